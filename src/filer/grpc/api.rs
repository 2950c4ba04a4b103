//! [`FilerApi`] for [`GrpcFiler`]: each call signed, sent over the mutation stream when it can
//! be, otherwise as a unary RPC through the failover loop, and its errors typed.

use std::sync::atomic::Ordering;

use futures::{StreamExt, TryStreamExt};

use super::errors::{
    create_err, delete_err, is_not_found_msg, is_precondition_msg, is_transport, rename_err,
    rename_text_err, status_err, update_err,
};
use super::GrpcFiler;
use crate::filer::{FilerApi, FilerError, MetadataStream, Result};
use crate::pb::filer as pb;
use pb::stream_mutate_entry_request::Request as MutReq;
use pb::stream_mutate_entry_response::Response as MutResp;

impl GrpcFiler {
    fn sign(&self, signatures: &mut Vec<i32>) {
        if signatures.is_empty() {
            signatures.push(self.inner.signature);
        }
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// Error text (and errno) of a stream response, top-level or nested.
fn stream_error(rs: &[pb::StreamMutateEntryResponse]) -> Option<String> {
    rs.iter()
        .find(|r| !r.error.is_empty())
        .map(|r| format!("{} (errno {})", r.error, r.errno))
}

#[async_trait::async_trait]
impl FilerApi for GrpcFiler {
    async fn lookup_entry(&self, dir: &str, name: &str) -> Result<pb::Entry> {
        let path = join(dir, name);
        self.call("lookup", |mut c| {
            let req = pb::LookupDirectoryEntryRequest {
                directory: dir.to_string(),
                name: name.to_string(),
            };
            let path = path.clone();
            async move {
                match c.lookup_directory_entry(req).await {
                    Ok(r) => r.into_inner().entry.ok_or(FilerError::NotFound(path)),
                    Err(s) if !is_transport(&s) && s.message().contains("no entry is found") => {
                        Err(FilerError::NotFound(path))
                    }
                    Err(s) => Err(status_err("lookup", s)),
                }
            }
        })
        .await
    }

    async fn list_page(
        &self,
        dir: &str,
        start_from: &str,
        inclusive: bool,
        limit: u32,
    ) -> Result<Vec<pb::Entry>> {
        self.call("list", |mut c| {
            let req = pb::ListEntriesRequest {
                directory: dir.to_string(),
                start_from_file_name: start_from.to_string(),
                inclusive_start_from: inclusive,
                limit,
                ..Default::default()
            };
            async move {
                let mut s = c
                    .list_entries(req)
                    .await
                    .map_err(|s| status_err("list", s))?
                    .into_inner();
                let mut out = Vec::new();
                while let Some(r) = s.message().await.map_err(|s| status_err("list", s))? {
                    if let Some(e) = r.entry {
                        out.push(e);
                    }
                }
                Ok(out)
            }
        })
        .await
    }

    async fn create_entry(
        &self,
        mut req: pb::CreateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        self.sign(&mut req.signatures);
        let path = join(
            &req.directory,
            req.entry.as_ref().map(|e| e.name.as_str()).unwrap_or(""),
        );
        if let Some(rs) = self
            .stream_mutate(MutReq::CreateRequest(req.clone()))
            .await?
        {
            let cr = rs.iter().find_map(|r| match &r.response {
                Some(MutResp::CreateResponse(c)) => Some(c.clone()),
                _ => None,
            });
            if let Some(c) = &cr {
                if !c.error.is_empty() || c.error_code != 0 {
                    return Err(create_err(&path, c.error_code(), &c.error));
                }
            }
            if let Some(e) = stream_error(&rs) {
                return Err(create_err(&path, pb::FilerError::Ok, &e));
            }
            return Ok(cr.and_then(|c| c.metadata_event).map(full_event));
        }
        self.inner.unary_count.fetch_add(1, Ordering::Relaxed);
        self.call("create", |mut c| {
            let req = req.clone();
            let path = path.clone();
            async move {
                let r = c
                    .create_entry(req)
                    .await
                    .map_err(|s| status_err("create", s))?
                    .into_inner();
                if !r.error.is_empty() || r.error_code != 0 {
                    return Err(create_err(&path, r.error_code(), &r.error));
                }
                Ok(r.metadata_event.map(full_event))
            }
        })
        .await
    }

    async fn update_entry(
        &self,
        mut req: pb::UpdateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        self.sign(&mut req.signatures);
        let path = join(
            &req.directory,
            req.entry.as_ref().map(|e| e.name.as_str()).unwrap_or(""),
        );
        if let Some(rs) = self
            .stream_mutate(MutReq::UpdateRequest(req.clone()))
            .await?
        {
            if let Some(e) = stream_error(&rs) {
                let err = if is_precondition_msg(&e) {
                    FilerError::Changed(format!("update {path}: {e}"))
                } else if is_not_found_msg(&e) {
                    FilerError::NotFound(format!("update {path}: {e}"))
                } else {
                    FilerError::Other(format!("update {path}: {e}"))
                };
                return Err(err);
            }
            return Ok(rs.into_iter().find_map(|r| match r.response {
                Some(MutResp::UpdateResponse(u)) => u.metadata_event.map(full_event),
                _ => None,
            }));
        }
        self.inner.unary_count.fetch_add(1, Ordering::Relaxed);
        self.call("update", |mut c| {
            let req = req.clone();
            let path = path.clone();
            async move {
                let r = c
                    .update_entry(req)
                    .await
                    .map_err(|s| update_err(&path, s))?
                    .into_inner();
                Ok(r.metadata_event.map(full_event))
            }
        })
        .await
    }

    async fn delete_entry(
        &self,
        mut req: pb::DeleteEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        self.sign(&mut req.signatures);
        let path = join(&req.directory, &req.name);
        if let Some(rs) = self
            .stream_mutate(MutReq::DeleteRequest(req.clone()))
            .await?
        {
            let dr = rs.iter().find_map(|r| match &r.response {
                Some(MutResp::DeleteResponse(d)) => Some(d.clone()),
                _ => None,
            });
            if let Some(d) = &dr {
                if !d.error.is_empty() {
                    return Err(delete_err(&path, &d.error));
                }
            }
            if let Some(e) = stream_error(&rs) {
                return Err(delete_err(&path, &e));
            }
            return Ok(dr.and_then(|d| d.metadata_event));
        }
        self.inner.unary_count.fetch_add(1, Ordering::Relaxed);
        self.call("delete", |mut c| {
            let req = req.clone();
            let path = path.clone();
            async move {
                let r = c
                    .delete_entry(req)
                    .await
                    .map_err(|s| status_err("delete", s))?
                    .into_inner();
                if !r.error.is_empty() {
                    return Err(delete_err(&path, &r.error));
                }
                Ok(r.metadata_event)
            }
        })
        .await
    }

    async fn rename_entry(
        &self,
        mut req: pb::StreamRenameEntryRequest,
    ) -> Result<Vec<pb::StreamRenameEntryResponse>> {
        self.sign(&mut req.signatures);
        let what = format!(
            "{} -> {}",
            join(&req.old_directory, &req.old_name),
            join(&req.new_directory, &req.new_name)
        );
        if let Some(rs) = self
            .stream_mutate(MutReq::RenameRequest(req.clone()))
            .await?
        {
            if let Some(e) = stream_error(&rs) {
                return Err(rename_text_err(&what, &e));
            }
            return Ok(rs
                .into_iter()
                .filter_map(|r| match r.response {
                    Some(MutResp::RenameResponse(x)) if x.event_notification.is_some() => Some(x),
                    _ => None,
                })
                .collect());
        }
        self.inner.unary_count.fetch_add(1, Ordering::Relaxed);
        self.call("rename", |mut c| {
            let req = req.clone();
            let what = what.clone();
            async move {
                let mut s = c
                    .stream_rename_entry(req)
                    .await
                    .map_err(|s| rename_err(&what, s))?
                    .into_inner();
                let mut out = Vec::new();
                while let Some(r) = s.message().await.map_err(|s| rename_err(&what, s))? {
                    if r.event_notification.is_some() {
                        out.push(r);
                    }
                }
                Ok(out)
            }
        })
        .await
    }

    async fn assign_volume(
        &self,
        req: pb::AssignVolumeRequest,
    ) -> Result<pb::AssignVolumeResponse> {
        self.call("assign", |mut c| {
            let req = req.clone();
            async move {
                let r = c
                    .assign_volume(req)
                    .await
                    .map_err(|s| status_err("assign", s))?
                    .into_inner();
                if !r.error.is_empty() {
                    return Err(FilerError::Other(format!("assign volume: {}", r.error)));
                }
                if r.file_id.is_empty() {
                    return Err(FilerError::Other("assign volume: empty file id".into()));
                }
                Ok(r)
            }
        })
        .await
    }

    async fn lookup_volume(&self, volume_id: u32) -> Result<Vec<pb::Location>> {
        let vid = volume_id.to_string();
        self.call("lookup volume", |mut c| {
            let vid = vid.clone();
            async move {
                let req = pb::LookupVolumeRequest {
                    volume_ids: vec![vid.clone()],
                };
                let r = match c.lookup_volume(req).await {
                    Ok(r) => r.into_inner(),
                    Err(s) if !is_transport(&s) && is_not_found_msg(s.message()) => {
                        return Err(FilerError::NotFound(format!(
                            "volume {vid}: {}",
                            s.message()
                        )))
                    }
                    Err(s) => return Err(status_err("lookup volume", s)),
                };
                let locs = r
                    .locations_map
                    .get(&vid)
                    .map(|l| l.locations.clone())
                    .unwrap_or_default();
                if locs.is_empty() {
                    return Err(FilerError::NotFound(format!("volume {vid}: no locations")));
                }
                Ok(locs)
            }
        })
        .await
    }

    async fn link_group(&self, id: &[u8]) -> Result<Option<pb::Entry>> {
        use prost::Message;
        self.call("kv get", |mut c| {
            let req = pb::KvGetRequest { key: id.to_vec() };
            async move {
                let r = c
                    .kv_get(req)
                    .await
                    .map_err(|s| status_err("kv get", s))?
                    .into_inner();
                if !r.error.is_empty() {
                    return Err(FilerError::Other(format!("kv get: {}", r.error)));
                }
                if r.value.is_empty() {
                    return Ok(None);
                }
                pb::Entry::decode(r.value.as_slice())
                    .map(Some)
                    .map_err(|e| FilerError::Other(format!("kv get: a link record: {e}")))
            }
        })
        .await
    }

    async fn statistics(&self, req: pb::StatisticsRequest) -> Result<pb::StatisticsResponse> {
        self.call("statistics", |mut c| {
            let req = req.clone();
            async move {
                Ok(c.statistics(req)
                    .await
                    .map_err(|s| status_err("statistics", s))?
                    .into_inner())
            }
        })
        .await
    }

    async fn configuration(&self) -> Result<pb::GetFilerConfigurationResponse> {
        self.call("configuration", |mut c| async move {
            Ok(
                c.get_filer_configuration(pb::GetFilerConfigurationRequest {})
                    .await
                    .map_err(|s| status_err("configuration", s))?
                    .into_inner(),
            )
        })
        .await
    }

    /// Picks a live filer with a cheap unary call, then opens the stream on it. The stream is
    /// opened lazily: the filer sends response headers only with its first event.
    async fn subscribe_once(&self, req: pb::SubscribeMetadataRequest) -> Result<MetadataStream> {
        self.configuration().await?;
        let idx = self.current();
        let mut client = self.inner.targets[idx].client.clone();
        let stream = futures::stream::once(async move {
            client.subscribe_metadata(req).await.map(|r| r.into_inner())
        })
        .try_flatten()
        .map_err(|s| status_err("subscribe", s));
        Ok(stream.boxed())
    }

    fn http_address(&self) -> String {
        self.inner.targets[self.current()].addr.http()
    }

    fn signature(&self) -> i32 {
        self.inner.signature
    }
}

/// A create's or update's event as [`FilerApi`] returns it: its entries carry only their name
/// and kind (see `MutationEvent` in proto/filer.proto: the chunks are not decoded).
///
/// [`FilerApi`]: crate::filer::FilerApi
pub(super) fn full_event(ev: pb::MutationEvent) -> pb::SubscribeMetadataResponse {
    let entry = |e: pb::EntryName| pb::Entry {
        name: e.name,
        is_directory: e.is_directory,
        ..Default::default()
    };
    pb::SubscribeMetadataResponse {
        directory: ev.directory,
        event_notification: ev.event_notification.map(|n| pb::EventNotification {
            old_entry: n.old_entry.map(entry),
            new_entry: n.new_entry.map(entry),
            delete_chunks: n.delete_chunks,
            new_parent_path: n.new_parent_path,
            is_from_other_cluster: n.is_from_other_cluster,
            signatures: n.signatures,
        }),
        ts_ns: ev.ts_ns,
        ..Default::default()
    }
}
