//! GrpcFiler against a real `weed` 4.48 (master+volume+filer on loopback).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::WeedServer;
use seaweedfs_csi_driver::filer::grpc::{FilerClientOptions, GrpcFiler};
use seaweedfs_csi_driver::filer::{FilerApi, FilerError};
use seaweedfs_csi_driver::pb::filer as pb;

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
