//! The cloud executor: the coordinator's `ExecutorService` for cloud runs
//! (SPEC §5), and the housekeeping of workers.
//!
//! `StartRun` reserves and persists the run's worker, workspace, thread and
//! message identity (`cloud_dispatch`) and returns (`executor.rs`); a drive
//! — one task per run, held by a lease on that row that it renews in the
//! background, so that when its replica dies any other one resumes it —
//! then admits the run (`admission.rs`): it wakes the owner's worker
//! (`wake.rs`: concurrent wakes coalesce into one start, held as a lease;
//! readiness capped, terminal `readiness_timeout`; a ready worker whose
//! agent no longer answers is woken afresh), probes and repairs the
//! worker's `openwork-cloud` MCP registration for the model
//! (`mcp_config_missing` without a Connect configuration: the provider is
//! never called), submits the message (observe-or-submit by message id; the
//! agent journals it before it runs), and watches the thread (`watch.rs`)
//! — keeping the worker out of idle stop — until it is idle, recording the
//! outcome with the wake and admission timings.
//!
//! An agent that dies costs only the runs it was executing: they end
//! `runtime_interrupted` (not the user's to fix, so no needs-attention),
//! and every later run of the owner finds a fresh agent.
//! `housekeeping.rs` resumes runs whose drive died, keeps ready workers'
//! agents alive (an agent nobody calls exits after its orphan bound), and
//! stops idle workers from any replica.

mod admission;
mod executor;
mod housekeeping;
mod wake;
mod watch;

use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_domain::Secret;
use automesh_edge::status;
use automesh_proto::agent::v1::worker_agent_service_client::WorkerAgentServiceClient;
use automesh_proto::executor::v1 as epb;
use automesh_proto::v1 as pb;
use automesh_rpc::InternalCredential;
use automesh_store::Store;
use automesh_store::cloud::{CloudDispatch, CloudPhase};
use chrono::Utc;
use prost::Message as _;
use tokio_util::sync::CancellationToken;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};
use tracing::Instrument;

use crate::driver::{WorkerDriver, WorkerLaunch};

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
    /// How long a replica holds a run's drive, and a worker's start,
    /// without renewing it: a replica that dies hands both over this fast.
    pub lease: Duration,
    /// How often every ready worker's agent is told its lifecycle lives
    /// (well inside the agents' orphan bound).
    pub keepalive_every: Duration,
}

impl Default for CloudSettings {
    fn default() -> Self {
        Self {
            readiness_cap: Duration::from_secs(120),
            idle_after: Duration::from_secs(900),
            idle_check: Duration::from_secs(30),
            connect: None,
            lease: Duration::from_secs(15),
            keepalive_every: Duration::from_secs(15),
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
        // Calls to the agent continue the run's trace.
        automesh_telemetry::propagation::inject(req.metadata_mut());
        Ok(req)
    }
}

type Agent = WorkerAgentServiceClient<InterceptedService<Channel, AgentAuth>>;

/// How often a running thread is looked at.
const WATCH: Duration = Duration::from_millis(500);
/// How long an agent may take to answer a keepalive before it counts as
/// gone (a dead one refuses at once; a stalled one says nothing).
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The cloud executor and the housekeeping of workers.
#[derive(Debug, Clone)]
pub struct Cloud {
    store: Store,
    driver: Arc<dyn WorkerDriver>,
    settings: CloudSettings,
    credential: InternalCredential,
    replica: String,
    driving: Arc<Mutex<HashSet<String>>>,
    /// Cancelled when the replica stops: its drives end before their
    /// claims are handed back (`hand_back`).
    stopped: CancellationToken,
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
        error_code: automesh_edge::convert::code_name(code),
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
        return automesh_executor::unknown_status();
    };
    let (phase, idle) = match d.phase {
        CloudPhase::Running => (epb::ExecutionPhase::Running, false),
        CloudPhase::Finished => (epb::ExecutionPhase::Finished, true),
        // Not submitted: nothing runs anywhere.
        CloudPhase::Waking | CloudPhase::Admitted => {
            (epb::ExecutionPhase::Admitted, d.cancel_requested)
        }
    };
    epb::ExecutionStatus {
        phase: phase as i32,
        idle,
        outcome: d
            .outcome
            .as_deref()
            .and_then(|b| epb::Outcome::decode(b).ok()),
        unaccepted: false,
    }
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A run's drive, held by this replica while `lost` is not cancelled; the
/// lease is renewed in the background until this is dropped.
struct Held {
    lost: CancellationToken,
    _renewal: AbortOnDrop,
}

impl Cloud {
    pub fn new(
        store: Store,
        driver: Arc<dyn WorkerDriver>,
        settings: CloudSettings,
        credential: InternalCredential,
    ) -> Self {
        let replica = format!("lifecycle-{}", uuid::Uuid::new_v4().simple());
        // Its drives and starts carry this name in the database.
        tracing::info!(%replica, "cloud-worker-lifecycle replica");
        Self {
            store,
            driver,
            settings,
            credential,
            replica,
            driving: Arc::default(),
            stopped: CancellationToken::new(),
        }
    }

    fn launch(&self, worker_id: &str) -> WorkerLaunch {
        WorkerLaunch {
            worker_id: worker_id.to_owned(),
            collaborator_token: self.credential.derive(&format!("collaborator:{worker_id}")),
            host_credential: self.credential.derive("worker-host"),
        }
    }

    /// A client of the worker's agent at `endpoint`, carrying both
    /// credentials.
    fn agent(&self, endpoint: &str, worker_id: &str) -> Result<Agent, Status> {
        let launch = self.launch(worker_id);
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
            .map_err(|e| status::internal("the worker's endpoint", &e))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(15))
            .connect_lazy();
        let auth = AgentAuth {
            bearer: format!("Bearer {}", launch.collaborator_token)
                .parse()
                .map_err(|e| status::internal("the collaborator token", &e))?,
            host: launch
                .host_credential
                .parse()
                .map_err(|e| status::internal("the host credential", &e))?,
        };
        Ok(WorkerAgentServiceClient::with_interceptor(channel, auth))
    }

    fn lease_until(&self) -> chrono::DateTime<Utc> {
        Utc::now() + chrono::Duration::from_std(self.settings.lease).unwrap_or_default()
    }

    /// Starts this replica's drive of a run unless one is running here.
    fn drive(&self, run_id: &str) {
        // A stopping replica starts no drive: what it held is handed back.
        if self.stopped.is_cancelled() || !self.driving.lock().insert(run_id.to_owned()) {
            return;
        }
        let cloud = self.clone();
        let run_id = run_id.to_owned();
        tokio::spawn(async move {
            // Everything the drive logs belongs to the run's trace.
            let span = cloud.run_span("automesh.cloud.drive", &run_id).await;
            let driven = async {
                if let Err(error) = cloud.drive_run(&run_id).await {
                    tracing::warn!(run_id = %run_id, %error, "cloud run drive stopped; it will be resumed");
                }
            }
            .instrument(span);
            tokio::select! {
                biased;
                // The replica stops: the drive (and its lease's renewal)
                // ends here; another replica resumes it.
                () = cloud.stopped.cancelled() => {}
                () = driven => {}
            }
            cloud.driving.lock().remove(&run_id);
        });
    }

    /// A span in `run_id`'s trace (the traceparent its dispatch carries), for
    /// work on the run that is not inside a request of it.
    pub(super) async fn run_span(&self, name: &'static str, run_id: &str) -> tracing::Span {
        let traceparent = self
            .store
            .cloud_run(run_id)
            .await
            .ok()
            .flatten()
            .and_then(|d| epb::RunSpec::decode(d.spec.as_slice()).ok())
            .map(|spec| spec.traceparent);
        automesh_telemetry::propagation::run_span(name, run_id, traceparent.as_deref())
    }

    /// Takes the run's drive, or `None` while another live replica has it;
    /// renews it every third of the lease until the returned guard drops.
    async fn hold(&self, run_id: &str) -> Result<Option<Held>, automesh_store::StoreError> {
        if !self
            .store
            .take_cloud_drive(run_id, &self.replica, self.lease_until(), Utc::now())
            .await?
        {
            return Ok(None);
        }
        let lost = CancellationToken::new();
        let cloud = self.clone();
        let run = run_id.to_owned();
        let signal = lost.clone();
        let renewal = tokio::spawn(
            async move {
                let every = cloud.settings.lease / 3;
                let mut valid_until = tokio::time::Instant::now() + cloud.settings.lease;
                loop {
                    tokio::time::sleep(every).await;
                    let sent = tokio::time::Instant::now();
                    let renewed = tokio::time::timeout(
                        every,
                        cloud.store.take_cloud_drive(
                            &run,
                            &cloud.replica,
                            cloud.lease_until(),
                            Utc::now(),
                        ),
                    )
                    .await;
                    match renewed {
                        Ok(Ok(true)) => valid_until = sent + cloud.settings.lease,
                        // Finished, or another replica has it.
                        Ok(Ok(false)) => break,
                        Ok(Err(error)) => {
                            tracing::warn!(run_id = %run, %error, "cannot renew the cloud drive")
                        }
                        Err(_) => {
                            tracing::warn!(run_id = %run, "renewing the cloud drive timed out")
                        }
                    }
                    if tokio::time::Instant::now() + every >= valid_until {
                        break;
                    }
                }
                signal.cancel();
            }
            .instrument(tracing::Span::current()),
        );
        Ok(Some(Held {
            lost,
            _renewal: AbortOnDrop(renewal),
        }))
    }

    async fn fail(
        &self,
        d: &CloudDispatch,
        code: ErrorCode,
        message: String,
    ) -> Result<(), automesh_store::StoreError> {
        tracing::warn!(run_id = %d.run_id, %code, %message, "cloud run failed");
        self.finish(d, pb::RunState::Failed, Some(code), message, None)
            .await
    }

    async fn finish(
        &self,
        d: &CloudDispatch,
        state: pb::RunState,
        code: Option<ErrorCode>,
        message: String,
        usage: Option<pb::Usage>,
    ) -> Result<(), automesh_store::StoreError> {
        let o = outcome(d, state, code, message, usage);
        self.store
            .finish_cloud_run(&d.run_id, &o.encode_to_vec(), Utc::now())
            .await?;
        Ok(())
    }
}
