//! Inode table: FUSE node id (= the filer's `attributes.inode`, root = 1) <-> filer path.
//!
//! The kernel keeps using node ids across a plugin restart, so the table can be exported and
//! re-imported by a successor process ([`InodeTable::snapshot`] / [`InodeTable::restore`]).

use super::attr::Kind;
use super::journal::{Journal, JournalOp};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;

pub const ROOT_INO: u64 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub ino: u64,
    pub path: String,
    pub is_dir: bool,
    pub nlookup: u64,
    /// Further names of a hard-linked file (`path` is the one used for filer calls).
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Creation time (seconds, nanoseconds) of the file this node stands for, when known:
    /// the filer can give two files one inode (see [`InodeTable::resolve`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub birth: Option<(i64, i32)>,
    /// The filer's number for the file when the node id is derived from it (see
    /// [`InodeTable::claim`]); None: the node id is the filer's number (or unknown, for a
    /// record from an older process or the crash journal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<u64>,
    /// The node stands for a link group (its number is the group's): a plain file met at
    /// one of its names is another file, such as an upload that replaced that name and
    /// kept the number.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub linked: bool,
}

impl NodeRecord {
    fn base(&self) -> u64 {
        self.base.unwrap_or(self.ino)
    }

    /// Whether this node may stand for the file `id` (an unknown birth matches any).
    fn stands_for(&self, id: &FileId) -> bool {
        // a record from the crash journal keeps no number: a derived id is known by its
        // derivation from the path it was made for
        let base_ok = self.base() == id.base
            || (self.base.is_none()
                && (0..16).any(|k| derived(id.base, &self.path, id.birth, k) == self.ino));
        base_ok
            && !self.linked
            && self.is_dir == id.is_dir
            && !(id.birth.0 != 0 && self.birth.is_some_and(|b| born_apart(b, id.birth)))
    }
}

/// What the filer says about a file (not a hard link): its number, creation time (seconds,
/// nanoseconds; 0 seconds when unknown) and kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    pub base: u64,
    pub birth: (i64, i32),
    pub is_dir: bool,
}

/// The answer of [`InodeTable::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The node id to use.
    Id(u64),
    /// The number is known here as the file at this other path, born in the same second:
    /// whether that path still holds a file with this number on the filer decides.
    Ask(String),
}

/// Two creation times of different files. Nanoseconds count only when both have them (a
/// client that drops them must not make a file look new).
fn born_apart(a: (i64, i32), b: (i64, i32)) -> bool {
    a.0 != b.0 || (a.1 != 0 && b.1 != 0 && a.1 != b.1)
}

/// Another node id for the file numbered `base` first seen at `path` (try `k`); never 0 or
/// 1. The same inputs give the same id, so every place that meets the file agrees on it.
fn derived(base: u64, path: &str, birth: (i64, i32), k: u64) -> u64 {
    // FNV-1a over the path, then the splitmix64 finaliser over everything
    let ph = path.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    let mut z = base
        ^ ph.rotate_left(17)
        ^ (birth.0 as u64).rotate_left(32)
        ^ (birth.1 as u32 as u64)
        ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    z.max(ROOT_INO + 1)
}

#[derive(Default)]
struct Inner {
    /// Boxed: a table sized for a million nodes has ~2 million slots (a power of two), so a
    /// slot holding the record itself (112 bytes) cost ~240 bytes per node.
    by_ino: HashMap<u64, Box<NodeRecord>>,
    /// `Box<str>` keys: 8 bytes less per slot than `String`. (A sorted map would make a
    /// directory's descendants one range, but every lookup 3-4x slower at a million.)
    by_path: HashMap<Box<str>, u64>,
    /// Records of other nodes a change touched on the way (a hard link's next name made
    /// its primary one), journaled with the change.
    touched: Vec<JournalOp>,
}

pub struct InodeTable {
    inner: RwLock<Inner>,
    journal: RwLock<Option<Arc<Journal>>>,
}

impl InodeTable {
    pub fn new(root_path: &str) -> Self {
        let t = InodeTable {
            inner: RwLock::new(Inner::default()),
            journal: RwLock::new(None),
        };
        t.inner.write().by_ino.insert(
            ROOT_INO,
            Box::new(NodeRecord {
                ino: ROOT_INO,
                path: root_path.to_string(),
                is_dir: true,
                nlookup: 1,
                aliases: Vec::new(),
                birth: None,
                base: None,
                linked: false,
            }),
        );
        t.inner.write().by_path.insert(root_path.into(), ROOT_INO);
        t
    }

    /// Starts recording every change to `j` (after writing the current table into it; no
    /// change slips in between).
    pub fn set_journal(&self, j: Arc<Journal>) {
        let g = self.inner.write();
        for op in Self::records_of(&g) {
            Self::log(&j, &op);
        }
        *self.journal.write() = Some(j);
    }

    /// The table as journal records (the root is implied).
    fn records_of(g: &Inner) -> Vec<JournalOp> {
        g.by_ino
            .values()
            .filter(|r| r.ino != ROOT_INO)
            .map(|r| Self::remembered(r.ino, &r.path, r.is_dir))
            .collect()
    }

    fn log(j: &Journal, op: &JournalOp) {
        if let Err(e) = j.append(op) {
            tracing::warn!(error = %e, "inode journal append failed");
        }
    }

    /// Makes a change under the table's write lock and journals the record `f` returns for
    /// it before the lock goes: records land in the order of the changes they stand for,
    /// else a successor's replay of two racing changes to one node ends in a state the table
    /// never had. Compacts the journal afterwards, without the write lock.
    fn change<R, I: IntoIterator<Item = JournalOp>>(
        &self,
        f: impl FnOnce(&mut Inner) -> (R, I),
    ) -> R {
        let r = {
            let mut g = self.inner.write();
            let (r, ops) = f(&mut g);
            let touched = std::mem::take(&mut g.touched);
            for op in ops.into_iter().chain(touched) {
                #[cfg(test)]
                tests::journal_pause();
                if let Some(j) = self.journal.read().as_ref() {
                    Self::log(j, &op);
                }
            }
            r
        };
        self.compact_journal();
        r
    }

    /// The record of `ino` now being known as `path`.
    fn remembered(ino: u64, path: &str, is_dir: bool) -> JournalOp {
        JournalOp::Remember {
            ino,
            path: path.to_string(),
            is_dir,
        }
    }

    /// Compacts the journal when it has grown large; called without the table's lock held.
    /// The snapshot is taken under the read lock, which also keeps appends (made under the
    /// write lock) out until the compaction is done: the snapshot is the journal's end state.
    fn compact_journal(&self) {
        // the journal's guard is let go first: set_journal takes the two the other way round
        let j = self.journal.read().clone();
        if let Some(j) = j.filter(|j| j.due()) {
            let g = self.inner.read();
            let _ = j.maybe_compact(|| Self::records_of(&g));
        }
    }

    /// Rebuilds the table from a journal written by a previous process.
    pub fn replay(&self, ops: Vec<JournalOp>) {
        for op in ops {
            match op {
                JournalOp::Remember { ino, path, is_dir } => {
                    let kind = if is_dir { Kind::Dir } else { Kind::File };
                    self.remember_quiet(ino, &path, kind, true, false);
                }
                JournalOp::Forget { ino } => {
                    self.forget_quiet(ino, u64::MAX);
                }
                JournalOp::Rename { from, to } => self.rename_quiet(&from, &to, false),
            }
        }
    }

    pub fn path(&self, ino: u64) -> Option<String> {
        self.inner.read().by_ino.get(&ino).map(|n| n.path.clone())
    }

    /// The kernel's lookup count of a node as kept here (0 when unknown).
    #[cfg(test)]
    pub fn nlookup_of(&self, ino: u64) -> u64 {
        self.inner.read().by_ino.get(&ino).map_or(0, |n| n.nlookup)
    }

    pub fn ino_of(&self, path: &str) -> Option<u64> {
        self.inner.read().by_path.get(path).copied()
    }

    /// Records that the kernel now knows `ino` as `path` (one more lookup when `counted`).
    /// A different path replaces the old one (the node was renamed elsewhere).
    pub fn remember(&self, ino: u64, path: &str, kind: Kind, counted: bool) {
        self.remember_as(ino, path, kind, counted, false)
    }

    /// Like [`remember`](Self::remember); with `hard_link` the path is added as one more name
    /// of the node instead of replacing the one it has.
    pub fn remember_as(&self, ino: u64, path: &str, kind: Kind, counted: bool, hard_link: bool) {
        self.change(|g| {
            let changed = Self::remember_in(g, ino, path, kind, counted, hard_link);
            (
                (),
                changed.then(|| Self::remembered(ino, path, kind == Kind::Dir)),
            )
        })
    }

    /// Returns whether the node's primary path is new or changed (an added alias is not
    /// journaled: a successor re-learns it from the kernel's next lookup).
    fn remember_quiet(
        &self,
        ino: u64,
        path: &str,
        kind: Kind,
        counted: bool,
        hard_link: bool,
    ) -> bool {
        let mut g = self.inner.write();
        let changed = Self::remember_in(&mut g, ino, path, kind, counted, hard_link);
        g.touched.clear();
        changed
    }

    fn remember_in(
        g: &mut Inner,
        ino: u64,
        path: &str,
        kind: Kind,
        counted: bool,
        hard_link: bool,
    ) -> bool {
        let mut changed = !g.by_ino.contains_key(&ino);
        let rec = g.by_ino.entry(ino).or_insert_with(|| {
            Box::new(NodeRecord {
                ino,
                path: path.to_string(),
                is_dir: kind == Kind::Dir,
                nlookup: 0,
                aliases: Vec::new(),
                birth: None,
                base: None,
                linked: false,
            })
        });
        if counted {
            rec.nlookup += 1;
        }
        let mut dropped = Vec::new();
        if rec.path != path {
            if hard_link {
                if !rec.aliases.iter().any(|a| a == path) {
                    rec.aliases.push(path.to_string());
                }
            } else {
                changed = true;
                dropped.push(std::mem::replace(&mut rec.path, path.to_string()));
                dropped.append(&mut rec.aliases);
            }
        }
        for old in dropped {
            if g.by_path.get(old.as_str()) == Some(&ino) {
                g.by_path.remove(old.as_str());
            }
        }
        if let Some(prev) = g.by_path.insert(path.into(), ino).filter(|p| *p != ino) {
            // the name leads to another file now: the node it led to keeps its other names
            Self::drop_name(g, prev, path);
        }
        changed
    }

    /// Takes `path` from node `ino`'s names; a hard link's next name becomes its primary
    /// one (journaled with the change, see [`Inner::touched`]).
    fn drop_name(g: &mut Inner, ino: u64, path: &str) {
        let Some(rec) = g.by_ino.get_mut(&ino) else {
            return;
        };
        rec.aliases.retain(|a| a != path);
        if rec.path != path {
            return;
        }
        // the next name that still leads to the node (a stale one would take another's)
        let by_path = &g.by_path;
        if let Some(i) = rec
            .aliases
            .iter()
            .position(|a| by_path.get(a.as_str()) == Some(&ino))
        {
            rec.path = rec.aliases.remove(i);
            let op = Self::remembered(ino, &rec.path, rec.is_dir);
            g.touched.push(op);
        }
    }

    /// Node `ino`, still known here, is reached by `path` too, a name of its link group
    /// (its open file moved there): a name that no longer leads to the node gives way as
    /// its primary one. No lookup is counted and no node is made again.
    pub fn add_link_name(&self, ino: u64, path: &str) {
        self.change(|g| {
            let Some(rec) = g.by_ino.get(&ino) else {
                return ((), None);
            };
            let dead = g.by_path.get(rec.path.as_str()) != Some(&ino);
            let is_dir = rec.is_dir;
            if let Some(prev) = g.by_path.insert(path.into(), ino).filter(|p| *p != ino) {
                Self::drop_name(g, prev, path);
            }
            let Some(rec) = g.by_ino.get_mut(&ino) else {
                return ((), None);
            };
            rec.linked = true;
            rec.aliases.retain(|a| a != path);
            if dead {
                rec.path = path.to_string();
            } else if rec.path != path {
                rec.aliases.push(path.to_string());
            }
            ((), dead.then(|| Self::remembered(ino, path, is_dir)))
        })
    }

    /// [`remember_as`](Self::remember_as) for a name of a link group's node.
    pub fn remember_link(&self, ino: u64, path: &str, kind: Kind, counted: bool) {
        self.change(|g| {
            let changed = Self::remember_in(g, ino, path, kind, counted, true);
            if let Some(rec) = g.by_ino.get_mut(&ino) {
                rec.linked = true;
            }
            (
                (),
                changed.then(|| Self::remembered(ino, path, kind == Kind::Dir)),
            )
        })
    }

    /// The node id for the file `id` at `path` (not a hard link: those share one number on
    /// purpose).
    ///
    /// The filer numbers a file created without an inode (an HTTP or S3 upload, a `weed
    /// mount` create) md5(path) + seconds * 37, so a file renamed away and a new one put at
    /// its old path within the same second share a number; as one node, each would show the
    /// other's attributes and content, and commits of one would land on the other. So:
    /// - the node the name has here is kept while it may stand for this file (same number,
    ///   kind and birth), as `weed mount` keeps a path's inode;
    /// - otherwise the filer's number, unless this table holds it for another file: one born
    ///   at another time, or of another kind, or whose name is gone here (deleted or
    ///   replaced). Such a file gets a node id derived from the number and the path;
    /// - a number held for another path, born in the same second (nanoseconds unknown, as
    ///   for uploads), is a file renamed by another client (its event not applied yet) or a
    ///   second file: [`Claim::Ask`]s whether that path still holds the number on the filer.
    pub fn claim(&self, path: &str, id: &FileId) -> Claim {
        Self::claim_in(&self.inner.read(), path, id, None)
    }

    /// The node that stands for the file `id` last known at `path` (the old entry of a move
    /// or removal): the name's node, else the number's if that name was its own, else as
    /// [`claim`](Self::claim) with the other path taken as live (a node nobody holds, when
    /// the file was never met here).
    pub fn node_of(&self, path: &str, id: &FileId) -> u64 {
        let g = self.inner.read();
        if let Some(r) = g.by_path.get(path).and_then(|x| g.by_ino.get(x)) {
            if r.stands_for(id) {
                return r.ino;
            }
        }
        // the number's node, only where that name was its own: elsewhere it may be a twin's
        let named = |r: &NodeRecord| r.path == path || r.aliases.iter().any(|a| a == path);
        if g.by_ino
            .get(&id.base)
            .is_some_and(|r| r.stands_for(id) && named(r))
        {
            return id.base;
        }
        Self::id_in(&g, path, id, true)
    }

    /// The node numbered as the file `id` says, if it may stand for that file (wherever it is).
    pub fn number_node(&self, id: &FileId) -> Option<u64> {
        let g = self.inner.read();
        g.by_ino
            .get(&id.base)
            .filter(|r| r.stands_for(id))
            .map(|r| r.ino)
    }

    /// Whether node `ino` is the one the name `path` leads to for the file `id` (the name's
    /// node standing for it, or the id [`claim`](Self::claim) gives a file met there now).
    pub fn is_node(&self, path: &str, id: &FileId, ino: u64) -> bool {
        let g = self.inner.read();
        let by_name = g.by_path.get(path) == Some(&ino);
        match g.by_ino.get(&ino) {
            Some(r) if by_name => r.stands_for(id),
            _ => Self::id_in(&g, path, id, true) == ino,
        }
    }

    /// A node id for the file `id` at `path` other than its number, for a second file with
    /// that number met at once (one directory listing).
    pub fn second_id(&self, path: &str, id: &FileId) -> u64 {
        Self::derive_in(&self.inner.read(), path, id)
    }

    /// [`claim`](Self::claim) with the answer to its question: `other_live`, whether the
    /// other path still holds the number (true when not known: two node ids for one file
    /// are safer than one for two).
    pub fn id_of(&self, path: &str, id: &FileId, other_live: bool) -> u64 {
        Self::id_in(&self.inner.read(), path, id, other_live)
    }

    fn id_in(g: &Inner, path: &str, id: &FileId, other_live: bool) -> u64 {
        match Self::claim_in(g, path, id, Some(other_live)) {
            Claim::Id(ino) => ino,
            // not asked again once answered
            Claim::Ask(_) => id.base,
        }
    }

    fn claim_in(g: &Inner, path: &str, id: &FileId, other_live: Option<bool>) -> Claim {
        if let Some(r) = g.by_path.get(path).and_then(|x| g.by_ino.get(x)) {
            if r.stands_for(id) {
                return Claim::Id(r.ino);
            }
        }
        let Some(r) = g.by_ino.get(&id.base) else {
            return Claim::Id(id.base);
        };
        if id.base == ROOT_INO {
            return Claim::Id(ROOT_INO);
        }
        let same_file = if !r.stands_for(id) {
            false
        } else if r.aliases.iter().any(|a| a == path) {
            true
        } else if id.birth.1 != 0 && r.birth == Some(id.birth) {
            // creation nanoseconds tell files apart: the same file, renamed unseen
            true
        } else if g.by_path.get(r.path.as_str()) != Some(&id.base) {
            // its name is gone here (deleted, or another file took it): a node the kernel
            // may still hold open for the old file never stands for a new one
            false
        } else {
            match other_live {
                None => return Claim::Ask(r.path.clone()),
                Some(live) => !live,
            }
        };
        if same_file {
            return Claim::Id(id.base);
        }
        Claim::Id(Self::derive_in(g, path, id))
    }

    fn derive_in(g: &Inner, path: &str, id: &FileId) -> u64 {
        let mut ino = id.base;
        for k in 0..16 {
            ino = derived(id.base, path, id.birth, k);
            match g.by_ino.get(&ino) {
                None => break,
                Some(r) if r.stands_for(id) && r.path == path => break,
                Some(_) => {}
            }
        }
        ino
    }

    /// Records that the kernel now knows the file `id` as node `ino` at `path` (one more
    /// lookup when `counted`); the number and birth go with the node.
    pub fn remember_file(&self, ino: u64, path: &str, id: &FileId, counted: bool) {
        self.change(|g| {
            let changed = Self::remember_file_in(g, ino, path, id, counted);
            ((), changed.then(|| Self::remembered(ino, path, id.is_dir)))
        })
    }

    /// Records which file node `ino` stands for, without naming it (see
    /// [`remember_file`](Self::remember_file)).
    pub fn note_file(&self, ino: u64, id: &FileId) {
        if let Some(rec) = self.inner.write().by_ino.get_mut(&ino) {
            Self::set_file(rec, ino, id);
        }
    }

    fn set_file(rec: &mut NodeRecord, ino: u64, id: &FileId) {
        rec.base = (ino != id.base).then_some(id.base);
        // a birth known to the nanosecond is not replaced by one without
        let coarser = rec
            .birth
            .is_some_and(|b| b.0 == id.birth.0 && id.birth.1 == 0);
        if id.birth.0 != 0 && ino != ROOT_INO && !coarser {
            rec.birth = Some(id.birth);
        }
    }

    /// [`claim`](Self::claim) and [`remember_file`](Self::remember_file) under one lock, so
    /// two files met at once cannot both take one number. Err: the question to answer
    /// first (call again with `other_live`).
    pub fn claim_and_remember(
        &self,
        path: &str,
        id: &FileId,
        counted: bool,
        other_live: Option<bool>,
    ) -> std::result::Result<u64, String> {
        self.change(|g| {
            let ino = match Self::claim_in(g, path, id, other_live) {
                Claim::Id(ino) => ino,
                Claim::Ask(other) => return (Err(other), None),
            };
            let changed = Self::remember_file_in(g, ino, path, id, counted);
            (
                Ok(ino),
                changed.then(|| Self::remembered(ino, path, id.is_dir)),
            )
        })
    }

    fn remember_file_in(g: &mut Inner, ino: u64, path: &str, id: &FileId, counted: bool) -> bool {
        let kind = if id.is_dir { Kind::Dir } else { Kind::File };
        let changed = Self::remember_in(g, ino, path, kind, counted, false);
        if let Some(rec) = g.by_ino.get_mut(&ino) {
            Self::set_file(rec, ino, id);
        }
        changed
    }

    /// Kernel FORGET: drops the mapping when its lookup count reaches zero (then true).
    pub fn forget(&self, ino: u64, n: u64) -> bool {
        self.change(|g| {
            let gone = Self::forget_in(g, ino, n);
            (gone, gone.then_some(JournalOp::Forget { ino }))
        })
    }

    /// Returns whether the node was dropped.
    fn forget_quiet(&self, ino: u64, n: u64) -> bool {
        Self::forget_in(&mut self.inner.write(), ino, n)
    }

    fn forget_in(g: &mut Inner, ino: u64, n: u64) -> bool {
        if ino == ROOT_INO {
            return false;
        }
        let gone = match g.by_ino.get_mut(&ino) {
            Some(rec) => {
                rec.nlookup = rec.nlookup.saturating_sub(n);
                rec.nlookup == 0
            }
            None => false,
        };
        if gone {
            if let Some(rec) = g.by_ino.remove(&ino) {
                for p in std::iter::once(&rec.path).chain(rec.aliases.iter()) {
                    if g.by_path.get(p.as_str()) == Some(&ino) {
                        g.by_path.remove(p.as_str());
                    }
                }
            }
        }
        gone
    }

    /// A path was deleted: forget the path mapping (the node id lives on until FORGET). A
    /// hard-linked node keeps being reachable through its other names.
    pub fn unlink_path(&self, path: &str) {
        self.change(|g| {
            let Some(ino) = g.by_path.remove(path) else {
                return ((), None);
            };
            Self::drop_name(g, ino, path);
            ((), None)
        })
    }

    /// The names that lead to node `ino` here now (a removed name stays the node's path
    /// until it is forgotten, but leads nowhere).
    pub fn live_names(&self, ino: u64) -> Vec<String> {
        let g = self.inner.read();
        match g.by_ino.get(&ino) {
            Some(rec) => std::iter::once(&rec.path)
                .chain(rec.aliases.iter())
                .filter(|p| g.by_path.get(p.as_str()) == Some(&ino))
                .cloned()
                .collect(),
            None => Vec::new(),
        }
    }

    /// Every known name of a node (the primary one first).
    pub fn aliases(&self, ino: u64) -> Vec<String> {
        let g = self.inner.read();
        match g.by_ino.get(&ino) {
            Some(rec) => std::iter::once(rec.path.clone())
                .chain(rec.aliases.iter().cloned())
                .collect(),
            None => Vec::new(),
        }
    }

    /// `old` (and everything below it) is now at `new`. `file`: the filer entry moved is not
    /// a directory (its caller knows), so only the name itself moves; otherwise every known
    /// path is scanned for descendants (~50 ms under the lock with a million).
    pub fn rename(&self, old: &str, new: &str, file: bool) {
        self.change(|g| {
            Self::rename_in(g, old, new, file);
            let op = JournalOp::Rename {
                from: old.to_string(),
                to: new.to_string(),
            };
            ((), Some(op))
        })
    }

    fn rename_quiet(&self, old: &str, new: &str, file: bool) {
        let mut g = self.inner.write();
        Self::rename_in(&mut g, old, new, file);
        g.touched.clear();
    }

    fn rename_in(g: &mut Inner, old: &str, new: &str, file: bool) {
        let prefix = format!("{}/", old.trim_end_matches('/'));
        let moved: Vec<(String, u64)> = if file {
            // (a record here that calls the name a directory is stale: the filer's word wins)
            g.by_path
                .get(old)
                .map(|&i| vec![(old.to_string(), i)])
                .unwrap_or_default()
        } else {
            g.by_path
                .iter()
                .filter(|(p, _)| &***p == old || p.starts_with(&prefix))
                .map(|(p, i)| (p.to_string(), *i))
                .collect()
        };
        let mut displaced = Vec::new();
        for (p, ino) in moved {
            let np = format!("{}{}", new, &p[old.len()..]);
            g.by_path.remove(p.as_str());
            if let Some(prev) = g.by_path.insert(np.as_str().into(), ino) {
                if prev != ino {
                    displaced.push((prev, np.clone()));
                }
            }
            if let Some(rec) = g.by_ino.get_mut(&ino) {
                if rec.path == p {
                    rec.path = np;
                } else if let Some(a) = rec.aliases.iter_mut().find(|a| **a == p) {
                    *a = np;
                }
            }
        }
        // files replaced at the new names: a hard link of one keeps its other names (taken
        // once every name has moved, so a promoted name is journaled where it ends up)
        for (prev, np) in displaced {
            Self::drop_name(g, prev, &np);
        }
    }

    pub fn snapshot(&self) -> Vec<NodeRecord> {
        self.inner
            .read()
            .by_ino
            .values()
            .map(|r| NodeRecord::clone(r))
            .collect()
    }

    pub fn restore(&self, records: Vec<NodeRecord>) {
        let mut g = self.inner.write();
        for r in records {
            if r.ino == ROOT_INO {
                continue;
            }
            g.by_path.insert(r.path.as_str().into(), r.ino);
            g.by_ino.insert(r.ino, Box::new(r));
        }
    }

    pub fn len(&self) -> usize {
        self.inner.read().by_ino.len()
    }

    /// Up to `n` nodes for the kernel to forget (see [`crate::fs::Fs::prune_nodes`]): files
    /// first, then directories, deepest first (a directory's dentry goes only after its
    /// children's). Never the root, nor a file `in_use` says is, nor one the kernel does not
    /// hold (asking for those would be wasted, and the same ones would be asked for again
    /// and again).
    pub fn prune_candidates(&self, n: usize, in_use: impl Fn(u64) -> bool) -> Vec<u64> {
        let g = self.inner.read();
        let mut out: Vec<u64> = g
            .by_ino
            .values()
            .filter(|r| !r.is_dir && r.nlookup > 0 && !in_use(r.ino))
            .map(|r| r.ino)
            .take(n)
            .collect();
        let want = n - out.len();
        if want > 0 {
            let mut dirs: Vec<(usize, u64)> = g
                .by_ino
                .values()
                .filter(|r| r.is_dir && r.ino != ROOT_INO && r.nlookup > 0 && !in_use(r.ino))
                .map(|r| (r.path.matches('/').count(), r.ino))
                .collect();
            drop(g);
            // the `want` deepest, without sorting them all
            let by_depth = |d: &(usize, u64)| std::cmp::Reverse(d.0);
            if dirs.len() > want {
                dirs.select_nth_unstable_by_key(want, by_depth);
                dirs.truncate(want);
            }
            dirs.sort_unstable_by_key(by_depth);
            out.extend(dirs.into_iter().map(|(_, ino)| ino));
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Joins a directory path and a name.
pub fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// Splits a full path into (parent directory, name).
pub fn split(path: &str) -> (String, String) {
    match path.rfind('/') {
        Some(0) => ("/".to_string(), path[1..].to_string()),
        Some(i) => (path[..i].to_string(), path[i + 1..].to_string()),
        None => ("/".to_string(), path.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_moves_descendants_and_forget_drops() {
        let t = InodeTable::new("/m");
        t.remember(10, "/m/a", Kind::Dir, true);
        t.remember(11, "/m/a/f", Kind::File, true);
        t.remember(12, "/m/ab", Kind::File, true);
        // names that share the prefix without being below it, and a deeper one
        t.remember(13, "/m/a-x", Kind::File, true);
        t.remember(14, "/m/a.y/z", Kind::File, true);
        t.remember(15, "/m/a/d/g", Kind::File, true);
        t.rename("/m/a", "/m/b", false);
        assert_eq!(t.path(10).unwrap(), "/m/b");
        assert_eq!(t.path(11).unwrap(), "/m/b/f");
        assert_eq!(t.path(12).unwrap(), "/m/ab");
        assert_eq!(t.path(13).unwrap(), "/m/a-x");
        assert_eq!(t.path(14).unwrap(), "/m/a.y/z");
        assert_eq!(t.path(15).unwrap(), "/m/b/d/g");
        assert_eq!(t.ino_of("/m/a/d/g"), None);
        // a file moves alone, also when a stale record calls its name a directory
        t.remember(16, "/m/file", Kind::Dir, true);
        t.remember(17, "/m/file/stale", Kind::File, true);
        t.rename("/m/file", "/m/file2", true);
        assert_eq!(t.path(16).unwrap(), "/m/file2");
        assert_eq!(t.ino_of("/m/file"), None);
        assert_eq!(t.path(17).unwrap(), "/m/file/stale");
        t.rename("/m/nothing", "/m/else", true);
        assert_eq!(t.ino_of("/m/b/f"), Some(11));
        t.forget(11, 1);
        assert!(t.path(11).is_none());
        assert_eq!(split("/m/b/f"), ("/m/b".to_string(), "f".to_string()));
        assert_eq!(split("/x"), ("/".to_string(), "x".to_string()));
        assert_eq!(join("/", "x"), "/x");
    }

    /// Files go first (not those in use), then directories from the deepest; never the root.
    #[test]
    fn prune_candidates_are_files_first_then_the_deepest_directories() {
        let t = InodeTable::new("/m");
        t.remember(10, "/m/a", Kind::Dir, true);
        t.remember(11, "/m/a/b", Kind::Dir, true);
        t.remember(12, "/m/a/b/f", Kind::File, true);
        t.remember(13, "/m/g", Kind::File, true);
        t.remember(14, "/m/open", Kind::File, true);
        let mut files = t.prune_candidates(2, |ino| ino == 14);
        files.sort();
        assert_eq!(files, vec![12, 13]);
        let all = t.prune_candidates(10, |ino| ino == 14);
        assert_eq!(all.len(), 4, "{all:?}");
        assert_eq!(&all[2..], &[11, 10], "deepest directory first");
        assert!(!all.contains(&ROOT_INO));
    }

    #[test]
    fn hard_link_names_survive_unlink_of_the_primary() {
        let t = InodeTable::new("/m");
        t.remember(20, "/m/f", Kind::File, true);
        t.remember_as(20, "/m/l1", Kind::File, true, true);
        t.remember_as(20, "/m/d/l2", Kind::File, true, true);
        assert_eq!(t.path(20).unwrap(), "/m/f");
        t.unlink_path("/m/f");
        assert_eq!(t.path(20).unwrap(), "/m/l1");
        assert_eq!(t.ino_of("/m/f"), None);
        t.rename("/m/d", "/m/e", false);
        assert_eq!(t.ino_of("/m/e/l2"), Some(20));
        t.unlink_path("/m/l1");
        assert_eq!(t.path(20).unwrap(), "/m/e/l2");
        // a plain remember at a new path is a rename: the old names go
        t.remember(20, "/m/g", Kind::File, true);
        assert_eq!(t.ino_of("/m/e/l2"), None);
        t.forget(20, 4);
        assert!(t.path(20).is_none());
        assert_eq!(t.ino_of("/m/g"), None);
    }

    #[test]
    fn journal_follows_a_promoted_hard_link_name() {
        let t = InodeTable::new("/m");
        let j = Arc::new(Journal::create().unwrap());
        t.set_journal(j.clone());
        t.remember(30, "/m/a", Kind::File, true);
        t.remember_as(30, "/m/b", Kind::File, true, true);
        t.unlink_path("/m/a");
        let t2 = InodeTable::new("/m");
        t2.replay(j.replay().unwrap());
        assert_eq!(t2.path(30).unwrap(), "/m/b");
    }

    /// An upload over a hard link's name keeps the group's number: the plain file met there
    /// is another node, and the group's node keeps its other name, also for a successor
    /// rebuilt from the crash journal.
    #[test]
    fn a_plain_file_at_a_link_groups_name_is_another_node() {
        let t = InodeTable::new("/m");
        let j = Arc::new(Journal::create().unwrap());
        t.set_journal(j.clone());
        let id = FileId {
            base: 40,
            birth: (1000, 0),
            is_dir: false,
        };
        t.remember_link(40, "/m/f", Kind::File, true);
        t.remember_link(40, "/m/l", Kind::File, true);
        let d = t.claim_and_remember("/m/f", &id, true, Some(true)).unwrap();
        assert_ne!(d, 40, "the upload took the group's node");
        assert_eq!(t.path(40).unwrap(), "/m/l");
        assert_eq!(t.ino_of("/m/f"), Some(d));
        let t2 = InodeTable::new("/m");
        t2.replay(j.replay().unwrap());
        assert_eq!(t2.path(40).unwrap(), "/m/l", "after a replay");
        assert_eq!(t2.ino_of("/m/f"), Some(d), "after a replay");
    }

    /// A directory moved over names a hard link held: the link keeps its other name, as it
    /// is after the move, also for a successor rebuilt from the crash journal.
    #[test]
    fn a_rename_over_a_hard_links_name_leaves_it_its_other_name_where_it_ends_up() {
        let t = InodeTable::new("/m");
        let j = Arc::new(Journal::create().unwrap());
        t.set_journal(j.clone());
        t.remember(10, "/m/a", Kind::Dir, true);
        t.remember(50, "/m/a/x", Kind::File, true);
        t.remember_link(40, "/m/b/x", Kind::File, true);
        t.remember_link(40, "/m/a/y", Kind::File, true);
        t.rename("/m/a", "/m/b", false);
        assert_eq!(t.ino_of("/m/b/x"), Some(50));
        assert_eq!(t.path(40).unwrap(), "/m/b/y");
        assert_eq!(t.live_names(40), vec!["/m/b/y".to_string()]);
        let t2 = InodeTable::new("/m");
        t2.replay(j.replay().unwrap());
        assert_eq!(t2.path(40).unwrap(), "/m/b/y", "after a replay");
        assert_eq!(t2.ino_of("/m/b/x"), Some(50), "after a replay");
    }

    /// An open file moved to another name of its link group: that name joins the node's
    /// names (primary where the old one leads nowhere), and no node is made for a forgotten
    /// one.
    #[test]
    fn a_link_name_joins_a_known_node_only() {
        let t = InodeTable::new("/m");
        t.remember_link(40, "/m/f", Kind::File, true);
        t.remember_link(40, "/m/g", Kind::File, true);
        t.unlink_path("/m/g");
        t.unlink_path("/m/f");
        t.add_link_name(40, "/m/l");
        assert_eq!(t.path(40).unwrap(), "/m/l");
        assert_eq!(t.live_names(40), vec!["/m/l".to_string()]);
        t.add_link_name(41, "/m/x");
        assert!(t.path(41).is_none(), "a node was made for a forgotten one");
        assert_eq!(t.ino_of("/m/x"), None);
        // a live primary stays; the name is one more
        t.remember_link(50, "/m/a", Kind::File, true);
        t.add_link_name(50, "/m/b");
        assert_eq!(t.path(50).unwrap(), "/m/a");
        assert_eq!(
            t.live_names(50),
            vec!["/m/a".to_string(), "/m/b".to_string()]
        );
    }

    /// Two uploads with one number and second: the second gets a derived node id, which a
    /// successor rebuilt from the crash journal (which keeps no numbers) gives it again.
    #[test]
    fn a_derived_node_id_survives_a_journal_replay() {
        let t = InodeTable::new("/m");
        let j = Arc::new(Journal::create().unwrap());
        t.set_journal(j.clone());
        let id = FileId {
            base: 5000,
            birth: (1000, 0),
            is_dir: false,
        };
        assert_eq!(t.claim_and_remember("/m/c", &id, true, None), Ok(5000));
        assert_eq!(
            t.claim_and_remember("/m/d", &id, true, None),
            Err("/m/c".to_string())
        );
        let d = t.claim_and_remember("/m/d", &id, true, Some(true)).unwrap();
        assert_ne!(d, 5000);
        let t2 = InodeTable::new("/m");
        t2.replay(j.replay().unwrap());
        assert_eq!(t2.claim("/m/d", &id), Claim::Id(d));
        assert_eq!(t2.claim("/m/c", &id), Claim::Id(5000));
        // a file whose name is gone here never gets the number back for a new file
        t2.unlink_path("/m/c");
        assert_ne!(t2.id_of("/m/x", &id, false), 5000);
    }

    #[test]
    fn journal_rebuilds_the_table() {
        let t = InodeTable::new("/m");
        let j = Arc::new(Journal::create().unwrap());
        t.remember(10, "/m/a", Kind::Dir, true);
        t.set_journal(j.clone());
        t.remember(11, "/m/a/f", Kind::File, true);
        t.remember(12, "/m/g", Kind::File, true);
        t.rename("/m/a", "/m/b", false);
        t.forget(12, 1);
        let t2 = InodeTable::new("/m");
        t2.replay(j.replay().unwrap());
        assert_eq!(t2.path(10).unwrap(), "/m/b");
        assert_eq!(t2.path(11).unwrap(), "/m/b/f");
        assert!(t2.path(12).is_none());
    }

    thread_local! {
        /// A pause before each journal append on this thread: widens the window in which an
        /// append made after the table's lock was let go would land out of order.
        /// (microseconds; threads pause for different times, so a later change's record can
        /// overtake an earlier one's when appends are not ordered)
        static PAUSE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    pub(super) fn journal_pause() {
        if PAUSE.get() > 0 {
            std::thread::sleep(std::time::Duration::from_micros(PAUSE.get()));
        }
    }

    /// Two threads name one node at once (a lookup under its new name racing an event's
    /// rename), the first to change the table the slower to journal: a successor replaying
    /// the journal must end where the table is. About half the rounds race that way.
    #[test]
    fn racing_changes_are_journaled_in_the_order_they_were_made() {
        for round in 0..200 {
            let t = Arc::new(InodeTable::new("/m"));
            let j = Arc::new(Journal::create().unwrap());
            t.set_journal(j.clone());
            t.remember(10, "/m/a", Kind::File, true);
            let start = Arc::new(std::sync::Barrier::new(2));
            let movers: Vec<_> = [("/m/b", 80), ("/m/c", 10)]
                .into_iter()
                .map(|(to, pause)| {
                    let (t, start) = (t.clone(), start.clone());
                    std::thread::spawn(move || {
                        PAUSE.set(pause);
                        start.wait();
                        t.remember(10, to, Kind::File, false);
                    })
                })
                .collect();
            for m in movers {
                m.join().unwrap();
            }
            let t2 = InodeTable::new("/m");
            t2.replay(j.replay().unwrap());
            assert_eq!(t2.path(10), t.path(10), "round {round}");
            for p in ["/m/a", "/m/b", "/m/c"] {
                assert_eq!(t2.ino_of(p), t.ino_of(p), "round {round}: {p}");
            }
        }
    }
}
