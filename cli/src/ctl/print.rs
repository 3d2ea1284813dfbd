//! How `automesh ctl` prints what the API returns: automations, runs,
//! receipts and events, one line each where it can.

use automesh_proto::v1 as pb;

use super::ts;

pub(super) fn describe_schedule(s: &Option<pb::Schedule>) -> String {
    use pb::schedule::Kind;
    let tod = |t: &Option<pb::TimeOfDay>| {
        t.as_ref()
            .map(|t| format!("{:02}:{:02}", t.hours, t.minutes))
            .unwrap_or_default()
    };
    match s.as_ref().and_then(|s| s.kind.as_ref()) {
        Some(Kind::Once(o)) => format!("once at {}", ts(&o.at)),
        Some(Kind::Daily(d)) => format!("daily at {} {}", tod(&d.time_of_day), d.time_zone),
        Some(Kind::Weekly(w)) => {
            let days: Vec<String> = w
                .days
                .iter()
                .filter_map(|d| pb::DayOfWeek::try_from(*d).ok())
                .map(|d| {
                    d.as_str_name()
                        .trim_start_matches("DAY_OF_WEEK_")
                        .to_ascii_lowercase()
                })
                .collect();
            format!(
                "weekly {} at {} {}",
                days.join(","),
                tod(&w.time_of_day),
                w.time_zone
            )
        }
        None => "-".into(),
    }
}

/// The short lowercase names people read for the public enums' values.
macro_rules! short_names {
    ($($name:ident: $enum:ident without $prefix:literal;)+) => {$(
        pub(super) fn $name(value: i32) -> String {
            pb::$enum::try_from(value)
                .map(|v| v.as_str_name().trim_start_matches($prefix).to_ascii_lowercase())
                .unwrap_or_default()
        }
    )+};
}

short_names! {
    automation_state: AutomationState without "AUTOMATION_STATE_";
    placement: Placement without "PLACEMENT_";
    run_state: RunState without "RUN_STATE_";
}

/// A budget per run in words, or `None` when it caps nothing.
pub(super) fn budget(max_cost_micros: Option<i64>, max_tokens: Option<i64>) -> Option<String> {
    let budget = automesh_domain::RunBudget {
        max_cost_micros,
        max_tokens,
    };
    budget.describe()
}

/// An automation, as an answer carries it (or nothing, as an empty one).
pub(super) fn print_automation(a: Option<pb::Automation>) {
    let a = a.unwrap_or_default();
    let (state, placement) = (automation_state(a.state), placement(a.placement));
    println!("id:         {}", a.id);
    println!("name:       {}", a.name);
    println!("placement:  {placement}");
    println!("state:      {state}");
    if !a.attention_reason.is_empty() {
        println!(
            "attention:  {} ({})",
            a.attention_reason, a.attention_message
        );
    }
    if !a.pause_reason.is_empty() {
        println!("paused:     {}", a.pause_reason);
    }
    match a.pause_after_failures {
        Some(0) => println!("failures:   {} in a row (never pauses)", a.failure_streak),
        Some(n) => println!("failures:   {} in a row (pauses at {n})", a.failure_streak),
        None => {}
    }
    if !a.failure_streak_codes.is_empty() {
        println!("streak:     {}", a.failure_streak_codes.join(", "));
    }
    if let Some(budget) = budget(a.max_cost_micros, a.max_tokens) {
        println!("budget:     {budget} per run");
    }
    if let Some(monthly) = a.monthly_budget_micros {
        let spent = a
            .month_spend_micros
            .map_or(String::new(), |s| format!(", {s} µ spent this month"));
        println!("monthly:    {monthly} µ{spent}");
    }
    if let Some(r) = &a.last_run {
        let cost = r.receipt.as_ref().and_then(|x| x.usage.as_ref());
        let cost = cost.map_or(String::new(), |u| format!(", cost {} µ", u.cost_micros));
        println!("last run:   {} ({}{cost})", r.id, run_state(r.state));
    }
    println!("model:      {}", a.model);
    println!("schedule:   {}", describe_schedule(&a.schedule));
    println!("next run:   {}", ts(&a.next_run_time));
    println!("etag:       {}", a.etag);
    println!("prompt:     {}", a.prompt);
}

/// A run, as an answer carries it (or nothing, as an empty one).
pub(super) fn print_run(r: Option<pb::Run>) {
    let r = r.unwrap_or_default();
    let state = run_state(r.state);
    println!("run:        {}", r.id);
    println!("automation: {}", r.automation_id);
    println!("state:      {state}");
    if !r.error_code.is_empty() {
        println!("error:      {} — {}", r.error_code, r.error_message);
    }
    println!("created:    {}", ts(&r.create_time));
    println!("deadline:   {}", ts(&r.deadline_time));
    if !r.trace_id.is_empty() {
        println!("trace:      {}", r.trace_id);
    }
    if let Some(receipt) = &r.receipt {
        print_receipt(receipt);
    }
}

/// A run's state as one line of `ctl watch`, with its error code if any.
pub(super) fn print_state(r: &pb::Run) {
    let error = if r.error_code.is_empty() {
        String::new()
    } else {
        format!(" ({})", r.error_code)
    };
    println!("-- run {} is {}{error}", r.id, run_state(r.state));
}

/// Whether a run in this state has ended (and a watch of it will end).
pub(super) fn is_terminal(state: i32) -> bool {
    automesh_edge::convert::run_state_from_pb(state).is_some_and(|s| s.is_terminal())
}

/// A receipt in two lines: what ran it, and what it used and cost.
pub(super) fn print_receipt(receipt: &pb::Receipt) {
    let usage = receipt.usage.unwrap_or_default();
    let model = match (receipt.model.as_str(), receipt.provider_model.as_str()) {
        ("", _) => String::new(),
        (m, "") => format!("  model {m}"),
        (m, p) => format!("  model {m} (asked of the provider as {p})"),
    };
    println!(
        "receipt:    engine {}{model}",
        if receipt.engine.is_empty() {
            "-"
        } else {
            &receipt.engine
        }
    );
    let price = match &receipt.price {
        Some(p) => format!(
            " at {}/{} µ per million input/output tokens",
            p.input_micros_per_million_tokens, p.output_micros_per_million_tokens
        ),
        None => " (the model has no price)".into(),
    };
    println!(
        "            tokens in/out {}/{}  cost {} µ{price}",
        usage.input_tokens, usage.output_tokens, usage.cost_micros
    );
    if let Some(budget) = budget(receipt.max_cost_micros, receipt.max_tokens) {
        println!("            budget {budget} per run");
    }
}

pub(super) fn print_event(e: &pb::RunEvent) {
    use pb::run_event::Payload;
    let what = match &e.payload {
        Some(Payload::AssistantText(t)) => format!("assistant: {}", t.text),
        Some(Payload::ToolCall(c)) => format!("tool call {} {}", c.tool, c.input_json),
        Some(Payload::ToolResult(r)) => format!(
            "tool result {}{}: {}",
            r.tool,
            if r.is_error { " (error)" } else { "" },
            r.output
        ),
        Some(Payload::PermissionPrompt(p)) => format!(
            "permission {} {:?} → {}",
            p.permission,
            p.patterns,
            if p.reply.is_empty() {
                "pending"
            } else {
                &p.reply
            }
        ),
        Some(Payload::Usage(u)) => format!(
            "usage: tokens in/out {}/{}  cost {} µ",
            u.input_tokens, u.output_tokens, u.cost_micros
        ),
        Some(Payload::StatusChange(s)) => [
            format!("status {}", run_state(s.state)),
            s.error_code.clone(),
            s.message.clone(),
        ]
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(" "),
        None => "(empty)".into(),
    };
    println!("{:>5}  {}  {what}", e.sequence, ts(&e.create_time));
}
