//! Metrics through the OpenTelemetry metrics SDK: exported over OTLP when
//! the standard variables ask for it, and always readable as Prometheus
//! text on a service's metrics listener (`/metrics`, off the gRPC port).
//!
//! Instruments are made from [`meter`] where the work happens; names and
//! units follow the OpenTelemetry style (`automesh.runs.ended`, unit `s`),
//! and label sets stay bounded: placement, outcome, error code, method,
//! state — never a run, user or organisation id.

use std::fmt::Write as _;
use std::sync::{Arc, Weak};
use std::time::Duration;

use opentelemetry::metrics::Meter;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    InstrumentKind, ManualReader, Pipeline, SdkMeterProvider, Temporality,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// automesh's meter.
pub fn meter() -> Meter {
    opentelemetry::global::meter("automesh")
}

/// A counter of automesh's meter.
pub fn counter(
    name: &'static str,
    description: &'static str,
) -> opentelemetry::metrics::Counter<u64> {
    meter()
        .u64_counter(name)
        .with_description(description)
        .build()
}

/// A histogram of durations in seconds with these bucket `boundaries`.
pub fn seconds(
    name: &'static str,
    description: &'static str,
    boundaries: &[f64],
) -> opentelemetry::metrics::Histogram<f64> {
    meter()
        .f64_histogram(name)
        .with_unit("s")
        .with_description(description)
        .with_boundaries(boundaries.to_vec())
        .build()
}

/// Counts a run that reached a terminal state (`automesh.runs.ended`),
/// wherever it ended: created already ended by the scheduler (skipped,
/// missed) or ended by a coordinator.
pub fn run_ended(
    placement: automesh_domain::Placement,
    outcome: automesh_domain::RunState,
    error_code: Option<automesh_domain::ErrorCode>,
) {
    static ENDED: std::sync::OnceLock<opentelemetry::metrics::Counter<u64>> =
        std::sync::OnceLock::new();
    ENDED
        .get_or_init(|| {
            counter(
                "automesh.runs.ended",
                "Runs that reached a terminal state, by placement, outcome and error code",
            )
        })
        .add(
            1,
            &[
                opentelemetry::KeyValue::new("placement", placement.as_str()),
                opentelemetry::KeyValue::new("outcome", outcome.as_str()),
                opentelemetry::KeyValue::new(
                    "error_code",
                    error_code.map(|c| c.as_str()).unwrap_or(""),
                ),
            ],
        );
}

/// A gauge whose values a service samples itself (a database count, say)
/// and the SDK reads at each collection.
#[derive(Clone, Default)]
pub struct Sampled(Arc<parking_lot::Mutex<Vec<Sample>>>);

/// One value of a sampled gauge, with its labels.
pub type Sample = (f64, Vec<opentelemetry::KeyValue>);

impl std::fmt::Debug for Sampled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sampled")
    }
}

impl Sampled {
    /// Registers the gauge `name` (with `unit`) on automesh's meter.
    pub fn gauge(name: &'static str, unit: &'static str, description: &'static str) -> Self {
        let sampled = Sampled::default();
        let values = sampled.0.clone();
        let _gauge = meter()
            .f64_observable_gauge(name)
            .with_unit(unit)
            .with_description(description)
            .with_callback(move |observer| {
                let values = values.lock();
                for (v, attrs) in values.iter() {
                    observer.observe(*v, attrs);
                }
            })
            .build();
        sampled
    }

    /// Replaces the values.
    pub fn set(&self, values: Vec<Sample>) {
        *self.0.lock() = values;
    }
}

/// The reader a scrape collects from, shared with the meter provider.
#[derive(Debug, Clone)]
pub struct Scrape(Arc<ManualReader>);

impl Default for Scrape {
    fn default() -> Self {
        Self(Arc::new(
            ManualReader::builder()
                .with_temporality(Temporality::Cumulative)
                .build(),
        ))
    }
}

impl MetricReader for Scrape {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline);
    }

    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

impl Scrape {
    /// Everything measured so far, as Prometheus text (exposition 0.0.4).
    pub fn render(&self) -> String {
        let mut rm = ResourceMetrics::default();
        if self.0.collect(&mut rm).is_err() {
            return String::new();
        }
        encode(&rm)
    }
}

/// The meter provider of a process: the scrape reader always, and OTLP
/// export when the standard variables ask for it.
pub fn provider(
    resource: opentelemetry_sdk::Resource,
    scrape: &Scrape,
    otlp: bool,
) -> Result<SdkMeterProvider, opentelemetry_otlp::ExporterBuildError> {
    let mut builder = SdkMeterProvider::builder()
        .with_resource(resource)
        .with_reader(scrape.clone());
    if otlp {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .build()?;
        builder = builder
            .with_reader(opentelemetry_sdk::metrics::PeriodicReader::builder(exporter).build());
    }
    Ok(builder.build())
}

/// A Prometheus metric name: dots and dashes become underscores.
fn prom_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The Prometheus unit suffix of an OpenTelemetry unit.
fn unit_suffix(unit: &str) -> &'static str {
    match unit {
        "s" => "_seconds",
        "ms" => "_milliseconds",
        "By" => "_bytes",
        _ => "",
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn labels<'a>(
    kvs: impl Iterator<Item = &'a opentelemetry::KeyValue>,
    extra: Option<(&str, String)>,
) -> String {
    let mut parts: Vec<String> = kvs
        .map(|kv| {
            format!(
                "{}=\"{}\"",
                prom_name(kv.key.as_str()),
                escape(&kv.value.to_string())
            )
        })
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// Writes a counter's or a gauge's points: one line per label set.
fn simple<'a, V: std::fmt::Display>(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    points: impl Iterator<Item = (impl Iterator<Item = &'a opentelemetry::KeyValue>, V)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (attributes, value) in points {
        let _ = writeln!(out, "{name}{} {value}", labels(attributes, None));
    }
}

fn encode(rm: &ResourceMetrics) -> String {
    let mut out = String::new();
    for scope in rm.scope_metrics() {
        for m in scope.metrics() {
            let base = format!("{}{}", prom_name(m.name()), unit_suffix(m.unit()));
            let help = escape(m.description());
            macro_rules! numbers {
                ($data:expr) => {
                    match $data {
                        MetricData::Sum(sum) => {
                            let (name, kind) = if sum.is_monotonic() {
                                (format!("{base}_total"), "counter")
                            } else {
                                (base.clone(), "gauge")
                            };
                            let points = sum.data_points().map(|p| (p.attributes(), p.value()));
                            simple(&mut out, &name, &help, kind, points);
                        }
                        MetricData::Gauge(g) => {
                            let points = g.data_points().map(|p| (p.attributes(), p.value()));
                            simple(&mut out, &base, &help, "gauge", points);
                        }
                        MetricData::Histogram(h) => {
                            let _ = writeln!(out, "# HELP {base} {help}\n# TYPE {base} histogram");
                            for p in h.data_points() {
                                let mut cumulative = 0u64;
                                let bounds: Vec<f64> = p.bounds().collect();
                                for (i, count) in p.bucket_counts().enumerate() {
                                    cumulative += count;
                                    let le =
                                        bounds.get(i).map_or("+Inf".to_owned(), |b| b.to_string());
                                    let _ = writeln!(
                                        out,
                                        "{base}_bucket{} {cumulative}",
                                        labels(p.attributes(), Some(("le", le)))
                                    );
                                }
                                let l = labels(p.attributes(), None);
                                let _ = writeln!(out, "{base}_sum{l} {}", p.sum());
                                let _ = writeln!(out, "{base}_count{l} {}", p.count());
                            }
                        }
                        MetricData::ExponentialHistogram(_) => {}
                    }
                };
            }
            match m.data() {
                AggregatedMetrics::F64(d) => numbers!(d),
                AggregatedMetrics::U64(d) => numbers!(d),
                AggregatedMetrics::I64(d) => numbers!(d),
            }
        }
    }
    out
}

/// Serves `GET /metrics` (Prometheus text) on `listener` until `shutdown`.
pub async fn serve(scrape: Scrape, listener: TcpListener, shutdown: CancellationToken) {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let scrape = scrape.clone();
            async move {
                (
                    [(
                        http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    scrape.render(),
                )
            }
        }),
    );
    if let Err(error) = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
    {
        tracing::warn!(%error, "the metrics listener stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::KeyValue;
    use opentelemetry::metrics::MeterProvider as _;

    #[test]
    fn counters_gauges_and_histograms_render_as_prometheus_text() {
        let scrape = Scrape::default();
        let provider = provider(
            opentelemetry_sdk::Resource::builder_empty().build(),
            &scrape,
            false,
        )
        .expect("provider");
        let meter = provider.meter("test");
        let ended = meter
            .u64_counter("automesh.runs.ended")
            .with_description("runs that ended")
            .build();
        ended.add(2, &[KeyValue::new("outcome", "succeeded")]);
        ended.add(1, &[KeyValue::new("outcome", "failed")]);
        let streams = meter.i64_up_down_counter("automesh.runner.streams").build();
        streams.add(3, &[]);
        let latency = meter
            .f64_histogram("automesh.run.dispatch.duration")
            .with_unit("s")
            .with_boundaries(vec![0.01, 0.1, 1.0])
            .build();
        latency.record(0.05, &[KeyValue::new("placement", "desktop")]);
        latency.record(0.5, &[KeyValue::new("placement", "desktop")]);
        let text = scrape.render();
        assert!(
            text.contains("# TYPE automesh_runs_ended_total counter"),
            "{text}"
        );
        assert!(
            text.contains("automesh_runs_ended_total{outcome=\"succeeded\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("automesh_runs_ended_total{outcome=\"failed\"} 1"),
            "{text}"
        );
        assert!(text.contains("automesh_runner_streams 3"), "{text}");
        assert!(
            text.contains(
                "automesh_run_dispatch_duration_seconds_bucket{placement=\"desktop\",le=\"0.1\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "automesh_run_dispatch_duration_seconds_bucket{placement=\"desktop\",le=\"+Inf\"} 2"
            ),
            "{text}"
        );
        assert!(
            text.contains("automesh_run_dispatch_duration_seconds_count{placement=\"desktop\"} 2"),
            "{text}"
        );
    }
}
