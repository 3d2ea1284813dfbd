//! Who is signed in, and the proof a form came from the console.
//!
//! The session is the user's own bearer token (the HS256 JWT the public API
//! takes), kept in an `HttpOnly`, `SameSite=Strict` cookie the page's script
//! cannot read; the console holds no session state of its own, so every
//! replica serves every user and a restart signs nobody out. The gateway
//! checks the token on every call; when it refuses it (expired, revoked
//! key), the console clears the cookie and sends the user to sign-in.
//!
//! Every state-changing form carries a CSRF token: an HMAC, under the
//! console's key, of the session's token (signed in) or of a random
//! pre-session value kept in its own cookie (the sign-in forms). A request
//! from another site cannot read either cookie, so it cannot forge one.

use automesh_rpc::InternalCredential;
use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Redirect, Response};
use http::HeaderMap;
use http::request::Parts;

use crate::time::Viewer;

/// The cookie that holds the bearer token.
pub const SESSION_COOKIE: &str = "automesh_session";
/// The cookie of the sign-in forms' CSRF token, before a session exists.
pub const PRE_SESSION_COOKIE: &str = "automesh_pre";
/// The form field every state-changing form carries.
pub const CSRF_FIELD: &str = "csrf";

/// Signs CSRF tokens with the console's key (HMAC-SHA256).
#[derive(Clone, Debug)]
pub struct Signer(InternalCredential);

impl Signer {
    /// A signer with `key` (at least 16 visible ASCII characters).
    pub fn new(key: &str) -> anyhow::Result<Self> {
        InternalCredential::new(key).map(Self).map_err(|_| {
            anyhow::anyhow!("AUTOMESH_CONSOLE_KEY must be at least 16 visible ASCII characters")
        })
    }

    /// The token a form of the session holding `secret` carries.
    pub fn csrf(&self, secret: &str) -> String {
        self.0.derive(&format!("csrf\n{secret}"))
    }

    /// Whether `presented` is the token of `secret` (constant time).
    pub fn verify(&self, secret: &str, presented: &str) -> bool {
        let want = self.csrf(secret);
        want.len() == presented.len()
            && want
                .bytes()
                .zip(presented.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// The value of cookie `name` in `headers`.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim_matches('"'))
        .filter(|v| !v.is_empty())
}

/// A `Set-Cookie` value for a cookie the page's script cannot read, sent
/// only to this site's own pages; `max_age` 0 clears it.
pub fn set_cookie(name: &str, value: &str, max_age: i64, secure: bool) -> String {
    format!(
        "{name}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{}",
        if secure { "; Secure" } else { "" }
    )
}

/// A signed-in user: their token (for the gateway), the CSRF token their
/// forms carry, and how they see time.
#[derive(Clone)]
pub struct Session {
    token: String,
    pub csrf: String,
    pub viewer: Viewer,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

impl Session {
    /// The bearer token, for calls to the gateway only.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Refuses a form whose CSRF token is not this session's.
    pub fn check(&self, signer: &Signer, form: &crate::Form) -> Result<(), crate::Failure> {
        if signer.verify(&self.token, form.get(CSRF_FIELD).unwrap_or_default()) {
            Ok(())
        } else {
            Err(crate::Failure::Forged)
        }
    }
}

/// A state-changing form of a signed-in user whose CSRF token is this
/// session's: the one way a handler takes a POST, so none can forget the
/// check. No session sends the browser to sign-in; a forged form is
/// refused before the handler runs.
pub struct Posted {
    pub session: Session,
    pub form: crate::Form,
}

impl axum::extract::FromRequest<crate::AppState> for Posted {
    type Rejection = Response;

    async fn from_request(
        request: axum::extract::Request,
        state: &crate::AppState,
    ) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = request.into_parts();
        let session = Session::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let request = axum::extract::Request::from_parts(parts, body);
        let form = crate::Form::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)?;
        session
            .check(&state.signer, &form)
            .map_err(IntoResponse::into_response)?;
        Ok(Self { session, form })
    }
}

/// What a page needs without a session: sends the browser to sign-in.
#[derive(Debug)]
pub struct SignInFirst;

impl IntoResponse for SignInFirst {
    fn into_response(self) -> Response {
        Redirect::to("/sign-in").into_response()
    }
}

impl FromRequestParts<crate::AppState> for Session {
    type Rejection = SignInFirst;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &crate::AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = cookie(&parts.headers, SESSION_COOKIE).ok_or(SignInFirst)?;
        Ok(Session {
            csrf: state.signer.csrf(token),
            token: token.to_owned(),
            viewer: Viewer::from_headers(&parts.headers),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csrf_token_is_bound_to_its_session_and_key() {
        let signer = Signer::new("0123456789abcdef-key").expect("key");
        let other = Signer::new("0123456789abcdef-other").expect("key");
        let token = signer.csrf("session-a");
        assert!(signer.verify("session-a", &token));
        assert!(!signer.verify("session-b", &token));
        assert!(!other.verify("session-a", &token));
        assert!(!signer.verify("session-a", ""));
        assert!(!signer.verify("session-a", &token[1..]));
    }

    #[test]
    fn cookies_are_read_by_name_and_written_strict() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::COOKIE,
            "a=1; automesh_session=tok.en; b=2".parse().expect("header"),
        );
        assert_eq!(cookie(&headers, SESSION_COOKIE), Some("tok.en"));
        assert_eq!(cookie(&headers, "missing"), None);
        let set = set_cookie(SESSION_COOKIE, "v", 60, true);
        for part in [
            "HttpOnly",
            "SameSite=Strict",
            "Secure",
            "Path=/",
            "Max-Age=60",
        ] {
            assert!(set.contains(part), "{set}");
        }
        assert!(!set_cookie("x", "v", 0, false).contains("Secure"));
    }
}
