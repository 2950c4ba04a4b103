//! Building the client (one lazy channel per filer, plain or over TLS) and the failover loop
//! that bounds every unary call and moves to the next filer after a transport error.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tonic::transport::{Endpoint, Uri};

use super::{Client, FilerClientOptions, GrpcFiler, Inner, Target};
use crate::filer::addr::FilerAddress;
use crate::filer::{FilerError, Result};
use crate::pb::filer::seaweed_filer_client::SeaweedFilerClient;

/// Max gRPC message size both ways; SeaweedFS uses 1 GiB (entries with many chunks are large).
pub const MAX_MESSAGE_SIZE: usize = 1 << 30;
/// HTTP/2 keepalive ping interval. The filer rejects pings more often than every 20 s.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

impl GrpcFiler {
    /// Validates the options and prepares lazy channels; does not touch the network (see module doc).
    pub async fn connect(opts: FilerClientOptions) -> Result<GrpcFiler> {
        let addrs =
            FilerAddress::parse_all(&opts.addresses).map_err(FilerError::InvalidArgument)?;
        let tls = opts
            .security
            .grpc_client_tls_config()
            .map_err(|e| FilerError::InvalidArgument(format!("filer gRPC TLS: {e}")))?;
        let mut targets = Vec::with_capacity(addrs.len());
        for addr in addrs {
            let uri = format!("http://{}", addr.grpc());
            let ep = Endpoint::from_shared(uri.clone())
                .map_err(|e| FilerError::InvalidArgument(format!("filer address {uri}: {e}")))?
                .connect_timeout(opts.connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                .keep_alive_while_idle(true)
                .initial_stream_window_size(16 << 20)
                .initial_connection_window_size(16 << 20);
            let channel = match &tls {
                Some(cfg) => ep.connect_with_connector_lazy(tls_connector(cfg.clone())),
                None => ep.connect_lazy(),
            };
            let client = SeaweedFilerClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE);
            targets.push(Target { addr, client });
        }
        let signature = loop {
            let s: i32 = rand::random();
            if s != 0 {
                break s;
            }
        };
        tracing::debug!(filers = ?targets.iter().map(|t| t.addr.to_string()).collect::<Vec<_>>(),
            signature, tls = tls.is_some(), "filer client ready");
        Ok(GrpcFiler {
            inner: Arc::new(Inner {
                targets,
                current: AtomicUsize::new(0),
                call_timeout: opts.call_timeout,
                signature,
                stream_enabled: AtomicBool::new(true),
                stream_unsupported: AtomicBool::new(false),
                mutate: Mutex::new(HashMap::new()),
                next_request_id: AtomicU64::new(1),
                stream_count: AtomicU64::new(0),
                unary_count: AtomicU64::new(0),
            }),
        })
    }

    /// The parsed filer addresses, in failover order.
    pub fn addresses(&self) -> Vec<FilerAddress> {
        self.inner.targets.iter().map(|t| t.addr.clone()).collect()
    }

    pub(super) fn current(&self) -> usize {
        self.inner.current.load(Ordering::Relaxed) % self.inner.targets.len()
    }

    /// Runs `f` against the current filer with a per-attempt timeout, moving to the next filer
    /// and retrying after a transport error (at most `filers + 1` attempts).
    pub(super) async fn call<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let n = self.inner.targets.len();
        let attempts = n + 1;
        let mut last = FilerError::Unavailable(format!("{op}: no filer configured"));
        let mut pauses = crate::retry::RECONNECT.pauses();
        for attempt in 0..attempts {
            let idx = self.current();
            let target = &self.inner.targets[idx];
            let res = match tokio::time::timeout(self.inner.call_timeout, f(target.client.clone()))
                .await
            {
                Ok(r) => r,
                Err(_) => Err(FilerError::Timeout(format!(
                    "{op} on filer {} after {:?}",
                    target.addr, self.inner.call_timeout
                ))),
            };
            match res {
                Err(FilerError::Unavailable(msg)) => {
                    tracing::warn!(filer = %target.addr, op, attempt, error = %msg, "filer unavailable, trying next");
                    let _ = self.inner.current.compare_exchange(
                        idx,
                        (idx + 1) % n,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                    last = FilerError::Unavailable(format!("{op} on filer {}: {msg}", target.addr));
                    if (attempt + 1) % n == 0 && attempt + 1 < attempts {
                        // Went round every filer: pause briefly before trying them again.
                        tokio::time::sleep(pauses.next_pause()).await;
                    }
                }
                Err(FilerError::Timeout(msg)) => {
                    // Unknown whether it was applied: do not retry, but prefer another filer next time.
                    if n > 1 {
                        let _ = self.inner.current.compare_exchange(
                            idx,
                            (idx + 1) % n,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
                    }
                    return Err(FilerError::Timeout(msg));
                }
                other => return other,
            }
        }
        Err(last)
    }
}

// ---- TLS ----

/// A tonic connector doing TCP + rustls with our CA-only verifier. SNI/host name come from the
/// URI but the verifier ignores the name (SeaweedFS does not check it).
fn tls_connector(
    cfg: Arc<rustls::ClientConfig>,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Error = std::io::Error,
    Future = impl Future<
        Output = std::io::Result<TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>,
    > + Send,
> + Send
       + Clone
       + 'static {
    let connector = tokio_rustls::TlsConnector::from(cfg);
    tower::service_fn(move |uri: Uri| {
        let connector = connector.clone();
        async move {
            let bad = || {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("bad filer uri {uri}"),
                )
            };
            let host = uri
                .host()
                .ok_or_else(bad)?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().ok_or_else(bad)?;
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = match host.parse::<std::net::IpAddr>() {
                Ok(ip) => rustls::pki_types::ServerName::IpAddress(ip.into()),
                Err(_) => {
                    rustls::pki_types::ServerName::try_from(host.clone()).unwrap_or_else(|_| {
                        rustls::pki_types::ServerName::try_from("seaweedfs").expect("static name")
                    })
                }
            };
            let tls = connector.connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filer::FilerApi;
    use std::time::Instant;

    #[tokio::test]
    async fn connect_rejects_bad_addresses() {
        let o = FilerClientOptions {
            addresses: vec!["nope".into()],
            ..Default::default()
        };
        assert!(matches!(
            GrpcFiler::connect(o).await,
            Err(FilerError::InvalidArgument(_))
        ));
        let o = FilerClientOptions {
            addresses: vec![],
            ..Default::default()
        };
        assert!(matches!(
            GrpcFiler::connect(o).await,
            Err(FilerError::InvalidArgument(_))
        ));
    }

    #[tokio::test]
    async fn signature_nonzero_and_address() {
        let o = FilerClientOptions {
            addresses: vec!["127.0.0.1:1.2,127.0.0.1:3".into()],
            ..Default::default()
        };
        let f = GrpcFiler::connect(o).await.unwrap();
        assert_ne!(f.signature(), 0);
        assert_eq!(f.http_address(), "127.0.0.1:1");
        assert_eq!(f.addresses()[1].grpc_port, 10003);
    }

    #[tokio::test]
    async fn silent_listener_is_bounded() {
        // The kernel accepts the TCP connection but nobody speaks HTTP/2.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let opts = FilerClientOptions {
            addresses: vec![format!("127.0.0.1:1.{port}")],
            call_timeout: Duration::from_millis(800),
            connect_timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let f = GrpcFiler::connect(opts).await.unwrap();
        let t0 = Instant::now();
        let e = f.lookup_entry("/", "x").await.unwrap_err();
        assert!(
            matches!(e, FilerError::Timeout(_) | FilerError::Unavailable(_)),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        drop(l);
    }
}
