//! File ids: `"<volume id>,<key hex><cookie 8 hex>"` and the `FileId` protobuf message.
//!
//! The key is the 8-byte big-endian needle id hex-encoded after dropping leading zero *bytes*;
//! the cookie is always 8 hex digits. A `_N` suffix (multi-count assigns) adds N to the key.

use super::{Result, VolumeError};
use crate::pb::filer as pb;
use std::fmt;

/// A parsed file id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    pub volume_id: u32,
    pub key: u64,
    pub cookie: u32,
}

impl FileId {
    /// Parses `"2,013728e3cc"` (optionally with a `_N` delta suffix). Never panics.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || VolumeError::InvalidFileId(s.to_string());
        let (vid, rest) = s.split_once(',').ok_or_else(bad)?;
        if vid.is_empty() || !vid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let volume_id: u32 = vid.parse().map_err(|_| bad())?;
        let (key_cookie, delta) = match rest.rsplit_once('_') {
            Some((kc, d)) => {
                if d.is_empty() || !d.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                (kc, Some(d.parse::<u64>().map_err(|_| bad())?))
            }
            None => (rest, None),
        };
        // At least one key digit (the volume server rejects `<= 8` hex chars), at most 16.
        if key_cookie.len() <= 8
            || key_cookie.len() > 24
            || !key_cookie.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err(bad());
        }
        let split = key_cookie.len() - 8;
        let mut key = u64::from_str_radix(&key_cookie[..split], 16).map_err(|_| bad())?;
        let cookie = u32::from_str_radix(&key_cookie[split..], 16).map_err(|_| bad())?;
        if let Some(d) = delta {
            key = key.checked_add(d).ok_or_else(bad)?;
        }
        Ok(FileId {
            volume_id,
            key,
            cookie,
        })
    }

    pub fn from_pb(f: &pb::FileId) -> Self {
        FileId {
            volume_id: f.volume_id,
            key: f.file_key,
            cookie: f.cookie,
        }
    }

    pub fn to_pb(self) -> pb::FileId {
        pb::FileId {
            volume_id: self.volume_id,
            file_key: self.key,
            cookie: self.cookie,
        }
    }
}

impl fmt::Display for FileId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut bytes = [0u8; 12];
        bytes[..8].copy_from_slice(&self.key.to_be_bytes());
        bytes[8..].copy_from_slice(&self.cookie.to_be_bytes());
        let first = bytes[..8].iter().position(|b| *b != 0).unwrap_or(8);
        write!(f, "{},{}", self.volume_id, hex::encode(&bytes[first..]))
    }
}

impl std::str::FromStr for FileId {
    type Err = VolumeError;
    fn from_str(s: &str) -> Result<Self> {
        FileId::parse(s)
    }
}

/// The chunk's id: `file_id` if set, else built from the `fid` message.
pub fn chunk_file_id(chunk: &pb::FileChunk) -> Result<String> {
    if !chunk.file_id.is_empty() {
        return Ok(chunk.file_id.clone());
    }
    match &chunk.fid {
        Some(f) if f.volume_id != 0 => Ok(FileId::from_pb(f).to_string()),
        _ => Err(VolumeError::InvalidFileId(String::new())),
    }
}

/// The chunks' ids as the filer compares them in a `WriteCondition` (its
/// `GetFileIdString`: "" for a chunk with neither form).
pub fn chunk_file_ids(chunks: &[pb::FileChunk]) -> Vec<String> {
    chunks
        .iter()
        .map(|c| chunk_file_id(c).unwrap_or_default())
        .collect()
}

/// The chunk's parsed id (from `file_id`, else `fid`).
pub fn chunk_fid(chunk: &pb::FileChunk) -> Result<FileId> {
    if !chunk.file_id.is_empty() {
        return FileId::parse(&chunk.file_id);
    }
    match &chunk.fid {
        Some(f) if f.volume_id != 0 => Ok(FileId::from_pb(f)),
        _ => Err(VolumeError::InvalidFileId(String::new())),
    }
}

/// Fills `file_id` from `fid` (and `fid` from `file_id`) where one is missing, as the filer
/// stores only `fid` inside manifests.
pub fn normalize_chunk_ids(chunk: &mut pb::FileChunk) {
    if chunk.file_id.is_empty() {
        if let Some(f) = &chunk.fid {
            if f.volume_id != 0 {
                chunk.file_id = FileId::from_pb(f).to_string();
            }
        }
    } else if chunk.fid.is_none() {
        if let Ok(f) = FileId::parse(&chunk.file_id) {
            chunk.fid = Some(f.to_pb());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_doc_example() {
        let f = FileId::parse("2,013728e3cc").unwrap();
        assert_eq!(
            f,
            FileId {
                volume_id: 2,
                key: 1,
                cookie: 0x3728e3cc
            }
        );
        assert_eq!(f.cookie, 925426636);
        assert_eq!(f.to_string(), "2,013728e3cc");
    }

    #[test]
    fn formats_without_leading_zero_bytes() {
        let f = FileId {
            volume_id: 7,
            key: 0x0102,
            cookie: 1,
        };
        assert_eq!(f.to_string(), "7,010200000001");
        let f = FileId {
            volume_id: 3,
            key: u64::MAX,
            cookie: 0xdeadbeef,
        };
        assert_eq!(f.to_string(), "3,ffffffffffffffffdeadbeef");
        assert_eq!(FileId::parse(&f.to_string()).unwrap(), f);
        // A key byte with a leading zero nibble keeps it ("0a", not "a").
        let f = FileId {
            volume_id: 1,
            key: 0x0a,
            cookie: 0,
        };
        assert_eq!(f.to_string(), "1,0a00000000");
    }

    #[test]
    fn odd_length_key_and_delta_suffix() {
        assert_eq!(FileId::parse("5,a12345678").unwrap().key, 0xa);
        let f = FileId::parse("3,01637037d6_2").unwrap();
        assert_eq!(
            f,
            FileId {
                volume_id: 3,
                key: 3,
                cookie: 0x637037d6
            }
        );
        assert_eq!(f.to_string(), "3,03637037d6");
    }

    #[test]
    fn bad_inputs_are_errors() {
        for s in [
            "",
            ",",
            "2",
            "2,",
            ",013728e3cc",
            "x,013728e3cc",
            "-1,013728e3cc",
            "2,3728e3cc",
            "2,zz3728e3cc",
            "99999999999,013728e3cc",
            "2,00000000000000000000000001",
            "2,013728e3cc_",
            "2,013728e3cc_x",
            "2,ffffffffffffffff3728e3cc_1",
            "2,01 3728e3cc",
            "2,é13728e3cc",
        ] {
            assert!(
                matches!(FileId::parse(s), Err(VolumeError::InvalidFileId(_))),
                "{s:?} should fail"
            );
        }
    }

    #[test]
    fn chunk_id_from_file_id_or_fid() {
        let mut c = pb::FileChunk {
            fid: Some(pb::FileId {
                volume_id: 2,
                file_key: 1,
                cookie: 0x3728e3cc,
            }),
            ..Default::default()
        };
        assert_eq!(chunk_file_id(&c).unwrap(), "2,013728e3cc");
        assert_eq!(chunk_fid(&c).unwrap().key, 1);
        normalize_chunk_ids(&mut c);
        assert_eq!(c.file_id, "2,013728e3cc");
        let mut d = pb::FileChunk {
            file_id: "4,0a00000001".into(),
            ..Default::default()
        };
        assert_eq!(chunk_file_id(&d).unwrap(), "4,0a00000001");
        normalize_chunk_ids(&mut d);
        assert_eq!(d.fid.unwrap().file_key, 10);
        assert!(chunk_file_id(&pb::FileChunk::default()).is_err());
        assert!(chunk_fid(&pb::FileChunk {
            file_id: "nope".into(),
            ..Default::default()
        })
        .is_err());
    }
}
