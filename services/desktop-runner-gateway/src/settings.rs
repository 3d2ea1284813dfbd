//! The bounds of runner streams: the gateway's flags for heartbeats, the
//! dead-stream bound, Hello and acceptance, and what serves the runner
//! listener's HTTP/2; the keepalive the bound gives that listener.

use std::time::Duration;

/// Bounds of a runner stream: flags of the gateway's configuration, whose
/// defaults are [`StreamSettings::default`].
#[derive(Debug, Clone, clap::Args)]
pub struct StreamSettings {
    /// How often runners must send a heartbeat (told to them in `Welcome`).
    #[arg(long = "heartbeat-interval", env = "AUTOMESH_RUNNER_HEARTBEAT", default_value = "3s", value_parser = automesh_domain::parse_duration)]
    pub heartbeat_interval: Duration,
    /// Silence after which a runner's stream is declared dead.
    #[arg(long = "dead-after", env = "AUTOMESH_RUNNER_DEAD_AFTER", default_value = "10s", value_parser = automesh_domain::parse_duration)]
    pub dead_after: Duration,
    /// How long the gateway may take to store one report of a runner (its
    /// events, a result) before it gives up on the stream (UNAVAILABLE: the
    /// runner reconnects and sends it again, event ids make that harmless).
    /// While a report is stored the runner's next messages are still read —
    /// its heartbeats keep it alive — until a few reports wait; then the
    /// gateway stops reading (HTTP/2 flow control holds the runner back)
    /// and its silence is not counted against it.
    #[arg(long = "report-timeout", env = "AUTOMESH_RUNNER_REPORT_TIMEOUT", default_value = "60s", value_parser = automesh_domain::parse_duration)]
    pub report_timeout: Duration,
    /// How long a new stream may take to say `Hello`.
    #[arg(long = "hello-timeout", env = "AUTOMESH_RUNNER_HELLO_TIMEOUT", default_value = "5s", value_parser = automesh_domain::parse_duration)]
    pub hello_timeout: Duration,
    /// How long a runner may hold an assignment without accepting it before
    /// it goes to the owner's other runners (and the runner is told to drop
    /// it).
    #[arg(long = "accept-within", env = "AUTOMESH_RUNNER_ACCEPT_WITHIN", default_value = "10s", value_parser = automesh_domain::parse_duration)]
    pub accept_within: Duration,
    /// How often a replica looks for desktop work it was not told about
    /// (offers, given-back claims, cancellations, revoked runners, a run's
    /// change): the fallback for a lost notification. Notes (LISTEN/NOTIFY
    /// on PostgreSQL) bring work at once; a lost LISTEN connection is made
    /// again and followed by one look at everything.
    #[arg(long = "dispatch-poll", env = "AUTOMESH_RUNNER_DISPATCH_POLL", default_value = "1s", value_parser = automesh_domain::parse_duration)]
    pub dispatch_poll: Duration,
    /// What serves the runner listener's HTTP/2 connections: `lean` (ours,
    /// which keeps no buffers on an idle connection: about 12 KiB per idle
    /// runner instead of about 31) or `hyper` (hyper's, as every other
    /// listener), a fallback should a runner's HTTP/2 client disagree with
    /// the lean one.
    #[arg(long = "runner-http2", env = "AUTOMESH_RUNNER_HTTP2", default_value = "lean")]
    pub http2: Http2,
}

/// An HTTP/2 implementation for the runner listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Http2 {
    Lean,
    Hyper,
}

impl Default for StreamSettings {
    /// The flags' defaults.
    fn default() -> Self {
        automesh_rpc::runtime::config_from_args(&[]).expect("the stream flags' defaults parse")
    }
}

impl StreamSettings {
    /// Refuses bounds that would declare every stream dead or never.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.heartbeat_interval.is_zero() && self.heartbeat_interval < self.dead_after,
            "the runner heartbeat ({:?}, AUTOMESH_RUNNER_HEARTBEAT) must be longer than 0 and \
             shorter than the dead-after bound ({:?}, AUTOMESH_RUNNER_DEAD_AFTER)",
            self.heartbeat_interval,
            self.dead_after
        );
        for (bound, what) in [
            (self.hello_timeout, "AUTOMESH_RUNNER_HELLO_TIMEOUT"),
            (self.report_timeout, "AUTOMESH_RUNNER_REPORT_TIMEOUT"),
            (self.accept_within, "AUTOMESH_RUNNER_ACCEPT_WITHIN"),
            (self.dispatch_poll, "AUTOMESH_RUNNER_DISPATCH_POLL"),
        ] {
            anyhow::ensure!(!bound.is_zero(), "{what} must be longer than 0");
        }
        Ok(())
    }

    /// The runner listener's HTTP/2 keepalive: a PING after half the
    /// dead-after bound of silence, answered within two fifths of it, so a
    /// stalled PING-liveness stream is closed within the bound.
    pub fn keepalive(&self) -> (Duration, Duration) {
        (self.dead_after / 2, self.dead_after * 2 / 5)
    }

    /// The grid the runner listener rounds its keepalive deadlines up to,
    /// so the PINGs of many idle streams fire together: the PING and its
    /// timeout are each late by at most one step, a fortieth of the
    /// dead-after bound at most (50 ms at the default 10 s), which keeps a
    /// stalled stream's end within 95 % of the bound.
    pub fn ping_grid(&self) -> Duration {
        (self.dead_after / 40).min(automesh_rpc::server::PING_GRID)
    }
}
