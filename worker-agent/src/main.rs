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
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli.args.execute()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
