//! The driver process (the binary's default command): filer client, metrics endpoint, stager
//! (FUSE sessions, adopted from the fd-keeper when it has them) and the CSI services, until
//! SIGTERM. `src/main.rs` only parses flags.

use std::sync::Arc;

use crate::cli::DriverArgs;
use crate::csi::server::{shutdown_signal, Endpoint};
use crate::csi::stager::Stager;
use crate::filer::grpc::FilerClientOptions;
use crate::filer::hub::FilerHub;
use crate::filer::FilerApi;
use crate::fuse::stager::FuseStager;
use crate::security::SecurityConfig;

/// Builds a stager for the test seams instead of the FUSE stager (test-support builds only).
pub type StagerOverride = Box<dyn FnOnce() -> anyhow::Result<Arc<dyn Stager>> + Send>;

/// Runs the driver (the default command) until SIGTERM/SIGINT. `stager_override`, when given,
/// replaces the FUSE stager on nodes (see the `seaweedfs-csi-test-support` binary).
pub fn run(args: DriverArgs, stager_override: Option<StagerOverride>) -> anyhow::Result<()> {
    let plan = args.plan()?;
    if plan.run_node {
        crate::budget::MemoryBudget::configure(args.memory_budget_mb);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async move {
        let security = SecurityConfig::load()?;
        // The node's one connection to this filer: staged volumes on it share it.
        let shared = FilerHub::global()
            .connect(FilerClientOptions {
                addresses: plan.filers.clone(),
                security: security.clone(),
                ..Default::default()
            })
            .await?;
        let filer: Arc<dyn FilerApi> = shared.session();

        let mut fuse_stager = None;
        let stager: Option<Arc<dyn Stager>> = if !plan.run_node {
            None
        } else if let Some(make) = stager_override {
            Some(make()?)
        } else {
            let s = Arc::new(match &plan.keeper_socket {
                Some(sock) => FuseStager::with_keeper(security.clone(), sock)?,
                None => {
                    tracing::warn!("no --keeperSocket: FUSE sessions end when this process ends");
                    FuseStager::new(security.clone())
                }
            });
            let found = s.adopt_all();
            if found > 0 {
                tracing::info!(
                    sessions = found,
                    "adopting live FUSE sessions from the fd-keeper"
                );
            }
            fuse_stager = Some(s.clone());
            Some(s)
        };
        // Before the CSI socket: /healthz is the node pod's liveness probe, /readyz its
        // readiness probe.
        let _metrics = match plan.metrics_port {
            Some(port) => Some(
                crate::metrics_server::MetricsServer::start_on_port_with_ready(
                    port,
                    None,
                    Some(readiness(filer.clone(), fuse_stager.clone())),
                )
                .await?,
            ),
            None => None,
        };
        // Rolling update (maxSurge): the previous plugin still serves the socket until it gets
        // SIGTERM; its sessions are claimed above and adopted once it has exited.
        let stopped = tokio::select! {
            _ = wait_for_endpoint(&plan.endpoint) => false,
            _ = shutdown_signal() => true,
        };
        let served = if stopped {
            Ok(())
        } else {
            crate::cli::run_driver(plan, filer, stager).await
        };
        if let Some(s) = fuse_stager {
            s.shutdown().await;
        }
        served?;
        Ok(())
    });
    // Adoption claims may still wait on the keeper in blocking threads: do not wait for them.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    result
}

/// `/readyz`: the filer answers (what every NodeStage and CreateVolume needs) and so does the
/// fd-keeper, when there is one (every NodeStage hands it the session).
fn readiness(
    filer: Arc<dyn FilerApi>,
    stager: Option<Arc<FuseStager>>,
) -> crate::metrics_server::HealthCheck {
    let rt = tokio::runtime::Handle::current();
    Arc::new(move || {
        let limit = std::time::Duration::from_secs(3);
        match rt.block_on(tokio::time::timeout(limit, filer.configuration())) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("filer: {e}")),
            Err(_) => return Err(format!("filer: no answer within {limit:?}")),
        }
        match &stager {
            Some(s) => s.keeper_ready(),
            None => Ok(()),
        }
    })
}

/// Waits while another process answers on the unix CSI socket (bounded only by that process:
/// it stops listening on SIGTERM). A stale socket file is left to the listener setup.
async fn wait_for_endpoint(endpoint: &Endpoint) {
    let Endpoint::Unix(path) = endpoint else {
        return;
    };
    let mut waited = 0u64;
    loop {
        let p = path.clone();
        let live =
            tokio::task::spawn_blocking(move || std::os::unix::net::UnixStream::connect(p).is_ok())
                .await
                .unwrap_or(false);
        if !live {
            if waited > 0 {
                tracing::info!(socket = %path.display(), "the previous plugin released the CSI socket");
            }
            return;
        }
        if waited == 0 {
            tracing::info!(socket = %path.display(),
                "another plugin serves the CSI socket (rolling update?); waiting for it to stop");
        } else if waited % 600 == 0 {
            tracing::warn!(socket = %path.display(), waited_secs = waited / 10,
                "the CSI socket is still served by another process");
        }
        waited += 1;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
