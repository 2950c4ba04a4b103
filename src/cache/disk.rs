//! Disk tier of the chunk cache: whole chunks kept as files in the volume's cache directory
//! (`cacheDir`), at most `cacheCapacityMB` of them, as the Go driver and `weed mount` size it.
//!
//! A file id names immutable bytes, so a cached file stays valid for as long as it exists:
//! across plugin restarts and upgrades the directory is scanned again and read from. Each
//! file carries a CRC-32 of its bytes; one that does not check out (a torn write, a disk
//! error, an edit by hand) is deleted and the chunk fetched again. A full disk or a deleted
//! directory costs only caching: writes fail (and are retried after recreating the
//! directory), reads miss.

use bytes::Bytes;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// `[magic 4][crc32 of the data, LE 4][data length, LE 8]`, then the data.
/// (Version 1 files were written with other modes and maybe from encrypted chunks: dropped.)
const MAGIC: &[u8; 4] = b"SWC2";
const HEADER: usize = 16;
/// Names of files being written; never read, removed at startup.
const TMP_PREFIX: &str = ".tmp-";
/// A file takes whole blocks on disk: weighed so, many small chunks cannot take far more
/// disk (and inodes) than the capacity says.
const BLOCK: u64 = 4096;

fn weight(len: u64) -> u64 {
    len.div_ceil(BLOCK).max(1) * BLOCK
}

/// Only this process's user reads the cache: the chunks are other users' file contents.
fn make_dir(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

#[derive(Debug, Default)]
pub struct DiskStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub writes: AtomicU64,
    pub write_errors: AtomicU64,
    /// Chunks not written because enough writes were in flight already.
    pub skipped: AtomicU64,
    /// Files dropped because their checksum, length or header was wrong.
    pub corrupt: AtomicU64,
    pub evictions: AtomicU64,
}

pub struct DiskCache {
    dir: PathBuf,
    capacity: u64,
    /// File id -> bytes on disk. Eviction deletes the file.
    index: moka::sync::Cache<String, u64>,
    /// Set when the volume leaves the node: nothing is written (or the directory made again)
    /// any more.
    closed: AtomicBool,
    pub stats: Arc<DiskStats>,
}

/// The file name for a file id: ids are `<volume>,<key><cookie>` (hex) with an optional
/// `_<n>` suffix; anything else is hex-encoded so no id can leave the directory.
fn file_name(fid: &str) -> String {
    let plain = fid.len() <= 200
        && fid.starts_with(|c: char| c.is_ascii_digit())
        && fid.bytes().filter(|b| *b == b',').count() <= 1
        && fid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b',' || b == b'_');
    if plain {
        fid.replace(',', "-")
    } else {
        format!("x{}", hex::encode(fid.as_bytes()))
    }
}

/// The file id a cache file name stands for (None for names this cache did not write).
fn fid_of(name: &str) -> Option<String> {
    if let Some(h) = name.strip_prefix('x') {
        return hex::decode(h).ok().and_then(|b| String::from_utf8(b).ok());
    }
    let ok = name.starts_with(|c: char| c.is_ascii_digit())
        && name.bytes().filter(|b| *b == b'-').count() <= 1
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    ok.then(|| name.replacen('-', ",", 1))
}

impl DiskCache {
    /// Opens (creating it if needed) the cache in `dir`, holding at most `capacity` bytes,
    /// and takes in the chunks a previous process left there (the oldest are evicted first
    /// when they exceed the capacity now).
    /// Blocking (it reads the directory): call it off the async threads.
    pub fn open(dir: &Path, capacity: u64) -> io::Result<Arc<Self>> {
        make_dir(dir)?;
        // also a directory an older version made with looser modes
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let stats = Arc::new(DiskStats::default());
        let st = stats.clone();
        let evict_dir = dir.to_path_buf();
        // LRU: a new chunk always gets in (TinyLFU would keep refusing chunks never read
        // twice once full, freezing the first ones in)
        let index = moka::sync::Cache::builder()
            .max_capacity(capacity)
            .eviction_policy(moka::policy::EvictionPolicy::lru())
            .weigher(|_k: &String, v: &u64| weight(*v).min(u32::MAX as u64) as u32)
            .eviction_listener(move |k: Arc<String>, _v, cause| {
                // a replaced entry's file is the new one; an explicit removal deleted it
                if cause.was_evicted() {
                    st.evictions.fetch_add(1, Ordering::Relaxed);
                    let _ = std::fs::remove_file(evict_dir.join(file_name(&k)));
                }
            })
            .build();
        let c = Arc::new(DiskCache {
            dir: dir.to_path_buf(),
            capacity,
            index,
            closed: AtomicBool::new(false),
            stats,
        });
        c.scan()?;
        Ok(c)
    }

    /// Indexes the files already in the directory, oldest first.
    fn scan(&self) -> io::Result<()> {
        let mut found = Vec::new();
        for ent in std::fs::read_dir(&self.dir)? {
            let Ok(ent) = ent else { continue };
            let name = ent.file_name().to_string_lossy().into_owned();
            let Ok(md) = ent.metadata() else { continue };
            if !md.is_file() {
                continue;
            }
            if name.starts_with(TMP_PREFIX) {
                let _ = std::fs::remove_file(ent.path());
                continue;
            }
            let Some(fid) = fid_of(&name) else {
                continue;
            };
            if md.len() < HEADER as u64 {
                let _ = std::fs::remove_file(ent.path());
                continue;
            }
            let age = md.modified().ok();
            found.push((age, fid, md.len()));
        }
        found.sort();
        for (_, fid, len) in found {
            self.index.insert(fid, len);
        }
        self.index.run_pending_tasks();
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, fid: &str) -> bool {
        self.index.contains_key(fid)
    }

    /// Stops writing: the volume leaves the node and its directory is about to go.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// The chunk's bytes, if cached and intact (blocking file I/O).
    pub fn get(&self, fid: &str) -> Option<Bytes> {
        // a read, for the recency order
        if self.index.get(fid).is_none() {
            self.stats.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let path = self.dir.join(file_name(fid));
        match read_checked(&path) {
            Ok(b) => {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                Some(b)
            }
            Err(e) => {
                match e.kind() {
                    io::ErrorKind::InvalidData => {
                        self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(fid, path = %path.display(), error = %e, "dropping a corrupt chunk cache file");
                        let _ = std::fs::remove_file(&path);
                        self.index.invalidate(fid);
                    }
                    io::ErrorKind::NotFound => self.index.invalidate(fid),
                    // too many open files, EIO, ...: the file may be fine, keep it
                    _ => {
                        tracing::debug!(fid, path = %path.display(), error = %e, "chunk cache file unreadable")
                    }
                }
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Stores the chunk (blocking file I/O). Failures only cost caching.
    pub fn put(&self, fid: &str, data: &[u8]) {
        let size = (data.len() + HEADER) as u64;
        let closed = || self.closed.load(Ordering::SeqCst);
        if weight(size) > self.capacity / 2 || self.index.contains_key(fid) || closed() {
            return;
        }
        let mut r = self.write_file(fid, data);
        if r.as_ref()
            .is_err_and(|e| e.kind() == io::ErrorKind::NotFound)
            && !closed()
        {
            // the directory was deleted under us: make it again
            r = make_dir(&self.dir).and_then(|_| self.write_file(fid, data));
        }
        match r {
            Ok(()) => {
                self.stats.writes.fetch_add(1, Ordering::Relaxed);
                self.index.insert(fid.to_string(), size);
                // evict now: moka otherwise lets dozens of inserts pass the capacity first
                self.index.run_pending_tasks();
            }
            Err(e) => {
                self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(fid, dir = %self.dir.display(), error = %e, "chunk cache write failed");
            }
        }
    }

    /// Writes to a temporary name, then renames: a reader never sees a partial file.
    fn write_file(&self, fid: &str, data: &[u8]) -> io::Result<()> {
        let tmp = self
            .dir
            .join(format!("{TMP_PREFIX}{:016x}", rand::random::<u64>()));
        let r = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            let mut head = [0u8; HEADER];
            head[..4].copy_from_slice(MAGIC);
            head[4..8].copy_from_slice(&crc32fast::hash(data).to_le_bytes());
            head[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
            f.write_all(&head)?;
            f.write_all(data)?;
            std::fs::rename(&tmp, self.dir.join(file_name(fid)))
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }

    /// Bytes the index holds (approximate until pending maintenance runs).
    pub fn weighted_size(&self) -> u64 {
        self.index.weighted_size()
    }

    pub fn run_pending_tasks(&self) {
        self.index.run_pending_tasks();
    }
}

fn read_checked(path: &Path) -> io::Result<Bytes> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
    let mut f = std::fs::File::open(path)?;
    let mut head = [0u8; HEADER];
    f.read_exact(&mut head).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => bad("shorter than its header"),
        _ => e,
    })?;
    if &head[..4] != MAGIC {
        return Err(bad("not a chunk cache file"));
    }
    let crc = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
    let on_disk = f.metadata()?.len().saturating_sub(HEADER as u64);
    if len != on_disk {
        return Err(bad("length differs from its header"));
    }
    let mut data = vec![0u8; len as usize];
    f.read_exact(&mut data)?;
    if crc32fast::hash(&data) != crc {
        return Err(bad("checksum mismatch"));
    }
    Ok(Bytes::from(data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "swcsi-disk-cache-{tag}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn chunks_survive_a_reopen_and_names_stay_inside() {
        let d = tmpdir("reopen");
        let c = DiskCache::open(&d, 1 << 20).unwrap();
        c.put("3,01637037d6", b"hello");
        c.put("../../etc/passwd", b"x");
        c.put("x1,2,3", b"y");
        assert_eq!(c.get("3,01637037d6").unwrap(), Bytes::from_static(b"hello"));
        drop(c);
        let c = DiskCache::open(&d, 1 << 20).unwrap();
        assert_eq!(c.get("3,01637037d6").unwrap(), Bytes::from_static(b"hello"));
        assert_eq!(c.get("../../etc/passwd").unwrap(), Bytes::from_static(b"x"));
        assert_eq!(c.get("x1,2,3").unwrap(), Bytes::from_static(b"y"));
        for ent in std::fs::read_dir(&d).unwrap() {
            assert!(!ent.unwrap().file_name().to_string_lossy().contains('/'));
        }
        assert!(c.get("4,02").is_none());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_corrupt_or_truncated_file_is_dropped_and_missed() {
        let d = tmpdir("corrupt");
        let c = DiskCache::open(&d, 1 << 20).unwrap();
        for (fid, damage) in [("1,aa", 0), ("1,bb", 1)] {
            c.put(fid, &[7u8; 1000]);
            let p = d.join(file_name(fid));
            let mut b = std::fs::read(&p).unwrap();
            if damage == 0 {
                b[HEADER + 500] ^= 1;
            } else {
                b.truncate(HEADER + 10);
            }
            std::fs::write(&p, b).unwrap();
            assert!(c.get(fid).is_none(), "{fid}");
            assert!(!p.exists(), "{fid}");
            assert!(!c.contains(fid));
        }
        assert_eq!(c.stats.corrupt.load(Ordering::Relaxed), 2);
        // and cached again afterwards
        c.put("1,aa", b"fresh");
        assert_eq!(c.get("1,aa").unwrap(), Bytes::from_static(b"fresh"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Found in review: with moka's default admission (TinyLFU) a full cache refused every
    /// chunk not read twice, so it kept its first contents for good.
    #[test]
    fn a_full_cache_takes_new_chunks_and_drops_the_least_recent() {
        let d = tmpdir("lru");
        let c = DiskCache::open(&d, 64 << 10).unwrap();
        for i in 0..64u32 {
            c.put(&format!("3,{i:04x}"), &[5u8; 3000]);
            c.run_pending_tasks();
        }
        assert!(c.get("3,003f").is_some(), "the newest chunk was refused");
        assert!(c.get("3,0000").is_none(), "the oldest chunk is still there");
        assert!(c.weighted_size() <= 64 << 10);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Found in review: any read error (too many open files, EIO) dropped a good file.
    #[test]
    fn a_file_that_cannot_be_read_now_is_kept() {
        let d = tmpdir("unreadable");
        let c = DiskCache::open(&d, 1 << 20).unwrap();
        c.put("1,aa", b"fine");
        let p = d.join(file_name("1,aa"));
        std::fs::remove_file(&p).unwrap();
        // reading it fails, and not because it is gone or corrupt
        std::fs::create_dir(&p).unwrap();
        assert!(c.get("1,aa").is_none());
        assert!(c.contains("1,aa"));
        assert_eq!(c.stats.corrupt.load(Ordering::Relaxed), 0);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_closed_cache_writes_nothing_and_never_makes_its_directory_again() {
        let d = tmpdir("closed");
        let c = DiskCache::open(&d, 1 << 20).unwrap();
        c.close();
        std::fs::remove_dir_all(&d).unwrap();
        c.put("1,01", b"late");
        assert!(!d.exists());
        assert!(c.get("1,01").is_none());
    }

    #[test]
    fn a_deleted_directory_is_made_again_and_capacity_evicts_files() {
        let d = tmpdir("gone");
        let c = DiskCache::open(&d, 64 << 10).unwrap();
        c.put("1,01", &[1u8; 1000]);
        std::fs::remove_dir_all(&d).unwrap();
        assert!(c.get("1,01").is_none());
        c.put("1,02", &[2u8; 1000]);
        assert_eq!(c.get("1,02").unwrap().len(), 1000);
        for i in 0..200u32 {
            c.put(&format!("2,{i:04x}"), &[3u8; 4000]);
        }
        // no maintenance run here: every write keeps the capacity by itself
        let on_disk: u64 = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert!(on_disk <= 64 << 10, "{on_disk} bytes on disk");
        assert!(c.stats.evictions.load(Ordering::Relaxed) > 0);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
