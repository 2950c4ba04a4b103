//! Data integrity where single-mount tests never look: two mounts of one filer directory (two
//! "nodes") acting on each other's fresh writes, and hostile sizes and offsets. Real `weed
//! server`, real kernel FUSE mounts.

mod common;
mod fuse_support;

use fuse_support::*;
use seaweedfs_csi_driver::filer::FilerApi;
use seaweedfs_csi_driver::pb::filer as pb;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Duration;

const ROUNDS: usize = 20;
const SIZE: usize = 3 << 20;

/// Node A rewrites a file and closes it; node B, which read the old version and so has its
/// entry (and old chunk list) cached, at once changes only metadata. B's change must not
/// carry its stale chunk list to the filer: the filer deletes every chunk an update leaves
/// out, which would be A's new data.
fn stale_node_metadata_change(tag: &str, change: impl Fn(&Path, usize)) {
    let w = shared_server();
    let root = unique_path(tag);
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    let mut lost = Vec::new();
    for i in 0..ROUNDS {
        let name = format!("f{i}");
        let old = pseudo_random(1000 + i as u64, SIZE);
        let new = pseudo_random(2000 + i as u64, SIZE);
        fs::write(a.join(&name), &old).unwrap();
        // B reads the old version (caches the entry, its chunks and pages)
        assert!(
            eventually_reads(&b.join(&name), Duration::from_secs(15), |d| d == old).is_some(),
            "B never saw the first version of {name}"
        );
        fs::write(a.join(&name), &new).unwrap();
        change(&b.join(&name), i);
        let path = format!("{root}/{}", final_name(&name, tag));
        // settle, then every client must read A's bytes
        std::thread::sleep(Duration::from_millis(300));
        if w.filer_get(&path).as_deref() != Some(&new[..]) {
            lost.push(name.clone());
        }
    }
    assert!(
        lost.is_empty(),
        "{tag}: A's fresh write was destroyed by B's metadata change in {}/{ROUNDS} rounds: {lost:?}",
        lost.len()
    );
    for i in 0..ROUNDS {
        let name = final_name(&format!("f{i}"), tag);
        let want = pseudo_random(2000 + i as u64, SIZE);
        for m in [&a, &b] {
            assert!(
                eventually_reads(&m.join(&name), Duration::from_secs(15), |d| d == want).is_some(),
                "{tag}: {name} does not read A's bytes on {}",
                m.path().display()
            );
        }
    }
}

fn final_name(name: &str, tag: &str) -> String {
    if tag.starts_with("stale-rename") {
        format!("{name}.moved")
    } else {
        name.to_string()
    }
}

#[test]
fn stale_chmod_and_touch_keep_another_nodes_write() {
    stale_node_metadata_change("stale-chmod", |p, i| {
        fs::set_permissions(p, fs::Permissions::from_mode(0o600 + (i as u32 % 2) * 0o40)).unwrap();
        let f = fs::File::open(p).unwrap();
        let t = libc::timespec {
            tv_sec: 1_700_000_000 + i as i64,
            tv_nsec: 0,
        };
        let c = cpath(p);
        let times = [t, t];
        check(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) }).unwrap();
        drop(f);
    });
}

#[test]
fn stale_setxattr_keeps_another_nodes_write() {
    stale_node_metadata_change("stale-xattr", |p, i| {
        setxattr(p, "user.round", format!("{i}").as_bytes(), 0).unwrap();
    });
}

/// chown and a POSIX ACL (an xattr that also sets the mode) from the stale node.
#[test]
fn stale_chown_and_acl_keep_another_nodes_write() {
    stale_node_metadata_change("stale-acl", |p, i| {
        let id = 1000 + i as u32;
        let c = cpath(p);
        check(unsafe { libc::chown(c.as_ptr(), id, id) }).unwrap();
        // user::rw- user:<id>:r-- group::r-- mask::r-- other::---
        let a = acl(&[
            (1, 6, u32::MAX),
            (2, 4, id),
            (4, 4, u32::MAX),
            (0x10, 4, u32::MAX),
            (0x20, 0, u32::MAX),
        ]);
        setxattr(p, "system.posix_acl_access", &a, 0).unwrap();
    });
}

#[test]
fn stale_rename_keeps_another_nodes_write() {
    stale_node_metadata_change("stale-rename", |p, _| {
        let mut to = p.as_os_str().to_owned();
        to.push(".moved");
        fs::rename(p, to).unwrap();
    });
}

/// B holds the file open (read-only) across A's rewrite, then changes its mode through the
/// open file: the open file's entry is stale too.
#[test]
fn stale_open_file_metadata_change_keeps_another_nodes_write() {
    let w = shared_server();
    let root = unique_path("stale-open");
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    for i in 0..5 {
        let name = format!("g{i}");
        let old = pseudo_random(3000 + i, SIZE);
        let new = pseudo_random(4000 + i, SIZE);
        fs::write(a.join(&name), &old).unwrap();
        assert!(eventually_reads(&b.join(&name), Duration::from_secs(15), |d| d == old).is_some());
        let held = fs::File::open(b.join(&name)).unwrap();
        fs::write(a.join(&name), &new).unwrap();
        check(unsafe { libc::fchmod(held.as_raw_fd(), 0o604) }).unwrap();
        setxattr(&b.join(&name), "user.k", b"v", 0).unwrap();
        drop(held);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            w.filer_get(&format!("{root}/{name}")).as_deref(),
            Some(&new[..]),
            "round {i}: A's write lost after B's change through an open file"
        );
    }
}

/// Node A holds a file open with nothing of its own to write; then node B moves another
/// file over its name, or removes it and makes a new one there; and A at once truncates,
/// chmods or sets an xattr through its open file, before the event reaches it. The file at
/// the name now must keep its bytes, mode and xattrs: A's change goes to the file A opened
/// (gone from the name) or fails with ESTALE. A chmod or xattr used to change the file at
/// the name. (An upload over the name is not another file: the filer keeps the entry's
/// inode and creation time, so the change goes to it.)
#[test]
fn a_change_through_an_open_file_never_lands_in_the_file_that_took_its_name() {
    let w = shared_server();
    let root = unique_path("took-name");
    let rt = runtime();
    let filer = filer_client(&rt, &w);
    let a = mount_ours(&w, &root, &[]);
    let b = mount_ours(&w, &root, &[]);
    let mut changed = Vec::new();
    for i in 0..3 * ROUNDS {
        let name = format!("t{i}");
        fs::write(a.join(&name), pseudo_random(6000 + i as u64, 4096)).unwrap();
        let held = OpenOptions::new()
            .read(true)
            .write(true)
            .open(a.join(&name))
            .unwrap();
        let new = pseudo_random(7000 + i as u64, 64 << 10);
        let how = match i % 2 {
            0 => {
                fs::write(b.join(format!("{name}.tmp")), &new).unwrap();
                fs::rename(b.join(format!("{name}.tmp")), b.join(&name)).unwrap();
                "moved over"
            }
            _ => {
                // B may not know the name yet: it is removed once B sees it
                assert!(
                    eventually_reads(&b.join(&name), Duration::from_secs(15), |_| true).is_some()
                );
                fs::remove_file(b.join(&name)).unwrap();
                fs::write(b.join(&name), &new).unwrap();
                "made again"
            }
        };
        let fd = held.as_raw_fd();
        let r = match (i / 2) % 3 {
            0 => check(unsafe { libc::ftruncate(fd, 10) }),
            1 => check(unsafe { libc::fchmod(fd, 0o600) }),
            _ => check(unsafe {
                libc::fsetxattr(fd, c"user.a".as_ptr(), b"v".as_ptr().cast(), 1, 0)
            }),
        };
        drop(held);
        std::thread::sleep(Duration::from_millis(300));
        let e = rt
            .block_on(filer.lookup_entry(&root, &name))
            .expect("the file at the name");
        let bytes = w.filer_get(&format!("{root}/{name}"));
        let mode = e.attributes.as_ref().map_or(0, |a| a.file_mode & 0o777);
        if bytes.as_deref() != Some(&new[..]) || mode == 0o600 || !e.extended.is_empty() {
            changed.push(format!(
                "{name} ({how}, change #{}: {r:?}; {} bytes, mode {mode:o}, xattrs {:?})",
                (i / 2) % 3,
                bytes.map_or(0, |b| b.len()),
                e.extended.keys().collect::<Vec<_>>()
            ));
        }
    }
    assert!(
        changed.is_empty(),
        "A's change through its open file reached the file that took the name: {changed:?}"
    );
}

/// A file whose bytes live inline in its filer entry (as the HTTP API and S3 store small
/// files) truncated to 1 TiB: the inline bytes must not be blown up in memory.
#[test]
fn truncate_inline_file_to_huge_sizes() {
    let w = shared_server();
    let root = unique_path("inline-huge");
    let rt = runtime();
    let filer = filer_client(&rt, &w);
    rt.block_on(filer.create_entry(pb::CreateEntryRequest {
        directory: root.clone(),
        entry: Some(pb::Entry {
            name: "inline".into(),
            content: b"inline bytes".to_vec(),
            attributes: Some(pb::FuseAttributes {
                file_size: 12,
                file_mode: 0o644,
                mtime: 1_700_000_000,
                crtime: 1_700_000_000,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }))
    .expect("create inline entry");
    let m = mount_ours(&w, &root, &[]);
    fs::write(m.join("bystander"), b"unchanged").unwrap();
    let p = m.join("inline");
    assert_eq!(fs::read(&p).unwrap(), b"inline bytes");
    for size in [1u64 << 40, i64::MAX as u64] {
        let c = cpath(&p);
        check(unsafe { libc::truncate(c.as_ptr(), size as i64) })
            .unwrap_or_else(|e| panic!("truncate to {size}: errno {e}"));
        assert_eq!(fs::metadata(&p).unwrap().len(), size);
        let f = fs::File::open(&p).unwrap();
        let mut head = [0u8; 12];
        f.read_exact_at(&mut head, 0).unwrap();
        assert_eq!(&head, b"inline bytes");
        let mut tail = [1u8; 16];
        f.read_exact_at(&mut tail, size - 16).unwrap();
        assert_eq!(tail, [0u8; 16], "the extension reads as zeros");
        // back to the inline bytes
        check(unsafe { libc::truncate(c.as_ptr(), 12) }).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"inline bytes");
    }
    // a negative length is the kernel's EINVAL; the mount is still there
    let c = cpath(&p);
    assert_eq!(
        check(unsafe { libc::truncate(c.as_ptr(), -1) }),
        Err(libc::EINVAL)
    );
    assert!(is_mounted(m.path()));
    assert_eq!(fs::read(m.join("bystander")).unwrap(), b"unchanged");
}

/// Writes, fallocate and xattrs at and past the limits: a clear errno each, the mount stays
/// up, and nothing else changes.
#[test]
fn hostile_offsets_and_sizes() {
    let w = shared_server();
    let root = unique_path("hostile");
    let m = mount_ours(&w, &root, &[]);
    fs::write(m.join("bystander"), b"unchanged").unwrap();
    let p = m.join("f");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    let fd = f.as_raw_fd();
    // a write at 1 TiB makes a sparse file that reads back
    f.write_all_at(b"far away", 1 << 40).unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, 1 << 40).unwrap();
    assert_eq!(&b, b"far away");
    f.read_exact_at(&mut b, (1 << 40) - 8).unwrap();
    assert_eq!(b, [0u8; 8]);
    // at the largest offset the kernel allows, and past it
    let max = i64::MAX;
    let r = unsafe { libc::pwrite(fd, b"x".as_ptr().cast(), 1, max - 1) };
    assert!(r == 1, "a 1-byte write ending at i64::MAX: {}", errno());
    // past it: the kernel refuses (EFBIG or EINVAL depending on the path), nothing reaches us
    let r = unsafe { libc::pwrite(fd, b"xy".as_ptr().cast(), 2, max - 1) };
    let e = errno();
    assert!(
        r == -1 && (e == libc::EFBIG || e == libc::EINVAL),
        "a write past i64::MAX: {r} errno {e}"
    );
    let r = unsafe { libc::pwrite(fd, b"x".as_ptr().cast(), 1, -1) };
    assert_eq!((r, errno()), (-1, libc::EINVAL));
    // fallocate: past the limit, negative, and a large reservation
    let r = check(unsafe { libc::fallocate(fd, 0, max - 10, 100) });
    assert!(
        r == Err(libc::EFBIG) || r == Err(libc::EINVAL),
        "fallocate past i64::MAX: {r:?}"
    );
    assert_eq!(
        check(unsafe { libc::fallocate(fd, 0, -1, 100) }),
        Err(libc::EINVAL)
    );
    assert_eq!(
        check(unsafe { libc::fallocate(fd, 0, 0, -5) }),
        Err(libc::EINVAL)
    );
    check(unsafe { libc::ftruncate(fd, 0) }).unwrap();
    check(unsafe { libc::fallocate(fd, 0, 1 << 40, 4096) }).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), (1 << 40) + 4096);
    check(unsafe { libc::fsync(fd) }).unwrap();
    drop(f);
    // xattrs: a 64 KiB name and a value over 64 KiB are refused, the largest value works
    let long = "user.".to_string() + &"n".repeat(65536);
    assert_eq!(setxattr(&p, &long, b"v", 0), Err(libc::ERANGE));
    assert_eq!(
        setxattr(&p, "user.big", &vec![7u8; 65537], 0),
        Err(libc::E2BIG)
    );
    let full = vec![9u8; 65536];
    setxattr(&p, "user.full", &full, 0).unwrap();
    assert_eq!(getxattr(&p, "user.full").unwrap(), full);
    assert!(is_mounted(m.path()));
    assert_eq!(fs::read(m.join("bystander")).unwrap(), b"unchanged");
    assert_eq!(fs::metadata(&p).unwrap().len(), (1 << 40) + 4096);
}
