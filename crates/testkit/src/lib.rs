//! Fakes for what lies outside the project, speaking the real protocols on
//! loopback: an OpenAI-compatible provider (HTTP + SSE) and an MCP server
//! (Streamable HTTP, via rmcp).

use parking_lot::{Mutex, RwLock};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Response, StatusCode};
use axum::middleware::{self, Next};
use axum::routing::post;

// ---- provider ----

/// How the fake provider answers a request (n is 0-based).
pub type Script = Arc<dyn Fn(usize, &serde_json::Value) -> Reply + Send + Sync>;

pub enum Reply {
    Json(serde_json::Value),
    Status(u16, Option<&'static str>),
    Sse(String),
    /// The same, sent one byte per chunk.
    SseBytewise(String),
    Raw(&'static str),
    Slow(Duration),
    /// The JSON answer, after a pause.
    Delayed(Duration, serde_json::Value),
}

#[derive(Clone)]
pub struct FakeProvider {
    script: Script,
    pub calls: Arc<AtomicUsize>,
    pub auth: Arc<Mutex<Vec<String>>>,
    pub bodies: Arc<Mutex<Vec<serde_json::Value>>>,
    /// The `traceparent` header of each request ("" without one).
    pub traceparents: Arc<Mutex<Vec<String>>>,
}

impl FakeProvider {
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

async fn handle(
    State(fake): State<FakeProvider>,
    headers: HeaderMap,
    body: String,
) -> Response<Body> {
    let n = fake.calls.fetch_add(1, Ordering::SeqCst);
    if let Some(a) = headers.get("authorization").and_then(|v| v.to_str().ok()) {
        fake.auth.lock().push(a.to_owned());
    }
    fake.traceparents.lock().push(
        headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned(),
    );
    let request: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    fake.bodies.lock().push(request.clone());
    match (fake.script)(n, &request) {
        Reply::Json(v) => Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(v.to_string()))
            .expect("response"),
        Reply::Status(code, retry_after) => {
            let mut r = Response::builder().status(StatusCode::from_u16(code).expect("status"));
            if let Some(ra) = retry_after {
                r = r.header("retry-after", ra);
            }
            r.body(Body::from("{\"error\":{\"message\":\"scripted\"}}"))
                .expect("response")
        }
        Reply::Sse(text) => Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from(text))
            .expect("response"),
        Reply::SseBytewise(text) => {
            let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                text.into_bytes().into_iter().map(|b| Ok(vec![b])).collect();
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(futures_util::stream::iter(chunks)))
                .expect("response")
        }
        Reply::Raw(text) => Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(text))
            .expect("response"),
        Reply::Delayed(d, v) => {
            tokio::time::sleep(d).await;
            Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(v.to_string()))
                .expect("response")
        }
        Reply::Slow(d) => {
            tokio::time::sleep(d).await;
            Response::builder()
                .body(Body::from("{}"))
                .expect("response")
        }
    }
}

/// Serves the fake provider; returns its base URL (`…/v1`).
pub async fn provider(
    script: impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync + 'static,
) -> (String, FakeProvider) {
    let fake = FakeProvider {
        script: Arc::new(script),
        calls: Arc::default(),
        auth: Arc::default(),
        bodies: Arc::default(),
        traceparents: Arc::default(),
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(handle))
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                axum::Json(serde_json::json!({"object": "list", "data": [
                    {"id": "fake-model", "object": "model", "owned_by": "fake"}]}))
            }),
        )
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/v1", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, fake)
}

pub fn text_completion(text: &str) -> serde_json::Value {
    serde_json::json!({
        "id": "chatcmpl-fake-1", "model": "fake-model-2026",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    })
}

pub fn tool_call_completion(id: &str, name: &str, args: &str) -> serde_json::Value {
    serde_json::json!({
        "id": "chatcmpl-fake-2", "model": "fake-model-2026",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": args}}]},
            "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    })
}

/// The same answer as server-sent events, split into deltas.
pub fn as_sse(v: &serde_json::Value) -> String {
    let message = &v["choices"][0]["message"];
    let mut out = String::new();
    let mut push = |chunk: serde_json::Value| out.push_str(&format!("data: {chunk}\n\n"));
    if let Some(text) = message["content"].as_str() {
        let (a, b) = text.split_at(text.len() / 2);
        for part in [a, b] {
            push(serde_json::json!({"choices": [{"index": 0, "delta": {"content": part}}]}));
        }
    }
    for (i, call) in message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let args = call["function"]["arguments"].as_str().unwrap_or("");
        let (a, b) = args.split_at(args.len() / 2);
        push(
            serde_json::json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": a}}]}}]}),
        );
        push(
            serde_json::json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "function": {"arguments": b}}]}}]}),
        );
    }
    push(
        serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": v["choices"][0]["finish_reason"]}]}),
    );
    push(serde_json::json!({"choices": [], "usage": v["usage"]}));
    out.push_str("data: [DONE]\n\n");
    out
}

// ---- MCP ----

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use tokio_util::sync::CancellationToken;

/// A fake Connect endpoint with a tool list set at runtime.
#[derive(Clone, Default)]
pub struct FakeMcp {
    pub tools: Arc<RwLock<Vec<Tool>>>,
    pub calls: Arc<Mutex<Vec<(String, String)>>>,
    /// The `traceparent` header of each HTTP request ("" without one).
    pub traceparents: Arc<Mutex<Vec<String>>>,
}

pub fn tool(name: &'static str) -> Tool {
    let schema: JsonObject =
        serde_json::json!({"type": "object", "properties": {"query": {"type": "string"}}})
            .as_object()
            .cloned()
            .unwrap_or_default();
    Tool::new(name, format!("the {name} tool"), Arc::new(schema))
}

impl FakeMcp {
    pub fn with_tools(names: &[&'static str]) -> Self {
        let fake = FakeMcp::default();
        *fake.tools.write() = names.iter().map(|n| tool(n)).collect();
        fake
    }
}

impl ServerHandler for FakeMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("fake-connect", "0.0.0"))
    }

    async fn list_tools(
        &self,
        _r: Option<PaginatedRequestParams>,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let tools = self.tools.read().clone();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        r: CallToolRequestParams,
        _cx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = serde_json::Value::Object(r.arguments.clone().unwrap_or_default());
        self.calls
            .lock()
            .push((r.name.to_string(), args.to_string()));
        if args.get("slow").and_then(|v| v.as_bool()) == Some(true) {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "{} found: mail.send",
            r.name
        ))])
        .into())
    }
}

/// A fake Connect endpoint with exactly the two reviewed tools
/// (`search_capabilities`, `execute_capability`), requiring `Bearer <token>`.
pub async fn connect(token: &str) -> (String, CancellationToken) {
    mcp(
        FakeMcp::with_tools(&["search_capabilities", "execute_capability"]),
        token,
    )
    .await
}

/// Serves the fake MCP endpoint at `…/mcp`, requiring `Bearer <token>`.
pub async fn mcp(fake: FakeMcp, token: &str) -> (String, CancellationToken) {
    let ct = CancellationToken::new();
    let fake_traceparents = fake.traceparents.clone();
    let service: StreamableHttpService<FakeMcp, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(fake.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_sse_keep_alive(None)
            .with_cancellation_token(ct.child_token()),
    );
    let traceparents = fake_traceparents;
    let app = automesh_rpc::http::require_bearer(
        Router::new().nest_service("/mcp", service),
        token,
        "unauthorized",
    )
    // Outermost: every request's trace context is recorded, refused or not.
    .layer(middleware::from_fn(move |req: Request, next: Next| {
        {
            let mut t = traceparents.lock();
            t.push(
                req.headers()
                    .get("traceparent")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
        next.run(req)
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/mcp", listener.local_addr().expect("addr"));
    let stop = ct.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled_owned().await })
            .await;
    });
    (url, ct)
}
