//! Runs, receipts, usage and events.

use automesh_domain::{Receipt, Run, RunEvent, RunEventPayload, RunState, RunTrigger, Usage};
use automesh_proto::v1 as pb;
use chrono::{DateTime, Utc};

#[allow(unused_imports)]
use super::*;

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
        error_code: code_name(r.error_code),
        error_message: r.error_message.clone().unwrap_or_default(),
        deadline_time: Some(timestamp(r.deadline_at)),
        create_time: Some(timestamp(r.created_at)),
        update_time: Some(timestamp(r.updated_at)),
        receipt: receipt.map(receipt_to_pb),
        trace_id: r.trace_id().unwrap_or_default().to_owned(),
    }
}

/// Usage on the wire; the one conversion each way.
pub fn usage_to_pb(u: &Usage) -> pb::Usage {
    pb::Usage {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        cost_micros: u.cost_micros,
    }
}

pub fn usage_from_pb(u: &pb::Usage) -> Usage {
    Usage {
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
        error_code: code_name(r.error_code),
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
        price: r.price.map(price_to_pb),
        max_cost_micros: r.budget.max_cost_micros,
        max_tokens: r.budget.max_tokens,
    }
}

pub fn price_to_pb(p: automesh_domain::Price) -> pb::Price {
    pb::Price {
        input_micros_per_million_tokens: p.input_micros_per_million_tokens,
        output_micros_per_million_tokens: p.output_micros_per_million_tokens,
    }
}

/// A budget per run and the price it is counted at, as executors and
/// engines take them (`None` when it caps nothing).
pub fn run_budget_to_pb(
    budget: automesh_domain::RunBudget,
    price: Option<automesh_domain::Price>,
) -> Option<pb::RunBudget> {
    budget.is_set().then(|| pb::RunBudget {
        max_cost_micros: budget.max_cost_micros,
        max_tokens: budget.max_tokens,
        price: price.map(price_to_pb),
    })
}

/// A budget per run as an executor received it, and its price.
pub fn run_budget_from_pb(
    budget: Option<&pb::RunBudget>,
) -> (automesh_domain::RunBudget, Option<automesh_domain::Price>) {
    let Some(b) = budget else {
        return Default::default();
    };
    let price = b.price.as_ref().map(|p| automesh_domain::Price {
        input_micros_per_million_tokens: p.input_micros_per_million_tokens,
        output_micros_per_million_tokens: p.output_micros_per_million_tokens,
    });
    let budget = automesh_domain::RunBudget {
        max_cost_micros: b.max_cost_micros,
        max_tokens: b.max_tokens,
    };
    (budget, price)
}

/// An event's payload in its protobuf form.
pub fn payload_to_pb(payload: &RunEventPayload) -> pb::run_event::Payload {
    use pb::run_event::Payload;
    match payload {
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
    }
}

pub fn event_to_pb(e: &RunEvent) -> pb::RunEvent {
    let payload = payload_to_pb(&e.payload);
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
        Payload::Usage(u) => RunEventPayload::Usage(usage_from_pb(u)),
        Payload::StatusChange(s) => RunEventPayload::StatusChange {
            state: run_state_from_pb(s.state)
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            error_code: (!s.error_code.is_empty()).then(|| s.error_code.clone()),
            message: (!s.message.is_empty()).then(|| s.message.clone()),
        },
    })
}

/// What a `ListRunsRequest` narrows the list to, besides its automation:
/// the states (all when none) and the creation window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunListFilter {
    pub states: Vec<RunState>,
    pub error_codes: Vec<automesh_domain::ErrorCode>,
    pub created_after: Option<chrono::DateTime<chrono::Utc>>,
    pub created_before: Option<chrono::DateTime<chrono::Utc>>,
}

/// Reads a list request's filters, naming each bad field: an unknown or
/// unspecified state, a timestamp out of range, an empty window.
pub fn run_list_filter(
    r: &pb::ListRunsRequest,
) -> Result<RunListFilter, automesh_domain::Violations> {
    let mut v = automesh_domain::Violations::default();
    let mut states = Vec::with_capacity(r.states.len());
    for (i, s) in r.states.iter().enumerate() {
        match run_state_from_pb(*s) {
            Some(state) => states.push(state),
            None => v.field(format!("states[{i}]"), format!("unknown run state {s}")),
        }
    }
    let mut error_codes = Vec::with_capacity(r.error_codes.len());
    for (i, c) in r.error_codes.iter().enumerate() {
        match c.parse::<automesh_domain::ErrorCode>() {
            Ok(code) => error_codes.push(code),
            Err(_) => v.field(
                format!("error_codes[{i}]"),
                format!("unknown error code {c:?}: see docs/error-codes.md"),
            ),
        }
    }
    let mut instant = |field: &str, t: &Option<prost_types::Timestamp>| {
        let t = t.as_ref()?;
        let at = from_timestamp(t);
        if at.is_none() {
            v.field(field, "is not a valid timestamp");
        }
        at
    };
    let created_after = instant("created_after", &r.created_after);
    let created_before = instant("created_before", &r.created_before);
    if let (Some(a), Some(b)) = (created_after, created_before)
        && a >= b
    {
        v.field("created_before", "must be later than created_after");
    }
    v.into_result(RunListFilter {
        states,
        error_codes,
        created_after,
        created_before,
    })
}

/// The longest period `SummarizeUsage` sums.
pub const USAGE_PERIOD_DAYS: i64 = 400;

/// A validated `SummarizeUsage` request.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageQuery {
    pub automation_id: Option<String>,
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub zone: chrono_tz::Tz,
}

/// Validates `SummarizeUsage`: both instants required, in order, at most
/// [`USAGE_PERIOD_DAYS`] apart; the zone an IANA name or empty (UTC).
pub fn parse_usage_query(
    r: &pb::SummarizeUsageRequest,
) -> Result<UsageQuery, automesh_domain::Violations> {
    let mut v = automesh_domain::Violations::default();
    let mut instant = |field: &str, t: &Option<prost_types::Timestamp>| {
        let Some(t) = t.as_ref() else {
            v.field(field, "required");
            return None;
        };
        let at = from_timestamp(t);
        if at.is_none() {
            v.field(field, "is not a valid timestamp");
        }
        at
    };
    let start = instant("start_time", &r.start_time);
    let end = instant("end_time", &r.end_time);
    if let (Some(a), Some(b)) = (start, end) {
        if a >= b {
            v.field("end_time", "must be later than start_time");
        } else if b - a > chrono::Duration::days(USAGE_PERIOD_DAYS) {
            v.field(
                "end_time",
                format!("must be at most {USAGE_PERIOD_DAYS} days after start_time"),
            );
        }
    }
    let zone = if r.time_zone.is_empty() {
        Some(chrono_tz::UTC)
    } else {
        let zone = automesh_domain::schedule::parse_time_zone(&r.time_zone);
        if zone.is_none() {
            v.field("time_zone", format!("unknown time zone {:?}", r.time_zone));
        }
        zone
    };
    if r.automation_id.len() > 200 {
        v.field("automation_id", "must be at most 200 bytes");
    }
    automesh_domain::validation::check_no_nul(&mut v, "automation_id", &r.automation_id);
    let (Some(start), Some(end), Some(zone)) = (start, end, zone) else {
        return Err(v);
    };
    v.into_result(UsageQuery {
        automation_id: (!r.automation_id.is_empty()).then(|| r.automation_id.clone()),
        start,
        end,
        zone,
    })
}

/// The answer to `query` from its quarter hours: the total, and every
/// calendar day of the query's zone that the period touches, in order.
pub fn usage_summary(
    query: &UsageQuery,
    slices: &[automesh_domain::QuarterUsage],
) -> pb::SummarizeUsageResponse {
    use chrono::TimeZone;
    let day = |t: DateTime<Utc>| query.zone.from_utc_datetime(&t.naive_utc()).date_naive();
    let add = |u: &mut pb::Usage, s: &automesh_domain::QuarterUsage| {
        u.input_tokens += s.input_tokens;
        u.output_tokens += s.output_tokens;
        u.cost_micros += s.cost_micros;
    };
    let (first, last) = (
        day(query.start),
        day(query.end - chrono::Duration::microseconds(1)),
    );
    let mut days: Vec<pb::UsageDay> = first
        .iter_days()
        .take_while(|d| *d <= last)
        .map(|d| pb::UsageDay {
            date: d.format("%Y-%m-%d").to_string(),
            usage: Some(pb::Usage::default()),
            runs: 0,
        })
        .collect();
    let mut total = pb::Usage::default();
    let mut runs = 0;
    for slice in slices {
        add(&mut total, slice);
        runs += slice.runs;
        let index = (day(slice.start.max(query.start)) - first).num_days();
        if let Some(d) = usize::try_from(index).ok().and_then(|i| days.get_mut(i)) {
            add(d.usage.get_or_insert_default(), slice);
            d.runs += slice.runs;
        }
    }
    pb::SummarizeUsageResponse {
        total: Some(total),
        runs,
        days,
        time_zone: query.zone.name().to_owned(),
    }
}
