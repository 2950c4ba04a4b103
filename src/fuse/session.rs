//! Lifecycle of one mounted volume: build the clients and the [`Fs`], mount it with fuser, keep
//! it coherent (metadata subscription, directory-time write-back) and unmount it cleanly.
//!
//! Over 800 lines: mount, adopt, hand over and unmount of one session share its serving state,
//! so they stay together.

use crate::cache::ChunkCache;
use crate::config::MountOptions;
use crate::filer::grpc::FilerClientOptions;
use crate::filer::hub::{FilerHub, SessionFiler};
use crate::filer::subscribe::SubscriptionEvent;
use crate::filer::{FilerApi, FilerError};
use crate::fs::{ChunkCondition, Fs, FsConfig, FsError};
use crate::security::SecurityConfig;
use crate::volume::http::{VolumeClient, VolumeClientOptions};
use crate::volume::VolumeError;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("filer: {0}")]
    Filer(#[from] FilerError),
    #[error("volume servers: {0}")]
    Volume(#[from] VolumeError),
    #[error("filesystem: {0}")]
    Fs(#[from] FsError),
    #[error("mount point {path}: {msg}")]
    MountPoint { path: PathBuf, msg: String },
    #[error("mount of {path} failed: {source}")]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Smallest chunk cache: sequential readahead lands in the cache, so even `cacheCapacityMB=0`
/// keeps this much (readahead in flight is bounded separately by `concurrentReaders`).
pub use crate::budget::MIN_CACHE_BYTES;

/// Chunk cache size of a session without a node memory budget (`--memoryBudgetMB=0`):
/// `cacheCapacityMB` less the chunks that may be in flight for readahead (at most a quarter
/// of it), so that a full cache, fetches in flight and the runtime together stay within
/// `cacheCapacityMB` + 64 MiB of resident memory. With a budget, the node's tier is used.
pub fn cache_bytes(opts: &MountOptions) -> u64 {
    let cap = opts.cache_capacity_mb << 20;
    let in_flight = opts.concurrent_readers as u64 * (u64::from(opts.chunk_size_limit_mb) << 20);
    cap.saturating_sub(in_flight.min(cap / 4))
        .max(MIN_CACHE_BYTES)
}

/// Puts every thread's allocations in one glibc arena. Chunks are allocated on one thread and
/// freed on another; with an arena per thread the freed space is reused by few allocations
/// and resident memory grew ~220 MiB past a full 992 MiB cache in the benchmark, against ~80
/// MiB with one arena, which also cost the least CPU (a low mmap threshold kept memory as
/// low but page-faulted every new buffer: +30 % CPU on writes). Call it before threads start
/// (`main` does); `build_fs` calls it too, for embedders.
///
/// The mmap threshold is fixed just above 16 MiB: chunks of up to 16 MiB (2 MiB by default)
/// stay in the arena (larger ones, `chunkSizeLimitMB` > 16, are mapped: a page fault per new
/// page), while fuser's zeroed 16 MiB + 4 KiB read buffer (one per FUSE thread, four per
/// volume) is mapped, and so resident only as far as requests fill it. With glibc's sliding
/// threshold, one freed large buffer moved the rest into the heap, where `calloc` zeroes
/// reused memory: ~17 MiB resident per idle staged volume. Each setting is left alone when
/// the operator gives it (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`,
/// `MALLOC_TRIM_THRESHOLD_` or its `GLIBC_TUNABLES` name).
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const MMAP_THRESHOLD: libc::c_int = (16 << 20) + 2048;
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
            let given = |env: &str, tunable: &str| {
                std::env::var_os(env).is_some() || tunables.contains(tunable)
            };
            // SAFETY: mallopt only changes allocator parameters.
            unsafe {
                if !given("MALLOC_ARENA_MAX", "malloc.arena_max") {
                    libc::mallopt(libc::M_ARENA_MAX, 1);
                }
                if !given("MALLOC_MMAP_THRESHOLD_", "malloc.mmap_threshold") {
                    libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
                }
                if !given("MALLOC_TRIM_THRESHOLD_", "malloc.trim_threshold") {
                    libc::mallopt(libc::M_TRIM_THRESHOLD, 32 << 20);
                }
            }
        });
    }
}

/// Every 5 s, gives the pages of free heap memory back to the kernel (`malloc_trim`). glibc
/// returns only the heap's top by itself: the holes that evicted 2 MiB chunks leave between
/// small allocations stay resident (in the node memory benchmark the trimmer lowered the peak
/// by 144 MiB). A pass holds the arena's lock while it walks the free chunks, so allocations
/// wait for it (a pass of 20 ms or more is logged); pages given back cost a fault when reused. `SEAWEEDFS_HEAP_TRIM_SECS` sets
/// the period (0: off).
pub fn start_heap_trimmer() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        let secs = match std::env::var("SEAWEEDFS_HEAP_TRIM_SECS") {
            Err(_) => 5,
            Ok(v) => v.parse::<u64>().unwrap_or_else(|_| {
                tracing::warn!(
                    value = v,
                    "SEAWEEDFS_HEAP_TRIM_SECS is not a number; using 5"
                );
                5
            }),
        };
        if secs == 0 {
            return;
        }
        ONCE.call_once(|| {
            let spawned =
                std::thread::Builder::new()
                    .name("heap-trim".into())
                    .spawn(move || loop {
                        std::thread::sleep(Duration::from_secs(secs));
                        let t0 = std::time::Instant::now();
                        // SAFETY: malloc_trim only releases free memory of the allocator.
                        unsafe {
                            libc::malloc_trim(0);
                        }
                        let ms = t0.elapsed().as_millis() as u64;
                        if ms >= 20 {
                            tracing::info!(ms, "heap trim took long");
                        }
                    });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start the heap trimmer");
            }
        });
    }
}

/// Adds the disk tier under `cacheDir`, sized by `cacheCapacityMB` (as the Go driver and
/// `weed mount` size theirs). Not with the filer's `cipher` on: chunks are kept decrypted, and
/// the cluster's encryption must not end at the node's disk. A directory that cannot be used
/// costs only the tier.
async fn with_disk_tier(cache: ChunkCache, opts: &MountOptions, cipher: bool) -> ChunkCache {
    let (Some(dir), cap) = (&opts.cache_dir, opts.cache_capacity_mb << 20) else {
        return cache;
    };
    if cap == 0 {
        return cache;
    }
    if cipher {
        tracing::info!(dir = %dir.display(), "the filer encrypts chunks: no disk cache");
        return cache;
    }
    // reads the directory: off the async threads
    let d = dir.clone();
    let opened = tokio::task::spawn_blocking(move || crate::cache::disk::DiskCache::open(&d, cap))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    match opened {
        Ok(d) => {
            tracing::info!(dir = %dir.display(), capacity_mb = opts.cache_capacity_mb, cached_mb = d.weighted_size() >> 20, "disk chunk cache");
            cache.with_disk(d)
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "disk chunk cache unusable; memory only");
            cache
        }
    }
}

/// Builds the filesystem for `opts` (nothing is mounted yet) on the node's shared connection
/// to its filer ([`FilerHub::global`]); the returned view carries the session's signature.
pub async fn build_fs(
    opts: &MountOptions,
    security: &SecurityConfig,
) -> Result<(Arc<Fs>, Arc<SessionFiler>), MountError> {
    let shared = FilerHub::global()
        .connect(FilerClientOptions {
            addresses: opts.filers.clone(),
            security: security.clone(),
            ..Default::default()
        })
        .await?;
    let session = shared.session();
    let filer: Arc<dyn FilerApi> = session.clone();
    let conf = filer.configuration().await?;
    let store = VolumeClient::new(
        filer.clone(),
        VolumeClientOptions {
            access: opts.volume_server_access,
            security: security.clone(),
            data_center: opts.data_center.clone(),
            read_retry: Duration::from_secs(opts.read_retry_secs.max(1)),
            ..Default::default()
        },
    )?;
    let mut cfg = FsConfig::from_mount_options(opts);
    cfg.cipher = conf.cipher;
    cfg.chunk_condition = ChunkCondition::of_version(conf.major_version, conf.minor_version);
    if cfg.chunk_condition == ChunkCondition::Unknown {
        tracing::warn!(version = %conf.version, "the filer is older than SeaweedFS 4.41 and cannot check a commit's chunk list: nodes writing one file at once are not merged, the last commit wins");
    }
    tune_allocator();
    let cache = with_disk_tier(ChunkCache::for_node(cache_bytes(opts)), opts, conf.cipher).await;
    let store = Arc::new(crate::instrumented::InstrumentedStore(Arc::new(store)));
    let fs = Fs::new(cfg, filer, store, cache);
    fs.init_root().await?;
    Ok((fs, session))
}

/// Background work of a mounted filesystem: coherence and write-back. Its events come from
/// the node's one subscription to the filer (a route on `session`'s connection), which ends
/// when the event task is aborted.
pub fn spawn_background(fs: &Arc<Fs>, session: &SessionFiler) -> Vec<tokio::task::JoinHandle<()>> {
    // from before the filesystem's first lookup: what it read is no older than this
    let since_ns = fs.created_ns;
    let prefix = if fs.cfg.root == "/" {
        "/".to_string()
    } else {
        format!("{}/", fs.cfg.root)
    };
    let mut sub = session.subscribe(&prefix, since_ns);
    let f = fs.clone();
    let events = tokio::spawn(async move {
        while let Some(ev) = sub.recv().await {
            match ev {
                SubscriptionEvent::Event(e) => f.apply_event(&e),
                SubscriptionEvent::Resync => f.resync(),
                SubscriptionEvent::Recheck(e) => f.recheck_event(&e),
            }
        }
    });
    let f = fs.clone();
    let flusher = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        for n in 0u64.. {
            tick.tick().await;
            f.flush_dir_times().await;
            f.cache.expire_arrived();
            if n % 10 == 0 {
                f.sweep_caches();
            }
        }
    });
    // apart: a prune waiting in the kernel (or for the keeper) holds up no other chore
    let f = fs.clone();
    let pruner = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let p = f.clone();
            let _ = tokio::task::spawn_blocking(move || p.prune_nodes()).await;
        }
    });
    let f = fs.clone();
    let health = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            let ok = tokio::time::timeout(Duration::from_secs(5), f.filer.configuration()).await;
            f.set_healthy(matches!(ok, Ok(Ok(_))));
            let _ = tokio::time::timeout(Duration::from_secs(5), f.refresh_capacity()).await;
            if f.quota() > 0 {
                f.refresh_usage().await;
            }
        }
    });
    let f = fs.clone();
    let pressure = tokio::spawn(async move { f.relieve_memory_pressure().await });
    vec![events, flusher, pruner, health, pressure]
}

/// Checks that `dir` can be mounted on: exists (or is created), is a directory, is empty
/// unless `nonempty`.
pub fn check_mount_point(dir: &Path, create: bool, nonempty: bool) -> Result<(), MountError> {
    let bad = |msg: &str| MountError::MountPoint {
        path: dir.to_path_buf(),
        msg: msg.to_string(),
    };
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => return Err(bad("is not a directory")),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            std::fs::create_dir_all(dir).map_err(|e| bad(&format!("cannot create: {e}")))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(bad("does not exist (use --dirAutoCreate)"))
        }
        Err(e) => {
            return Err(bad(&format!(
                "cannot stat: {e} (a dead mount? unmount it first)"
            )))
        }
    }
    if !nonempty {
        let mut it = std::fs::read_dir(dir).map_err(|e| bad(&format!("cannot list: {e}")))?;
        if it.next().is_some() {
            return Err(bad("is not empty (use --nonempty to mount over it)"));
        }
    }
    Ok(())
}

/// fuser mount options for a volume.
pub fn fuse_config(opts: &MountOptions, fsname: String) -> fuser::Config {
    use fuser::MountOption as O;
    let mut mo = vec![
        O::FSName(fsname),
        O::Subtype("seaweedfs".into()),
        O::DefaultPermissions,
        O::NoDev,
        O::NoSuid,
        O::CUSTOM("max_read=1048576".into()),
    ];
    if opts.read_only {
        mo.push(O::RO);
    }
    let mut c = fuser::Config::default();
    c.mount_options = mo;
    c.acl = if opts.allow_others {
        fuser::SessionACL::All
    } else {
        fuser::SessionACL::RootAndOwner
    };
    c.n_threads = Some(opts.fuse_threads.max(1));
    c.clone_fd = false;
    c
}

/// Raises the mount's kernel readahead (its bdi's `read_ahead_kb` stays at 128 KiB otherwise).
pub fn raise_readahead(mountpoint: &Path, kb: u32) {
    let Some((major, minor)) = mount_device(mountpoint) else {
        return;
    };
    let p = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = std::fs::write(&p, kb.to_string()) {
        tracing::debug!(path = p, error = %e, "cannot raise readahead");
    }
}

/// The FUSE adapter of `fs`, and its linger (attached by [`serving_device`]).
fn new_adapter(
    fs: &Arc<Fs>,
    opts: &MountOptions,
) -> (super::adapter::FuseAdapter, Arc<super::linger::Linger>) {
    let linger = Arc::new(super::linger::Linger::new(Duration::from_micros(
        opts.fuse_spin_us,
    )));
    let adapter =
        super::adapter::FuseAdapter::new(fs.clone(), tokio::runtime::Handle::current(), None)
            .with_linger(linger.clone());
    (adapter, linger)
}

/// Just before a session serves: attaches `linger` to its FUSE device and returns a duplicate
/// of that device (see [`raw_device`]).
fn serving_device<F: fuser::Filesystem>(
    s: &fuser::Session<F>,
    linger: &super::linger::Linger,
) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{AsFd, AsRawFd};
    linger.attach(s.as_fd().as_raw_fd());
    raw_device(s)
}

/// A duplicate of a session's FUSE device fd (None, logged, if it cannot be made).
fn raw_device<F: fuser::Filesystem>(s: &fuser::Session<F>) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::AsFd;
    s.as_fd()
        .try_clone_to_owned()
        .inspect_err(|e| tracing::warn!(error = %e, "cannot duplicate the FUSE device fd; nodes are not pruned"))
        .ok()
}

pub fn fsname(opts: &MountOptions) -> String {
    format!(
        "{}:{}",
        opts.filers.first().cloned().unwrap_or_default(),
        opts.filer_path
    )
}

/// What a successor needs to serve a volume it adopts (stored in the keeper's blob).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VolumeState {
    pub volume_id: String,
    pub opts: MountOptions,
    /// The inode table at a graceful handover (after a crash the journal memfd has it).
    pub inodes: Vec<crate::fs::inode::NodeRecord>,
    /// True when the previous process flushed everything and stopped serving on purpose.
    pub graceful: bool,
    /// Names the session at the keeper across adoptions (see [`KeeperClient::put_session`]);
    /// absent in blobs of older versions.
    ///
    /// [`KeeperClient::put_session`]: crate::keeper::KeeperClient::put_session
    #[serde(default)]
    pub token: Option<u64>,
}

impl VolumeState {
    /// Fills in what a predecessor of an older version did not record: its options do not
    /// name the volume, which NodeExpandVolume's capacity record is named after.
    fn completed(mut self) -> Self {
        if self.opts.volume_id.is_empty() {
            self.opts.volume_id = self.volume_id.clone();
        }
        self
    }
}

type Blob = super::takeover::Handover<VolumeState>;

/// How a session is served.
enum Serving {
    /// fuser owns the mount; dropping the session unmounts (the `mount` command).
    Plain(fuser::BackgroundSession),
    /// Takeover-capable: the fd-keeper holds dups of the connection and of the inode journal;
    /// nothing unmounts unless asked (CSI node plugin).
    Kept(Box<KeptSession>),
}

struct KeptSession {
    bg: Option<fuser::BackgroundSession>,
    keeper: Arc<crate::keeper::KeeperClient>,
    gate: Arc<super::adapter::Gate>,
    volume_id: String,
    opts: MountOptions,
    init: super::takeover::InitParams,
    token: Option<u64>,
}

/// One mounted volume served by this process.
pub struct MountedVolume {
    pub fs: Arc<Fs>,
    pub mountpoint: PathBuf,
    /// The FUSE connection id (minor of the mount's st_dev), for aborting it.
    conn: Option<u32>,
    serving: Option<Serving>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn mount_err(path: &Path, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> MountError {
    MountError::Mount {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    }
}

impl MountedVolume {
    /// The CSI volume id of a kept session.
    pub fn volume_id(&self) -> Option<String> {
        match &self.serving {
            Some(Serving::Kept(k)) => Some(k.volume_id.clone()),
            _ => None,
        }
    }

    /// Builds the filesystem and mounts it at `mountpoint` (which must be checked already).
    pub async fn mount(
        opts: &MountOptions,
        security: &SecurityConfig,
        mountpoint: &Path,
    ) -> Result<Self, MountError> {
        let (fs, session) = build_fs(opts, security).await?;
        let (adapter, linger) = new_adapter(&fs, opts);
        let mut config = fuse_config(opts, fsname(opts));
        // fuser's direct mount drops Subtype; pass it raw so the mount shows as fuse.seaweedfs
        // (takeover::mount_fresh puts it in the fs type instead)
        config
            .mount_options
            .push(fuser::MountOption::CUSTOM("subtype=seaweedfs".into()));
        let mp = mountpoint.to_path_buf();
        let (bg, raw) = tokio::task::spawn_blocking(move || {
            let s = fuser::Session::new(adapter, &mp, &config)?;
            let raw = serving_device(&s, &linger);
            s.spawn().map(|bg| (bg, raw))
        })
        .await
        .map_err(|e| mount_err(mountpoint, e.to_string()))?
        .map_err(|e| MountError::Mount {
            path: mountpoint.to_path_buf(),
            source: e,
        })?;
        Ok(Self::started(
            fs,
            &session,
            mountpoint,
            Serving::Plain(bg),
            None,
            raw,
        ))
    }

    /// `kept`: the keeper's notifier for a kept session (else invalidations are written here).
    /// `raw`: the session's FUSE device, for notifications fuser does not write.
    fn started(
        fs: Arc<Fs>,
        session: &SessionFiler,
        mountpoint: &Path,
        serving: Serving,
        kept: Option<crate::keeper::KeeperNotifier>,
        raw: Option<std::os::fd::OwnedFd>,
    ) -> Self {
        let bg = match &serving {
            Serving::Plain(bg) => Some(bg),
            Serving::Kept(k) => k.bg.as_ref(),
        };
        // A kept session whose keeper cannot write for it does not prune: written here, an
        // eviction waiting in the kernel would keep a killed plugin from exiting, and with
        // it the fd its successor needs.
        let raw = raw.filter(|_| matches!(serving, Serving::Plain(_)) || kept.is_some());
        if let Some(bg) = bg {
            let direct = super::adapter::KernelNotifier::new(bg.notifier(), raw);
            match kept {
                Some(keeper) => {
                    fs.set_notifier(Arc::new(super::adapter::KeptNotifier::new(keeper, direct)))
                }
                None => fs.set_notifier(Arc::new(direct)),
            }
        }
        raise_readahead(mountpoint, 4096);
        register_metrics(&fs);
        let tasks = spawn_background(&fs, session);
        let conn = connection_id(mountpoint);
        tracing::info!(mountpoint = %mountpoint.display(), root = %fs.cfg.root, conn, "serving");
        MountedVolume {
            fs,
            mountpoint: mountpoint.to_path_buf(),
            conn,
            serving: Some(serving),
            tasks,
        }
    }

    /// Mounts a takeover-capable session whose fds the keeper holds.
    pub async fn mount_kept(
        volume_id: &str,
        opts: &MountOptions,
        security: &SecurityConfig,
        mountpoint: &Path,
        keeper: Arc<crate::keeper::KeeperClient>,
    ) -> Result<Self, MountError> {
        let (fs, session) = build_fs(opts, security).await?;
        let journal =
            Arc::new(crate::fs::journal::Journal::create().map_err(|e| mount_err(mountpoint, e))?);
        fs.inodes.set_journal(journal.clone());
        let dirty =
            crate::fs::verifier::DirtyLog::create().map_err(|e| mount_err(mountpoint, e))?;
        let dfd = dirty
            .fd()
            .try_clone_to_owned()
            .map_err(|e| mount_err(mountpoint, e))?;
        fs.verifier.attach(dirty);
        let (adapter, linger) = new_adapter(&fs, opts);
        let gate = adapter.gate();
        let config = fuse_config(opts, fsname(opts));
        let mp = mountpoint.to_path_buf();
        let mounted = tokio::task::spawn_blocking(move || {
            super::takeover::mount_fresh(adapter, &mp, &config)
        })
        .await
        .map_err(|e| mount_err(mountpoint, e.to_string()))?
        .map_err(|e| MountError::Mount {
            path: mountpoint.to_path_buf(),
            source: e,
        })?;
        let token = Some(rand::random::<u64>());
        let state = VolumeState {
            volume_id: volume_id.to_string(),
            opts: opts.clone(),
            inodes: Vec::new(),
            graceful: false,
            token,
        };
        let blob = Blob::new(mountpoint.to_path_buf(), mounted.init.clone(), state)
            .to_bytes()
            .map_err(|e| mount_err(mountpoint, e))?;
        let k = keeper.clone();
        let id = volume_id.to_string();
        let fd = mounted.fd;
        let jfd = journal
            .fd()
            .try_clone_to_owned()
            .map_err(|e| mount_err(mountpoint, e))?;
        let put = tokio::task::spawn_blocking(move || {
            use std::os::fd::AsFd;
            k.put_session(&id, token, &blob, &[fd.as_fd(), jfd.as_fd(), dfd.as_fd()])
        })
        .await
        .map_err(|e| mount_err(mountpoint, e.to_string()))?;
        if let Err(e) = put {
            // without the keeper the session would not survive us: do not serve it
            let _ = super::takeover::unmount(mountpoint);
            return Err(mount_err(mountpoint, format!("fd-keeper: {e}")));
        }
        let notifier = keeper_notifier(&keeper, volume_id, token).await;
        let raw = serving_device(&mounted.session, &linger);
        let bg = mounted.session.spawn().map_err(|e| MountError::Mount {
            path: mountpoint.to_path_buf(),
            source: e,
        })?;
        let serving = Serving::Kept(Box::new(KeptSession {
            bg: Some(bg),
            keeper,
            gate,
            volume_id: volume_id.to_string(),
            opts: opts.clone(),
            init: mounted.init,
            token,
        }));
        Ok(Self::started(
            fs, &session, mountpoint, serving, notifier, raw,
        ))
    }

    /// Adopts a session a previous process left with the keeper (crash or upgrade). `keeper`
    /// must be the connection that was granted the claim.
    pub async fn adopt(
        entry: crate::keeper::KeptEntry,
        security: &SecurityConfig,
        keeper: Arc<crate::keeper::KeeperClient>,
    ) -> Result<Self, MountError> {
        let blob = Blob::from_bytes(&entry.blob).map_err(|e| mount_err(Path::new("?"), e))?;
        let mountpoint = blob.mountpoint.clone();
        let mut fds = entry.fds.into_iter();
        let fuse_fd = fds
            .next()
            .ok_or_else(|| mount_err(&mountpoint, "keeper entry has no FUSE fd"))?;
        let journal = match fds.next() {
            Some(fd) => Arc::new(
                crate::fs::journal::Journal::open(fd).map_err(|e| mount_err(&mountpoint, e))?,
            ),
            None => Arc::new(
                crate::fs::journal::Journal::create().map_err(|e| mount_err(&mountpoint, e))?,
            ),
        };
        let dirty_fd = fds.next();
        let state = blob.state.completed();
        // The kernel queues requests meanwhile; keep trying while the filer is unreachable.
        let mut pauses = crate::retry::RECONNECT.pauses();
        let (fs, filer) = loop {
            match build_fs(&state.opts, security).await {
                Ok(built) => break built,
                Err(e) => {
                    tracing::warn!(volume_id = %state.volume_id, error = %e, "adopt: filer not ready, retrying");
                    tokio::time::sleep(pauses.next_pause()).await;
                }
            }
        };
        fs.inodes.restore(state.inodes.clone());
        match journal.replay() {
            Ok(ops) => fs.inodes.replay(ops),
            Err(e) => {
                tracing::warn!(error = %e, "inode journal unreadable; unknown node ids will get ESTALE")
            }
        }
        fs.inodes.set_journal(journal);
        // before serving: the first request may carry a handle that lost data
        match dirty_fd {
            Some(fd) => {
                fs.verifier.adopt(crate::fs::verifier::DirtyLog::open(fd));
            }
            None => {
                tracing::warn!(volume_id = %state.volume_id, "the previous process kept no dirty-inode log (older version); lost writes are not reported until the volume is staged again")
            }
        }
        let (adapter, linger) = new_adapter(&fs, &state.opts);
        let gate = adapter.gate();
        let config = fuse_config(&state.opts, fsname(&state.opts));
        let init = blob.init.clone();
        let init2 = init.clone();
        let session = tokio::task::spawn_blocking(move || {
            super::takeover::adopt(adapter, fuse_fd, &init2, &config)
        })
        .await
        .map_err(|e| mount_err(&mountpoint, e.to_string()))?
        .map_err(|e| MountError::Mount {
            path: mountpoint.clone(),
            source: e,
        })?;
        // init() above saw the kernel's offer; what the kernel enforces is what the first
        // daemon agreed to (a predecessor of another version may have asked differently)
        if let Some(agreed) = &init.agreed {
            fs.set_posix_acl(super::adapter::posix_acl_negotiated(agreed.flags));
        }
        let notifier = keeper_notifier(&keeper, &state.volume_id, state.token).await;
        let raw = serving_device(&session, &linger);
        let bg = session.spawn().map_err(|e| MountError::Mount {
            path: mountpoint.clone(),
            source: e,
        })?;
        tracing::info!(volume_id = %state.volume_id, mountpoint = %mountpoint.display(),
            graceful = state.graceful, nodes = fs.inodes.len(), posix_acl = fs.posix_acl(),
            "adopted live FUSE session");
        let serving = Serving::Kept(Box::new(KeptSession {
            bg: Some(bg),
            keeper,
            gate,
            volume_id: state.volume_id.clone(),
            opts: state.opts.clone(),
            init,
            token: state.token,
        }));
        Ok(Self::started(
            fs,
            &filer,
            &mountpoint,
            serving,
            notifier,
            raw,
        ))
    }

    /// Graceful handover: stop answering, flush everything, leave the state for the successor.
    /// The mount stays; the caller exits afterwards without unmounting.
    pub async fn hand_over(mut self) -> Result<(), MountError> {
        let Some(Serving::Kept(k)) = self.serving.take() else {
            return self.unmount().await;
        };
        let KeptSession {
            bg,
            keeper,
            gate,
            volume_id,
            opts,
            init,
            token,
        } = *k;
        let started = std::time::Instant::now();
        // before the gate closes: an invalidation in progress may need a request answered
        if !self.fs.stop_notifying(Duration::from_secs(10)).await {
            tracing::warn!(volume_id, "kernel invalidations still running at handover");
        }
        if !gate.close_and_wait(Duration::from_secs(30)).await {
            tracing::warn!(volume_id, "requests still running at handover");
        }
        // first: a caller's timeout may drop this future in the flush below
        self.fs.close();
        let flushed = self.fs.flush_all().await;
        for t in self.tasks.drain(..) {
            t.abort();
        }
        let state = VolumeState {
            volume_id: volume_id.clone(),
            opts,
            inodes: self.fs.inodes.snapshot(),
            graceful: true,
            token,
        };
        let blob = Blob::new(self.mountpoint.clone(), init, state)
            .to_bytes()
            .map_err(|e| mount_err(&self.mountpoint, e))?;
        let id = volume_id.clone();
        let k = keeper.clone();
        tokio::task::spawn_blocking(move || k.update_blob(&id, &blob))
            .await
            .map_err(|e| mount_err(&self.mountpoint, e.to_string()))?
            .map_err(|e| mount_err(&self.mountpoint, format!("fd-keeper: {e}")))?;
        // Leave the fuser threads blocked on the fd; process exit releases them.
        std::mem::forget(bg);
        std::mem::forget(keeper);
        tracing::info!(
            volume_id,
            took_ms = started.elapsed().as_millis() as u64,
            "handed over"
        );
        flushed.map_err(MountError::Fs)
    }

    /// The kernel ended the FUSE connection (an unmount from outside, once nothing uses the
    /// mount any more): fuser's session loop returns on ENODEV.
    pub fn session_ended(&self) -> bool {
        match &self.serving {
            Some(Serving::Plain(bg)) => bg.guard.is_finished(),
            Some(Serving::Kept(k)) => k.bg.as_ref().is_some_and(|bg| bg.guard.is_finished()),
            None => true,
        }
    }

    /// Flushes everything dirty, then unmounts (and tells the keeper the session is over).
    pub async fn unmount(self) -> Result<(), MountError> {
        self.finish(true, false).await
    }

    /// [`Self::unmount`] for a process about to exit: fuser's session is left to the exit
    /// instead of dropped (see [`Self::close_after_outside_unmount`]).
    pub async fn unmount_before_exit(self) -> Result<(), MountError> {
        self.finish(true, true).await
    }

    /// After an unmount from outside ([`Self::session_ended`]), in a process about to exit:
    /// flushes what is dirty and ends the session, but unmounts nothing. Whatever is at the
    /// path now is someone else's mount, even with our connection id: ids are device minors
    /// the kernel hands out again at once (xfstests' cycle mounts saw the old daemon take
    /// the new mount down).
    pub async fn close_after_outside_unmount(self) -> Result<(), MountError> {
        self.finish(false, true).await
    }

    /// `leave_session`: fuser 0.18 unmounts the path once more when its session is dropped
    /// (its "already unmounted?" poll test is inverted), which would take down a new mount
    /// there; an exiting process leaves it (an fd and a thread) to the exit instead.
    async fn finish(mut self, may_unmount: bool, leave_session: bool) -> Result<(), MountError> {
        // read before the flush, which can take seconds: a connection id is a device minor
        // the kernel hands out again, so a mount made at the path meanwhile may reuse ours
        let still_ours =
            may_unmount && self.conn.is_some() && connection_id(&self.mountpoint) == self.conn;
        // first: a caller's timeout may drop this future in the flush below
        self.fs.close();
        let flushed = self.fs.flush_all().await;
        for t in self.tasks.drain(..) {
            t.abort();
        }
        // closes the keeper's notifier connections (their threads hold the FUSE fd) before
        // anything below can be cut short; nothing needs the kernel's caches dropped now
        self.fs.drop_notifier();
        let mp = self.mountpoint.clone();
        let (bg, keeper) = match self.serving.take() {
            Some(Serving::Plain(bg)) => (Some(bg), None),
            Some(Serving::Kept(k)) => (k.bg, Some((k.keeper, k.volume_id, k.token))),
            None => (None, None),
        };
        let conn = self.conn;
        // whatever is at the path now is not ours to unmount (maybe a new mount there); but
        // our own connection still mounted there is (fuser's session thread can end while the
        // mount stays, as in a chroot without fusermount: the mount was left behind)
        let ended = !may_unmount || (self.session_ended() && !still_ours);
        let unmounted = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let r = if ended {
                Ok(())
            } else {
                super::takeover::unmount(&mp)
            };
            if let Some((keeper, volume_id, token)) = keeper {
                // by token: this may run late (a timed-out unstage), after a new stage of the
                // volume put its own session there
                if let Err(e) = keeper.drop_session(&volume_id, token) {
                    tracing::warn!(volume_id, error = %e, "fd-keeper drop failed");
                }
            }
            if let Some(bg) = bg {
                if leave_session {
                    let waited = std::time::Instant::now();
                    while !bg.guard.is_finished() && waited.elapsed() < Duration::from_secs(3) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    std::mem::forget(bg);
                } else {
                    join_or_abort(bg, conn);
                }
            }
            r
        })
        .await
        .map_err(|e| mount_err(&self.mountpoint, e.to_string()))?;
        if let Err(e) = unmounted {
            // already gone (e.g. replaced by the node service): not an error for us
            if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) {
                tracing::debug!(mountpoint = %self.mountpoint.display(), error = %e, "unmount");
            } else {
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e, "unmount failed");
            }
        }
        tracing::info!(mountpoint = %self.mountpoint.display(), "unmounted");
        flushed.map_err(MountError::Fs)
    }
}

impl Drop for MountedVolume {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        // (a kept session's filesystem may live on, unreported, in the forgotten session)
        self.fs.leave_budget();
        match self.serving.take() {
            // dropping a plain session unmounts: never leave a dead mount behind
            Some(Serving::Plain(bg)) => drop(bg),
            // a kept session outlives this object on purpose (the keeper holds it)
            Some(Serving::Kept(k)) => std::mem::forget(k.bg),
            None => {}
        }
    }
}

/// The keeper's notifier connections for a kept session; None (logged) if the keeper cannot
/// give them (an older keeper): this process then writes its invalidations itself, and a
/// SIGKILL while one waits in the kernel can leave it unable to exit (docs/SEMANTICS.md).
async fn keeper_notifier(
    keeper: &Arc<crate::keeper::KeeperClient>,
    volume_id: &str,
    token: Option<u64>,
) -> Option<crate::keeper::KeeperNotifier> {
    let path = keeper.path().to_path_buf();
    let id = volume_id.to_string();
    let opened =
        tokio::task::spawn_blocking(move || crate::keeper::KeeperNotifier::open(&path, &id, token))
            .await;
    match opened {
        Ok(Ok(n)) => Some(n),
        Ok(Err(e)) => {
            tracing::warn!(volume_id, error = %e,
                "the fd-keeper does not take this session's invalidations (see the error; a keeper older than this plugin refuses them); writing them here");
            None
        }
        Err(e) => {
            tracing::warn!(volume_id, error = %e, "opening the keeper's notifier failed");
            None
        }
    }
}

/// The FUSE connection id of a mount: the minor number of its device.
fn connection_id(mountpoint: &Path) -> Option<u32> {
    mount_device(mountpoint).map(|(_, minor)| minor)
}

/// The device of the topmost mount at `mountpoint`, from /proc/self/mountinfo. Never touches the
/// mounted filesystem: a stat there would be a FUSE request this very process must answer,
/// and it may be called from a runtime worker the answer needs.
fn mount_device(mountpoint: &Path) -> Option<(u32, u32)> {
    let mounts = crate::csi::mounts::read_mountinfo().ok()?;
    mounts
        .iter()
        .rev()
        .find(|m| m.mount_point == mountpoint)
        .map(|m| (m.major, m.minor))
}

/// Waits for the session threads; if the connection is still referenced elsewhere (a bind
/// mount that outlived the staging mount), aborts it so they end and nothing hangs.
fn join_or_abort(bg: fuser::BackgroundSession, conn: Option<u32>) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(bg.join());
    });
    if rx.recv_timeout(Duration::from_secs(3)).is_ok() {
        return;
    }
    if let Some(id) = conn {
        match abort_connection(id) {
            Ok(()) => tracing::warn!(
                conn = id,
                "aborted a FUSE connection still referenced after unmount"
            ),
            Err(e) => tracing::warn!(conn = id, error = %e, "cannot abort FUSE connection"),
        }
    }
    if rx.recv_timeout(Duration::from_secs(3)).is_err() {
        tracing::warn!(?conn, "FUSE session threads did not end; leaving them");
    }
}

/// Aborts a FUSE connection through fusectl (mounting it if needed).
pub fn abort_connection(id: u32) -> std::io::Result<()> {
    let dir = Path::new("/sys/fs/fuse/connections");
    let abort = dir.join(id.to_string()).join("abort");
    if !abort.exists() {
        let _ = nix::mount::mount(
            Some("fusectl"),
            dir,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
    }
    std::fs::write(&abort, b"1")
}

/// Sessions whose cache and upload counters are exported (`seaweedfs_csi_cache_*`).
static LIVE: parking_lot::Mutex<Vec<(String, std::sync::Weak<Fs>)>> =
    parking_lot::Mutex::new(Vec::new());

/// Registers a session for the per-volume metrics (one collector exports every session).
fn register_metrics(fs: &Arc<Fs>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| crate::metrics::global().add_collector(Box::new(SessionCollector)));
    let mut live = LIVE.lock();
    live.retain(|(_, w)| w.strong_count() > 0);
    live.push((fs.cfg.root.clone(), Arc::downgrade(fs)));
}

type SessionValue = fn(&Fs) -> u64;

/// A number of the session's disk cache tier (0 without one).
fn disk_stat(f: &Fs, v: impl Fn(&crate::cache::disk::DiskCache) -> u64) -> u64 {
    f.cache.disk().map(|d| v(d)).unwrap_or(0)
}

/// The families of [`SessionCollector`]: name (a counter's without `_total`), type, help and
/// the value of one session.
const SESSION_FAMILIES: [(&str, MetricType, &str, SessionValue); 13] = [
    (
        "seaweedfs_csi_cache_hits",
        MetricType::Counter,
        "Chunk reads served from the session cache.",
        |f| f.cache.stats.hits.load(Relaxed),
    ),
    (
        "seaweedfs_csi_cache_misses",
        MetricType::Counter,
        "Chunk reads that fetched from volume servers.",
        |f| f.cache.stats.misses.load(Relaxed),
    ),
    (
        "seaweedfs_csi_cache_evictions",
        MetricType::Counter,
        "Chunks evicted from the session cache.",
        |f| f.cache.stats.evictions.load(Relaxed),
    ),
    (
        "seaweedfs_csi_cache_served_bytes",
        MetricType::Counter,
        "Bytes served from the session cache.",
        |f| f.cache.stats.bytes_from_cache.load(Relaxed),
    ),
    (
        "seaweedfs_csi_cache_fetched_bytes",
        MetricType::Counter,
        "Bytes fetched from volume servers.",
        |f| f.cache.stats.bytes_fetched.load(Relaxed),
    ),
    (
        "seaweedfs_csi_cache_size_bytes",
        MetricType::Gauge,
        "Bytes held by the session cache.",
        |f| f.cache.weighted_size(),
    ),
    (
        "seaweedfs_csi_disk_cache_hits",
        MetricType::Counter,
        "Chunk reads served from the disk cache under cacheDir.",
        |f| disk_stat(f, |d| d.stats.hits.load(Relaxed)),
    ),
    (
        "seaweedfs_csi_disk_cache_size_bytes",
        MetricType::Gauge,
        "Bytes held by the disk cache under cacheDir.",
        |f| disk_stat(f, |d| d.weighted_size()),
    ),
    (
        "seaweedfs_csi_disk_cache_corrupt",
        MetricType::Counter,
        "Disk cache files dropped because their checksum, length or header was wrong.",
        |f| disk_stat(f, |d| d.stats.corrupt.load(Relaxed)),
    ),
    (
        "seaweedfs_csi_disk_cache_write_errors",
        MetricType::Counter,
        "Chunks the disk cache could not store (full disk, unwritable directory).",
        |f| disk_stat(f, |d| d.stats.write_errors.load(Relaxed)),
    ),
    (
        "seaweedfs_csi_disk_cache_skipped",
        MetricType::Counter,
        "Chunks not put on disk because 128 MiB of disk writes were queued.",
        |f| disk_stat(f, |d| d.stats.skipped.load(Relaxed)),
    ),
    (
        "seaweedfs_csi_inodes",
        MetricType::Gauge,
        "Files and directories the kernel holds a reference to (the session's inode table).",
        |f| f.inodes.len() as u64,
    ),
    (
        "seaweedfs_csi_upload_queue_depth",
        MetricType::Gauge,
        "Chunk uploads in flight.",
        |f| f.uploads_in_flight(),
    ),
];

/// Reads the live sessions' cache and upload numbers at scrape time, summed per volume: two
/// sessions of one filer path must not give two series with the same labels.
#[derive(Debug)]
struct SessionCollector;

impl Collector for SessionCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let live: Vec<(String, Arc<Fs>)> = LIVE
            .lock()
            .iter()
            .filter_map(|(v, w)| w.upgrade().map(|f| (v.clone(), f)))
            .collect();
        let mut per_volume =
            std::collections::BTreeMap::<String, [u64; SESSION_FAMILIES.len()]>::new();
        for (vol, f) in &live {
            let row = per_volume.entry(vol.clone()).or_default();
            for (sum, (.., get)) in row.iter_mut().zip(&SESSION_FAMILIES) {
                *sum += get(f);
            }
        }
        for (i, (name, kind, help, _)) in SESSION_FAMILIES.iter().enumerate() {
            let samples = per_volume
                .iter()
                .map(|(vol, row)| ([("volume", vol.as_str())], row[i]));
            crate::metrics::encode_values(&mut encoder, name, help, *kind, samples)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filer::hub::SharedFiler;
    use crate::filer::mock::MockFiler;
    use crate::fs::inode::ROOT_INO;
    use crate::volume::mock::MockChunkStore;

    async fn listing(fs: &Arc<Fs>) -> Vec<String> {
        let dh = fs.opendir(ROOT_INO).await.unwrap();
        let names = fs
            .readdir(ROOT_INO, dh, 0)
            .await
            .unwrap()
            .entries
            .iter()
            .map(|e| e.name.clone())
            .filter(|n| n != "." && n != "..")
            .collect();
        fs.releasedir(dh);
        names
    }

    /// A blob of an older version has options without the volume's id: the adopted session
    /// records its capacity under the volume's own name all the same.
    #[test]
    fn an_older_blobs_options_get_the_volume_id() {
        let mut v = serde_json::to_value(VolumeState {
            volume_id: "pv-old".into(),
            opts: MountOptions {
                volume_id: "pv-old".into(),
                ..Default::default()
            },
            inodes: Vec::new(),
            graceful: true,
            token: None,
        })
        .unwrap();
        v["opts"].as_object_mut().unwrap().remove("volume_id");
        let old: VolumeState = serde_json::from_value(v).unwrap();
        assert_eq!(old.completed().opts.volume_id, "pv-old");
    }

    /// The collector exports every live session's numbers, one series per volume: sessions
    /// of one filer path are summed (two lines with the same labels would be invalid), and a
    /// dropped session leaves.
    #[tokio::test]
    async fn session_collector_sums_per_volume() {
        let fs_at = |root: &str| {
            let mut cfg = FsConfig::from_mount_options(&MountOptions::default());
            cfg.root = root.into();
            Fs::new(
                cfg,
                Arc::new(MockFiler::new()),
                Arc::new(MockChunkStore::new()),
                ChunkCache::new(1 << 20),
            )
        };
        let (a, b) = (fs_at("/collect/x"), fs_at("/collect/x"));
        let c = fs_at("/collect/\"y\"");
        a.cache.stats.hits.fetch_add(2, Relaxed);
        b.cache.stats.hits.fetch_add(3, Relaxed);
        c.cache.stats.hits.fetch_add(7, Relaxed);
        for f in [&a, &b, &c] {
            register_metrics(f);
        }
        let text = crate::metrics::render_collector(Box::new(SessionCollector));
        let hits: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("seaweedfs_csi_cache_hits_total{volume=\"/collect/"))
            .collect();
        assert_eq!(
            hits,
            [
                r#"seaweedfs_csi_cache_hits_total{volume="/collect/\"y\""} 7"#,
                r#"seaweedfs_csi_cache_hits_total{volume="/collect/x"} 5"#,
            ],
            "{text}"
        );
        assert!(text.contains("# TYPE seaweedfs_csi_cache_size_bytes gauge\n"));
        drop(c);
        let text = crate::metrics::render_collector(Box::new(SessionCollector));
        assert!(!text.contains(r#"volume="/collect/\"y\"""#), "{text}");
    }

    /// Two sessions on one shared connection, the same filer path: each one's cached
    /// listing follows the other's changes through the node's one subscription, for as
    /// long as its background tasks run.
    #[tokio::test]
    async fn background_keeps_the_route_and_sessions_see_each_other() {
        let m = MockFiler::new();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let fs_of = |v: Arc<SessionFiler>| {
            Fs::new(
                FsConfig::from_mount_options(&MountOptions::default()),
                v,
                Arc::new(MockChunkStore::new()),
                ChunkCache::new(1 << 20),
            )
        };
        let (va, vb) = (shared.session(), shared.session());
        let (a, b) = (fs_of(va.clone()), fs_of(vb.clone()));
        let ta = spawn_background(&a, &va);
        let tb = spawn_background(&b, &vb);
        assert!(listing(&b).await.is_empty()); // cached from now on
        let (attr, fh) = a
            .create(ROOT_INO, "from-a", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        a.release(fh, attr.ino).await.unwrap();
        let lists = m.calls("list_page");
        let t0 = std::time::Instant::now();
        while !listing(&b).await.contains(&"from-a".to_string()) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "event never applied"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(m.calls("list_page"), lists, "from the event, not a re-read");
        assert_eq!(shared.routes(), 2);
        for t in ta.into_iter().chain(tb) {
            t.abort();
        }
        let t0 = std::time::Instant::now();
        while shared.routes() > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "routes end with the tasks"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
