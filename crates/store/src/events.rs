//! Queries of a run's event log: ordered by a per-run sequence number and
//! deduplicated by the producer's event id.

use automesh_domain::{ErrorCode, RunEvent, RunEventPayload, RunState};
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use std::collections::{HashMap, HashSet};

use crate::rows::{self, col, micros};
use crate::sql::{Bulk, bulk};
use crate::{Result, Store, StoreError};

bulk! {
    /// An event at its number in its run's log.
    struct EventRow {
        run_id: String => TEXT,
        seq: i64 => BIGINT,
        event_id: String => TEXT,
        kind: &'static str => TEXT,
        payload: String => TEXT,
        created_at: i64 => BIGINT,
    }
}

/// Events, each unless its run's log holds its id already: the ones
/// written.
pub(crate) const INSERT: Bulk<EventRow> = bulk!(EventRow => [
    "INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
     SELECT i.run_id, i.seq, i.event_id, i.kind, i.payload, i.created_at FROM "
] [
    " WHERE true ON CONFLICT (run_id, event_id) DO NOTHING RETURNING run_id, event_id"
]);

/// For the rows' runs, each run's last event number (a row with no
/// `event_id`), and which of the rows' ids its log holds already (rows
/// with an `event_id`): one round trip for what numbering needs.
const LOOKUP: Bulk<EventRow> = bulk!(EventRow => [
    "WITH input AS (SELECT * FROM "
] [
    ") SELECT r.id AS run_id, r.last_event_seq AS seq, NULL AS event_id FROM runs r \
       WHERE r.id IN (SELECT run_id FROM input) \
     UNION ALL SELECT e.run_id, e.seq, e.event_id FROM run_events e \
       JOIN input ON e.run_id = input.run_id AND e.event_id = input.event_id"
]);

/// The runs' last event numbers (`seq` of each row).
pub(crate) const SET_LAST_SEQ: Bulk<EventRow> = bulk!(EventRow => [
    "UPDATE runs SET last_event_seq = i.seq FROM "
] [
    " WHERE runs.id = i.run_id"
]);

const LIST_AFTER: &str = "SELECT run_id, seq, event_id, payload, created_at FROM run_events \
     WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3";

fn decode(row: &AnyRow) -> Result<RunEvent> {
    rows::columns! { row => RunEvent { run_id, sequence = "seq", event_id, created_at, payload } }
}

/// An event as a producer sends it: its own id and what happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEvent {
    pub event_id: String,
    pub payload: RunEventPayload,
}

impl Store {
    /// Appends events to a run's log in order, skipping any whose event id
    /// the log already holds, and returns only the ones appended.
    pub async fn append_events(
        &self,
        run_id: &str,
        events: &[NewEvent],
        now: DateTime<Utc>,
    ) -> Result<Vec<RunEvent>> {
        let append = Append {
            run_id: run_id.to_owned(),
            events: events.to_vec(),
            now,
        };
        self.writer().write(append).await
    }
}

/// The id of the status event a run's move to `state` is recorded under:
/// one per state, however often it is recorded.
pub fn status_event_id(state: RunState) -> String {
    format!("coordinator:status:{state}")
}

/// The status event of a run's move to `state`.
pub fn status_event(state: RunState, code: Option<ErrorCode>, message: Option<&str>) -> NewEvent {
    NewEvent {
        event_id: status_event_id(state),
        payload: RunEventPayload::StatusChange {
            state: state.as_str().to_owned(),
            error_code: code.map(|c| c.as_str().to_owned()),
            message: message.map(str::to_owned),
        },
    }
}

/// Events appended to one run's log, committed with others.
struct Append {
    run_id: String,
    events: Vec<NewEvent>,
    now: DateTime<Utc>,
}

impl crate::writer::Job for Append {
    type Output = Vec<RunEvent>;

    fn key(&self) -> &str {
        &self.run_id
    }

    /// Three statements for every job: the runs' last numbers with which
    /// ids their logs hold, the new events numbered on from the last, and
    /// the runs' new last numbers. The numbers read are the batch's to take:
    /// its runs are locked before (PostgreSQL; SQLite has one writer), so
    /// two writers never number one run's events alike.
    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<Vec<RunEvent>>>>> {
        Box::pin(async move {
            let mut candidates = vec![];
            for job in jobs {
                for event in &job.events {
                    candidates.push(row(&job.run_id, 0, event, job.now)?);
                }
            }
            // A job of no events still needs its run's last number (or to
            // hear that the run does not exist).
            for job in jobs.iter().filter(|j| j.events.is_empty()) {
                let none = NewEvent {
                    event_id: String::new(),
                    payload: RunEventPayload::AssistantText {
                        text: String::new(),
                    },
                };
                candidates.push(row(&job.run_id, 0, &none, job.now)?);
            }
            let found = LOOKUP.all(&mut *db, &candidates, |r| {
                let run_id: String = col(r, "run_id")?;
                let event_id: Option<String> = col(r, "event_id")?;
                Ok((run_id, col::<i64>(r, "seq")?, event_id))
            });
            let mut last: HashMap<String, i64> = HashMap::new();
            let mut held: HashSet<(String, String)> = HashSet::new();
            for (run_id, seq, event_id) in found.await? {
                match event_id {
                    Some(event_id) => {
                        held.insert((run_id, event_id));
                    }
                    None => {
                        last.insert(run_id, seq);
                    }
                }
            }
            let mut rows = vec![];
            let mut answers = vec![];
            for job in jobs {
                let Some(&from) = last.get(&job.run_id) else {
                    answers.push(Err(StoreError::NotFound));
                    continue;
                };
                let mut seq = from;
                let mut appended = vec![];
                for event in &job.events {
                    // An id the log holds (or this job appends) adds nothing.
                    if !held.insert((job.run_id.clone(), event.event_id.clone())) {
                        continue;
                    }
                    seq += 1;
                    rows.push(row(&job.run_id, seq, event, job.now)?);
                    appended.push(RunEvent {
                        run_id: job.run_id.clone(),
                        sequence: seq,
                        event_id: event.event_id.clone(),
                        created_at: job.now,
                        payload: event.payload.clone(),
                    });
                }
                answers.push(Ok(appended));
            }
            INSERT.execute(&mut *db, &rows).await?;
            // Each run's last row carries its new last number.
            let mut lasts: HashMap<&str, &EventRow> = HashMap::new();
            for row in &rows {
                lasts.insert(&row.run_id, row);
            }
            let lasts: Vec<EventRow> = lasts.into_values().cloned().collect();
            SET_LAST_SEQ.execute(&mut *db, &lasts).await?;
            Ok(answers)
        })
    }
}

/// `event` as the row of run `run_id`'s log at `seq`.
pub(crate) fn row(run_id: &str, seq: i64, event: &NewEvent, at: DateTime<Utc>) -> Result<EventRow> {
    let payload = serde_json::to_string(&event.payload)
        .map_err(|e| StoreError::Corrupt(format!("event payload: {e}")))?;
    Ok(EventRow {
        run_id: run_id.to_owned(),
        seq,
        event_id: event.event_id.clone(),
        kind: event.payload.kind(),
        payload,
        created_at: micros(at),
    })
}

impl crate::Internal<'_> {
    /// Up to `limit` events of a run with a sequence greater than `after`.
    pub async fn events(self, run_id: &str, after: i64, limit: u32) -> Result<Vec<RunEvent>> {
        let params = (run_id, after, i64::from(limit));
        rows::all(self.db(), LIST_AFTER, params, decode).await
    }
}
