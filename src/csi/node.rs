//! CSI Node service: one FUSE session per staged volume (through a [`Stager`]), bind-mounted
//! onto each pod's target path.
//!
//! Every RPC is idempotent and runs under a per-volume lock. Decisions are made from the real
//! mount table, not only from memory, so they hold after a plugin restart: a dead mount (the
//! FUSE daemon is gone, the kernel answers ENOTCONN) is treated as not mounted and replaced, a
//! live one is left alone. On any failure nothing stays mounted that was not mounted before.
//!
//! Over 800 lines: one file per CSI service, as the project's style asks; the mount syscalls
//! live in `mounts.rs`, the staging in `stager.rs`.

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tonic::{Request, Response, Status};

use super::mounts::{self, MountError, MountState};
use super::params::{self, VolumeDefaults};
use super::stager::{StageError, Stager};
use super::state::{RecordedRequest, RecordedVolume, StateError, StateStore};
use super::topology::{KubeNodeLabels, NodeLabels, NodeTopology, TopologySpec};
use super::{require_capability, require_field, CapabilityRequest, KeyedLocks};
use crate::config::MountOptions;
use crate::pb::csi::node_server::Node;
use crate::pb::csi::node_service_capability::{self, rpc};
use crate::pb::csi::volume_capability::access_mode::Mode;
use crate::pb::csi::volume_usage::Unit;
use crate::pb::csi::*;

/// Node-wide settings.
#[derive(Debug, Clone, Default)]
pub struct NodeConfig {
    pub node_id: String,
    /// 0 = no limit.
    pub max_volumes_per_node: i64,
    /// `--topologyKeys` / `--dataCenterLabel`: segments returned as `accessible_topology`
    /// (none when empty) and the Node label holding this node's data center.
    pub topology: TopologySpec,
    pub defaults: VolumeDefaults,
}

/// Bounds for calls that can block on a hung filesystem.
#[derive(Debug, Clone, Copy)]
pub struct NodeTimeouts {
    /// One mount-state check or mount syscall.
    pub syscall: Duration,
    /// Starting a FUSE session (talks to the filer).
    pub stage: Duration,
    /// statfs for NodeGetVolumeStats.
    pub stats: Duration,
    /// Telling the stager to end a session whose mount is already dead (best effort).
    pub end_dead_session: Duration,
}

impl Default for NodeTimeouts {
    fn default() -> Self {
        NodeTimeouts {
            syscall: Duration::from_secs(30),
            stage: Duration::from_secs(60),
            stats: Duration::from_secs(10),
            end_dead_session: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone)]
struct Publication {
    read_only: bool,
}

/// What this process knows about a staged volume. Rebuilt lazily after a restart.
#[derive(Debug, Clone)]
struct StagedVolume {
    staging: PathBuf,
    read_only: bool,
    /// Options of the session (None when only learned from the mount table after a restart).
    opts: Option<MountOptions>,
    publications: HashMap<PathBuf, Publication>,
}

/// Outcome of one self-repair look at a recorded volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recovery {
    Done,
    Later,
}

/// Cheap to clone: clones share the locks and the volume table (the recovery task holds one).
#[derive(Clone)]
pub struct NodeService {
    stager: Arc<dyn Stager>,
    config: NodeConfig,
    timeouts: NodeTimeouts,
    locks: Arc<KeyedLocks>,
    volumes: Arc<Mutex<HashMap<String, StagedVolume>>>,
    store: Option<Arc<StateStore>>,
    /// This node's labels, read when needed and kept (shared by clones; topology.rs).
    topology: Arc<NodeTopology>,
}

fn stage_status(e: StageError) -> Status {
    let msg = e.to_string();
    match e {
        StageError::InvalidOptions(_) => Status::invalid_argument(msg),
        StageError::NotFound(_) | StageError::NotStaged(_) => Status::not_found(msg),
        StageError::Unavailable(_) => Status::unavailable(msg),
        StageError::Timeout(_) => Status::deadline_exceeded(msg),
        _ => Status::internal(msg),
    }
}

fn mount_status(what: &str, e: MountError) -> Status {
    Status::internal(format!("{what}: {e}"))
}

/// A required absolute path without `..` components.
fn abs_path(value: &str, name: &str) -> Result<PathBuf, Status> {
    require_field(value, name)?;
    let p = Path::new(value);
    if !p.is_absolute() {
        return Err(Status::invalid_argument(format!(
            "{name} must be an absolute path, got {value:?}"
        )));
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err(Status::invalid_argument(format!(
            "{name} must not contain '..', got {value:?}"
        )));
    }
    Ok(p.to_path_buf())
}

fn rpc_cap(t: rpc::Type) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(node_service_capability::Type::Rpc(
            node_service_capability::Rpc { r#type: t as i32 },
        )),
    }
}

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl NodeService {
    pub fn new(stager: Arc<dyn Stager>, config: NodeConfig) -> Self {
        Self::with_timeouts(stager, config, NodeTimeouts::default())
    }

    pub fn with_timeouts(
        stager: Arc<dyn Stager>,
        config: NodeConfig,
        timeouts: NodeTimeouts,
    ) -> Self {
        // The Kubernetes client is made on first use: nothing is asked of the API here.
        let source = config
            .topology
            .needs_labels()
            .then(|| Arc::new(KubeNodeLabels::new()) as Arc<dyn NodeLabels>);
        let topology = Arc::new(NodeTopology::new(
            config.topology.clone(),
            &config.node_id,
            source,
        ));
        NodeService {
            stager,
            config,
            timeouts,
            locks: Arc::new(KeyedLocks::new()),
            volumes: Arc::new(Mutex::new(HashMap::new())),
            store: None,
            topology,
        }
    }

    /// Reads this node's labels from `source` instead of the Kubernetes API (tests).
    pub fn with_node_labels(mut self, source: Arc<dyn NodeLabels>) -> Self {
        self.topology = Arc::new(NodeTopology::new(
            self.config.topology.clone(),
            &self.config.node_id,
            Some(source),
        ));
        self
    }

    /// Records staged volumes under `dir` (`crate::csi::state`), for [`Self::spawn_recovery`].
    /// A directory that cannot be opened only turns the self-repair off (logged).
    pub fn with_state_dir(mut self, dir: Option<&Path>) -> Self {
        self.store = dir.and_then(|dir| match StateStore::open(dir) {
            Ok(s) => {
                tracing::info!(file = %s.path().display(), "recording staged volumes");
                Some(Arc::new(s))
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot open the state directory; lost sessions will not be repaired");
                None
            }
        });
        self
    }

    /// Updates the state file; a failure only costs the self-repair of this volume, so it is
    /// logged, not returned (a file this version leaves alone is logged once by the store).
    fn record(&self, volume_id: &str, f: impl FnOnce(&StateStore) -> Result<(), StateError>) {
        if let Some(s) = &self.store {
            match f(s) {
                Ok(()) => {}
                Err(e) if e.is_unsupported() => {}
                Err(e) => tracing::error!(volume_id, error = %e, "cannot update the state file"),
            }
        }
    }

    /// Runs a blocking filesystem call off the async workers, bounded in time: a hung FUSE
    /// mount blocks the thread, not the RPC.
    async fn blocking<T: Send + 'static>(
        &self,
        what: &str,
        limit: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Status> {
        match tokio::time::timeout(limit, tokio::task::spawn_blocking(f)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(join)) => Err(Status::internal(format!("{what}: {join}"))),
            Err(_) => Err(Status::unavailable(format!(
                "{what}: no answer within {limit:?} (hung filesystem?)"
            ))),
        }
    }

    async fn state(&self, path: &Path) -> Result<MountState, Status> {
        let p = path.to_path_buf();
        self.blocking("mount state", self.timeouts.syscall, move || {
            mounts::mount_state(&p)
        })
        .await?
        .map_err(|e| mount_status("mount state", e))
    }

    async fn sys<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce() -> Result<T, MountError> + Send + 'static,
    ) -> Result<T, Status> {
        self.blocking(what, self.timeouts.syscall, f)
            .await?
            .map_err(|e| mount_status(what, e))
    }

    async fn unmount_all(&self, path: &Path) -> Result<(), Status> {
        let p = path.to_path_buf();
        let out = self.sys("unmount", move || mounts::unmount_all(&p)).await?;
        if out == mounts::Unmounted::Detached {
            tracing::warn!(path = %path.display(), "dead mount lazily detached");
        }
        Ok(())
    }

    async fn ensure_dir(&self, path: &Path) -> Result<(), Status> {
        let p = path.to_path_buf();
        self.blocking("mkdir", self.timeouts.syscall, move || {
            mounts::ensure_dir(&p)
        })
        .await?
        .map_err(|e| Status::internal(format!("create {}: {e}", path.display())))
    }

    /// Stages a volume at a path where nothing (alive) is mounted; leaves nothing mounted on
    /// failure, whatever the stager did.
    async fn stage_fresh(
        &self,
        volume_id: &str,
        opts: MountOptions,
        staging: &Path,
    ) -> Result<(), Status> {
        self.ensure_dir(staging).await?;
        let res = with_timeout(
            self.timeouts.stage,
            self.stager.stage(volume_id, opts, staging),
        )
        .await;
        if let Err(e) = res {
            tracing::warn!(volume_id, staging = %staging.display(), error = %e, "stage failed; cleaning up");
            if let Err(ce) = self.unmount_all(staging).await {
                tracing::error!(volume_id, staging = %staging.display(), error = %ce.message(), "cleanup after failed stage");
            }
            return Err(stage_status(e));
        }
        Ok(())
    }

    /// Replaces a dead staging mount (NodePublishVolume found it) with a new session, then
    /// re-binds the publications whose binds died with it.
    async fn repair_staging(
        &self,
        volume_id: &str,
        staging: &Path,
        ctx: &HashMap<String, String>,
        cap: &CapabilityRequest,
        dead: MountState,
    ) -> Result<(), Status> {
        tracing::warn!(volume_id, staging = %staging.display(), "staging mount is dead; staging again");
        let moved = self.take_over_elsewhere(volume_id, staging).await?;
        // Resolved before anything is torn down: a failure leaves the dead mount as it was.
        // The dead session's read-only mode is kept (this is a NodePublish request, whose
        // own read-only flag is the bind's, not the session's).
        let prior = self.prior_opts(volume_id, staging);
        let read_only = prior
            .as_ref()
            .map_or(cap.read_only_mode() || cap.ro_flag(), |p| p.read_only);
        let opts = self
            .session_options(volume_id, ctx, &cap.mount_flags, read_only, prior.as_ref())
            .await?;
        let request = recorded_request(ctx, &cap.mount_flags);
        self.start_session(volume_id, staging, dead, read_only, opts, &request, moved)
            .await
    }

    /// Starts the session of `volume_id` at `staging`, where `state` (dead or nothing) is
    /// mounted, with `opts` (resolved before: a failure to resolve them tears nothing down),
    /// records it, and binds it again over the publications whose binds died with the old
    /// session: those of this path that this process or the state file knows (after a
    /// restart only the file does), and `moved` (those of a dead staging path elsewhere,
    /// [`Self::take_over_elsewhere`]).
    #[allow(clippy::too_many_arguments)]
    async fn start_session(
        &self,
        volume_id: &str,
        staging: &Path,
        state: MountState,
        read_only: bool,
        opts: MountOptions,
        request: &RecordedRequest,
        moved: HashMap<PathBuf, Publication>,
    ) -> Result<(), Status> {
        if let MountState::Dead(errno) = state {
            tracing::warn!(volume_id, staging = %staging.display(), %errno, "dead staging mount; replacing it");
            self.end_dead_session(volume_id, staging).await;
            self.unmount_all(staging).await?;
        }
        let mut publications = self.publications_at(volume_id, staging);
        self.stage_fresh(volume_id, opts.clone(), staging).await?;
        self.record(volume_id, |s| {
            s.record_stage(volume_id, staging, read_only, &opts, Some(request))
        });
        self.rebind_dead(volume_id, staging, &publications).await;
        self.rebind_dead(volume_id, staging, &moved).await;
        for (target, p) in &moved {
            self.record(volume_id, |s| {
                s.record_publish(volume_id, target, p.read_only).map(|_| ())
            });
        }
        publications.extend(moved);
        tracing::info!(
            volume_id,
            staging = %staging.display(),
            filer_path = %opts.filer_path,
            read_only,
            quota_bytes = opts.quota_bytes,
            data_center = %opts.data_center,
            publications = publications.len(),
            "volume staged"
        );
        let mut vols = self.volumes.lock();
        vols.insert(
            volume_id.to_string(),
            StagedVolume {
                staging: staging.to_path_buf(),
                read_only,
                opts: Some(opts),
                publications,
            },
        );
        set_published_gauge(&vols);
        Ok(())
    }

    /// Binds `staging` over those of `publications` whose mount is dead. A failure is only
    /// logged: it is another pod's mount, not the caller's, and stays dead as it was.
    async fn rebind_dead(
        &self,
        volume_id: &str,
        staging: &Path,
        publications: &HashMap<PathBuf, Publication>,
    ) {
        for (target, p) in publications {
            if !matches!(self.state(target).await, Ok(MountState::Dead(_))) {
                continue;
            }
            match self.bind_over_dead(staging, target, p.read_only).await {
                Ok(()) => {
                    tracing::info!(volume_id, target = %target.display(), "re-bound publication")
                }
                Err(e) => {
                    tracing::error!(volume_id, target = %target.display(), error = %e.message(),
                        "re-binding a dead publication failed")
                }
            }
        }
    }

    /// The publications of `volume_id` staged at `staging` that this process or the state
    /// file knows.
    fn publications_at(&self, volume_id: &str, staging: &Path) -> HashMap<PathBuf, Publication> {
        let mut out: HashMap<PathBuf, Publication> = self
            .recorded(volume_id)
            .filter(|r| r.staging == staging)
            .map(|r| {
                r.targets
                    .into_iter()
                    .map(|(t, rt)| {
                        (
                            t,
                            Publication {
                                read_only: rt.read_only,
                            },
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(k) = self
            .volumes
            .lock()
            .get(volume_id)
            .filter(|k| k.staging == staging)
        {
            out.extend(k.publications.clone());
        }
        out
    }

    /// Before a session of `volume_id` starts at `staging`: the stager runs one session per
    /// volume, so one at another staging path (known to this process, the state file or the
    /// stager itself, which alone knows it when the records are stale or lost) would end
    /// under its pods. FAILED_PRECONDITION when that mount is alive, and also when
    /// it is dead but still has publications: those pods belong to the other PV, whose
    /// options (path, filer, read-only, quota) may differ, and whose NodeUnstage would end
    /// a session they shared; a NodePublishVolume at that path or the startup repair starts
    /// it again there. No publication is moved (the returned map stays empty).
    async fn take_over_elsewhere(
        &self,
        volume_id: &str,
        staging: &Path,
    ) -> Result<HashMap<PathBuf, Publication>, Status> {
        let in_memory = self
            .volumes
            .lock()
            .get(volume_id)
            .map(|k| k.staging.clone());
        let recorded = self.recorded(volume_id).map(|r| r.staging);
        if in_memory.is_none() && recorded.is_none() {
            // nothing known of the volume here: a session being adopted may be elsewhere
            self.settled(volume_id).await?;
        }
        let served = self.stager.staging_path(volume_id);
        let moved = HashMap::new();
        let mut others: Vec<PathBuf> = Vec::new();
        for p in in_memory.into_iter().chain(recorded).chain(served) {
            if p != staging && !others.contains(&p) {
                others.push(p);
            }
        }
        for other in others {
            if self.state(&other).await? == MountState::Healthy {
                return Err(Status::failed_precondition(format!(
                    "volume {volume_id} is already staged at {}",
                    other.display()
                )));
            }
            let pods = self.publications_at(volume_id, &other);
            if !pods.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "volume {volume_id} still has {} publication(s) at staging path {} (its \
                     session is gone; a NodePublishVolume there or the plugin's startup repair \
                     starts it again)",
                    pods.len(),
                    other.display()
                )));
            }
        }
        Ok(moved)
    }

    /// The options of a session: node defaults, then the volume context, then the CSI mount
    /// flags (PV `mountOptions`); anything invalid or unknown is INVALID_ARGUMENT.
    fn mount_options_with(
        volume_id: &str,
        ctx: &HashMap<String, String>,
        cap: &CapabilityRequest,
        defaults: &VolumeDefaults,
    ) -> Result<MountOptions, Status> {
        let ro = cap.read_only_mode() || cap.ro_flag();
        Self::resolve(volume_id, ctx, &cap.mount_flags, ro, defaults)
    }

    fn resolve(
        volume_id: &str,
        ctx: &HashMap<String, String>,
        mount_flags: &[String],
        read_only: bool,
        defaults: &VolumeDefaults,
    ) -> Result<MountOptions, Status> {
        let mut opts = params::resolve_mount_options(volume_id, ctx, defaults, read_only)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        params::apply_mount_flags(volume_id, &mut opts, mount_flags, defaults)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(opts)
    }

    /// The options to start again a session this node ran with `prior`: resolved again from
    /// this process's flags and the request, so what an upgrade changed (filer addresses,
    /// cacheDir, ...) applies to the new session; only a data center that came from this
    /// node's label is kept from `prior`, so starting again never waits for the Kubernetes API
    /// and the volume's writes do not move to another data center under running pods. None
    /// when that data center is needed and `prior` has none (ask the API).
    fn options_again(
        &self,
        volume_id: &str,
        ctx: &HashMap<String, String>,
        mount_flags: &[String],
        read_only: bool,
        prior: &MountOptions,
    ) -> Option<Result<MountOptions, Status>> {
        let defaults = match self.node_data_center_label(ctx) {
            None => Cow::Borrowed(&self.config.defaults),
            Some(_) if prior.data_center.is_empty() => return None,
            Some(_) => Cow::Owned(VolumeDefaults {
                data_center: prior.data_center.clone(),
                ..self.config.defaults.clone()
            }),
        };
        Some(Self::resolve(
            volume_id,
            ctx,
            mount_flags,
            read_only,
            &defaults,
        ))
    }

    /// The options of a session started at a staging path: after `prior` when one ran there
    /// ([`Self::options_after`], which never fails), else as for a new volume (which may read
    /// this node's labels from the Kubernetes API: bounded by NODE_READ_TIMEOUT, and
    /// concurrent callers share one read and its failure, see topology.rs).
    async fn session_options(
        &self,
        volume_id: &str,
        ctx: &HashMap<String, String>,
        mount_flags: &[String],
        read_only: bool,
        prior: Option<&MountOptions>,
    ) -> Result<MountOptions, Status> {
        if let Some(p) = prior {
            return Ok(self
                .options_after(volume_id, Some((ctx, mount_flags)), read_only, p)
                .await);
        }
        let defaults = self.volume_defaults(ctx).await?;
        Self::resolve(volume_id, ctx, mount_flags, read_only, &defaults)
    }

    /// The options to start again a session this node ran with `prior`, with the mode
    /// `read_only`. With the request: resolved again ([`Self::options_again`], or as for a
    /// new volume when that needs the API), keeping `prior`'s quota (the volume context's,
    /// or NodeExpandVolume's since). Without it (recorded by a version that did not keep
    /// it): `prior` with this plugin's `--filer` and `--cacheDir`, the context it came from
    /// being unknown. When the request no longer resolves (a flag it needs was removed, the
    /// API is down), `prior` as it is (logged): the volume's pods get their mounts back
    /// rather than an error that no retry cures.
    async fn options_after(
        &self,
        volume_id: &str,
        request: Option<(&HashMap<String, String>, &[String])>,
        read_only: bool,
        prior: &MountOptions,
    ) -> MountOptions {
        MountOptions {
            // an older build's record does not name the volume, which NodeExpandVolume's
            // capacity record is named after
            volume_id: volume_id.to_string(),
            ..self
                .options_again_or_prior(volume_id, request, read_only, prior)
                .await
        }
    }

    async fn options_again_or_prior(
        &self,
        volume_id: &str,
        request: Option<(&HashMap<String, String>, &[String])>,
        read_only: bool,
        prior: &MountOptions,
    ) -> MountOptions {
        let Some((ctx, mount_flags)) = request else {
            // An older build's record: its filer may be the volume's own (`filer` key), which
            // cannot be told from that build's --filer, and a wrong guess would show the pods
            // another cluster's files. The filer is kept; the cache root is this plugin's.
            let d = &self.config.defaults;
            return MountOptions {
                cache_dir: d
                    .cache_root
                    .as_deref()
                    .map(|r| params::cache_dir_for(r, volume_id)),
                read_only,
                ..prior.clone()
            };
        };
        let resolved = match self.options_again(volume_id, ctx, mount_flags, read_only, prior) {
            Some(r) => r,
            None => match self.volume_defaults(ctx).await {
                Ok(d) => Self::resolve(volume_id, ctx, mount_flags, read_only, &d),
                Err(e) => Err(e),
            },
        };
        match resolved {
            Ok(o) => MountOptions {
                quota_bytes: prior.quota_bytes,
                // what a newer version recorded stays recorded for it (a rollback, then a
                // roll forward)
                unknown: prior.unknown.clone(),
                ..o
            },
            Err(e) => {
                tracing::warn!(volume_id, error = %e.message(),
                    "the volume's request does not resolve with this plugin's flags; starting its session again with the options it had");
                MountOptions {
                    read_only,
                    ..prior.clone()
                }
            }
        }
    }

    /// The options of the session staged at `staging`, if this process or the state file
    /// knows them.
    fn prior_opts(&self, volume_id: &str, staging: &Path) -> Option<MountOptions> {
        self.volumes
            .lock()
            .get(volume_id)
            .filter(|k| k.staging == staging)
            .and_then(|k| k.opts.clone())
            .or_else(|| self.recorded_opts(volume_id, staging))
    }

    /// The node defaults for a volume with context `ctx`: with `--dataCenterLabel` and no
    /// `--dataCenter`, a volume that writes to the local data center (and names none itself)
    /// gets the label's value from this node's Node object (topology.rs: kept, re-read while
    /// missing). An API failure is UNAVAILABLE (kubelet retries), no API configuration
    /// FAILED_PRECONDITION; a node without the label is FAILED_PRECONDITION naming the label
    /// and the node.
    async fn volume_defaults(
        &self,
        ctx: &HashMap<String, String>,
    ) -> Result<Cow<'_, VolumeDefaults>, Status> {
        let defaults = &self.config.defaults;
        let Some(label) = self.node_data_center_label(ctx) else {
            return Ok(Cow::Borrowed(defaults));
        };
        match self.topology.data_center().await {
            Ok(Some(dc)) => Ok(Cow::Owned(VolumeDefaults {
                data_center: dc,
                ..defaults.clone()
            })),
            // The node lacks the label (yet: it is read again, see topology.rs): kubelet's
            // retry may succeed, unlike a bad volume context.
            Ok(None) => Err(Status::failed_precondition(format!(
                "dataLocality write_preferLocalDc needs a data center: node {:?} has no label {label:?} (--dataCenterLabel), and neither --dataCenter nor the volume's dataCenter is set",
                self.config.node_id
            ))),
            Err(e) => Err(e.into_status()),
        }
    }

    /// The `--dataCenterLabel` a volume with context `ctx` takes its data center from: set,
    /// no `--dataCenter`, and the volume writes to the local data center without naming one.
    fn node_data_center_label(&self, ctx: &HashMap<String, String>) -> Option<&str> {
        let defaults = &self.config.defaults;
        let label = self.config.topology.data_center_label.as_deref()?;
        (defaults.data_center.is_empty() && params::uses_node_data_center(ctx, defaults))
            .then_some(label)
    }

    /// Checks the request's options without asking the API: `Some` when they are complete,
    /// `None` when they need this node's data center from its Node object (checked with a
    /// stand-in for it). INVALID_ARGUMENT as [`Self::mount_options_with`].
    fn offline_mount_options(
        &self,
        volume_id: &str,
        ctx: &HashMap<String, String>,
        cap: &CapabilityRequest,
    ) -> Result<Option<MountOptions>, Status> {
        if self.node_data_center_label(ctx).is_none() {
            return Self::mount_options_with(volume_id, ctx, cap, &self.config.defaults).map(Some);
        }
        let stand_in = VolumeDefaults {
            data_center: "node-data-center".into(),
            ..self.config.defaults.clone()
        };
        Self::mount_options_with(volume_id, ctx, cap, &stand_in).map(|_| None)
    }

    /// The state file's record of `volume_id`, if any (an unreadable file is logged).
    fn recorded(&self, volume_id: &str) -> Option<RecordedVolume> {
        let store = self.store.as_ref()?;
        store.get(volume_id).unwrap_or_else(|e| {
            if !e.is_unsupported() {
                tracing::warn!(volume_id, error = %e, "cannot read the state file");
            }
            None
        })
    }

    /// The options recorded for `volume_id` staged at `staging` (state file), if any.
    fn recorded_opts(&self, volume_id: &str, staging: &Path) -> Option<MountOptions> {
        self.recorded(volume_id)
            .filter(|r| r.staging == staging)
            .map(|r| r.opts)
    }

    /// [`Self::volume_defaults`] from what is already known, never asking the API (for
    /// bookkeeping in synchronous code).
    fn known_volume_defaults(&self) -> Cow<'_, VolumeDefaults> {
        let defaults = &self.config.defaults;
        match self.topology.cached_data_center() {
            Some(dc) if defaults.data_center.is_empty() => Cow::Owned(VolumeDefaults {
                data_center: dc,
                ..defaults.clone()
            }),
            _ => Cow::Borrowed(defaults),
        }
    }

    /// Lets the stager drop a session whose mount died; bounded, and a failure only logged:
    /// the dead mount is removed by the caller either way.
    async fn end_dead_session(&self, volume_id: &str, staging: &Path) {
        if self.stager.health(volume_id).is_none() {
            return;
        }
        let r = with_timeout(
            self.timeouts.end_dead_session,
            self.stager.unstage(volume_id, staging),
        )
        .await;
        if let Err(e) = r {
            tracing::warn!(volume_id, error = %e, "ending the dead session failed");
        }
    }

    async fn bind(&self, staging: &Path, target: &Path, read_only: bool) -> Result<(), Status> {
        let (s, t) = (staging.to_path_buf(), target.to_path_buf());
        let res = self
            .sys("bind mount", move || {
                if read_only {
                    mounts::bind_mount_readonly(&s, &t)
                } else {
                    mounts::bind_mount(&s, &t)
                }
            })
            .await;
        if res.is_err() {
            // A timed-out bind may still complete later; make sure it does not stay.
            let _ = self.unmount_all(target).await;
        }
        res
    }

    /// Whether the state file records `path` as the staging path or a target of the volume.
    fn recorded_at(&self, volume_id: &str, path: &Path) -> bool {
        let Some(s) = &self.store else { return false };
        matches!(s.get(volume_id), Ok(Some(r)) if r.staging == path || r.targets.contains_key(path))
    }

    /// Starts the self-repair of recorded volumes whose FUSE session is gone for good (the
    /// fd-keeper died too, or there is none): each one this process neither serves nor is
    /// adopting, and whose staging mount is dead or missing, is staged again and its recorded
    /// publications are bound again. A failing volume is retried with backoff until it works or
    /// is unstaged. Call once at start, after the stager has begun its adoptions.
    pub fn spawn_recovery(&self) -> Option<tokio::task::JoinHandle<()>> {
        let store = self.store.clone()?;
        let recorded = match store.volumes() {
            Ok(v) => v,
            Err(e) if e.is_unsupported() => return None,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the state file; nothing repaired");
                return None;
            }
        };
        if recorded.is_empty() {
            return None;
        }
        let me = self.clone();
        Some(tokio::spawn(async move {
            let tasks: Vec<_> = recorded
                .into_keys()
                .map(|id| {
                    let me = me.clone();
                    tokio::spawn(async move { me.recover_with_retry(&id).await })
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
        }))
    }

    async fn recover_with_retry(&self, volume_id: &str) {
        let mut pauses = crate::retry::REPAIR.pauses();
        let mut restaged = false;
        for attempt in 0.. {
            let delay = pauses.next_pause();
            match self.recover_volume(volume_id, &mut restaged).await {
                Ok(Recovery::Done) => return,
                Ok(Recovery::Later) => {}
                Err(e) => {
                    tracing::warn!(volume_id, attempt, error = %e.message(), retry_in = ?delay,
                    "repairing a recorded volume failed")
                }
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// Whether a session of this process makes the repair unnecessary (healthy), or may
    /// still (being adopted, or its filer is away): then look again later. A failed adoption
    /// leaves the volume unserved and dead, which the next look repairs.
    fn served_here(&self, volume_id: &str) -> Option<Recovery> {
        self.stager.health(volume_id).map(|h| {
            if h.healthy {
                Recovery::Done
            } else {
                Recovery::Later
            }
        })
    }

    /// One repair attempt. Once this process has staged the volume again (`restaged`), later
    /// attempts only finish binding its publications.
    async fn recover_volume(
        &self,
        volume_id: &str,
        restaged: &mut bool,
    ) -> Result<Recovery, Status> {
        if !*restaged {
            if let Some(r) = self.served_here(volume_id) {
                return Ok(r);
            }
        }
        let Some(store) = self.store.clone() else {
            return Ok(Recovery::Done);
        };
        let _guard = self.locks.lock(volume_id).await;
        let mut rec: RecordedVolume = match store.get(volume_id) {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(Recovery::Done), // unstaged meanwhile
            // a newer plugin generation (rolling update) rewrote it: its records are its own
            Err(e) if e.is_unsupported() => return Ok(Recovery::Done),
            Err(e) => return Err(Status::internal(e.to_string())),
        };
        if !*restaged {
            if let Some(r) = self.served_here(volume_id) {
                return Ok(r);
            }
        }
        let state = self.state(&rec.staging).await?;
        match state {
            // A predecessor's live session (no keeper): not ours.
            MountState::Healthy if !*restaged => return Ok(Recovery::Done),
            MountState::Healthy => {}
            MountState::NotMounted if !rec.staging.exists() => {
                tracing::warn!(volume_id, staging = %rec.staging.display(),
                    "recorded staging directory is gone; forgetting the volume");
                self.record(volume_id, |s| s.record_unstage(volume_id));
                return Ok(Recovery::Done);
            }
            MountState::Dead(_) | MountState::NotMounted => {
                tracing::warn!(volume_id, staging = %rec.staging.display(), ?state,
                    "recorded volume's session is gone; staging it again");
                // The recorded session's options, resolved again with this process's flags
                // (options_after), before the dead mount goes.
                let ctx: Option<HashMap<String, String>> = rec
                    .request
                    .as_ref()
                    .map(|r| r.volume_context.clone().into_iter().collect());
                let request = rec
                    .request
                    .as_ref()
                    .zip(ctx.as_ref())
                    .map(|(r, c)| (c, r.mount_flags.as_slice()));
                let opts = self
                    .options_after(volume_id, request, rec.read_only, &rec.opts)
                    .await;
                if matches!(state, MountState::Dead(_)) {
                    self.unmount_all(&rec.staging).await?;
                }
                self.stage_fresh(volume_id, opts.clone(), &rec.staging)
                    .await?;
                *restaged = true;
                // Recorded now: a later attempt (binding failed) knows what runs.
                self.record(volume_id, |s| {
                    s.record_stage(
                        volume_id,
                        &rec.staging,
                        rec.read_only,
                        &opts,
                        rec.request.as_ref(),
                    )
                });
                rec.opts = opts;
            }
        }
        let mut publications = HashMap::new();
        for (target, t) in &rec.targets {
            match self.state(target).await? {
                MountState::Healthy => {}
                MountState::Dead(_) => {
                    self.bind_over_dead(&rec.staging, target, t.read_only)
                        .await?;
                    tracing::info!(volume_id, target = %target.display(), "re-bound publication");
                }
                MountState::NotMounted if target.exists() => {
                    self.bind(&rec.staging, target, t.read_only).await?;
                    tracing::info!(volume_id, target = %target.display(), "re-bound publication");
                }
                MountState::NotMounted => {
                    // kubelet removed it: the pod is gone.
                    self.record(volume_id, |s| s.record_unpublish(volume_id, target));
                    continue;
                }
            }
            publications.insert(
                target.clone(),
                Publication {
                    read_only: t.read_only,
                },
            );
        }
        tracing::info!(volume_id, staging = %rec.staging.display(), publications = publications.len(),
            "recorded volume staged and bound again");
        self.volumes.lock().insert(
            volume_id.to_string(),
            StagedVolume {
                staging: rec.staging.clone(),
                read_only: rec.read_only,
                opts: Some(rec.opts),
                publications,
            },
        );
        Ok(Recovery::Done)
    }

    /// Binds the staging mount over a publication whose mount died, leaving the dead mount
    /// underneath instead of unmounting it first: in between, the pod would write into the
    /// node's own directory (data hidden, and lost to the volume, once the new bind covers
    /// it). The dead layer is shadowed and goes at NodeUnpublish (`unmount_all` removes every
    /// layer). A mount on top of the old one also propagates into containers that mounted the
    /// target with HostToContainer propagation; others keep the dead mount until restarted.
    async fn bind_over_dead(
        &self,
        staging: &Path,
        target: &Path,
        read_only: bool,
    ) -> Result<(), Status> {
        let (s, t) = (staging.to_path_buf(), target.to_path_buf());
        self.sys("bind mount", move || {
            if read_only {
                mounts::bind_mount_readonly(&s, &t)
            } else {
                mounts::bind_mount(&s, &t)
            }
        })
        .await
    }

    /// Keeps NodeExpandVolume's quota for the sessions started again (options_after), in
    /// memory and in the state file: a static PV's volume context keeps its size at creation,
    /// and nothing records an expansion on its filer directory.
    fn keep_quota(&self, volume_id: &str, quota: u64) {
        if let Some(o) = self
            .volumes
            .lock()
            .get_mut(volume_id)
            .and_then(|v| v.opts.as_mut())
        {
            o.quota_bytes = quota;
        }
        self.record(volume_id, |s| s.record_quota(volume_id, quota).map(|_| ()));
    }

    /// Read-only flag of the top mount at `path`, from the mount table.
    async fn mounted_read_only(&self, path: &Path) -> Result<Option<bool>, Status> {
        let p = path.to_path_buf();
        let table = self.sys("read mountinfo", mounts::read_mountinfo).await?;
        Ok(table
            .iter()
            .rev()
            .find(|m| m.mount_point == p)
            .map(|m| m.is_read_only()))
    }
}

fn rw_name(read_only: bool) -> &'static str {
    if read_only {
        "read-only"
    } else {
        "read-write"
    }
}

/// What the state file keeps of a request (see [`RecordedRequest`]): not the pod's info.
fn recorded_request(ctx: &HashMap<String, String>, mount_flags: &[String]) -> RecordedRequest {
    RecordedRequest {
        volume_context: ctx
            .iter()
            .filter(|(k, _)| !super::state::is_pod_info(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        mount_flags: mount_flags.to_vec(),
        unknown: Default::default(),
    }
}

impl NodeService {
    /// Waits (bounded) for an adoption of the volume in progress to finish.
    async fn settled(&self, volume_id: &str) -> Result<(), Status> {
        let settle = async {
            self.stager.settled(volume_id).await;
            Ok(())
        };
        with_timeout(self.timeouts.stage, settle)
            .await
            .map_err(stage_status)
    }
}

async fn with_timeout<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, StageError>>,
) -> Result<T, StageError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(StageError::Timeout(format!("no answer within {limit:?}"))),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        let staging = abs_path(&req.staging_target_path, "staging_target_path")?;
        let cap = require_capability(req.volume_capability.as_ref())?;
        let volume_id = req.volume_id.as_str();
        let read_only = cap.read_only_mode() || cap.ro_flag();
        // Everything is checked now, but the node's data center from its Node object is
        // resolved only when a session is started: a healthy volume (kubelet repeats
        // NodeStage after a plugin restart) keeps its own and must not depend on the
        // Kubernetes API.
        let ctx = &req.volume_context;
        let offline = self.offline_mount_options(volume_id, ctx, &cap);

        let _guard = self.locks.lock(volume_id).await;
        // The options of the session at this path: this process's, else the recorded ones
        // (after a restart).
        let prior = self.prior_opts(volume_id, &staging);
        let offline_opts = match offline {
            Ok(o) => o,
            // A volume staged here keeps its options (see options_after), as in the repairs:
            // a flag the request needs, removed since, does not take its pods' mounts away.
            Err(e) if prior.is_some() => {
                tracing::warn!(volume_id, staging = %staging.display(), error = %e.message(),
                    "the request does not resolve with this plugin's flags; the volume keeps the options it was staged with");
                None
            }
            Err(e) => return Err(e),
        };
        let moved = self.take_over_elsewhere(volume_id, &staging).await?;
        let known = self
            .volumes
            .lock()
            .get(volume_id)
            .filter(|k| k.staging == staging)
            .cloned();
        let request = recorded_request(ctx, &cap.mount_flags);
        let state = self.state(&staging).await?;
        let staged_read_only = known
            .as_ref()
            .map(|k| k.read_only)
            .or(prior.as_ref().map(|p| p.read_only));
        if !matches!(state, MountState::NotMounted) {
            if let Some(ro) = staged_read_only.filter(|ro| *ro != read_only) {
                return Err(Status::already_exists(format!(
                    "volume {volume_id} is staged {} at {}; the request asks for {}",
                    rw_name(ro),
                    staging.display(),
                    rw_name(read_only),
                )));
            }
        }

        if state == MountState::Healthy {
            tracing::info!(volume_id, staging = %staging.display(), "already staged");
            // An adopted session keeps writing with its options, and a later recovery
            // restarts it with them; without any, what the request gives without the API.
            let opts = prior.or_else(|| {
                let defaults = self.known_volume_defaults();
                Self::mount_options_with(volume_id, ctx, &cap, &defaults).ok()
            });
            match &opts {
                Some(o) => {
                    let wanted = self
                        .options_again(volume_id, ctx, &cap.mount_flags, read_only, o)
                        .and_then(Result::ok)
                        .map(|w| MountOptions {
                            quota_bytes: o.quota_bytes,
                            ..w
                        });
                    if wanted.as_ref().is_some_and(|w| w != o) {
                        tracing::warn!(volume_id, staging = %staging.display(),
                            "the volume context, mount flags or plugin flags differ from the running session's; they apply when the volume is staged again");
                    }
                    self.record(volume_id, |s| {
                        s.record_stage(volume_id, &staging, read_only, o, Some(&request))
                    })
                }
                None => tracing::warn!(
                    volume_id,
                    "staged volume not recorded: its data center is not known yet"
                ),
            }
            // Publications of a dead staging path elsewhere: bound to the live session here.
            self.rebind_dead(volume_id, &staging, &moved).await;
            for (target, p) in &moved {
                self.record(volume_id, |s| {
                    s.record_publish(volume_id, target, p.read_only).map(|_| ())
                });
            }
            let fresh = || StagedVolume {
                staging: staging.clone(),
                read_only,
                opts: None,
                publications: HashMap::new(),
            };
            let mut vols = self.volumes.lock();
            let k = vols.entry(volume_id.to_string()).or_insert_with(&fresh);
            if k.staging != staging {
                *k = fresh();
            }
            k.opts = k.opts.take().or(opts);
            k.publications.extend(moved);
            set_published_gauge(&vols);
            return Ok(Response::new(NodeStageVolumeResponse {}));
        }

        // Resolved before a dead mount is torn down: a failure leaves it as it was.
        let opts = match (offline_opts, &prior) {
            (Some(o), None) => o,
            _ => {
                self.session_options(volume_id, ctx, &cap.mount_flags, read_only, prior.as_ref())
                    .await?
            }
        };
        self.start_session(volume_id, &staging, state, read_only, opts, &request, moved)
            .await?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        let staging = abs_path(&req.staging_target_path, "staging_target_path")?;
        let volume_id = req.volume_id.as_str();

        let _guard = self.locks.lock(volume_id).await;
        // The volume's session runs at another staging path (this one is what an earlier
        // session left): only this path goes, the session and its records stay.
        let current = self
            .volumes
            .lock()
            .get(volume_id)
            .map(|k| k.staging.clone())
            .or_else(|| self.recorded(volume_id).map(|r| r.staging));
        let known = current.is_some();
        let elsewhere = current.filter(|c| *c != staging);
        // Where the stager's session is mounted decides whether it ends, over records that
        // may be stale or lost: the stager ends its one session wherever it is mounted. One
        // still being adopted has no known path yet: with no record to go by, wait for it.
        if !known {
            self.settled(volume_id).await?;
        }
        let served = self.stager.staging_path(volume_id);
        let end_session = match &served {
            Some(at) => *at == staging,
            // none, or one still being adopted (its path not known yet): as the records say
            None => elsewhere.is_none() && self.stager.health(volume_id).is_some(),
        };
        if end_session {
            if let Err(e) = with_timeout(
                self.timeouts.stage,
                self.stager.unstage(volume_id, &staging),
            )
            .await
            {
                // Still unmount below: a session that cannot end cleanly must not keep the path.
                tracing::warn!(volume_id, error = %e, "ending the session failed");
            }
        }
        if !matches!(self.state(&staging).await?, MountState::NotMounted) {
            self.unmount_all(&staging).await?;
        }
        let p = staging.clone();
        match self
            .blocking("remove staging dir", self.timeouts.syscall, move || {
                mounts::remove_mount_dir(&p)
            })
            .await?
        {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(volume_id, staging = %staging.display(), error = %e, "staging dir left in place")
            }
        }
        if let Some(current) = elsewhere {
            tracing::info!(volume_id, staging = %staging.display(), current = %current.display(),
                "old staging path removed; the volume stays staged at its current one");
            return Ok(Response::new(NodeUnstageVolumeResponse {}));
        }
        if let Some(at) = served.as_ref().filter(|at| **at != staging) {
            // What this process knew of the volume was about this path; its session is not.
            tracing::warn!(volume_id, staging = %staging.display(), session = %at.display(),
                "staging path removed; the volume's session runs at another path and stays");
        }
        self.volumes.lock().remove(volume_id);
        self.record(volume_id, |s| s.record_unstage(volume_id));
        // the volume's disk chunk cache goes with it, also when no session of this process
        // had it (the stager removes the directory of a session it ends)
        // (nor while a session of it is still up: one still being adopted writes there)
        let session_elsewhere = served.as_ref().is_some_and(|at| *at != staging)
            || self.stager.health(volume_id).is_some();
        if let (Some(root), false) = (
            self.config.defaults.cache_root.as_deref(),
            session_elsewhere,
        ) {
            let dir = params::cache_dir_for(root, volume_id);
            let d = dir.clone();
            let r = self
                .blocking("remove disk cache", self.timeouts.syscall, move || {
                    match std::fs::remove_dir_all(&d) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                        _ => Ok(()),
                    }
                })
                .await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::warn!(volume_id, dir = %dir.display(), "the disk chunk cache was not removed");
            }
        }
        tracing::info!(volume_id, staging = %staging.display(), "volume unstaged");
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        let target = abs_path(&req.target_path, "target_path")?;
        let cap = require_capability(req.volume_capability.as_ref())?;
        if req.staging_target_path.trim().is_empty() {
            // The spec's code for a missing staging path when STAGE_UNSTAGE_VOLUME is advertised.
            return Err(Status::failed_precondition(
                "staging_target_path is required: stage the volume first",
            ));
        }
        let staging = abs_path(&req.staging_target_path, "staging_target_path")?;
        if target == staging {
            return Err(Status::invalid_argument(
                "target_path must differ from staging_target_path",
            ));
        }
        let volume_id = req.volume_id.as_str();
        // Session settings among them were applied at stage; unknown ones are refused here too.
        params::check_mount_flags(&cap.mount_flags)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let read_only = req.readonly || cap.ro_flag() || cap.read_only_mode();

        let _guard = self.locks.lock(volume_id).await;
        match self.state(&staging).await? {
            MountState::Healthy => {}
            dead @ MountState::Dead(_) => {
                self.repair_staging(volume_id, &staging, &req.volume_context, &cap, dead)
                    .await?
            }
            MountState::NotMounted => {
                return Err(Status::failed_precondition(format!(
                    "volume {volume_id} is not staged at {}",
                    staging.display()
                )));
            }
        }

        if cap.mode == Mode::SingleNodeSingleWriter {
            let others: Vec<PathBuf> = self
                .volumes
                .lock()
                .get(volume_id)
                .map(|k| {
                    k.publications
                        .keys()
                        .filter(|t| **t != target)
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            for other in others {
                if !matches!(self.state(&other).await, Ok(MountState::NotMounted)) {
                    return Err(Status::failed_precondition(format!(
                        "volume {volume_id} is SINGLE_NODE_SINGLE_WRITER and already published at {}",
                        other.display()
                    )));
                }
            }
        }

        match self.state(&target).await? {
            MountState::Healthy => {
                if let Some(ro) = self.mounted_read_only(&target).await? {
                    if ro != read_only {
                        return Err(Status::already_exists(format!(
                            "{} is already published {}",
                            target.display(),
                            if ro { "read-only" } else { "read-write" }
                        )));
                    }
                }
                tracing::info!(volume_id, target = %target.display(), "already published");
            }
            state => {
                if let MountState::Dead(errno) = state {
                    tracing::warn!(volume_id, target = %target.display(), %errno, "dead publish mount; replacing it");
                    self.unmount_all(&target).await?;
                }
                self.ensure_dir(&target).await?;
                self.bind(&staging, &target, read_only).await?;
                tracing::info!(volume_id, target = %target.display(), read_only, "volume published");
            }
        }

        self.record(volume_id, |s| {
            if s.record_publish(volume_id, &target, read_only)? {
                return Ok(());
            }
            // Staged before the state file existed (or by an older version): record it now.
            let ro = cap.read_only_mode() || cap.ro_flag();
            let defaults = self.known_volume_defaults();
            match Self::mount_options_with(volume_id, &req.volume_context, &cap, &defaults) {
                Ok(opts) => {
                    let request = recorded_request(&req.volume_context, &cap.mount_flags);
                    s.record_stage(volume_id, &staging, ro, &opts, Some(&request))?;
                    s.record_publish(volume_id, &target, read_only).map(|_| ())
                }
                Err(e) => {
                    tracing::warn!(volume_id, error = %e.message(), "publication not recorded");
                    Ok(())
                }
            }
        });
        let mut vols = self.volumes.lock();
        let rec = vols
            .entry(volume_id.to_string())
            .or_insert_with(|| StagedVolume {
                staging: staging.clone(),
                read_only: cap.read_only_mode() || cap.ro_flag(),
                opts: None,
                publications: HashMap::new(),
            });
        rec.publications.insert(target, Publication { read_only });
        set_published_gauge(&vols);
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        let target = abs_path(&req.target_path, "target_path")?;
        let volume_id = req.volume_id.as_str();

        let _guard = self.locks.lock(volume_id).await;
        if !matches!(self.state(&target).await?, MountState::NotMounted) {
            self.unmount_all(&target).await?;
        }
        let p = target.clone();
        self.blocking(
            "remove target",
            self.timeouts.syscall,
            move || match mounts::remove_mount_dir(&p) {
                Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => std::fs::remove_file(&p),
                other => other,
            },
        )
        .await?
        .map_err(|e| Status::internal(format!("remove {}: {e}", target.display())))?;
        {
            let mut vols = self.volumes.lock();
            if let Some(rec) = vols.get_mut(volume_id) {
                rec.publications.remove(&target);
            }
            set_published_gauge(&vols);
        }
        self.record(volume_id, |s| s.record_unpublish(volume_id, &target));
        tracing::info!(volume_id, target = %target.display(), "volume unpublished");
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        require_field(&req.volume_path, "volume_path")?;
        let volume_id = req.volume_id.as_str();
        let path = PathBuf::from(&req.volume_path);
        let not_found = || {
            Status::not_found(format!(
                "volume {volume_id} is not mounted at {}",
                req.volume_path
            ))
        };
        if !path.is_absolute() {
            return Err(not_found());
        }
        let abnormal = |message: String| {
            Response::new(NodeGetVolumeStatsResponse {
                usage: vec![],
                volume_condition: Some(VolumeCondition {
                    abnormal: true,
                    message,
                }),
            })
        };
        let p = path.clone();
        let state = match self
            .blocking("mount state", self.timeouts.stats, move || {
                mounts::mount_state(&p)
            })
            .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => match e.errno() {
                Some(nix::errno::Errno::ENOENT) => return Err(not_found()),
                _ => return Ok(abnormal(format!("cannot check the mount: {e}"))),
            },
            Err(s) => return Ok(abnormal(s.message().to_string())),
        };
        match state {
            MountState::NotMounted => {
                if self.recorded_at(volume_id, &path) {
                    return Ok(abnormal(
                        "the FUSE session is gone; the plugin is staging the volume again".into(),
                    ));
                }
                return Err(not_found());
            }
            MountState::Dead(errno) => {
                return Ok(abnormal(format!(
                    "the FUSE session is gone ({errno}); the volume needs to be staged again"
                )))
            }
            MountState::Healthy => {}
        }
        let p = path.clone();
        let st = match self
            .blocking("statfs", self.timeouts.stats, move || {
                nix::sys::statvfs::statvfs(&p)
            })
            .await
        {
            Ok(Ok(st)) => st,
            Ok(Err(errno)) => return Ok(abnormal(format!("statfs failed: {errno}"))),
            Err(s) => return Ok(abnormal(s.message().to_string())),
        };
        let frsize = st.fragment_size() as u64;
        let blocks = st.blocks() as u64;
        let bfree = st.blocks_free() as u64;
        let bavail = st.blocks_available() as u64;
        let mut usage = vec![VolumeUsage {
            total: clamp_i64(blocks.saturating_mul(frsize)),
            available: clamp_i64(bavail.saturating_mul(frsize)),
            used: clamp_i64(blocks.saturating_sub(bfree).saturating_mul(frsize)),
            unit: Unit::Bytes as i32,
        }];
        // Filers that report "unlimited" inodes (i64::MAX-ish counts) would only produce noise.
        let files = st.files() as u64;
        if files > 0 && files < (1u64 << 62) {
            let ffree = st.files_free() as u64;
            usage.push(VolumeUsage {
                total: clamp_i64(files),
                available: clamp_i64(st.files_available() as u64),
                used: clamp_i64(files.saturating_sub(ffree)),
                unit: Unit::Inodes as i32,
            });
        }
        let volume_condition = match self.stager.health(volume_id) {
            Some(h) => VolumeCondition {
                abnormal: !h.healthy,
                message: h.message,
            },
            None => VolumeCondition {
                abnormal: false,
                message: String::new(),
            },
        };
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(volume_condition),
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        require_field(&req.volume_id, "volume_id")?;
        require_field(&req.volume_path, "volume_path")?;
        if let Some(cap) = req.volume_capability.as_ref() {
            super::check_capability(cap).map_err(Status::invalid_argument)?;
        }
        let volume_id = req.volume_id.as_str();
        let (required, limit) = req
            .capacity_range
            .as_ref()
            .map(|r| (r.required_bytes, r.limit_bytes))
            .unwrap_or((0, 0));
        if required < 0 || limit < 0 {
            return Err(Status::invalid_argument(
                "capacity_range values must not be negative",
            ));
        }
        let bytes = if required > 0 { required } else { limit };
        // 1 byte or less means "no quota", as in the Go driver.
        let quota = if bytes <= 1 { 0 } else { bytes as u64 };

        let _guard = self.locks.lock(volume_id).await;
        self.settled(volume_id).await?;
        if self.stager.health(volume_id).is_some() {
            // what the session applies: a larger capacity recorded for the volume stays
            let applied =
                with_timeout(self.timeouts.stage, self.stager.set_quota(volume_id, quota))
                    .await
                    .map_err(stage_status)?;
            self.keep_quota(volume_id, applied);
            tracing::info!(volume_id, quota = applied, "quota applied");
            return Ok(Response::new(NodeExpandVolumeResponse {
                capacity_bytes: if applied == 0 { bytes } else { applied as i64 },
            }));
        }
        let path = PathBuf::from(&req.volume_path);
        let not_found =
            || Status::not_found(format!("volume {volume_id} is not staged on this node"));
        if !path.is_absolute() {
            return Err(not_found());
        }
        match self.state(&path).await {
            Ok(MountState::Healthy) => {
                // Mounted but not served by this process: the quota applies at the next stage.
                self.keep_quota(volume_id, quota);
                tracing::warn!(
                    volume_id,
                    quota,
                    "volume not served by this process; quota applies when staged again"
                );
                Ok(Response::new(NodeExpandVolumeResponse {
                    capacity_bytes: bytes,
                }))
            }
            _ => Err(not_found()),
        }
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: vec![
                rpc_cap(rpc::Type::StageUnstageVolume),
                rpc_cap(rpc::Type::GetVolumeStats),
                rpc_cap(rpc::Type::ExpandVolume),
                rpc_cap(rpc::Type::VolumeCondition),
                rpc_cap(rpc::Type::SingleNodeMultiWriter),
            ],
        }))
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        // Like the Go driver: a failure to read the node's labels fails the call (kubelet
        // retries the registration) rather than registering the node without its topology.
        let segments = self
            .topology
            .segments()
            .await
            .map_err(|e| e.into_status())?;
        let accessible_topology = (!segments.is_empty()).then_some(Topology { segments });
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.config.node_id.clone(),
            max_volumes_per_node: self.config.max_volumes_per_node.max(0),
            accessible_topology,
        }))
    }
}

/// Keeps `seaweedfs_csi_published_targets` equal to the publications this process knows.
fn set_published_gauge(vols: &HashMap<String, StagedVolume>) {
    let n: usize = vols.values().map(|v| v.publications.len()).sum();
    crate::metrics::global().published_targets.set(n as i64);
}
