//! Node plugin memory under load (issue: one node-wide budget): the real driver binary with
//! `--memoryBudgetMB`, driven over its CSI socket like kubelet, against a real `weed server`.
//! While its resident memory is sampled every 100 ms, at once:
//!
//! - `VOLUMES` volumes are staged and published (20);
//! - 8 writers each write 1,000 files of 32 KiB in 4 KiB writes (volumes 4..12);
//! - `find` plus a stat of every name walks a directory of `ENTRIES` names (volume 12);
//! - 4 readers each read their own `READ_MB` file sequentially (volumes 0..4).
//!
//! It reports the peak against the budget. `cargo bench --features test-support --bench
//! node_memory` (the feature gives `fill-dir`, which makes the big directory over gRPC;
//! without it the names are created through the mount, which is slow). Sizes come from the
//! environment: `NODE_MEM_BUDGET_MB` (1024), `NODE_MEM_VOLUMES` (20), `NODE_MEM_READ_MB`
//! (1024 per reader), `NODE_MEM_ENTRIES` (200000).

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/csi_common/mod.rs"]
mod csi_common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn write_file(path: &Path, mib: u64) {
    let mut f = std::fs::File::create(path).unwrap();
    let block: Vec<u8> = (0..1 << 20).map(|i| (i % 253) as u8).collect();
    for _ in 0..mib {
        f.write_all(&block).unwrap();
    }
    f.sync_all().unwrap();
}

fn fill_dir(filer: &str, volume_path: &str, mount_dir: &Path, n: u64) {
    let t0 = Instant::now();
    common::fill_dir(filer, volume_path, mount_dir, n);
    eprintln!(
        "node_memory: {n} names in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("node_memory: bench");
        return;
    }
    // `cargo test --all-targets` runs this once without `--bench`: tiny sizes, so that it
    // keeps working without costing the test run minutes
    let measuring = std::env::args().any(|a| a == "--bench");
    let tiny = |n: u64, small: u64| if measuring { n } else { small };
    let budget_mb = env_or("NODE_MEM_BUDGET_MB", tiny(1024, 256));
    let volumes = env_or("NODE_MEM_VOLUMES", tiny(20, 13)).max(13) as usize;
    let read_mb = env_or("NODE_MEM_READ_MB", tiny(1024, 8));
    let entries = env_or("NODE_MEM_ENTRIES", tiny(200_000, 2_000));
    if !measuring {
        eprintln!("node_memory: test mode (no --bench), tiny sizes");
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 20 collections of 7 volumes each, and the readers' files
    let weed = common::WeedServer::start_with(common::WeedOptions {
        max_volumes: 200 + (4 * 2 * read_mb / 256) as u32,
        ..Default::default()
    });
    let port = common::free_port();
    let dir = tempfile::Builder::new()
        .prefix("nodemem")
        .tempdir()
        .unwrap();
    let socket = dir.path().join("plugin/csi.sock");
    let args = vec![
        format!("--endpoint=unix://{}", socket.display()),
        format!("--filer={}", weed.filer_addr()),
        "--nodeid=node-1".to_string(),
        format!("--metricsPort={port}"),
        format!("--memoryBudgetMB={budget_mb}"),
    ];
    let driver = csi_common::Driver::start_raw(dir, socket, csi_common::Stager::Fuse, args, vec![]);
    let pid = driver.pid().unwrap();
    let pods: Vec<(PathBuf, String)> = rt.block_on(async {
        let mut pods = Vec::new();
        for v in 0..volumes {
            // room for the file read and its rewrite
            let bytes = ((2 * read_mb + 256) << 20) as i64;
            let pod = driver
                .provision_and_publish_sized(&format!("pvc-mem-{v}"), &format!("pod-{v}"), bytes)
                .await;
            pods.push((pod.target.clone(), pod.vol.volume_id.clone()));
        }
        pods
    });
    let idle = common::rss_kib(pid);
    eprintln!(
        "node_memory: {volumes} volumes staged, plugin resident {} MiB",
        idle / 1024
    );
    // fixtures: 4 files to read, one big directory to walk
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (target, _) in pods.iter().take(4) {
            s.spawn(move || write_file(&target.join("data"), read_mb));
        }
    });
    eprintln!(
        "node_memory: 4 x {read_mb} MiB written in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    fill_dir(&weed.filer_addr(), &pods[12].1, &pods[12].0, entries);
    // at once: sampled
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (done, peak) = (done.clone(), peak.clone());
        std::thread::spawn(move || {
            let mut meta_peak = 0f64;
            let mut cache_peak = 0f64;
            let mut dirty_peak = 0f64;
            let mut inodes_peak = 0f64;
            let mut n = 0u64;
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(common::rss_kib(pid), Ordering::Relaxed);
                if n % 10 == 0 {
                    let m = scrape(port);
                    meta_peak =
                        meta_peak.max(common::metric(&m, "seaweedfs_csi_metadata_cache_bytes"));
                    cache_peak =
                        cache_peak.max(common::metric(&m, "seaweedfs_csi_memory_cache_bytes"));
                    dirty_peak = dirty_peak.max(common::metric(&m, "seaweedfs_csi_dirty_bytes"));
                    inodes_peak = inodes_peak.max(common::metric_sum(&m, "seaweedfs_csi_inodes"));
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            (meta_peak, cache_peak, dirty_peak, inodes_peak)
        })
    };
    let t0 = Instant::now();
    let (walked, read, written) = std::thread::scope(|s| {
        let readers: Vec<_> = pods
            .iter()
            .take(4)
            .map(|(target, _)| {
                s.spawn(move || {
                    let mut f = std::fs::File::open(target.join("data")).unwrap();
                    let mut buf = vec![0u8; 1 << 20];
                    let mut total = 0u64;
                    loop {
                        let n = f.read(&mut buf).unwrap();
                        if n == 0 {
                            break total;
                        }
                        total += n as u64;
                    }
                })
            })
            .collect();
        let writers: Vec<_> = pods[4..12]
            .iter()
            .map(|(target, _)| {
                s.spawn(move || {
                    let d = target.join("small");
                    std::fs::create_dir_all(&d).unwrap();
                    let block = [7u8; 4096];
                    for i in 0..1000 {
                        let mut f = std::fs::File::create(d.join(format!("f{i:04}"))).unwrap();
                        for _ in 0..8 {
                            f.write_all(&block).unwrap();
                        }
                    }
                    1000u64
                })
            })
            .collect();
        let walker = s.spawn(|| {
            let out = std::process::Command::new("find")
                .arg(pods[12].0.join("big"))
                .args(["-type", "f", "-printf", "%s\n"])
                .output()
                .unwrap();
            assert!(out.status.success(), "find failed");
            out.stdout.iter().filter(|&&b| b == b'\n').count() as u64
        });
        let read: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
        let written: u64 = writers.into_iter().map(|h| h.join().unwrap()).sum();
        (walker.join().unwrap(), read, written)
    });
    let secs = t0.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let (meta_peak, cache_peak, dirty_peak, inodes_peak) = sampler.join().unwrap();
    let peak_mib = peak.load(Ordering::Relaxed) as f64 / 1024.0;
    let mib = |v: f64| v / 1048576.0;
    println!(
        "node_memory: budget {budget_mb} MiB, {volumes} volumes; in {secs:.0} s: {walked} of \
         {entries} names found and stat'ed, {} MiB read by 4 readers, {written} files written by \
         8 writers",
        read >> 20
    );
    println!(
        "node_memory: peak resident {peak_mib:.0} MiB (budget + {:.0} MiB; idle with {volumes} \
         volumes: {} MiB); peaks of the parts: chunk cache {:.0} MiB, listings {:.0} MiB, \
         dirty {:.0} MiB; inodes the kernel held: {inodes_peak:.0}",
        peak_mib - budget_mb as f64,
        idle / 1024,
        mib(cache_peak),
        mib(meta_peak),
        mib(dirty_peak)
    );
    assert_eq!(walked, entries, "find missed names");
    assert_eq!(read, 4 * (read_mb << 20), "a reader read short");
    drop(driver);
    drop(weed);
}
