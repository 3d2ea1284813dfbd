//! Executing a claimed run: start (or, on takeover, observe) its message on
//! the placement's executor, record its events and status, and wait —
//! bounded by the deadline and the cancellation bound — for its ending.

use std::time::Duration;

use automesh_domain::{ErrorCode, Placement, Run, RunEventPayload, RunState};
use automesh_edge::convert;
use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_client::ExecutorServiceClient;
use automesh_rpc::InternalChannel;
use automesh_store::StoreError;
use automesh_store::events::NewEvent;
use automesh_store::leases::ClaimedRun;
use chrono::Utc;
use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;

use super::ending::{CancelCause, Ending, cancelled, finished, offline_unless, ran_on_executor};
use super::outcome::priced;
use super::{Context, Stop, sleep_until};

pub(super) fn spec(ctx: &Context, run: &Run, message_id: &str) -> epb::RunSpec {
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
        budget: convert::run_budget_to_pb(run.budget, ctx.price(run)),
    }
}

pub(super) async fn execute(
    ctx: &Context,
    claimed: &ClaimedRun,
    progress: &mut Progress,
    lost: &CancellationToken,
    cancel_seen: &CancellationToken,
) -> Result<Ending, Stop> {
    let run = &claimed.run;
    let deadline = run.deadline_at;
    let never_submitted = !claimed.maybe_submitted;
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
    // The model's authority, checked against this coordinator's catalogue
    // before anything is dispatched (the catalogue may have changed since
    // the automation was created): a model no longer admitted for the
    // owner's organisation where the run runs is a durable failure the owner
    // must fix, and no provider is ever called for it.
    if never_submitted
        && let Err(refusal) = ctx
            .settings
            .models
            .admits(&run.model, &run.org_id, run.placement)
    {
        let why = refusal.explain(&run.model, &run.org_id);
        tracing::warn!(run_id = %run.id, model = %run.model, reason = %why, "the run's model is not admitted; it is not dispatched");
        return Ok(Ending::new(
            RunState::Failed,
            Some(ErrorCode::ModelNotAuthorized),
            format!("{why}; the run was not dispatched"),
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
        // The message identity is persisted with the first claim, before
        // any StartRun: a run that had none was never offered to any
        // executor, so there is nothing to stop and it is cancelled at once.
        if never_submitted {
            return Ok(Ending::new(
                RunState::Cancelled,
                None,
                "cancelled before any executor had it",
            ));
        }
        return cancel_and_wait(ctx, &mut executor, run, lost, CancelCause::User).await;
    }
    // The identity the claim persisted: a takeover finds it and observes,
    // never resubmits under another.
    let Some(message_id) = run.message_id.clone() else {
        let missing = "a run of an executed placement was claimed without its message identity";
        return Err(Stop::Store(StoreError::Corrupt(missing.into())));
    };
    let spec = spec(ctx, run, &message_id);

    // Start (or observe) the message, retrying until the deadline. Neither
    // a cancellation nor the deadline abandons a StartRun in flight (it is
    // bounded by the call timeout): the executor could take the run after
    // the cancellation reached it, and hold it until the cancellation
    // bound. Once the call has answered, the cancellation goes to an
    // executor that has the run.
    let mut backoff = Duration::from_millis(100);
    progress.submitted = true;
    let started = loop {
        let start = epb::StartRunRequest {
            run: Some(spec.clone()),
        };
        let attempt = tokio::select! {
            biased;
            () = lost.cancelled() => return Err(Stop::LeaseLost),
            r = measured(ctx, run, "StartRun", start, |r| executor.start_run(r)) => r,
        };
        match attempt {
            Ok(started) => break started,
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
    apply_status(ctx, run, progress, started.status.as_ref()).await?;
    // A previous drive may have cancelled it for its deadline, then died.
    let inferred = (Utc::now() >= deadline).then_some(CancelCause::Deadline);
    // Finished already (a fast run, or one that ended while no coordinator
    // watched): its events are still read into the run's log before it
    // ends; only if they cannot be read does the run end without them.
    let known_end = finished(started.status.as_ref(), inferred);

    let mut after = claimed.executor_seq;
    let mut cancel: Option<(CancelCause, tokio::time::Instant)> = None;
    // The usage the executor reported while this drive read its events.
    let mut spent = automesh_domain::Usage::default();
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
        // An update read while gathering events, to be handled next.
        let mut held: Option<epb::ObserveRunResponse> = None;
        loop {
            let cancel_deadline = cancel.map(|(_, at)| at + ctx.settings.cancel_bound);
            tokio::select! {
                item = async {
                    if let Some(update) = held.take() {
                        return Ok(Some(update));
                    }
                    match stream.as_mut() { Some(s) => s.message().await, None => Ok(None) }
                } => {
                    match item {
                        Ok(Some(update)) => {
                            backoff = Duration::from_millis(100);
                            match update.update {
                                Some(epb::observe_run_response::Update::Event(e)) => {
                                    // With the events the stream holds ready behind it: one write.
                                    let mut events = vec![e];
                                    while events.len() < RECORD_AT_ONCE
                                        && let Some(Ok(Some(next))) = stream.as_mut().and_then(|s| s.message().now_or_never())
                                    {
                                        match next.update {
                                            Some(epb::observe_run_response::Update::Event(e)) => events.push(e),
                                            _ => {
                                                held = Some(next);
                                                break;
                                            }
                                        }
                                    }
                                    record_events(ctx, run, &events).await?;
                                    // The budget per run, checked here too: an
                                    // executor whose engine ignores it (a
                                    // third-party runner) is stopped by the
                                    // coordinator, one event batch later.
                                    spent = spent_after(spent, &events);
                                    if cancel.is_none()
                                        && let Some(over) = run.budget.exceeded(&spent, ctx.price(run))
                                    {
                                        tracing::warn!(error_code = over.code.as_str(), "{}; cancelling the run on its executor", over.message);
                                        send_cancel(ctx, &mut executor, run, "over its budget per run").await;
                                        cancel = Some((CancelCause::Budget, tokio::time::Instant::now()));
                                    }
                                    after = events.iter().fold(after, |a, e| a.max(e.sequence));
                                    if !first_event {
                                        first_event = true;
                                        crate::metrics::metrics().first_event(run);
                                    }
                                }
                                Some(epb::observe_run_response::Update::Status(s)) => {
                                    ran |= ran_on_executor(Some(&s));
                                    unaccepted |= s.unaccepted;
                                    apply_status(ctx, run, progress, Some(&s)).await?;
                                    if let Some(ending) = finished(Some(&s), cancel.map(|c| c.0).or(inferred)) {
                                        return Ok(at_least(ending, spent));
                                    }
                                    if s.idle && let Some((cause, _)) = cancel {
                                        return Ok(at_least(offline_unless(ran, unaccepted, run.placement, cause, cancelled(cause, true)), spent));
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
                        return Ok(at_least(offline_unless(ran, unaccepted, run.placement, cause, cancelled(cause, idle)), spent));
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

/// Without an executor for its placement a run can only wait: for a
/// cancellation, or for its deadline.
pub(super) async fn wait_without_executor(
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
pub(super) async fn never_started(
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
pub(super) async fn cancel_and_wait(
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
        CancelCause::Budget => "over its budget per run",
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

pub(super) async fn send_cancel(
    ctx: &Context,
    executor: &mut ExecutorServiceClient<InternalChannel>,
    run: &Run,
    reason: &str,
) {
    let cancel = epb::CancelRunRequest {
        run_id: run.id.clone(),
        reason: reason.to_owned(),
    };
    let result = measured(ctx, run, "CancelRun", cancel, |r| executor.cancel_run(r)).await;
    if let Err(status) = result {
        tracing::warn!(code = ?status.code(), "executor did not take the cancellation; idleness decides");
    } else {
        tracing::info!(reason, "cancellation forwarded to the executor");
    }
}

pub(super) async fn status_of(
    ctx: &Context,
    executor: &mut ExecutorServiceClient<InternalChannel>,
    run: &Run,
) -> Option<epb::ExecutionStatus> {
    let get = epb::GetRunStatusRequest {
        run_id: run.id.clone(),
    };
    let result = measured(ctx, run, "GetRunStatus", get, |r| {
        executor.get_run_status(r)
    })
    .await;
    result.ok()?.status
}

/// When the run was admitted and started, as far as its drive knows: from
/// its claim, and from the moves its drive made since.
#[derive(Debug, Clone, Copy)]
pub(super) struct Progress {
    pub(super) admitted_at: Option<chrono::DateTime<Utc>>,
    pub(super) started_at: Option<chrono::DateTime<Utc>>,
    /// Whether an executor may have the run's message.
    pub(super) submitted: bool,
    /// Whether the run is known to be admitted (or past it), and running
    /// (or past it): a transition is attempted once, not on every status.
    admitted: bool,
    running: bool,
}

impl Progress {
    pub(super) fn of(claimed: &ClaimedRun) -> Self {
        Self {
            admitted_at: claimed.run.admitted_at,
            started_at: claimed.run.started_at,
            submitted: claimed.maybe_submitted,
            admitted: claimed.run.admitted_at.is_some() || claimed.run.started_at.is_some(),
            running: claimed.run.started_at.is_some(),
        }
    }
}

/// Moves the stored state forward to what the executor reports.
pub(super) async fn apply_status(
    ctx: &Context,
    run: &Run,
    progress: &mut Progress,
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
    // Only the moves not made yet: once attempted, the run is there or past
    // it (or ended), and asking again would only fail its guard.
    let targets: Vec<RunState> = targets
        .iter()
        .copied()
        .filter(|t| match t {
            RunState::Admitted => !progress.admitted,
            RunState::Running => !progress.running,
            _ => true,
        })
        .collect();
    if !targets.is_empty() {
        let now = Utc::now();
        let moves = ctx.store.advance_run(&run.id, &targets, now).await?;
        for t in &targets {
            match t {
                RunState::Admitted => progress.admitted = true,
                RunState::Running => progress.running = true,
                _ => {}
            }
        }
        for moved in moves {
            match moved {
                RunState::Admitted => progress.admitted_at = Some(now),
                RunState::Running => progress.started_at = Some(now),
                _ => {}
            }
        }
    }
    Ok(())
}

/// Events the executor reported, recorded in the run's log in order (in
/// one write), each priced and bounded; an event without an id is dropped.
pub(super) async fn record_events(
    ctx: &Context,
    run: &Run,
    events: &[automesh_proto::v1::RunEvent],
) -> Result<(), Stop> {
    let mut new = Vec::with_capacity(events.len());
    for e in events {
        let e = &e.clone().bounded();
        let Some(mut payload) = convert::event_payload_from_pb(e) else {
            continue;
        };
        if let RunEventPayload::Usage(usage) = &mut payload {
            *usage = priced(*usage, ctx.price(run));
        }
        if e.event_id.is_empty() {
            tracing::warn!("executor event without an id dropped");
            continue;
        }
        new.push(NewEvent {
            event_id: e.event_id.clone(),
            payload,
        });
    }
    if !new.is_empty() {
        ctx.store.append_events(&run.id, &new, Utc::now()).await?;
    }
    Ok(())
}

/// `ending`, charged at least the usage its events reported (`spent`): an
/// executor cancelled mid-run may report no usage in its outcome.
fn at_least(mut ending: Ending, spent: automesh_domain::Usage) -> Ending {
    ending.usage.input_tokens = ending.usage.input_tokens.max(spent.input_tokens);
    ending.usage.output_tokens = ending.usage.output_tokens.max(spent.output_tokens);
    ending
}

/// `spent` plus the usage `events` report.
fn spent_after(
    spent: automesh_domain::Usage,
    events: &[automesh_proto::v1::RunEvent],
) -> automesh_domain::Usage {
    events.iter().fold(spent, |total, e| match &e.payload {
        Some(automesh_proto::v1::run_event::Payload::Usage(u)) => automesh_domain::Usage {
            input_tokens: total.input_tokens.saturating_add(u.input_tokens.max(0)),
            output_tokens: total.output_tokens.saturating_add(u.output_tokens.max(0)),
            cost_micros: total.cost_micros,
        },
        _ => total,
    })
}

/// The most ready events recorded in one write.
const RECORD_AT_ONCE: usize = 256;

/// One unary executor call for `run`: bounded by the call timeout, its
/// duration and result measured (`automesh.executor.call.*`).
async fn measured<Req, Resp, Answer>(
    ctx: &Context,
    run: &Run,
    method: &'static str,
    message: Req,
    call: impl FnOnce(tonic::Request<Req>) -> Answer,
) -> Result<Resp, tonic::Status>
where
    Answer: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
{
    let mut request = tonic::Request::new(message);
    request.set_timeout(ctx.settings.call_timeout);
    let called = std::time::Instant::now();
    let result = call(request).await;
    let outcome = result.as_ref().map(|_| ()).map_err(tonic::Status::code);
    crate::metrics::metrics().call(run, method, called, outcome);
    result.map(tonic::Response::into_inner)
}
