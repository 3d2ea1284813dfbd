//! What a listener lets in, alike for hyper's HTTP/2 and the lean one: at
//! most `max_connections` open at once (a permit per connection, taken
//! before the accept, as mini-redis does), and a bound on the time a new
//! connection takes to send its first request — a client that connects and
//! never speaks (or never gets past the preface) holds a file descriptor and
//! a task for nothing. Each shows in metrics (`automesh.server.*`, by
//! listener: the first service it serves) and in a named log line.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, UpDownCounter};

struct Metrics {
    open: UpDownCounter<i64>,
    at_cap: Counter<u64>,
    unready: Counter<u64>,
}

fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let meter = automesh_telemetry::metrics::meter();
        Metrics {
            open: meter
                .i64_up_down_counter("automesh.server.connections")
                .with_description("Connections a listener holds open, by listener")
                .build(),
            at_cap: automesh_telemetry::metrics::counter(
                "automesh.server.connection_cap.reached",
                "Times a listener held its most connections (AUTOMESH_MAX_CONNECTIONS) and \
                 stopped accepting until one closed, by listener",
            ),
            unready: automesh_telemetry::metrics::counter(
                "automesh.server.connections.unready",
                "Connections closed because they sent no request within the first-request \
                 bound (AUTOMESH_FIRST_REQUEST_WITHIN; no HTTP/2 preface, or no request \
                 headers), by listener",
            ),
        }
    })
}

/// The listener reached its cap: counted, and said once per time.
pub(super) fn at_cap(listener: &'static str, max: usize) {
    metrics()
        .at_cap
        .add(1, &[KeyValue::new("listener", listener)]);
    tracing::warn!(
        listener,
        max_connections = max,
        "connection cap reached: accepting no more connections until one closes \
         (AUTOMESH_MAX_CONNECTIONS)"
    );
}

/// An open connection: its permit, and its place in the open count, both
/// given back when it closes.
pub(super) struct Open {
    listener: &'static str,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Open {
    pub(super) fn new(listener: &'static str, permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        metrics()
            .open
            .add(1, &[KeyValue::new("listener", listener)]);
        Self {
            listener,
            _permit: permit,
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        metrics()
            .open
            .add(-1, &[KeyValue::new("listener", self.listener)]);
    }
}

/// The first-request bound of one connection.
pub(super) struct FirstRequest {
    listener: &'static str,
    peer: SocketAddr,
    within: Duration,
    /// Set by the connection's service at its first request.
    asked: Arc<AtomicBool>,
}

impl FirstRequest {
    pub(super) fn new(listener: &'static str, peer: SocketAddr, within: Duration) -> Self {
        Self {
            listener,
            peer,
            within,
            asked: Arc::default(),
        }
    }

    /// What the connection's service sets when its first request comes.
    pub(super) fn asked(&self) -> Arc<AtomicBool> {
        self.asked.clone()
    }

    /// Resolves once the bound passed with no request; never after one.
    pub(super) async fn overdue(&self) {
        tokio::time::sleep(self.within).await;
        if self.asked.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
    }

    /// The connection is closed for it: counted, and said (at most once a
    /// second per process, with how many more were closed meanwhile, so a
    /// flood of silent connections does not flood the log).
    pub(super) fn closing(&self) {
        metrics()
            .unready
            .add(1, &[KeyValue::new("listener", self.listener)]);
        static LAST: AtomicU64 = AtomicU64::new(0);
        static UNSAID: AtomicU64 = AtomicU64::new(0);
        let second = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if LAST.swap(second, Ordering::Relaxed) == second {
            UNSAID.fetch_add(1, Ordering::Relaxed);
            return;
        }
        tracing::warn!(
            listener = self.listener,
            peer = %self.peer,
            bound = ?self.within,
            also_closed = UNSAID.swap(0, Ordering::Relaxed),
            "closing a connection that sent no request within the bound \
             (AUTOMESH_FIRST_REQUEST_WITHIN)"
        );
    }
}
