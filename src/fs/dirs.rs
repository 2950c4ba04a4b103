//! Directories of [`Fs`]: handles and listings (readdir(plus), the names an event took away
//! meanwhile), and directory times written back to the filer.

use super::attr::{self, Attr, Kind};
use super::inode::{join, split, Claim, FileId, ROOT_INO};
use super::meta::Cached;
use super::{errno, Fs, Result};
use crate::pb::filer as pb;
use futures::StreamExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

/// One directory entry returned by readdir(plus).
#[derive(Debug, Clone)]
pub struct DirEntryOut {
    pub name: String,
    pub ino: u64,
    pub kind: Kind,
    /// Full attributes (None for "." and "..").
    pub attr: Option<Attr>,
    /// What the filer says identifies the file, when it is not a hard link (None for "."
    /// and ".." too): readdirplus remembers the node with it.
    pub ident: Option<FileId>,
    /// The entry is a name of a link group (its node is the group's).
    pub link: bool,
}

/// The entries an open directory handle lists (a snapshot taken when it is read from 0).
/// For a directory too large to cache, a window of [`DIR_PAGE`] entries that the handle
/// moves forward as the kernel reads on: memory stays flat however large the directory.
#[derive(Debug)]
pub struct DirListing {
    pub entries: Vec<DirEntryOut>,
    /// The readdir offset of `entries[0]` (0 unless a later page of a large directory). The
    /// entry at index `i` has offset `base + i` and is followed by offset `base + i + 1`.
    pub base: u64,
    /// A page of a large directory that may go on: its last name, where the next page starts.
    next: Option<String>,
    /// Where each page this handle has read so far starts: its offset and the name it
    /// follows (a seek back fetches that page again instead of listing from the start).
    starts: Vec<(u64, String)>,
    /// When the snapshot was taken (read before it was).
    since: Since,
}

/// When a directory listing was taken: [`Fs`]'s count of names taken away by events and the
/// time, both read before it was.
#[derive(Debug, Clone, Copy)]
struct Since {
    names_gone: u64,
    at: Instant,
}

/// Entries per page of a directory too large to cache.
pub const DIR_PAGE: usize = 1024;
/// Entries one readdirplus answer considers (a 4 KiB reply holds about 25).
const PLUS_WINDOW: usize = 64;
/// Names one readdirplus answer looks up again at most, and at once.
const PLUS_LOOKUPS: usize = 32;
const PLUS_PARALLEL: usize = 8;

/// What one readdirplus reply sends (see [`Fs::readdirplus`]).
pub struct PlusPage {
    pub listing: Arc<DirListing>,
    /// In listing order, some left out.
    pub entries: Vec<PlusEntry>,
    /// When their attributes were chosen: a change from then on takes them back.
    decided: Instant,
}

pub struct PlusEntry {
    /// Where it is in the listing: its readdir offset is `listing.base + index`.
    pub index: usize,
    /// As sent: with current attributes, or the node now at the name.
    pub entry: DirEntryOut,
}

impl DirListing {
    /// The index in `entries` of readdir offset `offset` (`entries.len()`: none left here).
    pub fn index_of(&self, offset: u64) -> usize {
        (offset.saturating_sub(self.base) as usize).min(self.entries.len())
    }

    fn end(&self) -> u64 {
        self.base + self.entries.len() as u64
    }
}

impl Fs {
    /// Records a change of `dir`'s contents: mtime/ctime now, written back in the background.
    pub(super) fn touch_dir(&self, dir: &str) {
        self.dir_times
            .lock()
            .insert(dir.to_string(), SystemTime::now());
    }

    /// Writes pending directory times to the filer (called periodically). Each write is a
    /// read-modify-write of the directory's entry, in turn with this node's other changes
    /// of it (a chmod or utimes meanwhile is neither undone nor overtaken).
    pub async fn flush_dir_times(&self) {
        let paths: Vec<String> = self.dir_times.lock().keys().cloned().collect();
        for path in paths {
            let (dir, name) = split(&path);
            let _turn = self.entry_lock(&dir, &name).lock().await;
            // read under the lock: a utimes since the listing above removed it, and its time
            // stands
            let Some(t) = self.dir_times.lock().get(&path).copied() else {
                continue;
            };
            if path != "/" {
                self.write_dir_time(&dir, &name, t).await;
            }
            if path == self.cfg.root {
                let mut r = self.root_attr.lock();
                r.mtime = r.mtime.max(t);
                r.ctime = r.ctime.max(t);
            }
            // kept when a child changed meanwhile (a newer time); a failed write is dropped,
            // as the kernel's own directory times are not retried either
            let mut times = self.dir_times.lock();
            if times.get(&path) == Some(&t) {
                times.remove(&path);
            }
        }
    }

    async fn write_dir_time(&self, dir: &str, name: &str, t: SystemTime) {
        let mut e = match self.filer.lookup_entry(dir, name).await {
            Ok(e) => e,
            Err(_) => return,
        };
        if !e.is_directory {
            // the name leads to a file now: not ours to rewrite here
            return;
        }
        let a = e.attributes.get_or_insert_with(Default::default);
        let (s, ns) = attr::split_ts(t);
        if (a.mtime, a.mtime_ns) >= (s, ns) {
            return;
        }
        (a.mtime, a.mtime_ns) = (s, ns);
        // never back: a chmod or setxattr since may have set a later ctime
        if (a.ctime, a.ctime_ns) < (s, ns) {
            (a.ctime, a.ctime_ns) = (s, ns);
        }
        if let Err(err) = self.update_entry(dir, e).await {
            tracing::debug!(dir, name, error = %err, "directory time write-back failed");
        }
    }

    /// An explicit mtime of directory `path` (utimes) replaces the pending time of its
    /// contents' last change. Call with the entry's lock held.
    pub(super) fn dir_time_set(&self, path: &str) {
        self.dir_times.lock().remove(path);
    }

    /// Checks that `ino` is a directory; the listing is taken when it is read from its start.
    pub async fn opendir(&self, ino: u64) -> Result<u64> {
        let dir = self.path_of(ino)?;
        if ino != ROOT_INO {
            let (pd, pn) = split(&dir);
            if !self.entry_at(&pd, &pn).await?.is_directory {
                return Err(errno(libc::ENOTDIR, format!("{dir} is not a directory")));
            }
        }
        // no listing yet: the first read takes it, from whatever offset (the kernel may
        // answer offset 0 from its own cache and ask us from further on)
        Ok(self.next_fh.fetch_add(1, Ordering::Relaxed))
    }

    /// The directory's entries as of now, with "." and "..": all of them, or for a
    /// directory too large to cache, its first page.
    async fn dir_snapshot(&self, ino: u64) -> Result<DirListing> {
        // read first: a name an event takes away or changes from here on is caught by
        // `gone_since` and `readdirplus`
        let since = self.listing_since();
        let dir = self.path_of(ino)?;
        let cached = if self.load_dir(&dir).await? {
            self.meta.listing(&dir)
        } else {
            None
        };
        let entries = match cached {
            Some(l) => l,
            None if self.meta.is_too_large(&dir) => {
                return self.dir_page(ino, &dir, "", 0, since).await;
            }
            None => self.list_uncached(&dir).await?,
        };
        Ok(self.dir_listing(ino, &dir, &entries, 0, None, since).await)
    }

    /// The page of a large directory after name `after` (from its start when empty), whose
    /// first entry has readdir offset `base`.
    async fn dir_page(
        &self,
        ino: u64,
        dir: &str,
        after: &str,
        base: u64,
        since: Since,
    ) -> Result<DirListing> {
        self.stats.filer_calls.fetch_add(1, Ordering::Relaxed);
        let page = self
            .filer
            .list_page(dir, after, false, DIR_PAGE as u32)
            .await?;
        let full = page.len() == DIR_PAGE;
        let mut entries: Vec<Arc<pb::Entry>> = page.into_iter().map(Arc::new).collect();
        let next = full.then(|| entries.last().map(|e| e.name.clone()).unwrap_or_default());
        // files created here and not on the filer yet, in this page's range of names
        let pending = self.pending_in_dir(dir, None);
        if !pending.is_empty() {
            let within = |n: &str| n > after && next.as_deref().is_none_or(|last| n <= last);
            let have: std::collections::HashSet<String> =
                entries.iter().map(|e| e.name.clone()).collect();
            entries.extend(
                pending
                    .into_iter()
                    .filter(|p| within(&p.name) && !have.contains(&p.name)),
            );
            entries.sort_by(|x, y| x.name.cmp(&y.name));
        }
        Ok(self
            .dir_listing(ino, dir, &entries, base, next, since)
            .await)
    }

    /// Readdir entries for `entries` of `dir` (with "." and ".." first when `base` is 0).
    async fn dir_listing(
        &self,
        ino: u64,
        dir: &str,
        entries: &[Arc<pb::Entry>],
        base: u64,
        next: Option<String>,
        since: Since,
    ) -> DirListing {
        // the whole directory, not a page of it
        let whole = base == 0 && next.is_none();
        let mut out = Vec::with_capacity(entries.len() + 2);
        if base == 0 {
            let parent_ino = if ino == ROOT_INO {
                ROOT_INO
            } else {
                self.inodes.ino_of(&split(dir).0).unwrap_or(ROOT_INO)
            };
            for (name, ino) in [(".", ino), ("..", parent_ino)] {
                out.push(DirEntryOut {
                    name: name.into(),
                    ino,
                    kind: Kind::Dir,
                    attr: None,
                    ident: None,
                    link: false,
                });
            }
        }
        // ids handed to files (not hard links) in this listing: a second file with a number
        // (two uploads the filer numbered alike) gets another
        let mut handed = std::collections::HashSet::new();
        for e in entries.iter() {
            let path = join(dir, &e.name);
            let ident = e.hard_link_id.is_empty().then(|| attr::file_id(&path, e));
            let mut eino = match &ident {
                Some(id) => match self.inodes.claim(&path, id) {
                    Claim::Id(ino) => ino,
                    Claim::Ask(other) => {
                        // a number another name holds: this listing answers for names in it
                        let (odir, oname) = split(&other);
                        let listed = entries.iter().find(|o| o.name == oname);
                        let live = match listed {
                            Some(o) if odir == dir => {
                                o.hard_link_id.is_empty()
                                    && attr::file_id(&other, o).base == id.base
                            }
                            None if odir == dir && whole => false,
                            _ => self.still_holds(&other, id).await,
                        };
                        self.inodes.id_of(&path, id, live)
                    }
                },
                None => self.node_id(&path, e),
            };
            if let Some(id) = &ident {
                if !handed.insert(eino) {
                    eino = self.inodes.second_id(&path, id);
                    handed.insert(eino);
                }
            }
            let a = self.attr_of(eino, &path, e);
            out.push(DirEntryOut {
                name: e.name.clone(),
                ino: eino,
                kind: a.kind,
                attr: Some(a),
                ident,
                link: !e.hard_link_id.is_empty(),
            });
        }
        DirListing {
            entries: out,
            base,
            next,
            starts: Vec::new(),
            since,
        }
    }

    /// Entries from `offset` on (see [`DirListing::index_of`]). The first read of a handle,
    /// and every read from offset 0 (a rewinddir), takes the listing: POSIX wants names
    /// created since opendir listed after a rewind (xfstests generic/471), and the kernel
    /// asks from 0 again once the directory changed. Later offsets read that same listing,
    /// so a listing in pages stays consistent; a large directory's handle moves on to the
    /// next page when the kernel reads past its window. With `plus`, each returned entry
    /// counts as a lookup.
    pub async fn readdir(&self, ino: u64, fh: u64, offset: u64) -> Result<Arc<DirListing>> {
        let held = self.dir_handles.lock().get(&fh).cloned();
        // a seek back within a large directory: where the page that holds it starts
        let back = match &held {
            Some(l) if offset != 0 && offset < l.base => {
                l.starts.iter().rev().find(|(b, _)| *b <= offset).cloned()
            }
            _ => None,
        };
        let mut l = match (held, back) {
            (Some(l), _) if offset != 0 && offset >= l.base => l,
            (Some(l), Some((base, after))) => self.page_at(ino, base, after, &l.starts).await?,
            // not read yet here (the kernel served offset 0 from its cache), a handle from
            // a previous process (takeover), or a rewind
            _ => {
                let mut l = self.dir_snapshot(ino).await?;
                if l.next.is_some() {
                    l.starts.push((0, String::new()));
                }
                Arc::new(l)
            }
        };
        // a large directory: on to the page that holds `offset`
        while offset >= l.end() {
            let Some(after) = l.next.clone() else { break };
            l = self.page_at(ino, l.end(), after, &l.starts).await?;
        }
        self.dir_handles.lock().insert(fh, l.clone());
        Ok(l)
    }

    /// The page of a large directory that starts at offset `base`, after name `after`,
    /// remembering where it starts along with the pages read before (`starts`).
    async fn page_at(
        &self,
        ino: u64,
        base: u64,
        after: String,
        starts: &[(u64, String)],
    ) -> Result<Arc<DirListing>> {
        let since = self.listing_since();
        let dir = self.path_of(ino)?;
        let mut page = self.dir_page(ino, &dir, &after, base, since).await?;
        page.starts = starts.to_vec();
        if !page.starts.iter().any(|(b, _)| *b == base) {
            page.starts.push((base, after));
        }
        Ok(Arc::new(page))
    }

    /// Entries from `offset` on for readdirplus, with the attributes the kernel will believe
    /// for the entry TTL. The listing is a snapshot from opendir, and its attributes are sent
    /// only for names that did not change since it was taken (here or in an event: a file
    /// written and closed since would appear truncated, a read then gets 0 bytes), and are
    /// not open or cached here. A changed name is looked up again: gone, it is left out; now
    /// another node, that node is sent. When that lookup fails the reply ends before the
    /// entry (the kernel asks again from there), or fails if it is the first.
    ///
    /// An empty answer means the end of the directory, as the kernel takes it.
    pub async fn readdirplus(&self, ino: u64, fh: u64, mut offset: u64) -> Result<PlusPage> {
        loop {
            let listing = self.readdir(ino, fh, offset).await?;
            let start = listing.index_of(offset);
            let decided = Instant::now();
            let (entries, end) = self.plus_window(ino, &listing, start).await?;
            let more = end < listing.entries.len() || listing.next.is_some();
            if !entries.is_empty() || end == start || !more {
                return Ok(PlusPage {
                    listing,
                    entries,
                    decided,
                });
            }
            // every entry of the window is gone: on to the next, an empty reply would end
            // the directory
            offset = listing.base + end as u64;
        }
    }

    /// The entries of `listing` from index `start` as readdirplus sends them, up to
    /// [`PLUS_WINDOW`] of them, and the index where that ends.
    async fn plus_window(
        &self,
        dir_ino: u64,
        listing: &DirListing,
        start: usize,
    ) -> Result<(Vec<PlusEntry>, usize)> {
        let mut end = (start + PLUS_WINDOW).min(listing.entries.len());
        let Some(dir) = self.inodes.path(dir_ino) else {
            return Err(errno(libc::ENOENT, format!("directory {dir_ino} is gone")));
        };
        let mut out: Vec<Option<DirEntryOut>> = Vec::with_capacity(end - start);
        let mut doubted = Vec::new();
        for (i, e) in listing.entries[start..end].iter().enumerate() {
            let Some(snap) = &e.attr else {
                out.push(Some(e.clone())); // "." and ".."
                continue;
            };
            let path = join(&dir, &e.name);
            let cached = self.meta.lookup(&dir, &e.name);
            // changed since the listing; gone or another node by the cache; or a hard link
            // (stamps are per name, and a write through another name changed this one)
            let doubt = self.name_changes.since(&path, listing.since.at)
                || match &cached {
                    Cached::Found(cur) => !self.is_node(&path, cur, e.ino),
                    Cached::Absent => true,
                    Cached::Unknown => false,
                }
                || (snap.kind != Kind::Dir && (snap.nlink > 1 || e.ident.is_none()));
            let attr = if doubt {
                if doubted.len() == PLUS_LOOKUPS {
                    end = start + i;
                    break;
                }
                doubted.push(start + i);
                out.push(None);
                continue;
            } else if let Some(of) = self.open_file(e.ino) {
                self.open_file_attr(e.ino, &of)
            } else {
                match cached {
                    Cached::Found(cur) => self.attr_of(e.ino, &path, &cur),
                    _ => snap.clone(),
                }
            };
            out.push(Some(DirEntryOut {
                attr: Some(attr),
                ..e.clone()
            }));
        }
        // the changed names, looked up at once
        let looked: Vec<_> = futures::stream::iter(doubted)
            .map(|i| {
                let name = &listing.entries[i].name;
                let dir = &dir;
                async move { (i, self.entry_at(dir, name).await) }
            })
            .buffered(PLUS_PARALLEL)
            .collect()
            .await;
        for (i, found) in looked {
            let e = &listing.entries[i];
            let path = join(&dir, &e.name);
            match found {
                Ok(cur) if self.is_node(&path, &cur, e.ino) => {
                    out[i - start] = Some(DirEntryOut {
                        attr: Some(self.attr_of(e.ino, &path, &cur)),
                        ..e.clone()
                    });
                }
                Ok(cur) => {
                    // another file or directory at the name now
                    let a = self.remember_asking(&path, &cur, false).await;
                    out[i - start] = Some(DirEntryOut {
                        name: e.name.clone(),
                        ino: a.ino,
                        kind: a.kind,
                        ident: cur
                            .hard_link_id
                            .is_empty()
                            .then(|| attr::file_id(&path, &cur)),
                        link: !cur.hard_link_id.is_empty(),
                        attr: Some(a),
                    });
                }
                Err(err) if err.errno == libc::ENOENT => {} // gone: left out
                Err(err) if i == start => return Err(err),
                Err(err) => {
                    tracing::debug!(path, error = %err, "readdirplus: entry unknown; the reply ends before it");
                    end = i;
                    break;
                }
            }
        }
        let entries = out
            .into_iter()
            .take(end - start)
            .enumerate()
            .filter_map(|(k, e)| {
                e.map(|entry| PlusEntry {
                    index: start + k,
                    entry,
                })
            })
            .collect();
        Ok((entries, end))
    }

    /// Of the entries `range` of `listing` (a snapshot of directory `dir_ino` that
    /// readdirplus handed the kernel), the names an event may have taken away since the
    /// snapshot was taken. The kernel keeps a readdirplus entry as a positive dentry for the
    /// entry TTL, and a removal event's invalidation can reach the kernel before that reply
    /// does: such a name would stay visible after it is gone. Costs nothing unless a name went
    /// away somewhere while the listing was read; then each sent name is checked (a lookup
    /// where the directory's listing is not cached).
    pub async fn gone_since(
        &self,
        dir_ino: u64,
        listing: &DirListing,
        range: std::ops::Range<usize>,
    ) -> Vec<String> {
        if self.names_gone.load(Ordering::SeqCst) == listing.since.names_gone {
            return Vec::new();
        }
        let Some(dir) = self.inodes.path(dir_ino) else {
            return Vec::new();
        };
        let mut gone = Vec::new();
        for e in listing.entries.get(range).unwrap_or_default() {
            if e.name == "." || e.name == ".." {
                continue;
            }
            let path = join(&dir, &e.name);
            let current = match self.meta.lookup(&dir, &e.name) {
                Cached::Found(cur) => self.is_node(&path, &cur, e.ino),
                Cached::Absent => false,
                Cached::Unknown => match self.entry_at(&dir, &e.name).await {
                    Ok(cur) => self.is_node(&path, &cur, e.ino),
                    // not sure: leave the kernel's entry (an open of it is ESTALE if stale)
                    Err(err) => err.errno != libc::ENOENT,
                },
            };
            if !current {
                gone.push(e.name.clone());
            }
        }
        gone
    }

    /// Takes back, in the background, what the first `sent` entries of a readdirplus reply
    /// told the kernel and that changed meanwhile: an event's invalidation may have reached
    /// the kernel before the reply did. A name changed since the attributes were chosen
    /// loses its attributes; a name [`Self::gone_since`] finds gone, its entry.
    /// Called once the reply is out: the kernel takes the directory's lock for an
    /// invalidation, which the listing may still hold.
    pub fn take_back(self: &Arc<Self>, dir_ino: u64, page: PlusPage, sent: usize) {
        let sent = &page.entries[..sent.min(page.entries.len())];
        let (Some(first), Some(last)) = (sent.first(), sent.last()) else {
            return;
        };
        let range = first.index..last.index + 1;
        let changed: Vec<u64> = match self.inodes.path(dir_ino) {
            Some(dir) => sent
                .iter()
                .filter(|p| {
                    p.entry.attr.is_some()
                        && self
                            .name_changes
                            .since(&join(&dir, &p.entry.name), page.decided)
                })
                .map(|p| p.entry.ino)
                .collect(),
            None => Vec::new(),
        };
        let names_went = self.names_gone.load(Ordering::SeqCst) != page.listing.since.names_gone;
        if changed.is_empty() && !names_went {
            return;
        }
        let (Some(nt), Ok(rt)) = (self.notifier(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let fs = self.clone();
        let listing = page.listing.clone();
        rt.spawn(async move {
            let gone = if names_went {
                fs.gone_since(dir_ino, &listing, range).await
            } else {
                Vec::new()
            };
            tracing::debug!(
                dir_ino,
                ?gone,
                ?changed,
                "readdirplus entries changed meanwhile"
            );
            let _ = tokio::task::spawn_blocking(move || {
                // attributes only: an entry's invalidation waits for the directory's lock,
                // which a listing waiting for our next reply holds, and a process killed
                // meanwhile could not exit (a replaced name is a gone one, below)
                for ino in &changed {
                    nt.inval_attr(*ino);
                }
                for name in &gone {
                    nt.inval_entry(dir_ino, name);
                }
            })
            .await;
        });
    }

    /// Read before a listing is taken (see [`DirListing`]).
    fn listing_since(&self) -> Since {
        Since {
            names_gone: self.names_gone.load(Ordering::SeqCst),
            at: Instant::now(),
        }
    }

    /// An event took a name away (see [`Self::gone_since`]).
    pub(super) fn note_name_gone(&self) {
        self.names_gone.fetch_add(1, Ordering::SeqCst);
    }

    /// readdirplus registers the names it returns, as lookup would.
    pub fn remember_dir_entry(&self, dir_ino: u64, e: &DirEntryOut) {
        if let Some(dir) = self.inodes.path(dir_ino) {
            let path = join(&dir, &e.name);
            // a file with several links keeps its other names; a name an event took away
            // since the snapshot (renamed, deleted) must not become the node's path again
            let linked = e
                .attr
                .as_ref()
                .is_some_and(|a| a.kind != Kind::Dir && a.nlink > 1);
            let stale = match self.meta.lookup(&dir, &e.name) {
                Cached::Found(cur) => match &e.ident {
                    Some(id) => attr::file_id(&path, &cur) != *id,
                    None => !self.is_node(&path, &cur, e.ino),
                },
                Cached::Absent => true,
                Cached::Unknown => false,
            };
            match (&e.ident, linked || stale) {
                _ if e.link => self.inodes.remember_link(e.ino, &path, e.kind, true),
                (Some(id), false) => self.inodes.remember_file(e.ino, &path, id, true),
                (ident, _) => {
                    self.inodes
                        .remember_as(e.ino, &path, e.kind, true, linked || stale);
                    if let Some(id) = ident {
                        self.inodes.note_file(e.ino, id);
                    }
                }
            }
        }
    }

    pub fn releasedir(&self, fh: u64) {
        self.dir_handles.lock().remove(&fh);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::filer::FilerApi;
    use crate::fs::integrity_tests::event;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;
    use parking_lot::Mutex;
    use std::collections::HashMap;

    /// A filesystem on `filer` that caches listings of up to `max_cached` entries.
    fn new_fs(filer: Arc<MockFiler>, max_cached: usize) -> Arc<Fs> {
        let mut cfg = FsConfig::from_mount_options(&MountOptions::default());
        cfg.max_cached_dir_entries = max_cached;
        Fs::new(
            cfg,
            filer,
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        )
    }

    /// The entries readdirplus sends from the first name on (past "." and ".."), by name,
    /// from the listing handle `dh` took when it was read from 0.
    async fn plus(fs: &Fs, dh: u64) -> Result<HashMap<String, DirEntryOut>> {
        plus_from(fs, dh, 2).await
    }

    async fn plus_from(fs: &Fs, dh: u64, offset: u64) -> Result<HashMap<String, DirEntryOut>> {
        let page = fs.readdirplus(ROOT_INO, dh, offset).await?;
        Ok(page
            .entries
            .into_iter()
            .map(|p| (p.entry.name.clone(), p.entry))
            .collect())
    }

    fn size(m: &HashMap<String, DirEntryOut>, name: &str) -> u64 {
        m[name].attr.as_ref().unwrap().size
    }

    /// Files named `names`, each holding its name, and a directory handle whose listing
    /// was taken after; the listing is the only copy of the directory (too large to cache).
    async fn listed(names: &[&str]) -> (Arc<Fs>, Arc<MockFiler>, u64) {
        let filer = Arc::new(MockFiler::new());
        let fs = new_fs(filer.clone(), 1);
        for name in names {
            let (a, fh) = fs
                .create(ROOT_INO, name, 0o644, 0, libc::O_WRONLY, 0, 0)
                .await
                .unwrap();
            fs.write(fh, a.ino, 0, name.as_bytes()).await.unwrap();
            fs.release(fh, a.ino).await.unwrap();
        }
        let dh = fs.opendir(ROOT_INO).await.unwrap();
        fs.readdir(ROOT_INO, dh, 0).await.unwrap();
        (fs, filer, dh)
    }

    /// Another client replaces `/name` by `new` (None: deletes it); its event arrives here.
    async fn elsewhere(fs: &Arc<Fs>, filer: &MockFiler, name: &str, new: Option<pb::Entry>) {
        let old = filer.get(&format!("/{name}")).unwrap();
        let other = filer.other_client();
        match &new {
            Some(e) => other
                .update_entry(pb::UpdateEntryRequest {
                    directory: "/".into(),
                    entry: Some(e.clone()),
                    ..Default::default()
                })
                .await
                .map(drop)
                .unwrap(),
            None => other
                .delete_entry(pb::DeleteEntryRequest {
                    directory: "/".into(),
                    name: name.into(),
                    ..Default::default()
                })
                .await
                .map(drop)
                .unwrap(),
        }
        fs.apply_event(&event(Some(old), new));
    }

    /// `/name` with `content` inline, as another client rewrote it.
    fn rewritten(filer: &MockFiler, name: &str, content: &[u8]) -> pb::Entry {
        let mut e = filer.get(&format!("/{name}")).unwrap();
        e.content = content.to_vec();
        e.chunks.clear();
        e.attributes.as_mut().unwrap().file_size = content.len() as u64;
        e
    }

    /// Another file with `content` at `/name`, as another client put it there.
    fn replaced(filer: &MockFiler, name: &str, content: &[u8]) -> pb::Entry {
        let mut e = rewritten(filer, name, content);
        let attrs = e.attributes.as_mut().unwrap();
        attrs.inode += 1_000;
        attrs.crtime -= 1_000;
        e
    }

    #[tokio::test]
    async fn readdirplus_attrs_are_current_not_from_the_opendir_snapshot() {
        let fs = new_fs(Arc::new(MockFiler::new()), 100_000);
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.write(fh, a.ino, 0, b"12345").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();

        let dh = fs.opendir(ROOT_INO).await.unwrap();
        let list = fs.readdir(ROOT_INO, dh, 0).await.unwrap();
        let e = list.entries.iter().find(|e| e.name == "f").unwrap();
        assert_eq!(e.attr.as_ref().unwrap().size, 5);

        // Written after the snapshot: open, then closed again.
        let fh = fs.open(a.ino, libc::O_WRONLY).await.unwrap();
        fs.write(fh, a.ino, 5, b"67890").await.unwrap();
        assert_eq!(size(&plus(&fs, dh).await.unwrap(), "f"), 10);
        fs.release(fh, a.ino).await.unwrap();
        assert_eq!(size(&plus(&fs, dh).await.unwrap(), "f"), 10);
        // "." and ".." carry no attributes.
        assert!(plus_from(&fs, dh, 0).await.unwrap()["."].attr.is_none());
    }

    /// A file created, written and closed here after the listing was taken, while an event
    /// (after a takeover: the predecessor's replayed ones) dropped the cached listing:
    /// readdirplus must not hand the kernel the listing's size 0 (CI: a file read back as 0
    /// bytes right after an upgrade).
    #[tokio::test]
    async fn readdirplus_does_not_send_a_size_from_before_a_local_write() {
        let filer = Arc::new(MockFiler::new());
        let fs = new_fs(filer.clone(), 100_000);
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        let (g, gh) = fs
            .create(ROOT_INO, "g", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.release(gh, g.ino).await.unwrap();
        let dh = fs.opendir(ROOT_INO).await.unwrap();
        fs.readdir(ROOT_INO, dh, 0).await.unwrap();
        assert_eq!(size(&plus(&fs, dh).await.unwrap(), "f"), 0);
        let data = vec![7u8; 33_060];
        fs.write(fh, a.ino, 0, &data).await.unwrap();
        fs.flush(fh, a.ino).await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        // an old event about another name changed here (a replayed one) drops the
        // cached listing
        let g = filer.get("/g").unwrap();
        fs.apply_event(&event(Some(g.clone()), Some(g)));
        assert!(matches!(fs.meta.lookup("/", "f"), Cached::Unknown));
        assert_eq!(size(&plus(&fs, dh).await.unwrap(), "f"), 33_060);
    }

    /// Another client's change after the listing was taken: readdirplus sends what the
    /// name holds now, not the listing's attributes. A gone name is left out; a name that
    /// now holds another file sends that file.
    #[tokio::test]
    async fn readdirplus_sends_what_other_clients_changed_since_the_listing() {
        let (fs, filer, dh) = listed(&["a", "f", "g", "h"]).await;
        let before = plus(&fs, dh).await.unwrap();
        assert_eq!(size(&before, "f"), 1);
        assert_eq!(before.len(), 4);

        elsewhere(
            &fs,
            &filer,
            "f",
            Some(rewritten(&filer, "f", b"0123456789")),
        )
        .await;
        elsewhere(&fs, &filer, "g", None).await;
        elsewhere(
            &fs,
            &filer,
            "h",
            Some(replaced(&filer, "h", b"another file")),
        )
        .await;

        let after = plus(&fs, dh).await.unwrap();
        assert_eq!(size(&after, "a"), 1);
        assert_eq!(size(&after, "f"), 10);
        assert_eq!(after["f"].ino, before["f"].ino);
        assert!(!after.contains_key("g"), "a deleted name is sent");
        assert_eq!(size(&after, "h"), 12);
        assert_ne!(
            after["h"].ino, before["h"].ino,
            "the old file is sent for h"
        );
    }

    /// A name another client gave to another file while the file it held is open here:
    /// the open file is not sent for the name (its dentry would point at a file the name
    /// no longer holds).
    #[tokio::test]
    async fn readdirplus_sends_the_new_file_at_a_name_whose_old_file_is_open() {
        let (fs, filer, dh) = listed(&["a", "t"]).await;
        let before = plus(&fs, dh).await.unwrap();
        let fh = fs.open(before["t"].ino, libc::O_RDONLY).await.unwrap();
        elsewhere(
            &fs,
            &filer,
            "t",
            Some(replaced(&filer, "t", b"another file")),
        )
        .await;
        let after = plus(&fs, dh).await.unwrap();
        assert_ne!(
            after["t"].ino, before["t"].ino,
            "the open old file is sent for t"
        );
        assert_eq!(size(&after, "t"), 12);
        fs.release(fh, before["t"].ino).await.unwrap();
    }

    /// Stamps are per name: a file written through one of its hard links is looked up
    /// again under its other names too.
    #[tokio::test]
    async fn readdirplus_looks_up_every_name_of_a_hard_linked_file() {
        let filer = Arc::new(MockFiler::new());
        let fs = new_fs(filer.clone(), 1);
        let (a, fh) = fs
            .create(ROOT_INO, "a", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.write(fh, a.ino, 0, b"12345").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        fs.link(a.ino, ROOT_INO, "b").await.unwrap();
        let dh = fs.opendir(ROOT_INO).await.unwrap();
        fs.readdir(ROOT_INO, dh, 0).await.unwrap();
        assert_eq!(size(&plus(&fs, dh).await.unwrap(), "a"), 5);
        let fh = fs.open(a.ino, libc::O_WRONLY).await.unwrap();
        fs.write(fh, a.ino, 5, b"67890").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        // the filer keeps one record for both names (the mock does not): each name is
        // asked for, not only the one the write went through
        let asked = filer.calls("lookup_entry");
        let after = plus(&fs, dh).await.unwrap();
        assert_eq!(after.len(), 2);
        assert_eq!(filer.calls("lookup_entry") - asked, 2);
    }

    /// More gone names than one answer looks up: the answer goes on past them instead of
    /// coming back empty, which would end the directory for the kernel.
    #[tokio::test]
    async fn readdirplus_goes_on_past_a_window_of_gone_names() {
        let mut names: Vec<String> = (0..PLUS_LOOKUPS + 8).map(|i| format!("n{i:03}")).collect();
        names.push("zz".into());
        let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let (fs, filer, dh) = listed(&refs).await;
        for n in &names[..names.len() - 1] {
            elsewhere(&fs, &filer, n, None).await;
        }
        let after = plus(&fs, dh).await.unwrap();
        assert_eq!(after.keys().collect::<Vec<_>>(), vec!["zz"]);
    }

    /// A changed name the filer cannot be asked about: the answer ends before it (the
    /// kernel asks again from there), or fails when it is the first one.
    #[tokio::test]
    async fn readdirplus_ends_before_a_changed_name_it_cannot_look_up() {
        let (fs, filer, dh) = listed(&["a", "f"]).await;
        elsewhere(
            &fs,
            &filer,
            "f",
            Some(rewritten(&filer, "f", b"0123456789")),
        )
        .await;
        filer.fail_next(1_000);
        let got = plus(&fs, dh).await.unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), vec!["a"]);
        assert!(plus_from(&fs, dh, 3).await.is_err());
        filer.fail_next(0);
        assert_eq!(size(&plus_from(&fs, dh, 3).await.unwrap(), "f"), 10);
    }

    /// Records the kernel invalidations asked for.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);

    impl super::super::Notifier for Recorder {
        fn inval_entry(&self, _parent: u64, name: &str) {
            self.0.lock().push(format!("entry {name}"));
        }
        fn inval_inode(&self, ino: u64) {
            self.0.lock().push(format!("inode {ino}"));
        }
        fn inval_attr(&self, ino: u64) {
            self.0.lock().push(format!("attr {ino}"));
        }
    }

    /// A change that lands between choosing a reply's attributes and the kernel taking
    /// them: its invalidation may reach the kernel first, so the reply's entry for it is
    /// taken back after the reply.
    #[tokio::test]
    async fn a_change_during_a_readdirplus_reply_takes_its_attributes_back() {
        let (fs, filer, dh) = listed(&["a", "f"]).await;
        let rec = Arc::new(Recorder::default());
        fs.set_notifier(rec.clone());
        let page = fs.readdirplus(ROOT_INO, dh, 2).await.unwrap();
        let f = page.entries.iter().find(|p| p.entry.name == "f").unwrap();
        let ino = f.entry.ino;
        elsewhere(
            &fs,
            &filer,
            "f",
            Some(rewritten(&filer, "f", b"0123456789")),
        )
        .await;
        rec.0.lock().clear();
        let n = page.entries.len();
        fs.take_back(ROOT_INO, page, n);
        for _ in 0..100 {
            if !rec.0.lock().is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let got = rec.0.lock().clone();
        assert_eq!(got, vec![format!("attr {ino}")]);
    }

    /// Per-directory and per-inode bookkeeping goes when it is no longer needed: the lock
    /// of a directory listing when the listing is done, the page-cache generations of an
    /// inode when the kernel forgets it (a later open then drops the kernel's pages).
    #[tokio::test]
    async fn per_directory_and_per_inode_state_does_not_pile_up() {
        let fs = new_fs(Arc::new(MockFiler::new()), 100_000);
        let mut dirs = Vec::new();
        for i in 0..50 {
            dirs.push(
                fs.mkdir(ROOT_INO, &format!("d{i}"), 0o755, 0, 0, 0)
                    .await
                    .unwrap(),
            );
        }
        for d in &dirs {
            assert!(matches!(
                fs.lookup(d.ino, "nothing").await,
                Err(e) if e.errno == libc::ENOENT
            ));
        }
        assert!(
            fs.dir_locks.lock().is_empty(),
            "{} locks left",
            fs.dir_locks.lock().len()
        );
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.write(fh, a.ino, 0, b"12345").await.unwrap();
        fs.release(fh, a.ino).await.unwrap();
        for _ in 0..2 {
            let fh = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
            fs.keep_cache(a.ino); // as the adapter does at each open
            fs.release(fh, a.ino).await.unwrap();
        }
        assert!(fs.keep_cache(a.ino), "unchanged: the pages stay valid");
        assert!(fs.opened_gen.lock().contains_key(&a.ino));
        fs.forget(a.ino, 1);
        assert!(!fs.content_gen.lock().contains_key(&a.ino));
        assert!(!fs.opened_gen.lock().contains_key(&a.ino));
        assert!(!fs.keep_cache(a.ino), "forgotten: a new open starts afresh");
        // an event about a file nobody here looked up bumps a generation FORGET never clears
        fs.bump_content_gen(987_654_321);
        fs.sweep_caches();
        assert!(!fs.content_gen.lock().contains_key(&987_654_321));
        assert!(fs.dir_locks.lock().is_empty());
    }

    /// A directory too large to cache is listed in pages of [`DIR_PAGE`]: the handle holds one
    /// window, moves on as the kernel reads on (in buffers that end mid-page), lists every
    /// name once and in order, finds its way back after a seek, and deciding it is too large
    /// reads only one entry more than the limit.
    #[tokio::test]
    async fn a_directory_too_large_to_cache_is_listed_in_pages() {
        let filer = Arc::new(MockFiler::new());
        let fs = new_fs(filer.clone(), 100);
        let d = fs.mkdir(ROOT_INO, "big", 0o755, 0, 0, 0).await.unwrap();
        const N: usize = 2 * DIR_PAGE + 500;
        let other = filer.other_client();
        for i in 0..N {
            let req = pb::CreateEntryRequest {
                directory: "/big".into(),
                entry: Some(pb::Entry {
                    name: format!("f{i:05}"),
                    attributes: Some(pb::FuseAttributes {
                        file_mode: 0o644,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            };
            other.create_entry(req).await.unwrap();
        }
        fs.meta.invalidate_dir("/big", false);
        let before = filer.calls("list_page");
        let dh = fs.opendir(d.ino).await.unwrap();
        // the kernel's buffers hold 300 entries at a time
        let (mut offset, mut names, mut widest) = (0u64, Vec::new(), 0);
        loop {
            let l = fs.readdir(d.ino, dh, offset).await.unwrap();
            widest = widest.max(l.entries.len());
            let start = l.index_of(offset);
            let got: Vec<_> = l.entries[start..].iter().take(300).collect();
            if got.is_empty() {
                break;
            }
            names.extend(got.iter().map(|e| e.name.clone()));
            offset = l.base + (start + got.len()) as u64;
        }
        let want: Vec<String> = [".".to_string(), "..".to_string()]
            .into_iter()
            .chain((0..N).map(|i| format!("f{i:05}")))
            .collect();
        assert!(
            names == want,
            "{} names listed, want {}",
            names.len(),
            want.len()
        );
        assert!(widest <= DIR_PAGE + 2, "a window of {widest} entries");
        // load_dir: one page of 101; then 3 pages (the last one short)
        assert_eq!(filer.calls("list_page") - before, 4);
        // a seek back (telldir/seekdir) from the last page to the middle one: that page
        // again, not a listing from the start
        let calls = filer.calls("list_page");
        let mid = (DIR_PAGE + 2 + 3) as u64;
        let l = fs.readdir(d.ino, dh, mid).await.unwrap();
        assert_eq!(
            l.entries[l.index_of(mid)].name,
            format!("f{:05}", DIR_PAGE + 3)
        );
        assert_eq!(filer.calls("list_page") - calls, 1);
        // and to the first
        let l = fs.readdir(d.ino, dh, 7).await.unwrap();
        assert_eq!(l.entries[l.index_of(7)].name, "f00005");
        // and forward again, past the first page
        let far = (DIR_PAGE + 10) as u64;
        let l = fs.readdir(d.ino, dh, far).await.unwrap();
        assert_eq!(
            l.entries[l.index_of(far)].name,
            format!("f{:05}", DIR_PAGE + 8)
        );
        fs.releasedir(dh);
    }

    /// POSIX: after rewinddir, names added since opendir are listed (xfstests generic/471).
    #[tokio::test]
    async fn rewinddir_lists_names_created_since_opendir() {
        let fs = new_fs(Arc::new(MockFiler::new()), 100_000);
        let names = |l: &DirListing| l.entries.iter().map(|e| e.name.clone()).collect::<Vec<_>>();
        let dh = fs.opendir(ROOT_INO).await.unwrap();
        assert_eq!(
            names(&fs.readdir(ROOT_INO, dh, 0).await.unwrap()),
            [".", ".."]
        );
        // opened before the create, first read after it (glibc's opendir reads nothing)
        let unread = fs.opendir(ROOT_INO).await.unwrap();
        let (a, fh) = fs
            .create(ROOT_INO, "new", 0o644, 0, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.release(fh, a.ino).await.unwrap();
        assert_eq!(
            names(&fs.readdir(ROOT_INO, unread, 0).await.unwrap()),
            [".", "..", "new"]
        );
        fs.releasedir(unread);
        // reading on from where it was: the snapshot
        assert_eq!(fs.readdir(ROOT_INO, dh, 2).await.unwrap().entries.len(), 2);
        // a handle first read past offset 0 (the kernel's cache answered 0): a real listing
        let cached = fs.opendir(ROOT_INO).await.unwrap();
        assert_eq!(
            fs.readdir(ROOT_INO, cached, 2).await.unwrap().entries.len(),
            3
        );
        fs.releasedir(cached);
        // from the start again: a fresh one
        assert_eq!(
            names(&fs.readdir(ROOT_INO, dh, 0).await.unwrap()),
            [".", "..", "new"]
        );
        fs.releasedir(dh);
    }
}
