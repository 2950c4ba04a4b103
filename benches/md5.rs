//! MD5 of upload chunks (src/volume/md5x.rs): 8 chunks of 2 MiB hashed one by one with the
//! `md-5` crate, as every upload did before, with our scalar hasher (one stream, as a file
//! that fsyncs often hashes its appends), and side by side in SIMD lanes.
//! `cargo bench --bench md5`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use md5::{Digest, Md5};
use seaweedfs_csi_driver::volume::md5x::{md5_many, md5_one};
use std::hint::black_box;

const CHUNK: usize = 2 << 20;
const N: usize = 8;

fn bench(c: &mut Criterion) {
    let bufs: Vec<Vec<u8>> = (0..N)
        .map(|i| (0..CHUNK).map(|j| (j * 31 + i * 7) as u8).collect())
        .collect();
    let inputs: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
    let mut g = c.benchmark_group("md5 8 x 2 MiB");
    g.throughput(Throughput::Bytes((CHUNK * N) as u64));
    g.sample_size(20);
    g.bench_function("one by one (md-5)", |b| {
        b.iter(|| {
            for d in &inputs {
                black_box(Md5::digest(black_box(d)));
            }
        })
    });
    g.bench_function("one by one (ours)", |b| {
        b.iter(|| {
            for d in &inputs {
                black_box(md5_one(black_box(d)));
            }
        })
    });
    g.bench_function("lanes", |b| {
        b.iter(|| black_box(md5_many(black_box(&inputs))))
    });
    g.finish();
    // fewer chunks than lanes: what a batch of a single sequential writer looks like
    for n in [2, 4] {
        let mut g = c.benchmark_group(format!("md5 {n} x 2 MiB"));
        g.throughput(Throughput::Bytes((CHUNK * n) as u64));
        g.sample_size(20);
        g.bench_function("lanes", |b| {
            b.iter(|| black_box(md5_many(black_box(&inputs[..n]))))
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
