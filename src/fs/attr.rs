//! Entry <-> POSIX attribute conversions. `file_mode` on the filer is Go's `os.FileMode`
//! (type in the high bits), not `st_mode`; inode numbers come from `attributes.inode`.

use crate::pb::filer as pb;
use md5::{Digest, Md5};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const GO_DIR: u32 = 1 << 31;
const GO_SYMLINK: u32 = 1 << 27;
const GO_DEVICE: u32 = 1 << 26;
const GO_PIPE: u32 = 1 << 25;
const GO_SOCKET: u32 = 1 << 24;
const GO_SETUID: u32 = 1 << 23;
const GO_SETGID: u32 = 1 << 22;
const GO_CHARDEV: u32 = 1 << 21;
const GO_STICKY: u32 = 1 << 20;

/// File type as the filesystem layer sees it (no FUSE types here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

/// POSIX attributes of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub kind: Kind,
    /// Permission bits incl. suid/sgid/sticky (0o7777).
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub crtime: SystemTime,
}

/// Go FileMode -> (kind, permission bits).
pub fn from_go_mode(m: u32) -> (Kind, u16) {
    let kind = if m & GO_DIR != 0 {
        Kind::Dir
    } else if m & GO_SYMLINK != 0 {
        Kind::Symlink
    } else if m & GO_CHARDEV != 0 {
        Kind::CharDev
    } else if m & GO_DEVICE != 0 {
        Kind::BlockDev
    } else if m & GO_PIPE != 0 {
        Kind::Fifo
    } else if m & GO_SOCKET != 0 {
        Kind::Socket
    } else {
        Kind::File
    };
    let mut perm = (m & 0o7777) as u16;
    if m & GO_SETUID != 0 {
        perm |= 0o4000;
    }
    if m & GO_SETGID != 0 {
        perm |= 0o2000;
    }
    if m & GO_STICKY != 0 {
        perm |= 0o1000;
    }
    (kind, perm)
}

/// (kind, permission bits) -> Go FileMode, the way `weed mount` stores it.
pub fn to_go_mode(kind: Kind, perm: u32) -> u32 {
    let t = match kind {
        Kind::File => 0,
        Kind::Dir => GO_DIR,
        Kind::Symlink => GO_SYMLINK,
        Kind::Fifo => GO_PIPE,
        Kind::Socket => GO_SOCKET,
        Kind::CharDev => GO_CHARDEV,
        Kind::BlockDev => GO_DEVICE,
    };
    t | (perm & 0o7777)
}

/// POSIX `st_mode` type bits -> kind.
pub fn kind_from_posix(mode: u32) -> Option<Kind> {
    Some(match mode & libc::S_IFMT {
        libc::S_IFREG | 0 => Kind::File,
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFLNK => Kind::Symlink,
        libc::S_IFIFO => Kind::Fifo,
        libc::S_IFSOCK => Kind::Socket,
        libc::S_IFCHR => Kind::CharDev,
        libc::S_IFBLK => Kind::BlockDev,
        _ => return None,
    })
}

/// The filer's inode formula: BE u64 of md5(path)[0..8] + crtime*37 (wrapping).
pub fn path_inode(path: &str, crtime_secs: i64) -> u64 {
    let d = Md5::digest(path.as_bytes());
    let base = u64::from_be_bytes(d[..8].try_into().expect("md5 has 16 bytes"));
    base.wrapping_add((crtime_secs as u64).wrapping_mul(37))
}

/// Inode of a hard-link group: BE u64 of md5(hard_link_id)[0..8].
pub fn hardlink_inode(id: &[u8]) -> u64 {
    let d = Md5::digest(id);
    u64::from_be_bytes(d[..8].try_into().expect("md5 has 16 bytes"))
}

/// The entry is one of several names of its file (a hard link): its content record is shared,
/// and removing this name leaves the file.
pub fn has_other_links(e: &pb::Entry) -> bool {
    !e.hard_link_id.is_empty() && e.hard_link_counter > 1
}

/// Inode number for an entry at `path`; never 0 or 1 (1 is the mount root).
pub fn entry_inode(path: &str, e: &pb::Entry) -> u64 {
    let a = e.attributes.as_ref();
    let ino = match a.map(|a| a.inode).unwrap_or(0) {
        0 if !e.hard_link_id.is_empty() => hardlink_inode(&e.hard_link_id),
        0 => path_inode(path, a.map(|a| a.crtime).unwrap_or(0)),
        i => i,
    };
    if ino <= 1 {
        ino + 2
    } else {
        ino
    }
}

/// An entry's creation time: (seconds, nanoseconds); (0, 0) when unknown.
pub fn birth(e: &pb::Entry) -> (i64, i32) {
    e.attributes
        .as_ref()
        .map(|a| (a.crtime, a.crtime_ns))
        .unwrap_or((0, 0))
}

/// What the filer says identifies the file `e` at `path` (see [`super::inode::FileId`]).
pub fn file_id(path: &str, e: &pb::Entry) -> super::inode::FileId {
    super::inode::FileId {
        base: entry_inode(path, e),
        birth: birth(e),
        is_dir: e.is_directory,
    }
}

/// Filer seconds and nanoseconds (nanoseconds always forward, also before 1970) as a time.
pub fn ts(secs: i64, nanos: i32) -> SystemTime {
    let nanos = Duration::from_nanos(nanos.clamp(0, 999_999_999) as u64);
    let t = if secs >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(secs as u64))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs()))
    };
    t.and_then(|t| t.checked_add(nanos)).unwrap_or(UNIX_EPOCH)
}

/// The inverse of [`ts`]: times before 1970 have negative seconds (as the filer and `weed
/// mount` store them), not 0.
pub fn split_ts(t: SystemTime) -> (i64, i32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos() as i32),
        Err(e) => {
            let d = e.duration();
            let secs = -(d.as_secs().min(i64::MAX as u64) as i64);
            match d.subsec_nanos() {
                0 => (secs, 0),
                n => (secs - 1, (1_000_000_000 - n) as i32),
            }
        }
    }
}

/// Maps ids between local and filer views (`-map.uid` / `-map.gid`).
#[derive(Debug, Clone, Default)]
pub struct IdMap {
    pub uids: Vec<(u32, u32)>,
    pub gids: Vec<(u32, u32)>,
}

impl IdMap {
    pub fn uid_to_local(&self, filer: u32) -> u32 {
        self.uids
            .iter()
            .find(|(_, f)| *f == filer)
            .map(|(l, _)| *l)
            .unwrap_or(filer)
    }
    pub fn gid_to_local(&self, filer: u32) -> u32 {
        self.gids
            .iter()
            .find(|(_, f)| *f == filer)
            .map(|(l, _)| *l)
            .unwrap_or(filer)
    }
    pub fn uid_to_filer(&self, local: u32) -> u32 {
        self.uids
            .iter()
            .find(|(l, _)| *l == local)
            .map(|(_, f)| *f)
            .unwrap_or(local)
    }
    pub fn gid_to_filer(&self, local: u32) -> u32 {
        self.gids
            .iter()
            .find(|(l, _)| *l == local)
            .map(|(_, f)| *f)
            .unwrap_or(local)
    }
}

/// Size of an entry: inline content, attributes and the chunk list, whichever reaches furthest.
pub fn entry_size(e: &pb::Entry) -> u64 {
    let attr = e.attributes.as_ref().map(|a| a.file_size).unwrap_or(0);
    let chunks = e
        .chunks
        .iter()
        .map(|c| (c.offset.max(0) as u64).saturating_add(c.size))
        .max()
        .unwrap_or(0);
    attr.max(chunks).max(e.content.len() as u64)
}

/// POSIX attributes of a filer entry.
pub fn entry_attr(ino: u64, e: &pb::Entry, ids: &IdMap) -> Attr {
    let default = pb::FuseAttributes::default();
    let a = e.attributes.as_ref().unwrap_or(&default);
    let (mut kind, perm) = from_go_mode(a.file_mode);
    if e.is_directory {
        kind = Kind::Dir;
    }
    let mtime = ts(a.mtime, a.mtime_ns);
    let ctime = if a.ctime > 0 {
        ts(a.ctime, a.ctime_ns)
    } else {
        mtime
    };
    let atime = if a.atime > 0 {
        ts(a.atime, a.atime_ns)
    } else {
        mtime
    };
    let crtime = if a.crtime > 0 {
        ts(a.crtime, a.crtime_ns)
    } else {
        mtime
    };
    let size = match kind {
        Kind::Symlink => a.symlink_target.len() as u64,
        Kind::Dir => 4096,
        _ => entry_size(e),
    };
    let nlink = match kind {
        Kind::Dir => 2,
        _ if e.hard_link_counter > 0 => e.hard_link_counter as u32,
        _ => 1,
    };
    Attr {
        ino,
        size,
        kind,
        perm,
        nlink,
        uid: ids.uid_to_local(a.uid),
        gid: ids.gid_to_local(a.gid),
        rdev: a.rdev,
        atime,
        mtime,
        ctime,
        crtime,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn times_before_1970_keep_their_value() {
        for (secs, nanos) in [
            (-1, 0),
            (-100, 5),
            (-2, 500_000_000),
            (0, 1),
            (1_700_000_000, 9),
        ] {
            assert_eq!(split_ts(ts(secs, nanos)), (secs, nanos));
        }
        let t = UNIX_EPOCH - Duration::from_millis(1500);
        assert_eq!(split_ts(t), (-2, 500_000_000));
        assert_eq!(ts(-2, 500_000_000), t);
    }

    use super::*;

    #[test]
    fn go_modes_round_trip() {
        assert_eq!(from_go_mode(0x800001ed), (Kind::Dir, 0o755));
        assert_eq!(from_go_mode(0x080001ff), (Kind::Symlink, 0o777));
        assert_eq!(from_go_mode(0x1a4), (Kind::File, 0o644));
        assert_eq!(from_go_mode(GO_SETUID | 0o755), (Kind::File, 0o4755));
        for k in [
            Kind::File,
            Kind::Dir,
            Kind::Symlink,
            Kind::Fifo,
            Kind::Socket,
            Kind::CharDev,
            Kind::BlockDev,
        ] {
            assert_eq!(from_go_mode(to_go_mode(k, 0o1750)), (k, 0o1750));
        }
    }

    #[test]
    fn ctime_zero_falls_back_to_mtime() {
        let e = pb::Entry {
            attributes: Some(pb::FuseAttributes {
                mtime: 100,
                ctime: -62135596800,
                file_mode: 0o644,
                ..Default::default()
            }),
            ..Default::default()
        };
        let a = entry_attr(5, &e, &IdMap::default());
        assert_eq!(a.ctime, a.mtime);
        assert_eq!(a.mtime, UNIX_EPOCH + Duration::from_secs(100));
    }

    #[test]
    fn id_maps_both_ways() {
        let m = IdMap {
            uids: vec![(1000, 0)],
            gids: vec![],
        };
        assert_eq!(m.uid_to_local(0), 1000);
        assert_eq!(m.uid_to_filer(1000), 0);
        assert_eq!(m.uid_to_local(7), 7);
    }
}
