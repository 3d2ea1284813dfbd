//! Queries of the `runs` aggregate: creation (idempotent by derived id),
//! scoped reads, and guarded state transitions.

use automesh_domain::run::NewRun;
use automesh_domain::{ErrorCode, Principal, QuarterUsage, Run, RunState};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use const_format::concatcp;
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use crate::keys::{KeyRow, key_of, key_run};
use crate::page::{Cursor, Page};
use crate::rows::{self, col, micros};
use crate::sql::{Bulk, Input, bulk};
use crate::{Result, Store, StoreError};

/// The columns every run query reads, in `decode`'s terms.
pub(crate) const RUN_COLUMNS: &str = "id, automation_id, org_id, owner_id, placement, trigger, \
     scheduled_for, idempotency_key, prompt, model, state, error_code, error_message, deadline_at, \
     traceparent, message_id, cancel_requested_at, admitted_at, started_at, created_at, updated_at, \
     max_cost_micros, max_tokens";

/// The states of a live run, as an SQL list: named once, for every query
/// that must only touch live runs (a unit test keeps it equal to the
/// domain's non-terminal states).
pub(crate) const LIVE_STATES: &str = "('pending', 'waking', 'admitted', 'running')";

bulk! {
    /// A run as it is created.
    struct RunRow {
        id: String => TEXT,
        automation_id: String => TEXT,
        org_id: String => TEXT,
        owner_id: String => TEXT,
        placement: &'static str => TEXT,
        trigger: &'static str => TEXT,
        scheduled_for: Option<i64> => BIGINT,
        idempotency_key: Option<String> => TEXT,
        prompt: String => TEXT,
        model: String => TEXT,
        state: &'static str => TEXT,
        error_code: Option<&'static str> => TEXT,
        error_message: Option<String> => TEXT,
        deadline_at: i64 => BIGINT,
        traceparent: Option<String> => TEXT,
        created_at: i64 => BIGINT,
        max_cost_micros: Option<i64> => BIGINT,
        max_tokens: Option<i64> => BIGINT,
    }
}

/// Runs created, each unless its id exists: the ids created.
const CREATE: Bulk<RunRow> = bulk!(RunRow => [
    "INSERT INTO runs (", <RunRow as Input>::COLUMNS, ", updated_at) SELECT i.*, i.created_at FROM "
] [
    " WHERE true ON CONFLICT (id) DO NOTHING RETURNING id"
]);

impl RunRow {
    /// `new`, created at `now`.
    pub(crate) fn of(new: &NewRun<'_>, now: DateTime<Utc>) -> RunRow {
        let a = new.automation;
        RunRow {
            id: new.id.clone(),
            automation_id: a.id.clone(),
            org_id: a.org_id.clone(),
            owner_id: a.owner_id.clone(),
            placement: a.placement.as_str(),
            trigger: new.trigger.as_str(),
            scheduled_for: rows::opt_micros(new.scheduled_for),
            idempotency_key: new.idempotency_key.clone(),
            prompt: a.prompt.clone(),
            model: a.model.clone(),
            state: new.state.as_str(),
            error_code: new.error.as_ref().map(|(c, _)| c.as_str()),
            error_message: new.error.as_ref().map(|(_, m)| m.clone()),
            deadline_at: micros(new.deadline_at),
            traceparent: new.traceparent.clone(),
            created_at: micros(now),
            max_cost_micros: a.budget.max_cost_micros,
            max_tokens: a.budget.max_tokens,
        }
    }
}

/// Creates `rows`' runs, each unless its id exists or its idempotency key
/// names a run already: the ids created. With keys, two statements, so
/// the caller's transaction makes them one.
pub(crate) async fn create(
    db: &mut AnyConnection,
    rows: &[RunRow],
) -> Result<std::collections::HashSet<String>> {
    let keys: Vec<KeyRow> = rows.iter().filter_map(key_of).collect();
    let created = if keys.is_empty() {
        CREATE.all(db, rows, |r| col::<String>(r, "id")).await?
    } else {
        let claimed = crate::keys::claim(&mut *db, &keys).await?;
        let rows: Vec<RunRow> = rows
            .iter()
            .filter(|r| key_of(r).is_none() || claimed.contains(&r.id))
            .cloned()
            .collect();
        if rows.is_empty() {
            return Ok(Default::default());
        }
        CREATE.all(db, &rows, |r| col::<String>(r, "id")).await?
    };
    Ok(created.into_iter().collect())
}

bulk! {
    /// A run, by id.
    struct IdRow {
        id: String => TEXT,
    }
}

impl IdRow {
    pub(crate) fn of(id: &str) -> IdRow {
        IdRow { id: id.to_owned() }
    }
}

/// The runs' last event numbers.
pub(crate) const LAST_EVENT_SEQ: Bulk<IdRow> = bulk!(IdRow => [
    "SELECT r.id, r.last_event_seq FROM runs r JOIN "
] [
    " ON r.id = i.id"
]);

/// The runs' states (why a write was refused).
const STATES: Bulk<IdRow> =
    bulk!(IdRow => ["SELECT r.id, r.state FROM runs r JOIN "] [" ON r.id = i.id"]);

/// Why each of `ids` was refused a move to the state `to` names: the run
/// is missing, or it is in the state it is in.
pub(crate) async fn refusals(
    db: &mut AnyConnection,
    ids: &[&str],
    to: impl Fn(&str) -> String,
) -> Result<std::collections::HashMap<String, StoreError>> {
    let rows: Vec<IdRow> = ids.iter().map(|id| IdRow::of(id)).collect();
    let states = STATES.all(db, &rows, |r| {
        Ok((col::<String>(r, "id")?, col::<String>(r, "state")?))
    });
    let states: std::collections::HashMap<String, String> = states.await?.into_iter().collect();
    Ok(ids
        .iter()
        .map(|id| {
            let refusal = match states.get(*id) {
                None => StoreError::NotFound,
                Some(from) => StoreError::IllegalTransition {
                    from: from.clone(),
                    to: to(id),
                },
            };
            ((*id).to_owned(), refusal)
        })
        .collect())
}

const GET_UNSCOPED: &str = concatcp!("SELECT ", RUN_COLUMNS, " FROM runs WHERE id = $1");

const GET: &str = concatcp!(
    "SELECT ",
    RUN_COLUMNS,
    " FROM runs WHERE id = $1 AND org_id = $2 AND owner_id = $3"
);

/// A page of an owner's runs, narrowed (`$1`..`$9`, see
/// [`Store::list_runs`]), `$10` rows at most. The states (`$6`) and error
/// codes (`$9`) are comma-separated names of closed sets, so a `LIKE` on
/// them matches whole names.
const RUN_PAGE: &str = "FROM runs \
     WHERE org_id = $1 AND owner_id = $2 AND ($3 = '' OR automation_id = $3) \
       AND (created_at, id) < ($4, $5) \
       AND ($6 = '' OR (',' || $6 || ',') LIKE ('%,' || state || ',%')) \
       AND created_at >= $7 AND created_at < $8 \
       AND ($9 = '' OR (',' || $9 || ',') LIKE ('%,' || COALESCE(error_code, '-') || ',%')) \
     ORDER BY created_at DESC, id DESC LIMIT $10";

const LIST: &str = concatcp!("SELECT ", RUN_COLUMNS, " ", RUN_PAGE);

/// The receipts of the runs of a [`LIST`] page (same parameters).
const LIST_RECEIPTS: &str = concatcp!(
    "SELECT ",
    crate::receipts::RECEIPT_COLUMNS,
    " FROM receipts WHERE run_id IN (SELECT id ",
    RUN_PAGE,
    ")"
);

/// An automation's newest run (the index `runs_by_automation` serves it).
const LAST: &str = concatcp!(
    "SELECT ",
    RUN_COLUMNS,
    " FROM runs WHERE automation_id = $1 AND org_id = $2 AND owner_id = $3 \
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

/// `$5` is a comma-framed list of the states the run may move from, such as
/// `,pending,waking,`: one static query for every transition on both backends.
const TRANSITION: &str = "UPDATE runs SET state = $2, error_code = $3, error_message = $4, \
     updated_at = $6, \
     admitted_at = CASE WHEN $2 = 'admitted' THEN $6 ELSE admitted_at END, \
     started_at = CASE WHEN $2 = 'running' THEN $6 ELSE started_at END \
     WHERE id = $1 AND $5 LIKE '%,' || state || ',%'";

bulk! {
    /// A run's move forward to `state`, from one of `froms` (a
    /// comma-framed list such as `,pending,waking,`), at `at`.
    struct MoveRow {
        id: String => TEXT,
        state: &'static str => TEXT,
        froms: String => TEXT,
        at: i64 => BIGINT,
    }
}

/// Runs' moves forward, each guarded by the states it may come from and
/// taking the number of its status event: the runs that moved.
const ADVANCE: Bulk<MoveRow> = bulk!(MoveRow => [
    "UPDATE runs SET state = i.state, updated_at = i.at, \
     admitted_at = CASE WHEN i.state = 'admitted' THEN i.at ELSE runs.admitted_at END, \
     started_at = CASE WHEN i.state = 'running' THEN i.at ELSE runs.started_at END, \
     last_event_seq = runs.last_event_seq + 1 FROM "
] [
    " WHERE runs.id = i.id AND i.froms LIKE '%,' || runs.state || ',%' \
     RETURNING runs.id, runs.last_event_seq"
]);

pub(crate) fn decode(row: &AnyRow) -> Result<Run> {
    let budget = crate::rows::budget(row)?;
    rows::columns! { row => Run {
        id, automation_id, org_id, owner_id, placement, trigger, scheduled_for, idempotency_key,
        prompt, model, state, error_code, error_message, deadline_at, traceparent, message_id,
        cancel_requested_at, admitted_at, started_at, created_at, updated_at; budget
    } }
}

impl Store {
    /// Creates a run unless one with the same id exists, and returns the
    /// stored run with `true` when this call created it. A live run wakes
    /// the coordinators.
    pub async fn create_run(&self, new: &NewRun<'_>, now: DateTime<Utc>) -> Result<(Run, bool)> {
        let row = RunRow::of(new, now);
        let (created, id) = match key_of(&row) {
            // One statement, atomic on its own: no transaction around it.
            None => {
                let mut db = self.db().acquire().await?;
                let created = !create(&mut db, &[row]).await?.is_empty();
                if created && !new.state.is_terminal() {
                    crate::signal::runs_created_on(&mut db).await?;
                }
                (created, new.id.clone())
            }
            // The key and the run, or the run the key named already.
            Some(key) => {
                let mut tx = self.begin_write().await?;
                let created = !create(&mut tx, &[row]).await?.is_empty();
                let id = match created {
                    true => new.id.clone(),
                    false => key_run(&mut tx, &key.automation_id, &key.idempotency_key)
                        .await?
                        .unwrap_or_else(|| new.id.clone()),
                };
                if created && !new.state.is_terminal() {
                    crate::signal::runs_created_on(&mut tx).await?;
                }
                tx.commit().await?;
                (created, id)
            }
        };
        Ok((self.internal().get_run(&id).await?, created))
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
        let (states, codes) = filter.names();
        let params = page_params(owner, filter, (&states, &codes), after);
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
        let (states, codes) = filter.names();
        let params = page_params(owner, filter, (&states, &codes), after);
        let (a, b, c, d, e, f, g, h, i) = params;
        let params = (a, b, c, d, e, f, g, h, i, i64::from(limit) + 1);
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
    /// Only runs that carry one of these error codes (all when empty):
    /// why a run failed, or why an occurrence was skipped or missed.
    pub error_codes: Vec<ErrorCode>,
}

/// `$1`..`$9` of a page of `owner`'s runs ([`LIST`], [`LIST_RECEIPTS`]).
fn page_params<'p>(
    owner: &'p Principal,
    filter: &RunFilter<'p>,
    (states, codes): (&'p str, &'p str),
    after: &'p Cursor,
) -> (
    &'p str,
    &'p str,
    &'p str,
    i64,
    &'p str,
    &'p str,
    i64,
    i64,
    &'p str,
) {
    (
        &owner.org_id,
        &owner.user_id,
        filter.automation_id.unwrap_or(""),
        after.created_micros,
        &after.id,
        states,
        filter.created_after.map_or(i64::MIN, micros),
        filter.created_before.map_or(i64::MAX, micros),
        codes,
    )
}

impl<'a> RunFilter<'a> {
    /// The states and the error codes, as the page queries take them
    /// (comma-separated).
    fn names(&self) -> (String, String) {
        let states: Vec<&str> = self.states.iter().map(|s| s.as_str()).collect();
        let codes: Vec<&str> = self.error_codes.iter().map(|c| c.as_str()).collect();
        (states.join(","), codes.join(","))
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

    /// Step by step (each status an executor reports is one step): every
    /// job's next move in one statement, then the status events of the
    /// runs that moved in another.
    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<Vec<RunState>>>>> {
        Box::pin(async move {
            let mut moved: Vec<Vec<RunState>> = jobs.iter().map(|_| vec![]).collect();
            let steps = jobs.iter().map(|j| j.targets.len()).max().unwrap_or(0);
            for step in 0..steps {
                let of_step: Vec<(usize, RunState)> = jobs
                    .iter()
                    .enumerate()
                    .filter_map(|(i, j)| j.targets.get(step).map(|to| (i, *to)))
                    .collect();
                let rows: Vec<MoveRow> = of_step
                    .iter()
                    .map(|(i, to)| MoveRow {
                        id: jobs[*i].id.clone(),
                        state: to.as_str(),
                        froms: predecessors(*to),
                        at: micros(jobs[*i].now),
                    })
                    .collect();
                let made = ADVANCE.all(&mut *db, &rows, |r| {
                    Ok((col::<String>(r, "id")?, col::<i64>(r, "last_event_seq")?))
                });
                let made: std::collections::HashMap<String, i64> =
                    made.await?.into_iter().collect();
                let mut events = vec![];
                for (i, to) in of_step {
                    let job = jobs[i];
                    if let Some(seq) = made.get(&job.id) {
                        // A move made writes its status event, which cannot
                        // exist yet: the state was not reached before.
                        let event = crate::events::status_event(to, None, None);
                        events.push(crate::events::row(&job.id, *seq, &event, job.now)?);
                        moved[i].push(to);
                    }
                }
                crate::events::INSERT.execute(&mut *db, &events).await?;
            }
            Ok(moved.into_iter().map(Ok).collect())
        })
    }
}

/// The states a run may move to `to` from, as [`TRANSITION`] takes them.
fn predecessors(to: RunState) -> String {
    RunState::predecessors(to)
        .iter()
        .fold(String::from(","), |acc, s| format!("{acc}{s},"))
}

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
        let listed: Vec<&str> = super::LIVE_STATES
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
