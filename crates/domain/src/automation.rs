//! Automations: a saved prompt plus a schedule, with a placement fixed by the
//! surface that created it, a state machine, and validation rules.

use chrono::{DateTime, Utc};

pub use crate::budget::{check_budget, month_of};
use crate::error_code::ErrorCode;
use crate::run::{RunBudget, RunState};
use crate::schedule::Schedule;
use crate::validation::{Limit, Violations, check_text};

/// Longest automation name (the contract: 1..=200 characters).
pub const NAME_LIMIT: Limit = Limit::Chars(200);
/// Longest prompt (the contract: 1..=32768 bytes).
pub const PROMPT_LIMIT: Limit = Limit::Bytes(32 * 1024);
/// Longest model id.
pub const MODEL_LIMIT: Limit = Limit::Chars(200);
/// Longest run-now idempotency key (the contract: 1..=200 characters).
pub const IDEMPOTENCY_KEY_LIMIT: Limit = Limit::Chars(200);
/// Longest runner name (the contract: 1..=200 characters).
pub const RUNNER_NAME_LIMIT: Limit = Limit::Chars(200);
/// Longest reason given when pausing (the contract: 0..=500 characters).
pub const PAUSE_REASON_LIMIT: Limit = Limit::Chars(500);
/// Consecutive failed or timed-out runs after which an automation pauses
/// itself, unless its owner chose otherwise (0 turns it off).
pub const DEFAULT_PAUSE_AFTER_FAILURES: u32 = 3;
/// The most `pause_after_failures` may be.
pub const MAX_PAUSE_AFTER_FAILURES: u32 = 1000;
/// The codes of a failure streak's newest runs an automation keeps.
pub const STREAK_CODES_KEPT: usize = 20;

/// A closed set of names: an enum with its stable names (`as_str`,
/// `FromStr`, `Display`) and `ALL` its values.
#[macro_export]
macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident => $s:literal,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vm])* $variant,)* }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            /// The stable storage and wire name.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $s,)* }
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($s => Ok($name::$variant),)*
                    _ => Err(format!("unknown {} {s:?}", stringify!($name))),
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

string_enum! {
    /// Where an automation's runs execute. Fixed at creation, never edited.
    Placement { Desktop => "desktop", Cloud => "cloud", }
}

string_enum! {
    /// The product surface an automation was created from.
    Surface { Desktop => "desktop", Web => "web", CloudChat => "cloud_chat", }
}

impl Surface {
    /// The creating surface alone decides placement.
    pub fn placement(self) -> Placement {
        match self {
            Surface::Desktop => Placement::Desktop,
            Surface::Web | Surface::CloudChat => Placement::Cloud,
        }
    }
}

string_enum! {
    /// The lifecycle state of an automation.
    AutomationState {
        Active => "active",
        Inactive => "inactive",
        NeedsAttention => "needs_attention",
        Archived => "archived",
    }
}

/// A transition a user can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateChange {
    Activate,
    Deactivate,
    Archive,
}

/// A state change that is not allowed from the current state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot {change:?} an automation that is {from}")]
pub struct IllegalStateChange {
    pub from: AutomationState,
    pub change: StateChange,
}

impl AutomationState {
    /// The state after `change`. Archived is final.
    pub fn apply(self, change: StateChange) -> Result<AutomationState, IllegalStateChange> {
        match (self, change) {
            (AutomationState::Archived, StateChange::Archive) => Ok(AutomationState::Archived),
            (AutomationState::Archived, _) => Err(IllegalStateChange { from: self, change }),
            (_, StateChange::Activate) => Ok(AutomationState::Active),
            (_, StateChange::Deactivate) => Ok(AutomationState::Inactive),
            (_, StateChange::Archive) => Ok(AutomationState::Archived),
        }
    }

    /// Only active automations produce occurrences.
    pub fn is_scheduling(self) -> bool {
        self == AutomationState::Active
    }
}

/// A stored automation.
#[derive(Debug, Clone, PartialEq)]
pub struct Automation {
    pub id: String,
    pub org_id: String,
    pub owner_id: String,
    pub name: String,
    pub prompt: String,
    pub model: String,
    pub placement: Placement,
    pub surface: Surface,
    pub schedule: Schedule,
    pub next_run_at: Option<DateTime<Utc>>,
    pub state: AutomationState,
    /// Why the automation needs its owner's attention, while it does.
    pub attention: Option<Attention>,
    /// The reason its owner gave when pausing it, while it is paused.
    pub pause_reason: Option<String>,
    /// After this many consecutive failed or timed-out runs it pauses
    /// itself (needs-attention, `failing_repeatedly`); 0 never.
    pub pause_after_failures: u32,
    /// Its consecutive failed or timed-out runs since its last success
    /// (or activation).
    pub failure_streak: FailureStreak,
    /// The most each of its runs may spend.
    pub budget: RunBudget,
    /// The most its runs may cost together in a calendar month of its
    /// schedule's zone (micro-units); `None` is no budget.
    pub monthly_budget_micros: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Bumped on every write; the public etag.
    pub version: i64,
}

/// Why an automation needs its owner's attention: the error that ended its
/// run, in the run's words.
#[derive(Debug, Clone, PartialEq)]
pub struct Attention {
    pub reason: ErrorCode,
    pub message: String,
}

/// An automation's consecutive failed or timed-out runs: how many, and the
/// error codes of the newest [`STREAK_CODES_KEPT`] of them, oldest first (a
/// run that ended without a code is named by its state).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailureStreak {
    pub runs: i64,
    pub codes: Vec<String>,
}

impl FailureStreak {
    fn extend(&mut self, code: &str) {
        self.runs += 1;
        self.codes.push(code.to_owned());
        let over = self.codes.len().saturating_sub(STREAK_CODES_KEPT);
        self.codes.drain(..over);
    }
}

impl Automation {
    /// The opaque etag clients send back on writes.
    pub fn etag(&self) -> String {
        format_etag(self.version)
    }

    /// What a run's end does to its automation; `true` when it changed it.
    ///
    /// A failed or timed-out run extends the failure streak, and a
    /// successful one ends it. An active automation needs attention after
    /// a run failed with a durable error of its owner's setup (the run's
    /// code is the reason), or once the streak reaches
    /// `pause_after_failures` (`failing_repeatedly`): its schedule pauses.
    /// A successful run of one that needs attention makes it active again,
    /// from its next occurrence after `now`. Cancelled runs change nothing.
    pub fn after_run(
        &mut self,
        outcome: RunState,
        code: Option<ErrorCode>,
        message: Option<&str>,
        now: DateTime<Utc>,
    ) -> bool {
        let before = self.clone();
        match outcome {
            RunState::Failed | RunState::TimedOut => {
                self.failure_streak
                    .extend(code.map_or(outcome.as_str(), ErrorCode::as_str));
                let durable =
                    outcome == RunState::Failed && code.is_some_and(ErrorCode::needs_attention);
                let streak = self.pause_after_failures > 0
                    && self.failure_streak.runs >= i64::from(self.pause_after_failures);
                if self.state == AutomationState::Active && (durable || streak) {
                    self.state = AutomationState::NeedsAttention;
                    self.next_run_at = None;
                    self.attention = Some(match code {
                        Some(code) if durable => Attention {
                            reason: code,
                            message: message.unwrap_or_default().to_owned(),
                        },
                        _ => Attention {
                            reason: ErrorCode::FailingRepeatedly,
                            message: format!(
                                "{} runs in a row ended failed or timed out ({})",
                                self.failure_streak.runs,
                                self.failure_streak.codes.join(", ")
                            ),
                        },
                    });
                }
            }
            RunState::Succeeded => {
                self.failure_streak = FailureStreak::default();
                // A spent month is not mended by a run that succeeded.
                if self.state == AutomationState::NeedsAttention && !self.paused_for_budget() {
                    self.state = AutomationState::Active;
                    self.attention = None;
                    self.next_run_at = self.schedule.next_after(now);
                }
            }
            _ => {}
        }
        *self != before
    }
}

/// The etag of a version.
pub fn format_etag(version: i64) -> String {
    format!("v{version}")
}

/// The version named by an etag; `None` when it is not one of ours.
pub fn parse_etag(etag: &str) -> Option<i64> {
    etag.strip_prefix('v')?.parse().ok()
}

/// A validated automation to create, for its owner.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAutomation {
    pub id: String,
    pub owner: crate::Principal,
    pub name: String,
    pub prompt: String,
    pub model: String,
    pub surface: Surface,
    pub schedule: Schedule,
    /// See [`Automation::pause_after_failures`].
    pub pause_after_failures: u32,
    pub budget: RunBudget,
    pub monthly_budget_micros: Option<i64>,
}

impl NewAutomation {
    pub fn placement(&self) -> Placement {
        self.surface.placement()
    }
}

/// A validated edit: each `Some` field replaces the stored one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AutomationPatch {
    pub name: Option<String>,
    pub prompt: Option<String>,
    pub model: Option<String>,
    pub schedule: Option<Schedule>,
    pub pause_after_failures: Option<u32>,
    /// Each `Some` replaces the cap (`Some(None)` removes it).
    pub max_cost_micros: Option<Option<i64>>,
    pub max_tokens: Option<Option<i64>>,
    pub monthly_budget_micros: Option<Option<i64>>,
    /// When set, the write happens only if the stored version still matches.
    pub expected_version: Option<i64>,
}

/// Checks the free-text fields of an automation; `prefix` is the request path
/// of the automation message (such as `automation`).
pub fn check_fields(
    v: &mut Violations,
    prefix: &str,
    name: Option<&str>,
    prompt: Option<&str>,
    model: Option<&str>,
) {
    if let Some(name) = name {
        check_text(v, &format!("{prefix}.name"), name, NAME_LIMIT);
    }
    if let Some(prompt) = prompt {
        check_text(v, &format!("{prefix}.prompt"), prompt, PROMPT_LIMIT);
    }
    if let Some(model) = model {
        check_text(v, &format!("{prefix}.model"), model, MODEL_LIMIT);
    }
}

/// Checks a `pause_after_failures` a request gives: 0 (never) up to
/// [`MAX_PAUSE_AFTER_FAILURES`].
pub fn check_pause_after_failures(v: &mut Violations, field: &str, value: i64) -> Option<u32> {
    match u32::try_from(value) {
        Ok(n) if n <= MAX_PAUSE_AFTER_FAILURES => Some(n),
        _ => {
            v.field(
                field,
                format!(
                    "must be between 0 (never pause) and {MAX_PAUSE_AFTER_FAILURES} consecutive failed runs"
                ),
            );
            None
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn surface_decides_placement() {
        assert_eq!(Surface::Desktop.placement(), Placement::Desktop);
        assert_eq!(Surface::Web.placement(), Placement::Cloud);
        assert_eq!(Surface::CloudChat.placement(), Placement::Cloud);
    }

    #[test]
    fn archived_is_final() {
        use AutomationState::*;
        assert!(Archived.apply(StateChange::Activate).is_err());
        assert!(Archived.apply(StateChange::Deactivate).is_err());
        assert_eq!(NeedsAttention.apply(StateChange::Activate), Ok(Active));
        assert_eq!(Active.apply(StateChange::Deactivate), Ok(Inactive));
        assert_eq!(Inactive.apply(StateChange::Archive), Ok(Archived));
    }

    #[test]
    fn etags_round_trip() {
        assert_eq!(parse_etag(&format_etag(42)), Some(42));
        assert_eq!(parse_etag("42"), None);
        assert_eq!(parse_etag("vx"), None);
    }

    pub(crate) fn automation(pause_after_failures: u32) -> Automation {
        let at = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        Automation {
            id: "a".into(),
            org_id: "o".into(),
            owner_id: "u".into(),
            name: "n".into(),
            prompt: "p".into(),
            model: "m".into(),
            placement: Placement::Cloud,
            surface: Surface::Web,
            schedule: Schedule::Daily {
                time: "09:00".parse().unwrap_or_else(|e| panic!("{e:?}")),
                zone: chrono_tz::Europe::Berlin,
            },
            next_run_at: Some(at),
            state: AutomationState::Active,
            attention: None,
            pause_reason: None,
            pause_after_failures,
            failure_streak: FailureStreak::default(),
            budget: RunBudget::default(),
            monthly_budget_micros: None,
            created_at: at,
            updated_at: at,
            version: 1,
        }
    }

    #[test]
    fn a_failure_streak_pauses_at_its_length_whatever_the_codes() {
        let now = Utc::now();
        let mut a = automation(3);
        assert!(a.after_run(RunState::Failed, Some(ErrorCode::ProviderError), None, now));
        assert!(a.after_run(
            RunState::TimedOut,
            Some(ErrorCode::DeadlineExceeded),
            None,
            now
        ));
        assert_eq!(a.state, AutomationState::Active);
        // A cancelled run neither extends nor ends the streak.
        assert!(!a.after_run(RunState::Cancelled, None, None, now));
        assert!(a.after_run(RunState::Failed, None, None, now));
        assert_eq!(a.state, AutomationState::NeedsAttention);
        assert_eq!(a.next_run_at, None);
        let attention = a
            .attention
            .clone()
            .unwrap_or_else(|| panic!("no attention"));
        assert_eq!(attention.reason, ErrorCode::FailingRepeatedly);
        assert!(
            attention
                .message
                .contains("provider_error, deadline_exceeded, failed")
        );
        assert_eq!(a.failure_streak.runs, 3);
        // A success ends it and resumes the schedule.
        assert!(a.after_run(RunState::Succeeded, None, None, now));
        assert_eq!(a.state, AutomationState::Active);
        assert_eq!(a.failure_streak, FailureStreak::default());
        assert!(a.next_run_at.is_some_and(|t| t > now));
        assert_eq!(a.attention, None);
    }

    #[test]
    fn zero_never_pauses_and_the_kept_codes_are_bounded() {
        let now = Utc::now();
        let mut a = automation(0);
        for _ in 0..STREAK_CODES_KEPT + 5 {
            a.after_run(RunState::Failed, Some(ErrorCode::ToolError), None, now);
        }
        assert_eq!(a.state, AutomationState::Active);
        assert_eq!(a.failure_streak.runs, (STREAK_CODES_KEPT + 5) as i64);
        assert_eq!(a.failure_streak.codes.len(), STREAK_CODES_KEPT);
    }

    #[test]
    fn a_durable_code_pauses_at_once_with_its_own_reason() {
        let now = Utc::now();
        let mut a = automation(3);
        a.after_run(
            RunState::Failed,
            Some(ErrorCode::RuntimeMissing),
            Some("no worker"),
            now,
        );
        assert_eq!(a.state, AutomationState::NeedsAttention);
        let attention = a
            .attention
            .clone()
            .unwrap_or_else(|| panic!("no attention"));
        assert_eq!(attention.reason, ErrorCode::RuntimeMissing);
        assert_eq!(attention.message, "no worker");
        // An inactive automation counts its streak but is not moved.
        let mut b = automation(1);
        b.state = AutomationState::Inactive;
        b.next_run_at = None;
        b.after_run(RunState::Failed, None, None, now);
        assert_eq!(b.state, AutomationState::Inactive);
        assert_eq!(b.failure_streak.runs, 1);
    }

    #[test]
    fn pause_after_failures_is_bounded() {
        let mut v = Violations::default();
        assert_eq!(check_pause_after_failures(&mut v, "f", 0), Some(0));
        assert_eq!(check_pause_after_failures(&mut v, "f", 1000), Some(1000));
        assert!(v.is_empty());
        assert_eq!(check_pause_after_failures(&mut v, "f", -1), None);
        assert_eq!(check_pause_after_failures(&mut v, "f", 1001), None);
        assert_eq!(v.iter().count(), 2);
    }
}
