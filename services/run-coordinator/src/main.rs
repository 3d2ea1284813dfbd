//! The run-coordinator service as its own process.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "automesh-run-coordinator",
    about = "The automesh run-coordinator service",
    version
)]
struct Cli {
    #[command(flatten)]
    command: automesh_run_coordinator::Command,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Cli::parse().command.execute().await
}
