//! Recording the end: the terminal state, the receipt (charged at the
//! run's price), the terminal event and what the outcome means for the
//! automation (its failure streak, needs attention, or healthy again) in
//! one transaction.

use automesh_domain::{Price, Receipt, Run, RunState, Usage};
use automesh_store::StoreError;
use chrono::{DateTime, Utc};

use super::Context;
use super::ending::Ending;
use super::execute::Progress;

/// `usage` as the mesh charges it: the executor's tokens at the run's
/// price (0 for an unpriced model), whatever cost the engine reported.
pub(super) fn priced(usage: Usage, price: Option<Price>) -> Usage {
    Usage {
        cost_micros: price.map_or(0, |p| {
            p.cost_micros(usage.input_tokens, usage.output_tokens)
        }),
        ..usage
    }
}

pub(super) fn micros_between(from: Option<DateTime<Utc>>, to: DateTime<Utc>) -> i64 {
    from.map_or(0, |f| (to - f).num_microseconds().unwrap_or(0).max(0))
}

/// Records the end: the terminal state, the receipt, the terminal status
/// event and what the outcome means for the automation, in one transaction.
pub(super) async fn finish(
    ctx: &Context,
    run: &Run,
    ending: Ending,
    progress: Progress,
) -> Result<(), StoreError> {
    let now = Utc::now();
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
        // From the later of its creation and its instant: a run created
        // ahead of its instant was not queued while it waited for it.
        queued_micros: micros_between(
            Some(crate::metrics::due(run)),
            progress.admitted_at.unwrap_or(now),
        ),
        wake_micros: ending.wake_micros,
        admission_micros: ending.admission_micros,
        execution_micros: micros_between(progress.started_at.or(progress.admitted_at), now),
        usage: ending.usage,
        worker_id: some(thread.worker_id),
        workspace_id: some(thread.workspace_id),
        thread_id: some(thread.thread_id),
        message_id: some(thread.message_id)
            .or_else(|| progress.submitted.then(|| run.message_id.clone()).flatten()),
        created_at: now,
        model: some(run.model.clone()),
        provider_model: ctx.model(run).map(|m| m.provider_model().to_owned()),
        price,
        budget: run.budget,
    };
    let after = match ctx.store.finish_run_as(&receipt, &ctx.owner, now).await {
        Ok(after) => {
            automesh_rpc::process::failpoint("coordinator.after_finish");
            crate::metrics::metrics().ended(run, ending.state, ending.code, &ending.usage);
            after
        }
        // Already terminal (another path ended it): nothing more to do.
        Err(StoreError::IllegalTransition { .. }) => return Ok(()),
        Err(e) => return Err(e),
    };
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
    tracing::info!(
        state = %ending.state,
        error_code = code,
        failure_streak = after.failure_streak,
        "run ended"
    );
    // What the end did to the automation, committed with it.
    span.record("automation.failure_streak", after.failure_streak);
    if let Some(reason) = after.paused {
        span.record("automation.attention", reason.as_str());
        crate::metrics::metrics().attention(Some(reason));
        tracing::warn!(
            automation_id = %run.automation_id,
            reason = %reason,
            failure_streak = after.failure_streak,
            "automation needs attention: its schedule is paused"
        );
    } else if after.resumed {
        crate::metrics::metrics().attention(None);
        tracing::info!(automation_id = %run.automation_id, "automation active again after a successful run");
    }
    Ok(())
}
