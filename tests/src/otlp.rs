//! An OpenTelemetry collector for tests: the real OTLP/gRPC trace and logs
//! services on loopback, keeping every span and log record it receives with
//! its resource (which service, which instance), so a test can read a run's
//! whole trace — and its log lines — across processes.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{
    LogsService, LogsServiceServer,
};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};

/// One received span.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root.
    pub parent_span_id: String,
    pub name: String,
    /// OTLP `SpanKind` (1 internal, 2 server, 3 client, …).
    pub kind: i32,
    /// OTLP status code (0 unset, 1 ok, 2 error).
    pub status: i32,
    pub attributes: BTreeMap<String, String>,
    /// `service.name` of the process that sent it.
    pub service: String,
    /// `service.instance.id` of that process.
    pub instance: String,
}

fn text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

/// One received log record.
#[derive(Debug, Clone)]
pub struct LogLine {
    /// Empty when the line was logged outside any trace.
    pub trace_id: String,
    pub span_id: String,
    pub body: String,
    pub severity: String,
    pub attributes: BTreeMap<String, String>,
    pub service: String,
}

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Span>>>);

#[derive(Clone, Default)]
struct LogCollector(Arc<Mutex<Vec<LogLine>>>);

#[tonic::async_trait]
impl LogsService for LogCollector {
    async fn export(
        &self,
        request: tonic::Request<ExportLogsServiceRequest>,
    ) -> Result<tonic::Response<ExportLogsServiceResponse>, tonic::Status> {
        let mut lines = self.0.lock();
        for rl in &request.get_ref().resource_logs {
            let resource = rl
                .resource
                .as_ref()
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            for sl in &rl.scope_logs {
                for r in &sl.log_records {
                    lines.push(LogLine {
                        trace_id: hex::encode(&r.trace_id),
                        span_id: hex::encode(&r.span_id),
                        body: text(&r.body),
                        severity: r.severity_text.clone(),
                        attributes: attributes(&r.attributes),
                        service: resource.get("service.name").cloned().unwrap_or_default(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportLogsServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock();
        for rs in &request.get_ref().resource_spans {
            let resource = rs
                .resource
                .as_ref()
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            for ss in &rs.scope_spans {
                for s in &ss.spans {
                    spans.push(Span {
                        trace_id: hex::encode(&s.trace_id),
                        span_id: hex::encode(&s.span_id),
                        parent_span_id: hex::encode(&s.parent_span_id),
                        name: s.name.clone(),
                        kind: s.kind,
                        status: s.status.as_ref().map_or(0, |st| st.code),
                        attributes: attributes(&s.attributes),
                        service: resource.get("service.name").cloned().unwrap_or_default(),
                        instance: resource
                            .get("service.instance.id")
                            .cloned()
                            .unwrap_or_default(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A running collector.
#[derive(Clone)]
pub struct Receiver {
    /// Where to point `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    spans: Arc<Mutex<Vec<Span>>>,
    logs: Arc<Mutex<Vec<LogLine>>>,
}

impl Receiver {
    /// Serves until the runtime ends.
    pub async fn start() -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let collector = Collector::default();
        let spans = collector.0.clone();
        let log_collector = LogCollector::default();
        let logs = log_collector.0.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector))
                .add_service(LogsServiceServer::new(log_collector))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(Receiver {
            endpoint,
            spans,
            logs,
        })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().clone()
    }

    /// Every log record received so far.
    pub fn logs(&self) -> Vec<LogLine> {
        self.logs.lock().clone()
    }

    /// The spans of one trace.
    pub fn trace(&self, trace_id: &str) -> Vec<Span> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }
}
