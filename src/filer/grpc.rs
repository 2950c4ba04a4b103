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

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Status};

use super::addr::FilerAddress;
use super::{pb, FilerApi, FilerError, MetadataStream, Result};
use crate::security::SecurityConfig;
use pb::seaweed_filer_client::SeaweedFilerClient;
use pb::stream_mutate_entry_request::Request as MutReq;
use pb::stream_mutate_entry_response::Response as MutResp;

/// Max gRPC message size both ways; SeaweedFS uses 1 GiB (entries with many chunks are large).
pub const MAX_MESSAGE_SIZE: usize = 1 << 30;
/// HTTP/2 keepalive ping interval. The filer rejects pings more often than every 20 s.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// After the mutation stream broke, use unary calls for this long before reopening it.
const STREAM_REOPEN_DELAY: Duration = Duration::from_secs(2);
/// A mutation lane unused this long is closed when another lane opens.
const LANE_IDLE: Duration = Duration::from_secs(300);

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

#[derive(Default)]
struct MutateSlot {
    conn: Option<Arc<MutateConn>>,
    retry_after: Option<Instant>,
    last_used: Option<Instant>,
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

impl GrpcFiler {
    /// Validates the options and prepares lazy channels; does not touch the network (see module doc).
    pub async fn connect(opts: FilerClientOptions) -> Result<GrpcFiler> {
        let addrs =
            FilerAddress::parse_all(&opts.addresses).map_err(FilerError::InvalidArgument)?;
        let tls = opts
            .security
            .grpc_client_tls_config()
            .map_err(|e| FilerError::InvalidArgument(format!("filer gRPC TLS: {e}")))?;
        let mut targets = Vec::with_capacity(addrs.len());
        for addr in addrs {
            let uri = format!("http://{}", addr.grpc());
            let ep = Endpoint::from_shared(uri.clone())
                .map_err(|e| FilerError::InvalidArgument(format!("filer address {uri}: {e}")))?
                .connect_timeout(opts.connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true)
                .initial_stream_window_size(16 << 20)
                .initial_connection_window_size(16 << 20);
            let channel = match &tls {
                Some(cfg) => ep.connect_with_connector_lazy(tls_connector(cfg.clone())),
                None => ep.connect_lazy(),
            };
            let client = SeaweedFilerClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE);
            targets.push(Target { addr, client });
        }
        let signature = loop {
            let s: i32 = rand::random();
            if s != 0 {
                break s;
            }
        };
        tracing::debug!(filers = ?targets.iter().map(|t| t.addr.to_string()).collect::<Vec<_>>(),
            signature, tls = tls.is_some(), "filer client ready");
        Ok(GrpcFiler {
            inner: Arc::new(Inner {
                targets,
                current: AtomicUsize::new(0),
                call_timeout: opts.call_timeout,
                signature,
                stream_enabled: AtomicBool::new(true),
                stream_unsupported: AtomicBool::new(false),
                mutate: Mutex::new(HashMap::new()),
                next_request_id: AtomicU64::new(1),
                stream_count: AtomicU64::new(0),
                unary_count: AtomicU64::new(0),
            }),
        })
    }

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

    /// The parsed filer addresses, in failover order.
    pub fn addresses(&self) -> Vec<FilerAddress> {
        self.inner.targets.iter().map(|t| t.addr.clone()).collect()
    }

    fn current(&self) -> usize {
        self.inner.current.load(Ordering::Relaxed) % self.inner.targets.len()
    }

    /// Runs `f` against the current filer with a per-attempt timeout, moving to the next filer
    /// and retrying after a transport error (at most `filers + 1` attempts).
    async fn call<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let n = self.inner.targets.len();
        let attempts = n + 1;
        let mut last = FilerError::Unavailable(format!("{op}: no filer configured"));
        for attempt in 0..attempts {
            let idx = self.current();
            let target = &self.inner.targets[idx];
            let res = match tokio::time::timeout(self.inner.call_timeout, f(target.client.clone()))
                .await
            {
                Ok(r) => r,
                Err(_) => Err(FilerError::Timeout(format!(
                    "{op} on filer {} after {:?}",
                    target.addr, self.inner.call_timeout
                ))),
            };
            match res {
                Err(FilerError::Unavailable(msg)) => {
                    tracing::warn!(filer = %target.addr, op, attempt, error = %msg, "filer unavailable, trying next");
                    let _ = self.inner.current.compare_exchange(
                        idx,
                        (idx + 1) % n,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                    last = FilerError::Unavailable(format!("{op} on filer {}: {msg}", target.addr));
                    if (attempt + 1) % n == 0 && attempt + 1 < attempts {
                        // Went round every filer: pause briefly before trying them again.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                Err(FilerError::Timeout(msg)) => {
                    // Unknown whether it was applied: do not retry, but prefer another filer next time.
                    if n > 1 {
                        let _ = self.inner.current.compare_exchange(
                            idx,
                            (idx + 1) % n,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
                    }
                    return Err(FilerError::Timeout(msg));
                }
                other => return other,
            }
        }
        Err(last)
    }

    fn sign(&self, signatures: &mut Vec<i32>) {
        if signatures.is_empty() {
            signatures.push(self.inner.signature);
        }
    }

    /// Sends one mutation over the stream. `Ok(None)`: use the unary RPC instead.
    async fn stream_mutate(
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

// ---- TLS ----

/// A tonic connector doing TCP + rustls with our CA-only verifier. SNI/host name come from the
/// URI but the verifier ignores the name (SeaweedFS does not check it).
fn tls_connector(
    cfg: Arc<rustls::ClientConfig>,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Error = std::io::Error,
    Future = impl Future<
        Output = std::io::Result<TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>,
    > + Send,
> + Send
       + Clone
       + 'static {
    let connector = tokio_rustls::TlsConnector::from(cfg);
    tower::service_fn(move |uri: Uri| {
        let connector = connector.clone();
        async move {
            let bad = || {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("bad filer uri {uri}"),
                )
            };
            let host = uri
                .host()
                .ok_or_else(bad)?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().ok_or_else(bad)?;
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = match host.parse::<std::net::IpAddr>() {
                Ok(ip) => rustls::pki_types::ServerName::IpAddress(ip.into()),
                Err(_) => {
                    rustls::pki_types::ServerName::try_from(host.clone()).unwrap_or_else(|_| {
                        rustls::pki_types::ServerName::try_from("seaweedfs").expect("static name")
                    })
                }
            };
            let tls = connector.connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        }
    })
}

// ---- error mapping ----

fn is_transport(s: &Status) -> bool {
    match s.code() {
        // hyper reports a connection dropped before/while sending as "operation was canceled"
        Code::Unavailable | Code::Cancelled => true,
        Code::Unknown | Code::Internal => {
            let m = s.message();
            m.contains("transport error")
                || m.contains("h2 protocol error")
                || m.contains("connection")
                || m.contains("broken pipe")
                || m.contains("tcp connect error")
        }
        _ => false,
    }
}

fn is_not_found_msg(m: &str) -> bool {
    m.contains("no entry is found") || m.contains("not found")
}

/// Generic status mapping; op-specific text matches happen before this.
fn status_err(op: &str, s: Status) -> FilerError {
    let msg = format!("{op}: {}", s.message());
    if is_transport(&s) {
        return FilerError::Unavailable(format!("{msg} ({:?})", s.code()));
    }
    match s.code() {
        Code::DeadlineExceeded => FilerError::Timeout(msg),
        Code::NotFound => FilerError::NotFound(msg),
        Code::AlreadyExists => FilerError::AlreadyExists(msg),
        Code::InvalidArgument => FilerError::InvalidArgument(msg),
        _ if s.message().contains("no entry is found") => FilerError::NotFound(msg),
        code => FilerError::Other(format!("{msg} ({code:?})")),
    }
}

fn create_err(path: &str, code: pb::FilerError, text: &str) -> FilerError {
    let msg = format!("create {path}: {text}");
    match code {
        pb::FilerError::EntryAlreadyExists | pb::FilerError::ExistingIsFile => {
            FilerError::AlreadyExists(msg)
        }
        pb::FilerError::ExistingIsDirectory => FilerError::IsADirectory(msg),
        pb::FilerError::ParentIsFile => FilerError::NotADirectory(msg),
        pb::FilerError::EntryNameTooLong => FilerError::NameTooLong(msg),
        pb::FilerError::PreconditionFailed => FilerError::Other(msg),
        pb::FilerError::Ok => {
            if text.contains("already exists") {
                FilerError::AlreadyExists(msg)
            } else if text.contains("name too long") {
                FilerError::NameTooLong(msg)
            } else {
                FilerError::Other(msg)
            }
        }
    }
}

fn update_err(path: &str, s: Status) -> FilerError {
    if !is_transport(&s) && is_not_found_msg(s.message()) {
        return FilerError::NotFound(format!("update {path}: {}", s.message()));
    }
    status_err("update", s)
}

fn delete_err(path: &str, text: &str) -> FilerError {
    let msg = format!("delete {path}: {text}");
    if text.contains("non-empty") || text.contains("not empty") {
        FilerError::NotEmpty(msg)
    } else if text.contains("no entry is found") {
        FilerError::NotFound(msg)
    } else {
        FilerError::Other(msg)
    }
}

fn rename_text_err(what: &str, text: &str) -> FilerError {
    let msg = format!("rename {what}: {text}");
    if is_not_found_msg(text) {
        FilerError::NotFound(msg)
    } else if text.contains("is not empty") || text.contains("not empty") {
        FilerError::NotEmpty(msg)
    } else if text.contains("not directory") || text.contains("not a directory") {
        FilerError::NotADirectory(msg)
    } else {
        FilerError::Other(msg)
    }
}

fn rename_err(what: &str, s: Status) -> FilerError {
    if is_transport(&s) || s.code() == Code::DeadlineExceeded {
        return status_err("rename", s);
    }
    rename_text_err(what, s.message())
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
            return Ok(cr.and_then(|c| c.metadata_event));
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
                Ok(r.metadata_event)
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
                let err = if is_not_found_msg(&e) {
                    FilerError::NotFound(format!("update {path}: {e}"))
                } else {
                    FilerError::Other(format!("update {path}: {e}"))
                };
                return Err(err);
            }
            return Ok(rs.into_iter().find_map(|r| match r.response {
                Some(MutResp::UpdateResponse(u)) => u.metadata_event,
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
                Ok(r.metadata_event)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_errors() {
        assert!(matches!(
            status_err(
                "lookup",
                Status::unknown("filer: no entry is found in filer store")
            ),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            status_err("x", Status::unavailable("tcp connect error")),
            FilerError::Unavailable(_)
        ));
        assert!(matches!(
            status_err("x", Status::unknown("transport error")),
            FilerError::Unavailable(_)
        ));
        assert!(matches!(
            status_err("x", Status::deadline_exceeded("slow")),
            FilerError::Timeout(_)
        ));
        assert!(matches!(
            status_err("x", Status::internal("boom")),
            FilerError::Other(_)
        ));
        assert!(matches!(
            update_err(
                "/a",
                Status::unknown("not found /a: filer: no entry is found in filer store")
            ),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::EntryAlreadyExists, "x"),
            FilerError::AlreadyExists(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::ExistingIsDirectory, "x"),
            FilerError::IsADirectory(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::ParentIsFile, "x"),
            FilerError::NotADirectory(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::EntryNameTooLong, "x"),
            FilerError::NameTooLong(_)
        ));
        assert!(matches!(
            create_err("/a", pb::FilerError::Ok, "weird"),
            FilerError::Other(_)
        ));
        assert!(matches!(
            delete_err("/a", "fail to delete non-empty folder: /a"),
            FilerError::NotEmpty(_)
        ));
        assert!(matches!(
            delete_err("/a", "disk on fire"),
            FilerError::Other(_)
        ));
        assert!(matches!(
            rename_text_err("a", "entry not found"),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            rename_text_err("a", "filer: no entry is found in filer store"),
            FilerError::NotFound(_)
        ));
        assert!(matches!(
            rename_text_err("a", "target /b is not empty"),
            FilerError::NotEmpty(_)
        ));
        assert!(matches!(
            rename_text_err("a", "/b is not directory"),
            FilerError::NotADirectory(_)
        ));
        assert!(matches!(
            rename_err("a", Status::unavailable("down")),
            FilerError::Unavailable(_)
        ));
    }

    #[tokio::test]
    async fn connect_rejects_bad_addresses() {
        let o = FilerClientOptions {
            addresses: vec!["nope".into()],
            ..Default::default()
        };
        assert!(matches!(
            GrpcFiler::connect(o).await,
            Err(FilerError::InvalidArgument(_))
        ));
        let o = FilerClientOptions {
            addresses: vec![],
            ..Default::default()
        };
        assert!(matches!(
            GrpcFiler::connect(o).await,
            Err(FilerError::InvalidArgument(_))
        ));
    }

    #[tokio::test]
    async fn signature_nonzero_and_address() {
        let o = FilerClientOptions {
            addresses: vec!["127.0.0.1:1.2,127.0.0.1:3".into()],
            ..Default::default()
        };
        let f = GrpcFiler::connect(o).await.unwrap();
        assert_ne!(f.signature(), 0);
        assert_eq!(f.http_address(), "127.0.0.1:1");
        assert_eq!(f.addresses()[1].grpc_port, 10003);
    }

    // ---- an in-process fake filer for stream-mutate edge cases the real one won't produce ----

    use futures::stream::BoxStream;
    use pb::seaweed_filer_server::{SeaweedFiler, SeaweedFilerServer};
    use tonic::{Request, Response};

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
                    metadata_event: Some(created(&name, c.signatures)),
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
        async fn create_entry(
            &self,
            r: Request<pb::CreateEntryRequest>,
        ) -> R<pb::CreateEntryResponse> {
            self.unary_creates.fetch_add(1, Ordering::Relaxed);
            let c = r.into_inner();
            let name = c.entry.map(|e| e.name).unwrap_or_default();
            Ok(Response::new(pb::CreateEntryResponse {
                metadata_event: Some(created(&name, c.signatures)),
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
                            let mut lists: Vec<Vec<_>> =
                                batch.drain(..).rev().map(answers).collect();
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
        async fn statistics(
            &self,
            _r: Request<pb::StatisticsRequest>,
        ) -> R<pb::StatisticsResponse> {
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
    async fn silent_listener_is_bounded() {
        // The kernel accepts the TCP connection but nobody speaks HTTP/2.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let opts = FilerClientOptions {
            addresses: vec![format!("127.0.0.1:1.{port}")],
            call_timeout: Duration::from_millis(800),
            connect_timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let f = GrpcFiler::connect(opts).await.unwrap();
        let t0 = Instant::now();
        let e = f.lookup_entry("/", "x").await.unwrap_err();
        assert!(
            matches!(e, FilerError::Timeout(_) | FilerError::Unavailable(_)),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        drop(l);
    }

    #[tokio::test]
    async fn hung_call_times_out() {
        let (f, _stop) = serve(fake(Mode::Hang)).await;
        let t0 = Instant::now();
        let e = f.lookup_entry("/", "x").await.unwrap_err();
        assert!(matches!(e, FilerError::Timeout(_)), "{e:?}");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    }
}
