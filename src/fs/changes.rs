//! When each name last changed, here or in another client's event: a directory listing's
//! attributes may be sent to the kernel (readdirplus, which it believes for the entry TTL)
//! only for names that did not change since the listing was taken.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Stamps older than this go first when the bound is reached (a listing is read within
/// seconds of being taken; an older one only costs lookups).
const KEEP: Duration = Duration::from_secs(30);
/// Bound on the names remembered (about 100 B each).
const MAX: usize = 65_536;

#[derive(Default)]
pub(super) struct NameChanges {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    at: HashMap<String, Instant>,
    /// Stamps up to this instant may have been forgotten: listings taken before it trust
    /// no name.
    forgot_to: Option<Instant>,
}

impl NameChanges {
    /// `path` changes now (a change also stamps again when it completes).
    pub(super) fn stamp(&self, path: String) {
        let now = Instant::now();
        let mut g = self.inner.lock();
        if g.at.len() >= MAX && !g.at.contains_key(&path) {
            g.at.retain(|_, t| now.duration_since(*t) < KEEP);
            let mut forgot = now.checked_sub(KEEP);
            if g.at.len() >= MAX {
                // a burst beyond the bound inside the window
                g.at.clear();
                forgot = Some(now);
            }
            g.forgot_to = g.forgot_to.max(forgot);
        }
        g.at.insert(path, now);
    }

    /// Whether `path` changed at or after `since` (or may have: its stamp was forgotten).
    pub(super) fn since(&self, path: &str, since: Instant) -> bool {
        let g = self.inner.lock();
        g.forgot_to.is_some_and(|f| f >= since) || g.at.get(path).is_some_and(|t| *t >= since)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().at.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_changed_after_a_listing_is_doubted_and_one_before_is_not() {
        let c = NameChanges::default();
        c.stamp("/d/old".into());
        std::thread::sleep(Duration::from_millis(2));
        let taken = Instant::now();
        c.stamp("/d/new".into());
        assert!(!c.since("/d/old", taken));
        assert!(c.since("/d/new", taken));
        assert!(!c.since("/d/other", taken));
    }

    #[test]
    fn past_the_bound_forgotten_stamps_make_older_listings_doubt_every_name() {
        let c = NameChanges::default();
        let taken = Instant::now();
        for i in 0..MAX {
            c.stamp(format!("/d/{i}"));
        }
        assert!(!c.since("/d/unrelated", taken));
        let later = Instant::now();
        c.stamp("/d/one-more".into());
        assert!(c.len() <= MAX);
        // all stamps were within the window: dropped, so nothing listed before is trusted
        assert!(c.since("/d/unrelated", taken));
        assert!(c.since("/d/unrelated", later));
        std::thread::sleep(Duration::from_millis(2));
        let after = Instant::now();
        assert!(!c.since("/d/unrelated", after));
        assert!(c.since("/d/one-more", later));
    }
}
