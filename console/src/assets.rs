//! The console's script and stylesheet, compiled into the binary: nothing
//! is fetched from elsewhere, and no build step beyond cargo's exists.

use axum::extract::Path;
use axum::response::{IntoResponse, Response};
use http::header;

const SCRIPT: &str = include_str!("../assets/console.js");
const STYLE: &str = include_str!("../assets/console.css");

pub async fn serve(Path(name): Path<String>) -> Response {
    let (body, kind) = match name.as_str() {
        "console.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "console.css" => (STYLE, "text/css; charset=utf-8"),
        _ => return crate::Failure::NotFound.into_response(),
    };
    // Revalidated on each load: the binary may have changed underneath.
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
