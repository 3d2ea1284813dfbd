//! The runners' `Connect` streams: authentication by per-runner token
//! (looked up by its hash), `Hello` first, then heartbeats. A stream that
//! stops carrying messages is declared dead within `dead_after` even when
//! its TCP connection stays open — a stalled stream must not look alive.
//!
//! Each stream's outbound side is a bounded channel: a slow runner slows
//! its own stream, it cannot make the gateway buffer without limit.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_proto::executor::v1 as epb;
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_server::DesktopRunnerService;
use automesh_rpc::status;
use automesh_store::Store;
use chrono::Utc;
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::executor::{Dispatch, cancel_message, send};
use crate::hash_token;

/// Messages queued towards one runner before the sender waits.
const OUTBOUND: usize = 32;

/// Bounds of a runner stream.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// How often runners must send a heartbeat (told to them in `Welcome`).
    pub heartbeat_interval: Duration,
    /// Silence after which a stream is declared dead.
    pub dead_after: Duration,
    /// How long a new stream may take to say `Hello`.
    pub hello_timeout: Duration,
    /// How long a runner may hold an assignment without accepting it; then
    /// the assignment goes to the owner's other runners and the silent one
    /// is told to drop it.
    pub accept_within: Duration,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(3),
            dead_after: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(5),
            accept_within: Duration::from_secs(10),
        }
    }
}

/// Messages towards one runner.
pub type ToRunner = mpsc::Sender<Result<rpb::ConnectResponse, Status>>;

/// One connected runner.
#[derive(Debug, Clone)]
pub struct Session {
    /// Unique per stream within this replica.
    pub id: u64,
    /// Unique per stream across replicas: what a claim names.
    pub stream_id: String,
    pub runner_id: String,
    pub org_id: String,
    pub owner_id: String,
    /// Ends the stream (a newer stream of the same runner replaces it).
    pub closed: CancellationToken,
    /// Ends the stream because the runner was revoked.
    pub revoked: CancellationToken,
    pub tx: ToRunner,
    /// When the runner last sent anything ([`heard_now`] units).
    pub last_heard: Arc<AtomicU64>,
}

/// Milliseconds since this process started: the clock of `last_heard`.
pub fn heard_now() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// The runners connected to this replica.
#[derive(Debug, Default)]
pub struct Sessions {
    by_runner: Mutex<HashMap<String, Session>>,
    next_id: AtomicU64,
}

impl Sessions {
    /// How many streams this replica holds.
    pub fn len(&self) -> usize {
        self.by_runner.lock().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A connected runner of the owner other than `passed_over`.
    pub fn of_owner(
        &self,
        org_id: &str,
        owner_id: &str,
        passed_over: Option<&str>,
    ) -> Option<Session> {
        let m = self.by_runner.lock().ok()?;
        m.values()
            .find(|s| {
                s.org_id == org_id
                    && s.owner_id == owner_id
                    && passed_over != Some(s.runner_id.as_str())
            })
            .cloned()
    }

    /// Closes the streams held here that are no longer their runner's
    /// newest (a newer one opened on another replica); returns how many.
    pub fn close_replaced(&self, newest: &[(String, String)]) -> usize {
        let Ok(m) = self.by_runner.lock() else {
            return 0;
        };
        newest
            .iter()
            .filter_map(|(runner_id, stream_id)| {
                m.get(runner_id).filter(|s| &s.stream_id != stream_id)
            })
            .map(|s| s.closed.cancel())
            .count()
    }

    /// Ends the streams of revoked runners held here; returns how many.
    pub fn revoke(&self, runner_ids: &[String]) -> usize {
        let Ok(m) = self.by_runner.lock() else {
            return 0;
        };
        runner_ids
            .iter()
            .filter_map(|id| m.get(id))
            .map(|s| s.revoked.cancel())
            .count()
    }

    /// The stream of a connected runner.
    pub fn get(&self, runner_id: &str) -> Option<Session> {
        self.by_runner.lock().ok()?.get(runner_id).cloned()
    }
}

/// The `DesktopRunnerService` implementation.
#[derive(Debug, Clone)]
pub struct RunnerStreams {
    store: Store,
    settings: StreamSettings,
    pub sessions: Arc<Sessions>,
    pub dispatch: Arc<Dispatch>,
    shutdown: CancellationToken,
}

impl RunnerStreams {
    pub fn new(store: Store, settings: StreamSettings, shutdown: CancellationToken) -> Self {
        Self {
            store,
            settings: settings.clone(),
            sessions: Arc::default(),
            dispatch: Arc::new(Dispatch::new(settings.accept_within)),
            shutdown,
        }
    }
}

type Outbound = Pin<Box<dyn Stream<Item = Result<rpb::ConnectResponse, Status>> + Send>>;

fn bearer(request: &Request<Streaming<rpb::ConnectRequest>>) -> Result<String, Status> {
    let header = request
        .metadata()
        .get("authorization")
        .ok_or_else(|| Status::unauthenticated("missing runner token"))?
        .to_str()
        .map_err(|_| Status::unauthenticated("malformed authorization header"))?;
    header
        .strip_prefix("Bearer ")
        .map(|t| t.trim().to_owned())
        .ok_or_else(|| Status::unauthenticated("authorization must be `Bearer <runner token>`"))
}

#[tonic::async_trait]
impl DesktopRunnerService for RunnerStreams {
    type ConnectStream = Outbound;

    async fn connect(
        &self,
        request: Request<Streaming<rpb::ConnectRequest>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let token = bearer(&request)?;
        let runner = self
            .store
            .find_runner_by_token_hash(&hash_token(&token))
            .await
            .map_err(|e| status::failure(e.kind(), "runner lookup", &e))?
            .ok_or_else(|| Status::unauthenticated("unknown or revoked runner token"))?;
        let mut inbound = request.into_inner();

        // Hello first, bounded.
        let hello = match tokio::time::timeout(self.settings.hello_timeout, inbound.next()).await {
            Ok(Some(Ok(rpb::ConnectRequest {
                message: Some(rpb::connect_request::Message::Hello(h)),
            }))) => h,
            Ok(Some(Ok(_))) => {
                return Err(Status::failed_precondition(
                    "the first message must be Hello",
                ));
            }
            Ok(Some(Err(s))) => return Err(s),
            Ok(None) => {
                return Err(Status::cancelled(
                    "the runner closed the stream before Hello",
                ));
            }
            Err(_) => return Err(Status::deadline_exceeded("no Hello within the bound")),
        };
        tracing::info!(runner_id = %runner.id, held = hello.held_runs.len(), version = %hello.runner_version, "runner connected");

        // The newest stream of a runner wins on every replica: recorded
        // before this stream is used, so an older one (here or elsewhere)
        // can no longer claim or report.
        let stream_id = uuid::Uuid::new_v4().to_string();
        self.store
            .open_runner_stream(&runner.id, &stream_id, Utc::now())
            .await
            .map_err(|e| status::failure(e.kind(), "opening the runner stream", &e))?;
        let (tx, rx) = mpsc::channel(OUTBOUND);
        let closed = CancellationToken::new();
        let session = Session {
            id: self.sessions.next_id.fetch_add(1, Ordering::Relaxed),
            stream_id,
            runner_id: runner.id.clone(),
            org_id: runner.org_id.clone(),
            owner_id: runner.owner_id.clone(),
            closed: closed.clone(),
            revoked: CancellationToken::new(),
            tx: tx.clone(),
            last_heard: Arc::new(AtomicU64::new(heard_now())),
        };
        if let Ok(mut m) = self.sessions.by_runner.lock()
            && let Some(previous) = m.insert(runner.id.clone(), session.clone())
        {
            // A reconnecting runner replaces its old stream.
            previous.closed.cancel();
        }
        let welcome = rpb::ConnectResponse {
            message: Some(rpb::connect_response::Message::Welcome(rpb::Welcome {
                runner_id: runner.id.clone(),
                heartbeat_interval: Some(prost_types::Duration {
                    seconds: self.settings.heartbeat_interval.as_secs() as i64,
                    nanos: self.settings.heartbeat_interval.subsec_nanos() as i32,
                }),
            })),
        };
        tx.send(Ok(welcome))
            .await
            .map_err(|_| Status::cancelled("the runner went away"))?;
        let sessions = self.sessions.clone();
        let dispatch = self.dispatch.clone();
        let store = self.store.clone();
        let settings = self.settings.clone();
        let shutdown = self.shutdown.clone();
        let held: Vec<String> = hello.held_runs.iter().map(|h| h.run_id.clone()).collect();
        tokio::spawn(async move {
            let runner_id = session.runner_id.clone();
            // After the response is returned, so the runner is reading: the
            // outbound channel is bounded and must never fill unread.
            if let Err(error) = reconcile(&store, &dispatch, &session, &held).await {
                tracing::warn!(runner_id = %runner_id, %error, "reconciliation failed; the delivery pass will retry");
            }
            dispatch.poke();
            let ended = follow(&mut inbound, &session, &settings, &shutdown, &store).await;
            dispatch.forget_stream(&session.stream_id);
            if let Err(status) = ended {
                tracing::warn!(runner_id = %runner_id, code = ?status.code(), reason = status.message(), "runner stream ended");
                let _ = tokio::time::timeout(Duration::from_secs(1), tx.send(Err(status))).await;
            } else {
                tracing::info!(runner_id = %runner_id, "runner disconnected");
            }
            let current = if let Ok(mut m) = sessions.by_runner.lock()
                && m.get(&runner_id).is_some_and(|s| s.id == session.id)
            {
                m.remove(&runner_id);
                true
            } else {
                false
            };
            dispatch.forget_session(session.id);
            // What it was offered but never accepted may go to another
            // runner of the owner (or back to this one when it returns).
            if current
                && let Err(error) = store
                    .release_unaccepted_desktop_runs(&runner_id, &session.stream_id, Utc::now())
                    .await
            {
                tracing::warn!(runner_id = %runner_id, %error, "cannot release unaccepted assignments");
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Reconciles what a (re)connecting runner holds with the shared dispatch
/// state: runs it should run and does not hold are offered again (it
/// deduplicates by run id); cancelled runs it holds are cancelled again;
/// cancelled runs it no longer holds are idle; runs it holds that are
/// unknown, finished or another runner's are cancelled. Each send is
/// bounded.
async fn reconcile(
    store: &Store,
    dispatch: &crate::executor::Dispatch,
    session: &Session,
    held: &[String],
) -> Result<(), automesh_store::StoreError> {
    let runner_id = session.runner_id.as_str();
    let mine = store
        .desktop_runs_for_runner(&session.org_id, &session.owner_id, runner_id, 1024)
        .await?;
    for a in &mine {
        let holds = held.contains(&a.run_id);
        if a.cancel_requested {
            if holds {
                let reason = a.cancel_reason.clone().unwrap_or_default();
                send(&session.tx, cancel_message(&a.run_id, &reason)).await;
            } else if a.runner_id.as_deref() == Some(runner_id) {
                store
                    .desktop_run_idle(&a.run_id, runner_id, &session.stream_id, Utc::now())
                    .await?;
            }
        } else if !holds
            // Only what no runner has accepted is offered again: a run this
            // runner accepted and no longer holds may be executing on the
            // machine of an older stream of its token; it is never sent to a
            // second one.
            && a.phase == automesh_store::desktop::DesktopPhase::Admitted
            && !dispatch.offer(store, session, a, true).await?
            && session.tx.is_closed()
        {
            // The stream is gone; what was not offered waits for the next.
            return Ok(());
        }
    }
    for run_id in held {
        if mine.iter().any(|a| &a.run_id == run_id) {
            continue;
        }
        // Another owner's run gets the very answer an unknown id gets: a
        // runner learns nothing about runs that are not its owner's.
        let reason = match store.desktop_run(run_id).await? {
            Some(a) if a.org_id == session.org_id && a.owner_id == session.owner_id => {
                if a.phase == automesh_store::desktop::DesktopPhase::Finished {
                    "the run is finished"
                } else {
                    "the run belongs to another runner of its owner"
                }
            }
            _ => UNKNOWN_RUN,
        };
        if !send(&session.tx, cancel_message(run_id, reason)).await {
            tracing::warn!(
                runner_id,
                "the runner is not reading; reconciliation stopped"
            );
            return Ok(());
        }
    }
    Ok(())
}

/// What a reconnecting runner is told about a run it holds that the
/// gateway does not know for its owner.
const UNKNOWN_RUN: &str = "the gateway does not know this run";

/// A report the gateway refused, and why (sent back as `ProtocolError`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub run_id: String,
    pub code: &'static str,
    pub message: String,
}

impl Refusal {
    fn message(&self) -> rpb::ConnectResponse {
        rpb::ConnectResponse {
            message: Some(rpb::connect_response::Message::ProtocolError(
                rpb::ProtocolError {
                    run_id: self.run_id.clone(),
                    code: self.code.to_owned(),
                    message: self.message.clone(),
                },
            )),
        }
    }
}

/// The run ids of a report.
fn report_run_id(message: &rpb::connect_request::Message) -> Option<&str> {
    use rpb::connect_request::Message;
    match message {
        Message::AssignmentAccepted(a) => Some(&a.run_id),
        Message::RunEvents(e) => Some(&e.run_id),
        Message::RunFinished(f) => Some(&f.run_id),
        Message::IdleObserved(i) => Some(&i.run_id),
        Message::Hello(_) | Message::Heartbeat(_) => None,
    }
}

/// Outcomes a runner may finish a run with.
fn terminal_outcome(state: i32) -> bool {
    use automesh_proto::v1::RunState;
    matches!(
        RunState::try_from(state),
        Ok(RunState::Succeeded | RunState::Failed | RunState::Cancelled | RunState::TimedOut)
    )
}

/// What the gateway answers a runner's report with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// Recorded (or a harmless redelivery): nothing to say.
    Nothing,
    /// The acceptance is recorded on this stream: the runner may start.
    Confirmed(String),
    Refused(Refusal),
}

/// Records a runner's report about one of its runs. Only the runner a run is
/// claimed for can change it (the store's updates are guarded by runner and
/// stream). An acceptance is answered with a confirmation once it is
/// recorded — the runner starts the run only then. A report the protocol
/// does not allow changes nothing and comes back as a [`Refusal`]; one that
/// changed nothing because it was a redelivery (after a reconnect) is fine.
async fn record(
    store: &Store,
    session: &Session,
    message: rpb::connect_request::Message,
) -> Result<Answer, automesh_store::StoreError> {
    let (runner_id, stream_id) = (session.runner_id.as_str(), session.stream_id.as_str());
    use rpb::connect_request::Message;
    let now = Utc::now();
    let Some(run_id) = report_run_id(&message).map(str::to_owned) else {
        return Ok(Answer::Nothing);
    };
    let refuse = |code: &'static str, message: String| {
        Ok(Answer::Refused(Refusal {
            run_id: run_id.clone(),
            code,
            message,
        }))
    };
    let acceptance = matches!(message, Message::AssignmentAccepted(_));
    if run_id.is_empty() {
        return refuse("invalid_report", "a report must name its run".into());
    }
    if let Message::RunFinished(f) = &message
        && !terminal_outcome(f.outcome)
    {
        let name = automesh_proto::v1::RunState::try_from(f.outcome)
            .map(|s| s.as_str_name().to_owned())
            .unwrap_or_else(|_| format!("{}", f.outcome));
        return refuse(
            "non_terminal_outcome",
            format!(
                "RunFinished needs a terminal outcome (SUCCEEDED, FAILED, CANCELLED or \
                 TIMED_OUT), not {name}; the run is unchanged"
            ),
        );
    }
    let applied = match message {
        Message::AssignmentAccepted(a) => {
            store
                .desktop_run_accepted(&a.run_id, runner_id, stream_id, now)
                .await?
        }
        Message::RunEvents(batch) => {
            let events: Vec<(String, Vec<u8>)> = batch
                .events
                .iter()
                .filter(|e| !e.event_id.is_empty())
                // A third-party runner's events are bounded here too.
                .map(|e| (e.event_id.clone(), e.clone().bounded().encode_to_vec()))
                .collect();
            store
                .append_desktop_events(&batch.run_id, runner_id, stream_id, &events, now)
                .await?
                > 0
        }
        Message::RunFinished(f) => {
            let outcome = epb::Outcome {
                state: f.outcome,
                error_code: f.error_code.clone(),
                error_message: f.error_message.clone(),
                engine: f.engine.clone(),
                usage: f.usage,
                ..Default::default()
            };
            store
                .desktop_run_finished(
                    &f.run_id,
                    runner_id,
                    stream_id,
                    &outcome.encode_to_vec(),
                    now,
                )
                .await?
        }
        Message::IdleObserved(i) => {
            store
                .desktop_run_idle(&i.run_id, runner_id, stream_id, now)
                .await?
        }
        Message::Hello(_) | Message::Heartbeat(_) => true,
    };
    if applied {
        return Ok(if acceptance {
            Answer::Confirmed(run_id)
        } else {
            Answer::Nothing
        });
    }
    // Nothing changed: a redelivery of a report already recorded, or a
    // report about a run this runner does not hold (unknown, or another
    // runner's: the same answer either way).
    let held = store.desktop_run(&run_id).await?.filter(|a| {
        a.runner_id.as_deref() == Some(runner_id) && a.stream_id.as_deref() == Some(stream_id)
    });
    if let Some(a) = held {
        // An acceptance sent again (its confirmation was lost) is confirmed
        // again while the run runs here; a cancelled one is not (the
        // cancellation tells the runner to drop it).
        let confirm = acceptance
            && a.phase == automesh_store::desktop::DesktopPhase::Running
            && !a.cancel_requested;
        Ok(if confirm {
            Answer::Confirmed(run_id)
        } else {
            Answer::Nothing
        })
    } else {
        refuse(
            "not_assigned",
            "this runner holds no run with that id; the report was ignored".into(),
        )
    }
}

/// Reads the runner's messages until it leaves, falls silent, or is replaced.
async fn follow(
    inbound: &mut Streaming<rpb::ConnectRequest>,
    session: &Session,
    settings: &StreamSettings,
    shutdown: &CancellationToken,
    store: &Store,
) -> Result<(), Status> {
    use rpb::connect_request::Message;
    let tx = &session.tx;
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(settings.dead_after, inbound.next()) => next,
            () = session.closed.cancelled() => return Err(Status::aborted("replaced by a newer stream of this runner")),
            () = session.revoked.cancelled() => return Err(Status::unauthenticated("the runner was revoked")),
            () = shutdown.cancelled() => return Err(Status::unavailable("gateway shutting down; reconnect")),
        };
        let message = match next {
            Err(_) => {
                return Err(Status::deadline_exceeded(format!(
                    "no heartbeat for {:?}: the stream is declared dead",
                    settings.dead_after
                )));
            }
            Ok(None) => return Ok(()),
            // A runner message over the size limit is RESOURCE_EXHAUSTED,
            // as for every request (see the server builder).
            Ok(Some(Err(status)))
                if status.code() == tonic::Code::OutOfRange
                    && status.message().contains("message length too large") =>
            {
                return Err(Status::resource_exhausted(status.message().to_owned()));
            }
            Ok(Some(Err(status))) => return Err(status),
            Ok(Some(Ok(m))) => m,
        };
        session.last_heard.store(heard_now(), Ordering::Relaxed);
        match message.message {
            Some(Message::Heartbeat(h)) => {
                let ack = rpb::ConnectResponse {
                    message: Some(rpb::connect_response::Message::HeartbeatAck(
                        rpb::HeartbeatAck {
                            send_time: h.send_time,
                        },
                    )),
                };
                // A runner that does not read its acks for a whole dead
                // period is as dead as one that does not write.
                match tokio::time::timeout(settings.dead_after, tx.send(Ok(ack))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return Ok(()),
                    Err(_) => {
                        return Err(Status::resource_exhausted(
                            "the runner stopped reading its stream",
                        ));
                    }
                }
            }
            Some(Message::Hello(_)) => {
                return Err(Status::failed_precondition(
                    "Hello may be sent only once per stream",
                ));
            }
            Some(other) => {
                // Bounded like every wait; a report that cannot be recorded
                // ends the stream, and the runner resends what it holds when
                // it reconnects (event ids make that harmless).
                match tokio::time::timeout(settings.dead_after, record(store, session, other)).await
                {
                    Ok(Ok(Answer::Nothing)) => {}
                    Ok(Ok(Answer::Confirmed(run_id))) => {
                        let confirmed = rpb::ConnectResponse {
                            message: Some(rpb::connect_response::Message::AssignmentConfirmed(
                                rpb::AssignmentConfirmed { run_id },
                            )),
                        };
                        if !send(tx, confirmed).await {
                            return Ok(());
                        }
                    }
                    Ok(Ok(Answer::Refused(refusal))) => {
                        tracing::warn!(
                            runner_id = %session.runner_id,
                            run_id = %refusal.run_id,
                            code = refusal.code,
                            "a runner's report was refused"
                        );
                        crate::metrics::protocol_error(refusal.code);
                        if !send(tx, refusal.message()).await {
                            return Ok(());
                        }
                    }
                    Ok(Err(error)) => {
                        return Err(status::failure(
                            error.kind(),
                            "recording the runner's report",
                            &error,
                        ));
                    }
                    Err(_) => {
                        return Err(Status::unavailable(
                            "recording the runner's report timed out; reconnect",
                        ));
                    }
                }
            }
            None => {}
        }
    }
}
