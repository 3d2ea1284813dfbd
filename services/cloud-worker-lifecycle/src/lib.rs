//! The cloud-worker-lifecycle service: owns per-user cloud workers — their
//! records, wake, readiness, idle stop and MCP registration — and serves the
//! coordinator's executor contract for cloud runs (`cloud.rs`). Workers are
//! started by a pluggable driver (`driver.rs`).

pub mod cloud;
pub mod docker;
pub mod driver;
mod metrics;

use anyhow::Result;
use automesh_domain::Principal;
use automesh_domain::{CloudWorker, WorkerState};
use automesh_edge::convert;
use automesh_edge::status;
use automesh_proto::worker::v1 as wpb;
use automesh_proto::worker::v1::cloud_worker_lifecycle_service_server::{
    CloudWorkerLifecycleService, CloudWorkerLifecycleServiceServer,
};
use automesh_rpc::{GrpcServer, InternalCredential, RequireInternal, ServerSettings};
use automesh_store::Store;
use chrono::Utc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Status;

automesh_rpc::service_config! {
    /// Settings of a cloud-worker-lifecycle process.
    listen("AUTOMESH_LIFECYCLE_LISTEN", "127.0.0.1:50055"), database;
    /// The worker driver new workers are recorded with.
    #[arg(long, env = "AUTOMESH_WORKER_DRIVER", default_value = "local-process")]
    pub driver: String,
    /// The command that runs a worker agent (local-process driver); by
    /// default this binary's `worker-agent` subcommand.
    #[arg(long, env = "AUTOMESH_WORKER_AGENT_COMMAND", value_delimiter = ' ')]
    pub agent_command: Vec<String>,
    /// Where workers' working directories are created.
    #[arg(
        long,
        env = "AUTOMESH_WORKERS_DIR",
        default_value = ".automesh/workers"
    )]
    pub workers_dir: std::path::PathBuf,
    #[command(flatten)]
    pub worker: WorkerEnv,
    /// Docker driver: the Engine API socket.
    #[arg(
        long,
        env = "AUTOMESH_DOCKER_SOCKET",
        default_value = "/var/run/docker.sock"
    )]
    pub docker_socket: std::path::PathBuf,
    /// Docker driver: the worker image (its entrypoint runs `automesh`).
    #[arg(long, env = "AUTOMESH_WORKER_IMAGE", default_value = "automesh:latest")]
    pub worker_image: String,
    /// Cap on a worker becoming ready (terminal readiness_timeout).
    #[arg(long, env = "AUTOMESH_READINESS_CAP", default_value = "120s", value_parser = automesh_domain::parse_duration)]
    pub readiness_cap: std::time::Duration,
    /// Workers unused this long are stopped.
    #[arg(long, env = "AUTOMESH_WORKER_IDLE_AFTER", default_value = "15m", value_parser = automesh_domain::parse_duration)]
    pub idle_after: std::time::Duration,
    /// How often idle workers are looked for.
    #[arg(long, env = "AUTOMESH_WORKER_IDLE_CHECK", default_value = "30s", value_parser = automesh_domain::parse_duration)]
    pub idle_check: std::time::Duration,
    /// How long a replica holds a cloud run's drive or a worker's start
    /// without renewing it; a replica that dies hands both over this fast.
    #[arg(long, env = "AUTOMESH_CLOUD_LEASE", default_value = "15s", value_parser = automesh_domain::parse_duration)]
    pub lease: std::time::Duration,
    /// Local-process driver: an agent that hears from no lifecycle replica
    /// this long exits (replicas keep ready workers' agents alive every
    /// quarter of it).
    #[arg(long, env = "AUTOMESH_AGENT_ORPHAN_AFTER", default_value = "60s", value_parser = automesh_domain::parse_duration)]
    pub agent_orphan_after: std::time::Duration,
    /// Local-process driver: each agent dies with the replica that started
    /// it, so a stopped or killed replica leaves none behind (`false`: it
    /// lives on for another replica on the host to adopt, up to its orphan
    /// bound).
    #[arg(long, env = "AUTOMESH_AGENT_DIES_WITH_LIFECYCLE", default_value_t = true, action = clap::ArgAction::Set)]
    pub agent_dies_with_lifecycle: bool,
}

/// What cloud workers are given: their model provider, and the Connect
/// (MCP) endpoint of the users' tools.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerEnv {
    /// The model provider (OpenAI-compatible) cloud workers use
    /// [default: https://api.openai.com/v1; in `dev`, the built-in demo model].
    #[arg(long = "worker-provider-url", env = "AUTOMESH_WORKER_PROVIDER_URL")]
    pub provider_url: Option<String>,
    #[arg(
        long = "worker-provider-key",
        env = "AUTOMESH_WORKER_PROVIDER_API_KEY",
        hide_env_values = true,
        default_value = ""
    )]
    pub provider_key: automesh_domain::Secret,
    /// The Connect (MCP) endpoint of the users' tools; without it cloud runs
    /// end `mcp_config_missing` (and need attention).
    #[arg(long, env = "AUTOMESH_CONNECT_URL")]
    pub connect_url: Option<String>,
    #[arg(long, env = "AUTOMESH_CONNECT_TOKEN", hide_env_values = true, default_value = "")]
    pub connect_token: automesh_domain::Secret,
    /// Bound on one provider request of a cloud worker's engine.
    #[arg(long = "worker-request-timeout", env = "AUTOMESH_WORKER_REQUEST_TIMEOUT", default_value = "120s", value_parser = automesh_domain::parse_duration)]
    pub request_timeout: std::time::Duration,
    /// Cloud workers' engines use streaming completions.
    #[arg(long = "worker-stream", env = "AUTOMESH_WORKER_STREAM")]
    pub stream: bool,
    /// The step limit of a cloud worker's agent loop.
    #[arg(
        long = "worker-max-steps",
        env = "AUTOMESH_WORKER_MAX_STEPS",
        default_value_t = 32
    )]
    pub max_steps: u32,
}

/// The provider cloud workers use when none is configured.
pub const DEFAULT_PROVIDER_URL: &str = "https://api.openai.com/v1";

impl WorkerEnv {
    /// The configured provider, or OpenAI's.
    pub fn provider_url(&self) -> String {
        self.provider_url
            .clone()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_PROVIDER_URL.to_owned())
    }

    /// The engine settings every agent is started with.
    pub fn engine(&self) -> driver::EngineSettings {
        driver::EngineSettings {
            request_timeout: self.request_timeout,
            stream: self.stream,
            max_steps: self.max_steps,
        }
    }

    /// The Connect configuration, if any.
    pub fn connect(&self) -> Option<cloud::ConnectSettings> {
        self.connect_url.clone().map(|url| cloud::ConnectSettings {
            url,
            token: self.connect_token.clone(),
        })
    }

    /// A local-process driver running `command` for workers under `root`.
    pub fn local_driver(
        &self,
        command: Vec<String>,
        root: std::path::PathBuf,
    ) -> driver::LocalProcessDriver {
        driver::LocalProcessDriver::new(
            command,
            root,
            self.provider_url(),
            self.provider_key.clone(),
        )
        .with_engine(self.engine())
    }
}

impl Config {
    /// The cloud settings and the local-process driver these flags describe.
    pub fn cloud(
        &self,
    ) -> anyhow::Result<(
        std::sync::Arc<dyn driver::WorkerDriver>,
        cloud::CloudSettings,
    )> {
        let command = if self.agent_command.is_empty() {
            vec![
                std::env::current_exe()?.to_string_lossy().into_owned(),
                "worker-agent".into(),
            ]
        } else {
            self.agent_command.clone()
        };
        let driver: std::sync::Arc<dyn driver::WorkerDriver> = match self.driver.as_str() {
            "local-process" => std::sync::Arc::new(
                self.worker
                    .local_driver(command, self.workers_dir.clone())
                    .with_orphan_after(self.agent_orphan_after)
                    .with_die_with_parent(self.agent_dies_with_lifecycle),
            ),
            "docker" => std::sync::Arc::new(docker::DockerDriver {
                socket: self.docker_socket.clone(),
                image: self.worker_image.clone(),
                provider_url: self.worker.provider_url(),
                provider_key: self.worker.provider_key.clone(),
                engine: self.worker.engine(),
            }),
            other => anyhow::bail!("unknown worker driver {other:?} (local-process or docker)"),
        };
        let settings = cloud::CloudSettings {
            readiness_cap: self.readiness_cap,
            idle_after: self.idle_after,
            idle_check: self.idle_check,
            connect: self.worker.connect(),
            lease: self.lease,
            keepalive_every: (self.agent_orphan_after / 4).min(std::time::Duration::from_secs(15)),
        };
        Ok((driver, settings))
    }
}

/// The worker registry (`CloudWorkerLifecycleService`): registers and reads
/// users' cloud workers. The lifecycle itself — waking, admitting, watching
/// and idle-stopping workers — is `cloud::Cloud`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct WorkerRegistry {
    store: Store,
    driver: String,
}

impl WorkerRegistry {
    pub fn new(store: Store, driver: impl Into<String>) -> Self {
        Self {
            store,
            driver: driver.into(),
        }
    }
}

fn worker_to_pb(w: &CloudWorker) -> wpb::Worker {
    wpb::Worker {
        id: w.id.clone(),
        organization_id: w.org_id.clone(),
        owner_id: w.owner_id.clone(),
        state: match w.state {
            WorkerState::Stopped => wpb::WorkerState::Stopped,
            WorkerState::Starting => wpb::WorkerState::Starting,
            WorkerState::Ready => wpb::WorkerState::Ready,
            WorkerState::Stopping => wpb::WorkerState::Stopping,
            WorkerState::Failed => wpb::WorkerState::Failed,
        } as i32,
        driver: w.driver.clone(),
        create_time: Some(convert::timestamp(w.created_at)),
        update_time: Some(convert::timestamp(w.updated_at)),
    }
}

#[tonic::async_trait]
impl CloudWorkerLifecycleService for WorkerRegistry {
    automesh_edge::scoped_calls! {
        get_worker(wpb::GetWorkerRequest) -> wpb::GetWorkerResponse => serve_get;
        register_worker(wpb::RegisterWorkerRequest) -> wpb::RegisterWorkerResponse
            => serve_register;
    }
}

/// What each call does for its caller.
impl WorkerRegistry {
    async fn serve_get(
        &self,
        owner: Principal,
        _: wpb::GetWorkerRequest,
    ) -> Result<wpb::GetWorkerResponse, Status> {
        let worker = self.store.get_worker(&owner).await;
        let worker = worker.map_err(|e| status::of(&e, "cloud worker"))?;
        let worker = worker.ok_or_else(|| status::not_found("cloud worker"))?;
        Ok(wpb::GetWorkerResponse {
            worker: Some(worker_to_pb(&worker)),
        })
    }

    async fn serve_register(
        &self,
        owner: Principal,
        _: wpb::RegisterWorkerRequest,
    ) -> Result<wpb::RegisterWorkerResponse, Status> {
        let registered = self.store.register_worker(&owner, &self.driver, Utc::now());
        let worker = registered
            .await
            .map_err(|e| status::of(&e, "cloud worker"))?;
        tracing::info!(worker_id = %worker.id, driver = %worker.driver, "cloud worker registered");
        let worker = Some(worker_to_pb(&worker));
        Ok(wpb::RegisterWorkerResponse { worker })
    }
}

/// The lifecycle service assembled from its configuration. Its binary,
/// `dev` mode and the test harness all start it the same way:
/// [`Service::new`], then [`Service::serve`].
#[derive(Debug)]
pub struct Service {
    /// What [`cloud::Cloud`] is made of once the driver is final.
    driver: std::sync::Arc<dyn driver::WorkerDriver>,
    store: Store,
    settings: cloud::CloudSettings,
    credential: InternalCredential,
    server: ServerSettings,
}

impl Service {
    /// Checks `config` and assembles the service over `store`, with the
    /// worker driver the configuration names.
    pub fn new(config: &Config, store: Store, credential: InternalCredential) -> Result<Self> {
        for (bound, what) in [
            (
                config.readiness_cap,
                "the readiness cap (AUTOMESH_READINESS_CAP)",
            ),
            (
                config.idle_check,
                "the idle check (AUTOMESH_WORKER_IDLE_CHECK)",
            ),
            (config.lease, "the cloud lease (AUTOMESH_CLOUD_LEASE)"),
            (
                config.agent_orphan_after,
                "the agents' orphan bound (AUTOMESH_AGENT_ORPHAN_AFTER)",
            ),
        ] {
            anyhow::ensure!(!bound.is_zero(), "{what} must be longer than 0");
        }
        let (driver, settings) = config.cloud()?;
        store.observe_pool(&automesh_telemetry::metrics::meter());
        Ok(Self {
            driver,
            store,
            settings,
            credential,
            server: ServerSettings::default().limited(&config.connections)?,
        })
    }

    /// Replaces the configured worker driver with `driver`: for a container
    /// runtime no flag can name, such as a test's fake one.
    pub fn with_driver(mut self, driver: std::sync::Arc<dyn driver::WorkerDriver>) -> Self {
        self.driver = driver;
        self
    }

    /// Serves the lifecycle API and the cloud executor, and keeps workers
    /// (idle stop, keepalive, resumed drives), until `shutdown` is cancelled.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        let Self {
            driver,
            store,
            settings,
            credential,
            server,
        } = self;
        let registry = WorkerRegistry::new(store.clone(), driver.name());
        let cloud = cloud::Cloud::new(store.clone(), driver, settings, credential.clone());
        let mut server = GrpcServer::new(server)?;
        server.add_service(CloudWorkerLifecycleServiceServer::with_interceptor(
            registry,
            RequireInternal(credential.clone()),
        ));
        server.add_service(
            automesh_proto::executor::v1::executor_service_server::ExecutorServiceServer::with_interceptor(
                automesh_executor::Contract(cloud.clone()),
                RequireInternal(credential),
            ),
        );
        // Told to stop (a rolling restart): what this replica holds is
        // handed back at once, before the server drains, so another replica
        // resumes its runs' drives and its workers' starts now, not when
        // their leases lapse; its observe streams end, for their callers to
        // observe again elsewhere.
        let ended = CancellationToken::new();
        let handing_back = {
            let (cloud, shutdown, ended) = (cloud.clone(), shutdown.clone(), ended.clone());
            async move {
                tokio::select! {
                    () = shutdown.cancelled() => cloud.hand_back().await,
                    // The server ended by itself (an error): nothing to do.
                    () = ended.cancelled() => {}
                }
            }
        };
        let serving = async {
            let result = server
                .serve_beside(listener, shutdown, store.readiness_probe(), |stop| {
                    cloud.housekeeping(stop)
                })
                .await;
            ended.cancel();
            result
        };
        let (served, ()) = tokio::join!(serving, handing_back);
        served?;
        Ok(())
    }
}

automesh_rpc::service_main!(
    Config,
    "automesh-cloud-worker-lifecycle",
    "127.0.0.1:9455",
    with_store
);
