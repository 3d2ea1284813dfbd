//! The worker agent (`automesh worker-agent`): the program inside a user's
//! cloud worker that hosts native threads (`automesh.agent.v1`).
//!
//! - A message is submitted to a thread idempotently by its message id
//!   (observe-or-submit): a repeated id returns the existing message, never
//!   a second execution.
//! - Threads run on the native engine with the run-scoped Connect MCP
//!   endpoint of the model's persisted `openwork-cloud` registration (kept in
//!   the worker's state directory) and the run's bearer token, which is used
//!   for that message only and never stored.
//! - Threads keep running when the coordinator that started them goes away;
//!   a later observer reattaches by thread id.
//! - Every call needs both credentials — the collaborator token
//!   (`authorization: Bearer …`) and the internal host credential
//!   (`x-automesh-host-credential`) — and is refused if either is missing.
//! - A message is journaled (`<state dir>/threads/`, synced) before its
//!   engine starts, so an agent started after a crash knows every message a
//!   previous one accepted: it reports those it finished, and those it did
//!   not as failed `runtime_interrupted` — never runs one twice.
//! - One agent per state directory (an exclusive lock on `agent.lock`; its
//!   pid in `agent.pid`), and none outlives its lifecycle without a bound:
//!   an agent that hears no call for its orphan bound exits, as it does on
//!   SIGTERM, SIGINT or `Shutdown`.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_edge::status;
use automesh_engine::adapter::{EngineRequest, NativeEngine};
use automesh_engine::wire::{finished_parts, run_forwarding};
use automesh_proto::agent::v1 as apb;
use automesh_proto::agent::v1::worker_agent_service_server::{
    WorkerAgentService, WorkerAgentServiceServer,
};
use automesh_proto::v1 as pb;
use automesh_rpc::{GrpcServer, ServerSettings};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

mod auth;
mod cli;
mod threads;
pub use auth::DualCredential;
pub use cli::{Args, LOCK_FILE, PID_FILE, StateDir};

/// The header carrying the internal host credential.
pub use automesh_rpc::auth::HOST_CREDENTIAL_HEADER as HOST_HEADER;
/// The registration name the mesh manages.
pub const REGISTRATION: &str = "openwork-cloud";

/// How the agent reaches its model provider and where it keeps state.
#[derive(Debug, Clone)]
pub struct Settings {
    pub provider: automesh_engine::ProviderFlags,
    pub state_dir: PathBuf,
    /// The agent exits after this long without an authenticated call
    /// (`None`: never; only for tests that hold the agent in-process).
    pub orphan_after: Option<Duration>,
}

use threads::{Journal, Threads, Track, interrupted, unknown};

/// The `WorkerAgentService`.
#[derive(Clone)]
pub struct Agent {
    settings: Settings,
    threads: Arc<Mutex<Threads>>,
    changed: Arc<Notify>,
    journal: Arc<Journal>,
    /// Unique to this process.
    id: Arc<str>,
    /// Cancelled to stop the agent (`Shutdown`, orphan bound, signal).
    stop: CancellationToken,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Agent {{ settings: {:?}, .. }}", self.settings)
    }
}

fn registrations_path(settings: &Settings) -> PathBuf {
    settings.state_dir.join("mcp-registrations.json")
}

impl Agent {
    /// An agent over the journal in `settings.state_dir`: every message a
    /// previous agent accepted is known, finished or interrupted.
    pub fn new(settings: Settings, stop: CancellationToken) -> anyhow::Result<Self> {
        let journal = Journal::open(&settings.state_dir.join("threads"))?;
        let mut threads = Threads::default();
        for record in journal.all() {
            let thread_id = record.note.clone();
            let message_id = record.run_id.clone();
            let thread = match record.finished {
                Some(t) => t,
                None => {
                    let t = interrupted(&thread_id, &message_id);
                    // Said in the run's trace, which the journal keeps.
                    let span = tracing::info_span!(
                        parent: None,
                        "automesh.agent.thread",
                        otel.name = "automesh.agent.interrupted",
                        %thread_id,
                        %message_id
                    );
                    let traceparent = Some(record.traceparent.as_str());
                    automesh_telemetry::propagation::continue_trace(&span, traceparent);
                    let _in_run = span.entered();
                    tracing::warn!(%thread_id, %message_id, "a message a previous agent accepted never finished; it is reported interrupted");
                    journal.finish(&message_id, &t)?;
                    t
                }
            };
            threads
                .by_message
                .insert(message_id.clone(), thread_id.clone());
            threads.by_id.insert(
                thread_id,
                Track {
                    message_id,
                    busy: false,
                    outcome: None,
                    events: vec![],
                    cancel: CancellationToken::new(),
                    journaled: Some(thread),
                },
            );
        }
        Ok(Self {
            settings,
            threads: Arc::new(Mutex::new(threads)),
            changed: Arc::default(),
            journal: Arc::new(journal),
            id: Arc::from(uuid::Uuid::new_v4().simple().to_string()),
            stop,
        })
    }

    fn registrations(&self) -> HashMap<String, apb::McpRegistration> {
        let Ok(text) = std::fs::read_to_string(registrations_path(&self.settings)) else {
            return HashMap::new();
        };
        serde_json::from_str::<HashMap<String, (String, String)>>(&text)
            .unwrap_or_default()
            .into_iter()
            .map(|(model, (name, url))| {
                let r = apb::McpRegistration {
                    name,
                    url,
                    model: model.clone(),
                };
                (model, r)
            })
            .collect()
    }

    fn thread(&self, thread_id: &str) -> apb::Thread {
        let known = self
            .threads
            .lock()
            .by_id
            .get(thread_id)
            .map(|t| t.thread(thread_id));
        known.unwrap_or_else(|| unknown(thread_id))
    }

    fn engine(&self, url: &str, token: &str) -> NativeEngine {
        NativeEngine::from_flags(&self.settings.provider, url, token)
    }
}

type ObserveStream = automesh_executor::Updates<apb::ObserveThreadResponse>;

#[tonic::async_trait]
impl WorkerAgentService for Agent {
    async fn submit_message(
        &self,
        request: Request<apb::SubmitMessageRequest>,
    ) -> Result<Response<apb::SubmitMessageResponse>, Status> {
        let req = request.into_inner();
        if req.thread_id.is_empty() || req.message_id.is_empty() {
            return Err(Status::invalid_argument(
                "thread_id and message_id are required",
            ));
        }
        {
            let threads = self.threads.lock();
            if let Some(thread_id) = threads.by_message.get(&req.message_id) {
                let thread = threads
                    .by_id
                    .get(thread_id)
                    .map(|t| t.thread(thread_id))
                    .unwrap_or_else(|| unknown(thread_id));
                return Ok(Response::new(apb::SubmitMessageResponse {
                    submitted: false,
                    thread: Some(thread),
                }));
            }
            if threads.by_id.get(&req.thread_id).is_some_and(|t| t.busy) {
                return Err(Status::failed_precondition(
                    "the thread is busy with another message",
                ));
            }
        }
        let Some(registration) = self.registrations().remove(&req.model) else {
            return Err(Status::failed_precondition(format!(
                "{}: no `{REGISTRATION}` MCP registration for model {}",
                ErrorCode::McpConfigMissing,
                req.model
            )));
        };
        // Stopping the agent stops its engines.
        let cancel = self.stop.child_token();
        // Checked again under the lock that inserts: one execution per id.
        let raced = {
            let mut threads = self.threads.lock();
            if threads.by_message.contains_key(&req.message_id) {
                true
            } else {
                // Journaled (synced) before anything runs: an agent started
                // after a crash knows this message and never runs it again.
                match self
                    .journal
                    .accept_with(&req.message_id, &req.thread_id, &req.traceparent)
                {
                    Ok(true) => {}
                    Ok(false) => {
                        return Err(status::internal(
                            "journaling the message",
                            &"the journal holds a message the agent does not",
                        ));
                    }
                    Err(error) => {
                        return Err(status::internal("journaling the message", &error));
                    }
                }
                threads
                    .by_message
                    .insert(req.message_id.clone(), req.thread_id.clone());
                threads.by_id.insert(
                    req.thread_id.clone(),
                    Track {
                        message_id: req.message_id.clone(),
                        busy: true,
                        outcome: None,
                        events: vec![],
                        cancel: cancel.clone(),
                        journaled: None,
                    },
                );
                false
            }
        };
        if raced {
            return Ok(Response::new(apb::SubmitMessageResponse {
                submitted: false,
                thread: Some(self.thread(&req.thread_id)),
            }));
        }
        tracing::info!(thread_id = %req.thread_id, message_id = %req.message_id, "message submitted");
        let engine = self.engine(&registration.url, &req.connect_token);
        let due = req.deadline_time.as_ref();
        let engine_request = EngineRequest {
            guidance: (!req.guidance.is_empty()).then(|| req.guidance.clone()),
            ..EngineRequest::due(&req.prompt, &req.model, &req.provider_model, due)
                .within(req.budget.as_ref())
        };
        let span = tracing::info_span!("automesh.agent.thread", thread_id = %req.thread_id);
        automesh_telemetry::propagation::continue_trace(&span, Some(req.traceparent.as_str()));
        let threads = self.threads.clone();
        let changed = self.changed.clone();
        let journal = self.journal.clone();
        let stop = self.stop.clone();
        let thread_id = req.thread_id.clone();
        let run_id = req.message_id.clone();
        tokio::spawn(
            async move {
                let append = |mut event: pb::RunEvent| {
                    if let Some(track) = threads.lock().by_id.get_mut(&thread_id) {
                        event.sequence = track.events.len() as i64 + 1;
                        track.events.push(event);
                    }
                    changed.notify_waiters();
                    std::future::ready(())
                };
                let outcome = run_forwarding(&engine, engine_request, &run_id, cancel, append);
                let outcome = outcome.await;
                if stop.is_cancelled() {
                    // Stopped with the agent, not finished: the journal keeps
                    // it unfinished, so the next agent reports it interrupted.
                    tracing::warn!("thread stopped with the agent");
                    return;
                }
                let finished = threads.lock().by_id.get_mut(&thread_id).map(|track| {
                    track.busy = false;
                    track.outcome = Some(finished_parts(&outcome));
                    track.thread(&thread_id)
                });
                if let Some(thread) = finished
                    && let Err(error) = journal.finish(&run_id, &thread)
                {
                    tracing::error!(%error, "cannot journal the thread's outcome");
                }
                changed.notify_waiters();
                tracing::info!("thread idle");
            }
            .instrument(span),
        );
        Ok(Response::new(apb::SubmitMessageResponse {
            submitted: true,
            thread: Some(self.thread(&req.thread_id)),
        }))
    }

    type ObserveThreadStream = ObserveStream;

    async fn observe_thread(
        &self,
        request: Request<apb::ObserveThreadRequest>,
    ) -> Result<Response<Self::ObserveThreadStream>, Status> {
        let req = request.into_inner();
        if self.thread(&req.thread_id).status == apb::ThreadStatus::Unknown as i32 {
            return Err(Status::not_found("unknown thread"));
        }
        let agent = self.clone();
        let (observer, stream) = automesh_executor::updates();
        let thread_id = req.thread_id;
        let read = move |after: i64| {
            let t = agent.threads.lock();
            let track = t.by_id.get(&thread_id)?;
            let events = track.events.iter().filter(|e| e.sequence > after);
            Some((events.cloned().collect(), track.thread(&thread_id)))
        };
        // An idle thread is the end of the stream.
        let idle = |t: &apb::Thread| t.status == apb::ThreadStatus::Idle as i32;
        let changed = self.changed.clone();
        tokio::spawn(async move {
            let poll = Duration::from_secs(1);
            observer
                .follow(req.after_sequence, &changed, poll, read, idle)
                .await;
        });
        Ok(Response::new(stream))
    }

    async fn cancel_thread(
        &self,
        request: Request<apb::CancelThreadRequest>,
    ) -> Result<Response<apb::CancelThreadResponse>, Status> {
        let req = request.into_inner();
        if let Some(track) = self.threads.lock().by_id.get(&req.thread_id) {
            track.cancel.cancel();
        }
        Ok(Response::new(apb::CancelThreadResponse {
            thread: Some(self.thread(&req.thread_id)),
        }))
    }

    async fn get_thread(
        &self,
        request: Request<apb::GetThreadRequest>,
    ) -> Result<Response<apb::GetThreadResponse>, Status> {
        Ok(Response::new(apb::GetThreadResponse {
            thread: Some(self.thread(&request.into_inner().thread_id)),
        }))
    }

    async fn get_mcp_registration(
        &self,
        request: Request<apb::GetMcpRegistrationRequest>,
    ) -> Result<Response<apb::GetMcpRegistrationResponse>, Status> {
        let model = request.into_inner().model;
        match self.registrations().remove(&model) {
            Some(r) => Ok(Response::new(apb::GetMcpRegistrationResponse {
                registration: Some(r),
            })),
            None => Err(Status::not_found("no registration for the model")),
        }
    }

    async fn put_mcp_registration(
        &self,
        request: Request<apb::PutMcpRegistrationRequest>,
    ) -> Result<Response<apb::PutMcpRegistrationResponse>, Status> {
        let r = request
            .into_inner()
            .registration
            .ok_or_else(|| Status::invalid_argument("registration is required"))?;
        if r.model.is_empty() || r.url.is_empty() || r.name != REGISTRATION {
            return Err(Status::invalid_argument(format!(
                "a registration needs a model, a url and the name `{REGISTRATION}`"
            )));
        }
        let mut all: HashMap<String, (String, String)> = self
            .registrations()
            .into_iter()
            .map(|(m, r)| (m, (r.name, r.url)))
            .collect();
        all.insert(r.model.clone(), (r.name.clone(), r.url.clone()));
        let path = registrations_path(&self.settings);
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(&all)
            .map_err(|e| status::internal("the registrations", &e))?;
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| status::internal("persisting the registration", &e))?;
        tracing::info!(model = %r.model, "MCP registration written");
        Ok(Response::new(apb::PutMcpRegistrationResponse {
            registration: Some(r),
        }))
    }

    async fn keep_alive(
        &self,
        _request: Request<apb::KeepAliveRequest>,
    ) -> Result<Response<apb::KeepAliveResponse>, Status> {
        let busy = self
            .threads
            .lock()
            .by_id
            .values()
            .filter(|t| t.busy)
            .count();
        Ok(Response::new(apb::KeepAliveResponse {
            agent_id: self.id.to_string(),
            pid: i64::from(std::process::id()),
            busy_threads: i32::try_from(busy).unwrap_or(i32::MAX),
        }))
    }

    async fn shutdown(
        &self,
        request: Request<apb::ShutdownRequest>,
    ) -> Result<Response<apb::ShutdownResponse>, Status> {
        let reason = request.into_inner().reason;
        tracing::info!(%reason, "shutdown requested by the lifecycle");
        let stop = self.stop.clone();
        // After this answer has gone out.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            stop.cancel();
        });
        Ok(Response::new(apb::ShutdownResponse {}))
    }
}

/// Serves the agent on `listener` until `shutdown`, a `Shutdown` call, or
/// (with `settings.orphan_after`) a silence that long from its lifecycle.
pub async fn serve(
    settings: Settings,
    credential: DualCredential,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&settings.state_dir)?;
    let orphan_after = settings.orphan_after;
    let agent = Agent::new(settings, shutdown.child_token())?;
    let stop = agent.stop.clone();
    if let Some(bound) = orphan_after {
        let contact = credential.contact.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            loop {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1).min(bound)) => {}
                    () = stop.cancelled() => return,
                }
                let silent = contact.silent_for(started);
                if silent >= bound {
                    tracing::warn!(
                        silent_ms = silent.as_millis() as u64,
                        "no call from the lifecycle within the orphan bound; the agent exits"
                    );
                    stop.cancel();
                    return;
                }
            }
        });
    }
    let mut server = GrpcServer::new(ServerSettings::default())?;
    server.add_service(WorkerAgentServiceServer::with_interceptor(
        agent, credential,
    ));
    server
        .serve(listener, stop, Box::new(|| Box::pin(async { true })))
        .await?;
    tracing::info!("worker agent stopped");
    Ok(())
}
