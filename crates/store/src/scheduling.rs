//! The scheduler's transaction: claim due automations (row locks that other
//! replicas skip on PostgreSQL; the single writer lock on SQLite), create
//! their runs and receipts, and advance their next occurrence — all or
//! nothing.

use automesh_domain::run::NewRun;
use automesh_domain::{Automation, Receipt};
use chrono::{DateTime, Utc};
use sqlx::{Any, Transaction};

use crate::automations::automation_columns;
use crate::rows::{self, col, micros, opt_micros};
use crate::runs::live_states;
use crate::{Backend, Result, Store};

/// Up to `$2` active automations due at `$1`, soonest first, each with
/// whether a run of it is still live; `$lock` is how the backend keeps two
/// schedulers' claims apart.
macro_rules! due_sql {
    ($lock:literal) => {
        concat!(
            "SELECT ",
            automation_columns!(),
            ", CASE WHEN EXISTS (SELECT 1 FROM runs r WHERE r.automation_id = automations.id \
               AND r.state IN ",
            live_states!(),
            ") THEN 1 ELSE 0 END AS live_run FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL \
             AND next_run_at <= $1 ORDER BY next_run_at LIMIT $2",
            $lock
        )
    };
}

const DUE_PG: &str = due_sql!(" FOR UPDATE SKIP LOCKED");

/// SQLite has one writer at a time: the claim needs no row locks.
const DUE_SQLITE: &str = due_sql!("");

const NEXT_DUE: &str = "SELECT MIN(next_run_at) AS next_due FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL";

const ADVANCE: &str = "UPDATE automations SET next_run_at = $2, updated_at = $3, \
     version = version + 1 WHERE id = $1";

/// PostgreSQL: an occurrence fired in one statement — the run created
/// (unless its id exists), its automation advanced to `$17`, and, when the
/// run is live (`$18` = 1), the coordinators woken at commit (a notification
/// repeated in one transaction is delivered once). How many runs it created.
const FIRE_PG: &str = concat!(
    "WITH created AS (",
    crate::runs::insert_run_sql!(),
    " RETURNING id), advanced AS (UPDATE automations SET next_run_at = $17, updated_at = $16, \
     version = version + 1 WHERE id = $2) \
     SELECT (SELECT COUNT(*) FROM created) AS created, \
     (SELECT COUNT(*) FROM (SELECT pg_notify('automesh_runs', $19) FROM created WHERE $18 = 1) w) \
     AS woken"
);

/// PostgreSQL: many occurrences fired in one statement, as [`FIRE_PG`]
/// fires one — `$1` a JSON array of the runs, each with its automation's
/// next occurrence (`next_run_at`), created at `$2`: every run created
/// unless its id exists, every automation advanced, and the coordinators
/// woken at commit when any run was created (with `$3`, the process's
/// token). The ids of the runs it created.
const FIRE_MANY_PG: &str = concat!(
    "WITH input AS (SELECT * FROM json_to_recordset($1::json) AS i(id TEXT, automation_id TEXT, \
       org_id TEXT, owner_id TEXT, placement TEXT, trigger TEXT, scheduled_for BIGINT, \
       idempotency_key TEXT, prompt TEXT, model TEXT, state TEXT, error_code TEXT, \
       error_message TEXT, deadline_at BIGINT, traceparent TEXT, next_run_at BIGINT)), \
     created AS (",
    crate::runs::insert_run_into!(),
    " SELECT id, automation_id, org_id, owner_id, placement, trigger, scheduled_for, \
       idempotency_key, prompt, model, state, error_code, error_message, deadline_at, \
       traceparent, $2, $2 FROM input ON CONFLICT (id) DO NOTHING RETURNING id), \
     advanced AS (UPDATE automations a SET next_run_at = i.next_run_at, updated_at = $2, \
       version = a.version + 1 FROM input i WHERE a.id = i.automation_id) \
     SELECT id, (SELECT COUNT(*) FROM (SELECT pg_notify('automesh_runs', $3) \
       WHERE EXISTS (SELECT 1 FROM created)) w) AS woken FROM created"
);

/// PostgreSQL: an occurrence fired without a lock — the automation
/// advanced to `$17` only while still active, due at `$18`, at version
/// `$19` and with no run live; its run created only then, and the
/// coordinators woken. It commits asynchronously, like the scheduling
/// transaction (see [`Store::begin_scheduling`]). How many runs it created.
const FIRE_UNLOCKED_PG: &str = concat!(
    "WITH async_commit AS (SELECT set_config('synchronous_commit', 'off', true)), \
     advanced AS (UPDATE automations SET next_run_at = $17, updated_at = $16, \
       version = version + 1 \
       WHERE id = $2 AND state = 'active' AND next_run_at = $18 AND version = $19 \
       AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.automation_id = $2 AND r.state IN ",
    crate::runs::live_states!(),
    ") RETURNING id), created AS (",
    crate::runs::insert_run_into!(),
    " SELECT ",
    crate::runs::insert_run_values!(),
    " FROM advanced ON CONFLICT (id) DO NOTHING RETURNING id) \
     SELECT (SELECT COUNT(*) FROM created) AS created, \
     (SELECT COUNT(*) FROM (SELECT pg_notify('automesh_runs', $20) FROM created) w) AS woken, \
     (SELECT COUNT(*) FROM async_commit) AS settings"
);

/// What is due by `$1` (at most `$2`), read without a lock.
const DUE_UNLOCKED: &str = due_sql!("");

/// An automation due now, and whether a run of it is still live.
#[derive(Debug, Clone)]
pub struct Due {
    pub automation: Automation,
    pub live_run: bool,
}

fn decode_due(row: &sqlx::any::AnyRow) -> Result<Due> {
    Ok(Due {
        automation: crate::automations::decode(row)?,
        live_run: col(row, "live_run")?,
    })
}

/// An open scheduling transaction; dropped without `commit`, it rolls back.
pub struct SchedulingTx {
    tx: Transaction<'static, Any>,
    backend: Backend,
    created_pending: bool,
    /// The coordinators' wake-up is already part of the transaction.
    notified: bool,
}

impl std::fmt::Debug for SchedulingTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulingTx").finish_non_exhaustive()
    }
}

impl Store {
    /// A scheduling transaction. On PostgreSQL it commits asynchronously
    /// (no wait for the WAL flush): what it writes is a pure function of
    /// the automations it advances, in the same transaction, so a crash
    /// that loses it loses both, and the occurrence fires again, under the
    /// same derived run id, after the restart. Nothing acts on its runs
    /// before a synchronous commit that depends on them (a coordinator's
    /// claim), which flushes the WAL past it.
    pub async fn begin_scheduling(&self) -> Result<SchedulingTx> {
        let tx = match self.backend() {
            Backend::Postgres => {
                self.db()
                    .begin_with("BEGIN; SET LOCAL synchronous_commit = off")
                    .await?
            }
            Backend::Sqlite => self.begin_write().await?,
        };
        Ok(SchedulingTx {
            tx,
            backend: self.backend(),
            created_pending: false,
            notified: false,
        })
    }

    /// The earliest next occurrence of any active automation (one index probe).
    pub async fn next_due_at(&self) -> Result<Option<DateTime<Utc>>> {
        let next = rows::optional(self.db(), NEXT_DUE, (), |r| col(r, "next_due")).await?;
        Ok(next.flatten())
    }
}

impl Store {
    /// Up to `limit` active automations due by `at`, soonest first, each
    /// with whether a run of it is live: read without a lock, to plan what
    /// [`Store::fire_unlocked`] fires at the instant.
    pub async fn due_by(&self, at: DateTime<Utc>, limit: u32) -> Result<Vec<Due>> {
        let decode = rows::skipping("due automation", decode_due);
        let params = (micros(at), i64::from(limit));
        let due = rows::all(self.db(), DUE_UNLOCKED, params, decode).await?;
        Ok(due.into_iter().flatten().collect())
    }

    /// Fires an occurrence planned from [`Store::due_by`]'s read, in one
    /// statement and without a lock: creates the run and moves the
    /// automation's next occurrence from `due` to `next` — only if the
    /// automation is still active, unchanged (its version) and due at
    /// `due`, and no run of it is live. `true` when it fired; `false` when
    /// a guard did not hold (a scheduling transaction then decides).
    /// PostgreSQL only.
    pub async fn fire_unlocked(
        &self,
        new: &NewRun<'_>,
        due: DateTime<Utc>,
        next: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        if self.backend() != Backend::Postgres {
            return Ok(false);
        }
        let version = new.automation.version;
        let token = crate::signal::process_token();
        let params = crate::runs::insert_run_params!(
            new,
            now,
            opt_micros(next),
            micros(due),
            version,
            token
        );
        let created = rows::optional(self.db(), FIRE_UNLOCKED_PG, params, |r| col(r, "created"));
        let created: Option<i64> = created.await?;
        let created = created.unwrap_or(0) > 0;
        if created {
            crate::signal::runs_created();
        }
        Ok(created)
    }
}

impl SchedulingTx {
    /// Up to `limit` active automations due at `now`, locked for this
    /// transaction (rows another scheduler holds are skipped), each with
    /// whether a run of it is still live.
    pub async fn claim_due(&mut self, now: DateTime<Utc>, limit: u32) -> Result<Vec<Due>> {
        let sql = match self.backend {
            Backend::Postgres => DUE_PG,
            Backend::Sqlite => DUE_SQLITE,
        };
        // A row that does not decode is skipped, not allowed to stop every
        // other automation from firing.
        let decode = rows::skipping("due automation", decode_due);
        let params = (micros(now), i64::from(limit));
        let due = rows::all(&mut *self.tx, sql, params, decode).await?;
        Ok(due.into_iter().flatten().collect())
    }

    /// Creates a run unless its (derived) id exists; `true` when created.
    pub async fn create_run(&mut self, new: &NewRun<'_>, now: DateTime<Utc>) -> Result<bool> {
        let created = crate::runs::insert(&mut self.tx, new, now).await?;
        if created && !new.state.is_terminal() {
            self.created_pending = true;
        }
        Ok(created)
    }

    /// Fires an occurrence: creates its run unless the run's (derived) id
    /// exists, and moves the automation's next occurrence to `next` — on
    /// PostgreSQL in one statement, which also wakes the coordinators at
    /// commit; `true` when the run was created.
    pub async fn fire(
        &mut self,
        new: &NewRun<'_>,
        next: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        if self.backend == Backend::Sqlite {
            let created = self.create_run(new, now).await?;
            self.advance(&new.automation.id, next, now).await?;
            return Ok(created);
        }
        let live = i64::from(!new.state.is_terminal());
        let token = crate::signal::process_token();
        let params = crate::runs::insert_run_params!(new, now, opt_micros(next), live, token);
        let (created, woken): (i64, i64) = rows::optional(&mut *self.tx, FIRE_PG, params, |r| {
            Ok((col(r, "created")?, col(r, "woken")?))
        })
        .await?
        .unwrap_or_default();
        self.notified |= woken > 0;
        self.created_pending |= created > 0 && live == 1;
        Ok(created > 0)
    }

    /// Fires many occurrences, each as [`SchedulingTx::fire`] fires one
    /// (its run created unless its id exists, its automation moved to its
    /// `next` occurrence) — on PostgreSQL all in one statement, which also
    /// wakes the coordinators at commit. Whether each run was created, in
    /// order.
    pub async fn fire_many(
        &mut self,
        fires: &[(&NewRun<'_>, Option<DateTime<Utc>>)],
        now: DateTime<Utc>,
    ) -> Result<Vec<bool>> {
        if self.backend == Backend::Sqlite || fires.len() < 2 {
            let mut created = Vec::with_capacity(fires.len());
            for (new, next) in fires {
                created.push(self.fire(new, *next, now).await?);
            }
            return Ok(created);
        }
        let input: Vec<serde_json::Value> = fires
            .iter()
            .map(|(new, next)| fire_row(new, *next))
            .collect();
        let input = serde_json::Value::Array(input).to_string();
        let token = crate::signal::process_token();
        let params = (input, micros(now), token);
        let rows = rows::all(&mut *self.tx, FIRE_MANY_PG, params, |r| {
            Ok((col::<String>(r, "id")?, col::<i64>(r, "woken")?))
        })
        .await?;
        self.notified |= rows.iter().any(|(_, woken)| *woken > 0);
        let made: std::collections::HashSet<&str> =
            rows.iter().map(|(id, _)| id.as_str()).collect();
        let created: Vec<bool> = fires
            .iter()
            .map(|(new, _)| made.contains(new.id.as_str()))
            .collect();
        self.created_pending |= fires
            .iter()
            .zip(&created)
            .any(|((new, _), made)| *made && !new.state.is_terminal());
        Ok(created)
    }

    /// Stores the receipt of a run created terminal (skipped, missed).
    pub async fn insert_receipt(&mut self, receipt: &Receipt) -> Result<()> {
        crate::receipts::created_terminal(&mut self.tx, receipt).await
    }

    /// Moves an automation's next occurrence (and its version: the
    /// automation's etag changes as its next run time does).
    pub async fn advance(
        &mut self,
        automation_id: &str,
        next: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let params = (automation_id, opt_micros(next), micros(now));
        rows::execute(&mut *self.tx, ADVANCE, params).await?;
        Ok(())
    }

    /// Commits; returns whether pending runs were created (so coordinators
    /// can be woken).
    pub async fn commit(self) -> Result<bool> {
        let mut tx = self.tx;
        if self.created_pending && !self.notified && self.backend == Backend::Postgres {
            let token = crate::signal::process_token();
            crate::signal::notify(&mut *tx, crate::Topic::Runs, token).await?;
        }
        tx.commit().await?;
        if self.created_pending {
            crate::signal::runs_created();
        }
        Ok(self.created_pending)
    }
}

/// One occurrence's row of [`FIRE_MANY_PG`]'s input: the run's columns as
/// [`crate::runs::insert_run_params`] binds them, and its automation's
/// next occurrence.
fn fire_row(new: &NewRun<'_>, next: Option<DateTime<Utc>>) -> serde_json::Value {
    let a = new.automation;
    serde_json::json!({
        "id": new.id,
        "automation_id": a.id,
        "org_id": a.org_id,
        "owner_id": a.owner_id,
        "placement": a.placement.as_str(),
        "trigger": new.trigger.as_str(),
        "scheduled_for": opt_micros(new.scheduled_for),
        "idempotency_key": new.idempotency_key,
        "prompt": a.prompt,
        "model": a.model,
        "state": new.state.as_str(),
        "error_code": new.error.as_ref().map(|(c, _)| c.as_str()),
        "error_message": new.error.as_ref().map(|(_, m)| m.as_str()),
        "deadline_at": micros(new.deadline_at),
        "traceparent": new.traceparent,
        "next_run_at": opt_micros(next),
    })
}
