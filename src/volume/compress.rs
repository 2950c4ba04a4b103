//! Per-chunk compression decision and gzip helpers.
//!
//! Writers sniff a mime type from the data (a small subset of Go's `http.DetectContentType`:
//! enough to tell text from the common binary formats) and gzip text; data of unknown type
//! larger than 16 KiB is gzip'ed when its first 128 bytes shrink below 90 %. The compressed
//! form is kept only if it is smaller.

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::{Read, Write};

/// Largest clear needle we inflate; protects against gzip bombs from a broken server.
pub const MAX_INFLATED: u64 = 1 << 30;

/// Sniffed content type, `None` for "unknown binary" (`application/octet-stream`).
pub fn detect_mime(data: &[u8]) -> Option<&'static str> {
    const SIGS: &[(&[u8], &str)] = &[
        (b"%PDF-", "application/pdf"),
        (b"%!PS-Adobe-", "application/postscript"),
        (b"\xFE\xFF", "text/plain; charset=utf-16be"),
        (b"\xFF\xFE", "text/plain; charset=utf-16le"),
        (b"\xEF\xBB\xBF", "text/plain; charset=utf-8"),
        (b"GIF87a", "image/gif"),
        (b"GIF89a", "image/gif"),
        (b"\x89PNG\x0D\x0A\x1A\x0A", "image/png"),
        (b"\xFF\xD8\xFF", "image/jpeg"),
        (b"BM", "image/bmp"),
        (b"OggS\x00", "application/ogg"),
        (b"ID3", "audio/mpeg"),
        (b"\x1A\x45\xDF\xA3", "video/webm"),
        (b"wOFF", "font/woff"),
        (b"wOF2", "font/woff2"),
        (b"\x1F\x8B\x08", "application/x-gzip"),
        (b"PK\x03\x04", "application/zip"),
        (b"Rar!\x1A\x07", "application/x-rar-compressed"),
        (b"\x00asm", "application/wasm"),
    ];
    for (sig, mime) in SIGS {
        if data.starts_with(sig) {
            return Some(mime);
        }
    }
    if data.len() >= 12 && &data[..4] == b"RIFF" {
        match &data[8..12] {
            b"WAVE" => return Some("audio/wave"),
            b"WEBP" => return Some("image/webp"),
            b"AVI " => return Some("video/avi"),
            _ => {}
        }
    }
    if data.len() >= 12 && &data[4..8] == b"ftyp" {
        return Some("video/mp4");
    }
    // Text: no control bytes other than whitespace/ESC in the first 512 bytes.
    let head = &data[..data.len().min(512)];
    let binary = head.iter().any(|&b| {
        b <= 0x08 || b == 0x0B || (0x0E..=0x1A).contains(&b) || (0x1C..=0x1F).contains(&b)
    });
    if binary {
        None
    } else {
        Some("text/plain; charset=utf-8")
    }
}

/// Whether a writer should try to gzip `data` whose sniffed type is `mime`.
pub fn should_gzip(data: &[u8], mime: Option<&str>) -> bool {
    match mime {
        Some(m) if m.starts_with("text/") => true,
        Some(m) => {
            matches!(m, "audio/wave" | "audio/wav" | "audio/x-wav")
                || m.ends_with("xml")
                || m.ends_with("script")
        }
        None if data.len() > 16 * 1024 => gzip(&data[..128]).len() * 10 < 128 * 9,
        None => false,
    }
}

/// The gzip'ed form of `data` if compression is worthwhile and it actually got smaller.
pub fn maybe_gzip(data: &[u8], mime: Option<&str>) -> Option<Vec<u8>> {
    if !should_gzip(data, mime) {
        return None;
    }
    let z = gzip(data);
    (z.len() < data.len()).then_some(z)
}

/// gzip at the fast level (what SeaweedFS writers use).
pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::with_capacity(data.len() / 2 + 64), Compression::fast());
    // Writing to a Vec cannot fail.
    let _ = enc.write_all(data);
    enc.finish().unwrap_or_default()
}

/// Inflates gzip data (multi-member streams too), refusing more than [`MAX_INFLATED`] bytes.
pub fn gunzip(data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(data.len().saturating_mul(3).min(64 << 20));
    let mut dec = MultiGzDecoder::new(data).take(MAX_INFLATED + 1);
    dec.read_to_end(&mut out)
        .map_err(|e| format!("gunzip: {e}"))?;
    if out.len() as u64 > MAX_INFLATED {
        return Err(format!("gunzip: more than {MAX_INFLATED} bytes"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_text_and_binary() {
        assert_eq!(
            detect_mime(b"hello world\n"),
            Some("text/plain; charset=utf-8")
        );
        assert_eq!(detect_mime(b""), Some("text/plain; charset=utf-8"));
        assert_eq!(detect_mime(b"\x89PNG\r\n\x1a\n...."), Some("image/png"));
        assert_eq!(detect_mime(&gzip(b"abc")), Some("application/x-gzip"));
        assert_eq!(detect_mime(b"RIFF\0\0\0\0WAVEfmt "), Some("audio/wave"));
        assert_eq!(detect_mime(&[0u8, 1, 2, 3]), None);
    }

    #[test]
    fn compression_decision() {
        let text = "the quick brown fox jumps over the lazy dog\n".repeat(100);
        let z = maybe_gzip(text.as_bytes(), detect_mime(text.as_bytes())).unwrap();
        assert!(z.len() < text.len());
        assert_eq!(gunzip(&z).unwrap(), text.as_bytes());
        // Tiny text does not shrink: kept clear.
        assert!(maybe_gzip(b"a", Some("text/plain")).is_none());
        // Random bytes of unknown type are not compressed.
        let mut rnd = vec![0u8; 64 * 1024];
        rand::fill(&mut rnd[..]);
        rnd[0] = 0;
        assert!(detect_mime(&rnd).is_none());
        assert!(maybe_gzip(&rnd, None).is_none());
        // Large zero-filled binary of unknown type compresses.
        let zeros = vec![0u8; 20 * 1024];
        assert!(maybe_gzip(&zeros, detect_mime(&zeros)).is_some());
        // Small unknown binary: not even tried.
        assert!(!should_gzip(&[0u8; 100], None));
        assert!(!should_gzip(b"x", Some("image/png")));
    }

    #[test]
    fn gunzip_rejects_garbage_and_reads_multi_member() {
        assert!(gunzip(b"not gzip at all").is_err());
        let mut z = gzip(b"abc");
        z.truncate(z.len() - 5);
        assert!(gunzip(&z).is_err());
        let mut two = gzip(b"abc");
        two.extend(gzip(b"def"));
        assert_eq!(gunzip(&two).unwrap(), b"abcdef");
    }
}
