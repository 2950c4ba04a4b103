//! In-memory [`FilerApi`] double for unit tests, with the filer semantics upper layers rely on:
//!
//! - entries keyed by full path; `/` always exists;
//! - `CreateEntry` is an upsert keeping the old `crtime` and `inode`; `o_excl` refuses existing
//!   entries; a file over a directory is `IsADirectory`, a directory over a file `AlreadyExists`;
//!   names over 255 bytes are `NameTooLong`; missing parents are created unless
//!   `skip_check_parent_directory` (then orphans are allowed). Like filer 4.48, a child under a
//!   regular file is accepted and turns that file into a directory (mode `ModeDir|0755`, content
//!   kept): callers must check parents themselves;
//! - inode 0 is assigned as `u64::from_be_bytes(md5(path)[0..8]) + crtime * 37` (wrapping);
//! - `DeleteEntry` of a missing entry succeeds, a non-empty directory needs `is_recursive`;
//! - rename moves whole subtrees and returns one event per moved entry;
//! - `ListEntries` is sorted by name and paged, a missing directory lists as empty;
//! - `AssignVolume` hands out fake fids `1,<hex>` on location `mock:0`;
//! - subscriptions see events whose `signatures` do not contain the subscriber's signature;
//!   they resume by log position (exclusive), not by `ts_ns`: like the real filer, an event
//!   may carry a stamp older than events logged before it ([`MockFiler::stamp_next_back`]).
//!
//! Several [`MockFiler`] handles can share one namespace ([`MockFiler::other_client`]), each
//! with its own signature, to simulate foreign writers. Fault injection: [`MockFiler::fail_next`].
//!
//! Over 800 lines: a whole filer double (namespace, event log, subscriptions, faults) with its
//! own tests; test support only.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::StreamExt;
use md5::{Digest, Md5};
use parking_lot::Mutex;
use tokio::sync::{broadcast, watch};

use super::{pb, FilerApi, FilerError, MetadataStream, Result};

/// Go's `os.ModeDir` bit in `file_mode`.
const MODE_DIR: u32 = 1 << 31;
/// The mock filer's own signature, appended to every event like the real one does.
pub const MOCK_FILER_SIGNATURE: i32 = 0x5EAF_11E5;
const MAX_NAME_LEN: usize = 255;

/// In-memory filer double (see module doc). Cheap to clone; clones share state and signature.
#[derive(Clone)]
pub struct MockFiler {
    shared: Arc<Shared>,
    signature: i32,
}

struct Shared {
    state: Mutex<State>,
    events: broadcast::Sender<(i64, pb::SubscribeMetadataResponse)>,
    /// Bumped to cut every open subscription stream (with an Unavailable error).
    disconnect: watch::Sender<u64>,
    faults: Mutex<Option<(u32, FilerError)>>,
    calls: Mutex<HashMap<&'static str, u64>>,
    next_key: AtomicU64,
    total_size: AtomicU64,
    /// Lookups to hold after they read (see [`MockFiler::hold_next_lookup`]).
    holds: Mutex<Vec<(String, Arc<LookupHold>)>>,
    /// Conditions checked as SeaweedFS 4.29-4.40 does (see [`MockFiler::conditions_as_4_40`]).
    conditions_as_4_40: std::sync::atomic::AtomicBool,
    /// See [`MockFiler::away_for_next_conditional_creates`].
    away_creates: std::sync::atomic::AtomicU32,
    /// Creates to answer with `Unavailable` after storing them.
    lost_replies: std::sync::atomic::AtomicU32,
    /// See [`MockFiler::commits_before_next_conditional_creates`].
    commits_first: Mutex<std::collections::VecDeque<(String, pb::Entry)>>,
}

/// A lookup held between reading its entry and answering, as a slow network holds it.
#[derive(Default)]
pub struct LookupHold {
    arrived: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

impl LookupHold {
    /// Waits until the held lookup has read its entry.
    pub async fn arrived(&self) {
        self.arrived.notified().await;
    }

    /// Lets the held lookup answer (with what it read before).
    pub fn release(&self) {
        self.release.notify_one();
    }
}

struct State {
    entries: BTreeMap<String, pb::Entry>,
    /// Live subscribers; every logged event is also sent here.
    tx: broadcast::Sender<(i64, pb::SubscribeMetadataResponse)>,
    /// Events with their log position (monotone, like the filer's LogEntry ts).
    log: Vec<(i64, pb::SubscribeMetadataResponse)>,
    last_ts: i64,
    /// The next event's `ts_ns` is this much older than its log position.
    stamp_back: i64,
}

fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

fn split(path: &str) -> (String, String) {
    match path.rfind('/') {
        Some(0) => ("/".into(), path[1..].into()),
        Some(i) => (path[..i].into(), path[i + 1..].into()),
        None => ("/".into(), path.into()),
    }
}

/// Normalizes a directory argument: no trailing slash except for the root.
fn norm_dir(dir: &str) -> String {
    let d = dir.trim_end_matches('/');
    if d.is_empty() {
        "/".into()
    } else if d.starts_with('/') {
        d.into()
    } else {
        format!("/{d}")
    }
}

/// The inode the filer assigns when a client leaves it 0.
pub fn inode_for(path: &str, crtime: i64) -> u64 {
    let h = Md5::digest(path.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[..8]);
    u64::from_be_bytes(b).wrapping_add((crtime as u64).wrapping_mul(37))
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn child_prefix(dir: &str) -> String {
    if dir == "/" {
        "/".into()
    } else {
        format!("{dir}/")
    }
}

impl State {
    fn is_dir(&self, path: &str) -> bool {
        path == "/" || self.entries.get(path).is_some_and(|e| e.is_directory)
    }

    fn exists(&self, path: &str) -> bool {
        path == "/" || self.entries.contains_key(path)
    }

    fn has_children(&self, dir: &str) -> bool {
        let p = child_prefix(dir);
        self.entries
            .range(p.clone()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(&p))
    }

    /// Paths of every descendant of `dir`, in key order.
    fn descendants(&self, dir: &str) -> Vec<String> {
        let p = child_prefix(dir);
        self.entries
            .range(p.clone()..)
            .take_while(|(k, _)| k.starts_with(&p))
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn next_ts(&mut self) -> i64 {
        self.last_ts = now_ns().max(self.last_ts + 1);
        self.last_ts
    }

    fn log_event(
        &mut self,
        directory: &str,
        old_entry: Option<pb::Entry>,
        new_entry: Option<pb::Entry>,
        new_parent_path: &str,
        signatures: &[i32],
        delete_chunks: bool,
    ) -> pb::SubscribeMetadataResponse {
        let mut sigs = signatures.to_vec();
        sigs.push(MOCK_FILER_SIGNATURE);
        let ev = pb::SubscribeMetadataResponse {
            directory: directory.into(),
            event_notification: Some(pb::EventNotification {
                old_entry,
                new_entry,
                delete_chunks,
                new_parent_path: new_parent_path.into(),
                is_from_other_cluster: false,
                signatures: sigs,
            }),
            ..Default::default()
        };
        let pos = self.next_ts();
        let ev = pb::SubscribeMetadataResponse {
            ts_ns: pos - std::mem::take(&mut self.stamp_back),
            ..ev
        };
        self.log.push((pos, ev.clone()));
        let _ = self.tx.send((pos, ev.clone()));
        ev
    }
}

impl Default for MockFiler {
    fn default() -> Self {
        Self::new()
    }
}

fn random_signature() -> i32 {
    loop {
        let s: i32 = rand::random();
        if s != 0 && s != MOCK_FILER_SIGNATURE {
            return s;
        }
    }
}

fn event_paths(ev: &pb::SubscribeMetadataResponse) -> (String, String) {
    let Some(n) = &ev.event_notification else {
        return (ev.directory.clone(), String::new());
    };
    let src_name = n
        .old_entry
        .as_ref()
        .or(n.new_entry.as_ref())
        .map(|e| e.name.as_str())
        .unwrap_or("");
    let src = join(&ev.directory, src_name);
    let dst = match &n.new_entry {
        Some(e) if !n.new_parent_path.is_empty() => join(&n.new_parent_path, &e.name),
        _ => String::new(),
    };
    (src, dst)
}

fn matches_subscription(
    req: &pb::SubscribeMetadataRequest,
    ev: &pb::SubscribeMetadataResponse,
) -> bool {
    if req.signature != 0
        && ev
            .event_notification
            .as_ref()
            .is_some_and(|n| n.signatures.contains(&req.signature))
    {
        return false;
    }
    if req.until_ns > 0 && ev.ts_ns > req.until_ns {
        return false;
    }
    let (src, dst) = event_paths(ev);
    let mut prefixes: Vec<&str> = req.path_prefixes.iter().map(String::as_str).collect();
    if !req.path_prefix.is_empty() || (prefixes.is_empty() && req.directories.is_empty()) {
        prefixes.push(&req.path_prefix);
    }
    let by_prefix = prefixes
        .iter()
        .any(|p| src.starts_with(p) || (!dst.is_empty() && dst.starts_with(p)));
    by_prefix || req.directories.contains(&ev.directory)
}

impl MockFiler {
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(4096);
        let (disconnect, _) = watch::channel(0);
        MockFiler {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    entries: BTreeMap::new(),
                    tx: events.clone(),
                    log: Vec::new(),
                    last_ts: 0,
                    stamp_back: 0,
                }),
                events,
                disconnect,
                faults: Mutex::new(None),
                calls: Mutex::new(HashMap::new()),
                next_key: AtomicU64::new(1),
                total_size: AtomicU64::new(1 << 40),
                holds: Mutex::new(Vec::new()),
                conditions_as_4_40: Default::default(),
                away_creates: Default::default(),
                commits_first: Default::default(),
                lost_replies: Default::default(),
            }),
            signature: random_signature(),
        }
    }

    /// Another client of the same namespace with its own signature (a "foreign" writer).
    pub fn other_client(&self) -> MockFiler {
        MockFiler {
            shared: self.shared.clone(),
            signature: random_signature(),
        }
    }

    /// The next `n` API calls (of any client sharing this namespace) fail with `Unavailable`.
    pub fn fail_next(&self, n: u32) {
        self.fail_next_with(n, FilerError::Unavailable("injected fault".into()));
    }

    /// The next `n` API calls fail with `err`.
    pub fn fail_next_with(&self, n: u32, err: FilerError) {
        *self.shared.faults.lock() = (n > 0).then_some((n, err));
    }

    /// Ends every open subscription stream with an `Unavailable` error (a filer restart).
    pub fn disconnect_subscribers(&self) {
        self.shared.disconnect.send_modify(|g| *g += 1);
    }

    /// How many times `op` (the trait method name, e.g. `"lookup_entry"`) was called.
    pub fn calls(&self, op: &str) -> u64 {
        self.shared.calls.lock().get(op).copied().unwrap_or(0)
    }

    /// Checks write conditions as SeaweedFS 4.29-4.40 does: on creates only (updates ignore
    /// them), and a clause kind it does not know (`IF_CHUNKS_EQUAL`, 4.41) never holds. Its
    /// configuration says 4.40 from now on.
    pub fn conditions_as_4_40(&self) {
        self.shared.conditions_as_4_40.store(true, Ordering::SeqCst);
    }

    /// The next `n` conditional creates find no entry at their name, as if another client
    /// had moved it away just then and back right after (0: none from now on).
    pub fn away_for_next_conditional_creates(&self, n: u32) {
        self.shared.away_creates.store(n, Ordering::SeqCst);
    }

    /// Each of the next conditional creates first finds one of `entries` stored at
    /// `dir/name` by another client, in turn (a file busy with other writers' commits; no
    /// event is sent for them).
    pub fn commits_before_next_conditional_creates(&self, dir: &str, entries: Vec<pb::Entry>) {
        let mut q = self.shared.commits_first.lock();
        q.extend(entries.into_iter().map(|e| (dir.to_string(), e)));
    }

    /// The next create is stored, and its caller gets `Unavailable` instead of the answer
    /// (a connection lost after the filer acted).
    pub fn lose_next_create_reply(&self) {
        self.shared.lost_replies.fetch_add(1, Ordering::SeqCst);
    }

    fn take_lost_reply(&self) -> bool {
        self.shared
            .lost_replies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn old_conditions(&self) -> bool {
        self.shared.conditions_as_4_40.load(Ordering::SeqCst)
    }

    /// The next lookup of `path` (full path) reads the entry, then waits for
    /// [`LookupHold::release`] before it answers with what it read.
    pub fn hold_next_lookup(&self, path: &str) -> Arc<LookupHold> {
        self.hold_next("lookup_entry", path)
    }

    /// The next rename of `path` (its source) is applied, then waits for
    /// [`LookupHold::release`] before it answers (the reply is still on its way).
    pub fn hold_next_rename(&self, path: &str) -> Arc<LookupHold> {
        self.hold_next("rename_entry", path)
    }

    /// The next update of `path` is applied, then waits for [`LookupHold::release`] before
    /// it answers.
    pub fn hold_next_update(&self, path: &str) -> Arc<LookupHold> {
        self.hold_next("update_entry", path)
    }

    /// The next create of `path` waits for [`LookupHold::release`] before it is applied.
    pub fn hold_next_create(&self, path: &str) -> Arc<LookupHold> {
        self.hold_next("create_entry", path)
    }

    fn hold_next(&self, op: &str, path: &str) -> Arc<LookupHold> {
        let h = Arc::new(LookupHold::default());
        self.shared
            .holds
            .lock()
            .push((format!("{op} {path}"), h.clone()));
        h
    }

    /// Applies an update (see [`MockFiler::hold_next_update`] for the answer's hold).
    fn update_now(
        &self,
        req: pb::UpdateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        let dir = norm_dir(&req.directory);
        let mut entry = req
            .entry
            .ok_or_else(|| FilerError::InvalidArgument("update without entry".into()))?;
        let path = join(&dir, &entry.name);
        let sigs = self.sigs(&req.signatures);
        let mut st = self.shared.state.lock();
        let Some(old) = st.entries.get(&path).cloned() else {
            return Err(FilerError::NotFound(path));
        };
        if !self.old_conditions() && !condition_holds(req.condition.as_ref(), Some(&old)) {
            return Err(FilerError::Changed(format!(
                "update {path}: precondition failed"
            )));
        }
        let attrs = entry.attributes.get_or_insert_with(Default::default);
        if attrs.inode == 0 {
            attrs.inode = old.attributes.as_ref().map(|a| a.inode).unwrap_or(0);
        }
        if old == entry {
            return Ok(None);
        }
        st.entries.insert(path, entry.clone());
        Ok(Some(st.log_event(
            &dir,
            Some(old),
            Some(entry),
            &dir,
            &sigs,
            false,
        )))
    }

    /// The rename itself, applied at once (see [`FilerApi::rename_entry`]).
    fn rename_now(
        &self,
        req: pb::StreamRenameEntryRequest,
    ) -> Result<Vec<pb::StreamRenameEntryResponse>> {
        let (od, nd) = (norm_dir(&req.old_directory), norm_dir(&req.new_directory));
        let (src, dst) = (join(&od, &req.old_name), join(&nd, &req.new_name));
        check_name(&req.new_name, &dst)?;
        let sigs = self.sigs(&req.signatures);
        let mut st = self.shared.state.lock();
        let Some(src_entry) = st.entries.get(&src).cloned() else {
            return Err(FilerError::NotFound(format!(
                "rename source {src}: no entry is found"
            )));
        };
        if src == dst {
            return Ok(Vec::new());
        }
        if !st.exists(&nd) {
            return Err(FilerError::NotFound(format!(
                "rename target directory {nd} not found"
            )));
        }
        if !st.is_dir(&nd) {
            return Err(FilerError::NotADirectory(format!(
                "rename target {nd} is not directory"
            )));
        }
        if src_entry.is_directory && (dst.starts_with(&format!("{src}/")) || nd == src) {
            return Err(FilerError::InvalidArgument(format!(
                "cannot move {src} into itself"
            )));
        }
        if let Some(t) = st.entries.get(&dst).cloned() {
            match (src_entry.is_directory, t.is_directory) {
                (true, true) if st.has_children(&dst) => {
                    return Err(FilerError::NotEmpty(format!(
                        "rename target {dst} is not empty"
                    )))
                }
                (false, true) => return Err(FilerError::IsADirectory(dst)),
                (true, false) => {
                    return Err(FilerError::NotADirectory(format!("{dst} is not directory")))
                }
                _ => {}
            }
            st.entries.remove(&dst);
        }
        // Move the entry, then its descendants (parents before children, like the filer's events).
        let mut moves = vec![(src.clone(), dst.clone())];
        for d in st.descendants(&src) {
            let nd2 = format!("{dst}{}", &d[src.len()..]);
            moves.push((d, nd2));
        }
        let mut out = Vec::new();
        for (from, to) in moves {
            let Some(old) = st.entries.remove(&from) else {
                continue;
            };
            let (from_dir, _) = split(&from);
            let (to_dir, to_name) = split(&to);
            let mut new = old.clone();
            new.name = to_name;
            st.entries.insert(to, new.clone());
            let ev = st.log_event(&from_dir, Some(old), Some(new), &to_dir, &sigs, false);
            out.push(pb::StreamRenameEntryResponse {
                directory: ev.directory,
                event_notification: ev.event_notification,
                ts_ns: ev.ts_ns,
            });
        }
        Ok(out)
    }

    /// Waits at a hold set for `op` on `path`, if there is one.
    async fn wait_at_hold(&self, op: &str, path: &str) {
        let key = format!("{op} {path}");
        let hold = {
            let mut holds = self.shared.holds.lock();
            let i = holds.iter().position(|(p, _)| *p == key);
            i.map(|i| holds.remove(i).1)
        };
        if let Some(h) = hold {
            h.arrived.notify_one();
            h.release.notified().await;
        }
    }

    /// Total bytes reported by `statistics`.
    pub fn set_total_size(&self, bytes: u64) {
        self.shared.total_size.store(bytes, Ordering::Relaxed);
    }

    /// Direct read of an entry by full path (no fault injection, no call counting).
    pub fn get(&self, path: &str) -> Option<pb::Entry> {
        self.shared.state.lock().entries.get(path).cloned()
    }

    /// Every stored path, sorted.
    pub fn paths(&self) -> Vec<String> {
        self.shared.state.lock().entries.keys().cloned().collect()
    }

    /// Every logged event so far.
    pub fn events(&self) -> Vec<pb::SubscribeMetadataResponse> {
        self.shared
            .state
            .lock()
            .log
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// The next logged event gets a `ts_ns` `ns` older than its log position, as when the
    /// filer stamps two racing mutations in one order and logs them in the other, or an
    /// event comes from a peer filer.
    pub fn stamp_next_back(&self, ns: i64) {
        self.shared.state.lock().stamp_back = ns;
    }

    fn enter(&self, op: &'static str) -> Result<()> {
        *self.shared.calls.lock().entry(op).or_default() += 1;
        let mut f = self.shared.faults.lock();
        if let Some((n, err)) = f.as_mut() {
            let e = err.clone();
            *n -= 1;
            if *n == 0 {
                *f = None;
            }
            return Err(e);
        }
        Ok(())
    }

    fn sigs(&self, s: &[i32]) -> Vec<i32> {
        if s.is_empty() {
            vec![self.signature]
        } else {
            s.to_vec()
        }
    }
}

fn check_name(name: &str, path: &str) -> Result<()> {
    if name.is_empty() || name.contains('/') {
        return Err(FilerError::InvalidArgument(format!(
            "bad name {name:?} for {path}"
        )));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(FilerError::NameTooLong(path.into()));
    }
    Ok(())
}

impl MockFiler {
    async fn create_entry_now(
        &self,
        req: pb::CreateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        self.enter("create_entry")?;
        let dir = norm_dir(&req.directory);
        let mut entry = req
            .entry
            .ok_or_else(|| FilerError::InvalidArgument("create without entry".into()))?;
        let path = join(&dir, &entry.name);
        check_name(&entry.name, &path)?;
        self.wait_at_hold("create_entry", &path).await;
        let sigs = self.sigs(&req.signatures);
        let mut st = self.shared.state.lock();
        if st.exists(&dir) && !st.is_dir(&dir) {
            return Err(FilerError::NotADirectory(format!(
                "parent of {path} is a file"
            )));
        }
        if req.condition.is_some() {
            let mut q = self.shared.commits_first.lock();
            if q.front().is_some_and(|(d, e)| join(d, &e.name) == path) {
                let (_, e) = q.pop_front().expect("checked");
                st.entries.insert(path.clone(), e);
            }
        }
        let old = st.entries.get(&path).cloned();
        let mut cond = req.condition.clone();
        if let Some(c) = cond.as_mut().filter(|_| self.old_conditions()) {
            for cl in &mut c.clauses {
                if cl.kind() == pb::write_condition::Kind::IfChunksEqual {
                    // unknown there: never holds
                    cl.kind = i32::MAX;
                }
            }
        }
        let away = cond.is_some()
            && self
                .shared
                .away_creates
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if !condition_holds(cond.as_ref(), old.as_ref().filter(|_| !away)) {
            return Err(FilerError::Changed(format!(
                "create {path}: precondition failed"
            )));
        }
        if let Some(o) = &old {
            if req.o_excl {
                return Err(FilerError::AlreadyExists(path));
            }
            if o.is_directory && !entry.is_directory {
                return Err(FilerError::IsADirectory(path));
            }
            if !o.is_directory && entry.is_directory {
                return Err(FilerError::AlreadyExists(format!(
                    "{path} exists as a file"
                )));
            }
        }
        if !req.skip_check_parent_directory && !st.exists(&dir) {
            // Create missing ancestors, top-down, like the filer does.
            let mut missing = Vec::new();
            let mut d = dir.clone();
            while d != "/" && !st.exists(&d) {
                missing.push(d.clone());
                d = split(&d).0;
            }
            if !st.is_dir(&d) {
                return Err(FilerError::NotADirectory(format!(
                    "ancestor {d} of {path} is a file"
                )));
            }
            for m in missing.into_iter().rev() {
                let (pd, name) = split(&m);
                let now = now_ns() / 1_000_000_000;
                let mut e = pb::Entry {
                    name,
                    is_directory: true,
                    attributes: Some(pb::FuseAttributes {
                        mtime: now,
                        crtime: now,
                        file_mode: MODE_DIR | 0o755,
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                e.attributes.as_mut().unwrap().inode = inode_for(&m, now);
                st.entries.insert(m.clone(), e.clone());
                st.log_event(&pd, None, Some(e), &pd, &sigs, false);
            }
        }
        if let Some(parent) = st.entries.get(&dir).filter(|p| !p.is_directory).cloned() {
            let mut promoted = parent.clone();
            promoted.is_directory = true;
            promoted
                .attributes
                .get_or_insert_with(Default::default)
                .file_mode = MODE_DIR | 0o755;
            st.entries.insert(dir.clone(), promoted.clone());
            let (pd, _) = split(&dir);
            st.log_event(&pd, Some(parent), Some(promoted), &pd, &sigs, false);
        }
        let attrs = entry.attributes.get_or_insert_with(Default::default);
        if let Some(o) = old.as_ref().and_then(|o| o.attributes.as_ref()) {
            attrs.crtime = o.crtime;
            attrs.crtime_ns = o.crtime_ns;
            if o.inode != 0 {
                attrs.inode = o.inode;
            }
        }
        if attrs.inode == 0 {
            attrs.inode = inode_for(&path, attrs.crtime);
        }
        st.entries.insert(path, entry.clone());
        Ok(Some(st.log_event(
            &dir,
            old,
            Some(entry),
            &dir,
            &sigs,
            false,
        )))
    }
}

#[async_trait::async_trait]
impl FilerApi for MockFiler {
    async fn lookup_entry(&self, dir: &str, name: &str) -> Result<pb::Entry> {
        self.enter("lookup_entry")?;
        let path = join(&norm_dir(dir), name);
        let found = self.shared.state.lock().entries.get(&path).cloned();
        self.wait_at_hold("lookup_entry", &path).await;
        found.ok_or(FilerError::NotFound(path))
    }

    async fn list_page(
        &self,
        dir: &str,
        start_from: &str,
        inclusive: bool,
        limit: u32,
    ) -> Result<Vec<pb::Entry>> {
        self.enter("list_page")?;
        let dir = norm_dir(dir);
        let limit = if limit == 0 { 100_000 } else { limit as usize };
        let st = self.shared.state.lock();
        let prefix = child_prefix(&dir);
        let start_key = format!("{prefix}{start_from}");
        Ok(st
            .entries
            .range(start_key.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .filter(|(k, _)| !k[prefix.len()..].contains('/'))
            .filter(|(k, _)| inclusive || start_from.is_empty() || **k != start_key)
            .take(limit)
            .map(|(_, e)| e.clone())
            .collect())
    }

    async fn create_entry(
        &self,
        req: pb::CreateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        let r = self.create_entry_now(req).await;
        if r.is_ok() && self.take_lost_reply() {
            return Err(FilerError::Unavailable(
                "injected: the reply was lost".into(),
            ));
        }
        r
    }

    async fn update_entry(
        &self,
        req: pb::UpdateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        self.enter("update_entry")?;
        let path = req
            .entry
            .as_ref()
            .map(|e| join(&norm_dir(&req.directory), &e.name));
        let out = self.update_now(req);
        if let Some(path) = path {
            self.wait_at_hold("update_entry", &path).await;
        }
        out
    }

    async fn delete_entry(
        &self,
        req: pb::DeleteEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>> {
        self.enter("delete_entry")?;
        let dir = norm_dir(&req.directory);
        let path = join(&dir, &req.name);
        let sigs = self.sigs(&req.signatures);
        let mut st = self.shared.state.lock();
        let Some(old) = st.entries.get(&path).cloned() else {
            return Ok(None);
        };
        if old.is_directory && st.has_children(&path) {
            if !req.is_recursive {
                return Err(FilerError::NotEmpty(format!(
                    "fail to delete non-empty folder: {path}"
                )));
            }
            for d in st.descendants(&path) {
                st.entries.remove(&d);
            }
        }
        st.entries.remove(&path);
        Ok(Some(st.log_event(
            &dir,
            Some(old),
            None,
            "",
            &sigs,
            req.is_delete_data,
        )))
    }

    async fn rename_entry(
        &self,
        req: pb::StreamRenameEntryRequest,
    ) -> Result<Vec<pb::StreamRenameEntryResponse>> {
        self.enter("rename_entry")?;
        let src = join(&norm_dir(&req.old_directory), &req.old_name);
        let out = self.rename_now(req);
        self.wait_at_hold("rename_entry", &src).await;
        out
    }

    async fn assign_volume(
        &self,
        req: pb::AssignVolumeRequest,
    ) -> Result<pb::AssignVolumeResponse> {
        self.enter("assign_volume")?;
        let count = req.count.max(1);
        let key = self
            .shared
            .next_key
            .fetch_add(count as u64, Ordering::Relaxed);
        let cookie: u32 = rand::random();
        let loc = pb::Location {
            url: "mock:0".into(),
            public_url: "mock:0".into(),
            ..Default::default()
        };
        Ok(pb::AssignVolumeResponse {
            file_id: format!("1,{key:x}{cookie:08x}"),
            count,
            collection: req.collection,
            replication: req.replication,
            location: Some(loc),
            ..Default::default()
        })
    }

    async fn lookup_volume(&self, volume_id: u32) -> Result<Vec<pb::Location>> {
        self.enter("lookup_volume")?;
        if volume_id == 1 {
            Ok(vec![pb::Location {
                url: "mock:0".into(),
                public_url: "mock:0".into(),
                ..Default::default()
            }])
        } else {
            Err(FilerError::NotFound(format!("volume {volume_id}")))
        }
    }

    /// The mock keeps no separate record: a group lives while an entry carries its id, and
    /// that entry's count stands for the group's.
    async fn link_group(&self, id: &[u8]) -> Result<Option<pb::Entry>> {
        self.enter("link_group")?;
        let st = self.shared.state.lock();
        Ok(st
            .entries
            .values()
            .find(|e| !id.is_empty() && e.hard_link_id == id)
            .cloned())
    }

    async fn statistics(&self, _req: pb::StatisticsRequest) -> Result<pb::StatisticsResponse> {
        self.enter("statistics")?;
        let st = self.shared.state.lock();
        let files = st.entries.values().filter(|e| !e.is_directory);
        let (mut used, mut count) = (0u64, 0u64);
        for e in files {
            used += e.attributes.as_ref().map(|a| a.file_size).unwrap_or(0);
            count += 1;
        }
        let total = self.shared.total_size.load(Ordering::Relaxed);
        Ok(pb::StatisticsResponse {
            total_size: total,
            used_size: used,
            file_count: count,
            logical_total_size: total,
            logical_used_size: used,
        })
    }

    async fn configuration(&self) -> Result<pb::GetFilerConfigurationResponse> {
        self.enter("configuration")?;
        Ok(pb::GetFilerConfigurationResponse {
            masters: vec!["mock:9333".into()],
            max_mb: 4,
            dir_buckets: "/buckets".into(),
            signature: MOCK_FILER_SIGNATURE,
            version: if self.old_conditions() {
                "mock 4.40"
            } else {
                "mock 4.48"
            }
            .into(),
            major_version: 4,
            minor_version: if self.old_conditions() { 40 } else { 48 },
            ..Default::default()
        })
    }

    async fn subscribe_once(&self, req: pb::SubscribeMetadataRequest) -> Result<MetadataStream> {
        self.enter("subscribe_once")?;
        if req.client_id == 0 {
            // The real filer ends such a stream at once, with no events.
            return Ok(futures::stream::empty().boxed());
        }
        let (rx, backlog) = {
            let st = self.shared.state.lock();
            let rx = self.shared.events.subscribe();
            let backlog: Vec<_> = st
                .log
                .iter()
                .filter(|(pos, _)| *pos > req.since_ns)
                .cloned()
                .collect();
            (rx, backlog)
        };
        let last_backlog = backlog.last().map(|e| e.0).unwrap_or(req.since_ns);
        let cut = self.shared.disconnect.subscribe();
        let req = Arc::new(req);
        let r1 = req.clone();
        let backlog = futures::stream::iter(backlog)
            .map(|(_, e)| e)
            .filter(move |e| futures::future::ready(matches_subscription(&r1, e)));
        let live = futures::stream::unfold(
            (rx, cut, req, false),
            move |(mut rx, mut cut, req, done)| async move {
                if done {
                    return None;
                }
                loop {
                    tokio::select! {
                        _ = cut.changed() => {
                            let e = Err(FilerError::Unavailable("mock filer went away".into()));
                            return Some((e, (rx, cut, req, true)));
                        }
                        r = rx.recv() => match r {
                            Ok((pos, ev)) if pos > last_backlog && matches_subscription(&req, &ev) => {
                                return Some((Ok(ev), (rx, cut, req, false)));
                            }
                            Ok(_) => continue,
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                let e = Err(FilerError::Unavailable(format!("subscriber lagged by {n} events")));
                                return Some((e, (rx, cut, req, true)));
                            }
                            Err(broadcast::error::RecvError::Closed) => return None,
                        }
                    }
                }
            },
        );
        Ok(backlog.map(Ok).chain(live).boxed())
    }

    fn http_address(&self) -> String {
        "mock:8888".into()
    }

    fn signature(&self) -> i32 {
        self.signature
    }
}

/// The filer's check of a [`pb::WriteCondition`] against the stored entry, for the kinds this
/// client sends; any other kind fails, as on the filer.
fn condition_holds(cond: Option<&pb::WriteCondition>, current: Option<&pb::Entry>) -> bool {
    use pb::write_condition::Kind;
    cond.is_none_or(|c| {
        c.clauses.iter().all(|cl| match Kind::try_from(cl.kind) {
            Ok(Kind::None) => true,
            Ok(Kind::IfExists) => current.is_some(),
            Ok(Kind::IfNotExists) => current.is_none(),
            Ok(Kind::IfChunksEqual) => {
                let mut stored = current
                    .map(|e| crate::volume::fid::chunk_file_ids(&e.chunks))
                    .unwrap_or_default();
                let mut want = cl.fids.clone();
                stored.sort();
                want.sort();
                stored == want
            }
            _ => false,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, size: u64) -> pb::Entry {
        pb::Entry {
            name: name.into(),
            attributes: Some(pb::FuseAttributes {
                file_size: size,
                crtime: 100,
                mtime: 100,
                file_mode: 0o644,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn dir(name: &str) -> pb::Entry {
        pb::Entry {
            name: name.into(),
            is_directory: true,
            attributes: Some(pb::FuseAttributes {
                crtime: 100,
                file_mode: MODE_DIR | 0o755,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn create(d: &str, e: pb::Entry) -> pb::CreateEntryRequest {
        pb::CreateEntryRequest {
            directory: d.into(),
            entry: Some(e),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn create_upsert_keeps_crtime_and_inode() {
        let m = MockFiler::new();
        m.create_entry(create("/a", file("f", 1))).await.unwrap();
        assert!(
            m.lookup_entry("/", "a").await.unwrap().is_directory,
            "parent auto-created"
        );
        let e = m.lookup_entry("/a", "f").await.unwrap();
        let ino = e.attributes.as_ref().unwrap().inode;
        assert_eq!(ino, inode_for("/a/f", 100));
        let mut f2 = file("f", 5);
        f2.attributes.as_mut().unwrap().crtime = 999;
        m.create_entry(create("/a", f2)).await.unwrap();
        let e = m.lookup_entry("/a", "f").await.unwrap();
        let a = e.attributes.unwrap();
        assert_eq!((a.crtime, a.inode, a.file_size), (100, ino, 5));

        let mut ex = create("/a", file("f", 1));
        ex.o_excl = true;
        assert!(matches!(
            m.create_entry(ex).await,
            Err(FilerError::AlreadyExists(_))
        ));
        assert!(matches!(
            m.create_entry(create("/", file("a", 0))).await,
            Err(FilerError::IsADirectory(_))
        ));
        assert!(matches!(
            m.create_entry(create("/a/f", file("x", 0))).await,
            Err(FilerError::NotADirectory(_))
        ));
        assert!(matches!(
            m.create_entry(create("/a", file(&"n".repeat(256), 0)))
                .await,
            Err(FilerError::NameTooLong(_))
        ));
        let mut orphan = create("/nowhere", file("o", 0));
        orphan.skip_check_parent_directory = true;
        m.create_entry(orphan).await.unwrap();
        assert!(
            m.get("/nowhere").is_none(),
            "skip_check_parent_directory creates no parents"
        );
        assert!(m.get("/nowhere/o").is_some());
    }

    #[test]
    fn inode_formula() {
        // first 8 bytes of md5(path), big-endian, plus crtime*37, wrapping.
        let h = Md5::digest(b"/a/f");
        let base = u64::from_be_bytes(h[..8].try_into().unwrap());
        assert_eq!(inode_for("/a/f", 0), base);
        assert_eq!(inode_for("/a/f", 10), base.wrapping_add(370));
        assert_eq!(inode_for("/a/f", -1), base.wrapping_sub(37));
    }

    #[tokio::test]
    async fn list_paging_sorted() {
        let m = MockFiler::new();
        m.create_entry(create("/", dir("d"))).await.unwrap();
        for i in (0..25).rev() {
            m.create_entry(create("/d", file(&format!("f{i:02}"), 0)))
                .await
                .unwrap();
        }
        m.create_entry(create("/d", dir("sub"))).await.unwrap();
        m.create_entry(create("/d/sub", file("deep", 0)))
            .await
            .unwrap();
        m.create_entry(create("/", file("d0", 0))).await.unwrap(); // sibling sharing the prefix
        let p1 = m.list_page("/d", "", false, 10).await.unwrap();
        assert_eq!(p1.first().unwrap().name, "f00");
        assert_eq!(p1.last().unwrap().name, "f09");
        let p2 = m.list_page("/d/", "f09", false, 10).await.unwrap();
        assert_eq!(p2.first().unwrap().name, "f10");
        let p3 = m.list_page("/d", "f09", true, 2).await.unwrap();
        assert_eq!(
            p3.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
            ["f09", "f10"]
        );
        let all = m.list_all("/d").await.unwrap();
        assert_eq!(all.len(), 26);
        assert_eq!(all.last().unwrap().name, "sub");
        assert!(m.list_all("/missing").await.unwrap().is_empty());
        let root: Vec<_> = m
            .list_all("/")
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(root, ["d", "d0"]);
    }

    #[tokio::test]
    async fn delete_semantics() {
        let m = MockFiler::new();
        m.create_entry(create("/d/s", file("f", 0))).await.unwrap();
        let del = |name: &str, recursive| pb::DeleteEntryRequest {
            directory: "/".into(),
            name: name.into(),
            is_recursive: recursive,
            ..Default::default()
        };
        assert!(matches!(
            m.delete_entry(del("d", false)).await,
            Err(FilerError::NotEmpty(_))
        ));
        assert!(m
            .delete_entry(del("missing", false))
            .await
            .unwrap()
            .is_none());
        m.delete_entry(del("d", true)).await.unwrap().unwrap();
        assert!(m.paths().is_empty(), "{:?}", m.paths());
    }

    #[tokio::test]
    async fn rename_moves_subtree() {
        let m = MockFiler::new();
        m.create_entry(create("/a/b", file("f", 0))).await.unwrap();
        m.create_entry(create("/", dir("t"))).await.unwrap();
        let ino = m.get("/a/b/f").unwrap().attributes.unwrap().inode;
        let rn = |od: &str, on: &str, nd: &str, nn: &str| pb::StreamRenameEntryRequest {
            old_directory: od.into(),
            old_name: on.into(),
            new_directory: nd.into(),
            new_name: nn.into(),
            signatures: vec![],
        };
        let evs = m.rename_entry(rn("/", "a", "/t", "a2")).await.unwrap();
        assert_eq!(evs.len(), 3);
        assert_eq!(evs[0].directory, "/");
        assert_eq!(
            evs[0].event_notification.as_ref().unwrap().new_parent_path,
            "/t"
        );
        assert_eq!(m.paths(), ["/t", "/t/a2", "/t/a2/b", "/t/a2/b/f"]);
        assert_eq!(m.get("/t/a2/b/f").unwrap().attributes.unwrap().inode, ino);
        assert!(matches!(
            m.rename_entry(rn("/", "a", "/t", "x")).await,
            Err(FilerError::NotFound(_))
        ));
        assert!(matches!(
            m.rename_entry(rn("/", "t", "/t/a2", "x")).await,
            Err(FilerError::InvalidArgument(_))
        ));
        m.create_entry(create("/", dir("full"))).await.unwrap();
        m.create_entry(create("/full", file("x", 0))).await.unwrap();
        assert!(matches!(
            m.rename_entry(rn("/t", "a2", "/", "full")).await,
            Err(FilerError::NotEmpty(_))
        ));
        assert!(matches!(
            m.rename_entry(rn("/full", "x", "/t", "a2")).await,
            Err(FilerError::IsADirectory(_))
        ));
        // file over file replaces
        m.create_entry(create("/", file("y", 3))).await.unwrap();
        m.rename_entry(rn("/full", "x", "/", "y")).await.unwrap();
        assert_eq!(m.get("/y").unwrap().attributes.unwrap().file_size, 0);
        assert!(m.get("/full/x").is_none());
    }

    #[tokio::test]
    async fn volumes_stats_config_and_faults() {
        let m = MockFiler::new();
        let a = m
            .assign_volume(pb::AssignVolumeRequest {
                count: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(a.file_id.starts_with("1,"), "{}", a.file_id);
        let b = m
            .assign_volume(pb::AssignVolumeRequest::default())
            .await
            .unwrap();
        assert_ne!(a.file_id, b.file_id);
        assert_eq!(a.location.unwrap().url, "mock:0");
        assert_eq!(m.lookup_volume(1).await.unwrap()[0].url, "mock:0");
        assert!(matches!(
            m.lookup_volume(7).await,
            Err(FilerError::NotFound(_))
        ));
        m.create_entry(create("/", file("f", 10))).await.unwrap();
        let s = m.statistics(Default::default()).await.unwrap();
        assert_eq!((s.used_size, s.file_count, s.total_size), (10, 1, 1 << 40));
        assert_eq!(
            m.configuration().await.unwrap().signature,
            MOCK_FILER_SIGNATURE
        );

        m.fail_next(2);
        assert!(matches!(
            m.lookup_entry("/", "f").await,
            Err(FilerError::Unavailable(_))
        ));
        assert!(matches!(
            m.statistics(Default::default()).await,
            Err(FilerError::Unavailable(_))
        ));
        assert!(m.lookup_entry("/", "f").await.is_ok());
        assert_eq!(m.calls("lookup_entry"), 2);
    }

    #[tokio::test]
    async fn subscription_filters_own_signature_and_prefix() {
        let me = MockFiler::new();
        let other = me.other_client();
        let req = pb::SubscribeMetadataRequest {
            client_id: 7,
            path_prefix: "/watched/".into(),
            signature: me.signature(),
            since_ns: 0,
            ..Default::default()
        };
        other
            .create_entry(create("/watched", file("backlog", 0)))
            .await
            .unwrap();
        let mut s = me.subscribe_once(req.clone()).await.unwrap();
        me.create_entry(create("/watched", file("mine", 0)))
            .await
            .unwrap();
        other
            .create_entry(create("/elsewhere", file("x", 0)))
            .await
            .unwrap();
        other
            .create_entry(create("/watched", file("theirs", 0)))
            .await
            .unwrap();
        let names: Vec<String> = [s.next().await, s.next().await]
            .into_iter()
            .map(|r| {
                r.unwrap()
                    .unwrap()
                    .event_notification
                    .unwrap()
                    .new_entry
                    .unwrap()
                    .name
            })
            .collect();
        assert_eq!(names, ["backlog", "theirs"]);
        me.disconnect_subscribers();
        assert!(matches!(
            s.next().await,
            Some(Err(FilerError::Unavailable(_)))
        ));
        assert!(s.next().await.is_none());
        // client_id 0: ends at once, like the real filer
        let mut z = me
            .subscribe_once(pb::SubscribeMetadataRequest {
                client_id: 0,
                ..req
            })
            .await
            .unwrap();
        assert!(z.next().await.is_none());
    }
}
