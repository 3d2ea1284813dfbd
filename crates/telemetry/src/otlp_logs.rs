//! Log lines over OTLP, when the standard variables ask for it: each event
//! becomes a log record with its level, target, message (the body) and
//! fields (attributes), and the trace and span of the span it was logged in
//! — so a log backend links every line about a run to the run's trace.

use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _, Severity};
use opentelemetry_sdk::logs::{SdkLogger, SdkLoggerProvider};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// The layer that turns events into OTLP log records.
pub struct OtlpLogs {
    logger: SdkLogger,
}

impl OtlpLogs {
    pub fn new(provider: &SdkLoggerProvider) -> Self {
        Self {
            logger: provider.logger("automesh"),
        }
    }
}

struct Fields<'a> {
    record: &'a mut opentelemetry_sdk::logs::SdkLogRecord,
}

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record.set_body(AnyValue::from(value.to_owned()));
        } else {
            self.record.add_attribute(field.name(), value.to_owned());
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record.add_attribute(field.name(), value);
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record
            .add_attribute(field.name(), i64::try_from(value).unwrap_or(i64::MAX));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.record.add_attribute(field.name(), value);
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.record.add_attribute(field.name(), value);
    }
}

fn severity(level: &tracing::Level) -> Severity {
    match *level {
        tracing::Level::ERROR => Severity::Error,
        tracing::Level::WARN => Severity::Warn,
        tracing::Level::INFO => Severity::Info,
        tracing::Level::DEBUG => Severity::Debug,
        tracing::Level::TRACE => Severity::Trace,
    }
}

impl<S> tracing_subscriber::Layer<S> for OtlpLogs
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut record = self.logger.create_log_record();
        record.set_target(meta.target().to_owned());
        record.set_severity_number(severity(meta.level()));
        record.set_severity_text(meta.level().as_str());
        record.set_timestamp(std::time::SystemTime::now());
        event.record(&mut Fields {
            record: &mut record,
        });
        if let Some(span) = ctx.event_span(event)
            && let Some(sc) = crate::json_log::traced(&span)
        {
            record.set_trace_context(sc.trace_id(), sc.span_id(), Some(sc.trace_flags()));
        }
        self.logger.emit(record);
    }
}
