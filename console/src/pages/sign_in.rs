//! Sign-in, the development one-click sign-in, and sign-out.
//!
//! A token is checked by calling the gateway with it before it becomes the
//! session, so a mistyped or expired token is refused on the sign-in page.
//! The token travels only in the POST body and the cookie: never in a URL,
//! a log line, a span or a page.

use automesh_proto::v1 as pb;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, StatusCode, header};
use maud::{Markup, html};

use crate::pages::{bare, see_other};
use crate::session::{CSRF_FIELD, PRE_SESSION_COOKIE, Posted, SESSION_COOKIE, cookie, set_cookie};
use crate::{AppState, Failure, Form};

/// How long the session cookie lives; the token's own expiry ends it
/// sooner (the gateway refuses it, and the console sends the user here).
const SESSION_SECONDS: i64 = 30 * 24 * 3600;

/// The sign-in page. A new pre-session value is set when there is none.
pub async fn page(State(state): State<AppState>, headers: HeaderMap, uri: http::Uri) -> Response {
    let ended = Form::query(&uri).text("ended");
    let notice = match ended.as_str() {
        "expired" => Some("Your session has expired. Sign in again with a fresh token."),
        "refused" => Some("The API no longer accepts your token. Sign in again."),
        "out" => Some("You are signed out."),
        _ => None,
    };
    sign_in_page(&state, &headers, notice, None, StatusCode::OK)
}

fn sign_in_page(
    state: &AppState,
    headers: &HeaderMap,
    notice: Option<&str>,
    error: Option<String>,
    status: StatusCode,
) -> Response {
    let (pre, fresh) = match cookie(headers, PRE_SESSION_COOKIE) {
        Some(p) => (p.to_owned(), false),
        None => (automesh_rpc::runtime::random_secret("pre_"), true),
    };
    let csrf = state.signer.csrf(&pre);
    let body = form(state, &csrf, notice, error.as_deref());
    let mut response = (status, bare("Sign in", body)).into_response();
    if fresh {
        let set = set_cookie(PRE_SESSION_COOKIE, &pre, 3600, state.secure);
        if let Ok(v) = set.parse() {
            response.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    response
}

fn form(state: &AppState, csrf: &str, notice: Option<&str>, error: Option<&str>) -> Markup {
    html! {
        h1 { "Sign in to automesh" }
        @if let Some(n) = notice { p.notice role="status" { (n) } }
        form method="post" action="/sign-in" {
            input type="hidden" name=(CSRF_FIELD) value=(csrf);
            label for="token" { "Your API token (the bearer token the automesh API takes)" }
            textarea #token name="token" rows="4" required autocomplete="off" spellcheck="false"
                aria-describedby=[error.map(|_| "token-error")] {}
            @if let Some(e) = error { p #token-error .error role="alert" { (e) } }
            button type="submit" { "Sign in" }
        }
        @if state.dev_token.is_some() {
            form method="post" action="/sign-in/dev" {
                input type="hidden" name=(CSRF_FIELD) value=(csrf);
                p { "Development mesh: " }
                button #dev-sign-in type="submit" { "Sign in as the dev user" }
            }
        }
    }
}

/// Checks the pre-session CSRF token of a sign-in form.
fn check_pre(state: &AppState, headers: &HeaderMap, form: &Form) -> Result<(), Failure> {
    let pre = cookie(headers, PRE_SESSION_COOKIE).ok_or(Failure::Forged)?;
    if state
        .signer
        .verify(pre, form.get(CSRF_FIELD).unwrap_or_default())
    {
        Ok(())
    } else {
        Err(Failure::Forged)
    }
}

pub async fn submit(State(state): State<AppState>, headers: HeaderMap, form: Form) -> Response {
    if let Err(f) = check_pre(&state, &headers, &form) {
        return f.into_response();
    }
    let token = form.text("token");
    let token = token
        .strip_prefix("Bearer ")
        .unwrap_or(&token)
        .trim()
        .to_owned();
    start(&state, &headers, token).await
}

pub async fn dev(State(state): State<AppState>, headers: HeaderMap, form: Form) -> Response {
    if let Err(f) = check_pre(&state, &headers, &form) {
        return f.into_response();
    }
    match state.dev_token.clone() {
        Some(token) => start(&state, &headers, token.expose().to_owned()).await,
        None => Failure::NotFound.into_response(),
    }
}

/// Asks the gateway whether `token` is good, then makes it the session.
async fn start(state: &AppState, headers: &HeaderMap, token: String) -> Response {
    if token.is_empty() {
        let e = Some("Paste a token first.".to_owned());
        return sign_in_page(state, headers, None, e, StatusCode::BAD_REQUEST);
    }
    let probe = async {
        state
            .api
            .automations(&token)?
            .list_automations(pb::ListAutomationsRequest {
                page_size: 1,
                ..Default::default()
            })
            .await
    };
    match probe.await {
        Ok(_) => {
            tracing::info!("signed in");
            let set = set_cookie(SESSION_COOKIE, &token, SESSION_SECONDS, state.secure);
            let clear_pre = set_cookie(PRE_SESSION_COOKIE, "", 0, state.secure);
            let mut response = see_other("/");
            for c in [set, clear_pre] {
                if let Ok(v) = c.parse() {
                    response.headers_mut().append(header::SET_COOKIE, v);
                }
            }
            response
        }
        Err(status) if status.code() == tonic::Code::Unauthenticated => {
            let why = format!("That token was refused: {}.", status.message());
            sign_in_page(state, headers, None, Some(why), StatusCode::UNAUTHORIZED)
        }
        Err(status) => Failure::from(status).into_response(),
    }
}

/// Clears the session (a form with the session's CSRF token).
pub async fn sign_out(State(state): State<AppState>, _: Posted) -> Response {
    let mut response = see_other("/sign-in?ended=out");
    if let Ok(v) = set_cookie(SESSION_COOKIE, "", 0, state.secure).parse() {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response
}
