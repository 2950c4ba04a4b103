//! Data integrity and failure behaviour of our FUSE mount against a real `weed` 4.48: large
//! random-offset writes, concurrent writers, unlink/rename of open files, and inode stability
//! across remounts. Failures of the filer are in tests/fuse_faults.rs.

mod common;
mod fuse_support;

use fuse_support::*;
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::time::Instant;

const MIB: usize = 1 << 20;

/// xorshift for offsets/lengths (deterministic per seed).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    if let Some(at) = first_difference(got, want) {
        panic!(
            "{what}: differs at byte {at} (len {} vs {})",
            got.len(),
            want.len()
        );
    }
}

#[test]
fn large_file_random_offsets_byte_for_byte() {
    let w = shared_server();
    let root = unique_path("large");
    let m = mount_ours(&w, &root, &[]);
    let size = 100 * MIB + 12_345;
    let mut want = vec![0u8; size];
    let p = m.join("big.bin");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .unwrap();
    // the last byte first, then random overlapping writes of 1 B .. 3 MiB
    let mut rng = Rng(0x5eed_1234_abcd);
    f.write_all_at(&[0xAB], size as u64 - 1).unwrap();
    want[size - 1] = 0xAB;
    let mut written = 0usize;
    let mut i = 0u64;
    let started = Instant::now();
    while written < 2 * size {
        let len = match rng.below(4) {
            0 => 1 + rng.below(100) as usize,
            1 => 1 + rng.below(64 * 1024) as usize,
            _ => 1 + rng.below(3 * MIB as u64) as usize,
        };
        let off = rng.below((size - len) as u64) as usize;
        let data = pseudo_random(i, len);
        f.write_all_at(&data, off as u64).unwrap();
        want[off..off + len].copy_from_slice(&data);
        written += len;
        i += 1;
        // read back a random range while dirty data and uploads are in flight
        if i % 16 == 0 {
            let roff = rng.below(size as u64 - 1) as usize;
            let rlen = (1 + rng.below(2 * MIB as u64) as usize).min(size - roff);
            let mut buf = vec![0u8; rlen];
            f.read_exact_at(&mut buf, roff as u64).unwrap();
            assert_same(
                &format!("read-back at {roff}+{rlen}"),
                &buf,
                &want[roff..roff + rlen],
            );
        }
        if i % 97 == 0 {
            f.sync_data().unwrap();
        }
    }
    f.sync_all().unwrap();
    drop(f);
    eprintln!(
        "{} writes, {} MiB in {:?}",
        i,
        written / MIB,
        started.elapsed()
    );
    assert_eq!(fs::metadata(&p).unwrap().len(), size as u64);
    assert_same("read through the mount", &fs::read(&p).unwrap(), &want);
    // a fresh mount (no caches) and the filer HTTP API read the same bytes
    let m2 = mount_ours(&w, &root, &[]);
    assert_same("fresh mount", &fs::read(m2.join("big.bin")).unwrap(), &want);
    let via_http = w.filer_get(&format!("{root}/big.bin")).expect("filer GET");
    assert_same("filer HTTP", &via_http, &want);
}

/// A database log: appends with an fsync every few of them, so its appends are hashed as
/// they are written and each fsync's upload sends that digest. Between some fsyncs the log
/// also rewrites bytes it appended since the last one, leaves a gap and fills it, or cuts
/// its tail: the volume server refuses a Content-MD5 that is not the bytes', so a digest
/// kept past such a write fails the fsync, and the bytes are checked through a fresh mount
/// and the filer's HTTP API.
#[test]
fn a_log_that_fsyncs_often_keeps_every_byte() {
    let w = shared_server();
    let root = unique_path("synclog");
    let m = mount_ours(&w, &root, &[]);
    let p = m.join("wal");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    let mut want: Vec<u8> = Vec::new();
    let mut rng = Rng(0x10_6f5c);
    for round in 0..60u64 {
        let start = want.len();
        for i in 0..1 + rng.below(24) {
            let data = pseudo_random(round * 100 + i, 1 + rng.below(96 * 1024) as usize);
            f.write_all_at(&data, want.len() as u64).unwrap();
            want.extend_from_slice(&data);
        }
        let unsynced = want.len() - start;
        match round % 5 {
            // overwrite inside what this round appended
            1 => {
                let len = 1 + rng.below(unsynced as u64) as usize;
                let at = start + rng.below((unsynced - len + 1) as u64) as usize;
                let data = pseudo_random(9_000 + round, len);
                f.write_all_at(&data, at as u64).unwrap();
                want[at..at + len].copy_from_slice(&data);
            }
            // a gap past the end, then filled
            2 => {
                let end = want.len();
                let tail = pseudo_random(8_000 + round, 5_000);
                f.write_all_at(&tail, (end + 3_000) as u64).unwrap();
                let gap = pseudo_random(7_000 + round, 3_000);
                f.write_all_at(&gap, end as u64).unwrap();
                want.extend_from_slice(&gap);
                want.extend_from_slice(&tail);
            }
            // cut into what this round appended, then append again
            3 => {
                let cut = start + rng.below(unsynced as u64) as usize;
                f.set_len(cut as u64).unwrap();
                want.truncate(cut);
                let data = pseudo_random(6_000 + round, 40_000);
                f.write_all_at(&data, cut as u64).unwrap();
                want.extend_from_slice(&data);
            }
            _ => {}
        }
        f.sync_data().unwrap();
    }
    drop(f);
    assert_same("read through the mount", &fs::read(&p).unwrap(), &want);
    let m2 = mount_ours(&w, &root, &[]);
    assert_same("fresh mount", &fs::read(m2.join("wal")).unwrap(), &want);
    let via_http = w.filer_get(&format!("{root}/wal")).expect("filer GET");
    assert_same("filer HTTP", &via_http, &want);
}

#[test]
fn many_concurrent_writers() {
    let w = shared_server();
    let root = unique_path("conc");
    let m = mount_ours(&w, &root, &[]);
    let n = 16;
    let per = 5 * MIB + 777;
    std::thread::scope(|s| {
        for t in 0..n {
            let p = m.join(format!("w{t}"));
            s.spawn(move || {
                let data = pseudo_random(1000 + t as u64, per);
                let mut f = File::create(&p).unwrap();
                // uneven write sizes so slots fill in different orders
                for piece in data.chunks(100_000 + t * 3_001) {
                    f.write_all(piece).unwrap();
                }
                f.sync_all().unwrap();
            });
        }
    });
    for t in 0..n {
        let want = pseudo_random(1000 + t as u64, per);
        assert_same(
            &format!("w{t} via mount"),
            &fs::read(m.join(format!("w{t}"))).unwrap(),
            &want,
        );
        assert_same(
            &format!("w{t} via filer"),
            &w.filer_get(&format!("{root}/w{t}")).unwrap(),
            &want,
        );
    }
    // concurrent writers to one file, disjoint ranges
    let p = m.join("shared");
    let f = File::create(&p).unwrap();
    let part = 3 * MIB;
    std::thread::scope(|s| {
        for t in 0..8 {
            let f = &f;
            s.spawn(move || {
                let data = pseudo_random(50 + t as u64, part);
                f.write_all_at(&data, (t * part) as u64).unwrap();
            });
        }
    });
    drop(f);
    let mut want = Vec::new();
    for t in 0..8 {
        want.extend(pseudo_random(50 + t as u64, part));
    }
    assert_same("shared file", &fs::read(&p).unwrap(), &want);
    assert_same(
        "shared file via filer",
        &w.filer_get(&format!("{root}/shared")).unwrap(),
        &want,
    );

    // many descriptors of one file, each writing its part and committing (fsync/close)
    // concurrently: every commit must carry every earlier chunk
    let p = m.join("many-fds");
    File::create(&p).unwrap();
    let part = MIB + 1000;
    std::thread::scope(|s| {
        for t in 0..12usize {
            let p = &p;
            s.spawn(move || {
                let data = pseudo_random(300 + t as u64, part);
                for k in 0..4 {
                    let f = OpenOptions::new().write(true).open(p).unwrap();
                    let (a, b) = (k * part / 4, (k + 1) * part / 4);
                    f.write_all_at(&data[a..b], (t * part + a) as u64).unwrap();
                    if (t + k) % 2 == 0 {
                        f.sync_all().unwrap();
                    }
                }
            });
        }
    });
    let want: Vec<u8> = (0..12).flat_map(|t| pseudo_random(300 + t, part)).collect();
    assert_same("many fds", &fs::read(&p).unwrap(), &want);
    assert_same(
        "many fds via filer",
        &w.filer_get(&format!("{root}/many-fds")).unwrap(),
        &want,
    );
}

#[test]
fn unlinked_open_file_stays_usable() {
    let w = shared_server();
    let root = unique_path("unl");
    let m = mount_ours(&w, &root, &[]);
    let p = m.join("doomed");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .unwrap();
    let first = pseudo_random(1, 3 * MIB);
    f.write_all_at(&first, 0).unwrap();
    f.sync_all().unwrap(); // committed: its chunks exist on the volume servers
    fs::remove_file(&p).unwrap();
    assert_eq!(lstat(&p).unwrap_err(), libc::ENOENT);
    assert!(w.filer_get(&format!("{root}/doomed")).is_none());
    let st = fstat(f.as_raw_fd()).unwrap();
    assert_eq!(st.st_nlink, 0);
    // still readable (committed data) and writable through the fd
    let mut buf = vec![0u8; first.len()];
    f.read_exact_at(&mut buf, 0).unwrap();
    assert_same("committed data after unlink", &buf, &first);
    f.write_all_at(b"after unlink", 100).unwrap();
    let mut b = [0u8; 12];
    f.read_exact_at(&mut b, 100).unwrap();
    assert_eq!(&b, b"after unlink");
    f.sync_all().unwrap();
    drop(f);
    // closing it does not bring the name back
    assert_eq!(lstat(&p).unwrap_err(), libc::ENOENT);
    assert!(w.filer_get(&format!("{root}/doomed")).is_none());
    let names: Vec<_> = fs::read_dir(m.path()).unwrap().collect();
    assert!(names.is_empty());

    // a file unlinked before its first flush (deferred create) never reaches the filer
    let q = m.join("never");
    let mut g = File::create(&q).unwrap();
    g.write_all(b"x").unwrap();
    fs::remove_file(&q).unwrap();
    g.write_all(b"y").unwrap();
    drop(g);
    assert!(w.filer_get(&format!("{root}/never")).is_none());
    assert_eq!(lstat(&q).unwrap_err(), libc::ENOENT);
}

#[test]
fn rename_over_an_open_file() {
    let w = shared_server();
    let root = unique_path("rov");
    let m = mount_ours(&w, &root, &[]);
    let old = pseudo_random(7, 2 * MIB + 3);
    let new = pseudo_random(8, MIB + 5);
    fs::write(m.join("target"), &old).unwrap();
    fs::write(m.join("tmp"), &new).unwrap();
    let reader = File::open(m.join("target")).unwrap();
    let old_ino = reader.metadata().unwrap().ino();
    // the classic atomic replace
    fs::rename(m.join("tmp"), m.join("target")).unwrap();
    assert_same("new content", &fs::read(m.join("target")).unwrap(), &new);
    assert_same(
        "new content via filer",
        &w.filer_get(&format!("{root}/target")).unwrap(),
        &new,
    );
    assert_ne!(fs::metadata(m.join("target")).unwrap().ino(), old_ino);
    assert_eq!(lstat(&m.join("tmp")).unwrap_err(), libc::ENOENT);
    // the replaced file is still readable through the open fd
    let mut buf = vec![0u8; old.len()];
    reader.read_exact_at(&mut buf, 0).unwrap();
    assert_same("replaced file via old fd", &buf, &old);
    drop(reader);
    // a writer of a replaced file cannot resurrect it
    fs::write(m.join("a"), b"aaa").unwrap();
    fs::write(m.join("b"), b"bbb").unwrap();
    let wr = OpenOptions::new().write(true).open(m.join("b")).unwrap();
    fs::rename(m.join("a"), m.join("b")).unwrap();
    wr.write_all_at(b"XXXXXX", 0).unwrap();
    drop(wr);
    assert_eq!(fs::read(m.join("b")).unwrap(), b"aaa");
    assert_eq!(w.filer_get(&format!("{root}/b")).unwrap(), b"aaa");
    // renaming a file that is open for writing and not yet flushed
    let mut g = File::create(m.join("pending")).unwrap();
    g.write_all(b"pending data").unwrap();
    fs::rename(m.join("pending"), m.join("renamed")).unwrap();
    g.write_all(b" more").unwrap();
    drop(g);
    assert_eq!(fs::read(m.join("renamed")).unwrap(), b"pending data more");
    assert_eq!(
        w.filer_get(&format!("{root}/renamed")).unwrap(),
        b"pending data more"
    );
    assert!(w.filer_get(&format!("{root}/pending")).is_none());
}

#[test]
fn inode_numbers_are_stable_across_remounts() {
    let w = shared_server();
    let root = unique_path("ino");
    let m = mount_ours(&w, &root, &[]);
    fs::create_dir_all(m.join("d/e")).unwrap();
    fs::write(m.join("d/e/f"), b"f").unwrap();
    fs::write(m.join("g"), b"g").unwrap();
    std::os::unix::fs::symlink("g", m.join("s")).unwrap();
    fs::hard_link(m.join("g"), m.join("d/hl")).unwrap();
    check(unsafe { libc::mkfifo(cpath(&m.join("p")).as_ptr(), 0o600) }).unwrap();
    let names = ["d", "d/e", "d/e/f", "g", "s", "d/hl", "p"];
    let before: HashMap<&str, u64> = names
        .iter()
        .map(|n| (*n, lstat(&m.join(n)).unwrap().st_ino))
        .collect();
    assert_eq!(before["g"], before["d/hl"]);
    let mut all: Vec<u64> = before.values().copied().collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), names.len() - 1, "distinct inodes");
    let st = m.unmount();
    assert!(st.success(), "clean exit on SIGTERM: {st}");
    let m = mount_ours(&w, &root, &[]);
    for n in names {
        assert_eq!(lstat(&m.join(n)).unwrap().st_ino, before[n], "{n}");
    }
    // readdir reports the same numbers as stat
    for e in fs::read_dir(m.join("d")).unwrap() {
        let e = e.unwrap();
        use std::os::unix::fs::DirEntryExt;
        let name = format!("d/{}", e.file_name().to_string_lossy());
        assert_eq!(e.ino(), before[name.as_str()], "{name}");
    }
    // a rename keeps the number
    fs::rename(m.join("d/e/f"), m.join("f2")).unwrap();
    assert_eq!(lstat(&m.join("f2")).unwrap().st_ino, before["d/e/f"]);
}
