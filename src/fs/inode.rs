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
}

/// Two creation times of different files. Nanoseconds count only when both have them (a
/// client that drops them must not make a file look new).
fn born_apart(a: (i64, i32), b: (i64, i32)) -> bool {
    a.0 != b.0 || (a.1 != 0 && b.1 != 0 && a.1 != b.1)
}

/// Another node id for a file numbered `ino`, stable for its birth; never 0 or 1.
fn derived(ino: u64, birth: (i64, i32)) -> u64 {
    // splitmix64 finaliser over the number and the birth
    let mut z = ino ^ (birth.0 as u64).rotate_left(32) ^ (birth.1 as u32 as u64);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    z.max(ROOT_INO + 1)
}

#[derive(Default)]
struct Inner {
    by_ino: HashMap<u64, NodeRecord>,
    by_path: HashMap<String, u64>,
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
            NodeRecord {
                ino: ROOT_INO,
                path: root_path.to_string(),
                is_dir: true,
                nlookup: 1,
                aliases: Vec::new(),
                birth: None,
            },
        );
        t.inner
            .write()
            .by_path
            .insert(root_path.to_string(), ROOT_INO);
        t
    }

    /// Starts recording every change to `j` (after writing the current table into it).
    pub fn set_journal(&self, j: Arc<Journal>) {
        for r in self.snapshot() {
            if r.ino != ROOT_INO {
                self.log(
                    &j,
                    JournalOp::Remember {
                        ino: r.ino,
                        path: r.path,
                        is_dir: r.is_dir,
                    },
                );
            }
        }
        *self.journal.write() = Some(j);
    }

    fn log(&self, j: &Journal, op: JournalOp) {
        if let Err(e) = j.append(&op) {
            tracing::warn!(error = %e, "inode journal append failed");
        }
    }

    fn journal(&self, op: JournalOp) {
        if let Some(j) = self.journal.read().as_ref() {
            self.log(j, op);
            let _ = j.maybe_compact(|| {
                self.snapshot()
                    .into_iter()
                    .filter(|r| r.ino != ROOT_INO)
                    .map(|r| JournalOp::Remember {
                        ino: r.ino,
                        path: r.path,
                        is_dir: r.is_dir,
                    })
                    .collect()
            });
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
                JournalOp::Rename { from, to } => self.rename_quiet(&from, &to),
            }
        }
    }

    pub fn path(&self, ino: u64) -> Option<String> {
        self.inner.read().by_ino.get(&ino).map(|n| n.path.clone())
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
        if self.remember_quiet(ino, path, kind, counted, hard_link) {
            self.journal(JournalOp::Remember {
                ino,
                path: path.to_string(),
                is_dir: kind == Kind::Dir,
            });
        }
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
        let mut changed = !g.by_ino.contains_key(&ino);
        let rec = g.by_ino.entry(ino).or_insert_with(|| NodeRecord {
            ino,
            path: path.to_string(),
            is_dir: kind == Kind::Dir,
            nlookup: 0,
            aliases: Vec::new(),
            birth: None,
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
            if g.by_path.get(&old) == Some(&ino) {
                g.by_path.remove(&old);
            }
        }
        g.by_path.insert(path.to_string(), ino);
        changed
    }

    /// The node id for a file the filer numbers `base`, created at `birth` (seconds,
    /// nanoseconds). The filer numbers a file created without an inode (an HTTP or S3 upload)
    /// md5(path) + seconds * 37, so a file renamed away and a new one uploaded to its old
    /// path within the same second share a number; as one node, each would show the other's
    /// attributes and content. A number this table holds for a file born at another time
    /// therefore gives way to one derived from both (again while that one is taken). An
    /// unknown birth (0 seconds, or a node restored from an older process) matches any.
    pub fn resolve(&self, base: u64, birth: (i64, i32)) -> u64 {
        if birth.0 == 0 {
            return base;
        }
        let g = self.inner.read();
        let mut ino = base;
        for _ in 0..16 {
            match g.by_ino.get(&ino).and_then(|r| r.birth) {
                Some(b) if born_apart(b, birth) && ino != ROOT_INO => ino = derived(ino, birth),
                _ => return ino,
            }
        }
        ino
    }

    /// Records the birth of the file node `ino` stands for (see [`resolve`](Self::resolve)).
    pub fn set_birth(&self, ino: u64, birth: (i64, i32)) {
        if birth.0 == 0 || ino == ROOT_INO {
            return;
        }
        if let Some(rec) = self.inner.write().by_ino.get_mut(&ino) {
            rec.birth = Some(birth);
        }
    }

    /// Kernel FORGET: drops the mapping when its lookup count reaches zero.
    pub fn forget(&self, ino: u64, n: u64) {
        if self.forget_quiet(ino, n) {
            self.journal(JournalOp::Forget { ino });
        }
    }

    /// Returns whether the node was dropped.
    fn forget_quiet(&self, ino: u64, n: u64) -> bool {
        if ino == ROOT_INO {
            return false;
        }
        let mut g = self.inner.write();
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
                    if g.by_path.get(p) == Some(&ino) {
                        g.by_path.remove(p);
                    }
                }
            }
        }
        gone
    }

    /// A path was deleted: forget the path mapping (the node id lives on until FORGET). A
    /// hard-linked node keeps being reachable through its other names.
    pub fn unlink_path(&self, path: &str) {
        let promoted = {
            let mut g = self.inner.write();
            let Some(ino) = g.by_path.remove(path) else {
                return;
            };
            match g.by_ino.get_mut(&ino) {
                Some(rec) => {
                    rec.aliases.retain(|a| a != path);
                    if rec.path == path && !rec.aliases.is_empty() {
                        rec.path = rec.aliases.remove(0);
                        Some((ino, rec.path.clone(), rec.is_dir))
                    } else {
                        None
                    }
                }
                None => None,
            }
        };
        if let Some((ino, path, is_dir)) = promoted {
            self.journal(JournalOp::Remember { ino, path, is_dir });
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

    /// `old` (and everything below it) is now at `new`.
    pub fn rename(&self, old: &str, new: &str) {
        self.rename_quiet(old, new);
        self.journal(JournalOp::Rename {
            from: old.to_string(),
            to: new.to_string(),
        });
    }

    fn rename_quiet(&self, old: &str, new: &str) {
        let mut g = self.inner.write();
        let prefix = format!("{}/", old.trim_end_matches('/'));
        let moved: Vec<(String, u64)> = g
            .by_path
            .iter()
            .filter(|(p, _)| p.as_str() == old || p.starts_with(&prefix))
            .map(|(p, i)| (p.clone(), *i))
            .collect();
        for (p, ino) in moved {
            let np = format!("{}{}", new, &p[old.len()..]);
            g.by_path.remove(&p);
            g.by_path.insert(np.clone(), ino);
            if let Some(rec) = g.by_ino.get_mut(&ino) {
                if rec.path == p {
                    rec.path = np;
                } else if let Some(a) = rec.aliases.iter_mut().find(|a| **a == p) {
                    *a = np;
                }
            }
        }
    }

    pub fn snapshot(&self) -> Vec<NodeRecord> {
        self.inner.read().by_ino.values().cloned().collect()
    }

    pub fn restore(&self, records: Vec<NodeRecord>) {
        let mut g = self.inner.write();
        for r in records {
            if r.ino == ROOT_INO {
                continue;
            }
            g.by_path.insert(r.path.clone(), r.ino);
            g.by_ino.insert(r.ino, r);
        }
    }

    pub fn len(&self) -> usize {
        self.inner.read().by_ino.len()
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
        t.rename("/m/a", "/m/b");
        assert_eq!(t.path(10).unwrap(), "/m/b");
        assert_eq!(t.path(11).unwrap(), "/m/b/f");
        assert_eq!(t.path(12).unwrap(), "/m/ab");
        assert_eq!(t.ino_of("/m/b/f"), Some(11));
        t.forget(11, 1);
        assert!(t.path(11).is_none());
        assert_eq!(split("/m/b/f"), ("/m/b".to_string(), "f".to_string()));
        assert_eq!(split("/x"), ("/".to_string(), "x".to_string()));
        assert_eq!(join("/", "x"), "/x");
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
        t.rename("/m/d", "/m/e");
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

    #[test]
    fn journal_rebuilds_the_table() {
        let t = InodeTable::new("/m");
        let j = Arc::new(Journal::create().unwrap());
        t.remember(10, "/m/a", Kind::Dir, true);
        t.set_journal(j.clone());
        t.remember(11, "/m/a/f", Kind::File, true);
        t.remember(12, "/m/g", Kind::File, true);
        t.rename("/m/a", "/m/b");
        t.forget(12, 1);
        let t2 = InodeTable::new("/m");
        t2.replay(j.replay().unwrap());
        assert_eq!(t2.path(10).unwrap(), "/m/b");
        assert_eq!(t2.path(11).unwrap(), "/m/b/f");
        assert!(t2.path(12).is_none());
    }
}
