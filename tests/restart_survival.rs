//! Issue 6 end to end: pods keep their mounts when the node plugin is upgraded, crashes, or
//! loses its fd-keeper too. Real processes (keeper, driver generations, two "pod" processes),
//! real FUSE mounts, a real SeaweedFS; the CSI node service is driven over its socket.
//!
//! (a) upgrade: a new driver starts while the old one serves (maxSurge), waits for the socket
//!     and the keeper claim; SIGTERM to the old one -> handover, adoption, nothing fails, every
//!     byte written (even unsynced) is on the filer.
//! (b) crash: SIGKILL, a new driver adopts; everything acknowledged by fsync/close is on the
//!     filer; the open file handle keeps working unless it had unsynced bytes, which died
//!     with the process: then its writes, syncs and close fail with EIO.
//! (c) keeper and driver killed: a new keeper + driver stage and bind the recorded volume again
//!     (new mounts); NodeGetVolumeStats goes from abnormal to normal.
//! (d) crash with dirty data: EIO on exactly the handles that lost data.
//! (e) upgrade with 20 volumes holding dirty data: the handover fits the grace period.
//!
//! The pods are separate processes (this test binary re-executed, see [`pod_process_entry`]),
//! so the test process never holds a file open on the mount: a process with files open on a
//! FUSE mount whose daemon is down must not fork+exec a successor (every inherited fd closed
//! at exec sends FLUSH and waits for that very daemon). Every process is killed by pid and
//! every mount aborted and detached on drop.

#[allow(unused_imports)]
mod common;
mod csi_common;

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use csi_common::*;
use nix::mount::MntFlags;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use seaweedfs_csi_driver::csi::mounts;
use seaweedfs_csi_driver::keeper::KeeperClient;
use seaweedfs_csi_driver::pb::csi::volume_capability::access_mode::Mode;
use seaweedfs_csi_driver::pb::csi::*;
use serde::{Deserialize, Serialize};

/// No operation, process exit or recovery may take longer.
const BOUND: Duration = Duration::from_secs(30);
/// The scenarios measure latencies and share 2 cores with the builds: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

// ---------------------------------------------------------------------------------------------
// The pod process: workers in one target directory, a report at the end.

const POD_ENV: &str = "RESTART_SURVIVAL_POD";
const HELD_BLOCK: usize = 8192;
const BIG_LEN: usize = 2 << 20;

#[derive(Serialize, Deserialize, Clone, Debug)]
struct PodConfig {
    name: String,
    /// The pod's volume (a CSI target path).
    dir: PathBuf,
    /// Where the pod writes `ready` and `report.json`.
    out: PathBuf,
}

/// One finished operation.
#[derive(Serialize, Deserialize, Clone, Debug)]
struct Op {
    worker: String,
    op: String,
    start: u64,
    end: u64,
    err: Option<String>,
    errno: Option<i32>,
    /// The file the op was about (files worker) or the block (held worker).
    file: Option<usize>,
}

/// The file a pod keeps open for its whole life, appending blocks through one fd.
#[derive(Serialize, Deserialize, Default, Debug)]
struct HeldReport {
    name: String,
    /// (block index, end of its successful write).
    written: Vec<(u64, u64)>,
    /// (blocks 0..n covered, end of the successful fsync).
    synced: Vec<(u64, u64)>,
    closed: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
struct FileRec {
    name: String,
    seed: u64,
    len: usize,
    created_at: u64,
    fsynced_at: Option<u64>,
    closed_at: Option<u64>,
    deleted: bool,
    /// A rename to this name or an unlink failed: the daemon may have applied it before it
    /// died, so the file may be under either name or gone.
    uncertain: Option<String>,
}

#[derive(Serialize, Deserialize, Default, Debug)]
struct PodReport {
    ops: Vec<Op>,
    held: HeldReport,
    files: Vec<FileRec>,
    hung: Vec<String>,
}

fn held_block(pod: &str, i: u64) -> Vec<u8> {
    let salt = pod.bytes().map(u64::from).sum::<u64>();
    let mut b: Vec<u8> = (0..HELD_BLOCK)
        .map(|j| (salt.wrapping_mul(31) + i * 7 + j as u64 * 13) as u8)
        .collect();
    b[..8].copy_from_slice(&i.to_le_bytes());
    b
}

fn file_data(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (seed.wrapping_mul(2654435761) >> 7).wrapping_add(j as u64 * 11) as u8)
        .collect()
}

fn big_data() -> Vec<u8> {
    (0..BIG_LEN).map(|j| (j % 251) as u8).collect()
}

/// close(2) with its result (dropping a `File` ignores it; FUSE reports flush errors here).
fn close_file(f: File) -> io::Result<()> {
    let fd = f.into_raw_fd();
    // SAFETY: we own fd (just released from the File) and close it exactly once.
    if unsafe { libc::close(fd) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

type OpLog = Arc<Mutex<Vec<Op>>>;

fn timed<T>(
    log: &OpLog,
    worker: &str,
    op: &str,
    file: Option<usize>,
    f: impl FnOnce() -> io::Result<T>,
) -> Option<T> {
    let start = now_ns();
    let r = f();
    let end = now_ns();
    let (out, err, errno) = match r {
        Ok(v) => (Some(v), None, None),
        Err(e) => (None, Some(e.to_string()), e.raw_os_error()),
    };
    log.lock().unwrap().push(Op {
        worker: worker.into(),
        op: op.into(),
        start,
        end,
        err,
        errno,
        file,
    });
    if out.is_none() {
        // do not spin on a dead mount
        std::thread::sleep(Duration::from_millis(20));
    }
    out
}

fn mismatch(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{what}: wrong content"))
}

fn held_worker(
    pod: String,
    f: File,
    mut held: HeldReport,
    log: OpLog,
    stop: Arc<AtomicBool>,
) -> HeldReport {
    let w = "held";
    let mut i = 1u64;
    let mut last_written: HashMap<u64, bool> = HashMap::new();
    let mut write = |i: u64, held: &mut HeldReport| {
        let data = held_block(&pod, i);
        if timed(&log, w, "write", None, || {
            f.write_all_at(&data, i * HELD_BLOCK as u64)
        })
        .is_some()
        {
            held.written.push((i, now_ns()));
            last_written.insert(i, true);
        }
    };
    while !stop.load(Ordering::SeqCst) {
        write(i, &mut held);
        if i % 8 == 0 && timed(&log, w, "fsync", None, || f.sync_all()).is_some() {
            held.synced.push((i + 1, now_ns()));
        }
        if i % 4 == 1 && held.written.iter().any(|(b, _)| *b == i - 1) {
            let want = held_block(&pod, i - 1);
            timed(&log, w, "read", Some(i as usize - 1), || {
                let mut back = vec![0u8; HELD_BLOCK];
                f.read_exact_at(&mut back, (i - 1) * HELD_BLOCK as u64)?;
                if back != want {
                    return Err(mismatch("held block read back"));
                }
                Ok(())
            });
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(3));
    }
    // After the event: the same fd still writes, syncs and closes.
    write(i, &mut held);
    if timed(&log, w, "fsync", None, || f.sync_all()).is_some() {
        held.synced.push((i + 1, now_ns()));
    }
    held.closed = timed(&log, w, "close", None, || close_file(f)).is_some();
    held
}

fn files_worker(pod: String, dir: PathBuf, log: OpLog, stop: Arc<AtomicBool>) -> Vec<FileRec> {
    let w = "files";
    let mut files: Vec<FileRec> = Vec::new();
    let mut i = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let seed = (i as u64) << 8 | pod.len() as u64;
        let len = 1 + (i * 7919) % 150_000;
        let data = file_data(seed, len);
        files.push(FileRec {
            name: format!("{pod}-f{i}.dat"),
            seed,
            len,
            created_at: now_ns(),
            fsynced_at: None,
            closed_at: None,
            deleted: false,
            uncertain: None,
        });
        let path = dir.join(&files[i].name);
        let n = Some(i);
        let done = (|| {
            let mut f = timed(&log, w, "create", n, || {
                OpenOptions::new().write(true).create_new(true).open(&path)
            })?;
            if timed(&log, w, "write", n, || f.write_all(&data)).is_none() {
                let _ = close_file(f);
                return None;
            }
            if i % 2 == 0 {
                timed(&log, w, "fsync", n, || f.sync_all())?;
                files[i].fsynced_at = Some(now_ns());
            }
            timed(&log, w, "close", n, || close_file(f))?;
            files[i].closed_at = Some(now_ns());
            timed(&log, w, "read", n, || {
                let got = std::fs::read(&path)?;
                if got != data {
                    let at = got.iter().zip(&data).position(|(a, b)| a != b);
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "{}: read back {} bytes (want {}), first difference at {at:?}",
                            files[i].name,
                            got.len(),
                            data.len()
                        ),
                    ));
                }
                Ok(())
            })?;
            Some(())
        })();
        if done.is_some() {
            if i % 4 == 3 {
                let to = format!("{pod}-r{i}.dat");
                if timed(&log, w, "rename", n, || {
                    std::fs::rename(&path, dir.join(&to))
                })
                .is_some()
                {
                    files[i].name = to;
                } else {
                    files[i].uncertain = Some(to);
                }
            }
            if i % 5 == 4 && files[i - 2].closed_at.is_some() && !files[i - 2].deleted {
                let victim = dir.join(&files[i - 2].name);
                if timed(&log, w, "unlink", Some(i - 2), || {
                    std::fs::remove_file(&victim)
                })
                .is_some()
                {
                    files[i - 2].deleted = true;
                } else {
                    files[i - 2].uncertain = Some(String::new());
                }
            }
            if i % 6 == 0 {
                let d = dir.join(format!("{pod}-d{i}"));
                if timed(&log, w, "mkdir", None, || std::fs::create_dir(&d)).is_some() {
                    timed(&log, w, "rmdir", None, || std::fs::remove_dir(&d));
                }
            }
        }
        i += 1;
    }
    files
}

fn reader_worker(dir: PathBuf, log: OpLog, stop: Arc<AtomicBool>) {
    let w = "reader";
    let want = big_data();
    while !stop.load(Ordering::SeqCst) {
        timed(&log, w, "read big", None, || {
            let got = std::fs::read(dir.join("big.dat"))?;
            if got != want {
                return Err(mismatch("big.dat"));
            }
            Ok(())
        });
        timed(&log, w, "stat", None, || {
            std::fs::metadata(dir.join("big.dat"))
        });
        timed(&log, w, "readdir", None, || {
            std::fs::read_dir(&dir).map(|d| d.count())
        });
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Looks up names that do not exist: negative lookups are not cached, so every probe is
/// answered by the daemon (the handover/recovery clock).
fn probe_worker(pod: String, dir: PathBuf, log: OpLog, stop: Arc<AtomicBool>) {
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let p = dir.join(format!("{pod}-nx-{n}"));
        timed(
            &log,
            "probe",
            "lookup",
            None,
            || match std::fs::symlink_metadata(&p) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
                Ok(_) => Err(io::Error::other("a name that was never created exists")),
            },
        );
        n += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn run_pod(cfg: PodConfig) {
    let log: OpLog = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    // The held file exists on the filer before anything happens (fsynced).
    let held_name = format!("{}-held.dat", cfg.name);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(cfg.dir.join(&held_name))
        .expect("create the held file");
    f.write_all_at(&held_block(&cfg.name, 0), 0).unwrap();
    f.sync_all().unwrap();
    let held = HeldReport {
        name: held_name,
        written: vec![(0, now_ns())],
        synced: vec![(1, now_ns())],
        closed: false,
    };

    let (l, s, p) = (log.clone(), stop.clone(), cfg.name.clone());
    let held_t = std::thread::spawn(move || held_worker(p, f, held, l, s));
    let (l, s, p, d) = (log.clone(), stop.clone(), cfg.name.clone(), cfg.dir.clone());
    let files_t = std::thread::spawn(move || files_worker(p, d, l, s));
    let (l, s, d) = (log.clone(), stop.clone(), cfg.dir.clone());
    let reader_t = std::thread::spawn(move || reader_worker(d, l, s));
    let (l, s, p, d) = (log.clone(), stop.clone(), cfg.name.clone(), cfg.dir.clone());
    let probe_t = std::thread::spawn(move || probe_worker(p, d, l, s));
    std::fs::write(cfg.out.join("ready"), b"").unwrap();

    let mut line = String::new();
    let _ = io::stdin().read_line(&mut line);
    stop.store(true, Ordering::SeqCst);

    let deadline = Instant::now() + BOUND;
    let mut report = PodReport::default();
    let all_done = || {
        held_t.is_finished()
            && files_t.is_finished()
            && reader_t.is_finished()
            && probe_t.is_finished()
    };
    while !all_done() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for (name, done) in [
        ("held", held_t.is_finished()),
        ("files", files_t.is_finished()),
        ("reader", reader_t.is_finished()),
        ("probe", probe_t.is_finished()),
    ] {
        if !done {
            report.hung.push(name.into());
        }
    }
    if report.hung.is_empty() {
        report.held = held_t.join().unwrap();
        report.files = files_t.join().unwrap();
        reader_t.join().unwrap();
        probe_t.join().unwrap();
    }
    report.ops = std::mem::take(&mut *log.lock().unwrap());
    std::fs::write(
        cfg.out.join("report.json"),
        serde_json::to_vec(&report).unwrap(),
    )
    .unwrap();
    // Hung threads cannot be joined: leave without them.
    std::process::exit(if report.hung.is_empty() { 0 } else { 3 });
}

/// Not a test: the body of the pod processes the scenarios start (this binary re-executed
/// with `RESTART_SURVIVAL_POD` set). Does nothing when run any other way.
#[test]
#[ignore = "entry point of the pod child processes; started by the scenarios"]
fn pod_process_entry() {
    if let Ok(cfg) = std::env::var(POD_ENV) {
        run_pod(serde_json::from_str(&cfg).expect("pod config"));
    }
}

// ---------------------------------------------------------------------------------------------
// Processes and the fixture

const BIN: &str = env!("CARGO_BIN_EXE_seaweedfs-csi-driver");

/// The driver binary: `RESTART_SURVIVAL_BIN` (e.g. a release build, to measure the handover
/// as shipped), else the one cargo built with the test.
fn driver_binary() -> String {
    std::env::var("RESTART_SURVIVAL_BIN").unwrap_or_else(|_| BIN.to_string())
}

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &str, args: &[String], dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let f = File::create(&log).unwrap();
        let mut cmd = Command::new(driver_binary());
        cmd.args(args).env_remove("RUST_LOG");
        // RESTART_SURVIVAL_LOG: the drivers' log filter when chasing a failure (e.g. debug)
        if let Ok(filter) = std::env::var("RESTART_SURVIVAL_LOG") {
            cmd.env("RUST_LOG", filter);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        Proc {
            name: name.into(),
            child,
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits until the log has a line with `needle`; returns it.
    fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log();
            if let Some(l) = log.lines().find(|l| l.contains(needle)) {
                return l.to_string();
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("{} exited ({st}) before {needle:?}:\n{log}", self.name);
            }
            assert!(
                Instant::now() < deadline,
                "{}: no {needle:?} within {timeout:?}:\n{log}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).unwrap();
    }

    /// Waits for the exit; returns (success, unix ns when the exit was seen).
    fn wait_exit(&mut self, timeout: Duration) -> (bool, u64) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return (st.success(), now_ns());
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {timeout:?}:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn kill_now(&mut self) {
        if self.running() {
            let _ = kill(self.pid(), Signal::SIGKILL);
        }
    }

    /// Bounded reap: a process stuck in a FUSE request cannot die before the mount is aborted.
    fn reap(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.running() {
            if Instant::now() > deadline {
                eprintln!("{} (pid {}) did not die", self.name, self.pid());
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_now();
        self.reap();
    }
}

/// A pod: this test binary re-executed as [`pod_process_entry`] on one target directory.
struct Pod {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    out: PathBuf,
}

impl Pod {
    fn start(name: &str, target: &Path, base: &Path) -> Pod {
        let out = base.join(format!("pod-{name}"));
        std::fs::create_dir_all(&out).unwrap();
        let cfg = PodConfig {
            name: name.into(),
            dir: target.to_path_buf(),
            out: out.clone(),
        };
        let log = File::create(out.join("pod.log")).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "pod_process_entry",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(POD_ENV, serde_json::to_string(&cfg).unwrap())
            .stdin(Stdio::piped())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let mut pod = Pod {
            name: name.into(),
            child,
            stdin,
            out,
        };
        let deadline = Instant::now() + BOUND;
        while !pod.out.join("ready").exists() {
            if let Ok(Some(st)) = pod.child.try_wait() {
                panic!("pod {name} exited ({st}):\n{}", pod.log());
            }
            assert!(Instant::now() < deadline, "pod {name} never got ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        pod
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.out.join("pod.log")).unwrap_or_default()
    }

    /// Stops the workers and returns what they did.
    fn stop(&mut self) -> PodReport {
        drop(self.stdin.take());
        let deadline = Instant::now() + BOUND + Duration::from_secs(5);
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            assert!(
                Instant::now() < deadline,
                "pod {} did not stop:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let report: PodReport =
            serde_json::from_slice(&std::fs::read(self.out.join("report.json")).unwrap_or_else(
                |e| panic!("pod {} report ({status}): {e}\n{}", self.name, self.log()),
            ))
            .unwrap();
        assert!(
            report.hung.is_empty(),
            "pod {}: workers hung for more than {BOUND:?}: {:?}",
            self.name,
            report.hung
        );
        assert!(status.success(), "pod {} exited with {status}", self.name);
        report
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        }
    }
}

/// Owns the temp dir, pods and processes. Drop order: kill the pods, abort and detach every
/// mount below the dir (wakes anything blocked in a FUSE request), kill the processes.
struct Fixture {
    dir: tempfile::TempDir,
    pods: Vec<Pod>,
    procs: Vec<Proc>,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture {
            dir: tempfile::Builder::new()
                .prefix("restart-survival")
                .tempdir()
                .unwrap(),
            pods: Vec::new(),
            procs: Vec::new(),
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn csi_socket(&self) -> PathBuf {
        self.path("plugin/csi.sock")
    }

    fn keeper_socket(&self) -> PathBuf {
        self.path("keeper/keeper.sock")
    }

    fn state_dir(&self) -> PathBuf {
        self.path("plugin/state")
    }

    fn start_keeper(&mut self, name: &str) -> usize {
        std::fs::create_dir_all(self.path("keeper")).unwrap();
        let args = vec![
            "keeper".to_string(),
            format!("--socket={}", self.keeper_socket().display()),
            "--logLevel=info".into(),
        ];
        self.procs.push(Proc::spawn(name, &args, self.dir.path()));
        let i = self.procs.len() - 1;
        self.procs[i].wait_for("keeper listening", BOUND);
        i
    }

    /// Starts a driver generation (controller + node, real FUSE stager, the keeper, a state
    /// dir). Does not wait: a successor waits for its predecessor's socket.
    fn spawn_driver(&mut self, name: &str, filer: &str) -> usize {
        let args = vec![
            format!("--endpoint=unix://{}", self.csi_socket().display()),
            format!("--filer={filer}"),
            "--nodeid=test-node".into(),
            format!("--keeperSocket={}", self.keeper_socket().display()),
            format!("--stateDir={}", self.state_dir().display()),
            "--logLevel=info".into(),
        ];
        self.procs.push(Proc::spawn(name, &args, self.dir.path()));
        self.procs.len() - 1
    }

    fn wait_socket(&mut self, i: usize) {
        let deadline = Instant::now() + BOUND;
        loop {
            assert!(
                self.procs[i].running(),
                "{} exited:\n{}",
                self.procs[i].name,
                self.procs[i].log()
            );
            if std::os::unix::net::UnixStream::connect(self.csi_socket()).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} never served",
                self.procs[i].name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Threads writing kernel invalidations for a session in the keepers started here.
    fn notifier_threads(&self) -> usize {
        let pids = self.procs.iter().map(|p| p.pid());
        pids.map(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| {
                    d.flatten()
                        .filter(|t| {
                            std::fs::read_to_string(t.path().join("comm"))
                                .is_ok_and(|c| c.trim() == "keeper-notify")
                        })
                        .count()
                })
                .unwrap_or(0)
        })
        .sum()
    }

    fn keeper_ids(&self) -> Vec<String> {
        KeeperClient::connect(&self.keeper_socket())
            .unwrap()
            .list()
            .unwrap()
    }

    fn recorded_volumes(&self) -> usize {
        let st: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.state_dir().join("volumes.json")).unwrap())
                .unwrap();
        st["volumes"].as_object().map(|m| m.len()).unwrap_or(0)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // a failed scenario: the drivers' last words say what they were doing
            for p in &self.procs {
                let log = p.log();
                let lines: Vec<&str> = log.lines().collect();
                eprintln!(
                    "----- {} log, last lines:\n{}",
                    p.name,
                    lines[lines.len().saturating_sub(60)..].join("\n")
                );
            }
        }
        for p in &mut self.pods {
            if let Ok(None) = p.child.try_wait() {
                let _ = kill(Pid::from_raw(p.child.id() as i32), Signal::SIGKILL);
            }
        }
        if let Ok(ms) = mounts::mounts_under(self.dir.path()) {
            for m in ms {
                // MNT_FORCE aborts a FUSE connection: blocked callers get an error.
                let _ = nix::mount::umount2(&m.mount_point, MntFlags::MNT_FORCE);
            }
        }
        unmount_below(self.dir.path());
        for p in &mut self.procs {
            p.kill_now();
        }
        self.procs.clear();
        for p in &mut self.pods {
            let deadline = Instant::now() + Duration::from_secs(5);
            while let Ok(None) = p.child.try_wait() {
                if Instant::now() > deadline {
                    eprintln!("pod {} did not die", p.name);
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if std::thread::panicking() {
            for p in &self.procs {
                eprintln!("---- {} ----\n{}", p.name, p.log());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The volume and its checks

/// (mount point, mount id, major:minor) of every mount on the paths.
fn mount_ids(paths: &[&Path]) -> Vec<(PathBuf, u32, String)> {
    let mut v: Vec<_> = mounts::read_mountinfo()
        .unwrap()
        .into_iter()
        .filter(|m| paths.contains(&m.mount_point.as_path()))
        .map(|m| {
            (
                m.mount_point.clone(),
                m.mount_id,
                format!("{}:{}", m.major, m.minor),
            )
        })
        .collect();
    v.sort();
    v
}

struct Volume {
    vol: seaweedfs_csi_driver::pb::csi::Volume,
    staging: PathBuf,
    targets: Vec<PathBuf>,
}

impl Volume {
    /// CreateVolume, a 2 MiB file put through the filer, NodeStage, NodePublish x2.
    async fn provision(
        c: &mut Clients,
        weed: &common::WeedServer,
        fx: &Fixture,
        name: &str,
    ) -> Volume {
        let vol = c
            .controller
            .create_volume(create_req(name, 0, &[]))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        weed.filer_put(&format!("{}/big.dat", vol.volume_id), &big_data(), "");
        let staging = fx.path(&format!(
            "kubelet/plugins/kubernetes.io/csi/seaweedfs-csi-driver/{name}/globalmount"
        ));
        std::fs::create_dir_all(&staging).unwrap();
        c.node
            .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
            .await
            .unwrap();
        let mut targets = Vec::new();
        for pod in ["pod-a", "pod-b"] {
            let t = fx.path(&format!(
                "kubelet/pods/{pod}/volumes/kubernetes.io~csi/pv/mount"
            ));
            std::fs::create_dir_all(t.parent().unwrap()).unwrap();
            c.node
                .node_publish_volume(publish_req(
                    &vol,
                    &staging,
                    &t,
                    false,
                    Mode::MultiNodeMultiWriter,
                ))
                .await
                .unwrap();
            targets.push(t);
        }
        Volume {
            vol,
            staging,
            targets,
        }
    }

    fn mount_paths(&self) -> Vec<&Path> {
        std::iter::once(self.staging.as_path())
            .chain(self.targets.iter().map(|t| t.as_path()))
            .collect()
    }

    fn filer_path(&self, name: &str) -> String {
        format!("{}/{name}", self.vol.volume_id)
    }

    async fn stats(&self, c: &mut Clients, path: &Path) -> VolumeCondition {
        c.node
            .node_get_volume_stats(NodeGetVolumeStatsRequest {
                volume_id: self.vol.volume_id.clone(),
                volume_path: path.display().to_string(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume_condition
            .unwrap()
    }

    /// NodeUnpublish x2 + NodeUnstage; then nothing is mounted, kept or recorded.
    async fn tear_down(&self, c: &mut Clients, fx: &Fixture) {
        let notifiers = fx.notifier_threads();
        assert!(
            notifiers >= 1,
            "a kept session has the keeper write its invalidations ({notifiers} threads)"
        );
        for t in &self.targets {
            c.node
                .node_unpublish_volume(unpublish_req(&self.vol, t))
                .await
                .unwrap();
        }
        c.node
            .node_unstage_volume(unstage_req(&self.vol, &self.staging))
            .await
            .unwrap();
        let left = mounts_below(fx.dir.path());
        assert!(left.is_empty(), "mounts left after unstage: {left:?}");
        assert!(
            fx.keeper_ids().is_empty(),
            "the keeper must drop the session at unstage"
        );
        assert_eq!(
            fx.recorded_volumes(),
            0,
            "state file still records the volume"
        );
        // the unstaged session's notifier threads end (they hold the FUSE fd)
        let deadline = Instant::now() + BOUND;
        while fx.notifier_threads() >= notifiers {
            assert!(
                Instant::now() < deadline,
                "notifier threads outlived their session: {} of {notifiers}",
                fx.notifier_threads()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits until the CSI socket answers and returns fresh clients.
async fn clients(fx: &Fixture) -> Clients {
    let deadline = Instant::now() + BOUND;
    while std::os::unix::net::UnixStream::connect(fx.csi_socket()).is_err() {
        if Instant::now() >= deadline {
            // the processes' last words say why (seen once in CI, cause unknown)
            let tails: Vec<String> = fx
                .procs
                .iter()
                .map(|p| {
                    let log = p.log();
                    let lines: Vec<&str> = log.lines().collect();
                    lines[lines.len().saturating_sub(40)..].join("\n")
                })
                .collect();
            panic!(
                "CSI socket never answered ({}: {:?}); process logs, last lines:\n{}",
                fx.csi_socket().display(),
                std::fs::symlink_metadata(fx.csi_socket()).map(|m| m.file_type()),
                tails.join("\n-----\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Clients::connect(&fx.csi_socket()).await
}

/// What the reports say about one event.
struct Analysis {
    /// Event -> first lookup answered after the old process was gone.
    recovery_ns: u64,
    /// Longest operation that was in flight across the event.
    max_across_ns: u64,
    ops: usize,
    ops_after: usize,
}

/// Checks the timings and progress of both pods around an event at `t_event` (signal sent),
/// with the old process gone at `t_gone`; returns the numbers.
/// `crash`: the event was a SIGKILL, so a held descriptor that lost bytes fails from then on
/// (the write verifier) and cannot make progress.
fn analyze(reports: &[(String, PodReport)], t_event: u64, t_gone: u64, crash: bool) -> Analysis {
    let mut a = Analysis {
        recovery_ns: u64::MAX,
        max_across_ns: 0,
        ops: 0,
        ops_after: 0,
    };
    for (pod, r) in reports {
        let mut workers: BTreeMap<&str, (usize, usize, u64)> = BTreeMap::new();
        for op in &r.ops {
            let w = workers.entry(op.worker.as_str()).or_default();
            w.0 += 1;
            if op.start > t_gone && op.err.is_none() {
                w.1 += 1;
            }
            w.2 = w.2.max(op.end - op.start);
            assert!(
                op.end - op.start < BOUND.as_nanos() as u64,
                "pod {pod}: {} {} took {:.0} ms",
                op.worker,
                op.op,
                ms(op.end - op.start)
            );
            if op.start <= t_gone && op.end >= t_event {
                a.max_across_ns = a.max_across_ns.max(op.end - op.start);
            }
            if op.worker == "probe" && op.err.is_none() && op.end > t_gone {
                a.recovery_ns = a.recovery_ns.min(op.end - t_event);
            }
        }
        for (w, (n, after, worst)) in &workers {
            println!(
                "  {pod}/{w}: {n} ops, {after} ok after the event, slowest {:.1} ms",
                ms(*worst)
            );
            let verified_lost = crash && *w == "held" && held_lost_data(r, t_event, t_gone);
            assert!(
                *after > 0 || verified_lost,
                "pod {pod}: {w} made no progress after the event"
            );
            a.ops += n;
            a.ops_after += after;
        }
    }
    assert!(
        a.recovery_ns != u64::MAX,
        "no lookup succeeded after the event"
    );
    a
}

/// Blocks 0..n of the held file were covered by an fsync that completed before `t`.
fn synced_before(r: &PodReport, t: u64) -> u64 {
    r.held
        .synced
        .iter()
        .filter(|(_, end)| *end < t)
        .map(|(n, _)| *n)
        .max()
        .unwrap_or(0)
}

fn errors(r: &PodReport) -> Vec<&Op> {
    r.ops.iter().filter(|o| o.err.is_some()).collect()
}

/// What a failed files-worker op is about: every op on that file, its record, what the filer
/// holds under its name and the drivers' log lines that name it.
fn explain_failures(
    weed: &common::WeedServer,
    v: &Volume,
    fx: &Fixture,
    r: &PodReport,
    errs: &[&Op],
) -> String {
    let mut out = String::new();
    for i in errs
        .iter()
        .filter(|o| o.worker == "files")
        .filter_map(|o| o.file)
    {
        let Some(f) = r.files.get(i) else { continue };
        out += &format!("file {i}: {f:?}\n");
        for o in r
            .ops
            .iter()
            .filter(|o| o.worker == "files" && o.file == Some(i))
        {
            out += &format!("  {} {}..{} {:?}\n", o.op, o.start, o.end, o.err);
        }
        let got = weed.filer_get(&v.filer_path(&f.name));
        out += &format!(
            "  on the filer now: {:?} bytes, equal: {:?}\n",
            got.as_ref().map(Vec::len),
            got.map(|g| g == file_data(f.seed, f.len))
        );
        for p in &fx.procs {
            for line in p.log().lines().filter(|l| l.contains(&f.name)) {
                out += &format!("  [{}] {line}\n", p.name);
            }
        }
    }
    out
}

/// Every block of the held file that must be there (`must(block, write end)`) is there.
/// Returns (blocks checked, other written blocks that are not on the filer).
fn check_held(
    weed: &common::WeedServer,
    v: &Volume,
    pod: &str,
    r: &PodReport,
    must: impl Fn(u64, u64) -> bool,
) -> (usize, usize) {
    let data = weed
        .filer_get(&v.filer_path(&r.held.name))
        .unwrap_or_else(|| panic!("{} is not on the filer", r.held.name));
    let (mut checked, mut lost) = (0, 0);
    for (i, end) in &r.held.written {
        let at = *i as usize * HELD_BLOCK;
        if !must(*i, *end) {
            if data.get(at..at + HELD_BLOCK) != Some(held_block(pod, *i).as_slice()) {
                lost += 1;
            }
            continue;
        }
        assert!(
            data.len() >= at + HELD_BLOCK,
            "pod {pod}: held file has {} bytes, block {i} is missing",
            data.len()
        );
        assert!(
            data[at..at + HELD_BLOCK] == held_block(pod, *i),
            "pod {pod}: held file block {i} differs on the filer"
        );
        checked += 1;
    }
    (checked, lost)
}

/// Every file whose close (or fsync) succeeded is on the filer with its content; deleted ones
/// are gone. Returns the number of files checked.
fn check_files(weed: &common::WeedServer, v: &Volume, pod: &str, r: &PodReport) -> usize {
    let mut n = 0;
    for f in &r.files {
        if f.closed_at.is_none() && f.fsynced_at.is_none() {
            continue;
        }
        let got = weed.filer_get(&v.filer_path(&f.name));
        if let Some(other) = &f.uncertain {
            // A failed rename/unlink (its process died) may or may not have been applied.
            let got = got.or_else(|| {
                (!other.is_empty())
                    .then(|| weed.filer_get(&v.filer_path(other)))
                    .flatten()
            });
            if let Some(got) = got {
                assert!(
                    got == file_data(f.seed, f.len),
                    "pod {pod}: {} differs on the filer",
                    f.name
                );
            }
        } else if f.deleted {
            assert!(
                got.is_none(),
                "pod {pod}: deleted {} is still on the filer",
                f.name
            );
        } else {
            let got = got.unwrap_or_else(|| {
                let orig = f.name.replacen("-r", "-f", 1);
                panic!(
                    "pod {pod}: {} is not on the filer ({f:?}; under its first name {orig}: {}; \
                     now {})",
                    f.name,
                    weed.filer_get(&v.filer_path(&orig)).is_some(),
                    now_ns()
                )
            });
            assert!(
                got == file_data(f.seed, f.len),
                "pod {pod}: {} differs on the filer ({} bytes, want {})",
                f.name,
                got.len(),
                f.len
            );
        }
        n += 1;
    }
    n
}

/// Claim granted -> session served, from the new driver's log.
fn adopt_ms(log: &str) -> u64 {
    let l = log
        .lines()
        .find(|l| l.contains("session adopted"))
        .unwrap_or("");
    l.split("took_ms=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------------------------
// Scenarios

/// Starts weed, a keeper, driver A, provisions the volume and starts both pods.
async fn start_scenario(name: &str) -> (common::WeedServer, Fixture, Volume, usize) {
    let weed = common::WeedServer::start();
    let mut fx = Fixture::new();
    fx.start_keeper("keeper");
    let a = fx.spawn_driver("driver-a", &weed.filer_addr());
    fx.wait_socket(a);
    let mut c = clients(&fx).await;
    let v = Volume::provision(&mut c, &weed, &fx, name).await;
    assert_eq!(fx.keeper_ids(), vec![v.vol.volume_id.clone()]);
    assert_eq!(fx.recorded_volumes(), 1);
    for (i, pod) in ["a", "b"].iter().enumerate() {
        let p = Pod::start(pod, &v.targets[i], fx.dir.path());
        fx.pods.push(p);
    }
    (weed, fx, v, a)
}

fn stop_pods(fx: &mut Fixture) -> Vec<(String, PodReport)> {
    fx.pods
        .iter_mut()
        .map(|p| (p.name.clone(), p.stop()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_hands_over_every_session_without_errors() {
    let _serial = SERIAL.lock().await;
    let (weed, mut fx, v, a) = start_scenario("pvc-upgrade").await;
    let before = mount_ids(&v.mount_paths());
    assert_eq!(before.len(), 3, "{before:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The new generation starts beside the old one and waits for its socket and sessions.
    let b = fx.spawn_driver("driver-b", &weed.filer_addr());
    fx.procs[b].wait_for("waiting for it to stop", BOUND);
    fx.procs[0].wait_for("claim waits for the current owner", BOUND);

    let t_event = now_ns();
    fx.procs[a].signal(Signal::SIGTERM);
    let (ok, t_gone) = fx.procs[a].wait_exit(BOUND);
    assert!(ok, "old driver failed:\n{}", fx.procs[a].log());
    assert!(fx.procs[a].log().contains("handed over"));
    fx.procs[b].wait_for("session adopted", BOUND);
    let mut c = clients(&fx).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    for p in v.mount_paths() {
        let cond = v.stats(&mut c, p).await;
        assert!(!cond.abnormal, "{}: {cond:?}", p.display());
    }
    let reports = stop_pods(&mut fx);
    for (pod, r) in &reports {
        let errs = errors(r);
        assert!(
            errs.is_empty(),
            "pod {pod}: operations failed (event at {t_event}, old process gone at {t_gone}): {errs:#?}\n{}",
            explain_failures(&weed, &v, &fx, r, &errs)
        );
    }
    let an = analyze(&reports, t_event, t_gone, false);
    assert_eq!(
        mount_ids(&v.mount_paths()),
        before,
        "the mounts must not change"
    );
    let (mut blocks, mut files) = (0, 0);
    for (pod, r) in &reports {
        // A handover flushes everything: every block written, synced or not.
        assert!(r.held.closed, "pod {pod}: closing the held file failed");
        blocks += check_held(&weed, &v, pod, r, |_, _| true).0;
        files += check_files(&weed, &v, pod, r);
    }
    println!(
        "upgrade: SIGTERM -> old process gone {:.1} ms; SIGTERM -> first lookup answered by the \
         new process {:.1} ms (claim granted -> serving {} ms); slowest op across the handover {:.1} ms; \
         {} ops ({} after); {blocks} held blocks and {files} files verified on the filer",
        ms(t_gone - t_event),
        ms(an.recovery_ns),
        adopt_ms(&fx.procs[b].log()),
        ms(an.max_across_ns),
        an.ops,
        an.ops_after
    );
    v.tear_down(&mut c, &fx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_is_adopted_and_synced_data_survives() {
    let _serial = SERIAL.lock().await;
    let (weed, mut fx, v, a) = start_scenario("pvc-crash").await;
    let before = mount_ids(&v.mount_paths());
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let t_event = now_ns();
    fx.procs[a].signal(Signal::SIGKILL);
    let (_, t_gone) = fx.procs[a].wait_exit(BOUND);
    // Spawned by a process without files on the mount (see the module comment).
    let b = fx.spawn_driver("driver-b", &weed.filer_addr());
    fx.procs[b].wait_for("session adopted", BOUND);
    let mut c = clients(&fx).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    for p in v.mount_paths() {
        let cond = v.stats(&mut c, p).await;
        assert!(!cond.abnormal, "{}: {cond:?}", p.display());
    }
    let reports = stop_pods(&mut fx);
    let mut lost = Vec::new();
    for (pod, r) in &reports {
        let synced_before = synced_before(r, t_event);
        let held_lost = held_lost_data(r, t_event, t_gone);
        for op in errors(r) {
            // Only what was never flushed before the crash may be gone: it lived in the dead
            // process. A file created before and never flushed no longer exists; a held block
            // written before and never synced reads back as a hole. Anything else fails.
            let expected = if op.worker == "held" && op.errno == Some(libc::EIO) {
                // the held fd had unsynced bytes when its process died: from then on its
                // writes, syncs and close fail (reads go on)
                held_lost
                    && op.end > t_event
                    && ["write", "fsync", "close"].contains(&op.op.as_str())
            } else if op.worker == "held" {
                op.op == "read"
                    && op.errno.is_none()
                    && op.file.is_some_and(|b| {
                        b as u64 >= synced_before
                            && r.held
                                .written
                                .iter()
                                .any(|(i, end)| *i == b as u64 && *end < t_gone)
                    })
            } else {
                // a file opened before the crash and not synced or closed by then: it no
                // longer exists (its create was deferred), or its descriptor lost bytes and
                // the write verifier fails its writes, syncs and close
                let unsynced_at_crash = op.file.map(|i| &r.files[i]).is_some_and(|f| {
                    f.created_at < t_event
                        && f.fsynced_at.is_none_or(|t| t > t_event)
                        && f.closed_at.is_none_or(|t| t > t_event)
                });
                let verifier = op.errno == Some(libc::EIO)
                    && op.end > t_event
                    && ["write", "fsync", "close"].contains(&op.op.as_str());
                unsynced_at_crash && (op.errno == Some(libc::ENOENT) || verifier)
            };
            assert!(expected, "pod {pod}: operation failed: {op:#?}");
            lost.push(format!(
                "{pod}: {} {}",
                op.op,
                op.err.as_deref().unwrap_or("")
            ));
        }
    }
    let an = analyze(&reports, t_event, t_gone, true);
    assert_eq!(
        mount_ids(&v.mount_paths()),
        before,
        "the mounts must not change"
    );
    let (mut blocks, mut files, mut lost_blocks) = (0, 0, 0);
    for (pod, r) in &reports {
        assert!(
            r.held.closed || held_lost_data(r, t_event, t_gone),
            "pod {pod}: closing the held file failed"
        );
        // fsynced before the crash, or written after the new process took over.
        let synced_before = synced_before(r, t_event);
        let (checked, lost) = check_held(&weed, &v, pod, r, |i, end| {
            i < synced_before || end > t_gone
        });
        blocks += checked;
        lost_blocks += lost;
        files += check_files(&weed, &v, pod, r);
    }
    println!(
        "crash: SIGKILL -> first lookup answered by the new process {:.1} ms (process start, \
         claim, adoption {} ms, RESEND); slowest op across the crash {:.1} ms; {} ops ({} \
         after); {blocks} held blocks and {files} files verified on the filer; lost with the \
         dead process (written, never synced): {lost_blocks} held blocks; errors seen for \
         that lost data: {lost:?}",
        ms(an.recovery_ns),
        adopt_ms(&fx.procs[b].log()),
        ms(an.max_across_ns),
        an.ops,
        an.ops_after
    );
    v.tear_down(&mut c, &fx).await;
}

/// Whether the held fd may have lost data in a crash at `t_event` (process gone at `t_gone`):
/// a block written and not covered by an fsync that finished before the crash, or a write in
/// flight across it (the dead process may have buffered it).
fn held_lost_data(r: &PodReport, t_event: u64, t_gone: u64) -> bool {
    let synced = synced_before(r, t_event);
    r.held
        .written
        .iter()
        .any(|(i, end)| *i >= synced && *end < t_gone)
        || r.ops
            .iter()
            .any(|o| o.worker == "held" && o.op == "write" && o.start < t_gone && o.end > t_event)
}

/// Kills keeper and driver; checks that the volume's mounts are dead.
fn lose_keeper_and_driver(fx: &mut Fixture, v: &Volume, keeper: usize, driver: usize) -> u64 {
    let t = now_ns();
    for i in [keeper, driver] {
        fx.procs[i].signal(Signal::SIGKILL);
        fx.procs[i].wait_exit(BOUND);
    }
    for p in v.mount_paths() {
        assert!(
            matches!(mounts::mount_state(p).unwrap(), mounts::MountState::Dead(_)),
            "{} should be dead",
            p.display()
        );
    }
    t
}

/// Polls NodeGetVolumeStats on a pod path until the volume is normal; returns when.
async fn wait_normal(c: &mut Clients, v: &Volume) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let cond = v.stats(c, &v.targets[1]).await;
        if !cond.abnormal {
            return now_ns();
        }
        assert!(Instant::now() < deadline, "never normal again: {cond:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeper_and_driver_lost_volume_is_staged_and_bound_again() {
    let _serial = SERIAL.lock().await;
    let (mut weed, mut fx, v, a) = start_scenario("pvc-fallback").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // 1. Keeper and driver die: nothing holds the connection any more, the mounts are dead.
    // A new keeper + driver stage and bind the recorded volume again by themselves.
    let t_event = lose_keeper_and_driver(&mut fx, &v, 0, a);
    let k2 = fx.start_keeper("keeper-2");
    let t_spawn = now_ns();
    let b = fx.spawn_driver("driver-b", &weed.filer_addr());
    fx.wait_socket(b);
    let mut c = clients(&fx).await;
    let t_repaired = wait_normal(&mut c, &v).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;

    // 2. Again, with the filer down: the first repairs fail and the volume is reported
    // abnormal until the filer is back.
    let t_event2 = lose_keeper_and_driver(&mut fx, &v, k2, b);
    println!(
        "fallback events: first loss {t_event}, repaired {t_repaired}, second loss {t_event2}"
    );
    weed.stop_filer();
    fx.start_keeper("keeper-3");
    let d = fx.spawn_driver("driver-c", &weed.filer_addr());
    fx.wait_socket(d);
    let mut c = clients(&fx).await;
    fx.procs[d].wait_for("repairing a recorded volume failed", BOUND);
    for p in v.mount_paths() {
        let cond = v.stats(&mut c, p).await;
        assert!(cond.abnormal, "{}: {cond:?}", p.display());
    }
    let t_filer = now_ns();
    weed.start_filer();
    let t_filer_up = now_ns();
    let t_normal = wait_normal(&mut c, &v).await;
    for p in v.mount_paths() {
        let cond = v.stats(&mut c, p).await;
        assert!(!cond.abnormal, "{}: {cond:?}", p.display());
        assert_eq!(mounts::mount_state(p).unwrap(), mounts::MountState::Healthy);
    }
    // The staging mount was replaced; each target got the new bind on top of its dead one
    // (never a moment without a mount, so pods cannot write into the node's directory).
    let after = mount_ids(&v.mount_paths());
    let on = |p: &Path| after.iter().filter(|m| m.0 == p).count();
    assert_eq!(on(&v.staging), 1, "{after:?}");
    for t in &v.targets {
        assert_eq!(on(t), 3, "two dead layers and the live one: {after:?}");
    }
    assert_eq!(
        fx.keeper_ids(),
        vec![v.vol.volume_id.clone()],
        "kept by the new keeper"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let reports = stop_pods(&mut fx);

    let (mut files, mut blocks) = (0, 0);
    for (pod, r) in &reports {
        let mut after_ok: BTreeMap<&str, usize> = BTreeMap::new();
        for op in &r.ops {
            if op.start <= t_normal {
                continue;
            }
            if op.worker == "held" {
                // its fd belongs to the first, dead connection: it stays dead
                if let Some(e) = op.errno {
                    assert!(
                        [libc::ENOTCONN, libc::ECONNABORTED, libc::EIO].contains(&e),
                        "pod {pod}: held fd: {op:?}"
                    );
                }
                continue;
            }
            assert!(
                op.err.is_none(),
                "pod {pod}: failed after the repair (losses at {t_event} and {t_event2}, normal \
                 at {t_normal}): {op:#?} {:#?}",
                op.file.map(|i| &r.files[i])
            );
            *after_ok.entry(op.worker.as_str()).or_default() += 1;
        }
        for w in ["files", "probe", "reader"] {
            assert!(
                after_ok.get(w).copied().unwrap_or(0) > 0,
                "pod {pod}: {w} made no progress after the repair"
            );
        }
        println!("  {pod}: ok after the repair: {after_ok:?}");
        // Everything fsynced or closed (before the losses and on the new mounts) is there.
        files += check_files(&weed, &v, pod, r);
        let synced_before = synced_before(r, t_event);
        blocks += check_held(&weed, &v, pod, r, |i, _| i < synced_before).0;
        // And the new mount serves it.
        let held = std::fs::read(v.targets[0].join(&r.held.name)).unwrap();
        assert!(held.len() >= synced_before as usize * HELD_BLOCK);
        assert!(held[..HELD_BLOCK] == held_block(pod, 0));
    }
    println!(
        "keeper+driver lost: kill -> volume normal again (staged + bound by the new driver) \
         {:.1} ms, of which new driver start -> normal {:.1} ms; with the filer down: abnormal \
         until it was back, filer start {:.1} ms, filer up -> normal {:.1} ms (retry backoff); \
         {files} files and {blocks} synced held blocks verified on the filer; mounts now {after:?}",
        ms(t_repaired - t_event),
        ms(t_repaired - t_spawn),
        ms(t_filer_up - t_filer),
        ms(t_normal - t_filer_up),
    );
    v.tear_down(&mut c, &fx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_adoption_falls_back_to_staging_again() {
    use std::os::fd::AsFd;
    let _serial = SERIAL.lock().await;
    let weed = common::WeedServer::start();
    let mut fx = Fixture::new();
    fx.start_keeper("keeper");
    let a = fx.spawn_driver("driver-a", &weed.filer_addr());
    fx.wait_socket(a);
    let mut c = clients(&fx).await;
    let v = Volume::provision(&mut c, &weed, &fx, "pvc-badblob").await;
    std::fs::write(v.targets[0].join("kept.txt"), b"before").unwrap();
    fx.procs[a].signal(Signal::SIGKILL);
    fx.procs[a].wait_exit(BOUND);

    // Corrupt what the keeper hands over (same fds, a blob nobody can read).
    {
        let k = KeeperClient::connect(&fx.keeper_socket()).unwrap();
        let e = k.claim(&v.vol.volume_id, BOUND).unwrap();
        let fds: Vec<_> = e.fds.iter().map(|f| f.as_fd()).collect();
        k.put(&v.vol.volume_id, b"not a handover blob", &fds)
            .unwrap();
    }
    let b = fx.spawn_driver("driver-b", &weed.filer_addr());
    fx.procs[b].wait_for("adopting a session failed; ending it", BOUND);
    let mut c = clients(&fx).await;
    let t0 = Instant::now();
    wait_normal(&mut c, &v).await;
    println!(
        "failed adoption -> staged and bound again in {:?}",
        t0.elapsed()
    );
    for t in &v.targets {
        assert_eq!(std::fs::read(t.join("kept.txt")).unwrap(), b"before");
    }
    assert_eq!(fx.keeper_ids(), vec![v.vol.volume_id.clone()]);
    v.tear_down(&mut c, &fx).await;
}

// ---------------------------------------------------------------------------------------------
// Helper processes holding files open across an event (a crash, a handover): like the pods,
// separate processes, so that the test process never has a file open on the mount.

const HELPER_ENV: &str = "RESTART_SURVIVAL_HELPER";
/// Lost-handles helper: A's committed prefix, its never-synced tail, B, C, A's later write.
const A_SYNCED: usize = 100_000;
const A_UNSYNCED: usize = 50_000;
const B_LEN: usize = 70_000;
const B_MORE: usize = 10_000;
const C_LEN: usize = 30_000;
const A_NEW: usize = 4096;
/// Dirty helper: per file, this many slots of the default 2 MiB chunk, each filled but for
/// its last 4 KiB, so nothing is sealed (uploaded) before the handover flushes it.
const DIRTY_SLOTS: usize = 4;
const SLOT: usize = 2 << 20;
const DIRTY_RUN: usize = SLOT - 4096;

#[derive(Serialize, Deserialize)]
struct HelperConfig {
    kind: String,
    dirs: Vec<PathBuf>,
    out: PathBuf,
}

/// 0 for success, else the errno (-1 for a wrong result).
fn outcome<T>(r: io::Result<T>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

fn read_check(f: &File, at: u64, want: &[u8]) -> io::Result<()> {
    let mut got = vec![0u8; want.len()];
    f.read_exact_at(&mut got, at)?;
    if got != want {
        return Err(mismatch("read back"));
    }
    Ok(())
}

fn wait_go(out: &Path) {
    std::fs::write(out.join("ready"), b"").unwrap();
    let mut line = String::new();
    let _ = io::stdin().read_line(&mut line);
}

/// File A gets bytes it never syncs, B is written and fsynced, C only read; after the crash
/// every operation on the old fds and on a new open of A is reported.
fn run_lost_handles(cfg: &HelperConfig) -> BTreeMap<String, i32> {
    let dir = &cfg.dirs[0];
    let rw = |name: &str| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join(name))
            .unwrap()
    };
    let a = rw("a.dat");
    a.write_all_at(&file_data(1, A_SYNCED), 0).unwrap();
    a.sync_all().unwrap();
    a.write_all_at(&file_data(2, A_UNSYNCED), A_SYNCED as u64)
        .unwrap();
    let b = rw("b.dat");
    b.write_all_at(&file_data(3, B_LEN), 0).unwrap();
    b.sync_all().unwrap();
    std::fs::write(dir.join("c.dat"), file_data(4, C_LEN)).unwrap();
    let c = File::open(dir.join("c.dat")).unwrap();
    read_check(&c, 0, &file_data(4, C_LEN)).unwrap();
    wait_go(&cfg.out);

    let mut r = BTreeMap::new();
    let end = (A_SYNCED + A_UNSYNCED) as u64;
    r.insert("a write".into(), outcome(a.write_all_at(&[7; 4096], end)));
    r.insert("a fsync".into(), outcome(a.sync_all()));
    r.insert(
        "a read".into(),
        outcome(read_check(&a, 0, &file_data(1, A_SYNCED))),
    );
    r.insert(
        "b write".into(),
        outcome(b.write_all_at(&file_data(5, B_MORE), B_LEN as u64)),
    );
    r.insert("b fsync".into(), outcome(b.sync_all()));
    r.insert(
        "c read".into(),
        outcome(read_check(&c, 0, &file_data(4, C_LEN))),
    );
    r.insert(
        "new open of a: write, fsync, close".into(),
        outcome((|| {
            let f = OpenOptions::new().write(true).open(dir.join("a.dat"))?;
            f.write_all_at(&file_data(6, A_NEW), A_SYNCED as u64)?;
            f.sync_all()?;
            close_file(f)
        })()),
    );
    r.insert("a close".into(), outcome(close_file(a)));
    r.insert("b close".into(), outcome(close_file(b)));
    r.insert("c close".into(), outcome(close_file(c)));
    r
}

fn dirty_content(seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; (DIRTY_SLOTS - 1) * SLOT + DIRTY_RUN];
    for k in 0..DIRTY_SLOTS {
        v[k * SLOT..k * SLOT + DIRTY_RUN].copy_from_slice(&file_data(seed + k as u64, DIRTY_RUN));
    }
    v
}

/// One file per directory with `DIRTY_SLOTS` unsealed slots of dirty data, held open across
/// the event, then closed.
fn run_dirty_holder(cfg: &HelperConfig) -> BTreeMap<String, i32> {
    let files: Vec<File> = cfg
        .dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(d.join("dirty.dat"))
                .unwrap();
            let want = dirty_content(i as u64 * 100);
            for k in 0..DIRTY_SLOTS {
                let at = k * SLOT;
                f.write_all_at(&want[at..at + DIRTY_RUN], at as u64)
                    .unwrap();
            }
            f
        })
        .collect();
    wait_go(&cfg.out);
    files
        .into_iter()
        .enumerate()
        .map(|(i, f)| (format!("close {i}"), outcome(close_file(f))))
        .collect()
}

/// Not a test: the body of the helper processes (this binary re-executed with
/// `RESTART_SURVIVAL_HELPER` set). Does nothing when run any other way.
#[test]
#[ignore = "entry point of helper child processes; started by the scenarios"]
fn helper_process_entry() {
    let Ok(cfg) = std::env::var(HELPER_ENV) else {
        return;
    };
    let cfg: HelperConfig = serde_json::from_str(&cfg).expect("helper config");
    let report = match cfg.kind.as_str() {
        "lost-handles" => run_lost_handles(&cfg),
        "dirty" => run_dirty_holder(&cfg),
        k => panic!("unknown helper {k}"),
    };
    std::fs::write(
        cfg.out.join("report.json"),
        serde_json::to_vec(&report).unwrap(),
    )
    .unwrap();
    std::process::exit(0);
}

struct Helper {
    child: Child,
    stdin: Option<ChildStdin>,
    out: PathBuf,
}

impl Helper {
    fn start(kind: &str, dirs: Vec<PathBuf>, base: &Path) -> Helper {
        let out = base.join(format!("helper-{kind}"));
        std::fs::create_dir_all(&out).unwrap();
        let cfg = HelperConfig {
            kind: kind.into(),
            dirs,
            out: out.clone(),
        };
        let log = File::create(out.join("helper.log")).unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "helper_process_entry",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HELPER_ENV, serde_json::to_string(&cfg).unwrap())
            .stdin(Stdio::piped())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut h = Helper {
            stdin: child.stdin.take(),
            child,
            out,
        };
        let deadline = Instant::now() + BOUND * 2;
        while !h.out.join("ready").exists() {
            if let Ok(Some(st)) = h.child.try_wait() {
                panic!("helper {kind} exited ({st}):\n{}", h.log());
            }
            assert!(Instant::now() < deadline, "helper {kind} never got ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        h
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.out.join("helper.log")).unwrap_or_default()
    }

    /// Lets it go on and returns its report.
    fn finish(&mut self) -> BTreeMap<String, i32> {
        drop(self.stdin.take());
        let deadline = Instant::now() + BOUND;
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "helper did not finish:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        serde_json::from_slice(
            &std::fs::read(self.out.join("report.json"))
                .unwrap_or_else(|e| panic!("helper report: {e}\n{}", self.log())),
        )
        .unwrap()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        }
    }
}

/// (d) SIGKILL while file A holds acknowledged, never-synced bytes and B does not: after the
/// adoption A's old fd fails writes, fsync and close with EIO (its bytes are gone), while B's
/// old fd, a read-only fd on C and a new open of A work, and their data is on the filer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_fails_exactly_the_handles_that_lost_data() {
    let _serial = SERIAL.lock().await;
    let weed = common::WeedServer::start();
    let mut fx = Fixture::new();
    fx.start_keeper("keeper");
    let a = fx.spawn_driver("driver-a", &weed.filer_addr());
    fx.wait_socket(a);
    let mut c = clients(&fx).await;
    let v = Volume::provision(&mut c, &weed, &fx, "pvc-lost").await;
    let mut helper = Helper::start("lost-handles", vec![v.targets[0].clone()], fx.dir.path());

    fx.procs[a].signal(Signal::SIGKILL);
    fx.procs[a].wait_exit(BOUND);
    let b = fx.spawn_driver("driver-b", &weed.filer_addr());
    fx.procs[b].wait_for("session adopted", BOUND);
    let got = helper.finish();

    let eio = libc::EIO;
    let want: BTreeMap<String, i32> = [
        ("a write", eio),
        ("a fsync", eio),
        ("a close", eio),
        ("a read", 0),
        ("b write", 0),
        ("b fsync", 0),
        ("b close", 0),
        ("c read", 0),
        ("c close", 0),
        ("new open of a: write, fsync, close", 0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(got, want, "errno per operation after the crash (0 = ok)");
    let mut a_want = file_data(1, A_SYNCED);
    a_want.extend(file_data(6, A_NEW));
    assert!(
        weed.filer_get(&v.filer_path("a.dat")) == Some(a_want),
        "a.dat: the committed prefix and the new open's write"
    );
    let mut b_want = file_data(3, B_LEN);
    b_want.extend(file_data(5, B_MORE));
    assert!(weed.filer_get(&v.filer_path("b.dat")) == Some(b_want));
    assert!(
        fx.procs[b].log().contains("on inodes with unflushed data"),
        "the adoption logs the loss"
    );
    v.tear_down(&mut c, &fx).await;
}

/// Waits until `needle` is in the log of `fx.procs[i]` `n` times.
fn wait_count(fx: &mut Fixture, i: usize, needle: &str, n: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let log = fx.procs[i].log();
        if log.matches(needle).count() >= n {
            return;
        }
        assert!(fx.procs[i].running(), "{} exited:\n{log}", fx.procs[i].name);
        assert!(
            Instant::now() < deadline,
            "{}: {needle:?} not {n} times within {timeout:?}:\n{log}",
            fx.procs[i].name
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Volumes staged for the handover measurement (the grace period in deploy/ is sized from it).
const HANDOVER_VOLUMES: usize = 20;

/// (e) Rolling update with `HANDOVER_VOLUMES` staged volumes that each hold 8 MiB of dirty,
/// unsealed data: SIGTERM -> the old process has flushed all of it and exited within the
/// grace period (sessions hand over in parallel); every byte is on the filer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handover_of_many_dirty_volumes_fits_the_grace_period() {
    let _serial = SERIAL.lock().await;
    let weed = common::WeedServer::start();
    let mut fx = Fixture::new();
    let keeper = fx.start_keeper("keeper");
    let a = fx.spawn_driver("driver-a", &weed.filer_addr());
    fx.wait_socket(a);
    let mut c = clients(&fx).await;
    let mut vols = Vec::new();
    for i in 0..HANDOVER_VOLUMES {
        let vol = c
            .controller
            // one collection for all: the test server's 100 volumes do not cover 20
            // collections of 7 each
            .create_volume(create_req(
                &format!("pvc-many-{i}"),
                0,
                &[("collection", "handover")],
            ))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let staging = fx.path(&format!(
            "kubelet/plugins/kubernetes.io/csi/seaweedfs-csi-driver/pvc-many-{i}/globalmount"
        ));
        std::fs::create_dir_all(&staging).unwrap();
        c.node
            .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
            .await
            .unwrap();
        vols.push(Volume {
            vol,
            staging,
            targets: Vec::new(),
        });
    }
    let dirs = vols.iter().map(|v| v.staging.clone()).collect();
    let mut helper = Helper::start("dirty", dirs, fx.dir.path());

    let b = fx.spawn_driver("driver-b", &weed.filer_addr());
    fx.procs[b].wait_for("waiting for it to stop", BOUND);
    wait_count(
        &mut fx,
        keeper,
        "claim waits for the current owner",
        HANDOVER_VOLUMES,
        BOUND,
    );
    let t_event = now_ns();
    fx.procs[a].signal(Signal::SIGTERM);
    let (ok, t_gone) = fx.procs[a].wait_exit(BOUND * 2);
    assert!(ok, "old driver failed:\n{}", fx.procs[a].log());
    let handover = Duration::from_nanos(t_gone - t_event);
    wait_count(&mut fx, b, "session adopted", HANDOVER_VOLUMES, BOUND);
    let closes = helper.finish();
    let problems = |i: usize| -> Vec<String> {
        fx.procs[i]
            .log()
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .map(String::from)
            .collect()
    };
    assert!(
        closes.values().all(|&e| e == 0),
        "closes after the handover: {closes:?}\nold: {:#?}\nnew: {:#?}",
        problems(a),
        problems(b)
    );
    for (i, v) in vols.iter().enumerate() {
        let got = weed.filer_get(&v.filer_path("dirty.dat"));
        assert!(
            got.as_deref() == Some(dirty_content(i as u64 * 100).as_slice()),
            "volume {i}: dirty.dat is not on the filer as written ({:?} bytes)",
            got.map(|g| g.len())
        );
    }
    let dirty_mib = (HANDOVER_VOLUMES * DIRTY_SLOTS * DIRTY_RUN) >> 20;
    println!(
        "handover of {HANDOVER_VOLUMES} volumes with {dirty_mib} MiB dirty in all: SIGTERM -> \
         old process gone {:.0} ms ({})",
        handover.as_secs_f64() * 1000.0,
        fx.procs[a]
            .log()
            .lines()
            .find(|l| l.contains("sessions shut down"))
            .unwrap_or("no shutdown line")
    );
    // SIGTERM may first wait up to SHUTDOWN_GRACE for in-flight CSI calls
    let grace = node_grace_period();
    let drain = seaweedfs_csi_driver::csi::server::SHUTDOWN_GRACE;
    assert!(
        handover + drain < grace,
        "the handover took {handover:?}: with {drain:?} for CSI calls it must fit the node's \
         terminationGracePeriodSeconds ({grace:?})"
    );
    for v in &vols {
        c.node
            .node_unstage_volume(unstage_req(&v.vol, &v.staging))
            .await
            .unwrap();
    }
    let left = mounts_below(fx.dir.path());
    assert!(left.is_empty(), "mounts left after unstage: {left:?}");
}

/// The node plugin's terminationGracePeriodSeconds in deploy/kubernetes/base/node.yaml.
fn node_grace_period() -> Duration {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/kubernetes/base/node.yaml"
    );
    let y = std::fs::read_to_string(path).unwrap();
    let secs = y
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("terminationGracePeriodSeconds in node.yaml");
    Duration::from_secs(secs)
}
