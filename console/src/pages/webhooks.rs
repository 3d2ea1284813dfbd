//! The owner's webhook endpoints: register one (its secret shown once),
//! see why one is disabled and what delivery did, send a test message,
//! delete one. Everything goes through `automesh.v1.Notifications`.

use automesh_proto::v1 as pb;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use maud::html;

use crate::pages::{csrf, layout, see_other};
use crate::session::{Posted, Session};
use crate::{AppState, Failure, Form};

fn back(notice: &str) -> Response {
    see_other(&format!(
        "/webhooks?{}",
        form_urlencoded::Serializer::new(String::new())
            .append_pair("notice", notice)
            .finish()
    ))
}

pub async fn page(State(state): State<AppState>, session: Session, uri: http::Uri) -> Response {
    let notice = Form::query(&uri).text("notice");
    let listed = async {
        let mut client = state.api.notifications(session.token())?;
        let listed = client
            .list_webhook_endpoints(pb::ListWebhookEndpointsRequest {})
            .await?;
        Ok::<_, Failure>(listed.into_inner().endpoints)
    };
    let endpoints = match listed.await {
        Ok(e) => e,
        Err(f) => return f.into_response(),
    };
    let viewer = &session.viewer;
    let body = html! {
        h1 { "Notifications" }
        @if !notice.is_empty() { p.notice role="status" { (notice) } }
        p {
            "Your webhook endpoints are told when a run fails (the first of a streak), an automation needs "
            "your attention, a monthly budget is spent, or occurrences were missed. Messages are signed as "
            a href="https://www.standardwebhooks.com/" { "Standard Webhooks" } " says."
        }
        table.webhooks {
            caption.visually-hidden { "Your webhook endpoints, oldest first" }
            thead { tr {
                th scope="col" { "URL" } th scope="col" { "Endpoint id" } th scope="col" { "Status" }
                th scope="col" { "Created" } th scope="col" { span.visually-hidden { "Actions" } }
            } }
            tbody {
                @for e in &endpoints {
                    tr data-endpoint=(e.id) {
                        td { code { (e.url) } @if !e.description.is_empty() { br; (e.description) } }
                        td { a href=(format!("/webhooks/{}", e.id)) { code { (e.id) } } }
                        td {
                            @if e.disable_time.is_some() {
                                span.state.state-attention { "disabled" }
                                p.reason { (viewer.ts(&e.disable_time)) ": " (e.disabled_reason) }
                            } @else { span.state.state-active { "enabled" } }
                        }
                        td { (viewer.ts(&e.create_time)) }
                        td {
                            @if e.disable_time.is_none() {
                                form method="post" action=(format!("/webhooks/{}/test", e.id)) {
                                    (csrf(&session))
                                    button type="submit" aria-label=(format!("Send a test message to {}", e.url)) { "Send test" }
                                }
                            }
                            form method="post" action=(format!("/webhooks/{}/delete", e.id)) {
                                (csrf(&session))
                                button type="submit" aria-label=(format!("Delete {}", e.url)) { "Delete" }
                            }
                        }
                    }
                }
                @if endpoints.is_empty() { tr { td colspan="5" { "No endpoints yet." } } }
            }
        }
        form method="post" action="/webhooks" {
            (csrf(&session))
            label for="url" { "Endpoint URL (https)" }
            input #url name="url" type="url" required maxlength="2048" placeholder="https://hooks.example.com/automesh";
            label for="description" { "Description (optional)" }
            input #description name="description" maxlength="500";
            button type="submit" { "Add endpoint" }
        }
    };
    layout(&session, "Notifications", body).into_response()
}

pub async fn create(State(state): State<AppState>, Posted { session, form }: Posted) -> Response {
    let created = async {
        let request = pb::CreateWebhookEndpointRequest {
            url: form.text("url"),
            description: form.text("description"),
        };
        state
            .api
            .notifications(session.token())?
            .create_webhook_endpoint(request)
            .await
    };
    match created.await {
        Ok(r) => {
            let r = r.into_inner();
            let endpoint = r.endpoint.unwrap_or_default();
            tracing::info!(endpoint_id = %endpoint.id, "webhook endpoint created");
            let body = html! {
                h1 { "Webhook endpoint" }
                p.notice role="status" {
                    "Copy the signing secret now: it is shown once. Your receiver verifies each message's "
                    code { "webhook-signature" } " with it."
                }
                dl.facts {
                    dt { "Endpoint id" } dd { code #created-endpoint { (endpoint.id) } }
                    dt { "URL" } dd { code { (endpoint.url) } }
                    dt { "Signing secret" } dd { code #created-secret { (r.secret) } }
                }
                p { a href="/webhooks" { "Done" } }
            };
            layout(&session, "Webhook endpoint", body).into_response()
        }
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition
            ) =>
        {
            back(&crate::failure::refusal(&s))
        }
        Err(s) => Failure::from(s).into_response(),
    }
}

pub async fn act(
    State(state): State<AppState>,
    Path((id, action)): Path<(String, String)>,
    Posted { session, .. }: Posted,
) -> Response {
    let mut client = match state.api.notifications(session.token()) {
        Ok(c) => c,
        Err(s) => return Failure::from(s).into_response(),
    };
    let done = match action.as_str() {
        "test" => client
            .test_webhook_endpoint(pb::TestWebhookEndpointRequest { id: id.clone() })
            .await
            .map(|r| format!("Test message {} queued.", r.into_inner().message_id)),
        "delete" => client
            .delete_webhook_endpoint(pb::DeleteWebhookEndpointRequest { id: id.clone() })
            .await
            .map(|_| "Deleted.".to_owned()),
        _ => return Failure::NotFound.into_response(),
    };
    match done {
        Ok(notice) => {
            tracing::info!(endpoint_id = %id, action, "webhook endpoint changed");
            back(&notice)
        }
        Err(s) if s.code() == tonic::Code::FailedPrecondition => back(&crate::failure::refusal(&s)),
        Err(s) => Failure::from(s).into_response(),
    }
}

pub async fn messages(
    State(state): State<AppState>,
    Path(id): Path<String>,
    session: Session,
) -> Response {
    let listed = async {
        let request = pb::ListWebhookMessagesRequest {
            endpoint_id: id.clone(),
            page_size: 50,
        };
        let mut client = state.api.notifications(session.token())?;
        let listed = client.list_webhook_messages(request).await?;
        Ok::<_, Failure>(listed.into_inner().messages)
    };
    let messages = match listed.await {
        Ok(m) => m,
        Err(f) => return f.into_response(),
    };
    let viewer = &session.viewer;
    let body = html! {
        h1 { "Messages of " code { (id) } }
        p { a href="/webhooks" { "All endpoints" } }
        table.messages {
            caption.visually-hidden { "The endpoint's newest messages" }
            thead { tr {
                th scope="col" { "Message id" } th scope="col" { "Type" } th scope="col" { "Written" }
                th scope="col" { "Status" } th scope="col" { "Attempts" } th scope="col" { "Last error" }
            } }
            tbody {
                @for m in &messages {
                    tr data-message=(m.id) {
                        td { code { (m.id) } }
                        td { code { (m.event_type) } }
                        td { (viewer.ts(&m.create_time)) }
                        td {
                            @if m.deliver_time.is_some() { "delivered " (viewer.ts(&m.deliver_time)) }
                            @else if m.next_attempt_time.is_some() { "next attempt " (viewer.ts(&m.next_attempt_time)) }
                            @else { "given up" }
                        }
                        td { (m.attempts) }
                        td { (m.last_error) }
                    }
                }
                @if messages.is_empty() { tr { td colspan="6" { "No messages yet." } } }
            }
        }
    };
    layout(&session, "Webhook messages", body).into_response()
}
