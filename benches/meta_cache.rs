//! Metadata cache (src/fs/meta.rs): lookups in a cached directory of 10, 1,000 and 50,000
//! entries (a hit, an authoritative miss) and in a directory that is not cached. A lookup is a
//! hash of the directory plus a B-tree search of the name: it must not grow with the directory.
//! `cargo bench --bench meta_cache`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use seaweedfs_csi_driver::fs::meta::{Cached, MetaCache};
use seaweedfs_csi_driver::pb::filer as pb;

fn lookups(c: &mut Criterion) {
    let mut g = c.benchmark_group("meta_cache");
    g.throughput(Throughput::Elements(1));
    for n in [10usize, 1_000, 50_000] {
        let cache = MetaCache::new(Duration::from_secs(3600));
        // other cached directories beside the one looked up
        for d in 0..100 {
            let dir = format!("/buckets/other{d}");
            cache.install(&dir, vec![], cache.generation(&dir), &[]);
        }
        let dir = format!("/buckets/dir{n}");
        let entries = (0..n)
            .map(|i| pb::Entry {
                name: format!("file-{i:08}.dat"),
                ..Default::default()
            })
            .collect();
        assert!(cache.install(&dir, entries, cache.generation(&dir), &[]));
        let name = format!("file-{:08}.dat", n / 2);
        g.bench_function(BenchmarkId::new("lookup_hit", n), |b| {
            b.iter(|| {
                assert!(matches!(
                    cache.lookup(black_box(&dir), black_box(&name)),
                    Cached::Found(_)
                ))
            })
        });
        g.bench_function(BenchmarkId::new("lookup_absent", n), |b| {
            b.iter(|| {
                assert!(matches!(
                    cache.lookup(black_box(&dir), black_box("file-99999999.tmp")),
                    Cached::Absent
                ))
            })
        });
        g.bench_function(BenchmarkId::new("lookup_uncached_dir", n), |b| {
            b.iter(|| {
                assert!(matches!(
                    cache.lookup(black_box("/buckets/nowhere"), black_box(&name)),
                    Cached::Unknown
                ))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, lookups);
criterion_main!(benches);
