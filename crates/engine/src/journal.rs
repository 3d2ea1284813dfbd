//! The local journal of the runs an executor accepted — the desktop
//! runner's and the worker agent's: one append-only file per run
//! (`<dir>/<key>.jsonl`), each line synced before the executor acts on it.
//! A run is journaled as accepted *before* its engine starts, so a restart,
//! a crash or a laptop waking from sleep finds it and never runs it a second
//! time; its events and its result are journaled too, so they can be
//! reported again after a reconnect or a restart (receivers deduplicate by
//! event id).
//!
//! The desktop runner first *holds* an assignment (journaled with the
//! assignment itself) while it waits for the gateway to confirm its
//! acceptance, and accepts it only then: a held run has not started, so it
//! may be let go (the gateway gave it to another runner) or started after a
//! restart, never run twice.
//!
//! A torn last line (a crash mid-write) is ignored; the executor then only
//! lacks that one event, never a run.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use automesh_proto::v1 as pb;
use serde::{Deserialize, Serialize};

/// How long a finished run's record is kept when the gateway never says it
/// is done with it.
const KEEP_FINISHED: chrono::Duration = chrono::Duration::days(7);

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("run journal {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line {
    Accepted {
        run_id: String,
        at: String,
        /// What the executor keeps beside the id (the agent: its thread).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        note: String,
        /// The run's W3C `traceparent`, so that what the executor says of
        /// the run after a restart is in the run's trace.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        traceparent: String,
    },
    /// Held, not started: the hex-encoded assignment, kept until the
    /// acceptance is confirmed (an `Accepted` line follows) or the run is
    /// let go (the file goes).
    Held {
        run_id: String,
        at: String,
        body: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        traceparent: String,
    },
    /// A hex-encoded `automesh.v1.RunEvent`.
    Event { body: String },
    /// The hex-encoded result message (the runner: `RunFinished`; the
    /// agent: its `Thread`).
    Finished { body: String, at: String },
}

/// When a line is written, as it is written.
fn now() -> String {
    chrono::Utc::now().to_rfc3339()
}

/// What the journal holds of one run; `F` is the executor's result message.
#[derive(Debug, Clone)]
pub struct RunRecord<F> {
    pub run_id: String,
    pub note: String,
    /// The run's W3C `traceparent` (empty when none was given).
    pub traceparent: String,
    /// The assignment of a held run, which has not started; `None` once
    /// it is accepted (and for runs accepted at once).
    pub held: Option<Vec<u8>>,
    pub events: Vec<pb::RunEvent>,
    pub finished: Option<F>,
    pub finished_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl<F> RunRecord<F> {
    /// A span of the executor's work on this run, in the run's trace.
    pub fn span(&self, name: &'static str) -> tracing::Span {
        let traceparent = Some(self.traceparent.as_str()).filter(|t| !t.is_empty());
        automesh_telemetry::propagation::run_span(name, &self.run_id, traceparent)
    }
}

impl<F> Default for RunRecord<F> {
    fn default() -> Self {
        Self {
            run_id: String::new(),
            note: String::new(),
            traceparent: String::new(),
            held: None,
            events: vec![],
            finished: None,
            finished_at: None,
        }
    }
}

/// The journal directory, with results of type `F`.
#[derive(Debug)]
pub struct Record<F> {
    dir: PathBuf,
    runs: Mutex<HashMap<String, RunRecord<F>>>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RecordError + '_ {
    move |source| RecordError::Io {
        path: path.to_owned(),
        source,
    }
}

fn valid_run_id(run_id: &str) -> bool {
    !run_id.is_empty()
        && run_id.len() <= 200
        && run_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

impl<F: prost::Message + Default + Clone> Record<F> {
    /// Opens (creating) the journal in `dir` and loads what it holds.
    pub fn open(dir: &Path) -> Result<Record<F>, RecordError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut runs = HashMap::new();
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let path = entry.map_err(io(dir))?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
                continue;
            }
            let mut text = std::fs::read_to_string(&path).map_err(io(&path))?;
            if !text.is_empty() && !text.ends_with('\n') {
                // A torn last line: cut it, so the next append starts clean.
                text.truncate(text.rfind('\n').map_or(0, |i| i + 1));
                std::fs::write(&path, &text).map_err(io(&path))?;
            }
            let mut run = RunRecord::default();
            let mut torn = 0;
            for line in text.lines() {
                match serde_json::from_str::<Line>(line) {
                    Ok(Line::Accepted {
                        run_id,
                        note,
                        traceparent,
                        ..
                    }) => {
                        run.run_id = run_id;
                        run.note = note;
                        if !traceparent.is_empty() {
                            run.traceparent = traceparent;
                        }
                        run.held = None;
                    }
                    Ok(Line::Held {
                        run_id,
                        body,
                        traceparent,
                        ..
                    }) => {
                        run.run_id = run_id;
                        run.traceparent = traceparent;
                        run.held = Some(hex::decode(&body).unwrap_or_default());
                    }
                    Ok(Line::Event { body }) => {
                        if let Some(e) = hex::decode(&body).ok().and_then(|b| {
                            <pb::RunEvent as prost::Message>::decode(b.as_slice()).ok()
                        }) {
                            run.events.push(e);
                        }
                    }
                    Ok(Line::Finished { body, at }) => {
                        run.finished = hex::decode(&body)
                            .ok()
                            .and_then(|b| F::decode(b.as_slice()).ok());
                        run.finished_at = at.parse().ok();
                    }
                    Err(_) => torn += 1,
                }
            }
            if torn > 0 {
                // Said in the run's trace: the file is named after the run.
                let _in_run = run.span("automesh.journal.open").entered();
                tracing::warn!(path = %path.display(), lines = torn, "ignoring torn lines of the run journal");
            }
            if !run.run_id.is_empty() {
                runs.insert(run.run_id.clone(), run);
            }
        }
        Ok(Record {
            dir: dir.to_owned(),
            runs: Mutex::new(runs),
        })
    }

    /// Refuses a run id that could name a file outside the journal.
    fn check(&self, run_id: &str) -> Result<(), RecordError> {
        if valid_run_id(run_id) {
            Ok(())
        } else {
            Err(RecordError::Io {
                path: self.dir.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "bad run id"),
            })
        }
    }

    fn path(&self, run_id: &str) -> PathBuf {
        self.dir.join(format!("{run_id}.jsonl"))
    }

    fn append(&self, run_id: &str, line: &Line) -> Result<(), RecordError> {
        let path = self.path(run_id);
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io(&path))?;
        let mut text = serde_json::to_string(line).unwrap_or_default();
        text.push('\n');
        f.write_all(text.as_bytes()).map_err(io(&path))?;
        f.sync_data().map_err(io(&path))
    }

    /// Records a held run as accepted (keeping the trace it was held
    /// with); false when it already was (it must not run again). Synced to
    /// disk before it returns.
    pub fn accept(&self, run_id: &str) -> Result<bool, RecordError> {
        let traceparent = self.get(run_id).map(|r| r.traceparent).unwrap_or_default();
        self.accept_with(run_id, "", &traceparent)
    }

    /// Records the run as accepted (a held one too), keeping `note` beside
    /// the id and the run's `traceparent`; false when it already was.
    pub fn accept_with(
        &self,
        run_id: &str,
        note: &str,
        traceparent: &str,
    ) -> Result<bool, RecordError> {
        self.check(run_id)?;
        let mut runs = self.runs.lock();
        if runs.get(run_id).is_some_and(|r| r.held.is_none()) {
            return Ok(false);
        }
        let line = Line::Accepted {
            run_id: run_id.to_owned(),
            at: now(),
            note: note.to_owned(),
            traceparent: traceparent.to_owned(),
        };
        self.append(run_id, &line)?;
        let run = runs.entry(run_id.to_owned()).or_default();
        run.run_id = run_id.to_owned();
        run.note = note.to_owned();
        run.traceparent = traceparent.to_owned();
        run.held = None;
        Ok(true)
    }

    /// Holds a run that must not start yet, with its `assignment` and its
    /// `traceparent`; false when the run is known already (held or
    /// accepted). Synced to disk before it returns. [`Record::accept`]
    /// starts it later.
    pub fn hold(
        &self,
        run_id: &str,
        assignment: &[u8],
        traceparent: &str,
    ) -> Result<bool, RecordError> {
        self.check(run_id)?;
        let mut runs = self.runs.lock();
        if runs.contains_key(run_id) {
            return Ok(false);
        }
        let (run_id, body) = (run_id.to_owned(), hex::encode(assignment));
        self.append(
            &run_id,
            &Line::Held {
                run_id: run_id.clone(),
                at: now(),
                body,
                traceparent: traceparent.to_owned(),
            },
        )?;
        runs.insert(
            run_id.to_owned(),
            RunRecord {
                run_id: run_id.to_owned(),
                traceparent: traceparent.to_owned(),
                held: Some(assignment.to_vec()),
                ..RunRecord::default()
            },
        );
        Ok(true)
    }

    /// Lets go of a held run that never started (another executor has
    /// it); true when it was held. An accepted run is never let go here.
    pub fn let_go(&self, run_id: &str) -> bool {
        let mut runs = self.runs.lock();
        if runs.get(run_id).is_some_and(|r| r.held.is_some()) {
            runs.remove(run_id);
            let _ = std::fs::remove_file(self.path(run_id));
            true
        } else {
            false
        }
    }

    /// Records an event of the run.
    pub fn event(&self, run_id: &str, event: &pb::RunEvent) -> Result<(), RecordError> {
        let mut runs = self.runs.lock();
        self.append(
            run_id,
            &Line::Event {
                body: hex::encode(prost::Message::encode_to_vec(event)),
            },
        )?;
        if let Some(r) = runs.get_mut(run_id) {
            r.events.push(event.clone());
        }
        Ok(())
    }

    /// Records the run's result.
    pub fn finish(&self, run_id: &str, finished: &F) -> Result<(), RecordError> {
        let mut runs = self.runs.lock();
        let now = chrono::Utc::now();
        self.append(
            run_id,
            &Line::Finished {
                body: hex::encode(finished.encode_to_vec()),
                at: now.to_rfc3339(),
            },
        )?;
        if let Some(r) = runs.get_mut(run_id) {
            r.finished = Some(finished.clone());
            r.finished_at = Some(now);
        }
        Ok(())
    }

    /// Forgets a finished run the gateway no longer needs.
    pub fn forget(&self, run_id: &str) {
        let mut runs = self.runs.lock();
        if runs.get(run_id).is_some_and(|r| r.finished.is_some()) {
            runs.remove(run_id);
            let _ = std::fs::remove_file(self.path(run_id));
        }
    }

    /// One run's record.
    pub fn get(&self, run_id: &str) -> Option<RunRecord<F>> {
        self.runs.lock().get(run_id).cloned()
    }

    /// Every run recorded, after dropping finished ones past retention.
    pub fn all(&self) -> Vec<RunRecord<F>> {
        let cutoff = chrono::Utc::now() - KEEP_FINISHED;
        let stale: Vec<String> = {
            let runs = self.runs.lock();
            runs.values()
                .filter(|r| r.finished_at.is_some_and(|t| t < cutoff))
                .map(|r| r.run_id.clone())
                .collect()
        };
        for run_id in stale {
            self.forget(&run_id);
        }
        self.runs.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use automesh_proto::runner::v1 as rpb;

    type Record = super::Record<rpb::RunFinished>;

    /// A journal opened in a fresh directory named after `name`.
    fn opened(name: &str) -> (PathBuf, Record) {
        let d = dir(name);
        let r = Record::open(&d).expect("open");
        (d, r)
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "automesh-record-{name}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn an_accepted_run_survives_a_reopen_and_is_not_accepted_twice() {
        let (d, r) = opened("reopen");
        assert!(r.accept("run-1").expect("accept"));
        assert!(!r.accept("run-1").expect("again"));
        let e = pb::RunEvent {
            event_id: "run-1:1".into(),
            ..Default::default()
        };
        r.event("run-1", &e).expect("event");
        drop(r);
        let r = Record::open(&d).expect("reopen");
        assert!(!r.accept("run-1").expect("after reopen"));
        let run = r.get("run-1").expect("held");
        assert_eq!(run.events.len(), 1);
        assert!(run.finished.is_none());
        r.finish(
            "run-1",
            &rpb::RunFinished {
                run_id: "run-1".into(),
                ..Default::default()
            },
        )
        .expect("finish");
        let r = Record::open(&d).expect("reopen");
        assert!(r.get("run-1").expect("held").finished.is_some());
        r.forget("run-1");
        assert!(r.get("run-1").is_none());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_torn_last_line_loses_only_that_line() {
        let (d, r) = opened("torn");
        assert!(r.accept("run-2").expect("accept"));
        drop(r);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(d.join("run-2.jsonl"))
            .expect("file");
        f.write_all(b"{\"kind\":\"ev").expect("torn");
        let r = Record::open(&d).expect("reopen");
        assert!(r.get("run-2").is_some());
        assert!(!r.accept("run-2").expect("still accepted"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_held_run_survives_a_reopen_unstarted_and_is_started_once() {
        let (d, r) = opened("held");
        let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert!(r.hold("run-3", b"assignment", trace).expect("hold"));
        assert!(!r.hold("run-3", b"assignment", trace).expect("held already"));
        drop(r);
        let r = Record::open(&d).expect("reopen");
        let held = r.get("run-3").expect("held");
        assert_eq!(held.held.as_deref(), Some(&b"assignment"[..]));
        assert_eq!(held.traceparent, trace);
        assert!(r.accept("run-3").expect("start"));
        assert!(!r.accept("run-3").expect("started already"));
        assert!(!r.let_go("run-3"), "a started run is never let go");
        drop(r);
        // The run's trace outlives its acceptance and a restart: what is
        // said of it later (an interruption) is in its trace.
        let r = Record::open(&d).expect("reopen");
        let accepted = r.get("run-3").expect("kept");
        assert!(accepted.held.is_none());
        assert_eq!(accepted.traceparent, trace);
        assert!(!r.accept("run-3").expect("still started"));
        // A held run let go is gone, file and all.
        assert!(r.hold("run-4", b"other", "").expect("hold"));
        assert!(r.let_go("run-4"));
        assert!(!d.join("run-4.jsonl").exists());
        assert!(Record::open(&d).expect("reopen").get("run-4").is_none());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn run_ids_cannot_escape_the_directory() {
        let (d, r) = opened("escape");
        assert!(r.accept("../etc/passwd").is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
