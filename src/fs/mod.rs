//! Filesystem logic over the SeaweedFS clients, free of FUSE types: node ids, handles,
//! namespace operations, the write and read paths, metadata coherence. The `fuse` module is a
//! thin adapter that maps kernel requests onto [`Fs`] and errors onto errnos.

pub mod acl;
pub mod attr;
#[cfg(test)]
mod budget_tests;
mod changes;
mod dirs;
mod entries;
mod events;
pub mod file;
mod handles;
pub mod inode;
#[cfg(test)]
mod integrity_tests;
pub mod journal;
pub mod meta;
mod namespace;
mod read;
mod resent;
mod setattr;
mod space;
pub mod verifier;
mod write;
mod xattr;

pub use attr::{Attr, IdMap, Kind};

/// Extended attribute of a volume's root directory holding its capacity in bytes (decimal),
/// written by the CSI controller at CreateVolume and ControllerExpandVolume. Not prefixed with
/// `xattr-`, so FUSE clients do not list it as a user xattr.
pub const CAPACITY_XATTR: &str = "seaweedfs-csi.capacity";

/// How many open states, each retired by its last close while we waited for it, a setattr or
/// xattr change follows to the next before it gives up with `EAGAIN`.
const CHANGE_ROUNDS: usize = 16;
/// Stripes of [`Fs`]'s entry locks (two paths sharing one only wait for each other).
const ENTRY_LOCK_STRIPES: usize = 256;
pub use dirs::{DirEntryOut, DirListing};
pub use setattr::SetAttr;
pub use space::StatFs;
pub use write::{WriteTarget, Written};

use crate::budget::MemoryBudget;
use crate::cache::ChunkCache;
use crate::config::MountOptions;
use crate::filer::{FilerApi, FilerError};
use crate::pb::filer as pb;
use crate::volume::{ChunkStore, VolumeError};
use file::OpenFile;
use inode::InodeTable;
use meta::MetaCache;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::Semaphore;

/// Errors of the filesystem layer: an errno plus context for the log.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{msg} (errno {errno})")]
pub struct FsError {
    pub errno: i32,
    pub msg: String,
}

impl FsError {
    pub fn new(errno: i32, msg: impl Into<String>) -> Self {
        FsError {
            errno,
            msg: msg.into(),
        }
    }
}

impl From<FilerError> for FsError {
    fn from(e: FilerError) -> Self {
        FsError {
            errno: e.errno(),
            msg: e.to_string(),
        }
    }
}

impl From<VolumeError> for FsError {
    fn from(e: VolumeError) -> Self {
        FsError {
            errno: e.errno(),
            msg: e.to_string(),
        }
    }
}

pub type Result<T, E = FsError> = std::result::Result<T, E>;

fn errno(e: i32, msg: impl Into<String>) -> FsError {
    FsError::new(e, msg)
}

/// Kernel cache invalidation, implemented by the FUSE adapter.
pub trait Notifier: Send + Sync {
    fn inval_entry(&self, parent: u64, name: &str);
    /// Attributes and cached pages.
    fn inval_inode(&self, ino: u64);
    /// Attributes only. Takes no lock in the kernel that a request waiting for us may
    /// hold (an entry's invalidation waits for the directory's lock, a page's for the page):
    /// a process killed while one is in flight still exits.
    fn inval_attr(&self, ino: u64);
    /// Asks the kernel to forget the nodes `inos` where nothing uses them (FUSE_NOTIFY_PRUNE):
    /// it drops their unused dentries, and each node whose inode goes with them comes back
    /// as a FORGET. Takes no directory lock. Returns how many of `inos` (a prefix) were
    /// asked for: fewer when the kernel (or this notifier) cannot, or failed part-way.
    fn prune(&self, _inos: &[u64]) -> usize {
        0
    }
    /// Whether [`Self::prune`] may be asked at all (not refused for good).
    fn can_prune(&self) -> bool {
        false
    }
}

/// The kernel notifier as the filesystem uses it: counts the calls in progress and passes
/// none on once stopped (see [`Fs::stop_notifying`]).
pub struct StoppableNotifier {
    inner: Arc<dyn Notifier>,
    stopped: AtomicBool,
    running: AtomicUsize,
}

impl StoppableNotifier {
    fn new(inner: Arc<dyn Notifier>) -> Self {
        StoppableNotifier {
            inner,
            stopped: Default::default(),
            running: Default::default(),
        }
    }

    /// Runs `f` unless stopped. Counted first, checked second: `stop` sets the flag first
    /// and then waits for the count, so a call either sees the flag or is waited for.
    /// `waits`: the kernel may hold the call until a request of ours is answered (an entry's
    /// invalidation waits for the directory lock a lookup holds, a page's for the page).
    fn pass(&self, waits: bool, f: impl FnOnce(&dyn Notifier)) {
        self.running.fetch_add(1, Ordering::SeqCst);
        if !self.stopped.load(Ordering::SeqCst) {
            let call = || f(self.inner.as_ref());
            // a runtime worker that may wait hands its tasks to another thread first, or a
            // runtime of one worker (a 1-CPU pod) would wait for itself
            let worker = waits
                && tokio::runtime::Handle::try_current().is_ok_and(|h| {
                    h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
                });
            if worker {
                tokio::task::block_in_place(call)
            } else {
                call()
            }
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
    }

    pub fn inval_entry(&self, parent: u64, name: &str) {
        self.pass(true, |n| n.inval_entry(parent, name));
    }

    pub fn inval_inode(&self, ino: u64) {
        self.pass(true, |n| n.inval_inode(ino));
    }

    pub fn inval_attr(&self, ino: u64) {
        self.pass(false, |n| n.inval_attr(ino));
    }

    pub fn prune(&self, inos: &[u64]) -> usize {
        let mut done = 0;
        self.pass(true, |n| done = n.prune(inos));
        done
    }

    pub fn can_prune(&self) -> bool {
        self.inner.can_prune()
    }

    async fn stop(&self, limit: Duration) -> bool {
        self.stopped.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + limit;
        while self.running.load(Ordering::SeqCst) > 0 {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }
}

/// Settings of one filesystem instance (derived from [`MountOptions`]).
#[derive(Debug, Clone)]
pub struct FsConfig {
    pub root: String,
    pub chunk_size: usize,
    pub max_dirty_slots: usize,
    /// Data chunks per manifest chunk (see [`crate::chunks::MANIFEST_BATCH`]).
    pub manifest_batch: usize,
    pub collection: String,
    pub replication: String,
    pub disk_type: String,
    pub ttl_sec: i32,
    pub data_center: String,
    pub meta_ttl: Duration,
    pub read_only: bool,
    pub umask: u32,
    pub ids: IdMap,
    pub quota_bytes: u64,
    /// See [`MountOptions::quota_from_filer`].
    pub quota_from_filer: bool,
    /// The root entry's xattr where NodeExpandVolume records this volume's capacity
    /// (`CAPACITY_XATTR.<volume id>`); None: the shared one.
    pub capacity_key: Option<String>,
    pub concurrent_writers: usize,
    pub concurrent_readers: usize,
    /// Chunks prefetched ahead of a sequential reader.
    pub readahead_chunks: usize,
    /// Directories with more entries than this are not cached.
    pub max_cached_dir_entries: usize,
    pub cipher: bool,
    /// How long an upload (and a commit) keeps retrying while volume servers or the filer
    /// are unreachable before fsync/close report EIO. The bytes stay buffered either way
    /// and the next fsync tries again.
    pub upload_retry: Duration,
    /// An absent `security.selinux` label answers EOPNOTSUPP instead of ENODATA. Set when
    /// the node runs without SELinux: nothing on it can use a label, and tools that ask for
    /// one (`ls -l`, anything on libselinux with coreutils' per-device cache) then stop
    /// asking for the rest of the listing instead of paying one round trip per file. With
    /// SELinux enabled the kernel answers that name itself (genfs labelling) or needs
    /// ENODATA (xattr labelling), so it stays off. Labels that are set are stored and
    /// returned either way.
    pub selinux_label_unsupported: bool,
    /// The node's memory budget, shared by every session (dirty write data is charged to it).
    pub budget: Arc<MemoryBudget>,
    /// Whether the filer checks a commit's chunk list condition, as its version says.
    pub chunk_condition: ChunkCondition,
}

/// Whether the filer checks `IF_CHUNKS_EQUAL` (SeaweedFS 4.41+), the condition that keeps a
/// commit from deleting another node's new chunks (see `Fs::rebase`). SeaweedFS 4.29-4.40
/// fail a clause they do not know, so every commit carrying it would be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChunkCondition {
    /// 4.41 or later: every plain file's commit carries it, and a refusal is always a
    /// change on the filer (a move away and back counts too): never taken for ignorance.
    Checked,
    /// Before 4.41: commits carry `IF_EXISTS` alone, and the last writer wins.
    Unknown,
    /// The filer did not say its version: carried, and given up for the session if the
    /// filer refuses it twice in one commit while its entry still lists those chunks.
    #[default]
    Untold,
}

impl ChunkCondition {
    /// From `GetFilerConfiguration`'s version numbers (0.0 from a filer that does not send
    /// them).
    pub fn of_version(major: i32, minor: i32) -> Self {
        match (major, minor) {
            (0, 0) => ChunkCondition::Untold,
            v if v >= (4, 41) => ChunkCondition::Checked,
            _ => ChunkCondition::Unknown,
        }
    }
}

/// SELinux is enabled when its filesystem is mounted (what libselinux checks).
pub fn selinux_enabled() -> bool {
    std::path::Path::new("/sys/fs/selinux/enforce").exists()
}

impl FsConfig {
    pub fn from_mount_options(o: &MountOptions) -> Self {
        let root = normalize_root(&o.filer_path);
        FsConfig {
            root,
            chunk_size: (o.chunk_size_limit_mb.max(1) as usize) << 20,
            max_dirty_slots: 4,
            manifest_batch: o.manifest_batch.max(1),
            collection: o.collection.clone(),
            replication: o.replication.clone(),
            disk_type: o.disk_type.clone(),
            ttl_sec: o.ttl_sec,
            data_center: o.data_center.clone(),
            meta_ttl: Duration::from_secs(o.cache_meta_ttl_sec.max(1)),
            read_only: o.read_only,
            umask: o.umask,
            ids: IdMap {
                uids: o.uid_map.clone(),
                gids: o.gid_map.clone(),
            },
            quota_bytes: o.quota_bytes,
            quota_from_filer: o.quota_from_filer,
            capacity_key: (!o.volume_id.is_empty())
                .then(|| format!("{CAPACITY_XATTR}.{}", o.volume_id)),
            concurrent_writers: o.concurrent_writers.max(1),
            concurrent_readers: o.concurrent_readers.max(1),
            readahead_chunks: (o.concurrent_readers / 4).clamp(1, 8),
            max_cached_dir_entries: 100_000,
            cipher: false,
            upload_retry: Duration::from_secs(60),
            selinux_label_unsupported: !selinux_enabled(),
            budget: MemoryBudget::global().clone(),
            chunk_condition: ChunkCondition::default(),
        }
    }
}

pub fn normalize_root(p: &str) -> String {
    let t = p.trim_end_matches('/');
    if t.is_empty() {
        "/".to_string()
    } else if t.starts_with('/') {
        t.to_string()
    } else {
        format!("/{t}")
    }
}

/// An open file handle (one per kernel open).
pub struct Handle {
    pub ino: u64,
    pub file: Arc<OpenFile>,
    pub writable: bool,
    /// Sequential-read detector: end of the previous read and a streak counter.
    pub seq: Mutex<(u64, u32)>,
}

struct OpenEntry {
    file: Arc<OpenFile>,
    handles: usize,
}

/// Counters exported as metrics.
#[derive(Default)]
pub struct FsStats {
    pub filer_calls: AtomicU64,
    pub uploads: AtomicU64,
    pub upload_bytes: AtomicU64,
    pub upload_errors: AtomicU64,
    /// Commits rebased onto another client's change of the file ([`Fs::rebase`]).
    pub rebases: AtomicU64,
}

pub struct Fs {
    pub cfg: FsConfig,
    pub filer: Arc<dyn FilerApi>,
    pub store: Arc<dyn ChunkStore>,
    pub cache: ChunkCache,
    pub inodes: InodeTable,
    pub meta: MetaCache,
    files: Mutex<HashMap<u64, OpenEntry>>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    dir_handles: Mutex<HashMap<u64, Arc<DirListing>>>,
    /// Bumped whenever an event takes a name away (delete, rename, doubt): a listing taken
    /// before may hand the kernel names that are gone (see [`Fs::gone_since`]).
    names_gone: AtomicU64,
    next_fh: AtomicU64,
    /// When this filesystem was built (ns since the epoch), before its first lookup: the
    /// metadata subscription starts here.
    pub created_ns: i64,
    upload_sem: Arc<Semaphore>,
    prefetch_sem: Arc<Semaphore>,
    /// The volume was unmounted or handed over: background re-reads end.
    closed: AtomicBool,
    /// Filer lookups of open files re-read after events, at once (a resync asks for all).
    rereads: Semaphore,
    dir_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The filer does not know the chunk list condition (its version, or it failed one that
    /// held, see [`ChunkCondition`]): commits send none.
    no_chunk_condition: AtomicBool,
    /// Serialize this node's read-modify-write cycles of one filer entry (see
    /// [`Fs::update_fresh`]); striped by path, so memory stays fixed.
    entry_locks: Box<[tokio::sync::Mutex<()>]>,
    /// Pending parent-directory time updates (written back in the background).
    dir_times: Mutex<HashMap<String, SystemTime>>,
    /// Bumped per inode when another client changes its content (kernel page-cache validity).
    content_gen: Mutex<HashMap<u64, u64>>,
    opened_gen: Mutex<HashMap<u64, u64>>,
    statfs_cache: Mutex<Option<(Instant, StatFs)>>,
    /// Bytes used in the quota'd volume, as last measured.
    used_bytes: AtomicU64,
    quota: AtomicU64,
    notifier: parking_lot::RwLock<Option<Arc<StoppableNotifier>>>,
    /// Nodes of the inode table last counted into the budget (see [`Fs::prune_nodes`]).
    nodes_reported: AtomicU64,
    pruning: Mutex<entries::Pruning>,
    /// The session's nodes left the node-wide count (see [`Fs::leave_budget`]).
    left_budget: Mutex<bool>,
    /// The largest capacity NodeExpandVolume recorded through this session (see
    /// [`Fs::refresh_capacity`]).
    expanded: AtomicU64,
    /// Rewrites of an overwritten capacity record in a row, and when the next may be made.
    rerecords: Mutex<entries::Rerecords>,
    /// The largest of this volume's own capacity records taken (see
    /// [`Fs::take_capacity`]); the quota is computed and set under it.
    capacity_floor: Mutex<u64>,
    /// Deletes of orphaned chunks in flight (an unmount or a handover waits for them).
    deletes: Arc<write::BackgroundDeletes>,
    healthy: AtomicBool,
    /// The kernel caches and enforces POSIX ACLs (FUSE_POSIX_ACL was negotiated): keep modes
    /// in sync with access ACLs and apply default-ACL inheritance.
    posix_acl: AtomicBool,
    pub stats: FsStats,
    root_attr: Mutex<Attr>,
    /// Which handles lost data in a crash of a previous process.
    pub verifier: verifier::Verifier,
    /// Paths this node changed on the filer lately, and when. Another client's event about
    /// one of them may predate our change (the filer does not send us our own events).
    local_changes: Mutex<HashMap<String, Instant>>,
    /// When names last changed, here or in an event (see [`changes`]).
    name_changes: Arc<changes::NameChanges>,
}

impl Fs {
    pub fn new(
        cfg: FsConfig,
        filer: Arc<dyn FilerApi>,
        store: Arc<dyn ChunkStore>,
        cache: ChunkCache,
    ) -> Arc<Self> {
        let now = SystemTime::now();
        let no_chunk_condition = cfg.chunk_condition == ChunkCondition::Unknown;
        let root_attr = Attr {
            ino: inode::ROOT_INO,
            size: 4096,
            kind: Kind::Dir,
            perm: (0o777 & !cfg.umask) as u16,
            nlink: 2,
            uid: 0,
            gid: 0,
            rdev: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
        };
        let start_fh = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Arc::new(Fs {
            inodes: InodeTable::new(&cfg.root),
            meta: MetaCache::with_budget(cfg.meta_ttl, cfg.budget.clone())
                .with_max_entries(cfg.max_cached_dir_entries),
            upload_sem: Arc::new(Semaphore::new(cfg.concurrent_writers)),
            prefetch_sem: Arc::new(Semaphore::new(cfg.concurrent_readers)),
            closed: AtomicBool::new(false),
            rereads: Semaphore::new(4),
            quota: AtomicU64::new(cfg.quota_bytes),
            cfg,
            filer,
            store,
            cache,
            files: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            dir_handles: Mutex::new(HashMap::new()),
            names_gone: AtomicU64::new(0),
            next_fh: AtomicU64::new(start_fh),
            created_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as i64)
                .unwrap_or(0),
            dir_locks: Mutex::new(HashMap::new()),
            no_chunk_condition: AtomicBool::new(no_chunk_condition),
            entry_locks: (0..ENTRY_LOCK_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
            dir_times: Mutex::new(HashMap::new()),
            content_gen: Mutex::new(HashMap::new()),
            opened_gen: Mutex::new(HashMap::new()),
            statfs_cache: Mutex::new(None),
            used_bytes: AtomicU64::new(0),
            notifier: parking_lot::RwLock::new(None),
            nodes_reported: AtomicU64::new(0),
            pruning: Mutex::new(Default::default()),
            left_budget: Mutex::new(false),
            expanded: AtomicU64::new(0),
            rerecords: Mutex::new(Default::default()),
            capacity_floor: Mutex::new(0),
            deletes: Default::default(),
            healthy: AtomicBool::new(true),
            posix_acl: AtomicBool::new(false),
            stats: FsStats::default(),
            root_attr: Mutex::new(root_attr),
            local_changes: Mutex::new(HashMap::new()),
            name_changes: Default::default(),
            verifier: verifier::Verifier::new(start_fh),
        })
    }

    pub fn set_notifier(&self, n: Arc<dyn Notifier>) {
        *self.notifier.write() = Some(Arc::new(StoppableNotifier::new(n)));
    }

    /// The kernel notifier, if any. Its lock is released before the call returns: a guard
    /// held across an invalidation (a temporary in an `if let`) would keep `drop_notifier`
    /// waiting for as long as the kernel holds that invalidation.
    pub(crate) fn notifier(&self) -> Option<Arc<StoppableNotifier>> {
        self.notifier.read().clone()
    }

    /// Stops kernel invalidations and lets go of the notifier (once calls in progress end).
    pub fn drop_notifier(&self) {
        if let Some(n) = self.notifier.write().take() {
            n.stopped.store(true, Ordering::SeqCst);
        }
    }

    /// The volume is being unmounted or handed over: background work of its own (re-reads
    /// of open files after events) ends.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Stops kernel invalidations and waits (up to `limit`) for those in progress; false if
    /// some were still running at the limit. Called before a hand-over closes the request
    /// gate: an invalidation waits in the kernel for directory locks that requests left
    /// unanswered may hold, and would keep this process from exiting (and the next one from
    /// taking the session over).
    pub async fn stop_notifying(&self, limit: Duration) -> bool {
        let n = self.notifier();
        match n {
            Some(n) => n.stop(limit).await,
            None => true,
        }
    }
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set_healthy(&self, v: bool) {
        self.healthy.store(v, std::sync::atomic::Ordering::Relaxed)
    }

    /// Set from the FUSE INIT negotiation (fresh mount or adoption).
    pub fn set_posix_acl(&self, on: bool) {
        self.posix_acl
            .store(on, std::sync::atomic::Ordering::Relaxed)
    }

    pub fn posix_acl(&self) -> bool {
        self.posix_acl.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set_quota(&self, bytes: u64) {
        self.quota
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
        *self.statfs_cache.lock() = None;
    }

    pub fn quota(&self) -> u64 {
        self.quota.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Chunk uploads running now (the upload queue's depth).
    pub fn uploads_in_flight(&self) -> u64 {
        (self.cfg.concurrent_writers - self.upload_sem.available_permits()) as u64
    }

    /// Number of open file handles (for handover and stats).
    pub fn open_handles(&self) -> usize {
        self.handles.lock().len()
    }

    pub(crate) fn upload_options(&self, path: &str) -> crate::volume::UploadOptions {
        crate::volume::UploadOptions {
            collection: self.cfg.collection.clone(),
            replication: self.cfg.replication.clone(),
            ttl_sec: self.cfg.ttl_sec,
            disk_type: self.cfg.disk_type.clone(),
            data_center: self.cfg.data_center.clone(),
            path: path.to_string(),
            cipher: self.cfg.cipher,
            may_wait: None,
            md5: None,
            syncs: false,
        }
    }
}

pub(crate) fn now_parts() -> (i64, i32) {
    attr::split_ts(SystemTime::now())
}

/// Makes a name safe for the filer (UTF-8 only, as `weed mount` does).
pub fn sanitize_name(name: &std::ffi::OsStr) -> Result<String> {
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(name);
    if bytes.len() > 255 {
        return Err(errno(libc::ENAMETOOLONG, "name longer than 255 bytes"));
    }
    Ok(String::from_utf8_lossy(bytes).replace('\u{FFFD}', "_"))
}

impl Drop for Fs {
    fn drop(&mut self) {
        self.leave_budget();
    }
}

pub(crate) fn entry_with_name(e: &pb::Entry, name: &str) -> pb::Entry {
    let mut e = e.clone();
    e.name = name.to_string();
    e
}

#[cfg(test)]
pub(super) mod notifier_tests {
    use super::*;

    /// Records calls; the first one blocks until released (a kernel waiting for a lock).
    pub(in crate::fs) struct Blocking {
        pub(in crate::fs) calls: Mutex<Vec<String>>,
        release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl Blocking {
        /// The notifier and what releases its first call.
        pub(in crate::fs) fn new() -> (Arc<Self>, std::sync::mpsc::Sender<()>) {
            let (tx, rx) = std::sync::mpsc::channel();
            let b = Blocking {
                calls: Mutex::new(Vec::new()),
                release: std::sync::Mutex::new(rx),
            };
            (Arc::new(b), tx)
        }

        /// Waits (up to 5 s) until a call has come.
        pub(in crate::fs) fn wait_for_a_call(&self) -> bool {
            let until = std::time::Instant::now() + Duration::from_secs(5);
            while self.calls.lock().is_empty() {
                if std::time::Instant::now() > until {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            true
        }
    }

    impl Notifier for Blocking {
        fn inval_entry(&self, _parent: u64, name: &str) {
            let first = {
                let mut c = self.calls.lock();
                c.push(name.to_string());
                c.len() == 1
            };
            if first {
                let _ = self.release.lock().unwrap().recv();
            }
        }
        fn inval_inode(&self, ino: u64) {
            self.calls.lock().push(format!("inode {ino}"));
        }
        fn inval_attr(&self, ino: u64) {
            self.calls.lock().push(format!("attr {ino}"));
        }
    }

    /// Waits in `inval_entry` for a task of the runtime, as the kernel waits for a lookup
    /// whose answer a runtime task sends.
    struct WaitsForTask {
        rt: tokio::runtime::Handle,
    }

    impl Notifier for WaitsForTask {
        fn inval_entry(&self, _parent: u64, name: &str) {
            let (tx, rx) = std::sync::mpsc::channel();
            self.rt.spawn(async move {
                let _ = tx.send(());
            });
            if rx.recv_timeout(Duration::from_secs(5)).is_err() {
                panic!("{name}: the task the kernel waits for never ran");
            }
        }
        fn inval_inode(&self, _ino: u64) {}
        fn inval_attr(&self, _ino: u64) {}
    }

    #[test]
    fn an_invalidation_waiting_for_a_task_does_not_stall_a_one_worker_runtime() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let n = Arc::new(StoppableNotifier::new(Arc::new(WaitsForTask {
            rt: rt.handle().clone(),
        })));
        // from a task on the only worker, as the events task calls it
        let done =
            rt.block_on(async move { tokio::spawn(async move { n.inval_entry(1, "a") }).await });
        assert!(done.is_ok(), "the invalidation stalled the runtime");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stopping_waits_for_running_invalidations_and_passes_no_more() {
        let (inner, tx) = Blocking::new();
        let n = Arc::new(StoppableNotifier::new(inner.clone()));
        let busy = n.clone();
        let blocked = std::thread::spawn(move || busy.inval_entry(1, "a"));
        assert!(inner.wait_for_a_call());
        // one call is in the kernel: stopping waits for it
        assert!(!n.stop(Duration::from_millis(100)).await);
        n.inval_entry(1, "b");
        n.inval_inode(7);
        tx.send(()).unwrap();
        blocked.join().unwrap();
        assert!(n.stop(Duration::from_secs(5)).await);
        assert_eq!(*inner.calls.lock(), vec!["a".to_string()]);
    }
}
