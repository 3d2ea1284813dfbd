//! The closed set of error codes a run or an automation can carry. Each has a
//! stable snake_case name that appears in receipts, events and the API; the
//! list is documented in `docs/error-codes.md`.

use std::fmt;
use std::str::FromStr;

macro_rules! error_codes {
    ($($variant:ident => $name:literal: $doc:literal,)*) => {
        /// A named terminal error. Adding a code is a contract change:
        /// document it in `docs/error-codes.md`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $(#[doc = $doc] $variant,)*
        }

        impl ErrorCode {
            /// Every code, in documentation order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The stable wire name.
            pub fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$variant => $name,)* }
            }

            /// What the code means, for operators.
            pub fn description(self) -> &'static str {
                match self { $(ErrorCode::$variant => $doc,)* }
            }
        }

        impl FromStr for ErrorCode {
            type Err = UnknownErrorCode;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($name => Ok(ErrorCode::$variant),)*
                    _ => Err(UnknownErrorCode(s.to_owned())),
                }
            }
        }
    };
}

error_codes! {
    ProviderUnavailable => "provider_unavailable": "The model provider refused the credentials, is outside the allowlist, or stayed unavailable.",
    ModelNotAuthorized => "model_not_authorized": "The model is no longer authorised for the owner's organisation (cloud) or no longer in the model catalogue; checked before the run is dispatched, so nothing is called.",
    RuntimeMissing => "runtime_missing": "The owner has no cloud worker.",
    RuntimeFailed => "runtime_failed": "The owner's cloud worker kept failing to start.",
    RuntimeInterrupted => "runtime_interrupted": "The cloud worker's agent stopped while executing the run; it is not run again.",
    ReadinessTimeout => "readiness_timeout": "The cloud worker did not become ready within the readiness cap.",
    McpConfigMissing => "mcp_config_missing": "The Connect (MCP) configuration for the model is missing.",
    ToolInventoryMismatch => "tool_inventory_mismatch": "The Connect endpoint did not list exactly the reviewed tools.",
    ConnectTokenExpired => "connect_token_expired": "The run's Connect token expired.",
    ConnectUnauthorized => "connect_unauthorized": "The Connect endpoint refused the run's token.",
    RunnerOffline => "runner_offline": "No desktop runner of the owner was connected before the deadline.",
    RunnerUnresponsive => "runner_unresponsive": "A runner of the owner was connected but never accepted the run; no other runner took it before the deadline.",
    RunnerInterrupted => "runner_interrupted": "The desktop runner stopped while executing the run; it is not run again.",
    PermissionDenied => "permission_denied": "The agent asked for a permission the headless policy does not allow.",
    PermissionPending => "permission_pending": "A permission prompt was still unanswered when a bound was hit.",
    QuestionUnanswered => "question_unanswered": "The agent asked the absent user a question a headless run cannot answer.",
    IdleTimeout => "idle_timeout": "The engine made no progress for longer than the idle bound.",
    DeadlineExceeded => "deadline_exceeded": "The run reached its deadline.",
    CancelUnobserved => "cancel_unobserved": "The executor was not observed idle within the cancellation bound.",
    StepLimitExceeded => "step_limit_exceeded": "The agent loop reached its step limit.",
    ProviderError => "provider_error": "The model provider returned a malformed or truncated answer.",
    ToolError => "tool_error": "A Connect tool call failed in a way the run cannot continue from.",
    BudgetExceeded => "budget_exceeded": "The run spent more than its automation's budget per run (max_cost_micros or max_tokens); it stopped at that step boundary and the provider was not called again.",
    BudgetExhausted => "budget_exhausted": "Skipped: the automation's runs this month (in its schedule's zone) cost its monthly budget or more; the automation needs attention until the month ends or the budget is raised.",
    PreviousRunLive => "previous_run_live": "Skipped: the previous run of the automation was still live at the due instant.",
    MissedDuringDowntime => "missed_during_downtime": "Missed: the occurrence fell due while the mesh was down, outside the catch-up window.",
    Internal => "internal": "An internal error; see the logs by trace id.",
    FailingRepeatedly => "failing_repeatedly": "An automation's reason for needing attention, not a run's code: its last runs (as many as its pause_after_failures) all ended failed or timed out, so its schedule paused.",
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0:?}")]
pub struct UnknownErrorCode(pub String);

impl ErrorCode {
    /// Whether a run that failed with this code is a durable failure of the
    /// user's setup: the automation then needs attention (it stops being
    /// scheduled until the user fixes the cause and activates it), and a
    /// successful run clears it.
    pub fn needs_attention(self) -> bool {
        matches!(
            self,
            ErrorCode::RuntimeMissing
                | ErrorCode::RuntimeFailed
                | ErrorCode::ReadinessTimeout
                | ErrorCode::McpConfigMissing
                | ErrorCode::ModelNotAuthorized
                | ErrorCode::BudgetExhausted
        )
    }
}

/// A failure named by one of the closed set of [`ErrorCode`]s, with a
/// message for people that never carries a credential: how an engine run,
/// a worker driver or any step of either fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct CodedError {
    pub code: ErrorCode,
    pub message: String,
}

impl CodedError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_documented() {
        let doc = include_str!("../../../docs/error-codes.md");
        for code in ErrorCode::ALL {
            assert_eq!(code.as_str().parse::<ErrorCode>(), Ok(*code));
            assert!(
                doc.contains(&format!("`{}`", code.as_str())),
                "{code} is missing from docs/error-codes.md"
            );
        }
    }

    /// The document's "needs attention" column says what the code does.
    #[test]
    fn the_needs_attention_column_is_the_codes_own() {
        let doc = include_str!("../../../docs/error-codes.md");
        for code in ErrorCode::ALL {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{}` |", code.as_str())))
                .unwrap_or_else(|| panic!("no row for {code}"));
            let last = row
                .trim_end_matches('|')
                .rsplit('|')
                .next()
                .unwrap_or_default()
                .trim();
            assert_eq!(
                last == "yes",
                code.needs_attention(),
                "{code}: the document says {last:?}"
            );
        }
    }
}
