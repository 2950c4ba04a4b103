//! `seaweedfs-csi-driver mount`: the filesystem as a standalone foreground command, with the
//! `weed mount` flags a user of this driver sets.

use super::session::{check_mount_point, MountedVolume};
use crate::config::{parse_id_map, MountOptions, VolumeServerAccess};
use crate::security::SecurityConfig;
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Clone, Args)]
pub struct MountArgs {
    /// Filer address(es), comma-separated: host:port or host:port.grpcPort
    #[arg(long, default_value = "localhost:8888")]
    pub filer: String,
    /// Remote directory to mount
    #[arg(long = "filer.path", default_value = "/")]
    pub filer_path: String,
    /// Local mount point
    #[arg(long)]
    pub dir: PathBuf,
    /// Create the mount point if missing
    #[arg(long = "dirAutoCreate", default_value_t = false)]
    pub dir_auto_create: bool,
    /// Allow mounting over a non-empty directory
    #[arg(long, default_value_t = false)]
    pub nonempty: bool,
    #[arg(long, default_value = "")]
    pub collection: String,
    #[arg(long, default_value = "")]
    pub replication: String,
    /// Disk type for new chunks (hdd, ssd, or a tag)
    #[arg(long, default_value = "")]
    pub disk: String,
    /// TTL in seconds for new chunks
    #[arg(long, default_value_t = 0)]
    pub ttl: i32,
    #[arg(long = "dataCenter", default_value = "")]
    pub data_center: String,
    /// Memory budget of this process in MiB (dirty write data may take a quarter of it);
    /// 0: none; default: 3/4 of the cgroup memory limit, else 1/4 of the machine's memory
    #[arg(long = "memoryBudgetMB")]
    pub memory_budget_mb: Option<u64>,
    #[arg(long = "chunkSizeLimitMB", default_value_t = 2)]
    pub chunk_size_limit_mb: u32,
    #[arg(long = "concurrentWriters", default_value_t = 32)]
    pub concurrent_writers: usize,
    #[arg(long = "concurrentReaders", default_value_t = 16)]
    pub concurrent_readers: usize,
    /// Directory of the disk chunk cache (optional; sized by --cacheCapacityMB)
    #[arg(long = "cacheDir")]
    pub cache_dir: Option<PathBuf>,
    /// Chunk cache capacity in MiB: memory, and on disk under --cacheDir when set
    #[arg(long = "cacheCapacityMB", default_value_t = 128)]
    pub cache_capacity_mb: u64,
    #[arg(long = "cacheMetaTtlSec", default_value_t = 60)]
    pub cache_meta_ttl_sec: u64,
    #[arg(long = "readOnly", default_value_t = false)]
    pub read_only: bool,
    /// Octal umask for the mount root
    #[arg(long, default_value = "022")]
    pub umask: String,
    #[arg(long = "allowOthers", default_value_t = true, action = clap::ArgAction::Set)]
    pub allow_others: bool,
    #[arg(long = "map.uid", default_value = "")]
    pub map_uid: String,
    #[arg(long = "map.gid", default_value = "")]
    pub map_gid: String,
    #[arg(long = "volumeServerAccess", default_value = "direct")]
    pub volume_server_access: String,
    /// Quota in MiB (0 = none)
    #[arg(long = "collectionQuotaMB", default_value_t = 0)]
    pub collection_quota_mb: u64,
    /// FUSE worker threads (default: one per CPU, at most 4)
    #[arg(long = "fuse.threads", default_value_t = crate::config::default_fuse_threads())]
    pub fuse_threads: usize,
    /// Longest wait of a FUSE thread, in microseconds, for the next request after answering
    /// one before it sleeps (0: never; at most 1000)
    #[arg(long = "fuse.spinMicros", default_value_t = crate::config::DEFAULT_FUSE_SPIN_US,
          value_parser = clap::value_parser!(u64).range(0..=crate::config::MAX_FUSE_SPIN_US))]
    pub fuse_spin_us: u64,
    /// Data chunks per manifest chunk. Tests lower it to reach manifests with few chunks.
    #[arg(long = "manifestBatch", hide = true, default_value_t = crate::chunks::MANIFEST_BATCH)]
    pub manifest_batch: usize,
}

impl MountArgs {
    pub fn to_options(&self) -> anyhow::Result<MountOptions> {
        let umask = u32::from_str_radix(self.umask.trim_start_matches("0o"), 8)
            .map_err(|_| anyhow::anyhow!("invalid -umask {:?}: expected octal", self.umask))?;
        let access: VolumeServerAccess = self
            .volume_server_access
            .parse()
            .map_err(anyhow::Error::msg)?;
        if self.chunk_size_limit_mb == 0 || self.chunk_size_limit_mb > 1024 {
            anyhow::bail!("-chunkSizeLimitMB must be between 1 and 1024");
        }
        if self.concurrent_writers == 0 || self.concurrent_readers == 0 {
            anyhow::bail!("-concurrentWriters and -concurrentReaders must be at least 1");
        }
        Ok(MountOptions {
            filers: self
                .filer
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            filer_path: self.filer_path.clone(),
            collection: self.collection.clone(),
            replication: self.replication.clone(),
            disk_type: self.disk.clone(),
            ttl_sec: self.ttl,
            data_center: self.data_center.clone(),
            chunk_size_limit_mb: self.chunk_size_limit_mb,
            concurrent_writers: self.concurrent_writers,
            concurrent_readers: self.concurrent_readers,
            cache_dir: self.cache_dir.clone(),
            cache_capacity_mb: self.cache_capacity_mb,
            cache_meta_ttl_sec: self.cache_meta_ttl_sec,
            read_only: self.read_only,
            umask,
            allow_others: self.allow_others,
            uid_map: parse_id_map(&self.map_uid).map_err(anyhow::Error::msg)?,
            gid_map: parse_id_map(&self.map_gid).map_err(anyhow::Error::msg)?,
            volume_server_access: access,
            quota_bytes: self.collection_quota_mb << 20,
            fuse_threads: self.fuse_threads.max(1),
            fuse_spin_us: self.fuse_spin_us,
            manifest_batch: self.manifest_batch.max(1),
            ..Default::default()
        })
    }
}

/// Runs in the foreground until SIGINT/SIGTERM (then unmounts cleanly) or until the mount is
/// unmounted from outside.
pub fn run(args: MountArgs) -> anyhow::Result<()> {
    let opts = args.to_options()?;
    check_mount_point(&args.dir, args.dir_auto_create, args.nonempty)?;
    crate::budget::MemoryBudget::configure(args.memory_budget_mb);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let security = SecurityConfig::load()?;
        let mounted = MountedVolume::mount(&opts, &security, &args.dir).await?;
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        let unmounted_outside = loop {
            tokio::select! {
                _ = int.recv() => break false,
                _ = term.recv() => break false,
                _ = tick.tick() => {
                    // unmounted from outside: nothing is left to serve, exit as weed mount does
                    if mounted.session_ended() {
                        tracing::info!(dir = %args.dir.display(), "the FUSE connection ended (unmounted); exiting");
                        break true;
                    }
                }
            }
        };
        if unmounted_outside {
            // a mount at the path now is a new one (maybe with our reused connection id)
            tracing::info!("stopping: flushing");
            mounted.close_after_outside_unmount().await?;
        } else {
            tracing::info!("stopping: flushing and unmounting");
            mounted.unmount_before_exit().await?;
        }
        Ok(())
    })
}
