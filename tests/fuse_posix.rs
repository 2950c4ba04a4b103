//! Every filesystem operation through the real kernel FUSE: our `mount` command against a real
//! `weed` 4.48, checked through the mount and, where it matters, on the filer itself.

mod common;
mod fuse_support;

use fuse_support::*;
use seaweedfs_csi_driver::filer::FilerApi;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const GO_DIR: u32 = 1 << 31;
const GO_SYMLINK: u32 = 1 << 27;
const GO_PIPE: u32 = 1 << 25;

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn ts(sec: i64, nsec: i64) -> libc::timespec {
    libc::timespec {
        tv_sec: sec,
        tv_nsec: nsec,
    }
}

fn utimens(p: &Path, atime: libc::timespec, mtime: libc::timespec) -> Result<(), i32> {
    let t = [atime, mtime];
    check(unsafe { libc::utimensat(libc::AT_FDCWD, cpath(p).as_ptr(), t.as_ptr(), 0) }).map(|_| ())
}

fn ctime_ns(st: &libc::stat) -> i128 {
    st.st_ctime as i128 * 1_000_000_000 + st.st_ctime_nsec as i128
}

/// The filer's entry for `dir/name` (as another client sees it).
fn filer_entry(
    rt: &tokio::runtime::Runtime,
    f: &impl FilerApi,
    dir: &str,
    name: &str,
) -> Option<seaweedfs_csi_driver::pb::filer::Entry> {
    rt.block_on(f.lookup_entry(dir, name)).ok()
}

#[test]
fn attributes_and_setattr() {
    let w = shared_server();
    let root = unique_path("attr");
    let m = mount_ours(&w, &root, &[]);
    let rt = runtime();
    let fc = filer_client(&rt, &w);
    let p = m.join("f");

    // create + getattr
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o640)
        .open(&p)
        .unwrap();
    f.write_all(b"hello").unwrap();
    drop(f);
    let st = lstat(&p).unwrap();
    assert_eq!(st.st_mode, libc::S_IFREG | 0o640);
    assert_eq!(st.st_size, 5);
    assert_eq!(st.st_nlink, 1);
    assert_eq!((st.st_uid, st.st_gid), (0, 0));
    assert!((st.st_mtime - now_secs()).abs() < 60);
    assert_eq!(lstat(&m.join("missing")).unwrap_err(), libc::ENOENT);
    let e = filer_entry(&rt, &fc, &root, "f").expect("created on the filer");
    let a = e.attributes.clone().unwrap();
    assert_eq!(a.file_mode, 0o640);
    assert_eq!(a.file_size, 5);
    assert_eq!(st.st_ino, a.inode, "st_ino is the filer's inode");

    // chmod: mode and ctime change, filer gets the Go FileMode
    let before = lstat(&p).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    fs::set_permissions(&p, fs::Permissions::from_mode(0o604)).unwrap();
    let st = lstat(&p).unwrap();
    assert_eq!(st.st_mode & 0o7777, 0o604);
    assert!(ctime_ns(&st) > ctime_ns(&before), "chmod updates ctime");
    assert_eq!(st.st_mtime, before.st_mtime, "chmod keeps mtime");
    let a = filer_entry(&rt, &fc, &root, "f")
        .unwrap()
        .attributes
        .unwrap();
    assert_eq!(a.file_mode, 0o604);

    // chown
    std::os::unix::fs::chown(&p, Some(1234), Some(5678)).unwrap();
    let st = lstat(&p).unwrap();
    assert_eq!((st.st_uid, st.st_gid), (1234, 5678));
    let a = filer_entry(&rt, &fc, &root, "f")
        .unwrap()
        .attributes
        .unwrap();
    assert_eq!((a.uid, a.gid), (1234, 5678));

    // utimensat with explicit times (nanoseconds kept)
    utimens(&p, ts(1_000_000_000, 500), ts(1_100_000_000, 250_000_000)).unwrap();
    let st = lstat(&p).unwrap();
    assert_eq!((st.st_atime, st.st_atime_nsec), (1_000_000_000, 500));
    assert_eq!(
        (st.st_mtime, st.st_mtime_nsec),
        (1_100_000_000, 250_000_000)
    );
    let a = filer_entry(&rt, &fc, &root, "f")
        .unwrap()
        .attributes
        .unwrap();
    assert_eq!((a.mtime, a.mtime_ns), (1_100_000_000, 250_000_000));
    assert_eq!((a.atime, a.atime_ns), (1_000_000_000, 500));
    // UTIME_OMIT keeps atime, UTIME_NOW sets mtime to now
    utimens(&p, ts(0, libc::UTIME_OMIT), ts(0, libc::UTIME_NOW)).unwrap();
    let st = lstat(&p).unwrap();
    assert_eq!((st.st_atime, st.st_atime_nsec), (1_000_000_000, 500));
    assert!((st.st_mtime - now_secs()).abs() < 60);

    // truncate down and up; the filer serves the same bytes
    let before = lstat(&p).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(2)
        .unwrap();
    let st = lstat(&p).unwrap();
    assert_eq!(st.st_size, 2);
    assert!(ctime_ns(&st) > ctime_ns(&before), "truncate updates ctime");
    assert!(st.st_mtime >= before.st_mtime);
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(10)
        .unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"he\0\0\0\0\0\0\0\0");
    assert_eq!(
        w.filer_get(&format!("{root}/f")).unwrap(),
        b"he\0\0\0\0\0\0\0\0"
    );
    // truncate(2) by path on a file that is not open
    let c = cpath(&p);
    check(unsafe { libc::truncate(c.as_ptr(), 3) }).unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"he\0");
    // O_TRUNC on open
    fs::write(&p, b"xyz123").unwrap();
    OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    assert_eq!(lstat(&p).unwrap().st_size, 0);
    assert_eq!(w.filer_get(&format!("{root}/f")).unwrap(), b"");
}

#[test]
fn write_by_other_user_clears_setuid() {
    let w = shared_server();
    let m = mount_ours(&w, &unique_path("suid"), &[]);
    let p = m.join("s");
    fs::write(&p, b"x").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o6777)).unwrap();
    assert_eq!(lstat(&p).unwrap().st_mode & 0o7777, 0o6777);
    // write as nobody (default_permissions: the kernel checks and strips the bits)
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("echo more >> '{}'", p.display()))
        .uid(65534)
        .gid(65534)
        .status()
        .unwrap();
    assert!(st.success());
    let st = lstat(&p).unwrap();
    assert_eq!(
        st.st_mode & 0o6000,
        0,
        "suid/sgid cleared by an unprivileged write"
    );
    assert_eq!(fs::read(&p).unwrap(), b"xmore\n");
    // permission checks: nobody cannot write a 0644 root file
    fs::write(m.join("ro"), b"1").unwrap();
    fs::set_permissions(m.join("ro"), fs::Permissions::from_mode(0o644)).unwrap();
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo x >> '{}' 2>/dev/null",
            m.join("ro").display()
        ))
        .uid(65534)
        .gid(65534)
        .status()
        .unwrap();
    assert!(!st.success(), "EACCES for other users");
}

/// The other ways a file loses its set-user/group-ID bits: a truncate, an `O_TRUNC` open and
/// a fallocate by an unprivileged user, a chown by anyone (root included). The kernel leaves
/// this to us (FUSE_HANDLE_KILLPRIV_V2); a directory keeps its set-group-ID bit on chown,
/// and a file that is not group-executable keeps set-group-ID.
#[test]
fn truncate_open_trunc_fallocate_and_chown_clear_setuid() {
    let w = shared_server();
    let m = mount_ours(&w, &unique_path("suid-more"), &[]);
    let p = m.join("s");
    let nobody_runs = |cmd: String| {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .uid(65534)
            .gid(65534)
            .status()
            .unwrap()
            .success()
    };
    let as_nobody = |cmd: String| assert!(nobody_runs(cmd));
    let setuid = |mode: u32| {
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        assert_eq!(lstat(&p).unwrap().st_mode & 0o7777, mode);
    };
    let bits = || lstat(&p).unwrap().st_mode & 0o7777;
    fs::write(&p, b"data").unwrap();
    setuid(0o6777);
    as_nobody(format!("truncate -s 2 '{}'", p.display()));
    assert_eq!(bits(), 0o777, "an unprivileged truncate");
    assert_eq!(fs::read(&p).unwrap(), b"da");
    setuid(0o6777);
    // (an open that truncates and writes nothing: a write would clear them by itself)
    as_nobody(format!(": > '{}'", p.display()));
    assert_eq!(bits(), 0o777, "an unprivileged O_TRUNC open");
    assert_eq!(fs::read(&p).unwrap(), b"");
    setuid(0o6777);
    // a fallocate refused (zeroing a range is not supported) changes nothing
    assert!(!nobody_runs(format!(
        "fallocate --zero-range -o 0 -l 1 '{}'",
        p.display()
    )));
    assert_eq!(bits(), 0o6777, "a refused unprivileged fallocate");
    as_nobody(format!("fallocate -l 8192 '{}'", p.display()));
    assert_eq!(bits(), 0o777, "an unprivileged fallocate");
    setuid(0o6777);
    std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
    assert_eq!(bits(), 0o777, "a chown by root");
    // set-group-ID without group execute is a mandatory-locking mark: kept
    setuid(0o6766);
    std::os::unix::fs::chown(&p, None, Some(65534)).unwrap();
    assert_eq!(
        bits(),
        0o2766,
        "a chown keeps set-group-ID of a file not group-executable"
    );
    let d = m.join("d");
    fs::create_dir(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o2777)).unwrap();
    std::os::unix::fs::chown(&d, Some(65534), None).unwrap();
    assert_eq!(
        lstat(&d).unwrap().st_mode & 0o7777,
        0o2777,
        "a directory keeps its bits"
    );
    // root's own truncate and write keep them (it has CAP_FSETID)
    setuid(0o6777);
    fs::write(&p, b"root").unwrap();
    assert_eq!(bits(), 0o6777, "root's O_TRUNC write");
}

/// An `O_RDONLY|O_TRUNC` open truncates the file, on the filer too, as on a local
/// filesystem; of a file being executed it fails with ETXTBSY and changes nothing, not even
/// the kernel's idea of its size (pages of it mapped before stay readable: the process
/// running it would otherwise die of SIGBUS).
#[test]
fn a_read_only_truncating_open() {
    let w = shared_server();
    let root = unique_path("rotrunc");
    let m = mount_ours(&w, &root, &[]);
    let p = m.join("plain");
    fs::write(&p, b"hello").unwrap();
    drop(
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_TRUNC)
            .open(&p)
            .unwrap(),
    );
    assert_eq!(fs::metadata(&p).unwrap().len(), 0);
    assert_eq!(w.filer_get(&format!("{root}/plain")).unwrap(), b"");

    let sleep = ["/usr/bin/sleep", "/bin/sleep"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("sleep");
    let original = fs::read(sleep).unwrap();
    let exe = m.join("sleeper");
    fs::write(&exe, &original).unwrap();
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
    let mut child = std::process::Command::new(&exe).arg("60").spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let f = File::open(&exe).unwrap();
    let len = original.len();
    // SAFETY: a read-only shared mapping of an open file, unmapped below
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    let last = len - 1;
    // SAFETY: within the mapping
    let byte = unsafe { std::ptr::read_volatile((map as *const u8).add(last)) };
    assert_eq!(byte, original[last]);
    let r = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_TRUNC)
        .open(&exe);
    // the mapping read again in a child: a SIGBUS there must not end this test's process
    // SAFETY: the child only reads memory and exits
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let again = unsafe { std::ptr::read_volatile((map as *const u8).add(last)) };
        unsafe { libc::_exit(if again == byte { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: our own child
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    unsafe { libc::munmap(map, len) };
    assert_eq!(
        r.map(|_| ()).unwrap_err().raw_os_error(),
        Some(libc::ETXTBSY)
    );
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the mapped file was cut short (wait status {status:#x})"
    );
    assert!(alive, "the process running the file died");
    assert_eq!(fs::metadata(&exe).unwrap().len() as usize, len);
    assert_eq!(w.filer_get(&format!("{root}/sleeper")).unwrap(), original);
}

#[test]
fn directories() {
    let w = shared_server();
    let root = unique_path("dirs");
    let m = mount_ours(&w, &root, &[]);
    let rt = runtime();
    let fc = filer_client(&rt, &w);
    let d = m.join("d");
    fs::create_dir(&d).unwrap();
    let st = lstat(&d).unwrap();
    assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFDIR);
    assert_eq!(st.st_nlink, 2);
    let e = filer_entry(&rt, &fc, &root, "d").unwrap();
    assert!(e.is_directory);
    assert_ne!(e.attributes.unwrap().file_mode & GO_DIR, 0);
    assert_eq!(
        fs::create_dir(&d).unwrap_err().raw_os_error(),
        Some(libc::EEXIST)
    );
    // nlink = 2 + subdirectories; parent mtime moves
    let before = lstat(&d).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    fs::create_dir(d.join("a")).unwrap();
    fs::create_dir(d.join("b")).unwrap();
    fs::write(d.join("file"), b"1").unwrap();
    let st = lstat(&d).unwrap();
    assert_eq!(st.st_nlink, 4);
    assert!(ctime_ns(&st) > ctime_ns(&before));
    assert!(
        (st.st_mtime, st.st_mtime_nsec) > (before.st_mtime, before.st_mtime_nsec),
        "mkdir changes the parent's mtime"
    );
    // rmdir
    assert_eq!(
        fs::remove_dir(&d).unwrap_err().raw_os_error(),
        Some(libc::ENOTEMPTY)
    );
    assert_eq!(
        fs::remove_dir(d.join("file")).unwrap_err().raw_os_error(),
        Some(libc::ENOTDIR)
    );
    fs::remove_dir(d.join("a")).unwrap();
    assert_eq!(lstat(&d).unwrap().st_nlink, 3);
    assert!(filer_entry(&rt, &fc, &format!("{root}/d"), "a").is_none());
    // readdir shows . and .. and the entries
    let names: BTreeSet<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, ["b", "file"].iter().map(|s| s.to_string()).collect());
    let c = cpath(&d);
    let dirp = unsafe { libc::opendir(c.as_ptr()) };
    assert!(!dirp.is_null());
    let mut all = BTreeSet::new();
    loop {
        let ent = unsafe { libc::readdir(dirp) };
        if ent.is_null() {
            break;
        }
        let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) };
        all.insert(name.to_string_lossy().to_string());
    }
    unsafe { libc::closedir(dirp) };
    assert!(all.contains(".") && all.contains(".."));
    // long names
    let long = "n".repeat(255);
    fs::write(d.join(&long), b"ok").unwrap();
    assert_eq!(fs::read(d.join(&long)).unwrap(), b"ok");
    let too_long = "n".repeat(256);
    assert_eq!(
        fs::write(d.join(&too_long), b"x")
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENAMETOOLONG)
    );
    // rmdir of a whole tree through the mount
    fs::remove_dir_all(&d).unwrap();
    assert!(filer_entry(&rt, &fc, &root, "d").is_none());
}

/// `cp -a`, rsync and tar set a directory's times after filling it: those times stand, on the
/// mount and on the filer, although the contents changed just before; a later change moves
/// them on again.
#[test]
fn a_directory_keeps_the_times_utimes_gave_it_after_its_contents_changed() {
    let w = shared_server();
    let root = unique_path("dirtimes");
    let m = mount_ours(&w, &root, &[]);
    let rt = runtime();
    let fc = filer_client(&rt, &w);
    let d = m.join("d");
    fs::create_dir(&d).unwrap();
    fs::write(d.join("f"), b"1").unwrap();
    let old = 978_307_200; // 2001-01-01
    utimens(&d, ts(old, 0), ts(old, 5)).unwrap();
    let st = lstat(&d).unwrap();
    assert_eq!((st.st_mtime, st.st_mtime_nsec), (old, 5), "on the mount");
    // fsyncdir writes pending directory times back
    File::open(&d).unwrap().sync_all().unwrap();
    let a = filer_entry(&rt, &fc, &root, "d")
        .unwrap()
        .attributes
        .unwrap();
    assert_eq!((a.mtime, a.mtime_ns), (old, 5), "on the filer");
    assert_eq!(lstat(&d).unwrap().st_mtime, old, "after the write-back");
    // a change after the utimes moves the time on
    fs::write(d.join("g"), b"2").unwrap();
    File::open(&d).unwrap().sync_all().unwrap();
    assert!(lstat(&d).unwrap().st_mtime >= now_secs() - 60);
    let a = filer_entry(&rt, &fc, &root, "d")
        .unwrap()
        .attributes
        .unwrap();
    assert!(
        a.mtime >= now_secs() - 60,
        "a later change reaches the filer"
    );
}

#[test]
fn create_mknod_fifo_unlink() {
    let w = shared_server();
    let root = unique_path("mknod");
    let m = mount_ours(&w, &root, &[]);
    let rt = runtime();
    let fc = filer_client(&rt, &w);

    // O_CREAT|O_EXCL
    let p = m.join("c");
    File::create(&p).unwrap();
    let e = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&p)
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));

    // mknod: regular file and fifo are created on the filer at once
    let r = m.join("reg");
    check(unsafe { libc::mknod(cpath(&r).as_ptr(), libc::S_IFREG | 0o600, 0) }).unwrap();
    let st = lstat(&r).unwrap();
    assert_eq!(st.st_mode, libc::S_IFREG | 0o600);
    assert_eq!(st.st_size, 0);
    assert!(filer_entry(&rt, &fc, &root, "reg").is_some());
    let fifo = m.join("fifo");
    check(unsafe { libc::mkfifo(cpath(&fifo).as_ptr(), 0o644) }).unwrap();
    let st = lstat(&fifo).unwrap();
    assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFIFO);
    let e = filer_entry(&rt, &fc, &root, "fifo").unwrap();
    assert_ne!(e.attributes.unwrap().file_mode & GO_PIPE, 0);
    // the fifo works (served by the kernel)
    let fd = check(unsafe { libc::open(cpath(&fifo).as_ptr(), libc::O_RDWR | libc::O_NONBLOCK) })
        .unwrap();
    let n = unsafe { libc::write(fd, b"pipe".as_ptr().cast(), 4) };
    assert_eq!(n, 4);
    let mut buf = [0u8; 8];
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), 8) };
    assert_eq!(&buf[..n as usize], b"pipe");
    unsafe { libc::close(fd) };
    assert_eq!(
        check(unsafe { libc::mknod(cpath(&r).as_ptr(), libc::S_IFREG | 0o600, 0) }).unwrap_err(),
        libc::EEXIST
    );

    // unlink
    fs::remove_file(&r).unwrap();
    fs::remove_file(&fifo).unwrap();
    assert_eq!(lstat(&r).unwrap_err(), libc::ENOENT);
    assert!(filer_entry(&rt, &fc, &root, "reg").is_none());
    assert!(filer_entry(&rt, &fc, &root, "fifo").is_none());
    assert_eq!(
        fs::remove_file(m.join("nope")).unwrap_err().raw_os_error(),
        Some(libc::ENOENT)
    );
    fs::create_dir(m.join("dd")).unwrap();
    assert_eq!(
        fs::remove_file(m.join("dd")).unwrap_err().raw_os_error(),
        Some(libc::EISDIR)
    );
}

fn renameat2(from: &Path, to: &Path, flags: u32) -> Result<(), i32> {
    check(unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            cpath(from).as_ptr(),
            libc::AT_FDCWD,
            cpath(to).as_ptr(),
            flags,
        )
    })
    .map(|_| ())
}

#[test]
fn renames() {
    let w = shared_server();
    let root = unique_path("ren");
    let m = mount_ours(&w, &root, &[]);
    let get = |p: &str| w.filer_get(&format!("{root}/{p}"));

    // file rename keeps the inode and content
    fs::write(m.join("a"), b"AAA").unwrap();
    let ino = lstat(&m.join("a")).unwrap().st_ino;
    fs::rename(m.join("a"), m.join("b")).unwrap();
    assert_eq!(lstat(&m.join("a")).unwrap_err(), libc::ENOENT);
    assert_eq!(lstat(&m.join("b")).unwrap().st_ino, ino);
    assert_eq!(fs::read(m.join("b")).unwrap(), b"AAA");
    assert_eq!(get("b").unwrap(), b"AAA");
    assert!(get("a").is_none());

    // rename over an existing file replaces it
    fs::write(m.join("c"), b"CCCCCC").unwrap();
    fs::rename(m.join("b"), m.join("c")).unwrap();
    assert_eq!(fs::read(m.join("c")).unwrap(), b"AAA");
    assert_eq!(lstat(&m.join("c")).unwrap().st_ino, ino);
    assert_eq!(get("c").unwrap(), b"AAA");

    // directory with contents
    fs::create_dir_all(m.join("d1/sub")).unwrap();
    fs::write(m.join("d1/sub/f"), b"deep").unwrap();
    fs::create_dir(m.join("d2")).unwrap();
    fs::rename(m.join("d1"), m.join("d2/moved")).unwrap();
    assert_eq!(fs::read(m.join("d2/moved/sub/f")).unwrap(), b"deep");
    assert_eq!(get("d2/moved/sub/f").unwrap(), b"deep");
    assert_eq!(lstat(&m.join("d1")).unwrap_err(), libc::ENOENT);
    assert_eq!(lstat(&m.join("d2")).unwrap().st_nlink, 3);
    // into itself
    assert_eq!(
        fs::rename(m.join("d2"), m.join("d2/moved/x"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EINVAL)
    );
    // over an empty directory: allowed; over a non-empty one: refused
    fs::create_dir(m.join("empty")).unwrap();
    fs::create_dir(m.join("full")).unwrap();
    fs::write(m.join("full/x"), b"x").unwrap();
    fs::create_dir(m.join("src")).unwrap();
    let e = fs::rename(m.join("src"), m.join("full")).unwrap_err();
    assert!(
        matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)),
        "{e}"
    );
    fs::rename(m.join("src"), m.join("empty")).unwrap();
    assert_eq!(lstat(&m.join("src")).unwrap_err(), libc::ENOENT);
    // dir over file and file over dir
    assert_eq!(
        fs::rename(m.join("empty"), m.join("c"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENOTDIR)
    );
    assert_eq!(
        fs::rename(m.join("c"), m.join("full"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EISDIR)
    );

    // RENAME_NOREPLACE
    fs::write(m.join("n1"), b"one").unwrap();
    fs::write(m.join("n2"), b"two").unwrap();
    assert_eq!(
        renameat2(&m.join("n1"), &m.join("n2"), libc::RENAME_NOREPLACE).unwrap_err(),
        libc::EEXIST
    );
    assert_eq!(fs::read(m.join("n2")).unwrap(), b"two");
    renameat2(&m.join("n1"), &m.join("n3"), libc::RENAME_NOREPLACE).unwrap();
    assert_eq!(fs::read(m.join("n3")).unwrap(), b"one");

    // RENAME_EXCHANGE: files, then a file and a directory
    let i2 = lstat(&m.join("n2")).unwrap().st_ino;
    let i3 = lstat(&m.join("n3")).unwrap().st_ino;
    renameat2(&m.join("n2"), &m.join("n3"), libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs::read(m.join("n2")).unwrap(), b"one");
    assert_eq!(fs::read(m.join("n3")).unwrap(), b"two");
    assert_eq!(lstat(&m.join("n2")).unwrap().st_ino, i3);
    assert_eq!(lstat(&m.join("n3")).unwrap().st_ino, i2);
    assert_eq!(get("n2").unwrap(), b"one");
    assert_eq!(get("n3").unwrap(), b"two");
    renameat2(&m.join("n2"), &m.join("full"), libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs::read(m.join("n2/x")).unwrap(), b"x");
    assert_eq!(fs::read(m.join("full")).unwrap(), b"one");
    assert_eq!(get("n2/x").unwrap(), b"x");
    assert_eq!(
        renameat2(&m.join("n2"), &m.join("absent"), libc::RENAME_EXCHANGE).unwrap_err(),
        libc::ENOENT
    );
    // no temporary names left behind
    let names: Vec<String> = fs::read_dir(m.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with(".swx")), "{names:?}");
}

#[test]
fn symlinks_and_hard_links() {
    let w = shared_server();
    let root = unique_path("links");
    let m = mount_ours(&w, &root, &[]);
    let rt = runtime();
    let fc = filer_client(&rt, &w);

    fs::write(m.join("target"), b"data").unwrap();
    std::os::unix::fs::symlink("target", m.join("sl")).unwrap();
    assert_eq!(
        fs::read_link(m.join("sl")).unwrap().to_str().unwrap(),
        "target"
    );
    let st = lstat(&m.join("sl")).unwrap();
    assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(st.st_size, 6);
    assert_eq!(fs::read(m.join("sl")).unwrap(), b"data");
    let a = filer_entry(&rt, &fc, &root, "sl")
        .unwrap()
        .attributes
        .unwrap();
    assert_eq!(a.symlink_target, "target");
    assert_ne!(a.file_mode & GO_SYMLINK, 0);
    assert_eq!(
        fs::read_link(m.join("target")).unwrap_err().raw_os_error(),
        Some(libc::EINVAL)
    );
    // a dangling symlink to a long target
    let long_target = "x/".repeat(1000);
    std::os::unix::fs::symlink(&long_target, m.join("long")).unwrap();
    assert_eq!(
        fs::read_link(m.join("long")).unwrap().to_str().unwrap(),
        long_target
    );

    // hard links share inode, data and attributes
    fs::hard_link(m.join("target"), m.join("h1")).unwrap();
    fs::create_dir(m.join("sub")).unwrap();
    fs::hard_link(m.join("h1"), m.join("sub/h2")).unwrap();
    let st0 = lstat(&m.join("target")).unwrap();
    let st1 = lstat(&m.join("h1")).unwrap();
    let st2 = lstat(&m.join("sub/h2")).unwrap();
    assert_eq!(st0.st_ino, st1.st_ino);
    assert_eq!(st0.st_ino, st2.st_ino);
    assert_eq!(st0.st_nlink, 3);
    let e = filer_entry(&rt, &fc, &root, "h1").unwrap();
    assert!(!e.hard_link_id.is_empty());
    assert_eq!(e.hard_link_counter, 3);
    // a write through one name shows through the others (also in listings)
    fs::write(m.join("sub/h2"), b"changed through h2").unwrap();
    assert_eq!(fs::read(m.join("target")).unwrap(), b"changed through h2");
    fs::set_permissions(m.join("h1"), fs::Permissions::from_mode(0o600)).unwrap();
    for e in fs::read_dir(m.path()).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().to_string();
        if name == "target" || name == "h1" {
            let md = fs::symlink_metadata(e.path()).unwrap();
            assert_eq!(md.len(), 18, "{name}");
            assert_eq!(md.mode() & 0o777, 0o600, "{name}");
            assert_eq!(md.nlink(), 3, "{name}");
        }
    }
    assert_eq!(
        w.filer_get(&format!("{root}/target")).unwrap(),
        b"changed through h2"
    );
    // removing names lowers the count; the data lives while one name is left
    fs::remove_file(m.join("target")).unwrap();
    assert_eq!(lstat(&m.join("h1")).unwrap().st_nlink, 2);
    assert_eq!(lstat(&m.join("sub/h2")).unwrap().st_nlink, 2);
    fs::remove_file(m.join("sub/h2")).unwrap();
    let st = lstat(&m.join("h1")).unwrap();
    assert_eq!(st.st_nlink, 1);
    assert_eq!(fs::read(m.join("h1")).unwrap(), b"changed through h2");
    // links to directories are refused
    assert_eq!(
        fs::hard_link(m.join("sub"), m.join("sub2"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EPERM)
    );
    // a remount (fresh caches) sees the same
    drop(m);
    let m = mount_ours(&w, &root, &[]);
    assert_eq!(fs::read(m.join("h1")).unwrap(), b"changed through h2");
    assert_eq!(lstat(&m.join("h1")).unwrap().st_nlink, 1);
    assert_eq!(
        fs::read(m.join("sl")).unwrap_err().raw_os_error(),
        Some(libc::ENOENT)
    );
}

#[test]
fn open_read_write_flush_fsync() {
    let w = shared_server();
    let root = unique_path("io");
    let m = mount_ours(&w, &root, &[]);
    let p = m.join("f");
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    f.write_all(b"0123456789").unwrap();
    // fsync commits to the filer while the file stays open
    f.sync_all().unwrap();
    assert_eq!(w.filer_get(&format!("{root}/f")).unwrap(), b"0123456789");
    f.write_all_at(b"AB", 4).unwrap();
    let mut buf = [0u8; 10];
    f.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"0123AB6789");
    f.sync_data().unwrap();
    assert_eq!(w.filer_get(&format!("{root}/f")).unwrap(), b"0123AB6789");
    // read at and after EOF
    let mut b = [0u8; 4];
    assert_eq!(f.read_at(&mut b, 10).unwrap(), 0);
    assert_eq!(f.read_at(&mut b, 8).unwrap(), 2);
    // sparse write beyond EOF
    f.write_all_at(b"Z", 20).unwrap();
    drop(f); // flush + release
    let mut want = b"0123AB6789".to_vec();
    want.resize(20, 0);
    want.push(b'Z');
    assert_eq!(fs::read(&p).unwrap(), want);
    assert_eq!(w.filer_get(&format!("{root}/f")).unwrap(), want);

    // O_APPEND from two handles
    let mut a1 = OpenOptions::new().append(true).open(&p).unwrap();
    let mut a2 = OpenOptions::new().append(true).open(&p).unwrap();
    a1.write_all(b"-one").unwrap();
    a2.write_all(b"-two").unwrap();
    drop(a1);
    drop(a2);
    let mut want2 = want.clone();
    want2.extend_from_slice(b"-one-two");
    assert_eq!(fs::read(&p).unwrap(), want2);
    assert_eq!(w.filer_get(&format!("{root}/f")).unwrap(), want2);

    // a created but empty file exists after close
    File::create(m.join("empty")).unwrap();
    assert_eq!(w.filer_get(&format!("{root}/empty")).unwrap(), b"");
    // seek + read through std
    let mut f = File::open(&p).unwrap();
    f.seek(SeekFrom::Start(4)).unwrap();
    let mut s = String::new();
    f.take(2).read_to_string(&mut s).unwrap();
    assert_eq!(s, "AB");
}

#[test]
fn readdir_ten_thousand_entries() {
    let w = shared_server();
    let root = unique_path("big");
    let m = mount_ours(&w, &root, &[]);
    let d = m.join("many");
    fs::create_dir(&d).unwrap();
    let n = 10_000;
    for i in 0..n {
        // half created with open(O_CREAT) (deferred create), half with mknod (immediate)
        let p = d.join(format!("file-{i:05}"));
        if i % 2 == 0 {
            File::create(&p).unwrap();
        } else {
            check(unsafe { libc::mknod(cpath(&p).as_ptr(), libc::S_IFREG | 0o644, 0) }).unwrap();
        }
    }
    let want: BTreeSet<String> = (0..n).map(|i| format!("file-{i:05}")).collect();
    let listed = |dir: &Path| -> BTreeSet<String> {
        let v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert_eq!(v.len(), n, "no duplicates");
        v.into_iter().collect()
    };
    assert_eq!(listed(&d), want);
    // the filer has them all, and a fresh mount lists them all
    let rt = runtime();
    let fc = filer_client(&rt, &w);
    let on_filer = rt.block_on(fc.list_all(&format!("{root}/many"))).unwrap();
    assert_eq!(on_filer.len(), n);
    drop(m);
    let m = mount_ours(&w, &root, &[]);
    let d = m.join("many");
    assert_eq!(listed(&d), want);
    // stat of every entry after readdirplus
    for (i, e) in fs::read_dir(&d).unwrap().enumerate() {
        if i % 1000 == 0 {
            let md = e.unwrap().metadata().unwrap();
            assert!(md.is_file());
        }
    }
}

#[test]
fn statfs_reports_the_cluster() {
    let w = shared_server();
    let m = mount_ours(&w, &unique_path("statfs"), &[]);
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    check(unsafe { libc::statvfs(cpath(m.path()).as_ptr(), &mut s) }).unwrap();
    assert!(s.f_bsize > 0);
    assert!(s.f_blocks > 0, "total size from the master");
    assert!(s.f_bfree <= s.f_blocks);
    assert!(s.f_files > 0);
    assert_eq!(s.f_namemax, 255);
    // with a quota the size is the quota
    let m2 = mount_ours(&w, &unique_path("statfs2"), &["--collectionQuotaMB=64"]);
    check(unsafe { libc::statvfs(cpath(m2.path()).as_ptr(), &mut s) }).unwrap();
    assert_eq!(s.f_blocks * s.f_frsize, 64 << 20);
}

fn listxattr(p: &Path) -> Vec<String> {
    let c = cpath(p);
    let len = unsafe { libc::listxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
    assert!(len >= 0, "listxattr: {}", errno());
    let mut buf = vec![0u8; len as usize];
    let got = unsafe { libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(got >= 0);
    buf.truncate(got as usize);
    let mut v: Vec<String> = buf
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn xattrs_are_stored_like_weed_mount() {
    let w = shared_server();
    let root = unique_path("xattr");
    let m = mount_ours(&w, &root, &[]);
    let rt = runtime();
    let fc = filer_client(&rt, &w);
    let p = m.join("f");
    fs::write(&p, b"x").unwrap();
    assert!(listxattr(&p).is_empty());
    setxattr(&p, "user.k1", b"v1", 0).unwrap();
    setxattr(&p, "user.bin", &[0, 1, 2, 255], 0).unwrap();
    assert_eq!(getxattr(&p, "user.k1").unwrap(), b"v1");
    assert_eq!(getxattr(&p, "user.bin").unwrap(), [0, 1, 2, 255]);
    assert_eq!(listxattr(&p), ["user.bin", "user.k1"]);
    assert_eq!(getxattr(&p, "user.none").unwrap_err(), libc::ENODATA);
    assert_eq!(
        setxattr(&p, "user.k1", b"x", libc::XATTR_CREATE).unwrap_err(),
        libc::EEXIST
    );
    assert_eq!(
        setxattr(&p, "user.none", b"x", libc::XATTR_REPLACE).unwrap_err(),
        libc::ENODATA
    );
    setxattr(&p, "user.k1", b"v1b", libc::XATTR_REPLACE).unwrap();
    // a too small buffer is ERANGE
    let n = std::ffi::CString::new("user.k1").unwrap();
    let mut small = [0u8; 1];
    let r = unsafe { libc::getxattr(cpath(&p).as_ptr(), n.as_ptr(), small.as_mut_ptr().cast(), 1) };
    assert_eq!((r, errno()), (-1, libc::ERANGE));
    // stored as extended["xattr-<name>"]
    let e = filer_entry(&rt, &fc, &root, "f").unwrap();
    assert_eq!(e.extended.get("xattr-user.k1").unwrap(), b"v1b");
    assert_eq!(e.extended.get("xattr-user.bin").unwrap(), &[0, 1, 2, 255]);
    // remove
    let rm = |name: &str| {
        let n = std::ffi::CString::new(name).unwrap();
        check(unsafe { libc::removexattr(cpath(&p).as_ptr(), n.as_ptr()) })
    };
    rm("user.bin").unwrap();
    assert_eq!(rm("user.bin").unwrap_err(), libc::ENODATA);
    assert_eq!(listxattr(&p), ["user.k1"]);
    let e = filer_entry(&rt, &fc, &root, "f").unwrap();
    assert!(!e.extended.contains_key("xattr-user.bin"));
    // writing the file keeps its xattrs; xattrs on directories
    fs::write(&p, b"new content").unwrap();
    assert_eq!(getxattr(&p, "user.k1").unwrap(), b"v1b");
    fs::create_dir(m.join("d")).unwrap();
    setxattr(&m.join("d"), "user.dir", b"yes", 0).unwrap();
    // large values
    let big = pseudo_random(3, 60_000);
    setxattr(&p, "user.big", &big, 0).unwrap();
    assert_eq!(getxattr(&p, "user.big").unwrap(), big);
    // survive a remount
    drop(m);
    let m = mount_ours(&w, &root, &[]);
    assert_eq!(getxattr(&m.join("f"), "user.k1").unwrap(), b"v1b");
    assert_eq!(getxattr(&m.join("d"), "user.dir").unwrap(), b"yes");
    assert_eq!(fs::read(m.join("f")).unwrap(), b"new content");
}

#[test]
fn lseek_data_hole_and_fallocate() {
    let w = shared_server();
    let root = unique_path("seek");
    let m = mount_ours(&w, &root, &[]);
    let p = m.join("f");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .unwrap();
    f.write_all_at(b"abc", 0).unwrap();
    f.sync_all().unwrap();
    let fd = f.as_raw_fd();
    let seek = |off: i64, wh: i32| {
        let r = unsafe { libc::lseek(fd, off, wh) };
        if r < 0 {
            Err(errno())
        } else {
            Ok(r)
        }
    };
    assert_eq!(seek(0, libc::SEEK_DATA), Ok(0));
    assert_eq!(seek(1, libc::SEEK_DATA), Ok(1));
    assert_eq!(seek(0, libc::SEEK_HOLE), Ok(3));
    assert_eq!(seek(3, libc::SEEK_DATA), Err(libc::ENXIO));
    assert_eq!(seek(5, libc::SEEK_HOLE), Err(libc::ENXIO));
    assert_eq!(seek(-1, libc::SEEK_DATA), Err(libc::ENXIO));
    assert_eq!(seek(-1, libc::SEEK_HOLE), Err(libc::ENXIO));
    // a sparse file: data at 0 and at 5 MiB (dirty, then committed), a hole between; in
    // whole 4 KiB blocks, as block filesystems answer (the rest of the first block is data)
    let far = 5u64 << 20;
    f.write_all_at(b"far", far).unwrap();
    for _ in 0..2 {
        assert_eq!(seek(0, libc::SEEK_HOLE), Ok(4096));
        assert_eq!(seek(3, libc::SEEK_HOLE), Ok(4096));
        assert_eq!(seek(3, libc::SEEK_DATA), Ok(3));
        assert_eq!(seek(4096, libc::SEEK_HOLE), Ok(4096));
        assert_eq!(seek(4096, libc::SEEK_DATA), Ok(far as i64));
        assert_eq!(seek(far as i64 + 1, libc::SEEK_DATA), Ok(far as i64 + 1));
        assert_eq!(seek(far as i64, libc::SEEK_HOLE), Ok(far as i64 + 3));
        f.sync_all().unwrap();
    }
    f.set_len(3).unwrap();
    // fallocate mode 0 extends with zeros and changes ctime
    let before = fstat(fd).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    check(unsafe { libc::fallocate(fd, 0, 0, 1 << 20) }).unwrap();
    let st = fstat(fd).unwrap();
    assert_eq!(st.st_size, 1 << 20);
    assert!(ctime_ns(&st) > ctime_ns(&before));
    let mut buf = vec![9u8; 16];
    f.read_exact_at(&mut buf, (1 << 20) - 16).unwrap();
    assert_eq!(buf, vec![0u8; 16]);
    assert_eq!(lstat(&p).unwrap().st_size, 1 << 20);
    // within the size: no change in size
    check(unsafe { libc::fallocate(fd, 0, 100, 100) }).unwrap();
    assert_eq!(fstat(fd).unwrap().st_size, 1 << 20);
    // KEEP_SIZE accepted, size unchanged
    check(unsafe { libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, 0, 4 << 20) }).unwrap();
    assert_eq!(fstat(fd).unwrap().st_size, 1 << 20);
    // hole punching is not supported
    assert_eq!(
        check(unsafe {
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                10,
            )
        })
        .unwrap_err(),
        libc::EOPNOTSUPP
    );
    // posix_fallocate
    assert_eq!(unsafe { libc::posix_fallocate(fd, 0, 2 << 20) }, 0);
    assert_eq!(fstat(fd).unwrap().st_size, 2 << 20);
    drop(f);
    let on_filer = w.filer_get(&format!("{root}/f")).unwrap();
    assert_eq!(on_filer.len(), 2 << 20);
    assert_eq!(&on_filer[..3], b"abc");
    assert!(on_filer[3..].iter().all(|b| *b == 0));
}

#[test]
fn locks_conflict_between_open_files() {
    let w = shared_server();
    let m = mount_ours(&w, &unique_path("locks"), &[]);
    let p = m.join("lockfile");
    fs::write(&p, b"0123456789").unwrap();
    let f1 = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let f2 = OpenOptions::new().read(true).write(true).open(&p).unwrap();

    // flock(2)
    check(unsafe { libc::flock(f1.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }).unwrap();
    assert_eq!(
        check(unsafe { libc::flock(f2.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }).unwrap_err(),
        libc::EWOULDBLOCK
    );
    // ...also from another process
    let st = std::process::Command::new("flock")
        .args(["-n", "-x"])
        .arg(&p)
        .arg("true")
        .status()
        .unwrap();
    assert!(!st.success(), "flock(1) must fail while we hold the lock");
    check(unsafe { libc::flock(f1.as_raw_fd(), libc::LOCK_UN) }).unwrap();
    check(unsafe { libc::flock(f2.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) }).unwrap();
    check(unsafe { libc::flock(f1.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) }).unwrap();
    check(unsafe { libc::flock(f1.as_raw_fd(), libc::LOCK_UN) }).unwrap();
    check(unsafe { libc::flock(f2.as_raw_fd(), libc::LOCK_UN) }).unwrap();

    // POSIX byte-range locks (open file description locks conflict between fds)
    let lk = |ty: i32, start: i64, len: i64| libc::flock {
        l_type: ty as i16,
        l_whence: libc::SEEK_SET as i16,
        l_start: start,
        l_len: len,
        l_pid: 0,
    };
    let mut l = lk(libc::F_WRLCK, 0, 5);
    check(unsafe { libc::fcntl(f1.as_raw_fd(), libc::F_OFD_SETLK, &mut l) }).unwrap();
    let mut l = lk(libc::F_WRLCK, 2, 2);
    assert_eq!(
        check(unsafe { libc::fcntl(f2.as_raw_fd(), libc::F_OFD_SETLK, &mut l) }).unwrap_err(),
        libc::EAGAIN
    );
    // the conflict is reported by F_OFD_GETLK
    let mut l = lk(libc::F_WRLCK, 0, 10);
    check(unsafe { libc::fcntl(f2.as_raw_fd(), libc::F_OFD_GETLK, &mut l) }).unwrap();
    assert_eq!(l.l_type, libc::F_WRLCK as i16);
    assert_eq!((l.l_start, l.l_len), (0, 5));
    // a non-overlapping range is free
    let mut l = lk(libc::F_WRLCK, 5, 5);
    check(unsafe { libc::fcntl(f2.as_raw_fd(), libc::F_OFD_SETLK, &mut l) }).unwrap();
    let mut l = lk(libc::F_UNLCK, 0, 5);
    check(unsafe { libc::fcntl(f1.as_raw_fd(), libc::F_OFD_SETLK, &mut l) }).unwrap();
    let mut l = lk(libc::F_WRLCK, 0, 5);
    check(unsafe { libc::fcntl(f2.as_raw_fd(), libc::F_OFD_SETLK, &mut l) }).unwrap();

    // classic process-owned fcntl locks: a child process sees our lock
    let mut l = lk(libc::F_UNLCK, 0, 0);
    check(unsafe { libc::fcntl(f2.as_raw_fd(), libc::F_OFD_SETLK, &mut l) }).unwrap();
    let mut l = lk(libc::F_WRLCK, 0, 0);
    check(unsafe { libc::fcntl(f1.as_raw_fd(), libc::F_SETLK, &mut l) }).unwrap();
    let script = format!(
        "import fcntl,sys\nf=open('{}','r+')\ntry:\n fcntl.lockf(f,fcntl.LOCK_EX|fcntl.LOCK_NB)\n sys.exit(0)\nexcept OSError:\n sys.exit(3)\n",
        p.display()
    );
    let st = std::process::Command::new("python3")
        .arg("-c")
        .arg(&script)
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(3), "lockf in another process must conflict");
}

#[test]
fn lock_file_pattern_and_git_work() {
    let w = shared_server();
    let root = unique_path("git");
    let m = mount_ours(&w, &root, &[]);
    // create x.lock exclusively, rename it over x, again and again within one second: every
    // new file gets its own inode number, and no stale name survives
    let mut inos = BTreeSet::new();
    for i in 0..5 {
        let lock = m.join("config.lock");
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&lock)
            .unwrap_or_else(|e| panic!("round {i}: {e}"));
        f.write_all(format!("v{i}").as_bytes()).unwrap();
        drop(f);
        inos.insert(lstat(&lock).unwrap().st_ino);
        fs::rename(&lock, m.join("config")).unwrap();
        assert_eq!(lstat(&lock).unwrap_err(), libc::ENOENT, "round {i}");
        assert_eq!(
            fs::read(m.join("config")).unwrap(),
            format!("v{i}").as_bytes()
        );
    }
    assert_eq!(inos.len(), 5, "distinct inode numbers");
    assert_eq!(w.filer_get(&format!("{root}/config")).unwrap(), b"v4");
    assert!(w.filer_get(&format!("{root}/config.lock")).is_none());

    // a real git repository: init, commit, gc, fsck, clone
    let git = |dir: &Path, args: &[&str]| {
        let out = std::process::Command::new("git")
            .current_dir(dir)
            .args(["-c", "user.email=t@example.com", "-c", "user.name=t"])
            .args(args)
            .output()
            .expect("git");
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let repo = m.join("repo");
    fs::create_dir(&repo).unwrap();
    git(&repo, &["init", "-q"]);
    for i in 0..50 {
        fs::create_dir_all(repo.join(format!("d{}", i % 7))).unwrap();
        fs::write(
            repo.join(format!("d{}/f{i}.txt", i % 7)),
            pseudo_random(i, 1000 + i as usize * 300),
        )
        .unwrap();
    }
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-qm", "one"]);
    fs::write(repo.join("d0/f0.txt"), b"changed").unwrap();
    git(&repo, &["commit", "-qam", "two"]);
    git(&repo, &["gc", "-q"]);
    git(&repo, &["fsck", "--strict"]);
    assert_eq!(git(&repo, &["status", "--porcelain"]), "");
    git(m.path(), &["clone", "-q", "repo", "clone"]);
    assert_eq!(fs::read(m.join("clone/d0/f0.txt")).unwrap(), b"changed");
    assert_eq!(
        fs::read(m.join("clone/d3/f10.txt")).unwrap(),
        pseudo_random(10, 4000)
    );
}

#[test]
fn setgid_directories_pass_on_their_group() {
    let w = shared_server();
    let m = mount_ours(&w, &unique_path("sgid"), &[]);
    let d = m.join("shared");
    fs::create_dir(&d).unwrap();
    std::os::unix::fs::chown(&d, None, Some(1234)).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o2777)).unwrap();
    fs::write(d.join("file"), b"x").unwrap();
    fs::create_dir(d.join("sub")).unwrap();
    fs::create_dir(d.join("sub/deeper")).unwrap();
    std::os::unix::fs::symlink("file", d.join("link")).unwrap();
    check(unsafe { libc::mkfifo(cpath(&d.join("fifo")).as_ptr(), 0o644) }).unwrap();
    for n in ["file", "sub", "sub/deeper", "link", "fifo"] {
        assert_eq!(lstat(&d.join(n)).unwrap().st_gid, 1234, "{n}");
    }
    assert_ne!(lstat(&d.join("sub")).unwrap().st_mode & libc::S_ISGID, 0);
    assert_ne!(
        lstat(&d.join("sub/deeper")).unwrap().st_mode & libc::S_ISGID,
        0
    );
    assert_eq!(lstat(&d.join("file")).unwrap().st_mode & libc::S_ISGID, 0);
    // a non-member asking for a setgid file gets the group but not the bit
    let script = format!(
        "import os\nos.umask(0)\nos.close(os.open('{}', os.O_CREAT|os.O_WRONLY, 0o2777))\n",
        d.join("by_nobody").display()
    );
    let st = std::process::Command::new("python3")
        .arg("-c")
        .arg(&script)
        .uid(65534)
        .gid(65534)
        .status()
        .unwrap();
    assert!(st.success());
    let st = lstat(&d.join("by_nobody")).unwrap();
    assert_eq!((st.st_uid, st.st_gid), (65534, 1234));
    assert_eq!(st.st_mode & 0o7777, 0o777);
    // outside a setgid directory the creator's group is used
    fs::create_dir(m.join("plain")).unwrap();
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("mkdir '{}'", m.join("plain/n").display()))
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(lstat(&m.join("plain/n")).unwrap().st_gid, 0);
}

#[test]
fn shared_mmap_and_direct_io() {
    let w = shared_server();
    let root = unique_path("mmap");
    let m = mount_ours(&w, &root, &[]);
    // a shared writable mapping reaches the filer after msync + close
    let p = m.join("mapped");
    fs::write(&p, vec![0u8; 3 * 4096]).unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let len = 3 * 4096;
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED, "mmap: {}", errno());
    let map = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
    map[100..110].copy_from_slice(b"0123456789");
    map[8190..8195].copy_from_slice(b"edges");
    check(unsafe { libc::msync(addr, len, libc::MS_SYNC) }).unwrap();
    unsafe { libc::munmap(addr, len) };
    drop(f);
    let mut want = vec![0u8; len];
    want[100..110].copy_from_slice(b"0123456789");
    want[8190..8195].copy_from_slice(b"edges");
    assert_eq!(fs::read(&p).unwrap(), want);
    assert_eq!(w.filer_get(&format!("{root}/mapped")).unwrap(), want);

    // O_DIRECT writes and reads with aligned buffers
    let q = m.join("direct");
    let data = pseudo_random(77, 3 << 20);
    let layout = std::alloc::Layout::from_size_align(data.len(), 4096).unwrap();
    let buf = unsafe { std::alloc::alloc(layout) };
    let aligned = unsafe { std::slice::from_raw_parts_mut(buf, data.len()) };
    aligned.copy_from_slice(&data);
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&q)
        .unwrap();
    f.write_all_at(aligned, 0).unwrap();
    drop(f);
    aligned.fill(0);
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&q)
        .unwrap();
    f.read_exact_at(aligned, 0).unwrap();
    assert!(aligned == &data[..], "O_DIRECT read back");
    unsafe { std::alloc::dealloc(buf, layout) };
    assert!(w.filer_get(&format!("{root}/direct")).unwrap() == data);
}

#[test]
fn terminal_ioctls_and_copy_file_range_answer_quietly() {
    let w = shared_server();
    let m = mount_ours(&w, &unique_path("ioctl"), &[]);
    let p = m.join("f");
    std::fs::write(&p, b"0123456789").unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    // isatty(), as Python's open() does: not a terminal
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    let r = check(unsafe { libc::ioctl(f.as_raw_fd(), libc::TCGETS, &mut t) });
    assert_eq!(r, Err(libc::ENOTTY));
    // copy_file_range falls back to a plain copy in the kernel
    let out = std::fs::File::create(m.join("g")).unwrap();
    let (mut off_in, mut off_out) = (0i64, 0i64);
    let n = check(unsafe {
        libc::copy_file_range(
            f.as_raw_fd(),
            &mut off_in,
            out.as_raw_fd(),
            &mut off_out,
            10,
            0,
        ) as libc::c_int
    });
    // EXDEV/ENOSYS-style refusals are fine for a caller (cp falls back); a copy must be exact
    if let Ok(n) = n {
        assert_eq!(n, 10);
        drop(out);
        assert_eq!(std::fs::read(m.join("g")).unwrap(), b"0123456789");
    }
    let log = m.log_text();
    assert!(!log.contains("Not Implemented"), "{log}");
    assert!(!log.contains("WARN"), "no WARN in normal use: {log}");
}
