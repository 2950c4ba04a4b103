//! The real [`ChunkStore`]: AssignVolume through the filer, raw POST to the volume server,
//! GETs with replica failover, gzip, AES-256-GCM, read JWTs and the three access modes.
//!
//! One `reqwest::Client` is built per [`VolumeClient`] and reused. It has no gzip feature, so it
//! never adds `Accept-Encoding` or inflates by itself: we set the header only on whole-needle
//! GETs (the volume server applies `Range` to the *compressed* bytes if both are sent).
//!
//! Over 800 lines: the read path (replicas, relookup, ranges, gzip) and the upload path
//! (assign, raw POST, retries) share the client, its location cache and its errors.

use super::chunkbuf::{self, ChunkBuf};
use super::cipher;
use super::compress::{self, detect_mime, maybe_gzip};
use super::fid::{chunk_fid, FileId};
use super::fidpool::{self, FidPool, PoolKey};
use super::jwt::mint_read_jwt;
use super::location::{ordered_hosts, LocationCache};
use super::md5x;
use super::{ChunkStore, Result, UploadOptions, VolumeError};
use crate::config::VolumeServerAccess;
use crate::filer::{FilerApi, FilerError};
use crate::pb::filer as pb;
use crate::security::SecurityConfig;
use async_trait::async_trait;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bytes::Bytes;
use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_ENCODING, RANGE};
use reqwest::StatusCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Settings of a [`VolumeClient`].
#[derive(Debug, Clone)]
pub struct VolumeClientOptions {
    /// `-volumeServerAccess`: direct, publicUrl or filerProxy.
    pub access: VolumeServerAccess,
    /// JWT read key and HTTPS client settings.
    pub security: SecurityConfig,
    /// Our data center: replicas there are tried first.
    pub data_center: String,
    /// Total time budget for retry rounds (reads) and re-assigns (uploads).
    pub read_retry: Duration,
    /// Timeout of one upload POST.
    pub upload_timeout: Duration,
    /// Timeout of one GET (headers and body).
    pub read_timeout: Duration,
    /// TCP/TLS connect timeout.
    pub connect_timeout: Duration,
    /// Timeout of one AssignVolume / LookupVolume call through the filer.
    pub filer_timeout: Duration,
    /// Idle keep-alive connections kept per volume server.
    pub max_idle_per_host: usize,
}

impl Default for VolumeClientOptions {
    fn default() -> Self {
        Self {
            access: VolumeServerAccess::Direct,
            security: SecurityConfig::default(),
            data_center: String::new(),
            read_retry: Duration::from_secs(6),
            upload_timeout: Duration::from_secs(120),
            read_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            filer_timeout: Duration::from_secs(30),
            max_idle_per_host: 32,
        }
    }
}

/// Volume-server HTTP client implementing [`ChunkStore`].
pub struct VolumeClient {
    filer: Arc<dyn FilerApi>,
    http: reqwest::Client,
    opts: VolumeClientOptions,
    scheme: &'static str,
    locations: LocationCache,
    /// File ids reserved by earlier assigns (see [`super::fidpool`]).
    fids: FidPool,
    /// The filer's path-rule prefixes and when they were read (None: unknown, assign alone).
    rules: parking_lot::Mutex<(Option<Instant>, Option<PathRules>)>,
    /// One reader of filer.conf at a time.
    rules_read: tokio::sync::Mutex<()>,
    /// Reserving ids is off: the operator said so (`SEAWEEDFS_ASSIGN_BATCH=1`) or a reserved
    /// id was another upload's (a master whose sequencer ignores `count`, e.g. snowflake).
    no_pool: std::sync::atomic::AtomicBool,
}

/// Location prefixes of the filer's path rules.
type PathRules = Arc<Vec<String>>;

/// How long the filer's path rules (filer.conf) are trusted before they are read again: as
/// long as reserved ids live, so a rule added meanwhile misplaces nothing after ~2 x this.
const RULES_FOR: Duration = fidpool::FRESH_FOR;

/// Outcome of one HTTP exchange, classified for the retry logic.
#[derive(Debug)]
enum Failure {
    /// Non-success status with the server's message.
    Status(u16, String),
    /// Connect/send/receive failure (no usable status).
    Transport { msg: String, timeout: bool },
    /// The bytes arrived but are wrong (bad gzip, GCM tag, short body).
    Corrupt(String),
}

impl Failure {
    fn from_reqwest(e: reqwest::Error) -> Self {
        Failure::Transport {
            timeout: e.is_timeout(),
            msg: error_chain(&e),
        }
    }

    /// Worth another replica / round: 404, >= 499 and transport errors (not 429).
    fn retryable(&self) -> bool {
        match self {
            Failure::Status(s, _) => *s == 404 || *s >= 499,
            Failure::Transport { .. } => true,
            Failure::Corrupt(_) => false,
        }
    }

    fn into_read_error(self, fid: &str) -> VolumeError {
        let fid = fid.to_string();
        match self {
            Failure::Status(404, _) => VolumeError::NotFound { fid },
            Failure::Status(401 | 403, msg) => {
                VolumeError::Unauthorized(format!("read {fid}: {msg}"))
            }
            Failure::Status(416, msg) => VolumeError::Corrupt {
                fid,
                msg: format!("range not satisfiable: {msg}"),
            },
            Failure::Status(s, msg) => VolumeError::Read {
                fid,
                msg: format!("HTTP {s}: {msg}"),
            },
            Failure::Transport { msg, timeout: true } => {
                VolumeError::Timeout(format!("read {fid}: {msg}"))
            }
            Failure::Transport { msg, .. } => VolumeError::Read { fid, msg },
            Failure::Corrupt(msg) => VolumeError::Corrupt { fid, msg },
        }
    }

    fn into_upload_error(self, fid: &str) -> VolumeError {
        let fid = fid.to_string();
        match self {
            Failure::Status(401 | 403, msg) => {
                VolumeError::Unauthorized(format!("upload {fid}: {msg}"))
            }
            Failure::Status(s, msg) => VolumeError::Upload {
                fid,
                msg: format!("HTTP {s}: {msg}"),
            },
            Failure::Transport { msg, timeout: true } => {
                VolumeError::Timeout(format!("upload {fid}: {msg}"))
            }
            Failure::Transport { msg, .. } | Failure::Corrupt(msg) => {
                VolumeError::Upload { fid, msg }
            }
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// What the upload says about the chunk's bytes.
struct Part<'a> {
    filename: &'a str,
    mime: Option<&'a str>,
    gzip: bool,
    md5: Option<&'a str>,
}

/// What a successful POST told us.
struct UploadReply {
    content_md5: String,
}

impl VolumeClient {
    /// Builds the client (one pooled HTTP client, HTTPS when `[https.client] enabled`).
    pub fn new(filer: Arc<dyn FilerApi>, opts: VolumeClientOptions) -> Result<Self> {
        let sec = &opts.security;
        let mut b = reqwest::Client::builder()
            .connect_timeout(opts.connect_timeout)
            .pool_max_idle_per_host(opts.max_idle_per_host)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .user_agent(concat!("seaweedfs-csi-driver/", env!("CARGO_PKG_VERSION")));
        if sec.https_client_enabled {
            let cfg = |what: &str, e: &dyn std::fmt::Display| {
                VolumeError::Config(format!("https client {what}: {e}"))
            };
            if let Some(ca) = &sec.https_ca {
                let pem =
                    std::fs::read(ca).map_err(|e| cfg(&format!("ca {}", ca.display()), &e))?;
                for c in reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| cfg("ca", &e))? {
                    b = b.add_root_certificate(c);
                }
            }
            if let (Some(cert), Some(key)) = (&sec.https_cert, &sec.https_key) {
                let mut pem = std::fs::read(cert)
                    .map_err(|e| cfg(&format!("cert {}", cert.display()), &e))?;
                pem.push(b'\n');
                pem.extend(
                    std::fs::read(key).map_err(|e| cfg(&format!("key {}", key.display()), &e))?,
                );
                b = b.identity(reqwest::Identity::from_pem(&pem).map_err(|e| cfg("identity", &e))?);
            }
            if sec.https_insecure_skip_verify {
                b = b.danger_accept_invalid_certs(true);
            }
        }
        let http = b
            .build()
            .map_err(|e| VolumeError::Config(format!("http client: {}", error_chain(&e))))?;
        let scheme = if sec.https_client_enabled {
            "https"
        } else {
            "http"
        };
        let locations = LocationCache::new(filer.clone(), opts.filer_timeout);
        Ok(Self {
            filer,
            http,
            opts,
            scheme,
            locations,
            fids: FidPool::default(),
            rules: parking_lot::Mutex::new((None, None)),
            rules_read: tokio::sync::Mutex::new(()),
            no_pool: (std::env::var("SEAWEEDFS_ASSIGN_BATCH").as_deref() == Ok("1")).into(),
        })
    }

    /// The volume-location cache (to seed or invalidate, and for tests).
    pub fn locations(&self) -> &LocationCache {
        &self.locations
    }

    pub fn options(&self) -> &VolumeClientOptions {
        &self.opts
    }

    fn read_auth(&self, fid: &str) -> Option<String> {
        let key = self
            .opts
            .security
            .jwt_read_key
            .as_deref()
            .filter(|k| !k.is_empty())?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Some(format!(
            "Bearer {}",
            mint_read_jwt(
                key.as_bytes(),
                fid,
                self.opts.security.jwt_read_expires_secs,
                now
            )
        ))
    }

    /// DELETE of one needle on a volume server holding it (the server deletes the replicas).
    async fn delete_one(&self, fid_str: &str) -> Result<()> {
        let fid = FileId::parse(fid_str).map_err(|_| VolumeError::InvalidFileId(fid_str.into()))?;
        let locs = self
            .locations
            .get(fid.volume_id)
            .await
            .map_err(|e| e.error)?;
        let hosts = ordered_hosts(&locs, self.opts.access, &self.opts.data_center);
        let host = hosts
            .first()
            .ok_or(VolumeError::NoLocation(fid.volume_id))?;
        let url = format!("{}://{host}/{fid_str}", self.scheme);
        let mut req = self.http.delete(&url).timeout(self.opts.read_timeout);
        if let Some(key) = self
            .opts
            .security
            .jwt_write_key
            .as_deref()
            .filter(|k| !k.is_empty())
        {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            // write tokens carry the same claims as read tokens, signed with the write key
            let token = mint_read_jwt(key.as_bytes(), fid_str, 10, now);
            req = req.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let resp = req.send().await.map_err(|e| VolumeError::Upload {
            fid: fid_str.into(),
            msg: format!("delete: {e}"),
        })?;
        let status = resp.status().as_u16();
        if resp.status().is_success() || status == 404 {
            return Ok(());
        }
        Err(if status == 401 {
            VolumeError::Unauthorized(format!("delete of {fid_str}"))
        } else {
            VolumeError::Upload {
                fid: fid_str.into(),
                msg: format!("delete: HTTP {status}"),
            }
        })
    }

    /// Full GET URLs of a needle, in the order to try.
    async fn read_urls(
        &self,
        fid: &FileId,
        fid_str: &str,
    ) -> std::result::Result<Vec<String>, (VolumeError, bool)> {
        if self.opts.access == VolumeServerAccess::FilerProxy {
            let filer = self.filer.http_address();
            return Ok(vec![format!(
                "{}://{filer}/?proxyChunkId={fid_str}&readDeleted=true",
                self.scheme
            )]);
        }
        let locs = self
            .locations
            .get(fid.volume_id)
            .await
            .map_err(|e| (e.error, e.retryable))?;
        let hosts = ordered_hosts(&locs, self.opts.access, &self.opts.data_center);
        if hosts.is_empty() {
            return Err((VolumeError::NoLocation(fid.volume_id), true));
        }
        Ok(hosts
            .into_iter()
            .map(|h| format!("{}://{h}/{fid_str}?readDeleted=true", self.scheme))
            .collect())
    }

    /// One GET. `range` is `(offset, len)` with `len > 0`; whole fetches ask for gzip unless the
    /// chunk is encrypted. Returns the body with any `Content-Encoding: gzip` undone.
    async fn get_once(
        &self,
        url: &str,
        auth: Option<&str>,
        range: Option<(u64, u64)>,
        accept_gzip: bool,
    ) -> std::result::Result<Bytes, Failure> {
        let mut req = self.http.get(url).timeout(self.opts.read_timeout);
        if let Some(a) = auth {
            req = req.header(AUTHORIZATION, a);
        }
        match range {
            Some((off, len)) => req = req.header(RANGE, format!("bytes={}-{}", off, off + len - 1)),
            None if accept_gzip => req = req.header(reqwest::header::ACCEPT_ENCODING, "gzip"),
            None => {}
        }
        let resp = req.send().await.map_err(Failure::from_reqwest)?;
        let status = resp.status();
        let gzipped = is_gzip_encoded(resp.headers());
        if !status.is_success() {
            let body = resp.bytes().await.unwrap_or_default();
            return Err(Failure::Status(status.as_u16(), error_message(&body)));
        }
        let partial = status == StatusCode::PARTIAL_CONTENT;
        let body = read_body(resp).await?;
        let body = if gzipped {
            if range.is_some() {
                // The server must not compress a ranged answer; if it did, the bytes are unusable.
                return Err(Failure::Corrupt(
                    "gzip-encoded answer to a Range request".into(),
                ));
            }
            Bytes::from(compress::gunzip(&body).map_err(Failure::Corrupt)?)
        } else {
            body
        };
        match range {
            Some((off, len)) if !partial => {
                // A plain 200 carries the whole needle: slice it ourselves.
                slice(&body, off, len).map_err(Failure::Corrupt)
            }
            Some((_, len)) if (body.len() as u64) < len => Err(Failure::Corrupt(format!(
                "short body: {} of {len} bytes",
                body.len()
            ))),
            Some((_, len)) => Ok(body.slice(..len as usize)),
            None => Ok(body),
        }
    }

    /// Reads a needle with failover across replicas, one re-lookup, and retry rounds (1 s, ×1.5)
    /// within `read_retry`. `decode` turns the wire body into clear bytes; a decode error counts
    /// as that replica being corrupt.
    async fn read_needle<F>(
        &self,
        chunk: &pb::FileChunk,
        range: Option<(u64, u64)>,
        accept_gzip: bool,
        decode: F,
    ) -> Result<Bytes>
    where
        F: Fn(Bytes) -> std::result::Result<Bytes, String>,
    {
        let fid = chunk_fid(chunk)?;
        let fid_str = fid.to_string();
        let start = Instant::now();
        let mut pauses = crate::retry::STORAGE.pauses();
        let mut relooked = false;
        loop {
            // Minted per round so a short `expires_after_seconds` cannot expire during retries.
            let auth = match self.opts.access {
                VolumeServerAccess::FilerProxy => None,
                _ => self.read_auth(&fid_str),
            };
            let mut last: Option<Failure> = None;
            let mut lookup_err: Option<VolumeError> = None;
            let mut any_retryable = false;
            match self.read_urls(&fid, &fid_str).await {
                Err((e, retryable)) => {
                    any_retryable = retryable;
                    lookup_err = Some(e);
                }
                Ok(urls) => {
                    for url in &urls {
                        let res = self
                            .get_once(url, auth.as_deref(), range, accept_gzip)
                            .await;
                        let res = res.and_then(|b| decode(b).map_err(Failure::Corrupt));
                        match res {
                            Ok(b) => return Ok(b),
                            Err(f) => {
                                tracing::debug!(fid = %fid_str, url = %url, failure = ?f, "chunk read attempt failed");
                                match &f {
                                    Failure::Status(401 | 403 | 429, _) => {
                                        return Err(f.into_read_error(&fid_str))
                                    }
                                    Failure::Status(s, _) if *s != 404 && *s < 499 => {
                                        return Err(f.into_read_error(&fid_str))
                                    }
                                    _ => {}
                                }
                                any_retryable |= f.retryable();
                                // Keep the most telling failure: corrupt beats 404/transport.
                                if !matches!(last, Some(Failure::Corrupt(_))) {
                                    last = Some(f);
                                }
                            }
                        }
                    }
                }
            }
            let err = match (last, lookup_err) {
                (Some(f), _) => f.into_read_error(&fid_str),
                (None, Some(e)) => e,
                (None, None) => VolumeError::NoLocation(fid.volume_id),
            };
            if !any_retryable {
                return Err(err);
            }
            if !relooked && self.opts.access != VolumeServerAccess::FilerProxy {
                // Every replica failed: the cached list may be stale. Look it up once more now.
                relooked = true;
                self.locations.invalidate(fid.volume_id).await;
                continue;
            }
            let wait = pauses.next_pause();
            if start.elapsed() + wait > self.opts.read_retry {
                tracing::warn!(fid = %fid_str, error = %err, elapsed_ms = start.elapsed().as_millis() as u64, "chunk read failed");
                return Err(err);
            }
            tracing::debug!(fid = %fid_str, error = %err, wait_ms = wait.as_millis() as u64, "chunk read: retrying");
            tokio::time::sleep(wait).await;
        }
    }

    /// A file id for one upload: one reserved earlier for files placed alike, else a new
    /// assign that reserves more. Also returns the pool the id came from or went to.
    async fn assign(
        &self,
        opts: &UploadOptions,
        size: u64,
    ) -> std::result::Result<(pb::AssignVolumeResponse, Option<PoolKey>), (VolumeError, bool)> {
        let key = self.pool_key(opts, size).await;
        if let Some(a) = key.as_ref().and_then(|k| self.fids.take(k)) {
            return Ok((a, key));
        }
        let count = if key.is_some() { fidpool::BATCH } else { 1 };
        let a = self.assign_once(opts, size, count).await?;
        if let Some(k) = &key {
            self.fids.keep(k.clone(), &a);
        }
        Ok((a, key))
    }

    /// Uploads that may share an assign with others of `opts`'s directory, unless a path
    /// rule of the filer tells files of that directory apart or the rules are unknown.
    async fn pool_key(&self, opts: &UploadOptions, size: u64) -> Option<PoolKey> {
        // large chunks gain little, and 16 of them on one volume would not spread; but an
        // fsync of a file that fsyncs often waits for its assign
        let pooled = size <= fidpool::MAX_POOLED_SIZE
            || (opts.syncs && size <= fidpool::MAX_SYNC_POOLED_SIZE);
        if !pooled || self.no_pool.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let (dir, _) = opts.path.rsplit_once('/')?;
        let dir = if dir.is_empty() { "/" } else { dir };
        let rules = self.path_rules().await?;
        if fidpool::splits_dir(dir, &rules) {
            return None;
        }
        Some(PoolKey {
            collection: opts.collection.clone(),
            replication: opts.replication.clone(),
            ttl_sec: opts.ttl_sec,
            data_center: opts.data_center.clone(),
            disk_type: opts.disk_type.clone(),
            dir: dir.to_string(),
        })
    }

    /// The filer's path-rule prefixes, read again every [`RULES_FOR`]. None when they
    /// cannot be read or parsed.
    async fn path_rules(&self) -> Option<PathRules> {
        let fresh = || {
            let r = self.rules.lock();
            r.0.is_some_and(|at| at.elapsed() < RULES_FOR)
                .then(|| r.1.clone())
        };
        if let Some(r) = fresh() {
            return r;
        }
        let _one = self.rules_read.lock().await;
        if let Some(r) = fresh() {
            return r;
        }
        let read = tokio::time::timeout(
            self.opts.filer_timeout,
            self.filer.lookup_entry("/etc/seaweedfs", "filer.conf"),
        )
        .await;
        let rules = match read {
            Ok(Err(FilerError::NotFound(_))) => Some(Vec::new()),
            // rules kept in chunks (a huge file) are not read here: assign alone
            Ok(Ok(e)) if e.chunks.is_empty() => fidpool::rule_prefixes(&e.content),
            Ok(Ok(_)) => None,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "filer.conf not readable; file ids assigned one at a time");
                None
            }
            Err(_) => None,
        };
        let rules = rules.map(Arc::new);
        *self.rules.lock() = (Some(Instant::now()), rules.clone());
        rules
    }

    async fn assign_once(
        &self,
        opts: &UploadOptions,
        size: u64,
        count: i32,
    ) -> std::result::Result<pb::AssignVolumeResponse, (VolumeError, bool)> {
        let req = pb::AssignVolumeRequest {
            count,
            collection: opts.collection.clone(),
            replication: opts.replication.clone(),
            ttl_sec: opts.ttl_sec,
            data_center: if opts.data_center.is_empty() {
                self.opts.data_center.clone()
            } else {
                opts.data_center.clone()
            },
            path: opts.path.clone(),
            disk_type: opts.disk_type.clone(),
            expected_data_size: size,
            ..Default::default()
        };
        match tokio::time::timeout(self.opts.filer_timeout, self.filer.assign_volume(req)).await {
            Err(_) => Err((VolumeError::Timeout("AssignVolume".into()), true)),
            Ok(Err(e)) => {
                let retryable = matches!(e, FilerError::Unavailable(_) | FilerError::Timeout(_));
                Err((VolumeError::Assign(e.to_string()), retryable))
            }
            Ok(Ok(r)) if !r.error.is_empty() => Err((VolumeError::Assign(r.error), false)),
            Ok(Ok(r)) => Ok(r),
        }
    }

    fn upload_url(&self, assign: &pb::AssignVolumeResponse, fid: &str) -> Result<String> {
        if self.opts.access == VolumeServerAccess::FilerProxy {
            return Ok(format!(
                "{}://{}/?proxyChunkId={fid}",
                self.scheme,
                self.filer.http_address()
            ));
        }
        let loc = assign.location.as_ref();
        let host = loc
            .map(|l| match self.opts.access {
                VolumeServerAccess::PublicUrl if !l.public_url.is_empty() => l.public_url.as_str(),
                _ => l.url.as_str(),
            })
            .unwrap_or("");
        if host.is_empty() {
            return Err(VolumeError::Assign(format!(
                "assign of {fid} returned no location"
            )));
        }
        Ok(format!("{}://{host}/{fid}", self.scheme))
    }

    async fn post_once(
        &self,
        url: &str,
        auth: &str,
        body: &RawUpload,
    ) -> std::result::Result<UploadReply, Failure> {
        // a body of bytes carries its length (Content-Length), and clones share them
        let mut req = self
            .http
            .post(url)
            .timeout(self.opts.upload_timeout)
            .headers(body.headers.clone())
            .body(body.data.clone());
        if !auth.is_empty() {
            req = req.header(AUTHORIZATION, format!("Bearer {auth}"));
        }
        let resp = req.send().await.map_err(Failure::from_reqwest)?;
        let status = resp.status();
        let header_md5 = resp
            .headers()
            .get("Content-MD5")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body = resp.bytes().await.map_err(Failure::from_reqwest)?;
        match status.as_u16() {
            204 => Ok(UploadReply {
                content_md5: header_md5,
            }),
            201 | 200 => {
                let json: serde_json::Value =
                    serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
                if let Some(err) = json
                    .get("error")
                    .and_then(|e| e.as_str())
                    .filter(|e| !e.is_empty())
                {
                    return Err(Failure::Status(500, err.to_string()));
                }
                let md5 = if header_md5.is_empty() {
                    json.get("contentMd5")
                        .and_then(|v| v.as_str())
                        .unwrap_or("")
                        .to_string()
                } else {
                    header_md5
                };
                Ok(UploadReply { content_md5: md5 })
            }
            s => Err(Failure::Status(s, error_message(&body))),
        }
    }

    /// Up to 3 attempts on the same fid (pauses of the `UPLOAD_ATTEMPT` policy) for retryable
    /// failures.
    async fn upload_to_fid(
        &self,
        url: &str,
        auth: &str,
        body: RawUpload,
    ) -> std::result::Result<UploadReply, Failure> {
        let mut attempt = 0u32;
        let mut pauses = crate::retry::UPLOAD_ATTEMPT.pauses();
        loop {
            match self.post_once(url, auth, &body).await {
                Ok(r) => return Ok(r),
                Err(f) => {
                    let retry = matches!(&f, Failure::Status(s, _) if *s >= 500)
                        || matches!(f, Failure::Transport { .. });
                    attempt += 1;
                    if !retry || attempt >= 3 {
                        return Err(f);
                    }
                    tracing::debug!(url, failure = ?f, attempt, "chunk upload attempt failed");
                    tokio::time::sleep(pauses.next_pause()).await;
                }
            }
        }
    }
}

fn is_gzip_encoded(h: &HeaderMap) -> bool {
    h.get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("gzip"))
}

/// `{"error": "..."}` from a SeaweedFS error body, else the (short) raw text.
fn error_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
            return e.to_string();
        }
    }
    let s = String::from_utf8_lossy(&body[..body.len().min(200)]);
    s.trim().to_string()
}

fn slice(b: &Bytes, off: u64, len: u64) -> std::result::Result<Bytes, String> {
    let end = off.checked_add(len).ok_or("range overflow")?;
    if end > b.len() as u64 {
        return Err(format!(
            "short body: needle has {} bytes, wanted [{off}, {end})",
            b.len()
        ));
    }
    Ok(b.slice(off as usize..end as usize))
}

/// A chunk's upload: its bytes as the raw body of the POST (sent from the buffer they were
/// written into) and what describes them as request headers. The volume server reads such a
/// body straight into the needle; a multipart form, as other clients send, costs it a parse
/// and a copy of every byte (~1 ms of its CPU per MiB here, on every upload).
#[derive(Clone)]
struct RawUpload {
    headers: HeaderMap,
    data: Bytes,
}

/// Builds the POST SeaweedFS volume servers take as a raw upload: a `Content-Type` other than
/// a form (they read a body without one as multipart), the needle's name in
/// `Content-Disposition`, and `Content-Encoding`/`Content-MD5` as a part's headers would say.
fn raw_upload(url: &str, part: &Part<'_>, data: Bytes) -> RawUpload {
    // Quotes, backslashes, controls and non-ASCII would need RFC 2231 encoding; the name only
    // labels the needle, so replace them.
    let filename: String = part
        .filename
        .chars()
        .map(|c| {
            if c.is_ascii() && !c.is_ascii_control() && c != '"' && c != '\\' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut headers = HeaderMap::new();
    // without a Content-Type the server would parse the body as a form: never leave it out
    let octets = reqwest::header::HeaderValue::from_static("application/octet-stream");
    let content_type = part
        .mime
        .and_then(|m| reqwest::header::HeaderValue::from_str(m).ok())
        .unwrap_or(octets);
    headers.insert("content-type", content_type);
    let mut set = |name: &'static str, value: &str| {
        // every value is printable ASCII (names sanitized above, base64, URLs we built)
        match reqwest::header::HeaderValue::from_str(value) {
            Ok(v) => {
                headers.insert(name, v);
            }
            Err(_) => tracing::warn!(name, value, "not a header value; left out of the upload"),
        }
    };
    if !filename.is_empty() {
        set(
            "content-disposition",
            &format!("attachment; filename=\"{filename}\""),
        );
    }
    set("idempotency-key", url);
    if part.gzip {
        set("content-encoding", "gzip");
    }
    if let Some(md5) = part.md5 {
        set("content-md5", md5);
    }
    RawUpload { headers, data }
}

/// Collects a response body. Chunk-sized bodies of known length go into a buffer of their own
/// (all pages mapped in one call, see `chunkbuf`); others into the allocator, as reqwest does.
async fn read_body(mut resp: reqwest::Response) -> std::result::Result<Bytes, Failure> {
    let want = resp.content_length().unwrap_or(0) as usize;
    let buf = match want {
        n if (chunkbuf::MIN_LEN..=chunkbuf::MAX_LEN).contains(&n) => ChunkBuf::with_capacity(n),
        _ => None,
    };
    let Some(mut buf) = buf else {
        return resp.bytes().await.map_err(Failure::from_reqwest);
    };
    while let Some(piece) = resp.chunk().await.map_err(Failure::from_reqwest)? {
        if !buf.extend_from_slice(&piece) {
            return Err(Failure::Corrupt(format!(
                "body longer than its Content-Length {want}"
            )));
        }
    }
    if buf.len() != want {
        // hyper reports a connection closed early as an error; be strict anyway
        return Err(Failure::Transport {
            msg: format!("body ended after {} of {want} bytes", buf.len()),
            timeout: false,
        });
    }
    Ok(buf.into_bytes())
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or("")
}

#[async_trait]
impl ChunkStore for VolumeClient {
    async fn upload(&self, data: Bytes, opts: &UploadOptions) -> Result<pb::FileChunk> {
        let clear_len = data.len() as u64;
        let mime = detect_mime(&data);
        let gz = maybe_gzip(&data, mime);
        let is_compressed = gz.is_some();
        // the retry budget counts from here: the first assign runs beside the hash below
        let start = Instant::now();
        let md5;
        let mut first_assign = None;
        let (payload, part, cipher_key) = if opts.cipher {
            // encrypt(gzip?(data)); no name, mime, encoding or MD5: the server sees ciphertext only.
            let key = cipher::gen_key();
            let plain: &[u8] = gz.as_deref().unwrap_or(&data);
            let enc = cipher::encrypt(plain, &key).map_err(|msg| VolumeError::Upload {
                fid: String::new(),
                msg,
            })?;
            (
                Bytes::from(enc),
                Part {
                    filename: "",
                    mime: None,
                    gzip: false,
                    md5: None,
                },
                key,
            )
        } else {
            // the first assign runs while the chunk is hashed: an fsync waits for both
            let hash = async {
                let streamed = match &opts.md5 {
                    Some(s) => s.digest(clear_len).await,
                    None => None,
                };
                match streamed {
                    Some(d) => d,
                    None => md5x::digest(data.clone(), opts.may_wait).await,
                }
            };
            let (digest, assigned) = tokio::join!(hash, self.assign(opts, clear_len));
            first_assign = Some(assigned);
            md5 = B64.encode(digest);
            let payload = match gz {
                Some(z) => Bytes::from(z),
                None => data.clone(),
            };
            let part = Part {
                filename: base_name(&opts.path),
                mime,
                gzip: is_compressed,
                md5: Some(md5.as_str()),
            };
            (payload, part, Vec::new())
        };

        let mut pauses = crate::retry::STORAGE.pauses();
        loop {
            let assigned = match first_assign.take() {
                Some(a) => a,
                None => self.assign(opts, clear_len).await,
            };
            let (err, retryable) = match assigned {
                Err(e) => e,
                Ok((assign, pool)) => {
                    let fid = FileId::parse(&assign.file_id).map_err(|_| {
                        if let Some(k) = &pool {
                            self.fids.forget(k);
                        }
                        VolumeError::Assign(format!(
                            "assign returned bad file id {:?}",
                            assign.file_id
                        ))
                    })?;
                    // stored without a `_n` suffix (every client reads plain ids); uploaded
                    // with it (the write JWT names the assign's first id)
                    let fid_str = fid.to_string();
                    let url = self.upload_url(&assign, &assign.file_id)?;
                    let body = raw_upload(&url, &part, payload.clone());
                    match self.upload_to_fid(&url, &assign.auth, body).await {
                        Ok(reply) => {
                            return Ok(pb::FileChunk {
                                file_id: fid_str,
                                fid: Some(fid.to_pb()),
                                size: clear_len,
                                e_tag: reply.content_md5,
                                cipher_key,
                                is_compressed,
                                ..Default::default()
                            })
                        }
                        Err(f) => {
                            if let Some(k) = &pool {
                                self.fids.forget(k);
                                if matches!(&f, Failure::Status(_, m) if m.contains("cookie")) {
                                    // key+n was another assign's: the master does not
                                    // reserve `count` keys (snowflake sequencer)
                                    tracing::warn!(fid = %assign.file_id, error = ?f,
                                        "a reserved file id belonged to another upload; assigning one id at a time from now on");
                                    self.no_pool
                                        .store(true, std::sync::atomic::Ordering::Relaxed);
                                }
                            }
                            // 5xx and unreachable servers: another volume may work (re-assign).
                            // A reserved id's JWT may have run out: assign a fresh one.
                            let retryable = matches!(&f, Failure::Status(s, _) if *s >= 500)
                                || matches!(f, Failure::Transport { .. })
                                || (pool.is_some() && matches!(&f, Failure::Status(401, _)));
                            (f.into_upload_error(&fid_str), retryable)
                        }
                    }
                }
            };
            let backoff = pauses.next_pause();
            if !retryable || start.elapsed() + backoff > self.opts.read_retry {
                tracing::warn!(path = %opts.path, error = %err, "chunk upload failed");
                return Err(err);
            }
            tracing::debug!(path = %opts.path, error = %err, "chunk upload: re-assigning");
            tokio::time::sleep(backoff).await;
        }
    }

    fn expedite(&self) {
        md5x::kick();
    }

    fn batch_width(&self) -> usize {
        md5x::lanes()
    }

    async fn delete_chunks(&self, file_ids: &[String]) -> Result<()> {
        if self.opts.access == VolumeServerAccess::FilerProxy {
            // the filer's proxy serves reads only; volume.fsck finds these
            tracing::debug!(
                count = file_ids.len(),
                "orphaned chunks left (filerProxy access)"
            );
            return Ok(());
        }
        let mut first_err = None;
        for fid_str in file_ids {
            if let Err(e) = self.delete_one(fid_str).await {
                tracing::debug!(fid = %fid_str, error = %e, "orphaned chunk not deleted");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    async fn fetch_chunk(&self, chunk: &pb::FileChunk) -> Result<Bytes> {
        let key = chunk.cipher_key.clone();
        let is_compressed = chunk.is_compressed;
        let min_len = if chunk.is_chunk_manifest {
            0
        } else {
            chunk.size
        };
        let decode = move |body: Bytes| -> std::result::Result<Bytes, String> {
            let clear = if key.is_empty() {
                // Unencrypted gzip needles came back with Content-Encoding and are inflated already.
                body
            } else {
                let plain = cipher::decrypt(&body, &key)?;
                if is_compressed {
                    Bytes::from(compress::gunzip(&plain)?)
                } else {
                    Bytes::from(plain)
                }
            };
            if (clear.len() as u64) < min_len {
                return Err(format!(
                    "short body: {} bytes, chunk size {min_len}",
                    clear.len()
                ));
            }
            Ok(clear)
        };
        self.read_needle(chunk, None, chunk.cipher_key.is_empty(), decode)
            .await
    }

    async fn fetch_range(&self, chunk: &pb::FileChunk, offset: u64, len: u64) -> Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        if offset.checked_add(len).is_none() {
            let fid = chunk_fid(chunk).map(|f| f.to_string()).unwrap_or_default();
            let msg = format!("range {offset}+{len} overflows");
            return Err(VolumeError::Corrupt { fid, msg });
        }
        if chunk.is_compressed || !chunk.cipher_key.is_empty() {
            let whole = self.fetch_chunk(chunk).await?;
            let fid = chunk_fid(chunk).map(|f| f.to_string()).unwrap_or_default();
            return slice(&whole, offset, len).map_err(|msg| VolumeError::Corrupt { fid, msg });
        }
        self.read_needle(chunk, Some((offset, len)), false, Ok)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_upload_headers() {
        let part = Part {
            filename: "a\"b\u{e9}.txt",
            mime: Some("text/plain"),
            gzip: true,
            md5: Some("xyz=="),
        };
        let b = raw_upload("http://h/1,01", &part, Bytes::from_static(b"DATA"));
        let h = |n: &str| b.headers.get(n).map(|v| v.to_str().unwrap().to_string());
        assert_eq!(h("content-type").as_deref(), Some("text/plain"));
        assert_eq!(
            h("content-disposition").as_deref(),
            Some("attachment; filename=\"a_b_.txt\"")
        );
        assert_eq!(h("idempotency-key").as_deref(), Some("http://h/1,01"));
        assert_eq!(h("content-encoding").as_deref(), Some("gzip"));
        assert_eq!(h("content-md5").as_deref(), Some("xyz=="));
        assert_eq!(&b.data[..], b"DATA");
        // a ciphered chunk: no name, type, encoding or digest of the plaintext (the server
        // names the needle after its id); never a form
        let plain = Part {
            filename: "",
            mime: None,
            gzip: false,
            md5: None,
        };
        let b = raw_upload("http://h/1,01", &plain, Bytes::from_static(b"x"));
        assert_eq!(
            b.headers.get("content-type").unwrap(),
            "application/octet-stream"
        );
        for n in ["content-disposition", "content-encoding", "content-md5"] {
            assert!(b.headers.get(n).is_none(), "{n}");
        }
    }

    #[test]
    fn error_messages_and_slices() {
        assert_eq!(error_message(br#"{"error":"wrong jwt"}"#), "wrong jwt");
        assert_eq!(error_message(b"plain text\n"), "plain text");
        let b = Bytes::from_static(b"0123456789");
        assert_eq!(&slice(&b, 2, 3).unwrap()[..], b"234");
        assert!(slice(&b, 8, 3).is_err());
        assert!(slice(&b, u64::MAX, 3).is_err());
        assert_eq!(base_name("/a/b/c.txt"), "c.txt");
        assert_eq!(base_name(""), "");
    }

    #[test]
    fn failure_classification() {
        assert!(Failure::Status(404, String::new()).retryable());
        assert!(Failure::Status(503, String::new()).retryable());
        assert!(Failure::Status(499, String::new()).retryable());
        assert!(!Failure::Status(429, String::new()).retryable());
        assert!(!Failure::Status(400, String::new()).retryable());
        assert!(matches!(
            Failure::Status(401, "x".into()).into_read_error("1,01"),
            VolumeError::Unauthorized(_)
        ));
        assert!(matches!(
            Failure::Status(404, "x".into()).into_read_error("1,01"),
            VolumeError::NotFound { .. }
        ));
        assert!(matches!(
            Failure::Corrupt("x".into()).into_read_error("1,01"),
            VolumeError::Corrupt { .. }
        ));
    }
}
