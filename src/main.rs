use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "seaweedfs-csi-driver", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Mount a filer path in the foreground (like `weed mount`).
    Mount(seaweedfs_csi_driver::fuse::mount_cmd::MountArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Some(Cmd::Mount(a)) => seaweedfs_csi_driver::fuse::mount_cmd::run(a),
        None => Err(anyhow::anyhow!("driver mode not wired yet")),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
