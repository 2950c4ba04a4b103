//! Volume-id → replica locations, looked up through the filer and cached without TTL.
//!
//! Like the Go client's vidMap: an entry stays until every replica of a read has failed, then
//! the reader invalidates it and looks it up once more. Concurrent lookups of one vid are
//! deduplicated (moka's `try_get_with` runs one loader and shares its result).

use super::VolumeError;
use crate::config::VolumeServerAccess;
use crate::filer::{FilerApi, FilerError};
use crate::pb::filer as pb;
use rand::seq::SliceRandom;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub type Locations = Arc<Vec<pb::Location>>;

pub struct LocationCache {
    filer: Arc<dyn FilerApi>,
    cache: moka::future::Cache<u32, Locations>,
    timeout: Duration,
    lookups: AtomicU64,
}

/// Why a lookup failed; `retryable` errors are worth another read round.
#[derive(Debug, Clone)]
pub struct LookupError {
    pub error: VolumeError,
    pub retryable: bool,
}

impl LocationCache {
    pub fn new(filer: Arc<dyn FilerApi>, timeout: Duration) -> Self {
        Self {
            filer,
            cache: moka::future::Cache::builder().max_capacity(1 << 16).build(),
            timeout,
            lookups: AtomicU64::new(0),
        }
    }

    /// Cached locations of `vid`, looking them up (once, shared by concurrent callers) if absent.
    pub async fn get(&self, vid: u32) -> std::result::Result<Locations, LookupError> {
        self.cache
            .try_get_with(vid, self.lookup(vid))
            .await
            .map_err(|e| (*e).clone())
    }

    async fn lookup(&self, vid: u32) -> std::result::Result<Locations, LookupError> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let res = tokio::time::timeout(self.timeout, self.filer.lookup_volume(vid)).await;
        match res {
            Err(_) => Err(LookupError {
                error: VolumeError::Timeout(format!("lookup of volume {vid}")),
                retryable: true,
            }),
            Ok(Ok(locs)) if locs.is_empty() => Err(LookupError {
                error: VolumeError::NoLocation(vid),
                retryable: true,
            }),
            Ok(Ok(locs)) => Ok(Arc::new(locs)),
            Ok(Err(e)) => {
                tracing::debug!(vid, error = %e, "volume lookup failed");
                let missing = e.is_not_found() || e.to_string().contains("not found");
                let retryable =
                    matches!(e, FilerError::Unavailable(_) | FilerError::Timeout(_)) || missing;
                let error = if missing {
                    VolumeError::NoLocation(vid)
                } else {
                    VolumeError::Read {
                        fid: format!("{vid},*"),
                        msg: format!("volume lookup: {e}"),
                    }
                };
                Err(LookupError { error, retryable })
            }
        }
    }

    /// Forgets `vid` so the next read looks it up again.
    pub async fn invalidate(&self, vid: u32) {
        self.cache.invalidate(&vid).await;
    }

    /// Puts known locations in the cache (e.g. from an assign, or tests).
    pub async fn seed(&self, vid: u32, locs: Vec<pb::Location>) {
        self.cache.insert(vid, Arc::new(locs)).await;
    }

    /// How many lookups reached the filer.
    pub fn lookup_count(&self) -> u64 {
        self.lookups.load(Ordering::Relaxed)
    }
}

/// Replica base addresses (`host:port`) in the order to try: same data center first, each group
/// shuffled. `PublicUrl` prefers `public_url` and falls back to `url`.
pub fn ordered_hosts(
    locs: &[pb::Location],
    access: VolumeServerAccess,
    data_center: &str,
) -> Vec<String> {
    let host = |l: &pb::Location| match access {
        VolumeServerAccess::PublicUrl if !l.public_url.is_empty() => l.public_url.clone(),
        _ => l.url.clone(),
    };
    let mut rng = rand::rng();
    let (mut near, mut far): (Vec<_>, Vec<_>) = locs
        .iter()
        .filter(|l| !l.url.is_empty() || !l.public_url.is_empty())
        .partition(|l| !data_center.is_empty() && l.data_center == data_center);
    near.shuffle(&mut rng);
    far.shuffle(&mut rng);
    near.into_iter()
        .chain(far)
        .map(host)
        .filter(|h| !h.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(url: &str, public: &str, dc: &str) -> pb::Location {
        pb::Location {
            url: url.into(),
            public_url: public.into(),
            data_center: dc.into(),
            ..Default::default()
        }
    }

    #[test]
    fn same_data_center_first_and_public_url_fallback() {
        let locs = vec![
            loc("a:1", "pa:1", "dc1"),
            loc("b:1", "", "dc2"),
            loc("c:1", "pc:1", "dc2"),
        ];
        for _ in 0..20 {
            let h = ordered_hosts(&locs, VolumeServerAccess::Direct, "dc2");
            assert_eq!(h.len(), 3);
            assert!(h[..2].contains(&"b:1".to_string()) && h[..2].contains(&"c:1".to_string()));
            assert_eq!(h[2], "a:1");
        }
        let mut h = ordered_hosts(&locs, VolumeServerAccess::PublicUrl, "");
        h.sort();
        assert_eq!(h, vec!["b:1", "pa:1", "pc:1"]);
        assert!(ordered_hosts(&[loc("", "", "")], VolumeServerAccess::Direct, "").is_empty());
    }
}
