//! A tiny HTTP/1.x server for `--metricsPort`: `GET /metrics` (Prometheus text from
//! [`crate::metrics::global`]), `GET /healthz` (liveness) and `GET /readyz` (readiness), each
//! 200 `ok` or 503 with the reason.
//!
//! `/healthz` only says the process answers (and whatever its own check adds): it must not
//! fail on a filer outage, or kubelet would restart the plugin, which cannot help and which
//! the mounts only survive through the keeper. `/readyz` also checks what a new NodeStage
//! needs from outside the process: the filer and the fd-keeper.
//!
//! Hand-written on tokio instead of a web framework: two read-only endpoints do not justify
//! another dependency, and every connection is bounded in size, time and number so a
//! misbehaving scraper cannot hurt the node plugin.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

/// Longest request head accepted; scrapers send a few hundred bytes.
const MAX_HEAD: usize = 8 * 1024;
/// Connections served at once; more wait in the accept backlog.
const MAX_CONNS: usize = 32;
/// Time a client has to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client has to take the answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one health check: a check stuck on a hung mount must answer "unhealthy", not hang
/// the probe.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Returns `Err(reason)` when the process is unhealthy (or not ready). Called on a blocking
/// thread for every `/healthz` (`/readyz`) request, with [`HEALTH_TIMEOUT`].
pub type HealthCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

#[derive(Clone, Default)]
struct Checks {
    health: Option<HealthCheck>,
    ready: Option<HealthCheck>,
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsServerError {
    #[error("cannot listen for metrics on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running server; [`MetricsServer::shutdown`] stops it (dropping it stops accepting too).
pub struct MetricsServer {
    local_addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` and serves in a background task. `health: None` means `/healthz` is always
    /// 200 while the process answers at all.
    pub async fn start(
        addr: SocketAddr,
        health: Option<HealthCheck>,
    ) -> Result<Self, MetricsServerError> {
        Self::start_with_ready(addr, health, None).await
    }

    /// Like [`Self::start`], with a readiness check for `/readyz` (`None`: same as `/healthz`).
    pub async fn start_with_ready(
        addr: SocketAddr,
        health: Option<HealthCheck>,
        ready: Option<HealthCheck>,
    ) -> Result<Self, MetricsServerError> {
        let checks = Checks { health, ready };
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| MetricsServerError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| MetricsServerError::Bind { addr, source })?;
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let slots = Arc::new(Semaphore::new(MAX_CONNS));
            loop {
                let permit = tokio::select! {
                    _ = stopped.changed() => return,
                    p = slots.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                };
                let conn = tokio::select! {
                    _ = stopped.changed() => return,
                    c = listener.accept() => c,
                };
                match conn {
                    Ok((stream, peer)) => {
                        let checks = checks.clone();
                        tokio::spawn(async move {
                            if let Err(e) = serve_conn(stream, checks).await {
                                tracing::debug!(%peer, error = %e, "metrics connection ended");
                            }
                            drop(permit);
                        });
                    }
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "metrics accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        tracing::info!(%local_addr, "serving /metrics, /healthz and /readyz");
        Ok(Self {
            local_addr,
            stop,
            task: Some(task),
        })
    }

    /// `0.0.0.0:<port>`, as `--metricsPort` means it (Prometheus scrapes the pod IP).
    pub async fn start_on_port(
        port: u16,
        health: Option<HealthCheck>,
    ) -> Result<Self, MetricsServerError> {
        Self::start(SocketAddr::from(([0, 0, 0, 0], port)), health).await
    }

    /// [`Self::start_on_port`] with a readiness check.
    pub async fn start_on_port_with_ready(
        port: u16,
        health: Option<HealthCheck>,
        ready: Option<HealthCheck>,
    ) -> Result<Self, MetricsServerError> {
        Self::start_with_ready(SocketAddr::from(([0, 0, 0, 0], port)), health, ready).await
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting and waits for the accept loop to end (connections in flight finish on
    /// their own, bounded by the timeouts).
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Response {
    status: u16,
    reason: &'static str,
    content_type: &'static str,
    body: String,
}

impl Response {
    fn text(status: u16, reason: &'static str, body: impl Into<String>) -> Self {
        Self {
            status,
            reason,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

async fn serve_conn(mut stream: TcpStream, checks: Checks) -> std::io::Result<()> {
    let head = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Ok(r) => r?,
        Err(_) => return Err(std::io::ErrorKind::TimedOut.into()),
    };
    let (method, resp) = match head {
        Some(h) => {
            let (method, path) = parse_request_line(&h);
            let resp = route(method, path, checks).await;
            (method.to_string(), resp)
        }
        None => (
            String::new(),
            Response::text(
                431,
                "Request Header Fields Too Large",
                "request head too large\n",
            ),
        ),
    };
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        resp.status,
        resp.reason,
        resp.content_type,
        resp.body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        out.extend_from_slice(resp.body.as_bytes());
    }
    match tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(&out).await?;
        stream.shutdown().await
    })
    .await
    {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Reads until the blank line ending the head. `None` if it exceeds [`MAX_HEAD`]. A body, if
/// any, is ignored: no endpoint takes one and the connection is closed after the answer.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<String>> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            // Peer closed early: answer whatever arrived (an empty head gets a 400).
            return Ok(Some(String::from_utf8_lossy(&buf).into_owned()));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_head_end(&buf) {
            return Ok(Some(String::from_utf8_lossy(&buf[..end]).into_owned()));
        }
        if buf.len() > MAX_HEAD {
            return Ok(None);
        }
    }
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .or_else(|| buf.windows(2).position(|w| w == b"\n\n"))
}

/// `GET /metrics?x=y HTTP/1.1` -> (`GET`, `/metrics`). Missing parts come back empty.
fn parse_request_line(head: &str) -> (&str, &str) {
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("");
    let target = parts.next().unwrap_or("");
    let path = target.split(['?', '#']).next().unwrap_or("");
    (method, path)
}

async fn route(method: &str, path: &str, checks: Checks) -> Response {
    if method.is_empty() || path.is_empty() {
        return Response::text(400, "Bad Request", "bad request\n");
    }
    if method != "GET" && method != "HEAD" {
        return Response::text(405, "Method Not Allowed", "only GET and HEAD\n");
    }
    match path {
        "/metrics" => Response {
            status: 200,
            reason: "OK",
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            body: crate::metrics::global().render(),
        },
        "/healthz" => match check_health(checks.health).await {
            Ok(()) => Response::text(200, "OK", "ok\n"),
            Err(reason) => {
                tracing::warn!(%reason, "health check failed");
                Response::text(503, "Service Unavailable", format!("unhealthy: {reason}\n"))
            }
        },
        "/readyz" => {
            let mut r = check_health(checks.health).await;
            if r.is_ok() {
                r = check_health(checks.ready).await;
            }
            match r {
                Ok(()) => Response::text(200, "OK", "ok\n"),
                Err(reason) => {
                    tracing::warn!(%reason, "readiness check failed");
                    Response::text(503, "Service Unavailable", format!("not ready: {reason}\n"))
                }
            }
        }
        _ => Response::text(
            404,
            "Not Found",
            "not found; try /metrics, /healthz or /readyz\n",
        ),
    }
}

async fn check_health(health: Option<HealthCheck>) -> Result<(), String> {
    let Some(check) = health else {
        return Ok(());
    };
    match tokio::time::timeout(HEALTH_TIMEOUT, tokio::task::spawn_blocking(move || check())).await {
        Ok(Ok(r)) => r,
        Ok(Err(join)) => Err(format!("health check panicked: {join}")),
        Err(_) => Err(format!(
            "health check did not finish within {}s",
            HEALTH_TIMEOUT.as_secs()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_line_parsing() {
        assert_eq!(
            parse_request_line("GET /metrics?name[]=x HTTP/1.1\r\nHost: a"),
            ("GET", "/metrics")
        );
        assert_eq!(
            parse_request_line("HEAD /healthz HTTP/1.0"),
            ("HEAD", "/healthz")
        );
        assert_eq!(parse_request_line(""), ("", ""));
        assert_eq!(parse_request_line("GET"), ("GET", ""));
    }

    #[test]
    fn head_end_found_with_crlf_or_lf() {
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\n\n"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
    }

    #[tokio::test]
    async fn routes() {
        let none = Checks::default;
        let health = |h: HealthCheck| Checks {
            health: Some(h),
            ready: None,
        };
        assert_eq!(route("POST", "/metrics", none()).await.status, 405);
        assert_eq!(route("GET", "/nope", none()).await.status, 404);
        assert_eq!(route("", "", none()).await.status, 400);
        assert_eq!(route("GET", "/healthz", none()).await.status, 200);
        assert_eq!(route("GET", "/readyz", none()).await.status, 200);
        let sick: HealthCheck = Arc::new(|| Err("filer unreachable".into()));
        let r = route("GET", "/healthz", health(sick.clone())).await;
        assert_eq!(r.status, 503);
        assert!(r.body.contains("filer unreachable"));
        let panicky: HealthCheck = Arc::new(|| panic!("boom"));
        assert_eq!(route("GET", "/healthz", health(panicky)).await.status, 503);
        // Not ready is not unhealthy.
        let not_ready = Checks {
            health: None,
            ready: Some(sick),
        };
        assert_eq!(
            route("GET", "/healthz", not_ready.clone()).await.status,
            200
        );
        let r = route("GET", "/readyz", not_ready).await;
        assert_eq!(r.status, 503);
        assert!(
            r.body.contains("not ready: filer unreachable"),
            "{}",
            r.body
        );
    }
}
