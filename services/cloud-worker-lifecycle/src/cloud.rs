//! The cloud executor: the coordinator's `ExecutorService` for cloud runs
//! (SPEC §5), and the idle stop of workers.
//!
//! `StartRun` reserves and persists the run's worker, workspace, thread and
//! message identity (`cloud_dispatch`) and returns; a driver task (one per
//! run, held by a renewable lease on the row, so a replica that dies hands
//! it over) then wakes the owner's worker (concurrent wakes coalesce into
//! one start; readiness capped, terminal `readiness_timeout`), probes and
//! repairs the worker's `openwork-cloud` MCP registration for the model
//! (`mcp_config_missing` without a Connect configuration: the provider is
//! never called), submits the message (observe-or-submit by message id),
//! and watches the thread — keeping the worker out of idle stop — until it
//! is idle, recording the outcome with the wake and admission timings.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_proto::agent::v1 as apb;
use automesh_proto::agent::v1::worker_agent_service_client::WorkerAgentServiceClient;
use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_server::ExecutorService;
use automesh_proto::v1 as pb;
use automesh_rpc::auth::Secret;
use automesh_rpc::{InternalCredential, status};
use automesh_store::Store;
use automesh_store::cloud::{CloudDispatch, Reservation, Wake};
use chrono::Utc;
use prost::Message as _;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::driver::{DriverError, WorkerDriver, WorkerLaunch};

/// The Connect (MCP) endpoint cloud runs use for the user's tools, and the
/// bearer token runs present to it.
#[derive(Debug, Clone)]
pub struct ConnectSettings {
    pub url: String,
    pub token: Secret,
}

/// Bounds and periods of the cloud path.
#[derive(Debug, Clone)]
pub struct CloudSettings {
    /// Cap on a worker becoming ready (terminal `readiness_timeout`).
    pub readiness_cap: Duration,
    /// Workers unused this long are stopped.
    pub idle_after: Duration,
    /// How often idle workers are looked for.
    pub idle_check: Duration,
    /// The Connect configuration; without it cloud runs end
    /// `mcp_config_missing`.
    pub connect: Option<ConnectSettings>,
}

impl Default for CloudSettings {
    fn default() -> Self {
        Self {
            readiness_cap: Duration::from_secs(120),
            idle_after: Duration::from_secs(900),
            idle_check: Duration::from_secs(30),
            connect: None,
        }
    }
}

/// What a worker's agent requires on every call.
#[derive(Clone)]
struct AgentAuth {
    bearer: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
    host: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
}

impl Interceptor for AgentAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut()
            .insert("authorization", self.bearer.clone());
        req.metadata_mut().insert(
            automesh_rpc::auth::HOST_CREDENTIAL_HEADER,
            self.host.clone(),
        );
        Ok(req)
    }
}

type Agent = WorkerAgentServiceClient<InterceptedService<Channel, AgentAuth>>;

/// How long a driver holds a run before another replica may take it over.
const DRIVE_LEASE: Duration = Duration::from_secs(15);
/// How often a running thread is looked at (and its worker kept busy).
const WATCH: Duration = Duration::from_millis(500);
/// How long a worker may stop answering before its run fails.
const AGENT_SILENCE: Duration = Duration::from_secs(15);

/// The cloud executor and idle stop.
#[derive(Debug, Clone)]
pub struct Cloud {
    store: Store,
    driver: Arc<dyn WorkerDriver>,
    settings: CloudSettings,
    credential: InternalCredential,
    replica: String,
    driving: Arc<Mutex<HashSet<String>>>,
}

fn outcome(
    d: &CloudDispatch,
    state: pb::RunState,
    code: Option<ErrorCode>,
    message: impl Into<String>,
    usage: Option<pb::Usage>,
) -> epb::Outcome {
    epb::Outcome {
        state: state as i32,
        error_code: code.map(|c| c.as_str().to_owned()).unwrap_or_default(),
        error_message: message.into(),
        engine: "native-v1".into(),
        usage,
        wake_micros: d.wake_micros,
        admission_micros: d.admission_micros,
        native_thread: Some(pb::NativeThread {
            worker_id: d.worker_id.clone(),
            workspace_id: d.workspace_id.clone(),
            thread_id: d.thread_id.clone(),
            message_id: d.message_id.clone(),
        }),
    }
}

fn status_of(d: Option<&CloudDispatch>) -> epb::ExecutionStatus {
    let Some(d) = d else {
        return epb::ExecutionStatus {
            phase: epb::ExecutionPhase::Unknown as i32,
            idle: true,
            outcome: None,
        };
    };
    let (phase, idle) = match d.phase.as_str() {
        "running" => (epb::ExecutionPhase::Running, false),
        "finished" => (epb::ExecutionPhase::Finished, true),
        // Not submitted: nothing runs anywhere.
        _ => (epb::ExecutionPhase::Admitted, d.cancel_requested),
    };
    epb::ExecutionStatus {
        phase: phase as i32,
        idle,
        outcome: d
            .outcome
            .as_deref()
            .and_then(|b| epb::Outcome::decode(b).ok()),
    }
}

fn guidance() -> String {
    "You run headless in the user's cloud worker, started by a schedule: nobody is watching and \
     nobody can answer questions. The user's connected services are available through the \
     openwork-cloud tools (search_capabilities, execute_capability)."
        .into()
}

impl Cloud {
    pub fn new(
        store: Store,
        driver: Arc<dyn WorkerDriver>,
        settings: CloudSettings,
        credential: InternalCredential,
    ) -> Self {
        Self {
            store,
            driver,
            settings,
            credential,
            replica: format!("lifecycle-{}", uuid::Uuid::new_v4().simple()),
            driving: Arc::default(),
        }
    }

    fn launch(&self, worker_id: &str) -> WorkerLaunch {
        WorkerLaunch {
            worker_id: worker_id.to_owned(),
            collaborator_token: self.credential.derive(&format!("collaborator:{worker_id}")),
            host_credential: self.credential.derive("worker-host"),
        }
    }

    fn agent(&self, endpoint: &str, worker_id: &str) -> Result<Agent, Status> {
        let launch = self.launch(worker_id);
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
            .map_err(|_| Status::internal("bad worker endpoint"))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(15))
            .connect_lazy();
        let auth = AgentAuth {
            bearer: format!("Bearer {}", launch.collaborator_token)
                .parse()
                .map_err(|_| Status::internal("token"))?,
            host: launch
                .host_credential
                .parse()
                .map_err(|_| Status::internal("host credential"))?,
        };
        Ok(WorkerAgentServiceClient::with_interceptor(channel, auth))
    }

    /// Starts this replica's driver of a run unless one is running here.
    fn drive(&self, run_id: &str) {
        if let Ok(mut d) = self.driving.lock()
            && !d.insert(run_id.to_owned())
        {
            return;
        }
        let cloud = self.clone();
        let run_id = run_id.to_owned();
        tokio::spawn(async move {
            if let Err(error) = cloud.drive_run(&run_id).await {
                tracing::warn!(run_id = %run_id, %error, "cloud run driver stopped; another call will resume it");
            }
            if let Ok(mut d) = cloud.driving.lock() {
                d.remove(&run_id);
            }
        });
    }

    async fn hold(&self, run_id: &str) -> Result<bool, automesh_store::StoreError> {
        let now = Utc::now();
        self.store
            .take_cloud_drive(
                run_id,
                &self.replica,
                now + chrono::Duration::from_std(DRIVE_LEASE).unwrap_or_default(),
                now,
            )
            .await
    }

    async fn fail(
        &self,
        d: &CloudDispatch,
        code: ErrorCode,
        message: String,
    ) -> Result<(), automesh_store::StoreError> {
        tracing::warn!(run_id = %d.run_id, %code, %message, "cloud run failed before submission");
        let o = outcome(d, pb::RunState::Failed, Some(code), message, None);
        self.store
            .finish_cloud_run(&d.run_id, &o.encode_to_vec(), Utc::now())
            .await?;
        Ok(())
    }

    async fn drive_run(&self, run_id: &str) -> Result<(), automesh_store::StoreError> {
        if !self.hold(run_id).await? {
            return Ok(());
        }
        let Some(d) = self.store.cloud_run(run_id).await? else {
            return Ok(());
        };
        let Ok(spec) = epb::RunSpec::decode(d.spec.as_slice()) else {
            return self
                .fail(&d, ErrorCode::Internal, "undecodable run spec".into())
                .await;
        };
        let deadline = spec
            .deadline_time
            .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
            .unwrap_or_else(|| Utc::now() + chrono::Duration::minutes(30));
        if d.phase == "waking" || d.phase == "admitted" {
            if d.cancel_requested {
                let o = outcome(
                    &d,
                    pb::RunState::Cancelled,
                    None,
                    "cancelled before submission",
                    None,
                );
                self.store
                    .finish_cloud_run(run_id, &o.encode_to_vec(), Utc::now())
                    .await?;
                return Ok(());
            }
            let woke = Utc::now();
            let endpoint = match self.wake(&d.worker_id, deadline).await {
                Ok(e) => e,
                Err(e) => return self.fail(&d, e.code, e.message).await,
            };
            let wake_micros = (Utc::now() - woke).num_microseconds().unwrap_or(0);
            self.store
                .set_cloud_phase(run_id, "admitted", wake_micros, 0, Utc::now())
                .await?;
            let admitted = Utc::now();
            let Some(connect) = self.settings.connect.clone() else {
                let d = self.store.cloud_run(run_id).await?.unwrap_or(d);
                return self
                    .fail(&d, ErrorCode::McpConfigMissing, format!(
                        "no Connect configuration for model {}: the run would lack the user's tools",
                        spec.model
                    ))
                    .await;
            };
            let Ok(mut agent) = self.agent(&endpoint, &d.worker_id) else {
                return self
                    .fail(&d, ErrorCode::RuntimeFailed, "bad worker endpoint".into())
                    .await;
            };
            // Probe the persisted registration; repair it when it drifted.
            let current = agent
                .get_mcp_registration(apb::GetMcpRegistrationRequest {
                    model: spec.model.clone(),
                })
                .await;
            let drifted = match &current {
                Ok(r) => r
                    .get_ref()
                    .registration
                    .as_ref()
                    .is_none_or(|r| r.url != connect.url || r.name != "openwork-cloud"),
                Err(s) if s.code() == tonic::Code::NotFound => true,
                Err(s) => {
                    return self
                        .fail(
                            &d,
                            ErrorCode::RuntimeFailed,
                            format!("the worker did not answer: {}", s.message()),
                        )
                        .await;
                }
            };
            if drifted {
                tracing::warn!(run_id, worker_id = %d.worker_id, model = %spec.model, "MCP registration missing or drifted; repairing");
                if let Err(s) = agent
                    .put_mcp_registration(apb::PutMcpRegistrationRequest {
                        registration: Some(apb::McpRegistration {
                            name: "openwork-cloud".into(),
                            url: connect.url.clone(),
                            model: spec.model.clone(),
                        }),
                    })
                    .await
                {
                    return self
                        .fail(
                            &d,
                            ErrorCode::McpConfigMissing,
                            format!(
                                "the MCP registration could not be repaired: {}",
                                s.message()
                            ),
                        )
                        .await;
                }
            }
            if self
                .store
                .cloud_run(run_id)
                .await?
                .is_some_and(|d| d.cancel_requested)
            {
                let o = outcome(
                    &d,
                    pb::RunState::Cancelled,
                    None,
                    "cancelled before submission",
                    None,
                );
                self.store
                    .finish_cloud_run(run_id, &o.encode_to_vec(), Utc::now())
                    .await?;
                return Ok(());
            }
            let submitted = agent
                .submit_message(apb::SubmitMessageRequest {
                    workspace_id: d.workspace_id.clone(),
                    thread_id: d.thread_id.clone(),
                    message_id: d.message_id.clone(),
                    prompt: spec.prompt.clone(),
                    model: spec.model.clone(),
                    deadline_time: spec.deadline_time,
                    traceparent: spec.traceparent.clone(),
                    connect_token: connect.token.expose().to_owned(),
                    guidance: guidance(),
                })
                .await;
            if let Err(s) = submitted {
                return self
                    .fail(
                        &d,
                        ErrorCode::RuntimeFailed,
                        format!("the worker refused the message: {}", s.message()),
                    )
                    .await;
            }
            let admission_micros = (Utc::now() - admitted).num_microseconds().unwrap_or(0);
            self.store
                .set_cloud_phase(run_id, "running", wake_micros, admission_micros, Utc::now())
                .await?;
            tracing::info!(run_id, worker_id = %d.worker_id, "message submitted to the worker");
        }
        self.watch(run_id).await
    }

    /// Wakes the worker (or waits for whoever is waking it), bounded by the
    /// readiness cap and the deadline.
    async fn wake(
        &self,
        worker_id: &str,
        deadline: chrono::DateTime<Utc>,
    ) -> Result<String, DriverError> {
        let cap = Utc::now()
            + chrono::Duration::from_std(self.settings.readiness_cap).unwrap_or_default();
        let give_up = cap.min(deadline);
        let stale = chrono::Duration::from_std(self.settings.readiness_cap).unwrap_or_default();
        let mut backoff = Duration::from_millis(50);
        loop {
            let now = Utc::now();
            let _ = self.store.touch_worker(worker_id, now).await;
            let wake = self
                .store
                .wake_worker(worker_id, stale, now)
                .await
                .map_err(|e| DriverError::new(ErrorCode::RuntimeFailed, e.to_string()))?;
            match wake {
                Wake::Ready(endpoint) => return Ok(endpoint),
                Wake::Start => {
                    let within = (give_up - Utc::now()).to_std().unwrap_or_default();
                    tracing::info!(worker_id, "starting the worker");
                    let started = self.driver.start(&self.launch(worker_id), within).await;
                    let endpoint = match started {
                        Ok(e) => e,
                        Err(e) => {
                            let _ = self.store.worker_failed(worker_id, Utc::now()).await;
                            return Err(e);
                        }
                    };
                    if let Err(e) = wait_serving(&endpoint, give_up).await {
                        let _ = self.driver.stop(worker_id).await;
                        let _ = self.store.worker_failed(worker_id, Utc::now()).await;
                        return Err(e);
                    }
                    let _ = self
                        .store
                        .worker_ready(worker_id, &endpoint, Utc::now())
                        .await;
                    return Ok(endpoint);
                }
                Wake::Starting | Wake::Stopping => {}
            }
            if Utc::now() >= give_up {
                return Err(DriverError::new(
                    ErrorCode::ReadinessTimeout,
                    format!(
                        "the worker was not ready within {:?}",
                        self.settings.readiness_cap
                    ),
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Watches a submitted thread until it is idle, keeping its worker busy
    /// and forwarding a cancellation.
    async fn watch(&self, run_id: &str) -> Result<(), automesh_store::StoreError> {
        let mut cancel_sent = false;
        let mut silent_since: Option<tokio::time::Instant> = None;
        // One client per endpoint, not per look; the lease is renewed and the
        // worker touched every third of the lease, not on every look.
        let mut agent: Option<(String, Agent)> = None;
        let mut renewed: Option<tokio::time::Instant> = None;
        loop {
            let renew = renewed.is_none_or(|at| at.elapsed() >= DRIVE_LEASE / 3);
            if renew {
                if !self.hold(run_id).await? {
                    return Ok(());
                }
                renewed = Some(tokio::time::Instant::now());
            }
            let Some(d) = self.store.cloud_run(run_id).await? else {
                return Ok(());
            };
            if d.phase == "finished" {
                return Ok(());
            }
            if renew {
                let _ = self.store.touch_worker(&d.worker_id, Utc::now()).await;
            }
            let endpoint = self.store.worker_endpoint(&d.worker_id).await?;
            if agent.as_ref().map(|(e, _)| Some(e)) != Some(endpoint.as_ref()) {
                agent = endpoint.and_then(|e| self.agent(&e, &d.worker_id).ok().map(|a| (e, a)));
            }
            let thread = match agent.as_mut() {
                Some((_, agent)) => {
                    if d.cancel_requested && !cancel_sent {
                        cancel_sent = agent
                            .cancel_thread(apb::CancelThreadRequest {
                                thread_id: d.thread_id.clone(),
                            })
                            .await
                            .is_ok();
                    }
                    agent
                        .get_thread(apb::GetThreadRequest {
                            thread_id: d.thread_id.clone(),
                        })
                        .await
                        .ok()
                        .and_then(|r| r.into_inner().thread)
                }
                None => None,
            };
            match thread {
                Some(t) if t.status == apb::ThreadStatus::Idle as i32 => {
                    let state = pb::RunState::try_from(t.outcome).unwrap_or(pb::RunState::Failed);
                    let code = t.error_code.parse::<ErrorCode>().ok();
                    let o = outcome(&d, state, code, t.error_message.clone(), t.usage);
                    self.store
                        .finish_cloud_run(run_id, &o.encode_to_vec(), Utc::now())
                        .await?;
                    let _ = self.store.touch_worker(&d.worker_id, Utc::now()).await;
                    tracing::info!(run_id, "cloud run finished on its worker");
                    return Ok(());
                }
                Some(t) if t.status == apb::ThreadStatus::Busy as i32 => silent_since = None,
                _ => {
                    // Unknown thread or no answer: the worker lost it.
                    let since = *silent_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() >= AGENT_SILENCE {
                        let _ = self.store.worker_failed(&d.worker_id, Utc::now()).await;
                        return self
                            .fail(
                                &d,
                                ErrorCode::RuntimeFailed,
                                "the worker stopped answering for the run's thread".into(),
                            )
                            .await;
                    }
                }
            }
            tokio::time::sleep(WATCH).await;
        }
    }

    /// Stops workers idle past the period, until shutdown. A worker with a
    /// live run is never stopped (see `Store::begin_worker_stop`).
    pub async fn idle_stop(self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(self.settings.idle_check) => {}
                () = shutdown.cancelled() => return,
            }
            if let Err(error) = self.idle_pass().await {
                tracing::warn!(%error, "idle stop pass failed");
            }
        }
    }

    /// One idle-stop pass; returns the workers it stopped.
    pub async fn idle_pass(&self) -> Result<Vec<String>, automesh_store::StoreError> {
        let now = Utc::now();
        let cutoff = now - chrono::Duration::from_std(self.settings.idle_after).unwrap_or_default();
        let mut stopped = vec![];
        for worker_id in self.store.idle_worker_candidates(cutoff).await? {
            if !self
                .store
                .begin_worker_stop(&worker_id, cutoff, Utc::now())
                .await?
            {
                continue;
            }
            tracing::info!(worker_id, "stopping an idle worker");
            if let Err(e) = self.driver.stop(&worker_id).await {
                tracing::warn!(worker_id, error = %e, "stopping the worker failed");
                let _ = self.store.worker_failed(&worker_id, Utc::now()).await;
                continue;
            }
            self.store.worker_stopped(&worker_id, Utc::now()).await?;
            stopped.push(worker_id);
        }
        Ok(stopped)
    }
}

/// Waits until the agent's gRPC health answers SERVING, bounded.
async fn wait_serving(endpoint: &str, give_up: chrono::DateTime<Utc>) -> Result<(), DriverError> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .map_err(|_| DriverError::new(ErrorCode::RuntimeFailed, "bad worker endpoint"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect_lazy();
    let mut client = HealthClient::new(channel);
    let mut backoff = Duration::from_millis(25);
    loop {
        if let Ok(r) = client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            && r.get_ref().status == ServingStatus::Serving as i32
        {
            return Ok(());
        }
        if Utc::now() >= give_up {
            return Err(DriverError::new(
                ErrorCode::ReadinessTimeout,
                "the worker agent did not report SERVING before the readiness cap",
            ));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

type ObserveStream = Pin<Box<dyn Stream<Item = Result<epb::ObserveRunResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExecutorService for Cloud {
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
        let store_err = |e: automesh_store::StoreError| status::unavailable("cloud dispatch", &e);
        if let Some(existing) = self
            .store
            .cloud_run(&spec.run_id)
            .await
            .map_err(store_err)?
        {
            if existing.phase != "finished" {
                self.drive(&spec.run_id);
            }
            return Ok(Response::new(epb::StartRunResponse {
                submitted: false,
                status: Some(status_of(Some(&existing))),
            }));
        }
        let owner =
            automesh_domain::Principal::new(spec.organization_id.clone(), spec.owner_id.clone());
        let Some(worker) = self.store.get_worker(&owner).await.map_err(store_err)? else {
            // A durable failure of the user's setup: needs attention.
            return Ok(Response::new(epb::StartRunResponse {
                submitted: false,
                status: Some(epb::ExecutionStatus {
                    phase: epb::ExecutionPhase::Finished as i32,
                    idle: true,
                    outcome: Some(epb::Outcome {
                        state: pb::RunState::Failed as i32,
                        error_code: ErrorCode::RuntimeMissing.as_str().into(),
                        error_message: "the owner has no cloud worker".into(),
                        ..Default::default()
                    }),
                }),
            }));
        };
        let thread_id = format!("thr-{}", spec.run_id);
        let workspace_id = format!("ws-{}", worker.id);
        let reserved = self
            .store
            .reserve_cloud_run(
                &Reservation {
                    run_id: &spec.run_id,
                    org_id: &spec.organization_id,
                    owner_id: &spec.owner_id,
                    worker_id: &worker.id,
                    workspace_id: &workspace_id,
                    thread_id: &thread_id,
                    message_id: &spec.message_id,
                    spec: &spec.encode_to_vec(),
                },
                Utc::now(),
            )
            .await
            .map_err(store_err)?;
        if reserved {
            tracing::info!(run_id = %spec.run_id, worker_id = %worker.id, "cloud run reserved");
        }
        self.drive(&spec.run_id);
        let d = self
            .store
            .cloud_run(&spec.run_id)
            .await
            .map_err(store_err)?;
        Ok(Response::new(epb::StartRunResponse {
            submitted: reserved,
            status: Some(status_of(d.as_ref())),
        }))
    }

    type ObserveRunStream = ObserveStream;

    async fn observe_run(
        &self,
        request: Request<epb::ObserveRunRequest>,
    ) -> Result<Response<Self::ObserveRunStream>, Status> {
        let req = request.into_inner();
        let store_err = |e: automesh_store::StoreError| status::unavailable("cloud dispatch", &e);
        let Some(first) = self.store.cloud_run(&req.run_id).await.map_err(store_err)? else {
            return Err(Status::not_found("no cloud dispatch for this run"));
        };
        if first.phase != "finished" {
            // A coordinator that reattaches also revives a driver whose
            // replica died.
            self.drive(&req.run_id);
        }
        let cloud = self.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let mut after = req.after_sequence;
            let mut last: Option<epb::ExecutionStatus> = None;
            loop {
                let Ok(Some(d)) = cloud.store.cloud_run(&req.run_id).await else {
                    return;
                };
                if d.phase != "finished" {
                    // Revives a driver that stopped (a store error, a dead
                    // replica); a live one elsewhere keeps its lease.
                    cloud.drive(&req.run_id);
                }
                // Events come from the worker's thread while it runs.
                if (d.phase == "running" || d.phase == "finished")
                    && let Ok(Some(endpoint)) = cloud.store.worker_endpoint(&d.worker_id).await
                    && let Ok(mut agent) = cloud.agent(&endpoint, &d.worker_id)
                    && let Ok(stream) = agent
                        .observe_thread(apb::ObserveThreadRequest {
                            thread_id: d.thread_id.clone(),
                            after_sequence: after,
                        })
                        .await
                {
                    let mut stream = stream.into_inner();
                    while let Ok(Some(m)) = stream.message().await {
                        if let Some(apb::observe_thread_response::Update::Event(mut e)) = m.update {
                            after = after.max(e.sequence);
                            e.run_id = req.run_id.clone();
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
                    }
                }
                let Ok(Some(d)) = cloud.store.cloud_run(&req.run_id).await else {
                    return;
                };
                let status = status_of(Some(&d));
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
                tokio::select! {
                    () = tokio::time::sleep(WATCH) => {}
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
        let store_err = |e: automesh_store::StoreError| status::unavailable("cloud dispatch", &e);
        self.store
            .cancel_cloud_run(&req.run_id, Utc::now())
            .await
            .map_err(store_err)?;
        let d = self.store.cloud_run(&req.run_id).await.map_err(store_err)?;
        if let Some(d) = &d
            && d.phase != "finished"
        {
            self.drive(&req.run_id);
        }
        Ok(Response::new(epb::CancelRunResponse {
            status: Some(status_of(d.as_ref())),
        }))
    }

    async fn get_run_status(
        &self,
        request: Request<epb::GetRunStatusRequest>,
    ) -> Result<Response<epb::GetRunStatusResponse>, Status> {
        let d = self
            .store
            .cloud_run(&request.into_inner().run_id)
            .await
            .map_err(|e| status::unavailable("cloud dispatch", &e))?;
        Ok(Response::new(epb::GetRunStatusResponse {
            status: Some(status_of(d.as_ref())),
        }))
    }
}
