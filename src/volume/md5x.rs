//! MD5 of several buffers at once, one 32-bit SIMD lane per buffer (8 with AVX2, 4 with SSE2).
//!
//! Every uploaded chunk carries its MD5 as `Content-MD5` (the volume server checks the bytes it
//! received against it). One MD5 stream is a chain of dependent 32-bit steps that keeps one
//! core busy at ~600 MB/s while most of its execution units idle; independent chunks hashed in
//! lanes side by side cost little more than one. Digests are identical to the `md-5` crate's
//! (the tests compare every length class), so nothing on the wire changes.

use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Per-step additive constants: floor(abs(sin(i + 1)) * 2^32).
const K: [u32; 64] = [
    0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
    0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
    0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
    0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
    0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
    0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
    0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
    0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391,
];

/// Left-rotation of each step.
const S: [u32; 64] = [
    7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 5, 9, 14, 20, 5, 9, 14, 20, 5, 9,
    14, 20, 5, 9, 14, 20, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 6, 10, 15,
    21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21,
];

/// Message word of each step.
const W: [usize; 64] = [
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 6, 11, 0, 5, 10, 15, 4, 9, 14, 3, 8,
    13, 2, 7, 12, 5, 8, 11, 14, 1, 4, 7, 10, 13, 0, 3, 6, 9, 12, 15, 2, 0, 7, 14, 5, 12, 3, 10, 1,
    8, 15, 6, 13, 4, 11, 2, 9,
];

const INIT: [u32; 4] = [0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476];

/// How many buffers one pass hashes side by side on this CPU (1: no SIMD kernel).
pub fn lanes() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            return 8;
        }
        4 // SSE2 is part of x86-64
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        1
    }
}

/// The MD5 digest of each input, in order.
pub fn md5_many(inputs: &[&[u8]]) -> Vec<[u8; 16]> {
    md5_lanes(inputs, lanes())
}

/// [`md5_many`] with at most `lanes` lanes (8 only where AVX2 is present, 4 on any x86-64,
/// 1: the scalar hasher).
fn md5_lanes(inputs: &[&[u8]], lanes: usize) -> Vec<[u8; 16]> {
    // a kernel width this CPU runs, never wider, whatever the caller asked for
    let lanes = match lanes.min(self::lanes()) {
        l if l >= 8 => 8,
        l if l >= 4 => 4,
        _ => 1,
    };
    let mut out = Vec::with_capacity(inputs.len());
    for group in inputs.chunks(lanes.max(1)) {
        if group.len() == 1 {
            // one stream: the scalar hasher is faster than a mostly empty vector
            out.push(md5_one(group[0]));
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        out.extend(x86::group(group, lanes));
        #[cfg(not(target_arch = "x86_64"))]
        out.extend(group.iter().map(|d| md5_one(d)));
    }
    out
}

/// Chunks smaller than this are hashed by the caller at once: batching would save little and
/// delay small files' commits.
const BATCH_MIN: usize = 256 << 10;
/// The longest a chunk waits for companions before it is hashed anyway.
/// A pass costs the same for 1 or 8 chunks, so a sequential writer's chunks (one every few
/// ms) should meet; the uploads in flight (`concurrentWriters`) cover the delay.
const MAX_WAIT: Duration = Duration::from_millis(50);

/// Kicks so far; a chunk sealed before the latest kick never waits.
static KICKS: AtomicU64 = AtomicU64::new(0);

/// The kick generation now: what a chunk sealed now passes to [`digest`] as `may_wait`.
pub fn generation() -> u64 {
    KICKS.load(Ordering::SeqCst)
}

/// The MD5 of an upload's chunk. `may_wait: Some(generation at sealing)`: nobody waits for
/// this chunk yet (it was written in passing, not sealed by a flush), so it may wait up to
/// [`MAX_WAIT`] to be hashed with others, unless [`kick`] was called since it was sealed (a
/// flush about to wait for it), however late it reaches the queue.
pub async fn digest(data: Bytes, may_wait: Option<u64>) -> [u8; 16] {
    if data.len() < BATCH_MIN || lanes() == 1 {
        return md5_one(&data);
    }
    let (tx, rx) = oneshot::channel();
    let job = Job {
        data: data.clone(),
        may_wait,
        since: Instant::now(),
        reply: tx,
    };
    if batcher().push(job).is_err() {
        return md5_one(&data);
    }
    match rx.await {
        Ok(d) => d,
        // the hashing thread died with this job (a bug): hash here
        Err(_) => md5_one(&data),
    }
}

/// Ends the wait of every chunk sealed until now, queued or not yet (a flush is about to wait
/// for its uploads).
pub fn kick() {
    match BATCHER.get() {
        Some(b) => b.kick(),
        None => {
            KICKS.fetch_add(1, Ordering::SeqCst);
        }
    }
}

struct Job {
    data: Bytes,
    /// Some(kick generation at sealing): see [`digest`].
    may_wait: Option<u64>,
    since: Instant,
    reply: oneshot::Sender<[u8; 16]>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs at the front that must not wait any longer (kicked).
    kicked: usize,
    /// Hashing threads running; once none is left, callers hash for themselves.
    threads: usize,
}

/// Hashing threads take queued chunks side by side, a full set of lanes at a time, or fewer once
/// the oldest has waited [`MAX_WAIT`] or someone needs them now.
struct Batcher {
    queue: Mutex<Queue>,
    ready: Condvar,
}

static BATCHER: OnceLock<Arc<Batcher>> = OnceLock::new();

fn batcher() -> &'static Arc<Batcher> {
    BATCHER.get_or_init(|| {
        let b = Arc::new(Batcher {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
        });
        // one thread hashes ~2.5 GiB/s; big nodes get a few so hashing never caps their writes
        let threads = std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 4));
        b.lock().threads = threads;
        for i in 0..threads {
            let worker = b.clone();
            match std::thread::Builder::new()
                .name(format!("md5-lanes-{i}"))
                .spawn(move || {
                    let _gone = Gone(&worker);
                    worker.run()
                }) {
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not start an MD5 hashing thread");
                    b.lock().threads -= 1;
                }
            }
        }
        b
    })
}

impl Batcher {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a job; gives it back when no thread is left to hash it.
    fn push(&self, job: Job) -> Result<(), Job> {
        let mut q = self.lock();
        if q.threads == 0 {
            return Err(job);
        }
        // compared under the lock that kick() takes to count: no kick slips in between
        if job.may_wait != Some(generation()) {
            q.kicked = q.jobs.len() + 1;
        }
        q.jobs.push_back(job);
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    fn kick(&self) {
        let mut q = self.lock();
        KICKS.fetch_add(1, Ordering::SeqCst);
        q.kicked = q.jobs.len();
        drop(q);
        self.ready.notify_one();
    }

    fn run(&self) {
        let lanes = lanes();
        loop {
            let batch: Vec<Job> = {
                let mut q = self.lock();
                loop {
                    let Some(first) = q.jobs.front() else {
                        q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner());
                        continue;
                    };
                    let waited = first.since.elapsed();
                    if q.jobs.len() >= lanes || q.kicked > 0 || waited >= MAX_WAIT {
                        break;
                    }
                    q = self
                        .ready
                        .wait_timeout(q, MAX_WAIT - waited)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                let n = q.jobs.len().min(lanes);
                q.kicked = q.kicked.saturating_sub(n);
                q.jobs.drain(..n).collect()
            };
            let inputs: Vec<&[u8]> = batch.iter().map(|j| j.data.as_ref()).collect();
            let digests = md5_many(&inputs);
            for (job, d) in batch.into_iter().zip(digests) {
                // the uploader may have been cancelled; nothing to do then
                let _ = job.reply.send(d);
            }
        }
    }
}

/// Counts a hashing thread out when it ends (only a panic ends one). With the last one gone
/// the queued jobs' replies are dropped, so their callers hash for themselves.
struct Gone<'a>(&'a Batcher);

impl Drop for Gone<'_> {
    fn drop(&mut self) {
        let mut q = self.0.lock();
        q.threads = q.threads.saturating_sub(1);
        if q.threads == 0 {
            q.jobs.clear();
            tracing::error!("no MD5 hashing thread is left: chunks are hashed one by one");
        }
    }
}

/// Hashes `data[done..]` on top of `state` (which covers `data[..done]`) and pads.
fn finish(state: &mut [u32; 4], data: &[u8], done: usize) -> [u8; 16] {
    let rest = compress_blocks(state, &data[done..]);
    pad(state, rest, data.len() as u64)
}

/// Hashes `rest` (less than a block, the end of `len` bytes) with MD5's padding on top of
/// `state`, and gives the digest.
fn pad(state: &mut [u32; 4], rest: &[u8], len: u64) -> [u8; 16] {
    let mut tail = [0u8; 128];
    tail[..rest.len()].copy_from_slice(rest);
    tail[rest.len()] = 0x80;
    let end = if rest.len() < 56 { 64 } else { 128 };
    tail[end - 8..end].copy_from_slice(&len.wrapping_mul(8).to_le_bytes());
    for block in tail[..end].chunks_exact(64) {
        compress_scalar(state, block.try_into().expect("64 bytes"));
    }
    let mut d = [0u8; 16];
    for (o, w) in d.chunks_exact_mut(4).zip(state.iter()) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    d
}

/// Hashes the whole 64-byte blocks of `data` on top of `state`; returns what is left.
fn compress_blocks<'a>(state: &mut [u32; 4], data: &'a [u8]) -> &'a [u8] {
    // a local copy stays in registers from block to block
    let mut st = *state;
    let mut blocks = data.chunks_exact(64);
    for block in &mut blocks {
        compress_scalar(&mut st, block.try_into().expect("64 bytes"));
    }
    *state = st;
    blocks.remainder()
}

/// One MD5 block. Each step waits for the step before (`b`); what does not depend on it
/// (`a`, the constant, the message word, and for G the `c & !d` half) is summed first, so
/// only the round function's last operation, the add, the rotation and the final add are on
/// that chain: 10-19 % faster than the `md-5` crate here (`cargo bench --bench md5`).
#[inline(always)]
fn compress_scalar(state: &mut [u32; 4], block: &[u8; 64]) {
    let m: [u32; 16] =
        std::array::from_fn(|i| u32::from_le_bytes(block[i * 4..i * 4 + 4].try_into().unwrap()));
    let [mut a, mut b, mut c, mut d] = *state;
    for i in 0..64 {
        let early = a.wrapping_add(K[i]).wrapping_add(m[W[i]]);
        let t = match i / 16 {
            0 => early.wrapping_add(d ^ (b & (c ^ d))),
            1 => early.wrapping_add(c & !d).wrapping_add(b & d),
            2 => early.wrapping_add(b ^ (c ^ d)),
            _ => early.wrapping_add(c ^ (b | !d)),
        };
        (a, d, c) = (d, c, b);
        b = b.wrapping_add(t.rotate_left(S[i]));
    }
    for (s, v) in state.iter_mut().zip([a, b, c, d]) {
        *s = s.wrapping_add(v);
    }
}

/// The MD5 of one buffer (the scalar hasher).
pub fn md5_one(data: &[u8]) -> [u8; 16] {
    let mut st = INIT;
    finish(&mut st, data, 0)
}

/// MD5 fed piece by piece (the scalar hasher): a stream of appends hashed as they come.
#[derive(Clone)]
pub struct Hasher {
    state: [u32; 4],
    /// The bytes of an unfinished block.
    block: [u8; 64],
    len: u64,
}

impl Default for Hasher {
    fn default() -> Self {
        Hasher {
            state: INIT,
            block: [0; 64],
            len: 0,
        }
    }
}

impl Hasher {
    pub fn update(&mut self, mut data: &[u8]) {
        let held = (self.len % 64) as usize;
        self.len += data.len() as u64;
        if held > 0 {
            let n = (64 - held).min(data.len());
            self.block[held..held + n].copy_from_slice(&data[..n]);
            data = &data[n..];
            if held + n < 64 {
                return;
            }
            let block = self.block;
            compress_scalar(&mut self.state, &block);
        }
        let rest = compress_blocks(&mut self.state, data);
        self.block[..rest.len()].copy_from_slice(rest);
    }

    pub fn finalize(&self) -> [u8; 16] {
        let held = (self.len % 64) as usize;
        let mut state = self.state;
        pad(&mut state, &self.block[..held], self.len)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{finish, INIT, K, S, W};
    use std::arch::x86_64::*;

    /// The digests of 2..=`lanes` inputs: passes over the whole blocks all unfinished inputs
    /// still have, until fewer than two have any (lanes drop out as their inputs end), then
    /// each input's rest and padding. `lanes` is 8 only where AVX2 was detected.
    pub(super) fn group(group: &[&[u8]], lanes: usize) -> Vec<[u8; 16]> {
        let n = group.len();
        debug_assert!((2..=lanes).contains(&n) && (lanes == 4 || lanes == 8));
        let mut states = [INIT; 8];
        let mut done = [0usize; 8];
        loop {
            let active: Vec<usize> = (0..n).filter(|&l| group[l].len() - done[l] >= 64).collect();
            if active.len() < 2 {
                break;
            }
            let blocks = active
                .iter()
                .map(|&l| (group[l].len() - done[l]) / 64)
                .min()
                .unwrap_or(0);
            let mut st = [INIT; 8];
            // unused lanes re-read the first active input, which has `blocks` blocks too
            let mut ptrs = [group[active[0]][done[active[0]]..].as_ptr(); 8];
            for (i, &l) in active.iter().enumerate() {
                st[i] = states[l];
                ptrs[i] = group[l][done[l]..].as_ptr();
            }
            // SAFETY: every pointer has at least `blocks * 64` readable bytes after it (the
            // minimum over the active inputs); AVX2 is used only with `lanes == 8`, which
            // `lanes()` gives only where it detected AVX2; SSE2 is part of x86-64.
            unsafe {
                // an 8-lane pass takes less time than a 4-lane one, however few lanes are
                // used (`cargo bench --bench md5`: 2 x 2 MiB in 6.4 ms vs 7.9 ms on 4 lanes)
                if lanes == 8 {
                    compress8(&mut st, &ptrs, blocks);
                } else {
                    compress4(&mut st, &ptrs, blocks);
                }
            }
            for (i, &l) in active.iter().enumerate() {
                states[l] = st[i];
                done[l] += blocks * 64;
            }
        }
        (0..n)
            .map(|l| finish(&mut states[l], group[l], done[l]))
            .collect()
    }

    /// The 64 steps over `blocks` blocks of every lane; `$load` gathers message word i of
    /// every lane into `m[i]`. One body for both widths, so they cannot drift apart.
    macro_rules! lanes_compress {
        ($name:ident, $feat:literal, $lanes:literal, $v:ty, $load:ident,
         $loadu:path, $storeu:path, $set1:path, $add:path, $and:path, $or:path, $xor:path,
         $andnot:path, $sll:path, $srl:path, $count:path) => {
            #[target_feature(enable = $feat)]
            unsafe fn $name(state: &mut [[u32; 4]; 8], ptrs: &[*const u8; 8], blocks: usize) {
                let ptrs: [*const u8; $lanes] = std::array::from_fn(|l| ptrs[l]);
                let mut v = [$set1(0); 4];
                for (w, v) in v.iter_mut().enumerate() {
                    let mut words = [0u32; $lanes];
                    for l in 0..$lanes {
                        words[l] = state[l][w];
                    }
                    *v = $loadu(words.as_ptr() as *const $v);
                }
                let [mut a, mut b, mut c, mut d] = v;
                let ones = $set1(-1);
                for blk in 0..blocks {
                    let m = $load(&ptrs, blk * 64);
                    let (a0, b0, c0, d0) = (a, b, c, d);
                    for i in 0..64 {
                        let f = match i / 16 {
                            0 => $or($and(b, c), $andnot(b, d)),
                            1 => $or($and(b, d), $andnot(d, c)),
                            2 => $xor($xor(b, c), d),
                            _ => $xor(c, $or(b, $xor(d, ones))),
                        };
                        let t = $add($add(a, f), $add($set1(K[i] as i32), m[W[i]]));
                        let t = $or(
                            $sll(t, $count(S[i] as i32)),
                            $srl(t, $count(32 - S[i] as i32)),
                        );
                        (a, d, c) = (d, c, b);
                        b = $add(b, t);
                    }
                    a = $add(a, a0);
                    b = $add(b, b0);
                    c = $add(c, c0);
                    d = $add(d, d0);
                }
                for (w, v) in [a, b, c, d].into_iter().enumerate() {
                    let mut words = [0u32; $lanes];
                    $storeu(words.as_mut_ptr() as *mut $v, v);
                    for l in 0..$lanes {
                        state[l][w] = words[l];
                    }
                }
            }
        };
    }

    /// Words of block `off..off + 64` of 4 lanes, word-major (a 4x4 transpose per 16 bytes).
    #[target_feature(enable = "sse2")]
    unsafe fn load4(p: &[*const u8; 4], off: usize) -> [__m128i; 16] {
        let mut m = [_mm_setzero_si128(); 16];
        for q in 0..4 {
            let mut r = [_mm_setzero_si128(); 4];
            for l in 0..4 {
                r[l] = _mm_loadu_si128(p[l].add(off + q * 16) as *const __m128i);
            }
            let t0 = _mm_unpacklo_epi32(r[0], r[1]);
            let t1 = _mm_unpacklo_epi32(r[2], r[3]);
            let t2 = _mm_unpackhi_epi32(r[0], r[1]);
            let t3 = _mm_unpackhi_epi32(r[2], r[3]);
            m[q * 4] = _mm_unpacklo_epi64(t0, t1);
            m[q * 4 + 1] = _mm_unpackhi_epi64(t0, t1);
            m[q * 4 + 2] = _mm_unpacklo_epi64(t2, t3);
            m[q * 4 + 3] = _mm_unpackhi_epi64(t2, t3);
        }
        m
    }

    /// Words of block `off..off + 64` of 8 lanes, word-major (an 8x8 transpose per 32 bytes).
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: &[*const u8; 8], off: usize) -> [__m256i; 16] {
        let mut m = [_mm256_setzero_si256(); 16];
        for h in 0..2 {
            let mut r = [_mm256_setzero_si256(); 8];
            for l in 0..8 {
                r[l] = _mm256_loadu_si256(p[l].add(off + h * 32) as *const __m256i);
            }
            let t: [__m256i; 8] = [
                _mm256_unpacklo_epi32(r[0], r[1]),
                _mm256_unpackhi_epi32(r[0], r[1]),
                _mm256_unpacklo_epi32(r[2], r[3]),
                _mm256_unpackhi_epi32(r[2], r[3]),
                _mm256_unpacklo_epi32(r[4], r[5]),
                _mm256_unpackhi_epi32(r[4], r[5]),
                _mm256_unpacklo_epi32(r[6], r[7]),
                _mm256_unpackhi_epi32(r[6], r[7]),
            ];
            // u[k]: word k (low half) and k + 4 (high half) of lanes 0-3 / 4-7
            let u: [__m256i; 8] = [
                _mm256_unpacklo_epi64(t[0], t[2]),
                _mm256_unpackhi_epi64(t[0], t[2]),
                _mm256_unpacklo_epi64(t[1], t[3]),
                _mm256_unpackhi_epi64(t[1], t[3]),
                _mm256_unpacklo_epi64(t[4], t[6]),
                _mm256_unpackhi_epi64(t[4], t[6]),
                _mm256_unpacklo_epi64(t[5], t[7]),
                _mm256_unpackhi_epi64(t[5], t[7]),
            ];
            for k in 0..4 {
                m[h * 8 + k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
                m[h * 8 + k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
            }
        }
        m
    }

    lanes_compress!(
        compress4,
        "sse2",
        4,
        __m128i,
        load4,
        _mm_loadu_si128,
        _mm_storeu_si128,
        _mm_set1_epi32,
        _mm_add_epi32,
        _mm_and_si128,
        _mm_or_si128,
        _mm_xor_si128,
        _mm_andnot_si128,
        _mm_sll_epi32,
        _mm_srl_epi32,
        _mm_cvtsi32_si128
    );

    lanes_compress!(
        compress8,
        "avx2",
        8,
        __m256i,
        load8,
        _mm256_loadu_si256,
        _mm256_storeu_si256,
        _mm256_set1_epi32,
        _mm256_add_epi32,
        _mm256_and_si256,
        _mm256_or_si256,
        _mm256_xor_si256,
        _mm256_andnot_si256,
        _mm256_sll_epi32,
        _mm256_srl_epi32,
        _mm_cvtsi32_si128
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use md5::{Digest, Md5};

    fn reference(d: &[u8]) -> [u8; 16] {
        Md5::digest(d).into()
    }

    fn data(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn every_padding_case_matches_md5_in_every_lane() {
        // lengths around the 56-byte padding edge and block multiples, mixed in one group so
        // lanes stop at different blocks
        let lens = [
            0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 1000, 4096, 65_537,
        ];
        let bufs: Vec<Vec<u8>> = lens.iter().map(|&n| data(n, n as u64)).collect();
        for width in widths() {
            for group in 1..=17 {
                for start in 0..lens.len() {
                    let inputs: Vec<&[u8]> = (0..group)
                        .map(|k| bufs[(start + k) % lens.len()].as_slice())
                        .collect();
                    let got = md5_lanes(&inputs, width);
                    for (d, g) in inputs.iter().zip(&got) {
                        let len = d.len();
                        assert_eq!(*g, reference(d), "len {len}, {group} inputs, {width} lanes");
                    }
                }
            }
        }
    }

    /// Every kernel this CPU can run (and the scalar path, width 1).
    fn widths() -> Vec<usize> {
        let mut w = vec![1];
        if cfg!(target_arch = "x86_64") {
            w.push(4);
        }
        if lanes() == 8 {
            w.push(8);
        }
        w
    }

    #[test]
    fn equal_chunks_hash_like_one_at_a_time() {
        let bufs: Vec<Vec<u8>> = (0..11).map(|i| data(2 << 20, 100 + i)).collect();
        let inputs: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
        for width in widths() {
            let got = md5_lanes(&inputs, width);
            assert_eq!(got.len(), inputs.len());
            for (d, g) in inputs.iter().zip(&got) {
                assert_eq!(*g, reference(d), "{width} lanes");
            }
            // a lane's result does not depend on its neighbours
            assert_eq!(md5_lanes(&inputs[3..4], width)[0], got[3]);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batched_digests_match_and_a_lone_waiting_chunk_is_answered() {
        let bufs: Vec<Bytes> = (0..13)
            .map(|i| Bytes::from(data((1 << 20) + i * 100, 500 + i as u64)))
            .collect();
        // many at once, some waiting, some not: every answer is its own chunk's
        let tasks: Vec<_> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| tokio::spawn(digest(b.clone(), (i % 3 != 0).then(generation))))
            .collect();
        for (t, b) in tasks.into_iter().zip(&bufs) {
            assert_eq!(t.await.unwrap(), reference(b));
        }
        // one chunk that may wait, alone: answered once its wait is over
        let lone = tokio::time::timeout(
            Duration::from_secs(10),
            digest(bufs[0].clone(), Some(generation())),
        );
        assert_eq!(
            lone.await.expect("a lone chunk is hashed"),
            reference(&bufs[0])
        );
    }

    fn job(may_wait: Option<u64>) -> Job {
        Job {
            data: Bytes::from_static(b"x"),
            may_wait,
            since: Instant::now(),
            reply: oneshot::channel().0,
        }
    }

    #[test]
    fn a_chunk_sealed_before_a_kick_never_waits_however_late_it_is_queued() {
        let b = Batcher {
            queue: Mutex::new(Queue {
                threads: 1,
                ..Queue::default()
            }),
            ready: Condvar::new(),
        };
        // sealed now, nobody waiting: it may wait (other tests may kick meanwhile; retry)
        let waits = (0..5).any(|_| {
            b.lock().kicked = 0;
            b.lock().jobs.clear();
            assert!(b.push(job(Some(generation()))).is_ok());
            b.lock().kicked == 0
        });
        assert!(waits, "a chunk sealed at the current generation may wait");
        // sealed, then a flush kicks before its upload reaches the queue: it must not wait
        b.lock().jobs.clear();
        b.lock().kicked = 0;
        let sealed = generation();
        b.kick();
        assert!(b.push(job(Some(sealed))).is_ok());
        assert_eq!(b.lock().kicked, 1, "the late chunk is due at once");
        // a flush's own chunk never waits, and takes the queue ahead of it along
        b.lock().kicked = 0;
        assert!(b.push(job(Some(generation()))).is_ok());
        assert!(b.push(job(None)).is_ok());
        let q = b.lock();
        assert_eq!(q.kicked, q.jobs.len());
        drop(q);
        // with no hashing thread left, callers get their job back and hash it themselves
        b.lock().threads = 0;
        assert!(b.push(job(None)).is_err());
    }

    #[test]
    fn known_vectors() {
        let hex = |d: [u8; 16]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let got = md5_many(&[b"", b"abc", b"message digest", b"abc"]);
        assert_eq!(hex(got[0]), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hex(got[1]), "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(hex(got[2]), "f96b697d7cb7938d525a2f31aaf161d0");
        assert_eq!(got[3], got[1]);
    }

    /// The scalar hasher, whole or fed in pieces of every size class (within a block,
    /// across blocks, ending on a block's edge, around the padding's 56 bytes), is MD5.
    #[test]
    fn the_scalar_hasher_fed_in_any_pieces_is_md5() {
        for len in [
            0,
            1,
            55,
            56,
            57,
            63,
            64,
            65,
            119,
            120,
            128,
            1000,
            65536,
            1 << 20,
        ] {
            let d = data(len, len as u64 + 3);
            assert_eq!(md5_one(&d), reference(&d), "len {len}");
            for piece in [1, 7, 63, 64, 65, 200, 4096] {
                let mut h = Hasher::default();
                for p in d.chunks(piece) {
                    h.update(p);
                }
                assert_eq!(
                    h.finalize(),
                    reference(&d),
                    "len {len} in pieces of {piece}"
                );
                // finalize leaves the stream as it was: more can follow
                h.update(b"x");
                let mut more = d.clone();
                more.push(b'x');
                assert_eq!(h.finalize(), reference(&more), "len {len} + 1");
            }
        }
    }

    #[test]
    fn the_scalar_finish_alone_is_md5() {
        for len in [0, 3, 56, 64, 200] {
            let d = data(len, 7);
            let mut st = INIT;
            assert_eq!(finish(&mut st, &d, 0), reference(&d));
        }
    }
}
