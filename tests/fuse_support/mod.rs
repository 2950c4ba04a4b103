//! Helpers for the FUSE integration tests: our `mount` command and `weed mount` as child
//! processes behind guards that always stop them (by pid) and detach their mounts, plus small
//! libc wrappers. Used with `mod common; mod fuse_support;`.
#![allow(dead_code)]

use crate::common::WeedServer;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_seaweedfs-csi-driver");

/// One `weed server` + filer shared by the tests of a binary while any of them runs; stopped
/// when the last user drops it.
pub fn shared_server() -> Arc<WeedServer> {
    static SERVER: Mutex<Weak<WeedServer>> = Mutex::new(Weak::new());
    let mut g = SERVER.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = g.upgrade() {
        return s;
    }
    let s = Arc::new(WeedServer::start());
    *g = Arc::downgrade(&s);
    s
}

/// A fresh filer path per test.
pub fn unique_path(tag: &str) -> String {
    format!("/t-{tag}-{}", crate::common::rand_suffix())
}

/// Whether `path` is a mount point (per /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let want = path.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mountinfo(mp) == want)
}

fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

pub fn lazy_unmount(path: &Path) {
    if let Ok(c) = CString::new(path.as_os_str().as_bytes()) {
        unsafe {
            libc::umount2(c.as_ptr(), libc::MNT_DETACH);
        }
    }
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn signal(pid: u32, sig: i32) {
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// Stops a child: `sig` first, SIGKILL after `grace`; always reaps. Returns whether it exited
/// by itself within the grace period.
pub fn stop_child(c: &mut Child, sig: i32, grace: Duration) -> bool {
    if let Ok(Some(_)) = c.try_wait() {
        return true;
    }
    signal(c.id(), sig);
    let clean = wait_until(grace, || matches!(c.try_wait(), Ok(Some(_))));
    if !clean {
        let _ = c.kill();
    }
    let _ = c.wait();
    clean
}

/// A mounted filesystem served by a child process (ours or `weed mount`). Dropping it stops the
/// process by pid (SIGTERM, then SIGKILL) and lazily unmounts whatever is left.
pub struct MountGuard {
    pub dir: PathBuf,
    child: Option<Child>,
    pub log: PathBuf,
    /// Temporary parent of `dir` (removed on drop).
    _tmp: Option<tempfile::TempDir>,
}

impl MountGuard {
    pub fn path(&self) -> &Path {
        &self.dir
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.dir.join(p)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM and wait for a clean exit; returns the exit status.
    pub fn unmount(mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        signal(c.id(), libc::SIGTERM);
        let done = wait_until(Duration::from_secs(30), || {
            matches!(c.try_wait(), Ok(Some(_)))
        });
        if !done {
            let _ = c.kill();
        }
        let st = c.wait().expect("wait");
        assert!(done, "mount process ignored SIGTERM: {}", self.log_text());
        st
    }

    /// SIGKILL the process, leaving its mount dead (the guard still cleans it up).
    pub fn kill9(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn take_child(&mut self) -> Option<Child> {
        self.child.take()
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c, libc::SIGTERM, Duration::from_secs(10));
        }
        if is_mounted(&self.dir) {
            lazy_unmount(&self.dir);
        }
    }
}

/// A mount point directory under /tmp whose parents are 0755 (other users can enter it).
pub fn mount_dir(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::Builder::new()
        .prefix(&format!("fusetest-{tag}-"))
        .tempdir_in("/tmp")
        .expect("tempdir");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().join("mnt");
    std::fs::create_dir(&dir).unwrap();
    (tmp, dir)
}

/// Spawns our `mount` command with `args` (plus `--dir`) and waits for the mount.
pub fn spawn_ours(filer: &str, filer_path: &str, dir: &Path, extra: &[&str]) -> MountGuard {
    spawn_ours_logging(filer, filer_path, dir, extra, &test_log_level())
}

/// The mount processes' `RUST_LOG`: `FUSE_TEST_LOG`, or `info`.
pub fn test_log_level() -> String {
    std::env::var("FUSE_TEST_LOG").unwrap_or_else(|_| "info".into())
}

/// [`spawn_ours`] with the mount process's `RUST_LOG`.
pub fn spawn_ours_logging(
    filer: &str,
    filer_path: &str,
    dir: &Path,
    extra: &[&str],
    rust_log: &str,
) -> MountGuard {
    let log = dir
        .parent()
        .unwrap_or(Path::new("/tmp"))
        .join(format!("mount-{}.log", crate::common::rand_suffix()));
    let f = std::fs::File::create(&log).unwrap();
    let child = Command::new(BIN)
        .arg("mount")
        .arg(format!("--filer={filer}"))
        .arg(format!("--filer.path={filer_path}"))
        .arg(format!("--dir={}", dir.display()))
        .args(extra)
        .env("RUST_LOG", rust_log)
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("spawn mount");
    let mut g = MountGuard {
        dir: dir.to_path_buf(),
        child: Some(child),
        log,
        _tmp: None,
    };
    g.wait_mounted();
    g
}

/// Our mount of `filer_path` on a fresh directory.
pub fn mount_ours(w: &WeedServer, filer_path: &str, extra: &[&str]) -> MountGuard {
    mount_ours_logging(w, filer_path, extra, &test_log_level())
}

/// [`mount_ours`] with the mount process's `RUST_LOG`.
pub fn mount_ours_logging(
    w: &WeedServer,
    filer_path: &str,
    extra: &[&str],
    rust_log: &str,
) -> MountGuard {
    let (tmp, dir) = mount_dir("ours");
    let mut g = spawn_ours_logging(&w.filer_addr(), filer_path, &dir, extra, rust_log);
    g._tmp = Some(tmp);
    g
}

/// A real `weed mount` of `filer_path` on a fresh directory.
pub fn mount_weed(w: &WeedServer, filer_path: &str) -> MountGuard {
    let (tmp, dir) = mount_dir("weed");
    let log = tmp.path().join("weed-mount.log");
    let f = std::fs::File::create(&log).unwrap();
    let cache = tmp.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    let child = Command::new(std::env::var("WEED_BIN").unwrap_or_else(|_| "weed".into()))
        .current_dir(tmp.path())
        .arg("mount")
        .arg(format!("-filer={}", w.filer_addr()))
        .arg(format!("-filer.path={filer_path}"))
        .arg(format!("-dir={}", dir.display()))
        .arg(format!("-cacheDir={}", cache.display()))
        .arg(format!(
            "-localSocket={}",
            tmp.path().join("weed-mount.sock").display()
        ))
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("spawn weed mount");
    let mut g = MountGuard {
        dir,
        child: Some(child),
        log,
        _tmp: Some(tmp),
    };
    g.wait_mounted();
    g
}

impl MountGuard {
    fn wait_mounted(&mut self) {
        let dir = self.dir.clone();
        let mut exited = None;
        let ok = wait_until(Duration::from_secs(30), || {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    exited = Some(st);
                    return true;
                }
            }
            is_mounted(&dir)
        });
        if let Some(st) = exited {
            panic!("mount process exited early ({st}): {}", self.log_text());
        }
        if !ok {
            // where the process waits (its threads' kernel wait channels)
            let pid = self.child.as_ref().map(|c| c.id()).unwrap_or(0);
            let mut waits = String::new();
            if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
                for t in tasks.flatten() {
                    let read =
                        |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
                    waits += &format!("{} {}\n", read("comm").trim(), read("wchan").trim());
                    waits += &read("stack");
                }
            }
            panic!(
                "not mounted within 30 s: {}\nthreads:\n{waits}",
                self.log_text()
            );
        }
    }
}

// ---------- small libc wrappers ----------

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `Err(errno)` when `r` is -1.
pub fn check(r: libc::c_int) -> Result<libc::c_int, i32> {
    if r == -1 {
        Err(errno())
    } else {
        Ok(r)
    }
}

pub fn lstat(p: &Path) -> Result<libc::stat, i32> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    check(unsafe { libc::lstat(cpath(p).as_ptr(), &mut st) })?;
    Ok(st)
}

pub fn fstat(fd: libc::c_int) -> Result<libc::stat, i32> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    check(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

/// Deterministic pseudo-random bytes (xorshift), so failures are reproducible.
pub fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Async filer client for checking what reached the filer.
pub fn filer_client(
    rt: &tokio::runtime::Runtime,
    w: &WeedServer,
) -> seaweedfs_csi_driver::filer::grpc::GrpcFiler {
    use seaweedfs_csi_driver::filer::grpc::{FilerClientOptions, GrpcFiler};
    rt.block_on(GrpcFiler::connect(FilerClientOptions {
        addresses: vec![w.filer_addr()],
        call_timeout: Duration::from_secs(20),
        ..Default::default()
    }))
    .expect("filer client")
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Reads a whole file, retrying `timeout` until `pred` holds (for cross-mount coherence).
pub fn eventually_reads(
    p: &Path,
    timeout: Duration,
    pred: impl Fn(&[u8]) -> bool,
) -> Option<Vec<u8>> {
    let mut last = None;
    let ok = wait_until(timeout, || match std::fs::read(p) {
        Ok(b) => {
            let good = pred(&b);
            last = Some(b);
            good
        }
        Err(_) => false,
    });
    if ok {
        last
    } else {
        None
    }
}

pub fn setxattr(p: &Path, name: &str, v: &[u8], flags: i32) -> Result<(), i32> {
    let n = CString::new(name).unwrap();
    check(unsafe {
        libc::setxattr(
            cpath(p).as_ptr(),
            n.as_ptr(),
            v.as_ptr().cast(),
            v.len(),
            flags,
        )
    })
    .map(|_| ())
}

/// One getxattr(2) call into a buffer of the largest xattr size (one kernel request at most).
pub fn getxattr(p: &Path, name: &str) -> Result<Vec<u8>, i32> {
    let n = CString::new(name).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    let got = unsafe {
        libc::getxattr(
            cpath(p).as_ptr(),
            n.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if got < 0 {
        return Err(errno());
    }
    buf.truncate(got as usize);
    Ok(buf)
}

/// A POSIX ACL in its xattr form: version 2, then {tag, perm, id} little-endian.
pub fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut b = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        b.extend_from_slice(&tag.to_le_bytes());
        b.extend_from_slice(&perm.to_le_bytes());
        b.extend_from_slice(&id.to_le_bytes());
    }
    b
}
