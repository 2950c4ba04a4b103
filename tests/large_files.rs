//! Large files through our mount: past `--manifestBatch` data chunks a commit folds them into
//! SeaweedFS chunk manifests, which `weed mount` and the filer HTTP API must read as we do, and
//! a truncate through a manifest must not bring old bytes back on any of them.
//!
//! `weed mount` folds at 10000 chunks; the hidden `--manifestBatch=8` (with 1 MiB chunks)
//! reaches manifests with a 20 MiB file instead of 10 GiB.

mod common;
mod fuse_support;

use fuse_support::*;
use seaweedfs_csi_driver::chunks;
use seaweedfs_csi_driver::filer::FilerApi;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn assert_reads(what: &str, p: &Path, want: &[u8]) {
    let got = eventually_reads(p, Duration::from_secs(20), |b| b == want);
    assert!(
        got.is_some(),
        "{what}: {} does not read the expected {} bytes (has {:?} bytes)",
        p.display(),
        want.len(),
        fs::read(p).ok().map(|b| b.len())
    );
}

#[test]
fn manifest_files_interoperate_and_truncate_cleanly() {
    let w = shared_server();
    let root = unique_path("manifest");
    let ours = mount_ours(&w, &root, &["--chunkSizeLimitMB=1", "--manifestBatch=8"]);
    let weed = mount_weed(&w, &root);
    let rt = runtime();
    let filer = filer_client(&rt, &w);

    // two commits: 12 chunks (one manifest), then 21 in all (two)
    let data = pseudo_random(8, 20 * MIB + 12345);
    let mut f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(ours.join("big.bin"))
        .unwrap();
    f.write_all(&data[..12 * MIB]).unwrap();
    f.sync_all().unwrap();
    f.write_all(&data[12 * MIB..]).unwrap();
    drop(f);

    let e = rt.block_on(filer.lookup_entry(&root, "big.bin")).unwrap();
    let manifests = e.chunks.iter().filter(|c| c.is_chunk_manifest).count();
    assert_eq!(manifests, 2, "{:?}", e.chunks);
    assert!(e.chunks.len() < 8, "{} chunks listed", e.chunks.len());
    assert_eq!(chunks::file_size(&e), data.len() as u64);

    let http = || w.filer_get(&format!("{root}/big.bin")).unwrap();
    assert!(http() == data, "filer HTTP reads other bytes");
    assert_reads("weed mount", &weed.join("big.bin"), &data);
    assert!(fs::read(ours.join("big.bin")).unwrap() == data);

    // down into the first manifest, mid-chunk, then up again: zeros past the cut everywhere
    let cut = 3 * MIB + 777;
    let f = OpenOptions::new()
        .write(true)
        .open(ours.join("big.bin"))
        .unwrap();
    f.set_len(cut as u64).unwrap();
    f.set_len(data.len() as u64).unwrap();
    drop(f);
    let mut want = data[..cut].to_vec();
    want.resize(data.len(), 0);
    assert!(fs::read(ours.join("big.bin")).unwrap() == want, "our mount");
    assert!(http() == want, "filer HTTP shows old bytes");
    assert_reads("weed mount after truncate", &weed.join("big.bin"), &want);
    // and a fresh mount of ours, which starts from the filer's entry
    drop(ours);
    let again = mount_ours(&w, &root, &["--chunkSizeLimitMB=1"]);
    assert!(
        fs::read(again.join("big.bin")).unwrap() == want,
        "fresh mount"
    );
}
