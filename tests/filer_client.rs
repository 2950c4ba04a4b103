//! GrpcFiler against a real `weed` 4.48 (master+volume+filer on loopback).

#[allow(unused_imports)] // the shared harness imports more than this file uses
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::WeedServer;
use futures::StreamExt;
use seaweedfs_csi_driver::filer::grpc::{FilerClientOptions, GrpcFiler};
use seaweedfs_csi_driver::filer::subscribe::{
    spawn_subscription, SubscribeOptions, SubscriptionEvent,
};
use seaweedfs_csi_driver::filer::{FilerApi, FilerError};
use seaweedfs_csi_driver::pb::filer as pb;
use seaweedfs_csi_driver::security::SecurityConfig;
use tokio::sync::mpsc;

const DIR_MODE: u32 = 0x8000_0000 | 0o755; // Go os.ModeDir | perm

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn file_entry(name: &str, content: &[u8]) -> pb::Entry {
    pb::Entry {
        name: name.into(),
        content: content.to_vec(),
        attributes: Some(pb::FuseAttributes {
            file_size: content.len() as u64,
            mtime: now_secs(),
            crtime: now_secs(),
            file_mode: 0o644,
            uid: 1000,
            gid: 1000,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn dir_entry(name: &str) -> pb::Entry {
    pb::Entry {
        name: name.into(),
        is_directory: true,
        attributes: Some(pb::FuseAttributes {
            mtime: now_secs(),
            crtime: now_secs(),
            file_mode: DIR_MODE,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn create(dir: &str, entry: pb::Entry) -> pb::CreateEntryRequest {
    pb::CreateEntryRequest {
        directory: dir.into(),
        entry: Some(entry),
        ..Default::default()
    }
}

async fn client(w: &WeedServer) -> GrpcFiler {
    GrpcFiler::connect(FilerClientOptions {
        addresses: vec![w.filer_addr()],
        call_timeout: Duration::from_secs(20),
        ..Default::default()
    })
    .await
    .unwrap()
}

async fn crud_roundtrip(f: &GrpcFiler) {
    // create (parents auto-created since skip_check_parent_directory=false)
    let ev = f
        .create_entry(create("/crud/sub", file_entry("a.txt", b"hello")))
        .await
        .unwrap();
    let ev = ev.expect("create returns its metadata event");
    let en = ev.event_notification.unwrap();
    assert_eq!(en.new_entry.unwrap().name, "a.txt");
    assert!(
        en.signatures.contains(&f.signature()),
        "our signature is on the event: {:?}",
        en.signatures
    );

    let e = f.lookup_entry("/crud/sub", "a.txt").await.unwrap();
    assert_eq!(e.content, b"hello");
    assert!(!e.is_directory);
    let d = f.lookup_entry("/crud", "sub").await.unwrap();
    assert!(d.is_directory);

    // update
    let mut e2 = e.clone();
    e2.attributes.as_mut().unwrap().file_mode = 0o600;
    e2.extended.insert("user.k".into(), b"v".to_vec());
    f.update_entry(pb::UpdateEntryRequest {
        directory: "/crud/sub".into(),
        entry: Some(e2),
        ..Default::default()
    })
    .await
    .unwrap();
    let e3 = f.lookup_entry("/crud/sub", "a.txt").await.unwrap();
    assert_eq!(e3.attributes.unwrap().file_mode, 0o600);
    assert_eq!(
        e3.extended.get("user.k").map(|v| v.as_slice()),
        Some(&b"v"[..])
    );

    // update of a missing entry is NotFound
    let err = f
        .update_entry(pb::UpdateEntryRequest {
            directory: "/crud/sub".into(),
            entry: Some(file_entry("missing", b"")),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(matches!(err, FilerError::NotFound(_)), "{err:?}");

    // list
    let names: Vec<String> = f
        .list_all("/crud/sub")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["a.txt"]);
    assert!(f.list_all("/does/not/exist").await.unwrap().is_empty());

    // o_excl
    let mut req = create("/crud/sub", file_entry("a.txt", b"again"));
    req.o_excl = true;
    let err = f.create_entry(req).await.unwrap_err();
    assert!(matches!(err, FilerError::AlreadyExists(_)), "{err:?}");

    // non-empty rmdir
    let err = f
        .delete_entry(pb::DeleteEntryRequest {
            directory: "/crud".into(),
            name: "sub".into(),
            is_delete_data: true,
            is_recursive: false,
            ignore_recursive_error: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(matches!(err, FilerError::NotEmpty(_)), "{err:?}");

    // delete file, then NotFound; deleting again succeeds
    let del = pb::DeleteEntryRequest {
        directory: "/crud/sub".into(),
        name: "a.txt".into(),
        is_delete_data: true,
        ..Default::default()
    };
    let ev = f
        .delete_entry(del.clone())
        .await
        .unwrap()
        .expect("delete event");
    assert_eq!(
        ev.event_notification.unwrap().old_entry.unwrap().name,
        "a.txt"
    );
    let err = f.lookup_entry("/crud/sub", "a.txt").await.unwrap_err();
    assert!(matches!(err, FilerError::NotFound(_)), "{err:?}");
    assert_eq!(err.errno(), libc::ENOENT);
    f.delete_entry(del).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crud_over_stream_and_unary() {
    let w = WeedServer::start();
    let f = client(&w).await;
    crud_roundtrip(&f).await;
    let c = f.mutation_counts();
    assert!(
        c.stream >= 6,
        "mutations went over StreamMutateEntry: {c:?}"
    );
    assert_eq!(c.unary, 0, "{c:?}");

    let u = client(&w).await;
    u.set_stream_mutate(false);
    crud_roundtrip(&u).await;
    let c = u.mutation_counts();
    assert_eq!(c.stream, 0, "{c:?}");
    assert!(c.unary >= 6, "{c:?}");
}

/// A chunk with a well-formed id that no volume holds (the filer only compares ids here).
fn fake_chunk(key: u8, offset: i64) -> pb::FileChunk {
    pb::FileChunk {
        file_id: format!("1,{key:02x}01020304"),
        offset,
        size: 4,
        modified_ts_ns: 1_000 + key as i64,
        ..Default::default()
    }
}

fn same_chunks(fids: &[&pb::FileChunk]) -> pb::WriteCondition {
    pb::WriteCondition {
        clauses: vec![pb::write_condition::Clause {
            kind: pb::write_condition::Kind::IfChunksEqual as i32,
            fids: fids.iter().map(|c| c.file_id.clone()).collect(),
        }],
    }
}

async fn fids_at(f: &GrpcFiler, dir: &str, name: &str) -> Vec<String> {
    let mut v: Vec<String> = f
        .lookup_entry(dir, name)
        .await
        .unwrap()
        .chunks
        .iter()
        .map(|c| seaweedfs_csi_driver::volume::fid::chunk_file_id(c).unwrap())
        .collect();
    v.sort();
    v
}

/// The filer (4.41+) stores a create or update only if the entry still lists the chunks a
/// `IF_CHUNKS_EQUAL` condition names (or, `IF_EXISTS`, only over an entry it has), else
/// nothing changes and the client sees `FilerError::Changed`: what makes a metadata change
/// safe against a commit elsewhere between its lookup and its update, and a commit safe
/// against a removal elsewhere. Over the stream and over unary calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_with_a_chunk_condition_store_only_onto_those_chunks() {
    let w = WeedServer::start();
    for stream in [true, false] {
        let f = client(&w).await;
        f.set_stream_mutate(stream);
        let dir = format!("/cond-{stream}");
        f.create_entry(create("/", dir_entry(&dir[1..])))
            .await
            .unwrap();
        let (a, b, c, x) = (
            fake_chunk(0xa1, 0),
            fake_chunk(0xb2, 4),
            fake_chunk(0xc3, 0),
            fake_chunk(0xee, 0),
        );
        let mut e = file_entry("f", b"");
        e.attributes.as_mut().unwrap().file_size = 4;
        e.chunks = vec![a.clone()];
        f.create_entry(create(&dir, e.clone())).await.unwrap();

        let mut grown = e.clone();
        grown.chunks = vec![a.clone(), b.clone()];
        grown.attributes.as_mut().unwrap().file_size = 8;
        let stale = f
            .update_entry(pb::UpdateEntryRequest {
                directory: dir.clone(),
                entry: Some(grown.clone()),
                condition: Some(same_chunks(&[&x])),
                ..Default::default()
            })
            .await;
        assert!(
            matches!(stale, Err(FilerError::Changed(_))),
            "stream {stream}: an update on stale chunks: {stale:?}"
        );
        assert_eq!(fids_at(&f, &dir, "f").await, vec![a.file_id.clone()]);
        f.update_entry(pb::UpdateEntryRequest {
            directory: dir.clone(),
            entry: Some(grown),
            condition: Some(same_chunks(&[&a])),
            ..Default::default()
        })
        .await
        .unwrap();
        let both = vec![a.file_id.clone(), b.file_id.clone()];
        assert_eq!(fids_at(&f, &dir, "f").await, both);

        let mut other = e.clone();
        other.chunks = vec![c.clone()];
        let mut req = create(&dir, other);
        req.condition = Some(same_chunks(&[&a]));
        let stale = f.create_entry(req.clone()).await;
        assert!(
            matches!(stale, Err(FilerError::Changed(_))),
            "stream {stream}: a create over stale chunks: {stale:?}"
        );
        assert_eq!(fids_at(&f, &dir, "f").await, both);
        // ids compare as a set, in any order
        req.condition = Some(same_chunks(&[&b, &a]));
        f.create_entry(req).await.unwrap();
        assert_eq!(fids_at(&f, &dir, "f").await, vec![c.file_id.clone()]);

        // a commit stored only over an entry the filer still has
        let exists = pb::WriteCondition {
            clauses: vec![pb::write_condition::Clause {
                kind: pb::write_condition::Kind::IfExists as i32,
                fids: Vec::new(),
            }],
        };
        let mut req = create(&dir, file_entry("gone", b"x"));
        req.condition = Some(exists.clone());
        let r = f.create_entry(req).await;
        assert!(
            matches!(r, Err(FilerError::Changed(_))),
            "stream {stream}: a create over no entry: {r:?}"
        );
        assert!(matches!(
            f.lookup_entry(&dir, "gone").await,
            Err(FilerError::NotFound(_))
        ));
        let mut req = create(&dir, file_entry("f", b"y"));
        req.condition = Some(exists);
        f.create_entry(req).await.unwrap();
        assert_eq!(f.lookup_entry(&dir, "f").await.unwrap().content, b"y");
    }
}

/// A hard link group's shared record on a real filer: read by its id, it carries the
/// group's link count, one less at each removed name, and is gone with the last name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_groups_record_counts_its_names_and_goes_with_the_last() {
    let w = WeedServer::start();
    let f = client(&w).await;
    f.create_entry(create("/", dir_entry("links")))
        .await
        .unwrap();
    let id: Vec<u8> = (1..=16).chain([1]).collect();
    for name in ["a", "b"] {
        let mut e = file_entry(name, b"shared");
        e.hard_link_id = id.clone();
        e.hard_link_counter = 2;
        f.create_entry(create("/links", e)).await.unwrap();
    }
    let count = |r: Option<pb::Entry>| r.map(|e| (e.hard_link_counter, e.content));
    assert_eq!(
        count(f.link_group(&id).await.unwrap()),
        Some((2, b"shared".to_vec()))
    );
    let remove = |name: &'static str| {
        f.delete_entry(pb::DeleteEntryRequest {
            directory: "/links".into(),
            name: name.into(),
            is_delete_data: true,
            ..Default::default()
        })
    };
    remove("a").await.unwrap();
    assert_eq!(
        count(f.link_group(&id).await.unwrap()),
        Some((1, b"shared".to_vec()))
    );
    remove("b").await.unwrap();
    assert_eq!(count(f.link_group(&id).await.unwrap()), None);
    assert_eq!(count(f.link_group(b"no such group").await.unwrap()), None);
}

async fn client_at(addresses: Vec<String>, security: SecurityConfig) -> GrpcFiler {
    GrpcFiler::connect(FilerClientOptions {
        addresses,
        security,
        call_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(3),
    })
    .await
    .unwrap()
}

fn rename_req(od: &str, on: &str, nd: &str, nn: &str) -> pb::StreamRenameEntryRequest {
    pb::StreamRenameEntryRequest {
        old_directory: od.into(),
        old_name: on.into(),
        new_directory: nd.into(),
        new_name: nn.into(),
        signatures: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn type_conflicts_and_name_limits() {
    let w = WeedServer::start();
    for stream in [true, false] {
        let f = client(&w).await;
        f.set_stream_mutate(stream);
        let d = format!("/conf{stream}");
        f.create_entry(create(&d, file_entry("file", b"x")))
            .await
            .unwrap();
        f.create_entry(create(&d, dir_entry("dir"))).await.unwrap();
        // a file over a directory and a directory over a file are refused
        let e = f
            .create_entry(create(&d, file_entry("dir", b"")))
            .await
            .unwrap_err();
        assert!(
            matches!(e, FilerError::IsADirectory(_)),
            "stream={stream}: {e:?}"
        );
        let e = f
            .create_entry(create(&d, dir_entry("file")))
            .await
            .unwrap_err();
        assert!(
            matches!(e, FilerError::AlreadyExists(_)),
            "stream={stream}: {e:?}"
        );
        // gotcha mirrored by the mock: the filer accepts a child under a regular file and turns
        // that file into a directory (content kept), so callers must check parents themselves
        f.create_entry(create(&d, file_entry("file2", b"x")))
            .await
            .unwrap();
        f.create_entry(create(&format!("{d}/file2"), file_entry("child", b"")))
            .await
            .unwrap();
        let p = f.lookup_entry(&d, "file2").await.unwrap();
        assert!(p.is_directory, "stream={stream}: {p:?}");
        assert_eq!(p.attributes.as_ref().unwrap().file_mode, DIR_MODE);
        // names over 255 bytes
        let e = f
            .create_entry(create(&d, file_entry(&"n".repeat(300), b"")))
            .await
            .unwrap_err();
        assert!(
            matches!(e, FilerError::NameTooLong(_)),
            "stream={stream}: {e:?}"
        );
        // the upsert keeps crtime and inode
        let before = f
            .lookup_entry(&d, "file")
            .await
            .unwrap()
            .attributes
            .unwrap();
        let mut again = file_entry("file", b"yy");
        again.attributes.as_mut().unwrap().crtime = 12345;
        f.create_entry(create(&d, again)).await.unwrap();
        let after = f
            .lookup_entry(&d, "file")
            .await
            .unwrap()
            .attributes
            .unwrap();
        assert_eq!(
            (after.crtime, after.inode, after.file_size),
            (before.crtime, before.inode, 2)
        );
        assert_ne!(after.inode, 0, "filer assigns inodes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_2500_entries_paged() {
    let w = WeedServer::start();
    let f = client(&w).await;
    f.create_entry(create("/", dir_entry("big"))).await.unwrap();
    let t0 = Instant::now();
    let results: Vec<_> = futures::stream::iter(0..2500)
        .map(|i| {
            let f = f.clone();
            async move {
                f.create_entry(create("/big", file_entry(&format!("f{i:05}"), b"")))
                    .await
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert!(
        results.iter().all(|r| r.is_ok()),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    eprintln!("2500 creates over one mutation stream: {:?}", t0.elapsed());
    assert!(
        f.mutation_counts().stream >= 2500,
        "{:?}",
        f.mutation_counts()
    );

    let t0 = Instant::now();
    let all = f.list_all("/big").await.unwrap();
    eprintln!("list_all of 2500: {:?}", t0.elapsed());
    let names: Vec<String> = all.iter().map(|e| e.name.clone()).collect();
    let expect: Vec<String> = (0..2500).map(|i| format!("f{i:05}")).collect();
    assert_eq!(names, expect);

    // manual paging: exclusive and inclusive start
    let p1 = f.list_page("/big", "", false, 1000).await.unwrap();
    let p2 = f
        .list_page("/big", &p1[999].name, false, 1000)
        .await
        .unwrap();
    let p3 = f
        .list_page("/big", &p2[999].name, false, 1000)
        .await
        .unwrap();
    assert_eq!((p1.len(), p2.len(), p3.len()), (1000, 1000, 500));
    assert_eq!(p2[0].name, "f01000");
    assert_eq!(p3.last().unwrap().name, "f02499");
    let inc = f.list_page("/big", "f01000", true, 2).await.unwrap();
    assert_eq!(
        inc.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
        ["f01000", "f01001"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rename_file_and_directory() {
    let w = WeedServer::start();
    for stream in [true, false] {
        let f = client(&w).await;
        f.set_stream_mutate(stream);
        let d = format!("/rn{stream}");
        f.create_entry(create(&d, file_entry("f", b"1")))
            .await
            .unwrap();
        let ino = f
            .lookup_entry(&d, "f")
            .await
            .unwrap()
            .attributes
            .unwrap()
            .inode;
        let evs = f.rename_entry(rename_req(&d, "f", &d, "g")).await.unwrap();
        assert!(!evs.is_empty(), "rename returns events");
        let n = evs[0].event_notification.as_ref().unwrap();
        assert_eq!(n.new_entry.as_ref().unwrap().name, "g");
        assert_eq!(n.new_parent_path, d);
        assert!(f.lookup_entry(&d, "f").await.unwrap_err().is_not_found());
        let g = f.lookup_entry(&d, "g").await.unwrap();
        assert_eq!(g.content, b"1");
        assert_eq!(g.attributes.unwrap().inode, ino, "inode follows the rename");

        // a directory with children
        for c in ["a", "b", "c"] {
            f.create_entry(create(&format!("{d}/src/sub"), file_entry(c, c.as_bytes())))
                .await
                .unwrap();
        }
        f.create_entry(create(&d, dir_entry("dst"))).await.unwrap();
        let evs = f
            .rename_entry(rename_req(&d, "src", &format!("{d}/dst"), "moved"))
            .await
            .unwrap();
        let moved: Vec<String> = evs
            .iter()
            .filter_map(|e| {
                e.event_notification
                    .as_ref()?
                    .new_entry
                    .as_ref()
                    .map(|x| x.name.clone())
            })
            .collect();
        for n in ["moved", "sub", "a", "b", "c"] {
            assert!(
                moved.contains(&n.to_string()),
                "stream={stream} events {moved:?} lack {n}"
            );
        }
        assert_eq!(
            f.lookup_entry(&format!("{d}/dst/moved/sub"), "b")
                .await
                .unwrap()
                .content,
            b"b"
        );
        assert!(f.lookup_entry(&d, "src").await.unwrap_err().is_not_found());
        assert!(f
            .list_all(&format!("{d}/src/sub"))
            .await
            .unwrap()
            .is_empty());

        // errors
        let e = f
            .rename_entry(rename_req(&d, "nope", &d, "x"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, FilerError::NotFound(_)),
            "stream={stream}: {e:?}"
        );
        f.create_entry(create(&format!("{d}/full"), file_entry("x", b"")))
            .await
            .unwrap();
        f.create_entry(create(&d, dir_entry("empty")))
            .await
            .unwrap();
        let e = f
            .rename_entry(rename_req(&d, "empty", &d, "full"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, FilerError::NotEmpty(_)),
            "stream={stream}: {e:?}"
        );
        let c = f.mutation_counts();
        if stream {
            assert_eq!(c.unary, 0, "{c:?}");
        } else {
            assert_eq!(c.stream, 0, "{c:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_statistics_configuration() {
    let w = WeedServer::start();
    let f = client(&w).await;
    let a = f
        .assign_volume(pb::AssignVolumeRequest {
            count: 1,
            path: "/v/x".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let (vid, rest) = a.file_id.split_once(',').expect("fid vid,keycookie");
    assert!(!rest.is_empty());
    let vid: u32 = vid.parse().unwrap();
    let loc = a.location.clone().expect("assign location");
    assert_eq!(loc.url, format!("127.0.0.1:{}", w.volume_port));
    let locs = f.lookup_volume(vid).await.unwrap();
    assert!(locs.iter().any(|l| l.url == loc.url), "{locs:?}");
    assert_eq!(locs[0].grpc_port as u32, w.volume_port as u32 + 10000);
    let e = f.lookup_volume(987_654).await.unwrap_err();
    assert!(matches!(e, FilerError::NotFound(_)), "{e:?}");

    let s = f
        .statistics(pb::StatisticsRequest::default())
        .await
        .unwrap();
    assert!(s.total_size > 0, "{s:?}");
    let c = f.configuration().await.unwrap();
    assert!(c.version.contains("4.48"), "{c:?}");
    // its version numbers tell that it checks a commit's chunk list (IF_CHUNKS_EQUAL)
    assert_eq!(
        seaweedfs_csi_driver::fs::ChunkCondition::of_version(c.major_version, c.minor_version),
        seaweedfs_csi_driver::fs::ChunkCondition::Checked,
        "{c:?}"
    );
    assert_ne!(c.signature, 0);
    assert_eq!(c.masters, vec![w.master_addr()]);
    assert_eq!(f.http_address(), w.filer_addr());
}

async fn next_event(
    rx: &mut mpsc::Receiver<SubscriptionEvent>,
    within: Duration,
) -> SubscriptionEvent {
    tokio::time::timeout(within, rx.recv())
        .await
        .expect("subscription event in time")
        .expect("subscription alive")
}

fn event_name(ev: &SubscriptionEvent) -> Option<String> {
    match ev {
        SubscriptionEvent::Event(e) => {
            let n = e.event_notification.as_ref()?;
            n.new_entry
                .as_ref()
                .or(n.old_entry.as_ref())
                .map(|x| x.name.clone())
        }
        SubscriptionEvent::Resync | SubscriptionEvent::Recheck(_) => None,
    }
}

/// Collects events until one names `name`; returns everything seen on the way.
async fn until_named(
    rx: &mut mpsc::Receiver<SubscriptionEvent>,
    name: &str,
) -> Vec<SubscriptionEvent> {
    let mut seen = Vec::new();
    loop {
        let ev = next_event(rx, Duration::from_secs(30)).await;
        let hit = event_name(&ev).as_deref() == Some(name);
        seen.push(ev);
        if hit {
            return seen;
        }
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_sees_foreign_not_own_changes() {
    let w = WeedServer::start();
    let f = Arc::new(client(&w).await);
    let opts = SubscribeOptions {
        client_name: "test".into(),
        path_prefix: "/sub/".into(),
        extra_prefixes: vec![],
        since_ns: now_ns(),
    };
    let (mut rx, handle) = spawn_subscription(f.clone(), opts);
    f.create_entry(create("/sub", file_entry("own1.txt", b"mine")))
        .await
        .unwrap();
    f.rename_entry(rename_req("/sub", "own1.txt", "/sub", "own2.txt"))
        .await
        .unwrap();
    let w2 = &w;
    tokio::task::block_in_place(|| w2.filer_put("/sub/foreign.txt", b"theirs", ""));
    let seen = until_named(&mut rx, "foreign.txt").await;
    let names: Vec<_> = seen.iter().filter_map(event_name).collect();
    assert!(
        !names.iter().any(|n| n.starts_with("own")),
        "own events leaked: {names:?}"
    );
    assert!(!seen.iter().any(|e| matches!(e, SubscriptionEvent::Resync)));
    // nothing outside the prefix
    tokio::task::block_in_place(|| w2.filer_put("/other/x.txt", b"x", ""));
    f.delete_entry(pb::DeleteEntryRequest {
        directory: "/sub".into(),
        name: "own2.txt".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    tokio::task::block_in_place(|| w2.filer_put("/sub/foreign2.txt", b"theirs", ""));
    let seen = until_named(&mut rx, "foreign2.txt").await;
    let names: Vec<_> = seen.iter().filter_map(event_name).collect();
    assert_eq!(
        names,
        ["foreign2.txt"],
        "only the foreign change under the prefix"
    );
    drop(rx);
    tokio::time::timeout(Duration::from_secs(5), handle)
        .await
        .expect("task ends when receiver dropped")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_survives_filer_restart() {
    let mut w = WeedServer::start();
    let f = Arc::new(client(&w).await);
    let opts = SubscribeOptions {
        client_name: "test".into(),
        path_prefix: "/rs/".into(),
        since_ns: now_ns(),
        ..Default::default()
    };
    let (mut rx, _handle) = spawn_subscription(f.clone(), opts);
    tokio::task::block_in_place(|| w.filer_put("/rs/before.txt", b"1", ""));
    until_named(&mut rx, "before.txt").await;

    tokio::task::block_in_place(|| {
        w.stop_filer();
        w.start_filer();
    });
    let t0 = Instant::now();
    // our own mutations work again (the broken mutation stream falls back / reopens)
    f.create_entry(create("/rs", file_entry("own-after.txt", b"x")))
        .await
        .unwrap();
    tokio::task::block_in_place(|| w.filer_put("/rs/after.txt", b"2", ""));
    let seen = until_named(&mut rx, "after.txt").await;
    eprintln!(
        "event after filer restart arrived {:?} after restart",
        t0.elapsed()
    );
    assert!(
        seen.iter().any(|e| matches!(e, SubscriptionEvent::Resync)),
        "Resync after reconnect"
    );
    let resync_pos = seen
        .iter()
        .position(|e| matches!(e, SubscriptionEvent::Resync))
        .unwrap();
    let after_pos = seen
        .iter()
        .position(|e| event_name(e).as_deref() == Some("after.txt"))
        .unwrap();
    assert!(resync_pos < after_pos);
    assert!(!seen
        .iter()
        .filter_map(event_name)
        .any(|n| n == "own-after.txt"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_filer_is_unavailable_quickly() {
    let dead = format!("127.0.0.1:{}", common::free_port_pair());
    let f = client_at(vec![dead], SecurityConfig::default()).await;
    let t0 = Instant::now();
    let e = f.lookup_entry("/", "x").await.unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(e, FilerError::Unavailable(_)), "{e:?}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let e = f
        .create_entry(create("/", file_entry("x", b"")))
        .await
        .unwrap_err();
    assert!(matches!(e, FilerError::Unavailable(_)), "{e:?}");
    let e = f
        .subscribe_once(pb::SubscribeMetadataRequest {
            client_id: 1,
            ..Default::default()
        })
        .await;
    assert!(matches!(e, Err(FilerError::Unavailable(_))));
    eprintln!(
        "unreachable filer: Unavailable after {took:?}; whole test {:?}",
        t0.elapsed()
    );
    assert!(t0.elapsed() < Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_from_dead_to_live_filer() {
    let w = WeedServer::start();
    let dead = format!("127.0.0.1:{}", common::free_port_pair());
    let f = client_at(
        vec![dead.clone(), w.filer_addr()],
        SecurityConfig::default(),
    )
    .await;
    assert_eq!(f.http_address(), dead);
    f.create_entry(create("/fo", file_entry("x", b"ok")))
        .await
        .unwrap();
    assert_eq!(f.http_address(), w.filer_addr(), "moved to the live filer");
    assert_eq!(f.lookup_entry("/fo", "x").await.unwrap().content, b"ok");
    // one comma-separated string works the same
    let g = client_at(
        vec![format!("{dead},{}", w.filer_addr())],
        SecurityConfig::default(),
    )
    .await;
    assert_eq!(g.lookup_entry("/fo", "x").await.unwrap().content, b"ok");
}

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }
}

/// A CA, one server cert (used by master, volume and filer) whose only name is
/// `filer.invalid` (so a host name check against 127.0.0.1 would fail), one client cert, and a
/// second unrelated CA.
fn make_pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    let dir = tempfile::Builder::new().prefix("pki").tempdir().unwrap();
    let write = |name: &str, data: String| std::fs::write(dir.path().join(name), data).unwrap();
    let mk_ca = |cn: &str| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let cert = p.self_signed(&key).unwrap();
        (cert, key)
    };
    let (ca, ca_key) = mk_ca("test ca");
    write("ca.crt", ca.pem());
    let (other_ca, _) = mk_ca("other ca");
    write("other-ca.crt", other_ca.pem());
    for (name, sans) in [
        ("server", vec!["filer.invalid".to_string()]),
        ("client", vec!["client".to_string()]),
    ] {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(sans).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
        write(&format!("{name}.crt"), cert.pem());
        write(&format!("{name}.key"), key.serialize_pem());
    }
    Pki { dir }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls() {
    let pki = make_pki();
    let p = |n: &str| pki.path(n).display().to_string();
    let mut toml = format!("[grpc]\nca = \"{}\"\n", p("ca.crt"));
    for section in ["master", "volume", "filer"] {
        toml += &format!(
            "[grpc.{section}]\ncert = \"{}\"\nkey = \"{}\"\n",
            p("server.crt"),
            p("server.key")
        );
    }
    toml += &format!(
        "[grpc.client]\ncert = \"{}\"\nkey = \"{}\"\n",
        p("client.crt"),
        p("client.key")
    );
    let w = WeedServer::start_with(common::WeedOptions {
        security_toml: Some(toml.clone()),
        ..Default::default()
    });

    // Our own reader of the same file yields a working mTLS client.
    let sec = SecurityConfig::from_toml_str(&toml).unwrap();
    assert!(sec.grpc_tls_enabled());
    let f = client_at(vec![w.filer_addr()], sec.clone()).await;
    f.create_entry(create("/tls", file_entry("x", b"secret")))
        .await
        .unwrap();
    assert_eq!(
        f.lookup_entry("/tls", "x").await.unwrap().content,
        b"secret"
    );
    assert!(f.configuration().await.unwrap().version.contains("4.48"));
    assert_eq!(
        f.mutation_counts().stream,
        1,
        "mutation stream works over TLS"
    );

    // Plaintext against the mTLS filer fails cleanly and in bounded time.
    let t0 = Instant::now();
    let plain = client_at(vec![w.filer_addr()], SecurityConfig::default()).await;
    let e = plain.lookup_entry("/tls", "x").await.unwrap_err();
    assert!(matches!(e, FilerError::Unavailable(_)), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(15));

    // A client trusting a different CA refuses the server certificate.
    let wrong = SecurityConfig {
        grpc_ca: Some(pki.path("other-ca.crt")),
        ..sec.clone()
    };
    let e = client_at(vec![w.filer_addr()], wrong)
        .await
        .lookup_entry("/tls", "x")
        .await
        .unwrap_err();
    assert!(matches!(e, FilerError::Unavailable(_)), "{e:?}");

    // Without a client certificate the filer refuses us (only the CA configured = plaintext).
    let no_client = SecurityConfig {
        grpc_client_cert: None,
        grpc_client_key: None,
        ..sec
    };
    assert!(!no_client.grpc_tls_enabled());
    let e = client_at(vec![w.filer_addr()], no_client)
        .await
        .lookup_entry("/tls", "x")
        .await
        .unwrap_err();
    assert!(matches!(e, FilerError::Unavailable(_)), "{e:?}");
}
