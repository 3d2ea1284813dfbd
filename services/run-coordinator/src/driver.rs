//! Driving runs: the claim loop and one driver per claimed run.
//!
//! A coordinator leases live runs (any replica may hold any run; a lease
//! that stops being renewed expires and another coordinator takes the run
//! over). A driver persists the run's message identity before it first
//! submits, asks the placement's executor to start (or, on takeover, to
//! observe) that exact message, records the executor's events and status,
//! and ends the run with one receipt. Every wait is bounded: by the run's
//! deadline, by the cancellation bound, or by the lease.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_domain::{
    AutomationState, ErrorCode, ModelCatalog, ModelSpec, Placement, Price, Receipt, Run,
    RunEventPayload, RunState, Usage,
};
use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_client::ExecutorServiceClient;
use automesh_rpc::{InternalChannel, convert, propagation};
use automesh_store::events::NewEvent;
use automesh_store::leases::{ClaimedRun, Renewal};
use automesh_store::{Store, StoreError};
use chrono::{DateTime, Utc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How the claim loop and its drivers behave.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long a lease lasts without a heartbeat; renewed every third of it.
    pub lease: Duration,
    /// How long to wait for an executor to be observed idle after a
    /// cancellation before ending the run with `cancel_unobserved`.
    pub cancel_bound: Duration,
    /// How often to look for claimable runs when nothing wakes the loop.
    pub poll: Duration,
    /// How many runs one coordinator drives at once.
    pub max_concurrent: usize,
    /// Bound on one unary executor call.
    pub call_timeout: Duration,
    /// How long past its deadline a submitted run waits for a coordinator
    /// with its executor before any coordinator ends it.
    pub orphan_grace: Duration,
    /// The model catalogue: the provider name each run's model is asked
    /// for, and the price its usage is charged at.
    pub models: Arc<ModelCatalog>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(15),
            cancel_bound: Duration::from_secs(30),
            poll: Duration::from_millis(500),
            max_concurrent: 1024,
            call_timeout: Duration::from_secs(10),
            orphan_grace: Duration::from_secs(300),
            models: Arc::new(ModelCatalog::development()),
        }
    }
}

/// The executors of each placement.
#[derive(Debug, Clone, Default)]
pub struct Executors {
    pub desktop: Option<ExecutorServiceClient<InternalChannel>>,
    pub cloud: Option<ExecutorServiceClient<InternalChannel>>,
}

impl Executors {
    /// The placements this coordinator can execute.
    pub fn placements(&self) -> Vec<Placement> {
        let mut out = vec![];
        if self.desktop.is_some() {
            out.push(Placement::Desktop);
        }
        if self.cloud.is_some() {
            out.push(Placement::Cloud);
        }
        out
    }

    fn for_placement(&self, p: Placement) -> Option<ExecutorServiceClient<InternalChannel>> {
        match p {
            Placement::Desktop => self.desktop.clone(),
            Placement::Cloud => self.cloud.clone(),
        }
    }
}

/// What the drivers of one coordinator share.
#[derive(Debug)]
pub struct Context {
    pub store: Store,
    pub executors: Executors,
    pub settings: Settings,
    /// This coordinator's lease identity.
    pub owner: String,
    /// The cancellation signal of every run this replica drives.
    pub active: Mutex<HashMap<String, CancellationToken>>,
}

impl Context {
    /// Tells this replica's driver of `run_id`, if it has one, that a
    /// cancellation was requested (other replicas learn it from their next
    /// heartbeat).
    pub fn signal_cancel(&self, run_id: &str) {
        if let Some(token) = self.active.lock().ok().and_then(|m| m.get(run_id).cloned()) {
            token.cancel();
        }
    }
}

/// Registers a driver's cancellation signal for as long as it lives.
struct Registration<'a> {
    ctx: &'a Context,
    run_id: String,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Ok(mut m) = self.ctx.active.lock() {
            m.remove(&self.run_id);
        }
    }
}

/// Claims and drives runs until `shutdown`; then stops its drivers and gives
/// their leases up, so another coordinator takes the runs over at once.
pub async fn run_loop(ctx: Arc<Context>, shutdown: CancellationToken) {
    let mut drivers = JoinSet::new();
    let _queue = AbortOnDrop(tokio::spawn(sample_queue(ctx.store.clone())));
    let mut watcher = ctx.store.watch_new_runs().await;
    tracing::info!(owner = %ctx.owner, "coordinator claiming runs");
    loop {
        while drivers.try_join_next().is_some() {}
        let capacity = ctx.settings.max_concurrent.saturating_sub(drivers.len());
        let mut claimed_any = false;
        if capacity > 0 {
            let now = Utc::now();
            let until = now + chrono::Duration::from_std(ctx.settings.lease).unwrap_or_default();
            let placements = ctx.executors.placements();
            match ctx
                .store
                .claim_runs(
                    &ctx.owner,
                    &placements,
                    until,
                    now,
                    now - chrono::Duration::from_std(ctx.settings.orphan_grace).unwrap_or_default(),
                    capacity.min(64) as u32,
                )
                .await
            {
                Ok(claimed) => {
                    claimed_any = !claimed.is_empty();
                    for run in claimed {
                        drivers.spawn(drive(ctx.clone(), run));
                    }
                }
                Err(error) => tracing::warn!(%error, "cannot claim runs"),
            }
        }
        if claimed_any {
            continue;
        }
        tokio::select! {
            () = watcher.wait(ctx.settings.poll) => {}
            () = shutdown.cancelled() => break,
        }
    }
    drivers.shutdown().await;
    match ctx.store.release_all_leases(&ctx.owner).await {
        Ok(n) => tracing::info!(released = n, "coordinator stopped; leases released"),
        Err(error) => tracing::warn!(%error, "coordinator stopped; leases will expire"),
    }
}

/// Samples the queue of unclaimed runs for its gauges, every few seconds.
async fn sample_queue(store: Store) {
    loop {
        if let Ok(q) = store.run_queue().await {
            let m = crate::metrics::metrics();
            m.pending.set(vec![(q.pending as f64, vec![])]);
            let lag = q.oldest.map_or(0.0, |t| {
                (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
            });
            m.lag.set(vec![(lag, vec![])]);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Why a driver stopped without ending the run.
#[derive(Debug)]
enum Stop {
    /// Another coordinator holds the run now.
    LeaseLost,
    Store(StoreError),
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Store(e)
    }
}

/// How a run ends.
#[derive(Debug, Clone)]
struct Ending {
    state: RunState,
    code: Option<ErrorCode>,
    message: Option<String>,
    engine: Option<String>,
    usage: Usage,
    wake_micros: i64,
    admission_micros: i64,
    thread: Option<automesh_proto::v1::NativeThread>,
}

impl Ending {
    fn new(state: RunState, code: Option<ErrorCode>, message: impl Into<String>) -> Self {
        Ending {
            state,
            code,
            message: Some(message.into()),
            engine: None,
            usage: Usage::default(),
            wake_micros: 0,
            admission_micros: 0,
            thread: None,
        }
    }
}

/// Why a cancellation was sent to the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CancelCause {
    User,
    Deadline,
}

async fn drive(ctx: Arc<Context>, claimed: ClaimedRun) {
    let run = claimed.run.clone();
    let span = tracing::info_span!(
        parent: None,
        "automesh.run",
        run_id = %run.id,
        automation_id = %run.automation_id,
        placement = %run.placement,
        claim = claimed.claims,
        outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
    );
    propagation::continue_trace(&span, run.traceparent.as_deref());
    if claimed.claims > 1 {
        crate::metrics::metrics().taken_over(&run);
    }
    let lost = CancellationToken::new();
    let cancel_seen = CancellationToken::new();
    if run.cancel_requested_at.is_some() {
        cancel_seen.cancel();
    }
    if let Ok(mut m) = ctx.active.lock() {
        m.insert(run.id.clone(), cancel_seen.clone());
    }
    let _registration = Registration {
        ctx: &ctx,
        run_id: run.id.clone(),
    };
    // Dies with the driver, however the driver ends: a heartbeat that
    // outlived a killed driver would keep the run from being taken over.
    let heartbeat = AbortOnDrop(tokio::spawn(
        heartbeat(ctx.clone(), run.clone(), lost.clone(), cancel_seen.clone()).in_current_span(),
    ));
    let result = execute(&ctx, &claimed, &lost, &cancel_seen)
        .instrument(span.clone())
        .await;
    drop(heartbeat);
    // Instrumented, never `span.enter()` across an await: a guard held over
    // an await point can be dropped on another thread and corrupt the
    // subscriber's span registry.
    async {
        match result {
            Ok(ending) => {
                if let Err(error) = finish(&ctx, &run, ending).await {
                    tracing::warn!(%error, "cannot record the run's end; it will be retried after the lease");
                }
            }
            Err(Stop::LeaseLost) => tracing::warn!("lease lost; another coordinator has the run"),
            Err(Stop::Store(error)) => {
                tracing::warn!(%error, "driver stopped on a store error; retried after the lease")
            }
        }
    }
    .instrument(span)
    .await;
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews the lease every third of its length; cancels `lost` when it is
/// lost or cannot be renewed before it expires.
async fn heartbeat(
    ctx: Arc<Context>,
    run: Run,
    lost: CancellationToken,
    cancel_seen: CancellationToken,
) {
    let lease = ctx.settings.lease;
    let every = lease / 3;
    // The lease is ours until `valid_until`, counted from when the last
    // successful renewal was sent: a driver never outlives its lease.
    let mut valid_until = tokio::time::Instant::now() + lease;
    // A driver that is stuck somewhere gets no renewals past this point,
    // so another coordinator can take the run and end it.
    let stop_renewing = run.deadline_at
        + chrono::Duration::from_std(ctx.settings.cancel_bound * 2 + lease).unwrap_or_default();
    loop {
        let wake = (tokio::time::Instant::now() + every).min(valid_until - every / 2);
        tokio::time::sleep_until(wake).await;
        if Utc::now() > stop_renewing {
            tracing::warn!("driver still busy well past the run's deadline; letting the lease go");
            lost.cancel();
            return;
        }
        let sent = tokio::time::Instant::now();
        let until = Utc::now() + chrono::Duration::from_std(lease).unwrap_or_default();
        let renewal =
            tokio::time::timeout(every, ctx.store.renew_lease(&run.id, &ctx.owner, until)).await;
        match renewal {
            Ok(Ok(Renewal::Held { cancel_requested })) => {
                valid_until = sent + lease;
                if cancel_requested {
                    cancel_seen.cancel();
                }
            }
            Ok(Ok(Renewal::Lost)) => {
                lost.cancel();
                return;
            }
            Ok(Err(error)) => tracing::warn!(%error, "lease renewal failed"),
            Err(_) => tracing::warn!("lease renewal timed out"),
        }
        if tokio::time::Instant::now() + every / 2 >= valid_until {
            lost.cancel();
            return;
        }
    }
}

fn sleep_until(t: DateTime<Utc>) -> tokio::time::Sleep {
    tokio::time::sleep((t - Utc::now()).to_std().unwrap_or(Duration::ZERO))
}

fn spec(ctx: &Context, run: &Run, message_id: &str) -> epb::RunSpec {
    epb::RunSpec {
        run_id: run.id.clone(),
        automation_id: run.automation_id.clone(),
        organization_id: run.org_id.clone(),
        owner_id: run.owner_id.clone(),
        prompt: run.prompt.clone(),
        model: run.model.clone(),
        deadline_time: Some(convert::timestamp(run.deadline_at)),
        traceparent: run.traceparent.clone().unwrap_or_default(),
        message_id: message_id.to_owned(),
        placement: convert::placement_to_pb(run.placement) as i32,
        provider_model: ctx
            .model(run)
            .map(|m| m.provider_model().to_owned())
            .unwrap_or_default(),
    }
}

impl Context {
    /// The catalogue entry of the run's model (a model removed from the
    /// catalogue since the run was created has none: its run is unpriced).
    fn model(&self, run: &Run) -> Option<&ModelSpec> {
        self.settings.models.get(&run.model)
    }

    fn price(&self, run: &Run) -> Option<Price> {
        self.model(run).and_then(|m| m.price)
    }
}

/// `usage` as the mesh charges it: the executor's tokens at the run's
/// price (0 for an unpriced model), whatever cost the engine reported.
fn priced(usage: Usage, price: Option<Price>) -> Usage {
    Usage {
        cost_micros: price.map_or(0, |p| {
            p.cost_micros(usage.input_tokens, usage.output_tokens)
        }),
        ..usage
    }
}

/// The message identity a run submits under.
fn message_id_for(run: &Run) -> String {
    format!("msg_{}", run.id)
}

async fn execute(
    ctx: &Context,
    claimed: &ClaimedRun,
    lost: &CancellationToken,
    cancel_seen: &CancellationToken,
) -> Result<Ending, Stop> {
    let run = &claimed.run;
    let deadline = run.deadline_at;
    let never_submitted = run.message_id.is_none();
    if Utc::now() >= deadline && never_submitted {
        return Ok(Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::DeadlineExceeded),
            "the run reached its deadline before it was dispatched",
        ));
    }
    if run.cancel_requested_at.is_some() && never_submitted {
        return Ok(Ending::new(
            RunState::Cancelled,
            None,
            "cancelled before it was dispatched",
        ));
    }
    let Some(mut executor) = ctx.executors.for_placement(run.placement) else {
        return wait_without_executor(run, lost, cancel_seen).await;
    };
    // Taken over after a cancellation or past the deadline: the message may
    // or may not have reached the executor. Never submit it now; cancel
    // whatever is there and wait (bounded) for idle.
    if Utc::now() >= deadline {
        return cancel_and_wait(ctx, &mut executor, run, lost, CancelCause::Deadline).await;
    }
    if cancel_seen.is_cancelled() {
        // The message identity is persisted before the first StartRun: a
        // run without one was never offered to any executor, so there is
        // nothing to stop and it is cancelled at once.
        if run.message_id.is_none() {
            return Ok(Ending::new(
                RunState::Cancelled,
                None,
                "cancelled before any executor had it",
            ));
        }
        return cancel_and_wait(ctx, &mut executor, run, lost, CancelCause::User).await;
    }
    // Identity first: a takeover must find it and observe, never resubmit.
    let message_id = ctx
        .store
        .ensure_message_id(&run.id, &message_id_for(run))
        .await?;
    let spec = spec(ctx, run, &message_id);

    // Start (or observe) the message, retrying until the deadline. Neither
    // a cancellation nor the deadline abandons a StartRun in flight (it is
    // bounded by the call timeout): the executor could take the run after
    // the cancellation reached it, and hold it until the cancellation
    // bound. Once the call has answered, the cancellation goes to an
    // executor that has the run.
    let mut backoff = Duration::from_millis(100);
    let started = loop {
        let mut request = tonic::Request::new(epb::StartRunRequest {
            run: Some(spec.clone()),
        });
        request.set_timeout(ctx.settings.call_timeout);
        let called = std::time::Instant::now();
        let attempt = tokio::select! {
            biased;
            () = lost.cancelled() => return Err(Stop::LeaseLost),
            r = executor.start_run(request) => r,
        };
        crate::metrics::metrics().call(
            run,
            "StartRun",
            called,
            attempt.as_ref().map(|_| ()).map_err(tonic::Status::code),
        );
        match attempt {
            Ok(resp) => break resp.into_inner(),
            Err(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), "executor did not accept the run; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = sleep_until(deadline) => return never_started(ctx, &mut executor, run, lost).await,
                    () = cancel_seen.cancelled() => return cancel_and_wait(ctx, &mut executor, run, lost, CancelCause::User).await,
                    () = lost.cancelled() => return Err(Stop::LeaseLost),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    };
    tracing::info!(submitted = started.submitted, message_id = %message_id, "run started on its executor");
    if started.submitted {
        crate::metrics::metrics().dispatched(run);
    }
    let mut first_event = claimed.claims > 1;
    apply_status(ctx, run, started.status.as_ref()).await?;
    // A previous driver may have cancelled it for its deadline, then died.
    let inferred = (Utc::now() >= deadline).then_some(CancelCause::Deadline);
    // Finished already (a fast run, or one that ended while no coordinator
    // watched): its events are still read into the run's log before it
    // ends; only if they cannot be read does the run end without them.
    let known_end = finished(started.status.as_ref(), inferred);

    let mut after = claimed.executor_seq;
    let mut cancel: Option<(CancelCause, tokio::time::Instant)> = None;
    // Whether the executor ever ran it: a desktop run no runner accepted
    // before its deadline is `runner_offline`, not a cancelled execution.
    let mut ran = ran_on_executor(started.status.as_ref()) || run.started_at.is_some();
    // Whether a runner of the owner sat on it without accepting it.
    let mut unaccepted = started.status.as_ref().is_some_and(|s| s.unaccepted);
    let mut backoff = Duration::from_millis(100);
    loop {
        // Opening the stream is bounded; the stream itself is read inside
        // the select below, beside the deadline, cancellation and lease.
        let opened = tokio::time::timeout(
            ctx.settings.call_timeout,
            executor.observe_run(epb::ObserveRunRequest {
                run_id: run.id.clone(),
                after_sequence: after,
            }),
        )
        .await;
        let mut stream = match opened {
            Ok(Ok(s)) => Some(s.into_inner()),
            Ok(Err(status)) => {
                tracing::warn!(code = ?status.code(), "cannot observe the run; retrying");
                None
            }
            Err(_) => {
                tracing::warn!("observing the run timed out; retrying");
                None
            }
        };
        loop {
            let cancel_deadline = cancel.map(|(_, at)| at + ctx.settings.cancel_bound);
            tokio::select! {
                item = async { match stream.as_mut() { Some(s) => s.message().await, None => Ok(None) } } => {
                    match item {
                        Ok(Some(update)) => {
                            backoff = Duration::from_millis(100);
                            match update.update {
                                Some(epb::observe_run_response::Update::Event(e)) => {
                                    record_event(ctx, run, &e).await?;
                                    after = after.max(e.sequence);
                                    if !first_event {
                                        first_event = true;
                                        crate::metrics::metrics().first_event(run);
                                    }
                                }
                                Some(epb::observe_run_response::Update::Status(s)) => {
                                    ran |= ran_on_executor(Some(&s));
                                    unaccepted |= s.unaccepted;
                                    apply_status(ctx, run, Some(&s)).await?;
                                    if let Some(ending) = finished(Some(&s), cancel.map(|c| c.0).or(inferred)) {
                                        return Ok(ending);
                                    }
                                    if s.idle && let Some((cause, _)) = cancel {
                                        return Ok(offline_unless(ran, unaccepted, run, cause, cancelled(cause, true)));
                                    }
                                }
                                None => {}
                            }
                        }
                        Ok(None) | Err(_) => break,
                    }
                }
                () = sleep_until(deadline), if cancel.is_none() => {
                    send_cancel(ctx, &mut executor, run, "deadline reached").await;
                    cancel = Some((CancelCause::Deadline, tokio::time::Instant::now()));
                }
                () = cancel_seen.cancelled(), if cancel.is_none() => {
                    send_cancel(ctx, &mut executor, run, "cancelled by the user").await;
                    cancel = Some((CancelCause::User, tokio::time::Instant::now()));
                }
                () = async { match cancel_deadline { Some(at) => tokio::time::sleep_until(at).await, None => std::future::pending().await } } => {
                    // Last look before giving up on seeing it idle.
                    if let Some((cause, _)) = cancel {
                        let idle = status_of(ctx, &mut executor, run).await.is_some_and(|s| s.idle);
                        return Ok(offline_unless(ran, unaccepted, run, cause, cancelled(cause, idle)));
                    }
                }
                () = lost.cancelled() => return Err(Stop::LeaseLost),
            }
        }
        ctx.store.set_executor_seq(&run.id, after).await?;
        if let Some(ending) = known_end.clone() {
            tracing::warn!("the finished run's events could not be read; it ends without them");
            return Ok(ending);
        }
        // The stream ended or broke: reconnect, bounded by the deadline and the lease.
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = lost.cancelled() => return Err(Stop::LeaseLost),
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
        if cancel.is_none() && Utc::now() >= deadline {
            send_cancel(ctx, &mut executor, run, "deadline reached").await;
            cancel = Some((CancelCause::Deadline, tokio::time::Instant::now()));
        }
    }
}

fn ran_on_executor(status: Option<&epb::ExecutionStatus>) -> bool {
    status.is_some_and(|s| {
        matches!(
            epb::ExecutionPhase::try_from(s.phase),
            Ok(epb::ExecutionPhase::Running | epb::ExecutionPhase::Finished)
        )
    })
}

/// A desktop run that reached its deadline without any runner accepting it
/// ends `runner_offline` (SPEC §6), or `runner_unresponsive` when a runner
/// of the owner was sent it and never accepted it; anything else keeps its
/// ending.
fn offline_unless(
    ran: bool,
    unaccepted: bool,
    run: &Run,
    cause: CancelCause,
    ending: Ending,
) -> Ending {
    if ran || run.placement != Placement::Desktop || !matches!(cause, CancelCause::Deadline) {
        return ending;
    }
    if unaccepted {
        return Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::RunnerUnresponsive),
            "a runner of the owner was sent the run and never accepted it, and no other runner took it before its deadline",
        );
    }
    Ending::new(
        RunState::TimedOut,
        Some(ErrorCode::RunnerOffline),
        "no runner of the owner took the run before its deadline",
    )
}

/// Without an executor for its placement a run can only wait: for a
/// cancellation, or for its deadline.
async fn wait_without_executor(
    run: &Run,
    lost: &CancellationToken,
    cancel_seen: &CancellationToken,
) -> Result<Ending, Stop> {
    // A submitted run is only claimed here once orphaned past its deadline:
    // it can be ended, but no executor of this replica can cancel it.
    // Not a durable failure of the user's setup: the mesh has no executor.
    let code = match run.placement {
        Placement::Desktop => ErrorCode::RunnerOffline,
        Placement::Cloud => ErrorCode::DeadlineExceeded,
    };
    tokio::select! {
        () = sleep_until(run.deadline_at) => {
            Ok(Ending::new(RunState::TimedOut, Some(code), format!("no {} executor took the run before its deadline", run.placement)))
        }
        () = cancel_seen.cancelled() => {
            Ok(Ending::new(RunState::Cancelled, None, "cancelled before it was dispatched"))
        }
        () = lost.cancelled() => Err(Stop::LeaseLost),
    }
}

/// The deadline came before the executor ever accepted the run: make sure
/// nothing runs, then end it. A desktop run that no runner took is
/// `runner_offline` (SPEC §6).
async fn never_started(
    ctx: &Context,
    executor: &mut ExecutorServiceClient<InternalChannel>,
    run: &Run,
    lost: &CancellationToken,
) -> Result<Ending, Stop> {
    let ending = cancel_and_wait(ctx, executor, run, lost, CancelCause::Deadline).await?;
    Ok(match run.placement {
        Placement::Desktop => Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::RunnerOffline),
            "no runner of the owner took the run before its deadline",
        ),
        Placement::Cloud => ending,
    })
}

/// Cancels the run on its executor and waits, bounded, for it to be idle.
async fn cancel_and_wait(
    ctx: &Context,
    executor: &mut ExecutorServiceClient<InternalChannel>,
    run: &Run,
    lost: &CancellationToken,
    cause: CancelCause,
) -> Result<Ending, Stop> {
    if lost.is_cancelled() {
        return Err(Stop::LeaseLost);
    }
    let reason = match cause {
        CancelCause::Deadline => "deadline reached",
        CancelCause::User => "cancelled by the user",
    };
    send_cancel(ctx, executor, run, reason).await;
    let give_up = tokio::time::Instant::now() + ctx.settings.cancel_bound;
    while tokio::time::Instant::now() < give_up {
        if lost.is_cancelled() {
            return Err(Stop::LeaseLost);
        }
        if status_of(ctx, executor, run).await.is_some_and(|s| s.idle) {
            return Ok(cancelled(cause, true));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(cancelled(cause, false))
}

fn cancelled(cause: CancelCause, idle_observed: bool) -> Ending {
    match (cause, idle_observed) {
        (CancelCause::Deadline, true) => Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::DeadlineExceeded),
            "the run reached its deadline and was cancelled on its executor",
        ),
        (CancelCause::Deadline, false) => Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::DeadlineExceeded),
            "the run reached its deadline; its executor was not observed idle after cancellation",
        ),
        (CancelCause::User, true) => Ending::new(
            RunState::Cancelled,
            None,
            "cancelled by the user; the executor is idle",
        ),
        (CancelCause::User, false) => Ending::new(
            RunState::Cancelled,
            Some(ErrorCode::CancelUnobserved),
            "cancelled by the user; the executor was not observed idle within the cancellation bound",
        ),
    }
}

async fn send_cancel(
    ctx: &Context,
    executor: &mut ExecutorServiceClient<InternalChannel>,
    run: &Run,
    reason: &str,
) {
    let mut request = tonic::Request::new(epb::CancelRunRequest {
        run_id: run.id.clone(),
        reason: reason.to_owned(),
    });
    request.set_timeout(ctx.settings.call_timeout);
    let called = std::time::Instant::now();
    let result = executor.cancel_run(request).await;
    crate::metrics::metrics().call(
        run,
        "CancelRun",
        called,
        result.as_ref().map(|_| ()).map_err(tonic::Status::code),
    );
    if let Err(status) = result {
        tracing::warn!(code = ?status.code(), "executor did not take the cancellation; idleness decides");
    } else {
        tracing::info!(reason, "cancellation forwarded to the executor");
    }
}

async fn status_of(
    ctx: &Context,
    executor: &mut ExecutorServiceClient<InternalChannel>,
    run: &Run,
) -> Option<epb::ExecutionStatus> {
    let mut request = tonic::Request::new(epb::GetRunStatusRequest {
        run_id: run.id.clone(),
    });
    request.set_timeout(ctx.settings.call_timeout);
    let called = std::time::Instant::now();
    let result = executor.get_run_status(request).await;
    crate::metrics::metrics().call(
        run,
        "GetRunStatus",
        called,
        result.as_ref().map(|_| ()).map_err(tonic::Status::code),
    );
    result.ok()?.into_inner().status
}

/// Moves the stored state forward to what the executor reports.
async fn apply_status(
    ctx: &Context,
    run: &Run,
    status: Option<&epb::ExecutionStatus>,
) -> Result<(), Stop> {
    let Some(status) = status else { return Ok(()) };
    let targets: &[RunState] = match epb::ExecutionPhase::try_from(status.phase) {
        Ok(epb::ExecutionPhase::Admitted) => &[RunState::Admitted],
        Ok(epb::ExecutionPhase::Running | epb::ExecutionPhase::Finished) => {
            &[RunState::Admitted, RunState::Running]
        }
        _ => &[],
    };
    let now = Utc::now();
    for target in targets {
        let current = ctx.store.get_run_unscoped(&run.id).await?;
        if current.state.can_move_to(*target) {
            match ctx.store.transition_run(&run.id, *target, None, now).await {
                Ok(_) => record_status(ctx, run, *target, None, None).await?,
                Err(StoreError::IllegalTransition { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// The ending an executor reported, if it reported one.
fn finished(status: Option<&epb::ExecutionStatus>, cancel: Option<CancelCause>) -> Option<Ending> {
    let status = status?;
    if status.phase != epb::ExecutionPhase::Finished as i32 {
        return None;
    }
    let outcome = status.outcome.clone().unwrap_or_default();
    let reported = convert::run_state_from_pb(outcome.state).unwrap_or(RunState::Failed);
    let code = outcome.error_code.parse::<ErrorCode>().ok();
    let (state, code) = match (reported, cancel) {
        (RunState::Cancelled | RunState::TimedOut, Some(CancelCause::Deadline))
        | (RunState::TimedOut, _) => (RunState::TimedOut, Some(ErrorCode::DeadlineExceeded)),
        (RunState::Succeeded, _) => (RunState::Succeeded, None),
        (RunState::Cancelled, _) => (RunState::Cancelled, None),
        (_, _) => (RunState::Failed, code.or(Some(ErrorCode::Internal))),
    };
    let usage = outcome.usage.unwrap_or_default();
    Some(Ending {
        state,
        code,
        message: (!outcome.error_message.is_empty()).then(|| outcome.error_message.clone()),
        engine: (!outcome.engine.is_empty()).then(|| outcome.engine.clone()),
        usage: Usage {
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            cost_micros: usage.cost_micros,
        },
        wake_micros: outcome.wake_micros,
        admission_micros: outcome.admission_micros,
        thread: outcome.native_thread,
    })
}

async fn record_event(
    ctx: &Context,
    run: &Run,
    e: &automesh_proto::v1::RunEvent,
) -> Result<(), Stop> {
    let e = &e.clone().bounded();
    let Some(mut payload) = convert::event_payload_from_pb(e) else {
        return Ok(());
    };
    if let RunEventPayload::Usage(usage) = &mut payload {
        *usage = priced(*usage, ctx.price(run));
    }
    if e.event_id.is_empty() {
        tracing::warn!("executor event without an id dropped");
        return Ok(());
    }
    ctx.store
        .append_events(
            &run.id,
            &[NewEvent {
                event_id: e.event_id.clone(),
                payload,
            }],
            Utc::now(),
        )
        .await?;
    Ok(())
}

/// A status event of the coordinator's own, with an id that makes it
/// appear once however often it is recorded.
async fn record_status(
    ctx: &Context,
    run: &Run,
    state: RunState,
    code: Option<ErrorCode>,
    message: Option<&str>,
) -> Result<(), StoreError> {
    let event = automesh_store::events::status_event(state, code, message);
    ctx.store
        .append_events(&run.id, &[event], Utc::now())
        .await
        .map(|_| ())
}

fn micros_between(from: Option<DateTime<Utc>>, to: DateTime<Utc>) -> i64 {
    from.map_or(0, |f| (to - f).num_microseconds().unwrap_or(0).max(0))
}

/// Records the end: the terminal state, the receipt and the terminal status
/// event in one transaction, then what the outcome means for the automation.
async fn finish(ctx: &Context, run: &Run, ending: Ending) -> Result<(), StoreError> {
    let now = Utc::now();
    let current = ctx.store.get_run_unscoped(&run.id).await?;
    let thread = ending.thread.clone().unwrap_or_default();
    let some = |s: String| (!s.is_empty()).then_some(s);
    let price = ctx.price(run);
    let ending = Ending {
        usage: priced(ending.usage, price),
        ..ending
    };
    let receipt = Receipt {
        run_id: run.id.clone(),
        outcome: ending.state,
        error_code: ending.code,
        error_message: ending.message.clone(),
        placement: run.placement,
        engine: ending.engine.clone(),
        queued_micros: micros_between(Some(run.created_at), current.admitted_at.unwrap_or(now)),
        wake_micros: ending.wake_micros,
        admission_micros: ending.admission_micros,
        execution_micros: micros_between(current.started_at.or(current.admitted_at), now),
        usage: ending.usage,
        worker_id: some(thread.worker_id),
        workspace_id: some(thread.workspace_id),
        thread_id: some(thread.thread_id),
        message_id: some(thread.message_id).or(current.message_id.clone()),
        created_at: now,
        model: some(run.model.clone()),
        provider_model: ctx.model(run).map(|m| m.provider_model().to_owned()),
        price,
    };
    match ctx.store.finish_run_as(&receipt, &ctx.owner, now).await {
        Ok(_) => {
            automesh_rpc::process::failpoint("coordinator.after_finish");
            crate::metrics::metrics().ended(run, ending.state, ending.code, &ending.usage);
        }
        // Already terminal (another path ended it): nothing more to do.
        Err(StoreError::IllegalTransition { .. }) => return Ok(()),
        Err(e) => return Err(e),
    }
    let code = ending.code.map(|c| c.as_str()).unwrap_or_default();
    // The run's span says how it ended; a failed run marks it ERROR with
    // its error code as `error.type` (OpenTelemetry's convention).
    let span = tracing::Span::current();
    span.record("outcome", ending.state.as_str());
    if !matches!(ending.state, RunState::Succeeded | RunState::Cancelled) {
        span.record("otel.status_code", "ERROR");
        span.record(
            "error.type",
            if code.is_empty() {
                ending.state.as_str()
            } else {
                code
            },
        );
        if let Some(message) = ending.message.as_deref() {
            span.record("otel.status_description", message);
        }
    }
    tracing::info!(state = %ending.state, error_code = code, "run ended");
    update_attention(ctx, run, &ending, now).await
}

/// A durable failure the user must fix pauses the automation
/// (needs-attention); a successful run clears it.
async fn update_attention(
    ctx: &Context,
    run: &Run,
    ending: &Ending,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let needs_attention =
        ending.code.is_some_and(ErrorCode::needs_attention) && ending.state == RunState::Failed;
    let succeeded = ending.state == RunState::Succeeded;
    if !needs_attention && !succeeded {
        return Ok(());
    }
    for _ in 0..5 {
        let mut a = ctx
            .store
            .get_automation_unscoped(&run.automation_id)
            .await?;
        let version = a.version;
        if needs_attention && a.state == AutomationState::Active {
            a.state = AutomationState::NeedsAttention;
            a.attention_reason = ending.code;
            a.attention_message = ending.message.clone();
            a.next_run_at = None;
        } else if succeeded && a.state == AutomationState::NeedsAttention {
            a.state = AutomationState::Active;
            a.attention_reason = None;
            a.attention_message = None;
            a.next_run_at = a.schedule.next_after(now);
        } else {
            return Ok(());
        }
        match ctx
            .store
            .update_automation_if_version(&a, version, now)
            .await
        {
            Ok(_) => {
                tracing::info!(automation_id = %a.id, state = %a.state, "automation attention updated");
                return Ok(());
            }
            Err(StoreError::VersionConflict { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
