//! Read path: resolve a read into pieces, fetch chunk pieces through the session's chunk cache
//! (whole chunks for sequential readers, with readahead; exact ranges for random readers).

use super::file::Piece;
use super::{errno, Fs, Result};
use crate::pb::filer as pb;
use bytes::{Bytes, BytesMut};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Cache key of a chunk: its file id (immutable), built from `fid` when `file_id` is empty.
pub fn chunk_key(c: &pb::FileChunk) -> String {
    if !c.file_id.is_empty() {
        return c.file_id.clone();
    }
    match &c.fid {
        Some(f) => {
            let key = f.file_key.to_be_bytes();
            let first = key.iter().position(|b| *b != 0).unwrap_or(7);
            format!(
                "{},{}{:08x}",
                f.volume_id,
                hex::encode(&key[first..]),
                f.cookie
            )
        }
        None => String::new(),
    }
}

/// Reads this small or smaller are served by exact ranged requests when not sequential.
const RANDOM_RANGE_MAX: u64 = 256 * 1024;

/// Kernel readahead requests are served concurrently and may be seen out of order: a read up
/// to this far behind the furthest one keeps a sequential stream going.
const SEQ_BEHIND: u64 = 8 << 20;

/// Updates a handle's detector (`(end of the furthest read, streak)`) and tells whether this
/// read belongs to a sequential stream. A stream starts with a read that continues the previous
/// one exactly (or starts at 0); random reads never do, so they never trigger whole-chunk
/// fetches and readahead by landing near each other by chance. Once started, a stream survives
/// forward jumps: readers sharing the page cache (pods on bind mounts of one volume) skip the
/// pages another reader brought in, and were taken for random readers sending ranged GETs for
/// chunks that were about to be fetched whole (see also `OpenFile::stream_pos`).
fn next_sequential(seq: &mut (u64, u32), offset: u64, size: u64) -> bool {
    let (last_end, streak) = *seq;
    let end = offset + size;
    let contiguous = offset == last_end;
    let near = offset.saturating_add(SEQ_BEHIND) >= last_end;
    *seq = if contiguous {
        (end, streak.saturating_add(1))
    } else if near && streak > 0 {
        (end.max(last_end), streak)
    } else {
        (end, 0)
    };
    seq.1 >= 1
}

impl Fs {
    pub async fn read(&self, fh: u64, ino: u64, offset: u64, size: u32) -> Result<Bytes> {
        let h = self.handle(fh, ino).await?;
        let of = h.file.clone();
        let mut sequential = next_sequential(&mut h.seq.lock(), offset, size as u64);
        if !sequential {
            // A reader sharing the page cache with a sequential one (pods on bind mounts of
            // one volume) asks only for the pages the other has not brought in: near that
            // stream, it is part of it, and its chunks are being fetched whole anyway.
            let window = (self.cfg.readahead_chunks * self.cfg.chunk_size) as u64 + SEQ_BEHIND;
            let pos = of.stream_pos.load(Ordering::Relaxed);
            sequential = pos != u64::MAX && offset.abs_diff(pos) <= window;
        }
        self.read_file(&of, offset, size as u64, sequential).await
    }

    /// The bytes of `[offset, offset+len)` of an open file (short at EOF).
    pub(crate) async fn read_range(
        &self,
        of: &Arc<super::file::OpenFile>,
        offset: u64,
        len: u64,
    ) -> Result<Bytes> {
        self.read_file(of, offset, len, false).await
    }

    async fn read_file(
        &self,
        of: &Arc<super::file::OpenFile>,
        offset: u64,
        size: u64,
        sequential: bool,
    ) -> Result<Bytes> {
        let Some((end, pieces, overlays)) = of.plan_read(offset, size) else {
            return Ok(Bytes::new());
        };
        if sequential {
            self.readahead(of, end);
        }
        // fast path: one piece, no dirty overlay
        if pieces.len() == 1 && overlays.is_empty() {
            let p = pieces.into_iter().next().expect("one piece");
            return self.fetch_piece(p, sequential).await;
        }
        let mut out = BytesMut::zeroed((end - offset) as usize);
        let fetches = pieces.into_iter().map(|p| {
            let at = match &p {
                Piece::Chunk { at, .. } | Piece::Mem { at, .. } | Piece::Zero { at, .. } => *at,
            };
            async move { self.fetch_piece(p, sequential).await.map(|b| (at, b)) }
        });
        for r in futures::future::join_all(fetches).await {
            let (at, b) = r?;
            let lo = (at - offset) as usize;
            out[lo..lo + b.len()].copy_from_slice(&b);
        }
        for (at, d) in overlays {
            let lo = (at - offset) as usize;
            out[lo..lo + d.len()].copy_from_slice(&d);
        }
        Ok(out.freeze())
    }

    async fn fetch_piece(&self, p: Piece, sequential: bool) -> Result<Bytes> {
        match p {
            Piece::Zero { len, .. } => Ok(Bytes::from(vec![0u8; len as usize])),
            Piece::Mem { data, .. } => Ok(data),
            Piece::Chunk {
                chunk,
                offset_in_chunk,
                len,
                ..
            } => {
                let key = chunk_key(&chunk);
                let plain = chunk.cipher_key.is_empty() && !chunk.is_compressed;
                // a random read of a cached, arriving or hot chunk takes the whole chunk
                let whole = sequential
                    || !plain
                    || len > RANDOM_RANGE_MAX
                    || self.cache.contains_or_pending(&key)
                    || self.cache.is_held(&key)
                    || self.cache.touch_ranged(&key);
                let data = if whole {
                    self.whole_chunk(&chunk, &key).await?
                } else {
                    match self.store.fetch_range(&chunk, offset_in_chunk, len).await {
                        Ok(b) => return check_len(b, len, &key),
                        // the volume server failed: the disk tier may still have it
                        Err(_) if self.cache.on_disk(&key) => {
                            self.whole_chunk(&chunk, &key).await?
                        }
                        Err(e) => return Err(e.into()),
                    }
                };
                self.cache.served(&key, len, chunk.size);
                let lo = offset_in_chunk as usize;
                let hi = lo + len as usize;
                if hi > data.len() {
                    return Err(errno(
                        libc::EIO,
                        format!("chunk {key} has {} bytes, need {hi}", data.len()),
                    ));
                }
                Ok(data.slice(lo..hi))
            }
        }
    }

    async fn whole_chunk(&self, chunk: &pb::FileChunk, key: &str) -> Result<Bytes> {
        let store = self.store.clone();
        let c = chunk.clone();
        let to_disk = chunk.cipher_key.is_empty();
        self.cache
            .get_or_fetch_chunk(key, to_disk, async move { store.fetch_chunk(&c).await })
            .await
            .map_err(|e| (*e).clone().into())
    }

    /// Prefetches the chunks after `from` so the volume servers work in parallel with the reader.
    fn readahead(&self, of: &Arc<super::file::OpenFile>, from: u64) {
        if !self.cache.enabled() {
            return;
        }
        of.stream_pos.store(from, Ordering::Relaxed);
        let window = (self.cfg.readahead_chunks * self.cfg.chunk_size) as u64;
        let Some((_, pieces, _)) = of.plan_read(from, window) else {
            return;
        };
        for p in pieces {
            let Piece::Chunk { chunk, .. } = p else {
                continue;
            };
            let key = chunk_key(&chunk);
            // cached, on its way, or held: another fetch would only cost a GET and a charge
            if self.cache.contains_or_pending(&key) || self.cache.is_held(&key) {
                continue;
            }
            let Ok(permit) = self.prefetch_sem.clone().try_acquire_owned() else {
                return;
            };
            // the node's readahead allowance (memory budget) is shared by every session
            let Some(charge) = self.cfg.budget.try_readahead(chunk.size) else {
                return;
            };
            let cache = self.cache.clone();
            let store = self.store.clone();
            tokio::spawn(async move {
                let c = chunk.clone();
                let to_disk = c.cipher_key.is_empty();
                cache
                    .prefetch_chunk(&key, to_disk, Some(charge), async move {
                        store.fetch_chunk(&c).await
                    })
                    .await;
                drop(permit);
            });
        }
    }
}

fn check_len(b: Bytes, len: u64, key: &str) -> Result<Bytes> {
    if (b.len() as u64) < len {
        return Err(errno(
            libc::EIO,
            format!("short read of {key}: {} < {len}", b.len()),
        ));
    }
    Ok(b.slice(..len as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_detection() {
        let mut s = (0, 0);
        // a reader from the start, with readahead requests seen out of order
        assert!(next_sequential(&mut s, 0, 1 << 20));
        assert!(next_sequential(&mut s, 2 << 20, 1 << 20));
        assert!(next_sequential(&mut s, 1 << 20, 1 << 20));
        assert_eq!(s.0, 3 << 20);
        assert!(next_sequential(&mut s, 3 << 20, 1 << 20));
        // a forward jump (pages another reader cached) keeps it; a jump far back ends it
        assert!(next_sequential(&mut s, 100 << 20, 1 << 20));
        assert!(!next_sequential(&mut s, 10 << 20, 4096));
        // exact continuation starts a new one
        assert!(next_sequential(&mut s, (10 << 20) + 4096, 4096));
        // random reads that land near each other by chance stay random
        let mut r = (0, 0);
        assert!(!next_sequential(&mut r, 10 << 20, 4096));
        assert!(!next_sequential(&mut r, (10 << 20) + 8192, 4096));
        assert!(!next_sequential(&mut r, (10 << 20) - 65536, 4096));
    }

    #[test]
    fn key_from_fid() {
        let c = pb::FileChunk {
            fid: Some(pb::FileId {
                volume_id: 2,
                file_key: 1,
                cookie: 0x3728e3cc,
            }),
            ..Default::default()
        };
        assert_eq!(chunk_key(&c), "2,013728e3cc");
    }
}
