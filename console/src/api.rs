//! The console's only source of truth: the public API (`automesh.v1`) of
//! the gateway, called as the signed-in user with their own token, so
//! authentication, validation, etags, idempotency and tenant scoping stay
//! in the gateway. The console never reads the database.

use std::time::Duration;

use automesh_proto::v1::automations_client::AutomationsClient;
use automesh_proto::v1::notifications_client::NotificationsClient;
use automesh_proto::v1::runs_client::RunsClient;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

/// What a call to the gateway carries: the user's token and the current
/// trace context (so a page's request and the calls it makes are one
/// trace), bounded by a deadline.
#[derive(Clone)]
pub struct AsUser {
    authorization: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
    timeout: Option<Duration>,
}

impl Interceptor for AsUser {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut()
            .insert("authorization", self.authorization.clone());
        automesh_telemetry::propagation::inject(req.metadata_mut());
        if let Some(t) = self.timeout {
            req.set_timeout(t);
        }
        Ok(req)
    }
}

type Authed = InterceptedService<Channel, AsUser>;

/// The gateway, reached over one lazily connected channel.
#[derive(Clone, Debug)]
pub struct Api {
    channel: Channel,
    timeout: Duration,
}

impl Api {
    /// A client of the gateway at `addr` (`http://host:port`); it connects
    /// on first use, so the console starts before the gateway does.
    pub fn new(addr: &str, timeout: Duration) -> anyhow::Result<Self> {
        Ok(Self {
            channel: automesh_rpc::client::channel(addr)?,
            timeout,
        })
    }

    /// The bound on one unary call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn as_user(&self, token: &str, timeout: Option<Duration>) -> Result<AsUser, Status> {
        let authorization = format!("Bearer {token}")
            .parse()
            .map_err(|_| Status::unauthenticated("the session's token is not a valid header"))?;
        Ok(AsUser {
            authorization,
            timeout,
        })
    }

    /// The Automations service, as the holder of `token`.
    pub fn automations(&self, token: &str) -> Result<AutomationsClient<Authed>, Status> {
        let user = self.as_user(token, Some(self.timeout))?;
        Ok(AutomationsClient::with_interceptor(
            self.channel.clone(),
            user,
        ))
    }

    /// The Runs service, as the holder of `token`.
    pub fn runs(&self, token: &str) -> Result<RunsClient<Authed>, Status> {
        let user = self.as_user(token, Some(self.timeout))?;
        Ok(RunsClient::with_interceptor(self.channel.clone(), user))
    }

    /// The Notifications service, as the holder of `token`.
    pub fn notifications(&self, token: &str) -> Result<NotificationsClient<Authed>, Status> {
        let user = self.as_user(token, Some(self.timeout))?;
        Ok(NotificationsClient::with_interceptor(
            self.channel.clone(),
            user,
        ))
    }

    /// The Runs service for a stream that lasts as long as the run: no
    /// deadline on the call (the stream's own reader bounds its waits).
    pub fn watch(&self, token: &str) -> Result<RunsClient<Authed>, Status> {
        let user = self.as_user(token, None)?;
        Ok(RunsClient::with_interceptor(self.channel.clone(), user))
    }

    /// Whether the gateway reports SERVING (the console's readiness).
    pub async fn serving(&self) -> bool {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_check_response::ServingStatus;
        let mut client = tonic_health::pb::health_client::HealthClient::new(self.channel.clone());
        let check = client.check(HealthCheckRequest {
            service: String::new(),
        });
        matches!(
            tokio::time::timeout(Duration::from_secs(2), check).await,
            Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32
        )
    }
}

/// Whether a gateway answer means the gateway could not be reached (the
/// page says so and retries), rather than an answer about the request.
pub fn unreachable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
    )
}
