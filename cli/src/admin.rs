//! `automesh admin`: operator tasks that go to internal services with the
//! internal credential.

use anyhow::Context;
use automesh_domain::Principal;
use automesh_edge::convert;
use automesh_proto::worker::v1 as wpb;
use automesh_proto::worker::v1::cloud_worker_lifecycle_service_client::CloudWorkerLifecycleServiceClient;
use automesh_rpc::{InternalCredential, internal_channel};
use clap::{Args, Subcommand};

#[derive(Debug, Args)]
pub struct AdminArgs {
    /// The internal service credential; defaults to <data-dir>/internal-token.
    #[arg(long, env = "AUTOMESH_INTERNAL_TOKEN", hide_env_values = true, global = true)]
    internal_token: Option<automesh_domain::Secret>,
    #[command(flatten)]
    data_dir: crate::dev::DataDir,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Debug, Subcommand)]
enum AdminCommand {
    /// Record that a user has a cloud worker (it starts stopped; the
    /// lifecycle wakes it for the user's first cloud run). Creating a cloud
    /// automation needs one: nothing is allocated silently. Registering an
    /// existing worker again changes nothing.
    RegisterWorker {
        /// The user (the `sub` of their bearer tokens).
        #[arg(long)]
        user: String,
        /// The user's organisation (the `org` of their bearer tokens).
        #[arg(long)]
        org: String,
        /// The cloud-worker-lifecycle service (any replica).
        #[arg(long, env = "AUTOMESH_LIFECYCLE_ADDR", default_value = "http://127.0.0.1:50055")]
        lifecycle_addr: String,
    },
}

pub async fn run(args: AdminArgs) -> anyhow::Result<()> {
    let secret = match args.internal_token {
        Some(t) => t.expose().to_owned(),
        None => {
            let path = args.data_dir.path.join("internal-token");
            std::fs::read_to_string(&path)
                .with_context(|| {
                    format!(
                        "no internal credential: pass --internal-token or run `automesh dev` ({})",
                        path.display()
                    )
                })?
                .trim()
                .to_owned()
        }
    };
    let credential = InternalCredential::new(secret)?;
    match args.command {
        AdminCommand::RegisterWorker {
            user,
            org,
            lifecycle_addr,
        } => {
            let mut client = CloudWorkerLifecycleServiceClient::new(internal_channel(
                &lifecycle_addr,
                &credential,
            )?);
            let worker = client
                .register_worker(wpb::RegisterWorkerRequest {
                    caller: Some(convert::caller(&Principal::new(org, user))),
                })
                .await
                .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
                .into_inner()
                .worker
                .unwrap_or_default();
            println!(
                "worker {} of {}/{} is {:?}",
                worker.id,
                worker.organization_id,
                worker.owner_id,
                wpb::WorkerState::try_from(worker.state).unwrap_or_default()
            );
        }
    }
    Ok(())
}
