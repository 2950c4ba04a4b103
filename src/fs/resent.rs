//! Requests the kernel queues again after a takeover (FUSE_NOTIFY_RESEND) may already have been
//! applied by the process that died before answering them. Run again, a namespace change then
//! fails where its first run succeeded: mkdir finds its own directory (EEXIST), unlink finds
//! nothing to remove (ENOENT). For a resent request those outcomes are answered as the first
//! run's success. A wrong guess (someone else made the same change meanwhile) still leaves
//! exactly the state the caller asked for.
//!
//! A file's create(2) reaches the filer at its first flush, which can come before the create
//! is answered only when a hand-over flushed everything after its wait for running requests
//! timed out: run again, the create finds its file, which a create answers with ESTALE (see
//! `Fs::create`); for a resent create, an empty regular file owned by the caller is opened
//! instead.
//! Data writes are idempotent (same offset, same bytes).

use super::attr::{Attr, Kind};
use super::{Fs, Result};

impl Fs {
    /// All three take the request's `resent` flag and pass any result through when it is
    /// false, so the adapter calls them for every request.
    ///
    /// mkdir/mknod/symlink/link: EEXIST for an entry of the kind asked for (`want`; `None` =
    /// any non-directory) is the first run's result: answer with that entry.
    pub async fn settle_resent_create(
        &self,
        resent: bool,
        parent: u64,
        name: &str,
        want: Option<Kind>,
        r: Result<Attr>,
    ) -> Result<Attr> {
        let e = match r {
            Err(e) if resent && e.errno == libc::EEXIST => e,
            r => return r,
        };
        match self.lookup(parent, name).await {
            Ok(a) if want.map_or(a.kind != Kind::Dir, |k| a.kind == k) => {
                tracing::info!(
                    name,
                    "resent create found its entry: applied before the takeover"
                );
                Ok(a)
            }
            Ok(a) => {
                // the lookup counted a reference the kernel never receives
                self.forget(a.ino, 1);
                Err(e)
            }
            Err(_) => Err(e),
        }
    }

    /// create(2): ESTALE (the name exists) for an empty regular file the caller owns is the
    /// first run's result: open that file, as the first run did. A file with bytes in it is
    /// not: the create was never answered, so nothing can have written through it.
    pub async fn settle_resent_open_create(
        &self,
        resent: bool,
        parent: u64,
        name: &str,
        flags: i32,
        uid: u32,
        r: Result<(Attr, u64)>,
    ) -> Result<(Attr, u64)> {
        let e = match r {
            Err(e) if resent && e.errno == libc::ESTALE => e,
            r => return r,
        };
        match self.lookup(parent, name).await {
            Ok(a) if a.kind == Kind::File && a.uid == uid && a.size == 0 => {
                tracing::info!(
                    name,
                    "resent create found its file: applied before the takeover"
                );
                match self.open(a.ino, flags & !libc::O_TRUNC).await {
                    Ok(fh) => Ok((a, fh)),
                    Err(err) => {
                        self.forget(a.ino, 1);
                        Err(err)
                    }
                }
            }
            Ok(a) => {
                // the lookup counted a reference the kernel never receives
                self.forget(a.ino, 1);
                Err(e)
            }
            Err(_) => Err(e),
        }
    }

    /// unlink/rmdir: ENOENT is the first run's result.
    pub fn settle_resent_remove(&self, resent: bool, name: &str, r: Result<()>) -> Result<()> {
        match r {
            Err(e) if resent && e.errno == libc::ENOENT => {
                tracing::info!(
                    name,
                    "resent removal found nothing: applied before the takeover"
                );
                Ok(())
            }
            r => r,
        }
    }

    /// rename: ENOENT while the destination exists is the first run's result.
    pub async fn settle_resent_rename(
        &self,
        resent: bool,
        newparent: u64,
        newname: &str,
        r: Result<()>,
    ) -> Result<()> {
        let e = match r {
            Err(e) if resent && e.errno == libc::ENOENT => e,
            r => return r,
        };
        match self.lookup(newparent, newname).await {
            Ok(_) => {
                tracing::info!(
                    newname,
                    "resent rename found its result: applied before the takeover"
                );
                Ok(())
            }
            Err(_) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ChunkCache;
    use crate::config::MountOptions;
    use crate::filer::mock::MockFiler;
    use crate::fs::inode::ROOT_INO;
    use crate::fs::FsConfig;
    use crate::volume::mock::MockChunkStore;
    use std::sync::Arc;

    fn fs() -> Arc<Fs> {
        let cfg = FsConfig::from_mount_options(&MountOptions::default());
        Fs::new(
            cfg,
            Arc::new(MockFiler::new()),
            Arc::new(MockChunkStore::new()),
            ChunkCache::new(1 << 20),
        )
    }

    /// A create resent after a hand-over that flushed it finds its own file and opens it;
    /// a file of another owner at the name stays ESTALE (the kernel then checks the caller).
    #[tokio::test]
    async fn a_resent_create_opens_the_file_its_first_run_made() {
        let fs = fs();
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC;
        let (a, fh) = fs
            .create(ROOT_INO, "f", 0o444, 0, flags, 1000, 1000)
            .await
            .unwrap();
        fs.release(fh, a.ino).await.unwrap();
        let counted = fs.inodes.nlookup_of(a.ino);
        let refused = |resent: bool, uid: u32| {
            let fs = fs.clone();
            async move {
                let r = fs.create(ROOT_INO, "f", 0o444, 0, flags, uid, uid).await;
                let r = fs
                    .settle_resent_open_create(resent, ROOT_INO, "f", flags, uid, r)
                    .await;
                assert_eq!(
                    r.unwrap_err().errno,
                    libc::ESTALE,
                    "resent {resent} uid {uid}"
                );
            }
        };
        // not resent, or another owner's file: the kernel looks again and checks the caller
        refused(false, 1000).await;
        refused(true, 1001).await;
        assert_eq!(
            fs.inodes.nlookup_of(a.ino),
            counted,
            "a refusal kept a lookup"
        );
        let again = fs.create(ROOT_INO, "f", 0o444, 0, flags, 1000, 1000).await;
        assert_eq!(again.as_ref().unwrap_err().errno, libc::ESTALE);
        let (b, fh) = fs
            .settle_resent_open_create(true, ROOT_INO, "f", flags, 1000, again)
            .await
            .unwrap();
        assert_eq!(b.ino, a.ino);
        assert_eq!(
            fs.inodes.nlookup_of(a.ino),
            counted + 1,
            "the reply's entry"
        );
        fs.write(fh, b.ino, 0, b"data").await.unwrap();
        fs.release(fh, b.ino).await.unwrap();
        // written since: not a file an unanswered create made
        refused(true, 1000).await;
    }

    #[tokio::test]
    async fn replayed_creates_answer_with_the_existing_entry() {
        let fs = fs();
        let d = fs.mkdir(ROOT_INO, "d", 0o755, 0, 0, 0).await.unwrap();
        let again = fs.mkdir(ROOT_INO, "d", 0o755, 0, 0, 0).await;
        assert_eq!(again.as_ref().unwrap_err().errno, libc::EEXIST);
        let settled = fs
            .settle_resent_create(true, ROOT_INO, "d", Some(Kind::Dir), again)
            .await
            .unwrap();
        assert_eq!(settled.ino, d.ino);

        // Another kind under the name is a real conflict.
        let s = fs.symlink(ROOT_INO, "l", "/x", 0, 0).await.unwrap();
        let r = fs.mkdir(ROOT_INO, "l", 0o755, 0, 0, 0).await;
        let r = fs
            .settle_resent_create(true, ROOT_INO, "l", Some(Kind::Dir), r)
            .await;
        assert_eq!(r.unwrap_err().errno, libc::EEXIST);
        let r = fs.symlink(ROOT_INO, "l", "/x", 0, 0).await;
        let r = fs
            .settle_resent_create(true, ROOT_INO, "l", Some(Kind::Symlink), r)
            .await;
        assert_eq!(r.unwrap().ino, s.ino);
        // mknod wants any non-directory: a directory is a conflict.
        let r = fs
            .mknod(ROOT_INO, "d", libc::S_IFIFO | 0o644, 0, 0, 0, 0)
            .await;
        let r = fs.settle_resent_create(true, ROOT_INO, "d", None, r).await;
        assert_eq!(r.unwrap_err().errno, libc::EEXIST);
        // Other errors pass through untouched.
        let r = fs.mkdir(999_999, "x", 0o755, 0, 0, 0).await;
        let errno = r.as_ref().unwrap_err().errno;
        let r = fs.settle_resent_create(true, 999_999, "x", None, r).await;
        assert_eq!(r.unwrap_err().errno, errno);
    }

    #[tokio::test]
    async fn replayed_removals_and_renames_succeed() {
        let fs = fs();
        fs.mkdir(ROOT_INO, "a", 0o755, 0, 0, 0).await.unwrap();
        fs.rmdir(ROOT_INO, "a").await.unwrap();
        let again = fs.rmdir(ROOT_INO, "a").await;
        assert_eq!(again.as_ref().unwrap_err().errno, libc::ENOENT);
        fs.settle_resent_remove(true, "a", again).unwrap();

        fs.mkdir(ROOT_INO, "b", 0o755, 0, 0, 0).await.unwrap();
        let r = fs.unlink(ROOT_INO, "b").await; // EISDIR: not a replay outcome
        assert_eq!(
            fs.settle_resent_remove(true, "b", r).unwrap_err().errno,
            libc::EISDIR
        );

        fs.rename(ROOT_INO, "b", ROOT_INO, "c", 0).await.unwrap();
        let again = fs.rename(ROOT_INO, "b", ROOT_INO, "c", 0).await;
        assert_eq!(again.as_ref().unwrap_err().errno, libc::ENOENT);
        fs.settle_resent_rename(true, ROOT_INO, "c", again)
            .await
            .unwrap();
        // Source and destination both missing: a real ENOENT.
        let r = fs.rename(ROOT_INO, "zz", ROOT_INO, "yy", 0).await;
        let r = fs.settle_resent_rename(true, ROOT_INO, "yy", r).await;
        assert_eq!(r.unwrap_err().errno, libc::ENOENT);
    }

    #[tokio::test]
    async fn first_runs_pass_through_untouched() {
        let fs = fs();
        fs.mkdir(ROOT_INO, "d", 0o755, 0, 0, 0).await.unwrap();
        let again = fs.mkdir(ROOT_INO, "d", 0o755, 0, 0, 0).await;
        let r = fs
            .settle_resent_create(false, ROOT_INO, "d", Some(Kind::Dir), again)
            .await;
        assert_eq!(r.unwrap_err().errno, libc::EEXIST);
        let r = fs.rmdir(ROOT_INO, "nothing").await;
        assert_eq!(
            fs.settle_resent_remove(false, "nothing", r)
                .unwrap_err()
                .errno,
            libc::ENOENT
        );
        let r = fs.rename(ROOT_INO, "zz", ROOT_INO, "d", 0).await;
        let r = fs.settle_resent_rename(false, ROOT_INO, "d", r).await;
        assert_eq!(r.unwrap_err().errno, libc::ENOENT);
    }
}
