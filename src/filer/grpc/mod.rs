//! The real filer client: `filer_pb.SeaweedFiler` over tonic, with failover across several filers.
//!
//! Connection policy: [`GrpcFiler::connect`] only validates the options and prepares one lazy
//! channel per filer; it never blocks on the network. Every call is bounded: each attempt by
//! `call_timeout` (TCP+TLS connect by `connect_timeout`), and a call makes at most
//! `addresses + 1` attempts, moving to the next filer after a transport error. When no filer
//! can be reached, calls fail with [`FilerError::Unavailable`] (refused: within ~0.2 s; silently
//! dropped packets: after `connect_timeout` per attempt). A filer that accepts the connection
//! but does not answer gives [`FilerError::Timeout`] after `call_timeout`; timed-out calls are
//! not retried (they may have been applied) but the next call prefers another filer.
//!
//! Mutations go over a multiplexed `StreamMutateEntry` stream when the filer supports it
//! (4.18+), one per signature (so per volume on a connection the hub shares), falling back to the unary RPCs on `Unimplemented` or a broken stream. A mutation
//! whose stream broke is re-sent as a unary call; create/update/delete are idempotent upserts,
//! a repeated rename may report NotFound if the first attempt had already been applied.
//!
//! Server errors are mapped to typed [`FilerError`]s here, once.
//!
//! [`FilerError`]: super::FilerError
//! [`FilerError::Unavailable`]: super::FilerError::Unavailable
//! [`FilerError::Timeout`]: super::FilerError::Timeout

mod api;
mod connect;
mod errors;
mod mutate;
#[cfg(test)]
mod tests;

pub use connect::{KEEPALIVE_INTERVAL, MAX_MESSAGE_SIZE};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tonic::transport::Channel;

use super::addr::FilerAddress;
use super::pb;
use crate::security::SecurityConfig;
use mutate::MutateSlot;
use pb::seaweed_filer_client::SeaweedFilerClient;

/// How to reach the filers.
#[derive(Debug, Clone)]
pub struct FilerClientOptions {
    /// Filer addresses, `host:port` or `host:port.grpcPort`; items may be comma-separated lists.
    pub addresses: Vec<String>,
    pub security: SecurityConfig,
    /// Bound for one attempt of one call (streams: for opening them).
    pub call_timeout: Duration,
    /// Bound for TCP (+TLS) connection setup.
    pub connect_timeout: Duration,
}

impl Default for FilerClientOptions {
    fn default() -> Self {
        Self {
            addresses: vec!["localhost:8888".into()],
            security: SecurityConfig::default(),
            call_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Counters for tests and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MutationCounts {
    /// Mutations answered over `StreamMutateEntry`.
    pub stream: u64,
    /// Mutations sent as unary RPCs (fallback or forced).
    pub unary: u64,
}

type Client = SeaweedFilerClient<Channel>;

struct Target {
    addr: FilerAddress,
    client: Client,
}

/// Filer gRPC client; cheap to clone (shared state).
#[derive(Clone)]
pub struct GrpcFiler {
    inner: Arc<Inner>,
}

struct Inner {
    targets: Vec<Target>,
    current: AtomicUsize,
    call_timeout: Duration,
    signature: i32,
    stream_enabled: AtomicBool,
    /// Set once a filer answered `Unimplemented` to StreamMutateEntry.
    stream_unsupported: AtomicBool,
    /// One mutation stream per signature (per session view of a shared connection): a
    /// volume's mutations keep their order and a hung stream stalls only that volume.
    mutate: Mutex<HashMap<i32, MutateSlot>>,
    next_request_id: AtomicU64,
    stream_count: AtomicU64,
    unary_count: AtomicU64,
}

impl std::fmt::Debug for GrpcFiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcFiler")
            .field(
                "filers",
                &self
                    .inner
                    .targets
                    .iter()
                    .map(|t| t.addr.to_string())
                    .collect::<Vec<_>>(),
            )
            .field("signature", &self.inner.signature)
            .finish()
    }
}
