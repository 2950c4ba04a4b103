//! Thin `fuser` adapter: every kernel request is handed to [`Fs`] on the tokio runtime and
//! answered from there, so FUSE worker threads never block on the network. Only type
//! conversions and errno mapping live here.
//!
//! Over 800 lines: one thin method per kernel request (about forty), each a conversion; split,
//! the mapping would no longer read as one table.

use crate::fs::{Attr, DirEntryOut, Fs, FsError, Kind, SetAttr};
use crate::metrics::OpTimer;
use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use std::ffi::OsStr;
use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::SystemTime;

/// Called from `init()` with what the kernel offered, so a successor can adopt the connection.
pub type InitHook = Box<dyn Fn(&KernelConfig) + Send + Sync>;

pub struct FuseAdapter {
    fs: Arc<Fs>,
    rt: tokio::runtime::Handle,
    init_hook: Option<InitHook>,
    gate: Arc<Gate>,
    /// This session's FUSE op series (`volume` = the filer path), resolved once each so that a
    /// request only adds to atomics.
    ops: Arc<crate::metrics::FuseOps>,
    linger: Arc<super::linger::Linger>,
}

/// Lets a handover stop answering new requests: once closed, requests are left unanswered
/// (the successor gets them again through FUSE_NOTIFY_RESEND), and `wait_idle` waits for the
/// ones already running.
#[derive(Default)]
pub struct Gate {
    closed: AtomicBool,
    active: AtomicUsize,
}

/// A request counted in by [`Gate::enter`]; dropping it counts the request out, however the
/// request ends (answered, failed, panicked, or its task dropped by a runtime shutting down),
/// so a hand-over never waits out its timeout for a request that is gone.
pub struct Entered(Arc<Gate>);

impl Drop for Entered {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    /// Counts a request in; None once a hand-over closed the gate.
    fn enter(self: &Arc<Self>) -> Option<Entered> {
        self.active.fetch_add(1, Ordering::SeqCst);
        let entered = Entered(self.clone());
        (!self.closed.load(Ordering::SeqCst)).then_some(entered)
    }

    /// Stops admitting requests and waits (bounded) until none is running.
    pub async fn close_and_wait(&self, timeout: std::time::Duration) -> bool {
        self.closed.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + timeout;
        while self.active.load(Ordering::SeqCst) > 0 {
            if tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        true
    }
}

impl FuseAdapter {
    pub fn new(fs: Arc<Fs>, rt: tokio::runtime::Handle, init_hook: Option<InitHook>) -> Self {
        FuseAdapter {
            ops: Arc::new(crate::metrics::global().fuse_ops(fs.cfg.root.as_str().into())),
            fs,
            rt,
            init_hook,
            gate: Arc::default(),
            linger: Arc::new(super::linger::Linger::new(std::time::Duration::ZERO)),
        }
    }

    /// Waits `linger` for a next request after answering one without waiting.
    pub fn with_linger(mut self, linger: Arc<super::linger::Linger>) -> Self {
        self.linger = linger;
        self
    }

    pub fn gate(&self) -> Arc<Gate> {
        self.gate.clone()
    }

    /// Runs a request's future on this FUSE thread until it first has to wait, and only then
    /// hands it to the runtime. Requests answered from memory (cached attributes and chunks,
    /// buffered writes) so skip the wake-up of a runtime worker, which was most of their
    /// latency on a busy machine.
    fn dispatch(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut fut = Box::pin(fut);
        // tokio resources and `tokio::spawn` inside the future need the runtime's context
        let _rt = self.rt.enter();
        match poll_inline(fut.as_mut()) {
            Some(Poll::Pending) => {
                self.rt.spawn(fut);
            }
            // answered: the caller's next request may follow at once
            Some(Poll::Ready(())) => {
                self.linger.after_answer();
            }
            None => {}
        }
    }

    /// Answers a request counted in by `entered` with `body`'s outcome: `answer` gets it,
    /// after it was timed and, if it failed, logged.
    fn serve<T>(
        &self,
        entered: Entered,
        (op, index): (&'static str, usize),
        body: impl Future<Output = Result<T, FsError>> + Send + 'static,
        answer: impl FnOnce(Result<T, FsError>) + Send + 'static,
    ) {
        let ops = self.ops.clone();
        self.dispatch(async move {
            // dropped last, however the request ends: after `answer`, whose reply, dropped
            // unanswered (a panic), answers EIO
            let _entered = entered;
            let answer = answer;
            let timer = ops.start(index);
            // a request that never gets an outcome (a panic, a dropped task) failed
            timer.failed();
            let r = body.await;
            let ok = r.is_ok();
            if let Err(e) = &r {
                log_err(op, e);
            }
            answer(r);
            if ok {
                timer.succeeded();
            }
        });
    }
}

/// Whether negotiated INIT flags (`flags | flags2 << 32`, as recorded for a takeover) include
/// FUSE_POSIX_ACL.
pub fn posix_acl_negotiated(flags: u64) -> bool {
    InitFlags::from_bits_retain(flags).contains(InitFlags::FUSE_POSIX_ACL)
}

/// Whether a session's agreed INIT flags leave set-user/group-ID clearing to the daemon.
pub fn killpriv_v2_negotiated(flags: u64) -> bool {
    InitFlags::from_bits_retain(flags).contains(InitFlags::FUSE_HANDLE_KILLPRIV_V2)
}

fn kind(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDev => FileType::CharDevice,
        Kind::BlockDev => FileType::BlockDevice,
    }
}

pub fn to_file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.crtime,
        kind: kind(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: 1 << 20,
        flags: 0,
    }
}

fn err(e: &FsError) -> Errno {
    Errno::from_i32(e.errno)
}

fn log_err(op: &str, e: &FsError) {
    match e.errno {
        libc::ENOENT
        | libc::EEXIST
        | libc::ENODATA
        | libc::ENOTEMPTY
        | libc::ENOTDIR
        | libc::EISDIR => {
            tracing::trace!(op, error = %e, "fuse op failed")
        }
        libc::EIO => tracing::warn!(op, error = %e, "fuse op failed"),
        // data the application asked to be stored is not
        libc::ESTALE if matches!(op, "fsync" | "flush") => {
            tracing::warn!(op, error = %e, "fuse op failed")
        }
        _ => tracing::debug!(op, error = %e, "fuse op failed"),
    }
}

/// Whether the kernel resent this request after a takeover (the dead process may have applied
/// it already; see `crate::fs::resent`).
fn resent(req: &Request) -> bool {
    req.unique().0 & super::takeover::RESEND_UNIQUE_BIT != 0
}

fn name_of(name: &OsStr) -> Result<String, FsError> {
    crate::fs::sanitize_name(name)
}

fn time(t: Option<TimeOrNow>) -> Option<SystemTime> {
    t.map(|t| match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    })
}

/// Polls a request's future once on the calling FUSE thread. A panic is caught here, as
/// tokio catches one in a task: unwinding would end the FUSE thread. The future is then
/// dropped, which answers the request with EIO (fuser answers a dropped reply) and counts it
/// out of the hand-over gate. None if it panicked.
fn poll_inline<F: Future + ?Sized>(fut: std::pin::Pin<&mut F>) -> Option<Poll<F::Output>> {
    // a wake-up of this waker may be lost: whoever spawns the future polls it again first
    let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
    on_fuse_thread(|| fut.poll(&mut cx))
}

/// Runs a request's step on the calling FUSE thread, catching a panic (logged; None) so
/// that it does not unwind the thread. The caller drops the request, which answers EIO.
fn on_fuse_thread<T>(step: impl FnOnce() -> T) -> Option<T> {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(step));
    if r.is_err() {
        tracing::error!("a FUSE request panicked; answered with EIO");
    }
    r.ok()
}

macro_rules! run {
    ($self:ident, $op:literal, $reply:ident, |$fs:ident| $body:expr, |$v:ident| $ok:expr) => {{
        let Some(entered) = $self.gate.enter() else {
            // handing over: the successor answers this request after FUSE_NOTIFY_RESEND
            std::mem::forget($reply);
            return;
        };
        let $fs = $self.fs.clone();
        let body = {
            let $fs = $fs.clone();
            async move { $body }
        };
        let op = ($op, const { crate::metrics::fuse_op_index($op) });
        $self.serve(entered, op, body, move |r| match r {
            Ok($v) => $ok,
            Err(e) => $reply.error(err(&e)),
        });
    }};
}

/// A write answered outside [`run!`]: timed like the others, and it leaves the hand-over
/// gate when dropped, answered or not (a panic, the runtime dropping its task), so a
/// hand-over does not wait for it. Dropped unanswered, it counts as failed.
struct WriteEnd {
    // fields drop in this order: the reply (answering EIO if unanswered) before the gate
    // counts the request out
    reply: Option<ReplyWrite>,
    timer: OpTimer<'static>,
    _entered: Entered,
}

impl WriteEnd {
    fn written(mut self, n: usize) {
        if let Some(r) = self.reply.take() {
            r.written(n as u32);
        }
    }

    fn failed(mut self, e: &FsError) {
        log_err("write", e);
        self.timer.failed();
        if let Some(r) = self.reply.take() {
            r.error(err(e));
        }
    }
}

impl Drop for WriteEnd {
    fn drop(&mut self) {
        if self.reply.is_some() {
            self.timer.failed();
        }
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        let max_ra = match config.set_max_readahead(16 << 20) {
            Ok(_) => 16 << 20,
            Err(max) => {
                let _ = config.set_max_readahead(max);
                max
            }
        };
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        let wanted = InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_PARALLEL_DIROPS
            // not FUSE_ATOMIC_O_TRUNC: with it the kernel truncates its view of the file
            // when our open succeeds, before its own ETXTBSY check, so an O_RDONLY|O_TRUNC
            // open of a file being executed cut it short under the process (SIGBUS), and
            // a read-only one we do not truncate left the kernel's size at 0. Without it the
            // kernel checks first and truncates with a SETATTR.
            | InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_EXPLICIT_INVAL_DATA
            // The kernel caches and enforces POSIX ACLs; DONT_MASK hands us the umask so that
            // a parent's default ACL can replace it (see `crate::fs::acl`).
            | InitFlags::FUSE_POSIX_ACL
            | InitFlags::FUSE_DONT_MASK
            // Without it the kernel asks for security.capability before every write (one
            // more round trip per write(2): half the speed of 4 KiB writes); with it, it
            // asks once per inode and leaves clearing set-user/group-ID bits to us
            // (write flag, chown, truncate, O_TRUNC open, fallocate: see `SetAttr`).
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        let granted = wanted & config.capabilities();
        let _ = config.add_capabilities(granted);
        self.fs
            .set_posix_acl(granted.contains(InitFlags::FUSE_POSIX_ACL));
        tracing::info!(
            max_readahead = max_ra,
            posix_acl = self.fs.posix_acl(),
            dont_mask = granted.contains(InitFlags::FUSE_DONT_MASK),
            "FUSE session initialised"
        );
        if let Some(h) = &self.init_hook {
            h(config);
        }
        Ok(())
    }

    fn destroy(&mut self) {}

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name_of(name);
        run!(
            self,
            "lookup",
            reply,
            |fs| async { fs.lookup(parent.0, &name?).await }.await,
            |a| reply.entry(&fs.cfg.meta_ttl, &to_file_attr(&a), Generation(0))
        );
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        run!(self, "getattr", reply, |fs| fs.getattr(ino.0).await, |a| {
            reply.attr(&fs.cfg.meta_ttl, &to_file_attr(&a))
        });
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // With FUSE_HANDLE_KILLPRIV_V2 the kernel sends neither the cleared mode of a chown
        // (always cleared, for root too) nor that of an unprivileged truncate; the caller's
        // uid stands in for its CAP_FSETID, which the request does not carry.
        let chown = (uid.is_some() || gid.is_some()) && mode.is_none();
        let req = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: time(atime),
            mtime: time(mtime),
            ctime,
            kill_suidgid: chown || (size.is_some() && req.uid() != 0),
        };
        run!(
            self,
            "setattr",
            reply,
            |fs| fs.setattr(ino.0, req).await,
            |a| reply.attr(&fs.cfg.meta_ttl, &to_file_attr(&a))
        );
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        run!(
            self,
            "readlink",
            reply,
            |fs| fs.readlink(ino.0).await,
            |t| reply.data(t.as_bytes())
        );
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let name = name_of(name);
        let (uid, gid, resent) = (req.uid(), req.gid(), resent(req));
        run!(
            self,
            "mknod",
            reply,
            |fs| async {
                let name = name?;
                let r = fs.mknod(parent.0, &name, mode, umask, rdev, uid, gid).await;
                fs.settle_resent_create(resent, parent.0, &name, None, r)
                    .await
            }
            .await,
            |a| reply.entry(&fs.cfg.meta_ttl, &to_file_attr(&a), Generation(0))
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
        let name = name_of(name);
        let (uid, gid, resent) = (req.uid(), req.gid(), resent(req));
        run!(
            self,
            "mkdir",
            reply,
            |fs| async {
                let name = name?;
                let r = fs.mkdir(parent.0, &name, mode, umask, uid, gid).await;
                fs.settle_resent_create(resent, parent.0, &name, Some(Kind::Dir), r)
                    .await
            }
            .await,
            |a| reply.entry(&fs.cfg.meta_ttl, &to_file_attr(&a), Generation(0))
        );
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (name, resent) = (name_of(name), resent(req));
        run!(
            self,
            "unlink",
            reply,
            |fs| async {
                let name = name?;
                let r = fs.unlink(parent.0, &name).await;
                fs.settle_resent_remove(resent, &name, r)
            }
            .await,
            |_v| reply.ok()
        );
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (name, resent) = (name_of(name), resent(req));
        run!(
            self,
            "rmdir",
            reply,
            |fs| async {
                let name = name?;
                let r = fs.rmdir(parent.0, &name).await;
                fs.settle_resent_remove(resent, &name, r)
            }
            .await,
            |_v| reply.ok()
        );
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let name = name_of(link_name);
        let target = target.to_string_lossy().to_string();
        let (uid, gid, resent) = (req.uid(), req.gid(), resent(req));
        run!(
            self,
            "symlink",
            reply,
            |fs| async {
                let name = name?;
                let r = fs.symlink(parent.0, &name, &target, uid, gid).await;
                fs.settle_resent_create(resent, parent.0, &name, Some(Kind::Symlink), r)
                    .await
            }
            .await,
            |a| reply.entry(&fs.cfg.meta_ttl, &to_file_attr(&a), Generation(0))
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
        let (name, newname, resent) = (name_of(name), name_of(newname), resent(req));
        run!(
            self,
            "rename",
            reply,
            |fs| async {
                let newname = newname?;
                let r = fs
                    .rename(parent.0, &name?, newparent.0, &newname, flags.bits())
                    .await;
                fs.settle_resent_rename(resent, newparent.0, &newname, r)
                    .await
            }
            .await,
            |_v| reply.ok()
        );
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let (name, resent) = (name_of(newname), resent(req));
        run!(
            self,
            "link",
            reply,
            |fs| async {
                let name = name?;
                let r = fs.link(ino.0, newparent.0, &name).await;
                fs.settle_resent_create(resent, newparent.0, &name, Some(Kind::File), r)
                    .await
            }
            .await,
            |a| reply.entry(&fs.cfg.meta_ttl, &to_file_attr(&a), Generation(0))
        );
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // an unprivileged O_TRUNC open clears set-user/group-ID bits (see `setattr`)
        let kill = flags.0 & libc::O_TRUNC != 0 && req.uid() != 0;
        run!(
            self,
            "open",
            reply,
            |fs| async {
                let fh = fs.open(ino.0, flags.0).await?;
                if kill {
                    if let Err(e) = fs.kill_suidgid(ino.0).await {
                        let _ = fs.release(fh, ino.0).await;
                        return Err(e);
                    }
                }
                Ok(fh)
            }
            .await,
            |fh| {
                let mut f = FopenFlags::empty();
                if fs.keep_cache(ino.0) {
                    f |= FopenFlags::FOPEN_KEEP_CACHE;
                }
                reply.opened(FileHandle(fh), f)
            }
        );
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        run!(
            self,
            "read",
            reply,
            |fs| fs.read(fh.0, ino.0, offset, size).await,
            |b| reply.data(&b)
        );
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // the kernel found set-user/group-ID bits to clear (FUSE_HANDLE_KILLPRIV_V2)
        let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let Some(entered) = self.gate.enter() else {
            // handing over: the successor answers this request after FUSE_NOTIFY_RESEND
            std::mem::forget(reply);
            return;
        };
        let (ino, fh, len) = (ino.0, fh.0, data.len());
        let done = WriteEnd {
            timer: self
                .ops
                .start_owned(const { crate::metrics::fuse_op_index("write") }),
            _entered: entered,
            reply: Some(reply),
        };
        let fs = self.fs.clone();
        // the steps that may wait come first and do not hold the bytes: when they do not
        // wait, the bytes are copied once, from the kernel's buffer into the file's
        let mut target = Box::pin({
            let fs = fs.clone();
            async move {
                if kill {
                    fs.kill_suidgid(ino).await?;
                }
                fs.write_target(fh, ino, len).await
            }
        });
        // tokio resources and `tokio::spawn` in these steps need the runtime's context
        let _rt = self.rt.enter();
        match poll_inline(target.as_mut()) {
            // `done`, dropped, answers EIO
            None => {}
            Some(Poll::Ready(Ok(t))) => {
                let Some(written) = on_fuse_thread(|| fs.write_into(t, offset, data)) else {
                    return;
                };
                self.dispatch(async move {
                    fs.write_done(written).await;
                    done.written(len);
                });
            }
            Some(Poll::Ready(Err(e))) => done.failed(&e),
            Some(Poll::Pending) => {
                let data = data.to_vec();
                self.dispatch(async move {
                    match target.await {
                        Ok(t) => {
                            fs.write_done(fs.write_into(t, offset, &data)).await;
                            done.written(len);
                        }
                        Err(e) => done.failed(&e),
                    }
                });
            }
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        run!(
            self,
            "flush",
            reply,
            |fs| fs.flush(fh.0, ino.0).await,
            |_v| reply.ok()
        );
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        run!(
            self,
            "release",
            reply,
            |fs| fs.release(fh.0, ino.0).await,
            |_v| reply.ok()
        );
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        run!(
            self,
            "fsync",
            reply,
            |fs| fs.fsync(fh.0, ino.0).await,
            |_v| reply.ok()
        );
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // The kernel may cache the listing while this handle reads it (CACHE_DIR), but every
        // open lists afresh from our metadata cache: a listing kept across opens (KEEP_CACHE)
        // was seen to hide a name another node created, for longer than the metadata TTL,
        // when the subscription's invalidation raced a listing being filled.
        run!(self, "opendir", reply, |fs| fs.opendir(ino.0).await, |fh| {
            reply.opened(FileHandle(fh), FopenFlags::FOPEN_CACHE_DIR)
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        run!(
            self,
            "readdir",
            reply,
            |fs| fs.readdir(ino.0, fh.0, offset).await,
            |list| {
                let start = list.index_of(offset);
                for (i, e) in list.entries.iter().enumerate().skip(start) {
                    let next = list.base + i as u64 + 1;
                    if reply.add(INodeNo(e.ino), next, kind(e.kind), &e.name) {
                        break;
                    }
                }
                reply.ok()
            }
        );
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        run!(
            self,
            "readdirplus",
            reply,
            |fs| fs.readdirplus(ino.0, fh.0, offset).await,
            |page| {
                let mut sent = 0;
                for p in &page.entries {
                    let e = &p.entry;
                    if reply.add(
                        INodeNo(e.ino),
                        page.listing.base + p.index as u64 + 1,
                        &e.name,
                        &fs.cfg.meta_ttl,
                        &to_file_attr(&dir_attr(ino.0, e)),
                        Generation(0),
                    ) {
                        break;
                    }
                    sent += 1;
                    if e.attr.is_some() {
                        fs.remember_dir_entry(ino.0, e);
                    }
                }
                reply.ok();
                // after the reply: its entries may have reached the kernel after an event's
                // invalidation
                fs.take_back(ino.0, page, sent);
            }
        );
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.fs.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        run!(
            self,
            "fsyncdir",
            reply,
            |fs| {
                fs.flush_dir_times().await;
                Ok::<(), FsError>(())
            },
            |_v| reply.ok()
        );
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        run!(self, "statfs", reply, |fs| fs.statfs().await, |s| reply
            .statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize
            ));
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let name = name_of(name);
        let value = value.to_vec();
        run!(
            self,
            "setxattr",
            reply,
            |fs| async { fs.setxattr(ino.0, &name?, &value, flags).await }.await,
            |_v| reply.ok()
        );
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let name = name_of(name);
        run!(
            self,
            "getxattr",
            reply,
            |fs| async { fs.getxattr(ino.0, &name?).await }.await,
            |v| {
                if size == 0 {
                    reply.size(v.len() as u32)
                } else if v.len() > size as usize {
                    reply.error(Errno::ERANGE)
                } else {
                    reply.data(&v)
                }
            }
        );
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        run!(
            self,
            "listxattr",
            reply,
            |fs| fs.listxattr(ino.0).await,
            |names| {
                let mut buf = Vec::new();
                for n in names {
                    buf.extend_from_slice(n.as_bytes());
                    buf.push(0);
                }
                if size == 0 {
                    reply.size(buf.len() as u32)
                } else if buf.len() > size as usize {
                    reply.error(Errno::ERANGE)
                } else {
                    reply.data(&buf)
                }
            }
        );
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_of(name);
        run!(
            self,
            "removexattr",
            reply,
            |fs| async { fs.removexattr(ino.0, &name?).await }.await,
            |_v| reply.ok()
        );
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        run!(
            self,
            "access",
            reply,
            |fs| fs.getattr(ino.0).await.map(|_| ()),
            |_v| reply.ok()
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
        let name = name_of(name);
        let (uid, gid, resent) = (req.uid(), req.gid(), resent(req));
        run!(
            self,
            "create",
            reply,
            |fs| async {
                let name = name?;
                let r = fs
                    .create(parent.0, &name, mode, umask, flags, uid, gid)
                    .await;
                fs.settle_resent_open_create(resent, parent.0, &name, flags, uid, r)
                    .await
            }
            .await,
            |v| {
                let (a, fh) = v;
                reply.created(
                    &fs.cfg.meta_ttl,
                    &to_file_attr(&a),
                    Generation(0),
                    FileHandle(fh),
                    FopenFlags::empty(),
                )
            }
        );
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let kill = req.uid() != 0;
        run!(
            self,
            "fallocate",
            reply,
            |fs| async {
                fs.fallocate(fh.0, ino.0, offset, length, mode).await?;
                // an unprivileged fallocate clears set-user/group-ID bits (see `setattr`);
                // after it, so that one refused (a mode we do not support) changes nothing
                if kill {
                    fs.kill_suidgid(ino.0).await?;
                }
                Ok(())
            }
            .await,
            |_v| reply.ok()
        );
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        run!(
            self,
            "lseek",
            reply,
            |fs| fs.lseek(fh.0, ino.0, offset, whence).await,
            |o| reply.offset(o)
        );
    }

    // The three below answer at once and quietly (fuser's defaults log a WARN per request):
    // programs send them in normal use.

    /// Every `isatty()` on an open file (Python's `open()`, shells) asks TCGETS: a file on
    /// this filesystem is no terminal and has no other controls.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        tracing::trace!(cmd, "ioctl: ENOTTY");
        reply.error(Errno::ENOTTY);
    }

    /// `cp` tries it first; ENOSYS makes the kernel copy through read and write (and stop
    /// asking this connection).
    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        _fh_in: FileHandle,
        _offset_in: u64,
        _ino_out: INodeNo,
        _fh_out: FileHandle,
        _offset_out: u64,
        _len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::ENOSYS);
    }

    /// ENOSYS: the kernel then treats files here as always ready, as for regular files.
    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: fuser::PollNotifier,
        _events: fuser::PollEvents,
        _flags: fuser::PollFlags,
        reply: fuser::ReplyPoll,
    ) {
        reply.error(Errno::ENOSYS);
    }
}

fn dir_attr(dir_ino: u64, e: &DirEntryOut) -> Attr {
    match e.attr.clone() {
        Some(a) => a,
        None => {
            let mut a = fs_root_like(e.ino);
            if e.ino == dir_ino {
                a.ino = dir_ino;
            }
            a
        }
    }
}

fn fs_root_like(ino: u64) -> Attr {
    let now = SystemTime::now();
    Attr {
        ino,
        size: 4096,
        kind: Kind::Dir,
        perm: 0o755,
        nlink: 2,
        uid: 0,
        gid: 0,
        rdev: 0,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
    }
}

/// Kernel cache invalidation through fuser's notifier; notifications fuser does not know
/// (FUSE_NOTIFY_PRUNE) are written to `raw`, the session's FUSE device.
pub struct KernelNotifier {
    notifier: fuser::Notifier,
    raw: Option<std::os::fd::OwnedFd>,
    /// The kernel refused a prune (before Linux 6.18): not asked again.
    no_prune: std::sync::atomic::AtomicBool,
}

impl KernelNotifier {
    /// `raw`: a duplicate of the session's FUSE device fd, if one could be made.
    pub fn new(notifier: fuser::Notifier, raw: Option<std::os::fd::OwnedFd>) -> Self {
        Self {
            notifier,
            raw,
            no_prune: Default::default(),
        }
    }
}

impl crate::fs::Notifier for KernelNotifier {
    fn inval_entry(&self, parent: u64, name: &str) {
        let _ = self.notifier.inval_entry(INodeNo(parent), OsStr::new(name));
    }
    fn inval_inode(&self, ino: u64) {
        let _ = self.notifier.inval_inode(INodeNo(ino), 0, -1);
    }
    fn inval_attr(&self, ino: u64) {
        // a negative offset: the kernel drops the attributes and leaves the pages
        let _ = self.notifier.inval_inode(INodeNo(ino), -1, 0);
    }
    fn prune(&self, inos: &[u64]) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(fd) = self.raw.as_ref() else {
            return 0;
        };
        if self.no_prune.load(Relaxed) {
            return 0;
        }
        crate::keeper::notify::prune_in_batches(inos, |msg| match nix::unistd::write(fd, msg) {
            Ok(_) => true,
            // the kernel has no such notification
            Err(e @ (nix::errno::Errno::EINVAL | nix::errno::Errno::ENOSYS)) => {
                if !self.no_prune.swap(true, Relaxed) {
                    tracing::warn!(error = %e, "the kernel cannot be asked to forget nodes (FUSE_NOTIFY_PRUNE, Linux 6.18+); the inode table is not bounded");
                }
                false
            }
            Err(e) => {
                tracing::debug!(error = %e, "prune notification failed");
                false
            }
        })
    }
    fn can_prune(&self) -> bool {
        self.raw.is_some() && !self.no_prune.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Kernel cache invalidation for a kept session: written by the fd-keeper's threads, so that
/// one waiting in the kernel cannot keep this process from exiting (see
/// [`crate::keeper::notify`]); by fuser's notifier once the keeper has no connection left.
pub struct KeptNotifier {
    keeper: crate::keeper::KeeperNotifier,
    direct: KernelNotifier,
    /// An unexpected errno from the kernel has been logged (once per session).
    warned: std::sync::atomic::AtomicBool,
    /// The keeper or the kernel refused a prune: not asked again.
    no_prune: std::sync::atomic::AtomicBool,
}

impl KeptNotifier {
    pub fn new(keeper: crate::keeper::KeeperNotifier, direct: KernelNotifier) -> Self {
        Self {
            keeper,
            direct,
            warned: Default::default(),
            no_prune: Default::default(),
        }
    }

    fn pass(&self, msg: std::io::Result<Vec<u8>>, direct: impl FnOnce(&KernelNotifier)) {
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "invalidation not sent");
                return;
            }
        };
        match self.keeper.send(&msg) {
            // ENOENT: the kernel holds nothing of that node, as good as done
            Ok(()) => {}
            Err(Some(e)) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(Some(e)) => {
                // not expected (EINVAL: a message the keeper or kernel refuses): once, loud
                if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(error = %e, "kernel cache invalidation refused; writing them here");
                }
                direct(&self.direct)
            }
            Err(None) => direct(&self.direct),
        }
    }
}

impl crate::fs::Notifier for KeptNotifier {
    fn inval_entry(&self, parent: u64, name: &str) {
        use crate::keeper::notify::inval_entry_msg;
        self.pass(inval_entry_msg(parent, name.as_bytes()), |d| {
            d.inval_entry(parent, name)
        });
    }
    fn inval_inode(&self, ino: u64) {
        use crate::keeper::notify::inval_inode_msg;
        self.pass(Ok(inval_inode_msg(ino, 0, -1)), |d| d.inval_inode(ino));
    }
    fn inval_attr(&self, ino: u64) {
        use crate::keeper::notify::inval_inode_msg;
        self.pass(Ok(inval_inode_msg(ino, -1, 0)), |d| d.inval_attr(ino));
    }
    fn prune(&self, inos: &[u64]) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        // Through the keeper like the invalidations, never written here: an inode evicted by
        // the prune waits for its locked pages, which a read in flight to us may hold, and a
        // thread of ours waiting there would keep a killed plugin from exiting.
        if self.no_prune.load(Relaxed) {
            return 0;
        }
        crate::keeper::notify::prune_in_batches(inos, |msg| match self.keeper.send(msg) {
            Ok(()) => true,
            Err(Some(e)) if e.raw_os_error() == Some(libc::EINVAL) => {
                // a keeper (or kernel) that does not know the notification
                if !self.no_prune.swap(true, Relaxed) {
                    tracing::warn!(error = %e, "the keeper or the kernel cannot ask the kernel to forget nodes (FUSE_NOTIFY_PRUNE: Linux 6.18+ and a keeper of this version); the inode table is not bounded");
                }
                false
            }
            Err(Some(e)) => {
                tracing::debug!(error = %e, "prune through the keeper failed");
                false
            }
            // no keeper connection now: not this round
            Err(None) => false,
        })
    }
    fn can_prune(&self) -> bool {
        !self.no_prune.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::{Fs, FsError, FuseAdapter};
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn posix_acl_is_read_from_recorded_flags() {
        assert!(super::posix_acl_negotiated(1 << 20 | 1 << 30 | 1 << 39));
        assert!(!super::posix_acl_negotiated(1 << 6 | 1 << 30));
    }

    /// A write whose future is dropped unfinished (a panic, a runtime shutting down) still
    /// leaves the hand-over gate, so a takeover does not wait out its timeout for it.
    #[tokio::test]
    async fn an_unfinished_write_leaves_the_hand_over_gate() {
        let gate = Arc::new(super::Gate::default());
        let end = |gate: &Arc<super::Gate>| {
            let ops = crate::metrics::global().fuse_ops("gate-test".into());
            super::WriteEnd {
                timer: ops.start_owned(0),
                _entered: gate.enter().expect("open"),
                reply: None,
            }
        };
        let answered = end(&gate);
        let dropped = end(&gate);
        answered.written(0);
        drop(dropped);
        assert!(
            gate.close_and_wait(Duration::from_millis(200)).await,
            "a write is still counted in"
        );
    }

    /// An adapter over mocks whose metrics series carry `volume`.
    fn adapter(volume: &str) -> FuseAdapter {
        let mut cfg = FsConfig::from_mount_options(&MountOptions::default());
        cfg.root = volume.into();
        let fs = Fs::new(
            cfg,
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        FuseAdapter::new(fs, tokio::runtime::Handle::current(), None)
    }

    /// A request that panics, on the FUSE thread or later on the runtime, is counted out of
    /// the hand-over gate (a hand-over would otherwise wait out its timeout for it) and as a
    /// failed operation, and the panic does not unwind the FUSE thread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_that_panics_leaves_the_hand_over_gate() {
        let volume = "/adapter-test/panics";
        let a = adapter(volume);
        let getattr = ("getattr", crate::metrics::fuse_op_index("getattr"));
        let gate = a.gate();
        let answered = Arc::new(AtomicUsize::new(0));
        let answer = |n: &Arc<AtomicUsize>| {
            let n = n.clone();
            move |_: Result<(), FsError>| {
                n.fetch_add(1, Ordering::SeqCst);
            }
        };
        // panics in its first poll, on the calling (FUSE) thread
        a.serve(
            gate.enter().expect("open"),
            getattr,
            async { panic!("injected, inline") },
            answer(&answered),
        );
        // panics on the runtime, after waiting once
        a.serve(
            gate.enter().expect("open"),
            getattr,
            async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                panic!("injected, spawned")
            },
            answer(&answered),
        );
        // an answered one, for contrast
        a.serve(
            gate.enter().expect("open"),
            getattr,
            async { Ok(()) },
            answer(&answered),
        );
        assert!(
            gate.close_and_wait(Duration::from_secs(2)).await,
            "a request that panicked is still counted in"
        );
        assert_eq!(answered.load(Ordering::SeqCst), 1);
        assert!(gate.enter().is_none(), "a closed gate admits no request");
        let l = format!(r#"op="getattr",volume="{volume}""#);
        let text = crate::metrics::global().render();
        for want in [
            format!("seaweedfs_csi_fuse_op_seconds_count{{{l}}} 3\n"),
            format!("seaweedfs_csi_fuse_op_errors_total{{{l}}} 2\n"),
        ] {
            assert!(text.contains(&want), "no {want:?} in\n{text}");
        }
    }
}
