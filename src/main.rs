//! `seaweedfs-csi-driver`: flag parsing and wiring only; everything else is the library.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use seaweedfs_csi_driver::cli::{self, Cli, Command, DriverArgs};
use seaweedfs_csi_driver::csi::stager::{FakeStager, Stager};
use seaweedfs_csi_driver::filer::grpc::{FilerClientOptions, GrpcFiler};
use seaweedfs_csi_driver::filer::FilerApi;
use seaweedfs_csi_driver::security::SecurityConfig;

fn main() -> ExitCode {
    let cli = Cli::parse_from(cli::normalize_args(std::env::args_os()));
    if let Err(e) = cli::init_tracing(&cli.log) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Some(Command::Mount(args)) => seaweedfs_csi_driver::fuse::mount_cmd::run(args),
        // TODO(lead): `Some(Command::Keeper(args)) => seaweedfs_csi_driver::keeper::run(args),`
        // once the Keeper variant is added to `cli::Command`.
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
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let security = SecurityConfig::load()?;
        let filer = GrpcFiler::connect(FilerClientOptions {
            addresses: plan.filers.clone(),
            security: security.clone(),
            ..Default::default()
        })
        .await?;
        let filer: Arc<dyn FilerApi> = Arc::new(filer);

        if let Some(port) = plan.metrics_port {
            // TODO(lead): serve crate::metrics on this port once it has an HTTP exporter.
            tracing::warn!(port, "--metricsPort is not served yet");
        }

        let stager: Option<Arc<dyn Stager>> = if !plan.run_node {
            None
        } else if let Some(dir) = &plan.fake_stager_dir {
            tracing::warn!(dir = %dir.display(), "test mode: volumes are bind mounts of scratch directories");
            Some(Arc::new(FakeStager::new(dir.clone())?))
        } else {
            Some(Arc::new(seaweedfs_csi_driver::fuse::stager::FuseStager::new(security.clone())))
        };
        cli::run_driver(plan, filer, stager).await?;
        Ok(())
    })
}
