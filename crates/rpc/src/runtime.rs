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
    pub telemetry: crate::telemetry::Telemetry,
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
    let telemetry = crate::telemetry::init(service)?;
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
    tokio::spawn(crate::metrics::serve(
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
    pub internal_token: crate::auth::Secret,
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

/// Parses `500ms`, `90s`, `30m`, `2h` or a bare number of seconds (for
/// duration flags).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| s.split_at(i));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("expected a duration such as 500ms, 90s, 30m or 2h, got {s:?}"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => {
            return Err(format!(
                "unknown duration unit {unit:?} in {s:?}; use ms, s, m or h"
            ));
        }
    })
}

/// Makes a service's `Config` (with a `listen` field) runnable as its own
/// process: `service_main!(Config, "automesh-x", "127.0.0.1:9464", run)` implements
/// [`ServiceMain`] with the crate's `run(config, credential, listener,
/// shutdown)` and defines `Command`.
#[macro_export]
macro_rules! service_main {
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
