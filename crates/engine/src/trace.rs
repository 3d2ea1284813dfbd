//! The engine's side of a run's trace: W3C trace context on its outbound
//! HTTP calls (the provider and the Connect endpoint join the run's
//! trace), and the `server.address`/`server.port` of an endpoint for the
//! GenAI span attributes.

use opentelemetry::propagation::Injector;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct Headers<'a>(&'a mut reqwest::header::HeaderMap);

impl Injector for Headers<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            reqwest::header::HeaderName::from_bytes(key.as_bytes()),
            reqwest::header::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// `traceparent` (and `tracestate`) of the current span, as HTTP headers.
pub fn headers() -> reqwest::header::HeaderMap {
    let mut map = reqwest::header::HeaderMap::new();
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut Headers(&mut map))
    });
    map
}

/// The host and port `url` names (the scheme's default port when it names
/// none); empty and 0 for something that is not a URL.
pub fn server_of(url: &str) -> (String, u16) {
    match reqwest::Url::parse(url) {
        Ok(u) => (
            u.host_str().unwrap_or_default().to_owned(),
            u.port_or_known_default().unwrap_or(0),
        ),
        Err(_) => (String::new(), 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_of_an_endpoint() {
        assert_eq!(
            server_of("https://api.openai.com/v1"),
            ("api.openai.com".to_owned(), 443)
        );
        assert_eq!(
            server_of("http://127.0.0.1:8080/mcp"),
            ("127.0.0.1".to_owned(), 8080)
        );
        assert_eq!(server_of("not a url"), (String::new(), 0));
    }
}
