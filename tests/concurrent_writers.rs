//! Concurrent writers on one file, one per node, checked against a model. Each node owns
//! every n-th stripe of the file (the stripe size changes per round, from a few KiB to more
//! than a chunk), and a thread per node writes random bytes at random offsets inside its own
//! stripes, fsyncs, closes and reopens, and reads its own bytes back, all at once with the
//! others and with no waiting for each other; a second thread per node reads that node's
//! bytes back meanwhile through a descriptor of its own. The nodes' writes never overlap, so the outcome
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
//! (operations per node and round, default 120), `CONC_MOUNTS` (2 or 3, default 2),
//! `CONC_MOVE_MS` (the mover's longest pause between moves; it stays away up to half of it.
//! By default 200 and 25, a move every ~12 ms, in turns).

mod common;
mod fuse_support;
mod model_support;

use fuse_support::*;
use model_support::*;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// Writes stay below this: several chunks of either size.
const EXTENT: usize = 5 * MIB + 4321;
const STRIPES: &[usize] = &[4096, 65_537, 300_000, MIB, 1_500_007];
/// What a mount logs at a commit rebased onto another client's (info).
const REBASED: &str = "rebasing onto it";
/// What a mount logs when it gives the chunk list condition up (warn).
const CONDITION_OFF: &str = "refuses a chunk list condition that holds";
/// The file's other name, while the mover has it there.
const MOVED: &str = "f.moved";
const NODE_ARGS: &[&[&str]] = &[&[], &["--chunkSizeLimitMB=1"], &["--chunkSizeLimitMB=4"]];

/// What one node wrote: its bytes, which of them it wrote, and by which of its operations.
struct Written {
    data: Vec<u8>,
    op: Vec<u32>,
    end: usize,
    /// The ranges it wrote, for reading them back.
    ranges: Vec<(usize, usize)>,
    log: Vec<String>,
}

impl Written {
    fn new() -> Self {
        Written {
            data: vec![0; EXTENT],
            op: vec![0; EXTENT],
            end: 0,
            ranges: Vec::new(),
            log: Vec::new(),
        }
    }

    fn put(&mut self, off: usize, buf: &[u8], op: u32) {
        self.data[off..off + buf.len()].copy_from_slice(buf);
        self.op[off..off + buf.len()].fill(op);
        self.end = self.end.max(off + buf.len());
        self.ranges.push((off, buf.len()));
    }

    /// Reads back one range it wrote through `f`: nobody else writes there, so its bytes are
    /// exact at any time (the caller holds the model, so no write of its own is half done).
    /// False if it has written nothing yet.
    fn check_one(&self, f: &File, rng: &mut Rng, who: &str) -> Result<bool, String> {
        if self.ranges.is_empty() {
            return Ok(false);
        }
        let (off, len) = *rng.pick(&self.ranges);
        let mut got = vec![0; len];
        match f.read_exact_at(&mut got, off as u64) {
            Ok(()) if got == self.data[off..off + len] => Ok(true),
            Ok(()) => Err(format!(
                "{who}: pread {off}+{len} of its own bytes: {}",
                first_difference(&self.data[off..off + len], &got)
            )),
            Err(e) => Err(format!("{who}: pread {off}+{len}: {e}")),
        }
    }
}

fn owner(x: usize, stripe: usize, nodes: usize) -> usize {
    (x / stripe) % nodes
}

/// Opens the file, which may be under the mover's other name just now.
fn open_moving(path: &Path) -> std::io::Result<File> {
    let open = |p: &Path| OpenOptions::new().read(true).write(true).open(p);
    for tries in 0..200 {
        match open(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            r => return r,
        }
        if let Ok(f) = open(&path.with_file_name(MOVED)) {
            return Ok(f);
        }
        std::thread::sleep(Duration::from_millis(1 + tries % 3));
    }
    open(path)
}

/// Closes `f` and says what close(2) said (dropping a `File` ignores it: a flush that failed
/// at the close would go unseen until the end).
fn close(f: File) -> std::io::Result<()> {
    use std::os::fd::IntoRawFd;
    // SAFETY: the descriptor is ours alone (taken out of the File) and closed once
    if unsafe { libc::close(f.into_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One node's writer: random operations on its own stripes of `path`, recorded in `me`.
fn writer(
    node: usize,
    nodes: usize,
    stripe: usize,
    path: &Path,
    seed: u64,
    ops: u64,
    me: &Mutex<Written>,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let log = |what: String| me.lock().unwrap().log.push(what);
    let mut f = open_moving(path).map_err(|e| format!("open: {e}"))?;
    let own: Vec<usize> = (0..EXTENT.div_ceil(stripe))
        .filter(|k| k % nodes == node)
        .collect();
    if own.is_empty() {
        return Ok(());
    }
    for i in 1..=ops as u32 {
        match rng.weighted(&[8, 2, 1, 2, 1]) {
            0 => {
                let k = *rng.pick(&own);
                let (lo, hi) = (k * stripe, ((k + 1) * stripe).min(EXTENT));
                let off = rng.range(lo as u64, hi as u64 - 1) as usize;
                let max = if rng.chance(1, 3) { 4096 } else { 300 << 10 };
                let len = rng.range(1, (hi - off).min(max) as u64) as usize;
                let buf = rng.bytes(len);
                // the model is held while the write is under way: the reader waits
                let mut m = me.lock().unwrap();
                m.log.push(format!("{i}: pwrite {off}+{len}"));
                m.put(off, &buf, i);
                f.write_all_at(&buf, off as u64)
                    .map_err(|e| format!("pwrite {off}+{len}: {e}"))?;
            }
            1 => {
                log(format!("{i}: fsync"));
                f.sync_all().map_err(|e| format!("fsync: {e}"))?;
            }
            2 => {
                log(format!("{i}: close, reopen"));
                close(f).map_err(|e| format!("close: {e}"))?;
                f = open_moving(path).map_err(|e| format!("reopen: {e}"))?;
            }
            3 => {
                log(format!("{i}: pread"));
                me.lock().unwrap().check_one(&f, &mut rng, "the writer")?;
            }
            _ => {
                let ms = rng.below(15);
                log(format!("{i}: sleep {ms} ms"));
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
    }
    log("end: fsync, close".into());
    f.sync_all().map_err(|e| format!("final fsync: {e}"))?;
    close(f).map_err(|e| format!("final close: {e}"))
}

/// Another thread of the node reads its own bytes back through a descriptor of its own while
/// the writer writes, commits and rebases, until `writing` ends.
fn reader(
    path: &Path,
    seed: u64,
    me: &Mutex<Written>,
    writing: &AtomicBool,
) -> Result<u32, String> {
    let mut rng = Rng::new(seed);
    let f = open_moving(path).map_err(|e| format!("the reader's open: {e}"))?;
    let mut reads = 0;
    while writing.load(Relaxed) {
        if me.lock().unwrap().check_one(&f, &mut rng, "the reader")? {
            reads += 1;
        }
        std::thread::sleep(Duration::from_millis(rng.below(3)));
    }
    Ok(reads)
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
    // the mover's longest pause between moves, in ms (it stays away up to half of it); by
    // default every other moving round moves fast, about every 12 ms
    let move_ms = std::env::var("CONC_MOVE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
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
        let pause = move_ms
            .unwrap_or(if seed % 4 == 3 { 25 } else { 200 })
            .max(8);
        let moves = AtomicU32::new(0);
        let writing = AtomicBool::new(true);
        let models: Vec<Mutex<Written>> = (0..nodes).map(|_| Mutex::new(Written::new())).collect();
        let started = Instant::now();
        let (results, reads, mover) = std::thread::scope(|s| {
            let (moves, writing) = (&moves, &writing);
            let mover = moving.then(|| {
                let (f, g) = (mounts[0].join("f"), mounts[0].join(MOVED));
                let mut rng = Rng::new(seed ^ 0x5eed);
                s.spawn(move || -> Result<(), String> {
                    while writing.load(Relaxed) {
                        std::thread::sleep(Duration::from_millis(rng.range(pause / 8, pause)));
                        std::fs::rename(&f, &g).map_err(|e| format!("move away: {e}"))?;
                        std::thread::sleep(Duration::from_millis(rng.below(pause / 2)));
                        std::fs::rename(&g, &f).map_err(|e| format!("move back: {e}"))?;
                        moves.fetch_add(1, Relaxed);
                    }
                    Ok(())
                })
            });
            let readers: Vec<_> = mounts
                .iter()
                .zip(&models)
                .enumerate()
                .map(|(i, (m, me))| {
                    let path = m.join("f");
                    s.spawn(move || reader(&path, seed ^ (i as u64 + 101), me, writing))
                })
                .collect();
            let writers: Vec<_> = mounts
                .iter()
                .zip(&models)
                .enumerate()
                .map(|(i, (m, me))| {
                    let path = m.join("f");
                    s.spawn(move || writer(i, nodes, stripe, &path, seed ^ (i as u64 + 1), ops, me))
                })
                .collect();
            let results: Vec<_> = writers.into_iter().map(|h| h.join().unwrap()).collect();
            writing.store(false, Relaxed);
            let reads: Vec<_> = readers.into_iter().map(|h| h.join().unwrap()).collect();
            let mover = mover.map(|h| h.join().unwrap()).unwrap_or(Ok(()));
            (results, reads, mover)
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
        let written: Vec<Written> = models
            .into_iter()
            .map(|m| m.into_inner().unwrap())
            .collect();
        let last_ops = |i: usize| tail(&written[i].log.join("\n"), 12);
        for (i, r) in results.into_iter().enumerate() {
            if let Err(e) = r {
                fail(format!(
                    "node {i}: {e}\nits last operations:\n{}",
                    last_ops(i)
                ));
            }
        }
        let mut read_back = 0;
        for (i, r) in reads.into_iter().enumerate() {
            match r {
                Ok(n) => read_back += n,
                Err(e) => fail(format!(
                    "node {i}: {e}\nits last operations:\n{}",
                    last_ops(i)
                )),
            }
        }
        if read_back == 0 {
            fail("no node's second thread read anything back".into());
        }
        if let Err(e) = mover {
            fail(format!("the mover: {e}"));
        }
        let moves = moves.into_inner();
        if moving && moves == 0 {
            fail("the mover never moved the file".into());
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
        let logs: Vec<String> = mounts.iter().map(|m| m.log_text()).collect();
        if let Some(i) = logs.iter().position(|l| l.contains(CONDITION_OFF)) {
            fail(format!(
                "node {i} turned the chunk list condition off (the last writer wins)"
            ));
        }
        let refused: usize = logs.iter().map(|l| l.matches(REBASED).count()).sum();
        rebases += refused;
        eprintln!(
            "round {round} (seed {seed}, stripe {stripe}, base {} bytes): {nodes} x {ops} \
             operations in {:?}, final size {size}, {refused} commits rebased, {moves} moves \
             away and back (pauses up to {pause} ms), {read_back} reads by other threads",
            base.len(),
            started.elapsed(),
        );
        for m in mounts {
            m.unmount();
        }
    }
    // the test proves nothing unless commits did race (counted from the mounts' info log)
    let info = ["info", "debug", "trace"]
        .iter()
        .any(|l| test_log_level().contains(l));
    assert!(
        rebases > 0 || rounds == 0 || !info,
        "no commit was refused in {rounds} rounds: the writers never raced"
    );
}
