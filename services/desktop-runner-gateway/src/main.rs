//! The desktop-runner-gateway service as its own process.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "automesh-desktop-runner-gateway",
    about = "The automesh desktop-runner-gateway service",
    version
)]
struct Cli {
    #[command(flatten)]
    command: automesh_desktop_runner_gateway::Command,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Cli::parse().command.execute().await
}
