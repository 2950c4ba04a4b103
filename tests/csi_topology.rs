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

/// Evaluates `$call` (a CSI call) until it succeeds, like kubelet's retries: a failed read of
/// the Node object is returned for a few seconds (topology.rs FAILURE_MEMORY) before the API
/// is asked again. Panics after 20 s with the last error.
macro_rules! until_ok {
    ($call:expr) => {{
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            match $call.await {
                Ok(r) => break r,
                Err(e) if std::time::Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
                Err(e) => panic!("still failing: {e:?}"),
            }
        }
    }};
}

/// The options the node plugin recorded for `volume_id` in its state file (what the FUSE
/// session was started with; `--stateDir` defaults to `plugin/state` next to the socket).
fn recorded_opts(driver: &Driver, volume_id: &str) -> seaweedfs_csi_driver::config::MountOptions {
    let dir = driver.socket.parent().unwrap().join("state");
    let store = seaweedfs_csi_driver::csi::state::StateStore::open(&dir).unwrap();
    store
        .get(volume_id)
        .unwrap()
        .unwrap_or_else(|| panic!("{volume_id} not recorded in {}", dir.display()))
        .opts
}

/// The fd-keeper (`keeper` subcommand) on `socket`: FUSE sessions outlive a plugin restart.
/// SIGKILLed on drop.
struct Keeper(std::process::Child);

impl Keeper {
    fn start(socket: &std::path::Path) -> Keeper {
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let child = std::process::Command::new(driver_bin())
            .arg("keeper")
            .arg(format!("--socket={}", socket.display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let k = Keeper(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while seaweedfs_csi_driver::keeper::KeeperClient::connect(socket).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "keeper never listened"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        k
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

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
    let info = until_ok!(c.node.node_get_info(NodeGetInfoRequest {})).into_inner();
    assert_eq!(info.node_id, "test-node");
    let want = segments(&[(ZONE, "z-a"), ("example.com/rack", "r7"), ("fixed", "yes")]);
    assert_eq!(info.accessible_topology.unwrap().segments, want);
    assert_eq!(
        api.requests().len(),
        2,
        "a failure is remembered for a while, not asked again at once"
    );

    // Read once per process: a later call is answered from memory, even with the API down
    // (missing.example.com/key is missing: it is read again, but at most every 10 s).
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
    let info = until_ok!(c.node.node_get_info(NodeGetInfoRequest {})).into_inner();
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

/// Local writes with the data center taken from the zone label (no --dataCenter).
const LOCAL_WRITES_BY_LABEL: &[&str] = &[
    "--dataLocality=write_preferLocalDc",
    "--dataCenterLabel=topology.kubernetes.io/zone",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_center_label_gives_local_writes_the_node_data_center() {
    let weed = common::WeedServer::start();
    let api = FakeApi::start().await;
    api.set_node("test-node", &[(ZONE, "z-a")]);
    api.fail(true);
    // No --dataCenter: the zone label stands in for it (without --dataCenterLabel this
    // command line is refused at startup).
    let driver = api.driver(&weed.filer_addr(), LOCAL_WRITES_BY_LABEL);
    let mut c = driver.clients().await;

    // The data center is read when a volume needs it; an API failure is retryable.
    let (vol, staging, r) = stage(&driver, &mut c, "pvc-topo-dc", &[]).await;
    let err = r.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(driver.mounts().is_empty());
    api.fail(false);
    until_ok!(c
        .node
        .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter)));
    // What the session was started with (and what a recovery restarts it with).
    let opts = recorded_opts(&driver, &vol.volume_id);
    assert_eq!(
        opts.data_center, "z-a",
        "the session writes to the node's zone"
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
    assert_eq!(recorded_opts(&driver, &vol2.volume_id).data_center, "dc-x");
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

    // A node without the label (yet): FAILED_PRECONDITION naming the label and the node.
    let bare = FakeApi::start().await;
    bare.set_node("test-node", &[("kubernetes.io/hostname", "test-node")]);
    let driver = bare.driver(&weed.filer_addr(), LOCAL_WRITES_BY_LABEL);
    let mut c = driver.clients().await;
    let (_, _, r) = stage(&driver, &mut c, "pvc-topo-nolabel", &[]).await;
    let err = r.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains(ZONE) && err.message().contains("\"test-node\""),
        "{err:?}"
    );
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

/// kubelet repeats NodeStage for volumes that are already staged after a plugin restart. A
/// healthy (adopted) volume keeps the data center its session was started with, and needs no
/// Kubernetes API: neither an API failure nor a changed label touch it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_healthy_volume_staged_again_after_a_restart_keeps_its_data_center() {
    let weed = common::WeedServer::start();
    let api = FakeApi::start().await;
    api.set_node("test-node", &[(ZONE, "z-a")]);
    let dir = tempfile::Builder::new()
        .prefix("csitopo")
        .tempdir()
        .unwrap();
    let keeper_sock = dir.path().join("keeper/keeper.sock");
    let _keeper = Keeper::start(&keeper_sock);
    let socket = dir.path().join("plugin/csi.sock");
    let args = vec![
        format!("--endpoint=unix://{}", socket.display()),
        format!("--filer={}", weed.filer_addr()),
        "--nodeid=test-node".to_string(),
        format!("--keeperSocket={}", keeper_sock.display()),
        "--logLevel=info,seaweedfs_csi_driver=debug".to_string(),
        "--dataLocality=write_preferLocalDc".to_string(),
        format!("--dataCenterLabel={ZONE}"),
        format!("--topologyKeys={ZONE}"),
    ];
    let env = vec![("KUBECONFIG".to_string(), api.kubeconfig())];
    let mut driver = Driver::start_raw(dir, socket, Stager::Fuse, args, env);
    let mut c = driver.clients().await;
    let (vol, staging, r) = stage(&driver, &mut c, "pvc-topo-restart", &[]).await;
    r.unwrap();
    assert_eq!(recorded_opts(&driver, &vol.volume_id).data_center, "z-a");

    // The plugin restarts (its session survives in the keeper) while the API is down.
    api.fail(true);
    driver.kill();
    driver.restart();
    let mut c = driver.clients().await;
    let n = api.requests().len();
    c.node
        .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
        .await
        .expect("a healthy volume needs no Kubernetes API");
    assert_eq!(api.requests().len(), n, "NodeStage read the Node object");
    // The API is back, with another zone, and the plugin has read it (kubelet registered the
    // restarted plugin): the live session still writes to z-a.
    api.fail(false);
    api.set_node("test-node", &[(ZONE, "z-b")]);
    let info = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        info.accessible_topology.unwrap().segments,
        segments(&[(ZONE, "z-b")])
    );
    let n = api.requests().len();
    c.node
        .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
        .await
        .unwrap();
    assert_eq!(
        recorded_opts(&driver, &vol.volume_id).data_center,
        "z-a",
        "the recorded options are the session's, not the current label"
    );
    assert_eq!(
        api.requests().len(),
        n,
        "NodeStage of a healthy volume read the Node object"
    );

    c.node
        .node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert!(driver.mounts().is_empty());
}

/// The controller needs the node plugin's `--topologyKeys` (the provisioner asks its Identity)
/// but never reads them: no API configuration, RBAC or requests; a node plugin without any
/// API configuration says so at startup and fails with FAILED_PRECONDITION.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_advertises_topology_without_the_api_and_a_node_without_config_says_so() {
    let api = FakeApi::start().await;
    api.set_node("test-node", &[(ZONE, "z-a")]);
    let constraints = PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service {
                r#type: service::Type::VolumeAccessibilityConstraints as i32,
            },
        )),
    };
    let no_config: &[(&str, &str)] = &[("KUBECONFIG", "/nonexistent/kubeconfig")];
    for env in [&[("KUBECONFIG", api.kubeconfig().as_str())][..], no_config] {
        let driver = Driver::start_env(
            NO_FILER,
            &["--components=controller", "--topologyKeys", ZONE],
            env,
        );
        let mut c = driver.clients().await;
        let caps = c
            .identity
            .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities;
        assert!(caps.contains(&constraints), "{env:?}: {caps:?}");
        assert!(
            !driver.log().contains("cannot be read"),
            "{env:?}:\n{}",
            driver.log()
        );
    }
    assert!(api.requests().is_empty(), "the controller read the API");

    let driver = Driver::start_env(
        NO_FILER,
        &["--components=node", "--topologyKeys", ZONE],
        no_config,
    );
    let log = driver.log();
    assert!(
        log.contains("ERROR") && log.contains("cannot be read") && log.contains("test-node"),
        "one clear error at startup:\n{log}"
    );
    let mut c = driver.clients().await;
    let err = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
}

/// The data center reaches SeaweedFS: with volume servers in two data centers, a volume whose
/// data center comes from the node's zone label writes its chunks to that data center's
/// volume server, and one whose StorageClass names the other one writes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chunks_land_in_the_data_center_the_session_names() {
    use std::io::Write;
    let mut weed = common::WeedServer::start();
    let port_a = weed.start_extra_volume("za", &["-dataCenter=z-a"]);
    let port_b = weed.start_extra_volume("zb", &["-dataCenter=z-b"]);
    let api = FakeApi::start().await;
    api.set_node("test-node", &[(ZONE, "z-a")]);
    let driver = api.driver(&weed.filer_addr(), LOCAL_WRITES_BY_LABEL);
    let mut c = driver.clients().await;
    let (va, sa, r) = stage(&driver, &mut c, "pvc-dc-label", &[]).await;
    r.unwrap();
    let (vb, sb, r) = stage(&driver, &mut c, "pvc-dc-class", &[("dataCenter", "z-b")]).await;
    r.unwrap();
    for (vol, staging, port) in [(&va, &sa, port_a), (&vb, &sb, port_b)] {
        let p = staging.join("f");
        tokio::task::spawn_blocking(move || {
            let mut f = std::fs::File::create(&p)?;
            f.write_all(&vec![7u8; 3 << 20])?;
            f.sync_all()
        })
        .await
        .unwrap()
        .unwrap();
        let meta = common::http_get(&weed.filer_url(&format!("{}/f?metadata=true", vol.volume_id)))
            .expect("the file's metadata");
        let entry: serde_json::Value = serde_json::from_slice(&meta).unwrap();
        let chunks = entry["chunks"].as_array().expect("chunks");
        assert!(!chunks.is_empty(), "{entry}");
        for ch in chunks {
            let vid = ch["file_id"].as_str().unwrap().split(',').next().unwrap();
            let loc = common::http_get(&format!(
                "http://{}/dir/lookup?volumeId={vid}",
                weed.master_addr()
            ))
            .expect("volume lookup");
            let loc: serde_json::Value = serde_json::from_slice(&loc).unwrap();
            let urls: Vec<String> = loc["locations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l["url"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(
                urls,
                vec![format!("127.0.0.1:{port}")],
                "{}: chunk {ch}",
                vol.volume_id
            );
        }
    }
    for (v, s) in [(&va, &sa), (&vb, &sb)] {
        c.node.node_unstage_volume(unstage_req(v, s)).await.unwrap();
    }
    assert!(driver.mounts().is_empty());
}
