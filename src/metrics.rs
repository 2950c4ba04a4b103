//! Process-wide metrics on `prometheus-client`, served in the Prometheus text format (0.0.4) on
//! `--metricsPort`. Names are documented in docs/METRICS.md.
//!
//! Latency series are updated with atomics only. A FUSE session resolves its per-op series once
//! ([`FuseOps`]) and the backend decorators once per call site, so a request costs a few atomic
//! adds: no lock, no allocation. Values read at scrape time (session caches, the filer hub) come
//! from [`Collector`]s.

use parking_lot::RwLock;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// `Content-Type` of [`Metrics::render`]'s output.
pub use prometheus_text::CONTENT_TYPE;

/// Latency histogram bucket bounds in seconds (`+Inf` is implied).
pub const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0, 10.0,
];

/// The `op` values of `seaweedfs_csi_fuse_op_seconds`, indexed by [`fuse_op_index`].
pub const FUSE_OPS: [&str; 30] = [
    "lookup",
    "getattr",
    "setattr",
    "readlink",
    "mknod",
    "mkdir",
    "unlink",
    "rmdir",
    "symlink",
    "rename",
    "link",
    "open",
    "read",
    "write",
    "flush",
    "release",
    "fsync",
    "opendir",
    "readdir",
    "readdirplus",
    "fsyncdir",
    "statfs",
    "setxattr",
    "getxattr",
    "listxattr",
    "removexattr",
    "access",
    "create",
    "fallocate",
    "lseek",
];

/// Index of `op` in [`FUSE_OPS`]; meant for a `const` block, so an unknown op fails the build.
pub const fn fuse_op_index(op: &str) -> usize {
    let mut i = 0;
    while i < FUSE_OPS.len() {
        if str_eq(FUSE_OPS[i], op) {
            return i;
        }
        i += 1;
    }
    panic!("not in metrics::FUSE_OPS")
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// A latency histogram over [`BUCKETS`], updated with two atomic adds (prometheus-client's own
/// `Histogram` takes a mutex on every observation).
#[derive(Clone, Debug, Default)]
pub struct Latency(Arc<LatencyCells>);

#[derive(Debug, Default)]
struct LatencyCells {
    /// Observations per bucket, not cumulative; the last one is above every bound.
    buckets: [AtomicU64; BUCKETS.len() + 1],
    /// In nanoseconds: an integer add is exact and needs no compare-exchange loop.
    sum_nanos: AtomicU64,
}

impl Latency {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = BUCKETS.partition_point(|b| *b < secs);
        self.0.buckets[i].fetch_add(1, Relaxed);
        self.0
            .sum_nanos
            .fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }
}

impl TypedMetric for Latency {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        let mut buckets = BUCKETS.map(|b| (b, 0));
        let mut count = 0;
        for (i, cell) in self.0.buckets.iter().enumerate() {
            let n = cell.load(Relaxed);
            count += n;
            if let Some(b) = buckets.get_mut(i) {
                b.1 = n;
            }
        }
        let sum = self.0.sum_nanos.load(Relaxed) as f64 / 1e9;
        // the encoder accumulates the buckets and adds `+Inf` (= count)
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Keeps a family's HELP and TYPE in the output before its first series exists (the registry
/// skips empty metrics), so every documented family is listed from the start.
#[derive(Debug)]
struct Listed<M>(M);

impl<M: EncodeMetric> EncodeMetric for Listed<M> {
    fn encode(&self, encoder: MetricEncoder) -> fmt::Result {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

/// One latency series: its histogram and its error counter.
#[derive(Clone, Debug)]
pub struct Series {
    seconds: Latency,
    errors: Counter,
}

impl Series {
    /// Times one operation; it is recorded when the timer drops.
    pub fn start(&self) -> OpTimer<'_> {
        OpTimer::new(Cow::Borrowed(self))
    }

    pub fn observe(&self, d: Duration, failed: bool) {
        self.seconds.observe(d);
        if failed {
            self.errors.inc();
        }
    }
}

/// `X_seconds` and `X_errors_total` over the label set `L`.
#[derive(Clone, Debug)]
struct LatencyFamily<L> {
    seconds: Family<L, Latency>,
    errors: Family<L, Counter>,
}

impl<L> LatencyFamily<L>
where
    L: Clone + Hash + Eq + EncodeLabelSet + fmt::Debug + Send + Sync + 'static,
{
    fn register(registry: &mut Registry, name: &str, what: &str) -> Self {
        let f = LatencyFamily {
            seconds: Family::default(),
            errors: Family::default(),
        };
        registry.register(
            format!("{name}_seconds"),
            format!("Latency of {what}"),
            Listed(f.seconds.clone()),
        );
        // a counter's `_total` is added by the encoder
        registry.register(
            format!("{name}_errors"),
            format!("Failed {what}"),
            Listed(f.errors.clone()),
        );
        f
    }

    /// The series of `labels`, created on first use. Takes the families' locks: callers on a
    /// hot path keep the result.
    fn series(&self, labels: &L) -> Series {
        Series {
            seconds: self.seconds.get_or_create_owned(labels),
            errors: self.errors.get_or_create_owned(labels),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FuseOpLabels {
    op: &'static str,
    volume: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

pub struct Metrics {
    /// Written only to add a collector; a scrape reads it.
    registry: RwLock<Registry>,
    fuse: LatencyFamily<FuseOpLabels>,
    filer: LatencyFamily<MethodLabels>,
    volume: LatencyFamily<KindLabels>,
    uploads: Counter,
    upload_errors: Counter,
    commit_rebases: Counter,
    lingers: Counter,
    linger_caught: Counter,
    pub staged_volumes: Gauge,
    pub published_targets: Gauge,
    /// Live [`FuseOps`] per volume: the last one's drop removes the volume's op series (a
    /// node works through many volumes; their series must not stay until a restart).
    fuse_users: Arc<parking_lot::Mutex<std::collections::HashMap<Arc<str>, usize>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every static family (tests use their own; the process uses [`global`]).
    pub fn new() -> Self {
        let mut r = Registry::default();
        let fuse = LatencyFamily::register(&mut r, "seaweedfs_csi_fuse_op", "FUSE operations");
        let filer = LatencyFamily::register(&mut r, "seaweedfs_csi_filer_rpc", "filer gRPC calls");
        let volume = LatencyFamily::register(
            &mut r,
            "seaweedfs_csi_volume_request",
            "volume-server HTTP requests",
        );
        let (uploads, upload_errors) = (Counter::default(), Counter::default());
        let commit_rebases = Counter::default();
        let (lingers, linger_caught) = (Counter::default(), Counter::default());
        let (staged_volumes, published_targets) = (Gauge::default(), Gauge::default());
        r.register(
            "seaweedfs_csi_uploads",
            "Chunk uploads that succeeded",
            uploads.clone(),
        );
        r.register(
            "seaweedfs_csi_upload_errors",
            "Chunk uploads that failed",
            upload_errors.clone(),
        );
        r.register(
            "seaweedfs_csi_commit_rebases",
            "Commits rebased onto another client's change of the file",
            commit_rebases.clone(),
        );
        r.register(
            "seaweedfs_csi_fuse_lingers",
            "Waits of a FUSE thread for the next request after answering one",
            lingers.clone(),
        );
        r.register(
            "seaweedfs_csi_fuse_linger_caught",
            "Requests a FUSE thread found while waiting after an answer, so it did not sleep",
            linger_caught.clone(),
        );
        r.register(
            "seaweedfs_csi_staged_volumes",
            "Volumes staged (FUSE sessions served)",
            staged_volumes.clone(),
        );
        r.register(
            "seaweedfs_csi_published_targets",
            "Pod target paths bind-mounted",
            published_targets.clone(),
        );
        Metrics {
            registry: RwLock::new(r),
            fuse,
            filer,
            volume,
            uploads,
            upload_errors,
            commit_rebases,
            lingers,
            linger_caught,
            staged_volumes,
            published_targets,
            fuse_users: Default::default(),
        }
    }

    pub fn upload_done(&self, ok: bool) {
        if ok {
            self.uploads.inc();
        } else {
            self.upload_errors.inc();
        }
    }

    /// A commit was refused because another client had changed the file, and rebased.
    pub fn commit_rebased(&self) {
        self.commit_rebases.inc();
    }

    /// A FUSE thread waited for the next request after an answer; `caught`: one came.
    pub fn linger_done(&self, caught: bool) {
        self.lingers.inc();
        if caught {
            self.linger_caught.inc();
        }
    }

    /// The op series of the FUSE session serving `volume` (its filer path).
    pub fn fuse_ops(&self, volume: Arc<str>) -> FuseOps {
        *self.fuse_users.lock().entry(volume.clone()).or_default() += 1;
        FuseOps {
            family: self.fuse.clone(),
            users: self.fuse_users.clone(),
            volume,
            series: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// `seaweedfs_csi_filer_rpc_seconds{method}`; keep it, finding it takes locks.
    pub fn filer_rpc(&self, method: &'static str) -> Series {
        self.filer.series(&MethodLabels { method })
    }

    /// `seaweedfs_csi_volume_request_seconds{kind}`; keep it, finding it takes locks.
    pub fn volume_request(&self, kind: &'static str) -> Series {
        self.volume.series(&KindLabels { kind })
    }

    /// Adds values computed at every scrape.
    pub fn add_collector(&self, c: Box<dyn Collector>) {
        self.registry.write().register_collector(c);
    }

    /// Every metric in the Prometheus text format ([`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_text::encode(&mut out, &self.registry.read()) {
            // only a collector can fail (writing to a String cannot): serve the rest
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}

pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
}

/// A FUSE session's op series, each created on its first request and then updated without a
/// lock (indexed by [`fuse_op_index`]).
pub struct FuseOps {
    family: LatencyFamily<FuseOpLabels>,
    users: Arc<parking_lot::Mutex<std::collections::HashMap<Arc<str>, usize>>>,
    volume: Arc<str>,
    series: [OnceLock<Series>; FUSE_OPS.len()],
}

impl Drop for FuseOps {
    fn drop(&mut self) {
        // under the lock: a new session of the volume starts its series after the removal
        let mut users = self.users.lock();
        let Some(n) = users.get_mut(&self.volume) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        users.remove(&self.volume);
        for op in FUSE_OPS {
            let labels = FuseOpLabels {
                op,
                volume: self.volume.clone(),
            };
            self.family.seconds.remove(&labels);
            self.family.errors.remove(&labels);
        }
    }
}

impl FuseOps {
    pub fn series(&self, op: usize) -> &Series {
        self.series[op].get_or_init(|| {
            self.family.series(&FuseOpLabels {
                op: FUSE_OPS[op],
                volume: self.volume.clone(),
            })
        })
    }

    /// Times one request of operation `op` (an index into [`FUSE_OPS`]).
    pub fn start(&self, op: usize) -> OpTimer<'_> {
        self.series(op).start()
    }

    /// [`Self::start`] for a request that outlives this borrow (the series is shared).
    pub fn start_owned(&self, op: usize) -> OpTimer<'static> {
        OpTimer::new(Cow::Owned(self.series(op).clone()))
    }
}

/// Times one operation; records on drop.
pub struct OpTimer<'a> {
    series: Cow<'a, Series>,
    start: Instant,
    failed: Cell<bool>,
}

impl OpTimer<'_> {
    fn new(series: Cow<'_, Series>) -> OpTimer<'_> {
        OpTimer {
            series,
            start: Instant::now(),
            failed: Cell::new(false),
        }
    }

    pub fn failed(&self) {
        self.failed.set(true);
    }

    /// Counts the operation as succeeded after all (see [`Self::failed`]).
    pub fn succeeded(&self) {
        self.failed.set(false);
    }
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        self.series.observe(self.start.elapsed(), self.failed.get());
    }
}

/// Times one FUSE request of the session serving `volume`, looking its series up (locks).
/// Sessions use [`Metrics::fuse_ops`] instead.
pub fn fuse_op(op: &'static str, volume: Arc<str>) -> OpTimer<'static> {
    OpTimer::new(Cow::Owned(
        global().fuse.series(&FuseOpLabels { op, volume }),
    ))
}

/// Writes one family of a [`Collector`]: a counter (`name` without `_total`, which the
/// encoder adds) or a gauge, with one sample per label set.
pub fn encode_values<S: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: impl IntoIterator<Item = (S, u64)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in samples {
        let sample = family.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(sample)?,
            _ => ConstGauge::new(v).encode(sample)?,
        }
    }
    Ok(())
}

/// The text of one collector alone.
#[cfg(test)]
pub(crate) fn render_collector(c: Box<dyn Collector>) -> String {
    let mut r = Registry::default();
    r.register_collector(c);
    let mut out = String::new();
    prometheus_text::encode(&mut out, &r).unwrap();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Label values are escaped as the text format requires: `\` -> `\\`, `"` -> `\"` and a
    /// newline -> `\n` (the hand-written encoder missed the newline, which ended the sample
    /// line in the middle of the label).
    #[test]
    fn label_values_are_escaped() {
        let t = fuse_op("lookup", "/esc\\a\"b\nc".into());
        t.failed();
        drop(t);
        let text = global().render();
        let want = r#"seaweedfs_csi_fuse_op_errors_total{op="lookup",volume="/esc\\a\"b\nc"} 1"#;
        assert!(text.lines().any(|l| l == want), "{text}");
    }

    /// Found in review: every volume's op series stayed until the process restarted, so a
    /// node working through many volumes grew its scrape for good. The last session of a
    /// volume takes them along; another session of the same volume keeps them.
    #[test]
    fn a_volumes_op_series_go_with_its_last_session() {
        let m = Metrics::new();
        let (a, b) = (
            m.fuse_ops("/buckets/v".into()),
            m.fuse_ops("/buckets/v".into()),
        );
        a.series(fuse_op_index("read"))
            .observe(Duration::from_millis(3), false);
        let has = |m: &Metrics| m.render().contains(r#"volume="/buckets/v""#);
        drop(a);
        assert!(has(&m), "the other session still serves the volume");
        drop(b);
        assert!(!has(&m));
        // staged again: fresh series
        let c = m.fuse_ops("/buckets/v".into());
        c.series(fuse_op_index("read"))
            .observe(Duration::from_millis(3), false);
        assert!(has(&m));
    }

    /// One FUSE op observed through a session's handles gives exactly the usual histogram
    /// lines: cumulative buckets with Go-style bounds, `+Inf`, `_sum` and `_count`, and the
    /// error counter.
    #[test]
    fn fuse_op_histogram_lines() {
        let m = Metrics::new();
        let ops = m.fuse_ops("/buckets/v".into());
        ops.series(fuse_op_index("read"))
            .observe(Duration::from_millis(3), false);
        ops.series(fuse_op_index("read"))
            .observe(Duration::from_secs(20), true);
        let text = m.render();
        let l = r#"op="read",volume="/buckets/v""#;
        let mut want = vec![
            "# HELP seaweedfs_csi_fuse_op_seconds Latency of FUSE operations.".to_string(),
            "# TYPE seaweedfs_csi_fuse_op_seconds histogram".to_string(),
        ];
        for (le, n) in [
            ("0.0001", 0),
            ("0.00025", 0),
            ("0.0005", 0),
            ("0.001", 0),
            ("0.0025", 0),
            ("0.005", 1),
            ("0.01", 1),
            ("0.025", 1),
            ("0.1", 1),
            ("0.5", 1),
            ("2", 1),
            ("10", 1),
            ("+Inf", 2),
        ] {
            want.push(format!(
                "seaweedfs_csi_fuse_op_seconds_bucket{{{l},le=\"{le}\"}} {n}"
            ));
        }
        want.extend([
            format!("seaweedfs_csi_fuse_op_seconds_sum{{{l}}} 20.003"),
            format!("seaweedfs_csi_fuse_op_seconds_count{{{l}}} 2"),
            "# HELP seaweedfs_csi_fuse_op_errors_total Failed FUSE operations.".to_string(),
            "# TYPE seaweedfs_csi_fuse_op_errors_total counter".to_string(),
            format!("seaweedfs_csi_fuse_op_errors_total{{{l}}} 1"),
        ]);
        let got: Vec<&str> = text.lines().take(want.len()).collect();
        assert_eq!(got, want, "{text}");

        // the hot path: a timer on the cached handle lands in the same series
        drop(ops.start(fuse_op_index("read")));
        assert!(m
            .render()
            .contains(&format!("seaweedfs_csi_fuse_op_seconds_count{{{l}}} 3\n")));
    }

    /// Families are listed before anything is observed, unlabelled samples carry no `{}`.
    #[test]
    fn empty_registry_lists_every_family() {
        let text = Metrics::new().render();
        for f in [
            "seaweedfs_csi_fuse_op_seconds histogram",
            "seaweedfs_csi_fuse_op_errors_total counter",
            "seaweedfs_csi_filer_rpc_seconds histogram",
            "seaweedfs_csi_volume_request_errors_total counter",
            "seaweedfs_csi_uploads_total counter",
            "seaweedfs_csi_staged_volumes gauge",
        ] {
            assert!(text.contains(&format!("# TYPE {f}\n")), "{f}:\n{text}");
        }
        assert!(
            text.contains("\nseaweedfs_csi_upload_errors_total 0\n")
                && text.contains("\nseaweedfs_csi_commit_rebases_total 0\n"),
            "{text}"
        );
    }

    #[test]
    fn every_fuse_op_has_an_index() {
        for (i, op) in FUSE_OPS.iter().enumerate() {
            assert_eq!(fuse_op_index(op), i);
        }
    }
}
