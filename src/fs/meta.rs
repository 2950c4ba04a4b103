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
    /// Number of subdirectories (for the directory's link count).
    subdirs: usize,
}

#[derive(Default)]
struct Inner {
    dirs: HashMap<String, Listing>,
    /// Bumped by every change to a directory, so a listing that raced with a change is not
    /// installed over it.
    gens: HashMap<String, u64>,
    /// Latest known shared state (attributes, chunks, link count) of each hard-link group.
    /// Every name of the group shows it, so a change through one name is seen through all.
    links: HashMap<Vec<u8>, Arc<pb::Entry>>,
    /// Directories found too large to cache, and when: not listed again within the TTL.
    too_large: HashMap<String, Instant>,
}

/// `e` with the shared state of its hard-link group, if that is known and differs.
fn overlay(links: &HashMap<Vec<u8>, Arc<pb::Entry>>, e: &Arc<pb::Entry>) -> Arc<pb::Entry> {
    if e.hard_link_id.is_empty() {
        return e.clone();
    }
    match links.get(&e.hard_link_id) {
        Some(s) if s.name == e.name => s.clone(),
        Some(s) => Arc::new(pb::Entry {
            name: e.name.clone(),
            ..(**s).clone()
        }),
        None => e.clone(),
    }
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
                Some(e) => Cached::Found(overlay(&g.links, e)),
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
            .map(|l| l.entries.values().map(|e| overlay(&g.links, e)).collect())
    }

    /// Number of subdirectories of a fresh cached directory.
    pub fn subdirs(&self, dir: &str) -> Option<usize> {
        let g = self.inner.lock();
        g.dirs.get(dir).filter(|l| self.fresh(l)).map(|l| l.subdirs)
    }

    /// Records the current shared state of a hard-link group (from the filer or our own change).
    pub fn note_link(&self, e: &pb::Entry) {
        if !e.hard_link_id.is_empty() {
            self.inner
                .lock()
                .links
                .insert(e.hard_link_id.clone(), Arc::new(e.clone()));
        }
    }

    /// One name of a hard-link group was removed: the others have one link less.
    pub fn link_removed(&self, e: &pb::Entry) {
        if e.hard_link_id.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        let cur = g
            .links
            .get(&e.hard_link_id)
            .map(|s| (**s).clone())
            .unwrap_or_else(|| e.clone());
        if cur.hard_link_counter <= 1 {
            g.links.remove(&e.hard_link_id);
            return;
        }
        let mut next = cur;
        next.hard_link_counter -= 1;
        g.links.insert(e.hard_link_id.clone(), Arc::new(next));
    }

    /// Remembers that `dir` has too many entries to cache (until the TTL passes).
    pub fn mark_too_large(&self, dir: &str) {
        let mut g = self.inner.lock();
        let ttl = self.ttl;
        g.too_large.retain(|_, t| t.elapsed() < ttl);
        g.too_large.insert(dir.to_string(), Instant::now());
    }

    pub fn is_too_large(&self, dir: &str) -> bool {
        let g = self.inner.lock();
        g.too_large
            .get(dir)
            .map(|t| t.elapsed() < self.ttl)
            .unwrap_or(false)
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
        for e in map.values() {
            if !e.hard_link_id.is_empty() {
                // fresh from the filer: newer than anything we held
                g.links.insert(e.hard_link_id.clone(), e.clone());
            }
        }
        let subdirs = map.values().filter(|e| e.is_directory).count();
        g.dirs.insert(
            dir.to_string(),
            Listing {
                entries: map,
                loaded: Instant::now(),
                subdirs,
            },
        );
        true
    }

    /// An entry was created or changed in `dir`.
    pub fn upsert(&self, dir: &str, entry: Arc<pb::Entry>) {
        let mut g = self.inner.lock();
        *g.gens.entry(dir.to_string()).or_default() += 1;
        if !entry.hard_link_id.is_empty() {
            g.links.insert(entry.hard_link_id.clone(), entry.clone());
        }
        if let Some(l) = g.dirs.get_mut(dir) {
            let new_dir = entry.is_directory;
            if let Some(old) = l.entries.insert(entry.name.clone(), entry) {
                if old.is_directory {
                    l.subdirs -= 1;
                }
            }
            if new_dir {
                l.subdirs += 1;
            }
        }
    }

    /// An entry was removed from `dir`.
    pub fn remove(&self, dir: &str, name: &str) {
        let mut g = self.inner.lock();
        *g.gens.entry(dir.to_string()).or_default() += 1;
        if let Some(l) = g.dirs.get_mut(dir) {
            if let Some(old) = l.entries.remove(name) {
                if old.is_directory {
                    l.subdirs -= 1;
                }
            }
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
        g.links.clear();
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
    fn subdir_count_follows_changes() {
        let m = MetaCache::new(Duration::from_secs(60));
        let dir = |n: &str| pb::Entry {
            name: n.into(),
            is_directory: true,
            ..Default::default()
        };
        assert_eq!(m.subdirs("/d"), None);
        m.install("/d", vec![e("a"), dir("s1")], m.generation("/d"), &[]);
        assert_eq!(m.subdirs("/d"), Some(1));
        m.upsert("/d", Arc::new(dir("s2")));
        m.upsert("/d", Arc::new(dir("s2")));
        assert_eq!(m.subdirs("/d"), Some(2));
        m.remove("/d", "s1");
        m.remove("/d", "a");
        assert_eq!(m.subdirs("/d"), Some(1));
    }

    #[test]
    fn hard_link_names_share_state() {
        let m = MetaCache::new(Duration::from_secs(60));
        let link = |n: &str, size: u64, count: i32| pb::Entry {
            name: n.into(),
            hard_link_id: vec![7; 17],
            hard_link_counter: count,
            attributes: Some(pb::FuseAttributes {
                file_size: size,
                ..Default::default()
            }),
            ..Default::default()
        };
        m.install("/d", vec![link("a", 1, 2), link("b", 1, 2)], 0, &[]);
        m.upsert("/d", Arc::new(link("a", 99, 2)));
        let Cached::Found(b) = m.lookup("/d", "b") else {
            panic!("b is cached")
        };
        assert_eq!(b.name, "b");
        assert_eq!(b.attributes.as_ref().unwrap().file_size, 99);
        m.remove("/d", "a");
        m.link_removed(&link("a", 99, 2));
        let l = m.listing("/d").unwrap();
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].hard_link_counter, 1);
    }

    #[test]
    fn ttl_expires() {
        let m = MetaCache::new(Duration::from_millis(0));
        m.install("/d", vec![e("a")], 0, &[]);
        assert!(matches!(m.lookup("/d", "a"), Cached::Unknown));
    }
}
