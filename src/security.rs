//! `security.toml` and `WEED_*` environment settings, read the way SeaweedFS reads them:
//! `./security.toml`, `~/.seaweedfs/security.toml`, `/etc/seaweedfs/security.toml` (first found);
//! an env var `WEED_GRPC_CLIENT_CERT` overrides key `grpc.client.cert`, and so on.
//!
//! Also builds the rustls client configs: gRPC mTLS to the filer (chain checked against the CA,
//! host name NOT checked, as SeaweedFS does) and the optional HTTPS client for volume servers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// File name looked up in the search directories.
pub const SECURITY_FILE: &str = "security.toml";

/// Errors reading security settings or building TLS configs from them.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parse {what}: {msg}")]
    Parse { what: String, msg: String },
    #[error("invalid setting {key}: {msg}")]
    Invalid { key: String, msg: String },
    #[error("tls: {0}")]
    Tls(String),
}

/// Security settings the client needs. `Debug` redacts the JWT keys.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecurityConfig {
    /// `[grpc] ca`: CA for filer gRPC mTLS.
    pub grpc_ca: Option<PathBuf>,
    /// `[grpc.client] cert`
    pub grpc_client_cert: Option<PathBuf>,
    /// `[grpc.client] key`
    pub grpc_client_key: Option<PathBuf>,
    /// `[jwt.signing.read] key`: we mint read JWTs with it.
    pub jwt_read_key: Option<String>,
    /// `[jwt.signing.read] expires_after_seconds` (0 = no exp claim).
    pub jwt_read_expires_secs: u64,
    /// `[jwt.filer_signing] key` (filer HTTP writes).
    pub jwt_filer_key: Option<String>,
    /// `[jwt.signing] key`: volume-server writes. Uploads get their token from AssignVolume;
    /// with this key we can also delete chunks we uploaded but never committed.
    pub jwt_write_key: Option<String>,
    /// `[https.client] enabled`
    pub https_client_enabled: bool,
    pub https_ca: Option<PathBuf>,
    pub https_cert: Option<PathBuf>,
    pub https_key: Option<PathBuf>,
    pub https_insecure_skip_verify: bool,
}

impl std::fmt::Debug for SecurityConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |k: &Option<String>| k.as_ref().map(|_| "<redacted>");
        f.debug_struct("SecurityConfig")
            .field("grpc_ca", &self.grpc_ca)
            .field("grpc_client_cert", &self.grpc_client_cert)
            .field("grpc_client_key", &self.grpc_client_key)
            .field("jwt_read_key", &redact(&self.jwt_read_key))
            .field("jwt_read_expires_secs", &self.jwt_read_expires_secs)
            .field("jwt_filer_key", &redact(&self.jwt_filer_key))
            .field("jwt_write_key", &redact(&self.jwt_write_key))
            .field("https_client_enabled", &self.https_client_enabled)
            .field("https_ca", &self.https_ca)
            .field("https_cert", &self.https_cert)
            .field("https_key", &self.https_key)
            .field(
                "https_insecure_skip_verify",
                &self.https_insecure_skip_verify,
            )
            .finish()
    }
}

/// Every key we read, as written in security.toml (each overridable by [`env_name`]).
pub const SETTING_KEYS: &[&str] = &[
    "grpc.ca",
    "grpc.client.cert",
    "grpc.client.key",
    "jwt.signing.read.key",
    "jwt.signing.read.expires_after_seconds",
    "jwt.filer_signing.key",
    "jwt.signing.key",
    "https.client.enabled",
    "https.client.ca",
    "https.client.cert",
    "https.client.key",
    "https.client.insecure_skip_verify",
];

/// The env var overriding a key: `grpc.client.cert` -> `WEED_GRPC_CLIENT_CERT`.
pub fn env_name(key: &str) -> String {
    format!("WEED_{}", key.to_ascii_uppercase().replace('.', "_"))
}

/// The directories searched for security.toml, in order.
pub fn default_search_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from(".")];
    if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        dirs.push(Path::new(&home).join(".seaweedfs"));
    }
    dirs.push(PathBuf::from("/etc/seaweedfs"));
    dirs
}

/// A setting value before typing: TOML scalars and env strings both end up here.
enum Raw {
    Str(String),
    Int(i64),
    Bool(bool),
}

impl SecurityConfig {
    /// Reads the first security.toml found in the default directories (none is fine: defaults),
    /// then applies `WEED_*` environment overrides.
    pub fn load() -> Result<Self, SecurityError> {
        Self::load_from(&default_search_dirs(), |k| std::env::var(k).ok())
    }

    /// [`Self::load`] with explicit search directories and env lookup (for tests).
    pub fn load_from(
        dirs: &[PathBuf],
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, SecurityError> {
        let mut table = toml::Table::new();
        for d in dirs {
            let p = d.join(SECURITY_FILE);
            match std::fs::read_to_string(&p) {
                Ok(text) => {
                    table = parse_table(&text, &p.display().to_string())?;
                    tracing::info!(path = %p.display(), "loaded security settings");
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    // e.g. the working directory is a dead mount: not a reason to fail
                    tracing::warn!(path = %p.display(), error = %e, "cannot read security.toml candidate; skipping");
                    continue;
                }
            }
        }
        Self::from_table(&table, env)
    }

    /// Parses security.toml text, without environment overrides.
    pub fn from_toml_str(text: &str) -> Result<Self, SecurityError> {
        let table = parse_table(text, "security.toml")?;
        Self::from_table(&table, |_| None)
    }

    /// Parses security.toml text, then applies overrides from `env` (e.g. `std::env::var`).
    pub fn from_toml_str_with_env(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, SecurityError> {
        let table = parse_table(text, "security.toml")?;
        Self::from_table(&table, env)
    }

    fn from_table(
        table: &toml::Table,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, SecurityError> {
        let get = |key: &str| -> Option<Raw> {
            if let Some(v) = env(&env_name(key)) {
                return Some(Raw::Str(v));
            }
            let mut cur: Option<&toml::Value> = None;
            for (i, part) in key.split('.').enumerate() {
                cur = if i == 0 {
                    table.get(part)
                } else {
                    cur?.as_table()?.get(part)
                };
            }
            match cur? {
                toml::Value::String(s) => Some(Raw::Str(s.clone())),
                toml::Value::Integer(n) => Some(Raw::Int(*n)),
                toml::Value::Boolean(b) => Some(Raw::Bool(*b)),
                _ => None,
            }
        };
        let string = |key: &str| -> Result<Option<String>, SecurityError> {
            Ok(match get(key) {
                None => None,
                Some(Raw::Str(s)) => Some(s.trim().to_string()).filter(|s| !s.is_empty()),
                Some(Raw::Int(n)) => Some(n.to_string()),
                Some(Raw::Bool(_)) => {
                    return Err(SecurityError::Invalid {
                        key: key.into(),
                        msg: "expected a string".into(),
                    })
                }
            })
        };
        let path = |key: &str| -> Result<Option<PathBuf>, SecurityError> {
            Ok(string(key)?.map(PathBuf::from))
        };
        let boolean = |key: &str| -> Result<bool, SecurityError> {
            Ok(match get(key) {
                None => false,
                Some(Raw::Bool(b)) => b,
                Some(Raw::Int(n)) => n != 0,
                Some(Raw::Str(s)) => match s.trim().to_ascii_lowercase().as_str() {
                    "" | "0" | "false" | "f" | "no" | "off" => false,
                    "1" | "true" | "t" | "yes" | "on" => true,
                    other => {
                        return Err(SecurityError::Invalid {
                            key: key.into(),
                            msg: format!("expected a boolean, got {other:?}"),
                        })
                    }
                },
            })
        };
        let uint = |key: &str| -> Result<u64, SecurityError> {
            match get(key) {
                None => Ok(0),
                Some(Raw::Int(n)) if n >= 0 => Ok(n as u64),
                Some(Raw::Str(s)) if s.trim().is_empty() => Ok(0),
                Some(Raw::Str(s)) => s.trim().parse().map_err(|_| SecurityError::Invalid {
                    key: key.into(),
                    msg: format!("expected a non-negative integer, got {s:?}"),
                }),
                _ => Err(SecurityError::Invalid {
                    key: key.into(),
                    msg: "expected a non-negative integer".into(),
                }),
            }
        };
        Ok(SecurityConfig {
            grpc_ca: path("grpc.ca")?,
            grpc_client_cert: path("grpc.client.cert")?,
            grpc_client_key: path("grpc.client.key")?,
            jwt_read_key: string("jwt.signing.read.key")?,
            jwt_read_expires_secs: uint("jwt.signing.read.expires_after_seconds")?,
            jwt_filer_key: string("jwt.filer_signing.key")?,
            jwt_write_key: string("jwt.signing.key")?,
            https_client_enabled: boolean("https.client.enabled")?,
            https_ca: path("https.client.ca")?,
            https_cert: path("https.client.cert")?,
            https_key: path("https.client.key")?,
            https_insecure_skip_verify: boolean("https.client.insecure_skip_verify")?,
        })
    }

    /// True when filer gRPC must use mTLS (`[grpc] ca` plus `[grpc.client] cert` and `key`).
    /// Like SeaweedFS, a partial setting means plaintext.
    pub fn grpc_tls_enabled(&self) -> bool {
        self.grpc_ca.is_some() && self.grpc_client_cert.is_some() && self.grpc_client_key.is_some()
    }

    /// rustls config for filer gRPC: mTLS with our client cert, server chain verified against
    /// `[grpc] ca` but host name not checked, ALPN `h2`. `None` when mTLS is not configured.
    pub fn grpc_client_tls_config(
        &self,
    ) -> Result<Option<Arc<rustls::ClientConfig>>, SecurityError> {
        if !self.grpc_tls_enabled() {
            return Ok(None);
        }
        let (Some(ca), Some(cert), Some(key)) =
            (&self.grpc_ca, &self.grpc_client_cert, &self.grpc_client_key)
        else {
            return Ok(None);
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = load_roots(ca)?;
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| SecurityError::Tls(format!("CA {}: {e}", ca.display())))?;
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| SecurityError::Tls(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoHostnameVerifier { inner }))
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|e| SecurityError::Tls(format!("client cert {}: {e}", cert.display())))?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Some(Arc::new(cfg)))
    }

    /// rustls config for HTTPS to volume servers/filer (`[https.client]`), `None` unless enabled.
    /// Host names are verified unless `insecure_skip_verify`; the client cert is optional.
    pub fn https_client_tls_config(
        &self,
    ) -> Result<Option<Arc<rustls::ClientConfig>>, SecurityError> {
        if !self.https_client_enabled {
            return Ok(None);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| SecurityError::Tls(e.to_string()))?;
        let builder = if self.https_insecure_skip_verify {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAnyVerifier { provider }))
        } else {
            let Some(ca) = &self.https_ca else {
                return Err(SecurityError::Invalid {
                    key: "https.client.ca".into(),
                    msg: "required when https.client.enabled (or set insecure_skip_verify)".into(),
                });
            };
            builder.with_root_certificates(load_roots(ca)?)
        };
        let cfg = match (&self.https_cert, &self.https_key) {
            (Some(c), Some(k)) => builder
                .with_client_auth_cert(load_certs(c)?, load_key(k)?)
                .map_err(|e| SecurityError::Tls(format!("client cert {}: {e}", c.display())))?,
            _ => builder.with_no_client_auth(),
        };
        Ok(Some(Arc::new(cfg)))
    }
}

fn parse_table(text: &str, what: &str) -> Result<toml::Table, SecurityError> {
    text.parse::<toml::Table>()
        .map_err(|e| SecurityError::Parse {
            what: what.into(),
            msg: e.to_string(),
        })
}

fn read(path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|e| SecurityError::Read {
        path: path.to_path_buf(),
        source: e,
    })
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, SecurityError> {
    let data = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&data)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SecurityError::Tls(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(SecurityError::Tls(format!(
            "{}: no PEM certificate found",
            path.display()
        )));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, SecurityError> {
    let data = read(path)?;
    PrivateKeyDer::from_pem_slice(&data).map_err(|e| match e {
        pem::Error::NoItemsFound => {
            SecurityError::Tls(format!("{}: no PEM private key found", path.display()))
        }
        e => SecurityError::Tls(format!("{}: {e}", path.display())),
    })
}

fn load_roots(path: &Path) -> Result<RootCertStore, SecurityError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots
            .add(c)
            .map_err(|e| SecurityError::Tls(format!("CA {}: {e}", path.display())))?;
    }
    Ok(roots)
}

/// Verifies the chain against the CA like WebPKI, but accepts any host name: SeaweedFS
/// certificates are issued per component, not per address, and Go's weed does not check names.
#[derive(Debug)]
struct NoHostnameVerifier {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for NoHostnameVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // WebPKI checks the chain first and the name last, so a name error means the chain passed.
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Ok(v) => Ok(v),
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            Err(e) => Err(e),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// `insecure_skip_verify`: accepts any certificate but still checks handshake signatures.
#[derive(Debug)]
struct AcceptAnyVerifier {
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for AcceptAnyVerifier {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const SAMPLE: &str = r#"
[jwt.signing]
key = "write-secret"
[jwt.signing.read]
key = "read-secret"
expires_after_seconds = 15
[jwt.filer_signing]
key = "filer-secret"
[grpc]
ca = "/certs/ca.crt"
[grpc.client]
cert = "/certs/client.crt"
key = "/certs/client.key"
[https.client]
enabled = true
insecure_skip_verify = false
"#;

    #[test]
    fn parses_keys() {
        let c = SecurityConfig::from_toml_str(SAMPLE).unwrap();
        assert_eq!(c.grpc_ca.as_deref(), Some(Path::new("/certs/ca.crt")));
        assert_eq!(
            c.grpc_client_cert.as_deref(),
            Some(Path::new("/certs/client.crt"))
        );
        assert_eq!(
            c.grpc_client_key.as_deref(),
            Some(Path::new("/certs/client.key"))
        );
        assert_eq!(c.jwt_read_key.as_deref(), Some("read-secret"));
        assert_eq!(c.jwt_read_expires_secs, 15);
        assert_eq!(c.jwt_filer_key.as_deref(), Some("filer-secret"));
        assert!(c.https_client_enabled);
        assert!(!c.https_insecure_skip_verify);
        assert!(c.grpc_tls_enabled());
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("read-secret") && !dbg.contains("filer-secret"),
            "{dbg}"
        );
    }

    #[test]
    fn empty_is_default() {
        assert_eq!(
            SecurityConfig::from_toml_str("").unwrap(),
            SecurityConfig::default()
        );
        // empty strings (as in SeaweedFS's scaffold) mean "unset"
        let c =
            SecurityConfig::from_toml_str("[grpc]\nca = \"\"\n[jwt.signing.read]\nkey = \"\"\n")
                .unwrap();
        assert_eq!(c, SecurityConfig::default());
        assert!(!c.grpc_tls_enabled());
    }

    #[test]
    fn env_overrides_file() {
        assert_eq!(env_name("grpc.client.cert"), "WEED_GRPC_CLIENT_CERT");
        // every key honours its env var
        for key in SETTING_KEYS {
            let name = env_name(key);
            let val = if key.contains("enabled") || key.contains("skip") {
                "true"
            } else if key.contains("seconds") {
                "7"
            } else {
                "v"
            };
            let c = SecurityConfig::from_toml_str_with_env("", |k| {
                (k == name).then(|| val.to_string())
            })
            .unwrap();
            assert_ne!(c, SecurityConfig::default(), "{name} ignored");
        }
        assert_eq!(
            env_name("jwt.signing.read.expires_after_seconds"),
            "WEED_JWT_SIGNING_READ_EXPIRES_AFTER_SECONDS"
        );
        let env: HashMap<&str, &str> = [
            ("WEED_GRPC_CA", "/env/ca"),
            ("WEED_JWT_SIGNING_READ_KEY", "env-read"),
            ("WEED_JWT_SIGNING_READ_EXPIRES_AFTER_SECONDS", "60"),
            ("WEED_HTTPS_CLIENT_ENABLED", "false"),
            ("WEED_HTTPS_CLIENT_INSECURE_SKIP_VERIFY", "true"),
            ("WEED_JWT_FILER_SIGNING_KEY", "env-filer"),
        ]
        .into_iter()
        .collect();
        let c =
            SecurityConfig::from_toml_str_with_env(SAMPLE, |k| env.get(k).map(|v| v.to_string()))
                .unwrap();
        assert_eq!(c.grpc_ca.as_deref(), Some(Path::new("/env/ca")));
        assert_eq!(
            c.grpc_client_cert.as_deref(),
            Some(Path::new("/certs/client.crt"))
        );
        assert_eq!(c.jwt_read_key.as_deref(), Some("env-read"));
        assert_eq!(c.jwt_read_expires_secs, 60);
        assert_eq!(c.jwt_filer_key.as_deref(), Some("env-filer"));
        assert!(!c.https_client_enabled);
        assert!(c.https_insecure_skip_verify);
    }

    #[test]
    fn rejects_bad_values() {
        assert!(
            SecurityConfig::from_toml_str("[jwt.signing.read]\nexpires_after_seconds = -1")
                .is_err()
        );
        assert!(SecurityConfig::from_toml_str("[https.client]\nenabled = \"maybe\"").is_err());
        assert!(SecurityConfig::from_toml_str("not toml [").is_err());
        let env = |k: &str| {
            (k == "WEED_JWT_SIGNING_READ_EXPIRES_AFTER_SECONDS").then(|| "ten".to_string())
        };
        assert!(SecurityConfig::from_toml_str_with_env("", env).is_err());
    }

    #[test]
    fn load_takes_first_found_file() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let c = tempfile::tempdir().unwrap();
        std::fs::write(
            b.path().join(SECURITY_FILE),
            "[jwt.signing.read]\nkey = \"from-b\"\n",
        )
        .unwrap();
        std::fs::write(
            c.path().join(SECURITY_FILE),
            "[jwt.signing.read]\nkey = \"from-c\"\n",
        )
        .unwrap();
        let dirs = [
            a.path().to_path_buf(),
            b.path().to_path_buf(),
            c.path().to_path_buf(),
        ];
        let cfg = SecurityConfig::load_from(&dirs, |_| None).unwrap();
        assert_eq!(cfg.jwt_read_key.as_deref(), Some("from-b"));
        // no file anywhere: defaults plus env
        let cfg = SecurityConfig::load_from(&dirs[..1], |k| {
            (k == "WEED_JWT_SIGNING_READ_KEY").then(|| "from-env".to_string())
        })
        .unwrap();
        assert_eq!(cfg.jwt_read_key.as_deref(), Some("from-env"));
        // a broken file is an error, not silently ignored
        std::fs::write(a.path().join(SECURITY_FILE), "[[[").unwrap();
        assert!(SecurityConfig::load_from(&dirs, |_| None).is_err());
    }

    #[test]
    fn pem_files_load_certs_and_keys() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["a.invalid".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let crt = dir.path().join("a.crt");
        let k = dir.path().join("a.key");
        // two certificates in one file (a chain), with text around them
        std::fs::write(&crt, format!("junk\n{}\n{}", cert.pem(), cert.pem())).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        assert_eq!(load_certs(&crt).unwrap().len(), 2);
        assert!(load_key(&k).is_ok());
        // a certificate file has no private key; a key file has no certificate
        let e = load_key(&crt).unwrap_err().to_string();
        assert!(e.contains("no PEM private key found"), "{e}");
        let e = load_certs(&k).unwrap_err().to_string();
        assert!(e.contains("no PEM certificate found"), "{e}");
        // a broken PEM section is an error naming the file
        let bad = dir.path().join("bad.crt");
        std::fs::write(&bad, "-----BEGIN CERTIFICATE-----\n!!!\n").unwrap();
        let e = load_certs(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.crt"), "{e}");
        assert!(load_roots(&crt).is_ok());
    }

    #[test]
    fn tls_configs_need_settings_and_files() {
        let c = SecurityConfig::default();
        assert!(c.grpc_client_tls_config().unwrap().is_none());
        assert!(c.https_client_tls_config().unwrap().is_none());
        let c = SecurityConfig::from_toml_str(SAMPLE).unwrap();
        // files do not exist: a clear error, no panic
        let e = c.grpc_client_tls_config().unwrap_err();
        assert!(e.to_string().contains("/certs/ca.crt"), "{e}");
        // https enabled without CA and without skip-verify is a configuration error
        assert!(c.https_client_tls_config().is_err());
        let skip = SecurityConfig {
            https_client_enabled: true,
            https_insecure_skip_verify: true,
            ..Default::default()
        };
        assert!(skip.https_client_tls_config().unwrap().is_some());
    }
}
