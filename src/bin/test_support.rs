//! `seaweedfs-csi-test-support`: the driver binary plus its test seams, built only with
//! `--features test-support` and never shipped (the image and `scripts/build-static.sh` build
//! `seaweedfs-csi-driver`, which has product commands only).
//!
//! - `memfs`: a trivial in-memory FUSE filesystem with the same takeover machinery as the
//!   product (the takeover tests, and the benchmark ceiling);
//! - `fill-dir`: creates many empty files (or directories) in one filer directory over gRPC (the big-directory
//!   benchmarks: a million names in minutes, where creating them through a mount takes long);
//! - `--fakeStager=DIR`: the driver stages volumes as bind mounts of scratch directories under
//!   DIR instead of FUSE sessions (CSI tests that need mounts surviving the process, or
//!   `CSI_TEST_STAGER=fake`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, Parser, Subcommand};
use seaweedfs_csi_driver::cli::{self, Command, DriverArgs, LogArgs};
use seaweedfs_csi_driver::csi::stager::{FakeStager, Stager};
use seaweedfs_csi_driver::fuse::memfs;

#[derive(Debug, Parser)]
#[command(
    name = "seaweedfs-csi-test-support",
    about = "seaweedfs-csi-driver with test seams (memfs, --fakeStager); not shipped",
    args_conflicts_with_subcommands = true
)]
struct TestCli {
    #[command(subcommand)]
    command: Option<TestCommand>,
    /// Stage volumes with bind mounts of scratch directories under this path (no FUSE)
    #[arg(long = "fakeStager")]
    fake_stager: Option<PathBuf>,
    #[command(flatten)]
    driver: DriverArgs,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Debug, Subcommand)]
enum TestCommand {
    /// A trivial in-memory FUSE filesystem (takeover tests and the benchmark ceiling).
    Memfs(memfs::MemfsArgs),
    /// Creates `count` empty files `<prefix><n>` in a filer directory (benchmarks).
    FillDir(FillDirArgs),
    #[command(flatten)]
    Product(Command),
}

fn main() -> ExitCode {
    seaweedfs_csi_driver::fuse::session::tune_allocator();
    let cli = TestCli::parse_from(cli::normalize_args_for(
        &TestCli::command(),
        std::env::args_os(),
    ));
    if let Err(e) = cli::init_tracing(&cli.log) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Some(TestCommand::Memfs(args)) => memfs::run(args),
        Some(TestCommand::FillDir(args)) => fill_dir(args),
        Some(TestCommand::Product(Command::Mount(args))) => {
            seaweedfs_csi_driver::fuse::mount_cmd::run(*args)
        }
        Some(TestCommand::Product(Command::Keeper(args))) => {
            seaweedfs_csi_driver::keeper::run(args)
        }
        None => {
            let fake = cli.fake_stager.map(|dir| {
                Box::new(move || -> anyhow::Result<Arc<dyn Stager>> {
                    tracing::warn!(dir = %dir.display(), "test mode: volumes are bind mounts of scratch directories");
                    Ok(Arc::new(FakeStager::new(dir)?.leave_mounts_on_drop()))
                }) as seaweedfs_csi_driver::driver::StagerOverride
            });
            seaweedfs_csi_driver::driver::run(cli.driver, fake)
        }
    };
    cli::exit_code(result)
}

#[derive(Debug, clap::Args)]
struct FillDirArgs {
    /// Filer address (host:port)
    #[arg(long)]
    filer: String,
    /// Directory to fill (made if missing)
    #[arg(long)]
    dir: String,
    #[arg(long)]
    count: usize,
    #[arg(long, default_value = "entry-")]
    prefix: String,
    /// Creates in flight at once
    #[arg(long, default_value_t = 64)]
    parallel: usize,
    /// Makes empty directories instead of files
    #[arg(long)]
    dirs: bool,
}

fn fill_dir(a: FillDirArgs) -> anyhow::Result<()> {
    use futures::StreamExt;
    use seaweedfs_csi_driver::filer::grpc::FilerClientOptions;
    use seaweedfs_csi_driver::filer::hub::FilerHub;
    use seaweedfs_csi_driver::filer::FilerApi;
    use seaweedfs_csi_driver::fs::attr::{to_go_mode, Kind};
    use seaweedfs_csi_driver::pb::filer as pb;

    let (kind, perm) = if a.dirs {
        (Kind::Dir, 0o755)
    } else {
        (Kind::File, 0o644)
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let shared = FilerHub::global()
            .connect(FilerClientOptions {
                addresses: vec![a.filer.clone()],
                ..Default::default()
            })
            .await?;
        let filer = shared.session();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs() as i64;
        let width = a.count.to_string().len();
        let creates = futures::stream::iter(0..a.count).map(|i| {
            let filer = filer.clone();
            let req = pb::CreateEntryRequest {
                directory: a.dir.clone(),
                entry: Some(pb::Entry {
                    name: format!("{}{i:0width$}", a.prefix),
                    is_directory: a.dirs,
                    attributes: Some(pb::FuseAttributes {
                        file_mode: to_go_mode(kind, perm),
                        mtime: now,
                        crtime: now,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            };
            async move { filer.create_entry(req).await }
        });
        let mut results = creates.buffer_unordered(a.parallel.max(1));
        let mut done = 0usize;
        while let Some(r) = results.next().await {
            r?;
            done += 1;
            if done % 100_000 == 0 {
                eprintln!("fill-dir: {done} of {} in {}", a.count, a.dir);
            }
        }
        Ok(())
    })
}
