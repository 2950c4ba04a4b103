//! Node-wide filer connections and metadata subscriptions.
//!
//! A node stages tens of volumes; with a client per volume the filer would hold one gRPC
//! connection and one `SubscribeMetadata` stream per volume per node. The hub instead keeps
//! ONE [`SharedFiler`] per (filer addresses, security, timeouts): one set of tonic channels
//! (HTTP/2 multiplexes every call and stream) and ONE subscription whose request carries
//! every staged volume's path prefix. Events are routed to the sessions by path.
//!
//! Signatures: each session mutates through its own [`SessionFiler`] view, which stamps the
//! session's own signature on its mutations. The shared subscription cannot filter by a
//! single signature server-side (it would hide one volume's changes from another volume
//! mapped to the same or a nested path), so it asks for everything (`signature: 0`) and the
//! router drops, per session, the events carrying that session's signature: the [`Fs`]
//! applies its own changes from the mutation responses and must not see them again.
//!
//! A volume staged (even under a prefix already carried, for its own history) or a prefix
//! unstaged restarts the stream from the lowest position any session has seen, minus
//! [`RESUME_MARGIN`], so no session loses an event; a new session starts at its own
//! `since_ns`, and a stream that did not carry it never moves its position. A
//! position is never used to filter: the filer stamps `ts_ns` before the event enters its
//! log (and a peer filer's events keep their own stamps), so one stream is not monotone in
//! `ts_ns`. A replay's repeats are instead recognised by the fingerprints each session keeps
//! of what it was sent (or, if it forgot too many, it gets a resync). A replay is short: the
//! filer sends a progress marker after every 1000 events it filtered out, which moves the
//! positions on a busy filer.
//!
//! A slow session never stalls the others: its channel is bounded and, when full, the
//! router drops its events and sends it [`SubscriptionEvent::Resync`] as soon as there is
//! room (it then rereads from the filer what it cached). Blocking would let one stuck
//! session stop coherence for every volume of the node; buffering without bound would let it
//! grow the plugin's memory with the filer's event rate.
//!
//! [`Fs`]: crate::fs::Fs
//!
//! Over 800 lines: half is its unit tests; the connection sharing and the routing of one
//! subscription share the router's state, so they stay together.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use futures::StreamExt;
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use tokio::sync::{mpsc, Notify};

use super::grpc::{FilerClientOptions, GrpcFiler};
use super::subscribe::{flatten, has_change, random_nonzero, SubscriptionEvent};
use super::{pb, FilerApi, MetadataStream, Result};
use crate::security::SecurityConfig;

/// Events a session may have queued before it is marked for a resync.
pub const SESSION_QUEUE: usize = 1024;
/// How often pending resyncs of full sessions are retried when no event comes.
const RESYNC_RETRY: Duration = Duration::from_millis(250);
/// A restarted stream resumes this far before the lowest position, for events stamped
/// before, but logged after, those already seen.
pub const RESUME_MARGIN: i64 = 2_000_000_000;
/// Fingerprints a session keeps of the events it was sent, to skip them in a replay: at
/// most this many...
const SEEN_MAX: usize = 4096;
/// ...and only those seen within this much of its position (a replay starts
/// [`RESUME_MARGIN`] before it).
const SEEN_WINDOW: i64 = 30_000_000_000;
/// A prefix-set change waits this long for more before the stream restarts.
const REPLAN_SETTLE: Duration = Duration::from_millis(200);
/// Shown by the filer in its subscriber list.
const CLIENT_NAME: &str = "seaweedfs-csi";

/// Process-wide counters (the hub's connections come and go; counters must not).
static STREAMS_OPENED: AtomicU64 = AtomicU64::new(0);
static EVENTS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// A fingerprint of a (small) file's contents; None if it cannot be read. Read off the
/// runtime's threads (a path on a hung network mount must not stall a worker).
async fn file_fingerprint(path: &std::path::Path) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let bytes = tokio::fs::read(path).await.ok()?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    Some(h.finish())
}

/// What makes two volumes share a connection.
#[derive(Clone, PartialEq, Eq)]
struct HubKey {
    addresses: Vec<String>,
    security: SecurityConfig,
    /// Fingerprints of the gRPC TLS files' contents: a volume staged after the certificates
    /// were rotated gets a connection with the new ones (the old one lives on with its
    /// volumes). Contents, not times: a copy that keeps times (`cp -p`, an image) is new too.
    tls_files: Vec<Option<u64>>,
    call_timeout: Duration,
    connect_timeout: Duration,
}

/// The node's filer connections, one per distinct filer configuration.
#[derive(Default)]
pub struct FilerHub {
    conns: Mutex<Vec<(HubKey, Weak<SharedFiler>)>>,
}

/// Exports a hub's state at scrape time.
struct HubCollector(&'static FilerHub);

impl std::fmt::Debug for HubCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HubCollector")
    }
}

impl Collector for HubCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        self.0.encode_metrics(&mut encoder)
    }
}

impl FilerHub {
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide hub (sessions, the CSI controller and the node service use it).
    /// Its state is exported with the process's metrics.
    pub fn global() -> &'static FilerHub {
        static HUB: OnceLock<FilerHub> = OnceLock::new();
        let mut created = false;
        let hub = HUB.get_or_init(|| {
            created = true;
            FilerHub::new()
        });
        if created {
            crate::metrics::global().add_collector(Box::new(HubCollector(hub)));
        }
        hub
    }

    /// Writes the hub's gauges and the process-wide stream counters.
    fn encode_metrics(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        let live: Vec<Arc<SharedFiler>> = self
            .conns
            .lock()
            .iter()
            .filter_map(|(_, w)| w.upgrade())
            .collect();
        let streaming = live.iter().filter(|s| s.routes() > 0).count();
        // counters without `_total`: the encoder adds it
        let rows: [(&str, MetricType, &str, u64); 4] = [
            (
                "seaweedfs_csi_filer_connections",
                MetricType::Gauge,
                "Filer connections shared by this process's volumes (one per filer).",
                live.len() as u64,
            ),
            (
                "seaweedfs_csi_metadata_subscriptions",
                MetricType::Gauge,
                "Filers this process holds a SubscribeMetadata stream on (one stream each).",
                streaming as u64,
            ),
            (
                "seaweedfs_csi_metadata_streams_opened",
                MetricType::Counter,
                "SubscribeMetadata streams opened (prefix-set changes and reconnects).",
                STREAMS_OPENED.load(Ordering::Relaxed),
            ),
            (
                "seaweedfs_csi_metadata_events_dropped",
                MetricType::Counter,
                "Events not queued for a volume whose queue was full (it gets a resync).",
                EVENTS_DROPPED.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, v) in rows {
            let no_labels: [(&str, &str); 0] = [];
            crate::metrics::encode_values(encoder, name, help, kind, [(no_labels, v)])?;
        }
        Ok(())
    }

    /// The shared connection for `opts`, created on first use. It lives as long as someone
    /// holds it (or a view of it); the last holder's drop closes its channels and stream.
    pub async fn connect(&self, opts: FilerClientOptions) -> Result<Arc<SharedFiler>> {
        let addresses = super::addr::FilerAddress::parse_all(&opts.addresses)
            .map_err(super::FilerError::InvalidArgument)?
            .iter()
            .map(|a| a.to_string())
            .collect();
        let sec = &opts.security;
        let mut tls_files = Vec::new();
        for p in [&sec.grpc_ca, &sec.grpc_client_cert, &sec.grpc_client_key] {
            tls_files.push(match p {
                Some(p) => file_fingerprint(p).await,
                None => None,
            });
        }
        let key = HubKey {
            addresses,
            security: opts.security.clone(),
            tls_files,
            call_timeout: opts.call_timeout,
            connect_timeout: opts.connect_timeout,
        };
        if let Some(s) = self.find(&key) {
            return Ok(s);
        }
        // connect() does not touch the network, so two racing callers cost nothing.
        let grpc = GrpcFiler::connect(opts).await?;
        let inner: Arc<dyn FilerApi> =
            Arc::new(crate::instrumented::InstrumentedFiler(Arc::new(grpc)));
        let mut conns = self.conns.lock();
        conns.retain(|(_, w)| w.strong_count() > 0);
        if let Some(s) = conns
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(s);
        }
        let shared = SharedFiler::new(inner);
        conns.push((key, Arc::downgrade(&shared)));
        Ok(shared)
    }

    fn find(&self, key: &HubKey) -> Option<Arc<SharedFiler>> {
        self.conns
            .lock()
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, w)| w.upgrade())
    }

    /// Live shared connections that include the filer at `address` (tests, per filer).
    pub fn connections_to(&self, address: &str) -> usize {
        self.conns
            .lock()
            .iter()
            .filter(|(k, w)| w.strong_count() > 0 && k.addresses.iter().any(|a| a == address))
            .count()
    }

    /// Live shared connections.
    pub fn connections(&self) -> usize {
        self.conns
            .lock()
            .iter()
            .filter(|(_, w)| w.strong_count() > 0)
            .count()
    }
}

/// One filer connection shared by every session of a node, and its one subscription.
pub struct SharedFiler {
    inner: Arc<dyn FilerApi>,
    router: Arc<Router>,
    /// The last good `GetFilerConfiguration` answer: every session's health check asks for
    /// it every few seconds, which would be filer load growing with the volumes per node.
    conf: Mutex<Option<(std::time::Instant, pb::GetFilerConfigurationResponse)>>,
}

/// How long one `GetFilerConfiguration` answer serves every session of a filer.
pub const CONFIGURATION_TTL: Duration = Duration::from_secs(4);

impl SharedFiler {
    /// Shares `inner` (any [`FilerApi`]; the hub uses the gRPC client).
    pub fn new(inner: Arc<dyn FilerApi>) -> Arc<SharedFiler> {
        Arc::new(SharedFiler {
            inner,
            router: Arc::new(Router::default()),
            conf: Mutex::new(None),
        })
    }

    /// A view for one session (or the controller) with a signature of its own.
    pub fn session(self: &Arc<Self>) -> Arc<SessionFiler> {
        Arc::new(SessionFiler {
            shared: self.clone(),
            signature: random_nonzero(),
        })
    }

    /// `SubscribeMetadata` streams opened so far (one per prefix-set change or reconnect).
    pub fn streams_opened(&self) -> u64 {
        self.router.streams_opened.load(Ordering::Relaxed)
    }

    /// Sessions currently subscribed.
    pub fn routes(&self) -> usize {
        self.router.state.lock().routes.len()
    }
}

/// A session's view of a [`SharedFiler`]: same channels, its own signature.
pub struct SessionFiler {
    shared: Arc<SharedFiler>,
    signature: i32,
}

fn sign(signatures: &mut Vec<i32>, me: i32) {
    if signatures.is_empty() {
        signatures.push(me);
    }
}

impl SessionFiler {
    /// Subscribes to the events under `prefix` (e.g. `"/buckets/pvc-1/"`) after `since_ns`,
    /// except this view's own. Dropping the [`Subscription`] ends the route.
    pub fn subscribe(&self, prefix: &str, since_ns: i64) -> Subscription {
        self.shared
            .router
            .add(&self.shared.inner, prefix, self.signature, since_ns)
    }

    pub fn shared(&self) -> &Arc<SharedFiler> {
        &self.shared
    }
}

#[async_trait::async_trait]
impl FilerApi for SessionFiler {
    async fn lookup_entry(&self, dir: &str, name: &str) -> Result<pb::Entry> {
        self.shared.inner.lookup_entry(dir, name).await
    }
    async fn list_page(
        &self,
        dir: &str,
        start_from: &str,
        inclusive: bool,
        limit: u32,
    ) -> Result<Vec<pb::Entry>> {
        self.shared
            .inner
            .list_page(dir, start_from, inclusive, limit)
            .await
    }
    async fn create_entry(
        &self,
        mut req: pb::CreateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        sign(&mut req.signatures, self.signature);
        self.shared.inner.create_entry(req).await
    }
    async fn update_entry(
        &self,
        mut req: pb::UpdateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        sign(&mut req.signatures, self.signature);
        self.shared.inner.update_entry(req).await
    }
    async fn delete_entry(
        &self,
        mut req: pb::DeleteEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        sign(&mut req.signatures, self.signature);
        self.shared.inner.delete_entry(req).await
    }
    async fn rename_entry(
        &self,
        mut req: pb::StreamRenameEntryRequest,
    ) -> Result<Vec<pb::StreamRenameEntryResponse>> {
        sign(&mut req.signatures, self.signature);
        self.shared.inner.rename_entry(req).await
    }
    async fn assign_volume(
        &self,
        req: pb::AssignVolumeRequest,
    ) -> Result<pb::AssignVolumeResponse> {
        self.shared.inner.assign_volume(req).await
    }
    async fn lookup_volume(&self, volume_id: u32) -> Result<Vec<pb::Location>> {
        self.shared.inner.lookup_volume(volume_id).await
    }
    async fn statistics(&self, req: pb::StatisticsRequest) -> Result<pb::StatisticsResponse> {
        self.shared.inner.statistics(req).await
    }
    async fn link_group(&self, id: &[u8]) -> Result<Option<pb::Entry>> {
        self.shared.inner.link_group(id).await
    }
    /// Shared by the sessions for [`CONFIGURATION_TTL`]; failures are not remembered, so a
    /// filer that went away is noticed by the next caller.
    async fn configuration(&self) -> Result<pb::GetFilerConfigurationResponse> {
        if let Some((at, c)) = &*self.shared.conf.lock() {
            if at.elapsed() < CONFIGURATION_TTL {
                return Ok(c.clone());
            }
        }
        let c = self.shared.inner.configuration().await?;
        *self.shared.conf.lock() = Some((std::time::Instant::now(), c.clone()));
        Ok(c)
    }
    async fn subscribe_once(&self, req: pb::SubscribeMetadataRequest) -> Result<MetadataStream> {
        self.shared.inner.subscribe_once(req).await
    }
    fn http_address(&self) -> String {
        self.shared.inner.http_address()
    }
    fn signature(&self) -> i32 {
        self.signature
    }
}

/// A session's end of the shared subscription; dropping it removes the route.
pub struct Subscription {
    rx: mpsc::Receiver<SubscriptionEvent>,
    _route: RouteGuard,
}

impl Subscription {
    /// The next event for this session. (A method, not a public field: a task that moved
    /// only the receiver out would drop the route with the rest of the struct.)
    pub async fn recv(&mut self) -> Option<SubscriptionEvent> {
        self.rx.recv().await
    }
}

struct RouteGuard {
    router: Arc<Router>,
    id: u64,
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        self.router.state.lock().routes.remove(&self.id);
        self.router.changed.notify_one();
    }
}

struct Route {
    /// `"/"` or a directory with a trailing slash.
    prefix: String,
    signature: i32,
    tx: mpsc::Sender<SubscriptionEvent>,
    /// The highest `ts_ns` of the events the route's streams carried (its `since_ns` at
    /// first). Only chooses where a restarted stream resumes: stamps are not monotone.
    resume_ns: i64,
    /// The running stream's request carries this route's prefix: only then do its events
    /// tell anything about this route (a route added later waits for the restart).
    covered: bool,
    /// Fingerprints of the events sent (or owed as a resync), with the route's position
    /// when each was seen (monotone, so the oldest are in front).
    seen: VecDeque<(i64, u64)>,
    seen_set: HashSet<u64>,
    /// The highest position of a forgotten fingerprint: a replay from at or below it may
    /// repeat an event that cannot be recognised.
    forgot_ns: i64,
    /// Events were dropped (full queue) or may be lost (reconnect): owes a Resync.
    owes_resync: bool,
    /// A new session gets events stamped before its `since_ns` as rechecks until an event
    /// stamped after it arrives: a stream restarted for another route's sake replays older
    /// events, and applied after the session's own fresh lookups they would bring back older
    /// states (an older chunk list after a remount). Not dropped: a stamp is the filer's
    /// clock (or a peer filer's) and `since_ns` the node's, so such an event may be newer
    /// than the session's reads. No time limit: a recheck loses nothing, it only costs a
    /// lookup, while a replay may take long or interleave a peer filer's older stamps.
    floor_ns: Option<i64>,
}

impl Route {
    fn new(
        prefix: &str,
        signature: i32,
        since_ns: i64,
    ) -> (Route, mpsc::Receiver<SubscriptionEvent>) {
        let (tx, rx) = mpsc::channel(SESSION_QUEUE);
        let r = Route {
            prefix: prefix.to_string(),
            signature,
            tx,
            resume_ns: since_ns,
            covered: false,
            seen: VecDeque::new(),
            seen_set: HashSet::new(),
            forgot_ns: i64::MIN,
            owes_resync: false,
            floor_ns: Some(since_ns),
        };
        (r, rx)
    }

    /// Records `fp`; false if it was recorded already (a replayed event).
    fn first_sight(&mut self, fp: u64) -> bool {
        if !self.seen_set.insert(fp) {
            return false;
        }
        self.seen.push_back((self.resume_ns, fp));
        while let Some(&(at, old)) = self.seen.front() {
            if self.seen.len() <= SEEN_MAX && at >= self.resume_ns.saturating_sub(SEEN_WINDOW) {
                break;
            }
            self.seen.pop_front();
            self.seen_set.remove(&old);
            self.forgot_ns = self.forgot_ns.max(at);
        }
        true
    }

    fn wants(&self, src: &str, dst: &str, sigs: &[i32]) -> bool {
        let under = |p: &str| !p.is_empty() && p.starts_with(&self.prefix);
        (under(src) || under(dst)) && !sigs.contains(&self.signature)
    }

    /// Sends what the route owes, then `ev`; never waits.
    fn deliver(&mut self, ev: Option<SubscriptionEvent>) {
        use mpsc::error::TrySendError;
        if self.owes_resync {
            match self.tx.try_send(SubscriptionEvent::Resync) {
                Ok(()) => self.owes_resync = false,
                // the resync still to come covers `ev`
                Err(e) => {
                    if ev.is_some() && matches!(e, TrySendError::Full(_)) {
                        EVENTS_DROPPED.fetch_add(1, Ordering::Relaxed);
                    }
                    return;
                }
            }
        }
        if let Some(ev) = ev {
            if let Err(TrySendError::Full(_)) = self.tx.try_send(ev) {
                EVENTS_DROPPED.fetch_add(1, Ordering::Relaxed);
                self.owes_resync = true;
            }
        }
    }
}

/// Identifies an event across a replay: the same event comes back with the same stamp.
fn fingerprint(ev: &pb::SubscribeMetadataResponse) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ev.ts_ns.hash(&mut h);
    ev.directory.hash(&mut h);
    if let Some(n) = &ev.event_notification {
        n.old_entry.as_ref().map(|e| &e.name).hash(&mut h);
        n.new_entry.as_ref().map(|e| &e.name).hash(&mut h);
        n.new_parent_path.hash(&mut h);
    }
    h.finish()
}

#[derive(Default)]
struct RouterState {
    routes: HashMap<u64, Route>,
    next_id: u64,
    /// A subscription task runs (it ends when the last route goes).
    running: bool,
}

#[derive(Default)]
struct Router {
    state: Mutex<RouterState>,
    /// Routes were added or removed.
    changed: Notify,
    streams_opened: AtomicU64,
}

/// The smallest prefix set covering `prefixes` (nested ones are covered by their parent).
fn cover(prefixes: impl IntoIterator<Item = String>) -> Vec<String> {
    let sorted: BTreeSet<String> = prefixes.into_iter().collect();
    let mut out: Vec<String> = Vec::new();
    for p in sorted {
        // in sorted order, anything a kept prefix covers comes right after it
        if out.last().is_some_and(|q| p.starts_with(q.as_str())) {
            continue;
        }
        out.push(p);
    }
    out
}

/// Source and target path of an event, as the filer matches them against prefixes.
fn event_paths(ev: &pb::SubscribeMetadataResponse) -> (String, String) {
    let join = |d: &str, n: &str| {
        if d.ends_with('/') {
            format!("{d}{n}")
        } else {
            format!("{d}/{n}")
        }
    };
    let Some(n) = &ev.event_notification else {
        return (String::new(), String::new());
    };
    let src = n
        .old_entry
        .as_ref()
        .or(n.new_entry.as_ref())
        .map(|e| join(&ev.directory, &e.name))
        .unwrap_or_default();
    let dst = n
        .new_entry
        .as_ref()
        .map(|e| {
            let d = if n.new_parent_path.is_empty() {
                &ev.directory
            } else {
                &n.new_parent_path
            };
            join(d, &e.name)
        })
        .unwrap_or_default();
    (src, dst)
}

impl Router {
    fn add(
        self: &Arc<Self>,
        inner: &Arc<dyn FilerApi>,
        prefix: &str,
        signature: i32,
        since_ns: i64,
    ) -> Subscription {
        let (route, rx) = Route::new(prefix, signature, since_ns);
        let mut st = self.state.lock();
        let id = st.next_id;
        st.next_id += 1;
        st.routes.insert(id, route);
        if !st.running {
            st.running = true;
            tokio::spawn(run(inner.clone(), self.clone()));
        }
        drop(st);
        self.changed.notify_one();
        Subscription {
            rx,
            _route: RouteGuard {
                router: self.clone(),
                id,
            },
        }
    }

    /// The prefix set and start position of the next stream, which covers every route from
    /// now on; None (and the task is over) when no route is left.
    fn plan(&self) -> Option<(Vec<String>, i64)> {
        let mut st = self.state.lock();
        if st.routes.is_empty() {
            st.running = false;
            return None;
        }
        let prefixes = cover(st.routes.values().map(|r| r.prefix.clone()));
        let low = st.routes.values().map(|r| r.resume_ns).min().unwrap_or(0);
        let since = low.saturating_sub(RESUME_MARGIN);
        for r in st.routes.values_mut() {
            // It forgot events the replay may repeat: a resync, and then the whole replay in
            // log order (skipping only the events it remembers could end it on an older
            // state: an evicted create replayed, the remembered delete after it skipped; and
            // a resync does not reread open files, so none of it may be dropped).
            if r.forgot_ns >= since {
                r.owes_resync = true;
                r.seen.clear();
                r.seen_set.clear();
                r.forgot_ns = i64::MIN;
            }
            r.covered = true;
        }
        Some((prefixes, since))
    }

    /// The running stream (of `prefixes`) no longer fits the routes: a prefix went, or a
    /// route came, which needs a replay from its own `since_ns` even if a parent prefix is
    /// carried already.
    fn needs_replan(&self, prefixes: &[String]) -> bool {
        let st = self.state.lock();
        st.routes.values().any(|r| !r.covered)
            || cover(st.routes.values().map(|r| r.prefix.clone())) != prefixes
    }

    fn dispatch(&self, ev: pb::SubscribeMetadataResponse) {
        let change = has_change(&ev);
        let (src, dst) = event_paths(&ev);
        let sigs: &[i32] = ev
            .event_notification
            .as_ref()
            .map(|n| n.signatures.as_slice())
            .unwrap_or(&[]);
        let mut fp = None;
        let mut st = self.state.lock();
        for r in st.routes.values_mut() {
            if !r.covered {
                // this stream may not carry its prefix: its position must not move
                if r.owes_resync {
                    r.deliver(None);
                }
                continue;
            }
            r.resume_ns = r.resume_ns.max(ev.ts_ns);
            let predates = r.floor_ns.is_some_and(|f| ev.ts_ns < f);
            if !predates {
                r.floor_ns = None;
            }
            if change
                && r.wants(&src, &dst, sigs)
                && r.first_sight(*fp.get_or_insert_with(|| fingerprint(&ev)))
            {
                r.deliver(Some(if predates {
                    SubscriptionEvent::Recheck(ev.clone())
                } else {
                    SubscriptionEvent::Event(ev.clone())
                }));
            } else if r.owes_resync {
                r.deliver(None);
            }
        }
    }

    /// After a gap every session must treat its caches as stale.
    fn resync_all(&self) {
        for r in self.state.lock().routes.values_mut() {
            r.owes_resync = true;
            r.deliver(None);
        }
    }

    fn retry_resyncs(&self) {
        for r in self.state.lock().routes.values_mut() {
            if r.owes_resync {
                r.deliver(None);
            }
        }
    }
}

/// Why a stream ended.
enum Ended {
    /// The prefix set changed: reopen at once, no gap.
    Replan,
    /// Broken or refused: back off, then resync everyone.
    Lost,
    /// No route left.
    Done,
}

async fn run(inner: Arc<dyn FilerApi>, router: Arc<Router>) {
    let client_id = random_nonzero();
    let mut epoch: i32 = 0;
    let mut pauses = crate::retry::RECONNECT.pauses();
    let mut had_stream = false;
    let mut gap = false;
    while let Some((prefixes, since_ns)) = router.plan() {
        // The filer refuses a second stream of one client_id with an epoch <= the active one.
        epoch = epoch.wrapping_add(1).max(1);
        // path_prefix must not be empty (it would match every path); the filer matches an
        // event's source and target path against path_prefix and every path_prefixes.
        let req = pb::SubscribeMetadataRequest {
            client_name: CLIENT_NAME.into(),
            path_prefix: prefixes[0].clone(),
            path_prefixes: prefixes[1..].to_vec(),
            since_ns,
            signature: 0,
            client_id,
            client_epoch: epoch,
            ..Default::default()
        };
        let opened = tokio::select! {
            r = inner.subscribe_once(req) => r,
            _ = router.changed.notified() => continue,
        };
        let ended = match opened {
            Err(e) => {
                tracing::warn!(error = %e, "metadata subscription failed to open");
                gap |= had_stream;
                Ended::Lost
            }
            Ok(stream) => {
                router.streams_opened.fetch_add(1, Ordering::Relaxed);
                STREAMS_OPENED.fetch_add(1, Ordering::Relaxed);
                if gap {
                    tracing::info!(since_ns, epoch, "metadata subscription reconnected");
                    router.resync_all();
                    gap = false;
                }
                had_stream = true;
                let ended = pump(&router, stream, &prefixes, &mut pauses).await;
                if matches!(ended, Ended::Lost) {
                    gap = true;
                }
                ended
            }
        };
        match ended {
            Ended::Replan => {
                // volumes are often staged in bursts: one restart for a burst
                tokio::time::sleep(REPLAN_SETTLE).await;
                continue;
            }
            Ended::Done => continue, // plan() ends the task
            Ended::Lost => {
                let sleep = tokio::time::sleep(pauses.next_pause());
                tokio::pin!(sleep);
                loop {
                    tokio::select! {
                        _ = &mut sleep => break,
                        _ = router.changed.notified() => {
                            if router.state.lock().routes.is_empty() {
                                break;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Forwards one stream's events until it ends or the prefix set changes.
async fn pump(
    router: &Router,
    mut stream: MetadataStream,
    prefixes: &[String],
    pauses: &mut crate::retry::Pauses,
) -> Ended {
    let mut tick = tokio::time::interval(RESYNC_RETRY);
    loop {
        tokio::select! {
            _ = router.changed.notified() => {
                if router.state.lock().routes.is_empty() {
                    return Ended::Done;
                }
                if router.needs_replan(prefixes) {
                    return Ended::Replan;
                }
            }
            _ = tick.tick() => router.retry_resyncs(),
            item = stream.next() => match item {
                Some(Ok(msg)) => {
                    *pauses = crate::retry::RECONNECT.pauses();
                    for ev in flatten(msg) {
                        router.dispatch(ev);
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "metadata subscription broke");
                    return Ended::Lost;
                }
                None => {
                    tracing::info!("metadata subscription ended by filer");
                    return Ended::Lost;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filer::mock::MockFiler;

    fn mk(dir: &str, name: &str) -> pb::CreateEntryRequest {
        pb::CreateEntryRequest {
            directory: dir.into(),
            entry: Some(pb::Entry {
                name: name.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn mv(od: &str, on: &str, nd: &str, nn: &str) -> pb::StreamRenameEntryRequest {
        pb::StreamRenameEntryRequest {
            old_directory: od.into(),
            old_name: on.into(),
            new_directory: nd.into(),
            new_name: nn.into(),
            ..Default::default()
        }
    }

    fn now_ns() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64
    }

    /// `dir/name` of an event's new entry (old entry for a delete), or `<resync>`.
    fn what(ev: &SubscriptionEvent) -> String {
        match ev {
            SubscriptionEvent::Resync => "<resync>".into(),
            SubscriptionEvent::Recheck(e) => {
                format!("recheck {}", what(&SubscriptionEvent::Event(e.clone())))
            }
            SubscriptionEvent::Event(e) => {
                let n = e.event_notification.as_ref().unwrap();
                match (&n.old_entry, &n.new_entry) {
                    (_, Some(ne)) => {
                        let d = if n.new_parent_path.is_empty() {
                            &e.directory
                        } else {
                            &n.new_parent_path
                        };
                        format!("{}/{}", d.trim_end_matches('/'), ne.name)
                    }
                    (Some(o), None) => format!("-{}/{}", e.directory.trim_end_matches('/'), o.name),
                    _ => "?".into(),
                }
            }
        }
    }

    async fn next(s: &mut Subscription) -> String {
        let ev = tokio::time::timeout(Duration::from_secs(10), s.recv())
            .await
            .expect("event in time")
            .expect("channel open");
        what(&ev)
    }

    /// Nothing more arrives within a short while.
    async fn quiet(s: &mut Subscription) {
        if let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(300), s.recv()).await {
            panic!("unexpected event {}", what(&ev));
        }
    }

    async fn wait_for(mut cond: impl FnMut() -> bool, what: &str) {
        let t0 = std::time::Instant::now();
        while !cond() {
            assert!(t0.elapsed() < Duration::from_secs(10), "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A recording double: the requests of every stream opened.
    /// With `lag`, each message waits that long before it is handed over (a stream that is
    /// behind the filer's log, so that a restart has events in flight).
    struct Rec {
        inner: MockFiler,
        seen: Mutex<Vec<pb::SubscribeMetadataRequest>>,
        lag: Option<Duration>,
    }

    fn rec(m: &MockFiler) -> Arc<Rec> {
        Arc::new(Rec {
            inner: m.clone(),
            seen: Default::default(),
            lag: None,
        })
    }

    #[async_trait::async_trait]
    impl FilerApi for Rec {
        async fn lookup_entry(&self, d: &str, n: &str) -> Result<pb::Entry> {
            self.inner.lookup_entry(d, n).await
        }
        async fn list_page(&self, d: &str, s: &str, i: bool, l: u32) -> Result<Vec<pb::Entry>> {
            self.inner.list_page(d, s, i, l).await
        }
        async fn create_entry(
            &self,
            r: pb::CreateEntryRequest,
        ) -> Result<Option<pb::SubscribeMetadataResponse>> {
            self.inner.create_entry(r).await
        }
        async fn update_entry(
            &self,
            r: pb::UpdateEntryRequest,
        ) -> Result<Option<pb::SubscribeMetadataResponse>> {
            self.inner.update_entry(r).await
        }
        async fn delete_entry(
            &self,
            r: pb::DeleteEntryRequest,
        ) -> Result<Option<pb::SubscribeMetadataResponse>> {
            self.inner.delete_entry(r).await
        }
        async fn rename_entry(
            &self,
            r: pb::StreamRenameEntryRequest,
        ) -> Result<Vec<pb::StreamRenameEntryResponse>> {
            self.inner.rename_entry(r).await
        }
        async fn assign_volume(
            &self,
            r: pb::AssignVolumeRequest,
        ) -> Result<pb::AssignVolumeResponse> {
            self.inner.assign_volume(r).await
        }
        async fn lookup_volume(&self, v: u32) -> Result<Vec<pb::Location>> {
            self.inner.lookup_volume(v).await
        }
        async fn statistics(&self, r: pb::StatisticsRequest) -> Result<pb::StatisticsResponse> {
            self.inner.statistics(r).await
        }
        async fn configuration(&self) -> Result<pb::GetFilerConfigurationResponse> {
            self.inner.configuration().await
        }
        async fn subscribe_once(&self, r: pb::SubscribeMetadataRequest) -> Result<MetadataStream> {
            self.seen.lock().push(r.clone());
            let s = self.inner.subscribe_once(r).await?;
            Ok(match self.lag {
                None => s,
                Some(d) => s
                    .then(move |m| async move {
                        tokio::time::sleep(d).await;
                        m
                    })
                    .boxed(),
            })
        }
        fn http_address(&self) -> String {
            self.inner.http_address()
        }
        fn signature(&self) -> i32 {
            self.inner.signature()
        }
    }

    #[test]
    fn cover_drops_nested_and_duplicate_prefixes() {
        let c = cover(["/b/x/", "/a/", "/a/", "/b/", "/ab/", "/a/deep/"].map(String::from));
        assert_eq!(c, ["/a/", "/ab/", "/b/"]);
        assert_eq!(cover(["/", "/a/"].map(String::from)), ["/"]);
    }

    #[tokio::test]
    async fn routes_by_path_and_a_rename_between_roots_reaches_both() {
        let m = MockFiler::new();
        let other = m.other_client();
        let r = rec(&m);
        let shared = SharedFiler::new(r.clone());
        let (a, b) = (shared.session(), shared.session());
        let t = now_ns();
        let mut sa = a.subscribe("/a/", t);
        let mut sb = b.subscribe("/b/", t);
        wait_for(|| shared.routes() == 2, "routes").await;
        other.create_entry(mk("/a", "x")).await.unwrap();
        other.create_entry(mk("/b", "y")).await.unwrap();
        other.create_entry(mk("/c", "z")).await.unwrap();
        assert_eq!(next(&mut sa).await, "/a/x");
        assert_eq!(next(&mut sb).await, "/b/y");
        other.rename_entry(mv("/a", "x", "/b", "x2")).await.unwrap();
        assert_eq!(next(&mut sa).await, "/b/x2", "source root sees it leave");
        assert_eq!(next(&mut sb).await, "/b/x2", "target root sees it arrive");
        quiet(&mut sa).await;
        quiet(&mut sb).await;
        // one stream, no server-side signature filter, a non-empty path_prefix
        let last = r.seen.lock().last().cloned().unwrap();
        assert_eq!(last.signature, 0);
        let mut all = last.path_prefixes.clone();
        all.push(last.path_prefix.clone());
        all.sort();
        assert_eq!(all, ["/a/", "/b/"]);
        assert_ne!(last.client_id, 0);
    }

    #[tokio::test]
    async fn own_events_dropped_per_session_only() {
        let m = MockFiler::new();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let (a, twin, nested) = (shared.session(), shared.session(), shared.session());
        let mut dir = mk("/v", "sub");
        dir.entry.as_mut().unwrap().is_directory = true;
        m.other_client().create_entry(dir).await.unwrap();
        let t = now_ns();
        let mut sa = a.subscribe("/v/", t);
        // another volume of this node on the same filer path, and one nested inside it
        let mut st = twin.subscribe("/v/", t);
        let mut sn = nested.subscribe("/v/sub/", t);
        wait_for(|| shared.routes() == 3, "routes").await;
        a.create_entry(mk("/v", "mine")).await.unwrap();
        a.create_entry(mk("/v/sub", "deep")).await.unwrap();
        twin.create_entry(mk("/v", "theirs")).await.unwrap();
        nested.create_entry(mk("/v/sub", "n")).await.unwrap();
        // the directory's creation, from before the sessions began, comes as a recheck;
        // a's own changes are not sent back to a, but reach the others
        assert_eq!(next(&mut sa).await, "recheck /v/sub");
        assert_eq!(next(&mut sa).await, "/v/theirs");
        assert_eq!(next(&mut sa).await, "/v/sub/n");
        quiet(&mut sa).await;
        assert_eq!(next(&mut st).await, "recheck /v/sub");
        assert_eq!(next(&mut st).await, "/v/mine");
        assert_eq!(next(&mut st).await, "/v/sub/deep");
        assert_eq!(next(&mut st).await, "/v/sub/n");
        quiet(&mut st).await;
        assert_eq!(next(&mut sn).await, "/v/sub/deep");
        quiet(&mut sn).await;
    }

    #[tokio::test]
    async fn prefix_changes_lose_and_repeat_nothing() {
        let m = MockFiler::new();
        let other = m.other_client();
        let r = Arc::new(Rec {
            lag: Some(Duration::from_millis(6)),
            ..Arc::into_inner(rec(&m)).unwrap()
        });
        let shared = SharedFiler::new(r.clone());
        let a = shared.session();
        let t0 = now_ns();
        let mut sa = a.subscribe("/a/", t0);
        wait_for(|| shared.streams_opened() == 1, "first stream").await;
        // a steady writer in /a while volumes come and go
        const N: usize = 240;
        let w = other.clone();
        let writer = tokio::spawn(async move {
            for i in 0..N {
                w.create_entry(mk("/a", &format!("f{i:03}"))).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        let mut later = Vec::new();
        for i in 0..6 {
            let s = shared.session();
            // one starts in the past: the stream replays from there, /a must not see twice
            let since = if i == 4 { t0 } else { now_ns() };
            let sub = s.subscribe(&format!("/b{i}/"), since);
            tokio::time::sleep(REPLAN_SETTLE + Duration::from_millis(30)).await;
            if i % 2 == 0 {
                drop(sub); // unstaged again
            } else {
                later.push((s, sub));
            }
        }
        writer.await.unwrap();
        for i in 0..N {
            assert_eq!(next(&mut sa).await, format!("/a/f{i:03}"));
        }
        quiet(&mut sa).await;
        assert!(
            shared.streams_opened() >= 4,
            "the prefix set changed: {} streams",
            shared.streams_opened()
        );
        // a newly added volume starts at its own "now": none of /a's history, its own events
        let (_, sub) = &mut later[0];
        other.create_entry(mk("/b1", "new")).await.unwrap();
        assert_eq!(next(sub).await, "/b1/new");
        // restarts resume where the slowest session was, less the margin
        let seen = r.seen.lock().clone();
        assert!(seen.iter().all(|q| q.since_ns >= t0 - RESUME_MARGIN));
        assert!(seen
            .windows(2)
            .all(|w| w[1].client_epoch > w[0].client_epoch));
    }

    #[tokio::test]
    async fn a_burst_of_stages_shares_its_restarts() {
        let m = MockFiler::new();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let a = shared.session();
        let _sa = a.subscribe("/a/", now_ns());
        wait_for(|| shared.streams_opened() == 1, "first stream").await;
        let mut subs = Vec::new();
        for i in 0..10 {
            let v = shared.session();
            subs.push((v.subscribe(&format!("/v{i}/"), now_ns()), v));
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        tokio::time::sleep(REPLAN_SETTLE * 3).await;
        let n = shared.streams_opened();
        assert!(n <= 3, "ten stages within 150 ms: {n} streams");
    }

    #[tokio::test]
    async fn events_stamped_out_of_order_are_delivered() {
        let m = MockFiler::new();
        let other = m.other_client();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let a = shared.session();
        let mut sa = a.subscribe("/a/", now_ns());
        wait_for(|| shared.streams_opened() == 1, "stream").await;
        other.create_entry(mk("/a", "x")).await.unwrap();
        // stamped before x, logged after it (a racing mutation, or a peer filer's event)
        m.stamp_next_back(1_000_000_000);
        other.create_entry(mk("/a", "y")).await.unwrap();
        assert_eq!(next(&mut sa).await, "/a/x");
        assert_eq!(next(&mut sa).await, "/a/y");
        quiet(&mut sa).await;
    }

    #[tokio::test]
    async fn a_restart_replays_the_margin_without_repeats() {
        let m = MockFiler::new();
        let other = m.other_client();
        let r = rec(&m);
        let shared = SharedFiler::new(r.clone());
        let a = shared.session();
        let mut sa = a.subscribe("/a/", now_ns());
        wait_for(|| shared.streams_opened() == 1, "stream").await;
        other.create_entry(mk("/a", "x")).await.unwrap();
        m.stamp_next_back(1_000_000_000);
        other.create_entry(mk("/a", "y")).await.unwrap();
        assert_eq!(next(&mut sa).await, "/a/x");
        assert_eq!(next(&mut sa).await, "/a/y");
        // a volume staged: the stream restarts before x and y, which a has seen
        let b = shared.session();
        let _sb = b.subscribe("/b/", now_ns());
        wait_for(|| shared.streams_opened() == 2, "restart").await;
        let since = r.seen.lock()[1].since_ns;
        let x_ts = m.events()[0].ts_ns;
        assert!(since < x_ts, "the replay covers x");
        // stamped before everything delivered so far, logged after the restart
        m.stamp_next_back(3_000_000_000);
        other.create_entry(mk("/a", "z")).await.unwrap();
        assert_eq!(next(&mut sa).await, "/a/z");
        quiet(&mut sa).await;
    }

    /// A router with no subscription task, for driving `plan` and `dispatch` by hand.
    fn bare_route(
        router: &Router,
        prefix: &str,
        since_ns: i64,
    ) -> (u64, mpsc::Receiver<SubscriptionEvent>) {
        let (route, rx) = Route::new(prefix, 1, since_ns);
        let mut st = router.state.lock();
        let id = st.next_id;
        st.next_id += 1;
        st.routes.insert(id, route);
        (id, rx)
    }

    /// What a route's queue holds now, as `what` spells each event.
    fn drained(rx: &mut mpsc::Receiver<SubscriptionEvent>) -> Vec<String> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|e| what(&e))
            .collect()
    }

    fn created(dir: &str, name: &str, ts_ns: i64) -> pb::SubscribeMetadataResponse {
        pb::SubscribeMetadataResponse {
            directory: dir.into(),
            ts_ns,
            event_notification: Some(pb::EventNotification {
                new_entry: mk(dir, name).entry,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_new_route_keeps_its_position_until_a_stream_carries_it() {
        const S: i64 = 1_000_000_000;
        let router = Router::default();
        let (_, mut ra) = bare_route(&router, "/a/", 100 * S);
        let (prefixes, since) = router.plan().unwrap();
        assert_eq!((prefixes, since), (vec!["/a/".to_string()], 98 * S));
        router.dispatch(created("/a", "x", 150 * S));
        // staged while the /a stream runs, from an earlier point of its own
        let (_, mut rb) = bare_route(&router, "/b/", 120 * S);
        router.dispatch(created("/a", "y", 160 * S));
        assert!(router.needs_replan(&["/a/".to_string()]));
        let (prefixes, since) = router.plan().unwrap();
        assert_eq!(prefixes, ["/a/", "/b/"]);
        assert_eq!(since, 118 * S, "b's own since_ns, less the margin");
        assert!(!router.needs_replan(&prefixes));
        // the replay: a skips what it had, b gets its events from its start
        for ev in [
            created("/a", "x", 150 * S),
            created("/b", "early", 155 * S),
            created("/a", "y", 160 * S),
        ] {
            router.dispatch(ev);
        }
        assert_eq!(drained(&mut ra), ["/a/x", "/a/y"]);
        assert_eq!(drained(&mut rb), ["/b/early"]);
    }

    #[test]
    fn a_replay_for_an_older_route_brings_a_new_one_nothing_older_than_itself() {
        const S: i64 = 1_000_000_000;
        let router = Router::default();
        let (_, mut ra) = bare_route(&router, "/a/", 10 * S);
        router.plan().unwrap();
        // staged much later, while /a was quiet: the restart replays from a's position
        let (_, mut rb) = bare_route(&router, "/b/", 200 * S);
        assert_eq!(router.plan().unwrap().1, 8 * S);
        for ev in [
            created("/b", "ancient", 100 * S), // before b existed: its first listing has it
            created("/b", "recent", 199 * S),  // before b's start (by the node's clock)
            created("/b", "new", 250 * S),
            created("/a", "x", 260 * S),
            // caught up: live events count whatever their stamp (a peer filer's clock)
            created("/b", "peer", 100 * S),
        ] {
            router.dispatch(ev);
        }
        // from before b's start: may be older than b's own lookups, so b rereads, not applies
        assert_eq!(
            drained(&mut rb),
            [
                "recheck /b/ancient",
                "recheck /b/recent",
                "/b/new",
                "/b/peer"
            ]
        );
        assert_eq!(drained(&mut ra), ["/a/x"]);
        // a route whose replay never reaches its start (a quiet prefix): rechecks until an
        // event from after its start comes, however long that takes
        let (_, mut rc) = bare_route(&router, "/c/", 300 * S);
        router.plan().unwrap();
        router.dispatch(created("/c", "early", 250 * S));
        // (the floor once ended after 5 s, and an older state applied after that could
        // stand for good in an open file)
        std::thread::sleep(Duration::from_millis(5200));
        router.dispatch(created("/c", "late-peer", 260 * S));
        router.dispatch(created("/c", "live", 301 * S));
        router.dispatch(created("/c", "later-peer", 270 * S));
        assert_eq!(
            drained(&mut rc),
            [
                "recheck /c/early",
                "recheck /c/late-peer",
                "/c/live",
                "/c/later-peer"
            ]
        );
    }

    #[test]
    fn a_replay_past_forgotten_fingerprints_resyncs() {
        const S: i64 = 1_000_000_000;
        let router = Router::default();
        let (_, mut ra) = bare_route(&router, "/a/", 0);
        router.plan().unwrap();
        router.dispatch(created("/a", "old", 10 * S));
        router.dispatch(created("/a", "new", 10 * S + SEEN_WINDOW + S));
        assert_eq!(ra.try_recv().map(|e| what(&e)).unwrap(), "/a/old");
        assert_eq!(ra.try_recv().map(|e| what(&e)).unwrap(), "/a/new");
        // a restart near a's position: "old" (forgotten) is not replayed, nothing owed
        router.plan().unwrap();
        router.retry_resyncs();
        assert!(ra.try_recv().is_err());
        // a route from before "old": the replay would repeat it unrecognised
        let (_, _rb) = bare_route(&router, "/b/", 9 * S);
        router.plan().unwrap();
        router.retry_resyncs();
        assert_eq!(ra.try_recv().map(|e| what(&e)).unwrap(), "<resync>");
        // the count bound too
        let router = Router::default();
        let (_, mut ra) = bare_route(&router, "/a/", 0);
        router.plan().unwrap();
        for i in 0..SEEN_MAX as i64 + 1 {
            router.dispatch(created("/a", &format!("{i}"), S + i));
            ra.try_recv().unwrap();
        }
        router.plan().unwrap();
        router.retry_resyncs();
        assert_eq!(ra.try_recv().map(|e| what(&e)).unwrap(), "<resync>");
    }

    /// Found in review: a replay that only skipped the remembered events re-sent an evicted
    /// create and skipped the remembered delete after it, ending the session on a file that
    /// was gone.
    #[test]
    fn a_replay_past_forgotten_fingerprints_ends_on_the_current_state() {
        const S: i64 = 1_000_000_000;
        let router = Router::default();
        let (_, mut ra) = bare_route(&router, "/a/", 100 * S);
        router.plan().unwrap();
        let deleted = pb::SubscribeMetadataResponse {
            directory: "/a".into(),
            ts_ns: 140 * S,
            event_notification: Some(pb::EventNotification {
                old_entry: mk("/a", "x").entry,
                ..Default::default()
            }),
            ..Default::default()
        };
        // x's fingerprint is out of the window by the time of the delete
        let log = [created("/a", "x", 100 * S), deleted];
        let play = |router: &Router, ra: &mut mpsc::Receiver<SubscriptionEvent>| {
            for e in log.clone() {
                router.dispatch(e);
            }
            drained(ra)
        };
        assert_eq!(play(&router, &mut ra), ["/a/x", "-/a/x"]);
        // a volume staged from before x: the replay starts before it
        let (_, _rb) = bare_route(&router, "/b/", 99 * S);
        assert!(router.plan().unwrap().1 < 100 * S);
        assert_eq!(play(&router, &mut ra), ["<resync>", "/a/x", "-/a/x"]);
    }

    #[tokio::test]
    async fn a_nested_route_gets_its_own_history() {
        let m = MockFiler::new();
        let other = m.other_client();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let a = shared.session();
        let _sa = a.subscribe("/a/", now_ns());
        wait_for(|| shared.streams_opened() == 1, "stream").await;
        let t = now_ns();
        other.create_entry(mk("/a/n", "early")).await.unwrap();
        // the prefix set does not change, but the stream passed n's start already
        tokio::time::sleep(Duration::from_millis(50)).await;
        let n = shared.session();
        let mut sn = n.subscribe("/a/n/", t);
        assert_eq!(next(&mut sn).await, "/a/n/early");
        other.create_entry(mk("/a/n", "later")).await.unwrap();
        assert_eq!(next(&mut sn).await, "/a/n/later");
        quiet(&mut sn).await;
    }

    #[tokio::test]
    async fn resync_reaches_every_session_after_a_disconnect() {
        let m = MockFiler::new();
        let other = m.other_client();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let (a, b) = (shared.session(), shared.session());
        let t = now_ns();
        let mut sa = a.subscribe("/a/", t);
        let mut sb = b.subscribe("/b/", t);
        wait_for(|| shared.streams_opened() >= 1, "stream").await;
        other.create_entry(mk("/a", "1")).await.unwrap();
        assert_eq!(next(&mut sa).await, "/a/1");
        m.fail_next(1); // the first reconnect attempt fails too
        m.disconnect_subscribers();
        wait_for(|| m.calls("subscribe_once") >= 3, "reconnect").await;
        other.create_entry(mk("/b", "2")).await.unwrap();
        assert_eq!(next(&mut sa).await, "<resync>");
        assert_eq!(next(&mut sb).await, "<resync>");
        assert_eq!(next(&mut sb).await, "/b/2");
        quiet(&mut sa).await;
    }

    #[tokio::test]
    async fn a_stuck_session_gets_a_resync_and_stalls_nobody() {
        let m = MockFiler::new();
        let other = m.other_client();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let (slow, fast) = (shared.session(), shared.session());
        let t = now_ns();
        let mut ss = slow.subscribe("/s/", t);
        let mut sf = fast.subscribe("/f/", t);
        wait_for(|| shared.streams_opened() >= 1, "stream").await;
        let n = SESSION_QUEUE + 50;
        for i in 0..n {
            other.create_entry(mk("/s", &format!("{i}"))).await.unwrap();
        }
        other.create_entry(mk("/f", "after")).await.unwrap();
        // the fast session is not held up by the full one
        assert_eq!(next(&mut sf).await, "/f/after");
        // the slow one gets what fitted, then a resync in place of what did not
        let mut got = 0;
        loop {
            match next(&mut ss).await.as_str() {
                "<resync>" => break,
                _ => got += 1,
            }
        }
        assert_eq!(got, SESSION_QUEUE);
        assert!(EVENTS_DROPPED.load(Ordering::Relaxed) >= 50);
        other.create_entry(mk("/s", "again")).await.unwrap();
        assert_eq!(next(&mut ss).await, "/s/again");
    }

    #[tokio::test]
    async fn the_stream_ends_with_the_last_route_and_restarts_on_demand() {
        let m = MockFiler::new();
        let other = m.other_client();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let a = shared.session();
        let sa = a.subscribe("/a/", now_ns());
        wait_for(|| shared.streams_opened() == 1, "stream").await;
        drop(sa);
        wait_for(|| !shared.router.state.lock().running, "task ends").await;
        let mut sa = a.subscribe("/a/", now_ns());
        wait_for(|| shared.streams_opened() == 2, "stream again").await;
        other.create_entry(mk("/a", "x")).await.unwrap();
        assert_eq!(next(&mut sa).await, "/a/x");
    }

    #[tokio::test]
    async fn hub_shares_one_connection_per_filer_configuration() {
        let hub = FilerHub::new();
        let opts = |a: &str| FilerClientOptions {
            addresses: vec![a.into()],
            ..Default::default()
        };
        let x = hub.connect(opts("127.0.0.1:1")).await.unwrap();
        let y = hub.connect(opts("127.0.0.1:1")).await.unwrap();
        let z = hub.connect(opts("127.0.0.1:2")).await.unwrap();
        assert!(Arc::ptr_eq(&x, &y));
        assert!(!Arc::ptr_eq(&x, &z));
        assert_eq!(hub.connections(), 2);
        // views share it and sign differently
        let (v1, v2) = (x.session(), x.session());
        assert!(Arc::ptr_eq(v1.shared(), v2.shared()));
        assert_ne!(v1.signature(), v2.signature());
        drop((x, y, z));
        assert_eq!(hub.connections(), 1, "held by its views");
        drop((v1, v2));
        assert_eq!(hub.connections(), 0, "the last holder closes it");
        assert!(hub.connect(opts("not an address")).await.is_err());
    }

    #[tokio::test]
    async fn rotated_tls_files_get_a_new_connection() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, crt, key) = (
            dir.path().join("ca.crt"),
            dir.path().join("c.crt"),
            dir.path().join("c.key"),
        );
        let write = |when: u64| {
            let k = rcgen::KeyPair::generate().unwrap();
            let c = rcgen::CertificateParams::new(vec!["filer.invalid".to_string()])
                .unwrap()
                .self_signed(&k)
                .unwrap();
            for (p, text) in [(&ca, c.pem()), (&crt, c.pem()), (&key, k.serialize_pem())] {
                std::fs::write(p, text).unwrap();
                let t = std::time::UNIX_EPOCH + Duration::from_secs(when);
                let f = std::fs::File::options().write(true).open(p).unwrap();
                f.set_modified(t).unwrap();
            }
        };
        write(1_000_000);
        let opts = || FilerClientOptions {
            addresses: vec!["127.0.0.1:1".into()],
            security: SecurityConfig {
                grpc_ca: Some(ca.clone()),
                grpc_client_cert: Some(crt.clone()),
                grpc_client_key: Some(key.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        let hub = FilerHub::new();
        let a = hub.connect(opts()).await.unwrap();
        let b = hub.connect(opts()).await.unwrap();
        assert!(Arc::ptr_eq(&a, &b), "same files: shared");
        // cert-manager renewed them; copied with their times kept
        write(1_000_000);
        let c = hub.connect(opts()).await.unwrap();
        assert!(!Arc::ptr_eq(&a, &c), "renewed files: a new connection");
        assert_eq!(hub.connections(), 2);
    }

    #[tokio::test]
    async fn sessions_share_configuration_answers_but_not_failures() {
        let m = MockFiler::new();
        let shared = SharedFiler::new(Arc::new(m.clone()));
        let views: Vec<_> = (0..50).map(|_| shared.session()).collect();
        for v in &views {
            v.configuration().await.unwrap();
        }
        assert_eq!(
            m.calls("configuration"),
            1,
            "one call serves 50 health checks"
        );
        // a failure is not kept: the next check asks the filer again
        *shared.conf.lock() = None;
        m.fail_next(1);
        assert!(views[0].configuration().await.is_err());
        views[1].configuration().await.unwrap();
        assert_eq!(m.calls("configuration"), 3);
    }

    #[tokio::test]
    async fn metrics_show_connections_streams_and_drops() {
        // the collector exports a hub for as long as the process runs
        let hub: &'static FilerHub = Box::leak(Box::new(FilerHub::new()));
        let render = || crate::metrics::render_collector(Box::new(HubCollector(hub)));
        let x = hub
            .connect(FilerClientOptions {
                addresses: vec!["127.0.0.1:1".into()],
                ..Default::default()
            })
            .await
            .unwrap();
        let out = render();
        assert!(
            out.contains("\nseaweedfs_csi_filer_connections 1\n"),
            "{out}"
        );
        assert!(
            out.contains("\nseaweedfs_csi_metadata_subscriptions 0\n"),
            "{out}"
        );
        assert!(out.contains("# TYPE seaweedfs_csi_metadata_events_dropped_total counter"));
        drop(x);
        let out = render();
        assert!(
            out.contains("\nseaweedfs_csi_filer_connections 0\n"),
            "{out}"
        );
    }
}
