//! StorageClass parameters / volume context -> [`MountOptions`], volume naming and filer paths,
//! with the same keys and precedence as the Go driver so existing StorageClasses and static PVs
//! keep working.
//!
//! Over 800 lines: a third of it is the table-driven tests of every Go-driver key and its
//! precedence.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::{parse_id_map, MountOptions, VolumeServerAccess};

/// Where dynamically provisioned volumes go unless `parentDir`/`path` say otherwise; the filer
/// treats directories here as S3 buckets.
pub const BUCKETS_DIR: &str = "/buckets";
/// Context key carrying the requested capacity in bytes (the quota).
pub const KEY_VOLUME_CAPACITY: &str = "volumeCapacity";
pub const KEY_PARENT_DIR: &str = "parentDir";
pub const KEY_VOLUME_NAME: &str = "volumeName";
pub const KEY_PATH: &str = "path";

/// Errors in parameters; all are the caller's fault (INVALID_ARGUMENT).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    #[error("invalid value {value:?} for parameter {key:?}: {reason}")]
    Invalid {
        key: String,
        value: String,
        reason: String,
    },
    #[error(
        "dataLocality {0} needs a data center: set --dataCenter (or --dataCenterLabel with that label on the node) on the node plugin, or dataCenter in the StorageClass"
    )]
    LocalityWithoutDataCenter(String),
    #[error("invalid volume name {0:?}: {1}")]
    InvalidName(String, String),
    #[error("unsupported mount options (PV mountOptions): {flags}; supported: {known}")]
    UnknownMountFlags { flags: String, known: String },
}

fn invalid(key: &str, value: &str, reason: impl Into<String>) -> ParamError {
    ParamError::Invalid {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// `dataLocality` (`none` | `write_preferLocalDc`, case-insensitive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataLocality {
    #[default]
    None,
    WritePreferLocalDc,
}

impl std::str::FromStr for DataLocality {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "" | "none" => Ok(DataLocality::None),
            "write_preferlocaldc" => Ok(DataLocality::WritePreferLocalDc),
            _ => Err(format!(
                "unknown dataLocality {s:?}: expected none or write_preferLocalDc"
            )),
        }
    }
}

/// Node-wide defaults that volume context values override.
#[derive(Debug, Clone, Default)]
pub struct VolumeDefaults {
    /// Driver-level mount options (filers, cache sizes, concurrency, id maps, umask).
    /// `filer_path`, `collection`, `quota_bytes`, `read_only` and `cache_dir` are per volume.
    pub base: MountOptions,
    /// `--cacheDir`: each volume gets `<cacheDir>/<sha256 hex of volume id>`.
    pub cache_root: Option<PathBuf>,
    /// `--dataCenter`; used only when the effective locality asks for it.
    pub data_center: String,
    /// `--dataLocality`.
    pub data_locality: DataLocality,
}

/// Go's `path.Clean` for slash paths: collapses `//`, `.` and `..`; never returns "".
pub fn clean_path(p: &str) -> String {
    let abs = p.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for seg in p.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if parts.last().is_some_and(|l| *l != "..") {
                    parts.pop();
                } else if !abs {
                    parts.push("..");
                }
            }
            s => parts.push(s),
        }
    }
    let joined = parts.join("/");
    match (abs, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".to_string(),
        (false, false) => joined,
    }
}

/// Splits a clean absolute path into (parent, base). `/a` -> (`/`, `a`).
pub fn split_path(p: &str) -> (String, String) {
    match p.rfind('/') {
        Some(0) => ("/".to_string(), p[1..].to_string()),
        Some(i) => (p[..i].to_string(), p[i + 1..].to_string()),
        None => (".".to_string(), p.to_string()),
    }
}

fn base_name(p: &str) -> String {
    split_path(p).1
}

/// The filer path a volume mounts: an absolute volume id *is* the path (dynamic volumes);
/// otherwise the static PV's `path` attribute; otherwise the legacy `/buckets/<id>`.
pub fn filer_path_for(volume_id: &str, ctx: &HashMap<String, String>) -> String {
    if volume_id.starts_with('/') {
        return clean_path(volume_id);
    }
    match ctx
        .get(KEY_PATH)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
    {
        Some(p) => clean_path(p),
        None => format!("{BUCKETS_DIR}/{volume_id}"),
    }
}

/// Where a new volume is created on the filer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeLocation {
    pub parent_dir: String,
    pub name: String,
    /// `parent_dir/name`, which is also the volume id.
    pub path: String,
}

/// CreateVolume naming: `path` wins (its dir/base become parent/name); else `parentDir`
/// (default `/buckets`) plus the request name, made a valid bucket name under `/buckets`.
pub fn new_volume_location(
    req_name: &str,
    params: &HashMap<String, String>,
) -> Result<VolumeLocation, ParamError> {
    if let Some(p) = params
        .get(KEY_PATH)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
    {
        if !p.starts_with('/') {
            return Err(invalid(KEY_PATH, p, "must be an absolute filer path"));
        }
        let path = clean_path(p);
        if path == "/" {
            return Err(invalid(KEY_PATH, p, "cannot be the filer root"));
        }
        let (parent_dir, name) = split_path(&path);
        return Ok(VolumeLocation {
            parent_dir,
            name,
            path,
        });
    }
    let parent_raw = params
        .get(KEY_PARENT_DIR)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .unwrap_or(BUCKETS_DIR);
    if !parent_raw.starts_with('/') {
        return Err(invalid(
            KEY_PARENT_DIR,
            parent_raw,
            "must be an absolute filer path",
        ));
    }
    let parent_dir = clean_path(parent_raw);
    let name = if parent_dir == BUCKETS_DIR {
        bucket_safe_name(req_name)
    } else {
        req_name.to_string()
    };
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(ParamError::InvalidName(
            req_name.to_string(),
            "must be one path component".into(),
        ));
    }
    let path = if parent_dir == "/" {
        format!("/{name}")
    } else {
        format!("{parent_dir}/{name}")
    };
    Ok(VolumeLocation {
        parent_dir,
        name,
        path,
    })
}

fn sha1_hex(s: &str) -> String {
    use sha1::Digest;
    hex::encode(sha1::Sha1::digest(s.as_bytes()))
}

/// The filer's S3 bucket-name rules (3-63 bytes; lowercase letters, digits, `.`, `-`; no `..`;
/// starts and ends with a letter or digit; no `xn--` prefix or `-s3alias` suffix; not an IP).
pub fn verify_bucket_name(name: &str) -> Result<(), &'static str> {
    if name.len() < 3 || name.len() > 63 {
        return Err("bucket name must be 3 to 63 characters");
    }
    let mut prev = '\0';
    for ch in name.chars() {
        if !(ch.is_lowercase() || ch.is_numeric() || ch == '.' || ch == '-') {
            return Err("bucket name can only contain lowercase letters, digits, dots and hyphens");
        }
        if ch == '.' && prev == '.' {
            return Err("bucket name must not contain two adjacent dots");
        }
        prev = ch;
    }
    let first = name.as_bytes()[0];
    let last = name.as_bytes()[name.len() - 1];
    if first == b'.' || first == b'-' {
        return Err("bucket name must start with a letter or digit");
    }
    if last == b'.' || last == b'-' {
        return Err("bucket name must end with a letter or digit");
    }
    if name.starts_with("xn--") {
        return Err("bucket name prefix xn-- is reserved");
    }
    if name.ends_with("-s3alias") {
        return Err("bucket name suffix -s3alias is reserved");
    }
    if name.parse::<std::net::IpAddr>().is_ok() {
        return Err("bucket name cannot be an IP address");
    }
    Ok(())
}

/// A bucket-safe directory name for a CreateVolume name under `/buckets`, computed exactly like
/// the Go driver so names stay stable across the migration: lowercase; longer than 63 bytes
/// becomes its sha1 hex; a still-invalid name becomes `<first 21 sanitized chars>.<sha1>`.
pub fn bucket_safe_name(req_name: &str) -> String {
    let mut id = req_name.to_lowercase();
    if id.len() > 63 {
        id = sha1_hex(&id);
    }
    if verify_bucket_name(&id).is_err() {
        let hash = sha1_hex(&id);
        let mut sanitized: String = id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        sanitized.truncate(21);
        id = format!("{sanitized}.{hash}");
    }
    id
}

/// Parses a Go duration (`300ms`, `1.5h`, `2h45m`, `10s`).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let rest = s.strip_prefix('+').unwrap_or(s);
    if rest.starts_with('-') {
        return Err("negative durations are not allowed".into());
    }
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    let mut total = 0f64;
    let mut chars = rest.char_indices().peekable();
    while chars.peek().is_some() {
        let start = chars.peek().map(|(i, _)| *i).unwrap_or(0);
        let mut end = start;
        while let Some((i, c)) = chars.peek().copied() {
            if c.is_ascii_digit() || c == '.' {
                end = i + c.len_utf8();
                chars.next();
            } else {
                break;
            }
        }
        let num = &rest[start..end];
        if num.is_empty() || num == "." {
            return Err(format!("invalid duration {s:?}"));
        }
        let value: f64 = num
            .parse()
            .map_err(|_| format!("invalid number in duration {s:?}"))?;
        let ustart = end;
        let mut uend = end;
        while let Some((i, c)) = chars.peek().copied() {
            if c.is_ascii_digit() || c == '.' {
                break;
            }
            uend = i + c.len_utf8();
            chars.next();
        }
        let factor = match &rest[ustart..uend] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "" => return Err(format!("missing unit in duration {s:?}")),
            u => return Err(format!("unknown unit {u:?} in duration {s:?}")),
        };
        total += value * factor;
    }
    if !total.is_finite() || total > 1e12 {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(total))
}

/// TTL in seconds: an integer, or an integer with unit `s`, `m`, `h`, `d`, `w`.
fn parse_ttl_secs(v: &str) -> Result<i32, String> {
    let v = v.trim();
    let (num, mult) = match v.char_indices().last() {
        Some((i, 's')) => (&v[..i], 1i64),
        Some((i, 'm')) => (&v[..i], 60),
        Some((i, 'h')) => (&v[..i], 3600),
        Some((i, 'd')) => (&v[..i], 86400),
        Some((i, 'w')) => (&v[..i], 7 * 86400),
        _ => (v, 1),
    };
    let n: i64 = num
        .parse()
        .map_err(|_| "expected seconds (e.g. 3600) or a number with s/m/h/d/w".to_string())?;
    if n < 0 {
        return Err("must not be negative".into());
    }
    i32::try_from(n * mult).map_err(|_| "too large".to_string())
}

fn parse_num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, ParamError> {
    v.trim()
        .parse::<T>()
        .map_err(|_| invalid(key, v, "expected a non-negative integer"))
}

fn parse_filers(key: &str, v: &str) -> Result<Vec<String>, ParamError> {
    let list: Vec<String> = v
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if list.is_empty() {
        return Err(invalid(
            key,
            v,
            "expected a comma-separated list of filer addresses",
        ));
    }
    Ok(list)
}

/// The cache directory of one volume under `--cacheDir`.
pub fn cache_dir_for(root: &std::path::Path, volume_id: &str) -> PathBuf {
    use sha2::Digest;
    root.join(hex::encode(sha2::Sha256::digest(volume_id.as_bytes())))
}

/// Requested capacity from the context (`volumeCapacity`, bytes); 0 = none. Like the Go
/// driver, 1 byte or less means no quota.
pub fn capacity_from_context(ctx: &HashMap<String, String>) -> Result<u64, ParamError> {
    match ctx
        .get(KEY_VOLUME_CAPACITY)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
    {
        None => Ok(0),
        Some(v) => {
            let n: i64 = v
                .parse()
                .map_err(|_| invalid(KEY_VOLUME_CAPACITY, v, "expected bytes as an integer"))?;
            if n < 0 {
                return Err(invalid(KEY_VOLUME_CAPACITY, v, "must not be negative"));
            }
            Ok(if n <= 1 { 0 } else { n as u64 })
        }
    }
}

/// Whether [`resolve_mount_options`] would take the node's data center
/// (`defaults.data_center`): the effective locality is write_preferLocalDc and the context
/// names no dataCenter. An unparsable locality is false (resolving reports it).
pub fn uses_node_data_center(ctx: &HashMap<String, String>, defaults: &VolumeDefaults) -> bool {
    let get = |k: &str| ctx.get(k).map(|s| s.trim()).filter(|s| !s.is_empty());
    let locality = match get("dataLocality") {
        Some(v) => v.parse::<DataLocality>().unwrap_or(DataLocality::None),
        None => defaults.data_locality,
    };
    locality == DataLocality::WritePreferLocalDc && get("dataCenter").is_none()
}

/// Builds the mount options of one volume from node defaults and the volume context.
pub fn resolve_mount_options(
    volume_id: &str,
    ctx: &HashMap<String, String>,
    defaults: &VolumeDefaults,
    read_only: bool,
) -> Result<MountOptions, ParamError> {
    let mut o = defaults.base.clone();
    let filer_path = filer_path_for(volume_id, ctx);
    o.collection = if filer_path == "/" {
        String::new()
    } else {
        base_name(&filer_path)
    };
    o.filer_path = filer_path;
    o.read_only = read_only;
    o.quota_bytes = capacity_from_context(ctx)?;
    // The capacity recorded on the volume's directory (CreateVolume, every expansion) wins
    // over the context, which keeps the size at creation for the PV's whole life.
    o.quota_from_filer = true;
    o.volume_id = volume_id.to_string();
    o.cache_dir = defaults
        .cache_root
        .as_deref()
        .map(|r| cache_dir_for(r, volume_id));
    o.data_center = String::new();

    // Aliases: the first name of each pair wins when both are set.
    let get = |k: &str| {
        ctx.get(k)
            .map(|s| s.as_str())
            .filter(|s| !s.trim().is_empty())
    };
    let pick = |a: &'static str, b: &'static str| {
        get(a).map(|v| (a, v)).or_else(|| get(b).map(|v| (b, v)))
    };

    if let Some(v) = get("collection") {
        o.collection = v.trim().to_string();
    }
    if let Some(v) = get("replication") {
        let v = v.trim();
        if v.len() != 3 || !v.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid("replication", v, "expected three digits like 001"));
        }
        o.replication = v.to_string();
    }
    if let Some((_, v)) = pick("diskType", "disk") {
        o.disk_type = v.trim().to_string();
    }
    if let Some(v) = get("ttl") {
        o.ttl_sec = parse_ttl_secs(v).map_err(|r| invalid("ttl", v, r))?;
    }
    if let Some(v) = get("chunkSizeLimitMB") {
        let n: u32 = parse_num("chunkSizeLimitMB", v)?;
        if n == 0 {
            return Err(invalid("chunkSizeLimitMB", v, "must be at least 1"));
        }
        o.chunk_size_limit_mb = n;
    }
    if let Some(v) = get("volumeServerAccess") {
        o.volume_server_access = v
            .trim()
            .parse::<VolumeServerAccess>()
            .map_err(|r| invalid("volumeServerAccess", v, r))?;
    }
    if let Some(v) = get("readRetryTime") {
        let d = parse_go_duration(v).map_err(|r| invalid("readRetryTime", v, r))?;
        o.read_retry_secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    }
    if let Some((k, v)) = pick("uidMap", "map.uid") {
        o.uid_map = parse_id_map(v).map_err(|r| invalid(k, v, r))?;
    }
    if let Some((k, v)) = pick("gidMap", "map.gid") {
        o.gid_map = parse_id_map(v).map_err(|r| invalid(k, v, r))?;
    }
    if let Some(v) = get("cacheCapacityMB") {
        o.cache_capacity_mb = parse_num("cacheCapacityMB", v)?;
    }
    if let Some(v) = get("cacheMetaTtlSec") {
        o.cache_meta_ttl_sec = parse_num("cacheMetaTtlSec", v)?;
    }
    for (key, field) in [
        ("concurrentReaders", &mut o.concurrent_readers),
        ("concurrentWriters", &mut o.concurrent_writers),
    ] {
        if let Some(v) = get(key) {
            let n: usize = parse_num(key, v)?;
            // 0 meant "unlimited" to weed mount (and crashed it, Go issue #165); keep the default.
            if n == 0 {
                tracing::debug!(volume_id, key, "0 requested; keeping the node default");
            } else {
                *field = n;
            }
        }
    }
    if let Some(v) = get("filer") {
        o.filers = parse_filers("filer", v)?;
    }
    if let Some(v) = get("filer.path") {
        let v = v.trim();
        if !v.starts_with('/') {
            return Err(invalid("filer.path", v, "must be an absolute filer path"));
        }
        o.filer_path = clean_path(v);
    }

    // Data locality: driver < StorageClass/PV; an explicit dataCenter always wins.
    let locality = match get("dataLocality") {
        Some(v) => v
            .parse::<DataLocality>()
            .map_err(|r| invalid("dataLocality", v, r))?,
        None => defaults.data_locality,
    };
    let explicit_dc = get("dataCenter").map(|s| s.trim().to_string());
    if locality != DataLocality::None && explicit_dc.is_none() && defaults.data_center.is_empty() {
        return Err(ParamError::LocalityWithoutDataCenter(
            "write_preferLocalDc".into(),
        ));
    }
    if let Some(dc) = explicit_dc {
        o.data_center = dc;
    } else if locality == DataLocality::WritePreferLocalDc {
        o.data_center = defaults.data_center.clone();
    }

    for key in ctx.keys() {
        if !KNOWN_KEYS.contains(&key.as_str()) {
            // kubelet's csi.storage.k8s.io/* pod info, the provisioner identity, ...
            tracing::debug!(volume_id, key = key.as_str(), "volume context key ignored");
        }
    }
    Ok(o)
}

/// Mount flags (PV `mountOptions`, CSI `mount_flags`) that make the volume read-only.
pub const READ_ONLY_FLAGS: &[&str] = &["ro", "readOnly"];
/// Mount flags that change nothing: `rw` is the default.
const NO_OP_FLAGS: &[&str] = &["rw"];
/// `key=value` mount flags: the volume-context settings of one FUSE session, same names and
/// values as the context keys (docs/CONFIGURATION.md, "Mount options").
const VALUE_FLAGS: &[&str] = &[
    "cacheCapacityMB",
    "cacheMetaTtlSec",
    "concurrentReaders",
    "concurrentWriters",
    "chunkSizeLimitMB",
    "readRetryTime",
];

/// Checks CSI mount flags: every one must be in the documented list. The error names every
/// flag that is not, so nothing is silently dropped.
pub fn check_mount_flags(flags: &[String]) -> Result<(), ParamError> {
    let unknown: Vec<&str> = flags
        .iter()
        .map(|f| f.trim())
        .filter(|f| !f.is_empty())
        .filter(|f| {
            if READ_ONLY_FLAGS.contains(f) || NO_OP_FLAGS.contains(f) {
                return false;
            }
            !matches!(f.split_once('='), Some((k, _)) if VALUE_FLAGS.contains(&k.trim()))
        })
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    Err(ParamError::UnknownMountFlags {
        flags: unknown.join(", "),
        known: READ_ONLY_FLAGS
            .iter()
            .chain(NO_OP_FLAGS)
            .map(|f| f.to_string())
            .chain(VALUE_FLAGS.iter().map(|k| format!("{k}=<value>")))
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Applies CSI mount flags on top of the options resolved from the volume context: a flag
/// wins over the context key of the same name (the PV's `mountOptions` are the more specific
/// choice). `ro`/`readOnly` are read by the caller (they also decide the publish bind).
pub fn apply_mount_flags(
    volume_id: &str,
    o: &mut MountOptions,
    flags: &[String],
    defaults: &VolumeDefaults,
) -> Result<(), ParamError> {
    check_mount_flags(flags)?;
    let ctx: HashMap<String, String> = flags
        .iter()
        .filter_map(|f| f.trim().split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    if ctx.is_empty() {
        return Ok(());
    }
    // Same parsing and checks as the context keys, on a copy that only differs in these.
    let mut base = defaults.clone();
    base.base = o.clone();
    base.data_locality = DataLocality::None;
    let parsed = resolve_mount_options(volume_id, &ctx, &base, o.read_only)?;
    for key in ctx.keys() {
        match key.as_str() {
            "cacheCapacityMB" => o.cache_capacity_mb = parsed.cache_capacity_mb,
            "cacheMetaTtlSec" => o.cache_meta_ttl_sec = parsed.cache_meta_ttl_sec,
            "concurrentReaders" => o.concurrent_readers = parsed.concurrent_readers,
            "concurrentWriters" => o.concurrent_writers = parsed.concurrent_writers,
            "chunkSizeLimitMB" => o.chunk_size_limit_mb = parsed.chunk_size_limit_mb,
            "readRetryTime" => o.read_retry_secs = parsed.read_retry_secs,
            _ => {}
        }
    }
    Ok(())
}

const KNOWN_KEYS: &[&str] = &[
    "collection",
    "replication",
    "diskType",
    "disk",
    "ttl",
    "chunkSizeLimitMB",
    "volumeServerAccess",
    "readRetryTime",
    "dataCenter",
    "dataLocality",
    "uidMap",
    "map.uid",
    "gidMap",
    "map.gid",
    "cacheCapacityMB",
    "cacheMetaTtlSec",
    "concurrentReaders",
    "concurrentWriters",
    "filer",
    "filer.path",
    KEY_PATH,
    KEY_PARENT_DIR,
    KEY_VOLUME_NAME,
    KEY_VOLUME_CAPACITY,
    "collectionQuotaMB",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn mount_flags_are_applied_or_refused() {
        let flags = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let d = VolumeDefaults::default();
        let mut o =
            resolve_mount_options("/buckets/v", &ctx(&[("cacheCapacityMB", "100")]), &d, false)
                .unwrap();
        apply_mount_flags(
            "/buckets/v",
            &mut o,
            &flags(&[
                "ro",
                "rw",
                "cacheCapacityMB=64",
                " concurrentReaders=3 ",
                "readRetryTime=2s",
            ]),
            &d,
        )
        .unwrap();
        assert_eq!(
            (o.cache_capacity_mb, o.concurrent_readers, o.read_retry_secs),
            (64, 3, 2)
        );
        assert_eq!(o.filer_path, "/buckets/v", "nothing else changes");
        let e = check_mount_flags(&flags(&["ro", "noatime", "bogus=1", "cacheCapacityMB=8"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("noatime, bogus=1"), "{e}");
        assert!(e.contains("readOnly"), "the error lists what works: {e}");
        let bad = apply_mount_flags("/v", &mut o, &flags(&["concurrentWriters=x"]), &d);
        assert!(bad.unwrap_err().to_string().contains("concurrentWriters"));
    }

    #[test]
    fn filer_path_resolution_order() {
        let c = ctx(&[("path", "/data/static")]);
        assert_eq!(
            filer_path_for("/buckets/pvc-1", &c),
            "/buckets/pvc-1",
            "absolute id wins over path"
        );
        assert_eq!(filer_path_for("static-handle", &c), "/data/static");
        assert_eq!(filer_path_for("legacy", &HashMap::new()), "/buckets/legacy");
        assert_eq!(filer_path_for("/a//b/", &HashMap::new()), "/a/b");
    }

    #[test]
    fn clean_and_split() {
        assert_eq!(clean_path("/a/../b/./c/"), "/b/c");
        assert_eq!(clean_path("/.."), "/");
        assert_eq!(clean_path(""), ".");
        assert_eq!(clean_path("a/../.."), "..");
        assert_eq!(split_path("/a"), ("/".into(), "a".into()));
        assert_eq!(split_path("/a/b/c"), ("/a/b".into(), "c".into()));
    }

    #[test]
    fn bucket_names_match_the_go_driver() {
        // Already valid: only lowercased.
        assert_eq!(
            bucket_safe_name("pvc-0b3f6e1c-aaaa-bbbb-cccc-1234567890ab"),
            "pvc-0b3f6e1c-aaaa-bbbb-cccc-1234567890ab"
        );
        assert_eq!(bucket_safe_name("PVC-Upper"), "pvc-upper");
        // Longer than 63 bytes: sha1 hex of the lowercased name (40 chars, a valid bucket name).
        let long = "a".repeat(64);
        assert_eq!(bucket_safe_name(&long), sha1_hex(&long));
        // Invalid: first 21 sanitized chars, a dot, and the sha1 of the lowercased name.
        let got = bucket_safe_name("My_Volume_With_Underscores_Long");
        let lower = "my_volume_with_underscores_long";
        assert_eq!(got, format!("my-volume-with-unders.{}", sha1_hex(lower)));
        assert!(verify_bucket_name(&got).is_ok());
        assert_eq!(bucket_safe_name("ab"), format!("ab.{}", sha1_hex("ab")));
        assert_eq!(bucket_safe_name("-x-"), format!("-x-.{}", sha1_hex("-x-")));
    }

    #[test]
    fn bucket_rules() {
        assert!(verify_bucket_name("abc").is_ok());
        assert!(verify_bucket_name("a.b-c9").is_ok());
        for bad in [
            "ab",
            "a..b",
            ".ab",
            "ab-",
            "xn--abc",
            "abc-s3alias",
            "192.168.1.1",
            "a_b",
            "ABC",
        ] {
            assert!(verify_bucket_name(bad).is_err(), "{bad} should be rejected");
        }
        assert!(verify_bucket_name(&"a".repeat(64)).is_err());
    }

    #[test]
    fn create_locations() {
        let loc = new_volume_location("PVC-1", &HashMap::new()).unwrap();
        assert_eq!(
            loc,
            VolumeLocation {
                parent_dir: "/buckets".into(),
                name: "pvc-1".into(),
                path: "/buckets/pvc-1".into()
            }
        );
        let loc = new_volume_location("PVC-1", &ctx(&[("parentDir", "/vols/")])).unwrap();
        assert_eq!(loc.path, "/vols/PVC-1", "outside /buckets the name is kept");
        let loc = new_volume_location("ignored", &ctx(&[("path", "/x/y/../z")])).unwrap();
        assert_eq!((loc.parent_dir.as_str(), loc.name.as_str()), ("/x", "z"));
        assert!(new_volume_location("n", &ctx(&[("path", "rel/p")])).is_err());
        assert!(new_volume_location("n", &ctx(&[("path", "/")])).is_err());
        assert!(new_volume_location("n", &ctx(&[("parentDir", "rel")])).is_err());
        assert!(new_volume_location("a/b", &ctx(&[("parentDir", "/v")])).is_err());
        let loc = new_volume_location("n", &ctx(&[("parentDir", "/")])).unwrap();
        assert_eq!(loc.path, "/n");
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("6s").unwrap(), Duration::from_secs(6));
        assert_eq!(parse_go_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(
            parse_go_duration("1.5h").unwrap(),
            Duration::from_secs(5400)
        );
        assert_eq!(
            parse_go_duration("250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(parse_go_duration("0").unwrap(), Duration::ZERO);
        for bad in ["", "5", "-1s", "1x", "s", "1.2.3s"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} should fail");
        }
    }

    fn defaults() -> VolumeDefaults {
        VolumeDefaults {
            base: MountOptions {
                filers: vec!["f1:8888".into()],
                umask: 0,
                ..Default::default()
            },
            cache_root: Some(PathBuf::from("/var/cache/seaweedfs")),
            data_center: String::new(),
            data_locality: DataLocality::None,
        }
    }

    #[test]
    fn defaults_apply_for_an_empty_context() {
        let o =
            resolve_mount_options("/buckets/pvc-1", &HashMap::new(), &defaults(), false).unwrap();
        assert_eq!(o.filer_path, "/buckets/pvc-1");
        assert_eq!(o.collection, "pvc-1");
        assert_eq!(o.filers, vec!["f1:8888".to_string()]);
        assert_eq!(o.quota_bytes, 0);
        assert!(!o.read_only);
        assert_eq!(o.umask, 0);
        assert_eq!(
            o.cache_dir.unwrap(),
            cache_dir_for(
                std::path::Path::new("/var/cache/seaweedfs"),
                "/buckets/pvc-1"
            )
        );
    }

    #[test]
    fn every_key_is_applied() {
        let c = ctx(&[
            ("collection", "coll"),
            ("replication", "010"),
            ("diskType", "ssd"),
            ("disk", "hdd"),
            ("ttl", "2h"),
            ("chunkSizeLimitMB", "8"),
            ("volumeServerAccess", "filerProxy"),
            ("readRetryTime", "1500ms"),
            ("map.uid", "1:2"),
            ("gidMap", "3:4"),
            ("map.gid", "9:9"),
            ("cacheCapacityMB", "64"),
            ("cacheMetaTtlSec", "5"),
            ("concurrentReaders", "7"),
            ("concurrentWriters", "0"),
            ("filer", "a:1, b:2"),
            ("filer.path", "/override/"),
            ("volumeCapacity", "1073741824"),
            ("dataCenter", "dc1"),
            ("csi.storage.k8s.io/pod.name", "p"),
        ]);
        let o = resolve_mount_options("/buckets/v", &c, &defaults(), true).unwrap();
        assert_eq!(o.collection, "coll");
        assert_eq!(o.replication, "010");
        assert_eq!(o.disk_type, "ssd", "diskType wins over disk");
        assert_eq!(o.ttl_sec, 7200);
        assert_eq!(o.chunk_size_limit_mb, 8);
        assert_eq!(o.volume_server_access, VolumeServerAccess::FilerProxy);
        assert_eq!(o.read_retry_secs, 2, "rounded up");
        assert_eq!(o.uid_map, vec![(1, 2)]);
        assert_eq!(o.gid_map, vec![(3, 4)], "gidMap wins over map.gid");
        assert_eq!(o.cache_capacity_mb, 64);
        assert_eq!(o.cache_meta_ttl_sec, 5);
        assert_eq!(o.concurrent_readers, 7);
        assert_eq!(
            o.concurrent_writers,
            MountOptions::default().concurrent_writers,
            "0 keeps the default"
        );
        assert_eq!(o.filers, vec!["a:1".to_string(), "b:2".to_string()]);
        assert_eq!(o.filer_path, "/override");
        assert_eq!(o.quota_bytes, 1 << 30);
        assert_eq!(o.data_center, "dc1");
        assert!(o.read_only);
    }

    #[test]
    fn static_pv_collection_defaults_to_path_basename() {
        let o = resolve_mount_options(
            "handle",
            &ctx(&[("path", "/data/team-a")]),
            &defaults(),
            false,
        )
        .unwrap();
        assert_eq!(
            (o.filer_path.as_str(), o.collection.as_str()),
            ("/data/team-a", "team-a")
        );
        let o = resolve_mount_options("legacy-id", &HashMap::new(), &defaults(), false).unwrap();
        assert_eq!(
            (o.filer_path.as_str(), o.collection.as_str()),
            ("/buckets/legacy-id", "legacy-id")
        );
    }

    #[test]
    fn data_locality_rules() {
        let mut d = defaults();
        let c = ctx(&[("dataLocality", "write_preferLocalDc")]);
        assert_eq!(
            resolve_mount_options("/b/v", &c, &d, false).unwrap_err(),
            ParamError::LocalityWithoutDataCenter("write_preferLocalDc".into())
        );
        d.data_center = "node-dc".into();
        assert_eq!(
            resolve_mount_options("/b/v", &c, &d, false)
                .unwrap()
                .data_center,
            "node-dc"
        );
        // Without locality the node's data center is not used.
        assert_eq!(
            resolve_mount_options("/b/v", &HashMap::new(), &d, false)
                .unwrap()
                .data_center,
            ""
        );
        d.data_locality = DataLocality::WritePreferLocalDc;
        assert_eq!(
            resolve_mount_options("/b/v", &HashMap::new(), &d, false)
                .unwrap()
                .data_center,
            "node-dc"
        );
        let none = ctx(&[("dataLocality", "none")]);
        assert_eq!(
            resolve_mount_options("/b/v", &none, &d, false)
                .unwrap()
                .data_center,
            ""
        );
        assert!(
            resolve_mount_options("/b/v", &ctx(&[("dataLocality", "bogus")]), &d, false).is_err()
        );
    }

    #[test]
    fn node_data_center_is_used_only_for_local_writes_without_a_volume_data_center() {
        let mut d = defaults();
        let uses = |c: &[(&str, &str)], d: &VolumeDefaults| uses_node_data_center(&ctx(c), d);
        assert!(!uses(&[], &d));
        assert!(uses(&[("dataLocality", "write_preferLocalDc")], &d));
        assert!(!uses(
            &[("dataLocality", "write_preferLocalDc"), ("dataCenter", "x")],
            &d
        ));
        d.data_locality = DataLocality::WritePreferLocalDc;
        assert!(uses(&[], &d));
        assert!(!uses(&[("dataLocality", "none")], &d));
        assert!(!uses(&[("dataLocality", "bogus")], &d));
    }

    #[test]
    fn invalid_values_name_the_key() {
        for (k, v) in [
            ("replication", "1"),
            ("ttl", "soon"),
            ("chunkSizeLimitMB", "0"),
            ("chunkSizeLimitMB", "-1"),
            ("volumeServerAccess", "bogus"),
            ("readRetryTime", "6"),
            ("uidMap", "1000"),
            ("map.gid", "x:1"),
            ("cacheCapacityMB", "lots"),
            ("concurrentReaders", "-3"),
            ("filer", " , "),
            ("filer.path", "relative"),
            ("volumeCapacity", "-5"),
            ("volumeCapacity", "1Gi"),
        ] {
            let err =
                resolve_mount_options("/b/v", &ctx(&[(k, v)]), &defaults(), false).unwrap_err();
            assert!(err.to_string().contains(k), "{k}={v}: {err}");
        }
    }

    #[test]
    fn tiny_capacity_means_no_quota() {
        assert_eq!(
            capacity_from_context(&ctx(&[("volumeCapacity", "1")])).unwrap(),
            0
        );
        assert_eq!(
            capacity_from_context(&ctx(&[("volumeCapacity", "2")])).unwrap(),
            2
        );
    }
}
