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
