//! Open files and handles of [`Fs`]: open, handles re-created after a takeover, release, and
//! an open file taking the filer's current entry while it has nothing of its own.

use super::events::Identity;
use super::file::OpenFile;
use super::inode::split;
use super::{errno, now_parts, Fs, Handle, OpenEntry, Result};
use crate::pb::filer as pb;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Flushes a last close makes at most while changes keep reaching the file (each one
/// commits what arrived during the one before).
const CLOSE_ROUNDS: u32 = 16;

/// How long an open waits for the events that say where a name it found gone went.
const NAME_SETTLE: Duration = Duration::from_secs(2);

impl Fs {
    /// Takes the filer's entry `e` into an open file that has nothing of its own to commit.
    pub(super) async fn adopt_if_clean(&self, ino: u64, of: &Arc<OpenFile>, e: pb::Entry) {
        let resolved = if crate::chunks::has_manifest(&e.chunks) {
            match crate::chunks::expand_manifests(&e.chunks, self.store.as_ref()).await {
                Ok(r) => r,
                Err(err) => {
                    tracing::warn!(ino, error = %err, "manifest expansion failed; keeping the open file's entry");
                    return;
                }
            }
        } else {
            e.chunks.clone()
        };
        let mut s = of.state.lock();
        // renamed meanwhile: the entry looked up under the old name is not this file's now
        if !s.is_clean() || s.entry.name != e.name {
            return;
        }
        if s.entry.chunks != e.chunks
            || crate::chunks::file_size(&s.entry) != crate::chunks::file_size(&e)
        {
            self.bump_content_gen(ino);
        }
        s.replace_entry(e, resolved);
    }

    /// Before an open file's data changes: if it has nothing of its own, start from the
    /// filer's current entry (another node may have rewritten it since it was opened).
    ///
    /// A name gone from the filer is a move or a removal this node has not seen yet (or a
    /// rename of its own running meanwhile). The events say which: until they do, the file
    /// is looked for again at the name they (or a lookup) give it, for at most
    /// [`NAME_SETTLE`]. A removal, or no answer in that time, is ESTALE.
    pub(super) async fn refresh_if_clean(&self, ino: u64, of: &Arc<OpenFile>) -> Result<()> {
        // (the runtime's clock, as the pauses' own)
        let start = tokio::time::Instant::now();
        let mut pauses = crate::retry::NAME_EVENTS.pauses();
        let mut first = true;
        let mut forgotten: Option<(String, String)> = None;
        let deleted = |dir: &str, name: &str| {
            errno(
                libc::ESTALE,
                format!(
                    "{} was deleted or replaced elsewhere",
                    super::inode::join(dir, name)
                ),
            )
        };
        loop {
            let (dir, name, clean, unlinked, known) = {
                let s = of.state.lock();
                (
                    s.dir.clone(),
                    s.entry.name.clone(),
                    s.is_clean() && !s.pending_create && !s.unlinked,
                    s.unlinked,
                    Identity::of(&s.entry),
                )
            };
            if unlinked && !first {
                // an event said the name we missed was a removal
                return Err(deleted(&dir, &name));
            }
            if !clean {
                return Ok(());
            }
            first = false;
            // the read and the adoption take the entry's turn: a chmod (or xattr change) that
            // reached the filer between them would be undone by the stale entry adopted here,
            // which this file's next commit carries
            let turn = self.entry_lock(&dir, &name).lock().await;
            let path = super::inode::join(&dir, &name);
            let failed = match self.fresh_entry(&dir, &name).await {
                Ok(e) if self.is_open_file(&path, &e, ino, &known) => {
                    self.adopt_if_clean(ino, of, e).await;
                    return Ok(());
                }
                // another file holds the name (moved over it, or removed and made again):
                // taken as ours, its bytes would be changed and committed as ours
                Ok(_) => None,
                Err(e) if e.errno == libc::ENOENT => None,
                Err(e) => Some(e),
            };
            // not held across the invalidation below: it waits for the directory's lock,
            // which a rename or link there may hold while its handler waits for this turn
            drop(turn);
            if let Some(e) = failed {
                return Err(e);
            }
            // gone from this name on the filer: forgotten here, the kernel's entry too
            // (once per name: each time drops cached listings)
            let gone = Some((dir.clone(), name.clone()));
            if forgotten != gone {
                self.meta.remove(&dir, &name);
                self.note_name_gone();
                if let (Some(nt), Some(pino)) = (self.notifier(), self.inodes.ino_of(&dir)) {
                    nt.inval_entry(pino, &name);
                }
                forgotten = gone;
            }
            // moved elsewhere, its event not here yet, and a lookup since found it at
            // its new name (the kernel opens what that lookup gave it): it is there
            // now. Said ESTALE, the kernel's second walk finds the same node and fails
            // for good.
            if self.found_moved(ino, of, &dir, &name).await {
                return Ok(());
            }
            // deleted elsewhere and its event lost, or a name that keeps moving: a
            // commit would bring it back with chunks the filer already deleted.
            // ESTALE makes the kernel walk the path again (an O_CREAT open then
            // creates a new file instead of failing).
            if start.elapsed() >= NAME_SETTLE {
                return Err(deleted(&dir, &name));
            }
            let renamed = {
                let s = of.state.lock();
                (s.dir.as_str(), s.entry.name.as_str()) != (dir.as_str(), name.as_str())
            };
            // moved by a rename of this node or an event meanwhile: look there at once
            if !renamed {
                tokio::time::sleep(pauses.next_pause()).await;
            }
        }
    }

    /// Whether open file `of` (node `ino`), gone from `dir/name`, is at the name the node
    /// table has for it now (a lookup found it there), as the filer confirms: then it is
    /// moved there, with the filer's entry taken if it has nothing of its own.
    async fn found_moved(&self, ino: u64, of: &Arc<OpenFile>, dir: &str, name: &str) -> bool {
        let old = super::inode::join(dir, name);
        let Ok(now) = self.path_of(ino) else {
            return false;
        };
        if now == old {
            return false;
        }
        let (ndir, nname) = split(&now);
        let turn = self.entry_lock(&ndir, &nname).lock().await;
        let fresh = match self.fresh_entry(&ndir, &nname).await {
            Ok(e) if e.hard_link_id.is_empty() && self.is_node(&now, &e, ino) => e,
            _ => return false,
        };
        {
            let mut s = of.state.lock();
            // changed meanwhile (an event moved or removed it, a lookup numbered it
            // elsewhere): that decides. Checked and moved in one step.
            let still = (s.dir.as_str(), s.entry.name.as_str()) == (dir, name)
                && !s.unlinked
                && self.inodes.path(ino).as_deref() == Some(now.as_str());
            if !still {
                return false;
            }
            (s.dir, s.entry.name) = split(&now);
        }
        tracing::debug!(from = %old, to = %now, "an open file moved elsewhere was found at its new name");
        self.adopt_if_clean(ino, of, fresh).await;
        drop(turn);
        true
    }

    /// Counts one more handle on `ino`'s open-file state and returns that state. The count
    /// and the lookup are one step: a last release running concurrently (on another thread)
    /// may have removed `file` from the table after the caller found it, and a handle on a
    /// state the table no longer has would see its writes vanish from getattr and setattr.
    /// None if `file` was retired meanwhile (its chunks deleted): the caller loads it again.
    pub(super) fn register_open(&self, ino: u64, file: Arc<OpenFile>) -> Option<Arc<OpenFile>> {
        let mut files = self.files.lock();
        if !files.contains_key(&ino) && file.state.lock().retired {
            return None;
        }
        let o = files
            .entry(ino)
            .or_insert_with(|| OpenEntry { file, handles: 0 });
        o.handles += 1;
        Some(o.file.clone())
    }

    /// `ino`'s open-file state with one more handle counted on it.
    async fn open_counted(&self, ino: u64, by_name: bool) -> Result<Arc<OpenFile>> {
        // a retired state is replaced by a fresh load at once; only a close racing every
        // load could retire each in turn
        for _ in 0..3 {
            let of = self.open_inode(ino, by_name).await?;
            if let Some(of) = self.register_open(ino, of) {
                return Ok(of);
            }
        }
        Err(errno(
            libc::ESTALE,
            "the file was closed while being opened",
        ))
    }

    /// A new handle on `file`, already counted by [`Self::register_open`].
    fn insert_handle(&self, ino: u64, file: Arc<OpenFile>, writable: bool) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(
            fh,
            Arc::new(Handle {
                ino,
                file,
                writable,
                seq: parking_lot::Mutex::new((0, 0)),
            }),
        );
        fh
    }

    /// A handle on a state just made (create): nothing can have retired it.
    pub(super) fn add_handle(&self, ino: u64, file: Arc<OpenFile>, writable: bool) -> Result<u64> {
        let file = self
            .register_open(ino, file)
            .ok_or_else(|| errno(libc::EIO, "a new file was closed before its first handle"))?;
        Ok(self.insert_handle(ino, file, writable))
    }

    /// A handle by number; after a takeover the kernel may present handles of the previous
    /// process, which are re-created on first use.
    pub async fn handle(&self, fh: u64, ino: u64) -> Result<Arc<Handle>> {
        if let Some(h) = self.handles.lock().get(&fh) {
            return Ok(h.clone());
        }
        self.verifier.adopted_handle(fh, ino);
        let file = self.open_counted(ino, false).await?;
        let h = Arc::new(Handle {
            ino,
            file,
            writable: !self.cfg.read_only,
            seq: parking_lot::Mutex::new((0, 0)),
        });
        let raced = {
            let mut hs = self.handles.lock();
            match hs.get(&fh) {
                Some(other) => Some(other.clone()),
                None => {
                    hs.insert(fh, h.clone());
                    None
                }
            }
        };
        match raced {
            // another request re-created it first: give back the count taken above
            Some(other) => {
                if let Some(o) = self.files.lock().get_mut(&ino) {
                    o.handles = o.handles.saturating_sub(1);
                }
                Ok(other)
            }
            None => Ok(h),
        }
    }

    /// The open-file state of `ino`, loaded if it is not open. `by_name`: for a new open from
    /// the kernel (which can look the name up again); a handle re-created after a takeover
    /// cannot, and keeps using the file its name leads to.
    pub(super) async fn open_inode(&self, ino: u64, by_name: bool) -> Result<Arc<OpenFile>> {
        if let Some(of) = self.open_file(ino) {
            return Ok(of);
        }
        let path = self.path_of(ino)?;
        let (dir, name) = split(&path);
        let e = match self.entry_at(&dir, &name).await {
            Ok(e) => e,
            // The kernel opens a node it still has a name for, but the name is gone (deleted
            // by another client; the kernel's entry outlived our invalidation). ESTALE makes
            // it walk the path again: a plain open then fails with ENOENT, an O_CREAT open
            // creates the file, instead of failing with ENOENT.
            Err(err) if by_name && err.errno == libc::ENOENT => {
                return Err(errno(libc::ESTALE, format!("{path}: {}", err.msg)))
            }
            Err(err) => return Err(err),
        };
        // the name leads to another file now (deleted and created again elsewhere): this node
        // is not that file (entries without an inode attribute are known by path only)
        let numbered = e.attributes.as_ref().is_some_and(|a| a.inode != 0);
        if by_name && numbered && e.hard_link_id.is_empty() && !self.is_node(&path, &e, ino) {
            return Err(errno(libc::ESTALE, format!("{path} is another file now")));
        }
        if e.is_directory {
            return Err(errno(libc::EISDIR, format!("{path} is a directory")));
        }
        let of = self.load_open_file(ino, &dir, (*e).clone()).await?;
        Ok(self.install_open(ino, of))
    }

    /// Open-file state for `entry` (manifests expanded, remote content cached), not registered.
    async fn load_open_file(&self, ino: u64, dir: &str, mut entry: pb::Entry) -> Result<OpenFile> {
        if entry.chunks.iter().any(|c| c.is_chunk_manifest) {
            let resolved =
                crate::chunks::expand_manifests(&entry.chunks, self.store.as_ref()).await?;
            let of = OpenFile::new(
                ino,
                dir.to_string(),
                entry,
                self.cfg.chunk_size,
                self.cfg.max_dirty_slots,
            )
            .with_budget(self.cfg.budget.clone());
            {
                let mut s = of.state.lock();
                s.max_ts = s
                    .max_ts
                    .max(resolved.iter().map(|c| c.modified_ts_ns).max().unwrap_or(0));
                s.resolved = Arc::new(resolved);
            }
            return Ok(of);
        }
        if entry
            .remote_entry
            .as_ref()
            .map(|r| r.remote_size > 0)
            .unwrap_or(false)
            && entry.chunks.is_empty()
        {
            entry = self.cache_remote(dir, &entry.name).await?;
        }
        Ok(OpenFile::new(
            ino,
            dir.to_string(),
            entry,
            self.cfg.chunk_size,
            self.cfg.max_dirty_slots,
        )
        .with_budget(self.cfg.budget.clone()))
    }

    async fn cache_remote(&self, dir: &str, name: &str) -> Result<pb::Entry> {
        Err(errno(
            libc::EIO,
            format!("{dir}/{name} lives only in remote storage; cache it on the filer first"),
        ))
    }

    fn install_open(&self, ino: u64, of: OpenFile) -> Arc<OpenFile> {
        let mut files = self.files.lock();
        files
            .entry(ino)
            .or_insert_with(|| OpenEntry {
                file: Arc::new(of),
                handles: 0,
            })
            .file
            .clone()
    }

    /// open(2). Returns the handle and whether the kernel may keep its page cache.
    pub async fn open(&self, ino: u64, flags: i32) -> Result<u64> {
        let acc = flags & libc::O_ACCMODE;
        let writable = acc == libc::O_WRONLY || acc == libc::O_RDWR;
        if writable || flags & libc::O_TRUNC != 0 {
            self.check_writable()?;
        }
        let of = self.open_counted(ino, true).await?;
        let fh = self.insert_handle(ino, of, writable);
        let Some(of) = self.handles.lock().get(&fh).map(|h| h.file.clone()) else {
            return Err(errno(libc::EIO, "handle vanished while opening"));
        };
        if writable {
            // close-to-open for writers: what this handle writes is laid over the filer's
            // current chunk list, not one cached before another node's last close
            if let Err(e) = self.refresh_if_clean(ino, &of).await {
                let _ = self.release(fh, ino).await;
                return Err(e);
            }
        }
        if flags & libc::O_TRUNC != 0 && writable {
            // the truncate waits for uploads in flight: none may be held back for batching
            self.store.expedite();
            of.truncate(0).await;
            self.verifier.dirtied(ino);
            {
                let mut s = of.state.lock();
                let a = s.entry.attributes.get_or_insert_with(Default::default);
                (a.mtime, a.mtime_ns) = now_parts();
                (a.ctime, a.ctime_ns) = (a.mtime, a.mtime_ns);
            }
            self.bump_content_gen(ino);
        }
        Ok(fh)
    }

    /// Whether the kernel's cached pages of `ino` are still valid for a new open.
    pub fn keep_cache(&self, ino: u64) -> bool {
        let cur = *self.content_gen.lock().get(&ino).unwrap_or(&0);
        let prev = self.opened_gen.lock().insert(ino, cur);
        prev == Some(cur)
    }

    pub(super) fn forget_content_gen(&self, ino: u64) {
        self.content_gen.lock().remove(&ino);
        self.opened_gen.lock().remove(&ino);
    }

    pub(super) fn bump_content_gen(&self, ino: u64) {
        *self.content_gen.lock().entry(ino).or_default() += 1;
    }

    pub async fn release(&self, fh: u64, ino: u64) -> Result<()> {
        self.verifier.released(fh);
        let h = self.handles.lock().remove(&fh);
        let Some(of) = h.map(|h| h.file.clone()) else {
            // a handle of a previous process never used here: it was never counted, so it
            // must not count the file down (a live handle would lose its state at 0)
            return match self.open_file(ino) {
                Some(of) => self.flush_file(&of).await,
                None => Ok(()),
            };
        };
        let last = {
            let mut files = self.files.lock();
            match files.get_mut(&ino) {
                Some(o) => {
                    o.handles = o.handles.saturating_sub(1);
                    o.handles == 0
                }
                None => false,
            }
        };
        let mut r = self.flush_file(&of).await;
        if last {
            // a change that reached the state while the final flush ran (a chmod deferred
            // into it) is committed too; only a close whose flush failed leaves one behind
            let mut rounds = 0;
            while !self
                .retire(ino, &of, r.is_err() || rounds == CLOSE_ROUNDS)
                .await
            {
                rounds += 1;
                r = self.flush_file(&of).await;
            }
            if r.is_ok() && rounds == CLOSE_ROUNDS && of.state.lock().meta_dirty {
                tracing::error!(path = %of.path(), rounds,
                    "changes kept arriving during the last close; the latest were not committed");
            }
            // (not after an ESTALE: the name may lead to another file now)
            if r.as_ref().is_err_and(|e| e.errno == libc::EIO) || rounds == CLOSE_ROUNDS {
                self.salvage_deferred_attrs(&of).await;
            }
        }
        r
    }

    /// After the last handle's flush: the state leaves the open files, and the chunks only
    /// it knew (uploaded but carried by no commit: it failed for good, or the file was
    /// unlinked) are deleted. Under the commit lock, so no commit of the state is in flight,
    /// and retired in the same step, so none can follow (commits of unknown outcome already
    /// gave up their chunks, see [`OpenFile::keep_carried`]). False, and nothing done, if
    /// the state has a change to commit and `give_up` is not set: flush it first.
    async fn retire(&self, ino: u64, of: &Arc<OpenFile>, give_up: bool) -> bool {
        let _commit = of.commit.lock().await;
        let (orphans, pending) = {
            let mut files = self.files.lock();
            let still_last = files
                .get(&ino)
                .is_some_and(|o| o.handles == 0 && Arc::ptr_eq(&o.file, of));
            if !still_last {
                return true;
            }
            let mut s = of.state.lock();
            if s.meta_dirty && !s.unlinked && !give_up {
                return false;
            }
            files.remove(&ino);
            // before retiring: a retired file drops lost runs unreported
            of.settle_lost(&mut s);
            s.retired = true;
            // (an unlinked or replaced one's name may be another file's now)
            let pending =
                (s.pending_create && !s.unlinked).then(|| (s.dir.clone(), s.entry.name.clone()));
            let orphans = s.take_orphans();
            drop(s);
            // in the files lock: an open that follows starts a new dirty record after this
            self.verifier.closed(ino);
            (orphans, pending)
        };
        // never created on the filer: the name this node showed for it goes with it (unless
        // another file took it meanwhile)
        if let Some((dir, name)) = pending {
            let path = super::inode::join(&dir, &name);
            if matches!(self.meta.lookup(&dir, &name), super::meta::Cached::Found(cur) if self.is_node(&path, &cur, ino))
            {
                self.meta.remove(&dir, &name);
            }
        }
        if let Some(e) = of.unplaced() {
            let lost: usize = of
                .state
                .lock()
                .inflight
                .iter()
                .filter(|i| i.failed)
                .map(|i| i.data.len())
                .sum();
            tracing::error!(path = %of.path(), lost_bytes = lost, error = %e,
                "last handle closed with data that could not be placed; it is dropped");
        }
        if !orphans.is_empty() {
            tracing::info!(path = %of.path(), count = orphans.len(),
                "deleting chunks no entry references after the last close");
        }
        self.delete_orphans(orphans);
        true
    }
}
