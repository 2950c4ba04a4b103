//! `security.toml` and `WEED_*` environment settings, read the way SeaweedFS reads them:
//! `./security.toml`, `~/.seaweedfs/security.toml`, `/etc/seaweedfs/security.toml`; an env var
//! `WEED_GRPC_CLIENT_CERT` overrides key `grpc.client.cert`, and so on.

use std::path::PathBuf;

/// Security settings the client needs.
#[derive(Debug, Clone, Default)]
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
    /// `[https.client] enabled`
    pub https_client_enabled: bool,
    pub https_ca: Option<PathBuf>,
    pub https_cert: Option<PathBuf>,
    pub https_key: Option<PathBuf>,
    pub https_insecure_skip_verify: bool,
}
