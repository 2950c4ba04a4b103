//! The one retry policy of the driver: exponential backoff with jitter, built on backon.
//! Every retry loop takes its pauses from a [`Policy`] named here, so the bounds live in one
//! place, and nodes that lost a server at the same moment (a filer or volume server restart)
//! spread their retries instead of arriving in lockstep.

use backon::{BackoffBuilder, ExponentialBuilder};
use std::time::Duration;

/// Pauses doubling from `first` up to `max`, each drawn at random between its step and
/// twice the step. How long to keep trying is the caller's (a deadline or a count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub first: Duration,
    pub max: Duration,
}

/// Chunk reads, uploads and commits while a volume server or the filer is away
/// (0.25-0.5 s at first, 4-8 s at most).
pub const STORAGE: Policy = Policy {
    first: Duration::from_millis(250),
    max: Duration::from_secs(4),
};

/// One volume server refusing an upload before another is assigned (0.2-0.4 s, 0.4-0.8 s).
pub const UPLOAD_ATTEMPT: Policy = Policy {
    first: Duration::from_millis(200),
    max: Duration::from_millis(400),
};

/// A metadata subscription reconnecting, and a pause after every filer of a list failed
/// (0.1-0.2 s at first, 2.5-5 s at most).
pub const RECONNECT: Policy = Policy {
    first: Duration::from_millis(100),
    max: Duration::from_millis(2500),
};

/// Looking for an open file at the name the metadata events give it, while its name moves
/// (5-10 ms at first, 100-200 ms at most): the events are usually milliseconds behind.
pub const NAME_EVENTS: Policy = Policy {
    first: Duration::from_millis(5),
    max: Duration::from_millis(100),
};

/// A commit refused again and again because other clients keep changing the file (1-2 ms
/// at first, 50-100 ms at most): the writers' retries drift apart.
pub const REBASE: Policy = Policy {
    first: Duration::from_millis(1),
    max: Duration::from_millis(50),
};

/// Repairs of recorded volumes after a plugin restart (1-2 s at first, 15-30 s at most).
pub const REPAIR: Policy = Policy {
    first: Duration::from_secs(1),
    max: Duration::from_secs(15),
};

impl Policy {
    /// An endless series of pauses; start a new one after a success.
    pub fn pauses(&self) -> Pauses {
        Pauses(
            ExponentialBuilder::new()
                .with_min_delay(self.first)
                .with_max_delay(self.max)
                .with_jitter()
                .without_max_times()
                .build(),
            self.max,
        )
    }
}

/// The pauses of one retry loop (see [`Policy::pauses`]).
#[derive(Debug)]
pub struct Pauses(backon::ExponentialBackoff, Duration);

impl Pauses {
    /// The next pause, to be slept before the next attempt.
    pub fn next_pause(&mut self) -> Duration {
        // never None without a count or total bound; the cap keeps that promise cheap
        self.0.next().unwrap_or(self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_within_jitter_bounds_and_stop_growing_at_max() {
        for p in [
            STORAGE,
            UPLOAD_ATTEMPT,
            RECONNECT,
            NAME_EVENTS,
            REBASE,
            REPAIR,
        ] {
            let mut s = p.pauses();
            let mut step = p.first;
            for _ in 0..40 {
                let d = s.next_pause();
                assert!(
                    d >= step && d <= step * 2,
                    "{p:?}: {d:?} outside {step:?}..2x"
                );
                step = (step * 2).min(p.max);
            }
        }
    }

    #[test]
    fn pauses_are_jittered_per_loop() {
        // two nodes starting their retries at the same moment must not pause alike
        let a: Vec<Duration> = (0..8)
            .map({
                let mut s = RECONNECT.pauses();
                move |_| s.next_pause()
            })
            .collect();
        let b: Vec<Duration> = (0..8)
            .map({
                let mut s = RECONNECT.pauses();
                move |_| s.next_pause()
            })
            .collect();
        assert_ne!(a, b);
        let firsts: std::collections::HashSet<Duration> =
            (0..50).map(|_| RECONNECT.pauses().next_pause()).collect();
        assert!(firsts.len() > 40, "first pauses spread: {}", firsts.len());
    }
}
