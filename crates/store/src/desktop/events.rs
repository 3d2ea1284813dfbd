//! The `desktop_events` table: the events runners reported for their
//! runs, numbered per run and deduplicated by event id, read by the
//! coordinator through `ObserveRun`; and the purge of finished assignments
//! with their events.

use chrono::{DateTime, Utc};

use crate::rows::{from_hex, int, micros, text, to_hex};
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
        let Some(mut seq): Option<i64> = sqlx::query_scalar(LOCK_EVENTS)
            .bind(run_id)
            .bind(runner_id)
            .bind(stream_id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(0);
        };
        let mut appended = 0;
        for (event_id, body) in events {
            let existing: Option<i64> = sqlx::query_scalar(FIND_EVENT)
                .bind(run_id)
                .bind(event_id)
                .fetch_optional(&mut *tx)
                .await?;
            if existing.is_some() {
                continue;
            }
            seq += 1;
            sqlx::query(INSERT_EVENT)
                .bind(run_id)
                .bind(seq)
                .bind(event_id)
                .bind(to_hex(body))
                .execute(&mut *tx)
                .await?;
            appended += 1;
        }
        if appended > 0 {
            sqlx::query(SET_EVENT_COUNT)
                .bind(run_id)
                .bind(seq)
                .bind(micros(now))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        if appended > 0 {
            self.desktop_changed().await;
        }
        Ok(appended)
    }

    /// Up to `limit` events of a run after sequence `after`.
    pub async fn desktop_events_after(
        &self,
        run_id: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<DesktopEvent>> {
        let rows = sqlx::query(EVENTS_AFTER)
            .bind(run_id)
            .bind(after)
            .bind(i64::from(limit))
            .fetch_all(self.db())
            .await?;
        rows.iter()
            .map(|row| {
                Ok(DesktopEvent {
                    sequence: int(row, "seq")?,
                    event_id: text(row, "event_id")?,
                    body: from_hex(&text(row, "body")?)?,
                })
            })
            .collect()
    }

    /// Forgets assignments finished before `before` (the coordinator has
    /// long recorded them in the run's receipt and event log).
    pub async fn purge_finished_desktop_runs(&self, before: DateTime<Utc>) -> Result<u64> {
        let mut tx = self.begin_write().await?;
        sqlx::query(DELETE_FINISHED_EVENTS_BEFORE)
            .bind(micros(before))
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query(DELETE_FINISHED_BEFORE)
            .bind(micros(before))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }
}
