//! Filer gRPC client (`filer_pb.SeaweedFiler`).
//!
//! [`FilerApi`] is the seam every upper layer uses; [`grpc::GrpcFiler`] is the real client and
//! [`mock::MockFiler`] an in-memory test double with the same semantics for unit tests.

pub mod addr;
pub mod grpc;
pub mod hub;
pub mod mock;
pub mod subscribe;

use crate::pb::filer as pb;
use async_trait::async_trait;
use futures::stream::BoxStream;

/// Errors of the filer layer. Not-found is a variant, never a string to grep.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FilerError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    #[error("directory not empty: {0}")]
    NotEmpty(String),
    #[error("not a directory: {0}")]
    NotADirectory(String),
    #[error("is a directory: {0}")]
    IsADirectory(String),
    #[error("name too long: {0}")]
    NameTooLong(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("filer unavailable: {0}")]
    Unavailable(String),
    #[error("filer call timed out: {0}")]
    Timeout(String),
    /// A write's [`pb::WriteCondition`] did not hold: the stored entry changed since it was
    /// read (the caller reads it again and retries).
    #[error("entry changed meanwhile: {0}")]
    Changed(String),
    #[error("filer error: {0}")]
    Other(String),
}

impl FilerError {
    /// The errno a filesystem operation should return for this error.
    pub fn errno(&self) -> i32 {
        match self {
            FilerError::NotFound(_) => libc::ENOENT,
            FilerError::AlreadyExists(_) => libc::EEXIST,
            FilerError::NotEmpty(_) => libc::ENOTEMPTY,
            FilerError::NotADirectory(_) => libc::ENOTDIR,
            FilerError::IsADirectory(_) => libc::EISDIR,
            FilerError::NameTooLong(_) => libc::ENAMETOOLONG,
            FilerError::InvalidArgument(_) => libc::EINVAL,
            FilerError::Unavailable(_)
            | FilerError::Timeout(_)
            | FilerError::Changed(_)
            | FilerError::Other(_) => libc::EIO,
        }
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, FilerError::NotFound(_))
    }
}

pub type Result<T, E = FilerError> = std::result::Result<T, E>;

/// Stream of raw subscription messages (one connection; see [`subscribe`] for reconnects).
pub type MetadataStream = BoxStream<'static, Result<pb::SubscribeMetadataResponse>>;

/// What the rest of the driver needs from a filer. Implemented by the real gRPC client with
/// failover across several filers, and by an in-memory double for tests.
#[async_trait]
pub trait FilerApi: Send + Sync + 'static {
    /// `LookupDirectoryEntry`; a missing entry is [`FilerError::NotFound`].
    async fn lookup_entry(&self, dir: &str, name: &str) -> Result<pb::Entry>;

    /// One page of `ListEntries`, sorted by name, starting after `start_from`
    /// (or at it when `inclusive`). A missing directory lists as empty.
    async fn list_page(
        &self,
        dir: &str,
        start_from: &str,
        inclusive: bool,
        limit: u32,
    ) -> Result<Vec<pb::Entry>>;

    /// Every entry of a directory, paged.
    async fn list_all(&self, dir: &str) -> Result<Vec<pb::Entry>> {
        self.list_upto(dir, usize::MAX).await
    }

    /// The first `max` entries of a directory (fewer: that is all of it), paged: a caller
    /// that only wants to know whether a directory is small reads no more than that.
    async fn list_upto(&self, dir: &str, max: usize) -> Result<Vec<pb::Entry>> {
        const PAGE: usize = 1024;
        let mut out: Vec<pb::Entry> = Vec::new();
        loop {
            let want = (max - out.len()).min(PAGE);
            if want == 0 {
                return Ok(out);
            }
            let start = out.last().map(|e| e.name.clone()).unwrap_or_default();
            let page = self.list_page(dir, &start, false, want as u32).await?;
            let n = page.len();
            out.extend(page);
            if n < want {
                return Ok(out);
            }
        }
    }

    /// `CreateEntry` (preferably over `StreamMutateEntry`). In-band errors are mapped to
    /// typed errors. Returns the logged event, if any (from a real filer its entries carry
    /// only their name and kind: a commit's reply lists every chunk twice, left undecoded).
    async fn create_entry(
        &self,
        req: pb::CreateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>>;

    /// `UpdateEntry`. A missing entry is [`FilerError::NotFound`]. The event as for
    /// [`Self::create_entry`].
    async fn update_entry(
        &self,
        req: pb::UpdateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>>;

    /// `DeleteEntry`. Deleting a missing entry succeeds. A non-empty directory is
    /// [`FilerError::NotEmpty`].
    async fn delete_entry(
        &self,
        req: pb::DeleteEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>>;

    /// `StreamRenameEntry` (or the stream-mutate equivalent). Returns the events for every moved entry.
    async fn rename_entry(
        &self,
        req: pb::StreamRenameEntryRequest,
    ) -> Result<Vec<pb::StreamRenameEntryResponse>>;

    /// `AssignVolume`; an in-band `error` becomes an error.
    async fn assign_volume(&self, req: pb::AssignVolumeRequest)
        -> Result<pb::AssignVolumeResponse>;

    /// `LookupVolume` for one volume id (the filer fails a whole batch on one unknown id).
    async fn lookup_volume(&self, volume_id: u32) -> Result<Vec<pb::Location>>;

    /// `Statistics`.
    async fn statistics(&self, req: pb::StatisticsRequest) -> Result<pb::StatisticsResponse>;

    /// A hard link group's shared record (`KvGet` of its `hard_link_id`: the entry every
    /// name of the group reads its content and link count from); `None` once the group's
    /// last name is gone.
    async fn link_group(&self, _id: &[u8]) -> Result<Option<pb::Entry>> {
        Err(FilerError::Other("link groups cannot be read here".into()))
    }

    /// `GetFilerConfiguration`.
    async fn configuration(&self) -> Result<pb::GetFilerConfigurationResponse>;

    /// Opens one `SubscribeMetadata` stream on the current filer.
    async fn subscribe_once(&self, req: pb::SubscribeMetadataRequest) -> Result<MetadataStream>;

    /// HTTP address (`host:port`) of the filer currently in use (filerProxy reads, tests).
    fn http_address(&self) -> String;

    /// This client's signature, put in `signatures` of every mutation so the subscription
    /// filters out our own events.
    fn signature(&self) -> i32;
}
