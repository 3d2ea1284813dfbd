//! The one contract every engine implements (the native engine and the
//! OpenCode adapter), so that the desktop runner and the worker agent run a
//! run without knowing which engine does it: the request, the events an
//! engine reports, and how its run ends.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use automesh_domain::Usage;
use serde::{Deserialize, Serialize};

use crate::native::{self, NativeRun};
use crate::provider::Message;
use automesh_domain::CodedError;

// The contract types: what an engine reports and how its run ends.

/// What a step boundary leaves behind: enough to resume instead of restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub step: u32,
    pub messages: Vec<Message>,
    pub usage: Usage,
}

/// What the engine reports while it runs.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    AssistantText {
        step: u32,
        text: String,
    },
    ToolCall {
        step: u32,
        call_id: String,
        tool: String,
        input_json: String,
    },
    ToolResult {
        step: u32,
        call_id: String,
        tool: String,
        output: String,
        is_error: bool,
    },
    Usage {
        step: u32,
        usage: Usage,
    },
    /// The agent asked for a permission, and what the headless policy
    /// answered (`once`, `reject`; empty while pending).
    Permission {
        permission_id: String,
        permission: String,
        patterns: Vec<String>,
        reply: String,
    },
    Checkpoint(Checkpoint),
}

impl EngineEvent {
    /// The run event this engine event is (a checkpoint is none: it stays
    /// with the engine).
    pub fn payload(&self) -> Option<automesh_domain::RunEventPayload> {
        use automesh_domain::RunEventPayload as P;
        if let EngineEvent::Checkpoint(_) = self {
            return None;
        }
        Some(match self.clone() {
            EngineEvent::AssistantText { text, .. } => P::AssistantText { text },
            EngineEvent::ToolCall {
                call_id,
                tool,
                input_json,
                ..
            } => P::ToolCall {
                call_id,
                tool,
                input_json,
            },
            EngineEvent::ToolResult {
                call_id,
                tool,
                output,
                is_error,
                ..
            } => P::ToolResult {
                call_id,
                tool,
                output,
                is_error,
            },
            EngineEvent::Usage { usage, .. } => P::Usage(usage),
            EngineEvent::Permission {
                permission_id,
                permission,
                patterns,
                reply,
            } => P::PermissionPrompt {
                permission_id,
                permission,
                patterns,
                reply: Some(reply),
            },
            EngineEvent::Checkpoint(_) => return None,
        })
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    Succeeded { answer: String },
    Failed(CodedError),
    Cancelled,
}

/// The end of a run and what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub ending: Ending,
    pub usage: Usage,
    pub steps: u32,
}

/// What every engine needs to run one run.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub prompt: String,
    /// The catalogue model id, such as `openai/gpt-4.1-mini`.
    pub model: String,
    /// The name the provider expects for it (the catalogue's mapping, such
    /// as `gpt-4.1-mini`); empty when the mesh sent none.
    pub provider_model: String,
    /// The automation the run belongs to (engines may configure per
    /// automation, such as OpenCode's permission policy).
    pub automation_id: String,
    /// Runtime guidance (where the agent runs, with which tools).
    pub guidance: Option<String>,
    pub deadline: Instant,
    /// Resume from a checkpoint instead of starting from the prompt.
    pub resume_from: Option<Checkpoint>,
    /// What the run may spend, checked after every step: a run that
    /// exceeds it stops at that step boundary (`budget_exceeded`).
    pub budget: automesh_domain::RunBudget,
    /// The price its cost is counted at (`None`: unpriced, so only its
    /// tokens are capped).
    pub price: Option<automesh_domain::Price>,
}

/// How long a run that came without a deadline may take.
pub const DEFAULT_RUN_BOUND: std::time::Duration = std::time::Duration::from_secs(1800);

impl EngineRequest {
    /// `prompt` on `model` (`provider_model`: the provider's name for it,
    /// empty for the default), due by `deadline_time` as the mesh sent it
    /// (without one, within [`DEFAULT_RUN_BOUND`]); for no automation in
    /// particular, without guidance, from the start.
    pub fn due(
        prompt: &str,
        model: &str,
        provider_model: &str,
        deadline_time: Option<&prost_types::Timestamp>,
    ) -> Self {
        let left = deadline_time
            .and_then(automesh_edge::convert::from_timestamp)
            .map(|d| (d - chrono::Utc::now()).to_std().unwrap_or_default())
            .unwrap_or(DEFAULT_RUN_BOUND);
        EngineRequest {
            prompt: prompt.to_owned(),
            model: model.to_owned(),
            provider_model: provider_model.to_owned(),
            automation_id: String::new(),
            guidance: None,
            deadline: Instant::now() + left,
            resume_from: None,
            budget: automesh_domain::RunBudget::default(),
            price: None,
        }
    }

    /// This request under the budget the mesh sent (none when unset).
    pub fn within(self, budget: Option<&automesh_proto::v1::RunBudget>) -> Self {
        let (budget, price) = automesh_edge::convert::run_budget_from_pb(budget);
        EngineRequest {
            budget,
            price,
            ..self
        }
    }

    /// The name to ask the provider for: the catalogue's mapping, or, from
    /// a mesh that sends none, the id after its first `/`.
    pub fn provider_name(&self) -> &str {
        if !self.provider_model.is_empty() {
            return &self.provider_model;
        }
        self.model
            .split_once('/')
            .map_or(self.model.as_str(), |(_, m)| m)
    }
}

/// An engine: runs a request to its end, reporting events as it goes.
/// Cancelling `cancel` stops it; it always ends, by the request's deadline.
pub trait EngineAdapter: Send + Sync {
    /// The engine id recorded on receipts, such as `native-v1`.
    fn engine_id(&self) -> &'static str;

    /// Runs `request` to its outcome, sending what happens on `events`,
    /// until it ends or `stop` is cancelled.
    fn run(&self, request: EngineRequest, events: Events, stop: CancellationToken) -> Running<'_>;
}

/// Where an engine sends what happens during a run.
pub type Events = mpsc::Sender<EngineEvent>;

/// A run under way, resolving to its outcome.
pub type Running<'a> = Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>;

/// The native engine, configured for one run (its provider and its
/// run-scoped Connect endpoint).
#[derive(Debug, Clone)]
pub struct NativeEngine {
    /// Everything but the per-request fields, which `run` fills in.
    pub template: NativeRun,
}

impl NativeEngine {
    /// The native engine against an OpenAI-compatible provider at
    /// `provider_url` and the Connect endpoint at `connect_url`: how the
    /// desktop runner, the worker agent and `dev` all build it. The caller
    /// checked the model against its catalogue (the gateway only assigns
    /// runs whose model the owner may use).
    /// [`NativeEngine::openai_compatible`] as the engine's flags set it.
    pub fn from_flags(
        flags: &crate::ProviderFlags,
        connect_url: &str,
        connect_token: &str,
    ) -> NativeEngine {
        let settings = NativeSettings {
            request_timeout: flags.request_timeout,
            stream: flags.stream,
            max_steps: flags.max_steps,
            ..Default::default()
        };
        let key = flags.provider_key.expose();
        Self::openai_compatible(
            &flags.provider_url,
            key,
            connect_url,
            connect_token,
            settings,
        )
    }

    pub fn openai_compatible(
        provider_url: &str,
        provider_key: &str,
        connect_url: &str,
        connect_token: &str,
        settings: NativeSettings,
    ) -> NativeEngine {
        NativeEngine {
            template: NativeRun {
                model: String::new(),
                prompt: String::new(),
                guidance: None,
                provider: crate::provider::ProviderConfig {
                    kind: "openai-compatible".into(),
                    base_url: provider_url.to_owned(),
                    api_key: provider_key.into(),
                    request_timeout: settings.request_timeout,
                    stream: settings.stream,
                },
                connect: crate::connect::ConnectConfig {
                    url: connect_url.to_owned(),
                    token: connect_token.into(),
                    call_timeout: settings.connect_call_timeout,
                },
                connect_token_expires_at: None,
                model_authorized: true,
                max_steps: settings.max_steps,
                deadline: Instant::now(),
                resume_from: None,
                budget: Default::default(),
                price: None,
            },
        }
    }
}

/// The native engine's knobs, alike on every placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativeSettings {
    /// Bound on one provider request.
    pub request_timeout: std::time::Duration,
    /// Streaming completions.
    pub stream: bool,
    /// The agent loop's step limit.
    pub max_steps: u32,
    /// Bound on connecting to the Connect endpoint and on each tool call.
    pub connect_call_timeout: std::time::Duration,
}

impl Default for NativeSettings {
    fn default() -> Self {
        Self {
            request_timeout: std::time::Duration::from_secs(120),
            stream: false,
            max_steps: native::DEFAULT_MAX_STEPS,
            connect_call_timeout: std::time::Duration::from_secs(30),
        }
    }
}

impl EngineAdapter for NativeEngine {
    fn engine_id(&self) -> &'static str {
        "native-v1"
    }

    fn run(&self, request: EngineRequest, events: Events, stop: CancellationToken) -> Running<'_> {
        let model = request.provider_name().to_owned();
        let run = NativeRun {
            prompt: request.prompt,
            model,
            guidance: request.guidance,
            deadline: request.deadline,
            resume_from: request.resume_from,
            budget: request.budget,
            price: request.price,
            ..self.template.clone()
        };
        Box::pin(native::run(run, events, stop))
    }
}
