//! Desktop dispatch shared by every runner-gateway replica (SPEC §6).
//!
//! An assignment is offered (idempotent by run id) by whichever replica the
//! coordinator called; the replica holding a stream of the owner's runner
//! claims it for that runner with a guarded update — so exactly one replica
//! sends it — and writes back what the runner reports. Every change tells
//! the replicas a [`DesktopNote`] of what changed. Offers, reports, events
//! and cancellations commit through the store's writer (many runs' writes
//! in one transaction); a claim is one statement of its own, on the
//! latency path. Bodies (the run spec, the outcome, events) are opaque
//! protobuf bytes to the store, kept hex-encoded so both backends share one
//! column type.

use chrono::{DateTime, Utc};
use const_format::concatcp;
use sqlx::any::AnyRow;

use crate::rows::{self, micros, to_hex};
use crate::signal::DesktopNote;
use crate::{Result, Store};

mod events;
mod streams;
mod write;

use write::{DesktopWrite, Reported, Write};

pub use events::DesktopEvent;

automesh_domain::string_enum! {
    /// Where an assignment is.
    DesktopPhase {
        /// Offered; no runner has accepted it yet.
        Admitted => "admitted",
        /// A runner accepted it.
        Running => "running",
        /// The runner reported its result.
        Finished => "finished",
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
    /// The stream of `runner_id` that holds the claim.
    pub stream_id: Option<String>,
    /// When it was last claimed.
    pub claimed_at: DateTime<Utc>,
    /// The runner that held it without accepting it in time: it is not
    /// offered to that runner again until the runner opens a new stream.
    pub passed_over: Option<String>,
}

/// An assignment's columns, for a `SELECT` or a `RETURNING`.
const COLUMNS: &str = "run_id, org_id, owner_id, spec, runner_id, phase, idle, outcome, \
     cancel_requested, cancel_reason, event_count, stream_id, claimed_at, passed_over";

/// Only the runner's newest stream may claim, only a run no runner has
/// accepted, and not for the runner that already sat on it.
const CLAIM_GUARDED: &str = "UPDATE desktop_assignments SET runner_id = $2, stream_id = $3, \
     claimed_at = $4, updated_at = $4 \
     WHERE run_id = $1 AND phase = 'admitted' AND cancel_requested = 0 \
     AND (runner_id IS NULL OR runner_id = $2) \
     AND (passed_over IS NULL OR passed_over <> $2) \
     AND EXISTS (SELECT 1 FROM runner_streams s WHERE s.runner_id = $2 AND s.stream_id = $3)";

/// The claim; it returns the assignment as claimed, so the replica that
/// claimed an offer it was told of has the spec to send without another
/// read.
const CLAIM: &str = concatcp!(CLAIM_GUARDED, " RETURNING ", COLUMNS);

/// PostgreSQL: the same claim, committed asynchronously (no wait for the
/// WAL flush on the dispatch path). Safe: a claim lost with a database
/// crash only makes the runner's acceptance fail its guard (the runner
/// starts nothing before `AssignmentConfirmed`, whose acceptance commits
/// durably, and so flushes the claim before it), and the run is offered
/// again.
const CLAIM_PG: &str = concatcp!(
    "WITH async_commit AS (SELECT set_config('synchronous_commit', 'off', true)) ",
    CLAIM_GUARDED,
    " AND EXISTS (SELECT 1 FROM async_commit) RETURNING ",
    COLUMNS
);

const RELEASE_UNACCEPTED: &str = "UPDATE desktop_assignments \
     SET runner_id = NULL, stream_id = NULL, updated_at = $3 \
     WHERE runner_id = $1 AND stream_id = $2 AND phase = 'admitted' RETURNING run_id";

/// A claim not accepted in time goes back, the runner passed over.
const EXPIRE_CLAIM: &str = concatcp!(
    "UPDATE desktop_assignments \
     SET runner_id = NULL, stream_id = NULL, passed_over = runner_id, updated_at = $4 \
     WHERE run_id = $1 AND runner_id = $2 AND stream_id = $3 AND phase = 'admitted' \
     RETURNING ",
    COLUMNS
);

/// Claims left by a replica that died with them, older than `$1`.
const EXPIRE_ORPHANED_CLAIMS: &str = "UPDATE desktop_assignments \
     SET passed_over = runner_id, runner_id = NULL, stream_id = NULL, updated_at = $2 \
     WHERE phase = 'admitted' AND runner_id IS NOT NULL AND claimed_at < $1 RETURNING run_id";

fn decode(row: &AnyRow) -> Result<DesktopAssignment> {
    rows::columns! { row => DesktopAssignment {
        run_id, org_id, owner_id, spec, runner_id, phase, idle, outcome, cancel_requested,
        cancel_reason, event_count, stream_id, claimed_at, passed_over,
    } }
}

/// What a replica does with a runner stream's claim on an assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Claims it for the stream: applies only when the stream is the
    /// runner's newest, no other runner holds it, it was not accepted,
    /// finished or cancelled, and the runner did not already sit on it.
    Take,
    /// Gives back a claim the stream did not accept in time; the runner is
    /// passed over for it. Applies only while the claim is unaccepted.
    Expire,
}

/// What a runner reports of a run it was assigned.
#[derive(Debug, Clone, Copy)]
pub enum RunnerReport<'a> {
    /// It accepted the assignment.
    Accepted,
    /// Its result, an encoded `Outcome` (its engine is idle too).
    Finished(&'a [u8]),
    /// Its engine is idle for the run.
    Idle,
}

impl Store {
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
        let rows = q.fetch_all(self.db()).await?;
        rows.iter().map(decode).collect()
    }

    /// Offers a desktop run; returns false when it was already offered (the
    /// existing assignment stands). The replicas are told who it is for.
    pub async fn offer_desktop_run(
        &self,
        run_id: &str,
        org_id: &str,
        owner_id: &str,
        spec: &[u8],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let write = DesktopWrite::Offer {
            org_id: org_id.to_owned(),
            owner_id: owner_id.to_owned(),
            spec: to_hex(spec),
        };
        Ok(self.desktop_write(run_id, write, now).await? == 1)
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

    /// Takes or gives back the claim of stream `stream_id` of `runner_id`
    /// on an assignment: see [`Claim`]. The assignment as the claim left
    /// it, when it applied.
    pub async fn desktop_claim(
        &self,
        claim: Claim,
        run_id: &str,
        runner_id: &str,
        stream_id: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DesktopAssignment>> {
        let params = (run_id, runner_id, stream_id, micros(now));
        Ok(match claim {
            // A claim is only this replica's business until it is accepted.
            Claim::Take => {
                let claim = match self.backend() {
                    crate::Backend::Postgres => CLAIM_PG,
                    crate::Backend::Sqlite => CLAIM,
                };
                rows::optional(self.db(), claim, params, decode).await?
            }
            Claim::Expire => {
                let given_back = rows::optional(self.db(), EXPIRE_CLAIM, params, decode).await?;
                if given_back.is_some() {
                    let run_id = run_id.to_owned();
                    self.tell(&[DesktopNote::GivenBack { run_id }]).await;
                }
                given_back
            }
        })
    }

    /// Gives back the assignments stream `stream_id` was offered but never
    /// accepted (it ended), so another runner of the owner may take them.
    pub async fn release_unaccepted_desktop_runs(
        &self,
        runner_id: &str,
        stream_id: &str,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let params = (runner_id, stream_id, micros(now));
        let released = rows::all(self.db(), RELEASE_UNACCEPTED, params, |_| Ok(())).await?;
        if !released.is_empty() {
            self.tell(&[DesktopNote::Released]).await;
        }
        Ok(released.len() as u64)
    }

    /// Gives back every unaccepted claim made before `before` (claims whose
    /// replica died before it could enforce its own bound).
    pub async fn expire_orphaned_desktop_claims(
        &self,
        before: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let args = (micros(before), micros(now));
        let run_ids: Vec<String> = rows::all(self.db(), EXPIRE_ORPHANED_CLAIMS, args, |r| {
            rows::col(r, "run_id")
        })
        .await?;
        let notes: Vec<DesktopNote> = run_ids
            .iter()
            .map(|run_id| DesktopNote::GivenBack {
                run_id: run_id.clone(),
            })
            .collect();
        self.tell(&notes).await;
        Ok(run_ids.len() as u64)
    }

    /// Records what the runner of stream `stream_id` reported of `run_id`;
    /// false when the run is not this stream's to report on, or the report
    /// changes nothing (accepted twice, accepted after a cancellation).
    pub async fn desktop_report(
        &self,
        report: RunnerReport<'_>,
        run_id: &str,
        runner_id: &str,
        stream_id: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let write = DesktopWrite::Report {
            runner_id: runner_id.to_owned(),
            stream_id: stream_id.to_owned(),
            outcome: match report {
                RunnerReport::Accepted => Reported::Accepted,
                RunnerReport::Finished(outcome) => Reported::Finished(to_hex(outcome)),
                RunnerReport::Idle => Reported::Idle,
            },
        };
        Ok(self.desktop_write(run_id, write, now).await? == 1)
    }

    /// Commits one desktop write with others; how many rows it changed.
    async fn desktop_write(
        &self,
        run_id: &str,
        write: DesktopWrite,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let job = Write {
            run_id: run_id.to_owned(),
            write,
            at: micros(now),
        };
        Ok(self.writer().write(job).await?.changed)
    }

    /// Asks for the run to be cancelled; returns the assignment as it now is
    /// (None when it was never offered).
    pub async fn cancel_desktop_run(
        &self,
        run_id: &str,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DesktopAssignment>> {
        let write = DesktopWrite::Cancel {
            reason: reason.to_owned(),
        };
        self.desktop_write(run_id, write, now).await?;
        self.desktop_run(run_id).await
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
