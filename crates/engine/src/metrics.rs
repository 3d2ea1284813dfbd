//! The engine's metrics, under the OpenTelemetry GenAI conventions where
//! they exist: `gen_ai.client.operation.duration`,
//! `gen_ai.client.token.usage`, and provider retries. Exported over OTLP by
//! the process running the engine (the runner, the worker agent).

use std::sync::OnceLock;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};

pub(crate) struct Metrics {
    duration: Histogram<f64>,
    tokens: Histogram<u64>,
    retries: Counter<u64>,
}

pub(crate) fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = opentelemetry::global::meter("automesh");
        Metrics {
            duration: m
                .f64_histogram("gen_ai.client.operation.duration")
                .with_unit("s")
                .with_description("Model and tool calls of the engine")
                .with_boundaries(vec![
                    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92,
                ])
                .build(),
            tokens: m
                .u64_histogram("gen_ai.client.token.usage")
                .with_unit("{token}")
                .with_description("Tokens per model call, by type (input, output)")
                .with_boundaries(vec![
                    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0,
                ])
                .build(),
            retries: m
                .u64_counter("automesh.provider.retries")
                .with_description("Provider requests retried (429, 5xx, timeouts)")
                .build(),
        }
    })
}

impl Metrics {
    pub(crate) fn operation(
        &self,
        operation: &'static str,
        model: &str,
        took: std::time::Duration,
        error: Option<&'static str>,
    ) {
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", operation),
            KeyValue::new("gen_ai.provider.name", "openai"),
            KeyValue::new("gen_ai.request.model", model.to_owned()),
        ];
        if let Some(e) = error {
            attrs.push(KeyValue::new("error.type", e));
        }
        self.duration.record(took.as_secs_f64(), &attrs);
    }

    pub(crate) fn tokens(&self, model: &str, input: i64, output: i64) {
        for (kind, n) in [("input", input), ("output", output)] {
            self.tokens.record(
                u64::try_from(n).unwrap_or(0),
                &[
                    KeyValue::new("gen_ai.operation.name", "chat"),
                    KeyValue::new("gen_ai.provider.name", "openai"),
                    KeyValue::new("gen_ai.request.model", model.to_owned()),
                    KeyValue::new("gen_ai.token.type", kind),
                ],
            );
        }
    }

    pub(crate) fn retried(&self, status: u16) {
        self.retries.add(
            1,
            &[KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            )],
        );
    }
}
