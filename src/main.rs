//! `seaweedfs-csi-driver`: flag parsing and wiring only; everything else is the library.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use seaweedfs_csi_driver::cli::{self, Cli, Command, DriverArgs};
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

        // Before the CSI socket: /healthz is the node pod's readiness and liveness probe.
        let _metrics = match plan.metrics_port {
            Some(port) => Some(
                seaweedfs_csi_driver::metrics_server::MetricsServer::start_on_port(port, None)
                    .await?,
            ),
            None => None,
        };

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
        let served = cli::run_driver(plan, filer, stager).await;
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
