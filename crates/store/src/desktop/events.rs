//! The `desktop_events` table: the events runners reported for their
//! runs, numbered per run and deduplicated by event id, read by the
//! coordinator through `ObserveRun`; and the purge of finished assignments
//! with their events.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use std::collections::{HashMap, HashSet};

use crate::rows::{self, col, micros, to_hex};
use crate::signal::DesktopNote;
use crate::sql::{Bulk, bulk};
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

bulk! {
    /// A runner's claim on a run's log: the stream it reports on.
    struct HolderRow {
        run_id: String => TEXT,
        runner_id: String => TEXT,
        stream_id: String => TEXT,
    }
}

/// The logs' event counts, of the runs each row's stream still holds, the
/// assignments locked until the batch commits.
const LOCK_EVENTS: Bulk<HolderRow> = bulk!(HolderRow => [
    "UPDATE desktop_assignments SET event_count = desktop_assignments.event_count FROM "
] [
    " WHERE desktop_assignments.run_id = i.run_id AND desktop_assignments.runner_id = i.runner_id AND desktop_assignments.stream_id = i.stream_id \
     RETURNING desktop_assignments.run_id, desktop_assignments.event_count"
]);

bulk! {
    /// An event at its number in its run's desktop log (`body` in hex).
    struct EventRow {
        run_id: String => TEXT,
        seq: i64 => BIGINT,
        event_id: String => TEXT,
        body: String => TEXT,
    }
}

/// Which of the rows' ids their runs' logs hold already.
const HELD: Bulk<EventRow> = bulk!(EventRow => [
    "SELECT e.run_id, e.event_id FROM desktop_events e JOIN "
] [
    " ON e.run_id = i.run_id AND e.event_id = i.event_id"
]);

/// Events, each unless its run's log holds its id already.
const INSERT_EVENT: Bulk<EventRow> = bulk!(EventRow => [
    "INSERT INTO desktop_events (run_id, seq, event_id, body) \
     SELECT i.run_id, i.seq, i.event_id, i.body FROM "
] [
    " WHERE true ON CONFLICT (run_id, event_id) DO NOTHING"
]);

bulk! {
    /// A log's new event count.
    struct CountRow {
        run_id: String => TEXT,
        event_count: i64 => BIGINT,
        updated_at: i64 => BIGINT,
    }
}

const SET_EVENT_COUNT: Bulk<CountRow> = bulk!(CountRow => [
    "UPDATE desktop_assignments SET event_count = i.event_count, updated_at = i.updated_at FROM "
] [
    " WHERE desktop_assignments.run_id = i.run_id"
]);

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
    const LOCK_PG: &'static str = super::write::LOCK_ASSIGNMENTS_PG;

    type Output = usize;

    fn key(&self) -> &str {
        &self.run_id
    }

    fn signal(&self, appended: &usize) -> Option<DesktopNote> {
        let run_id = self.run_id.clone();
        (*appended > 0).then_some(DesktopNote::Changed { run_id, now: None })
    }

    /// Four statements for every job: lock the held logs and read their
    /// counts, find the ids they hold, insert the rest numbered on, and
    /// set the new counts.
    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<usize>>>> {
        Box::pin(async move {
            let holders: Vec<HolderRow> = jobs
                .iter()
                .map(|j| HolderRow {
                    run_id: j.run_id.clone(),
                    runner_id: j.runner_id.clone(),
                    stream_id: j.stream_id.clone(),
                })
                .collect();
            let counts = LOCK_EVENTS.all(&mut *db, &holders, |r| {
                Ok((col::<String>(r, "run_id")?, col::<i64>(r, "event_count")?))
            });
            let counts: HashMap<String, i64> = counts.await?.into_iter().collect();
            let candidates: Vec<EventRow> = jobs
                .iter()
                .filter(|j| counts.contains_key(&j.run_id))
                .flat_map(|j| j.events.iter().map(|(id, body)| j.row(0, id, body)))
                .collect();
            let held = HELD.all(&mut *db, &candidates, |r| {
                Ok((col::<String>(r, "run_id")?, col::<String>(r, "event_id")?))
            });
            let mut held: HashSet<(String, String)> = held.await?.into_iter().collect();
            let mut rows = vec![];
            let mut new_counts = vec![];
            let mut answers = vec![];
            for job in jobs {
                // Events of a run the stream does not hold: none appended.
                let Some(&from) = counts.get(&job.run_id) else {
                    answers.push(Ok(0));
                    continue;
                };
                let mut seq = from;
                for (event_id, body) in &job.events {
                    // An id the log holds (or this job appends) adds nothing.
                    if held.insert((job.run_id.clone(), event_id.clone())) {
                        seq += 1;
                        rows.push(job.row(seq, event_id, body));
                    }
                }
                if seq > from {
                    new_counts.push(CountRow {
                        run_id: job.run_id.clone(),
                        event_count: seq,
                        updated_at: job.at,
                    });
                }
                answers.push(Ok(usize::try_from(seq - from).unwrap_or(0)));
            }
            INSERT_EVENT.execute(&mut *db, &rows).await?;
            SET_EVENT_COUNT.execute(&mut *db, &new_counts).await?;
            Ok(answers)
        })
    }
}

impl Append {
    fn row(&self, seq: i64, event_id: &str, body: &str) -> EventRow {
        EventRow {
            run_id: self.run_id.clone(),
            seq,
            event_id: event_id.to_owned(),
            body: body.to_owned(),
        }
    }
}
