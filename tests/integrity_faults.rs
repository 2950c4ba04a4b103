//! Faults injected with real processes under 4 writers that write and fsync: the volume
//! server stopped for 30 s, the filer killed (SIGKILL) and started again 15 s later. Nothing
//! acknowledged (fsync returned 0) may be lost, and the writers resume on their own once the
//! server is back.
//!
//! The writers are child processes, not threads of this test: while the volume server is
//! down, a flush of their files cannot finish, and any process this test spawns (the volume
//! server itself) would inherit their fds and hang in FUSE_FLUSH when exec closes them.

mod common;
mod fuse_support;

use common::{WeedOptions, WeedServer};
use fuse_support::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BLOCK: usize = 256 << 10; // an fsync every 4 blocks (1 MiB), in the writer
const WRITERS: usize = 4;

/// Block `i` of writer `w`: a 16-byte header naming it, then a 251-periodic pattern whose
/// phase depends on both (the Python writer below makes the same bytes).
fn block(w: usize, i: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(BLOCK);
    b.extend_from_slice(format!("w{w:03}b{i:010}\n").as_bytes());
    let seed = (w * 7919 + i * 104_729) % 251;
    b.extend((16..BLOCK).map(|k| ((seed + k) % 251) as u8));
    b
}

/// Writes blocks to argv[1] until argv[3] exists; prints `acked N` after each fsync.
const WRITER: &str = r#"
import os, sys
path, w, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
BLOCK, EVERY = 256 << 10, 4
period = bytes(range(251)) * (BLOCK // 251 + 2)
def block(i):
    seed = (w * 7919 + i * 104729) % 251
    head = ("w%03db%010d\n" % (w, i)).encode()
    return head + period[(seed + 16) % 251:][:BLOCK - 16]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
i = 0
try:
    while not os.path.exists(stop):
        b = block(i)
        n = 0
        while n < len(b):
            n += os.write(fd, b[n:])
        i += 1
        if i % EVERY == 0:
            os.fsync(fd)
            print("acked", i, flush=True)
    os.fsync(fd)
    print("acked", i, flush=True)
    os.close(fd)
    print("done", i, flush=True)
except OSError as e:
    print("error after block", i, e, flush=True)
    sys.exit(1)
"#;

struct Writer {
    child: Child,
    acked: Arc<AtomicU64>,
    /// The writer's last line.
    last: Arc<Mutex<String>>,
}

fn spawn_writer(path: &std::path::Path, w: usize, stop: &std::path::Path) -> Writer {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(WRITER)
        .arg(path)
        .arg(w.to_string())
        .arg(stop)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3");
    let acked = Arc::new(AtomicU64::new(0));
    let last = Arc::new(Mutex::new(String::new()));
    let out = child.stdout.take().unwrap();
    let (a, l) = (acked.clone(), last.clone());
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(n) = line.strip_prefix("acked ") {
                if let Ok(n) = n.trim().parse() {
                    a.store(n, Ordering::SeqCst);
                }
            }
            *l.lock().unwrap() = line;
        }
    });
    Writer { child, acked, last }
}

impl Drop for Writer {
    fn drop(&mut self) {
        common::kill_child(&mut self.child);
    }
}

#[test]
fn volume_server_down_30s_loses_nothing_acknowledged() {
    let w = WeedServer::start_with(WeedOptions {
        separate_volume: true,
        ..Default::default()
    });
    outage_loses_nothing_acknowledged(w, "vsdown", Duration::from_secs(30), |w, down| {
        if down {
            w.stop_volume()
        } else {
            w.start_volume()
        }
    });
}

/// The filer crashes (SIGKILL) under the writers and is back 15 s later: commits and chunk
/// assignments wait for it (within `--uploadRetry`), the metadata stream is taken up again.
#[test]
fn filer_crash_and_restart_loses_nothing_acknowledged() {
    let w = WeedServer::start();
    outage_loses_nothing_acknowledged(w, "filercrash", Duration::from_secs(15), |w, down| {
        if down {
            w.crash_filer()
        } else {
            w.start_filer()
        }
    });
}

/// 4 writers append and fsync; `fault(w, true)` takes a server down for `outage`, then
/// `fault(w, false)` brings it back. Every writer resumes on its own, and every block an
/// fsync acknowledged is on the filer and reads back the same through the mount.
fn outage_loses_nothing_acknowledged(
    mut w: WeedServer,
    tag: &str,
    outage: Duration,
    fault: impl Fn(&mut WeedServer, bool),
) {
    let root = unique_path(tag);
    let m = mount_ours(&w, &root, &["--chunkSizeLimitMB=1"]);
    let scratch = tempfile::tempdir().unwrap();
    let stop = scratch.path().join("stop");
    let mut writers: Vec<Writer> = (0..WRITERS)
        .map(|i| spawn_writer(&m.join(format!("w{i}")), i, &stop))
        .collect();
    let acked =
        |ws: &[Writer]| -> Vec<u64> { ws.iter().map(|x| x.acked.load(Ordering::SeqCst)).collect() };
    assert!(
        wait_until(Duration::from_secs(60), || acked(&writers)
            .iter()
            .all(|&n| n >= 8)),
        "writers did not get going: {:?}",
        acked(&writers)
    );
    fault(&mut w, true);
    let down_at = acked(&writers);
    std::thread::sleep(outage);
    fault(&mut w, false);
    let up_at = Instant::now();
    // every writer makes progress again after the volume server is back
    let resumed = wait_until(Duration::from_secs(90), || {
        acked(&writers)
            .iter()
            .zip(&down_at)
            .all(|(now, before)| *now >= before + 8)
    });
    let resumed_after = up_at.elapsed();
    std::fs::write(&stop, b"").unwrap();
    let mut written = Vec::new();
    for (i, wr) in writers.iter_mut().enumerate() {
        let st = wr.child.wait().unwrap();
        // the reader thread has seen the last line once the pipe closes
        let done = wait_until(Duration::from_secs(10), || {
            wr.last.lock().unwrap().starts_with("done ")
                || wr.last.lock().unwrap().starts_with("error")
        });
        let last = wr.last.lock().unwrap().clone();
        assert!(
            st.success() && done && last.starts_with("done "),
            "writer {i} failed ({st}): {last}\n{}",
            m.log_text()
        );
        written.push(last["done ".len()..].trim().parse::<usize>().unwrap());
    }
    assert!(
        resumed,
        "writers did not resume within 90 s of the restart ({} s): {:?} -> {:?}",
        up_at.elapsed().as_secs(),
        down_at,
        acked(&writers)
    );
    // what fsync acknowledged (here: everything, each writer ended with an fsync) is on the
    // filer, byte for byte, and reads back the same through the mount
    for (i, n) in written.iter().enumerate() {
        let got = w
            .filer_get(&format!("{root}/w{i}"))
            .unwrap_or_else(|| panic!("w{i} missing on the filer"));
        assert_eq!(got.len(), n * BLOCK, "w{i}: length on the filer");
        for b in 0..*n {
            assert!(
                got[b * BLOCK..(b + 1) * BLOCK] == block(i, b)[..],
                "w{i}: block {b} of {n} differs on the filer"
            );
        }
        let via_mount = std::fs::read(m.join(format!("w{i}"))).unwrap();
        assert!(via_mount == got, "w{i}: the mount reads other bytes");
    }
    eprintln!(
        "blocks written per writer: {written:?} (acknowledged before the outage: {down_at:?}); \
         all resumed {resumed_after:?} after the server was back"
    );
}
