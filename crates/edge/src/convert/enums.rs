//! Enumerations: placement, surface, automation and run states, weekdays.

use automesh_domain::{AutomationState, Placement, RunState, Surface};
use automesh_proto::v1 as pb;
use chrono::Weekday;

#[allow(unused_imports)]
use super::*;

pub fn placement_to_pb(p: Placement) -> pb::Placement {
    match p {
        Placement::Desktop => pb::Placement::Desktop,
        Placement::Cloud => pb::Placement::Cloud,
    }
}

pub fn placement_from_pb(p: i32) -> Option<Placement> {
    match pb::Placement::try_from(p).ok()? {
        pb::Placement::Desktop => Some(Placement::Desktop),
        pb::Placement::Cloud => Some(Placement::Cloud),
        pb::Placement::Unspecified => None,
    }
}

pub fn surface_to_pb(s: Surface) -> pb::Surface {
    match s {
        Surface::Desktop => pb::Surface::Desktop,
        Surface::Web => pb::Surface::Web,
        Surface::CloudChat => pb::Surface::CloudChat,
    }
}

pub fn surface_from_pb(s: i32) -> Option<Surface> {
    match pb::Surface::try_from(s).ok()? {
        pb::Surface::Desktop => Some(Surface::Desktop),
        pb::Surface::Web => Some(Surface::Web),
        pb::Surface::CloudChat => Some(Surface::CloudChat),
        pb::Surface::Unspecified => None,
    }
}

pub fn automation_state_to_pb(s: AutomationState) -> pb::AutomationState {
    match s {
        AutomationState::Active => pb::AutomationState::Active,
        AutomationState::Inactive => pb::AutomationState::Inactive,
        AutomationState::NeedsAttention => pb::AutomationState::NeedsAttention,
        AutomationState::Archived => pb::AutomationState::Archived,
    }
}

pub fn run_state_to_pb(s: RunState) -> pb::RunState {
    match s {
        RunState::Pending => pb::RunState::Pending,
        RunState::Waking => pb::RunState::Waking,
        RunState::Admitted => pb::RunState::Admitted,
        RunState::Running => pb::RunState::Running,
        RunState::Succeeded => pb::RunState::Succeeded,
        RunState::Failed => pb::RunState::Failed,
        RunState::TimedOut => pb::RunState::TimedOut,
        RunState::Cancelled => pb::RunState::Cancelled,
        RunState::Skipped => pb::RunState::Skipped,
        RunState::Missed => pb::RunState::Missed,
    }
}

pub fn run_state_from_pb(s: i32) -> Option<RunState> {
    Some(match pb::RunState::try_from(s).ok()? {
        pb::RunState::Unspecified => return None,
        pb::RunState::Pending => RunState::Pending,
        pb::RunState::Waking => RunState::Waking,
        pb::RunState::Admitted => RunState::Admitted,
        pb::RunState::Running => RunState::Running,
        pb::RunState::Succeeded => RunState::Succeeded,
        pb::RunState::Failed => RunState::Failed,
        pb::RunState::TimedOut => RunState::TimedOut,
        pb::RunState::Cancelled => RunState::Cancelled,
        pb::RunState::Skipped => RunState::Skipped,
        pb::RunState::Missed => RunState::Missed,
    })
}

pub(crate) fn weekday_from_pb(d: i32) -> Option<Weekday> {
    match pb::DayOfWeek::try_from(d).ok()? {
        pb::DayOfWeek::Unspecified => None,
        pb::DayOfWeek::Monday => Some(Weekday::Mon),
        pb::DayOfWeek::Tuesday => Some(Weekday::Tue),
        pb::DayOfWeek::Wednesday => Some(Weekday::Wed),
        pb::DayOfWeek::Thursday => Some(Weekday::Thu),
        pb::DayOfWeek::Friday => Some(Weekday::Fri),
        pb::DayOfWeek::Saturday => Some(Weekday::Sat),
        pb::DayOfWeek::Sunday => Some(Weekday::Sun),
    }
}

pub(crate) fn weekday_to_pb(d: Weekday) -> pb::DayOfWeek {
    match d {
        Weekday::Mon => pb::DayOfWeek::Monday,
        Weekday::Tue => pb::DayOfWeek::Tuesday,
        Weekday::Wed => pb::DayOfWeek::Wednesday,
        Weekday::Thu => pb::DayOfWeek::Thursday,
        Weekday::Fri => pb::DayOfWeek::Friday,
        Weekday::Sat => pb::DayOfWeek::Saturday,
        Weekday::Sun => pb::DayOfWeek::Sunday,
    }
}

/// An error code's wire name; empty for none.
pub fn code_name(code: Option<automesh_domain::ErrorCode>) -> String {
    code.map(|c| c.as_str().to_owned()).unwrap_or_default()
}
