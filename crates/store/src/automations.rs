//! Queries of the `automations` aggregate.

use std::collections::HashMap;

use automesh_domain::automation::{Automation, FailureStreak, NewAutomation};
use automesh_domain::schedule::{Schedule, ScheduleRecord};
use automesh_domain::{
    Attention, AutomationState, ErrorCode, Notice, Principal, Receipt, Run, RunState,
};
use chrono::{DateTime, Utc};
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use const_format::concatcp;

use crate::page::{Cursor, Page};
use crate::rows::{self, col, micros, opt_micros};
use crate::runs::IdRow;
use crate::sql::{Bulk, bulk};
use crate::{Result, Store, StoreError};

/// The columns every automation query reads, in `decode`'s terms.
pub(crate) const AUTOMATION_COLUMNS: &str = "id, org_id, owner_id, name, prompt, model, placement, \
     surface, schedule, state, attention_reason, attention_message, pause_reason, version, \
     next_run_at, created_at, updated_at, pause_after_failures, failure_streak, streak_codes, \
     max_cost_micros, max_tokens, monthly_budget_micros";

const INSERT: &str = "INSERT INTO automations (id, org_id, owner_id, name, prompt, model, placement, \
     surface, schedule, state, attention_reason, attention_message, version, next_run_at, \
     created_at, updated_at, pause_after_failures, max_cost_micros, max_tokens, \
     monthly_budget_micros) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'active', NULL, NULL, 1, $10, $11, $11, $12, $13, \
     $14, $15)";

const GET: &str = concatcp!(
    "SELECT ",
    AUTOMATION_COLUMNS,
    " FROM automations WHERE id = $1 AND org_id = $2 AND owner_id = $3"
);

const GET_UNSCOPED: &str = concatcp!(
    "SELECT ",
    AUTOMATION_COLUMNS,
    " FROM automations WHERE id = $1"
);

/// A page of an owner's automations (`$1`..`$5`), `$6` rows at most.
const PAGE: &str = "FROM automations a \
     WHERE a.org_id = $1 AND a.owner_id = $2 \
       AND (a.created_at, a.id) < ($3, $4) \
       AND ($5 = 1 OR a.state <> 'archived') \
     ORDER BY a.created_at DESC, a.id DESC LIMIT $6";

const LIST: &str = concatcp!("SELECT ", AUTOMATION_COLUMNS, " ", PAGE);

/// The newest run of each automation of a [`LIST`] page (same parameters).
const LAST_RUN_IDS: &str = concatcp!(
    "SELECT (SELECT r.id FROM runs r WHERE r.automation_id = a.id \
     ORDER BY r.created_at DESC, r.id DESC LIMIT 1) ",
    PAGE
);

const LAST_RUNS: &str = concatcp!(
    "SELECT ",
    crate::runs::RUN_COLUMNS,
    " FROM runs WHERE id IN (",
    LAST_RUN_IDS,
    ")"
);

const LAST_RECEIPTS: &str = concatcp!(
    "SELECT ",
    crate::receipts::RECEIPT_COLUMNS,
    " FROM receipts WHERE run_id IN (",
    LAST_RUN_IDS,
    ")"
);

/// Placement, surface, owner and creation time are absent: they never change.
const UPDATE_IF_VERSION: &str = "UPDATE automations SET name = $4, prompt = $5, model = $6, \
     schedule = $7, state = $8, attention_reason = $9, attention_message = $10, \
     next_run_at = $11, updated_at = $12, pause_reason = $14, pause_after_failures = $15, \
     failure_streak = $16, streak_codes = $17, max_cost_micros = $18, max_tokens = $19, \
     monthly_budget_micros = $20, version = version + 1 \
     WHERE id = $1 AND org_id = $2 AND owner_id = $3 AND version = $13";

/// PostgreSQL: the automations a batch's ended runs move, locked in one
/// order (`$1`, a JSON array of ids), after the batch's runs: batches that
/// end runs of crossing sets of automations queue instead of deadlocking.
/// `NO KEY UPDATE`, so that a scheduler inserting a run of one (whose
/// foreign key takes a key-share lock) never waits for it.
pub(crate) const LOCK_AUTOMATIONS_PG: &str = "SELECT id FROM automations \
     WHERE id IN (SELECT value FROM json_array_elements_text($1::json)) \
     ORDER BY id COLLATE \"C\" FOR NO KEY UPDATE";

/// The automations of a batch's ended runs, read in its transaction.
const STANDINGS: Bulk<IdRow> = bulk!(IdRow => [
    "SELECT ", AUTOMATION_COLUMNS, " FROM automations WHERE id IN (SELECT i.id FROM "
] [
    ")"
]);

bulk! {
    /// What runs' ends made of an automation: its state, why it needs
    /// attention, its next occurrence and its failure streak.
    struct StandingRow {
        id: String => TEXT,
        state: &'static str => TEXT,
        attention_reason: Option<&'static str> => TEXT,
        attention_message: Option<String> => TEXT,
        next_run_at: Option<i64> => BIGINT,
        failure_streak: i64 => BIGINT,
        streak_codes: String => TEXT,
        at: i64 => BIGINT,
    }
}

/// Automations moved by their runs' ends (read and locked in the same
/// transaction, so no guard but the id is needed).
const STAND: Bulk<StandingRow> = bulk!(StandingRow => [
    "UPDATE automations SET state = i.state, attention_reason = i.attention_reason, \
     attention_message = i.attention_message, next_run_at = i.next_run_at, \
     failure_streak = i.failure_streak, streak_codes = i.streak_codes, updated_at = i.at, \
     version = automations.version + 1 FROM "
] [
    " WHERE automations.id = i.id"
]);

pub(crate) fn decode(row: &AnyRow) -> Result<Automation> {
    let reason: Option<ErrorCode> = col(row, "attention_reason")?;
    let message: Option<String> = col(row, "attention_message")?;
    let attention = reason.map(|reason| Attention {
        reason,
        message: message.unwrap_or_default(),
    });
    let pause_after_failures: i64 = col(row, "pause_after_failures")?;
    let pause_after_failures = u32::try_from(pause_after_failures)
        .map_err(|_| StoreError::Corrupt(format!("pause_after_failures={pause_after_failures}")))?;
    let codes: String = col(row, "streak_codes")?;
    let failure_streak = FailureStreak {
        runs: col(row, "failure_streak")?,
        codes: serde_json::from_str(&codes)
            .map_err(|e| StoreError::Corrupt(format!("streak_codes: {e}")))?,
    };
    let budget = rows::budget(row)?;
    rows::columns! { row => Automation {
        id, org_id, owner_id, name, prompt, model, placement, surface, schedule, state, version,
        next_run_at, created_at, updated_at, pause_reason, monthly_budget_micros;
        attention, pause_after_failures, failure_streak, budget
    } }
}

fn codes_json(streak: &FailureStreak) -> String {
    // A list of strings always serialises.
    serde_json::to_string(&streak.codes).unwrap_or_else(|_| "[]".into())
}

/// A run's end, as it bears on its automation.
#[derive(Debug, Clone)]
pub(crate) struct RunEnd<'a> {
    pub(crate) run_id: &'a str,
    pub(crate) automation_id: &'a str,
    pub(crate) outcome: RunState,
    pub(crate) code: Option<ErrorCode>,
    pub(crate) message: Option<&'a str>,
}

/// What runs' ends do to their automations, in the transaction that ends
/// them (after the runs' rows are locked): each automation is locked and
/// read, moved by its runs' ends in the order given
/// ([`Automation::after_run`]), and written once if they changed it. The
/// automations as they stand after, by id; each with whether it changed.
pub(crate) async fn after_runs(
    db: &mut AnyConnection,
    ends: &[RunEnd<'_>],
    now: DateTime<Utc>,
) -> Result<HashMap<String, (Automation, bool)>> {
    if ends.is_empty() {
        return Ok(HashMap::new());
    }
    let mut ids: Vec<&str> = ends.iter().map(|e| e.automation_id).collect();
    ids.sort_unstable();
    ids.dedup();
    if rows::is_postgres(db) {
        let json = serde_json::to_string(&ids)
            .map_err(|e| StoreError::Corrupt(format!("automation ids: {e}")))?;
        crate::writer::counted();
        rows::execute(&mut *db, LOCK_AUTOMATIONS_PG, (json,)).await?;
    }
    let ids: Vec<IdRow> = ids.iter().map(|id| IdRow::of(id)).collect();
    let read = STANDINGS.all(&mut *db, &ids, |r| {
        let a = decode(r)?;
        Ok((a.id.clone(), (a, false)))
    });
    let mut standing: HashMap<String, (Automation, bool)> = read.await?.into_iter().collect();
    // What the owner is told, in this transaction: the first failure of a
    // streak, and a move to needs-attention (one per streak).
    let mut notices = vec![];
    for end in ends {
        if let Some((a, changed)) = standing.get_mut(end.automation_id) {
            let (was, streak) = (a.state, a.failure_streak.runs);
            *changed |= a.after_run(end.outcome, end.code, end.message, now);
            if streak == 0 && matches!(end.outcome, RunState::Failed | RunState::TimedOut) {
                let (id, code, message) = (end.run_id, end.code, end.message);
                notices.push(Notice::run_failed(a, id, end.outcome, code, message, now));
            }
            if was != a.state && a.state == AutomationState::NeedsAttention {
                notices.push(Notice::needs_attention(a, end.run_id, now));
            }
        }
    }
    let moved: Vec<StandingRow> = standing
        .values()
        .filter(|(_, changed)| *changed)
        .map(|(a, _)| StandingRow::of(a, now))
        .collect();
    STAND.execute(&mut *db, &moved).await?;
    crate::notifications::enqueue(&mut *db, &notices).await?;
    Ok(standing)
}

/// Writes what `moved` automations now are (state, attention, next
/// occurrence, failure streak), each a new version; the caller holds
/// their rows (a scheduling transaction's claim).
pub(crate) async fn stand(
    db: &mut AnyConnection,
    moved: &[&Automation],
    now: DateTime<Utc>,
) -> Result<()> {
    let rows: Vec<StandingRow> = moved.iter().map(|a| StandingRow::of(a, now)).collect();
    STAND.execute(db, &rows).await?;
    Ok(())
}

impl StandingRow {
    fn of(a: &Automation, now: DateTime<Utc>) -> StandingRow {
        StandingRow {
            id: a.id.clone(),
            state: a.state.as_str(),
            attention_reason: a.attention.as_ref().map(|x| x.reason.as_str()),
            attention_message: a.attention.as_ref().map(|x| x.message.clone()),
            next_run_at: opt_micros(a.next_run_at),
            failure_streak: a.failure_streak.runs,
            streak_codes: codes_json(&a.failure_streak),
            at: micros(now),
        }
    }
}

/// What the runs of an automation created in `[$2, $3)` cost together:
/// the sum of their receipts (a run without one yet adds nothing). The
/// index `runs_by_automation` bounds it to those runs, however many the
/// automation has.
const MONTH_SPEND: &str = "SELECT CAST(COALESCE(SUM(rc.cost_micros), 0) AS BIGINT) AS spent \
     FROM runs r JOIN receipts rc ON rc.run_id = r.id \
     WHERE r.automation_id = $1 AND r.created_at >= $2 AND r.created_at < $3";

/// [`MONTH_SPEND`] on `db`.
pub(crate) async fn month_spend(
    db: &mut AnyConnection,
    automation_id: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<i64> {
    let params = (automation_id, micros(from), micros(to));
    let spent = rows::optional(db, MONTH_SPEND, params, |r| col::<i64>(r, "spent"));
    Ok(spent.await?.unwrap_or(0))
}

/// Automations paused because their monthly budget is spent (the
/// scheduler's month sweep), `$1` at most.
const BUDGET_SPENT: &str = concatcp!(
    "SELECT ",
    AUTOMATION_COLUMNS,
    " FROM automations WHERE attention_reason = 'budget_exhausted' \
     AND state = 'needs_attention' ORDER BY id LIMIT $1"
);

fn schedule_json(s: &Schedule) -> String {
    // Serialising a plain enum of strings and integers cannot fail.
    serde_json::to_string(&ScheduleRecord::from(s)).unwrap_or_default()
}

impl Store {
    /// Inserts a new automation, active, at version 1.
    pub async fn create_automation(
        &self,
        new: &NewAutomation,
        next_run_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<Automation> {
        crate::error::storable(&[
            ("id", &new.id),
            ("name", &new.name),
            ("prompt", &new.prompt),
            ("model", &new.model),
        ])?;
        let params = (
            &new.id,
            &new.owner.org_id,
            &new.owner.user_id,
            &new.name,
            &new.prompt,
            &new.model,
            new.placement().as_str(),
            new.surface.as_str(),
            schedule_json(&new.schedule),
            opt_micros(next_run_at),
            micros(now),
            i64::from(new.pause_after_failures),
            new.budget.max_cost_micros,
            new.budget.max_tokens,
            new.monthly_budget_micros,
        );
        rows::execute(self.db(), INSERT, params).await?;
        self.internal().get_automation(&new.id).await
    }

    /// One automation of `owner`; another tenant's answers `NotFound`.
    pub async fn get_automation(&self, owner: &Principal, id: &str) -> Result<Automation> {
        rows::owned(self.db(), GET, owner, id, decode).await
    }

    /// A page of `owner`'s automations, newest first.
    pub async fn list_automations(
        &self,
        owner: &Principal,
        after: &Cursor,
        limit: u32,
        show_archived: bool,
    ) -> Result<Page<Automation>> {
        let params = (
            &owner.org_id,
            &owner.user_id,
            after.created_micros,
            &after.id,
            i64::from(show_archived),
        );
        rows::page(self.db(), LIST, params, limit, decode).await
    }

    /// The newest run of each automation on the page
    /// [`list_automations`](Self::list_automations) answers for the same
    /// arguments, with its receipt once it ended: two queries, whatever the
    /// page's size.
    pub async fn last_runs_of_page(
        &self,
        owner: &Principal,
        after: &Cursor,
        limit: u32,
        show_archived: bool,
    ) -> Result<Vec<(Run, Option<Receipt>)>> {
        let params = || {
            (
                &owner.org_id,
                &owner.user_id,
                after.created_micros,
                &after.id,
                i64::from(show_archived),
                i64::from(limit) + 1,
            )
        };
        let runs = rows::all(self.db(), LAST_RUNS, params(), crate::runs::decode).await?;
        let receipts = rows::all(self.db(), LAST_RECEIPTS, params(), crate::receipts::decode);
        let mut receipts: std::collections::HashMap<String, Receipt> = receipts
            .await?
            .into_iter()
            .map(|r| (r.run_id.clone(), r))
            .collect();
        Ok(runs
            .into_iter()
            .map(|run| {
                let receipt = receipts.remove(&run.id);
                (run, receipt)
            })
            .collect())
    }

    /// Writes the mutable fields of `updated` if the stored version is still
    /// `expected_version`, and returns the stored result. Placement, surface,
    /// owner and creation time are never written.
    pub async fn update_automation_if_version(
        &self,
        updated: &Automation,
        expected_version: i64,
        now: DateTime<Utc>,
    ) -> Result<Automation> {
        let (name, prompt, model) = (&updated.name, &updated.prompt, &updated.model);
        let reason = updated.pause_reason.as_deref().unwrap_or_default();
        crate::error::storable(&[
            ("name", name),
            ("prompt", prompt),
            ("model", model),
            ("pause reason", reason),
        ])?;
        let params = (
            &updated.id,
            &updated.org_id,
            &updated.owner_id,
            &updated.name,
            &updated.prompt,
            &updated.model,
            schedule_json(&updated.schedule),
            updated.state.as_str(),
            updated.attention.as_ref().map(|x| x.reason.as_str()),
            updated.attention.as_ref().map(|x| x.message.as_str()),
            opt_micros(updated.next_run_at),
            micros(now),
            expected_version,
            updated.pause_reason.as_deref(),
            i64::from(updated.pause_after_failures),
            updated.failure_streak.runs,
            codes_json(&updated.failure_streak),
            updated.budget.max_cost_micros,
            updated.budget.max_tokens,
            updated.monthly_budget_micros,
        );
        let written = rows::changed_one(self.db(), UPDATE_IF_VERSION, params).await?;
        let owner = Principal::new(&updated.org_id, &updated.owner_id);
        let stored = self.get_automation(&owner, &updated.id).await?;
        if written {
            Ok(stored)
        } else {
            Err(StoreError::VersionConflict {
                current: stored.version,
            })
        }
    }
}

impl crate::Internal<'_> {
    /// One automation by id, for internal callers that act for no user.
    pub async fn get_automation(self, id: &str) -> Result<Automation> {
        rows::by_id(self.db(), GET_UNSCOPED, id, decode).await
    }

    /// What the runs of `automation_id` created in `[from, to)` cost
    /// together, by their receipts (micro-units).
    pub async fn month_spend(
        self,
        automation_id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<i64> {
        let mut db = self.db().acquire().await?;
        month_spend(&mut db, automation_id, from, to).await
    }

    /// Up to `limit` automations paused because their monthly budget is
    /// spent, in id order.
    pub async fn budget_spent(self, limit: u32) -> Result<Vec<Automation>> {
        rows::all(self.db(), BUDGET_SPENT, (i64::from(limit),), decode).await
    }
}
