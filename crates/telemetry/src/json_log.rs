//! JSON log lines that name their trace: `AUTOMESH_LOG_FORMAT=json` writes
//! one object per line with the event's fields, its span's fields, and the
//! OpenTelemetry `trace_id` and `span_id` of the span it was logged in — so
//! an SRE goes from a log line to its trace, and from a run's trace id to
//! every line about it.

use std::fmt;

use opentelemetry::trace::TraceContextExt;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The JSON line format (see the module).
#[derive(Debug, Default, Clone, Copy)]
pub struct JsonWithTrace;

struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), Value::String(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0
            .insert(field.name().to_owned(), Value::String(value.to_owned()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), value.into());
    }
}

impl<S> FormatEvent<S, JsonFields> for JsonWithTrace
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = Map::new();
        line.insert(
            "timestamp".into(),
            chrono::Utc::now()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                .into(),
        );
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        let mut fields = Map::new();
        event.record(&mut Fields(&mut fields));
        line.insert("fields".into(), Value::Object(fields));
        // The event's own span: its explicit parent (`parent: &span`) when
        // it names one, else the current span.
        let span = match event.parent() {
            Some(id) => ctx.span(id),
            None if event.is_contextual() => ctx.lookup_current(),
            None => None,
        };
        if let Some(span) = span {
            // The fields of the span and its parents, innermost last wins.
            let mut span_fields = Map::new();
            for s in span.scope().from_root() {
                if let Some(f) = s.extensions().get::<FormattedFields<JsonFields>>()
                    && let Ok(Value::Object(map)) = serde_json::from_str::<Value>(f)
                {
                    span_fields.extend(map);
                }
            }
            let mut current = Map::new();
            current.insert("name".into(), span.name().into());
            current.extend(span_fields);
            line.insert("span".into(), Value::Object(current));
            if let Some(sc) = traced(&span) {
                line.insert("trace_id".into(), sc.trace_id().to_string().into());
                line.insert("span_id".into(), sc.span_id().to_string().into());
            }
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// The trace context of the nearest span of `span`'s scope that is in a
/// trace (a library's span below the trace filter has none of its own).
pub(crate) fn traced<S>(
    span: &tracing_subscriber::registry::SpanRef<'_, S>,
) -> Option<opentelemetry::trace::SpanContext>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    span.scope().find_map(|s| {
        let id = s.id();
        let cx =
            tracing::dispatcher::get_default(|d| tracing_opentelemetry::get_otel_context(&id, d))?;
        let sc = cx.span().span_context().clone();
        sc.is_valid().then_some(sc)
    })
}
