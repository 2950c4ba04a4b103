//! Restart survival for FUSE sessions: mount so that a successor process can adopt the live
//! kernel connection, adopt it, and make the kernel replay requests the dead process had read.
//!
//! # Mechanism
//! A FUSE connection lives as long as *any* process holds an fd of its `/dev/fuse` open file
//! (kernel: the connection is aborted when the last `fuse_dev` file is released). So:
//! 1. [`mount_fresh`] opens `/dev/fuse`, calls mount(2) itself with `fd=N` and returns a
//!    second fd of the same open file ([`Mounted::fd`]) that the caller hands to the fd-keeper
//!    (`crate::keeper`). Nothing in this path ever unmounts: fuser sessions created with
//!    `Session::from_fd` have no mount to drop, and there is no `auto_unmount` helper process.
//!    Unmounting is an explicit decision ([`unmount`]), taken when a volume is unstaged.
//! 2. While mounting, the INIT request the kernel sent is read here, recorded as
//!    [`InitParams`] (what the kernel offered and what the first daemon agreed to), and passed
//!    on to fuser through a socketpair; fuser's INIT reply is forwarded to the kernel.
//! 3. A successor calls [`adopt`] with a dup of the live fd (from the keeper) and the recorded
//!    [`InitParams`]. An initialised connection never sends INIT again, but fuser's
//!    `Session::from_fd` insists on reading one. So the same INIT is written into one end of a
//!    socketpair, `from_fd` runs its handshake on the other end (the reply is read back and
//!    discarded: the kernel keeps what was agreed at mount time), and then
//!    `dup3(live_fd, session_fd)` makes the session's fd number refer to the live connection.
//! 4. [`notify_resend`] (`FUSE_NOTIFY_RESEND`, Linux 6.9+) makes the kernel queue again every
//!    request that was read from the connection but never answered (resent ids have bit 63
//!    set, [`RESEND_UNIQUE_BIT`]). [`adopt`] sends it before returning.
//!
//! # Why this is sound with stock fuser 0.18
//! * fuser's channel is an `Arc<File>`; reads, writes and `clone_fd` use the raw fd number at
//!   call time and cache nothing about the device, so replacing the file behind the number
//!   with dup3 (atomic, before `run()`, while no other thread can use the session) is
//!   invisible to it. The number keeps being owned and closed by fuser's `File`.
//! * The INIT values only matter to the filesystem's own `init()`; the kernel ignores the
//!   discarded reply. A successor that asks for different settings (max_write, flags) gets a
//!   warning, not a change.
//! * RESEND is valid only when no live process is mid-request on the connection (a live
//!   daemon would get duplicates and its own replies would fail), i.e. after the old daemon is
//!   gone and before the new one reads. The keeper's `claim` provides exactly that ordering:
//!   it is granted only once the previous owner's keeper connection is closed, which for a
//!   process that keeps its client for its whole life means the process has exited.
//! * Resent requests may already have been applied by the dead daemon (it crashed between
//!   applying and replying): non-idempotent operations must be deduplicated by the filesystem
//!   (see `memfs`'s reply cache for one way).
//!
//! # Threads: one shared fd, no `clone_fd`
//! Cloned fds (`FUSE_DEV_IOC_CLONE`) are separate queues: a request read on a clone is aborted
//! (ECONNABORTED) when that clone is closed, even if the keeper holds the original. fuser
//! creates its clones inside `run()`, out of our reach, so the keeper could not hold them.
//! Therefore `Config::clone_fd` is rejected here; use `Config::n_threads` > 1: all fuser
//! threads then read the one shared fd, every in-flight request sits on the queue of the file
//! the keeper holds, and RESEND covers all of them.
//!
//! # Limits
//! * Kernel request timeouts (`fs.fuse.default_request_timeout` / `max_request_timeout`, Linux
//!   6.14+, fixed when a mount is created): if non-zero, the kernel aborts the connection when
//!   a request waits longer, so a takeover must finish within it. See [`request_timeouts`].
//! * A filesystem must rebuild its node-id and file-handle tables in the successor: the kernel
//!   keeps using the old ids (getattr for ids never looked up, reads with old handles,
//!   FORGET/RELEASE for them).
//! * fuser answers FUSE_INTERRUPT with ENOSYS, and its `SessionACL::Owner` compares against
//!   the adopting process's euid.
//! * During an outage (no daemon serving), callers wait; requests already read by the dead
//!   daemon and FLUSH (sent on every close, a "forced" request) wait *uninterruptibly*, even
//!   through SIGKILL, until a successor answers or the connection is aborted. Seen in the
//!   tests: a process with files open on the mount that forks+execs the successor deadlocks,
//!   because exec closes the inherited O_CLOEXEC fds and each close waits for the very daemon
//!   being exec'd. The successor must be started by a process with no files on the mount
//!   (kubelet/containerd), and it must not touch its own mount before serving.
//! * If no successor ever comes, callers hang; the way out is an explicit unmount, or aborting
//!   the connection (`umount2(MNT_FORCE)` or `/sys/fs/fuse/connections/<dev>/abort`).

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use fuser::{Config, Filesystem, MountOption, Session, SessionACL};
use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sys::socket::{socketpair, AddressFamily, MsgFlags, SockFlag, SockType};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// FUSE opcode of INIT.
const FUSE_INIT: u32 = 26;
/// `struct fuse_in_header` / `struct fuse_out_header` sizes.
const IN_HEADER_LEN: usize = 40;
const OUT_HEADER_LEN: usize = 16;
/// `struct fuse_init_in` of ABI >= 7.36 (major, minor, max_readahead, flags, flags2, 11 unused).
#[cfg(test)]
const INIT_IN_LEN: usize = 64;
/// Pre-7.36 `fuse_init_in`: major, minor, max_readahead, flags.
const INIT_IN_COMPAT_LEN: usize = 16;
/// Notification code of FUSE_NOTIFY_RESEND (`enum fuse_notify_code`).
const FUSE_NOTIFY_RESEND: i32 = 7;
/// Capability bit: the high 32 flag bits are in `flags2`.
const FUSE_INIT_EXT: u64 = 1 << 30;
/// Capability bit: the kernel understands FUSE_NOTIFY_RESEND (ABI 7.40).
pub const FUSE_HAS_RESEND: u64 = 1 << 39;
/// Set in the `unique` id of a request the kernel queued again after FUSE_NOTIFY_RESEND; the
/// other bits are the id of the original request.
pub const RESEND_UNIQUE_BIT: u64 = 1 << 63;
/// `/dev/fuse` is character device 10:229.
const DEV_FUSE_MAJOR: u64 = 10;
const DEV_FUSE_MINOR: u64 = 229;
/// The kernel refuses reads smaller than max_write + headers; INIT comes before max_write is
/// negotiated, so 1 MiB + a page is plenty.
const INIT_READ_BUF: usize = (1 << 20) + 4096;

/// What the kernel offered in the connection's INIT request, plus what the first daemon
/// answered. Recorded by [`mount_fresh`] and stored with the fd in the keeper, so a successor
/// can synthesize the same INIT for fuser's handshake ([`adopt`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitParams {
    /// Kernel FUSE ABI version.
    pub major: u32,
    pub minor: u32,
    /// Readahead the kernel offered.
    pub max_readahead: u32,
    /// Kernel capability flags (`flags | flags2 << 32`, `FUSE_INIT_EXT` included as sent).
    pub flags: u64,
    /// Size of the `fuse_init_in` body the kernel sent (64 since ABI 7.36, 16 before).
    pub init_in_len: u32,
    /// The settings the first daemon answered with, i.e. what the kernel uses for the life of
    /// the connection. `None` if not known.
    pub agreed: Option<InitAgreed>,
}

/// The daemon's INIT reply (`fuse_init_out`) as the kernel accepted it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitAgreed {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// Enabled capabilities (`flags | flags2 << 32`).
    pub flags: u64,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub time_gran: u32,
    pub max_pages: u16,
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    b.get(at..at + 2)
        .map(|s| u16::from_le_bytes(s.try_into().expect("2 bytes")))
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl InitParams {
    /// Parses a raw INIT request as read from `/dev/fuse`.
    pub fn parse_request(raw: &[u8]) -> io::Result<Self> {
        let len = le_u32(raw, 0).ok_or_else(|| invalid("short FUSE request"))? as usize;
        let opcode = le_u32(raw, 4).ok_or_else(|| invalid("short FUSE request"))?;
        if opcode != FUSE_INIT {
            return Err(invalid(format!("expected FUSE_INIT, got opcode {opcode}")));
        }
        if len > raw.len() || len < IN_HEADER_LEN + INIT_IN_COMPAT_LEN {
            return Err(invalid(format!(
                "bad INIT length {len} (read {})",
                raw.len()
            )));
        }
        let body = &raw[IN_HEADER_LEN..len];
        let word = |at| le_u32(body, at).ok_or_else(|| invalid("short fuse_init_in"));
        let mut flags = u64::from(word(12)?);
        if flags & FUSE_INIT_EXT != 0 {
            if let Some(flags2) = le_u32(body, 16) {
                flags |= u64::from(flags2) << 32;
            }
        }
        Ok(Self {
            major: word(0)?,
            minor: word(4)?,
            max_readahead: word(8)?,
            flags,
            init_in_len: body.len() as u32,
            agreed: None,
        })
    }

    /// A FUSE_INIT request carrying these values, as the kernel would send it.
    pub fn to_request(&self, unique: u64) -> Vec<u8> {
        // Never shorter than the compat struct, and no absurd sizes from a corrupt blob.
        let body_len = (self.init_in_len as usize).clamp(INIT_IN_COMPAT_LEN, 4096);
        let total = IN_HEADER_LEN + body_len;
        let mut b = Vec::with_capacity(total);
        b.extend_from_slice(&(total as u32).to_le_bytes());
        b.extend_from_slice(&FUSE_INIT.to_le_bytes());
        b.extend_from_slice(&unique.to_le_bytes());
        b.extend_from_slice(&[0u8; IN_HEADER_LEN - 16]); // nodeid, uid, gid, pid, extlen, pad
        b.extend_from_slice(&self.major.to_le_bytes());
        b.extend_from_slice(&self.minor.to_le_bytes());
        b.extend_from_slice(&self.max_readahead.to_le_bytes());
        b.extend_from_slice(&(self.flags as u32).to_le_bytes());
        if body_len >= 20 {
            b.extend_from_slice(&((self.flags >> 32) as u32).to_le_bytes());
        }
        b.resize(total, 0);
        b
    }

    /// Whether the kernel offered FUSE_NOTIFY_RESEND.
    pub fn kernel_has_resend(&self) -> bool {
        self.flags & FUSE_HAS_RESEND != 0
    }
}

impl InitAgreed {
    /// Parses a daemon's raw INIT reply (`fuse_out_header` + `fuse_init_out`).
    pub fn parse_reply(raw: &[u8]) -> io::Result<Self> {
        let len = le_u32(raw, 0).ok_or_else(|| invalid("short INIT reply"))? as usize;
        let error = le_u32(raw, 4).ok_or_else(|| invalid("short INIT reply"))? as i32;
        if error != 0 {
            return Err(io::Error::from_raw_os_error(-error));
        }
        // 24 bytes is the oldest reply that carries max_write (ABI < 7.23).
        if len > raw.len() || len < OUT_HEADER_LEN + 24 {
            return Err(invalid(format!("bad INIT reply length {len}")));
        }
        let b = &raw[OUT_HEADER_LEN..len];
        let w = |at| le_u32(b, at).unwrap_or(0);
        let h = |at| le_u16(b, at).unwrap_or(0);
        let mut flags = u64::from(w(12));
        if flags & FUSE_INIT_EXT != 0 {
            flags |= u64::from(w(32)) << 32;
        }
        Ok(Self {
            major: w(0),
            minor: w(4),
            max_readahead: w(8),
            flags,
            max_background: h(16),
            congestion_threshold: h(18),
            max_write: w(20),
            time_gran: w(24),
            max_pages: h(28),
        })
    }
}

/// Everything a successor needs, serialized into the keeper's blob: the INIT parameters, the
/// mount point (informational: the mount itself never moves) and the filesystem's own state
/// (node ids, open handles, ...).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Handover<S> {
    /// Bumped on incompatible changes of the envelope.
    pub format: u32,
    pub mountpoint: PathBuf,
    pub init: InitParams,
    pub state: S,
}

/// Current [`Handover::format`] of a session whose kernel clears set-user/group-ID bits
/// itself; [`HANDOVER_FORMAT_KILLPRIV_V2`] for one negotiated with FUSE_HANDLE_KILLPRIV_V2.
pub const HANDOVER_FORMAT: u32 = 1;
/// The format of a session negotiated with FUSE_HANDLE_KILLPRIV_V2: the kernel leaves the
/// clearing of set-user/group-ID bits on writes to the daemon for the connection's life, and
/// a version before 2 (which never clears them) must not adopt it.
pub const HANDOVER_FORMAT_KILLPRIV_V2: u32 = 2;

impl<S: Serialize> Handover<S> {
    pub fn new(mountpoint: PathBuf, init: InitParams, state: S) -> Self {
        let v2 = init
            .agreed
            .as_ref()
            .is_some_and(|a| super::adapter::killpriv_v2_negotiated(a.flags));
        Self {
            format: if v2 {
                HANDOVER_FORMAT_KILLPRIV_V2
            } else {
                HANDOVER_FORMAT
            },
            mountpoint,
            init,
            state,
        }
    }

    pub fn to_bytes(&self) -> io::Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| invalid(format!("encode handover: {e}")))
    }
}

impl<S: DeserializeOwned> Handover<S> {
    pub fn from_bytes(b: &[u8]) -> io::Result<Self> {
        let h: Self =
            serde_json::from_slice(b).map_err(|e| invalid(format!("decode handover: {e}")))?;
        if h.format != HANDOVER_FORMAT && h.format != HANDOVER_FORMAT_KILLPRIV_V2 {
            return Err(invalid(format!(
                "handover format {} not supported (want {HANDOVER_FORMAT} or {HANDOVER_FORMAT_KILLPRIV_V2})",
                h.format
            )));
        }
        Ok(h)
    }
}

/// A freshly mounted session.
#[derive(Debug)]
pub struct Mounted<FS: Filesystem> {
    /// Ready to `run()`/`spawn()`; it never unmounts by itself.
    pub session: Session<FS>,
    /// A second fd of the live connection: give it to the keeper (it is not used otherwise;
    /// dropping it is harmless while the session runs).
    pub fd: OwnedFd,
    /// What to store with `fd` so that a successor can [`adopt`].
    pub init: InitParams,
}

/// Rejects configurations that would break a takeover.
fn check_config(config: &Config) -> io::Result<()> {
    if config.clone_fd {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "clone_fd is not takeover-safe (clones are separate queues the keeper cannot hold); \
             use n_threads with a shared fd",
        ));
    }
    if config.mount_options.contains(&MountOption::AutoUnmount) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "auto_unmount would unmount when the daemon exits, defeating a handover",
        ));
    }
    Ok(())
}

/// mount(2) arguments for a FUSE mount of `dev` at `mountpoint`.
fn mount_args(
    mountpoint: &Path,
    dev: BorrowedFd<'_>,
    config: &Config,
) -> io::Result<(String, String, MsFlags, String)> {
    let meta = std::fs::metadata(mountpoint)?;
    let mut source = None;
    let mut fstype = "fuse".to_string();
    let mut flags = MsFlags::empty();
    let (mut dev_ok, mut suid_ok) = (false, false);
    let mut data = format!(
        "fd={},rootmode={:o},user_id={},group_id={}",
        dev.as_raw_fd(),
        meta.mode() & libc::S_IFMT,
        nix::unistd::getuid(),
        nix::unistd::getgid()
    );
    for opt in &config.mount_options {
        match opt {
            MountOption::FSName(n) => source = Some(n.clone()),
            MountOption::Subtype(t) => {
                fstype = format!("fuse.{t}");
                source.get_or_insert_with(|| t.clone());
            }
            MountOption::CUSTOM(s) => {
                data.push(',');
                data.push_str(s);
            }
            MountOption::DefaultPermissions => data.push_str(",default_permissions"),
            MountOption::Dev => dev_ok = true,
            MountOption::Suid => suid_ok = true,
            MountOption::RO => flags |= MsFlags::MS_RDONLY,
            MountOption::NoExec => flags |= MsFlags::MS_NOEXEC,
            MountOption::NoAtime => flags |= MsFlags::MS_NOATIME,
            MountOption::DirSync => flags |= MsFlags::MS_DIRSYNC,
            MountOption::Sync => flags |= MsFlags::MS_SYNCHRONOUS,
            MountOption::NoDev
            | MountOption::NoSuid
            | MountOption::RW
            | MountOption::Exec
            | MountOption::Atime
            | MountOption::Async => {}
            MountOption::AutoUnmount => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "auto_unmount is not supported",
                ))
            }
        }
    }
    if !dev_ok {
        flags |= MsFlags::MS_NODEV;
    }
    if !suid_ok {
        flags |= MsFlags::MS_NOSUID;
    }
    if config.acl != SessionACL::Owner {
        data.push_str(",allow_other");
    }
    Ok((source.unwrap_or_else(|| "fuse".into()), fstype, flags, data))
}

/// Unmounts `mountpoint` on drop unless disarmed: a failed [`mount_fresh`] must not leave a
/// dead mount behind.
struct UnmountOnError<'a> {
    mountpoint: &'a Path,
    armed: bool,
}

impl Drop for UnmountOnError<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = nix::mount::umount2(self.mountpoint, MntFlags::MNT_DETACH) {
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                    "cleanup unmount after failed mount");
            }
        }
    }
}

fn open_dev_fuse() -> io::Result<OwnedFd> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/fuse")?;
    Ok(OwnedFd::from(f))
}

/// Checks that `fd` is an open `/dev/fuse` file.
fn check_dev_fuse(fd: BorrowedFd<'_>) -> io::Result<()> {
    let st = nix::sys::stat::fstat(fd)?;
    let rdev = st.st_rdev;
    if st.st_mode & libc::S_IFMT != libc::S_IFCHR
        || libc::major(rdev) as u64 != DEV_FUSE_MAJOR
        || libc::minor(rdev) as u64 != DEV_FUSE_MINOR
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "fd is not an open /dev/fuse",
        ));
    }
    Ok(())
}

fn read_retrying(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match nix::unistd::read(fd, buf) {
            Ok(n) => return Ok(n),
            // ENOENT: the request was interrupted before we got it; read the next one.
            Err(Errno::EINTR | Errno::EAGAIN | Errno::ENOENT) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Runs fuser's INIT handshake against `init_request` over a socketpair and returns the
/// session (still on the socket) and the raw INIT reply fuser wrote.
fn handshake_via_socketpair<FS: Filesystem>(
    fs: FS,
    init_request: &[u8],
    config: &Config,
) -> io::Result<(Session<FS>, Vec<u8>)> {
    // SEQPACKET keeps message boundaries: fuser expects one request per read.
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    let n = nix::unistd::write(&ours, init_request)?;
    if n != init_request.len() {
        return Err(io::Error::other("short write of synthetic INIT"));
    }
    let session = Session::from_fd(fs, theirs, config.acl, config.clone())?;
    // fuser replied synchronously inside from_fd; the reply is already queued.
    let mut reply = vec![0u8; 4096];
    let n = nix::sys::socket::recv(ours.as_raw_fd(), &mut reply, MsgFlags::MSG_DONTWAIT)?;
    reply.truncate(n);
    Ok((session, reply))
}

/// Makes the session's fd number refer to `live` (see the module comment for why this is
/// sound). Must run before the session serves.
fn splice_fd<FS: Filesystem>(live: BorrowedFd<'_>, session: &Session<FS>) -> io::Result<()> {
    let target = session.as_fd().as_raw_fd();
    // nix's dup3 wants the target as an OwnedFd, but fuser owns it: call libc directly.
    // SAFETY: both fds are open for the whole call; dup3 only changes what `target` refers to.
    Errno::result(unsafe { libc::dup3(live.as_raw_fd(), target, libc::O_CLOEXEC) })?;
    Ok(())
}

/// Mounts `fs` at `mountpoint` so that the connection survives this process: returns the
/// session, a second fd for the keeper and the recorded INIT parameters.
///
/// `config.mount_options` are translated to mount(2) (requires CAP_SYS_ADMIN; no
/// fusermount). `config.acl != Owner` adds `allow_other`. `clone_fd` and `AutoUnmount` are
/// rejected (see the module comment). On error nothing stays mounted.
pub fn mount_fresh<FS: Filesystem>(
    fs: FS,
    mountpoint: &Path,
    config: &Config,
) -> io::Result<Mounted<FS>> {
    check_config(config)?;
    warn_if_request_timeouts();
    let dev = open_dev_fuse()?;
    let (source, fstype, flags, data) = mount_args(mountpoint, dev.as_fd(), config)?;
    nix::mount::mount(
        Some(source.as_str()),
        mountpoint,
        Some(fstype.as_str()),
        flags,
        Some(data.as_str()),
    )
    .map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!("mount({}, {fstype}, {data}): {e}", mountpoint.display()),
        )
    })?;
    let mut guard = UnmountOnError {
        mountpoint,
        armed: true,
    };

    let mut buf = vec![0u8; INIT_READ_BUF];
    let n = read_retrying(dev.as_fd(), &mut buf)?;
    buf.truncate(n);
    let mut init = InitParams::parse_request(&buf)?;

    let (session, reply) = handshake_via_socketpair(fs, &buf, config)?;
    // fuser accepted INIT (an init() error returns above, and the guard unmounts): forward
    // its answer so the kernel finishes INIT.
    init.agreed = Some(InitAgreed::parse_reply(&reply)?);
    nix::unistd::write(&dev, &reply)?;
    splice_fd(dev.as_fd(), &session)?;
    guard.armed = false;
    tracing::info!(mountpoint = %mountpoint.display(), abi = %format!("{}.{}", init.major, init.minor),
        kernel_has_resend = init.kernel_has_resend(), "mounted FUSE session (takeover-capable)");
    Ok(Mounted {
        session,
        fd: dev,
        init,
    })
}

/// Options of [`adopt_with`].
#[derive(Clone, Debug)]
pub struct AdoptOptions {
    /// Send FUSE_NOTIFY_RESEND after adopting (default). Only correct when the previous
    /// daemon is gone (see the module comment).
    pub resend: bool,
}

impl Default for AdoptOptions {
    fn default() -> Self {
        Self { resend: true }
    }
}

/// Takes over the live connection `live_fd` (a dup from the keeper) with a new filesystem
/// instance and sends FUSE_NOTIFY_RESEND. `fs.init()` is called with the recorded kernel
/// offer. Precondition: no other process is serving the connection (use the keeper's claim).
/// The returned session never unmounts by itself.
pub fn adopt<FS: Filesystem>(
    fs: FS,
    live_fd: OwnedFd,
    init: &InitParams,
    config: &Config,
) -> io::Result<Session<FS>> {
    adopt_with(fs, live_fd, init, config, &AdoptOptions::default())
}

/// [`adopt`] with options.
pub fn adopt_with<FS: Filesystem>(
    fs: FS,
    live_fd: OwnedFd,
    init: &InitParams,
    config: &Config,
    opts: &AdoptOptions,
) -> io::Result<Session<FS>> {
    check_config(config)?;
    check_dev_fuse(live_fd.as_fd())?;
    let (session, reply) = handshake_via_socketpair(fs, &init.to_request(1), config)?;
    match (InitAgreed::parse_reply(&reply), &init.agreed) {
        (Ok(new), Some(old)) if &new != old => tracing::warn!(
            old = ?old, new = ?new,
            "the adopting filesystem asked for different INIT settings; the kernel keeps the old ones"
        ),
        (Err(e), _) => tracing::warn!(error = %e, "could not parse the adopting INIT reply"),
        _ => {}
    }
    splice_fd(live_fd.as_fd(), &session)?;
    drop(live_fd);
    if opts.resend {
        notify_resend(session.as_fd())?;
    }
    Ok(session)
}

/// Outcome of [`notify_resend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resend {
    /// The kernel queued every read-but-unanswered request again.
    Sent,
    /// The kernel does not know FUSE_NOTIFY_RESEND (before Linux 6.9): requests the previous
    /// daemon had read stay unanswered until their callers give up.
    Unsupported,
}

/// Writes FUSE_NOTIFY_RESEND to the connection. Only call it when no process is in the middle
/// of serving the connection and before the new daemon starts reading.
pub fn notify_resend(fd: BorrowedFd<'_>) -> io::Result<Resend> {
    let mut msg = [0u8; OUT_HEADER_LEN];
    msg[0..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_le_bytes());
    msg[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_le_bytes());
    // unique = 0 marks a notification.
    match nix::unistd::write(fd, &msg) {
        Ok(_) => {
            tracing::info!("sent FUSE_NOTIFY_RESEND");
            Ok(Resend::Sent)
        }
        Err(e @ (Errno::EINVAL | Errno::ENOSYS)) => {
            tracing::warn!(error = %e,
                "kernel does not support FUSE_NOTIFY_RESEND; requests in flight at the takeover may hang");
            Ok(Resend::Unsupported)
        }
        Err(e) => Err(e.into()),
    }
}

/// Unmounts a FUSE mount; falls back to a lazy unmount if it is busy. This ends the
/// connection for good (the daemon's reads fail with ENODEV).
pub fn unmount(mountpoint: &Path) -> io::Result<()> {
    match nix::mount::umount2(mountpoint, MntFlags::empty()) {
        Ok(()) => Ok(()),
        Err(Errno::EBUSY) => Ok(nix::mount::umount2(mountpoint, MntFlags::MNT_DETACH)?),
        Err(e) => Err(e.into()),
    }
}

/// Kernel FUSE request timeouts in seconds (`/proc/sys/fs/fuse/*_request_timeout`); `None`
/// where the kernel has no such sysctl (before 6.14). Non-zero values bound how long a
/// takeover may take: the kernel aborts the connection when a request waits longer, keeper
/// or not. They are fixed when a mount is created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestTimeouts {
    pub default_secs: Option<u64>,
    pub max_secs: Option<u64>,
}

pub fn request_timeouts() -> RequestTimeouts {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/fs/fuse/{name}"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    };
    RequestTimeouts {
        default_secs: read("default_request_timeout"),
        max_secs: read("max_request_timeout"),
    }
}

fn warn_if_request_timeouts() {
    let t = request_timeouts();
    if t.default_secs.unwrap_or(0) != 0 || t.max_secs.unwrap_or(0) != 0 {
        tracing::warn!(default_secs = ?t.default_secs, max_secs = ?t.max_secs,
            "fs.fuse request timeouts are set: a takeover slower than that aborts the mount");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> InitParams {
        InitParams {
            major: 7,
            minor: 45,
            max_readahead: 131072,
            flags: FUSE_INIT_EXT | FUSE_HAS_RESEND | 1,
            init_in_len: INIT_IN_LEN as u32,
            agreed: None,
        }
    }

    #[test]
    fn init_request_roundtrip() {
        let p = sample();
        let raw = p.to_request(42);
        assert_eq!(raw.len(), IN_HEADER_LEN + INIT_IN_LEN);
        assert_eq!(le_u32(&raw, 4), Some(FUSE_INIT));
        assert_eq!(u64::from_le_bytes(raw[8..16].try_into().unwrap()), 42);
        assert_eq!(InitParams::parse_request(&raw).unwrap(), p);
        assert!(p.kernel_has_resend());
    }

    #[test]
    fn compat_init_has_no_flags2() {
        let mut p = sample();
        p.init_in_len = INIT_IN_COMPAT_LEN as u32;
        p.flags = 0x1234;
        let raw = p.to_request(1);
        assert_eq!(raw.len(), IN_HEADER_LEN + INIT_IN_COMPAT_LEN);
        assert_eq!(InitParams::parse_request(&raw).unwrap(), p);
    }

    #[test]
    fn parse_rejects_garbage() {
        assert!(InitParams::parse_request(&[]).is_err());
        let mut raw = sample().to_request(1);
        raw[4] = 1; // LOOKUP
        assert!(InitParams::parse_request(&raw).is_err());
        let mut raw = sample().to_request(1);
        raw[0..4].copy_from_slice(&1000u32.to_le_bytes());
        assert!(InitParams::parse_request(&raw).is_err());
        // A corrupt blob cannot make us allocate a huge request.
        let mut p = sample();
        p.init_in_len = u32::MAX;
        assert_eq!(p.to_request(1).len(), IN_HEADER_LEN + 4096);
    }

    #[test]
    fn parse_reply_fields_and_errors() {
        let mut raw = vec![0u8; OUT_HEADER_LEN + 64];
        let len = raw.len() as u32;
        raw[0..4].copy_from_slice(&len.to_le_bytes());
        let b = OUT_HEADER_LEN;
        raw[b..b + 4].copy_from_slice(&7u32.to_le_bytes());
        raw[b + 4..b + 8].copy_from_slice(&40u32.to_le_bytes());
        raw[b + 12..b + 16].copy_from_slice(&((FUSE_INIT_EXT as u32) | 1).to_le_bytes());
        raw[b + 20..b + 24].copy_from_slice(&(1u32 << 20).to_le_bytes());
        raw[b + 28..b + 30].copy_from_slice(&256u16.to_le_bytes());
        raw[b + 32..b + 36].copy_from_slice(&0x80u32.to_le_bytes());
        let a = InitAgreed::parse_reply(&raw).unwrap();
        assert_eq!(
            (a.major, a.minor, a.max_write, a.max_pages),
            (7, 40, 1 << 20, 256)
        );
        assert_eq!(a.flags, FUSE_INIT_EXT | 1 | (0x80 << 32));

        let mut err = vec![0u8; OUT_HEADER_LEN];
        err[0..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_le_bytes());
        err[4..8].copy_from_slice(&(-libc::EPROTO).to_le_bytes());
        let e = InitAgreed::parse_reply(&err).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPROTO));
    }

    #[test]
    fn handover_envelope_checks_format() {
        let h = Handover::new(PathBuf::from("/mnt/x"), sample(), vec![1u32, 2]);
        let b = h.to_bytes().unwrap();
        let back = Handover::<Vec<u32>>::from_bytes(&b).unwrap();
        assert_eq!(back.state, vec![1, 2]);
        assert_eq!(back.init, sample());
        let mut v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        v["format"] = 99.into();
        assert!(Handover::<Vec<u32>>::from_bytes(&serde_json::to_vec(&v).unwrap()).is_err());
        assert_eq!(h.format, HANDOVER_FORMAT, "nothing agreed");
    }

    /// A session whose kernel leaves set-user/group-ID clearing to the daemon is handed over
    /// in format 2, which versions that never clear them (they accept only 1) refuse; this
    /// version reads both.
    #[test]
    fn a_killpriv_v2_session_is_handed_over_in_a_format_older_versions_refuse() {
        let agreed = |flags: u64| InitAgreed {
            major: 7,
            minor: 45,
            max_readahead: 131072,
            flags,
            max_background: 16,
            congestion_threshold: 12,
            max_write: 1 << 20,
            time_gran: 1,
            max_pages: 256,
        };
        let with = |flags: u64| InitParams {
            agreed: Some(agreed(flags)),
            ..sample()
        };
        let v2 = fuser::InitFlags::FUSE_HANDLE_KILLPRIV_V2.bits();
        let h = Handover::new(PathBuf::from("/mnt/x"), with(v2 | 1), 0u32);
        assert_eq!(h.format, HANDOVER_FORMAT_KILLPRIV_V2);
        assert!(Handover::<u32>::from_bytes(&h.to_bytes().unwrap()).is_ok());
        let h = Handover::new(PathBuf::from("/mnt/x"), with(1), 0u32);
        assert_eq!(h.format, HANDOVER_FORMAT);
        assert!(Handover::<u32>::from_bytes(&h.to_bytes().unwrap()).is_ok());
    }

    #[test]
    fn config_rejects_clone_fd_and_auto_unmount() {
        let mut c = Config::default();
        c.clone_fd = true;
        assert!(check_config(&c).is_err());
        let mut c = Config::default();
        c.mount_options.push(MountOption::AutoUnmount);
        assert!(check_config(&c).is_err());
        assert!(check_config(&Config::default()).is_ok());
    }

    #[test]
    fn adopt_refuses_non_fuse_fd() {
        let (r, _w) = nix::unistd::pipe().unwrap();
        struct Nop;
        impl Filesystem for Nop {}
        let Err(e) = adopt(Nop, r, &sample(), &Config::default()) else {
            panic!("adopted a pipe")
        };
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
