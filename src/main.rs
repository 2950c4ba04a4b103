//! `seaweedfs-csi-driver`: flag parsing and wiring only; everything else is the library.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use seaweedfs_csi_driver::cli::{self, Cli, Command, DriverArgs};
use seaweedfs_csi_driver::csi::server::{shutdown_signal, Endpoint};
use seaweedfs_csi_driver::csi::stager::{FakeStager, Stager};
use seaweedfs_csi_driver::filer::grpc::{FilerClientOptions, GrpcFiler};
use seaweedfs_csi_driver::filer::FilerApi;
use seaweedfs_csi_driver::fuse::stager::FuseStager;
use seaweedfs_csi_driver::security::SecurityConfig;

fn main() -> ExitCode {
    // before any thread exists, so that every thread shares the one arena
    seaweedfs_csi_driver::fuse::session::tune_allocator();
    let cli = Cli::parse_from(cli::normalize_args(std::env::args_os()));
    if let Err(e) = cli::init_tracing(&cli.log) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Some(Command::Mount(args)) => seaweedfs_csi_driver::fuse::mount_cmd::run(*args),
        Some(Command::Keeper(args)) => seaweedfs_csi_driver::keeper::run(args),
        Some(Command::Memfs(args)) => seaweedfs_csi_driver::fuse::memfs::run(args),
        None => run_driver(cli.driver),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_driver(args: DriverArgs) -> anyhow::Result<()> {
    let plan = args.plan()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async move {
        let security = SecurityConfig::load()?;
        let filer = GrpcFiler::connect(FilerClientOptions {
            addresses: plan.filers.clone(),
            security: security.clone(),
            ..Default::default()
        })
        .await?;
        let filer: Arc<dyn FilerApi> = Arc::new(filer);

        let mut fuse_stager = None;
        let stager: Option<Arc<dyn Stager>> = if !plan.run_node {
            None
        } else if let Some(dir) = &plan.fake_stager_dir {
            tracing::warn!(dir = %dir.display(), "test mode: volumes are bind mounts of scratch directories");
            Some(Arc::new(FakeStager::new(dir.clone())?.leave_mounts_on_drop()))
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
                tracing::info!(sessions = found, "adopting live FUSE sessions from the fd-keeper");
            }
            fuse_stager = Some(s.clone());
            Some(s)
        };
        // Before the CSI socket: /healthz is the node pod's liveness probe, /readyz its
        // readiness probe.
        let _metrics = match plan.metrics_port {
            Some(port) => Some(
                seaweedfs_csi_driver::metrics_server::MetricsServer::start_on_port_with_ready(
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
            cli::run_driver(plan, filer, stager).await
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
) -> seaweedfs_csi_driver::metrics_server::HealthCheck {
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
