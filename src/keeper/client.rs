//! [`KeeperClient`], the blocking client a daemon keeps for its whole life: one bounded
//! round trip per call, reconnecting after I/O errors.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{
    connect, socket, sockopt, AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr,
};
use parking_lot::Mutex;

use super::protocol::{
    blob_to_memfd, poll_fds, read_blob, recv_msg, send_msg, ErrKind, Request, Response, MAX_MSG,
};
use super::KeeperError;

/// Default bound for a keeper round trip (claims have their own).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

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

pub(super) fn open_conn(path: &Path) -> Result<OwnedFd, KeeperError> {
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

    /// The keeper's socket.
    pub fn path(&self) -> &Path {
        &self.path
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
        self.put_session(id, None, blob, fds)
    }

    /// [`Self::put`] for the session named `token`: only a drop with that token (or none)
    /// removes the entry (see [`Self::drop_session`]).
    pub fn put_session(
        &self,
        id: &str,
        token: Option<u64>,
        blob: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), KeeperError> {
        let memfd = blob_to_memfd(blob)?;
        let raw: Vec<RawFd> = std::iter::once(memfd.as_raw_fd())
            .chain(fds.iter().map(|f| f.as_raw_fd()))
            .collect();
        let req = Request::Put {
            id: id.into(),
            token,
        };
        let (resp, _) = self.call(&req, &raw, self.timeout)?;
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
        self.drop_session(id, None)
    }

    /// Forgets `id` if it is still the session named `token` (a late drop of an earlier
    /// session of the volume leaves a newer one alone).
    pub fn drop_session(&self, id: &str, token: Option<u64>) -> Result<(), KeeperError> {
        let req = Request::Drop {
            id: id.into(),
            token,
        };
        let (resp, _) = self.call(&req, &[], self.timeout)?;
        Self::expect_ok(resp)
    }
}
