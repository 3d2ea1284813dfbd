//! The runner gateway's metrics: runner streams held by this replica,
//! assignments delivered (and delivered again after a reconnect), and runner
//! reports refused as protocol errors.

use std::sync::{Arc, OnceLock};

use opentelemetry::metrics::Counter;

struct Metrics {
    streams_ended: Counter<u64>,
    deliveries: Counter<u64>,
    redeliveries: Counter<u64>,
    protocol_errors: Counter<u64>,
    unaccepted: Counter<u64>,
}

fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        use automesh_telemetry::metrics::counter;
        Metrics {
            streams_ended: counter(
                "automesh.runner.streams_ended",
                "Runner streams that ended, by reason: closed (by the runner), lost (its \
                 connection went: a PING-liveness connection that stopped answering among them), \
                 silent (no heartbeat within the bound), replaced, revoked, protocol, broken \
                 (a transport error), shutdown, other",
            ),
            deliveries: counter(
                "automesh.desktop.deliveries",
                "Assignments sent to a runner for the first time",
            ),
            redeliveries: counter(
                "automesh.desktop.redeliveries",
                "Assignments sent again to a reconnected runner that did not hold them",
            ),
            unaccepted: counter(
                "automesh.desktop.unaccepted",
                "Assignments given back because their runner did not accept them in time",
            ),
            protocol_errors: counter(
                "automesh.desktop.protocol_errors",
                "Runner reports refused as protocol errors, by code",
            ),
        }
    })
}

/// One assignment given back because its runner did not accept it in time.
pub(crate) fn unaccepted() {
    metrics().unaccepted.add(1, &[]);
}

/// One runner report refused with `code`.
pub(crate) fn protocol_error(code: &'static str) {
    metrics()
        .protocol_errors
        .add(1, &[opentelemetry::KeyValue::new("code", code)]);
}

/// One assignment sent to a runner.
pub(crate) fn delivered(again: bool) {
    let m = metrics();
    if again {
        m.redeliveries.add(1, &[]);
    } else {
        m.deliveries.add(1, &[]);
    }
}

/// One runner stream ended, for `reason`.
pub(crate) fn stream_ended(reason: &'static str) {
    metrics()
        .streams_ended
        .add(1, &[opentelemetry::KeyValue::new("reason", reason)]);
}

/// Reports the streams `sessions` holds by liveness (`ping`, `heartbeat`),
/// read at each collection.
pub(crate) fn observe_streams(sessions: Arc<crate::stream::Sessions>) {
    let _streams = automesh_telemetry::metrics::meter()
        .u64_observable_gauge("automesh.runner.streams")
        .with_unit("{stream}")
        .with_description("Desktop runner streams connected to this replica, by liveness")
        .with_callback(move |o| {
            let (ping, heartbeat) = sessions.by_liveness();
            o.observe(
                ping as u64,
                &[opentelemetry::KeyValue::new("liveness", "ping")],
            );
            o.observe(
                heartbeat as u64,
                &[opentelemetry::KeyValue::new("liveness", "heartbeat")],
            );
        })
        .build();
}
