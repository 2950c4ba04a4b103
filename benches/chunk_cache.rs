//! Chunk cache (src/cache): a hit, a miss (fetch + insert, evictions included once the cache is
//! full) and a miss that 16 concurrent readers of one chunk share (one fetch, coalesced).
//! `cargo bench --bench chunk_cache`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use seaweedfs_csi_driver::cache::ChunkCache;

const CHUNK: usize = 64 * 1024;
const CAPACITY: u64 = 64 << 20;

fn chunk_cache(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let data = Bytes::from(vec![7u8; CHUNK]);
    let mut g = c.benchmark_group("chunk_cache");
    g.throughput(Throughput::Elements(1));

    let cache = ChunkCache::new(CAPACITY);
    rt.block_on(async {
        cache.insert("3,hit".to_string(), data.clone()).await;
        cache.run_pending_tasks().await;
    });
    g.bench_function("hit", |b| {
        b.to_async(&rt).iter(|| async {
            let r = cache
                .get_or_fetch("3,hit", async { Err::<Bytes, ()>(()) })
                .await;
            assert_eq!(r.unwrap().len(), CHUNK);
        })
    });

    let next = AtomicU64::new(0);
    g.bench_function("miss", |b| {
        b.to_async(&rt).iter(|| async {
            let fid = format!("4,{:x}", next.fetch_add(1, Ordering::Relaxed));
            let d = data.clone();
            let r = cache
                .get_or_fetch(&fid, async move { Ok::<_, ()>(d) })
                .await;
            assert_eq!(r.unwrap().len(), CHUNK);
        })
    });

    // 16 readers miss on the same chunk at once: one fetch runs, the others wait for it.
    const READERS: usize = 16;
    let fetches = Arc::new(AtomicU64::new(0));
    g.bench_function("coalesced_miss_16_readers", |b| {
        b.to_async(&rt).iter(|| async {
            let fid = format!("5,{:x}", next.fetch_add(1, Ordering::Relaxed));
            let reads = (0..READERS).map(|_| {
                let (d, n, fid) = (data.clone(), fetches.clone(), fid.as_str());
                let cache = &cache;
                async move {
                    cache
                        .get_or_fetch(fid, async move {
                            n.fetch_add(1, Ordering::Relaxed);
                            // let the other readers arrive while the fetch is in flight
                            tokio::task::yield_now().await;
                            Ok::<_, ()>(d)
                        })
                        .await
                }
            });
            for r in futures::future::join_all(reads).await {
                assert_eq!(r.unwrap().len(), CHUNK);
            }
        })
    });
    g.finish();
    let (hits, misses) = (
        cache.stats.hits.load(Ordering::Relaxed),
        cache.stats.misses.load(Ordering::Relaxed),
    );
    // every coalesced batch fetched once: misses == fetches of the miss + coalesced runs
    assert!(hits > 0 && misses > 0);
}

criterion_group!(benches, chunk_cache);
criterion_main!(benches);
