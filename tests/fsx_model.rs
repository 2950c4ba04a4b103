//! An fsx-style tester: one file on our mount (1 MiB chunks), random operations — pread,
//! pwrite at random offsets and lengths (often across chunk boundaries), ftruncate up and
//! down, mmap reads, MAP_SHARED mmap writes with msync, fallocate (mode 0 and KEEP_SIZE),
//! fsync, close + reopen, and now and then an unmount + remount — each checked against an
//! in-memory copy of the file. After a close the filer HTTP API is sometimes checked too,
//! and after a reopen or remount the whole file is compared.
//!
//! Environment: `FSX_OPS` (default 3000), `FSX_SEED` (number or `random`), `FSX_MAXLEN`
//! (default 4 MiB + 1234), `FSX_REMOUNT_EVERY` (mean ops between remounts, default 1000).
//! `FSX_SABOTAGE=N` flips one byte of the model after operation N: the run must fail (a check
//! of the checker). `scripts/soak.sh` runs the long version.

mod common;
mod fuse_support;
mod model_support;

use fuse_support::*;
use model_support::*;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::time::Instant;

const MIB: u64 = 1 << 20;
const CHUNK: u64 = MIB;
const MOUNT_ARGS: &[&str] = &["--chunkSizeLimitMB=1"];

struct Fsx {
    w: std::sync::Arc<common::WeedServer>,
    root: String,
    mount: Option<MountGuard>,
    file: Option<File>,
    model: Vec<u8>,
    log: Vec<String>,
    seed: u64,
    page: u64,
    counts: std::collections::BTreeMap<&'static str, u64>,
}

impl Fsx {
    fn path(&self) -> std::path::PathBuf {
        self.mount.as_ref().unwrap().join("fsx.bin")
    }

    fn fd(&self) -> i32 {
        self.file.as_ref().unwrap().as_raw_fd()
    }

    fn open(&mut self) {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(self.path())
            .unwrap_or_else(|e| self.fail(&format!("open: {e}")));
        self.file = Some(f);
    }

    fn close(&mut self) {
        if let Some(f) = self.file.take() {
            // close(2) reports the flush's result
            let fd = std::os::unix::io::IntoRawFd::into_raw_fd(f);
            if unsafe { libc::close(fd) } != 0 {
                self.fail(&format!("close: errno {}", errno()));
            }
        }
    }

    fn fail(&self, what: &str) -> ! {
        let log = self
            .mount
            .as_ref()
            .map(|m| tail(&m.log_text(), 25))
            .unwrap_or_default();
        panic!(
            "FSX FAILURE (seed {s}; rerun with FSX_SEED={s} FSX_OPS={n}): {what}\n\
             --- last operations ---\n{}\n--- mount log (tail) ---\n{log}",
            tail(&self.log.join("\n"), 40),
            s = self.seed,
            n = self.log.len(),
        );
    }

    fn note(&mut self, s: String) {
        self.log.push(s);
    }

    fn pread(&self, off: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        let mut done = 0;
        while done < len {
            match self
                .file
                .as_ref()
                .unwrap()
                .read_at(&mut buf[done..], off + done as u64)
            {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => self.fail(&format!("pread off={off} len={len}: {e}")),
            }
        }
        buf.truncate(done);
        buf
    }

    /// `got` must equal the model's bytes at `off`.
    fn compare(&self, what: &str, off: u64, got: &[u8]) {
        let end = (off as usize + got.len()).min(self.model.len());
        let want = &self.model[(off as usize).min(end)..end];
        if got != want {
            let d = first_difference(want, got);
            // report file offsets, not buffer offsets
            let at = (0..want.len().min(got.len()))
                .find(|&i| want[i] != got[i])
                .unwrap_or(want.len().min(got.len()));
            self.fail(&format!(
                "{what}: mismatch at file offset {} (0x{:x}), chunk {} + {}: {d}",
                off + at as u64,
                off + at as u64,
                (off + at as u64) / CHUNK,
                (off + at as u64) % CHUNK
            ));
        }
    }

    fn check_size(&self, what: &str) {
        let st = fstat(self.fd()).unwrap_or_else(|e| self.fail(&format!("fstat: errno {e}")));
        if st.st_size as u64 != self.model.len() as u64 {
            self.fail(&format!(
                "{what}: st_size {} model {}",
                st.st_size,
                self.model.len()
            ));
        }
    }

    fn check_all(&self, what: &str) {
        self.check_size(what);
        let got = self.pread(0, self.model.len() + 4096);
        if got.len() != self.model.len() {
            self.fail(&format!(
                "{what}: read {} bytes, model has {}",
                got.len(),
                self.model.len()
            ));
        }
        self.compare(what, 0, &got);
    }

    fn check_http(&self, what: &str) {
        let p = format!("{}/fsx.bin", self.root);
        let got = self
            .w
            .filer_get(&p)
            .unwrap_or_else(|| self.fail(&format!("{what}: GET {p} failed")));
        if got.len() != self.model.len() {
            self.fail(&format!(
                "{what}: HTTP GET has {} bytes, model {}; {}",
                got.len(),
                self.model.len(),
                first_difference(&self.model, &got)
            ));
        }
        self.compare(&format!("{what} (HTTP GET)"), 0, &got);
    }

    fn remount(&mut self) {
        self.close();
        let m = self.mount.take().unwrap();
        let st = m.unmount();
        if !st.success() {
            self.fail(&format!("mount process exited with {st} on unmount"));
        }
        self.mount = Some(mount_ours(&self.w, &self.root, MOUNT_ARGS));
        self.open();
    }

    fn apply_write(&mut self, off: u64, buf: &[u8]) {
        let (off, end) = (off as usize, off as usize + buf.len());
        if self.model.len() < end {
            self.model.resize(end, 0);
        }
        self.model[off..end].copy_from_slice(buf);
    }

    fn bump(&mut self, k: &'static str) {
        *self.counts.entry(k).or_default() += 1;
    }
}

/// An offset in `0..=limit`: uniform, or near a chunk boundary.
fn rand_off(rng: &mut Rng, limit: u64) -> u64 {
    if limit == 0 {
        return 0;
    }
    if rng.chance(1, 3) {
        let k = rng.range(0, limit / CHUNK + 1) * CHUNK;
        let o = (k + rng.range(0, 8192)).saturating_sub(4096);
        o.min(limit)
    } else {
        rng.range(0, limit)
    }
}

fn rand_len(rng: &mut Rng) -> u64 {
    match rng.weighted(&[50, 35, 15]) {
        0 => rng.range(1, 4096),
        1 => rng.range(4097, 200_000),
        _ => rng.range(200_001, CHUNK + CHUNK / 2),
    }
}

#[test]
fn fsx_random_operations_match_an_in_memory_file() {
    let seed = seed_from_env("FSX_SEED", 4242);
    let ops = env_u64("FSX_OPS", 3000);
    let maxlen = env_u64("FSX_MAXLEN", 4 * MIB + 1234);
    let remount_every = env_u64("FSX_REMOUNT_EVERY", 1000).max(1);
    let w = shared_server();
    let root = unique_path("fsx");
    let mount = mount_ours(&w, &root, MOUNT_ARGS);
    // FSX_SABOTAGE=N: corrupt the model after operation N (the run must then fail)
    let sabotage = env_u64("FSX_SABOTAGE", 0);
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let mut fx = Fsx {
        w,
        root,
        mount: Some(mount),
        file: None,
        model: Vec::new(),
        log: Vec::new(),
        seed,
        page,
        counts: Default::default(),
    };
    fx.open();
    let mut rng = Rng::new(seed);
    let started = Instant::now();
    for i in 0..ops {
        let size = fx.model.len() as u64;
        // read, write, truncate, mmap read, mmap write, falloc, falloc keep, fsync,
        // close+reopen, remount
        let mut weights = [20, 28, 8, 8, 8, 4, 2, 2, 4, 0];
        // about one remount every `remount_every` ops, and one in the middle of a short run
        let remount = i == ops / 2 || rng.chance(1, remount_every);
        if remount {
            weights = [0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        }
        match rng.weighted(&weights) {
            0 => {
                let off = rand_off(&mut rng, size + 1000);
                let len = rand_len(&mut rng) as usize;
                fx.note(format!("#{i} pread off={off} len={len} (size {size})"));
                let got = fx.pread(off, len);
                let want = (size.saturating_sub(off) as usize).min(len);
                if got.len() != want {
                    fx.fail(&format!(
                        "pread off={off} len={len}: got {} bytes, want {want}",
                        got.len()
                    ));
                }
                fx.compare("pread", off, &got);
                fx.bump("pread");
            }
            1 => {
                let off = rand_off(&mut rng, maxlen - 1);
                let len = rand_len(&mut rng).min(maxlen - off);
                let buf = rng.bytes(len as usize);
                fx.note(format!("#{i} pwrite off={off} len={len} (size {size})"));
                if let Err(e) = fx.file.as_ref().unwrap().write_all_at(&buf, off) {
                    fx.fail(&format!("pwrite: {e}"));
                }
                fx.apply_write(off, &buf);
                fx.bump("pwrite");
            }
            2 => {
                let len = match rng.below(4) {
                    0 => rng.range(0, size),
                    1 => size.saturating_sub(rng.range(0, 70_000)),
                    2 => size + rng.range(0, 70_000),
                    _ => rand_off(&mut rng, maxlen),
                }
                .min(maxlen);
                fx.note(format!("#{i} ftruncate {size} -> {len}"));
                if let Err(e) = fx.file.as_ref().unwrap().set_len(len) {
                    fx.fail(&format!("ftruncate: {e}"));
                }
                fx.model.resize(len as usize, 0);
                fx.bump("ftruncate");
            }
            op @ (3 | 4) if size > 0 => {
                let off = rand_off(&mut rng, size - 1);
                let len = rand_len(&mut rng).min(size - off);
                let start = off - off % fx.page;
                let maplen = (off + len - start) as usize;
                let write = op == 4;
                fx.note(format!(
                    "#{i} mmap {} off={off} len={len} (map {start}+{maplen}, size {size})",
                    if write { "write+msync" } else { "read" }
                ));
                let prot = if write {
                    libc::PROT_READ | libc::PROT_WRITE
                } else {
                    libc::PROT_READ
                };
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        maplen,
                        prot,
                        libc::MAP_SHARED,
                        fx.fd(),
                        start as libc::off_t,
                    )
                };
                if p == libc::MAP_FAILED {
                    fx.fail(&format!("mmap: errno {}", errno()));
                }
                let region = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), maplen) };
                let inner = (off - start) as usize..maplen;
                if write {
                    let buf = rng.bytes(len as usize);
                    region[inner].copy_from_slice(&buf);
                    let r = unsafe { libc::msync(p, maplen, libc::MS_SYNC) };
                    let e = errno();
                    unsafe { libc::munmap(p, maplen) };
                    if r != 0 {
                        fx.fail(&format!("msync: errno {e}"));
                    }
                    fx.apply_write(off, &buf);
                    fx.bump("mmap write");
                } else {
                    let got = region[inner].to_vec();
                    unsafe { libc::munmap(p, maplen) };
                    fx.compare("mmap read", off, &got);
                    fx.bump("mmap read");
                }
            }
            op @ (5 | 6) => {
                let keep = op == 6;
                let off = rand_off(&mut rng, maxlen - 1);
                let len = rand_len(&mut rng).min(maxlen - off);
                fx.note(format!(
                    "#{i} fallocate{} off={off} len={len} (size {size})",
                    if keep { " KEEP_SIZE" } else { "" }
                ));
                let mode = if keep { libc::FALLOC_FL_KEEP_SIZE } else { 0 };
                let r = unsafe {
                    libc::fallocate(fx.fd(), mode, off as libc::off_t, len as libc::off_t)
                };
                if r != 0 {
                    fx.fail(&format!("fallocate: errno {}", errno()));
                }
                if !keep && off + len > size {
                    fx.model.resize((off + len) as usize, 0);
                }
                fx.bump(if keep { "fallocate keep" } else { "fallocate" });
            }
            7 => {
                fx.note(format!("#{i} fsync"));
                if let Err(e) = fx.file.as_ref().unwrap().sync_all() {
                    fx.fail(&format!("fsync: {e}"));
                }
                fx.bump("fsync");
            }
            9 => {
                fx.note(format!("#{i} unmount + remount (size {size})"));
                fx.remount();
                fx.check_all("after remount");
                fx.bump("remount");
            }
            // close + reopen (also the mmap ops on an empty file)
            _ => {
                let http = rng.chance(1, 3);
                fx.note(format!(
                    "#{i} close + reopen{} (size {size})",
                    if http { ", HTTP GET" } else { "" }
                ));
                fx.close();
                if http {
                    fx.check_http("after close");
                }
                fx.open();
                fx.check_all("after reopen");
                fx.bump("close+reopen");
            }
        }
        if i + 1 == sabotage {
            // self-check of the checker: a model that is wrong by one byte must be caught
            if fx.model.is_empty() {
                fx.model.push(0);
            }
            let at = rng.below(fx.model.len() as u64) as usize;
            fx.model[at] ^= 0x5a;
            fx.note(format!("#{i} SABOTAGE: model byte {at} flipped"));
            fx.check_all("after sabotage (this must fail)");
        }
        fx.check_size("after the operation");
        if (i + 1) % 250 == 0 {
            fx.check_all("periodic full read");
        }
        if (i + 1) % 10_000 == 0 {
            eprintln!("{} ops in {:?}", i + 1, started.elapsed());
        }
    }
    // the end state, through a fresh mount and through HTTP
    fx.note("end: unmount + remount".into());
    fx.remount();
    fx.check_all("final, after remount");
    fx.check_http("final");
    eprintln!(
        "fsx seed {seed}: {ops} operations in {:?}, final size {}; {:?}",
        started.elapsed(),
        fx.model.len(),
        fx.counts
    );
    fx.close();
    drop(fx.mount.take());
}
