//! Chunk model (src/chunks.rs) at 10, 1,000 and 50,000 chunks: building the visible intervals
//! (O(n log n) by design), and the per-operation paths that must not grow with n: painting a
//! new write at the end (an append) or over one chunk in the middle (an overwrite), planning a
//! 128 KiB read and clipping the intervals to it (binary search + the pieces touched).
//! `cargo bench --bench chunks`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use seaweedfs_csi_driver::chunks::{
    intervals_in, paint, read_plan, visible_intervals, VisibleInterval,
};
use seaweedfs_csi_driver::pb::filer as pb;
use std::hint::black_box;

const CHUNK: u64 = 1 << 20;
const SIZES: [usize; 3] = [10, 1_000, 50_000];

/// A file written sequentially in 1 MiB chunks.
fn sequential(n: usize) -> Vec<pb::FileChunk> {
    (0..n)
        .map(|i| pb::FileChunk {
            file_id: format!("3,{i:x}"),
            offset: (i as u64 * CHUNK) as i64,
            size: CHUNK,
            modified_ts_ns: i as i64 + 1,
            ..Default::default()
        })
        .collect()
}

/// Sequential chunks, then every 7th 1 MiB range rewritten by a chunk that straddles two old
/// ones (so the intervals are split pieces of different chunks).
fn overwritten(n: usize) -> Vec<pb::FileChunk> {
    let mut v = sequential(n);
    let ts0 = n as i64 + 1;
    for (k, i) in (0..n).step_by(7).enumerate() {
        v.push(pb::FileChunk {
            file_id: format!("4,{i:x}"),
            offset: (i as u64 * CHUNK + CHUNK / 2) as i64,
            size: CHUNK,
            modified_ts_ns: ts0 + k as i64,
            ..Default::default()
        });
    }
    v
}

fn build(c: &mut Criterion) {
    let mut g = c.benchmark_group("visible_intervals");
    for n in SIZES {
        let seq = sequential(n);
        let ow = overwritten(n);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("sequential", n), &seq, |b, ch| {
            b.iter(|| visible_intervals(black_box(ch)))
        });
        g.throughput(Throughput::Elements(ow.len() as u64));
        g.bench_with_input(BenchmarkId::new("overwritten", n), &ow, |b, ch| {
            b.iter(|| visible_intervals(black_box(ch)))
        });
    }
    g.finish();
}

fn per_op(c: &mut Criterion) {
    let mut g = c.benchmark_group("per_op");
    g.throughput(Throughput::Elements(1));
    for n in SIZES {
        let chunks = overwritten(n);
        let mut ivs = visible_intervals(&chunks);
        let end = ivs.last().unwrap().stop;
        let size = end;
        let mid = end / 2;

        // An append: the new chunk lands after the last interval. Popping it restores the list.
        g.bench_function(BenchmarkId::new("paint_append", n), |b| {
            b.iter(|| {
                paint(
                    &mut ivs,
                    VisibleInterval {
                        start: end,
                        stop: end + CHUNK,
                        chunk_index: chunks.len(),
                        offset_in_chunk: 0,
                        modified_ts_ns: i64::MAX,
                    },
                );
                ivs.pop()
            })
        });

        // An overwrite of exactly one visible interval in the middle, newer each time: the list
        // keeps its length (one interval replaced in place).
        let i = ivs.len() / 2;
        let (s, e) = (ivs[i].start, ivs[i].stop);
        let mut ts = i64::MAX / 2;
        g.bench_function(BenchmarkId::new("paint_overwrite_middle", n), |b| {
            b.iter(|| {
                ts += 1;
                paint(
                    &mut ivs,
                    VisibleInterval {
                        start: s,
                        stop: e,
                        chunk_index: chunks.len() + 1,
                        offset_in_chunk: 0,
                        modified_ts_ns: ts,
                    },
                );
            })
        });
        assert_eq!(ivs.len(), visible_intervals(&chunks).len());

        g.bench_function(BenchmarkId::new("read_plan_128k_middle", n), |b| {
            b.iter(|| read_plan(black_box(&ivs), black_box(mid), 128 << 10, size))
        });
        g.bench_function(BenchmarkId::new("intervals_in_128k_middle", n), |b| {
            b.iter(|| intervals_in(black_box(&ivs), black_box(mid), mid + (128 << 10)))
        });
    }
    g.finish();
}

criterion_group!(benches, build, per_op);
criterion_main!(benches);
