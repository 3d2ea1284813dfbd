//! The connection loop of every automesh server: accepts TCP connections,
//! serves each over HTTP/2 (hyper) under the server's per-connection limits,
//! and drains them on shutdown.
//!
//! It does what tonic's own loop does (a span per request, a deadline per
//! call from `grpc-timeout` and the server's bound, a concurrency limit per
//! connection, errors answered as gRPC statuses), with one difference that is
//! the reason it exists: the timer behind HTTP/2 keepalive PINGs rounds its
//! deadlines up to a grid (`ServerSettings::ping_grid`, [`PING_GRID`] by
//! default). Ten thousand idle connections,
//! each PINGed every few seconds, then PING together a few times a second:
//! the process wakes for a batch, not for every PING, which is most of what
//! an idle connection costs (tonic's loop takes no timer). Rounding delays a
//! PING and its timeout by at most one grid step each; the keepalive bounds
//! leave room for that (see `desktop-runner-gateway`'s stream settings).

use std::convert::Infallible;
use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use automesh_http2::GridTimer;
use hyper::rt::{Sleep, Timer};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tonic::body::Body;
use tower::{Service, ServiceBuilder};
use tracing::Instrument;

use super::{ServerSettings, admission};

/// Keepalive deadlines are rounded up to a multiple of this by default:
/// 20 wake-ups a second for any number of idle connections, and bursts
/// small enough (about 200 PINGs at 19,000 connections PINGed every 5 s)
/// not to hold up other work for long. Coarser grids (100 ms, 250 ms)
/// saved little more CPU but their bursts delayed dispatch at 19,000
/// streams (run-now → assignment p99 33-92 ms against 17-20 ms).
pub const PING_GRID: Duration = Duration::from_millis(50);

/// A boxed error, as hyper and tower pass them.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// hyper's timer with deadlines rounded up to the grid shared by every
/// connection of the process (`automesh_http2::GridTimer`), so that timers
/// set at nearby instants fire in one wake-up.
#[derive(Debug, Clone)]
struct HyperGrid(GridTimer);

impl Timer for HyperGrid {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        TokioTimer::new().sleep_until(self.0.round(Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Sleep>> {
        TokioTimer::new().sleep_until(self.0.round(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn Sleep>>, new_deadline: Instant) {
        TokioTimer::new().reset(sleep, self.0.round(new_deadline))
    }
}

/// The routes, as one cloneable service.
pub(crate) type Routes =
    tower::util::BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// Makes the span of one request.
pub(crate) type SpanOf = fn(&http::Request<()>) -> tracing::Span;

/// Serves `routes` on `listener` (named `name` in metrics and logs) until
/// `shutdown` resolves, then lets every connection finish its calls (new
/// streams are refused) and returns once all have closed. Connections are
/// served by hyper's HTTP/2, or by the lean one (`automesh_http2`) when the
/// settings ask for it; alike for both, at most `max_connections` are open
/// at once (a permit is taken before each accept, so at the cap new ones
/// wait in the kernel's backlog), and one that sends no request within
/// `first_request_within` is closed.
pub(crate) async fn serve(
    listener: TcpListener,
    name: &'static str,
    routes: Routes,
    settings: &ServerSettings,
    span_of: SpanOf,
    shutdown: impl Future<Output = ()>,
) {
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .timer(HyperGrid(GridTimer::new(settings.ping_grid)))
        .keep_alive_interval(Some(settings.keepalive.0))
        .keep_alive_timeout(settings.keepalive.1)
        .max_concurrent_streams(settings.max_concurrent_streams);
    let limits = automesh_http2::Limits {
        max_concurrent_streams: settings.max_concurrent_streams,
        keepalive: settings.keepalive,
        ping_grid: settings.ping_grid,
    };
    let (drain, draining) = tokio::sync::watch::channel(());
    let cap = std::sync::Arc::new(tokio::sync::Semaphore::new(settings.max_connections));
    let mut shutdown = pin!(shutdown);
    loop {
        let permit = match cap.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                admission::at_cap(name, settings.max_connections);
                tokio::select! {
                    () = &mut shutdown => break,
                    permit = cap.clone().acquire_owned() => match permit {
                        Ok(permit) => {
                            tracing::info!(listener = name, "below the connection cap again: accepting");
                            permit
                        }
                        Err(_) => break,
                    },
                }
            }
        };
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, or a connection reset before
                    // it was accepted: not the listener's end. A short pause
                    // keeps the loop from spinning while descriptors are out.
                    tracing::debug!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let open = admission::Open::new(name, permit);
        let first = admission::FirstRequest::new(name, peer, settings.first_request_within);
        let draining = draining.clone();
        if settings.lean_http2 {
            // A body that ended early is read as tonic reads its own.
            let calls = ServiceBuilder::new()
                .map_request(|req: http::Request<automesh_http2::RecvBody>| {
                    req.map(|body| http_body_util::BodyExt::map_err(body, lean_stream))
                })
                .service(calls(&routes, settings, span_of, first.asked()));
            let connection = automesh_http2::Connection::new(tcp, calls, limits);
            tokio::spawn(drive(
                connection,
                |c| c.get_mut().graceful_shutdown(),
                draining,
                first,
                open,
            ));
        } else {
            let calls = calls(&routes, settings, span_of, first.asked());
            let connection =
                http2.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(calls));
            tokio::spawn(drive(
                connection,
                |c| c.graceful_shutdown(),
                draining,
                first,
                open,
            ));
        }
    }
    // Refuse new connections at once, then drain the open ones.
    drop(listener);
    drop(draining);
    let _ = drain.send(());
    drain.closed().await;
}

/// The layers every call goes through, whatever serves the connection:
/// its span, errors as gRPC statuses, the per-connection concurrency limit
/// and the deadline.
fn calls<B>(
    routes: &Routes,
    settings: &ServerSettings,
    span_of: SpanOf,
    asked: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> impl Service<
    http::Request<B>,
    Response = http::Response<
        impl http_body::Body<Data = bytes::Bytes, Error: Into<BoxError>> + Send + Unpin + 'static,
    >,
    Error: Into<BoxError>,
    Future: Send + 'static,
> + Clone
+ Send
+ Unpin
+ 'static
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    ServiceBuilder::new()
        .map_request(move |req: http::Request<B>| {
            // The connection asked something: it is past its first-request
            // bound.
            asked.store(true, std::sync::atomic::Ordering::Relaxed);
            req.map(Body::new)
        })
        .layer_fn(move |inner| Traced { inner, span_of })
        .layer(tonic::service::RecoverErrorLayer::new())
        .concurrency_limit(settings.concurrency_per_connection)
        .layer_fn(|inner| Deadline {
            inner,
            bound: settings.request_timeout,
        })
        .service(routes.clone())
}

/// Runs one connection to its end; a drain signal lets its calls finish.
/// One that asks nothing within its first-request bound is drained the
/// same way (a GOAWAY, when it got as far as HTTP/2), and dropped if it has
/// not closed within [`automesh_http2::CLOSE_WITHIN`] after that.
async fn drive<C, E>(
    connection: C,
    drain: impl FnOnce(Pin<&mut C>),
    mut draining: tokio::sync::watch::Receiver<()>,
    first: admission::FirstRequest,
    _open: admission::Open,
) where
    C: Future<Output = Result<(), E>>,
    E: std::error::Error + 'static,
{
    let mut connection = pin!(connection);
    tokio::select! {
        ended = connection.as_mut() => {
            if let Err(error) = ended {
                tracing::debug!(%error, cause = causes(&error), "connection ended");
            }
            return;
        }
        _ = draining.changed() => drain(connection.as_mut()),
        () = first.overdue() => {
            first.closing();
            drain(connection.as_mut());
            let _ = tokio::time::timeout(automesh_http2::CLOSE_WITHIN, connection).await;
            return;
        }
    }
    if let Err(error) = connection.await {
        tracing::debug!(%error, cause = causes(&error), "connection ended while draining");
    }
}

/// Runs each call inside the span `span_of` makes for it.
#[derive(Clone)]
struct Traced<S> {
    inner: S,
    span_of: SpanOf,
}

impl<S> Service<http::Request<Body>> for Traced<S>
where
    S: Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tracing::instrument::Instrumented<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let bodyless = http::Request::from_parts(parts, ());
        let span = (self.span_of)(&bodyless);
        let (parts, ()) = bodyless.into_parts();
        self.inner
            .call(http::Request::from_parts(parts, body))
            .instrument(span)
    }
}

/// Bounds a call (until its response headers) by the shorter of the
/// caller's `grpc-timeout` and the server's bound; past it the call is
/// CANCELLED ("Timeout expired"), as tonic answers.
#[derive(Clone)]
struct Deadline<S> {
    inner: S,
    bound: Duration,
}

impl<S, B> Service<http::Request<B>> for Deadline<S>
where
    S: Service<http::Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let bound = grpc_timeout(req.headers()).map_or(self.bound, |t| t.min(self.bound));
        let call = self.inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout(bound, call).await {
                Ok(answer) => answer.map_err(Into::into),
                Err(_) => Err(Box::new(tonic::TimeoutExpired(())) as BoxError),
            }
        })
    }
}

/// The caller's deadline from a `grpc-timeout` header (at most 8 digits and
/// a unit: H, M, S, m, u or n); none when absent or malformed.
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// What lies under a connection's error (hyper's own says only "http2
/// error"): its sources, outermost first.
fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut causes = vec![];
    let mut source = error.source();
    while let Some(cause) = source {
        causes.push(cause.to_string());
        source = cause.source();
    }
    causes.join(": ")
}

/// A request body of the lean HTTP/2 server that ended early: a stream
/// lost or reset with CANCEL was abandoned by its caller.
fn lean_stream(error: automesh_http2::StreamError) -> tonic::Status {
    use automesh_http2::{Reason, StreamError};
    let abandoned = match &error {
        StreamError::Lost => true,
        StreamError::Reset { reason, .. } => *reason == Reason::CANCEL,
    };
    automesh_edge::status::stream_ended(abandoned, &error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_headers_are_read_as_the_protocol_spells_them() {
        let at = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-timeout", v.parse().expect("header"));
            grpc_timeout(&h)
        };
        assert_eq!(at("3S"), Some(Duration::from_secs(3)));
        assert_eq!(at("250m"), Some(Duration::from_millis(250)));
        assert_eq!(at("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(at("5u"), Some(Duration::from_micros(5)));
        assert_eq!(at("123456789S"), None, "more than 8 digits");
        assert_eq!(at("S"), None);
        assert_eq!(at("10x"), None);
        assert_eq!(grpc_timeout(&http::HeaderMap::new()), None);
    }
}
