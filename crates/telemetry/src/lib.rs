//! Telemetry initialisation: structured logs (text, or JSON with
//! `AUTOMESH_LOG_FORMAT=json`) filtered by `RUST_LOG`, W3C trace context
//! propagation, and OTLP trace export when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set.
//!
//! Spans always get OpenTelemetry trace ids, exported or not, so that run
//! records and log lines carry them.

pub mod json_log;
pub mod metrics;
pub mod otlp_logs;
pub mod propagation;

use opentelemetry::global;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::subscriber::Interest;
use tracing::{Metadata, span};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::layer::{Context, Filter};
use tracing_subscriber::util::SubscriberInitExt;

/// A per-layer filter whose callsites are never cached as "always".
///
/// Per-layer filters pass each decision from `enabled` to the event through
/// a thread-local; a callsite cached as "always" skips `enabled`, and reads
/// whatever the previous `enabled` call on that thread left there. sqlx asks
/// `log::log_enabled!` after every query (through `tracing-log`, a call to
/// `enabled` with no event after it), so the next such event — "serving",
/// "shutdown requested", a run's log lines — was silently dropped whenever
/// `RUST_LOG` enabled debug anywhere (tokio-rs/tracing#2519, #2704). With
/// "sometimes", `enabled` runs before every event and the state is fresh.
pub struct Fresh<F>(pub F);

impl<S, F: Filter<S>> Filter<S> for Fresh<F> {
    fn enabled(&self, meta: &Metadata<'_>, cx: &Context<'_, S>) -> bool {
        self.0.enabled(meta, cx)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        let interest = self.0.callsite_enabled(meta);
        if interest.is_never() {
            interest
        } else {
            Interest::sometimes()
        }
    }

    fn event_enabled(&self, event: &tracing::Event<'_>, cx: &Context<'_, S>) -> bool {
        self.0.event_enabled(event, cx)
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        self.0.max_level_hint()
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_new_span(attrs, id, cx);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, cx: Context<'_, S>) {
        self.0.on_record(id, values, cx);
    }

    fn on_enter(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_enter(id, cx);
    }

    fn on_exit(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_exit(id, cx);
    }

    fn on_close(&self, id: span::Id, cx: Context<'_, S>) {
        self.0.on_close(id, cx);
    }
}

/// Flushes and shuts down trace and metric export when dropped.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    meters: opentelemetry_sdk::metrics::SdkMeterProvider,
    logs: Option<opentelemetry_sdk::logs::SdkLoggerProvider>,
    scrape: crate::metrics::Scrape,
}

impl Telemetry {
    /// What a metrics listener serves.
    pub fn scrape(&self) -> crate::metrics::Scrape {
        self.scrape.clone()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
        let _ = self.meters.force_flush();
        let _ = self.meters.shutdown();
        if let Some(logs) = &self.logs {
            let _ = logs.force_flush();
            let _ = logs.shutdown();
        }
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

/// This process as telemetry names it: the standard `OTEL_SERVICE_NAME` and
/// `OTEL_RESOURCE_ATTRIBUTES` win over `default_name`, and every process
/// gets a `service.instance.id` of its own (unless those variables set one),
/// so replicas of one service can be told apart.
pub fn resource(default_name: &str) -> Resource {
    use opentelemetry::{Key, KeyValue};
    let detected = Resource::builder().build();
    let mut builder = Resource::builder();
    let named = detected
        .get(&Key::new("service.name"))
        .is_some_and(|n| !n.as_str().starts_with("unknown_service"));
    if !named {
        builder = builder.with_service_name(default_name.to_owned());
    }
    if detected.get(&Key::new("service.instance.id")).is_none() {
        builder = builder.with_attribute(KeyValue::new(
            "service.instance.id",
            uuid::Uuid::new_v4().to_string(),
        ));
    }
    builder.build()
}

fn any_set(vars: &[&str]) -> bool {
    vars.iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Whether the standard OTLP variables ask for trace export.
pub fn otlp_requested() -> bool {
    any_set(&[
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ])
}

/// Whether the standard OTLP variables ask for log export (and
/// `OTEL_LOGS_EXPORTER` does not say `none`).
pub fn otlp_logs_requested() -> bool {
    std::env::var("OTEL_LOGS_EXPORTER").map_or(true, |v| v != "none")
        && any_set(&[
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
        ])
}

/// Whether the standard OTLP variables ask for metric export (and
/// `OTEL_METRICS_EXPORTER` does not say `none`).
pub fn otlp_metrics_requested() -> bool {
    std::env::var("OTEL_METRICS_EXPORTER").map_or(true, |v| v != "none")
        && any_set(&[
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        ])
}

/// Installs the global propagator, tracer provider and subscriber. Must be
/// called inside a tokio runtime (the OTLP exporter needs one).
pub fn init(service_name: &str) -> Result<Telemetry, TelemetryError> {
    use std::io::IsTerminal;
    // Colours only for a person at a terminal, never into a log file.
    install(
        service_name,
        std::io::stderr,
        std::io::stderr().is_terminal(),
    )
}

/// [`init`], with log lines written (without colours) to `writer`.
pub fn init_writing_to<W>(service_name: &str, writer: W) -> Result<Telemetry, TelemetryError>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    install(service_name, writer, false)
}

fn install<W>(service_name: &str, writer: W, ansi: bool) -> Result<Telemetry, TelemetryError>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    global::set_text_map_propagator(TraceContextPropagator::new());
    let resource = resource(service_name);
    let scrape = crate::metrics::Scrape::default();
    let resource_for_logs = resource.clone();
    let meters = crate::metrics::provider(resource.clone(), &scrape, otlp_metrics_requested())?;
    global::set_meter_provider(meters.clone());
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if otlp_requested() {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    global::set_tracer_provider(provider.clone());
    let logs = if otlp_logs_requested() {
        let exporter = opentelemetry_otlp::LogExporter::builder()
            .with_tonic()
            .build()?;
        Some(
            opentelemetry_sdk::logs::SdkLoggerProvider::builder()
                .with_resource(resource_for_logs)
                .with_batch_exporter(exporter)
                .build(),
        )
    } else {
        None
    };
    let otlp_logs = logs.as_ref().map(|l| {
        crate::otlp_logs::OtlpLogs::new(l)
            .with_filter(Fresh(EnvFilter::try_from_default_env().unwrap_or_else(
                |_| EnvFilter::new("info,h2=warn,hyper=warn,tower=warn,sqlx=warn"),
            )))
    });
    let tracer = provider.tracer(service_name.to_owned());
    // Filters are per layer: `RUST_LOG` quiets the logs, never the spans
    // that carry trace context between services.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(Fresh(span_filter()));
    let filter = Fresh(
        EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new("info,h2=warn,hyper=warn,tower=warn,sqlx=warn")),
    );
    let json = std::env::var("AUTOMESH_LOG_FORMAT").is_ok_and(|v| v == "json");
    let registry = tracing_subscriber::registry().with(otel).with(otlp_logs);
    let installed = if json {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                    .event_format(crate::json_log::JsonWithTrace)
                    .with_writer(writer)
                    .with_filter(filter),
            )
            .try_init()
    } else {
        registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(ansi)
                    .with_writer(writer)
                    .with_filter(filter),
            )
            .try_init()
    };
    installed.map_err(|_| TelemetryError::AlreadyInstalled)?;
    Ok(Telemetry {
        provider,
        meters,
        logs,
        scrape,
    })
}

/// The spans exported as traces: automesh's own at info and above, and
/// nothing from the transport crates underneath.
fn span_filter() -> EnvFilter {
    EnvFilter::new("info,h2=off,hyper=off,hyper_util=off,tower=off,sqlx=warn,rmcp=warn")
}

/// What tests' log lines are captured into (bounded), so a test can scan
/// every log line the services in its process wrote.
static CAPTURED: parking_lot::Mutex<Vec<u8>> = parking_lot::Mutex::new(Vec::new());
const CAPTURE_LIMIT: usize = 64 * 1024 * 1024;

struct Capture;

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut c = CAPTURED.lock();
        if c.len() + buf.len() <= CAPTURE_LIMIT {
            c.extend_from_slice(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Every log line captured in this process since `init_for_tests` (debug
/// and above for automesh, info for the rest; transport crates excluded).
pub fn captured_logs() -> String {
    String::from_utf8_lossy(&CAPTURED.lock()).into_owned()
}

/// For tests: the propagator, an in-process tracer provider (no export),
/// a subscriber that writes through the test harness, and a capture of
/// every log line for [`captured_logs`]. Idempotent, so every test may call
/// it.
pub fn init_for_tests() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        global::set_text_map_propagator(TraceContextPropagator::new());
        let provider = SdkTracerProvider::builder().build();
        global::set_tracer_provider(provider.clone());
        let otel = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("automesh-tests"))
            .with_filter(Fresh(span_filter()));
        let filter =
            Fresh(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")));
        let _ = tracing_subscriber::registry()
            .with(otel)
            .with(
                tracing_subscriber::fmt::layer()
                    .with_test_writer()
                    .with_filter(filter),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(|| Capture)
                    .with_filter(Fresh(EnvFilter::new(
                        "info,automesh=debug,h2=off,hyper=off,hyper_util=off,tower=off,sqlx=warn",
                    ))),
            )
            .try_init();
    });
}
