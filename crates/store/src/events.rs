//! Queries of a run's event log: ordered by a per-run sequence number and
//! deduplicated by the producer's event id.

use std::collections::HashSet;

use automesh_domain::{ErrorCode, RunEvent, RunEventPayload, RunState};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use crate::rows::{self, col, micros};
use crate::{Result, Store, StoreError};

/// Locks the run row (a no-op write) and reads its last sequence, so that
/// concurrent appenders to one run queue up instead of racing for numbers.
const LOCK_RUN: &str =
    "UPDATE runs SET last_event_seq = last_event_seq WHERE id = $1 RETURNING last_event_seq";

const FIND_BY_EVENT_ID: &str = "SELECT seq FROM run_events WHERE run_id = $1 AND event_id = $2";

const INSERT: &str = "INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6)";

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

/// [`Store::append_events`] inside the caller's transaction, so events can
/// commit with the state change they describe.
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

pub(crate) async fn append_in(
    tx: &mut AnyConnection,
    run_id: &str,
    events: &[NewEvent],
    now: DateTime<Utc>,
) -> Result<Vec<RunEvent>> {
    let mut seq: i64 = rows::optional(&mut *tx, LOCK_RUN, (run_id,), |r| col(r, "last_event_seq"))
        .await?
        .ok_or(StoreError::NotFound)?;
    let mut seen = HashSet::new();
    let mut appended = Vec::new();
    for event in events {
        if !seen.insert(event.event_id.as_str()) {
            continue;
        }
        let known = (run_id, &event.event_id);
        if rows::optional(&mut *tx, FIND_BY_EVENT_ID, known, |_| Ok(()))
            .await?
            .is_some()
        {
            continue;
        }
        seq += 1;
        let payload = serde_json::to_string(&event.payload)
            .map_err(|e| StoreError::Corrupt(format!("event payload: {e}")))?;
        let kind = event.payload.kind();
        let params = (run_id, seq, &event.event_id, kind, payload, micros(now));
        rows::execute(&mut *tx, INSERT, params).await?;
        appended.push(RunEvent {
            run_id: run_id.to_owned(),
            sequence: seq,
            event_id: event.event_id.clone(),
            created_at: now,
            payload: event.payload.clone(),
        });
    }
    if !appended.is_empty() {
        rows::execute(&mut *tx, SET_LAST_SEQ, (run_id, seq)).await?;
    }
    Ok(appended)
}

impl crate::Internal<'_> {
    /// Up to `limit` events of a run with a sequence greater than `after`.
    pub async fn events(self, run_id: &str, after: i64, limit: u32) -> Result<Vec<RunEvent>> {
        let params = (run_id, after, i64::from(limit));
        rows::all(self.db(), LIST_AFTER, params, decode).await
    }
}
