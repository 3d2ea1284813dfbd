//! The desktop writes that commit through the store's writer: offers,
//! runners' reports and cancellations, each kind one bulk statement for
//! every job of the batch (each row guarded as if it were alone).

use std::collections::{HashMap, HashSet};

use futures_util::future::BoxFuture;
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use crate::Result;
use crate::rows;
use crate::signal::{AssignmentState, DesktopNote};
use crate::sql::{Bulk, bulk};
use crate::writer::Job;

bulk! {
    /// A desktop run offered to its owner's runners.
    struct OfferRow {
        run_id: String => TEXT,
        org_id: String => TEXT,
        owner_id: String => TEXT,
        spec: String => TEXT,
        at: i64 => BIGINT,
    }
}

/// Offers, each unless its run was offered before: the runs offered.
const OFFER: Bulk<OfferRow> = bulk!(OfferRow => [
    "INSERT INTO desktop_assignments (run_id, org_id, owner_id, spec, created_at, updated_at) \
     SELECT i.run_id, i.org_id, i.owner_id, i.spec, i.at, i.at FROM "
] [
    " WHERE true ON CONFLICT (run_id) DO NOTHING RETURNING run_id"
]);

bulk! {
    /// What the runner of a stream reported of a run: `kind` is
    /// `accepted`, `finished` (with its `outcome`, hex) or `idle`.
    struct ReportRow {
        run_id: String => TEXT,
        runner_id: String => TEXT,
        stream_id: String => TEXT,
        kind: &'static str => TEXT,
        outcome: Option<String> => TEXT,
        at: i64 => BIGINT,
    }
}

/// Runners' reports, each only from the stream that holds the run: an
/// acceptance only of an offer not yet accepted nor cancelled (a cancelled
/// one is not accepted: its runner is told to drop it), a result only
/// once. What each report that applied left, for the note that tells the
/// run's observers.
const REPORT: Bulk<ReportRow> = bulk!(ReportRow => [
    "UPDATE desktop_assignments SET \
       phase = CASE i.kind WHEN 'accepted' THEN 'running' WHEN 'finished' THEN 'finished' \
         ELSE desktop_assignments.phase END, \
       idle = CASE WHEN i.kind = 'accepted' THEN desktop_assignments.idle ELSE 1 END, \
       outcome = CASE WHEN i.kind = 'finished' THEN i.outcome ELSE desktop_assignments.outcome END, \
       updated_at = i.at FROM "
] [
    " WHERE desktop_assignments.run_id = i.run_id AND desktop_assignments.runner_id = i.runner_id AND desktop_assignments.stream_id = i.stream_id \
       AND CASE i.kind WHEN 'accepted' THEN desktop_assignments.phase = 'admitted' AND desktop_assignments.cancel_requested = 0 \
         WHEN 'finished' THEN desktop_assignments.phase <> 'finished' ELSE 1 = 1 END \
     RETURNING desktop_assignments.run_id, desktop_assignments.phase, desktop_assignments.idle, desktop_assignments.event_count, desktop_assignments.passed_over, desktop_assignments.outcome"
]);

bulk! {
    /// A cancellation asked for, and why.
    struct CancelRow {
        run_id: String => TEXT,
        reason: String => TEXT,
        at: i64 => BIGINT,
    }
}

/// Cancellations (the first reason stands); a run no runner holds is idle
/// the moment it is cancelled. The runs cancelled.
const CANCEL: Bulk<CancelRow> = bulk!(CancelRow => [
    "UPDATE desktop_assignments SET cancel_requested = 1, \
     cancel_reason = COALESCE(desktop_assignments.cancel_reason, i.reason), \
     idle = CASE WHEN desktop_assignments.runner_id IS NULL OR desktop_assignments.phase = 'finished' THEN 1 ELSE desktop_assignments.idle END, \
     updated_at = i.at FROM "
] [
    " WHERE desktop_assignments.run_id = i.run_id RETURNING desktop_assignments.run_id"
]);

fn decode_state(row: &AnyRow) -> Result<AssignmentState> {
    Ok(AssignmentState {
        phase: rows::col(row, "phase")?,
        idle: rows::col(row, "idle")?,
        event_count: rows::col(row, "event_count")?,
        passed_over: rows::col::<Option<String>>(row, "passed_over")?.is_some(),
        outcome_hex: rows::col(row, "outcome")?,
    })
}

/// What a runner reported, as stored.
#[derive(Debug)]
pub(super) enum Reported {
    Accepted,
    /// The encoded outcome, hex.
    Finished(String),
    Idle,
}

/// One desktop write of a run.
#[derive(Debug)]
pub(super) enum DesktopWrite {
    Offer {
        org_id: String,
        owner_id: String,
        /// The encoded spec, hex.
        spec: String,
    },
    Report {
        runner_id: String,
        stream_id: String,
        outcome: Reported,
    },
    Cancel {
        reason: String,
    },
}

/// A desktop write committed with others.
pub(super) struct Write {
    pub(super) run_id: String,
    pub(super) write: DesktopWrite,
    /// When, in microseconds.
    pub(super) at: i64,
}

/// What a desktop write did: rows changed, and for a runner's report what
/// the assignment now is.
pub(super) struct Written {
    pub(super) changed: u64,
    now: Option<AssignmentState>,
}

impl Written {
    fn rows(changed: bool) -> Self {
        let changed = u64::from(changed);
        Written { changed, now: None }
    }

    fn report(now: Option<AssignmentState>) -> Self {
        let changed = u64::from(now.is_some());
        Written { changed, now }
    }
}

/// PostgreSQL: the assignments a batch's desktop jobs write, locked in one
/// order (see [`Job::LOCK_PG`]); an offer's row may not exist yet.
pub(super) const LOCK_ASSIGNMENTS_PG: &str = "SELECT run_id FROM desktop_assignments \
     WHERE run_id IN (SELECT value FROM json_array_elements_text($1::json)) \
     ORDER BY run_id COLLATE \"C\" FOR UPDATE";

impl Job for Write {
    const LOCK_PG: &'static str = LOCK_ASSIGNMENTS_PG;

    type Output = Written;

    fn key(&self) -> &str {
        &self.run_id
    }

    fn signal(&self, written: &Written) -> Option<DesktopNote> {
        let run_id = self.run_id.clone();
        let note = match &self.write {
            _ if written.changed == 0 => return None,
            DesktopWrite::Offer {
                org_id, owner_id, ..
            } => DesktopNote::Offered {
                run_id,
                org_id: org_id.clone(),
                owner_id: owner_id.clone(),
            },
            DesktopWrite::Report { .. } => DesktopNote::Changed {
                run_id,
                now: written.now.clone(),
            },
            DesktopWrite::Cancel { .. } => DesktopNote::Cancelled { run_id },
        };
        Some(note)
    }

    /// One statement per kind of write among the jobs: offers, reports,
    /// cancellations.
    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<Written>>>> {
        Box::pin(async move {
            let (mut offers, mut reports, mut cancels) = (vec![], vec![], vec![]);
            for job in jobs {
                let (run_id, at) = (job.run_id.clone(), job.at);
                match &job.write {
                    DesktopWrite::Offer {
                        org_id,
                        owner_id,
                        spec,
                    } => offers.push(OfferRow {
                        run_id,
                        org_id: org_id.clone(),
                        owner_id: owner_id.clone(),
                        spec: spec.clone(),
                        at,
                    }),
                    DesktopWrite::Report {
                        runner_id,
                        stream_id,
                        outcome,
                    } => {
                        let (kind, outcome) = match outcome {
                            Reported::Accepted => ("accepted", None),
                            Reported::Finished(hex) => ("finished", Some(hex.clone())),
                            Reported::Idle => ("idle", None),
                        };
                        reports.push(ReportRow {
                            run_id,
                            runner_id: runner_id.clone(),
                            stream_id: stream_id.clone(),
                            kind,
                            outcome,
                            at,
                        });
                    }
                    DesktopWrite::Cancel { reason } => cancels.push(CancelRow {
                        run_id,
                        reason: reason.clone(),
                        at,
                    }),
                }
            }
            let run_id = |r: &AnyRow| rows::col::<String>(r, "run_id");
            let offered: HashSet<String> = OFFER
                .all(&mut *db, &offers, run_id)
                .await?
                .into_iter()
                .collect();
            let reported = REPORT.all(&mut *db, &reports, |r| Ok((run_id(r)?, decode_state(r)?)));
            let mut reported: HashMap<String, AssignmentState> =
                reported.await?.into_iter().collect();
            let cancelled: HashSet<String> = CANCEL
                .all(&mut *db, &cancels, run_id)
                .await?
                .into_iter()
                .collect();
            Ok(jobs
                .iter()
                .map(|job| {
                    Ok(match &job.write {
                        DesktopWrite::Offer { .. } => Written::rows(offered.contains(&job.run_id)),
                        DesktopWrite::Report { .. } => {
                            Written::report(reported.remove(&job.run_id))
                        }
                        DesktopWrite::Cancel { .. } => {
                            Written::rows(cancelled.contains(&job.run_id))
                        }
                    })
                })
                .collect())
        })
    }
}
