//! The `StreamMutateEntry` path: one multiplexed mutation stream per lane (signature), opened
//! on demand, swept when idle, and given up for unary calls when it breaks or is unsupported.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tonic::Code;

use super::{Client, GrpcFiler, MutationCounts};
use crate::filer::{FilerError, Result};
use crate::pb::filer as pb;
use pb::stream_mutate_entry_request::Request as MutReq;

/// After the mutation stream broke, use unary calls for this long before reopening it.
const STREAM_REOPEN_DELAY: Duration = Duration::from_secs(2);
/// A mutation lane unused this long is closed when another lane opens.
const LANE_IDLE: Duration = Duration::from_secs(300);

#[derive(Default)]
pub(super) struct MutateSlot {
    conn: Option<Arc<MutateConn>>,
    retry_after: Option<Instant>,
    last_used: Option<Instant>,
}

impl GrpcFiler {
    /// Enables (default) or disables the `StreamMutateEntry` path; disabled = unary RPCs only.
    pub fn set_stream_mutate(&self, enabled: bool) {
        self.inner.stream_enabled.store(enabled, Ordering::Relaxed);
        if !enabled {
            self.inner.mutate.lock().clear();
        }
    }

    /// How many mutations went over the stream vs. unary RPCs so far.
    pub fn mutation_counts(&self) -> MutationCounts {
        MutationCounts {
            stream: self.inner.stream_count.load(Ordering::Relaxed),
            unary: self.inner.unary_count.load(Ordering::Relaxed),
        }
    }

    /// Sends one mutation over the stream. `Ok(None)`: use the unary RPC instead.
    pub(super) async fn stream_mutate(
        &self,
        req: MutReq,
    ) -> Result<Option<Vec<pb::StreamMutateEntryResponse>>> {
        if !self.inner.stream_enabled.load(Ordering::Relaxed)
            || self.inner.stream_unsupported.load(Ordering::Relaxed)
        {
            return Ok(None);
        }
        let lane = lane_of(&req);
        let Some(conn) = self.mutate_conn(lane) else {
            return Ok(None);
        };
        let id = self.inner.next_request_id.fetch_add(1, Ordering::Relaxed);
        let (done_tx, done_rx) = oneshot::channel();
        {
            let mut p = conn.pending.lock();
            if p.closed {
                return Ok(None);
            }
            p.map.insert(
                id,
                Pending {
                    acc: Vec::new(),
                    done: done_tx,
                },
            );
        }
        if conn
            .tx
            .send(pb::StreamMutateEntryRequest {
                request_id: id,
                request: Some(req),
            })
            .is_err()
        {
            conn.pending.lock().map.remove(&id);
            return Ok(None);
        }
        match tokio::time::timeout(self.inner.call_timeout, done_rx).await {
            Ok(Ok(Ok(responses))) => {
                self.inner.stream_count.fetch_add(1, Ordering::Relaxed);
                Ok(Some(responses))
            }
            Ok(Ok(Err(StreamFail::Unimplemented))) => {
                tracing::info!("filer does not implement StreamMutateEntry; using unary mutations");
                self.inner.stream_unsupported.store(true, Ordering::Relaxed);
                Ok(None)
            }
            Ok(Ok(Err(StreamFail::Broken(msg)))) => {
                tracing::warn!(error = %msg, "mutation stream broke; retrying as unary call");
                self.mark_stream_broken(lane, &conn);
                Ok(None)
            }
            Ok(Err(_)) => {
                self.mark_stream_broken(lane, &conn);
                Ok(None)
            }
            Err(_) => {
                conn.pending.lock().map.remove(&id);
                // A hung stream must not hold every later mutation hostage.
                self.mark_stream_broken(lane, &conn);
                Err(FilerError::Timeout(format!(
                    "StreamMutateEntry after {:?}",
                    self.inner.call_timeout
                )))
            }
        }
    }

    fn mark_stream_broken(&self, lane: i32, conn: &Arc<MutateConn>) {
        let mut lanes = self.inner.mutate.lock();
        if let Some(slot) = lanes.get_mut(&lane) {
            if slot.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                slot.conn = None;
                slot.retry_after = Some(Instant::now() + STREAM_REOPEN_DELAY);
            }
        }
    }

    /// The open mutation stream of `lane` to the current filer, opening one if needed.
    fn mutate_conn(&self, lane: i32) -> Option<Arc<MutateConn>> {
        let idx = self.current();
        let now = Instant::now();
        let mut lanes = self.inner.mutate.lock();
        let sweep = !lanes.contains_key(&lane)
            || lanes
                .values()
                .filter_map(|s| s.last_used)
                .min()
                .is_some_and(|t| now.duration_since(t) >= LANE_IDLE);
        if sweep {
            // Lanes of sessions that went away: their streams are closed by dropping them.
            lanes.retain(|_, s| {
                s.last_used
                    .is_some_and(|t| now.duration_since(t) < LANE_IDLE)
                    || s.conn
                        .as_ref()
                        .is_some_and(|c| !c.pending.lock().map.is_empty())
            });
        }
        let slot = lanes.entry(lane).or_default();
        slot.last_used = Some(now);
        if let Some(c) = &slot.conn {
            if c.target == idx && !c.pending.lock().closed {
                return Some(c.clone());
            }
            slot.conn = None;
        }
        if slot.retry_after.is_some_and(|t| now < t) {
            return None;
        }
        slot.retry_after = None;
        let conn = MutateConn::open(idx, self.inner.targets[idx].client.clone());
        slot.conn = Some(conn.clone());
        Some(conn)
    }
}

/// The lane of a mutation: the signature it carries (its session view's).
fn lane_of(req: &MutReq) -> i32 {
    let sigs = match req {
        MutReq::CreateRequest(r) => &r.signatures,
        MutReq::UpdateRequest(r) => &r.signatures,
        MutReq::DeleteRequest(r) => &r.signatures,
        MutReq::RenameRequest(r) => &r.signatures,
    };
    sigs.first().copied().unwrap_or(0)
}

// ---- the multiplexed StreamMutateEntry connection ----

enum StreamFail {
    Unimplemented,
    Broken(String),
}

struct Pending {
    acc: Vec<pb::StreamMutateEntryResponse>,
    done: oneshot::Sender<std::result::Result<Vec<pb::StreamMutateEntryResponse>, StreamFail>>,
}

#[derive(Default)]
struct PendingMap {
    map: HashMap<u64, Pending>,
    /// Set (under the lock) when the stream ended; nothing may be registered afterwards.
    closed: bool,
}

struct MutateConn {
    target: usize,
    tx: mpsc::UnboundedSender<pb::StreamMutateEntryRequest>,
    pending: Arc<Mutex<PendingMap>>,
}

impl MutateConn {
    /// Starts the stream in a task; requests queue in the channel until it is up. Dropping the
    /// last sender (this struct) ends the request stream and so the task.
    fn open(target: usize, mut client: Client) -> Arc<MutateConn> {
        let (tx, rx) = mpsc::unbounded_channel();
        let pending: Arc<Mutex<PendingMap>> = Arc::default();
        let p = pending.clone();
        tokio::spawn(async move {
            let reqs = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
            let fail = match client.stream_mutate_entry(reqs).await {
                Err(s) if s.code() == Code::Unimplemented => StreamFail::Unimplemented,
                Err(s) => StreamFail::Broken(s.to_string()),
                Ok(resp) => {
                    let mut s = resp.into_inner();
                    loop {
                        match s.message().await {
                            Ok(Some(m)) => dispatch(&p, m),
                            Ok(None) => break StreamFail::Broken("stream closed by filer".into()),
                            Err(st) if st.code() == Code::Unimplemented => {
                                break StreamFail::Unimplemented
                            }
                            Err(st) => break StreamFail::Broken(st.to_string()),
                        }
                    }
                }
            };
            let drained: Vec<Pending> = {
                let mut g = p.lock();
                g.closed = true;
                g.map.drain().map(|(_, v)| v).collect()
            };
            for d in drained {
                let f = match &fail {
                    StreamFail::Unimplemented => StreamFail::Unimplemented,
                    StreamFail::Broken(m) => StreamFail::Broken(m.clone()),
                };
                let _ = d.done.send(Err(f));
            }
        });
        Arc::new(MutateConn {
            target,
            tx,
            pending,
        })
    }
}

fn dispatch(pending: &Mutex<PendingMap>, m: pb::StreamMutateEntryResponse) {
    let mut g = pending.lock();
    let id = m.request_id;
    let last = m.is_last;
    let Some(p) = g.map.get_mut(&id) else {
        tracing::debug!(request_id = id, "response for an abandoned mutation");
        return;
    };
    p.acc.push(m);
    if last {
        if let Some(p) = g.map.remove(&id) {
            let _ = p.done.send(Ok(p.acc));
        }
    }
}
