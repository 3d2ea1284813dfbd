//! The coordinator's metrics (see docs/operations.md): runs ended,
//! automations their ends moved, the latency from due to dispatch and to
//! first event, takeovers, executor
//! calls, tokens and cost, and the queue (depth and lag).

use std::sync::OnceLock;
use std::time::Duration;

use automesh_domain::{ErrorCode, Placement, Run, RunState};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};

/// Latency buckets in seconds, from a millisecond to the longest deadline.
const LATENCY: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

pub(crate) struct Metrics {
    dispatch: Histogram<f64>,
    first_event: Histogram<f64>,
    takeovers: Counter<u64>,
    attention: Counter<u64>,
    calls: Histogram<f64>,
    call_errors: Counter<u64>,
    tokens: Counter<u64>,
    cost: Counter<u64>,
    pub(crate) pending: automesh_telemetry::metrics::Sampled,
    pub(crate) lag: automesh_telemetry::metrics::Sampled,
}

pub(crate) fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        use automesh_telemetry::metrics::{counter, seconds};
        let m = automesh_telemetry::metrics::meter();
        Metrics {
            dispatch: seconds(
                "automesh.run.dispatch.duration",
                "From a run's due instant to its executor accepting StartRun",
                &LATENCY,
            ),
            first_event: seconds(
                "automesh.run.first_event.duration",
                "From a run's due instant to its first executor event",
                &LATENCY,
            ),
            takeovers: counter(
                "automesh.run.lease.takeovers",
                "Runs claimed again after another coordinator's lease lapsed",
            ),
            attention: counter(
                "automesh.automation.attention",
                "Automations a run's end moved: to needs-attention (reason = its code, such as failing_repeatedly) or back to active (reason = cleared)",
            ),
            calls: seconds(
                "automesh.executor.call.duration",
                "Unary calls to an executor, by placement, method and result",
                &LATENCY,
            ),
            call_errors: counter(
                "automesh.executor.call.errors",
                "Executor calls that failed, by placement, method and gRPC code",
            ),
            tokens: counter(
                "automesh.run.tokens",
                "Model tokens of ended runs, by placement and type (input, output)",
            ),
            cost: m
                .u64_counter("automesh.run.cost")
                .with_unit("{micro-unit}")
                .with_description("Cost of ended runs in micro-units of the catalogue's currency")
                .build(),
            pending: automesh_telemetry::metrics::Sampled::gauge(
                "automesh.runs.pending",
                "{run}",
                "Runs waiting to be claimed by a coordinator",
            ),
            lag: automesh_telemetry::metrics::Sampled::gauge(
                "automesh.runs.queue.lag",
                "s",
                "Age of the oldest run waiting to be claimed",
            ),
        }
    })
}

fn placement(p: Placement) -> KeyValue {
    KeyValue::new("placement", p.as_str())
}

/// When the run fell due: its scheduled instant, or its creation when that
/// was later (a catch-up) or it has none (a manual run).
pub(crate) fn due(run: &Run) -> chrono::DateTime<chrono::Utc> {
    run.scheduled_for
        .unwrap_or(run.created_at)
        .max(run.created_at)
}

fn since(at: chrono::DateTime<chrono::Utc>) -> f64 {
    (chrono::Utc::now() - at)
        .to_std()
        .unwrap_or(Duration::ZERO)
        .as_secs_f64()
}

impl Metrics {
    pub(crate) fn ended(
        &self,
        run: &Run,
        state: RunState,
        code: Option<ErrorCode>,
        usage: &automesh_domain::Usage,
    ) {
        automesh_telemetry::metrics::run_ended(run.placement, state, code);
        let p = placement(run.placement);
        let tokens = |n: i64| u64::try_from(n).unwrap_or(0);
        self.tokens.add(
            tokens(usage.input_tokens),
            &[p.clone(), KeyValue::new("type", "input")],
        );
        self.tokens.add(
            tokens(usage.output_tokens),
            &[p.clone(), KeyValue::new("type", "output")],
        );
        self.cost.add(tokens(usage.cost_micros), &[p]);
    }

    /// A run's end moved its automation: to needs-attention for `reason`,
    /// or (`None`) back to active.
    pub(crate) fn attention(&self, reason: Option<ErrorCode>) {
        let reason = reason.map_or("cleared", ErrorCode::as_str);
        self.attention.add(1, &[KeyValue::new("reason", reason)]);
    }

    pub(crate) fn dispatched(&self, run: &Run) {
        self.dispatch
            .record(since(due(run)), &[placement(run.placement)]);
    }

    pub(crate) fn first_event(&self, run: &Run) {
        self.first_event
            .record(since(due(run)), &[placement(run.placement)]);
    }

    pub(crate) fn taken_over(&self, run: &Run) {
        self.takeovers.add(1, &[placement(run.placement)]);
    }

    pub(crate) fn call(
        &self,
        run: &Run,
        method: &'static str,
        started: std::time::Instant,
        result: Result<(), tonic::Code>,
    ) {
        let p = placement(run.placement);
        let outcome = match result {
            Ok(()) => "ok".to_owned(),
            Err(code) => format!("{code:?}"),
        };
        self.calls.record(
            started.elapsed().as_secs_f64(),
            &[
                p.clone(),
                KeyValue::new("method", method),
                KeyValue::new("result", outcome.clone()),
            ],
        );
        if result.is_err() {
            self.call_errors.add(
                1,
                &[
                    p,
                    KeyValue::new("method", method),
                    KeyValue::new("code", outcome),
                ],
            );
        }
    }
}
