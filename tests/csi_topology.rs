//! Topology from Node labels (`--topologyKeys` label keys, `--dataCenterLabel`): the driver
//! binary on its CSI socket, driven like kubelet, reading its own Node object through a
//! kubeconfig from a fake Kubernetes API server (plain HTTP on 127.0.0.1, in this process) that
//! can be told to fail. Staging runs against a real SeaweedFS.

#[allow(unused_imports)]
mod common;
mod csi_common;

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use csi_common::*;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use seaweedfs_csi_driver::pb::csi::plugin_capability::{self, service};
use seaweedfs_csi_driver::pb::csi::volume_capability::access_mode::Mode;
use seaweedfs_csi_driver::pb::csi::*;
use tonic::Code;

const ZONE: &str = "topology.kubernetes.io/zone";

#[derive(Default)]
struct ApiState {
    nodes: Mutex<HashMap<String, BTreeMap<String, String>>>,
    failing: AtomicBool,
    /// Paths of the requests served, in order.
    requests: Mutex<Vec<String>>,
}

/// A Kubernetes API server that knows `GET /api/v1/nodes/<name>`: the Node with its labels,
/// 404 (a NotFound Status) for other names, 500 while failing. Stopped on drop.
struct FakeApi {
    state: Arc<ApiState>,
    task: tokio::task::JoinHandle<()>,
    /// Holds the kubeconfig.
    dir: tempfile::TempDir,
}

fn status_json(code: u16, reason: &str, message: &str) -> String {
    serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
    .to_string()
}

fn answer(state: &ApiState, path: &str) -> (StatusCode, String) {
    state.requests.lock().push(path.to_string());
    if state.failing.load(Ordering::SeqCst) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            status_json(500, "InternalError", "etcd is sulking"),
        );
    }
    let Some(name) = path.strip_prefix("/api/v1/nodes/") else {
        return (
            StatusCode::NOT_FOUND,
            status_json(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    match state.nodes.lock().get(name) {
        Some(labels) => (
            StatusCode::OK,
            serde_json::json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": { "name": name, "uid": "0d7a4c3e-1", "labels": labels },
                "spec": {}, "status": {},
            })
            .to_string(),
        ),
        None => (
            StatusCode::NOT_FOUND,
            status_json(404, "NotFound", &format!("nodes \"{name}\" not found")),
        ),
    }
}

impl FakeApi {
    async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(ApiState::default());
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc =
                        hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                            let (code, body) = answer(&st, req.uri().path());
                            let resp = Response::builder()
                                .status(code)
                                .header("content-type", "application/json")
                                .body(body)
                                .unwrap();
                            async move { Ok::<_, Infallible>(resp) }
                        });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        let dir = tempfile::Builder::new()
            .prefix("kubeapi")
            .tempdir()
            .unwrap();
        std::fs::write(
            dir.path().join("kubeconfig"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{port}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user:\n    token: not-a-secret\n"
            ),
        )
        .unwrap();
        FakeApi { state, task, dir }
    }

    fn kubeconfig(&self) -> String {
        self.dir.path().join("kubeconfig").display().to_string()
    }

    fn set_node(&self, name: &str, labels: &[(&str, &str)]) {
        self.state.nodes.lock().insert(
            name.to_string(),
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
    }

    fn fail(&self, on: bool) {
        self.state.failing.store(on, Ordering::SeqCst);
    }

    fn requests(&self) -> Vec<String> {
        self.state.requests.lock().clone()
    }

    /// The driver (`--nodeid=test-node`) with this API's kubeconfig.
    fn driver(&self, filer: &str, extra: &[&str]) -> Driver {
        Driver::start_env(filer, extra, &[("KUBECONFIG", &self.kubeconfig())])
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn segments(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// No filer is needed for Identity and NodeGetInfo: nothing listens here.
const NO_FILER: &str = "127.0.0.1:9";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_get_info_reports_the_node_labels_named_by_topology_keys() {
    let api = FakeApi::start().await;
    api.set_node(
        "test-node",
        &[
            (ZONE, "z-a"),
            ("example.com/rack", "r7"),
            ("kubernetes.io/hostname", "test-node"),
        ],
    );
    api.set_node("other-node", &[(ZONE, "z-b")]);
    // The API is down when the plugin starts: startup must not depend on it.
    api.fail(true);
    let driver = api.driver(
        NO_FILER,
        &[
            "--components=node",
            "-topologyKeys=topology.kubernetes.io/zone,example.com/rack,missing.example.com/key,fixed=yes",
        ],
    );
    let mut c = driver.clients().await;

    let caps = c
        .identity
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let constraints = PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service {
                r#type: service::Type::VolumeAccessibilityConstraints as i32,
            },
        )),
    };
    assert!(
        caps.contains(&constraints),
        "topology keys advertise VOLUME_ACCESSIBILITY_CONSTRAINTS: {caps:?}"
    );
    assert!(
        api.requests().is_empty(),
        "nothing read before it is needed"
    );

    // API failure: an error kubelet retries, naming the node and the API's answer.
    let err = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("\"test-node\"") && err.message().contains("etcd is sulking"),
        "{err:?}"
    );
    assert_eq!(
        api.requests(),
        vec!["/api/v1/nodes/test-node".to_string()],
        "its own Node object, by --nodeid"
    );
    // The plugin is still up.
    c.identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap();

    // The API recovers: kubelet's retry gets the labels; a missing one is skipped, key=value
    // entries are reported as given.
    api.fail(false);
    let info = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "test-node");
    let want = segments(&[(ZONE, "z-a"), ("example.com/rack", "r7"), ("fixed", "yes")]);
    assert_eq!(info.accessible_topology.unwrap().segments, want);

    // Read once per process: a later call is answered from memory, even with the API down.
    api.fail(true);
    let n = api.requests().len();
    let info = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.accessible_topology.unwrap().segments, want);
    assert_eq!(api.requests().len(), n, "labels kept for the process");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_object_that_does_not_exist_is_a_clear_error() {
    let api = FakeApi::start().await;
    api.set_node("some-other-node", &[(ZONE, "z-a")]);
    let driver = api.driver(NO_FILER, &["--components=node", "--topologyKeys", ZONE]);
    let mut c = driver.clients().await;
    let err = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("node \"test-node\" not found"),
        "{err:?}"
    );
    // Created later (e.g. the plugin came up before its Node object): the retry works.
    api.set_node("test-node", &[(ZONE, "z-c")]);
    let info = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        info.accessible_topology.unwrap().segments,
        segments(&[(ZONE, "z-c")])
    );
}

/// Stages `name` (created first) and returns the result with the staging path.
async fn stage(
    driver: &Driver,
    c: &mut Clients,
    name: &str,
    params: &[(&str, &str)],
) -> (Volume, std::path::PathBuf, Result<(), tonic::Status>) {
    let vol = c
        .controller
        .create_volume(create_req(name, 1 << 30, params))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let staging = driver.staging_path(name);
    let r = c
        .node
        .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
        .await
        .map(|_| ());
    (vol, staging, r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_center_label_gives_local_writes_the_node_data_center() {
    let weed = common::WeedServer::start();
    let api = FakeApi::start().await;
    api.set_node("test-node", &[(ZONE, "z-a")]);
    api.fail(true);
    // No --dataCenter: the zone label stands in for it (without --dataCenterLabel this
    // command line is refused at startup).
    let driver = api.driver(
        &weed.filer_addr(),
        &[
            "--dataLocality=write_preferLocalDc",
            "--dataCenterLabel=topology.kubernetes.io/zone",
        ],
    );
    let mut c = driver.clients().await;

    // The data center is read when a volume needs it; an API failure is retryable.
    let (vol, staging, r) = stage(&driver, &mut c, "pvc-topo-dc", &[]).await;
    let err = r.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(driver.mounts().is_empty());
    api.fail(false);
    c.node
        .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
        .await
        .unwrap();
    assert!(
        driver
            .log()
            .contains(&format!("volume_id=\"{}\"", vol.volume_id))
            && driver.log().contains("data_center=z-a"),
        "the session writes to the node's zone:\n{}",
        driver.log()
    );

    // A StorageClass dataCenter wins over the label.
    let (vol2, staging2, r) = stage(
        &driver,
        &mut c,
        "pvc-topo-explicit",
        &[("dataCenter", "dc-x")],
    )
    .await;
    r.unwrap();
    assert!(
        driver.log().contains("data_center=dc-x"),
        "{}",
        driver.log()
    );
    assert_eq!(
        api.requests().len(),
        2,
        "one failed read, one good one, then from memory"
    );

    for (v, s) in [(&vol, &staging), (&vol2, &staging2)] {
        c.node.node_unstage_volume(unstage_req(v, s)).await.unwrap();
    }
    assert!(driver.mounts().is_empty());
    drop(driver);

    // A node without the label: the same error as a missing --dataCenter, naming the label.
    let bare = FakeApi::start().await;
    bare.set_node("test-node", &[("kubernetes.io/hostname", "test-node")]);
    let driver = bare.driver(
        &weed.filer_addr(),
        &[
            "--dataLocality=write_preferLocalDc",
            "--dataCenterLabel=topology.kubernetes.io/zone",
        ],
    );
    let mut c = driver.clients().await;
    let (_, _, r) = stage(&driver, &mut c, "pvc-topo-nolabel", &[]).await;
    let err = r.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains(ZONE), "{err:?}");
    // A volume without local writes never needs the label.
    let (v, s, r) = stage(
        &driver,
        &mut c,
        "pvc-topo-nolocality",
        &[("dataLocality", "none")],
    )
    .await;
    r.unwrap();
    c.node
        .node_unstage_volume(unstage_req(&v, &s))
        .await
        .unwrap();
    assert!(driver.mounts().is_empty());
}
