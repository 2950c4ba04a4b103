//! The keeper process: [`KeeperServer`] holds the entries and serves requests on its socket
//! without ever blocking on a client; [`run`] is the `keeper` subcommand.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use nix::errno::Errno;
use nix::sys::socket::{
    accept4, bind, connect, getsockopt, listen, socket, sockopt, AddressFamily, Backlog, MsgFlags,
    SockFlag, SockType, UnixAddr,
};

use super::protocol::{
    check_sealed, poll_fds, recv_msg, send_msg, validate_id, ErrKind, Request, Response, MAX_MSG,
};
use super::MAX_FDS_PER_ENTRY;

const MAX_CONNS: usize = 1024;
const MAX_ENTRIES: usize = 4096;
/// Most notifier threads at once (a daemon refused one writes its invalidations itself).
const MAX_NOTIFIERS: usize = 512;

type ConnId = u64;

struct Entry {
    blob: OwnedFd,
    fds: Vec<OwnedFd>,
    owner: Option<ConnId>,
    /// The session's token (see [`Request::Put`]).
    token: Option<u64>,
    /// Connections waiting in `claim`, oldest first.
    waiters: VecDeque<ConnId>,
    /// The sockets of the notifier threads writing to `fds[0]` (gone once a thread ends).
    notifiers: Vec<Weak<OwnedFd>>,
}

impl Entry {
    /// Ends the entry's notifier threads: their `recv` sees EOF and they let go of the FUSE
    /// fd they hold (a thread waiting in the kernel ends once its write returns). Called
    /// when the entry goes: a daemon whose unmount was cut short (a timeout) would otherwise
    /// keep the threads, and the connection, alive until it exits.
    fn stop_notifiers(&self) {
        for sock in self.notifiers.iter().filter_map(Weak::upgrade) {
            let _ = nix::sys::socket::shutdown(sock.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        }
    }
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
    /// Notifier threads running.
    notifiers: Arc<AtomicUsize>,
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
            notifiers: Arc::new(AtomicUsize::new(0)),
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
            Request::Put { id, .. }
            | Request::UpdateBlob { id }
            | Request::Get { id }
            | Request::Claim { id }
            | Request::Notifier { id, .. }
            | Request::Drop { id, .. } => validate_id(id),
        };
        if let Err(m) = id_ok {
            return self.reply_err(cid, ErrKind::Invalid, m);
        }
        match req {
            Request::Put { id, token } => {
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
                        .map(|e| {
                            e.stop_notifiers();
                            e.waiters
                        })
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
                        token,
                        waiters,
                        notifiers: Vec::new(),
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
            Request::Notifier { id, token } => self.start_notifier(cid, id, token),
            Request::List => {
                let mut ids: Vec<String> = self.entries.keys().cloned().collect();
                ids.sort();
                self.reply(cid, &Response::Ids { ids }, &[]);
            }
            Request::Drop { id, token: Some(t) }
                if self
                    .entries
                    .get(&id)
                    .is_some_and(|e| e.token.is_some_and(|et| et != t)) =>
            {
                // a late drop of an earlier session (its unmount outlived a timeout, and the
                // volume was staged again meanwhile): the entry is another session's now
                tracing::info!(id = %id, conn = cid, "keeper: drop for an earlier session ignored");
                self.reply(cid, &Response::Ok, &[]);
            }
            Request::Drop { id, .. } => match self.entries.remove(&id) {
                None => self.reply_err(cid, ErrKind::NotFound, id),
                Some(e) => {
                    tracing::info!(id = %id, conn = cid, "keeper: drop (fds closed)");
                    e.stop_notifiers();
                    for w in e.waiters {
                        self.reply_err(w, ErrKind::NotFound, id.clone());
                    }
                    drop(e.fds);
                    self.reply(cid, &Response::Ok, &[]);
                }
            },
        }
    }

    /// Hands connection `cid` to a thread that writes the invalidations it sends to the
    /// FUSE connection of entry `id` (see [`super::notify`]).
    fn start_notifier(&mut self, cid: ConnId, id: String, token: Option<u64>) {
        let Some(e) = self.entries.get(&id) else {
            return self.reply_err(cid, ErrKind::NotFound, id);
        };
        // a session named by a token is only ever written for by that session
        if e.token.is_some() && token != e.token {
            return self.reply_err(
                cid,
                ErrKind::Invalid,
                format!("{id} is another session now"),
            );
        }
        // the connection leaves the poll set: one that owns or waits for entries must stay
        if self
            .entries
            .values()
            .any(|e| e.owner == Some(cid) || e.waiters.contains(&cid))
        {
            let m = "a connection that owns or claims entries cannot be a notifier".into();
            return self.reply_err(cid, ErrKind::Invalid, m);
        }
        if self.notifiers.load(Ordering::SeqCst) >= MAX_NOTIFIERS {
            return self.reply_err(cid, ErrKind::Invalid, "too many notifiers".into());
        }
        let fuse = match e.fds.first().map(|f| f.try_clone()) {
            Some(Ok(f)) => f,
            Some(Err(err)) => {
                return self.reply_err(cid, ErrKind::Invalid, format!("dup: {err}"));
            }
            None => return self.reply_err(cid, ErrKind::Invalid, "entry has no fd".into()),
        };
        self.reply(cid, &Response::Ok, &[]);
        if self.to_close.contains(&cid) {
            return;
        }
        let Some(sock) = self.conns.remove(&cid) else {
            return;
        };
        let sock = Arc::new(sock);
        if let Some(e) = self.entries.get_mut(&id) {
            e.notifiers.retain(|n| n.strong_count() > 0);
            e.notifiers.push(Arc::downgrade(&sock));
        }
        let count = self.notifiers.clone();
        count.fetch_add(1, Ordering::SeqCst);
        tracing::info!(id = %id, conn = cid, "keeper: notifier started");
        let spawned = std::thread::Builder::new()
            .name("keeper-notify".into())
            .spawn(move || {
                super::notify::serve(sock, fuse);
                count.fetch_sub(1, Ordering::SeqCst);
                tracing::debug!(id = %id, conn = cid, "keeper: notifier ended");
            });
        if let Err(err) = spawned {
            // the closure (and the connection in it) is gone: the daemon sees EOF and writes
            // its invalidations itself
            self.notifiers.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(conn = cid, error = %err, "keeper: cannot start a notifier thread");
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
