//! Plain configuration structs with defaults, shared by the `mount` command and the CSI node.

use std::path::PathBuf;

/// How chunk data is fetched from / sent to volume servers (`-volumeServerAccess`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum VolumeServerAccess {
    /// `Location.url`
    #[default]
    Direct,
    /// `Location.public_url`
    PublicUrl,
    /// through the filer: `http://<filer>/?proxyChunkId=<fid>`
    FilerProxy,
}

impl std::str::FromStr for VolumeServerAccess {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" | "direct" => Ok(Self::Direct),
            "publicUrl" => Ok(Self::PublicUrl),
            "filerProxy" => Ok(Self::FilerProxy),
            other => Err(format!(
                "invalid volumeServerAccess {other:?}: expected direct, publicUrl or filerProxy"
            )),
        }
    }
}

/// Options a newer version wrote (state file, keeper blob) that this one does not know:
/// kept, so that a rewrite by this version (a rollback) does not drop them.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct UnknownOptions(pub serde_json::Map<String, serde_json::Value>);

/// Never makes two options differ: this version does not apply them.
impl PartialEq for UnknownOptions {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Everything one mounted volume (one FUSE session) needs. Mirrors `weed mount` flags.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct MountOptions {
    /// Filer HTTP addresses (`host:port` or `host:port.grpcPort`).
    pub filers: Vec<String>,
    /// Remote path mounted as the root (no trailing slash, except "/").
    pub filer_path: String,
    pub collection: String,
    pub replication: String,
    pub disk_type: String,
    pub ttl_sec: i32,
    pub data_center: String,
    pub chunk_size_limit_mb: u32,
    pub concurrent_writers: usize,
    pub concurrent_readers: usize,
    /// Disk cache directory (optional disk tier, write swap). None = memory only.
    pub cache_dir: Option<PathBuf>,
    /// Chunk cache capacity in MiB (memory tier; see docs/CONFIGURATION.md).
    pub cache_capacity_mb: u64,
    pub cache_meta_ttl_sec: u64,
    pub read_only: bool,
    pub umask: u32,
    pub allow_others: bool,
    /// (local, filer) uid pairs.
    pub uid_map: Vec<(u32, u32)>,
    /// (local, filer) gid pairs.
    pub gid_map: Vec<(u32, u32)>,
    pub volume_server_access: VolumeServerAccess,
    /// Quota in bytes (0 = none): writes fail with ENOSPC beyond it; `df` shows it.
    pub quota_bytes: u64,
    /// Take the quota from the root directory's [`crate::fs::CAPACITY_XATTR`] when it has one
    /// (at mount and every few seconds after), over `quota_bytes`: the CSI controller records
    /// every expansion there, so every node enforces the latest size without NodeExpandVolume.
    pub quota_from_filer: bool,
    /// The CSI volume id, when a CSI volume is mounted: NodeExpandVolume records the capacity
    /// under a name of this volume's own (static PVs may share a directory). Empty: none.
    pub volume_id: String,
    /// Max total wait for read retries.
    pub read_retry_secs: u64,
    /// FUSE worker threads; [`default_fuse_threads`] unless set.
    pub fuse_threads: usize,
    /// Longest wait, in microseconds, of a FUSE thread for the next request after answering
    /// one, before it sleeps (see [`crate::fuse::linger`]); 0: never.
    pub fuse_spin_us: u64,
    /// Data chunks per manifest chunk; only tests lower it.
    pub manifest_batch: usize,
    #[serde(flatten)]
    pub unknown: UnknownOptions,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            filers: vec!["localhost:8888".into()],
            filer_path: "/".into(),
            collection: String::new(),
            replication: String::new(),
            disk_type: String::new(),
            ttl_sec: 0,
            data_center: String::new(),
            chunk_size_limit_mb: 2,
            concurrent_writers: 32,
            concurrent_readers: 16,
            cache_dir: None,
            cache_capacity_mb: 128,
            cache_meta_ttl_sec: 60,
            read_only: false,
            umask: 0o022,
            allow_others: true,
            uid_map: Vec::new(),
            gid_map: Vec::new(),
            volume_server_access: VolumeServerAccess::Direct,
            quota_bytes: 0,
            quota_from_filer: false,
            volume_id: String::new(),
            read_retry_secs: 6,
            fuse_threads: default_fuse_threads(),
            fuse_spin_us: DEFAULT_FUSE_SPIN_US,
            manifest_batch: crate::chunks::MANIFEST_BATCH,
            unknown: UnknownOptions::default(),
        }
    }
}

/// Default of [`MountOptions::fuse_spin_us`]: about two cross-CPU wake-ups on a VM.
pub const DEFAULT_FUSE_SPIN_US: u64 = 50;

/// Largest [`MountOptions::fuse_spin_us`] accepted: beyond it a wait costs more than the
/// sleep it avoids.
pub const MAX_FUSE_SPIN_US: u64 = 1000;

/// One FUSE thread per CPU, at most 4. A FUSE thread never waits on the network (a request
/// that must wait moves to the runtime), so threads beyond the CPUs only spread the kernel's
/// wake-ups: it hands each request to the thread that has slept longest, mostly on another
/// CPU than the writer's, and a 4 KiB write stream on 2 CPUs ran ~1.4x faster with 2 threads
/// than with 4 (docs/BENCHMARKS.md).
pub fn default_fuse_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// Parses `local:filer,local:filer` id maps (`-map.uid`, `uidMap`).
pub fn parse_id_map(s: &str) -> Result<Vec<(u32, u32)>, String> {
    let mut out = Vec::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (l, f) = pair
            .split_once(':')
            .ok_or_else(|| format!("invalid id map entry {pair:?}: expected local:filer"))?;
        let l = l
            .trim()
            .parse()
            .map_err(|_| format!("invalid local id in {pair:?}"))?;
        let f = f
            .trim()
            .parse()
            .map_err(|_| format!("invalid filer id in {pair:?}"))?;
        out.push((l, f));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_threads_follow_the_cpus_up_to_four() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(default_fuse_threads(), cpus.min(4));
        assert_eq!(MountOptions::default().fuse_threads, cpus.min(4));
    }

    #[test]
    fn id_map_parses_and_rejects() {
        assert_eq!(
            parse_id_map("1000:0, 5:6").unwrap(),
            vec![(1000, 0), (5, 6)]
        );
        assert_eq!(parse_id_map("").unwrap(), vec![]);
        assert!(parse_id_map("1000").is_err());
        assert!(parse_id_map("a:1").is_err());
    }

    #[test]
    fn unknown_options_are_kept_and_never_compared() {
        let json = r#"{"filer_path":"/p","writeback":{"mode":"async"}}"#;
        let o: MountOptions = serde_json::from_str(json).unwrap();
        assert_eq!(o.filer_path, "/p");
        assert_eq!(o.quota_bytes, 0, "a missing field is its default");
        let again = serde_json::to_value(&o).unwrap();
        assert_eq!(again["writeback"]["mode"], "async");
        let plain = MountOptions {
            filer_path: "/p".into(),
            ..Default::default()
        };
        assert_eq!(o, plain);
        assert_ne!(o, MountOptions::default());
    }

    #[test]
    fn volume_server_access_parses() {
        assert_eq!(
            "publicUrl".parse::<VolumeServerAccess>(),
            Ok(VolumeServerAccess::PublicUrl)
        );
        assert!("bogus".parse::<VolumeServerAccess>().is_err());
    }
}
