//! The OpenCode adapter (SPEC §8): drives a local `opencode serve` (1.18;
//! older releases' permission events too) over HTTP + SSE, headless.
//!
//! - **Never a hang.** Every HTTP request has a bound; the server's
//!   readiness is awaited (bounded) before anything else; an idle watchdog
//!   ends a session without progress; the run deadline bounds everything.
//!   The watchdog is reset by any event *about the run's sessions* — status
//!   changes, message and part updates (tool state changes included),
//!   permission events — and never by the server's own heartbeats, so a
//!   session that stays busy, waits on a prompt or keeps retrying after its
//!   last real event is ended with a named error.
//! - **Permissions under an explicit policy** ([`PermissionPolicy`]): a
//!   prompt whose kind and patterns the allow-list covers is answered
//!   `once`; any other is answered `reject`, the session is aborted and the
//!   run ends `permission_denied` naming the permission. Both
//!   `permission.asked` (1.18, `POST /permission/{id}/reply`) and the older
//!   `permission.updated` (`POST /session/{id}/permissions/{id}`) are
//!   handled. Prompts raised by child sessions (sub-agents, linked by
//!   `parentID`) are answered like the parent's.
//! - **A model failing forever** (OpenCode retries 5xx with backoff and no
//!   error event) ends `provider_unavailable` after `max_model_retries`.
//! - **A dropped event stream** (it has no replay) is reopened and the state
//!   recovered from `GET /permission`, `GET /session/status` and the
//!   session's messages; events are deduplicated by part and call id.
//! - Tool inputs are read from the `running`/`completed` states, never from
//!   `pending` (which carries an empty input).
//! - Cancellation aborts the session and waits, bounded, for it to be idle.

mod client;
mod drive;
mod policy;
mod server;
mod session;
mod sse;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::adapter::{EngineEvent, EngineRequest, Events, Outcome, Running};

pub use policy::{PermissionPolicy, PermissionRule, PolicyBook, glob};
pub use server::{OpenCodeServer, isolated_env};
pub use sse::IGNORED_EVENTS;

use session::Drive;

/// How to reach and bound an OpenCode server.
#[derive(Clone, Debug)]
pub struct OpenCodeConfig {
    /// Such as `http://127.0.0.1:4096`.
    pub base_url: String,
    /// HTTP Basic credentials, when the server has a password.
    pub username: String,
    pub password: Option<automesh_domain::Secret>,
    /// The project directory (`?directory=`), or the server's own.
    pub directory: Option<String>,
    /// Time without progress of the session after which it is ended.
    pub idle_timeout: Duration,
    /// Bound on each HTTP request.
    pub request_timeout: Duration,
    /// Bound on waiting for the server to answer its health check.
    pub ready_timeout: Duration,
    /// Bound on waiting for idle after an abort.
    pub cancel_timeout: Duration,
    /// Retries of a failing model after which the run ends.
    pub max_model_retries: u64,
}

impl OpenCodeConfig {
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            username: "opencode".into(),
            password: None,
            directory: None,
            idle_timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(10),
            ready_timeout: Duration::from_secs(30),
            cancel_timeout: Duration::from_secs(10),
            max_model_retries: 3,
        }
    }
}

/// Runs one request on the OpenCode server to its end.
pub async fn run(
    cfg: &OpenCodeConfig,
    policy: &PermissionPolicy,
    request: EngineRequest,
    events: mpsc::Sender<EngineEvent>,
    cancel: CancellationToken,
) -> Outcome {
    let mut d = Drive {
        cfg,
        http: reqwest::Client::new(),
        events: &events,
        policy,
        cancel: cancel.clone(),
        root: String::new(),
        sessions: HashSet::new(),
        texts: HashSet::new(),
        calls: HashSet::new(),
        results: HashSet::new(),
        permissions: HashSet::new(),
        usage: HashMap::new(),
        usage_sent: HashSet::new(),
        pending: None,
        ending: None,
        model_error: None,
        aborted: None,
        root_idle: false,
        busy_seen: false,
        last_answer: String::new(),
        budget: request.budget,
        price: request.price,
    };
    let ending = drive::drive(&mut d, &request, &cancel).await;
    Outcome {
        ending,
        usage: d.usage_total(),
        steps: d.usage_sent.len() as u32,
    }
}

/// The OpenCode engine for the adapter contract.
#[derive(Debug, Clone)]
pub struct OpenCodeEngine {
    pub config: OpenCodeConfig,
    pub policies: PolicyBook,
}

impl crate::adapter::EngineAdapter for OpenCodeEngine {
    fn engine_id(&self) -> &'static str {
        "opencode-1.18"
    }

    fn run(&self, request: EngineRequest, events: Events, stop: CancellationToken) -> Running<'_> {
        let policy = self.policies.for_automation(&request.automation_id);
        Box::pin(run(&self.config, policy, request, events, stop))
    }
}
