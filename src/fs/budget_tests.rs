//! Tests of dirty write data under the node's memory budget ([`crate::budget`]).

use super::inode::ROOT_INO;
use super::{Fs, FsConfig};
use crate::budget::MemoryBudget;
use crate::cache::ChunkCache;
use crate::config::MountOptions;
use crate::filer::mock::MockFiler;
use crate::volume::mock::MockChunkStore;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A filesystem with 1 MiB chunks whose dirty data is charged to `budget`.
fn fs_with(budget: &Arc<MemoryBudget>) -> (Arc<Fs>, Arc<MockChunkStore>) {
    fs_with_config(budget, |_| {})
}

/// [`fs_with`], its configuration changed by `tune` first.
fn fs_with_config(
    budget: &Arc<MemoryBudget>,
    tune: impl FnOnce(&mut FsConfig),
) -> (Arc<Fs>, Arc<MockChunkStore>) {
    let mut cfg = FsConfig::from_mount_options(&MountOptions {
        chunk_size_limit_mb: 1,
        ..Default::default()
    });
    cfg.budget = budget.clone();
    cfg.upload_retry = Duration::from_secs(30);
    tune(&mut cfg);
    let store = Arc::new(MockChunkStore::new());
    let fs = Fs::new(
        cfg,
        Arc::new(MockFiler::new()),
        store.clone(),
        ChunkCache::new(0),
    );
    (fs, store)
}

/// The bytes file `i` gets at `off`.
fn pattern(i: usize, off: u64) -> Vec<u8> {
    (0..4096u64)
        .map(|b| (i as u64 * 31 + off / 4096 + b) as u8)
        .collect()
}

/// 40 files, each written 4 KiB at the starts and the ends of 4 chunk-sized slots (so each
/// slot holds its whole chunk), kept open: unbounded, they would hold 160 MiB of dirty slots. Under
/// a 128 MiB budget (32 MiB of dirty data) they never hold much more than that, every
/// write succeeds (writers wait, they do not fail), every byte reaches the filer, and every
/// charge is given back.
#[tokio::test]
async fn many_files_written_at_random_stay_within_the_dirty_budget() {
    let budget = MemoryBudget::new(128 * MIB);
    let limit = budget.dirty_limit();
    let (fs, store) = fs_with(&budget);
    let relief = {
        let fs = fs.clone();
        tokio::spawn(async move { fs.relieve_memory_pressure().await })
    };
    // some of the uploads fail at first: the writers wait through the retries
    store.fail_next_uploads(3);
    let mut files = Vec::new();
    for i in 0..40 {
        let (a, fh) = fs
            .create(ROOT_INO, &format!("f{i}"), 0o644, 0, libc::O_RDWR, 0, 0)
            .await
            .unwrap();
        files.push((a.ino, fh));
    }
    let offsets = [MIB - 4096, 2 * MIB - 4096, 3 * MIB - 4096, 4 * MIB - 4096];
    let mut peak = 0;
    for off in offsets {
        for (i, (ino, fh)) in files.iter().enumerate() {
            for at in [off + 4096 - MIB, off] {
                fs.write(*fh, *ino, at, &pattern(i, at)).await.unwrap();
                peak = peak.max(budget.dirty());
            }
        }
    }
    // one write past the limit can land before the next one waits: a slot at most
    assert!(
        peak <= limit + MIB,
        "dirty data peaked at {} MiB against a {} MiB limit",
        peak >> 20,
        limit >> 20
    );
    assert!(budget.waits.load(Ordering::Relaxed) > 0, "no writer waited");
    for (ino, fh) in &files {
        fs.release(*fh, *ino).await.unwrap();
    }
    relief.abort();
    assert_eq!(budget.dirty(), 0, "charges were not given back");
    for (i, (ino, _)) in files.iter().enumerate() {
        let of = fs.open_inode(*ino, false).await.unwrap();
        let got = fs.read_range(&of, 0, 4 * MIB).await.unwrap();
        assert_eq!(got.len() as u64, 4 * MIB);
        for off in offsets {
            let at = off as usize;
            let start = at + 4096 - MIB as usize;
            assert_eq!(&got[at..at + 4096], &pattern(i, off)[..], "f{i} at {off}");
            assert_eq!(
                &got[start..start + 4096],
                &pattern(i, start as u64)[..],
                "f{i} at {start}"
            );
            assert!(
                got[start + 4096..at].iter().all(|&b| b == 0),
                "f{i} between {start} and {off}"
            );
        }
    }
}

/// Without a budget nothing waits and nothing is charged past what is buffered: a write at
/// the end of a slot holds its own bytes, not zeros for the part of the slot before it.
#[tokio::test]
async fn no_budget_means_no_waiting() {
    let budget = MemoryBudget::new(u64::MAX);
    let (fs, _store) = fs_with(&budget);
    let (a, fh) = fs
        .create(ROOT_INO, "f", 0o644, 0, libc::O_RDWR, 0, 0)
        .await
        .unwrap();
    fs.write(fh, a.ino, MIB - 4096, &[1u8; 4096]).await.unwrap();
    let charged = budget.dirty();
    assert!(
        (4096..MIB / 4).contains(&charged),
        "the slot was charged {charged} bytes for 4 KiB"
    );
    fs.release(fh, a.ino).await.unwrap();
    assert_eq!(budget.dirty(), 0);
    assert_eq!(budget.waits.load(Ordering::Relaxed), 0);
}

/// A kernel (or keeper) that takes the first `take` ids of a prune and fails the rest.
struct PartialPrune {
    take: usize,
    asked: parking_lot::Mutex<Vec<Vec<u64>>>,
}

impl super::Notifier for PartialPrune {
    fn inval_entry(&self, _parent: u64, _name: &str) {}
    fn inval_inode(&self, _ino: u64) {}
    fn inval_attr(&self, _ino: u64) {}
    fn prune(&self, inos: &[u64]) -> usize {
        self.asked.lock().push(inos.to_vec());
        inos.len().min(self.take)
    }
    fn can_prune(&self) -> bool {
        true
    }
}

/// Past its part of the budget the inode table asks for the excess; of a prune that fails
/// part-way only what was sent counts, the rest waits for the pause, and nodes the kernel
/// does not hold (remembered without a lookup) are never asked for.
#[test]
fn a_prune_that_fails_part_way_counts_what_was_sent() {
    let budget = MemoryBudget::new(64 * MIB);
    let (fs, _) = fs_with(&budget);
    let limit = budget.inode_limit() / crate::budget::NODE_BYTES;
    let n = limit + 1000;
    for i in 0..n {
        let kind = super::attr::Kind::File;
        fs.inodes.remember(1000 + i, &format!("/f{i}"), kind, true);
    }
    // known, but held by no lookup of the kernel
    for i in 0..100 {
        fs.inodes.remember(
            900_000 + i,
            &format!("/unheld{i}"),
            super::attr::Kind::File,
            false,
        );
    }
    let nt = Arc::new(PartialPrune {
        take: 128,
        asked: Default::default(),
    });
    fs.set_notifier(nt.clone());
    assert_eq!(fs.prune_nodes(), 128, "what was sent");
    assert_eq!(budget.nodes_pruned.load(Ordering::Relaxed), 128);
    let asked = nt.asked.lock().clone();
    assert_eq!(asked.len(), 1);
    assert!(
        asked[0].len() > 128,
        "the excess was asked for: {}",
        asked[0].len()
    );
    assert!(
        asked[0].iter().all(|ino| *ino < 900_000),
        "a node the kernel does not hold was asked for"
    );
    // a failure pauses the scan
    assert_eq!(fs.prune_nodes(), 0);
    assert_eq!(nt.asked.lock().len(), 1);
}

/// A round that runs after the session left the budget (its blocking task outlives the
/// session's tasks) does not count the session's nodes in again.
#[test]
fn a_session_that_left_the_budget_is_not_counted_again() {
    let budget = MemoryBudget::new(64 * MIB);
    let (fs, _) = fs_with(&budget);
    for i in 0..10 {
        fs.inodes
            .remember(1000 + i, &format!("/f{i}"), super::attr::Kind::File, true);
    }
    fs.prune_nodes();
    assert_eq!(budget.nodes(), 11, "the root and ten files");
    fs.leave_budget();
    assert_eq!(budget.nodes(), 0);
    fs.prune_nodes();
    assert_eq!(budget.nodes(), 0, "counted in again after it left");
}

/// A write that waited for room while this file's uploads failed is refused (EIO), as a
/// write that came after the failure is: the failed runs hold no budget, so nothing else
/// would stop bytes piling up behind data that cannot be placed. What was written stays
/// readable, and an fsync that can upload places all of it.
#[tokio::test]
async fn a_write_that_waited_for_room_while_uploads_failed_is_refused() {
    let budget = MemoryBudget::new(8 * MIB);
    let (fs, store) = fs_with_config(&budget, |cfg| {
        // an upload gives up at its first failure
        cfg.upload_retry = Duration::ZERO;
        // so that partial slots, not sealed ones, fill the budget
        cfg.max_dirty_slots = 64;
    });
    let (a, fh) = fs
        .create(ROOT_INO, "f", 0o644, 0, libc::O_RDWR, 0, 0)
        .await
        .unwrap();
    // slots written short of full, so nothing uploads until the budget is over
    let part = vec![7u8; (MIB - 4096) as usize];
    let mut slots = 0u64;
    while !budget.dirty_over() {
        fs.write(fh, a.ino, slots * MIB, &part).await.unwrap();
        slots += 1;
        assert!(slots < 64, "the dirty budget never filled");
    }
    assert_eq!(store.upload_count(), 0);
    // every upload the coming wait starts fails once
    store.fail_next_uploads(slots as u32);
    let late = fs.write(fh, a.ino, slots * MIB, &part).await;
    let e = late.expect_err("a write after its wait accepted although uploads had failed");
    assert_eq!(e.errno, libc::EIO);
    // nothing written before is lost: readable now, placed by an fsync that can upload
    let back = fs.read(fh, a.ino, 0, part.len() as u32).await.unwrap();
    assert!(back[..] == part[..]);
    // an upload the wait started may fail while the first fsync runs: that fsync reports
    // it, and the next one uploads it again (no more injected failures are left)
    if let Err(e) = fs.fsync(fh, a.ino).await {
        assert_eq!(e.errno, libc::EIO, "{e:?}");
        fs.fsync(fh, a.ino).await.unwrap();
    }
    let e = fs.lookup(ROOT_INO, "f").await.unwrap();
    assert_eq!(e.size, (slots - 1) * MIB + part.len() as u64);
    for k in 0..slots {
        let back = fs
            .read(fh, a.ino, k * MIB, part.len() as u32)
            .await
            .unwrap();
        assert!(back[..] == part[..], "slot {k}");
    }
    assert!(store.upload_count() >= 2 * slots);
    fs.release(fh, a.ino).await.unwrap();
}

/// Runs of one file sealed and then dropped before their upload started hold the node's
/// dirty budget through their in-flight records; a writer of another file waiting for room
/// gets it once the pressure relief reaches that file, not only when someone touches it.
#[tokio::test]
async fn lost_runs_give_their_budget_back_to_writers_of_other_files() {
    let budget = MemoryBudget::new(8 * MIB);
    let (fs, _store) = fs_with(&budget);
    let relief = {
        let fs = fs.clone();
        tokio::spawn(async move { fs.relieve_memory_pressure().await })
    };
    let (a, fha) = fs
        .create(ROOT_INO, "a", 0o644, 0, libc::O_RDWR, 0, 0)
        .await
        .unwrap();
    let of = fs.open_file(a.ino).expect("open");
    let chunk = vec![3u8; MIB as usize];
    let mut k = 0;
    while !budget.dirty_over() {
        // a full chunk, sealed by the write and dropped unstarted
        let lost = of.write(k * MIB, &chunk);
        assert_eq!(lost.len(), 1);
        drop(lost);
        k += 1;
        assert!(k < 64, "the dirty budget never filled");
    }
    let (b, fhb) = fs
        .create(ROOT_INO, "b", 0o644, 0, libc::O_RDWR, 0, 0)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), fs.write(fhb, b.ino, 0, b"b"))
        .await
        .expect("a writer of another file still waits for the lost runs' budget")
        .unwrap();
    // and the lost runs themselves are placed by the next fsync
    fs.fsync(fha, a.ino).await.unwrap();
    let e = fs.lookup(ROOT_INO, "a").await.unwrap();
    assert_eq!(e.size, k * MIB);
    relief.abort();
}
