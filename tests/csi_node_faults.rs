//! Node service served in-process on a real unix socket with the FakeStager, so faults can be
//! injected into the stager and its calls inspected. Real mounts throughout.

mod csi_common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use csi_common::*;
use seaweedfs_csi_driver::csi::identity::IdentityService;
use seaweedfs_csi_driver::csi::mounts::{self, MountState};
use seaweedfs_csi_driver::csi::node::{NodeConfig, NodeService};
use seaweedfs_csi_driver::csi::params::{DataLocality, VolumeDefaults};
use seaweedfs_csi_driver::csi::server::{self, BoundListener, CsiServices, Endpoint};
use seaweedfs_csi_driver::csi::stager::{FakeStager, StageError, Stager, StagerCall};
use seaweedfs_csi_driver::csi::topology::{StaticNodeLabels, TopologySpec};
use seaweedfs_csi_driver::filer::mock::MockFiler;
use seaweedfs_csi_driver::pb::csi::node_server::Node;
use seaweedfs_csi_driver::pb::csi::volume_capability::access_mode::Mode;
use seaweedfs_csi_driver::pb::csi::*;
use tonic::{Code, Request};

struct Harness {
    dir: tempfile::TempDir,
    stager: Arc<FakeStager>,
    clients: Clients,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<()>>,
}

impl Harness {
    async fn start() -> Harness {
        let dir = tempfile::Builder::new()
            .prefix("csifaults")
            .tempdir()
            .unwrap();
        let stager = Arc::new(FakeStager::new(dir.path().join("scratch")).unwrap());
        let config = NodeConfig {
            node_id: "n1".into(),
            max_volumes_per_node: 0,
            topology: TopologySpec {
                fixed: [("zone".to_string(), "z1".to_string())].into(),
                ..Default::default()
            },
            defaults: VolumeDefaults {
                base: seaweedfs_csi_driver::config::MountOptions {
                    filers: vec!["f:8888".into()],
                    ..Default::default()
                },
                cache_root: Some(PathBuf::from("/var/cache/test")),
                ..Default::default()
            },
        };
        let services = CsiServices {
            identity: IdentityService::new("test.csi", Arc::new(MockFiler::new()), true),
            controller: None,
            node: Some(NodeService::new(stager.clone(), config)),
        };
        let socket = dir.path().join("csi.sock");
        let listener = BoundListener::bind(&Endpoint::Unix(socket.clone()))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(async move {
            server::serve(listener, services, async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        let clients = Clients::connect(&socket).await;
        Harness {
            dir,
            stager,
            clients,
            stop: Some(tx),
            served: Some(served),
        }
    }

    fn staging(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(format!("staging/{name}"));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    fn target(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(format!("pods/{name}/mount"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        p
    }

    fn mounts(&self) -> Vec<PathBuf> {
        mounts_below(self.dir.path())
    }

    async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.served.take() {
            let _ = tokio::time::timeout(Duration::from_secs(15), h).await;
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        unmount_below(self.dir.path());
    }
}

fn volume(id: &str, ctx: &[(&str, &str)]) -> Volume {
    Volume {
        volume_id: id.into(),
        volume_context: ctx
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

fn is_mounted(p: &Path) -> bool {
    mounts::is_mount_point(p).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_stage_leaves_nothing_mounted_and_can_be_retried() {
    let h = Harness::start().await;
    let mut node = h.clients.node.clone();
    let vol = volume("/buckets/faulty", &[]);
    let staging = h.staging("faulty");

    h.stager
        .fail_next_stage(StageError::Unavailable("filer down (injected)".into()));
    let err = node
        .node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(err.message().contains("injected"));
    assert!(h.mounts().is_empty(), "stray mounts: {:?}", h.mounts());

    h.stager.fail_next_stage(StageError::InvalidOptions(
        "bad filer address (injected)".into(),
    ));
    let err = node
        .node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(h.mounts().is_empty());

    node.node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await
        .unwrap();
    assert!(is_mounted(&staging));
    assert_eq!(h.stager.stage_count(), 3);

    // Unstage still unmounts when the stager fails to end the session.
    h.stager
        .fail_next_unstage(StageError::Unmount("stuck (injected)".into()));
    node.node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert!(h.mounts().is_empty());
    assert!(!staging.exists(), "empty staging dir removed");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn options_reach_the_stager() {
    let h = Harness::start().await;
    let mut node = h.clients.node.clone();
    let vol = volume(
        "/buckets/opts",
        &[
            ("volumeCapacity", "1073741824"),
            ("collection", "c9"),
            ("csi.storage.k8s.io/pod.name", "p"),
        ],
    );
    let staging = h.staging("opts");
    node.node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeReaderOnly))
        .await
        .unwrap();
    let opts = h.stager.session_options("/buckets/opts").unwrap();
    assert!(opts.read_only, "reader-only mode stages read-only");
    assert_eq!(opts.quota_bytes, 1 << 30);
    assert_eq!(opts.collection, "c9");
    assert_eq!(opts.filer_path, "/buckets/opts");
    assert_eq!(opts.filers, vec!["f:8888".to_string()]);
    assert!(opts.cache_dir.unwrap().starts_with("/var/cache/test"));
    assert_eq!(
        std::fs::write(staging.join("x"), b"x")
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EROFS),
        "read-only session"
    );
    // Same volume and path, now read-write: incompatible.
    let r = node
        .node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await;
    assert_eq!(code(r), Code::AlreadyExists);
    // The same volume at another staging path while the first is live.
    let r = node
        .node_stage_volume(stage_req(
            &vol,
            &h.staging("elsewhere"),
            Mode::MultiNodeReaderOnly,
        ))
        .await;
    assert_eq!(code(r), Code::FailedPrecondition);

    // Reader-only publish binds read-only even without the readonly flag.
    let t = h.target("ro");
    node.node_publish_volume(publish_req(
        &vol,
        &staging,
        &t,
        false,
        Mode::MultiNodeReaderOnly,
    ))
    .await
    .unwrap();
    assert!(mounts::read_mountinfo()
        .unwrap()
        .iter()
        .any(|m| m.mount_point == t && m.is_read_only()));

    // Expansion goes to the stager as a quota.
    let r = NodeExpandVolumeRequest {
        volume_id: vol.volume_id.clone(),
        volume_path: t.display().to_string(),
        capacity_range: Some(CapacityRange {
            required_bytes: 3 << 30,
            limit_bytes: 0,
        }),
        ..Default::default()
    };
    assert_eq!(
        node.node_expand_volume(r)
            .await
            .unwrap()
            .into_inner()
            .capacity_bytes,
        3 << 30
    );
    assert_eq!(
        h.stager
            .session_options("/buckets/opts")
            .unwrap()
            .quota_bytes,
        3 << 30
    );
    assert!(h
        .stager
        .calls()
        .iter()
        .any(|c| matches!(c, StagerCall::SetQuota { bytes, .. } if *bytes == 3 << 30)));

    // Bad parameters never reach the stager.
    let before = h.stager.stage_count();
    let bad = volume("/buckets/bad", &[("ttl", "forever")]);
    let r = node
        .node_stage_volume(stage_req(&bad, &h.staging("bad"), Mode::SingleNodeWriter))
        .await;
    assert_eq!(code(r), Code::InvalidArgument);
    assert_eq!(h.stager.stage_count(), before);

    node.node_unpublish_volume(unpublish_req(&vol, &t))
        .await
        .unwrap();
    node.node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert!(h.mounts().is_empty());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_is_reported_in_volume_stats() {
    let h = Harness::start().await;
    let mut node = h.clients.node.clone();
    let vol = volume("/buckets/health", &[]);
    let staging = h.staging("health");
    let t = h.target("p");
    node.node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await
        .unwrap();
    node.node_publish_volume(publish_req(
        &vol,
        &staging,
        &t,
        false,
        Mode::SingleNodeWriter,
    ))
    .await
    .unwrap();
    let stats = |node: &mut seaweedfs_csi_driver::pb::csi::node_client::NodeClient<_>| {
        let r = NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: t.display().to_string(),
            ..Default::default()
        };
        let mut node = node.clone();
        async move { node.node_get_volume_stats(r).await.unwrap().into_inner() }
    };
    let s = stats(&mut node).await;
    assert!(!s.volume_condition.as_ref().unwrap().abnormal);
    assert!(s
        .usage
        .iter()
        .any(|u| u.unit == volume_usage::Unit::Bytes as i32 && u.total > 0));

    h.stager
        .set_unhealthy(&vol.volume_id, "filer unreachable for 30s (injected)");
    let s = stats(&mut node).await;
    let c = s.volume_condition.unwrap();
    assert!(c.abnormal);
    assert!(c.message.contains("filer unreachable"));
    assert!(
        !s.usage.is_empty(),
        "usage still reported while the session is unhealthy"
    );
    h.stager.set_healthy(&vol.volume_id);

    let info = node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "n1");
    assert_eq!(info.accessible_topology.unwrap().segments["zone"], "z1");
    let caps = h
        .clients
        .identity
        .clone()
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert_eq!(
        caps.len(),
        3,
        "topology adds VOLUME_ACCESSIBILITY_CONSTRAINTS"
    );

    node.node_unpublish_volume(unpublish_req(&vol, &t))
        .await
        .unwrap();
    node.node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_are_serialised_per_volume_only() {
    let h = Harness::start().await;
    h.stager.set_stage_delay_ms(200);
    let vol_a = volume("/buckets/a", &[]);
    let staging_a = h.staging("a");

    // Ten concurrent stages of one volume: one stage call, no overlap inside the stager.
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let mut node = h.clients.node.clone();
        let r = stage_req(&vol_a, &staging_a, Mode::SingleNodeWriter);
        tasks.push(tokio::spawn(async move {
            node.node_stage_volume(r).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(h.stager.stage_count(), 1);
    assert!(!h.stager.overlap_seen());

    // Eight different volumes staged at once take about one delay, not eight.
    let start = std::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let mut node = h.clients.node.clone();
        let v = volume(&format!("/buckets/v{i}"), &[]);
        let s = h.staging(&format!("v{i}"));
        tasks.push(tokio::spawn(async move {
            node.node_stage_volume(stage_req(&v, &s, Mode::SingleNodeWriter))
                .await
                .map(|_| (v, s))
        }));
    }
    let mut staged = Vec::new();
    for t in tasks {
        staged.push(t.await.unwrap().unwrap());
    }
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(1200),
        "different volumes waited for each other: {took:?}"
    );
    assert_eq!(h.stager.stage_count(), 9);

    let mut node = h.clients.node.clone();
    for (v, s) in &staged {
        node.node_unstage_volume(unstage_req(v, s)).await.unwrap();
    }
    node.node_unstage_volume(unstage_req(&vol_a, &staging_a))
        .await
        .unwrap();
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_session_is_restaged_and_dead_binds_rebound() {
    let h = Harness::start().await;
    let mut node = h.clients.node.clone();
    let vol = volume("/buckets/dead", &[]);
    let staging = h.staging("dead");
    let t1 = h.target("one");
    node.node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await
        .unwrap();
    node.node_publish_volume(publish_req(
        &vol,
        &staging,
        &t1,
        false,
        Mode::SingleNodeWriter,
    ))
    .await
    .unwrap();
    std::fs::write(t1.join("keep"), b"k").unwrap();

    // The session dies: the staging mount and the pod's bind both answer ENOTCONN.
    mounts::unmount_all(&t1).unwrap();
    mounts::unmount_all(&staging).unwrap();
    mounts::mount_dead_fuse(&staging).unwrap();
    mounts::mount_dead_fuse(&t1).unwrap();
    assert!(matches!(
        mounts::mount_state(&t1).unwrap(),
        MountState::Dead(_)
    ));

    // The next publish (another pod) re-stages and re-binds the known dead publication too.
    let t2 = h.target("two");
    node.node_publish_volume(publish_req(
        &vol,
        &staging,
        &t2,
        false,
        Mode::SingleNodeWriter,
    ))
    .await
    .unwrap();
    assert_eq!(h.stager.stage_count(), 2);
    assert_eq!(mounts::mount_state(&staging).unwrap(), MountState::Healthy);
    assert_eq!(
        mounts::mount_state(&t1).unwrap(),
        MountState::Healthy,
        "dead bind re-bound"
    );
    assert_eq!(std::fs::read(t1.join("keep")).unwrap(), b"k");
    assert_eq!(std::fs::read(t2.join("keep")).unwrap(), b"k");

    for t in [&t1, &t2] {
        node.node_unpublish_volume(unpublish_req(&vol, t))
            .await
            .unwrap();
    }
    node.node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    h.shutdown().await;
}

/// The same volume at a second staging path: the stager runs one session per volume, so a
/// repair there never ends the live session at the first one (refused, as NodeStage is), nor
/// takes over the first one's pods when it is dead (refused while it has any); the first
/// path's own publish repairs it, and once it is unstaged the second path works.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_staging_path_never_ends_the_volumes_session_at_the_first() {
    let h = Harness::start().await;
    let mut node = h.clients.node.clone();
    let vol = volume("/buckets/moved", &[]);
    let (staging_a, staging_b) = (h.staging("moved-a"), h.staging("moved-b"));
    let (t1, t2) = (h.target("moved-one"), h.target("moved-two"));
    let mode = Mode::MultiNodeMultiWriter;
    node.node_stage_volume(stage_req(&vol, &staging_a, mode))
        .await
        .unwrap();
    node.node_publish_volume(publish_req(&vol, &staging_a, &t1, false, mode))
        .await
        .unwrap();
    std::fs::write(t1.join("keep"), b"k").unwrap();

    // a is alive; a dead mount from elsewhere is at b.
    mounts::mount_dead_fuse(&staging_b).unwrap();
    let err = node
        .node_publish_volume(publish_req(&vol, &staging_b, &t2, false, mode))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(mounts::mount_state(&t1).unwrap(), MountState::Healthy);
    assert_eq!(
        mounts::mount_state(&staging_a).unwrap(),
        MountState::Healthy
    );
    assert!(
        !h.stager
            .calls()
            .iter()
            .any(|c| matches!(c, StagerCall::Unstage { .. })),
        "a's session was not ended"
    );

    // a's session and bind die: b is still refused while a has a pod (that pod is the
    // other PV's: its options may differ, and its NodeUnstage of b would end it).
    for p in [&t1, &staging_a] {
        mounts::unmount_all(p).unwrap();
        mounts::mount_dead_fuse(p).unwrap();
    }
    let err = node
        .node_publish_volume(publish_req(&vol, &staging_b, &t2, false, mode))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(matches!(
        mounts::mount_state(&t1).unwrap(),
        MountState::Dead(_)
    ));
    // a's own publish repairs a, with its pod
    node.node_publish_volume(publish_req(&vol, &staging_a, &t1, false, mode))
        .await
        .unwrap();
    assert_eq!(std::fs::read(t1.join("keep")).unwrap(), b"k");

    // once a's pod is gone and a is unstaged, b stages and publishes
    node.node_unpublish_volume(unpublish_req(&vol, &t1))
        .await
        .unwrap();
    node.node_unstage_volume(unstage_req(&vol, &staging_a))
        .await
        .unwrap();
    node.node_publish_volume(publish_req(&vol, &staging_b, &t2, false, mode))
        .await
        .unwrap();
    for p in [&staging_b, &t2] {
        assert_eq!(
            mounts::mount_state(p).unwrap(),
            MountState::Healthy,
            "{p:?}"
        );
    }
    assert_eq!(std::fs::read(t2.join("keep")).unwrap(), b"k");

    node.node_unpublish_volume(unpublish_req(&vol, &t2))
        .await
        .unwrap();
    node.node_unstage_volume(unstage_req(&vol, &staging_b))
        .await
        .unwrap();
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    h.shutdown().await;
}

/// A node plugin generation of [`a_repair_after_a_restart_uses_the_recorded_data_center`]:
/// `--dataLocality=write_preferLocalDc --dataCenterLabel=zone`, the state file in `state`,
/// this node's labels from `labels`.
fn labelled_node(
    stager: Arc<FakeStager>,
    state: &Path,
    labels: Arc<StaticNodeLabels>,
) -> NodeService {
    labelled_node_with_filer(stager, state, labels, "f:8888")
}

/// [`labelled_node`] with `--filer=filer` (an upgrade may change it).
fn labelled_node_with_filer(
    stager: Arc<FakeStager>,
    state: &Path,
    labels: Arc<StaticNodeLabels>,
    filer: &str,
) -> NodeService {
    node_generation(
        stager,
        state,
        Flags {
            filer,
            label: true,
            locality: DataLocality::WritePreferLocalDc,
            ..Flags::default()
        },
    )
    .with_node_labels(labels)
}

/// The node plugin flags the generations below differ in.
struct Flags<'a> {
    filer: &'a str,
    cache_root: Option<&'a str>,
    /// `--dataCenterLabel=zone`.
    label: bool,
    locality: DataLocality,
}

impl Default for Flags<'_> {
    fn default() -> Self {
        Flags {
            filer: "f:8888",
            cache_root: None,
            label: false,
            locality: DataLocality::None,
        }
    }
}

/// A node plugin generation with `flags`, its state file in `state`.
fn node_generation(stager: Arc<FakeStager>, state: &Path, flags: Flags) -> NodeService {
    let config = NodeConfig {
        node_id: "n1".into(),
        max_volumes_per_node: 0,
        topology: TopologySpec {
            data_center_label: flags.label.then(|| "zone".into()),
            ..Default::default()
        },
        defaults: VolumeDefaults {
            base: seaweedfs_csi_driver::config::MountOptions {
                filers: vec![flags.filer.into()],
                ..Default::default()
            },
            data_locality: flags.locality,
            cache_root: flags.cache_root.map(PathBuf::from),
            ..Default::default()
        },
    };
    NodeService::new(stager, config).with_state_dir(Some(state))
}

/// A directory for one test's node generations (state file, staging paths, pods), whose
/// mounts go when it does.
struct Site {
    _cleanup: Unmounter,
    dir: tempfile::TempDir,
}

impl Site {
    fn new(prefix: &str) -> Site {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
        Site {
            _cleanup: scopeguard(dir.path().to_path_buf()),
            dir,
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// A new process's stager (no sessions); the volumes' data stays in one scratch root.
    fn stager(&self) -> Arc<FakeStager> {
        Arc::new(FakeStager::new(self.dir.path().join("scratch")).unwrap())
    }

    fn staging(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(format!("staging/{name}"));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    fn target(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(format!("pods/{name}/mount"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        p
    }

    fn state_file(&self) -> String {
        std::fs::read_to_string(self.state().join("volumes.json")).unwrap()
    }

    fn mounts(&self) -> Vec<PathBuf> {
        mounts_below(self.dir.path())
    }
}

/// The FUSE sessions die (no keeper): each path's mount answers ENOTCONN.
fn kill(paths: &[&Path]) {
    for p in paths {
        mounts::unmount_all(p).unwrap();
        mounts::mount_dead_fuse(p).unwrap();
    }
}

fn healthy(p: &Path) -> bool {
    mounts::mount_state(p).unwrap() == MountState::Healthy
}

/// A NodePublish that finds the staging mount dead re-stages it. After a plugin restart
/// (nothing in memory) it uses the options recorded at NodeStage: neither the Kubernetes API
/// (down here, read under the volume's lock) nor a label changed since decide the data center.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repair_after_a_restart_uses_the_recorded_data_center() {
    let dir = tempfile::Builder::new()
        .prefix("csirepair")
        .tempdir()
        .unwrap();
    let _cleanup = scopeguard(dir.path().to_path_buf());
    let stager = Arc::new(FakeStager::new(dir.path().join("scratch")).unwrap());
    let state = dir.path().join("state");
    let staging = dir.path().join("staging/v");
    std::fs::create_dir_all(&staging).unwrap();
    let target = |n: &str| {
        let p = dir.path().join(format!("pods/{n}/mount"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        p
    };
    let vol = volume("/buckets/v", &[]);
    let mode = Mode::MultiNodeMultiWriter;

    let first = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-a")]));
    let gen1 = labelled_node(stager.clone(), &state, first.clone());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    assert_eq!(
        stager.session_options("/buckets/v").unwrap().data_center,
        "z-a"
    );
    drop(gen1);

    // A new generation (nothing in memory); its session dies; the API is down and the label
    // has changed meanwhile.
    mounts::unmount_all(&staging).unwrap();
    mounts::mount_dead_fuse(&staging).unwrap();
    let second = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-b")]));
    second.fail();
    let gen2 = labelled_node_with_filer(stager.clone(), &state, second.clone(), "g:8888");
    gen2.node_publish_volume(Request::new(publish_req(
        &vol,
        &staging,
        &target("p"),
        false,
        mode,
    )))
    .await
    .expect("repaired with the recorded options");
    assert_eq!(mounts::mount_state(&staging).unwrap(), MountState::Healthy);
    assert_eq!(
        stager.session_options("/buckets/v").unwrap().data_center,
        "z-a",
        "the repaired session writes where the recorded one did"
    );
    assert_eq!(
        stager.session_options("/buckets/v").unwrap().filers,
        vec!["g:8888".to_string()],
        "the rest is resolved again with this generation's flags"
    );
    assert_eq!(second.calls(), 0, "the API was not asked");

    gen2.node_unpublish_volume(Request::new(unpublish_req(&vol, &target("p"))))
        .await
        .unwrap();
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(mounts_below(dir.path()).is_empty());
}

/// A dead staging mount that kubelet stages again (NodeStage) after a plugin upgrade, and
/// one that the upgraded plugin's startup repair finds: both keep the recorded data center
/// (the API is down and the label changed) and take the new plugin's flags (another filer).
/// A healthy staged volume asked for again with another read-only mode is refused, also when
/// only the state file knows its mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_stage_after_an_upgrade_keeps_its_data_center_and_takes_the_new_flags() {
    let dir = tempfile::Builder::new()
        .prefix("csiupgrade")
        .tempdir()
        .unwrap();
    let _cleanup = scopeguard(dir.path().to_path_buf());
    let stager = Arc::new(FakeStager::new(dir.path().join("scratch")).unwrap());
    let state = dir.path().join("state");
    let mode = Mode::MultiNodeMultiWriter;
    let staging = |n: &str| {
        let p = dir.path().join(format!("staging/{n}"));
        std::fs::create_dir_all(&p).unwrap();
        p
    };
    let (va, sa) = (volume("/buckets/a", &[]), staging("a"));
    let (vb, sb) = (volume("/buckets/b", &[]), staging("b"));

    let first = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-a")]));
    let gen1 = labelled_node(stager.clone(), &state, first.clone());
    for (v, s) in [(&va, &sa), (&vb, &sb)] {
        gen1.node_stage_volume(Request::new(stage_req(v, s, mode)))
            .await
            .unwrap();
    }
    drop(gen1);

    // The upgraded plugin (nothing in memory, API down, label changed, another filer) finds
    // a's session dead and b's healthy.
    mounts::unmount_all(&sa).unwrap();
    mounts::mount_dead_fuse(&sa).unwrap();
    let second = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-b")]));
    second.fail();
    let gen2 = labelled_node_with_filer(stager.clone(), &state, second.clone(), "g:8888");
    gen2.node_stage_volume(Request::new(stage_req(&va, &sa, mode)))
        .await
        .expect("a dead stage is staged again without the API");
    assert_eq!(mounts::mount_state(&sa).unwrap(), MountState::Healthy);
    let o = stager.session_options("/buckets/a").unwrap();
    assert_eq!(o.data_center, "z-a", "recorded data center kept");
    assert_eq!(o.filers, vec!["g:8888".to_string()], "new flags applied");

    // b is healthy and read-write: a read-only request for it is refused, though only the
    // state file knows how it was staged.
    let err = gen2
        .node_stage_volume(Request::new(stage_req(&vb, &sb, Mode::MultiNodeReaderOnly)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert_eq!(mounts::mount_state(&sb).unwrap(), MountState::Healthy);
    drop(gen2);

    // Another upgrade; b's session died meanwhile; the startup repair restarts it.
    mounts::unmount_all(&sb).unwrap();
    mounts::mount_dead_fuse(&sb).unwrap();
    // A new process: a stager with no sessions.
    let stager = Arc::new(FakeStager::new(dir.path().join("scratch3")).unwrap());
    let gen3 = labelled_node_with_filer(stager.clone(), &state, second.clone(), "h:8888");
    let repair = gen3.spawn_recovery().expect("recorded volumes");
    tokio::time::timeout(Duration::from_secs(60), repair)
        .await
        .expect("repair finished")
        .unwrap();
    assert_eq!(mounts::mount_state(&sb).unwrap(), MountState::Healthy);
    let o = stager.session_options("/buckets/b").unwrap();
    assert_eq!(o.data_center, "z-a", "recorded data center kept");
    assert_eq!(o.filers, vec!["h:8888".to_string()], "new flags applied");
    assert_eq!(second.calls(), 0, "the API was never asked");

    for (v, s) in [(&va, &sa), (&vb, &sb)] {
        gen3.node_unstage_volume(Request::new(unstage_req(v, s)))
            .await
            .unwrap();
    }
    assert!(mounts_below(dir.path()).is_empty());
}

/// After a restart without the sessions (no keeper), the NodePublish of a new pod that finds
/// the staging mount dead stages the volume again and binds it again over every recorded
/// publication, not only those this process knows (none); so does NodeStage.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repair_after_a_restart_binds_every_recorded_publication_again() {
    let site = Site::new("csirebind");
    let vol = volume("/buckets/rebind", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("rebind");
    let (t1, t2, t3) = (site.target("one"), site.target("two"), site.target("three"));
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    for t in [&t1, &t2] {
        gen1.node_publish_volume(Request::new(publish_req(&vol, &staging, t, false, mode)))
            .await
            .unwrap();
    }
    std::fs::write(t1.join("keep"), b"k").unwrap();
    drop((gen1, stager));
    kill(&[&staging, &t1, &t2]);

    // The next generation; kubelet publishes a third pod before any startup repair.
    let stager = site.stager();
    let gen2 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen2.node_publish_volume(Request::new(publish_req(&vol, &staging, &t3, false, mode)))
        .await
        .unwrap();
    for p in [&staging, &t1, &t2, &t3] {
        assert!(healthy(p), "{p:?} is not bound again");
    }
    assert_eq!(std::fs::read(t2.join("keep")).unwrap(), b"k");
    drop((gen2, stager));

    // Again, and this time kubelet's NodeStage finds the dead mount.
    kill(&[&staging, &t1, &t2, &t3]);
    let stager = site.stager();
    let gen3 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen3.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    for p in [&staging, &t1, &t2, &t3] {
        assert!(healthy(p), "{p:?} is not bound again");
    }

    for t in [&t1, &t2, &t3] {
        gen3.node_unpublish_volume(Request::new(unpublish_req(&vol, t)))
            .await
            .unwrap();
    }
    gen3.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// After a restart only the state file knows where a volume is staged: a NodeStage or a
/// NodePublish repair at a second staging path is refused while the volume's session at the
/// first is alive, and leaves it (and its pod) alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_restart_a_second_staging_path_leaves_the_live_session_alone() {
    let site = Site::new("csisecond");
    let vol = volume("/buckets/second", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let (a, b, c) = (site.staging("a"), site.staging("b"), site.staging("c"));
    let (t1, t2) = (site.target("one"), site.target("two"));
    // The session outlives the generation that staged it (an adopted one, say).
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &a, mode)))
        .await
        .unwrap();
    gen1.node_publish_volume(Request::new(publish_req(&vol, &a, &t1, false, mode)))
        .await
        .unwrap();
    drop(gen1);

    let gen2 = node_generation(stager.clone(), &site.state(), Flags::default());
    mounts::mount_dead_fuse(&b).unwrap();
    let err = gen2
        .node_publish_volume(Request::new(publish_req(&vol, &b, &t2, false, mode)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let err = gen2
        .node_stage_volume(Request::new(stage_req(&vol, &c, mode)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(healthy(&a) && healthy(&t1), "the live session was ended");
    assert_eq!(stager.stage_count(), 1);
    assert!(!stager
        .calls()
        .iter()
        .any(|c| matches!(c, StagerCall::Unstage { .. })));

    gen2.node_unpublish_volume(Request::new(unpublish_req(&vol, &t1)))
        .await
        .unwrap();
    for s in [&a, &b, &c] {
        gen2.node_unstage_volume(Request::new(unstage_req(&vol, s)))
            .await
            .unwrap();
    }
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// The state file lost the volume's record (or an older build wrote none) and this process
/// has no memory of it, but the stager serves it at a: a NodeStage at another path, a
/// NodePublish repair at a dead one and a NodeUnstage of a stale one all leave that session
/// (and its pod) alone; the stager is asked where its session is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_only_the_stager_knows_is_left_alone_by_other_staging_paths() {
    let site = Site::new("csiunknown");
    let vol = volume("/buckets/unknown", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let (a, b, c) = (site.staging("a"), site.staging("b"), site.staging("c"));
    let (t1, t2) = (site.target("one"), site.target("two"));
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &a, mode)))
        .await
        .unwrap();
    gen1.node_publish_volume(Request::new(publish_req(&vol, &a, &t1, false, mode)))
        .await
        .unwrap();
    drop(gen1);
    std::fs::remove_file(site.state().join("volumes.json")).unwrap();

    let gen2 = node_generation(stager.clone(), &site.state(), Flags::default());
    let err = gen2
        .node_stage_volume(Request::new(stage_req(&vol, &c, mode)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    mounts::mount_dead_fuse(&b).unwrap();
    let err = gen2
        .node_publish_volume(Request::new(publish_req(&vol, &b, &t2, false, mode)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &b)))
        .await
        .unwrap();
    assert!(!mounts::is_mount_point(&b).unwrap());
    assert!(healthy(&a) && healthy(&t1), "the live session was ended");
    assert_eq!(stager.staging_path(&vol.volume_id), Some(a.clone()));
    assert_eq!(stager.stage_count(), 1);
    assert!(!stager
        .calls()
        .iter()
        .any(|c| matches!(c, StagerCall::Unstage { .. })));

    gen2.node_unpublish_volume(Request::new(unpublish_req(&vol, &t1)))
        .await
        .unwrap();
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &a)))
        .await
        .unwrap();
    assert_eq!(stager.health(&vol.volume_id), None, "the session ended");
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// The records say b, but the stager's session runs at a (started where nothing recorded
/// it): NodeUnstage of a ends that session instead of unmounting it under the stager, which
/// would keep serving nothing; b's records stay until b is unstaged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unstaging_the_stagers_session_path_ends_it_whatever_the_records_say() {
    let site = Site::new("csistale");
    let vol = volume("/buckets/stale", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let (a, b) = (site.staging("a"), site.staging("b"));
    let stager = site.stager();
    let node = node_generation(stager.clone(), &site.state(), Flags::default());
    node.node_stage_volume(Request::new(stage_req(&vol, &b, mode)))
        .await
        .unwrap();
    stager
        .stage(
            &vol.volume_id,
            seaweedfs_csi_driver::config::MountOptions::default(),
            &a,
        )
        .await
        .unwrap();
    assert!(site.state_file().contains(&*b.to_string_lossy()));

    node.node_unstage_volume(Request::new(unstage_req(&vol, &a)))
        .await
        .unwrap();
    assert_eq!(stager.health(&vol.volume_id), None, "the session ended");
    assert!(stager.calls().iter().any(|c| matches!(c,
        StagerCall::Unstage { staging_path, .. } if *staging_path == a)));
    assert!(!mounts::is_mount_point(&a).unwrap());
    assert!(site.state_file().contains(&*b.to_string_lossy()));

    node.node_unstage_volume(Request::new(unstage_req(&vol, &b)))
        .await
        .unwrap();
    assert!(!site.state_file().contains(&*vol.volume_id));
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// A rollback: the state file is a newer version's, which this one cannot read. The plugin
/// serves its RPCs all the same and leaves the file as it was, for the version that reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_newer_versions_state_file_survives_an_older_plugin() {
    let site = Site::new("csirollback");
    let vol = volume("/buckets/rollback", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let (a, t1) = (site.staging("a"), site.target("one"));
    std::fs::create_dir_all(site.state()).unwrap();
    let newer = br#"{"format": 2, "volumes": {"/buckets/kept": {"sessions": ["/x"]}}}"#;
    let file = site.state().join("volumes.json");
    std::fs::write(&file, newer).unwrap();

    let node = node_generation(site.stager(), &site.state(), Flags::default());
    assert!(node.spawn_recovery().is_none());
    node.node_stage_volume(Request::new(stage_req(&vol, &a, mode)))
        .await
        .unwrap();
    node.node_publish_volume(Request::new(publish_req(&vol, &a, &t1, false, mode)))
        .await
        .unwrap();
    assert!(healthy(&a) && healthy(&t1));
    node.node_unpublish_volume(Request::new(unpublish_req(&vol, &t1)))
        .await
        .unwrap();
    node.node_unstage_volume(Request::new(unstage_req(&vol, &a)))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(&file).unwrap(),
        newer,
        "the file was rewritten"
    );
    let names: Vec<_> = std::fs::read_dir(site.state())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "the file and its lock only: {names:?}");
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// A static PV's size is its volume context's, which NodeExpandVolume outgrows: a session
/// started again keeps the expanded quota, after a restart (the state file has it) and by the
/// same process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expanded_quota_survives_a_restart_and_a_repair() {
    const MI: u64 = 1 << 20;
    let site = Site::new("csiquota");
    let vol = volume(
        "static-quota",
        &[("volumeCapacity", "1048576"), ("path", "/data/static")],
    );
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("q");
    let (t1, t2, t3) = (site.target("one"), site.target("two"), site.target("three"));
    let expand = |target: &Path, bytes: u64| {
        Request::new(NodeExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: target.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: bytes as i64,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
    };
    let quota = |stager: &FakeStager| stager.session_options("static-quota").unwrap().quota_bytes;
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    gen1.node_publish_volume(Request::new(publish_req(&vol, &staging, &t1, false, mode)))
        .await
        .unwrap();
    assert_eq!(quota(&stager), MI);
    gen1.node_expand_volume(expand(&t1, 10 * MI)).await.unwrap();
    assert_eq!(quota(&stager), 10 * MI);
    drop((gen1, stager));

    kill(&[&staging, &t1]);
    let stager = site.stager();
    let gen2 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen2.node_publish_volume(Request::new(publish_req(&vol, &staging, &t2, false, mode)))
        .await
        .unwrap();
    assert_eq!(quota(&stager), 10 * MI, "after a restart");

    gen2.node_expand_volume(expand(&t2, 20 * MI)).await.unwrap();
    kill(&[&staging, &t1, &t2]);
    gen2.node_publish_volume(Request::new(publish_req(&vol, &staging, &t3, false, mode)))
        .await
        .unwrap();
    assert_eq!(quota(&stager), 20 * MI, "repaired by the same process");

    for t in [&t1, &t2, &t3] {
        gen2.node_unpublish_volume(Request::new(unpublish_req(&vol, t)))
            .await
            .unwrap();
    }
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// A record written before the state file kept requests: the startup repair of the upgraded
/// plugin starts the session with its `--cacheDir`, the rest (filer too) as recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_old_record_keeps_its_filer_and_takes_the_new_cache_root() {
    let site = Site::new("csilegacy");
    let vol = volume("/buckets/legacy", &[("collection", "c7")]);
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("legacy");
    let old = Flags {
        cache_root: Some("/var/cache/old"),
        ..Flags::default()
    };
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), old);
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    drop((gen1, stager));
    // What an older version wrote: no request.
    let file = site.state().join("volumes.json");
    let mut st: serde_json::Value = serde_json::from_str(&site.state_file()).unwrap();
    st["volumes"]["/buckets/legacy"]
        .as_object_mut()
        .unwrap()
        .remove("request")
        .expect("recorded with its request");
    st["volumes"]["/buckets/legacy"]["opts"]
        .as_object_mut()
        .unwrap()
        .remove("volume_id")
        .expect("recorded with the volume's id");
    std::fs::write(&file, st.to_string()).unwrap();
    kill(&[&staging]);

    let stager = site.stager();
    let new = Flags {
        filer: "g:8888",
        cache_root: Some("/var/cache/new"),
        ..Flags::default()
    };
    let gen2 = node_generation(stager.clone(), &site.state(), new);
    let repair = gen2.spawn_recovery().expect("recorded volumes");
    tokio::time::timeout(Duration::from_secs(60), repair)
        .await
        .expect("repair finished")
        .unwrap();
    assert!(healthy(&staging));
    let o = stager.session_options("/buckets/legacy").unwrap();
    // the recorded filer may be the volume's own: never swapped for this plugin's --filer
    assert_eq!(o.filers, vec!["f:8888".to_string()], "the recorded filer");
    assert!(
        o.cache_dir.as_ref().unwrap().starts_with("/var/cache/new"),
        "new --cacheDir: {:?}",
        o.cache_dir
    );
    assert_eq!(
        (o.collection.as_str(), o.filer_path.as_str()),
        ("c7", "/buckets/legacy")
    );
    // NodeExpandVolume's capacity record is named after it
    assert_eq!(o.volume_id, "/buckets/legacy", "the volume's id");
    let st: serde_json::Value = serde_json::from_str(&site.state_file()).unwrap();
    let rec = &st["volumes"]["/buckets/legacy"];
    assert_eq!(rec["opts"]["filers"][0], "f:8888", "what runs is recorded");
    assert!(rec.get("request").is_none(), "no request made up");

    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// After a restart whose records are lost, a session still being adopted has no known path;
/// a NodeUnstageVolume of an old staging path meanwhile must wait to learn where the session
/// runs, and leave it (it ended the session at its current path, pods and all).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unstage_of_an_old_path_waits_for_an_adoption_and_leaves_the_session() {
    let site = Site::new("csiadopting");
    let vol = volume("/buckets/adopting", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let (old, current) = (site.staging("old"), site.staging("current"));
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &current, mode)))
        .await
        .unwrap();
    drop(gen1);
    std::fs::remove_file(site.state().join("volumes.json")).unwrap();
    stager.begin_adoption("/buckets/adopting");
    let gen2 = node_generation(stager.clone(), &site.state(), Flags::default());
    let adopter = stager.clone();
    let finish = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        adopter.finish_adoption("/buckets/adopting");
    });
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &old)))
        .await
        .unwrap();
    finish.await.unwrap();
    assert!(
        healthy(&current),
        "the session at its current path was ended"
    );
    assert_eq!(
        stager.staging_path("/buckets/adopting"),
        Some(current.clone())
    );
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &current)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// A rollback: options a newer version recorded for a volume stay in its record when this
/// version starts the session again from the recorded request (a repair), so the newer
/// version finds them when it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repair_keeps_the_options_a_newer_version_recorded() {
    let site = Site::new("csinewopt");
    let vol = volume("/buckets/newopt", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("newopt");
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    drop((gen1, stager));
    let file = site.state().join("volumes.json");
    let mut st: serde_json::Value = serde_json::from_str(&site.state_file()).unwrap();
    st["volumes"]["/buckets/newopt"]["opts"]["option_of_a_newer_version"] =
        serde_json::json!({"x": 42});
    std::fs::write(&file, st.to_string()).unwrap();
    kill(&[&staging]);

    let stager = site.stager();
    let gen2 = node_generation(stager.clone(), &site.state(), Flags::default());
    let repair = gen2.spawn_recovery().expect("recorded volumes");
    tokio::time::timeout(Duration::from_secs(60), repair)
        .await
        .expect("repair finished")
        .unwrap();
    assert!(healthy(&staging));
    let st: serde_json::Value = serde_json::from_str(&site.state_file()).unwrap();
    assert_eq!(
        st["volumes"]["/buckets/newopt"]["opts"]["option_of_a_newer_version"],
        serde_json::json!({"x": 42}),
        "{st}"
    );
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// A recorded session without a data center, started again by a plugin that now takes it
/// from this node's label: the startup repair asks the API for it rather than reusing the
/// recorded options whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_startup_repair_reads_a_data_center_its_record_lacks() {
    let site = Site::new("csinodc");
    let vol = volume("/buckets/nodc", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("nodc");
    let stager = site.stager();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    assert_eq!(
        stager.session_options("/buckets/nodc").unwrap().data_center,
        ""
    );
    drop((gen1, stager));
    kill(&[&staging]);

    let labels = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-b")]));
    let stager = site.stager();
    let gen2 = labelled_node_with_filer(stager.clone(), &site.state(), labels.clone(), "g:8888");
    let repair = gen2.spawn_recovery().expect("recorded volumes");
    tokio::time::timeout(Duration::from_secs(60), repair)
        .await
        .expect("repair finished")
        .unwrap();
    let o = stager.session_options("/buckets/nodc").unwrap();
    assert_eq!(o.data_center, "z-b");
    assert_eq!(o.filers, vec!["g:8888".to_string()]);
    assert_eq!(labels.calls(), 1);

    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// `--dataCenterLabel` removed by an upgrade: the recorded request no longer resolves
/// (write_preferLocalDc without a data center). Like the startup repair, NodePublish's repair
/// and NodeStage (live or dead mount) keep the session's recorded options instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_the_new_flags_no_longer_resolve_keeps_its_recorded_options() {
    let site = Site::new("csinolabel");
    let vol = volume("/buckets/nolabel", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("nolabel");
    let (t1, t2) = (site.target("one"), site.target("two"));
    let labels = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-a")]));
    let stager = site.stager();
    let gen1 = labelled_node(stager.clone(), &site.state(), labels);
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    gen1.node_publish_volume(Request::new(publish_req(&vol, &staging, &t1, false, mode)))
        .await
        .unwrap();
    drop((gen1, stager));
    kill(&[&staging, &t1]);

    let no_label = || Flags {
        locality: DataLocality::WritePreferLocalDc,
        ..Flags::default()
    };
    let stager = site.stager();
    let gen2 = node_generation(stager.clone(), &site.state(), no_label());
    gen2.node_publish_volume(Request::new(publish_req(&vol, &staging, &t2, false, mode)))
        .await
        .expect("repaired with the recorded options");
    assert!(healthy(&staging) && healthy(&t1) && healthy(&t2));
    assert_eq!(
        stager
            .session_options("/buckets/nolabel")
            .unwrap()
            .data_center,
        "z-a"
    );
    gen2.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .expect("a live session keeps its options");
    drop((gen2, stager));

    kill(&[&staging, &t1, &t2]);
    let stager = site.stager();
    let gen3 = node_generation(stager.clone(), &site.state(), no_label());
    gen3.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .expect("staged again with the recorded options");
    assert!(healthy(&staging) && healthy(&t1) && healthy(&t2));
    assert_eq!(
        stager
            .session_options("/buckets/nolabel")
            .unwrap()
            .data_center,
        "z-a"
    );
    // A volume this node never staged is still refused.
    let err = gen3
        .node_stage_volume(Request::new(stage_req(
            &volume("/buckets/new", &[]),
            &site.staging("new"),
            mode,
        )))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    for t in [&t1, &t2] {
        gen3.node_unpublish_volume(Request::new(unpublish_req(&vol, t)))
            .await
            .unwrap();
    }
    gen3.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// kubelet's pod info in NodePublish's volume context (service account tokens among it) is
/// not written to the state file, whether the request is recorded by a repair or because the
/// volume was not recorded yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_state_file_keeps_no_pod_info() {
    let site = Site::new("csipodinfo");
    let token = "eyJhbGciOi-bearer-token";
    let vol = volume(
        "/buckets/podinfo",
        &[
            ("collection", "c5"),
            ("csi.storage.k8s.io/pod.name", "web-0"),
            (
                "csi.storage.k8s.io/serviceAccount.tokens",
                &format!(r#"{{"api":{{"token":"{token}"}}}}"#),
            ),
        ],
    );
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("podinfo");
    let (t1, t2) = (site.target("one"), site.target("two"));
    // Staged by a plugin that recorded elsewhere (an older version): the first publish
    // records the volume from its request.
    let stager = site.stager();
    let gen0 = node_generation(
        stager.clone(),
        &site.dir.path().join("other"),
        Flags::default(),
    );
    gen0.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    let gen1 = node_generation(stager.clone(), &site.state(), Flags::default());
    gen1.node_publish_volume(Request::new(publish_req(&vol, &staging, &t1, false, mode)))
        .await
        .unwrap();
    let st = site.state_file();
    assert!(st.contains("c5"), "{st}");
    assert!(
        !st.contains(token) && !st.contains("serviceAccount") && !st.contains("web-0"),
        "{st}"
    );

    // A repair records the request again.
    kill(&[&staging, &t1]);
    gen1.node_publish_volume(Request::new(publish_req(&vol, &staging, &t2, false, mode)))
        .await
        .unwrap();
    assert_eq!(stager.stage_count(), 2);
    let st = site.state_file();
    assert!(st.contains("c5"), "{st}");
    assert!(
        !st.contains(token) && !st.contains("serviceAccount") && !st.contains("web-0"),
        "{st}"
    );

    for t in [&t1, &t2] {
        gen1.node_unpublish_volume(Request::new(unpublish_req(&vol, t)))
            .await
            .unwrap();
    }
    gen1.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// NodeStage over a dead mount of a volume this node has no record of, whose data center
/// must come from the API, which is down: UNAVAILABLE (kubelet retries), and nothing is torn
/// down first (the options are resolved before): the dead mount stays, the stager is not
/// asked to end its session.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_stage_whose_data_center_cannot_be_read_is_left_as_it_was() {
    let site = Site::new("csinoapi");
    let vol = volume("/buckets/noapi", &[]);
    let mode = Mode::MultiNodeMultiWriter;
    let staging = site.staging("noapi");
    let stager = site.stager();
    let up = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-a")]));
    let gen1 = labelled_node(stager.clone(), &site.dir.path().join("state1"), up);
    gen1.node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap();
    drop(gen1);

    // Another generation with no record of it (the stager still holds the session).
    let down = Arc::new(StaticNodeLabels::new("n1", [("zone", "z-a")]));
    down.fail();
    let gen2 = labelled_node(stager.clone(), &site.state(), down.clone());
    kill(&[&staging]);
    let before = stager.calls().len();
    let err = gen2
        .node_stage_volume(Request::new(stage_req(&vol, &staging, mode)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(down.calls(), 1);
    assert!(matches!(
        mounts::mount_state(&staging).unwrap(),
        MountState::Dead(_)
    ));
    let after: Vec<_> = stager.calls()[before..].to_vec();
    assert!(after.is_empty(), "the stager was called: {after:?}");

    down.recover();
    gen2.node_unstage_volume(Request::new(unstage_req(&vol, &staging)))
        .await
        .unwrap();
    assert!(site.mounts().is_empty(), "{:?}", site.mounts());
}

/// Unmounts everything below the path on drop (a failed assertion leaves no mounts behind).
struct Unmounter(PathBuf);

fn scopeguard(p: PathBuf) -> Unmounter {
    Unmounter(p)
}

impl Drop for Unmounter {
    fn drop(&mut self) {
        unmount_below(&self.0);
    }
}
