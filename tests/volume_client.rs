//! Volume-server client against a real `weed` (upload, read back through the filer HTTP API and
//! through our read path, encryption, JWT) plus a tiny fake HTTP volume server and a fake filer
//! for fault injection (retries, failover, status handling) that does not depend on timing.

// The shared harness has items (and an import) this file does not use.
#[allow(unused_imports)]
mod common;

use async_trait::async_trait;
use bytes::Bytes;
use common::{WeedOptions, WeedServer};
use parking_lot::Mutex;
use rand::{Rng, RngExt, SeedableRng};
use seaweedfs_csi_driver::chunks::{self, ReadPiece};
use seaweedfs_csi_driver::config::VolumeServerAccess;
use seaweedfs_csi_driver::filer::grpc::{FilerClientOptions, GrpcFiler};
use seaweedfs_csi_driver::filer::{FilerApi, FilerError, MetadataStream};
use seaweedfs_csi_driver::pb::filer as pb;
use seaweedfs_csi_driver::security::SecurityConfig;
use seaweedfs_csi_driver::volume::http::{VolumeClient, VolumeClientOptions};
use seaweedfs_csi_driver::volume::{ChunkStore, UploadOptions, VolumeError};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ---------------------------------------------------------------------------------------------
// The real filer client.

async fn connect_filer(w: &WeedServer) -> Arc<dyn FilerApi> {
    let opts = FilerClientOptions {
        addresses: vec![w.filer_addr()],
        ..Default::default()
    };
    Arc::new(GrpcFiler::connect(opts).await.expect("filer client"))
}

fn unsupported<T>() -> Result<T, FilerError> {
    Err(FilerError::Other("not used by these tests".into()))
}

// ---------------------------------------------------------------------------------------------
// Fake filer: fixed assign answers and volume locations, optionally delegating the rest.

#[derive(Default)]
struct FakeFiler {
    inner: Option<Arc<dyn FilerApi>>,
    locations: Mutex<HashMap<u32, Vec<pb::Location>>>,
    assign: Mutex<Option<pb::AssignVolumeResponse>>,
    assigns: AtomicU32,
    lookups: AtomicU32,
}

impl FakeFiler {
    fn with_locations(locs: Vec<(u32, Vec<pb::Location>)>) -> Arc<Self> {
        let f = FakeFiler::default();
        f.locations.lock().extend(locs);
        Arc::new(f)
    }
}

fn loc(host: &str, dc: &str) -> pb::Location {
    pb::Location {
        url: host.into(),
        public_url: host.into(),
        data_center: dc.into(),
        ..Default::default()
    }
}

#[async_trait]
impl FilerApi for FakeFiler {
    async fn lookup_entry(&self, dir: &str, name: &str) -> Result<pb::Entry, FilerError> {
        match &self.inner {
            Some(i) => i.lookup_entry(dir, name).await,
            None => unsupported(),
        }
    }
    async fn list_page(
        &self,
        _: &str,
        _: &str,
        _: bool,
        _: u32,
    ) -> Result<Vec<pb::Entry>, FilerError> {
        unsupported()
    }
    async fn create_entry(
        &self,
        req: pb::CreateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>, FilerError> {
        match &self.inner {
            Some(i) => i.create_entry(req).await,
            None => unsupported(),
        }
    }
    async fn update_entry(
        &self,
        _: pb::UpdateEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>, FilerError> {
        unsupported()
    }
    async fn delete_entry(
        &self,
        _: pb::DeleteEntryRequest,
    ) -> Result<Option<pb::SubscribeMetadataResponse>, FilerError> {
        unsupported()
    }
    async fn rename_entry(
        &self,
        _: pb::StreamRenameEntryRequest,
    ) -> Result<Vec<pb::StreamRenameEntryResponse>, FilerError> {
        unsupported()
    }
    async fn assign_volume(
        &self,
        req: pb::AssignVolumeRequest,
    ) -> Result<pb::AssignVolumeResponse, FilerError> {
        self.assigns.fetch_add(1, Ordering::SeqCst);
        if let Some(a) = self.assign.lock().clone() {
            return Ok(a);
        }
        match &self.inner {
            Some(i) => i.assign_volume(req).await,
            None => Err(FilerError::Other("no assign configured".into())),
        }
    }
    async fn lookup_volume(&self, vid: u32) -> Result<Vec<pb::Location>, FilerError> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        if let Some(l) = self.locations.lock().get(&vid) {
            return Ok(l.clone());
        }
        match &self.inner {
            Some(i) => i.lookup_volume(vid).await,
            None => Err(FilerError::Other(format!("volume id {vid} not found"))),
        }
    }
    async fn statistics(
        &self,
        _: pb::StatisticsRequest,
    ) -> Result<pb::StatisticsResponse, FilerError> {
        unsupported()
    }
    async fn configuration(&self) -> Result<pb::GetFilerConfigurationResponse, FilerError> {
        unsupported()
    }
    async fn subscribe_once(
        &self,
        _: pb::SubscribeMetadataRequest,
    ) -> Result<MetadataStream, FilerError> {
        unsupported()
    }
    fn http_address(&self) -> String {
        self.inner
            .as_ref()
            .map(|i| i.http_address())
            .unwrap_or_else(|| "127.0.0.1:1".into())
    }
    fn signature(&self) -> i32 {
        1
    }
}

// ---------------------------------------------------------------------------------------------
// Fake volume server: answers scripted replies in order (the last one repeats) and records
// every request. One request per connection (`Connection: close`).

#[derive(Clone, Debug)]
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

fn reply(status: u16, body: &[u8]) -> Reply {
    Reply {
        status,
        headers: vec![],
        body: body.to_vec(),
    }
}

#[derive(Clone, Debug)]
struct Seen {
    method: String,
    path: String,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

struct FakeVolume {
    addr: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeVolume {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeVolume {
    async fn start(replies: Vec<Reply>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let task = tokio::spawn(async move {
            let mut n = 0usize;
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                let r = replies[n.min(replies.len() - 1)].clone();
                n += 1;
                let Some(req) = read_request(&mut sock).await else {
                    continue;
                };
                seen2.lock().push(req);
                let mut head = format!(
                    "HTTP/1.1 {} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                    r.status,
                    r.body.len()
                );
                for (k, v) in &r.headers {
                    head.push_str(&format!("{k}: {v}\r\n"));
                }
                head.push_str("\r\n");
                let _ = sock.write_all(head.as_bytes()).await;
                let _ = sock.write_all(&r.body).await;
                let _ = sock.shutdown().await;
            }
        });
        FakeVolume { addr, seen, task }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().clone()
    }
}

async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<Seen> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_string();
    let path = first.next()?.to_string();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&tmp[..n]);
    }
    Some(Seen {
        method,
        path,
        headers,
        body,
    })
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

fn client(filer: Arc<dyn FilerApi>, f: impl FnOnce(&mut VolumeClientOptions)) -> VolumeClient {
    let mut o = VolumeClientOptions::default();
    f(&mut o);
    VolumeClient::new(filer, o).expect("volume client")
}

fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

fn text_bytes(n: usize) -> Vec<u8> {
    let line = b"The quick brown fox jumps over the lazy dog; 0123456789.\n";
    line.iter().cycle().take(n).copied().collect()
}

/// Reads `[off, off+len)` of an entry through our chunk model and `store` (ranged fetches).
async fn read_range(
    store: &dyn ChunkStore,
    entry: &pb::Entry,
    off: u64,
    len: u64,
) -> Result<Vec<u8>, VolumeError> {
    let chunks = chunks::expand_manifests(&entry.chunks, store).await?;
    let ivs = chunks::visible_intervals(&chunks);
    let mut out = Vec::new();
    for p in chunks::read_plan(&ivs, off, len, chunks::file_size(entry)) {
        match p {
            ReadPiece::Zero { len, .. } => out.resize(out.len() + len as usize, 0),
            ReadPiece::Chunk {
                chunk_index,
                offset_in_chunk,
                len,
                ..
            } => out.extend_from_slice(
                &store
                    .fetch_range(&chunks[chunk_index], offset_in_chunk, len)
                    .await?,
            ),
        }
    }
    Ok(out)
}

async fn read_all(store: &dyn ChunkStore, entry: &pb::Entry) -> Vec<u8> {
    read_range(store, entry, 0, u64::MAX)
        .await
        .expect("read file")
}

fn file_entry(name: &str, chunks: Vec<pb::FileChunk>, size: u64) -> pb::Entry {
    let now = now_ns() / 1_000_000_000;
    pb::Entry {
        name: name.into(),
        chunks,
        attributes: Some(pb::FuseAttributes {
            file_size: size,
            mtime: now,
            crtime: now,
            file_mode: 0o644,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn create(filer: &Arc<dyn FilerApi>, dir: &str, entry: pb::Entry) {
    filer
        .create_entry(pb::CreateEntryRequest {
            directory: dir.into(),
            entry: Some(entry),
            ..Default::default()
        })
        .await
        .expect("create entry");
}

async fn upload_at(
    store: &VolumeClient,
    data: &[u8],
    offset: i64,
    ts: i64,
    opts: &UploadOptions,
) -> pb::FileChunk {
    let mut c = store
        .upload(Bytes::copy_from_slice(data), opts)
        .await
        .expect("upload");
    c.offset = offset;
    c.modified_ts_ns = ts;
    c
}

fn md5_b64(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(md5::Md5::digest(data))
}

// ---------------------------------------------------------------------------------------------
// Real SeaweedFS.

/// Chunks hashed together in SIMD lanes (src/volume/md5x.rs) each carry their own MD5: the
/// volume server checks `Content-MD5` against the bytes it got and echoes it as the ETag, so a
/// digest given to the wrong chunk fails the upload or the comparison below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_hashed_together_carry_their_own_md5() {
    let w = WeedServer::start();
    let filer = connect_filer(&w).await;
    let store = Arc::new(client(filer.clone(), |_| {}));
    // 11 chunks of different sizes at once: more than one set of lanes, most of them allowed
    // to wait for companions, some not (as a flush would send them)
    let datas: Vec<Vec<u8>> = (0..11u64)
        .map(|i| random_bytes(100 + i, (1 << 20) + i as usize * 4099))
        .collect();
    let tasks: Vec<_> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let store = store.clone();
            let opts = UploadOptions {
                path: format!("/lanes/f{i}"),
                may_wait: (i % 4 != 0).then(seaweedfs_csi_driver::volume::md5x::generation),
                ..Default::default()
            };
            let d = Bytes::from(d.clone());
            tokio::spawn(async move { store.upload(d, &opts).await })
        })
        .collect();
    for (t, d) in tasks.into_iter().zip(&datas) {
        let c = t.await.expect("task").expect("upload accepted");
        assert_eq!(c.e_tag, md5_b64(d), "the server's digest is this chunk's");
        let back = store.fetch_chunk(&c).await.expect("read back");
        assert!(back[..] == d[..], "chunk {} reads back", c.file_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_are_readable_through_filer_and_our_reads() {
    let w = WeedServer::start();
    let filer = connect_filer(&w).await;
    let store = client(filer.clone(), |_| {});
    let opts = UploadOptions {
        path: "/up/mixed.bin".into(),
        ..Default::default()
    };

    let text = text_bytes(300_000);
    let bin = random_bytes(1, 1_000_000);
    let zeros = vec![0u8; 70_000];
    let t = now_ns();
    let c0 = upload_at(&store, &text, 0, t, &opts).await;
    let c1 = upload_at(&store, &bin, text.len() as i64, t + 1, &opts).await;
    let c2 = upload_at(
        &store,
        &zeros,
        (text.len() + bin.len()) as i64,
        t + 2,
        &opts,
    )
    .await;
    assert!(c0.is_compressed, "text is stored gzip'ed");
    assert!(!c1.is_compressed, "random data is not");
    assert!(c2.is_compressed, "large compressible binary is");
    assert_eq!(c0.size, text.len() as u64);
    assert_eq!(c1.e_tag, md5_b64(&bin), "e_tag is the echoed Content-MD5");
    assert!(c0.fid.is_some() && !c0.file_id.is_empty() && c0.cipher_key.is_empty());

    let mut want = text.clone();
    want.extend_from_slice(&bin);
    want.extend_from_slice(&zeros);
    // A hole of 1000 bytes after the last chunk (file_size beyond the chunks).
    let size = want.len() as u64 + 1000;
    want.resize(size as usize, 0);
    create(
        &filer,
        "/up",
        file_entry("mixed.bin", vec![c0.clone(), c1.clone(), c2.clone()], size),
    )
    .await;
    assert_eq!(
        w.filer_get("/up/mixed.bin").expect("filer GET"),
        want,
        "filer HTTP API reads our chunks"
    );

    // Our read path: whole chunks and ranges (ranged requests for the plain chunk, whole
    // fetch + slice for the gzip'ed ones).
    assert_eq!(&store.fetch_chunk(&c0).await.unwrap()[..], &text[..]);
    assert_eq!(&store.fetch_chunk(&c1).await.unwrap()[..], &bin[..]);
    assert_eq!(
        &store.fetch_range(&c1, 12_345, 777).await.unwrap()[..],
        &bin[12_345..13_122]
    );
    assert_eq!(
        &store.fetch_range(&c0, 299_990, 10).await.unwrap()[..],
        &text[299_990..]
    );
    let entry = filer.lookup_entry("/up", "mixed.bin").await.unwrap();
    assert_eq!(read_all(&store, &entry).await, want);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..40 {
        let off = rng.random_range(0..size);
        let len = rng.random_range(0..200_000u64);
        let got = read_range(&store, &entry, off, len).await.unwrap();
        let end = (off + len).min(size) as usize;
        assert_eq!(got, &want[off as usize..end], "range {off}+{len}");
    }

    // A chunk claiming more bytes than its needle holds is corrupt, not a panic or short read.
    let mut liar = c1.clone();
    liar.size += 10;
    assert!(matches!(
        store.fetch_chunk(&liar).await,
        Err(VolumeError::Corrupt { .. })
    ));
    assert!(matches!(
        store.fetch_range(&liar, bin.len() as u64 - 5, 10).await,
        Err(VolumeError::Corrupt { .. })
    ));
    assert!(matches!(
        store.fetch_range(&liar, bin.len() as u64 + 5, 3).await,
        Err(VolumeError::Corrupt { .. })
    ));
    // An unknown needle on a real volume is NotFound; an unknown volume has no location.
    let mut gone = c1.clone();
    gone.file_id = format!("{},ffff00000001", c1.fid.unwrap().volume_id);
    gone.fid = None;
    let t0 = Instant::now();
    assert!(matches!(
        store.fetch_chunk(&gone).await,
        Err(VolumeError::NotFound { .. })
    ));
    assert!(t0.elapsed() < Duration::from_secs(10));
    let bogus = pb::FileChunk {
        file_id: "9999,0100000001".into(),
        size: 1,
        ..Default::default()
    };
    let e = store.fetch_chunk(&bogus).await.unwrap_err();
    assert!(matches!(e, VolumeError::NoLocation(9999)), "{e:?}");

    // publicUrl and filerProxy modes upload and read too.
    for access in [
        VolumeServerAccess::PublicUrl,
        VolumeServerAccess::FilerProxy,
    ] {
        let s = client(filer.clone(), |o| o.access = access);
        let data = random_bytes(9, 50_000);
        let c = s
            .upload(Bytes::from(data.clone()), &opts)
            .await
            .expect("upload");
        assert_eq!(
            &s.fetch_chunk(&c).await.unwrap()[..],
            &data[..],
            "{access:?}"
        );
        assert_eq!(
            &s.fetch_range(&c, 100, 50).await.unwrap()[..],
            &data[100..150],
            "{access:?}"
        );
        let ct = s
            .upload(Bytes::from(text_bytes(5000)), &opts)
            .await
            .unwrap();
        assert!(ct.is_compressed);
        assert_eq!(
            &s.fetch_range(&ct, 10, 20).await.unwrap()[..],
            &text_bytes(5000)[10..30],
            "{access:?}"
        );
    }
    // Location lookups are cached: one per volume id.
    let before = store.locations().lookup_count();
    for _ in 0..5 {
        store.fetch_range(&c1, 0, 10).await.unwrap();
    }
    assert_eq!(store.locations().lookup_count(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_files_the_filer_wrote_and_overwrites_resolve_like_the_filer() {
    let w = WeedServer::start();
    let filer = connect_filer(&w).await;
    let store = client(filer.clone(), |_| {});

    // Small binary.
    let small = random_bytes(2, 3000);
    w.filer_put("/f/small.bin", &small, "");
    let e = filer.lookup_entry("/f", "small.bin").await.unwrap();
    assert_eq!(e.chunks.len(), 1);
    assert_eq!(read_all(&store, &e).await, small);

    // Text: the filer gzips it.
    let text = text_bytes(200_000);
    w.filer_put("/f/t.txt", &text, "");
    let e = filer.lookup_entry("/f", "t.txt").await.unwrap();
    assert!(
        e.chunks.iter().all(|c| c.is_compressed),
        "filer stores text gzip'ed"
    );
    assert_eq!(read_all(&store, &e).await, text);
    assert_eq!(
        read_range(&store, &e, 1234, 5678).await.unwrap(),
        &text[1234..1234 + 5678]
    );

    // Multi-chunk (the filer splits at 4 MiB).
    let big = random_bytes(3, 9 * 1024 * 1024 + 333);
    w.filer_put("/f/multi.bin", &big, "");
    let e = filer.lookup_entry("/f", "multi.bin").await.unwrap();
    assert!(e.chunks.len() >= 3, "{} chunks", e.chunks.len());
    assert_eq!(read_all(&store, &e).await, big);
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for _ in 0..30 {
        let off = rng.random_range(0..big.len() as u64);
        let len = rng.random_range(1..6 * 1024 * 1024u64);
        let got = read_range(&store, &e, off, len).await.unwrap();
        let end = (off + len).min(big.len() as u64) as usize;
        assert_eq!(got, &big[off as usize..end], "range {off}+{len}");
    }

    // Overwrite ranges with newer chunks (one straddling a chunk boundary, one small, one
    // covering the whole last chunk and growing the file), then compact like a writer does.
    let opts = UploadOptions {
        path: "/f/multi.bin".into(),
        ..Default::default()
    };
    let t = now_ns();
    let mut want = big.clone();
    let mut chunks_now = e.chunks.clone();
    let four = 4 * 1024 * 1024usize;
    let edits: Vec<(usize, Vec<u8>)> = vec![
        (four - 512 * 1024, random_bytes(4, 1024 * 1024)),
        (10, b"OVERWRITTEN".to_vec()),
        (2 * four, text_bytes(big.len() - 2 * four + 5000)),
    ];
    for (i, (off, data)) in edits.iter().enumerate() {
        chunks_now.push(upload_at(&store, data, *off as i64, t + i as i64, &opts).await);
        if want.len() < off + data.len() {
            want.resize(off + data.len(), 0);
        }
        want[*off..off + data.len()].copy_from_slice(data);
    }
    let (kept, garbage) = chunks::compact(&chunks_now);
    assert_eq!(
        garbage.len(),
        1,
        "the fully covered last filer chunk is garbage"
    );
    assert_eq!(garbage[0].offset, 2 * four as i64);
    create(
        &filer,
        "/f",
        file_entry("multi.bin", kept, want.len() as u64),
    )
    .await;
    let e2 = filer.lookup_entry("/f", "multi.bin").await.unwrap();
    assert_eq!(read_all(&store, &e2).await, want, "our read path");
    assert_eq!(
        w.filer_get("/f/multi.bin").unwrap(),
        want,
        "filer HTTP API agrees"
    );

    // Truncate to a size inside the first chunk: the filer reads the shrunk chunk list the same.
    let cut = 3 * 1024 * 1024 + 7;
    let (kept, _dropped) = chunks::truncate(&e2.chunks, cut);
    create(&filer, "/f", file_entry("multi.bin", kept, cut)).await;
    assert_eq!(w.filer_get("/f/multi.bin").unwrap(), &want[..cut as usize]);
    let e3 = filer.lookup_entry("/f", "multi.bin").await.unwrap();
    assert_eq!(read_all(&store, &e3).await, &want[..cut as usize]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_file_streams_with_matching_hash() {
    let w = WeedServer::start();
    let filer = connect_filer(&w).await;
    let store = client(filer.clone(), |_| {});

    // 105 MiB + a bit, generated to disk so memory stays at one block.
    let size: u64 = 105 * 1024 * 1024 + 12_345;
    let path = w.path().join("big.bin");
    let mut hasher = Sha256::new();
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let mut rng = rand::rngs::StdRng::seed_from_u64(100);
        let mut left = size;
        let mut block = vec![0u8; 1 << 20];
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            rng.fill_bytes(&mut block[..n]);
            hasher.update(&block[..n]);
            f.write_all(&block[..n]).unwrap();
            left -= n as u64;
        }
    }
    let want_hash = hasher.finalize();
    let out = std::process::Command::new("curl")
        .args(["-sS", "-f", "-F"])
        .arg(format!("file=@{}", path.display()))
        .arg(w.filer_url("/big/big.bin"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "upload: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let e = filer.lookup_entry("/big", "big.bin").await.unwrap();
    assert_eq!(chunks::file_size(&e), size);
    let chunks_list = chunks::expand_manifests(&e.chunks, &store).await.unwrap();
    let ivs = chunks::visible_intervals(&chunks_list);
    let started = Instant::now();
    let mut h = Sha256::new();
    let mut total = 0u64;
    for p in chunks::read_plan(&ivs, 0, size, size) {
        match p {
            ReadPiece::Zero { len, .. } => panic!("unexpected hole of {len} bytes"),
            ReadPiece::Chunk {
                chunk_index,
                offset_in_chunk,
                len,
                ..
            } => {
                let c = &chunks_list[chunk_index];
                let whole = store.fetch_chunk(c).await.unwrap();
                let piece = &whole[offset_in_chunk as usize..(offset_in_chunk + len) as usize];
                h.update(piece);
                total += piece.len() as u64;
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "read {} MiB in {} chunks in {secs:.2}s ({:.0} MiB/s)",
        total >> 20,
        chunks_list.len(),
        (total >> 20) as f64 / secs
    );
    assert_eq!(total, size);
    assert_eq!(h.finalize(), want_hash);

    // Random ranged reads against the file on disk.
    let mut f = std::fs::File::open(&path).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for _ in 0..10 {
        let off = rng.random_range(0..size);
        let len = rng.random_range(1..9 * 1024 * 1024u64).min(size - off);
        let mut want = vec![0u8; len as usize];
        f.seek(SeekFrom::Start(off)).unwrap();
        f.read_exact(&mut want).unwrap();
        assert_eq!(
            read_range(&store, &e, off, len).await.unwrap(),
            want,
            "range {off}+{len}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_chunks_round_trip_and_bad_keys_are_corrupt() {
    let w = WeedServer::start_with(WeedOptions {
        encrypt: true,
        ..Default::default()
    });
    let filer = connect_filer(&w).await;
    assert!(
        filer.configuration().await.unwrap().cipher,
        "filer runs with -encryptVolumeData"
    );
    let store = client(filer.clone(), |_| {});
    let opts = UploadOptions {
        path: "/enc/ours.txt".into(),
        cipher: true,
        ..Default::default()
    };

    let text = text_bytes(100_000);
    let bin = random_bytes(20, 300_000);
    let t = now_ns();
    let c0 = upload_at(&store, &text, 0, t, &opts).await;
    let c1 = upload_at(&store, &bin, text.len() as i64, t + 1, &opts).await;
    assert_eq!(c0.cipher_key.len(), 32);
    assert!(c0.is_compressed, "compress-then-encrypt for text");
    assert!(!c1.is_compressed);
    assert!(c0.e_tag.is_empty(), "no MD5 under cipher");
    let mut want = text.clone();
    want.extend_from_slice(&bin);
    create(
        &filer,
        "/enc",
        file_entry("ours.txt", vec![c0.clone(), c1.clone()], want.len() as u64),
    )
    .await;
    assert_eq!(
        w.filer_get("/enc/ours.txt").unwrap(),
        want,
        "filer decrypts our chunks"
    );
    let e = filer.lookup_entry("/enc", "ours.txt").await.unwrap();
    assert_eq!(read_all(&store, &e).await, want);
    assert_eq!(
        &store.fetch_range(&c1, 1000, 100).await.unwrap()[..],
        &bin[1000..1100]
    );

    // A file the filer encrypted.
    let theirs = random_bytes(21, 5 * 1024 * 1024);
    w.filer_put("/enc/theirs.bin", &theirs, "");
    let e = filer.lookup_entry("/enc", "theirs.bin").await.unwrap();
    assert!(e.chunks.iter().all(|c| c.cipher_key.len() == 32));
    assert_eq!(read_all(&store, &e).await, theirs);
    let their_text = text_bytes(50_000);
    w.filer_put("/enc/theirs.txt", &their_text, "");
    let e = filer.lookup_entry("/enc", "theirs.txt").await.unwrap();
    assert_eq!(read_all(&store, &e).await, their_text);

    // Wrong key / not-encrypted-but-claims-to-be: Corrupt, promptly.
    let mut bad = c1.clone();
    bad.cipher_key = vec![7u8; 32];
    let t0 = Instant::now();
    assert!(matches!(
        store.fetch_chunk(&bad).await,
        Err(VolumeError::Corrupt { .. })
    ));
    assert!(matches!(
        store.fetch_range(&bad, 0, 10).await,
        Err(VolumeError::Corrupt { .. })
    ));
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "corrupt data is not retried for long"
    );
    let mut gz_lie = c1.clone();
    gz_lie.is_compressed = true;
    assert!(matches!(
        store.fetch_chunk(&gz_lie).await,
        Err(VolumeError::Corrupt { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_keys_sign_reads_and_missing_key_is_unauthorized() {
    let sec = "[jwt.signing]\nkey = \"write-secret-123\"\nexpires_after_seconds = 10\n\
               [jwt.signing.read]\nkey = \"read-secret-456\"\nexpires_after_seconds = 30\n";
    let w = WeedServer::start_with(WeedOptions {
        security_toml: Some(sec.into()),
        ..Default::default()
    });
    let filer = connect_filer(&w).await;
    let keyed = client(filer.clone(), |o| {
        o.security = SecurityConfig {
            jwt_read_key: Some("read-secret-456".into()),
            jwt_read_expires_secs: 30,
            ..Default::default()
        }
    });
    let keyless = client(filer.clone(), |_| {});
    let opts = UploadOptions {
        path: "/jwt/a.bin".into(),
        ..Default::default()
    };

    let data = random_bytes(30, 40_000);
    // Uploads carry the write JWT from AssignVolume; works for both.
    let c = keyed
        .upload(Bytes::from(data.clone()), &opts)
        .await
        .expect("upload with write jwt");
    assert_eq!(&keyed.fetch_chunk(&c).await.unwrap()[..], &data[..]);
    assert_eq!(
        &keyed.fetch_range(&c, 5, 10).await.unwrap()[..],
        &data[5..15]
    );
    let e = keyless.fetch_chunk(&c).await.unwrap_err();
    assert!(matches!(e, VolumeError::Unauthorized(_)), "{e:?}");
    assert!(matches!(
        keyless.fetch_range(&c, 0, 4).await,
        Err(VolumeError::Unauthorized(_))
    ));
    // A wrong read key is rejected too.
    let wrong = client(filer.clone(), |o| {
        o.security.jwt_read_key = Some("nope".into())
    });
    assert!(matches!(
        wrong.fetch_chunk(&c).await,
        Err(VolumeError::Unauthorized(_))
    ));
    // Through the filer proxy the filer signs the read itself.
    let proxy = client(filer.clone(), |o| o.access = VolumeServerAccess::FilerProxy);
    assert_eq!(&proxy.fetch_chunk(&c).await.unwrap()[..], &data[..]);
    let c2 = proxy
        .upload(Bytes::from(data.clone()), &opts)
        .await
        .expect("proxied upload forwards write jwt");
    assert_eq!(&keyed.fetch_chunk(&c2).await.unwrap()[..], &data[..]);
    // Created entries read back through the filer as usual.
    create(
        &filer,
        "/jwt",
        file_entry("a.bin", vec![c], data.len() as u64),
    )
    .await;
    assert_eq!(w.filer_get("/jwt/a.bin").unwrap(), data);
}

/// Small files of one directory share an assign: ids are reserved 16 at a time (`fid_n`),
/// the volume server takes the suffixed ids under the assign's write JWT, each chunk is stored
/// with a plain id, and the filer serves every file. A filer.conf rule that ends inside a
/// directory's names (`/rules/tmp-`) makes that directory's files assign one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_of_one_directory_share_an_assign() {
    let sec = "[jwt.signing]\nkey = \"write-secret-123\"\nexpires_after_seconds = 10\n";
    let w = WeedServer::start_with(WeedOptions {
        security_toml: Some(sec.into()),
        ..Default::default()
    });
    let real = connect_filer(&w).await;
    let fake = Arc::new(FakeFiler {
        inner: Some(real.clone()),
        ..Default::default()
    });
    let store = client(fake.clone(), |_| {});
    let mut ids = std::collections::HashSet::new();
    for i in 0..20u64 {
        let data = random_bytes(100 + i, 3000 + i as usize);
        let opts = UploadOptions {
            path: format!("/pool/f{i}"),
            ..Default::default()
        };
        let c = upload_at(&store, &data, 0, now_ns(), &opts).await;
        assert!(!c.file_id.contains('_'), "stored plainly: {}", c.file_id);
        assert!(
            ids.insert(c.file_id.clone()),
            "id {} given twice",
            c.file_id
        );
        let name = format!("f{i}");
        create(
            &real,
            "/pool",
            file_entry(&name, vec![c], data.len() as u64),
        )
        .await;
        assert_eq!(w.filer_get(&format!("/pool/{name}")).unwrap(), data);
    }
    // 2 when the 20 uploads take under 2 s (reserved ids expire then); a slow machine may
    // need a few more, never one per upload
    let n = fake.assigns.load(Ordering::SeqCst);
    assert!(
        (2..=6).contains(&n),
        "20 uploads in one directory: an assign of 16 ids, then another ({n})"
    );

    let conf = br#"{"locations":[{"locationPrefix":"/rules/tmp-","collection":"tmpcol"}]}"#;
    let mut e = file_entry("filer.conf", Vec::new(), conf.len() as u64);
    e.content = conf.to_vec();
    create(&real, "/etc/seaweedfs", e).await;
    let fake = Arc::new(FakeFiler {
        inner: Some(real.clone()),
        ..Default::default()
    });
    let store = client(fake.clone(), |_| {});
    let upload_in = |dir: &'static str, i: u64| {
        let store = &store;
        async move {
            let data = random_bytes(200 + i, 2000);
            let opts = UploadOptions {
                path: format!("{dir}/g{i}"),
                ..Default::default()
            };
            let c = upload_at(store, &data, 0, now_ns(), &opts).await;
            assert_eq!(&store.fetch_chunk(&c).await.unwrap()[..], &data[..]);
        }
    };
    for i in 0..3 {
        upload_in("/rules", i).await;
    }
    assert_eq!(
        fake.assigns.load(Ordering::SeqCst),
        3,
        "every file of the split directory assigns alone"
    );
    for i in 3..5 {
        upload_in("/pool", i).await;
    }
    assert!(
        fake.assigns.load(Ordering::SeqCst) <= 5,
        "the other directory still shares"
    );
    // large chunks assign alone
    let before = fake.assigns.load(Ordering::SeqCst);
    for i in 0..2u64 {
        let data = random_bytes(300 + i, 300 << 10);
        let opts = UploadOptions {
            path: format!("/pool/big{i}"),
            ..Default::default()
        };
        upload_at(&store, &data, 0, now_ns(), &opts).await;
    }
    assert_eq!(fake.assigns.load(Ordering::SeqCst) - before, 2);
    // ...unless their file fsyncs often: its fsyncs wait for them
    let before = fake.assigns.load(Ordering::SeqCst);
    for i in 0..4u64 {
        let data = random_bytes(400 + i, 1 << 20);
        let opts = UploadOptions {
            path: "/synced/log".into(),
            syncs: true,
            ..Default::default()
        };
        let c = upload_at(&store, &data, 0, now_ns(), &opts).await;
        assert_eq!(&store.fetch_chunk(&c).await.unwrap()[..], &data[..]);
    }
    // 1 when the 4 uploads take under 2 s (reserved ids expire then)
    let n = fake.assigns.load(Ordering::SeqCst) - before;
    assert!(
        (1..=2).contains(&n),
        "a syncing file's 4 chunks of 1 MiB share an assign ({n})"
    );
}

/// A digest hashed while the bytes were written is what the upload sends as Content-MD5:
/// the volume server accepts it for the right bytes and refuses the upload when the bytes
/// hashed were others of the same length (so it is not recomputed behind our back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_hashed_while_written_is_the_content_md5() {
    use seaweedfs_csi_driver::volume::md5stream::Stream;
    let w = WeedServer::start();
    let filer = connect_filer(&w).await;
    let store = client(filer.clone(), |o| {
        o.read_retry = std::time::Duration::from_millis(300)
    });
    let data = random_bytes(7, (1 << 20) + 333);
    let stream = |bytes: &[u8]| {
        let s = Stream::new();
        for piece in bytes.chunks(65_536) {
            s.push(piece);
        }
        s
    };
    let opts = UploadOptions {
        path: "/streamed/log".into(),
        md5: Some(stream(&data)),
        syncs: true,
        ..Default::default()
    };
    let c = upload_at(&store, &data, 0, now_ns(), &opts).await;
    assert_eq!(
        c.e_tag,
        md5_b64(&data),
        "the server echoed the streamed digest"
    );
    assert_eq!(&store.fetch_chunk(&c).await.unwrap()[..], &data[..]);

    let other = random_bytes(8, data.len());
    let opts = UploadOptions {
        md5: Some(stream(&other)),
        ..opts
    };
    let r = store.upload(Bytes::from(data.clone()), &opts).await;
    assert!(
        r.is_err(),
        "bytes other than the hashed ones were accepted: {r:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Fault injection (no weed needed).

fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p = l.local_addr().unwrap().port();
    drop(l);
    p
}

#[tokio::test]
async fn dead_volume_server_fails_within_bound() {
    let dead = format!("127.0.0.1:{}", closed_port());
    let filer = FakeFiler::with_locations(vec![(3, vec![loc(&dead, "")])]);
    *filer.assign.lock() = Some(pb::AssignVolumeResponse {
        file_id: "3,0100000001".into(),
        location: Some(loc(&dead, "")),
        count: 1,
        ..Default::default()
    });
    let store = client(filer.clone(), |_| {});
    let chunk = pb::FileChunk {
        file_id: "3,0200000002".into(),
        size: 10,
        ..Default::default()
    };

    let t0 = Instant::now();
    let e = store.fetch_chunk(&chunk).await.unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(e, VolumeError::Read { .. }), "{e:?}");
    assert!(
        took < Duration::from_secs(20),
        "read gave up after {took:?}"
    );
    assert!(
        took >= Duration::from_secs(1),
        "retry rounds happened ({took:?})"
    );
    assert_eq!(
        filer.lookups.load(Ordering::SeqCst),
        2,
        "one lookup, one re-lookup after all replicas failed"
    );

    let t0 = Instant::now();
    let e = store
        .upload(Bytes::from_static(b"data"), &UploadOptions::default())
        .await
        .unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(e, VolumeError::Upload { .. }), "{e:?}");
    assert!(
        took < Duration::from_secs(20),
        "upload gave up after {took:?}"
    );
    assert!(
        filer.assigns.load(Ordering::SeqCst) >= 2,
        "unreachable server => re-assign"
    );
}

#[tokio::test]
async fn upload_retries_same_fid_then_succeeds() {
    let mut ok = reply(
        201,
        br#"{"name":"x","size":5,"eTag":"abcd","contentMd5":"ignored"}"#,
    );
    ok.headers.push(("Content-MD5", md5_b64(b"hello")));
    let vs = FakeVolume::start(vec![reply(500, br#"{"error":"disk hiccup"}"#), ok]).await;
    let filer = Arc::new(FakeFiler::default());
    *filer.assign.lock() = Some(pb::AssignVolumeResponse {
        file_id: "5,0a1b2c3d4e".into(),
        auth: "the.write.jwt".into(),
        location: Some(loc(&vs.addr, "")),
        count: 1,
        ..Default::default()
    });
    let store = client(filer.clone(), |_| {});
    let opts = UploadOptions {
        path: "/x/hello.txt".into(),
        collection: "c1".into(),
        ..Default::default()
    };
    let c = store
        .upload(Bytes::from_static(b"hello"), &opts)
        .await
        .expect("second attempt succeeds");
    assert_eq!(c.file_id, "5,0a1b2c3d4e");
    assert_eq!(
        c.fid,
        Some(pb::FileId {
            volume_id: 5,
            file_key: 0x0a,
            cookie: 0x1b2c3d4e
        })
    );
    assert_eq!(c.size, 5);
    assert_eq!(c.e_tag, md5_b64(b"hello"));
    assert_eq!(
        filer.assigns.load(Ordering::SeqCst),
        1,
        "retried on the same fid, no re-assign"
    );
    let seen = vs.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(s.method, "POST");
        assert_eq!(s.path, "/5,0a1b2c3d4e");
        assert_eq!(
            s.headers.get("authorization").map(String::as_str),
            Some("Bearer the.write.jwt")
        );
        // the bytes as the raw body, described by the request's headers
        assert_eq!(s.body, b"hello");
        assert!(s.headers["content-type"].starts_with("text/plain"));
        assert_eq!(
            s.headers.get("content-disposition").map(String::as_str),
            Some("attachment; filename=\"hello.txt\"")
        );
        assert_eq!(s.headers["content-md5"], md5_b64(b"hello"));
        assert!(
            !s.headers.contains_key("content-encoding"),
            "5 bytes of text do not shrink"
        );
    }
}

#[tokio::test]
async fn upload_client_errors_are_not_retried() {
    let vs = FakeVolume::start(vec![reply(401, br#"{"error":"wrong jwt"}"#)]).await;
    let filer = Arc::new(FakeFiler::default());
    *filer.assign.lock() = Some(pb::AssignVolumeResponse {
        file_id: "5,0a1b2c3d4e".into(),
        location: Some(loc(&vs.addr, "")),
        ..Default::default()
    });
    let store = client(filer.clone(), |_| {});
    let e = store
        .upload(Bytes::from_static(b"x"), &UploadOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(e, VolumeError::Unauthorized(ref m) if m.contains("wrong jwt")),
        "{e:?}"
    );
    assert_eq!(vs.seen().len(), 1);
    assert_eq!(filer.assigns.load(Ordering::SeqCst), 1);

    // An encrypted upload sends no name, mime, encoding or MD5.
    let mut ok = reply(201, br#"{"size":1}"#);
    ok.headers.push(("Content-MD5", String::new()));
    let vs2 = FakeVolume::start(vec![ok]).await;
    *filer.assign.lock() = Some(pb::AssignVolumeResponse {
        file_id: "6,0100000001".into(),
        location: Some(loc(&vs2.addr, "")),
        ..Default::default()
    });
    let data = text_bytes(10_000);
    let c = store
        .upload(
            Bytes::from(data.clone()),
            &UploadOptions {
                cipher: true,
                path: "/a/b.txt".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(c.is_compressed && c.cipher_key.len() == 32 && c.e_tag.is_empty());
    let seen = &vs2.seen()[0];
    let body = seen.body.clone();
    for h in ["content-md5", "content-encoding", "content-disposition"] {
        assert!(!seen.headers.contains_key(h), "{h}: {:?}", seen.headers);
    }
    assert_eq!(seen.headers["content-type"], "application/octet-stream");
    assert!(
        !body.windows(20).any(|w| w == &data[..20]),
        "plaintext must not be on the wire"
    );
}

fn chunk(fid: &str, size: u64) -> pb::FileChunk {
    pb::FileChunk {
        file_id: fid.into(),
        size,
        ..Default::default()
    }
}

#[tokio::test]
async fn read_fails_over_from_404_replica_and_relooks_once() {
    let a = FakeVolume::start(vec![reply(404, b"")]).await;
    let b = FakeVolume::start(vec![reply(200, b"hello")]).await;
    let filer =
        FakeFiler::with_locations(vec![(9, vec![loc(&b.addr, "dc2"), loc(&a.addr, "dc1")])]);
    let store = client(filer.clone(), |o| o.data_center = "dc1".into());
    let c = chunk("9,01deadbeef", 5);
    assert_eq!(&store.fetch_chunk(&c).await.unwrap()[..], b"hello");
    assert_eq!(a.seen().len(), 1, "same data center replica is tried first");
    assert_eq!(b.seen().len(), 1);
    let s = &a.seen()[0];
    assert_eq!(s.path, "/9,01deadbeef?readDeleted=true");
    assert_eq!(
        s.headers.get("accept-encoding").map(String::as_str),
        Some("gzip")
    );

    // Every replica 404: one re-lookup, then NotFound once the retry budget is spent.
    let filer = FakeFiler::with_locations(vec![(9, vec![loc(&a.addr, "")])]);
    let store = client(filer.clone(), |o| {
        o.read_retry = std::time::Duration::from_millis(300)
    });
    let e = store.fetch_chunk(&c).await.unwrap_err();
    assert!(matches!(e, VolumeError::NotFound { .. }), "{e:?}");
    assert_eq!(filer.lookups.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn read_status_handling_and_header_rules() {
    let filer_for = |addr: &str| FakeFiler::with_locations(vec![(4, vec![loc(addr, "")])]);
    let c = chunk("4,0100000001", 10);

    // 503 then success: retried (after the immediate re-lookup, no sleep needed).
    let vs = FakeVolume::start(vec![reply(503, b"busy"), reply(200, b"0123456789")]).await;
    let store = client(filer_for(&vs.addr), |_| {});
    assert_eq!(&store.fetch_chunk(&c).await.unwrap()[..], b"0123456789");
    assert_eq!(vs.seen().len(), 2);

    // 429: not retried.
    let vs = FakeVolume::start(vec![reply(429, b"slow down"), reply(200, b"0123456789")]).await;
    let store = client(filer_for(&vs.addr), |_| {});
    assert!(matches!(
        store.fetch_chunk(&c).await,
        Err(VolumeError::Read { .. })
    ));
    assert_eq!(vs.seen().len(), 1);

    // 401 -> Unauthorized; 400 -> plain failure; neither retried.
    for (status, unauthorized) in [(401u16, true), (400, false)] {
        let vs = FakeVolume::start(vec![reply(status, br#"{"error":"nope"}"#)]).await;
        let store = client(filer_for(&vs.addr), |_| {});
        let e = store.fetch_chunk(&c).await.unwrap_err();
        assert_eq!(
            matches!(e, VolumeError::Unauthorized(_)),
            unauthorized,
            "{e:?}"
        );
        assert_eq!(vs.seen().len(), 1);
    }

    // Ranged reads: Range header and never Accept-Encoding; a 206 body is used as is.
    let vs = FakeVolume::start(vec![reply(206, b"345")]).await;
    let store = client(filer_for(&vs.addr), |o| {
        o.security.jwt_read_key = Some("k".into());
    });
    assert_eq!(&store.fetch_range(&c, 3, 3).await.unwrap()[..], b"345");
    let s = &vs.seen()[0];
    assert_eq!(
        s.headers.get("range").map(String::as_str),
        Some("bytes=3-5")
    );
    assert!(
        !s.headers.contains_key("accept-encoding"),
        "Range must not be combined with Accept-Encoding"
    );
    let auth = s.headers.get("authorization").expect("read jwt");
    assert!(auth.starts_with("Bearer ey"));
    let claims = auth.split('.').nth(1).unwrap();
    use base64::Engine;
    let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(claims)
        .unwrap();
    assert!(String::from_utf8(claims)
        .unwrap()
        .starts_with(r#"{"fid":"4,0100000001""#));

    // A 200 to a Range request carries the whole needle: sliced locally. A short 206 is corrupt.
    let vs = FakeVolume::start(vec![reply(200, b"0123456789"), reply(206, b"3")]).await;
    let store = client(filer_for(&vs.addr), |_| {});
    assert_eq!(&store.fetch_range(&c, 3, 3).await.unwrap()[..], b"345");
    assert!(matches!(
        store.fetch_range(&c, 3, 3).await,
        Err(VolumeError::Corrupt { .. })
    ));

    // Compressed chunks are fetched whole (no Range), inflated per Content-Encoding, sliced.
    let z = seaweedfs_csi_driver::volume::compress::gzip(b"0123456789");
    let mut gz = reply(200, &z);
    gz.headers.push(("Content-Encoding", "gzip".into()));
    let mut bad = reply(200, b"\x1f\x8b\x08garbage");
    bad.headers.push(("Content-Encoding", "gzip".into()));
    let vs = FakeVolume::start(vec![gz, bad]).await;
    let store = client(filer_for(&vs.addr), |_| {});
    let cz = pb::FileChunk {
        is_compressed: true,
        ..c.clone()
    };
    assert_eq!(&store.fetch_range(&cz, 2, 4).await.unwrap()[..], b"2345");
    let s = &vs.seen()[0];
    assert!(!s.headers.contains_key("range"));
    assert_eq!(
        s.headers.get("accept-encoding").map(String::as_str),
        Some("gzip")
    );
    let t0 = Instant::now();
    assert!(matches!(
        store.fetch_chunk(&cz).await,
        Err(VolumeError::Corrupt { .. })
    ));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "corrupt data is not retried"
    );

    // A truncated whole body (shorter than chunk.size) is corrupt.
    let vs = FakeVolume::start(vec![reply(200, b"01234")]).await;
    let store = client(filer_for(&vs.addr), |_| {});
    assert!(matches!(
        store.fetch_chunk(&c).await,
        Err(VolumeError::Corrupt { .. })
    ));

    // Invalid ids fail fast without network.
    assert!(matches!(
        store.fetch_chunk(&chunk("garbage", 1)).await,
        Err(VolumeError::InvalidFileId(_))
    ));
}

#[tokio::test]
async fn concurrent_reads_share_one_lookup() {
    let vs = FakeVolume::start(vec![reply(200, b"0123456789")]).await;
    let filer = FakeFiler::with_locations(vec![(4, vec![loc(&vs.addr, "")])]);
    let store = Arc::new(client(filer.clone(), |_| {}));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            s.fetch_chunk(&chunk(&format!("4,{:02x}00000001", i + 1), 10))
                .await
        }));
    }
    for t in tasks {
        assert_eq!(&t.await.unwrap().unwrap()[..], b"0123456789");
    }
    assert_eq!(filer.lookups.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn https_settings_are_applied() {
    // A CA file that does not exist is a configuration error, not a panic.
    let mut o = VolumeClientOptions::default();
    o.security.https_client_enabled = true;
    o.security.https_ca = Some("/nonexistent/ca.pem".into());
    let r = VolumeClient::new(Arc::new(FakeFiler::default()), o);
    assert!(matches!(r, Err(VolumeError::Config(_))));

    // With HTTPS on, requests go out as TLS: a plain-HTTP server never sees an HTTP request.
    let vs = FakeVolume::start(vec![reply(200, b"0123456789")]).await;
    let filer = FakeFiler::with_locations(vec![(4, vec![loc(&vs.addr, "")])]);
    let store = client(filer, |o| {
        o.security.https_client_enabled = true;
        o.security.https_insecure_skip_verify = true;
        o.read_timeout = Duration::from_secs(1);
        o.read_retry = std::time::Duration::from_millis(300);
    });
    let t0 = Instant::now();
    let e = store
        .fetch_chunk(&chunk("4,0100000001", 10))
        .await
        .unwrap_err();
    assert!(
        matches!(e, VolumeError::Read { .. } | VolumeError::Timeout(_)),
        "{e:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(vs.seen().is_empty(), "no plain HTTP request was sent");
}
