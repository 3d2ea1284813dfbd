//! Shared gRPC plumbing for every automesh server and client: one server
//! builder (health, reflection, tracing, timeouts, limits), the internal
//! service credential, client channels that carry the credential and W3C
//! trace context, telemetry initialisation, rich error statuses, and the
//! conversions between protobuf messages and domain types.

pub mod auth;
pub mod client;
pub mod convert;
pub mod executor;
pub mod http;
pub mod json_log;
pub mod metrics;
pub mod otlp_logs;
pub mod precise;
pub mod process;
pub mod propagation;
pub mod runtime;
pub mod server;
pub mod status;
pub mod telemetry;

pub use auth::{InternalCredential, RequireInternal};
pub use client::{InternalChannel, Outbound, internal_channel};
pub use server::{GrpcServer, ServerSettings};
