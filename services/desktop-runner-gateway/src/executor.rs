//! The desktop executor: the coordinator's `ExecutorService` for desktop
//! runs, served by every gateway replica alike.
//!
//! Nothing here lives only in one replica's memory. `StartRun` offers the
//! run in PostgreSQL/SQLite (idempotent by run id) and signals the other
//! replicas (LISTEN/NOTIFY); the replica holding a stream of the owner's
//! runner claims the assignment for that runner with a guarded update — so
//! exactly one replica sends it — and writes back what the runner reports.
//! `ObserveRun`, `CancelRun` and `GetRunStatus` read and write the same rows
//! on whichever replica the coordinator calls. With no runner connected the
//! offer simply waits; the coordinator ends it `runner_offline` at the
//! deadline.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_server::ExecutorService;
use automesh_proto::runner::v1 as rpb;
use automesh_proto::v1 as pb;
use automesh_rpc::status;
use automesh_store::desktop::{DesktopAssignment, DesktopPhase};
use automesh_store::{Store, Topic};
use chrono::Utc;
use prost::Message as _;
use tokio::sync::Notify;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::stream::Sessions;

/// Bound on handing one message to a runner's stream.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a replica looks for work even without a signal.
const POLL: Duration = Duration::from_secs(1);
/// Assignments (and cancellations) one delivery pass handles.
const PASS_LIMIT: u32 = 256;
/// How far back each pass looks for revoked runners.
const REVOCATION_MARGIN: chrono::Duration = chrono::Duration::seconds(10);
/// How often a replica forgets long-finished assignments, and how long
/// they are kept (their receipts and events live on in the run's records).
const PURGE_EVERY: Duration = Duration::from_secs(600);
const KEEP_FINISHED: chrono::Duration = chrono::Duration::hours(24);
/// Events one `ObserveRun` read takes.
const EVENTS_PAGE: u32 = 256;

/// An assignment this replica sent, waiting for its runner to accept it.
#[derive(Debug, Clone)]
struct Awaiting {
    runner_id: String,
    stream_id: String,
    tx: crate::stream::ToRunner,
    until: tokio::time::Instant,
    /// When it was sent, and when the runner was last heard from
    /// ([`crate::stream::heard_now`] units).
    sent_at: u64,
    last_heard: Arc<std::sync::atomic::AtomicU64>,
}

impl Awaiting {
    /// Past the bound, and the runner was heard from well after the run was
    /// sent (half the bound later) without accepting it: wedged, not merely
    /// stalled. A stalled runner (a stopped process, a broken network) is
    /// left to the dead-stream bound, which gives its runs back when the
    /// stream ends.
    fn wedged(&self, now: tokio::time::Instant, accept_within: Duration) -> bool {
        let heard = self.last_heard.load(std::sync::atomic::Ordering::Relaxed);
        self.until <= now && heard >= self.sent_at + accept_within.as_millis() as u64 / 2
    }
}

/// This replica's side of desktop dispatch: wake-ups, which cancellations
/// it already forwarded on which stream, and the assignments it sent that
/// are not accepted yet.
#[derive(Debug)]
pub struct Dispatch {
    changed: Notify,
    cancels_sent: Mutex<HashSet<(u64, String)>>,
    accept_within: Duration,
    awaiting: Mutex<HashMap<String, Awaiting>>,
}

impl Default for Dispatch {
    fn default() -> Self {
        Self::new(crate::stream::StreamSettings::default().accept_within)
    }
}

impl Dispatch {
    pub fn new(accept_within: Duration) -> Self {
        Self {
            changed: Notify::new(),
            cancels_sent: Mutex::default(),
            accept_within,
            awaiting: Mutex::default(),
        }
    }

    /// Forgets the assignments awaiting acceptance on a stream that ended
    /// (its unaccepted claims are released with it).
    pub fn forget_stream(&self, stream_id: &str) {
        if let Ok(mut a) = self.awaiting.lock() {
            a.retain(|_, w| w.stream_id != stream_id);
        }
    }

    /// Whether an assignment sent from here is past its acceptance bound.
    fn any_due(&self) -> bool {
        let now = tokio::time::Instant::now();
        self.awaiting
            .lock()
            .is_ok_and(|a| a.values().any(|w| w.until <= now))
    }

    /// Gives back what a runner held past the acceptance bound, and tells
    /// the runner to drop it; the run goes to the owner's other runners.
    async fn expire_unaccepted(&self, store: &Store) -> Result<(), automesh_store::StoreError> {
        let now = tokio::time::Instant::now();
        let due: Vec<(String, Awaiting)> = match self.awaiting.lock() {
            Ok(mut a) => {
                let due: Vec<String> = a
                    .iter()
                    .filter(|(_, w)| w.wedged(now, self.accept_within))
                    .map(|(run, _)| run.clone())
                    .collect();
                due.into_iter()
                    .filter_map(|run| a.remove(&run).map(|w| (run, w)))
                    .collect()
            }
            Err(_) => vec![],
        };
        for (run_id, w) in due {
            if store
                .expire_desktop_claim(&run_id, &w.runner_id, &w.stream_id, Utc::now())
                .await?
            {
                tracing::warn!(
                    run_id = %run_id,
                    runner_id = %w.runner_id,
                    bound = ?self.accept_within,
                    "the runner did not accept its assignment in time; it goes to another runner of the owner"
                );
                crate::metrics::unaccepted();
                let reason = format!(
                    "not accepted within {:?}; the run goes to another runner of its owner",
                    self.accept_within
                );
                send(&w.tx, cancel_message(&run_id, &reason)).await;
            }
        }
        Ok(())
    }

    /// Gives back claims a replica that died could not enforce its bound
    /// on (three bounds old); looked for once per poll interval.
    async fn expire_orphaned(&self, store: &Store) -> Result<(), automesh_store::StoreError> {
        let orphaned_before = Utc::now()
            - chrono::Duration::from_std(self.accept_within * 3).unwrap_or(chrono::Duration::MAX);
        let n = store
            .expire_orphaned_desktop_claims(orphaned_before, Utc::now())
            .await?;
        if n > 0 {
            tracing::warn!(claims = n, "unaccepted claims of a lost replica given back");
        }
        Ok(())
    }
    /// Wakes this replica's delivery pass and observers.
    pub fn poke(&self) {
        self.changed.notify_waiters();
    }

    fn cancel_sent(&self, session: u64, run_id: &str) -> bool {
        self.cancels_sent
            .lock()
            .is_ok_and(|mut s| !s.insert((session, run_id.to_owned())))
    }

    /// Forgets what was sent on a stream that ended.
    pub fn forget_session(&self, session: u64) {
        if let Ok(mut s) = self.cancels_sent.lock() {
            s.retain(|(id, _)| *id != session);
        }
    }

    /// Relays desktop signals (local and, on PostgreSQL, from other
    /// processes) to this replica's waiters, until shutdown.
    pub async fn relay(self: Arc<Self>, store: Store, shutdown: CancellationToken) {
        let mut watcher = store.watch(Topic::Desktop).await;
        loop {
            tokio::select! {
                () = watcher.wait(POLL) => self.poke(),
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// Delivers offered assignments to this replica's runners and forwards
    /// cancellations, on every signal and at least every second.
    pub async fn deliver(
        self: Arc<Self>,
        store: Store,
        sessions: Arc<Sessions>,
        shutdown: CancellationToken,
    ) {
        let mut last_purge = tokio::time::Instant::now();
        // Revocations are looked for with a margin, so a clock step or a
        // slow commit cannot hide one; ending a stream twice is harmless.
        let mut revoked_after = Utc::now() - REVOCATION_MARGIN;
        // Runner reports wake this loop many times a second; revocations
        // and newer streams are looked for once per poll interval, not on
        // every wake.
        let mut revocations_checked: Option<tokio::time::Instant> = None;
        let mut streams_after = Utc::now() - REVOCATION_MARGIN;
        let mut orphans_checked: Option<tokio::time::Instant> = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if last_purge.elapsed() >= PURGE_EVERY {
                last_purge = tokio::time::Instant::now();
                let before = Utc::now() - KEEP_FINISHED;
                match store.purge_finished_desktop_runs(before).await {
                    Ok(n) if n > 0 => {
                        tracing::info!(purged = n, "finished desktop assignments purged")
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(%error, "purging finished desktop assignments failed")
                    }
                }
            }
            if !sessions.is_empty() && revocations_checked.is_none_or(|at| at.elapsed() >= POLL) {
                revocations_checked = Some(tokio::time::Instant::now());
                let checked = Utc::now();
                match store.runners_revoked_since(revoked_after).await {
                    Ok(ids) => {
                        let ended = sessions.revoke(&ids);
                        if ended > 0 {
                            tracing::info!(streams = ended, "streams of revoked runners ended");
                        }
                        revoked_after = checked - REVOCATION_MARGIN;
                    }
                    Err(error) => tracing::warn!(%error, "cannot look for revoked runners"),
                }
                // A runner's newest stream wins on every replica: one held
                // here that another replica's newer stream replaced ends.
                match store.runner_streams_opened_since(streams_after).await {
                    Ok(newest) => {
                        let closed = sessions.close_replaced(&newest);
                        if closed > 0 {
                            tracing::info!(
                                streams = closed,
                                "streams replaced by a newer stream of their runner ended"
                            );
                        }
                        streams_after = checked - REVOCATION_MARGIN;
                    }
                    Err(error) => tracing::warn!(%error, "cannot look for newer runner streams"),
                }
            }
            // Only this replica's own sends, and only when one is due: no
            // database work on an ordinary wake.
            if self.any_due()
                && let Err(error) = self.expire_unaccepted(&store).await
            {
                tracing::warn!(%error, "cannot give back unaccepted assignments");
            }
            if orphans_checked.is_none_or(|at| at.elapsed() >= POLL) {
                orphans_checked = Some(tokio::time::Instant::now());
                if let Err(error) = self.expire_orphaned(&store).await {
                    tracing::warn!(%error, "cannot give back orphaned claims");
                }
            }
            if !sessions.is_empty()
                && let Err(error) = self.pass(&store, &sessions).await
            {
                tracing::warn!(%error, "desktop delivery pass failed; retrying");
            }
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep(POLL) => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    async fn pass(
        &self,
        store: &Store,
        sessions: &Sessions,
    ) -> Result<(), automesh_store::StoreError> {
        for a in store.unclaimed_desktop_runs(PASS_LIMIT).await? {
            let Some(session) = sessions.of_owner(&a.org_id, &a.owner_id, a.passed_over.as_deref())
            else {
                continue;
            };
            self.offer(store, &session, &a, false).await?;
        }
        for a in store.cancelling_desktop_runs(PASS_LIMIT).await? {
            let Some(runner_id) = a.runner_id.as_deref() else {
                continue;
            };
            let Some(session) = sessions.get(runner_id) else {
                continue;
            };
            if self.cancel_sent(session.id, &a.run_id) {
                continue;
            }
            let reason = a.cancel_reason.clone().unwrap_or_default();
            let span = run_span("automesh.desktop.cancel", &a);
            if send(&session.tx, cancel_message(&a.run_id, &reason))
                .instrument(span.clone())
                .await
            {
                tracing::info!(parent: &span, run_id = %a.run_id, runner_id, "cancellation forwarded to the runner");
            }
        }
        Ok(())
    }
}

impl Dispatch {
    /// Claims `a` for `session`'s stream and sends it; gives the claim back
    /// when the stream does not take it, so the next pass (or another
    /// runner) can. A sent assignment the runner does not accept within the
    /// bound is given back too.
    pub(crate) async fn offer(
        &self,
        store: &Store,
        session: &crate::stream::Session,
        a: &DesktopAssignment,
        again: bool,
    ) -> Result<bool, automesh_store::StoreError> {
        let sent = offer_in_trace(store, session, a, again)
            .instrument(run_span("automesh.desktop.deliver", a))
            .await?;
        if sent && let Ok(mut awaiting) = self.awaiting.lock() {
            awaiting.insert(
                a.run_id.clone(),
                Awaiting {
                    runner_id: session.runner_id.clone(),
                    stream_id: session.stream_id.clone(),
                    tx: session.tx.clone(),
                    until: tokio::time::Instant::now() + self.accept_within,
                    sent_at: crate::stream::heard_now(),
                    last_heard: session.last_heard.clone(),
                },
            );
        }
        Ok(sent)
    }
}

/// A span of work on `a` in its run's trace (the traceparent its spec
/// carries), so delivery and its log lines belong to the run.
fn run_span(name: &'static str, a: &DesktopAssignment) -> tracing::Span {
    let span = tracing::info_span!("automesh.desktop", otel.name = name, run_id = %a.run_id);
    let traceparent = epb::RunSpec::decode(a.spec.as_slice())
        .ok()
        .map(|s| s.traceparent)
        .filter(|t| !t.is_empty());
    automesh_rpc::propagation::continue_trace(&span, traceparent.as_deref());
    span
}

async fn offer_in_trace(
    store: &Store,
    session: &crate::stream::Session,
    a: &DesktopAssignment,
    again: bool,
) -> Result<bool, automesh_store::StoreError> {
    let (runner_id, tx) = (session.runner_id.as_str(), &session.tx);
    if !store
        .claim_desktop_run(&a.run_id, runner_id, &session.stream_id, Utc::now())
        .await?
    {
        return Ok(false);
    }
    let Ok(spec) = epb::RunSpec::decode(a.spec.as_slice()) else {
        tracing::error!(run_id = %a.run_id, "undecodable desktop run spec");
        return Ok(false);
    };
    if send(tx, assignment(&spec)).await {
        tracing::info!(run_id = %a.run_id, runner_id, again, "run assigned to a runner");
        crate::metrics::delivered(again);
        Ok(true)
    } else {
        tracing::warn!(run_id = %a.run_id, runner_id, "the runner's stream did not take the assignment");
        store
            .release_unaccepted_desktop_runs(runner_id, &session.stream_id, Utc::now())
            .await?;
        Ok(false)
    }
}

/// Sends one message to a runner, bounded.
pub(crate) async fn send(tx: &crate::stream::ToRunner, message: rpb::ConnectResponse) -> bool {
    matches!(
        tokio::time::timeout(SEND_TIMEOUT, tx.send(Ok(message))).await,
        Ok(Ok(()))
    )
}

/// The assignment message for a run.
pub fn assignment(spec: &epb::RunSpec) -> rpb::ConnectResponse {
    rpb::ConnectResponse {
        message: Some(rpb::connect_response::Message::Assignment(
            rpb::Assignment {
                run_id: spec.run_id.clone(),
                automation_id: spec.automation_id.clone(),
                prompt: spec.prompt.clone(),
                model: spec.model.clone(),
                deadline_time: spec.deadline_time,
                traceparent: spec.traceparent.clone(),
                provider_model: spec.provider_model.clone(),
            },
        )),
    }
}

/// The cancellation message for a run.
pub fn cancel_message(run_id: &str, reason: &str) -> rpb::ConnectResponse {
    rpb::ConnectResponse {
        message: Some(rpb::connect_response::Message::CancelAssignment(
            rpb::CancelAssignment {
                run_id: run_id.to_owned(),
                reason: reason.to_owned(),
            },
        )),
    }
}

fn status_of(a: Option<&DesktopAssignment>) -> epb::ExecutionStatus {
    let Some(a) = a else {
        return epb::ExecutionStatus {
            phase: epb::ExecutionPhase::Unknown as i32,
            idle: true,
            outcome: None,
            unaccepted: false,
        };
    };
    let phase = match a.phase {
        DesktopPhase::Admitted => epb::ExecutionPhase::Admitted,
        DesktopPhase::Running => epb::ExecutionPhase::Running,
        DesktopPhase::Finished => epb::ExecutionPhase::Finished,
    };
    epb::ExecutionStatus {
        phase: phase as i32,
        idle: a.idle,
        outcome: a
            .outcome
            .as_deref()
            .and_then(|b| epb::Outcome::decode(b).ok()),
        unaccepted: a.passed_over.is_some() && a.phase == DesktopPhase::Admitted,
    }
}

/// The `ExecutorService` of desktop runs.
#[derive(Debug, Clone)]
pub struct DesktopExecutor {
    store: Store,
    dispatch: Arc<Dispatch>,
}

impl DesktopExecutor {
    pub fn new(store: Store, dispatch: Arc<Dispatch>) -> Self {
        Self { store, dispatch }
    }

    async fn status(&self, run_id: &str) -> Result<epb::ExecutionStatus, Status> {
        let a = self
            .store
            .desktop_run(run_id)
            .await
            .map_err(|e| status::failure(e.kind(), "desktop dispatch", &e))?;
        Ok(status_of(a.as_ref()))
    }
}

type ObserveStream = Pin<Box<dyn Stream<Item = Result<epb::ObserveRunResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExecutorService for DesktopExecutor {
    async fn start_run(
        &self,
        request: Request<epb::StartRunRequest>,
    ) -> Result<Response<epb::StartRunResponse>, Status> {
        let spec = request
            .into_inner()
            .run
            .ok_or_else(|| Status::invalid_argument("run is required"))?;
        if spec.run_id.is_empty() || spec.message_id.is_empty() {
            return Err(Status::invalid_argument(
                "run_id and message_id are required",
            ));
        }
        if spec.organization_id.is_empty() || spec.owner_id.is_empty() {
            return Err(Status::invalid_argument(
                "organization_id and owner_id are required",
            ));
        }
        let offered = self
            .store
            .offer_desktop_run(
                &spec.run_id,
                &spec.organization_id,
                &spec.owner_id,
                &spec.encode_to_vec(),
                Utc::now(),
            )
            .await
            .map_err(|e| status::failure(e.kind(), "desktop dispatch", &e))?;
        if offered {
            tracing::info!(run_id = %spec.run_id, "desktop run offered to the owner's runners");
        }
        Ok(Response::new(epb::StartRunResponse {
            submitted: offered,
            status: Some(self.status(&spec.run_id).await?),
        }))
    }

    type ObserveRunStream = ObserveStream;

    async fn observe_run(
        &self,
        request: Request<epb::ObserveRunRequest>,
    ) -> Result<Response<Self::ObserveRunStream>, Status> {
        let req = request.into_inner();
        if self
            .store
            .desktop_run(&req.run_id)
            .await
            .map_err(|e| status::failure(e.kind(), "desktop dispatch", &e))?
            .is_none()
        {
            return Err(Status::not_found("no desktop assignment for this run"));
        }
        let store = self.store.clone();
        let dispatch = self.dispatch.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let mut after = req.after_sequence;
            let mut last: Option<epb::ExecutionStatus> = None;
            loop {
                let changed = dispatch.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                // Status first, events after: a finished status read before
                // its events would end the stream too early.
                let read = async {
                    let a = store.desktop_run(&req.run_id).await?;
                    let events = store
                        .desktop_events_after(&req.run_id, after, EVENTS_PAGE)
                        .await?;
                    Ok::<_, automesh_store::StoreError>((a, events))
                };
                let (a, events) = match read.await {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = tx
                            .send(Err(status::failure(e.kind(), "desktop dispatch", &e)))
                            .await;
                        return;
                    }
                };
                let Some(a) = a else { return };
                let more = events.len() as u32 == EVENTS_PAGE;
                // A live phase change comes before the events read with it
                // (the run is `running` before its engine's first event); a
                // finished status comes after them, and ends the stream.
                // Events mean the runner's engine is at work: when they were
                // read ahead of the acceptance that preceded them (the status
                // is read first), the run is running all the same.
                let mut status = status_of(Some(&a));
                let running = epb::ExecutionPhase::Running as i32;
                let seen_running = last.as_ref().is_some_and(|s| {
                    s.phase == running || s.phase == epb::ExecutionPhase::Finished as i32
                });
                if !events.is_empty() && !seen_running && status.phase != running {
                    status = epb::ExecutionStatus {
                        phase: running,
                        idle: false,
                        outcome: None,
                        unaccepted: false,
                    };
                }
                if status.phase != epb::ExecutionPhase::Finished as i32
                    && last.as_ref() != Some(&status)
                {
                    last = Some(status.clone());
                    let update = epb::observe_run_response::Update::Status(status);
                    if tx
                        .send(Ok(epb::ObserveRunResponse {
                            update: Some(update),
                        }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                for e in events {
                    after = e.sequence;
                    let Ok(mut event) = pb::RunEvent::decode(e.body.as_slice()) else {
                        tracing::error!(run_id = %req.run_id, seq = e.sequence, "undecodable desktop event");
                        continue;
                    };
                    event.sequence = e.sequence;
                    event.run_id = req.run_id.clone();
                    let update = epb::observe_run_response::Update::Event(event);
                    if tx
                        .send(Ok(epb::ObserveRunResponse {
                            update: Some(update),
                        }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                if more {
                    continue;
                }
                let status = status_of(Some(&a));
                if last.as_ref() != Some(&status) {
                    last = Some(status.clone());
                    let finished = status.phase == epb::ExecutionPhase::Finished as i32;
                    let update = epb::observe_run_response::Update::Status(status);
                    if tx
                        .send(Ok(epb::ObserveRunResponse {
                            update: Some(update),
                        }))
                        .await
                        .is_err()
                        || finished
                    {
                        return;
                    }
                }
                // Woken by any desktop change, never idle longer than the
                // poll interval (the coordinator's bounds do the rest).
                tokio::select! {
                    () = changed => {}
                    () = tokio::time::sleep(POLL) => {}
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn cancel_run(
        &self,
        request: Request<epb::CancelRunRequest>,
    ) -> Result<Response<epb::CancelRunResponse>, Status> {
        let req = request.into_inner();
        let reason = if req.reason.is_empty() {
            "cancelled"
        } else {
            req.reason.as_str()
        };
        let a = self
            .store
            .cancel_desktop_run(&req.run_id, reason, Utc::now())
            .await
            .map_err(|e| status::failure(e.kind(), "desktop dispatch", &e))?;
        Ok(Response::new(epb::CancelRunResponse {
            status: Some(status_of(a.as_ref())),
        }))
    }

    async fn get_run_status(
        &self,
        request: Request<epb::GetRunStatusRequest>,
    ) -> Result<Response<epb::GetRunStatusResponse>, Status> {
        Ok(Response::new(epb::GetRunStatusResponse {
            status: Some(self.status(&request.into_inner().run_id).await?),
        }))
    }
}
