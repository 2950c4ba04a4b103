//! Chunk model: which chunk is visible at each byte, read plans, truncation, compaction and
//! chunk manifests.
//!
//! A file is `Entry.chunks` (plus `attributes.file_size`). Chunks may overlap; at every byte the
//! chunk with the largest `modified_ts_ns` wins. Ties are resolved by list order: the chunk
//! later in the list wins (SeaweedFS's own tie behaviour is ill-defined; writers give distinct
//! timestamps). Bytes no chunk covers, up to the file size, read as zeros.
//!
//! Everything here is pure except the manifest functions, which fetch/upload manifest needles
//! through a [`ChunkStore`]. [`visible_intervals`], [`compact`] and [`truncate`] expect
//! manifest-expanded chunk lists (see [`expand_manifests`]); manifest chunks they meet are
//! skipped (visibility), kept (compaction) or kept whole unless entirely past EOF (truncation).
//!
//! Over 800 lines: half of it is the unit tests of the interval and manifest arithmetic, which
//! need its private helpers.

use crate::pb::filer as pb;
use crate::volume::fid::normalize_chunk_ids;
use crate::volume::{ChunkStore, Result, UploadOptions, VolumeError};
use prost::Message;
use std::collections::BTreeMap;

/// Data chunks per manifest (SeaweedFS `ManifestBatch`, used by `weed mount` and the filer).
/// A commit then sends at most this many data chunks (under 1 MB of protobuf) plus one
/// manifest chunk per batch. Lower would fold sooner but make more, smaller manifests that
/// every open of the file fetches; the same value as the filer also means the filer never
/// folds our entries itself (it does at this count), so what we commit is what it stores.
pub const MANIFEST_BATCH: usize = 10_000;

/// Deepest manifest nesting we follow (guards against cycles in corrupt data).
const MAX_MANIFEST_DEPTH: usize = 16;

/// A file range `[start, stop)` served by one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisibleInterval {
    pub start: u64,
    pub stop: u64,
    /// Index into the chunk slice given to [`visible_intervals`].
    pub chunk_index: usize,
    /// Offset within the chunk's clear needle data where `start` is read from.
    pub offset_in_chunk: u64,
    pub modified_ts_ns: i64,
}

/// One piece of a read, in file order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPiece {
    /// `len` bytes from chunk `chunk_index` at `offset_in_chunk`, landing at `file_offset`.
    Chunk {
        chunk_index: usize,
        offset_in_chunk: u64,
        len: u64,
        file_offset: u64,
    },
    /// `len` zero bytes at `file_offset` (a hole, or the tail up to the file size).
    Zero { file_offset: u64, len: u64 },
}

impl ReadPiece {
    pub fn file_offset(&self) -> u64 {
        match *self {
            ReadPiece::Chunk { file_offset, .. } | ReadPiece::Zero { file_offset, .. } => {
                file_offset
            }
        }
    }

    pub fn len(&self) -> u64 {
        match *self {
            ReadPiece::Chunk { len, .. } | ReadPiece::Zero { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `[offset, offset + size)` of a chunk, or None if it is empty or malformed (negative offset,
/// overflowing end).
pub fn chunk_range(c: &pb::FileChunk) -> Option<(u64, u64)> {
    let start = u64::try_from(c.offset).ok()?;
    let stop = start.checked_add(c.size)?;
    (stop > start).then_some((start, stop))
}

/// The end of the furthest chunk (0 for none). Manifest chunks count with their span.
pub fn chunks_end(chunks: &[pb::FileChunk]) -> u64 {
    chunks
        .iter()
        .filter_map(chunk_range)
        .map(|(_, e)| e)
        .max()
        .unwrap_or(0)
}

/// Logical file size: `max(attributes.file_size, furthest chunk end)`, and `remote_size` for
/// remote entries whose remote copy is newer than the local mtime.
pub fn file_size(entry: &pb::Entry) -> u64 {
    let attr = entry.attributes.as_ref();
    let mut size = attr
        .map(|a| a.file_size)
        .unwrap_or(0)
        .max(chunks_end(&entry.chunks));
    if let (Some(r), Some(a)) = (entry.remote_entry.as_ref(), attr) {
        if r.remote_mtime > a.mtime {
            size = size.max(u64::try_from(r.remote_size).unwrap_or(0));
        }
    }
    size
}

/// Resolves overlaps: the sorted, non-overlapping list of visible pieces. Empty, malformed and
/// manifest chunks are ignored.
pub fn visible_intervals(chunks: &[pb::FileChunk]) -> Vec<VisibleInterval> {
    let mut order: Vec<usize> = (0..chunks.len()).collect();
    // Stable: equal timestamps keep list order, so the later chunk is painted last and wins.
    order.sort_by_key(|&i| chunks[i].modified_ts_ns);
    let mut map: BTreeMap<u64, VisibleInterval> = BTreeMap::new();
    for i in order {
        let c = &chunks[i];
        if c.is_chunk_manifest {
            tracing::debug!(file_id = %c.file_id, "visible_intervals: unexpanded manifest chunk skipped");
            continue;
        }
        let Some((start, stop)) = chunk_range(c) else {
            continue;
        };
        // Intervals overlapping [start, stop): possibly one starting before `start`, and all
        // starting inside the range.
        let mut hit: Vec<u64> = Vec::new();
        if let Some((&k, iv)) = map.range(..start).next_back() {
            if iv.stop > start {
                hit.push(k);
            }
        }
        hit.extend(map.range(start..stop).map(|(&k, _)| k));
        for k in hit {
            let Some(iv) = map.remove(&k) else { continue };
            if iv.start < start {
                map.insert(iv.start, VisibleInterval { stop: start, ..iv });
            }
            if iv.stop > stop {
                let right = VisibleInterval {
                    start: stop,
                    offset_in_chunk: iv.offset_in_chunk + (stop - iv.start),
                    ..iv
                };
                map.insert(stop, right);
            }
        }
        map.insert(
            start,
            VisibleInterval {
                start,
                stop,
                chunk_index: i,
                offset_in_chunk: 0,
                modified_ts_ns: c.modified_ts_ns,
            },
        );
    }
    map.into_values().collect()
}

/// Lays `new` over `intervals` (sorted, non-overlapping, as from [`visible_intervals`]) as if
/// its chunk were appended to the list: it shows wherever its ts is at least the visible one's
/// (a tie goes to the later chunk, as there). Only the intervals it overlaps are touched, so a
/// writer appending chunk after chunk never rebuilds the whole list.
pub fn paint(intervals: &mut Vec<VisibleInterval>, new: VisibleInterval) {
    let (a, b, t) = (new.start, new.stop, new.modified_ts_ns);
    if a >= b {
        return;
    }
    let i0 = intervals.partition_point(|iv| iv.stop <= a);
    let i1 = intervals.partition_point(|iv| iv.start < b);
    let piece = |x: u64, y: u64| VisibleInterval {
        start: x,
        stop: y,
        offset_in_chunk: new.offset_in_chunk + (x - a),
        ..new
    };
    let mut out = Vec::with_capacity(i1 - i0 + 2);
    // `new` fills [cursor, ..) up to the next interval that outranks it
    let mut cursor = a;
    for iv in &intervals[i0..i1] {
        if iv.modified_ts_ns > t {
            if iv.start > cursor {
                out.push(piece(cursor, iv.start));
            }
            out.push(*iv);
            cursor = cursor.max(iv.stop);
            continue;
        }
        if iv.start < a {
            out.push(VisibleInterval { stop: a, ..*iv });
        }
        if iv.stop > b {
            if b > cursor {
                out.push(piece(cursor, b));
                cursor = b;
            }
            out.push(VisibleInterval {
                start: b,
                offset_in_chunk: iv.offset_in_chunk + (b - iv.start),
                ..*iv
            });
        }
    }
    if b > cursor {
        out.push(piece(cursor, b));
    }
    intervals.splice(i0..i1, out);
}

/// The intervals overlapping `[start, stop)`, clipped to it.
pub fn intervals_in(intervals: &[VisibleInterval], start: u64, stop: u64) -> Vec<VisibleInterval> {
    let first = intervals.partition_point(|iv| iv.stop <= start);
    intervals[first..]
        .iter()
        .take_while(|iv| iv.start < stop)
        .map(|iv| {
            let s = iv.start.max(start);
            VisibleInterval {
                start: s,
                stop: iv.stop.min(stop),
                offset_in_chunk: iv.offset_in_chunk + (s - iv.start),
                ..*iv
            }
        })
        .collect()
}

/// Plans reading `[offset, offset + len)` clipped to `file_size`: chunk slices and zero gaps in
/// file order, covering the clipped range exactly. `intervals` must come from
/// [`visible_intervals`] (sorted, non-overlapping).
pub fn read_plan(
    intervals: &[VisibleInterval],
    offset: u64,
    len: u64,
    file_size: u64,
) -> Vec<ReadPiece> {
    let end = offset.saturating_add(len).min(file_size);
    let mut out = Vec::new();
    if offset >= end {
        return out;
    }
    let mut pos = offset;
    let first = intervals.partition_point(|iv| iv.stop <= offset);
    for iv in &intervals[first..] {
        if iv.start >= end {
            break;
        }
        if iv.start > pos {
            out.push(ReadPiece::Zero {
                file_offset: pos,
                len: iv.start - pos,
            });
            pos = iv.start;
        }
        let stop = iv.stop.min(end);
        if stop > pos {
            out.push(ReadPiece::Chunk {
                chunk_index: iv.chunk_index,
                offset_in_chunk: iv.offset_in_chunk + (pos - iv.start),
                len: stop - pos,
                file_offset: pos,
            });
            pos = stop;
        }
    }
    if pos < end {
        out.push(ReadPiece::Zero {
            file_offset: pos,
            len: end - pos,
        });
    }
    out
}

/// Truncates a chunk list to `new_size` the way SeaweedFS does: chunks reaching past the new
/// end keep their fid with `size` shrunk; chunks starting at or after it are dropped. Returns
/// `(kept, dropped)`; the dropped chunks' needles are garbage once the entry is saved.
/// Shrinking (rather than relying on `file_size`) keeps old bytes from reappearing if the file
/// grows again. Manifest chunks are only dropped when entirely past the end: one the new end
/// cuts ([`cuts_manifest`]) would keep listing its chunks at full length, so expand first.
pub fn truncate(
    chunks: &[pb::FileChunk],
    new_size: u64,
) -> (Vec<pb::FileChunk>, Vec<pb::FileChunk>) {
    let mut kept = Vec::with_capacity(chunks.len());
    let mut dropped = Vec::new();
    for c in chunks {
        let start = u64::try_from(c.offset).unwrap_or(0);
        if c.offset < 0 || start >= new_size {
            dropped.push(c.clone());
            continue;
        }
        let mut c = c.clone();
        if !c.is_chunk_manifest && start.saturating_add(c.size) > new_size {
            c.size = new_size - start;
        }
        kept.push(c);
    }
    (kept, dropped)
}

/// Whether truncating to `new_size` cuts through a manifest chunk (see [`truncate`]).
pub fn cuts_manifest(chunks: &[pb::FileChunk], new_size: u64) -> bool {
    chunks.iter().any(|c| {
        c.is_chunk_manifest && chunk_range(c).is_some_and(|(s, e)| s < new_size && new_size < e)
    })
}

/// Drops chunks no longer visible at any byte. Returns `(kept, garbage)` in list order;
/// a partly visible chunk is kept whole. Manifest chunks are always kept.
pub fn compact(chunks: &[pb::FileChunk]) -> (Vec<pb::FileChunk>, Vec<pb::FileChunk>) {
    let mut visible = vec![false; chunks.len()];
    for iv in visible_intervals(chunks) {
        visible[iv.chunk_index] = true;
    }
    let mut kept = Vec::new();
    let mut garbage = Vec::new();
    for (c, vis) in chunks.iter().zip(visible) {
        if vis || c.is_chunk_manifest {
            kept.push(c.clone());
        } else {
            garbage.push(c.clone());
        }
    }
    (kept, garbage)
}

pub fn has_manifest(chunks: &[pb::FileChunk]) -> bool {
    chunks.iter().any(|c| c.is_chunk_manifest)
}

/// Replaces every manifest chunk by the data chunks it lists (recursively), fetching the
/// manifest needles through `store`. `file_id` is filled from `fid` on every chunk.
pub async fn expand_manifests(
    chunks: &[pb::FileChunk],
    store: &dyn ChunkStore,
) -> Result<Vec<pb::FileChunk>> {
    expand_manifests_in_range(chunks, store, 0, u64::MAX).await
}

/// Like [`expand_manifests`], but only resolves manifests overlapping `[start, stop)`; manifests
/// outside the range are left out of the result (enough to plan a read of that range).
pub async fn expand_manifests_in_range(
    chunks: &[pb::FileChunk],
    store: &dyn ChunkStore,
    start: u64,
    stop: u64,
) -> Result<Vec<pb::FileChunk>> {
    let mut out = Vec::with_capacity(chunks.len());
    expand_into(chunks, store, start, stop, 0, &mut out).await?;
    Ok(out)
}

fn expand_into<'a>(
    chunks: &'a [pb::FileChunk],
    store: &'a dyn ChunkStore,
    start: u64,
    stop: u64,
    depth: usize,
    out: &'a mut Vec<pb::FileChunk>,
) -> futures::future::BoxFuture<'a, Result<()>> {
    Box::pin(async move {
        for c in chunks {
            let mut c = c.clone();
            normalize_chunk_ids(&mut c);
            if !c.is_chunk_manifest {
                out.push(c);
                continue;
            }
            let overlaps = chunk_range(&c).is_some_and(|(s, e)| s < stop && e > start);
            if !overlaps {
                continue;
            }
            if depth >= MAX_MANIFEST_DEPTH {
                return Err(VolumeError::Corrupt {
                    fid: c.file_id.clone(),
                    msg: format!("chunk manifests nested deeper than {MAX_MANIFEST_DEPTH}"),
                });
            }
            let body = store.fetch_chunk(&c).await?;
            let manifest =
                pb::FileChunkManifest::decode(body.as_ref()).map_err(|e| VolumeError::Corrupt {
                    fid: c.file_id.clone(),
                    msg: format!("bad chunk manifest: {e}"),
                })?;
            expand_into(&manifest.chunks, store, start, stop, depth + 1, out).await?;
        }
        Ok(())
    })
}

/// If there are at least `batch` data chunks, folds each full group of `batch` (in offset order)
/// into one uploaded manifest chunk; the remainder stays as is. Manifest chunks already present
/// are kept. `batch` is [`MANIFEST_BATCH`] in production.
pub async fn maybe_manifestize(
    chunks: Vec<pb::FileChunk>,
    store: &dyn ChunkStore,
    opts: &UploadOptions,
    batch: usize,
) -> Result<Vec<pb::FileChunk>> {
    let batch = batch.max(1);
    // a chunk without a valid range (negative offset, empty, overflowing) is never folded: a
    // manifest spanning it would have no valid range either, and a truncate would drop it
    // together with every chunk inside
    let (manifests, plain): (Vec<_>, Vec<_>) =
        chunks.into_iter().partition(|c| c.is_chunk_manifest);
    let (mut data, invalid): (Vec<_>, Vec<_>) =
        plain.into_iter().partition(|c| chunk_range(c).is_some());
    if data.len() < batch {
        data.extend(invalid);
        data.extend(manifests);
        return Ok(data);
    }
    data.sort_by_key(|c| c.offset);
    let mut out = manifests;
    let full = data.len() / batch * batch;
    let rest = data.split_off(full);
    for group in data.chunks(batch) {
        let ranges = || group.iter().filter_map(chunk_range);
        let min = ranges().map(|r| r.0).min().unwrap_or(0);
        let max = ranges().map(|r| r.1).max().unwrap_or(min);
        // Inside manifests the filer keeps only the `fid` message.
        let stored: Vec<pb::FileChunk> = group
            .iter()
            .map(|c| {
                let mut c = c.clone();
                normalize_chunk_ids(&mut c);
                if c.fid.is_some() {
                    c.file_id.clear();
                }
                c
            })
            .collect();
        let body = pb::FileChunkManifest { chunks: stored }.encode_to_vec();
        let mut m = store.upload(body.into(), opts).await?;
        m.is_chunk_manifest = true;
        m.offset = i64::try_from(min).unwrap_or(i64::MAX);
        m.size = max - min;
        m.modified_ts_ns = 0;
        out.push(m);
    }
    out.extend(rest);
    out.extend(invalid);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::mock::MockChunkStore;
    use proptest::prelude::*;

    fn ch(key: u64, offset: i64, size: u64, ts: i64) -> pb::FileChunk {
        let fid = crate::volume::fid::FileId {
            volume_id: 1,
            key,
            cookie: 7,
        };
        pb::FileChunk {
            file_id: fid.to_string(),
            fid: Some(fid.to_pb()),
            offset,
            size,
            modified_ts_ns: ts,
            ..Default::default()
        }
    }

    /// Needle content of the chunk with `key` at needle position `p` (never 0).
    fn needle_byte(key: u64, p: u64) -> u8 {
        (((key.wrapping_mul(31)).wrapping_add(p.wrapping_mul(7))) % 251) as u8 + 1
    }

    fn key_of(c: &pb::FileChunk) -> u64 {
        c.fid.unwrap().file_key
    }

    /// Reference: paint chunks in (ts, list index) order into a zeroed byte array.
    fn reference(chunks: &[pb::FileChunk], size: u64) -> Vec<u8> {
        let mut buf = vec![0u8; size as usize];
        let mut order: Vec<usize> = (0..chunks.len()).collect();
        order.sort_by_key(|&i| chunks[i].modified_ts_ns);
        for i in order {
            let c = &chunks[i];
            for p in 0..c.size {
                let x = c.offset as u64 + p;
                if x < size {
                    buf[x as usize] = needle_byte(key_of(c), p);
                }
            }
        }
        buf
    }

    /// Materialises a read through `read_plan`.
    fn plan_bytes(chunks: &[pb::FileChunk], offset: u64, len: u64, size: u64) -> Vec<u8> {
        let ivs = visible_intervals(chunks);
        let mut out = Vec::new();
        let mut expect = offset;
        for p in read_plan(&ivs, offset, len, size) {
            assert_eq!(p.file_offset(), expect, "pieces must be contiguous");
            assert!(!p.is_empty());
            expect += p.len();
            match p {
                ReadPiece::Zero { len, .. } => out.extend(std::iter::repeat_n(0u8, len as usize)),
                ReadPiece::Chunk {
                    chunk_index,
                    offset_in_chunk,
                    len,
                    ..
                } => {
                    let c = &chunks[chunk_index];
                    assert!(offset_in_chunk + len <= c.size, "piece beyond chunk size");
                    out.extend((0..len).map(|i| needle_byte(key_of(c), offset_in_chunk + i)));
                }
            }
        }
        out
    }

    #[test]
    fn doc_example_overlap_and_compaction() {
        let t = 1_000;
        let chunks = vec![ch(1, 0, 100, t), ch(2, 20, 30, t + 2), ch(3, 40, 10, t + 1)];
        let entry = pb::Entry {
            chunks: chunks.clone(),
            attributes: Some(pb::FuseAttributes {
                file_size: 120,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(file_size(&entry), 120);
        let ivs = visible_intervals(&chunks);
        let shape: Vec<_> = ivs
            .iter()
            .map(|iv| (iv.start, iv.stop, iv.chunk_index, iv.offset_in_chunk))
            .collect();
        assert_eq!(shape, vec![(0, 20, 0, 0), (20, 50, 1, 0), (50, 100, 0, 50)]);
        let plan = read_plan(&ivs, 0, 1000, 120);
        assert_eq!(
            plan,
            vec![
                ReadPiece::Chunk {
                    chunk_index: 0,
                    offset_in_chunk: 0,
                    len: 20,
                    file_offset: 0
                },
                ReadPiece::Chunk {
                    chunk_index: 1,
                    offset_in_chunk: 0,
                    len: 30,
                    file_offset: 20
                },
                ReadPiece::Chunk {
                    chunk_index: 0,
                    offset_in_chunk: 50,
                    len: 50,
                    file_offset: 50
                },
                ReadPiece::Zero {
                    file_offset: 100,
                    len: 20
                },
            ]
        );
        let (kept, garbage) = compact(&chunks);
        assert_eq!(kept.iter().map(key_of).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(garbage.iter().map(key_of).collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn ties_later_in_list_wins_and_bad_chunks_ignored() {
        let chunks = vec![
            ch(1, 0, 10, 5),
            ch(2, 0, 10, 5),
            ch(3, -5, 10, 9),
            ch(4, 5, u64::MAX, 9),
            ch(5, 3, 0, 9),
        ];
        let ivs = visible_intervals(&chunks);
        assert_eq!(ivs.len(), 1);
        assert_eq!(ivs[0].chunk_index, 1);
        let (kept, garbage) = compact(&chunks);
        assert_eq!(kept.len(), 1);
        assert_eq!(garbage.len(), 4);
    }

    #[test]
    fn read_plan_edges() {
        let chunks = vec![ch(1, 10, 10, 1)];
        let ivs = visible_intervals(&chunks);
        assert!(read_plan(&ivs, 30, 10, 30).is_empty());
        assert!(read_plan(&ivs, 5, 0, 30).is_empty());
        assert_eq!(
            read_plan(&ivs, 0, u64::MAX, 5),
            vec![ReadPiece::Zero {
                file_offset: 0,
                len: 5
            }]
        );
        assert_eq!(
            read_plan(&ivs, 12, 3, 30),
            vec![ReadPiece::Chunk {
                chunk_index: 0,
                offset_in_chunk: 2,
                len: 3,
                file_offset: 12
            }]
        );
        // file_size smaller than the chunk end clips the chunk.
        assert_eq!(
            read_plan(&ivs, 0, 100, 15),
            vec![
                ReadPiece::Zero {
                    file_offset: 0,
                    len: 10
                },
                ReadPiece::Chunk {
                    chunk_index: 0,
                    offset_in_chunk: 0,
                    len: 5,
                    file_offset: 10
                }
            ]
        );
    }

    #[test]
    fn file_size_rules() {
        let mut e = pb::Entry {
            chunks: vec![ch(1, 100, 50, 1)],
            ..Default::default()
        };
        assert_eq!(file_size(&e), 150);
        e.attributes = Some(pb::FuseAttributes {
            file_size: 3 << 20,
            mtime: 10,
            ..Default::default()
        });
        assert_eq!(file_size(&e), 3 << 20);
        e.remote_entry = Some(pb::RemoteEntry {
            remote_mtime: 11,
            remote_size: 5 << 20,
            ..Default::default()
        });
        assert_eq!(file_size(&e), 5 << 20);
        e.remote_entry.as_mut().unwrap().remote_mtime = 9;
        assert_eq!(file_size(&e), 3 << 20);
    }

    #[test]
    fn truncate_shrinks_and_drops() {
        let chunks = vec![ch(1, 0, 5 << 20, 1), ch(2, 5 << 20, 100, 2)];
        let (kept, dropped) = truncate(&chunks, (1 << 20) + 7);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].file_id, chunks[0].file_id);
        assert_eq!(kept[0].size, 1_048_583);
        assert_eq!(dropped.len(), 1);
        let (kept, dropped) = truncate(&chunks, 0);
        assert!(kept.is_empty());
        assert_eq!(dropped.len(), 2);
    }

    #[tokio::test]
    async fn a_chunk_without_a_valid_range_is_never_folded() {
        let store = MockChunkStore::new();
        let mut data = Vec::new();
        for i in 0..3u64 {
            let mut c = store.insert(vec![i as u8; 10]);
            c.offset = (i * 10) as i64;
            data.push(c);
        }
        data[0].offset = -1;
        let out = maybe_manifestize(data.clone(), &store, &UploadOptions::default(), 2)
            .await
            .unwrap();
        // two valid chunks make one manifest over [10, 30); the broken one stays outside it
        let m: Vec<_> = out.iter().filter(|c| c.is_chunk_manifest).collect();
        assert_eq!(m.len(), 1);
        assert_eq!(chunk_range(m[0]), Some((10, 30)));
        assert!(out.iter().any(|c| c.offset == -1 && !c.is_chunk_manifest));
        assert_eq!(out.len(), 2);
    }

    #[tokio::test]
    async fn manifests_expand_recursively_and_manifestize_round_trips() {
        let store = MockChunkStore::new();
        let mut data = Vec::new();
        for i in 0..7u64 {
            let mut c = store.insert(vec![i as u8; 10]);
            c.offset = (i * 10) as i64;
            c.modified_ts_ns = 100 + i as i64;
            data.push(c);
        }
        let folded = maybe_manifestize(data.clone(), &store, &UploadOptions::default(), 3)
            .await
            .unwrap();
        // 7 chunks, batch 3: two manifests + one remaining data chunk.
        assert_eq!(folded.iter().filter(|c| c.is_chunk_manifest).count(), 2);
        assert_eq!(folded.len(), 3);
        let m0 = folded
            .iter()
            .find(|c| c.is_chunk_manifest && c.offset == 0)
            .unwrap();
        assert_eq!(m0.size, 30);
        // Existing manifests are never folded again.
        let again = maybe_manifestize(folded.clone(), &store, &UploadOptions::default(), 1)
            .await
            .unwrap();
        assert_eq!(again.iter().filter(|c| c.is_chunk_manifest).count(), 3);
        // Nest by hand: a manifest listing the two manifests (by fid only, as the filer stores them).
        let inner: Vec<pb::FileChunk> = folded
            .iter()
            .filter(|c| c.is_chunk_manifest)
            .map(|c| pb::FileChunk {
                file_id: String::new(),
                ..c.clone()
            })
            .collect();
        let mut outer = store.insert(pb::FileChunkManifest { chunks: inner }.encode_to_vec());
        outer.is_chunk_manifest = true;
        outer.offset = 0;
        outer.size = 60;
        let mut nested: Vec<pb::FileChunk> = folded
            .iter()
            .filter(|c| !c.is_chunk_manifest)
            .cloned()
            .collect();
        nested.push(outer);
        assert!(has_manifest(&nested));
        let mut expanded = expand_manifests(&nested, &store).await.unwrap();
        expanded.sort_by_key(|c| c.offset);
        assert_eq!(expanded, data);
        // Range-limited expansion resolves only overlapping manifests.
        let before = store.whole_fetch_count();
        let part = expand_manifests_in_range(&nested, &store, 60, 70)
            .await
            .unwrap();
        assert_eq!(part.iter().map(|c| c.offset).collect::<Vec<_>>(), vec![60]);
        assert!(store.whole_fetch_count() - before <= 1);
        // Corrupt manifest body -> Corrupt, not a panic.
        let mut bad = store.insert(vec![0xff_u8; 16]);
        bad.is_chunk_manifest = true;
        assert!(matches!(
            expand_manifests(&[bad], &store).await,
            Err(VolumeError::Corrupt { .. })
        ));
    }

    #[tokio::test]
    async fn manifest_cycle_is_an_error() {
        let store = MockChunkStore::new();
        let fid = "1,0100000007";
        let me = pb::FileChunk {
            file_id: fid.into(),
            offset: 0,
            size: 10,
            is_chunk_manifest: true,
            ..Default::default()
        };
        store.put_raw(
            fid,
            pb::FileChunkManifest {
                chunks: vec![me.clone()],
            }
            .encode_to_vec(),
        );
        assert!(matches!(
            expand_manifests(&[me], &store).await,
            Err(VolumeError::Corrupt { .. })
        ));
    }

    /// Byte-level view of intervals: for each byte, (chunk, offset in chunk) or None.
    fn byte_map(ivs: &[VisibleInterval], size: u64) -> Vec<Option<(usize, u64)>> {
        let mut m = vec![None; size as usize];
        for iv in ivs {
            for x in iv.start..iv.stop.min(size) {
                m[x as usize] = Some((iv.chunk_index, iv.offset_in_chunk + (x - iv.start)));
            }
        }
        m
    }

    fn iv_of(chunks: &[pb::FileChunk], i: usize) -> VisibleInterval {
        let (start, stop) = chunk_range(&chunks[i]).unwrap_or((0, 0));
        VisibleInterval {
            start,
            stop,
            chunk_index: i,
            offset_in_chunk: 0,
            modified_ts_ns: chunks[i].modified_ts_ns,
        }
    }

    #[test]
    fn cuts_manifest_only_inside_its_span() {
        let mut m = ch(9, 100, 50, 0);
        m.is_chunk_manifest = true;
        let list = [ch(1, 0, 100, 1), m];
        assert!(cuts_manifest(&list, 120));
        assert!(!cuts_manifest(&list, 100));
        assert!(!cuts_manifest(&list, 150));
        assert!(!cuts_manifest(&list, 50), "a data chunk is not a manifest");
    }

    fn arb_chunks() -> impl Strategy<Value = Vec<pb::FileChunk>> {
        // Small offsets/sizes so overlaps are common; few distinct timestamps so ties happen.
        prop::collection::vec((0i64..200, 0u64..80, 0i64..6), 0..12).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (off, size, ts))| ch(i as u64 + 1, off, size, ts))
                .collect()
        })
    }

    proptest! {
        #[test]
        fn read_plan_matches_reference(chunks in arb_chunks(), extra in 0u64..50, off in 0u64..320, len in 0u64..320) {
            let size = chunks_end(&chunks) + extra;
            let want = reference(&chunks, size);
            let got = plan_bytes(&chunks, off, len, size);
            let lo = (off as usize).min(want.len());
            let hi = ((off + len) as usize).min(want.len());
            prop_assert_eq!(got, want[lo..hi].to_vec());
        }

        #[test]
        fn painting_chunk_by_chunk_equals_rebuilding(chunks in arb_chunks()) {
            let size = chunks_end(&chunks);
            let mut ivs = Vec::new();
            for i in 0..chunks.len() {
                paint(&mut ivs, iv_of(&chunks, i));
                for w in ivs.windows(2) {
                    prop_assert!(w[0].stop <= w[1].start);
                }
                let want = visible_intervals(&chunks[..=i]);
                prop_assert_eq!(byte_map(&ivs, size), byte_map(&want, size));
            }
        }

        #[test]
        fn painting_over_a_range_equals_rebuilding(
            chunks in arb_chunks(),
            more in arb_chunks(),
            off in 0u64..300,
            len in 0u64..300,
        ) {
            // `more` plays the uploads in flight: listed after `chunks`, painted on a range.
            let mut all = chunks.clone();
            all.extend(more.iter().cloned());
            let size = chunks_end(&all);
            let mut ivs = intervals_in(&visible_intervals(&chunks), off, off + len);
            for i in chunks.len()..all.len() {
                paint(&mut ivs, iv_of(&all, i));
            }
            // what lies outside the range is never read
            let clip = |mut m: Vec<Option<(usize, u64)>>| {
                for (x, b) in m.iter_mut().enumerate() {
                    if (x as u64) < off || (x as u64) >= off + len {
                        *b = None;
                    }
                }
                m
            };
            prop_assert_eq!(clip(byte_map(&ivs, size)), clip(byte_map(&visible_intervals(&all), size)));
        }

        #[test]
        fn intervals_sorted_disjoint(chunks in arb_chunks()) {
            let ivs = visible_intervals(&chunks);
            for w in ivs.windows(2) {
                prop_assert!(w[0].stop <= w[1].start);
            }
            for iv in &ivs {
                prop_assert!(iv.start < iv.stop);
                prop_assert!(iv.offset_in_chunk + (iv.stop - iv.start) <= chunks[iv.chunk_index].size);
            }
        }

        #[test]
        fn compact_preserves_visible_bytes(chunks in arb_chunks(), extra in 0u64..50) {
            let size = chunks_end(&chunks) + extra;
            let (kept, garbage) = compact(&chunks);
            prop_assert_eq!(kept.len() + garbage.len(), chunks.len());
            prop_assert_eq!(plan_bytes(&kept, 0, size, size), reference(&chunks, size));
            // Nothing kept is invisible.
            let again = compact(&kept);
            prop_assert!(again.1.is_empty());
        }

        #[test]
        fn truncate_preserves_prefix_and_zeroes_regrowth(chunks in arb_chunks(), cut in 0u64..300) {
            let size = chunks_end(&chunks).max(cut) + 10;
            let before = reference(&chunks, size);
            let (kept, dropped) = truncate(&chunks, cut);
            prop_assert_eq!(kept.len() + dropped.len(), chunks.len());
            prop_assert!(chunks_end(&kept) <= cut);
            // Growing the file again shows zeros past the cut, never old bytes.
            let after = plan_bytes(&kept, 0, size, size);
            let c = cut as usize;
            prop_assert_eq!(&after[..c], &before[..c]);
            prop_assert!(after[c..].iter().all(|&b| b == 0));
        }
    }
}
