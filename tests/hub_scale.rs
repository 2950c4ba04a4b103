//! Benchmark (ignored by default; docs/BENCHMARKS.md "Many volumes per node"): N volumes
//! staged in one process against N `weed mount`s on one real filer. Prints the filer's
//! subscriber count (its own `ListMetadataSubscribers`), the TCP connections to the filer's
//! gRPC port, event delivery latency (HTTP write -> name in a listing we hold) with 1 and N
//! volumes, and idle CPU.
//!
//! ```text
//! PATH=/opt/seaweedfs-csi-venv/bin:$PATH cargo test --release --features test-support \
//!     --test hub_scale -- --ignored --nocapture        # HUB_BENCH_VOLUMES=50 by default
//! ```

mod common;
mod fuse_support;

use common::WeedServer;
use fuse_support::*;
use seaweedfs_csi_driver::config::MountOptions;
use seaweedfs_csi_driver::fuse::session::MountedVolume;
use seaweedfs_csi_driver::pb::filer as pb;
use seaweedfs_csi_driver::security::SecurityConfig;
use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SAMPLES: usize = 40;

struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            lazy_unmount(&self.0);
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// Subscribers per client type, from the filer's admin API.
async fn subscribers(grpc: &str) -> Vec<pb::MetadataSubscriber> {
    let mut c = pb::seaweed_filer_client::SeaweedFilerClient::connect(format!("http://{grpc}"))
        .await
        .expect("filer gRPC");
    c.list_metadata_subscribers(pb::ListMetadataSubscribersRequest::default())
        .await
        .expect("ListMetadataSubscribers")
        .into_inner()
        .subscribers
}

/// Established TCP connections from the processes `pids` to `port` on 127.0.0.1.
fn connections_to(pids: &[u32], port: u16) -> usize {
    let mut inodes = HashSet::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(t) = std::fs::read_link(fd.path()) {
                let t = t.to_string_lossy().to_string();
                if let Some(i) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                    inodes.insert(i.to_string());
                }
            }
        }
    }
    let want = format!(":{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 9 && f[2].ends_with(&want) && f[3] == "01" && inodes.contains(f[9])
        })
        .count()
}

/// CPU seconds (user + system) used so far by `pids`.
fn cpu_secs(pids: &[u32]) -> f64 {
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|s| {
            let rest = &s[s.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / tick)
        })
        .sum()
}

/// A small file through the filer's HTTP API (multipart POST), without spawning curl.
fn http_post(addr: &str, path: &str, data: &[u8]) {
    let b = "hubbenchboundary";
    let mut body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(data);
    body.extend_from_slice(format!("\r\n--{b}--\r\n").as_bytes());
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: multipart/form-data; boundary={b}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(&body).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 2"), "{resp}");
}

fn listed(dir: &Path, name: &str) -> bool {
    std::fs::read_dir(dir)
        .map(|it| it.flatten().any(|e| e.file_name() == name))
        .unwrap_or(false)
}

/// Write through HTTP into one of `vols` (round robin) and time until the name shows in that
/// volume's listing (polled every ms). Returns sorted milliseconds.
fn latencies(filer: &str, vols: &[(PathBuf, String)], tag: &str) -> Vec<f64> {
    for (dir, _) in vols {
        let _ = listed(dir, "warm");
    }
    let mut out = Vec::new();
    for k in 0..SAMPLES {
        let (dir, root) = &vols[k % vols.len()];
        let name = format!("{tag}-{k}");
        let t0 = Instant::now();
        http_post(filer, &format!("{root}/{name}"), b"x");
        // polled every ms (wait_until's 50 ms steps would be the measurement)
        while !listed(dir, &name) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{name} not visible in {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        out.push(t0.elapsed().as_secs_f64() * 1000.0);
        std::thread::sleep(Duration::from_millis(50));
    }
    out.sort_by(|a, b| a.partial_cmp(b).unwrap());
    out
}

fn pct(v: &[f64], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn rss_kib(pids: &[u32]) -> u64 {
    pids.iter().map(|&p| common::rss_kib(p)).sum()
}

fn idle_cpu_percent(pids: &[u32], secs: u64) -> f64 {
    let c0 = cpu_secs(pids);
    std::thread::sleep(Duration::from_secs(secs));
    (cpu_secs(pids) - c0) / secs as f64 * 100.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "benchmark: minutes, 50 mounts"]
async fn many_volumes_one_subscription_against_weed_mounts() {
    let n: usize = std::env::var("HUB_BENCH_VOLUMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let w = blocking(WeedServer::start).await;
    let grpc_port = w.filer_port + 10000;
    let grpc = format!("127.0.0.1:{grpc_port}");
    let filer = w.filer_addr();
    let base = unique_path("scale");
    let me = std::process::id();
    let sec = SecurityConfig::default();

    // ours: one volume first, then n
    let mut tmps = Vec::new();
    let mut guards = Vec::new();
    let mut vols = Vec::new();
    let mut ours: Vec<(PathBuf, String)> = Vec::new();
    let t_stage = Instant::now();
    for i in 0..n {
        let (tmp, dir) = mount_dir("scale");
        guards.push(Unmount(dir.clone()));
        tmps.push(tmp);
        let root = format!("{base}/v{i}");
        let opts = MountOptions {
            filers: vec![filer.clone()],
            filer_path: root.clone(),
            ..Default::default()
        };
        vols.push(MountedVolume::mount(&opts, &sec, &dir).await.unwrap());
        ours.push((dir, root));
        if i == 0 {
            let one = ours.clone();
            let f = filer.clone();
            let l1 = blocking(move || latencies(&f, &one, "one")).await;
            println!(
                "ours, 1 volume: latency p50 {:.1} ms p99 {:.1} ms max {:.1} ms",
                pct(&l1, 0.5),
                pct(&l1, 0.99),
                l1[l1.len() - 1]
            );
        }
    }
    let staged_in = t_stage.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // before this process opens its own admin connection for the subscriber list
    let our_conns = connections_to(&[me], grpc_port);
    let subs = subscribers(&grpc).await;
    let our_subs = subs
        .iter()
        .filter(|s| s.client_type == "seaweedfs-csi")
        .count();
    let all = ours.clone();
    let f = filer.clone();
    let ln = blocking(move || latencies(&f, &all, "many")).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let our_cpu = blocking(move || idle_cpu_percent(&[me], 20)).await;
    let our_rss = rss_kib(&[me]);
    println!(
        "ours, {n} volumes (staged in {:.1} s): filer subscribers {our_subs}, connections to filer gRPC {our_conns}, \
         latency p50 {:.1} ms p99 {:.1} ms max {:.1} ms, idle CPU {our_cpu:.2} % of one core, RSS {} MiB (test process)",
        staged_in.as_secs_f64(),
        pct(&ln, 0.5),
        pct(&ln, 0.99),
        ln[ln.len() - 1],
        our_rss / 1024
    );
    for v in vols {
        v.unmount().await.unwrap();
    }
    drop(guards);

    // n weed mounts
    let wbase = unique_path("scale-weed");
    let mut mounts = Vec::new();
    let t_weed = Instant::now();
    for i in 0..n {
        let wr = &w;
        let root = format!("{wbase}/m{i}");
        // the root must exist for weed mount
        wr.filer_put(&format!("{root}/.keep"), b"", "");
        let g = tokio::task::block_in_place(|| mount_weed(wr, &root));
        mounts.push((g, root));
    }
    let weed_in = t_weed.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pids: Vec<u32> = mounts.iter().map(|(g, _)| g.pid()).collect();
    let subs = subscribers(&grpc).await;
    let weed_subs = subs.iter().filter(|s| s.client_type == "mount").count();
    let weed_conns = connections_to(&pids, grpc_port);
    let wl: Vec<(PathBuf, String)> = mounts
        .iter()
        .map(|(g, r)| (g.path().to_path_buf(), r.clone()))
        .collect();
    let f = filer.clone();
    let lw = blocking(move || latencies(&f, &wl, "weed")).await;
    let p2 = pids.clone();
    let weed_cpu = blocking(move || idle_cpu_percent(&p2, 20)).await;
    let rss_kb = rss_kib(&pids);
    println!(
        "weed mount x{n} (mounted in {:.1} s): filer subscribers {weed_subs}, connections to filer gRPC {weed_conns}, \
         latency p50 {:.1} ms p99 {:.1} ms max {:.1} ms, idle CPU {weed_cpu:.2} % of one core, RSS {} MiB",
        weed_in.as_secs_f64(),
        pct(&lw, 0.5),
        pct(&lw, 0.99),
        lw[lw.len() - 1],
        rss_kb / 1024
    );
    let kinds: Vec<String> = subs
        .iter()
        .map(|s| format!("{}:{}", s.client_type, s.path_prefix))
        .take(3)
        .collect();
    println!("(filer subscriber sample: {kinds:?})");
    blocking(move || {
        drop(mounts);
        drop(w);
    })
    .await;
    assert_eq!(our_subs, 1);
}
