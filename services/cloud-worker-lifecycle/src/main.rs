//! The cloud-worker-lifecycle service as its own process.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "automesh-cloud-worker-lifecycle",
    about = "The automesh cloud-worker-lifecycle service",
    version
)]
struct Cli {
    #[command(flatten)]
    command: automesh_cloud_worker_lifecycle::Command,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Cli::parse().command.execute().await
}
