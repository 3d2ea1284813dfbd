//! The lifecycle's metrics: cloud workers by state, wakes and how long a
//! started worker took to become ready, agents found lost, idle stops.

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};

pub(crate) struct Metrics {
    wakes: Counter<u64>,
    readiness: Histogram<f64>,
    lost: Counter<u64>,
    idle_stops: Counter<u64>,
    pub(crate) workers: automesh_telemetry::metrics::Sampled,
}

pub(crate) fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        use automesh_telemetry::metrics::{counter, seconds};
        Metrics {
            wakes: counter(
                "automesh.cloud.wakes",
                "Wakes of a cloud worker for a run, by result (ready, started, or an error code)",
            ),
            readiness: seconds(
                "automesh.cloud.readiness.duration",
                "From starting a cloud worker to its agent answering",
                &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0],
            ),
            lost: counter(
                "automesh.cloud.agents.lost",
                "Ready workers whose agent stopped answering (woken afresh)",
            ),
            idle_stops: counter(
                "automesh.cloud.idle_stops",
                "Cloud workers stopped after their idle period",
            ),
            workers: automesh_telemetry::metrics::Sampled::gauge(
                "automesh.cloud.workers",
                "{worker}",
                "Cloud workers by state",
            ),
        }
    })
}

impl Metrics {
    pub(crate) fn woke(&self, result: &'static str) {
        self.wakes.add(1, &[KeyValue::new("result", result)]);
    }

    pub(crate) fn ready_after(&self, took: Duration) {
        self.readiness.record(took.as_secs_f64(), &[]);
    }

    pub(crate) fn agent_lost(&self) {
        self.lost.add(1, &[]);
    }

    pub(crate) fn idle_stopped(&self) {
        self.idle_stops.add(1, &[]);
    }
}
