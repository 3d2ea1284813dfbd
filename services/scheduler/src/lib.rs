//! The scheduler service: owns automation definitions and schedules, keeps
//! each active automation's next occurrence, and creates runs (scheduled
//! occurrences and run-now) with ids derived so that each is created once.
//!
//! Handlers are thin: they convert protobuf into domain types with
//! `automesh_rpc::convert`, call [`Scheduler`], and map its [`Error`] into a
//! `Status` in one place.

mod error;
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
        occurrences::Settings {
            catch_up_window: self.catch_up_window,
            run_deadline: self.run_deadline,
            max_sleep: Duration::from_secs(1),
        }
    }
}

/// Parses `90s`, `30m`, `2h` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| s.split_at(i));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("expected a duration such as 90s, 30m or 2h, got {s:?}"))?;
    let secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => {
            return Err(format!(
                "unknown duration unit {unit:?} in {s:?}; use ms, s, m or h"
            ));
        }
    };
    Ok(Duration::from_secs(secs))
}

/// Serves the scheduler on `listener` until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let store = Store::connect_lazy(&config.database_url, StoreOptions::default())?;
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

impl automesh_rpc::runtime::ServiceMain for Config {
    const NAME: &'static str = "automesh-scheduler";

    fn listen(&self) -> SocketAddr {
        self.listen
    }

    async fn run(
        self,
        credential: InternalCredential,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        run(self, credential, listener, shutdown).await
    }
}

/// The service as a command: its settings plus the internal credential.
pub type Command = automesh_rpc::runtime::ServiceCommand<Config>;
