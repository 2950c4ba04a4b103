//! Helpers for the model-checked tests (`multi_client.rs`, `fsx_model.rs`): a seeded PRNG,
//! run parameters from the environment, a few libc wrappers the other helpers lack, and the
//! filer HTTP API calls (DELETE, a JSON directory listing) not in `common`. Used with
//! `mod common; mod fuse_support; mod model_support;`.
#![allow(dead_code)]

use crate::common::WeedServer;
use crate::fuse_support::{check, cpath, errno};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::Path;
use std::process::Command;

/// splitmix64: tiny, seedable, good enough to pick operations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `num/den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }

    /// Index into `weights` chosen with probability proportional to its weight.
    pub fn weighted(&mut self, weights: &[u64]) -> usize {
        let total: u64 = weights.iter().sum();
        let mut r = self.below(total);
        for (i, w) in weights.iter().enumerate() {
            if r < *w {
                return i;
            }
            r -= w;
        }
        unreachable!()
    }

    /// `len` pseudo-random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// `name` from the environment as a number, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        _ => default,
    }
}

/// A seed from `name` (a number, or `random`), else `default`; printed so failures reproduce.
pub fn seed_from_env(name: &str, default: u64) -> u64 {
    let seed = match std::env::var(name) {
        Ok(v) if v.trim() == "random" => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            (t.as_nanos() as u64 ^ ((std::process::id() as u64) << 32)) % 1_000_000_000
        }
        _ => env_u64(name, default),
    };
    eprintln!("{name}={seed}");
    seed
}

/// The `user.` extended attributes of `p` and their values.
pub fn user_xattrs(p: &Path) -> Result<BTreeMap<String, Vec<u8>>, i32> {
    let c = cpath(p);
    let mut buf = vec![0u8; 64 << 10];
    let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(errno());
    }
    buf.truncate(n as usize);
    let mut out = BTreeMap::new();
    for name in buf.split(|b| *b == 0).filter(|s| !s.is_empty()) {
        let name = String::from_utf8_lossy(name).to_string();
        if !name.starts_with("user.") {
            continue;
        }
        let cn = CString::new(name.clone()).unwrap();
        let mut v = vec![0u8; 64 << 10];
        let got =
            unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        if got < 0 {
            return Err(errno());
        }
        v.truncate(got as usize);
        out.insert(name, v);
    }
    Ok(out)
}

pub fn removexattr(p: &Path, name: &str) -> Result<(), i32> {
    let n = CString::new(name).unwrap();
    check(unsafe { libc::removexattr(cpath(p).as_ptr(), n.as_ptr()) }).map(|_| ())
}

/// utimensat(AT_FDCWD, p, [atime, mtime], 0); a `None` time is `UTIME_NOW`.
pub fn utimens(p: &Path, atime: Option<(i64, i64)>, mtime: Option<(i64, i64)>) -> Result<(), i32> {
    let ts = |t: Option<(i64, i64)>| match t {
        Some((s, ns)) => libc::timespec {
            tv_sec: s,
            tv_nsec: ns,
        },
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
    };
    let times = [ts(atime), ts(mtime)];
    check(unsafe { libc::utimensat(libc::AT_FDCWD, cpath(p).as_ptr(), times.as_ptr(), 0) })
        .map(|_| ())
}

/// DELETE through the filer HTTP API; true on a 2xx answer.
pub fn filer_delete(w: &WeedServer, path: &str) -> bool {
    Command::new("curl")
        .args(["-sS", "-f", "-X", "DELETE"])
        .arg(w.filer_url(path))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// One entry of the filer's JSON directory listing.
#[derive(Debug, Clone)]
pub struct HttpEntry {
    pub name: String,
    pub size: u64,
    /// Permission bits of the entry's mode.
    pub perm: u32,
    pub is_dir: bool,
    /// `user.` xattrs (`extended["xattr-user.…"]`).
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// The filer's listing of directory `dir` (`GET dir/` with `Accept: application/json`).
pub fn filer_list(w: &WeedServer, dir: &str) -> Result<Vec<HttpEntry>, String> {
    use base64::Engine;
    let url = format!("{}/?limit=10000", w.filer_url(dir.trim_end_matches('/')));
    let out = Command::new("curl")
        .args(["-sS", "-f", "-H", "Accept: application/json"])
        .arg(&url)
        .output()
        .map_err(|e| format!("curl: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "GET {url}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("listing of {dir} is not JSON: {e}"))?;
    let mut res = Vec::new();
    for e in v["Entries"].as_array().cloned().unwrap_or_default() {
        let full = e["FullPath"].as_str().unwrap_or_default();
        let name = full.rsplit('/').next().unwrap_or_default().to_string();
        let mode = e["Mode"].as_u64().unwrap_or(0);
        let mut xattrs = BTreeMap::new();
        if let Some(ext) = e["Extended"].as_object() {
            for (k, v) in ext {
                if let Some(x) = k.strip_prefix("xattr-") {
                    if x.starts_with("user.") {
                        let b = base64::engine::general_purpose::STANDARD
                            .decode(v.as_str().unwrap_or_default())
                            .map_err(|e| format!("xattr {k} of {name}: {e}"))?;
                        xattrs.insert(x.to_string(), b);
                    }
                }
            }
        }
        res.push(HttpEntry {
            name,
            size: e["FileSize"].as_u64().unwrap_or(0),
            perm: (mode & 0o777) as u32,
            // Go's os.ModeDir
            is_dir: mode & (1 << 31) != 0,
            xattrs,
        });
    }
    Ok(res)
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A short description of where two byte strings first differ.
pub fn first_difference(want: &[u8], got: &[u8]) -> String {
    let common = want.len().min(got.len());
    match (0..common).find(|&i| want[i] != got[i]) {
        Some(i) => {
            let end = |v: &[u8]| (i + 16).min(v.len());
            format!(
                "first difference at offset {i} (0x{i:x}): want {:02x?} got {:02x?} \
                 (lengths want {} got {})",
                &want[i..end(want)],
                &got[i..end(got)],
                want.len(),
                got.len()
            )
        }
        None if want.len() == got.len() => "identical".into(),
        None => format!(
            "same first {common} bytes; lengths want {} got {}",
            want.len(),
            got.len()
        ),
    }
}
