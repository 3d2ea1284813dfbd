//! The run-coordinator service: owns the run lifecycle — every state
//! transition after creation, the event log, cancellation and receipts — and
//! serves run history and live event streams.

pub mod driver;
mod error;
mod metrics;
mod service;
mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use automesh_proto::coordinator::v1::run_coordinator_service_server::RunCoordinatorServiceServer;
use automesh_rpc::{GrpcServer, InternalCredential, RequireInternal, ServerSettings};
use automesh_store::{Store, StoreOptions};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::Error;
pub use service::Coordinator;

/// Settings of a run-coordinator process.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to listen on.
    #[arg(
        long = "listen",
        env = "AUTOMESH_COORDINATOR_LISTEN",
        default_value = "127.0.0.1:50054"
    )]
    pub listen: SocketAddr,
    /// Database URL: postgres://… or sqlite:….
    #[arg(long, env = "AUTOMESH_DATABASE_URL")]
    pub database_url: String,
    /// The executor of desktop runs (the desktop-runner-gateway).
    #[arg(long, env = "AUTOMESH_DESKTOP_EXECUTOR_ADDR")]
    pub desktop_executor_addr: Option<String>,
    /// The executor of cloud runs (the cloud-worker-lifecycle service).
    #[arg(long, env = "AUTOMESH_CLOUD_EXECUTOR_ADDR")]
    pub cloud_executor_addr: Option<String>,
    /// How long a run's lease lasts without a heartbeat.
    #[arg(long, env = "AUTOMESH_RUN_LEASE", default_value = "15s", value_parser = parse_duration)]
    pub lease: Duration,
    /// How long to wait for an executor to be idle after a cancellation.
    #[arg(long, env = "AUTOMESH_CANCEL_BOUND", default_value = "30s", value_parser = parse_duration)]
    pub cancel_bound: Duration,
    /// The model catalogue (JSON, docs/models.md), the same file the gateway
    /// reads: runs are asked of their provider by its names and priced at
    /// its prices. Without it, the development catalogue.
    #[arg(long, env = "AUTOMESH_MODELS_FILE")]
    pub models_file: Option<std::path::PathBuf>,
}

pub use automesh_rpc::runtime::parse_duration;

/// Clients of the configured executors, carrying the internal credential.
pub fn executors(
    desktop: Option<&str>,
    cloud: Option<&str>,
    credential: &InternalCredential,
) -> anyhow::Result<driver::Executors> {
    use automesh_proto::executor::v1::executor_service_client::ExecutorServiceClient;
    let client = |addr: Option<&str>| -> anyhow::Result<_> {
        Ok(match addr {
            Some(a) => Some(ExecutorServiceClient::new(automesh_rpc::internal_channel(
                a, credential,
            )?)),
            None => None,
        })
    };
    Ok(driver::Executors {
        desktop: client(desktop)?,
        cloud: client(cloud)?,
    })
}

/// Serves the coordinator on `listener` until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // A coordinator without an executor would let every run of that
    // placement wait out its whole deadline: refuse to start instead.
    let missing: Vec<&str> = [
        (
            config.desktop_executor_addr.as_deref(),
            "AUTOMESH_DESKTOP_EXECUTOR_ADDR (--desktop-executor-addr): the desktop-runner-gateway",
        ),
        (
            config.cloud_executor_addr.as_deref(),
            "AUTOMESH_CLOUD_EXECUTOR_ADDR (--cloud-executor-addr): the cloud-worker-lifecycle service",
        ),
    ]
    .into_iter()
    .filter(|(addr, _)| addr.is_none_or(|a| a.trim().is_empty()))
    .map(|(_, what)| what)
    .collect();
    anyhow::ensure!(
        missing.is_empty(),
        "the run-coordinator needs an executor for each placement; set {}",
        missing.join(" and ")
    );
    let models = automesh_domain::ModelCatalog::load(config.models_file.as_deref())
        .map_err(anyhow::Error::msg)?;
    let store = Store::connect_lazy(&config.database_url, StoreOptions::from_env())?;
    let executors = executors(
        config.desktop_executor_addr.as_deref(),
        config.cloud_executor_addr.as_deref(),
        &credential,
    )?;
    let settings = driver::Settings {
        lease: config.lease,
        cancel_bound: config.cancel_bound,
        models: Arc::new(models),
        ..driver::Settings::default()
    };
    serve(store, settings, executors, credential, listener, shutdown).await
}

/// Serves the coordinator over an existing store (used by `dev` mode and tests).
/// Both run until `shutdown`: the gRPC server and the claim loop with its
/// drivers. They live inside this future, so aborting it stops everything
/// at once, as a crash would.
pub async fn serve(
    store: Store,
    settings: driver::Settings,
    executors: driver::Executors,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    store.observe_pool(&automesh_rpc::metrics::meter());
    let context = Arc::new(driver::Context {
        store: store.clone(),
        executors,
        settings,
        owner: format!("coordinator-{}", uuid::Uuid::new_v4()),
        active: Default::default(),
    });
    let coordinator = Coordinator::new(context.clone(), shutdown.clone());
    let mut server = GrpcServer::new(ServerSettings::default())?;
    server.add_service(RunCoordinatorServiceServer::with_interceptor(
        coordinator,
        RequireInternal(credential),
    ));
    let claiming = driver::run_loop(context, shutdown.clone());
    let serving = server.serve(listener, shutdown, store.readiness_probe());
    let ((), served) = tokio::join!(claiming, serving);
    served?;
    Ok(())
}

automesh_rpc::service_main!(Config, "automesh-run-coordinator", "127.0.0.1:9454", run);
