//! Client channels between services. Every outbound call carries the
//! internal credential and the caller's W3C trace context.

use std::time::Duration;

use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use crate::auth::InternalCredential;
use crate::propagation;

/// Adds the internal credential (when set) and the current trace context.
#[derive(Clone, Debug, Default)]
pub struct Outbound {
    credential: Option<InternalCredential>,
}

impl Outbound {
    pub fn new(credential: Option<InternalCredential>) -> Self {
        Self { credential }
    }
}

impl Interceptor for Outbound {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(c) = &self.credential {
            req.metadata_mut().insert("authorization", c.header_value());
        }
        propagation::inject(req.metadata_mut());
        Ok(req)
    }
}

/// A channel to another service of the mesh.
pub type InternalChannel = InterceptedService<Channel, Outbound>;

/// Why a channel could not be made.
#[derive(Debug, thiserror::Error)]
#[error("invalid service address {addr:?}: {source}")]
pub struct ChannelError {
    addr: String,
    #[source]
    source: tonic::transport::Error,
}

/// Bounds on every outbound call: connecting, and a whole unary call.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A lazily connected channel to `addr` (`http://host:port`), so services can
/// start in any order. Calls fail with UNAVAILABLE until the peer answers.
pub fn channel(addr: &str) -> Result<Channel, ChannelError> {
    let endpoint = Endpoint::from_shared(addr.to_owned())
        .map_err(|source| ChannelError {
            addr: addr.to_owned(),
            source,
        })?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10));
    Ok(endpoint.connect_lazy())
}

/// A channel to another service, carrying the internal credential. Unary
/// calls are bounded by [`CALL_TIMEOUT`]; streams set their own bounds.
pub fn internal_channel(
    addr: &str,
    credential: &InternalCredential,
) -> Result<InternalChannel, ChannelError> {
    Ok(InterceptedService::new(
        channel(addr)?,
        Outbound::new(Some(credential.clone())),
    ))
}
