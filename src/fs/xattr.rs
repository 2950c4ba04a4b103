//! Extended attributes of [`Fs`]'s nodes, and the POSIX ACLs kept among them.

use super::acl::{self, Acl};
use super::attr::{self, to_go_mode, Kind};
use super::inode::{split, ROOT_INO};
use super::{errno, now_parts, Fs, Result};
use crate::pb::filer as pb;

const XATTR_PREFIX: &str = "xattr-";
const SELINUX_XATTR: &str = "security.selinux";

impl Fs {
    /// Runs `f` on the xattrs (the entry's `extended` map) of `ino`, without copying the
    /// entry: the kernel asks for `security.capability` on every write, and an open file's
    /// entry holds its whole chunk list (a copy per write grew with the file's size).
    async fn with_xattrs<R>(
        &self,
        ino: u64,
        f: impl FnOnce(&std::collections::HashMap<String, Vec<u8>>) -> R,
    ) -> Result<R> {
        let path = self.path_of(ino)?;
        if let Some(of) = self.open_file(ino) {
            return Ok(f(&of.state.lock().entry.extended));
        }
        if ino == ROOT_INO {
            let (d, n) = split(&self.cfg.root);
            if self.cfg.root == "/" {
                return Err(errno(libc::ENOTSUP, "no xattrs on the filer root"));
            }
            return Ok(f(&self.entry_at(&d, &n).await?.extended));
        }
        let (d, n) = split(&path);
        Ok(f(&self.entry_at(&d, &n).await?.extended))
    }

    pub async fn getxattr(&self, ino: u64, name: &str) -> Result<Vec<u8>> {
        if ino == ROOT_INO && self.cfg.root == "/" && self.posix_acl() && is_acl_name(name) {
            // the kernel takes any other error as a failed permission check
            return Err(errno(libc::ENODATA, "no ACL on the filer root"));
        }
        let key = format!("{XATTR_PREFIX}{name}");
        match self.with_xattrs(ino, |x| x.get(&key).cloned()).await? {
            Some(v) => Ok(v),
            None if name == SELINUX_XATTR && self.cfg.selinux_label_unsupported => Err(errno(
                libc::EOPNOTSUPP,
                "no SELinux label (SELinux is off on this node)",
            )),
            None => Err(errno(libc::ENODATA, format!("no xattr {name}"))),
        }
    }

    pub async fn listxattr(&self, ino: u64) -> Result<Vec<String>> {
        let mut v: Vec<String> = self
            .with_xattrs(ino, |x| {
                x.keys()
                    .filter_map(|k| k.strip_prefix(XATTR_PREFIX).map(str::to_string))
                    .collect()
            })
            .await?;
        v.sort();
        Ok(v)
    }

    pub async fn setxattr(&self, ino: u64, name: &str, value: &[u8], flags: i32) -> Result<()> {
        self.check_writable()?;
        if name.len() > 255 {
            return Err(errno(libc::ERANGE, "xattr name too long"));
        }
        if value.len() > 65536 {
            return Err(errno(libc::E2BIG, "xattr value too large"));
        }
        if self.posix_acl() && is_acl_name(name) {
            return self.set_acl(ino, name, value, flags).await;
        }
        self.change_xattrs(ino, |ext| {
            let key = format!("{XATTR_PREFIX}{name}");
            let exists = ext.contains_key(&key);
            if flags & libc::XATTR_CREATE != 0 && exists {
                return Err(errno(libc::EEXIST, "xattr exists"));
            }
            if flags & libc::XATTR_REPLACE != 0 && !exists {
                return Err(errno(libc::ENODATA, "no such xattr"));
            }
            ext.insert(key, value.to_vec());
            Ok(())
        })
        .await
    }

    /// setxattr of an ACL the kernel enforces: validated; an access ACL also sets the mode's
    /// permission bits and is not stored when the mode says it all.
    async fn set_acl(&self, ino: u64, name: &str, value: &[u8], flags: i32) -> Result<()> {
        let parsed = Acl::parse(value).map_err(|e| errno(e.errno(), format!("{name}: {e}")))?;
        let key = xattr_key(name);
        self.change_entry(ino, |e| {
            let exists = e.extended.contains_key(&key);
            if flags & libc::XATTR_CREATE != 0 && exists {
                return Err(errno(libc::EEXIST, "xattr exists"));
            }
            if flags & libc::XATTR_REPLACE != 0 && !exists {
                return Err(errno(libc::ENODATA, "no such xattr"));
            }
            if name == acl::DEFAULT {
                if !e.is_directory {
                    // as ext4 and the VFS answer for non-directories
                    return Err(errno(libc::EACCES, "default ACL on a non-directory"));
                }
                if parsed.is_empty() {
                    e.extended.remove(&key);
                } else {
                    e.extended.insert(key.clone(), value.to_vec());
                }
                return Ok(());
            }
            if parsed.is_empty() {
                e.extended.remove(&key);
                return Ok(());
            }
            let a = e.attributes.get_or_insert_with(Default::default);
            let (kind, perm) = attr::from_go_mode(a.file_mode);
            let kind = if e.is_directory { Kind::Dir } else { kind };
            a.file_mode = to_go_mode(kind, (u32::from(perm) & !0o777) | parsed.mode_bits());
            if parsed.is_equivalent_to_mode() {
                e.extended.remove(&key);
            } else {
                e.extended.insert(key.clone(), value.to_vec());
            }
            Ok(())
        })
        .await
    }

    pub async fn removexattr(&self, ino: u64, name: &str) -> Result<()> {
        self.check_writable()?;
        self.change_xattrs(ino, |ext| {
            ext.remove(&format!("{XATTR_PREFIX}{name}"))
                .map(|_| ())
                .ok_or_else(|| errno(libc::ENODATA, "no such xattr"))
        })
        .await
    }

    async fn change_xattrs(
        &self,
        ino: u64,
        f: impl Fn(&mut std::collections::HashMap<String, Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        self.change_entry(ino, |e| f(&mut e.extended)).await
    }

    /// Applies `f` to the entry (xattrs, or the mode along with an ACL) and commits it.
    async fn change_entry(&self, ino: u64, f: impl Fn(&mut pb::Entry) -> Result<()>) -> Result<()> {
        self.change_entry_starting(ino, self.open_file(ino), f)
            .await
    }

    /// [`Self::change_entry`] starting from `open`, the open state found for `ino`.
    pub(super) async fn change_entry_starting(
        &self,
        ino: u64,
        mut open: Option<std::sync::Arc<super::file::OpenFile>>,
        f: impl Fn(&mut pb::Entry) -> Result<()>,
    ) -> Result<()> {
        for _ in 0..super::CHANGE_ROUNDS {
            if let Some(r) = self.change_entry_from(ino, open.as_ref(), &f).await {
                return r;
            }
            // closed for good meanwhile: the current state (if any) takes the change, or a
            // newer open state's commit would write over a change made to the filer's entry
            open = self.open_file(ino);
        }
        Err(errno(
            libc::EAGAIN,
            "the file was opened and closed again and again while being changed",
        ))
    }

    /// [`Self::change_entry`] through `open`, the file's open state; None if that state was
    /// retired by its last close.
    pub(super) async fn change_entry_from(
        &self,
        ino: u64,
        open: Option<&std::sync::Arc<super::file::OpenFile>>,
        f: &impl Fn(&mut pb::Entry) -> Result<()>,
    ) -> Option<Result<()>> {
        // this node's own commits of the file stay out of the lookup→update below
        let commit_lock = match open {
            Some(of) => Some(of.commit.lock().await),
            None => None,
        };
        if let Some(of) = open {
            let local = {
                let mut s = of.state.lock();
                if s.retired {
                    return None;
                }
                let local = !s.is_clean() || s.unlinked;
                if local {
                    // our own entry goes to the filer anyway: the change rides that commit
                    if let Err(e) = f(&mut s.entry) {
                        return Some(Err(e));
                    }
                    let a = s.entry.attributes.get_or_insert_with(Default::default);
                    (a.ctime, a.ctime_ns) = now_parts();
                    s.touch();
                }
                local
            };
            if local {
                drop(commit_lock);
                // an ESTALE here is not retried by path: the file may have been moved away
                // unseen, and the path may lead to another file now
                return Some(self.flush_file(of).await);
            }
        }
        let (dir, name) = if ino == ROOT_INO {
            if self.cfg.root == "/" {
                return Some(Err(errno(libc::ENOTSUP, "no xattrs on the filer root")));
            }
            split(&self.cfg.root)
        } else {
            match self.path_of(ino) {
                Ok(p) => split(&p),
                Err(e) => return Some(Err(e)),
            }
        };
        let turn = self.entry_lock(&dir, &name).lock().await;
        if open.is_none() && ino != ROOT_INO && self.open_file(ino).is_some() {
            // opened since the caller looked: that state takes the change (see setattr)
            return None;
        }
        let known = open
            .filter(|_| ino != ROOT_INO)
            .map(|of| super::events::Identity::of(&of.state.lock().entry));
        let path = super::inode::join(&dir, &name);
        let e = self
            .update_fresh_locked(&dir, &name, |e| {
                if let Some(known) = &known {
                    self.check_open_file(&path, e, ino, known)?;
                }
                f(e)?;
                let a = e.attributes.get_or_insert_with(Default::default);
                (a.ctime, a.ctime_ns) = now_parts();
                Ok(())
            })
            .await;
        drop(turn);
        let e = match e {
            Ok(e) => e,
            Err(e) => return Some(Err(e)),
        };
        if let Some(of) = open {
            self.adopt_if_clean(ino, of, e).await;
        }
        drop(commit_lock);
        if ino == ROOT_INO {
            let _ = self.init_root().await;
        }
        Some(Ok(()))
    }
}

pub(super) fn xattr_key(name: &str) -> String {
    format!("{XATTR_PREFIX}{name}")
}

fn is_acl_name(name: &str) -> bool {
    name == acl::ACCESS || name == acl::DEFAULT
}

/// chmod of an entry with an access ACL: the ACL follows the new mode (named entries stay).
pub(super) fn chmod_access_acl(e: &mut pb::Entry, mode: u32) {
    let key = xattr_key(acl::ACCESS);
    let Some(raw) = e.extended.get_mut(&key) else {
        return;
    };
    match Acl::parse(raw) {
        Ok(mut a) if !a.is_empty() => {
            a.chmod(mode);
            *raw = a.to_bytes();
        }
        Ok(_) => {}
        Err(err) => {
            tracing::warn!(name = %e.name, error = %err, "chmod: stored access ACL is malformed; left as is")
        }
    }
}

#[cfg(test)]
mod acl_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::acl::{AclEntry, GROUP_OBJ, MASK, OTHER, UNDEFINED_ID, USER, USER_OBJ};
    use crate::fs::{FsConfig, SetAttr};
    use crate::volume::mock::MockChunkStore;
    use std::sync::Arc;

    fn fs(posix_acl: bool) -> Arc<Fs> {
        let o = MountOptions {
            filer_path: "/vol".into(),
            ..Default::default()
        };
        let fs = Fs::new(
            FsConfig::from_mount_options(&o),
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        fs.set_posix_acl(posix_acl);
        fs
    }

    fn acl(entries: &[(u16, u16, u32)]) -> Acl {
        Acl {
            entries: entries
                .iter()
                .map(|&(tag, perm, id)| AclEntry { tag, perm, id })
                .collect(),
        }
    }

    fn named_reader(mask: u16) -> Acl {
        acl(&[
            (USER_OBJ, 6, UNDEFINED_ID),
            (USER, 4, 65534),
            (GROUP_OBJ, 0, UNDEFINED_ID),
            (MASK, mask, UNDEFINED_ID),
            (OTHER, 0, UNDEFINED_ID),
        ])
    }

    async fn file(fs: &Fs, name: &str, mode: u32) -> u64 {
        let a = fs
            .mknod(ROOT_INO, name, libc::S_IFREG | mode, 0, 0, 0, 0)
            .await
            .unwrap();
        a.ino
    }

    #[tokio::test]
    async fn access_acl_sets_the_mode_and_chmod_rewrites_it() {
        let fs = fs(true);
        fs.init_root().await.unwrap();
        let ino = file(&fs, "f", 0o4600).await;
        let v = named_reader(4).to_bytes();
        fs.setxattr(ino, acl::ACCESS, &v, 0).await.unwrap();
        let a = fs.getattr(ino).await.unwrap();
        assert_eq!(a.perm, 0o4640, "group bits = mask, setuid kept");
        assert_eq!(fs.getxattr(ino, acl::ACCESS).await.unwrap(), v);

        fs.setattr(
            ino,
            SetAttr {
                mode: Some(0o751),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let back = Acl::parse(&fs.getxattr(ino, acl::ACCESS).await.unwrap()).unwrap();
        assert_eq!(back.mode_bits(), 0o751);
        assert_eq!(back.entries[1].perm, 4, "named entry kept");

        // malformed: EINVAL, nothing changed
        let err = fs.setxattr(ino, acl::ACCESS, &v[..7], 0).await;
        assert_eq!(err.unwrap_err().errno, libc::EINVAL);
        assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o751);

        // an equivalent ACL: mode only, the stored one goes away
        let base = acl(&[(USER_OBJ, 6, 0), (GROUP_OBJ, 4, 0), (OTHER, 0, 0)]);
        fs.setxattr(ino, acl::ACCESS, &base.to_bytes(), 0)
            .await
            .unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o640);
        let gone = fs.getxattr(ino, acl::ACCESS).await.unwrap_err();
        assert_eq!(gone.errno, libc::ENODATA);
    }

    #[tokio::test]
    async fn default_acl_only_on_directories_and_inherited() {
        let fs = fs(true);
        fs.init_root().await.unwrap();
        let f = file(&fs, "f", 0o644).await;
        let d = acl(&[
            (USER_OBJ, 7, UNDEFINED_ID),
            (USER, 7, 65534),
            (GROUP_OBJ, 5, UNDEFINED_ID),
            (MASK, 7, UNDEFINED_ID),
            (OTHER, 0, UNDEFINED_ID),
        ]);
        let err = fs.setxattr(f, acl::DEFAULT, &d.to_bytes(), 0).await;
        assert_eq!(err.unwrap_err().errno, libc::EACCES);

        let dir = fs.mkdir(ROOT_INO, "d", 0o755, 0o022, 0, 0).await.unwrap();
        assert_eq!(dir.perm, 0o755);
        fs.setxattr(dir.ino, acl::DEFAULT, &d.to_bytes(), 0)
            .await
            .unwrap();
        // umask 077 is ignored under a default ACL
        let (child, fh) = fs
            .create(dir.ino, "c", 0o666, 0o077, libc::O_WRONLY, 0, 0)
            .await
            .unwrap();
        fs.release(fh, child.ino).await.unwrap();
        assert_eq!(child.perm, 0o660);
        let ca = Acl::parse(&fs.getxattr(child.ino, acl::ACCESS).await.unwrap()).unwrap();
        assert_eq!(ca.mode_bits(), 0o660);
        assert_eq!(
            ca.entries[1],
            AclEntry {
                tag: USER,
                perm: 7,
                id: 65534
            }
        );
        assert!(fs.getxattr(child.ino, acl::DEFAULT).await.is_err());

        let sub = fs.mkdir(dir.ino, "s", 0o777, 0o077, 0, 0).await.unwrap();
        assert_eq!(sub.perm, 0o770);
        assert_eq!(
            fs.getxattr(sub.ino, acl::DEFAULT).await.unwrap(),
            d.to_bytes()
        );
        assert!(fs.getxattr(sub.ino, acl::ACCESS).await.is_ok());
        // symlinks get nothing
        let l = fs.symlink(dir.ino, "l", "x", 0, 0).await.unwrap();
        assert_eq!(l.perm, 0o777);
    }

    #[tokio::test]
    async fn filer_root_reports_no_acl_rather_than_an_error() {
        for (on, want) in [(true, libc::ENODATA), (false, libc::ENOTSUP)] {
            let fs = Fs::new(
                FsConfig::from_mount_options(&MountOptions::default()),
                Arc::new(MockFiler::new()),
                Arc::new(MockChunkStore::new()),
                ChunkCache::new(1 << 20),
            );
            fs.set_posix_acl(on);
            // the kernel turns any error but ENODATA into a failed permission check
            let e = fs.getxattr(ROOT_INO, acl::ACCESS).await.unwrap_err();
            assert_eq!(e.errno, want);
        }
    }

    #[tokio::test]
    async fn without_negotiated_acls_xattrs_are_plain_and_umask_applies() {
        let fs = fs(false);
        fs.init_root().await.unwrap();
        let ino = file(&fs, "f", 0o600).await;
        let v = named_reader(4).to_bytes();
        fs.setxattr(ino, acl::ACCESS, &v, 0).await.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o600, "mode untouched");
        // not validated either (as before)
        fs.setxattr(ino, acl::ACCESS, b"junk", 0).await.unwrap();
        let d = fs.mkdir(ROOT_INO, "d", 0o777, 0o022, 0, 0).await.unwrap();
        assert_eq!(d.perm, 0o755);
        let n = fs
            .mknod(ROOT_INO, "p", libc::S_IFIFO | 0o666, 0o027, 0, 0, 0)
            .await
            .unwrap();
        assert_eq!((n.kind, n.perm), (Kind::Fifo, 0o640));
    }
}

#[cfg(test)]
mod xattr_tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;
    use std::sync::Arc;

    async fn fs_with(selinux_label_unsupported: bool) -> (Arc<Fs>, u64) {
        let mut cfg = FsConfig::from_mount_options(&MountOptions::default());
        cfg.selinux_label_unsupported = selinux_label_unsupported;
        let fs = Fs::new(
            cfg,
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        );
        fs.init_root().await.unwrap();
        let d = fs.mkdir(ROOT_INO, "d", 0o755, 0, 0, 0).await.unwrap();
        (fs, d.ino)
    }

    #[tokio::test]
    async fn absent_selinux_label_is_unsupported_only_when_selinux_is_off() {
        let (fs, ino) = fs_with(true).await;
        let e = fs.getxattr(ino, SELINUX_XATTR).await.unwrap_err();
        assert_eq!(e.errno, libc::EOPNOTSUPP);
        // other names keep ENODATA, and a label that is set is returned
        let e = fs.getxattr(ino, "security.other").await.unwrap_err();
        assert_eq!(e.errno, libc::ENODATA);
        let label = b"system_u:object_r:container_file_t:s0\0";
        fs.setxattr(ino, SELINUX_XATTR, label, 0).await.unwrap();
        assert_eq!(fs.getxattr(ino, SELINUX_XATTR).await.unwrap(), label);

        let (fs, ino) = fs_with(false).await;
        let e = fs.getxattr(ino, SELINUX_XATTR).await.unwrap_err();
        assert_eq!(e.errno, libc::ENODATA);
    }
}
