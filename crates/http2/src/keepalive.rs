//! A connection's keepalive: a PING after `interval` without a byte from
//! the peer, and the connection's end when its answer takes longer than
//! `timeout`. One timer per connection, its deadlines rounded up to the
//! server's grid so that idle connections PING together; the timer is
//! re-armed when it fires or a PING is answered, never per read.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::time::Sleep;

use super::ConnError;
use super::frame;
use crate::GridTimer;

/// The payload of our keepalive PINGs; an answer carries it back.
pub(super) const PAYLOAD: [u8; 8] = *b"automesh";

/// How long peers take to answer our PINGs, up to the keepalive bound.
fn answer_times() -> &'static opentelemetry::metrics::Histogram<f64> {
    static ANSWERS: std::sync::OnceLock<opentelemetry::metrics::Histogram<f64>> =
        std::sync::OnceLock::new();
    ANSWERS.get_or_init(|| {
        super::meter()
            .f64_histogram("automesh.http2.ping.answer.duration")
            .with_unit("s")
            .with_description(
                "How long peers of the lean HTTP/2 server (the runner listener) took to answer \
                 its PINGs (keepalive and shutdown), as the server read the answer: answers near \
                 the keepalive bound mean a loaded fleet, or a server too loaded to read them",
            )
            .with_boundaries(vec![0.001, 0.005, 0.025, 0.1, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0])
            .build()
    })
}

/// The payload of the PING of a graceful shutdown.
pub(super) const DRAINING: [u8; 8] = *b"draining";

pub(super) struct Keepalive {
    interval: Duration,
    timeout: Duration,
    grid: GridTimer,
    sleep: Pin<Box<Sleep>>,
    /// When the peer last sent anything.
    heard: Instant,
    /// When our unanswered PING was sent.
    pinged: Option<Instant>,
}

impl Keepalive {
    pub fn new((interval, timeout): (Duration, Duration), grid: Duration) -> Self {
        let grid = GridTimer::new(grid);
        let now = Instant::now();
        let sleep = Box::pin(tokio::time::sleep_until(grid.round(now + interval).into()));
        Self {
            interval,
            timeout,
            grid,
            sleep,
            heard: now,
            pinged: None,
        }
    }

    /// The peer sent something.
    pub fn heard(&mut self) {
        self.heard = Instant::now();
    }

    /// The peer answered a PING of ours: how long it took is recorded
    /// (`automesh.http2.ping.answer.duration`), so that keepalive ends can
    /// be told apart from a fleet that answers slowly.
    pub fn answered(&mut self) {
        if let Some(at) = self.pinged.take() {
            answer_times().record(at.elapsed().as_secs_f64(), &[]);
            let at = self.grid.round(self.heard + self.interval);
            self.sleep.as_mut().reset(at.into());
        }
    }

    /// A PING of another purpose was sent: it must be answered in time.
    pub fn expect_answer(&mut self) {
        let now = Instant::now();
        self.pinged = Some(now);
        self.sleep
            .as_mut()
            .reset(self.grid.round(now + self.timeout).into());
    }

    /// Sends a PING into `out` when the peer has been silent for the
    /// interval; `Ready` with the error when a PING went unanswered.
    pub fn poll(&mut self, cx: &mut Context<'_>, out: &mut Vec<u8>) -> Poll<ConnError> {
        while self.sleep.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if self.pinged.is_some() {
                return Poll::Ready(ConnError::KeepAlive(self.timeout));
            }
            let due = self.heard + self.interval;
            let next = if due <= now {
                frame::ping(out, false, PAYLOAD);
                self.pinged = Some(now);
                now + self.timeout
            } else {
                due
            };
            self.sleep.as_mut().reset(self.grid.round(next).into());
        }
        Poll::Pending
    }

    /// Waits for a closing connection's deadline on the same timer.
    pub fn poll_close_deadline(&mut self, cx: &mut Context<'_>, at: Option<Instant>) -> Poll<()> {
        let Some(at) = at else {
            return Poll::Ready(());
        };
        let at = tokio::time::Instant::from(at);
        if self.sleep.deadline() != at {
            self.pinged = None;
            self.sleep.as_mut().reset(at);
        }
        self.sleep.as_mut().poll(cx)
    }
}
