//! The run-coordinator service: owns the run lifecycle — every state
//! transition after creation, the event log, cancellation and receipts — and
//! serves run history and live event streams.

mod error;
mod service;
mod watch;

use std::net::SocketAddr;

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
}

/// Serves the coordinator on `listener` until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let store = Store::connect_lazy(&config.database_url, StoreOptions::default())?;
    serve(store, credential, listener, shutdown).await
}

/// Serves the coordinator over an existing store (used by `dev` mode and tests).
pub async fn serve(
    store: Store,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let coordinator = Coordinator::new(store.clone(), shutdown.clone());
    let mut server = GrpcServer::new(ServerSettings::default())?;
    server.add_service(RunCoordinatorServiceServer::with_interceptor(
        coordinator,
        RequireInternal(credential),
    ));
    server
        .serve(listener, shutdown, store.readiness_probe())
        .await?;
    Ok(())
}

impl automesh_rpc::runtime::ServiceMain for Config {
    const NAME: &'static str = "automesh-run-coordinator";

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
