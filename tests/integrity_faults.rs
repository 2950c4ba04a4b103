//! Faults injected with real processes: the volume server stopped for 30 s under writers.
//! Nothing acknowledged (fsync returned 0) may be lost, and the writers resume on their own.

mod common;
mod fuse_support;

use common::{WeedOptions, WeedServer};
use fuse_support::*;
use std::fs::OpenOptions;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK: usize = 256 << 10;
const FSYNC_EVERY: usize = 4; // blocks: an fsync per MiB
const WRITERS: usize = 4;

fn block(writer: usize, i: usize) -> Vec<u8> {
    pseudo_random((writer as u64) << 32 | i as u64, BLOCK)
}

#[test]
fn volume_server_down_30s_loses_nothing_acknowledged() {
    let mut w = WeedServer::start_with(WeedOptions {
        separate_volume: true,
        ..Default::default()
    });
    let root = unique_path("vsdown");
    let m = mount_ours(&w, &root, &["--chunkSizeLimitMB=1"]);
    let stop = Arc::new(AtomicBool::new(false));
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..WRITERS).map(|_| AtomicU64::new(0)).collect());
    let mut threads = Vec::new();
    for wi in 0..WRITERS {
        let p = m.join(format!("w{wi}"));
        let stop = stop.clone();
        let acked = acked.clone();
        threads.push(std::thread::spawn(move || -> Result<usize, String> {
            let mut f = OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(&p)
                .map_err(|e| format!("open: {e}"))?;
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                f.write_all(&block(wi, i))
                    .map_err(|e| format!("write of block {i}: {e}"))?;
                i += 1;
                if i % FSYNC_EVERY == 0 {
                    f.sync_all()
                        .map_err(|e| format!("fsync after block {i}: {e}"))?;
                    acked[wi].store(i as u64, Ordering::SeqCst);
                }
            }
            f.sync_all().map_err(|e| format!("last fsync: {e}"))?;
            acked[wi].store(i as u64, Ordering::SeqCst);
            Ok(i)
        }));
    }
    let total = |a: &Arc<Vec<AtomicU64>>| -> Vec<u64> {
        a.iter().map(|x| x.load(Ordering::SeqCst)).collect()
    };
    assert!(
        wait_until(Duration::from_secs(60), || total(&acked)
            .iter()
            .all(|&n| n >= 8)),
        "writers did not get going: {:?}",
        total(&acked)
    );
    w.stop_volume();
    let down_at = total(&acked);
    std::thread::sleep(Duration::from_secs(30));
    w.start_volume();
    let up_at = Instant::now();
    // every writer must make progress again after the volume server is back
    let resumed = wait_until(Duration::from_secs(90), || {
        total(&acked)
            .iter()
            .zip(&down_at)
            .all(|(now, before)| *now >= before + 8)
    });
    stop.store(true, Ordering::Relaxed);
    let mut written = Vec::new();
    for (wi, t) in threads.into_iter().enumerate() {
        match t.join().unwrap() {
            Ok(n) => written.push(n),
            Err(e) => panic!("writer {wi} failed: {e}\n{}", m.log_text()),
        }
    }
    assert!(
        resumed,
        "writers did not resume within 90 s of the restart ({:?} s): {:?} -> {:?}",
        up_at.elapsed().as_secs(),
        down_at,
        total(&acked)
    );
    // what fsync acknowledged (here: everything, every writer ended with an fsync) is on the
    // filer, byte for byte
    for (wi, n) in written.iter().enumerate() {
        let got = w
            .filer_get(&format!("{root}/w{wi}"))
            .unwrap_or_else(|| panic!("w{wi} missing on the filer"));
        assert_eq!(got.len(), n * BLOCK, "w{wi}: length on the filer");
        for i in 0..*n {
            assert!(
                got[i * BLOCK..(i + 1) * BLOCK] == block(wi, i)[..],
                "w{wi}: block {i} of {n} differs on the filer"
            );
        }
    }
}
