//! Kernel cache invalidations written by helper processes instead of the plugin's threads.
//!
//! An entry invalidation waits, uninterruptibly, for the directory's lock, and a page
//! invalidation for locked pages; a request in flight to us may hold either. A thread of ours
//! stuck there keeps a SIGKILLed plugin from exiting: its fds stay open, the keeper never sees
//! it go, no successor adopts the session, and nobody answers the request. The mount hangs
//! for good. A helper stuck there instead lets the plugin exit; its successor answers the
//! request (resent), which frees the lock, and the helper then exits (its socket is closed).
//!
//! Only for sessions the keeper holds: without one, the fd a stuck helper holds would keep a
//! dead daemon's connection from aborting.
//!
//! A helper is this binary run as `HELPER_ARG` with the socket on fd 3 and the FUSE fd on
//! fd 4: it writes each message it receives to the FUSE fd and answers with the result.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::fs::Notifier;

/// The first argument that makes the binary a helper (before any flag parsing).
pub const HELPER_ARG: &str = "__fuse-notify-helper";
/// Helpers per session: a notification waiting on one directory does not hold up the rest.
pub const HELPERS: usize = 2;

const FUSE_NOTIFY_INVAL_INODE: i32 = 2;
const FUSE_NOTIFY_INVAL_ENTRY: i32 = 3;
/// The kernel's limit on a name in a notification.
const NAME_MAX: usize = 1024;
/// Largest message: out header, entry header, a name at the limit and its NUL.
const MSG_MAX: usize = 16 + 16 + NAME_MAX + 1;
const SOCK_FD: RawFd = 3;
const FUSE_FD: RawFd = 4;

/// A FUSE_NOTIFY_INVAL_ENTRY message (fuse_out_header + fuse_notify_inval_entry_out + name).
pub fn inval_entry_msg(parent: u64, name: &[u8]) -> io::Result<Vec<u8>> {
    if name.len() > NAME_MAX {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    let len = 16 + 16 + name.len() + 1;
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

/// A FUSE_NOTIFY_INVAL_INODE message: `off` < 0 drops attributes only, else pages from
/// `off` for `len` bytes (0: to the end) too.
pub fn inval_inode_msg(ino: u64, off: i64, len: i64) -> Vec<u8> {
    let mut m = Vec::with_capacity(40);
    m.extend_from_slice(&40u32.to_ne_bytes());
    m.extend_from_slice(&FUSE_NOTIFY_INVAL_INODE.to_ne_bytes());
    m.extend_from_slice(&0u64.to_ne_bytes());
    m.extend_from_slice(&ino.to_ne_bytes());
    m.extend_from_slice(&off.to_ne_bytes());
    m.extend_from_slice(&len.to_ne_bytes());
    m
}

struct Helper {
    /// Held for one message and its answer.
    sock: Mutex<OwnedFd>,
    child: Mutex<Option<Child>>,
    dead: AtomicBool,
}

/// Helper processes writing one session's notifications (see the module docs).
pub struct NotifyProxy {
    helpers: Vec<Helper>,
    next: AtomicUsize,
}

impl NotifyProxy {
    /// Starts `n` helpers writing to `fuse`.
    pub fn spawn(fuse: BorrowedFd<'_>, n: usize) -> io::Result<NotifyProxy> {
        let helpers = (0..n.max(1))
            .map(|_| spawn_helper(fuse))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(NotifyProxy {
            helpers,
            next: AtomicUsize::new(0),
        })
    }

    /// The helpers' process ids.
    pub fn pids(&self) -> Vec<u32> {
        self.helpers
            .iter()
            .filter_map(|h| h.child.lock().as_ref().map(|c| c.id()))
            .collect()
    }

    /// Has a helper write `msg` and waits for the kernel's answer. Err(None): no helper is
    /// left (the caller writes it itself); Err(Some(e)): the kernel refused it.
    pub fn send(&self, msg: &[u8]) -> Result<(), Option<io::Error>> {
        let n = self.helpers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let live = |i: &usize| !self.helpers[i % n].dead.load(Ordering::Relaxed);
        // an idle helper first; else wait for one
        let order: Vec<usize> = (start..start + n).filter(live).collect();
        let Some(&first) = order.first() else {
            return Err(None);
        };
        let mut picked = None;
        for &i in &order {
            if let Some(g) = self.helpers[i % n].sock.try_lock() {
                picked = Some((i % n, g));
                break;
            }
        }
        let (i, sock) = match picked {
            Some(p) => p,
            None => (first % n, self.helpers[first % n].sock.lock()),
        };
        match exchange(sock.as_fd(), msg) {
            Ok(0) => Ok(()),
            Ok(e) => Err(Some(io::Error::from_raw_os_error(e))),
            Err(e) => {
                tracing::warn!(error = %e, helper = i, "notification helper gone; writing notifications directly");
                self.helpers[i].dead.store(true, Ordering::Relaxed);
                drop(sock);
                self.send(msg)
            }
        }
    }
}

impl Drop for NotifyProxy {
    fn drop(&mut self) {
        let children: Vec<Child> = self
            .helpers
            .drain(..)
            .filter_map(|h| h.child.lock().take())
            .collect();
        // the sockets are closed now, so each helper exits once it is not stuck in the kernel
        if !children.is_empty() {
            let _ = std::thread::Builder::new()
                .name("notify-reaper".into())
                .spawn(move || {
                    for mut c in children {
                        let _ = c.wait();
                    }
                });
        }
    }
}

/// Sends `msg`, returns the helper's answer (0 or an errno).
fn exchange(sock: BorrowedFd<'_>, msg: &[u8]) -> io::Result<i32> {
    let raw = sock.as_raw_fd();
    // SAFETY: valid fd and buffer; MSG_NOSIGNAL: a gone helper is EPIPE, not SIGPIPE.
    let sent = unsafe { libc::send(raw, msg.as_ptr().cast(), msg.len(), libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut ans = [0u8; 4];
    loop {
        // SAFETY: valid fd and buffer.
        let n = unsafe { libc::recv(raw, ans.as_mut_ptr().cast(), ans.len(), 0) };
        if n == 4 {
            return Ok(i32::from_ne_bytes(ans));
        }
        if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return Err(if n < 0 {
            io::Error::last_os_error()
        } else {
            io::Error::new(io::ErrorKind::UnexpectedEof, "helper closed its socket")
        });
    }
}

fn cloexec_dup_high(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // above 4, so that placing them on 3 and 4 in the child cannot overwrite one another
    // SAFETY: F_DUPFD_CLOEXEC on a valid fd returns a new fd we own.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 10) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just created.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

fn spawn_helper(fuse: BorrowedFd<'_>) -> io::Result<Helper> {
    let (ours, theirs) = nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::SeqPacket,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let theirs = cloexec_dup_high(theirs.as_fd())?;
    let fuse = cloexec_dup_high(fuse)?;
    let (s, f) = (theirs.as_raw_fd(), fuse.as_raw_fd());
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg(HELPER_ARG)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // SAFETY: only dup2 (async-signal-safe) between fork and exec; dup2 clears FD_CLOEXEC on
    // the copies, the originals close at exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(s, SOCK_FD) < 0 || libc::dup2(f, FUSE_FD) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    drop((theirs, fuse));
    Ok(Helper {
        sock: Mutex::new(ours),
        child: Mutex::new(Some(child)),
        dead: AtomicBool::new(false),
    })
}

/// The helper process: call first thing in `main`; returns only if this process is not one.
pub fn run_helper_if_asked() {
    if std::env::args_os().nth(1).as_deref() != Some(std::ffi::OsStr::new(HELPER_ARG)) {
        return;
    }
    // nothing else of the parent's may stay open here (the keeper watches for its fds)
    // SAFETY: closes fds this fresh process does not use.
    unsafe {
        libc::syscall(libc::SYS_close_range, FUSE_FD as u32 + 1, u32::MAX, 0);
        // only EOF on the socket (its plugin is gone) or SIGKILL ends a helper
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGPIPE] {
            libc::signal(sig, libc::SIG_IGN);
        }
    }
    // SAFETY: the spawner placed them there.
    let (sock, fuse) = unsafe { (OwnedFd::from_raw_fd(SOCK_FD), OwnedFd::from_raw_fd(FUSE_FD)) };
    serve(sock.as_fd(), fuse.as_fd());
    std::process::exit(0);
}

/// Writes each message from `sock` to `fuse` and answers with 0 or the errno, until EOF.
pub fn serve(sock: BorrowedFd<'_>, fuse: BorrowedFd<'_>) {
    let mut buf = vec![0u8; MSG_MAX];
    loop {
        // SAFETY: valid fd and buffer.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n == 0 {
            return;
        }
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return;
        }
        // SAFETY: valid fd and the n bytes received.
        let w = unsafe { libc::write(fuse.as_raw_fd(), buf.as_ptr().cast(), n as usize) };
        let ans: i32 = if w < 0 {
            io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        } else {
            0
        };
        // SAFETY: valid fd and buffer.
        let sent = unsafe {
            libc::send(
                sock.as_raw_fd(),
                ans.to_ne_bytes().as_ptr().cast(),
                4,
                libc::MSG_NOSIGNAL,
            )
        };
        if sent < 0 {
            return;
        }
    }
}

/// [`crate::fs::Notifier`] through a [`NotifyProxy`], writing directly (fuser's notifier)
/// once no helper is left.
pub struct ProxyNotifier {
    pub proxy: NotifyProxy,
    pub direct: super::adapter::KernelNotifier,
}

impl ProxyNotifier {
    fn pass(&self, msg: io::Result<Vec<u8>>, direct: impl FnOnce(&super::adapter::KernelNotifier)) {
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "notification not sent");
                return;
            }
        };
        match self.proxy.send(&msg) {
            // ENOENT: the kernel does not know the node (nothing cached to drop)
            Ok(()) | Err(Some(_)) => {}
            Err(None) => direct(&self.direct),
        }
    }
}

impl Notifier for ProxyNotifier {
    fn inval_entry(&self, parent: u64, name: &str) {
        self.pass(inval_entry_msg(parent, name.as_bytes()), |d| {
            d.inval_entry(parent, name)
        });
    }
    fn inval_inode(&self, ino: u64) {
        self.pass(Ok(inval_inode_msg(ino, 0, -1)), |d| d.inval_inode(ino));
    }
    fn inval_attr(&self, ino: u64) {
        self.pass(Ok(inval_inode_msg(ino, -1, 0)), |d| d.inval_attr(ino));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_have_the_kernel_layout() {
        let m = inval_entry_msg(7, b"ab").unwrap();
        assert_eq!(m.len(), 16 + 16 + 3);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 35);
        assert_eq!(i32::from_ne_bytes(m[4..8].try_into().unwrap()), 3);
        assert_eq!(u64::from_ne_bytes(m[8..16].try_into().unwrap()), 0);
        assert_eq!(u64::from_ne_bytes(m[16..24].try_into().unwrap()), 7);
        assert_eq!(u32::from_ne_bytes(m[24..28].try_into().unwrap()), 2);
        assert_eq!(&m[32..], b"ab\0");
        let m = inval_inode_msg(9, -1, 0);
        assert_eq!(m.len(), 40);
        assert_eq!(i32::from_ne_bytes(m[4..8].try_into().unwrap()), 2);
        assert_eq!(i64::from_ne_bytes(m[24..32].try_into().unwrap()), -1);
        assert!(inval_entry_msg(1, &[b'a'; NAME_MAX + 1]).is_err());
    }

    #[test]
    fn serve_writes_each_message_whole_and_answers_the_errno() {
        let (ours, theirs) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        let t = std::thread::spawn(move || serve(theirs.as_fd(), w.as_fd()));
        let m = inval_entry_msg(1, b"name").unwrap();
        assert_eq!(exchange(ours.as_fd(), &m).unwrap(), 0);
        let mut got = vec![0u8; m.len()];
        nix::unistd::read(&r, &mut got).unwrap();
        assert_eq!(got, m);
        // a write the "kernel" refuses: its errno comes back
        drop(r);
        assert_eq!(exchange(ours.as_fd(), &m).unwrap(), libc::EPIPE);
        drop(ours);
        t.join().unwrap();
    }
}
