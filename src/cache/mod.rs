//! Chunk cache shared by every reader of one FUSE session.
//!
//! Keys are file ids, which are immutable, so nothing ever needs invalidating. Values are whole
//! clear chunks weighed in bytes. Concurrent misses for one chunk are coalesced into one fetch
//! (`try_get_with`); eviction happens on moka's maintenance path and never blocks readers.
//! Fetches in flight are tracked so that readers of part of such a chunk wait for it instead
//! of asking the volume server for their range too.

pub mod disk;

use bytes::Bytes;
use disk::DiskCache;
use moka::future::Cache;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How many chunks read by exact ranges are remembered, and for how long (see
/// [`ChunkCache::touch_ranged`]).
const RANGED_MEMORY: u64 = 4096;
const RANGED_TTL: Duration = Duration::from_secs(60);
/// KiB of chunks waiting to be written to the disk tier (each holds its chunk, mostly shared
/// with the memory cache, until written); past it a chunk is not put on disk.
const DISK_QUEUE_KIB: u32 = 128 << 10;

#[derive(Debug, Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_from_cache: AtomicU64,
    pub bytes_fetched: AtomicU64,
    /// Bytes read from the disk tier (counted neither as hits nor misses here: see
    /// [`disk::DiskStats`]).
    pub bytes_from_disk: AtomicU64,
    pub evictions: Arc<AtomicU64>,
}

#[derive(Clone)]
pub struct ChunkCache {
    cache: Option<Cache<String, Bytes>>,
    /// Chunks being fetched whole right now, with the number of fetches (normally one).
    pending: Arc<Mutex<HashMap<String, usize>>>,
    /// Chunks recently read by exact ranges.
    ranged: moka::sync::Cache<String, ()>,
    /// The disk tier under `cacheDir`, if any: read before the volume servers, filled with
    /// what they send.
    disk: Option<Arc<DiskCache>>,
    /// Disk writes queued, in KiB: a reader outrunning the disk by far skips caching rather
    /// than queueing chunks in memory without bound.
    disk_writes: Arc<tokio::sync::Semaphore>,
    pub stats: Arc<CacheStats>,
}

/// Marks a whole-chunk fetch as in flight until dropped (also when the fetch is cancelled).
struct Pending<'a> {
    map: &'a Mutex<HashMap<String, usize>>,
    key: &'a str,
}

impl<'a> Pending<'a> {
    fn new(map: &'a Mutex<HashMap<String, usize>>, key: &'a str) -> Self {
        *map.lock().entry(key.to_string()).or_default() += 1;
        Pending { map, key }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let mut m = self.map.lock();
        if let Some(n) = m.get_mut(self.key) {
            *n -= 1;
            if *n == 0 {
                m.remove(self.key);
            }
        }
    }
}

impl ChunkCache {
    /// `capacity_bytes == 0` disables caching (fetches are still coalesced by the caller's
    /// read path, not here).
    pub fn new(capacity_bytes: u64) -> Self {
        let stats = Arc::new(CacheStats::default());
        let ev = stats.evictions.clone();
        let cache = (capacity_bytes > 0).then(|| {
            Cache::builder()
                .max_capacity(capacity_bytes)
                .weigher(|k: &String, v: &Bytes| {
                    (k.len() + v.len() + 64).min(u32::MAX as usize) as u32
                })
                .eviction_listener(move |_k, _v, cause| {
                    if cause.was_evicted() {
                        ev.fetch_add(1, Ordering::Relaxed);
                    }
                })
                .build()
        });
        let ranged = moka::sync::Cache::builder()
            .max_capacity(RANGED_MEMORY)
            .time_to_live(RANGED_TTL)
            .build();
        ChunkCache {
            cache,
            pending: Arc::default(),
            ranged,
            disk: None,
            disk_writes: Arc::new(tokio::sync::Semaphore::new(DISK_QUEUE_KIB as usize)),
            stats,
        }
    }

    /// Adds a disk tier: chunks fetched from the volume servers are also kept in `disk`, and
    /// a chunk missing from memory is read from there before the volume servers are asked.
    pub fn with_disk(mut self, disk: Arc<DiskCache>) -> Self {
        self.disk = Some(disk);
        self
    }

    pub fn disk(&self) -> Option<&Arc<DiskCache>> {
        self.disk.as_ref()
    }

    /// Whether the disk tier holds the chunk.
    pub fn on_disk(&self, fid: &str) -> bool {
        self.disk.as_ref().is_some_and(|d| d.contains(fid))
    }

    /// Closes the disk tier and waits for its writes in flight (bounded by `limit`): then
    /// nothing writes into its directory any more.
    pub async fn close_disk(&self, limit: Duration) -> Option<std::path::PathBuf> {
        let disk = self.disk.as_ref()?;
        disk.close();
        let all = self.disk_writes.acquire_many(DISK_QUEUE_KIB);
        if let Ok(Ok(p)) = tokio::time::timeout(limit, all).await {
            p.forget();
        }
        Some(disk.dir().to_path_buf())
    }

    pub fn enabled(&self) -> bool {
        self.cache.is_some()
    }

    pub async fn get(&self, fid: &str) -> Option<Bytes> {
        let v = self.cache.as_ref()?.get(fid).await;
        if let Some(b) = &v {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            self.stats
                .bytes_from_cache
                .fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        v
    }

    pub fn contains(&self, fid: &str) -> bool {
        self.cache
            .as_ref()
            .map(|c| c.contains_key(fid))
            .unwrap_or(false)
    }

    /// Cached, or being fetched whole: a reader of any part of it should wait for that fetch.
    /// (Not the disk tier: a small random read is cheaper as a ranged GET than as a whole
    /// chunk read and checked from disk.)
    pub fn contains_or_pending(&self, fid: &str) -> bool {
        self.contains(fid) || self.pending.lock().contains_key(fid)
    }

    /// Records a read of part of `fid` by exact range; true if the chunk was read that way
    /// recently, i.e. it is hot and worth fetching whole into the cache.
    pub fn touch_ranged(&self, fid: &str) -> bool {
        if self.cache.is_none() {
            return false;
        }
        if self.ranged.contains_key(fid) {
            self.ranged.invalidate(fid);
            return true;
        }
        self.ranged.insert(fid.to_string(), ());
        false
    }

    pub async fn insert(&self, fid: String, data: Bytes) {
        if let Some(c) = &self.cache {
            c.insert(fid, data).await;
        }
    }

    /// Returns the cached chunk or runs `fetch` once for all concurrent callers.
    pub async fn get_or_fetch<F, E>(&self, fid: &str, fetch: F) -> Result<Bytes, Arc<E>>
    where
        F: Future<Output = Result<Bytes, E>>,
        E: Send + Sync + 'static,
    {
        self.get_or_fetch_chunk(fid, true, fetch).await
    }

    /// [`Self::get_or_fetch`]; what is fetched goes to the disk tier only with `to_disk`
    /// (never a chunk the cluster keeps encrypted: it is cached decrypted).
    pub async fn get_or_fetch_chunk<F, E>(
        &self,
        fid: &str,
        to_disk: bool,
        fetch: F,
    ) -> Result<Bytes, Arc<E>>
    where
        F: Future<Output = Result<Bytes, E>>,
        E: Send + Sync + 'static,
    {
        match &self.cache {
            Some(c) => {
                let stats = self.stats.clone();
                let (mut fetched, mut on_disk) = (false, false);
                // held until the value is in the cache, so a reader never finds the chunk
                // neither pending nor cached while it is being inserted
                let mut pending = None;
                let r = c
                    .try_get_with(fid.to_string(), async {
                        pending = Some(Pending::new(&self.pending, fid));
                        if let Some(b) = self.read_disk(fid).await {
                            on_disk = true;
                            return Ok(b);
                        }
                        fetched = true;
                        let b = fetch.await?;
                        stats
                            .bytes_fetched
                            .fetch_add(b.len() as u64, Ordering::Relaxed);
                        if to_disk {
                            self.keep_on_disk(fid, &b);
                        }
                        Ok(b)
                    })
                    .await;
                drop(pending);
                if let (Ok(b), false) = (&r, on_disk) {
                    if fetched {
                        self.stats.misses.fetch_add(1, Ordering::Relaxed);
                    } else {
                        self.stats.hits.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .bytes_from_cache
                            .fetch_add(b.len() as u64, Ordering::Relaxed);
                    }
                }
                r
            }
            None => {
                if let Some(b) = self.read_disk(fid).await {
                    return Ok(b);
                }
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                let b = fetch.await.map_err(Arc::new)?;
                self.stats
                    .bytes_fetched
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                if to_disk {
                    self.keep_on_disk(fid, &b);
                }
                Ok(b)
            }
        }
    }

    /// The chunk from the disk tier (its file read off the async threads).
    async fn read_disk(&self, fid: &str) -> Option<Bytes> {
        let disk = self.disk.clone()?;
        if !disk.contains(fid) {
            return None;
        }
        let key = fid.to_string();
        let b = tokio::task::spawn_blocking(move || disk.get(&key))
            .await
            .ok()
            .flatten()?;
        self.stats
            .bytes_from_disk
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        Some(b)
    }

    /// Keeps a fetched chunk on disk, in the background (a reader never waits for it).
    fn keep_on_disk(&self, fid: &str, b: &Bytes) {
        let (Some(disk), Ok(rt)) = (self.disk.clone(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let kib = (b.len() as u64)
            .div_ceil(1024)
            .clamp(1, DISK_QUEUE_KIB as u64) as u32;
        let Ok(permit) = self.disk_writes.clone().try_acquire_many_owned(kib) else {
            disk.stats.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let (key, data) = (fid.to_string(), b.clone());
        rt.spawn_blocking(move || {
            disk.put(&key, &data);
            drop(permit);
        });
    }

    /// Bytes currently held (approximate; moka updates lazily).
    pub fn weighted_size(&self) -> u64 {
        self.cache.as_ref().map(|c| c.weighted_size()).unwrap_or(0)
    }

    pub async fn run_pending_tasks(&self) {
        if let Some(c) = &self.cache {
            c.run_pending_tasks().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[tokio::test]
    async fn coalesces_concurrent_misses_and_bounds_bytes() {
        let c = ChunkCache::new(10 * 1024 * 1024);
        let calls = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let c = c.clone();
            let calls = calls.clone();
            tasks.push(tokio::spawn(async move {
                c.get_or_fetch::<_, std::io::Error>("1,01", async {
                    calls.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    Ok(Bytes::from(vec![7u8; 1024]))
                })
                .await
                .unwrap()
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap().len(), 1024);
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        for i in 0..40 {
            c.insert(format!("2,{i:02x}"), Bytes::from(vec![0u8; 1024 * 1024]))
                .await;
        }
        c.run_pending_tasks().await;
        assert!(
            c.weighted_size() <= 10 * 1024 * 1024 + 1024 * 1024,
            "{}",
            c.weighted_size()
        );
    }

    #[tokio::test]
    async fn pending_fetch_is_visible_until_done() {
        let c = ChunkCache::new(1 << 20);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let c2 = c.clone();
        let t = tokio::spawn(async move {
            c2.get_or_fetch::<_, std::io::Error>("4,01", async {
                let _ = rx.await;
                Ok(Bytes::from_static(b"data"))
            })
            .await
        });
        while !c.contains_or_pending("4,01") {
            tokio::task::yield_now().await;
        }
        assert!(!c.contains("4,01"));
        tx.send(()).unwrap();
        t.await.unwrap().unwrap();
        assert!(c.contains_or_pending("4,01"));
        assert!(c.pending.lock().is_empty());
    }

    #[tokio::test]
    async fn second_ranged_touch_is_hot() {
        let c = ChunkCache::new(1 << 20);
        assert!(!c.touch_ranged("5,01"));
        assert!(!c.touch_ranged("5,02"));
        assert!(c.touch_ranged("5,01"));
        // forgotten once reported: the whole fetch caches it
        assert!(!c.touch_ranged("5,01"));
        assert!(!ChunkCache::new(0).touch_ranged("5,03"));
    }

    #[tokio::test]
    async fn failed_fetch_is_not_cached() {
        let c = ChunkCache::new(1 << 20);
        let r = c
            .get_or_fetch::<_, std::io::Error>("3,01", async { Err(std::io::Error::other("boom")) })
            .await;
        assert!(r.is_err());
        let r = c
            .get_or_fetch::<_, std::io::Error>("3,01", async { Ok(Bytes::from_static(b"ok")) })
            .await;
        assert_eq!(r.unwrap(), Bytes::from_static(b"ok"));
    }
}
