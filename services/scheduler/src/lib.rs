//! The scheduler service: owns automation definitions and schedules, keeps
//! each active automation's next occurrence, and creates runs (scheduled
//! occurrences and run-now) with ids derived so that each is created once.
//!
//! Handlers are thin: they convert protobuf into domain types with
//! `automesh_edge::convert`, call [`Scheduler`], and map its [`Error`] into a
//! `Status` in one place.

pub mod budget;
mod error;
mod metrics;
pub mod occurrences;
mod service;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use automesh_proto::scheduler::v1::scheduler_service_server::SchedulerServiceServer;
use automesh_rpc::{GrpcServer, InternalCredential, RequireInternal, ServerSettings};
use automesh_store::Store;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use error::Error;
pub use service::Scheduler;

automesh_rpc::service_config! {
    /// Settings of a scheduler process.
    listen("AUTOMESH_SCHEDULER_LISTEN", "127.0.0.1:50053"), database;
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

pub use automesh_domain::parse_duration;

/// The scheduler assembled from its configuration. Its binary, `dev` mode
/// and the test harness all start it the same way: [`Service::new`], then
/// [`Service::serve`].
#[derive(Debug)]
pub struct Service {
    /// The gRPC server, the scheduler service added.
    server: GrpcServer,
    /// What the occurrence loop runs on; `wake` is how an edit wakes it.
    store: Store,
    settings: occurrences::Settings,
    wake: Arc<Notify>,
}

impl Service {
    /// Checks `config` and assembles the scheduler over `store`.
    pub fn new(config: &Config, store: Store, credential: InternalCredential) -> Result<Self> {
        anyhow::ensure!(
            !config.run_deadline.is_zero(),
            "the run deadline (AUTOMESH_RUN_DEADLINE, --run-deadline) must be longer than 0"
        );
        store.observe_pool(&automesh_telemetry::metrics::meter());
        // An edit wakes the occurrence loop.
        let wake = Arc::new(Notify::new());
        let scheduler = Scheduler::new(store.clone(), config.run_deadline, wake.clone());
        let mut server = GrpcServer::new(ServerSettings::default().limited(&config.connections)?)?;
        server.add_service(SchedulerServiceServer::with_interceptor(
            scheduler,
            RequireInternal(credential),
        ));
        Ok(Self {
            server,
            store,
            settings: config.settings(),
            wake,
        })
    }

    /// Serves until `shutdown` is cancelled: the gRPC server and the
    /// occurrence loop, both inside this future, so aborting it stops
    /// everything at once, as a crash would.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        let Self {
            server,
            store,
            settings,
            wake,
        } = self;
        let probe = store.readiness_probe();
        server
            .serve_beside(listener, shutdown, probe, |stop| {
                occurrences::run_loop(store, settings, wake, stop)
            })
            .await?;
        Ok(())
    }
}

automesh_rpc::service_main!(Config, "automesh-scheduler", "127.0.0.1:9453", with_store);
