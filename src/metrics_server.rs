//! `--metricsPort`: `GET /metrics` (Prometheus text from [`crate::metrics::global`]),
//! `GET /healthz` (liveness) and `GET /readyz` (readiness), each 200 `ok` or 503 with the
//! reason; other paths 404, other methods 405 (HEAD is answered like GET, without a body).
//!
//! `/healthz` only says the process answers (and whatever its own check adds): it must not
//! fail on a filer outage, or kubelet would restart the plugin, which cannot help and which
//! the mounts only survive through the keeper. `/readyz` also checks what a new NodeStage
//! needs from outside the process: the filer and the fd-keeper.
//!
//! Routes are axum; connections are served with hyper's HTTP/1 builder rather than
//! `axum::serve`, which can set neither a header read timeout nor keep-alive. A misbehaving
//! client must not delay a probe, so the accept loop never waits: each connection serves one
//! request, has [`HEADER_TIMEOUT`] to send its head and [`CONN_TIMEOUT`] in all, and past
//! [`MAX_CONNS`] at once new connections are closed rather than queued.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

/// Longest request head accepted (hyper's minimum buffer); scrapers send a few hundred bytes.
const MAX_HEAD: usize = 8 * 1024;
/// Connections served at once: only a bound on sockets, far above what probes and scrapers use.
const MAX_CONNS: usize = 512;
/// Time a client has to send its request head, from the moment it connects.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a connection may take in all, answer included (a client that never reads it).
const CONN_TIMEOUT: Duration = Duration::from_secs(30);
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
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| MetricsServerError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| MetricsServerError::Bind { addr, source })?;
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(accept_loop(
            listener,
            router(Checks { health, ready }),
            stopped,
        ));
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
    /// their own, bounded by [`CONN_TIMEOUT`]).
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

async fn accept_loop(listener: TcpListener, app: Router, mut stopped: watch::Receiver<bool>) {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .keep_alive(false);
    let slots = Arc::new(Semaphore::new(MAX_CONNS));
    loop {
        let (stream, peer) = tokio::select! {
            _ = stopped.changed() => return,
            c = listener.accept() => match c {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "{MAX_CONNS} metrics connections open, closing a new one");
            continue;
        };
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        tokio::spawn(async move {
            match tokio::time::timeout(CONN_TIMEOUT, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics connection failed"),
                Err(_) => tracing::debug!(%peer, "metrics connection timed out"),
            }
            drop(slot);
        });
    }
}

fn router(checks: Checks) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found; try /metrics, /healthz or /readyz\n",
            )
        })
        .with_state(checks)
}

async fn metrics() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        crate::metrics::global().render(),
    )
}

async fn healthz(State(checks): State<Checks>) -> (StatusCode, String) {
    match check_health(checks.health).await {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(reason) => {
            tracing::warn!(%reason, "health check failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("unhealthy: {reason}\n"),
            )
        }
    }
}

async fn readyz(State(checks): State<Checks>) -> (StatusCode, String) {
    let mut r = check_health(checks.health).await;
    if r.is_ok() {
        r = check_health(checks.ready).await;
    }
    match r {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(reason) => {
            tracing::warn!(%reason, "readiness check failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {reason}\n"),
            )
        }
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

    fn checks(health: Option<HealthCheck>, ready: Option<HealthCheck>) -> State<Checks> {
        State(Checks { health, ready })
    }

    #[tokio::test]
    async fn health_and_readiness() {
        assert_eq!(healthz(checks(None, None)).await.0, StatusCode::OK);
        assert_eq!(readyz(checks(None, None)).await.0, StatusCode::OK);
        let sick: HealthCheck = Arc::new(|| Err("filer unreachable".into()));
        let (s, body) = healthz(checks(Some(sick.clone()), None)).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("filer unreachable"), "{body}");
        let panicky: HealthCheck = Arc::new(|| panic!("boom"));
        assert_eq!(
            healthz(checks(Some(panicky), None)).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        // Not ready is not unhealthy.
        assert_eq!(
            healthz(checks(None, Some(sick.clone()))).await.0,
            StatusCode::OK
        );
        let (s, body) = readyz(checks(None, Some(sick))).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("not ready: filer unreachable"), "{body}");
    }

    /// A check stuck on a hung mount answers 503 after HEALTH_TIMEOUT, it does not hang.
    #[tokio::test]
    async fn stuck_check_times_out() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = parking_lot::Mutex::new(rx);
        let stuck: HealthCheck = Arc::new(move || {
            let _ = rx.lock().recv();
            Ok(())
        });
        let (s, body) = healthz(checks(Some(stuck), None)).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("did not finish within 5s"), "{body}");
        drop(tx);
    }
}
