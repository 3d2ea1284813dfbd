//! The automations list: search, filters, sorting, each automation's last
//! run, and pausing or resuming a selection at once.

use automesh_proto::v1 as pb;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use crate::pages::{automation_state, csrf, is_terminal, layout, placement, run_state, schedule};
use crate::session::{Posted, Session};
use crate::time::cost;
use crate::{AppState, Failure, Form};

/// Rows per page of the list.
const PAGE: usize = 50;
/// The most automations the list reads (20 pages of the API's largest).
const MOST: usize = 20_000;

/// Every automation of the caller (archived ones when asked), newest first.
pub async fn all(
    state: &AppState,
    session: &Session,
    archived: bool,
) -> Result<Vec<pb::Automation>, Failure> {
    let mut client = state.api.automations(session.token())?;
    let mut out = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_automations(pb::ListAutomationsRequest {
                page_size: 1000,
                page_token,
                show_archived: archived,
            })
            .await?
            .into_inner();
        out.extend(page.automations);
        if page.next_page_token.is_empty() || out.len() >= MOST {
            return Ok(out);
        }
        page_token = page.next_page_token;
    }
}

/// The list's filters, from the query string.
#[derive(Debug, Default)]
struct Filters {
    q: String,
    state: String,
    placement: String,
    sort: String,
    page: usize,
}

impl Filters {
    fn from(form: &Form) -> Self {
        Self {
            q: form.text("q"),
            state: form.text("state"),
            placement: form.text("placement"),
            sort: form.text("sort"),
            page: form.text("page").parse().unwrap_or(0),
        }
    }

    fn keeps(&self, a: &pb::Automation) -> bool {
        let name = self.q.to_lowercase();
        (name.is_empty() || a.name.to_lowercase().contains(&name))
            && (self.state.is_empty() || automation_state(a.state) == self.state.replace('_', " "))
            && (self.placement.is_empty() || placement(a.placement) == self.placement)
    }

    fn order(&self, list: &mut [pb::Automation]) {
        let secs = |t: &Option<prost_types::Timestamp>| t.as_ref().map_or(i64::MAX, |t| t.seconds);
        match self.sort.as_str() {
            "name" => list.sort_by_key(|a| a.name.to_lowercase()),
            "next_run" => list.sort_by_key(|a| secs(&a.next_run_time)),
            "state" => list.sort_by_key(|a| a.state),
            // Newest first, as the API lists them.
            _ => {}
        }
    }

    fn link(&self, page: usize) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("q", &self.q),
            ("state", &self.state),
            ("placement", &self.placement),
            ("sort", &self.sort),
        ] {
            if !v.is_empty() {
                q.append_pair(k, v);
            }
        }
        q.append_pair("page", &page.to_string());
        format!("/?{}", q.finish())
    }
}

pub async fn list(State(state): State<AppState>, session: Session, uri: http::Uri) -> Response {
    let query = Form::query(&uri);
    let filters = Filters::from(&query);
    let archived = filters.state == "archived";
    let mut automations = match all(&state, &session, archived).await {
        Ok(a) => a,
        Err(f) => return f.into_response(),
    };
    automations.retain(|a| filters.keeps(a));
    filters.order(&mut automations);
    let total = automations.len();
    let start = (filters.page * PAGE).min(total);
    let rows: Vec<pb::Automation> = automations
        .drain(start..(start + PAGE).min(total))
        .collect();
    // A desktop card warns when no runner of the owner is connected.
    let desktop = pb::Placement::Desktop as i32;
    let offline = if rows.iter().any(|a| a.placement == desktop) {
        match crate::pages::runners::any_connected(&state, &session).await {
            Ok(connected) => !connected,
            Err(f) => return f.into_response(),
        }
    } else {
        false
    };
    let notice = bulk_notice(&query);
    let body = html! {
        h1 { "Automations" }
        @if let Some(n) = notice { p.notice role="status" { (n) } }
        (filter_form(&filters))
        p.count { (total) " automation" @if total != 1 { "s" } }
        form #bulk method="post" action="/automations/bulk" {
            (csrf(&session))
            div.bulk-actions {
                label for="bulk-reason" { "Reason for pausing (optional)" }
                input #bulk-reason name="reason" maxlength="500";
                button type="submit" name="action" value="pause" { "Pause selected" }
                button type="submit" name="action" value="resume" { "Resume selected" }
            }
            table.automations {
                caption.visually-hidden { "Your automations" }
                thead { tr {
                    th scope="col" { span.visually-hidden { "Select" } }
                    th scope="col" { "Name" }
                    th scope="col" { "Placement" }
                    th scope="col" { "State" }
                    th scope="col" { "Schedule" }
                    th scope="col" { "Next run" }
                    th scope="col" { "Last run" }
                } }
                tbody {
                    @for a in &rows {
                        (row(&session, a, offline && a.placement == desktop))
                    }
                }
            }
        }
        nav.pages aria-label="Pages" {
            @if filters.page > 0 { a href=(filters.link(filters.page - 1)) { "Newer" } }
            @if start + PAGE < total { a href=(filters.link(filters.page + 1)) { "Older" } }
        }
    };
    layout(&session, "Automations", body).into_response()
}

fn filter_form(f: &Filters) -> Markup {
    let option = |value: &str, label: &str, current: &str| {
        html! { option value=(value) selected[value == current] { (label) } }
    };
    html! {
        form.filters method="get" action="/" role="search" {
            label for="q" { "Name" }
            input #q type="search" name="q" value=(f.q);
            label for="state" { "State" }
            select #state name="state" {
                (option("", "any (not archived)", &f.state))
                (option("active", "active", &f.state))
                (option("paused", "paused", &f.state))
                (option("needs_attention", "needs attention", &f.state))
                (option("archived", "archived", &f.state))
            }
            label for="placement" { "Placement" }
            select #placement name="placement" {
                (option("", "any", &f.placement))
                (option("desktop", "desktop", &f.placement))
                (option("cloud", "cloud", &f.placement))
            }
            label for="sort" { "Sort by" }
            select #sort name="sort" {
                (option("", "newest", &f.sort))
                (option("name", "name", &f.sort))
                (option("next_run", "next run", &f.sort))
                (option("state", "state", &f.sort))
            }
            button type="submit" { "Apply" }
        }
    }
}

fn row(session: &Session, a: &pb::Automation, runner_offline: bool) -> Markup {
    let state = automation_state(a.state);
    let last = a.last_run.as_ref();
    html! {
        tr data-automation=(a.id) {
            td {
                input type="checkbox" name="ids" value=(a.id) id=(format!("select-{}", a.id))
                    aria-label=(format!("Select {}", a.name));
            }
            td { a href=(format!("/automations/{}", a.id)) { (a.name) } }
            td {
                span.placement { (placement(a.placement)) }
                @if runner_offline {
                    br; small.warning title="None of your desktop runners is connected: a run now would end runner_offline" {
                        "no runner connected"
                    }
                }
            }
            td {
                span class=(format!("state state-{}", state.replace(' ', "-"))) { (state) }
                @if !a.attention_reason.is_empty() {
                    br; small.reason { (attention(a)) }
                }
                @if !a.pause_reason.is_empty() {
                    br; small.reason { "Paused: " (a.pause_reason) }
                }
            }
            td { (schedule(&a.schedule, &session.viewer)) }
            td { (session.viewer.ts(&a.next_run_time)) }
            td {
                @match last {
                    Some(r) => {
                        a href=(format!("/runs/{}", r.id)) { (run_state(r.state)) }
                        @if is_terminal(r.state) {
                            @if let Some(u) = r.receipt.as_ref().and_then(|x| x.usage.as_ref()) {
                                " · " (cost(u.cost_micros))
                            }
                        }
                    }
                    None => span.none { "never run" },
                }
            }
        }
    }
}

/// Why an automation needs attention, in words.
pub fn attention(a: &pb::Automation) -> String {
    if !a.attention_message.is_empty() {
        a.attention_message.clone()
    } else {
        crate::pages::explain(&a.attention_reason)
            .unwrap_or(a.attention_reason.as_str())
            .to_owned()
    }
}

fn bulk_notice(query: &Form) -> Option<String> {
    let done = query.text("done");
    let action = query.text("did");
    if action.is_empty() {
        return None;
    }
    let failed: Vec<&str> = query.all("failed");
    let mut text = format!("{action} {done}.");
    if !failed.is_empty() {
        text.push_str(&format!(
            " {} could not be changed: {}",
            failed.len(),
            failed.join("; ")
        ));
    }
    Some(text)
}

/// Pauses or resumes every selected automation; each answer is its own
/// (one refused does not stop the others), and the list says what happened.
pub async fn bulk(State(state): State<AppState>, Posted { session, form }: Posted) -> Response {
    let ids: Vec<String> = form.all("ids").into_iter().map(str::to_owned).collect();
    let pause = match form.text("action").as_str() {
        "pause" => true,
        "resume" => false,
        other => return Failure::BadForm(format!("unknown bulk action {other:?}")).into_response(),
    };
    let mut client = match state.api.automations(session.token()) {
        Ok(c) => c,
        Err(s) => return Failure::from(s).into_response(),
    };
    // One batch call per 100 ids (the API's bound); each id has its own
    // answer.
    let mut answers: Vec<(String, Result<(), tonic::Status>)> = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(100) {
        let ids = chunk.to_vec();
        let results = if pause {
            client
                .batch_deactivate_automations(pb::BatchDeactivateAutomationsRequest {
                    ids,
                    reason: form.text("reason"),
                })
                .await
                .map(|r| r.into_inner().results)
        } else {
            client
                .batch_activate_automations(pb::BatchActivateAutomationsRequest { ids })
                .await
                .map(|r| r.into_inner().results)
        };
        let results = match results {
            Ok(r) => r,
            Err(status) => return Failure::from(status).into_response(),
        };
        answers.extend(results.into_iter().map(|r| {
            let answer = if r.code == 0 {
                Ok(())
            } else {
                Err(tonic::Status::new(tonic::Code::from(r.code), r.message))
            };
            (r.id, answer)
        }));
    }
    let mut q = form_urlencoded::Serializer::new(String::new());
    let done = answers.iter().filter(|(_, a)| a.is_ok()).count();
    q.append_pair("did", if pause { "Paused" } else { "Resumed" });
    q.append_pair("done", &done.to_string());
    for (id, answer) in &answers {
        if let Err(status) = answer {
            if status.code() == tonic::Code::Unauthenticated {
                return Failure::from(status.clone()).into_response();
            }
            q.append_pair("failed", &format!("{id}: {}", status.message()));
        }
    }
    tracing::info!(selected = ids.len(), changed = done, pause, "bulk change");
    crate::pages::see_other(&format!("/?{}", q.finish()))
}
