//! The scheduler's metrics: runs created by placement, trigger and initial
//! state, and the runs it creates already ended (skipped, missed).

use std::sync::OnceLock;

use automesh_domain::{ErrorCode, Placement, RunState, RunTrigger};
use opentelemetry::KeyValue;
use opentelemetry::metrics::Counter;

fn created() -> &'static Counter<u64> {
    static CREATED: OnceLock<Counter<u64>> = OnceLock::new();
    CREATED.get_or_init(|| {
        automesh_rpc::metrics::counter(
            "automesh.runs.created",
            "Runs created, by placement, trigger and initial state",
        )
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
    for c in created {
        let trigger = c.trigger.as_str();
        self::created().add(
            1,
            &[
                KeyValue::new("placement", c.placement.as_str()),
                KeyValue::new("trigger", trigger),
                KeyValue::new("state", c.state.as_str()),
            ],
        );
        if c.state.is_terminal() {
            automesh_rpc::metrics::run_ended(c.placement, c.state, c.code);
        }
    }
}
