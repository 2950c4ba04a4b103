//! Decorators that time every call of a backend into the metrics registry, so the backends
//! themselves stay free of metrics code.

use crate::filer::{FilerApi, MetadataStream, Result as FilerResult};
use crate::metrics;
use crate::pb::filer as pb;
use crate::volume::{ChunkStore, Result as VolumeResult, UploadOptions};
use async_trait::async_trait;
use bytes::Bytes;
use std::future::Future;
use std::sync::Arc;

async fn timed<T, E>(
    family: &'static str,
    label: &'static str,
    f: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let t = metrics::timer(family, label);
    let r = f.await;
    if r.is_err() {
        t.failed();
    }
    r
}

const FILER: &str = "seaweedfs_csi_filer_rpc";
const VOLUME: &str = "seaweedfs_csi_volume_request";

/// A [`FilerApi`] whose calls are recorded as `seaweedfs_csi_filer_rpc_seconds{method}`.
pub struct InstrumentedFiler(pub Arc<dyn FilerApi>);

#[async_trait]
impl FilerApi for InstrumentedFiler {
    async fn lookup_entry(&self, dir: &str, name: &str) -> FilerResult<pb::Entry> {
        timed(
            FILER,
            "LookupDirectoryEntry",
            self.0.lookup_entry(dir, name),
        )
        .await
    }
    async fn list_page(
        &self,
        dir: &str,
        start_from: &str,
        inclusive: bool,
        limit: u32,
    ) -> FilerResult<Vec<pb::Entry>> {
        timed(
            FILER,
            "ListEntries",
            self.0.list_page(dir, start_from, inclusive, limit),
        )
        .await
    }
    async fn create_entry(
        &self,
        req: pb::CreateEntryRequest,
    ) -> FilerResult<Option<pb::SubscribeMetadataResponse>> {
        timed(FILER, "CreateEntry", self.0.create_entry(req)).await
    }
    async fn update_entry(
        &self,
        req: pb::UpdateEntryRequest,
    ) -> FilerResult<Option<pb::SubscribeMetadataResponse>> {
        timed(FILER, "UpdateEntry", self.0.update_entry(req)).await
    }
    async fn delete_entry(
        &self,
        req: pb::DeleteEntryRequest,
    ) -> FilerResult<Option<pb::SubscribeMetadataResponse>> {
        timed(FILER, "DeleteEntry", self.0.delete_entry(req)).await
    }
    async fn rename_entry(
        &self,
        req: pb::StreamRenameEntryRequest,
    ) -> FilerResult<Vec<pb::StreamRenameEntryResponse>> {
        timed(FILER, "StreamRenameEntry", self.0.rename_entry(req)).await
    }
    async fn assign_volume(
        &self,
        req: pb::AssignVolumeRequest,
    ) -> FilerResult<pb::AssignVolumeResponse> {
        timed(FILER, "AssignVolume", self.0.assign_volume(req)).await
    }
    async fn lookup_volume(&self, volume_id: u32) -> FilerResult<Vec<pb::Location>> {
        timed(FILER, "LookupVolume", self.0.lookup_volume(volume_id)).await
    }
    async fn statistics(&self, req: pb::StatisticsRequest) -> FilerResult<pb::StatisticsResponse> {
        timed(FILER, "Statistics", self.0.statistics(req)).await
    }
    async fn configuration(&self) -> FilerResult<pb::GetFilerConfigurationResponse> {
        timed(FILER, "GetFilerConfiguration", self.0.configuration()).await
    }
    async fn subscribe_once(
        &self,
        req: pb::SubscribeMetadataRequest,
    ) -> FilerResult<MetadataStream> {
        timed(FILER, "SubscribeMetadata", self.0.subscribe_once(req)).await
    }
    fn http_address(&self) -> String {
        self.0.http_address()
    }
    fn signature(&self) -> i32 {
        self.0.signature()
    }
}

/// A [`ChunkStore`] whose requests are recorded as `seaweedfs_csi_volume_request_seconds{kind}`.
pub struct InstrumentedStore(pub Arc<dyn ChunkStore>);

#[async_trait]
impl ChunkStore for InstrumentedStore {
    async fn upload(&self, data: Bytes, opts: &UploadOptions) -> VolumeResult<pb::FileChunk> {
        timed(VOLUME, "upload", self.0.upload(data, opts)).await
    }
    async fn fetch_chunk(&self, chunk: &pb::FileChunk) -> VolumeResult<Bytes> {
        timed(VOLUME, "read_chunk", self.0.fetch_chunk(chunk)).await
    }
    async fn fetch_range(
        &self,
        chunk: &pb::FileChunk,
        offset: u64,
        len: u64,
    ) -> VolumeResult<Bytes> {
        timed(VOLUME, "read_range", self.0.fetch_range(chunk, offset, len)).await
    }
    async fn delete_chunks(&self, file_ids: &[String]) -> VolumeResult<()> {
        timed(VOLUME, "delete", self.0.delete_chunks(file_ids)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filer::mock::MockFiler;

    #[tokio::test]
    async fn filer_calls_are_counted_with_errors() {
        let f = InstrumentedFiler(Arc::new(MockFiler::new()));
        let before = metrics::global().render();
        assert!(f.lookup_entry("/", "missing").await.is_err());
        let after = metrics::global().render();
        let count = |s: &str| {
            s.lines()
                .find(|l| {
                    l.starts_with(
                        "seaweedfs_csi_filer_rpc_errors_total{method=\"LookupDirectoryEntry\"}",
                    )
                })
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        assert!(count(&after) > count(&before), "{after}");
    }
}
