//! CSI Controller service: a volume is a directory on the filer.
//!
//! Stateless like the Go driver: the volume id is the directory's full filer path, the volume
//! context carries the StorageClass parameters. The requested capacity is also recorded in an
//! extended attribute of the directory so a repeated CreateVolume with a different size can be
//! refused (ALREADY_EXISTS) as the CSI spec asks.

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

/// Extended attribute of a volume directory holding its capacity in bytes (decimal). Not
/// prefixed with `xattr-`, so FUSE clients do not list it as a user xattr.
pub const CAPACITY_XATTR: &str = "seaweedfs-csi.capacity";

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
        FilerError::InvalidArgument(_) | FilerError::NameTooLong(_) => Status::invalid_argument(msg),
        FilerError::Unavailable(_) => Status::unavailable(msg),
        FilerError::Timeout(_) => Status::deadline_exceeded(msg),
        _ => Status::internal(msg),
    }
}

async fn call<T>(op: &str, fut: impl Future<Output = Result<T, FilerError>>) -> Result<T, FilerError> {
    match tokio::time::timeout(FILER_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => Err(FilerError::Timeout(format!("{op} took longer than {FILER_TIMEOUT:?}"))),
    }
}

fn now_secs() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

fn stored_capacity(entry: &fpb::Entry) -> Option<i64> {
    entry.extended.get(CAPACITY_XATTR).and_then(|v| std::str::from_utf8(v).ok()).and_then(|s| s.parse().ok())
}

/// Validated capacity range: (required, limit), 0 = unset.
fn capacity_range(r: Option<&CapacityRange>) -> Result<(i64, i64), Status> {
    let Some(r) = r else { return Ok((0, 0)) };
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(Status::invalid_argument("capacity_range values must not be negative"));
    }
    if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes {
        return Err(Status::invalid_argument("capacity_range.required_bytes exceeds limit_bytes"));
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
        ControllerService { filer, config, locks: KeyedLocks::new() }
    }

    /// The directory entry of a volume, or NOT_FOUND.
    async fn lookup_dir(&self, path: &str) -> Result<fpb::Entry, Status> {
        let (dir, name) = params::split_path(path);
        if name.is_empty() {
            return Err(Status::invalid_argument(format!("volume path {path:?} names the filer root")));
        }
        match call("lookup", self.filer.lookup_entry(&dir, &name)).await {
            Ok(e) if e.is_directory => Ok(e),
            Ok(_) => Err(Status::not_found(format!("{path} exists but is not a directory"))),
            Err(FilerError::NotFound(_)) => Err(Status::not_found(format!("volume {path} does not exist"))),
            Err(e) => Err(filer_status("lookup volume", e)),
        }
    }

    async fn mkdir(&self, loc: &params::VolumeLocation, capacity: i64) -> Result<(), FilerError> {
        let now = now_secs();
        let mut extended = HashMap::new();
        if capacity > 0 {
            extended.insert(CAPACITY_XATTR.to_string(), capacity.to_string().into_bytes());
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
        call("create", self.filer.create_entry(req)).await.map(|_| ())
    }

    async fn set_capacity(&self, path: &str, mut entry: fpb::Entry, capacity: i64) -> Result<(), FilerError> {
        let (dir, _) = params::split_path(path);
        entry.extended.insert(CAPACITY_XATTR.to_string(), capacity.to_string().into_bytes());
        let req = fpb::UpdateEntryRequest {
            directory: dir,
            entry: Some(entry),
            signatures: vec![self.filer.signature()],
            ..Default::default()
        };
        call("update", self.filer.update_entry(req)).await.map(|_| ())
    }

    /// Deletes a directory's children one page at a time, then the directory. Children first
    /// because deleting a bucket directory only drops the collection named like the bucket, so
    /// chunks of a custom `collection` would otherwise leak.
    async fn delete_tree(&self, path: &str) -> Result<(), FilerError> {
        const PAGE: u32 = 1000;
        let mut previous_first: Option<String> = None;
        loop {
            let page = call("list", self.filer.list_page(path, "", false, PAGE)).await?;
            let Some(first) = page.first().map(|e| e.name.clone()) else { break };
            if previous_first.as_deref() == Some(first.as_str()) {
                return Err(FilerError::Other(format!("deleting {path}/{first} makes no progress")));
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
        call("delete", self.filer.delete_entry(req)).await.map(|_| ())
    }
}

fn rpc_cap(t: rpc::Type) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(controller_service_capability::Type::Rpc(controller_service_capability::Rpc {
            r#type: t as i32,
        })),
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
            return Err(Status::invalid_argument("volume content sources (snapshots, clones) are not supported"));
        }
        let (required, limit) = capacity_range(req.capacity_range.as_ref())?;
        let capacity = if required > 0 { required } else { limit };

        let mut ctx = req.parameters.clone();
        let loc = params::new_volume_location(&req.name, &ctx).map_err(|e| Status::invalid_argument(e.to_string()))?;
        ctx.insert(KEY_PARENT_DIR.to_string(), loc.parent_dir.clone());
        ctx.insert(KEY_VOLUME_NAME.to_string(), loc.name.clone());
        if capacity > 0 {
            ctx.insert(KEY_VOLUME_CAPACITY.to_string(), capacity.to_string());
        }

        let _guard = self.locks.lock(&loc.path).await;
        let capacity_bytes = match call("lookup", self.filer.lookup_entry(&loc.parent_dir, &loc.name)).await {
            Ok(existing) => {
                if !existing.is_directory {
                    return Err(Status::already_exists(format!("{} exists and is not a directory", loc.path)));
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
            .map(|t| if !t.requisite.is_empty() { t.requisite } else { t.preferred })
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
            return Err(Status::invalid_argument(format!("refusing to delete the filer directory {path}")));
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
                return Err(Status::failed_precondition(format!("{path} is not a volume directory")));
            }
            Ok(_) => {}
        }
        self.delete_tree(&path).await.map_err(|e| filer_status("delete volume", e))?;
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
        Ok(Response::new(ControllerPublishVolumeResponse { publish_context: HashMap::new() }))
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
                return Ok(Response::new(ValidateVolumeCapabilitiesResponse { confirmed: None, message: reason }));
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
        Ok(Response::new(ControllerGetCapabilitiesResponse { capabilities }))
    }

    /// Records the new capacity; the node applies it as the quota (NodeExpandVolume).
    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        let range = req.capacity_range.as_ref().ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
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
            self.set_capacity(&path, entry, capacity).await.map_err(|e| filer_status("record capacity", e))?;
        }
        tracing::info!(volume_id = %req.volume_id, capacity, "volume expanded");
        Ok(Response::new(ControllerExpandVolumeResponse { capacity_bytes: capacity, node_expansion_required: true }))
    }
}
