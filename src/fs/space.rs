//! Space of [`Fs`]'s volume: statfs and the quota's used bytes, fallocate, and lseek's data
//! and holes.

use super::{errno, now_parts, Fs, Result};
use crate::pb::filer as pb;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, Default)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// The granularity lseek reports data and holes in.
const SEEK_BLOCK: u64 = 4096;

impl Fs {
    /// Re-reads the volume's used bytes (quota accounting).
    pub async fn refresh_usage(&self) {
        if let Ok(st) = self
            .filer
            .statistics(pb::StatisticsRequest {
                collection: self.cfg.collection.clone(),
                replication: self.cfg.replication.clone(),
                disk_type: self.cfg.disk_type.clone(),
                ttl: String::new(),
            })
            .await
        {
            self.used_bytes.store(st.used_size, Ordering::Relaxed);
        }
    }

    pub async fn statfs(&self) -> Result<StatFs> {
        if let Some((at, s)) = *self.statfs_cache.lock() {
            if at.elapsed() < Duration::from_secs(5) {
                return Ok(s);
            }
        }
        let st = self
            .filer
            .statistics(pb::StatisticsRequest {
                collection: self.cfg.collection.clone(),
                replication: self.cfg.replication.clone(),
                disk_type: self.cfg.disk_type.clone(),
                ttl: String::new(),
            })
            .await?;
        self.used_bytes.store(st.used_size, Ordering::Relaxed);
        let quota = self.quota();
        let mut total = st.total_size;
        if quota > 0 {
            total = if total == 0 { quota } else { total.min(quota) };
        }
        let used = st.used_size.min(total);
        let bsize = 4096u64;
        let files = u32::MAX as u64;
        let s = StatFs {
            blocks: total / bsize,
            bfree: (total - used) / bsize,
            bavail: (total - used) / bsize,
            files,
            ffree: files.saturating_sub(st.file_count),
            bsize: bsize as u32,
            namelen: 255,
            frsize: bsize as u32,
        };
        *self.statfs_cache.lock() = Some((Instant::now(), s));
        Ok(s)
    }

    /// fallocate(2): mode 0 (and KEEP_SIZE) is honoured by reserving the size; SeaweedFS has no
    /// preallocation, so punching holes and other modes are not supported.
    pub async fn fallocate(
        &self,
        fh: u64,
        ino: u64,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> Result<()> {
        self.check_writable()?;
        if mode & !libc::FALLOC_FL_KEEP_SIZE != 0 {
            return Err(errno(libc::EOPNOTSUPP, "fallocate mode not supported"));
        }
        let h = self.handle(fh, ino).await?;
        self.verifier.check(fh)?;
        let end = offset
            .checked_add(length)
            .ok_or_else(|| errno(libc::EFBIG, "too large"))?;
        let of = h.file.clone();
        let grow = mode & libc::FALLOC_FL_KEEP_SIZE == 0 && end > of.state.lock().size;
        if grow {
            of.grow_to(end);
        }
        {
            // a successful fallocate changes ctime (and mtime when the size grew)
            let mut s = of.state.lock();
            let now = now_parts();
            let a = s.entry.attributes.get_or_insert_with(Default::default);
            (a.ctime, a.ctime_ns) = now;
            if grow {
                (a.mtime, a.mtime_ns) = now;
            }
            s.touch();
        }
        self.flush_file(&of).await
    }

    /// lseek SEEK_DATA / SEEK_HOLE from the ranges chunks and dirty data cover, in whole
    /// [`SEEK_BLOCK`]s (bytes no chunk covers are holes; the end of the file counts as one).
    pub async fn lseek(&self, fh: u64, ino: u64, offset: i64, whence: i32) -> Result<i64> {
        let h = self.handle(fh, ino).await?;
        let size = h.file.state.lock().size;
        if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
            return Err(errno(libc::EINVAL, "unsupported whence"));
        }
        if offset < 0 {
            // as the kernel's own filesystems answer (xfstests' seek_sanity_test)
            return Err(errno(libc::ENXIO, "negative offset"));
        }
        let off = offset as u64;
        if off >= size && (whence == libc::SEEK_DATA || whence == libc::SEEK_HOLE) {
            return Err(errno(libc::ENXIO, "offset at or beyond EOF"));
        }
        // Whole 4 KiB blocks, as block filesystems answer (a hole inside a block reads as
        // zeros and may be reported as data): programs that look for holes (cp, tar,
        // xfstests' seek_sanity_test) find a block size, not 1-byte holes.
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (start, end) in h.file.data_ranges() {
            let (start, end) = (
                start & !(SEEK_BLOCK - 1),
                end.div_ceil(SEEK_BLOCK) * SEEK_BLOCK,
            );
            let end = end.min(size);
            match ranges.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => ranges.push((start, end)),
            }
        }
        match whence {
            libc::SEEK_DATA => ranges
                .iter()
                .find(|(_, end)| *end > off)
                .map(|(start, _)| (*start).max(off) as i64)
                .ok_or_else(|| errno(libc::ENXIO, "no data after offset")),
            libc::SEEK_HOLE => Ok(ranges
                .iter()
                .find(|(start, end)| *start <= off && off < *end)
                .map(|(_, end)| *end)
                .unwrap_or(off) as i64),
            _ => Err(errno(libc::EINVAL, "unsupported whence")),
        }
    }
}
