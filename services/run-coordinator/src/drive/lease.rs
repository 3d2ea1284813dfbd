//! One drive per claimed run: the run's span, its lease heartbeat (a
//! drive never outlives its lease), the hold of a run claimed ahead of its
//! instant, and the hand-over to `execute`.

use std::sync::Arc;

use automesh_domain::Run;
use automesh_store::leases::{ClaimedRun, Renewal};
use automesh_telemetry::propagation;
use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::claim::Registration;
use super::execute::{Progress, execute};
use super::outcome::finish;
use super::{Context, Stop};

pub(super) async fn drive(ctx: Arc<Context>, claimed: ClaimedRun) {
    let run = claimed.run.clone();
    let span = tracing::info_span!(
        parent: None,
        "automesh.run",
        run_id = %run.id,
        automation_id = %run.automation_id,
        placement = %run.placement,
        claim = claimed.claims,
        held_us = tracing::field::Empty,
        outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
        budget.max_cost_micros = run.budget.max_cost_micros,
        budget.max_tokens = run.budget.max_tokens,
        automation.failure_streak = tracing::field::Empty,
        automation.attention = tracing::field::Empty,
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
    ctx.active
        .lock()
        .insert(run.id.clone(), cancel_seen.clone());
    let _registration = Registration {
        ctx: &ctx,
        run_id: run.id.clone(),
    };
    // Dies with the drive, however the drive ends: a heartbeat that
    // outlived a killed drive would keep the run from being taken over.
    let heartbeat = AbortOnDrop(tokio::spawn(
        heartbeat(ctx.clone(), run.clone(), lost.clone(), cancel_seen.clone()).in_current_span(),
    ));
    hold(&run, &span).await;
    let mut progress = Progress::of(&claimed);
    let result = execute(&ctx, &claimed, &mut progress, &lost, &cancel_seen)
        .instrument(span.clone())
        .await;
    drop(heartbeat);
    // Instrumented, never `span.enter()` across an await: a guard held over
    // an await point can be dropped on another thread and corrupt the
    // subscriber's span registry.
    async {
        match result {
            Ok(ending) => {
                if let Err(error) = finish(&ctx, &run, ending, progress).await {
                    tracing::warn!(%error, "cannot record the run's end; it will be retried after the lease");
                }
            }
            Err(Stop::LeaseLost) => tracing::warn!("lease lost; another coordinator has the run"),
            Err(Stop::Store(error)) => {
                tracing::warn!(%error, "drive stopped on a store error; retried after the lease")
            }
        }
    }
    .instrument(span)
    .await;
}

/// Holds a run claimed ahead of its instant ([`CLAIM_AHEAD`]) until the
/// instant, so that nothing reaches its executor before it; bounded by the
/// run's deadline, the bound of everything a run waits for. How long it
/// held is the span's `held_us`. A cancellation requested meanwhile is
/// seen by `execute` right after.
///
/// [`CLAIM_AHEAD`]: automesh_store::leases::CLAIM_AHEAD
async fn hold(run: &Run, span: &tracing::Span) {
    let Some(at) = run.scheduled_for else {
        return;
    };
    let ahead = (at.min(run.deadline_at) - Utc::now())
        .to_std()
        .unwrap_or_default();
    if !ahead.is_zero() {
        span.record("held_us", ahead.as_micros() as u64);
        automesh_rpc::precise::sleep_precisely(ahead).await;
    }
}

/// Aborts its task when dropped.
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews the lease every third of its length; cancels `lost` when it is
/// lost or cannot be renewed before it expires.
pub(super) async fn heartbeat(
    ctx: Arc<Context>,
    run: Run,
    lost: CancellationToken,
    cancel_seen: CancellationToken,
) {
    let lease = ctx.settings.lease;
    let every = lease / 3;
    // The lease is ours until `valid_until`, counted from when the last
    // successful renewal was sent: a drive never outlives its lease.
    let mut valid_until = tokio::time::Instant::now() + lease;
    // A drive that is stuck somewhere gets no renewals past this point,
    // so another coordinator can take the run and end it.
    let stop_renewing = run.deadline_at
        + chrono::Duration::from_std(ctx.settings.cancel_bound * 2 + lease).unwrap_or_default();
    loop {
        let wake = (tokio::time::Instant::now() + every).min(valid_until - every / 2);
        tokio::time::sleep_until(wake).await;
        if Utc::now() > stop_renewing {
            tracing::warn!("drive still busy well past the run's deadline; letting the lease go");
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
