//! The node DaemonSet's update strategy (deploy/: RollingUpdate, maxSurge 1, maxUnavailable 0,
//! keeper in its own pod) played with real processes: a keeper, an old plugin serving a staged
//! and published FUSE volume, then the "surge" pod's plugin started on the same CSI socket and
//! keeper while the old one still runs, then the old one stopped as the DaemonSet controller
//! does once the new pod is Ready. The published mount must keep working throughout and the
//! new process must end up serving both the CSI socket and the FUSE session.

mod common;
mod csi_common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csi_common::*;
use seaweedfs_csi_driver::pb::csi::NodeGetInfoRequest;

/// A process of the binary, killed by pid on drop.
struct Proc {
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    fn spawn(args: &[String], log: &Path) -> Proc {
        let f = std::fs::File::create(log).unwrap();
        let child = Command::new(driver_bin())
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(f)
            .spawn()
            .expect("spawn the binary");
        Proc {
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        terminate_child(self.child.take()?)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), self.log());
        }
    }
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

// The new plugin takes the CSI endpoint over while the old one still runs (maxSurge: 1), then
// adopts the sessions once the old one has handed them over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn surge_rollout_hands_the_mounts_over() {
    let weed = tokio::task::spawn_blocking(common::WeedServer::start)
        .await
        .unwrap();
    let dir = tempfile::Builder::new()
        .prefix("handover")
        .tempdir()
        .unwrap();
    let keeper_sock = dir.path().join("keeper/keeper.sock");
    std::fs::create_dir_all(keeper_sock.parent().unwrap()).unwrap();
    let mut keeper = Proc::spawn(
        &[
            "keeper".into(),
            format!("--socket={}", keeper_sock.display()),
        ],
        &dir.path().join("keeper.log"),
    );
    wait_for("the keeper socket", Duration::from_secs(10), || {
        keeper_sock.exists()
    });

    let socket = dir.path().join("plugin/csi.sock");
    let args = vec![
        format!("--endpoint=unix://{}", socket.display()),
        format!("--filer={}", weed.filer_addr()),
        "--nodeid=node-1".to_string(),
        format!("--keeperSocket={}", keeper_sock.display()),
        "--logLevel=info".to_string(),
    ];
    let log_dir = dir.path().to_path_buf();
    let mut old = Driver::start_raw(dir, socket.clone(), Stager::Fuse, args.clone(), vec![]);

    // A volume staged on this node and published into a pod, with data in it.
    let pod = old.provision_and_publish("pvc-handover", "pod-a").await;
    let (vol, target) = (&pod.vol, &pod.target);
    std::fs::write(target.join("before.txt"), b"written before the rollout").unwrap();
    // A directory with a default ACL: inheritance after the adoption shows that the new process
    // knows the kernel enforces ACLs (FUSE_POSIX_ACL agreed by the old one).
    let acl_dir = target.join("acl");
    std::fs::create_dir(&acl_dir).unwrap();
    set_default_acl(&acl_dir);

    // The surge pod: a second plugin on the same node, same CSI socket path, same keeper.
    let mut new = Proc::spawn(&args, &log_dir.join("new.log"));
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        new.running(),
        "the new plugin must wait for the old one to leave the socket, not exit (its pod would \
         never turn Ready and the rollout would stall):\n{}",
        new.log()
    );
    // Meanwhile pods keep working on the old process.
    assert_eq!(
        std::fs::read(target.join("before.txt")).unwrap(),
        b"written before the rollout"
    );

    // The new pod is Ready: the DaemonSet controller deletes the old one.
    let status = old.terminate().expect("old plugin was running");
    assert!(status.success(), "old plugin exited with {status}");

    wait_for(
        "the new plugin to adopt the session and serve the socket",
        Duration::from_secs(30),
        || {
            new.log().contains("session adopted")
                && std::os::unix::net::UnixStream::connect(&socket).is_ok()
        },
    );
    assert!(new.running(), "{}", new.log());
    // The pod's mount never changed and works, reads and writes.
    assert_eq!(
        std::fs::read(target.join("before.txt")).unwrap(),
        b"written before the rollout"
    );
    std::fs::write(target.join("after.txt"), b"written after the rollout").unwrap();
    let st = Command::new("sh")
        .arg("-c")
        .arg("umask 077 && echo x > inherited")
        .current_dir(&acl_dir)
        .status()
        .unwrap();
    assert!(st.success());
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(acl_dir.join("inherited")).unwrap();
    assert_eq!(
        md.mode() & 0o777,
        0o660,
        "default ACL inherited (umask ignored) by the adopting process"
    );
    assert_eq!(
        weed.filer_get(&format!("{}/after.txt", vol.volume_id))
            .unwrap(),
        b"written after the rollout"
    );

    // kubelet's next calls reach the new process, which knows the volume.
    let c = Clients::connect(&socket).await;
    c.node
        .clone()
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap();
    pod.unpublish_and_unstage(&c).await;
    assert!(old.mounts().is_empty(), "mounts left: {:?}", old.mounts());
    assert!(
        socket.exists(),
        "the old plugin removed the new one's socket"
    );

    let st = new.terminate().unwrap();
    assert!(st.success(), "new plugin exited with {st}:\n{}", new.log());
    // Nothing held any more: the keeper drains and exits on SIGTERM.
    let st = keeper.terminate().unwrap();
    assert!(st.success(), "keeper exited with {st}:\n{}", keeper.log());
}

/// Sets `user::rwx user:65534:rwx group::r-x mask::rwx other::---` as `dir`'s default ACL
/// (the raw xattr form).
fn set_default_acl(dir: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in [
        (1u16, 7u16, u32::MAX),
        (2, 7, 65534),
        (4, 5, u32::MAX),
        (0x10, 7, u32::MAX),
        (0x20, 0, u32::MAX),
    ] {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    let p = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new("system.posix_acl_default").unwrap();
    let r = unsafe { libc::setxattr(p.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}
