//! Desktop dispatch shared by every runner-gateway replica (SPEC §6).
//!
//! An assignment is offered (idempotent by run id) by whichever replica the
//! coordinator called; the replica holding a stream of the owner's runner
//! claims it for that runner with a guarded update — so exactly one replica
//! sends it — and writes back what the runner reports. Every change signals
//! [`Topic::Desktop`], which wakes replicas in this process and, through
//! NOTIFY, in others. Bodies (the run spec, the outcome, events) are opaque
//! protobuf bytes to the store, kept hex-encoded so both backends share one
//! column type.

use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::rows::{from_hex, int, micros, opt_text, text, to_hex};
use crate::signal::Topic;
use crate::{Result, Store, StoreError};

/// Where an assignment is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DesktopPhase {
    /// Offered; no runner has accepted it yet.
    Admitted,
    /// A runner accepted it.
    Running,
    /// The runner reported its result.
    Finished,
}

impl DesktopPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            DesktopPhase::Admitted => "admitted",
            DesktopPhase::Running => "running",
            DesktopPhase::Finished => "finished",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        match s {
            "admitted" => Ok(DesktopPhase::Admitted),
            "running" => Ok(DesktopPhase::Running),
            "finished" => Ok(DesktopPhase::Finished),
            other => Err(StoreError::Corrupt(format!("desktop phase {other:?}"))),
        }
    }
}

/// One desktop assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesktopAssignment {
    pub run_id: String,
    pub org_id: String,
    pub owner_id: String,
    /// The encoded run spec.
    pub spec: Vec<u8>,
    /// The runner it is claimed for, if any.
    pub runner_id: Option<String>,
    pub phase: DesktopPhase,
    pub idle: bool,
    /// The encoded outcome, once finished.
    pub outcome: Option<Vec<u8>>,
    pub cancel_requested: bool,
    pub cancel_reason: Option<String>,
    pub event_count: i64,
}

/// One event a runner reported, in the run's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesktopEvent {
    pub sequence: i64,
    pub event_id: String,
    /// The encoded event.
    pub body: Vec<u8>,
}

const COLUMNS: &str = "run_id, org_id, owner_id, spec, runner_id, phase, idle, outcome, \
     cancel_requested, cancel_reason, event_count";

const OFFER: &str = "INSERT INTO desktop_assignments \
     (run_id, org_id, owner_id, spec, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $5) \
     ON CONFLICT (run_id) DO NOTHING";

const CLAIM: &str = "UPDATE desktop_assignments SET runner_id = $2, updated_at = $3 \
     WHERE run_id = $1 AND phase <> 'finished' AND cancel_requested = 0 \
     AND (runner_id IS NULL OR runner_id = $2)";

const RELEASE_UNACCEPTED: &str = "UPDATE desktop_assignments SET runner_id = NULL, updated_at = $2 \
     WHERE runner_id = $1 AND phase = 'admitted'";

const ACCEPTED: &str = "UPDATE desktop_assignments SET phase = 'running', updated_at = $3 \
     WHERE run_id = $1 AND runner_id = $2 AND phase = 'admitted'";

const FINISHED: &str = "UPDATE desktop_assignments \
     SET phase = 'finished', idle = 1, outcome = $3, updated_at = $4 \
     WHERE run_id = $1 AND runner_id = $2 AND phase <> 'finished'";

const IDLE: &str = "UPDATE desktop_assignments SET idle = 1, updated_at = $3 \
     WHERE run_id = $1 AND runner_id = $2";

/// A run no runner holds is idle the moment it is cancelled.
const CANCEL: &str = "UPDATE desktop_assignments SET cancel_requested = 1, \
     cancel_reason = COALESCE(cancel_reason, $2), \
     idle = CASE WHEN runner_id IS NULL OR phase = 'finished' THEN 1 ELSE idle END, \
     updated_at = $3 WHERE run_id = $1";

const LOCK_EVENTS: &str = "UPDATE desktop_assignments SET event_count = event_count \
     WHERE run_id = $1 AND runner_id = $2 RETURNING event_count";

const FIND_EVENT: &str = "SELECT seq FROM desktop_events WHERE run_id = $1 AND event_id = $2";

const INSERT_EVENT: &str =
    "INSERT INTO desktop_events (run_id, seq, event_id, body) VALUES ($1, $2, $3, $4)";

const SET_EVENT_COUNT: &str =
    "UPDATE desktop_assignments SET event_count = $2, updated_at = $3 WHERE run_id = $1";

const EVENTS_AFTER: &str = "SELECT seq, event_id, body FROM desktop_events \
     WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3";

const DELETE_FINISHED_EVENTS_BEFORE: &str = "DELETE FROM desktop_events WHERE run_id IN \
     (SELECT run_id FROM desktop_assignments WHERE phase = 'finished' AND updated_at < $1)";

const DELETE_FINISHED_BEFORE: &str =
    "DELETE FROM desktop_assignments WHERE phase = 'finished' AND updated_at < $1";

fn decode(row: &AnyRow) -> Result<DesktopAssignment> {
    Ok(DesktopAssignment {
        run_id: text(row, "run_id")?,
        org_id: text(row, "org_id")?,
        owner_id: text(row, "owner_id")?,
        spec: from_hex(&text(row, "spec")?)?,
        runner_id: opt_text(row, "runner_id")?,
        phase: DesktopPhase::parse(&text(row, "phase")?)?,
        idle: int(row, "idle")? != 0,
        outcome: opt_text(row, "outcome")?
            .map(|h| from_hex(&h))
            .transpose()?,
        cancel_requested: int(row, "cancel_requested")? != 0,
        cancel_reason: opt_text(row, "cancel_reason")?,
        event_count: int(row, "event_count")?,
    })
}

impl Store {
    async fn desktop_changed(&self) {
        if let Err(error) = self.signal(Topic::Desktop).await {
            // Only a hint: replicas poll as well.
            tracing::warn!(%error, "cannot signal a desktop change");
        }
    }

    async fn select_assignments(
        &self,
        filter: &'static str,
        binds: &[&str],
        limit: u32,
    ) -> Result<Vec<DesktopAssignment>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM desktop_assignments WHERE {filter} ORDER BY created_at LIMIT {limit}"
        );
        // Built only from the constant filters of this module.
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for b in binds {
            q = q.bind(*b);
        }
        let rows = q.fetch_all(self.pool()).await?;
        rows.iter().map(decode).collect()
    }

    /// Offers a desktop run; returns false when it was already offered (the
    /// existing assignment stands).
    pub async fn offer_desktop_run(
        &self,
        run_id: &str,
        org_id: &str,
        owner_id: &str,
        spec: &[u8],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let done = sqlx::query(OFFER)
            .bind(run_id)
            .bind(org_id)
            .bind(owner_id)
            .bind(to_hex(spec))
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        let offered = done.rows_affected() == 1;
        if offered {
            self.desktop_changed().await;
        }
        Ok(offered)
    }

    /// One assignment.
    pub async fn desktop_run(&self, run_id: &str) -> Result<Option<DesktopAssignment>> {
        Ok(self
            .select_assignments("run_id = $1", &[run_id], 1)
            .await?
            .pop())
    }

    /// Unfinished assignments of an owner that `runner_id` holds or that no
    /// runner holds: what a (re)connecting runner should be running.
    pub async fn desktop_runs_for_runner(
        &self,
        org_id: &str,
        owner_id: &str,
        runner_id: &str,
        limit: u32,
    ) -> Result<Vec<DesktopAssignment>> {
        self.select_assignments(
            "org_id = $1 AND owner_id = $2 AND phase <> 'finished' \
             AND (runner_id IS NULL OR runner_id = $3)",
            &[org_id, owner_id, runner_id],
            limit,
        )
        .await
    }

    /// Assignments waiting for a runner, oldest first.
    pub async fn unclaimed_desktop_runs(&self, limit: u32) -> Result<Vec<DesktopAssignment>> {
        self.select_assignments(
            "phase = 'admitted' AND runner_id IS NULL AND cancel_requested = 0",
            &[],
            limit,
        )
        .await
    }

    /// Cancelled assignments a runner holds and has not yet reported idle.
    pub async fn cancelling_desktop_runs(&self, limit: u32) -> Result<Vec<DesktopAssignment>> {
        self.select_assignments(
            "cancel_requested = 1 AND idle = 0 AND runner_id IS NOT NULL",
            &[],
            limit,
        )
        .await
    }

    /// Claims an assignment for `runner_id`: true when it is now that
    /// runner's (or already was), false when another runner holds it or it
    /// is finished or cancelled.
    pub async fn claim_desktop_run(
        &self,
        run_id: &str,
        runner_id: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let done = sqlx::query(CLAIM)
            .bind(run_id)
            .bind(runner_id)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives back the assignments `runner_id` was offered but never accepted
    /// (its stream ended), so another runner of the owner may take them.
    pub async fn release_unaccepted_desktop_runs(
        &self,
        runner_id: &str,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let done = sqlx::query(RELEASE_UNACCEPTED)
            .bind(runner_id)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        if done.rows_affected() > 0 {
            self.desktop_changed().await;
        }
        Ok(done.rows_affected())
    }

    /// The runner accepted the assignment.
    pub async fn desktop_run_accepted(
        &self,
        run_id: &str,
        runner_id: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        self.desktop_update(ACCEPTED, run_id, runner_id, None, now)
            .await
    }

    /// The runner reported the run's result (and so its engine is idle).
    pub async fn desktop_run_finished(
        &self,
        run_id: &str,
        runner_id: &str,
        outcome: &[u8],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        self.desktop_update(FINISHED, run_id, runner_id, Some(to_hex(outcome)), now)
            .await
    }

    /// The runner's engine is idle for the run.
    pub async fn desktop_run_idle(
        &self,
        run_id: &str,
        runner_id: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        self.desktop_update(IDLE, run_id, runner_id, None, now)
            .await
    }

    async fn desktop_update(
        &self,
        sql: &'static str,
        run_id: &str,
        runner_id: &str,
        body: Option<String>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let mut q = sqlx::query(sql).bind(run_id).bind(runner_id);
        if let Some(body) = body {
            q = q.bind(body);
        }
        let done = q.bind(micros(now)).execute(self.pool()).await?;
        let changed = done.rows_affected() == 1;
        if changed {
            self.desktop_changed().await;
        }
        Ok(changed)
    }

    /// Asks for the run to be cancelled; returns the assignment as it now is
    /// (None when it was never offered).
    pub async fn cancel_desktop_run(
        &self,
        run_id: &str,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DesktopAssignment>> {
        let done = sqlx::query(CANCEL)
            .bind(run_id)
            .bind(reason)
            .bind(micros(now))
            .execute(self.pool())
            .await?;
        if done.rows_affected() == 1 {
            self.desktop_changed().await;
        }
        self.desktop_run(run_id).await
    }

    /// Appends what `runner_id` reported for a run, skipping event ids the
    /// log already holds; returns how many were appended. Events of a run
    /// the runner does not hold are refused (none appended).
    pub async fn append_desktop_events(
        &self,
        run_id: &str,
        runner_id: &str,
        events: &[(String, Vec<u8>)],
        now: DateTime<Utc>,
    ) -> Result<usize> {
        let mut tx = self.begin_write().await?;
        let Some(mut seq): Option<i64> = sqlx::query_scalar(LOCK_EVENTS)
            .bind(run_id)
            .bind(runner_id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(0);
        };
        let mut appended = 0;
        for (event_id, body) in events {
            let existing: Option<i64> = sqlx::query_scalar(FIND_EVENT)
                .bind(run_id)
                .bind(event_id)
                .fetch_optional(&mut *tx)
                .await?;
            if existing.is_some() {
                continue;
            }
            seq += 1;
            sqlx::query(INSERT_EVENT)
                .bind(run_id)
                .bind(seq)
                .bind(event_id)
                .bind(to_hex(body))
                .execute(&mut *tx)
                .await?;
            appended += 1;
        }
        if appended > 0 {
            sqlx::query(SET_EVENT_COUNT)
                .bind(run_id)
                .bind(seq)
                .bind(micros(now))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        if appended > 0 {
            self.desktop_changed().await;
        }
        Ok(appended)
    }

    /// Up to `limit` events of a run after sequence `after`.
    pub async fn desktop_events_after(
        &self,
        run_id: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<DesktopEvent>> {
        let rows = sqlx::query(EVENTS_AFTER)
            .bind(run_id)
            .bind(after)
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|row| {
                Ok(DesktopEvent {
                    sequence: int(row, "seq")?,
                    event_id: text(row, "event_id")?,
                    body: from_hex(&text(row, "body")?)?,
                })
            })
            .collect()
    }

    /// Forgets assignments finished before `before` (the coordinator has
    /// long recorded them in the run's receipt and event log).
    pub async fn purge_finished_desktop_runs(&self, before: DateTime<Utc>) -> Result<u64> {
        let mut tx = self.begin_write().await?;
        sqlx::query(DELETE_FINISHED_EVENTS_BEFORE)
            .bind(micros(before))
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query(DELETE_FINISHED_BEFORE)
            .bind(micros(before))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use crate::rows::{from_hex, to_hex};

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&bytes)).expect("hex"), bytes);
        assert!(from_hex("abc").is_err());
        assert!(from_hex("zz").is_err());
    }
}
