//! W3C trace context in gRPC metadata: injected on every outbound call,
//! extracted on every inbound one, and stored with each run so that its
//! trace can be continued by whichever service handles it later.

use std::collections::HashMap;

use opentelemetry::Context;
use opentelemetry::global;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Writes the current span's context into outbound metadata.
pub fn inject(metadata: &mut MetadataMap) {
    let cx = tracing::Span::current().context();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataInjector(metadata)));
}

/// Reads a remote parent context from inbound HTTP/2 headers.
pub fn extract(headers: &http::HeaderMap) -> Context {
    global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// The current span's context as a `traceparent` value, to store with a run.
pub fn current_traceparent() -> Option<String> {
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut map: HashMap<String, String> = HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut map));
    map.remove("traceparent")
}

/// A parent context from a stored `traceparent`, to continue a run's trace.
pub fn context_from_traceparent(traceparent: &str) -> Context {
    let map = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    global::get_text_map_propagator(|p| p.extract(&map))
}

/// Makes `span` a child of the run trace named by `traceparent`.
pub fn continue_trace(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(tp) = traceparent.filter(|tp| !tp.is_empty()) {
        let _ = span.set_parent(context_from_traceparent(tp));
    }
}

/// A span of work on one run in the run's own trace (`traceparent`, as the
/// run, its assignment or its journal stores it), for work that is not
/// inside a request of the run: a loop's step, a report from a stream, a
/// recovery after a restart. Whatever is logged inside it carries the
/// run's trace id, and its parent is only the run's trace, never the span
/// of the loop or stream it was made in.
pub fn run_span(otel_name: &'static str, run_id: &str, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(
        parent: None,
        "automesh.on_run",
        otel.name = otel_name,
        run_id = %run_id
    );
    continue_trace(&span, traceparent);
    span
}

/// The trace id of the current span, for logs and error messages.
pub fn current_trace_id() -> Option<String> {
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}
