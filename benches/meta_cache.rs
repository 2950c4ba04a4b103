//! Metadata cache (src/fs/meta.rs): lookups in a cached directory of 10, 1,000 and 50,000
//! entries (a hit, an authoritative miss) and in a directory that is not cached. A lookup is a
//! hash of the directory plus a B-tree search of the name: it must not grow with the directory.
//! Also measures the memory one cached entry takes (resident bytes per entry of a 200,000-entry
//! listing of one-chunk files, against the weight the budget charges for it), and the memory
//! one node of the inode table takes (1,000,000 files the kernel holds after a walk).
//! `cargo bench --bench meta_cache`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use seaweedfs_csi_driver::fs::meta::{entry_weight, Cached, MetaCache};
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

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// A file entry as the filer lists one: attributes and one chunk.
fn file_entry(i: usize) -> pb::Entry {
    pb::Entry {
        name: format!("file-{i:08}.dat"),
        attributes: Some(pb::FuseAttributes {
            file_size: 4096,
            mtime: 1_700_000_000,
            file_mode: 0o644,
            uid: 1000,
            gid: 1000,
            crtime: 1_700_000_000,
            inode: i as u64 * 7919,
            ..Default::default()
        }),
        chunks: vec![pb::FileChunk {
            file_id: format!("3,{i:x}0a1b2c3d"),
            size: 4096,
            modified_ts_ns: 1_700_000_000_000_000_000,
            e_tag: "d41d8cd98f00b204e9800998ecf8427e".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn memory_per_entry(c: &mut Criterion) {
    const N: usize = 200_000;
    let cache = MetaCache::new(Duration::from_secs(3600));
    let before = rss_bytes();
    // as a listing arrives: decoded entries, then the cache's tree of them
    let entries: Vec<pb::Entry> = (0..N).map(file_entry).collect();
    let weight: u64 = entries.iter().map(entry_weight).sum();
    assert!(cache.install(
        "/buckets/big",
        entries,
        cache.generation("/buckets/big"),
        &[]
    ));
    let after = rss_bytes();
    println!(
        "meta_cache memory: {N} cached file entries: {:.0} resident bytes per entry (measured), \
         {:.0} charged per entry (entry_weight)",
        after.saturating_sub(before) as f64 / N as f64,
        weight as f64 / N as f64
    );
    let e = file_entry(1);
    c.bench_function("meta_cache/entry_weight", |b| {
        b.iter(|| entry_weight(black_box(&e)))
    });
}

/// The inode table's cost per node the kernel holds: a `find` that stats 1,000,000 files
/// leaves the kernel holding every one of them (until memory pressure makes it forget), and
/// the session holds a record of each.
fn memory_per_inode(c: &mut Criterion) {
    use seaweedfs_csi_driver::fs::inode::{FileId, InodeTable};
    const N: u64 = 1_000_000;
    let before = rss_bytes();
    let table = InodeTable::new("/buckets/pvc-0123");
    for i in 0..N {
        let id = FileId {
            base: 1_000_000 + i * 7919,
            birth: (1_700_000_000, 0),
            is_dir: false,
        };
        let path = format!("/buckets/pvc-0123/big/entry-{i:07}");
        table.remember_file(id.base, &path, &id, true);
    }
    let after = rss_bytes();
    println!(
        "meta_cache memory: inode table of {} nodes: {:.0} resident bytes per node",
        table.len(),
        after.saturating_sub(before) as f64 / N as f64
    );
    // a rename in a table of a million: one file, and a directory of 1,000
    for i in 0..1000 {
        let id = FileId {
            base: 500 + i,
            birth: (1_700_000_000, 0),
            is_dir: false,
        };
        table.remember_file(id.base, &format!("/buckets/pvc-0123/d/f{i}"), &id, true);
    }
    let (a, b) = (
        "/buckets/pvc-0123/big/entry-0000007",
        "/buckets/pvc-0123/big/renamed",
    );
    c.bench_function("inode_table/rename_file_among_1M", |bch| {
        bch.iter(|| {
            table.rename(a, b, true);
            table.rename(b, a, true);
        })
    });
    let (a, b) = ("/buckets/pvc-0123/d", "/buckets/pvc-0123/e");
    c.bench_function("inode_table/rename_dir_of_1000_among_1M", |bch| {
        bch.iter(|| {
            table.rename(a, b, false);
            table.rename(b, a, false);
        })
    });
    // kept: its freed memory would be measured as the next benchmark's
    std::mem::forget(table);
}

criterion_group!(benches, memory_per_inode, lookups, memory_per_entry);
criterion_main!(benches);
