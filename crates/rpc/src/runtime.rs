//! What every service binary does around its server: bind the listener,
//! turn SIGINT/SIGTERM into a cancellation token, and make secrets.

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A token cancelled on SIGINT or SIGTERM, so servers drain and stop.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(error) => {
                        tracing::warn!(%error, "cannot listen for SIGTERM");
                        let _ = ctrl_c.await;
                        t.cancel();
                        return;
                    }
                };
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutdown requested: draining");
        t.cancel();
    });
    token
}

/// Runs a command to its end on a new async runtime: success, or its error
/// printed with its chain of causes (no backtrace) and a failing status.
pub fn exit_after(
    command: impl std::future::Future<Output = anyhow::Result<()>>,
) -> std::process::ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Binds a listener, naming the address in the error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
}

/// A fresh random secret (244 bits from the OS generator), URL-safe.
pub fn random_secret(prefix: &str) -> String {
    format!(
        "{prefix}{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// What a service process needs before it serves.
#[derive(Debug)]
pub struct Started {
    pub telemetry: automesh_telemetry::Telemetry,
    pub credential: crate::InternalCredential,
    pub listener: TcpListener,
    pub shutdown: CancellationToken,
}

/// Initialises telemetry, checks the internal credential, binds `listen`
/// and the metrics listener `metrics` (Prometheus text at `/metrics`),
/// and arms shutdown on SIGINT/SIGTERM.
pub async fn start(
    service: &str,
    listen: SocketAddr,
    metrics: SocketAddr,
    internal_token: &str,
) -> anyhow::Result<Started> {
    let telemetry = automesh_telemetry::init(service)?;
    let credential = crate::InternalCredential::new(internal_token)?;
    let listener = bind(listen).await?;
    let metrics_listener = bind(metrics).await?;
    tracing::info!(
        service,
        addr = %listen,
        metrics = %metrics_listener.local_addr()?,
        "listening"
    );
    let shutdown = shutdown_on_signal();
    tokio::spawn(automesh_telemetry::metrics::serve(
        telemetry.scrape(),
        metrics_listener,
        shutdown.clone(),
    ));
    Ok(Started {
        telemetry,
        credential,
        listener,
        shutdown,
    })
}

/// A service that can run as its own process: its settings know where it
/// listens and how it serves.
pub trait ServiceMain: clap::Args + Send + Sized + 'static {
    /// The service name, for telemetry and logs.
    const NAME: &'static str;
    /// Where its metrics listener listens unless told otherwise.
    const METRICS_LISTEN: &'static str;

    fn listen(&self) -> SocketAddr;

    fn run(
        self,
        credential: crate::InternalCredential,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> impl std::future::Future<Output = anyhow::Result<()>> + Send;
}

/// A service as a command: its settings plus the mesh's internal credential.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceCommand<C: clap::Args> {
    #[command(flatten)]
    pub config: C,
    /// The internal service credential shared by the mesh.
    #[arg(long, env = "AUTOMESH_INTERNAL_TOKEN", hide_env_values = true)]
    pub internal_token: automesh_domain::Secret,
    /// Where to serve metrics as Prometheus text (`GET /metrics`); each
    /// service has its own default port.
    #[arg(long, env = "AUTOMESH_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
}

impl<C: ServiceMain> ServiceCommand<C> {
    /// Runs the service until SIGINT or SIGTERM.
    pub async fn execute(self) -> anyhow::Result<()> {
        let metrics = match self.metrics_listen {
            Some(a) => a,
            None => C::METRICS_LISTEN.parse()?,
        };
        let started = start(
            C::NAME,
            self.config.listen(),
            metrics,
            self.internal_token.expose(),
        )
        .await?;
        self.config
            .run(started.credential, started.listener, started.shutdown)
            .await
    }
}

/// A service's configuration as its flags give it when started with only
/// `args`, reading no environment: what `dev` mode and the test harnesses
/// start from, so that every default is written once, on its flag.
pub fn config_from_args<C: clap::Args>(args: &[&str]) -> anyhow::Result<C> {
    let command = C::augment_args(clap::Command::new("automesh").no_binary_name(true))
        .mut_args(|a| a.env(None));
    let matches = command.try_get_matches_from(args)?;
    Ok(C::from_arg_matches(&matches)?)
}

/// The model catalogue flag the gateway, the run-coordinator and `dev`
/// share: the file is read as the flags are parsed, so a bad catalogue
/// stops a service before it serves.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Models {
    /// The model catalogue (JSON, docs/models.md). The gateway and the
    /// run-coordinator must read the same file: the one checks models
    /// against it, the other asks providers by its names and prices runs at
    /// its prices. Without it, the development catalogue.
    #[arg(
        long = "models-file",
        value_name = "FILE",
        env = "AUTOMESH_MODELS_FILE",
        value_parser = parse_models_file
    )]
    pub file: Option<automesh_domain::ModelCatalog>,
}

impl Models {
    /// These models, as if read from a file.
    pub fn of(catalog: automesh_domain::ModelCatalog) -> Self {
        Self {
            file: Some(catalog),
        }
    }

    /// The configured catalogue, or the development one.
    pub fn catalog(&self) -> automesh_domain::ModelCatalog {
        self.file
            .clone()
            .unwrap_or_else(automesh_domain::ModelCatalog::development)
    }
}

fn parse_models_file(path: &str) -> Result<automesh_domain::ModelCatalog, String> {
    automesh_domain::ModelCatalog::load(Some(std::path::Path::new(path)))
}

/// What every listener of a service accepts: flags every service has.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectionLimits {
    /// The most connections each of the service's listeners holds at once.
    /// At the cap it accepts no more until one closes (new ones wait in the
    /// kernel's backlog). Default: what the process's open-file limit
    /// allows, less a reserve for its other files.
    #[arg(long = "max-connections", env = "AUTOMESH_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// How long a new connection may take to send its first request (the
    /// HTTP/2 preface and the request's headers) before it is closed.
    #[arg(
        long = "first-request-within",
        env = "AUTOMESH_FIRST_REQUEST_WITHIN",
        default_value = "10s",
        value_parser = parse_duration
    )]
    pub first_request_within: std::time::Duration,
}

impl ConnectionLimits {
    /// Refuses limits that would let no connection in.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.max_connections != Some(0),
            "AUTOMESH_MAX_CONNECTIONS (--max-connections) must be at least 1"
        );
        anyhow::ensure!(
            !self.first_request_within.is_zero(),
            "AUTOMESH_FIRST_REQUEST_WITHIN (--first-request-within) must be longer than 0"
        );
        Ok(())
    }
}

pub use automesh_domain::parse_duration;

/// Makes a service's `Config` (with a `listen` field) runnable as its own
/// process: `service_main!(Config, "automesh-x", "127.0.0.1:9464", run)` implements
/// [`ServiceMain`] with the crate's `run(config, credential, listener,
/// shutdown)` and defines `Command`.
///
/// `with_store` in place of `run`: the binary opens its own pool on the
/// configured database and serves the crate's `Service` over it.
#[macro_export]
macro_rules! service_main {
    ($config:ty, $name:literal, $metrics:literal, with_store) => {
        /// The binary: its own pool on the configured database.
        async fn run(
            config: $config,
            credential: $crate::InternalCredential,
            listener: ::tokio::net::TcpListener,
            shutdown: ::tokio_util::sync::CancellationToken,
        ) -> ::anyhow::Result<()> {
            let store = ::automesh_store::Store::connect_lazy(
                &config.database_url,
                ::automesh_store::StoreOptions::from_env(),
            )?;
            // A schema newer than this binary knows is refused before
            // anything serves.
            store.refuse_newer_schema().await?;
            Service::new(&config, store, credential)?
                .serve(listener, shutdown)
                .await
        }

        $crate::service_main!($config, $name, $metrics, run);
    };
    ($config:ty, $name:literal, $metrics:literal, $run:path) => {
        impl $crate::runtime::ServiceMain for $config {
            const NAME: &'static str = $name;
            const METRICS_LISTEN: &'static str = $metrics;

            fn listen(&self) -> ::std::net::SocketAddr {
                self.listen
            }

            async fn run(
                self,
                credential: $crate::InternalCredential,
                listener: ::tokio::net::TcpListener,
                shutdown: ::tokio_util::sync::CancellationToken,
            ) -> ::anyhow::Result<()> {
                $run(self, credential, listener, shutdown).await
            }
        }

        /// The service as a command: its settings plus the internal credential.
        pub type Command = $crate::runtime::ServiceCommand<$config>;
    };
}

/// Declares a service's `Config`: where it listens (`--listen`, with the
/// service's own variable and default), with `database` its database
/// (`--database-url`, `AUTOMESH_DATABASE_URL`), then its own fields.
///
/// ```ignore
/// automesh_rpc::service_config! {
///     /// Settings of a scheduler process.
///     listen("AUTOMESH_SCHEDULER_LISTEN", "127.0.0.1:50053"), database;
///     /// How long a run may take.
///     #[arg(long, default_value = "30m", value_parser = parse_duration)]
///     pub run_deadline: Duration,
/// }
/// ```
#[macro_export]
macro_rules! service_config {
    ($(#[$meta:meta])* listen($env:literal, $default:literal), database; $($fields:tt)*) => {
        $crate::service_config! {
            $(#[$meta])* listen($env, $default);
            /// Database URL: postgres://… or sqlite:….
            #[arg(long, env = "AUTOMESH_DATABASE_URL")]
            pub database_url: String,
            $($fields)*
        }
    };
    ($(#[$meta:meta])* listen($env:literal, $default:literal); $($fields:tt)*) => {
        $(#[$meta])*
        #[derive(Debug, Clone, clap::Args)]
        pub struct Config {
            /// Address to listen on.
            #[arg(long = "listen", env = $env, default_value = $default)]
            pub listen: ::std::net::SocketAddr,
            #[command(flatten)]
            pub connections: $crate::runtime::ConnectionLimits,
            $($fields)*
        }
    };
}

/// A service's own binary: `service_binary!(automesh_scheduler,
/// "automesh-scheduler", "The automesh scheduler service")` parses the
/// service's command and runs it until SIGINT or SIGTERM.
#[macro_export]
macro_rules! service_binary {
    ($service:ident, $name:literal, $about:literal) => {
        #[derive(Debug, clap::Parser)]
        #[command(name = $name, about = $about, version)]
        struct Cli {
            #[command(flatten)]
            command: $service::Command,
        }

        #[tokio::main]
        async fn main() -> anyhow::Result<()> {
            <Cli as clap::Parser>::parse().command.execute().await
        }
    };
}
