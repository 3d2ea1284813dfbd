//! Desktop dispatch on one replica: wake-ups (local signals and NOTIFY),
//! the delivery pass that claims offered runs for this replica's runner
//! streams and sends them, the forwarding of cancellations, and the
//! acceptance bound on what this replica sent (a runner that keeps
//! heartbeating without accepting is passed over; claims of a replica that
//! died are given back). Every replica runs the same pass; the store's
//! guarded claims make exactly one of them send each run.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_proto::executor::v1 as epb;
use automesh_proto::runner::v1 as rpb;
use automesh_store::desktop::{Claim, DesktopAssignment};
use automesh_store::{Store, Topic};
use chrono::Utc;
use prost::Message as _;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::stream::Sessions;

/// Bound on handing one message to a runner's stream.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a replica looks for work even without a signal.
pub(crate) const POLL: Duration = Duration::from_secs(1);
/// Assignments (and cancellations) one delivery pass handles.
const PASS_LIMIT: u32 = 256;
/// How far back each pass looks for revoked runners.
const REVOCATION_MARGIN: chrono::Duration = chrono::Duration::seconds(10);
/// How often a replica forgets long-finished assignments, and how long
/// they are kept (their receipts and events live on in the run's records).
const PURGE_EVERY: Duration = Duration::from_secs(600);
const KEEP_FINISHED: chrono::Duration = chrono::Duration::hours(24);

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
    pub(crate) changed: Notify,
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
                .desktop_claim(
                    Claim::Expire,
                    &run_id,
                    &w.runner_id,
                    &w.stream_id,
                    Utc::now(),
                )
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
        .desktop_claim(
            Claim::Take,
            &a.run_id,
            runner_id,
            &session.stream_id,
            Utc::now(),
        )
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
