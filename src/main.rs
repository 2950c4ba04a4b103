use clap::Parser;
use seaweedfs_csi_driver::{fuse::memfs, keeper};

/// Hidden helper roles of the binary (the CSI flags are parsed elsewhere).
#[derive(Parser)]
#[command(name = "seaweedfs-csi-driver")]
enum Role {
    /// Holds live /dev/fuse fds across plugin restarts.
    #[command(hide = true)]
    Keeper(keeper::KeeperArgs),
    /// In-memory test/benchmark filesystem using the takeover machinery.
    #[command(hide = true)]
    Memfs(memfs::MemfsArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Role::parse() {
        Role::Keeper(a) => keeper::run(a),
        Role::Memfs(a) => memfs::run(a),
    }
}
