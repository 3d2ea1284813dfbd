//! `automesh-worker-agent`: the worker agent as its own binary (the same as
//! `automesh worker-agent`).

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "automesh-worker-agent",
    version,
    about = "The automesh worker agent: hosts native threads inside a user's cloud worker"
)]
struct Cli {
    #[command(flatten)]
    args: automesh_worker_agent::Args,
}

fn main() -> std::process::ExitCode {
    automesh_rpc::runtime::exit_after(Cli::parse().args.execute())
}
