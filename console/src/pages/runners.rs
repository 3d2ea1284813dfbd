//! The owner's desktop runners: mint a runner's token (shown once) and
//! revoke a runner.

use automesh_proto::v1 as pb;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use crate::pages::{csrf, layout, see_other};
use crate::session::{Posted, Session};
use crate::{AppState, Failure, Form};

fn mint_form(session: &Session) -> Markup {
    html! {
        form method="post" action="/runners" {
            (csrf(session))
            label for="runner_name" { "Runner name (such as the machine's name)" }
            input #runner_name name="runner_name" required maxlength="200";
            button type="submit" { "Mint a runner token" }
        }
    }
}

fn revoke_form(session: &Session) -> Markup {
    html! {
        form #revoke method="post" action="/runners/revoke/revoke" {
            (csrf(session))
            label for="runner_id" { "Runner id to revoke" }
            input #runner_id name="runner_id" required;
            button type="submit" { "Revoke" }
        }
    }
}

/// The caller's runners that are not revoked, as the API lists them.
pub async fn list(state: &AppState, session: &Session) -> Result<Vec<pb::Runner>, Failure> {
    Ok(state
        .api
        .automations(session.token())?
        .list_runners(pb::ListRunnersRequest {})
        .await?
        .into_inner()
        .runners)
}

/// Whether a run of a desktop automation would find a runner now.
pub async fn any_connected(state: &AppState, session: &Session) -> Result<bool, Failure> {
    Ok(list(state, session).await?.iter().any(|r| r.connected))
}

/// What a desktop automation's card and run-now say when none of the
/// owner's runners is connected.
pub fn offline_warning() -> Markup {
    html! {
        p.warning role="note" {
            "None of your desktop runners is connected: a run started now would end "
            code { "runner_offline" } " unless one connects before its deadline. "
            a href="/runners" { "Runners" }
        }
    }
}

pub async fn page(State(state): State<AppState>, session: Session, uri: http::Uri) -> Response {
    let notice = Form::query(&uri).text("notice");
    let runners = match list(&state, &session).await {
        Ok(r) => r,
        Err(f) => return f.into_response(),
    };
    let viewer = &session.viewer;
    let body = html! {
        h1 { "Desktop runners" }
        @if !notice.is_empty() { p.notice role="status" { (notice) } }
        p { "A desktop automation runs on one of your runners: start " code { "automesh runner" } " with a token minted here." }
        table.runners {
            caption.visually-hidden { "Your desktop runners, newest first" }
            thead { tr {
                th scope="col" { "Name" } th scope="col" { "Runner id" } th scope="col" { "Status" }
                th scope="col" { "Last seen" } th scope="col" { "Minted" } th scope="col" { span.visually-hidden { "Actions" } }
            } }
            tbody {
                @for r in &runners {
                    tr data-runner=(r.runner_id) {
                        td { (r.name) }
                        td { code { (r.runner_id) } }
                        td {
                            @if r.connected { span.state.state-active { "online" } }
                            @else { span.state.state-paused { "offline" } }
                        }
                        td { @if r.last_seen_time.is_some() { (viewer.ts(&r.last_seen_time)) } @else { "never" } }
                        td { (viewer.ts(&r.create_time)) }
                        td {
                            form method="post" action=(format!("/runners/{}/revoke", r.runner_id)) {
                                (csrf(&session))
                                button type="submit" aria-label=(format!("Revoke {}", r.name)) { "Revoke" }
                            }
                        }
                    }
                }
                @if runners.is_empty() { tr { td colspan="6" { "No runners yet." } } }
            }
        }
        (mint_form(&session))
        (revoke_form(&session))
    };
    layout(&session, "Runners", body).into_response()
}

pub async fn mint(State(state): State<AppState>, Posted { session, form }: Posted) -> Response {
    let minted = async {
        state
            .api
            .automations(session.token())?
            .create_runner_token(pb::CreateRunnerTokenRequest {
                runner_name: form.text("runner_name"),
            })
            .await
    };
    match minted.await {
        Ok(r) => {
            let r = r.into_inner();
            tracing::info!(runner_id = %r.runner_id, "runner token minted");
            let body = html! {
                h1 { "Runner token" }
                p.notice role="status" { "Copy it now: it is shown once and stored only as a hash." }
                dl.facts {
                    dt { "Runner id" } dd { code #minted-runner { (r.runner_id) } }
                    dt { "Token" } dd { code #minted-token { (r.token) } }
                }
                p { a href="/runners" { "Done" } }
            };
            layout(&session, "Runner token", body).into_response()
        }
        Err(s) if s.code() == tonic::Code::InvalidArgument => {
            let why = crate::failure::refusal(&s);
            see_other(&format!(
                "/runners?{}",
                form_urlencoded::Serializer::new(String::new())
                    .append_pair("notice", &why)
                    .finish()
            ))
        }
        Err(s) => Failure::from(s).into_response(),
    }
}

pub async fn revoke(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted { session, form }: Posted,
) -> Response {
    // The id comes from the path, or from the revoke form's field.
    let runner_id = match form.text("runner_id") {
        typed if !typed.is_empty() => typed,
        _ => id,
    };
    let revoked = async {
        state
            .api
            .automations(session.token())?
            .revoke_runner_token(pb::RevokeRunnerTokenRequest {
                runner_id: runner_id.clone(),
            })
            .await
    };
    match revoked.await {
        Ok(_) => {
            tracing::info!(runner_id = %runner_id, "runner revoked");
            see_other("/runners?notice=Revoked.")
        }
        Err(s) => Failure::from(s).into_response(),
    }
}
