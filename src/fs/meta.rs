//! Metadata cache: whole directory listings, kept coherent by our own mutations and the filer's
//! metadata subscription. A listed directory answers lookups (including authoritative ENOENT)
//! and readdir without leaving the process while it is fresh.

use crate::pb::filer as pb;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Listing {
    entries: BTreeMap<String, Arc<pb::Entry>>,
    loaded: Instant,
}

#[derive(Default)]
struct Inner {
    dirs: HashMap<String, Listing>,
    /// Bumped by every change to a directory, so a listing that raced with a change is not
    /// installed over it.
    gens: HashMap<String, u64>,
}

pub struct MetaCache {
    inner: Mutex<Inner>,
    ttl: Duration,
}

/// Result of a cached lookup.
pub enum Cached {
    /// The directory is cached and has the entry.
    Found(Arc<pb::Entry>),
    /// The directory is cached and has no such entry.
    Absent,
    /// The directory is not cached (or stale): ask the filer.
    Unknown,
}

impl MetaCache {
    pub fn new(ttl: Duration) -> Self {
        MetaCache {
            inner: Mutex::new(Inner::default()),
            ttl,
        }
    }

    fn fresh(&self, l: &Listing) -> bool {
        l.loaded.elapsed() < self.ttl
    }

    pub fn lookup(&self, dir: &str, name: &str) -> Cached {
        let g = self.inner.lock();
        match g.dirs.get(dir) {
            Some(l) if self.fresh(l) => match l.entries.get(name) {
                Some(e) => Cached::Found(e.clone()),
                None => Cached::Absent,
            },
            _ => Cached::Unknown,
        }
    }

    /// Sorted entries of a fresh cached directory.
    pub fn listing(&self, dir: &str) -> Option<Vec<Arc<pb::Entry>>> {
        let g = self.inner.lock();
        g.dirs
            .get(dir)
            .filter(|l| self.fresh(l))
            .map(|l| l.entries.values().cloned().collect())
    }

    pub fn is_cached(&self, dir: &str) -> bool {
        let g = self.inner.lock();
        g.dirs.get(dir).map(|l| self.fresh(l)).unwrap_or(false)
    }

    /// Generation of a directory, taken before listing it from the filer.
    pub fn generation(&self, dir: &str) -> u64 {
        *self.inner.lock().gens.get(dir).unwrap_or(&0)
    }

    /// Installs a listing fetched from the filer, unless the directory changed meanwhile.
    /// `pinned` entries (files created here but not yet on the filer) are kept.
    pub fn install(
        &self,
        dir: &str,
        entries: Vec<pb::Entry>,
        gen: u64,
        pinned: &[Arc<pb::Entry>],
    ) -> bool {
        let mut g = self.inner.lock();
        if *g.gens.get(dir).unwrap_or(&0) != gen {
            return false;
        }
        let mut map: BTreeMap<String, Arc<pb::Entry>> = entries
            .into_iter()
            .map(|e| (e.name.clone(), Arc::new(e)))
            .collect();
        for p in pinned {
            map.insert(p.name.clone(), p.clone());
        }
        g.dirs.insert(
            dir.to_string(),
            Listing {
                entries: map,
                loaded: Instant::now(),
            },
        );
        true
    }

    /// An entry was created or changed in `dir`.
    pub fn upsert(&self, dir: &str, entry: Arc<pb::Entry>) {
        let mut g = self.inner.lock();
        *g.gens.entry(dir.to_string()).or_default() += 1;
        if let Some(l) = g.dirs.get_mut(dir) {
            l.entries.insert(entry.name.clone(), entry);
        }
    }

    /// An entry was removed from `dir`.
    pub fn remove(&self, dir: &str, name: &str) {
        let mut g = self.inner.lock();
        *g.gens.entry(dir.to_string()).or_default() += 1;
        if let Some(l) = g.dirs.get_mut(dir) {
            l.entries.remove(name);
        }
    }

    /// Drops a directory's listing (and everything below it when `recursive`).
    pub fn invalidate_dir(&self, dir: &str, recursive: bool) {
        let mut g = self.inner.lock();
        *g.gens.entry(dir.to_string()).or_default() += 1;
        g.dirs.remove(dir);
        if recursive {
            let prefix = format!("{}/", dir.trim_end_matches('/'));
            g.dirs.retain(|k, _| !k.starts_with(&prefix));
        }
    }

    /// After a subscription gap nothing cached can be trusted.
    pub fn invalidate_all(&self) {
        let mut g = self.inner.lock();
        let keys: Vec<String> = g.dirs.keys().cloned().collect();
        for k in keys {
            *g.gens.entry(k).or_default() += 1;
        }
        g.dirs.clear();
    }

    pub fn cached_dirs(&self) -> usize {
        self.inner.lock().dirs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(name: &str) -> pb::Entry {
        pb::Entry {
            name: name.into(),
            ..Default::default()
        }
    }

    #[test]
    fn install_lookup_and_race_guard() {
        let m = MetaCache::new(Duration::from_secs(60));
        assert!(matches!(m.lookup("/d", "a"), Cached::Unknown));
        let g = m.generation("/d");
        assert!(m.install("/d", vec![e("a")], g, &[]));
        assert!(matches!(m.lookup("/d", "a"), Cached::Found(_)));
        assert!(matches!(m.lookup("/d", "b"), Cached::Absent));
        // a listing started before a change must not overwrite it
        let g = m.generation("/d");
        m.upsert("/d", Arc::new(e("b")));
        assert!(!m.install("/d", vec![e("a")], g, &[]));
        assert!(matches!(m.lookup("/d", "b"), Cached::Found(_)));
        m.remove("/d", "a");
        assert!(matches!(m.lookup("/d", "a"), Cached::Absent));
        m.invalidate_all();
        assert!(matches!(m.lookup("/d", "b"), Cached::Unknown));
    }

    #[test]
    fn ttl_expires() {
        let m = MetaCache::new(Duration::from_millis(0));
        m.install("/d", vec![e("a")], 0, &[]);
        assert!(matches!(m.lookup("/d", "a"), Cached::Unknown));
    }
}
