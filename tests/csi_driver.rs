//! The driver binary on a unix socket, driven like kubelet and the sidecars drive it, against a
//! real SeaweedFS, with real mounts. `CSI_TEST_STAGER=fuse` runs it with the FUSE stager.

#[allow(unused_imports)]
mod common;
mod csi_common;

use std::path::PathBuf;
use std::sync::Arc;

use csi_common::*;
use seaweedfs_csi_driver::csi::mounts::{self, MountState};
use seaweedfs_csi_driver::pb::csi::volume_capability::access_mode::Mode;
use seaweedfs_csi_driver::pb::csi::*;
use tonic::Code;

fn assert_no_mounts_below(d: &Driver, what: &str) {
    let m = d.mounts();
    assert!(m.is_empty(), "{what}: stray mounts {m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_lifecycle_like_kubelet() {
    let weed = common::WeedServer::start();
    let driver = Driver::start(&weed.filer_addr(), &[]);
    let mut c = driver.clients().await;

    // Identity.
    let info = c
        .identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "seaweedfs-csi-driver");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    let probe = c
        .identity
        .probe(ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready, Some(true));

    // CreateVolume: a bucket directory on the real filer; repeated = same volume.
    let req = create_req("PVC-Lifecycle-1", 1 << 30, &[("replication", "000")]);
    let vol = c
        .controller
        .create_volume(req.clone())
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(vol.volume_id, "/buckets/pvc-lifecycle-1");
    assert_eq!(vol.capacity_bytes, 1 << 30);
    assert!(
        filer_has(&weed.filer_addr(), "/buckets/pvc-lifecycle-1"),
        "volume dir on the filer"
    );
    let again = c
        .controller
        .create_volume(req)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, vol.volume_id);
    assert_eq!(again.volume_context, vol.volume_context);

    // ValidateVolumeCapabilities confirms every supported mode.
    let caps: Vec<VolumeCapability> = seaweedfs_csi_driver::csi::SUPPORTED_ACCESS_MODES
        .iter()
        .map(|m| mount_cap(*m))
        .collect();
    let v = c
        .controller
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: vol.volume_id.clone(),
            volume_capabilities: caps,
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(v.confirmed.unwrap().volume_capabilities.len(), 7);

    // Attacher on by default: ControllerPublish is a checked no-op.
    c.controller
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "test-node".into(),
            volume_capability: Some(mount_cap(Mode::MultiNodeMultiWriter)),
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap();

    // Stage twice.
    let staging = driver.staging_path("pv1");
    for _ in 0..2 {
        c.node
            .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
            .await
            .unwrap();
    }
    assert!(mounts::is_mount_point(&staging).unwrap());
    assert_eq!(
        mounts::mounts_under(&staging).unwrap().len(),
        1,
        "one session, not two"
    );

    // Publish to three targets (the last read-only), each twice.
    let targets: Vec<PathBuf> = (0..3)
        .map(|i| driver.target_path(&format!("pod-{i}")))
        .collect();
    for (i, t) in targets.iter().enumerate() {
        for _ in 0..2 {
            c.node
                .node_publish_volume(publish_req(
                    &vol,
                    &staging,
                    t,
                    i == 2,
                    Mode::MultiNodeMultiWriter,
                ))
                .await
                .unwrap();
        }
        let ms = mounts::mounts_under(t).unwrap();
        assert_eq!(ms.len(), 1, "{} mounted once", t.display());
        // every target, read-only or not, is nosuid,nodev (per /proc/self/mountinfo)
        let opts: Vec<&str> = ms[0].mount_options.split(',').collect();
        assert_eq!(opts.contains(&"ro"), i == 2, "{}", ms[0].mount_options);
        for want in ["nosuid", "nodev"] {
            assert!(
                opts.contains(&want),
                "{}: {want} missing in {}",
                t.display(),
                ms[0].mount_options
            );
        }
    }
    std::fs::write(targets[0].join("hello.txt"), b"written by pod-0").unwrap();
    assert_eq!(
        std::fs::read(targets[1].join("hello.txt")).unwrap(),
        b"written by pod-0"
    );
    assert_eq!(
        std::fs::read(targets[2].join("hello.txt")).unwrap(),
        b"written by pod-0"
    );
    let err = std::fs::write(targets[2].join("nope.txt"), b"x").unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EROFS),
        "readonly target rejects writes"
    );
    // Publishing the read-only target read-write is an incompatible re-publish.
    let r = c
        .node
        .node_publish_volume(publish_req(
            &vol,
            &staging,
            &targets[2],
            false,
            Mode::MultiNodeMultiWriter,
        ))
        .await;
    assert_eq!(code(r), Code::AlreadyExists);
    if driver.stager == Stager::Fuse {
        std::thread::sleep(std::time::Duration::from_secs(2));
        let got = weed.filer_get("/buckets/pvc-lifecycle-1/hello.txt");
        assert_eq!(
            got.as_deref(),
            Some(&b"written by pod-0"[..]),
            "data reached the filer"
        );
    }

    // Stats on a target: bytes, condition normal.
    let stats = c
        .node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: targets[0].display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let bytes = stats
        .usage
        .iter()
        .find(|u| u.unit == volume_usage::Unit::Bytes as i32)
        .expect("bytes usage");
    assert!(
        bytes.total > 0 && bytes.available >= 0 && bytes.used >= 0,
        "{bytes:?}"
    );
    assert_eq!(stats.volume_condition.map(|c| c.abnormal), Some(false));

    // Online expansion: controller records, node applies the quota.
    let exp = c
        .controller
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 2 << 30,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(exp.node_expansion_required);
    let nexp = c
        .node
        .node_expand_volume(node_expand_req(&vol.volume_id, &targets[0], 2 << 30))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(nexp.capacity_bytes, 2 << 30);

    // Unpublish (twice each): mounts and target dirs gone.
    for t in &targets {
        for _ in 0..2 {
            c.node
                .node_unpublish_volume(unpublish_req(&vol, t))
                .await
                .unwrap();
        }
        assert!(!t.exists(), "{} removed", t.display());
    }
    // Unstage twice.
    for _ in 0..2 {
        c.node
            .node_unstage_volume(unstage_req(&vol, &staging))
            .await
            .unwrap();
    }
    assert_no_mounts_below(&driver, "after unstage");

    c.controller
        .controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "test-node".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // Delete twice: directory and data gone.
    for _ in 0..2 {
        c.controller
            .delete_volume(DeleteVolumeRequest {
                volume_id: vol.volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(
        !filer_has(&weed.filer_addr(), "/buckets/pvc-lifecycle-1"),
        "volume dir deleted"
    );

    // Every RPC was logged with its duration, secrets never.
    let log = driver.log();
    for rpc in [
        "CreateVolume",
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeUnstageVolume",
        "DeleteVolume",
    ] {
        assert!(log.contains(&format!("rpc={rpc}")), "{rpc} not logged");
    }
    assert!(log.contains("duration_ms"));
    assert!(!log.contains("do-not-log-me"), "a secret reached the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_publish_of_one_volume_to_ten_targets() {
    let weed = common::WeedServer::start();
    let driver = Driver::start(&weed.filer_addr(), &[]);
    let c = driver.clients().await;
    let vol = c
        .controller
        .clone()
        .create_volume(create_req("pvc-concurrent", 0, &[]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let staging = driver.staging_path("pvc");

    // Ten concurrent stages of the same volume: one session.
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let mut node = c.node.clone();
        let req = stage_req(&vol, &staging, Mode::MultiNodeMultiWriter);
        tasks.push(tokio::spawn(async move {
            node.node_stage_volume(req).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(mounts::mounts_under(&staging).unwrap().len(), 1);

    // Ten targets, each published twice, all at once.
    let targets: Arc<Vec<PathBuf>> = Arc::new(
        (0..10)
            .map(|i| driver.target_path(&format!("p{i}")))
            .collect(),
    );
    let mut tasks = Vec::new();
    for round in 0..2 {
        for (i, t) in targets.iter().enumerate() {
            let mut node = c.node.clone();
            let req = publish_req(&vol, &staging, t, i % 3 == 0, Mode::MultiNodeMultiWriter);
            tasks.push(tokio::spawn(async move {
                (round, node.node_publish_volume(req).await.map(|_| ()))
            }));
        }
    }
    for t in tasks {
        let (round, r) = t.await.unwrap();
        r.unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    for (i, t) in targets.iter().enumerate() {
        let ms = mounts::mounts_under(t).unwrap();
        assert_eq!(ms.len(), 1, "{} has {} mounts", t.display(), ms.len());
        assert_eq!(ms[0].is_read_only(), i % 3 == 0);
    }
    std::fs::write(targets[1].join("f"), b"shared").unwrap();
    for t in targets.iter() {
        assert_eq!(std::fs::read(t.join("f")).unwrap(), b"shared");
    }

    let mut tasks = Vec::new();
    for t in targets.iter() {
        let mut node = c.node.clone();
        let req = unpublish_req(&vol, t);
        tasks.push(tokio::spawn(async move {
            node.node_unpublish_volume(req).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    c.node
        .clone()
        .node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert_no_mounts_below(&driver, "after concurrent unpublish/unstage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_requests_get_clear_codes_and_mount_nothing() {
    let weed = common::WeedServer::start();
    let driver = Driver::start(&weed.filer_addr(), &[]);
    let mut c = driver.clients().await;
    let vol = c
        .controller
        .create_volume(create_req("pvc-bad", 0, &[]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let staging = driver.staging_path("bad");
    let target = driver.target_path("pod-bad");
    let s = |p: &PathBuf| p.display().to_string();

    // Stage.
    let mut r = stage_req(&vol, &staging, Mode::SingleNodeWriter);
    r.volume_id.clear();
    assert_eq!(
        code(c.node.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol, &staging, Mode::SingleNodeWriter);
    r.staging_target_path.clear();
    assert_eq!(
        code(c.node.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol, &staging, Mode::SingleNodeWriter);
    r.staging_target_path = "relative/globalmount".into();
    assert_eq!(
        code(c.node.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol, &staging, Mode::SingleNodeWriter);
    r.staging_target_path = format!("{}/../escape", s(&staging));
    assert_eq!(
        code(c.node.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol, &staging, Mode::SingleNodeWriter);
    r.volume_capability = None;
    assert_eq!(
        code(c.node.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol, &staging, Mode::SingleNodeWriter);
    r.volume_capability = Some(block_cap(Mode::SingleNodeWriter));
    let err = c.node.node_stage_volume(r).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("block access type is not supported"),
        "{}",
        err.message()
    );
    let mut r = stage_req(&vol, &staging, Mode::SingleNodeWriter);
    r.volume_context.insert("replication".into(), "lots".into());
    let err = c.node.node_stage_volume(r).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("replication"), "{}", err.message());
    assert_no_mounts_below(&driver, "after bad stages");

    // Publish.
    c.node
        .node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await
        .unwrap();
    let mut r = publish_req(&vol, &staging, &target, false, Mode::SingleNodeWriter);
    r.volume_id.clear();
    assert_eq!(
        code(c.node.node_publish_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = publish_req(&vol, &staging, &target, false, Mode::SingleNodeWriter);
    r.target_path.clear();
    assert_eq!(
        code(c.node.node_publish_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = publish_req(&vol, &staging, &target, false, Mode::SingleNodeWriter);
    r.target_path = "pods/x/mount".into();
    assert_eq!(
        code(c.node.node_publish_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = publish_req(&vol, &staging, &target, false, Mode::SingleNodeWriter);
    r.volume_capability = None;
    assert_eq!(
        code(c.node.node_publish_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = publish_req(&vol, &staging, &target, false, Mode::SingleNodeWriter);
    r.volume_capability = Some(block_cap(Mode::SingleNodeWriter));
    assert_eq!(
        code(c.node.node_publish_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = publish_req(&vol, &staging, &target, false, Mode::SingleNodeWriter);
    r.staging_target_path.clear();
    assert_eq!(
        code(c.node.node_publish_volume(r).await),
        Code::FailedPrecondition
    );
    let other_staging = driver.staging_path("never-staged");
    let r = publish_req(&vol, &other_staging, &target, false, Mode::SingleNodeWriter);
    assert_eq!(
        code(c.node.node_publish_volume(r).await),
        Code::FailedPrecondition,
        "not staged there"
    );
    assert!(
        !mounts::is_mount_point(&target).unwrap(),
        "no publish mount after bad requests"
    );
    assert_eq!(
        driver.mounts(),
        vec![staging.clone()],
        "only the staging mount"
    );

    // Unpublish / unstage / stats / expand.
    let r = NodeUnpublishVolumeRequest {
        volume_id: String::new(),
        target_path: s(&target),
    };
    assert_eq!(
        code(c.node.node_unpublish_volume(r).await),
        Code::InvalidArgument
    );
    let r = NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: String::new(),
    };
    assert_eq!(
        code(c.node.node_unpublish_volume(r).await),
        Code::InvalidArgument
    );
    let r = NodeUnstageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: "rel".into(),
    };
    assert_eq!(
        code(c.node.node_unstage_volume(r).await),
        Code::InvalidArgument
    );
    let r = NodeGetVolumeStatsRequest {
        volume_id: vol.volume_id.clone(),
        volume_path: s(&target),
        ..Default::default()
    };
    assert_eq!(
        code(c.node.node_get_volume_stats(r).await),
        Code::NotFound,
        "nothing published at target"
    );
    let r = NodeGetVolumeStatsRequest {
        volume_id: "unknown".into(),
        volume_path: "/does/not/exist".into(),
        ..Default::default()
    };
    assert_eq!(code(c.node.node_get_volume_stats(r).await), Code::NotFound);
    let r = NodeExpandVolumeRequest {
        volume_id: "unknown".into(),
        volume_path: "/does/not/exist".into(),
        ..Default::default()
    };
    assert_eq!(code(c.node.node_expand_volume(r).await), Code::NotFound);

    // Controller.
    assert_eq!(
        code(c.controller.create_volume(create_req("", 0, &[])).await),
        Code::InvalidArgument
    );
    let mut r = create_req("pvc-block", 0, &[]);
    r.volume_capabilities = vec![block_cap(Mode::SingleNodeWriter)];
    assert_eq!(
        code(c.controller.create_volume(r).await),
        Code::InvalidArgument
    );
    let r = DeleteVolumeRequest {
        volume_id: "/buckets".into(),
        ..Default::default()
    };
    assert_eq!(
        code(c.controller.delete_volume(r).await),
        Code::InvalidArgument
    );
    assert!(
        filer_has(&weed.filer_addr(), "/buckets/pvc-bad"),
        "refused delete touched nothing"
    );
    let r = ValidateVolumeCapabilitiesRequest {
        volume_id: "/buckets/missing-volume".into(),
        volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter)],
        ..Default::default()
    };
    assert_eq!(
        code(c.controller.validate_volume_capabilities(r).await),
        Code::NotFound
    );
    let r = ValidateVolumeCapabilitiesRequest {
        volume_id: vol.volume_id.clone(),
        volume_capabilities: vec![block_cap(Mode::SingleNodeWriter)],
        ..Default::default()
    };
    let v = c
        .controller
        .validate_volume_capabilities(r)
        .await
        .unwrap()
        .into_inner();
    assert!(
        v.confirmed.is_none() && v.message.contains("block"),
        "{v:?}"
    );
    assert_eq!(
        code(
            c.controller
                .list_volumes(ListVolumesRequest::default())
                .await
        ),
        Code::Unimplemented
    );
    assert_eq!(
        code(
            c.controller
                .get_capacity(GetCapacityRequest::default())
                .await
        ),
        Code::Unimplemented
    );

    c.node
        .node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert_no_mounts_below(&driver, "at the end");
}

/// After a plugin crash: a live staging mount is left alone, a dead one (what a dead FUSE
/// daemon leaves behind) is detected, reported and replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restart_keeps_live_mounts_and_repairs_dead_ones() {
    let weed = common::WeedServer::start();
    // self-repair off: this test inspects dead mounts before kubelet-style calls repair them
    let mut driver = Driver::start(&weed.filer_addr(), &["--stateDir="]);
    let mut c = driver.clients().await;
    let vol = c
        .controller
        .create_volume(create_req("pvc-restart", 0, &[]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let staging = driver.staging_path("restart");
    let t1 = driver.target_path("pod-1");
    c.node
        .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
        .await
        .unwrap();
    c.node
        .node_publish_volume(publish_req(
            &vol,
            &staging,
            &t1,
            false,
            Mode::MultiNodeMultiWriter,
        ))
        .await
        .unwrap();
    std::fs::write(t1.join("before"), b"1").unwrap();
    let staging_id = |p: &PathBuf| {
        mounts::mounts_under(p)
            .unwrap()
            .iter()
            .map(|m| m.mount_id)
            .max()
    };
    let live_id = staging_id(&staging);

    driver.kill();
    driver.restart();
    let mut c = driver.clients().await;
    if driver.stager == Stager::Fake {
        // The fake's bind outlives the process: a live mount the new process must leave alone.
        c.node
            .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
            .await
            .unwrap();
        assert_eq!(
            staging_id(&staging),
            live_id,
            "live staging mount untouched"
        );
        c.node
            .node_publish_volume(publish_req(
                &vol,
                &staging,
                &t1,
                false,
                Mode::MultiNodeMultiWriter,
            ))
            .await
            .unwrap();
        assert_eq!(mounts::mounts_under(&t1).unwrap().len(), 1);
        assert_eq!(std::fs::read(t1.join("before")).unwrap(), b"1");

        // Now the session dies: replace the staging mount with a dead FUSE mount.
        mounts::unmount_all(&staging).unwrap();
        mounts::mount_dead_fuse(&staging).unwrap();
    }
    assert!(
        matches!(mounts::mount_state(&staging).unwrap(), MountState::Dead(_)),
        "staging should be dead now"
    );

    // Stats on the staging path report the dead session.
    let stats = c
        .node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: staging.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let cond = stats.volume_condition.unwrap();
    assert!(cond.abnormal, "{cond:?}");

    // Publishing a new pod repairs the staging mount first.
    let t2 = driver.target_path("pod-2");
    c.node
        .node_publish_volume(publish_req(
            &vol,
            &staging,
            &t2,
            false,
            Mode::MultiNodeMultiWriter,
        ))
        .await
        .unwrap();
    assert_eq!(mounts::mount_state(&staging).unwrap(), MountState::Healthy);
    assert_eq!(
        std::fs::read(t2.join("before")).unwrap(),
        b"1",
        "same data after repair"
    );

    // NodeStage on a dead staging path repairs as well.
    mounts::unmount_all(&staging).unwrap();
    mounts::mount_dead_fuse(&staging).unwrap();
    c.node
        .node_stage_volume(stage_req(&vol, &staging, Mode::MultiNodeMultiWriter))
        .await
        .unwrap();
    assert_eq!(mounts::mount_state(&staging).unwrap(), MountState::Healthy);

    // A dead publish mount is replaced by a publish and removed by an unpublish.
    mounts::unmount_all(&t2).unwrap();
    mounts::mount_dead_fuse(&t2).unwrap();
    c.node
        .node_publish_volume(publish_req(
            &vol,
            &staging,
            &t2,
            false,
            Mode::MultiNodeMultiWriter,
        ))
        .await
        .unwrap();
    assert_eq!(std::fs::read(t2.join("before")).unwrap(), b"1");
    mounts::unmount_all(&t1).unwrap();
    mounts::mount_dead_fuse(&t1).unwrap();
    let pin = nix::fcntl::open(
        &t1,
        nix::fcntl::OFlag::O_PATH,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    c.node
        .node_unpublish_volume(unpublish_req(&vol, &t1))
        .await
        .unwrap();
    nix::unistd::close(pin).unwrap();
    assert!(!t1.exists());
    c.node
        .node_unpublish_volume(unpublish_req(&vol, &t2))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert_no_mounts_below(&driver, "after cleanup");
}

/// SIGTERM: exits 0, removes its socket, and leaves volumes mounted (pods keep working).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_shuts_down_gracefully_without_unmounting() {
    let weed = common::WeedServer::start();
    let mut driver = Driver::start(&weed.filer_addr(), &[]);
    let mut c = driver.clients().await;
    let vol = c
        .controller
        .create_volume(create_req("pvc-term", 0, &[]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let staging = driver.staging_path("term");
    c.node
        .node_stage_volume(stage_req(&vol, &staging, Mode::SingleNodeWriter))
        .await
        .unwrap();
    drop(c);
    let status = driver.terminate().expect("was running");
    assert!(status.success(), "exit status {status}");
    assert!(!driver.socket.exists(), "socket removed on shutdown");
    if driver.stager == Stager::Fake {
        assert!(
            mounts::is_mount_point(&staging).unwrap(),
            "volumes stay mounted across a plugin restart"
        );
    }
    assert!(driver.log().contains("SIGTERM received"));
}

/// Go-style command lines and WEED_* environment variables configure the binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn go_style_flags_and_env_vars() {
    let weed = common::WeedServer::start();
    let dir = tempfile::Builder::new()
        .prefix("csitest")
        .tempdir()
        .unwrap();
    let socket = dir.path().join("csi.sock");
    let args = vec![
        "-driverName=custom.csi.example.com".to_string(),
        "-components=controller".to_string(),
        "-attacher=false".to_string(),
        "-mountEndpoint=unix:///tmp/ignored.sock".to_string(),
    ];
    let env = vec![
        (
            "WEED_ENDPOINT".to_string(),
            format!("unix://{}", socket.display()),
        ),
        ("WEED_FILER".to_string(), weed.filer_addr()),
        ("WEED_LOGFORMAT".to_string(), "json".to_string()),
    ];
    // controller only: no stager runs
    let driver = Driver::start_raw(dir, socket, Stager::Fuse, args, env);
    let mut c = driver.clients().await;
    let info = c
        .identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "custom.csi.example.com");
    let caps = c
        .controller
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert_eq!(
        caps.len(),
        3,
        "no PUBLISH_UNPUBLISH_VOLUME with -attacher=false"
    );
    // Controller only: the node service is not registered.
    assert_eq!(
        code(
            c.node
                .node_get_capabilities(NodeGetCapabilitiesRequest {})
                .await
        ),
        Code::Unimplemented
    );
    let log = driver.log();
    assert!(
        log.contains("mountEndpoint") && log.contains("ignored"),
        "warning about --mountEndpoint"
    );
    let first = log
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(
        serde_json::from_str::<serde_json::Value>(first).is_ok(),
        "json log line: {first}"
    );
}

/// NodeExpandVolume of `volume_id` at `path` to `bytes`, as kubelet asks for it.
fn node_expand_req(volume_id: &str, path: &std::path::Path, bytes: u64) -> NodeExpandVolumeRequest {
    NodeExpandVolumeRequest {
        volume_id: volume_id.to_string(),
        volume_path: path.display().to_string(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes as i64,
            limit_bytes: 0,
        }),
        ..Default::default()
    }
}

/// Waits up to `secs` for `df` at `path` to show `want` bytes; returns what it showed last.
async fn wait_df(path: &std::path::Path, want: u64, secs: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let p = path.to_path_buf();
        let got = tokio::task::spawn_blocking(move || df_total(&p))
            .await
            .unwrap();
        if got == want || std::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Issue 13 (1): an expansion is the size every node enforces, at every stage. Node A gets
/// NodeExpandVolume; node B, staged before the expansion, never does and must pick the new
/// size up by itself; A staged again with the PV's (creation-time) volume context must keep it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expansion_survives_restage_and_reaches_other_nodes() {
    const GIB: u64 = 1 << 30;
    let weed = common::WeedServer::start();
    let a = Driver::start_fuse(&weed.filer_addr(), &[]);
    let b = Driver::start_fuse(&weed.filer_addr(), &[]);
    let (mut ca, mut cb) = (a.clients().await, b.clients().await);
    let vol = ca
        .controller
        .create_volume(create_req("pvc-expand-13", GIB as i64, &[]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let mode = Mode::MultiNodeMultiWriter;
    let (sa, sb) = (a.staging_path("pv-exp"), b.staging_path("pv-exp"));
    ca.node
        .node_stage_volume(stage_req(&vol, &sa, mode))
        .await
        .unwrap();
    cb.node
        .node_stage_volume(stage_req(&vol, &sb, mode))
        .await
        .unwrap();
    assert_eq!(wait_df(&sa, GIB, 0).await, GIB, "A before the expansion");
    assert_eq!(wait_df(&sb, GIB, 0).await, GIB, "B before the expansion");

    // csi-resizer: ControllerExpandVolume, then kubelet on node A only: NodeExpandVolume.
    ca.controller
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 3 * GIB as i64,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    ca.node
        .node_expand_volume(node_expand_req(&vol.volume_id, &sa, 3 * GIB))
        .await
        .unwrap();
    assert_eq!(
        wait_df(&sa, 3 * GIB, 0).await,
        3 * GIB,
        "A after NodeExpandVolume"
    );
    assert_eq!(
        wait_df(&sb, 3 * GIB, 20).await,
        3 * GIB,
        "B, staged before the expansion, never got NodeExpandVolume"
    );

    // The pod moves: kubelet unstages and stages again with the context stored in the PV.
    ca.node
        .node_unstage_volume(unstage_req(&vol, &sa))
        .await
        .unwrap();
    let sa = a.staging_path("pv-exp");
    ca.node
        .node_stage_volume(stage_req(&vol, &sa, mode))
        .await
        .unwrap();
    assert_eq!(
        vol.volume_context.get("volumeCapacity").map(String::as_str),
        Some("1073741824"),
        "the PV keeps the size at creation"
    );
    assert_eq!(wait_df(&sa, 3 * GIB, 0).await, 3 * GIB, "A staged again");

    for (c, s) in [(&mut ca, &sa), (&mut cb, &sb)] {
        c.node
            .node_unstage_volume(unstage_req(&vol, s))
            .await
            .unwrap();
    }
    assert_no_mounts_below(&a, "A after unstage");
    assert_no_mounts_below(&b, "B after unstage");
}

/// Issue 13 (1), static PV: the controller's expansion finds no directory for a bare handle
/// (the path is only in the volume context), so NodeExpandVolume on one node must record the
/// size on the filer: the other node, staged before, picks it up without NodeExpandVolume,
/// and a new stage with the PV's unchanged context keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_static_volumes_expansion_reaches_other_nodes_and_later_stages() {
    const GIB: u64 = 1 << 30;
    let weed = common::WeedServer::start();
    let out = std::process::Command::new("curl")
        .args(["-sS", "-f", "-X", "POST"])
        .arg(format!("http://{}/static-exp/data/", weed.filer_addr()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let a = Driver::start_fuse(&weed.filer_addr(), &[]);
    let b = Driver::start_fuse(&weed.filer_addr(), &[]);
    let (mut ca, mut cb) = (a.clients().await, b.clients().await);
    let vol = Volume {
        volume_id: "static-exp".into(),
        volume_context: [
            ("path".to_string(), "/static-exp/data".to_string()),
            ("volumeCapacity".to_string(), GIB.to_string()),
        ]
        .into(),
        ..Default::default()
    };
    let mode = Mode::MultiNodeMultiWriter;
    let (sa, sb) = (a.staging_path("pv-sexp"), b.staging_path("pv-sexp"));
    for (c, s) in [(&mut ca, &sa), (&mut cb, &sb)] {
        c.node
            .node_stage_volume(stage_req(&vol, s, mode))
            .await
            .unwrap();
    }
    assert_eq!(wait_df(&sa, GIB, 0).await, GIB, "A before the expansion");
    assert_eq!(wait_df(&sb, GIB, 0).await, GIB, "B before the expansion");
    // another static PV on the same directory, with its own size, staged on B
    let mut other = vol.clone();
    other.volume_id = "static-exp-other".into();
    let so = b.staging_path("pv-sexp-other");
    cb.node
        .node_stage_volume(stage_req(&other, &so, mode))
        .await
        .unwrap();
    let range = Some(CapacityRange {
        required_bytes: 3 * GIB as i64,
        limit_bytes: 0,
    });
    let expanded = ca
        .controller
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: range,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(expanded.node_expansion_required);
    ca.node
        .node_expand_volume(node_expand_req(&vol.volume_id, &sa, 3 * GIB))
        .await
        .unwrap();
    assert_eq!(
        wait_df(&sa, 3 * GIB, 0).await,
        3 * GIB,
        "A after NodeExpandVolume"
    );
    assert_eq!(
        wait_df(&sb, 3 * GIB, 20).await,
        3 * GIB,
        "B, staged before the expansion, never got NodeExpandVolume"
    );
    // an older, smaller expansion asked again (kubelet retries) does not lower the quota,
    // and the answer says what the volume has
    let answer = ca
        .node
        .node_expand_volume(node_expand_req(&vol.volume_id, &sa, 2 * GIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.capacity_bytes as u64,
        3 * GIB,
        "NodeExpandVolume's answer after a smaller request"
    );
    assert_eq!(
        wait_df(&sa, 3 * GIB, 0).await,
        3 * GIB,
        "A after a smaller NodeExpandVolume"
    );
    // the other PV on the directory keeps its own size, also when staged again
    assert_eq!(
        wait_df(&so, GIB, 0).await,
        GIB,
        "the other PV after the expansion"
    );
    cb.node
        .node_unstage_volume(unstage_req(&other, &so))
        .await
        .unwrap();
    cb.node
        .node_stage_volume(stage_req(&other, &so, mode))
        .await
        .unwrap();
    assert_eq!(wait_df(&so, GIB, 0).await, GIB, "the other PV staged again");
    cb.node
        .node_unstage_volume(unstage_req(&other, &so))
        .await
        .unwrap();
    // B moves its pod: staged again from the PV's context, which still says 1 GiB
    cb.node
        .node_unstage_volume(unstage_req(&vol, &sb))
        .await
        .unwrap();
    let sb = b.staging_path("pv-sexp");
    cb.node
        .node_stage_volume(stage_req(&vol, &sb, mode))
        .await
        .unwrap();
    assert_eq!(wait_df(&sb, 3 * GIB, 0).await, 3 * GIB, "B staged again");

    for (c, s) in [(&mut ca, &sa), (&mut cb, &sb)] {
        c.node
            .node_unstage_volume(unstage_req(&vol, s))
            .await
            .unwrap();
    }
    assert_no_mounts_below(&a, "A after unstage");
    assert_no_mounts_below(&b, "B after unstage");
}

fn with_flags(mut cap: VolumeCapability, flags: &[&str]) -> VolumeCapability {
    if let Some(volume_capability::AccessType::Mount(m)) = cap.access_type.as_mut() {
        m.mount_flags = flags.iter().map(|s| s.to_string()).collect();
    }
    cap
}

/// Issue 13 (8): PV `mountOptions` (CSI mount_flags) that map to a setting of this driver are
/// honoured; unknown ones are refused with INVALID_ARGUMENT naming them, leaving nothing
/// mounted, at NodeStageVolume and NodePublishVolume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pv_mount_options_are_honoured_or_refused() {
    let weed = common::WeedServer::start();
    let driver = Driver::start(&weed.filer_addr(), &[]);
    let mut c = driver.clients().await;
    let vol = c
        .controller
        .create_volume(create_req("pvc-mount-flags", 1 << 30, &[]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let mode = Mode::MultiNodeMultiWriter;
    let staging = driver.staging_path("pv-flags");

    // Unknown options: refused, named, nothing mounted.
    let mut req = stage_req(&vol, &staging, mode);
    req.volume_capability = Some(with_flags(
        mount_cap(mode),
        &["ro", "noatime", "bogusOption=1"],
    ));
    let err = c.node.node_stage_volume(req).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains(": noatime, bogusOption=1;"),
        "names exactly the unknown ones: {}",
        err.message()
    );
    assert_no_mounts_below(&driver, "after a refused stage");

    // Known options: applied to the session (recorded with its options) and read-only.
    let mut req = stage_req(&vol, &staging, mode);
    req.volume_capability = Some(with_flags(
        mount_cap(mode),
        &["readOnly", "cacheCapacityMB=64", "concurrentReaders=3"],
    ));
    c.node.node_stage_volume(req).await.unwrap();
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(driver.path("plugin/state/volumes.json")).unwrap())
            .unwrap();
    let opts = &state["volumes"][&vol.volume_id]["opts"];
    assert_eq!(opts["cache_capacity_mb"], 64, "{state}");
    assert_eq!(opts["concurrent_readers"], 3, "{state}");
    assert_eq!(opts["read_only"], true, "{state}");
    let err = std::fs::write(staging.join("x"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");

    // NodePublishVolume refuses unknown options as well, without binding.
    let target = driver.target_path("pod-flags");
    let mut req = publish_req(&vol, &staging, &target, false, mode);
    req.volume_capability = Some(with_flags(mount_cap(mode), &["nosuchflag"]));
    let err = c.node.node_publish_volume(req).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("nosuchflag"), "{}", err.message());
    assert!(!mounts::is_mount_point(&target).unwrap_or(false));

    c.node
        .node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert_no_mounts_below(&driver, "after unstage");
}

/// Runs `cmd args` as uid/gid 65534 (nobody) with no supplementary groups.
fn as_nobody(cmd: &str, args: &[&std::path::Path]) -> std::process::Output {
    std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", cmd])
        .args(args)
        .output()
        .expect("setpriv")
}

/// Issue 13 (13): a static PV on a directory another client made through the filer HTTP API
/// without a mode (stored 0660) must be usable by a non-root pod, as with `weed mount`, whose
/// root shows 0777 &^ umask.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn non_root_pod_can_use_a_root_made_over_http() {
    use std::os::unix::fs::PermissionsExt;
    let weed = common::WeedServer::start();
    let out = std::process::Command::new("curl")
        .args(["-sS", "-f", "-X", "POST"])
        .arg(format!("http://{}/static13/data/", weed.filer_addr()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let driver = Driver::start_fuse(&weed.filer_addr(), &[]);
    // The pod's user must be able to reach the target through the test's own directories.
    std::fs::set_permissions(driver.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = driver.clients().await;
    let vol = Volume {
        volume_id: "static13".into(),
        volume_context: [("path".to_string(), "/static13/data".to_string())].into(),
        ..Default::default()
    };
    let mode = Mode::MultiNodeMultiWriter;
    let staging = driver.staging_path("pv-static13");
    let target = driver.target_path("pod-nobody");
    c.node
        .node_stage_volume(stage_req(&vol, &staging, mode))
        .await
        .unwrap();
    c.node
        .node_publish_volume(publish_req(&vol, &staging, &target, false, mode))
        .await
        .unwrap();

    let (t, f) = (target.clone(), target.join("written-by-nobody"));
    let (ls, touch, stat, mode_bits) = tokio::task::spawn_blocking(move || {
        let mode_bits = std::fs::metadata(&t).unwrap().permissions().mode() & 0o7777;
        (
            as_nobody("ls", &[&t]),
            as_nobody("touch", &[&f]),
            as_nobody("stat", &[&f]),
            mode_bits,
        )
    })
    .await
    .unwrap();
    assert_eq!(
        mode_bits, 0o777,
        "the volume root as weed mount shows it (umask 000)"
    );
    for (what, o) in [("ls", &ls), ("touch", &touch), ("stat", &stat)] {
        assert!(o.status.success(), "{what} as nobody: {o:?}");
    }
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert_eq!(
        weed.filer_get("/static13/data/written-by-nobody")
            .as_deref(),
        Some(&b""[..]),
        "the file reached the filer"
    );

    c.node
        .node_unpublish_volume(unpublish_req(&vol, &target))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap();
    assert_no_mounts_below(&driver, "after unstage");
}

/// Issue 13 (3): grpc-core clients (Python `grpcio`) derive `:authority` from the socket path
/// (`tmp%2F...%2Fcsi.sock`), which h2 refuses; the unix socket must serve them anyway. A raw
/// unary call with a hand-encoded empty GetPluginInfoRequest, no `grpc.default_authority`.
#[test]
fn python_grpcio_client_over_the_unix_socket() {
    const CLIENT: &str = r#"
import sys, grpc
ch = grpc.insecure_channel("unix://" + sys.argv[1])
# several calls on one channel (one HTTP/2 connection), of more than one method
for _ in range(3):
    resp = ch.unary_unary("/csi.v1.Identity/GetPluginInfo")(b"", timeout=20)
    assert resp[0] == 0x0A, resp  # field 1 (name), length-delimited
    n, i, shift = 0, 1, 0
    while True:
        b = resp[i]; i += 1
        n |= (b & 0x7F) << shift; shift += 7
        if b < 0x80:
            break
    print(resp[i:i + n].decode())
    ch.unary_unary("/csi.v1.Identity/Probe")(b"", timeout=20)
"#;
    let have = std::process::Command::new("python3")
        .args(["-c", "import grpc"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        have,
        "needs python3 with grpcio (.ci/run installs grpcio==1.85.1 in the venv of scripts/venv.sh)"
    );
    // No filer needed: Identity answers without one.
    let driver = Driver::start("127.0.0.1:1", &["--components=controller"]);
    for _ in 0..2 {
        let out = std::process::Command::new("python3")
            .args(["-c", CLIENT])
            .arg(&driver.socket)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "grpcio call failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let names: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        assert_eq!(names, vec!["seaweedfs-csi-driver"; 3]);
    }
}
