//! `automesh`: one binary for the whole mesh.
//!
//! - `automesh dev` starts every service in one process on SQLite;
//! - `automesh console` serves the web console (a client of the gateway);
//! - `automesh gateway|scheduler|run-coordinator|cloud-worker-lifecycle|desktop-runner-gateway`
//!   runs one service, for separate deployment;
//! - `automesh runner` is the reference desktop runner;
//! - `automesh ctl` drives the public API for people;
//! - `automesh admin` does operator tasks on internal services;
//! - `automesh migrate` applies the database migrations once;
//! - `automesh retention` shows and sets how long history is kept.

mod admin;
mod ctl;
mod dev;
mod retention;

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
    /// Apply the database migrations this binary knows, once, then exit
    /// (a deployment's migration job; services refuse a newer schema).
    Migrate(MigrateArgs),
    /// How long finished runs are kept: each organisation's own retention,
    /// and a pass run now.
    Retention(retention::RetentionArgs),
}

#[derive(Debug, clap::Args)]
struct MigrateArgs {
    /// Database URL: postgres://… or sqlite:….
    #[arg(long, env = "AUTOMESH_DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Give up when the database does not answer within this long.
    #[arg(long, default_value = "60s", value_parser = automesh_domain::parse_duration)]
    wait: std::time::Duration,
}

/// `automesh migrate`: waits (bounded) for the database, refuses a schema
/// newer than this binary, applies what is missing and says so.
async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let store = automesh_store::Store::connect_lazy(&args.database_url, Default::default())
        .context("cannot open the database")?;
    let give_up = tokio::time::Instant::now() + args.wait;
    let before = loop {
        match store.ping().await {
            Ok(()) => break store.schema_version().await?,
            Err(error) if tokio::time::Instant::now() < give_up => {
                eprintln!("waiting for the database: {error}");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            Err(error) => {
                anyhow::bail!(
                    "the database did not answer within {:?}: {error}",
                    args.wait
                )
            }
        }
    };
    store.refuse_newer_schema().await?;
    store.migrate().await.context("migration failed")?;
    let after = store.schema_version().await?.unwrap_or_default();
    match before {
        Some(v) if v == after => println!("schema at version {after}: nothing to apply"),
        Some(v) => println!("schema migrated from version {v} to {after}"),
        None => println!("schema created at version {after}"),
    }
    store.close().await;
    Ok(())
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
        Command::Migrate(args) => migrate(args).await,
        Command::Retention(args) => retention::run(args).await,
    }
}
