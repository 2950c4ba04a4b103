//! Coherence with other clients: the filer's metadata events applied to the caches and
//! open files, and the changes this node made lately (an event about them may be older).

use super::attr::entry_inode;
use super::file::{FileState, OpenFile};
use super::inode::join;
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

/// A change of an open file's filer entry or name in flight (see [`Fs::note_local`]).
pub(super) struct LocalChange(Option<Arc<OpenFile>>);

impl Drop for LocalChange {
    fn drop(&mut self) {
        if let Some(of) = &self.0 {
            let mut s = of.state.lock();
            s.local_inflight -= 1;
            s.changed_here();
        }
    }
}

impl Fs {
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
        for of in self.apply_event_now(ev) {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(self.clone().resync_open_file(of));
                }
                Err(_) => of.state.lock().resync = Default::default(),
            }
        }
        let Some(n) = ev.event_notification.as_ref() else {
            return;
        };
        let dir = ev.directory.as_str();
        let ndir = if n.new_parent_path.is_empty() {
            dir
        } else {
            n.new_parent_path.as_str()
        };
        let touched = n
            .old_entry
            .iter()
            .map(|o| (dir, o.name.as_str()))
            .chain(n.new_entry.iter().map(|e| (ndir, e.name.as_str())));
        for (d, name) in touched {
            if self.changed_here_lately(d, name) {
                self.meta.invalidate_dir(d, false);
                if let (Some(nt), Some(pino)) =
                    (self.notifier.read().clone(), self.inodes.ino_of(d))
                {
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
        LocalChange(of)
    }

    pub(super) fn remember_local(&self, dir: &str, name: &str) {
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
        loop {
            // the files lock is never taken under a file's state lock (the other order is used)
            let open = self.open_file(of.ino).is_some_and(|o| Arc::ptr_eq(&o, &of));
            let (dir, name, epoch, deleted) = {
                let mut s = of.state.lock();
                if !s.resync.wanted || !open {
                    s.resync = Default::default();
                    running.0 = None;
                    return;
                }
                if s.local_inflight > 0 {
                    (String::new(), String::new(), 0, false) // wait below
                } else {
                    s.resync.wanted = false;
                    let deleted = std::mem::take(&mut s.resync.deleted);
                    (s.dir.clone(), s.entry.name.clone(), s.epoch, deleted)
                }
            };
            if name.is_empty() {
                tokio::time::sleep(super::backoff(0)).await;
                continue;
            }
            let path = join(&dir, &name);
            let answer = self.look_again(&path, &dir, &name, of.ino).await;
            // Ok(true): the entry was replaced; Err: ask again
            let outcome: std::result::Result<bool, Option<super::FsError>> = {
                let mut s = of.state.lock();
                let moved_on = s.epoch != epoch
                    || s.local_inflight > 0
                    || (s.dir.as_str(), s.entry.name.as_str()) != (&dir, &name);
                match answer {
                    Ok(_) | Err(_) if moved_on => Err(None),
                    Err(e) => Err(Some(e)),
                    Ok(Some((e, resolved))) => {
                        let same = s.entry == e && *s.resolved == resolved;
                        if s.is_clean() && !same {
                            s.replace_entry(e, resolved);
                            Ok(true)
                        } else {
                            Ok(false)
                        }
                    }
                    Ok(None) => {
                        // a file whose create is still deferred was never the filer's to remove
                        if deleted && !s.pending_create {
                            s.unlinked = true;
                            s.epoch += 1;
                        }
                        Ok(false)
                    }
                }
            };
            match outcome {
                Ok(replaced) => {
                    attempt = 0;
                    if replaced {
                        self.bump_content_gen(of.ino);
                        if let Some(nt) = self.notifier.read().clone() {
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
                    tokio::time::sleep(super::backoff(attempt)).await;
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
    ) -> Result<Option<(pb::Entry, Vec<pb::FileChunk>)>> {
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let e = match self.filer.lookup_entry(dir, name).await {
            Ok(e) if entry_inode(path, &e) == ino => e,
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

    /// Applies `ev`; returns the open files whose entry must be read again from the filer.
    fn apply_event_now(&self, ev: &pb::SubscribeMetadataResponse) -> Vec<Arc<OpenFile>> {
        let mut doubtful = Vec::new();
        let Some(n) = ev.event_notification.as_ref() else {
            return doubtful;
        };
        let dir = ev.directory.as_str();
        let notifier = self.notifier.read().clone();
        if let Some(old) = &n.old_entry {
            let renamed_or_deleted = n
                .new_entry
                .as_ref()
                .map(|ne| ne.name != old.name)
                .unwrap_or(true)
                || (!n.new_parent_path.is_empty() && n.new_parent_path != dir);
            if renamed_or_deleted {
                self.meta.remove(dir, &old.name);
                // after the removal: a listing that missed this count cannot hold the name
                self.note_name_gone();
                let opath = join(dir, &old.name);
                if old.is_directory {
                    self.meta.invalidate_dir(&opath, true);
                }
                if let (Some(nt), Some(pino)) = (&notifier, self.inodes.ino_of(dir)) {
                    nt.inval_entry(pino, &old.name);
                }
                match &n.new_entry {
                    None => {
                        let ino = entry_inode(&opath, old);
                        // a hard-linked file may live on under other names: re-read, never unlink
                        let linked = !old.hard_link_id.is_empty() && old.hard_link_counter > 1;
                        let mut doubt = false;
                        if let Some(of) = self.open_file(ino) {
                            let mut s = of.state.lock();
                            doubt = self.doubtful(&s, dir, &old.name);
                            if doubt && s.want_resync(!linked) {
                                doubtful.push(of.clone());
                            }
                        }
                        self.name_removed(dir, &old.name, old, doubt);
                        // other names of a hard-linked file now have one link less
                        if let Some(nt) = &notifier {
                            nt.inval_inode(entry_inode(&opath, old));
                        }
                    }
                    Some(new) => {
                        // renamed by another client: our node ids and open files follow, and
                        // a file of ours it replaced must not be committed again
                        let ndir = if n.new_parent_path.is_empty() {
                            dir
                        } else {
                            n.new_parent_path.as_str()
                        };
                        let npath = join(ndir, &new.name);
                        let moving = entry_inode(&opath, old);
                        if let Some(replaced) = self.inodes.ino_of(&npath) {
                            if replaced != moving {
                                if let Some(of) = self.open_file(replaced) {
                                    // The event may predate our own change of that name: an
                                    // open file of ours with data to commit is then kept (its
                                    // commit wins, as the last writer does), never dropped.
                                    let mut s = of.state.lock();
                                    if !self.doubtful(&s, ndir, &new.name) {
                                        s.unlinked = true;
                                        s.epoch += 1;
                                    } else if s.want_resync(true) {
                                        doubtful.push(of.clone());
                                    }
                                }
                                self.inodes.unlink_path(&npath);
                            }
                        }
                        self.moved(&opath, &npath);
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
            let ino = entry_inode(&npath, new);
            if self.inodes.ino_of(&npath).is_some_and(|known| known != ino) {
                // the name leads to another file now (replaced by an upload)
                self.note_name_gone();
            }
            if let Some(of) = self.open_file(ino) {
                let mut s = of.state.lock();
                // A manifest entry needs its manifests fetched first: keep the old list
                // (its needles stay readable with readDeleted) until the next open. An event
                // about another name than the file has here (not a hard link) is older than
                // our rename of it: its entry is not this file's any more.
                let here = (s.dir.as_str(), s.entry.name.as_str()) == (ndir, new.name.as_str())
                    || !new.hard_link_id.is_empty();
                if here && s.is_clean() {
                    if self.doubtful(&s, ndir, &new.name) {
                        if s.want_resync(false) {
                            doubtful.push(of.clone());
                        }
                    } else if !crate::chunks::has_manifest(&new.chunks) {
                        s.replace_entry(new.clone(), new.chunks.clone());
                    }
                }
            }
            self.bump_content_gen(ino);
            if let Some(nt) = &notifier {
                if let Some(pino) = self.inodes.ino_of(ndir) {
                    nt.inval_entry(pino, &new.name);
                }
                nt.inval_inode(ino);
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

    /// After a subscription gap: drop every cached listing and kernel attribute.
    pub fn resync(&self) {
        self.meta.invalidate_all();
        if let Some(nt) = self.notifier.read().clone() {
            for rec in self.inodes.snapshot() {
                nt.inval_inode(rec.ino);
            }
        }
    }
}
