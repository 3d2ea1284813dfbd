//! Week partitions of runs, their events and receipts (PostgreSQL;
//! `migrations/postgres/0014_run_partitions.sql`, docs/retention.md): made
//! ahead of need and dropped whole once every run in them is due, for the
//! retention pass in `retention.rs`.

use std::time::Instant;

use chrono::{DateTime, Duration, Utc};

use super::{BUDGET_DAYS, Pass, Policy, Purged};
use crate::rows::{self, col, micros};
use crate::{Backend, Result, StoreError};

/// Weeks created ahead of the current one (each pass makes them).
pub const WEEKS_AHEAD: i32 = 2;

/// Makes the weeks from `$1`'s to `$2` ahead: each partition made, or one
/// that could not be (its rows are in the default partition already).
const ENSURE_WEEKS: &str = "SELECT partition, CAST(CASE WHEN created THEN 1 ELSE 0 END AS BIGINT) \
     AS created FROM automesh_ensure_run_partitions($1, $2)";

/// The weeks runs are partitioned in, oldest first, by their `YYYYMMDD`.
const WEEKS: &str = "SELECT substr(c.relname, 7) AS week FROM pg_inherits i \
     JOIN pg_class c ON c.oid = i.inhrelid \
     WHERE i.inhparent = 'runs'::regclass AND c.relname LIKE 'runs\\_p%' ORDER BY c.relname";

/// The partition run `$1` is in.
const PARTITION_OF_RUN: &str =
    "SELECT CAST(tableoid::regclass AS TEXT) AS part FROM runs WHERE id = $1";

/// Why week `$1` stays at `$2` (default days `$3`, at least `$4`), if it
/// does.
const WEEK_KEPT: &str = "SELECT automesh_run_partition_kept($1, $2, $3, $4) AS kept";

/// The rows week `$1` holds, table by table.
const WEEK_ROWS_HELD: &str =
    "SELECT runs, run_events, receipts FROM automesh_run_partition_rows($1)";

/// Week `$2`'s partition of `$1` dropped unless something keeps the week
/// (checked again under lock): why it stays, or NULL.
const DROP_WEEK: &str = "SELECT automesh_drop_run_partition($1, $2, $3, $4, $5) AS kept";

/// The tables a week is dropped from, one transaction each, the runs last
/// (a week whose runs are kept keeps its runs partition).
const WEEK_TABLES: [&str; 3] = ["receipts", "run_events", "runs"];

/// How long a drop waits for its locks before it is left to the next pass:
/// the drop takes the parent tables' lock for a moment, and queues the
/// writes behind it while it waits.
const DROP_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '2s'";

/// Up to `$3` dispatch rows and idempotency keys of the runs with ids in
/// `[$1, $2)` (a week about to be dropped), table by table.
const WEEK_ROWS: [&str; 4] = [
    "DELETE FROM desktop_events WHERE (run_id, seq) IN (SELECT run_id, seq FROM desktop_events \
     WHERE run_id >= $1 AND run_id < $2 LIMIT $3)",
    "DELETE FROM desktop_assignments WHERE run_id IN (SELECT run_id FROM desktop_assignments \
     WHERE run_id >= $1 AND run_id < $2 LIMIT $3)",
    "DELETE FROM cloud_dispatch WHERE run_id IN (SELECT run_id FROM cloud_dispatch \
     WHERE run_id >= $1 AND run_id < $2 LIMIT $3)",
    "DELETE FROM run_keys WHERE (automation_id, idempotency_key) IN \
     (SELECT automation_id, idempotency_key FROM run_keys WHERE run_id >= $1 AND run_id < $2 LIMIT $3)",
];

/// PostgreSQL's `lock_not_available`: a drop's lock wait reached its bound.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// A week partition of runs (PostgreSQL).
#[derive(Debug, Clone)]
pub(super) struct Week {
    /// `YYYYMMDD` of its Monday.
    pub(super) name: String,
    /// The ids it holds: `[lo, hi)`.
    pub(super) lo: String,
    pub(super) hi: String,
    /// Its last instant (exclusive).
    end: DateTime<Utc>,
}

impl Week {
    fn of(name: String) -> Result<Week> {
        let monday = chrono::NaiveDate::parse_from_str(&name, "%Y%m%d")
            .map_err(|_| StoreError::Corrupt(format!("a week partition runs_p{name}")))?
            .and_time(chrono::NaiveTime::MIN)
            .and_utc();
        let end = monday + Duration::days(7);
        Ok(Week {
            lo: automesh_domain::ids::run_id_bound(monday),
            hi: automesh_domain::ids::run_id_bound(end),
            name,
            end,
        })
    }

    /// Whether its runs are left to the drop: its default-retention runs
    /// are not all due yet.
    pub(super) fn awaits_drop(&self, policy: &Policy, now: DateTime<Utc>) -> bool {
        self.end + Duration::days(i64::from(policy.default_days).max(BUDGET_DAYS)) > now
    }
}

fn lock_not_available(e: &StoreError) -> bool {
    matches!(e, StoreError::Database(sqlx::Error::Database(db))
        if db.code().as_deref() == Some(LOCK_NOT_AVAILABLE))
}

impl crate::Internal<'_> {
    /// The week partitions of runs there are, by the `YYYYMMDD` of their
    /// Mondays, oldest first (none on SQLite).
    pub async fn run_weeks(self) -> Result<Vec<String>> {
        match self.0.backend() {
            Backend::Postgres => rows::all(self.db(), WEEKS, (), |r| col(r, "week")).await,
            Backend::Sqlite => Ok(Vec::new()),
        }
    }

    /// The partition that holds run `id` (PostgreSQL; `None` on SQLite or
    /// when there is no such run).
    pub async fn partition_of_run(self, id: &str) -> Result<Option<String>> {
        match self.0.backend() {
            Backend::Postgres => {
                let part = rows::optional(self.db(), PARTITION_OF_RUN, (id,), |r| col(r, "part"));
                part.await
            }
            Backend::Sqlite => Ok(None),
        }
    }

    /// Makes the week partitions from `now`'s week to [`WEEKS_AHEAD`] ahead
    /// where missing (PostgreSQL; nothing on SQLite): how many were made. A
    /// week that cannot be made is logged: its rows stay in the default
    /// partition, which batches purge.
    pub async fn make_run_weeks(self, now: DateTime<Utc>) -> Result<u64> {
        if self.0.backend() == Backend::Sqlite {
            return Ok(0);
        }
        let made = rows::all(self.db(), ENSURE_WEEKS, (micros(now), WEEKS_AHEAD), |r| {
            Ok((
                col::<String>(r, "partition")?,
                col::<i64>(r, "created")? == 1,
            ))
        });
        let mut created = 0;
        for (partition, made) in made.await? {
            if made {
                created += 1;
                tracing::info!(%partition, "retention: week partition made");
            } else {
                tracing::warn!(
                    %partition,
                    "retention: week partition cannot be made, its default partition holds rows \
                     of that week; they are deleted in batches"
                );
            }
        }
        Ok(created)
    }

    /// The week partitions of runs, oldest first, after making those ahead
    /// (counted in `pass`).
    pub(super) async fn weeks(self, now: DateTime<Utc>, pass: &mut Pass) -> Result<Vec<Week>> {
        pass.weeks_created += self.make_run_weeks(now).await?;
        self.run_weeks().await?.into_iter().map(Week::of).collect()
    }

    /// Drops `week` when nothing keeps it: its runs' dispatch rows and
    /// idempotency keys in batches first, then its partitions in one short
    /// transaction. False when the pass's time bound was crossed first.
    pub(super) async fn drop_week(
        self,
        week: &Week,
        policy: &Policy,
        now: DateTime<Utc>,
        started: Instant,
        pass: &mut Pass,
    ) -> Result<bool> {
        let params = (
            week.name.as_str(),
            micros(now),
            i64::from(policy.default_days),
            BUDGET_DAYS,
        );
        let kept = rows::optional(self.db(), WEEK_KEPT, params, |r| {
            col::<Option<String>>(r, "kept")
        });
        if let Some(why) = kept.await?.flatten() {
            tracing::debug!(week = %week.name, %why, "retention: week partition kept");
            return Ok(true);
        }
        for sql in WEEK_ROWS {
            loop {
                let range = (week.lo.as_str(), week.hi.as_str(), i64::from(policy.batch));
                let deleted = rows::execute(self.db(), sql, range).await?;
                if !sql.contains("run_keys") {
                    pass.purged.dispatch += deleted;
                }
                if deleted < u64::from(policy.batch) {
                    break;
                }
                if started.elapsed() >= policy.time_bound {
                    return Ok(false);
                }
            }
        }
        // Counted before the drop's lock is taken: only a run written into
        // the week meanwhile could change them, and that run, created now,
        // keeps the week (the check under lock says so).
        let held = rows::optional(self.db(), WEEK_ROWS_HELD, (week.name.as_str(),), |r| {
            Ok(Purged {
                runs: col::<i64>(r, "runs")?.unsigned_abs(),
                run_events: col::<i64>(r, "run_events")?.unsigned_abs(),
                receipts: col::<i64>(r, "receipts")?.unsigned_abs(),
                ..Purged::default()
            })
        });
        let purged = held.await?.unwrap_or_default();
        for table in WEEK_TABLES {
            let mut tx = self.0.begin_write().await?;
            rows::execute(&mut *tx, DROP_LOCK_TIMEOUT, ()).await?;
            let (name, now_us, default_days, least_days) = params;
            let params = (table, name, now_us, default_days, least_days);
            let dropped = rows::optional(&mut *tx, DROP_WEEK, params, |r| {
                col::<Option<String>>(r, "kept")
            });
            match dropped.await {
                Ok(Some(None)) => tx.commit().await?,
                Ok(why) => {
                    let why = why.flatten().unwrap_or_default();
                    tracing::debug!(week = %week.name, table, %why, "retention: week partition kept");
                    return Ok(true);
                }
                Err(e) if lock_not_available(&e) => {
                    tracing::warn!(
                        week = %week.name,
                        table,
                        "retention: week partition not dropped, its table was busy for 2 s; \
                         the next pass tries again"
                    );
                    return Ok(true);
                }
                Err(e) => return Err(e),
            }
        }
        tracing::info!(
            week = %week.name,
            runs = purged.runs,
            run_events = purged.run_events,
            receipts = purged.receipts,
            "retention: week partition dropped"
        );
        pass.purged.add(purged);
        pass.weeks_dropped.push(week.name.clone());
        Ok(true)
    }
}
