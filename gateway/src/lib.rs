//! The public API gateway: authenticates the web backend's (and the desktop
//! app's) bearer tokens, scopes every call to the caller, validates input,
//! applies the creation rules, and fans out to the internal services.
//!
//! It owns no data: what it knows of automations and runs it asks for.

pub mod auth;
mod automations;
mod notifications;
mod pass;
mod preview;
mod runs;
pub mod upstream;

use std::sync::Arc;

use anyhow::Result;
use automesh_domain::{ModelCatalog, ModelRefusal, Placement, Principal};
use automesh_edge::convert;
use automesh_edge::status;
use automesh_proto::v1::automations_server::AutomationsServer;
use automesh_proto::v1::notifications_server::NotificationsServer;
use automesh_proto::v1::runs_server::RunsServer;
use automesh_proto::worker::v1 as wpb;
use automesh_rpc::{GrpcServer, InternalCredential, ServerSettings};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

pub use auth::{Authenticator, mint};
pub use upstream::{UpstreamAddrs, Upstreams};

automesh_rpc::service_config! {
    /// Settings of a gateway process.
    listen("AUTOMESH_GATEWAY_LISTEN", "127.0.0.1:50051");
    #[command(flatten)]
    pub upstreams: UpstreamAddrs,
    #[command(flatten)]
    pub models: automesh_rpc::runtime::Models,
    /// The HS256 key that verifies bearer tokens (at least 32 bytes).
    #[arg(long, env = "AUTOMESH_JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: automesh_domain::Secret,
}

/// A call the gateway accepted: authenticated, its request checked.
struct Accepted<T> {
    owner: Principal,
    req: T,
}

impl<T> Accepted<T> {
    /// What scopes the upstream call to the caller.
    fn caller(&self) -> Option<automesh_proto::internal::v1::Caller> {
        Some(convert::caller(&self.owner))
    }
}

/// An upstream's answer, its status passed on as it came.
fn forwarded<T>(answer: Result<tonic::Response<T>, Status>) -> Result<T, Status> {
    answer
        .map(tonic::Response::into_inner)
        .map_err(status::forward)
}

/// The gateway's state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Gateway {
    auth: Authenticator,
    models: Arc<ModelCatalog>,
    upstreams: Upstreams,
}

impl Gateway {
    fn new(auth: Authenticator, models: ModelCatalog, upstreams: Upstreams) -> Self {
        Self {
            auth,
            models: Arc::new(models),
            upstreams,
        }
    }

    fn principal<T>(&self, request: &tonic::Request<T>) -> Result<Principal, Status> {
        self.auth.principal(request.metadata())
    }

    /// Authenticates a call and checks its request (INVALID_ARGUMENT naming
    /// each bad field): the caller that scopes the upstream call, the
    /// caller's principal and the request.
    fn accept<T>(
        &self,
        request: tonic::Request<T>,
        check: impl FnOnce(&T) -> Result<(), automesh_domain::Violations>,
    ) -> Result<Accepted<T>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        check(&req).map_err(|v| status::invalid_argument(&v))?;
        Ok(Accepted { owner, req })
    }

    /// The model must be one the catalogue admits where the automation runs
    /// (`ModelCatalog::admits`: it exists; in the cloud it is authorised for
    /// the caller's organisation) — the rule every run is held to again.
    fn check_model(
        &self,
        owner: &Principal,
        model: &str,
        placement: Placement,
    ) -> Result<(), Status> {
        match self.models.admits(model, &owner.org_id, placement) {
            Ok(_) => Ok(()),
            Err(ModelRefusal::Unknown) => {
                let known: Vec<&str> = self.models.models.iter().map(|m| m.id.as_str()).collect();
                Err(status::invalid_field(
                    "automation.model",
                    &format!(
                        "unknown model {model:?}; known models: {}",
                        known.join(", ")
                    ),
                ))
            }
            Err(refusal @ ModelRefusal::NotAuthorized) => Err(status::failed_precondition(
                "MODEL_AUTHORIZATION",
                &format!("models/{model}"),
                &refusal.explain(model, &owner.org_id),
            )),
        }
    }

    /// A cloud automation needs the owner's existing cloud worker (stopped is
    /// fine); nothing is allocated silently.
    async fn require_cloud_worker(&self, owner: &Principal) -> Result<(), Status> {
        let mut lifecycle = self.upstreams.lifecycle.clone();
        match lifecycle
            .get_worker(wpb::GetWorkerRequest {
                caller: Some(convert::caller(owner)),
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::NotFound => Err(status::failed_precondition(
                "CLOUD_WORKER",
                &format!("users/{}", owner.user_id),
                "creating a cloud automation requires an existing cloud worker for this user; \
                 none exists, and none is allocated silently",
            )),
            Err(s) => Err(status::forward(s)),
        }
    }
}

/// The gateway assembled from its configuration. Its binary, `dev` mode and
/// the test harness all start it the same way: [`Service::new`], then
/// [`Service::serve`].
#[derive(Debug)]
pub struct Service {
    gateway: Gateway,
    server: ServerSettings,
}

impl Service {
    /// Checks `config` (the token key, the upstream addresses) and
    /// assembles the gateway; the internal services need not be up yet.
    pub fn new(config: &Config, credential: InternalCredential) -> Result<Self> {
        Ok(Self {
            server: ServerSettings::default().limited(&config.connections)?,
            gateway: Gateway::new(
                Authenticator::hs256(config.jwt_secret.expose().as_bytes())?,
                config.models.catalog(),
                Upstreams::new(&config.upstreams, &credential)?,
            ),
        })
    }

    /// Serves the public API on `listener` until `shutdown` is cancelled;
    /// it reports SERVING while every upstream does.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        let gateway = self.gateway;
        let mut server = GrpcServer::new(self.server.clone())?;
        server.add_service(AutomationsServer::new(gateway.clone()));
        server.add_service(RunsServer::new(gateway.clone()));
        server.add_service(NotificationsServer::new(gateway.clone()));
        let upstreams = gateway.upstreams.clone();
        server
            .serve(
                listener,
                shutdown,
                Box::new(move || {
                    let upstreams = upstreams.clone();
                    Box::pin(async move { upstreams.all_serving().await })
                }),
            )
            .await?;
        Ok(())
    }
}

/// The binary.
async fn run(
    config: Config,
    cred: InternalCredential,
    l: TcpListener,
    stop: CancellationToken,
) -> Result<()> {
    Service::new(&config, cred)?.serve(l, stop).await
}

automesh_rpc::service_main!(Config, "automesh-gateway", "127.0.0.1:9451", run);
