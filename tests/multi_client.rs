//! Multi-client model test: two (optionally three) mounts of our filesystem on one filer
//! directory — two "nodes" — plus the filer HTTP API as another client. A seeded PRNG picks
//! operations (create, pwrite, truncate, chmod, utimensat, set/removexattr, rename, unlink,
//! write+fsync with the descriptor still open, a descriptor held across operations and used
//! later for pwrite+fsync, ftruncate, fchmod or fsetxattr (it follows its file through renames
//! and uploads; once the file is gone its changes may fail but must reach no file), HTTP
//! PUT/DELETE) on a few names, each done by
//! one random client, one at a time. After each operation the test waits until every client
//! shows exactly what a sequential in-memory model says (names, bytes, size, mode, user
//! xattrs, and the mtime after a utimensat; HTTP: names, bytes, size, mode, xattrs from the
//! filer's JSON listing) — the close-to-open promise of docs/SEMANTICS.md: another client's
//! committed change is visible within about a second. No operation is issued before the
//! previous one has settled everywhere.
//!
//! `field_*`: the case seen in the field — node A rewrites a 3 MiB file and closes it; node B,
//! which had read (and cached) the old version, at once runs chmod + touch (or setxattr, or
//! rename) on it. A's new bytes must survive on every client.
//!
//! Environment: `MODEL_SEED` (number or `random`), `MODEL_OPS` (default 300),
//! `MODEL_MOUNTS` (2 or 3), `MODEL_SETTLE_SECS` (default 5), `FIELD_REPS` (default 20).
//! `MODEL_HELD_LINKS=1` also holds hard-linked files (known to fail, see [`World`]).
//! `MODEL_SABOTAGE=N` changes the model after operation N (or the first later one with a
//! file): the run must fail (a check of the checker). `scripts/soak.sh` runs long
//! random-seed versions.

mod common;
mod fuse_support;
mod model_support;

use common::WeedServer;
use fuse_support::*;
use model_support::*;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const NAMES: &[&str] = &["a", "b", "c", "d", "e"];
/// Largest file the random test makes (several 1 MiB and 2 MiB chunks).
const MAX_SIZE: usize = 3 * MIB + MIB / 2;
/// Mode of a file made by open(O_CREAT, 0644) under umask 022.
const CREATE_MODE: u32 = 0o644;
/// Mode the filer gives a file uploaded over HTTP (its default `mode=0660`).
const HTTP_MODE: u32 = 0o660;

#[derive(Clone, Debug, PartialEq)]
struct FileState {
    /// Which file this is (the filer's inode): a rename or an upload over its name keeps it,
    /// a new file at the name gets a new one. Hard links of one file share it.
    id: u64,
    /// Its entry names a link group (it was hard-linked once; its last name keeps that).
    linked: bool,
    data: Vec<u8>,
    mode: u32,
    xattrs: BTreeMap<String, Vec<u8>>,
    /// Known exactly after a utimensat, until the next change of the data.
    mtime: Option<(i64, i64)>,
}

impl FileState {
    fn new(data: Vec<u8>, mode: u32) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        FileState {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            linked: false,
            data,
            mode,
            xattrs: BTreeMap::new(),
            mtime: None,
        }
    }
}

type Model = BTreeMap<String, FileState>;

struct Node {
    label: String,
    guard: MountGuard,
}

/// A descriptor a node keeps open across operations, on the file `id` (opened at `name`).
struct Held {
    fh: fs::File,
    id: u64,
    name: String,
}

/// The clients of one filer directory and the sequential model of it.
struct World {
    w: Arc<WeedServer>,
    root: String,
    /// Per node, a descriptor kept open across operations (closed before the mounts go).
    held: Vec<Option<Held>>,
    nodes: Vec<Node>,
    model: Model,
    log: Vec<String>,
    settle_timeout: Duration,
    seed: u64,
    max_settle: Duration,
    settles: u32,
    /// `MODEL_VERBOSE=1`: print each operation as it is done.
    verbose: bool,
    /// `MODEL_HELD_LINKS=1`: held descriptors on hard-linked files too (known to fail: a
    /// node holding a group's file whose names went can show its size at a name another
    /// node links then, seed 250893840; see docs/SEMANTICS.md). Off: a link closes the held
    /// descriptors first, and only files never linked are held.
    held_links: bool,
    /// A directory in the root that is not part of the model (load for the clients).
    ignore: Option<String>,
    /// Hard links: the link group of each name that has one (names of a group share one
    /// file: its bytes, mode, xattrs and times).
    groups: BTreeMap<String, u32>,
    next_group: u32,
}

impl World {
    fn new(tag: &str, node_args: &[&[&str]], seed: u64) -> Self {
        Self::new_logging(tag, node_args, seed, &test_log_level())
    }

    /// [`Self::new`] with the mount processes' `RUST_LOG`.
    fn new_logging(tag: &str, node_args: &[&[&str]], seed: u64, rust_log: &str) -> Self {
        // modes of created files are part of the model
        unsafe {
            libc::umask(0o022);
        }
        let w = shared_server();
        let root = unique_path(tag);
        w.filer_put(&format!("{root}/.keep-dir"), b"x", "");
        assert!(filer_delete(&w, &format!("{root}/.keep-dir")));
        let nodes: Vec<Node> = node_args
            .iter()
            .enumerate()
            .map(|(i, args)| Node {
                label: format!(
                    "node{}{}",
                    (b'A' + i as u8) as char,
                    if args.is_empty() {
                        String::new()
                    } else {
                        format!("({})", args.join(" "))
                    }
                ),
                guard: mount_ours_logging(&w, &root, args, rust_log),
            })
            .collect();
        World {
            w,
            root,
            held: nodes.iter().map(|_| None).collect(),
            nodes,
            model: Model::new(),
            log: Vec::new(),
            settle_timeout: Duration::from_secs(env_u64("MODEL_SETTLE_SECS", 5)),
            seed,
            max_settle: Duration::ZERO,
            settles: 0,
            verbose: env_u64("MODEL_VERBOSE", 0) != 0,
            held_links: env_u64("MODEL_HELD_LINKS", 0) != 0,
            ignore: None,
            groups: BTreeMap::new(),
            next_group: 0,
        }
    }

    /// How many names the file at `name` has.
    fn links(&self, name: &str) -> u64 {
        match self.groups.get(name) {
            Some(g) => self.groups.values().filter(|x| *x == g).count() as u64,
            None => 1,
        }
    }

    /// After a change of the file at `name`: its other names show the same file.
    fn propagate(&mut self, name: &str) {
        let Some(g) = self.groups.get(name).copied() else {
            return;
        };
        let st = self.model[name].clone();
        for (n, _) in self.groups.iter().filter(|(n, x)| **x == g && *n != name) {
            self.model.insert(n.clone(), st.clone());
        }
    }

    /// `name` no longer names its link group's file (removed, or replaced by another file).
    fn leave_group(&mut self, name: &str) {
        if let Some(g) = self.groups.remove(name) {
            let rest: Vec<String> = self
                .groups
                .iter()
                .filter(|(_, x)| **x == g)
                .map(|(n, _)| n.clone())
                .collect();
            if rest.len() == 1 {
                self.groups.remove(&rest[0]);
            }
        }
    }

    fn http_path(&self, name: &str) -> String {
        format!("{}/{name}", self.root)
    }

    fn note(&mut self, s: String) {
        if self.verbose {
            eprintln!("{s}");
        }
        self.log.push(s);
    }

    /// What node `n` shows, compared with the model; `Err` describes the first difference.
    fn check_node(&self, n: usize) -> Result<(), String> {
        let node = &self.nodes[n];
        let l = &node.label;
        let mut names = BTreeSet::new();
        for e in fs::read_dir(node.guard.path()).map_err(|e| format!("{l}: readdir: {e}"))? {
            let e = e.map_err(|e| format!("{l}: readdir: {e}"))?;
            names.insert(e.file_name().to_string_lossy().to_string());
        }
        if let Some(i) = &self.ignore {
            names.remove(i);
        }
        let want: BTreeSet<String> = self.model.keys().cloned().collect();
        if names != want {
            return Err(format!("{l}: names {names:?}, model {want:?}"));
        }
        // a name gone from the listing must be gone for lookups too (a kernel entry that
        // outlived its invalidation made an O_CREAT open of it fail with ENOENT)
        for name in NAMES.iter().filter(|n| !self.model.contains_key(**n)) {
            match fs::symlink_metadata(node.guard.join(name)) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                other => return Err(format!("{l}: {name} is not in the model, lstat: {other:?}")),
            }
        }
        for (name, st) in &self.model {
            let p = node.guard.join(name);
            let md = fs::symlink_metadata(&p).map_err(|e| format!("{l}: lstat {name}: {e}"))?;
            if !md.is_file() {
                return Err(format!("{l}: {name} is not a regular file: {md:?}"));
            }
            if md.len() != st.data.len() as u64 {
                return Err(format!(
                    "{l}: {name}: st_size {} model {}",
                    md.len(),
                    st.data.len()
                ));
            }
            if md.nlink() != self.links(name) {
                return Err(format!(
                    "{l}: {name}: st_nlink {} model {}",
                    md.nlink(),
                    self.links(name)
                ));
            }
            if md.mode() & 0o7777 != st.mode {
                return Err(format!(
                    "{l}: {name}: mode {:o} model {:o}",
                    md.mode() & 0o7777,
                    st.mode
                ));
            }
            if let Some(t) = st.mtime {
                let got = (md.mtime(), md.mtime_nsec());
                if got != t {
                    return Err(format!("{l}: {name}: mtime {got:?} model {t:?}"));
                }
            }
            let x = user_xattrs(&p).map_err(|e| format!("{l}: listxattr {name}: errno {e}"))?;
            if x != st.xattrs {
                return Err(format!(
                    "{l}: {name}: xattrs {:?} model {:?}",
                    x.keys().collect::<Vec<_>>(),
                    st.xattrs.keys().collect::<Vec<_>>()
                ));
            }
            let data = fs::read(&p).map_err(|e| format!("{l}: read {name}: {e}"))?;
            if data != st.data {
                return Err(format!(
                    "{l}: {name}: content differs: {}",
                    describe_content(&st.data, &data)
                ));
            }
        }
        Ok(())
    }

    /// What the filer HTTP API shows, compared with the model.
    fn check_http(&self) -> Result<(), String> {
        let mut list = filer_list(&self.w, &self.root).map_err(|e| format!("http: {e}"))?;
        list.retain(|e| Some(&e.name) != self.ignore.as_ref());
        let names: BTreeSet<String> = list.iter().map(|e| e.name.clone()).collect();
        let want: BTreeSet<String> = self.model.keys().cloned().collect();
        if names != want {
            return Err(format!("http: names {names:?}, model {want:?}"));
        }
        for e in &list {
            let st = &self.model[&e.name];
            let n = &e.name;
            if e.is_dir {
                return Err(format!("http: {n} is a directory"));
            }
            if e.size != st.data.len() as u64 {
                return Err(format!(
                    "http: {n}: FileSize {} model {}",
                    e.size,
                    st.data.len()
                ));
            }
            if e.perm != st.mode & 0o777 {
                return Err(format!("http: {n}: mode {:o} model {:o}", e.perm, st.mode));
            }
            if e.xattrs != st.xattrs {
                return Err(format!(
                    "http: {n}: xattrs {:?} model {:?}",
                    e.xattrs.keys().collect::<Vec<_>>(),
                    st.xattrs.keys().collect::<Vec<_>>()
                ));
            }
            let data = self
                .w
                .filer_get(&self.http_path(n))
                .ok_or_else(|| format!("http: GET {n} failed"))?;
            if data != st.data {
                return Err(format!(
                    "http: {n}: content differs: {}",
                    describe_content(&st.data, &data)
                ));
            }
        }
        Ok(())
    }

    /// Waits until every client shows the model (up to the settle timeout).
    fn settle(&mut self) -> Result<(), String> {
        let start = Instant::now();
        let deadline = start + self.settle_timeout;
        for n in 0..=self.nodes.len() {
            loop {
                let r = if n == self.nodes.len() {
                    self.check_http()
                } else {
                    self.check_node(n)
                };
                match r {
                    Ok(()) => break,
                    Err(e) if Instant::now() >= deadline => {
                        let waited = start.elapsed();
                        let diag = self.diagnose(n);
                        return Err(format!("not settled after {waited:?}: {e}\n{diag}"));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
        let took = start.elapsed();
        self.max_settle = self.max_settle.max(took);
        self.settles += 1;
        Ok(())
    }

    /// After a client failed to settle: what each name looks like there (lookup vs listing),
    /// and whether (and when) it converges later (`MODEL_LATE_SECS`, default 70: longer than
    /// the 60 s cache TTLs).
    fn diagnose(&self, n: usize) -> String {
        let mut out = String::from("    diagnosis:");
        let label = if n == self.nodes.len() {
            "http".to_string()
        } else {
            self.nodes[n].label.clone()
        };
        if n < self.nodes.len() {
            for name in NAMES {
                let p = self.nodes[n].guard.join(name);
                let st = match fs::symlink_metadata(&p) {
                    Ok(m) => format!("exists size {} mode {:o}", m.len(), m.mode() & 0o7777),
                    Err(e) => format!("lstat: {e}"),
                };
                let model = match self.model.get(*name) {
                    Some(f) => format!("size {} mode {:o}", f.data.len(), f.mode),
                    None => "absent".into(),
                };
                out.push_str(&format!("\n      {label} {name}: {st}; model: {model}"));
            }
        }
        let late = Duration::from_secs(env_u64("MODEL_LATE_SECS", 70));
        let t = Instant::now();
        let ok = wait_until(late, || {
            std::thread::sleep(Duration::from_millis(200));
            if n == self.nodes.len() {
                self.check_http().is_ok()
            } else {
                self.check_node(n).is_ok()
            }
        });
        if ok {
            out.push_str(&format!(
                "\n      {label} converged {:?} later",
                t.elapsed()
            ));
        } else {
            let e = if n == self.nodes.len() {
                self.check_http()
            } else {
                self.check_node(n)
            };
            out.push_str(&format!(
                "\n      {label} still differs {:?} later: {}",
                t.elapsed(),
                e.err().unwrap_or_default()
            ));
        }
        out
    }

    /// Panics with everything needed to reproduce.
    fn fail(&self, what: &str) -> ! {
        let mut msg = format!(
            "MODEL MISMATCH (seed {}; rerun with MODEL_SEED={}): {what}\n--- last operations ---\n{}\n",
            self.seed,
            self.seed,
            tail(&self.log.join("\n"), 30)
        );
        for n in &self.nodes {
            msg.push_str(&format!(
                "--- {} mount log (tail) ---\n{}\n",
                n.label,
                tail(&n.guard.log_text(), 25)
            ));
        }
        panic!("{msg}");
    }
}

/// Whose content is it: for the 3 MiB rewrites, tells "old version" from "mixed" from "new".
fn describe_content(want: &[u8], got: &[u8]) -> String {
    first_difference(want, got)
}

// ---------- operations ----------

fn rand_len(rng: &mut Rng) -> usize {
    match rng.weighted(&[55, 25, 20]) {
        // small: the filer may keep it inline in the entry
        0 => rng.range(0, 4096) as usize,
        1 => rng.range(4097, 300_000) as usize,
        // one to three chunks of either chunk size
        _ => rng.range(MIB as u64 - 3, (2 * MIB + MIB / 2) as u64) as usize,
    }
}

/// An offset for a write into a file of `size` bytes: anywhere, at a chunk boundary, or past
/// the end (a hole).
fn rand_offset(rng: &mut Rng, size: usize) -> usize {
    match rng.weighted(&[45, 35, 20]) {
        0 => rng.range(0, size as u64) as usize,
        1 => {
            let k = rng.range(1, 3) as usize * MIB;
            (k + rng.range(0, 8192) as usize).saturating_sub(4096)
        }
        _ => size + rng.range(1, 100_000) as usize,
    }
}

fn apply_write(data: &mut Vec<u8>, off: usize, buf: &[u8]) {
    // an empty write changes nothing, also past the end
    if buf.is_empty() {
        return;
    }
    if data.len() < off + buf.len() {
        data.resize(off + buf.len(), 0);
    }
    data[off..off + buf.len()].copy_from_slice(buf);
}

fn pick_existing(rng: &mut Rng, model: &Model) -> Option<String> {
    if model.is_empty() {
        return None;
    }
    let keys: Vec<&String> = model.keys().collect();
    Some(rng.pick(&keys).to_string())
}

const MODES: &[u32] = &[0o600, 0o640, 0o644, 0o664, 0o700, 0o755, 0o444, 0o606];

/// One random operation by one random client. Returns an error for a failed system call.
fn random_op(wd: &mut World, rng: &mut Rng, i: u64) -> Result<(), String> {
    let nn = wd.nodes.len() as u64;
    // each node weight 3, HTTP 1
    let c = rng.below(3 * nn + 1);
    if c == 3 * nn {
        return http_op(wd, rng, i);
    }
    let n = (c / 3) as usize;
    let label = wd.nodes[n].label.clone();
    let dir = wd.nodes[n].guard.path().to_path_buf();
    let name = rng.pick(NAMES).to_string();
    let existing = pick_existing(rng, &wd.model);
    let op = rng.weighted(&[12, 14, 8, 8, 8, 8, 3, 8, 5, 6, 6, 10]);
    let e2s = |e: std::io::Error| e.to_string();
    match (op, existing) {
        (1, Some(f)) => {
            let size = wd.model[&f].data.len();
            let off = rand_offset(rng, size).min(MAX_SIZE - 1);
            let len = rand_len(rng).min(MAX_SIZE - off);
            let buf = rng.bytes(len);
            wd.note(format!(
                "#{i} {label}: pwrite {f} off={off} len={len} (size {size})"
            ));
            let fh = OpenOptions::new()
                .write(true)
                .open(dir.join(&f))
                .map_err(e2s)?;
            fh.write_all_at(&buf, off as u64).map_err(e2s)?;
            drop(fh);
            let st = wd.model.get_mut(&f).unwrap();
            apply_write(&mut st.data, off, &buf);
            st.mtime = None;
            wd.propagate(&f);
        }
        (2, Some(f)) => {
            let size = wd.model[&f].data.len();
            let len = match rng.below(4) {
                0 => 0,
                1 => rng.range(0, size as u64) as usize,
                2 => (rng.range(1, 3) as usize * MIB + rng.range(0, 4096) as usize)
                    .saturating_sub(2048),
                _ => size + rng.range(1, 300_000) as usize,
            }
            .min(MAX_SIZE);
            wd.note(format!("#{i} {label}: truncate {f} {size} -> {len}"));
            OpenOptions::new()
                .write(true)
                .open(dir.join(&f))
                .and_then(|fh| fh.set_len(len as u64))
                .map_err(e2s)?;
            let st = wd.model.get_mut(&f).unwrap();
            st.data.resize(len, 0);
            st.mtime = None;
            wd.propagate(&f);
        }
        (3, Some(f)) => {
            let mode = *rng.pick(MODES);
            wd.note(format!("#{i} {label}: chmod {f} {mode:o}"));
            fs::set_permissions(dir.join(&f), fs::Permissions::from_mode(mode)).map_err(e2s)?;
            wd.model.get_mut(&f).unwrap().mode = mode;
            wd.propagate(&f);
        }
        (4, Some(f)) => {
            let at = (rng.range(1_000_000_000, 1_700_000_000) as i64, 0);
            let mt = (
                rng.range(1_000_000_000, 1_700_000_000) as i64,
                rng.below(1_000_000_000) as i64,
            );
            wd.note(format!("#{i} {label}: utimensat {f} mtime={mt:?}"));
            utimens(&dir.join(&f), Some(at), Some(mt)).map_err(|e| format!("errno {e}"))?;
            wd.model.get_mut(&f).unwrap().mtime = Some(mt);
            wd.propagate(&f);
        }
        (5, Some(f)) => {
            let key = format!("user.k{}", rng.below(3));
            let len = rng.range(0, 100) as usize;
            let v = rng.bytes(len);
            wd.note(format!("#{i} {label}: setxattr {f} {key} ({len} bytes)"));
            setxattr(&dir.join(&f), &key, &v, 0).map_err(|e| format!("errno {e}"))?;
            wd.model.get_mut(&f).unwrap().xattrs.insert(key, v);
            wd.propagate(&f);
        }
        (6, Some(f)) => {
            let keys: Vec<String> = wd.model[&f].xattrs.keys().cloned().collect();
            if keys.is_empty() {
                return create_op(wd, rng, i, n, &f);
            }
            let key = rng.pick(&keys).clone();
            wd.note(format!("#{i} {label}: removexattr {f} {key}"));
            removexattr(&dir.join(&f), &key).map_err(|e| format!("errno {e}"))?;
            wd.model.get_mut(&f).unwrap().xattrs.remove(&key);
            wd.propagate(&f);
        }
        (7, Some(f)) => {
            let to = rng.pick(NAMES).to_string();
            if to == f {
                return create_op(wd, rng, i, n, &name);
            }
            let over = wd.model.contains_key(&to);
            let same = wd.groups.contains_key(&f) && wd.groups.get(&f) == wd.groups.get(&to);
            wd.note(format!(
                "#{i} {label}: rename {f} -> {to}{}",
                if same {
                    " (two links of one file: nothing happens)"
                } else if over {
                    " (replacing)"
                } else {
                    ""
                }
            ));
            fs::rename(dir.join(&f), dir.join(&to)).map_err(e2s)?;
            if !same {
                wd.leave_group(&to);
                if let Some(g) = wd.groups.remove(&f) {
                    wd.groups.insert(to.clone(), g);
                }
                let st = wd.model.remove(&f).unwrap();
                wd.model.insert(to, st);
            }
        }
        (8, Some(f)) => {
            wd.note(format!("#{i} {label}: unlink {f}"));
            fs::remove_file(dir.join(&f)).map_err(e2s)?;
            wd.model.remove(&f);
            wd.leave_group(&f);
        }
        (10, Some(f)) => {
            if !wd.held_links {
                for k in 0..wd.held.len() {
                    if let Some(h) = wd.held[k].take() {
                        let l = wd.nodes[k].label.clone();
                        wd.note(format!("#{i} {l}: close held {} (before a link)", h.name));
                    }
                }
            }
            let free: Vec<&str> = NAMES
                .iter()
                .copied()
                .filter(|n| !wd.model.contains_key(*n))
                .collect();
            if free.is_empty() {
                return create_op(wd, rng, i, n, &name);
            }
            let to = rng.pick(&free).to_string();
            wd.note(format!("#{i} {label}: link {f} {to}"));
            fs::hard_link(dir.join(&f), dir.join(&to)).map_err(e2s)?;
            let g = match wd.groups.get(&f) {
                Some(g) => *g,
                None => {
                    wd.next_group += 1;
                    wd.groups.insert(f.clone(), wd.next_group);
                    wd.next_group
                }
            };
            wd.groups.insert(to.clone(), g);
            let st = wd.model.get_mut(&f).unwrap();
            st.linked = true;
            let st = st.clone();
            wd.model.insert(to, st);
        }
        (9, _) => {
            // write + fsync, check every client while the descriptor is still open, close
            let size = wd.model.get(&name).map(|s| s.data.len()).unwrap_or(0);
            let off = if rng.chance(1, 2) {
                0
            } else {
                rand_offset(rng, size).min(MAX_SIZE - 1)
            };
            let len = rand_len(rng).min(MAX_SIZE - off);
            let buf = rng.bytes(len);
            let new = !wd.model.contains_key(&name);
            wd.note(format!(
                "#{i} {label}: open{} {name}, pwrite off={off} len={len}, fsync (size {size})",
                if new { "(O_CREAT, new)" } else { "" }
            ));
            let fh = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .open(dir.join(&name))
                .map_err(e2s)?;
            fh.write_all_at(&buf, off as u64).map_err(e2s)?;
            fh.sync_all().map_err(e2s)?;
            let st = wd
                .model
                .entry(name.clone())
                .or_insert_with(|| FileState::new(Vec::new(), CREATE_MODE));
            apply_write(&mut st.data, off, &buf);
            st.mtime = None;
            wd.propagate(&name);
            if let Err(e) = wd.settle() {
                wd.fail(&format!("after fsync, descriptor open: {e}"));
            }
            wd.note(format!("#{i} {label}: close {name}"));
            drop(fh);
        }
        (11, _) => return held_op(wd, rng, i, n),
        _ => return create_op(wd, rng, i, n, &name),
    }
    Ok(())
}

/// Through node `n`'s held descriptor (opened here if it has none): a pwrite + fsync, a
/// truncate, a chmod, a setxattr, or the close. While the file it was opened on still has
/// a name (it follows renames; an upload over it is the same file), the change must
/// succeed and reach that file. Once the file is gone (removed, or another file put at
/// its name), the change may fail or go nowhere, but must never reach any file.
fn held_op(wd: &mut World, rng: &mut Rng, i: u64, n: usize) -> Result<(), String> {
    let label = wd.nodes[n].label.clone();
    let e2s = |e: std::io::Error| e.to_string();
    let Some(h) = wd.held[n].as_ref() else {
        let f = pick_existing(rng, &wd.model).filter(|f| wd.held_links || !wd.model[f].linked);
        let Some(f) = f else {
            let name = rng.pick(NAMES).to_string();
            return create_op(wd, rng, i, n, &name);
        };
        wd.note(format!("#{i} {label}: open {f} O_RDWR, held"));
        let fh = OpenOptions::new()
            .read(true)
            .write(true)
            .open(wd.nodes[n].guard.join(&f))
            .map_err(e2s)?;
        let id = wd.model[&f].id;
        wd.held[n] = Some(Held { fh, id, name: f });
        return Ok(());
    };
    let id = h.id;
    let opened = h.name.clone();
    // where the file is now (a hard link's names all show it)
    let at = wd
        .model
        .iter()
        .find(|(_, st)| st.id == id)
        .map(|(k, _)| k.clone());
    let now = match &at {
        Some(a) => format!("now {a}"),
        None => "gone".into(),
    };
    let fd = h.fh.as_raw_fd();
    let action = rng.weighted(&[5, 2, 2, 2, 2]);
    let (what, r): (String, Result<(), String>) = match action {
        0 => {
            let size = at.as_ref().map_or(0, |a| wd.model[a].data.len());
            let off = rand_offset(rng, size).min(MAX_SIZE - 1);
            let len = rand_len(rng).min(MAX_SIZE - off);
            let buf = rng.bytes(len);
            let r =
                h.fh.write_all_at(&buf, off as u64)
                    .and_then(|_| h.fh.sync_all())
                    .map_err(e2s);
            if let (Ok(()), Some(a)) = (&r, &at) {
                let st = wd.model.get_mut(a).unwrap();
                apply_write(&mut st.data, off, &buf);
                st.mtime = None;
            }
            (format!("pwrite off={off} len={len} + fsync"), r)
        }
        1 => {
            let size = at.as_ref().map_or(0, |a| wd.model[a].data.len());
            let len = (rng.range(0, size as u64 + 200_000) as usize).min(MAX_SIZE);
            let r = h.fh.set_len(len as u64).map_err(e2s);
            if let (Ok(()), Some(a)) = (&r, &at) {
                let st = wd.model.get_mut(a).unwrap();
                st.data.resize(len, 0);
                st.mtime = None;
            }
            (format!("ftruncate {len}"), r)
        }
        2 => {
            let mode = *rng.pick(MODES);
            let r = check(unsafe { libc::fchmod(fd, mode) })
                .map(|_| ())
                .map_err(|e| format!("errno {e}"));
            if let (Ok(()), Some(a)) = (&r, &at) {
                wd.model.get_mut(a).unwrap().mode = mode;
            }
            (format!("fchmod {mode:o}"), r)
        }
        3 => {
            let key = format!("user.k{}", rng.below(3));
            let vlen = rng.range(0, 100) as usize;
            let v = rng.bytes(vlen);
            let c = std::ffi::CString::new(key.clone()).unwrap();
            let r =
                check(unsafe { libc::fsetxattr(fd, c.as_ptr(), v.as_ptr().cast(), v.len(), 0) })
                    .map(|_| ())
                    .map_err(|e| format!("errno {e}"));
            if let (Ok(()), Some(a)) = (&r, &at) {
                wd.model.get_mut(a).unwrap().xattrs.insert(key.clone(), v);
            }
            (format!("fsetxattr {key}"), r)
        }
        _ => {
            wd.note(format!("#{i} {label}: close held {opened} ({now})"));
            wd.held[n] = None;
            return Ok(());
        }
    };
    wd.note(format!(
        "#{i} {label}: held {opened} ({now}): {what} -> {}",
        match &r {
            Ok(()) => "ok".to_string(),
            Err(e) => e.clone(),
        }
    ));
    // gone: any outcome, as long as no file shows it (the settle checks that)
    if let Some(a) = at {
        r?;
        wd.propagate(&a);
    }
    Ok(())
}

/// open(O_CREAT|O_TRUNC) + write + close on node `n`.
fn create_op(wd: &mut World, rng: &mut Rng, i: u64, n: usize, name: &str) -> Result<(), String> {
    let len = rand_len(rng);
    let buf = rng.bytes(len);
    let label = wd.nodes[n].label.clone();
    let exists = wd.model.contains_key(name);
    wd.note(format!(
        "#{i} {label}: create{} {name} len={len}",
        if exists { " (O_TRUNC existing)" } else { "" }
    ));
    let p = wd.nodes[n].guard.join(name);
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(&p)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &buf))
        .map_err(|e| e.to_string())?;
    match wd.model.get_mut(name) {
        Some(st) => {
            st.data = buf;
            st.mtime = None;
            wd.propagate(name);
        }
        None => {
            wd.model
                .insert(name.to_string(), FileState::new(buf, CREATE_MODE));
        }
    }
    Ok(())
}

fn http_op(wd: &mut World, rng: &mut Rng, i: u64) -> Result<(), String> {
    let existing = pick_existing(rng, &wd.model);
    match existing {
        Some(f) if rng.chance(1, 3) => {
            wd.note(format!("#{i} http: DELETE {f}"));
            if !filer_delete(&wd.w, &wd.http_path(&f)) {
                return Err(format!("DELETE {f} failed"));
            }
            wd.model.remove(&f);
            wd.leave_group(&f);
        }
        _ => {
            let name = rng.pick(NAMES).to_string();
            let len = rand_len(rng).max(1);
            let buf = rng.bytes(len);
            let exists = wd.model.contains_key(&name);
            wd.note(format!(
                "#{i} http: PUT {name} len={len}{}",
                if exists { " (replacing)" } else { "" }
            ));
            wd.w.filer_put(&wd.http_path(&name), &buf, "");
            // an upload replaces the whole entry: the filer's default mode, no xattrs; a
            // hard link's name gets a new file, the group's other names keep theirs (also
            // the last name of a group: its entry still names the group). A plain file
            // stays the same file (the filer keeps its inode and creation time).
            let same = wd.model.get(&name).filter(|st| !st.linked).map(|st| st.id);
            wd.leave_group(&name);
            let mut st = FileState::new(buf, HTTP_MODE);
            if let Some(id) = same {
                st.id = id;
            }
            wd.model.insert(name, st);
        }
    }
    Ok(())
}

#[test]
fn random_operations_by_several_clients_match_a_sequential_model() {
    let seed = seed_from_env("MODEL_SEED", 20261201);
    let ops = env_u64("MODEL_OPS", 300);
    let three = env_u64("MODEL_MOUNTS", 2) >= 3;
    let mut args: Vec<&[&str]> = vec![&[], &["--chunkSizeLimitMB=1"]];
    if three {
        args.push(&[]);
    }
    // MODEL_SABOTAGE=N: change the model after operation N (the run must then fail)
    let mut sabotage = env_u64("MODEL_SABOTAGE", 0);
    let mut wd = World::new("model", &args, seed);
    let mut rng = Rng::new(seed);
    let started = Instant::now();
    for i in 0..ops {
        if let Err(e) = random_op(&mut wd, &mut rng, i) {
            wd.fail(&format!("operation #{i} failed: {e}"));
        }
        if i + 1 >= sabotage && sabotage > 0 && !wd.model.is_empty() {
            sabotage = 0;
            // self-check of the checker: a wrong model must be caught
            if let Some(f) = pick_existing(&mut rng, &wd.model) {
                let st = wd.model.get_mut(&f).unwrap();
                match rng.below(3) {
                    0 if !st.data.is_empty() => {
                        let at = (st.data.len() - 1) / 2;
                        st.data[at] ^= 1;
                    }
                    1 => st.mode ^= 0o001,
                    _ => {
                        st.xattrs.insert("user.sabotage".into(), b"x".to_vec());
                    }
                }
                wd.note(format!("#{i} SABOTAGE: model of {f} changed"));
            }
        }
        if let Err(e) = wd.settle() {
            wd.fail(&format!("after operation #{i}: {e}"));
        }
        if (i + 1) % 100 == 0 {
            eprintln!(
                "{} ops, {:?}, files {:?}",
                i + 1,
                started.elapsed(),
                wd.model
                    .iter()
                    .map(|(k, v)| format!("{k}:{}", v.data.len()))
                    .collect::<Vec<_>>()
            );
        }
    }
    eprintln!(
        "seed {seed}: {ops} operations in {:?}; {} settles, slowest {:?}",
        started.elapsed(),
        wd.settles,
        wd.max_settle
    );
}

/// The model run while each mount's inode table is over its part of the node's memory
/// budget (`--memoryBudgetMB=64`: 13,107 nodes): a walker stats 16,000 other names on both
/// mounts again and again, so every second each session asks the kernel to forget nodes
/// (FUSE_NOTIFY_PRUNE, Linux 6.18+), the model's files among them. Names forgotten and
/// looked up again must show exactly what the model says, as every other client sees it.
#[test]
fn random_operations_match_the_model_while_the_kernel_forgets_nodes() {
    use std::sync::atomic::{AtomicBool, Ordering};
    if !common::kernel_at_least(6, 18) {
        eprintln!("SKIPPED: FUSE_NOTIFY_PRUNE needs Linux 6.18+");
        return;
    }
    let seed = seed_from_env("MODEL_SEED", 20261205);
    let ops = env_u64("MODEL_PRUNE_OPS", 150);
    let budget: &[&str] = &["--memoryBudgetMB=64"];
    let log = format!(
        "{},seaweedfs_csi_driver::fs::entries=debug",
        test_log_level()
    );
    let mut wd = World::new_logging("prune", &[budget, budget], seed, &log);
    debug_assert!(
        !NAMES.contains(&"big"),
        "the load directory is not in the model"
    );
    wd.ignore = Some("big".into());
    common::fill_dir(
        &wd.w.filer_addr(),
        &wd.root,
        wd.nodes[0].guard.path(),
        16_000,
    );
    /// Stops the walker also when the test panics (the mounts go, it would spin on).
    struct StopOnDrop(Arc<AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_drop = StopOnDrop(stop.clone());
    let walker = {
        let stop = stop.clone();
        let dirs: Vec<_> = wd.nodes.iter().map(|n| n.guard.join("big")).collect();
        std::thread::spawn(move || {
            let mut walks = 0u32;
            while !stop.load(Ordering::Relaxed) {
                for d in &dirs {
                    for e in fs::read_dir(d).into_iter().flatten().flatten() {
                        let _ = e.metadata();
                    }
                }
                walks += 1;
            }
            walks
        })
    };
    let mut rng = Rng::new(seed);
    let mut failed = None;
    for i in 0..ops {
        let r = random_op(&mut wd, &mut rng, i)
            .map_err(|e| format!("operation #{i} failed: {e}"))
            .and_then(|()| {
                wd.settle()
                    .map_err(|e| format!("after operation #{i}: {e}"))
            });
        if let Err(e) = r {
            failed = Some(e);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let walks = walker.join().unwrap();
    if let Some(e) = failed {
        wd.fail(&e);
    }
    for n in &wd.nodes {
        let asked = n
            .guard
            .log_text()
            .matches("asked the kernel to forget nodes")
            .count();
        eprintln!("{}: {asked} prune rounds, {walks} walks", n.label);
        assert!(
            asked > 0,
            "{}: the kernel was never asked to forget nodes",
            n.label
        );
    }
}

#[derive(Clone, Copy, Debug)]
enum Follow {
    /// chmod, then touch (utimensat UTIME_NOW)
    ChmodTouch,
    Setxattr,
    Rename,
}

/// The field case: node A rewrites a 3 MiB file and closes it; node B, which had read (and
/// cached) the old version, immediately — before A's change can have reached it — runs a
/// metadata operation on the file. A's bytes must be what every client ends up with, and B's
/// change must be applied on top of them. All variants run; failures are collected.
#[test]
fn field_rewrite_then_metadata_op_on_a_node_with_the_old_version_cached() {
    let reps = env_u64("FIELD_REPS", 20);
    let seed = seed_from_env("MODEL_SEED", 20261201);
    let mut wd = World::new("field", &[&[], &[]], seed);
    let mut rng = Rng::new(seed);
    let mut failures: Vec<String> = Vec::new();
    let size = 3 * MIB;
    for variant in [Follow::ChmodTouch, Follow::Setxattr, Follow::Rename] {
        let mut cur = "f".to_string();
        for rep in 0..reps {
            let (a, b) = (wd.nodes[0].guard.path(), wd.nodes[1].guard.path());
            let (a, b) = (a.to_path_buf(), b.to_path_buf());
            // the old version, everywhere; B reads it (the settle check reads it on B, too)
            if !wd.model.contains_key(&cur) {
                let v = rng.bytes(size);
                wd.note(format!(
                    "{variant:?} rep {rep}: A writes {cur} (old version)"
                ));
                fs::write(a.join(&cur), &v).unwrap();
                wd.model.insert(cur.clone(), FileState::new(v, CREATE_MODE));
            }
            if let Err(e) = wd.settle() {
                wd.fail(&format!("{variant:?} rep {rep}: old version: {e}"));
            }
            let old = fs::read(b.join(&cur)).unwrap();
            assert_eq!(old, wd.model[&cur].data);

            // A rewrites and closes; B at once does its operation
            let v = rng.bytes(size);
            wd.note(format!(
                "{variant:?} rep {rep}: A rewrites {cur} (O_TRUNC, 3 MiB, close)"
            ));
            fs::write(a.join(&cur), &v).unwrap();
            let st = wd.model.get_mut(&cur).unwrap();
            st.data = v;
            st.mtime = None;
            let r = match variant {
                Follow::ChmodTouch => {
                    let mode = if rep % 2 == 0 { 0o600 } else { 0o640 };
                    wd.note(format!(
                        "{variant:?} rep {rep}: B chmod {mode:o} + touch {cur}"
                    ));
                    let r = fs::set_permissions(b.join(&cur), fs::Permissions::from_mode(mode))
                        .map_err(|e| e.to_string())
                        .and_then(|_| {
                            utimens(&b.join(&cur), None, None).map_err(|e| format!("errno {e}"))
                        });
                    wd.model.get_mut(&cur).unwrap().mode = mode;
                    r
                }
                Follow::Setxattr => {
                    let val = format!("rep{rep}").into_bytes();
                    wd.note(format!(
                        "{variant:?} rep {rep}: B setxattr user.rep on {cur}"
                    ));
                    let r = setxattr(&b.join(&cur), "user.rep", &val, 0)
                        .map_err(|e| format!("errno {e}"));
                    wd.model
                        .get_mut(&cur)
                        .unwrap()
                        .xattrs
                        .insert("user.rep".into(), val);
                    r
                }
                Follow::Rename => {
                    let to = if cur == "f" { "g" } else { "f" }.to_string();
                    wd.note(format!("{variant:?} rep {rep}: B rename {cur} -> {to}"));
                    let r = fs::rename(b.join(&cur), b.join(&to)).map_err(|e| e.to_string());
                    let st = wd.model.remove(&cur).unwrap();
                    wd.model.insert(to.clone(), st);
                    cur = to;
                    r
                }
            };
            let r = r.and_then(|_| wd.settle());
            if let Err(e) = r {
                let whose = |n: usize| -> String {
                    let got = fs::read(wd.nodes[n].guard.join(&cur)).unwrap_or_default();
                    describe_version(&got, &old, &wd.model[&cur].data)
                };
                let http = describe_version(
                    &wd.w.filer_get(&wd.http_path(&cur)).unwrap_or_default(),
                    &old,
                    &wd.model[&cur].data,
                );
                let msg = format!(
                    "{variant:?} rep {rep}: {e}\n    content now: A {}, B {}, http {}",
                    whose(0),
                    whose(1),
                    http
                );
                eprintln!("FAILURE {msg}");
                failures.push(msg);
                // start the next repetition from scratch
                for name in wd.model.keys().cloned().collect::<Vec<_>>() {
                    filer_delete(&wd.w, &wd.http_path(&name));
                }
                for name in NAMES.iter().chain(["f", "g"].iter()) {
                    filer_delete(&wd.w, &wd.http_path(name));
                }
                wd.model.clear();
                if let Err(e) = wd.settle() {
                    wd.fail(&format!("could not reset after a failure: {e}"));
                }
                cur = "f".into();
            }
        }
    }
    if !failures.is_empty() {
        let mut msg = format!(
            "{} of {} repetitions lost A's rewrite or B's change:\n{}\n",
            failures.len(),
            3 * reps,
            failures.join("\n")
        );
        for n in &wd.nodes {
            msg.push_str(&format!(
                "--- {} mount log (tail) ---\n{}\n",
                n.label,
                tail(&n.guard.log_text(), 25)
            ));
        }
        panic!("{msg}");
    }
}

/// "new version", "old version", "empty", or where it differs from the new one.
fn describe_version(got: &[u8], old: &[u8], new: &[u8]) -> String {
    if got == new {
        "= new version".into()
    } else if got == old {
        "= OLD version".into()
    } else if got.is_empty() {
        "empty/absent".into()
    } else {
        format!("neither: {}", first_difference(new, got))
    }
}

/// Found by a 3-mount soak run: the filer numbers an uploaded file md5(path) + crtime
/// seconds * 37, so a file uploaded to `d`, renamed to `c` through another mount, and a new
/// upload to `d` within the same second share one inode. A mount that took the number for its
/// node id showed `d` with `c`'s size and attributes (two files, one node) for good.
#[test]
fn an_upload_renamed_away_and_a_new_upload_to_its_name_in_one_second_stay_two_files() {
    let mut wd = World::new("inodes", &[&[], &[]], 1);
    let secs = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
    };
    let mut same_second = 0;
    for rep in 0..6 {
        let (d, c) = (format!("d{rep}"), format!("c{rep}"));
        // start just after a second boundary, so all three changes can share one second
        while secs().subsec_millis() > 100 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let start = secs().as_secs();
        let first = vec![b'1'; 266];
        wd.w.filer_put(&wd.http_path(&d), &first, "");
        // node A knows the first file as `d`; node B renames it once the upload's event has
        // reached it (a mount's cached listing shows a new name only then)
        let a = wd.nodes[0].guard.path().to_path_buf();
        let seen = |p: &std::path::Path| wait_until(Duration::from_secs(5), || p.exists());
        seen(&a.join(&d));
        assert!(
            seen(&wd.nodes[1].guard.join(&d)),
            "rep {rep}: node B never saw `{d}`"
        );
        fs::rename(wd.nodes[1].guard.join(&d), wd.nodes[1].guard.join(&c)).unwrap();
        let second = vec![b'2'; 52568];
        wd.w.filer_put(&wd.http_path(&d), &second, "");
        if secs().as_secs() == start {
            same_second += 1;
        }
        wd.model.insert(c.clone(), FileState::new(first, HTTP_MODE));
        wd.model
            .insert(d.clone(), FileState::new(second, HTTP_MODE));
        if let Err(e) = wd.settle() {
            wd.fail(&format!("rep {rep}: {e}"));
        }
        let (mc, md) = (
            fs::metadata(a.join(&c)).unwrap(),
            fs::metadata(a.join(&d)).unwrap(),
        );
        assert_ne!(
            mc.ino(),
            md.ino(),
            "rep {rep}: two files, one inode on node A"
        );
    }
    // the case needs the three changes inside one second; on a machine too slow for that
    // even once the test proves nothing, so it says so by failing
    assert!(same_second > 0, "no repetition fitted in one second");
    eprintln!("{same_second} of 6 repetitions inside one second");
}
