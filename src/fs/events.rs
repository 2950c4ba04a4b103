//! Coherence with other clients: the filer's metadata events applied to the caches and
//! open files, and the changes this node made lately (an event about them may be older).
//!
//! Over 800 lines: half is its unit tests.

use super::changes::NameChanges;
use super::file::{FileState, OpenFile};
use super::inode::join;
use super::meta::Cached;
use super::{errno, Fs, Result};
use crate::filer::FilerError;
use crate::pb::filer as pb;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long another client's event about a name we changed makes us re-read its directory
/// (far beyond the subscription's delivery delay; a longer window costs only listings).
const LOCAL_CHANGE_WINDOW: Duration = Duration::from_secs(30);
/// Bound on the names remembered for that (about 100 B each).
const LOCAL_CHANGES_MAX: usize = 65_536;

/// A change of a filer entry or name in flight (see [`Fs::note_local`]): the open file at
/// it, and the name, stamped again as changed when the change is done.
pub(super) struct LocalChange {
    of: Option<Arc<OpenFile>>,
    changes: Arc<NameChanges>,
    path: String,
}

impl Drop for LocalChange {
    fn drop(&mut self) {
        if let Some(of) = &self.of {
            let mut s = of.state.lock();
            s.local_inflight -= 1;
            s.changed_here();
        }
        // a listing taken while the change was in flight may hold the entry before it
        self.changes.stamp(std::mem::take(&mut self.path));
    }
}

/// What identifies a file across renames where the filer keeps no inode: its node id is
/// then derived from the path it was first seen at, which a rename changes.
#[derive(Debug, Default)]
pub(super) struct Identity {
    inode: u64,
    crtime: i64,
    hard_link_id: Vec<u8>,
}

impl Identity {
    pub(super) fn of(e: &pb::Entry) -> Self {
        let a = e.attributes.as_ref();
        Identity {
            inode: a.map(|a| a.inode).unwrap_or(0),
            crtime: a.map(|a| a.crtime).unwrap_or(0),
            hard_link_id: e.hard_link_id.clone(),
        }
    }

    /// `e` has no inode either, and the same creation time and hard-link id.
    pub(super) fn is_inodeless_match(&self, e: &pb::Entry) -> bool {
        let other = Identity::of(e);
        self.inode == 0
            && other.inode == 0
            && self.crtime != 0
            && (self.crtime, &self.hard_link_id) == (other.crtime, &other.hard_link_id)
    }
}

/// Entries numbered alike by the filer, born in the same second (nanoseconds unknown, as
/// for uploads), that are surely two files: no chunk in common (versions of one file keep
/// the chunks they do not overwrite), or, both without chunks, other inline content.
/// Where creation times cannot tell two such files apart, their data can.
fn other_upload(a: &pb::Entry, b: &pb::Entry) -> bool {
    let fids = |e: &pb::Entry| {
        e.chunks
            .iter()
            .filter_map(|c| crate::volume::fid::chunk_fid(c).ok())
            .collect::<std::collections::HashSet<_>>()
    };
    let data_differs = match (fids(a), fids(b)) {
        (fa, fb) if fa.is_empty() && fb.is_empty() => a.content != b.content,
        (fa, fb) if !fa.is_empty() && !fb.is_empty() => fa.is_disjoint(&fb),
        // one chunked, one inline: a file rewritten, or two files; not sure
        _ => false,
    };
    let (ia, ib) = (a.attributes.as_ref(), b.attributes.as_ref());
    let number = |x: Option<&pb::FuseAttributes>| x.map(|x| (x.inode, x.crtime, x.crtime_ns));
    number(ia) == number(ib)
        && number(ia).is_some_and(|(ino, _, ns)| ino != 0 && ns == 0)
        && a.hard_link_id.is_empty()
        && data_differs
}

/// An open file's name `path` now leads to another file (one moved over it). A hard link
/// with other names (`linked`) lives on: one less link, and, if `path` was its own name, it
/// moves to another of `names`, the names known here to lead to it (none: unlinked).
/// Otherwise unlinked.
/// A name known here may be gone on the filer already (removed elsewhere, its event not
/// here yet): the next commit first asks the filer (a removal is then believed), so it
/// never brings that name back.
pub(super) fn name_taken(s: &mut FileState, path: &str, linked: bool, names: Vec<String>) {
    s.epoch += 1;
    if !linked {
        s.unlinked = true;
        return;
    }
    s.entry.hard_link_counter = (s.entry.hard_link_counter - 1).max(1);
    if join(&s.dir, &s.entry.name) == path {
        match names.into_iter().find(|p| p != path) {
            Some(p) => {
                (s.dir, s.entry.name) = super::inode::split(&p);
                s.name_doubt = true;
                s.removal_doubt = true;
            }
            None => s.unlinked = true,
        }
    }
}

/// The filer confirmed that the open file's name is gone (an event said so): an unlinked
/// file, or a hard-linked one whose link group lives on at `moved_to` (path, link count),
/// found by [`Fs::other_link`] (also for a group an event showed the file in, which its
/// commit joins). A file whose own entry is linked keeps its name with no other name known.
/// Returns the name moved to, which the caller makes one of the node's names (see
/// [`Fs::moved_by_link`]).
#[must_use]
pub(super) fn name_gone(s: &mut FileState, moved_to: Option<(String, i32)>) -> Option<String> {
    let mut moved = None;
    match moved_to {
        Some((p, count)) => {
            (s.dir, s.entry.name) = super::inode::split(&p);
            if !s.entry.hard_link_id.is_empty() {
                s.entry.hard_link_counter = count;
            }
            moved = Some(p);
        }
        None if super::attr::has_other_links(&s.entry) => {}
        _ => s.unlinked = true,
    }
    s.removal_doubt = false;
    s.epoch += 1;
    moved
}

impl Fs {
    /// After [`name_gone`] moved open file `ino` to `path`, another name of its link group:
    /// the node's names here include it (lookups by it, and later removals, find the node).
    pub(super) fn moved_by_link(&self, ino: u64, path: Option<String>) {
        if let Some(p) = path {
            self.inodes.add_link_name(ino, &p);
        }
    }

    /// The removal of `path`, a name of open file `s` (node `ino`) in a link group, with no
    /// other name of it known here but names its events showed: the re-read that confirms
    /// one with the filer decides where the file lives on (else it is unlinked at once).
    fn other_name_to_confirm(&self, s: &FileState, ino: u64, path: &str, old: &pb::Entry) -> bool {
        super::attr::has_other_links(old)
            && !s.link_names.is_empty()
            && self.inodes.live_names(ino).iter().all(|p| p == path)
    }

    /// Another name of hard-linked file `of`, for its `removed` one: a name known here for
    /// it that the filer confirms leads to its link group now, with the group's link count
    /// there (a name known here may be stale: removed since, or another file's).
    pub(super) async fn other_link(&self, of: &OpenFile, removed: &str) -> Option<(String, i32)> {
        let (group, names) = {
            let s = of.state.lock();
            (s.link_group(), s.link_names.clone())
        };
        if group.is_empty() {
            return None;
        }
        // the node's names first, then the events' names, newest first
        let mut known = self.inodes.live_names(of.ino);
        for p in names.into_iter().rev() {
            if !known.contains(&p) {
                known.push(p);
            }
        }
        for p in known {
            if p == removed {
                continue;
            }
            let (d, n) = super::inode::split(&p);
            self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
            match self.filer.lookup_entry(&d, &n).await {
                Ok(e) if e.hard_link_id == group && !e.is_directory => {
                    return Some((p, e.hard_link_counter))
                }
                _ => continue,
            }
        }
        None
    }

    /// Applies another client's change. An event about a name this node changed lately may
    /// be older than our change (the filer sends us only others' events, in its order, so it
    /// can arrive after ours took effect here): the cached listing would then bring back a
    /// name we removed or an entry we replaced. So after such an event the directory's
    /// listing is dropped and read from the filer again on the next lookup.
    ///
    /// An open file is the exception: its entry is not dropped and read again on the next
    /// lookup, so for a name changed here lately the event's entry is not taken; the entry is
    /// read from the filer instead (in the background), which is never older than our change.
    pub fn apply_event(self: &Arc<Self>, ev: &pb::SubscribeMetadataResponse) {
        let Some(n) = ev.event_notification.as_ref() else {
            for of in self.apply_event_now(ev) {
                self.spawn_resync(of);
            }
            return;
        };
        let dir = ev.directory.as_str();
        let ndir = if n.new_parent_path.is_empty() {
            dir
        } else {
            n.new_parent_path.as_str()
        };
        let touched: Vec<(&str, &str)> = n
            .old_entry
            .iter()
            .map(|o| (dir, o.name.as_str()))
            .chain(n.new_entry.iter().map(|e| (ndir, e.name.as_str())))
            .collect();
        // first: a readdirplus deciding from here on doubts the listing's entry, one that
        // decided before takes its reply back (see `Fs::readdirplus`)
        for (d, name) in &touched {
            self.name_changes.stamp(join(d, name));
        }
        for of in self.apply_event_now(ev) {
            self.spawn_resync(of);
        }
        // and again: one that decided in between may have read the cache before the event
        for (d, name) in &touched {
            self.name_changes.stamp(join(d, name));
        }
        for (d, name) in touched {
            if self.changed_here_lately(d, name) {
                self.meta.invalidate_dir(d, false);
                if let (Some(nt), Some(pino)) = (self.notifier(), self.inodes.ino_of(d)) {
                    nt.inval_entry(pino, name);
                }
            }
        }
    }

    /// Notes a change of `dir/name` made by this node (see [`Self::apply_event`]).
    /// The returned guard marks an open file at that name as changing here until it drops
    /// (hold it across the filer call; see [`Self::resync_open_file`]).
    #[must_use]
    /// `ino`: the file changed, when known (the name may no longer lead to it here).
    pub(super) fn note_local(&self, dir: &str, name: &str, ino: Option<u64>) -> LocalChange {
        let of = ino.and_then(|ino| self.open_file(ino)).or_else(|| {
            let ino = self.inodes.ino_of(&join(dir, name))?;
            self.open_file(ino)
        });
        if let Some(of) = &of {
            let mut s = of.state.lock();
            s.local_inflight += 1;
            s.changed_here();
        }
        self.remember_local(dir, name);
        LocalChange {
            of,
            changes: self.name_changes.clone(),
            path: join(dir, name),
        }
    }

    pub(super) fn remember_local(&self, dir: &str, name: &str) {
        self.name_changes.stamp(join(dir, name));
        let mut m = self.local_changes.lock();
        if m.len() >= LOCAL_CHANGES_MAX {
            m.retain(|_, t| t.elapsed() < LOCAL_CHANGE_WINDOW);
            if m.len() >= LOCAL_CHANGES_MAX {
                // a burst beyond the bound: listings are trusted as events come again
                m.clear();
            }
        }
        m.insert(join(dir, name), Instant::now());
    }

    pub(super) fn changed_here_lately(&self, dir: &str, name: &str) -> bool {
        self.local_changes
            .lock()
            .get(&join(dir, name))
            .is_some_and(|t| t.elapsed() < LOCAL_CHANGE_WINDOW)
    }

    /// An event about this open file may be older than this node's own change of it.
    fn doubtful(&self, s: &FileState, dir: &str, name: &str) -> bool {
        s.changed_here_within(LOCAL_CHANGE_WINDOW) || self.changed_here_lately(dir, name)
    }

    /// Re-reads the entry of an open file that events of doubtful order were about, until no
    /// such event is waiting or the file is closed. The answer is taken only if the file
    /// did not move on while it was asked for (a change of ours in flight or done, a newer
    /// event applied); otherwise it is asked again, since either may be the newer. A removal
    /// is believed only if the filer no longer has the file under its name.
    async fn resync_open_file(self: Arc<Self>, of: Arc<OpenFile>) {
        /// Should the task end other than by its own return (a panic), a later doubtful
        /// event still starts a new one.
        struct Running(Option<Arc<OpenFile>>);
        impl Drop for Running {
            fn drop(&mut self) {
                if let Some(of) = self.0.take() {
                    of.state.lock().resync = Default::default();
                }
            }
        }
        let mut running = Running(Some(of.clone()));
        let mut attempt = 0;
        let mut pauses = crate::retry::STORAGE.pauses();
        loop {
            // the files lock is never taken under a file's state lock (the other order is used)
            let open = self.open_file(of.ino).is_some_and(|o| Arc::ptr_eq(&o, &of));
            let (dir, name, epoch, deleted, known) = {
                let mut s = of.state.lock();
                // an unmounted volume's files stay in the table: `closed` ends the task
                if !s.resync.wanted || !open || self.closed.load(Ordering::Relaxed) {
                    s.resync = Default::default();
                    running.0 = None;
                    return;
                }
                if s.local_inflight > 0 {
                    (String::new(), String::new(), 0, false, Identity::default())
                // wait below
                } else {
                    s.resync.wanted = false;
                    let deleted = std::mem::take(&mut s.resync.deleted);
                    let known = Identity::of(&s.entry);
                    (s.dir.clone(), s.entry.name.clone(), s.epoch, deleted, known)
                }
            };
            if name.is_empty() {
                tokio::time::sleep(crate::retry::STORAGE.first).await;
                continue;
            }
            let path = join(&dir, &name);
            let (answer, moved_to) = match self.rereads.acquire().await {
                Ok(_permit) => {
                    let answer = self.look_again(&path, &dir, &name, of.ino, &known).await;
                    // a hard-linked file's removed name: where its link group lives on
                    let moved_to = match &answer {
                        Ok(None) if deleted => self.other_link(&of, &path).await,
                        _ => None,
                    };
                    (answer, moved_to)
                }
                Err(_) => return,
            };
            // Ok(true): the entry was replaced; Err: ask again
            let mut moved = None;
            let outcome: std::result::Result<bool, Option<super::FsError>> = {
                let mut s = of.state.lock();
                let moved_on = s.epoch != epoch
                    || s.local_inflight > 0
                    || (s.dir.as_str(), s.entry.name.as_str()) != (&dir, &name);
                match answer {
                    Ok(_) | Err(_) if moved_on => Err(None),
                    Err(e) => Err(Some(e)),
                    Ok(Some((e, resolved))) => {
                        // found under its name, with nothing of ours or of events since
                        s.name_doubt = false;
                        s.removal_doubt = false;
                        let same = s.entry == e && *s.resolved == resolved;
                        if s.is_clean() && !same {
                            s.replace_entry(e, resolved);
                            Ok(true)
                        } else {
                            // with data to commit it keeps its entry, but not the news that
                            // another node made it a hard link (its commit joins the group)
                            if !e.hard_link_id.is_empty() && e.hard_link_id != s.entry.hard_link_id
                            {
                                s.saw_link_group(&e);
                            }
                            Ok(false)
                        }
                    }
                    Ok(None) => {
                        // a file whose create is still deferred was never the filer's to remove
                        if deleted && !s.pending_create {
                            moved = name_gone(&mut s, moved_to);
                        } else if deleted {
                            s.removal_doubt = false;
                        }
                        Ok(false)
                    }
                }
            };
            self.moved_by_link(of.ino, moved);
            match outcome {
                Ok(replaced) => {
                    attempt = 0;
                    pauses = crate::retry::STORAGE.pauses();
                    if replaced {
                        self.bump_content_gen(of.ino);
                        if let Some(nt) = self.notifier() {
                            nt.inval_inode(of.ino);
                        }
                    }
                }
                Err(failed) => {
                    {
                        let mut s = of.state.lock();
                        s.resync.wanted = true;
                        s.resync.deleted |= deleted;
                    }
                    if let Some(e) = &failed {
                        tracing::warn!(path, error = %e, attempt, "re-reading an open file's entry after an event failed; retrying");
                    }
                    // a pause before asking again, also when the file moved on meanwhile
                    tokio::time::sleep(pauses.next_pause()).await;
                    attempt = (attempt + 1).min(5);
                }
            }
        }
    }

    /// The filer's entry of file `ino` at `dir/name` with its chunks resolved, or None if the
    /// name is gone or is another file now.
    pub(super) async fn look_again(
        &self,
        path: &str,
        dir: &str,
        name: &str,
        ino: u64,
        known: &Identity,
    ) -> Result<Option<(pb::Entry, Vec<pb::FileChunk>)>> {
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let e = match self.filer.lookup_entry(dir, name).await {
            Ok(e) if self.is_open_file(path, &e, ino, known) => e,
            Ok(_) | Err(FilerError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let resolved = if crate::chunks::has_manifest(&e.chunks) {
            crate::chunks::expand_manifests(&e.chunks, self.store.as_ref())
                .await
                .map_err(|err| errno(libc::EIO, format!("{path}: manifests: {err}")))?
        } else {
            e.chunks.clone()
        };
        Ok(Some((e, resolved)))
    }

    /// Another client removed `dir`/`old.name`, the name of node `ino`: an open file there
    /// whose removal may be older than our change of it, or that may live on under a name
    /// the filer must confirm, is re-read (pushed to `doubtful`); otherwise it is unlinked,
    /// or moves to another name of its link group known here.
    fn removed_by_event(
        &self,
        dir: &str,
        old: &pb::Entry,
        ino: u64,
        doubtful: &mut Vec<Arc<OpenFile>>,
    ) {
        let path = join(dir, &old.name);
        let mut doubt = false;
        if let Some(of) = self.open_file(ino) {
            let mut s = of.state.lock();
            doubt = self.doubtful(&s, dir, &old.name)
                || self.other_name_to_confirm(&s, ino, &path, old);
            if doubt && s.want_resync(true) {
                doubtful.push(of.clone());
            }
        }
        self.name_removed(dir, &old.name, old, doubt);
        // other names of a hard-linked file now have one link less
        if let Some(nt) = self.notifier() {
            nt.inval_inode(ino);
        }
    }

    /// Applies `ev`; returns the open files whose entry must be read again from the filer.
    fn apply_event_now(&self, ev: &pb::SubscribeMetadataResponse) -> Vec<Arc<OpenFile>> {
        let mut doubtful = Vec::new();
        let Some(n) = ev.event_notification.as_ref() else {
            return doubtful;
        };
        let dir = ev.directory.as_str();
        let notifier = self.notifier();
        if let Some(old) = &n.old_entry {
            let renamed_or_deleted = n
                .new_entry
                .as_ref()
                .map(|ne| ne.name != old.name)
                .unwrap_or(true)
                || (!n.new_parent_path.is_empty() && n.new_parent_path != dir);
            if renamed_or_deleted {
                let opath = join(dir, &old.name);
                // A move of a file whose old name this node looked up again since, and found
                // another file at: the name leads to that file now and keeps it (when the
                // cached listing agrees; a node alone may be left over from before).
                let old_ino = self.node_of(&opath, old);
                // the cached entry at the old name is another file: another node's, or
                // (numbered alike in the same second) with other data
                let cached = match self.meta.lookup(dir, &old.name) {
                    Cached::Found(cur) => Some(cur),
                    _ => None,
                };
                // another upload with the moved file's number holds the old name now
                let twin_cached = cached.as_ref().is_some_and(|cur| other_upload(cur, old));
                let newer_cached = twin_cached
                    || cached
                        .as_ref()
                        .is_some_and(|cur| !self.is_node(&opath, cur, old_ino));
                // Files only: a directory's subtree moves by path, and below a newer
                // directory at the old path it could not be told apart.
                let newer_here = n.new_entry.is_some()
                    && !old.is_directory
                    && (newer_cached || self.inodes.ino_of(&opath).is_some_and(|at| at != old_ino));
                let keep_name = newer_here && newer_cached;
                if !keep_name {
                    self.meta.remove(dir, &old.name);
                    // after the removal: a listing that missed this count cannot hold the name
                    self.note_name_gone();
                    if old.is_directory {
                        self.meta.invalidate_dir(&opath, true);
                    }
                    if let (Some(nt), Some(pino)) = (&notifier, self.inodes.ino_of(dir)) {
                        nt.inval_entry(pino, &old.name);
                    }
                }
                match &n.new_entry {
                    None => {
                        // (a hard-linked file lives on under its other names: the re-read
                        // moves it to one)
                        self.removed_by_event(dir, old, old_ino, &mut doubtful);
                    }
                    Some(new) => {
                        // renamed by another client: our node ids and open files follow, and
                        // a file of ours it replaced must not be committed again. The open
                        // file's answers asked for before are stale (the name may have been
                        // one of its other names, which a removed name moves it to)
                        if let Some(of) = self.open_file(old_ino) {
                            of.state.lock().epoch += 1;
                        }
                        let ndir = if n.new_parent_path.is_empty() {
                            dir
                        } else {
                            n.new_parent_path.as_str()
                        };
                        let npath = join(ndir, &new.name);
                        if let Some(replaced) = self.inodes.ino_of(&npath) {
                            // not when that node is the moved file, met at its new name
                            // before this event came
                            // (by its number and birth, and its data where those cannot tell)
                            let same = self.is_node(&npath, new, replaced)
                                && !self
                                    .open_file(replaced)
                                    .is_some_and(|of| other_upload(&of.state.lock().entry, new))
                                && !matches!(self.meta.lookup(ndir, &new.name),
                                    Cached::Found(cur) if other_upload(&cur, new));
                            if replaced != old_ino && !same {
                                if let Some(of) = self.open_file(replaced) {
                                    // a hard link lives on under its other names here
                                    let names = self.inodes.live_names(replaced);
                                    // The event may predate our own change of that name: an
                                    // open file of ours with data to commit is then kept (its
                                    // commit wins, as the last writer does), never dropped.
                                    let mut s = of.state.lock();
                                    if !self.doubtful(&s, ndir, &new.name) {
                                        let linked = super::attr::has_other_links(&s.entry);
                                        name_taken(&mut s, &npath, linked, names);
                                    } else if s.want_resync(true) {
                                        doubtful.push(of.clone());
                                    }
                                }
                                self.inodes.unlink_path(&npath);
                            }
                        }
                        if newer_here {
                            // Only the moved node and its open file follow. Where the name's
                            // node is numbered as the moved file (another upload holds the
                            // name now), it stays with the name, unless it is open on the
                            // moved file (its entry shares data with the old one).
                            let twin = twin_cached && self.inodes.ino_of(&opath) == Some(old_ino);
                            let open_on_old = self
                                .open_file(old_ino)
                                .is_some_and(|of| !other_upload(&of.state.lock().entry, old));
                            if !twin || open_on_old {
                                self.moved_node(old_ino, &npath);
                            }
                        } else {
                            self.moved(&opath, &npath, !old.is_directory);
                        }
                    }
                }
            }
        }
        if let Some(new) = &n.new_entry {
            let ndir = if n.new_parent_path.is_empty() {
                dir
            } else {
                n.new_parent_path.as_str()
            };
            self.meta.upsert(ndir, Arc::new(new.clone()));
            let npath = join(ndir, &new.name);
            let ino = self.node_id(&npath, new);
            if let Some(known) = self.inodes.ino_of(&npath).filter(|known| *known != ino) {
                // the name leads to another file now (replaced by an upload)
                self.note_name_gone();
                // A hard link's name replaced by a plain file (an upload keeps the number):
                // the group's node lives on under its other names, with one link less.
                let left_group = n.old_entry.as_ref().filter(|o| {
                    o.name == new.name
                        && !o.hard_link_id.is_empty()
                        && o.hard_link_id != new.hard_link_id
                });
                // (a removal of that name, as a delete event's; an open file there moves on)
                if let Some(old) = left_group {
                    self.removed_by_event(ndir, old, known, &mut doubtful);
                }
            }
            if let Some(of) = self.open_file(ino) {
                let mut s = of.state.lock();
                // A manifest entry needs its manifests fetched first: keep the old list
                // (its needles stay readable with readDeleted) until the next open. An event
                // about another name than the file has here (not a hard link) is older than
                // our rename of it: its entry is not this file's any more.
                let own = (s.dir.as_str(), s.entry.name.as_str()) == (ndir, new.name.as_str());
                let here = own || !new.hard_link_id.is_empty();
                if here && s.is_clean() {
                    if self.doubtful(&s, ndir, &new.name) {
                        if s.want_resync(false) {
                            doubtful.push(of.clone());
                        }
                    } else if !crate::chunks::has_manifest(&new.chunks) {
                        s.replace_entry(new.clone(), new.chunks.clone());
                    }
                } else if here && new.hard_link_id != s.entry.hard_link_id {
                    // (a group is taken only at its own name: one met by number elsewhere
                    // may be a twin's)
                    if own && !new.hard_link_id.is_empty() {
                        s.saw_link_group(new);
                    } else {
                        s.link_news = s.link_news.saturating_add(1);
                    }
                }
                if !own && !new.hard_link_id.is_empty() && new.hard_link_id == s.link_group() {
                    s.note_link_name(npath.clone());
                }
            }
            // Also the node the file's number stands for wherever it is here now: an event from
            // before our rename of the file names its old path, where the id worked out for a
            // file met there is another (a derived one, for uploads born in one second).
            // Dropping a cache too many costs a read; one too few serves stale bytes.
            let by_number = new
                .hard_link_id
                .is_empty()
                .then(|| self.inodes.number_node(&super::attr::file_id(&npath, new)))
                .flatten()
                .filter(|n| *n != ino);
            for i in std::iter::once(ino).chain(by_number) {
                self.bump_content_gen(i);
                if let Some(nt) = &notifier {
                    nt.inval_inode(i);
                }
            }
            if let (Some(nt), Some(pino)) = (&notifier, self.inodes.ino_of(ndir)) {
                nt.inval_entry(pino, &new.name);
            }
        }
        // a name appeared or disappeared: the directories' link counts and times changed
        let name_changed = match (&n.old_entry, &n.new_entry) {
            (Some(o), Some(ne)) => {
                o.name != ne.name || (!n.new_parent_path.is_empty() && n.new_parent_path != dir)
            }
            _ => true,
        };
        if let (true, Some(nt)) = (name_changed, &notifier) {
            let mut dirs = vec![self.inodes.ino_of(dir)];
            if !n.new_parent_path.is_empty() && n.new_parent_path != dir {
                dirs.push(self.inodes.ino_of(&n.new_parent_path));
            }
            for d in dirs.into_iter().flatten() {
                nt.inval_inode(d);
            }
        }
        doubtful
    }

    /// Starts [`Self::resync_open_file`] for `of`, whose `want_resync` said none runs.
    fn spawn_resync(self: &Arc<Self>, of: Arc<OpenFile>) {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(self.clone().resync_open_file(of));
            }
            Err(_) => of.state.lock().resync = Default::default(),
        }
    }

    /// After a subscription gap: drop every cached listing and kernel attribute, and read
    /// the entry of every open file again (an open file's entry is not dropped with the
    /// caches, and its change in the gap would otherwise stay unseen until it is closed).
    pub fn resync(self: &Arc<Self>) {
        self.meta.invalidate_all();
        if let Some(nt) = self.notifier() {
            for rec in self.inodes.snapshot() {
                nt.inval_inode(rec.ino);
            }
        }
        let open: Vec<Arc<OpenFile>> = self.files.lock().values().map(|o| o.file.clone()).collect();
        for of in open {
            let start = {
                let mut s = of.state.lock();
                // (a re-read already under way must not clear it with an older answer)
                s.name_doubt = true;
                s.epoch += 1;
                s.want_resync(false)
            };
            if start {
                self.spawn_resync(of);
            }
        }
    }

    /// Takes an event that may be older than what this filesystem has read since it started
    /// (see [`crate::filer::subscribe::SubscriptionEvent::Recheck`]): nothing of it is
    /// applied, neither its entries nor its moves, since they may be states the filer has
    /// left already (a file moved away and back, a name taken by another file since). What
    /// it names is asked of the filer again instead: the cached listings and the kernel's
    /// entries are dropped, and open files read their entry again.
    pub fn recheck_event(self: &Arc<Self>, ev: &pb::SubscribeMetadataResponse) {
        let Some(n) = ev.event_notification.as_ref() else {
            return;
        };
        let dir = ev.directory.as_str();
        let ndir = if n.new_parent_path.is_empty() {
            dir
        } else {
            n.new_parent_path.as_str()
        };
        let opath = n.old_entry.as_ref().map(|o| join(dir, &o.name));
        let npath = n.new_entry.as_ref().map(|e| join(ndir, &e.name));
        let moved = opath.is_some() && npath.is_some() && opath != npath;
        if n.new_entry.is_none() || moved {
            // a listing being handed out may hold the name
            self.note_name_gone();
        }
        let notifier = self.notifier();
        // (inode, whether the event says it is gone from the filer: believed only once the
        // filer no longer has it under its name here). Only the event's own file: what holds
        // the name here now may be another file, and "not under its name" may mean renamed
        // since, so a recheck never unlinks it.
        let mut inos: Vec<(u64, bool)> = Vec::new();
        let sides = n
            .old_entry
            .iter()
            .zip(opath.iter())
            .map(|(e, p)| (dir, e, p, true));
        let sides = sides.chain(
            n.new_entry
                .iter()
                .zip(npath.iter())
                .map(|(e, p)| (ndir, e, p, false)),
        );
        for (d, e, path, old_side) in sides {
            self.meta.invalidate_dir(d, false);
            if e.is_directory {
                self.meta.invalidate_dir(path, true);
            }
            if let (Some(nt), Some(pino)) = (&notifier, self.inodes.ino_of(d)) {
                nt.inval_entry(pino, &e.name);
                nt.inval_inode(pino);
            }
            // a removed name of a file with other names (a hard link) is not the file gone
            let linked = super::attr::has_other_links(e);
            let removed = old_side && n.new_entry.is_none() && !linked;
            let ino = if old_side {
                self.node_of(path, e)
            } else {
                self.node_id(path, e)
            };
            inos.push((ino, removed));
            if let Some(here) = self.inodes.ino_of(path) {
                inos.push((here, false));
            }
        }
        for (ino, gone) in inos {
            self.bump_content_gen(ino);
            if let Some(nt) = &notifier {
                nt.inval_inode(ino);
            }
            if let Some(of) = self.open_file(ino) {
                let start = {
                    let mut s = of.state.lock();
                    // the event's move is not taken: it may have moved the file
                    s.name_doubt = true;
                    s.epoch += 1;
                    s.want_resync(gone)
                };
                if start {
                    self.spawn_resync(of);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::filer::FilerApi;
    use crate::fs::inode::ROOT_INO;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;
    use std::time::Duration;

    fn fs() -> (Arc<Fs>, MockFiler) {
        let filer = MockFiler::new();
        let other = filer.other_client();
        let fs = Fs::new(
            FsConfig::from_mount_options(&MountOptions::default()),
            Arc::new(filer),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        (fs, other)
    }

    fn file(name: &str, content: &[u8]) -> pb::Entry {
        pb::Entry {
            name: name.into(),
            content: content.to_vec(),
            attributes: Some(pb::FuseAttributes {
                file_mode: 0o644,
                file_size: content.len() as u64,
                inode: 4242,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Another client writes `/name` with `content`; returns its event.
    async fn put(other: &MockFiler, name: &str, content: &[u8]) -> pb::SubscribeMetadataResponse {
        create(other, file(name, content)).await
    }

    /// Another client creates (or replaces) `e` in the root; returns its event.
    async fn create(other: &MockFiler, e: pb::Entry) -> pb::SubscribeMetadataResponse {
        other
            .create_entry(pb::CreateEntryRequest {
                directory: "/".into(),
                entry: Some(e),
                ..Default::default()
            })
            .await
            .unwrap()
            .expect("the mock logs an event")
    }

    /// Another client deletes `/name` (and its data); returns its event.
    async fn removed(other: &MockFiler, name: &str) -> pb::SubscribeMetadataResponse {
        other
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: name.into(),
                is_delete_data: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .unwrap()
    }

    /// `/f` put by another client, opened for writing here and written and flushed, so
    /// that its events are doubtful for a while: (ino, fh).
    async fn changed_here(fs: &Arc<Fs>, other: &MockFiler) -> (u64, u64) {
        put(other, "f", b"x").await;
        let ino = fs.lookup(ROOT_INO, "f").await.unwrap().ino;
        let fh = fs.open(ino, libc::O_RDWR).await.unwrap();
        fs.write(fh, ino, 0, b"one").await.unwrap();
        fs.flush(fh, ino).await.unwrap();
        (ino, fh)
    }

    /// A file with two hard links `l` and `f` (made by another client), both looked up here,
    /// open at `l`, written and flushed here (its events are doubtful for a while): (ino, fh).
    async fn linked_changed_here(fs: &Arc<Fs>, other: &MockFiler) -> (u64, u64) {
        for n in ["l", "f"] {
            let mut e = file(n, b"data");
            e.hard_link_id = vec![7; 17];
            e.hard_link_counter = 2;
            create(other, e).await;
        }
        let ino = fs.lookup(ROOT_INO, "l").await.unwrap().ino;
        assert_eq!(fs.lookup(ROOT_INO, "f").await.unwrap().ino, ino);
        let fh = fs.open(ino, libc::O_RDWR).await.unwrap();
        fs.write(fh, ino, 0, b"DATA").await.unwrap();
        fs.flush(fh, ino).await.unwrap();
        (ino, fh)
    }

    /// A hard-linked file's commit refused at its name (another node removed it between the
    /// commit's look at the link group and the commit): the name is not given back; the
    /// file moves to the other name of its group, which the filer confirms, and commits
    /// there.
    #[tokio::test]
    async fn a_refused_commit_of_a_hard_link_moves_to_its_other_name() {
        let (fs, other) = fs();
        let (ino, fh) = linked_changed_here(&fs, &other).await;
        let name = fs.open_file(ino).unwrap().state.lock().entry.name.clone();
        let rest = if name == "f" { "l" } else { "f" };
        fs.write(fh, ino, 4, b"-MORE").await.unwrap();
        let hold = other.hold_next_lookup(&format!("/{name}"));
        let flush = {
            let fs = fs.clone();
            tokio::spawn(async move { fs.flush(fh, ino).await })
        };
        hold.arrived().await;
        removed(&other, &name).await;
        // the filer's link record counts one name less (the mock keeps no record)
        let mut e = other.get(&format!("/{rest}")).unwrap();
        e.hard_link_counter = 1;
        create(&other, e).await;
        hold.release();
        flush.await.unwrap().unwrap();
        assert!(
            other.get(&format!("/{name}")).is_none(),
            "the removed name came back"
        );
        let kept = other.get(&format!("/{rest}")).unwrap();
        assert_eq!(
            kept.attributes.unwrap().file_size,
            9,
            "the writes at {rest}"
        );
        fs.release(fh, ino).await.unwrap();
    }

    /// A hard-linked file whose every name another node removed, the events not here yet:
    /// its commit finds its name gone and the group's record gone too, so it must not give
    /// the name back (the entry would list the chunks the group's removal deleted). It
    /// waits for the events and, with none, says ESTALE.
    #[tokio::test]
    async fn a_commit_does_not_give_back_a_name_of_a_link_group_removed_elsewhere() {
        let (fs, other) = fs();
        let (ino, fh) = linked_changed_here(&fs, &other).await;
        for name in ["f", "l"] {
            removed(&other, name).await;
        }
        fs.write(fh, ino, 4, b"-MORE").await.unwrap();
        let r = fs.flush(fh, ino).await;
        assert_eq!(r.map_err(|e| e.errno), Err(libc::ESTALE));
        let names = || (other.get("/f").is_some(), other.get("/l").is_some());
        assert_eq!(names(), (false, false), "a removed name came back");
        let _ = fs.release(fh, ino).await;
        assert_eq!(names(), (false, false), "after the last close");
    }

    /// Opens `/name` read-only here: (ino, fh).
    async fn open(fs: &Arc<Fs>, name: &str) -> (u64, u64) {
        let ino = fs.lookup(ROOT_INO, name).await.unwrap().ino;
        (ino, fs.open(ino, libc::O_RDONLY).await.unwrap())
    }

    async fn read_all(fs: &Arc<Fs>, (ino, fh): (u64, u64)) -> Vec<u8> {
        fs.read(fh, ino, 0, 64).await.unwrap().to_vec()
    }

    /// Background re-reads have run.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// An event stamped before the session's start may still be newer than what it read
    /// (the filer's clock behind the node's, or a peer filer's event): dropping it left an
    /// open file on the old bytes until it was closed.
    #[tokio::test]
    async fn a_recheck_brings_an_open_file_the_filers_current_entry() {
        let (fs, other) = fs();
        put(&other, "f", b"old").await;
        let h = open(&fs, "f").await;
        assert_eq!(read_all(&fs, h).await, b"old");
        let ev = put(&other, "f", b"newer").await;
        fs.recheck_event(&ev);
        settle().await;
        assert_eq!(read_all(&fs, h).await, b"newer");
    }

    /// ...and an event older than what the session read must not bring an older state back
    /// (applied, it would: the file was not changed here).
    #[tokio::test]
    async fn a_recheck_never_brings_back_an_older_state() {
        let (fs, other) = fs();
        let old = put(&other, "f", b"old").await;
        put(&other, "f", b"newer").await;
        let h = open(&fs, "f").await;
        fs.recheck_event(&old);
        settle().await;
        assert_eq!(read_all(&fs, h).await, b"newer");
        assert_eq!(fs.lookup(ROOT_INO, "f").await.unwrap().size, 5);
        // a name it lists as gone is asked for again, not taken away
        let del = pb::SubscribeMetadataResponse {
            directory: "/".into(),
            event_notification: Some(pb::EventNotification {
                old_entry: Some(file("f", b"old")),
                ..Default::default()
            }),
            ..Default::default()
        };
        fs.recheck_event(&del);
        settle().await;
        assert_eq!(fs.lookup(ROOT_INO, "f").await.unwrap().size, 5);
        let of = fs.open_file(h.0).unwrap();
        assert!(!of.state.lock().unlinked, "the filer still has it");
        // once the filer agrees, the removal holds
        let gone = other
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: "f".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .unwrap();
        fs.recheck_event(&gone);
        settle().await;
        assert!(of.state.lock().unlinked);
        assert_eq!(
            fs.lookup(ROOT_INO, "f").await.unwrap_err().errno,
            libc::ENOENT
        );
    }

    fn mv(from: &str, to: &str) -> pb::SubscribeMetadataResponse {
        pb::SubscribeMetadataResponse {
            directory: "/".into(),
            event_notification: Some(pb::EventNotification {
                old_entry: Some(file(from, b"data")),
                new_entry: Some(file(to, b"data")),
                new_parent_path: "/".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn rename_elsewhere(other: &MockFiler, from: &str, to: &str) {
        other
            .rename_entry(pb::StreamRenameEntryRequest {
                old_directory: "/".into(),
                old_name: from.into(),
                new_directory: "/".into(),
                new_name: to.into(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// Found in review: a replayed move applied to "the file it moved" (same identity at the
    /// old name) dragged files: replayed after the session's own lookups, f->g and g->f
    /// moved A away and back, and the second took B (open at g, made since) along to f,
    /// whose commit then overwrote A. A recheck moves nothing.
    #[tokio::test]
    async fn a_replayed_move_back_and_forth_leaves_every_file_where_the_filer_has_it() {
        let (fs, other) = fs();
        put(&other, "f", b"AAAA").await; // A, inode 4242
        rename_elsewhere(&other, "f", "g").await;
        rename_elsewhere(&other, "g", "f").await;
        let mut b = file("g", b"BBBB");
        b.attributes.as_mut().unwrap().inode = 777;
        let create_b = create(&other, b).await;
        let a = fs.lookup(ROOT_INO, "f").await.unwrap().ino;
        let b = fs.lookup(ROOT_INO, "g").await.unwrap().ino;
        let afh = fs.open(a, libc::O_RDWR).await.unwrap();
        let bfh = fs.open(b, libc::O_RDWR).await.unwrap();
        fs.write(bfh, b, 0, b"bbbbbbbb").await.unwrap();
        for ev in [mv("f", "g"), mv("g", "f"), create_b] {
            fs.recheck_event(&ev);
        }
        settle().await;
        assert_eq!(fs.open_file(a).unwrap().state.lock().entry.name, "f");
        assert_eq!(fs.open_file(b).unwrap().state.lock().entry.name, "g");
        fs.flush(bfh, b).await.unwrap();
        fs.write(afh, a, 0, b"aa").await.unwrap();
        fs.flush(afh, a).await.unwrap();
        let (f, g) = (other.get("/f").unwrap(), other.get("/g").unwrap());
        assert_eq!(f.attributes.unwrap().inode, 4242);
        assert_eq!(g.attributes.unwrap().inode, 777);
        assert_eq!(crate::chunks::file_size(&other.get("/g").unwrap()), 8);
    }

    /// ...and a name that another file holds by now (a new file made at the old name after
    /// the move) is left alone: the event is not about it.
    #[tokio::test]
    async fn a_recheck_never_moves_another_file_that_took_the_name() {
        let (fs, other) = fs();
        let mut newer = file("f", b"new file");
        newer.attributes.as_mut().unwrap().inode = 777;
        create(&other, newer).await;
        let (ino, _fh) = open(&fs, "f").await;
        fs.recheck_event(&mv("f", "g")); // moved the file with inode 4242, long ago
        settle().await;
        let of = fs.open_file(ino).unwrap();
        assert_eq!(of.state.lock().entry.name, "f");
        assert_eq!(fs.lookup(ROOT_INO, "f").await.unwrap().ino, ino);
    }

    /// Found in review: a recheck of one name's removal unlinked an open hard-linked file
    /// that lives on under another name, and its writes were never committed.
    #[tokio::test]
    async fn a_recheck_of_one_hard_link_removal_keeps_the_file() {
        let (fs, other) = fs();
        for n in ["l", "f"] {
            let mut e = file(n, b"data");
            e.hard_link_id = vec![7; 17];
            e.hard_link_counter = 2;
            create(&other, e).await;
        }
        let ino = fs.lookup(ROOT_INO, "l").await.unwrap().ino;
        let fh = fs.open(ino, libc::O_RDWR).await.unwrap();
        fs.write(fh, ino, 0, b"DATA-MORE").await.unwrap();
        let gone = other
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: "l".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .unwrap();
        fs.recheck_event(&gone);
        settle().await;
        assert!(!fs.open_file(ino).unwrap().state.lock().unlinked);
        fs.flush(fh, ino).await.unwrap();
        assert!(other.get("/f").is_some());
    }

    /// Found in review: re-reads unlinked only files with nothing to commit, so a removal
    /// the filer confirmed left a file being written linked, and its commit brought the
    /// entry back with chunks the filer had deleted.
    #[tokio::test]
    async fn a_confirmed_removal_unlinks_a_file_being_written() {
        let (fs, other) = fs();
        let (ino, fh) = changed_here(&fs, &other).await;
        fs.write(fh, ino, 3, b"two").await.unwrap();
        let gone = removed(&other, "f").await;
        fs.apply_event(&gone);
        settle().await;
        fs.flush(fh, ino).await.unwrap();
        assert!(other.get("/f").is_none(), "a deleted file brought back");
    }

    /// Found by the FUSE interop test (intermittent): a removal of a file changed here lately
    /// is left to the file's re-read, and a close that committed before the re-read had run
    /// created the removed file again. The same for a file replaced by another client's
    /// move: the close wrote the old file over the new one.
    #[tokio::test]
    async fn a_commit_before_a_removals_re_read_does_not_bring_the_file_back() {
        for replaced in [false, true] {
            let (fs, other) = fs();
            put(&other, "f", b"x").await;
            let ino = fs.lookup(ROOT_INO, "f").await.unwrap().ino;
            let fh = fs.open(ino, libc::O_RDWR).await.unwrap();
            fs.write(fh, ino, 0, b"one").await.unwrap();
            fs.flush(fh, ino).await.unwrap(); // changed here lately: its events are doubtful
            fs.write(fh, ino, 3, b"two").await.unwrap();
            // the re-read cannot start before the close
            let held = fs.rereads.acquire_many(4).await.unwrap();
            let ev = if replaced {
                let mut e = file("r", b"new");
                e.attributes.as_mut().unwrap().inode = 7777;
                create(&other, e).await;
                renamed(&other, "r", "f").await
            } else {
                removed(&other, "f").await
            };
            fs.apply_event(&ev);
            fs.flush(fh, ino).await.unwrap();
            let want = replaced.then(|| "new".to_string());
            assert_eq!(content_of(&other, "f"), want, "replaced={replaced}");
            assert!(fs.open_file(ino).unwrap().state.lock().unlinked);
            fs.release(fh, ino).await.unwrap();
            drop(held);
            settle().await;
            assert_eq!(content_of(&other, "f"), want, "replaced={replaced}");
        }
    }

    /// Raised in review: a re-read asked for by an update, whose lookup answered "still
    /// there" after the removal's event arrived, could settle the removal doubt with that
    /// older answer, and a commit before the next round would create the removed file again.
    /// Two guards keep it out: the removal's event takes the name's node away (the answer no
    /// longer matches the file) and the doubt bumps the file's epoch (the answer is stale).
    #[tokio::test]
    async fn a_re_read_answer_from_before_a_removal_does_not_settle_it() {
        let (fs, other) = fs();
        let (ino, fh) = changed_here(&fs, &other).await;
        // an update's re-read reads the entry, and its answer is held
        let hold = other.hold_next_lookup("/f");
        let mut e = other.get("/f").unwrap();
        e.attributes.as_mut().unwrap().mtime += 1;
        let ev = create(&other, e).await;
        fs.apply_event(&ev);
        hold.arrived().await;
        fs.write(fh, ino, 3, b"two").await.unwrap();
        let gone = removed(&other, "f").await;
        fs.apply_event(&gone);
        // the re-read's next round waits for a permit queued before its own is returned
        let others = fs.rereads.acquire_many(3).await.unwrap();
        let mut last = std::pin::pin!(fs.rereads.acquire());
        assert!(futures::poll!(&mut last).is_pending());
        hold.release();
        let last = last.await.unwrap();
        settle().await;
        fs.flush(fh, ino).await.unwrap();
        assert!(other.get("/f").is_none(), "a deleted file brought back");
        drop((others, last));
        fs.release(fh, ino).await.unwrap();
    }

    /// A hard-linked file open here under one name, changed here lately, and that name
    /// removed by another client: its commits created the removed name again. It moves to
    /// another of its names known here, once the filer confirms that name still leads to
    /// its link group (review: a name known here can be another file's since, which the
    /// move wrote over). `early`: the commit comes before the re-read.
    #[tokio::test]
    async fn a_doubtful_removal_of_a_hard_link_moves_the_file_to_its_other_name() {
        for (early, stale) in [(false, false), (true, false), (false, true), (true, true)] {
            let case = format!("early={early} stale={stale}");
            let (fs, other) = fs();
            let (ino, fh) = linked_changed_here(&fs, &other).await;
            let delete = |name: &str| {
                other.delete_entry(pb::DeleteEntryRequest {
                    directory: "/".into(),
                    name: name.into(),
                    ..Default::default()
                })
            };
            if stale {
                // `f` is another file now; this node has not heard of it yet
                delete("f").await.unwrap();
                let mut e = file("f", b"another file");
                e.attributes.as_mut().unwrap().inode = 999;
                create(&other, e).await;
            }
            let gone = delete("l").await.unwrap().unwrap();
            if !stale {
                // the filer's link record counts one name less (the mock keeps no record)
                let mut e = other.get("/f").unwrap();
                e.hard_link_counter = 1;
                create(&other, e).await;
            }
            let held = if early {
                Some(fs.rereads.acquire_many(4).await.unwrap())
            } else {
                None
            };
            fs.apply_event(&gone);
            settle().await;
            fs.write(fh, ino, 4, b"-MORE").await.unwrap();
            let flushed = fs.flush(fh, ino).await.map_err(|e| e.errno);
            let _ = fs.release(fh, ino).await;
            drop(held);
            let f = other.get("/f").expect("f stays");
            if stale {
                // the group has no name left (its record went with the last one): not
                // given back, since the name would list the chunks the filer deleted then
                assert_eq!(flushed, Err(libc::ESTALE), "{case}");
                assert!(
                    other.get("/l").is_none(),
                    "{case}: the removed name came back"
                );
                assert_eq!(content_of(&other, "f").unwrap(), "another file", "{case}");
                assert!(f.hard_link_id.is_empty(), "{case}");
            } else {
                assert_eq!(flushed, Ok(()), "{case}");
                assert!(
                    other.get("/l").is_none(),
                    "{case}: the removed name came back"
                );
                assert_eq!(f.attributes.unwrap().file_size, 9, "{case}");
                assert_eq!(f.hard_link_counter, 1, "{case}");
            }
        }
    }

    /// Found in review: the other name a hard-linked file's removed name moves it to,
    /// renamed by another client after the filer confirmed it: the move took the old name,
    /// and the commit created it again beside the renamed one (two names, a count of one).
    #[tokio::test]
    async fn a_hard_link_renamed_while_its_file_moves_to_it_is_followed() {
        let (fs, other) = fs();
        let (ino, fh) = linked_changed_here(&fs, &other).await;
        let gone = other
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: "l".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .unwrap();
        // the filer's link record counts one name less (the mock keeps no record)
        let mut e = other.get("/f").unwrap();
        e.hard_link_counter = 1;
        create(&other, e).await;
        // the re-read confirms `f`, and its answer is held while `f` becomes `g`
        let hold = other.hold_next_lookup("/f");
        fs.apply_event(&gone);
        hold.arrived().await;
        let moved = renamed(&other, "f", "g").await;
        fs.apply_event(&moved);
        hold.release();
        settle().await;
        fs.write(fh, ino, 4, b"-MORE").await.unwrap();
        fs.flush(fh, ino).await.unwrap();
        fs.release(fh, ino).await.unwrap();
        assert!(other.get("/l").is_none(), "the removed name came back");
        assert!(other.get("/f").is_none(), "the renamed name came back");
        let g = other.get("/g").expect("the renamed link");
        assert_eq!(g.attributes.unwrap().file_size, 9);
    }

    /// An entry without an inode (made through the HTTP API or S3) is known here by a node
    /// id derived from the path it was first seen at; after another client renamed it, its
    /// re-read must still recognise it (it was taken for another file, and its newer entry
    /// ignored).
    #[tokio::test]
    async fn an_inodeless_file_renamed_elsewhere_is_still_recognised_by_its_re_read() {
        let (fs, other) = fs();
        let noino = |name: &str, content: &[u8]| {
            let mut e = file(name, content);
            let a = e.attributes.as_mut().unwrap();
            a.inode = 0;
            a.crtime = 1000;
            e
        };
        create(&other, noino("f", b"old")).await;
        let h = open(&fs, "f").await;
        rename_elsewhere(&other, "f", "g").await;
        let mut moved = mv("f", "g");
        let n = moved.event_notification.as_mut().unwrap();
        (n.old_entry, n.new_entry) = (Some(noino("f", b"old")), Some(noino("g", b"old")));
        fs.apply_event(&moved);
        assert_eq!(fs.open_file(h.0).unwrap().state.lock().entry.name, "g");
        let ev = create(&other, noino("g", b"newer")).await;
        fs.recheck_event(&ev);
        settle().await;
        assert_eq!(read_all(&fs, h).await, b"newer");
        assert!(!fs.open_file(h.0).unwrap().state.lock().unlinked);
    }

    /// Found by the soak run: the filer numbers a file created without an inode (an HTTP
    /// upload) md5(path) + crtime seconds * 37, so a file uploaded to `d`, renamed to `c` by
    /// another client, and a new upload to `d` within the same second share one inode. Taken
    /// for one node here, `d` showed `c`'s size and attributes - also when the rename's event
    /// arrived after the new `d` had been looked up.
    #[tokio::test]
    async fn two_files_the_filer_gave_one_inode_are_two_files_here() {
        // creation nanoseconds told apart (a `weed mount` create) or unknown (an upload)
        for (stale, ns) in [(false, 1), (true, 1), (false, 0), (true, 0)] {
            let (fs, other) = fs();
            let born = |name: &str, content: &[u8], n: i32| {
                let mut e = file(name, content);
                let a = e.attributes.as_mut().unwrap();
                (a.inode, a.crtime, a.crtime_ns) = (5000, 1000, n * ns);
                e
            };
            create(&other, born("d", b"old", 1)).await;
            let first = fs.lookup(ROOT_INO, "d").await.unwrap().ino;
            let moved = renamed(&other, "d", "c").await;
            if !stale {
                fs.apply_event(&moved);
            }
            let ev = create(&other, born("d", b"newer d", 2)).await;
            fs.apply_event(&ev);
            // looked up before a stale move event is applied
            let d_early = fs.lookup(ROOT_INO, "d").await.unwrap().ino;
            if stale {
                fs.apply_event(&moved);
            }
            let c = fs.lookup(ROOT_INO, "c").await.unwrap();
            let d = fs.lookup(ROOT_INO, "d").await.unwrap();
            let case = format!("stale={stale} ns={ns}");
            assert_eq!(d.ino, d_early, "{case}: the kernel's node for `d` stays");
            if stale && ns == 0 {
                // nothing tells the files apart but their data: the kernel last met the
                // node as the new `d`, which keeps it
                assert_eq!(d.ino, first, "{case}");
            } else {
                assert_eq!(c.ino, first, "{case}: the moved file keeps its node");
            }
            assert_ne!(c.ino, d.ino, "{case}");
            assert_eq!(fs.getattr(d.ino).await.unwrap().size, 7, "{case}");
            assert_eq!(fs.getattr(c.ino).await.unwrap().size, 3, "{case}");
            assert_eq!(fs.lookup(ROOT_INO, "d").await.unwrap().ino, d.ino);
            // a listing agrees, and so does a lookup once the moved file's node is forgotten
            let fh = fs.opendir(ROOT_INO).await.unwrap();
            let l = fs.readdir(ROOT_INO, fh, 0).await.unwrap();
            let listed = |n: &str| l.entries.iter().find(|e| e.name == n).unwrap().ino;
            assert_eq!((listed("c"), listed("d")), (c.ino, d.ino), "{case}");
            fs.forget(c.ino, 2);
            assert_eq!(fs.lookup(ROOT_INO, "d").await.unwrap().ino, d.ino, "{case}");
        }
    }

    /// An upload numbered 5000 and born in second 1000, nanoseconds unknown.
    fn upload(name: &str, content: &[u8]) -> pb::Entry {
        let mut e = file(name, content);
        let a = e.attributes.as_mut().unwrap();
        (a.inode, a.crtime, a.crtime_ns) = (5000, 1000, 0);
        e
    }

    /// The filer's content of `/name`.
    fn content_of(other: &MockFiler, name: &str) -> Option<String> {
        other
            .get(&format!("/{name}"))
            .map(|e| String::from_utf8_lossy(&e.content).into_owned())
    }

    /// Found in review: an event about the renamed-away upload `c`, never met here, took the
    /// node of the new upload `d` (same number and second) that is open and written here: a
    /// delete unlinked it (the write was lost), a rename moved it (the write went to `e`).
    #[tokio::test]
    async fn an_event_about_a_twin_never_met_here_leaves_the_open_file_alone() {
        for delete in [true, false] {
            let (fs, other) = fs();
            for ev in [
                create(&other, upload("d", b"old")).await,
                renamed(&other, "d", "c").await,
                create(&other, upload("d", b"newer d")).await,
            ] {
                fs.apply_event(&ev);
            }
            let d = fs.lookup(ROOT_INO, "d").await.unwrap().ino;
            let fh = fs.open(d, libc::O_RDWR).await.unwrap();
            fs.write(fh, d, 0, b"PRECIOUS").await.unwrap();
            let ev = if delete {
                other
                    .delete_entry(pb::DeleteEntryRequest {
                        directory: "/".into(),
                        name: "c".into(),
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .unwrap()
            } else {
                renamed(&other, "c", "e").await
            };
            fs.apply_event(&ev);
            settle().await;
            fs.flush(fh, d).await.unwrap();
            // the write reached `d` (8 bytes over its 7)
            let d_size = other.get("/d").map(|e| crate::chunks::file_size(&e));
            assert_eq!(d_size, Some(8), "delete={delete}");
            if !delete {
                assert_eq!(content_of(&other, "e").as_deref(), Some("old"));
                let err = fs.lookup(ROOT_INO, "c").await.unwrap_err();
                assert_eq!(err.errno, libc::ENOENT, "a phantom `c`");
            }
        }
    }

    /// Found in review: a listing that met both uploads with one number, on a table that
    /// knew neither, gave both that number as node id.
    #[tokio::test]
    async fn one_listing_of_two_uploads_with_one_number_gives_two_nodes() {
        let (fs, other) = fs();
        create(&other, upload("d", b"old")).await;
        renamed(&other, "d", "c").await;
        create(&other, upload("d", b"newer d")).await;
        let fh = fs.opendir(ROOT_INO).await.unwrap();
        let l = fs.readdir(ROOT_INO, fh, 0).await.unwrap();
        for e in l.entries.iter().skip(2) {
            fs.remember_dir_entry(ROOT_INO, e);
        }
        let listed = |n: &str| l.entries.iter().find(|e| e.name == n).unwrap().ino;
        let (c, d) = (listed("c"), listed("d"));
        assert_ne!(c, d);
        assert_eq!(fs.getattr(c).await.unwrap().size, 3);
        assert_eq!(fs.getattr(d).await.unwrap().size, 7);
        assert_eq!(fs.lookup(ROOT_INO, "c").await.unwrap().ino, c);
        assert_eq!(fs.lookup(ROOT_INO, "d").await.unwrap().ino, d);
    }

    /// Found in review: `d` looked up again (a listing expired) after another client moved the
    /// first upload to `c` and uploaded a new `d`, opened and written before the events came:
    /// the move event took the open file along and its flush overwrote `c`.
    #[tokio::test]
    async fn a_twin_opened_before_the_move_event_keeps_its_name() {
        let (fs, other) = fs();
        create(&other, upload("d", b"old")).await;
        fs.lookup(ROOT_INO, "d").await.unwrap();
        let mv = renamed(&other, "d", "c").await;
        let up = create(&other, upload("d", b"newer d")).await;
        fs.meta.invalidate_dir("/", false);
        let d = fs.lookup(ROOT_INO, "d").await.unwrap().ino;
        let fh = fs.open(d, libc::O_RDWR).await.unwrap();
        fs.write(fh, d, 0, b"W").await.unwrap();
        fs.apply_event(&mv);
        fs.apply_event(&up);
        settle().await;
        fs.flush(fh, d).await.unwrap();
        assert_eq!(content_of(&other, "c").as_deref(), Some("old"));
        let d = other.get("/d").unwrap();
        assert_eq!(crate::chunks::file_size(&d), 7);
        assert_ne!(d.content, b"newer d", "the write never reached `d`");
    }

    /// Found in review: a hard link of a file known by a derived node id (another upload has
    /// its number) made both names that other file's node; writes through it went there.
    #[tokio::test]
    async fn a_hard_link_of_a_file_with_a_derived_node_id_stays_that_file() {
        let (fs, other) = fs();
        create(&other, upload("d", b"old")).await;
        let first = fs.lookup(ROOT_INO, "d").await.unwrap().ino;
        fs.apply_event(&renamed(&other, "d", "c").await);
        fs.apply_event(&create(&other, upload("d", b"newer d")).await);
        let d = fs.lookup(ROOT_INO, "d").await.unwrap().ino;
        assert_ne!(d, first);
        fs.link(d, ROOT_INO, "l").await.unwrap();
        let (d2, l, c) = (
            fs.lookup(ROOT_INO, "d").await.unwrap().ino,
            fs.lookup(ROOT_INO, "l").await.unwrap().ino,
            fs.lookup(ROOT_INO, "c").await.unwrap().ino,
        );
        assert_eq!((d2, l, c), (d, d, first));
        let fh = fs.open(d, libc::O_RDWR).await.unwrap();
        fs.write(fh, d, 0, b"XX").await.unwrap();
        fs.flush(fh, d).await.unwrap();
        fs.release(fh, d).await.unwrap();
        assert_eq!(content_of(&other, "c").as_deref(), Some("old"));
    }

    /// Found in CI (multi_client, 1 of 60): another client's rewrite of an upload, whose
    /// event came after our rename of the file, dropped the cached pages of a derived id for
    /// the old name, not of our node: it kept serving the old bytes.
    #[tokio::test]
    async fn an_older_event_of_a_file_we_renamed_drops_its_cached_pages() {
        let (fs, other) = fs();
        create(&other, upload("f", b"old")).await;
        let ino = fs.lookup(ROOT_INO, "f").await.unwrap().ino;
        let rewrite = create(&other, upload("f", b"rewritten")).await;
        fs.rename(ROOT_INO, "f", ROOT_INO, "g", 0).await.unwrap();
        fs.keep_cache(ino);
        assert!(fs.keep_cache(ino));
        fs.apply_event(&rewrite);
        assert!(!fs.keep_cache(ino), "the node's cached pages were kept");
    }

    /// A file another client renamed, looked up at its new name before the rename's event
    /// is here, keeps its node when its old name is gone on the filer; when a new file with
    /// the same number took the old name (an upload in the same second), the two differ.
    #[tokio::test]
    async fn a_file_renamed_unseen_keeps_its_node_unless_a_new_file_took_its_name() {
        for replaced in [false, true] {
            let (fs, other) = fs();
            let upload = |name: &str, content: &[u8]| {
                let mut e = file(name, content);
                let a = e.attributes.as_mut().unwrap();
                (a.inode, a.crtime, a.crtime_ns) = (5000, 1000, 0);
                e
            };
            create(&other, upload("d", b"old")).await;
            let first = fs.lookup(ROOT_INO, "d").await.unwrap().ino;
            let moved = renamed(&other, "d", "c").await;
            let upload_ev = if replaced {
                Some(create(&other, upload("d", b"newer d")).await)
            } else {
                None
            };
            // the listing read again from the filer (its time to live ran out) before the
            // events are here
            fs.meta.invalidate_dir("/", false);
            let c = fs.lookup(ROOT_INO, "c").await.unwrap();
            fs.apply_event(&moved);
            if let Some(ev) = &upload_ev {
                fs.apply_event(ev);
            }
            let c_after = fs.lookup(ROOT_INO, "c").await.unwrap();
            assert_eq!(c_after.size, 3, "replaced={replaced}");
            if replaced {
                // the kernel knows `d` as `first` still: `c` must be another node, and stays
                // it once the events are here (two nodes for `c` would each commit)
                assert_ne!(c.ino, first, "replaced={replaced}");
                assert_eq!(c_after.ino, c.ino, "replaced={replaced}");
                let d = fs.lookup(ROOT_INO, "d").await.unwrap();
                assert_eq!(d.ino, first);
                assert_eq!(fs.getattr(d.ino).await.unwrap().size, 7);
            } else {
                assert_eq!((c.ino, c_after.ino), (first, first));
                let err = fs.lookup(ROOT_INO, "d").await.unwrap_err();
                assert_eq!(err.errno, libc::ENOENT);
            }
        }
    }

    /// The event of another client's rename, as the subscription carries it.
    async fn renamed(other: &MockFiler, from: &str, to: &str) -> pb::SubscribeMetadataResponse {
        let r = other
            .rename_entry(pb::StreamRenameEntryRequest {
                old_directory: "/".into(),
                old_name: from.into(),
                new_directory: "/".into(),
                new_name: to.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .remove(0);
        pb::SubscribeMetadataResponse {
            directory: r.directory,
            event_notification: r.event_notification,
            ts_ns: r.ts_ns,
            ..Default::default()
        }
    }

    /// Writes to the file open here at `name`; another client renames it to `to` while the
    /// replay still carries `old` (a recheck, then the live rename): the file must stay
    /// linked and its writes reach `to`.
    async fn recheck_while_renamed_elsewhere(
        fs: &Arc<Fs>,
        other: &MockFiler,
        old: &pb::SubscribeMetadataResponse,
        name: &str,
        to: &str,
    ) {
        let ino = fs.lookup(ROOT_INO, name).await.unwrap().ino;
        let fh = fs.open(ino, libc::O_RDWR).await.unwrap();
        fs.write(fh, ino, 0, b"precious").await.unwrap();
        let live = renamed(other, name, to).await;
        fs.recheck_event(old);
        settle().await;
        fs.apply_event(&live);
        settle().await;
        assert!(!fs.open_file(ino).unwrap().state.lock().unlinked);
        fs.flush(fh, ino).await.unwrap();
        let moved = other.get(&format!("/{to}")).unwrap();
        assert_eq!(crate::chunks::file_size(&moved), 8);
    }

    /// Found in review: a replayed removal of an older file at `f` marked the file open at
    /// `f` now as gone; another client had renamed it to `h` meanwhile, so its re-read found
    /// no `f`, and it was unlinked: its writes never reached `h`.
    #[tokio::test]
    async fn a_recheck_of_an_older_files_removal_never_unlinks_the_file_there_now() {
        let (fs, other) = fs();
        let mut x = file("f", b"X");
        x.attributes.as_mut().unwrap().inode = 111;
        create(&other, x).await;
        let old_delete = other
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: "f".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .unwrap();
        put(&other, "f", b"A").await;
        recheck_while_renamed_elsewhere(&fs, &other, &old_delete, "f", "h").await;
    }

    /// ...and the same through a replayed move onto the name of a file open here now.
    #[tokio::test]
    async fn a_recheck_of_an_older_move_never_unlinks_the_file_at_its_target_now() {
        let (fs, other) = fs();
        put(&other, "f", b"A").await;
        let old_move = renamed(&other, "f", "g").await;
        renamed(&other, "g", "a2").await;
        let mut b = file("g", b"B");
        b.attributes.as_mut().unwrap().inode = 777;
        create(&other, b).await;
        recheck_while_renamed_elsewhere(&fs, &other, &old_move, "g", "k").await;
    }

    /// After a subscription gap an open file's change in the gap is seen (its entry is not
    /// among the caches a resync drops).
    #[tokio::test]
    async fn a_resync_rereads_open_files() {
        let (fs, other) = fs();
        put(&other, "f", b"old").await;
        let h = open(&fs, "f").await;
        put(&other, "f", b"in the gap").await;
        fs.resync();
        settle().await;
        assert_eq!(read_all(&fs, h).await, b"in the gap");
    }
}
