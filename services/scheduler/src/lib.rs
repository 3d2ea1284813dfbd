//! The scheduler service: owns automation definitions and schedules, keeps
//! each active automation's next occurrence, and creates runs (scheduled
//! occurrences and run-now) with ids derived so that each is created once.
//!
//! Handlers are thin: they convert protobuf into domain types with
//! `automesh_edge::convert`, call [`Scheduler`], and map its [`Error`] into a
//! `Status` in one place.

pub mod budget;
pub mod delivery;
mod error;
mod metrics;
pub mod occurrences;
pub mod retention;
mod service;
pub mod webhooks;

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
    /// The operator's notification key: each webhook endpoint's signing
    /// secret is derived from it (nothing secret is stored). Without it,
    /// webhook endpoints cannot be created and nothing is delivered. Keep
    /// it stable: a new key changes every endpoint's secret.
    #[arg(long, env = "AUTOMESH_NOTIFICATION_KEY", hide_env_values = true)]
    pub notification_key: Option<automesh_domain::Secret>,
    /// Allow http:// webhook endpoints (development only).
    #[arg(long, env = "AUTOMESH_WEBHOOK_ALLOW_HTTP")]
    pub webhook_allow_http: bool,
    /// Allow webhook endpoints on loopback, private and link-local
    /// addresses (development only; otherwise refused at creation and at
    /// every delivery, whatever a name resolves to).
    #[arg(long, env = "AUTOMESH_WEBHOOK_ALLOW_PRIVATE")]
    pub webhook_allow_private: bool,
    /// Bound on one delivery attempt (connect, send, answer).
    #[arg(long, env = "AUTOMESH_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub webhook_timeout: Duration,
    /// The wait before a failed message's first retry; each next one
    /// doubles it, up to an hour, with jitter.
    #[arg(long, env = "AUTOMESH_WEBHOOK_FIRST_RETRY", default_value = "5s", value_parser = parse_duration)]
    pub webhook_first_retry: Duration,
    /// How long a message is retried; then its endpoint is disabled, with
    /// the reason shown to its owner.
    #[arg(long, env = "AUTOMESH_WEBHOOK_RETRY_FOR", default_value = "24h", value_parser = parse_duration)]
    pub webhook_retry_for: Duration,
    /// Days a finished run (its events, receipt) and a webhook message done
    /// with are kept, unless its organisation has its own (`automesh
    /// retention set`); 0 keeps everything.
    #[arg(long, env = "AUTOMESH_RETENTION_DAYS", default_value_t = automesh_store::retention::DEFAULT_RETENTION_DAYS)]
    pub retention_days: u32,
    /// How often retention runs (one scheduler replica at a time).
    #[arg(long, env = "AUTOMESH_RETENTION_EVERY", default_value = "1h", value_parser = parse_duration)]
    pub retention_every: Duration,
    /// Runs deleted per transaction by retention (each batch is short, so
    /// no lock is held for long).
    #[arg(long, env = "AUTOMESH_RETENTION_BATCH", default_value_t = 500)]
    pub retention_batch: u32,
}

impl Config {
    pub fn settings(&self) -> occurrences::Settings {
        occurrences::Settings::new(self.run_deadline, self.catch_up_window)
    }

    /// Retention settings; `None` when everything is kept.
    pub fn retention(&self) -> Result<Option<retention::Settings>> {
        if self.retention_days == 0 {
            return Ok(None);
        }
        let most = automesh_store::retention::MAX_RETENTION_DAYS;
        anyhow::ensure!(
            self.retention_days <= most,
            "--retention-days (AUTOMESH_RETENTION_DAYS) is at most {most}, or 0 to keep everything"
        );
        anyhow::ensure!(
            (1..=100_000).contains(&self.retention_batch),
            "--retention-batch (AUTOMESH_RETENTION_BATCH) is 1 to 100000"
        );
        anyhow::ensure!(
            self.retention_every >= Duration::from_secs(60),
            "--retention-every (AUTOMESH_RETENTION_EVERY) is at least 1m"
        );
        Ok(Some(retention::Settings {
            policy: automesh_store::retention::Policy {
                default_days: self.retention_days,
                batch: self.retention_batch,
                ..Default::default()
            },
            every: self.retention_every,
        }))
    }

    /// Webhook settings, when the operator gave a notification key.
    pub fn webhooks(&self) -> Result<Option<Arc<webhooks::Webhooks>>> {
        let Some(key) = &self.notification_key else {
            return Ok(None);
        };
        anyhow::ensure!(
            key.expose().len() >= 16,
            "the notification key (AUTOMESH_NOTIFICATION_KEY, --notification-key) must be at least 16 bytes"
        );
        for (name, d) in [
            ("--webhook-timeout", self.webhook_timeout),
            ("--webhook-first-retry", self.webhook_first_retry),
            ("--webhook-retry-for", self.webhook_retry_for),
        ] {
            anyhow::ensure!(!d.is_zero(), "{name} must be longer than 0");
        }
        Ok(Some(Arc::new(webhooks::Webhooks {
            key: key.clone(),
            allow_http: self.webhook_allow_http,
            allow_private: self.webhook_allow_private,
            timeout: self.webhook_timeout,
            first_retry: self.webhook_first_retry,
            retry_for: self.webhook_retry_for,
        })))
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
    webhooks: Option<Arc<webhooks::Webhooks>>,
    retention: Option<retention::Settings>,
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
        let webhooks = config.webhooks()?;
        let retention = config.retention()?;
        let scheduler = Scheduler::new(
            store.clone(),
            config.run_deadline,
            wake.clone(),
            webhooks.clone(),
        );
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
            webhooks,
            retention,
        })
    }

    /// Serves until `shutdown` is cancelled: the gRPC server, the
    /// occurrence loop, retention and (with a notification key) webhook
    /// delivery, all inside this future, so aborting it stops everything
    /// at once, as a crash would.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        let Self {
            server,
            store,
            settings,
            wake,
            webhooks,
            retention,
        } = self;
        let probe = store.readiness_probe();
        server
            .serve_beside(listener, shutdown, probe, |stop| async move {
                let delivery = async {
                    if let Some(webhooks) = webhooks {
                        delivery::run_loop(store.clone(), webhooks, stop.clone()).await;
                    }
                };
                let history = async {
                    match retention {
                        Some(retention) => {
                            retention::run_loop(store.clone(), retention, stop.clone()).await;
                        }
                        None => retention::weeks_loop(store.clone(), stop.clone()).await,
                    }
                };
                let occurrences =
                    occurrences::run_loop(store.clone(), settings, wake, stop.clone());
                tokio::join!(occurrences, delivery, history);
            })
            .await?;
        Ok(())
    }
}

automesh_rpc::service_main!(Config, "automesh-scheduler", "127.0.0.1:9453", with_store);
