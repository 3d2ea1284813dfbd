//! Notifications: what an owner is told at their webhook endpoints when
//! something needs them — a run that failed, an automation that needs
//! attention or spent its monthly budget, occurrences missed while the
//! scheduler was down.
//!
//! A [`Notice`] is written to the outbox in the transaction of the change
//! that causes it. Its id is derived from its cause, so a cause written
//! twice (a replayed batch, a retried pass) is one message, and every
//! delivery attempt of it carries the same `webhook-id`.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::json;
use uuid::Uuid;

use crate::{Automation, ErrorCode, Principal, RunState};

/// The namespace of derived message ids (a fixed random UUID).
const MESSAGE_NAMESPACE: Uuid = Uuid::from_u128(0x3b8e_51d0_77c4_4a0e_9f26_e1a4_5c0b_8d72);

/// The longest run error message a notice carries (the run has it whole).
const MESSAGE_LIMIT: usize = 1000;

/// What a notice is about: its `type` in the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// A run ended failed or timed out, the first of a failure streak
    /// (the rest of the streak is told once, by `NeedsAttention`).
    RunFailed,
    /// An automation moved to needs-attention (its reason in the payload).
    NeedsAttention,
    /// An automation's monthly budget is spent: an occurrence or run-now
    /// was skipped and the automation needs attention.
    BudgetReached,
    /// Occurrences fell due while the scheduler was down and were recorded
    /// missed.
    OccurrencesMissed,
    /// The owner asked for a test message.
    Test,
}

impl EventType {
    pub const ALL: [EventType; 5] = [
        EventType::RunFailed,
        EventType::NeedsAttention,
        EventType::BudgetReached,
        EventType::OccurrencesMissed,
        EventType::Test,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::RunFailed => "run.failed",
            EventType::NeedsAttention => "automation.needs_attention",
            EventType::BudgetReached => "automation.budget_reached",
            EventType::OccurrencesMissed => "automation.occurrences_missed",
            EventType::Test => "webhook.test",
        }
    }
}

impl std::fmt::Display for EventType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A message for an owner's webhook endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The `webhook-id`: `msg_` and 32 hex digits, derived from the cause.
    pub id: String,
    pub org_id: String,
    pub owner_id: String,
    pub event_type: EventType,
    /// The body: `{"type", "timestamp", "data"}` as JSON.
    pub payload: String,
    pub at: DateTime<Utc>,
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

impl Notice {
    fn new(
        event_type: EventType,
        cause: &str,
        (org_id, owner_id): (&str, &str),
        data: serde_json::Value,
        at: DateTime<Utc>,
    ) -> Notice {
        let name = format!("{}/{cause}", event_type.as_str());
        let id = Uuid::new_v5(&MESSAGE_NAMESPACE, name.as_bytes());
        let payload = json!({
            "type": event_type.as_str(),
            "timestamp": rfc3339(at),
            "data": data,
        });
        Notice {
            id: format!("msg_{}", id.simple()),
            org_id: org_id.to_owned(),
            owner_id: owner_id.to_owned(),
            event_type,
            payload: payload.to_string(),
            at,
        }
    }

    fn automation(a: &Automation) -> serde_json::Value {
        json!({ "id": a.id, "name": a.name })
    }

    /// Run `run_id` of `a` ended `outcome` (failed or timed out).
    pub fn run_failed(
        a: &Automation,
        run_id: &str,
        outcome: RunState,
        code: Option<ErrorCode>,
        message: Option<&str>,
        at: DateTime<Utc>,
    ) -> Notice {
        let message: String = message
            .unwrap_or_default()
            .chars()
            .take(MESSAGE_LIMIT)
            .collect();
        let data = json!({
            "automation": Notice::automation(a),
            "run_id": run_id,
            "state": outcome.as_str(),
            "error_code": code.map(ErrorCode::as_str),
            "error_message": message,
        });
        let owner = (a.org_id.as_str(), a.owner_id.as_str());
        Notice::new(EventType::RunFailed, run_id, owner, data, at)
    }

    /// `a` (as it stands after the move) needs attention, moved there by
    /// the end of run `run_id`.
    pub fn needs_attention(a: &Automation, run_id: &str, at: DateTime<Utc>) -> Notice {
        let (reason, message) = a
            .attention
            .as_ref()
            .map(|x| (x.reason.as_str(), x.message.as_str()))
            .unwrap_or_default();
        let data = json!({
            "automation": Notice::automation(a),
            "reason": reason,
            "message": message,
            "run_id": run_id,
            "failure_streak": a.failure_streak.runs,
            "failure_streak_codes": a.failure_streak.codes,
        });
        let cause = format!("{}/{run_id}", a.id);
        let owner = (a.org_id.as_str(), a.owner_id.as_str());
        Notice::new(EventType::NeedsAttention, &cause, owner, data, at)
    }

    /// The monthly budget of `a` is spent: run `run_id` was recorded
    /// skipped.
    pub fn budget_reached(a: &Automation, run_id: &str, spent: i64, at: DateTime<Utc>) -> Notice {
        let data = json!({
            "automation": Notice::automation(a),
            "run_id": run_id,
            "month_spend_micros": spent,
            "monthly_budget_micros": a.monthly_budget_micros,
        });
        let owner = (a.org_id.as_str(), a.owner_id.as_str());
        Notice::new(EventType::BudgetReached, run_id, owner, data, at)
    }

    /// Occurrences of `a` due at `missed` were recorded missed.
    pub fn occurrences_missed(
        a: &Automation,
        missed: &[DateTime<Utc>],
        at: DateTime<Utc>,
    ) -> Notice {
        let first = missed.iter().min().copied().unwrap_or(at);
        let last = missed.iter().max().copied().unwrap_or(at);
        let data = json!({
            "automation": Notice::automation(a),
            "missed": missed.len(),
            "first_scheduled_for": rfc3339(first),
            "last_scheduled_for": rfc3339(last),
        });
        let cause = format!("{}/{}", a.id, first.timestamp_micros());
        let owner = (a.org_id.as_str(), a.owner_id.as_str());
        Notice::new(EventType::OccurrencesMissed, &cause, owner, data, at)
    }

    /// A test message to `endpoint_id`, asked for by its owner.
    pub fn test(owner: &Principal, endpoint_id: &str, at: DateTime<Utc>) -> Notice {
        let cause = Uuid::new_v4().to_string();
        let data = json!({ "endpoint_id": endpoint_id });
        let owner = (owner.org_id.as_str(), owner.user_id.as_str());
        Notice::new(EventType::Test, &cause, owner, data, at)
    }
}

/// An owner's webhook endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookEndpoint {
    /// `ep_` and 32 hex digits.
    pub id: String,
    pub org_id: String,
    pub owner_id: String,
    pub url: String,
    pub description: String,
    pub created_at: DateTime<Utc>,
    /// When deliveries to it stopped, and why (a message undelivered for
    /// the whole retry window).
    pub disabled_at: Option<DateTime<Utc>>,
    pub disabled_reason: Option<String>,
}

pub fn new_endpoint_id() -> String {
    format!("ep_{}", Uuid::new_v4().simple())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_one_message_id() {
        let owner = Principal::new("o", "u");
        let at = DateTime::from_timestamp(1_800_000_000, 0).expect("instant");
        let a = Notice::test(&owner, "ep_1", at);
        let b = Notice::test(&owner, "ep_1", at);
        assert_ne!(a.id, b.id, "each test message is its own");
        assert!(a.id.starts_with("msg_") && a.id.len() == 36, "{}", a.id);
        let p: serde_json::Value = serde_json::from_str(&a.payload).expect("json");
        assert_eq!(p["type"], "webhook.test");
        assert_eq!(p["timestamp"], "2027-01-15T08:00:00.000Z");
        assert_eq!(p["data"]["endpoint_id"], "ep_1");
    }
}
