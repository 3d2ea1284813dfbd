//! Runs: one execution of an automation, its state machine, its ordered
//! events, and its terminal receipt.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::automation::Placement;
use crate::error_code::{CodedError, ErrorCode};
use crate::string_enum;

string_enum! {
    /// The lifecycle state of a run.
    RunState {
        Pending => "pending",
        Waking => "waking",
        Admitted => "admitted",
        Running => "running",
        Succeeded => "succeeded",
        Failed => "failed",
        TimedOut => "timed_out",
        Cancelled => "cancelled",
        Skipped => "skipped",
        Missed => "missed",
    }
}

impl RunState {
    /// Terminal states are final: nothing moves a run out of one.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Succeeded
                | RunState::Failed
                | RunState::TimedOut
                | RunState::Cancelled
                | RunState::Skipped
                | RunState::Missed
        )
    }

    /// Whether a live run may move from `self` to `next`. Skipped and missed
    /// runs are created terminal, never reached by a transition.
    pub fn can_move_to(self, next: RunState) -> bool {
        use RunState::*;
        match (self, next) {
            (from, _) if from.is_terminal() => false,
            (_, Skipped | Missed) => false,
            (_, Succeeded | Failed | TimedOut | Cancelled) => true,
            (Pending, Waking | Admitted) => true,
            (Waking, Admitted) => true,
            (Admitted, Running) => true,
            _ => false,
        }
    }

    /// The states a transition to `next` may start from (for guarded SQL).
    pub fn predecessors(next: RunState) -> Vec<RunState> {
        use RunState::*;
        [Pending, Waking, Admitted, Running]
            .into_iter()
            .filter(|s| s.can_move_to(next))
            .collect()
    }
}

string_enum! {
    /// What started a run.
    RunTrigger { Schedule => "schedule", Manual => "manual", }
}

/// Token usage and cost of a run or a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: i64,
    pub output_tokens: i64,
    /// Millionths of the billing currency unit.
    pub cost_micros: i64,
}

/// The most one run of an automation may spend: cost (at the run's price)
/// and tokens (input and output together), each optional. A run that
/// exceeds either stops at the step boundary where it did: the provider
/// is not called again, and it ends `budget_exceeded`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunBudget {
    pub max_cost_micros: Option<i64>,
    pub max_tokens: Option<i64>,
}

/// The largest cap either field of a [`RunBudget`] may be (a million units
/// of the currency; 10^12 tokens).
pub const MAX_BUDGET: i64 = 1_000_000_000_000;

impl RunBudget {
    /// Its caps in words (`1500 µ, 777 tokens`), or `None` when it caps
    /// nothing.
    pub fn describe(&self) -> Option<String> {
        let caps: Vec<String> = [
            self.max_cost_micros.map(|c| format!("{c} µ")),
            self.max_tokens.map(|t| format!("{t} tokens")),
        ]
        .into_iter()
        .flatten()
        .collect();
        (!caps.is_empty()).then(|| caps.join(", "))
    }

    /// Whether it caps anything.
    pub fn is_set(&self) -> bool {
        self.max_cost_micros.is_some() || self.max_tokens.is_some()
    }

    /// Why `usage`, so far, exceeds the budget, counting cost at `price`
    /// (an unpriced run costs nothing, so only its tokens are capped);
    /// `None` while within it.
    pub fn exceeded(&self, usage: &Usage, price: Option<crate::Price>) -> Option<CodedError> {
        let tokens = usage.input_tokens.saturating_add(usage.output_tokens);
        if let Some(max) = self.max_tokens
            && tokens > max
        {
            return Some(CodedError::new(
                ErrorCode::BudgetExceeded,
                format!("the run used {tokens} tokens, over its cap of {max}"),
            ));
        }
        let cost = price.map_or(0, |p| {
            p.cost_micros(usage.input_tokens, usage.output_tokens)
        });
        match self.max_cost_micros {
            Some(max) if cost > max => Some(CodedError::new(
                ErrorCode::BudgetExceeded,
                format!("the run cost {cost} micro-units, over its cap of {max}"),
            )),
            _ => None,
        }
    }
}

/// The summed usage on the receipts of the runs created in one quarter hour
/// (every zone's day starts on one): what a period's totals and its days in
/// any zone are summed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuarterUsage {
    /// The quarter hour's start.
    pub start: DateTime<Utc>,
    /// Runs with a receipt.
    pub runs: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cost_micros: i64,
}

/// A stored run.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub id: String,
    pub automation_id: String,
    pub org_id: String,
    pub owner_id: String,
    pub placement: Placement,
    pub trigger: RunTrigger,
    /// The occurrence (scheduled runs only).
    pub scheduled_for: Option<DateTime<Utc>>,
    pub idempotency_key: Option<String>,
    /// Snapshot of the automation's prompt and model when the run was created.
    pub prompt: String,
    pub model: String,
    /// Fixed at creation; covers waiting, wake-up, admission and execution.
    pub deadline_at: DateTime<Utc>,
    pub state: RunState,
    pub error_code: Option<ErrorCode>,
    pub error_message: Option<String>,
    /// When a user asked for cancellation.
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// When an executor accepted the run, and when it started executing.
    pub admitted_at: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// W3C `traceparent` of the trace that follows this run.
    pub traceparent: Option<String>,
    /// The deterministic identity of the user message, persisted before the
    /// prompt is first submitted.
    pub message_id: Option<String>,
    /// Snapshot of the automation's budget per run when it was created.
    pub budget: RunBudget,
}

impl Run {
    /// The trace id inside the stored `traceparent`, if any.
    pub fn trace_id(&self) -> Option<&str> {
        trace_id_of(self.traceparent.as_deref()?)
    }
}

/// The trace id of a W3C `traceparent` (`version-traceid-spanid-flags`),
/// when it has one of the right length.
fn trace_id_of(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.split('-');
    let (_version, trace_id) = (parts.next()?, parts.next()?);
    (trace_id.len() == 32).then_some(trace_id)
}

/// A run to create: the automation it runs — whose owner and placement it
/// takes, and whose prompt and model it snapshots — and the occurrence,
/// trigger and bounds of this run.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRun<'a> {
    pub id: String,
    pub automation: &'a crate::Automation,
    pub trigger: RunTrigger,
    pub scheduled_for: Option<DateTime<Utc>>,
    pub idempotency_key: Option<String>,
    /// `Pending` normally; `Skipped` or `Missed` for occurrences recorded
    /// terminal at creation, with why.
    pub state: RunState,
    pub error: Option<(ErrorCode, String)>,
    pub deadline_at: DateTime<Utc>,
    pub traceparent: Option<String>,
}

/// The durable terminal record of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Receipt {
    pub run_id: String,
    pub outcome: RunState,
    pub error_code: Option<ErrorCode>,
    pub error_message: Option<String>,
    pub placement: Placement,
    pub engine: Option<String>,
    pub queued_micros: i64,
    pub wake_micros: i64,
    pub admission_micros: i64,
    pub execution_micros: i64,
    pub usage: Usage,
    pub worker_id: Option<String>,
    pub workspace_id: Option<String>,
    pub thread_id: Option<String>,
    pub message_id: Option<String>,
    pub created_at: DateTime<Utc>,
    /// The catalogue model the run was priced by.
    pub model: Option<String>,
    /// The name the provider was asked for.
    pub provider_model: Option<String>,
    /// The price `usage.cost_micros` was computed at; `None` for an
    /// unpriced model (cost 0).
    pub price: Option<crate::Price>,
    /// The budget the run ran under.
    pub budget: RunBudget,
}

impl Receipt {
    /// The receipt of a run of `placement` that ended `outcome` at `at`
    /// before anything ran it: no error, engine, timings, usage, identities
    /// or model (a run recorded skipped or missed, say); set what applies.
    pub fn bare(run_id: &str, outcome: RunState, placement: Placement, at: DateTime<Utc>) -> Self {
        Self {
            run_id: run_id.to_owned(),
            outcome,
            error_code: None,
            error_message: None,
            placement,
            engine: None,
            queued_micros: 0,
            wake_micros: 0,
            admission_micros: 0,
            execution_micros: 0,
            usage: Usage::default(),
            worker_id: None,
            workspace_id: None,
            thread_id: None,
            message_id: None,
            created_at: at,
            model: None,
            provider_model: None,
            price: None,
            budget: RunBudget::default(),
        }
    }
}

/// What happened in a run, as the event log records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RunEventPayload {
    AssistantText {
        text: String,
    },
    ToolCall {
        call_id: String,
        tool: String,
        input_json: String,
    },
    ToolResult {
        call_id: String,
        tool: String,
        output: String,
        is_error: bool,
    },
    PermissionPrompt {
        permission_id: String,
        permission: String,
        patterns: Vec<String>,
        reply: Option<String>,
    },
    Usage(Usage),
    StatusChange {
        state: String,
        error_code: Option<String>,
        message: Option<String>,
    },
}

impl RunEventPayload {
    /// A short kind name, stored beside the payload for filtering.
    pub fn kind(&self) -> &'static str {
        match self {
            RunEventPayload::AssistantText { .. } => "assistant_text",
            RunEventPayload::ToolCall { .. } => "tool_call",
            RunEventPayload::ToolResult { .. } => "tool_result",
            RunEventPayload::PermissionPrompt { .. } => "permission_prompt",
            RunEventPayload::Usage(_) => "usage",
            RunEventPayload::StatusChange { .. } => "status_change",
        }
    }
}

/// One ordered, deduplicated event of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunEvent {
    pub run_id: String,
    /// Strictly increasing per run, from 1.
    pub sequence: i64,
    /// The producer's id; redelivery of the same id adds nothing.
    pub event_id: String,
    pub created_at: DateTime<Utc>,
    pub payload: RunEventPayload,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_is_final() {
        use RunState::*;
        for t in [Succeeded, Failed, TimedOut, Cancelled, Skipped, Missed] {
            for n in [
                Pending, Waking, Admitted, Running, Succeeded, Failed, Cancelled,
            ] {
                assert!(!t.can_move_to(n), "{t} -> {n}");
            }
        }
        assert!(Pending.can_move_to(Admitted));
        assert!(Pending.can_move_to(TimedOut));
        assert!(!Running.can_move_to(Pending));
        assert!(!Pending.can_move_to(Running));
        assert!(!Pending.can_move_to(Skipped));
    }

    #[test]
    fn trace_id_from_traceparent() {
        for (traceparent, want) in [
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Some("4bf92f3577b34da6a3ce929d0e0e4736"),
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
                None,
            ),
            ("00", None),
            ("", None),
        ] {
            assert_eq!(trace_id_of(traceparent), want, "{traceparent:?}");
        }
    }
}

#[cfg(test)]
mod budget_tests {
    use super::*;

    #[test]
    fn a_budget_is_exceeded_only_past_its_cap() {
        let price = crate::Price {
            input_micros_per_million_tokens: 1_000_000,
            output_micros_per_million_tokens: 2_000_000,
        };
        let usage = Usage {
            input_tokens: 100,
            output_tokens: 50,
            cost_micros: 0,
        };
        // 100 × 1 + 50 × 2 = 200 micro-units; 150 tokens.
        let at = |max_cost_micros, max_tokens| RunBudget {
            max_cost_micros,
            max_tokens,
        };
        assert!(at(Some(200), None).exceeded(&usage, Some(price)).is_none());
        let over = at(Some(199), None).exceeded(&usage, Some(price));
        assert_eq!(over.map(|e| e.code), Some(ErrorCode::BudgetExceeded));
        assert!(at(None, Some(150)).exceeded(&usage, None).is_none());
        assert!(at(None, Some(149)).exceeded(&usage, None).is_some());
        // Unpriced: cost is 0, only tokens are capped.
        assert!(at(Some(0), None).exceeded(&usage, None).is_none());
        assert!(!RunBudget::default().is_set());
        assert!(RunBudget::default().exceeded(&usage, Some(price)).is_none());
    }
}
