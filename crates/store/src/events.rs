//! Queries of a run's event log: ordered by a per-run sequence number and
//! deduplicated by the producer's event id.

use automesh_domain::{ErrorCode, RunEvent, RunEventPayload, RunState};
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use crate::rows::{self, col, micros};
use crate::{Result, Store, StoreError};

/// Locks the run row (a no-op write) and reads its last sequence, so that
/// concurrent appenders to one run queue up instead of racing for numbers.
const LOCK_RUN: &str =
    "UPDATE runs SET last_event_seq = last_event_seq WHERE id = $1 RETURNING last_event_seq";

/// An event, unless the log holds its id already.
const INSERT: &str = "INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (run_id, event_id) DO NOTHING";

const SET_LAST_SEQ: &str = "UPDATE runs SET last_event_seq = $2 WHERE id = $1";

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

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Result<Vec<RunEvent>>> {
        Box::pin(append_in(db, &self.run_id, &self.events, self.now))
    }
}

/// [`Store::append_events`] inside the caller's transaction, so events can
/// commit with the state change they describe.
pub(crate) async fn append_in(
    tx: &mut AnyConnection,
    run_id: &str,
    events: &[NewEvent],
    now: DateTime<Utc>,
) -> Result<Vec<RunEvent>> {
    let last = rows::optional(&mut *tx, LOCK_RUN, (run_id,), |r| col(r, "last_event_seq"));
    let mut seq: i64 = last.await?.ok_or(StoreError::NotFound)?;
    let mut appended = Vec::new();
    for event in events {
        // An id the log holds (or this call appended) adds nothing.
        if insert(&mut *tx, run_id, seq + 1, event, now).await? {
            seq += 1;
            appended.push(RunEvent {
                run_id: run_id.to_owned(),
                sequence: seq,
                event_id: event.event_id.clone(),
                created_at: now,
                payload: event.payload.clone(),
            });
        }
    }
    if !appended.is_empty() {
        rows::execute(&mut *tx, SET_LAST_SEQ, (run_id, seq)).await?;
    }
    Ok(appended)
}

/// An event's id, kind and stored payload, as `run_events` keeps them.
pub(crate) fn columns(event: &NewEvent) -> Result<(&str, &'static str, String)> {
    let payload = serde_json::to_string(&event.payload)
        .map_err(|e| StoreError::Corrupt(format!("event payload: {e}")))?;
    Ok((&event.event_id, event.payload.kind(), payload))
}

/// Inserts `event` at `seq`, the run's row locked and its sequence taken by
/// the caller; false when the log holds the event's id already.
pub(crate) async fn insert(
    tx: &mut AnyConnection,
    run_id: &str,
    seq: i64,
    event: &NewEvent,
    now: DateTime<Utc>,
) -> Result<bool> {
    let (id, kind, payload) = columns(event)?;
    let params = (run_id, seq, id, kind, payload, micros(now));
    rows::changed_one(&mut *tx, INSERT, params).await
}

impl crate::Internal<'_> {
    /// Up to `limit` events of a run with a sequence greater than `after`.
    pub async fn events(self, run_id: &str, after: i64, limit: u32) -> Result<Vec<RunEvent>> {
        let params = (run_id, after, i64::from(limit));
        rows::all(self.db(), LIST_AFTER, params, decode).await
    }
}
