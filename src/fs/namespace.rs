//! Namespace operations of [`Fs`]: create, mkdir, mknod, symlink, readlink, unlink, rmdir,
//! rename and link, and how node ids and open files follow a moved or removed name.

use super::acl::{self, Acl};
use super::attr::{self, entry_attr, Attr, Kind};
use super::file::OpenFile;
use super::inode::{join, split, ROOT_INO};
use super::xattr::xattr_key;
use super::{entry_with_name, errno, now_parts, Fs, OpenEntry, Result};
use crate::filer::FilerError;
use crate::pb::filer as pb;
use std::sync::atomic::Ordering;
use std::sync::Arc;

const RENAME_NOREPLACE: u32 = 1;
const RENAME_EXCHANGE: u32 = 2;
const RENAME_WHITEOUT: u32 = 4;

impl Fs {
    fn check_new_name(&self, name: &str) -> Result<()> {
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            return Err(errno(libc::EINVAL, format!("invalid name {name:?}")));
        }
        if name.len() > 255 {
            return Err(errno(libc::ENAMETOOLONG, "name too long"));
        }
        Ok(())
    }

    async fn ensure_absent(&self, dir: &str, name: &str) -> Result<()> {
        match self.entry_at(dir, name).await {
            Ok(_) => Err(errno(libc::EEXIST, format!("{dir}/{name} exists"))),
            Err(e) if e.errno == libc::ENOENT => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn parent_dir(&self, parent: u64) -> Result<String> {
        let dir = self.path_of(parent)?;
        if parent != ROOT_INO {
            let (pd, pn) = split(&dir);
            let e = self.entry_at(&pd, &pn).await?;
            if !e.is_directory {
                return Err(errno(libc::ENOTDIR, format!("{dir} is not a directory")));
            }
        }
        Ok(dir)
    }

    /// Owner group and mode of a new entry in `dir`: a setgid directory passes on its group
    /// (and, to subdirectories, the setgid bit), as local filesystems do; FUSE leaves this to
    /// the filesystem. A file keeps a requested setgid bit only if its creator is root or is
    /// in its group.
    async fn inherit_group(
        &self,
        parent: u64,
        dir: &str,
        kind: Kind,
        perm: u32,
        uid: u32,
        gid: u32,
    ) -> (u32, u32) {
        let pattr = if parent == ROOT_INO {
            Some(self.root_attr())
        } else {
            let (pd, pn) = split(dir);
            self.entry_at(&pd, &pn)
                .await
                .ok()
                .map(|e| entry_attr(parent, &e, &self.cfg.ids))
        };
        match pattr {
            Some(p) if p.perm as u32 & libc::S_ISGID != 0 => {
                let perm = if kind == Kind::Dir {
                    perm | libc::S_ISGID
                } else if uid != 0 && p.gid != gid {
                    perm & !libc::S_ISGID
                } else {
                    perm
                };
                (perm, p.gid)
            }
            _ => (perm, gid),
        }
    }

    /// Permission bits and ACL xattrs of a new node. With ACLs negotiated and a default ACL on
    /// the parent, both come from it and the umask is ignored (POSIX.1e); otherwise the umask
    /// applies. Without FUSE_DONT_MASK the kernel has masked `perm` already (masking again is
    /// harmless). Symlinks get neither.
    async fn initial_mode(
        &self,
        parent: u64,
        dir: &str,
        kind: Kind,
        perm: u32,
        umask: u32,
    ) -> (u32, Vec<(String, Vec<u8>)>) {
        if kind == Kind::Symlink {
            return (perm, Vec::new());
        }
        let Some(default) = self.default_acl_of(parent, dir).await else {
            return (perm & !(umask & 0o777), Vec::new());
        };
        let inh = Acl::inherit(&default, perm, kind == Kind::Dir);
        let mut xattrs = Vec::new();
        if let Some(a) = inh.access {
            xattrs.push((xattr_key(acl::ACCESS), a.to_bytes()));
        }
        if let Some(d) = inh.default {
            xattrs.push((xattr_key(acl::DEFAULT), d.to_bytes()));
        }
        (inh.mode, xattrs)
    }

    /// The parent's default ACL, if ACLs are negotiated and it has a usable one.
    async fn default_acl_of(&self, parent: u64, dir: &str) -> Option<Acl> {
        if !self.posix_acl() || (parent == ROOT_INO && self.cfg.root == "/") {
            return None;
        }
        let (pd, pn) = split(dir);
        let e = match self.entry_at(&pd, &pn).await {
            Ok(e) => e,
            Err(err) => {
                tracing::debug!(dir, error = %err, "parent lookup for its default ACL failed");
                return None;
            }
        };
        let raw = e.extended.get(&xattr_key(acl::DEFAULT))?;
        match Acl::parse(raw) {
            Ok(a) if !a.is_empty() => Some(a),
            Ok(_) => None,
            Err(err) => {
                tracing::warn!(dir, error = %err, "ignoring a malformed default ACL");
                None
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn make_node(
        &self,
        parent: u64,
        name: &str,
        kind: Kind,
        perm: u32,
        umask: u32,
        uid: u32,
        gid: u32,
        symlink: &str,
        rdev: u32,
    ) -> Result<Attr> {
        self.check_writable()?;
        self.check_new_name(name)?;
        let dir = self.parent_dir(parent).await?;
        self.ensure_absent(&dir, name).await?;
        let path = join(&dir, name);
        let (perm, acls) = self.initial_mode(parent, &dir, kind, perm, umask).await;
        let (perm, gid) = self.inherit_group(parent, &dir, kind, perm, uid, gid).await;
        let mut e = self.new_entry(name, kind, perm, uid, gid, symlink, rdev);
        e.extended.extend(acls);
        if let Some(a) = e.attributes.as_mut() {
            a.inode = self.fresh_inode();
        }
        self.create_on_filer(&dir, &e, true).await?;
        self.meta.upsert(&dir, Arc::new(e.clone()));
        if kind == Kind::Dir {
            // an empty new directory is fully known
            let g = self.meta.generation(&path);
            self.meta.install(&path, Vec::new(), g, &[]);
        }
        self.touch_dir(&dir);
        Ok(self.remember(&path, &e, true))
    }

    pub async fn mkdir(
        &self,
        parent: u64,
        name: &str,
        mode: u32,
        umask: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        self.make_node(
            parent,
            name,
            Kind::Dir,
            mode & 0o7777,
            umask,
            uid,
            gid,
            "",
            0,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    pub async fn mknod(
        &self,
        parent: u64,
        name: &str,
        mode: u32,
        umask: u32,
        rdev: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        let kind =
            attr::kind_from_posix(mode).ok_or_else(|| errno(libc::EINVAL, "bad file type"))?;
        if kind == Kind::Dir || kind == Kind::Symlink {
            return Err(errno(libc::EINVAL, "mknod of a directory or symlink"));
        }
        self.make_node(parent, name, kind, mode & 0o7777, umask, uid, gid, "", rdev)
            .await
    }

    pub async fn symlink(
        &self,
        parent: u64,
        name: &str,
        target: &str,
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        if target.len() > 4095 {
            return Err(errno(libc::ENAMETOOLONG, "symlink target too long"));
        }
        self.make_node(parent, name, Kind::Symlink, 0o777, 0, uid, gid, target, 0)
            .await
    }

    pub async fn readlink(&self, ino: u64) -> Result<String> {
        let path = self.path_of(ino)?;
        let (dir, name) = split(&path);
        let e = self.entry_at(&dir, &name).await?;
        let a = e.attributes.clone().unwrap_or_default();
        if attr::from_go_mode(a.file_mode).0 != Kind::Symlink {
            return Err(errno(libc::EINVAL, "not a symlink"));
        }
        Ok(a.symlink_target)
    }

    /// create(2): the filer entry is created on the first flush (like `weed mount`), but the
    /// name is visible here at once.
    #[allow(clippy::too_many_arguments)]
    pub async fn create(
        &self,
        parent: u64,
        name: &str,
        mode: u32,
        umask: u32,
        flags: i32,
        uid: u32,
        gid: u32,
    ) -> Result<(Attr, u64)> {
        self.check_writable()?;
        self.check_new_name(name)?;
        let dir = self.parent_dir(parent).await?;
        match self.entry_at(&dir, name).await {
            Ok(_) if flags & libc::O_EXCL != 0 => {
                return Err(errno(libc::EEXIST, format!("{dir}/{name} exists")));
            }
            // Another client made the name between the kernel's lookup and this create. The
            // kernel skips its permission check for a file it asked us to create, and we
            // cannot make it ourselves (a request carries no supplementary groups), so the
            // file is not opened here: ESTALE makes the kernel walk the path once more,
            // find the file, check the caller against its mode and open (and truncate) it
            // the ordinary way.
            Ok(_) => {
                return Err(errno(
                    libc::ESTALE,
                    format!("{dir}/{name} was created by another client; the kernel looks again"),
                ));
            }
            Err(e) if e.errno == libc::ENOENT => {}
            Err(e) => return Err(e),
        }
        let path = join(&dir, name);
        let (perm, acls) = self
            .initial_mode(parent, &dir, Kind::File, mode & 0o7777, umask)
            .await;
        let (perm, gid) = self
            .inherit_group(parent, &dir, Kind::File, perm, uid, gid)
            .await;
        let mut e = self.new_entry(name, Kind::File, perm, uid, gid, "", 0);
        e.extended.extend(acls);
        let ino = self.fresh_inode();
        if let Some(a) = e.attributes.as_mut() {
            a.inode = ino;
        }
        let of = Arc::new(
            OpenFile::new(
                ino,
                dir.clone(),
                e.clone(),
                self.cfg.chunk_size,
                self.cfg.max_dirty_slots,
            )
            .with_budget(self.cfg.budget.clone()),
        );
        // the name exists here from now on, before the filer has it
        self.remember_local(&dir, name);
        {
            let mut s = of.state.lock();
            s.pending_create = true;
            s.changed_here();
            s.touch();
        }
        self.files.lock().insert(
            ino,
            OpenEntry {
                file: of.clone(),
                handles: 0,
            },
        );
        self.meta.upsert(&dir, Arc::new(e.clone()));
        self.touch_dir(&dir);
        let a = self.remember(&path, &e, true);
        let fh = self.add_handle(ino, of, true)?;
        Ok((a, fh))
    }

    pub async fn unlink(&self, parent: u64, name: &str) -> Result<()> {
        self.check_writable()?;
        let dir = self.path_of(parent)?;
        let e = self.entry_at(&dir, name).await?;
        if e.is_directory {
            return Err(errno(libc::EISDIR, "unlink of a directory"));
        }
        let path = join(&dir, name);
        let ino = self.node_id(&path, &e);
        // other names of a hard-linked file keep it (and its open handles) alive
        let linked = attr::has_other_links(&e);
        let of = self.open_file(ino);
        // a commit of the file already on its way lands first: after the delete it would
        // create the name again, listing chunks the delete removes
        let _commit = match &of {
            Some(of) if !linked => Some(of.commit.lock().await),
            _ => None,
        };
        let (pending, marked) = match &of {
            Some(of) => {
                let mut s = of.state.lock();
                // marked before the delete, so a concurrent flush cannot resurrect the entry
                let mark = !linked && s.dir == dir && s.entry.name == name && !s.unlinked;
                if mark {
                    s.unlinked = true;
                }
                (s.pending_create, mark)
            }
            None => (false, false),
        };
        if !pending {
            let _local = self.note_local(&dir, name, Some(ino));
            self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
            let r = self
                .filer
                .delete_entry(pb::DeleteEntryRequest {
                    directory: dir.clone(),
                    name: name.to_string(),
                    is_delete_data: true,
                    ..Default::default()
                })
                .await;
            if let Err(err) = r {
                if let (Some(of), true) = (&of, marked) {
                    of.state.lock().unlinked = false;
                }
                return Err(err.into());
            }
        }
        self.meta.remove(&dir, name);
        self.name_removed(&dir, name, &e, false);
        self.touch_dir(&dir);
        if !e.hard_link_id.is_empty() {
            if let Some(n) = self.notifier() {
                n.inval_inode(ino);
            }
        }
        Ok(())
    }

    pub async fn rmdir(&self, parent: u64, name: &str) -> Result<()> {
        self.check_writable()?;
        if name == "." {
            return Err(errno(libc::EINVAL, "rmdir ."));
        }
        let dir = self.path_of(parent)?;
        let e = self.entry_at(&dir, name).await?;
        if !e.is_directory {
            return Err(errno(libc::ENOTDIR, "rmdir of a non-directory"));
        }
        let path = join(&dir, name);
        if self.load_dir(&path).await.unwrap_or(false) {
            if let Some(l) = self.meta.listing(&path) {
                if !l.is_empty() {
                    return Err(errno(libc::ENOTEMPTY, format!("{path} is not empty")));
                }
            }
        }
        self.remember_local(&dir, name);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        self.filer
            .delete_entry(pb::DeleteEntryRequest {
                directory: dir.clone(),
                name: name.to_string(),
                is_delete_data: true,
                ..Default::default()
            })
            .await
            .map_err(|e| match e {
                FilerError::NotEmpty(m) => errno(libc::ENOTEMPTY, m),
                other => other.into(),
            })?;
        self.meta.remove(&dir, name);
        self.meta.invalidate_dir(&path, true);
        self.inodes.unlink_path(&path);
        self.dir_times.lock().remove(&path);
        self.touch_dir(&dir);
        Ok(())
    }

    pub async fn rename(
        &self,
        parent: u64,
        name: &str,
        newparent: u64,
        newname: &str,
        flags: u32,
    ) -> Result<()> {
        self.check_writable()?;
        if flags & RENAME_WHITEOUT != 0 {
            return Err(errno(libc::EINVAL, "RENAME_WHITEOUT is not supported"));
        }
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0
            || flags & RENAME_NOREPLACE != 0 && flags & RENAME_EXCHANGE != 0
        {
            return Err(errno(libc::EINVAL, "unknown rename flags"));
        }
        self.check_new_name(newname)?;
        let odir = self.path_of(parent)?;
        let ndir = self.parent_dir(newparent).await?;
        let src = self.entry_at(&odir, name).await?;
        let opath = join(&odir, name);
        let npath = join(&ndir, newname);
        if src.is_directory && (npath.starts_with(&format!("{opath}/"))) {
            return Err(errno(libc::EINVAL, "cannot move a directory into itself"));
        }
        let dst = match self.entry_at(&ndir, newname).await {
            Ok(d) => Some(d),
            Err(e) if e.errno == libc::ENOENT => None,
            Err(e) => return Err(e),
        };
        if opath == npath {
            return Ok(());
        }
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return Err(errno(libc::EEXIST, format!("{npath} exists")));
        }
        if flags & RENAME_EXCHANGE != 0 {
            let Some(dst) = dst else {
                return Err(errno(libc::ENOENT, format!("{npath} does not exist")));
            };
            if dst.is_directory && src.is_directory && npath.starts_with(&format!("{opath}/"))
                || opath.starts_with(&format!("{npath}/"))
            {
                return Err(errno(
                    libc::EINVAL,
                    "cannot exchange a directory with its descendant",
                ));
            }
            // Three moves through a hidden temporary name in the source directory.
            let tmp = format!(".swx-{}-{}", std::process::id(), super::file::next_ts_ns());
            self.rename_plain(&odir, name, &odir, &tmp, &src).await?;
            let tsrc = self.entry_at(&odir, &tmp).await?;
            if let Err(e) = self.rename_plain(&ndir, newname, &odir, name, &dst).await {
                let _ = self.rename_plain(&odir, &tmp, &odir, name, &tsrc).await;
                return Err(e);
            }
            self.rename_plain(&odir, &tmp, &ndir, newname, &tsrc)
                .await?;
            return Ok(());
        }
        if let Some(d) = &dst {
            match (src.is_directory, d.is_directory) {
                (true, false) => {
                    return Err(errno(libc::ENOTDIR, format!("{npath} is not a directory")))
                }
                (false, true) => {
                    return Err(errno(libc::EISDIR, format!("{npath} is a directory")))
                }
                (true, true) => {
                    let np = npath.clone();
                    if self.load_dir(&np).await.unwrap_or(false) {
                        if let Some(l) = self.meta.listing(&np) {
                            if !l.is_empty() {
                                return Err(errno(libc::ENOTEMPTY, format!("{np} is not empty")));
                            }
                        }
                    }
                }
                _ => {}
            }
            // the replaced file lives on in open handles only (a hard link, also under its
            // other names)
            let replaced = self
                .open_file(self.node_id(&npath, d))
                .map(|of| (of, attr::has_other_links(d)));
            return self
                .rename_plain_over(&odir, name, &ndir, newname, &src, replaced)
                .await;
        }
        self.rename_plain(&odir, name, &ndir, newname, &src).await
    }

    async fn rename_plain(
        &self,
        odir: &str,
        name: &str,
        ndir: &str,
        newname: &str,
        src: &pb::Entry,
    ) -> Result<()> {
        self.rename_plain_over(odir, name, ndir, newname, src, None)
            .await
    }

    /// Moves `odir/name` to `ndir/newname`; `replaced` is the open file the move replaces
    /// there, and whether it has other links: unlinked by the move (undone if the move
    /// fails), or, a hard link, moved to another of its names once the move is done.
    async fn rename_plain_over(
        &self,
        odir: &str,
        name: &str,
        ndir: &str,
        newname: &str,
        src: &pb::Entry,
        replaced: Option<(Arc<OpenFile>, bool)>,
    ) -> Result<()> {
        let opath = join(odir, name);
        let npath = join(ndir, newname);
        let ino = self.node_id(&opath, src);
        // a deferred or dirty file must exist on the filer before it can be moved there
        if let Some(of) = self.open_file(ino) {
            self.flush_file(&of).await?;
        }
        // This node's commits of the moved files, and of the replaced one, wait until the
        // open files know their new names: a commit in between would create the old name
        // again, or write the replaced file over the moved one, with chunks another entry
        // lists (deleting either would delete the other's data).
        let held = self.open_files_at(&opath, replaced.as_ref().map(|(of, _)| of));
        let mut _commits = Vec::with_capacity(held.len());
        for of in &held {
            _commits.push(of.commit.lock().await);
        }
        // (a hard link is not marked: its commit cannot run before it moves, its lock is held)
        let marked = replaced.as_ref().is_some_and(|(of, linked)| {
            !linked && !std::mem::replace(&mut of.state.lock().unlinked, true)
        });
        let _old = self.note_local(odir, name, Some(ino));
        let _new = self.note_local(ndir, newname, None);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let events = match self
            .filer
            .rename_entry(pb::StreamRenameEntryRequest {
                old_directory: odir.to_string(),
                old_name: name.to_string(),
                new_directory: ndir.to_string(),
                new_name: newname.to_string(),
                ..Default::default()
            })
            .await
        {
            Ok(events) => events,
            Err(e) => {
                if let (Some((of, _)), true) = (&replaced, marked) {
                    of.state.lock().unlinked = false;
                }
                return Err(e.into());
            }
        };
        let moved = events
            .iter()
            .filter_map(|r| r.event_notification.as_ref())
            .filter_map(|n| n.new_entry.clone())
            .find(|e| e.name == newname)
            .unwrap_or_else(|| entry_with_name(src, newname));
        self.meta.remove(odir, name);
        if src.is_directory {
            self.meta.invalidate_dir(&opath, true);
            self.meta.invalidate_dir(&npath, true);
        }
        self.moved(&opath, &npath, !src.is_directory);
        if let Some((of, true)) = &replaced {
            // its name here is the moved file's now; its other names still lead to it
            let names = self.inodes.live_names(of.ino);
            super::events::name_taken(&mut of.state.lock(), &npath, true, names);
        }
        // POSIX: rename changes the moved inode's ctime. Set on the filer's entry as it is
        // now: `src` may be older than another node's last write to it.
        let moved = match self
            .update_fresh(ndir, newname, |e| {
                let a = e.attributes.get_or_insert_with(Default::default);
                (a.ctime, a.ctime_ns) = now_parts();
                Ok(())
            })
            .await
        {
            Ok(e) => e,
            Err(e) => {
                tracing::debug!(path = npath, error = %e, "ctime update after rename failed");
                self.meta.upsert(ndir, Arc::new(moved.clone()));
                moved
            }
        };
        if let Some(of) = self.open_file(ino) {
            let mut s = of.state.lock();
            if let (Some(a), Some(m)) = (s.entry.attributes.as_mut(), moved.attributes.as_ref()) {
                a.ctime = m.ctime;
                a.ctime_ns = m.ctime_ns;
            }
        }
        self.touch_dir(odir);
        self.touch_dir(ndir);
        Ok(())
    }

    /// The open files at `opath` or below it, and `also`, each once, in inode order (the
    /// order their commit locks are taken in when one task holds several).
    fn open_files_at(&self, opath: &str, also: Option<&Arc<OpenFile>>) -> Vec<Arc<OpenFile>> {
        let prefix = format!("{opath}/");
        let mut out: Vec<Arc<OpenFile>> = {
            let files = self.files.lock();
            files
                .values()
                .filter(|o| {
                    let s = o.file.state.lock();
                    let p = join(&s.dir, &s.entry.name);
                    p == opath || p.starts_with(&prefix)
                })
                .map(|o| o.file.clone())
                .collect()
        };
        out.extend(also.cloned());
        out.sort_by_key(|of| of.ino);
        out.dedup_by(|a, b| Arc::ptr_eq(a, b));
        out
    }

    /// `opath` (and everything below it) is now at `npath`: node ids and open files follow.
    /// `file`: the entry moved is not a directory.
    pub(super) fn moved(&self, opath: &str, npath: &str, file: bool) {
        self.inodes.rename(opath, npath, file);
        let prefix = format!("{opath}/");
        {
            // pending directory times go with their directories (at the old path they would
            // be lost, or land on a directory made there since)
            let mut times = self.dir_times.lock();
            let keys: Vec<String> = times
                .keys()
                .filter(|k| *k == opath || k.starts_with(&prefix))
                .cloned()
                .collect();
            for k in keys {
                if let Some(t) = times.remove(&k) {
                    let nk = format!("{npath}{}", &k[opath.len()..]);
                    let at = times.entry(nk).or_insert(t);
                    *at = (*at).max(t);
                }
            }
        }
        let files = self.files.lock();
        for o in files.values() {
            let mut s = o.file.state.lock();
            let p = join(&s.dir, &s.entry.name);
            if p == opath {
                (s.dir, s.entry.name) = split(npath);
            } else if p.starts_with(&prefix) {
                let np = format!("{npath}{}", &p[opath.len()..]);
                s.dir = split(&np).0;
            }
        }
    }

    /// The file of node `ino` is now at `npath`, while its old path belongs to another node
    /// (a directory moves with its subtree, by path: [`moved`](Self::moved)).
    pub(super) fn moved_node(&self, ino: u64, npath: &str) {
        if self.inodes.path(ino).is_none() {
            return;
        }
        self.inodes
            .remember_as(ino, npath, Kind::File, false, false);
        if let Some(of) = self.open_file(ino) {
            let mut s = of.state.lock();
            if !s.unlinked {
                (s.dir, s.entry.name) = split(npath);
            }
        }
    }

    /// The name `dir/name` of `e` is gone: open handles of a hard-linked file follow one of
    /// its other names; otherwise they become unlinked (their data is no longer committed).
    /// `doubt`: the removal may be older than our own change of the name; an open file
    /// is then left linked (the caller re-reads the entry to decide).
    pub(super) fn name_removed(&self, dir: &str, name: &str, e: &pb::Entry, doubt: bool) {
        let path = join(dir, name);
        let ino = self.node_of(&path, e);
        self.meta.link_removed(e);
        self.inodes.unlink_path(&path);
        let Some(of) = self.open_file(ino).filter(|_| !doubt) else {
            return;
        };
        let linked = attr::has_other_links(e);
        let other = self.inodes.aliases(ino).into_iter().next();
        let mut s = of.state.lock();
        if !linked {
            s.unlinked = true;
            s.epoch += 1;
            return;
        }
        s.entry.hard_link_counter = (s.entry.hard_link_counter - 1).max(1);
        // a re-read asked for before this may have looked for the file under this name
        s.epoch += 1;
        if s.dir == dir && s.entry.name == name {
            match other {
                Some(p) => (s.dir, s.entry.name) = split(&p),
                None => s.unlinked = true,
            }
        }
    }

    pub async fn link(&self, ino: u64, newparent: u64, newname: &str) -> Result<Attr> {
        self.check_writable()?;
        self.check_new_name(newname)?;
        let path = self.path_of(ino)?;
        let (dir, name) = split(&path);
        let open = self.open_file(ino);
        if let Some(of) = &open {
            self.flush_file(of).await?;
        }
        // This node's commits of the file wait until it knows its link group: one in between
        // would write the entry without it, and its two names would then list the same
        // chunks as two files (deleting either would delete the other's data).
        let _commit = match &open {
            Some(of) => Some(of.commit.lock().await),
            None => None,
        };
        let ndir = self.parent_dir(newparent).await?;
        self.ensure_absent(&ndir, newname).await?;
        // the link group is set on the filer's current entry (a cached one may miss another
        // node's write, whose chunks the update would delete)
        let mut prior = (Vec::new(), 0);
        let updated = self
            .update_fresh(&dir, &name, |e| {
                if e.is_directory {
                    return Err(errno(libc::EPERM, "hard link to a directory"));
                }
                prior = (e.hard_link_id.clone(), e.hard_link_counter);
                // names of a link group share the filer's number as their node id: a file
                // known here by a derived id (another upload has its number) takes that id
                // as its number, or it would become the other file's node
                // (an entry without a number is known by its path until it has a link id)
                let renumber = e.hard_link_id.is_empty()
                    && (attr::entry_inode(&path, e) != ino
                        || e.attributes.as_ref().is_none_or(|a| a.inode == 0));
                if e.hard_link_id.is_empty() {
                    let mut id: Vec<u8> = (0..16).map(|_| rand::random::<u8>()).collect();
                    id.push(1);
                    e.hard_link_id = id;
                    e.hard_link_counter = 1;
                }
                e.hard_link_counter += 1;
                let a = e.attributes.get_or_insert_with(Default::default);
                (a.ctime, a.ctime_ns) = now_parts();
                if renumber {
                    a.inode = ino;
                }
                Ok(())
            })
            .await?;
        // the node stands for the file under its (maybe new) number
        self.inodes.note_file(ino, &attr::file_id(&path, &updated));
        let newe = entry_with_name(&updated, newname);
        if let Err(e) = self.create_on_filer(&ndir, &newe, true).await {
            if e.errno != libc::EEXIST {
                // the new name may exist anyway: a count too high only keeps chunks longer
                return Err(e);
            }
            // undo only our count, on the entry as it is now, and only if it is still the
            // group we joined (a link made meanwhile keeps its count)
            let _ = self
                .update_fresh(&dir, &name, |e| {
                    if e.hard_link_id != updated.hard_link_id {
                        return Err(errno(libc::ESTALE, "replaced meanwhile"));
                    }
                    e.hard_link_counter = (e.hard_link_counter - 1).max(1);
                    if prior.0.is_empty() && e.hard_link_counter == 1 {
                        (e.hard_link_id, e.hard_link_counter) = prior.clone();
                    }
                    Ok(())
                })
                .await;
            return Err(e);
        }
        self.meta.upsert(&ndir, Arc::new(newe.clone()));
        if let Some(of) = self.open_file(ino) {
            // the next flush of an open handle must keep the file in its link group
            let mut s = of.state.lock();
            s.entry.hard_link_id = updated.hard_link_id.clone();
            s.entry.hard_link_counter = updated.hard_link_counter;
            if let (Some(a), Some(u)) = (s.entry.attributes.as_mut(), updated.attributes.as_ref()) {
                (a.ctime, a.ctime_ns, a.inode) = (u.ctime, u.ctime_ns, u.inode);
            }
        }
        self.touch_dir(&ndir);
        if let Some(n) = self.notifier() {
            n.inval_inode(ino);
        }
        let npath = join(&ndir, newname);
        let a = self.attr_of(ino, &npath, &newe);
        let mut a = Attr { ino, ..a };
        if self.open_file(ino).is_none() {
            a.nlink = newe.hard_link_counter.max(1) as u32;
        }
        self.inodes.remember_link(ino, &npath, a.kind, true);
        Ok(a)
    }
}
