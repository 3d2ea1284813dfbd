//! One run: its state, placement, trace id and timings, its native thread
//! (assistant text, tool calls and results, usage per step) as it happens,
//! its receipt, and cancel. The live part is fed by `live.rs`.

use automesh_proto::v1 as pb;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use crate::pages::{csrf, explain, is_terminal, layout, placement, run_state, see_other};
use crate::session::{Posted, Session};
use crate::time::{cost, duration};
use crate::{AppState, Failure};

/// Events read for the first render (the rest arrive live).
const FIRST_EVENTS: i32 = 1000;

pub async fn page(
    State(state): State<AppState>,
    session: Session,
    Path(id): Path<String>,
) -> Response {
    match render(&state, &session, &id).await {
        Ok(page) => page.into_response(),
        Err(f) => f.into_response(),
    }
}

async fn render(state: &AppState, session: &Session, id: &str) -> Result<Markup, Failure> {
    let mut runs = state.api.runs(session.token())?;
    let run = runs
        .get_run(pb::GetRunRequest { id: id.to_owned() })
        .await?
        .into_inner()
        .run
        .ok_or(Failure::NotFound)?;
    let events = runs
        .list_run_events(pb::ListRunEventsRequest {
            run_id: id.to_owned(),
            after_sequence: 0,
            page_size: FIRST_EVENTS,
        })
        .await?
        .into_inner();
    let started = started_at(&events.events);
    let live = !is_terminal(run.state);
    let body = html! {
        p { a href=(format!("/automations/{}", run.automation_id)) { "← Automation" } }
        h1 { "Run " code { (run.id) } }
        div #run-summary { (summary(session, &run, started.as_ref())) }
        h2 { "Thread" }
        ol #thread data-run=(run.id) data-after=(events.last_sequence) data-live=(live) aria-live="polite" {
            @for e in &events.events { (event_item(session, e)) }
        }
        p #live-status role="status" {
            @if live { "Following the run live…" }
        }
    };
    Ok(layout(session, "Run", body))
}

/// When the run started running, from its status events.
pub fn started_at(events: &[pb::RunEvent]) -> Option<prost_types::Timestamp> {
    events.iter().find_map(|e| match &e.payload {
        Some(pb::run_event::Payload::StatusChange(s))
            if s.state == pb::RunState::Running as i32 =>
        {
            e.create_time
        }
        _ => None,
    })
}

/// The run's header: state, placement, trace, timings, error, receipt and
/// cancel (re-rendered live at every state change).
pub fn summary(
    session: &Session,
    run: &pb::Run,
    started: Option<&prost_types::Timestamp>,
) -> Markup {
    let v = &session.viewer;
    let state = run_state(run.state);
    let receipt = run.receipt.as_ref();
    html! {
        dl.facts {
            dt { "State" } dd { span #run-state class=(format!("run-state run-{}", state.replace(' ', "-"))) { (state) } }
            dt { "Placement" } dd { span.placement { (placement(run.placement)) } }
            dt { "Trace id" } dd { code #trace-id { (run.trace_id) } }
            dt { "Queued" } dd { (v.ts(&run.create_time)) }
            dt { "Started" } dd { (v.ts(&started.copied())) }
            dt { "Ended" } dd { (v.ts(&receipt.and_then(|r| r.create_time))) }
            dt { "Deadline" } dd { (v.ts(&run.deadline_time)) }
        }
        @if !run.error_code.is_empty() {
            div.run-error role="alert" {
                p { code { (run.error_code) } ": " (run.error_message) }
                @if let Some(words) = explain(&run.error_code) { p.explain { (words) } }
            }
        }
        @if let Some(r) = receipt { (receipt_section(r)) }
        @if !is_terminal(run.state) {
            form method="post" action=(format!("/runs/{}/cancel", run.id)) {
                (csrf(session))
                button #cancel type="submit" { "Cancel run" }
            }
        }
    }
}

fn receipt_section(r: &pb::Receipt) -> Markup {
    let usage = r.usage.unwrap_or_default();
    html! {
        section #receipt aria-labelledby="receipt-title" {
            h2 #receipt-title { "Receipt" }
            dl.facts {
                dt { "Outcome" } dd { (run_state(r.outcome)) }
                dt { "Placement" } dd { (placement(r.placement)) }
                dt { "Engine" } dd { (r.engine) }
                dt { "Model" } dd { (r.model) @if !r.provider_model.is_empty() { " (asked as " (r.provider_model) ")" } }
                dt { "Tokens" } dd #receipt-tokens { (usage.input_tokens) " in · " (usage.output_tokens) " out" }
                dt { "Cost" } dd #receipt-cost { (cost(usage.cost_micros)) }
                dt { "Price" } dd {
                    @match &r.price {
                        Some(p) => {
                            (cost(p.input_micros_per_million_tokens)) " per million input tokens, "
                            (cost(p.output_micros_per_million_tokens)) " per million output tokens"
                        }
                        None => "unpriced (cost 0 means not priced, not free)",
                    }
                }
                dt { "Budget per run" } dd #receipt-budget { (crate::pages::budget(r.max_cost_micros, r.max_tokens)) }
                dt { "Waiting" } dd { (duration(&r.queued_duration)) }
                dt { "Wake-up" } dd { (duration(&r.wake_duration)) }
                dt { "Admission" } dd { (duration(&r.admission_duration)) }
                dt { "Execution" } dd { (duration(&r.execution_duration)) }
                @if let Some(t) = &r.native_thread {
                    dt { "Native thread" } dd { code { (t.thread_id) } " in " code { (t.workspace_id) } " on " code { (t.worker_id) } }
                }
            }
        }
    }
}

/// One event of the thread, as a list item.
pub fn event_item(session: &Session, e: &pb::RunEvent) -> Markup {
    use pb::run_event::Payload;
    let at = session.viewer.ts(&e.create_time);
    html! {
        li.event data-seq=(e.sequence) {
            @match &e.payload {
                Some(Payload::AssistantText(t)) => {
                    div.assistant { span.who { "Assistant" } " " (at) p.text { (t.text) } }
                }
                Some(Payload::ToolCall(c)) => {
                    details.tool-call open {
                        summary { "Tool call " code { (c.tool) } " " (at) }
                        pre { (c.input_json) }
                    }
                }
                Some(Payload::ToolResult(r)) => {
                    details.tool-result open {
                        summary {
                            @if r.is_error { "Tool error " } @else { "Tool result " }
                            code { (r.tool) } " " (at)
                        }
                        pre { (r.output) }
                    }
                }
                Some(Payload::PermissionPrompt(p)) => {
                    div.permission {
                        "Permission " code { (p.permission) } " " (p.patterns.join(", "))
                        ": " @if p.reply.is_empty() { "pending" } @else { (p.reply) } " " (at)
                    }
                }
                Some(Payload::Usage(u)) => {
                    div.usage {
                        "Step usage: " (u.input_tokens) " in · " (u.output_tokens) " out · " (cost(u.cost_micros))
                    }
                }
                Some(Payload::StatusChange(s)) => {
                    div.status {
                        "→ " (run_state(s.state)) " " (at)
                        @if !s.error_code.is_empty() { " " code { (s.error_code) } }
                        @if !s.message.is_empty() { " — " (s.message) }
                    }
                }
                None => { div.unknown { "An event this console does not know how to show." } }
            }
        }
    }
}

pub async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted { session, .. }: Posted,
) -> Response {
    let cancelled = async {
        state
            .api
            .runs(session.token())?
            .cancel_run(pb::CancelRunRequest { id: id.clone() })
            .await
    };
    match cancelled.await {
        Ok(_) => {
            tracing::info!(run_id = %id, "cancellation asked");
            see_other(&format!("/runs/{id}"))
        }
        Err(s) if s.code() == tonic::Code::FailedPrecondition => see_other(&format!("/runs/{id}")),
        Err(s) => Failure::from(s).into_response(),
    }
}
