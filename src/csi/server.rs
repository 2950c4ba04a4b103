//! gRPC server for the CSI services on a unix socket (kubelet, sidecars) or TCP.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tonic::codegen::http;
use tonic::transport::Server;
use tower::{Layer, Service};

use super::controller::ControllerService;
use super::identity::IdentityService;
use super::node::NodeService;
use crate::pb::csi::controller_server::ControllerServer;
use crate::pb::csi::identity_server::IdentityServer;
use crate::pb::csi::node_server::NodeServer;

/// How long in-flight RPCs may run after a shutdown signal before the server stops anyway.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid endpoint {0:?}: expected unix:///path/to/socket or tcp://host:port")]
    InvalidEndpoint(String),
    #[error("another process is serving on {0}")]
    InUse(PathBuf),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServeError {
    let context = context.into();
    move |source| ServeError::Io { context, source }
}

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port`.
    Tcp(String),
}

impl std::str::FromStr for Endpoint {
    type Err = ServeError;

    /// `unix:///abs/path`, `unix://relative/path` (read as absolute, like the Go driver's
    /// default `unix://tmp/seaweedfs-csi.sock`), `unix:/path`, a bare `/path`, or `tcp://host:port`.
    fn from_str(s: &str) -> Result<Self, ServeError> {
        let bad = || ServeError::InvalidEndpoint(s.to_string());
        let lower = s.to_ascii_lowercase();
        if lower.starts_with("unix:") {
            let rest = s[5..].trim_start_matches('/');
            if rest.is_empty() {
                return Err(bad());
            }
            return Ok(Endpoint::Unix(PathBuf::from(format!("/{rest}"))));
        }
        if lower.starts_with("tcp://") {
            let rest = &s[6..];
            if rest.is_empty() || !rest.contains(':') {
                return Err(bad());
            }
            return Ok(Endpoint::Tcp(rest.to_string()));
        }
        if s.starts_with('/') {
            return Ok(Endpoint::Unix(PathBuf::from(s)));
        }
        Err(bad())
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp://{a}"),
        }
    }
}

/// The services one process serves. Identity always; controller and node per `--components`.
pub struct CsiServices {
    pub identity: IdentityService,
    pub controller: Option<ControllerService>,
    pub node: Option<NodeService>,
}

/// Logs every RPC with its method, gRPC status and duration. Only the method path is looked
/// at, never the request body, so secrets cannot end up in the log.
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcLogLayer;

impl<S> Layer<S> for RpcLogLayer {
    type Service = RpcLog<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcLog { inner }
    }
}

#[derive(Debug, Clone)]
pub struct RpcLog<S> {
    inner: S,
}

/// Frequent polling calls are logged at debug so they do not drown the interesting ones.
fn is_chatty(method: &str) -> bool {
    matches!(
        method,
        "Probe"
            | "GetPluginInfo"
            | "GetPluginCapabilities"
            | "NodeGetCapabilities"
            | "NodeGetVolumeStats"
    )
}

impl<S, B, RB> Service<http::Request<B>> for RpcLog<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_string();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            let ms = start.elapsed().as_secs_f64() * 1000.0;
            let method = path.rsplit('/').next().unwrap_or(&path).to_string();
            match &res {
                Ok(resp) => {
                    // Errors come back "trailers-only": the status is in the headers. A success
                    // carries it in the trailers, which we do not wait for.
                    let code = resp
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<i32>().ok())
                        .unwrap_or(0);
                    if code == 0 {
                        if is_chatty(&method) {
                            tracing::debug!(rpc = %method, duration_ms = ms, "rpc ok");
                        } else {
                            tracing::info!(rpc = %method, duration_ms = ms, "rpc ok");
                        }
                    } else {
                        let message = resp
                            .headers()
                            .get("grpc-message")
                            .and_then(|v| v.to_str().ok())
                            .map(percent_decode)
                            .unwrap_or_default();
                        let code = tonic::Code::from_i32(code);
                        tracing::warn!(rpc = %method, duration_ms = ms, code = ?code, message = %message, "rpc failed");
                    }
                }
                Err(e) => {
                    tracing::error!(rpc = %method, duration_ms = ms, error = %e, "rpc transport error")
                }
            }
            res
        })
    }
}

/// grpc-message is percent-encoded on the wire.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 3 <= b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Resolves when SIGTERM or SIGINT arrives.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            std::future::pending::<()>().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; shutting down"),
    }
}

/// Makes `path` free for a new socket: a socket file nobody listens on is stale and removed;
/// a socket somebody answers on is in use; any other file is left alone (an error).
fn prepare_socket_path(path: &Path) -> Result<(), ServeError> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io(format!("create {}", parent.display())))?;
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(format!("stat {}", path.display()))(e)),
        Ok(md) if md.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ServeError::InUse(path.to_path_buf()));
            }
            tracing::info!(socket = %path.display(), "removing stale socket");
            std::fs::remove_file(path)
                .map_err(io(format!("remove stale socket {}", path.display())))
        }
        Ok(_) => Err(ServeError::Io {
            context: format!("{} exists and is not a socket", path.display()),
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        }),
    }
}

/// A listener bound before serving starts, so callers know the socket exists once this returns.
pub enum BoundListener {
    Unix(tokio::net::UnixListener, PathBuf),
    Tcp(tokio::net::TcpListener),
}

impl BoundListener {
    pub async fn bind(endpoint: &Endpoint) -> Result<Self, ServeError> {
        match endpoint {
            Endpoint::Unix(path) => {
                prepare_socket_path(path)?;
                let l = tokio::net::UnixListener::bind(path)
                    .map_err(io(format!("listen on {}", path.display())))?;
                Ok(BoundListener::Unix(l, path.clone()))
            }
            Endpoint::Tcp(addr) => {
                let l = tokio::net::TcpListener::bind(addr.as_str())
                    .await
                    .map_err(io(format!("listen on {addr}")))?;
                Ok(BoundListener::Tcp(l))
            }
        }
    }
}

/// Serves until `shutdown` resolves, then lets in-flight RPCs finish for up to
/// [`SHUTDOWN_GRACE`]. Removes the unix socket file as soon as shutdown begins. Mounts are
/// never touched here: pods keep their volumes across a plugin restart.
pub async fn serve(
    listener: BoundListener,
    services: CsiServices,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let CsiServices {
        identity,
        controller,
        node,
    } = services;
    let router = Server::builder()
        .layer(RpcLogLayer)
        .add_service(IdentityServer::new(identity))
        .add_optional_service(controller.map(ControllerServer::new))
        .add_optional_service(node.map(NodeServer::new));

    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    let stopping = {
        let mut rx = rx.clone();
        async move {
            let _ = rx.wait_for(|v| *v).await;
        }
    };
    let deadline = {
        let mut rx = rx.clone();
        async move {
            let _ = rx.wait_for(|v| *v).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        }
    };

    // A unix socket file is removed when shutdown begins (below); a stale file left by a
    // failure is replaced at the next start (`prepare_socket_path`).
    match listener {
        BoundListener::Unix(l, path) => {
            tracing::info!(endpoint = %format!("unix://{}", path.display()), "serving CSI");
            // Give the path up as soon as we stop accepting, while our listener still holds
            // it: a successor (rolling update) may bind it while we drain, and removing it
            // later could delete the successor's socket.
            let p = path.clone();
            let stopping = async move {
                stopping.await;
                let _ = std::fs::remove_file(&p);
            };
            // Any :authority, as kubelet's and every other client's (see `authority`).
            let incoming = tokio_stream::StreamExt::map(
                tokio_stream::wrappers::UnixListenerStream::new(l),
                |conn| conn.map(super::authority::AnyAuthority::new),
            );
            let served = router.serve_with_incoming_shutdown(incoming, stopping);
            bounded(served, deadline).await
        }
        BoundListener::Tcp(l) => {
            tracing::info!(endpoint = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "serving CSI over TCP");
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
            let served = router.serve_with_incoming_shutdown(incoming, stopping);
            bounded(served, deadline).await
        }
    }
}

async fn bounded(
    served: impl Future<Output = Result<(), tonic::transport::Error>>,
    deadline: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    tokio::select! {
        r = served => r.map_err(ServeError::from),
        _ = deadline => {
            tracing::warn!(grace = ?SHUTDOWN_GRACE, "in-flight RPCs did not finish; stopping anyway");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            "unix:///csi/csi.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/csi/csi.sock".into())
        );
        assert_eq!(
            "unix://tmp/seaweedfs-csi.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/tmp/seaweedfs-csi.sock".into())
        );
        assert_eq!(
            "unix:/a.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/a.sock".into())
        );
        assert_eq!(
            "/a.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/a.sock".into())
        );
        assert_eq!(
            "tcp://127.0.0.1:10000".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("127.0.0.1:10000".into())
        );
        for bad in [
            "",
            "unix://",
            "tcp://",
            "tcp://nohost",
            "http://x:1",
            "relative.sock",
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn grpc_message_decoding() {
        assert_eq!(percent_decode("a%20b%3A"), "a b:");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[tokio::test]
    async fn stale_socket_is_replaced_but_live_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/csi.sock");
        let ep = Endpoint::Unix(path.clone());
        let first = BoundListener::bind(&ep).await.unwrap();
        assert!(matches!(
            BoundListener::bind(&ep).await,
            Err(ServeError::InUse(_))
        ));
        drop(first);
        // The file stays behind after the listener is gone: stale.
        assert!(path.exists());
        let _second = BoundListener::bind(&ep).await.unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        assert!(BoundListener::bind(&Endpoint::Unix(plain.clone()))
            .await
            .is_err());
        assert!(plain.exists(), "a regular file is never removed");
    }
}
