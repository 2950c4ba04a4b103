//! Metadata cache: whole directory listings, kept coherent by our own mutations and the filer's
//! metadata subscription. A listed directory answers lookups (including authoritative ENOENT)
//! and readdir without leaving the process while it is fresh.

use crate::budget::MemoryBudget;
use crate::pb::filer as pb;
use parking_lot::Mutex;
use prost::Message;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Listing {
    entries: BTreeMap<String, Arc<pb::Entry>>,
    loaded: Instant,
    /// Number of subdirectories (for the directory's link count).
    subdirs: usize,
    /// Bytes charged for its entries ([`entry_weight`]).
    weight: u64,
    /// When it last answered a lookup or listing ([`Inner::tick`]): the least recently used
    /// listings are dropped first.
    used: u64,
}

/// Memory one cached entry takes, approximately: the entry's fields (its encoded size is a
/// fair measure of its strings and chunk list), the struct, the name kept twice (key and
/// entry) and the tree's and `Arc`'s bookkeeping.
pub fn entry_weight(e: &pb::Entry) -> u64 {
    (e.encoded_len() + std::mem::size_of::<pb::Entry>() + e.name.len() + 128) as u64
}

struct Inner {
    dirs: HashMap<String, Listing>,
    /// A directory's generation: the value of `counter` at its last change, so a listing that
    /// raced with a change is not installed over it. Directories not cached are pruned from
    /// it; theirs is then `floor` (the counter at the last prune), which differs from any
    /// generation a listing in flight took if anything changed since.
    gens: HashMap<String, u64>,
    counter: u64,
    floor: u64,
    /// Bytes charged by every listing here.
    weight: u64,
    tick: u64,
    ttl: Duration,
    budget: Arc<MemoryBudget>,
    /// Latest known shared state (attributes, chunks, link count) of each hard-link group.
    /// Every name of the group shows it, so a change through one name is seen through all.
    links: HashMap<Vec<u8>, Arc<pb::Entry>>,
    /// Directories found too large to cache, and when: not listed again within the TTL.
    too_large: HashMap<String, Instant>,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            dirs: HashMap::new(),
            gens: HashMap::new(),
            counter: 0,
            floor: 0,
            weight: 0,
            tick: 0,
            ttl: Duration::ZERO,
            budget: MemoryBudget::new(u64::MAX),
            links: HashMap::new(),
            too_large: HashMap::new(),
        }
    }
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

impl Inner {
    fn bump(&mut self, dir: &str) {
        self.counter += 1;
        let c = self.counter;
        self.gens.insert(dir.to_string(), c);
    }

    /// A directory's generation, remembered from now on: a change to it after this point
    /// gives another.
    fn generation(&mut self, dir: &str) -> u64 {
        let c = self.counter;
        *self.gens.entry(dir.to_string()).or_insert(c)
    }

    /// Whether `gen` is still the directory's generation (a listing taken at `gen` may be
    /// installed). A generation pruned since is `floor`: equal only if nothing changed at all.
    fn current(&self, dir: &str, gen: u64) -> bool {
        self.gens.get(dir).copied().unwrap_or(self.floor) == gen
    }

    fn touch(&mut self, dir: &str) {
        self.tick += 1;
        let t = self.tick;
        if let Some(l) = self.dirs.get_mut(dir) {
            l.used = t;
        }
    }

    /// Changes a listing's weight (and the session's, and the node's) by `add - sub`.
    fn reweigh(&mut self, dir: &str, add: u64, sub: u64) {
        if let Some(l) = self.dirs.get_mut(dir) {
            let sub = sub.min(l.weight + add);
            l.weight = l.weight + add - sub;
            self.weight = self.weight + add - sub;
            self.budget.meta_add(add);
            self.budget.meta_sub(sub);
        }
    }

    /// Drops one listing, giving back its weight.
    fn drop_listing(&mut self, dir: &str) {
        if let Some(l) = self.dirs.remove(dir) {
            self.weight -= l.weight.min(self.weight);
            self.budget.meta_sub(l.weight);
        }
    }

    fn drop_expired(&mut self, keep: &str) -> bool {
        let ttl = self.ttl;
        let expired: Vec<String> = self
            .dirs
            .iter()
            .filter(|(d, l)| d.as_str() != keep && l.loaded.elapsed() >= ttl)
            .map(|(d, _)| d.clone())
            .collect();
        let dropped = !expired.is_empty();
        for d in expired {
            self.drop_listing(&d);
        }
        dropped
    }

    /// Drops the least recently used listings (never `keep`) until this session holds at
    /// most `to` bytes or the node is within `node_to`.
    fn shed(&mut self, keep: &str, to: u64, node_to: u64) -> bool {
        if self.weight <= to {
            return false;
        }
        let mut by_use: Vec<(u64, String)> = self
            .dirs
            .iter()
            .filter(|(d, _)| d.as_str() != keep)
            .map(|(d, l)| (l.used, d.clone()))
            .collect();
        by_use.sort_unstable();
        let mut dropped = false;
        for (_, d) in by_use {
            if self.weight <= to || self.budget.meta() <= node_to {
                break;
            }
            self.drop_listing(&d);
            dropped = true;
        }
        if dropped {
            self.prune();
        }
        dropped
    }

    /// Forgets the generations and hard-link states that no cached listing needs.
    fn prune(&mut self) {
        let dirs = &self.dirs;
        self.gens.retain(|d, _| dirs.contains_key(d));
        self.floor = self.counter;
        if self.links.is_empty() {
            return;
        }
        let used: std::collections::HashSet<Vec<u8>> = self
            .dirs
            .values()
            .flat_map(|l| l.entries.values())
            .filter(|e| !e.hard_link_id.is_empty())
            .map(|e| e.hard_link_id.clone())
            .collect();
        self.links.retain(|id, _| used.contains(id));
    }
}

/// Every session's metadata cache, so that one that needs room can make others give back
/// what they hold past their fair share.
static SESSIONS: Mutex<Vec<std::sync::Weak<Mutex<Inner>>>> = Mutex::new(Vec::new());

pub struct MetaCache {
    inner: Arc<Mutex<Inner>>,
    ttl: Duration,
    /// Listings of more entries are not cached (see [`Self::install`]'s caller).
    max_entries: usize,
    /// The node's budget: the metadata caches of every session share its metadata part.
    budget: Arc<MemoryBudget>,
}

impl Drop for MetaCache {
    fn drop(&mut self) {
        let mut g = self.inner.lock();
        self.budget.meta_sub(g.weight);
        g.weight = 0;
        g.dirs.clear();
    }
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
    /// A cache with no budget (for tests and tools).
    pub fn new(ttl: Duration) -> Self {
        Self::with_budget(ttl, MemoryBudget::new(u64::MAX))
    }

    pub fn with_budget(ttl: Duration, budget: Arc<MemoryBudget>) -> Self {
        let inner = Arc::new(Mutex::new(Inner {
            ttl,
            budget: budget.clone(),
            ..Inner::default()
        }));
        let mut all = SESSIONS.lock();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&inner));
        MetaCache {
            inner,
            ttl,
            max_entries: usize::MAX,
            budget,
        }
    }

    /// Listings that grow past `n` entries (our own creates) stop being cached.
    pub fn with_max_entries(mut self, n: usize) -> Self {
        self.max_entries = n;
        self
    }

    /// Bytes this session's listings are charged.
    pub fn weight(&self) -> u64 {
        self.inner.lock().weight
    }

    /// Brings the node's metadata back within its part of the budget (call without holding
    /// any session's lock): expired listings go everywhere; then every session holding more
    /// than a fair share of 7/8 of the limit sheds its least recently used listings down to
    /// it, largest first; then, if the node is still over, this session sheds more. `keep`
    /// (this session's listing just installed) stays. Shedding to 7/8 makes this run once
    /// per many installs.
    fn relieve(&self, keep: &str) {
        let limit = self.budget.meta_limit();
        if self.budget.meta() <= limit {
            return;
        }
        let target = limit / 8 * 7;
        let mine = Arc::as_ptr(&self.inner);
        let sessions: Vec<Arc<Mutex<Inner>>> =
            SESSIONS.lock().iter().filter_map(|w| w.upgrade()).collect();
        let sessions: Vec<Arc<Mutex<Inner>>> = sessions
            .into_iter()
            .filter(|s| Arc::ptr_eq(&s.lock().budget, &self.budget))
            .collect();
        let keep_of = |s: &Arc<Mutex<Inner>>| if Arc::as_ptr(s) == mine { keep } else { "" };
        let mut dropped = false;
        for s in &sessions {
            dropped |= s.lock().drop_expired(keep_of(s));
        }
        let fair = target / sessions.len().max(1) as u64;
        let mut by_weight: Vec<(u64, &Arc<Mutex<Inner>>)> =
            sessions.iter().map(|s| (s.lock().weight, s)).collect();
        by_weight.sort_unstable_by_key(|(w, _)| std::cmp::Reverse(*w));
        for (_, s) in by_weight {
            if self.budget.meta() <= target {
                break;
            }
            dropped |= s.lock().shed(keep_of(s), fair, target);
        }
        if self.budget.meta() > target {
            dropped |= self.inner.lock().shed(keep, 0, target);
        }
        if dropped {
            self.budget.count_meta_eviction();
        }
    }

    /// Drops expired listings and what only they needed (run now and then: a session that
    /// stopped listing would otherwise keep them).
    pub fn sweep(&self) {
        let mut g = self.inner.lock();
        // generations of directories not cached pile up with every change; pruned when they
        // outnumber the listings by far (a prune refuses listings in flight)
        if g.drop_expired("") || g.gens.len() > 2 * g.dirs.len() + 1024 {
            g.prune();
        }
    }

    fn fresh(&self, l: &Listing) -> bool {
        l.loaded.elapsed() < self.ttl
    }

    pub fn lookup(&self, dir: &str, name: &str) -> Cached {
        let mut g = self.inner.lock();
        let r = match g.dirs.get(dir) {
            Some(l) if self.fresh(l) => match l.entries.get(name) {
                Some(e) => Cached::Found(overlay(&g.links, e)),
                None => Cached::Absent,
            },
            _ => return Cached::Unknown,
        };
        g.touch(dir);
        r
    }

    /// Sorted entries of a fresh cached directory.
    pub fn listing(&self, dir: &str) -> Option<Vec<Arc<pb::Entry>>> {
        let mut g = self.inner.lock();
        let l: Vec<_> = g
            .dirs
            .get(dir)
            .filter(|l| self.fresh(l))
            .map(|l| l.entries.values().map(|e| overlay(&g.links, e)).collect())?;
        g.touch(dir);
        Some(l)
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
        self.inner.lock().generation(dir)
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
        let mut map: BTreeMap<String, Arc<pb::Entry>> = entries
            .into_iter()
            .map(|e| (e.name.clone(), Arc::new(e)))
            .collect();
        for p in pinned {
            map.insert(p.name.clone(), p.clone());
        }
        let weight: u64 = map.values().map(|e| entry_weight(e)).sum();
        let mut g = self.inner.lock();
        if !g.current(dir, gen) {
            return false;
        }
        g.drop_listing(dir);
        if weight > self.budget.meta_limit() / 2 {
            // it would push out everything else, and be pushed out itself at once
            drop(g);
            self.mark_too_large(dir);
            return false;
        }
        for e in map.values() {
            if !e.hard_link_id.is_empty() {
                // fresh from the filer: newer than anything we held
                g.links.insert(e.hard_link_id.clone(), e.clone());
            }
        }
        let subdirs = map.values().filter(|e| e.is_directory).count();
        g.tick += 1;
        let used = g.tick;
        g.dirs.insert(
            dir.to_string(),
            Listing {
                entries: map,
                loaded: Instant::now(),
                subdirs,
                weight,
                used,
            },
        );
        g.weight += weight;
        self.budget.meta_add(weight);
        drop(g);
        self.relieve(dir);
        true
    }

    /// An entry was created or changed in `dir`.
    pub fn upsert(&self, dir: &str, entry: Arc<pb::Entry>) {
        let mut g = self.inner.lock();
        g.bump(dir);
        if !entry.hard_link_id.is_empty() {
            g.links.insert(entry.hard_link_id.clone(), entry.clone());
        }
        let mut weights = None;
        if let Some(l) = g.dirs.get_mut(dir) {
            let new_dir = entry.is_directory;
            let add = entry_weight(&entry);
            let mut sub = 0;
            if let Some(old) = l.entries.insert(entry.name.clone(), entry) {
                sub = entry_weight(&old);
                if old.is_directory {
                    l.subdirs -= 1;
                }
            }
            if new_dir {
                l.subdirs += 1;
            }
            weights = Some((add, sub));
        }
        if let Some((add, sub)) = weights {
            g.reweigh(dir, add, sub);
            // grown past what a listing may be: not cached any more, as if listed so now
            let over = g.dirs.get(dir).is_some_and(|l| {
                l.weight > self.budget.meta_limit() / 2 || l.entries.len() > self.max_entries
            });
            if over {
                g.drop_listing(dir);
                drop(g);
                self.mark_too_large(dir);
                return;
            }
            drop(g);
            self.relieve(dir);
        }
    }

    /// An entry was removed from `dir`.
    pub fn remove(&self, dir: &str, name: &str) {
        let mut g = self.inner.lock();
        g.bump(dir);
        let mut sub = None;
        if let Some(l) = g.dirs.get_mut(dir) {
            if let Some(old) = l.entries.remove(name) {
                if old.is_directory {
                    l.subdirs -= 1;
                }
                sub = Some(entry_weight(&old));
            }
        }
        if let Some(sub) = sub {
            g.reweigh(dir, 0, sub);
        }
    }

    /// Drops a directory's listing (and everything below it when `recursive`).
    pub fn invalidate_dir(&self, dir: &str, recursive: bool) {
        let mut g = self.inner.lock();
        g.bump(dir);
        g.drop_listing(dir);
        if recursive {
            let prefix = format!("{}/", dir.trim_end_matches('/'));
            let below: Vec<String> = g
                .dirs
                .keys()
                .chain(g.gens.keys())
                .filter(|k| k.starts_with(&prefix))
                .cloned()
                .collect();
            // listings in flight below it too (their directories are in `gens`)
            for k in below {
                g.bump(&k);
                g.drop_listing(&k);
            }
        }
    }

    /// After a subscription gap nothing cached can be trusted.
    pub fn invalidate_all(&self) {
        let mut g = self.inner.lock();
        let keys: Vec<String> = g.dirs.keys().cloned().collect();
        for k in keys {
            g.drop_listing(&k);
        }
        // every generation moves on, listings in flight for uncached directories included
        g.counter += 1;
        g.gens.clear();
        g.floor = g.counter;
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

    fn many(prefix: &str, n: usize) -> Vec<pb::Entry> {
        (0..n).map(|i| e(&format!("{prefix}-{i:06}"))).collect()
    }

    /// Two sessions share a 16 MiB metadata part (a 128 MiB budget). Listings are dropped
    /// least recently used first, by the session that needs room, and the node's total stays
    /// within the limit; a dropped listing answers "ask the filer", never "absent".
    #[test]
    fn listings_beyond_the_metadata_budget_are_dropped_least_recently_used_first() {
        let budget = MemoryBudget::new(128 << 20);
        let limit = budget.meta_limit();
        assert_eq!(limit, 16 << 20);
        let a = MetaCache::with_budget(Duration::from_secs(600), budget.clone());
        let b = MetaCache::with_budget(Duration::from_secs(600), budget.clone());
        let one = many("x", 5000).iter().map(entry_weight).sum::<u64>();
        assert!(one > 1 << 20, "{one}");
        a.install("/hot", many("h", 5000), a.generation("/hot"), &[]);
        for d in 0..40 {
            let dir = format!("/a{d}");
            assert!(a.install(&dir, many("x", 5000), a.generation(&dir), &[]));
            // the hot one is used between installs
            assert!(matches!(a.lookup("/hot", "h-000001"), Cached::Found(_)));
            assert!(budget.meta() <= limit, "{} > {limit}", budget.meta());
        }
        // b's five listings are well under its fair share (7/8 of the limit, halved)
        for d in 0..5 {
            let dir = format!("/b{d}");
            assert!(b.install(&dir, many("y", 2000), b.generation(&dir), &[]));
        }
        assert!(b.weight() < limit / 8 * 7 / 2, "{}", b.weight());
        assert!(budget.meta() <= limit);
        assert_eq!(a.weight() + b.weight(), budget.meta());
        // b asked for room under its fair share: a, over its share, gave it
        for d in 0..5 {
            assert!(b.is_cached(&format!("/b{d}")), "b's /b{d} was dropped");
        }
        assert!(matches!(a.lookup("/hot", "h-000002"), Cached::Found(_)));
        assert!(matches!(a.lookup("/a39", "x-000002"), Cached::Found(_)));
        // the oldest were dropped: unknown, so the filer is asked
        assert!(matches!(a.lookup("/a0", "x-000002"), Cached::Unknown));
        assert!(matches!(a.lookup("/a0", "nope"), Cached::Unknown));
        assert!(
            budget
                .meta_evictions
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
        );
        drop(a);
        assert_eq!(
            budget.meta(),
            b.weight(),
            "a closed session gives back its part"
        );
    }

    #[test]
    fn a_listing_too_heavy_for_the_budget_is_not_cached() {
        let budget = MemoryBudget::new(64 << 20); // 16 MiB floor
        let m = MetaCache::with_budget(Duration::from_secs(600), budget.clone());
        assert!(!m.install("/huge", many("z", 60_000), m.generation("/huge"), &[]));
        assert!(m.is_too_large("/huge"));
        assert!(matches!(m.lookup("/huge", "z-000001"), Cached::Unknown));
        assert_eq!(budget.meta(), 0);
    }

    /// Changes to directories that are not cached leave no generation behind once swept, and
    /// a listing taken before such a change is still refused after the sweep.
    #[test]
    fn swept_generations_still_refuse_a_listing_older_than_a_change() {
        let m = MetaCache::new(Duration::from_millis(0));
        for d in 0..2000 {
            m.upsert(&format!("/d{d}"), Arc::new(e("a")));
        }
        let before = m.generation("/x");
        m.remove("/x", "old");
        m.sweep();
        assert!(m.inner.lock().gens.is_empty());
        assert!(!m.install("/x", vec![e("old")], before, &[]));
        // a listing of a directory nothing changed in is installed (a few generations are
        // not pruned: a prune would refuse it)
        let m = MetaCache::new(Duration::from_secs(60));
        let g = m.generation("/y");
        m.upsert("/other", Arc::new(e("a")));
        m.sweep();
        m.upsert("/other", Arc::new(e("b")));
        assert!(m.install("/y", vec![e("a")], g, &[]));
    }

    /// A listing grown by our own creates past what a listing may be (entries or weight) is
    /// not cached any more; a listing in flight for a directory that was not cached is
    /// refused after a subscription gap (invalidate_all).
    #[test]
    fn a_listing_grown_past_its_limits_stops_being_cached() {
        let budget = MemoryBudget::new(1 << 30);
        let m =
            MetaCache::with_budget(Duration::from_secs(600), budget.clone()).with_max_entries(100);
        m.install("/d", many("x", 90), m.generation("/d"), &[]);
        for i in 0..20 {
            m.upsert("/d", Arc::new(e(&format!("new{i}"))));
        }
        assert!(!m.is_cached("/d"));
        assert!(m.is_too_large("/d"));
        assert!(matches!(m.lookup("/d", "x-000001"), Cached::Unknown));
        assert_eq!((m.weight(), budget.meta()), (0, 0));
        let small = MemoryBudget::new(64 << 20); // 16 MiB part: listings up to 8 MiB
        let m = MetaCache::with_budget(Duration::from_secs(600), small.clone());
        m.install("/w", vec![], m.generation("/w"), &[]);
        for i in 0..30_000 {
            m.upsert("/w", Arc::new(e(&format!("n{i:06}"))));
        }
        assert!(!m.is_cached("/w"));
        assert!(small.meta() <= small.meta_limit() / 2);
        assert_eq!(
            small
                .meta_evictions
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        let g = m.generation("/never-cached");
        m.invalidate_all();
        assert!(!m.install("/never-cached", vec![e("a")], g, &[]));
    }

    #[test]
    fn weights_follow_upserts_removes_and_invalidation() {
        let budget = MemoryBudget::new(1 << 30);
        let m = MetaCache::with_budget(Duration::from_secs(60), budget.clone());
        m.install("/d", vec![e("a")], m.generation("/d"), &[]);
        let w1 = m.weight();
        m.upsert("/d", Arc::new(e("bbbbbbbb")));
        assert_eq!(m.weight(), w1 + entry_weight(&e("bbbbbbbb")));
        m.remove("/d", "a");
        assert_eq!(m.weight(), entry_weight(&e("bbbbbbbb")));
        m.install("/d/s", vec![e("c")], m.generation("/d/s"), &[]);
        m.invalidate_dir("/d", true);
        assert_eq!((m.weight(), budget.meta()), (0, 0));
    }

    #[test]
    fn ttl_expires() {
        let m = MetaCache::new(Duration::from_millis(0));
        m.install("/d", vec![e("a")], 0, &[]);
        assert!(matches!(m.lookup("/d", "a"), Cached::Unknown));
    }
}
