//! The desktop executor: the coordinator's `ExecutorService` for desktop
//! runs, served by the gateway replica that holds the owner's runner stream.
//!
//! `StartRun` hands the run to a connected runner of its owner as an
//! `Assignment` (at least once; runners deduplicate by run id) — or answers
//! UNAVAILABLE when none is connected, and the coordinator keeps trying until
//! the deadline (`runner_offline`). The runner's acceptance, events, result
//! and idle reports come back on its stream and are served to `ObserveRun`.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_server::ExecutorService;
use automesh_proto::runner::v1 as rpb;
use automesh_proto::v1 as pb;
use tokio::sync::Notify;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::stream::Sessions;

/// Bound on handing one message to a runner's stream.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// What this replica knows of one desktop run.
#[derive(Debug, Clone)]
struct Track {
    spec: epb::RunSpec,
    runner_id: String,
    phase: epb::ExecutionPhase,
    idle: bool,
    outcome: Option<epb::Outcome>,
    events: Vec<pb::RunEvent>,
    event_ids: HashSet<String>,
}

impl Track {
    fn status(&self) -> epb::ExecutionStatus {
        epb::ExecutionStatus {
            phase: self.phase as i32,
            idle: self.idle,
            outcome: self.outcome.clone(),
        }
    }
}

fn unknown() -> epb::ExecutionStatus {
    epb::ExecutionStatus {
        phase: epb::ExecutionPhase::Unknown as i32,
        idle: true,
        outcome: None,
    }
}

/// The desktop runs this replica dispatched, and what their runners said.
#[derive(Debug, Default)]
pub struct Dispatch {
    runs: Mutex<HashMap<String, Track>>,
    changed: Notify,
}

impl Dispatch {
    fn update(&self, run_id: &str, runner_id: &str, f: impl FnOnce(&mut Track)) {
        if let Ok(mut runs) = self.runs.lock()
            && let Some(t) = runs.get_mut(run_id)
            && t.runner_id == runner_id
        {
            f(t);
        }
        self.changed.notify_waiters();
    }

    /// A message a runner sent about one of its runs.
    pub fn on_runner_message(&self, runner_id: &str, message: &rpb::connect_request::Message) {
        use rpb::connect_request::Message;
        match message {
            Message::AssignmentAccepted(a) => self.update(&a.run_id, runner_id, |t| {
                if t.phase == epb::ExecutionPhase::Admitted {
                    t.phase = epb::ExecutionPhase::Running;
                }
            }),
            Message::RunEvents(batch) => self.update(&batch.run_id, runner_id, |t| {
                for e in &batch.events {
                    if e.event_id.is_empty() || !t.event_ids.insert(e.event_id.clone()) {
                        continue;
                    }
                    let mut e = e.clone();
                    e.sequence = t.events.len() as i64 + 1;
                    e.run_id = t.spec.run_id.clone();
                    t.events.push(e);
                }
            }),
            Message::RunFinished(f) => self.update(&f.run_id, runner_id, |t| {
                t.phase = epb::ExecutionPhase::Finished;
                t.idle = true;
                t.outcome = Some(epb::Outcome {
                    state: f.outcome,
                    error_code: f.error_code.clone(),
                    error_message: f.error_message.clone(),
                    engine: f.engine.clone(),
                    usage: f.usage,
                    ..Default::default()
                });
            }),
            Message::IdleObserved(i) => self.update(&i.run_id, runner_id, |t| t.idle = true),
            Message::Hello(_) | Message::Heartbeat(_) => {}
        }
    }

    /// Runs this replica dispatched to `runner_id` that have not finished.
    pub fn unfinished_of(&self, runner_id: &str) -> Vec<epb::RunSpec> {
        self.runs.lock().map_or_else(
            |_| vec![],
            |runs| {
                runs.values()
                    .filter(|t| {
                        t.runner_id == runner_id && t.phase != epb::ExecutionPhase::Finished
                    })
                    .map(|t| t.spec.clone())
                    .collect()
            },
        )
    }

    /// Whether this replica knows the run.
    pub fn knows(&self, run_id: &str) -> bool {
        self.runs.lock().is_ok_and(|r| r.contains_key(run_id))
    }
}

/// The assignment message for a run.
pub fn assignment(spec: &epb::RunSpec) -> rpb::ConnectResponse {
    rpb::ConnectResponse {
        message: Some(rpb::connect_response::Message::Assignment(
            rpb::Assignment {
                run_id: spec.run_id.clone(),
                automation_id: spec.automation_id.clone(),
                prompt: spec.prompt.clone(),
                model: spec.model.clone(),
                deadline_time: spec.deadline_time,
                traceparent: spec.traceparent.clone(),
            },
        )),
    }
}

/// The `ExecutorService` of desktop runs.
#[derive(Debug, Clone)]
pub struct DesktopExecutor {
    sessions: Arc<Sessions>,
    dispatch: Arc<Dispatch>,
}

impl DesktopExecutor {
    pub fn new(sessions: Arc<Sessions>, dispatch: Arc<Dispatch>) -> Self {
        Self { sessions, dispatch }
    }

    fn status(&self, run_id: &str) -> epb::ExecutionStatus {
        self.dispatch
            .runs
            .lock()
            .ok()
            .and_then(|r| r.get(run_id).map(Track::status))
            .unwrap_or_else(unknown)
    }
}

type ObserveStream = Pin<Box<dyn Stream<Item = Result<epb::ObserveRunResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExecutorService for DesktopExecutor {
    async fn start_run(
        &self,
        request: Request<epb::StartRunRequest>,
    ) -> Result<Response<epb::StartRunResponse>, Status> {
        let spec = request
            .into_inner()
            .run
            .ok_or_else(|| Status::invalid_argument("run is required"))?;
        if spec.run_id.is_empty() || spec.message_id.is_empty() {
            return Err(Status::invalid_argument(
                "run_id and message_id are required",
            ));
        }
        if self.dispatch.knows(&spec.run_id) {
            return Ok(Response::new(epb::StartRunResponse {
                submitted: false,
                status: Some(self.status(&spec.run_id)),
            }));
        }
        let (runner_id, tx) = self
            .sessions
            .of_owner(&spec.organization_id, &spec.owner_id)
            .ok_or_else(|| {
                Status::unavailable("runner_offline: no runner of the owner is connected")
            })?;
        let track = Track {
            spec: spec.clone(),
            runner_id: runner_id.clone(),
            phase: epb::ExecutionPhase::Admitted,
            idle: false,
            outcome: None,
            events: vec![],
            event_ids: HashSet::new(),
        };
        let status = track.status();
        if let Ok(mut runs) = self.dispatch.runs.lock() {
            runs.insert(spec.run_id.clone(), track);
        }
        match tokio::time::timeout(SEND_TIMEOUT, tx.send(Ok(assignment(&spec)))).await {
            Ok(Ok(())) => {
                tracing::info!(run_id = %spec.run_id, runner_id = %runner_id, "run assigned to a runner");
                Ok(Response::new(epb::StartRunResponse {
                    submitted: true,
                    status: Some(status),
                }))
            }
            _ => {
                if let Ok(mut runs) = self.dispatch.runs.lock() {
                    runs.remove(&spec.run_id);
                }
                Err(Status::unavailable(
                    "runner_offline: the runner's stream did not take the assignment",
                ))
            }
        }
    }

    type ObserveRunStream = ObserveStream;

    async fn observe_run(
        &self,
        request: Request<epb::ObserveRunRequest>,
    ) -> Result<Response<Self::ObserveRunStream>, Status> {
        let req = request.into_inner();
        if !self.dispatch.knows(&req.run_id) {
            return Err(Status::not_found("this replica does not know the run"));
        }
        let dispatch = self.dispatch.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let mut after = req.after_sequence;
            let mut last: Option<epb::ExecutionStatus> = None;
            loop {
                let changed = dispatch.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                let snapshot = dispatch.runs.lock().ok().and_then(|r| {
                    r.get(&req.run_id).map(|t| {
                        let events: Vec<pb::RunEvent> = t
                            .events
                            .iter()
                            .filter(|e| e.sequence > after)
                            .cloned()
                            .collect();
                        (events, t.status())
                    })
                });
                let Some((events, status)) = snapshot else {
                    return;
                };
                for e in events {
                    after = e.sequence;
                    let update = epb::observe_run_response::Update::Event(e);
                    if tx
                        .send(Ok(epb::ObserveRunResponse {
                            update: Some(update),
                        }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                if last.as_ref() != Some(&status) {
                    last = Some(status.clone());
                    let finished = status.phase == epb::ExecutionPhase::Finished as i32;
                    let update = epb::observe_run_response::Update::Status(status);
                    if tx
                        .send(Ok(epb::ObserveRunResponse {
                            update: Some(update),
                        }))
                        .await
                        .is_err()
                        || finished
                    {
                        return;
                    }
                }
                // Woken by the runner's next message, and never idle longer
                // than a second (the coordinator's bounds do the rest).
                tokio::select! {
                    () = changed => {}
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn cancel_run(
        &self,
        request: Request<epb::CancelRunRequest>,
    ) -> Result<Response<epb::CancelRunResponse>, Status> {
        let req = request.into_inner();
        let runner = self
            .dispatch
            .runs
            .lock()
            .ok()
            .and_then(|r| r.get(&req.run_id).map(|t| t.runner_id.clone()));
        if let Some(runner_id) = runner
            && let Some(tx) = self.sessions.sender(&runner_id)
        {
            let cancel = rpb::ConnectResponse {
                message: Some(rpb::connect_response::Message::CancelAssignment(
                    rpb::CancelAssignment {
                        run_id: req.run_id.clone(),
                        reason: req.reason.clone(),
                    },
                )),
            };
            if tokio::time::timeout(SEND_TIMEOUT, tx.send(Ok(cancel)))
                .await
                .is_err()
            {
                tracing::warn!(run_id = %req.run_id, "the runner did not take the cancellation in time");
            }
        }
        Ok(Response::new(epb::CancelRunResponse {
            status: Some(self.status(&req.run_id)),
        }))
    }

    async fn get_run_status(
        &self,
        request: Request<epb::GetRunStatusRequest>,
    ) -> Result<Response<epb::GetRunStatusResponse>, Status> {
        Ok(Response::new(epb::GetRunStatusResponse {
            status: Some(self.status(&request.into_inner().run_id)),
        }))
    }
}
