//! What a page shows when it cannot show what was asked: each gateway
//! answer mapped once to what the user can do about it.

use axum::response::{IntoResponse, Redirect, Response};
use http::{StatusCode, header};
use maud::html;
use tonic::{Code, Status};

use crate::pages::bare;
use crate::session::{SESSION_COOKIE, set_cookie};

#[derive(Debug)]
pub enum Failure {
    /// The gateway refused the session's token: sign in again.
    SignIn { expired: bool },
    /// Unknown, or another user's: the same answer for both.
    NotFound,
    /// The gateway did not answer: the page says so and retries.
    Unreachable(String),
    /// A form without this session's CSRF token.
    Forged,
    /// A form the console cannot read.
    BadForm(String),
    /// Any other refusal, with the gateway's message.
    Refused(Status),
}

impl From<Status> for Failure {
    fn from(status: Status) -> Self {
        match status.code() {
            Code::Unauthenticated => Failure::SignIn {
                expired: status.message().contains("expired"),
            },
            Code::NotFound => Failure::NotFound,
            _ if crate::api::unreachable(&status) => {
                Failure::Unreachable(status.message().to_owned())
            }
            _ => Failure::Refused(status),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        match self {
            Failure::SignIn { expired } => {
                let to = if expired {
                    "/sign-in?ended=expired"
                } else {
                    "/sign-in?ended=refused"
                };
                let clear = set_cookie(SESSION_COOKIE, "", 0, false);
                ([(header::SET_COOKIE, clear)], Redirect::to(to)).into_response()
            }
            Failure::NotFound => (
                StatusCode::NOT_FOUND,
                bare(
                    "Not found",
                    html! {
                        h1 { "Not found" }
                        p { "There is no such automation or run among yours." }
                        p { a href="/" { "Back to your automations" } }
                    },
                ),
            )
                .into_response(),
            Failure::Unreachable(message) => (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "5")],
                bare(
                    "Gateway unavailable",
                    html! {
                        // Refreshes itself (a meta refresh needs no script).
                        meta http-equiv="refresh" content="5";
                        h1 { "The API gateway is not answering" }
                        p.error role="alert" { "This page retries every 5 seconds. (" (message) ")" }
                    },
                ),
            )
                .into_response(),
            Failure::Forged => (
                StatusCode::FORBIDDEN,
                bare(
                    "Form expired",
                    html! {
                        h1 { "This form can no longer be sent" }
                        p { "It was opened in another session, or before the console restarted. Nothing was changed." }
                        p { a href="/" { "Start again from your automations" } }
                    },
                ),
            )
                .into_response(),
            Failure::BadForm(why) => (
                StatusCode::BAD_REQUEST,
                bare("Bad request", html! { h1 { "Bad request" } p.error { (why) } }),
            )
                .into_response(),
            Failure::Refused(status) => {
                let code = match status.code() {
                    Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
                    Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => {
                        StatusCode::CONFLICT
                    }
                    Code::PermissionDenied => StatusCode::FORBIDDEN,
                    Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
                    _ => StatusCode::BAD_GATEWAY,
                };
                (
                    code,
                    bare(
                        "Refused",
                        html! {
                            h1 { "The request was refused" }
                            p.error role="alert" { (refusal(&status)) }
                            p { a href="/" { "Back to your automations" } }
                        },
                    ),
                )
                    .into_response()
            }
        }
    }
}

/// A gateway refusal in words: its message, then each field it names.
pub fn refusal(status: &Status) -> String {
    let mut text = status.message().to_owned();
    for (field, why) in automesh_edge::status::field_violations(status) {
        text.push_str(&format!("; {field}: {why}"));
    }
    text
}
