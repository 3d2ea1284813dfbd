//! The runners' `Connect` streams: authentication by per-runner token
//! (looked up by its hash), `Hello` first, then heartbeats. A stream that
//! stops carrying messages is declared dead within `dead_after` even when
//! its TCP connection stays open — a stalled stream must not look alive.
//!
//! Each stream's outbound side is a bounded channel: a slow runner slows
//! its own stream, it cannot make the gateway buffer without limit.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_server::DesktopRunnerService;
use automesh_rpc::status;
use automesh_store::Store;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::executor::Dispatch;
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
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(3),
            dead_after: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(5),
        }
    }
}

/// Messages towards one runner.
pub type ToRunner = mpsc::Sender<Result<rpb::ConnectResponse, Status>>;

/// One connected runner.
#[derive(Debug, Clone)]
pub struct Session {
    pub org_id: String,
    pub owner_id: String,
    /// Ends the stream (a newer stream of the same runner replaces it).
    pub closed: CancellationToken,
    pub tx: ToRunner,
}

/// The runners connected to this replica.
#[derive(Debug, Default)]
pub struct Sessions(Mutex<HashMap<String, Session>>);

impl Sessions {
    /// Whether `runner_id` has a live stream here.
    pub fn is_connected(&self, runner_id: &str) -> bool {
        self.0.lock().is_ok_and(|m| m.contains_key(runner_id))
    }

    /// How many streams this replica holds.
    pub fn len(&self) -> usize {
        self.0.lock().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A connected runner of the owner, with its stream.
    pub fn of_owner(&self, org_id: &str, owner_id: &str) -> Option<(String, ToRunner)> {
        let m = self.0.lock().ok()?;
        m.iter()
            .find(|(_, s)| s.org_id == org_id && s.owner_id == owner_id)
            .map(|(id, s)| (id.clone(), s.tx.clone()))
    }

    /// The stream of a connected runner.
    pub fn sender(&self, runner_id: &str) -> Option<ToRunner> {
        self.0.lock().ok()?.get(runner_id).map(|s| s.tx.clone())
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
            settings,
            sessions: Arc::default(),
            dispatch: Arc::default(),
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
            .map_err(|e| status::unavailable("runner lookup", &e))?
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

        let (tx, rx) = mpsc::channel(OUTBOUND);
        let closed = CancellationToken::new();
        let session = Session {
            org_id: runner.org_id.clone(),
            owner_id: runner.owner_id.clone(),
            closed: closed.clone(),
            tx: tx.clone(),
        };
        if let Ok(mut m) = self.sessions.0.lock()
            && let Some(previous) = m.insert(runner.id.clone(), session)
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
        let settings = self.settings.clone();
        let shutdown = self.shutdown.clone();
        let runner_id = runner.id.clone();
        let held: Vec<String> = hello.held_runs.iter().map(|h| h.run_id.clone()).collect();
        tokio::spawn(async move {
            // After the response is returned, so the runner is reading: the
            // outbound channel is bounded and must never fill unread.
            reconcile(&dispatch, &runner_id, &held, &tx, settings.dead_after).await;
            let ended = follow(
                &mut inbound,
                &tx,
                &settings,
                &closed,
                &shutdown,
                &dispatch,
                &runner_id,
            )
            .await;
            if let Err(status) = ended {
                tracing::warn!(runner_id = %runner_id, code = ?status.code(), reason = status.message(), "runner stream ended");
                let _ = tokio::time::timeout(Duration::from_secs(1), tx.send(Err(status))).await;
            } else {
                tracing::info!(runner_id = %runner_id, "runner disconnected");
            }
            if let Ok(mut m) = sessions.0.lock()
                && m.get(&runner_id).is_some_and(|s| s.closed == closed)
            {
                m.remove(&runner_id);
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Reconciles what a (re)connecting runner holds with what this replica
/// assigned it: runs it should still run are offered again (it deduplicates
/// by run id); runs it holds that are unknown here are cancelled. Each send
/// is bounded.
async fn reconcile(
    dispatch: &Dispatch,
    runner_id: &str,
    held: &[String],
    tx: &ToRunner,
    bound: Duration,
) {
    let mut outbound: Vec<rpb::ConnectResponse> = dispatch
        .unfinished_of(runner_id)
        .iter()
        .filter(|spec| !held.contains(&spec.run_id))
        .map(crate::executor::assignment)
        .collect();
    outbound.extend(held.iter().filter(|id| !dispatch.knows(id)).map(|run_id| {
        rpb::ConnectResponse {
            message: Some(rpb::connect_response::Message::CancelAssignment(
                rpb::CancelAssignment {
                    run_id: run_id.clone(),
                    reason: "the gateway does not know this run".into(),
                },
            )),
        }
    }));
    for message in outbound {
        if tokio::time::timeout(bound, tx.send(Ok(message)))
            .await
            .is_err()
        {
            tracing::warn!(
                runner_id,
                "the runner is not reading; reconciliation stopped"
            );
            return;
        }
    }
}

/// Reads the runner's messages until it leaves, falls silent, or is replaced.
async fn follow(
    inbound: &mut Streaming<rpb::ConnectRequest>,
    tx: &mpsc::Sender<Result<rpb::ConnectResponse, Status>>,
    settings: &StreamSettings,
    closed: &CancellationToken,
    shutdown: &CancellationToken,
    dispatch: &Dispatch,
    runner_id: &str,
) -> Result<(), Status> {
    use rpb::connect_request::Message;
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(settings.dead_after, inbound.next()) => next,
            () = closed.cancelled() => return Err(Status::aborted("replaced by a newer stream of this runner")),
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
            Ok(Some(Err(status))) => return Err(status),
            Ok(Some(Ok(m))) => m,
        };
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
            Some(other) => dispatch.on_runner_message(runner_id, &other),
            None => {}
        }
    }
}
