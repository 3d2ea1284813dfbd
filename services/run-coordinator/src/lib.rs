//! The run-coordinator service: owns the run lifecycle — every state
//! transition after creation, the event log, cancellation and receipts — and
//! serves run history and live event streams.

pub mod drive;
mod error;
mod metrics;
mod service;
mod watch;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use automesh_proto::coordinator::v1::run_coordinator_service_server::RunCoordinatorServiceServer;
use automesh_rpc::{GrpcServer, InternalCredential, RequireInternal, ServerSettings};
use automesh_store::Store;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::Error;
pub use service::Coordinator;

automesh_rpc::service_config! {
    /// Settings of a run-coordinator process.
    listen("AUTOMESH_COORDINATOR_LISTEN", "127.0.0.1:50054"), database;
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
    /// The placements whose runs this replica claims and executes (comma
    /// separated); each needs its executor. Every replica serves run
    /// history and watches, whatever it executes.
    #[arg(
        long,
        env = "AUTOMESH_COORDINATOR_PLACEMENTS",
        value_delimiter = ',',
        default_value = "desktop,cloud"
    )]
    pub placements: Vec<automesh_domain::Placement>,
    /// How often to look for claimable runs when nothing wakes the claim
    /// loop (a safety net: new and released runs wake it at once).
    #[arg(long, env = "AUTOMESH_CLAIM_POLL", default_value = "500ms", value_parser = parse_duration)]
    pub claim_poll: Duration,
    /// How many runs this replica drives at once; a full replica claims no
    /// more until one of its runs ends (and claims the next at once then).
    #[arg(long, env = "AUTOMESH_COORDINATOR_MAX_RUNS", default_value_t = 1024)]
    pub max_runs: usize,
    #[command(flatten)]
    pub models: automesh_rpc::runtime::Models,
}

pub use automesh_domain::parse_duration;

/// The coordinator assembled from its configuration. Its binary, `dev` mode
/// and the test harness all start it the same way: [`Service::new`], then
/// [`Service::serve`].
#[derive(Debug)]
pub struct Service {
    /// What every drive of this replica shares: the store, the executors,
    /// the settings and its lease identity.
    context: Arc<drive::Context>,
    credential: InternalCredential,
    server: ServerSettings,
}

impl Service {
    /// Checks `config` and assembles the coordinator over `store`: it
    /// refuses to start without an executor for each placement, since every
    /// run of a placement without one would wait out its whole deadline.
    pub fn new(config: &Config, store: Store, credential: InternalCredential) -> Result<Self> {
        use automesh_domain::Placement;
        let executes = |p: Placement| config.placements.contains(&p);
        let missing: Vec<&str> = [
            (
                Placement::Desktop,
                config.desktop_executor_addr.as_deref(),
                "AUTOMESH_DESKTOP_EXECUTOR_ADDR (--desktop-executor-addr): the desktop-runner-gateway",
            ),
            (
                Placement::Cloud,
                config.cloud_executor_addr.as_deref(),
                "AUTOMESH_CLOUD_EXECUTOR_ADDR (--cloud-executor-addr): the cloud-worker-lifecycle service",
            ),
        ]
        .into_iter()
        .filter(|(p, addr, _)| executes(*p) && addr.is_none_or(|a| a.trim().is_empty()))
        .map(|(_, _, what)| what)
        .collect();
        anyhow::ensure!(
            missing.is_empty(),
            "the run-coordinator needs an executor for each placement it executes; set {}",
            missing.join(" and ")
        );
        for (bound, what) in [
            (config.lease, "the run lease (AUTOMESH_RUN_LEASE, --lease)"),
            (
                config.claim_poll,
                "the claim poll (AUTOMESH_CLAIM_POLL, --claim-poll)",
            ),
        ] {
            anyhow::ensure!(!bound.is_zero(), "{what} must be longer than 0");
        }
        anyhow::ensure!(
            config.max_runs > 0,
            "the most runs a replica drives (AUTOMESH_COORDINATOR_MAX_RUNS, --max-runs) must be at least 1"
        );
        use automesh_proto::executor::v1::executor_service_client::ExecutorServiceClient;
        let client = |p: Placement, addr: &Option<String>| -> anyhow::Result<_> {
            Ok(match addr.as_deref().filter(|_| executes(p)) {
                Some(addr) => Some(ExecutorServiceClient::new(automesh_rpc::internal_channel(
                    addr,
                    &credential,
                )?)),
                None => None,
            })
        };
        let executors = drive::Executors {
            desktop: client(Placement::Desktop, &config.desktop_executor_addr)?,
            cloud: client(Placement::Cloud, &config.cloud_executor_addr)?,
        };
        let settings = drive::Settings {
            lease: config.lease,
            cancel_bound: config.cancel_bound,
            poll: config.claim_poll,
            max_concurrent: config.max_runs,
            models: Arc::new(config.models.catalog()),
            ..drive::Settings::default()
        };
        store.observe_pool(&automesh_telemetry::metrics::meter());
        let context = Arc::new(drive::Context {
            store,
            executors,
            settings,
            owner: format!("coordinator-{}", uuid::Uuid::new_v4()),
            active: Default::default(),
        });
        Ok(Self {
            context,
            credential,
            server: ServerSettings::default().limited(&config.connections)?,
        })
    }

    /// Serves until `shutdown` is cancelled: the gRPC server and the claim
    /// loop with its drives, all inside this future, so aborting it stops
    /// everything at once, as a crash would.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        let store = self.context.store.clone();
        let coordinator = Coordinator::new(self.context.clone(), shutdown.clone());
        let mut server = GrpcServer::new(self.server.clone())?;
        server.add_service(RunCoordinatorServiceServer::with_interceptor(
            coordinator,
            RequireInternal(self.credential),
        ));
        let context = self.context;
        server
            .serve_beside(listener, shutdown, store.readiness_probe(), |stop| {
                drive::run_loop(context, stop)
            })
            .await?;
        Ok(())
    }
}

automesh_rpc::service_main!(
    Config,
    "automesh-run-coordinator",
    "127.0.0.1:9454",
    with_store
);
