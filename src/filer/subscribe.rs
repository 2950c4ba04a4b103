//! A reconnecting `SubscribeMetadata` subscription.
//!
//! One task keeps a stream open on the filer, resumes after errors from the last applied
//! `ts_ns`, and forwards one event per message (batches flattened). After every reconnect it
//! sends [`SubscriptionEvent::Resync`] first: events may have been lost in the gap (e.g. a
//! filer restart drops its in-memory log), so caches must treat everything as stale.
//!
//! Our own mutations carry `filer.signature()` in `signatures`, and the subscription sends the
//! same signature, so the filer filters our own events out server-side.
//!
//! This is the one-client form (tools, tests). Mounted volumes share one subscription per
//! filer per node instead: see [`super::hub`].

use std::sync::Arc;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{pb, FilerApi};

/// Capacity of the event channel; a slow consumer back-pressures the stream.
const CHANNEL_CAPACITY: usize = 1024;

#[derive(Debug, Clone, Default)]
pub struct SubscribeOptions {
    /// Shown by the filer in its subscriber list (e.g. `"mount"`).
    pub client_name: String,
    /// Events under this path (e.g. `"/buckets/pvc-1/"`, with a trailing slash to avoid siblings).
    pub path_prefix: String,
    /// More prefixes (e.g. `"/etc/seaweedfs/filer.conf"`).
    pub extra_prefixes: Vec<String>,
    /// Start position in nanoseconds since the epoch (usually "now" at mount time); 0 replays
    /// the filer's whole metadata log.
    pub since_ns: i64,
}

// Events are the common case and Resync is rare, so boxing the event would only add allocations.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum SubscriptionEvent {
    /// One metadata event (never a batch: `events` is empty).
    Event(pb::SubscribeMetadataResponse),
    /// Sent after every reconnect, before any event from the new stream: treat caches as stale.
    Resync,
    /// An event that may be older than what the session has read since it started (a replay
    /// reaching back before its start, or a filer's clock behind the node's): apply none of
    /// it, read what it names from the filer again.
    Recheck(pb::SubscribeMetadataResponse),
}

pub(crate) fn random_nonzero() -> i32 {
    loop {
        let v: i32 = rand::random();
        if v != 0 {
            return v;
        }
    }
}

/// An event that carries an entry change (not an empty progress marker).
pub(crate) fn has_change(ev: &pb::SubscribeMetadataResponse) -> bool {
    ev.event_notification
        .as_ref()
        .is_some_and(|n| n.old_entry.is_some() || n.new_entry.is_some())
}

/// Splits a (possibly batched) message into single events.
pub(crate) fn flatten(
    mut msg: pb::SubscribeMetadataResponse,
) -> Vec<pb::SubscribeMetadataResponse> {
    let rest = std::mem::take(&mut msg.events);
    let mut out = Vec::with_capacity(1 + rest.len());
    if msg.event_notification.is_some() || msg.ts_ns != 0 {
        msg.log_file_refs.clear();
        out.push(msg);
    }
    for e in rest {
        out.extend(flatten(e));
    }
    out
}

/// Starts the subscription task. It ends when the receiver is dropped.
pub fn spawn_subscription(
    filer: Arc<dyn FilerApi>,
    opts: SubscribeOptions,
) -> (mpsc::Receiver<SubscriptionEvent>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
    let handle = tokio::spawn(run(filer, opts, tx));
    (rx, handle)
}

async fn run(
    filer: Arc<dyn FilerApi>,
    opts: SubscribeOptions,
    tx: mpsc::Sender<SubscriptionEvent>,
) {
    let client_id = random_nonzero();
    let mut epoch: i32 = 0;
    let mut since_ns = opts.since_ns;
    let mut pauses = crate::retry::RECONNECT.pauses();
    let mut had_stream = false;
    loop {
        // The filer refuses a second stream of the same client_id with an epoch <= the active one.
        epoch = epoch.wrapping_add(1).max(1);
        let req = pb::SubscribeMetadataRequest {
            client_name: opts.client_name.clone(),
            path_prefix: opts.path_prefix.clone(),
            path_prefixes: opts.extra_prefixes.clone(),
            since_ns,
            signature: filer.signature(),
            client_id,
            client_epoch: epoch,
            ..Default::default()
        };
        let opened = tokio::select! {
            _ = tx.closed() => return,
            r = filer.subscribe_once(req) => r,
        };
        match opened {
            Err(e) => {
                tracing::warn!(error = %e, prefix = %opts.path_prefix, "metadata subscription failed to open");
            }
            Ok(mut stream) => {
                if had_stream {
                    tracing::info!(since_ns, epoch, prefix = %opts.path_prefix, "metadata subscription reconnected");
                    if tx.send(SubscriptionEvent::Resync).await.is_err() {
                        return;
                    }
                }
                had_stream = true;
                loop {
                    let item = tokio::select! {
                        _ = tx.closed() => return,
                        item = stream.next() => item,
                    };
                    match item {
                        Some(Ok(msg)) => {
                            pauses = crate::retry::RECONNECT.pauses();
                            for ev in flatten(msg) {
                                // Progress markers only move the resume point.
                                since_ns = since_ns.max(ev.ts_ns);
                                if has_change(&ev)
                                    && tx.send(SubscriptionEvent::Event(ev)).await.is_err()
                                {
                                    return;
                                }
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, since_ns, prefix = %opts.path_prefix, "metadata subscription broke");
                            break;
                        }
                        None => {
                            tracing::info!(since_ns, prefix = %opts.path_prefix, "metadata subscription ended by filer");
                            break;
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = tx.closed() => return,
            _ = tokio::time::sleep(pauses.next_pause()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filer::mock::MockFiler;
    use std::time::Duration;

    fn create(dir: &str, name: &str) -> pb::CreateEntryRequest {
        pb::CreateEntryRequest {
            directory: dir.into(),
            entry: Some(pb::Entry {
                name: name.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn next(rx: &mut mpsc::Receiver<SubscriptionEvent>) -> SubscriptionEvent {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("event in time")
            .expect("channel open")
    }

    fn name_of(ev: &SubscriptionEvent) -> String {
        match ev {
            SubscriptionEvent::Event(e) => e
                .event_notification
                .as_ref()
                .unwrap()
                .new_entry
                .as_ref()
                .unwrap()
                .name
                .clone(),
            SubscriptionEvent::Resync => "<resync>".into(),
            SubscriptionEvent::Recheck(_) => "<recheck>".into(),
        }
    }

    #[test]
    fn flattens_batches_and_skips_empty_shell() {
        let ev = |ts| pb::SubscribeMetadataResponse {
            ts_ns: ts,
            event_notification: Some(Default::default()),
            ..Default::default()
        };
        let batch = pb::SubscribeMetadataResponse {
            events: vec![ev(2), ev(3)],
            ..ev(1)
        };
        assert_eq!(
            flatten(batch).iter().map(|e| e.ts_ns).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        let shell = pb::SubscribeMetadataResponse {
            events: vec![ev(5)],
            ..Default::default()
        };
        assert_eq!(
            flatten(shell).iter().map(|e| e.ts_ns).collect::<Vec<_>>(),
            [5]
        );
        assert!(!has_change(&ev(1)));
    }

    #[tokio::test]
    async fn reconnects_with_resync_and_resumes() {
        let me = MockFiler::new();
        let other = me.other_client();
        let opts = SubscribeOptions {
            client_name: "test".into(),
            path_prefix: "/w/".into(),
            extra_prefixes: vec!["/etc/seaweedfs/filer.conf".into()],
            since_ns: 0,
        };
        let (mut rx, handle) = spawn_subscription(Arc::new(me.clone()), opts);
        other.create_entry(create("/w", "a")).await.unwrap();
        me.create_entry(create("/w", "own")).await.unwrap(); // filtered by signature
        other
            .create_entry(create("/etc/seaweedfs", "filer.conf"))
            .await
            .unwrap();
        assert_eq!(name_of(&next(&mut rx).await), "a");
        assert_eq!(name_of(&next(&mut rx).await), "filer.conf");

        // Filer goes away and the first reconnect attempt fails.
        me.fail_next(1);
        me.disconnect_subscribers();
        let t0 = std::time::Instant::now();
        while me.calls("subscribe_once") < 3 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no reconnect");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        other.create_entry(create("/w", "b")).await.unwrap();
        assert!(matches!(next(&mut rx).await, SubscriptionEvent::Resync));
        // resumed after the last applied event: nothing old is replayed
        assert_eq!(name_of(&next(&mut rx).await), "b");

        drop(rx);
        tokio::time::timeout(Duration::from_secs(5), handle)
            .await
            .expect("task ends with the receiver")
            .unwrap();
    }

    #[tokio::test]
    async fn epoch_and_client_id() {
        // A recording double: checks the request fields across reconnects.
        struct Rec {
            inner: MockFiler,
            seen: parking_lot::Mutex<Vec<pb::SubscribeMetadataRequest>>,
        }
        #[async_trait::async_trait]
        impl FilerApi for Rec {
            async fn lookup_entry(&self, d: &str, n: &str) -> crate::filer::Result<pb::Entry> {
                self.inner.lookup_entry(d, n).await
            }
            async fn list_page(
                &self,
                d: &str,
                s: &str,
                i: bool,
                l: u32,
            ) -> crate::filer::Result<Vec<pb::Entry>> {
                self.inner.list_page(d, s, i, l).await
            }
            async fn create_entry(
                &self,
                r: pb::CreateEntryRequest,
            ) -> crate::filer::Result<Option<pb::SubscribeMetadataResponse>> {
                self.inner.create_entry(r).await
            }
            async fn update_entry(
                &self,
                r: pb::UpdateEntryRequest,
            ) -> crate::filer::Result<Option<pb::SubscribeMetadataResponse>> {
                self.inner.update_entry(r).await
            }
            async fn delete_entry(
                &self,
                r: pb::DeleteEntryRequest,
            ) -> crate::filer::Result<Option<pb::SubscribeMetadataResponse>> {
                self.inner.delete_entry(r).await
            }
            async fn rename_entry(
                &self,
                r: pb::StreamRenameEntryRequest,
            ) -> crate::filer::Result<Vec<pb::StreamRenameEntryResponse>> {
                self.inner.rename_entry(r).await
            }
            async fn assign_volume(
                &self,
                r: pb::AssignVolumeRequest,
            ) -> crate::filer::Result<pb::AssignVolumeResponse> {
                self.inner.assign_volume(r).await
            }
            async fn lookup_volume(&self, v: u32) -> crate::filer::Result<Vec<pb::Location>> {
                self.inner.lookup_volume(v).await
            }
            async fn statistics(
                &self,
                r: pb::StatisticsRequest,
            ) -> crate::filer::Result<pb::StatisticsResponse> {
                self.inner.statistics(r).await
            }
            async fn configuration(
                &self,
            ) -> crate::filer::Result<pb::GetFilerConfigurationResponse> {
                self.inner.configuration().await
            }
            async fn subscribe_once(
                &self,
                r: pb::SubscribeMetadataRequest,
            ) -> crate::filer::Result<crate::filer::MetadataStream> {
                self.seen.lock().push(r.clone());
                self.inner.subscribe_once(r).await
            }
            fn http_address(&self) -> String {
                self.inner.http_address()
            }
            fn signature(&self) -> i32 {
                self.inner.signature()
            }
        }
        let m = MockFiler::new();
        let rec = Arc::new(Rec {
            inner: m.clone(),
            seen: Default::default(),
        });
        let (mut rx, _h) = spawn_subscription(
            rec.clone(),
            SubscribeOptions {
                path_prefix: "/".into(),
                since_ns: 42,
                ..Default::default()
            },
        );
        m.other_client()
            .create_entry(create("/", "x"))
            .await
            .unwrap();
        next(&mut rx).await;
        m.disconnect_subscribers();
        assert!(matches!(next(&mut rx).await, SubscriptionEvent::Resync));
        let seen = rec.seen.lock().clone();
        assert!(seen.len() >= 2);
        assert_ne!(seen[0].client_id, 0);
        assert!(seen.iter().all(|r| r.client_id == seen[0].client_id));
        assert!(seen.iter().all(|r| r.signature == m.signature()));
        assert_eq!((seen[0].client_epoch, seen[1].client_epoch), (1, 2));
        assert_eq!(seen[0].since_ns, 42);
        assert!(seen[1].since_ns > 42, "resume point advanced");
    }
}
