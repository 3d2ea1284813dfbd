//! Retention (`migrations/*/0013_retention.sql`, docs/retention.md): a
//! finished run, with its events, receipt and dispatch rows, is deleted
//! once it was created longer ago than its organisation's retention period;
//! a webhook message done with (delivered or given up) likewise. A pass
//! walks the organisations (one index probe each) and deletes each one's
//! oldest rows in batches, each batch its own short transaction, so no
//! lock is held for long and a pass stopped half-way has lost nothing.
//!
//! A run still going is never touched, however old: only the terminal
//! states are selected, and a terminal run never changes again. A run of
//! an automation with a monthly budget is kept at least [`BUDGET_DAYS`],
//! so the current month's spend (the sum of its receipts) never shrinks
//! under retention.
//!
//! One scheduler at a time runs a pass: it claims the `retention_passes`
//! row, whose `claimed_until` then says when the next pass is due.
//!
//! On PostgreSQL runs, their events and receipts are partitioned by week
//! (`migrations/postgres/0014_run_partitions.sql`): a pass first makes the
//! weeks ahead, then drops each week whose every run is finished and past
//! its retention (dispatch rows and idempotency keys of its runs deleted in
//! batches first), and leaves the runs of the weeks still to be dropped to
//! that; batches delete the rest (runs older than the partitions, weeks an
//! organisation with a longer retention keeps, and organisations with a
//! shorter one).

use std::time::{Duration as StdDuration, Instant};

use chrono::{DateTime, Duration, Utc};
use sqlx::AnyConnection;

use crate::rows::{self, col, micros};
use crate::sql::{Bulk, bulk};
use crate::{Backend, Result, StoreError};

mod weeks;
pub use weeks::WEEKS_AHEAD;
use weeks::Week;

/// Days a finished run is kept unless the operator says otherwise.
pub const DEFAULT_RETENTION_DAYS: u32 = 30;
/// The longest retention an organisation may have (a hundred years).
pub const MAX_RETENTION_DAYS: u32 = 36_500;
/// Days a run of an automation with a monthly budget is kept at least:
/// longer than any calendar month in any zone, so the month's spend it
/// counts in is over before it goes.
pub const BUDGET_DAYS: i64 = 32;

/// The terminal states, as the partial index `runs_expiry` names them.
const FINISHED: &str =
    "state IN ('succeeded', 'failed', 'timed_out', 'cancelled', 'skipped', 'missed')";

/// The next organisation after `$1` with a finished run or a webhook
/// endpoint: one probe of `runs_expiry` and one of
/// `webhook_endpoints_by_owner`.
const NEXT_ORG: &str = const_format::concatcp!(
    "SELECT MIN(org_id) AS org_id FROM (\
     SELECT MIN(org_id) AS org_id FROM runs WHERE org_id > $1 AND ",
    FINISHED,
    " UNION ALL SELECT MIN(org_id) AS org_id FROM webhook_endpoints WHERE org_id > $1) n"
);

/// Up to `$4` finished runs of organisation `$1` created before `$2`,
/// oldest first; a run of an automation with a monthly budget only when
/// created before `$3` too; none with an id in `[$5, $6)` (the weeks to be
/// dropped whole; an empty range on SQLite).
const EXPIRED_RUNS: &str = const_format::concatcp!(
    "SELECT r.id FROM runs r WHERE r.org_id = $1 AND r.",
    FINISHED,
    " AND r.created_at < $2 AND (r.created_at < $3 OR NOT EXISTS (SELECT 1 FROM automations a \
     WHERE a.id = r.automation_id AND a.monthly_budget_micros IS NOT NULL)) \
     AND NOT (r.id >= $5 AND r.id < $6) \
     ORDER BY r.created_at, r.id LIMIT $4"
);

/// When organisation `$1`'s oldest finished run that is kept was created.
const OLDEST_KEPT: &str = const_format::concatcp!(
    "SELECT created_at FROM runs WHERE org_id = $1 AND ",
    FINISHED,
    " ORDER BY created_at LIMIT 1"
);

bulk! {
    /// A run a batch deletes.
    struct Expired {
        id: String => TEXT,
    }
}

/// What a batch deletes of its runs, children first (the runs are
/// referenced by their events and receipts), in this order.
const DELETE_EVENTS: Bulk<Expired> = bulk!(Expired => [
    "DELETE FROM run_events WHERE run_id IN (SELECT i.id FROM "
] [")"]);
const DELETE_RECEIPTS: Bulk<Expired> = bulk!(Expired => [
    "DELETE FROM receipts WHERE run_id IN (SELECT i.id FROM "
] [")"]);
const DELETE_DESKTOP_EVENTS: Bulk<Expired> = bulk!(Expired => [
    "DELETE FROM desktop_events WHERE run_id IN (SELECT i.id FROM "
] [")"]);
const DELETE_DESKTOP: Bulk<Expired> = bulk!(Expired => [
    "DELETE FROM desktop_assignments WHERE run_id IN (SELECT i.id FROM "
] [")"]);
const DELETE_CLOUD: Bulk<Expired> = bulk!(Expired => [
    "DELETE FROM cloud_dispatch WHERE run_id IN (SELECT i.id FROM "
] [")"]);
const DELETE_KEYS: Bulk<Expired> = bulk!(Expired => [
    "DELETE FROM run_keys WHERE run_id IN (SELECT i.id FROM "
] [")"]);
/// The runs themselves, terminal ones only (the guard, written once).
const DELETE_RUNS: Bulk<Expired> = bulk!(Expired => [
    "DELETE FROM runs WHERE id IN (SELECT i.id FROM "
] [") AND ", FINISHED]);

/// Up to `$3` messages of organisation `$1`'s endpoints done with and
/// created before `$2`.
const DELETE_MESSAGES: &str = "DELETE FROM webhook_messages WHERE (endpoint_id, message_id) IN \
     (SELECT m.endpoint_id, m.message_id FROM webhook_endpoints e \
     JOIN webhook_messages m ON m.endpoint_id = e.id \
     WHERE e.org_id = $1 AND m.next_attempt_at IS NULL AND m.created_at < $2 \
     ORDER BY m.created_at LIMIT $3)";

const OVERRIDES: &str = "SELECT org_id, retention_days FROM org_retention ORDER BY org_id";

const SET_OVERRIDE: &str = "INSERT INTO org_retention (org_id, retention_days, updated_at) \
     VALUES ($1, $2, $3) ON CONFLICT (org_id) DO UPDATE \
     SET retention_days = excluded.retention_days, updated_at = excluded.updated_at";

const CLEAR_OVERRIDE: &str = "DELETE FROM org_retention WHERE org_id = $1";

/// Claims the pass when it is due (its claim over, or the next pass's
/// instant reached), until `$2`.
const CLAIM_PASS: &str = "UPDATE retention_passes SET claimed_until = $2 \
     WHERE name = 'runs' AND claimed_until <= $1";

/// A pass done at `$1`: the next is due at `$2` (when given; an operator's
/// pass leaves the timetable as it is).
const FINISH_PASS: &str = "UPDATE retention_passes SET last_done_at = $1, \
     claimed_until = COALESCE($2, claimed_until) WHERE name = 'runs'";

const LAST_PASS: &str = "SELECT last_done_at FROM retention_passes WHERE name = 'runs'";

/// What a pass deleted, by table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    pub runs: u64,
    pub run_events: u64,
    pub receipts: u64,
    /// Desktop assignments and their events, and cloud dispatch rows.
    pub dispatch: u64,
    pub webhook_messages: u64,
}

impl Purged {
    fn add(&mut self, other: Purged) {
        self.runs += other.runs;
        self.run_events += other.run_events;
        self.receipts += other.receipts;
        self.dispatch += other.dispatch;
        self.webhook_messages += other.webhook_messages;
    }

    /// Each table's count, by the name metrics give it.
    pub fn by_table(&self) -> [(&'static str, u64); 5] {
        [
            ("runs", self.runs),
            ("run_events", self.run_events),
            ("receipts", self.receipts),
            ("dispatch", self.dispatch),
            ("webhook_messages", self.webhook_messages),
        ]
    }
}

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// Rows deleted, by batches and with the weeks dropped.
    pub purged: Purged,
    /// Week partitions dropped (PostgreSQL), by their `YYYYMMDD`.
    pub weeks_dropped: Vec<String>,
    /// Week partitions made ahead of need (PostgreSQL).
    pub weeks_created: u64,
    /// Organisations visited.
    pub orgs: u64,
    /// When the oldest finished run kept was created (of the organisations
    /// visited).
    pub oldest_kept: Option<DateTime<Utc>>,
    /// False when the pass stopped at its time bound with work left (the
    /// next pass goes on).
    pub complete: bool,
}

/// How a pass runs.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Days kept for an organisation without its own retention.
    pub default_days: u32,
    /// Runs per batch (each batch one transaction).
    pub batch: u32,
    /// The most a pass may take; it stops after the batch that crosses it.
    pub time_bound: StdDuration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            default_days: DEFAULT_RETENTION_DAYS,
            batch: 500,
            time_bound: StdDuration::from_secs(60),
        }
    }
}

fn days(n: u32) -> Duration {
    Duration::days(i64::from(n))
}

/// One batch of organisation `org`'s runs created before `before`, none
/// with an id in `spared`: the ids read and everything of theirs deleted in
/// one transaction.
async fn purge_runs(
    db: &mut AnyConnection,
    org: &str,
    before: DateTime<Utc>,
    budgeted_before: DateTime<Utc>,
    limit: u32,
    spared: (&str, &str),
) -> Result<Purged> {
    let params = (
        org,
        micros(before),
        micros(budgeted_before),
        i64::from(limit),
        spared.0,
        spared.1,
    );
    let ids = rows::all(&mut *db, EXPIRED_RUNS, params, |r| {
        Ok(Expired { id: col(r, "id")? })
    })
    .await?;
    if ids.is_empty() {
        return Ok(Purged::default());
    }
    DELETE_KEYS.execute(&mut *db, &ids).await?;
    let run_events = DELETE_EVENTS.execute(&mut *db, &ids).await?;
    let receipts = DELETE_RECEIPTS.execute(&mut *db, &ids).await?;
    let mut dispatch = DELETE_DESKTOP_EVENTS.execute(&mut *db, &ids).await?;
    dispatch += DELETE_DESKTOP.execute(&mut *db, &ids).await?;
    dispatch += DELETE_CLOUD.execute(&mut *db, &ids).await?;
    let runs = DELETE_RUNS.execute(&mut *db, &ids).await?;
    Ok(Purged {
        runs,
        run_events,
        receipts,
        dispatch,
        webhook_messages: 0,
    })
}

impl crate::Internal<'_> {
    /// Organisations with a retention of their own, and its days.
    pub async fn org_retentions(self) -> Result<Vec<(String, u32)>> {
        rows::all(self.db(), OVERRIDES, (), |r| {
            let days: i64 = col(r, "retention_days")?;
            let days = u32::try_from(days)
                .map_err(|_| StoreError::Corrupt(format!("retention of {days} days")))?;
            Ok((col(r, "org_id")?, days))
        })
        .await
    }

    /// Gives organisation `org_id` a retention of `days` (1 to
    /// [`MAX_RETENTION_DAYS`]); `Invariant` otherwise.
    pub async fn set_org_retention(
        self,
        org_id: &str,
        days: u32,
        now: DateTime<Utc>,
    ) -> Result<()> {
        if !(1..=MAX_RETENTION_DAYS).contains(&days) {
            return Err(StoreError::Invariant(format!(
                "a retention is 1 to {MAX_RETENTION_DAYS} days, not {days}"
            )));
        }
        crate::error::storable(&[("org_id", org_id)])?;
        let params = (org_id, i64::from(days), micros(now));
        rows::execute(self.db(), SET_OVERRIDE, params).await?;
        Ok(())
    }

    /// Returns organisation `org_id` to the default retention; false when
    /// it had none of its own.
    pub async fn clear_org_retention(self, org_id: &str) -> Result<bool> {
        Ok(rows::execute(self.db(), CLEAR_OVERRIDE, (org_id,)).await? > 0)
    }

    /// Claims the retention pass until `until` when one is due at `now`
    /// (none under way, the last one's next instant reached): true when
    /// this caller runs it.
    pub async fn claim_retention_pass(
        self,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<bool> {
        rows::changed_one(self.db(), CLAIM_PASS, (micros(now), micros(until))).await
    }

    /// A pass done at `now`; the next is due at `next` (`None`: an
    /// operator's pass, which leaves the schedulers' timetable alone).
    pub async fn finish_retention_pass(
        self,
        now: DateTime<Utc>,
        next: Option<DateTime<Utc>>,
    ) -> Result<()> {
        let params = (micros(now), next.map(micros));
        rows::execute(self.db(), FINISH_PASS, params).await?;
        Ok(())
    }

    /// When the last retention pass finished, if one has.
    pub async fn last_retention_pass(self) -> Result<Option<DateTime<Utc>>> {
        let last = rows::optional(self.db(), LAST_PASS, (), |r| {
            col::<Option<DateTime<Utc>>>(r, "last_done_at")
        });
        Ok(last.await?.flatten())
    }

    /// One retention pass at `now` under `policy`: every organisation's
    /// finished runs and done webhook messages older than its retention
    /// deleted, in batches of `policy.batch`, until none is left or the
    /// pass's time bound is crossed.
    pub async fn purge_expired(self, policy: Policy, now: DateTime<Utc>) -> Result<Pass> {
        if policy.batch == 0 || policy.default_days == 0 {
            return Err(StoreError::Invariant(
                "a retention pass needs a batch and a default of at least 1".into(),
            ));
        }
        let started = Instant::now();
        let overrides = self.org_retentions().await?;
        let budgeted_before = now - Duration::days(BUDGET_DAYS);
        let mut pass = Pass {
            complete: true,
            ..Pass::default()
        };
        // The weeks: made ahead, dropped when due; those still to be dropped
        // are spared the batches (for organisations at the default or a
        // longer retention: a shorter one's runs go in batches).
        let weeks = match self.0.backend() {
            Backend::Postgres => self.weeks(now, &mut pass).await?,
            Backend::Sqlite => Vec::new(),
        };
        let awaiting: Vec<&Week> = weeks
            .iter()
            .filter(|w| w.awaits_drop(&policy, now))
            .collect();
        let spared = match (awaiting.first(), awaiting.last()) {
            (Some(first), Some(last)) => (first.lo.as_str(), last.hi.as_str()),
            _ => ("", ""),
        };
        for week in weeks.iter().filter(|w| !w.awaits_drop(&policy, now)) {
            if !self
                .drop_week(week, &policy, now, started, &mut pass)
                .await?
            {
                pass.complete = false;
                return Ok(pass);
            }
        }
        let mut after = String::new();
        loop {
            let next = rows::optional(self.db(), NEXT_ORG, (after.as_str(),), |r| {
                col::<Option<String>>(r, "org_id")
            });
            let Some(org) = next.await?.flatten() else {
                break;
            };
            pass.orgs += 1;
            let kept = overrides
                .iter()
                .find(|(o, _)| *o == org)
                .map_or(policy.default_days, |(_, d)| *d);
            let before = now - days(kept);
            let spared = if kept >= policy.default_days {
                spared
            } else {
                ("", "")
            };
            // Runs, a batch per transaction, until a short one.
            loop {
                let mut tx = self.0.begin_write().await?;
                let purged =
                    purge_runs(&mut tx, &org, before, budgeted_before, policy.batch, spared)
                        .await?;
                tx.commit().await?;
                pass.purged.add(purged);
                if purged.runs < u64::from(policy.batch) {
                    break;
                }
                if started.elapsed() >= policy.time_bound {
                    pass.complete = false;
                    return Ok(pass);
                }
            }
            loop {
                let params = (org.as_str(), micros(before), i64::from(policy.batch));
                let deleted = rows::execute(self.db(), DELETE_MESSAGES, params).await?;
                pass.purged.webhook_messages += deleted;
                if deleted < u64::from(policy.batch) {
                    break;
                }
                if started.elapsed() >= policy.time_bound {
                    pass.complete = false;
                    return Ok(pass);
                }
            }
            let oldest = rows::optional(self.db(), OLDEST_KEPT, (org.as_str(),), |r| {
                col::<DateTime<Utc>>(r, "created_at")
            });
            if let Some(oldest) = oldest.await? {
                pass.oldest_kept = Some(pass.oldest_kept.map_or(oldest, |o| o.min(oldest)));
            }
            if started.elapsed() >= policy.time_bound {
                pass.complete = false;
                return Ok(pass);
            }
            after = org;
        }
        Ok(pass)
    }
}
