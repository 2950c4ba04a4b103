//! CSI Identity service.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::filer::FilerApi;
use crate::pb::csi::identity_server::Identity;
use crate::pb::csi::plugin_capability::{self, service, volume_expansion};
use crate::pb::csi::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};

/// How long Probe waits for the filer before answering "not ready".
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

pub struct IdentityService {
    name: String,
    filer: Arc<dyn FilerApi>,
    probe_timeout: Duration,
    topology: bool,
}

impl IdentityService {
    /// `topology`: advertise VOLUME_ACCESSIBILITY_CONSTRAINTS (only when topology is configured).
    pub fn new(name: impl Into<String>, filer: Arc<dyn FilerApi>, topology: bool) -> Self {
        IdentityService {
            name: name.into(),
            filer,
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
            topology,
        }
    }

    pub fn with_probe_timeout(mut self, t: Duration) -> Self {
        self.probe_timeout = t;
        self
    }
}

fn service_cap(t: service::Type) -> PluginCapability {
    PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _req: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.name.clone(),
            vendor_version: super::VENDOR_VERSION.to_string(),
            manifest: HashMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        // Like the Go driver, CONTROLLER_SERVICE is advertised by every instance: node-only and
        // controller-only processes register under the same driver name.
        let mut capabilities = vec![
            service_cap(service::Type::ControllerService),
            PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(
                    plugin_capability::VolumeExpansion {
                        r#type: volume_expansion::Type::Online as i32,
                    },
                )),
            },
        ];
        if self.topology {
            capabilities.push(service_cap(service::Type::VolumeAccessibilityConstraints));
        }
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    /// Ready when the filer answers `GetFilerConfiguration` within the probe timeout.
    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let ready = match tokio::time::timeout(self.probe_timeout, self.filer.configuration()).await
        {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "probe: filer not reachable");
                false
            }
            Err(_) => {
                tracing::warn!(timeout = ?self.probe_timeout, "probe: filer did not answer in time");
                false
            }
        };
        Ok(Response::new(ProbeResponse { ready: Some(ready) }))
    }
}
