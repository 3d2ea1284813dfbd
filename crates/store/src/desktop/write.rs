//! The desktop writes that commit through the store's writer: offers,
//! runners' reports and cancellations, each one job as it runs alone, and
//! on PostgreSQL the statements that make a batch's offers, and its
//! reports, at once (each row guarded as it is alone).

use futures_util::future::BoxFuture;
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use crate::Result;
use crate::rows;
use crate::signal::{AssignmentState, DesktopNote};
use crate::writer::{Job, Joined, Joint, Row};

macro_rules! offer {
    () => {
        "INSERT INTO desktop_assignments \
         (run_id, org_id, owner_id, spec, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $5) \
         ON CONFLICT (run_id) DO NOTHING"
    };
}
const OFFER: &str = offer!();
/// PostgreSQL: the offer and its note in one statement, for an offer
/// written alone (its own transaction): a row for the offer made, the note
/// (`$7` on channel `$6`) sent only then.
const OFFER_NOTIFIED_PG: &str = concat!(
    "WITH offered AS (",
    offer!(),
    " RETURNING run_id) SELECT pg_notify($6, $7) FROM offered"
);

/// What a report leaves, for the note that tells the run's observers.
macro_rules! state_after {
    () => {
        " RETURNING phase, idle, event_count, passed_over, outcome"
    };
}

/// A cancelled assignment is not accepted: its runner is told to drop it.
const ACCEPTED: &str = concat!(
    "UPDATE desktop_assignments SET phase = 'running', updated_at = $4 \
     WHERE run_id = $1 AND runner_id = $2 AND stream_id = $3 AND phase = 'admitted' \
     AND cancel_requested = 0",
    state_after!()
);

const FINISHED: &str = concat!(
    "UPDATE desktop_assignments \
     SET phase = 'finished', idle = 1, outcome = $4, updated_at = $5 \
     WHERE run_id = $1 AND runner_id = $2 AND stream_id = $3 AND phase <> 'finished'",
    state_after!()
);

const IDLE: &str = concat!(
    "UPDATE desktop_assignments SET idle = 1, updated_at = $4 \
     WHERE run_id = $1 AND runner_id = $2 AND stream_id = $3",
    state_after!()
);

/// PostgreSQL: runners' reports on many runs (each run once) in one
/// statement, each row guarded as [`ACCEPTED`], [`FINISHED`] or [`IDLE`]
/// guards it alone, the rows locked in byte order of their run ids (the
/// order the writer sorts a batch in); what each report that applied
/// left.
const REPORT_MANY_PG: &str = "WITH input AS (SELECT * FROM json_to_recordset($1::json) AS i(run_id TEXT, \
       runner_id TEXT, stream_id TEXT, kind TEXT, outcome TEXT, at BIGINT)), \
     locked AS MATERIALIZED (SELECT run_id FROM desktop_assignments \
       WHERE run_id IN (SELECT run_id FROM input) ORDER BY run_id COLLATE \"C\" FOR UPDATE) \
     UPDATE desktop_assignments d SET \
       phase = CASE i.kind WHEN 'accepted' THEN 'running' WHEN 'finished' THEN 'finished' \
         ELSE d.phase END, \
       idle = CASE WHEN i.kind = 'accepted' THEN d.idle ELSE 1 END, \
       outcome = CASE WHEN i.kind = 'finished' THEN i.outcome ELSE d.outcome END, \
       updated_at = i.at \
     FROM input i WHERE d.run_id = i.run_id AND d.run_id IN (SELECT run_id FROM locked) \
       AND d.runner_id = i.runner_id AND d.stream_id = i.stream_id \
       AND CASE i.kind WHEN 'accepted' THEN d.phase = 'admitted' AND d.cancel_requested = 0 \
         WHEN 'finished' THEN d.phase <> 'finished' ELSE true END \
     RETURNING d.run_id, d.phase, d.idle, d.event_count, d.passed_over, d.outcome";

/// PostgreSQL: many offers (each run once) in one statement, as [`OFFER`]
/// makes one, inserted in byte order of their run ids; the runs offered.
const OFFER_MANY_PG: &str = "INSERT INTO desktop_assignments \
     (run_id, org_id, owner_id, spec, created_at, updated_at) \
     SELECT run_id, org_id, owner_id, spec, at, at FROM json_to_recordset($1::json) \
       AS i(run_id TEXT, org_id TEXT, owner_id TEXT, spec TEXT, at BIGINT) \
     ORDER BY run_id COLLATE \"C\" ON CONFLICT (run_id) DO NOTHING RETURNING run_id";

/// Records the reports of `input` (a JSON array of [`Write`]'s joined
/// rows) in one statement: what each that applied left, by run.
pub(crate) async fn report_many(
    db: &mut AnyConnection,
    input: String,
) -> Result<std::collections::HashMap<String, AssignmentState>> {
    let left = rows::all(db, REPORT_MANY_PG, (input,), |r| {
        Ok((rows::col::<String>(r, "run_id")?, decode_state(r)?))
    });
    Ok(left.await?.into_iter().collect())
}

/// Makes the offers of `input` (a JSON array of [`Write`]'s joined rows)
/// in one statement: the runs offered (not offered before).
pub(crate) async fn offer_many(
    db: &mut AnyConnection,
    input: String,
) -> Result<std::collections::HashSet<String>> {
    let made = rows::all(db, OFFER_MANY_PG, (input,), |r| rows::col(r, "run_id"));
    Ok(made.await?.into_iter().collect())
}

fn decode_state(row: &AnyRow) -> Result<AssignmentState> {
    Ok(AssignmentState {
        phase: rows::col(row, "phase")?,
        idle: rows::col(row, "idle")?,
        event_count: rows::col(row, "event_count")?,
        passed_over: rows::col::<Option<String>>(row, "passed_over")?.is_some(),
        outcome_hex: rows::col(row, "outcome")?,
    })
}

/// A run no runner holds is idle the moment it is cancelled.
const CANCEL: &str = "UPDATE desktop_assignments SET cancel_requested = 1, \
     cancel_reason = COALESCE(cancel_reason, $2), \
     idle = CASE WHEN runner_id IS NULL OR phase = 'finished' THEN 1 ELSE idle END, \
     updated_at = $3 WHERE run_id = $1";

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
    fn rows(changed: u64) -> Self {
        Written { changed, now: None }
    }

    fn report(now: Option<AssignmentState>) -> Self {
        let changed = u64::from(now.is_some());
        Written { changed, now }
    }
}

impl Job for Write {
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

    fn runs_alone(&self) -> bool {
        matches!(self.write, DesktopWrite::Offer { .. })
    }

    /// An offer or a report as one row of [`OFFER_MANY_PG`] or
    /// [`REPORT_MANY_PG`], with the values [`OFFER`] and the report's own
    /// statement bind.
    fn joined_row(&self) -> Option<Row> {
        let (run_id, at) = (&self.run_id, self.at);
        let (joint, value) = match &self.write {
            DesktopWrite::Offer {
                org_id,
                owner_id,
                spec,
            } => (
                Joint::Offer,
                serde_json::json!({
                    "run_id": run_id, "org_id": org_id, "owner_id": owner_id, "spec": spec, "at": at,
                }),
            ),
            DesktopWrite::Report {
                runner_id,
                stream_id,
                outcome,
            } => {
                let (kind, outcome) = match outcome {
                    Reported::Accepted => ("accepted", None),
                    Reported::Finished(hex) => ("finished", Some(hex)),
                    Reported::Idle => ("idle", None),
                };
                (
                    Joint::Report,
                    serde_json::json!({
                        "run_id": run_id, "runner_id": runner_id, "stream_id": stream_id,
                        "kind": kind, "outcome": outcome, "at": at,
                    }),
                )
            }
            DesktopWrite::Cancel { .. } => return None,
        };
        Some(Row {
            joint,
            run_id: run_id.clone(),
            value,
        })
    }

    fn joined(&self, done: Joined) -> Option<Written> {
        match (&self.write, done) {
            (DesktopWrite::Offer { .. }, Joined::Offered(made)) => {
                Some(Written::rows(u64::from(made)))
            }
            (DesktopWrite::Report { .. }, Joined::Reported(now)) => Some(Written::report(now)),
            _ => None,
        }
    }

    fn run_alone<'c>(
        &'c self,
        db: &'c mut AnyConnection,
    ) -> Option<BoxFuture<'c, Result<Written>>> {
        let DesktopWrite::Offer {
            org_id,
            owner_id,
            spec,
        } = &self.write
        else {
            return None;
        };
        // The note an offer made asks for, as one payload.
        let note = self.signal(&Written::rows(1))?;
        let payload = DesktopNote::payloads(&[note]).pop()?;
        let channel = crate::signal::Topic::Desktop.pg_channel();
        Some(Box::pin(async move {
            let params = (
                &self.run_id,
                org_id,
                owner_id,
                spec,
                self.at,
                channel,
                payload,
            );
            let made = rows::all(db, OFFER_NOTIFIED_PG, params, |_| Ok(())).await?;
            Ok(Written::rows(made.len() as u64))
        }))
    }

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Result<Written>> {
        let (run_id, at) = (self.run_id.as_str(), self.at);
        Box::pin(async move {
            match &self.write {
                DesktopWrite::Offer {
                    org_id,
                    owner_id,
                    spec,
                } => {
                    let params = (run_id, org_id, owner_id, spec, at);
                    rows::execute(db, OFFER, params).await.map(Written::rows)
                }
                DesktopWrite::Report {
                    runner_id,
                    stream_id,
                    outcome,
                } => {
                    let holder = (run_id, runner_id, stream_id);
                    let (r, runner, stream) = holder;
                    let now = match outcome {
                        Reported::Accepted => {
                            let params = (r, runner, stream, at);
                            rows::optional(db, ACCEPTED, params, decode_state).await?
                        }
                        Reported::Finished(outcome) => {
                            let params = (r, runner, stream, outcome, at);
                            rows::optional(db, FINISHED, params, decode_state).await?
                        }
                        Reported::Idle => {
                            let params = (r, runner, stream, at);
                            rows::optional(db, IDLE, params, decode_state).await?
                        }
                    };
                    Ok(Written::report(now))
                }
                DesktopWrite::Cancel { reason } => {
                    let params = (run_id, reason, at);
                    rows::execute(db, CANCEL, params).await.map(Written::rows)
                }
            }
        })
    }
}
