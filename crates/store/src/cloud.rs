//! Cloud workers' lifecycle and cloud dispatch (SPEC §5).
//!
//! Worker states move only through guarded updates, so concurrent wakes of
//! one worker coalesce into one start, and idle stop can never select a
//! worker with a live run: the stop is one statement that requires the
//! worker idle past the cutoff *and* no unfinished dispatch row, while an
//! admission first writes its dispatch row and then touches the worker
//! (`last_active_at`) with an update that refuses a stopping worker — the
//! two updates serialise on the worker's row.

use chrono::{DateTime, Duration, Utc};
use sqlx::any::AnyRow;

use crate::rows::{from_hex, int, micros, opt_text, text, to_hex};
use crate::{Result, Store, StoreError};

/// What a wake found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// This caller moved the worker to `starting`: it must start it.
    Start,
    /// Someone else is starting it.
    Starting,
    /// It is ready at this endpoint.
    Ready(String),
    /// It is being stopped; wake again once it is stopped.
    Stopping,
}

const CLAIM_START: &str = "UPDATE cloud_workers SET state = 'starting', endpoint = NULL, \
     updated_at = $2, last_active_at = $2 \
     WHERE id = $1 AND (state IN ('stopped', 'failed') OR (state = 'starting' AND updated_at < $3))";

const STATE: &str = "SELECT state, endpoint FROM cloud_workers WHERE id = $1";

const READY: &str = "UPDATE cloud_workers SET state = 'ready', endpoint = $2, updated_at = $3, \
     last_active_at = $3 WHERE id = $1 AND state = 'starting'";

const FAILED: &str = "UPDATE cloud_workers SET state = 'failed', endpoint = NULL, updated_at = $2 \
     WHERE id = $1 AND state IN ('starting', 'ready', 'stopping')";

const TOUCH: &str = "UPDATE cloud_workers SET last_active_at = $2 \
     WHERE id = $1 AND state IN ('ready', 'starting')";

const IDLE_CANDIDATES: &str = "SELECT id FROM cloud_workers \
     WHERE state = 'ready' AND last_active_at < $1 ORDER BY last_active_at LIMIT 100";

const BEGIN_STOP: &str = "UPDATE cloud_workers SET state = 'stopping', updated_at = $3 \
     WHERE id = $1 AND state = 'ready' AND last_active_at < $2 \
     AND NOT EXISTS (SELECT 1 FROM cloud_dispatch d WHERE d.worker_id = $1 AND d.phase <> 'finished')";

const STOPPED: &str = "UPDATE cloud_workers SET state = 'stopped', endpoint = NULL, updated_at = $2 \
     WHERE id = $1 AND state = 'stopping'";

const DISPATCH_COLUMNS: &str = "run_id, org_id, owner_id, worker_id, workspace_id, thread_id, \
     message_id, spec, phase, outcome, cancel_requested, wake_micros, admission_micros, \
     driver_owner, driver_until";

const RESERVE: &str = "INSERT INTO cloud_dispatch (run_id, org_id, owner_id, worker_id, workspace_id, \
     thread_id, message_id, spec, created_at, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9) ON CONFLICT (run_id) DO NOTHING";

const TAKE_DRIVE: &str = "UPDATE cloud_dispatch SET driver_owner = $2, driver_until = $3 \
     WHERE run_id = $1 AND phase <> 'finished' AND (driver_until < $4 OR driver_owner = $2)";

const SET_PHASE: &str = "UPDATE cloud_dispatch SET phase = $2, wake_micros = $3, \
     admission_micros = $4, updated_at = $5 WHERE run_id = $1 AND phase <> 'finished'";

const FINISH: &str = "UPDATE cloud_dispatch SET phase = 'finished', outcome = $2, updated_at = $3 \
     WHERE run_id = $1 AND phase <> 'finished'";

const CANCEL: &str =
    "UPDATE cloud_dispatch SET cancel_requested = 1, updated_at = $2 WHERE run_id = $1";

/// A cloud run's reserved identity and where its admission is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudDispatch {
    pub run_id: String,
    pub org_id: String,
    pub owner_id: String,
    pub worker_id: String,
    pub workspace_id: String,
    pub thread_id: String,
    pub message_id: String,
    pub spec: Vec<u8>,
    /// `waking`, `admitted`, `running` or `finished`.
    pub phase: String,
    pub outcome: Option<Vec<u8>>,
    pub cancel_requested: bool,
    pub wake_micros: i64,
    pub admission_micros: i64,
}

fn decode(row: &AnyRow) -> Result<CloudDispatch> {
    Ok(CloudDispatch {
        run_id: text(row, "run_id")?,
        org_id: text(row, "org_id")?,
        owner_id: text(row, "owner_id")?,
        worker_id: text(row, "worker_id")?,
        workspace_id: text(row, "workspace_id")?,
        thread_id: text(row, "thread_id")?,
        message_id: text(row, "message_id")?,
        spec: from_hex(&text(row, "spec")?)?,
        phase: text(row, "phase")?,
        outcome: opt_text(row, "outcome")?
            .map(|h| from_hex(&h))
            .transpose()?,
        cancel_requested: int(row, "cancel_requested")? != 0,
        wake_micros: int(row, "wake_micros")?,
        admission_micros: int(row, "admission_micros")?,
    })
}

/// A new reservation.
#[derive(Debug, Clone)]
pub struct Reservation<'a> {
    pub run_id: &'a str,
    pub org_id: &'a str,
    pub owner_id: &'a str,
    pub worker_id: &'a str,
    pub workspace_id: &'a str,
    pub thread_id: &'a str,
    pub message_id: &'a str,
    pub spec: &'a [u8],
}

impl Store {
    /// Tries to move a worker towards running: see [`Wake`]. A worker stuck
    /// `starting` longer than `stale_after` (its starter died) can be
    /// claimed again.
    pub async fn wake_worker(
        &self,
        worker_id: &str,
        stale_after: Duration,
        now: DateTime<Utc>,
    ) -> Result<Wake> {
        let done = sqlx::query(CLAIM_START)
            .bind(worker_id)
            .bind(micros(now))
            .bind(micros(now - stale_after))
            .execute(self.pool())
            .await?;
        if done.rows_affected() == 1 {
            return Ok(Wake::Start);
        }
        let row = sqlx::query(STATE)
            .bind(worker_id)
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound)?;
        Ok(match text(&row, "state")?.as_str() {
            "ready" => match opt_text(&row, "endpoint")? {
                Some(e) => Wake::Ready(e),
                None => Wake::Starting,
            },
            "stopping" => Wake::Stopping,
            _ => Wake::Starting,
        })
    }

    /// The endpoint of a ready worker.
    pub async fn worker_endpoint(&self, worker_id: &str) -> Result<Option<String>> {
        let row = sqlx::query(STATE)
            .bind(worker_id)
            .fetch_optional(self.pool())
            .await?;
        match row {
            Some(row) if text(&row, "state")? == "ready" => opt_text(&row, "endpoint"),
            _ => Ok(None),
        }
    }

    /// The worker this caller started is ready at `endpoint`.
    pub async fn worker_ready(
        &self,
        worker_id: &str,
        endpoint: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let done = sqlx::query(READY)
            .bind(worker_id)
            .bind(endpoint)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The worker failed (to start, or while running).
    pub async fn worker_failed(&self, worker_id: &str, now: DateTime<Utc>) -> Result<bool> {
        let done = sqlx::query(FAILED)
            .bind(worker_id)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Marks the worker in use now; false unless it is ready or starting
    /// (a stopping or stopped worker must be woken again).
    pub async fn touch_worker(&self, worker_id: &str, now: DateTime<Utc>) -> Result<bool> {
        let done = sqlx::query(TOUCH)
            .bind(worker_id)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Ready workers unused since before `cutoff`.
    pub async fn idle_worker_candidates(&self, cutoff: DateTime<Utc>) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar(IDLE_CANDIDATES)
            .bind(micros(cutoff))
            .fetch_all(self.pool())
            .await?)
    }

    /// Moves an idle worker to `stopping` — only if it is still ready, still
    /// unused since `cutoff`, and has no live run. True when the caller must
    /// now stop it.
    pub async fn begin_worker_stop(
        &self,
        worker_id: &str,
        cutoff: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let done = sqlx::query(BEGIN_STOP)
            .bind(worker_id)
            .bind(micros(cutoff))
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The worker this caller was stopping is stopped.
    pub async fn worker_stopped(&self, worker_id: &str, now: DateTime<Utc>) -> Result<bool> {
        let done = sqlx::query(STOPPED)
            .bind(worker_id)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Reserves a cloud run's identity; false when it was reserved before
    /// (the existing reservation stands).
    pub async fn reserve_cloud_run(&self, r: &Reservation<'_>, now: DateTime<Utc>) -> Result<bool> {
        let done = sqlx::query(RESERVE)
            .bind(r.run_id)
            .bind(r.org_id)
            .bind(r.owner_id)
            .bind(r.worker_id)
            .bind(r.workspace_id)
            .bind(r.thread_id)
            .bind(r.message_id)
            .bind(to_hex(r.spec))
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// One cloud run's dispatch.
    pub async fn cloud_run(&self, run_id: &str) -> Result<Option<CloudDispatch>> {
        let sql = format!("SELECT {DISPATCH_COLUMNS} FROM cloud_dispatch WHERE run_id = $1");
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .fetch_optional(self.pool())
            .await?
            .as_ref()
            .map(decode)
            .transpose()
    }

    /// Takes (or renews) the right to drive a cloud run's admission until
    /// `until`: false while another live driver has it.
    pub async fn take_cloud_drive(
        &self,
        run_id: &str,
        owner: &str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let done = sqlx::query(TAKE_DRIVE)
            .bind(run_id)
            .bind(owner)
            .bind(micros(until))
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Records progress of an unfinished cloud run.
    pub async fn set_cloud_phase(
        &self,
        run_id: &str,
        phase: &str,
        wake_micros: i64,
        admission_micros: i64,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let done = sqlx::query(SET_PHASE)
            .bind(run_id)
            .bind(phase)
            .bind(wake_micros)
            .bind(admission_micros)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Records a cloud run's outcome (once).
    pub async fn finish_cloud_run(
        &self,
        run_id: &str,
        outcome: &[u8],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let done = sqlx::query(FINISH)
            .bind(run_id)
            .bind(to_hex(outcome))
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Asks for a cloud run to be cancelled.
    pub async fn cancel_cloud_run(&self, run_id: &str, now: DateTime<Utc>) -> Result<bool> {
        let done = sqlx::query(CANCEL)
            .bind(run_id)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }
}
