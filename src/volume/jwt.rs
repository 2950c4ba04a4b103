//! Read JWTs for volume servers: HS256 over `{"fid": ..., "exp": ...}`, minted by the client from
//! `[jwt.signing.read] key` (write JWTs come ready-made from AssignVolume).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

const HEADER: &str = r#"{"alg":"HS256","typ":"JWT"}"#;

/// Mints the token for `fid`. `expires_secs == 0` leaves out `exp` (the server then accepts it forever).
pub fn mint_read_jwt(key: &[u8], fid: &str, expires_secs: u64, now_unix: u64) -> String {
    // Written by hand so the claim order is fixed (fid, exp); the fid is JSON-escaped.
    let fid_json = serde_json::Value::from(fid).to_string();
    let claims = if expires_secs == 0 {
        format!(r#"{{"fid":{fid_json}}}"#)
    } else {
        format!(
            r#"{{"fid":{fid_json},"exp":{}}}"#,
            now_unix.saturating_add(expires_secs)
        )
    };
    let signing_input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(HEADER),
        URL_SAFE_NO_PAD.encode(claims.as_bytes())
    );
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("hmac takes any key length");
    mac.update(signing_input.as_bytes());
    let sig = mac.finalize().into_bytes();
    format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(sig))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors computed independently with Python's hmac/hashlib/base64.
    #[test]
    fn matches_reference_vectors() {
        assert_eq!(
            mint_read_jwt(b"readsecret", "2,013728e3cc", 10, 1_700_000_000),
            "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJmaWQiOiIyLDAxMzcyOGUzY2MiLCJleHAiOjE3MDAwMDAwMTB9.7AgSBmzUQSEzPjs3NAKWjrJfGf-AY_QN09i0XLgXFpQ"
        );
        assert_eq!(
            mint_read_jwt(b"readsecret", "2,013728e3cc", 0, 1_700_000_000),
            "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJmaWQiOiIyLDAxMzcyOGUzY2MifQ.4tLd1NOCC2ipHRZ03xhuxYujJeLKZN2ojOBisNH3jKU"
        );
    }
}
