//! The reference desktop runner (`automesh runner`, SPEC §6).
//!
//! It keeps one `Connect` stream to the desktop-runner-gateway, authenticated
//! with its per-runner token, and:
//! - says `Hello` with every run its local record still holds, then sends the
//!   events and results of those runs again (event ids make that harmless);
//! - asks for liveness by HTTP/2 PING (`Hello.ping_liveness`): when the
//!   gateway grants it, neither side sends heartbeats while idle; the
//!   gateway PINGs the connection and ends it when the runner does not
//!   answer, and the runner, which sends no PINGs, leaves a gateway it has
//!   not heard a byte from for `dead_after` (after asking with one heartbeat
//!   at three fifths of it; see `link`); otherwise (an older gateway) it heartbeats at the
//!   interval the gateway asks for, and treats a stream on which the gateway
//!   says nothing (not even heartbeat acks) for `dead_after` as dead, like
//!   the gateway does;
//! - reconnects with jittered exponential backoff;
//! - records each assignment as held, synced to disk, *before* it tells the
//!   gateway it accepts it, and starts the engine only once the gateway
//!   confirms the acceptance (recorded as accepted first): an acceptance
//!   lost on the way lets the gateway give the run to another runner, so a
//!   run that was never confirmed never starts here — a held run the gateway
//!   says is another's is let go. An assignment it already holds is never
//!   run again — not after a redelivery, a reconnect, a restart or a laptop
//!   waking from sleep. A run a previous process accepted but did not
//!   finish ends `runner_interrupted` (its agent may have acted already);
//! - runs each assignment through an [`EngineAdapter`] — the native engine
//!   or OpenCode — with the assignment's deadline, and cancels it on
//!   `CancelAssignment`, reporting `IdleObserved` once the engine stopped.

pub mod cli;
mod execute;
mod handle;
mod link;

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_domain::Secret;
use automesh_engine::adapter::{EngineAdapter, Outcome};
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_client::DesktopRunnerServiceClient;
use automesh_proto::v1 as pb;
use rpb::connect_request::Message as Up;
use rpb::connect_response::Message as Down;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The runner's journal of accepted runs, with their `RunFinished`.
type Record = automesh_engine::journal::Record<automesh_proto::runner::v1::RunFinished>;

/// Messages queued towards the gateway before senders wait.
const OUTBOUND: usize = 256;
/// Bound on queueing one message towards the gateway.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// How a runner connects and where it keeps its record.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The desktop-runner-gateway replicas, such as `http://127.0.0.1:50052`;
    /// each reconnection tries the next.
    pub gateways: Vec<String>,
    pub token: Secret,
    /// Where the record of accepted runs lives.
    pub state_dir: PathBuf,
    /// First and largest pause between reconnection attempts (each pause
    /// is jittered).
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// Bound on connecting and on the gateway's `Welcome`.
    pub connect_timeout: Duration,
    /// Silence from the gateway after which the stream is declared dead.
    pub dead_after: Duration,
}

impl Settings {
    pub fn new(gateways: Vec<String>, token: Secret, state_dir: PathBuf) -> Self {
        Self {
            gateways,
            token,
            state_dir,
            reconnect_min: Duration::from_millis(200),
            reconnect_max: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            dead_after: Duration::from_secs(10),
        }
    }
}

/// Counters a supervisor (or a test) can read.
#[derive(Debug, Default)]
pub struct Stats {
    /// Streams that got a `Welcome`.
    pub connections: AtomicUsize,
    /// Runs handed to the engine by this process.
    pub executions: AtomicUsize,
    /// Assignments received that were already held (not run again).
    pub duplicates: AtomicUsize,
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
pub enum StreamEnd {
    #[error("cannot connect to the gateway: {0}")]
    Connect(String),
    #[error("the gateway refused the stream: {0}")]
    Refused(tonic::Status),
    #[error("the gateway sent nothing for {0:?}: the stream is declared dead")]
    Silent(Duration),
    #[error("the stream broke: {0}")]
    Broken(tonic::Status),
    #[error("the gateway closed the stream")]
    Closed,
}

/// A desktop runner.
pub struct Runner {
    settings: Settings,
    engine: Arc<dyn EngineAdapter>,
    record: Arc<Record>,
    active: Arc<Mutex<HashMap<String, CancellationToken>>>,
    outbox: Arc<Mutex<Option<mpsc::Sender<rpb::ConnectRequest>>>>,
    pub stats: Arc<Stats>,
    /// The engines running; aborted when the runner is dropped (a killed
    /// runner leaves nothing running behind).
    engines: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Drop for Runner {
    fn drop(&mut self) {
        for e in self.engines.lock().iter() {
            e.abort();
        }
    }
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("gateways", &self.settings.gateways)
            .field("engine", &self.engine.engine_id())
            .finish()
    }
}

fn up(m: Up) -> rpb::ConnectRequest {
    rpb::ConnectRequest { message: Some(m) }
}

pub use automesh_engine::wire::run_event;
use automesh_engine::wire::{finished_parts, now_ts};

/// The result message for an engine outcome.
pub fn finished(run_id: &str, engine: &str, outcome: &Outcome) -> rpb::RunFinished {
    let (state, error_code, error_message, usage) = finished_parts(outcome);
    rpb::RunFinished {
        run_id: run_id.to_owned(),
        outcome: state as i32,
        error_code,
        error_message,
        engine: engine.to_owned(),
        usage: Some(usage),
    }
}

/// A span of the runner's handling of an assignment, in its run's trace.
fn assignment_span(name: &'static str, a: &rpb::Assignment) -> tracing::Span {
    automesh_telemetry::propagation::run_span(name, &a.run_id, Some(a.traceparent.as_str()))
}

fn jitter(base: Duration) -> Duration {
    // Full jitter in [base/2, base]: reconnecting runners spread out.
    let r = (uuid::Uuid::new_v4().as_u128() % 1000) as u32;
    base / 2 + base * r / 2000
}

impl Runner {
    /// A runner with its record opened. Runs a previous process accepted
    /// but never finished are ended `runner_interrupted` here: they are
    /// never run again.
    pub fn new(settings: Settings, engine: Arc<dyn EngineAdapter>) -> anyhow::Result<Runner> {
        let record = Arc::new(Record::open(&settings.state_dir)?);
        for run in record.all() {
            // A held run never started: it waits for its confirmation.
            if run.finished.is_none() && run.held.is_none() {
                let _in_run = run.span("automesh.runner.interrupted").entered();
                tracing::warn!(run_id = %run.run_id, "a run accepted before a restart ends runner_interrupted; it is not run again");
                record.finish(
                    &run.run_id,
                    &rpb::RunFinished {
                        run_id: run.run_id.clone(),
                        outcome: pb::RunState::Failed as i32,
                        error_code: ErrorCode::RunnerInterrupted.as_str().to_owned(),
                        error_message: "the runner stopped while the run was executing; it is not run again because its agent may already have acted".into(),
                        engine: engine.engine_id().to_owned(),
                        usage: None,
                    },
                )?;
            }
        }
        Ok(Runner {
            settings,
            engine,
            record,
            active: Arc::default(),
            outbox: Arc::default(),
            stats: Arc::default(),
            engines: Mutex::default(),
        })
    }

    /// Keeps a stream to the gateway until `shutdown`, reconnecting with
    /// jittered exponential backoff.
    pub async fn run(&self, shutdown: CancellationToken) {
        let mut backoff = self.settings.reconnect_min;
        let mut attempt = 0usize;
        while !shutdown.is_cancelled() {
            let welcomed_before = self.stats.connections.load(Ordering::SeqCst);
            let Some(gateway) = self
                .settings
                .gateways
                .get(attempt % self.settings.gateways.len().max(1))
                .cloned()
            else {
                tracing::error!("no gateway to connect to");
                return;
            };
            attempt += 1;
            let ended = tokio::select! {
                e = self.stream_once(&gateway, &shutdown) => e,
                () = shutdown.cancelled() => break,
            };
            *self.outbox.lock() = None;
            if self.stats.connections.load(Ordering::SeqCst) > welcomed_before {
                backoff = self.settings.reconnect_min;
            }
            let pause = jitter(backoff);
            tracing::warn!(reason = %ended, retry_in = ?pause, "runner stream ended; reconnecting");
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = shutdown.cancelled() => break,
            }
            backoff = (backoff * 2).min(self.settings.reconnect_max);
        }
        // Stop the engines; their results stay in the record and are
        // reported on the next connection.
        for token in self.active.lock().values() {
            token.cancel();
        }
    }

    fn hello(&self) -> rpb::ConnectRequest {
        let held_runs = self
            .record
            .all()
            .into_iter()
            .map(|r| rpb::HeldRun {
                run_id: r.run_id,
                finished: r.finished.is_some(),
            })
            .collect();
        up(Up::Hello(rpb::Hello {
            runner_version: env!("CARGO_PKG_VERSION").into(),
            held_runs,
            ping_liveness: true,
        }))
    }

    async fn stream_once(&self, gateway: &str, shutdown: &CancellationToken) -> StreamEnd {
        // No PINGs of our own: the connection notes the gateway's (`link`).
        let endpoint = match tonic::transport::Endpoint::from_shared(gateway.to_owned()) {
            Ok(e) => e.connect_timeout(self.settings.connect_timeout),
            Err(e) => return StreamEnd::Connect(e.to_string()),
        };
        let (channel, heard) =
            match tokio::time::timeout(self.settings.connect_timeout, link::connect(&endpoint))
                .await
            {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return StreamEnd::Connect(e.to_string()),
                Err(_) => return StreamEnd::Connect("timed out".into()),
            };
        let (tx, rx) = mpsc::channel(OUTBOUND);
        if tx.send(self.hello()).await.is_err() {
            return StreamEnd::Closed;
        }
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        match format!("Bearer {}", self.settings.token.expose()).parse() {
            Ok(v) => {
                request.metadata_mut().insert("authorization", v);
            }
            Err(_) => return StreamEnd::Connect("the runner token is not valid ASCII".into()),
        }
        let mut client = DesktopRunnerServiceClient::new(channel);
        let opened =
            tokio::time::timeout(self.settings.connect_timeout, client.connect(request)).await;
        let mut inbound = match opened {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => return StreamEnd::Refused(status),
            Err(_) => return StreamEnd::Connect("the gateway did not answer in time".into()),
        };
        let welcome = match tokio::time::timeout(self.settings.connect_timeout, inbound.message())
            .await
        {
            Ok(Ok(Some(rpb::ConnectResponse {
                message: Some(Down::Welcome(w)),
            }))) => w,
            Ok(Ok(_)) => return StreamEnd::Connect("the gateway did not say Welcome first".into()),
            Ok(Err(status)) => return StreamEnd::Refused(status),
            Err(_) => return StreamEnd::Connect("no Welcome in time".into()),
        };
        self.stats.connections.fetch_add(1, Ordering::SeqCst);
        let interval = welcome
            .heartbeat_interval
            .and_then(|d| Duration::try_from(d).ok())
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs(3));
        let ping_liveness = welcome.ping_liveness;
        tracing::info!(runner_id = %welcome.runner_id, gateway, ?interval, ping_liveness, "runner connected");
        *self.outbox.lock() = Some(tx.clone());
        let stream_done = CancellationToken::new();
        let _stop_heartbeats = stream_done.clone().drop_guard();
        if !ping_liveness {
            tokio::spawn(heartbeats(tx.clone(), interval, stream_done.clone()));
        }
        self.resend_held(&tx).await;
        // With PING liveness the gateway sends no messages while idle: the
        // watch over the bytes it sends (its PINGs), not the silence of
        // messages, tells that it is gone.
        let silence = if ping_liveness {
            Duration::from_secs(365 * 24 * 3600)
        } else {
            self.settings.dead_after
        };
        let mut watch = link::Watch::new(heard, self.settings.dead_after);
        let mut look = tokio::time::interval(watch.period());
        look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        loop {
            let next = tokio::select! {
                next = tokio::time::timeout(silence, inbound.message()) => next,
                _ = look.tick(), if ping_liveness => {
                    match watch.look() {
                        link::Verdict::Fine => {}
                        // Bounded like every send: a full queue means the
                        // stream is busy, and the gateway will be heard.
                        link::Verdict::Ask => {
                            let _ = tx.try_send(up(Up::Heartbeat(rpb::Heartbeat {
                                send_time: Some(now_ts()),
                            })));
                        }
                        link::Verdict::Gone => return StreamEnd::Silent(self.settings.dead_after),
                    }
                    continue;
                }
                () = shutdown.cancelled() => return StreamEnd::Closed,
            };
            let message = match next {
                Err(_) => return StreamEnd::Silent(self.settings.dead_after),
                Ok(Err(status)) => return StreamEnd::Broken(status),
                Ok(Ok(None)) => return StreamEnd::Closed,
                Ok(Ok(Some(m))) => m,
            };
            match message.message {
                Some(Down::Assignment(a)) => self.on_assignment(a, &tx).await,
                Some(Down::CancelAssignment(c)) => self.on_cancel(&c, &tx).await,
                Some(Down::AssignmentConfirmed(c)) => self.on_confirmed(&c.run_id),
                Some(Down::ProtocolError(e)) => self.on_refusal(&e),
                Some(Down::HeartbeatAck(_)) | Some(Down::Welcome(_)) | None => {}
            }
        }
    }

    /// After a (re)connect: what the gateway may have missed.
    async fn resend_held(&self, tx: &mpsc::Sender<rpb::ConnectRequest>) {
        for run in self.record.all() {
            // A run that runs here, or is held waiting for its confirmation.
            if run.held.is_some() || self.is_active(&run.run_id) {
                send(
                    tx,
                    up(Up::AssignmentAccepted(rpb::AssignmentAccepted {
                        run_id: run.run_id.clone(),
                    })),
                )
                .await;
            }
            // In messages the gateway accepts: a long run's history sent
            // as one message could exceed the size limit on every
            // reconnection, forever.
            let mut rest: &[automesh_proto::v1::RunEvent] = &run.events;
            while !rest.is_empty() {
                let n = automesh_proto::bounds::fitting(rest);
                send(
                    tx,
                    up(Up::RunEvents(rpb::RunEvents {
                        run_id: run.run_id.clone(),
                        events: rest[..n].to_vec(),
                    })),
                )
                .await;
                rest = &rest[n..];
            }
            if let Some(f) = run.finished {
                send(tx, up(Up::RunFinished(f))).await;
            }
        }
    }

    fn is_active(&self, run_id: &str) -> bool {
        self.active.lock().contains_key(run_id)
    }
}

async fn send(tx: &mpsc::Sender<rpb::ConnectRequest>, m: rpb::ConnectRequest) -> bool {
    matches!(
        tokio::time::timeout(SEND_TIMEOUT, tx.send(m)).await,
        Ok(Ok(()))
    )
}

async fn send_current(
    outbox: &Mutex<Option<mpsc::Sender<rpb::ConnectRequest>>>,
    m: rpb::ConnectRequest,
) {
    let tx = outbox.lock().clone();
    if let Some(tx) = tx {
        // Not sent now is sent after the next connect, from the record.
        send(&tx, m).await;
    }
}

async fn heartbeats(
    tx: mpsc::Sender<rpb::ConnectRequest>,
    interval: Duration,
    done: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = done.cancelled() => return,
        }
        let hb = up(Up::Heartbeat(rpb::Heartbeat {
            send_time: Some(now_ts()),
        }));
        if !send(&tx, hb).await {
            return;
        }
    }
}
