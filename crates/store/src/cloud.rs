//! Cloud workers' lifecycle and cloud dispatch (SPEC §5).
//!
//! Worker states move only through guarded updates, so concurrent wakes of
//! one worker coalesce into one start (held as a lease by the replica that
//! starts it, so a start whose holder died is taken over once its lease
//! lapses), a lost agent is marked lost once (by its agent id), and idle
//! stop can never select a worker with a live run: the stop is one statement that requires the
//! worker idle past the cutoff *and* no unfinished dispatch row, while an
//! admission first writes its dispatch row and then touches the worker
//! (`last_active_at`) with an update that refuses a stopping worker — the
//! two updates serialise on the worker's row.

use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::rows::{from_hex, int, micros, opt_text, text, to_hex};
use crate::{Result, Store, StoreError};

/// What a wake found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// This caller moved the worker to `starting` and holds the start's
    /// lease: it must start it (and renew the lease while it does).
    Start,
    /// Someone else is starting it.
    Starting,
    /// It is ready: this agent answers at this endpoint.
    Ready { endpoint: String, agent_id: String },
    /// It is being stopped; wake again once it is stopped.
    Stopping,
}

/// A ready worker and the agent that answers for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyWorker {
    pub id: String,
    pub endpoint: String,
    pub agent_id: String,
}

const CLAIM_START: &str = "UPDATE cloud_workers SET state = 'starting', endpoint = NULL, \
     agent_id = NULL, starter = $3, start_until = $4, updated_at = $2, last_active_at = $2 \
     WHERE id = $1 AND (state IN ('stopped', 'failed') OR (state = 'starting' AND start_until < $2))";

const RENEW_START: &str = "UPDATE cloud_workers SET start_until = $3 \
     WHERE id = $1 AND state = 'starting' AND starter = $2";

const STATE: &str = "SELECT state, endpoint, agent_id FROM cloud_workers WHERE id = $1";

const READY: &str = "UPDATE cloud_workers SET state = 'ready', endpoint = $3, agent_id = $4, \
     updated_at = $5, last_active_at = $5 WHERE id = $1 AND state = 'starting' AND starter = $2";

const START_FAILED: &str = "UPDATE cloud_workers SET state = 'failed', endpoint = NULL, \
     agent_id = NULL, updated_at = $3 WHERE id = $1 AND state = 'starting' AND starter = $2";

const LOST: &str = "UPDATE cloud_workers SET state = 'failed', endpoint = NULL, agent_id = NULL, \
     updated_at = $3 WHERE id = $1 AND state = 'ready' AND agent_id = $2";

const FAILED: &str = "UPDATE cloud_workers SET state = 'failed', endpoint = NULL, agent_id = NULL, \
     updated_at = $2 WHERE id = $1 AND state IN ('starting', 'ready', 'stopping')";

const TOUCH: &str = "UPDATE cloud_workers SET last_active_at = $2 \
     WHERE id = $1 AND state IN ('ready', 'starting')";

const IDLE_CANDIDATES: &str = "SELECT id FROM cloud_workers \
     WHERE state = 'ready' AND last_active_at < $1 ORDER BY last_active_at LIMIT 100";

const READY_WORKERS: &str = "SELECT id, endpoint, agent_id FROM cloud_workers \
     WHERE state = 'ready' AND endpoint IS NOT NULL AND agent_id IS NOT NULL ORDER BY id LIMIT $1";

const BEGIN_STOP: &str = "UPDATE cloud_workers SET state = 'stopping', updated_at = $3 \
     WHERE id = $1 AND state = 'ready' AND last_active_at < $2 \
     AND NOT EXISTS (SELECT 1 FROM cloud_dispatch d WHERE d.worker_id = $1 AND d.phase <> 'finished')";

const STOPPED: &str = "UPDATE cloud_workers SET state = 'stopped', endpoint = NULL, \
     agent_id = NULL, updated_at = $2 WHERE id = $1 AND state = 'stopping'";

const BY_STATE: &str = "SELECT state, COUNT(*) AS n FROM cloud_workers GROUP BY state";

const UNDRIVEN: &str = "SELECT run_id FROM cloud_dispatch \
     WHERE phase <> 'finished' AND driver_until < $1 ORDER BY driver_until LIMIT $2";

const GET_DISPATCH: &str = "SELECT run_id, org_id, owner_id, worker_id, workspace_id, thread_id, \
     message_id, spec, phase, outcome, cancel_requested, wake_micros, admission_micros, \
     driver_owner, driver_until FROM cloud_dispatch WHERE run_id = $1";

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

/// Where a cloud run's admission is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloudPhase {
    /// Reserved; its worker is being woken.
    Waking,
    /// Its worker is ready; the message is not submitted yet.
    Admitted,
    /// The message was submitted to the worker's agent.
    Running,
    /// The outcome is recorded.
    Finished,
}

impl CloudPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            CloudPhase::Waking => "waking",
            CloudPhase::Admitted => "admitted",
            CloudPhase::Running => "running",
            CloudPhase::Finished => "finished",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        match s {
            "waking" => Ok(CloudPhase::Waking),
            "admitted" => Ok(CloudPhase::Admitted),
            "running" => Ok(CloudPhase::Running),
            "finished" => Ok(CloudPhase::Finished),
            other => Err(StoreError::Corrupt(format!("cloud phase {other:?}"))),
        }
    }
}

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
    pub phase: CloudPhase,
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
        phase: CloudPhase::parse(&text(row, "phase")?)?,
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
    /// Tries to move a worker towards running: see [`Wake`]. A start is
    /// claimed by `starter` until `until`; a start whose holder stopped
    /// renewing it (it died) can be claimed again once that has passed.
    pub async fn wake_worker(
        &self,
        worker_id: &str,
        starter: &str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<Wake> {
        let done = sqlx::query(CLAIM_START)
            .bind(worker_id)
            .bind(micros(now))
            .bind(starter)
            .bind(micros(until))
            .execute(self.db())
            .await?;
        if done.rows_affected() == 1 {
            return Ok(Wake::Start);
        }
        let row = sqlx::query(STATE)
            .bind(worker_id)
            .fetch_optional(self.db())
            .await?
            .ok_or(StoreError::NotFound)?;
        Ok(match text(&row, "state")?.as_str() {
            "ready" => match (opt_text(&row, "endpoint")?, opt_text(&row, "agent_id")?) {
                (Some(endpoint), Some(agent_id)) => Wake::Ready { endpoint, agent_id },
                _ => Wake::Starting,
            },
            "stopping" => Wake::Stopping,
            _ => Wake::Starting,
        })
    }

    /// Renews `starter`'s claim on a worker's start; false once it lost it.
    pub async fn renew_worker_start(
        &self,
        worker_id: &str,
        starter: &str,
        until: DateTime<Utc>,
    ) -> Result<bool> {
        crate::rows::changed_one(self.db(), RENEW_START, (worker_id, starter, micros(until))).await
    }

    /// The endpoint of a ready worker and the agent that answers there.
    pub async fn worker_endpoint(&self, worker_id: &str) -> Result<Option<ReadyWorker>> {
        let row = sqlx::query(STATE)
            .bind(worker_id)
            .fetch_optional(self.db())
            .await?;
        match row {
            Some(row) if text(&row, "state")? == "ready" => Ok(
                match (opt_text(&row, "endpoint")?, opt_text(&row, "agent_id")?) {
                    (Some(endpoint), Some(agent_id)) => Some(ReadyWorker {
                        id: worker_id.to_owned(),
                        endpoint,
                        agent_id,
                    }),
                    _ => None,
                },
            ),
            _ => Ok(None),
        }
    }

    /// The worker `starter` started is ready: `agent_id` answers at
    /// `endpoint`. False when the start was taken over meanwhile.
    pub async fn worker_ready(
        &self,
        worker_id: &str,
        starter: &str,
        endpoint: &str,
        agent_id: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        crate::rows::changed_one(
            self.db(),
            READY,
            (worker_id, starter, endpoint, agent_id, micros(now)),
        )
        .await
    }

    /// The start `starter` holds failed.
    pub async fn worker_start_failed(
        &self,
        worker_id: &str,
        starter: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        crate::rows::changed_one(self.db(), START_FAILED, (worker_id, starter, micros(now))).await
    }

    /// The agent `agent_id` of a ready worker stopped answering: the worker
    /// must be woken afresh. True for the one caller that marked it; false
    /// when another did, or the worker has a different agent by now.
    pub async fn worker_lost(
        &self,
        worker_id: &str,
        agent_id: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        crate::rows::changed_one(self.db(), LOST, (worker_id, agent_id, micros(now))).await
    }

    /// The worker failed (while it was being stopped, say).
    pub async fn worker_failed(&self, worker_id: &str, now: DateTime<Utc>) -> Result<bool> {
        crate::rows::changed_one(self.db(), FAILED, (worker_id, micros(now))).await
    }

    /// Up to `limit` ready workers with their agents.
    pub async fn ready_workers(&self, limit: u32) -> Result<Vec<ReadyWorker>> {
        let rows = sqlx::query(READY_WORKERS)
            .bind(i64::from(limit))
            .fetch_all(self.db())
            .await?;
        rows.iter()
            .map(|row| {
                Ok(ReadyWorker {
                    id: text(row, "id")?,
                    endpoint: text(row, "endpoint")?,
                    agent_id: text(row, "agent_id")?,
                })
            })
            .collect()
    }

    /// How many workers are in each state.
    pub async fn workers_by_state(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query(BY_STATE).fetch_all(self.db()).await?;
        rows.iter()
            .map(|r| Ok((text(r, "state")?, int(r, "n")?)))
            .collect()
    }

    /// Up to `limit` unfinished cloud runs whose driver stopped renewing its
    /// lease before `now` (its replica died): any replica resumes them.
    pub async fn undriven_cloud_runs(&self, now: DateTime<Utc>, limit: u32) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar(UNDRIVEN)
            .bind(micros(now))
            .bind(i64::from(limit))
            .fetch_all(self.db())
            .await?)
    }

    /// Marks the worker in use now; false unless it is ready or starting
    /// (a stopping or stopped worker must be woken again).
    pub async fn touch_worker(&self, worker_id: &str, now: DateTime<Utc>) -> Result<bool> {
        crate::rows::changed_one(self.db(), TOUCH, (worker_id, micros(now))).await
    }

    /// Ready workers unused since before `cutoff`.
    pub async fn idle_worker_candidates(&self, cutoff: DateTime<Utc>) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar(IDLE_CANDIDATES)
            .bind(micros(cutoff))
            .fetch_all(self.db())
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
        crate::rows::changed_one(
            self.db(),
            BEGIN_STOP,
            (worker_id, micros(cutoff), micros(now)),
        )
        .await
    }

    /// The worker this caller was stopping is stopped.
    pub async fn worker_stopped(&self, worker_id: &str, now: DateTime<Utc>) -> Result<bool> {
        crate::rows::changed_one(self.db(), STOPPED, (worker_id, micros(now))).await
    }

    /// Reserves a cloud run's identity; false when it was reserved before
    /// (the existing reservation stands).
    pub async fn reserve_cloud_run(&self, r: &Reservation<'_>, now: DateTime<Utc>) -> Result<bool> {
        crate::rows::changed_one(
            self.db(),
            RESERVE,
            (
                r.run_id,
                r.org_id,
                r.owner_id,
                r.worker_id,
                r.workspace_id,
                r.thread_id,
                r.message_id,
                to_hex(r.spec),
                micros(now),
            ),
        )
        .await
    }

    /// One cloud run's dispatch.
    pub async fn cloud_run(&self, run_id: &str) -> Result<Option<CloudDispatch>> {
        crate::rows::maybe(self.db(), GET_DISPATCH, run_id, decode).await
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
        crate::rows::changed_one(
            self.db(),
            TAKE_DRIVE,
            (run_id, owner, micros(until), micros(now)),
        )
        .await
    }

    /// Records progress of an unfinished cloud run.
    pub async fn set_cloud_phase(
        &self,
        run_id: &str,
        phase: CloudPhase,
        wake_micros: i64,
        admission_micros: i64,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        crate::rows::changed_one(
            self.db(),
            SET_PHASE,
            (
                run_id,
                phase.as_str(),
                wake_micros,
                admission_micros,
                micros(now),
            ),
        )
        .await
    }

    /// Records a cloud run's outcome (once).
    pub async fn finish_cloud_run(
        &self,
        run_id: &str,
        outcome: &[u8],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        crate::rows::changed_one(self.db(), FINISH, (run_id, to_hex(outcome), micros(now))).await
    }

    /// Asks for a cloud run to be cancelled.
    pub async fn cancel_cloud_run(&self, run_id: &str, now: DateTime<Utc>) -> Result<bool> {
        crate::rows::changed_one(self.db(), CANCEL, (run_id, micros(now))).await
    }
}
