//! Concurrent writers on one file, one per node, checked against a model. Each node owns
//! every n-th stripe of the file (the stripe size changes per round, from a few KiB to more
//! than a chunk), and a thread per node writes random bytes at random offsets inside its own
//! stripes, fsyncs, closes and reopens, and reads its own bytes back, all at once with the
//! others and with no waiting for each other. The nodes' writes never overlap, so the outcome
//! is fully defined: when every writer has closed, the filer (over HTTP) and every mount must
//! hold each node's last bytes in its stripes, the original bytes where nobody wrote, and the
//! size of the furthest write. A commit that drops another node's chunk, a rebase that puts
//! one node's stale bytes over another's, or a read that mixes them fails here.
//!
//! The nodes mount with different chunk sizes, so their chunks do not line up. In every other
//! round (odd seeds) one more thread renames the file away and back on the first node meanwhile: the
//! writes follow the file, whatever its name when they are committed.
//!
//! Environment: `CONC_SEED` (number or `random`), `CONC_ROUNDS` (default 4), `CONC_OPS`
//! (operations per node and round, default 120), `CONC_MOUNTS` (2 or 3, default 2).

mod common;
mod fuse_support;
mod model_support;

use fuse_support::*;
use model_support::*;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// Writes stay below this: several chunks of either size.
const EXTENT: usize = 5 * MIB + 4321;
const STRIPES: &[usize] = &[4096, 65_537, 300_000, MIB, 1_500_007];
/// The file's other name, while the mover has it there.
const MOVED: &str = "f.moved";
const NODE_ARGS: &[&[&str]] = &[&[], &["--chunkSizeLimitMB=1"], &["--chunkSizeLimitMB=4"]];

/// What one node wrote: its bytes, which of them it wrote, and by which of its operations.
struct Written {
    data: Vec<u8>,
    op: Vec<u32>,
    end: usize,
    log: Vec<String>,
}

impl Written {
    fn new() -> Self {
        Written {
            data: vec![0; EXTENT],
            op: vec![0; EXTENT],
            end: 0,
            log: Vec::new(),
        }
    }

    fn put(&mut self, off: usize, buf: &[u8], op: u32) {
        self.data[off..off + buf.len()].copy_from_slice(buf);
        self.op[off..off + buf.len()].fill(op);
        self.end = self.end.max(off + buf.len());
    }
}

fn owner(x: usize, stripe: usize, nodes: usize) -> usize {
    (x / stripe) % nodes
}

/// One node's writer: random operations on its own stripes of `path`.
fn writer(
    node: usize,
    nodes: usize,
    stripe: usize,
    path: &std::path::Path,
    seed: u64,
    ops: u64,
) -> Result<Written, (Written, String)> {
    let mut rng = Rng::new(seed);
    let mut me = Written::new();
    // the file may be under its other name just now (the mover's)
    let open = || {
        let mut tries = 0;
        loop {
            let r = OpenOptions::new().read(true).write(true).open(path);
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 200 => {
                    tries += 1;
                    let other = path.with_file_name(if tries % 2 == 1 { MOVED } else { "f" });
                    if let Ok(f) = OpenOptions::new().read(true).write(true).open(other) {
                        return Ok(f);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                r => return r,
            }
        }
    };
    let mut f: File = match open() {
        Ok(f) => f,
        Err(e) => return Err((me, format!("open: {e}"))),
    };
    let own: Vec<usize> = (0..EXTENT.div_ceil(stripe))
        .filter(|k| k % nodes == node)
        .collect();
    if own.is_empty() {
        return Ok(me);
    }
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for i in 1..=ops as u32 {
        let step = match rng.weighted(&[8, 2, 1, 2, 1]) {
            0 => {
                let k = *rng.pick(&own);
                let (lo, hi) = (k * stripe, ((k + 1) * stripe).min(EXTENT));
                let off = rng.range(lo as u64, hi as u64 - 1) as usize;
                let max = if rng.chance(1, 3) { 4096 } else { 300 << 10 };
                let len = rng.range(1, (hi - off).min(max) as u64) as usize;
                let buf = rng.bytes(len);
                me.log.push(format!("{i}: pwrite {off}+{len}"));
                ranges.push((off, len));
                me.put(off, &buf, i);
                f.write_all_at(&buf, off as u64)
                    .map_err(|e| format!("pwrite {off}+{len}: {e}"))
            }
            1 => {
                me.log.push(format!("{i}: fsync"));
                f.sync_all().map_err(|e| format!("fsync: {e}"))
            }
            2 => {
                me.log.push(format!("{i}: close, reopen"));
                drop(f);
                f = match open() {
                    Ok(f) => f,
                    Err(e) => return Err((me, format!("reopen: {e}"))),
                };
                Ok(())
            }
            3 if !ranges.is_empty() => {
                // its own bytes: nobody else writes there, so they are exact at any time
                let (off, len) = *rng.pick(&ranges);
                me.log.push(format!("{i}: pread {off}+{len}"));
                let mut got = vec![0; len];
                match f.read_exact_at(&mut got, off as u64) {
                    Ok(()) if got == me.data[off..off + len] => Ok(()),
                    Ok(()) => Err(format!(
                        "pread {off}+{len} of its own bytes: {}",
                        first_difference(&me.data[off..off + len], &got)
                    )),
                    Err(e) => Err(format!("pread {off}+{len}: {e}")),
                }
            }
            _ => {
                let ms = rng.below(15);
                me.log.push(format!("{i}: sleep {ms} ms"));
                std::thread::sleep(Duration::from_millis(ms));
                Ok(())
            }
        };
        if let Err(e) = step {
            return Err((me, e));
        }
    }
    me.log.push("end: fsync, close".into());
    if let Err(e) = f.sync_all() {
        return Err((me, format!("final fsync: {e}")));
    }
    Ok(me)
}

/// Says which node wrote the first byte where `got` differs from `want`, and how.
fn explain(want: &[u8], got: &[u8], written: &[Written], stripe: usize) -> String {
    let n = written.len();
    let Some(x) = want
        .iter()
        .zip(got)
        .position(|(a, b)| a != b)
        .or((want.len() != got.len()).then_some(want.len().min(got.len())))
    else {
        return "equal".into();
    };
    let o = owner(x, stripe, n);
    let w = &written[o];
    let by = if x < EXTENT && w.op[x] != 0 {
        format!("node {o}'s operation {}", w.op[x])
    } else {
        "nobody (the original bytes or a hole)".into()
    };
    let differ = want.iter().zip(got).filter(|(a, b)| a != b).count();
    format!(
        "{} bytes, want {}: {differ} differ, the first at {x} (stripe of node {o}, written by {by}); \
         node {o}'s last operations:\n{}",
        got.len(),
        want.len(),
        tail(&w.log.join("\n"), 12)
    )
}

#[test]
fn concurrent_writers_on_disjoint_stripes_keep_every_write() {
    let seed = seed_from_env("CONC_SEED", 20261207);
    let rounds = env_u64("CONC_ROUNDS", 4);
    let ops = env_u64("CONC_OPS", 120);
    let nodes = env_u64("CONC_MOUNTS", 2).clamp(2, 3) as usize;
    let w = shared_server();
    let mut rebases = 0;
    for round in 0..rounds {
        let seed = seed.wrapping_add(round * 7919);
        let mut rng = Rng::new(seed);
        let stripe = *rng.pick(STRIPES);
        let root = unique_path("conc");
        let mounts: Vec<MountGuard> = (0..nodes)
            .map(|i| mount_ours(&w, &root, NODE_ARGS[i]))
            .collect();
        let base_len = rng.below(3 * MIB as u64) as usize;
        let base = rng.bytes(base_len);
        std::fs::write(mounts[0].join("f"), &base).unwrap();
        for m in &mounts[1..] {
            assert!(
                wait_until(Duration::from_secs(15), || {
                    std::fs::metadata(m.join("f")).is_ok_and(|md| md.len() == base.len() as u64)
                }),
                "round {round}: another node sees the file"
            );
        }
        // (the round seeds alternate in parity, and a rerun of one seed moves as it did)
        let moving = seed % 2 == 1;
        let moves = std::sync::atomic::AtomicU32::new(0);
        let writing = std::sync::atomic::AtomicBool::new(true);
        let started = Instant::now();
        let results: Vec<_> = std::thread::scope(|s| {
            if moving {
                let (f, g) = (mounts[0].join("f"), mounts[0].join(MOVED));
                let (moves, writing) = (&moves, &writing);
                let mut rng = Rng::new(seed ^ 0x5eed);
                s.spawn(move || {
                    while writing.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(rng.range(5, 40)));
                        std::fs::rename(&f, &g).expect("move the file away");
                        std::thread::sleep(Duration::from_millis(rng.below(20)));
                        std::fs::rename(&g, &f).expect("move the file back");
                        moves.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
            let handles: Vec<_> = mounts
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let path = m.join("f");
                    s.spawn(move || writer(i, nodes, stripe, &path, seed ^ (i as u64 + 1), ops))
                })
                .collect();
            let results = handles.into_iter().map(|h| h.join().unwrap()).collect();
            writing.store(false, std::sync::atomic::Ordering::Relaxed);
            results
        });
        // on a failure the mounts' logs are kept, for the story behind it
        let fail = |what: String| -> ! {
            let logs: Vec<String> = mounts
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let keep = format!("/tmp/conc-{seed}-node{i}.log");
                    let _ = std::fs::copy(&m.log, &keep);
                    keep
                })
                .collect();
            panic!(
                "CONCURRENT FAILURE (seed {seed}, round {round}, stripe {stripe}; rerun with \
                 CONC_SEED={seed} CONC_ROUNDS=1 CONC_MOUNTS={nodes}): {what}\nmount logs: {logs:?}"
            )
        };
        let mut written = Vec::new();
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(wr) => written.push(wr),
                Err((wr, e)) => fail(format!(
                    "node {i}: {e}\nits last operations:\n{}",
                    tail(&wr.log.join("\n"), 12)
                )),
            }
        }
        let size = written.iter().map(|wr| wr.end).fold(base.len(), usize::max);
        let mut want = base.clone();
        want.resize(size, 0);
        for (x, b) in want.iter_mut().enumerate().take(EXTENT) {
            let wr = &written[owner(x, stripe, nodes)];
            if wr.op[x] != 0 {
                *b = wr.data[x];
            }
        }
        let path = format!("{root}/f");
        let got = w.filer_get(&path).unwrap_or_default();
        if got != want {
            fail(format!(
                "the filer has {}",
                explain(&want, &got, &written, stripe)
            ));
        }
        for (i, m) in mounts.iter().enumerate() {
            let mut last = Vec::new();
            let same = wait_until(Duration::from_secs(15), || {
                last = std::fs::read(m.join("f")).unwrap_or_default();
                last == want
            });
            if !same {
                fail(format!(
                    "node {i} reads {}",
                    explain(&want, &last, &written, stripe)
                ));
            }
        }
        let refused: usize = mounts
            .iter()
            .map(|m| m.log_text().matches("rebasing onto it").count())
            .sum();
        rebases += refused;
        eprintln!(
            "round {round} (seed {seed}, stripe {stripe}, base {} bytes): {nodes} x {ops} \
             operations in {:?}, final size {size}, {refused} commits rebased, {} moves away \
             and back",
            base.len(),
            started.elapsed(),
            moves.into_inner()
        );
        for m in mounts {
            m.unmount();
        }
    }
    // the test proves nothing unless commits did race
    assert!(
        rebases > 0 || rounds == 0,
        "no commit was refused in {rounds} rounds: the writers never raced"
    );
}
