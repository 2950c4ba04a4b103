//! Open-file state shared by every handle of one inode: the entry as we know it, dirty data
//! buffered in chunk-sized slots, uploads in flight, and the read path over all of them.
//!
//! Write path: writes land in slots of `chunk_size`; a slot is sealed (uploaded in the
//! background, bounded by a session-wide semaphore) when full, when too many slots are open,
//! or on flush. Every sealed run gets a strictly increasing `modified_ts_ns`, so the visible
//! bytes are well defined whatever order uploads finish in. Flush waits for uploads, then
//! commits the whole chunk list with one `CreateEntry`.
//!
//! Over 800 lines: the write slots, the upload bookkeeping and the commit snapshot share one
//! lock and its invariants, and its unit tests need them.

use super::attr::entry_size;
use crate::budget::{Charge, MemoryBudget};
use crate::chunks;
use crate::pb::filer as pb;
use crate::volume::md5stream::Stream as Md5Stream;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// Strictly increasing nanosecond timestamps for chunk ordering, process-wide.
pub fn next_ts_ns() -> i64 {
    static LAST: AtomicI64 = AtomicI64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0);
    let mut prev = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(prev + 1);
        match LAST.compare_exchange_weak(prev, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(p) => prev = p,
        }
    }
}

/// Writes at least this large reserve the whole slot up front (small files never do).
const LARGE_WRITE: usize = 64 * 1024;

/// One chunk-sized window of dirty bytes.
#[derive(Default)]
pub struct Slot {
    /// The bytes from slot offset `base` on: a slot first written in its middle (appends
    /// after an fsync) holds no zeros for the part before, which nobody wrote.
    data: Vec<u8>,
    base: usize,
    /// Sorted, non-overlapping, merged written ranges within the slot.
    pub ranges: Vec<(usize, usize)>,
    /// `data`'s memory, held against the node's budget.
    charge: Option<Charge>,
    /// The MD5 of the slot's one range (from `start`), hashed as it was appended: kept
    /// only while every write to the slot extends that range at its end.
    md5: Option<HashedAhead>,
}

/// A slot's stream of hashed appends. Dropped without being sealed (an overwrite, a
/// truncate, the slot dropped), its pieces not hashed yet are dropped too.
struct HashedAhead {
    start: usize,
    stream: Option<Md5Stream>,
}

impl Drop for HashedAhead {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            s.abandon();
        }
    }
}

impl Slot {
    /// `stream`: hash appends as they come (the file fsyncs often).
    fn write(
        &mut self,
        at: usize,
        buf: &[u8],
        slot_size: usize,
        budget: &Arc<MemoryBudget>,
        stream: bool,
    ) {
        let end = at + buf.len();
        let appends = match (&self.md5, self.ranges.as_slice()) {
            (Some(h), [(s, e)]) => h.start == *s && *e == at,
            _ => false,
        };
        if stream && self.ranges.is_empty() {
            self.md5 = Some(HashedAhead {
                start: at,
                stream: Some(Md5Stream::new()),
            });
        } else if !(stream && appends) {
            // an overwrite, a gap or a write before the range: hashed again when uploaded
            self.md5 = None;
        }
        if let Some(md5) = self.md5.as_ref().and_then(|h| h.stream.as_ref()) {
            md5.push(buf);
        }
        if self.ranges.is_empty() {
            self.data.clear();
            self.base = at;
        } else if at < self.base {
            // a write before the first one: the slot takes the plain layout from its start,
            // once (moving up only as far as each write would copy the bytes again and again
            // for a writer going backwards)
            let mut moved = Vec::with_capacity(self.end());
            moved.resize(self.base, 0);
            moved.extend_from_slice(&self.data);
            self.data = moved;
            self.base = 0;
        }
        let (lo, hi) = (at - self.base, end - self.base);
        if self.data.capacity() == 0 && buf.len() >= LARGE_WRITE {
            // a large writer fills the slot: allocate it once instead of growing it
            self.data
                .reserve_exact((slot_size - self.base.min(slot_size)).max(hi));
        }
        // the part past the end is appended, not zero-filled first and then copied over
        let len = self.data.len();
        // grown once to the write's end, as resizing to it would (the charge follows capacity)
        self.data.reserve(hi.saturating_sub(len));
        if lo >= len {
            self.data.resize(lo, 0);
            self.data.extend_from_slice(buf);
        } else if hi > len {
            let (over, past) = buf.split_at(len - lo);
            self.data[lo..].copy_from_slice(over);
            self.data.extend_from_slice(past);
        } else {
            self.data[lo..hi].copy_from_slice(buf);
        }
        add_range(&mut self.ranges, at, end);
        self.charge
            .get_or_insert_with(|| budget.charge())
            .set(self.data.capacity() as u64);
    }

    pub fn written(&self) -> usize {
        self.ranges.iter().map(|(s, e)| e - s).sum()
    }

    /// The bytes at slot offsets `lo..hi` (within the written ranges).
    fn bytes(&self, lo: usize, hi: usize) -> &[u8] {
        &self.data[lo - self.base..hi - self.base]
    }

    /// One past the last slot offset held.
    fn end(&self) -> usize {
        self.base + self.data.len()
    }

    fn truncate(&mut self, len: usize) {
        self.md5 = None;
        self.data.truncate(len.saturating_sub(self.base));
        self.ranges.retain_mut(|r| {
            r.1 = r.1.min(len);
            r.0 < r.1
        });
    }
}

fn add_range(ranges: &mut Vec<(usize, usize)>, s: usize, e: usize) {
    let mut ns = s;
    let mut ne = e;
    let mut out = Vec::with_capacity(ranges.len() + 1);
    for &(a, b) in ranges.iter() {
        if b < ns || a > ne {
            out.push((a, b));
        } else {
            ns = ns.min(a);
            ne = ne.max(b);
        }
    }
    out.push((ns, ne));
    out.sort_unstable();
    *ranges = out;
}

/// Data being uploaded: readable from memory until its chunk is in the entry. A run whose
/// upload gave up stays here (`failed`) until a later flush places it: acknowledged bytes are
/// never dropped while the file is open.
#[derive(Clone)]
pub struct Inflight {
    pub id: u64,
    pub offset: u64,
    pub data: Bytes,
    pub ts: i64,
    pub failed: bool,
    /// The sealed slot's memory, held against the node's budget while the upload runs (a
    /// failed run is not held: the file takes no more writes until it is placed).
    pub charge: Option<Arc<Charge>>,
}

/// A run sealed for upload. Its in-flight record is settled only by its upload, so a run
/// dropped before its upload started (a panic between sealing and starting it, a future
/// dropped while it waited for an upload slot) notes itself as lost: the file then settles
/// it as failed, to be uploaded again from memory by the next flush, instead of a flush
/// waiting for it forever.
pub struct SealedRun {
    pub id: u64,
    pub offset: u64,
    pub data: Bytes,
    pub ts: i64,
    /// `data`'s MD5, hashed while it was written (see [`Slot`]).
    pub md5: Option<Md5Stream>,
    /// Where it notes itself as lost; None once its upload has started or it was settled.
    settle: Option<Arc<Settle>>,
}

impl SealedRun {
    /// Its upload has started (or it was settled otherwise): dropping it is no loss.
    pub fn started(&mut self) {
        self.settle = None;
    }
}

impl Drop for SealedRun {
    fn drop(&mut self) {
        if let Some(settle) = self.settle.take() {
            tracing::error!(
                offset = self.offset,
                len = self.data.len(),
                "a sealed run was dropped before its upload started; the next flush uploads it"
            );
            settle.lost.lock().push(self.id);
            settle.done.notify_waiters();
        }
    }
}

/// How a file's uploads settle: waiters are woken after each one, and runs dropped before
/// their upload started are noted here (a lock of its own: a run may be dropped while the
/// file's state lock is held, unwinding a panic).
#[derive(Default)]
pub struct Settle {
    pub done: Notify,
    lost: Mutex<Vec<u64>>,
}

pub struct FileState {
    pub dir: String,
    pub entry: pb::Entry,
    /// `entry.chunks` with manifests expanded (what reads resolve against). `entry.chunks`
    /// keeps the manifest chunks, so a commit sends only the chunks not yet in a manifest.
    pub resolved: Arc<Vec<pb::FileChunk>>,
    /// `visible_intervals(resolved)`, built on first use and then kept up to date per upload.
    pub visible: Option<Arc<Vec<chunks::VisibleInterval>>>,
    pub size: u64,
    pub slots: BTreeMap<u64, Slot>,
    pub inflight: Vec<Inflight>,
    pub next_id: u64,
    /// Entry differs from the filer's (create pending, data or attributes changed).
    pub meta_dirty: bool,
    /// Not yet created on the filer (deferred create).
    pub pending_create: bool,
    pub unlinked: bool,
    /// Its last handle closed: this state left the open files and the chunks only it knew
    /// were deleted. It is never committed again; a request still holding it looks the
    /// file up again (an open finds it gone from the table and loads the filer's entry).
    pub retired: bool,
    /// Why the runs marked `failed` could not be placed (cleared once none is left).
    pub error: Option<String>,
    /// Bytes written but not yet committed (for quota accounting).
    pub uncommitted: u64,
    /// Bumped by every change a commit must carry; a commit clears `meta_dirty` only if no
    /// change arrived while it was in flight.
    pub seq: u64,
    /// Highest `modified_ts_ns` among the file's chunks. New runs sort after it whatever this
    /// node's clock says: a node whose clock is behind the last writer's must still win.
    pub max_ts: i64,
    /// Chunks we uploaded that no successful commit has carried yet.
    pub ours: HashSet<String>,
    /// Of those, the ones dropped from the list before a commit carried them (overwritten,
    /// truncated away): no entry will ever reference them, so they are deleted after the next
    /// successful commit (the filer only deletes chunks it once had).
    pub garbage: Vec<String>,
    /// Bumped when this node changes the file's filer entry or name (before and after the
    /// filer call) and when another client's event is applied to it: a re-read of the entry
    /// that saw it move on is stale.
    pub epoch: u64,
    /// When this node last changed the file's filer entry or name.
    pub local_at: Option<std::time::Instant>,
    /// Changes of the file's filer entry or name by this node in flight.
    pub local_inflight: u32,
    /// Re-reads of the entry asked for by events of doubtful order (one runs per file).
    pub resync: Resync,
    /// Another client may have moved or removed the file unseen (a subscription gap, a
    /// replayed event whose move is not taken): until a re-read finds it under its name, a
    /// commit first checks that the name still leads to it.
    pub name_doubt: bool,
    /// An event said the file was removed (or replaced by a move) but may be older than
    /// this node's own change of it, so its re-read decides. Until it has, a commit first
    /// asks the filer whether the name still leads to the file, and believes the removal if
    /// not: a commit in that window would otherwise create the removed file again.
    pub removal_doubt: bool,
    /// Events, since the last commit, that showed this plain file in a link group (another
    /// node made it a hard link) while it had data to commit, so it took no entry from them:
    /// the commit asks the filer for the group. (A file already in a group asks at every
    /// commit anyway, for the group's count.)
    pub link_news: u32,
    /// The last link group (id, link count) such an event or a re-read showed at this file's
    /// own name: until the commit joins it, a removal of this name may leave the file alive
    /// under another name of that group.
    pub seen_link: Option<(Vec<u8>, i32)>,
    /// Other names events showed in this file's link group (its entry's or `seen_link`'s),
    /// newest last: where a removed name's file lives on when no lookup here met them. The
    /// filer confirms one before it is used.
    pub link_names: Vec<String>,
    /// The attribute changes deferred into this state (merged, later ones winning) and the
    /// `seq` of the last: a commit that carried that `seq` carried them all. A last close
    /// that fails for good still applies them to the filer's entry (they were answered).
    pub deferred_attrs: Option<(super::setattr::SetAttr, u64)>,
    /// The file was fsynced with data to upload: its appends are hashed as they come, and
    /// its uploads take reserved file ids (an fsync waits for both).
    pub syncs: bool,
    /// The ids of the chunks the filer's entry lists as this node last knew it (opened,
    /// taken from an event, committed): a commit is stored only onto exactly those, and is
    /// otherwise rebased onto the filer's newer entry first ([`OpenFile::rebase`]).
    pub filer_chunks: Vec<String>,
    /// This node's data changes that no commit snapshot has taken yet.
    pub ops: DataOps,
    /// Data chunks the filer's entry holds inside manifests of `filer_chunks` while this
    /// node's list has them unfolded (a commit folded them, but a truncate meanwhile kept
    /// the list from taking its manifests): the filer's, for a rebase.
    pub filer_folded: Vec<String>,
}

/// What this node did to a file's data since a commit snapshot, as far as a rebase onto
/// another client's newer entry needs it: the other client's bytes survive except where
/// these changes put their own or cut them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DataOps {
    /// The lowest size a truncation set (the other client's bytes past it are cut).
    pub cut: Option<u64>,
    /// The end of the furthest write or extension (the file is at least this long).
    pub end: u64,
}

impl DataOps {
    /// Both `self` and `o`, as one set of changes.
    pub fn merge(&mut self, o: DataOps) {
        self.cut = match (self.cut, o.cut) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.end = self.end.max(o.end);
    }
}

/// Chunks' worth a file that fsyncs may write between two commits and still count as one
/// that fsyncs often; past it (a bulk load after one fsync) it uploads like any other file.
pub const SYNC_SPAN_CHUNKS: u64 = 4;

/// See [`FileState::resync`].
#[derive(Debug, Default)]
pub struct Resync {
    pub wanted: bool,
    pub running: bool,
    /// One of the events behind it removed the file's name.
    pub deleted: bool,
}

impl FileState {
    /// This node is about to change, or has changed, the file's filer entry or name.
    pub fn changed_here(&mut self) {
        self.epoch += 1;
        self.local_at = Some(std::time::Instant::now());
    }

    /// This node changed the file's entry or name within `window`.
    pub fn changed_here_within(&self, window: std::time::Duration) -> bool {
        self.local_at.is_some_and(|t| t.elapsed() < window)
    }

    /// Asks for a re-read of the entry; true if the caller must start it (none running).
    pub fn want_resync(&mut self, deleted: bool) -> bool {
        self.resync.wanted = true;
        self.resync.deleted |= deleted;
        if deleted {
            self.removal_doubt = true;
            // an answer asked for before the removal (a re-read or a commit's check under
            // way) must not settle it
            self.epoch += 1;
        }
        !std::mem::replace(&mut self.resync.running, true)
    }

    /// Notes dropped chunks that only we know about, for deletion after the next commit.
    fn drop_ours(&mut self, dropped: &[pb::FileChunk]) {
        for c in dropped {
            if self.ours.contains(&c.file_id) {
                self.garbage.push(c.file_id.clone());
            }
        }
    }

    /// A commit failed with an unknown outcome: the filer may hold what it carried, so none
    /// of those chunks is ever deleted by us.
    pub fn forget_carried(&mut self, snap_chunks: &[pb::FileChunk]) {
        for c in snap_chunks {
            self.ours.remove(&c.file_id);
        }
        let ours = &self.ours;
        self.garbage.retain(|f| ours.contains(f));
    }

    /// Everything we uploaded that no entry references, now that the file will never be
    /// committed again (unlinked or replaced before its last commit).
    pub fn take_orphans(&mut self) -> Vec<String> {
        self.garbage.clear();
        self.ours.drain().collect()
    }

    /// Records a change that the next commit must carry.
    pub fn touch(&mut self) {
        self.meta_dirty = true;
        self.seq += 1;
    }

    /// Nothing here differs from what the filer has: no dirty bytes, no uploads in flight, no
    /// pending commit. Only then may the entry be replaced by a newer one from the filer, and
    /// only then is a metadata change applied to the filer's entry rather than ours.
    /// Fsynced with data to upload, and not written much since its last commit.
    pub fn syncs_often(&self, chunk_size: u64) -> bool {
        self.syncs && self.uncommitted <= SYNC_SPAN_CHUNKS * chunk_size
    }

    /// The file's link group: its entry's, or one an event showed it in since its last
    /// commit (`seen_link`), which the next commit joins if the filer confirms it.
    pub fn link_group(&self) -> Vec<u8> {
        match &self.seen_link {
            Some((id, _)) if self.entry.hard_link_id.is_empty() => id.clone(),
            _ => self.entry.hard_link_id.clone(),
        }
    }

    /// An event or re-read at this file's own name showed it in link group `e`, while it has
    /// data to commit: its commit asks the filer for the group (`link_news`), and a removal
    /// of the name meanwhile looks for the file under the group's other names.
    pub fn saw_link_group(&mut self, e: &pb::Entry) {
        self.link_news = self.link_news.saturating_add(1);
        self.seen_link = Some((e.hard_link_id.clone(), e.hard_link_counter));
    }

    /// Records another name of the file's link group (an event's), keeping the last few.
    pub fn note_link_name(&mut self, path: String) {
        const KEEP: usize = 8;
        self.link_names.retain(|p| *p != path);
        if self.link_names.len() == KEEP {
            self.link_names.remove(0);
        }
        self.link_names.push(path);
    }

    pub fn is_clean(&self) -> bool {
        !self.meta_dirty && self.slots.is_empty() && self.inflight.is_empty()
    }

    /// Takes `e` (newer, from the filer) as the file's entry. Callers check [`is_clean`].
    pub fn replace_entry(&mut self, e: pb::Entry, resolved: Vec<pb::FileChunk>) {
        self.epoch += 1;
        self.filer_chunks = crate::volume::fid::chunk_file_ids(&e.chunks);
        self.filer_folded.clear();
        self.ops = DataOps::default();
        self.size = entry_size(&e);
        self.max_ts = max_ts(&resolved);
        self.resolved = Arc::new(resolved);
        self.visible = None;
        self.entry = e;
    }

    /// The next run's timestamp: after every chunk of the file, and strictly increasing.
    fn next_run_ts(&mut self) -> i64 {
        let ts = next_ts_ns().max(self.max_ts.saturating_add(1));
        self.max_ts = ts;
        ts
    }
}

fn max_ts(chunks: &[pb::FileChunk]) -> i64 {
    chunks.iter().map(|c| c.modified_ts_ns).max().unwrap_or(0)
}

impl FileState {
    /// The visible intervals of `resolved`, built once and then updated in place.
    fn visible(&mut self) -> Arc<Vec<chunks::VisibleInterval>> {
        self.visible
            .get_or_insert_with(|| Arc::new(chunks::visible_intervals(&self.resolved)))
            .clone()
    }
}

pub struct OpenFile {
    pub ino: u64,
    pub state: Mutex<FileState>,
    pub settle: Arc<Settle>,
    /// Held from building a commit until the filer answered it: two commits of one file in
    /// flight could reach the filer out of order, and the older chunk list would make the
    /// filer delete the chunks only the newer one has.
    pub commit: tokio::sync::Mutex<()>,
    pub chunk_size: usize,
    pub max_slots: usize,
    /// Where the latest sequential reader of any handle prefetched from (`u64::MAX`: none).
    pub stream_pos: AtomicU64,
    /// What this file's dirty bytes are charged to.
    pub budget: Arc<MemoryBudget>,
}

/// A planned read: its end offset, the pieces, and dirty bytes `(offset, data)` laid over them.
pub type ReadPlan = (u64, Vec<Piece>, Vec<(u64, Bytes)>);

/// A piece of a read: where its bytes come from.
pub enum Piece {
    Chunk {
        chunk: pb::FileChunk,
        offset_in_chunk: u64,
        len: u64,
        at: u64,
    },
    Mem {
        data: Bytes,
        at: u64,
    },
    Zero {
        len: u64,
        at: u64,
    },
}

impl OpenFile {
    pub fn new(
        ino: u64,
        dir: String,
        entry: pb::Entry,
        chunk_size: usize,
        max_slots: usize,
    ) -> Self {
        let size = entry_size(&entry);
        let max_ts = max_ts(&entry.chunks);
        let resolved = Arc::new(entry.chunks.clone());
        let filer_chunks = crate::volume::fid::chunk_file_ids(&entry.chunks);
        OpenFile {
            ino,
            state: Mutex::new(FileState {
                dir,
                entry,
                resolved,
                visible: None,
                size,
                slots: BTreeMap::new(),
                inflight: Vec::new(),
                next_id: 1,
                meta_dirty: false,
                pending_create: false,
                unlinked: false,
                retired: false,
                error: None,
                uncommitted: 0,
                seq: 0,
                max_ts,
                ours: HashSet::new(),
                garbage: Vec::new(),
                epoch: 0,
                local_at: None,
                local_inflight: 0,
                resync: Resync::default(),
                name_doubt: false,
                removal_doubt: false,
                link_news: 0,
                seen_link: None,
                link_names: Vec::new(),
                deferred_attrs: None,
                syncs: false,
                filer_chunks,
                ops: DataOps::default(),
                filer_folded: Vec::new(),
            }),
            settle: Arc::default(),
            commit: tokio::sync::Mutex::new(()),
            chunk_size: chunk_size.max(1),
            max_slots: max_slots.max(2),
            stream_pos: AtomicU64::new(u64::MAX),
            budget: MemoryBudget::global().clone(),
        }
    }

    /// Charges this file's dirty data to `budget` (the process's by default).
    pub fn with_budget(mut self, budget: Arc<MemoryBudget>) -> Self {
        self.budget = budget;
        self
    }

    pub fn path(&self) -> String {
        let s = self.state.lock();
        super::inode::join(&s.dir, &s.entry.name)
    }

    /// Buffers a write; returns runs that must now be uploaded.
    pub fn write(&self, offset: u64, buf: &[u8]) -> Vec<SealedRun> {
        let mut s = self.state.lock();
        self.write_locked(&mut s, offset, buf)
    }

    /// [`Self::write`] of bytes read from the file itself when its `seq` was `seq`: None,
    /// nothing written, if anything changed it since (the bytes read may be stale).
    pub fn rewrite_unless_changed(
        &self,
        seq: u64,
        offset: u64,
        buf: &[u8],
    ) -> Option<Vec<SealedRun>> {
        let mut s = self.state.lock();
        (s.seq == seq).then(|| self.write_locked(&mut s, offset, buf))
    }

    fn write_locked(&self, s: &mut FileState, offset: u64, buf: &[u8]) -> Vec<SealedRun> {
        let cs = self.chunk_size as u64;
        if !s.entry.content.is_empty() {
            // Move inline content into the dirty buffer first, so a partial overwrite keeps it
            // (weed mount drops it).
            let content = std::mem::take(&mut s.entry.content);
            write_slots(s, cs, 0, &content, &self.budget);
        }
        write_slots(s, cs, offset, buf, &self.budget);
        s.uncommitted += buf.len() as u64;
        s.size = s.size.max(offset + buf.len() as u64);
        s.ops.end = s.ops.end.max(offset + buf.len() as u64);
        s.touch();
        let mut sealed = Vec::new();
        let full: Vec<u64> = s
            .slots
            .iter()
            .filter(|(_, sl)| sl.ranges.len() == 1 && sl.ranges[0] == (0, self.chunk_size))
            .map(|(k, _)| *k)
            .collect();
        for k in full {
            sealed.extend(seal_slot(s, k, cs, &self.settle));
        }
        while s.slots.len() > self.max_slots {
            let fullest = s
                .slots
                .iter()
                .max_by_key(|(_, sl)| sl.written())
                .map(|(k, _)| *k);
            match fullest {
                Some(k) => sealed.extend(seal_slot(s, k, cs, &self.settle)),
                None => break,
            }
        }
        sealed
    }

    /// Seals every dirty slot (flush/fsync).
    pub fn seal_all(&self) -> Vec<SealedRun> {
        let cs = self.chunk_size as u64;
        let mut s = self.state.lock();
        // lost runs' records give their budget back here too (writers waiting for room
        // seal every open file)
        self.settle_lost(&mut s);
        let keys: Vec<u64> = s.slots.keys().copied().collect();
        let mut out = Vec::new();
        for k in keys {
            out.extend(seal_slot(&mut s, k, cs, &self.settle));
        }
        out
    }

    /// An upload finished: its chunk joins the entry and its memory copy is dropped. A
    /// failed upload keeps its bytes (readable, retried by the next flush). Returns the
    /// chunk's id if the file was retired meanwhile: no entry will ever list it.
    pub fn upload_done(&self, id: u64, result: Result<pb::FileChunk, String>) -> Option<String> {
        let mut s = self.state.lock();
        if s.retired {
            s.inflight.retain(|i| i.id != id);
            drop(s);
            self.settle.done.notify_waiters();
            return result.ok().map(|c| c.file_id);
        }
        if let Some(pos) = s.inflight.iter().position(|i| i.id == id) {
            match result {
                Ok(mut c) => {
                    let inf = s.inflight.remove(pos);
                    c.offset = inf.offset as i64;
                    c.modified_ts_ns = inf.ts;
                    s.ours.insert(c.file_id.clone());
                    s.entry.chunks.push(c.clone());
                    let size = c.size;
                    let s = &mut *s;
                    // in place: nothing outside the lock holds these Arcs for long, so a
                    // large file's list is not copied per chunk
                    let resolved = Arc::make_mut(&mut s.resolved);
                    resolved.push(c);
                    if let Some(v) = s.visible.as_mut() {
                        chunks::paint(
                            Arc::make_mut(v),
                            chunks::VisibleInterval {
                                start: inf.offset,
                                stop: inf.offset.saturating_add(size),
                                chunk_index: resolved.len() - 1,
                                offset_in_chunk: 0,
                                modified_ts_ns: inf.ts,
                            },
                        );
                    }
                    s.seq += 1;
                    if !s.inflight.iter().any(|i| i.failed) {
                        s.error = None;
                    }
                }
                Err(e) => {
                    s.inflight[pos].failed = true;
                    s.inflight[pos].charge = None;
                    s.error = Some(e);
                }
            }
        }
        drop(s);
        self.settle.done.notify_waiters();
        None
    }

    /// Runs whose upload gave up, handed out again for another try (same ids and order).
    pub fn retry_failed(&self) -> Vec<SealedRun> {
        let mut s = self.state.lock();
        self.settle_lost(&mut s);
        s.inflight
            .iter_mut()
            .filter(|i| i.failed)
            .map(|i| {
                i.failed = false;
                SealedRun {
                    id: i.id,
                    offset: i.offset,
                    data: i.data.clone(),
                    ts: i.ts,
                    md5: None,
                    settle: Some(self.settle.clone()),
                }
            })
            .collect()
    }

    /// The reason if acknowledged bytes of this file could not be placed yet.
    pub fn unplaced(&self) -> Option<String> {
        let mut s = self.state.lock();
        self.settle_lost(&mut s);
        s.inflight
            .iter()
            .any(|i| i.failed)
            .then(|| s.error.clone().unwrap_or_else(|| "upload failed".into()))
    }

    /// Settles the runs dropped before their upload started (see [`SealedRun`]) as an upload
    /// that gave up would be: failed, kept for the next flush (dropped if the file is retired).
    pub fn settle_lost(&self, s: &mut FileState) {
        let lost = std::mem::take(&mut *self.settle.lost.lock());
        if lost.is_empty() {
            return;
        }
        if s.retired {
            s.inflight.retain(|i| !lost.contains(&i.id));
            return;
        }
        let mut settled = false;
        for i in s.inflight.iter_mut().filter(|i| lost.contains(&i.id)) {
            i.failed = true;
            i.charge = None;
            settled = true;
        }
        if settled && s.error.is_none() {
            s.error = Some("a sealed run was dropped before its upload started".into());
        }
    }

    /// Waits until no upload of this file is running (failed runs wait for a retry).
    pub async fn wait_uploads(&self) {
        self.when_uploads(|s| s.inflight.iter().all(|i| i.failed))
            .await
    }

    /// Truncates (or extends) to `size`, once no upload in flight reaches past it: such a
    /// run's chunk would land in the list after the cut and bring its bytes back (a write
    /// racing the truncate, or an fsync retrying a failed run).
    pub async fn truncate(&self, size: u64) {
        self.when_uploads(|s| {
            let past = |i: &Inflight| !i.failed && i.offset + i.data.len() as u64 > size;
            let ready = !s.inflight.iter().any(past);
            if ready {
                // one that cuts nothing here (to the size or past it) is no cut of another
                // client's bytes either: the file is at least that long
                let op = if size < s.size {
                    DataOps {
                        cut: Some(size),
                        end: 0,
                    }
                } else {
                    DataOps {
                        cut: None,
                        end: size,
                    }
                };
                self.truncate_locked(s, size);
                s.ops.merge(op);
            }
            ready
        })
        .await
    }

    /// Runs `step` under the state lock after each finished upload until it says done (the
    /// wake-up is armed before the check, so none is missed).
    async fn when_uploads(&self, mut step: impl FnMut(&mut FileState) -> bool) {
        loop {
            let notified = self.settle.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.state.lock();
                self.settle_lost(&mut s);
                if step(&mut s) {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Extends to `size` if the file is shorter (fallocate): never cuts a write that landed
    /// past it meanwhile.
    pub fn grow_to(&self, size: u64) {
        let mut s = self.state.lock();
        if s.size < size {
            self.truncate_locked(&mut s, size);
        }
        s.ops.end = s.ops.end.max(size);
    }

    fn truncate_locked(&self, s: &mut FileState, size: u64) {
        let cs = self.chunk_size as u64;
        if !s.entry.content.is_empty() {
            let mut c = std::mem::take(&mut s.entry.content);
            if s.entry.chunks.is_empty() && s.slots.is_empty() && size <= 64 * 1024 {
                c.resize(size as usize, 0);
                s.entry.content = c;
            } else {
                c.truncate(size as usize);
                write_slots(s, cs, 0, &c, &self.budget);
            }
        }
        // runs that could not be placed yet are cut like any other data
        s.inflight.retain_mut(|i| {
            if !i.failed || i.offset + i.data.len() as u64 <= size {
                return true;
            }
            if i.offset >= size {
                return false;
            }
            i.data = i.data.slice(..(size - i.offset) as usize);
            true
        });
        s.slots.retain(|k, _| k * cs < size);
        if let Some((k, sl)) = s.slots.iter_mut().next_back() {
            let base = *k * cs;
            if base + sl.end() as u64 > size {
                sl.truncate((size - base) as usize);
            }
        }
        s.slots.retain(|_, sl| !sl.ranges.is_empty());
        if chunks::cuts_manifest(&s.entry.chunks, size) {
            // A cut manifest lists its chunks at full length: the bytes past `size` would come
            // back when the file grows. Commit the expanded chunks; the next commit folds them
            // into new manifests.
            let (kept, dropped) = chunks::truncate(&s.resolved, size);
            let (kept, hidden) = chunks::compact(&kept);
            s.drop_ours(&dropped);
            s.drop_ours(&hidden);
            s.entry.chunks = kept.clone();
            s.resolved = Arc::new(kept);
        } else {
            let (kept, dropped) = chunks::truncate(&s.entry.chunks, size);
            s.entry.chunks = kept;
            s.drop_ours(&dropped);
            s.resolved = Arc::new(chunks::truncate(&s.resolved, size).0);
        }
        s.visible = None;
        s.size = size;
        if let Some(a) = s.entry.attributes.as_mut() {
            a.file_size = size;
        }
        s.touch();
    }

    /// Plans a read of `[offset, offset+len)`: pieces over chunks and in-flight data, plus the
    /// dirty-slot bytes that overlay them. Returns None at/after EOF.
    pub fn plan_read(&self, offset: u64, len: u64) -> Option<ReadPlan> {
        let mut s = self.state.lock();
        if offset >= s.size || len == 0 {
            return None;
        }
        let end = (offset + len).min(s.size);
        let mut pieces = Vec::new();
        if !s.entry.content.is_empty() {
            let c = &s.entry.content;
            let cend = (end as usize).min(c.len());
            if (offset as usize) < cend {
                pieces.push(Piece::Mem {
                    data: Bytes::copy_from_slice(&c[offset as usize..cend]),
                    at: offset,
                });
            }
            if (cend as u64) < end {
                let from = (cend as u64).max(offset);
                pieces.push(Piece::Zero {
                    len: end - from,
                    at: from,
                });
            }
        } else {
            let visible = s.visible();
            let n = s.resolved.len();
            // In-flight data takes part in the ts ordering as chunks numbered after `resolved`,
            // laid over the visible intervals of this read's range only.
            let overlaid;
            let visible: &[chunks::VisibleInterval] = if s.inflight.is_empty() {
                &visible
            } else {
                let mut v = chunks::intervals_in(&visible, offset, end);
                for (k, inf) in s.inflight.iter().enumerate() {
                    let stop = inf.offset + inf.data.len() as u64;
                    if inf.offset < end && stop > offset {
                        chunks::paint(
                            &mut v,
                            chunks::VisibleInterval {
                                start: inf.offset,
                                stop,
                                chunk_index: n + k,
                                offset_in_chunk: 0,
                                modified_ts_ns: inf.ts,
                            },
                        );
                    }
                }
                overlaid = v;
                &overlaid
            };
            for p in chunks::read_plan(visible, offset, end - offset, end) {
                match p {
                    chunks::ReadPiece::Zero { file_offset, len } => pieces.push(Piece::Zero {
                        len,
                        at: file_offset,
                    }),
                    chunks::ReadPiece::Chunk {
                        chunk_index,
                        offset_in_chunk,
                        len,
                        file_offset,
                    } => {
                        if let Some(chunk) = s.resolved.get(chunk_index) {
                            pieces.push(Piece::Chunk {
                                chunk: chunk.clone(),
                                offset_in_chunk,
                                len,
                                at: file_offset,
                            });
                        } else if let Some(inf) = s.inflight.get(chunk_index - n) {
                            let a = (offset_in_chunk as usize).min(inf.data.len());
                            let b = (a + len as usize).min(inf.data.len());
                            pieces.push(Piece::Mem {
                                data: inf.data.slice(a..b),
                                at: file_offset,
                            });
                        }
                    }
                }
            }
        }
        let cs = self.chunk_size as u64;
        let mut overlays = Vec::new();
        let first_slot = offset / cs;
        for (k, sl) in s.slots.range(first_slot..) {
            let base = k * cs;
            if base >= end {
                break;
            }
            for &(a, b) in &sl.ranges {
                let fs = (base + a as u64).max(offset);
                let fe = (base + b as u64).min(end);
                if fs < fe {
                    let lo = (fs - base) as usize;
                    let hi = (fe - base) as usize;
                    overlays.push((fs, Bytes::copy_from_slice(sl.bytes(lo, hi))));
                }
            }
        }
        Some((end, pieces, overlays))
    }

    /// Sorted, merged byte ranges holding data (chunks, uploads in flight, dirty slots), clipped
    /// to the file size; everything else reads as zeros (holes).
    pub fn data_ranges(&self) -> Vec<(u64, u64)> {
        let mut s = self.state.lock();
        let size = s.size;
        let mut r: Vec<(u64, u64)> = Vec::new();
        if !s.entry.content.is_empty() {
            r.push((0, s.entry.content.len() as u64));
        }
        r.extend(s.visible().iter().map(|iv| (iv.start, iv.stop)));
        r.extend(
            s.inflight
                .iter()
                .map(|i| (i.offset, i.offset + i.data.len() as u64)),
        );
        let cs = self.chunk_size as u64;
        for (k, sl) in &s.slots {
            r.extend(
                sl.ranges
                    .iter()
                    .map(|&(a, b)| (k * cs + a as u64, k * cs + b as u64)),
            );
        }
        r.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(r.len());
        for (a, b) in r {
            let (a, b) = (a.min(size), b.min(size));
            if a >= b {
                continue;
            }
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        out
    }

    /// The entry to commit, with a compacted chunk list and current size, and what it covers
    /// (the change sequence number and the uncommitted bytes it takes to the filer).
    pub fn entry_for_commit(&self) -> CommitSnapshot {
        let mut s = self.state.lock();
        let (kept, garbage) = chunks::compact(&s.entry.chunks);
        s.entry.chunks = kept;
        s.drop_ours(&garbage);
        let size = s.size;
        if let Some(a) = s.entry.attributes.as_mut() {
            a.file_size = size;
        }
        CommitSnapshot {
            entry: s.entry.clone(),
            seq: s.seq,
            uncommitted: s.uncommitted,
            folded: Vec::new(),
            manifests: Vec::new(),
            base: s.filer_chunks.clone(),
            ops: std::mem::take(&mut s.ops),
        }
    }

    /// A commit of `snap` did not (or may not) land: see [`FileState::forget_carried`];
    /// its changes are still to be carried, and replayed by a rebase.
    pub fn keep_carried(&self, snap: &CommitSnapshot) {
        let mut s = self.state.lock();
        s.forget_carried(&snap.entry.chunks);
        s.forget_carried(&snap.folded);
        s.ops.merge(snap.ops);
    }

    /// The filer refused a commit of `snap` (its condition did not hold): nothing of it was
    /// stored, so its chunks stay this node's and its changes go back to the file. Returns
    /// the manifest chunks made for it, which nothing references.
    pub fn refused(&self, snap: CommitSnapshot) -> Vec<String> {
        self.state.lock().ops.merge(snap.ops);
        snap.manifests.iter().map(|c| c.file_id.clone()).collect()
    }

    /// Another client changed the file on the filer since this node last knew its entry,
    /// and this node has changes to commit: takes `fresh` (the filer's entry) as the base
    /// and replays this node's changes onto it. Each chunk by where it is: in both lists, as
    /// this node has it (cut by its own truncates already; also a chunk of a commit of ours
    /// that landed unanswered); in the base and gone from one list, gone (dropped by that
    /// side); new in the filer's, the other client's, cut where this node truncated; new
    /// here, ours. Where both wrote, the later chunk stamp wins, as at every read. The file
    /// is at least as long as the other client left it, unless this node truncated it.
    /// `inner`: the data chunks of each manifest chunk of either list, by id.
    pub fn rebase(
        &self,
        fresh: &pb::Entry,
        inner: &std::collections::HashMap<String, Vec<pb::FileChunk>>,
    ) -> Rebased {
        use crate::volume::fid::{chunk_file_id, chunk_file_ids};
        let id = |c: &pb::FileChunk| chunk_file_id(c).unwrap_or_default();
        let mut s = self.state.lock();
        let fresh_ids = chunk_file_ids(&fresh.chunks);
        let mergeable = fresh.content.is_empty()
            && s.entry.content.is_empty()
            && !fresh.is_directory
            && fresh.hard_link_id.is_empty()
            && s.entry.hard_link_id.is_empty();
        if !mergeable {
            s.epoch += 1;
            s.filer_chunks = fresh_ids;
            s.filer_folded.clear();
            return Rebased::Replaces;
        }
        let expand = |list: &[pb::FileChunk]| -> Option<Vec<pb::FileChunk>> {
            let mut out = Vec::with_capacity(list.len());
            for c in list {
                if c.is_chunk_manifest {
                    out.extend(inner.get(&id(c))?.iter().cloned());
                } else {
                    out.push(c.clone());
                }
            }
            Some(out)
        };
        // (a chunk inside a manifest counts as in its list, as does one the filer holds folded)
        let base: HashSet<&str> = s
            .filer_chunks
            .iter()
            .chain(&s.filer_folded)
            .map(String::as_str)
            .collect();
        let folded_in = |list: &[pb::FileChunk]| -> HashSet<String> {
            let mut ids: HashSet<String> = list.iter().map(id).collect();
            for m in list.iter().filter(|c| c.is_chunk_manifest) {
                ids.extend(inner.get(&id(m)).into_iter().flatten().map(id));
            }
            ids
        };
        let here = folded_in(&s.entry.chunks);
        let there = folded_in(&fresh.chunks);
        let theirs: Vec<pb::FileChunk> = fresh
            .chunks
            .iter()
            .filter(|c| {
                let i = id(c);
                !here.contains(&i) && !base.contains(i.as_str())
            })
            .cloned()
            .collect();
        // a chunk both lists have was cut by whichever side truncated it (a record only
        // ever gets shorter): the shorter of the two
        let sizes: std::collections::HashMap<String, u64> = fresh
            .chunks
            .iter()
            .filter(|c| !c.is_chunk_manifest)
            .map(|c| (id(c), c.size))
            .collect();
        let kept: Vec<pb::FileChunk> = s
            .entry
            .chunks
            .iter()
            .filter(|c| {
                let i = id(c);
                there.contains(&i) || !base.contains(i.as_str())
            })
            .map(|c| {
                let mut c = c.clone();
                if let Some(&theirs) = sizes.get(&id(&c)).filter(|_| !c.is_chunk_manifest) {
                    c.size = c.size.min(theirs);
                }
                c
            })
            .collect();
        let cut = s.ops.cut;
        let (mut top, refill) = match cut {
            // a cut through the other client's manifests lists their chunks instead (the
            // next commit folds them again)
            Some(cut) => {
                let Some(theirs) = expand(&theirs) else {
                    return Rebased::Again;
                };
                let refill = cut_start(&theirs, cut).map(|lo| (lo, cut));
                (chunks::truncate(&theirs, cut).0, refill)
            }
            None => (theirs, None),
        };
        top.extend(kept);
        let Some(all) = expand(&top) else {
            return Rebased::Again;
        };
        s.epoch += 1;
        if cut.is_none() {
            s.size = entry_size(fresh).max(s.ops.end);
        }
        s.max_ts = s.max_ts.max(max_ts(&all));
        s.entry.chunks = top;
        s.resolved = Arc::new(all);
        s.visible = None;
        let size = s.size;
        if let Some(a) = s.entry.attributes.as_mut() {
            a.file_size = size;
        }
        s.filer_chunks = fresh_ids;
        s.filer_folded.clear();
        Rebased::Merged { refill }
    }

    /// A commit of `snap` succeeded: clear what it covered, and only that (a write that
    /// finished uploading while the commit was in flight is still to be committed). Returns
    /// the chunks of ours that are now referenced by nothing, to delete.
    pub fn committed(&self, snap: &CommitSnapshot) -> Vec<String> {
        let mut s = self.state.lock();
        if s.seq == snap.seq && s.slots.is_empty() && s.inflight.is_empty() {
            s.meta_dirty = false;
        }
        if s.deferred_attrs
            .as_ref()
            .is_some_and(|(_, seq)| *seq <= snap.seq)
        {
            s.deferred_attrs = None;
        }
        s.uncommitted = s.uncommitted.saturating_sub(snap.uncommitted);
        s.pending_create = false;
        s.filer_chunks = crate::volume::fid::chunk_file_ids(&snap.entry.chunks);
        s.filer_folded.clear();
        let carried: HashSet<&str> = snap
            .entry
            .chunks
            .iter()
            .chain(&snap.folded)
            .map(|c| c.file_id.as_str())
            .collect();
        // a chunk the commit carried is the filer's now (it deletes it when it drops it)
        s.ours.retain(|f| !carried.contains(f.as_str()));
        let garbage = std::mem::take(&mut s.garbage);
        let mut delete = Vec::new();
        for f in garbage {
            if s.ours.remove(&f) {
                delete.push(f);
            }
        }
        delete
    }
}

/// What [`OpenFile::rebase`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Rebased {
    /// This node's changes now lie over the other client's entry; `refill`: a range
    /// `[start, cut)` of it that ends in the middle of one of its chunks, whose bytes must
    /// be written again (a chunk recorded shorter than its needle is unreadable to the
    /// filer's HTTP and S3 readers).
    Merged { refill: Option<(u64, u64)> },
    /// Not mergeable: this node's commit replaces the other client's entry.
    Replaces,
    /// Nothing done: a manifest chunk of either list is missing from `inner` (one of this
    /// node's was made meanwhile); to be tried again.
    Again,
}

/// What one commit sends and covers.
pub struct CommitSnapshot {
    pub entry: pb::Entry,
    pub seq: u64,
    pub uncommitted: u64,
    /// Data chunks of the entry folded into `manifests` for this commit (carried inside them).
    pub folded: Vec<pb::FileChunk>,
    /// Manifest chunks made for this commit.
    pub manifests: Vec<pb::FileChunk>,
    /// The ids of the filer's chunks `entry` was built on (what the commit's condition asks).
    pub base: Vec<String>,
    /// This node's data changes the commit carries (see [`DataOps`]).
    pub ops: DataOps,
}

impl OpenFile {
    /// A commit folded the data chunks `folded` of `entry.chunks` into `manifests`: the entry
    /// keeps the manifests from now on, so later commits send only the newer chunks. If the
    /// list lost any of them meanwhile (a truncate), it stays as it is: the next commit sends
    /// the data chunks, and the filer deletes these manifests (not their chunks, still listed).
    pub fn manifestized(&self, folded: &[pb::FileChunk], manifests: Vec<pb::FileChunk>) -> bool {
        fn key(c: &pb::FileChunk) -> (&str, i64, u64, i64) {
            (&c.file_id, c.offset, c.size, c.modified_ts_ns)
        }
        let want: HashSet<_> = folded.iter().map(key).collect();
        let mut s = self.state.lock();
        let present = s
            .entry
            .chunks
            .iter()
            .filter(|c| !c.is_chunk_manifest && want.contains(&key(c)))
            .count();
        if present != want.len() {
            return false;
        }
        s.entry
            .chunks
            .retain(|c| c.is_chunk_manifest || !want.contains(&key(c)));
        s.entry.chunks.extend(manifests);
        true
    }
}

/// Start of the earliest data chunk that a truncation to `size` cuts in the middle.
pub fn cut_start(chunks: &[pb::FileChunk], size: u64) -> Option<u64> {
    chunks
        .iter()
        .filter(|c| !c.is_chunk_manifest && c.offset >= 0)
        .map(|c| (c.offset as u64, c.offset as u64 + c.size))
        .filter(|(start, end)| *start < size && size < *end)
        .map(|(start, _)| start)
        .min()
}

fn write_slots(s: &mut FileState, cs: u64, offset: u64, buf: &[u8], budget: &Arc<MemoryBudget>) {
    let stream = s.syncs_often(cs);
    let mut pos = 0usize;
    while pos < buf.len() {
        let off = offset + pos as u64;
        let k = off / cs;
        let in_slot = (off % cs) as usize;
        let n = ((cs as usize) - in_slot).min(buf.len() - pos);
        s.slots.entry(k).or_default().write(
            in_slot,
            &buf[pos..pos + n],
            cs as usize,
            budget,
            stream,
        );
        pos += n;
    }
}

fn seal_slot(s: &mut FileState, k: u64, cs: u64, settle: &Arc<Settle>) -> Vec<SealedRun> {
    let Some(sl) = s.slots.remove(&k) else {
        return Vec::new();
    };
    let slot_base = sl.base;
    let data = Bytes::from(sl.data);
    let charge = sl.charge.map(Arc::new);
    // the stream hashed exactly the one range if it began where the range begins
    let mut md5 = match (sl.md5, sl.ranges.as_slice()) {
        (Some(mut h), [(a, b)]) if h.start == *a => {
            h.stream.take().filter(|m| m.pushed() == (b - a) as u64)
        }
        _ => None,
    };
    let mut out = Vec::new();
    for (a, b) in sl.ranges {
        let id = s.next_id;
        s.next_id += 1;
        let run = SealedRun {
            id,
            offset: k * cs + a as u64,
            data: data.slice(a - slot_base..b - slot_base),
            ts: s.next_run_ts(),
            md5: md5.take(),
            settle: Some(settle.clone()),
        };
        s.inflight.push(Inflight {
            id,
            offset: run.offset,
            data: run.data.clone(),
            ts: run.ts,
            failed: false,
            charge: charge.clone(),
        });
        out.push(run);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(cs: usize) -> OpenFile {
        let e = pb::Entry {
            name: "f".into(),
            attributes: Some(pb::FuseAttributes::default()),
            ..Default::default()
        };
        OpenFile::new(5, "/d".into(), e, cs, 4)
    }

    /// Writes into a slot at random offsets (appends, gaps, overwrites, writes that run
    /// past the end) hold exactly the bytes a plain buffer would, with zeros in the gaps, and
    /// the slot's ranges are exactly the runs of written bytes (what a seal uploads).
    #[test]
    fn slot_writes_match_a_plain_buffer() {
        let budget = MemoryBudget::new(u64::MAX);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for round in 0..200 {
            let mut slot = Slot::default();
            let mut model: Vec<u8> = Vec::new();
            let mut written: Vec<bool> = Vec::new();
            for i in 0..20 {
                if next(8) == 0 {
                    // a cut anywhere, also below the first write
                    let len = next(model.len() as u64 + 1) as usize;
                    slot.truncate(len);
                    model.truncate(len);
                    written.truncate(len);
                }
                let at = next(4096) as usize;
                let len = if next(4) == 0 {
                    65536
                } else {
                    1 + next(300) as usize
                };
                let buf: Vec<u8> = (0..len).map(|k| (round + i + k) as u8 | 1).collect();
                slot.write(at, &buf, 1 << 20, &budget, false);
                if model.len() < at + len {
                    model.resize(at + len, 0);
                }
                model[at..at + len].copy_from_slice(&buf);
                assert!(slot.end() <= model.len() && slot.base <= at);
                for &(a, b) in &slot.ranges {
                    assert!(
                        slot.bytes(a, b) == &model[a..b],
                        "round {round}, write {i} at {at}+{len}: range {a}..{b}"
                    );
                }
                written.resize(model.len(), false);
                written[at..at + len].fill(true);
                // the ranges: exactly the maximal runs of written bytes
                let mut runs = Vec::new();
                let mut k = 0;
                while k < written.len() {
                    if written[k] {
                        let s = k;
                        while k < written.len() && written[k] {
                            k += 1;
                        }
                        runs.push((s, k));
                    } else {
                        k += 1;
                    }
                }
                assert_eq!(slot.ranges, runs, "round {round}, write {i} at {at}+{len}");
                assert_eq!(slot.written(), written.iter().filter(|w| **w).count());
            }
        }
    }

    #[tokio::test]
    async fn truncate_waits_for_a_run_in_flight_past_the_new_size() {
        let f = Arc::new(file(4));
        // a run sealed by a racing write is uploading when the truncate comes
        let run = f.write(0, b"0123");
        assert_eq!(run.len(), 1);
        let g = f.clone();
        let t = tokio::spawn(async move { g.truncate(1).await });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!t.is_finished(), "the truncate must wait for the upload");
        f.upload_done(
            run[0].id,
            Ok(pb::FileChunk {
                file_id: "3,01".into(),
                size: 4,
                ..Default::default()
            }),
        );
        t.await.unwrap();
        // the chunk that landed is cut, so its bytes past 1 never come back
        let snap = f.entry_for_commit();
        assert_eq!(chunks::file_size(&snap.entry), 1);
        assert_eq!(chunks::chunks_end(&snap.entry.chunks), 1);
    }

    fn read_all(f: &OpenFile, off: u64, len: u64) -> Vec<u8> {
        let (end, pieces, overlays) = f.plan_read(off, len).unwrap();
        let mut out = vec![0u8; (end - off) as usize];
        for p in pieces {
            match p {
                Piece::Mem { data, at } => {
                    out[(at - off) as usize..][..data.len()].copy_from_slice(&data)
                }
                Piece::Zero { .. } => {}
                Piece::Chunk { .. } => panic!("no chunks in this test"),
            }
        }
        for (at, d) in overlays {
            out[(at - off) as usize..][..d.len()].copy_from_slice(&d);
        }
        out
    }

    #[test]
    fn full_slots_seal_and_inflight_is_readable() {
        let f = file(8);
        assert!(f.write(0, b"0123").is_empty());
        let sealed = f.write(4, b"4567AB");
        assert_eq!(sealed.len(), 1);
        assert_eq!(&sealed[0].data[..], b"01234567");
        assert_eq!(read_all(&f, 0, 100), b"01234567AB");
        // overwrite in-flight bytes: the dirty slot wins
        f.write(2, b"xy");
        assert_eq!(read_all(&f, 0, 100), b"01xy4567AB");
    }

    #[test]
    fn inline_content_survives_partial_overwrite() {
        let mut f = file(16);
        f.state.get_mut().entry.content = b"0123456789".to_vec();
        f.state.get_mut().size = 10;
        f.write(5, b"AB");
        assert_eq!(read_all(&f, 0, 100), b"01234AB789");
    }

    #[test]
    fn truncate_drops_dirty_tail() {
        let f = file(8);
        f.write(0, b"0123456");
        futures::executor::block_on(f.truncate(3));
        assert_eq!(read_all(&f, 0, 100), b"012");
        futures::executor::block_on(f.truncate(5));
        assert_eq!(read_all(&f, 0, 100), b"012\0\0");
    }

    #[test]
    fn data_ranges_merge_and_clip() {
        let f = file(8);
        f.write(20, b"xy");
        f.write(2, b"abcdefgh"); // spans slots 0 and 1
        f.write(10, b"z");
        assert_eq!(f.data_ranges(), vec![(2, 11), (20, 22)]);
        futures::executor::block_on(f.truncate(21));
        assert_eq!(f.data_ranges(), vec![(2, 11), (20, 21)]);
    }

    #[test]
    fn cut_start_finds_the_earliest_cut_chunk() {
        let c = |offset: i64, size: u64| pb::FileChunk {
            offset,
            size,
            ..Default::default()
        };
        let list = [c(0, 100), c(50, 100), c(150, 10)];
        assert_eq!(cut_start(&list, 120), Some(50));
        assert_eq!(cut_start(&list, 60), Some(0));
        assert_eq!(cut_start(&list, 150), None);
        assert_eq!(cut_start(&list, 0), None);
        assert_eq!(cut_start(&list, 500), None);
    }

    fn chunk(id: &str, size: u64) -> pb::FileChunk {
        pb::FileChunk {
            file_id: id.into(),
            size,
            ..Default::default()
        }
    }

    /// (chunk id or "mem:<bytes>" or "zero", at, len) per piece.
    fn shape(f: &OpenFile, off: u64, len: u64) -> Vec<(String, u64, u64)> {
        let (_, pieces, _) = f.plan_read(off, len).unwrap();
        pieces
            .into_iter()
            .map(|p| match p {
                Piece::Chunk { chunk, len, at, .. } => (chunk.file_id, at, len),
                Piece::Mem { data, at } => (
                    format!("mem:{}", String::from_utf8_lossy(&data)),
                    at,
                    data.len() as u64,
                ),
                Piece::Zero { len, at } => ("zero".into(), at, len),
            })
            .collect()
    }

    #[test]
    fn uploads_update_the_chunk_list_and_intervals_in_place() {
        let f = file(4);
        let a = f.write(0, b"aaaa");
        f.upload_done(a[0].id, Ok(chunk("3,01", 4)));
        assert_eq!(shape(&f, 0, 4), vec![("3,01".into(), 0, 4)]);
        let (list, ivs) = {
            let s = f.state.lock();
            (
                Arc::as_ptr(&s.resolved),
                Arc::as_ptr(s.visible.as_ref().unwrap()),
            )
        };
        let b = f.write(4, b"bbbb");
        // a read with an upload in flight uses (and keeps) the intervals built before
        assert_eq!(
            shape(&f, 0, 8),
            vec![("3,01".into(), 0, 4), ("mem:bbbb".into(), 4, 4)]
        );
        f.upload_done(b[0].id, Ok(chunk("3,02", 4)));
        let s = f.state.lock();
        assert_eq!(Arc::as_ptr(&s.resolved), list, "chunk list copied");
        let v = s.visible.as_ref().expect("intervals dropped");
        assert_eq!(Arc::as_ptr(v), ivs, "intervals copied");
        assert_eq!(**v, chunks::visible_intervals(&s.resolved));
    }

    #[test]
    fn reads_with_uploads_in_flight_keep_the_intervals() {
        let f = file(4);
        let a = f.write(0, b"aaaa");
        f.upload_done(a[0].id, Ok(chunk("3,01", 4)));
        let _b = f.write(4, b"bbbb");
        assert!(f.state.lock().visible.is_none());
        // built once for the committed chunks, the upload laid over this read's range only
        assert_eq!(
            shape(&f, 0, 8),
            vec![("3,01".into(), 0, 4), ("mem:bbbb".into(), 4, 4)]
        );
        let s = f.state.lock();
        assert_eq!(
            s.visible.as_deref().map(|v| v.as_slice()),
            Some(chunks::visible_intervals(&s.resolved).as_slice())
        );
    }

    #[test]
    fn reads_order_uploads_in_flight_and_chunks_by_ts() {
        let f = file(4);
        let x = f.write(0, b"xxxx");
        let y = f.write(0, b"yyyy");
        let z = f.write(8, b"zzzz");
        assert_eq!(shape(&f, 0, 12)[0], ("mem:yyyy".into(), 0, 4));
        // the newer run finishes first: the older one still in flight must not hide it
        f.upload_done(y[0].id, Ok(chunk("3,0y", 4)));
        assert_eq!(
            shape(&f, 0, 12),
            vec![
                ("3,0y".into(), 0, 4),
                ("zero".into(), 4, 4),
                ("mem:zzzz".into(), 8, 4)
            ]
        );
        f.upload_done(x[0].id, Ok(chunk("3,0x", 4)));
        f.upload_done(z[0].id, Ok(chunk("3,0z", 4)));
        assert_eq!(
            shape(&f, 2, 8),
            vec![
                ("3,0y".into(), 2, 2),
                ("zero".into(), 4, 4),
                ("3,0z".into(), 8, 2)
            ]
        );
    }

    /// A file whose first three 4-byte chunks are in a manifest, the fourth not.
    fn manifest_file() -> (OpenFile, Vec<pb::FileChunk>) {
        let data: Vec<pb::FileChunk> = (0..4)
            .map(|i| pb::FileChunk {
                offset: 4 * i,
                modified_ts_ns: 1 + i,
                ..chunk(&format!("3,0{i}"), 4)
            })
            .collect();
        let m = pb::FileChunk {
            is_chunk_manifest: true,
            offset: 0,
            ..chunk("3,0m", 12)
        };
        let e = pb::Entry {
            name: "f".into(),
            attributes: Some(pb::FuseAttributes {
                file_size: 16,
                ..Default::default()
            }),
            chunks: vec![m, data[3].clone()],
            ..Default::default()
        };
        let f = OpenFile::new(5, "/d".into(), e, 4, 4);
        f.state.lock().resolved = Arc::new(data.clone());
        (f, data)
    }

    #[test]
    fn truncate_through_a_manifest_commits_its_chunks_cut() {
        let (f, _) = manifest_file();
        futures::executor::block_on(f.truncate(6));
        {
            let s = f.state.lock();
            assert!(
                !chunks::has_manifest(&s.entry.chunks),
                "{:?}",
                s.entry.chunks
            );
            assert_eq!(chunks::chunks_end(&s.entry.chunks), 6);
            assert_eq!(*s.resolved, s.entry.chunks);
        }
        futures::executor::block_on(f.truncate(16));
        assert_eq!(
            shape(&f, 0, 16),
            vec![
                ("3,00".into(), 0, 4),
                ("3,01".into(), 4, 2),
                ("zero".into(), 6, 10)
            ]
        );
        assert_eq!(chunks::chunks_end(&f.entry_for_commit().entry.chunks), 6);
    }

    #[test]
    fn truncate_past_a_manifest_keeps_it() {
        let (f, _) = manifest_file();
        futures::executor::block_on(f.truncate(13));
        let s = f.state.lock();
        assert_eq!(s.entry.chunks.len(), 2);
        assert!(s.entry.chunks[0].is_chunk_manifest);
        assert_eq!(s.entry.chunks[1].size, 1);
    }

    #[test]
    fn manifestized_swaps_folded_chunks_unless_the_list_changed() {
        let (f, data) = manifest_file();
        {
            let mut s = f.state.lock();
            s.entry.chunks = data.clone();
        }
        let m = pb::FileChunk {
            is_chunk_manifest: true,
            ..chunk("3,0n", 8)
        };
        assert!(f.manifestized(&data[..2], vec![m.clone()]));
        assert_eq!(
            f.state.lock().entry.chunks,
            vec![data[2].clone(), data[3].clone(), m.clone()]
        );
        // a truncate meanwhile cut a folded chunk: the fold is dropped
        futures::executor::block_on(f.truncate(10));
        let before = f.state.lock().entry.chunks.clone();
        assert!(!f.manifestized(&data[2..], vec![m]));
        assert_eq!(f.state.lock().entry.chunks, before);
    }

    #[test]
    fn a_commit_racing_an_upload_leaves_the_file_dirty() {
        let f = file(4);
        let sealed = f.write(0, b"0123");
        assert_eq!(sealed.len(), 1);
        // the commit's snapshot is taken while the chunk is still uploading ...
        let snap = f.entry_for_commit();
        assert!(snap.entry.chunks.is_empty());
        // ... and the upload finishes before the filer answers the commit
        f.upload_done(
            sealed[0].id,
            Ok(pb::FileChunk {
                file_id: "3,01".into(),
                size: 4,
                ..Default::default()
            }),
        );
        f.committed(&snap);
        let s = f.state.lock();
        assert!(
            s.meta_dirty,
            "the chunk that missed the commit must still be committed"
        );
        assert!(!s.is_clean());
    }

    #[test]
    fn runs_sort_after_chunks_from_a_clock_ahead_of_ours() {
        let ahead = next_ts_ns() + 3_600_000_000_000;
        let e = pb::Entry {
            name: "f".into(),
            attributes: Some(pb::FuseAttributes {
                file_size: 8,
                ..Default::default()
            }),
            chunks: vec![pb::FileChunk {
                file_id: "3,02".into(),
                size: 8,
                modified_ts_ns: ahead,
                ..Default::default()
            }],
            ..Default::default()
        };
        let f = OpenFile::new(5, "/d".into(), e, 8, 4);
        let sealed = f.write(0, b"newbytes");
        assert_eq!(sealed.len(), 1);
        assert!(sealed[0].ts > ahead, "the new run must hide the old chunk");
        let again = f.write(0, b"evennewr");
        assert!(again[0].ts > sealed[0].ts);
    }

    #[test]
    fn ts_strictly_increases() {
        let a = next_ts_ns();
        let b = next_ts_ns();
        assert!(b > a);
    }
}
