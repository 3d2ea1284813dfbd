//! The scheduler service: owns automation definitions and schedules, keeps
//! each active automation's next occurrence, and creates runs (scheduled
//! occurrences and run-now) with ids derived so that each is created once.
//!
//! Handlers are thin: they convert protobuf into domain types with
//! `automesh_rpc::convert`, call [`Scheduler`], and map its [`Error`] into a
//! `Status` in one place.

mod error;
mod metrics;
pub mod occurrences;
mod service;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use automesh_proto::scheduler::v1::scheduler_service_server::SchedulerServiceServer;
use automesh_rpc::{GrpcServer, InternalCredential, RequireInternal, ServerSettings};
use automesh_store::{Store, StoreOptions};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use error::Error;
pub use service::Scheduler;

/// Settings of a scheduler process.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to listen on.
    #[arg(
        long = "listen",
        env = "AUTOMESH_SCHEDULER_LISTEN",
        default_value = "127.0.0.1:50053"
    )]
    pub listen: SocketAddr,
    /// Database URL: postgres://… or sqlite:….
    #[arg(long, env = "AUTOMESH_DATABASE_URL")]
    pub database_url: String,
    /// How long a run may take from creation to its end, wake-up and
    /// admission included (for example 30m, 2h).
    #[arg(long, env = "AUTOMESH_RUN_DEADLINE", default_value = "30m", value_parser = parse_duration)]
    pub run_deadline: Duration,
    /// How late the latest occurrence missed during downtime may be and
    /// still run once; older ones are recorded missed.
    #[arg(long, env = "AUTOMESH_CATCH_UP_WINDOW", default_value = "1h", value_parser = parse_duration)]
    pub catch_up_window: Duration,
}

impl Config {
    pub fn settings(&self) -> occurrences::Settings {
        occurrences::Settings::new(self.run_deadline, self.catch_up_window)
    }
}

pub use automesh_rpc::runtime::parse_duration;

/// Serves the scheduler on `listener` until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let store = Store::connect_lazy(&config.database_url, StoreOptions::from_env())?;
    serve(store, config.settings(), credential, listener, shutdown).await
}

/// Serves the scheduler over an existing store (used by `dev` mode and tests).
/// Both run until `shutdown`: the gRPC server and the occurrence loop. The
/// loop lives inside this future, so aborting it stops everything.
pub async fn serve(
    store: Store,
    settings: occurrences::Settings,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    store.observe_pool(&automesh_rpc::metrics::meter());
    let wake = Arc::new(Notify::new());
    let scheduler = Scheduler::new(store.clone(), settings.run_deadline, wake.clone());
    let mut server = GrpcServer::new(ServerSettings::default())?;
    server.add_service(SchedulerServiceServer::with_interceptor(
        scheduler,
        RequireInternal(credential),
    ));
    let looping = occurrences::run_loop(store.clone(), settings, wake, shutdown.clone());
    let serving = server.serve(listener, shutdown, store.readiness_probe());
    let ((), served) = tokio::join!(looping, serving);
    served?;
    Ok(())
}

automesh_rpc::service_main!(Config, "automesh-scheduler", "127.0.0.1:9453", run);
