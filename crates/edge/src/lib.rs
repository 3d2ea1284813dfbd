//! The protobuf edge: every conversion between `automesh.v1` messages and
//! domain types (`convert`), and the one place errors become gRPC statuses
//! (`status`: codes, rich details, the trace id), so a handler, a client
//! and the engine's wire format map alike.

pub mod convert;
pub mod status;
