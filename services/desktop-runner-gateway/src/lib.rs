//! The desktop-runner-gateway service: holds the desktop runners'
//! bidirectional streams (authentication, presence, assignment, events,
//! cancellation) and mints and revokes their per-runner credentials.
//!
//! It listens twice. The runner listener (`--listen`, the port desktops
//! reach and compose publishes) serves only `DesktopRunnerService` and
//! health. The internal listener (`--internal-listen`, for the mesh only)
//! serves the desktop `ExecutorService` (to the run-coordinator) and
//! `RunnerTokenService` (to the gateway), both behind the internal
//! credential: nothing internal is reachable, or even listed by reflection,
//! where runners connect.
//!
//! Runner tokens are shown once and stored only as a SHA-256 hash: a token is
//! 256 bits of OS randomness, so a fast hash is enough to make the stored
//! value useless to a reader of the database.

pub mod dispatch;
pub mod executor;
mod follow;
mod metrics;
mod outbound;
mod reports;
pub mod settings;
pub mod stream;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use automesh_domain::Principal;
use automesh_domain::ids::new_runner_id;
use automesh_edge::convert;
use automesh_edge::status;
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::runner_token_service_server::{
    RunnerTokenService, RunnerTokenServiceServer,
};
use automesh_rpc::{GrpcServer, InternalCredential, RequireInternal, ServerSettings};
use automesh_store::{Store, StoreOptions};
use chrono::Utc;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Status;

automesh_rpc::service_config! {
    /// Settings of a desktop-runner-gateway process.
    listen("AUTOMESH_RUNNER_GATEWAY_LISTEN", "127.0.0.1:50052"), database;
    /// Address of the internal listener: the desktop executor (for the
    /// run-coordinator's AUTOMESH_DESKTOP_EXECUTOR_ADDR) and the runner
    /// token service (for the gateway's AUTOMESH_RUNNER_GATEWAY_ADDR). Keep it
    /// off the network desktops reach.
    #[arg(
        long = "internal-listen",
        env = "AUTOMESH_RUNNER_GATEWAY_INTERNAL_LISTEN",
        default_value = "127.0.0.1:50056"
    )]
    pub internal_listen: SocketAddr,
    #[command(flatten)]
    pub streams: stream::StreamSettings,
}

/// Prefix of every runner token, so a leaked one is recognisable.
pub const TOKEN_PREFIX: &str = "amr_";

/// The stored form of a runner token.
pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The runner-token service's state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RunnerTokens {
    store: Store,
}

#[tonic::async_trait]
impl RunnerTokenService for RunnerTokens {
    automesh_edge::scoped_calls! {
        create_runner_token(rpb::CreateRunnerTokenRequest) -> rpb::CreateRunnerTokenResponse
            => serve_create;
        revoke_runner_token(rpb::RevokeRunnerTokenRequest) -> rpb::RevokeRunnerTokenResponse
            => serve_revoke;
        list_runners(rpb::ListRunnersRequest) -> rpb::ListRunnersResponse
            => serve_list;
    }
}

/// How often a replica beats, marking the streams it holds as seen.
pub const STREAMS_SEEN_EVERY: Duration = Duration::from_secs(10);

/// A stream whose replica has not beaten for this long (it died) reads as
/// offline.
pub const STREAM_STALE_AFTER: Duration = Duration::from_secs(35);

/// What each call does for its caller.
impl RunnerTokens {
    async fn serve_create(
        &self,
        owner: Principal,
        req: rpb::CreateRunnerTokenRequest,
    ) -> Result<rpb::CreateRunnerTokenResponse, Status> {
        let mut v = automesh_domain::Violations::default();
        let limit = automesh_domain::automation::RUNNER_NAME_LIMIT;
        automesh_domain::validation::check_text(&mut v, "runner_name", &req.runner_name, limit);
        v.into_result(())
            .map_err(|v| status::invalid_argument(&v))?;
        let token = automesh_rpc::runtime::random_secret(TOKEN_PREFIX);
        let (id, name, hash) = (new_runner_id(), req.runner_name.trim(), hash_token(&token));
        let created = self
            .store
            .create_runner(&owner, &id, name, &hash, Utc::now());
        let runner = created.await.map_err(|e| status::of(&e, "runner"))?;
        tracing::info!(runner_id = %runner.id, "runner token created");
        Ok(rpb::CreateRunnerTokenResponse {
            runner_id: runner.id,
            token,
            create_time: Some(convert::timestamp(runner.created_at)),
        })
    }

    async fn serve_revoke(
        &self,
        owner: Principal,
        req: rpb::RevokeRunnerTokenRequest,
    ) -> Result<rpb::RevokeRunnerTokenResponse, Status> {
        convert::require_id(&req.runner_id, "runner_id")
            .map_err(|v| status::invalid_argument(&v))?;
        let revoked = self.store.revoke_runner(&owner, &req.runner_id, Utc::now());
        revoked.await.map_err(|e| status::of(&e, "runner"))?;
        tracing::info!(runner_id = %req.runner_id, "runner revoked");
        Ok(rpb::RevokeRunnerTokenResponse {})
    }

    async fn serve_list(
        &self,
        owner: Principal,
        _req: rpb::ListRunnersRequest,
    ) -> Result<rpb::ListRunnersResponse, Status> {
        let stale = chrono::Duration::from_std(STREAM_STALE_AFTER).unwrap_or_default();
        let listed = self.store.list_runners(&owner, Utc::now(), stale);
        let runners = listed.await.map_err(|e| status::of(&e, "runners"))?;
        let runners = runners
            .into_iter()
            .map(|r| automesh_proto::v1::Runner {
                runner_id: r.id,
                name: r.name,
                create_time: Some(convert::timestamp(r.created_at)),
                connected: r.connected,
                last_seen_time: r.last_seen_at.map(convert::timestamp),
            })
            .collect();
        let response = Some(automesh_proto::v1::ListRunnersResponse { runners });
        Ok(rpb::ListRunnersResponse { response })
    }
}

/// The gateway's two listeners.
#[derive(Debug)]
pub struct Listeners {
    /// Where desktop runners connect: the runner stream and health only.
    pub runners: TcpListener,
    /// For the mesh only: the desktop executor and the runner token service.
    pub internal: TcpListener,
}

/// The runner gateway assembled from its configuration. Its binary, `dev`
/// mode and the test harness all start it the same way: [`Service::new`],
/// then [`Service::serve`].
#[derive(Debug)]
pub struct Service {
    /// The bounds of every runner stream.
    streams: stream::StreamSettings,
    store: Store,
    credential: InternalCredential,
    server: ServerSettings,
}

impl Service {
    /// Checks `config` and assembles the gateway over `store`.
    pub fn new(config: &Config, store: Store, credential: InternalCredential) -> Result<Self> {
        anyhow::ensure!(
            config.internal_listen.port() == 0 || config.internal_listen != config.listen,
            "the internal listener ({}) must differ from the runner listener",
            config.internal_listen
        );
        config.streams.check()?;
        store.observe_pool(&automesh_telemetry::metrics::meter());
        Ok(Self {
            streams: config.streams.clone(),
            store,
            credential,
            server: ServerSettings::default().limited(&config.connections)?,
        })
    }

    /// Serves the runner streams (runner-token authenticated) on the runner
    /// listener, and the desktop executor and the token service (internal
    /// credential) on the internal one, until `shutdown` is cancelled.
    pub async fn serve(self, listeners: Listeners, shutdown: CancellationToken) -> Result<()> {
        let Self {
            streams: settings,
            store,
            credential,
            server: limited,
        } = self;
        // The runner listener's PINGs are the liveness of PING-liveness
        // streams (see `stream`).
        let mut server = GrpcServer::new(ServerSettings {
            keepalive: settings.keepalive(),
            ping_grid: settings.ping_grid(),
            // Thousands of idle runner connections: no buffers while idle.
            lean_http2: settings.http2 == stream::Http2::Lean,
            ..limited.clone()
        })?;
        let mut internal = GrpcServer::new(limited)?;
        let streams = stream::RunnerStreams::new(store.clone(), settings, shutdown.clone());
        metrics::observe_streams(streams.sessions.clone());
        let desktop = executor::DesktopExecutor::new(store.clone(), streams.dispatch.clone());
        // Background tasks end with the server, whatever ends it.
        let tasks = shutdown.child_token();
        let relay = tokio::spawn(streams.dispatch.clone().relay(
            store.clone(),
            streams.sessions.clone(),
            tasks.clone(),
        ));
        let deliver = tokio::spawn(streams.dispatch.clone().deliver(
            store.clone(),
            streams.sessions.clone(),
            tasks.clone(),
        ));
        server.add_service(
            automesh_proto::runner::v1::desktop_runner_service_server::DesktopRunnerServiceServer::new(
                streams,
            ),
        );
        internal.add_service(
            automesh_proto::executor::v1::executor_service_server::ExecutorServiceServer::with_interceptor(
                automesh_executor::Contract(desktop),
                RequireInternal(credential.clone()),
            ),
        );
        internal.add_service(RunnerTokenServiceServer::with_interceptor(
            RunnerTokens {
                store: store.clone(),
            },
            RequireInternal(credential),
        ));
        // One stopping stops the other: half a gateway is no gateway.
        let stop = shutdown.child_token();
        let (served, served_internal) = tokio::join!(
            async {
                let r = server
                    .serve(listeners.runners, stop.clone(), store.readiness_probe())
                    .await;
                stop.cancel();
                r
            },
            async {
                let r = internal
                    .serve(listeners.internal, stop.clone(), store.readiness_probe())
                    .await;
                stop.cancel();
                r
            },
        );
        tasks.cancel();
        let _ = tokio::join!(relay, deliver);
        served?;
        served_internal?;
        Ok(())
    }
}

/// The binary: its own pool on the configured database, and the internal
/// listener bound beside the runner one.
async fn run(
    config: Config,
    credential: InternalCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let service = Service::new(
        &config,
        Store::connect_lazy(&config.database_url, StoreOptions::from_env())?,
        credential,
    )?;
    let internal = automesh_rpc::runtime::bind(config.internal_listen).await?;
    service
        .serve(
            Listeners {
                runners: listener,
                internal,
            },
            shutdown,
        )
        .await
}

automesh_rpc::service_main!(
    Config,
    "automesh-desktop-runner-gateway",
    "127.0.0.1:9452",
    run
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hash_is_stable_and_not_the_token() {
        let token = "amr_0123456789abcdef";
        assert_eq!(hash_token(token), hash_token(token));
        assert_eq!(hash_token(token).len(), 64);
        assert!(!hash_token(token).contains("0123456789abcdef"));
    }
}
