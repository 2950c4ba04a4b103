//! setattr(2) of [`Fs`]'s nodes: mode, owner and times, and truncation through the
//! open-file state.

use super::attr::{self, entry_attr, to_go_mode, Attr, Kind};
use super::events::Identity;
use super::file::{cut_start, OpenFile};
use super::inode::{split, ROOT_INO};
use super::xattr::chmod_access_acl;
use super::{errno, now_parts, Fs, Result};
use crate::pb::filer as pb;
use std::sync::Arc;
use std::time::SystemTime;

/// A setattr request; `None` fields are unchanged.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SystemTime>,
    pub mtime: Option<SystemTime>,
    pub ctime: Option<SystemTime>,
    /// Clear the set-user-ID bit, and the set-group-ID bit of a group-executable file, as
    /// the kernel would on a write, truncate or chown by a caller without CAP_FSETID: with
    /// FUSE_HANDLE_KILLPRIV_V2 it leaves that to us (see `crate::fuse::adapter`).
    /// Directories keep theirs.
    pub kill_suidgid: bool,
}

impl SetAttr {
    /// `later` on top of this one: its fields win where it has them.
    fn merge(&mut self, later: &SetAttr) {
        fn over<T: Copy>(a: &mut Option<T>, b: Option<T>) {
            if b.is_some() {
                *a = b;
            }
        }
        over(&mut self.mode, later.mode);
        over(&mut self.uid, later.uid);
        over(&mut self.gid, later.gid);
        over(&mut self.size, later.size);
        over(&mut self.atime, later.atime);
        over(&mut self.mtime, later.mtime);
        over(&mut self.ctime, later.ctime);
        // a later explicit mode is applied after any earlier clearing (chmod u+s after a
        // write by another user keeps the bit)
        if later.mode.is_some() {
            self.kill_suidgid = later.kill_suidgid;
        } else {
            self.kill_suidgid |= later.kill_suidgid;
        }
    }
}

/// `perm` without the bits a write by an unprivileged caller clears: set-user-ID, and
/// set-group-ID of a group-executable file (as the FUSE_HANDLE_KILLPRIV_V2 rules and the
/// kernel's own FUSE path have it; without group execute the bit stays).
fn killed_perm(perm: u32) -> u32 {
    let mut perm = perm & !libc::S_ISUID;
    if perm & libc::S_IXGRP != 0 {
        perm &= !libc::S_ISGID;
    }
    perm
}

impl Fs {
    /// Clears the set-user-ID bit (and set-group-ID of a group-executable file) of `ino`
    /// if it has one, as a write, O_TRUNC open or fallocate by an unprivileged caller must:
    /// see [`SetAttr::kill_suidgid`]. Nothing changes (and nothing is asked of the filer)
    /// for a file without them.
    pub async fn kill_suidgid(&self, ino: u64) -> Result<()> {
        let perm = u32::from(self.getattr(ino).await?.perm);
        if killed_perm(perm) == perm {
            return Ok(());
        }
        let req = SetAttr {
            kill_suidgid: true,
            ..Default::default()
        };
        self.setattr(ino, req).await.map(|_| ())
    }

    pub async fn setattr(&self, ino: u64, req: SetAttr) -> Result<Attr> {
        self.setattr_from(ino, req, self.open_file(ino)).await
    }

    /// [`Self::setattr`] starting from `open`, the open state found for `ino` (a state
    /// retired meanwhile by its last close is replaced by the current one, if any).
    pub(super) async fn setattr_from(
        &self,
        ino: u64,
        req: SetAttr,
        mut open: Option<Arc<OpenFile>>,
    ) -> Result<Attr> {
        self.check_writable()?;
        if ino == ROOT_INO && self.cfg.root == "/" {
            return Err(errno(libc::EPERM, "cannot change the filer root"));
        }
        let path = self.path_of(ino)?;
        let (dir, name) = split(&path);
        // A state retired by its last close while we waited for it is not an error: the
        // change goes to whatever holds the file now (a newer state, or the filer's entry).
        // Bounded, so opens and closes racing without end cannot keep a change spinning.
        let mut rounds = 0;
        let turn = loop {
            if let Some(of) = open.take() {
                if let Some(a) = self.setattr_open(ino, &path, &of, &req).await? {
                    return Ok(a);
                }
                rounds += 1;
                if rounds >= super::CHANGE_ROUNDS {
                    return Err(errno(
                        libc::EAGAIN,
                        format!("{path}: opened and closed {rounds} times while being changed"),
                    ));
                }
                open = self.open_file(ino);
                continue;
            }
            if ino == ROOT_INO || req.size.is_some() {
                break None;
            }
            let turn = self.entry_lock(&dir, &name).lock().await;
            // opened since the look above: its state takes the change (its commit carries
            // the entry its open read, which would undo a change made on the filer here)
            match self.open_file(ino) {
                Some(of) => open = Some(of),
                None => break Some(turn),
            }
        };
        if let Some(turn) = turn {
            let e = self
                .update_fresh_locked(&dir, &name, |e| {
                    self.apply_setattr(e, &req);
                    if e.is_directory && req.mtime.is_some() {
                        self.dir_time_set(&path);
                    }
                    Ok(())
                })
                .await?;
            drop(turn);
            return Ok(self.attr_of(ino, &path, &e));
        }
        if ino == ROOT_INO {
            let (pdir, pname) = split(&self.cfg.root);
            let e = self
                .update_fresh(&pdir, &pname, |e| {
                    self.apply_setattr(e, &req);
                    if req.mtime.is_some() {
                        self.dir_time_set(&self.cfg.root);
                    }
                    Ok(())
                })
                .await?;
            let mut a = entry_attr(ROOT_INO, &e, &self.cfg.ids);
            a.ino = ROOT_INO;
            *self.root_attr.lock() = a.clone();
            return Ok(a);
        }
        // Only a truncate is left. It rewrites the chunk list: build it on the filer's
        // entry, not a cached one, and through the open-file path (a cut chunk is
        // rewritten, inline content that grows past the inline limit becomes a chunk
        // instead of a huge buffer).
        let e = self.fresh_entry(&dir, &name).await?;
        if e.is_directory {
            return Err(errno(libc::EISDIR, "truncate of a directory"));
        }
        // through a registered open state, so a concurrent open shares it and its commits
        let fh = self.open(ino, libc::O_WRONLY).await?;
        let of = self.handles.lock().get(&fh).map(|h| h.file.clone());
        let r = match of {
            Some(of) => {
                self.bump_content_gen(ino);
                // counted by our handle: it cannot be retired before the release below
                self.setattr_open(ino, &path, &of, &req)
                    .await
                    .and_then(|a| a.ok_or_else(|| errno(libc::EIO, "truncated file closed")))
            }
            None => Err(errno(libc::EIO, "handle vanished during truncate")),
        };
        let released = self.release(fh, ino).await;
        r.and_then(|a| released.map(|_| a))
    }

    fn apply_setattr(&self, e: &mut pb::Entry, req: &SetAttr) {
        let a = e.attributes.get_or_insert_with(Default::default);
        if let Some(m) = req.mode {
            let (kind, _) = attr::from_go_mode(a.file_mode);
            let kind = if e.is_directory { Kind::Dir } else { kind };
            a.file_mode = to_go_mode(kind, m & 0o7777);
        }
        if req.kill_suidgid && !e.is_directory {
            let (kind, perm) = attr::from_go_mode(a.file_mode);
            a.file_mode = to_go_mode(kind, killed_perm(u32::from(perm)));
        }
        if let Some(u) = req.uid {
            a.uid = self.cfg.ids.uid_to_filer(u);
        }
        if let Some(g) = req.gid {
            a.gid = self.cfg.ids.gid_to_filer(g);
        }
        if let Some(t) = req.atime {
            (a.atime, a.atime_ns) = attr::split_ts(t);
        }
        if let Some(t) = req.mtime {
            (a.mtime, a.mtime_ns) = attr::split_ts(t);
        }
        (a.ctime, a.ctime_ns) = attr::split_ts(req.ctime.unwrap_or_else(SystemTime::now));
        if let (Some(m), true) = (req.mode, self.posix_acl()) {
            chmod_access_acl(e, m);
        }
    }

    /// An open file with changes of ours to commit takes the attributes with them, at the
    /// next flush, fsync or close, as it takes the data (tar sets times, owner and mode on
    /// every file before it closes it: one commit instead of four). False when the file is
    /// clean: its filer entry is changed instead (ours may predate another node's write).
    fn defer_setattr(&self, of: &OpenFile, req: &SetAttr) -> bool {
        let mut st = of.state.lock();
        // a retired state is never committed: the change goes to the filer's entry
        if (st.is_clean() && !st.unlinked) || st.retired {
            return false;
        }
        self.apply_setattr(&mut st.entry, req);
        st.touch();
        let seq = st.seq;
        match st.deferred_attrs.as_mut() {
            Some((merged, at)) => {
                merged.merge(req);
                *at = seq;
            }
            None => st.deferred_attrs = Some((req.clone(), seq)),
        }
        true
    }

    /// After a last close that failed for good (its data could not be placed): the
    /// attribute changes deferred into the state, which were answered as done, go to the
    /// filer's entry on their own. Not for a file that never reached the filer, was unlinked,
    /// or whose name may lead to another file now (moved by another client unseen).
    pub(super) async fn salvage_deferred_attrs(&self, of: &OpenFile) {
        let (req, dir, name, number) = {
            let mut s = of.state.lock();
            if !s.retired || s.unlinked || s.pending_create || s.name_doubt || s.removal_doubt {
                return;
            }
            let Some((req, _)) = s.deferred_attrs.take() else {
                return;
            };
            let number = s.entry.attributes.as_ref().map_or(0, |a| a.inode);
            (req, s.dir.clone(), s.entry.name.clone(), number)
        };
        let r = if self.inodes.path(of.ino).is_some() {
            // as any setattr: a newer open state of the file (opened since the close retired
            // this one) takes the change, or its commit would carry the entry without it
            // (boxed: a truncate's setattr_from closes a handle, which may come back here)
            Box::pin(self.setattr_from(of.ino, req, self.open_file(of.ino)))
                .await
                .map(|_| ())
        } else {
            // the kernel forgot the node already: nothing here can open it again. Events no
            // longer reach the retired state, so the name must still hold the same file (the
            // filer's number), not one made there since the file was moved away.
            self.update_fresh(&dir, &name, |e| {
                let now = e.attributes.as_ref().map_or(0, |a| a.inode);
                if number != 0 && now != number {
                    return Err(errno(libc::ESTALE, "another file at the name now"));
                }
                self.apply_setattr(e, &req);
                Ok(())
            })
            .await
            .map(|_| ())
        };
        match r {
            Ok(_) => {
                tracing::warn!(path = %of.path(), "last close failed; its attribute changes were applied on their own")
            }
            Err(e) => {
                tracing::error!(path = %of.path(), error = %e, "last close failed; its attribute changes are lost too")
            }
        }
    }

    /// setattr through an open file's state: attributes with the file's next commit (or on
    /// the filer's entry when there is nothing to commit), a truncate committed at once.
    /// None if the state was retired (its last close): the caller looks for the current one.
    async fn setattr_open(
        &self,
        ino: u64,
        path: &str,
        of: &Arc<OpenFile>,
        req: &SetAttr,
    ) -> Result<Option<Attr>> {
        if req.size.is_none() {
            if self.defer_setattr(of, req) {
                return Ok(Some(self.open_file_attr(ino, of)));
            }
            // nothing of ours to commit: change the filer's entry, never our copy of it. The
            // commit lock keeps this node's own commits of the file out of the lookup→update.
            let _commit = of.commit.lock().await;
            if self.defer_setattr(of, req) {
                return Ok(Some(self.open_file_attr(ino, of)));
            }
            // a newer open state would commit over a change made to the filer's entry here
            if of.state.lock().retired {
                return Ok(None);
            }
            let (dir, name) = split(path);
            let known = Identity::of(&of.state.lock().entry);
            let e = self
                .update_fresh(&dir, &name, |e| {
                    self.check_open_file(path, e, ino, &known)?;
                    self.apply_setattr(e, req);
                    Ok(())
                })
                .await?;
            self.adopt_if_clean(ino, of, e.clone()).await;
            return Ok(Some(self.attr_of(ino, path, &e)));
        }
        if let Some(size) = req.size {
            if of.state.lock().retired {
                return Ok(None);
            }
            self.refresh_if_clean(ino, of).await?;
            let runs = of.seal_all();
            self.store.expedite();
            self.start_uploads(of, runs, true).await;
            of.wait_uploads().await;
            let cut_at = || {
                let s = of.state.lock();
                if s.entry.content.is_empty() {
                    cut_start(&s.resolved, size)
                } else {
                    None
                }
            };
            let mut cut = cut_at();
            if cut.is_some() && !of.state.lock().is_clean() {
                // The kept bytes of the chunk the cut goes through are read back and
                // written again below: read over a base another client has committed over
                // since, they would undo its newer bytes. So this file's changes go first,
                // rebased onto such commits.
                self.flush_file(of).await?;
                cut = cut_at();
            }
            self.store.expedite();
            of.truncate(size).await;
            if let Some(lo) = cut {
                // A chunk cut in the middle would be recorded with a size smaller than its
                // needle, which the filer's HTTP/S3 readers cannot serve: rewrite the kept
                // bytes as a new chunk that hides it.
                let kept = self.read_range(of, lo, size - lo).await?;
                let runs = of.write(lo, &kept);
                self.start_uploads(of, runs, true).await;
            }
            if req.mtime.is_none() {
                let now = now_parts();
                let mut st = of.state.lock();
                let a = st.entry.attributes.get_or_insert_with(Default::default);
                (a.mtime, a.mtime_ns) = now;
            }
        }
        {
            let mut st = of.state.lock();
            self.apply_setattr(&mut st.entry, req);
            st.touch();
        }
        self.flush_file(of).await?;
        let e = of.state.lock().entry.clone();
        Ok(Some(self.attr_of(ino, path, &e)))
    }
}
