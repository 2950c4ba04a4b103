//! Namespace, attribute, handle and write operations of [`Fs`].

use super::acl::{self, Acl};
use super::attr::{self, entry_attr, entry_inode, to_go_mode, Attr, Kind};
use super::file::{cut_start, CommitSnapshot, OpenFile, SealedRun};
use super::inode::{join, split, ROOT_INO};
use super::meta::Cached;
use super::{entry_with_name, errno, now_parts, Fs, Handle, OpenEntry, Result};
use crate::filer::FilerError;
use crate::pb::filer as pb;
use crate::volume::VolumeError;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// One directory entry returned by readdir(plus).
#[derive(Debug, Clone)]
pub struct DirEntryOut {
    pub name: String,
    pub ino: u64,
    pub kind: Kind,
    /// Full attributes (None for "." and "..").
    pub attr: Option<Attr>,
}

/// The entries an open directory handle lists (a snapshot taken when it is read from 0).
#[derive(Debug, Default)]
pub struct DirListing {
    pub entries: Vec<DirEntryOut>,
    /// [`Fs`]'s count of names taken away by events, read before the snapshot was taken.
    names_gone: u64,
}

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
}

#[derive(Debug, Clone, Copy, Default)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

const XATTR_PREFIX: &str = "xattr-";
const SELINUX_XATTR: &str = "security.selinux";
const RENAME_NOREPLACE: u32 = 1;
const RENAME_EXCHANGE: u32 = 2;
const RENAME_WHITEOUT: u32 = 4;
/// The granularity lseek reports data and holes in.
const SEEK_BLOCK: u64 = 4096;

impl Fs {
    // ---------- path and entry resolution ----------

    pub fn path_of(&self, ino: u64) -> Result<String> {
        self.inodes
            .path(ino)
            .ok_or_else(|| errno(libc::ESTALE, format!("unknown inode {ino}")))
    }

    fn check_writable(&self) -> Result<()> {
        if self.cfg.read_only {
            Err(errno(libc::EROFS, "read-only mount"))
        } else {
            Ok(())
        }
    }

    fn dir_lock(&self, dir: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.dir_locks
            .lock()
            .entry(dir.to_string())
            .or_default()
            .clone()
    }

    /// Lists `dir` into the metadata cache (coalesced per directory).
    async fn load_dir(&self, dir: &str) -> Result<bool> {
        let lock = self.dir_lock(dir);
        let _g = lock.lock().await;
        if self.meta.is_cached(dir) {
            return Ok(true);
        }
        if self.meta.is_too_large(dir) {
            return Ok(false);
        }
        let gen = self.meta.generation(dir);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let entries = self.filer.list_all(dir).await?;
        if entries.len() > self.cfg.max_cached_dir_entries {
            // every lookup in it would list it all again
            self.meta.mark_too_large(dir);
            return Ok(false);
        }
        let pinned = self.pending_in_dir(dir, None);
        Ok(self.meta.install(dir, entries, gen, &pinned))
    }

    /// Files created here in `dir` (only `name`, if given) whose creation is still deferred
    /// (not yet on the filer).
    fn pending_in_dir(&self, dir: &str, name: Option<&str>) -> Vec<Arc<pb::Entry>> {
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
    async fn list_uncached(&self, dir: &str) -> Result<Vec<Arc<pb::Entry>>> {
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
    fn attr_of(&self, ino: u64, path: &str, e: &pb::Entry) -> Attr {
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

    fn open_file_attr(&self, ino: u64, of: &OpenFile) -> Attr {
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

    fn root_attr(&self) -> Attr {
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

    /// Applies the capacity recorded on the root entry (see [`super::CAPACITY_XATTR`]) as the
    /// quota, when this volume takes its quota from the filer. An absent or unreadable record
    /// keeps the current quota (volume context, NodeExpandVolume).
    fn take_capacity(&self, root: &pb::Entry) {
        if !self.cfg.quota_from_filer {
            return;
        }
        let Some(bytes) = root
            .extended
            .get(super::CAPACITY_XATTR)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| s.trim().parse::<i64>().ok())
        else {
            return;
        };
        // 1 byte or less means no quota, as in the volume context.
        let bytes = if bytes <= 1 { 0 } else { bytes as u64 };
        if bytes != self.quota() {
            tracing::info!(root = %self.cfg.root, from = self.quota(), to = bytes, "quota changed on the filer");
            self.set_quota(bytes);
        }
    }

    /// Re-reads the capacity recorded on the root entry (an expansion made elsewhere).
    /// Errors are ignored: the health check reports an unreachable filer.
    pub async fn refresh_capacity(&self) {
        if !self.cfg.quota_from_filer || self.cfg.root == "/" {
            return;
        }
        let (dir, name) = split(&self.cfg.root);
        if let Ok(e) = self.filer.lookup_entry(&dir, &name).await {
            self.take_capacity(&e);
        }
    }

    fn remember(&self, path: &str, e: &pb::Entry, counted: bool) -> Attr {
        let ino = entry_inode(path, e);
        let a = self.attr_of(ino, path, e);
        let linked = !e.hard_link_id.is_empty();
        self.inodes.remember_as(ino, path, a.kind, counted, linked);
        a
    }

    /// A new inode number for an entry we create. Not the filer's md5(path)+crtime_secs*37
    /// formula `weed mount` uses: that repeats when a path is reused within a second (write
    /// `x.lock`, rename it over `x`, create `x.lock` again), and two files with one number look
    /// like hard links to tar/rsync and mix up open-file state here. Random numbers are
    /// unique in practice; numbers the kernel knows here are skipped.
    fn fresh_inode(&self) -> u64 {
        loop {
            let ino: u64 = rand::random();
            if ino > ROOT_INO && self.inodes.path(ino).is_none() && self.open_file(ino).is_none() {
                return ino;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn new_entry(
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

    // ---------- lookup / attributes ----------

    pub async fn lookup(&self, parent: u64, name: &str) -> Result<Attr> {
        let dir = self.path_of(parent)?;
        let e = self.entry_at(&dir, name).await?;
        let path = join(&dir, name);
        if e.is_directory {
            self.load_dir_for_nlink(&path).await;
        }
        Ok(self.remember(&path, &e, true))
    }

    /// Lists a directory so its link count is known (best effort: it is usually read next).
    async fn load_dir_for_nlink(&self, path: &str) {
        if let Err(e) = self.load_dir(path).await {
            tracing::debug!(path, error = %e, "listing for the link count failed");
        }
    }

    pub fn forget(&self, ino: u64, n: u64) {
        self.inodes.forget(ino, n);
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

    pub async fn setattr(&self, ino: u64, req: SetAttr) -> Result<Attr> {
        self.check_writable()?;
        if ino == ROOT_INO && self.cfg.root == "/" {
            return Err(errno(libc::EPERM, "cannot change the filer root"));
        }
        let path = self.path_of(ino)?;
        let (dir, name) = split(&path);
        if let Some(of) = self.open_file(ino) {
            return self.setattr_open(ino, &path, &of, &req).await;
        }
        if ino == ROOT_INO {
            let (pdir, pname) = split(&self.cfg.root);
            let mut e = self.filer.lookup_entry(&pdir, &pname).await?;
            self.apply_setattr(&mut e, &req);
            self.update_entry(&pdir, e.clone()).await?;
            let mut a = entry_attr(ROOT_INO, &e, &self.cfg.ids);
            a.ino = ROOT_INO;
            *self.root_attr.lock() = a.clone();
            return Ok(a);
        }
        if req.size.is_some() {
            // A truncate rewrites the chunk list: build it on the filer's entry, not a cached
            // one, and through the open-file path (a cut chunk is rewritten, inline content
            // that grows past the inline limit becomes a chunk instead of a huge buffer).
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
                    self.setattr_open(ino, &path, &of, &req).await
                }
                None => Err(errno(libc::EIO, "handle vanished during truncate")),
            };
            let released = self.release(fh, ino).await;
            return r.and_then(|a| released.map(|_| a));
        }
        let e = self
            .update_fresh(&dir, &name, |e| {
                self.apply_setattr(e, &req);
                Ok(())
            })
            .await?;
        Ok(self.attr_of(ino, &path, &e))
    }

    fn apply_setattr(&self, e: &mut pb::Entry, req: &SetAttr) {
        let a = e.attributes.get_or_insert_with(Default::default);
        if let Some(m) = req.mode {
            let (kind, _) = attr::from_go_mode(a.file_mode);
            let kind = if e.is_directory { Kind::Dir } else { kind };
            a.file_mode = to_go_mode(kind, m & 0o7777);
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

    /// setattr through an open file's state; the change is committed at once.
    async fn setattr_open(
        &self,
        ino: u64,
        path: &str,
        of: &Arc<OpenFile>,
        req: &SetAttr,
    ) -> Result<Attr> {
        let clean = {
            let s = of.state.lock();
            s.is_clean() && !s.unlinked
        };
        if req.size.is_none() && clean {
            // nothing of ours to commit: change the filer's entry, never our copy of it. The
            // commit lock keeps this node's own commits of the file out of the lookup→update.
            let _commit = of.commit.lock().await;
            if of.state.lock().is_clean() {
                let (dir, name) = split(path);
                let e = self
                    .update_fresh(&dir, &name, |e| {
                        self.apply_setattr(e, req);
                        Ok(())
                    })
                    .await?;
                self.adopt_if_clean(ino, of, e.clone()).await;
                return Ok(self.attr_of(ino, path, &e));
            }
        }
        if let Some(size) = req.size {
            self.refresh_if_clean(ino, of).await?;
            let runs = of.seal_all();
            self.start_uploads(of, runs).await;
            of.wait_uploads().await;
            let cut = {
                let s = of.state.lock();
                if s.entry.content.is_empty() {
                    cut_start(&s.resolved, size)
                } else {
                    None
                }
            };
            of.truncate(size).await;
            if let Some(lo) = cut {
                // A chunk cut in the middle would be recorded with a size smaller than its
                // needle, which the filer's HTTP/S3 readers cannot serve: rewrite the kept
                // bytes as a new chunk that hides it.
                let kept = self.read_range(of, lo, size - lo).await?;
                let runs = of.write(lo, &kept);
                self.start_uploads(of, runs).await;
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
        Ok(self.attr_of(ino, path, &e))
    }

    async fn update_entry(&self, dir: &str, e: pb::Entry) -> Result<()> {
        let _local = self.note_local(dir, &e.name, Some(entry_inode(&join(dir, &e.name), &e)));
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let req = pb::UpdateEntryRequest {
            directory: dir.to_string(),
            entry: Some(e.clone()),
            ..Default::default()
        };
        self.filer.update_entry(req).await?;
        self.meta.upsert(dir, Arc::new(e));
        Ok(())
    }

    /// The filer's current entry `dir/name`, never a cached one.
    async fn fresh_entry(&self, dir: &str, name: &str) -> Result<pb::Entry> {
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
    /// every chunk an update leaves out. (The filer has no compare-and-swap; what is left is
    /// the round trip between this lookup and the update.)
    async fn update_fresh(
        &self,
        dir: &str,
        name: &str,
        f: impl FnOnce(&mut pb::Entry) -> Result<()>,
    ) -> Result<pb::Entry> {
        let mut e = self.fresh_entry(dir, name).await?;
        f(&mut e)?;
        self.update_entry(dir, e.clone()).await?;
        Ok(e)
    }

    /// Takes the filer's entry `e` into an open file that has nothing of its own to commit.
    async fn adopt_if_clean(&self, ino: u64, of: &Arc<OpenFile>, e: pb::Entry) {
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
    async fn refresh_if_clean(&self, ino: u64, of: &Arc<OpenFile>) -> Result<()> {
        let (dir, name, clean) = {
            let s = of.state.lock();
            (
                s.dir.clone(),
                s.entry.name.clone(),
                s.is_clean() && !s.pending_create && !s.unlinked,
            )
        };
        if !clean {
            return Ok(());
        }
        match self.fresh_entry(&dir, &name).await {
            Ok(e) => {
                self.adopt_if_clean(ino, of, e).await;
                Ok(())
            }
            // deleted elsewhere (its event not here yet): a commit would bring it back with
            // chunks the filer already deleted. ESTALE makes the kernel walk the path again
            // (an O_CREAT open then creates a new file instead of failing).
            Err(e) if e.errno == libc::ENOENT => {
                self.meta.remove(&dir, &name);
                self.note_name_gone();
                if let (Some(nt), Some(pino)) =
                    (self.notifier.read().clone(), self.inodes.ino_of(&dir))
                {
                    nt.inval_entry(pino, &name);
                }
                Err(errno(
                    libc::ESTALE,
                    format!("{dir}/{name} was deleted elsewhere"),
                ))
            }
            Err(e) => Err(e),
        }
    }

    async fn create_on_filer(&self, dir: &str, e: &pb::Entry, excl: bool) -> Result<()> {
        let _local = self.note_local(dir, &e.name, Some(entry_inode(&join(dir, &e.name), e)));
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let req = pb::CreateEntryRequest {
            directory: dir.to_string(),
            entry: Some(e.clone()),
            o_excl: excl,
            skip_check_parent_directory: true,
            ..Default::default()
        };
        self.filer
            .create_entry(req)
            .await
            .map_err(|err| match err {
                FilerError::AlreadyExists(m) => errno(libc::EEXIST, m),
                other => other.into(),
            })?;
        Ok(())
    }

    /// Records a change of `dir`'s contents: mtime/ctime now, written back in the background.
    fn touch_dir(&self, dir: &str) {
        self.dir_times
            .lock()
            .insert(dir.to_string(), SystemTime::now());
    }

    /// Writes pending directory times to the filer (called periodically).
    pub async fn flush_dir_times(&self) {
        let pending: Vec<(String, SystemTime)> = self.dir_times.lock().drain().collect();
        for (path, t) in pending {
            if path == "/" {
                continue;
            }
            let (dir, name) = split(&path);
            let e = match self.filer.lookup_entry(&dir, &name).await {
                Ok(e) => e,
                Err(_) => continue,
            };
            let mut e = e;
            let a = e.attributes.get_or_insert_with(Default::default);
            let (s, ns) = attr::split_ts(t);
            if (a.mtime, a.mtime_ns) >= (s, ns) {
                continue;
            }
            a.mtime = s;
            a.mtime_ns = ns;
            a.ctime = s;
            a.ctime_ns = ns;
            if let Err(err) = self.update_entry(&dir, e).await {
                tracing::debug!(path, error = %err, "directory time write-back failed");
            }
            if path == self.cfg.root {
                let mut r = self.root_attr.lock();
                r.mtime = r.mtime.max(t);
                r.ctime = r.ctime.max(t);
            }
        }
    }

    // ---------- namespace ----------

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
            Ok(e) => {
                if flags & libc::O_EXCL != 0 {
                    return Err(errno(libc::EEXIST, format!("{dir}/{name} exists")));
                }
                let path = join(&dir, name);
                let a = self.remember(&path, &e, true);
                let fh = self.open(a.ino, flags).await?;
                return Ok((self.getattr(a.ino).await?, fh));
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
        let of = Arc::new(OpenFile::new(
            ino,
            dir.clone(),
            e.clone(),
            self.cfg.chunk_size,
            self.cfg.max_dirty_slots,
        ));
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
        let fh = self.add_handle(ino, of, true);
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
        let ino = entry_inode(&path, &e);
        // other names of a hard-linked file keep it (and its open handles) alive
        let linked = !e.hard_link_id.is_empty() && e.hard_link_counter > 1;
        let of = self.open_file(ino);
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
            if let Some(n) = self.notifier.read().clone() {
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
            // the replaced file lives on in open handles only (undone if the rename fails)
            let dino = entry_inode(&npath, d);
            if let Some(of) = self.open_file(dino) {
                let marked = {
                    let mut s = of.state.lock();
                    !std::mem::replace(&mut s.unlinked, true)
                };
                let r = self.rename_plain(&odir, name, &ndir, newname, &src).await;
                if r.is_err() && marked {
                    of.state.lock().unlinked = false;
                }
                return r;
            }
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
        let opath = join(odir, name);
        let npath = join(ndir, newname);
        let ino = entry_inode(&opath, src);
        // a deferred or dirty file must exist on the filer before it can be moved there
        if let Some(of) = self.open_file(ino) {
            self.flush_file(&of).await?;
        }
        let _old = self.note_local(odir, name, Some(ino));
        let _new = self.note_local(ndir, newname, None);
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let events = self
            .filer
            .rename_entry(pb::StreamRenameEntryRequest {
                old_directory: odir.to_string(),
                old_name: name.to_string(),
                new_directory: ndir.to_string(),
                new_name: newname.to_string(),
                ..Default::default()
            })
            .await?;
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
        self.moved(&opath, &npath);
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

    /// `opath` (and everything below it) is now at `npath`: node ids and open files follow.
    pub(super) fn moved(&self, opath: &str, npath: &str) {
        self.inodes.rename(opath, npath);
        let files = self.files.lock();
        let prefix = format!("{opath}/");
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

    /// The name `dir/name` of `e` is gone: open handles of a hard-linked file follow one of
    /// its other names; otherwise they become unlinked (their data is no longer committed).
    /// `doubt`: the removal may be older than our own change of the name; an open file
    /// is then left linked (the caller re-reads the entry to decide).
    pub(super) fn name_removed(&self, dir: &str, name: &str, e: &pb::Entry, doubt: bool) {
        let path = join(dir, name);
        let ino = entry_inode(&path, e);
        self.meta.link_removed(e);
        self.inodes.unlink_path(&path);
        let Some(of) = self.open_file(ino).filter(|_| !doubt) else {
            return;
        };
        let linked = !e.hard_link_id.is_empty() && e.hard_link_counter > 1;
        let other = self.inodes.aliases(ino).into_iter().next();
        let mut s = of.state.lock();
        if !linked {
            s.unlinked = true;
            s.epoch += 1;
            return;
        }
        s.entry.hard_link_counter = (s.entry.hard_link_counter - 1).max(1);
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
        if let Some(of) = self.open_file(ino) {
            self.flush_file(&of).await?;
        }
        let ndir = self.parent_dir(newparent).await?;
        self.ensure_absent(&ndir, newname).await?;
        let src = self.filer.lookup_entry(&dir, &name).await?;
        if src.is_directory {
            return Err(errno(libc::EPERM, "hard link to a directory"));
        }
        let mut updated = src.clone();
        if updated.hard_link_id.is_empty() {
            let mut id: Vec<u8> = (0..16).map(|_| rand::random::<u8>()).collect();
            id.push(1);
            updated.hard_link_id = id;
            updated.hard_link_counter = 1;
        }
        updated.hard_link_counter += 1;
        let a = updated.attributes.get_or_insert_with(Default::default);
        (a.ctime, a.ctime_ns) = now_parts();
        self.update_entry(&dir, updated.clone()).await?;
        let newe = entry_with_name(&updated, newname);
        if let Err(e) = self.create_on_filer(&ndir, &newe, true).await {
            let _ = self.update_entry(&dir, src).await;
            return Err(e);
        }
        self.meta.upsert(&ndir, Arc::new(newe.clone()));
        if let Some(of) = self.open_file(ino) {
            // the next flush of an open handle must keep the file in its link group
            let mut s = of.state.lock();
            s.entry.hard_link_id = updated.hard_link_id.clone();
            s.entry.hard_link_counter = updated.hard_link_counter;
            if let (Some(a), Some(u)) = (s.entry.attributes.as_mut(), updated.attributes.as_ref()) {
                (a.ctime, a.ctime_ns) = (u.ctime, u.ctime_ns);
            }
        }
        self.touch_dir(&ndir);
        if let Some(n) = self.notifier.read().clone() {
            n.inval_inode(ino);
        }
        let npath = join(&ndir, newname);
        let a = self.attr_of(ino, &npath, &newe);
        let mut a = Attr { ino, ..a };
        if self.open_file(ino).is_none() {
            a.nlink = newe.hard_link_counter.max(1) as u32;
        }
        self.inodes.remember_as(ino, &npath, a.kind, true, true);
        Ok(a)
    }

    // ---------- handles ----------

    /// Counts one more handle on `ino`'s open-file state and returns that state. The count
    /// and the lookup are one step: a last release running concurrently (on another thread)
    /// may have removed `file` from the table after the caller found it, and a handle on a
    /// state the table no longer has would see its writes vanish from getattr and setattr.
    fn register_open(&self, ino: u64, file: Arc<OpenFile>) -> Arc<OpenFile> {
        let mut files = self.files.lock();
        let o = files
            .entry(ino)
            .or_insert_with(|| OpenEntry { file, handles: 0 });
        o.handles += 1;
        o.file.clone()
    }

    fn add_handle(&self, ino: u64, file: Arc<OpenFile>, writable: bool) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let file = self.register_open(ino, file);
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

    /// A handle by number; after a takeover the kernel may present handles of the previous
    /// process, which are re-created on first use.
    pub async fn handle(&self, fh: u64, ino: u64) -> Result<Arc<Handle>> {
        if let Some(h) = self.handles.lock().get(&fh) {
            return Ok(h.clone());
        }
        self.verifier.adopted_handle(fh, ino);
        let of = self.open_inode(ino, false).await?;
        let file = self.register_open(ino, of);
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
    async fn open_inode(&self, ino: u64, by_name: bool) -> Result<Arc<OpenFile>> {
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
        if by_name && numbered && e.hard_link_id.is_empty() && entry_inode(&path, &e) != ino {
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
            );
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
        ))
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
        let of = self.open_inode(ino, true).await?;
        let fh = self.add_handle(ino, of, writable);
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

    pub(super) fn bump_content_gen(&self, ino: u64) {
        *self.content_gen.lock().entry(ino).or_default() += 1;
    }

    pub async fn write(&self, fh: u64, ino: u64, offset: u64, data: &[u8]) -> Result<u32> {
        self.check_writable()?;
        let h = self.handle(fh, ino).await?;
        self.verifier.check(fh)?;
        let of = h.file.clone();
        if let Some(e) = of.unplaced() {
            // no more bytes pile up behind data that cannot be placed; fsync retries it
            return Err(errno(
                libc::EIO,
                format!("earlier upload failed (fsync retries it): {e}"),
            ));
        }
        let quota = self.quota();
        if quota > 0 {
            let pending: u64 = of.state.lock().uncommitted;
            if self.used_bytes.load(Ordering::Relaxed) + pending + data.len() as u64 > quota {
                self.refresh_usage().await;
                if self.used_bytes.load(Ordering::Relaxed) + pending + data.len() as u64 > quota {
                    return Err(errno(libc::ENOSPC, "volume quota exceeded"));
                }
            }
        }
        let runs = of.write(offset, data);
        self.verifier.dirtied(ino);
        {
            let mut s = of.state.lock();
            let (sec, ns) = now_parts();
            let a = s.entry.attributes.get_or_insert_with(Default::default);
            a.mtime = sec;
            a.mtime_ns = ns;
            a.ctime = sec;
            a.ctime_ns = ns;
        }
        if !runs.is_empty() {
            self.start_uploads(&of, runs).await;
        }
        Ok(data.len() as u32)
    }

    /// Starts background uploads; waits for an upload slot first (backpressure on writers).
    pub(crate) async fn start_uploads(&self, of: &Arc<OpenFile>, runs: Vec<SealedRun>) {
        let path = of.path();
        for run in runs {
            let permit = match self.upload_sem.clone().acquire_owned().await {
                Ok(p) => p,
                Err(_) => {
                    of.upload_done(run.id, Err("shutting down".into()));
                    continue;
                }
            };
            let store = self.store.clone();
            let opts = self.upload_options(&path);
            let of = of.clone();
            let stats_bytes = run.data.len() as u64;
            self.stats.uploads.fetch_add(1, Ordering::Relaxed);
            self.stats
                .upload_bytes
                .fetch_add(stats_bytes, Ordering::Relaxed);
            let fs_stats = crate::metrics::global();
            let cache = self.cache.clone();
            let retry_for = self.cfg.upload_retry;
            tokio::spawn(async move {
                let done = UploadDone(Some((of, run.id)));
                let data = run.data.clone();
                let r = upload_with_retry(store.as_ref(), run.data, &opts, retry_for).await;
                let key = r.as_ref().ok().map(super::read::chunk_key);
                fs_stats.upload_done(r.is_ok());
                done.finish(r.map_err(|e| e.to_string()));
                // keep what we just wrote: reading it back is common
                if let Some(key) = key.filter(|_| run.offset == 0 || data.len() <= 1 << 20) {
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
        // what an earlier flush could not place is tried again first (same order stamps)
        let mut runs = of.retry_failed();
        runs.extend(of.seal_all());
        if !runs.is_empty() {
            self.start_uploads(of, runs).await;
        }
        of.wait_uploads().await;
        let _commit = of.commit.lock().await;
        let (dir, dirty, unlinked) = {
            let s = of.state.lock();
            (s.dir.clone(), s.meta_dirty, s.unlinked)
        };
        if let Some(e) = of.unplaced() {
            return Err(errno(libc::EIO, format!("upload failed: {e}")));
        }
        if !dirty || unlinked {
            return Ok(());
        }
        let mut snap = of.entry_for_commit();
        self.manifestize(of, &mut snap).await;
        let start = Instant::now();
        let mut attempt = 0;
        let mut pauses = crate::retry::STORAGE.pauses();
        loop {
            if attempt > 0 && of.state.lock().unlinked {
                // removed while we retried: committing now would bring it back
                return Ok(());
            }
            match self.create_on_filer(&dir, &snap.entry, false).await {
                Ok(()) => break,
                Err(e) if e.errno == libc::EIO && start.elapsed() < self.cfg.upload_retry => {
                    let wait = pauses.next_pause();
                    attempt += 1;
                    tracing::warn!(path = %of.path(), error = %e, attempt, "commit failed, retrying");
                    tokio::time::sleep(wait).await;
                }
                Err(e) => {
                    // the filer may have stored it anyway: never delete what it carried
                    of.keep_carried(&snap);
                    return Err(e);
                }
            }
        }
        if !snap.folded.is_empty() {
            of.manifestized(&snap.folded, snap.manifests.clone());
        }
        let orphans = of.committed(&snap);
        self.delete_orphans(orphans);
        self.meta.upsert(&dir, Arc::new(snap.entry));
        Ok(())
    }

    /// Deletes chunks of ours that no entry references, in the background.
    fn delete_orphans(&self, fids: Vec<String>) {
        if fids.is_empty() {
            return;
        }
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Err(e) = store.delete_chunks(&fids).await {
                tracing::warn!(count = fids.len(), error = %e,
                    "orphaned chunks not deleted (volume.fsck finds them)");
            }
        });
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

    pub async fn release(&self, fh: u64, ino: u64) -> Result<()> {
        self.verifier.released(fh);
        let h = self.handles.lock().remove(&fh);
        let file = match h {
            Some(h) => Some(h.file.clone()),
            None => self.open_file(ino),
        };
        let Some(of) = file else { return Ok(()) };
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
        let r = self.flush_file(&of).await;
        if last {
            let orphans = {
                let files = self.files.lock();
                let still_last = files
                    .get(&ino)
                    .is_some_and(|o| o.handles == 0 && Arc::ptr_eq(&o.file, &of));
                let mut s = of.state.lock();
                if still_last && s.unlinked {
                    s.take_orphans()
                } else {
                    Vec::new()
                }
            };
            self.delete_orphans(orphans);
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
            let mut files = self.files.lock();
            if files.get(&ino).map(|o| o.handles == 0).unwrap_or(false) {
                files.remove(&ino);
                self.verifier.closed(ino);
            }
        }
        r
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
        first_err.map_or(Ok(()), Err)
    }

    // ---------- directories ----------

    /// Checks that `ino` is a directory; the listing is taken when it is read from its start.
    pub async fn opendir(&self, ino: u64) -> Result<u64> {
        let dir = self.path_of(ino)?;
        if ino != ROOT_INO {
            let (pd, pn) = split(&dir);
            if !self.entry_at(&pd, &pn).await?.is_directory {
                return Err(errno(libc::ENOTDIR, format!("{dir} is not a directory")));
            }
        }
        // no listing yet: the first read takes it, from whatever offset (the kernel may
        // answer offset 0 from its own cache and ask us from further on)
        Ok(self.next_fh.fetch_add(1, Ordering::Relaxed))
    }

    /// The directory's entries as of now, with "." and "..".
    async fn dir_snapshot(&self, ino: u64) -> Result<DirListing> {
        // read first: a name an event takes away from here on is caught by `gone_since`
        let names_gone = self.names_gone.load(Ordering::SeqCst);
        let dir = self.path_of(ino)?;
        let cached = if self.load_dir(&dir).await? {
            self.meta.listing(&dir)
        } else {
            None
        };
        let entries = match cached {
            Some(l) => l,
            None => self.list_uncached(&dir).await?,
        };
        let parent_ino = if ino == ROOT_INO {
            ROOT_INO
        } else {
            self.inodes.ino_of(&split(&dir).0).unwrap_or(ROOT_INO)
        };
        let mut out = Vec::with_capacity(entries.len() + 2);
        out.push(DirEntryOut {
            name: ".".into(),
            ino,
            kind: Kind::Dir,
            attr: None,
        });
        out.push(DirEntryOut {
            name: "..".into(),
            ino: parent_ino,
            kind: Kind::Dir,
            attr: None,
        });
        for e in entries {
            let path = join(&dir, &e.name);
            let eino = entry_inode(&path, &e);
            let a = self.attr_of(eino, &path, &e);
            out.push(DirEntryOut {
                name: e.name.clone(),
                ino: eino,
                kind: a.kind,
                attr: Some(a),
            });
        }
        Ok(DirListing {
            entries: out,
            names_gone,
        })
    }

    /// Entries from `offset` on. The first read of a handle, and every read from offset 0
    /// (a rewinddir), takes the listing: POSIX wants names created since opendir listed
    /// after a rewind (xfstests generic/471), and the kernel asks from 0 again once the
    /// directory changed. Later offsets read that same listing, so a listing in pages stays
    /// consistent. With `plus`, each returned entry counts as a lookup.
    pub async fn readdir(&self, ino: u64, fh: u64, offset: u64) -> Result<Arc<DirListing>> {
        if offset != 0 {
            if let Some(l) = self.dir_handles.lock().get(&fh).cloned() {
                return Ok(l);
            }
            // not read yet here (the kernel served offset 0 from its cache), or a handle
            // from a previous process (takeover)
        }
        let l = Arc::new(self.dir_snapshot(ino).await?);
        self.dir_handles.lock().insert(fh, l.clone());
        Ok(l)
    }

    /// Attributes of a listed entry as of now. The listing is a snapshot from opendir; sending
    /// its attributes later would overwrite the kernel's newer view (a file written since would
    /// appear truncated), so open files and cached entries win over the snapshot.
    pub fn current_dir_attr(&self, dir_ino: u64, e: &DirEntryOut) -> Option<Attr> {
        let snap = e.attr.as_ref()?;
        let dir = self.inodes.path(dir_ino)?;
        let path = join(&dir, &e.name);
        if let Some(of) = self.open_file(e.ino) {
            // from this handle, not looked up again: it may be closed meanwhile
            let s = of.state.lock();
            let mut a = entry_attr(e.ino, &s.entry, &self.cfg.ids);
            a.size = s.size;
            return Some(a);
        }
        match self.meta.lookup(&dir, &e.name) {
            Cached::Found(cur) if entry_inode(&path, &cur) == e.ino => {
                Some(self.attr_of(e.ino, &path, &cur))
            }
            _ => Some(snap.clone()),
        }
    }

    /// Of the entries `range` of `listing` (a snapshot of directory `dir_ino` that
    /// readdirplus handed the kernel), the names an event may have taken away since the
    /// snapshot was taken. The kernel keeps a readdirplus entry as a positive dentry for the
    /// entry TTL, and a removal event's invalidation can reach the kernel before that reply
    /// does: such a name would stay visible after it is gone. Costs nothing unless a name went
    /// away somewhere while the listing was read; then each sent name is checked (a lookup
    /// where the directory's listing is not cached).
    pub async fn gone_since(
        &self,
        dir_ino: u64,
        listing: &DirListing,
        range: std::ops::Range<usize>,
    ) -> Vec<String> {
        if self.names_gone.load(Ordering::SeqCst) == listing.names_gone {
            return Vec::new();
        }
        let Some(dir) = self.inodes.path(dir_ino) else {
            return Vec::new();
        };
        let mut gone = Vec::new();
        for e in listing.entries.get(range).unwrap_or_default() {
            if e.name == "." || e.name == ".." {
                continue;
            }
            let path = join(&dir, &e.name);
            let current = match self.meta.lookup(&dir, &e.name) {
                Cached::Found(cur) => entry_inode(&path, &cur) == e.ino,
                Cached::Absent => false,
                Cached::Unknown => match self.entry_at(&dir, &e.name).await {
                    Ok(cur) => entry_inode(&path, &cur) == e.ino,
                    // not sure: leave the kernel's entry (an open of it is ESTALE if stale)
                    Err(err) => err.errno != libc::ENOENT,
                },
            };
            if !current {
                gone.push(e.name.clone());
            }
        }
        gone
    }

    /// Invalidates, in the background, the kernel's entries for the names of `range` that
    /// [`Self::gone_since`] finds gone. Called once the readdirplus reply is out: the kernel
    /// takes the directory's lock for an invalidation, which the listing may still hold.
    pub fn take_back_gone(
        self: &Arc<Self>,
        dir_ino: u64,
        listing: Arc<DirListing>,
        range: std::ops::Range<usize>,
    ) {
        if self.names_gone.load(Ordering::SeqCst) == listing.names_gone {
            return;
        }
        let (Some(nt), Ok(rt)) = (
            self.notifier.read().clone(),
            tokio::runtime::Handle::try_current(),
        ) else {
            return;
        };
        let fs = self.clone();
        rt.spawn(async move {
            let gone = fs.gone_since(dir_ino, &listing, range).await;
            if gone.is_empty() {
                return;
            }
            tracing::debug!(dir_ino, ?gone, "names listed while an event took them away");
            let _ = tokio::task::spawn_blocking(move || {
                for name in &gone {
                    nt.inval_entry(dir_ino, name);
                }
            })
            .await;
        });
    }

    /// An event took a name away (see [`Self::gone_since`]).
    pub(super) fn note_name_gone(&self) {
        self.names_gone.fetch_add(1, Ordering::SeqCst);
    }

    /// readdirplus registers the names it returns, as lookup would.
    pub fn remember_dir_entry(&self, dir_ino: u64, e: &DirEntryOut) {
        if let Some(dir) = self.inodes.path(dir_ino) {
            let path = join(&dir, &e.name);
            // a file with several links keeps its other names; a name an event took away
            // since the snapshot (renamed, deleted) must not become the node's path again
            let linked = e
                .attr
                .as_ref()
                .is_some_and(|a| a.kind != Kind::Dir && a.nlink > 1);
            let stale = match self.meta.lookup(&dir, &e.name) {
                Cached::Found(cur) => entry_inode(&path, &cur) != e.ino,
                Cached::Absent => true,
                Cached::Unknown => false,
            };
            self.inodes
                .remember_as(e.ino, &path, e.kind, true, linked || stale);
        }
    }

    pub fn releasedir(&self, fh: u64) {
        self.dir_handles.lock().remove(&fh);
    }

    // ---------- statfs / quota ----------

    /// Re-reads the volume's used bytes (quota accounting).
    pub async fn refresh_usage(&self) {
        if let Ok(st) = self
            .filer
            .statistics(pb::StatisticsRequest {
                collection: self.cfg.collection.clone(),
                replication: self.cfg.replication.clone(),
                disk_type: self.cfg.disk_type.clone(),
                ttl: String::new(),
            })
            .await
        {
            self.used_bytes.store(st.used_size, Ordering::Relaxed);
        }
    }

    pub async fn statfs(&self) -> Result<StatFs> {
        if let Some((at, s)) = *self.statfs_cache.lock() {
            if at.elapsed() < Duration::from_secs(5) {
                return Ok(s);
            }
        }
        let st = self
            .filer
            .statistics(pb::StatisticsRequest {
                collection: self.cfg.collection.clone(),
                replication: self.cfg.replication.clone(),
                disk_type: self.cfg.disk_type.clone(),
                ttl: String::new(),
            })
            .await?;
        self.used_bytes.store(st.used_size, Ordering::Relaxed);
        let quota = self.quota();
        let mut total = st.total_size;
        if quota > 0 {
            total = if total == 0 { quota } else { total.min(quota) };
        }
        let used = st.used_size.min(total);
        let bsize = 4096u64;
        let files = u32::MAX as u64;
        let s = StatFs {
            blocks: total / bsize,
            bfree: (total - used) / bsize,
            bavail: (total - used) / bsize,
            files,
            ffree: files.saturating_sub(st.file_count),
            bsize: bsize as u32,
            namelen: 255,
            frsize: bsize as u32,
        };
        *self.statfs_cache.lock() = Some((Instant::now(), s));
        Ok(s)
    }

    // ---------- xattrs ----------

    /// Runs `f` on the xattrs (the entry's `extended` map) of `ino`, without copying the
    /// entry: the kernel asks for `security.capability` on every write, and an open file's
    /// entry holds its whole chunk list (a copy per write grew with the file's size).
    async fn with_xattrs<R>(
        &self,
        ino: u64,
        f: impl FnOnce(&std::collections::HashMap<String, Vec<u8>>) -> R,
    ) -> Result<R> {
        let path = self.path_of(ino)?;
        if let Some(of) = self.open_file(ino) {
            return Ok(f(&of.state.lock().entry.extended));
        }
        if ino == ROOT_INO {
            let (d, n) = split(&self.cfg.root);
            if self.cfg.root == "/" {
                return Err(errno(libc::ENOTSUP, "no xattrs on the filer root"));
            }
            return Ok(f(&self.entry_at(&d, &n).await?.extended));
        }
        let (d, n) = split(&path);
        Ok(f(&self.entry_at(&d, &n).await?.extended))
    }

    pub async fn getxattr(&self, ino: u64, name: &str) -> Result<Vec<u8>> {
        if ino == ROOT_INO && self.cfg.root == "/" && self.posix_acl() && is_acl_name(name) {
            // the kernel takes any other error as a failed permission check
            return Err(errno(libc::ENODATA, "no ACL on the filer root"));
        }
        let key = format!("{XATTR_PREFIX}{name}");
        match self.with_xattrs(ino, |x| x.get(&key).cloned()).await? {
            Some(v) => Ok(v),
            None if name == SELINUX_XATTR && self.cfg.selinux_label_unsupported => Err(errno(
                libc::EOPNOTSUPP,
                "no SELinux label (SELinux is off on this node)",
            )),
            None => Err(errno(libc::ENODATA, format!("no xattr {name}"))),
        }
    }

    pub async fn listxattr(&self, ino: u64) -> Result<Vec<String>> {
        let mut v: Vec<String> = self
            .with_xattrs(ino, |x| {
                x.keys()
                    .filter_map(|k| k.strip_prefix(XATTR_PREFIX).map(str::to_string))
                    .collect()
            })
            .await?;
        v.sort();
        Ok(v)
    }

    pub async fn setxattr(&self, ino: u64, name: &str, value: &[u8], flags: i32) -> Result<()> {
        self.check_writable()?;
        if name.len() > 255 {
            return Err(errno(libc::ERANGE, "xattr name too long"));
        }
        if value.len() > 65536 {
            return Err(errno(libc::E2BIG, "xattr value too large"));
        }
        if self.posix_acl() && is_acl_name(name) {
            return self.set_acl(ino, name, value, flags).await;
        }
        self.change_xattrs(ino, |ext| {
            let key = format!("{XATTR_PREFIX}{name}");
            let exists = ext.contains_key(&key);
            if flags & libc::XATTR_CREATE != 0 && exists {
                return Err(errno(libc::EEXIST, "xattr exists"));
            }
            if flags & libc::XATTR_REPLACE != 0 && !exists {
                return Err(errno(libc::ENODATA, "no such xattr"));
            }
            ext.insert(key, value.to_vec());
            Ok(())
        })
        .await
    }

    /// setxattr of an ACL the kernel enforces: validated; an access ACL also sets the mode's
    /// permission bits and is not stored when the mode says it all.
    async fn set_acl(&self, ino: u64, name: &str, value: &[u8], flags: i32) -> Result<()> {
        let parsed = Acl::parse(value).map_err(|e| errno(e.errno(), format!("{name}: {e}")))?;
        let key = xattr_key(name);
        self.change_entry(ino, |e| {
            let exists = e.extended.contains_key(&key);
            if flags & libc::XATTR_CREATE != 0 && exists {
                return Err(errno(libc::EEXIST, "xattr exists"));
            }
            if flags & libc::XATTR_REPLACE != 0 && !exists {
                return Err(errno(libc::ENODATA, "no such xattr"));
            }
            if name == acl::DEFAULT {
                if !e.is_directory {
                    // as ext4 and the VFS answer for non-directories
                    return Err(errno(libc::EACCES, "default ACL on a non-directory"));
                }
                if parsed.is_empty() {
                    e.extended.remove(&key);
                } else {
                    e.extended.insert(key.clone(), value.to_vec());
                }
                return Ok(());
            }
            if parsed.is_empty() {
                e.extended.remove(&key);
                return Ok(());
            }
            let a = e.attributes.get_or_insert_with(Default::default);
            let (kind, perm) = attr::from_go_mode(a.file_mode);
            let kind = if e.is_directory { Kind::Dir } else { kind };
            a.file_mode = to_go_mode(kind, (u32::from(perm) & !0o777) | parsed.mode_bits());
            if parsed.is_equivalent_to_mode() {
                e.extended.remove(&key);
            } else {
                e.extended.insert(key.clone(), value.to_vec());
            }
            Ok(())
        })
        .await
    }

    pub async fn removexattr(&self, ino: u64, name: &str) -> Result<()> {
        self.check_writable()?;
        self.change_xattrs(ino, |ext| {
            ext.remove(&format!("{XATTR_PREFIX}{name}"))
                .map(|_| ())
                .ok_or_else(|| errno(libc::ENODATA, "no such xattr"))
        })
        .await
    }

    async fn change_xattrs(
        &self,
        ino: u64,
        f: impl Fn(&mut std::collections::HashMap<String, Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        self.change_entry(ino, |e| f(&mut e.extended)).await
    }

    /// Applies `f` to the entry (xattrs, or the mode along with an ACL) and commits it.
    async fn change_entry(&self, ino: u64, f: impl Fn(&mut pb::Entry) -> Result<()>) -> Result<()> {
        let open = self.open_file(ino);
        // this node's own commits of the file stay out of the lookup→update below
        let commit_lock = match &open {
            Some(of) => Some(of.commit.lock().await),
            None => None,
        };
        if let Some(of) = &open {
            let local = {
                let mut s = of.state.lock();
                let local = !s.is_clean() || s.unlinked;
                if local {
                    // our own entry goes to the filer anyway: the change rides that commit
                    f(&mut s.entry)?;
                    let a = s.entry.attributes.get_or_insert_with(Default::default);
                    (a.ctime, a.ctime_ns) = now_parts();
                    s.touch();
                }
                local
            };
            if local {
                drop(commit_lock);
                return self.flush_file(of).await;
            }
        }
        let (dir, name) = if ino == ROOT_INO {
            if self.cfg.root == "/" {
                return Err(errno(libc::ENOTSUP, "no xattrs on the filer root"));
            }
            split(&self.cfg.root)
        } else {
            split(&self.path_of(ino)?)
        };
        let e = self
            .update_fresh(&dir, &name, |e| {
                f(e)?;
                let a = e.attributes.get_or_insert_with(Default::default);
                (a.ctime, a.ctime_ns) = now_parts();
                Ok(())
            })
            .await?;
        if let Some(of) = &open {
            self.adopt_if_clean(ino, of, e).await;
        }
        drop(commit_lock);
        if ino == ROOT_INO {
            let _ = self.init_root().await;
        }
        Ok(())
    }

    // ---------- misc ----------

    /// fallocate(2): mode 0 (and KEEP_SIZE) is honoured by reserving the size; SeaweedFS has no
    /// preallocation, so punching holes and other modes are not supported.
    pub async fn fallocate(
        &self,
        fh: u64,
        ino: u64,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> Result<()> {
        self.check_writable()?;
        if mode & !libc::FALLOC_FL_KEEP_SIZE != 0 {
            return Err(errno(libc::EOPNOTSUPP, "fallocate mode not supported"));
        }
        let h = self.handle(fh, ino).await?;
        self.verifier.check(fh)?;
        let end = offset
            .checked_add(length)
            .ok_or_else(|| errno(libc::EFBIG, "too large"))?;
        let of = h.file.clone();
        let grow = mode & libc::FALLOC_FL_KEEP_SIZE == 0 && end > of.state.lock().size;
        if grow {
            of.grow_to(end);
        }
        {
            // a successful fallocate changes ctime (and mtime when the size grew)
            let mut s = of.state.lock();
            let now = now_parts();
            let a = s.entry.attributes.get_or_insert_with(Default::default);
            (a.ctime, a.ctime_ns) = now;
            if grow {
                (a.mtime, a.mtime_ns) = now;
            }
            s.touch();
        }
        self.flush_file(&of).await
    }

    /// lseek SEEK_DATA / SEEK_HOLE from the ranges chunks and dirty data cover, in whole
    /// [`SEEK_BLOCK`]s (bytes no chunk covers are holes; the end of the file counts as one).
    pub async fn lseek(&self, fh: u64, ino: u64, offset: i64, whence: i32) -> Result<i64> {
        let h = self.handle(fh, ino).await?;
        let size = h.file.state.lock().size;
        if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
            return Err(errno(libc::EINVAL, "unsupported whence"));
        }
        if offset < 0 {
            // as the kernel's own filesystems answer (xfstests' seek_sanity_test)
            return Err(errno(libc::ENXIO, "negative offset"));
        }
        let off = offset as u64;
        if off >= size && (whence == libc::SEEK_DATA || whence == libc::SEEK_HOLE) {
            return Err(errno(libc::ENXIO, "offset at or beyond EOF"));
        }
        // Whole 4 KiB blocks, as block filesystems answer (a hole inside a block reads as
        // zeros and may be reported as data): programs that look for holes (cp, tar,
        // xfstests' seek_sanity_test) find a block size, not 1-byte holes.
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (start, end) in h.file.data_ranges() {
            let (start, end) = (
                start & !(SEEK_BLOCK - 1),
                end.div_ceil(SEEK_BLOCK) * SEEK_BLOCK,
            );
            let end = end.min(size);
            match ranges.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => ranges.push((start, end)),
            }
        }
        match whence {
            libc::SEEK_DATA => ranges
                .iter()
                .find(|(_, end)| *end > off)
                .map(|(start, _)| (*start).max(off) as i64)
                .ok_or_else(|| errno(libc::ENXIO, "no data after offset")),
            libc::SEEK_HOLE => Ok(ranges
                .iter()
                .find(|(start, end)| *start <= off && off < *end)
                .map(|(_, end)| *end)
                .unwrap_or(off) as i64),
            _ => Err(errno(libc::EINVAL, "unsupported whence")),
        }
    }

    pub fn access_ok(&self, _ino: u64) -> Result<()> {
        Ok(())
    }
}

/// Reports an upload's result to its file exactly once; a task that ends without one (a
/// panic) reports a failure, so fsync, close and truncate do not wait for it forever.
struct UploadDone(Option<(Arc<OpenFile>, u64)>);

impl UploadDone {
    fn finish(mut self, r: std::result::Result<pb::FileChunk, String>) {
        if let Some((of, id)) = self.0.take() {
            of.upload_done(id, r);
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

fn xattr_key(name: &str) -> String {
    format!("{XATTR_PREFIX}{name}")
}

fn is_acl_name(name: &str) -> bool {
    name == acl::ACCESS || name == acl::DEFAULT
}

/// chmod of an entry with an access ACL: the ACL follows the new mode (named entries stay).
fn chmod_access_acl(e: &mut pb::Entry, mode: u32) {
    let key = xattr_key(acl::ACCESS);
    let Some(raw) = e.extended.get_mut(&key) else {
        return;
    };
    match Acl::parse(raw) {
        Ok(mut a) if !a.is_empty() => {
            a.chmod(mode);
            *raw = a.to_bytes();
        }
        Ok(_) => {}
        Err(err) => {
            tracing::warn!(name = %e.name, error = %err, "chmod: stored access ACL is malformed; left as is")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;

    #[tokio::test]
    async fn readdirplus_attrs_are_current_not_from_the_opendir_snapshot() {
        let fs = Fs::new(
            FsConfig::from_mount_options(&MountOptions::default()),
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.write(fh, a.ino, 0, b"12345").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();

        let dh = fs.opendir(ROOT_INO).await.unwrap();
        let list = fs.readdir(ROOT_INO, dh, 0).await.unwrap();
        let e = list.entries.iter().find(|e| e.name == "f").unwrap();
        assert_eq!(e.attr.as_ref().unwrap().size, 5);

        // Written after the snapshot: open, then closed again.
        let fh = fs.open(a.ino, libc::O_WRONLY).await.unwrap();
        fs.write(fh, a.ino, 5, b"67890").await.unwrap();
        assert_eq!(fs.current_dir_attr(ROOT_INO, e).unwrap().size, 10);
        fs.release(fh, a.ino).await.unwrap();
        assert_eq!(fs.current_dir_attr(ROOT_INO, e).unwrap().size, 10);
        // "." and ".." carry no attributes.
        assert!(fs.current_dir_attr(ROOT_INO, &list.entries[0]).is_none());
    }

    /// POSIX: after rewinddir, names added since opendir are listed (xfstests generic/471).
    #[tokio::test]
    async fn rewinddir_lists_names_created_since_opendir() {
        let fs = Fs::new(
            FsConfig::from_mount_options(&MountOptions::default()),
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        let names = |l: &DirListing| l.entries.iter().map(|e| e.name.clone()).collect::<Vec<_>>();
        let dh = fs.opendir(ROOT_INO).await.unwrap();
        assert_eq!(
            names(&fs.readdir(ROOT_INO, dh, 0).await.unwrap()),
            [".", ".."]
        );
        // opened before the create, first read after it (glibc's opendir reads nothing)
        let unread = fs.opendir(ROOT_INO).await.unwrap();
        let (a, fh) = fs
            .create(ROOT_INO, "new", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.release(fh, a.ino).await.unwrap();
        assert_eq!(
            names(&fs.readdir(ROOT_INO, unread, 0).await.unwrap()),
            [".", "..", "new"]
        );
        fs.releasedir(unread);
        // reading on from where it was: the snapshot
        assert_eq!(fs.readdir(ROOT_INO, dh, 2).await.unwrap().entries.len(), 2);
        // a handle first read past offset 0 (the kernel's cache answered 0): a real listing
        let cached = fs.opendir(ROOT_INO).await.unwrap();
        assert_eq!(
            fs.readdir(ROOT_INO, cached, 2).await.unwrap().entries.len(),
            3
        );
        fs.releasedir(cached);
        // from the start again: a fresh one
        assert_eq!(
            names(&fs.readdir(ROOT_INO, dh, 0).await.unwrap()),
            [".", "..", "new"]
        );
        fs.releasedir(dh);
    }
}

#[cfg(test)]
mod acl_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::acl::{AclEntry, GROUP_OBJ, MASK, OTHER, UNDEFINED_ID, USER, USER_OBJ};
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;

    fn fs(posix_acl: bool) -> Arc<Fs> {
        let o = MountOptions {
            filer_path: "/vol".into(),
            ..Default::default()
        };
        let fs = Fs::new(
            FsConfig::from_mount_options(&o),
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        fs.set_posix_acl(posix_acl);
        fs
    }

    fn acl(entries: &[(u16, u16, u32)]) -> Acl {
        Acl {
            entries: entries
                .iter()
                .map(|&(tag, perm, id)| AclEntry { tag, perm, id })
                .collect(),
        }
    }

    fn named_reader(mask: u16) -> Acl {
        acl(&[
            (USER_OBJ, 6, UNDEFINED_ID),
            (USER, 4, 65534),
            (GROUP_OBJ, 0, UNDEFINED_ID),
            (MASK, mask, UNDEFINED_ID),
            (OTHER, 0, UNDEFINED_ID),
        ])
    }

    async fn file(fs: &Fs, name: &str, mode: u32) -> u64 {
        let a = fs
            .mknod(ROOT_INO, name, libc::S_IFREG | mode, 0, 0, 0, 0)
            .await
            .unwrap();
        a.ino
    }

    #[tokio::test]
    async fn access_acl_sets_the_mode_and_chmod_rewrites_it() {
        let fs = fs(true);
        fs.init_root().await.unwrap();
        let ino = file(&fs, "f", 0o4600).await;
        let v = named_reader(4).to_bytes();
        fs.setxattr(ino, acl::ACCESS, &v, 0).await.unwrap();
        let a = fs.getattr(ino).await.unwrap();
        assert_eq!(a.perm, 0o4640, "group bits = mask, setuid kept");
        assert_eq!(fs.getxattr(ino, acl::ACCESS).await.unwrap(), v);

        fs.setattr(
            ino,
            SetAttr {
                mode: Some(0o751),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let back = Acl::parse(&fs.getxattr(ino, acl::ACCESS).await.unwrap()).unwrap();
        assert_eq!(back.mode_bits(), 0o751);
        assert_eq!(back.entries[1].perm, 4, "named entry kept");

        // malformed: EINVAL, nothing changed
        let err = fs.setxattr(ino, acl::ACCESS, &v[..7], 0).await;
        assert_eq!(err.unwrap_err().errno, libc::EINVAL);
        assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o751);

        // an equivalent ACL: mode only, the stored one goes away
        let base = acl(&[(USER_OBJ, 6, 0), (GROUP_OBJ, 4, 0), (OTHER, 0, 0)]);
        fs.setxattr(ino, acl::ACCESS, &base.to_bytes(), 0)
            .await
            .unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o640);
        let gone = fs.getxattr(ino, acl::ACCESS).await.unwrap_err();
        assert_eq!(gone.errno, libc::ENODATA);
    }

    #[tokio::test]
    async fn default_acl_only_on_directories_and_inherited() {
        let fs = fs(true);
        fs.init_root().await.unwrap();
        let f = file(&fs, "f", 0o644).await;
        let d = acl(&[
            (USER_OBJ, 7, UNDEFINED_ID),
            (USER, 7, 65534),
            (GROUP_OBJ, 5, UNDEFINED_ID),
            (MASK, 7, UNDEFINED_ID),
            (OTHER, 0, UNDEFINED_ID),
        ]);
        let err = fs.setxattr(f, acl::DEFAULT, &d.to_bytes(), 0).await;
        assert_eq!(err.unwrap_err().errno, libc::EACCES);

        let dir = fs.mkdir(ROOT_INO, "d", 0o755, 0o022, 0, 0).await.unwrap();
        assert_eq!(dir.perm, 0o755);
        fs.setxattr(dir.ino, acl::DEFAULT, &d.to_bytes(), 0)
            .await
            .unwrap();
        // umask 077 is ignored under a default ACL
        let (child, fh) = fs
            .create(dir.ino, "c", 0o666, 0o077, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.release(fh, child.ino).await.unwrap();
        assert_eq!(child.perm, 0o660);
        let ca = Acl::parse(&fs.getxattr(child.ino, acl::ACCESS).await.unwrap()).unwrap();
        assert_eq!(ca.mode_bits(), 0o660);
        assert_eq!(
            ca.entries[1],
            AclEntry {
                tag: USER,
                perm: 7,
                id: 65534
            }
        );
        assert!(fs.getxattr(child.ino, acl::DEFAULT).await.is_err());

        let sub = fs.mkdir(dir.ino, "s", 0o777, 0o077, 0, 0).await.unwrap();
        assert_eq!(sub.perm, 0o770);
        assert_eq!(
            fs.getxattr(sub.ino, acl::DEFAULT).await.unwrap(),
            d.to_bytes()
        );
        assert!(fs.getxattr(sub.ino, acl::ACCESS).await.is_ok());
        // symlinks get nothing
        let l = fs.symlink(dir.ino, "l", "x", 0, 0).await.unwrap();
        assert_eq!(l.perm, 0o777);
    }

    #[tokio::test]
    async fn filer_root_reports_no_acl_rather_than_an_error() {
        for (on, want) in [(true, libc::ENODATA), (false, libc::ENOTSUP)] {
            let fs = Fs::new(
                FsConfig::from_mount_options(&MountOptions::default()),
                Arc::new(MockFiler::new()),
                Arc::new(MockChunkStore::new()),
                ChunkCache::new(1 << 20),
            );
            fs.set_posix_acl(on);
            // the kernel turns any error but ENODATA into a failed permission check
            let e = fs.getxattr(ROOT_INO, acl::ACCESS).await.unwrap_err();
            assert_eq!(e.errno, want);
        }
    }

    #[tokio::test]
    async fn without_negotiated_acls_xattrs_are_plain_and_umask_applies() {
        let fs = fs(false);
        fs.init_root().await.unwrap();
        let ino = file(&fs, "f", 0o600).await;
        let v = named_reader(4).to_bytes();
        fs.setxattr(ino, acl::ACCESS, &v, 0).await.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o600, "mode untouched");
        // not validated either (as before)
        fs.setxattr(ino, acl::ACCESS, b"junk", 0).await.unwrap();
        let d = fs.mkdir(ROOT_INO, "d", 0o777, 0o022, 0, 0).await.unwrap();
        assert_eq!(d.perm, 0o755);
        let n = fs
            .mknod(ROOT_INO, "p", libc::S_IFIFO | 0o666, 0o027, 0, 0, 0)
            .await
            .unwrap();
        assert_eq!((n.kind, n.perm), (Kind::Fifo, 0o640));
    }
}

#[cfg(test)]
mod xattr_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;

    async fn fs_with(selinux_label_unsupported: bool) -> (Arc<Fs>, u64) {
        let mut cfg = FsConfig::from_mount_options(&MountOptions::default());
        cfg.selinux_label_unsupported = selinux_label_unsupported;
        let fs = Fs::new(
            cfg,
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        fs.init_root().await.unwrap();
        let d = fs.mkdir(ROOT_INO, "d", 0o755, 0, 0, 0).await.unwrap();
        (fs, d.ino)
    }

    #[tokio::test]
    async fn absent_selinux_label_is_unsupported_only_when_selinux_is_off() {
        let (fs, ino) = fs_with(true).await;
        let e = fs.getxattr(ino, SELINUX_XATTR).await.unwrap_err();
        assert_eq!(e.errno, libc::EOPNOTSUPP);
        // other names keep ENODATA, and a label that is set is returned
        let e = fs.getxattr(ino, "security.other").await.unwrap_err();
        assert_eq!(e.errno, libc::ENODATA);
        let label = b"system_u:object_r:container_file_t:s0\0";
        fs.setxattr(ino, SELINUX_XATTR, label, 0).await.unwrap();
        assert_eq!(fs.getxattr(ino, SELINUX_XATTR).await.unwrap(), label);

        let (fs, ino) = fs_with(false).await;
        let e = fs.getxattr(ino, SELINUX_XATTR).await.unwrap_err();
        assert_eq!(e.errno, libc::ENODATA);
    }
}

#[cfg(test)]
mod integrity_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::filer::FilerApi;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;

    const MIB: usize = 1 << 20;

    fn fs_and_store(upload_retry: Duration) -> (Arc<Fs>, Arc<MockChunkStore>, Arc<MockFiler>) {
        let mut cfg = FsConfig::from_mount_options(&MountOptions {
            chunk_size_limit_mb: 1,
            ..Default::default()
        });
        cfg.upload_retry = upload_retry;
        let store = Arc::new(MockChunkStore::new());
        let filer = Arc::new(MockFiler::new());
        let fs = Fs::new(cfg, filer.clone(), store.clone(), ChunkCache::new(1 << 20));
        (fs, store, filer)
    }

    /// Creates "/f" in the root, open with `flags`.
    async fn create_f(fs: &Fs, flags: i32) -> (Attr, u64) {
        fs.create(ROOT_INO, "f", 0o644, 0, flags, 0, 0)
            .await
            .unwrap()
    }

    /// Background deletes have run (they are spawned after the commit).
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn referenced(filer: &MockFiler, path: &str) -> usize {
        filer.get(path).map(|e| e.chunks.len()).unwrap_or(0)
    }

    #[tokio::test]
    async fn an_older_event_does_not_bring_back_a_name_we_renamed() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_WRONLY).await;
        fs.write(fh, a.ino, 0, b"old").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        fs.readdir(ROOT_INO, 0, 0).await.ok();
        // another node rewrote f just before our rename; its event arrives after it
        let before = filer.get("/f").unwrap();
        fs.rename(ROOT_INO, "f", ROOT_INO, "g", 0).await.unwrap();
        let mut theirs = before.clone();
        theirs.content = b"new".to_vec();
        fs.apply_event(&pb::SubscribeMetadataResponse {
            directory: "/".into(),
            event_notification: Some(pb::EventNotification {
                old_entry: Some(before),
                new_entry: Some(theirs),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert_eq!(
            fs.lookup(ROOT_INO, "f").await.unwrap_err().errno,
            libc::ENOENT,
            "the old event must not bring f back"
        );
        assert!(fs.lookup(ROOT_INO, "g").await.is_ok());
        // a name we did not touch is applied as the event says
        let mut other = filer.get("/g").unwrap();
        other.name = "h".into();
        fs.apply_event(&pb::SubscribeMetadataResponse {
            directory: "/".into(),
            event_notification: Some(pb::EventNotification {
                new_entry: Some(other),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(fs.lookup(ROOT_INO, "h").await.is_ok());
    }

    #[tokio::test]
    async fn an_older_event_about_the_old_name_leaves_a_renamed_open_file_alone() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        let before = filer.get("/f").unwrap();
        fs.rename(ROOT_INO, "f", ROOT_INO, "g", 0).await.unwrap();
        let mut theirs = before.clone();
        theirs.content = b"old!".to_vec();
        fs.apply_event(&pb::SubscribeMetadataResponse {
            directory: "/".into(),
            event_notification: Some(pb::EventNotification {
                old_entry: Some(before),
                new_entry: Some(theirs),
                ..Default::default()
            }),
            ..Default::default()
        });
        // the open file is g now: an entry named f is not its entry
        let of = fs.handle(fh, a.ino).await.unwrap().file.clone();
        assert_eq!(of.state.lock().entry.name, "g");
        assert_eq!(&fs.read(fh, a.ino, 0, 16).await.unwrap()[..], b"ours");
        fs.release(fh, a.ino).await.unwrap();
        assert!(filer.get("/f").is_none(), "the rename is not undone");
        assert_eq!(crate::chunks::file_size(&filer.get("/g").unwrap()), 4);
    }

    #[tokio::test]
    async fn an_older_rename_onto_our_new_file_keeps_its_data() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        // another client's rename t -> f, done at the filer before our create
        let t = pb::Entry {
            name: "t".into(),
            attributes: Some(pb::FuseAttributes {
                inode: 777,
                ..Default::default()
            }),
            ..Default::default()
        };
        fs.apply_event(&pb::SubscribeMetadataResponse {
            directory: "/".into(),
            event_notification: Some(pb::EventNotification {
                old_entry: Some(t.clone()),
                new_entry: Some(entry_with_name(&t, "f")),
                ..Default::default()
            }),
            ..Default::default()
        });
        fs.release(fh, a.ino).await.unwrap();
        let e = filer.get("/f").expect("our file must be committed");
        assert_eq!(crate::chunks::file_size(&e), 4);
    }

    fn event(old: Option<pb::Entry>, new: Option<pb::Entry>) -> pb::SubscribeMetadataResponse {
        pb::SubscribeMetadataResponse {
            directory: "/".into(),
            event_notification: Some(pb::EventNotification {
                old_entry: old,
                new_entry: new,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Deletes "/f" as another client would, and applies its event here.
    async fn delete_f_elsewhere(fs: &Arc<Fs>, filer: &MockFiler) {
        let e = filer.get("/f").unwrap();
        filer
            .other_client()
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: "f".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        fs.apply_event(&event(Some(e), None));
    }

    #[tokio::test]
    async fn a_listing_read_across_a_delete_event_takes_the_name_back() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_WRONLY).await;
        fs.release(fh, a.ino).await.unwrap();
        let quiet = fs.opendir(ROOT_INO).await.unwrap();
        let quiet = fs.readdir(ROOT_INO, quiet, 0).await.unwrap();
        let all = 0..quiet.entries.len();
        assert!(fs.gone_since(ROOT_INO, &quiet, all).await.is_empty());
        let before = fs.opendir(ROOT_INO).await.unwrap();
        let before = fs.readdir(ROOT_INO, before, 0).await.unwrap();
        assert!(before.entries.iter().any(|e| e.name == "f"));
        delete_f_elsewhere(&fs, &filer).await;
        // the snapshot still has f: handed to the kernel after the event's invalidation, it
        // would stay there as a live name
        assert_eq!(
            fs.gone_since(ROOT_INO, &before, 0..before.entries.len())
                .await,
            vec!["f".to_string()]
        );
        let after = fs.opendir(ROOT_INO).await.unwrap();
        let after = fs.readdir(ROOT_INO, after, 0).await.unwrap();
        assert!(after.entries.iter().all(|e| e.name != "f"));
        let all = 0..after.entries.len();
        assert!(fs.gone_since(ROOT_INO, &after, all).await.is_empty());
    }

    #[tokio::test]
    async fn opening_a_node_whose_name_was_deleted_elsewhere_is_estale() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_WRONLY).await;
        fs.release(fh, a.ino).await.unwrap();
        let listed = DirEntryOut {
            name: "f".into(),
            ino: a.ino,
            kind: Kind::File,
            attr: Some(a.clone()),
        };
        delete_f_elsewhere(&fs, &filer).await;
        // a listing read before the event registers the name again (as readdirplus does)
        fs.remember_dir_entry(ROOT_INO, &listed);
        // the kernel opens the node it still has a name for: ESTALE makes it look the name up
        // again (an O_CREAT open then creates the file), where ENOENT failed the open
        for flags in [libc::O_RDONLY, libc::O_WRONLY | libc::O_TRUNC] {
            let err = fs.open(a.ino, flags).await.unwrap_err();
            assert_eq!(err.errno, libc::ESTALE, "{err}");
        }
        let (b, fh) = create_f(&fs, libc::O_WRONLY).await;
        assert_ne!(b.ino, a.ino);
        fs.release(fh, b.ino).await.unwrap();
        // the name leads to another file now: the old node must not open it
        let err = fs.open(a.ino, libc::O_RDONLY).await.unwrap_err();
        assert_eq!(err.errno, libc::ESTALE, "{err}");
    }

    #[tokio::test]
    async fn an_older_update_does_not_roll_back_an_open_file_we_committed() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours!").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        // another client's write, done at the filer before our commit; its event comes after
        let before = filer.get("/f").unwrap();
        let mut theirs = before.clone();
        theirs.chunks.clear();
        theirs.content = b"old".to_vec();
        theirs.attributes.as_mut().unwrap().file_size = 3;
        fs.apply_event(&event(Some(before), Some(theirs)));
        settle().await;
        assert_eq!(&fs.read(fh, a.ino, 0, 16).await.unwrap()[..], b"ours!");
        assert_eq!(fs.getattr(a.ino).await.unwrap().size, 5);
        fs.release(fh, a.ino).await.unwrap();
    }

    #[tokio::test]
    async fn a_newer_update_reaches_an_open_file_we_committed_lately() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours!").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        // another client writes after our commit: the re-read finds its entry
        let ours = filer.get("/f").unwrap();
        let mut theirs = ours.clone();
        theirs.chunks.clear();
        theirs.content = b"theirs!".to_vec();
        theirs.attributes.as_mut().unwrap().file_size = 7;
        filer
            .other_client()
            .update_entry(pb::UpdateEntryRequest {
                directory: "/".into(),
                entry: Some(theirs.clone()),
                ..Default::default()
            })
            .await
            .unwrap();
        fs.apply_event(&event(Some(ours), Some(theirs)));
        settle().await;
        assert_eq!(&fs.read(fh, a.ino, 0, 16).await.unwrap()[..], b"theirs!");
        fs.release(fh, a.ino).await.unwrap();
    }

    #[tokio::test]
    async fn an_older_delete_does_not_unlink_an_open_file_we_committed() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        // a delete of f at the filer before our commit (which recreated it)
        let gone = filer.get("/f").unwrap();
        fs.apply_event(&event(Some(gone), None));
        settle().await;
        fs.write(fh, a.ino, 4, b" and more").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        let e = filer.get("/f").expect("f is still on the filer");
        assert_eq!(
            crate::chunks::file_size(&e),
            13,
            "our later write is committed"
        );
    }

    #[tokio::test]
    async fn a_real_delete_of_a_name_changed_lately_unlinks_the_open_file() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        let gone = filer.get("/f").unwrap();
        filer
            .other_client()
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: "f".into(),
                is_delete_data: true,
                ..Default::default()
            })
            .await
            .unwrap();
        fs.apply_event(&event(Some(gone), None));
        settle().await;
        let of = fs.handle(fh, a.ino).await.unwrap().file.clone();
        assert!(of.state.lock().unlinked, "the filer says f is gone");
        fs.release(fh, a.ino).await.unwrap();
        assert!(
            filer.get("/f").is_none(),
            "an unlinked file is not committed again"
        );
    }

    #[tokio::test]
    async fn a_file_not_yet_on_the_filer_shows_in_a_directory_too_large_to_cache() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let mut cfg = fs.cfg.clone();
        cfg.max_cached_dir_entries = 2;
        let fs = Fs::new(
            cfg,
            filer.clone(),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        for n in ["a", "b", "c"] {
            filer
                .other_client()
                .create_entry(pb::CreateEntryRequest {
                    directory: "/".into(),
                    entry: Some(pb::Entry {
                        name: n.into(),
                        attributes: Some(pb::FuseAttributes::default()),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        let (a, fh) = create_f(&fs, libc::O_WRONLY).await;
        assert!(filer.get("/f").is_none(), "the create is still deferred");
        assert_eq!(fs.lookup(ROOT_INO, "f").await.unwrap().ino, a.ino);
        let dh = fs.opendir(ROOT_INO).await.unwrap();
        let names: Vec<String> = fs
            .readdir(ROOT_INO, dh, 0)
            .await
            .unwrap()
            .entries
            .iter()
            .map(|e| e.name.clone())
            .collect();
        assert_eq!(names, [".", "..", "a", "b", "c", "f"]);
        let again = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_WRONLY | libc::O_EXCL, 0, 0)
            .await;
        assert_eq!(again.unwrap_err().errno, libc::EEXIST);
        fs.release(fh, a.ino).await.unwrap();
        assert!(filer.get("/f").is_some());
    }

    #[tokio::test]
    async fn a_panicking_upload_fails_fsync_instead_of_hanging_it() {
        let (fs, store, _filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        store.panic_uploads(1);
        fs.write(fh, a.ino, 0, &vec![7u8; MIB]).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(20), fs.flush(fh, a.ino)).await;
        let r = r.expect("fsync must not wait forever for a task that is gone");
        assert_eq!(r.unwrap_err().errno, libc::EIO);
    }

    /// Waits (up to 10 s) until `cond` holds.
    async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
        for _ in 0..200 {
            if cond() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cond()
    }

    #[tokio::test]
    async fn a_real_delete_is_believed_once_the_filer_answers_again() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        let gone = filer.get("/f").unwrap();
        filer
            .other_client()
            .delete_entry(pb::DeleteEntryRequest {
                directory: "/".into(),
                name: "f".into(),
                is_delete_data: true,
                ..Default::default()
            })
            .await
            .unwrap();
        // the filer blinks while the delete's event is checked
        filer.fail_next(2);
        fs.apply_event(&event(Some(gone), None));
        let of = fs.handle(fh, a.ino).await.unwrap().file.clone();
        assert!(
            eventually(|| of.state.lock().unlinked).await,
            "the re-read is retried until the filer answers"
        );
        fs.release(fh, a.ino).await.unwrap();
        assert!(
            filer.get("/f").is_none(),
            "a deleted file is not brought back"
        );
    }

    #[tokio::test]
    async fn many_doubtful_events_on_one_file_share_one_re_read_at_a_time() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        let ours = filer.get("/f").unwrap();
        let before = filer.calls("lookup_entry");
        for _ in 0..500 {
            fs.apply_event(&event(Some(ours.clone()), Some(ours.clone())));
        }
        settle().await;
        let lookups = filer.calls("lookup_entry") - before;
        assert!(lookups <= 3, "{lookups} lookups for 500 events");
        let of = fs.handle(fh, a.ino).await.unwrap().file.clone();
        assert!(!of.state.lock().resync.running, "the re-read ends");
        fs.release(fh, a.ino).await.unwrap();
    }

    #[tokio::test]
    async fn an_older_rename_onto_our_committed_file_keeps_it() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        // another client's rename t -> f, before our commit at the filer
        let t = pb::Entry {
            name: "t".into(),
            attributes: Some(pb::FuseAttributes {
                inode: 777,
                ..Default::default()
            }),
            ..Default::default()
        };
        fs.apply_event(&event(Some(t.clone()), Some(entry_with_name(&t, "f"))));
        settle().await;
        fs.write(fh, a.ino, 4, b" and more").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        let e = filer.get("/f").expect("our file must stay");
        assert_eq!(
            crate::chunks::file_size(&e),
            13,
            "our later write is committed"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_re_read_and_a_listing_do_not_deadlock() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        let ours = filer.get("/f").unwrap();
        // files lock then state locks, over and over, while re-reads take them too
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let lister = {
            let (fs, stop) = (fs.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::black_box(fs.pending_in_dir("/", None));
                }
            })
        };
        let sender = {
            let fs = fs.clone();
            let rt = tokio::runtime::Handle::current();
            std::thread::spawn(move || {
                let _rt = rt.enter();
                for _ in 0..20_000 {
                    fs.apply_event(&event(Some(ours.clone()), Some(ours.clone())));
                }
            })
        };
        let sent = tokio::task::spawn_blocking(move || sender.join().is_ok());
        let sent = tokio::time::timeout(Duration::from_secs(60), sent).await;
        assert!(
            matches!(sent, Ok(Ok(true))),
            "the event thread never finished"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.store(true, Ordering::Relaxed);
        let done = tokio::task::spawn_blocking(move || lister.join().is_ok());
        let joined = tokio::time::timeout(Duration::from_secs(60), done).await;
        assert!(
            matches!(joined, Ok(Ok(true))),
            "the listing thread never finished"
        );
        fs.release(fh, a.ino).await.unwrap();
    }

    #[tokio::test]
    async fn our_changes_stay_marked_after_a_doubtful_delete() {
        let (fs, _store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, b"ours").await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        filer.fail_next(1000); // the re-read waits, the doubt stays
        fs.apply_event(&event(filer.get("/f"), None));
        let of = fs.handle(fh, a.ino).await.unwrap().file.clone();
        let epoch = of.state.lock().epoch;
        {
            // a commit of the file names it: the guard must find it though the path is gone here
            let _g = fs.note_local("/", "f", Some(a.ino));
            assert_eq!(of.state.lock().local_inflight, 1);
        }
        assert!(of.state.lock().epoch > epoch);
        filer.fail_next(0);
        fs.release(fh, a.ino).await.unwrap();
    }

    #[tokio::test]
    async fn runs_overwritten_before_the_commit_are_deleted() {
        let (fs, store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_WRONLY).await;
        // each full chunk is uploaded at once; the second hides the first
        fs.write(fh, a.ino, 0, &vec![1u8; MIB]).await.unwrap();
        fs.write(fh, a.ino, 0, &vec![2u8; MIB]).await.unwrap();
        fs.write(fh, a.ino, MIB as u64, &vec![3u8; MIB])
            .await
            .unwrap();
        fs.release(fh, a.ino).await.unwrap();
        settle().await;
        assert_eq!(referenced(&filer, "/f"), 2);
        assert_eq!(store.len(), 2, "the hidden run's needle must be deleted");
    }

    #[tokio::test]
    async fn runs_truncated_away_before_the_commit_are_deleted() {
        let (fs, store, filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        fs.write(fh, a.ino, 0, &vec![1u8; 3 * MIB]).await.unwrap();
        fs.setattr(
            a.ino,
            SetAttr {
                size: Some(MIB as u64),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        fs.release(fh, a.ino).await.unwrap();
        settle().await;
        assert_eq!(referenced(&filer, "/f"), 1);
        assert_eq!(store.len(), 1, "chunks past the new size must be deleted");
    }

    #[tokio::test]
    async fn a_file_unlinked_before_its_commit_leaves_no_chunks() {
        let (fs, store, _filer) = fs_and_store(Duration::from_secs(1));
        let (a, fh) = create_f(&fs, libc::O_WRONLY).await;
        fs.write(fh, a.ino, 0, &vec![1u8; 3 * MIB]).await.unwrap();
        fs.unlink(ROOT_INO, "f").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        settle().await;
        assert_eq!(
            store.len(),
            0,
            "nothing references the unlinked file's chunks"
        );
    }

    #[tokio::test]
    async fn a_failed_upload_keeps_the_bytes_and_a_later_fsync_places_them() {
        let (fs, store, filer) = fs_and_store(Duration::from_millis(1));
        let (a, fh) = create_f(&fs, libc::O_RDWR).await;
        store.fail_next_uploads(100);
        let data = vec![7u8; MIB + 10];
        fs.write(fh, a.ino, 0, &data).await.unwrap();
        let e = fs.flush(fh, a.ino).await.unwrap_err();
        assert_eq!(e.errno, libc::EIO);
        // no more bytes pile up behind it, but what was acknowledged is still readable
        assert_eq!(
            fs.write(fh, a.ino, 0, b"x").await.unwrap_err().errno,
            libc::EIO
        );
        let of = fs.handle(fh, a.ino).await.unwrap().file.clone();
        assert_eq!(&fs.read_range(&of, 0, 16).await.unwrap()[..], &data[..16]);
        // the cluster is back: the next fsync places everything
        store.fail_next_uploads(0);
        fs.flush(fh, a.ino).await.unwrap();
        fs.write(fh, a.ino, (MIB + 10) as u64, b"more")
            .await
            .unwrap();
        fs.release(fh, a.ino).await.unwrap();
        let e = filer.get("/f").unwrap();
        assert_eq!(crate::chunks::file_size(&e), (MIB + 14) as u64);
        let of = fs.open_inode(a.ino, true).await.unwrap();
        let got = fs.read_range(&of, 0, (MIB + 14) as u64).await.unwrap();
        assert_eq!(&got[..MIB + 10], &data[..]);
        assert_eq!(&got[MIB + 10..], b"more");
    }

    #[tokio::test]
    async fn uploads_retry_through_a_short_outage() {
        let (fs, store, filer) = fs_and_store(Duration::from_secs(30));
        let (a, fh) = create_f(&fs, libc::O_WRONLY).await;
        store.fail_next_uploads(2);
        fs.write(fh, a.ino, 0, &vec![5u8; MIB]).await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        assert_eq!(referenced(&filer, "/f"), 1);
        assert_eq!(store.len(), 1);
    }
}

#[cfg(test)]
mod manifest_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::chunks;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::FsConfig;
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
