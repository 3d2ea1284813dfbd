//! Plain-HTTP pieces shared by the mesh's own HTTP endpoints (the demo
//! model and Connect endpoint of `dev`) and the fakes that stand for
//! outside services in tests.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::IntoResponse;

/// Refuses every request of `router` that does not carry
/// `Authorization: Bearer <token>`: 401 with a `WWW-Authenticate: Bearer`
/// challenge and `refusal` as its body.
pub fn require_bearer(router: axum::Router, token: &str, refusal: &'static str) -> axum::Router {
    let want: Arc<str> = format!("Bearer {token}").into();
    router.layer(middleware::from_fn(move |req: Request, next: Next| {
        let want = want.clone();
        async move {
            let presented = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            if presented == Some(&*want) {
                next.run(req).await
            } else {
                let challenge = [(header::WWW_AUTHENTICATE, "Bearer")];
                (StatusCode::UNAUTHORIZED, challenge, refusal).into_response()
            }
        }
    }))
}
