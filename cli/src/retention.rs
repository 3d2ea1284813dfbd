//! `automesh retention`: an operator's view and settings of how long
//! history is kept (docs/retention.md), straight on the database like
//! `automesh migrate`: each organisation's own retention, and a pass run
//! now (the schedulers run one every `--retention-every` by themselves).

use anyhow::Context;
use automesh_store::retention::{DEFAULT_RETENTION_DAYS, MAX_RETENTION_DAYS, Policy};
use clap::{Args, Subcommand};

#[derive(Debug, Args)]
pub struct RetentionArgs {
    /// Database URL: postgres://… or sqlite:….
    #[arg(long, env = "AUTOMESH_DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: RetentionCommand,
}

#[derive(Debug, Subcommand)]
enum RetentionCommand {
    /// The organisations with a retention of their own, and when the last
    /// pass ran.
    List,
    /// Give an organisation a retention of its own (its finished runs,
    /// their events and receipts, and its webhook messages are kept this
    /// many days).
    Set {
        /// The organisation (the `org` of its users' bearer tokens).
        #[arg(long)]
        org: String,
        /// Days kept, 1 to 36500.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_RETENTION_DAYS)))]
        days: u32,
    },
    /// Return an organisation to the schedulers' default retention.
    Unset {
        #[arg(long)]
        org: String,
    },
    /// Run one retention pass now, whatever the schedulers' timetable, and
    /// say what it deleted.
    Run {
        /// Days kept for organisations without their own (the schedulers'
        /// `--retention-days`).
        #[arg(long, env = "AUTOMESH_RETENTION_DAYS", default_value_t = DEFAULT_RETENTION_DAYS,
              value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_RETENTION_DAYS)))]
        days: u32,
        /// Runs deleted per transaction.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch: u32,
    },
}

pub async fn run(args: RetentionArgs) -> anyhow::Result<()> {
    let url = args
        .database_url
        .context("no database: pass --database-url or set AUTOMESH_DATABASE_URL")?;
    let store = automesh_store::Store::connect_lazy(&url, Default::default())
        .context("cannot open the database")?;
    store.ping().await.context("the database does not answer")?;
    // A schema this binary does not know is named, with both versions.
    store.check_schema().await?;
    let internal = store.internal();
    let now = chrono::Utc::now();
    match args.command {
        RetentionCommand::List => {
            let overrides = internal.org_retentions().await?;
            if overrides.is_empty() {
                println!("no organisation has a retention of its own");
            }
            for (org, days) in overrides {
                println!("{org}\t{days} days");
            }
            match internal.last_retention_pass().await? {
                Some(at) => println!("last pass finished {}", at.to_rfc3339()),
                None => println!("no pass has run yet"),
            }
        }
        RetentionCommand::Set { org, days } => {
            internal.set_org_retention(&org, days, now).await?;
            println!("{org} keeps finished runs {days} days");
        }
        RetentionCommand::Unset { org } => {
            if internal.clear_org_retention(&org).await? {
                println!("{org} follows the default retention again");
            } else {
                println!("{org} had no retention of its own: nothing changed");
            }
        }
        RetentionCommand::Run { days, batch } => {
            eprintln!("retention pass: keeping {days} days unless an organisation says otherwise");
            let policy = Policy {
                default_days: days,
                batch,
                // An operator waits for the whole of it.
                time_bound: std::time::Duration::from_secs(24 * 3600),
            };
            let pass = internal.purge_expired(policy, now).await?;
            internal
                .finish_retention_pass(chrono::Utc::now(), None)
                .await?;
            for (table, n) in pass.purged.by_table() {
                println!("{table}\t{n} deleted");
            }
            println!("organisations visited\t{}", pass.orgs);
            if !pass.weeks_dropped.is_empty() {
                println!("week partitions dropped\t{}", pass.weeks_dropped.join(" "));
            }
            if let Some(oldest) = pass.oldest_kept {
                println!("oldest finished run kept\t{}", oldest.to_rfc3339());
            }
        }
    }
    store.close().await;
    Ok(())
}
