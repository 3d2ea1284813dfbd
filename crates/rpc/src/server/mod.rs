//! The one server builder every automesh service uses: gRPC health (NOT
//! SERVING until the readiness probe passes), server reflection (v1 and
//! v1alpha), a span per request that continues the caller's trace, request
//! timeouts and connection limits, and graceful shutdown. Connections are
//! served by our own loop (`connections`), whose keepalive PINGs of many
//! connections fire together.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use automesh_telemetry::propagation;

mod admission;
mod connections;
pub use connections::PING_GRID;

/// Limits and timeouts of a server.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// Bound on a unary call (and on producing a stream's first response).
    pub request_timeout: Duration,
    /// HTTP/2 streams one connection may have open at once.
    pub max_concurrent_streams: u32,
    /// Requests one connection may have in flight at once.
    pub concurrency_per_connection: usize,
    /// How often to probe readiness (database reachable and migrated).
    pub readiness_interval: Duration,
    /// HTTP/2 PINGs on a connection that has been silent this long, and how
    /// long an answer may take before the connection is closed as dead.
    pub keepalive: (Duration, Duration),
    /// Keepalive deadlines are rounded up to a multiple of this, so that
    /// the PINGs of many connections fire together (see `connections`).
    pub ping_grid: Duration,
    /// Serve connections with the lean HTTP/2 implementation (`http2`),
    /// which keeps no buffers on an idle connection: for listeners that
    /// hold many idle connections (the desktop runner listener). Otherwise
    /// hyper's.
    pub lean_http2: bool,
    /// The most connections this listener holds at once: at the cap it
    /// accepts no more until one closes.
    pub max_connections: usize,
    /// How long a new connection may take to send its first request (the
    /// HTTP/2 preface and the request's headers) before it is closed.
    pub first_request_within: Duration,
}

/// Open files a process keeps for other things than its connections (its
/// database pool, logs, its own outbound channels).
const FILES_RESERVED: u64 = 256;

/// The connections a listener may hold by default: what the process's
/// open-file limit allows, less a reserve (at least 64).
pub fn default_max_connections() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    let files = limit.unwrap_or(1 << 20);
    usize::try_from(files.saturating_sub(FILES_RESERVED).max(64)).unwrap_or(usize::MAX)
}

impl ServerSettings {
    /// These settings with a service's connection flags, once checked.
    pub fn limited(self, limits: &crate::runtime::ConnectionLimits) -> anyhow::Result<Self> {
        limits.check()?;
        Ok(Self {
            max_connections: limits.max_connections.unwrap_or(self.max_connections),
            first_request_within: limits.first_request_within,
            ..self
        })
    }
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(30),
            max_concurrent_streams: 1024,
            concurrency_per_connection: 1024,
            readiness_interval: Duration::from_secs(2),
            keepalive: (Duration::from_secs(20), Duration::from_secs(10)),
            ping_grid: PING_GRID,
            lean_http2: false,
            max_connections: default_max_connections(),
            first_request_within: Duration::from_secs(10),
        }
    }
}

const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// A readiness probe: `true` when the service can do its work.
pub type Probe = Box<dyn Fn() -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;

/// Collects a service's gRPC services, then serves them with health and
/// reflection on one listener.
pub struct GrpcServer {
    routes: RoutesBuilder,
    names: Vec<&'static str>,
    health: HealthReporter,
    settings: ServerSettings,
}

impl std::fmt::Debug for GrpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcServer")
            .field("services", &self.names)
            .finish()
    }
}

/// Why a server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("reflection descriptor set is invalid: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

impl GrpcServer {
    /// A server with health and reflection mounted.
    pub fn new(settings: ServerSettings) -> Result<Self, ServeError> {
        let (health, health_service) = tonic_health::server::health_reporter();
        let mut routes = RoutesBuilder::default();
        routes.add_service(health_service);
        Ok(Self {
            routes,
            names: Vec::new(),
            health,
            settings,
        })
    }

    /// Mounts one gRPC service.
    pub fn add_service<S>(&mut self, service: S) -> &mut Self
    where
        S: tower::Service<http::Request<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.names.push(S::NAME);
        self.routes.add_service(service);
        self
    }

    /// The health reporter, for services that report more than readiness.
    pub fn health(&self) -> HealthReporter {
        self.health.clone()
    }

    /// Serves like [`GrpcServer::serve`] with `beside` running alongside
    /// (a service's own loops). `beside` starts once `probe` first passes
    /// (the database reachable at the schema the binary knows), so that
    /// loops never spin on a database they cannot use yet: readiness says
    /// why once, instead of every loop every second. `beside` is given a
    /// token cancelled when serving ends, whatever ends it, so it never
    /// outlives the server; this returns once both are done.
    pub async fn serve_beside<F>(
        self,
        listener: TcpListener,
        shutdown: CancellationToken,
        probe: Probe,
        beside: impl FnOnce(CancellationToken) -> F,
    ) -> Result<(), ServeError>
    where
        F: Future<Output = ()>,
    {
        let stop = shutdown.child_token();
        let (ready_tx, mut ready) = tokio::sync::watch::channel(false);
        let ready_tx = std::sync::Arc::new(ready_tx);
        let probe: Probe = Box::new(move || {
            let (check, ready_tx) = (probe(), ready_tx.clone());
            Box::pin(async move {
                let passed = check.await;
                if passed {
                    ready_tx.send_replace(true);
                }
                passed
            })
        });
        let background = {
            let stop = stop.clone();
            async move {
                tokio::select! {
                    passed = ready.wait_for(|ready| *ready) => {
                        // The probe gone: serving ended before it passed.
                        if passed.is_err() {
                            return;
                        }
                    }
                    () = stop.cancelled() => return,
                }
                beside(stop).await;
            }
        };
        let serving = async {
            let served = self.serve(listener, shutdown, probe).await;
            stop.cancel();
            served
        };
        let (served, ()) = tokio::join!(serving, background);
        served
    }

    /// Serves until `shutdown` is cancelled, then drains in-flight calls.
    /// Health answers NOT_SERVING until `probe` first passes, and follows it
    /// afterwards.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: CancellationToken,
        probe: Probe,
    ) -> Result<(), ServeError> {
        let GrpcServer {
            mut routes,
            names,
            health,
            settings,
        } = self;
        // Reflection advertises exactly what this server serves.
        let reflection = || {
            names.iter().fold(
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(automesh_proto::FILE_DESCRIPTOR_SET)
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                    // So reflection clients can decode the rich error details.
                    .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
                    .with_service_name(HEALTH_SERVICE),
                |b, name| b.with_service_name(*name),
            )
        };
        routes.add_service(reflection().build_v1()?);
        routes.add_service(reflection().build_v1alpha()?);
        let readiness = tokio::spawn(
            follow_readiness(
                health.clone(),
                names.clone(),
                probe,
                settings.readiness_interval,
                shutdown.clone(),
            )
            .in_current_span(),
        );
        let routes = tower::ServiceBuilder::new()
            .map_response(oversized_is_resource_exhausted)
            .service(routes.routes());
        connections::serve(
            listener,
            names.first().copied().unwrap_or(HEALTH_SERVICE),
            connections::Routes::new(routes),
            &settings,
            request_span,
            shutdown.cancelled(),
        )
        .await;
        readiness.abort();
        Ok(())
    }
}

/// A request larger than the server accepts is RESOURCE_EXHAUSTED, as
/// gRPC's status code table says; tonic answers OUT_OF_RANGE ("decoded
/// message length too large"). Such an answer is trailers-only: its status
/// is in the response headers, rewritten here.
fn oversized_is_resource_exhausted<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let out_of_range = headers
        .get("grpc-status")
        .is_some_and(|s| s.as_bytes() == b"11");
    let too_large = headers.get("grpc-message").is_some_and(|m| {
        let m = String::from_utf8_lossy(m.as_bytes()).replace("%20", " ");
        m.contains("message length too large")
    });
    if out_of_range && too_large {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    response
}

/// Calls that are not work on one run: never traced. Probes (health,
/// reflection, an agent's keepalive) would otherwise be most of every trace
/// store; an idle worker's `Shutdown` is housekeeping; a runner's `Connect`
/// stream lives as long as the runner, and each of its runs is traced in
/// the run's own trace (what the stream carries for a run is handled in a
/// span of that run). Each would be a trace of one span of its own.
const UNTRACED: [&str; 5] = [
    "/grpc.health.",
    "/grpc.reflection.",
    "/automesh.agent.v1.WorkerAgentService/KeepAlive",
    "/automesh.agent.v1.WorkerAgentService/Shutdown",
    "/automesh.runner.v1.DesktopRunnerService/Connect",
];

/// The span of one inbound request, continuing the caller's trace. Health
/// checks, reflection and keepalives are not traced.
fn request_span(req: &http::Request<()>) -> tracing::Span {
    let path = req.uri().path();
    if UNTRACED.iter().any(|p| path.starts_with(p)) {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = %path,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.method = %path,
        trace_id = tracing::field::Empty,
    );
    let _ = span.set_parent(propagation::extract(req.headers()));
    let trace_id = {
        use opentelemetry::trace::TraceContextExt;
        span.context().span().span_context().trace_id()
    };
    span.record("trace_id", tracing::field::display(trace_id));
    span
}

async fn follow_readiness(
    health: HealthReporter,
    names: Vec<&'static str>,
    probe: Probe,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let set = |status: ServingStatus| {
        let (health, names) = (health.clone(), names.clone());
        async move {
            health.set_service_status("", status).await;
            for name in &names {
                health.set_service_status(*name, status).await;
            }
        }
    };
    set(ServingStatus::NotServing).await;
    let mut serving = false;
    loop {
        // A probe that hangs counts as a failure.
        let bound = interval.max(Duration::from_secs(1)) * 5;
        let ready = tokio::select! {
            ready = tokio::time::timeout(bound, probe()) => ready.unwrap_or(false),
            () = shutdown.cancelled() => break,
        };
        if ready != serving {
            if ready {
                set(ServingStatus::Serving).await;
                tracing::info!(services = ?names, "serving");
            } else {
                set(ServingStatus::NotServing).await;
                tracing::warn!(services = ?names, "not serving: readiness probe failed");
            }
            serving = ready;
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = shutdown.cancelled() => break,
        }
    }
    // Draining: tell load balancers to stop sending work.
    set(ServingStatus::NotServing).await;
    tracing::info!(services = ?names, "not serving: shutting down");
}
