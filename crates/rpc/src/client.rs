//! Client channels between services. Every outbound call carries the
//! internal credential and the caller's W3C trace context.
//!
//! A service address may name several replicas (`http://a:1,http://b:2`):
//! calls go to one of them until it fails to answer (refused, reset, or a
//! caller gave up waiting), then to the next, so a dead or stalled replica
//! costs one failed call, which every caller already retries.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tower::{Service, ServiceExt};

use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use crate::auth::InternalCredential;
use automesh_telemetry::propagation;

/// Adds the internal credential (when set) and the current trace context.
#[derive(Clone, Debug, Default)]
pub struct Outbound {
    credential: Option<InternalCredential>,
}

impl Outbound {
    pub fn new(credential: Option<InternalCredential>) -> Self {
        Self { credential }
    }
}

impl Interceptor for Outbound {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(c) = &self.credential {
            req.metadata_mut().insert("authorization", c.header_value());
        }
        propagation::inject(req.metadata_mut());
        Ok(req)
    }
}

/// A channel to another service of the mesh.
pub type InternalChannel = InterceptedService<Replicas, Outbound>;

/// Why a channel could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("invalid service address {addr:?}: {source}")]
    Invalid {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("no service address given")]
    Empty,
}

/// Bounds on every outbound call: connecting, and a whole unary call (for
/// a stream: until its response headers).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A lazily connected channel to `addr` (`http://host:port`), so services can
/// start in any order. Calls fail with UNAVAILABLE until the peer answers.
pub fn channel(addr: &str) -> Result<Channel, ChannelError> {
    let endpoint = Endpoint::from_shared(addr.to_owned())
        .map_err(|source| ChannelError::Invalid {
            addr: addr.to_owned(),
            source,
        })?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10));
    Ok(endpoint.connect_lazy())
}

/// A channel to another service, carrying the internal credential. `addrs`
/// is one address or a comma-separated list of replicas (see [`Replicas`]).
/// Unary calls are bounded by [`CALL_TIMEOUT`]; streams set their own bounds.
pub fn internal_channel(
    addrs: &str,
    credential: &InternalCredential,
) -> Result<InternalChannel, ChannelError> {
    Ok(InterceptedService::new(
        replicas(addrs)?,
        Outbound::new(Some(credential.clone())),
    ))
}

/// Lazily connected channels to the replicas `addrs` names (comma
/// separated), each bounded by [`CALL_TIMEOUT`] until its response.
pub fn replicas(addrs: &str) -> Result<Replicas, ChannelError> {
    let channels = addrs
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|addr| {
            Ok(Endpoint::from_shared(addr.to_owned())
                .map_err(|source| ChannelError::Invalid {
                    addr: addr.to_owned(),
                    source,
                })?
                .connect_timeout(CONNECT_TIMEOUT)
                .timeout(CALL_TIMEOUT)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(20))
                .keep_alive_timeout(Duration::from_secs(10))
                .connect_lazy())
        })
        .collect::<Result<Vec<_>, ChannelError>>()?;
    if channels.is_empty() {
        return Err(ChannelError::Empty);
    }
    Ok(Replicas {
        channels: channels.into(),
        current: Arc::default(),
    })
}

/// Channels to the replicas of one service. Each call goes to the current
/// replica; a call it does not answer moves every later call to the next
/// one. gRPC statuses (the replica answered) never move it.
#[derive(Debug, Clone)]
pub struct Replicas {
    channels: Arc<[Channel]>,
    current: Arc<AtomicUsize>,
}

impl Replicas {
    /// How many replicas this names.
    pub fn len(&self) -> usize {
        self.channels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.channels.is_empty()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Service<http::Request<tonic::body::Body>> for Replicas {
    type Response = http::Response<tonic::body::Body>;
    type Error = tonic::transport::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each call readies its own replica's channel.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let n = self.channels.len();
        let i = self.current.load(Ordering::Relaxed) % n;
        let mut channel = self.channels[i].clone();
        let attempt = Attempt {
            current: self.current.clone(),
            replica: i,
            replicas: n,
            answered: false,
        };
        Box::pin(async move {
            // The whole guard lives in the future: dropped with it.
            let mut attempt = attempt;
            let result = match channel.ready().await {
                Ok(ready) => ready.call(request).await,
                Err(e) => Err(e),
            };
            attempt.answered = result.is_ok();
            result
        })
    }
}

/// One call to one replica. A replica that did not answer — the call failed
/// at the transport, or its caller gave up waiting (a stalled replica
/// accepts connections and says nothing, so only the caller's own bound
/// ends the wait) — moves later calls to the next replica. Replicas are
/// interchangeable, so moving on after a call abandoned for another reason
/// costs nothing.
struct Attempt {
    current: Arc<AtomicUsize>,
    replica: usize,
    replicas: usize,
    answered: bool,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if self.answered || self.replicas < 2 {
            return;
        }
        // Only the first caller to see this replica fail moves on.
        let next = (self.replica + 1) % self.replicas;
        if self
            .current
            .compare_exchange(self.replica, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            tracing::warn!(
                replica = self.replica,
                "replica did not answer; using the next"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    /// A port nothing listens on (bound, then released).
    fn closed_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    }

    /// A server that answers health checks, its stop and its task.
    async fn live_server() -> (
        std::net::SocketAddr,
        tokio_util::sync::CancellationToken,
        tokio::task::JoinHandle<Result<(), crate::server::ServeError>>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let live = listener.local_addr().expect("addr");
        let shutdown = tokio_util::sync::CancellationToken::new();
        let server = crate::GrpcServer::new(crate::ServerSettings::default()).expect("server");
        let serving = tokio::spawn(server.serve(
            listener,
            shutdown.clone(),
            Box::new(|| Box::pin(async { true })),
        ));
        (live, shutdown, serving)
    }

    #[tokio::test]
    async fn calls_move_to_the_next_replica_when_one_is_down() {
        let (live, shutdown, serving) = live_server().await;
        let addrs = format!("http://127.0.0.1:{},http://{live}", closed_port());
        let replicas = replicas(&addrs).expect("replicas");
        assert_eq!(replicas.len(), 2);
        let mut client = HealthClient::new(replicas);
        let check = || HealthCheckRequest {
            service: String::new(),
        };
        let first = client.check(check()).await;
        assert_eq!(
            first.expect_err("the dead replica is tried first").code(),
            tonic::Code::Unavailable
        );
        for _ in 0..3 {
            client
                .check(check())
                .await
                .expect("the live replica answers every later call");
        }
        shutdown.cancel();
        serving.await.expect("join").expect("served");
    }

    #[tokio::test]
    async fn a_stalled_replica_is_left_once_a_caller_gives_up_on_it() {
        // Accepts connections, never answers: a stalled process.
        let stalled = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let stalled_addr = stalled.local_addr().expect("addr");
        let (live, shutdown, serving) = live_server().await;
        let mut client = HealthClient::new(
            replicas(&format!("http://{stalled_addr},http://{live}")).expect("replicas"),
        );
        let check = || HealthCheckRequest {
            service: String::new(),
        };
        let gave_up = tokio::time::timeout(Duration::from_millis(500), client.check(check())).await;
        assert!(gave_up.is_err(), "the stalled replica never answers");
        client
            .check(check())
            .await
            .expect("the next call goes to the live replica");
        drop(stalled);
        shutdown.cancel();
        serving.await.expect("join").expect("served");
    }

    #[test]
    fn an_empty_address_list_is_refused() {
        assert!(matches!(replicas(" , "), Err(ChannelError::Empty)));
        assert!(matches!(
            replicas("not a uri"),
            Err(ChannelError::Invalid { .. })
        ));
    }
}

/// Adds `authorization: Bearer <token>` when there is a token, and a
/// deadline when one is set: how the mesh's own tools (`ctl`, `dev`, the
/// test harnesses) call the public API as a user.
#[derive(Clone, Debug, Default)]
pub struct Bearer {
    value: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    timeout: Option<Duration>,
}

impl Bearer {
    /// Presents `token` (a token that is not valid ASCII presents nothing,
    /// and the server answers UNAUTHENTICATED).
    pub fn new(token: &str) -> Self {
        Self {
            value: format!("Bearer {token}").parse().ok(),
            timeout: None,
        }
    }

    /// Presents nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Bounds every call by `timeout` (the server sees it as the deadline).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.value {
            req.metadata_mut().insert("authorization", v.clone());
        }
        if let Some(t) = self.timeout {
            req.set_timeout(t);
        }
        Ok(req)
    }
}

/// Waits, bounded by `within`, until the gRPC health of `addr` reports
/// SERVING (`want` true) or anything else (`want` false); the error names
/// the last status seen.
pub async fn wait_for_health(addr: &str, within: Duration, want: bool) -> anyhow::Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let mut client = HealthClient::new(channel(addr)?);
    let give_up = tokio::time::Instant::now() + within;
    let mut last = None;
    loop {
        let check = client.check(HealthCheckRequest {
            service: String::new(),
        });
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(2), check).await {
            let serving = r.get_ref().status == ServingStatus::Serving as i32;
            if serving == want {
                return Ok(());
            }
            last = Some(r.get_ref().status);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < give_up,
            "{addr} did not become {} within {within:?} (last status {last:?})",
            if want { "SERVING" } else { "NOT_SERVING" }
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits, bounded by `within`, until `addr` reports SERVING.
pub async fn wait_serving(addr: &str, within: Duration) -> anyhow::Result<()> {
    wait_for_health(addr, within, true).await
}
