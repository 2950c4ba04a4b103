//! Chunk cache shared by every reader of one FUSE session.
//!
//! Keys are file ids, which are immutable, so nothing ever needs invalidating. Values are whole
//! clear chunks weighed in bytes. Concurrent misses for one chunk are coalesced into one fetch
//! (`try_get_with`); eviction happens on moka's maintenance path and never blocks readers.
//! Fetches in flight are tracked so that readers of part of such a chunk wait for it instead
//! of asking the volume server for their range too.
//!
//! The memory itself is a [`MemoryTier`]: with a node memory budget, one tier for the whole
//! process, in which every session's chunks compete (a session is an owner; its entries leave
//! with it); without one, a tier per session.

pub mod disk;

use bytes::Bytes;
use disk::DiskCache;
use moka::future::Cache;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
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

/// A chunk in a [`MemoryTier`]: its owner (a session) and file id.
type TierKey = (u64, String);

/// What one owner holds in a tier.
#[derive(Debug, Default)]
struct OwnerUse {
    bytes: AtomicI64,
    evictions: Arc<AtomicU64>,
}

/// Chunks in memory, bounded in bytes, shared by its owners (see the module docs). Entries
/// compete by frequency and recency (moka's TinyLFU), so one pass over a big file by one
/// volume does not push out the chunks another volume reads again and again.
pub struct MemoryTier {
    cache: Cache<TierKey, Bytes>,
    owners: Arc<Mutex<HashMap<u64, Arc<OwnerUse>>>>,
    next_owner: AtomicU64,
    capacity: u64,
}

impl std::fmt::Debug for MemoryTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTier")
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl MemoryTier {
    pub fn new(capacity_bytes: u64) -> Arc<Self> {
        let owners: Arc<Mutex<HashMap<u64, Arc<OwnerUse>>>> = Arc::default();
        let seen = owners.clone();
        let cache = Cache::builder()
            .max_capacity(capacity_bytes)
            .weigher(|k: &TierKey, v: &Bytes| weight(&k.1, v))
            .support_invalidation_closures()
            .eviction_listener(move |k: Arc<TierKey>, v: Bytes, cause| {
                let Some(o) = seen.lock().get(&k.0).cloned() else {
                    return; // its owner is gone
                };
                o.bytes
                    .fetch_sub(i64::from(weight(&k.1, &v)), Ordering::Relaxed);
                if cause.was_evicted() {
                    o.evictions.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build();
        Arc::new(MemoryTier {
            cache,
            owners,
            next_owner: AtomicU64::new(1),
            capacity: capacity_bytes,
        })
    }

    /// The node's tier, sized by the memory budget's cache share (made at first use, after
    /// the budget is configured). `None` without a budget.
    pub fn node() -> Option<Arc<MemoryTier>> {
        static NODE: std::sync::OnceLock<Option<Arc<MemoryTier>>> = std::sync::OnceLock::new();
        NODE.get_or_init(|| {
            let limit = crate::budget::MemoryBudget::global().cache_limit();
            (limit != u64::MAX).then(|| {
                let t = MemoryTier::new(limit);
                crate::metrics::global().add_collector(Box::new(TierCollector(t.clone())));
                t
            })
        })
        .clone()
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held by every owner (approximate: moka settles its accounting lazily).
    pub fn weighted_size(&self) -> u64 {
        self.cache.weighted_size()
    }

    fn owner(self: &Arc<Self>, evictions: Arc<AtomicU64>) -> Owner {
        let id = self.next_owner.fetch_add(1, Ordering::Relaxed);
        let usage = Arc::new(OwnerUse {
            bytes: AtomicI64::new(0),
            evictions,
        });
        self.owners.lock().insert(id, usage.clone());
        Owner {
            id,
            tier: self.clone(),
            usage,
        }
    }
}

fn weight(fid: &str, v: &Bytes) -> u32 {
    (fid.len() + v.len() + 64).min(u32::MAX as usize) as u32
}

/// A session's place in a tier; its chunks are dropped from the tier with it.
struct Owner {
    id: u64,
    tier: Arc<MemoryTier>,
    usage: Arc<OwnerUse>,
}

impl Owner {
    fn key(&self, fid: &str) -> TierKey {
        (self.id, fid.to_string())
    }

    /// Applies an insert's eviction now. moka applies its write log only every 64 writes or
    /// at a later operation, and until then the chunks it will evict stay in memory: up to
    /// 64 chunks (128 MiB of 2 MiB chunks) past the limit.
    async fn settle(&self) {
        self.tier.cache.run_pending_tasks().await;
    }

    fn held(&self, fid: &str, v: &Bytes) {
        self.usage
            .bytes
            .fetch_add(i64::from(weight(fid, v)), Ordering::Relaxed);
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.tier.owners.lock().remove(&self.id);
        let id = self.id;
        let c = self.tier.cache.clone();
        match tokio::runtime::Handle::try_current() {
            // removed one by one: a predicate (`invalidate_entries_if`) is applied a few
            // hundred entries per maintenance run, and only while the cache has traffic
            Ok(rt) => {
                rt.spawn(async move {
                    let mine: Vec<Arc<TierKey>> = c
                        .iter()
                        .filter(|(k, _)| k.0 == id)
                        .map(|(k, _)| k)
                        .collect();
                    for k in mine {
                        c.invalidate(&*k).await;
                    }
                    c.run_pending_tasks().await;
                });
            }
            Err(_) => {
                if let Err(e) = c.invalidate_entries_if(move |k, _| k.0 == id) {
                    tracing::warn!(error = %e, "chunk cache: could not drop a closed session's chunks");
                }
            }
        }
    }
}

/// Exports the node tier's size and capacity.
#[derive(Debug)]
struct TierCollector(Arc<MemoryTier>);

impl prometheus_client::collector::Collector for TierCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        const NO_LABELS: [(&str, &str); 0] = [];
        for (name, help, v) in [
            (
                "seaweedfs_csi_memory_cache_limit_bytes",
                "Chunk cache memory allowed node-wide (the memory budget's cache share).",
                self.0.capacity(),
            ),
            (
                "seaweedfs_csi_memory_cache_bytes",
                "Chunk cache memory held node-wide, every staged volume together.",
                self.0.weighted_size(),
            ),
        ] {
            crate::metrics::encode_values(
                &mut encoder,
                name,
                help,
                prometheus_client::metrics::MetricType::Gauge,
                [(NO_LABELS, v)],
            )?;
        }
        Ok(())
    }
}

#[derive(Clone)]
pub struct ChunkCache {
    /// The session's place in its memory tier (`None`: no memory caching).
    owner: Option<Arc<Owner>>,
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
    /// Chunks readahead fetched that the reader has not read whole yet. The tier may refuse
    /// a chunk seen once (TinyLFU admission: a big file read once must not push out chunks
    /// read often), and a reader that then fetched it again would double the GETs of a scan,
    /// so readahead holds what it fetched here, and reads take it from here without touching
    /// the tier (which would raise the chunk's frequency until it is admitted). A hold goes
    /// when its bytes have all been read ([`Self::served`]), after [`ARRIVED_TTL`]
    /// ([`Self::expire_arrived`], run every second), or to keep a session's holds within
    /// [`ARRIVED_MAX_BYTES`]. Each keeps its readahead charge: the node's readahead share
    /// bounds them too.
    arrived: Arc<Mutex<HashMap<String, Arrived>>>,
    pub stats: Arc<CacheStats>,
}

/// Marks a fetch as readahead's, with its charge against the node's readahead share.
struct Prefetch(Option<crate::budget::ReadaheadCharge>);

/// How long a chunk fetched by readahead waits for its reader.
const ARRIVED_TTL: Duration = Duration::from_secs(5);
/// Most bytes one session keeps waiting for their readers.
const ARRIVED_MAX_BYTES: usize = 64 << 20;

struct Arrived {
    data: Bytes,
    at: std::time::Instant,
    /// Bytes of it read so far.
    served: u64,
    _charge: Option<crate::budget::ReadaheadCharge>,
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
        Self::build((capacity_bytes > 0).then(|| MemoryTier::new(capacity_bytes)))
    }

    /// A session's cache in a shared tier (its chunks compete with every other owner's).
    pub fn in_tier(tier: &Arc<MemoryTier>) -> Self {
        Self::build(Some(tier.clone()))
    }

    /// The cache of a session of this node: in the node's tier when there is a memory budget,
    /// else a tier of its own of `capacity_bytes`.
    pub fn for_node(capacity_bytes: u64) -> Self {
        match MemoryTier::node() {
            Some(t) => Self::in_tier(&t),
            None => Self::new(capacity_bytes),
        }
    }

    fn build(tier: Option<Arc<MemoryTier>>) -> Self {
        let stats = Arc::new(CacheStats::default());
        let owner = tier.map(|t| Arc::new(t.owner(stats.evictions.clone())));
        let ranged = moka::sync::Cache::builder()
            .max_capacity(RANGED_MEMORY)
            .time_to_live(RANGED_TTL)
            .build();
        ChunkCache {
            owner,
            pending: Arc::default(),
            ranged,
            disk: None,
            disk_writes: Arc::new(tokio::sync::Semaphore::new(DISK_QUEUE_KIB as usize)),
            arrived: Arc::default(),
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
        self.owner.is_some()
    }

    pub async fn get(&self, fid: &str) -> Option<Bytes> {
        let o = self.owner.as_ref()?;
        let v = o.tier.cache.get(&o.key(fid)).await;
        if let Some(b) = &v {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            self.stats
                .bytes_from_cache
                .fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        v
    }

    pub fn contains(&self, fid: &str) -> bool {
        self.owner
            .as_ref()
            .is_some_and(|o| o.tier.cache.contains_key(&o.key(fid)))
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
        if self.owner.is_none() {
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
        if let Some(o) = &self.owner {
            o.held(&fid, &data);
            o.tier.cache.insert((o.id, fid), data).await;
            o.settle().await;
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
        self.fetch_chunk(fid, to_disk, None, fetch).await
    }

    /// Readahead of a chunk: fetched as by [`Self::get_or_fetch_chunk`], and also held for its
    /// reader (with `charge`) in case the tier does not keep it.
    pub async fn prefetch_chunk<F, E>(
        &self,
        fid: &str,
        to_disk: bool,
        charge: Option<crate::budget::ReadaheadCharge>,
        fetch: F,
    ) where
        F: Future<Output = Result<Bytes, E>>,
        E: Send + Sync + 'static,
    {
        let _ = self
            .fetch_chunk(fid, to_disk, Some(Prefetch(charge)), fetch)
            .await;
    }

    async fn fetch_chunk<F, E>(
        &self,
        fid: &str,
        to_disk: bool,
        prefetch: Option<Prefetch>,
        fetch: F,
    ) -> Result<Bytes, Arc<E>>
    where
        F: Future<Output = Result<Bytes, E>>,
        E: Send + Sync + 'static,
    {
        if prefetch.is_none() {
            if let Some(b) = self.arrived(fid) {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_from_cache
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                return Ok(b);
            }
        }
        match &self.owner {
            Some(o) => {
                let stats = self.stats.clone();
                let (mut fetched, mut on_disk) = (false, false);
                // held until the value is in the cache, so a reader never finds the chunk
                // neither pending nor cached while it is being inserted
                let mut pending = None;
                let r = o
                    .tier
                    .cache
                    .try_get_with(o.key(fid), async {
                        pending = Some(Pending::new(&self.pending, fid));
                        if let Some(b) = self.arrived(fid) {
                            return Ok(b);
                        }
                        let b = match self.read_disk(fid).await {
                            Some(b) => {
                                on_disk = true;
                                b
                            }
                            None => {
                                fetched = true;
                                let b = fetch.await?;
                                stats
                                    .bytes_fetched
                                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                                if to_disk {
                                    self.keep_on_disk(fid, &b);
                                }
                                b
                            }
                        };
                        // held before any waiter has the value: each of them takes it back
                        if let Some(p) = prefetch {
                            self.hold_arrived(fid, &b, p.0);
                        }
                        Ok(b)
                    })
                    .await;
                // this call's init is what went into the tier
                let ran = pending.is_some();
                drop(pending);
                if let (Ok(b), true) = (&r, ran) {
                    o.held(fid, b);
                    o.settle().await;
                }
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

    /// Keeps a chunk readahead fetched until its reader takes it (see `arrived`).
    fn hold_arrived(
        &self,
        fid: &str,
        data: &Bytes,
        charge: Option<crate::budget::ReadaheadCharge>,
    ) {
        let now = std::time::Instant::now();
        let mut m = self.arrived.lock();
        m.retain(|_, a| now.duration_since(a.at) < ARRIVED_TTL);
        let mut held: usize = m.values().map(|a| a.data.len()).sum();
        while held + data.len() > ARRIVED_MAX_BYTES && !m.is_empty() {
            let Some(oldest) = m.iter().min_by_key(|(_, a)| a.at).map(|(k, _)| k.clone()) else {
                break;
            };
            if let Some(a) = m.remove(&oldest) {
                held -= a.data.len();
            }
        }
        m.insert(
            fid.to_string(),
            Arrived {
                data: data.clone(),
                at: now,
                served: 0,
                _charge: charge,
            },
        );
    }

    /// The chunk readahead holds for its reader, if any.
    fn arrived(&self, fid: &str) -> Option<Bytes> {
        let m = self.arrived.lock();
        if m.is_empty() {
            return None;
        }
        m.get(fid).map(|a| a.data.clone())
    }

    /// Whether readahead holds the chunk for its reader.
    pub fn is_held(&self, fid: &str) -> bool {
        let m = self.arrived.lock();
        !m.is_empty() && m.contains_key(fid)
    }

    /// A reader read `len` bytes of chunk `fid` (of `size` bytes): once all of them have
    /// been read, readahead's hold on it, and the hold's charge, are given back. (Counting
    /// bytes, not the read of its end: the kernel's reads of one chunk finish out of order.)
    pub fn served(&self, fid: &str, len: u64, size: u64) {
        let mut m = self.arrived.lock();
        if m.is_empty() {
            return;
        }
        let done = match m.get_mut(fid) {
            Some(a) => {
                a.served += len;
                a.served >= size
            }
            None => false,
        };
        if done {
            m.remove(fid);
        }
    }

    /// Gives back the holds no reader came for within [`ARRIVED_TTL`] (a reader that stopped
    /// half way, a seek): run every second, so an idle session holds no readahead share.
    pub fn expire_arrived(&self) {
        let mut m = self.arrived.lock();
        if !m.is_empty() {
            m.retain(|_, a| a.at.elapsed() < ARRIVED_TTL);
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

    /// Bytes this session holds in its tier (approximate; moka settles lazily).
    pub fn weighted_size(&self) -> u64 {
        self.owner
            .as_ref()
            .map(|o| o.usage.bytes.load(Ordering::Relaxed).max(0) as u64)
            .unwrap_or(0)
    }

    /// The tier this session's chunks are kept in.
    pub fn tier(&self) -> Option<&Arc<MemoryTier>> {
        self.owner.as_ref().map(|o| &o.tier)
    }

    pub async fn run_pending_tasks(&self) {
        if let Some(o) = &self.owner {
            o.tier.cache.run_pending_tasks().await;
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

    async fn fill(c: &ChunkCache, prefix: &str, n: usize, mib: usize) {
        for i in 0..n {
            c.get_or_fetch::<_, std::io::Error>(&format!("{prefix},{i:02x}"), async move {
                Ok(Bytes::from(vec![1u8; mib << 20]))
            })
            .await
            .unwrap();
        }
        c.run_pending_tasks().await;
    }

    #[tokio::test]
    async fn sessions_in_one_tier_share_its_capacity_and_account_their_own_bytes() {
        let tier = MemoryTier::new(8 << 20);
        let (a, b) = (ChunkCache::in_tier(&tier), ChunkCache::in_tier(&tier));
        fill(&a, "1", 6, 1).await;
        fill(&b, "2", 6, 1).await;
        let total = tier.weighted_size();
        assert!(total <= 8 << 20, "{total}");
        assert_eq!(a.weighted_size() + b.weighted_size(), total);
        assert!(
            a.stats.evictions.load(Ordering::Relaxed) + b.stats.evictions.load(Ordering::Relaxed)
                > 0
        );
        // one session's chunk is not another's, even with the same file id (other clusters)
        a.insert("9,01".into(), Bytes::from_static(b"a")).await;
        assert!(b.get("9,01").await.is_none());
        assert_eq!(a.get("9,01").await.unwrap(), Bytes::from_static(b"a"));
    }

    #[tokio::test]
    async fn a_closed_session_leaves_the_tier_with_its_chunks() {
        let tier = MemoryTier::new(64 << 20);
        let (a, b) = (ChunkCache::in_tier(&tier), ChunkCache::in_tier(&tier));
        fill(&a, "1", 4, 1).await;
        fill(&b, "2", 3, 1).await;
        let a2 = a.clone();
        drop(a);
        tier.cache.run_pending_tasks().await;
        assert!(a2.contains("1,00"), "a clone still uses it");
        drop(a2);
        for _ in 0..100 {
            tier.cache.run_pending_tasks().await;
            if tier.weighted_size() == b.weighted_size() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(tier.weighted_size(), b.weighted_size());
        assert_eq!(tier.owners.lock().len(), 1);
    }

    #[tokio::test]
    async fn one_pass_over_a_big_file_leaves_another_sessions_hot_chunks() {
        let tier = MemoryTier::new(8 << 20);
        let (hot, scan) = (ChunkCache::in_tier(&tier), ChunkCache::in_tier(&tier));
        for _ in 0..5 {
            fill(&hot, "1", 4, 1).await;
        }
        fill(&scan, "2", 40, 1).await;
        for i in 0..4 {
            assert!(hot.contains(&format!("1,{i:02x}")), "hot chunk {i} evicted");
        }
        assert!(tier.weighted_size() <= 8 << 20);
    }

    fn mib(n: usize, v: u8) -> Bytes {
        Bytes::from(vec![v; n << 20])
    }

    /// A tier full of another session's hot chunks (each read 5 times).
    async fn hot_tier(chunks: usize) -> (Arc<MemoryTier>, ChunkCache) {
        let tier = MemoryTier::new(8 << 20);
        let hot = ChunkCache::in_tier(&tier);
        for _ in 0..5 {
            fill(&hot, "1", chunks, 1).await;
        }
        (tier, hot)
    }

    /// A scan of a file bigger than the tier, with another session's hot chunks in it: each
    /// chunk is fetched by readahead, then read in 8 pieces, as the kernel reads. The tier
    /// refuses the scan's chunks, each is still fetched once (readahead held it for its
    /// reader), the reads never touch the tier (they would raise the chunk's frequency until
    /// it pushed the hot chunks out), and every hold is given back once read.
    #[tokio::test]
    async fn a_scan_the_tier_refuses_is_fetched_once_and_leaves_the_hot_chunks() {
        let (tier, hot) = hot_tier(7).await;
        let budget = crate::budget::MemoryBudget::new(1 << 30);
        let scan = ChunkCache::in_tier(&tier);
        let fetches = Arc::new(AtomicUsize::new(0));
        let fetch = |n: Arc<AtomicUsize>| async move {
            n.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(mib(1, 2))
        };
        for i in 0..40 {
            let fid = format!("2,{i:02x}");
            let charge = budget.try_readahead(1 << 20);
            scan.prefetch_chunk(&fid, true, charge, fetch(fetches.clone()))
                .await;
            for _ in 0..8 {
                let b = scan
                    .get_or_fetch(&fid, fetch(fetches.clone()))
                    .await
                    .unwrap();
                assert_eq!(b.len(), 1 << 20);
                scan.served(&fid, 128 << 10, 1 << 20);
            }
        }
        tier.cache.run_pending_tasks().await;
        assert_eq!(fetches.load(Ordering::SeqCst), 40);
        let left = (0..7)
            .filter(|i| hot.contains(&format!("1,{i:02x}")))
            .count();
        assert_eq!(left, 7, "hot chunks pushed out by a one-pass scan");
        assert_eq!(budget.readahead(), 0, "every hold gave its charge back");
        assert!(tier.weighted_size() <= 8 << 20);
    }

    /// The kernel's reads of one chunk finish out of order: the read of its end before the
    /// read of its middle must not end the hold.
    #[tokio::test]
    async fn reads_of_a_held_chunk_out_of_order_fetch_it_once() {
        let (tier, _hot) = hot_tier(8).await;
        let scan = ChunkCache::in_tier(&tier);
        let n = Arc::new(AtomicUsize::new(0));
        let f = |n: Arc<AtomicUsize>| async move {
            n.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(mib(1, 2))
        };
        scan.prefetch_chunk("2,01", false, None, f(n.clone())).await;
        scan.get_or_fetch("2,01", f(n.clone())).await.unwrap(); // its end
        scan.served("2,01", 512 << 10, 1 << 20);
        scan.get_or_fetch("2,01", f(n.clone())).await.unwrap(); // its middle, later
        scan.served("2,01", 512 << 10, 1 << 20);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        assert!(!scan.is_held("2,01"), "read whole: given back");
    }

    /// Holds a reader never comes for (it stopped half way) are given back after the TTL, so
    /// an idle session holds none of the node's readahead share; and one session never holds
    /// more than its cap.
    #[tokio::test]
    async fn holds_nobody_reads_expire_and_stay_within_a_cap() {
        let budget = crate::budget::MemoryBudget::new(128 << 20); // 16 MiB of readahead
        let a = ChunkCache::in_tier(&MemoryTier::new(64 << 20));
        for i in 0..8 {
            let charge = budget.try_readahead(2 << 20);
            assert!(charge.is_some());
            a.prefetch_chunk(&format!("3,{i:02x}"), false, charge, async {
                Ok::<_, std::io::Error>(mib(2, 1))
            })
            .await;
        }
        assert!(budget.try_readahead(2 << 20).is_none());
        a.expire_arrived();
        assert_eq!(budget.readahead(), 16 << 20, "not expired yet");
        for h in a.arrived.lock().values_mut() {
            h.at -= ARRIVED_TTL;
        }
        a.expire_arrived();
        assert_eq!(budget.readahead(), 0);
        assert!(budget.try_readahead(2 << 20).is_some());
        for i in 0..40 {
            a.prefetch_chunk(&format!("4,{i:02x}"), false, None, async {
                Ok::<_, std::io::Error>(mib(2, 1))
            })
            .await;
        }
        let held: usize = a.arrived.lock().values().map(|h| h.data.len()).sum();
        assert!(held <= ARRIVED_MAX_BYTES, "{held}");
    }

    /// A closed session's chunks leave an idle tier (no other traffic to drive moka's
    /// maintenance), however many there are.
    #[tokio::test]
    async fn a_closed_sessions_many_chunks_leave_an_idle_tier() {
        let tier = MemoryTier::new(256 << 20);
        let a = ChunkCache::in_tier(&tier);
        for i in 0..4000 {
            a.insert(format!("1,{i:04x}"), Bytes::from(vec![0u8; 16 << 10]))
                .await;
        }
        assert!(tier.cache.entry_count() > 3000);
        drop(a);
        for _ in 0..200 {
            if tier.cache.entry_count() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(tier.cache.entry_count(), 0);
        assert_eq!(tier.weighted_size(), 0);
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
