//! Kernel cache invalidations written by the keeper's threads on a daemon's behalf.
//!
//! An entry invalidation waits, uninterruptibly, for its directory's lock, and a page
//! invalidation for locked pages; a request in flight to the daemon may hold either. A daemon
//! thread stuck there keeps a SIGKILLed daemon from exiting: its keeper connection never
//! closes, no successor is granted the claim, nobody answers the request, and the mount hangs
//! for good. So a kept session hands its notifications to the keeper, which already holds the
//! connection's fd and outlives the daemon: a keeper thread waits in the kernel instead, the
//! daemon (waiting in `recv`, which a signal ends) can exit, its successor answers the resent
//! request, and the keeper's write then completes.
//!
//! A connection becomes a notifier with `notifier{id, token}` (answered `ok`); from then on
//! each message on it is one raw notification (`fuse_out_header` with `unique` 0 and the
//! notify code in `error`, then its body) and each answer 4 bytes: 0 or the errno of the
//! write. The keeper only passes on the invalidations [`check`] accepts, never a reply to a
//! request. The thread ends when the daemon closes the connection.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::socket::MsgFlags;

use parking_lot::Mutex;

use super::protocol::{poll_fds, recv_msg, send_msg, ErrKind, Request, Response, MAX_MSG};
use super::KeeperError;

const FUSE_NOTIFY_INVAL_INODE: i32 = 2;
const FUSE_NOTIFY_INVAL_ENTRY: i32 = 3;
/// ABI 7.45, Linux 6.18+.
const FUSE_NOTIFY_PRUNE: i32 = 9;
const OUT_HEADER: usize = 16;
/// The kernel's limit on a name in a notification (FUSE_NAME_MAX).
pub const NAME_MAX: usize = 1024;
/// Largest notification: the header, the entry body, a name at the limit and its NUL.
pub const MSG_MAX: usize = OUT_HEADER + 16 + NAME_MAX + 1;
/// Node ids per FUSE_NOTIFY_PRUNE message: the message fits in [`MSG_MAX`], so a keeper
/// receives it whole.
pub const PRUNE_IDS_MAX: usize = (MSG_MAX - OUT_HEADER - 16) / 8;
/// Most connections per session: one is opened per invalidation in progress, so one that
/// waits in the kernel does not hold up the others; past this many the daemon writes an
/// invalidation itself.
pub const MAX_CONNS_PER_SESSION: usize = 8;

/// A FUSE_NOTIFY_INVAL_ENTRY message (`fuse_out_header`, `fuse_notify_inval_entry_out`,
/// the name and its NUL).
pub fn inval_entry_msg(parent: u64, name: &[u8]) -> io::Result<Vec<u8>> {
    if name.len() > NAME_MAX || name.contains(&0) {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    let len = OUT_HEADER + 16 + name.len() + 1;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&FUSE_NOTIFY_INVAL_ENTRY.to_ne_bytes());
    m.extend_from_slice(&0u64.to_ne_bytes());
    m.extend_from_slice(&parent.to_ne_bytes());
    m.extend_from_slice(&(name.len() as u32).to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(name);
    m.push(0);
    Ok(m)
}

/// A FUSE_NOTIFY_INVAL_INODE message: `off` < 0 drops the attributes only, otherwise the
/// pages from `off` for `len` bytes (0 or less: to the end) too.
pub fn inval_inode_msg(ino: u64, off: i64, len: i64) -> Vec<u8> {
    let mut m = Vec::with_capacity(OUT_HEADER + 24);
    m.extend_from_slice(&((OUT_HEADER + 24) as u32).to_ne_bytes());
    m.extend_from_slice(&FUSE_NOTIFY_INVAL_INODE.to_ne_bytes());
    m.extend_from_slice(&0u64.to_ne_bytes());
    m.extend_from_slice(&ino.to_ne_bytes());
    m.extend_from_slice(&off.to_ne_bytes());
    m.extend_from_slice(&len.to_ne_bytes());
    m
}

/// Sends `inos` as prune messages of at most [`PRUNE_IDS_MAX`] ids each, in order, until
/// `send` says one failed; returns how many ids went out (a prefix of `inos`).
pub fn prune_in_batches(inos: &[u64], mut send: impl FnMut(&[u8]) -> bool) -> usize {
    let mut sent = 0;
    for batch in inos.chunks(PRUNE_IDS_MAX) {
        if !send(&prune_msg(batch)) {
            break;
        }
        sent += batch.len();
    }
    sent
}

/// A FUSE_NOTIFY_PRUNE message (`fuse_out_header`, `fuse_notify_prune_out`: count, padding,
/// spare; then the node ids): the kernel drops the unused dentries of each node it has, and
/// an inode whose last one goes comes back as a FORGET. At most [`PRUNE_IDS_MAX`] ids.
pub fn prune_msg(inos: &[u64]) -> Vec<u8> {
    debug_assert!(inos.len() <= PRUNE_IDS_MAX);
    let len = OUT_HEADER + 16 + 8 * inos.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&FUSE_NOTIFY_PRUNE.to_ne_bytes());
    m.extend_from_slice(&0u64.to_ne_bytes());
    m.extend_from_slice(&(inos.len() as u32).to_ne_bytes());
    m.extend_from_slice(&[0u8; 12]);
    for ino in inos {
        m.extend_from_slice(&ino.to_ne_bytes());
    }
    m
}

fn u32_at(m: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(m[at..at + 4].try_into().expect("4 bytes"))
}

/// Whether `m` is one well-formed invalidation (the only thing the keeper writes for a
/// daemon); `Err(EINVAL)` otherwise.
pub(super) fn check(m: &[u8]) -> Result<(), i32> {
    if m.len() < OUT_HEADER || u32_at(m, 0) as usize != m.len() || m[8..16] != [0; 8] {
        return Err(libc::EINVAL);
    }
    let ok = match u32_at(m, 4) as i32 {
        FUSE_NOTIFY_INVAL_INODE => m.len() == OUT_HEADER + 24,
        FUSE_NOTIFY_PRUNE => {
            let body = OUT_HEADER + 16;
            m.len() > body && {
                let n = u32_at(m, OUT_HEADER) as usize;
                n <= PRUNE_IDS_MAX && m.len() == body + 8 * n
            }
        }
        FUSE_NOTIFY_INVAL_ENTRY => {
            let body = OUT_HEADER + 16;
            m.len() > body
                && u32_at(m, OUT_HEADER + 8) as usize == m.len() - body - 1
                && m.len() - body - 1 <= NAME_MAX
                && m[m.len() - 1] == 0
        }
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(libc::EINVAL)
    }
}

/// The keeper's notifier thread: writes each message from `sock` to `fuse` and answers with
/// 0 or the errno, until the daemon closes `sock`.
pub(super) fn serve(sock: Arc<OwnedFd>, fuse: OwnedFd) {
    // the keeper accepted it non-blocking; this thread waits on it
    let raw = sock.as_raw_fd();
    // SAFETY: fcntl on a valid fd we own.
    unsafe {
        let fl = libc::fcntl(raw, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(raw, libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
    let mut buf = vec![0u8; MSG_MAX];
    loop {
        let n = match recv_msg(sock.as_fd(), &mut buf, MsgFlags::empty()) {
            Ok(Some((n, _fds))) => n,
            Ok(None) => return,
            Err(nix::errno::Errno::EINTR) => continue,
            // a message larger than any notification, or a broken connection
            Err(_) => return,
        };
        let ans = match check(&buf[..n]) {
            Err(e) => e,
            // SAFETY: valid fd and the n bytes received.
            Ok(()) => match unsafe { libc::write(fuse.as_raw_fd(), buf.as_ptr().cast(), n) } {
                w if w < 0 => io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO),
                _ => 0,
            },
        };
        if send_msg(sock.as_fd(), &ans.to_ne_bytes(), &[], MsgFlags::empty()).is_err() {
            return;
        }
    }
}

/// One of a daemon's notifier connections.
struct Conn {
    sock: OwnedFd,
    /// Taken for one message and its answer.
    busy: AtomicBool,
    dead: AtomicBool,
}

/// A connection taken for one message (given back when dropped).
struct Taken(Arc<Conn>);

impl Drop for Taken {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::SeqCst);
    }
}

/// A daemon's side: the keeper connections that write one session's invalidations.
pub struct KeeperNotifier {
    path: PathBuf,
    id: String,
    token: Option<u64>,
    conns: Mutex<Conns>,
    /// Connections asked of the keeper (for tests).
    opens: AtomicUsize,
}

struct Conns {
    live: Vec<Arc<Conn>>,
    /// After the keeper refused or could not be reached: no new connection asked for
    /// before then (each attempt is a round trip, on every invalidation).
    retry_at: Option<Instant>,
    /// Connections being asked for now (counted against the limit; asked outside the lock,
    /// so a slow keeper never holds up callers that find an idle connection).
    opening: usize,
}

/// How long a refused or failed connection attempt is remembered.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Longest wait for the keeper to accept a notifier connection.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);

impl KeeperNotifier {
    /// Opens a first notifier connection for the session `id` (named `token`). A keeper of
    /// an older version refuses (`Rejected`): the caller writes invalidations itself then.
    pub fn open(path: &Path, id: &str, token: Option<u64>) -> Result<Self, KeeperError> {
        let first = open_one(path, id, token)?;
        Ok(KeeperNotifier {
            path: path.to_path_buf(),
            id: id.to_string(),
            token,
            conns: Mutex::new(Conns {
                live: vec![Arc::new(first)],
                retry_at: None,
                opening: 0,
            }),
            opens: AtomicUsize::new(1),
        })
    }

    /// Live connections (each is a keeper thread).
    pub fn connections(&self) -> usize {
        self.conns.lock().live.len()
    }

    /// Connections asked of the keeper so far, the first one included.
    pub fn attempts(&self) -> usize {
        self.opens.load(Ordering::SeqCst)
    }

    /// An idle connection, else a new one (up to [`MAX_CONNS_PER_SESSION`]). Never waits
    /// for a busy one: an invalidation can wait in the kernel for a request whose handler
    /// is the very caller that would wait here.
    fn take(&self) -> Option<Taken> {
        {
            let mut conns = self.conns.lock();
            conns.live.retain(|c| !c.dead.load(Ordering::SeqCst));
            let idle = conns.live.iter().find(|c| {
                c.busy
                    .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            });
            if let Some(c) = idle {
                return Some(Taken(c.clone()));
            }
            if conns.live.len() + conns.opening >= MAX_CONNS_PER_SESSION
                || conns.retry_at.is_some_and(|t| Instant::now() < t)
            {
                return None;
            }
            conns.opening += 1;
        }
        self.opens.fetch_add(1, Ordering::SeqCst);
        let opened = open_one(&self.path, &self.id, self.token);
        let mut conns = self.conns.lock();
        conns.opening -= 1;
        match opened {
            Ok(c) => {
                c.busy.store(true, Ordering::SeqCst);
                let c = Arc::new(c);
                conns.live.push(c.clone());
                conns.retry_at = None;
                Some(Taken(c))
            }
            Err(e) => {
                tracing::debug!(error = %e, "no further fd-keeper notifier connection");
                conns.retry_at = Some(Instant::now() + RETRY_AFTER);
                None
            }
        }
    }

    /// Has the keeper write `msg` and waits for the kernel's answer (as long as the kernel
    /// takes: only a signal ends the wait, and the keeper's write goes on after one).
    /// `Err(None)`: no connection could take it (the caller writes it itself);
    /// `Err(Some(e))`: the kernel refused it.
    pub fn send(&self, msg: &[u8]) -> Result<(), Option<io::Error>> {
        loop {
            let Some(taken) = self.take() else {
                return Err(None);
            };
            match exchange(taken.0.sock.as_fd(), msg) {
                Ok(0) => return Ok(()),
                Ok(e) => return Err(Some(io::Error::from_raw_os_error(e))),
                Err(e) => {
                    tracing::warn!(error = %e, "fd-keeper notifier connection lost");
                    taken.0.dead.store(true, Ordering::SeqCst);
                }
            }
        }
    }
}

/// One notifier connection, accepted by the keeper.
fn open_one(path: &Path, id: &str, token: Option<u64>) -> Result<Conn, KeeperError> {
    let req = serde_json::to_vec(&Request::Notifier {
        id: id.into(),
        token,
    })
    .expect("requests always serialize");
    let fd = super::client::open_conn(path)?;
    send_msg(fd.as_fd(), &req, &[], MsgFlags::empty())?;
    let ready = poll_fds(
        &[(Some(fd.as_fd()), libc::POLLIN)],
        OPEN_TIMEOUT.as_millis() as i32,
    )?;
    if ready[0] == 0 {
        return Err(KeeperError::Timeout);
    }
    let mut buf = vec![0u8; MAX_MSG];
    let Some((len, _)) = recv_msg(fd.as_fd(), &mut buf, MsgFlags::MSG_DONTWAIT)? else {
        return Err(KeeperError::Io(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "keeper closed the connection",
        )));
    };
    match serde_json::from_slice(&buf[..len]) {
        Ok(Response::Ok) => Ok(Conn {
            sock: fd,
            busy: AtomicBool::new(false),
            dead: AtomicBool::new(false),
        }),
        Ok(Response::Err {
            kind: ErrKind::NotFound,
            message,
        }) => Err(KeeperError::NotFound(message)),
        Ok(Response::Err { message, .. }) => Err(KeeperError::Rejected(message)),
        Ok(other) => Err(KeeperError::Protocol(format!(
            "unexpected answer {other:?}"
        ))),
        Err(e) => Err(KeeperError::Protocol(format!("bad answer: {e}"))),
    }
}

/// Sends `msg`, returns the keeper's answer (0 or an errno).
fn exchange(sock: BorrowedFd<'_>, msg: &[u8]) -> io::Result<i32> {
    send_msg(sock, msg, &[], MsgFlags::empty())?;
    let mut ans = [0u8; 4];
    loop {
        match recv_msg(sock, &mut ans, MsgFlags::empty()) {
            Ok(Some((4, _))) => return Ok(i32::from_ne_bytes(ans)),
            Ok(Some(_)) => return Err(io::Error::other("short answer from the fd-keeper")),
            Ok(None) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "fd-keeper closed the notifier connection",
                ))
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_have_the_kernel_layout_and_pass_the_check() {
        let m = inval_entry_msg(7, b"ab").unwrap();
        assert_eq!(m.len(), 16 + 16 + 3);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 35);
        assert_eq!(i32::from_ne_bytes(m[4..8].try_into().unwrap()), 3);
        assert_eq!(u64::from_ne_bytes(m[8..16].try_into().unwrap()), 0);
        assert_eq!(u64::from_ne_bytes(m[16..24].try_into().unwrap()), 7);
        assert_eq!(u32::from_ne_bytes(m[24..28].try_into().unwrap()), 2);
        assert_eq!(&m[32..], b"ab\0");
        assert_eq!(check(&m), Ok(()));
        let m = inval_inode_msg(9, -1, 0);
        assert_eq!(m.len(), 40);
        assert_eq!(i32::from_ne_bytes(m[4..8].try_into().unwrap()), 2);
        assert_eq!(i64::from_ne_bytes(m[24..32].try_into().unwrap()), -1);
        assert_eq!(check(&m), Ok(()));
        assert!(inval_entry_msg(1, &[b'a'; NAME_MAX + 1]).is_err());
        assert!(inval_entry_msg(1, b"a\0b").is_err());
        assert_eq!(
            check(&inval_entry_msg(1, &[b'a'; NAME_MAX]).unwrap()),
            Ok(())
        );
    }

    #[test]
    fn the_check_refuses_anything_but_an_invalidation() {
        let good = inval_entry_msg(1, b"name").unwrap();
        // a reply to a request (unique != 0)
        let mut m = good.clone();
        m[8] = 1;
        assert_eq!(check(&m), Err(libc::EINVAL));
        // another notify code (store, retrieve, delete, resend)
        for code in [1i32, 4, 5, 6, 7, -2] {
            let mut m = good.clone();
            m[4..8].copy_from_slice(&code.to_ne_bytes());
            assert_eq!(check(&m), Err(libc::EINVAL), "code {code}");
        }
        // a length field that lies, a name length that lies, no NUL, too short
        let mut m = good.clone();
        m[0] += 1;
        assert_eq!(check(&m), Err(libc::EINVAL));
        let mut m = good.clone();
        m[24] += 1;
        assert_eq!(check(&m), Err(libc::EINVAL));
        let mut m = good.clone();
        *m.last_mut().unwrap() = b'x';
        assert_eq!(check(&m), Err(libc::EINVAL));
        assert_eq!(check(&good[..10]), Err(libc::EINVAL));
        let mut m = inval_inode_msg(1, 0, 0);
        m.push(0);
        m[0] += 1;
        assert_eq!(check(&m), Err(libc::EINVAL));
    }
}
