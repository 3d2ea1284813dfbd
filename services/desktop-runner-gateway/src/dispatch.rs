//! Desktop dispatch on one replica: what it hears of desktop dispatch (the
//! store's [`DesktopNote`]s), the one-hop delivery of an offered run to the
//! owner's runner it holds (claimed and sent as soon as the offer is heard),
//! the delivery pass that looks at everything unclaimed (on a note that
//! claims were given back or cancelled, and once a second as a safety net
//! off the latency path), the forwarding of cancellations, and the
//! acceptance bound on what this replica sent (a runner that keeps its
//! stream alive without accepting is passed over; claims of a replica that
//! died are given back). Every replica does the same; the store's guarded
//! claims make exactly one of them send each run.

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use automesh_proto::executor::v1 as epb;
use automesh_store::desktop::Claim;
use automesh_store::{AssignmentState, DesktopNote, Heard, Store};
use chrono::Utc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::outbound::{cancel_message, run_span, send, send_assignment, spec_of, stored_run_span};
use crate::stream::Sessions;

/// How long a replica that stopped beating is remembered (its streams then
/// read as last seen when they opened).
const FORGET_REPLICAS: chrono::Duration = chrono::Duration::days(7);
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
    /// The stream's liveness is HTTP/2 PING, not heartbeats.
    ping_liveness: bool,
}

impl Awaiting {
    /// Past the bound, and the runner was heard from well after the run was
    /// sent (half the bound later) without accepting it: wedged, not merely
    /// stalled. A stalled runner (a stopped process, a broken network) is
    /// left to the dead-stream bound, which gives its runs back when the
    /// stream ends.
    ///
    /// A stream kept alive by HTTP/2 PING is alive while it stays open (a
    /// stalled one is closed by the PINGs' bound): past the bound, it is
    /// wedged.
    fn wedged(&self, now: tokio::time::Instant, accept_within: Duration) -> bool {
        let heard = self.last_heard.load(std::sync::atomic::Ordering::Relaxed);
        self.until <= now
            && (self.ping_liveness || heard >= self.sent_at + accept_within.as_millis() as u64 / 2)
    }
}

/// This replica's side of desktop dispatch: wake-ups (of the delivery pass,
/// and of each observed run), which cancellations it already forwarded on
/// which stream, the runs it is claiming now, and the assignments it sent
/// that are not accepted yet.
#[derive(Debug)]
pub struct Dispatch {
    pass_wanted: Notify,
    observed: Mutex<HashMap<String, Observed>>,
    cancels_sent: Mutex<HashSet<(u64, String)>>,
    accept_within: Duration,
    /// How often it looks for work even without a note.
    poll: Duration,
    claiming: Mutex<HashSet<String>>,
    awaiting: Mutex<HashMap<String, Awaiting>>,
}

/// The wake-up of one observed run, shared by its observers, and what the
/// last note said the run's assignment now is (none when it said nothing:
/// the observers read the row).
#[derive(Debug)]
struct Observed {
    changed: Arc<Notify>,
    observers: usize,
    told: Option<AssignmentState>,
}

/// An observer's registration; dropping it ends it.
#[derive(Debug)]
pub(crate) struct RunWake<'a> {
    dispatch: &'a Dispatch,
    run_id: String,
    pub(crate) changed: Arc<Notify>,
}

impl RunWake<'_> {
    /// What the last note said the run's assignment now is, if it said
    /// and no observer used it yet (an observer that finds nothing reads
    /// the row).
    pub(crate) fn told(&self) -> Option<AssignmentState> {
        let mut observed = self.dispatch.observed.lock();
        observed.get_mut(&self.run_id)?.told.take()
    }
}

impl Drop for RunWake<'_> {
    fn drop(&mut self) {
        let mut observed = self.dispatch.observed.lock();
        if let Some(o) = observed.get_mut(&self.run_id) {
            o.observers -= 1;
            if o.observers == 0 {
                observed.remove(&self.run_id);
            }
        }
    }
}

impl Default for Dispatch {
    fn default() -> Self {
        let settings = crate::stream::StreamSettings::default();
        Self::new(settings.accept_within, settings.dispatch_poll)
    }
}

impl Dispatch {
    /// How often it looks for work even without a note.
    pub(crate) fn poll(&self) -> Duration {
        self.poll
    }

    pub fn new(accept_within: Duration, poll: Duration) -> Self {
        Self {
            pass_wanted: Notify::new(),
            observed: Mutex::default(),
            cancels_sent: Mutex::default(),
            accept_within,
            poll,
            claiming: Mutex::default(),
            awaiting: Mutex::default(),
        }
    }

    /// Registers an observer of `run_id`: woken when the run's assignment
    /// changes, on whichever replica it changed.
    pub(crate) fn observe_run(&self, run_id: &str) -> RunWake<'_> {
        let changed = {
            let mut observed = self.observed.lock();
            let o = observed
                .entry(run_id.to_owned())
                .or_insert_with(|| Observed {
                    changed: Arc::default(),
                    observers: 0,
                    told: None,
                });
            o.observers += 1;
            o.changed.clone()
        };
        RunWake {
            dispatch: self,
            run_id: run_id.to_owned(),
            changed,
        }
    }

    /// Wakes the observers of `run_id`, if any.
    /// Wakes the observers of `run_id`, if any, with what the note said
    /// the run's assignment now is (`None`: they read it).
    fn wake_run(&self, run_id: &str, told: Option<AssignmentState>) {
        if let Some(o) = self.observed.lock().get_mut(run_id) {
            o.told = told;
            o.changed.notify_waiters();
        }
    }

    /// Wakes every observer (notes may have been lost): they read.
    fn wake_all_runs(&self) {
        for o in self.observed.lock().values_mut() {
            o.told = None;
            o.changed.notify_waiters();
        }
    }

    /// Whether `run_id` was sent on `stream_id` from here and awaits its
    /// acceptance.
    fn sent_on(&self, run_id: &str, stream_id: &str) -> bool {
        self.awaiting
            .lock()
            .get(run_id)
            .is_some_and(|w| w.stream_id == stream_id)
    }

    /// Forgets an assignment its runner accepted.
    pub(crate) fn accepted(&self, run_id: &str) {
        self.awaiting.lock().remove(run_id);
    }

    /// Forgets the assignments awaiting acceptance on a stream that ended
    /// (its unaccepted claims are released with it).
    pub fn forget_stream(&self, stream_id: &str) {
        self.awaiting.lock().retain(|_, w| w.stream_id != stream_id);
    }

    /// Whether an assignment sent from here is past its acceptance bound.
    fn any_due(&self) -> bool {
        let now = tokio::time::Instant::now();
        self.awaiting.lock().values().any(|w| w.until <= now)
    }

    /// Gives back what a runner held past the acceptance bound, and tells
    /// the runner to drop it; the run goes to the owner's other runners.
    async fn expire_unaccepted(&self, store: &Store) -> Result<(), automesh_store::StoreError> {
        let now = tokio::time::Instant::now();
        let due: Vec<(String, Awaiting)> = {
            let mut a = self.awaiting.lock();
            let due: Vec<String> = a
                .iter()
                .filter(|(_, w)| w.wedged(now, self.accept_within))
                .map(|(run, _)| run.clone())
                .collect();
            due.into_iter()
                .filter_map(|run| a.remove(&run).map(|w| (run, w)))
                .collect()
        };
        for (run_id, w) in due {
            let expired = store
                .desktop_claim(
                    Claim::Expire,
                    &run_id,
                    &w.runner_id,
                    &w.stream_id,
                    Utc::now(),
                )
                .await?;
            if let Some(a) = expired {
                let span = run_span("automesh.desktop.unaccepted", &run_id, spec_of(&a).as_ref());
                tracing::warn!(
                    parent: &span,
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
                send(&w.tx, cancel_message(&run_id, &reason))
                    .instrument(span)
                    .await;
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
    /// Wakes this replica's delivery pass.
    pub fn poke(&self) {
        self.pass_wanted.notify_waiters();
    }

    fn cancel_sent(&self, session: u64, run_id: &str) -> bool {
        !self
            .cancels_sent
            .lock()
            .insert((session, run_id.to_owned()))
    }

    /// Forgets what was sent on a stream that ended.
    pub fn forget_session(&self, session: u64) {
        self.cancels_sent.lock().retain(|(id, _)| *id != session);
    }

    /// Acts on what this replica hears of desktop dispatch, until shutdown:
    /// an offered run goes straight to the owner's runner held here (one
    /// claim, then the stream), a change wakes that run's observers, a
    /// given-back claim or a cancellation wakes the delivery pass; notes
    /// that may have been lost wake everything.
    pub async fn relay(
        self: Arc<Self>,
        store: Store,
        sessions: Arc<Sessions>,
        shutdown: CancellationToken,
    ) {
        let mut listener = store.listen_desktop().await;
        loop {
            let heard = tokio::select! {
                heard = listener.next(self.poll) => heard,
                () = shutdown.cancelled() => return,
            };
            let notes = match heard {
                Heard::Notes(notes) => notes,
                Heard::Missed => {
                    self.poke();
                    self.wake_all_runs();
                    continue;
                }
                Heard::Nothing => continue,
            };
            for note in notes {
                // An offer changes nothing its observer (which starts after
                // it) could see.
                match &note {
                    DesktopNote::Offered { .. } | DesktopNote::Released => {}
                    DesktopNote::Changed { run_id, now } => self.wake_run(run_id, now.clone()),
                    DesktopNote::GivenBack { run_id } | DesktopNote::Cancelled { run_id } => {
                        self.wake_run(run_id, None);
                    }
                }
                match note {
                    DesktopNote::Offered {
                        run_id,
                        org_id,
                        owner_id,
                    } => {
                        let Some(session) = sessions.of_owner(&org_id, &owner_id, None) else {
                            continue;
                        };
                        let (dispatch, store) = (self.clone(), store.clone());
                        tokio::spawn(async move {
                            if let Err(error) =
                                dispatch.offer(&store, &session, &run_id, false).await
                            {
                                let span =
                                    stored_run_span(&store, "automesh.desktop.deliver", &run_id)
                                        .await;
                                tracing::warn!(parent: &span, %error, run_id, "delivering an offered run failed; the delivery pass retries");
                                dispatch.poke();
                            }
                        });
                    }
                    DesktopNote::GivenBack { .. }
                    | DesktopNote::Cancelled { .. }
                    | DesktopNote::Released => self.poke(),
                    DesktopNote::Changed { .. } => {}
                }
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
        let mut streams_seen = tokio::time::Instant::now();
        loop {
            let wanted = self.pass_wanted.notified();
            tokio::pin!(wanted);
            wanted.as_mut().enable();
            // Owners see their runners online while this replica beats (one
            // write, however many streams it holds); its streams read
            // offline once the beat is stale (it died).
            if streams_seen.elapsed() >= crate::STREAMS_SEEN_EVERY {
                streams_seen = tokio::time::Instant::now();
                let beat =
                    store.runner_gateway_seen(&sessions.replica, Utc::now(), FORGET_REPLICAS);
                if let Err(error) = beat.await {
                    tracing::warn!(%error, "cannot record this replica's beat; its runners read offline once it is stale");
                }
            }
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
            if !sessions.is_empty()
                && revocations_checked.is_none_or(|at| at.elapsed() >= self.poll)
            {
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
            if orphans_checked.is_none_or(|at| at.elapsed() >= self.poll) {
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
                () = wanted => {}
                () = tokio::time::sleep(self.poll) => {}
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
            self.offer(store, &session, &a.run_id, false).await?;
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
            let span = run_span("automesh.desktop.cancel", &a.run_id, spec_of(&a).as_ref());
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
    /// Claims `run_id` for `session`'s stream (the claim returns the spec)
    /// and sends it; gives the claim back when the stream does not take it,
    /// so the next pass (or another runner) can. A sent assignment the
    /// runner does not accept within the bound is given back too. False
    /// when another replica or runner was faster, or it was sent on this
    /// stream already. `again`: a runner had it before.
    pub(crate) async fn offer(
        &self,
        store: &Store,
        session: &crate::stream::Session,
        run_id: &str,
        again: bool,
    ) -> Result<bool, automesh_store::StoreError> {
        let Some(_claiming) = Claiming::start(self, run_id) else {
            return Ok(false);
        };
        // Sent on this stream already (by the one-hop delivery, after a
        // pass read the run): a claim would apply again, a second send not.
        if self.sent_on(run_id, &session.stream_id) {
            return Ok(false);
        }
        let (runner_id, stream_id) = (&session.runner_id, &session.stream_id);
        let claimed = store.desktop_claim(Claim::Take, run_id, runner_id, stream_id, Utc::now());
        let Some(spec) = claimed.await?.as_ref().and_then(spec_of) else {
            return Ok(false);
        };
        let span = run_span("automesh.desktop.deliver", run_id, Some(&spec));
        self.send_claimed(store, session, &spec, again)
            .instrument(span)
            .await
    }

    /// Sends `spec`, claimed for `session`'s stream, and awaits its
    /// acceptance; gives the claim back when the stream does not take it.
    async fn send_claimed(
        &self,
        store: &Store,
        session: &crate::stream::Session,
        spec: &epb::RunSpec,
        again: bool,
    ) -> Result<bool, automesh_store::StoreError> {
        let sent = send_assignment(store, session, spec, again).await?;
        if sent {
            self.awaiting.lock().insert(
                spec.run_id.clone(),
                Awaiting {
                    runner_id: session.runner_id.clone(),
                    stream_id: session.stream_id.clone(),
                    tx: session.tx.clone(),
                    until: tokio::time::Instant::now() + self.accept_within,
                    sent_at: crate::stream::heard_now(),
                    last_heard: session.last_heard.clone(),
                    ping_liveness: session.ping_liveness,
                },
            );
        }
        Ok(sent)
    }
}

/// A run this replica is claiming and sending now: the one-hop delivery
/// and the delivery pass may both try it, only one of them does.
struct Claiming<'a> {
    dispatch: &'a Dispatch,
    run_id: String,
}

impl<'a> Claiming<'a> {
    fn start(dispatch: &'a Dispatch, run_id: &str) -> Option<Self> {
        let mut claiming = dispatch.claiming.lock();
        claiming.insert(run_id.to_owned()).then(|| Claiming {
            dispatch,
            run_id: run_id.to_owned(),
        })
    }
}

impl Drop for Claiming<'_> {
    fn drop(&mut self) {
        self.dispatch.claiming.lock().remove(&self.run_id);
    }
}
