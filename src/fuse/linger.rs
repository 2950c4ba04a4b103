//! A FUSE thread that has just answered a request waits a few microseconds for the next one
//! before it goes back to sleep in read(2).
//!
//! Why: a caller streaming small requests (4 KiB writes, an untar's create/write/close) sends
//! its next request a few microseconds after our answer wakes it. A FUSE thread asleep by then
//! has to be woken, and on a VM whose idle CPUs halt that wake-up crosses CPUs through the
//! hypervisor: ~20-30 us, more than the request's own work. Checking the device for a little
//! while first takes the request at once (docs/BENCHMARKS.md, 2026-12-07, session 38).
//!
//! Each thread backs off on its own: it counts waits that saw no request, less those that
//! caught one, and at [`MISSES_BEFORE_REST`] it answers the next [`REST_ANSWERS`] requests
//! without waiting. So a thread keeps waiting only while its waits catch a request at least
//! as often as not, and one with sparse requests waits for 8 of every 72 answers. (Sizing
//! the wait by how soon the next request came, as the kernel's haltpoll does, closed it
//! exactly when it was needed: a thread that slept sees its own wake-up in that time.) A
//! wait also gives way at once when another task wants this CPU: a caller woken onto this
//! CPU runs only once we stop.

use std::cell::Cell;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Waits without a request (less those with one) after which a thread rests.
pub const MISSES_BEFORE_REST: u32 = 8;

/// Answers a resting thread gives without waiting.
pub const REST_ANSWERS: u32 = 64;

/// A `sched_yield` that took longer than this ran another task on this CPU.
const YIELDED_TO_OTHERS: Duration = Duration::from_micros(3);

/// One session's linger settings; each FUSE thread keeps its own count.
#[derive(Debug)]
pub struct Linger {
    /// The session's FUSE device; -1 until attached. A raw number, not a duplicate: it is
    /// only polled on the session's FUSE threads while they serve a request, when the
    /// session's own fd is open, and a duplicate would keep the connection alive.
    fd: AtomicI32,
    max: Duration,
}

thread_local! {
    /// Waits on this thread that saw no request, less those that caught one.
    static MISSES: Cell<u32> = const { Cell::new(0) };
    /// Answers this thread still gives without waiting.
    static RESTING: Cell<u32> = const { Cell::new(0) };
}

/// How one linger ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A request is waiting on the device.
    Arrived,
    /// No request came within the limit.
    TimedOut,
    /// Another task wanted this CPU.
    GaveWay,
    /// Not waited: none allowed, this thread rests, or the device reports an error.
    Skipped,
}

impl Linger {
    /// `max` zero: never wait.
    pub fn new(max: Duration) -> Self {
        Linger {
            fd: AtomicI32::new(-1),
            max,
        }
    }

    /// Starts waiting on `fd`, the session's FUSE device.
    pub fn attach(&self, fd: RawFd) {
        self.fd.store(fd, Ordering::Relaxed);
    }

    /// Called after this thread answered a request: waits up to the limit for the next.
    pub fn after_answer(&self) -> Outcome {
        let fd = self.fd.load(Ordering::Relaxed);
        if self.max.is_zero() || fd < 0 {
            return Outcome::Skipped;
        }
        let resting = RESTING.get();
        if resting > 0 {
            RESTING.set(resting - 1);
            return Outcome::Skipped;
        }
        let outcome = wait_readable(fd, Instant::now(), self.max);
        if outcome != Outcome::Skipped {
            crate::metrics::global().linger_done(outcome == Outcome::Arrived);
        }
        match outcome {
            // waits must pay off at least as often as not: a catch cancels one miss
            Outcome::Arrived => MISSES.set(MISSES.get().saturating_sub(1)),
            Outcome::TimedOut => {
                let misses = MISSES.get() + 1;
                if misses >= MISSES_BEFORE_REST {
                    MISSES.set(0);
                    RESTING.set(REST_ANSWERS);
                } else {
                    MISSES.set(misses);
                }
            }
            // the caller (or other work) runs on this CPU: says nothing about the next request
            Outcome::GaveWay | Outcome::Skipped => {}
        }
        outcome
    }
}

/// Polls `fd` for input until `window` after `start`, giving way to other tasks.
fn wait_readable(fd: RawFd, start: Instant, window: Duration) -> Outcome {
    loop {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; a zero timeout never blocks
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        if n > 0 && p.revents == libc::POLLIN {
            return Outcome::Arrived;
        }
        if n != 0 {
            // an error (an aborted connection): the next read reports it
            return Outcome::Skipped;
        }
        if start.elapsed() >= window {
            return Outcome::TimedOut;
        }
        let y = Instant::now();
        // SAFETY: no arguments, no memory
        unsafe { libc::sched_yield() };
        if y.elapsed() > YIELDED_TO_OTHERS {
            return Outcome::GaveWay;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_zero_limit_never_looks() {
        let l = Linger::new(Duration::ZERO);
        let (r, w) = nix::unistd::pipe().unwrap();
        l.attach(r.as_raw_fd());
        // a request is there, but a thread that must not wait does not even look
        nix::unistd::write(&w, b"x").unwrap();
        assert_eq!(l.after_answer(), Outcome::Skipped);
    }

    /// How a wait of up to 5 s on `fd` ends, asserting that it ended within a second.
    fn ends_at_once(fd: RawFd) -> Outcome {
        let t = Instant::now();
        let outcome = wait_readable(fd, t, Duration::from_secs(5));
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "{outcome:?} took long"
        );
        outcome
    }

    #[test]
    fn input_on_the_device_ends_the_wait() {
        let (r, w) = nix::unistd::pipe().unwrap();
        // nothing to read: only the limit (or another task wanting the CPU) ends it
        let t = Instant::now();
        assert_ne!(wait_readable(r.as_raw_fd(), t, us(200)), Outcome::Arrived);
        nix::unistd::write(&w, b"x").unwrap();
        assert_eq!(ends_at_once(r.as_raw_fd()), Outcome::Arrived);
    }

    #[test]
    fn an_error_on_the_device_ends_the_wait_uncounted() {
        let (r, w) = nix::unistd::pipe().unwrap();
        // the writer gone: POLLHUP, as an aborted connection reports an error
        drop(w);
        assert_eq!(ends_at_once(r.as_raw_fd()), Outcome::Skipped);
    }

    #[test]
    fn a_thread_rests_after_waits_that_saw_nothing_and_then_waits_again() {
        let l = Linger::new(us(20));
        let (r, w) = nix::unistd::pipe().unwrap();
        l.attach(r.as_raw_fd());
        std::thread::spawn(move || {
            // `n` waits that see nothing; those that gave way to another task (a loaded
            // machine) do not count
            let miss = |n: u32| {
                let mut misses = 0;
                while misses < n {
                    match l.after_answer() {
                        Outcome::TimedOut => misses += 1,
                        Outcome::GaveWay => {}
                        o => panic!("{o:?} with nothing to read"),
                    }
                }
            };
            miss(MISSES_BEFORE_REST);
            // then it answers without looking, even with a request there
            nix::unistd::write(&w, b"x").unwrap();
            for _ in 0..REST_ANSWERS {
                assert_eq!(l.after_answer(), Outcome::Skipped);
            }
            // and after its rest it looks again
            assert_eq!(l.after_answer(), Outcome::Arrived);
            // a caught request cancels one miss: 7 misses and a catch leave 6, so 2 more
            // misses start a rest, and 1 does not
            nix::unistd::read(&r, &mut [0u8; 1]).unwrap();
            miss(MISSES_BEFORE_REST - 1);
            nix::unistd::write(&w, b"x").unwrap();
            assert_eq!(l.after_answer(), Outcome::Arrived);
            nix::unistd::read(&r, &mut [0u8; 1]).unwrap();
            miss(1);
            nix::unistd::write(&w, b"x").unwrap();
            assert_eq!(l.after_answer(), Outcome::Arrived, "rests too early");
            // now 6 again: 2 misses rest it
            nix::unistd::read(&r, &mut [0u8; 1]).unwrap();
            miss(2);
            nix::unistd::write(&w, b"x").unwrap();
            assert_eq!(l.after_answer(), Outcome::Skipped, "does not rest");
        })
        .join()
        .unwrap();
    }
}
