//! This node's topology segments and data center, from `--topologyKeys` and
//! `--dataCenterLabel`.
//!
//! `--topologyKeys` entries are either `key=value` (reported as given) or, as in the Go driver,
//! bare Node label keys: the plugin reads its own Node object (`--nodeid`) from the Kubernetes
//! API and reports those labels' values; missing labels are skipped. `--dataCenterLabel` names
//! a label whose value is the node's default data center when `--dataCenter` is empty.
//!
//! The Node object is read lazily, on the first call that needs it (NodeGetInfo, a NodeStage
//! or a NodePublish repair of a volume that writes to the local data center), and kept. A read
//! that lacks a label a caller needs (clouds add the zone label some time after the node
//! boots) is read again, at most every [`MISSING_LABEL_REREAD`]; a failed re-read keeps the
//! labels read before. Concurrent callers share one read in flight, and a failure is
//! remembered for [`FAILURE_MEMORY`] and returned to callers arriving meanwhile, so a
//! black-holed API costs each caller at most one [`NODE_READ_TIMEOUT`], not one per caller
//! queued before it. Startup never depends on the API.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, Shared};
use tokio::sync::OnceCell;

/// Bound on one read of the Node object (connect and answer).
pub const NODE_READ_TIMEOUT: Duration = Duration::from_secs(15);
/// How often labels a caller needs but the last read lacked are read again.
pub const MISSING_LABEL_REREAD: Duration = Duration::from_secs(10);
/// How long a failed read is returned to new callers before the API is asked again.
pub const FAILURE_MEMORY: Duration = Duration::from_secs(5);

/// What `--topologyKeys` and `--dataCenterLabel` ask of this node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopologySpec {
    /// `key=value` entries, reported as given (they win over a label of the same key).
    pub fixed: BTreeMap<String, String>,
    /// Bare keys: Node labels whose values are reported.
    pub label_keys: Vec<String>,
    /// Node label holding the node's data center (used when `--dataCenter` is empty).
    pub data_center_label: Option<String>,
}

impl TopologySpec {
    /// Whether NodeGetInfo reports a topology (and Identity advertises
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS): any `--topologyKeys` entry, as in the Go driver.
    pub fn advertised(&self) -> bool {
        !self.fixed.is_empty() || !self.label_keys.is_empty()
    }

    /// Whether anything needs this node's labels (and so the Kubernetes API).
    pub fn needs_labels(&self) -> bool {
        !self.label_keys.is_empty() || self.data_center_label.is_some()
    }
}

/// Errors reading this node's labels.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NodeLabelsError {
    #[error("no Kubernetes API configuration (KUBECONFIG or the in-cluster service account) to read the labels of node {node:?}: {reason}")]
    Config { node: String, reason: String },
    #[error("node {node:?} not found in the Kubernetes API (does --nodeid name the Node object?)")]
    NotFound { node: String },
    #[error("reading node {node:?} from the Kubernetes API: {reason}")]
    Api { node: String, reason: String },
}

impl NodeLabelsError {
    /// The gRPC status at the CSI boundary: UNAVAILABLE for the API's answers (kubelet and the
    /// sidecars retry); FAILED_PRECONDITION when there is no API configuration at all (the
    /// pod lacks its service account token or KUBECONFIG: no retry fixes that).
    pub fn into_status(self) -> tonic::Status {
        match self {
            NodeLabelsError::Config { .. } => tonic::Status::failed_precondition(self.to_string()),
            _ => tonic::Status::unavailable(self.to_string()),
        }
    }
}

/// Whether a Kubernetes API configuration can be made (KUBECONFIG or ~/.kube/config, else the
/// in-cluster service account), without calling the API: for a clear error at startup.
pub async fn check_api_config(node: &str) -> Result<(), NodeLabelsError> {
    kube::Config::infer()
        .await
        .map(|_| ())
        .map_err(|e| NodeLabelsError::Config {
            node: node.to_string(),
            reason: e.to_string(),
        })
}

/// Where a node's labels come from: the Kubernetes API ([`KubeNodeLabels`]) or a test double
/// ([`StaticNodeLabels`]).
#[async_trait::async_trait]
pub trait NodeLabels: Send + Sync {
    async fn labels(&self, node: &str) -> Result<BTreeMap<String, String>, NodeLabelsError>;
}

/// Reads Node objects with kube-rs. The client is made on first use from
/// `kube::Config::infer()` (KUBECONFIG or ~/.kube/config, else the in-cluster service account);
/// a failure to make it is retried on the next call. Needs RBAC `get` on `nodes`.
#[derive(Default)]
pub struct KubeNodeLabels {
    client: OnceCell<kube::Client>,
}

impl KubeNodeLabels {
    pub fn new() -> Self {
        Self::default()
    }

    async fn client(&self, node: &str) -> Result<&kube::Client, NodeLabelsError> {
        let config_err = |reason: String| NodeLabelsError::Config {
            node: node.to_string(),
            reason,
        };
        self.client
            .get_or_try_init(|| async {
                let mut config = kube::Config::infer()
                    .await
                    .map_err(|e| config_err(e.to_string()))?;
                config.connect_timeout = Some(NODE_READ_TIMEOUT);
                config.read_timeout = Some(NODE_READ_TIMEOUT);
                kube::Client::try_from(config).map_err(|e| config_err(e.to_string()))
            })
            .await
    }
}

#[async_trait::async_trait]
impl NodeLabels for KubeNodeLabels {
    async fn labels(&self, node: &str) -> Result<BTreeMap<String, String>, NodeLabelsError> {
        use k8s_openapi::api::core::v1::Node;
        let api: kube::Api<Node> = kube::Api::all(self.client(node).await?.clone());
        let api_err = |reason: String| NodeLabelsError::Api {
            node: node.to_string(),
            reason,
        };
        match tokio::time::timeout(NODE_READ_TIMEOUT, api.get_opt(node)).await {
            Ok(Ok(Some(n))) => Ok(n.metadata.labels.unwrap_or_default()),
            Ok(Ok(None)) => Err(NodeLabelsError::NotFound {
                node: node.to_string(),
            }),
            Ok(Err(e)) => Err(api_err(e.to_string())),
            Err(_) => Err(api_err(format!("no answer within {NODE_READ_TIMEOUT:?}"))),
        }
    }
}

/// Test double: fixed labels per node name; an unknown node is NotFound, and
/// [`StaticNodeLabels::fail`] makes every call fail until [`StaticNodeLabels::recover`].
#[derive(Default)]
pub struct StaticNodeLabels {
    nodes: parking_lot::Mutex<HashMap<String, BTreeMap<String, String>>>,
    failing: std::sync::atomic::AtomicBool,
    panicking: std::sync::atomic::AtomicBool,
    calls: std::sync::atomic::AtomicUsize,
    delay: parking_lot::Mutex<Duration>,
}

impl StaticNodeLabels {
    pub fn new<'a>(node: &str, labels: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let s = Self::default();
        s.nodes.lock().insert(
            node.to_string(),
            labels
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        s
    }

    pub fn fail(&self) {
        self.failing
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn recover(&self) {
        self.failing
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// The next call panics (a bug in the source), once.
    pub fn panic_once(&self) {
        self.panicking
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Sets (or adds) one label of `node`.
    pub fn set_label(&self, node: &str, key: &str, value: &str) {
        self.nodes
            .lock()
            .entry(node.to_string())
            .or_default()
            .insert(key.to_string(), value.to_string());
    }

    /// Every call waits `d` before answering (a slow or black-holed API).
    pub fn slow(&self, d: Duration) {
        *self.delay.lock() = d;
    }

    /// How many times the labels were asked for.
    pub fn calls(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl NodeLabels for StaticNodeLabels {
    async fn labels(&self, node: &str) -> Result<BTreeMap<String, String>, NodeLabelsError> {
        use std::sync::atomic::Ordering;
        self.calls.fetch_add(1, Ordering::SeqCst);
        let delay = *self.delay.lock();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if self.panicking.swap(false, Ordering::SeqCst) {
            panic!("injected panic in the label source");
        }
        if self.failing.load(Ordering::SeqCst) {
            return Err(NodeLabelsError::Api {
                node: node.to_string(),
                reason: "injected failure".into(),
            });
        }
        self.nodes
            .lock()
            .get(node)
            .cloned()
            .ok_or_else(|| NodeLabelsError::NotFound {
                node: node.to_string(),
            })
    }
}

type Labels = Arc<BTreeMap<String, String>>;
type SharedRead = Shared<BoxFuture<'static, Result<Labels, NodeLabelsError>>>;

/// What is known of this node's labels.
#[derive(Default)]
struct LabelCache {
    /// The last successful read.
    labels: Option<Labels>,
    /// When the last read (good or bad) finished.
    last_read: Option<Instant>,
    /// The last read's error, while no read has succeeded since.
    failure: Option<(NodeLabelsError, Instant)>,
    /// The read in flight, shared by every caller that waits for it.
    in_flight: Option<SharedRead>,
}

/// Clears the read in flight, as a failure, when a read task ends without finishing.
struct ReadGuard {
    cache: Arc<parking_lot::Mutex<LabelCache>>,
    node: String,
    finished: bool,
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        tracing::error!(node = %self.node, "reading this node's labels ended without an answer");
        let mut c = self.cache.lock();
        let now = Instant::now();
        c.in_flight = None;
        c.last_read = Some(now);
        c.failure = Some((
            NodeLabelsError::Api {
                node: self.node.clone(),
                reason: "the read ended without an answer".into(),
            },
            now,
        ));
    }
}

/// The node's topology at run time: the spec, where labels come from, and the labels once read.
pub struct NodeTopology {
    spec: TopologySpec,
    node: String,
    source: Option<Arc<dyn NodeLabels>>,
    cache: Arc<parking_lot::Mutex<LabelCache>>,
    reread_missing: Duration,
    failure_memory: Duration,
}

impl NodeTopology {
    /// `source` is used only when the spec needs labels; `None` then means "no API" (every
    /// read fails with a configuration error).
    pub fn new(spec: TopologySpec, node: &str, source: Option<Arc<dyn NodeLabels>>) -> Self {
        NodeTopology {
            spec,
            node: node.to_string(),
            source,
            cache: Arc::default(),
            reread_missing: MISSING_LABEL_REREAD,
            failure_memory: FAILURE_MEMORY,
        }
    }

    /// Other intervals than [`MISSING_LABEL_REREAD`] and [`FAILURE_MEMORY`] (tests).
    pub fn with_intervals(mut self, reread_missing: Duration, failure_memory: Duration) -> Self {
        self.reread_missing = reread_missing;
        self.failure_memory = failure_memory;
        self
    }

    pub fn spec(&self) -> &TopologySpec {
        &self.spec
    }

    /// This node's labels, as far as `complete` needs them: from memory when they satisfy it
    /// (or were read less than `reread_missing` ago), else from the one read in flight (started
    /// if none is). A failure is returned to callers for `failure_memory`; a failed re-read
    /// falls back on the labels read before.
    async fn labels(
        &self,
        complete: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> Result<Labels, NodeLabelsError> {
        let read = {
            let mut c = self.cache.lock();
            let now = Instant::now();
            if let Some(l) = &c.labels {
                let recent = c
                    .last_read
                    .is_some_and(|t| now.duration_since(t) < self.reread_missing);
                if complete(l) || recent {
                    return Ok(l.clone());
                }
            } else if let Some((e, t)) = &c.failure {
                if now.duration_since(*t) < self.failure_memory {
                    return Err(e.clone());
                }
            }
            match &c.in_flight {
                Some(r) => r.clone(),
                None => {
                    let r = self.start_read();
                    c.in_flight = Some(r.clone());
                    r
                }
            }
        };
        match read.await {
            Ok(l) => Ok(l),
            Err(e) => match self.cache.lock().labels.clone() {
                Some(l) => {
                    tracing::warn!(node = %self.node, error = %e, "re-reading this node's labels failed; keeping those read before");
                    Ok(l)
                }
                None => Err(e),
            },
        }
    }

    /// One read of the Node object, in a task of its own (it finishes, and its outcome is
    /// kept, even when every caller waiting for it has given up).
    fn start_read(&self) -> SharedRead {
        let source = self.source.clone();
        let node = self.node.clone();
        let cache = self.cache.clone();
        let task = tokio::spawn(async move {
            // Ends the read should the source panic (or the runtime drop the task): without it
            // `in_flight` would keep the dead read, and every later caller would get its error
            // for the life of the process.
            let mut guard = ReadGuard {
                cache: cache.clone(),
                node: node.clone(),
                finished: false,
            };
            let res = match source {
                None => Err(NodeLabelsError::Config {
                    node: node.clone(),
                    reason: "no Kubernetes client configured".into(),
                }),
                Some(s) => s.labels(&node).await.map(Arc::new),
            };
            let mut c = cache.lock();
            c.in_flight = None;
            c.last_read = Some(Instant::now());
            match &res {
                Ok(l) => {
                    if c.labels.as_deref() != Some(&**l) {
                        tracing::info!(node = %node, labels = ?l, "read this node's labels");
                    }
                    c.labels = Some(l.clone());
                    c.failure = None;
                }
                Err(e) => c.failure = Some((e.clone(), Instant::now())),
            }
            drop(c);
            guard.finished = true;
            res
        });
        let node = self.node.clone();
        async move {
            task.await.unwrap_or_else(|e| {
                Err(NodeLabelsError::Api {
                    node,
                    reason: format!("the read task failed: {e}"),
                })
            })
        }
        .boxed()
        .shared()
    }

    /// The segments NodeGetInfo reports: the labels named by bare keys (missing ones
    /// skipped), then the `key=value` entries. Reads the labels only when there are bare keys.
    pub async fn segments(&self) -> Result<HashMap<String, String>, NodeLabelsError> {
        let mut out = HashMap::new();
        if !self.spec.label_keys.is_empty() {
            let keys = &self.spec.label_keys;
            let labels = self
                .labels(|l| keys.iter().all(|k| l.contains_key(k)))
                .await?;
            for key in &self.spec.label_keys {
                match labels.get(key) {
                    Some(v) => {
                        out.insert(key.clone(), v.clone());
                    }
                    None => {
                        tracing::debug!(node = %self.node, key = %key, "topology label not on the node; skipped")
                    }
                }
            }
        }
        out.extend(self.spec.fixed.clone());
        Ok(out)
    }

    /// The value of `--dataCenterLabel` on this node (None: no such flag, or the node has no
    /// such label, or an empty one).
    pub async fn data_center(&self) -> Result<Option<String>, NodeLabelsError> {
        let Some(label) = self.spec.data_center_label.as_deref() else {
            return Ok(None);
        };
        let labels = self
            .labels(|l| data_center_from(l, label).is_some())
            .await?;
        Ok(data_center_from(&labels, label))
    }

    /// Like [`Self::data_center`] from labels already read; never calls the API.
    pub fn cached_data_center(&self) -> Option<String> {
        let label = self.spec.data_center_label.as_deref()?;
        data_center_from(self.cache.lock().labels.as_ref()?, label)
    }
}

fn data_center_from(labels: &BTreeMap<String, String>, label: &str) -> Option<String> {
    labels
        .get(label)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
        .map(String::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ZONE: &str = "topology.kubernetes.io/zone";

    fn spec(fixed: &[(&str, &str)], keys: &[&str], dc: Option<&str>) -> TopologySpec {
        TopologySpec {
            fixed: fixed
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            label_keys: keys.iter().map(|s| s.to_string()).collect(),
            data_center_label: dc.map(String::from),
        }
    }

    fn double() -> Arc<StaticNodeLabels> {
        Arc::new(StaticNodeLabels::new(
            "n1",
            [(ZONE, "z-a"), ("example.com/rack", "r7"), ("empty", " ")],
        ))
    }

    #[tokio::test]
    async fn bare_keys_read_labels_and_skip_missing_ones() {
        let src = double();
        let t = NodeTopology::new(
            spec(
                &[("fixed", "yes"), ("example.com/rack", "given")],
                &[ZONE, "example.com/rack", "absent"],
                None,
            ),
            "n1",
            Some(src.clone()),
        );
        let got = t.segments().await.unwrap();
        let want: HashMap<String, String> = [
            (ZONE, "z-a"),
            ("example.com/rack", "given"),
            ("fixed", "yes"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(got, want, "labels, missing skipped, key=value wins");
        assert!(t.spec().advertised());
    }

    #[tokio::test]
    async fn fixed_only_never_asks_the_api() {
        let src = double();
        src.fail();
        let t = NodeTopology::new(spec(&[("zone", "a")], &[], None), "n1", Some(src.clone()));
        assert_eq!(t.segments().await.unwrap()["zone"], "a");
        assert_eq!(t.data_center().await.unwrap(), None);
        assert_eq!(src.calls(), 0);
        assert!(!t.spec().needs_labels());
    }

    #[tokio::test]
    async fn labels_are_read_once_and_failures_are_not_kept() {
        let src = double();
        src.fail();
        let t = NodeTopology::new(spec(&[], &[ZONE], Some(ZONE)), "n1", Some(src.clone()))
            .with_intervals(MISSING_LABEL_REREAD, Duration::ZERO);
        let e = t.segments().await.unwrap_err();
        assert!(e.to_string().contains("\"n1\""), "{e}");
        assert_eq!(e.into_status().code(), tonic::Code::Unavailable);
        assert_eq!(t.cached_data_center(), None);
        src.recover();
        assert_eq!(t.segments().await.unwrap()[ZONE], "z-a");
        assert_eq!(t.data_center().await.unwrap().as_deref(), Some("z-a"));
        assert_eq!(t.cached_data_center().as_deref(), Some("z-a"));
        src.fail();
        assert_eq!(
            t.segments().await.unwrap()[ZONE],
            "z-a",
            "kept for the process"
        );
        assert_eq!(src.calls(), 2);
    }

    #[tokio::test]
    async fn a_read_that_panics_is_a_failure_and_read_again() {
        let src = double();
        src.panic_once();
        let t = NodeTopology::new(spec(&[], &[ZONE], Some(ZONE)), "n1", Some(src.clone()))
            .with_intervals(MISSING_LABEL_REREAD, Duration::ZERO);
        let e = t.segments().await.unwrap_err();
        assert_eq!(e.into_status().code(), tonic::Code::Unavailable);
        // Not stuck on the dead read: the next caller asks the API again.
        assert_eq!(t.segments().await.unwrap()[ZONE], "z-a");
        assert_eq!(t.data_center().await.unwrap().as_deref(), Some("z-a"));
        assert_eq!(src.calls(), 2);
    }

    /// The panicked read is a failure like any other: remembered for `failure_memory`, so
    /// callers meanwhile get it without asking the API again.
    #[tokio::test]
    async fn a_read_that_panics_is_a_failure_remembered_as_any() {
        let src = double();
        src.panic_once();
        let t = NodeTopology::new(spec(&[], &[ZONE], Some(ZONE)), "n1", Some(src.clone()))
            .with_intervals(MISSING_LABEL_REREAD, Duration::from_secs(60));
        for _ in 0..2 {
            let e = t.segments().await.unwrap_err();
            assert_eq!(e.into_status().code(), tonic::Code::Unavailable);
        }
        assert_eq!(
            t.data_center().await.unwrap_err().into_status().code(),
            tonic::Code::Unavailable
        );
        assert_eq!(src.calls(), 1);
    }

    #[tokio::test]
    async fn data_center_label_missing_or_empty_is_none() {
        let t = NodeTopology::new(spec(&[], &[], Some("nope")), "n1", Some(double()));
        assert_eq!(t.data_center().await.unwrap(), None);
        let t = NodeTopology::new(spec(&[], &[], Some("empty")), "n1", Some(double()));
        assert_eq!(t.data_center().await.unwrap(), None);
        assert!(
            !t.spec().advertised(),
            "a data-center label alone is no topology"
        );
    }

    #[tokio::test]
    async fn unknown_node_and_no_client_are_clear_errors() {
        let t = NodeTopology::new(spec(&[], &[ZONE], None), "other", Some(double()));
        let e = t.segments().await.unwrap_err();
        assert!(matches!(e, NodeLabelsError::NotFound { .. }), "{e:?}");
        assert!(e.to_string().contains("\"other\" not found"), "{e}");
        let t = NodeTopology::new(spec(&[], &[ZONE], None), "n1", None);
        let e = t.segments().await.unwrap_err();
        assert!(matches!(e, NodeLabelsError::Config { .. }), "{e:?}");
        // No configuration is not retryable: FAILED_PRECONDITION, not UNAVAILABLE.
        assert_eq!(e.into_status().code(), tonic::Code::FailedPrecondition);
    }

    #[tokio::test]
    async fn a_label_missing_from_the_read_is_read_again_after_the_interval() {
        // Long enough that a loaded machine still makes the calls below within it.
        let interval = Duration::from_secs(2);
        let src = Arc::new(StaticNodeLabels::new("n1", [("example.com/rack", "r7")]));
        let t = NodeTopology::new(
            spec(&[], &["example.com/rack", ZONE], Some(ZONE)),
            "n1",
            Some(src.clone()),
        )
        .with_intervals(interval, Duration::ZERO);
        assert_eq!(t.segments().await.unwrap().get(ZONE), None);
        assert_eq!(t.data_center().await.unwrap(), None);
        assert_eq!(src.calls(), 1, "not again within the interval");
        // The cloud adds the zone label after the node booted.
        src.set_label("n1", ZONE, "z-b");
        assert_eq!(t.data_center().await.unwrap(), None, "rate limited");
        assert_eq!(src.calls(), 1);
        tokio::time::sleep(interval + Duration::from_millis(50)).await;
        assert_eq!(t.data_center().await.unwrap().as_deref(), Some("z-b"));
        assert_eq!(t.cached_data_center().as_deref(), Some("z-b"));
        assert_eq!(t.segments().await.unwrap()[ZONE], "z-b");
        assert_eq!(src.calls(), 2);
        // Complete now: kept, however long it has been.
        tokio::time::sleep(interval + Duration::from_millis(50)).await;
        t.segments().await.unwrap();
        t.data_center().await.unwrap();
        assert_eq!(src.calls(), 2, "nothing missing: not read again");
    }

    #[tokio::test]
    async fn a_failed_re_read_keeps_the_labels_read_before() {
        let interval = Duration::from_secs(1);
        let src = Arc::new(StaticNodeLabels::new("n1", [("example.com/rack", "r7")]));
        let t = NodeTopology::new(
            spec(&[], &["example.com/rack", ZONE], None),
            "n1",
            Some(src.clone()),
        )
        .with_intervals(interval, Duration::ZERO);
        assert_eq!(t.segments().await.unwrap()["example.com/rack"], "r7");
        src.fail();
        tokio::time::sleep(interval + Duration::from_millis(50)).await;
        assert_eq!(t.segments().await.unwrap()["example.com/rack"], "r7");
        assert_eq!(src.calls(), 2, "re-read tried");
        // And the failed attempt counts for the rate limit.
        t.segments().await.unwrap();
        assert_eq!(src.calls(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_callers_share_one_read_and_its_failure() {
        let delay = Duration::from_millis(400);
        let src = double();
        src.fail();
        src.slow(delay);
        let t = Arc::new(
            NodeTopology::new(spec(&[], &[ZONE], Some(ZONE)), "n1", Some(src.clone()))
                .with_intervals(MISSING_LABEL_REREAD, Duration::from_secs(2)),
        );
        let started = Instant::now();
        let calls: Vec<_> = (0..8)
            .map(|i| {
                let t = t.clone();
                tokio::spawn(async move {
                    if i % 2 == 0 {
                        t.segments().await.map(|_| ())
                    } else {
                        t.data_center().await.map(|_| ())
                    }
                })
            })
            .collect();
        for c in futures::future::join_all(calls).await {
            let e = c.unwrap().unwrap_err();
            assert!(e.to_string().contains("injected failure"), "{e}");
        }
        let took = started.elapsed();
        assert!(
            took < delay * 2,
            "8 callers took {took:?}: one read of {delay:?} should serve them all"
        );
        assert_eq!(src.calls(), 1, "one read in flight, shared");
        // Remembered for a while: a caller arriving now gets it at once.
        let started = Instant::now();
        t.segments().await.unwrap_err();
        assert!(started.elapsed() < delay, "{:?}", started.elapsed());
        assert_eq!(src.calls(), 1);
        // Then the API is asked again.
        src.recover();
        src.slow(Duration::ZERO);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(t.segments().await.unwrap()[ZONE], "z-a");
        assert_eq!(src.calls(), 2);
    }
}
