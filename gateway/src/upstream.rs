//! Clients of the internal services the gateway fans out to.

use automesh_proto::coordinator::v1::run_coordinator_service_client::RunCoordinatorServiceClient;
use automesh_proto::runner::v1::runner_token_service_client::RunnerTokenServiceClient;
use automesh_proto::scheduler::v1::scheduler_service_client::SchedulerServiceClient;
use automesh_proto::worker::v1::cloud_worker_lifecycle_service_client::CloudWorkerLifecycleServiceClient;
use automesh_rpc::client::ChannelError;
use automesh_rpc::{InternalChannel, InternalCredential, internal_channel};
use tonic_health::pb::health_client::HealthClient;

/// One lazily connected channel per internal service.
#[derive(Debug, Clone)]
pub struct Upstreams {
    pub scheduler: SchedulerServiceClient<InternalChannel>,
    pub coordinator: RunCoordinatorServiceClient<InternalChannel>,
    pub lifecycle: CloudWorkerLifecycleServiceClient<InternalChannel>,
    pub runner_tokens: RunnerTokenServiceClient<InternalChannel>,
    health: Vec<(&'static str, automesh_rpc::client::Replicas)>,
}

/// Where the internal services listen. Each may name several replicas,
/// comma separated; calls move to the next when one fails.
#[derive(Debug, Clone, clap::Args)]
pub struct UpstreamAddrs {
    #[arg(long, env = "AUTOMESH_SCHEDULER_ADDR", default_value = SCHEDULER)]
    pub scheduler_addr: String,
    #[arg(long, env = "AUTOMESH_COORDINATOR_ADDR", default_value = COORDINATOR)]
    pub coordinator_addr: String,
    #[arg(long, env = "AUTOMESH_LIFECYCLE_ADDR", default_value = LIFECYCLE)]
    pub lifecycle_addr: String,
    /// The desktop-runner-gateway's internal listener (its
    /// `--internal-listen`), where the runner token service is.
    #[arg(long, env = "AUTOMESH_RUNNER_GATEWAY_ADDR", default_value = RUNNER_GATEWAY)]
    pub runner_gateway_addr: String,
}

/// Where each service listens by default.
const SCHEDULER: &str = "http://127.0.0.1:50053";
const COORDINATOR: &str = "http://127.0.0.1:50054";
const LIFECYCLE: &str = "http://127.0.0.1:50055";
const RUNNER_GATEWAY: &str = "http://127.0.0.1:50056";

impl Upstreams {
    pub fn new(
        addrs: &UpstreamAddrs,
        credential: &InternalCredential,
    ) -> Result<Self, ChannelError> {
        let health = |name, addr: &str| -> Result<_, ChannelError> {
            Ok((name, automesh_rpc::client::replicas(addr)?))
        };
        let channel = |addr: &str| internal_channel(addr, credential);
        Ok(Self {
            scheduler: SchedulerServiceClient::new(channel(&addrs.scheduler_addr)?),
            coordinator: RunCoordinatorServiceClient::new(channel(&addrs.coordinator_addr)?),
            lifecycle: CloudWorkerLifecycleServiceClient::new(channel(&addrs.lifecycle_addr)?),
            runner_tokens: RunnerTokenServiceClient::new(channel(&addrs.runner_gateway_addr)?),
            health: vec![
                health("scheduler", &addrs.scheduler_addr)?,
                health("run-coordinator", &addrs.coordinator_addr)?,
                health("cloud-worker-lifecycle", &addrs.lifecycle_addr)?,
                health("desktop-runner-gateway", &addrs.runner_gateway_addr)?,
            ],
        })
    }

    /// A client of the scheduler (clients are cheap to clone).
    pub fn scheduler(&self) -> SchedulerServiceClient<InternalChannel> {
        self.scheduler.clone()
    }

    /// A client of the run-coordinator.
    pub fn coordinator(&self) -> RunCoordinatorServiceClient<InternalChannel> {
        self.coordinator.clone()
    }

    /// A client of the runner token service (on the runner gateway).
    pub fn runner_tokens(&self) -> RunnerTokenServiceClient<InternalChannel> {
        self.runner_tokens.clone()
    }

    /// Whether every internal service reports SERVING (the gateway's own
    /// readiness: it can do nothing without them).
    pub async fn all_serving(&self) -> bool {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_check_response::ServingStatus;
        for (name, replicas) in &self.health {
            // Serving when one replica serves: a replica that does not
            // answer moves the next try to the next one.
            let mut ok = false;
            for _ in 0..replicas.len().max(1) {
                let mut client = HealthClient::new(replicas.clone());
                ok = matches!(
                    tokio::time::timeout(
                        std::time::Duration::from_secs(2),
                        client.check(HealthCheckRequest { service: String::new() }),
                    )
                    .await,
                    Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32
                );
                if ok {
                    break;
                }
            }
            if !ok {
                tracing::debug!(upstream = name, "upstream not serving");
                return false;
            }
        }
        true
    }
}
