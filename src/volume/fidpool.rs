//! File ids assigned several at a time. One `AssignVolume` with `count = n` reserves n
//! consecutive needle keys under one cookie (`fid`, `fid_1`, ... `fid_{n-1}`; the volume
//! server adds the suffix to the key and checks a write JWT against the id without it). Every
//! assign is a filer round trip plus the filer's own call to the master: for small files, as
//! in an untar, it was a third of the time per file.
//!
//! Ids are shared only between uploads that the filer would place alike: same collection,
//! replication, TTL, data center and disk type, and files in one directory, unless a
//! filer.conf path rule ends inside that directory's names (then every upload assigns alone).
//! Reserved ids expire after a short time (a write JWT lives ~10 s; a volume may fill up)
//! and are dropped when an upload to one fails. Unused ids are only skipped keys.

use crate::pb::filer as pb;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Ids reserved per assign.
pub const BATCH: i32 = 16;
/// Uploads of files that fsync often take reserved ids up to this size: their fsyncs wait
/// for the upload, and an assign was ~15 % of such an fsync.
pub const MAX_SYNC_POOLED_SIZE: u64 = 8 << 20;
/// Reserved ids older than this are not handed out.
pub const FRESH_FOR: Duration = Duration::from_secs(2);
/// Uploads larger than this assign alone (the assign is a small part of their time).
pub const MAX_POOLED_SIZE: u64 = 256 << 10;
/// Directories with reserved ids at once (older ones are dropped past it).
const MAX_KEYS: usize = 256;

/// Uploads that may share one assign.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub collection: String,
    pub replication: String,
    pub ttl_sec: i32,
    pub data_center: String,
    pub disk_type: String,
    /// The directory of the file (filer.conf rules match path prefixes).
    pub dir: String,
}

struct Reserved {
    assign: pb::AssignVolumeResponse,
    next: i32,
    at: Instant,
}

#[derive(Default)]
pub struct FidPool {
    reserved: Mutex<HashMap<PoolKey, Reserved>>,
}

impl FidPool {
    /// The next reserved id for `key` (its `file_id` carries the `_n` suffix), if any.
    pub fn take(&self, key: &PoolKey) -> Option<pb::AssignVolumeResponse> {
        let mut m = self.reserved.lock();
        let r = m.get_mut(key)?;
        if r.next >= r.assign.count || r.at.elapsed() >= FRESH_FOR {
            m.remove(key);
            return None;
        }
        let mut out = r.assign.clone();
        out.file_id = format!("{}_{}", r.assign.file_id, r.next);
        out.count = 1;
        r.next += 1;
        Some(out)
    }

    /// Keeps the ids of a fresh assign beyond the first (which the caller uses).
    pub fn keep(&self, key: PoolKey, assign: &pb::AssignVolumeResponse) {
        if assign.count <= 1 {
            return;
        }
        // never more than asked for, whatever the answer says
        let mut assign = assign.clone();
        assign.count = assign.count.min(BATCH);
        let mut m = self.reserved.lock();
        if m.len() >= MAX_KEYS {
            m.retain(|_, r| r.at.elapsed() < FRESH_FOR && r.next < r.assign.count);
            if m.len() >= MAX_KEYS {
                m.clear();
            }
        }
        m.insert(
            key,
            Reserved {
                assign,
                next: 1,
                at: Instant::now(),
            },
        );
    }

    /// An upload to one of `key`'s ids failed: its volume may be full or gone.
    pub fn forget(&self, key: &PoolKey) {
        self.reserved.lock().remove(key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.reserved.lock().len()
    }

    #[cfg(test)]
    fn age(&self, key: &PoolKey, by: Duration) {
        if let Some(r) = self.reserved.lock().get_mut(key) {
            r.at -= by;
        }
    }
}

/// The location prefixes of the filer's path rules (filer.conf, as `fs.configure` writes
/// it: JSON with `locations[].locationPrefix`). None if the text is not such a file.
pub fn rule_prefixes(conf: &[u8]) -> Option<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(conf).ok()?;
    let Some(locations) = v.get("locations") else {
        return Some(Vec::new());
    };
    let mut out = Vec::new();
    for l in locations.as_array()? {
        let p = l
            .get("locationPrefix")
            .or_else(|| l.get("location_prefix"))
            .and_then(|p| p.as_str())?;
        out.push(p.to_string());
    }
    Some(out)
}

/// Whether a rule applies to some files directly in `dir` and not to others: its prefix
/// ends inside the names of `dir` (`/d/app` splits `/d`; `/d/`, `/d/sub/` and `/` do not).
pub fn splits_dir(dir: &str, prefixes: &[String]) -> bool {
    let base = if dir.ends_with('/') {
        dir.to_string()
    } else {
        format!("{dir}/")
    };
    prefixes.iter().any(|p| {
        p.strip_prefix(base.as_str())
            .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(dir: &str) -> PoolKey {
        PoolKey {
            collection: "c".into(),
            replication: String::new(),
            ttl_sec: 0,
            data_center: String::new(),
            disk_type: String::new(),
            dir: dir.into(),
        }
    }

    fn assign(count: i32) -> pb::AssignVolumeResponse {
        pb::AssignVolumeResponse {
            file_id: "3,01637037d6".into(),
            count,
            auth: "jwt".into(),
            ..Default::default()
        }
    }

    #[test]
    fn hands_out_each_reserved_id_once_then_nothing() {
        let p = FidPool::default();
        assert!(p.take(&key("/d")).is_none());
        p.keep(key("/d"), &assign(3));
        let a = p.take(&key("/d")).unwrap();
        assert_eq!(a.file_id, "3,01637037d6_1");
        assert_eq!(a.auth, "jwt", "the assign's JWT covers every suffix");
        assert_eq!(p.take(&key("/d")).unwrap().file_id, "3,01637037d6_2");
        assert!(p.take(&key("/d")).is_none(), "only count - 1 ids are kept");
        assert!(
            p.take(&key("/other")).is_none(),
            "another directory assigns alone"
        );
        let mut k = key("/d");
        k.ttl_sec = 60;
        p.keep(key("/d"), &assign(3));
        assert!(p.take(&k).is_none(), "another TTL assigns alone");
    }

    #[test]
    fn reserved_ids_expire_and_never_exceed_the_batch() {
        let p = FidPool::default();
        p.keep(key("/d"), &assign(5));
        assert!(p.take(&key("/d")).is_some());
        p.age(&key("/d"), FRESH_FOR);
        assert!(p.take(&key("/d")).is_none(), "older than FRESH_FOR");
        p.keep(key("/d"), &assign(1000));
        let n = std::iter::from_fn(|| p.take(&key("/d"))).count();
        assert_eq!(
            n,
            BATCH as usize - 1,
            "a larger count than asked is not trusted"
        );
    }

    #[test]
    fn single_assigns_and_failed_volumes_are_not_kept() {
        let p = FidPool::default();
        p.keep(key("/d"), &assign(1));
        assert!(p.take(&key("/d")).is_none());
        p.keep(key("/d"), &assign(8));
        p.forget(&key("/d"));
        assert!(p.take(&key("/d")).is_none());
    }

    #[test]
    fn the_number_of_directories_is_bounded() {
        let p = FidPool::default();
        for i in 0..(MAX_KEYS * 3) {
            p.keep(key(&format!("/d{i}")), &assign(4));
        }
        assert!(p.len() <= MAX_KEYS);
    }

    #[test]
    fn rules_ending_inside_a_directory_split_it() {
        let conf = br#"{"version":0,"locations":[
            {"locationPrefix":"/buckets/b1/","collection":"b1"},
            {"locationPrefix":"/data/logs/app","ttl":"1d"},
            {"location_prefix":"/data/deep/sub/","ttl":"1d"}]}"#;
        let rules = rule_prefixes(conf).unwrap();
        assert_eq!(rules.len(), 3);
        assert!(
            splits_dir("/data/logs", &rules),
            "app* files have a TTL, others not"
        );
        assert!(
            !splits_dir("/data/logs/app", &rules),
            "a rule over a whole directory"
        );
        assert!(!splits_dir("/buckets/b1", &rules));
        assert!(
            !splits_dir("/buckets", &rules),
            "a rule for a subdirectory only"
        );
        assert!(!splits_dir("/data/deep", &rules));
        assert!(splits_dir("/", &["/tmp-".to_string()]));
        assert_eq!(rule_prefixes(b"{}"), Some(Vec::new()));
        assert_eq!(rule_prefixes(b"not json"), None);
        assert_eq!(
            rule_prefixes(br#"{"locations":[{"collection":"x"}]}"#),
            None
        );
    }
}
