//! SLOW TEST (release build of the static binary, several minutes the first time).
//!
//! The container image is `FROM scratch` plus one static binary (Dockerfile). No container
//! engine runs here, so this proves the same thing without one: it builds the binary exactly
//! as the Dockerfile does (scripts/build-static.sh), puts it ALONE into an empty root together
//! with what a container runtime and the node DaemonSet provide (/dev/fuse and /dev/null from
//! the host's /dev, /proc, kubelet's /etc/hosts and /etc/resolv.conf, an empty /tmp), chroots
//! into it with an empty environment and runs `--version`, `--help` and a real `mount` against a
//! real weed server on 127.0.0.1 (the chroot shares the network namespace). The filer is named
//! by a host name from the chroot's /etc/hosts, so name resolution of the static binary is
//! exercised too. Every mount and process is cleaned up on failure.

mod common;

use std::ffi::CString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Builds (or reuses) the static release binary and installs the image's copy (debug info
/// stripped) at `dest`; `arch` cross-compiles for another architecture.
fn build_static(dest: &Path, arch: Option<&str>) -> PathBuf {
    let mut cmd = Command::new("bash");
    // `cargo test` puts CARGO_PKG_* and friends into this process's environment; build scripts
    // that watch such variables would then see a change and rebuild everything. Build with the
    // environment a shell (or the Dockerfile) has.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().to_string();
        if (k == "CARGO" || k.starts_with("CARGO_") || k.starts_with("RUSTC") || k == "OUT_DIR")
            && k != "CARGO_HOME"
            && k != "CARGO_TARGET_DIR"
        {
            cmd.env_remove(&k);
        }
    }
    cmd.arg(repo().join("scripts/build-static.sh"));
    if let Some(arch) = arch {
        cmd.args(["--arch", arch]);
    }
    let out = cmd
        .arg("--out")
        .arg(dest)
        .current_dir(repo())
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/build-static.sh");
    assert!(out.status.success(), "static build failed");
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert_eq!(path, dest);
    assert!(path.is_file(), "no binary at {}", path.display());
    path
}

/// Loopback address of the test's DNS server (the resolver only speaks to port 53).
const DNS_ADDR: &str = "127.0.0.77";

/// A tiny DNS server standing in for cluster DNS: A records for `names` point at 127.0.0.1,
/// AAAA queries get an empty answer, everything else NXDOMAIN. Stops when dropped.
struct Dns {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    answered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dns {
    fn start(names: &[&str]) -> Dns {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        let sock = std::net::UdpSocket::bind((DNS_ADDR, 53)).expect("bind DNS on 127.0.0.77:53");
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let names: Vec<String> = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let (st, an) = (stop.clone(), answered.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while !st.load(Ordering::Relaxed) {
                let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(reply) = dns_reply(&buf[..n], &names) {
                    if reply.1 {
                        an.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = sock.send_to(&reply.0, peer);
                }
            }
        });
        Dns {
            stop,
            answered,
            thread: Some(thread),
        }
    }

    fn answered(&self) -> usize {
        self.answered.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// (reply, whether it carried an A record) for one query packet.
fn dns_reply(q: &[u8], names: &[String]) -> Option<(Vec<u8>, bool)> {
    if q.len() < 17 {
        return None;
    }
    let mut i = 12;
    let mut labels = Vec::new();
    while i < q.len() && q[i] != 0 {
        let l = q[i] as usize;
        labels.push(String::from_utf8_lossy(q.get(i + 1..i + 1 + l)?).to_ascii_lowercase());
        i += 1 + l;
    }
    let qtype = u16::from_be_bytes([*q.get(i + 1)?, *q.get(i + 2)?]);
    let question = q.get(12..i + 5)?;
    let name = labels.join(".");
    let known = names.contains(&name);
    let a = known && qtype == 1;
    let rcode = if known { 0 } else { 3 };
    let mut r = Vec::with_capacity(64);
    r.extend_from_slice(&q[0..2]);
    r.extend_from_slice(&(0x8180u16 | rcode).to_be_bytes());
    r.extend_from_slice(&1u16.to_be_bytes());
    r.extend_from_slice(&(a as u16).to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0]);
    r.extend_from_slice(question);
    if a {
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4, 127, 0, 0, 1]);
    }
    Some((r, a))
}

fn is_mounted(path: &Path) -> bool {
    let want = path.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
}

fn umount_lazy(path: &Path) {
    if let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) {
        unsafe {
            libc::umount2(c.as_ptr(), libc::MNT_DETACH);
        }
    }
}

/// The empty root: removes itself and everything mounted in it, and kills what runs in it.
struct Root {
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Root {
    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn new(binary: &Path) -> Root {
        let dir = tempfile::Builder::new()
            .prefix("scratch-root")
            .tempdir()
            .unwrap();
        let r = Root { dir, child: None };
        let p = r.path();
        std::fs::copy(binary, p.join("seaweedfs-csi-driver")).unwrap();
        std::fs::set_permissions(
            p.join("seaweedfs-csi-driver"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        for d in ["dev", "proc", "etc", "mnt"] {
            std::fs::create_dir(p.join(d)).unwrap();
        }
        std::fs::create_dir(p.join("tmp")).unwrap();
        std::fs::set_permissions(p.join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
        // The node DaemonSet mounts the host's /dev; these two nodes are what the binary uses.
        for (name, major, minor) in [("fuse", 10, 229), ("null", 1, 3)] {
            let c = CString::new(p.join("dev").join(name).as_os_str().as_encoded_bytes()).unwrap();
            let rc = unsafe {
                libc::mknod(
                    c.as_ptr(),
                    libc::S_IFCHR | 0o666,
                    libc::makedev(major, minor),
                )
            };
            assert_eq!(
                rc,
                0,
                "mknod /dev/{name}: {}",
                std::io::Error::last_os_error()
            );
        }
        // What kubelet writes into every container: cluster DNS with the pod's search domains.
        std::fs::write(p.join("etc/hosts"), "127.0.0.1\tlocalhost\n").unwrap();
        std::fs::write(
            p.join("etc/resolv.conf"),
            format!(
                "search seaweedfs.svc.cluster.test svc.cluster.test\nnameserver {DNS_ADDR}\n\
                 options ndots:5\n"
            ),
        )
        .unwrap();
        let proc_dir = CString::new(p.join("proc").as_os_str().as_encoded_bytes()).unwrap();
        let rc = unsafe {
            libc::mount(
                c"proc".as_ptr(),
                proc_dir.as_ptr(),
                c"proc".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "mount proc: {}", std::io::Error::last_os_error());
        r
    }

    /// A command that runs `/seaweedfs-csi-driver args...` chrooted into the root, with an
    /// empty environment (a scratch image has no PATH, HOME, ...).
    fn command(&self, args: &[&str]) -> Command {
        let root = CString::new(self.path().as_os_str().as_encoded_bytes()).unwrap();
        let mut cmd = Command::new("/seaweedfs-csi-driver");
        cmd.args(args).env_clear().current_dir("/");
        unsafe {
            cmd.pre_exec(move || {
                if libc::chroot(root.as_ptr()) != 0 || libc::chdir(c"/".as_ptr()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }

    fn run(&self, args: &[&str]) -> (bool, String) {
        let out = self.command(args).output().expect("spawn in chroot");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// Files in the root other than the mount points and the ones this test put there.
    fn unexpected_files(&self) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(self.path()).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().to_string();
            if !["seaweedfs-csi-driver", "dev", "proc", "etc", "mnt", "tmp"]
                .contains(&name.as_str())
            {
                out.push(name);
            }
        }
        out
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            common::kill_child(&mut c);
        }
        for d in ["mnt", "proc"] {
            let p = self.path().join(d);
            for _ in 0..3 {
                if !is_mounted(&p) {
                    break;
                }
                umount_lazy(&p);
            }
        }
    }
}

#[test]
fn scratch_image_runs_and_mounts_slow() {
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "needs root (chroot, mknod, mount)"
    );
    let image = tempfile::tempdir().unwrap();
    let binary = build_static(&image.path().join("seaweedfs-csi-driver"), None);

    // Static for real: the kernel runs it without any loader or library present.
    let elf = Command::new("readelf")
        .arg("-lW")
        .arg(&binary)
        .output()
        .unwrap();
    let elf = String::from_utf8_lossy(&elf.stdout);
    assert!(!elf.contains("INTERP"), "binary has a program interpreter");

    let weed = common::WeedServer::start();
    // The filer is addressed like a Kubernetes Service ("seaweedfs-filer" in the pod's
    // namespace), resolved through the search domains by the test's DNS server.
    let dns = Dns::start(&["seaweedfs-filer.seaweedfs.svc.cluster.test"]);
    let mut root = Root::new(&binary);

    let (ok, out) = root.run(&["--version"]);
    assert!(ok, "--version failed in the empty root: {out}");
    assert!(out.contains(env!("CARGO_PKG_VERSION")), "{out}");
    let (ok, out) = root.run(&["--help"]);
    assert!(ok, "--help failed: {out}");
    assert!(out.contains("mount"), "{out}");
    // the shipped binary has product commands only: no test seams
    assert!(
        !out.contains("memfs") && !out.contains("fakeStager"),
        "{out}"
    );
    let (ok, out) = root.run(&["mount", "--help"]);
    assert!(ok && out.contains("--filer"), "{out}");

    // A file that exists on the filer before the mount, to read through it.
    let seeded: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    weed.filer_put("/scratch/seeded.bin", &seeded, "");

    let log_path = weed.path().join("chroot-mount.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let filer = format!("seaweedfs-filer:{}", weed.filer_port);
    let child = root
        .command(&[
            "mount",
            &format!("--filer={filer}"),
            "--filer.path=/scratch",
            "--dir=/mnt",
        ])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn mount in chroot");
    root.child = Some(child);
    let mnt = root.path().join("mnt");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_mounted(&mnt) {
        if let Some(st) = root.child.as_mut().unwrap().try_wait().unwrap() {
            panic!(
                "mount exited with {st} before mounting:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "not mounted after 30 s:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    assert!(
        dns.answered() > 0,
        "the filer name was not resolved through DNS"
    );
    // Read what the filer had; write a multi-chunk file (uploads go from inside the chroot to
    // the volume server) and read it back, then check the filer has it.
    assert_eq!(std::fs::read(mnt.join("seeded.bin")).unwrap(), seeded);
    let data: Vec<u8> = (0..5u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    std::fs::write(mnt.join("written.bin"), &data).unwrap();
    let mut back = Vec::new();
    std::fs::File::open(mnt.join("written.bin"))
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert!(back == data, "read back differs");
    assert_eq!(weed.filer_get("/scratch/written.bin").unwrap(), data);
    let names: Vec<String> = std::fs::read_dir(&mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(
        names.contains(&"written.bin".to_string()) && names.contains(&"seeded.bin".to_string())
    );

    // SIGTERM: the command unmounts and exits cleanly.
    let status = sigterm_and_wait(&mut root.child, Duration::from_secs(20), "mount");
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(status.success(), "mount exited with {status}:\n{log}");
    assert!(!is_mounted(&mnt), "still mounted after exit:\n{log}");
    assert!(
        root.unexpected_files().is_empty(),
        "{:?}",
        root.unexpected_files()
    );
    println!(
        "static binary {} bytes; chroot mount log:\n{log}",
        std::fs::metadata(&binary).unwrap().len()
    );
}

/// The aarch64 build: cross-compiled by the same script (Debian's cross gcc, scripts/cross-deps.sh
/// installs it), static, and run under qemu-user: it prints the native build's version and
/// exactly the native build's help (same commands and flags), and mounts a real filer.
#[test]
fn aarch64_static_binary_runs_under_qemu_slow() {
    let qemu = "qemu-aarch64";
    assert!(
        Command::new(qemu).arg("--version").output().is_ok(),
        "{qemu} is missing: scripts/cross-deps.sh installs it (and the cross toolchain)"
    );
    let dir = tempfile::tempdir().unwrap();
    let binary = build_static(&dir.path().join("seaweedfs-csi-driver"), Some("aarch64"));

    let header = Command::new("readelf")
        .arg("-hlW")
        .arg(&binary)
        .output()
        .unwrap();
    let header = String::from_utf8_lossy(&header.stdout);
    assert!(
        header.contains("AArch64"),
        "not an aarch64 binary:\n{header}"
    );
    assert!(
        !header.contains("INTERP"),
        "binary has a program interpreter"
    );

    let native = env!("CARGO_BIN_EXE_seaweedfs-csi-driver");
    let run = |program: &str, args: &[&str]| {
        let out = Command::new(program)
            .args(args)
            .env_clear()
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let bin = binary.to_str().unwrap();
    for args in [&["--version"][..], &["--help"], &["mount", "--help"]] {
        let mut emulated = vec![bin];
        emulated.extend_from_slice(args);
        let arm = run(qemu, &emulated);
        assert_eq!(
            arm,
            run(native, args),
            "{args:?} differs from the native build"
        );
    }
    assert!(run(qemu, &[bin, "--version"]).contains(env!("CARGO_PKG_VERSION")));

    // A real mount by the emulated binary: FUSE, gRPC to the filer and HTTP uploads.
    let weed = common::WeedServer::start();
    let seeded: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    weed.filer_put("/arm/seeded.bin", &seeded, "");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let log_path = dir.path().join("mount.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = Command::new(qemu)
        .args([
            bin,
            "mount",
            &format!("--filer={}", weed.filer_addr()),
            "--filer.path=/arm",
            &format!("--dir={}", mnt.display()),
        ])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn the emulated mount");
    let mut guard = MountChild {
        child: Some(child),
        mnt: mnt.clone(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !is_mounted(&mnt) {
        let exited = guard.child.as_mut().unwrap().try_wait().unwrap();
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        assert!(exited.is_none(), "mount exited before mounting:\n{log}");
        assert!(Instant::now() < deadline, "not mounted after 60 s:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(std::fs::read(mnt.join("seeded.bin")).unwrap(), seeded);
    let data: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    std::fs::write(mnt.join("written.bin"), &data).unwrap();
    assert!(std::fs::read(mnt.join("written.bin")).unwrap() == data);
    assert!(
        weed.filer_get("/arm/written.bin").unwrap() == data,
        "the filer has other bytes"
    );

    let status = sigterm_and_wait(
        &mut guard.child,
        Duration::from_secs(30),
        "the emulated mount",
    );
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(status.success(), "mount exited with {status}:\n{log}");
    assert!(!is_mounted(&mnt), "still mounted after exit:\n{log}");
}

/// Sends SIGTERM to the child in `slot` and waits for its exit. If it has not exited within
/// `within`, the child goes back into `slot` (whose owner kills it on drop) and the test fails.
fn sigterm_and_wait(
    slot: &mut Option<Child>,
    within: Duration,
    what: &str,
) -> std::process::ExitStatus {
    let mut child = slot.take().expect("a running child");
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            *slot = Some(child);
            panic!("{what} did not exit within {within:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A mount process the test started: killed and its mount point detached if the test fails.
struct MountChild {
    child: Option<Child>,
    mnt: PathBuf,
}

impl Drop for MountChild {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            common::kill_child(&mut c);
        }
        if is_mounted(&self.mnt) {
            umount_lazy(&self.mnt);
        }
    }
}
