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

/// Up to `$2` active automations due at `$1`, soonest first; `$lock` is how
/// the backend keeps two schedulers' claims apart.
macro_rules! due_sql {
    ($lock:literal) => {
        rows::select!(
            automation_columns,
            "FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL \
             AND next_run_at <= $1 ORDER BY next_run_at LIMIT $2",
            $lock
        )
    };
}

const DUE_PG: &str = due_sql!(" FOR UPDATE SKIP LOCKED");

/// SQLite has one writer at a time: the claim needs no row locks.
const DUE_SQLITE: &str = due_sql!("");

const NEXT_DUE: &str = "SELECT MIN(next_run_at) AS next_due FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL";

const HAS_LIVE_RUN: &str = concat!(
    "SELECT 1 AS live FROM runs WHERE automation_id = $1 AND state IN ",
    live_states!(),
    " LIMIT 1"
);

const ADVANCE: &str = "UPDATE automations SET next_run_at = $2, updated_at = $3, \
     version = version + 1 WHERE id = $1";

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
    pub async fn begin_scheduling(&self) -> Result<SchedulingTx> {
        Ok(SchedulingTx {
            tx: self.begin_write().await?,
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

impl SchedulingTx {
    /// Up to `limit` active automations due at `now`, locked for this
    /// transaction; rows another scheduler holds are skipped.
    pub async fn claim_due(&mut self, now: DateTime<Utc>, limit: u32) -> Result<Vec<Automation>> {
        let sql = match self.backend {
            Backend::Postgres => DUE_PG,
            Backend::Sqlite => DUE_SQLITE,
        };
        // A row that does not decode is skipped, not allowed to stop every
        // other automation from firing.
        let decode = rows::skipping("due automation", crate::automations::decode);
        let params = (micros(now), i64::from(limit));
        let due = rows::all(&mut *self.tx, sql, params, decode).await?;
        Ok(due.into_iter().flatten().collect())
    }

    /// Whether a run of the automation is still live.
    pub async fn has_live_run(&mut self, automation_id: &str) -> Result<bool> {
        let live = rows::optional(&mut *self.tx, HAS_LIVE_RUN, (automation_id,), |_| Ok(()));
        Ok(live.await?.is_some())
    }

    /// Creates a run unless its (derived) id exists; `true` when created.
    pub async fn create_run(&mut self, new: &NewRun<'_>, now: DateTime<Utc>) -> Result<bool> {
        let created = crate::runs::insert(&mut self.tx, new, now).await?;
        if created && !new.state.is_terminal() {
            self.created_pending = true;
        }
        Ok(created)
    }

    /// Stores the receipt of a run created terminal (skipped, missed).
    pub async fn insert_receipt(&mut self, receipt: &Receipt) -> Result<()> {
        crate::receipts::insert(&mut self.tx, receipt).await
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
            sqlx::query("SELECT pg_notify('automesh_runs', '')")
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        if self.created_pending {
            crate::signal::runs_created();
        }
        Ok(self.created_pending)
    }
}
