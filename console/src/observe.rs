//! What an SRE sees of the console: a span per page request (the gateway
//! calls it makes are its children, so a click and the API calls behind it
//! are one trace), request counts and durations by route and status, the
//! live pages open, and the headers that keep every page in its lane (the
//! Content-Security-Policy allows no inline script).

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};
use tracing::Instrument;

/// Scripts and styles only from the console itself; no inline script, no
/// framing, no form posting elsewhere.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                       connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
                       base-uri 'none'";

struct Metrics {
    requests: Counter<u64>,
    duration: Histogram<f64>,
}

fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| Metrics {
        requests: automesh_telemetry::metrics::counter(
            "automesh.console.requests",
            "Console HTTP requests, by route and response status",
        ),
        duration: automesh_telemetry::metrics::seconds(
            "automesh.console.request.duration",
            "Console HTTP request time, to the response's headers (a live page's stream is \
             counted to its first byte), by route",
            &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ],
        ),
    })
}

/// Traces, counts and times a request, and adds the security headers.
pub async fn request(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let method = req.method().clone();
    // The URL's query (search text) and every header stay out of the span:
    // the session cookie is a bearer token.
    let span = tracing::info_span!(
        "console.request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    let started = Instant::now();
    let mut response = next.run(req).instrument(span.clone()).await;
    let status = response.status().as_u16();
    span.record("http.response.status_code", status);
    let attributes = [
        KeyValue::new("route", route.clone()),
        KeyValue::new("status", i64::from(status)),
    ];
    metrics().requests.add(1, &attributes);
    metrics().duration.record(
        started.elapsed().as_secs_f64(),
        &[KeyValue::new("route", route)],
    );
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// Ready while the gateway reports SERVING: the console can show nothing
/// without it.
pub async fn ready(State(state): State<crate::AppState>) -> Response {
    if state.api.serving().await {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the gateway is not serving",
        )
            .into_response()
    }
}
