//! The scheduler's metrics: runs created by placement, trigger and initial
//! state, and the runs it creates already ended (skipped, missed).

use std::sync::OnceLock;

use automesh_domain::{ErrorCode, Placement, RunState, RunTrigger};
use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;

struct Metrics {
    created: Counter<u64>,
    ended: Counter<u64>,
}

fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = automesh_rpc::metrics::meter();
        Metrics {
            created: m
                .u64_counter("automesh.runs.created")
                .with_description("Runs created, by placement, trigger and initial state")
                .build(),
            ended: m
                .u64_counter("automesh.runs.ended")
                .with_description(
                    "Runs that reached a terminal state, by placement, outcome and error code",
                )
                .build(),
        }
    })
}

/// A run the scheduler created, counted once its transaction committed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Created {
    pub placement: Placement,
    pub trigger: RunTrigger,
    pub state: RunState,
    pub code: Option<ErrorCode>,
}

pub(crate) fn count(created: &[Created]) {
    let m = metrics();
    for c in created {
        let trigger = c.trigger.as_str();
        m.created.add(
            1,
            &[
                KeyValue::new("placement", c.placement.as_str()),
                KeyValue::new("trigger", trigger),
                KeyValue::new("state", c.state.as_str()),
            ],
        );
        if c.state.is_terminal() {
            m.ended.add(
                1,
                &[
                    KeyValue::new("placement", c.placement.as_str()),
                    KeyValue::new("outcome", c.state.as_str()),
                    KeyValue::new("error_code", c.code.map(|c| c.as_str()).unwrap_or("")),
                ],
            );
        }
    }
}
