//! Volume-server HTTP client: assign + raw-body upload, ranged/whole chunk reads with replica
//! failover, gzip, AES-256-GCM, JWT, a volume-location cache and the `volumeServerAccess` modes.
//!
//! [`ChunkStore`] is the seam the filesystem uses; [`http::VolumeClient`] is the real client and
//! [`mock::MockChunkStore`] an in-memory double.

pub mod chunkbuf;
pub mod cipher;
pub mod compress;
pub mod fid;
pub mod fidpool;
pub mod http;
pub mod jwt;
pub mod location;
pub mod md5stream;
pub mod md5x;
pub mod mock;

use crate::pb::filer as pb;
use async_trait::async_trait;
use bytes::Bytes;

/// Errors of the volume layer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VolumeError {
    #[error("invalid file id {0:?}")]
    InvalidFileId(String),
    #[error("assign failed: {0}")]
    Assign(String),
    #[error("upload of {fid} failed: {msg}")]
    Upload { fid: String, msg: String },
    #[error("chunk {fid} not found on any replica")]
    NotFound { fid: String },
    #[error("volume {0} has no known location")]
    NoLocation(u32),
    #[error("read of {fid} failed: {msg}")]
    Read { fid: String, msg: String },
    #[error("chunk {fid} is corrupt: {msg}")]
    Corrupt { fid: String, msg: String },
    #[error("unauthorized ({0}): check the JWT keys in security.toml")]
    Unauthorized(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl VolumeError {
    pub fn errno(&self) -> i32 {
        match self {
            VolumeError::Unauthorized(_) => libc::EACCES,
            VolumeError::Unsupported(_) => libc::ENOTSUP,
            VolumeError::InvalidFileId(_) => libc::EINVAL,
            _ => libc::EIO,
        }
    }
}

pub type Result<T, E = VolumeError> = std::result::Result<T, E>;

/// Where and how a new chunk is stored (the AssignVolume parameters).
#[derive(Debug, Clone, Default)]
pub struct UploadOptions {
    pub collection: String,
    pub replication: String,
    pub ttl_sec: i32,
    pub disk_type: String,
    pub data_center: String,
    /// Full filer path of the file the chunk belongs to (filer.conf path rules).
    pub path: String,
    /// Encrypt with AES-256-GCM (filer `cipher`).
    pub cipher: bool,
    /// Some(`md5x::generation()` when the chunk was sealed): nobody waits for it yet (a full
    /// chunk written in passing, not one a flush sealed), so the store may hold it for a few
    /// milliseconds to hash it with others, unless `expedite` is called after that.
    pub may_wait: Option<u64>,
    /// The chunk's bytes hashed as they were written (a file that fsyncs often); its digest
    /// saves the upload hashing them, when it covers them all.
    pub md5: Option<md5stream::Stream>,
    /// The file fsyncs often, so a flush waits for this upload: a file id reserved earlier
    /// for its directory saves it the assign (see `fidpool`).
    pub syncs: bool,
}

/// Chunk storage as the filesystem sees it.
#[async_trait]
pub trait ChunkStore: Send + Sync + 'static {
    /// Assigns a fid and uploads `data`, retrying and re-assigning on failure. Returns a chunk
    /// with `file_id`, `fid`, `size`, `e_tag`, `cipher_key`, `is_compressed` set; the caller sets
    /// `offset` and `modified_ts_ns`.
    async fn upload(&self, data: Bytes, opts: &UploadOptions) -> Result<pb::FileChunk>;

    /// The whole clear content of a chunk's needle (decrypted, gunzipped). May be longer than
    /// `chunk.size` after a truncate; callers slice.
    async fn fetch_chunk(&self, chunk: &pb::FileChunk) -> Result<Bytes>;

    /// `len` clear bytes starting at `offset` within the chunk's needle. Uses an HTTP Range
    /// request when the chunk is neither encrypted nor compressed.
    async fn fetch_range(&self, chunk: &pb::FileChunk, offset: u64, len: u64) -> Result<Bytes>;

    /// Deletes needles this client uploaded that no filer entry references (runs overwritten
    /// or truncated before their commit, files unlinked before it). Best effort: what is left
    /// is found by `volume.fsck`. Only call it for chunks no entry can reference.
    async fn delete_chunks(&self, file_ids: &[String]) -> Result<()>;

    /// Someone is about to wait for the uploads started so far (a flush): stop holding any of
    /// them back for batching.
    fn expedite(&self) {}

    /// The most uploads this store holds back to hash together (1: it holds none back).
    /// While fewer are waiting, they wait up to a batching delay unless [`Self::expedite`]d.
    fn batch_width(&self) -> usize {
        1
    }
}
