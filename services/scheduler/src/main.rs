//! The scheduler service as its own process.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "automesh-scheduler",
    about = "The automesh scheduler service",
    version
)]
struct Cli {
    #[command(flatten)]
    command: automesh_scheduler::Command,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Cli::parse().command.execute().await
}
