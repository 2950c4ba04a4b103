//! Entries behind [`Fs`]'s nodes: paths, entries from the metadata cache or the filer and
//! their attributes (lookup, getattr), the root, and the entry writes the operations share.

use super::attr::{entry_attr, entry_inode, file_id, to_go_mode, Attr, Kind};
use super::events::Identity;
use super::file::OpenFile;
use super::inode::{join, split, FileId, ROOT_INO};
use super::meta::Cached;
use super::{errno, now_parts, Fs, Result};
use crate::filer::FilerError;
use crate::pb::filer as pb;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// After a prune the kernel or keeper refused, no candidates are looked for until then.
const PRUNE_PAUSE: Duration = Duration::from_secs(60);
/// Nodes asked for in one round at most (the ids asked are kept until the next).
const PRUNE_ROUND_MAX: usize = 65_536;

/// What [`Fs::prune_nodes`] remembers between rounds.
#[derive(Default)]
pub(super) struct Pruning {
    /// The nodes asked for last round.
    asked: std::collections::HashSet<u64>,
    paused_until: Option<Instant>,
}

/// Updates of the root entry NodeExpandVolume tries before it gives up (each found its
/// record overwritten by another writer of the entry).
const CAPACITY_ROUNDS: usize = 5;
/// The pause after the first rewrite of an overwritten capacity record; it doubles with
/// each further one in a row, up to [`RERECORD_PAUSE_MAX`].
const RERECORD_PAUSE: Duration = Duration::from_secs(5);
const RERECORD_PAUSE_MAX: Duration = Duration::from_secs(600);

/// Rewrites of an overwritten capacity record (see [`Fs::refresh_capacity`]): the count
/// starts again only after a quiet spell of twice the longest pause, so a writer that
/// overwrites it now and then cannot keep the pause short.
#[derive(Debug, Default)]
pub(super) struct Rerecords {
    made: u32,
    last: Option<Instant>,
}

impl Rerecords {
    /// Whether a rewrite may begin at `now`; if so, it is counted (before it runs: one cut
    /// short by the caller's timeout counts too).
    fn begin(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last {
            let since = now.saturating_duration_since(last);
            if since > 2 * RERECORD_PAUSE_MAX {
                self.made = 0;
            }
            if since < rerecord_pause(self.made) {
                return false;
            }
        }
        self.made = self.made.saturating_add(1);
        self.last = Some(now);
        true
    }
}

/// The pause after `made` rewrites in a row.
fn rerecord_pause(made: u32) -> Duration {
    if made == 0 {
        return Duration::ZERO;
    }
    RERECORD_PAUSE
        .saturating_mul(1 << (made - 1).min(7))
        .min(RERECORD_PAUSE_MAX)
}

impl Fs {
    pub fn path_of(&self, ino: u64) -> Result<String> {
        self.inodes
            .path(ino)
            .ok_or_else(|| errno(libc::ESTALE, format!("unknown inode {ino}")))
    }

    pub(super) fn check_writable(&self) -> Result<()> {
        if self.cfg.read_only {
            Err(errno(libc::EROFS, "read-only mount"))
        } else {
            Ok(())
        }
    }

    /// The lock of `dir/name`'s read-modify-write cycles. Never held across another
    /// entry's lock (two paths may share a stripe).
    pub(super) fn entry_lock(&self, dir: &str, name: &str) -> &tokio::sync::Mutex<()> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (dir, name).hash(&mut h);
        &self.entry_locks[h.finish() as usize % self.entry_locks.len()]
    }

    fn dir_lock(&self, dir: &str) -> DirLock<'_> {
        let lock = self
            .dir_locks
            .lock()
            .entry(dir.to_string())
            .or_default()
            .clone();
        DirLock {
            map: &self.dir_locks,
            dir: dir.to_string(),
            lock: Some(lock),
        }
    }

    /// Drops expired listings, and the page-cache generations of inodes the kernel does not
    /// hold (events bump them for files nobody here looked up; FORGET never comes for
    /// those). Dropping one only makes the next open start without the kernel's pages.
    pub fn sweep_caches(&self) {
        self.meta.sweep();
        for map in [&self.content_gen, &self.opened_gen] {
            // no lock held while the inode table is asked
            let keys: Vec<u64> = map.lock().keys().copied().collect();
            let unknown: Vec<u64> = keys
                .into_iter()
                .filter(|&ino| ino != ROOT_INO && self.inodes.path(ino).is_none())
                .collect();
            if !unknown.is_empty() {
                let mut m = map.lock();
                for ino in unknown {
                    m.remove(&ino);
                }
            }
        }
    }

    /// Keeps the inode tables of every session within their part of the memory budget
    /// ([`MemoryBudget::inode_limit`]). A node lives until the kernel's FORGET, and the
    /// kernel keeps every name a walk looked up until its own memory runs short, so past the
    /// limit this session asks the kernel to forget nodes (see [`super::Notifier::prune`]:
    /// only what nothing uses goes; open files, working directories and mount points stay,
    /// and a name dropped is looked up again when next used): its share of the excess, and
    /// an eighth of the limit more so that it is not asked again at once. Called every
    /// second; blocking (it writes to the FUSE device). Returns the nodes asked for.
    ///
    /// [`MemoryBudget::inode_limit`]: crate::budget::MemoryBudget::inode_limit
    pub fn prune_nodes(&self) -> usize {
        use crate::budget::NODE_BYTES;
        let now = self.inodes.len() as u64;
        {
            let left = self.left_budget.lock();
            if *left {
                return 0;
            }
            let before = self.nodes_reported.swap(now, Ordering::Relaxed);
            self.cfg.budget.nodes_changed(before, now);
        }
        let limit = self.cfg.budget.inode_limit() / NODE_BYTES;
        let total = self.cfg.budget.nodes();
        if total <= limit || now <= 1 {
            return 0;
        }
        let excess = total - (limit - limit / 8);
        let share = (u128::from(excess) * u128::from(now) / u128::from(total)) as usize;
        let Some(nt) = self.notifier() else {
            return 0;
        };
        if !nt.can_prune() {
            return 0;
        }
        let share = share.min(PRUNE_ROUND_MAX);
        let mut pruning = self.pruning.lock();
        if pruning.paused_until.is_some_and(|t| Instant::now() < t) {
            return 0;
        }
        // Not the files open here, nor the nodes asked for last time: still in the table,
        // they are in use (an O_PATH fd, a watch, a mount on a file), and asking for the same
        // ones every second would never reach the others.
        // (copied: the open files are not held up by the scan)
        let open: std::collections::HashSet<u64> = self.files.lock().keys().copied().collect();
        let asked = &pruning.asked;
        let inos = self
            .inodes
            .prune_candidates(share, |ino| open.contains(&ino) || asked.contains(&ino));
        if inos.is_empty() {
            pruning.asked.clear();
            return 0;
        }
        let sent = nt.prune(&inos).min(inos.len());
        if sent < inos.len() {
            // refused (an older kernel or keeper) or no keeper connection now: the scan is
            // not repeated every second
            pruning.paused_until = Some(Instant::now() + PRUNE_PAUSE);
        }
        if sent == 0 {
            return 0;
        }
        pruning.asked = inos[..sent].iter().copied().collect();
        self.cfg
            .budget
            .nodes_pruned
            .fetch_add(sent as u64, Ordering::Relaxed);
        tracing::debug!(root = %self.cfg.root, nodes = now, asked = sent, "asked the kernel to forget nodes");
        sent
    }

    /// This session's nodes leave the node-wide count (its session ends; idempotent).
    pub fn leave_budget(&self) {
        // under the lock: a round already started (its blocking task outlives the session's
        // tasks) cannot count the nodes in again after this
        let mut left = self.left_budget.lock();
        *left = true;
        let n = self.nodes_reported.swap(0, Ordering::Relaxed);
        self.cfg.budget.nodes_changed(n, 0);
    }

    /// Lists `dir` into the metadata cache (coalesced per directory).
    pub(super) async fn load_dir(&self, dir: &str) -> Result<bool> {
        let lock = self.dir_lock(dir);
        let _g = lock.mutex().lock().await;
        if self.meta.is_cached(dir) {
            return Ok(true);
        }
        if self.meta.is_too_large(dir) {
            return Ok(false);
        }
        let gen = self.meta.generation(dir);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        // one past the limit tells a directory too large to cache without reading it all
        let max = self.cfg.max_cached_dir_entries;
        let entries = self.filer.list_upto(dir, max.saturating_add(1)).await?;
        if entries.len() > max {
            // every lookup in it would list it all again
            self.meta.mark_too_large(dir);
            return Ok(false);
        }
        let pinned = self.pending_in_dir(dir, None);
        Ok(self.meta.install(dir, entries, gen, &pinned))
    }

    /// Files created here in `dir` (only `name`, if given) whose creation is still deferred
    /// (not yet on the filer).
    pub(super) fn pending_in_dir(&self, dir: &str, name: Option<&str>) -> Vec<Arc<pb::Entry>> {
        let files = self.files.lock();
        files
            .values()
            .filter_map(|o| {
                let s = o.file.state.lock();
                (s.pending_create
                    && !s.unlinked
                    && s.dir == dir
                    && name.is_none_or(|n| n == s.entry.name))
                .then(|| Arc::new(s.entry.clone()))
            })
            .collect()
    }

    /// `dir` listed from the filer, with the files created here that it does not have yet.
    pub(super) async fn list_uncached(&self, dir: &str) -> Result<Vec<Arc<pb::Entry>>> {
        // taken first: a file whose commit lands during the listing is in one or the other
        let pending = self.pending_in_dir(dir, None);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let mut l: Vec<Arc<pb::Entry>> = self
            .filer
            .list_all(dir)
            .await?
            .into_iter()
            .map(Arc::new)
            .collect();
        if !pending.is_empty() {
            let names: std::collections::HashSet<&str> =
                l.iter().map(|e| e.name.as_str()).collect();
            let missing: Vec<_> = pending
                .into_iter()
                .filter(|p| !names.contains(p.name.as_str()))
                .collect();
            l.extend(missing);
            l.sort_by(|a, b| a.name.cmp(&b.name));
        }
        Ok(l)
    }

    /// The entry `name` in `dir`, from the metadata cache or the filer.
    pub async fn entry_at(&self, dir: &str, name: &str) -> Result<Arc<pb::Entry>> {
        for attempt in 0..2 {
            match self.meta.lookup(dir, name) {
                // hard links share attributes kept by the filer: always ask it
                Cached::Found(e) if e.hard_link_id.is_empty() => return Ok(e),
                Cached::Found(_) => break,
                Cached::Absent => return Err(errno(libc::ENOENT, format!("{dir}/{name}"))),
                Cached::Unknown if attempt == 0 => match self.load_dir(dir).await {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::debug!(dir, error = %e, "listing failed; falling back to lookup");
                        break;
                    }
                },
                Cached::Unknown => break,
            }
        }
        // an uncached (or too large) directory: a file created here may not be on the filer yet
        if let Some(e) = self.pending_in_dir(dir, Some(name)).pop() {
            return Ok(e);
        }
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        match self.filer.lookup_entry(dir, name).await {
            Ok(e) => {
                self.meta.note_link(&e);
                Ok(Arc::new(e))
            }
            Err(FilerError::NotFound(_)) => Err(errno(libc::ENOENT, format!("{dir}/{name}"))),
            Err(e) => Err(e.into()),
        }
    }

    pub(super) fn open_file(&self, ino: u64) -> Option<Arc<OpenFile>> {
        self.files.lock().get(&ino).map(|o| o.file.clone())
    }

    /// Attributes of an entry, with live size/times of an open file layered on top.
    pub(super) fn attr_of(&self, ino: u64, path: &str, e: &pb::Entry) -> Attr {
        if let Some(of) = self.open_file(ino) {
            return self.open_file_attr(ino, &of);
        }
        let mut a = entry_attr(ino, e, &self.cfg.ids);
        if a.kind == Kind::Dir {
            a.nlink = self.dir_nlink(path);
            if let Some(t) = self.dir_times.lock().get(path) {
                a.mtime = a.mtime.max(*t);
                a.ctime = a.ctime.max(*t);
            }
        }
        a
    }

    pub(super) fn open_file_attr(&self, ino: u64, of: &OpenFile) -> Attr {
        let s = of.state.lock();
        let mut a = entry_attr(ino, &s.entry, &self.cfg.ids);
        a.size = s.size;
        if s.unlinked {
            // only open handles keep it alive (fstat after unlink shows 0 links)
            a.nlink = 0;
        }
        a
    }

    /// 2 + subdirectories when the listing is known; 1 ("unknown", as btrfs and others
    /// report, which makes `find` skip its leaf optimisation) otherwise.
    fn dir_nlink(&self, path: &str) -> u32 {
        self.meta
            .subdirs(path)
            .map(|n| 2u32.saturating_add(n as u32))
            .unwrap_or(1)
    }

    pub(super) fn root_attr(&self) -> Attr {
        let mut a = self.root_attr.lock().clone();
        a.nlink = self.dir_nlink(&self.cfg.root);
        if let Some(t) = self.dir_times.lock().get(&self.cfg.root) {
            a.mtime = a.mtime.max(*t);
            a.ctime = a.ctime.max(*t);
        }
        a
    }

    /// Loads the root directory's attributes, creating the remote directory if missing.
    pub async fn init_root(&self) -> Result<()> {
        if self.cfg.root == "/" {
            return Ok(());
        }
        let (dir, name) = split(&self.cfg.root);
        let e = match self.filer.lookup_entry(&dir, &name).await {
            Ok(e) => e,
            Err(FilerError::NotFound(_)) => {
                if self.cfg.read_only {
                    return Err(errno(
                        libc::ENOENT,
                        format!("{} does not exist on the filer", self.cfg.root),
                    ));
                }
                let e = self.new_entry(&name, Kind::Dir, 0o777 & !self.cfg.umask, 0, 0, "", 0);
                let req = pb::CreateEntryRequest {
                    directory: dir.clone(),
                    entry: Some(e.clone()),
                    o_excl: true,
                    ..Default::default()
                };
                match self.filer.create_entry(req).await {
                    Ok(_) | Err(FilerError::AlreadyExists(_)) => {}
                    Err(e) => return Err(e.into()),
                }
                self.filer.lookup_entry(&dir, &name).await?
            }
            Err(e) => return Err(e.into()),
        };
        if !e.is_directory {
            return Err(errno(
                libc::ENOTDIR,
                format!("{} is not a directory", self.cfg.root),
            ));
        }
        let mut a = entry_attr(ROOT_INO, &e, &self.cfg.ids);
        a.ino = ROOT_INO;
        // As `weed mount` does, the root shows 0777 &^ umask whatever mode the directory has
        // on the filer: one made by another client without a mode (the filer HTTP API's
        // `POST /dir/` stores 0660) would otherwise be unsearchable for every non-root pod.
        // A chmod through the mount still reaches the filer and shows until the next stage.
        a.perm = (0o777 & !self.cfg.umask) as u16;
        *self.root_attr.lock() = a;
        self.take_capacity(&e);
        Ok(())
    }

    /// Applies the capacity recorded on the root entry (see [`Self::capacity_on`]) as the
    /// quota, when this volume takes its quota from the filer. No readable record keeps the
    /// current quota (volume context, NodeExpandVolume).
    ///
    /// The volume's own record (NodeExpandVolume's) only grows: an expansion kubelet was
    /// told of is never taken back. So once one was taken, a smaller one (or none) found
    /// later is another writer's stale copy of the entry, and the quota stays at least
    /// there; the controller's record may be lowered (a failed expansion given up). Computed
    /// and set under one lock, so a re-read racing an expansion here cannot undo it.
    fn take_capacity(&self, root: &pb::Entry) {
        if !self.cfg.quota_from_filer {
            return;
        }
        let Some(mut bytes) = self.capacity_on(root) else {
            return;
        };
        let mut floor = self.capacity_floor.lock();
        if bytes == 0 {
            // no quota, by hand: what was recorded before no longer counts
            *floor = 0;
        } else {
            // (with no key of its own, the shared record is no floor: the controller may
            // lower it)
            let own = match self.cfg.capacity_key {
                Some(_) => self.own_capacity(root),
                None => 0,
            };
            *floor = (*floor).max(own);
            bytes = bytes.max(*floor);
        }
        if bytes != self.quota() {
            tracing::info!(root = %self.cfg.root, from = self.quota(), to = bytes, "quota changed on the filer");
            self.set_quota(bytes);
        }
    }

    /// The volume's own capacity record on the root entry (NodeExpandVolume's; the shared
    /// one when the volume has no key of its own), 0 when there is none.
    fn own_capacity(&self, root: &pb::Entry) -> u64 {
        recorded_capacity(root, self.own_capacity_key()).map_or(0, |v| v.max(0) as u64)
    }

    /// The key of the volume's own capacity record (see [`Self::own_capacity`]).
    fn own_capacity_key(&self) -> &str {
        self.cfg
            .capacity_key
            .as_deref()
            .unwrap_or(super::CAPACITY_XATTR)
    }

    /// The capacity the root entry's records give this volume: the controller's
    /// ([`super::CAPACITY_XATTR`], CreateVolume and ControllerExpandVolume) and this volume's
    /// own (NodeExpandVolume's, named after the volume: static PVs may share a directory).
    /// The larger wins; a record of 1 byte or less means no quota (0), as in the volume
    /// context. None: no readable record.
    fn capacity_on(&self, root: &pb::Entry) -> Option<u64> {
        let keys = std::iter::once(super::CAPACITY_XATTR).chain(self.cfg.capacity_key.as_deref());
        let mut out = None;
        for v in keys.filter_map(|k| recorded_capacity(root, k)) {
            if v <= 1 {
                return Some(0);
            }
            out = Some(out.map_or(v as u64, |o: u64| o.max(v as u64)));
        }
        out
    }

    /// NodeExpandVolume: this node enforces `bytes` and records it on the root entry, so
    /// that every node enforces it at every stage (a static PV has no directory the
    /// controller's expansion could find, and its volume context keeps the old size). The
    /// record only grows, and the quota applied is what the records say after it: an older,
    /// smaller expansion asked again never lowers it. A read-only session, or one that does
    /// not take its quota from the filer, only sets its own quota. Failing to record, the
    /// quota may only grow here, and the error says kubelet should ask again. Returns the
    /// quota applied (0 = none).
    pub async fn expand(&self, bytes: u64) -> Result<u64> {
        if !self.cfg.quota_from_filer || self.cfg.read_only || self.cfg.root == "/" || bytes == 0 {
            self.set_quota(bytes);
            return Ok(bytes);
        }
        let r = self.record_capacity(bytes).await;
        if r.is_err() {
            let q = self.quota();
            if q != 0 && bytes > q {
                self.set_quota(bytes);
            }
        }
        r.map(|()| self.quota())
    }

    async fn record_capacity(&self, bytes: u64) -> Result<()> {
        let (dir, name) = split(&self.cfg.root);
        let key = self.own_capacity_key();
        // in turn with this node's other cycles of the entry (the directory time write-back
        // would store a copy read before this change, without the record)
        let _turn = self.entry_lock(&dir, &name).lock().await;
        // A chunk condition cannot guard an extended attribute: another writer of the entry
        // (another node, or another PV's session on this directory) that read it before this
        // update stores its copy without the record. Read back after each update and write
        // it again (one more read than updates: the last update is checked too).
        for round in 0..=CAPACITY_ROUNDS {
            // a fresh copy: the update carries every other attribute of the directory as it is
            let mut e = self.filer.lookup_entry(&dir, &name).await?;
            // The volume's own record, even where the controller's already says as much:
            // only the own record is a floor no stale copy can lower (see `take_capacity`).
            if self.own_capacity(&e) >= bytes || self.capacity_on(&e) == Some(0) {
                // confirmed: kept from now on (see `refresh_capacity`); a failed expansion is
                // not (the claim may be lowered again, RecoverVolumeExpansionFailure)
                self.expanded.fetch_max(bytes, Ordering::Relaxed);
                self.take_capacity(&e);
                return Ok(());
            }
            if round == CAPACITY_ROUNDS {
                break;
            }
            e.extended
                .insert(key.to_string(), bytes.to_string().into_bytes());
            self.update_entry(&dir, e).await?;
            tracing::info!(root = %self.cfg.root, bytes, key, "capacity recorded on the filer");
        }
        Err(errno(
            libc::EAGAIN,
            format!(
                "{}: the capacity record was overwritten {CAPACITY_ROUNDS} times",
                self.cfg.root
            ),
        ))
    }

    /// Re-reads the capacity recorded on the root entry (an expansion made elsewhere).
    /// Errors are ignored: the health check reports an unreachable filer.
    pub async fn refresh_capacity(&self) {
        if !self.cfg.quota_from_filer || self.cfg.root == "/" {
            return;
        }
        let (dir, name) = split(&self.cfg.root);
        let Ok(e) = self.filer.lookup_entry(&dir, &name).await else {
            return;
        };
        // A record below what this session expanded to was overwritten after the expansion
        // checked it (another writer's copy of the entry read before it; the filer has no
        // compare-and-swap): written again rather than taken, so the size kubelet was told
        // sticks.
        // A writer that keeps storing an old copy (a node whose cache never learns) would
        // make that a rewrite every tick: they back off, and the quota stays meanwhile.
        let expanded = self.expanded.load(Ordering::Relaxed);
        if expanded > 0 && self.capacity_on(&e) != Some(0) && self.own_capacity(&e) < expanded {
            if !self.rerecords.lock().begin(Instant::now()) {
                return;
            }
            tracing::warn!(root = %self.cfg.root, expanded, "the capacity record was overwritten; recording it again");
            if let Err(err) = self.record_capacity(expanded).await {
                tracing::warn!(root = %self.cfg.root, error = %err, "recording the capacity again failed");
            }
            return;
        }
        self.take_capacity(&e);
    }

    /// Records that the kernel is told of the entry `e` at `path` (one more lookup when
    /// `counted`). A number another path holds here counts as held by another file still
    /// there; [`Self::remember_asking`] asks the filer instead.
    pub(super) fn remember(&self, path: &str, e: &pb::Entry, counted: bool) -> Attr {
        if !e.hard_link_id.is_empty() {
            return self.remember_link(path, e, counted);
        }
        let id = file_id(path, e);
        let ino = self
            .inodes
            .claim_and_remember(path, &id, counted, Some(true))
            .unwrap_or(id.base);
        self.attr_of(ino, path, e)
    }

    /// [`Self::remember`] for a file just read from the filer: where its number is known here
    /// as another path's file born in the same second, the filer says whether that path
    /// still holds it (two files) or not (one file, renamed by another client).
    pub(super) async fn remember_asking(&self, path: &str, e: &pb::Entry, counted: bool) -> Attr {
        if !e.hard_link_id.is_empty() {
            return self.remember_link(path, e, counted);
        }
        let id = file_id(path, e);
        let mut other_live = None;
        loop {
            match self
                .inodes
                .claim_and_remember(path, &id, counted, other_live)
            {
                Ok(ino) => return self.attr_of(ino, path, e),
                Err(other) if other_live.is_none() => {
                    other_live = Some(self.still_holds(&other, &id).await);
                }
                Err(_) => other_live = Some(true),
            }
        }
    }

    /// Hard links share one node id on purpose; a further name is one more alias.
    fn remember_link(&self, path: &str, e: &pb::Entry, counted: bool) -> Attr {
        let ino = entry_inode(path, e);
        let a = self.attr_of(ino, path, e);
        self.inodes.remember_link(ino, path, a.kind, counted);
        a
    }

    /// Whether `path` still holds a file numbered `id.base` on the filer (also when the
    /// filer cannot be asked: two node ids for one file are safer than one for two).
    pub(super) async fn still_holds(&self, path: &str, id: &FileId) -> bool {
        let (dir, name) = split(path);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        match self.filer.lookup_entry(&dir, &name).await {
            Ok(e) => e.hard_link_id.is_empty() && file_id(path, &e).base == id.base,
            Err(FilerError::NotFound(_)) => false,
            Err(err) => {
                tracing::debug!(path, error = %err, "could not ask whether a file is still there");
                true
            }
        }
    }

    /// The node id of the file `e` at `path` (see [`InodeTable::claim`]; a number another
    /// path holds counts as held by another file still there). Hard links share one number
    /// on purpose.
    pub(super) fn node_id(&self, path: &str, e: &pb::Entry) -> u64 {
        if e.hard_link_id.is_empty() {
            self.inodes.id_of(path, &file_id(path, e), true)
        } else {
            entry_inode(path, e)
        }
    }

    /// Whether node `ino` is the file `e` the name `path` leads to (see
    /// [`InodeTable::is_node`](super::inode::InodeTable::is_node)).
    pub(super) fn is_node(&self, path: &str, e: &pb::Entry, ino: u64) -> bool {
        if e.hard_link_id.is_empty() {
            self.inodes.is_node(path, &file_id(path, e), ino)
        } else {
            entry_inode(path, e) == ino
        }
    }

    /// Whether `e`, found at `path`, is the open file node `ino` whose own entry says
    /// `known`: the node table says so, or neither has the filer's number and both were
    /// born alike (such a file's node id follows the path it was first seen at).
    pub(super) fn is_open_file(
        &self,
        path: &str,
        e: &pb::Entry,
        ino: u64,
        known: &Identity,
    ) -> bool {
        self.is_node(path, e, ino) || known.is_inodeless_match(e)
    }

    /// [`Self::is_open_file`] as a check before a change of the filer's entry through an open
    /// file: another file at the name now (moved over it, or removed and made again, the
    /// event not here yet) is not changed, and the caller gets ESTALE.
    pub(super) fn check_open_file(
        &self,
        path: &str,
        e: &pb::Entry,
        ino: u64,
        known: &Identity,
    ) -> Result<()> {
        if self.is_open_file(path, e, ino, known) {
            Ok(())
        } else {
            Err(errno(libc::ESTALE, format!("{path} is another file now")))
        }
    }

    /// The node that stood for `e`, last known at `path` (the old entry of a move or a
    /// removal; see [`InodeTable::node_of`]).
    pub(super) fn node_of(&self, path: &str, e: &pb::Entry) -> u64 {
        if e.hard_link_id.is_empty() {
            self.inodes.node_of(path, &file_id(path, e))
        } else {
            entry_inode(path, e)
        }
    }

    /// A new inode number for an entry we create. Not the filer's md5(path)+crtime_secs*37
    /// formula `weed mount` uses: that repeats when a path is reused within a second (write
    /// `x.lock`, rename it over `x`, create `x.lock` again), and two files with one number look
    /// like hard links to tar/rsync and mix up open-file state here. Random numbers are
    /// unique in practice; numbers the kernel knows here are skipped.
    pub(super) fn fresh_inode(&self) -> u64 {
        loop {
            let ino: u64 = rand::random();
            if ino > ROOT_INO && self.inodes.path(ino).is_none() && self.open_file(ino).is_none() {
                return ino;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_entry(
        &self,
        name: &str,
        kind: Kind,
        perm: u32,
        uid: u32,
        gid: u32,
        symlink: &str,
        rdev: u32,
    ) -> pb::Entry {
        let (s, ns) = now_parts();
        let a = pb::FuseAttributes {
            file_size: 0,
            mtime: s,
            mtime_ns: ns,
            ctime: s,
            ctime_ns: ns,
            crtime: s,
            crtime_ns: ns,
            atime: s,
            atime_ns: ns,
            file_mode: to_go_mode(kind, perm),
            uid: self.cfg.ids.uid_to_filer(uid),
            gid: self.cfg.ids.gid_to_filer(gid),
            symlink_target: symlink.to_string(),
            rdev,
            ttl_sec: self.cfg.ttl_sec,
            ..Default::default()
        };
        pb::Entry {
            name: name.to_string(),
            is_directory: kind == Kind::Dir,
            attributes: Some(a),
            ..Default::default()
        }
    }

    pub async fn lookup(&self, parent: u64, name: &str) -> Result<Attr> {
        let dir = self.path_of(parent)?;
        let e = self.entry_at(&dir, name).await?;
        let path = join(&dir, name);
        if e.is_directory {
            self.load_dir_for_nlink(&path).await;
        }
        Ok(self.remember_asking(&path, &e, true).await)
    }

    /// Lists a directory so its link count is known (best effort: it is usually read next).
    async fn load_dir_for_nlink(&self, path: &str) {
        if let Err(e) = self.load_dir(path).await {
            tracing::debug!(path, error = %e, "listing for the link count failed");
        }
    }

    pub fn forget(&self, ino: u64, n: u64) {
        if self.inodes.forget(ino, n) {
            // the kernel dropped the inode and its pages: a later open starts afresh
            self.forget_content_gen(ino);
        }
    }

    pub async fn getattr(&self, ino: u64) -> Result<Attr> {
        if ino == ROOT_INO {
            self.load_dir_for_nlink(&self.cfg.root).await;
            return Ok(self.root_attr());
        }
        let path = self.path_of(ino)?;
        if let Some(of) = self.open_file(ino) {
            // under the lock, no copy: an open file's entry holds its whole chunk list, and
            // the kernel asks for attributes while a large file is being written
            return Ok(self.open_file_attr(ino, &of));
        }
        let (dir, name) = split(&path);
        let e = self.entry_at(&dir, &name).await?;
        if e.is_directory {
            self.load_dir_for_nlink(&path).await;
        }
        Ok(self.attr_of(ino, &path, &e))
    }

    pub(super) async fn update_entry(&self, dir: &str, e: pb::Entry) -> Result<()> {
        Ok(self.update_entry_if(dir, e, None).await?)
    }

    /// [`Self::update_entry`], stored only if the filer's entry still holds what `condition`
    /// says (else [`FilerError::Changed`], nothing stored).
    async fn update_entry_if(
        &self,
        dir: &str,
        e: pb::Entry,
        condition: Option<pb::WriteCondition>,
    ) -> std::result::Result<(), FilerError> {
        let _local = self.note_local(dir, &e.name, Some(self.node_id(&join(dir, &e.name), &e)));
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let req = pb::UpdateEntryRequest {
            directory: dir.to_string(),
            entry: Some(e.clone()),
            condition,
            ..Default::default()
        };
        self.filer.update_entry(req).await?;
        self.meta.upsert(dir, Arc::new(e));
        Ok(())
    }

    /// The filer's current entry `dir/name`, never a cached one.
    pub(super) async fn fresh_entry(&self, dir: &str, name: &str) -> Result<pb::Entry> {
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        match self.filer.lookup_entry(dir, name).await {
            Ok(e) => Ok(e),
            Err(FilerError::NotFound(_)) => {
                self.meta.remove(dir, name);
                self.note_name_gone();
                Err(errno(libc::ENOENT, format!("{dir}/{name}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Applies a metadata change to the filer's current entry and stores it. Never built from
    /// a cached entry: its chunk list may predate another node's write, and the filer deletes
    /// every chunk an update leaves out. The update is stored only if the filer still has
    /// the chunks that were looked up (a commit elsewhere in the round trip between the
    /// lookup and the update would otherwise be undone, its chunks deleted); if not, the
    /// change is applied to the entry looked up again.
    ///
    /// This node's own cycles of one entry take turns ([`Self::entry_lock`]): a chmod that
    /// lands between another cycle's lookup and update (a directory's time write-back, a
    /// utimes from another thread) would otherwise be undone by it.
    pub(super) async fn update_fresh(
        &self,
        dir: &str,
        name: &str,
        f: impl FnMut(&mut pb::Entry) -> Result<()>,
    ) -> Result<pb::Entry> {
        let _turn = self.entry_lock(dir, name).lock().await;
        self.update_fresh_locked(dir, name, f).await
    }

    /// [`Self::update_fresh`] for a caller that holds the entry's turn already.
    pub(super) async fn update_fresh_locked(
        &self,
        dir: &str,
        name: &str,
        mut f: impl FnMut(&mut pb::Entry) -> Result<()>,
    ) -> Result<pb::Entry> {
        let mut tries = 0;
        loop {
            let mut e = self.fresh_entry(dir, name).await?;
            let condition = chunks_unchanged(&e.chunks);
            f(&mut e)?;
            match self.update_entry_if(dir, e.clone(), Some(condition)).await {
                Err(FilerError::Changed(m)) if tries < CHANGED_RETRIES => {
                    tries += 1;
                    tracing::debug!(dir, name, tries, m, "entry changed under an update; again");
                    // a file committed again and again elsewhere: let a commit through
                    tokio::time::sleep(Duration::from_millis(u64::from(tries))).await;
                }
                Err(err) => return Err(err.into()),
                Ok(()) => return Ok(e),
            }
        }
    }

    pub(super) async fn create_on_filer(&self, dir: &str, e: &pb::Entry, excl: bool) -> Result<()> {
        self.create_on_filer_if(dir, e, excl, None)
            .await
            .map_err(|err| match err {
                FilerError::AlreadyExists(m) => errno(libc::EEXIST, m),
                other => other.into(),
            })
    }

    /// [`Self::create_on_filer`], stored only if the filer's entry at the name still holds
    /// what `condition` says (else [`FilerError::Changed`], nothing stored).
    pub(super) async fn create_on_filer_if(
        &self,
        dir: &str,
        e: &pb::Entry,
        excl: bool,
        condition: Option<pb::WriteCondition>,
    ) -> std::result::Result<(), FilerError> {
        let _local = self.note_local(dir, &e.name, Some(self.node_id(&join(dir, &e.name), e)));
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let req = pb::CreateEntryRequest {
            directory: dir.to_string(),
            entry: Some(e.clone()),
            o_excl: excl,
            skip_check_parent_directory: true,
            condition,
            ..Default::default()
        };
        self.filer.create_entry(req).await?;
        Ok(())
    }

    pub fn access_ok(&self, _ino: u64) -> Result<()> {
        Ok(())
    }
}

/// How often a conditional update is tried again on an entry that keeps changing under it
/// (each try reads it again) before the change fails.
const CHANGED_RETRIES: u32 = 8;

/// The condition that the filer's entry still lists exactly `chunks` (ids as a multiset).
pub(super) fn chunks_unchanged(chunks: &[pb::FileChunk]) -> pb::WriteCondition {
    pb::WriteCondition {
        clauses: vec![chunks_equal(crate::volume::fid::chunk_file_ids(chunks))],
    }
}

/// The clause that the entry lists exactly the chunks `fids` (as a multiset).
fn chunks_equal(fids: Vec<String>) -> pb::write_condition::Clause {
    pb::write_condition::Clause {
        kind: pb::write_condition::Kind::IfChunksEqual as i32,
        fids,
    }
}

/// The condition that the filer has an entry at the name and it lists exactly the chunks
/// `fids` (an absent entry counts as one without chunks, hence both clauses).
pub(super) fn exists_with_chunks(fids: &[String]) -> pb::WriteCondition {
    let mut c = must_exist();
    c.clauses.push(chunks_equal(fids.to_vec()));
    c
}

/// The condition that the filer has an entry at the name.
pub(super) fn must_exist() -> pb::WriteCondition {
    pb::WriteCondition {
        clauses: vec![pb::write_condition::Clause {
            kind: pb::write_condition::Kind::IfExists as i32,
            fids: Vec::new(),
        }],
    }
}

/// One directory's listing lock, taken out of `Fs::dir_locks` while used and removed from
/// it by its last user (the map would otherwise keep every directory ever listed).
struct DirLock<'a> {
    map: &'a parking_lot::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    dir: String,
    lock: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl DirLock<'_> {
    fn mutex(&self) -> &tokio::sync::Mutex<()> {
        self.lock.as_ref().expect("held until dropped")
    }
}

impl Drop for DirLock<'_> {
    fn drop(&mut self) {
        let mut m = self.map.lock();
        // ours let go under the map's lock: two users finishing together cannot both see
        // the other's and leave the entry; newcomers go through the map (locked)
        drop(self.lock.take());
        if m.get(&self.dir).is_some_and(|l| Arc::strong_count(l) == 1) {
            m.remove(&self.dir);
        }
    }
}

/// A capacity recorded on a volume's directory under `key`, if readable.
fn recorded_capacity(e: &pb::Entry, key: &str) -> Option<i64> {
    e.extended
        .get(key)
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|s| s.trim().parse::<i64>().ok())
}

#[cfg(test)]
mod rerecord_tests {
    use super::*;

    #[test]
    fn rewrites_pause_longer_each_time_and_start_again_after_a_quiet_spell() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = Rerecords::default();
        assert!(r.begin(at(0)), "the first rewrite waits for nothing");
        assert!(!r.begin(at(4)));
        assert!(r.begin(at(5)));
        assert!(!r.begin(at(14)), "the second pause is twice the first");
        assert!(r.begin(at(15)));
        // many more in a row: the pause stops at its longest
        let mut t = 15;
        for _ in 0..20 {
            t += RERECORD_PAUSE_MAX.as_secs();
            assert!(r.begin(at(t)));
            assert!(!r.begin(at(t + 1)));
        }
        // after a quiet spell the count starts again
        t += 2 * RERECORD_PAUSE_MAX.as_secs() + 1;
        assert!(r.begin(at(t)));
        assert!(r.begin(at(t + 5)));
    }
}
