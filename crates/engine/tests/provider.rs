//! The provider client against a fake OpenAI-compatible server speaking real
//! HTTP (and SSE) on loopback.

mod common;

use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_engine::provider::{ChatRequest, Message, Provider, ProviderConfig};
use common::{Reply, provider as fake, text_completion};
use tokio::time::Instant;

fn config(url: &str, stream: bool) -> ProviderConfig {
    ProviderConfig {
        kind: "openai-compatible".into(),
        base_url: url.into(),
        api_key: "sk-test-key-0123".into(),
        request_timeout: Duration::from_secs(5),
        stream,
    }
}

fn request() -> ChatRequest {
    ChatRequest {
        model: "fake-model".into(),
        messages: vec![Message::user("hello")],
        tools: vec![],
    }
}

fn deadline(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

#[tokio::test]
async fn non_streaming_answer_with_usage_and_bearer_key() {
    let (url, fake) = fake(|_, _| Reply::Json(text_completion("hi there"))).await;
    let provider = Provider::new(config(&url, false)).expect("provider");
    let r = provider
        .complete(&request(), deadline(10))
        .await
        .expect("answer");
    assert_eq!(r.content.as_deref(), Some("hi there"));
    assert_eq!((r.usage.prompt_tokens, r.usage.completion_tokens), (7, 3));
    assert_eq!(fake.auth.lock().as_slice(), ["Bearer sk-test-key-0123"]);
}

#[tokio::test]
async fn streaming_assembles_text_and_tool_call_deltas() {
    let sse = [
        r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"Let me "}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"content":"search."}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"search_capabilities","arguments":"{\"qu"}}]}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ery\":\"mail\"}"}}]}}]}"#,
        r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":5}}"#,
    ]
    .iter()
    .map(|d| format!("data: {d}\n\n"))
    .collect::<String>()
        + "data: [DONE]\n\n";
    let (url, fake) = fake(move |_, body| {
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        Reply::Sse(sse.clone())
    })
    .await;
    let provider = Provider::new(config(&url, true)).expect("provider");
    let r = provider
        .complete(&request(), deadline(10))
        .await
        .expect("answer");
    assert_eq!(r.content.as_deref(), Some("Let me search."));
    assert_eq!(r.tool_calls.len(), 1);
    assert_eq!(r.tool_calls[0].id, "call_1");
    assert_eq!(r.tool_calls[0].function.name, "search_capabilities");
    assert_eq!(r.tool_calls[0].function.arguments, r#"{"query":"mail"}"#);
    assert_eq!(r.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!((r.usage.prompt_tokens, r.usage.completion_tokens), (11, 5));
    assert_eq!(fake.calls(), 1);
}

#[tokio::test]
async fn a_kind_outside_the_allowlist_is_refused_before_any_request() {
    let (url, fake) = fake(|_, _| Reply::Json(text_completion("never"))).await;
    let err = Provider::new(ProviderConfig {
        kind: "anthropic".into(),
        ..config(&url, false)
    })
    .expect_err("refused");
    assert_eq!(err.code, ErrorCode::ProviderUnavailable);
    assert_eq!(fake.calls(), 0);
}

#[tokio::test]
async fn unauthorized_ends_at_once() {
    let (url, fake) = fake(|_, _| Reply::Status(401, None)).await;
    let provider = Provider::new(config(&url, false)).expect("provider");
    let err = provider
        .complete(&request(), deadline(30))
        .await
        .expect_err("401");
    assert_eq!(err.code, ErrorCode::ProviderUnavailable);
    assert_eq!(fake.calls(), 1, "no retry after 401");
    assert!(!err.message.contains("sk-test"), "{}", err.message);
}

#[tokio::test]
async fn rate_limited_then_success_honours_retry_after() {
    let (url, fake) = fake(|n, _| {
        if n == 0 {
            Reply::Status(429, Some("1"))
        } else {
            Reply::Json(text_completion("ok"))
        }
    })
    .await;
    let provider = Provider::new(config(&url, false)).expect("provider");
    let started = std::time::Instant::now();
    let r = provider
        .complete(&request(), deadline(30))
        .await
        .expect("answer after retry");
    assert_eq!(r.content.as_deref(), Some("ok"));
    assert_eq!(fake.calls(), 2);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "Retry-After was honoured"
    );
}

#[tokio::test]
async fn server_errors_until_the_deadline_end_with_a_named_error() {
    let (url, fake) = fake(|_, _| Reply::Status(500, None)).await;
    let provider = Provider::new(config(&url, false)).expect("provider");
    let err = provider
        .complete(&request(), deadline(2))
        .await
        .expect_err("500 forever");
    assert_eq!(err.code, ErrorCode::ProviderUnavailable);
    assert!(fake.calls() >= 2, "5xx is retried");
}

#[tokio::test]
async fn a_response_slower_than_the_request_timeout_is_abandoned() {
    let (url, fake) = fake(|_, _| Reply::Slow(Duration::from_secs(30))).await;
    let provider = Provider::new(ProviderConfig {
        request_timeout: Duration::from_millis(300),
        ..config(&url, false)
    })
    .expect("provider");
    let err = provider
        .complete(&request(), deadline(2))
        .await
        .expect_err("too slow");
    assert_eq!(err.code, ErrorCode::ProviderUnavailable);
    assert!(
        fake.calls() >= 2,
        "timed-out requests are retried within the deadline"
    );
}

#[tokio::test]
async fn a_stream_without_done_is_an_error_not_a_short_answer() {
    let (url, _fake) = fake(|_, _| {
        Reply::Sse(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"half an ans\"}}]}\n\n"
                .into(),
        )
    })
    .await;
    let provider = Provider::new(config(&url, true)).expect("provider");
    let err = provider
        .complete(&request(), deadline(10))
        .await
        .expect_err("truncated");
    assert_eq!(err.code, ErrorCode::ProviderError);
}

#[tokio::test]
async fn malformed_json_is_a_provider_error() {
    let (url, _fake) = fake(|_, _| Reply::Raw("{\"choices\": [ this is not json")).await;
    let provider = Provider::new(config(&url, false)).expect("provider");
    let err = provider
        .complete(&request(), deadline(10))
        .await
        .expect_err("malformed");
    assert_eq!(err.code, ErrorCode::ProviderError);
    // For people: no URL (a URL may carry a key), no type names.
    for never in ["http", "127.0.0.1", "::", "reqwest"] {
        assert!(
            !err.message.contains(never),
            "{never:?} in {:?}",
            err.message
        );
    }
    assert!(err.message.contains("not valid JSON"), "{}", err.message);
}

#[tokio::test]
async fn retry_after_as_an_http_date_is_honoured() {
    // RFC 9110: Retry-After is seconds or an HTTP date; this one is 3 s
    // ahead (whole seconds, so at least 2 s of wait).
    let at = std::time::SystemTime::now() + Duration::from_secs(3);
    let date: &'static str = Box::leak(httpdate::fmt_http_date(at).into_boxed_str());
    let (url, fake) = fake(move |n, _| {
        if n == 0 {
            Reply::Status(503, Some(date))
        } else {
            Reply::Json(text_completion("ok"))
        }
    })
    .await;
    let provider = Provider::new(config(&url, false)).expect("provider");
    let started = std::time::Instant::now();
    let r = provider
        .complete(&request(), deadline(30))
        .await
        .expect("answer after retry");
    assert_eq!(r.content.as_deref(), Some("ok"));
    assert_eq!(fake.calls(), 2);
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the retry waited for the date, not the 0.25 s backoff: {:?}",
        started.elapsed()
    );
}

#[test]
fn retry_after_reads_seconds_and_all_three_http_date_forms() {
    use automesh_engine::provider::retry_after;
    // Sun, 06 Nov 1994 08:49:37 GMT, from RFC 9110 §5.6.7.
    let now = std::time::UNIX_EPOCH + Duration::from_secs(784_111_777 - 10);
    for form in [
        "Sun, 06 Nov 1994 08:49:37 GMT",
        "Sunday, 06-Nov-94 08:49:37 GMT",
        "Sun Nov  6 08:49:37 1994",
    ] {
        assert_eq!(
            retry_after(form, now),
            Some(Duration::from_secs(10)),
            "{form}"
        );
    }
    assert_eq!(retry_after(" 7 ", now), Some(Duration::from_secs(7)));
    let later = now + Duration::from_secs(60);
    assert_eq!(
        retry_after("Sun, 06 Nov 1994 08:49:37 GMT", later),
        Some(Duration::ZERO),
        "a date already past means no wait"
    );
    assert_eq!(retry_after("soon", now), None);
}

#[tokio::test]
async fn multi_byte_text_split_across_chunks_survives() {
    // "é" is two bytes; the fake sends the stream in 1-byte chunks.
    let sse = format!(
        "data: {}\n\ndata: [DONE]\n\n",
        serde_json::json!({"choices": [{"index": 0, "delta": {"content": "café ☕"}}]})
    );
    let (url, _fake) = fake(move |_, _| Reply::SseBytewise(sse.clone())).await;
    let provider = Provider::new(config(&url, true)).expect("provider");
    let r = provider
        .complete(&request(), deadline(10))
        .await
        .expect("answer");
    assert_eq!(r.content.as_deref(), Some("café ☕"));
}
