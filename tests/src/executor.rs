//! A test executor: the real `automesh.executor.v1.ExecutorService` over
//! gRPC on loopback, with scripted behaviours, counting every submission so
//! tests can prove a prompt was submitted exactly once.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use automesh_executor::{Contract, Executor, ObserveStream};
use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_server::ExecutorServiceServer;
use automesh_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// What the executor does with a run.
#[derive(Debug, Clone)]
pub enum Behavior {
    /// Runs for `after`, emitting `events` assistant texts, then succeeds.
    Complete { after: Duration, events: usize },
    /// Accepts the run and works on it forever (until cancelled).
    Forever,
    /// Like `Forever`, and a cancellation never makes it idle.
    IgnoreCancel,
    /// Fails at once with this error code.
    Fail(&'static str),
    /// Reports a step's usage (`input` and `output` tokens) every `every`
    /// and never stops by itself: an engine that ignores the run's budget.
    Spend {
        input: i64,
        output: i64,
        every: Duration,
    },
}

#[derive(Debug, Default)]
struct Execution {
    spec: epb::RunSpec,
    events: Vec<pb::RunEvent>,
    phase: i32,
    idle: bool,
    outcome: Option<epb::Outcome>,
    cancelled: bool,
}

#[derive(Debug, Default)]
struct State {
    runs: HashMap<String, Execution>,
    /// Submissions per message id (StartRun calls that submitted).
    submissions: HashMap<String, usize>,
    /// Every StartRun call per run id, submitted or observed.
    start_calls: HashMap<String, usize>,
    /// When each run's first StartRun arrived.
    first_start: HashMap<String, chrono::DateTime<chrono::Utc>>,
}

/// The executor's shared state; clone freely.
#[derive(Debug, Clone)]
pub struct TestExecutor {
    state: Arc<Mutex<State>>,
    behavior: Arc<Mutex<Behavior>>,
    stop: CancellationToken,
}

impl TestExecutor {
    /// Serves on a loopback port; returns the executor and its address.
    pub async fn start(behavior: Behavior) -> anyhow::Result<(TestExecutor, String)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = format!("http://{}", listener.local_addr()?);
        let executor = TestExecutor {
            state: Arc::default(),
            behavior: Arc::new(Mutex::new(behavior)),
            stop: CancellationToken::new(),
        };
        let server = ExecutorServiceServer::new(Contract(executor.clone()));
        let stop = executor.stop.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(server)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop.cancelled_owned(),
                ),
        );
        Ok((executor, addr))
    }

    pub fn set_behavior(&self, behavior: Behavior) {
        *self.behavior.lock() = behavior;
    }

    /// How many times the message was submitted (not merely observed).
    pub fn submissions(&self, message_id: &str) -> usize {
        self.state
            .lock()
            .submissions
            .get(message_id)
            .copied()
            .unwrap_or(0)
    }

    /// Every message id submitted, with its count.
    pub fn all_submissions(&self) -> HashMap<String, usize> {
        self.state.lock().submissions.clone()
    }

    /// StartRun calls for a run, submitted or observed.
    pub fn start_calls(&self, run_id: &str) -> usize {
        self.state
            .lock()
            .start_calls
            .get(run_id)
            .copied()
            .unwrap_or(0)
    }

    /// When each run's first StartRun arrived.
    pub fn first_starts(&self) -> HashMap<String, chrono::DateTime<chrono::Utc>> {
        self.state.lock().first_start.clone()
    }

    /// Whether the run was asked to cancel.
    pub fn was_cancelled(&self, run_id: &str) -> bool {
        self.state
            .lock()
            .runs
            .get(run_id)
            .is_some_and(|e| e.cancelled)
    }

    fn execution_status(e: &Execution) -> epb::ExecutionStatus {
        epb::ExecutionStatus {
            phase: e.phase,
            idle: e.idle,
            outcome: e.outcome.clone(),
            unaccepted: false,
        }
    }

    fn event(run_id: &str, seq: i64, text: String) -> pb::RunEvent {
        pb::RunEvent {
            run_id: run_id.to_owned(),
            sequence: seq,
            event_id: format!("test-executor:{run_id}:{seq}"),
            create_time: None,
            payload: Some(pb::run_event::Payload::AssistantText(pb::AssistantText {
                text,
            })),
        }
    }

    /// The scripted execution of one run.
    async fn execute(self, run_id: String, behavior: Behavior) {
        let set = |f: &dyn Fn(&mut Execution)| {
            if let Some(e) = self.state.lock().runs.get_mut(&run_id) {
                f(e);
            }
        };
        set(&|e| e.phase = epb::ExecutionPhase::Running as i32);
        match behavior {
            Behavior::Complete { after, events } => {
                for i in 0..events {
                    tokio::time::sleep(after / (events as u32 + 1)).await;
                    if self
                        .state
                        .lock()
                        .runs
                        .get(&run_id)
                        .is_some_and(|e| e.cancelled)
                    {
                        break;
                    }
                    set(&|e| {
                        let seq = e.events.len() as i64 + 1;
                        e.events
                            .push(Self::event(&run_id, seq, format!("step {i}")));
                    });
                }
                tokio::time::sleep(after / (events as u32 + 1)).await;
                set(&|e| {
                    if e.outcome.is_none() {
                        e.phase = epb::ExecutionPhase::Finished as i32;
                        e.idle = true;
                        e.outcome = Some(epb::Outcome {
                            state: pb::RunState::Succeeded as i32,
                            engine: "test-executor".into(),
                            usage: Some(pb::Usage {
                                input_tokens: 10,
                                output_tokens: 5,
                                cost_micros: 42,
                            }),
                            ..Default::default()
                        });
                    }
                });
            }
            Behavior::Fail(code) => set(&|e| {
                e.phase = epb::ExecutionPhase::Finished as i32;
                e.idle = true;
                e.outcome = Some(epb::Outcome {
                    state: pb::RunState::Failed as i32,
                    error_code: code.into(),
                    error_message: format!("scripted failure {code}"),
                    engine: "test-executor".into(),
                    ..Default::default()
                });
            }),
            Behavior::Spend {
                input,
                output,
                every,
            } => loop {
                tokio::time::sleep(every).await;
                let mut state = self.state.lock();
                let Some(e) = state.runs.get_mut(&run_id) else {
                    return;
                };
                if e.cancelled {
                    return;
                }
                let seq = e.events.len() as i64 + 1;
                let mut event = Self::event(&run_id, seq, String::new());
                event.payload = Some(pb::run_event::Payload::Usage(pb::Usage {
                    input_tokens: input,
                    output_tokens: output,
                    cost_micros: 0,
                }));
                e.events.push(event);
            },
            Behavior::Forever | Behavior::IgnoreCancel => {}
        }
    }

    /// The events the executor reported for `run_id`.
    pub fn events(&self, run_id: &str) -> usize {
        self.state
            .lock()
            .runs
            .get(run_id)
            .map_or(0, |e| e.events.len())
    }
}

#[tonic::async_trait]
impl Executor for TestExecutor {
    async fn start(&self, spec: epb::RunSpec) -> Result<(bool, epb::ExecutionStatus), Status> {
        let behavior = self.behavior.lock().clone();
        let (submitted, status) = {
            let mut state = self.state.lock();
            *state.start_calls.entry(spec.run_id.clone()).or_default() += 1;
            state
                .first_start
                .entry(spec.run_id.clone())
                .or_insert_with(chrono::Utc::now);
            match state.runs.get(&spec.run_id) {
                Some(existing) => (false, Self::execution_status(existing)),
                None => {
                    *state
                        .submissions
                        .entry(spec.message_id.clone())
                        .or_default() += 1;
                    let e = Execution {
                        spec: spec.clone(),
                        phase: epb::ExecutionPhase::Admitted as i32,
                        ..Default::default()
                    };
                    let status = Self::execution_status(&e);
                    state.runs.insert(spec.run_id.clone(), e);
                    (true, status)
                }
            }
        };
        if submitted {
            tokio::spawn(self.clone().execute(spec.run_id.clone(), behavior));
        }
        Ok((submitted, status))
    }

    async fn observe(&self, run_id: String, after: i64) -> Result<ObserveStream, Status> {
        Ok(async_stream(self.state.clone(), run_id, after))
    }

    async fn cancel(&self, run_id: &str, _reason: &str) -> Result<epb::ExecutionStatus, Status> {
        let ignore = matches!(*self.behavior.lock(), Behavior::IgnoreCancel);
        let mut state = self.state.lock();
        let e = state
            .runs
            .get_mut(run_id)
            .ok_or_else(|| Status::not_found("run"))?;
        e.cancelled = true;
        if !ignore && e.outcome.is_none() {
            e.phase = epb::ExecutionPhase::Finished as i32;
            e.idle = true;
            e.outcome = Some(epb::Outcome {
                state: pb::RunState::Cancelled as i32,
                engine: "test-executor".into(),
                ..Default::default()
            });
        }
        Ok(Self::execution_status(e))
    }

    async fn status(&self, run_id: &str) -> Result<epb::ExecutionStatus, Status> {
        let state = self.state.lock();
        Ok(state
            .runs
            .get(run_id)
            .map(Self::execution_status)
            .unwrap_or_else(automesh_executor::unknown_status))
    }
}

/// Polls the execution and yields new events and status changes; ends after
/// the finished status.
fn async_stream(state: Arc<Mutex<State>>, run_id: String, after: i64) -> ObserveStream {
    let (observer, stream) = automesh_executor::observe();
    let read = move |after: i64| {
        let s = state.lock();
        let e = s.runs.get(&run_id)?;
        let events = e.events.iter().filter(|ev| ev.sequence > after);
        Some((events.cloned().collect(), TestExecutor::execution_status(e)))
    };
    let finished = |s: &epb::ExecutionStatus| s.phase == epb::ExecutionPhase::Finished as i32;
    tokio::spawn(async move {
        let never = tokio::sync::Notify::new();
        let poll = Duration::from_millis(20);
        observer.follow(after, &never, poll, read, finished).await;
    });
    stream
}

impl TestExecutor {
    /// The spec the run was started with (to check what reached the executor).
    pub fn spec_of(&self, run_id: &str) -> Option<epb::RunSpec> {
        self.state.lock().runs.get(run_id).map(|x| x.spec.clone())
    }
}
