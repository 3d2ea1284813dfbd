//! The desktop executor: the coordinator's `ExecutorService` for desktop
//! runs, served by every gateway replica alike.
//!
//! Nothing here lives only in one replica's memory. `StartRun` offers the
//! run in PostgreSQL/SQLite (idempotent by run id) and signals the other
//! replicas (LISTEN/NOTIFY); the replica holding a stream of the owner's
//! runner claims the assignment for that runner with a guarded update — so
//! exactly one replica sends it — and writes back what the runner reports.
//! `ObserveRun`, `CancelRun` and `GetRunStatus` read and write the same rows
//! on whichever replica the coordinator calls. With no runner connected the
//! offer simply waits; the coordinator ends it `runner_offline` at the
//! deadline.

use std::sync::Arc;

use automesh_edge::status;
use automesh_executor::{self as executor, Executor};
use automesh_proto::executor::v1 as epb;
use automesh_proto::v1 as pb;
use automesh_store::desktop::{DesktopAssignment, DesktopPhase};
use automesh_store::{AssignmentState, Store};
use chrono::Utc;
use prost::Message as _;
use tonic::Status;
use tracing::Instrument;

use crate::dispatch::Dispatch;

/// Events one `ObserveRun` read takes.
const EVENTS_PAGE: u32 = 256;

fn status_of(a: Option<&DesktopAssignment>) -> epb::ExecutionStatus {
    a.map_or_else(executor::unknown_status, |a| Seen::of(a).status())
}

/// What an observer knows of a run's assignment: read from its row, or told
/// by the note of the change that made it so.
struct Seen {
    phase: DesktopPhase,
    idle: bool,
    event_count: i64,
    passed_over: bool,
    outcome: Option<Vec<u8>>,
}

impl Seen {
    fn of(a: &DesktopAssignment) -> Seen {
        Seen {
            phase: a.phase,
            idle: a.idle,
            event_count: a.event_count,
            passed_over: a.passed_over.is_some(),
            outcome: a.outcome.clone(),
        }
    }

    fn told(state: &AssignmentState) -> Seen {
        Seen {
            phase: state.phase,
            idle: state.idle,
            event_count: state.event_count,
            passed_over: state.passed_over,
            outcome: state.outcome(),
        }
    }

    /// How far along it is: an assignment only ever moves forward, so a
    /// note behind what was seen is one delivered late.
    fn progress(&self) -> (u8, bool, i64) {
        let phase = match self.phase {
            DesktopPhase::Admitted => 0,
            DesktopPhase::Running => 1,
            DesktopPhase::Finished => 2,
        };
        (phase, self.idle, self.event_count)
    }

    fn status(&self) -> epb::ExecutionStatus {
        let phase = match self.phase {
            DesktopPhase::Admitted => epb::ExecutionPhase::Admitted,
            DesktopPhase::Running => epb::ExecutionPhase::Running,
            DesktopPhase::Finished => epb::ExecutionPhase::Finished,
        };
        epb::ExecutionStatus {
            phase: phase as i32,
            idle: self.idle,
            outcome: self
                .outcome
                .as_deref()
                .and_then(|b| epb::Outcome::decode(b).ok()),
            unaccepted: self.passed_over && self.phase == DesktopPhase::Admitted,
        }
    }
}

/// The `ExecutorService` of desktop runs.
#[derive(Debug, Clone)]
pub struct DesktopExecutor {
    store: Store,
    dispatch: Arc<Dispatch>,
}

impl DesktopExecutor {
    pub fn new(store: Store, dispatch: Arc<Dispatch>) -> Self {
        Self { store, dispatch }
    }

    /// A desktop run's assignment, if it has one.
    async fn assignment(&self, run_id: &str) -> Result<Option<DesktopAssignment>, Status> {
        let a = self.store.desktop_run(run_id).await;
        a.map_err(|e| status::of(&e, "desktop dispatch"))
    }
}

#[tonic::async_trait]
impl Executor for DesktopExecutor {
    async fn start(&self, spec: epb::RunSpec) -> Result<(bool, epb::ExecutionStatus), Status> {
        let (org, owner, body) = (&spec.organization_id, &spec.owner_id, spec.encode_to_vec());
        let offered = self
            .store
            .offer_desktop_run(&spec.run_id, org, owner, &body, Utc::now());
        let offered = offered
            .await
            .map_err(|e| status::of(&e, "desktop dispatch"))?;
        if offered {
            tracing::info!(run_id = %spec.run_id, "desktop run offered to the owner's runners");
            // Just offered: admitted, as nothing else could have changed it
            // yet but a runner's claim, which leaves it admitted.
            let admitted = epb::ExecutionStatus {
                phase: epb::ExecutionPhase::Admitted as i32,
                idle: false,
                outcome: None,
                unaccepted: false,
            };
            return Ok((true, admitted));
        }
        Ok((false, self.status(&spec.run_id).await?))
    }

    async fn observe(&self, run_id: String, after: i64) -> Result<executor::ObserveStream, Status> {
        let store = self.store.clone();
        let dispatch = self.dispatch.clone();
        let (mut observer, stream) = executor::observe();
        // In the run's trace, as the `ObserveRun` request that asked for it.
        let span = tracing::info_span!("automesh.desktop.observe", run_id = %run_id, after);
        tokio::spawn(async move {
            let mut after = after;
            let wake = dispatch.observe_run(&run_id);
            let mut first = true;
            let mut seen: Option<(u8, bool, i64)> = None;
            loop {
                let changed = wake.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                // Status first, events after: a finished status read before
                // its events would end the stream too early. The status is
                // what the note that woke it said, unless that is behind
                // what was seen; else the row. Events only when there are
                // more than were seen (a run's events are numbered 1, 2, …
                // as they are appended).
                let told = wake
                    .told()
                    .map(|t| Seen::told(&t))
                    .filter(|t| seen.is_none_or(|s| t.progress() >= s));
                let read = async {
                    let a = match told {
                        Some(t) => Some(t),
                        None => store.desktop_run(&run_id).await?.as_ref().map(Seen::of),
                    };
                    let events = match &a {
                        Some(a) if a.event_count > after => {
                            store
                                .desktop_events_after(&run_id, after, EVENTS_PAGE)
                                .await?
                        }
                        _ => vec![],
                    };
                    Ok::<_, automesh_store::StoreError>((a, events))
                };
                let (a, events) = match read.await {
                    Ok(r) => r,
                    Err(e) => {
                        observer.fail(status::of(&e, "desktop dispatch")).await;
                        return;
                    }
                };
                let Some(a) = a else {
                    if first {
                        let missing = Status::not_found("no desktop assignment for this run");
                        observer.fail(missing).await;
                    }
                    return;
                };
                first = false;
                seen = Some(a.progress());
                let more = events.len() as u32 == EVENTS_PAGE;
                // A live phase change comes before the events read with it
                // (the run is `running` before its engine's first event); a
                // finished status comes after them, and ends the stream.
                // Events mean the runner's engine is at work: when they were
                // read ahead of the acceptance that preceded them (the status
                // is read first), the run is running all the same.
                let mut status = a.status();
                let running = epb::ExecutionPhase::Running as i32;
                let seen_running = observer.last().is_some_and(|s| {
                    s.phase == running || s.phase == epb::ExecutionPhase::Finished as i32
                });
                if !events.is_empty() && !seen_running && status.phase != running {
                    status = epb::ExecutionStatus {
                        phase: running,
                        idle: false,
                        outcome: None,
                        unaccepted: false,
                    };
                }
                if status.phase != epb::ExecutionPhase::Finished as i32
                    && !observer.status(status).await
                {
                    return;
                }
                for e in events {
                    after = e.sequence;
                    let Ok(mut event) = pb::RunEvent::decode(e.body.as_slice()) else {
                        tracing::error!(run_id = %run_id, seq = e.sequence, "undecodable desktop event");
                        continue;
                    };
                    event.sequence = e.sequence;
                    event.run_id = run_id.clone();
                    if !observer.event(event).await {
                        return;
                    }
                }
                if more {
                    continue;
                }
                let status = a.status();
                let finished = status.phase == epb::ExecutionPhase::Finished as i32;
                if !observer.status(status).await || finished {
                    return;
                }
                // Woken by a change of this run on any replica, never idle
                // longer than the poll interval (the coordinator's bounds do
                // the rest).
                if !observer.wait(changed, dispatch.poll()).await {
                    return;
                }
            }
        }.instrument(span));
        Ok(stream)
    }

    async fn cancel(&self, run_id: &str, reason: &str) -> Result<epb::ExecutionStatus, Status> {
        let a = self.store.cancel_desktop_run(run_id, reason, Utc::now());
        let a = a.await.map_err(|e| status::of(&e, "desktop dispatch"))?;
        Ok(status_of(a.as_ref()))
    }

    async fn status(&self, run_id: &str) -> Result<epb::ExecutionStatus, Status> {
        Ok(status_of(self.assignment(run_id).await?.as_ref()))
    }
}
