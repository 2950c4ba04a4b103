//! The seam between the CSI node service and the FUSE layer.
//!
//! The node service decides *whether* to stage (idempotency, mount-table checks, locks); a
//! [`Stager`] only knows *how* to start and end one FUSE session per volume. The real one lives
//! in `crate::fuse`; [`FakeStager`] bind-mounts a scratch directory instead, so the node logic
//! runs against real mounts in tests without FUSE.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use parking_lot::Mutex;

use crate::config::MountOptions;
use crate::csi::mounts::{self, MountState};

/// Health of one session this process serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeHealth {
    pub healthy: bool,
    /// Why not healthy (or a short status when healthy).
    pub message: String,
}

impl VolumeHealth {
    pub fn healthy() -> Self {
        VolumeHealth {
            healthy: true,
            message: String::new(),
        }
    }
    pub fn unhealthy(message: impl Into<String>) -> Self {
        VolumeHealth {
            healthy: false,
            message: message.into(),
        }
    }
}

/// Errors of a [`Stager`]; the node service maps them to gRPC codes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StageError {
    /// The options cannot work (bad filer address, bad path, ...). Maps to INVALID_ARGUMENT.
    #[error("invalid mount options: {0}")]
    InvalidOptions(String),
    /// The remote filer path does not exist. Maps to NOT_FOUND.
    #[error("volume not found: {0}")]
    NotFound(String),
    /// The filer (or volume servers) cannot be reached. Maps to UNAVAILABLE.
    #[error("filer unavailable: {0}")]
    Unavailable(String),
    /// The volume is not staged by this process. Maps to NOT_FOUND.
    #[error("volume {0} is not staged on this node")]
    NotStaged(String),
    /// The mount itself failed. Maps to INTERNAL.
    #[error("mount failed: {0}")]
    Mount(String),
    /// Ending the session or unmounting failed. Maps to INTERNAL.
    #[error("unmount failed: {0}")]
    Unmount(String),
    /// Applying a quota failed. Maps to INTERNAL.
    #[error("quota: {0}")]
    Quota(String),
    /// Timed out. Maps to DEADLINE_EXCEEDED.
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("{0}")]
    Other(String),
}

/// Starts and ends the FUSE session of a volume.
///
/// Contract with the node service (which holds a per-volume lock around every call, so calls
/// for one volume never overlap):
/// - `stage` is called only when nothing (alive) is mounted at `staging_path`; the directory
///   exists. `opts` is complete: filer path, collection, quota (`quota_bytes`), read-only,
///   and `cache_dir` already points at this volume's own cache directory.
/// - On error, `stage` must leave nothing mounted at `staging_path`.
/// - `unstage` of a volume the stager does not serve returns `Ok(())`; the caller unmounts any
///   leftover mount itself.
#[async_trait]
pub trait Stager: Send + Sync + 'static {
    /// Mounts ONE FUSE session for the volume at `staging_path` (already created dir).
    /// Idempotency is the caller's job.
    async fn stage(
        &self,
        volume_id: &str,
        opts: MountOptions,
        staging_path: &Path,
    ) -> Result<(), StageError>;

    /// Ends the session and unmounts `staging_path`.
    async fn unstage(&self, volume_id: &str, staging_path: &Path) -> Result<(), StageError>;

    /// Health of a session this process serves (None = not served by us). Must be cheap and
    /// must not block on the filesystem.
    fn health(&self, volume_id: &str) -> Option<VolumeHealth>;

    /// Where this process's session of the volume is mounted (None: no session, or one whose
    /// adoption has not finished). The node service's records can be stale or lost; this is
    /// what `stage` elsewhere or `unstage` would end. Cheap, never blocks on the filesystem.
    fn staging_path(&self, volume_id: &str) -> Option<PathBuf>;

    /// Returns once no adoption of the volume is in progress, so that `staging_path` tells
    /// where its session runs (the caller bounds the wait).
    async fn settled(&self, _volume_id: &str) {}

    /// Applies a new quota (bytes, 0 = none) to a staged volume. Returns the quota applied:
    /// a larger one recorded for the volume stays.
    async fn set_quota(&self, volume_id: &str, bytes: u64) -> Result<u64, StageError>;
}

/// One call recorded by [`FakeStager`].
#[derive(Debug, Clone)]
pub enum StagerCall {
    Stage {
        volume_id: String,
        staging_path: PathBuf,
        opts: Box<MountOptions>,
    },
    Unstage {
        volume_id: String,
        staging_path: PathBuf,
    },
    SetQuota {
        volume_id: String,
        bytes: u64,
    },
}

#[derive(Debug, Clone)]
struct FakeSession {
    staging_path: PathBuf,
    opts: MountOptions,
}

#[derive(Default)]
struct FakeState {
    sessions: HashMap<String, FakeSession>,
    calls: Vec<StagerCall>,
    fail_next_stage: Option<StageError>,
    fail_next_unstage: Option<StageError>,
    unhealthy: HashMap<String, String>,
    stage_delay_ms: u64,
    in_flight: HashSet<String>,
    overlap_seen: bool,
    /// Sessions being "adopted": served, but where is not known yet.
    adopting: HashSet<String>,
}

/// Test double: "stages" a volume by bind-mounting `<root>/<sha256(volume id)>` onto the staging
/// path (read-only when the options say so). Real mount syscalls, so everything the node service
/// does on top (publish binds, unmounts, mount-table checks) is exercised for real. The scratch
/// directories persist under `root`, so a restarted driver sees the same data.
pub struct FakeStager {
    root: PathBuf,
    state: Mutex<FakeState>,
    unmount_on_drop: bool,
    adopted: tokio::sync::Notify,
}

impl FakeStager {
    /// `root` holds one scratch directory per volume; created if missing.
    pub fn new(root: impl Into<PathBuf>) -> std::io::Result<Self> {
        let root = root.into();
        std::fs::create_dir_all(&root)?;
        Ok(FakeStager {
            root,
            state: Mutex::new(FakeState::default()),
            unmount_on_drop: true,
            adopted: tokio::sync::Notify::new(),
        })
    }

    /// Keeps the binds when dropped, like a real plugin whose volumes outlive its process
    /// (used by the driver binary's `--fakeStager`).
    pub fn leave_mounts_on_drop(mut self) -> Self {
        self.unmount_on_drop = false;
        self
    }

    /// The scratch directory that backs a volume.
    pub fn scratch_dir(&self, volume_id: &str) -> PathBuf {
        use sha2::Digest;
        self.root
            .join(hex::encode(sha2::Sha256::digest(volume_id.as_bytes())))
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<StagerCall> {
        self.state.lock().calls.clone()
    }

    /// Number of `stage` calls so far.
    pub fn stage_count(&self) -> usize {
        self.state
            .lock()
            .calls
            .iter()
            .filter(|c| matches!(c, StagerCall::Stage { .. }))
            .count()
    }

    /// The options of the live session of a volume.
    pub fn session_options(&self, volume_id: &str) -> Option<MountOptions> {
        self.state
            .lock()
            .sessions
            .get(volume_id)
            .map(|s| s.opts.clone())
    }

    /// Makes the next `stage` fail with `err` (after mounting, to check the caller's cleanup
    /// does not depend on the stager's own).
    pub fn fail_next_stage(&self, err: StageError) {
        self.state.lock().fail_next_stage = Some(err);
    }

    /// Makes the next `unstage` fail with `err` without unmounting.
    pub fn fail_next_unstage(&self, err: StageError) {
        self.state.lock().fail_next_unstage = Some(err);
    }

    /// Reports a served volume as unhealthy until [`FakeStager::set_healthy`].
    pub fn set_unhealthy(&self, volume_id: &str, message: &str) {
        self.state
            .lock()
            .unhealthy
            .insert(volume_id.to_string(), message.to_string());
    }

    pub fn set_healthy(&self, volume_id: &str) {
        self.state.lock().unhealthy.remove(volume_id);
    }

    /// Slows `stage` down, to widen race windows in concurrency tests.
    pub fn set_stage_delay_ms(&self, ms: u64) {
        self.state.lock().stage_delay_ms = ms;
    }

    /// Whether two calls for the same volume ever ran at the same time (they must not: the
    /// node service serialises per volume).
    pub fn overlap_seen(&self) -> bool {
        self.state.lock().overlap_seen
    }

    /// Makes a staged volume's session look as one still being adopted after a restart
    /// (healthy unknown, path unknown) until [`Self::finish_adoption`].
    pub fn begin_adoption(&self, volume_id: &str) {
        self.state.lock().adopting.insert(volume_id.to_string());
    }

    pub fn finish_adoption(&self, volume_id: &str) {
        self.state.lock().adopting.remove(volume_id);
        self.adopted.notify_waiters();
    }

    fn enter(&self, volume_id: &str) {
        let mut st = self.state.lock();
        if !st.in_flight.insert(volume_id.to_string()) {
            st.overlap_seen = true;
        }
    }

    fn leave(&self, volume_id: &str) {
        self.state.lock().in_flight.remove(volume_id);
    }

    async fn stage_inner(
        &self,
        volume_id: &str,
        opts: MountOptions,
        staging_path: &Path,
    ) -> Result<(), StageError> {
        let (delay, fail) = {
            let mut st = self.state.lock();
            st.calls.push(StagerCall::Stage {
                volume_id: volume_id.to_string(),
                staging_path: staging_path.to_path_buf(),
                opts: Box::new(opts.clone()),
            });
            (st.stage_delay_ms, st.fail_next_stage.take())
        };
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        // One session per volume, as the real stager: a session still held for it ends first
        // (its mount with it, wherever it is).
        let stale = self.state.lock().sessions.remove(volume_id);
        if let Some(old) = stale {
            let _ = mounts::unmount_all(&old.staging_path);
        }
        let scratch = self.scratch_dir(volume_id);
        std::fs::create_dir_all(&scratch)
            .map_err(|e| StageError::Mount(format!("scratch dir: {e}")))?;
        let res = if opts.read_only {
            mounts::bind_mount_readonly(&scratch, staging_path)
        } else {
            mounts::bind_mount(&scratch, staging_path)
        };
        res.map_err(|e| StageError::Mount(e.to_string()))?;
        if let Some(err) = fail {
            // Honour the contract: nothing stays mounted when stage fails.
            let _ = mounts::unmount(staging_path);
            return Err(err);
        }
        self.state.lock().sessions.insert(
            volume_id.to_string(),
            FakeSession {
                staging_path: staging_path.to_path_buf(),
                opts,
            },
        );
        Ok(())
    }
}

#[async_trait]
impl Stager for FakeStager {
    async fn stage(
        &self,
        volume_id: &str,
        opts: MountOptions,
        staging_path: &Path,
    ) -> Result<(), StageError> {
        self.enter(volume_id);
        let r = self.stage_inner(volume_id, opts, staging_path).await;
        self.leave(volume_id);
        r
    }

    async fn unstage(&self, volume_id: &str, staging_path: &Path) -> Result<(), StageError> {
        // as the real one: an adoption in progress finishes first
        self.settled(volume_id).await;
        self.enter(volume_id);
        let r = (|| {
            let mut st = self.state.lock();
            st.calls.push(StagerCall::Unstage {
                volume_id: volume_id.to_string(),
                staging_path: staging_path.to_path_buf(),
            });
            if let Some(err) = st.fail_next_unstage.take() {
                return Err(err);
            }
            let Some(sess) = st.sessions.remove(volume_id) else {
                return Ok(());
            };
            drop(st);
            mounts::unmount(&sess.staging_path).map_err(|e| StageError::Unmount(e.to_string()))?;
            Ok(())
        })();
        self.leave(volume_id);
        r
    }

    fn health(&self, volume_id: &str) -> Option<VolumeHealth> {
        let st = self.state.lock();
        let sess = st.sessions.get(volume_id)?;
        if st.adopting.contains(volume_id) {
            return Some(VolumeHealth::unhealthy("being adopted"));
        }
        if let Some(msg) = st.unhealthy.get(volume_id) {
            return Some(VolumeHealth::unhealthy(msg.clone()));
        }
        Some(match mounts::mount_state(&sess.staging_path) {
            Ok(MountState::Healthy) => VolumeHealth::healthy(),
            Ok(other) => VolumeHealth::unhealthy(format!("staging mount is {other:?}")),
            Err(e) => VolumeHealth::unhealthy(e.to_string()),
        })
    }

    fn staging_path(&self, volume_id: &str) -> Option<PathBuf> {
        let st = self.state.lock();
        if st.adopting.contains(volume_id) {
            return None;
        }
        st.sessions.get(volume_id).map(|s| s.staging_path.clone())
    }

    async fn settled(&self, volume_id: &str) {
        loop {
            let notified = self.adopted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.state.lock().adopting.contains(volume_id) {
                return;
            }
            notified.await;
        }
    }

    async fn set_quota(&self, volume_id: &str, bytes: u64) -> Result<u64, StageError> {
        let mut st = self.state.lock();
        st.calls.push(StagerCall::SetQuota {
            volume_id: volume_id.to_string(),
            bytes,
        });
        let sess = st
            .sessions
            .get_mut(volume_id)
            .ok_or_else(|| StageError::NotStaged(volume_id.to_string()))?;
        sess.opts.quota_bytes = bytes;
        Ok(bytes)
    }
}

impl Drop for FakeStager {
    /// Unmounts what this instance still serves, so a test that forgot to unstage leaves no
    /// mount behind. (A driver process that is killed leaves its binds; its tests clean up.)
    fn drop(&mut self) {
        if !self.unmount_on_drop {
            return;
        }
        let sessions: Vec<FakeSession> =
            self.state.lock().sessions.drain().map(|(_, s)| s).collect();
        for s in sessions {
            let _ = mounts::unmount_all(&s.staging_path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fake_stager_binds_records_and_injects_faults() {
        let tmp = tempfile::tempdir().unwrap();
        let stager = FakeStager::new(tmp.path().join("scratch")).unwrap();
        let staging = tmp.path().join("staging");
        std::fs::create_dir(&staging).unwrap();

        stager
            .stage("vol-1", MountOptions::default(), &staging)
            .await
            .unwrap();
        assert!(mounts::is_mount_point(&staging).unwrap());
        assert_eq!(stager.health("vol-1"), Some(VolumeHealth::healthy()));
        assert_eq!(stager.health("other"), None);
        assert_eq!(stager.staging_path("vol-1"), Some(staging.clone()));
        assert_eq!(stager.staging_path("other"), None);
        std::fs::write(staging.join("f"), b"data").unwrap();
        assert_eq!(
            std::fs::read(stager.scratch_dir("vol-1").join("f")).unwrap(),
            b"data"
        );

        stager.set_quota("vol-1", 42).await.unwrap();
        assert_eq!(stager.session_options("vol-1").unwrap().quota_bytes, 42);
        assert!(matches!(
            stager.set_quota("nope", 1).await,
            Err(StageError::NotStaged(_))
        ));

        stager.set_unhealthy("vol-1", "filer gone");
        assert!(!stager.health("vol-1").unwrap().healthy);

        stager.unstage("vol-1", &staging).await.unwrap();
        assert!(!mounts::is_mount_point(&staging).unwrap());
        assert_eq!(stager.health("vol-1"), None);
        assert_eq!(stager.staging_path("vol-1"), None);
        stager.unstage("vol-1", &staging).await.unwrap();

        stager.fail_next_stage(StageError::Unavailable("injected".into()));
        let err = stager
            .stage("vol-2", MountOptions::default(), &staging)
            .await
            .unwrap_err();
        assert!(matches!(err, StageError::Unavailable(_)));
        assert!(
            !mounts::is_mount_point(&staging).unwrap(),
            "failed stage leaves nothing mounted"
        );

        let ro = MountOptions {
            read_only: true,
            ..Default::default()
        };
        stager.stage("vol-3", ro, &staging).await.unwrap();
        let err = std::fs::write(staging.join("x"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS));
        assert_eq!(stager.stage_count(), 3);
        assert!(!stager.overlap_seen());
        drop(stager);
        assert!(
            !mounts::is_mount_point(&staging).unwrap(),
            "drop unmounts live sessions"
        );
    }
}
