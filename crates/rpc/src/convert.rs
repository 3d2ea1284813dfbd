//! Conversions between protobuf messages and domain types, and the request
//! validation that comes with them. Handlers call these at the edge, so
//! protobuf types never reach the store.

use automesh_domain::automation::{
    AutomationPatch, IDEMPOTENCY_KEY_LIMIT, check_fields, parse_etag,
};
use automesh_domain::schedule::parse_time_zone;
use automesh_domain::{
    Automation, AutomationState, Placement, Principal, Receipt, Run, RunEvent, RunEventPayload,
    RunState, RunTrigger, Schedule, Surface, TimeOfDay, Usage, Violations, WeekdaySet,
};
use automesh_proto::internal::v1 as ipb;
use automesh_proto::v1 as pb;
use chrono::{DateTime, Utc, Weekday};
use tonic::Status;

/// Largest page any listing returns.
pub const MAX_PAGE_SIZE: u32 = 1000;

// ---- principals ----

/// The caller of an internal request; a missing or empty one is refused.
pub fn principal(caller: Option<&ipb::Caller>) -> Result<Principal, Status> {
    match caller {
        Some(c) if !c.organization_id.is_empty() && !c.user_id.is_empty() => {
            Ok(Principal::new(&c.organization_id, &c.user_id))
        }
        _ => Err(Status::unauthenticated("internal request without a caller")),
    }
}

pub fn caller(p: &Principal) -> ipb::Caller {
    ipb::Caller {
        organization_id: p.org_id.clone(),
        user_id: p.user_id.clone(),
    }
}

// ---- time ----

/// The first and last second a `google.protobuf.Timestamp` may hold
/// (0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z): clients reject whole
/// messages carrying anything outside.
pub const TIMESTAMP_MIN_SECONDS: i64 = -62_135_596_800;
pub const TIMESTAMP_MAX_SECONDS: i64 = 253_402_300_799;

/// An instant as a protobuf Timestamp, clamped into the Timestamp range so
/// that no message ever carries an invalid one (what is stored is checked at
/// write time; this is the last line).
pub fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    let seconds = t.timestamp();
    if seconds > TIMESTAMP_MAX_SECONDS {
        return prost_types::Timestamp {
            seconds: TIMESTAMP_MAX_SECONDS,
            nanos: 999_999_999,
        };
    }
    if seconds < TIMESTAMP_MIN_SECONDS {
        return prost_types::Timestamp {
            seconds: TIMESTAMP_MIN_SECONDS,
            nanos: 0,
        };
    }
    prost_types::Timestamp {
        seconds,
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

/// A protobuf Timestamp as an instant; `None` outside the Timestamp range or
/// with nanos outside 0..=999,999,999 (an invalid Timestamp).
pub fn from_timestamp(ts: &prost_types::Timestamp) -> Option<DateTime<Utc>> {
    if !(TIMESTAMP_MIN_SECONDS..=TIMESTAMP_MAX_SECONDS).contains(&ts.seconds)
        || !(0..=999_999_999).contains(&ts.nanos)
    {
        return None;
    }
    u32::try_from(ts.nanos)
        .ok()
        .and_then(|n| DateTime::from_timestamp(ts.seconds, n))
}

pub fn duration_from_micros(us: i64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: us.div_euclid(1_000_000),
        nanos: (us.rem_euclid(1_000_000) * 1000) as i32,
    }
}

// ---- enums ----

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

fn weekday_from_pb(d: i32) -> Option<Weekday> {
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

fn weekday_to_pb(d: Weekday) -> pb::DayOfWeek {
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

// ---- schedules ----

fn time_of_day(t: Option<&pb::TimeOfDay>, field: &str, v: &mut Violations) -> Option<TimeOfDay> {
    let Some(t) = t else {
        v.field(field, "required");
        return None;
    };
    let parsed = u32::try_from(t.hours)
        .ok()
        .zip(u32::try_from(t.minutes).ok())
        .and_then(|(h, m)| TimeOfDay::new(h, m));
    if parsed.is_none() {
        v.field(field, "hours must be 0..=23 and minutes 0..=59");
    }
    parsed
}

fn time_zone(name: &str, field: &str, v: &mut Violations) -> Option<chrono_tz::Tz> {
    let zone = parse_time_zone(name);
    if zone.is_none() {
        if name.is_empty() {
            v.field(field, "required (an IANA time zone such as Europe/Paris)");
        } else {
            v.field(field, format!("unknown time zone {name:?}"));
        }
    }
    zone
}

/// Parses a schedule; `field` is its request path (such as
/// `automation.schedule`). A `once` instant must be after `now`.
pub fn schedule_from_pb(
    s: Option<&pb::Schedule>,
    field: &str,
    now: DateTime<Utc>,
    v: &mut Violations,
) -> Option<Schedule> {
    use pb::schedule::Kind;
    let Some(kind) = s.and_then(|s| s.kind.as_ref()) else {
        v.field(field, "required: one of once, daily, weekly");
        return None;
    };
    let before = v.iter().count();
    let schedule = match kind {
        Kind::Once(o) => match o.at.as_ref() {
            None => {
                v.field(format!("{field}.once.at"), "required");
                None
            }
            Some(ts) => match from_timestamp(ts) {
                Some(at) => Some(Schedule::Once { at }),
                None => {
                    v.field(
                        format!("{field}.once.at"),
                        "not a valid timestamp: it must lie between \
                         0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z",
                    );
                    None
                }
            },
        },
        Kind::Daily(d) => {
            let time = time_of_day(
                d.time_of_day.as_ref(),
                &format!("{field}.daily.time_of_day"),
                v,
            );
            let zone = time_zone(&d.time_zone, &format!("{field}.daily.time_zone"), v);
            time.zip(zone)
                .map(|(time, zone)| Schedule::Daily { time, zone })
        }
        Kind::Weekly(w) => {
            let days_field = format!("{field}.weekly.days");
            let days: Vec<Option<Weekday>> = w.days.iter().map(|d| weekday_from_pb(*d)).collect();
            let set = if days.is_empty() {
                v.field(&days_field, "at least one day is required");
                None
            } else if days.iter().any(Option::is_none) {
                v.field(&days_field, "every day must be MONDAY..SUNDAY");
                None
            } else {
                WeekdaySet::new(days.into_iter().flatten())
            };
            let time = time_of_day(
                w.time_of_day.as_ref(),
                &format!("{field}.weekly.time_of_day"),
                v,
            );
            let zone = time_zone(&w.time_zone, &format!("{field}.weekly.time_zone"), v);
            match (set, time, zone) {
                (Some(days), Some(time), Some(zone)) => Some(Schedule::Weekly { days, time, zone }),
                _ => None,
            }
        }
    };
    if let Some(s) = &schedule {
        s.check_for_write(now, field, v);
    }
    if v.iter().count() > before {
        None
    } else {
        schedule
    }
}

pub fn schedule_to_pb(s: &Schedule) -> pb::Schedule {
    use pb::schedule::Kind;
    let tod = |t: &TimeOfDay| pb::TimeOfDay {
        hours: t.hour() as i32,
        minutes: t.minute() as i32,
    };
    pb::Schedule {
        kind: Some(match s {
            Schedule::Once { at } => Kind::Once(pb::OnceSchedule {
                at: Some(timestamp(*at)),
            }),
            Schedule::Daily { time, zone } => Kind::Daily(pb::DailySchedule {
                time_of_day: Some(tod(time)),
                time_zone: zone.name().to_owned(),
            }),
            Schedule::Weekly { days, time, zone } => Kind::Weekly(pb::WeeklySchedule {
                days: days
                    .days()
                    .into_iter()
                    .map(|d| weekday_to_pb(d) as i32)
                    .collect(),
                time_of_day: Some(tod(time)),
                time_zone: zone.name().to_owned(),
            }),
        }),
    }
}

// ---- automations ----

pub fn automation_to_pb(a: &Automation) -> pb::Automation {
    pb::Automation {
        id: a.id.clone(),
        organization_id: a.org_id.clone(),
        owner_id: a.owner_id.clone(),
        name: a.name.clone(),
        prompt: a.prompt.clone(),
        model: a.model.clone(),
        placement: placement_to_pb(a.placement) as i32,
        schedule: Some(schedule_to_pb(&a.schedule)),
        state: automation_state_to_pb(a.state) as i32,
        attention_reason: a
            .attention_reason
            .map(|c| c.as_str().to_owned())
            .unwrap_or_default(),
        attention_message: a.attention_message.clone().unwrap_or_default(),
        etag: a.etag(),
        next_run_time: a.next_run_at.map(timestamp),
        create_time: Some(timestamp(a.created_at)),
        update_time: Some(timestamp(a.updated_at)),
        surface: surface_to_pb(a.surface) as i32,
    }
}

/// A validated creation request, before the model and the owner's cloud
/// worker are checked against the catalogue and the lifecycle service.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateInput {
    pub name: String,
    pub prompt: String,
    pub model: String,
    pub surface: Surface,
    pub schedule: Schedule,
}

impl CreateInput {
    pub fn placement(&self) -> Placement {
        self.surface.placement()
    }
}

/// Validates `CreateAutomation`'s automation and surface.
pub fn parse_create(
    automation: Option<&pb::Automation>,
    surface: i32,
    now: DateTime<Utc>,
) -> Result<CreateInput, Violations> {
    let mut v = Violations::default();
    let surface = surface_from_pb(surface);
    if surface.is_none() {
        v.field(
            "surface",
            "required: one of SURFACE_DESKTOP, SURFACE_WEB, SURFACE_CLOUD_CHAT",
        );
    }
    let Some(a) = automation else {
        v.field("automation", "required");
        return Err(v);
    };
    check_fields(
        &mut v,
        "automation",
        Some(&a.name),
        Some(&a.prompt),
        Some(&a.model),
    );
    if let (Some(surface), Some(claimed)) = (surface, placement_from_pb(a.placement))
        && claimed != surface.placement()
    {
        v.field(
            "automation.placement",
            format!(
                "placement is decided by the creating surface ({}), which places it {}",
                surface,
                surface.placement()
            ),
        );
    }
    let schedule = schedule_from_pb(a.schedule.as_ref(), "automation.schedule", now, &mut v);
    match (surface, schedule) {
        (Some(surface), Some(schedule)) if v.is_empty() => Ok(CreateInput {
            name: a.name.trim().to_owned(),
            prompt: a.prompt.clone(),
            model: a.model.trim().to_owned(),
            surface,
            schedule,
        }),
        _ => Err(v),
    }
}

/// The fields `UpdateAutomation` may change.
pub const UPDATABLE_PATHS: &[&str] = &["name", "prompt", "model", "schedule"];

/// A validated update: the automation id, the patch, and a placement the
/// client claimed (which must equal the stored one).
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateInput {
    pub id: String,
    pub patch: AutomationPatch,
    pub claimed_placement: Option<Placement>,
}

/// Validates `UpdateAutomation`.
pub fn parse_update(
    req: &pb::UpdateAutomationRequest,
    now: DateTime<Utc>,
) -> Result<UpdateInput, Violations> {
    let mut v = Violations::default();
    let Some(a) = req.automation.as_ref() else {
        v.field("automation", "required");
        return Err(v);
    };
    if a.id.is_empty() {
        v.field("automation.id", "required");
    }
    automesh_domain::validation::check_no_nul(&mut v, "automation.id", &a.id);
    let paths: Vec<&str> = match &req.update_mask {
        Some(mask) if !mask.paths.is_empty() => mask.paths.iter().map(String::as_str).collect(),
        _ => UPDATABLE_PATHS.to_vec(),
    };
    let mut patch = AutomationPatch::default();
    for path in &paths {
        match *path {
            "name" => patch.name = Some(a.name.trim().to_owned()),
            "prompt" => patch.prompt = Some(a.prompt.clone()),
            "model" => patch.model = Some(a.model.trim().to_owned()),
            "schedule" => {
                patch.schedule =
                    schedule_from_pb(a.schedule.as_ref(), "automation.schedule", now, &mut v)
            }
            "placement" => v.field(
                "update_mask",
                "placement cannot be changed: create a new automation from the other surface",
            ),
            other => v.field(
                "update_mask",
                format!(
                    "unknown or read-only field {other:?}; updatable: name, prompt, model, schedule"
                ),
            ),
        }
    }
    check_fields(
        &mut v,
        "automation",
        patch.name.as_deref(),
        patch.prompt.as_deref(),
        patch.model.as_deref(),
    );
    if !a.etag.is_empty() {
        match parse_etag(&a.etag) {
            Some(version) => patch.expected_version = Some(version),
            None => v.field("automation.etag", "not an etag issued by this service"),
        }
    }
    v.into_result(UpdateInput {
        id: a.id.clone(),
        patch,
        claimed_placement: placement_from_pb(a.placement),
    })
}

/// Validates an optional etag of a state-change request.
pub fn parse_optional_etag(etag: &str, field: &str) -> Result<Option<i64>, Violations> {
    if etag.is_empty() {
        return Ok(None);
    }
    let mut v = Violations::default();
    let version = parse_etag(etag);
    if version.is_none() {
        v.field(field, "not an etag issued by this service");
    }
    v.into_result(version)
}

/// Validates a required id field.
pub fn require_id(id: &str, field: &str) -> Result<(), Violations> {
    let mut v = Violations::default();
    if id.is_empty() {
        v.field(field, "required");
    } else if id.len() > 200 {
        v.field(field, "must be at most 200 bytes");
    }
    automesh_domain::validation::check_no_nul(&mut v, field, id);
    v.into_result(())
}

/// Validates optional text fields that reach the database as they are
/// (filters, page tokens): no NUL.
pub fn check_optional_text(fields: &[(&str, &str)]) -> Result<(), Violations> {
    let mut v = Violations::default();
    for (field, value) in fields {
        automesh_domain::validation::check_no_nul(&mut v, field, value);
    }
    v.into_result(())
}

/// Validates `RunAutomationNow`.
pub fn parse_run_now(req: &pb::RunAutomationNowRequest) -> Result<(), Violations> {
    let mut v = Violations::default();
    if req.id.is_empty() {
        v.field("id", "required");
    }
    automesh_domain::validation::check_no_nul(&mut v, "id", &req.id);
    if req.idempotency_key.trim().is_empty() {
        v.field(
            "idempotency_key",
            "required: the same key returns the same run",
        );
    } else {
        automesh_domain::validation::check_text(
            &mut v,
            "idempotency_key",
            &req.idempotency_key,
            IDEMPOTENCY_KEY_LIMIT,
        );
    }
    v.into_result(())
}

/// Validates a page size: negative is an error, 0 is `default`, more than
/// [`MAX_PAGE_SIZE`] is capped.
pub fn page_size(size: i32, default: u32, field: &str) -> Result<u32, Violations> {
    let mut v = Violations::default();
    if size < 0 {
        v.field(field, "must not be negative");
    }
    v.into_result(match size {
        0 => default,
        n => (n as u32).min(MAX_PAGE_SIZE),
    })
}

// ---- runs ----

pub fn run_to_pb(r: &Run, receipt: Option<&Receipt>) -> pb::Run {
    pb::Run {
        id: r.id.clone(),
        automation_id: r.automation_id.clone(),
        organization_id: r.org_id.clone(),
        owner_id: r.owner_id.clone(),
        placement: placement_to_pb(r.placement) as i32,
        trigger: match r.trigger {
            RunTrigger::Schedule => pb::RunTrigger::Schedule,
            RunTrigger::Manual => pb::RunTrigger::Manual,
        } as i32,
        scheduled_time: r.scheduled_for.map(timestamp),
        state: run_state_to_pb(r.state) as i32,
        error_code: r
            .error_code
            .map(|c| c.as_str().to_owned())
            .unwrap_or_default(),
        error_message: r.error_message.clone().unwrap_or_default(),
        deadline_time: Some(timestamp(r.deadline_at)),
        create_time: Some(timestamp(r.created_at)),
        update_time: Some(timestamp(r.updated_at)),
        receipt: receipt.map(receipt_to_pb),
        trace_id: r.trace_id().unwrap_or_default().to_owned(),
    }
}

pub fn usage_to_pb(u: &Usage) -> pb::Usage {
    pb::Usage {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        cost_micros: u.cost_micros,
    }
}

pub fn receipt_to_pb(r: &Receipt) -> pb::Receipt {
    let thread = [&r.worker_id, &r.workspace_id, &r.thread_id, &r.message_id]
        .iter()
        .any(|f| f.is_some())
        .then(|| pb::NativeThread {
            worker_id: r.worker_id.clone().unwrap_or_default(),
            workspace_id: r.workspace_id.clone().unwrap_or_default(),
            thread_id: r.thread_id.clone().unwrap_or_default(),
            message_id: r.message_id.clone().unwrap_or_default(),
        });
    pb::Receipt {
        outcome: run_state_to_pb(r.outcome) as i32,
        error_code: r
            .error_code
            .map(|c| c.as_str().to_owned())
            .unwrap_or_default(),
        error_message: r.error_message.clone().unwrap_or_default(),
        placement: placement_to_pb(r.placement) as i32,
        engine: r.engine.clone().unwrap_or_default(),
        queued_duration: Some(duration_from_micros(r.queued_micros)),
        wake_duration: Some(duration_from_micros(r.wake_micros)),
        admission_duration: Some(duration_from_micros(r.admission_micros)),
        execution_duration: Some(duration_from_micros(r.execution_micros)),
        usage: Some(usage_to_pb(&r.usage)),
        native_thread: thread,
        create_time: Some(timestamp(r.created_at)),
        model: r.model.clone().unwrap_or_default(),
        provider_model: r.provider_model.clone().unwrap_or_default(),
        price: r.price.map(|p| pb::Price {
            input_micros_per_million_tokens: p.input_micros_per_million_tokens,
            output_micros_per_million_tokens: p.output_micros_per_million_tokens,
        }),
    }
}

pub fn event_to_pb(e: &RunEvent) -> pb::RunEvent {
    use pb::run_event::Payload;
    let payload = match &e.payload {
        RunEventPayload::AssistantText { text } => {
            Payload::AssistantText(pb::AssistantText { text: text.clone() })
        }
        RunEventPayload::ToolCall {
            call_id,
            tool,
            input_json,
        } => Payload::ToolCall(pb::ToolCall {
            call_id: call_id.clone(),
            tool: tool.clone(),
            input_json: input_json.clone(),
        }),
        RunEventPayload::ToolResult {
            call_id,
            tool,
            output,
            is_error,
        } => Payload::ToolResult(pb::ToolResult {
            call_id: call_id.clone(),
            tool: tool.clone(),
            output: output.clone(),
            is_error: *is_error,
        }),
        RunEventPayload::PermissionPrompt {
            permission_id,
            permission,
            patterns,
            reply,
        } => Payload::PermissionPrompt(pb::PermissionPrompt {
            permission_id: permission_id.clone(),
            permission: permission.clone(),
            patterns: patterns.clone(),
            reply: reply.clone().unwrap_or_default(),
        }),
        RunEventPayload::Usage(u) => Payload::Usage(usage_to_pb(u)),
        RunEventPayload::StatusChange {
            state,
            error_code,
            message,
        } => Payload::StatusChange(pb::StatusChange {
            state: state
                .parse::<RunState>()
                .map(|s| run_state_to_pb(s) as i32)
                .unwrap_or_default(),
            error_code: error_code.clone().unwrap_or_default(),
            message: message.clone().unwrap_or_default(),
        }),
    };
    pb::RunEvent {
        run_id: e.run_id.clone(),
        sequence: e.sequence,
        event_id: e.event_id.clone(),
        create_time: Some(timestamp(e.created_at)),
        payload: Some(payload),
    }
}

/// What an event means, from its protobuf form; `None` for an empty payload.
pub fn event_payload_from_pb(e: &pb::RunEvent) -> Option<RunEventPayload> {
    use pb::run_event::Payload;
    Some(match e.payload.as_ref()? {
        Payload::AssistantText(t) => RunEventPayload::AssistantText {
            text: t.text.clone(),
        },
        Payload::ToolCall(c) => RunEventPayload::ToolCall {
            call_id: c.call_id.clone(),
            tool: c.tool.clone(),
            input_json: c.input_json.clone(),
        },
        Payload::ToolResult(r) => RunEventPayload::ToolResult {
            call_id: r.call_id.clone(),
            tool: r.tool.clone(),
            output: r.output.clone(),
            is_error: r.is_error,
        },
        Payload::PermissionPrompt(p) => RunEventPayload::PermissionPrompt {
            permission_id: p.permission_id.clone(),
            permission: p.permission.clone(),
            patterns: p.patterns.clone(),
            reply: (!p.reply.is_empty()).then(|| p.reply.clone()),
        },
        Payload::Usage(u) => RunEventPayload::Usage(Usage {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            cost_micros: u.cost_micros,
        }),
        Payload::StatusChange(s) => RunEventPayload::StatusChange {
            state: run_state_from_pb(s.state)
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            error_code: (!s.error_code.is_empty()).then(|| s.error_code.clone()),
            message: (!s.message.is_empty()).then(|| s.message.clone()),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_never_leave_the_protobuf_range() {
        use chrono::TimeZone;
        let far = Utc
            .with_ymd_and_hms(10_000, 1, 1, 0, 0, 0)
            .single()
            .expect("instant");
        let ts = timestamp(far);
        assert_eq!((ts.seconds, ts.nanos), (TIMESTAMP_MAX_SECONDS, 999_999_999));
        let early = Utc
            .with_ymd_and_hms(-5, 1, 1, 0, 0, 0)
            .single()
            .expect("instant");
        assert_eq!(timestamp(early).seconds, TIMESTAMP_MIN_SECONDS);
        let now = Utc::now();
        assert_eq!(from_timestamp(&timestamp(now)), Some(now));
        for bad in [
            prost_types::Timestamp {
                seconds: TIMESTAMP_MAX_SECONDS + 1,
                nanos: 0,
            },
            prost_types::Timestamp {
                seconds: TIMESTAMP_MIN_SECONDS - 1,
                nanos: 0,
            },
            prost_types::Timestamp {
                seconds: 0,
                nanos: -1,
            },
            prost_types::Timestamp {
                seconds: 0,
                nanos: 1_000_000_000,
            },
        ] {
            assert_eq!(from_timestamp(&bad), None, "{bad:?}");
        }
    }
}
