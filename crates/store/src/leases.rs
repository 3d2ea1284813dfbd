//! Queries of the coordinator's claim on runs: leases taken with `FOR UPDATE
//! SKIP LOCKED` (PostgreSQL) or under the single writer lock (SQLite),
//! renewed by heartbeats, and free for another coordinator once expired.
//! Also the bookkeeping a coordinator persists while it drives a run.

use automesh_domain::{Placement, Run};
use chrono::{DateTime, Utc};

use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use const_format::concatcp;

use crate::rows::{self, col, micros};
use crate::runs::{LIVE_STATES, RUN_COLUMNS};
use crate::sql::{Bulk, bulk};
use crate::{Backend, Result, Store};

/// The claim of up to `$4` runs: live, unleased or with a lapsed lease, of
/// a placement this coordinator executes (or past what any coordinator
/// must end), due by `$7` (a scheduled run a little before its instant,
/// see [`CLAIM_AHEAD`]), oldest first, with [`CLAIM_LOCK`] between the
/// candidates and the update: how the backend keeps two claims apart. A run
/// of a placement this coordinator executes gets its message identity
/// (`msg_<run id>`) with its first such claim, before any `StartRun`, and
/// keeps it.
const CLAIM: [&str; 2] = [
    concatcp!(
        "UPDATE runs SET lease_owner = $1, lease_expires_at = $2, claims = claims + 1, \
           message_id = CASE WHEN $5 LIKE '%,' || placement || ',%' \
             THEN COALESCE(message_id, 'msg_' || id) ELSE message_id END \
         WHERE id IN (SELECT id FROM runs WHERE state IN ",
        LIVE_STATES,
        " AND (lease_expires_at IS NULL OR lease_expires_at < $3) \
              AND (scheduled_for IS NULL OR scheduled_for <= $7) \
              AND ($5 LIKE '%,' || placement || ',%' \
                   OR (message_id IS NULL AND (deadline_at < $3 OR cancel_requested_at IS NOT NULL)) \
                   OR deadline_at < $6) \
            ORDER BY created_at LIMIT $4"
    ),
    concatcp!(") RETURNING ", RUN_COLUMNS, ", executor_seq, claims"),
];

/// PostgreSQL: rows another coordinator is claiming are skipped. SQLite
/// has one writer at a time: its claim needs no row locks.
const CLAIM_LOCK: &str = " FOR UPDATE SKIP LOCKED";

/// How long before its instant a scheduled run may be claimed. The
/// scheduler creates an on-time occurrence's run a little ahead of its
/// instant (at most half this, so that a clock a little off between hosts
/// still finds it claimable), a coordinator claims it at once and its drive
/// holds it until the instant: at the instant only the `StartRun` call is
/// left. Nothing reaches an executor before the run's instant.
pub const CLAIM_AHEAD: std::time::Duration = std::time::Duration::from_millis(20);

const CLAIM_PG: &str = concatcp!(CLAIM[0], CLAIM_LOCK, CLAIM[1]);

const CLAIM_SQLITE: &str = concatcp!(CLAIM[0], CLAIM[1]);

bulk! {
    /// A lease renewed by its owner until `until`.
    struct RenewRow {
        id: String => TEXT,
        owner: String => TEXT,
        until: i64 => BIGINT,
    }
}

/// Leases renewed, each only while its owner holds it and the run is live:
/// the runs renewed, each with whether a cancellation was asked for.
const RENEW: Bulk<RenewRow> = bulk!(RenewRow => [
    "UPDATE runs SET lease_expires_at = i.until FROM "
] [
    " WHERE runs.id = i.id AND runs.lease_owner = i.owner AND runs.state IN ", LIVE_STATES,
    " RETURNING runs.id, runs.cancel_requested_at"
]);

bulk! {
    /// How far a run's executor event stream was read.
    struct SeqRow {
        id: String => TEXT,
        seq: i64 => BIGINT,
    }
}

/// The runs' executor sequence numbers, each only forward.
const SET_EXECUTOR_SEQ: Bulk<SeqRow> = bulk!(SeqRow => [
    "UPDATE runs SET executor_seq = i.seq FROM "
] [
    " WHERE runs.id = i.id AND runs.executor_seq < i.seq"
]);

const REQUEST_CANCEL: &str = concatcp!(
    "UPDATE runs SET cancel_requested_at = COALESCE(cancel_requested_at, $2) \
     WHERE id = $1 AND state IN ",
    LIVE_STATES
);

/// What renewing a lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Another coordinator holds the run now, or it ended.
    Lost,
    Held {
        cancel_requested: bool,
    },
}

/// A run this coordinator holds the lease of.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedRun {
    /// The run, with its message identity when this coordinator executes
    /// its placement.
    pub run: Run,
    /// How far the executor's event stream has been consumed.
    pub executor_seq: i64,
    /// How many times the run has been claimed (1 = first claim).
    pub claims: i64,
    /// Whether a previous drive may have submitted the run (this is not its
    /// first claim). On its first claim, no executor was ever asked to
    /// start it.
    pub maybe_submitted: bool,
}

fn decode_claimed(row: &sqlx::any::AnyRow) -> Result<ClaimedRun> {
    let claims = col(row, "claims")?;
    Ok(ClaimedRun {
        run: crate::runs::decode(row)?,
        executor_seq: col(row, "executor_seq")?,
        claims,
        maybe_submitted: claims > 1,
    })
}

impl Store {
    /// Leases up to `limit` live runs that nobody holds (or whose lease
    /// expired) to `owner` until `until`: runs of the `placements` this
    /// coordinator can execute; never-submitted runs that are cancelled or
    /// past their deadline (anyone can end those); and any run whose
    /// deadline was before `orphaned_before` (so a run no coordinator can
    /// execute any more still ends, a grace period after its deadline).
    /// A scheduled run is claimable from [`CLAIM_AHEAD`] before its
    /// instant; its drive holds it until then.
    pub async fn claim_runs(
        &self,
        owner: &str,
        placements: &[Placement],
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        orphaned_before: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<ClaimedRun>> {
        let placements = placements
            .iter()
            .fold(String::from(","), |acc, p| format!("{acc}{p},"));
        let sql = match self.backend() {
            Backend::Postgres => CLAIM_PG,
            Backend::Sqlite => CLAIM_SQLITE,
        };
        let params = (
            owner,
            micros(until),
            micros(now),
            i64::from(limit),
            placements,
            micros(orphaned_before),
            micros(now + chrono::Duration::from_std(CLAIM_AHEAD).unwrap_or_default()),
        );
        // A row that does not decode is logged and left to its lease expiry,
        // rather than stopping every other claim.
        // One statement, so no transaction around it: one round trip.
        let decode = rows::skipping("claimed run", decode_claimed);
        let claimed = rows::all(self.db(), sql, params, decode).await?;
        Ok(claimed.into_iter().flatten().collect())
    }

    /// Extends a lease. The heartbeat also brings news of a cancellation
    /// request, so drivers need no polling of their own.
    pub async fn renew_lease(
        &self,
        id: &str,
        owner: &str,
        until: DateTime<Utc>,
    ) -> Result<Renewal> {
        let renew = Renew {
            id: id.to_owned(),
            owner: owner.to_owned(),
            until,
        };
        self.writer().write(renew).await
    }

    /// Records how far the executor's event stream has been consumed.
    pub async fn set_executor_seq(&self, id: &str, seq: i64) -> Result<()> {
        let id = id.to_owned();
        self.writer().write(ExecutorSeq { id, seq }).await
    }
}

/// A lease renewed, committed with other writes.
struct Renew {
    id: String,
    owner: String,
    until: DateTime<Utc>,
}

impl crate::writer::Job for Renew {
    type Output = Renewal;

    fn key(&self) -> &str {
        &self.id
    }

    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<Renewal>>>> {
        Box::pin(async move {
            let rows: Vec<RenewRow> = jobs
                .iter()
                .map(|j| RenewRow {
                    id: j.id.clone(),
                    owner: j.owner.clone(),
                    until: micros(j.until),
                })
                .collect();
            let held = RENEW.all(db, &rows, |r| {
                let cancel = col::<Option<i64>>(r, "cancel_requested_at")?;
                Ok((col::<String>(r, "id")?, cancel.is_some()))
            });
            let held: std::collections::HashMap<String, bool> = held.await?.into_iter().collect();
            Ok(jobs
                .iter()
                .map(|j| {
                    Ok(match held.get(&j.id) {
                        None => Renewal::Lost,
                        Some(cancel) => Renewal::Held {
                            cancel_requested: *cancel,
                        },
                    })
                })
                .collect())
        })
    }
}

/// How far the executor's event stream was read, committed with other
/// writes.
struct ExecutorSeq {
    id: String,
    seq: i64,
}

impl crate::writer::Job for ExecutorSeq {
    type Output = ();

    fn key(&self) -> &str {
        &self.id
    }

    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<()>>>> {
        Box::pin(async move {
            let rows: Vec<SeqRow> = jobs
                .iter()
                .map(|j| SeqRow {
                    id: j.id.clone(),
                    seq: j.seq,
                })
                .collect();
            SET_EXECUTOR_SEQ.execute(db, &rows).await?;
            Ok(jobs.iter().map(|_| Ok(())).collect())
        })
    }
}

const RELEASE_ALL: &str =
    "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL WHERE lease_owner = $1";

impl Store {
    /// Gives up every lease `owner` holds (graceful shutdown).
    pub async fn release_all_leases(&self, owner: &str) -> Result<u64> {
        rows::execute(self.db(), RELEASE_ALL, (owner,)).await
    }
}

/// The queue of runs no coordinator has claimed yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Queue {
    /// Pending runs.
    pub pending: i64,
    /// When the oldest pending run was created.
    pub oldest: Option<DateTime<Utc>>,
}

const QUEUE: &str =
    "SELECT COUNT(*) AS n, MIN(created_at) AS oldest FROM runs WHERE state = 'pending'";

impl Store {
    /// How many runs wait to be claimed, and since when (queue lag).
    pub async fn run_queue(&self) -> Result<Queue> {
        let queue = rows::optional(self.db(), QUEUE, (), |row| {
            Ok(Queue {
                pending: col(row, "n")?,
                oldest: col(row, "oldest")?,
            })
        });
        Ok(queue.await?.unwrap_or_default())
    }
}

impl crate::Internal<'_> {
    /// Records a cancellation request on a live run; `false` when the run
    /// is already terminal (or unknown).
    pub async fn request_cancel(self, id: &str, now: DateTime<Utc>) -> Result<bool> {
        rows::changed_one(self.db(), REQUEST_CANCEL, (id, micros(now))).await
    }
}
