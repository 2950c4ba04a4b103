//! fd-keeper role: holds duplicates of live /dev/fuse fds across plugin restarts.
//!
//! `seaweedfs-csi-driver keeper --socket=/path` is a tiny single-threaded process that owns
//! no FUSE logic. A FUSE connection stays alive while any process holds its `/dev/fuse` fd, so
//! while the keeper holds a dup, a crash or upgrade of the daemon leaves every mount in place;
//! the successor fetches the fd and the metadata blob and adopts the connection
//! (`crate::fuse::takeover`).
//!
//! # Protocol
//! Unix `SOCK_SEQPACKET`; every message is one small JSON object, fds travel as SCM_RIGHTS.
//! The metadata blob (InitParams + whatever the filesystem hands to its successor) travels as a
//! sealed memfd (write/grow/shrink sealed, so it is immutable and can be handed out many
//! times), which keeps every message small whatever the blob's size ([`MAX_BLOB`]).
//!
//! | request | fds sent | answer |
//! |---|---|---|
//! | `put{id}` | blob, fuse fds... | `ok`; replaces the entry, sender becomes owner |
//! | `update_blob{id}` | blob | `ok` |
//! | `get{id}` | - | `entry` + blob, dups of the fuse fds |
//! | `claim{id}` | - | like `get`, but only once no *other live connection* owns the entry; the claimer becomes owner |
//! | `list` | - | `ids` |
//! | `drop{id}` | - | `ok`; closes the fds (the session is over) |
//!
//! Ownership is a property of the keeper *connection*: it ends when that connection closes,
//! which for a daemon that keeps its [`KeeperClient`] for its whole life means the daemon has
//! exited (all its threads are gone before its fds are closed). So a granted `claim` tells a
//! successor that the old daemon cannot be mid-request any more: the moment to adopt and send
//! FUSE_NOTIFY_RESEND. It also stops two daemons from serving one connection at once.
//!
//! # Robustness
//! * Never blocks on a client: sockets are non-blocking and a request gets exactly one small
//!   answer; a client whose receive buffer is full is disconnected.
//! * Client crashes only close their connection (ownership released, pending claims served).
//! * Only peers with the keeper's uid (or root) are served; the socket file is mode 0600.
//! * Restarting the keeper is safe only while it holds nothing: its fds are the only thing
//!   keeping a connection alive during a daemon outage. If the keeper dies, the fds are gone;
//!   running daemons are unaffected, but a daemon that then dies takes its mount with it
//!   (ENOTCONN) and the CSI node falls back to remount + rebind. On SIGTERM/SIGINT the keeper
//!   therefore only exits once it holds no entries (drain), and it refuses to start on a socket
//!   another keeper is listening on.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::socket::{
    accept4, bind, connect, getsockopt, listen, recvmsg, sendmsg, socket, sockopt, AddressFamily,
    Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Largest metadata blob accepted.
pub const MAX_BLOB: u64 = 64 << 20;
/// Most fuse fds per entry (one per connection clone; normally 1).
pub const MAX_FDS_PER_ENTRY: usize = 16;
const MAX_ID_LEN: usize = 1024;
const MAX_MSG: usize = 64 * 1024;
const MAX_CONNS: usize = 1024;
const MAX_ENTRIES: usize = 4096;
/// Default bound for a keeper round trip (claims have their own).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("keeper i/o: {0}")]
    Io(#[from] io::Error),
    #[error("keeper has no entry {0:?}")]
    NotFound(String),
    #[error("keeper entry {0:?} is owned by another live connection")]
    Busy(String),
    #[error("keeper rejected the request: {0}")]
    Rejected(String),
    #[error("keeper protocol error: {0}")]
    Protocol(String),
    #[error("timed out waiting for the keeper")]
    Timeout,
}

impl From<Errno> for KeeperError {
    fn from(e: Errno) -> Self {
        KeeperError::Io(e.into())
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Put { id: String },
    UpdateBlob { id: String },
    Get { id: String },
    Claim { id: String },
    List,
    Drop { id: String },
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ErrKind {
    NotFound,
    Busy,
    Invalid,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "r", rename_all = "snake_case")]
enum Response {
    Ok,
    /// Followed by fds: the blob memfd, then `nfds` fuse fds.
    Entry {
        nfds: usize,
        owner_alive: bool,
    },
    Ids {
        ids: Vec<String>,
    },
    Err {
        kind: ErrKind,
        message: String,
    },
}

// ---------------------------------------------------------------------------------------------
// Messages with fds

/// poll(2) over `fds` (fd, wanted events; `None` = skip the slot); returns the received
/// events per slot. `timeout_ms` < 0 waits forever. (libc directly: the crate's nix build
/// has no `poll` feature.)
fn poll_fds(fds: &[(Option<BorrowedFd<'_>>, i16)], timeout_ms: i32) -> nix::Result<Vec<i16>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|(fd, ev)| libc::pollfd {
            // poll ignores negative fds (a skipped slot would otherwise still report HUP).
            fd: fd.map_or(-1, |f| f.as_raw_fd()),
            events: *ev,
            revents: 0,
        })
        .collect();
    // SAFETY: pfds is a valid array of pollfd for the duration of the call.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    Errno::result(n)?;
    Ok(pfds.iter().map(|p| p.revents).collect())
}

fn send_msg(
    sock: BorrowedFd<'_>,
    payload: &[u8],
    fds: &[RawFd],
    flags: MsgFlags,
) -> nix::Result<()> {
    let iov = [IoSlice::new(payload)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    sendmsg::<()>(
        sock.as_raw_fd(),
        &iov,
        cmsgs,
        flags | MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Receives one message. `Ok(None)` = peer closed. Truncated messages are an error (and their
/// fds are closed).
fn recv_msg(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    flags: MsgFlags,
) -> nix::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_FDS_PER_ENTRY + 1]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg_space),
        flags | MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: SCM_RIGHTS installed these fds in our table just now; nobody else owns them.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let (bytes, truncated) = (
        msg.bytes,
        msg.flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC),
    );
    if truncated {
        return Err(Errno::EMSGSIZE);
    }
    if bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((bytes, fds)))
}

/// A sealed memfd holding `blob`.
fn blob_to_memfd(blob: &[u8]) -> io::Result<OwnedFd> {
    if blob.len() as u64 > MAX_BLOB {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("blob of {} bytes exceeds {MAX_BLOB}", blob.len()),
        ));
    }
    let fd = memfd_create(
        c"keeper-blob",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?;
    let mut f = File::from(fd);
    f.write_all(blob)?;
    fcntl(
        &f,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_WRITE
                | SealFlag::F_SEAL_SEAL,
        ),
    )?;
    Ok(OwnedFd::from(f))
}

/// Checks that `fd` is an immutable (sealed) blob of acceptable size; returns its size.
fn check_sealed(fd: BorrowedFd<'_>) -> Result<u64, String> {
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("blob fd is not a sealable memfd: {e}"))?;
    let need = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE;
    if !SealFlag::from_bits_truncate(seals).contains(need) {
        return Err("blob memfd is not sealed against writes".into());
    }
    let st = nix::sys::stat::fstat(fd).map_err(|e| format!("fstat blob: {e}"))?;
    let size = st.st_size as u64;
    if size > MAX_BLOB {
        return Err(format!("blob of {size} bytes exceeds {MAX_BLOB}"));
    }
    Ok(size)
}

fn read_blob(fd: OwnedFd) -> Result<Vec<u8>, KeeperError> {
    let size = check_sealed(fd.as_fd()).map_err(KeeperError::Protocol)?;
    let f = File::from(fd);
    let mut buf = vec![0u8; size as usize];
    // Positional reads: the open file (and its offset) is shared with other receivers.
    f.read_exact_at(&mut buf, 0)?;
    Ok(buf)
}

fn validate_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(format!("id must be 1..={MAX_ID_LEN} bytes"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Server

type ConnId = u64;

struct Entry {
    blob: OwnedFd,
    fds: Vec<OwnedFd>,
    owner: Option<ConnId>,
    /// Connections waiting in `claim`, oldest first.
    waiters: VecDeque<ConnId>,
}

/// The keeper's state and socket. Build with [`KeeperServer::bind`], run with
/// [`KeeperServer::serve`].
pub struct KeeperServer {
    listener: OwnedFd,
    path: PathBuf,
    conns: HashMap<ConnId, OwnedFd>,
    entries: HashMap<String, Entry>,
    next_conn: ConnId,
    euid: u32,
    /// Connections to close at the end of the current step (closing can grant claims, which
    /// can fail and close more).
    to_close: Vec<ConnId>,
}

impl KeeperServer {
    /// Binds the listening socket (mode 0600). Refuses if another keeper listens on `path`;
    /// removes a stale socket file otherwise.
    pub fn bind(path: &Path) -> io::Result<Self> {
        if path.exists() {
            let probe = socket(
                AddressFamily::Unix,
                SockType::SeqPacket,
                SockFlag::SOCK_CLOEXEC,
                None,
            )?;
            if connect(probe.as_raw_fd(), &UnixAddr::new(path)?).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("a keeper is already listening on {}", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        bind(listener.as_raw_fd(), &UnixAddr::new(path)?)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        listen(&listener, Backlog::new(128).map_err(io::Error::from)?)?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            conns: HashMap::new(),
            entries: HashMap::new(),
            next_conn: 1,
            euid: nix::unistd::geteuid().as_raw(),
            to_close: Vec::new(),
        })
    }

    /// Serves until `stop` becomes readable (a signalfd, a pipe) *and* no entries are held.
    pub fn serve(mut self, stop: BorrowedFd<'_>) -> io::Result<()> {
        tracing::info!(socket = %self.path.display(), "keeper listening");
        let mut draining = false;
        loop {
            if draining && self.entries.is_empty() {
                tracing::info!("keeper holds nothing; exiting");
                let _ = std::fs::remove_file(&self.path);
                return Ok(());
            }
            let ids: Vec<ConnId> = self.conns.keys().copied().collect();
            let (stop_ready, listen_ready, ready) = {
                let mut want = Vec::with_capacity(ids.len() + 2);
                // Once draining, the stop fd stays readable: stop watching it.
                want.push(((!draining).then_some(stop), libc::POLLIN));
                let accept = if self.conns.len() < MAX_CONNS {
                    libc::POLLIN
                } else {
                    0
                };
                want.push((Some(self.listener.as_fd()), accept));
                for id in &ids {
                    want.push((Some(self.conns[id].as_fd()), libc::POLLIN));
                }
                let rev = match poll_fds(&want, -1) {
                    Ok(r) => r,
                    Err(Errno::EINTR) => continue,
                    Err(e) => return Err(e.into()),
                };
                let ready: Vec<(ConnId, i16)> = ids
                    .iter()
                    .zip(&rev[2..])
                    .filter(|(_, r)| **r != 0)
                    .map(|(id, r)| (*id, *r))
                    .collect();
                (!draining && rev[0] != 0, rev[1] != 0, ready)
            };
            if stop_ready {
                draining = true;
                tracing::info!(
                    entries = self.entries.len(),
                    "keeper asked to stop; exiting once it holds nothing"
                );
            }
            if listen_ready {
                self.accept_all();
            }
            for (cid, revents) in ready {
                if revents & libc::POLLIN != 0 {
                    self.read_conn(cid);
                } else {
                    // HUP/ERR without data.
                    self.to_close.push(cid);
                }
            }
            self.process_closes();
        }
    }

    fn accept_all(&mut self) {
        while self.conns.len() < MAX_CONNS {
            let fd = match accept4(
                self.listener.as_raw_fd(),
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            ) {
                // SAFETY: accept4 returned a fresh fd we own.
                Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
                Err(Errno::EAGAIN | Errno::EINTR | Errno::ECONNABORTED) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "keeper accept");
                    return;
                }
            };
            match getsockopt(&fd, sockopt::PeerCredentials) {
                Ok(cred) if cred.uid() == 0 || cred.uid() == self.euid => {}
                Ok(cred) => {
                    tracing::warn!(uid = cred.uid(), pid = cred.pid(), "keeper: refusing peer");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "keeper: no peer credentials");
                    continue;
                }
            }
            let cid = self.next_conn;
            self.next_conn += 1;
            self.conns.insert(cid, fd);
        }
    }

    fn read_conn(&mut self, cid: ConnId) {
        let mut buf = vec![0u8; MAX_MSG];
        loop {
            let Some(sock) = self.conns.get(&cid) else {
                return;
            };
            match recv_msg(sock.as_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
                Ok(Some((n, fds))) => self.handle(cid, &buf[..n], fds),
                Ok(None) => {
                    self.to_close.push(cid);
                    return;
                }
                Err(Errno::EAGAIN | Errno::EINTR) => return,
                Err(e) => {
                    tracing::warn!(conn = cid, error = %e, "keeper: bad message; disconnecting");
                    self.to_close.push(cid);
                    return;
                }
            }
        }
    }

    fn owner_alive(&self, e: &Entry) -> bool {
        e.owner.is_some_and(|o| self.conns.contains_key(&o))
    }

    fn handle(&mut self, cid: ConnId, msg: &[u8], mut fds: Vec<OwnedFd>) {
        let req: Request = match serde_json::from_slice(msg) {
            Ok(r) => r,
            Err(e) => {
                return self.reply_err(cid, ErrKind::Invalid, format!("bad request: {e}"));
            }
        };
        tracing::debug!(conn = cid, ?req, nfds = fds.len(), "keeper request");
        let id_ok = match &req {
            Request::List => Ok(()),
            Request::Put { id }
            | Request::UpdateBlob { id }
            | Request::Get { id }
            | Request::Claim { id }
            | Request::Drop { id } => validate_id(id),
        };
        if let Err(m) = id_ok {
            return self.reply_err(cid, ErrKind::Invalid, m);
        }
        match req {
            Request::Put { id } => {
                if fds.len() < 2 || fds.len() > MAX_FDS_PER_ENTRY + 1 {
                    return self.reply_err(
                        cid,
                        ErrKind::Invalid,
                        format!("put needs a blob and 1..={MAX_FDS_PER_ENTRY} fds"),
                    );
                }
                if let Err(m) = check_sealed(fds[0].as_fd()) {
                    return self.reply_err(cid, ErrKind::Invalid, m);
                }
                let waiters = match self.entries.get(&id) {
                    Some(e) if self.owner_alive(e) && e.owner != Some(cid) => {
                        return self.reply_err(cid, ErrKind::Busy, id);
                    }
                    Some(_) => self
                        .entries
                        .remove(&id)
                        .map(|e| e.waiters)
                        .unwrap_or_default(),
                    None if self.entries.len() >= MAX_ENTRIES => {
                        return self.reply_err(cid, ErrKind::Invalid, "too many entries".into());
                    }
                    None => VecDeque::new(),
                };
                let blob = fds.remove(0);
                tracing::info!(id = %id, conn = cid, fds = fds.len(), "keeper: put");
                self.entries.insert(
                    id,
                    Entry {
                        blob,
                        fds,
                        owner: Some(cid),
                        waiters,
                    },
                );
                self.reply(cid, &Response::Ok, &[]);
            }
            Request::UpdateBlob { id } => {
                if fds.len() != 1 {
                    return self.reply_err(
                        cid,
                        ErrKind::Invalid,
                        "update_blob needs exactly the blob fd".into(),
                    );
                }
                if let Err(m) = check_sealed(fds[0].as_fd()) {
                    return self.reply_err(cid, ErrKind::Invalid, m);
                }
                let busy = match self.entries.get(&id) {
                    None => return self.reply_err(cid, ErrKind::NotFound, id),
                    Some(e) => self.owner_alive(e) && e.owner != Some(cid),
                };
                if busy {
                    return self.reply_err(cid, ErrKind::Busy, id);
                }
                let e = self.entries.get_mut(&id).expect("checked above");
                e.blob = fds.remove(0);
                e.owner = Some(cid);
                self.reply(cid, &Response::Ok, &[]);
            }
            Request::Get { id } => match self.entries.get(&id) {
                None => self.reply_err(cid, ErrKind::NotFound, id),
                Some(e) => {
                    let resp = Response::Entry {
                        nfds: e.fds.len(),
                        owner_alive: self.owner_alive(e),
                    };
                    let raw = entry_fds(e);
                    self.reply(cid, &resp, &raw);
                }
            },
            Request::Claim { id } => {
                let Some(e) = self.entries.get(&id) else {
                    return self.reply_err(cid, ErrKind::NotFound, id);
                };
                if self.owner_alive(e) && e.owner != Some(cid) {
                    tracing::info!(id = %id, conn = cid, "keeper: claim waits for the current owner");
                    self.entries
                        .get_mut(&id)
                        .expect("present")
                        .waiters
                        .push_back(cid);
                } else {
                    self.grant(&id, cid);
                }
            }
            Request::List => {
                let mut ids: Vec<String> = self.entries.keys().cloned().collect();
                ids.sort();
                self.reply(cid, &Response::Ids { ids }, &[]);
            }
            Request::Drop { id } => match self.entries.remove(&id) {
                None => self.reply_err(cid, ErrKind::NotFound, id),
                Some(e) => {
                    tracing::info!(id = %id, conn = cid, "keeper: drop (fds closed)");
                    for w in e.waiters {
                        self.reply_err(w, ErrKind::NotFound, id.clone());
                    }
                    drop(e.fds);
                    self.reply(cid, &Response::Ok, &[]);
                }
            },
        }
    }

    /// Makes `cid` the owner of `id` and sends it the entry.
    fn grant(&mut self, id: &str, cid: ConnId) {
        let Some(e) = self.entries.get_mut(id) else {
            return;
        };
        e.owner = Some(cid);
        tracing::info!(id = %id, conn = cid, "keeper: claim granted");
        let resp = Response::Entry {
            nfds: e.fds.len(),
            owner_alive: false,
        };
        let raw = entry_fds(e);
        self.reply(cid, &resp, &raw);
    }

    fn reply_err(&mut self, cid: ConnId, kind: ErrKind, message: String) {
        self.reply(cid, &Response::Err { kind, message }, &[]);
    }

    /// Sends without ever blocking; a client that cannot take the answer is disconnected.
    fn reply(&mut self, cid: ConnId, resp: &Response, fds: &[RawFd]) {
        let Some(sock) = self.conns.get(&cid) else {
            return;
        };
        let payload = serde_json::to_vec(resp).expect("responses always serialize");
        if let Err(e) = send_msg(sock.as_fd(), &payload, fds, MsgFlags::MSG_DONTWAIT) {
            tracing::warn!(conn = cid, error = %e, "keeper: cannot answer client; disconnecting");
            self.to_close.push(cid);
        }
    }

    fn process_closes(&mut self) {
        while let Some(cid) = self.to_close.pop() {
            if self.conns.remove(&cid).is_none() {
                continue;
            }
            tracing::debug!(conn = cid, "keeper: connection closed");
            let mut released = Vec::new();
            for (id, e) in self.entries.iter_mut() {
                e.waiters.retain(|w| *w != cid);
                if e.owner == Some(cid) {
                    e.owner = None;
                    released.push(id.clone());
                }
            }
            for id in released {
                tracing::info!(id = %id, conn = cid, "keeper: owner gone");
                let next = self.entries.get_mut(&id).and_then(|e| {
                    while let Some(w) = e.waiters.pop_front() {
                        if self.conns.contains_key(&w) {
                            return Some(w);
                        }
                    }
                    None
                });
                if let Some(w) = next {
                    self.grant(&id, w);
                }
            }
        }
    }
}

fn entry_fds(e: &Entry) -> Vec<RawFd> {
    std::iter::once(e.blob.as_raw_fd())
        .chain(e.fds.iter().map(|f| f.as_raw_fd()))
        .collect()
}

/// Arguments of the `keeper` subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct KeeperArgs {
    /// Unix socket to listen on (SOCK_SEQPACKET).
    #[arg(long)]
    pub socket: PathBuf,
}

/// Runs the keeper until SIGTERM/SIGINT and no entries are held.
pub fn run(args: KeeperArgs) -> anyhow::Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    use nix::sys::signalfd::{SfdFlags, SignalFd};
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block()?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;
    let server = KeeperServer::bind(&args.socket)?;
    server.serve(sfd.as_fd())?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Client

/// An entry as returned by [`KeeperClient::get`] / [`KeeperClient::claim`].
#[derive(Debug)]
pub struct KeptEntry {
    pub blob: Vec<u8>,
    /// Fresh dups of the connection fds (this process owns them).
    pub fds: Vec<OwnedFd>,
    /// Whether another live connection owns the entry (always false after a claim).
    pub owner_alive: bool,
}

struct ClientSock {
    fd: OwnedFd,
    poisoned: Option<Poison>,
    /// Timed-out connections, kept open: the keeper may still count them as the owner of
    /// entries this process serves, and closing one would let a successor claim those
    /// while this process still serves them.
    retired: VecDeque<OwnedFd>,
}

/// Why a connection cannot be used any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Poison {
    /// No answer in time (it may still come): keep the connection open.
    Timeout,
    /// Reset, closed or garbled: the connection is dead.
    Broken,
}

/// Most timed-out connections kept open per client.
const MAX_RETIRED: usize = 8;

/// Blocking client (each call is one bounded round trip; wrap in `spawn_blocking` from async
/// code). Calls are serialized internally, so it can be shared across threads.
///
/// Ownership of entries (see the module comment) belongs to this connection: keep the client
/// alive for as long as the process serves the sessions it put or claimed. After a timeout or
/// an I/O error the connection is poisoned (an answer may still arrive, possibly a granted
/// claim), and the next call opens a new one. A timed-out connection stays open (retired), so
/// what it owns stays owned until the client is dropped; drop the client to give up a pending
/// claim. An I/O error (the keeper restarted, the connection was reset) is retried on a new
/// connection a few times within [`RECONNECT_BUDGET`]; a timeout is not, since the keeper may
/// still act on the request.
pub struct KeeperClient {
    sock: Mutex<ClientSock>,
    path: PathBuf,
    timeout: Duration,
}

/// Reconnect attempts after an I/O error, and the pause before each one.
const RECONNECT_DELAYS: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(200),
    Duration::from_millis(500),
];
/// Longest a call spends reconnecting (the sum of [`RECONNECT_DELAYS`], rounded up).
pub const RECONNECT_BUDGET: Duration = Duration::from_secs(1);

fn open_conn(path: &Path) -> Result<OwnedFd, KeeperError> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    nix::sys::socket::setsockopt(
        &fd,
        sockopt::SendTimeout,
        &nix::sys::time::TimeVal::new(DEFAULT_TIMEOUT.as_secs() as _, 0),
    )?;
    Ok(fd)
}

impl KeeperClient {
    pub fn connect(path: &Path) -> Result<Self, KeeperError> {
        Ok(Self {
            sock: Mutex::new(ClientSock {
                fd: open_conn(path)?,
                poisoned: None,
                retired: VecDeque::new(),
            }),
            path: path.to_path_buf(),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// Bound for each round trip except `claim`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn call(
        &self,
        req: &Request,
        fds: &[RawFd],
        timeout: Duration,
    ) -> Result<(Response, Vec<OwnedFd>), KeeperError> {
        let mut s = self.sock.lock();
        let payload = serde_json::to_vec(req).expect("requests always serialize");
        let mut delays = RECONNECT_DELAYS.iter();
        loop {
            if let Some(poison) = s.poisoned {
                match open_conn(&self.path) {
                    Ok(fd) => {
                        let old = std::mem::replace(&mut s.fd, fd);
                        if poison == Poison::Timeout {
                            s.retired.push_back(old);
                            if s.retired.len() > MAX_RETIRED {
                                s.retired.pop_front();
                            }
                        }
                        s.poisoned = None;
                        tracing::info!(socket = %self.path.display(), "reconnected to the fd-keeper");
                    }
                    Err(e) => match delays.next() {
                        Some(d) => {
                            std::thread::sleep(*d);
                            continue;
                        }
                        None => return Err(e),
                    },
                }
            }
            let res = Self::round_trip(&s.fd, &payload, fds, timeout);
            match res {
                Err(KeeperError::Io(_)) => {
                    s.poisoned = Some(Poison::Broken);
                    match delays.next() {
                        Some(d) => {
                            tracing::warn!(socket = %self.path.display(), error = %res.as_ref().err().map(|e| e.to_string()).unwrap_or_default(),
                                "fd-keeper connection failed; reconnecting");
                            std::thread::sleep(*d)
                        }
                        None => return res,
                    }
                }
                Err(KeeperError::Timeout) => {
                    s.poisoned = Some(Poison::Timeout);
                    return res;
                }
                Err(KeeperError::Protocol(_)) => {
                    s.poisoned = Some(Poison::Broken);
                    return res;
                }
                other => return other,
            }
        }
    }

    /// One cheap round trip (`list`): whether the keeper answers now, for readiness checks.
    pub fn ping(&self) -> Result<(), KeeperError> {
        self.list().map(|_| ())
    }

    fn round_trip(
        fd: &OwnedFd,
        payload: &[u8],
        fds: &[RawFd],
        timeout: Duration,
    ) -> Result<(Response, Vec<OwnedFd>), KeeperError> {
        send_msg(fd.as_fd(), payload, fds, MsgFlags::empty())?;
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; MAX_MSG];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(KeeperError::Timeout);
            }
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            match poll_fds(&[(Some(fd.as_fd()), libc::POLLIN)], ms) {
                Err(Errno::EINTR) => continue,
                Ok(r) if r[0] == 0 => continue,
                Ok(_) => {}
                Err(e) => return Err(e.into()),
            }
            match recv_msg(fd.as_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
                Ok(Some((n, got))) => {
                    let resp: Response = serde_json::from_slice(&buf[..n])
                        .map_err(|e| KeeperError::Protocol(format!("bad answer: {e}")))?;
                    return Ok((resp, got));
                }
                Ok(None) => {
                    return Err(KeeperError::Io(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        "keeper closed the connection",
                    )))
                }
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn expect_ok(resp: Response) -> Result<(), KeeperError> {
        match resp {
            Response::Ok => Ok(()),
            other => Err(Self::unexpected(other)),
        }
    }

    fn unexpected(resp: Response) -> KeeperError {
        match resp {
            Response::Err {
                kind: ErrKind::NotFound,
                message,
            } => KeeperError::NotFound(message),
            Response::Err {
                kind: ErrKind::Busy,
                message,
            } => KeeperError::Busy(message),
            Response::Err {
                kind: ErrKind::Invalid,
                message,
            } => KeeperError::Rejected(message),
            other => KeeperError::Protocol(format!("unexpected answer {other:?}")),
        }
    }

    fn entry(resp: Response, mut got: Vec<OwnedFd>) -> Result<KeptEntry, KeeperError> {
        match resp {
            Response::Entry { nfds, owner_alive } => {
                if got.len() != nfds + 1 {
                    return Err(KeeperError::Protocol(format!(
                        "expected {} fds, got {}",
                        nfds + 1,
                        got.len()
                    )));
                }
                let blob = read_blob(got.remove(0))?;
                Ok(KeptEntry {
                    blob,
                    fds: got,
                    owner_alive,
                })
            }
            other => Err(Self::unexpected(other)),
        }
    }

    /// Stores (replacing) `id` with its blob and fds; this connection becomes the owner.
    /// Fails with `Busy` if another live connection owns `id`.
    pub fn put(&self, id: &str, blob: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), KeeperError> {
        let memfd = blob_to_memfd(blob)?;
        let raw: Vec<RawFd> = std::iter::once(memfd.as_raw_fd())
            .chain(fds.iter().map(|f| f.as_raw_fd()))
            .collect();
        let (resp, _) = self.call(&Request::Put { id: id.into() }, &raw, self.timeout)?;
        Self::expect_ok(resp)
    }

    /// Replaces the blob of `id` (owner or unowned entries only).
    pub fn update_blob(&self, id: &str, blob: &[u8]) -> Result<(), KeeperError> {
        let memfd = blob_to_memfd(blob)?;
        let (resp, _) = self.call(
            &Request::UpdateBlob { id: id.into() },
            &[memfd.as_raw_fd()],
            self.timeout,
        )?;
        Self::expect_ok(resp)
    }

    /// The blob and dups of the fds, without taking ownership.
    pub fn get(&self, id: &str) -> Result<KeptEntry, KeeperError> {
        let (resp, got) = self.call(&Request::Get { id: id.into() }, &[], self.timeout)?;
        Self::entry(resp, got)
    }

    /// Waits (up to `wait`) until no other live connection owns `id`, then takes ownership and
    /// returns the entry. Once granted, the previous owner is gone: adopt and send RESEND.
    pub fn claim(&self, id: &str, wait: Duration) -> Result<KeptEntry, KeeperError> {
        let (resp, got) = self.call(&Request::Claim { id: id.into() }, &[], wait)?;
        Self::entry(resp, got)
    }

    pub fn list(&self) -> Result<Vec<String>, KeeperError> {
        match self.call(&Request::List, &[], self.timeout)?.0 {
            Response::Ids { ids } => Ok(ids),
            other => Err(Self::unexpected(other)),
        }
    }

    /// Forgets `id` and closes the keeper's fds: the session is really over.
    pub fn drop_entry(&self, id: &str) -> Result<(), KeeperError> {
        let (resp, _) = self.call(&Request::Drop { id: id.into() }, &[], self.timeout)?;
        Self::expect_ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    struct Running {
        dir: tempfile::TempDir,
        stop_w: Option<OwnedFd>,
        thread: Option<std::thread::JoinHandle<io::Result<()>>>,
    }

    impl Running {
        fn start() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let server = KeeperServer::bind(&dir.path().join("k.sock")).unwrap();
            let (stop_r, stop_w) = nix::unistd::pipe().unwrap();
            let thread = std::thread::spawn(move || server.serve(stop_r.as_fd()));
            Self {
                dir,
                stop_w: Some(stop_w),
                thread: Some(thread),
            }
        }
        fn path(&self) -> PathBuf {
            self.dir.path().join("k.sock")
        }
        fn client(&self) -> KeeperClient {
            KeeperClient::connect(&self.path()).unwrap()
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            // Empty the keeper so that it exits, then ask it to stop.
            if let Ok(c) = KeeperClient::connect(&self.path()) {
                for id in c.list().unwrap_or_default() {
                    let _ = c.drop_entry(&id);
                }
            }
            drop(self.stop_w.take());
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
        let (sa, sb) = (
            nix::sys::stat::fstat(a).unwrap(),
            nix::sys::stat::fstat(b).unwrap(),
        );
        (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
    }

    #[test]
    fn client_reconnects_after_a_keeper_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.sock");
        let serve = |path: &Path| {
            let server = KeeperServer::bind(path).unwrap();
            let (stop_r, stop_w) = nix::unistd::pipe().unwrap();
            (
                stop_w,
                std::thread::spawn(move || server.serve(stop_r.as_fd())),
            )
        };
        let (stop, t) = serve(&path);
        let c = KeeperClient::connect(&path).unwrap();
        assert!(c.list().unwrap().is_empty());
        drop(stop);
        t.join().unwrap().unwrap();
        // Nobody listens: bounded retries, then an I/O error (not a hang).
        let t0 = Instant::now();
        assert!(matches!(c.list(), Err(KeeperError::Io(_))));
        assert!(t0.elapsed() < RECONNECT_BUDGET + Duration::from_millis(500));
        // A new keeper on the same path: the same client works again.
        let (stop, t) = serve(&path);
        let (_r, w) = nix::unistd::pipe().unwrap();
        c.put("v", b"x", &[w.as_fd()]).unwrap();
        assert_eq!(c.list().unwrap(), vec!["v".to_string()]);
        c.drop_entry("v").unwrap();
        drop(stop);
        t.join().unwrap().unwrap();
    }

    #[test]
    fn a_timeout_does_not_give_up_what_the_connection_owns() {
        let k = Running::start();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let other = k.client();
        other.put("b", b"x", &[w.as_fd()]).unwrap();
        let c = k.client();
        c.put("a", b"x", &[w.as_fd()]).unwrap();
        assert!(matches!(
            c.claim("b", Duration::from_millis(100)),
            Err(KeeperError::Timeout)
        ));
        // A new connection serves the next call; the timed-out one still owns "a".
        assert_eq!(c.list().unwrap().len(), 2);
        let successor = k.client();
        assert!(matches!(
            successor.claim("a", Duration::from_millis(300)),
            Err(KeeperError::Timeout)
        ));
        // Once the client is gone (with its pending claim gone too), "a" can be claimed.
        drop(successor);
        drop(c);
        let successor = k.client();
        assert!(successor.claim("a", Duration::from_secs(5)).is_ok());
    }

    #[test]
    fn put_get_passes_the_same_open_file() {
        let k = Running::start();
        let c = k.client();
        let (r, w) = nix::unistd::pipe().unwrap();
        c.put("vol1", b"{\"hello\":1}", &[w.as_fd()]).unwrap();
        drop(w);
        let e = k.client().get("vol1").unwrap();
        assert_eq!(e.blob, b"{\"hello\":1}");
        assert_eq!(e.fds.len(), 1);
        assert!(e.owner_alive);
        // A pipe's two ends share one inode.
        assert!(same_file(e.fds[0].as_fd(), r.as_fd()));
        // Writing through the fd we got back reaches the original pipe.
        nix::unistd::write(&e.fds[0], b"ping").unwrap();
        let mut got = [0u8; 4];
        File::from(r).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
        assert_eq!(c.list().unwrap(), vec!["vol1".to_string()]);
    }

    #[test]
    fn update_blob_and_drop_closes_fds() {
        let k = Running::start();
        let c = k.client();
        let (r, w) = nix::unistd::pipe().unwrap();
        c.put("a", b"v1", &[w.as_fd()]).unwrap();
        drop(w);
        c.update_blob("a", b"v2").unwrap();
        assert_eq!(c.get("a").unwrap().blob, b"v2");
        c.drop_entry("a").unwrap();
        // The keeper closed its write end and we hold none: the pipe reports EOF.
        let mut buf = Vec::new();
        File::from(r).read_to_end(&mut buf).unwrap();
        assert!(buf.is_empty());
        assert!(matches!(c.get("a"), Err(KeeperError::NotFound(_))));
        assert!(matches!(c.drop_entry("a"), Err(KeeperError::NotFound(_))));
        assert!(matches!(
            c.update_blob("a", b"x"),
            Err(KeeperError::NotFound(_))
        ));
    }

    #[test]
    fn big_blob_roundtrips() {
        let k = Running::start();
        let c = k.client();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let blob: Vec<u8> = (0..3 << 20).map(|i| (i * 7 % 251) as u8).collect();
        c.put("big", &blob, &[w.as_fd()]).unwrap();
        assert_eq!(k.client().get("big").unwrap().blob, blob);
    }

    #[test]
    fn claim_waits_for_the_owner_to_disconnect() {
        let k = Running::start();
        let owner = k.client();
        let (_r, w) = nix::unistd::pipe().unwrap();
        owner.put("v", b"state-1", &[w.as_fd()]).unwrap();

        // Another connection cannot take over or write while the owner lives.
        let other = k.client();
        assert!(matches!(
            other.put("v", b"x", &[w.as_fd()]),
            Err(KeeperError::Busy(_))
        ));
        assert!(matches!(
            other.update_blob("v", b"x"),
            Err(KeeperError::Busy(_))
        ));
        let short = k.client();
        assert!(matches!(
            short.claim("v", Duration::from_millis(200)),
            Err(KeeperError::Timeout)
        ));
        // The next call works on a new connection; dropping the client closes the timed-out
        // one too, which withdraws its pending claim.
        assert_eq!(short.list().unwrap(), vec!["v".to_string()]);
        drop(short);

        let path = k.path();
        let waiter = std::thread::spawn(move || {
            let c = KeeperClient::connect(&path).unwrap();
            let t0 = Instant::now();
            let e = c.claim("v", Duration::from_secs(10)).unwrap();
            (e.blob, t0.elapsed(), c)
        });
        std::thread::sleep(Duration::from_millis(300));
        owner.update_blob("v", b"state-final").unwrap();
        drop(owner); // the old daemon exits
        let (blob, waited, new_owner) = waiter.join().unwrap();
        assert_eq!(blob, b"state-final");
        assert!(
            waited >= Duration::from_millis(250),
            "claim returned early: {waited:?}"
        );
        // Now the new owner may write, and others are refused again.
        new_owner.update_blob("v", b"state-2").unwrap();
        assert!(matches!(
            other.update_blob("v", b"x"),
            Err(KeeperError::Busy(_))
        ));
        assert_eq!(other.get("v").unwrap().blob, b"state-2");
    }

    #[test]
    fn claim_of_unknown_and_dropped_entries() {
        let k = Running::start();
        let c = k.client();
        assert!(matches!(
            c.claim("nope", Duration::from_secs(1)),
            Err(KeeperError::NotFound(_))
        ));
        let (_r, w) = nix::unistd::pipe().unwrap();
        c.put("v", b"s", &[w.as_fd()]).unwrap();
        let path = k.path();
        let waiter = std::thread::spawn(move || {
            KeeperClient::connect(&path)
                .unwrap()
                .claim("v", Duration::from_secs(10))
        });
        std::thread::sleep(Duration::from_millis(200));
        c.drop_entry("v").unwrap();
        assert!(matches!(
            waiter.join().unwrap(),
            Err(KeeperError::NotFound(_))
        ));
    }

    #[test]
    fn bad_requests_are_rejected_and_keeper_survives() {
        let k = Running::start();
        let c = k.client();
        let (_r, w) = nix::unistd::pipe().unwrap();
        // No fds at all.
        assert!(matches!(
            c.put("v", b"s", &[]),
            Err(KeeperError::Rejected(_))
        ));
        assert!(matches!(
            c.put("", b"s", &[w.as_fd()]),
            Err(KeeperError::Rejected(_))
        ));
        let long = "x".repeat(MAX_ID_LEN + 1);
        assert!(matches!(c.get(&long), Err(KeeperError::Rejected(_))));

        // Raw garbage and an unsealed blob from a hand-made connection.
        let raw = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        connect(raw.as_raw_fd(), &UnixAddr::new(&k.path()).unwrap()).unwrap();
        send_msg(raw.as_fd(), b"not json", &[], MsgFlags::empty()).unwrap();
        let mut buf = vec![0u8; MAX_MSG];
        let (n, _) = recv_msg(raw.as_fd(), &mut buf, MsgFlags::empty())
            .unwrap()
            .unwrap();
        assert!(matches!(
            serde_json::from_slice(&buf[..n]).unwrap(),
            Response::Err {
                kind: ErrKind::Invalid,
                ..
            }
        ));
        let unsealed = memfd_create(c"x", MFdFlags::MFD_CLOEXEC).unwrap();
        send_msg(
            raw.as_fd(),
            br#"{"op":"put","id":"v"}"#,
            &[unsealed.as_raw_fd(), w.as_raw_fd()],
            MsgFlags::empty(),
        )
        .unwrap();
        let (n, _) = recv_msg(raw.as_fd(), &mut buf, MsgFlags::empty())
            .unwrap()
            .unwrap();
        assert!(matches!(
            serde_json::from_slice(&buf[..n]).unwrap(),
            Response::Err {
                kind: ErrKind::Invalid,
                ..
            }
        ));
        // A client that crashes mid-protocol (sends and vanishes) does not hurt the keeper.
        send_msg(raw.as_fd(), br#"{"op":"list"}"#, &[], MsgFlags::empty()).unwrap();
        drop(raw);
        c.put("v", b"ok", &[w.as_fd()]).unwrap();
        assert_eq!(c.list().unwrap(), vec!["v".to_string()]);
    }

    #[test]
    fn second_keeper_on_same_socket_is_refused() {
        let k = Running::start();
        let e = KeeperServer::bind(&k.path()).err().expect("must refuse");
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        // A stale socket file (no listener) is replaced.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("stale.sock");
        drop(KeeperServer::bind(&p).unwrap());
        assert!(p.exists());
        KeeperServer::bind(&p).unwrap();
    }

    #[test]
    fn keeper_exits_on_stop_only_when_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.sock");
        let server = KeeperServer::bind(&path).unwrap();
        let (stop_r, stop_w) = nix::unistd::pipe().unwrap();
        let t = std::thread::spawn(move || server.serve(stop_r.as_fd()));
        let c = KeeperClient::connect(&path).unwrap();
        let (_r, w) = nix::unistd::pipe().unwrap();
        c.put("v", b"s", &[w.as_fd()]).unwrap();
        drop(stop_w);
        std::thread::sleep(Duration::from_millis(200));
        assert!(!t.is_finished(), "keeper must not exit while holding fds");
        assert_eq!(c.get("v").unwrap().blob, b"s");
        c.drop_entry("v").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(t.is_finished());
        t.join().unwrap().unwrap();
    }
}
