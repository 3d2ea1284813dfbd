//! Automations: a saved prompt plus a schedule, with a placement fixed by the
//! surface that created it, a state machine, and validation rules.

use chrono::{DateTime, Utc};

use crate::error_code::ErrorCode;
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

impl Automation {
    /// The opaque etag clients send back on writes.
    pub fn etag(&self) -> String {
        format_etag(self.version)
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

#[cfg(test)]
mod tests {
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
}
