//! Chunk encryption as the filer's `-encryptVolumeData` does it: AES-GCM with a random per-chunk
//! key, no associated data; the needle body is `nonce(12) || ciphertext || tag(16)`.

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes128Gcm, Aes256Gcm, Nonce};
use rand::Rng;

pub const KEY_LEN: usize = 32;
pub const NONCE_LEN: usize = 12;
pub const TAG_LEN: usize = 16;

/// A fresh random 32-byte key.
pub fn gen_key() -> Vec<u8> {
    let mut k = vec![0u8; KEY_LEN];
    rand::rng().fill_bytes(&mut k);
    k
}

/// Encrypts `plain` with a 32-byte key, returning `nonce || ciphertext || tag`.
pub fn encrypt(plain: &[u8], key: &[u8]) -> Result<Vec<u8>, String> {
    let cipher =
        Aes256Gcm::new_from_slice(key).map_err(|_| format!("bad key length {}", key.len()))?;
    let mut nonce = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut nonce);
    let ct = cipher
        .encrypt(Nonce::from_slice(&nonce), plain)
        .map_err(|_| "encryption failed".to_string())?;
    let mut out = Vec::with_capacity(NONCE_LEN + ct.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&ct);
    Ok(out)
}

/// Decrypts `nonce || ciphertext || tag`. Accepts 32-byte (what writers generate) and 16-byte keys.
/// A wrong key, a short body or a flipped bit is an error (the GCM tag fails), never a panic.
pub fn decrypt(data: &[u8], key: &[u8]) -> Result<Vec<u8>, String> {
    if data.len() < NONCE_LEN + TAG_LEN {
        return Err(format!("encrypted body too short ({} bytes)", data.len()));
    }
    let (nonce, ct) = data.split_at(NONCE_LEN);
    let nonce = Nonce::from_slice(nonce);
    let res = match key.len() {
        32 => Aes256Gcm::new_from_slice(key)
            .map_err(|e| e.to_string())?
            .decrypt(nonce, ct),
        16 => Aes128Gcm::new_from_slice(key)
            .map_err(|e| e.to_string())?
            .decrypt(nonce, ct),
        n => return Err(format!("unsupported cipher key length {n}")),
    };
    res.map_err(|_| "AES-GCM authentication failed (wrong key or corrupt data)".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let key = gen_key();
        assert_eq!(key.len(), 32);
        let data = b"hello encrypted world".to_vec();
        let enc = encrypt(&data, &key).unwrap();
        assert_eq!(enc.len(), NONCE_LEN + data.len() + TAG_LEN);
        assert_eq!(decrypt(&enc, &key).unwrap(), data);
        // Empty plaintext still carries nonce and tag.
        let e = encrypt(b"", &key).unwrap();
        assert_eq!(e.len(), NONCE_LEN + TAG_LEN);
        assert_eq!(decrypt(&e, &key).unwrap(), b"");
    }

    #[test]
    fn tampering_and_wrong_keys_fail() {
        let key = gen_key();
        let mut enc = encrypt(b"some data", &key).unwrap();
        assert!(decrypt(&enc, &gen_key()).is_err());
        assert!(decrypt(&enc[..10], &key).is_err());
        assert!(decrypt(&enc, &key[..5]).is_err());
        assert!(decrypt(&enc, &key[..16]).is_err());
        let last = enc.len() - 1;
        enc[last] ^= 1;
        assert!(decrypt(&enc, &key).is_err());
        assert!(encrypt(b"x", &key[..16]).is_err());
    }
}
