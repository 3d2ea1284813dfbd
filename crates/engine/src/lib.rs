//! The engines behind one contract ([`adapter`]): the native engine — a
//! chat-completions tool loop against an OpenAI-compatible provider, with
//! exactly two MCP tools (`search_capabilities`, `execute_capability`)
//! served by the run's Connect endpoint — and the OpenCode adapter, which
//! drives a local `opencode serve`. Also the executors' run journal and the
//! wire conversion of engine events. Fail closed on every edge; every wait
//! bounded; credentials travel only as `Authorization` headers.

pub mod adapter;
pub mod connect;
pub mod error;
mod flags;
pub mod journal;
mod metrics;
pub mod native;
pub mod opencode;
pub mod provider;
pub mod trace;
pub mod wire;

pub use adapter::{EngineAdapter, EngineRequest, NativeEngine};
pub use flags::ProviderFlags;
