//! Upload and filer failures surface as errors on our FUSE mount, and the mount recovers.
//!
//! Alone in its own test binary on purpose: while the filer is down, this test holds a file
//! open whose flush cannot finish. A `Command::spawn` by any other test in the same process
//! forks a child that inherits that fd; closing it at exec sends FUSE_FLUSH, which waits for
//! the filer, so the other test's child hangs before it ever runs (seen as "not mounted
//! within 30 s" with an empty log). Cargo runs test binaries one after another.

mod common;
mod fuse_support;

use common::WeedServer;
use fuse_support::*;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// The tests here take turns: while one holds a mount whose filer is stopped (its writes
/// stuck in the kernel), a process the other spawned was seen stuck in a page fault before
/// it could exec (the test process's own memory; the driver was never reached).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Waits (bounded) for an fsync/close result and returns it.
fn timed<T>(what: &str, limit: Duration, f: impl FnOnce() -> T + Send) -> T
where
    T: Send,
{
    let started = Instant::now();
    let r = std::thread::scope(|s| s.spawn(f).join().unwrap());
    let took = started.elapsed();
    assert!(took < limit, "{what} took {took:?}");
    r
}

#[test]
fn failed_uploads_surface_as_errors() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // own server: this test stops its filer
    let mut w = WeedServer::start();
    let root = unique_path("eio");
    let m = mount_ours(&w, &root, &[]);
    fs::write(m.join("before"), b"ok").unwrap();
    let p = m.join("f");
    let mut f = File::create(&p).unwrap();
    f.write_all(&pseudo_random(1, MIB)).unwrap();
    w.stop_filer();
    // the next chunk needs AssignVolume from the filer: the writes are buffered, fsync fails
    let r = f.write_all(&pseudo_random(2, 3 * MIB));
    let r2 = timed("fsync", Duration::from_secs(120), || f.sync_all());
    let err = r.err().or(r2.err()).expect("write or fsync must fail");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // the handle stays poisoned; close reports the error too
    let r = timed("close", Duration::from_secs(120), move || {
        let fd = f.as_raw_fd();
        std::mem::forget(f);
        check(unsafe { libc::close(fd) })
    });
    assert_eq!(r.unwrap_err(), libc::EIO);
    // a metadata operation fails cleanly as well
    let e = timed("mkdir", Duration::from_secs(120), || {
        fs::create_dir(m.join("newdir"))
    })
    .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // the mount recovers when the filer is back
    w.start_filer();
    let ok = wait_until(Duration::from_secs(60), || {
        fs::write(m.join("after"), b"back").is_ok()
    });
    assert!(
        ok,
        "writes work again after the filer restart: {}",
        m.log_text()
    );
    assert_eq!(fs::read(m.join("before")).unwrap(), b"ok");
    assert_eq!(w.filer_get(&format!("{root}/after")).unwrap(), b"back");
}

/// Bytes in the regular files of `dir` (not recursive).
fn dir_bytes(dir: &std::path::Path) -> u64 {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The disk chunk cache under `--cacheDir` outlives the process: a new mount reads a file
/// the previous one read, with the volume server stopped (no GET can have served it).
#[test]
fn a_disk_cached_file_reads_after_a_remount_with_the_volume_server_down() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // own server: this test stops its volume server
    let mut w = WeedServer::start_with(common::WeedOptions {
        separate_volume: true,
        ..Default::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let args = [
        format!("--cacheDir={}", cache.path().display()),
        "--cacheCapacityMB=64".to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let root = unique_path("disktier");
    let data = pseudo_random(7, 5 * MIB + 12345);
    w.filer_put(&format!("{root}/f"), &data, "");
    let m = mount_ours(&w, &root, &args);
    assert!(fs::read(m.join("f")).unwrap() == data, "first read");
    // kept on disk in the background
    let kept = wait_until(Duration::from_secs(30), || {
        dir_bytes(cache.path()) >= data.len() as u64
    });
    assert!(kept, "{} bytes on disk", dir_bytes(cache.path()));
    assert!(m.unmount().success());

    w.stop_volume();
    let m = mount_ours(&w, &root, &args);
    let got = timed(
        "read with the volume server down",
        Duration::from_secs(120),
        || fs::read(m.join("f")),
    );
    assert!(got.unwrap() == data, "read from the disk cache");
    // one cache file damaged: it must not be served (the volume server is down: EIO)
    let victim = fs::read_dir(cache.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.is_file())
        .unwrap();
    let mut b = fs::read(&victim).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 0xff;
    fs::write(&victim, b).unwrap();
    assert!(m.unmount().success());
    let m = mount_ours(&w, &root, &args);
    let r = timed(
        "read of a damaged cache file",
        Duration::from_secs(120),
        || fs::read(m.join("f")),
    );
    assert!(r.is_err(), "bytes of a damaged cache file were served");
    w.start_volume();
    assert!(fs::read(m.join("f")).unwrap() == data, "fetched again");
    assert!(m.unmount().success());
}
