//! The scheduler's metrics: runs created by placement, trigger and initial
//! state, the runs it creates already ended (skipped, missed), and how
//! late after its due instant an occurrence's run was committed (0 when
//! it was committed ahead of it).

use std::sync::OnceLock;

use automesh_domain::{ErrorCode, Placement, RunState, RunTrigger};
use chrono::{DateTime, Utc};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};

fn created() -> &'static Counter<u64> {
    static CREATED: OnceLock<Counter<u64>> = OnceLock::new();
    CREATED.get_or_init(|| {
        automesh_telemetry::metrics::counter(
            "automesh.runs.created",
            "Runs created, by placement, trigger and initial state",
        )
    })
}

/// Buckets of the fire delay, in seconds: a millisecond apart at the low
/// end (an on-time occurrence commits within a few), then up to the
/// catch-up window's scale (an occurrence fired late after downtime).
const FIRE_DELAY: [f64; 17] = [
    0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
    600.0, 3600.0,
];

fn fire_delay() -> &'static Histogram<f64> {
    static FIRE: OnceLock<Histogram<f64>> = OnceLock::new();
    FIRE.get_or_init(|| {
        automesh_telemetry::metrics::seconds(
            "automesh.occurrence.fire.duration",
            "From an occurrence's due instant to the commit of the run it created (0 when it \
             committed ahead of the instant), by placement and path (ahead: fired by one \
             statement just ahead of the instant; pass: by a scheduling pass, catching up \
             included)",
            &FIRE_DELAY,
        )
    })
}

/// How an occurrence's run was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// Read, planned and fired by one statement just ahead of the due
    /// instant (its run held until the instant by the coordinator).
    Ahead,
    /// By a scheduling pass (the instant's fire did not apply, a burst, a
    /// catch-up after downtime).
    Pass,
}

impl Path {
    fn as_str(self) -> &'static str {
        match self {
            Path::Ahead => "ahead",
            Path::Pass => "pass",
        }
    }
}

/// A run the scheduler created, counted once its transaction committed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Created {
    pub placement: Placement,
    pub trigger: RunTrigger,
    pub state: RunState,
    pub code: Option<ErrorCode>,
    /// The due instant of the occurrence whose pending run this is, and the
    /// path that fired it; `None` for a manual run and for one created
    /// already ended.
    pub fired: Option<(DateTime<Utc>, Path)>,
}

/// Counts runs whose transaction has just committed; an occurrence's
/// pending run also records its fire delay, measured now.
pub(crate) fn count(created: &[Created]) {
    let now = Utc::now();
    for c in created {
        if let Some((due, path)) = c.fired {
            let late = (now - due).to_std().unwrap_or_default().as_secs_f64();
            fire_delay().record(
                late,
                &[
                    KeyValue::new("placement", c.placement.as_str()),
                    KeyValue::new("path", path.as_str()),
                ],
            );
        }
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
            automesh_telemetry::metrics::run_ended(c.placement, c.state, c.code);
        }
    }
}
