//! The node-wide memory budget: one plugin process serves every volume staged on its node,
//! so its memory is the node's problem. This module bounds the part that grows with the
//! number of open files: dirty write data (bytes written and not yet uploaded). Every
//! buffered byte holds a [`Charge`]; a writer that finds the budget spent makes room (its own
//! dirty bytes start uploading), asks every session to do the same with theirs, and waits
//! until uploads have freed enough. Writers wait; they never fail for memory.

use crate::metrics::encode_values;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::Notify;

/// The smallest dirty limit: a few chunk-sized slots, so one writer always makes progress.
pub const MIN_DIRTY_BYTES: u64 = 32 << 20;

/// How the budget is shared, in eighths: dirty write data 2, the chunk cache 3, readahead
/// in flight 1, metadata caches 1; the last eighth is split between the inode tables (a
/// sixteenth) and headroom for the runtime and for requests in progress.
const DIRTY_EIGHTHS: u64 = 2;
const CACHE_EIGHTHS: u64 = 3;
const READAHEAD_EIGHTHS: u64 = 1;
const META_EIGHTHS: u64 = 1;

/// The smallest metadata allowance: a few large directories.
pub const MIN_META_BYTES: u64 = 16 << 20;

/// The smallest inode-table allowance (about 13,000 nodes).
pub const MIN_INODE_BYTES: u64 = 4 << 20;

/// Resident bytes of one inode-table node, as the budget counts them (`cargo bench --bench
/// meta_cache`: 312 per node at a million, paths of ~50 bytes).
pub const NODE_BYTES: u64 = 320;

/// The smallest chunk cache: sequential readahead lands in it.
pub const MIN_CACHE_BYTES: u64 = 32 << 20;
/// The smallest readahead allowance: a few chunks, so a sequential reader still streams.
pub const MIN_READAHEAD_BYTES: u64 = 16 << 20;

#[derive(Debug)]
pub struct MemoryBudget {
    /// The whole budget in bytes (`u64::MAX`: none set).
    total: AtomicU64,
    /// Dirty bytes allowed node-wide (`u64::MAX`: unbounded).
    dirty_limit: AtomicU64,
    dirty: AtomicU64,
    /// Bytes of readahead fetches in flight, node-wide.
    readahead: AtomicU64,
    /// Bytes of cached directory listings, node-wide.
    meta: AtomicU64,
    /// Times a session dropped listings to stay within the metadata part (a metric).
    pub meta_evictions: AtomicU64,
    /// Nodes in the inode tables of every session, as last reported by each.
    nodes: AtomicU64,
    /// Nodes sessions asked the kernel to forget (a metric).
    pub nodes_pruned: AtomicU64,
    /// Writers that found the budget spent: every session seals its dirty slots.
    pressure: Notify,
    /// Dirty bytes went from over the limit to less.
    freed: Notify,
    /// Times a writer had to wait for room (a metric).
    pub waits: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `total` bytes (`u64::MAX`: unbounded).
    pub fn new(total: u64) -> Arc<Self> {
        let b = Arc::new(MemoryBudget {
            total: AtomicU64::new(u64::MAX),
            dirty_limit: AtomicU64::new(u64::MAX),
            dirty: AtomicU64::new(0),
            readahead: AtomicU64::new(0),
            meta: AtomicU64::new(0),
            meta_evictions: AtomicU64::new(0),
            nodes: AtomicU64::new(0),
            nodes_pruned: AtomicU64::new(0),
            pressure: Notify::new(),
            freed: Notify::new(),
            waits: AtomicU64::new(0),
        });
        b.set_total(total);
        b
    }

    /// The process's budget, shared by every session (unbounded until [`Self::set_total`]).
    /// Its use is exported with the process's metrics.
    pub fn global() -> &'static Arc<MemoryBudget> {
        static GLOBAL: OnceLock<Arc<MemoryBudget>> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let b = MemoryBudget::new(u64::MAX);
            crate::metrics::global().add_collector(Box::new(BudgetCollector(b.clone())));
            b
        })
    }

    /// Sets the process's budget from `--memoryBudgetMB`: a size in MiB, 0 for none, or
    /// (not given) [`default_total`].
    pub fn configure(flag_mb: Option<u64>) {
        let total = match flag_mb {
            Some(0) => u64::MAX,
            Some(mb) => mb.saturating_mul(1 << 20),
            None => default_total().unwrap_or(u64::MAX),
        };
        let b = Self::global();
        b.set_total(total);
        if total == u64::MAX {
            tracing::info!("no memory budget: dirty write data is not bounded node-wide");
        } else {
            tracing::info!(
                budget_mib = total >> 20,
                dirty_limit_mib = b.dirty_limit() >> 20,
                "memory budget"
            );
        }
    }

    /// Sets the budget; dirty data may take a quarter of it, and never less than
    /// [`MIN_DIRTY_BYTES`].
    pub fn set_total(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        let dirty = if total == u64::MAX {
            u64::MAX
        } else {
            (total / 8 * DIRTY_EIGHTHS).max(MIN_DIRTY_BYTES)
        };
        self.dirty_limit.store(dirty, Ordering::Relaxed);
        self.freed.notify_waiters();
    }

    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    pub fn dirty_limit(&self) -> u64 {
        self.dirty_limit.load(Ordering::Relaxed)
    }

    /// Bytes the node's chunk cache may hold (`u64::MAX`: no budget, each session has its
    /// own cache of `cacheCapacityMB`).
    pub fn cache_limit(&self) -> u64 {
        self.share(CACHE_EIGHTHS, MIN_CACHE_BYTES)
    }

    /// Bytes readahead may have in flight node-wide (`u64::MAX`: unbounded).
    pub fn readahead_limit(&self) -> u64 {
        self.share(READAHEAD_EIGHTHS, MIN_READAHEAD_BYTES)
    }

    fn share(&self, eighths: u64, min: u64) -> u64 {
        match self.total() {
            u64::MAX => u64::MAX,
            t => (t / 8 * eighths).max(min),
        }
    }

    /// Bytes the metadata caches of every session may hold (`u64::MAX`: unbounded).
    pub fn meta_limit(&self) -> u64 {
        self.share(META_EIGHTHS, MIN_META_BYTES)
    }

    /// Bytes of cached listings right now, node-wide.
    pub fn meta(&self) -> u64 {
        self.meta.load(Ordering::Relaxed)
    }

    pub fn meta_add(&self, n: u64) {
        self.meta.fetch_add(n, Ordering::Relaxed);
    }

    pub fn meta_sub(&self, n: u64) {
        // never below zero, whatever a caller's arithmetic
        let _ = self
            .meta
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                Some(m.saturating_sub(n))
            });
    }

    /// Bytes the inode tables of every session may hold (`u64::MAX`: unbounded): a
    /// sixteenth of the budget. Past it, sessions ask the kernel to forget the nodes it
    /// does not use (see `crate::fs::Fs::prune_nodes`).
    pub fn inode_limit(&self) -> u64 {
        match self.total() {
            u64::MAX => u64::MAX,
            t => (t / 16).max(MIN_INODE_BYTES),
        }
    }

    /// Nodes in every session's inode table (as last reported).
    pub fn nodes(&self) -> u64 {
        self.nodes.load(Ordering::Relaxed)
    }

    /// A session's table went from `before` to `now` nodes.
    pub fn nodes_changed(&self, before: u64, now: u64) {
        if now >= before {
            self.nodes.fetch_add(now - before, Ordering::Relaxed);
        } else {
            let n = before - now;
            let _ = self
                .nodes
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                    Some(m.saturating_sub(n))
                });
        }
    }

    pub fn count_meta_eviction(&self) {
        self.meta_evictions.fetch_add(1, Ordering::Relaxed);
    }

    /// Readahead bytes in flight right now, node-wide.
    pub fn readahead(&self) -> u64 {
        self.readahead.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` of readahead, or `None` when that would pass the limit (readahead is
    /// an optimisation: it is skipped, never waited for).
    pub fn try_readahead(self: &Arc<Self>, bytes: u64) -> Option<ReadaheadCharge> {
        let limit = self.readahead_limit();
        self.readahead
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                let after = held.checked_add(bytes)?;
                (after <= limit).then_some(after)
            })
            .ok()?;
        Some(ReadaheadCharge {
            budget: self.clone(),
            bytes,
        })
    }

    /// Dirty bytes held right now, node-wide.
    pub fn dirty(&self) -> u64 {
        self.dirty.load(Ordering::Relaxed)
    }

    pub fn dirty_over(&self) -> bool {
        self.dirty() > self.dirty_limit()
    }

    /// A charge of 0 bytes against this budget (grown with [`Charge::set`]).
    pub fn charge(self: &Arc<Self>) -> Charge {
        Charge {
            budget: self.clone(),
            bytes: 0,
        }
    }

    /// Waits until dirty data is below the limit, asking every session to start uploading
    /// what it holds while it waits (re-asked now and then: a session busy with the last
    /// request misses the next one).
    pub async fn wait_for_room(&self) {
        let mut counted = false;
        while self.dirty_over() {
            if !counted {
                self.waits.fetch_add(1, Ordering::Relaxed);
                counted = true;
            }
            let freed = self.freed.notified();
            self.pressure.notify_waiters();
            let _ = tokio::time::timeout(Duration::from_millis(50), freed).await;
        }
    }

    /// Resolves when a writer found the budget spent (see [`Self::wait_for_room`]).
    pub async fn pressed(&self) {
        self.pressure.notified().await;
    }

    fn sub(&self, n: u64) {
        if n == 0 {
            return;
        }
        let before = self.dirty.fetch_sub(n, Ordering::Relaxed);
        if before > self.dirty_limit() && before - n <= self.dirty_limit() {
            self.freed.notify_waiters();
        }
    }
}

const NO_LABELS: [(&str, &str); 0] = [];

/// Exports a budget's use at scrape time.
#[derive(Debug)]
struct BudgetCollector(Arc<MemoryBudget>);

impl Collector for BudgetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let b = &self.0;
        // an unbounded budget or limit is exported as 0
        let finite = |v: u64| if v == u64::MAX { 0 } else { v };
        for (name, help, v) in [
            (
                "seaweedfs_csi_memory_budget_bytes",
                "The node plugin's memory budget (0: none).",
                finite(b.total()),
            ),
            (
                "seaweedfs_csi_dirty_limit_bytes",
                "Dirty write data allowed node-wide before writers wait (0: unbounded).",
                finite(b.dirty_limit()),
            ),
            (
                "seaweedfs_csi_dirty_bytes",
                "Dirty write data held node-wide (buffered or uploading).",
                b.dirty(),
            ),
            (
                "seaweedfs_csi_metadata_cache_limit_bytes",
                "Cached directory listings allowed node-wide (0: unbounded).",
                finite(b.meta_limit()),
            ),
            (
                "seaweedfs_csi_metadata_cache_bytes",
                "Cached directory listings held node-wide (approximate bytes).",
                b.meta(),
            ),
            (
                "seaweedfs_csi_inode_table_limit_bytes",
                "Inode-table nodes allowed node-wide, in bytes (0: unbounded).",
                finite(b.inode_limit()),
            ),
            (
                "seaweedfs_csi_inode_table_bytes",
                "Inode-table nodes of every session, in bytes (approximate).",
                b.nodes().saturating_mul(NODE_BYTES),
            ),
            (
                "seaweedfs_csi_readahead_limit_bytes",
                "Readahead fetches allowed in flight node-wide (0: unbounded).",
                finite(b.readahead_limit()),
            ),
            (
                "seaweedfs_csi_readahead_bytes",
                "Readahead fetches in flight node-wide.",
                b.readahead(),
            ),
        ] {
            encode_values(
                &mut encoder,
                name,
                help,
                MetricType::Gauge,
                [(NO_LABELS, v)],
            )?;
        }
        encode_values(
            &mut encoder,
            "seaweedfs_csi_dirty_waits",
            "Writes that waited for room in the memory budget.",
            MetricType::Counter,
            [(NO_LABELS, b.waits.load(Ordering::Relaxed))],
        )?;
        encode_values(
            &mut encoder,
            "seaweedfs_csi_metadata_cache_evictions",
            "Times a session dropped cached listings to stay within the metadata budget.",
            MetricType::Counter,
            [(NO_LABELS, b.meta_evictions.load(Ordering::Relaxed))],
        )?;
        encode_values(
            &mut encoder,
            "seaweedfs_csi_inode_prunes",
            "Nodes sessions asked the kernel to forget to stay within the inode-table budget.",
            MetricType::Counter,
            [(NO_LABELS, b.nodes_pruned.load(Ordering::Relaxed))],
        )
    }
}

/// Readahead bytes in flight, given back when dropped.
#[derive(Debug)]
pub struct ReadaheadCharge {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Drop for ReadaheadCharge {
    fn drop(&mut self) {
        self.budget
            .readahead
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Bytes held against a [`MemoryBudget`], given back when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Charge {
    /// Now holds `bytes`.
    pub fn set(&mut self, bytes: u64) {
        if bytes > self.bytes {
            self.budget
                .dirty
                .fetch_add(bytes - self.bytes, Ordering::Relaxed);
        } else {
            self.budget.sub(self.bytes - bytes);
        }
        self.bytes = bytes;
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.sub(self.bytes);
    }
}

/// The budget a node gets when none is given: 3/4 of the container's cgroup memory limit
/// (the rest is the process's own overhead and the kernel's), or 1/4 of the machine's memory
/// without a limit. `None` when neither can be read.
pub fn default_total() -> Option<u64> {
    if let Some(limit) = cgroup_limit() {
        return Some(limit / 4 * 3);
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo_total(&meminfo).map(|t| t / 4)
}

/// The cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`) limit of this process.
fn cgroup_limit() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let file = if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else {
            continue;
        };
        if let Some(v) = std::fs::read_to_string(&file)
            .ok()
            .and_then(|s| parse_limit(&s))
        {
            return Some(v);
        }
    }
    None
}

/// A cgroup limit file's value; "max" or an absurd v1 "no limit" value is no limit.
fn parse_limit(s: &str) -> Option<u64> {
    let v: u64 = s.trim().parse().ok()?;
    (v < (1 << 60)).then_some(v)
}

fn parse_meminfo_total(s: &str) -> Option<u64> {
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_add_up_and_are_given_back() {
        let b = MemoryBudget::new(256 << 20);
        assert_eq!(b.dirty_limit(), 64 << 20);
        let mut c = b.charge();
        c.set(10);
        let mut d = b.charge();
        d.set(5);
        c.set(4);
        assert_eq!(b.dirty(), 9);
        drop(c);
        assert_eq!(b.dirty(), 5);
        drop(d);
        assert_eq!(b.dirty(), 0);
    }

    #[test]
    fn the_budget_is_shared_in_eighths_with_floors() {
        let b = MemoryBudget::new(1 << 30);
        assert_eq!(b.dirty_limit(), 256 << 20);
        assert_eq!(b.cache_limit(), 384 << 20);
        assert_eq!(b.readahead_limit(), 128 << 20);
        let small = MemoryBudget::new(64 << 20);
        assert_eq!(small.cache_limit(), MIN_CACHE_BYTES);
        assert_eq!(small.readahead_limit(), MIN_READAHEAD_BYTES);
        let none = MemoryBudget::new(u64::MAX);
        assert_eq!(none.cache_limit(), u64::MAX);
        assert!(none.try_readahead(u64::MAX / 2).is_some());
    }

    #[test]
    fn readahead_past_its_share_is_refused_until_given_back() {
        let b = MemoryBudget::new(128 << 20); // 16 MiB of readahead
        let first = b.try_readahead(10 << 20).unwrap();
        assert!(b.try_readahead(8 << 20).is_none());
        let second = b.try_readahead(6 << 20).unwrap();
        assert_eq!(b.readahead(), 16 << 20);
        drop(first);
        assert!(b.try_readahead(8 << 20).is_some());
        drop(second);
        assert_eq!(b.readahead(), 0);
    }

    #[test]
    fn a_small_budget_still_lets_one_writer_through() {
        assert_eq!(MemoryBudget::new(1 << 20).dirty_limit(), MIN_DIRTY_BYTES);
        assert_eq!(MemoryBudget::new(u64::MAX).dirty_limit(), u64::MAX);
    }

    #[test]
    fn limits_are_read_from_cgroup_and_meminfo_text() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("536870912\n"), Some(512 << 20));
        assert_eq!(
            parse_meminfo_total("MemTotal:       24596112 kB\nMemFree: 1 kB\n"),
            Some(24596112 * 1024)
        );
    }

    #[tokio::test]
    async fn a_waiting_writer_goes_on_once_room_is_freed() {
        let b = MemoryBudget::new(128 << 20);
        let mut c = b.charge();
        c.set(40 << 20);
        assert!(b.dirty_over());
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.wait_for_room().await })
        };
        // the waiter asks sessions to start uploading
        tokio::time::timeout(Duration::from_secs(2), b.pressed())
            .await
            .unwrap();
        assert!(!waiter.is_finished());
        c.set(1 << 20);
        tokio::time::timeout(Duration::from_secs(2), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(b.waits.load(Ordering::Relaxed), 1);
    }
}
