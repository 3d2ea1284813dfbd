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
