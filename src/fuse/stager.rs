//! The real [`Stager`]: one in-process FUSE session per staged volume.

use super::session::{MountError, MountedVolume};
use crate::config::MountOptions;
use crate::csi::stager::{StageError, Stager, VolumeHealth};
use crate::filer::FilerError;
use crate::security::SecurityConfig;
use async_trait::async_trait;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::Ordering;

pub struct FuseStager {
    security: SecurityConfig,
    sessions: Mutex<HashMap<String, MountedVolume>>,
}

impl FuseStager {
    pub fn new(security: SecurityConfig) -> Self {
        FuseStager { security, sessions: Mutex::new(HashMap::new()) }
    }

    /// Volume ids served by this process.
    pub fn volumes(&self) -> Vec<String> {
        self.sessions.lock().keys().cloned().collect()
    }
}

fn stage_error(e: MountError) -> StageError {
    match e {
        MountError::Filer(FilerError::NotFound(m)) => StageError::NotFound(m),
        MountError::Filer(FilerError::Unavailable(m)) => StageError::Unavailable(m),
        MountError::Filer(FilerError::Timeout(m)) => StageError::Timeout(m),
        MountError::Filer(FilerError::InvalidArgument(m)) => StageError::InvalidOptions(m),
        MountError::Fs(f) if f.errno == libc::ENOENT => StageError::NotFound(f.msg),
        MountError::Fs(f) if f.errno == libc::ENOTDIR => StageError::InvalidOptions(f.msg),
        other => StageError::Mount(other.to_string()),
    }
}

#[async_trait]
impl Stager for FuseStager {
    async fn stage(&self, volume_id: &str, opts: MountOptions, staging_path: &Path) -> Result<(), StageError> {
        let mounted = MountedVolume::mount(&opts, &self.security, staging_path).await.map_err(stage_error)?;
        let old = self.sessions.lock().insert(volume_id.to_string(), mounted);
        crate::metrics::global().staged_volumes.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = old {
            // a stale session of the same volume elsewhere: end it
            crate::metrics::global().staged_volumes.fetch_sub(1, Ordering::Relaxed);
            if let Err(e) = old.unmount().await {
                tracing::warn!(volume_id, error = %e, "ending a replaced session failed");
            }
        }
        Ok(())
    }

    async fn unstage(&self, volume_id: &str, _staging_path: &Path) -> Result<(), StageError> {
        let Some(mounted) = self.sessions.lock().remove(volume_id) else { return Ok(()) };
        crate::metrics::global().staged_volumes.fetch_sub(1, Ordering::Relaxed);
        mounted.unmount().await.map_err(|e| StageError::Unmount(e.to_string()))
    }

    fn health(&self, volume_id: &str) -> Option<VolumeHealth> {
        let s = self.sessions.lock();
        let m = s.get(volume_id)?;
        Some(if m.fs.is_healthy() {
            VolumeHealth::healthy()
        } else {
            VolumeHealth::unhealthy("filer connection lost; serving from cache until it returns")
        })
    }

    async fn set_quota(&self, volume_id: &str, bytes: u64) -> Result<(), StageError> {
        let s = self.sessions.lock();
        let m = s.get(volume_id).ok_or_else(|| StageError::NotStaged(volume_id.to_string()))?;
        m.fs.set_quota(bytes);
        Ok(())
    }
}
