//! The scheduler's transaction: claim due automations (row locks that other
//! replicas skip on PostgreSQL; the single writer lock on SQLite), create
//! their runs and receipts, and advance their next occurrence — all or
//! nothing.

use automesh_domain::run::NewRun;
use automesh_domain::{Automation, Receipt};
use chrono::{DateTime, Utc};
use const_format::concatcp;
use sqlx::{Any, Transaction};

use crate::automations::AUTOMATION_COLUMNS;
use crate::rows::{self, col, micros, opt_micros};
use crate::runs::{LIVE_STATES, RunRow};
use crate::sql::{Bulk, bulk};
use crate::{Backend, Result, Store};

/// Up to `$2` active automations due at `$1`, soonest first, each with
/// whether a run of it is still live; read without a lock (SQLite has one
/// writer at a time: its claim needs none either).
const DUE: &str = concatcp!(
    "SELECT ",
    AUTOMATION_COLUMNS,
    ", CASE WHEN EXISTS (SELECT 1 FROM runs r WHERE r.automation_id = automations.id \
       AND r.state IN ",
    LIVE_STATES,
    ") THEN 1 ELSE 0 END AS live_run FROM automations WHERE state = 'active' \
     AND next_run_at IS NOT NULL AND next_run_at <= $1 ORDER BY next_run_at LIMIT $2"
);

/// PostgreSQL: [`DUE`], claimed (rows another scheduler holds are skipped).
const DUE_PG: &str = concatcp!(DUE, " FOR UPDATE SKIP LOCKED");

const NEXT_DUE: &str = "SELECT MIN(next_run_at) AS next_due FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL";

const ADVANCE: &str = "UPDATE automations SET next_run_at = $2, updated_at = $3, \
     version = version + 1 WHERE id = $1";

bulk! {
    /// An occurrence fired: its automation, as read (due at `due`, at
    /// `version`), moved to its next occurrence.
    struct FireRow {
        automation_id: String => TEXT,
        due: Option<i64> => BIGINT,
        version: i64 => BIGINT,
        next_run_at: Option<i64> => BIGINT,
        at: i64 => BIGINT,
    }
}

/// Automations moved to their next occurrence, each only while still
/// active and as it was read (due instant, version), with no run
/// live: the ones moved, whose occurrences' runs are then created.
///
/// "No run live" is a scalar subquery, not `NOT EXISTS`: PostgreSQL turns
/// a `NOT EXISTS` into an anti-join planned from the tables' statistics,
/// and on young ones (a table just filled, not yet analysed) it scanned
/// all of `runs` once per automation (278 ms for 200 occurrences in
/// `bench-lifecycle`). A scalar subquery stays a lookup per automation in
/// `runs_live_by_automation`, whatever the statistics say.
const FIRE: Bulk<FireRow> = bulk!(FireRow => [
    "UPDATE automations SET next_run_at = i.next_run_at, updated_at = i.at, \
     version = automations.version + 1 FROM "
] [
    " WHERE automations.id = i.automation_id AND automations.state = 'active' \
     AND automations.next_run_at = i.due \
     AND automations.version = i.version \
     AND (SELECT r.id FROM runs r WHERE r.automation_id = automations.id \
       AND r.state IN ", LIVE_STATES, " LIMIT 1) IS NULL \
     RETURNING automations.id"
]);

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
        let due = rows::all(self.db(), DUE, params, decode).await?;
        Ok(due.into_iter().flatten().collect())
    }

    /// Fires occurrences planned from [`Store::due_by`]'s read, without a
    /// lock, in one transaction that commits asynchronously (as
    /// [`Store::begin_scheduling`]'s): each creates its run and moves its
    /// automation's next occurrence, as [`SchedulingTx::fire_many`] fires
    /// it — only if the automation is still active, unchanged and due as
    /// read, and no run of it is live. Whether each fired, in order; one
    /// whose guard did not hold is left to a scheduling pass, which claims
    /// and decides again.
    pub async fn fire_unlocked(
        &self,
        fires: &[(&NewRun<'_>, Option<DateTime<Utc>>)],
        now: DateTime<Utc>,
    ) -> Result<Vec<bool>> {
        let mut tx = self.begin_scheduling().await?;
        let fired = tx.fire_many(fires, now).await?;
        tx.commit().await?;
        Ok(fired)
    }
}

impl SchedulingTx {
    /// Up to `limit` active automations due at `now`, locked for this
    /// transaction (rows another scheduler holds are skipped), each with
    /// whether a run of it is still live.
    pub async fn claim_due(&mut self, now: DateTime<Utc>, limit: u32) -> Result<Vec<Due>> {
        let sql = match self.backend {
            Backend::Postgres => DUE_PG,
            Backend::Sqlite => DUE,
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
        let rows = [RunRow::of(new, now)];
        let created = !crate::runs::create(&mut self.tx, &rows).await?.is_empty();
        if created && !new.state.is_terminal() {
            self.created_pending = true;
        }
        Ok(created)
    }

    /// Fires occurrences: each moves its automation's next occurrence to
    /// its `next` and creates its run unless the run's (derived) id exists,
    /// guarded as [`Store::fire_unlocked`] says (under this transaction's
    /// claim the guard holds unless a run of the automation went live).
    /// Two statements for all of them. Whether each run was created, in
    /// order.
    pub async fn fire_many(
        &mut self,
        fires: &[(&NewRun<'_>, Option<DateTime<Utc>>)],
        now: DateTime<Utc>,
    ) -> Result<Vec<bool>> {
        let rows: Vec<FireRow> = fires
            .iter()
            .map(|(new, next)| FireRow {
                automation_id: new.automation.id.clone(),
                due: opt_micros(new.automation.next_run_at),
                version: new.automation.version,
                next_run_at: opt_micros(*next),
                at: micros(now),
            })
            .collect();
        let moved = FIRE.all(&mut self.tx, &rows, |r| col::<String>(r, "id"));
        let moved: std::collections::HashSet<String> = moved.await?.into_iter().collect();
        let runs: Vec<RunRow> = fires
            .iter()
            .filter(|(new, _)| moved.contains(&new.automation.id))
            .map(|(new, _)| RunRow::of(new, now))
            .collect();
        let made = crate::runs::create(&mut self.tx, &runs).await?;
        let created: Vec<bool> = fires
            .iter()
            .map(|(new, _)| made.contains(&new.id))
            .collect();
        self.created_pending |= fires
            .iter()
            .zip(&created)
            .any(|((new, _), made)| *made && !new.state.is_terminal());
        Ok(created)
    }

    /// Stores the receipt of a run created terminal (skipped, missed).
    pub async fn insert_receipt(&mut self, receipt: &Receipt) -> Result<()> {
        crate::receipts::created_terminal(&mut self.tx, std::slice::from_ref(receipt)).await
    }

    /// What the runs of `automation_id` created in `[from, to)` cost
    /// together, by their receipts, read in the transaction.
    pub async fn month_spend(
        &mut self,
        automation_id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<i64> {
        crate::automations::month_spend(&mut self.tx, automation_id, from, to).await
    }

    /// Writes what claimed automations now are (their state, attention and
    /// next occurrence: paused for a spent monthly budget, say).
    pub async fn stand(&mut self, moved: &[&Automation], now: DateTime<Utc>) -> Result<()> {
        crate::automations::stand(&mut self.tx, moved, now).await
    }

    /// Writes `notices` to the outbox in this transaction (a skipped or
    /// missed occurrence's): see [`crate::notifications`].
    pub async fn notify(&mut self, notices: &[automesh_domain::Notice]) -> Result<()> {
        crate::notifications::enqueue(&mut self.tx, notices).await?;
        Ok(())
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
        if self.created_pending && self.backend == Backend::Postgres {
            let token = crate::signal::process_token();
            crate::signal::notify(&mut *tx, crate::Topic::Runs, token).await?;
        }
        tx.commit().await?;
        if self.created_pending {
            crate::Topic::Runs.signal_local();
        }
        Ok(self.created_pending)
    }
}
