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

use automesh_domain::WorkerState;
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::rows::{self, col, micros, to_hex};
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

/// A guarded move of a cloud worker's state, applied only from the state it
/// names and, where it names one, only for the holder of the worker's start
/// or the agent it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerMove<'a> {
    /// `starter` renews its claim on the worker's start until `until`.
    RenewStart {
        starter: &'a str,
        until: DateTime<Utc>,
    },
    /// The worker `starter` started is ready: `agent_id` answers at
    /// `endpoint`. Refused when the start was taken over meanwhile.
    Ready {
        starter: &'a str,
        endpoint: &'a str,
        agent_id: &'a str,
    },
    /// The start `starter` holds failed.
    StartFailed { starter: &'a str },
    /// The agent `agent_id` of a ready worker stopped answering: the worker
    /// must be woken afresh. Applies for the one caller that marks it, and
    /// not once the worker has a different agent.
    Lost { agent_id: &'a str },
    /// The worker failed (while it was being stopped, say).
    Failed,
    /// The worker is in use now; refused unless it is ready or starting (a
    /// stopping or stopped worker must be woken again).
    Touch,
    /// An idle worker starts stopping — only if it is still ready, unused
    /// since `cutoff`, and has no live run. When it applies, the caller must
    /// now stop it.
    BeginStop { cutoff: DateTime<Utc> },
    /// The worker this caller was stopping is stopped.
    Stopped,
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

const STATE: &str = "SELECT id, state, endpoint, agent_id FROM cloud_workers WHERE id = $1";

/// A worker's state, and its agent when it has one.
fn decode_state(row: &AnyRow) -> Result<(WorkerState, Option<ReadyWorker>)> {
    let agent = (col(row, "endpoint")?, col(row, "agent_id")?);
    let ready = match agent {
        (Some(endpoint), Some(agent_id)) => Some(ReadyWorker {
            id: col(row, "id")?,
            endpoint,
            agent_id,
        }),
        _ => None,
    };
    Ok((col(row, "state")?, ready))
}

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

const READY_WORKERS: &str = "SELECT id, state, endpoint, agent_id FROM cloud_workers \
     WHERE state = 'ready' AND endpoint IS NOT NULL AND agent_id IS NOT NULL ORDER BY id LIMIT $1";

const BEGIN_STOP: &str = "UPDATE cloud_workers SET state = 'stopping', updated_at = $3 \
     WHERE id = $1 AND state = 'ready' AND last_active_at < $2 \
     AND NOT EXISTS (SELECT 1 FROM cloud_dispatch d WHERE d.worker_id = $1 AND d.phase <> 'finished')";

const STOPPED: &str = "UPDATE cloud_workers SET state = 'stopped', endpoint = NULL, \
     agent_id = NULL, updated_at = $2 WHERE id = $1 AND state = 'stopping'";

const BY_STATE: &str = "SELECT state, COUNT(*) AS n FROM cloud_workers GROUP BY state";

const UNDRIVEN: &str = "SELECT run_id FROM cloud_dispatch \
     WHERE phase <> 'finished' AND driver_until < $1 ORDER BY driver_until LIMIT $2";

/// A stopping replica `$1` hands back its drives: each unfinished run it
/// drives is undriven at once (another replica's resume pass takes it).
const RELEASE_DRIVES: &str = "UPDATE cloud_dispatch SET driver_until = 0 \
     WHERE driver_owner = $1 AND phase <> 'finished'";

/// … and the starts it holds: each worker it was starting is claimable at
/// once (its start, dying with the replica, is made again by another).
const RELEASE_STARTS: &str = "UPDATE cloud_workers SET start_until = 0 \
     WHERE starter = $1 AND state = 'starting'";

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

automesh_domain::string_enum! {
    /// Where a cloud run's admission is.
    CloudPhase {
        /// Reserved; its worker is being woken.
        Waking => "waking",
        /// Its worker is ready; the message is not submitted yet.
        Admitted => "admitted",
        /// The message was submitted to the worker's agent.
        Running => "running",
        /// The outcome is recorded.
        Finished => "finished",
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
    rows::columns! { row => CloudDispatch {
        run_id, org_id, owner_id, worker_id, workspace_id, thread_id, message_id, spec, phase,
        outcome, cancel_requested, wake_micros, admission_micros,
    } }
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
        let params = (worker_id, micros(now), starter, micros(until));
        if rows::changed_one(self.db(), CLAIM_START, params).await? {
            return Ok(Wake::Start);
        }
        let state = rows::optional(self.db(), STATE, (worker_id,), decode_state).await?;
        Ok(match state.ok_or(StoreError::NotFound)? {
            (WorkerState::Ready, Some(ready)) => Wake::Ready {
                endpoint: ready.endpoint,
                agent_id: ready.agent_id,
            },
            (WorkerState::Stopping, _) => Wake::Stopping,
            _ => Wake::Starting,
        })
    }

    /// The endpoint of a ready worker and the agent that answers there.
    pub async fn worker_endpoint(&self, worker_id: &str) -> Result<Option<ReadyWorker>> {
        Ok(
            match rows::optional(self.db(), STATE, (worker_id,), decode_state).await? {
                Some((WorkerState::Ready, ready)) => ready,
                _ => None,
            },
        )
    }

    /// Up to `limit` ready workers with their agents.
    pub async fn ready_workers(&self, limit: u32) -> Result<Vec<ReadyWorker>> {
        let workers = rows::all(self.db(), READY_WORKERS, (i64::from(limit),), decode_state);
        Ok(workers.await?.into_iter().filter_map(|(_, w)| w).collect())
    }

    /// How many workers are in each state.
    pub async fn workers_by_state(&self) -> Result<Vec<(String, i64)>> {
        rows::all(self.db(), BY_STATE, (), |r| {
            Ok((col(r, "state")?, col(r, "n")?))
        })
        .await
    }

    /// Up to `limit` unfinished cloud runs whose driver stopped renewing its
    /// lease before `now` (its replica died): any replica resumes them.
    pub async fn undriven_cloud_runs(&self, now: DateTime<Utc>, limit: u32) -> Result<Vec<String>> {
        let params = (micros(now), i64::from(limit));
        rows::all(self.db(), UNDRIVEN, params, |r| col(r, "run_id")).await
    }

    /// Ready workers unused since before `cutoff`.
    pub async fn idle_worker_candidates(&self, cutoff: DateTime<Utc>) -> Result<Vec<String>> {
        rows::all(self.db(), IDLE_CANDIDATES, (micros(cutoff),), |r| {
            col(r, "id")
        })
        .await
    }

    /// Makes the guarded move `m` of a worker's state: true when it applied,
    /// false when the worker was not where the move starts from (or not the
    /// caller's to move).
    pub async fn move_worker(
        &self,
        worker_id: &str,
        m: WorkerMove<'_>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let (db, at) = (self.db(), micros(now));
        match m {
            WorkerMove::RenewStart { starter, until } => {
                rows::changed_one(db, RENEW_START, (worker_id, starter, micros(until))).await
            }
            WorkerMove::Ready {
                starter,
                endpoint,
                agent_id,
            } => rows::changed_one(db, READY, (worker_id, starter, endpoint, agent_id, at)).await,
            WorkerMove::StartFailed { starter } => {
                rows::changed_one(db, START_FAILED, (worker_id, starter, at)).await
            }
            WorkerMove::Lost { agent_id } => {
                rows::changed_one(db, LOST, (worker_id, agent_id, at)).await
            }
            WorkerMove::Failed => rows::changed_one(db, FAILED, (worker_id, at)).await,
            WorkerMove::Touch => rows::changed_one(db, TOUCH, (worker_id, at)).await,
            WorkerMove::BeginStop { cutoff } => {
                rows::changed_one(db, BEGIN_STOP, (worker_id, micros(cutoff), at)).await
            }
            WorkerMove::Stopped => rows::changed_one(db, STOPPED, (worker_id, at)).await,
        }
    }

    /// Reserves a cloud run's identity; false when it was reserved before
    /// (the existing reservation stands).
    pub async fn reserve_cloud_run(&self, r: &Reservation<'_>, now: DateTime<Utc>) -> Result<bool> {
        rows::changed_one(
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

    /// Hands back everything `replica` holds, as it stops: its runs'
    /// drives and its workers' starts, claimable by another replica at once
    /// instead of when their leases lapse. How many of each.
    pub async fn release_cloud_claims(&self, replica: &str) -> Result<(u64, u64)> {
        let mut tx = self.begin_write().await?;
        let drives = rows::execute(&mut *tx, RELEASE_DRIVES, (replica,)).await?;
        let starts = rows::execute(&mut *tx, RELEASE_STARTS, (replica,)).await?;
        tx.commit().await?;
        Ok((drives, starts))
    }

    /// One cloud run's dispatch.
    pub async fn cloud_run(&self, run_id: &str) -> Result<Option<CloudDispatch>> {
        rows::optional(self.db(), GET_DISPATCH, (run_id,), decode).await
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
        rows::changed_one(
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
        rows::changed_one(
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
        rows::changed_one(self.db(), FINISH, (run_id, to_hex(outcome), micros(now))).await
    }

    /// Asks for a cloud run to be cancelled.
    pub async fn cancel_cloud_run(&self, run_id: &str, now: DateTime<Utc>) -> Result<bool> {
        rows::changed_one(self.db(), CANCEL, (run_id, micros(now))).await
    }
}
