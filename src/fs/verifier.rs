//! A write verifier across crashes, as NFS has: a handle whose acknowledged writes died with a
//! SIGKILLed process must not go on as if nothing happened.
//!
//! The process records which inodes hold acknowledged-but-uncommitted data in a small memfd
//! that the fd-keeper holds next to the inode journal: one record when a file goes from clean
//! to dirty, one when a commit leaves it clean (never one per write). A successor that adopts
//! the session loads that set; every handle of a previous process on such an inode is *lost*:
//! write, fsync and flush (close) fail with EIO from then on, reads go on (they return what
//! the filer has), release is fine. Handles opened after the adoption, and old handles on
//! inodes that had nothing uncommitted, keep working. A graceful handover flushes first, so
//! it loses nothing unless that flush failed.
//!
//! Old and new handles are told apart by number: fhs start at the process's start time in ns
//! (`Fs::new`), so every fh below ours belongs to a predecessor, and a handle the kernel
//! presents that we never issued (`Fs::handle`) is one of theirs. Lost inodes are inherited
//! across further crashes and handovers with the bound `below` (the adopting process's first
//! fh), so its own handles are not caught by a loss that predates them. This assumes the wall
//! clock does not step back by more than a process's uptime between generations (the fh
//! numbering assumes that already).
//!
//! Layout: a 16-byte header `[start u64][end u64]` (little endian), then fixed 17-byte records
//! `[op u8][ino u64][below u64]`. A record is written before the header's `end` moves past it,
//! so a torn append is never replayed; a rewrite goes after `end` and is switched to with one
//! header write, as in the inode journal.

use super::file::OpenFile;
use super::{errno, Result};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

const HEADER: u64 = 16;
const REC: usize = 17;
const OP_DIRTY: u8 = 1;
const OP_CLEAN: u8 = 2;
const OP_LOST: u8 = 3;
/// Rewrite the log when its live range exceeds this (about 60 000 clean/dirty pairs).
const COMPACT_AT: u64 = 2 << 20;
/// `Lost` with this inode covers every inode (the log could not be read).
const ANY_INODE: u64 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// The inode got acknowledged data that is not on the filer yet.
    Dirty(u64),
    /// A commit took everything the inode had to the filer.
    Clean(u64),
    /// Handles below `below` on `ino` (every inode for [`ANY_INODE`]) lost data in a crash.
    Lost { ino: u64, below: u64 },
}

impl Record {
    fn encode(&self) -> [u8; REC] {
        let (op, ino, below) = match *self {
            Record::Dirty(ino) => (OP_DIRTY, ino, 0),
            Record::Clean(ino) => (OP_CLEAN, ino, 0),
            Record::Lost { ino, below } => (OP_LOST, ino, below),
        };
        let mut b = [0u8; REC];
        b[0] = op;
        b[1..9].copy_from_slice(&ino.to_le_bytes());
        b[9..].copy_from_slice(&below.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> io::Result<Record> {
        let word = |r: std::ops::Range<usize>| {
            b.get(r)
                .and_then(|s| s.try_into().ok())
                .map(u64::from_le_bytes)
                .ok_or_else(|| bad("short record"))
        };
        let (ino, below) = (word(1..9)?, word(9..REC)?);
        match b.first() {
            Some(&OP_DIRTY) => Ok(Record::Dirty(ino)),
            Some(&OP_CLEAN) => Ok(Record::Clean(ino)),
            Some(&OP_LOST) => Ok(Record::Lost { ino, below }),
            _ => Err(bad("unknown record")),
        }
    }
}

fn bad(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("dirty-inode log: {what}"),
    )
}

/// The crash-surviving record of dirty inodes (a memfd).
pub struct DirtyLog {
    file: File,
    /// (start, end) of the live records.
    range: Mutex<(u64, u64)>,
}

impl DirtyLog {
    pub fn create() -> io::Result<Self> {
        let fd = nix::sys::memfd::memfd_create(
            c"seaweedfs-dirty",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )?;
        let log = DirtyLog {
            file: File::from(fd),
            range: Mutex::new((HEADER, HEADER)),
        };
        log.write_header(HEADER, HEADER)?;
        Ok(log)
    }

    /// Opens a log handed over by the keeper. A bad header shows in [`Self::replay`].
    pub fn open(fd: OwnedFd) -> Self {
        let file = File::from(fd);
        let mut h = [0u8; HEADER as usize];
        let range = match file.read_exact_at(&mut h, 0) {
            Ok(()) => {
                let word = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap_or([0; 8]));
                (word(0), word(8))
            }
            Err(_) => (0, 0),
        };
        DirtyLog {
            file,
            range: Mutex::new(range),
        }
    }

    /// Empties a log whose content cannot be trusted.
    fn reset(&self) -> io::Result<()> {
        let mut range = self.range.lock();
        self.file.set_len(0)?;
        self.write_header(HEADER, HEADER)?;
        *range = (HEADER, HEADER);
        Ok(())
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    fn write_header(&self, start: u64, end: u64) -> io::Result<()> {
        let mut h = [0u8; HEADER as usize];
        h[..8].copy_from_slice(&start.to_le_bytes());
        h[8..].copy_from_slice(&end.to_le_bytes());
        self.file.write_all_at(&h, 0)
    }

    pub fn append(&self, r: Record) -> io::Result<()> {
        let mut range = self.range.lock();
        self.file.write_all_at(&r.encode(), range.1)?;
        range.1 += REC as u64;
        self.write_header(range.0, range.1)
    }

    /// Every complete record, oldest first.
    pub fn replay(&self) -> io::Result<Vec<Record>> {
        let (start, end) = *self.range.lock();
        if start < HEADER || end < start || (end - start) % REC as u64 != 0 {
            return Err(bad(&format!("corrupt header ({start}, {end})")));
        }
        if end > self.file.metadata()?.len() {
            return Err(bad(&format!(
                "header ({start}, {end}) past the end of the log"
            )));
        }
        let len = usize::try_from(end - start).map_err(|_| bad("too large"))?;
        let mut data = vec![0u8; len];
        self.file.read_exact_at(&mut data, start)?;
        data.chunks(REC).map(Record::decode).collect()
    }

    /// Replaces the content with `records` (written after the live range, switched to with
    /// one header write, the old range's pages given back).
    pub fn rewrite(&self, records: &[Record]) -> io::Result<()> {
        let buf: Vec<u8> = records.iter().flat_map(|r| r.encode()).collect();
        let mut range = self.range.lock();
        let start = range.1;
        self.file.write_all_at(&buf, start)?;
        let end = start + buf.len() as u64;
        self.write_header(start, end)?;
        let old = std::mem::replace(&mut *range, (start, end));
        let _ = nix::fcntl::fallocate(
            &self.file,
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            old.0 as i64,
            old.1.saturating_sub(old.0) as i64,
        );
        Ok(())
    }

    fn len(&self) -> u64 {
        let r = self.range.lock();
        r.1.saturating_sub(r.0)
    }
}

/// What a successor learns from a predecessor's log: inode -> handles below this fh are lost.
pub fn lost_inodes(records: &[Record]) -> HashMap<u64, u64> {
    let mut dirty = HashSet::new();
    let mut lost: HashMap<u64, u64> = HashMap::new();
    for r in records {
        match *r {
            Record::Dirty(ino) => {
                dirty.insert(ino);
            }
            Record::Clean(ino) => {
                dirty.remove(&ino);
            }
            Record::Lost { ino, below } => {
                let b = lost.entry(ino).or_default();
                *b = (*b).max(below);
            }
        }
    }
    // every handle the predecessor knew on a dirty inode lost data (it issued or adopted
    // them all below our first fh; ours are bounded when the set is written down again)
    for ino in dirty {
        lost.insert(ino, u64::MAX);
    }
    lost
}

#[derive(Default)]
struct State {
    /// Inodes of ours with acknowledged data not on the filer yet (as the log says).
    dirty: HashSet<u64>,
    /// Inherited: handles below the value on the inode (or on any, [`ANY_INODE`]) are lost.
    lost_inodes: HashMap<u64, u64>,
    /// Predecessors' handles found lost so far.
    lost_handles: HashSet<u64>,
}

pub struct Verifier {
    /// The first fh this process issues.
    first_fh: u64,
    log: OnceLock<DirtyLog>,
    state: Mutex<State>,
    /// Anything inherited: only then do handle checks take the lock.
    inherited: AtomicBool,
}

impl Verifier {
    pub fn new(first_fh: u64) -> Self {
        Verifier {
            first_fh,
            log: OnceLock::new(),
            state: Mutex::new(State::default()),
            inherited: AtomicBool::new(false),
        }
    }

    /// Starts recording into `log` (a fresh mount). Without a log nothing is recorded: the
    /// session does not outlive the process.
    pub fn attach(&self, log: DirtyLog) {
        let _ = self.log.set(log);
    }

    /// Loads what a predecessor left in `log`, writes it down again with our bound and
    /// records into it from now on. Returns the number of inodes whose old handles are lost.
    pub fn adopt(&self, log: DirtyLog) -> usize {
        let mut lost = match log.replay() {
            Ok(records) => lost_inodes(&records),
            Err(e) => {
                // nothing says which inodes were dirty: fail every old handle's writes rather
                // than let one go on over missing bytes
                tracing::error!(error = %e, "dirty-inode log unreadable; every handle of the previous process will fail writes and syncs with EIO");
                if let Err(e) = log.reset() {
                    tracing::error!(error = %e, "dirty-inode log reset failed");
                }
                HashMap::from([(ANY_INODE, u64::MAX)])
            }
        };
        for below in lost.values_mut() {
            *below = (*below).min(self.first_fh);
        }
        let records: Vec<Record> = lost
            .iter()
            .map(|(&ino, &below)| Record::Lost { ino, below })
            .collect();
        if let Err(e) = log.rewrite(&records) {
            tracing::error!(error = %e, "dirty-inode log rewrite failed; a later crash may not report lost data");
        }
        let n = lost.len();
        if n > 0 {
            tracing::warn!(
                inodes = n,
                "handles of the previous process on inodes with unflushed data lost it; their writes and syncs fail with EIO"
            );
            self.inherited.store(true, Ordering::Release);
        }
        self.state.lock().lost_inodes = lost;
        self.attach(log);
        n
    }

    /// After a write was buffered on `ino` (before it is acknowledged).
    pub fn dirtied(&self, ino: u64) {
        let Some(log) = self.log.get() else { return };
        let mut st = self.state.lock();
        if !st.dirty.insert(ino) {
            return;
        }
        if let Err(e) = log.append(Record::Dirty(ino)) {
            // not recorded: the next write tries again
            st.dirty.remove(&ino);
            tracing::error!(ino, error = %e, "dirty-inode log append failed; a crash may not report this file's lost data");
        }
    }

    /// After a flush of `of`, the inode's current open state: forgets the inode once nothing
    /// of it is left to commit. A write buffered since is seen here, or records itself again
    /// afterwards ([`Self::dirtied`] runs after the buffering, both under the lock).
    pub fn settled(&self, of: &OpenFile) {
        let Some(log) = self.log.get() else { return };
        let mut st = self.state.lock();
        if !st.dirty.contains(&of.ino) || !of.state.lock().is_clean() {
            return;
        }
        self.forget(log, &mut st, of.ino);
    }

    /// The inode's last handle of ours was released: no handle of this process is left to
    /// lose anything on it (data that could not be placed was reported at that close), so it
    /// leaves the set even if never committed (unlinked while open, or failed).
    pub fn closed(&self, ino: u64) {
        let Some(log) = self.log.get() else { return };
        let mut st = self.state.lock();
        if st.dirty.contains(&ino) {
            self.forget(log, &mut st, ino);
        }
    }

    fn forget(&self, log: &DirtyLog, st: &mut State, ino: u64) {
        st.dirty.remove(&ino);
        if let Err(e) = log.append(Record::Clean(ino)) {
            tracing::warn!(ino, error = %e, "dirty-inode log append failed");
        }
        if log.len() >= COMPACT_AT {
            let mut records: Vec<Record> = st
                .lost_inodes
                .iter()
                .map(|(&ino, &below)| Record::Lost { ino, below })
                .collect();
            records.extend(st.dirty.iter().map(|&i| Record::Dirty(i)));
            if let Err(e) = log.rewrite(&records) {
                tracing::warn!(error = %e, "dirty-inode log compaction failed");
            }
        }
    }

    /// A handle of a previous process is used for the first time.
    pub fn adopted_handle(&self, fh: u64, ino: u64) {
        if !self.inherited.load(Ordering::Acquire) {
            return;
        }
        let mut st = self.state.lock();
        let covers = |i| st.lost_inodes.get(&i).is_some_and(|&below| fh < below);
        if covers(ino) || covers(ANY_INODE) {
            tracing::warn!(fh, ino, "a handle whose unflushed writes died with the previous process: writes and syncs on it fail with EIO");
            st.lost_handles.insert(fh);
        }
    }

    /// EIO for a lost handle (write, fsync, flush).
    pub fn check(&self, fh: u64) -> Result<()> {
        if self.inherited.load(Ordering::Acquire) && self.state.lock().lost_handles.contains(&fh) {
            return Err(errno(
                libc::EIO,
                "data written through this handle was lost when the previous plugin process died",
            ));
        }
        Ok(())
    }

    pub fn released(&self, fh: u64) {
        if self.inherited.load(Ordering::Acquire) {
            self.state.lock().lost_handles.remove(&fh);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::filer as pb;

    fn reopen(log: &DirtyLog) -> DirtyLog {
        DirtyLog::open(log.fd().try_clone_to_owned().unwrap())
    }

    fn file(ino: u64) -> OpenFile {
        OpenFile::new(ino, "/d".into(), pb::Entry::default(), 8, 4)
    }

    #[test]
    fn records_replay_in_order_through_a_dup() {
        let log = DirtyLog::create().unwrap();
        let rs = [
            Record::Dirty(5),
            Record::Clean(5),
            Record::Lost { ino: 9, below: 77 },
        ];
        for r in rs {
            log.append(r).unwrap();
        }
        assert_eq!(reopen(&log).replay().unwrap(), rs);
    }

    #[test]
    fn torn_append_is_not_replayed() {
        let log = DirtyLog::create().unwrap();
        log.append(Record::Dirty(3)).unwrap();
        let end = log.range.lock().1;
        log.file
            .write_all_at(&Record::Dirty(4).encode(), end)
            .unwrap();
        assert_eq!(reopen(&log).replay().unwrap(), [Record::Dirty(3)]);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let log = DirtyLog::create().unwrap();
        log.append(Record::Dirty(3)).unwrap();
        log.file.write_all_at(&[0xee], HEADER).unwrap();
        assert!(reopen(&log).replay().is_err());
        log.write_header(HEADER, HEADER + 5).unwrap();
        assert!(reopen(&log).replay().is_err());
        // a header claiming far more than the log holds is an error, not a huge allocation
        log.write_header(HEADER, HEADER + REC as u64 * (1 << 40))
            .unwrap();
        assert!(reopen(&log).replay().is_err());
        log.file.set_len(3).unwrap();
        assert!(reopen(&log).replay().is_err());
        assert!(Record::decode(&[1, 2]).is_err());
    }

    #[test]
    fn only_inodes_dirty_at_the_end_are_lost() {
        let rs = [
            Record::Dirty(1),
            Record::Dirty(2),
            Record::Clean(1),
            Record::Lost { ino: 7, below: 50 },
            Record::Lost { ino: 7, below: 40 },
        ];
        let lost = lost_inodes(&rs);
        assert_eq!(lost, HashMap::from([(2, u64::MAX), (7, 50)]));
    }

    #[test]
    fn one_record_per_transition_and_clean_only_when_nothing_is_left() {
        let v = Verifier::new(1000);
        let log = DirtyLog::create().unwrap();
        // a dup, as the keeper holds; each reopen reads the header as a successor would
        let kept = reopen(&log);
        v.attach(log);
        let f = file(4);
        f.write(0, b"abc");
        v.dirtied(4);
        f.write(3, b"def");
        v.dirtied(4);
        assert_eq!(reopen(&kept).replay().unwrap(), [Record::Dirty(4)]);
        // bytes still buffered: not clean
        v.settled(&f);
        assert_eq!(reopen(&kept).replay().unwrap(), [Record::Dirty(4)]);
        {
            let mut s = f.state.lock();
            s.slots.clear();
            s.meta_dirty = false;
        }
        v.settled(&f);
        v.settled(&f);
        assert_eq!(
            reopen(&kept).replay().unwrap(),
            [Record::Dirty(4), Record::Clean(4)]
        );
    }

    #[test]
    fn the_last_close_takes_an_inode_out_of_the_set() {
        // unlinked while open (never committed): the set must not keep it forever
        let v = Verifier::new(1000);
        let log = DirtyLog::create().unwrap();
        let kept = reopen(&log);
        v.attach(log);
        v.dirtied(9);
        v.closed(9);
        v.closed(9);
        let rs = reopen(&kept).replay().unwrap();
        assert_eq!(rs, [Record::Dirty(9), Record::Clean(9)]);
        assert!(lost_inodes(&rs).is_empty());
        assert!(v.state.lock().dirty.is_empty());
    }

    #[test]
    fn a_successor_fails_exactly_the_old_handles_on_dirty_inodes() {
        // predecessor: inode 4 dirty at the crash, inode 5 committed
        let log = DirtyLog::create().unwrap();
        for r in [Record::Dirty(4), Record::Dirty(5), Record::Clean(5)] {
            log.append(r).unwrap();
        }
        let v = Verifier::new(1000);
        assert_eq!(v.adopt(reopen(&log)), 1);
        v.adopted_handle(10, 4);
        v.adopted_handle(11, 5);
        assert_eq!(v.check(10).unwrap_err().errno, libc::EIO);
        assert!(v.check(11).is_ok());
        // ours are never looked at by adopted_handle; a new one is fine
        assert!(v.check(1000).is_ok());
        v.released(10);
        assert!(v.check(10).is_ok());
        // written down again bounded by our first fh, for the next generation
        assert_eq!(
            reopen(&log).replay().unwrap(),
            [Record::Lost {
                ino: 4,
                below: 1000
            }]
        );
    }

    #[test]
    fn losses_are_inherited_without_catching_later_handles() {
        let log = DirtyLog::create().unwrap();
        log.append(Record::Dirty(4)).unwrap();
        let v1 = Verifier::new(1000);
        v1.adopt(reopen(&log));
        // generation 1 dirties inode 6, then dies too
        v1.dirtied(6);
        let v2 = Verifier::new(2000);
        assert_eq!(v2.adopt(reopen(&log)), 2);
        v2.adopted_handle(10, 4); // generation 0's handle: still lost
        v2.adopted_handle(1500, 4); // generation 1's handle on 4: fine
        v2.adopted_handle(1501, 6); // generation 1's handle on 6: lost
        assert!(v2.check(10).is_err());
        assert!(v2.check(1500).is_ok());
        assert!(v2.check(1501).is_err());
    }

    #[test]
    fn an_unreadable_log_fails_every_old_handle() {
        let log = DirtyLog::create().unwrap();
        log.append(Record::Dirty(3)).unwrap();
        log.file.write_all_at(&[0xee], HEADER).unwrap();
        let v = Verifier::new(1000);
        v.adopt(reopen(&log));
        v.adopted_handle(10, 42);
        assert!(v.check(10).is_err());
        // and the next generation still knows
        let v2 = Verifier::new(2000);
        v2.adopt(reopen(&log));
        v2.adopted_handle(11, 42);
        v2.adopted_handle(1500, 42);
        assert!(v2.check(11).is_err());
        assert!(v2.check(1500).is_ok());
    }

    #[test]
    fn without_a_log_nothing_is_recorded_or_checked() {
        let v = Verifier::new(1000);
        v.dirtied(4);
        v.adopted_handle(10, 4);
        assert!(v.check(10).is_ok());
        assert!(v.state.lock().dirty.is_empty());
    }
}
