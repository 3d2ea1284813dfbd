//! Telemetry initialisation: structured logs (text, or JSON with
//! `AUTOMESH_LOG_FORMAT=json`) filtered by `RUST_LOG`, W3C trace context
//! propagation, and OTLP trace export when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set.
//!
//! Spans always get OpenTelemetry trace ids, exported or not, so that run
//! records and log lines carry them.

use opentelemetry::global;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Flushes and shuts down trace export when dropped.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("otlp exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("a global tracing subscriber is already installed")]
    AlreadyInstalled,
}

/// Whether the standard OTLP variables ask for export.
pub fn otlp_requested() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Installs the global propagator, tracer provider and subscriber. Must be
/// called inside a tokio runtime (the OTLP exporter needs one).
pub fn init(service_name: &str) -> Result<Telemetry, TelemetryError> {
    global::set_text_map_propagator(TraceContextPropagator::new());
    let mut builder = SdkTracerProvider::builder().with_resource(
        Resource::builder()
            .with_service_name(service_name.to_owned())
            .build(),
    );
    if otlp_requested() {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    global::set_tracer_provider(provider.clone());
    let tracer = provider.tracer(service_name.to_owned());
    let otel = tracing_opentelemetry::layer().with_tracer(tracer);
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,h2=warn,hyper=warn,tower=warn,sqlx=warn"));
    let json = std::env::var("AUTOMESH_LOG_FORMAT").is_ok_and(|v| v == "json");
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    let installed = if json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(false)
                    .with_writer(std::io::stderr),
            )
            .try_init()
    } else {
        registry
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .try_init()
    };
    installed.map_err(|_| TelemetryError::AlreadyInstalled)?;
    Ok(Telemetry { provider })
}

/// Installs only the propagator and a tracer provider (no subscriber), for
/// tests that bring their own subscriber or none.
pub fn init_for_tests() {
    global::set_text_map_propagator(TraceContextPropagator::new());
}
