//! The automesh server side, shared by every service: one gRPC server
//! builder and its transports (health, reflection, tracing, timeouts,
//! limits, connection admission), the internal service credential, client
//! channels that carry the credential and W3C trace context, the service
//! runtime (config, telemetry start, graceful shutdown). The executor kit
//! is `automesh-executor`. Telemetry is `automesh-telemetry`; the protobuf edge and error
//! mapping are `automesh-edge`.

pub mod auth;
pub mod client;
pub mod http;
pub mod precise;
pub mod process;
pub mod runtime;
pub mod server;

pub use auth::{InternalCredential, RequireInternal};
pub use client::{InternalChannel, Outbound, internal_channel};
pub use server::{GrpcServer, ServerSettings};
