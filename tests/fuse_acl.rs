//! POSIX ACLs through the real kernel FUSE against a real `weed`: the mount negotiates
//! FUSE_POSIX_ACL, so the kernel enforces ACLs and caches them; the filesystem keeps modes in
//! sync and applies default-ACL inheritance. ACLs are written as raw xattr bytes (no setfacl).

mod common;
mod fuse_support;

use fuse_support::*;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

const ACCESS: &str = "system.posix_acl_access";
const DEFAULT: &str = "system.posix_acl_default";
const USER_OBJ: u16 = 1;
const USER: u16 = 2;
const GROUP_OBJ: u16 = 4;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
const NOBODY: u32 = 65534;
const STRANGER: u32 = 65533;

fn entries(b: &[u8]) -> Vec<(u16, u16, u32)> {
    assert_eq!(&b[..4], &[2, 0, 0, 0]);
    b[4..]
        .chunks_exact(8)
        .map(|c| {
            (
                u16::from_le_bytes([c[0], c[1]]),
                u16::from_le_bytes([c[2], c[3]]),
                u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            )
        })
        .collect()
}

fn mode(p: &Path) -> u32 {
    lstat(p).unwrap().st_mode & 0o7777
}

/// Whether `uid` (with only its own group) can read `p`, checked by a child process.
fn can_read_as(uid: u32, p: &Path) -> bool {
    Command::new("cat")
        .arg(p)
        .uid(uid)
        .gid(uid)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// Runs `script` under sh in `dir` (its own umask; the test process's is left alone).
fn sh(dir: &Path, script: &str) {
    let st = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .status()
        .unwrap();
    assert!(st.success(), "{script}");
}

#[test]
fn access_acl_is_enforced_and_kept_in_sync_with_the_mode() {
    let w = shared_server();
    let root = unique_path("acl");
    let m = mount_ours(&w, &root, &[]);
    let p = m.join("f");
    std::fs::write(&p, b"secret").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(!can_read_as(NOBODY, &p), "0600 root file");

    // user::rw- user:65534:r-- group::--- mask::r-- other::---
    let a = acl(&[
        (USER_OBJ, 6, u32::MAX),
        (USER, 4, NOBODY),
        (GROUP_OBJ, 0, u32::MAX),
        (MASK, 4, u32::MAX),
        (OTHER, 0, u32::MAX),
    ]);
    setxattr(&p, ACCESS, &a, 0).unwrap();
    assert_eq!(mode(&p), 0o640, "group bits show the mask");
    assert_eq!(
        entries(&getxattr(&p, ACCESS).unwrap())[1],
        (USER, 4, NOBODY)
    );
    assert!(can_read_as(NOBODY, &p), "the named user may read");
    assert!(!can_read_as(STRANGER, &p), "others may not");

    // chmod rewrites the ACL: owner, mask and other follow the mode; the named entry stays
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o604)).unwrap();
    let back = entries(&getxattr(&p, ACCESS).unwrap());
    assert_eq!(back[0], (USER_OBJ, 6, u32::MAX));
    assert_eq!(back[1], (USER, 4, NOBODY), "named entry kept");
    assert_eq!(back[3], (MASK, 0, u32::MAX));
    assert_eq!(back[4], (OTHER, 4, u32::MAX));
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(!can_read_as(NOBODY, &p), "masked out after chmod 0600");
    // chmod 0640: the mask is r-- again, so the named user (and only it) reads
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(
        entries(&getxattr(&p, ACCESS).unwrap())[3],
        (MASK, 4, u32::MAX)
    );
    assert!(can_read_as(NOBODY, &p), "named entry back in force");
    assert!(!can_read_as(STRANGER, &p));

    // an ACL the mode can express is not stored; the mode takes its bits
    let base = acl(&[
        (USER_OBJ, 6, u32::MAX),
        (GROUP_OBJ, 4, u32::MAX),
        (OTHER, 0, u32::MAX),
    ]);
    setxattr(&p, ACCESS, &base, 0).unwrap();
    assert_eq!(mode(&p), 0o640);
    assert_eq!(getxattr(&p, ACCESS).unwrap_err(), libc::ENODATA);
    assert!(!can_read_as(STRANGER, &p));

    // malformed ACLs are refused (by the kernel or by us) and change nothing
    assert_eq!(
        setxattr(&p, ACCESS, &a[..a.len() - 3], 0),
        Err(libc::EINVAL)
    );
    let no_mask = acl(&[
        (USER_OBJ, 6, u32::MAX),
        (USER, 4, NOBODY),
        (GROUP_OBJ, 0, u32::MAX),
        (OTHER, 0, u32::MAX),
    ]);
    assert_eq!(setxattr(&p, ACCESS, &no_mask, 0), Err(libc::EINVAL));
    assert_eq!(mode(&p), 0o640);

    // a default ACL only fits a directory
    assert_eq!(setxattr(&p, DEFAULT, &a, 0), Err(libc::EACCES));

    // stored on the filer: a second mount sees the ACL, the mode, and enforces them
    setxattr(&p, ACCESS, &a, 0).unwrap();
    let m2 = mount_ours(&w, &root, &[]);
    let p2 = m2.join("f");
    assert_eq!(mode(&p2), 0o640);
    assert_eq!(getxattr(&p2, ACCESS).unwrap(), a);
    assert!(can_read_as(NOBODY, &p2));
    assert!(!can_read_as(STRANGER, &p2));
}

#[test]
fn default_acl_is_inherited_and_umask_applies_without_one() {
    let w = shared_server();
    let m = mount_ours(&w, &unique_path("dacl"), &[]);
    let d = m.join("d");
    std::fs::create_dir(&d).unwrap();
    // default: user::rwx user:65534:rwx group::r-x mask::rwx other::---
    let def = acl(&[
        (USER_OBJ, 7, u32::MAX),
        (USER, 7, NOBODY),
        (GROUP_OBJ, 5, u32::MAX),
        (MASK, 7, u32::MAX),
        (OTHER, 0, u32::MAX),
    ]);
    setxattr(&d, DEFAULT, &def, 0).unwrap();
    assert_eq!(getxattr(&d, DEFAULT).unwrap(), def);
    assert_eq!(
        getxattr(&d, ACCESS).unwrap_err(),
        libc::ENODATA,
        "a default ACL leaves the directory's access ACL alone"
    );

    // umask 077 would give 0600/0700; under a default ACL it is ignored
    sh(&d, "umask 077 && echo x > f && mkdir s");
    let f = d.join("f");
    assert_eq!(mode(&f), 0o660, "0666 limited by the ACL, umask ignored");
    let fa = entries(&getxattr(&f, ACCESS).unwrap());
    assert_eq!(
        fa,
        vec![
            (USER_OBJ, 6, u32::MAX),
            (USER, 7, NOBODY),
            (GROUP_OBJ, 5, u32::MAX),
            (MASK, 6, u32::MAX),
            (OTHER, 0, u32::MAX),
        ]
    );
    assert_eq!(getxattr(&f, DEFAULT).unwrap_err(), libc::ENODATA);
    assert!(can_read_as(NOBODY, &f), "inherited named entry is enforced");
    assert!(!can_read_as(STRANGER, &f));

    let s = d.join("s");
    assert_eq!(mode(&s), 0o770);
    assert_eq!(
        entries(&getxattr(&s, ACCESS).unwrap())[3],
        (MASK, 7, u32::MAX)
    );
    assert_eq!(
        getxattr(&s, DEFAULT).unwrap(),
        def,
        "subdirectory inherits the default"
    );
    // and passes it on again
    sh(&s, "umask 077 && mkdir deeper");
    assert_eq!(getxattr(&s.join("deeper"), DEFAULT).unwrap(), def);
    // a symlink gets no ACL
    sh(&d, "ln -s f l");
    assert_eq!(lstat(&d.join("l")).unwrap().st_mode & 0o777, 0o777);

    // no default ACL: the umask applies (the kernel hands it to us with FUSE_DONT_MASK)
    sh(
        m.path(),
        "umask 022 && echo x > plain && mkdir pdir && mkfifo pfifo",
    );
    assert_eq!(mode(&m.join("plain")), 0o644);
    assert_eq!(mode(&m.join("pdir")), 0o755);
    assert_eq!(mode(&m.join("pfifo")), 0o644);
    sh(m.path(), "umask 027 && echo x > plain2");
    assert_eq!(mode(&m.join("plain2")), 0o640);
    assert_eq!(
        getxattr(&m.join("plain"), ACCESS).unwrap_err(),
        libc::ENODATA
    );

    // removing the default ACL stops inheritance
    let n = std::ffi::CString::new(DEFAULT).unwrap();
    check(unsafe { libc::removexattr(cpath(&d).as_ptr(), n.as_ptr()) }).unwrap();
    sh(&d, "umask 022 && echo x > after");
    assert_eq!(mode(&d.join("after")), 0o644);
    assert_eq!(
        getxattr(&d.join("after"), ACCESS).unwrap_err(),
        libc::ENODATA
    );
}

/// The kernel caches ACLs (including "none"): repeated reads of `system.posix_acl_access`
/// reach the filesystem at most once, while other xattrs go through every time. Counted with
/// the per-op FUSE metrics of an in-process mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kernel_caches_acls() {
    use seaweedfs_csi_driver::config::MountOptions;
    use seaweedfs_csi_driver::fuse::session::MountedVolume;
    use seaweedfs_csi_driver::security::SecurityConfig;

    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            if is_mounted(&self.0) {
                lazy_unmount(&self.0);
            }
        }
    }

    let w = tokio::task::spawn_blocking(shared_server).await.unwrap();
    let (_tmp, dir) = mount_dir("aclcache");
    let _guard = Unmount(dir.clone());
    let opts = MountOptions {
        filers: vec![w.filer_addr()],
        filer_path: unique_path("aclcache"),
        ..Default::default()
    };
    let vol = MountedVolume::mount(&opts, &SecurityConfig::default(), &dir)
        .await
        .unwrap();
    assert!(vol.fs.posix_acl(), "the kernel granted FUSE_POSIX_ACL");

    let d = dir.clone();
    let (acl_calls, other_calls, after_set, warm_ls) = tokio::task::spawn_blocking(move || {
        // the op is counted just after its reply is sent: let the last one land
        let count = || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let text = seaweedfs_csi_driver::metrics::global().render();
            text.lines()
                .filter_map(|l| {
                    l.strip_prefix(r#"seaweedfs_csi_fuse_op_seconds_count{op="getxattr","#)
                        .and_then(|rest| rest.rsplit_once(' '))
                        .and_then(|(_, v)| v.parse::<f64>().ok())
                })
                .sum::<f64>()
        };
        let p = d.join("f");
        std::fs::write(&p, b"x").unwrap();
        lstat(&p).unwrap();
        let c0 = count();
        for _ in 0..50 {
            assert_eq!(getxattr(&p, ACCESS).unwrap_err(), libc::ENODATA);
        }
        let c1 = count();
        for _ in 0..50 {
            assert_eq!(getxattr(&p, "user.none").unwrap_err(), libc::ENODATA);
        }
        let c2 = count();
        // a change through the mount drops the cached ACL: the new one is read back
        let a = acl(&[
            (USER_OBJ, 6, u32::MAX),
            (USER, 4, NOBODY),
            (GROUP_OBJ, 4, u32::MAX),
            (MASK, 4, u32::MAX),
            (OTHER, 0, u32::MAX),
        ]);
        setxattr(&p, ACCESS, &a, 0).unwrap();
        for _ in 0..20 {
            assert_eq!(getxattr(&p, ACCESS).unwrap(), a);
        }
        let c3 = count();
        // `ls -l` of a warm directory: the listing, the attributes and the ACLs come from the
        // kernel; without SELinux on the node the missing label answers EOPNOTSUPP once and
        // ls stops asking, so a warm listing makes (almost) no getxattr round trips at all
        let dir = d.join("many");
        std::fs::create_dir(&dir).unwrap();
        for i in 0..200 {
            std::fs::write(dir.join(format!("f{i}")), b"").unwrap();
        }
        let ls = || {
            let out = std::process::Command::new("ls")
                .arg("-l")
                .arg(&dir)
                .output()
                .unwrap();
            assert!(out.status.success());
            assert_eq!(out.stdout.iter().filter(|&&b| b == b'\n').count(), 201);
        };
        ls();
        let c4 = count();
        ls();
        let c5 = count();
        (c1 - c0, c2 - c1, c3 - c2, c5 - c4)
    })
    .await
    .unwrap();
    eprintln!(
        "FUSE getxattr calls: 50x acl -> {acl_calls}, 50x user.none -> {other_calls}, \
         set + 20x acl -> {after_set}, warm ls -l of 200 files -> {warm_ls}"
    );
    assert!(acl_calls <= 1.0, "ACL reads not cached: {acl_calls} calls");
    assert!(other_calls >= 50.0, "user.none: {other_calls}");
    assert!(after_set <= 1.0, "re-read after set: {after_set}");
    // Directory listings are no longer kept in the kernel across opens (a kept listing hid
    // names other nodes created), so a warm `ls -l` sends READDIRPLUS again, whose entries
    // drop each child's cached ACL: one ACL read per file, plus the SELinux label once when
    // SELinux is off. Bounded, but no longer ~0 (docs/BENCHMARKS.md).
    let files = 200.0;
    assert!(
        warm_ls <= files + 3.0,
        "warm ls -l: {warm_ls} getxattr calls for {files} files"
    );
    vol.unmount().await.unwrap();
}
