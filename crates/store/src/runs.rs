//! Queries of the `runs` aggregate: creation (idempotent by derived id),
//! scoped reads, and guarded state transitions.

use automesh_domain::run::NewRun;
use automesh_domain::{ErrorCode, Principal, QuarterUsage, Run, RunState};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::page::{Cursor, Page};
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use crate::rows::{self, col, micros};
use crate::writer::{Joined, Joint, Row};
use crate::{Result, Store, StoreError};

/// The columns every run query reads, in `decode`'s terms.
macro_rules! run_columns {
    () => {
        "id, automation_id, org_id, owner_id, placement, trigger, scheduled_for, idempotency_key, \
         prompt, model, state, error_code, error_message, deadline_at, traceparent, message_id, \
         cancel_requested_at, admitted_at, started_at, created_at, updated_at"
    };
}
pub(crate) use run_columns;

/// The states of a live run, as an SQL list: named once, for every query
/// that must only touch live runs (a unit test keeps it equal to the
/// domain's non-terminal states).
macro_rules! live_states {
    () => {
        "('pending', 'waking', 'admitted', 'running')"
    };
}
pub(crate) use live_states;

/// The columns a run's insert sets, and their values (`$1`..`$16`, see
/// [`insert_run_params`]).
macro_rules! insert_run_into {
    () => {
        "INSERT INTO runs (id, automation_id, org_id, owner_id, placement, trigger, \
         scheduled_for, idempotency_key, prompt, model, state, error_code, error_message, \
         deadline_at, traceparent, created_at, updated_at)"
    };
}
macro_rules! insert_run_values {
    () => {
        "$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $16"
    };
}
pub(crate) use {insert_run_into, insert_run_values};

/// A run's insert, unless its id exists.
macro_rules! insert_run_sql {
    () => {
        concat!(
            $crate::runs::insert_run_into!(),
            " VALUES (",
            $crate::runs::insert_run_values!(),
            ") ON CONFLICT (id) DO NOTHING"
        )
    };
}
pub(crate) use insert_run_sql;

const INSERT: &str = insert_run_sql!();

/// PostgreSQL: a run created unless its id exists, in one statement that
/// also wakes the coordinators at commit when the run is live (`$17` = 1);
/// how many it created.
const CREATE_PG: &str = concat!(
    "WITH created AS (",
    insert_run_sql!(),
    " RETURNING id) \
     SELECT (SELECT COUNT(*) FROM created) AS created, \
     (SELECT COUNT(*) FROM (SELECT pg_notify('automesh_runs', $18) FROM created WHERE $17 = 1) w) \
     AS woken"
);

const GET_UNSCOPED: &str = rows::select!(run_columns, "FROM runs WHERE id = $1");

const GET: &str = rows::select!(
    run_columns,
    "FROM runs WHERE id = $1 AND org_id = $2 AND owner_id = $3"
);

/// A page of an owner's runs, narrowed (`$1`..`$8`, see
/// [`Store::list_runs`]), `$9` rows at most.
macro_rules! run_page {
    () => {
        "FROM runs \
         WHERE org_id = $1 AND owner_id = $2 AND ($3 = '' OR automation_id = $3) \
           AND (created_at < $4 OR (created_at = $4 AND id < $5)) \
           AND ($6 = '' OR (',' || $6 || ',') LIKE ('%,' || state || ',%')) \
           AND created_at >= $7 AND created_at < $8 \
         ORDER BY created_at DESC, id DESC LIMIT $9"
    };
}

const LIST: &str = concat!("SELECT ", run_columns!(), " ", run_page!());

/// The receipts of the runs of a [`LIST`] page (same parameters).
const LIST_RECEIPTS: &str = concat!(
    "SELECT ",
    crate::receipts::receipt_columns!(),
    " FROM receipts WHERE run_id IN (SELECT id ",
    run_page!(),
    ")"
);

/// An automation's newest run (the index `runs_by_automation` serves it).
const LAST: &str = rows::select!(
    run_columns,
    "FROM runs WHERE automation_id = $1 AND org_id = $2 AND owner_id = $3 \
     ORDER BY created_at DESC, id DESC LIMIT 1"
);

/// The usage on the receipts of an owner's runs created in `[$4, $5)`, per
/// quarter hour since the epoch (every zone's day starts on one): what a
/// period's totals and its days in any zone are summed from.
const USAGE: &str = "SELECT r.created_at / 900000000 AS quarter, COUNT(*) AS runs, \
     CAST(SUM(c.input_tokens) AS BIGINT) AS input_tokens, \
     CAST(SUM(c.output_tokens) AS BIGINT) AS output_tokens, \
     CAST(SUM(c.cost_micros) AS BIGINT) AS cost_micros \
     FROM runs r JOIN receipts c ON c.run_id = r.id \
     WHERE r.org_id = $1 AND r.owner_id = $2 AND ($3 = '' OR r.automation_id = $3) \
       AND r.created_at >= $4 AND r.created_at < $5 \
     GROUP BY r.created_at / 900000000 ORDER BY quarter";

/// A live run's end (its receipt is written in the same transaction,
/// `receipts.rs`); `$6` is the lease owner the end is fenced by, or empty
/// for an end no lease fences. It takes the sequence number of the run's
/// terminal event. Every write of a run's state is in this module: this,
/// [`TRANSITION`], [`ADVANCE`] and the creation.
pub(crate) const END: &str = concat!(
    "UPDATE runs SET state = $2, error_code = $3, error_message = $4, \
     updated_at = $5, last_event_seq = last_event_seq + 1 WHERE id = $1 AND state IN ",
    live_states!(),
    " AND ($6 = '' OR lease_owner = $6) RETURNING last_event_seq, automation_id"
);

/// [`END`], the run's receipt and its terminal event in one statement
/// (PostgreSQL), answering with the state of the run's automation: `$7`
/// .. `$24` the receipt's columns after its outcome and error, `$25`..`$27`
/// the event's id, kind and payload.
pub(crate) const END_PG: &str = concat!(
    "WITH ended AS (UPDATE runs SET state = $2, error_code = $3, error_message = $4, \
     updated_at = $5, last_event_seq = last_event_seq + 1 WHERE id = $1 AND state IN ",
    live_states!(),
    " AND ($6 = '' OR lease_owner = $6) RETURNING id, last_event_seq, automation_id), \
     receipt AS (INSERT INTO receipts (run_id, outcome, error_code, error_message, placement, \
       engine, queued_us, wake_us, admission_us, execution_us, input_tokens, output_tokens, \
       cost_micros, worker_id, workspace_id, thread_id, message_id, created_at, model, \
       provider_model, price_input_micros_per_mtok, price_output_micros_per_mtok) \
       SELECT id, $2, $3, $4, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, \
       $20, $21, $22, $23, $24 FROM ended ON CONFLICT (run_id) DO NOTHING) \
     INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
     SELECT id, last_event_seq, $25, $26, $27, $20 FROM ended \
     RETURNING (SELECT a.state FROM automations a, ended e WHERE a.id = e.automation_id) \
       AS automation_state"
);

/// `$5` is a comma-framed list of the states the run may move from, such as
/// `,pending,waking,`: one static query for every transition on both backends.
const TRANSITION: &str = "UPDATE runs SET state = $2, error_code = $3, error_message = $4, \
     updated_at = $6, \
     admitted_at = CASE WHEN $2 = 'admitted' THEN $6 ELSE admitted_at END, \
     started_at = CASE WHEN $2 = 'running' THEN $6 ELSE started_at END \
     WHERE id = $1 AND $5 LIKE '%,' || state || ',%'";

/// [`ADVANCE`] and the status event it takes the number of, in one
/// statement (PostgreSQL): `$5`..`$7` the event's id, kind and payload.
const ADVANCE_PG: &str = "WITH moved AS (UPDATE runs SET state = $2, updated_at = $4, \
     admitted_at = CASE WHEN $2 = 'admitted' THEN $4 ELSE admitted_at END, \
     started_at = CASE WHEN $2 = 'running' THEN $4 ELSE started_at END, \
     last_event_seq = last_event_seq + 1 \
     WHERE id = $1 AND $3 LIKE '%,' || state || ',%' RETURNING id, last_event_seq) \
     INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
     SELECT id, last_event_seq, $5, $6, $7, $4 FROM moved RETURNING seq";

/// Many runs' single moves forward and their status events in one
/// statement (PostgreSQL): `$1` a JSON array of the moves, one per run,
/// each as [`ADVANCE_PG`] takes its values. Each run's guard is its own
/// (the states it may move from); a run whose guard does not hold is left
/// as it is. Answers the ids of the runs that moved.
const ADVANCE_MANY_PG: &str = "WITH input AS (SELECT * FROM json_to_recordset($1::json) \
       AS i(id TEXT, state TEXT, froms TEXT, at BIGINT, event_id TEXT, kind TEXT, payload TEXT)), \
     moved AS (UPDATE runs r SET state = i.state, updated_at = i.at, \
       admitted_at = CASE WHEN i.state = 'admitted' THEN i.at ELSE r.admitted_at END, \
       started_at = CASE WHEN i.state = 'running' THEN i.at ELSE r.started_at END, \
       last_event_seq = r.last_event_seq + 1 \
       FROM input i WHERE r.id = i.id AND i.froms LIKE '%,' || r.state || ',%' \
       RETURNING r.id, r.last_event_seq, i.at, i.event_id, i.kind, i.payload) \
     INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
     SELECT id, last_event_seq, event_id, kind, payload, at FROM moved RETURNING run_id";

/// [`TRANSITION`] forward, taking the sequence number of its status event.
const ADVANCE: &str = "UPDATE runs SET state = $2, updated_at = $4, \
     admitted_at = CASE WHEN $2 = 'admitted' THEN $4 ELSE admitted_at END, \
     started_at = CASE WHEN $2 = 'running' THEN $4 ELSE started_at END, \
     last_event_seq = last_event_seq + 1 \
     WHERE id = $1 AND $3 LIKE '%,' || state || ',%' RETURNING last_event_seq";

pub(crate) fn decode(row: &AnyRow) -> Result<Run> {
    rows::columns! { row => Run {
        id, automation_id, org_id, owner_id, placement, trigger, scheduled_for, idempotency_key,
        prompt, model, state, error_code, error_message, deadline_at, traceparent, message_id,
        cancel_requested_at, admitted_at, started_at, created_at, updated_at,
    } }
}

impl Store {
    /// Creates a run unless one with the same id exists, and returns the
    /// stored run with `true` when this call created it.
    pub async fn create_run(&self, new: &NewRun<'_>, now: DateTime<Utc>) -> Result<(Run, bool)> {
        let created = if self.backend() == crate::Backend::Postgres {
            // One statement, atomic on its own: no transaction around it.
            let live = i64::from(!new.state.is_terminal());
            let token = crate::signal::process_token();
            let params = crate::runs::insert_run_params!(new, now, live, token);
            let created =
                rows::optional(self.db(), CREATE_PG, params, |r| col::<i64>(r, "created"))
                    .await?
                    .unwrap_or_default();
            created > 0
        } else {
            let mut tx = self.begin_write().await?;
            let created = insert(&mut tx, new, now).await?;
            tx.commit().await?;
            created
        };
        if created {
            crate::signal::runs_created();
        }
        Ok((self.internal().get_run(&new.id).await?, created))
    }

    /// One run of `owner`; another tenant's answers `NotFound`.
    pub async fn get_run(&self, owner: &Principal, id: &str) -> Result<Run> {
        rows::owned(self.db(), GET, owner, id, decode).await
    }

    /// The newest run of `owner`'s automation `automation_id`, if it ran.
    pub async fn last_run(&self, owner: &Principal, automation_id: &str) -> Result<Option<Run>> {
        let params = (automation_id, &owner.org_id, &owner.user_id);
        rows::optional(self.db(), LAST, params, decode).await
    }

    /// The usage on the receipts of `owner`'s runs (of one automation, when
    /// given) created in `[from, until)`, per quarter hour, in order.
    pub async fn usage_by_quarter_hour(
        &self,
        owner: &Principal,
        automation_id: Option<&str>,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<Vec<QuarterUsage>> {
        let params = (
            &owner.org_id,
            &owner.user_id,
            automation_id.unwrap_or(""),
            micros(from),
            micros(until),
        );
        rows::all(self.db(), USAGE, params, |row| {
            let quarter: i64 = col(row, "quarter")?;
            Ok(QuarterUsage {
                start: DateTime::from_timestamp(quarter * 900, 0)
                    .ok_or_else(|| StoreError::Corrupt(format!("quarter={quarter}")))?,
                runs: col(row, "runs")?,
                input_tokens: col(row, "input_tokens")?,
                output_tokens: col(row, "output_tokens")?,
                cost_micros: col(row, "cost_micros")?,
            })
        })
        .await
    }

    /// A page of `owner`'s runs, newest first, narrowed by `filter`.
    pub async fn list_runs(
        &self,
        owner: &Principal,
        filter: &RunFilter<'_>,
        after: &Cursor,
        limit: u32,
    ) -> Result<Page<Run>> {
        let states = filter.state_names();
        let params = page_params(owner, filter, &states, after);
        rows::page(self.db(), LIST, params, limit, decode).await
    }

    /// The receipts of the ended runs on the page
    /// [`list_runs`](Self::list_runs) answers for the same arguments, by run
    /// id: one query, whatever the page's size.
    pub async fn receipts_of_run_page(
        &self,
        owner: &Principal,
        filter: &RunFilter<'_>,
        after: &Cursor,
        limit: u32,
    ) -> Result<std::collections::HashMap<String, automesh_domain::Receipt>> {
        let states = filter.state_names();
        let params = page_params(owner, filter, &states, after);
        let (a, b, c, d, e, f, g, h) = params;
        let params = (a, b, c, d, e, f, g, h, i64::from(limit) + 1);
        let receipts = rows::all(self.db(), LIST_RECEIPTS, params, crate::receipts::decode);
        Ok(receipts
            .await?
            .into_iter()
            .map(|r| (r.run_id.clone(), r))
            .collect())
    }

    /// Moves a live run forward through `targets` in order, each move
    /// guarded by the states it may come from and recorded with its status
    /// event; a move the run's state does not allow is skipped (the run is
    /// there already, or past it). The states it moved to.
    pub async fn advance_run(
        &self,
        id: &str,
        targets: &[RunState],
        now: DateTime<Utc>,
    ) -> Result<Vec<RunState>> {
        let (id, targets) = (id.to_owned(), targets.to_vec());
        self.writer().write(Advance { id, targets, now }).await
    }

    /// Moves a run to `to` if its current state allows it; otherwise
    /// `IllegalTransition` (a terminal run never changes).
    pub async fn transition_run(
        &self,
        id: &str,
        to: RunState,
        error: Option<(ErrorCode, &str)>,
        now: DateTime<Utc>,
    ) -> Result<Run> {
        let from = predecessors(to);
        let (code, message) = (error.map(|(c, _)| c.as_str()), error.map(|(_, m)| m));
        let params = (id, to.as_str(), code, message, from, micros(now));
        let moved = rows::changed_one(self.db(), TRANSITION, params).await?;
        let run = self.internal().get_run(id).await?;
        if moved {
            Ok(run)
        } else {
            Err(StoreError::IllegalTransition {
                from: run.state.to_string(),
                to: to.to_string(),
            })
        }
    }
}

/// Which of an owner's runs a list holds: every field narrows it.
#[derive(Debug, Clone, Default)]
pub struct RunFilter<'a> {
    /// Only this automation's.
    pub automation_id: Option<&'a str>,
    /// Only runs in one of these states (all when empty).
    pub states: Vec<RunState>,
    /// Only runs created at or after this instant.
    pub created_after: Option<DateTime<Utc>>,
    /// Only runs created before this instant.
    pub created_before: Option<DateTime<Utc>>,
}

/// `$1`..`$8` of a page of `owner`'s runs ([`LIST`], [`LIST_RECEIPTS`]).
fn page_params<'p>(
    owner: &'p Principal,
    filter: &RunFilter<'p>,
    states: &'p str,
    after: &'p Cursor,
) -> (&'p str, &'p str, &'p str, i64, &'p str, &'p str, i64, i64) {
    (
        &owner.org_id,
        &owner.user_id,
        filter.automation_id.unwrap_or(""),
        after.created_micros,
        &after.id,
        states,
        filter.created_after.map_or(i64::MIN, micros),
        filter.created_before.map_or(i64::MAX, micros),
    )
}

impl<'a> RunFilter<'a> {
    /// The states, as the page queries take them (comma-separated).
    fn state_names(&self) -> String {
        let names: Vec<&str> = self.states.iter().map(|s| s.as_str()).collect();
        names.join(",")
    }

    /// Every run of one automation.
    pub fn automation(id: &'a str) -> Self {
        Self {
            automation_id: Some(id),
            ..Self::default()
        }
    }
}

/// A run's moves forward, committed with other writes.
struct Advance {
    id: String,
    targets: Vec<RunState>,
    now: DateTime<Utc>,
}

impl crate::writer::Job for Advance {
    type Output = Vec<RunState>;

    fn key(&self) -> &str {
        &self.id
    }

    /// The move, when the job is one move (the common case: each status
    /// an executor reports moves its run one step).
    fn joined_row(&self) -> Option<Row> {
        let [to] = self.targets.as_slice() else {
            return None;
        };
        let event = crate::events::status_event(*to, None, None);
        let (event_id, kind, payload) = crate::events::columns(&event).ok()?;
        Some(Row {
            joint: Joint::Move,
            run_id: self.id.clone(),
            value: serde_json::json!({
                "id": self.id,
                "state": to.as_str(),
                "froms": predecessors(*to),
                "at": micros(self.now),
                "event_id": event_id,
                "kind": kind,
                "payload": payload,
            }),
        })
    }

    fn joined(&self, done: Joined) -> Option<Vec<RunState>> {
        let Joined::Moved(made) = done else {
            return None;
        };
        Some(if made { self.targets.clone() } else { vec![] })
    }

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Result<Vec<RunState>>> {
        Box::pin(async move {
            let mut moved = vec![];
            for to in &self.targets {
                let (from, at) = (predecessors(*to), micros(self.now));
                // A move made writes its status event, which cannot exist
                // yet: the state was not reached before.
                let event = crate::events::status_event(*to, None, None);
                let made = if rows::is_postgres(db) {
                    let (id, kind, payload) = crate::events::columns(&event)?;
                    let params = (&self.id, to.as_str(), from, at, id, kind, payload);
                    let made = rows::optional(&mut *db, ADVANCE_PG, params, |_| Ok(()));
                    made.await?.is_some()
                } else {
                    let params = (&self.id, to.as_str(), from, at);
                    let seq =
                        rows::optional(&mut *db, ADVANCE, params, |r| col(r, "last_event_seq"));
                    match seq.await? {
                        Some(seq) => {
                            crate::events::insert(&mut *db, &self.id, seq, &event, self.now).await?
                        }
                        None => false,
                    }
                };
                if made {
                    moved.push(*to);
                }
            }
            Ok(moved)
        })
    }
}

/// Makes the moves of `input` (a JSON array of [`Advance`]'s joined rows,
/// of distinct runs) in one statement (PostgreSQL); the ids of the runs
/// that moved, each guard deciding for its own run as [`ADVANCE_PG`]
/// would.
pub(crate) async fn advance_many(
    db: &mut AnyConnection,
    input: String,
) -> Result<std::collections::HashSet<String>> {
    let moved = rows::all(db, ADVANCE_MANY_PG, (input,), |r| {
        col::<String>(r, "run_id")
    });
    Ok(moved.await?.into_iter().collect())
}

/// The states a run may move to `to` from, as [`TRANSITION`] takes them.
fn predecessors(to: RunState) -> String {
    RunState::predecessors(to)
        .iter()
        .fold(String::from(","), |acc, s| format!("{acc}{s},"))
}

/// Inserts a run unless its id exists; `true` when this call created it.
pub(crate) async fn insert(
    tx: &mut AnyConnection,
    new: &NewRun<'_>,
    now: DateTime<Utc>,
) -> Result<bool> {
    rows::changed_one(&mut *tx, INSERT, insert_run_params!(new, now)).await
}

/// The values of [`insert_run_sql`]'s parameters for `$new` (a
/// `&NewRun`) created at `$now`, then any `$extra` ones.
macro_rules! insert_run_params {
    ($new:expr, $now:expr $(, $extra:expr)*) => {{
        let new: &automesh_domain::run::NewRun<'_> = $new;
        let a = new.automation;
        (
            &new.id,
            &a.id,
            &a.org_id,
            &a.owner_id,
            a.placement.as_str(),
            new.trigger.as_str(),
            $crate::rows::opt_micros(new.scheduled_for),
            new.idempotency_key.as_deref(),
            &a.prompt,
            &a.model,
            new.state.as_str(),
            new.error.as_ref().map(|(c, _)| c.as_str()),
            new.error.as_ref().map(|(_, m)| m.as_str()),
            $crate::rows::micros(new.deadline_at),
            new.traceparent.as_deref(),
            $crate::rows::micros($now)
            $(, $extra)*
        )
    }};
}
pub(crate) use insert_run_params;

impl crate::Internal<'_> {
    /// One run by id, for internal callers that act for no user.
    pub async fn get_run(self, id: &str) -> Result<Run> {
        rows::by_id(self.db(), GET_UNSCOPED, id, decode).await
    }
}

#[cfg(test)]
mod tests {
    use automesh_domain::RunState;

    #[test]
    fn the_live_state_list_is_the_domains_non_terminal_states() {
        let listed: Vec<&str> = live_states!()
            .trim_matches(|c| c == '(' || c == ')')
            .split(", ")
            .map(|s| s.trim_matches('\''))
            .collect();
        let live: Vec<&str> = RunState::ALL
            .iter()
            .filter(|s| !s.is_terminal())
            .map(|s| s.as_str())
            .collect();
        assert_eq!(listed, live);
    }
}
