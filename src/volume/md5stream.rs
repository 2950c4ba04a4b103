//! MD5 of a run of bytes hashed while it is still being written.
//!
//! A file that fsyncs often (a database log) uploads a chunk per fsync, and the fsync waited
//! for that chunk's MD5 (`Content-MD5`) before its upload could start: ~2 ms per MiB on the
//! critical path. For such files every append is also handed, as a copy, to a hashing thread
//! of its own, which hashes it while the writer goes on; the upload an fsync starts finds its
//! digest ready. The digest is of exactly the bytes pushed, in order: whoever seals the run
//! must check that nothing but appends reached it (see `fs::file::Slot`), and a stream whose
//! pieces could not all be queued reports no digest, so the uploader hashes the data itself.

use super::md5x;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Bytes copied for hashing and not hashed yet, over all streams (~15 ms of hashing). Past
/// it, pieces are refused (their streams give no digest, so their uploads hash the data
/// themselves) instead of piling up: an fsync never waits long behind other files' pieces,
/// and the copies, which the node's memory budget does not see, stay small.
pub const MAX_PENDING: u64 = 8 << 20;

/// A running MD5 fed with appended pieces (cheap to clone: clones share the stream).
#[derive(Clone, Default)]
pub struct Stream(Arc<Shared>);

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0.lock();
        f.debug_struct("Stream")
            .field("pushed", &s.pushed)
            .field("hashed", &s.hashed)
            .field("broken", &s.broken)
            .finish()
    }
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    hashed: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    md5: md5x::Hasher,
    /// Pushed, not hashed yet.
    pending: VecDeque<Bytes>,
    pushed: u64,
    hashed: u64,
    /// A piece was refused or the hashing thread is gone: no digest will come.
    broken: bool,
    /// On the hashing thread's queue or being hashed now.
    queued: bool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn break_off(&self) {
        let mut s = self.lock();
        s.broken = true;
        let dropped: u64 = s.pending.drain(..).map(|p| p.len() as u64).sum();
        drop(s);
        PENDING.fetch_sub(dropped, Ordering::Relaxed);
        self.hashed.notify_waiters();
    }
}

static PENDING: AtomicU64 = AtomicU64::new(0);

impl Stream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a copy of `piece` to the stream; it is hashed in the background.
    pub fn push(&self, piece: &[u8]) {
        if piece.is_empty() {
            return;
        }
        let len = piece.len() as u64;
        let mut s = self.0.lock();
        if s.broken {
            return;
        }
        if PENDING.fetch_add(len, Ordering::Relaxed) + len > MAX_PENDING {
            PENDING.fetch_sub(len, Ordering::Relaxed);
            drop(s);
            self.0.break_off();
            return;
        }
        s.pending.push_back(Bytes::copy_from_slice(piece));
        s.pushed += len;
        let wake = !std::mem::replace(&mut s.queued, true);
        drop(s);
        if wake && hasher().queue(self.0.clone()).is_err() {
            self.0.break_off();
        }
    }

    /// Nobody will ask for the digest: pieces not hashed yet are dropped unhashed.
    pub fn abandon(&self) {
        self.0.break_off();
    }

    /// Bytes pushed so far.
    pub fn pushed(&self) -> u64 {
        self.0.lock().pushed
    }

    /// The MD5 of the stream once every piece is hashed, if exactly `len` bytes were pushed
    /// and none was refused; None tells the caller to hash the data itself.
    pub async fn digest(&self, len: u64) -> Option<[u8; 16]> {
        loop {
            let hashed = self.0.hashed.notified();
            tokio::pin!(hashed);
            // registered before the check: a piece hashed in between still wakes us
            hashed.as_mut().enable();
            {
                let s = self.0.lock();
                if s.broken || s.pushed != len {
                    return None;
                }
                if s.hashed == len {
                    return Some(s.md5.finalize());
                }
            }
            hashed.await;
        }
    }
}

/// The one thread that hashes streams, in the order their pieces came.
struct Hasher {
    queue: Mutex<VecDeque<Arc<Shared>>>,
    ready: Condvar,
    alive: std::sync::atomic::AtomicBool,
    /// The stream being hashed now (off the queue), for `Gone`.
    current: Mutex<Option<Arc<Shared>>>,
}

static HASHER: OnceLock<Arc<Hasher>> = OnceLock::new();

fn hasher() -> &'static Arc<Hasher> {
    HASHER.get_or_init(|| {
        let h = Arc::new(Hasher {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            alive: true.into(),
            current: Mutex::new(None),
        });
        let worker = h.clone();
        let started = std::thread::Builder::new()
            .name("md5-stream".into())
            .spawn(move || {
                let _gone = Gone(&worker);
                worker.run()
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "could not start the MD5 stream thread; chunks are hashed when uploaded");
            h.alive.store(false, Ordering::SeqCst);
        }
        h
    })
}

impl Hasher {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<Shared>>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn queue(&self, stream: Arc<Shared>) -> Result<(), ()> {
        let mut q = self.lock();
        // checked under the queue's lock: a dying thread empties the queue under it too
        if !self.alive.load(Ordering::SeqCst) {
            return Err(());
        }
        q.push_back(stream);
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    fn run(&self) {
        loop {
            let stream = {
                let mut q = self.lock();
                loop {
                    match q.pop_front() {
                        Some(s) => break s,
                        None => q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner()),
                    }
                }
            };
            *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(stream.clone());
            // every piece the stream has now and any pushed while these are hashed
            loop {
                let (piece, mut md5) = {
                    let mut s = stream.lock();
                    match s.pending.pop_front() {
                        Some(p) => (p, s.md5.clone()),
                        None => {
                            s.queued = false;
                            break;
                        }
                    }
                };
                md5.update(&piece);
                let mut s = stream.lock();
                // only this thread changes `md5`; a stream broken meanwhile keeps no digest
                if !s.broken {
                    s.md5 = md5;
                    s.hashed += piece.len() as u64;
                }
                drop(s);
                PENDING.fetch_sub(piece.len() as u64, Ordering::Relaxed);
                stream.hashed.notify_waiters();
            }
            *self.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }
}

/// The hashing thread ended (it does not, short of a panic): streams still waiting give no
/// digest, so their uploads hash the data themselves instead of waiting forever.
struct Gone<'a>(&'a Hasher);

impl Drop for Gone<'_> {
    fn drop(&mut self) {
        let mut waiting: Vec<Arc<Shared>> = {
            let mut q = self.0.lock();
            self.0.alive.store(false, Ordering::SeqCst);
            q.drain(..).collect()
        };
        let current = self
            .0
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        waiting.extend(current);
        for s in waiting {
            s.break_off();
        }
        tracing::error!("the MD5 stream thread ended: chunks are hashed when uploaded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use md5::{Digest, Md5};

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[tokio::test]
    async fn pieces_hash_to_the_digest_of_the_whole() {
        let d = data((1 << 20) + 12_345);
        let s = Stream::new();
        // uneven pieces, some not a multiple of MD5's 64-byte block
        for piece in d.chunks(65_537) {
            s.push(piece);
        }
        assert_eq!(s.pushed(), d.len() as u64);
        let want: [u8; 16] = Md5::digest(&d).into();
        assert_eq!(s.digest(d.len() as u64).await, Some(want));
        // asked again (an upload retried): the same digest
        assert_eq!(s.digest(d.len() as u64).await, Some(want));
    }

    #[tokio::test]
    async fn a_length_other_than_what_was_pushed_gets_no_digest() {
        let s = Stream::new();
        s.push(b"abc");
        assert_eq!(s.digest(2).await, None);
        assert_eq!(s.digest(4).await, None);
        let empty = Stream::new();
        assert_eq!(empty.digest(0).await, Some(Md5::digest(b"").into()));
    }

    #[tokio::test]
    async fn a_broken_stream_gets_no_digest_and_frees_its_pieces() {
        let s = Stream::new();
        s.push(&data(1000));
        s.0.break_off();
        assert_eq!(s.digest(1000).await, None);
        s.push(b"more");
        assert_eq!(s.pushed(), 1000, "a broken stream takes no more pieces");
        assert!(s.0.lock().pending.is_empty());
    }

    #[tokio::test]
    async fn many_streams_at_once_each_get_their_own_digest() {
        let streams: Vec<(Stream, Vec<u8>)> = (0..16)
            .map(|i| (Stream::new(), data(100_000 + i * 4099)))
            .collect();
        for round in 0..8 {
            for (s, d) in &streams {
                let n = d.len().div_ceil(8);
                if let Some(piece) = d.chunks(n).nth(round) {
                    s.push(piece);
                }
            }
        }
        for (s, d) in &streams {
            let want: [u8; 16] = Md5::digest(d).into();
            assert_eq!(s.digest(d.len() as u64).await, Some(want));
        }
    }
}
