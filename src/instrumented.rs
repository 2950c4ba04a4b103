//! Decorators that time every call of a backend into the metrics registry, so the backends
//! themselves stay free of metrics code.

use crate::filer::{FilerApi, MetadataStream, Result as FilerResult};
use crate::metrics;
use crate::pb::filer as pb;
use crate::volume::{ChunkStore, Result as VolumeResult, UploadOptions};
use async_trait::async_trait;
use bytes::Bytes;
use std::future::Future;
use std::sync::{Arc, OnceLock};

/// Awaits `$fut` timed into the global series `$family($label)` (a [`metrics::Metrics`]
/// method). Each call site finds its series once and keeps it in a static, so a call costs a
/// few atomic adds and no lock.
macro_rules! timed {
    ($family:ident, $label:literal, $fut:expr $(,)?) => {{
        static SERIES: OnceLock<metrics::Series> = OnceLock::new();
        let series = SERIES.get_or_init(|| metrics::global().$family($label));
        record(series, $fut).await
    }};
}

async fn record<T, E>(
    series: &metrics::Series,
    f: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let t = series.start();
    let r = f.await;
    if r.is_err() {
        t.failed();
    }
    r
}

/// A [`FilerApi`] whose calls are recorded as `seaweedfs_csi_filer_rpc_seconds{method}`.
pub struct InstrumentedFiler(pub Arc<dyn FilerApi>);

#[async_trait]
impl FilerApi for InstrumentedFiler {
    async fn lookup_entry(&self, dir: &str, name: &str) -> FilerResult<pb::Entry> {
        timed!(
            filer_rpc,
            "LookupDirectoryEntry",
            self.0.lookup_entry(dir, name),
        )
    }
    async fn list_page(
        &self,
        dir: &str,
        start_from: &str,
        inclusive: bool,
        limit: u32,
    ) -> FilerResult<Vec<pb::Entry>> {
        timed!(
            filer_rpc,
            "ListEntries",
            self.0.list_page(dir, start_from, inclusive, limit),
        )
    }
    async fn create_entry(
        &self,
        req: pb::CreateEntryRequest,
    ) -> FilerResult<Option<pb::SubscribeMetadataResponse>> {
        timed!(filer_rpc, "CreateEntry", self.0.create_entry(req))
    }
    async fn update_entry(
        &self,
        req: pb::UpdateEntryRequest,
    ) -> FilerResult<Option<pb::SubscribeMetadataResponse>> {
        timed!(filer_rpc, "UpdateEntry", self.0.update_entry(req))
    }
    async fn delete_entry(
        &self,
        req: pb::DeleteEntryRequest,
    ) -> FilerResult<Option<pb::SubscribeMetadataResponse>> {
        timed!(filer_rpc, "DeleteEntry", self.0.delete_entry(req))
    }
    async fn rename_entry(
        &self,
        req: pb::StreamRenameEntryRequest,
    ) -> FilerResult<Vec<pb::StreamRenameEntryResponse>> {
        timed!(filer_rpc, "StreamRenameEntry", self.0.rename_entry(req))
    }
    async fn assign_volume(
        &self,
        req: pb::AssignVolumeRequest,
    ) -> FilerResult<pb::AssignVolumeResponse> {
        timed!(filer_rpc, "AssignVolume", self.0.assign_volume(req))
    }
    async fn lookup_volume(&self, volume_id: u32) -> FilerResult<Vec<pb::Location>> {
        timed!(filer_rpc, "LookupVolume", self.0.lookup_volume(volume_id))
    }
    async fn statistics(&self, req: pb::StatisticsRequest) -> FilerResult<pb::StatisticsResponse> {
        timed!(filer_rpc, "Statistics", self.0.statistics(req))
    }
    async fn link_group(&self, id: &[u8]) -> FilerResult<Option<pb::Entry>> {
        timed!(filer_rpc, "KvGet", self.0.link_group(id))
    }
    async fn configuration(&self) -> FilerResult<pb::GetFilerConfigurationResponse> {
        timed!(filer_rpc, "GetFilerConfiguration", self.0.configuration())
    }
    async fn subscribe_once(
        &self,
        req: pb::SubscribeMetadataRequest,
    ) -> FilerResult<MetadataStream> {
        timed!(filer_rpc, "SubscribeMetadata", self.0.subscribe_once(req))
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
        timed!(volume_request, "upload", self.0.upload(data, opts))
    }
    fn expedite(&self) {
        self.0.expedite()
    }
    fn batch_width(&self) -> usize {
        self.0.batch_width()
    }
    async fn fetch_chunk(&self, chunk: &pb::FileChunk) -> VolumeResult<Bytes> {
        timed!(volume_request, "read_chunk", self.0.fetch_chunk(chunk))
    }
    async fn fetch_range(
        &self,
        chunk: &pb::FileChunk,
        offset: u64,
        len: u64,
    ) -> VolumeResult<Bytes> {
        timed!(
            volume_request,
            "read_range",
            self.0.fetch_range(chunk, offset, len)
        )
    }
    async fn delete_chunks(&self, file_ids: &[String]) -> VolumeResult<()> {
        timed!(volume_request, "delete", self.0.delete_chunks(file_ids))
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
