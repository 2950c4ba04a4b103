//! `seaweedfs-csi-driver`: flag parsing and wiring only; everything else is the library.
//! Only product commands: the test seams live in `src/bin/test_support.rs`.

use std::process::ExitCode;

use clap::Parser;
use seaweedfs_csi_driver::cli::{self, Cli, Command};

fn main() -> ExitCode {
    // before any thread exists, so that every thread shares the one arena
    seaweedfs_csi_driver::fuse::session::tune_allocator();
    let cli = Cli::parse_from(cli::normalize_args(std::env::args_os()));
    if let Err(e) = cli::init_tracing(&cli.log) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    if !matches!(cli.command, Some(Command::Keeper(_))) {
        seaweedfs_csi_driver::fuse::session::start_heap_trimmer();
    }
    let result = match cli.command {
        Some(Command::Mount(args)) => seaweedfs_csi_driver::fuse::mount_cmd::run(*args),
        Some(Command::Keeper(args)) => seaweedfs_csi_driver::keeper::run(args),
        None => seaweedfs_csi_driver::driver::run(cli.driver, None),
    };
    cli::exit_code(result)
}
