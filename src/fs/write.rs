//! The write path of [`Fs`]: writes into open files, background chunk uploads (retried
//! through short outages), and commits of the entry to the filer (chunk manifests, orphans).

use super::events::Identity;
use super::file::{CommitSnapshot, OpenFile, Rebased, SealedRun};
use super::inode::join;
use super::{errno, now_parts, ChunkCondition, Fs, Result};
use crate::filer::FilerError;
use crate::pb::filer as pb;
use crate::volume::VolumeError;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
// (deadlines on the runtime's clock, as the retry pauses' own: paused-time tests stay exact)
use tokio::time::Instant;

/// A write on its way into an open file: [`Fs::write_target`] found the file (it may wait,
/// but does not hold the bytes), [`Fs::write_into`] copies the bytes in without waiting.
pub struct WriteTarget(Arc<OpenFile>);

/// Bytes copied into an open file; [`Fs::write_done`] starts the uploads of the chunks they
/// filled.
pub struct Written {
    of: Arc<OpenFile>,
    runs: Vec<SealedRun>,
}

impl Fs {
    /// Writes `data` at `offset`: [`Self::write_target`], [`Self::write_into`] and
    /// [`Self::write_done`] in turn. The FUSE adapter calls them one by one, so that a write
    /// whose first step does not wait copies its bytes straight from the kernel's buffer.
    pub async fn write(&self, fh: u64, ino: u64, offset: u64, data: &[u8]) -> Result<u32> {
        let target = self.write_target(fh, ino, data.len()).await?;
        let written = self.write_into(target, offset, data);
        self.write_done(written).await;
        Ok(data.len() as u32)
    }

    /// The open file a write of `len` bytes goes into, once the quota allows them and the
    /// node's dirty budget has room (the waits a write may have).
    pub async fn write_target(&self, fh: u64, ino: u64, len: usize) -> Result<WriteTarget> {
        self.check_writable()?;
        let h = self.handle(fh, ino).await?;
        self.verifier.check(fh)?;
        let of = h.file.clone();
        // no more bytes pile up behind data that cannot be placed; fsync retries it
        let placed = || match of.unplaced() {
            Some(e) => Err(errno(
                libc::EIO,
                format!("earlier upload failed (fsync retries it): {e}"),
            )),
            None => Ok(()),
        };
        placed()?;
        // checked again after any wait (not on the path of a write that does not wait)
        let mut waited = false;
        let quota = self.quota();
        if quota > 0 {
            let pending: u64 = of.state.lock().uncommitted;
            if self.used_bytes.load(Ordering::Relaxed) + pending + len as u64 > quota {
                self.refresh_usage().await;
                waited = true;
                if self.used_bytes.load(Ordering::Relaxed) + pending + len as u64 > quota {
                    return Err(errno(libc::ENOSPC, "volume quota exceeded"));
                }
            }
        }
        if self.cfg.budget.dirty_over() {
            self.make_room(&of).await;
            waited = true;
        }
        if waited {
            // an upload may have failed while this waited (the quota's filer call, or room
            // the failure itself made: failed runs hold no budget)
            placed()?;
        }
        Ok(WriteTarget(of))
    }

    /// Copies `data` into the file at `offset` (never waits).
    pub fn write_into(&self, target: WriteTarget, offset: u64, data: &[u8]) -> Written {
        let of = target.0;
        let runs = of.write(offset, data);
        self.verifier.dirtied(of.ino);
        {
            let mut s = of.state.lock();
            let (sec, ns) = now_parts();
            let a = s.entry.attributes.get_or_insert_with(Default::default);
            a.mtime = sec;
            a.mtime_ns = ns;
            a.ctime = sec;
            a.ctime_ns = ns;
        }
        Written { of, runs }
    }

    /// Starts the uploads of the chunks a write filled (waits for upload slots).
    pub async fn write_done(&self, written: Written) {
        if !written.runs.is_empty() {
            self.start_uploads(&written.of, written.runs, false).await;
        }
    }

    /// The node's dirty data is over its budget: this file's dirty bytes start uploading,
    /// every session is asked to do the same, and the writer waits for room.
    async fn make_room(&self, of: &Arc<OpenFile>) {
        let runs = of.seal_all();
        if !runs.is_empty() {
            self.start_uploads(of, runs, true).await;
        }
        self.cfg.budget.wait_for_room().await;
    }

    /// Answers writers waiting for room in the node's budget (see [`Self::make_room`]):
    /// the dirty bytes of every file open here start uploading. Runs until the task is
    /// aborted with the session.
    pub async fn relieve_memory_pressure(&self) {
        loop {
            self.cfg.budget.pressed().await;
            let open: Vec<Arc<OpenFile>> =
                self.files.lock().values().map(|o| o.file.clone()).collect();
            for of in open {
                let runs = of.seal_all();
                if !runs.is_empty() {
                    self.start_uploads(&of, runs, true).await;
                }
            }
        }
    }

    /// Starts background uploads; waits for an upload slot first (backpressure on writers).
    /// `awaited`: the caller (a flush) waits for these, so the store must not hold them back.
    pub(crate) async fn start_uploads(
        &self,
        of: &Arc<OpenFile>,
        runs: Vec<SealedRun>,
        awaited: bool,
    ) {
        let path = of.path();
        let syncs = of.state.lock().syncs_often(of.chunk_size as u64);
        let sealed_at = crate::volume::md5x::generation();
        for mut run in runs {
            let permit = match self.upload_sem.clone().try_acquire_owned() {
                Ok(p) => Ok(p),
                Err(_) => {
                    // every slot is taken. Chunks wait for companions only while fewer than
                    // a batch are queued, so with two batches' worth of slots most of them
                    // are being hashed or sent and one frees as fast as volume servers answer;
                    // kicking the batch then only hashed a busy writer's chunks one or two at
                    // a time. With fewer slots, the held-back ones may be most of them: let
                    // them go, or this writer waits out their batching delay.
                    if self.cfg.concurrent_writers < 2 * self.store.batch_width() {
                        self.store.expedite();
                    }
                    self.upload_sem.clone().acquire_owned().await
                }
            };
            let permit = match permit {
                Ok(p) => p,
                Err(_) => {
                    run.started();
                    of.upload_done(run.id, Err("shutting down".into()));
                    continue;
                }
            };
            let store = self.store.clone();
            let mut opts = self.upload_options(&path);
            opts.may_wait = (!awaited).then_some(sealed_at);
            opts.md5 = run.md5.take();
            opts.syncs = syncs;
            let of = of.clone();
            let stats_bytes = run.data.len() as u64;
            self.stats.uploads.fetch_add(1, Ordering::Relaxed);
            self.stats
                .upload_bytes
                .fetch_add(stats_bytes, Ordering::Relaxed);
            let fs_stats = crate::metrics::global();
            let cache = self.cache.clone();
            let retry_for = self.cfg.upload_retry;
            let deletes = self.deletes.clone();
            tokio::spawn(async move {
                let done = UploadDone(Some((of, run.id)));
                // from here `done` settles it, however the task ends
                run.started();
                let data = std::mem::take(&mut run.data);
                let r = upload_with_retry(store.as_ref(), data.clone(), &opts, retry_for).await;
                let key = r.as_ref().ok().map(super::read::chunk_key);
                fs_stats.upload_done(r.is_ok());
                if let Some(fid) = done.finish(r.map_err(|e| e.to_string())) {
                    // its file was closed for good meanwhile: no entry will list it (deleted
                    // apart, so a slow volume server does not hold the upload slot)
                    deletes.spawn(store.clone(), vec![fid]);
                } else if let Some(key) = key.filter(|_| run.offset == 0 || data.len() <= 1 << 20) {
                    // keep what we just wrote: reading it back is common
                    cache.insert(key, data).await;
                }
                drop(permit);
            });
        }
    }

    /// [`Self::commit_file`]; the verifier then forgets the file if nothing is left to commit.
    pub async fn flush_file(&self, of: &Arc<OpenFile>) -> Result<()> {
        let r = self.commit_file(of).await;
        // only the inode's current open state speaks for it: a flush of one replaced
        // meanwhile must not clear a newer one's record (the files lock keeps it current)
        let files = self.files.lock();
        if files.get(&of.ino).is_some_and(|o| Arc::ptr_eq(&o.file, of)) {
            self.verifier.settled(of);
        }
        drop(files);
        r
    }

    /// Uploads everything dirty and commits the entry. Data acknowledged here is on the filer.
    async fn commit_file(&self, of: &Arc<OpenFile>) -> Result<()> {
        let mut rebases = 0;
        let mut pass = 0;
        let mut held_but_refused = false;
        let mut held_refusals = 0;
        let start = Instant::now();
        let mut rebase_pauses = crate::retry::REBASE.pauses();
        loop {
            let refused = pass > 0;
            let outcome = self.commit_pass(of, refused).await?;
            let outcome = match outcome {
                // (every refusal is another client's commit or move that got through: a busy
                // file is retried as long as an unreachable filer would be, never failed
                // for being busy)
                Pass::Changed(base)
                    if rebases < MIN_REBASES || start.elapsed() < self.cfg.upload_retry =>
                {
                    rebases += 1;
                    if rebases > 1 {
                        // written (or moved) again and again elsewhere: let a commit
                        // through, at moments spread apart from the other writers'
                        tokio::time::sleep(rebase_pauses.next_pause()).await;
                    }
                    match self.rebase(of, &base).await? {
                        Rebase::Done => continue,
                        // a filer that checks the condition refused it for a reason: the
                        // name was away just then (moved away and back). Bounded by count:
                        // a filer refusing a condition that holds for some other reason must
                        // not hold each flush for the whole retry time.
                        Rebase::HeldButRefused if self.filer_checks_chunks().await => {
                            held_refusals += 1;
                            if held_refusals > MAX_HELD_REFUSALS {
                                return Err(errno(
                                    libc::EIO,
                                    format!(
                                        "{}: the filer refused {MAX_HELD_REFUSALS} commits onto the chunk list it has (the name away each time?)",
                                        of.path()
                                    ),
                                ));
                            }
                            continue;
                        }
                        Rebase::HeldButRefused if !held_but_refused => {
                            // (once may be a move away and back between the two)
                            held_but_refused = true;
                            continue;
                        }
                        Rebase::HeldButRefused => {
                            if !self.no_chunk_condition.swap(true, Ordering::Relaxed) {
                                tracing::warn!(path = %of.path(), "the filer refuses a chunk list condition that holds (SeaweedFS before 4.41?): commits of this volume no longer merge concurrent writers' chunks, the last writer wins");
                            }
                            continue;
                        }
                        // (its name is gone, or holds a directory or another file now)
                        Rebase::NameGone => Pass::NameGone,
                    }
                }
                Pass::Changed(_) => {
                    return Err(errno(
                        libc::EIO,
                        format!(
                            "{}: changed by other clients under each of {rebases} commits in {:?}",
                            of.path(),
                            start.elapsed()
                        ),
                    ))
                }
                other => other,
            };
            pass += 1;
            match outcome {
                Pass::Done => return Ok(()),
                Pass::NameGone if pass <= NAME_GONE_PASSES => {
                    // removed or moved away on the filer after the name was checked, its
                    // event not here yet: the name is in doubt, so the next pass waits a
                    // little for that event (a removal unlinks the file, a move moves it)
                    // and says ESTALE without one. Taken as a removal, a move elsewhere
                    // would drop the writes. A hard link moves to another name of its group
                    // the filer confirms, as at a removal. (An answer asked for before is
                    // stale now.)
                    let mut s = of.state.lock();
                    s.name_doubt = true;
                    if super::attr::has_other_links(&s.entry) {
                        s.removal_doubt = true;
                    }
                    s.epoch += 1;
                }
                Pass::NameGone | Pass::Changed(_) => break,
            }
        }
        Err(errno(
            libc::ESTALE,
            format!("{}: its name kept going away under its commit", of.path()),
        ))
    }

    /// One try of [`Self::commit_file`]; `refused`: the filer refused the last one, its
    /// name gone.
    async fn commit_pass(&self, of: &Arc<OpenFile>, refused: bool) -> Result<Pass> {
        // what an earlier flush could not place is tried again first (same order stamps)
        let mut runs = of.retry_failed();
        runs.extend(of.seal_all());
        // chunks written earlier and held back for batching are waited for now
        self.store.expedite();
        if !runs.is_empty() {
            self.start_uploads(of, runs, true).await;
        }
        of.wait_uploads().await;
        let _commit = of.commit.lock().await;
        let (dirty, unlinked, retired) = {
            let s = of.state.lock();
            (s.meta_dirty, s.unlinked, s.retired)
        };
        if retired {
            // its chunks of ours were deleted at the last close: a commit would list them.
            // Nothing lost if it had nothing left to commit (the close committed it) or is
            // unlinked (never to be committed anyway).
            if !dirty || unlinked {
                return Ok(Pass::Done);
            }
            return Err(errno(
                libc::ESTALE,
                format!("{}: closed meanwhile; look it up again", of.path()),
            ));
        }
        if let Some(e) = of.unplaced() {
            return Err(errno(libc::EIO, format!("upload failed: {e}")));
        }
        if !dirty || unlinked {
            return Ok(Pass::Done);
        }
        self.confirm_name(of, refused).await?;
        if of.state.lock().unlinked {
            // a removal by another client, confirmed by the check: not created again
            return Ok(Pass::Done);
        }
        // read after the check: a move applied meanwhile (or the check moving a hard-linked
        // file to its other name) changed name and directory together
        let (dir, created) = {
            let s = of.state.lock();
            (s.dir.clone(), !s.pending_create)
        };
        let mut snap = of.entry_for_commit();
        self.manifestize(of, &mut snap).await;
        // from here the filer may take what the snapshot carries: unless the commit is known
        // to have failed before sending or succeeded, its chunks are never deleted by us,
        // also when this future is dropped mid-request (a caller's timeout)
        let mut inflight = CarriedUnlessSettled {
            of,
            snap: Some(snap),
        };
        let start = Instant::now();
        let mut attempt = 0;
        let mut pauses = crate::retry::STORAGE.pauses();
        loop {
            if attempt > 0 && of.state.lock().unlinked {
                // removed while we retried: committing now would bring it back (an attempt
                // before may still have landed: the guard keeps what it carried)
                return Ok(Pass::Done);
            }
            let snap = inflight.snap.as_mut().expect("just set");
            let link_news = of.state.lock().link_news;
            let r = match self
                .take_link_group(of, &dir, &mut snap.entry, link_news)
                .await
            {
                // its link group is gone with every name (removed elsewhere, the events
                // not here yet): waited for like a refusal. Given back, the name would list
                // the chunks the group's removal deleted.
                Ok(Place::Gone) => return Ok(Pass::NameGone),
                Ok(place) => {
                    // a file the filer has is stored only over its entry: after a removal
                    // elsewhere the commit would create the name again, listing chunks the
                    // removal deleted (a hard link's name given back is created, as before).
                    // A plain file's is stored only over the chunks it was built on: another
                    // node's commit since would lose its chunks (the filer deletes what a
                    // commit leaves out), so that one is rebased onto it first.
                    let plain = snap.entry.hard_link_id.is_empty() && link_news == 0;
                    let on_chunks = matches!(place, Place::Here)
                        && created
                        && plain
                        && !self.no_chunk_condition.load(Ordering::Relaxed);
                    let condition = match place {
                        Place::Here if on_chunks => {
                            Some(super::entries::exists_with_chunks(&snap.base))
                        }
                        Place::Here if created => Some(super::entries::must_exist()),
                        _ => None,
                    };
                    match self
                        .create_on_filer_if(&dir, &snap.entry, false, condition)
                        .await
                    {
                        // (also after an attempt that failed unanswered and landed: the
                        // rebase keeps every chunk the file has here as it is)
                        Err(FilerError::Changed(m)) if on_chunks => {
                            tracing::info!(path = %of.path(), m, "the file changed on the filer under a commit; rebasing onto it");
                            let base = snap.base.clone();
                            // refused: this attempt stored nothing (its changes go back to
                            // the file, to be carried by the rebased commit). An attempt
                            // before that failed unanswered may have landed, listing what
                            // it carried: then the guard gives those chunks up instead.
                            if attempt == 0 {
                                let refused = inflight.snap.take().expect("not settled yet");
                                self.delete_orphans(of.refused(refused));
                            } else {
                                drop(inflight);
                            }
                            return Ok(Pass::Changed(base));
                        }
                        Err(FilerError::Changed(m)) => {
                            tracing::info!(path = %of.path(), m, "the name went away under a commit; checking it again");
                            return Ok(Pass::NameGone);
                        }
                        r => r.map_err(super::FsError::from),
                    }
                }
                Err(e) => Err(e),
            };
            if r.is_ok() {
                self.link_group_committed(of, &snap.entry, link_news);
            }
            match r {
                Ok(()) => break,
                Err(e) if e.errno == libc::EIO && start.elapsed() < self.cfg.upload_retry => {
                    let wait = pauses.next_pause();
                    attempt += 1;
                    tracing::warn!(path = %of.path(), error = %e, attempt, "commit failed, retrying");
                    tokio::time::sleep(wait).await;
                }
                // the filer may have stored it anyway: the guard keeps what it carried
                Err(e) => return Err(e),
            }
        }
        let snap = inflight.snap.take().expect("settled once");
        let unfolded =
            !snap.folded.is_empty() && !of.manifestized(&snap.folded, snap.manifests.clone());
        let orphans = of.committed(&snap);
        if unfolded {
            of.state.lock().filer_folded = crate::volume::fid::chunk_file_ids(&snap.folded);
        }
        self.delete_orphans(orphans);
        self.meta.upsert(&dir, Arc::new(snap.entry));
        Ok(Pass::Done)
    }

    /// A hard-linked file's commit writes its link group's record whole, count included, and
    /// other nodes add and remove names without this file taking their counts while it has
    /// data to commit: the count is the filer's at the time of the commit. One too low, and
    /// the filer deletes the group's content at the removal of a name while another still
    /// shows it; one too high, and the content outlives every name. A file that another
    /// node made a hard link meanwhile (`link_news`) joins the group the filer has at its
    /// name, if that entry is this file: committed as a plain file it would leave the group,
    /// and its other names would keep the old content. (A name added or removed between
    /// this lookup and the commit is still missed: the filer has no conditional update of
    /// the record.)
    async fn take_link_group(
        &self,
        of: &OpenFile,
        dir: &str,
        e: &mut pb::Entry,
        link_news: u32,
    ) -> Result<Place> {
        let linked = !e.hard_link_id.is_empty();
        if !linked && link_news == 0 {
            return Ok(Place::Here);
        }
        let path = join(dir, &e.name);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let looked = self.filer.lookup_entry(dir, &e.name).await;
        let absent = matches!(looked, Err(FilerError::NotFound(_)));
        match looked {
            Ok(cur) if linked && cur.hard_link_id == e.hard_link_id => {
                e.hard_link_counter = cur.hard_link_counter.max(1);
            }
            Ok(cur)
                if !linked
                    && !cur.hard_link_id.is_empty()
                    && !cur.is_directory
                    && self.is_node(&path, &cur, of.ino) =>
            {
                e.hard_link_id = cur.hard_link_id;
                e.hard_link_counter = cur.hard_link_counter.max(1);
            }
            // the commit puts a hard link's name back (moved away unseen, which
            // `confirm_name` lets a hard link do): one name more than at another name
            Ok(_) | Err(FilerError::NotFound(_)) if linked => {
                let count = match self.other_link(of, &path).await {
                    Some((_, n)) => Some(n),
                    // no name known here leads to the group: its shared record says
                    // whether it still has names (ones this node never met)
                    None if absent => {
                        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
                        match self.filer.link_group(&e.hard_link_id).await {
                            Ok(Some(rec)) => Some(rec.hard_link_counter),
                            Ok(None) => return Ok(Place::Gone),
                            Err(err) => {
                                tracing::warn!(path, error = %err, "reading a link group's record failed; giving its name back");
                                None
                            }
                        }
                    }
                    None => None,
                };
                if let Some(n) = count {
                    e.hard_link_counter = n.max(1).saturating_add(1);
                }
                return Ok(if absent { Place::PutBack } else { Place::Here });
            }
            Ok(_) | Err(FilerError::NotFound(_)) => {}
            Err(err) => return Err(err.into()),
        }
        Ok(Place::Here)
    }

    /// After a commit: the open file shows the link group it committed (with data to commit,
    /// it takes no entry from events), and the events it answered are settled.
    fn link_group_committed(&self, of: &OpenFile, e: &pb::Entry, link_news: u32) {
        let changed = {
            let mut s = of.state.lock();
            s.link_news = s.link_news.saturating_sub(link_news);
            if s.link_news == 0 {
                s.seen_link = None;
            }
            let ours = s.entry.hard_link_id.is_empty() || s.entry.hard_link_id == e.hard_link_id;
            let changed = !e.hard_link_id.is_empty()
                && ours
                && (s.entry.hard_link_id != e.hard_link_id
                    || s.entry.hard_link_counter != e.hard_link_counter);
            if changed {
                s.entry.hard_link_id = e.hard_link_id.clone();
                s.entry.hard_link_counter = e.hard_link_counter;
            }
            changed
        };
        if let (true, Some(nt)) = (changed, self.notifier()) {
            nt.inval_attr(of.ino);
        }
    }

    /// Before a commit of a file whose name is in doubt (see [`FileState::name_doubt`]):
    /// the commit creates or replaces the entry at its name, and after another client moved
    /// the file unseen that would bring the old name back with chunks the moved entry also
    /// lists (deleting either then deletes the other's data). So the name must still lead
    /// to the file; a missing name is asked again for a few seconds (the missed move may
    /// still arrive as a replayed event), then it is ESTALE. A file an event said was removed
    /// (see [`FileState::removal_doubt`]) and not found is unlinked instead, as its re-read
    /// would do. Filer errors are retried like the commit's own.
    ///
    /// [`FileState::name_doubt`]: super::file::FileState::name_doubt
    /// [`FileState::removal_doubt`]: super::file::FileState::removal_doubt
    ///
    /// After the filer `refused` a commit at the name, a hard link's name is not given back
    /// either (removed elsewhere just now, it would come back): its file moves to another
    /// name of its group or waits for the event like any other.
    async fn confirm_name(&self, of: &OpenFile, refused: bool) -> Result<()> {
        const SETTLE: Duration = Duration::from_secs(3);
        let start = Instant::now();
        let mut pauses = crate::retry::STORAGE.pauses();
        // (a filer that answered is asked again soon: the event that moves the name is
        // usually milliseconds away, and a name that keeps moving matches only briefly)
        let mut name_pauses = crate::retry::NAME_EVENTS.pauses();
        loop {
            let (dir, name, epoch, known, removal, linked) = {
                let s = of.state.lock();
                let doubt = s.name_doubt || s.removal_doubt;
                if !doubt || s.unlinked || s.pending_create {
                    return Ok(());
                }
                (
                    s.dir.clone(),
                    s.entry.name.clone(),
                    s.epoch,
                    Identity::of(&s.entry),
                    s.removal_doubt,
                    super::attr::has_other_links(&s.entry),
                )
            };
            let path = join(&dir, &name);
            self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
            // (found, another file holds the name)
            let (found, taken) = match self.filer.lookup_entry(&dir, &name).await {
                Ok(e) => {
                    let ours = self.is_open_file(&path, &e, of.ino, &known);
                    (Some(ours), !ours)
                }
                Err(FilerError::NotFound(_)) => (Some(false), false),
                Err(e) if start.elapsed() < self.cfg.upload_retry => {
                    tracing::warn!(path, error = %e, "checking an open file's name before its commit failed; retrying");
                    (None, false)
                }
                Err(e) => return Err(e.into()),
            };
            // (a doubt raised after the read above bumps the epoch: the answer is not taken)
            let moved_to = match found {
                Some(false) if removal || (linked && taken) => self.other_link(of, &path).await,
                _ => None,
            };
            let moved = {
                let mut s = of.state.lock();
                // an answer about the name as it still is, with no doubt raised since
                // (a change of ours in flight may have moved it on the filer already)
                let current = s.epoch == epoch
                    && s.local_inflight == 0
                    && (s.dir.as_str(), s.entry.name.as_str()) == (&dir, &name);
                tracing::debug!(
                    path,
                    ?found,
                    taken,
                    current,
                    epoch,
                    epoch_now = s.epoch,
                    inflight = s.local_inflight,
                    now = %join(&s.dir, &s.entry.name),
                    "checked an open file's name before its commit"
                );
                if current && found == Some(true) {
                    s.name_doubt = false;
                    s.removal_doubt = false;
                    return Ok(());
                }
                // A hard-linked file's names share its content record: its data reaches the
                // group at another name the filer confirms, or at this one while it is free
                // (a name moved away unseen is given back). Never over another file there.
                let give_back = !taken && !refused;
                if current && found == Some(false) && linked && (moved_to.is_some() || give_back) {
                    if moved_to.is_some() || s.removal_doubt {
                        Some(super::events::name_gone(&mut s, moved_to))
                    } else {
                        Some(None)
                    }
                } else if current && found == Some(false) && s.removal_doubt && !linked {
                    Some(super::events::name_gone(&mut s, moved_to))
                } else if current && found == Some(false) && start.elapsed() >= SETTLE {
                    return Err(errno(
                        libc::ESTALE,
                        format!("{path}: moved or removed by another client while this node missed its events; not created again"),
                    ));
                } else if found.is_some() && s.local_inflight == 0 && start.elapsed() >= SETTLE * 10
                {
                    // (its name or events kept changing under every answer; a filer that
                    // does not answer is waited for as long as a commit's own retries)
                    return Err(errno(
                        libc::ESTALE,
                        format!("{path}: its name kept changing while it was checked"),
                    ));
                } else {
                    None
                }
            };
            // Some: settled (moved to another name of its link group, if Some again)
            if let Some(moved) = moved {
                self.moved_by_link(of.ino, moved);
                return Ok(());
            }
            let pause = match found {
                None => pauses.next_pause(),
                Some(_) => name_pauses.next_pause(),
            };
            tokio::time::sleep(pause).await;
        }
    }

    /// Whether the filer says, by its version, that it checks `IF_CHUNKS_EQUAL`. Asked again
    /// at each refusal of a chunk list that matched (rare): the session may have failed
    /// over to another filer since the mount, one older than 4.41 during a rolling change.
    /// (The node's connection keeps the answer for a few seconds: commits in that window
    /// after such a failover fail with EIO, their bytes kept for the next flush.)
    async fn filer_checks_chunks(&self) -> bool {
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        match self.filer.configuration().await {
            Ok(c) => {
                ChunkCondition::of_version(c.major_version, c.minor_version)
                    == ChunkCondition::Checked
            }
            Err(e) => {
                tracing::warn!(error = %e, "asking the filer's version failed; taking the one it said at the mount");
                self.cfg.chunk_condition == ChunkCondition::Checked
            }
        }
    }

    /// After the filer refused a commit because another client changed the file since this
    /// node knew its entry: takes the filer's entry as the base of this node's changes
    /// ([`OpenFile::rebase`]).
    ///
    /// A filer of SeaweedFS 4.29-4.40 checks conditions on creates but not `IF_CHUNKS_EQUAL`
    /// (4.41), and fails a clause it does not know: its entry still lists the chunks of
    /// `refused_base` (see [`Rebase::HeldButRefused`]).
    async fn rebase(&self, of: &Arc<OpenFile>, refused_base: &[String]) -> Result<Rebase> {
        // not while a commit of this file is in flight: its success sets the base too
        let _commit = of.commit.lock().await;
        let (dir, name, known) = {
            let s = of.state.lock();
            (s.dir.clone(), s.entry.name.clone(), Identity::of(&s.entry))
        };
        let path = join(&dir, &name);
        let start = Instant::now();
        let mut pauses = crate::retry::STORAGE.pauses();
        let fresh = loop {
            self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
            match self.filer.lookup_entry(&dir, &name).await {
                Ok(e) if e.is_directory => return Ok(Rebase::NameGone),
                // another file took the name (moved over it, or removed and made again):
                // this one's data is not merged into it; its events decide
                Ok(e) if !self.is_open_file(&path, &e, of.ino, &known) => {
                    return Ok(Rebase::NameGone)
                }
                Ok(e) => break e,
                Err(FilerError::NotFound(_)) => return Ok(Rebase::NameGone),
                Err(e) if start.elapsed() < self.cfg.upload_retry => {
                    tracing::warn!(path, error = %e, "reading the entry to rebase a commit onto failed; retrying");
                    tokio::time::sleep(pauses.next_pause()).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let mut there = crate::volume::fid::chunk_file_ids(&fresh.chunks);
        let mut asked = refused_base.to_vec();
        there.sort_unstable();
        asked.sort_unstable();
        if there == asked {
            return Ok(Rebase::HeldButRefused);
        }
        let mut rebased = Rebased::Again;
        for _ in 0..3 {
            let inner = self.manifests_of(&fresh, of).await.map_err(|e| {
                errno(
                    libc::EIO,
                    format!("{path}: manifests of the entry to rebase onto: {e}"),
                )
            })?;
            rebased = of.rebase(&fresh, &inner);
            if rebased != Rebased::Again {
                break;
            }
        }
        self.stats.rebases.fetch_add(1, Ordering::Relaxed);
        crate::metrics::global().commit_rebased();
        // what the kernel read of the file before holds neither side's latest bytes
        self.bump_content_gen(of.ino);
        if let Some(nt) = self.notifier() {
            nt.inval_inode(of.ino);
        }
        match rebased {
            Rebased::Merged { refill } => {
                tracing::info!(
                    path,
                    "rebased this node's changes onto another client's commit"
                );
                if let Some((lo, cut)) = refill {
                    // as a truncate of this node's own does (setattr): the kept bytes of a
                    // chunk cut in the middle become a chunk of their own, over it. Not over
                    // a write that came in while they were read. (Left as it is, the chunk
                    // is recorded shorter than its needle: fine for this client and `weed
                    // mount`, not for the filer's HTTP and S3 readers.)
                    let mut rewritten = false;
                    for _ in 0..3 {
                        let seq = of.state.lock().seq;
                        let kept = self.read_range(of, lo, cut - lo).await?;
                        if let Some(runs) = of.rewrite_unless_changed(seq, lo, &kept) {
                            self.start_uploads(of, runs, true).await;
                            rewritten = true;
                            break;
                        }
                    }
                    if !rewritten {
                        tracing::warn!(path, lo, cut, "written to while the kept part of a chunk cut by a truncate was read; left recorded shorter than its needle (the filer's HTTP and S3 readers cannot read it)");
                    }
                }
            }
            Rebased::Replaces => {
                tracing::warn!(path, "another client's change cannot be merged with this node's (inline content or hard links); this node's commit replaces it");
            }
            Rebased::Again => {
                return Err(errno(
                    libc::EIO,
                    format!("{path}: its manifests kept changing under a rebase"),
                ))
            }
        }
        Ok(Rebase::Done)
    }

    /// The data chunks of every manifest chunk of `fresh` and of `of`'s entry, by id (each
    /// fetched once per rebase; none for files below `manifest_batch` chunks).
    async fn manifests_of(
        &self,
        fresh: &pb::Entry,
        of: &OpenFile,
    ) -> std::result::Result<std::collections::HashMap<String, Vec<pb::FileChunk>>, VolumeError>
    {
        let local: Vec<pb::FileChunk> = of
            .state
            .lock()
            .entry
            .chunks
            .iter()
            .filter(|c| c.is_chunk_manifest)
            .cloned()
            .collect();
        let mut inner = std::collections::HashMap::new();
        for m in fresh
            .chunks
            .iter()
            .filter(|c| c.is_chunk_manifest)
            .chain(&local)
        {
            let key = crate::volume::fid::chunk_file_id(m).unwrap_or_default();
            if let std::collections::hash_map::Entry::Vacant(v) = inner.entry(key) {
                v.insert(
                    crate::chunks::expand_manifests(std::slice::from_ref(m), self.store.as_ref())
                        .await?,
                );
            }
        }
        Ok(inner)
    }

    /// Deletes chunks of ours that no entry references, in the background.
    pub(super) fn delete_orphans(&self, fids: Vec<String>) {
        if !fids.is_empty() {
            self.deletes.spawn(self.store.clone(), fids);
        }
    }

    /// Folds `entry`'s data chunks into manifest chunks once there are `manifest_batch` of them,
    /// as `weed mount` does, so a commit sends at most that many data chunks plus one manifest
    /// per batch instead of the whole list. Records in `snap` the data chunks folded and the
    /// new manifests. On an upload error the entry is committed unfolded (still correct).
    async fn manifestize(&self, of: &OpenFile, snap: &mut CommitSnapshot) {
        let batch = self.cfg.manifest_batch;
        let entry = &mut snap.entry;
        let data = entry.chunks.iter().filter(|c| !c.is_chunk_manifest).count();
        if data < batch {
            return;
        }
        let opts = self.upload_options(&of.path());
        let before = entry.chunks.clone();
        let after = match crate::chunks::maybe_manifestize(
            before.clone(),
            self.store.as_ref(),
            &opts,
            batch,
        )
        .await
        {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(path = %of.path(), error = %e, "chunk manifest upload failed; committing the chunks unfolded");
                return;
            }
        };
        let ids = |list: &[pb::FileChunk], manifest: bool| -> std::collections::HashSet<String> {
            list.iter()
                .filter(|c| c.is_chunk_manifest == manifest)
                .map(|c| c.file_id.clone())
                .collect()
        };
        let (unfolded, old_manifests) = (ids(&after, false), ids(&before, true));
        snap.folded = before
            .into_iter()
            .filter(|c| !c.is_chunk_manifest && !unfolded.contains(&c.file_id))
            .collect();
        snap.manifests = after
            .iter()
            .filter(|c| c.is_chunk_manifest && !old_manifests.contains(&c.file_id))
            .cloned()
            .collect();
        snap.entry.chunks = after;
    }

    pub async fn flush(&self, fh: u64, ino: u64) -> Result<()> {
        let h = self.handle(fh, ino).await?;
        self.verifier.check(fh)?;
        self.flush_file(&h.file).await
    }

    /// A flush that also marks a file fsynced with data to upload as one that fsyncs often
    /// (see [`FileState::syncs`]): its next fsyncs find their chunks hashed and a file id
    /// at hand. Encrypted chunks carry no MD5, so there is nothing to hash ahead for them.
    ///
    /// [`FileState::syncs`]: super::file::FileState::syncs
    pub async fn fsync(&self, fh: u64, ino: u64) -> Result<()> {
        let h = self.handle(fh, ino).await?;
        self.verifier.check(fh)?;
        {
            let mut s = h.file.state.lock();
            if !s.slots.is_empty() && !self.cfg.cipher {
                s.syncs = true;
            }
        }
        self.flush_file(&h.file).await
    }

    /// Flushes every open file (before a handover or shutdown).
    pub async fn flush_all(&self) -> Result<()> {
        let files: Vec<Arc<OpenFile>> =
            self.files.lock().values().map(|o| o.file.clone()).collect();
        // all at once: a handover must finish within the pod's grace period (uploads stay
        // bounded by the upload semaphore)
        let flushed = futures::future::join_all(files.iter().map(|of| self.flush_file(of))).await;
        let mut first_err = None;
        for (of, r) in files.iter().zip(flushed) {
            if let Err(e) = r {
                tracing::error!(path = %of.path(), error = %e, "flush failed");
                first_err.get_or_insert(e);
            }
        }
        self.flush_dir_times().await;
        // the process may exit or the volume go next: what is left is volume.fsck's to find
        if !self.deletes.drain(DRAIN_DELETES).await {
            tracing::warn!(root = %self.cfg.root, "orphaned chunk deletes still running; left to volume.fsck");
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Longest an unmount or a handover waits for orphaned chunks' deletes.
const DRAIN_DELETES: Duration = Duration::from_secs(5);

/// Deletes of chunks no entry references, running in the background, counted so that an
/// unmount or a handover can wait for them.
#[derive(Default)]
pub(super) struct BackgroundDeletes {
    running: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

/// Counts one delete down when its task ends, however it ends.
struct Running(Arc<BackgroundDeletes>);

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl BackgroundDeletes {
    fn spawn(self: &Arc<Self>, store: Arc<dyn crate::volume::ChunkStore>, fids: Vec<String>) {
        self.running.fetch_add(1, Ordering::SeqCst);
        let running = Running(self.clone());
        tokio::spawn(async move {
            let _running = running;
            if let Err(e) = store.delete_chunks(&fids).await {
                tracing::warn!(count = fids.len(), error = %e,
                    "orphaned chunks not deleted (volume.fsck finds them)");
            }
        });
    }

    /// Waits up to `limit` until no delete runs; false if some still did then.
    async fn drain(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // registered before the check: a delete ending in between still wakes us
            idle.as_mut().enable();
            if self.running.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return false;
            }
        }
    }
}

/// Reports an upload's result to its file exactly once; a task that ends without one (a
/// panic) reports a failure, so fsync, close and truncate do not wait for it forever.
struct UploadDone(Option<(Arc<OpenFile>, u64)>);

impl UploadDone {
    /// The chunk's id if no entry can ever list it (see [`OpenFile::upload_done`]).
    fn finish(mut self, r: std::result::Result<pb::FileChunk, String>) -> Option<String> {
        let (of, id) = self.0.take()?;
        of.upload_done(id, r)
    }
}

/// Where a hard-linked file's commit goes, as its link group on the filer says.
enum Place {
    /// Its own name, there on the filer.
    Here,
    /// Its own name, absent on the filer, given back as one more name of its group.
    PutBack,
    /// Nowhere: its name is absent and its group has no names left.
    Gone,
}

/// What one pass of a commit came to.
enum Pass {
    Done,
    /// The filer no longer had the file's name when the commit reached it.
    NameGone,
    /// The filer's entry was changed by another client since this node knew it: its chunks
    /// were not the ones the commit was built on (these).
    Changed(Vec<String>),
}

/// What [`Fs::rebase`] came to.
enum Rebase {
    /// The file's changes lie on the filer's entry now: commit again.
    Done,
    /// Its name is gone, or holds a directory or another file now.
    NameGone,
    /// The filer's entry lists the chunks the refused condition asked for: the name was
    /// away when the commit came (moved away and back), or the filer does not know
    /// `IF_CHUNKS_EQUAL` (SeaweedFS 4.29-4.40 fail it on creates). Unless its version says
    /// it does ([`ChunkCondition::Checked`], asked again each time), the second time in one
    /// commit this session's commits carry `IF_EXISTS` alone (the last writer wins, as
    /// before the condition).
    HeldButRefused,
}

/// Rebases of one commit onto the changes of other clients before it may give up (EIO):
/// at least this many, and more for as long as a commit retries a failing filer.
const MIN_REBASES: u32 = 16;

/// Refusals of a chunk list that matched (a name away just then) one commit takes as moves
/// before it gives up (EIO), on a filer that checks the condition.
const MAX_HELD_REFUSALS: u32 = 64;

/// Passes of a commit whose name goes away under it each time before it gives up (ESTALE).
/// Each pass first finds the file at its name again (`confirm_name` waits for the move's
/// event, and says ESTALE itself when the name leads nowhere), so many passes mean a file
/// moved again and again, not a lost one.
const NAME_GONE_PASSES: u32 = 12;

/// A commit's snapshot while the filer may take it: dropped unsettled (failed, or the
/// future dropped), the chunks it carries are given up (see [`OpenFile::keep_carried`]).
struct CarriedUnlessSettled<'a> {
    of: &'a OpenFile,
    snap: Option<CommitSnapshot>,
}

impl Drop for CarriedUnlessSettled<'_> {
    fn drop(&mut self) {
        if let Some(snap) = &self.snap {
            self.of.keep_carried(snap);
        }
    }
}

impl Drop for UploadDone {
    fn drop(&mut self) {
        if let Some((of, id)) = self.0.take() {
            tracing::error!(ino = of.ino, "chunk upload task ended without a result");
            of.upload_done(id, Err("upload task ended without a result".into()));
        }
    }
}

/// Uploads one run, retrying with backoff while the cluster cannot take it (volume servers
/// restarting, no writable volume, filer unreachable for assigns) for up to `retry_for`.
/// Errors a retry cannot fix (authorization, configuration) return at once.
async fn upload_with_retry(
    store: &dyn crate::volume::ChunkStore,
    data: bytes::Bytes,
    opts: &crate::volume::UploadOptions,
    retry_for: Duration,
) -> std::result::Result<pb::FileChunk, VolumeError> {
    let start = Instant::now();
    let mut attempt = 0;
    let mut pauses = crate::retry::STORAGE.pauses();
    loop {
        match store.upload(data.clone(), opts).await {
            Ok(c) => return Ok(c),
            Err(e) => {
                let permanent = matches!(
                    e,
                    VolumeError::Unauthorized(_)
                        | VolumeError::Unsupported(_)
                        | VolumeError::Config(_)
                        | VolumeError::InvalidFileId(_)
                );
                let wait = pauses.next_pause();
                if permanent || start.elapsed() + wait > retry_for {
                    return Err(e);
                }
                attempt += 1;
                tracing::warn!(path = %opts.path, error = %e, attempt, "chunk upload failed; retrying");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

#[cfg(test)]
mod manifest_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::chunks;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::inode::ROOT_INO;
    use crate::fs::{FsConfig, SetAttr};
    use crate::volume::mock::MockChunkStore;
    use crate::volume::ChunkStore;

    const CS: usize = 8;

    fn fs() -> (Arc<Fs>, Arc<MockFiler>, Arc<MockChunkStore>) {
        let mut cfg = FsConfig::from_mount_options(&MountOptions {
            manifest_batch: 3,
            ..Default::default()
        });
        cfg.chunk_size = CS;
        let filer = Arc::new(MockFiler::new());
        let store = Arc::new(MockChunkStore::new());
        let fs = Fs::new(cfg, filer.clone(), store.clone(), ChunkCache::new(1 << 20));
        (fs, filer, store)
    }

    /// The file as a reader of the filer's entry sees it (manifests expanded).
    async fn filer_bytes(filer: &MockFiler, store: &MockChunkStore, path: &str) -> Vec<u8> {
        let e = filer.get(path).unwrap();
        let list = chunks::expand_manifests(&e.chunks, store).await.unwrap();
        let size = chunks::file_size(&e);
        let mut out = vec![0u8; size as usize];
        let ivs = chunks::visible_intervals(&list);
        for p in chunks::read_plan(&ivs, 0, size, size) {
            if let chunks::ReadPiece::Chunk {
                chunk_index,
                offset_in_chunk,
                len,
                file_offset,
            } = p
            {
                let body = store.fetch_chunk(&list[chunk_index]).await.unwrap();
                out[file_offset as usize..][..len as usize]
                    .copy_from_slice(&body[offset_in_chunk as usize..][..len as usize]);
            }
        }
        out
    }

    fn manifests(filer: &MockFiler, path: &str) -> Vec<String> {
        let e = filer.get(path).unwrap();
        e.chunks
            .iter()
            .filter(|c| c.is_chunk_manifest)
            .map(|c| c.file_id.clone())
            .collect()
    }

    #[tokio::test]
    async fn commits_fold_chunks_into_manifests_once() {
        let (fs, filer, store) = fs();
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_RDWR, 0, 0)
            .await
            .unwrap();
        let data: Vec<u8> = (0..10 * CS).map(|i| (i % 251) as u8 + 1).collect();
        fs.write(fh, a.ino, 0, &data).await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        // 10 chunks, 3 per manifest: 3 manifests and 1 data chunk
        let e = filer.get("/f").unwrap();
        let first = manifests(&filer, "/f");
        assert_eq!(first.len(), 3, "{:?}", e.chunks);
        assert_eq!(e.chunks.len(), 4);
        assert_eq!(filer_bytes(&filer, &store, "/f").await, data);

        // one more chunk: the manifests already made are kept, not made again
        fs.write(fh, a.ino, data.len() as u64, &data[..CS])
            .await
            .unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        assert_eq!(manifests(&filer, "/f"), first);
        assert_eq!(filer.get("/f").unwrap().chunks.len(), 5);
        let mut want = data.clone();
        want.extend_from_slice(&data[..CS]);
        assert_eq!(filer_bytes(&filer, &store, "/f").await, want);
        fs.release(fh, a.ino).await.unwrap();
    }

    #[tokio::test]
    async fn truncating_through_a_manifest_never_brings_old_bytes_back() {
        let (fs, filer, store) = fs();
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_RDWR, 0, 0)
            .await
            .unwrap();
        let data: Vec<u8> = (0..10 * CS).map(|i| (i % 251) as u8 + 1).collect();
        fs.write(fh, a.ino, 0, &data).await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        assert_eq!(manifests(&filer, "/f").len(), 3);
        // not open: inside the first manifest, in the middle of a chunk; then grow again
        let cut = CS as u64 + 3;
        for size in [cut, 10 * CS as u64] {
            fs.setattr(
                a.ino,
                SetAttr {
                    size: Some(size),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        }
        let mut want = data[..cut as usize].to_vec();
        want.resize(10 * CS, 0);
        assert_eq!(filer_bytes(&filer, &store, "/f").await, want);
        let fh = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
        let got = fs.read(fh, a.ino, 0, 1 << 20).await.unwrap();
        assert_eq!(&got[..], &want[..]);
        fs.release(fh, a.ino).await.unwrap();
    }
}

#[cfg(test)]
mod stream_md5_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::inode::ROOT_INO;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;

    const CS: usize = 64 << 10;

    fn fs() -> (Arc<Fs>, Arc<MockChunkStore>) {
        fs_with_slots(MountOptions::default().concurrent_writers)
    }

    /// An `Fs` on mocks with 64 KiB chunks and `slots` upload slots.
    pub(super) fn fs_with_slots(slots: usize) -> (Arc<Fs>, Arc<MockChunkStore>) {
        let mut cfg = FsConfig::from_mount_options(&MountOptions::default());
        cfg.chunk_size = CS;
        cfg.concurrent_writers = slots;
        let store = Arc::new(MockChunkStore::new());
        let fs = Fs::new(
            cfg,
            Arc::new(MockFiler::new()),
            store.clone(),
            ChunkCache::new(1 << 20),
        );
        (fs, store)
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    /// A run sealed and then dropped before its upload started (a panic between the two, a
    /// write's future dropped while it waited for an upload slot) is settled as failed: an
    /// fsync waiting for it ends (EIO: its data was not placed) instead of waiting forever,
    /// and the next fsync uploads it from memory. Its bytes stay readable throughout.
    #[tokio::test]
    async fn a_sealed_run_dropped_before_its_upload_is_uploaded_by_the_next_fsync() {
        let (fs, store) = fs();
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_RDWR, 0, 0)
            .await
            .unwrap();
        let first = bytes(CS, 1);
        let of = fs.open_file(a.ino).expect("open");
        // a full chunk: sealed by the write, not started
        let lost = of.write(0, &first);
        assert_eq!(lost.len(), 1);
        // an fsync now waits for that run's upload
        let tail = bytes(100, 2);
        fs.write(fh, a.ino, CS as u64, &tail).await.unwrap();
        let fsync = tokio::spawn({
            let fs = fs.clone();
            async move { fs.fsync(fh, a.ino).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !fsync.is_finished(),
            "the fsync did not wait for the sealed run"
        );
        drop(lost);
        let r = tokio::time::timeout(Duration::from_secs(5), fsync)
            .await
            .expect("an fsync still waits for a run that was dropped")
            .unwrap();
        assert_eq!(
            r.expect_err("unplaced data reported as synced").errno,
            libc::EIO
        );
        let back = fs.read(fh, a.ino, 0, CS as u32).await.unwrap();
        assert!(back[..] == first[..]);
        // the next fsync places it
        fs.fsync(fh, a.ino).await.unwrap();
        let e = fs.lookup(ROOT_INO, "f").await.unwrap();
        assert_eq!(e.size, (CS + tail.len()) as u64);
        fs.release(fh, a.ino).await.unwrap();
        let fh = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
        let back = fs.read(fh, a.ino, 0, CS as u32).await.unwrap();
        assert!(back[..] == first[..]);
        assert!(store.upload_count() >= 2);
    }

    /// Appends after an fsync are hashed as they come and their uploads use that digest; an
    /// overwrite, a write before the range or a truncate inside it makes the upload hash
    /// the bytes itself. The mock store refuses a digest that is not the data's, as a
    /// volume server does, so a stale one fails the fsync.
    #[tokio::test]
    async fn appends_after_an_fsync_are_hashed_as_written_and_only_then() {
        let (fs, store) = fs();
        let (a, fh) = fs
            .create(ROOT_INO, "log", 0o644, 0, libc::O_RDWR, 0, 0)
            .await
            .unwrap();
        let mut model = Vec::new();
        let append = |fs: Arc<Fs>, model: &mut Vec<u8>, n: usize, seed: u8| {
            let d = bytes(n, seed);
            let at = model.len() as u64;
            model.extend_from_slice(&d);
            async move { fs.write(fh, a.ino, at, &d).await.unwrap() }
        };
        append(fs.clone(), &mut model, 5000, 1).await;
        fs.fsync(fh, a.ino).await.unwrap();
        assert_eq!(
            store.streamed_md5_count(),
            0,
            "the first fsync had nothing hashed"
        );

        // appends only, across a chunk boundary: every upload of this fsync was hashed ahead
        for i in 0..20 {
            append(fs.clone(), &mut model, 4096 + i * 7, i as u8).await;
        }
        let before = store.upload_count();
        fs.fsync(fh, a.ino).await.unwrap();
        let uploads = store.upload_count() - before;
        assert!(uploads >= 2, "{uploads}");
        assert_eq!(store.streamed_md5_count(), uploads);

        // an overwrite inside the appended range: the stream no longer matches
        let streamed = store.streamed_md5_count();
        append(fs.clone(), &mut model, 3000, 9).await;
        let at = model.len() - 2000;
        let patch = bytes(100, 77);
        model[at..at + 100].copy_from_slice(&patch);
        fs.write(fh, a.ino, at as u64, &patch).await.unwrap();
        append(fs.clone(), &mut model, 500, 10).await;
        fs.fsync(fh, a.ino).await.unwrap();
        assert_eq!(store.streamed_md5_count(), streamed);

        // a write just before the range joins it at the front: not hashed ahead either
        let base = model.len();
        model.resize(base + 10, 0);
        append(fs.clone(), &mut model, 1000, 11).await;
        let front = bytes(10, 12);
        fs.write(fh, a.ino, base as u64, &front).await.unwrap();
        model[base..base + 10].copy_from_slice(&front);
        fs.fsync(fh, a.ino).await.unwrap();
        assert_eq!(store.streamed_md5_count(), streamed);

        // a gap filled later: one range of as many bytes as were written, but not in the
        // order they were written (a digest of them in that order would be refused)
        let base = model.len();
        append(fs.clone(), &mut model, 1000, 13).await;
        model.resize(base + 1020, 0);
        for at in [base + 1010, base + 1000] {
            let d = bytes(10, at as u8);
            fs.write(fh, a.ino, at as u64, &d).await.unwrap();
            model[at..at + 10].copy_from_slice(&d);
        }
        fs.fsync(fh, a.ino).await.unwrap();
        assert_eq!(store.streamed_md5_count(), streamed);

        // a truncate into the appended range (the mock refuses a digest of bytes cut off)
        append(fs.clone(), &mut model, 3000, 14).await;
        let cut = model.len() - 1000;
        model.truncate(cut);
        fs.setattr(
            a.ino,
            crate::fs::SetAttr {
                size: Some(cut as u64),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        append(fs.clone(), &mut model, 700, 15).await;
        fs.fsync(fh, a.ino).await.unwrap();

        // plain appends again: hashed ahead again
        let streamed = store.streamed_md5_count();
        append(fs.clone(), &mut model, 2000, 16).await;
        fs.fsync(fh, a.ino).await.unwrap();
        assert_eq!(store.streamed_md5_count(), streamed + 1);

        let got = fs.read(fh, a.ino, 0, 1 << 20).await.unwrap();
        assert_eq!(got.len(), model.len());
        assert!(got[..] == model[..], "content differs from the model");
        fs.release(fh, a.ino).await.unwrap();
    }

    /// A file that fsynced once and then writes much more before its next commit (a bulk
    /// load) stops hashing ahead and stops taking reserved file ids: 16 large chunks per
    /// assign would pile onto one volume.
    #[tokio::test]
    async fn a_bulk_load_after_one_fsync_uploads_like_any_file() {
        let (fs, store) = fs();
        let (a, fh) = fs
            .create(ROOT_INO, "db", 0o644, 0, libc::O_RDWR, 0, 0)
            .await
            .unwrap();
        let d = bytes(CS, 3);
        fs.write(fh, a.ino, 0, &d[..100]).await.unwrap();
        fs.fsync(fh, a.ino).await.unwrap();
        let span = crate::fs::file::SYNC_SPAN_CHUNKS as usize * CS;
        let mut at = 100;
        while at < 100 + 2 * span {
            fs.write(fh, a.ino, at as u64, &d).await.unwrap();
            at += d.len();
        }
        // the uploads run in the background: wait for them
        fs.flush(fh, a.ino).await.unwrap();
        let (streamed, synced) = (store.streamed_md5_count(), store.synced_upload_count());
        let chunks = (span / CS) as u64;
        assert!(
            synced <= chunks + 2 && streamed <= chunks + 2,
            "{synced} / {streamed} of {} chunks uploaded as a syncing file's",
            2 * chunks
        );
        assert!(
            streamed > 0,
            "the first chunks after the fsync were hashed ahead"
        );
        fs.release(fh, a.ino).await.unwrap();
    }

    /// A file that never fsyncs hashes nothing ahead (its full chunks are hashed in SIMD
    /// lanes with others, which costs less CPU).
    #[tokio::test]
    async fn files_that_do_not_fsync_hash_nothing_ahead() {
        let (fs, store) = fs();
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_RDWR, 0, 0)
            .await
            .unwrap();
        let d = bytes(3 * CS + 100, 5);
        fs.write(fh, a.ino, 0, &d).await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        fs.write(fh, a.ino, d.len() as u64, &d[..1000])
            .await
            .unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        assert!(store.upload_count() >= 4);
        assert_eq!(store.streamed_md5_count(), 0);
    }
}

#[cfg(test)]
mod slot_wait_tests {
    use crate::fs::inode::ROOT_INO;
    use std::time::Duration;

    const CS: usize = 64 << 10;

    /// A writer waiting for an upload slot lets chunks held back for batching go only when
    /// they could be most of the slots (fewer than two batches' worth): otherwise one frees
    /// as fast as volume servers answer, and kicking the batch on every wait hashed a busy
    /// writer's chunks one or two at a time.
    #[tokio::test]
    async fn a_writer_waiting_for_a_slot_kicks_the_batch_only_with_few_slots() {
        for (width, kicks) in [(1, false), (2, false), (3, true), (8, true)] {
            let (fs, store) = super::stream_md5_tests::fs_with_slots(4);
            let (a, fh) = fs
                .create(ROOT_INO, "f", 0o644, 0, libc::O_RDWR, 0, 0)
                .await
                .unwrap();
            store.pause_uploads();
            store.set_batch_width(width);
            let chunk = vec![7u8; CS];
            // four full chunks take the four slots; their uploads wait in the store
            for i in 0..4u64 {
                fs.write(fh, a.ino, i * CS as u64, &chunk).await.unwrap();
            }
            assert_eq!(store.expedite_count(), 0, "batches of {width}");
            // the fifth chunk's writer finds no slot
            let writer = {
                let fs = fs.clone();
                let chunk = chunk.clone();
                tokio::spawn(async move {
                    fs.write(fh, a.ino, 4 * CS as u64, &chunk).await?;
                    fs.write(fh, a.ino, 5 * CS as u64, &chunk[..1]).await
                })
            };
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(
                !writer.is_finished(),
                "batches of {width}: no slot was free"
            );
            assert_eq!(
                store.expedite_count() > 0,
                kicks,
                "4 slots, batches of {width}"
            );
            store.resume_uploads();
            writer.await.unwrap().unwrap();
            fs.fsync(fh, a.ino).await.unwrap();
            assert_eq!(store.upload_count(), 6);
        }
    }
}
