//! One automation: what it is, its actions (activate, deactivate, archive,
//! run now), its run history with filters (the occurrences that were
//! skipped or missed included, with their reason), and its spend.

use automesh_proto::v1 as pb;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Datelike, Duration, TimeZone, Utc};
use maud::{Markup, html};

use crate::pages::automations::attention;
use crate::pages::{
    automation_state, csrf, explain, layout, placement, run_state, schedule, see_other,
};
use crate::session::{Posted, Session};
use crate::time::{cost, timestamp};
use crate::{AppState, Failure, Form};

/// The run states the history filter offers, as the API names them.
const STATES: [(pb::RunState, &str); 10] = [
    (pb::RunState::Pending, "pending"),
    (pb::RunState::Waking, "waking"),
    (pb::RunState::Running, "running"),
    (pb::RunState::Succeeded, "succeeded"),
    (pb::RunState::Failed, "failed"),
    (pb::RunState::TimedOut, "timed out"),
    (pb::RunState::Cancelled, "cancelled"),
    (pb::RunState::Skipped, "skipped"),
    (pb::RunState::Missed, "missed"),
    (pb::RunState::Admitted, "admitted"),
];

/// Rows of history per page.
const HISTORY: i32 = 50;

pub async fn page(
    State(state): State<AppState>,
    session: Session,
    Path(id): Path<String>,
    uri: http::Uri,
) -> Response {
    match render(&state, &session, &id, &Form::query(&uri)).await {
        Ok(page) => page.into_response(),
        Err(f) => f.into_response(),
    }
}

async fn render(
    state: &AppState,
    session: &Session,
    id: &str,
    query: &Form,
) -> Result<Markup, Failure> {
    let a = state
        .api
        .automations(session.token())?
        .get_automation(pb::GetAutomationRequest { id: id.to_owned() })
        .await?
        .into_inner()
        .automation
        .ok_or(Failure::NotFound)?;
    let viewer = &session.viewer;
    let states: Vec<i32> = query
        .all("state")
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    let from = day(query.get("from"), viewer.zone());
    let to = day(query.get("to"), viewer.zone()).map(|t| t + Duration::days(1));
    let mut runs = state.api.runs(session.token())?;
    let history = runs
        .list_runs(pb::ListRunsRequest {
            automation_id: id.to_owned(),
            page_size: HISTORY,
            page_token: query.text("page"),
            states: states.clone(),
            created_after: from.map(timestamp),
            created_before: to.map(timestamp),
            error_codes: query
                .get("reason")
                .filter(|r| !r.is_empty())
                .map(|r| vec![r.to_owned()])
                .unwrap_or_default(),
        })
        .await?
        .into_inner();
    let spend = spend(state, session, id).await?;
    let runner_offline = a.placement == pb::Placement::Desktop as i32
        && !crate::pages::runners::any_connected(state, session).await?;
    let state_name = automation_state(a.state);
    let archived = a.state == pb::AutomationState::Archived as i32;
    let body = html! {
        h1 { (a.name) }
        @if let Some(notice) = query.get("notice") { p.notice role="status" { (notice) } }
        dl.facts {
            dt { "Placement" } dd { span.placement { (placement(a.placement)) } }
            dt { "State" } dd {
                span class=(format!("state state-{}", state_name.replace(' ', "-"))) { (state_name) }
                @if !a.attention_reason.is_empty() {
                    " — " span.reason { (attention(&a)) } " (" code { (a.attention_reason) } ")"
                }
                @if !a.pause_reason.is_empty() {
                    " — " span.reason #pause-reason { "paused because: " (a.pause_reason) }
                }
            }
            dt { "Schedule" } dd { (schedule(&a.schedule, viewer)) }
            dt { "Next run" } dd { (viewer.ts(&a.next_run_time)) }
            dt { "Failed runs in a row" } dd #failure-streak {
                (a.failure_streak)
                @if !a.failure_streak_codes.is_empty() {
                    " (" @for (i, code) in a.failure_streak_codes.iter().enumerate() {
                        @if i > 0 { ", " } code { (code) }
                    } ")"
                }
                @match a.pause_after_failures {
                    Some(0) => { " — never pauses by itself" }
                    Some(n) => { " — pauses after " (n) }
                    None => {}
                }
            }
            dt { "Budget per run" } dd #budget {
                (crate::pages::budget(a.max_cost_micros, a.max_tokens))
            }
            dt { "Monthly budget" } dd #monthly-budget {
                @match a.monthly_budget_micros {
                    Some(m) => { (m) " µ" @if let Some(s) = a.month_spend_micros { ", " (s) " µ spent this month" } }
                    None => { "none" }
                }
            }
            dt { "Model" } dd { (a.model) }
            dt { "Prompt" } dd { pre.prompt { (a.prompt) } }
            dt { "Created" } dd { (viewer.ts(&a.create_time)) }
        }
        @if !archived {
            div.actions {
                a.button href=(format!("/automations/{id}/edit")) { "Edit" }
                @if a.state == pb::AutomationState::Active as i32 {
                    form method="post" action=(format!("/automations/{id}/deactivate")) {
                        (csrf(session))
                        label for="pause-reason-input" { "Reason (optional)" }
                        input #pause-reason-input name="reason" maxlength="500";
                        button type="submit" id="deactivate" { "Deactivate" }
                    }
                } @else {
                    (action(session, id, "activate", "Activate"))
                }
                form method="post" action=(format!("/automations/{id}/run"))
                    data-confirm=[runner_offline.then_some("None of your desktop runners is connected: this run would end runner_offline unless one connects before its deadline. Run it anyway?")] {
                    (csrf(session))
                    // One key per page view: sending the form twice starts one run.
                    input type="hidden" name="key" value=(uuid::Uuid::new_v4().to_string());
                    button #run-now type="submit" { "Run now" }
                }
                (action(session, id, "archive", "Archive"))
            }
        }
        @if runner_offline { (crate::pages::runners::offline_warning()) }
        (spend_section(&spend))
        h2 { "Run history" }
        (history_filter(id, &states, query))
        table.runs {
            caption.visually-hidden { "Runs of this automation, newest first" }
            thead { tr {
                th scope="col" { "Run" } th scope="col" { "State" } th scope="col" { "Trigger" }
                th scope="col" { "Due" } th scope="col" { "Created" } th scope="col" { "Reason" }
                th scope="col" { "Cost" }
            } }
            tbody {
                @for r in &history.runs { (run_row(session, r)) }
                @if history.runs.is_empty() { tr { td colspan="7" { "No runs match." } } }
            }
        }
        @if !history.next_page_token.is_empty() {
            nav.pages aria-label="History pages" {
                a href=(older_link(id, query, &history.next_page_token)) { "Older runs" }
            }
        }
    };
    Ok(layout(session, &a.name, body))
}

fn action(session: &Session, id: &str, verb: &str, label: &str) -> Markup {
    html! {
        form method="post" action=(format!("/automations/{id}/{verb}")) {
            (csrf(session))
            button type="submit" id=(verb) { (label) }
        }
    }
}

/// The local day `date` (YYYY-MM-DD) starts at, in `zone`.
fn day(date: Option<&str>, zone: chrono_tz::Tz) -> Option<DateTime<Utc>> {
    let d = chrono::NaiveDate::parse_from_str(date?.trim(), "%Y-%m-%d").ok()?;
    zone.from_local_datetime(&d.and_hms_opt(0, 0, 0)?)
        .earliest()
        .map(|t| t.with_timezone(&Utc))
}

fn older_link(id: &str, query: &Form, token: &str) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    for s in query.all("state") {
        q.append_pair("state", s);
    }
    for k in ["from", "to", "reason"] {
        if let Some(v) = query.get(k) {
            q.append_pair(k, v);
        }
    }
    q.append_pair("page", token);
    format!("/automations/{id}?{}", q.finish())
}

fn history_filter(id: &str, states: &[i32], query: &Form) -> Markup {
    html! {
        form.filters method="get" action=(format!("/automations/{id}")) aria-label="Filter runs" {
            fieldset {
                legend { "States" }
                @for (s, label) in STATES {
                    label.inline {
                        input type="checkbox" name="state" value=(s as i32) checked[states.contains(&(s as i32))];
                        " " (label)
                    }
                }
            }
            label for="reason" { "Reason" }
            select #reason name="reason" {
                option value="" { "any" }
                @for code in automesh_domain::ErrorCode::ALL {
                    option value=(code.as_str()) selected[query.text("reason") == code.as_str()] { (code.as_str()) }
                }
            }
            label for="from" { "From (day)" }
            input #from type="date" name="from" value=(query.text("from"));
            label for="to" { "To (day, inclusive)" }
            input #to type="date" name="to" value=(query.text("to"));
            button type="submit" { "Filter" }
        }
    }
}

fn run_row(session: &Session, r: &pb::Run) -> Markup {
    let trigger = if r.trigger == pb::RunTrigger::Manual as i32 {
        "run now"
    } else {
        "schedule"
    };
    let usage = r.receipt.as_ref().and_then(|x| x.usage.as_ref());
    html! {
        tr data-run=(r.id) {
            td { a href=(format!("/runs/{}", r.id)) { code { (r.id.get(..12).unwrap_or(&r.id)) } } }
            td { span class=(format!("run-state run-{}", run_state(r.state).replace(' ', "-"))) { (run_state(r.state)) } }
            td { (trigger) }
            td { (session.viewer.ts(&r.scheduled_time)) }
            td { (session.viewer.ts(&r.create_time)) }
            td {
                @if !r.error_code.is_empty() {
                    code { (r.error_code) }
                    @if let Some(words) = explain(&r.error_code) { br; small { (words) } }
                }
            }
            td { @if let Some(u) = usage { (cost(u.cost_micros)) } }
        }
    }
}

/// Spend of the automation: this calendar month (UTC) and the last 30
/// days, with each of those days' cost.
struct Spend {
    month: pb::Usage,
    last_30: pb::Usage,
    by_day: Vec<(chrono::NaiveDate, i64)>,
    /// The zone whose days these are.
    zone: String,
}

/// The automation's usage since the month began and over the last 30
/// days, per calendar day of the viewer's zone, from the API's summary.
async fn spend(state: &AppState, session: &Session, id: &str) -> Result<Spend, Failure> {
    let zone = session.viewer.zone();
    let now = Utc::now();
    let today = now.with_timezone(&zone).date_naive();
    let month_first = today.with_day(1).unwrap_or(today);
    let first_of_30 = today - Duration::days(29);
    let first = month_first.min(first_of_30);
    let start = zone
        .from_local_datetime(&first.and_hms_opt(0, 0, 0).unwrap_or_default())
        .earliest()
        .map_or(now - Duration::days(31), |t| t.with_timezone(&Utc));
    let summary = state
        .api
        .runs(session.token())?
        .summarize_usage(pb::SummarizeUsageRequest {
            automation_id: id.to_owned(),
            start_time: Some(timestamp(start)),
            end_time: Some(timestamp(now + Duration::seconds(1))),
            time_zone: zone.name().to_owned(),
        })
        .await?
        .into_inner();
    let mut s = Spend {
        month: pb::Usage::default(),
        last_30: pb::Usage::default(),
        by_day: Vec::with_capacity(30),
        zone: summary.time_zone.clone(),
    };
    for day in &summary.days {
        let (Ok(date), Some(u)) = (
            chrono::NaiveDate::parse_from_str(&day.date, "%Y-%m-%d"),
            day.usage.as_ref(),
        ) else {
            continue;
        };
        let add = |total: &mut pb::Usage| {
            total.input_tokens += u.input_tokens;
            total.output_tokens += u.output_tokens;
            total.cost_micros += u.cost_micros;
        };
        if date >= month_first {
            add(&mut s.month);
        }
        if date >= first_of_30 {
            add(&mut s.last_30);
            s.by_day.push((date, u.cost_micros));
        }
    }
    Ok(s)
}

fn spend_section(s: &Spend) -> Markup {
    let most = s.by_day.iter().map(|(_, c)| *c).max().unwrap_or(0).max(1);
    let tokens = |u: &pb::Usage| u.input_tokens + u.output_tokens;
    html! {
        section.spend aria-labelledby="spend-title" {
            h2 #spend-title { "Spend" }
            dl.facts {
                dt { "This month (" (s.zone) ")" }
                dd #spend-month { (cost(s.month.cost_micros)) " · " (tokens(&s.month)) " tokens" }
                dt { "Last 30 days" }
                dd #spend-30 { (cost(s.last_30.cost_micros)) " · " (tokens(&s.last_30)) " tokens" }
            }
            svg.chart viewBox="0 0 300 60" width="300" height="60" role="img"
                aria-label=(format!("Cost per day over the last 30 days ({} days)", s.zone)) {
                @for (i, (d, c)) in s.by_day.iter().enumerate() {
                    @let h = (c * 58 / most).max(if *c > 0 { 1 } else { 0 });
                    rect x=(i * 10) y=(60 - h) width="8" height=(h) {
                        title { (d) ": " (cost(*c)) }
                    }
                }
            }
        }
    }
}

/// Activate, deactivate, archive or run now.
pub async fn act(
    State(state): State<AppState>,
    Path((id, verb)): Path<(String, String)>,
    Posted { session, form }: Posted,
) -> Response {
    let mut client = match state.api.automations(session.token()) {
        Ok(c) => c,
        Err(s) => return Failure::from(s).into_response(),
    };
    let back = |notice: &str| {
        let q = form_urlencoded::Serializer::new(String::new())
            .append_pair("notice", notice)
            .finish();
        see_other(&format!("/automations/{id}?{q}"))
    };
    let request = pb::ActivateAutomationRequest {
        id: id.clone(),
        etag: String::new(),
    };
    let answer = match verb.as_str() {
        "activate" => client
            .activate_automation(request)
            .await
            .map(|_| back("Activated.")),
        "deactivate" => client
            .deactivate_automation(pb::DeactivateAutomationRequest {
                id: id.clone(),
                etag: String::new(),
                reason: form.text("reason"),
            })
            .await
            .map(|_| back("Deactivated: no more occurrences until you activate it.")),
        "archive" => client
            .archive_automation(pb::ArchiveAutomationRequest {
                id: id.clone(),
                etag: String::new(),
            })
            .await
            .map(|_| back("Archived: its history is kept.")),
        "run" => {
            let key = form.text("key");
            let key = if key.is_empty() {
                uuid::Uuid::new_v4().to_string()
            } else {
                key
            };
            client
                .run_automation_now(pb::RunAutomationNowRequest {
                    id: id.clone(),
                    idempotency_key: key,
                })
                .await
                .map(|r| {
                    let run = r.into_inner().run.map(|r| r.id).unwrap_or_default();
                    tracing::info!(automation_id = %id, run_id = %run, "run now");
                    see_other(&format!("/runs/{run}"))
                })
        }
        _ => return Failure::NotFound.into_response(),
    };
    match answer {
        Ok(r) => r,
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::FailedPrecondition | tonic::Code::Aborted
            ) =>
        {
            back(&format!("Not done: {}", crate::failure::refusal(&s)))
        }
        Err(s) => Failure::from(s).into_response(),
    }
}
