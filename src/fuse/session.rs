//! Lifecycle of one mounted volume: build the clients and the [`Fs`], mount it with fuser, keep
//! it coherent (metadata subscription, directory-time write-back) and unmount it cleanly.

use crate::cache::ChunkCache;
use crate::config::MountOptions;
use crate::filer::grpc::{FilerClientOptions, GrpcFiler};
use crate::filer::subscribe::{spawn_subscription, SubscribeOptions, SubscriptionEvent};
use crate::filer::{FilerApi, FilerError};
use crate::fs::{Fs, FsConfig, FsError};
use crate::security::SecurityConfig;
use crate::volume::http::{VolumeClient, VolumeClientOptions};
use crate::volume::VolumeError;
use std::path::{Path, PathBuf};
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

/// Extra memory for readahead on top of `cacheCapacityMB` (see docs/CONFIGURATION.md).
pub const READAHEAD_BUDGET: u64 = 64 << 20;

/// Connects to the filer and builds the filesystem for `opts` (nothing is mounted yet).
pub async fn build_fs(
    opts: &MountOptions,
    security: &SecurityConfig,
) -> Result<Arc<Fs>, MountError> {
    let filer = GrpcFiler::connect(FilerClientOptions {
        addresses: opts.filers.clone(),
        security: security.clone(),
        ..Default::default()
    })
    .await?;
    let filer: Arc<dyn FilerApi> = Arc::new(filer);
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
    let cache = ChunkCache::new((opts.cache_capacity_mb << 20) + READAHEAD_BUDGET);
    let fs = Fs::new(cfg, filer, Arc::new(store), cache);
    fs.init_root().await?;
    Ok(fs)
}

/// Background work of a mounted filesystem: coherence and write-back.
pub fn spawn_background(fs: &Arc<Fs>) -> Vec<tokio::task::JoinHandle<()>> {
    let since_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0);
    let prefix = if fs.cfg.root == "/" {
        "/".to_string()
    } else {
        format!("{}/", fs.cfg.root)
    };
    let (mut rx, sub) = spawn_subscription(
        fs.filer.clone(),
        SubscribeOptions {
            client_name: "seaweedfs-csi".into(),
            path_prefix: prefix,
            extra_prefixes: Vec::new(),
            since_ns,
        },
    );
    let f = fs.clone();
    let events = tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            match ev {
                SubscriptionEvent::Event(e) => f.apply_event(&e),
                SubscriptionEvent::Resync => f.resync(),
            }
        }
    });
    let f = fs.clone();
    let flusher = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            f.flush_dir_times().await;
        }
    });
    let f = fs.clone();
    let health = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            let ok = tokio::time::timeout(Duration::from_secs(5), f.filer.configuration()).await;
            f.set_healthy(matches!(ok, Ok(Ok(_))));
            if f.quota() > 0 {
                f.refresh_usage().await;
            }
        }
    });
    vec![sub, events, flusher, health]
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
            return Err(bad("does not exist (use -dirAutoCreate)"))
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
            return Err(bad("is not empty (use -nonempty to mount over it)"));
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
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::metadata(mountpoint) else {
        return;
    };
    let dev = m.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let p = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = std::fs::write(&p, kb.to_string()) {
        tracing::debug!(path = p, error = %e, "cannot raise readahead");
    }
}

pub fn fsname(opts: &MountOptions) -> String {
    format!(
        "{}:{}",
        opts.filers.first().cloned().unwrap_or_default(),
        opts.filer_path
    )
}

/// One mounted volume served by this process.
pub struct MountedVolume {
    pub fs: Arc<Fs>,
    pub mountpoint: PathBuf,
    bg: Option<fuser::BackgroundSession>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl MountedVolume {
    /// Builds the filesystem and mounts it at `mountpoint` (which must be checked already).
    pub async fn mount(
        opts: &MountOptions,
        security: &SecurityConfig,
        mountpoint: &Path,
    ) -> Result<Self, MountError> {
        let fs = build_fs(opts, security).await?;
        let adapter =
            super::adapter::FuseAdapter::new(fs.clone(), tokio::runtime::Handle::current(), None);
        let config = fuse_config(opts, fsname(opts));
        let mp = mountpoint.to_path_buf();
        let bg = tokio::task::spawn_blocking(move || {
            let s = fuser::Session::new(adapter, &mp, &config)?;
            s.spawn()
        })
        .await
        .map_err(|e| MountError::Mount {
            path: mountpoint.to_path_buf(),
            source: std::io::Error::other(e),
        })?
        .map_err(|e| MountError::Mount {
            path: mountpoint.to_path_buf(),
            source: e,
        })?;
        fs.set_notifier(Arc::new(super::adapter::KernelNotifier(bg.notifier())));
        raise_readahead(mountpoint, 4096);
        let tasks = spawn_background(&fs);
        tracing::info!(mountpoint = %mountpoint.display(), root = %fs.cfg.root, "mounted");
        Ok(MountedVolume {
            fs,
            mountpoint: mountpoint.to_path_buf(),
            bg: Some(bg),
            tasks,
        })
    }

    /// Flushes everything dirty, then unmounts.
    pub async fn unmount(mut self) -> Result<(), MountError> {
        let flushed = self.fs.flush_all().await;
        for t in self.tasks.drain(..) {
            t.abort();
        }
        if let Some(bg) = self.bg.take() {
            let mp = self.mountpoint.clone();
            tokio::task::spawn_blocking(move || bg.umount_and_join())
                .await
                .map_err(|e| MountError::Mount {
                    path: mp.clone(),
                    source: std::io::Error::other(e),
                })?
                .map_err(|e| MountError::Mount {
                    path: mp,
                    source: e,
                })?;
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
        // dropping the background session unmounts: never leave a dead mount behind
        self.bg.take();
    }
}
