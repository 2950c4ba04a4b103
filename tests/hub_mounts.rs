//! Volumes staged in one process share one filer connection and ONE metadata subscription
//! (real `weed`, real kernel FUSE): changes reach every volume, nested ones included, the
//! filer lists one subscriber for them, and a filer restart resyncs them all.

mod common;
mod fuse_support;

use common::WeedServer;
use fuse_support::*;
use seaweedfs_csi_driver::config::MountOptions;
use seaweedfs_csi_driver::filer::hub::FilerHub;
use seaweedfs_csi_driver::fuse::session::MountedVolume;
use seaweedfs_csi_driver::pb::filer as pb;
use seaweedfs_csi_driver::security::SecurityConfig;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Detaches a mount left behind by a failed test.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            lazy_unmount(&self.0);
        }
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Polls both listings (from a blocking thread: this runtime serves the mounts).
async fn both_list(dirs: [PathBuf; 2], name: &str, timeout: Duration) -> bool {
    let name = name.to_string();
    tokio::task::spawn_blocking(move || {
        wait_until(timeout, || dirs.iter().all(|d| names(d).contains(&name)))
    })
    .await
    .unwrap()
}

/// Our subscribers on the filer, from its own admin API.
async fn our_subscribers(grpc: &str) -> Vec<pb::MetadataSubscriber> {
    let Ok(mut c) =
        pb::seaweed_filer_client::SeaweedFilerClient::connect(format!("http://{grpc}")).await
    else {
        return Vec::new();
    };
    match c
        .list_metadata_subscribers(pb::ListMetadataSubscribersRequest::default())
        .await
    {
        Ok(r) => r
            .into_inner()
            .subscribers
            .into_iter()
            .filter(|s| s.client_type == "seaweedfs-csi")
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Our subscribers once there is one (up to 10 s: a stage restarts the stream after a
/// short settle, and the filer lists the old one until it notices it closed).
async fn one_subscriber(grpc: &str) -> Vec<pb::MetadataSubscriber> {
    let mut subs = Vec::new();
    for _ in 0..50 {
        subs = our_subscribers(grpc).await;
        if subs.len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    subs
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn volumes_share_one_subscription_and_resync_after_a_filer_restart() {
    // own server: this test restarts its filer
    let mut w = blocking(WeedServer::start).await;
    let grpc = format!("127.0.0.1:{}", w.filer_port + 10000);
    let root = unique_path("hub");
    let (_ta, da) = mount_dir("hub-a");
    let (_tb, db) = mount_dir("hub-b");
    let _ga = Unmount(da.clone());
    let _gb = Unmount(db.clone());
    let opts = |p: String| MountOptions {
        filers: vec![w.filer_addr()],
        filer_path: p,
        // listings stay cached far longer than the test: only events can show changes
        cache_meta_ttl_sec: 3600,
        ..Default::default()
    };
    let sec = SecurityConfig::default();
    let a = MountedVolume::mount(&opts(root.clone()), &sec, &da)
        .await
        .unwrap();
    let d = da.join("sub");
    blocking(move || std::fs::create_dir(d).unwrap()).await;
    // a second volume nested in the first one's filer path
    let b = MountedVolume::mount(&opts(format!("{root}/sub")), &sec, &db)
        .await
        .unwrap();
    let dirs = [da.join("sub"), db.clone()];
    let warm = dirs.clone();
    blocking(move || {
        for d in &warm {
            assert!(names(d).is_empty());
        }
    })
    .await;

    // (a) a file written through the filer HTTP API shows in both volumes' cached listings
    w.filer_put(&format!("{root}/sub/http1"), b"x", "");
    let ok = both_list(dirs.clone(), "http1", Duration::from_secs(15)).await;
    let seen = blocking({
        let d = dirs.clone();
        move || (names(&d[0]), names(&d[1]))
    })
    .await;
    assert!(ok, "http1 in both listings: {seen:?}");
    // each volume sees the other's writes (same filer path, distinct signatures)
    let p = da.join("sub/from-a");
    blocking(move || std::fs::write(p, b"a").unwrap()).await;
    assert!(both_list(dirs.clone(), "from-a", Duration::from_secs(15)).await);
    let p = db.join("from-b");
    blocking(move || std::fs::write(p, b"b").unwrap()).await;
    assert!(both_list(dirs.clone(), "from-b", Duration::from_secs(15)).await);

    // (b) the filer lists ONE subscriber of ours for the two volumes; one shared connection
    let subs = one_subscriber(&grpc).await;
    assert_eq!(subs.len(), 1, "one subscription for two volumes: {subs:?}");
    assert_eq!(
        subs[0].path_prefix,
        format!("{root}/"),
        "nested root covered"
    );
    assert_eq!(FilerHub::global().connections_to(&w.filer_addr()), 1);

    // (c) filer restart (by pid): a file created before our stream is back shows in both
    w = blocking(move || {
        w.stop_filer();
        std::thread::sleep(Duration::from_secs(3));
        w.start_filer();
        w
    })
    .await;
    let before = our_subscribers(&grpc).await.len();
    w.filer_put(&format!("{root}/sub/during-restart"), b"r", "");
    eprintln!("subscribers of ours when the file was created: {before}");
    assert!(
        both_list(dirs.clone(), "during-restart", Duration::from_secs(30)).await,
        "the file created around the restart shows in both listings"
    );
    let after = one_subscriber(&grpc).await;
    assert_eq!(after.len(), 1, "one subscription again: {after:?}");

    // unstaging both closes the stream and the shared connection
    a.unmount().await.unwrap();
    b.unmount().await.unwrap();
    let mut gone = false;
    for _ in 0..50 {
        if our_subscribers(&grpc).await.is_empty()
            && FilerHub::global().connections_to(&w.filer_addr()) == 0
        {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gone, "stream and connection closed with the last volume");
    blocking(move || drop(w)).await;
}

/// Issue 16's fault case at its scale: 50 volumes (HUB_TEST_VOLUMES) of one filer staged in
/// one process, the filer restarted; a file created through the HTTP API before our stream
/// is back shows in every volume's cached listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_one_of_fifty_volumes_resyncs_after_a_filer_restart() {
    let n: usize = std::env::var("HUB_TEST_VOLUMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let mut w = blocking(WeedServer::start).await;
    let grpc = format!("127.0.0.1:{}", w.filer_port + 10000);
    let base = unique_path("hub50");
    let sec = SecurityConfig::default();
    let (mut tmps, mut guards, mut vols, mut dirs) = (vec![], vec![], vec![], vec![]);
    for i in 0..n {
        let (tmp, dir) = mount_dir("hub50");
        guards.push(Unmount(dir.clone()));
        tmps.push(tmp);
        let opts = MountOptions {
            filers: vec![w.filer_addr()],
            filer_path: format!("{base}/v{i}"),
            cache_meta_ttl_sec: 3600, // only events (or a resync) can show changes
            ..Default::default()
        };
        vols.push(MountedVolume::mount(&opts, &sec, &dir).await.unwrap());
        dirs.push(dir);
    }
    let warm = dirs.clone();
    blocking(move || warm.iter().all(|d| names(d).is_empty())).await;
    let subs = one_subscriber(&grpc).await;
    assert_eq!(subs.len(), 1, "{n} volumes, one stream: {subs:?}");

    w = blocking(move || {
        w.stop_filer();
        std::thread::sleep(Duration::from_secs(3));
        w.start_filer();
        w
    })
    .await;
    for i in 0..n {
        w.filer_put(&format!("{base}/v{i}/after-restart"), b"r", "");
    }
    let check = dirs.clone();
    let missing = blocking(move || {
        let missing = || -> Vec<usize> {
            (0..check.len())
                .filter(|&i| !names(&check[i]).contains(&"after-restart".to_string()))
                .collect()
        };
        wait_until(Duration::from_secs(60), || missing().is_empty());
        missing()
    })
    .await;
    assert!(
        missing.is_empty(),
        "volumes that did not resync: {missing:?}"
    );

    for v in vols {
        v.unmount().await.unwrap();
    }
    blocking(move || drop(w)).await;
    drop(tmps);
}
