//! The scheduler's transaction: claim due automations (row locks that other
//! replicas skip on PostgreSQL; the single writer lock on SQLite), create
//! their runs and receipts, and advance their next occurrence — all or
//! nothing.

use automesh_domain::run::NewRun;
use automesh_domain::{Automation, Receipt};
use chrono::{DateTime, Utc};
use sqlx::{Any, Transaction};

use crate::automations::automation_columns;
use crate::rows::{micros, opt_micros};
use crate::runs::live_states;
use crate::{Backend, Result, Store};

const DUE_PG: &str = concat!(
    "SELECT ",
    automation_columns!(),
    " FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL AND next_run_at <= $1 \
     ORDER BY next_run_at LIMIT $2 FOR UPDATE SKIP LOCKED"
);

const DUE_SQLITE: &str = concat!(
    "SELECT ",
    automation_columns!(),
    " FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL AND next_run_at <= $1 \
     ORDER BY next_run_at LIMIT $2"
);

const NEXT_DUE: &str =
    "SELECT MIN(next_run_at) FROM automations WHERE state = 'active' AND next_run_at IS NOT NULL";

const HAS_LIVE_RUN: &str = concat!(
    "SELECT COUNT(*) FROM runs WHERE automation_id = $1 \
     AND state IN ",
    live_states!()
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
        let v: Option<i64> = sqlx::query_scalar(NEXT_DUE).fetch_one(self.db()).await?;
        Ok(v.and_then(DateTime::from_timestamp_micros))
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
        let rows = sqlx::query(sql)
            .bind(micros(now))
            .bind(i64::from(limit))
            .fetch_all(&mut *self.tx)
            .await?;
        // A row that does not decode is logged and skipped, not allowed to
        // stop every other automation from firing.
        Ok(rows
            .iter()
            .filter_map(|row| match crate::automations::decode(row) {
                Ok(a) => Some(a),
                Err(error) => {
                    tracing::error!(%error, "due automation does not decode; skipped");
                    None
                }
            })
            .collect())
    }

    /// Whether a run of the automation is still live.
    pub async fn has_live_run(&mut self, automation_id: &str) -> Result<bool> {
        let n: i64 = sqlx::query_scalar(HAS_LIVE_RUN)
            .bind(automation_id)
            .fetch_one(&mut *self.tx)
            .await?;
        Ok(n > 0)
    }

    /// Creates a run unless its (derived) id exists; `true` when created.
    pub async fn create_run(&mut self, new: &NewRun, now: DateTime<Utc>) -> Result<bool> {
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
        sqlx::query(ADVANCE)
            .bind(automation_id)
            .bind(opt_micros(next))
            .bind(micros(now))
            .execute(&mut *self.tx)
            .await?;
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
