//! Mount helpers built on syscalls only (no util-linux binaries in the image).
//!
//! Health checks are O(1): one forced `statx` of the path, never a directory listing, so a
//! volume with millions of entries is checked as fast as an empty one.

use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Errors of the mount helpers; `errno` is kept so callers can tell busy from missing.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{op} {path}: {errno}")]
    Sys {
        op: &'static str,
        path: PathBuf,
        errno: Errno,
    },
    #[error("{path} is still mounted after unmounting it {attempts} times")]
    StillMounted { path: PathBuf, attempts: usize },
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl MountError {
    fn sys(op: &'static str, path: &Path, errno: Errno) -> Self {
        MountError::Sys {
            op,
            path: path.to_path_buf(),
            errno,
        }
    }

    /// The errno behind a syscall failure, if any.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            MountError::Sys { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

pub type Result<T, E = MountError> = std::result::Result<T, E>;

/// What is at a path, as far as mounts go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountState {
    /// Nothing is mounted at the path (it may or may not exist).
    NotMounted,
    /// A mount point whose filesystem answers.
    Healthy,
    /// A mount point (or a path) whose filesystem is gone: the FUSE daemon died, so the kernel
    /// answers `ENOTCONN`/`EIO`. Safe to lazily detach.
    Dead(Errno),
}

/// Errnos that mean "the filesystem behind this path is gone", not "the path is missing".
fn is_dead_errno(e: Errno) -> bool {
    matches!(e, Errno::ENOTCONN | Errno::EIO | Errno::ECONNABORTED)
}

/// One `statx` that forces a round trip to the filesystem (FUSE honours
/// `AT_STATX_FORCE_SYNC` with a GETATTR), so a dead daemon shows up as `ENOTCONN` even while the
/// kernel still caches the root's attributes.
fn statx_forced(path: &Path) -> std::result::Result<libc::statx, Errno> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: statx writes into the zeroed buffer we own; `c` outlives the call.
    unsafe {
        let mut buf: libc::statx = std::mem::zeroed();
        let rc = libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_STATX_FORCE_SYNC,
            libc::STATX_TYPE | libc::STATX_INO,
            &mut buf,
        );
        if rc == 0 {
            Ok(buf)
        } else {
            Err(Errno::last())
        }
    }
}

/// Whether `path` is the root of a mount. Uses the statx mount-root attribute (Linux 5.8+) and
/// falls back to the mount table on older kernels. A bind mount of a directory of the same
/// filesystem has the same `st_dev` as its parent, so comparing devices is not enough.
pub fn is_mount_point(path: &Path) -> Result<bool> {
    match statx_forced(path) {
        Ok(st) => {
            let root_attr = libc::STATX_ATTR_MOUNT_ROOT as u64;
            if st.stx_attributes_mask & root_attr != 0 {
                Ok(st.stx_attributes & root_attr != 0)
            } else {
                in_mount_table(path)
            }
        }
        Err(Errno::ENOENT) | Err(Errno::ENOTDIR) => Ok(false),
        // A dead mount cannot be stat'ed; the mount table still knows it.
        Err(e) if is_dead_errno(e) => in_mount_table(path),
        Err(e) => Err(MountError::sys("statx", path, e)),
    }
}

fn in_mount_table(path: &Path) -> Result<bool> {
    let table = read_mountinfo()?;
    Ok(table.iter().any(|m| m.mount_point == path))
}

/// Mount state of a path with one forced `statx` (plus a mount-table read only when the kernel
/// lacks the mount-root attribute or the filesystem is dead).
pub fn mount_state(path: &Path) -> Result<MountState> {
    match statx_forced(path) {
        Ok(st) => {
            let root_attr = libc::STATX_ATTR_MOUNT_ROOT as u64;
            let mounted = if st.stx_attributes_mask & root_attr != 0 {
                st.stx_attributes & root_attr != 0
            } else {
                in_mount_table(path)?
            };
            Ok(if mounted {
                MountState::Healthy
            } else {
                MountState::NotMounted
            })
        }
        Err(Errno::ENOENT) | Err(Errno::ENOTDIR) => Ok(MountState::NotMounted),
        Err(e) if is_dead_errno(e) => {
            // A dead mount point itself, or a path below one: both need the dead mount gone
            // before the path can be used, but only the former can be unmounted here.
            if in_mount_table(path)? {
                Ok(MountState::Dead(e))
            } else {
                Err(MountError::sys("statx (below a dead mount)", path, e))
            }
        }
        Err(e) => Err(MountError::sys("statx", path, e)),
    }
}

/// Bind-mounts `source` onto `target` (both must exist), `nosuid,nodev`: a volume shared
/// between tenants must never carry a setuid binary or a device node into a pod.
pub fn bind_mount(source: &Path, target: &Path) -> Result<()> {
    bind_with(source, target, MsFlags::empty())
}

/// Read-only bind mount, `nosuid,nodev` as well.
pub fn bind_mount_readonly(source: &Path, target: &Path) -> Result<()> {
    bind_with(source, target, MsFlags::MS_RDONLY)
}

/// Per-mount flags are ignored on the initial bind, and a bind remount replaces all of them
/// (a read-only remount alone drops `nosuid`/`nodev`), so it is a bind followed by one remount
/// with every flag; if the remount fails the bind is undone so no weaker mount is left.
fn bind_with(source: &Path, target: &Path, extra: MsFlags) -> Result<()> {
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| MountError::sys("bind mount", target, e))?;
    let flags =
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | extra;
    if let Err(e) = mount(None::<&str>, target, None::<&str>, flags, None::<&str>) {
        let _ = umount2(target, MntFlags::empty());
        return Err(MountError::sys(
            "nosuid,nodev remount of the bind",
            target,
            e,
        ));
    }
    Ok(())
}

/// How an unmount went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmounted {
    /// Nothing was mounted there.
    NotMounted,
    /// Unmounted normally.
    Unmounted,
    /// The mount was dead and busy, so it was lazily detached (`MNT_DETACH`).
    Detached,
}

/// Unmounts the top mount at `path`. A live busy mount is an error (never detached: that would
/// hide a mount still in use); a dead one falls back to a lazy detach.
pub fn unmount(path: &Path) -> Result<Unmounted> {
    match umount2(path, MntFlags::empty()) {
        Ok(()) => Ok(Unmounted::Unmounted),
        Err(Errno::EINVAL) | Err(Errno::ENOENT) => {
            // EINVAL: not a mount point. It can also mean a dead mount under an odd path, so
            // confirm with the table before saying so.
            if in_mount_table(path)? {
                detach_if_dead(path, Errno::EINVAL)
            } else {
                Ok(Unmounted::NotMounted)
            }
        }
        Err(e) => detach_if_dead(path, e),
    }
}

fn detach_if_dead(path: &Path, first: Errno) -> Result<Unmounted> {
    match mount_state(path) {
        Ok(MountState::Dead(_)) => {
            umount2(path, MntFlags::MNT_DETACH)
                .map_err(|e| MountError::sys("lazy unmount", path, e))?;
            Ok(Unmounted::Detached)
        }
        Ok(MountState::NotMounted) => Ok(Unmounted::NotMounted),
        _ => Err(MountError::sys("unmount", path, first)),
    }
}

/// Unmounts every mount stacked at `path` (a bind can sit on a bind). Bounded.
pub fn unmount_all(path: &Path) -> Result<Unmounted> {
    const MAX: usize = 16;
    let mut outcome = Unmounted::NotMounted;
    for _ in 0..MAX {
        match unmount(path)? {
            Unmounted::NotMounted => return Ok(outcome),
            other => {
                if outcome != Unmounted::Detached {
                    outcome = other;
                }
            }
        }
    }
    if is_mount_point(path)? {
        return Err(MountError::StillMounted {
            path: path.to_path_buf(),
            attempts: MAX,
        });
    }
    Ok(outcome)
}

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    pub mount_id: u32,
    pub parent_id: u32,
    pub major: u32,
    pub minor: u32,
    /// Root of the mount within its filesystem (a bind of a subdirectory shows it here).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub mount_options: String,
    pub optional_fields: Vec<String>,
    pub fs_type: String,
    pub source: OsString,
    pub super_options: String,
}

impl MountInfo {
    pub fn is_read_only(&self) -> bool {
        self.mount_options.split(',').any(|o| o == "ro")
    }
}

/// Undoes the kernel's octal escapes (`\040` space, `\011` tab, `\012` newline, `\134` backslash).
pub fn unescape_octal(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        if field[i] == b'\\' && i + 4 <= field.len() {
            let digits = &field[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let v = (digits[0] - b'0') as u32 * 64
                    + (digits[1] - b'0') as u32 * 8
                    + (digits[2] - b'0') as u32;
                if v <= 255 {
                    out.push(v as u8);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(field[i]);
        i += 1;
    }
    out
}

fn parse_u32(s: &[u8]) -> Option<u32> {
    std::str::from_utf8(s).ok()?.parse().ok()
}

/// Parses one mountinfo line; `None` for a malformed line.
pub fn parse_mountinfo_line(line: &[u8]) -> Option<MountInfo> {
    let fields: Vec<&[u8]> = line
        .split(|b| *b == b' ')
        .filter(|f| !f.is_empty())
        .collect();
    let sep = fields.iter().position(|f| *f == b"-")?;
    if sep < 6 || fields.len() < sep + 3 {
        return None;
    }
    let (major, minor) = {
        let mm = fields[2];
        let colon = mm.iter().position(|b| *b == b':')?;
        (parse_u32(&mm[..colon])?, parse_u32(&mm[colon + 1..])?)
    };
    let text = |f: &[u8]| String::from_utf8_lossy(&unescape_octal(f)).into_owned();
    Some(MountInfo {
        mount_id: parse_u32(fields[0])?,
        parent_id: parse_u32(fields[1])?,
        major,
        minor,
        root: PathBuf::from(OsString::from_vec(unescape_octal(fields[3]))),
        mount_point: PathBuf::from(OsString::from_vec(unescape_octal(fields[4]))),
        mount_options: text(fields[5]),
        optional_fields: fields[6..sep].iter().map(|f| text(f)).collect(),
        fs_type: text(fields[sep + 1]),
        source: OsString::from_vec(unescape_octal(fields[sep + 2])),
        super_options: fields.get(sep + 3).map(|f| text(f)).unwrap_or_default(),
    })
}

/// Parses a whole mountinfo text, skipping malformed lines.
pub fn parse_mountinfo(text: &[u8]) -> Vec<MountInfo> {
    text.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(parse_mountinfo_line)
        .collect()
}

/// The current mount table of this process's mount namespace.
pub fn read_mountinfo() -> Result<Vec<MountInfo>> {
    let p = Path::new("/proc/self/mountinfo");
    let text = std::fs::read(p).map_err(|source| MountError::Io {
        path: p.to_path_buf(),
        source,
    })?;
    Ok(parse_mountinfo(&text))
}

/// Mounts whose mount point is `dir` or below it.
pub fn mounts_under(dir: &Path) -> Result<Vec<MountInfo>> {
    Ok(read_mountinfo()?
        .into_iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .collect())
}

/// `mkdir -p` that tolerates an existing directory, including one that is a dead mount point
/// (whose stat fails with ENOTCONN, so `create_dir_all` would report an error).
pub fn ensure_dir(path: &Path) -> std::io::Result<()> {
    match std::fs::create_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Removes an empty directory left by a mount point; missing is fine. Never recursive, so it
/// can never delete data through a mount that is still there.
pub fn remove_mount_dir(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Test support: a real but dead FUSE mount at `path`, made by mounting a `/dev/fuse`
/// connection and closing it before the INIT handshake, so the kernel aborts the connection
/// and every access answers `ENOTCONN` — exactly what a crashed FUSE daemon leaves behind.
#[doc(hidden)]
pub fn mount_dead_fuse(path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|source| MountError::Io {
            path: PathBuf::from("/dev/fuse"),
            source,
        })?;
    let data = format!("fd={},rootmode=40000,user_id=0,group_id=0", dev.as_raw_fd());
    mount(
        Some(OsStr::new("csi-test-dead")),
        path,
        Some("fuse.csi-test-dead"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .map_err(|e| MountError::sys("mount fuse", path, e))?;
    drop(dev);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &[u8] = b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
36 22 0:32 /sub\\040dir /mnt/with\\040space rw,nosuid master:7 shared:9 - fuse.seaweedfs 127.0.0.1:8888:/buckets/a rw,user_id=0,group_id=0
37 22 0:33 / /var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pv\\134a/mount ro,relatime - fuse.seaweedfs src ro
garbage line
";

    #[test]
    fn parses_mountinfo_with_escapes_and_optional_fields() {
        let m = parse_mountinfo(SAMPLE);
        assert_eq!(m.len(), 3, "the garbage line is skipped");
        assert_eq!(m[0].mount_point, PathBuf::from("/"));
        assert_eq!(m[0].fs_type, "ext4");
        assert_eq!(m[0].optional_fields, vec!["shared:1".to_string()]);
        assert_eq!(m[1].mount_point, PathBuf::from("/mnt/with space"));
        assert_eq!(m[1].root, PathBuf::from("/sub dir"));
        assert_eq!((m[1].major, m[1].minor), (0, 32));
        assert_eq!(
            m[1].optional_fields,
            vec!["master:7".to_string(), "shared:9".to_string()]
        );
        assert_eq!(m[1].source, OsString::from("127.0.0.1:8888:/buckets/a"));
        assert!(!m[1].is_read_only());
        assert_eq!(
            m[2].mount_point,
            PathBuf::from("/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pv\\a/mount")
        );
        assert!(m[2].is_read_only());
        assert_eq!(m[2].super_options, "ro");
    }

    #[test]
    fn unescape_keeps_invalid_sequences() {
        assert_eq!(unescape_octal(b"a\\011b"), b"a\tb");
        assert_eq!(unescape_octal(b"a\\012"), b"a\n");
        assert_eq!(unescape_octal(b"x\\9yz"), b"x\\9yz");
        assert_eq!(unescape_octal(b"end\\04"), b"end\\04");
        assert_eq!(unescape_octal(b"\\"), b"\\");
    }

    #[test]
    fn rejects_short_lines() {
        assert!(parse_mountinfo_line(b"1 2 3:4 / /x rw - ext4").is_none());
        assert!(parse_mountinfo_line(b"1 2 x / /x rw - ext4 src rw").is_none());
    }

    #[test]
    fn own_mount_table_has_root() {
        let t = read_mountinfo().unwrap();
        assert!(t.iter().any(|m| m.mount_point == Path::new("/")));
    }

    /// Unmounts whatever the test mounted under its temp dir, also when it fails midway.
    struct Cleanup(tempfile::TempDir);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for _ in 0..8 {
                let mut ms = mounts_under(self.0.path()).unwrap_or_default();
                if ms.is_empty() {
                    break;
                }
                ms.sort_by_key(|m| std::cmp::Reverse(m.mount_id));
                for m in ms {
                    let _ = umount2(&m.mount_point, MntFlags::MNT_DETACH);
                }
            }
        }
    }

    fn setup() -> (Cleanup, PathBuf, PathBuf) {
        let d = Cleanup(tempfile::tempdir().unwrap());
        let src = d.0.path().join("src");
        let dst = d.0.path().join("dst");
        std::fs::create_dir(&src).unwrap();
        std::fs::create_dir(&dst).unwrap();
        (d, src, dst)
    }

    #[test]
    fn bind_mount_roundtrip() {
        let (_d, src, dst) = setup();
        assert_eq!(mount_state(&dst).unwrap(), MountState::NotMounted);
        assert!(!is_mount_point(&dst).unwrap());
        bind_mount(&src, &dst).unwrap();
        assert!(is_mount_point(&dst).unwrap());
        assert!(
            in_mount_table(&dst).unwrap(),
            "the statx answer agrees with the table"
        );
        assert_eq!(mount_state(&dst).unwrap(), MountState::Healthy);
        let info = read_mountinfo()
            .unwrap()
            .into_iter()
            .find(|m| m.mount_point == dst)
            .unwrap();
        assert!(!info.is_read_only());
        assert_per_mount_flags(&info);
        std::fs::write(dst.join("f"), b"x").unwrap();
        assert_eq!(std::fs::read(src.join("f")).unwrap(), b"x");
        assert_eq!(unmount(&dst).unwrap(), Unmounted::Unmounted);
        assert_eq!(unmount(&dst).unwrap(), Unmounted::NotMounted);
        assert!(!dst.join("f").exists());
        assert_eq!(
            mount_state(&dst.join("missing")).unwrap(),
            MountState::NotMounted
        );
    }

    /// A pod's volume never runs setuid binaries or opens device nodes.
    fn assert_per_mount_flags(info: &MountInfo) {
        let opts: Vec<&str> = info.mount_options.split(',').collect();
        for want in ["nosuid", "nodev"] {
            assert!(
                opts.contains(&want),
                "{want} missing: {}",
                info.mount_options
            );
        }
    }

    #[test]
    fn readonly_bind_rejects_writes() {
        let (_d, src, dst) = setup();
        bind_mount_readonly(&src, &dst).unwrap();
        let err = std::fs::write(dst.join("f"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS));
        let info = read_mountinfo()
            .unwrap()
            .into_iter()
            .find(|m| m.mount_point == dst)
            .unwrap();
        assert!(info.is_read_only());
        assert_per_mount_flags(&info);
        // The source stays writable.
        std::fs::write(src.join("g"), b"y").unwrap();
        assert_eq!(std::fs::read(dst.join("g")).unwrap(), b"y");
    }

    #[test]
    fn unmount_all_removes_stacked_binds() {
        let (_d, src, dst) = setup();
        bind_mount(&src, &dst).unwrap();
        bind_mount(&src, &dst).unwrap();
        assert_eq!(mounts_under(&dst).unwrap().len(), 2);
        assert_eq!(unmount_all(&dst).unwrap(), Unmounted::Unmounted);
        assert!(mounts_under(&dst).unwrap().is_empty());
    }

    #[test]
    fn live_busy_mount_is_not_detached() {
        let (_d, src, dst) = setup();
        bind_mount(&src, &dst).unwrap();
        let _busy = std::fs::File::create(dst.join("open")).unwrap();
        // A cwd or open file keeps a normal unmount from succeeding only on some kernels; the
        // bind with a submount below it is the portable way to get EBUSY.
        let sub = dst.join("sub");
        std::fs::create_dir(&sub).unwrap();
        bind_mount(&src, &sub).unwrap();
        let err = unmount(&dst).unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EBUSY));
        assert!(
            is_mount_point(&dst).unwrap(),
            "a live busy mount stays mounted"
        );
    }

    #[test]
    fn dead_fuse_mount_is_detected_and_detached() {
        let (_d, _src, dst) = setup();
        mount_dead_fuse(&dst).unwrap();
        match mount_state(&dst).unwrap() {
            MountState::Dead(e) => assert_eq!(e, Errno::ENOTCONN),
            other => panic!("expected a dead mount, got {other:?}"),
        }
        assert!(is_mount_point(&dst).unwrap());
        ensure_dir(&dst).unwrap();
        // An O_PATH descriptor needs no answer from the filesystem but pins the mount, so a
        // plain unmount fails with EBUSY and only the lazy detach can remove it.
        let pin = nix::fcntl::open(
            &dst,
            nix::fcntl::OFlag::O_PATH,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        assert_eq!(umount2(&dst, MntFlags::empty()), Err(Errno::EBUSY));
        assert_eq!(unmount(&dst).unwrap(), Unmounted::Detached);
        assert_eq!(mount_state(&dst).unwrap(), MountState::NotMounted);
        nix::unistd::close(pin).unwrap();
    }

    #[test]
    fn idle_dead_fuse_mount_unmounts_normally() {
        let (_d, _src, dst) = setup();
        mount_dead_fuse(&dst).unwrap();
        assert_eq!(unmount_all(&dst).unwrap(), Unmounted::Unmounted);
        assert!(!is_mount_point(&dst).unwrap());
    }
}
