//! `/metrics` and `/healthz` over real TCP: the numbers a scraper sees move when operations
//! happen, both for synthetic timers and for a real FUSE mount against a real `weed`.

mod common;
mod csi_common;

use common::{metric as sample, metric_sum as sum_of};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use seaweedfs_csi_driver::metrics;
use seaweedfs_csi_driver::metrics_server::{HealthCheck, MetricsServer};

/// Raw request -> (status, headers, body). Blocking, with timeouts, on a plain std socket so the
/// client shares nothing with the server's runtime.
fn raw(addr: SocketAddr, request: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).unwrap();
    parse_response(&buf)
}

/// An HTTP/1 response -> (status, headers, body); status 0 if there is none.
fn parse_response(buf: &[u8]) -> (u16, String, String) {
    let text = String::from_utf8_lossy(buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let (status, _, body) = raw(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
    );
    (status, body)
}

/// Every metric the Grafana dashboard (deploy/grafana) queries is a series of this scrape (a
/// real driver with a staged, used volume), and every label it groups or filters by (other
/// than `pod` and `le`, which Prometheus and histograms add) is a label of those series.
fn assert_dashboard_queries_exist(scrape: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/grafana/seaweedfs-csi-driver.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            exprs.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["definition"].as_str() {
            exprs.push(q.to_string());
        }
    }
    assert!(exprs.len() >= 15, "{exprs:?}");
    let series: std::collections::BTreeSet<&str> = scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap())
        .collect();
    let mut names = std::collections::BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("seaweedfs_csi_") {
            let n: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + n.len()..];
            names.insert(n);
        }
        // labels in `by (...)` and `{label=~...}`
        for part in e.split("by (").skip(1) {
            for l in part.split(')').next().unwrap().split(',') {
                let l = l.trim();
                if l != "pod" && l != "le" {
                    assert!(
                        scrape.contains(&format!("{{{l}=\""))
                            || scrape.contains(&format!(",{l}=\"")),
                        "dashboard groups by {l}, which no series has: {e}"
                    );
                }
            }
        }
    }
    assert!(names.len() >= 15, "{names:?}");
    for n in &names {
        assert!(
            series.contains(n.as_str()),
            "the dashboard queries {n}, which the driver does not serve:\n{scrape}"
        );
    }
    // the per-volume panels really have a volume to show
    assert!(scrape.contains(r#"seaweedfs_csi_fuse_op_seconds_count{op="write",volume=""#));
}

/// Every non-comment line is `name{...} number`, and every family has HELP and TYPE.
fn assert_exposition_format(text: &str) {
    for l in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = l.strip_prefix("# ") {
            assert!(
                rest.starts_with("HELP ") || rest.starts_with("TYPE "),
                "bad comment: {l}"
            );
            continue;
        }
        let (k, v) = l
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {l}"));
        assert!(v.parse::<f64>().is_ok(), "bad value in {l}");
        let name = k.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad name in {l}"
        );
        let family = [
            "_bucket", "_sum", "_count", // histogram children
        ]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
        assert!(
            text.contains(&format!("# TYPE {family} "))
                || text.contains(&format!("# TYPE {name} ")),
            "no TYPE line for {name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_sees_ops_and_health() {
    let healthy = Arc::new(AtomicBool::new(true));
    let h = healthy.clone();
    let check: HealthCheck = Arc::new(move || {
        if h.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("filer unreachable".into())
        }
    });
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), Some(check))
        .await
        .unwrap();
    let addr = server.local_addr();

    let (before_status, before) = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
        .await
        .unwrap();
    assert_eq!(before_status, 200);
    let count = r#"seaweedfs_csi_fuse_op_seconds_count{op="mknod",volume="/t/\"q\""}"#;
    let errors = r#"seaweedfs_csi_fuse_op_errors_total{op="mknod",volume="/t/\"q\""}"#;
    let fast = r#"seaweedfs_csi_fuse_op_seconds_bucket{op="mknod",volume="/t/\"q\"",le="0.5"}"#;
    let c0 = sample(&before, count);
    let e0 = sample(&before, errors);
    let f0 = sample(&before, fast);

    for i in 0..3 {
        let t = metrics::fuse_op("mknod", r#"/t/"q""#.into());
        if i == 0 {
            t.failed();
        }
    }
    {
        // one slow op lands above the 0.5 s bucket but inside +Inf
        let _t = metrics::fuse_op("mknod", r#"/t/"q""#.into());
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    metrics::global().upload_done(true);
    metrics::global().upload_done(false);

    let (status, after) = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(sample(&after, count) - c0, 4.0, "{after}");
    assert_eq!(sample(&after, errors) - e0, 1.0);
    assert_eq!(
        sample(&after, fast) - f0,
        3.0,
        "the slow op must not be in le=0.5"
    );
    let inf = r#"seaweedfs_csi_fuse_op_seconds_bucket{op="mknod",volume="/t/\"q\"",le="+Inf"}"#;
    assert_eq!(sample(&after, inf), sample(&after, count));
    assert!(
        sample(
            &after,
            r#"seaweedfs_csi_fuse_op_seconds_sum{op="mknod",volume="/t/\"q\""}"#
        ) >= 0.6
    );
    assert!(sample(&after, "seaweedfs_csi_uploads_total") >= 1.0);
    assert!(sample(&after, "seaweedfs_csi_upload_errors_total") >= 1.0);
    assert_exposition_format(&after);

    let (s, _, head_body) = tokio::task::spawn_blocking(move || {
        raw(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    })
    .await
    .unwrap();
    assert_eq!((s, head_body.as_str()), (200, ""));

    let (s, body) = tokio::task::spawn_blocking(move || get(addr, "/healthz"))
        .await
        .unwrap();
    assert_eq!((s, body.as_str()), (200, "ok\n"));
    healthy.store(false, Ordering::SeqCst);
    let (s, body) = tokio::task::spawn_blocking(move || get(addr, "/healthz"))
        .await
        .unwrap();
    assert_eq!(s, 503);
    assert!(body.contains("filer unreachable"), "{body}");
    server.shutdown().await;
    // Stopped means the port no longer answers.
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err()
            || tokio::task::spawn_blocking(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let _ = s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
                let mut b = Vec::new();
                s.read_to_end(&mut b).map(|_| b.is_empty()).unwrap_or(true)
            })
            .await
            .unwrap()
    );
}

/// Every family a scrape returns is documented in docs/METRICS.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_documented() {
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let addr = server.local_addr();
    let text = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    server.shutdown().await;
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/METRICS.md"),
    )
    .unwrap();
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(families.len() >= 10, "{text}");
    for f in families {
        assert!(
            doc.contains(&format!("`{f}`")),
            "{f} is not documented in docs/METRICS.md"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_clients_do_not_hurt_the_server() {
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let addr = server.local_addr();
    tokio::task::spawn_blocking(move || {
        assert_eq!(get(addr, "/nope").0, 404);
        assert_eq!(raw(addr, b"POST /metrics HTTP/1.1\r\n\r\n").0, 405);
        assert_eq!(raw(addr, b"NOT A REQUEST\r\n\r\n").0, 400);
        let mut huge = b"GET /metrics HTTP/1.1\r\n".to_vec();
        huge.extend(std::iter::repeat_n(b'a', 20_000));
        assert_eq!(raw(addr, &huge).0, 431);
        // Idle clients holding their sockets open without sending anything: a scrape next to
        // them is answered at once, not after their header timeout.
        let idle: Vec<TcpStream> = (0..40).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let started = std::time::Instant::now();
        let (s, body) = get(addr, "/metrics");
        assert_eq!(s, 200);
        assert!(body.contains("# TYPE seaweedfs_csi_staged_volumes gauge"));
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(idle);
        // Parallel scrapes all succeed.
        let hs: Vec<_> = (0..16)
            .map(|_| std::thread::spawn(move || get(addr, "/metrics").0))
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), 200);
        }
    })
    .await
    .unwrap();
    let err = MetricsServer::start(addr, None).await;
    assert!(err.is_err(), "a second bind on a used port must fail");
    server.shutdown().await;
}

/// `GET path` that must be answered within `limit`: `Err` when it is not (the caller's probe
/// would have failed).
fn get_within(addr: SocketAddr, path: &str, limit: Duration) -> std::io::Result<(u16, String)> {
    let deadline = std::time::Instant::now() + limit;
    let mut s = TcpStream::connect_timeout(&addr, limit)?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut chunk)? {
            0 => break,
            n => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let (status, _, body) = parse_response(&buf);
    Ok((status, body))
}

/// Issue 14: clients that send half a request head and stall must not delay the liveness probe
/// (kubelet gives it 1 s by default). A server that serves a fixed number of connections at a
/// time queues the probe behind them until their read timeouts free the slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_clients_do_not_delay_healthz() {
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let addr = server.local_addr();
    tokio::task::spawn_blocking(move || {
        let stalled: Vec<TcpStream> = (0..200)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                    .unwrap();
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let started = std::time::Instant::now();
        let got = get_within(addr, "/healthz", Duration::from_secs(2));
        assert!(
            matches!(&got, Ok((200, body)) if body == "ok\n"),
            "/healthz next to 200 stalled clients: {got:?} after {:?}",
            started.elapsed()
        );
        // and so does a scrape
        let got = get_within(addr, "/metrics", Duration::from_secs(2));
        assert!(matches!(&got, Ok((200, _))), "{got:?}");
        drop(stalled);
    })
    .await
    .unwrap();
    server.shutdown().await;
}

/// A client that never finishes its request head (a header line now and then, forever) is cut
/// off by the header read timeout instead of holding its connection for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_request_head_is_cut_off() {
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let addr = server.local_addr();
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\n").unwrap();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 1024];
        loop {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "a client sending a never-ending request head was never cut off"
            );
            if s.write_all(b"X-Slow: a\r\n").is_err() {
                break;
            }
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        }
    })
    .await
    .unwrap();
    server.shutdown().await;
}

/// A real mount: FUSE ops and chunk uploads show up in a scrape.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn real_mount_moves_the_numbers() {
    use seaweedfs_csi_driver::config::MountOptions;
    use seaweedfs_csi_driver::fuse::session::MountedVolume;
    use seaweedfs_csi_driver::security::SecurityConfig;

    let weed = tokio::task::spawn_blocking(common::WeedServer::start)
        .await
        .unwrap();
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    let addr = server.local_addr();
    let before = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();

    let mnt = tempfile::tempdir().unwrap();
    let opts = MountOptions {
        filers: vec![weed.filer_addr()],
        filer_path: "/metricstest".into(),
        ..Default::default()
    };
    let vol = MountedVolume::mount(&opts, &SecurityConfig::default(), mnt.path())
        .await
        .unwrap();
    let dir = mnt.path().to_path_buf();
    let io = tokio::task::spawn_blocking(move || -> std::io::Result<(Vec<u8>, String)> {
        let data: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.join("a.bin"), &data)?;
        let back = std::fs::read(dir.join("a.bin"))?;
        assert_eq!(back, data);
        std::fs::read_dir(&dir)?.count();
        // a stream of small writes: each next write comes a few microseconds after the
        // answer, while the FUSE thread still waits for it
        let mut f = std::fs::File::create(dir.join("log"))?;
        let before_stream = get(addr, "/metrics").1;
        for i in 0..4096u32 {
            std::io::Write::write_all(&mut f, &[(i % 251) as u8; 4096])?;
        }
        f.sync_all()?;
        Ok((back, before_stream))
    })
    .await
    .unwrap();
    // while the volume is staged: its series go with its session
    let after = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    let unmounted = vol.unmount().await;
    let (_, before_stream) = io.unwrap();
    unmounted.unwrap();
    for op in ["create", "write", "flush", "release"] {
        let series =
            format!("seaweedfs_csi_fuse_op_seconds_count{{op=\"{op}\",volume=\"/metricstest\"}}");
        assert!(
            sample(&after, &series) > sample(&before, &series),
            "{series} did not move"
        );
    }
    let gone = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    assert!(
        !gone.contains(r#"seaweedfs_csi_fuse_op_seconds_count{op="create",volume="/metricstest"}"#),
        "an unstaged volume's op series stay: {gone}"
    );
    assert!(
        sample(&after, "seaweedfs_csi_uploads_total")
            > sample(&before, "seaweedfs_csi_uploads_total"),
        "no chunk upload was counted"
    );
    let caught = "seaweedfs_csi_fuse_linger_caught_total";
    assert!(
        sample(&after, caught) > sample(&before_stream, caught),
        "no request was taken by a FUSE thread waiting after an answer"
    );
    assert_exposition_format(&after);
    server.shutdown().await;
    // The file really reached the filer.
    let got = weed.filer_get("/metricstest/a.bin").unwrap();
    assert_eq!(got.len(), 3 << 20);
}

/// The driver binary itself: `--metricsPort` serves /healthz and /metrics, and a volume staged
/// and used through the CSI socket shows up in the numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn driver_serves_metrics_on_its_port() {
    use csi_common::*;

    let weed = tokio::task::spawn_blocking(common::WeedServer::start)
        .await
        .unwrap();
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("csimetrics")
        .tempdir()
        .unwrap();
    let socket = dir.path().join("plugin/csi.sock");
    let args = vec![
        format!("--endpoint=unix://{}", socket.display()),
        format!("--filer={}", weed.filer_addr()),
        "--nodeid=node-1".to_string(),
        format!("--metricsPort={port}"),
    ];
    let driver = Driver::start_raw(dir, socket, Stager::Fuse, args, vec![]);

    let (s, body) = tokio::task::spawn_blocking(move || get(addr, "/healthz"))
        .await
        .unwrap();
    assert_eq!((s, body.as_str()), (200, "ok\n"));
    let before = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    assert_eq!(
        sample(&before, "seaweedfs_csi_staged_volumes"),
        0.0,
        "{before}"
    );

    let c = driver.clients().await;
    let pod = driver.provision_and_publish("pvc-metrics", "pod-a").await;
    let target = &pod.target;
    let t = target.clone();
    tokio::task::spawn_blocking(move || {
        std::fs::write(t.join("m.bin"), vec![7u8; 3 << 20]).unwrap();
        assert_eq!(std::fs::read(t.join("m.bin")).unwrap().len(), 3 << 20);
    })
    .await
    .unwrap();

    let during = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    assert_eq!(
        sample(&during, "seaweedfs_csi_staged_volumes"),
        1.0,
        "{during}"
    );
    for op in ["create", "write", "read"] {
        // labelled by the volume: its filer path
        let series = format!(
            "seaweedfs_csi_fuse_op_seconds_count{{op=\"{op}\",volume=\"/buckets/pvc-metrics\"}}"
        );
        assert!(
            sample(&during, &series) >= 1.0,
            "{series} not counted:\n{during}"
        );
    }
    assert!(sample(&during, "seaweedfs_csi_uploads_total") >= 1.0);
    assert_exposition_format(&during);
    assert_dashboard_queries_exist(&during);

    pod.unpublish_and_unstage(&c).await;
    let after = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    assert_eq!(
        sample(&after, "seaweedfs_csi_staged_volumes"),
        0.0,
        "{after}"
    );
}

/// A keeper process on `socket`, SIGKILLed on drop.
struct KeeperProc(std::process::Child);

impl KeeperProc {
    fn start(socket: &std::path::Path, log: &std::path::Path) -> KeeperProc {
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let _ = std::fs::remove_file(socket);
        let log = std::fs::File::create(log).unwrap();
        let child = std::process::Command::new(csi_common::driver_bin())
            .arg("keeper")
            .arg(format!("--socket={}", socket.display()))
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let k = KeeperProc(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while seaweedfs_csi_driver::keeper::KeeperClient::connect(socket).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "keeper never listened"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        k
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for KeeperProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `path` until it answers `want` (at most `secs`); returns the last answer.
async fn wait_status(addr: SocketAddr, path: &'static str, want: u16, secs: u64) -> (u16, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let got = tokio::task::spawn_blocking(move || get(addr, path))
            .await
            .unwrap();
        if got.0 == want || std::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Issue 13 (4): the fd-keeper restarts (crash: SIGKILL while a volume is staged) between two
/// NodeStageVolume calls. The second stage must work against the new keeper without a plugin
/// restart, and /readyz (not /healthz) must say when the keeper is away.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keeper_restart_between_stages() {
    use csi_common::*;

    let weed = tokio::task::spawn_blocking(common::WeedServer::start)
        .await
        .unwrap();
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("csikeeper")
        .tempdir()
        .unwrap();
    let keeper_sock = dir.path().join("keeper/keeper.sock");
    let mut keeper = KeeperProc::start(&keeper_sock, &dir.path().join("keeper-1.log"));
    let socket = dir.path().join("plugin/csi.sock");
    let args = vec![
        format!("--endpoint=unix://{}", socket.display()),
        format!("--filer={}", weed.filer_addr()),
        "--nodeid=node-1".to_string(),
        format!("--keeperSocket={}", keeper_sock.display()),
        format!("--metricsPort={port}"),
        "--logLevel=info,seaweedfs_csi_driver=debug".to_string(),
    ];
    let keeper_log = dir.path().join("keeper-2.log");
    let driver = Driver::start_raw(dir, socket, Stager::Fuse, args, vec![]);
    assert_eq!(wait_status(addr, "/readyz", 200, 10).await.0, 200);

    let c = driver.clients().await;
    let first = driver.provision_and_publish("pvc-keeper-1", "pod-a").await;

    // The keeper crashes and comes back empty.
    keeper.kill();
    let (s, body) = wait_status(addr, "/readyz", 503, 10).await;
    assert_eq!(s, 503, "{body}");
    assert!(body.contains("fd-keeper"), "{body}");
    assert_eq!(
        wait_status(addr, "/healthz", 200, 0).await.0,
        200,
        "liveness does not depend on the keeper"
    );
    let _keeper2 = KeeperProc::start(&keeper_sock, &keeper_log);

    // A later stage works without restarting the plugin, and the new keeper holds it.
    let second = driver.provision_and_publish("pvc-keeper-2", "pod-b").await;
    assert_eq!(wait_status(addr, "/readyz", 200, 10).await.0, 200);
    let t = second.target.clone();
    tokio::task::spawn_blocking(move || {
        std::fs::write(t.join("f"), b"after the keeper restart").unwrap();
        assert_eq!(
            std::fs::read(t.join("f")).unwrap(),
            b"after the keeper restart"
        );
    })
    .await
    .unwrap();
    let ids = seaweedfs_csi_driver::keeper::KeeperClient::connect(&keeper_sock)
        .unwrap()
        .list()
        .unwrap();
    assert!(ids.contains(&second.vol.volume_id), "{ids:?}");

    second.unpublish_and_unstage(&c).await;
    first.unpublish_and_unstage(&c).await;
    assert!(driver.mounts().is_empty(), "{:?}", driver.mounts());

    // The filer going away makes the plugin not ready, but still alive.
    let mut weed = weed;
    tokio::task::spawn_blocking(move || {
        weed.stop_filer();
        weed
    })
    .await
    .unwrap();
    let (s, body) = wait_status(addr, "/readyz", 503, 10).await;
    assert_eq!(s, 503, "{body}");
    assert!(body.contains("filer"), "{body}");
    assert_eq!(wait_status(addr, "/healthz", 200, 0).await.0, 200);
}

/// A real filer, and the driver binary with the FUSE stager and `--memoryBudgetMB=<mb>`
/// serving metrics on the returned address.
async fn driver_with_budget(mb: u64) -> (common::WeedServer, SocketAddr, csi_common::Driver) {
    let (weed, addr, driver, _) = driver_with_budget_and(mb, false).await;
    (weed, addr, driver)
}

/// [`driver_with_budget`], with an fd-keeper (`kept`) holding its sessions.
async fn driver_with_budget_and(
    mb: u64,
    kept: bool,
) -> (
    common::WeedServer,
    SocketAddr,
    csi_common::Driver,
    Option<KeeperProc>,
) {
    use csi_common::*;
    // each staged volume is a collection, which grows 7 volumes at once
    let weed = tokio::task::spawn_blocking(|| {
        common::WeedServer::start_with(common::WeedOptions {
            max_volumes: 200,
            ..Default::default()
        })
    })
    .await
    .unwrap();
    let port = common::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("csibudget")
        .tempdir()
        .unwrap();
    let socket = dir.path().join("plugin/csi.sock");
    let mut args = vec![
        format!("--endpoint=unix://{}", socket.display()),
        format!("--filer={}", weed.filer_addr()),
        "--nodeid=node-1".to_string(),
        format!("--metricsPort={port}"),
        format!("--memoryBudgetMB={mb}"),
    ];
    let keeper = kept.then(|| {
        let sock = dir.path().join("keeper/keeper.sock");
        args.push(format!("--keeperSocket={}", sock.display()));
        KeeperProc::start(&sock, &dir.path().join("keeper.log"))
    });
    let driver = Driver::start_raw(dir, socket, Stager::Fuse, args, vec![]);
    (weed, addr, driver, keeper)
}

/// The driver binary with `--memoryBudgetMB=128` (32 MiB of dirty data node-wide): 40 files
/// on one staged volume, each written 4 KiB at the starts and the ends of 4 chunks (so each
/// dirty slot spans its chunk) and kept open, would hold 320 MiB of dirty buffers unbounded. Every write succeeds (writers wait, never fail), the
/// scrape shows the budget, the limit and writers that waited, every file reads back, and
/// nothing stays charged once they are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writers_wait_for_room_in_the_memory_budget_on_a_real_mount() {
    let (_weed, addr, driver) = driver_with_budget(128).await;
    let c = driver.clients().await;
    let pod = driver.provision_and_publish("pvc-budget", "pod-a").await;
    let target = pod.target.clone();
    const CHUNK: u64 = 2 << 20;
    let block = |i: u64, k: u64| vec![(i * 4 + k + 1) as u8; 4096];
    let head = |i: u64, k: u64| vec![(i * 4 + k + 1) as u8 ^ 0x80; 4096];
    let t = target.clone();
    let (files_written, peak) = tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let files: Vec<std::fs::File> = (0..40)
            .map(|i| std::fs::File::create(t.join(format!("f{i}"))).unwrap())
            .collect();
        let mut peak = 0.0f64;
        for k in 0..4u64 {
            for (i, f) in files.iter().enumerate() {
                f.write_all_at(&head(i as u64, k), k * CHUNK)
                    .expect("a write failed instead of waiting");
                f.write_all_at(&block(i as u64, k), (k + 1) * CHUNK - 4096)
                    .expect("a write failed instead of waiting");
            }
            let m = get(addr, "/metrics").1;
            peak = peak.max(sample(&m, "seaweedfs_csi_dirty_bytes"));
        }
        let n = files.len();
        drop(files);
        (n, peak)
    })
    .await
    .unwrap();
    assert_eq!(files_written, 40);
    let m = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    assert_eq!(
        sample(&m, "seaweedfs_csi_memory_budget_bytes"),
        (128u64 << 20) as f64
    );
    assert_eq!(
        sample(&m, "seaweedfs_csi_dirty_limit_bytes"),
        (32u64 << 20) as f64
    );
    assert!(
        sample(&m, "seaweedfs_csi_dirty_waits_total") >= 1.0,
        "no writer waited:\n{m}"
    );
    // sampled between rounds: never far past the limit (one chunk per writer in passing)
    assert!(
        peak <= (40u64 << 20) as f64,
        "dirty data at {} MiB against a 32 MiB limit",
        peak / 1048576.0
    );
    let t = target.clone();
    tokio::task::spawn_blocking(move || {
        for i in 0..40u64 {
            let got = std::fs::read(t.join(format!("f{i}"))).unwrap();
            assert_eq!(got.len() as u64, 4 * CHUNK, "f{i}");
            for k in 0..4u64 {
                let at = ((k + 1) * CHUNK - 4096) as usize;
                let start = (k * CHUNK) as usize;
                assert_eq!(&got[at..at + 4096], &block(i, k)[..], "f{i} chunk {k}");
                assert_eq!(&got[start..start + 4096], &head(i, k)[..], "f{i} chunk {k}");
                assert!(
                    got[start + 4096..at].iter().all(|&b| b == 0),
                    "f{i} chunk {k}"
                );
            }
        }
    })
    .await
    .unwrap();
    let m = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    assert_eq!(sample(&m, "seaweedfs_csi_dirty_bytes"), 0.0, "{m}");
    pod.unpublish_and_unstage(&c).await;
}

fn rss_mib(pid: u32) -> f64 {
    common::rss_kib(pid) as f64 / 1024.0
}

/// The driver binary with `--memoryBudgetMB=128`: its chunk cache is one node-wide tier of
/// 48 MiB (3/8 of the budget), not 128 MiB (`cacheCapacityMB`'s default) per staged volume.
/// Three volumes each read a 40 MiB file (120 MiB, which per-volume caches would all keep):
/// every byte reads back right, the node's cache stays within its limit, the volumes' own
/// sizes add up to no more, chunks were evicted, and the process stays within the budget
/// plus a fixed overhead. Unstaging a volume gives its cached chunks back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_staged_volume_shares_one_chunk_cache_within_the_memory_budget() {
    let (weed, addr, driver) = driver_with_budget(128).await;
    let c = driver.clients().await;
    const SIZE: usize = 40 << 20;
    let data = |v: usize| -> Vec<u8> {
        (0..SIZE)
            .map(|i| ((i / 4096 * 31 + v * 7 + i) % 251) as u8)
            .collect()
    };
    let mut pods = Vec::new();
    for v in 0..3 {
        let pod = driver
            .provision_and_publish(&format!("pvc-tier-{v}"), &format!("pod-{v}"))
            .await;
        let w = &weed;
        let d = data(v);
        w.filer_put(&format!("/buckets/pvc-tier-{v}/big"), &d, "");
        pods.push(pod);
    }
    for (v, pod) in pods.iter().enumerate() {
        let t = pod.target.join("big");
        let got = tokio::task::spawn_blocking(move || std::fs::read(t).unwrap())
            .await
            .unwrap();
        assert!(got == data(v), "volume {v}: the file read back wrong");
    }
    let m = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    let limit = sample(&m, "seaweedfs_csi_memory_cache_limit_bytes");
    assert_eq!(limit, (48u64 << 20) as f64, "{m}");
    let node = sample(&m, "seaweedfs_csi_memory_cache_bytes");
    let volumes = sum_of(&m, "seaweedfs_csi_cache_size_bytes");
    let mib = |v: f64| v / 1048576.0;
    assert!(
        node <= limit && volumes <= limit,
        "cached {} MiB node-wide, {} MiB by the volumes, limit {} MiB",
        mib(node),
        mib(volumes),
        mib(limit)
    );
    assert!(node > 0.0 && volumes > 0.0, "nothing cached:\n{m}");
    assert!(
        sum_of(&m, "seaweedfs_csi_cache_evictions_total") > 0.0,
        "no chunk was evicted:\n{m}"
    );
    let rss = rss_mib(driver.pid().unwrap());
    eprintln!(
        "node cache {:.1} MiB, volumes {:.1} MiB, limit {:.0} MiB, resident {rss:.0} MiB",
        mib(node),
        mib(volumes),
        mib(limit)
    );
    // the budget, plus what a debug build's process needs on its own
    assert!(rss <= 128.0 + 96.0, "resident {rss:.0} MiB");
    let last = pods.pop().unwrap();
    last.unpublish_and_unstage(&c).await;
    // what the node's tier holds comes down to what the two staged volumes hold
    let mut seen = (0.0, 0.0);
    for _ in 0..100 {
        let m = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
            .await
            .unwrap();
        seen = (
            sample(&m, "seaweedfs_csi_memory_cache_bytes"),
            sum_of(&m, "seaweedfs_csi_cache_size_bytes"),
        );
        if seen.0 == seen.1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        seen.0, seen.1,
        "the unstaged volume's chunks stayed in the tier"
    );
    for pod in &pods {
        pod.unpublish_and_unstage(&c).await;
    }
}

/// Staged volumes that serve nothing cost little resident memory: 12 more sessions (4 FUSE
/// threads each, each with fuser's 16 MiB read buffer) add under 3 MiB apiece. With glibc's
/// sliding mmap threshold the buffers landed in the heap, where `calloc` zeroes reused memory:
/// ~17 MiB resident per idle volume. Then, after a read larger than the chunk cache has left
/// evicted chunks' space free in the heap (and the trimmer has given its pages back), 4 more
/// add under 12 MiB (a buffer served from that space would be zeroed there, 16 MiB each;
/// not seen so far).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_staged_volumes_cost_little_resident_memory() {
    let (weed, _addr, driver) = driver_with_budget(256).await;
    let c = driver.clients().await;
    let pid = driver.pid().unwrap();
    let mut pods = vec![driver.provision_and_publish("pvc-idle-0", "pod-0").await];
    let first = rss_mib(pid);
    const MORE: usize = 12;
    let stage = |v: usize| {
        let driver = &driver;
        async move {
            let pod = driver
                .provision_and_publish(&format!("pvc-idle-{v}"), &format!("pod-{v}"))
                .await;
            let t = pod.target.join("probe");
            tokio::task::spawn_blocking(move || std::fs::write(t, b"x").unwrap())
                .await
                .unwrap();
            pod
        }
    };
    for v in 1..=MORE {
        pods.push(stage(v).await);
    }
    let after = rss_mib(pid);
    let each = (after - first) / MORE as f64;
    eprintln!(
        "resident {first:.0} MiB with 1 volume, {after:.0} MiB with {} ({each:.1} MiB each)",
        MORE + 1
    );
    assert!(each < 3.0, "{each:.1} MiB resident per idle staged volume");
    // 160 MiB through a 96 MiB chunk cache
    let data: Vec<u8> = (0..160usize << 20).map(|i| (i % 251) as u8).collect();
    weed.filer_put("/buckets/pvc-idle-0/big", &data, "");
    let t = pods[0].target.join("big");
    let got = tokio::task::spawn_blocking(move || std::fs::read(t).unwrap())
        .await
        .unwrap();
    assert!(got == data, "the big file read back wrong");
    drop((got, data));
    tokio::time::sleep(Duration::from_secs(7)).await;
    let churned = rss_mib(pid);
    for v in MORE + 1..=MORE + 4 {
        pods.push(stage(v).await);
    }
    let last = rss_mib(pid);
    eprintln!("resident {churned:.0} MiB after the read, {last:.0} MiB with 4 more volumes");
    assert!(
        last - churned < 12.0,
        "4 volumes staged after cache churn took {:.0} MiB",
        last - churned
    );
    for pod in &pods {
        pod.unpublish_and_unstage(&c).await;
    }
}

/// A directory too heavy for the metadata part of `--memoryBudgetMB=64` (16 MiB; one listing
/// may take half) is not cached but listed in pages of 1,024 through the kernel: readdir
/// (`ls -f`), readdir plus stat of every name (`ls -l`) and a walk see every one of 20,000
/// names exactly once, on a fresh session, and the node's cached listings stay within
/// their limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_directory_too_large_to_cache_lists_whole_in_pages_on_a_real_mount() {
    use std::collections::BTreeSet;

    let (_weed, addr, driver) = driver_with_budget(64).await;
    let c = driver.clients().await;
    const N: usize = 20_000;
    let pod = driver.provision_and_publish("pvc-bigdir", "pod-a").await;
    let t = pod.target.join("big");
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir(&t).unwrap();
        for i in 0..N {
            std::fs::File::create(t.join(format!("name-{i:05}"))).unwrap();
        }
    })
    .await
    .unwrap();
    // a fresh session: nothing of the directory cached
    pod.unpublish_and_unstage(&c).await;
    let pod = driver.provision_and_publish("pvc-bigdir", "pod-b").await;
    let t = pod.target.join("big");
    let want: BTreeSet<String> = (0..N).map(|i| format!("name-{i:05}")).collect();
    let (plain, stated, walked) = tokio::task::spawn_blocking(move || {
        let names = || -> Vec<String> {
            std::fs::read_dir(&t)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        };
        let plain = names();
        // as ls -l: every name listed, then stat
        let stated: Vec<String> = names()
            .into_iter()
            .filter(|n| std::fs::symlink_metadata(t.join(n)).unwrap().is_file())
            .collect();
        let out = std::process::Command::new("find")
            .arg(&t)
            .args(["-type", "f"])
            .output()
            .unwrap();
        assert!(out.status.success());
        let walked: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.rsplit('/').next().unwrap().to_string())
            .collect();
        (plain, stated, walked)
    })
    .await
    .unwrap();
    for (what, got) in [
        ("readdir", plain),
        ("readdir+stat", stated),
        ("find", walked),
    ] {
        assert_eq!(got.len(), N, "{what}: {} names", got.len());
        let set: BTreeSet<String> = got.into_iter().collect();
        assert!(set == want, "{what}: names differ");
    }
    let m = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
        .await
        .unwrap();
    let limit = sample(&m, "seaweedfs_csi_metadata_cache_limit_bytes");
    assert_eq!(limit, (16u64 << 20) as f64, "{m}");
    // the big directory was not cached (it was listed in pages): 20,000 entries would
    // weigh about 10 MiB
    let held = sample(&m, "seaweedfs_csi_metadata_cache_bytes");
    assert!(
        held < (2u64 << 20) as f64,
        "{held} bytes of listings cached"
    );
    pod.unpublish_and_unstage(&c).await;
}

/// The inode table is bounded by its part of `--memoryBudgetMB=64` (4 MiB, about 13,000
/// nodes): after a walk that stats 20,000 names on a real mount, the kernel is asked to
/// forget nodes nothing uses and the session's table shrinks below the limit. What is in
/// use stays: a file held open still reads, a directory with a mount on it keeps the mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inode_table_shrinks_to_its_budget_after_a_walk() {
    inode_table_shrinks_after_a_walk(false, false).await;
}

/// The same for sessions the fd-keeper holds: the keeper writes the prune.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_sessions_inode_table_shrinks_to_its_budget_after_a_walk() {
    inode_table_shrinks_after_a_walk(true, false).await;
}

/// A walk of directories only: the directories are what the kernel is asked to forget, and
/// one held open and one with a mount on it (as a pod's subPath) stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inode_table_shrinks_to_its_budget_after_a_walk_of_directories() {
    inode_table_shrinks_after_a_walk(false, true).await;
}

async fn inode_table_shrinks_after_a_walk(kept: bool, dirs: bool) {
    use std::os::unix::fs::OpenOptionsExt;
    const N: u64 = 20_000;
    if !common::kernel_at_least(6, 18) {
        eprintln!("SKIPPED: FUSE_NOTIFY_PRUNE needs Linux 6.18+");
        return;
    }
    let (weed, addr, driver, _keeper) = driver_with_budget_and(64, kept).await;
    let c = driver.clients().await;
    let name = match (kept, dirs) {
        (true, _) => "pvc-prune-kept",
        (false, true) => "pvc-prune-dirs",
        (false, false) => "pvc-prune",
    };
    let pod = driver.provision_and_publish(name, "pod-a").await;
    let t = pod.target.clone();
    let big = t.join("big");
    let filer = weed.filer_addr();
    let volume = pod.vol.volume_id.clone();
    let (held, pinned, bind, held_dir, sub) = tokio::task::spawn_blocking(move || {
        if dirs {
            common::fill_dir_with_dirs(&filer, &volume, &t, N);
        } else {
            common::fill_dir(&filer, &volume, &t, N);
        }
        std::fs::write(t.join("held"), b"still here").unwrap();
        let held = std::fs::File::open(t.join("held")).unwrap();
        // held by an O_PATH fd only: no open file here, so it is among those asked for
        std::fs::write(t.join("pinned"), b"pinned").unwrap();
        let pinned = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(t.join("pinned"))
            .unwrap();
        // a mount on a directory of the volume (as a pod's subPath is): among the walked
        // directories when they are what is walked
        let (sub, held_dir) = if dirs {
            // (listed only here: in the walk of files the listing would add nothing)
            let mut names: Vec<_> = std::fs::read_dir(&big)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            names.sort();
            (
                names[1].clone(),
                Some(std::fs::File::open(&names[2]).unwrap()),
            )
        } else {
            std::fs::create_dir(t.join("sub")).unwrap();
            (t.join("sub"), None)
        };
        let bind = tempfile::tempdir().unwrap();
        std::fs::write(bind.path().join("inside"), b"bound").unwrap();
        let st = std::process::Command::new("mount")
            .args(["--bind"])
            .arg(bind.path())
            .arg(&sub)
            .status()
            .unwrap();
        assert!(st.success(), "bind mount");
        let out = std::process::Command::new("find")
            .arg(&big)
            .args(["-mindepth", "1", "-type", if dirs { "d" } else { "f" }])
            .args(["-printf", "%s\n"]) // a stat of each
            .output()
            .unwrap();
        assert!(out.status.success());
        assert_eq!(
            out.stdout.split(|b| *b == b'\n').count() as u64 - 1,
            N,
            "names found"
        );
        (held, pinned, bind, held_dir, sub)
    })
    .await
    .unwrap();
    let limit_nodes = (4u64 << 20) / 320;
    let mut nodes = f64::MAX;
    let mut m = String::new();
    for _ in 0..60 {
        m = tokio::task::spawn_blocking(move || get(addr, "/metrics").1)
            .await
            .unwrap();
        nodes = sum_of(&m, "seaweedfs_csi_inodes");
        if nodes <= limit_nodes as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let unmount_sub = || {
        let _ = std::process::Command::new("umount").arg(&sub).status();
    };
    if nodes > limit_nodes as f64 {
        drop((held, pinned, held_dir));
        unmount_sub();
        pod.unpublish_and_unstage(&c).await;
        panic!("{nodes} nodes after 30 s, limit {limit_nodes}");
    }
    assert_eq!(
        sample(&m, "seaweedfs_csi_inode_table_limit_bytes"),
        (4u64 << 20) as f64
    );
    assert!(sample(&m, "seaweedfs_csi_inode_prunes_total") > 0.0, "{m}");
    // what was in use is untouched
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(sub.to_str().unwrap()));
    let through_mount = std::fs::read_to_string(sub.join("inside"));
    let mut s = String::new();
    use std::io::Read as _;
    let read = { held }.read_to_string(&mut s).map(|_| s);
    // (fstat of an O_PATH fd asks the daemon for the node's attributes)
    let pinned_len = pinned.metadata().map(|m| m.len());
    let held_dir_is_dir = held_dir.as_ref().map(|d| d.metadata().map(|m| m.is_dir()));
    unmount_sub();
    drop((bind, pinned, held_dir));
    assert!(mounted, "the mount on a directory of the volume went away");
    assert_eq!(through_mount.unwrap(), "bound", "the mounted directory");
    assert_eq!(read.unwrap(), "still here", "the file held open");
    assert_eq!(pinned_len.unwrap(), 6, "the file held by an O_PATH fd");
    if let Some(r) = held_dir_is_dir {
        assert!(r.unwrap(), "the directory held open");
    }
    // every name is still there, and looks up again (stat of each)
    let big = pod.target.join("big");
    let n = tokio::task::spawn_blocking(move || {
        std::fs::read_dir(&big)
            .unwrap()
            .filter(|e| {
                let m = e.as_ref().unwrap().metadata().unwrap();
                if dirs {
                    m.is_dir()
                } else {
                    m.len() == 0
                }
            })
            .count()
    })
    .await
    .unwrap();
    assert_eq!(n as u64, N);
    pod.unpublish_and_unstage(&c).await;
}
