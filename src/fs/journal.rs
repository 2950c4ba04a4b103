//! Crash-safe record of the inode table, kept in a memfd that the fd-keeper holds next to the
//! FUSE fd. After a SIGKILL the successor replays it and knows every node id the kernel may
//! still present (pages of a memfd outlive the process; nothing touches the disk).
//!
//! Layout: a 16-byte header `[start u64][end u64]` (little endian) followed by records
//! `[op u8][ino u64][len u16][path]` (+ `[len u16][path]` for renames). A record is written
//! before the header's `end` moves past it, so a torn append is never replayed. Compaction
//! writes a snapshot after `end`, then moves `start` and `end` with one 16-byte write, then
//! frees the old range.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;

const HEADER: u64 = 16;
const OP_REMEMBER: u8 = 1;
const OP_FORGET: u8 = 2;
const OP_RENAME: u8 = 3;
/// Compact when the live range exceeds this many bytes, or twice the last snapshot (a table
/// whose snapshot alone passes the mark would otherwise be copied out on every append).
const COMPACT_AT: u64 = 32 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalOp {
    Remember {
        ino: u64,
        path: String,
        is_dir: bool,
    },
    Forget {
        ino: u64,
    },
    Rename {
        from: String,
        to: String,
    },
}

pub struct Journal {
    file: File,
    state: parking_lot::Mutex<(u64, u64)>,
    /// The live range that triggers the next compaction.
    compact_at: std::sync::atomic::AtomicU64,
}

impl Journal {
    /// A new, empty journal in a fresh memfd.
    pub fn create() -> io::Result<Self> {
        let fd = nix::sys::memfd::memfd_create(
            c"seaweedfs-inodes",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )?;
        let j = Journal {
            file: File::from(fd),
            state: parking_lot::Mutex::new((HEADER, HEADER)),
            compact_at: COMPACT_AT.into(),
        };
        j.write_header(HEADER, HEADER)?;
        Ok(j)
    }

    /// Opens a journal handed over by the keeper.
    pub fn open(fd: OwnedFd) -> io::Result<Self> {
        let file = File::from(fd);
        let mut h = [0u8; 16];
        file.read_exact_at(&mut h, 0)?;
        let start = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
        let end = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
        if start < HEADER || end < start {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "corrupt inode journal header",
            ));
        }
        Ok(Journal {
            file,
            state: parking_lot::Mutex::new((start, end)),
            compact_at: COMPACT_AT.into(),
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    fn write_header(&self, start: u64, end: u64) -> io::Result<()> {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&start.to_le_bytes());
        h[8..].copy_from_slice(&end.to_le_bytes());
        self.file.write_all_at(&h, 0)
    }

    fn encode(op: &JournalOp, out: &mut Vec<u8>) {
        let put_str = |out: &mut Vec<u8>, s: &str| {
            let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        };
        match op {
            JournalOp::Remember { ino, path, is_dir } => {
                out.push(OP_REMEMBER | if *is_dir { 0x80 } else { 0 });
                out.extend_from_slice(&ino.to_le_bytes());
                put_str(out, path);
            }
            JournalOp::Forget { ino } => {
                out.push(OP_FORGET);
                out.extend_from_slice(&ino.to_le_bytes());
                put_str(out, "");
            }
            JournalOp::Rename { from, to } => {
                out.push(OP_RENAME);
                out.extend_from_slice(&0u64.to_le_bytes());
                put_str(out, from);
                put_str(out, to);
            }
        }
    }

    /// Appends one operation. Errors are logged by the caller; the journal is best effort.
    pub fn append(&self, op: &JournalOp) -> io::Result<()> {
        let mut buf = Vec::with_capacity(64);
        Self::encode(op, &mut buf);
        let mut st = self.state.lock();
        self.file.write_all_at(&buf, st.1)?;
        st.1 += buf.len() as u64;
        self.write_header(st.0, st.1)
    }

    /// Whether the live range has grown to the next compaction.
    pub fn due(&self) -> bool {
        let st = self.state.lock();
        st.1 - st.0 >= self.compact_at.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Replaces the journal's content with `snapshot` when it has grown large.
    pub fn maybe_compact(&self, snapshot: impl FnOnce() -> Vec<JournalOp>) -> io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut st = self.state.lock();
        if st.1 - st.0 < self.compact_at.load(Relaxed) {
            return Ok(());
        }
        let mut buf = Vec::new();
        for op in snapshot() {
            Self::encode(&op, &mut buf);
        }
        // raised first: a compaction of a snapshot over 16 MiB that fails (a full memfd) is
        // not retried on every append
        self.compact_at
            .store(COMPACT_AT.max(2 * buf.len() as u64), Relaxed);
        let new_start = st.1;
        self.file.write_all_at(&buf, new_start)?;
        let new_end = new_start + buf.len() as u64;
        self.write_header(new_start, new_end)?;
        let old = *st;
        *st = (new_start, new_end);
        // give the old range's pages back
        let _ = nix::fcntl::fallocate(
            &self.file,
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            old.0 as i64,
            (old.1 - old.0) as i64,
        );
        Ok(())
    }

    /// Every complete operation, oldest first.
    pub fn replay(&self) -> io::Result<Vec<JournalOp>> {
        let (start, end) = *self.state.lock();
        let mut data = vec![0u8; (end - start) as usize];
        self.file.read_exact_at(&mut data, start)?;
        let mut ops = Vec::new();
        let mut i = 0usize;
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "corrupt inode journal record");
        let get_str = |i: &mut usize| -> io::Result<String> {
            let l = u16::from_le_bytes(data.get(*i..*i + 2).ok_or_else(bad)?.try_into().expect("2"))
                as usize;
            let s = data.get(*i + 2..*i + 2 + l).ok_or_else(bad)?;
            *i += 2 + l;
            Ok(String::from_utf8_lossy(s).into_owned())
        };
        while i < data.len() {
            let op = data[i];
            let ino = u64::from_le_bytes(
                data.get(i + 1..i + 9)
                    .ok_or_else(bad)?
                    .try_into()
                    .expect("8"),
            );
            i += 9;
            match op & 0x7f {
                OP_REMEMBER => {
                    let path = get_str(&mut i)?;
                    ops.push(JournalOp::Remember {
                        ino,
                        path,
                        is_dir: op & 0x80 != 0,
                    });
                }
                OP_FORGET => {
                    get_str(&mut i)?;
                    ops.push(JournalOp::Forget { ino });
                }
                OP_RENAME => {
                    let from = get_str(&mut i)?;
                    let to = get_str(&mut i)?;
                    ops.push(JournalOp::Rename { from, to });
                }
                _ => return Err(bad()),
            }
        }
        Ok(ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_replay_and_reopen() {
        let j = Journal::create().unwrap();
        j.append(&JournalOp::Remember {
            ino: 5,
            path: "/a".into(),
            is_dir: true,
        })
        .unwrap();
        j.append(&JournalOp::Rename {
            from: "/a".into(),
            to: "/b".into(),
        })
        .unwrap();
        j.append(&JournalOp::Forget { ino: 5 }).unwrap();
        let dup = j.fd().try_clone_to_owned().unwrap();
        let j2 = Journal::open(dup).unwrap();
        assert_eq!(
            j2.replay().unwrap(),
            vec![
                JournalOp::Remember {
                    ino: 5,
                    path: "/a".into(),
                    is_dir: true
                },
                JournalOp::Rename {
                    from: "/a".into(),
                    to: "/b".into()
                },
                JournalOp::Forget { ino: 5 },
            ]
        );
    }

    /// A table whose snapshot passes the mark is compacted once, then again only after the
    /// journal has doubled: not on every append (each one copying out the whole table).
    #[test]
    fn a_large_snapshot_is_not_rewritten_on_every_append() {
        let j = Journal::create().unwrap();
        let op = |i: u64| JournalOp::Remember {
            ino: i,
            path: format!("/buckets/v/{i:0>1000}"),
            is_dir: false,
        };
        // a live table of ~34 MiB: past the mark on its own
        let table: Vec<JournalOp> = (0..34_000).map(op).collect();
        let compactions = std::cell::Cell::new(0);
        let (mut i, mut after) = (0, 0);
        while after < 20 {
            j.append(&op(i)).unwrap();
            j.maybe_compact(|| {
                compactions.set(compactions.get() + 1);
                table.clone()
            })
            .unwrap();
            i += 1;
            after += (compactions.get() > 0) as u32;
        }
        assert_eq!(compactions.get(), 1, "compacted again at once");
        let ops = j.replay().unwrap();
        assert_eq!(ops.len(), table.len() + 19);
        assert_eq!(ops.last(), Some(&op(i - 1)));
    }

    #[test]
    fn torn_append_is_not_replayed() {
        let j = Journal::create().unwrap();
        j.append(&JournalOp::Remember {
            ino: 7,
            path: "/x".into(),
            is_dir: false,
        })
        .unwrap();
        // bytes written past `end` without a header update (a crash mid-append)
        j.file
            .write_all_at(&[1, 2, 3, 4, 5], j.state.lock().1)
            .unwrap();
        let j2 = Journal::open(j.fd().try_clone_to_owned().unwrap()).unwrap();
        assert_eq!(j2.replay().unwrap().len(), 1);
    }
}
