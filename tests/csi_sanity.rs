//! Our own csi-sanity-style conformance cases (the applicable Identity/Controller/Node cases of
//! kubernetes-csi/csi-test, written for this driver), run against the driver binary on a unix
//! socket with a real SeaweedFS. Each case cleans up what it created; at the end nothing may be
//! left mounted. One weed server serves all cases, so the cases run in one test function with a
//! small runner that reports every failure.

#[allow(unused_imports)]
mod common;
mod csi_common;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use csi_common::*;
use parking_lot::Mutex;
use seaweedfs_csi_driver::pb::csi::controller_service_capability::rpc::Type as CtrlCap;
use seaweedfs_csi_driver::pb::csi::node_service_capability::rpc::Type as NodeCap;
use seaweedfs_csi_driver::pb::csi::plugin_capability::service::Type as PluginSvc;
use seaweedfs_csi_driver::pb::csi::volume_capability::access_mode::Mode;
use seaweedfs_csi_driver::pb::csi::*;
use tonic::Code;

const GI: i64 = 1 << 30;
/// csi-sanity's default test volume size and expansion size.
const TEST_SIZE: i64 = 10 * GI;
const EXPAND_SIZE: i64 = 20 * GI;

#[derive(Default)]
struct Registry {
    volumes: Vec<String>,
    stages: Vec<(String, PathBuf)>,
    publishes: Vec<(String, PathBuf)>,
}

#[derive(Clone)]
struct Ctx {
    c: Clients,
    staging: PathBuf,
    target_dir: PathBuf,
    reg: Arc<Mutex<Registry>>,
    serial: Arc<std::sync::atomic::AtomicU64>,
}

type CaseResult = Result<(), String>;
type Case = (
    &'static str,
    fn(Ctx) -> Pin<Box<dyn Future<Output = CaseResult> + Send>>,
);

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

fn expect_code<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
    want: Code,
) -> CaseResult {
    let got = code(r);
    ensure!(got == want, "expected {want:?}, got {got:?}");
    Ok(())
}

fn ok<T>(r: Result<T, tonic::Status>, what: &str) -> Result<T, String> {
    r.map_err(|s| format!("{what}: {:?} {}", s.code(), s.message()))
}

impl Ctx {
    fn unique(&self, prefix: &str) -> String {
        let n = self
            .serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{prefix}-{}-{n}", std::process::id())
    }

    fn target(&self) -> PathBuf {
        self.target_dir.join("target")
    }

    async fn create(&self, name: &str, bytes: i64, mode: Mode) -> Result<Volume, String> {
        let mut req = create_req(name, bytes, &[]);
        req.volume_capabilities = vec![mount_cap(mode)];
        let v = ok(
            self.c.controller.clone().create_volume(req).await,
            "CreateVolume",
        )?
        .into_inner()
        .volume
        .unwrap();
        self.reg.lock().volumes.push(v.volume_id.clone());
        Ok(v)
    }

    async fn stage(&self, v: &Volume, mode: Mode) -> CaseResult {
        ok(
            self.c
                .node
                .clone()
                .node_stage_volume(stage_req(v, &self.staging, mode))
                .await,
            "NodeStageVolume",
        )?;
        self.reg
            .lock()
            .stages
            .push((v.volume_id.clone(), self.staging.clone()));
        Ok(())
    }

    async fn publish(&self, v: &Volume, target: &std::path::Path, mode: Mode) -> CaseResult {
        let req = publish_req(v, &self.staging, target, false, mode);
        ok(
            self.c.node.clone().node_publish_volume(req).await,
            "NodePublishVolume",
        )?;
        self.reg
            .lock()
            .publishes
            .push((v.volume_id.clone(), target.to_path_buf()));
        Ok(())
    }

    /// Undoes everything the case registered, like csi-sanity's Resources.Cleanup.
    async fn cleanup(&self) -> CaseResult {
        let reg = std::mem::take(&mut *self.reg.lock());
        let mut node = self.c.node.clone();
        let mut ctrl = self.c.controller.clone();
        for (id, t) in reg.publishes.iter().rev() {
            let r = NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: t.display().to_string(),
            };
            ok(
                node.node_unpublish_volume(r).await,
                "cleanup NodeUnpublishVolume",
            )?;
        }
        for (id, s) in reg.stages.iter().rev() {
            let r = NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: s.display().to_string(),
            };
            ok(
                node.node_unstage_volume(r).await,
                "cleanup NodeUnstageVolume",
            )?;
        }
        for id in reg.volumes.iter().rev() {
            let r = DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            };
            ok(ctrl.delete_volume(r).await, "cleanup DeleteVolume")?;
        }
        Ok(())
    }
}

/// csi-sanity's runControllerTest: create, controller-publish, stage x n, publish x n, stats,
/// then the reverse, each undo x n.
async fn run_lifecycle(ctx: &Ctx, n: usize) -> CaseResult {
    let name = ctx.unique("sanity-node-full");
    let v = ctx.create(&name, TEST_SIZE, Mode::SingleNodeWriter).await?;
    let mut ctrl = ctx.c.controller.clone();
    let mut node = ctx.c.node.clone();
    let node_id = ok(
        node.node_get_info(NodeGetInfoRequest {}).await,
        "NodeGetInfo",
    )?
    .into_inner()
    .node_id;
    let cp = ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: node_id.clone(),
        volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    };
    ok(
        ctrl.controller_publish_volume(cp).await,
        "ControllerPublishVolume",
    )?;
    for _ in 0..n {
        ok(
            node.node_stage_volume(stage_req(&v, &ctx.staging, Mode::SingleNodeWriter))
                .await,
            "NodeStageVolume",
        )?;
    }
    let target = ctx.target();
    for _ in 0..n {
        let r = publish_req(&v, &ctx.staging, &target, false, Mode::SingleNodeWriter);
        ok(node.node_publish_volume(r).await, "NodePublishVolume")?;
    }
    let stats = ok(
        node.node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await,
        "NodeGetVolumeStats",
    )?
    .into_inner();
    ensure!(!stats.usage.is_empty(), "stats without usage");
    for _ in 0..n {
        ok(
            node.node_unpublish_volume(unpublish_req(&v, &target)).await,
            "NodeUnpublishVolume",
        )?;
    }
    ensure!(!target.exists(), "target path not removed");
    for _ in 0..n {
        ok(
            node.node_unstage_volume(unstage_req(&v, &ctx.staging))
                .await,
            "NodeUnstageVolume",
        )?;
    }
    for _ in 0..n {
        let r = ControllerUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: node_id.clone(),
            ..Default::default()
        };
        ok(
            ctrl.controller_unpublish_volume(r).await,
            "ControllerUnpublishVolume",
        )?;
    }
    for _ in 0..n {
        let r = DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        };
        ok(ctrl.delete_volume(r).await, "DeleteVolume")?;
    }
    ctx.reg.lock().volumes.retain(|id| *id != v.volume_id);
    Ok(())
}

fn cases() -> Vec<Case> {
    macro_rules! case {
        ($name:expr, |$ctx:ident| $body:block) => {
            ($name, |$ctx: Ctx| Box::pin(async move { $body }))
        };
    }
    vec![
        // ---------------- Identity ----------------
        case!("Identity GetPluginCapabilities should return appropriate capabilities", |ctx| {
            let caps = ok(ctx.c.identity.clone().get_plugin_capabilities(GetPluginCapabilitiesRequest {}).await, "caps")?
                .into_inner()
                .capabilities;
            let mut controller = false;
            for cap in caps {
                match cap.r#type {
                    Some(plugin_capability::Type::Service(s)) => {
                        let t = PluginSvc::try_from(s.r#type).map_err(|_| format!("unknown service {}", s.r#type))?;
                        controller |= t == PluginSvc::ControllerService;
                    }
                    Some(plugin_capability::Type::VolumeExpansion(e)) => {
                        ensure!(e.r#type == plugin_capability::volume_expansion::Type::Online as i32, "expansion {e:?}");
                    }
                    None => return Err("capability without type".into()),
                }
            }
            ensure!(controller, "CONTROLLER_SERVICE not advertised");
            Ok(())
        }),
        case!("Identity Probe should return appropriate information", |ctx| {
            let r = ok(ctx.c.identity.clone().probe(ProbeRequest {}).await, "Probe")?.into_inner();
            ensure!(r.ready == Some(true), "not ready: {r:?}");
            Ok(())
        }),
        case!("Identity GetPluginInfo should return appropriate information", |ctx| {
            let r = ok(ctx.c.identity.clone().get_plugin_info(GetPluginInfoRequest {}).await, "info")?.into_inner();
            let n = r.name.as_bytes();
            ensure!(!n.is_empty() && n.len() <= 63, "name length {}", n.len());
            let valid = n[0].is_ascii_alphabetic()
                && n[n.len() - 1].is_ascii_alphanumeric()
                && n.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'.');
            ensure!(valid, "name {:?} is not a valid driver name", r.name);
            ensure!(!r.vendor_version.is_empty(), "no vendor version");
            Ok(())
        }),
        // ---------------- Controller ----------------
        case!("Controller ControllerGetCapabilities should return appropriate capabilities", |ctx| {
            let caps = ok(ctx.c.controller.clone().controller_get_capabilities(ControllerGetCapabilitiesRequest {}).await, "caps")?
                .into_inner()
                .capabilities;
            let mut seen = Vec::new();
            for cap in caps {
                let Some(controller_service_capability::Type::Rpc(rpc)) = cap.r#type else {
                    return Err("capability without rpc".into());
                };
                seen.push(CtrlCap::try_from(rpc.r#type).map_err(|_| format!("unknown capability {}", rpc.r#type))?);
            }
            for want in [CtrlCap::CreateDeleteVolume, CtrlCap::ExpandVolume, CtrlCap::SingleNodeMultiWriter, CtrlCap::PublishUnpublishVolume] {
                ensure!(seen.contains(&want), "{want:?} missing from {seen:?}");
            }
            Ok(())
        }),
        case!("Controller RPCs not advertised (ListVolumes, GetCapacity) answer Unimplemented", |ctx| {
            expect_code(ctx.c.controller.clone().list_volumes(ListVolumesRequest::default()).await, Code::Unimplemented)?;
            expect_code(ctx.c.controller.clone().get_capacity(GetCapacityRequest::default()).await, Code::Unimplemented)
        }),
        case!("CreateVolume should fail when no name is provided", |ctx| {
            expect_code(ctx.c.controller.clone().create_volume(create_req("", TEST_SIZE, &[])).await, Code::InvalidArgument)
        }),
        case!("CreateVolume should fail when no volume capabilities are provided", |ctx| {
            let mut r = create_req(&ctx.unique("sanity-controller-create-no-volume-capabilities"), TEST_SIZE, &[]);
            r.volume_capabilities.clear();
            expect_code(ctx.c.controller.clone().create_volume(r).await, Code::InvalidArgument)
        }),
        case!("CreateVolume should return appropriate values SingleNodeWriter NoCapacity", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-controller-create-single-no-capacity"), 0, Mode::SingleNodeWriter).await?;
            ensure!(!v.volume_id.is_empty(), "empty volume id");
            Ok(())
        }),
        case!("CreateVolume should return appropriate values SingleNodeWriter WithCapacity 1Gi", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-controller-create-single-with-capacity"), GI, Mode::SingleNodeWriter).await?;
            ensure!(v.capacity_bytes == 0 || v.capacity_bytes >= GI, "capacity {}", v.capacity_bytes);
            Ok(())
        }),
        case!("CreateVolume should not fail when requesting to create a volume with already existing name and same capacity", |ctx| {
            let name = ctx.unique("sanity-controller-create-twice");
            let a = ctx.create(&name, TEST_SIZE, Mode::SingleNodeWriter).await?;
            let b = ctx.create(&name, TEST_SIZE, Mode::SingleNodeWriter).await?;
            ensure!(a.volume_id == b.volume_id, "{} != {}", a.volume_id, b.volume_id);
            ensure!(b.capacity_bytes == 0 || b.capacity_bytes >= TEST_SIZE, "capacity {}", b.capacity_bytes);
            Ok(())
        }),
        case!("CreateVolume should fail when requesting to create a volume with already existing name and different capacity", |ctx| {
            let name = ctx.unique("sanity-controller-create-twice-different");
            let mut r1 = create_req(&name, 0, &[]);
            r1.capacity_range = Some(CapacityRange { required_bytes: TEST_SIZE, limit_bytes: TEST_SIZE });
            let v = ok(ctx.c.controller.clone().create_volume(r1).await, "create")?.into_inner().volume.unwrap();
            ctx.reg.lock().volumes.push(v.volume_id.clone());
            ensure!(v.capacity_bytes == TEST_SIZE, "capacity {}", v.capacity_bytes);
            let mut r2 = create_req(&name, 0, &[]);
            r2.capacity_range = Some(CapacityRange { required_bytes: 2 * TEST_SIZE, limit_bytes: 2 * TEST_SIZE });
            expect_code(ctx.c.controller.clone().create_volume(r2).await, Code::AlreadyExists)
        }),
        case!("CreateVolume should not fail when creating volume with maximum-length name", |ctx| {
            let prefix = ctx.unique("sanity-controller-create-maxlen");
            let name = format!("{prefix}{}", "x".repeat(128 - prefix.len()));
            ensure!(name.len() == 128, "test bug");
            let v = ctx.create(&name, TEST_SIZE, Mode::SingleNodeWriter).await?;
            ensure!(v.capacity_bytes == 0 || v.capacity_bytes >= TEST_SIZE, "capacity {}", v.capacity_bytes);
            Ok(())
        }),
        case!("DeleteVolume should fail when no volume id is provided", |ctx| {
            expect_code(ctx.c.controller.clone().delete_volume(DeleteVolumeRequest::default()).await, Code::InvalidArgument)
        }),
        case!("DeleteVolume should succeed when an invalid volume id is used", |ctx| {
            let r = DeleteVolumeRequest { volume_id: "fake-volume-id-that-does-not-exist".into(), ..Default::default() };
            ok(ctx.c.controller.clone().delete_volume(r).await, "DeleteVolume").map(|_| ())
        }),
        case!("DeleteVolume should return appropriate values (no optional values added)", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-controller-create-appropriate"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() };
            ok(ctx.c.controller.clone().delete_volume(r).await, "DeleteVolume")?;
            ctx.reg.lock().volumes.clear();
            Ok(())
        }),
        case!("ValidateVolumeCapabilities should fail when no volume id is provided", |ctx| {
            let r = ValidateVolumeCapabilitiesRequest::default();
            expect_code(ctx.c.controller.clone().validate_volume_capabilities(r).await, Code::InvalidArgument)
        }),
        case!("ValidateVolumeCapabilities should fail when no volume capabilities are provided", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-controller-validate-nocaps"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = ValidateVolumeCapabilitiesRequest { volume_id: v.volume_id, ..Default::default() };
            expect_code(ctx.c.controller.clone().validate_volume_capabilities(r).await, Code::InvalidArgument)
        }),
        case!("ValidateVolumeCapabilities should return appropriate values (no optional values added)", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-controller-validate"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = ValidateVolumeCapabilitiesRequest {
                volume_id: v.volume_id,
                volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter)],
                ..Default::default()
            };
            let r = ok(ctx.c.controller.clone().validate_volume_capabilities(r).await, "validate")?.into_inner();
            let confirmed = r.confirmed.ok_or(format!("not confirmed: {}", r.message))?;
            ensure!(!confirmed.volume_capabilities.is_empty(), "confirmed without capabilities");
            Ok(())
        }),
        case!("ValidateVolumeCapabilities should fail when the requested volume does not exist", |ctx| {
            let r = ValidateVolumeCapabilitiesRequest {
                volume_id: ctx.unique("/buckets/sanity-missing"),
                volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter)],
                ..Default::default()
            };
            expect_code(ctx.c.controller.clone().validate_volume_capabilities(r).await, Code::NotFound)
        }),
        case!("ControllerPublishVolume should fail when no volume id is provided", |ctx| {
            let r = ControllerPublishVolumeRequest::default();
            expect_code(ctx.c.controller.clone().controller_publish_volume(r).await, Code::InvalidArgument)
        }),
        case!("ControllerPublishVolume should fail when no node id is provided", |ctx| {
            let r = ControllerPublishVolumeRequest { volume_id: "/buckets/x".into(), ..Default::default() };
            expect_code(ctx.c.controller.clone().controller_publish_volume(r).await, Code::InvalidArgument)
        }),
        case!("ControllerPublishVolume should fail when no volume capability is provided", |ctx| {
            let r = ControllerPublishVolumeRequest { volume_id: "/buckets/x".into(), node_id: "n".into(), ..Default::default() };
            expect_code(ctx.c.controller.clone().controller_publish_volume(r).await, Code::InvalidArgument)
        }),
        case!("ControllerPublishVolume should fail when the volume does not exist", |ctx| {
            let r = ControllerPublishVolumeRequest {
                volume_id: ctx.unique("/buckets/sanity-missing"),
                node_id: "n".into(),
                volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
                ..Default::default()
            };
            expect_code(ctx.c.controller.clone().controller_publish_volume(r).await, Code::NotFound)
        }),
        case!("ControllerUnpublishVolume should fail when no volume id is provided", |ctx| {
            let r = ControllerUnpublishVolumeRequest::default();
            expect_code(ctx.c.controller.clone().controller_unpublish_volume(r).await, Code::InvalidArgument)
        }),
        case!("ControllerExpandVolume should fail if no volume id is given", |ctx| {
            let r = ControllerExpandVolumeRequest {
                capacity_range: Some(CapacityRange { required_bytes: EXPAND_SIZE, limit_bytes: 0 }),
                ..Default::default()
            };
            expect_code(ctx.c.controller.clone().controller_expand_volume(r).await, Code::InvalidArgument)
        }),
        case!("ControllerExpandVolume should fail if no capacity range is given", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-expand-no-range"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = ControllerExpandVolumeRequest { volume_id: v.volume_id, ..Default::default() };
            expect_code(ctx.c.controller.clone().controller_expand_volume(r).await, Code::InvalidArgument)
        }),
        case!("ControllerExpandVolume should work", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-expand"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = ControllerExpandVolumeRequest {
                volume_id: v.volume_id,
                capacity_range: Some(CapacityRange { required_bytes: EXPAND_SIZE, limit_bytes: 0 }),
                ..Default::default()
            };
            let r = ok(ctx.c.controller.clone().controller_expand_volume(r).await, "expand")?.into_inner();
            ensure!(r.capacity_bytes >= EXPAND_SIZE, "capacity {}", r.capacity_bytes);
            Ok(())
        }),
        // ---------------- Node ----------------
        case!("Node NodeGetCapabilities should return appropriate capabilities", |ctx| {
            let caps = ok(ctx.c.node.clone().node_get_capabilities(NodeGetCapabilitiesRequest {}).await, "caps")?
                .into_inner()
                .capabilities;
            let mut seen = Vec::new();
            for cap in caps {
                let Some(node_service_capability::Type::Rpc(rpc)) = cap.r#type else {
                    return Err("capability without rpc".into());
                };
                seen.push(NodeCap::try_from(rpc.r#type).map_err(|_| format!("unknown capability {}", rpc.r#type))?);
            }
            for want in [NodeCap::StageUnstageVolume, NodeCap::GetVolumeStats, NodeCap::ExpandVolume, NodeCap::VolumeCondition] {
                ensure!(seen.contains(&want), "{want:?} missing from {seen:?}");
            }
            Ok(())
        }),
        case!("Node NodeGetInfo should return appropriate values", |ctx| {
            let r = ok(ctx.c.node.clone().node_get_info(NodeGetInfoRequest {}).await, "info")?.into_inner();
            ensure!(!r.node_id.is_empty(), "empty node id");
            ensure!(r.max_volumes_per_node >= 0, "negative max volumes");
            Ok(())
        }),
        case!("NodePublishVolume should fail when no volume id is provided", |ctx| {
            expect_code(ctx.c.node.clone().node_publish_volume(NodePublishVolumeRequest::default()).await, Code::InvalidArgument)
        }),
        case!("NodePublishVolume should fail when no target path is provided", |ctx| {
            let r = NodePublishVolumeRequest { volume_id: "some-vol".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_publish_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodePublishVolume should fail when no volume capability is provided", |ctx| {
            let r = NodePublishVolumeRequest {
                volume_id: "some-vol".into(),
                target_path: ctx.target().display().to_string(),
                ..Default::default()
            };
            expect_code(ctx.c.node.clone().node_publish_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodePublishVolume should fail when volume with single node single writer access mode is already mounted at a different target path", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-node-publish-single-node-single-writer"), TEST_SIZE, Mode::SingleNodeSingleWriter).await?;
            ctx.stage(&v, Mode::SingleNodeSingleWriter).await?;
            ctx.publish(&v, &ctx.target(), Mode::SingleNodeSingleWriter).await?;
            let other = ctx.target_dir.join("other_target");
            let r = publish_req(&v, &ctx.staging, &other, false, Mode::SingleNodeSingleWriter);
            let res = expect_code(ctx.c.node.clone().node_publish_volume(r).await, Code::FailedPrecondition);
            ensure!(!other.exists() || !seaweedfs_csi_driver::csi::mounts::is_mount_point(&other).unwrap(), "other target mounted");
            res
        }),
        case!("NodeUnpublishVolume should fail when no volume id is provided", |ctx| {
            expect_code(ctx.c.node.clone().node_unpublish_volume(NodeUnpublishVolumeRequest::default()).await, Code::InvalidArgument)
        }),
        case!("NodeUnpublishVolume should fail when no target path is provided", |ctx| {
            let r = NodeUnpublishVolumeRequest { volume_id: "some-vol".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_unpublish_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeUnpublishVolume should remove target path", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-node-unpublish-volume"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            ctx.stage(&v, Mode::SingleNodeWriter).await?;
            let target = ctx.target();
            let r = publish_req(&v, &ctx.staging, &target, false, Mode::SingleNodeWriter);
            ok(ctx.c.node.clone().node_publish_volume(r).await, "publish")?;
            ensure!(target.exists(), "target path not created by the driver");
            ok(ctx.c.node.clone().node_unpublish_volume(unpublish_req(&v, &target)).await, "unpublish")?;
            ensure!(!target.exists(), "target path not removed");
            Ok(())
        }),
        case!("NodeStageVolume should fail when no volume id is provided", |ctx| {
            let r = NodeStageVolumeRequest {
                staging_target_path: ctx.staging.display().to_string(),
                volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
                ..Default::default()
            };
            expect_code(ctx.c.node.clone().node_stage_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeStageVolume should fail when no staging target path is provided", |ctx| {
            let r = NodeStageVolumeRequest {
                volume_id: "some-vol".into(),
                volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
                ..Default::default()
            };
            expect_code(ctx.c.node.clone().node_stage_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeStageVolume should fail when no volume capability is provided", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-node-stage-nocaps"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = NodeStageVolumeRequest {
                volume_id: v.volume_id,
                staging_target_path: ctx.staging.display().to_string(),
                ..Default::default()
            };
            expect_code(ctx.c.node.clone().node_stage_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeUnstageVolume should fail when no volume id is provided", |ctx| {
            let r = NodeUnstageVolumeRequest { staging_target_path: ctx.staging.display().to_string(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_unstage_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeUnstageVolume should fail when no staging target path is provided", |ctx| {
            let r = NodeUnstageVolumeRequest { volume_id: "some-vol".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_unstage_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeGetVolumeStats should fail when no volume id is provided", |ctx| {
            let r = NodeGetVolumeStatsRequest { volume_path: "some/path".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_get_volume_stats(r).await, Code::InvalidArgument)
        }),
        case!("NodeGetVolumeStats should fail when no volume path is provided", |ctx| {
            let r = NodeGetVolumeStatsRequest { volume_id: "some-vol".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_get_volume_stats(r).await, Code::InvalidArgument)
        }),
        case!("NodeGetVolumeStats should fail when volume is not found", |ctx| {
            let r = NodeGetVolumeStatsRequest { volume_id: ctx.unique("some-vol"), volume_path: "some/path".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_get_volume_stats(r).await, Code::NotFound)
        }),
        case!("NodeGetVolumeStats should fail when volume does not exist on the specified path", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-node-get-volume-stats"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            ctx.stage(&v, Mode::SingleNodeWriter).await?;
            ctx.publish(&v, &ctx.target(), Mode::SingleNodeWriter).await?;
            let r = NodeGetVolumeStatsRequest { volume_id: v.volume_id, volume_path: "some/path".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_get_volume_stats(r).await, Code::NotFound)
        }),
        case!("NodeExpandVolume should fail when no volume id is provided", |ctx| {
            let r = NodeExpandVolumeRequest {
                volume_path: ctx.target_dir.display().to_string(),
                volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
                ..Default::default()
            };
            expect_code(ctx.c.node.clone().node_expand_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeExpandVolume should fail when no volume path is provided", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-node-expand-volume-valid-id"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = NodeExpandVolumeRequest {
                volume_id: v.volume_id,
                volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
                ..Default::default()
            };
            expect_code(ctx.c.node.clone().node_expand_volume(r).await, Code::InvalidArgument)
        }),
        case!("NodeExpandVolume should fail when volume is not found", |ctx| {
            let r = NodeExpandVolumeRequest { volume_id: ctx.unique("some-vol"), volume_path: "some/path".into(), ..Default::default() };
            expect_code(ctx.c.node.clone().node_expand_volume(r).await, Code::NotFound)
        }),
        case!("NodeExpandVolume should work if node-expand is called after node-publish", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-node-expand-volume"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            let r = ControllerExpandVolumeRequest {
                volume_id: v.volume_id.clone(),
                capacity_range: Some(CapacityRange { required_bytes: EXPAND_SIZE, limit_bytes: 0 }),
                ..Default::default()
            };
            let r = ok(ctx.c.controller.clone().controller_expand_volume(r).await, "controller expand")?.into_inner();
            ensure!(r.capacity_bytes == EXPAND_SIZE, "capacity {}", r.capacity_bytes);
            ctx.stage(&v, Mode::SingleNodeWriter).await?;
            ctx.publish(&v, &ctx.target(), Mode::SingleNodeWriter).await?;
            let r = NodeExpandVolumeRequest {
                volume_id: v.volume_id,
                volume_path: ctx.target().display().to_string(),
                capacity_range: Some(CapacityRange { required_bytes: EXPAND_SIZE, limit_bytes: 0 }),
                ..Default::default()
            };
            ok(ctx.c.node.clone().node_expand_volume(r).await, "node expand").map(|_| ())
        }),
        case!("Node Service should work", |ctx| { run_lifecycle(&ctx, 1).await }),
        case!("Node Service should be idempotent", |ctx| { run_lifecycle(&ctx, 10).await }),
        case!("Controller volume lifecycle should work and be idempotent", |ctx| {
            let v = ctx.create(&ctx.unique("sanity-controller-publish"), TEST_SIZE, Mode::SingleNodeWriter).await?;
            for _ in 0..2 {
                let r = ControllerPublishVolumeRequest {
                    volume_id: v.volume_id.clone(),
                    node_id: "test-node".into(),
                    volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
                    volume_context: v.volume_context.clone(),
                    ..Default::default()
                };
                ok(ctx.c.controller.clone().controller_publish_volume(r).await, "publish")?;
            }
            for _ in 0..2 {
                let r = ControllerUnpublishVolumeRequest { volume_id: v.volume_id.clone(), node_id: "test-node".into(), ..Default::default() };
                ok(ctx.c.controller.clone().controller_unpublish_volume(r).await, "unpublish")?;
            }
            Ok(())
        }),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn csi_sanity_cases() {
    let mut weed = common::WeedServer::start();
    let driver = Driver::start(&weed.filer_addr(), &[]);
    let c = driver.clients().await;
    let serial = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let all = cases();
    let total = all.len();
    let mut failed = Vec::new();
    for (i, (name, run)) in all.into_iter().enumerate() {
        // Like csi-sanity: the staging dir and the target's parent exist, the target does not.
        let base = driver.path(&format!("sanity/{i}"));
        let ctx = Ctx {
            c: c.clone(),
            staging: base.join("staging"),
            target_dir: base.join("mount"),
            reg: Arc::new(Mutex::new(Registry::default())),
            serial: serial.clone(),
        };
        std::fs::create_dir_all(&ctx.staging).unwrap();
        std::fs::create_dir_all(&ctx.target_dir).unwrap();
        let outcome =
            tokio::time::timeout(std::time::Duration::from_secs(120), run(ctx.clone())).await;
        let outcome = match outcome {
            Ok(r) => r,
            Err(_) => Err("timed out".into()),
        };
        let cleanup = ctx.cleanup().await;
        let left = mounts_below(&base);
        let outcome = outcome.and(cleanup).and(if left.is_empty() {
            Ok(())
        } else {
            Err(format!("mounts left behind: {left:?}"))
        });
        match outcome {
            Ok(()) => eprintln!("[PASS] {name}"),
            Err(e) => {
                eprintln!("[FAIL] {name}: {e}");
                failed.push(format!("{name}: {e}"));
            }
        }
    }
    eprintln!(
        "csi sanity: {} of {total} cases passed",
        total - failed.len()
    );

    // Probe tracks the filer: not ready while it is down, ready again after.
    let mut identity = c.identity.clone();
    weed.stop_filer();
    let r = identity.probe(ProbeRequest {}).await.unwrap().into_inner();
    if r.ready != Some(false) {
        failed.push(format!("Probe with the filer down: {r:?}"));
    }
    weed.start_filer();
    let mut ready = false;
    for _ in 0..50 {
        if identity
            .probe(ProbeRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready
            == Some(true)
        {
            ready = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    if !ready {
        failed.push("Probe not ready after the filer came back".into());
    }
    assert!(
        driver.mounts().is_empty(),
        "mounts left: {:?}",
        driver.mounts()
    );
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}
