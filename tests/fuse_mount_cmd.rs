//! The standalone `seaweedfs-csi-driver mount` command: refuses bad mount points and startup
//! failures with a clear message and a non-zero exit, never leaves a mount behind, unmounts
//! cleanly on SIGTERM/SIGINT, and a SIGKILLed mount is cleaned up by the guard.

mod common;
mod fuse_support;

use fuse_support::*;
use std::fs;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Runs the mount command expecting it to fail on its own; returns its output.
fn run_failing(args: &[String], limit: Duration) -> Output {
    let mut c = Command::new(BIN)
        .arg("mount")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let done = wait_until(limit, || matches!(c.try_wait(), Ok(Some(_))));
    if !done {
        stop_child(&mut c, libc::SIGKILL, Duration::from_secs(1));
        panic!("mount did not give up within {limit:?}");
    }
    let out = c.wait_with_output().unwrap();
    eprintln!("exited after {:?}", started.elapsed());
    out
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn refuses_missing_and_non_empty_mount_points() {
    let w = shared_server();
    let (tmp, _) = mount_dir("mp");
    let missing = tmp.path().join("missing");
    let out = run_failing(
        &[
            format!("--filer={}", w.filer_addr()),
            format!("--dir={}", missing.display()),
        ],
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));
    assert!(!missing.exists());

    // a regular file is not a mount point
    let file = tmp.path().join("file");
    fs::write(&file, b"x").unwrap();
    let out = run_failing(
        &[
            format!("--filer={}", w.filer_addr()),
            format!("--dir={}", file.display()),
        ],
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not a directory"), "{}", stderr(&out));

    // non-empty
    let full = tmp.path().join("full");
    fs::create_dir(&full).unwrap();
    fs::write(full.join("x"), b"x").unwrap();
    let out = run_failing(
        &[
            format!("--filer={}", w.filer_addr()),
            format!("--dir={}", full.display()),
        ],
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not empty"), "{}", stderr(&out));
    assert!(!is_mounted(&full));

    // ...unless asked for
    let root = unique_path("mp");
    let m = spawn_ours(&w.filer_addr(), &root, &full, &["--nonempty"]);
    assert!(is_mounted(&full));
    fs::write(full.join("inside"), b"1").unwrap();
    assert_eq!(w.filer_get(&format!("{root}/inside")).unwrap(), b"1");
    assert!(m.unmount().success());
    assert!(!is_mounted(&full));
    assert_eq!(
        fs::read(full.join("x")).unwrap(),
        b"x",
        "the hidden file is back"
    );

    // --dirAutoCreate creates the mount point
    let m = spawn_ours(&w.filer_addr(), &root, &missing, &["--dirAutoCreate"]);
    assert!(is_mounted(&missing));
    assert_eq!(fs::read(missing.join("inside")).unwrap(), b"1");
    drop(m);
    assert!(!is_mounted(&missing));
}

#[test]
fn startup_errors_exit_non_zero_without_a_mount() {
    let w = shared_server();
    let (_tmp, dir) = mount_dir("startup");
    // nothing listens on this port
    let port = common::free_port_pair();
    let out = run_failing(
        &[
            format!("--filer=127.0.0.1:{port}"),
            format!("--dir={}", dir.display()),
        ],
        Duration::from_secs(60),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("filer"), "{}", stderr(&out));
    assert!(!is_mounted(&dir));
    // the remote root is a file
    w.filer_put("/not-a-dir", b"file", "");
    let out = run_failing(
        &[
            format!("--filer={}", w.filer_addr()),
            "--filer.path=/not-a-dir".to_string(),
            format!("--dir={}", dir.display()),
        ],
        Duration::from_secs(60),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not a directory"), "{}", stderr(&out));
    assert!(!is_mounted(&dir));
    // bad flags
    let out = run_failing(
        &[
            format!("--filer={}", w.filer_addr()),
            format!("--dir={}", dir.display()),
            "--umask=9z".to_string(),
        ],
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("umask"), "{}", stderr(&out));
    assert!(!is_mounted(&dir));
    // a missing remote root is created
    let root = unique_path("created");
    let m = spawn_ours(&w.filer_addr(), &root, &dir, &[]);
    fs::write(m.join("f"), b"x").unwrap();
    assert_eq!(w.filer_get(&format!("{root}/f")).unwrap(), b"x");
}

#[test]
fn signals_unmount_cleanly_and_flush() {
    let w = shared_server();
    let root = unique_path("sig");
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let (_tmp, dir) = mount_dir("sig");
        let mut m = spawn_ours(&w.filer_addr(), &root, &dir, &[]);
        fs::write(m.join(format!("f{sig}")), b"data").unwrap();
        let mut child = m.take_child().unwrap();
        unsafe {
            libc::kill(child.id() as i32, sig);
        }
        let done = wait_until(Duration::from_secs(30), || {
            matches!(child.try_wait(), Ok(Some(_)))
        });
        assert!(done, "exit on signal {sig}");
        let st = child.wait().unwrap();
        assert!(st.success(), "signal {sig}: {st}: {}", m.log_text());
        assert!(!is_mounted(&dir), "unmounted after signal {sig}");
        assert_eq!(w.filer_get(&format!("{root}/f{sig}")).unwrap(), b"data");
        drop(m);
    }
}

#[test]
fn an_unmount_from_outside_ends_the_mount_command() {
    let w = shared_server();
    let root = unique_path("umount");
    let (_tmp, dir) = mount_dir("umount");
    let mut m = spawn_ours(&w.filer_addr(), &root, &dir, &[]);
    fs::write(m.join("f"), b"data").unwrap();
    let mut child = m.take_child().unwrap();
    let st = Command::new("umount").arg(&dir).status().unwrap();
    assert!(st.success(), "umount {}", dir.display());
    let done = wait_until(Duration::from_secs(20), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !done {
        stop_child(&mut child, libc::SIGKILL, Duration::from_secs(1));
    }
    assert!(
        done,
        "the mount command must exit after its mount went away"
    );
    let st = child.wait().unwrap();
    assert!(st.success(), "{st}: {}", m.log_text());
    assert_eq!(w.filer_get(&format!("{root}/f")).unwrap(), b"data");
    drop(m);
}

/// xfstests' cycle mounts: unmounted from outside and at once mounted again at the same
/// path, where the new mount usually gets the old one's connection id (a device minor). The
/// old mount command, exiting, must leave the new mount alone.
#[test]
fn a_new_mount_at_the_path_survives_the_old_mount_command_exiting() {
    let w = shared_server();
    let root = unique_path("remount");
    let (_tmp, dir) = mount_dir("remount");
    for round in 0..3 {
        let mut old = spawn_ours(&w.filer_addr(), &root, &dir, &[]);
        let mut old_child = old.take_child().unwrap();
        let st = Command::new("umount").arg(&dir).status().unwrap();
        assert!(st.success(), "umount {}", dir.display());
        let new = spawn_ours(&w.filer_addr(), &root, &dir, &[]);
        let exited = wait_until(Duration::from_secs(20), || {
            matches!(old_child.try_wait(), Ok(Some(_)))
        });
        if !exited {
            stop_child(&mut old_child, libc::SIGKILL, Duration::from_secs(1));
        }
        assert!(exited, "round {round}: the old mount command exits");
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            is_mounted(&dir),
            "round {round}: the new mount was taken down: {}",
            old.log_text()
        );
        fs::write(new.join(format!("r{round}")), b"x").unwrap();
        drop(new);
        drop(old);
    }
}

#[test]
fn sigkill_leaves_a_dead_mount_that_the_guard_removes() {
    let w = shared_server();
    let root = unique_path("kill");
    let (_tmp, dir) = mount_dir("kill");
    let mut m = spawn_ours(&w.filer_addr(), &root, &dir, &[]);
    fs::write(m.join("f"), b"x").unwrap();
    m.kill9();
    // the kernel mount stays, dead
    assert!(is_mounted(&dir));
    let e = fs::metadata(dir.join("f")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");
    // a new mount on the dead mount point is refused with a clear message
    let out = run_failing(
        &[
            format!("--filer={}", w.filer_addr()),
            format!("--filer.path={root}"),
            format!("--dir={}", dir.display()),
        ],
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("dead mount") || stderr(&out).contains("not connected"),
        "{}",
        stderr(&out)
    );
    drop(m);
    assert!(!is_mounted(&dir), "the guard detached the dead mount");
    // and the directory can be mounted again
    let m = spawn_ours(&w.filer_addr(), &root, &dir, &[]);
    assert_eq!(fs::read(m.join("f")).unwrap(), b"x");
}

#[test]
fn read_only_mount() {
    let w = shared_server();
    let root = unique_path("ro");
    w.filer_put(&format!("{root}/existing"), b"content", "");
    let m = mount_ours(&w, &root, &["--readOnly"]);
    assert_eq!(fs::read(m.join("existing")).unwrap(), b"content");
    let e = fs::write(m.join("new"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    let e = fs::OpenOptions::new()
        .write(true)
        .open(m.join("existing"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    assert_eq!(
        fs::remove_file(m.join("existing"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EROFS)
    );
    assert_eq!(
        fs::create_dir(m.join("d")).unwrap_err().raw_os_error(),
        Some(libc::EROFS)
    );
}
