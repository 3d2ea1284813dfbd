//! The `desktop_events` table: the events runners reported for their
//! runs, numbered per run and deduplicated by event id, read by the
//! coordinator through `ObserveRun`; and the purge of finished assignments
//! with their events.

use chrono::{DateTime, Utc};

use crate::rows::{self, col, micros, to_hex};
use crate::{Result, Store};

/// One event a runner reported, in the run's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesktopEvent {
    pub sequence: i64,
    pub event_id: String,
    /// The encoded event.
    pub body: Vec<u8>,
}

const LOCK_EVENTS: &str = "UPDATE desktop_assignments SET event_count = event_count \
     WHERE run_id = $1 AND runner_id = $2 AND stream_id = $3 RETURNING event_count";

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

impl Store {
    /// Appends what `runner_id` reported for a run, skipping event ids the
    /// log already holds; returns how many were appended. Events of a run
    /// the runner does not hold are refused (none appended).
    pub async fn append_desktop_events(
        &self,
        run_id: &str,
        runner_id: &str,
        stream_id: &str,
        events: &[(String, Vec<u8>)],
        now: DateTime<Utc>,
    ) -> Result<usize> {
        let mut tx = self.begin_write().await?;
        let holder = (run_id, runner_id, stream_id);
        let count = rows::optional(&mut *tx, LOCK_EVENTS, holder, |r| col(r, "event_count"));
        let Some(mut seq): Option<i64> = count.await? else {
            return Ok(0);
        };
        let mut appended = 0;
        for (event_id, body) in events {
            let known = rows::optional(&mut *tx, FIND_EVENT, (run_id, event_id), |_| Ok(()));
            if known.await?.is_some() {
                continue;
            }
            seq += 1;
            let params = (run_id, seq, event_id, to_hex(body));
            rows::execute(&mut *tx, INSERT_EVENT, params).await?;
            appended += 1;
        }
        if appended > 0 {
            let params = (run_id, seq, micros(now));
            rows::execute(&mut *tx, SET_EVENT_COUNT, params).await?;
        }
        tx.commit().await?;
        Ok(self.signal_if(appended).await)
    }

    /// Up to `limit` events of a run after sequence `after`.
    pub async fn desktop_events_after(
        &self,
        run_id: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<DesktopEvent>> {
        let params = (run_id, after, i64::from(limit));
        rows::all(self.db(), EVENTS_AFTER, params, |row| {
            Ok(DesktopEvent {
                sequence: col(row, "seq")?,
                event_id: col(row, "event_id")?,
                body: col(row, "body")?,
            })
        })
        .await
    }

    /// Forgets assignments finished before `before` (the coordinator has
    /// long recorded them in the run's receipt and event log).
    pub async fn purge_finished_desktop_runs(&self, before: DateTime<Utc>) -> Result<u64> {
        let before = (micros(before),);
        let mut tx = self.begin_write().await?;
        rows::execute(&mut *tx, DELETE_FINISHED_EVENTS_BEFORE, before).await?;
        let purged = rows::execute(&mut *tx, DELETE_FINISHED_BEFORE, before).await?;
        tx.commit().await?;
        Ok(purged)
    }
}
