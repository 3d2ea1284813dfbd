//! Creating and editing an automation: name, prompt, model, a once,
//! daily or weekly schedule in an IANA zone, and how many failed runs in a
//! row pause it, with a preview of the next
//! occurrences (in the schedule's zone and in UTC, across the next DST
//! change) from the API's `PreviewSchedule`.
//!
//! The console is the web surface, so what it creates is a cloud
//! automation; there is no placement picker. An edit carries the etag it
//! was read at: a concurrent change comes back as a conflict showing both
//! versions, never as a silent overwrite. The API's field errors appear
//! next to the fields they name.

use std::collections::HashMap;

use automesh_proto::v1 as pb;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use maud::{Markup, html};
use tonic::Code;

use automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES;

use crate::pages::{DAYS, csrf, layout, schedule as schedule_words, see_other};
use crate::session::{Posted, Session};
use crate::time::{instant, timestamp};
use crate::{AppState, Failure, Form};

/// The model a new automation starts with.
const DEFAULT_MODEL: &str = "openai/gpt-4.1-mini";

/// What the edit form changes (every field it shows).
const UPDATED: &[&str] = &[
    "name",
    "prompt",
    "model",
    "schedule",
    "pause_after_failures",
    "max_cost_micros",
    "max_tokens",
    "monthly_budget_micros",
];

/// What the form holds, as typed.
#[derive(Debug, Default, Clone)]
pub(crate) struct Draft {
    name: String,
    prompt: String,
    model: String,
    kind: String,
    time: String,
    days: Vec<i32>,
    zone: String,
    once_at: String,
    /// Runs in a row that may end failed before it pauses itself, as typed.
    pause_after_failures: String,
    /// The budget per run, as typed (blank: no cap).
    max_cost_micros: String,
    max_tokens: String,
    monthly_budget_micros: String,
    etag: String,
}

/// Messages for the form's fields, by field name; `""` for the form.
pub(crate) type Errors = HashMap<&'static str, Vec<String>>;

impl Draft {
    pub(crate) fn from_form(form: &Form) -> Self {
        Self {
            name: form.text("name"),
            prompt: form.get("prompt").unwrap_or_default().to_owned(),
            model: form.text("model"),
            kind: form.text("kind"),
            time: form.text("time"),
            days: form
                .all("days")
                .iter()
                .filter_map(|d| d.parse().ok())
                .collect(),
            zone: form.text("zone"),
            once_at: form.text("once_at"),
            pause_after_failures: form.text("pause_after_failures"),
            max_cost_micros: form.text("max_cost_micros"),
            max_tokens: form.text("max_tokens"),
            monthly_budget_micros: form.text("monthly_budget_micros"),
            etag: form.text("etag"),
        }
    }

    fn from_automation(a: &pb::Automation) -> Self {
        use pb::schedule::Kind;
        let mut d = Draft {
            name: a.name.clone(),
            prompt: a.prompt.clone(),
            model: a.model.clone(),
            etag: a.etag.clone(),
            pause_after_failures: a
                .pause_after_failures
                .unwrap_or(DEFAULT_PAUSE_AFTER_FAILURES as i32)
                .to_string(),
            max_cost_micros: a.max_cost_micros.map(|c| c.to_string()).unwrap_or_default(),
            max_tokens: a.max_tokens.map(|t| t.to_string()).unwrap_or_default(),
            monthly_budget_micros: a
                .monthly_budget_micros
                .map(|m| m.to_string())
                .unwrap_or_default(),
            ..Draft::default()
        };
        let tod = |t: &Option<pb::TimeOfDay>| {
            t.as_ref()
                .map(|t| format!("{:02}:{:02}", t.hours, t.minutes))
                .unwrap_or_default()
        };
        match a.schedule.as_ref().and_then(|s| s.kind.as_ref()) {
            Some(Kind::Once(o)) => {
                d.kind = "once".into();
                d.zone = "UTC".into();
                if let Some(at) = o.at.as_ref().and_then(instant) {
                    d.once_at = at.format("%Y-%m-%dT%H:%M").to_string();
                }
            }
            Some(Kind::Daily(x)) => {
                d.kind = "daily".into();
                d.time = tod(&x.time_of_day);
                d.zone = x.time_zone.clone();
            }
            Some(Kind::Weekly(w)) => {
                d.kind = "weekly".into();
                d.time = tod(&w.time_of_day);
                d.zone = w.time_zone.clone();
                d.days = w.days.clone();
            }
            None => {}
        }
        d
    }

    /// The schedule the form describes, or the fields it cannot read.
    pub(crate) fn schedule(&self) -> Result<pb::Schedule, Errors> {
        use pb::schedule::Kind;
        let mut errors = Errors::new();
        let time = || -> Option<pb::TimeOfDay> {
            let (h, m) = self.time.split_once(':')?;
            Some(pb::TimeOfDay {
                hours: h.parse().ok()?,
                minutes: m.get(..2).unwrap_or(m).parse().ok()?,
            })
        };
        let kind = match self.kind.as_str() {
            "once" => {
                let zone = automesh_domain::schedule::parse_time_zone(&self.zone);
                let local = chrono::NaiveDateTime::parse_from_str(&self.once_at, "%Y-%m-%dT%H:%M");
                match (zone, local) {
                    (Some(zone), Ok(local)) => {
                        use chrono::TimeZone;
                        let at = zone
                            .from_local_datetime(&local)
                            .earliest()
                            .map(|t| t.with_timezone(&chrono::Utc));
                        match at {
                            Some(at) => Some(Kind::Once(pb::OnceSchedule {
                                at: Some(timestamp(at)),
                            })),
                            None => {
                                errors.entry("once_at").or_default().push(
                                    "this local time does not exist in the zone (a DST gap)".into(),
                                );
                                None
                            }
                        }
                    }
                    (None, _) => {
                        errors
                            .entry("zone")
                            .or_default()
                            .push("choose a time zone".into());
                        None
                    }
                    (_, Err(_)) => {
                        errors
                            .entry("once_at")
                            .or_default()
                            .push("enter a date and time".into());
                        None
                    }
                }
            }
            "daily" | "weekly" => match time() {
                None => {
                    errors
                        .entry("time")
                        .or_default()
                        .push("enter a time of day (HH:MM)".into());
                    None
                }
                Some(t) if self.kind == "daily" => Some(Kind::Daily(pb::DailySchedule {
                    time_of_day: Some(t),
                    time_zone: self.zone.clone(),
                })),
                Some(t) => Some(Kind::Weekly(pb::WeeklySchedule {
                    days: self.days.clone(),
                    time_of_day: Some(t),
                    time_zone: self.zone.clone(),
                })),
            },
            _ => {
                errors
                    .entry("kind")
                    .or_default()
                    .push("choose once, daily or weekly".into());
                None
            }
        };
        match kind {
            Some(kind) if errors.is_empty() => Ok(pb::Schedule { kind: Some(kind) }),
            _ => Err(errors),
        }
    }

    /// A whole number as typed: blank is `None`; the API checks the range
    /// and names the field.
    fn number<T: std::str::FromStr>(
        typed: &str,
        field: &'static str,
        hint: &str,
    ) -> Result<Option<T>, Errors> {
        let typed = typed.trim();
        if typed.is_empty() {
            return Ok(None);
        }
        typed.parse().map(Some).map_err(|_| {
            let text = format!("enter a whole number ({hint})");
            Errors::from([(field, vec![text])])
        })
    }

    fn automation(&self, id: &str) -> Result<pb::Automation, Errors> {
        let schedule = self.schedule();
        let pause_after_failures = Self::number(
            &self.pause_after_failures,
            "pause_after_failures",
            "0 never pauses",
        )
        .map(|n| n.unwrap_or(DEFAULT_PAUSE_AFTER_FAILURES as i32));
        let no_cap = "or leave it blank for none";
        let cost = Self::number(&self.max_cost_micros, "max_cost_micros", no_cap);
        let tokens = Self::number(&self.max_tokens, "max_tokens", no_cap);
        let monthly = Self::number(&self.monthly_budget_micros, "monthly_budget_micros", no_cap);
        let (schedule, pause_after_failures, max_cost_micros, max_tokens, monthly_budget_micros) =
            match (schedule, pause_after_failures, cost, tokens, monthly) {
                (Ok(s), Ok(p), Ok(c), Ok(t), Ok(m)) => (s, p, c, t, m),
                (s, p, c, t, m) => {
                    let mut errors = s.err().unwrap_or_default();
                    errors.extend(p.err().unwrap_or_default());
                    errors.extend(c.err().unwrap_or_default());
                    errors.extend(t.err().unwrap_or_default());
                    errors.extend(m.err().unwrap_or_default());
                    return Err(errors);
                }
            };
        Ok(pb::Automation {
            id: id.to_owned(),
            name: self.name.clone(),
            prompt: self.prompt.clone(),
            model: self.model.clone(),
            etag: self.etag.clone(),
            schedule: Some(schedule),
            pause_after_failures: Some(pause_after_failures),
            max_cost_micros,
            max_tokens,
            monthly_budget_micros,
            ..Default::default()
        })
    }
}

/// The form field an API field path names (`automation.schedule.weekly.days`
/// → `days`).
fn field_of(path: &str) -> &'static str {
    let path = path.trim_start_matches("automation.");
    match path {
        "name" => "name",
        "prompt" => "prompt",
        "model" => "model",
        "pause_after_failures" => "pause_after_failures",
        "max_cost_micros" => "max_cost_micros",
        "max_tokens" => "max_tokens",
        "monthly_budget_micros" => "monthly_budget_micros",
        p if p.ends_with("time_zone") => "zone",
        p if p.ends_with("days") => "days",
        p if p.contains("time_of_day") => "time",
        p if p.contains("once.at") => "once_at",
        p if p.starts_with("schedule") => "kind",
        _ => "",
    }
}

/// A refusal's field errors, by form field.
fn errors_of(status: &tonic::Status) -> Errors {
    let mut errors = Errors::new();
    let violations = automesh_edge::status::field_violations(status);
    if violations.is_empty() {
        errors
            .entry("")
            .or_default()
            .push(status.message().to_owned());
    }
    for (field, why) in violations {
        let f = field_of(&field);
        let text = if f.is_empty() {
            format!("{field}: {why}")
        } else {
            why
        };
        errors.entry(f).or_default().push(text);
    }
    errors
}

fn field_errors(errors: &Errors, field: &'static str) -> Markup {
    html! {
        @if let Some(list) = errors.get(field) {
            @for e in list { p.error id=(format!("{field}-error")) role="alert" { (e) } }
        }
    }
}

fn described(errors: &Errors, field: &str) -> Option<String> {
    errors.contains_key(field).then(|| format!("{field}-error"))
}

/// The form, for a new automation (`id` None) or an edit.
fn form(session: &Session, id: Option<&str>, d: &Draft, errors: &Errors) -> Markup {
    let action = id.map_or("/automations".to_owned(), |id| {
        format!("/automations/{id}/edit")
    });
    let zone = if d.zone.is_empty() {
        session.viewer.local.map_or("UTC", |z| z.name()).to_owned()
    } else {
        d.zone.clone()
    };
    let kind = if d.kind.is_empty() {
        "daily"
    } else {
        d.kind.as_str()
    };
    html! {
        (field_errors(errors, ""))
        form #automation-form method="post" action=(action) {
            (csrf(session))
            input type="hidden" name="etag" value=(d.etag);
            label for="name" { "Name" }
            input #name name="name" value=(d.name) required maxlength="200"
                aria-describedby=[described(errors, "name")];
            (field_errors(errors, "name"))
            label for="prompt" { "Prompt" }
            textarea #prompt name="prompt" rows="6" required
                aria-describedby=[described(errors, "prompt")] { (d.prompt) }
            (field_errors(errors, "prompt"))
            label for="model" { "Model" }
            input #model name="model" required
                value=(if d.model.is_empty() { DEFAULT_MODEL } else { d.model.as_str() })
                aria-describedby=[described(errors, "model")];
            (field_errors(errors, "model"))
            fieldset #schedule {
                legend { "Schedule" }
                @for (value, label) in [("once", "Once"), ("daily", "Daily"), ("weekly", "Weekly")] {
                    label.inline {
                        input type="radio" name="kind" value=(value) checked[kind == value];
                        " " (label)
                    }
                }
                (field_errors(errors, "kind"))
                div.when-once {
                    label for="once_at" { "Date and time (in the zone below)" }
                    input #once_at type="datetime-local" name="once_at" value=(d.once_at)
                        aria-describedby=[described(errors, "once_at")];
                    (field_errors(errors, "once_at"))
                }
                div.when-repeating {
                    label for="time" { "Time of day" }
                    input #time type="time" name="time" value=(d.time)
                        aria-describedby=[described(errors, "time")];
                    (field_errors(errors, "time"))
                }
                fieldset.when-weekly {
                    legend { "Days" }
                    @for (day, label) in DAYS {
                        label.inline {
                            input type="checkbox" name="days" value=(day as i32)
                                checked[d.days.contains(&(day as i32))];
                            " " (label)
                        }
                    }
                    (field_errors(errors, "days"))
                }
                label for="zone" { "Time zone" }
                select #zone name="zone" data-browser-zone=(d.zone.is_empty())
                    aria-describedby=[described(errors, "zone")] {
                    @for tz in chrono_tz::TZ_VARIANTS {
                        option value=(tz.name()) selected[tz.name() == zone] { (tz.name()) }
                    }
                }
                (field_errors(errors, "zone"))
            }
            section #preview aria-live="polite" aria-label="Next occurrences" {}
            label for="pause_after_failures" { "Pause after this many failed runs in a row (0: never)" }
            input #pause_after_failures type="number" name="pause_after_failures" min="0" max="1000"
                value=(if d.pause_after_failures.is_empty() { DEFAULT_PAUSE_AFTER_FAILURES.to_string() } else { d.pause_after_failures.clone() })
                aria-describedby=[described(errors, "pause_after_failures")];
            (field_errors(errors, "pause_after_failures"))
            fieldset #budget {
                legend { "Budgets (blank: none)" }
                label for="max_cost_micros" { "Most one run may cost (micro-units of the currency)" }
                input #max_cost_micros type="number" name="max_cost_micros" min="0" value=(d.max_cost_micros)
                    aria-describedby=[described(errors, "max_cost_micros")];
                (field_errors(errors, "max_cost_micros"))
                label for="max_tokens" { "Most tokens one run may use (input and output)" }
                input #max_tokens type="number" name="max_tokens" min="0" value=(d.max_tokens)
                    aria-describedby=[described(errors, "max_tokens")];
                (field_errors(errors, "max_tokens"))
                label for="monthly_budget_micros" { "Most its runs may cost in a calendar month (micro-units)" }
                input #monthly_budget_micros type="number" name="monthly_budget_micros" min="0" value=(d.monthly_budget_micros)
                    aria-describedby=[described(errors, "monthly_budget_micros")];
                (field_errors(errors, "monthly_budget_micros"))
            }
            p.placement-note { "Runs in your cloud worker (created from the web)." }
            button type="submit" { @if id.is_some() { "Save changes" } @else { "Create automation" } }
        }
    }
}

pub async fn new_form(session: Session) -> Response {
    let body = html! {
        h1 { "New automation" }
        (form(&session, None, &Draft::default(), &Errors::new()))
    };
    layout(&session, "New automation", body).into_response()
}

pub async fn create(State(state): State<AppState>, Posted { session, form }: Posted) -> Response {
    let draft = Draft::from_form(&form);
    let again = |errors: Errors| {
        let body = html! { h1 { "New automation" } (self::form(&session, None, &draft, &errors)) };
        (
            StatusCode::BAD_REQUEST,
            layout(&session, "New automation", body),
        )
            .into_response()
    };
    let automation = match draft.automation("") {
        Ok(a) => a,
        Err(errors) => return again(errors),
    };
    let created = async {
        state
            .api
            .automations(session.token())?
            .create_automation(pb::CreateAutomationRequest {
                automation: Some(automation),
                surface: pb::Surface::Web as i32,
            })
            .await
    };
    match created.await {
        Ok(r) => {
            let id = r.into_inner().automation.map(|a| a.id).unwrap_or_default();
            tracing::info!(automation_id = %id, "automation created");
            see_other(&format!("/automations/{id}"))
        }
        Err(s) if matches!(s.code(), Code::InvalidArgument | Code::FailedPrecondition) => {
            again(errors_of(&s))
        }
        Err(s) => Failure::from(s).into_response(),
    }
}

async fn read(state: &AppState, session: &Session, id: &str) -> Result<pb::Automation, Failure> {
    let answer = state
        .api
        .automations(session.token())?
        .get_automation(pb::GetAutomationRequest { id: id.to_owned() })
        .await?;
    answer.into_inner().automation.ok_or(Failure::NotFound)
}

pub async fn edit_form(
    State(state): State<AppState>,
    session: Session,
    Path(id): Path<String>,
) -> Response {
    let a = match read(&state, &session, &id).await {
        Ok(a) => a,
        Err(f) => return f.into_response(),
    };
    let body = html! {
        h1 { "Edit " (a.name) }
        p { "Placement: " span.placement { (crate::pages::placement(a.placement)) } " (fixed when it was created)" }
        (form(&session, Some(&id), &Draft::from_automation(&a), &Errors::new()))
    };
    layout(&session, "Edit automation", body).into_response()
}

pub async fn update(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted { session, form }: Posted,
) -> Response {
    let draft = Draft::from_form(&form);
    let again = |errors: Errors, conflict: Option<Markup>| {
        let body = html! {
            h1 { "Edit automation" }
            @if let Some(c) = conflict { (c) }
            (self::form(&session, Some(&id), &draft, &errors))
        };
        let code = if errors.is_empty() {
            StatusCode::CONFLICT
        } else {
            StatusCode::BAD_REQUEST
        };
        (code, layout(&session, "Edit automation", body)).into_response()
    };
    let automation = match draft.automation(&id) {
        Ok(a) => a,
        Err(errors) => return again(errors, None),
    };
    let updated = async {
        state
            .api
            .automations(session.token())?
            .update_automation(pb::UpdateAutomationRequest {
                automation: Some(automation.clone()),
                update_mask: Some(prost_types::FieldMask {
                    paths: UPDATED.iter().map(|p| (*p).to_owned()).collect(),
                }),
            })
            .await
    };
    match updated.await {
        Ok(_) => see_other(&format!("/automations/{id}")),
        Err(s) if s.code() == Code::Aborted => {
            // Someone saved in between: show both, keep the user's text in
            // the form, and arm it with the saved version's etag so that
            // saving again is a decision made knowing the other change.
            let saved = match read(&state, &session, &id).await {
                Ok(a) => a,
                Err(f) => return f.into_response(),
            };
            let mut draft = draft.clone();
            draft.etag = saved.etag.clone();
            let conflict = conflict(&session, &automation, &saved);
            let body = html! {
                h1 { "Edit automation" }
                (conflict)
                (self::form(&session, Some(&id), &draft, &Errors::new()))
            };
            (
                StatusCode::CONFLICT,
                layout(&session, "Edit conflict", body),
            )
                .into_response()
        }
        Err(s) if matches!(s.code(), Code::InvalidArgument | Code::FailedPrecondition) => {
            again(errors_of(&s), None)
        }
        Err(s) => Failure::from(s).into_response(),
    }
}

/// Both versions of a conflicting edit, side by side.
fn conflict(session: &Session, mine: &pb::Automation, saved: &pb::Automation) -> Markup {
    let rows = |a: &pb::Automation| {
        html! {
            dl {
                dt { "Name" } dd { (a.name) }
                dt { "Prompt" } dd { pre { (a.prompt) } }
                dt { "Model" } dd { (a.model) }
                dt { "Schedule" } dd { (schedule_words(&a.schedule, &session.viewer)) }
                dt { "Pause after" } dd { (a.pause_after_failures.unwrap_or_default()) " failed runs in a row" }
            }
        }
    };
    html! {
        section.conflict role="alert" aria-labelledby="conflict-title" {
            h2 #conflict-title { "This automation changed since you opened it" }
            p { "Nothing was overwritten. Compare the two versions; saving the form below replaces the saved version with yours." }
            div.versions {
                div { h3 { "Your version" } (rows(mine)) }
                div { h3 { "Saved version" } (rows(saved)) }
            }
        }
    }
}
