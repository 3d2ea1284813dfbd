//! The cloud-worker-lifecycle service: owns per-user cloud workers — their
//! records, and (as the cloud path grows) wake, readiness, idle stop and MCP
//! registration.

use std::net::SocketAddr;

use automesh_domain::{CloudWorker, WorkerState};
use automesh_proto::worker::v1 as wpb;
use automesh_proto::worker::v1::cloud_worker_lifecycle_service_server::{
    CloudWorkerLifecycleService, CloudWorkerLifecycleServiceServer,
};
use automesh_rpc::{
    GrpcServer, InternalCredential, RequireInternal, ServerSettings, convert, status,
};
use automesh_store::{Store, StoreError, StoreOptions};
use chrono::Utc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Settings of a cloud-worker-lifecycle process.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address to listen on.
    #[arg(
        long = "listen",
        env = "AUTOMESH_LIFECYCLE_LISTEN",
        default_value = "127.0.0.1:50055"
    )]
    pub listen: SocketAddr,
    /// Database URL: postgres://… or sqlite:….
    #[arg(long, env = "AUTOMESH_DATABASE_URL")]
    pub database_url: String,
    /// The worker driver new workers are recorded with.
    #[arg(long, env = "AUTOMESH_WORKER_DRIVER", default_value = "local-process")]
    pub driver: String,
}

/// The lifecycle service's state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    store: Store,
    driver: String,
}

impl Lifecycle {
    pub fn new(store: Store, driver: impl Into<String>) -> Self {
        Self {
            store,
            driver: driver.into(),
        }
    }
}

fn store_status(e: StoreError) -> Status {
    match e {
        StoreError::NotFound => status::not_found("cloud worker"),
        e @ StoreError::Database(_) => status::unavailable("database", &e),
        e => status::internal("lifecycle store", &e),
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
impl CloudWorkerLifecycleService for Lifecycle {
    async fn get_worker(
        &self,
        request: Request<wpb::GetWorkerRequest>,
    ) -> Result<Response<wpb::GetWorkerResponse>, Status> {
        let owner = convert::principal(request.get_ref().caller.as_ref())?;
        let worker = self
            .store
            .get_worker(&owner)
            .await
            .map_err(store_status)?
            .ok_or_else(|| status::not_found("cloud worker"))?;
        Ok(Response::new(wpb::GetWorkerResponse {
            worker: Some(worker_to_pb(&worker)),
        }))
    }

    async fn register_worker(
        &self,
        request: Request<wpb::RegisterWorkerRequest>,
    ) -> Result<Response<wpb::RegisterWorkerResponse>, Status> {
        let owner = convert::principal(request.get_ref().caller.as_ref())?;
        let worker = self
            .store
            .register_worker(&owner, &self.driver, Utc::now())
            .await
            .map_err(store_status)?;
        tracing::info!(worker_id = %worker.id, driver = %worker.driver, "cloud worker registered");
        Ok(Response::new(wpb::RegisterWorkerResponse {
            worker: Some(worker_to_pb(&worker)),
        }))
    }
}

/// Serves the lifecycle service on `listener` until `shutdown` is cancelled.
pub async fn run(
    config: Config,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let store = Store::connect_lazy(&config.database_url, StoreOptions::default())?;
    serve(store, config.driver, credential, listener, shutdown).await
}

/// Serves over an existing store (used by `dev` mode and tests).
pub async fn serve(
    store: Store,
    driver: String,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut server = GrpcServer::new(ServerSettings::default())?;
    server.add_service(CloudWorkerLifecycleServiceServer::with_interceptor(
        Lifecycle::new(store.clone(), driver),
        RequireInternal(credential),
    ));
    server
        .serve(listener, shutdown, store.readiness_probe())
        .await?;
    Ok(())
}

automesh_rpc::service_main!(Config, "automesh-cloud-worker-lifecycle", run);
