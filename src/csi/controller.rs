//! CSI Controller service: a volume is a directory on the filer.
//!
//! Stateless like the Go driver: the volume id is the directory's full filer path, the volume
//! context carries the StorageClass parameters. The requested capacity is also recorded in an
//! extended attribute of the directory so a repeated CreateVolume with a different size can be
//! refused (ALREADY_EXISTS) as the CSI spec asks.
//!
//! Over 800 lines: one file per CSI service (the controller), and its unit tests.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tonic::{Request, Response, Status};

use super::params::{self, KEY_PARENT_DIR, KEY_VOLUME_CAPACITY, KEY_VOLUME_NAME};
use super::{check_capability, require_capability, require_field, KeyedLocks};
use crate::filer::{FilerApi, FilerError};
use crate::pb::csi::controller_server::Controller;
use crate::pb::csi::controller_service_capability::{self, rpc};
use crate::pb::csi::validate_volume_capabilities_response::Confirmed;
use crate::pb::csi::*;
use crate::pb::filer as fpb;

/// Extended attribute of a volume directory holding its capacity in bytes; every staged
/// session enforces it as the quota (`crate::fs::CAPACITY_XATTR`).
pub use crate::fs::CAPACITY_XATTR;

/// Go's `os.ModeDir`, as the filer stores directory modes.
const GO_MODE_DIR: u32 = 1 << 31;

/// Filer paths DeleteVolume refuses to remove even when a (static) PV names them.
const PROTECTED_PATHS: &[&str] = &["/", "/buckets", "/etc", "/topics"];

/// Per filer call.
const FILER_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// `--attacher`: advertise PUBLISH_UNPUBLISH_VOLUME (ControllerPublish is a no-op check).
    pub attacher: bool,
}

pub struct ControllerService {
    filer: Arc<dyn FilerApi>,
    config: ControllerConfig,
    locks: KeyedLocks,
}

fn filer_status(op: &str, e: FilerError) -> Status {
    let msg = format!("{op}: {e}");
    match e {
        FilerError::NotFound(_) => Status::not_found(msg),
        FilerError::AlreadyExists(_) => Status::already_exists(msg),
        FilerError::InvalidArgument(_) | FilerError::NameTooLong(_) => {
            Status::invalid_argument(msg)
        }
        FilerError::Unavailable(_) => Status::unavailable(msg),
        FilerError::Timeout(_) => Status::deadline_exceeded(msg),
        _ => Status::internal(msg),
    }
}

async fn call<T>(
    op: &str,
    fut: impl Future<Output = Result<T, FilerError>>,
) -> Result<T, FilerError> {
    match tokio::time::timeout(FILER_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => Err(FilerError::Timeout(format!(
            "{op} took longer than {FILER_TIMEOUT:?}"
        ))),
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn stored_capacity(entry: &fpb::Entry) -> Option<i64> {
    entry
        .extended
        .get(CAPACITY_XATTR)
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|s| s.parse().ok())
}

/// Validated capacity range: (required, limit), 0 = unset.
fn capacity_range(r: Option<&CapacityRange>) -> Result<(i64, i64), Status> {
    let Some(r) = r else { return Ok((0, 0)) };
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(Status::invalid_argument(
            "capacity_range values must not be negative",
        ));
    }
    if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes {
        return Err(Status::invalid_argument(
            "capacity_range.required_bytes exceeds limit_bytes",
        ));
    }
    Ok((r.required_bytes, r.limit_bytes))
}

/// The directory of a volume id: absolute ids are paths, legacy ids live in /buckets.
fn volume_dir(volume_id: &str) -> String {
    if volume_id.starts_with('/') {
        params::clean_path(volume_id)
    } else {
        format!("{}/{}", params::BUCKETS_DIR, volume_id)
    }
}

impl ControllerService {
    pub fn new(filer: Arc<dyn FilerApi>, config: ControllerConfig) -> Self {
        ControllerService {
            filer,
            config,
            locks: KeyedLocks::new(),
        }
    }

    /// The directory entry of a volume, or NOT_FOUND.
    async fn lookup_dir(&self, path: &str) -> Result<fpb::Entry, Status> {
        let (dir, name) = params::split_path(path);
        if name.is_empty() {
            return Err(Status::invalid_argument(format!(
                "volume path {path:?} names the filer root"
            )));
        }
        match call("lookup", self.filer.lookup_entry(&dir, &name)).await {
            Ok(e) if e.is_directory => Ok(e),
            Ok(_) => Err(Status::not_found(format!(
                "{path} exists but is not a directory"
            ))),
            Err(FilerError::NotFound(_)) => {
                Err(Status::not_found(format!("volume {path} does not exist")))
            }
            Err(e) => Err(filer_status("lookup volume", e)),
        }
    }

    async fn mkdir(&self, loc: &params::VolumeLocation, capacity: i64) -> Result<(), FilerError> {
        let now = now_secs();
        let mut extended = HashMap::new();
        if capacity > 0 {
            extended.insert(
                CAPACITY_XATTR.to_string(),
                capacity.to_string().into_bytes(),
            );
        }
        let entry = fpb::Entry {
            name: loc.name.clone(),
            is_directory: true,
            attributes: Some(fpb::FuseAttributes {
                mtime: now,
                crtime: now,
                file_mode: GO_MODE_DIR | 0o777,
                ..Default::default()
            }),
            extended,
            ..Default::default()
        };
        let req = fpb::CreateEntryRequest {
            directory: loc.parent_dir.clone(),
            entry: Some(entry),
            o_excl: true,
            signatures: vec![self.filer.signature()],
            ..Default::default()
        };
        call("create", self.filer.create_entry(req))
            .await
            .map(|_| ())
    }

    async fn set_capacity(
        &self,
        path: &str,
        mut entry: fpb::Entry,
        capacity: i64,
    ) -> Result<(), FilerError> {
        let (dir, _) = params::split_path(path);
        entry.extended.insert(
            CAPACITY_XATTR.to_string(),
            capacity.to_string().into_bytes(),
        );
        let req = fpb::UpdateEntryRequest {
            directory: dir,
            entry: Some(entry),
            signatures: vec![self.filer.signature()],
            ..Default::default()
        };
        call("update", self.filer.update_entry(req))
            .await
            .map(|_| ())
    }

    /// Deletes a directory's children one page at a time, then the directory. Children first
    /// because deleting a bucket directory only drops the collection named like the bucket, so
    /// chunks of a custom `collection` would otherwise leak.
    async fn delete_tree(&self, path: &str) -> Result<(), FilerError> {
        const PAGE: u32 = 1000;
        let mut previous_first: Option<String> = None;
        loop {
            let page = call("list", self.filer.list_page(path, "", false, PAGE)).await?;
            let Some(first) = page.first().map(|e| e.name.clone()) else {
                break;
            };
            if previous_first.as_deref() == Some(first.as_str()) {
                return Err(FilerError::Other(format!(
                    "deleting {path}/{first} makes no progress"
                )));
            }
            previous_first = Some(first);
            for child in page {
                let req = fpb::DeleteEntryRequest {
                    directory: path.to_string(),
                    name: child.name.clone(),
                    is_delete_data: true,
                    is_recursive: true,
                    ignore_recursive_error: true,
                    signatures: vec![self.filer.signature()],
                    ..Default::default()
                };
                call("delete child", self.filer.delete_entry(req)).await?;
            }
        }
        let (dir, name) = params::split_path(path);
        let req = fpb::DeleteEntryRequest {
            directory: dir,
            name,
            is_delete_data: true,
            is_recursive: true,
            ignore_recursive_error: true,
            signatures: vec![self.filer.signature()],
            ..Default::default()
        };
        call("delete", self.filer.delete_entry(req))
            .await
            .map(|_| ())
    }
}

fn rpc_cap(t: rpc::Type) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(controller_service_capability::Type::Rpc(
            controller_service_capability::Rpc { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.name, "name")?;
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        for cap in &req.volume_capabilities {
            check_capability(cap).map_err(Status::invalid_argument)?;
        }
        if req.volume_content_source.is_some() {
            return Err(Status::invalid_argument(
                "volume content sources (snapshots, clones) are not supported",
            ));
        }
        let (required, limit) = capacity_range(req.capacity_range.as_ref())?;
        let capacity = if required > 0 { required } else { limit };

        let mut ctx = req.parameters.clone();
        let loc = params::new_volume_location(&req.name, &ctx)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        ctx.insert(KEY_PARENT_DIR.to_string(), loc.parent_dir.clone());
        ctx.insert(KEY_VOLUME_NAME.to_string(), loc.name.clone());
        if capacity > 0 {
            ctx.insert(KEY_VOLUME_CAPACITY.to_string(), capacity.to_string());
        }

        let _guard = self.locks.lock(&loc.path).await;
        let capacity_bytes = match call(
            "lookup",
            self.filer.lookup_entry(&loc.parent_dir, &loc.name),
        )
        .await
        {
            Ok(existing) => {
                if !existing.is_directory {
                    return Err(Status::already_exists(format!(
                        "{} exists and is not a directory",
                        loc.path
                    )));
                }
                match stored_capacity(&existing) {
                    Some(have) if have < required || (limit > 0 && have > limit) => {
                        return Err(Status::already_exists(format!(
                            "volume {} already exists with capacity {have} bytes, incompatible with the requested range",
                            loc.path
                        )));
                    }
                    Some(have) => have,
                    None => capacity,
                }
            }
            Err(FilerError::NotFound(_)) => {
                match self.mkdir(&loc, capacity).await {
                    Ok(()) | Err(FilerError::AlreadyExists(_)) => {}
                    Err(e) => return Err(filer_status("create volume directory", e)),
                }
                tracing::info!(name = %req.name, path = %loc.path, capacity, "volume created");
                capacity
            }
            Err(e) => return Err(filer_status("look up volume directory", e)),
        };
        if capacity_bytes > 0 {
            ctx.insert(KEY_VOLUME_CAPACITY.to_string(), capacity_bytes.to_string());
        }

        let accessible_topology = req
            .accessibility_requirements
            .map(|t| {
                if !t.requisite.is_empty() {
                    t.requisite
                } else {
                    t.preferred
                }
            })
            .unwrap_or_default();
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes,
                volume_id: loc.path,
                volume_context: ctx,
                content_source: None,
                accessible_topology,
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        let path = volume_dir(&req.volume_id);
        if PROTECTED_PATHS.contains(&path.as_str()) {
            return Err(Status::invalid_argument(format!(
                "refusing to delete the filer directory {path}"
            )));
        }
        let _guard = self.locks.lock(&path).await;
        let (dir, name) = params::split_path(&path);
        match call("lookup", self.filer.lookup_entry(&dir, &name)).await {
            Err(FilerError::NotFound(_)) => {
                tracing::info!(volume_id = %req.volume_id, "volume already gone");
                return Ok(Response::new(DeleteVolumeResponse {}));
            }
            Err(e) => return Err(filer_status("look up volume directory", e)),
            Ok(e) if !e.is_directory => {
                return Err(Status::failed_precondition(format!(
                    "{path} is not a volume directory"
                )));
            }
            Ok(_) => {}
        }
        self.delete_tree(&path)
            .await
            .map_err(|e| filer_status("delete volume", e))?;
        tracing::info!(volume_id = %req.volume_id, path = %path, "volume deleted");
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    /// Nothing to attach: validates and confirms the volume exists (for csi-attacher).
    async fn controller_publish_volume(
        &self,
        request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        require_field(&req.node_id, "node_id")?;
        require_capability(req.volume_capability.as_ref())?;
        let path = params::filer_path_for(&req.volume_id, &req.volume_context);
        self.lookup_dir(&path).await?;
        Ok(Response::new(ControllerPublishVolumeResponse {
            publish_context: HashMap::new(),
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        Ok(Response::new(ControllerUnpublishVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        let path = params::filer_path_for(&req.volume_id, &req.volume_context);
        self.lookup_dir(&path).await?;
        for cap in &req.volume_capabilities {
            if let Err(reason) = check_capability(cap) {
                return Ok(Response::new(ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: reason,
                }));
            }
        }
        Ok(Response::new(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: req.mutable_parameters,
            }),
            message: String::new(),
        }))
    }

    async fn list_volumes(
        &self,
        _request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        Err(Status::unimplemented("ListVolumes is not supported"))
    }

    async fn get_capacity(
        &self,
        _request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        Err(Status::unimplemented("GetCapacity is not supported"))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        let mut capabilities = vec![
            rpc_cap(rpc::Type::CreateDeleteVolume),
            rpc_cap(rpc::Type::ExpandVolume),
            rpc_cap(rpc::Type::SingleNodeMultiWriter),
        ];
        if self.config.attacher {
            capabilities.push(rpc_cap(rpc::Type::PublishUnpublishVolume));
        }
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    /// Records the new capacity; the node applies it as the quota (NodeExpandVolume).
    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
        let (required, limit) = capacity_range(Some(range))?;
        if let Some(cap) = req.volume_capability.as_ref() {
            check_capability(cap).map_err(Status::invalid_argument)?;
        }
        let capacity = if required > 0 { required } else { limit };
        let path = volume_dir(&req.volume_id);
        let _guard = self.locks.lock(&path).await;
        let entry = match self.lookup_dir(&path).await {
            Ok(e) => e,
            // A relative id may be a static PV whose real path is only in its volume context,
            // which this RPC does not carry: nothing to record, the node applies the quota.
            Err(s) if s.code() == tonic::Code::NotFound && !req.volume_id.starts_with('/') => {
                return Ok(Response::new(ControllerExpandVolumeResponse {
                    capacity_bytes: capacity,
                    node_expansion_required: true,
                }));
            }
            Err(s) => return Err(s),
        };
        if capacity > 0 && stored_capacity(&entry) != Some(capacity) {
            self.set_capacity(&path, entry, capacity)
                .await
                .map_err(|e| filer_status("record capacity", e))?;
        }
        tracing::info!(volume_id = %req.volume_id, capacity, "volume expanded");
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: capacity,
            node_expansion_required: true,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filer::mock::MockFiler;
    use crate::pb::csi::volume_capability::access_mode::Mode;
    use crate::pb::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};

    fn mount_cap(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    fn service(filer: &MockFiler) -> ControllerService {
        ControllerService::new(
            Arc::new(filer.clone()),
            ControllerConfig { attacher: false },
        )
    }

    fn create_req(
        name: &str,
        required: i64,
        limit: i64,
        params: &[(&str, &str)],
    ) -> CreateVolumeRequest {
        CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            volume_capabilities: vec![mount_cap(Mode::MultiNodeMultiWriter)],
            parameters: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    async fn create(svc: &ControllerService, req: CreateVolumeRequest) -> Result<Volume, Status> {
        svc.create_volume(Request::new(req))
            .await
            .map(|r| r.into_inner().volume.unwrap())
    }

    fn put_file(filer: &MockFiler, dir: &str, name: &str) {
        let req = fpb::CreateEntryRequest {
            directory: dir.into(),
            entry: Some(fpb::Entry {
                name: name.into(),
                attributes: Some(fpb::FuseAttributes {
                    file_mode: 0o644,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        futures::executor::block_on(filer.create_entry(req)).unwrap();
    }

    #[tokio::test]
    async fn create_is_idempotent_and_checks_capacity() {
        let filer = MockFiler::new();
        let svc = service(&filer);
        let v = create(
            &svc,
            create_req("PVC-A", 1 << 30, 0, &[("collection", "c1")]),
        )
        .await
        .unwrap();
        assert_eq!(v.volume_id, "/buckets/pvc-a");
        assert_eq!(v.capacity_bytes, 1 << 30);
        assert_eq!(v.volume_context["collection"], "c1");
        assert_eq!(v.volume_context["parentDir"], "/buckets");
        assert_eq!(v.volume_context["volumeName"], "pvc-a");
        assert_eq!(v.volume_context["volumeCapacity"], (1i64 << 30).to_string());
        let e = filer.get("/buckets/pvc-a").expect("directory created");
        assert!(e.is_directory);
        assert_eq!(e.attributes.unwrap().file_mode, GO_MODE_DIR | 0o777);
        assert_eq!(
            stored_capacity(&filer.get("/buckets/pvc-a").unwrap()),
            Some(1 << 30)
        );

        let again = create(
            &svc,
            create_req("PVC-A", 1 << 30, 0, &[("collection", "c1")]),
        )
        .await
        .unwrap();
        assert_eq!(again.volume_id, v.volume_id);
        let err = create(&svc, create_req("PVC-A", 2 << 30, 0, &[]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::AlreadyExists);
        let err = create(&svc, create_req("PVC-A", 1, 1 << 20, &[]))
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            tonic::Code::AlreadyExists,
            "existing volume larger than the limit"
        );
        // A smaller request fits in the existing volume.
        assert_eq!(
            create(&svc, create_req("PVC-A", 1 << 20, 0, &[]))
                .await
                .unwrap()
                .capacity_bytes,
            1 << 30
        );
    }

    #[tokio::test]
    async fn create_names_and_argument_checks() {
        let filer = MockFiler::new();
        let svc = service(&filer);
        let v = create(&svc, create_req("n", 0, 0, &[("path", "/data/team/x")]))
            .await
            .unwrap();
        assert_eq!(v.volume_id, "/data/team/x");
        assert_eq!(v.capacity_bytes, 0);
        assert!(!v.volume_context.contains_key("volumeCapacity"));
        assert!(filer.get("/data/team/x").is_some());
        let v = create(
            &svc,
            create_req("Keep_Case", 0, 0, &[("parentDir", "/vols")]),
        )
        .await
        .unwrap();
        assert_eq!(v.volume_id, "/vols/Keep_Case");

        let code = |r: Result<Volume, Status>| r.unwrap_err().code();
        assert_eq!(
            code(create(&svc, create_req("", 0, 0, &[])).await),
            tonic::Code::InvalidArgument
        );
        let mut no_caps = create_req("x", 0, 0, &[]);
        no_caps.volume_capabilities.clear();
        assert_eq!(
            code(create(&svc, no_caps).await),
            tonic::Code::InvalidArgument
        );
        let mut block = create_req("x", 0, 0, &[]);
        block.volume_capabilities[0].access_type = Some(AccessType::Block(BlockVolume {}));
        let err = create(&svc, block).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("block"));
        assert_eq!(
            code(create(&svc, create_req("x", 10, 5, &[])).await),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            code(create(&svc, create_req("x", 0, 0, &[("path", "rel")])).await),
            tonic::Code::InvalidArgument
        );
        // A file where the volume should be.
        put_file(&filer, "/buckets", "taken");
        assert_eq!(
            code(create(&svc, create_req("taken", 0, 0, &[])).await),
            tonic::Code::AlreadyExists
        );
        filer.fail_next(1);
        assert_eq!(
            code(create(&svc, create_req("later", 0, 0, &[])).await),
            tonic::Code::Unavailable
        );
    }

    #[tokio::test]
    async fn delete_removes_children_first_then_the_directory() {
        let filer = MockFiler::new();
        let svc = service(&filer);
        let v = create(&svc, create_req("pvc-del", 0, 0, &[]))
            .await
            .unwrap();
        for i in 0..5 {
            put_file(&filer, &v.volume_id, &format!("f{i}"));
        }
        put_file(&filer, &format!("{}/sub/deeper", v.volume_id), "g");
        let before = filer.calls("delete_entry");
        svc.delete_volume(Request::new(DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
        assert!(
            filer
                .paths()
                .iter()
                .all(|p| !p.starts_with("/buckets/pvc-del")),
            "{:?}",
            filer.paths()
        );
        // 6 children (5 files + sub) one by one, then the directory itself.
        assert_eq!(filer.calls("delete_entry") - before, 7);
        // Idempotent; legacy (relative) ids live under /buckets.
        svc.delete_volume(Request::new(DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
        create(&svc, create_req("legacy", 0, 0, &[])).await.unwrap();
        svc.delete_volume(Request::new(DeleteVolumeRequest {
            volume_id: "legacy".into(),
            ..Default::default()
        }))
        .await
        .unwrap();
        assert!(filer.get("/buckets/legacy").is_none());
        for bad in ["", "/", "/buckets", "/etc/", "/topics"] {
            let err = svc
                .delete_volume(Request::new(DeleteVolumeRequest {
                    volume_id: bad.into(),
                    ..Default::default()
                }))
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn validate_publish_expand() {
        let filer = MockFiler::new();
        let svc =
            ControllerService::new(Arc::new(filer.clone()), ControllerConfig { attacher: true });
        let v = create(&svc, create_req("pvc-v", 1000, 0, &[]))
            .await
            .unwrap();
        let all: Vec<VolumeCapability> = super::super::SUPPORTED_ACCESS_MODES
            .iter()
            .map(|m| mount_cap(*m))
            .collect();
        let r = svc
            .validate_volume_capabilities(Request::new(ValidateVolumeCapabilitiesRequest {
                volume_id: v.volume_id.clone(),
                volume_capabilities: all.clone(),
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.confirmed.unwrap().volume_capabilities.len(), 7);
        let mut block = mount_cap(Mode::SingleNodeWriter);
        block.access_type = Some(AccessType::Block(BlockVolume {}));
        let r = svc
            .validate_volume_capabilities(Request::new(ValidateVolumeCapabilitiesRequest {
                volume_id: v.volume_id.clone(),
                volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter), block],
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
        assert!(r.confirmed.is_none());
        assert!(r.message.contains("block"), "{}", r.message);
        let err = svc
            .validate_volume_capabilities(Request::new(ValidateVolumeCapabilitiesRequest {
                volume_id: "/buckets/missing".into(),
                volume_capabilities: all.clone(),
                ..Default::default()
            }))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);

        let publish = |id: &str| ControllerPublishVolumeRequest {
            volume_id: id.into(),
            node_id: "n1".into(),
            volume_capability: Some(mount_cap(Mode::SingleNodeWriter)),
            ..Default::default()
        };
        svc.controller_publish_volume(Request::new(publish(&v.volume_id)))
            .await
            .unwrap();
        let err = svc
            .controller_publish_volume(Request::new(publish("/buckets/nope")))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);

        let expand = |id: &str, bytes: i64| ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            ..Default::default()
        };
        let r = svc
            .controller_expand_volume(Request::new(expand(&v.volume_id, 5000)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.capacity_bytes, r.node_expansion_required), (5000, true));
        assert_eq!(
            stored_capacity(&filer.get(&v.volume_id).unwrap()),
            Some(5000)
        );
        // The new size is what a repeated CreateVolume now compares against.
        assert_eq!(
            create(&svc, create_req("pvc-v", 5000, 0, &[]))
                .await
                .unwrap()
                .capacity_bytes,
            5000
        );
        let err = svc
            .controller_expand_volume(Request::new(expand("/buckets/nope", 1)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);
        svc.controller_expand_volume(Request::new(expand("static-handle", 1)))
            .await
            .unwrap();
        let err = svc
            .controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
                volume_id: v.volume_id.clone(),
                ..Default::default()
            }))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);

        let caps = svc
            .controller_get_capabilities(Request::new(ControllerGetCapabilitiesRequest {}))
            .await
            .unwrap()
            .into_inner()
            .capabilities;
        assert_eq!(caps.len(), 4, "attacher adds PUBLISH_UNPUBLISH_VOLUME");
        let caps = service(&filer)
            .controller_get_capabilities(Request::new(ControllerGetCapabilitiesRequest {}))
            .await
            .unwrap()
            .into_inner()
            .capabilities;
        assert_eq!(caps.len(), 3);
    }
}
