//! Tests of the keeper as a whole: a real [`KeeperServer`] on a temporary socket, driven by
//! [`KeeperClient`]s and by hand-made connections.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::socket::{connect, socket, AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr};

use super::protocol::{recv_msg, send_msg, ErrKind, Response, MAX_ID_LEN, MAX_MSG};
use super::{KeeperClient, KeeperError, KeeperServer, RECONNECT_BUDGET};

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

/// Found in review: an unstage that outlived its timeout dropped the entry after the volume
/// was staged again (same connection, same id), so the next plugin restart could not adopt
/// the new session. A drop names its session now.
#[test]
fn a_late_drop_of_an_earlier_session_leaves_the_new_one() {
    let k = Running::start();
    let (_r, w) = nix::unistd::pipe().unwrap();
    let c = k.client();
    c.put_session("v", Some(1), b"first", &[w.as_fd()]).unwrap();
    c.put_session("v", Some(2), b"second", &[w.as_fd()])
        .unwrap();
    c.drop_session("v", Some(1)).unwrap();
    assert_eq!(c.get("v").unwrap().blob, b"second");
    c.drop_session("v", Some(2)).unwrap();
    assert!(c.list().unwrap().is_empty());
    // a client without tokens (an older version) drops as before
    c.put("u", b"x", &[w.as_fd()]).unwrap();
    c.drop_session("u", Some(9)).unwrap();
    assert!(c.list().unwrap().is_empty());
}

#[test]
fn a_notifier_writes_checked_invalidations_to_the_entrys_fd_and_lets_it_go() {
    use super::notify::{inval_entry_msg, inval_inode_msg, prune_msg, PRUNE_IDS_MAX};
    use super::KeeperNotifier;
    let k = Running::start();
    let c = k.client();
    let (r, w) = nix::unistd::pipe().unwrap();
    c.put_session("v", Some(7), b"{}", &[w.as_fd()]).unwrap();
    drop(w);
    // unknown entry, another session's token, the owner's own connection: refused
    assert!(matches!(
        KeeperNotifier::open(&k.path(), "nope", None),
        Err(KeeperError::NotFound(_))
    ));
    assert!(matches!(
        KeeperNotifier::open(&k.path(), "v", Some(8)),
        Err(KeeperError::Rejected(_))
    ));
    // nor can a caller that names no session write for one that has a token
    assert!(matches!(
        KeeperNotifier::open(&k.path(), "v", None),
        Err(KeeperError::Rejected(_))
    ));
    let n = KeeperNotifier::open(&k.path(), "v", Some(7)).unwrap();
    let mut pipe = File::from(r);
    let most: Vec<u64> = (2..2 + PRUNE_IDS_MAX as u64).collect();
    for m in [
        inval_entry_msg(1, b"name").unwrap(),
        inval_inode_msg(5, -1, 0),
        prune_msg(&[5, 6]),
        prune_msg(&most),
    ] {
        n.send(&m).unwrap();
        let mut got = vec![0u8; m.len()];
        pipe.read_exact(&mut got).unwrap();
        assert_eq!(got, m);
    }
    // anything but an invalidation (here a reply to request 1) is refused, not written
    let mut reply = inval_inode_msg(5, -1, 0);
    reply[8] = 1;
    let e = n.send(&reply).unwrap_err().unwrap();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    // as is a prune whose count does not match its ids
    let mut bad = prune_msg(&[5, 6]);
    bad[16] = 3;
    let e = n.send(&bad).unwrap_err().unwrap();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    // the keeper still owns nothing on behalf of the notifier: the owner stays the owner
    assert!(k.client().get("v").unwrap().owner_alive);
    // the session ends, even while the daemon still holds its notifier (an unmount cut
    // short): the entry and the notifier threads let go of the fd (EOF)
    c.drop_entry("v").unwrap();
    assert_eof_within(&pipe, Duration::from_secs(10));
    // and the daemon, told so, writes its invalidations itself, without asking the keeper
    // again on every one
    for _ in 0..100 {
        assert!(matches!(n.send(&inval_inode_msg(5, -1, 0)), Err(None)));
    }
    assert!(n.attempts() < 10, "{} connection attempts", n.attempts());
}

/// Waits (bounded) for the read end of a pipe to reach EOF with nothing left in it.
fn assert_eof_within(pipe: &File, limit: Duration) {
    let ready = super::protocol::poll_fds(
        &[(Some(pipe.as_fd()), libc::POLLIN)],
        limit.as_millis() as i32,
    )
    .unwrap();
    assert!(ready[0] != 0, "the fd was still held after {limit:?}");
    let mut buf = [0u8; 64];
    let n = (&*pipe).read(&mut buf).unwrap();
    assert_eq!(n, 0, "unexpected bytes {:?}", &buf[..n]);
}

#[test]
fn a_connection_that_owns_entries_cannot_become_a_notifier() {
    let k = Running::start();
    let (_r, w) = nix::unistd::pipe().unwrap();
    let sock = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    connect(sock.as_raw_fd(), &UnixAddr::new(&k.path()).unwrap()).unwrap();
    let blob = super::protocol::blob_to_memfd(b"{}").unwrap();
    let ask = |msg: &[u8], fds: &[i32]| {
        send_msg(sock.as_fd(), msg, fds, MsgFlags::empty()).unwrap();
        let mut buf = vec![0u8; MAX_MSG];
        let (n, _) = recv_msg(sock.as_fd(), &mut buf, MsgFlags::empty())
            .unwrap()
            .unwrap();
        serde_json::from_slice::<Response>(&buf[..n]).unwrap()
    };
    let put = ask(
        br#"{"op":"put","id":"v"}"#,
        &[blob.as_raw_fd(), w.as_raw_fd()],
    );
    assert!(matches!(put, Response::Ok), "{put:?}");
    let r = ask(br#"{"op":"notifier","id":"v"}"#, &[]);
    assert!(
        matches!(
            r,
            Response::Err {
                kind: ErrKind::Invalid,
                ..
            }
        ),
        "{r:?}"
    );
    // still served as a normal connection, and still the owner
    assert!(matches!(
        ask(br#"{"op":"list"}"#, &[]),
        Response::Ids { .. }
    ));
    assert!(k.client().get("v").unwrap().owner_alive);
}

/// An invalidation waiting in the kernel (here: the "FUSE fd" is a full pipe) does not hold
/// up the next one: that gets a connection of its own (its handler may be what the first
/// one waits for), up to the per-session limit, beyond which the daemon writes it itself.
#[test]
fn a_waiting_invalidation_does_not_hold_up_the_next() {
    use super::notify::{inval_inode_msg, MAX_CONNS_PER_SESSION};
    use super::KeeperNotifier;
    use std::sync::Arc;
    let k = Running::start();
    let c = k.client();
    let (r, w) = nix::unistd::pipe().unwrap();
    c.put("v", b"{}", &[w.as_fd()]).unwrap();
    // fill the pipe (blocking: the keeper shares this open file): its writes now wait
    // until the test reads
    let filled = nix::fcntl::fcntl(&w, nix::fcntl::FcntlArg::F_GETPIPE_SZ).unwrap() as usize;
    let mut left = filled;
    while left > 0 {
        left -= nix::unistd::write(&w, &vec![0u8; left]).unwrap();
    }
    let n = Arc::new(KeeperNotifier::open(&k.path(), "v", None).unwrap());
    let msg = inval_inode_msg(5, -1, 0);
    let senders: Vec<_> = (0..MAX_CONNS_PER_SESSION)
        .map(|_| {
            let (n, msg) = (n.clone(), msg.clone());
            std::thread::spawn(move || n.send(&msg))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while n.connections() < MAX_CONNS_PER_SESSION {
        assert!(
            Instant::now() < deadline,
            "only {} connections for {MAX_CONNS_PER_SESSION} waiting invalidations",
            n.connections()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // every connection is taken: the next one is the caller's to write
    assert!(matches!(n.send(&msg), Err(None)));
    // the kernel (here: the reader) takes them: every waiting one completes
    let mut pipe = File::from(r);
    let mut want = filled + MAX_CONNS_PER_SESSION * msg.len();
    let mut buf = vec![0u8; 65536];
    while want > 0 {
        let got = pipe.read(&mut buf).unwrap();
        assert!(got > 0);
        want = want.saturating_sub(got);
    }
    for s in senders {
        s.join().unwrap().unwrap();
    }
    // and the connections are idle again
    n.send(&msg).unwrap();
    assert_eq!(n.connections(), MAX_CONNS_PER_SESSION);
    drop(w);
    c.drop_entry("v").unwrap();
}

/// A new session put in place of one whose daemon died ends the old one's notifier threads,
/// which would otherwise hold the old FUSE connection open.
#[test]
fn replacing_an_entry_ends_the_old_sessions_notifiers() {
    use super::KeeperNotifier;
    let k = Running::start();
    let (old_r, old_w) = nix::unistd::pipe().unwrap();
    let first = k.client();
    first
        .put_session("v", Some(1), b"{}", &[old_w.as_fd()])
        .unwrap();
    drop(old_w);
    let n = KeeperNotifier::open(&k.path(), "v", Some(1)).unwrap();
    // the first daemon is gone (its notifier connection lingers, as after a cut-short exit)
    drop(first);
    let (_new_r, new_w) = nix::unistd::pipe().unwrap();
    let second = k.client();
    // (the keeper may not have seen the first connection close yet)
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match second.put_session("v", Some(2), b"{}", &[new_w.as_fd()]) {
            Err(KeeperError::Busy(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            r => break r.unwrap(),
        }
    }
    assert_eof_within(&File::from(old_r), Duration::from_secs(10));
    drop(n);
    second.drop_entry("v").unwrap();
}

/// A keeper slow to accept a further notifier connection holds up only the caller asking
/// for it: another caller that finds an idle connection sends at once (the connection was
/// once asked for under the notifier's lock, for up to 5 s).
#[test]
fn a_slow_notifier_connection_holds_up_no_one_else() {
    use super::notify::inval_inode_msg;
    use super::KeeperNotifier;
    use nix::sys::socket::{accept, bind, listen, Backlog};
    use std::os::fd::FromRawFd;
    use std::sync::{mpsc, Arc};
    const LIMIT: Duration = Duration::from_secs(20);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fake.sock");
    let listener = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    bind(listener.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
    listen(&listener, Backlog::new(8).unwrap()).unwrap();
    // a fake keeper: the first connection is accepted at once; the first invalidation on it
    // is reported (`a_arrived`) and answered once `first_answer` is signalled, later ones at
    // once; the second connection's request is reported (`second_arrived`) and answered once
    // `second_answer` is signalled. Every wait is bounded: a test that goes wrong fails, it
    // does not hang.
    let (first_answer, first_wait) = mpsc::channel::<()>();
    let (second_answer, second_wait) = mpsc::channel::<()>();
    let (a_arrived, a_seen) = mpsc::channel::<()>();
    let (second_arrived, second_seen) = mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let ok = serde_json::to_vec(&Response::Ok).unwrap();
        let mut buf = vec![0u8; MAX_MSG];
        let first = unsafe { OwnedFd::from_raw_fd(accept(listener.as_raw_fd()).unwrap()) };
        recv_msg(first.as_fd(), &mut buf, MsgFlags::empty()).unwrap();
        send_msg(first.as_fd(), &ok, &[], MsgFlags::empty()).unwrap();
        let serve_first = std::thread::spawn(move || {
            let mut buf = vec![0u8; MAX_MSG];
            let mut n = 0;
            while let Ok(Some(_)) = recv_msg(first.as_fd(), &mut buf, MsgFlags::empty()) {
                if n == 0 {
                    a_arrived.send(()).unwrap();
                    first_wait.recv_timeout(LIMIT).unwrap();
                }
                n += 1;
                send_msg(first.as_fd(), &0i32.to_ne_bytes(), &[], MsgFlags::empty()).unwrap();
            }
        });
        let second = unsafe { OwnedFd::from_raw_fd(accept(listener.as_raw_fd()).unwrap()) };
        recv_msg(second.as_fd(), &mut buf, MsgFlags::empty()).unwrap();
        second_arrived.send(()).unwrap();
        second_wait.recv_timeout(LIMIT).unwrap();
        send_msg(second.as_fd(), &ok, &[], MsgFlags::empty()).unwrap();
        while let Ok(Some(_)) = recv_msg(second.as_fd(), &mut buf, MsgFlags::empty()) {
            send_msg(second.as_fd(), &0i32.to_ne_bytes(), &[], MsgFlags::empty()).unwrap();
        }
        serve_first
    });
    let n = Arc::new(KeeperNotifier::open(&path, "v", Some(1)).unwrap());
    let msg = inval_inode_msg(5, -1, 0);
    let send = || {
        let (n, msg) = (n.clone(), msg.clone());
        std::thread::spawn(move || n.send(&msg))
    };
    // A: its invalidation waits in the "kernel" on the only connection
    let a = send();
    a_seen
        .recv_timeout(LIMIT)
        .expect("A's invalidation reached the keeper");
    // B: finds no idle connection and asks for a second one, which the keeper is slow to give
    let b = send();
    second_seen
        .recv_timeout(LIMIT)
        .expect("B asked for a second connection");
    // A's invalidation is answered: the first connection is idle again
    first_answer.send(()).unwrap();
    join_within(a, LIMIT, "A").unwrap();
    // C takes the idle connection while B still waits for its own
    let c = send();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let c_done_first = c.is_finished() && !b.is_finished();
    second_answer.send(()).unwrap();
    join_within(c, LIMIT, "C").unwrap();
    join_within(b, LIMIT, "B").unwrap();
    assert!(
        c_done_first,
        "a send that found an idle connection waited for another caller's connection attempt"
    );
    // the notifier's connections close with it: the fake keeper's threads end
    drop(n);
    join_within(
        join_within(fake, LIMIT, "the fake keeper"),
        LIMIT,
        "its first connection",
    );
}

/// Joins `t`, failing the test (not hanging it) if it has not ended within `limit`.
fn join_within<T>(t: std::thread::JoinHandle<T>, limit: Duration, what: &str) -> T {
    let deadline = Instant::now() + limit;
    while !t.is_finished() {
        assert!(
            Instant::now() < deadline,
            "{what} did not finish within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    t.join().unwrap()
}
