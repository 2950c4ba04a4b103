//! Process-wide metrics, rendered in the Prometheus text format on `--metricsPort`.
//! Names are documented in docs/METRICS.md.

use parking_lot::Mutex;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// Latency histogram bucket bounds in seconds.
const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0, 10.0,
];

#[derive(Default, Clone)]
struct Hist {
    count: u64,
    errors: u64,
    sum: f64,
    buckets: [u64; 12],
}

impl Hist {
    fn observe(&mut self, secs: f64, failed: bool) {
        self.count += 1;
        if failed {
            self.errors += 1;
        }
        self.sum += secs;
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.buckets[i] += 1;
            }
        }
    }
}

/// (family, label value, volume) of one histogram series.
type SeriesKey = (&'static str, &'static str, Option<Arc<str>>);

/// Appends metric lines at scrape time.
pub type Collector = Box<dyn Fn(&mut String) + Send + Sync>;

#[derive(Default)]
pub struct Metrics {
    pub uploads_ok: AtomicU64,
    pub uploads_failed: AtomicU64,
    pub staged_volumes: AtomicU64,
    pub published_targets: AtomicU64,
    /// (family, label value, volume) -> histogram (FUSE ops per volume, filer RPCs,
    /// volume-server requests). Keys borrow static strings and share the session's volume
    /// name, so recording allocates nothing after a series' first observation.
    hists: Mutex<BTreeMap<SeriesKey, Hist>>,
    /// Gauges/counters supplied by sessions at render time.
    collectors: Mutex<Vec<Collector>>,
}

impl Metrics {
    pub fn upload_done(&self, ok: bool) {
        if ok {
            self.uploads_ok.fetch_add(1, Ordering::Relaxed);
        } else {
            self.uploads_failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn observe(
        &self,
        family: &'static str,
        label: &'static str,
        volume: Option<&Arc<str>>,
        secs: f64,
        failed: bool,
    ) {
        let mut hists = self.hists.lock();
        // get_mut first: the key is only built (an Arc clone) for a new series
        let key = (family, label, volume.cloned());
        match hists.get_mut(&key) {
            Some(h) => h.observe(secs, failed),
            None => hists.entry(key).or_default().observe(secs, failed),
        }
    }

    /// Registers a closure that appends metric lines at every scrape.
    pub fn add_collector(&self, f: Collector) {
        self.collectors.lock().push(f);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let families: [(&str, &str, &str); 3] = [
            ("seaweedfs_csi_fuse_op", "op", "FUSE operations"),
            ("seaweedfs_csi_filer_rpc", "method", "filer gRPC calls"),
            (
                "seaweedfs_csi_volume_request",
                "kind",
                "volume-server HTTP requests",
            ),
        ];
        let hists = self.hists.lock().clone();
        for (fam, label, help) in families {
            let _ = writeln!(
                out,
                "# HELP {fam}_seconds Latency of {help}.\n# TYPE {fam}_seconds histogram"
            );
            let labels = |l: &str, v: &Option<Arc<str>>| match v {
                Some(v) => format!(
                    "{label}=\"{l}\",volume=\"{}\"",
                    v.replace('\\', "\\\\").replace('"', "\\\"")
                ),
                None => format!("{label}=\"{l}\""),
            };
            for ((_, l, v), h) in hists.iter().filter(|((f, _, _), _)| *f == fam) {
                let l = labels(l, v);
                for (i, b) in BUCKETS.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "{fam}_seconds_bucket{{{l},le=\"{b}\"}} {}",
                        h.buckets[i]
                    );
                }
                let _ = writeln!(out, "{fam}_seconds_bucket{{{l},le=\"+Inf\"}} {}", h.count);
                let _ = writeln!(out, "{fam}_seconds_sum{{{l}}} {}", h.sum);
                let _ = writeln!(out, "{fam}_seconds_count{{{l}}} {}", h.count);
            }
            let _ = writeln!(
                out,
                "# HELP {fam}_errors_total Failed {help}.\n# TYPE {fam}_errors_total counter"
            );
            for ((_, l, v), h) in hists.iter().filter(|((f, _, _), _)| *f == fam) {
                let l = labels(l, v);
                let _ = writeln!(out, "{fam}_errors_total{{{l}}} {}", h.errors);
            }
        }
        let counters = [
            (
                "seaweedfs_csi_uploads_total",
                "Chunk uploads that succeeded.",
                &self.uploads_ok,
            ),
            (
                "seaweedfs_csi_upload_errors_total",
                "Chunk uploads that failed.",
                &self.uploads_failed,
            ),
        ];
        for (n, h, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {n} {h}\n# TYPE {n} counter\n{n} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let gauges = [
            (
                "seaweedfs_csi_staged_volumes",
                "Volumes staged (FUSE sessions served).",
                &self.staged_volumes,
            ),
            (
                "seaweedfs_csi_published_targets",
                "Pod target paths bind-mounted.",
                &self.published_targets,
            ),
        ];
        for (n, h, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {n} {h}\n# TYPE {n} gauge\n{n} {}",
                v.load(Ordering::Relaxed)
            );
        }
        for c in self.collectors.lock().iter() {
            c(&mut out);
        }
        out
    }
}

pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::default)
}

/// Times one operation; records on drop.
pub struct OpTimer {
    family: &'static str,
    label: &'static str,
    volume: Option<Arc<str>>,
    start: Instant,
    failed: Cell<bool>,
}

impl OpTimer {
    pub fn failed(&self) {
        self.failed.set(true);
    }
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        global().observe(
            self.family,
            self.label,
            self.volume.as_ref(),
            self.start.elapsed().as_secs_f64(),
            self.failed.get(),
        );
    }
}

/// Times one FUSE request of the session serving `volume` (its filer path).
pub fn fuse_op(op: &'static str, volume: Arc<str>) -> OpTimer {
    let mut t = timer("seaweedfs_csi_fuse_op", op);
    t.volume = Some(volume);
    t
}

pub fn timer(family: &'static str, label: &'static str) -> OpTimer {
    OpTimer {
        family,
        label,
        volume: None,
        start: Instant::now(),
        failed: Cell::new(false),
    }
}
