//! The preview of a schedule the edit form shows as it changes: the next
//! occurrences in the schedule's zone and in UTC, and the first one after
//! the zone's next offset change (`PreviewSchedule`).

use automesh_proto::v1 as pb;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use maud::{Markup, html};
use tonic::Code;

use crate::pages::edit::Draft;
use crate::session::Session;
use crate::time::{in_zone, instant};
use crate::{AppState, Form};

/// The preview fragment the form's script asks for as the schedule changes.
pub async fn preview(State(state): State<AppState>, session: Session, uri: http::Uri) -> Response {
    let draft = Draft::from_form(&Form::query(&uri));
    let schedule = match draft.schedule() {
        Ok(s) => s,
        Err(errors) => {
            let all: Vec<String> = errors.into_values().flatten().collect();
            return html! { p.muted { "No preview yet: " (all.join("; ")) } }.into_response();
        }
    };
    let answer = async {
        state
            .api
            .automations(session.token())?
            .preview_schedule(pb::PreviewScheduleRequest {
                schedule: Some(schedule),
                count: 5,
                after_time: None,
            })
            .await
    };
    match answer.await {
        Ok(r) => occurrences(&r.into_inner()).into_response(),
        Err(s) if s.code() == Code::InvalidArgument => {
            html! { p.muted { "No preview: " (crate::failure::refusal(&s)) } }.into_response()
        }
        Err(s) => (StatusCode::BAD_GATEWAY, html! { p.error { (s.message()) } }).into_response(),
    }
}

fn occurrences(p: &pb::PreviewScheduleResponse) -> Markup {
    let zone = automesh_domain::schedule::parse_time_zone(&p.time_zone).unwrap_or(chrono_tz::UTC);
    let line = |o: &pb::Occurrence| {
        let at = o.time.as_ref().and_then(instant);
        html! {
            @if let Some(at) = at {
                tr { td { (in_zone(at, zone)) } td { (in_zone(at, chrono_tz::UTC)) } }
            }
        }
    };
    html! {
        h2 { "Next occurrences" }
        @if p.occurrences.is_empty() {
            p { "None: this schedule does not fire again." }
        } @else {
            table.preview {
                thead { tr { th scope="col" { "In " (p.time_zone) } th scope="col" { "In UTC" } } }
                tbody { @for o in &p.occurrences { (line(o)) } }
            }
        }
        @if let (Some(change), Some(first)) = (p.next_offset_change_time.as_ref().and_then(instant), &p.first_after_offset_change) {
            p.dst {
                "The zone's offset changes at " (in_zone(change, chrono_tz::UTC))
                "; the first occurrence after it: "
            }
            table.preview.after-dst { tbody { (line(first)) } }
        }
    }
}
