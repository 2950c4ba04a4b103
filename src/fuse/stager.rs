//! The real [`Stager`]: one in-process FUSE session per staged volume.

use super::session::{MountError, MountedVolume};
use crate::config::MountOptions;
use crate::csi::stager::{StageError, Stager, VolumeHealth};
use crate::filer::FilerError;
use crate::keeper::KeeperClient;
use crate::security::SecurityConfig;
use async_trait::async_trait;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub struct FuseStager {
    security: SecurityConfig,
    sessions: Mutex<HashMap<String, MountedVolume>>,
    /// Volumes found in the keeper whose adoption has not finished yet.
    adopting: Mutex<HashSet<String>>,
    adopted: tokio::sync::Notify,
    /// With an fd-keeper, sessions survive this process (crash or upgrade).
    keeper: Option<(PathBuf, Arc<KeeperClient>)>,
}

impl FuseStager {
    /// Sessions end with this process.
    pub fn new(security: SecurityConfig) -> Self {
        FuseStager {
            security,
            sessions: Mutex::new(HashMap::new()),
            adopting: Mutex::new(HashSet::new()),
            adopted: tokio::sync::Notify::new(),
            keeper: None,
        }
    }

    /// Sessions are takeover-capable: their fds are held by the keeper at `socket`.
    pub fn with_keeper(security: SecurityConfig, socket: &Path) -> Result<Self, StageError> {
        let client = KeeperClient::connect(socket)
            .map_err(|e| StageError::Other(format!("fd-keeper at {}: {e}", socket.display())))?;
        Ok(FuseStager {
            security,
            sessions: Mutex::new(HashMap::new()),
            adopting: Mutex::new(HashSet::new()),
            adopted: tokio::sync::Notify::new(),
            keeper: Some((socket.to_path_buf(), Arc::new(client))),
        })
    }

    /// Adopts, in the background, every session a previous process left with the keeper. A
    /// session still served by a live predecessor (rolling update) is adopted as soon as that
    /// process exits. Returns the number of sessions found.
    pub fn adopt_all(self: &Arc<Self>) -> usize {
        let Some((socket, main)) = &self.keeper else {
            return 0;
        };
        let ids = match main.list() {
            Ok(ids) => ids,
            Err(e) => {
                tracing::error!(error = %e, "fd-keeper list failed; nothing adopted");
                return 0;
            }
        };
        // Registered before this returns, so the node's self-repair leaves them alone.
        self.adopting.lock().extend(ids.iter().cloned());
        for id in &ids {
            let me = self.clone();
            let socket = socket.clone();
            let id = id.clone();
            let id2 = id.clone();
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let claimed =
                    tokio::task::spawn_blocking(move || -> Result<(KeeperClient, _), String> {
                        loop {
                            // a timed-out connection is poisoned: claim again on a fresh one
                            let conn = KeeperClient::connect(&socket).map_err(|e| e.to_string())?;
                            match conn.claim(&id, Duration::from_secs(3600)) {
                                Ok(entry) => return Ok((conn, entry)),
                                Err(crate::keeper::KeeperError::Timeout) => continue,
                                Err(e) => return Err(format!("claim {id}: {e}")),
                            }
                        }
                    })
                    .await;
                let (conn, entry) = match claimed {
                    Ok(Ok(v)) => v,
                    Ok(Err(e)) => {
                        tracing::error!(error = %e, "adopt failed");
                        return me.adoption_over(&id2);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "adopt task failed");
                        return me.adoption_over(&id2);
                    }
                };
                let conn = Arc::new(conn);
                let granted = std::time::Instant::now();
                match MountedVolume::adopt(entry, &me.security, conn.clone()).await {
                    Ok(m) => {
                        let vid = m.volume_id().unwrap_or_default();
                        tracing::info!(volume_id = %vid,
                            claim_waited_ms = (granted - started).as_millis() as u64,
                            took_ms = granted.elapsed().as_millis() as u64, "session adopted");
                        crate::metrics::global().staged_volumes.inc();
                        me.sessions.lock().insert(vid, m);
                    }
                    Err(e) => {
                        // Nobody can serve it: release the keeper's fds so the mount fails fast
                        // (ENOTCONN) instead of hanging, and can be staged again.
                        tracing::error!(volume_id = %id2, error = %e, "adopting a session failed; ending it");
                        let id = id2.clone();
                        let _ = tokio::task::spawn_blocking(move || conn.drop_entry(&id)).await;
                    }
                }
                me.adoption_over(&id2);
            });
        }
        ids.len()
    }

    fn adoption_over(&self, volume_id: &str) {
        self.adopting.lock().remove(volume_id);
        self.adopted.notify_waiters();
    }

    /// Waits until the adoption of `volume_id` (if any) has finished.
    async fn wait_adopted(&self, volume_id: &str) {
        loop {
            let notified = self.adopted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.adopting.lock().contains(volume_id) {
                return;
            }
            notified.await;
        }
    }

    /// At process exit: with a keeper, hand every session over (flushed, left mounted for the
    /// successor); without one, flush what is dirty (the mounts die with the process).
    pub async fn shutdown(&self) {
        let sessions: Vec<(String, MountedVolume)> = self.sessions.lock().drain().collect();
        let (n, started) = (sessions.len(), std::time::Instant::now());
        let kept = self.keeper.is_some();
        // All at once: the pod's grace period bounds the whole shutdown, and one after another
        // it grew with every staged volume's dirty data.
        futures::future::join_all(sessions.into_iter().map(|(id, m)| async move {
            let r = if kept {
                m.hand_over().await
            } else {
                let r = m.fs.flush_all().await.map_err(Into::into);
                std::mem::forget(m);
                r
            };
            if let Err(e) = r {
                tracing::error!(volume_id = %id, error = %e, "shutdown of a session failed");
            }
        }))
        .await;
        if n > 0 {
            tracing::info!(
                sessions = n,
                took_ms = started.elapsed().as_millis() as u64,
                "sessions shut down"
            );
        }
    }

    /// Whether the fd-keeper answers; `Ok` without one. Blocking: one bounded round trip on a
    /// connection of its own, so a slow probe never poisons the connection that owns the
    /// sessions (the stager's reconnects by itself at its next call).
    pub fn keeper_ready(&self) -> Result<(), String> {
        let Some((socket, _)) = &self.keeper else {
            return Ok(());
        };
        KeeperClient::connect(socket)
            .and_then(|k| k.with_timeout(Duration::from_secs(2)).ping())
            .map_err(|e| format!("fd-keeper at {}: {e}", socket.display()))
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
    async fn stage(
        &self,
        volume_id: &str,
        opts: MountOptions,
        staging_path: &Path,
    ) -> Result<(), StageError> {
        // A session we still hold for this volume lost its mount (the node service only stages
        // when nothing alive is mounted): end it before mounting again.
        let stale = self.sessions.lock().remove(volume_id);
        if let Some(old) = stale {
            crate::metrics::global().staged_volumes.dec();
            tracing::warn!(volume_id, "replacing a session whose mount is gone");
            match tokio::time::timeout(Duration::from_secs(30), old.unmount()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(volume_id, error = %e, "ending the stale session"),
                Err(_) => tracing::warn!(volume_id, "ending the stale session timed out"),
            }
        }
        let mounted = match &self.keeper {
            Some((_, k)) => {
                MountedVolume::mount_kept(volume_id, &opts, &self.security, staging_path, k.clone())
                    .await
            }
            None => MountedVolume::mount(&opts, &self.security, staging_path).await,
        }
        .map_err(stage_error)?;
        self.sessions.lock().insert(volume_id.to_string(), mounted);
        crate::metrics::global().staged_volumes.inc();
        Ok(())
    }

    async fn unstage(&self, volume_id: &str, _staging_path: &Path) -> Result<(), StageError> {
        // The caller bounds this: the predecessor may still be handing the session over.
        self.wait_adopted(volume_id).await;
        let Some(mounted) = self.sessions.lock().remove(volume_id) else {
            return Ok(());
        };
        crate::metrics::global().staged_volumes.dec();
        let disk_cache = mounted
            .fs
            .cache
            .close_disk(std::time::Duration::from_secs(5))
            .await;
        mounted
            .unmount()
            .await
            .map_err(|e| StageError::Unmount(e.to_string()))?;
        // The volume leaves this node: its disk cache goes too, so volumes deleted since
        // leave nothing behind (a restart or upgrade keeps it: that is no unstage).
        if let Some(dir) = disk_cache {
            if let Err(e) = tokio::fs::remove_dir_all(&dir).await {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(volume_id, dir = %dir.display(), error = %e, "removing the disk chunk cache failed");
                }
            }
        }
        Ok(())
    }

    fn health(&self, volume_id: &str) -> Option<VolumeHealth> {
        if self.adopting.lock().contains(volume_id) {
            return Some(VolumeHealth::unhealthy(
                "taking over the live FUSE session from the previous plugin process",
            ));
        }
        let s = self.sessions.lock();
        let m = s.get(volume_id)?;
        Some(if m.fs.is_healthy() {
            VolumeHealth::healthy()
        } else {
            VolumeHealth::unhealthy("filer connection lost; serving from cache until it returns")
        })
    }

    async fn settled(&self, volume_id: &str) {
        self.wait_adopted(volume_id).await
    }

    fn staging_path(&self, volume_id: &str) -> Option<PathBuf> {
        self.sessions
            .lock()
            .get(volume_id)
            .map(|m| m.mountpoint.clone())
    }

    async fn set_quota(&self, volume_id: &str, bytes: u64) -> Result<u64, StageError> {
        let fs = self
            .sessions
            .lock()
            .get(volume_id)
            .map(|m| m.fs.clone())
            .ok_or_else(|| StageError::NotStaged(volume_id.to_string()))?;
        // on the filer too, for every node and every later stage; failing, the expansion is
        // reported failed and kubelet asks again
        fs.expand(bytes).await.map_err(expand_error)
    }
}

/// A failed expansion as kubelet should see it: retried while the filer may take it, not
/// found when the volume's directory is gone, refused when it is no directory.
fn expand_error(e: crate::fs::FsError) -> StageError {
    let msg = format!("recording the new capacity on the filer: {e}");
    match e.errno {
        libc::ENOENT => StageError::NotFound(msg),
        libc::ENOTDIR => StageError::InvalidOptions(msg),
        _ => StageError::Unavailable(msg),
    }
}

#[cfg(test)]
mod expand_error_tests {
    use super::*;

    #[test]
    fn a_gone_directory_is_not_found_and_a_busy_filer_is_unavailable() {
        let of = |errno| expand_error(crate::fs::FsError::new(errno, "x"));
        assert!(matches!(of(libc::ENOENT), StageError::NotFound(_)));
        assert!(matches!(of(libc::ENOTDIR), StageError::InvalidOptions(_)));
        assert!(matches!(of(libc::EAGAIN), StageError::Unavailable(_)));
        assert!(matches!(of(libc::EIO), StageError::Unavailable(_)));
    }
}
