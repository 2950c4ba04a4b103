//! In-memory [`ChunkStore`] for unit tests: needles by generated fid, fetch counters and
//! fault injection (fail the next N uploads or reads).

use super::fid::{chunk_file_id, FileId};
use super::{ChunkStore, Result, UploadOptions, VolumeError};
use crate::pb::filer as pb;
use async_trait::async_trait;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bytes::Bytes;
use md5::{Digest, Md5};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Stores clear bytes; chunks it returns are never compressed or encrypted.
#[derive(Default)]
pub struct MockChunkStore {
    needles: Mutex<HashMap<String, Bytes>>,
    next_key: AtomicU64,
    uploads: AtomicU64,
    whole_fetches: AtomicU64,
    range_fetches: AtomicU64,
    fail_uploads: AtomicU32,
    fail_reads: AtomicU32,
    panic_uploads: AtomicU32,
    streamed: AtomicU64,
    synced: AtomicU64,
    delete_delay: Mutex<std::time::Duration>,
    uploads_paused: AtomicBool,
    resumed: tokio::sync::Notify,
    batch_width: AtomicUsize,
    expedites: AtomicU64,
}

/// Decrements `n` if positive; true if this call should fail.
fn take_fault(n: &AtomicU32) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

impl MockChunkStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn next_fid(&self) -> FileId {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed) + 1;
        FileId {
            volume_id: 1,
            key,
            cookie: (key as u32).wrapping_mul(0x9E37_79B9),
        }
    }

    /// Stores `data` without counting an upload or consulting faults (test setup).
    pub fn insert(&self, data: impl Into<Bytes>) -> pb::FileChunk {
        let data = data.into();
        let fid = self.next_fid();
        let chunk = pb::FileChunk {
            file_id: fid.to_string(),
            fid: Some(fid.to_pb()),
            size: data.len() as u64,
            e_tag: B64.encode(Md5::digest(&data)),
            ..Default::default()
        };
        self.needles.lock().insert(chunk.file_id.clone(), data);
        chunk
    }

    /// Stores raw needle bytes under a given fid.
    pub fn put_raw(&self, fid: &str, data: impl Into<Bytes>) {
        self.needles.lock().insert(fid.to_string(), data.into());
    }

    /// Deletes a needle; later reads of it are `NotFound`.
    pub fn remove(&self, fid: &str) -> bool {
        self.needles.lock().remove(fid).is_some()
    }

    /// Every delete waits this long first (a slow volume server).
    pub fn delay_deletes(&self, d: std::time::Duration) {
        *self.delete_delay.lock() = d;
    }

    /// The next `n` uploads panic (a bug in the upload path, for the tests that nothing
    /// then waits forever).
    pub fn panic_uploads(&self, n: u32) {
        self.panic_uploads.store(n, Ordering::SeqCst);
    }

    pub fn contains(&self, fid: &str) -> bool {
        self.needles.lock().contains_key(fid)
    }

    pub fn len(&self) -> usize {
        self.needles.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The next `n` uploads fail with [`VolumeError::Upload`].
    pub fn fail_next_uploads(&self, n: u32) {
        self.fail_uploads.store(n, Ordering::SeqCst);
    }

    /// The next `n` reads (whole or ranged) fail with [`VolumeError::Read`].
    pub fn fail_next_reads(&self, n: u32) {
        self.fail_reads.store(n, Ordering::SeqCst);
    }

    /// Uploads wait (holding their upload slots) until [`Self::resume_uploads`].
    pub fn pause_uploads(&self) {
        self.uploads_paused.store(true, Ordering::SeqCst);
    }

    pub fn resume_uploads(&self) {
        self.uploads_paused.store(false, Ordering::SeqCst);
        self.resumed.notify_waiters();
    }

    /// What [`ChunkStore::batch_width`] reports from now on (0: the default, 1).
    pub fn set_batch_width(&self, n: usize) {
        self.batch_width.store(n, Ordering::SeqCst);
    }

    /// Calls of [`ChunkStore::expedite`] so far.
    pub fn expedite_count(&self) -> u64 {
        self.expedites.load(Ordering::SeqCst)
    }

    /// Uploads whose MD5 came from the bytes hashed as they were written.
    pub fn streamed_md5_count(&self) -> u64 {
        self.streamed.load(Ordering::Relaxed)
    }

    /// Uploads marked as those of a file that fsyncs often.
    pub fn synced_upload_count(&self) -> u64 {
        self.synced.load(Ordering::Relaxed)
    }

    pub fn upload_count(&self) -> u64 {
        self.uploads.load(Ordering::Relaxed)
    }

    /// Whole-needle plus ranged fetches.
    pub fn fetch_count(&self) -> u64 {
        self.whole_fetches.load(Ordering::Relaxed) + self.range_fetches.load(Ordering::Relaxed)
    }

    pub fn whole_fetch_count(&self) -> u64 {
        self.whole_fetches.load(Ordering::Relaxed)
    }

    pub fn range_fetch_count(&self) -> u64 {
        self.range_fetches.load(Ordering::Relaxed)
    }

    fn get(&self, chunk: &pb::FileChunk) -> Result<Bytes> {
        let fid = chunk_file_id(chunk)?;
        if take_fault(&self.fail_reads) {
            return Err(VolumeError::Read {
                fid,
                msg: "injected read fault".into(),
            });
        }
        self.needles
            .lock()
            .get(&fid)
            .cloned()
            .ok_or(VolumeError::NotFound { fid })
    }
}

#[async_trait]
impl ChunkStore for MockChunkStore {
    async fn upload(&self, data: Bytes, opts: &UploadOptions) -> Result<pb::FileChunk> {
        loop {
            // registered before the check, so a resume in between is not missed
            let resumed = self.resumed.notified();
            if !self.uploads_paused.load(Ordering::SeqCst) {
                break;
            }
            resumed.await;
        }
        self.uploads.fetch_add(1, Ordering::Relaxed);
        if opts.syncs {
            self.synced.fetch_add(1, Ordering::Relaxed);
        }
        // a digest hashed as the bytes were written must be theirs: a volume server refuses
        // a Content-MD5 that does not match what it received
        if let Some(streamed) = &opts.md5 {
            if let Some(d) = streamed.digest(data.len() as u64).await {
                use md5::Digest;
                if d != <[u8; 16]>::from(md5::Md5::digest(&data)) {
                    return Err(VolumeError::Upload {
                        fid: String::new(),
                        msg: "Content-MD5 did not match the data".into(),
                    });
                }
                self.streamed.fetch_add(1, Ordering::Relaxed);
            }
        }
        if take_fault(&self.panic_uploads) {
            panic!("injected upload panic");
        }
        if take_fault(&self.fail_uploads) {
            return Err(VolumeError::Upload {
                fid: String::new(),
                msg: "injected upload fault".into(),
            });
        }
        Ok(self.insert(data))
    }

    async fn fetch_chunk(&self, chunk: &pb::FileChunk) -> Result<Bytes> {
        self.whole_fetches.fetch_add(1, Ordering::Relaxed);
        self.get(chunk)
    }

    async fn fetch_range(&self, chunk: &pb::FileChunk, offset: u64, len: u64) -> Result<Bytes> {
        self.range_fetches.fetch_add(1, Ordering::Relaxed);
        let data = self.get(chunk)?;
        let end = offset.checked_add(len).filter(|e| *e <= data.len() as u64);
        match end {
            Some(end) => Ok(data.slice(offset as usize..end as usize)),
            None => Err(VolumeError::Corrupt {
                fid: chunk.file_id.clone(),
                msg: format!(
                    "range [{offset}, +{len}) beyond needle of {} bytes",
                    data.len()
                ),
            }),
        }
    }

    async fn delete_chunks(&self, file_ids: &[String]) -> Result<()> {
        let delay = *self.delete_delay.lock();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        for f in file_ids {
            self.remove(f);
        }
        Ok(())
    }

    fn expedite(&self) {
        self.expedites.fetch_add(1, Ordering::SeqCst);
    }

    fn batch_width(&self) -> usize {
        self.batch_width.load(Ordering::SeqCst).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_counts_and_faults() {
        let m = MockChunkStore::new();
        let c = m
            .upload(
                Bytes::from_static(b"hello world"),
                &UploadOptions::default(),
            )
            .await
            .unwrap();
        assert_eq!(c.size, 11);
        assert!(FileId::parse(&c.file_id).is_ok());
        assert_eq!(&m.fetch_chunk(&c).await.unwrap()[..], b"hello world");
        assert_eq!(&m.fetch_range(&c, 6, 5).await.unwrap()[..], b"world");
        assert!(matches!(
            m.fetch_range(&c, 6, 6).await,
            Err(VolumeError::Corrupt { .. })
        ));
        assert_eq!(
            (
                m.upload_count(),
                m.whole_fetch_count(),
                m.range_fetch_count()
            ),
            (1, 1, 2)
        );

        m.fail_next_uploads(2);
        assert!(m
            .upload(Bytes::from_static(b"x"), &UploadOptions::default())
            .await
            .is_err());
        assert!(m
            .upload(Bytes::from_static(b"x"), &UploadOptions::default())
            .await
            .is_err());
        let c2 = m
            .upload(Bytes::from_static(b"x"), &UploadOptions::default())
            .await
            .unwrap();
        assert_ne!(c2.file_id, c.file_id);

        m.fail_next_reads(1);
        assert!(matches!(
            m.fetch_chunk(&c).await,
            Err(VolumeError::Read { .. })
        ));
        assert!(m.fetch_chunk(&c).await.is_ok());

        // A chunk addressed only by its fid message works too.
        let by_fid = pb::FileChunk {
            fid: c.fid,
            ..Default::default()
        };
        assert_eq!(&m.fetch_chunk(&by_fid).await.unwrap()[..], b"hello world");

        assert!(m.remove(&c.file_id));
        assert!(matches!(
            m.fetch_chunk(&c).await,
            Err(VolumeError::NotFound { .. })
        ));
        assert!(matches!(
            m.fetch_chunk(&pb::FileChunk::default()).await,
            Err(VolumeError::InvalidFileId(_))
        ));
    }
}
