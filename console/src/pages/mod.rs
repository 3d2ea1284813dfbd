//! The pages: one module per screen, a shared layout, and the words the
//! console uses for states, placements, schedules and error codes.
//!
//! Everything interpolated into a page goes through maud, which escapes it:
//! names, prompts, model output and tool results are untrusted text.

pub mod automation;
pub mod automations;
pub mod edit;
pub mod preview;
pub mod runners;
pub mod runs;
pub mod sign_in;
pub mod webhooks;

use automesh_proto::v1 as pb;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use maud::{DOCTYPE, Markup, html};

use crate::session::{CSRF_FIELD, Session};

/// The document around a page's content, for a signed-in user: the
/// navigation, the time toggle and sign-out.
pub fn layout(session: &Session, title: &str, content: Markup) -> Markup {
    let viewer = &session.viewer;
    let zone_name = viewer.local.map(|z| z.name().to_owned());
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    nav aria-label="Main" {
                        a href="/" { "Automations" }
                        a href="/automations/new" { "New automation" }
                        a href="/runners" { "Runners" }
                        a href="/webhooks" { "Notifications" }
                    }
                    div.tools {
                        button #time-toggle type="button"
                            data-mode=(if viewer.shows_utc() { "utc" } else { "local" })
                            aria-label="Switch every time shown between UTC and your local time" {
                            @if viewer.shows_utc() {
                                "Times in UTC — show "
                                (zone_name.clone().unwrap_or_else(|| "local time".to_owned()))
                            } @else {
                                "Times in " (zone_name.clone().unwrap_or_default()) " — show UTC"
                            }
                        }
                        form method="post" action="/sign-out" {
                            (csrf(session))
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main #main { (content) }
            }
        }
    }
}

/// A page for someone not signed in (sign-in, errors).
pub fn bare(title: &str, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body { main #main { (content) } }
        }
    }
}

fn head(title: &str) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) " · automesh" }
            link rel="stylesheet" href="/assets/console.css";
            script src="/assets/console.js" defer {}
        }
    }
}

/// The hidden field that proves a form came from this session.
pub fn csrf(session: &Session) -> Markup {
    html! { input type="hidden" name=(CSRF_FIELD) value=(session.csrf); }
}

/// Any path the console does not serve.
pub async fn not_found() -> Response {
    crate::Failure::NotFound.into_response()
}

/// A 303 to `to` after a form (so reloading does not send it again).
pub fn see_other(to: &str) -> Response {
    (
        StatusCode::SEE_OTHER,
        [(http::header::LOCATION, to.to_owned())],
    )
        .into_response()
}

/// An automation's state in words.
pub fn automation_state(state: i32) -> &'static str {
    match pb::AutomationState::try_from(state) {
        Ok(pb::AutomationState::Active) => "active",
        Ok(pb::AutomationState::Inactive) => "paused",
        Ok(pb::AutomationState::NeedsAttention) => "needs attention",
        Ok(pb::AutomationState::Archived) => "archived",
        _ => "unknown",
    }
}

/// Where runs execute, as the label list cards and receipts show.
pub fn placement(p: i32) -> &'static str {
    match pb::Placement::try_from(p) {
        Ok(pb::Placement::Desktop) => "desktop",
        Ok(pb::Placement::Cloud) => "cloud",
        _ => "unknown",
    }
}

/// A run's state in words.
pub fn run_state(s: i32) -> &'static str {
    pb::RunState::try_from(s)
        .map(|s| match s {
            pb::RunState::Pending => "pending",
            pb::RunState::Waking => "waking",
            pb::RunState::Admitted => "admitted",
            pb::RunState::Running => "running",
            pb::RunState::Succeeded => "succeeded",
            pb::RunState::Failed => "failed",
            pb::RunState::TimedOut => "timed out",
            pb::RunState::Cancelled => "cancelled",
            pb::RunState::Skipped => "skipped",
            pb::RunState::Missed => "missed",
            pb::RunState::Unspecified => "unknown",
        })
        .unwrap_or("unknown")
}

/// Whether a run state is final.
pub fn is_terminal(s: i32) -> bool {
    s >= pb::RunState::Succeeded as i32
}

/// What an error code means, from the closed set (`docs/error-codes.md`).
pub fn explain(code: &str) -> Option<&'static str> {
    code.parse::<automesh_domain::ErrorCode>()
        .ok()
        .map(|c| c.description())
}

/// The short names of the weekdays, Monday first.
pub const DAYS: [(pb::DayOfWeek, &str); 7] = [
    (pb::DayOfWeek::Monday, "Mon"),
    (pb::DayOfWeek::Tuesday, "Tue"),
    (pb::DayOfWeek::Wednesday, "Wed"),
    (pb::DayOfWeek::Thursday, "Thu"),
    (pb::DayOfWeek::Friday, "Fri"),
    (pb::DayOfWeek::Saturday, "Sat"),
    (pb::DayOfWeek::Sunday, "Sun"),
];

/// A schedule in words, in the automation's own zone (a one-off in the
/// viewer's).
pub fn schedule(s: &Option<pb::Schedule>, viewer: &crate::time::Viewer) -> Markup {
    use pb::schedule::Kind;
    let tod = |t: &Option<pb::TimeOfDay>| {
        t.as_ref()
            .map(|t| format!("{:02}:{:02}", t.hours, t.minutes))
            .unwrap_or_default()
    };
    match s.as_ref().and_then(|s| s.kind.as_ref()) {
        Some(Kind::Once(o)) => html! { "Once, " (viewer.ts(&o.at)) },
        Some(Kind::Daily(d)) => {
            html! { "Daily at " (tod(&d.time_of_day)) " " (d.time_zone) }
        }
        Some(Kind::Weekly(w)) => {
            let days: Vec<&str> = DAYS
                .iter()
                .filter(|(d, _)| w.days.contains(&(*d as i32)))
                .map(|(_, n)| *n)
                .collect();
            html! { "Weekly on " (days.join(", ")) " at " (tod(&w.time_of_day)) " " (w.time_zone) }
        }
        None => html! { "—" },
    }
}

/// A budget per run in words.
pub fn budget(max_cost_micros: Option<i64>, max_tokens: Option<i64>) -> String {
    let budget = automesh_domain::RunBudget {
        max_cost_micros,
        max_tokens,
    };
    budget.describe().unwrap_or_else(|| "no cap".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_has_words() {
        for code in automesh_domain::ErrorCode::ALL {
            assert!(explain(code.as_str()).is_some_and(|d| !d.is_empty()));
        }
        assert_eq!(explain("not_a_code"), None);
    }

    #[test]
    fn untrusted_text_is_escaped() {
        let evil = "<script>alert(1)</script><img src=x onerror=alert(2)>";
        let page = bare(evil, html! { p { (evil) } }).into_string();
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(!page.contains("<img src=x"), "{page}");
        assert!(
            page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{page}"
        );
    }
}
