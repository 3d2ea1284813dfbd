//! An OpenAI-compatible `/chat/completions` client, non-streaming and
//! streaming (SSE with tool-call deltas and `stream_options.include_usage`).
//!
//! Fail closed: a provider kind outside the allowlist is refused before any
//! request (`provider_unavailable`); 401/403 end at once; 429 and 5xx are
//! retried with backoff that honours `Retry-After`, inside the caller's
//! deadline; a stream that ends without `[DONE]` or breaks is an error, not
//! a short answer. The API key travels only as the `Authorization` header.

use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_domain::Secret;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::time::Instant;

use automesh_domain::CodedError;

/// Provider kinds the engine speaks: both are the OpenAI wire protocol.
pub const ALLOWED_KINDS: &[&str] = &["openai-compatible", "openai"];

/// Where and how to reach a provider.
#[derive(Clone, Debug)]
pub struct ProviderConfig {
    /// One of [`ALLOWED_KINDS`]; anything else is refused.
    pub kind: String,
    /// Such as `https://api.openai.com/v1`; `/chat/completions` is appended.
    pub base_url: String,
    pub api_key: Secret,
    /// Bound on one HTTP request (120 s by default).
    pub request_timeout: Duration,
    /// Use `stream: true` and parse server-sent events.
    pub stream: bool,
}

/// One message of the conversation, in the wire format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn system(text: impl Into<String>) -> Self {
        Self::text("system", text)
    }
    pub fn user(text: impl Into<String>) -> Self {
        Self::text("user", text)
    }
    pub fn tool_result(call_id: &str, text: impl Into<String>) -> Self {
        Message {
            role: "tool".into(),
            content: Some(text.into()),
            tool_calls: vec![],
            tool_call_id: Some(call_id.to_owned()),
        }
    }
    fn text(role: &str, text: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: Some(text.into()),
            tool_calls: vec![],
            tool_call_id: None,
        }
    }
}

/// A tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text, as the model produced it.
    pub arguments: String,
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments.
    pub parameters: Value,
}

/// One request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
}

/// Token counts of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct TokenUsage {
    #[serde(default)]
    pub prompt_tokens: i64,
    #[serde(default)]
    pub completion_tokens: i64,
}

/// What the model answered.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatResponse {
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: Option<String>,
    pub usage: TokenUsage,
    /// The completion's id and the model that answered, as the provider
    /// names them.
    pub id: Option<String>,
    pub model: Option<String>,
}

/// The client of one provider.
#[derive(Debug, Clone)]
pub struct Provider {
    http: reqwest::Client,
    config: ProviderConfig,
}

fn unavailable(message: impl Into<String>) -> CodedError {
    CodedError::new(ErrorCode::ProviderUnavailable, message)
}

fn malformed(message: impl Into<String>) -> CodedError {
    CodedError::new(ErrorCode::ProviderError, message)
}

impl Provider {
    /// A client, or `provider_unavailable` for a kind outside the allowlist
    /// (checked before any request is made).
    pub fn new(config: ProviderConfig) -> Result<Self, CodedError> {
        if !ALLOWED_KINDS.contains(&config.kind.as_str()) {
            return Err(unavailable(format!(
                "provider kind {:?} is not an OpenAI-compatible provider; allowed: {}",
                config.kind,
                ALLOWED_KINDS.join(", ")
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| {
                unavailable(format!("cannot build the HTTP client: {}", e.without_url()))
            })?;
        Ok(Self { http, config })
    }

    fn url(&self) -> String {
        format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        )
    }

    /// The provider's host and port, for `server.address`/`server.port`.
    pub fn server(&self) -> (String, u16) {
        crate::trace::server_of(&self.config.base_url)
    }

    fn body(&self, req: &ChatRequest) -> Value {
        let mut body = serde_json::json!({
            "model": req.model,
            "messages": req.messages,
        });
        if !req.tools.is_empty() {
            body["tools"] = Value::Array(
                req.tools
                    .iter()
                    .map(|t| {
                        serde_json::json!({
                            "type": "function",
                            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                        })
                    })
                    .collect(),
            );
            body["tool_choice"] = "auto".into();
        }
        if self.config.stream {
            body["stream"] = true.into();
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        body
    }

    /// One completion, retried on 429/5xx and timeouts until `deadline`.
    /// Dropping the future drops the in-flight request (abort).
    pub async fn complete(
        &self,
        req: &ChatRequest,
        deadline: Instant,
    ) -> Result<ChatResponse, CodedError> {
        let body = self.body(req);
        let mut backoff = Duration::from_millis(250);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(unavailable(
                    "the provider did not answer successfully before the deadline",
                ));
            }
            let timeout = self.config.request_timeout.min(remaining);
            let outcome = tokio::time::timeout(timeout, self.once(&body)).await;
            let retry_after = match outcome {
                Ok(Ok(response)) => return Ok(response),
                Ok(Err(Failure::Fatal(e))) => return Err(e),
                Ok(Err(Failure::Retryable {
                    status,
                    retry_after,
                })) => {
                    tracing::warn!(status, attempt, "provider answered with a retryable status");
                    crate::metrics::metrics().retried(status);
                    retry_after
                }
                Err(_) => {
                    tracing::warn!(
                        attempt,
                        timeout_ms = timeout.as_millis() as u64,
                        "provider request timed out"
                    );
                    None
                }
            };
            let wait = retry_after.unwrap_or(backoff).min(Duration::from_secs(30));
            if Instant::now() + wait >= deadline {
                return Err(unavailable(format!(
                    "the provider kept failing ({attempt} attempts) until the deadline"
                )));
            }
            tokio::time::sleep(wait).await;
            backoff = (backoff * 2).min(Duration::from_secs(8));
        }
    }

    async fn once(&self, body: &Value) -> Result<ChatResponse, Failure> {
        let response = self
            .http
            .post(self.url())
            .bearer_auth(self.config.api_key.expose())
            // The provider's side of the call joins the run's trace.
            .headers(crate::trace::headers())
            .json(body)
            .send()
            .await
            .map_err(|e| {
                Failure::Retryable {
                    status: 0,
                    retry_after: None,
                }
                .log(e)
            })?;
        let status = response.status();
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
            return Err(Failure::Fatal(unavailable(format!(
                "the provider refused the credentials ({status})"
            ))));
        }
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| retry_after(v, std::time::SystemTime::now()));
            return Err(Failure::Retryable {
                status: status.as_u16(),
                retry_after,
            });
        }
        if !status.is_success() {
            return Err(Failure::Fatal(malformed(format!(
                "the provider answered {status}"
            ))));
        }
        if self.config.stream {
            read_stream(response).await.map_err(Failure::Fatal)
        } else {
            // Read, then parsed here: a decoding error of the HTTP client
            // names the URL, and a URL may carry a key.
            let body = response.bytes().await.map_err(|e| {
                tracing::warn!(error = %e.without_url(), "the provider's answer broke off");
                Failure::Fatal(malformed("the provider's answer broke off"))
            })?;
            let value: Value = serde_json::from_slice(&body).map_err(|e| {
                Failure::Fatal(malformed(format!(
                    "the provider's answer is not valid JSON ({e})"
                )))
            })?;
            parse_completion(&value).map_err(Failure::Fatal)
        }
    }
}

enum Failure {
    Fatal(CodedError),
    Retryable {
        status: u16,
        retry_after: Option<Duration>,
    },
}

impl Failure {
    fn log(self, e: reqwest::Error) -> Self {
        // Without its URL (which may carry a key); never headers.
        tracing::warn!(error = %e.without_url(), "provider request failed");
        self
    }
}

/// A `Retry-After` value (RFC 9110 §10.2.3): a number of seconds, or an
/// HTTP date (IMF-fixdate, or the obsolete RFC 850 and asctime forms) —
/// the wait until then, none for a date already past.
pub fn retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

fn parse_completion(v: &Value) -> Result<ChatResponse, CodedError> {
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| malformed("response without choices"))?;
    let message = choice
        .get("message")
        .ok_or_else(|| malformed("choice without message"))?;
    let tool_calls: Vec<ToolCall> = match message.get("tool_calls") {
        None | Some(Value::Null) => vec![],
        Some(calls) => serde_json::from_value(calls.clone())
            .map_err(|e| malformed(format!("malformed tool calls: {e}")))?,
    };
    let usage = v
        .get("usage")
        .map(|u| serde_json::from_value(u.clone()).unwrap_or_default())
        .unwrap_or_default();
    Ok(ChatResponse {
        content: message
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_owned),
        tool_calls,
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned),
        usage,
        id: v.get("id").and_then(Value::as_str).map(str::to_owned),
        model: v.get("model").and_then(Value::as_str).map(str::to_owned),
    })
}

/// The longest SSE line accepted (a bound on what one event may buffer).
const MAX_LINE_BYTES: usize = 4 * 1024 * 1024;

/// A tool call assembled from stream deltas.
#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

async fn read_stream(response: reqwest::Response) -> Result<ChatResponse, CodedError> {
    let mut bytes = response.bytes_stream();
    // Bytes, not text: a multi-byte character may be split across chunks;
    // only whole lines are decoded.
    let mut buffer: Vec<u8> = Vec::new();
    let mut content: Option<String> = None;
    let mut calls: Vec<PartialCall> = vec![];
    let mut finish_reason = None;
    let mut usage = TokenUsage::default();
    let mut done = false;
    let (mut id, mut model) = (None, None);
    while let Some(chunk) = bytes.next().await {
        let chunk = chunk.map_err(|e| {
            tracing::warn!(error = %e.without_url(), "the provider's stream broke off");
            malformed("the provider's stream broke off")
        })?;
        buffer.extend_from_slice(&chunk);
        if buffer.len() > MAX_LINE_BYTES {
            return Err(malformed("a stream line exceeds the size bound"));
        }
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let raw: Vec<u8> = buffer.drain(..=end).collect();
            let line =
                String::from_utf8(raw).map_err(|_| malformed("a stream line is not UTF-8"))?;
            let line = line.trim();
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data)
                .map_err(|e| malformed(format!("a stream event is not valid JSON ({e})")))?;
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                usage = serde_json::from_value(u.clone()).unwrap_or_default();
            }
            if id.is_none() {
                id = v.get("id").and_then(Value::as_str).map(str::to_owned);
            }
            if model.is_none() {
                model = v.get("model").and_then(Value::as_str).map(str::to_owned);
            }
            let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
                continue;
            };
            if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
                finish_reason = Some(r.to_owned());
            }
            let Some(delta) = choice.get("delta") else {
                continue;
            };
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                content.get_or_insert_with(String::new).push_str(text);
            }
            for call in delta
                .get("tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let index = call.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                if index >= 64 {
                    return Err(malformed("too many tool calls in one response"));
                }
                while calls.len() <= index {
                    calls.push(PartialCall::default());
                }
                let slot = &mut calls[index];
                if let Some(id) = call.get("id").and_then(Value::as_str) {
                    slot.id = id.to_owned();
                }
                if let Some(f) = call.get("function") {
                    if let Some(n) = f.get("name").and_then(Value::as_str) {
                        slot.name.push_str(n);
                    }
                    if let Some(a) = f.get("arguments").and_then(Value::as_str) {
                        slot.arguments.push_str(a);
                    }
                }
            }
        }
    }
    if !done {
        return Err(malformed("the stream ended without [DONE]"));
    }
    Ok(ChatResponse {
        content,
        tool_calls: calls
            .into_iter()
            .map(|c| ToolCall {
                id: c.id,
                kind: function_type(),
                function: FunctionCall {
                    name: c.name,
                    arguments: c.arguments,
                },
            })
            .collect(),
        finish_reason,
        usage,
        id,
        model,
    })
}
