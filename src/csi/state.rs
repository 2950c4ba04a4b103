//! Node-local record of the volumes this node plugin staged and published, so that a plugin
//! whose FUSE sessions are gone for good (the fd-keeper died too, or there is none) can stage
//! and bind them again by itself: kubelet does not repeat NodeStage/NodePublish for pods that
//! are already running.
//!
//! One small JSON file, rewritten atomically (temp file + fsync + rename + fsync of the
//! directory) on every change, under an advisory `flock` so two plugin generations that run at
//! once during a rolling update never lose each other's updates. The file is the only source of
//! truth: every change re-reads it. It holds mount options (filer addresses, paths, ids maps)
//! and requests, but no secrets (not kubelet's pod info either, whose service account tokens
//! are credentials: node.rs leaves it out); it is still created with mode 0600.
//!
//! Rollbacks: what a newer version wrote and this one does not know (fields at every level,
//! the mount options and requests included) is kept through this version's rewrites, and a
//! file in a format it cannot read is left alone rather than replaced (see [`StateStore::open`]).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use crate::config::MountOptions;

/// Used when neither `--stateDir` nor a unix endpoint gives a directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/seaweedfs-csi/state";
const FILE_NAME: &str = "volumes.json";
const LOCK_NAME: &str = "volumes.lock";
const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// JSON this version cannot read: a newer version's format, most likely. Left as it is
    /// and never written, so its records wait for a version that reads them.
    #[error("{path}: {reason} (left as it is: this version neither uses nor updates it)")]
    Unsupported { path: PathBuf, reason: String },
    /// Not JSON at all: no version wrote it (writes are atomic), so nothing can read it.
    #[error("{path}: not JSON: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

impl StateError {
    /// The file is one this version leaves alone (logged once by the store, see `read`).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, StateError::Unsupported { .. })
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Fields a newer version wrote that this one does not know: kept, so that a rewrite by this
/// version does not drop them.
pub type UnknownFields = serde_json::Map<String, serde_json::Value>;

/// A pod's bind of a staged volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedTarget {
    pub read_only: bool,
    #[serde(flatten)]
    pub unknown: UnknownFields,
}

/// Volume context keys kubelet adds to NodePublishVolume (pod name, uid, service account
/// tokens, ...): no mount option comes from them, and tokens are credentials, never kept.
pub fn is_pod_info(key: &str) -> bool {
    key.starts_with("csi.storage.k8s.io/")
}

/// What a NodeStage (or NodePublish) request asked of a volume, kept so that a repair can
/// resolve its options again with the flags of the plugin that does it.
/// Missing fields are empty: a version that leaves an empty one out is still read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedRequest {
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    #[serde(default)]
    pub mount_flags: Vec<String>,
    #[serde(flatten)]
    pub unknown: UnknownFields,
}

/// A staged volume as NodeStage resolved it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordedVolume {
    pub staging: PathBuf,
    pub read_only: bool,
    /// The complete options the session was started with.
    pub opts: MountOptions,
    /// The request they were resolved from (None in records written before it was kept: a
    /// repair then reuses `opts` as they are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RecordedRequest>,
    #[serde(default)]
    pub targets: BTreeMap<PathBuf, RecordedTarget>,
    #[serde(flatten)]
    pub unknown: UnknownFields,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    format: u32,
    #[serde(default)]
    volumes: BTreeMap<String, RecordedVolume>,
    #[serde(flatten)]
    unknown: UnknownFields,
}

/// The state file of one node plugin (see the module comment).
#[derive(Debug)]
pub struct StateStore {
    dir: PathBuf,
    file: PathBuf,
    /// An unsupported file was logged (once while it stays unsupported).
    unsupported_logged: AtomicBool,
}

/// Holds the advisory lock of the state directory while alive.
struct Locked(#[allow(dead_code)] nix::fcntl::Flock<File>);

impl StateStore {
    /// Opens (creating if needed) the state directory. A state file this version cannot
    /// read is not fatal: one that is JSON (a newer version's) stays as it is and is not
    /// written while it stays so; one that is not JSON is set aside under a new name, and the
    /// plugin only misses the self-repair of what it recorded.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(dir))?;
        let s = StateStore {
            dir: dir.to_path_buf(),
            file: dir.join(FILE_NAME),
            unsupported_logged: AtomicBool::new(false),
        };
        let _l = s.lock()?;
        match s.read() {
            Ok(_) | Err(StateError::Unsupported { .. }) => {}
            Err(e @ StateError::Corrupt { .. }) => {
                let aside = s.aside_name();
                tracing::error!(file = %s.file.display(), error = %e, aside = %aside.display(),
                    "unreadable state file set aside; recorded volumes are not repaired");
                std::fs::rename(&s.file, &aside).map_err(io_err(&s.file))?;
            }
            // Unread, so not moved: every access tries again.
            Err(e) => tracing::error!(error = %e, "cannot read the state file"),
        }
        Ok(s)
    }

    /// A name for a corrupt file that no earlier one has (a container's pid repeats).
    fn aside_name(&self) -> PathBuf {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let base = format!("{FILE_NAME}.corrupt-{secs}-{}", std::process::id());
        (0u32..)
            .map(|n| match n {
                0 => self.dir.join(&base),
                n => self.dir.join(format!("{base}-{n}")),
            })
            .find(|p| std::fs::symlink_metadata(p).is_err())
            .unwrap_or_else(|| self.dir.join(base))
    }

    pub fn path(&self) -> &Path {
        &self.file
    }

    fn lock(&self) -> Result<Locked, StateError> {
        let p = self.dir.join(LOCK_NAME);
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&p)
            .map_err(io_err(&p))?;
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
            .map(Locked)
            .map_err(|(_, e)| io_err(&p)(e.into()))
    }

    fn read(&self) -> Result<StateFile, StateError> {
        let bytes = match std::fs::read(&self.file) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(StateFile::default()),
            Err(e) => return Err(io_err(&self.file)(e)),
        };
        let json: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
                path: self.file.clone(),
                reason: e.to_string(),
            })?;
        let parsed = match json.get("format") {
            Some(f) if *f != FORMAT => {
                Err(format!("state format {f}, this version reads {FORMAT}"))
            }
            _ => serde_json::from_value::<StateFile>(json).map_err(|e| e.to_string()),
        };
        let mut st = match parsed {
            Ok(st) => st,
            Err(reason) => {
                let e = StateError::Unsupported {
                    path: self.file.clone(),
                    reason,
                };
                if !self.unsupported_logged.swap(true, Ordering::Relaxed) {
                    tracing::error!(error = %e,
                        "state file of a newer version (or one this version cannot read): volumes are neither recorded nor repaired by this process until it reads it (it reads it again at every change)");
                }
                return Err(e);
            }
        };
        self.unsupported_logged.store(false, Ordering::Relaxed);
        // an earlier build kept pod info (tokens among it): dropped at the next rewrite
        for v in st.volumes.values_mut() {
            if let Some(r) = v.request.as_mut() {
                r.volume_context.retain(|k, _| !is_pod_info(k));
            }
        }
        Ok(st)
    }

    fn write(&self, st: &StateFile) -> Result<(), StateError> {
        let tmp = self.dir.join(format!("{FILE_NAME}.tmp"));
        let bytes = serde_json::to_vec_pretty(st)
            .map_err(|e| io_err(&self.file)(std::io::Error::other(e)))?;
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        f.write_all(&bytes).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &self.file).map_err(io_err(&self.file))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&self.dir))
    }

    /// Read-modify-write under the lock.
    fn update<T>(
        &self,
        f: impl FnOnce(&mut BTreeMap<String, RecordedVolume>) -> T,
    ) -> Result<T, StateError> {
        let _l = self.lock()?;
        let mut st = self.read()?;
        let out = f(&mut st.volumes);
        st.format = FORMAT;
        self.write(&st)?;
        Ok(out)
    }

    /// Every recorded volume.
    pub fn volumes(&self) -> Result<BTreeMap<String, RecordedVolume>, StateError> {
        let _l = self.lock()?;
        Ok(self.read()?.volumes)
    }

    pub fn get(&self, volume_id: &str) -> Result<Option<RecordedVolume>, StateError> {
        Ok(self.volumes()?.remove(volume_id))
    }

    /// Records a staged volume; its publications (and what a newer version recorded of it
    /// and of its request, which kubelet repeats unchanged for one staging path) are kept
    /// when the staging path is the same. `request` None: not known (a record written by an
    /// older version, started again).
    pub fn record_stage(
        &self,
        volume_id: &str,
        staging: &Path,
        read_only: bool,
        opts: &MountOptions,
        request: Option<&RecordedRequest>,
    ) -> Result<(), StateError> {
        self.update(|v| {
            let (targets, unknown, request_unknown) = v
                .remove(volume_id)
                .filter(|old| old.staging == staging)
                .map(|old| (old.targets, old.unknown, old.request.map(|r| r.unknown)))
                .unwrap_or_default();
            let request = request.cloned().map(|mut r| {
                if r.unknown.is_empty() {
                    r.unknown = request_unknown.unwrap_or_default();
                }
                r
            });
            v.insert(
                volume_id.to_string(),
                RecordedVolume {
                    staging: staging.to_path_buf(),
                    read_only,
                    opts: opts.clone(),
                    request,
                    targets,
                    unknown,
                },
            );
        })
    }

    /// Records the quota NodeExpandVolume gave a staged volume (the session started again
    /// keeps it); false when the volume is not recorded.
    pub fn record_quota(&self, volume_id: &str, quota_bytes: u64) -> Result<bool, StateError> {
        self.update(|v| match v.get_mut(volume_id) {
            Some(rec) => {
                rec.opts.quota_bytes = quota_bytes;
                true
            }
            None => false,
        })
    }

    /// Records a publication; false when the volume is not recorded as staged.
    pub fn record_publish(
        &self,
        volume_id: &str,
        target: &Path,
        read_only: bool,
    ) -> Result<bool, StateError> {
        self.update(|v| match v.get_mut(volume_id) {
            Some(rec) => {
                let t = rec
                    .targets
                    .entry(target.to_path_buf())
                    .or_insert_with(|| RecordedTarget {
                        read_only,
                        unknown: UnknownFields::new(),
                    });
                t.read_only = read_only;
                true
            }
            None => false,
        })
    }

    pub fn record_unpublish(&self, volume_id: &str, target: &Path) -> Result<(), StateError> {
        self.update(|v| {
            if let Some(rec) = v.get_mut(volume_id) {
                rec.targets.remove(target);
            }
        })
    }

    pub fn record_unstage(&self, volume_id: &str) -> Result<(), StateError> {
        self.update(|v| {
            v.remove(volume_id);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(path: &str) -> MountOptions {
        MountOptions {
            filer_path: path.into(),
            quota_bytes: 5,
            ..Default::default()
        }
    }

    fn req() -> RecordedRequest {
        RecordedRequest {
            volume_context: [("capacity".to_string(), "5".to_string())].into(),
            mount_flags: vec!["ro".into()],
            ..Default::default()
        }
    }

    #[test]
    fn pod_info_an_earlier_build_recorded_is_dropped_at_the_next_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(&dir.path().join("st")).unwrap();
        let mut r = req();
        r.volume_context.insert(
            "csi.storage.k8s.io/serviceAccount.tokens".into(),
            "secret-token".into(),
        );
        r.volume_context
            .insert("csi.storage.k8s.io/pod.name".into(), "p".into());
        s.record_stage("v1", Path::new("/s/1"), false, &opts("/b"), Some(&r))
            .unwrap();
        // written as an earlier build wrote it: the pod info is in the file
        let raw = std::fs::read_to_string(&s.file).unwrap();
        assert!(raw.contains("secret-token"), "{raw}");
        assert!(s.record_publish("v1", Path::new("/t/1"), false).unwrap());
        let raw = std::fs::read_to_string(&s.file).unwrap();
        assert!(!raw.contains("secret-token"), "{raw}");
        assert!(!raw.contains("pod.name"), "{raw}");
        let v = s.volumes().unwrap();
        let kept = &v["v1"].request.as_ref().unwrap().volume_context;
        assert_eq!(kept.get("capacity").map(String::as_str), Some("5"));
    }

    #[test]
    fn records_survive_reopen_and_follow_the_rpcs() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(&dir.path().join("st")).unwrap();
        assert!(s.volumes().unwrap().is_empty());
        s.record_stage(
            "v1",
            Path::new("/s/1"),
            false,
            &opts("/buckets/v1"),
            Some(&req()),
        )
        .unwrap();
        assert!(s.record_publish("v1", Path::new("/t/a"), false).unwrap());
        assert!(s.record_publish("v1", Path::new("/t/b"), true).unwrap());
        assert!(!s.record_publish("nope", Path::new("/t/c"), false).unwrap());
        // Restaging at the same path keeps the publications.
        s.record_stage(
            "v1",
            Path::new("/s/1"),
            false,
            &opts("/buckets/v1"),
            Some(&req()),
        )
        .unwrap();

        let again = StateStore::open(&dir.path().join("st")).unwrap();
        let v = again.get("v1").unwrap().unwrap();
        assert_eq!(v.staging, PathBuf::from("/s/1"));
        assert_eq!(v.opts.filer_path, "/buckets/v1");
        assert_eq!(v.opts.quota_bytes, 5);
        assert_eq!(v.request, Some(req()));
        assert_eq!(v.targets.len(), 2);
        assert!(v.targets[Path::new("/t/b")].read_only);

        again.record_unpublish("v1", Path::new("/t/a")).unwrap();
        assert_eq!(s.get("v1").unwrap().unwrap().targets.len(), 1);
        // Staged elsewhere: old publications are gone with the old staging.
        s.record_stage(
            "v1",
            Path::new("/s/2"),
            false,
            &opts("/buckets/v1"),
            Some(&req()),
        )
        .unwrap();
        assert!(s.get("v1").unwrap().unwrap().targets.is_empty());
        s.record_unstage("v1").unwrap();
        assert!(again.volumes().unwrap().is_empty());
        // Nothing but the file and the lock is left behind (no temp file).
        let mut names: Vec<String> = std::fs::read_dir(dir.path().join("st"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, vec![FILE_NAME.to_string(), LOCK_NAME.to_string()]);
    }

    /// A file a newer version wrote: fields left out are defaults, fields this version does
    /// not know survive its rewrites.
    #[test]
    fn a_newer_versions_file_is_read_and_its_unknown_fields_kept() {
        let dir = tempfile::tempdir().unwrap();
        let newer = serde_json::json!({
            "format": FORMAT,
            "generation": 7,
            "volumes": {"v": {
                "staging": "/s", "read_only": false, "opts": {"filer_path": "/p"},
                "request": {}, "keeper": {"slot": 3},
                "targets": {"/t/a": {"read_only": true, "since": "x"}}
            }}
        });
        std::fs::write(dir.path().join(FILE_NAME), newer.to_string()).unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        let v = s.get("v").unwrap().expect("the volume is still recorded");
        assert_eq!(v.request, Some(RecordedRequest::default()));
        assert!(s.record_publish("v", Path::new("/t/a"), false).unwrap());
        assert!(s.record_publish("v", Path::new("/t/b"), false).unwrap());
        assert!(s.record_quota("v", 9).unwrap());
        assert!(!s.record_quota("nope", 9).unwrap());
        s.record_stage("v", Path::new("/s"), false, &opts("/p"), None)
            .unwrap();
        let again: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        assert_eq!(again["generation"], 7);
        let v = &again["volumes"]["v"];
        assert_eq!(v["keeper"]["slot"], 3);
        assert_eq!(v["targets"]["/t/a"]["since"], "x");
        assert_eq!(v["targets"]["/t/a"]["read_only"], false);
        assert_eq!(
            v["opts"]["quota_bytes"], 5,
            "record_stage wrote its options"
        );
        assert!(v.get("request").is_none(), "no request: none recorded");
        assert_eq!(s.get("v").unwrap().unwrap().targets.len(), 2);
    }

    /// Options and a request a newer version wrote keep what this version does not know
    /// through its rewrites, and through a repeated NodeStage at the same path.
    #[test]
    fn a_newer_versions_fields_in_options_and_request_survive_rewrites() {
        let dir = tempfile::tempdir().unwrap();
        let newer = serde_json::json!({
            "format": FORMAT,
            "volumes": {"v": {
                "staging": "/s", "read_only": false,
                "opts": {"filer_path": "/p", "quota_bytes": 3, "writeback": {"mode": "async"}},
                "request": {"volume_context": {"k": "v"}, "access_type": "mount"}
            }}
        });
        let file = dir.path().join(FILE_NAME);
        std::fs::write(&file, newer.to_string()).unwrap();
        let raw = || -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap()
        };
        let s = StateStore::open(dir.path()).unwrap();
        assert!(s.record_publish("v", Path::new("/t/a"), false).unwrap());
        assert!(s.record_quota("v", 9).unwrap());
        s.record_unpublish("v", Path::new("/t/a")).unwrap();
        let v = &raw()["volumes"]["v"];
        assert_eq!(v["opts"]["writeback"]["mode"], "async", "{v}");
        assert_eq!(v["opts"]["quota_bytes"], 9);
        assert_eq!(v["request"]["access_type"], "mount", "{v}");

        // kubelet repeats NodeStage: node.rs records the session's options as they are
        let rec = s.get("v").unwrap().unwrap();
        let again = RecordedRequest {
            volume_context: [("k".to_string(), "v".to_string())].into(),
            ..Default::default()
        };
        s.record_stage("v", Path::new("/s"), false, &rec.opts, Some(&again))
            .unwrap();
        let v = &raw()["volumes"]["v"];
        assert_eq!(v["opts"]["writeback"]["mode"], "async", "{v}");
        assert_eq!(v["request"]["access_type"], "mount", "{v}");

        // another path: another session, with only what this version gave it
        s.record_stage("v", Path::new("/s2"), false, &opts("/p"), Some(&again))
            .unwrap();
        let v = &raw()["volumes"]["v"];
        assert!(v["opts"].get("writeback").is_none(), "{v}");
        assert!(v["request"].get("access_type").is_none(), "{v}");
    }

    #[test]
    fn an_expanded_quota_is_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        s.record_stage("v", Path::new("/s"), false, &opts("/p"), Some(&req()))
            .unwrap();
        assert!(s.record_quota("v", 10 << 20).unwrap());
        let again = StateStore::open(dir.path()).unwrap();
        assert_eq!(again.get("v").unwrap().unwrap().opts.quota_bytes, 10 << 20);
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Not JSON (no version writes that: writes are atomic): set aside, every time under a
    /// new name, and the plugin records again.
    #[test]
    fn a_file_that_is_not_json_is_set_aside_under_a_new_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE_NAME);
        for junk in [&b"{not json"[..], b"{\"format\": 1, \"volu"] {
            std::fs::write(&file, junk).unwrap();
            let s = StateStore::open(dir.path()).unwrap();
            assert!(s.volumes().unwrap().is_empty());
            s.record_stage("v", Path::new("/s"), true, &opts("/x"), Some(&req()))
                .unwrap();
            assert!(s.get("v").unwrap().unwrap().read_only);
        }
        let aside: Vec<String> = names(dir.path())
            .into_iter()
            .filter(|n| n.contains("corrupt"))
            .collect();
        assert_eq!(aside.len(), 2, "{aside:?}");
        let kept: Vec<Vec<u8>> = aside
            .iter()
            .map(|n| std::fs::read(dir.path().join(n)).unwrap())
            .collect();
        assert!(kept.contains(&b"{not json".to_vec()), "{aside:?}");
    }

    /// JSON this version cannot read (a newer format, a newer enum variant): kept as it is,
    /// never written, and the store keeps working for what does not need it; once it is
    /// gone, the store records again.
    #[test]
    fn a_newer_versions_format_is_left_as_it_is_and_not_written() {
        let newer = [
            serde_json::json!({"format": 2, "volumes": {"v": {"where": "/s"}}}),
            serde_json::json!({"format": FORMAT, "volumes": {"v": {
                "staging": "/s", "read_only": false,
                "opts": {"volume_server_access": "Quic"}
            }}}),
        ];
        for newer in newer {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join(FILE_NAME);
            let bytes = serde_json::to_vec(&newer).unwrap();
            std::fs::write(&file, &bytes).unwrap();
            let s = StateStore::open(dir.path()).unwrap();
            assert!(s.volumes().unwrap_err().is_unsupported());
            let e = s
                .record_stage("w", Path::new("/s2"), false, &opts("/p"), Some(&req()))
                .unwrap_err();
            assert!(e.is_unsupported(), "{e}");
            assert!(s.record_unstage("v").unwrap_err().is_unsupported());
            assert_eq!(
                std::fs::read(&file).unwrap(),
                bytes,
                "the file is untouched"
            );
            assert_eq!(names(dir.path()), vec![FILE_NAME, LOCK_NAME]);
            drop(s);
            let again = StateStore::open(dir.path()).unwrap();
            assert_eq!(std::fs::read(&file).unwrap(), bytes);
            std::fs::remove_file(&file).unwrap();
            again
                .record_stage("w", Path::new("/s2"), false, &opts("/p"), Some(&req()))
                .unwrap();
            assert!(again.get("w").unwrap().is_some());
        }
    }

    #[test]
    fn concurrent_writers_do_not_lose_updates() {
        let dir = tempfile::tempdir().unwrap();
        let a = std::sync::Arc::new(StateStore::open(dir.path()).unwrap());
        let b = std::sync::Arc::new(StateStore::open(dir.path()).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let s = if i % 2 == 0 { a.clone() } else { b.clone() };
                std::thread::spawn(move || {
                    s.record_stage(
                        &format!("v{i}"),
                        Path::new(&format!("/s/{i}")),
                        false,
                        &opts("/p"),
                        Some(&req()),
                    )
                    .unwrap()
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(a.volumes().unwrap().len(), 8);
    }
}
