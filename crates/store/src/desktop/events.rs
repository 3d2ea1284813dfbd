//! The `desktop_events` table: the events runners reported for their
//! runs, numbered per run and deduplicated by event id, read by the
//! coordinator through `ObserveRun`; and the purge of finished assignments
//! with their events.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use crate::rows::{self, col, micros, to_hex};
use crate::signal::DesktopNote;
use crate::writer::Job;
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

/// An event, unless the run's log holds its id already.
const INSERT_EVENT: &str = "INSERT INTO desktop_events (run_id, seq, event_id, body) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (run_id, event_id) DO NOTHING";

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
        let append = Append {
            run_id: run_id.to_owned(),
            runner_id: runner_id.to_owned(),
            stream_id: stream_id.to_owned(),
            events: events
                .iter()
                .map(|(id, body)| (id.clone(), to_hex(body)))
                .collect(),
            at: micros(now),
        };
        self.writer().write(append).await
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

/// A runner's events for one run, committed with others.
struct Append {
    run_id: String,
    runner_id: String,
    stream_id: String,
    /// Event ids and hex bodies.
    events: Vec<(String, String)>,
    at: i64,
}

impl Job for Append {
    type Output = usize;

    fn key(&self) -> &str {
        &self.run_id
    }

    fn signal(&self, appended: &usize) -> Option<DesktopNote> {
        let run_id = self.run_id.clone();
        (*appended > 0).then_some(DesktopNote::Changed { run_id, now: None })
    }

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Result<usize>> {
        Box::pin(async move {
            let run_id = self.run_id.as_str();
            let holder = (run_id, &self.runner_id, &self.stream_id);
            let count = rows::optional(&mut *db, LOCK_EVENTS, holder, |r| col(r, "event_count"));
            let Some(mut seq): Option<i64> = count.await? else {
                return Ok(0);
            };
            let mut appended = 0;
            for (event_id, body) in &self.events {
                let params = (run_id, seq + 1, event_id, body);
                if rows::changed_one(&mut *db, INSERT_EVENT, params).await? {
                    seq += 1;
                    appended += 1;
                }
            }
            if appended > 0 {
                let params = (run_id, seq, self.at);
                rows::execute(&mut *db, SET_EVENT_COUNT, params).await?;
            }
            Ok(appended)
        })
    }
}
