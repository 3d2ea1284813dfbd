//! `automesh`: one binary for the whole mesh.
//!
//! - `automesh dev` starts every service in one process on SQLite;
//! - `automesh console` serves the web console (a client of the gateway);
//! - `automesh gateway|scheduler|run-coordinator|cloud-worker-lifecycle|desktop-runner-gateway`
//!   runs one service, for separate deployment;
//! - `automesh runner` is the reference desktop runner;
//! - `automesh ctl` drives the public API for people;
//! - `automesh admin` does operator tasks on internal services.

mod admin;
mod ctl;
mod dev;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "automesh",
    version,
    about = "Durable, scheduled AI-agent automations on the desktop or in the cloud",
    long_about = "automesh runs Automations — a saved prompt plus a schedule — durably, on the \
                  owner's desktop (through a runner) or in the owner's cloud worker.\n\n\
                  Quick start: `automesh dev` starts the whole mesh on SQLite and prints a \
                  token; `automesh ctl --help` shows how to drive it."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the whole mesh in one process on SQLite (development).
    Dev(dev::DevArgs),
    /// Run the public API gateway.
    Gateway(automesh_gateway::Command),
    /// Run the web console (browsers; a client of the public API).
    Console(automesh_console::Command),
    /// Run the scheduler service.
    Scheduler(automesh_scheduler::Command),
    /// Run the run-coordinator service.
    RunCoordinator(automesh_run_coordinator::Command),
    /// Run the cloud-worker-lifecycle service.
    CloudWorkerLifecycle(automesh_cloud_worker_lifecycle::Command),
    /// Run the desktop-runner-gateway service.
    DesktopRunnerGateway(automesh_desktop_runner_gateway::Command),
    /// Run the reference desktop runner: execute the owner's desktop runs here.
    Runner(automesh_runner::cli::Args),
    /// Run the worker agent (inside a cloud worker; started by its driver).
    WorkerAgent(automesh_worker_agent::Args),
    /// Drive the public API: automations, runs, events, tokens.
    Ctl(ctl::CtlArgs),
    /// Operator tasks on the internal services.
    Admin(admin::AdminArgs),
}

fn main() -> std::process::ExitCode {
    automesh_rpc::runtime::exit_after(execute(Cli::parse().command))
}

async fn execute(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Dev(args) => dev::run(args).await,
        Command::Gateway(c) => c.execute().await,
        Command::Console(c) => c.execute().await,
        Command::Scheduler(c) => c.execute().await,
        Command::RunCoordinator(c) => c.execute().await,
        Command::CloudWorkerLifecycle(c) => c.execute().await,
        Command::DesktopRunnerGateway(c) => c.execute().await,
        Command::Runner(args) => args.execute().await,
        Command::WorkerAgent(args) => args.execute().await,
        Command::Ctl(args) => ctl::run(args).await,
        Command::Admin(args) => admin::run(args).await,
    }
}
