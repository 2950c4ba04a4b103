//! This node's topology segments and data center, from `--topologyKeys` and
//! `--dataCenterLabel`.
//!
//! `--topologyKeys` entries are either `key=value` (reported as given) or, as in the Go driver,
//! bare Node label keys: the plugin reads its own Node object (`--nodeid`) from the Kubernetes
//! API and reports those labels' values; missing labels are skipped. `--dataCenterLabel` names
//! a label whose value is the node's default data center when `--dataCenter` is empty.
//!
//! The Node object is read lazily, on the first call that needs it, and kept for the life of
//! the process (node labels rarely change; a restart picks changes up). A failure is not kept:
//! the next call (kubelet retries NodeGetInfo) asks again. Startup never depends on the API.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OnceCell;

/// Bound on one read of the Node object (connect and answer).
pub const NODE_READ_TIMEOUT: Duration = Duration::from_secs(15);

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
    /// The gRPC status at the CSI boundary: UNAVAILABLE, so kubelet and the sidecars retry.
    pub fn into_status(self) -> tonic::Status {
        tonic::Status::unavailable(self.to_string())
    }
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
    calls: std::sync::atomic::AtomicUsize,
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

/// The node's topology at run time: the spec, where labels come from, and the labels once read.
pub struct NodeTopology {
    spec: TopologySpec,
    node: String,
    source: Option<Arc<dyn NodeLabels>>,
    labels: OnceCell<BTreeMap<String, String>>,
}

impl NodeTopology {
    /// `source` is used only when the spec needs labels; `None` then means "no API" (every
    /// read fails with a configuration error).
    pub fn new(spec: TopologySpec, node: &str, source: Option<Arc<dyn NodeLabels>>) -> Self {
        NodeTopology {
            spec,
            node: node.to_string(),
            source,
            labels: OnceCell::new(),
        }
    }

    pub fn spec(&self) -> &TopologySpec {
        &self.spec
    }

    /// This node's labels: read once, then from memory; a failure is not remembered.
    async fn labels(&self) -> Result<&BTreeMap<String, String>, NodeLabelsError> {
        self.labels
            .get_or_try_init(|| async {
                let source = self
                    .source
                    .as_ref()
                    .ok_or_else(|| NodeLabelsError::Config {
                        node: self.node.clone(),
                        reason: "no Kubernetes client configured".into(),
                    })?;
                let labels = source.labels(&self.node).await?;
                tracing::info!(node = %self.node, ?labels, "read this node's labels");
                Ok(labels)
            })
            .await
    }

    /// The segments NodeGetInfo reports: the labels named by bare keys (missing ones
    /// skipped), then the `key=value` entries. Reads the labels only when there are bare keys.
    pub async fn segments(&self) -> Result<HashMap<String, String>, NodeLabelsError> {
        let mut out = HashMap::new();
        if !self.spec.label_keys.is_empty() {
            let labels = self.labels().await?;
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
        let labels = self.labels().await?;
        Ok(data_center_from(labels, label))
    }

    /// Like [`Self::data_center`] from labels already read; never calls the API.
    pub fn cached_data_center(&self) -> Option<String> {
        let label = self.spec.data_center_label.as_deref()?;
        data_center_from(self.labels.get()?, label)
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
        let t = NodeTopology::new(spec(&[], &[ZONE], Some(ZONE)), "n1", Some(src.clone()));
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
    }
}
