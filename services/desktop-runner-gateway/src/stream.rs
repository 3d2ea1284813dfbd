//! The runners' `Connect` streams: authentication by per-runner token
//! (looked up by its hash), `Hello` first, then liveness. A stream is
//! declared dead within `dead_after` even when its TCP connection stays
//! open — a stalled stream must not look alive: a runner that heartbeats
//! is dead after `dead_after` of silence; one granted PING liveness
//! (`Hello.ping_liveness`) is PINGed by the runner listener's HTTP/2
//! keepalive, which closes a connection that does not answer within the
//! same bound, and costs the gateway no message, timer or wake-up per
//! interval.
//!
//! Each stream's outbound side is a bounded channel of boxed messages: a
//! slow runner slows its own stream, it cannot make the gateway buffer
//! without limit, and an idle stream's queue stays small.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use automesh_edge::status;
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_server::DesktopRunnerService;
use automesh_store::Store;
use chrono::Utc;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::dispatch::Dispatch;
use crate::follow::follow;
use crate::hash_token;
use crate::reports::reconcile;
pub use crate::settings::{Http2, StreamSettings};

/// Messages queued towards one runner before the sender waits.
const OUTBOUND: usize = 32;

/// How long after its inbound side ends a stream's way back is watched: it
/// closes too when the connection was lost, not when the runner ended.
pub(crate) const LOST_GRACE: Duration = Duration::from_millis(200);

/// What goes to one runner: its messages, and the status that ends its
/// stream (boxed, so the queue of an idle stream is a few hundred bytes).
pub type Outgoing = Result<Box<rpb::ConnectResponse>, Box<Status>>;

/// Messages towards one runner.
pub type ToRunner = mpsc::Sender<Outgoing>;

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
    /// Its liveness is the connection's HTTP/2 PINGs, not heartbeats.
    pub ping_liveness: bool,
}

/// Milliseconds since this process started: the clock of `last_heard`.
pub fn heard_now() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// The runners connected to this replica, by runner and by owner.
#[derive(Debug)]
pub struct Sessions {
    held: Mutex<Held>,
    next_id: AtomicU64,
    /// This replica, as the streams it holds name it (a new id per
    /// process): its beat marks them all seen.
    pub replica: String,
}

impl Default for Sessions {
    fn default() -> Self {
        Self {
            held: Mutex::default(),
            next_id: AtomicU64::default(),
            replica: uuid::Uuid::new_v4().to_string(),
        }
    }
}

#[derive(Debug, Default)]
struct Held {
    by_runner: HashMap<String, Session>,
    /// Runner ids by organisation, then owner.
    by_owner: HashMap<String, HashMap<String, Vec<String>>>,
}

impl Held {
    /// Adds `session`; the runner's previous stream, if any.
    fn insert(&mut self, session: Session) -> Option<Session> {
        let previous = self
            .by_runner
            .insert(session.runner_id.clone(), session.clone());
        if previous.is_none() {
            self.by_owner
                .entry(session.org_id)
                .or_default()
                .entry(session.owner_id)
                .or_default()
                .push(session.runner_id);
        }
        previous
    }

    /// Removes the stream `id` of `runner_id` if it is still the runner's
    /// current one.
    fn remove(&mut self, runner_id: &str, id: u64) -> bool {
        if self.by_runner.get(runner_id).is_none_or(|s| s.id != id) {
            return false;
        }
        let Some(s) = self.by_runner.remove(runner_id) else {
            return false;
        };
        if let Some(owners) = self.by_owner.get_mut(&s.org_id) {
            if let Some(runners) = owners.get_mut(&s.owner_id) {
                runners.retain(|r| r != runner_id);
                if runners.is_empty() {
                    owners.remove(&s.owner_id);
                }
            }
            if owners.is_empty() {
                self.by_owner.remove(&s.org_id);
            }
        }
        true
    }
}

impl Sessions {
    /// How many streams this replica holds.
    pub fn len(&self) -> usize {
        self.held.lock().by_runner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many streams are kept alive by PING, and how many by heartbeats.
    pub fn by_liveness(&self) -> (usize, usize) {
        let held = self.held.lock();
        let ping = held.by_runner.values().filter(|s| s.ping_liveness).count();
        (ping, held.by_runner.len() - ping)
    }

    /// A connected runner of the owner other than `passed_over`.
    pub fn of_owner(
        &self,
        org_id: &str,
        owner_id: &str,
        passed_over: Option<&str>,
    ) -> Option<Session> {
        let held = self.held.lock();
        let runners = held.by_owner.get(org_id)?.get(owner_id)?;
        runners
            .iter()
            .filter(|r| passed_over != Some(r.as_str()))
            .find_map(|r| held.by_runner.get(r))
            .cloned()
    }

    /// Closes the streams held here that are no longer their runner's
    /// newest (a newer one opened on another replica); returns how many.
    pub fn close_replaced(&self, newest: &[(String, String)]) -> usize {
        let held = self.held.lock();
        newest
            .iter()
            .filter_map(|(runner_id, stream_id)| {
                held.by_runner
                    .get(runner_id)
                    .filter(|s| &s.stream_id != stream_id)
            })
            .map(|s| s.closed.cancel())
            .count()
    }

    /// Ends the streams of revoked runners held here; returns how many.
    pub fn revoke(&self, runner_ids: &[String]) -> usize {
        let held = self.held.lock();
        runner_ids
            .iter()
            .filter_map(|id| held.by_runner.get(id))
            .map(|s| s.revoked.cancel())
            .count()
    }

    /// The stream of a connected runner.
    pub fn get(&self, runner_id: &str) -> Option<Session> {
        self.held.lock().by_runner.get(runner_id).cloned()
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
            dispatch: Arc::new(Dispatch::new(
                settings.accept_within,
                settings.dispatch_poll,
            )),
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
            .map_err(|e| status::of(&e, "runner lookup"))?
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
        tracing::info!(
            runner_id = %runner.id,
            held = hello.held_runs.len(),
            version = %hello.runner_version,
            ping_liveness = hello.ping_liveness,
            "runner connected"
        );

        // The newest stream of a runner wins on every replica: recorded
        // before this stream is used, so an older one (here or elsewhere)
        // can no longer claim or report.
        let stream_id = uuid::Uuid::new_v4().to_string();
        self.store
            .open_runner_stream(&runner.id, &stream_id, &self.sessions.replica, Utc::now())
            .await
            .map_err(|e| status::of(&e, "opening the runner stream"))?;
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
            ping_liveness: hello.ping_liveness,
        };
        let previous = self.sessions.held.lock().insert(session.clone());
        if let Some(previous) = previous {
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
                ping_liveness: hello.ping_liveness,
            })),
        };
        tx.send(Ok(Box::new(welcome)))
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
            let ended = follow(
                &mut inbound,
                &session,
                &settings,
                &shutdown,
                &store,
                &dispatch,
            )
            .await;
            dispatch.forget_stream(&session.stream_id);
            crate::metrics::stream_ended(end_reason(&ended));
            if let Err(status) = ended {
                tracing::warn!(runner_id = %runner_id, code = ?status.code(), reason = status.message(), "runner stream ended");
                let ended = tx.send(Err(Box::new(status)));
                let _ = tokio::time::timeout(Duration::from_secs(1), ended).await;
            } else {
                tracing::info!(runner_id = %runner_id, "runner disconnected");
            }
            let current = sessions.held.lock().remove(&runner_id, session.id);
            dispatch.forget_session(session.id);
            // Its owner sees it offline from now (unless a newer stream of
            // it replaced this one).
            if let Err(error) = store
                .close_runner_stream(&runner_id, &session.stream_id, Utc::now())
                .await
            {
                tracing::warn!(runner_id = %runner_id, %error, "cannot record the stream's end; it reads offline once stale");
            }
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
        let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(
            outbound.map(|m| m.map(|m| *m).map_err(|s| *s)),
        )))
    }
}

/// Why a stream ended, as the `automesh.runner.streams_ended` metric names it.
fn end_reason(ended: &Result<(), Status>) -> &'static str {
    let Err(status) = ended else {
        return "closed";
    };
    match status.code() {
        tonic::Code::Aborted => "replaced",
        tonic::Code::Unauthenticated => "revoked",
        tonic::Code::DeadlineExceeded => "silent",
        tonic::Code::FailedPrecondition | tonic::Code::ResourceExhausted => "protocol",
        tonic::Code::Unavailable if status.message().contains("shutting down") => "shutdown",
        tonic::Code::Unavailable if status.message().ends_with("the connection was lost") => "lost",
        tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled => "broken",
        _ => "other",
    }
}
