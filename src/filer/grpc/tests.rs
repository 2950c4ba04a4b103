//! Tests against an in-process fake filer, for stream-mutate edge cases the real one won't
//! produce (Unimplemented, answers out of order, a broken stream, a hung call).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};

use super::{FilerClientOptions, GrpcFiler, MutationCounts};
use crate::filer::{FilerApi, FilerError};
use crate::pb::filer as pb;
use pb::seaweed_filer_server::{SeaweedFiler, SeaweedFilerServer};
use pb::stream_mutate_entry_request::Request as MutReq;
use pb::stream_mutate_entry_response::Response as MutResp;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// StreamMutateEntry is Unimplemented (pre-4.18 filer).
    Unimplemented,
    /// Answers requests in pairs, in reverse order, interleaving rename events.
    Reverse,
    /// Reads one request and breaks the stream without answering.
    Break,
    /// Unary lookups never answer.
    Hang,
}

#[derive(Clone)]
struct Fake {
    mode: Mode,
    stream_calls: Arc<AtomicU64>,
    unary_creates: Arc<AtomicU64>,
}

type S<T> = BoxStream<'static, std::result::Result<T, Status>>;
type R<T> = std::result::Result<Response<T>, Status>;

fn created(name: &str, sigs: Vec<i32>) -> pb::SubscribeMetadataResponse {
    pb::SubscribeMetadataResponse {
        directory: "/".into(),
        event_notification: Some(pb::EventNotification {
            new_entry: Some(pb::Entry {
                name: name.into(),
                ..Default::default()
            }),
            signatures: sigs,
            ..Default::default()
        }),
        ts_ns: 1,
        ..Default::default()
    }
}

/// `created` as a mutation's reply carries it, read by the client as a `MutationEvent`.
fn created_reply(name: &str, sigs: Vec<i32>) -> pb::MutationEvent {
    let ev = created(name, sigs);
    let n = ev.event_notification.unwrap_or_default();
    pb::MutationEvent {
        directory: ev.directory,
        event_notification: Some(pb::MutationNotification {
            new_entry: n.new_entry.map(|e| pb::EntryName {
                name: e.name,
                is_directory: e.is_directory,
            }),
            signatures: n.signatures,
            ..Default::default()
        }),
        ts_ns: ev.ts_ns,
    }
}

fn answers(req: pb::StreamMutateEntryRequest) -> Vec<pb::StreamMutateEntryResponse> {
    let id = req.request_id;
    let resp = |response, is_last| pb::StreamMutateEntryResponse {
        request_id: id,
        is_last,
        response,
        ..Default::default()
    };
    match req.request {
        Some(MutReq::CreateRequest(c)) => {
            let name = c.entry.map(|e| e.name).unwrap_or_default();
            let cr = pb::CreateEntryResponse {
                metadata_event: Some(created_reply(&name, c.signatures)),
                ..Default::default()
            };
            vec![resp(Some(MutResp::CreateResponse(cr)), true)]
        }
        Some(MutReq::RenameRequest(r)) => {
            let ev = |n: &str| {
                Some(MutResp::RenameResponse(pb::StreamRenameEntryResponse {
                    directory: r.old_directory.clone(),
                    event_notification: created(n, vec![]).event_notification,
                    ts_ns: 2,
                }))
            };
            vec![
                resp(ev(&r.new_name), false),
                resp(ev(&format!("{}-child", r.new_name)), false),
                resp(None, true),
            ]
        }
        Some(MutReq::DeleteRequest(_)) => vec![pb::StreamMutateEntryResponse {
            request_id: id,
            is_last: true,
            error: "fail to delete non-empty folder: /d".into(),
            errno: 39,
            ..Default::default()
        }],
        _ => vec![resp(None, true)],
    }
}

#[tonic::async_trait]
impl SeaweedFiler for Fake {
    type ListEntriesStream = S<pb::ListEntriesResponse>;
    type StreamRenameEntryStream = S<pb::StreamRenameEntryResponse>;
    type StreamMutateEntryStream = S<pb::StreamMutateEntryResponse>;
    type SubscribeMetadataStream = S<pb::SubscribeMetadataResponse>;

    async fn lookup_directory_entry(
        &self,
        r: Request<pb::LookupDirectoryEntryRequest>,
    ) -> R<pb::LookupDirectoryEntryResponse> {
        if self.mode == Mode::Hang {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        let name = r.into_inner().name;
        Ok(Response::new(pb::LookupDirectoryEntryResponse {
            entry: Some(pb::Entry {
                name,
                ..Default::default()
            }),
            ..Default::default()
        }))
    }
    async fn create_entry(&self, r: Request<pb::CreateEntryRequest>) -> R<pb::CreateEntryResponse> {
        self.unary_creates.fetch_add(1, Ordering::Relaxed);
        let c = r.into_inner();
        let name = c.entry.map(|e| e.name).unwrap_or_default();
        Ok(Response::new(pb::CreateEntryResponse {
            metadata_event: Some(created_reply(&name, c.signatures)),
            ..Default::default()
        }))
    }
    async fn stream_mutate_entry(
        &self,
        r: Request<tonic::Streaming<pb::StreamMutateEntryRequest>>,
    ) -> R<Self::StreamMutateEntryStream> {
        self.stream_calls.fetch_add(1, Ordering::Relaxed);
        let mut reqs = r.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        match self.mode {
            Mode::Unimplemented => {
                return Err(Status::unimplemented("unknown method StreamMutateEntry"))
            }
            Mode::Break => {
                tokio::spawn(async move {
                    let _ = reqs.message().await;
                    let _ = tx.send(Err(Status::internal("stream reset")));
                });
            }
            Mode::Reverse | Mode::Hang => {
                tokio::spawn(async move {
                    let mut batch = Vec::new();
                    while let Ok(Some(m)) = reqs.message().await {
                        batch.push(m);
                        if batch.len() < 2 {
                            continue;
                        }
                        // reverse order; interleave: first response of each, then the rest
                        let mut lists: Vec<Vec<_>> = batch.drain(..).rev().map(answers).collect();
                        while lists.iter().any(|l| !l.is_empty()) {
                            for l in lists.iter_mut().filter(|l| !l.is_empty()) {
                                let _ = tx.send(Ok(l.remove(0)));
                            }
                        }
                    }
                });
            }
        }
        Ok(Response::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx).boxed(),
        ))
    }
    async fn list_entries(
        &self,
        _r: Request<pb::ListEntriesRequest>,
    ) -> R<Self::ListEntriesStream> {
        Err(Status::unimplemented("fake"))
    }
    async fn stream_rename_entry(
        &self,
        _r: Request<pb::StreamRenameEntryRequest>,
    ) -> R<Self::StreamRenameEntryStream> {
        Err(Status::unimplemented("fake"))
    }
    async fn subscribe_metadata(
        &self,
        _r: Request<pb::SubscribeMetadataRequest>,
    ) -> R<Self::SubscribeMetadataStream> {
        Err(Status::unimplemented("fake"))
    }
    async fn update_entry(
        &self,
        _r: Request<pb::UpdateEntryRequest>,
    ) -> R<pb::UpdateEntryResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn append_to_entry(
        &self,
        _r: Request<pb::AppendToEntryRequest>,
    ) -> R<pb::AppendToEntryResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn delete_entry(
        &self,
        _r: Request<pb::DeleteEntryRequest>,
    ) -> R<pb::DeleteEntryResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn atomic_rename_entry(
        &self,
        _r: Request<pb::AtomicRenameEntryRequest>,
    ) -> R<pb::AtomicRenameEntryResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn assign_volume(
        &self,
        _r: Request<pb::AssignVolumeRequest>,
    ) -> R<pb::AssignVolumeResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn lookup_volume(
        &self,
        _r: Request<pb::LookupVolumeRequest>,
    ) -> R<pb::LookupVolumeResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn statistics(&self, _r: Request<pb::StatisticsRequest>) -> R<pb::StatisticsResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn ping(&self, _r: Request<pb::PingRequest>) -> R<pb::PingResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_filer_configuration(
        &self,
        _r: Request<pb::GetFilerConfigurationRequest>,
    ) -> R<pb::GetFilerConfigurationResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn kv_get(&self, _r: Request<pb::KvGetRequest>) -> R<pb::KvGetResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn kv_put(&self, _r: Request<pb::KvPutRequest>) -> R<pb::KvPutResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn list_metadata_subscribers(
        &self,
        _r: Request<pb::ListMetadataSubscribersRequest>,
    ) -> R<pb::ListMetadataSubscribersResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn cache_remote_object_to_local_cluster(
        &self,
        _r: Request<pb::CacheRemoteObjectToLocalClusterRequest>,
    ) -> R<pb::CacheRemoteObjectToLocalClusterResponse> {
        Err(Status::unimplemented("fake"))
    }
}

/// Serves `fake` on a loopback port until the returned sender is dropped.
async fn serve(fake: Fake) -> (GrpcFiler, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(SeaweedFilerServer::new(fake))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = stop_rx.await;
                },
            ),
    );
    let opts = FilerClientOptions {
        addresses: vec![format!("127.0.0.1:1.{port}")],
        call_timeout: Duration::from_millis(1500),
        ..Default::default()
    };
    (GrpcFiler::connect(opts).await.unwrap(), stop_tx)
}

fn fake(mode: Mode) -> Fake {
    Fake {
        mode,
        stream_calls: Arc::default(),
        unary_creates: Arc::default(),
    }
}

fn create_req(name: &str) -> pb::CreateEntryRequest {
    pb::CreateEntryRequest {
        directory: "/".into(),
        entry: Some(pb::Entry {
            name: name.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn event_name(ev: &pb::SubscribeMetadataResponse) -> &str {
    &ev.event_notification
        .as_ref()
        .unwrap()
        .new_entry
        .as_ref()
        .unwrap()
        .name
}

/// Each signature (a session view of a shared connection) mutates over its own stream:
/// a stream stuck on one volume's request holds up no other volume's mutations.
#[tokio::test]
async fn each_signature_gets_its_own_mutation_stream() {
    let fk = fake(Mode::Reverse); // answers only once a stream has two requests
    let (f, _stop) = serve(fk.clone()).await;
    let signed = |name: &str, sig: i32| {
        let mut r = create_req(name);
        r.signatures = vec![sig];
        r
    };
    let lone = f.create_entry(signed("a1", 7));
    let pair = async {
        tokio::join!(
            f.create_entry(signed("b1", 8)),
            f.create_entry(signed("b2", 8))
        )
    };
    let (lone, (b1, b2)) = tokio::join!(lone, pair);
    assert_eq!(event_name(&b1.unwrap().unwrap()), "b1");
    assert_eq!(event_name(&b2.unwrap().unwrap()), "b2");
    // its stream never got a second request: only this volume's call timed out
    assert!(matches!(lone, Err(FilerError::Timeout(_))), "{lone:?}");
    assert_eq!(fk.stream_calls.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn unimplemented_stream_falls_back_to_unary_for_good() {
    let fk = fake(Mode::Unimplemented);
    let (f, _stop) = serve(fk.clone()).await;
    for name in ["a", "b", "c"] {
        let ev = f.create_entry(create_req(name)).await.unwrap().unwrap();
        assert_eq!(event_name(&ev), name);
        assert_eq!(
            ev.event_notification.unwrap().signatures,
            vec![f.signature()],
            "signed"
        );
    }
    assert_eq!(
        f.mutation_counts(),
        MutationCounts {
            stream: 0,
            unary: 3
        }
    );
    assert_eq!(
        fk.stream_calls.load(Ordering::Relaxed),
        1,
        "stream not retried after Unimplemented"
    );
    assert_eq!(fk.unary_creates.load(Ordering::Relaxed), 3);
}

#[tokio::test]
async fn out_of_order_and_multi_response_correlation() {
    let (f, _stop) = serve(fake(Mode::Reverse)).await;
    let rename = pb::StreamRenameEntryRequest {
        old_directory: "/".into(),
        old_name: "x".into(),
        new_directory: "/".into(),
        new_name: "y".into(),
        signatures: vec![],
    };
    let (c, r) = tokio::join!(f.create_entry(create_req("a")), f.rename_entry(rename));
    assert_eq!(event_name(&c.unwrap().unwrap()), "a");
    let names: Vec<String> = r
        .unwrap()
        .iter()
        .map(|x| {
            x.event_notification
                .as_ref()
                .unwrap()
                .new_entry
                .as_ref()
                .unwrap()
                .name
                .clone()
        })
        .collect();
    assert_eq!(names, ["y", "y-child"]);
    // many concurrent creates, answered pairwise reversed
    let all = futures::future::join_all((0..10).map(|i| {
        let f = f.clone();
        async move { f.create_entry(create_req(&format!("n{i}"))).await }
    }))
    .await;
    for (i, r) in all.into_iter().enumerate() {
        assert_eq!(event_name(&r.unwrap().unwrap()), format!("n{i}"));
    }
    // top-level error/errno of a stream response is typed
    let (d1, d2) = tokio::join!(
        f.delete_entry(pb::DeleteEntryRequest {
            directory: "/".into(),
            name: "d".into(),
            ..Default::default()
        }),
        f.create_entry(create_req("z"))
    );
    assert!(matches!(d1, Err(FilerError::NotEmpty(_))), "{d1:?}");
    assert!(d2.is_ok());
    assert_eq!(
        f.mutation_counts(),
        MutationCounts {
            stream: 14,
            unary: 0
        }
    );
}

#[tokio::test]
async fn broken_stream_retries_as_unary() {
    let fk = fake(Mode::Break);
    let (f, _stop) = serve(fk.clone()).await;
    let ev = f.create_entry(create_req("a")).await.unwrap().unwrap();
    assert_eq!(event_name(&ev), "a");
    assert_eq!(
        f.mutation_counts(),
        MutationCounts {
            stream: 0,
            unary: 1
        }
    );
    // within the reopen delay, mutations go straight to unary
    f.create_entry(create_req("b")).await.unwrap();
    assert_eq!(fk.stream_calls.load(Ordering::Relaxed), 1);
    assert_eq!(fk.unary_creates.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn hung_call_times_out() {
    let (f, _stop) = serve(fake(Mode::Hang)).await;
    let t0 = Instant::now();
    let e = f.lookup_entry("/", "x").await.unwrap_err();
    assert!(matches!(e, FilerError::Timeout(_)), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

/// The filer's reply to a create carries the event with both entries whole (every chunk);
/// read as `MutationEvent` it keeps the names and signatures, and the chunks are skipped.
#[test]
fn a_create_reply_from_the_filer_is_read_without_its_chunks() {
    use prost::Message;
    let chunk = |i: i64| pb::FileChunk {
        file_id: format!("3,{i:x}1234abcd"),
        offset: i << 20,
        size: 1 << 20,
        ..Default::default()
    };
    let entry = |n: usize| pb::Entry {
        name: "wal".into(),
        chunks: (0..n as i64).map(chunk).collect(),
        ..Default::default()
    };
    let event = pb::SubscribeMetadataResponse {
        directory: "/d".into(),
        event_notification: Some(pb::EventNotification {
            old_entry: Some(entry(1023)),
            new_entry: Some(entry(1024)),
            signatures: vec![7],
            ..Default::default()
        }),
        ts_ns: 42,
        ..Default::default()
    };
    // CreateEntryResponse as SeaweedFS declares it: field 2 is the whole event
    let mut wire = Vec::new();
    prost::encoding::string::encode(1, &String::new(), &mut wire);
    prost::encoding::message::encode(2, &event, &mut wire);
    prost::encoding::int64::encode(4, &42, &mut wire);
    let r = pb::CreateEntryResponse::decode(wire.as_slice()).unwrap();
    assert_eq!(r.log_ts_ns, 42);
    let ev = super::api::full_event(r.metadata_event.expect("the event is read"));
    assert_eq!((ev.directory.as_str(), ev.ts_ns), ("/d", 42));
    let n = ev.event_notification.unwrap();
    assert_eq!(n.signatures, [7]);
    for e in [n.old_entry.unwrap(), n.new_entry.unwrap()] {
        assert_eq!(e.name, "wal");
        assert!(e.chunks.is_empty());
    }
}
