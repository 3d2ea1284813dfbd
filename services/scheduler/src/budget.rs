//! Monthly budgets in the scheduler: an occurrence of an automation whose
//! month is spent is recorded skipped (`budget_exhausted`) and the
//! automation paused, in the pass's transaction; the month sweep makes such
//! automations active again once their month is over.

use std::time::Duration;

use automesh_domain::automation::month_of;
use automesh_domain::ids::scheduled_run_id;
use automesh_domain::{Automation, ErrorCode, Notice, RunState};
use automesh_store::scheduling::SchedulingTx;
use automesh_store::{Store, StoreError};
use chrono::{DateTime, Utc};

use crate::metrics::Created;
use crate::occurrences::record_terminal;

/// Whether the occurrence of `a` at `at` finds its month's budget spent:
/// then it is recorded skipped, with `budget_exhausted` on its receipt, and
/// the automation needs attention, its schedule paused (all in `tx`).
pub(crate) async fn skipped_for_budget(
    tx: &mut SchedulingTx,
    a: &Automation,
    at: DateTime<Utc>,
    now: DateTime<Utc>,
    created: &mut Vec<Created>,
) -> Result<bool, StoreError> {
    if a.monthly_budget_micros.is_none() {
        return Ok(false);
    }
    // The month the occurrence falls in, in the schedule's zone.
    let (from, to) = month_of(at, a.schedule.zone());
    let spent = tx.month_spend(&a.id, from, to).await?;
    if !a.month_spent(spent) {
        return Ok(false);
    }
    let why = format!(
        "this month's runs cost {spent} micro-units, the monthly budget is {}",
        a.monthly_budget_micros.unwrap_or_default()
    );
    let skipped = (RunState::Skipped, ErrorCode::BudgetExhausted, why.as_str());
    record_terminal(tx, a, at, now, skipped, created).await?;
    let mut paused = a.clone();
    if paused.exhaust_budget(spent, now) {
        tx.stand(&[&paused], now).await?;
        let run_id = scheduled_run_id(&a.id, at);
        tx.notify(&[Notice::budget_reached(&paused, &run_id, spent, now)])
            .await?;
    } else {
        // Not active (never so for a due automation): it moves on to its
        // next occurrence rather than staying due.
        let next = a.schedule.next_after(at);
        tx.advance(&a.id, next, now).await?;
    }
    tracing::warn!(automation_id = %a.id, scheduled_for = %at, spent, "occurrence skipped: the monthly budget is spent; the automation needs attention");
    Ok(true)
}

/// How often the loop looks for automations whose spent month is over.
pub(crate) const MONTH_SWEEP: Duration = Duration::from_secs(60);

/// Automations paused for a spent monthly budget whose month is over (its
/// spend in the current month is under the budget) are active again, from
/// their first occurrence of the new month: an occurrence at the month's
/// first instant fires, late by at most a sweep, not lost. How many.
pub async fn resume_spent_months(store: &Store, now: DateTime<Utc>) -> Result<usize, StoreError> {
    let mut resumed = 0;
    for a in store.internal().budget_spent(SWEEP_LIMIT).await? {
        let (month, _) = month_of(now, a.schedule.zone());
        let spent = store.internal().month_spend(&a.id, month, now).await?;
        let mut next = a.clone();
        if a.month_spent(spent) || !next.resume_budget(month) {
            continue;
        }
        match store
            .update_automation_if_version(&next, a.version, now)
            .await
        {
            Ok(_) => {
                resumed += 1;
                tracing::info!(automation_id = %a.id, "a new month: the automation paused for its spent budget is active again");
            }
            // Changed meanwhile: the next sweep looks again.
            Err(StoreError::VersionConflict { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(resumed)
}

/// The most automations one month sweep resumes.
const SWEEP_LIMIT: u32 = 500;
