//! The public API gateway as its own process.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "automesh-gateway",
    about = "The automesh public API gateway",
    version
)]
struct Cli {
    #[command(flatten)]
    command: automesh_gateway::Command,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Cli::parse().command.execute().await
}
