//! The web console: automations and runs in the browser, live.
//!
//! Server-rendered pages (maud templates compiled into the binary) and one
//! small script, served over HTTP/1.1 and HTTP/2 (h2c). It is a client of
//! the public API only ([`api`]): every page is built from `automesh.v1`
//! calls made with the signed-in user's own token ([`session`]), so the
//! gateway stays the one place that authenticates, validates and scopes.

pub mod api;
mod assets;
mod failure;
mod form;
mod live;
mod observe;
mod pages;
pub mod session;
pub mod time;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use axum::Router;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use failure::Failure;

/// Live run pages open in this process now (what
/// `automesh.console.live.watchers` reports).
pub fn live_pages() -> u64 {
    live::Watchers::open()
}
pub use form::Form;

/// Settings of a console process.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to serve browsers on (HTTP/1.1 and HTTP/2).
    #[arg(
        long = "listen",
        env = "AUTOMESH_CONSOLE_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    pub listen: SocketAddr,
    /// The public API gateway the console calls, as the signed-in user.
    #[arg(long, env = "AUTOMESH_CONSOLE_GATEWAY", default_value = "http://127.0.0.1:50051")]
    pub gateway: String,
    /// The key that signs the forms' CSRF tokens (at least 16 characters).
    /// Replicas behind one address must share it. Without it, a random key
    /// per process: a form opened before a restart is refused once, and the
    /// page offers a fresh one.
    #[arg(long, env = "AUTOMESH_CONSOLE_KEY", hide_env_values = true)]
    pub key: Option<automesh_domain::Secret>,
    /// Mark the cookies `Secure`: set it whenever browsers reach the console
    /// over TLS (a terminating proxy in front of it).
    #[arg(long, env = "AUTOMESH_CONSOLE_SECURE_COOKIES")]
    pub secure_cookies: bool,
    /// How long one call to the gateway may take before the page says the
    /// gateway is not answering.
    #[arg(
        long,
        env = "AUTOMESH_CONSOLE_GATEWAY_TIMEOUT",
        default_value = "10s",
        value_parser = automesh_domain::parse_duration
    )]
    pub gateway_timeout: Duration,
}

/// What every handler shares. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    pub(crate) api: api::Api,
    pub(crate) signer: session::Signer,
    pub(crate) secure: bool,
    /// `automesh dev`'s one-click sign-in: the dev user's token.
    pub(crate) dev_token: Option<Arc<automesh_domain::Secret>>,
    pub(crate) live: live::Watchers,
    pub(crate) shutdown: CancellationToken,
}

/// The console assembled from its configuration; its binary, `dev` mode and
/// the tests start it alike: [`Service::new`], then [`Service::serve`].
#[derive(Debug)]
pub struct Service {
    state: AppState,
}

impl Service {
    pub fn new(config: &Config) -> Result<Self> {
        let key = match &config.key {
            Some(k) => k.expose().to_owned(),
            None => automesh_rpc::runtime::random_secret("console_"),
        };
        Ok(Self {
            state: AppState {
                api: api::Api::new(&config.gateway, config.gateway_timeout)?,
                signer: session::Signer::new(&key)?,
                secure: config.secure_cookies,
                dev_token: None,
                live: live::Watchers,
                shutdown: CancellationToken::new(),
            },
        })
    }

    /// Offers a one-click sign-in as the holder of `token` (`automesh dev`
    /// only: there is no flag for it, so a deployed console never has one).
    pub fn with_dev_sign_in(mut self, token: String) -> Self {
        self.state.dev_token = Some(Arc::new(token.into()));
        self
    }

    /// The console's routes, for serving and for handler tests.
    pub fn router(&self) -> Router {
        router(self.state.clone())
    }

    /// Serves browsers on `listener` until `shutdown` is cancelled; live
    /// pages end their streams then, and the drain is bounded.
    pub async fn serve(mut self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        self.state.shutdown = shutdown.clone();
        let app = self.router();
        tracing::info!(addr = %listener.local_addr()?, "console serving");
        let stopping = shutdown.clone();
        let serving = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stopping.cancelled().await });
        tokio::select! {
            served = serving => served?,
            () = async {
                shutdown.cancelled().await;
                tokio::time::sleep(Duration::from_secs(10)).await;
            } => tracing::warn!("console connections did not drain within 10 s; stopping"),
        }
        Ok(())
    }
}

fn router(state: AppState) -> Router {
    use pages::{automation, automations, edit, preview, runners, runs, sign_in, webhooks};
    Router::new()
        .route("/", get(automations::list))
        .route("/automations/bulk", post(automations::bulk))
        .route("/automations/new", get(edit::new_form))
        .route("/automations", post(edit::create))
        .route("/preview", get(preview::preview))
        .route("/automations/{id}", get(automation::page))
        .route(
            "/automations/{id}/edit",
            get(edit::edit_form).post(edit::update),
        )
        .route("/automations/{id}/{action}", post(automation::act))
        .route("/runs/{id}", get(runs::page))
        .route("/runs/{id}/cancel", post(runs::cancel))
        .route("/runs/{id}/events", get(live::events))
        .route("/runners", get(runners::page).post(runners::mint))
        .route("/runners/{id}/revoke", post(runners::revoke))
        .route("/webhooks", get(webhooks::page).post(webhooks::create))
        .route("/webhooks/{id}", get(webhooks::messages))
        .route("/webhooks/{id}/{action}", post(webhooks::act))
        .route("/sign-in", get(sign_in::page).post(sign_in::submit))
        .route("/sign-in/dev", post(sign_in::dev))
        .route("/sign-out", post(sign_in::sign_out))
        .route("/assets/{name}", get(assets::serve))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(observe::ready))
        .fallback(pages::not_found)
        .layer(axum::middleware::from_fn(observe::request))
        .with_state(state)
}

/// The console as its own process: `automesh console`.
#[derive(Debug, clap::Args)]
pub struct Command {
    #[command(flatten)]
    pub config: Config,
    /// Where to serve metrics as Prometheus text (`GET /metrics`).
    #[arg(long, env = "AUTOMESH_METRICS_LISTEN", default_value = "127.0.0.1:9456")]
    pub metrics_listen: SocketAddr,
}

impl Command {
    /// Serves the console until SIGINT or SIGTERM.
    pub async fn execute(self) -> Result<()> {
        use automesh_rpc::runtime::{bind, shutdown_on_signal};
        let telemetry = automesh_telemetry::init("automesh-console")?;
        let service = Service::new(&self.config)?;
        let listener = bind(self.config.listen).await?;
        let metrics = bind(self.metrics_listen).await?;
        let shutdown = shutdown_on_signal();
        tokio::spawn(automesh_telemetry::metrics::serve(
            telemetry.scrape(),
            metrics,
            shutdown.clone(),
        ));
        service.serve(listener, shutdown).await
    }
}
