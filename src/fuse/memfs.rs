//! `memfs`: a small in-memory FUSE filesystem.
//!
//! Two uses: it proves the takeover machinery end to end (tests/takeover.rs runs it as real
//! processes), and it is the speed ceiling for the cache benchmarks (nothing behind it but a
//! `RwLock`ed map; 1 MiB writes, full readahead, several threads on one shared fd).
//!
//! Its whole state (nodes, the kernel-visible node ids and file handles, and a small reply
//! cache) is serialized into the keeper's blob, on every change (`--persist=every-change`,
//! survives SIGKILL) or only on SIGTERM (`--persist=on-exit`, for benchmarks).
//!
//! Handover discipline worth copying:
//! * every mutation is applied, persisted and *answered* under one write lock, so a snapshot
//!   taken under that lock matches exactly what the kernel has been told;
//! * a resent request (bit 63 of `unique`) whose original is in the reply cache was already
//!   applied by the dead daemon: answer it from the cache instead of applying it twice.
//!
//! Test hooks: machine-readable `memfs-event: ...` lines on stderr (ready, first request,
//! resent requests, held reads) and `--hold-read-name/--hold-ms` to keep a read in flight.
//!
//! Over 800 lines: a whole in-memory FUSE filesystem used as a test double and benchmark
//! ceiling; built only with the `test-support` feature.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, SessionACL,
    TimeOrNow, WriteFlags,
};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use super::takeover::{self, Handover, InitParams, RESEND_UNIQUE_BIT};
use crate::keeper::{KeeperClient, KeeperNotifier};

const ROOT: u64 = 1;
/// Completed mutations remembered for deduplicating resent requests. Only requests in flight
/// at a crash can be resent, so this needs to cover the threads' worth of requests, not more.
const REPLY_CACHE: usize = 256;
const BLKSIZE: u32 = 128 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Kind {
    File,
    Dir,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Node {
    name: String,
    parent: u64,
    kind: Kind,
    perm: u16,
    uid: u32,
    gid: u32,
    mtime_ns: u64,
    ctime_ns: u64,
    /// 0 once unlinked; the node lives on while a handle refers to it.
    nlink: u32,
    /// Travels raw after the JSON part of the blob (see [`encode_blob`]): JSON-encoding
    /// file contents on every change is far too slow.
    #[serde(skip)]
    data: Vec<u8>,
    children: BTreeMap<String, u64>,
}

/// What a completed mutation answered.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum Outcome {
    Ok,
    Err(i32),
    Entry(u64),
    Attr(u64),
    Opened(u64),
    Created { ino: u64, fh: u64 },
    Written(u32),
}

/// Everything a successor needs; serialized into the keeper blob.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemState {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    next_fh: u64,
    /// Open file handles the kernel knows: fh -> ino.
    handles: HashMap<u64, u64>,
    /// (original unique, outcome) of the latest mutations.
    recent: VecDeque<(u64, Outcome)>,
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn ts(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

impl Default for MemState {
    fn default() -> Self {
        let t = now_ns();
        let root = Node {
            name: String::new(),
            parent: ROOT,
            kind: Kind::Dir,
            perm: 0o777,
            uid: 0,
            gid: 0,
            mtime_ns: t,
            ctime_ns: t,
            nlink: 2,
            data: Vec::new(),
            children: BTreeMap::new(),
        };
        Self {
            nodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
            next_fh: 1,
            handles: HashMap::new(),
            recent: VecDeque::new(),
        }
    }
}

type R<T> = Result<T, Errno>;

impl MemState {
    fn node(&self, ino: u64) -> R<&Node> {
        self.nodes.get(&ino).ok_or(Errno::ENOENT)
    }

    fn node_mut(&mut self, ino: u64) -> R<&mut Node> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn dir(&self, ino: u64) -> R<&Node> {
        let n = self.node(ino)?;
        if n.kind != Kind::Dir {
            return Err(Errno::ENOTDIR);
        }
        Ok(n)
    }

    fn child(&self, parent: u64, name: &str) -> R<u64> {
        self.dir(parent)?
            .children
            .get(name)
            .copied()
            .ok_or(Errno::ENOENT)
    }

    fn attr(&self, ino: u64) -> R<FileAttr> {
        let n = self.node(ino)?;
        let size = n.data.len() as u64;
        Ok(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: ts(n.mtime_ns),
            mtime: ts(n.mtime_ns),
            ctime: ts(n.ctime_ns),
            crtime: ts(n.ctime_ns),
            kind: match n.kind {
                Kind::File => FileType::RegularFile,
                Kind::Dir => FileType::Directory,
            },
            perm: n.perm,
            nlink: n.nlink,
            uid: n.uid,
            gid: n.gid,
            rdev: 0,
            blksize: BLKSIZE,
            flags: 0,
        })
    }

    fn new_node(
        &mut self,
        req: &Request,
        parent: u64,
        name: &str,
        kind: Kind,
        mode: u32,
    ) -> R<u64> {
        if self.dir(parent)?.children.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let t = now_ns();
        self.nodes.insert(
            ino,
            Node {
                name: name.to_string(),
                parent,
                kind,
                perm: (mode & 0o7777) as u16,
                uid: req.uid(),
                gid: req.gid(),
                mtime_ns: t,
                ctime_ns: t,
                nlink: if kind == Kind::Dir { 2 } else { 1 },
                data: Vec::new(),
                children: BTreeMap::new(),
            },
        );
        let p = self.node_mut(parent)?;
        p.children.insert(name.to_string(), ino);
        p.mtime_ns = t;
        Ok(ino)
    }

    fn open_handle(&mut self, ino: u64) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, ino);
        fh
    }

    /// Drops an unlinked node once nothing refers to it any more.
    fn maybe_reap(&mut self, ino: u64) {
        let linked = self.nodes.get(&ino).is_some_and(|n| n.nlink > 0);
        if !linked && !self.handles.values().any(|&i| i == ino) {
            self.nodes.remove(&ino);
        }
    }

    /// Removes `name` from `parent` (its node stays while open).
    fn detach(&mut self, parent: u64, name: &str) -> R<u64> {
        let ino = self.child(parent, name)?;
        let t = now_ns();
        let p = self.node_mut(parent)?;
        p.children.remove(name);
        p.mtime_ns = t;
        let n = self.node_mut(ino)?;
        n.nlink = 0;
        n.ctime_ns = t;
        self.maybe_reap(ino);
        Ok(ino)
    }

    fn remember(&mut self, unique: u64, out: &Outcome) {
        if self.recent.len() >= REPLY_CACHE {
            self.recent.pop_front();
        }
        self.recent.push_back((unique, out.clone()));
    }

    fn recall(&self, unique: u64) -> Option<Outcome> {
        self.recent
            .iter()
            .rev()
            .find(|(u, _)| *u == unique)
            .map(|(_, o)| o.clone())
    }
}

/// JSON part of the blob: the state without file contents, plus (ino, length) of each
/// content in the order they follow.
#[derive(Serialize)]
struct SnapshotRef<'a> {
    state: &'a MemState,
    data: Vec<(u64, u64)>,
}

#[derive(Deserialize)]
struct Snapshot {
    state: MemState,
    data: Vec<(u64, u64)>,
}

/// Blob layout: JSON length (u64 LE), `Handover<SnapshotRef>` JSON, raw file contents.
fn encode_blob(
    mountpoint: &std::path::Path,
    init: &InitParams,
    st: &MemState,
) -> std::io::Result<Vec<u8>> {
    let files: Vec<(u64, &[u8])> = st
        .nodes
        .iter()
        .filter(|(_, n)| !n.data.is_empty())
        .map(|(i, n)| (*i, n.data.as_slice()))
        .collect();
    let snap = SnapshotRef {
        state: st,
        data: files.iter().map(|(i, d)| (*i, d.len() as u64)).collect(),
    };
    let json = Handover::new(mountpoint.to_path_buf(), init.clone(), snap).to_bytes()?;
    let total = 8 + json.len() + files.iter().map(|(_, d)| d.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, d) in files {
        out.extend_from_slice(d);
    }
    Ok(out)
}

fn decode_blob(blob: &[u8]) -> anyhow::Result<Handover<MemState>> {
    let len = blob
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .context("blob too short")?;
    let json = blob
        .get(8..8usize.saturating_add(len))
        .context("blob truncated")?;
    let h = Handover::<Snapshot>::from_bytes(json)?;
    let mut st = h.state.state;
    let mut rest = &blob[8 + len..];
    for (ino, n) in h.state.data {
        let n = usize::try_from(n)?;
        anyhow::ensure!(rest.len() >= n, "blob data truncated");
        let node = st
            .nodes
            .get_mut(&ino)
            .context("blob data for unknown node")?;
        node.data = rest[..n].to_vec();
        rest = &rest[n..];
    }
    Ok(Handover {
        format: h.format,
        mountpoint: h.mountpoint,
        init: h.init,
        state: st,
    })
}

fn name_str(name: &OsStr) -> R<&str> {
    name.to_str().ok_or(Errno::EINVAL)
}

struct Sink {
    client: Arc<KeeperClient>,
    id: String,
    init: InitParams,
    mountpoint: PathBuf,
}

struct Shared {
    state: RwLock<MemState>,
    sink: Mutex<Option<Sink>>,
    persist_every_change: bool,
    hold: Option<(String, Duration)>,
    hold_lookup: Option<(String, Duration)>,
    /// Invalidated (from another thread) while a lookup is held.
    inval_on_hold: Option<String>,
    notifier: Mutex<Option<Arc<dyn crate::fs::Notifier>>>,
    first_seen: AtomicBool,
    ttl: Duration,
}

impl Shared {
    /// The keeper blob for `st` (None without a keeper).
    fn blob(&self, st: &MemState) -> anyhow::Result<Option<Vec<u8>>> {
        let sink = self.sink.lock();
        let Some(s) = sink.as_ref() else {
            return Ok(None);
        };
        Ok(Some(encode_blob(&s.mountpoint, &s.init, st)?))
    }

    fn persist(&self, st: &MemState) -> anyhow::Result<()> {
        if let Some(blob) = self.blob(st)? {
            let sink = self.sink.lock();
            let s = sink.as_ref().expect("blob() saw a sink");
            s.client.update_blob(&s.id, &blob)?;
        }
        Ok(())
    }
}

/// The filesystem (cheap handle on shared state).
pub struct MemFs {
    sh: Arc<Shared>,
}

/// Tuning and test hooks of [`MemFs`].
#[derive(Clone, Debug)]
pub struct MemFsOptions {
    pub persist_every_change: bool,
    /// Reads of a file with this name sleep this long first (keeps a request in flight).
    pub hold: Option<(String, Duration)>,
    /// Lookups of this name sleep this long first (keeps the directory's lock taken).
    pub hold_lookup: Option<(String, Duration)>,
    /// While a lookup is held, another thread invalidates this name in its directory.
    pub inval_on_hold: Option<String>,
    pub ttl: Duration,
}

impl MemFs {
    pub fn new(state: MemState, opts: MemFsOptions) -> Self {
        Self {
            sh: Arc::new(Shared {
                state: RwLock::new(state),
                sink: Mutex::new(None),
                persist_every_change: opts.persist_every_change,
                hold: opts.hold,
                hold_lookup: opts.hold_lookup,
                inval_on_hold: opts.inval_on_hold,
                notifier: Mutex::new(None),
                first_seen: AtomicBool::new(false),
                ttl: opts.ttl,
            }),
        }
    }

    fn clone_handle(&self) -> Self {
        Self {
            sh: self.sh.clone(),
        }
    }

    fn note(&self, req: &Request, op: &str) {
        let unique = req.unique().0;
        if !self.sh.first_seen.swap(true, Ordering::Relaxed) {
            eprintln!(
                "memfs-event: first-request unix_ns={} unique={unique:#x} op={op}",
                now_ns()
            );
        }
        if unique & RESEND_UNIQUE_BIT != 0 {
            eprintln!("memfs-event: resent unique={unique:#x} op={op}");
        }
    }

    /// Applies, persists and answers a mutation under one write lock; answers a resent
    /// duplicate of an already applied mutation from the reply cache.
    fn mutate(
        &self,
        req: &Request,
        op: &str,
        apply: impl FnOnce(&mut MemState) -> R<Outcome>,
        answer: impl FnOnce(&MemState, Outcome),
    ) {
        self.note(req, op);
        let unique = req.unique().0;
        let original = unique & !RESEND_UNIQUE_BIT;
        let mut st = self.sh.state.write();
        if unique != original {
            if let Some(out) = st.recall(original) {
                eprintln!("memfs-event: deduplicated unique={unique:#x} op={op}");
                return answer(&st, out);
            }
        }
        let out = apply(&mut st).unwrap_or_else(|e| Outcome::Err(e.code()));
        st.remember(original, &out);
        if self.sh.persist_every_change {
            if let Err(e) = self.sh.persist(&st) {
                tracing::error!(error = %e, op, "memfs: cannot persist state to the keeper");
            }
        }
        answer(&st, out);
    }
}

fn errno(code: i32) -> Errno {
    Errno::from_i32(code)
}

impl Filesystem for MemFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        // The largest readahead the kernel allows.
        if let Err(max) = config.set_max_readahead(u32::MAX) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_PARALLEL_DIROPS);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.note(req, "lookup");
        if let Some((held, delay)) = &self.sh.hold_lookup {
            if name.as_encoded_bytes() == held.as_bytes() {
                eprintln!("memfs-event: hold op=lookup unique={:#x}", req.unique().0);
                if let Some(other) = self.sh.inval_on_hold.clone() {
                    let sh = self.sh.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(50));
                        let nt = sh.notifier.lock().clone();
                        if let Some(nt) = nt {
                            eprintln!("memfs-event: notifying name={other}");
                            nt.inval_entry(parent.0, &other);
                            eprintln!("memfs-event: notified name={other}");
                        }
                    });
                }
                std::thread::sleep(*delay);
            }
        }
        let st = self.sh.state.read();
        match name_str(name)
            .and_then(|n| st.child(parent.0, n))
            .and_then(|ino| st.attr(ino))
        {
            Ok(a) => reply.entry(&self.sh.ttl, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.note(req, "getattr");
        match self.sh.state.read().attr(ino.0) {
            Ok(a) => reply.attr(&self.sh.ttl, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let ttl = self.sh.ttl;
        self.mutate(
            req,
            "setattr",
            |st| {
                let n = st.node_mut(ino.0)?;
                if let Some(size) = size {
                    if n.kind == Kind::Dir {
                        return Err(Errno::EISDIR);
                    }
                    n.data.resize(size as usize, 0);
                    n.mtime_ns = now_ns();
                }
                if let Some(m) = mode {
                    n.perm = (m & 0o7777) as u16;
                }
                n.uid = uid.unwrap_or(n.uid);
                n.gid = gid.unwrap_or(n.gid);
                match mtime {
                    Some(TimeOrNow::Now) => n.mtime_ns = now_ns(),
                    Some(TimeOrNow::SpecificTime(t)) => {
                        n.mtime_ns = t
                            .duration_since(UNIX_EPOCH)
                            .map_or(0, |d| d.as_nanos() as u64)
                    }
                    None => {}
                }
                n.ctime_ns = now_ns();
                Ok(Outcome::Attr(ino.0))
            },
            |st, out| match out {
                Outcome::Attr(i) => match st.attr(i) {
                    Ok(a) => reply.attr(&ttl, &a),
                    Err(e) => reply.error(e),
                },
                Outcome::Err(e) => reply.error(errno(e)),
                _ => reply.error(Errno::EIO),
            },
        );
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let ttl = self.sh.ttl;
        self.mutate(
            req,
            "mkdir",
            |st| {
                let ino = st.new_node(req, parent.0, name_str(name)?, Kind::Dir, mode & !umask)?;
                Ok(Outcome::Entry(ino))
            },
            |st, out| entry_reply(st, out, &ttl, reply),
        );
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.mutate(
            req,
            "unlink",
            |st| {
                let name = name_str(name)?;
                if st.node(st.child(parent.0, name)?)?.kind == Kind::Dir {
                    return Err(Errno::EISDIR);
                }
                st.detach(parent.0, name)?;
                Ok(Outcome::Ok)
            },
            |_, out| empty_reply(out, reply),
        );
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.mutate(
            req,
            "rmdir",
            |st| {
                let name = name_str(name)?;
                let n = st.node(st.child(parent.0, name)?)?;
                if n.kind != Kind::Dir {
                    return Err(Errno::ENOTDIR);
                }
                if !n.children.is_empty() {
                    return Err(Errno::ENOTEMPTY);
                }
                st.detach(parent.0, name)?;
                Ok(Outcome::Ok)
            },
            |_, out| empty_reply(out, reply),
        );
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        self.mutate(
            req,
            "rename",
            |st| {
                let (name, newname) = (name_str(name)?, name_str(newname)?);
                if flags.contains(RenameFlags::RENAME_EXCHANGE)
                    || flags.contains(RenameFlags::RENAME_WHITEOUT)
                {
                    return Err(Errno::EINVAL);
                }
                let ino = st.child(parent.0, name)?;
                st.dir(newparent.0)?;
                if let Ok(target) = st.child(newparent.0, newname) {
                    if target == ino {
                        return Ok(Outcome::Ok);
                    }
                    if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                        return Err(Errno::EEXIST);
                    }
                    let (src, dst) = (st.node(ino)?.kind, st.node(target)?);
                    match (src, dst.kind) {
                        (Kind::Dir, Kind::File) => return Err(Errno::ENOTDIR),
                        (Kind::File, Kind::Dir) => return Err(Errno::EISDIR),
                        (Kind::Dir, Kind::Dir) if !dst.children.is_empty() => {
                            return Err(Errno::ENOTEMPTY)
                        }
                        _ => {}
                    }
                    st.detach(newparent.0, newname)?;
                }
                let t = now_ns();
                st.node_mut(parent.0)?.children.remove(name);
                st.node_mut(parent.0)?.mtime_ns = t;
                let np = st.node_mut(newparent.0)?;
                np.children.insert(newname.to_string(), ino);
                np.mtime_ns = t;
                let n = st.node_mut(ino)?;
                n.parent = newparent.0;
                n.name = newname.to_string();
                n.ctime_ns = t;
                Ok(Outcome::Ok)
            },
            |_, out| empty_reply(out, reply),
        );
    }

    fn open(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.mutate(
            req,
            "open",
            |st| {
                if st.node(ino.0)?.kind == Kind::Dir {
                    return Err(Errno::EISDIR);
                }
                Ok(Outcome::Opened(st.open_handle(ino.0)))
            },
            |_, out| match out {
                Outcome::Opened(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                Outcome::Err(e) => reply.error(errno(e)),
                _ => reply.error(Errno::EIO),
            },
        );
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let ttl = self.sh.ttl;
        self.mutate(
            req,
            "create",
            |st| {
                let name = name_str(name)?;
                let ino = match st.child(parent.0, name) {
                    Ok(_) if flags & libc::O_EXCL != 0 => return Err(Errno::EEXIST),
                    Ok(ino) => {
                        let n = st.node_mut(ino)?;
                        if n.kind == Kind::Dir {
                            return Err(Errno::EISDIR);
                        }
                        if flags & libc::O_TRUNC != 0 {
                            n.data.clear();
                            n.mtime_ns = now_ns();
                        }
                        ino
                    }
                    Err(_) => st.new_node(req, parent.0, name, Kind::File, mode & !umask)?,
                };
                Ok(Outcome::Created {
                    ino,
                    fh: st.open_handle(ino),
                })
            },
            |st, out| match out {
                Outcome::Created { ino, fh } => match st.attr(ino) {
                    Ok(a) => {
                        reply.created(&ttl, &a, Generation(0), FileHandle(fh), FopenFlags::empty())
                    }
                    Err(e) => reply.error(e),
                },
                Outcome::Err(e) => reply.error(errno(e)),
                _ => reply.error(Errno::EIO),
            },
        );
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.note(req, "read");
        if let Some((name, delay)) = &self.sh.hold {
            let held = self
                .sh
                .state
                .read()
                .node(ino.0)
                .is_ok_and(|n| &n.name == name);
            if held {
                eprintln!(
                    "memfs-event: hold unique={:#x} ms={}",
                    req.unique().0,
                    delay.as_millis()
                );
                std::thread::sleep(*delay);
            }
        }
        let st = self.sh.state.read();
        match st.node(ino.0) {
            Ok(n) if n.kind == Kind::File => {
                let start = (offset as usize).min(n.data.len());
                let end = start.saturating_add(size as usize).min(n.data.len());
                reply.data(&n.data[start..end]);
            }
            Ok(_) => reply.error(Errno::EISDIR),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.mutate(
            req,
            "write",
            |st| {
                let n = st.node_mut(ino.0)?;
                if n.kind != Kind::File {
                    return Err(Errno::EISDIR);
                }
                let start = usize::try_from(offset).map_err(|_| Errno::EFBIG)?;
                let end = start.checked_add(data.len()).ok_or(Errno::EFBIG)?;
                if n.data.len() < end {
                    n.data.resize(end, 0);
                }
                n.data[start..end].copy_from_slice(data);
                n.mtime_ns = now_ns();
                Ok(Outcome::Written(data.len() as u32))
            },
            |_, out| match out {
                Outcome::Written(n) => reply.written(n),
                Outcome::Err(e) => reply.error(errno(e)),
                _ => reply.error(Errno::EIO),
            },
        );
    }

    fn flush(
        &self,
        req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.note(req, "flush");
        reply.ok();
    }

    fn release(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.mutate(
            req,
            "release",
            |st| {
                if let Some(ino) = st.handles.remove(&fh.0) {
                    st.maybe_reap(ino);
                }
                Ok(Outcome::Ok)
            },
            |_, out| empty_reply(out, reply),
        );
    }

    fn fsync(&self, req: &Request, _ino: INodeNo, _fh: FileHandle, _ds: bool, reply: ReplyEmpty) {
        self.note(req, "fsync");
        reply.ok();
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        self.note(req, "readdir");
        let st = self.sh.state.read();
        let dir = match st.dir(ino.0) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let dots = [
            (ino.0, FileType::Directory, "."),
            (dir.parent, FileType::Directory, ".."),
        ];
        let kids = dir.children.iter().map(|(name, &child)| {
            let kind = match st.nodes.get(&child).map(|n| n.kind) {
                Some(Kind::Dir) => FileType::Directory,
                _ => FileType::RegularFile,
            };
            (child, kind, name.as_str())
        });
        for (i, (child, kind, name)) in dots
            .into_iter()
            .chain(kids)
            .enumerate()
            .skip(offset as usize)
        {
            if reply.add(INodeNo(child), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

fn entry_reply(st: &MemState, out: Outcome, ttl: &Duration, reply: ReplyEntry) {
    match out {
        Outcome::Entry(i) => match st.attr(i) {
            Ok(a) => reply.entry(ttl, &a, Generation(0)),
            Err(e) => reply.error(e),
        },
        Outcome::Err(e) => reply.error(errno(e)),
        _ => reply.error(Errno::EIO),
    }
}

fn empty_reply(out: Outcome, reply: ReplyEmpty) {
    match out {
        Outcome::Err(e) => reply.error(errno(e)),
        _ => reply.ok(),
    }
}

// ---------------------------------------------------------------------------------------------
// The `memfs` subcommand

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Persist {
    /// Hand the whole state to the keeper after every mutation (survives SIGKILL).
    EveryChange,
    /// Only at SIGTERM (fast; a crash loses changes since the last handover).
    OnExit,
}

/// Arguments of the hidden `memfs` subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct MemfsArgs {
    /// Mount point.
    #[arg(long)]
    pub dir: PathBuf,
    /// fd-keeper socket: hand the connection and state to it so a successor can adopt.
    #[arg(long)]
    pub keeper: Option<PathBuf>,
    /// Keeper entry id (required with --keeper).
    #[arg(long)]
    pub id: Option<String>,
    /// Adopt the live connection held by the keeper instead of mounting (waits until the
    /// previous daemon is gone).
    #[arg(long)]
    pub adopt: bool,
    /// On SIGTERM unmount (and drop the keeper entry) instead of handing over.
    #[arg(long)]
    pub unmount_on_exit: bool,
    /// Threads serving the shared /dev/fuse fd.
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    #[arg(long, value_enum, default_value_t = Persist::EveryChange)]
    pub persist: Persist,
    /// How long --adopt waits for the previous daemon, in seconds.
    #[arg(long, default_value_t = 60)]
    pub claim_timeout_secs: u64,
    /// Attribute/entry cache TTL in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub ttl_ms: u64,
    /// Test hook: reads of a file with this name are held for --hold-ms first.
    #[arg(long)]
    pub hold_read_name: Option<String>,
    /// Test hook: lookups of this name are held for --hold-ms first.
    #[arg(long)]
    pub hold_lookup_name: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub hold_ms: u64,
    /// Test hook: while a lookup is held, invalidate this name in its directory.
    #[arg(long)]
    pub inval_on_hold: Option<String>,
    /// Write invalidations from our own threads, not the keeper's (as before it could).
    #[arg(long)]
    pub notify_direct: bool,
}

/// Waits for SIGTERM/SIGINT (blocked by the caller) while `alive()`; returns the signal.
fn wait_signal(mask: &nix::sys::signal::SigSet, alive: impl Fn() -> bool) -> Option<i32> {
    let timeout = libc::timespec {
        tv_sec: 0,
        tv_nsec: 200_000_000,
    };
    while alive() {
        // SAFETY: valid sigset and timespec; no siginfo requested.
        let sig = unsafe { libc::sigtimedwait(mask.as_ref(), std::ptr::null_mut(), &timeout) };
        if sig > 0 {
            return Some(sig);
        }
    }
    None
}

/// The keeper's notifier for a kept connection, as the product opens it (not with
/// `--notify-direct`).
fn keeper_notifier(args: &MemfsArgs, client: &KeeperClient, id: &str) -> Option<KeeperNotifier> {
    if args.notify_direct {
        return None;
    }
    match KeeperNotifier::open(client.path(), id, None) {
        Ok(n) => {
            eprintln!("memfs-event: keeper-notifier open");
            Some(n)
        }
        Err(e) => {
            tracing::warn!(error = %e, "the keeper cannot write invalidations");
            None
        }
    }
}

/// Runs the `memfs` subcommand until SIGTERM/SIGINT or an external unmount.
pub fn run(args: MemfsArgs) -> anyhow::Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    // Block the stop signals before any thread exists: fuser's threads inherit the mask and
    // the main thread takes the signal with sigtimedwait.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block()?;

    let client = match &args.keeper {
        Some(p) => {
            Some(Arc::new(KeeperClient::connect(p).with_context(|| {
                format!("connect keeper {}", p.display())
            })?))
        }
        None => None,
    };
    let id = match (&client, &args.id) {
        (Some(_), Some(id)) => id.clone(),
        (Some(_), None) => anyhow::bail!("--keeper needs --id"),
        (None, _) if args.adopt => anyhow::bail!("--adopt needs --keeper"),
        (None, _) => String::new(),
    };
    let opts = MemFsOptions {
        persist_every_change: client.is_some() && args.persist == Persist::EveryChange,
        hold: args
            .hold_read_name
            .clone()
            .map(|n| (n, Duration::from_millis(args.hold_ms))),
        hold_lookup: args
            .hold_lookup_name
            .clone()
            .map(|n| (n, Duration::from_millis(args.hold_ms))),
        inval_on_hold: args.inval_on_hold.clone(),
        ttl: Duration::from_millis(args.ttl_ms),
    };
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("memfs".into()),
        MountOption::Subtype("memfs".into()),
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(args.threads.max(1));

    let (session, fs, notifier) = if args.adopt {
        let client = client.clone().expect("checked above");
        eprintln!("memfs-event: claiming id={id}");
        let entry = client
            .claim(&id, Duration::from_secs(args.claim_timeout_secs))
            .context("claim the live connection from the keeper")?;
        let h = decode_blob(&entry.blob)?;
        if h.mountpoint != args.dir {
            tracing::warn!(kept = %h.mountpoint.display(), given = %args.dir.display(),
                "adopting a connection mounted elsewhere; --dir is ignored");
        }
        let fd = entry
            .fds
            .into_iter()
            .next()
            .context("keeper entry has no fd")?;
        let notifier = keeper_notifier(&args, &client, &id);
        let fs = MemFs::new(h.state, opts);
        let handle = fs.clone_handle();
        *fs.sh.sink.lock() = Some(Sink {
            client,
            id: id.clone(),
            init: h.init.clone(),
            mountpoint: h.mountpoint.clone(),
        });
        (takeover::adopt(fs, fd, &h.init, &config)?, handle, notifier)
    } else {
        let fs = MemFs::new(MemState::default(), opts);
        let handle = fs.clone_handle();
        let m = takeover::mount_fresh(fs, &args.dir, &config)?;
        let mut notifier = None;
        if let Some(client) = &client {
            *handle.sh.sink.lock() = Some(Sink {
                client: client.clone(),
                id: id.clone(),
                init: m.init.clone(),
                mountpoint: args.dir.clone(),
            });
            let blob = handle.sh.blob(&handle.sh.state.read())?.expect("sink set");
            if let Err(e) = client.put(&id, &blob, &[m.fd.as_fd()]) {
                let _ = takeover::unmount(&args.dir);
                return Err(e).context("hand the connection to the keeper");
            }
            notifier = keeper_notifier(&args, client, &id);
        }
        (m.session, handle, notifier)
    };

    let bg = session.spawn()?;
    let direct = super::adapter::KernelNotifier::new(bg.notifier(), None);
    *fs.sh.notifier.lock() = Some(match notifier {
        Some(keeper) => Arc::new(super::adapter::KeptNotifier::new(keeper, direct)),
        None => Arc::new(direct),
    });
    eprintln!("memfs-event: ready unix_ns={}", now_ns());
    let handover = client.is_some() && !args.unmount_on_exit;
    match wait_signal(&mask, || !bg.guard.is_finished()) {
        Some(sig) if handover => {
            // Freeze: no request is applied or answered after this snapshot. Requests read
            // but blocked on the lock die with us and are resent to the successor.
            let st = fs.sh.state.write();
            let blob = fs.sh.blob(&st)?.expect("handover implies a sink");
            client
                .as_ref()
                .expect("handover implies a keeper")
                .update_blob(&id, &blob)
                .context("final state handover")?;
            eprintln!("memfs-event: handed-over signal={sig} unix_ns={}", now_ns());
            std::process::exit(0);
        }
        Some(sig) => {
            tracing::info!(signal = sig, dir = %args.dir.display(), "unmounting");
            takeover::unmount(&args.dir).context("unmount")?;
            bg.join()?;
        }
        None => {
            tracing::info!(dir = %args.dir.display(), "session ended (unmounted externally)");
            bg.join()?;
        }
    }
    if let Some(client) = &client {
        if let Err(e) = client.drop_entry(&id) {
            tracing::warn!(error = %e, id, "drop keeper entry");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_roundtrips_through_the_blob() {
        let mut st = MemState::default();
        st.nodes
            .get_mut(&ROOT)
            .unwrap()
            .children
            .insert("f".into(), 2);
        st.nodes.insert(
            2,
            Node {
                name: "f".into(),
                parent: ROOT,
                kind: Kind::File,
                perm: 0o644,
                uid: 0,
                gid: 0,
                mtime_ns: 1,
                ctime_ns: 1,
                nlink: 1,
                data: vec![0, 1, 2, 255],
                children: BTreeMap::new(),
            },
        );
        st.handles.insert(7, 2);
        st.remember(42, &Outcome::Written(4));
        let init = InitParams {
            major: 7,
            minor: 45,
            max_readahead: 1 << 17,
            flags: 1,
            init_in_len: 64,
            agreed: None,
        };
        let b = encode_blob(std::path::Path::new("/m"), &init, &st).unwrap();
        let h = decode_blob(&b).unwrap();
        assert_eq!(h.init, init);
        let back = h.state;
        assert_eq!(back.nodes[&2].data, vec![0, 1, 2, 255]);
        assert!(decode_blob(&b[..b.len() - 1]).is_err());
        assert!(decode_blob(&b[..5]).is_err());
        assert_eq!(back.handles[&7], 2);
        assert!(matches!(back.recall(42), Some(Outcome::Written(4))));
        assert!(back.recall(43).is_none());
    }

    #[test]
    fn reply_cache_is_bounded() {
        let mut st = MemState::default();
        for u in 0..(REPLY_CACHE as u64 + 10) {
            st.remember(u, &Outcome::Ok);
        }
        assert_eq!(st.recent.len(), REPLY_CACHE);
        assert!(st.recall(0).is_none());
        assert!(st.recall(REPLY_CACHE as u64 + 9).is_some());
    }

    #[test]
    fn unlinked_open_file_lives_until_release() {
        let mut st = MemState::default();
        st.nodes
            .get_mut(&ROOT)
            .unwrap()
            .children
            .insert("f".into(), 2);
        st.nodes.insert(
            2,
            Node {
                name: "f".into(),
                parent: ROOT,
                kind: Kind::File,
                perm: 0o644,
                uid: 0,
                gid: 0,
                mtime_ns: 1,
                ctime_ns: 1,
                nlink: 1,
                data: b"x".to_vec(),
                children: BTreeMap::new(),
            },
        );
        let fh = st.open_handle(2);
        st.detach(ROOT, "f").unwrap();
        assert!(st.nodes.contains_key(&2), "open file must survive unlink");
        assert!(st.child(ROOT, "f").is_err());
        st.handles.remove(&fh);
        st.maybe_reap(2);
        assert!(!st.nodes.contains_key(&2));
    }
}
