//! What `automesh dev` serves when no model provider or Connect endpoint is
//! configured, so that a first run does the product's main job end to end:
//!
//! - **the demo model**: an OpenAI-compatible chat-completions endpoint
//!   (`POST /v1/chat/completions`, JSON or server-sent events, bearer key
//!   required). It is deterministic: given the two Connect tools it calls
//!   `search_capabilities` once, then `execute_capability` once on the best
//!   match, then answers with a summary of what the tool returned. It reports
//!   token usage (about four characters a token) and names itself
//!   `automesh-demo`.
//! - **the demo Connect endpoint**: an MCP server over Streamable HTTP (bearer
//!   token required) with exactly the two reviewed tools over a small
//!   catalogue of demo capabilities (mail, calendar, weather, files, notes)
//!   that answer with canned demo data.
//!
//! Both are real HTTP on loopback, so the real native engine, MCP client,
//! worker agent and runner run unchanged against them. Everything they say is
//! labelled as demo. This is not a test fake: it is the smallest honest
//! stand-in for the outside world, and `dev` uses a configured provider or
//! Connect endpoint instead whenever one is given.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The name the demo model answers as (and the provider name `dev` maps
/// every catalogue model to while the demo model serves it).
pub const DEMO_MODEL: &str = "automesh-demo";

/// Every answer of the demo model starts with this label.
pub const MODEL_LABEL: &str = "[automesh demo model]";

/// One capability of the demo catalogue: its id, what it does, and the demo
/// data it answers with.
struct Capability {
    id: &'static str,
    description: &'static str,
    answer: &'static str,
}

const CATALOGUE: [Capability; 5] = [
    Capability {
        id: "mail.unread",
        description: "List unread email in the inbox, newest first",
        answer: "3 unread messages (demo data): Ana Ruiz — \"Q3 numbers\" (today 08:12); \
                 Build bot — \"nightly build green\" (today 06:00); \
                 Sam Lee — \"lunch on Thursday?\" (yesterday 18:40)",
    },
    Capability {
        id: "calendar.today",
        description: "List today's calendar events and meetings",
        answer: "2 events today (demo data): 09:30 stand-up (15 min); \
                 14:00 design review with Ana and Sam (1 h)",
    },
    Capability {
        id: "weather.forecast",
        description: "Weather forecast for a city for today and tomorrow",
        answer: "Paris (demo data): today 14 °C, light rain; tomorrow 17 °C, sunny",
    },
    Capability {
        id: "files.recent",
        description: "Recently changed files in the downloads folder",
        answer: "4 recent files (demo data): report-q3.pdf (2.1 MB), invoice-0042.pdf, \
                 photo-001.jpg, notes.txt",
    },
    Capability {
        id: "notes.create",
        description: "Create a note with a title and text",
        answer: "note created (demo data): \"Demo note\"",
    },
];

/// Words too common to say what a prompt is about.
const STOP_WORDS: [&str; 14] = [
    "the", "and", "for", "what", "with", "you", "your", "are", "this", "that", "from", "about",
    "please", "all",
];

/// The demo catalogue's best matches for `query`: capabilities sharing the
/// most words (of three letters or more) with it, best first; the whole
/// catalogue when nothing matches, so a demo run always has something to do.
fn search(query: &str) -> Vec<&'static Capability> {
    let words: Vec<String> = query
        .to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.len() >= 3 && !STOP_WORDS.contains(w))
        .map(|w| w.trim_end_matches('s').to_owned())
        .collect();
    let score = |c: &Capability| {
        let text = format!("{} {}", c.id, c.description).to_lowercase();
        words.iter().filter(|w| text.contains(w.as_str())).count()
    };
    let mut found: Vec<&Capability> = CATALOGUE.iter().filter(|c| score(c) > 0).collect();
    found.sort_by_key(|c| std::cmp::Reverse(score(c)));
    if found.is_empty() {
        found = CATALOGUE.iter().collect();
    }
    found.truncate(3);
    found
}

// ---- the demo model ----

#[derive(Clone)]
struct ModelState {
    /// `Bearer <key>`.
    authorization: Arc<str>,
}

/// Roughly what a tokenizer would count: four characters a token.
fn tokens(text: &str) -> i64 {
    let chars = text.chars().count() as i64;
    ((chars + 3) / 4).max(1)
}

/// The text of a chat message's content (a string, or text parts).
fn content_text(message: &Value) -> String {
    match &message["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// What the demo model does next, given the conversation so far.
enum Turn {
    Call { name: &'static str, args: Value },
    Say(String),
}

fn next_turn(body: &Value) -> Turn {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let prompt = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .map(content_text)
        .unwrap_or_default();
    // Only what came after the user's prompt counts.
    let since_prompt: Vec<&Value> = messages
        .iter()
        .rev()
        .take_while(|m| m["role"] != "user")
        .collect();
    let results: Vec<String> = since_prompt
        .iter()
        .rev()
        .filter(|m| m["role"] == "tool")
        .map(|m| content_text(m))
        .collect();
    let offered = |name: &str| {
        body["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["function"]["name"] == name))
    };
    let short: String = prompt.chars().take(120).collect();
    match results.len() {
        0 if offered("search_capabilities") => Turn::Call {
            name: "search_capabilities",
            args: json!({ "query": short }),
        },
        1 if offered("execute_capability") => {
            let found: Value = serde_json::from_str(&results[0]).unwrap_or(Value::Null);
            let id = found["capabilities"][0]["id"]
                .as_str()
                .unwrap_or("mail.unread")
                .to_owned();
            Turn::Call {
                name: "execute_capability",
                args: json!({ "capability": id, "input": {} }),
            }
        }
        0 => Turn::Say(format!(
            "{MODEL_LABEL} No tools were offered, so here is your prompt back: \"{short}\"."
        )),
        _ => {
            let outcome: String = results
                .last()
                .map(|r| r.chars().take(400).collect())
                .unwrap_or_default();
            Turn::Say(format!(
                "{MODEL_LABEL} For \"{short}\" I searched the capabilities once and ran the best \
                 match once. It returned: {outcome}. Summary: that is everything the demo \
                 catalogue knows; configure a real model provider and Connect endpoint for real \
                 answers."
            ))
        }
    }
}

async fn completions(
    State(state): State<ModelState>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let authorized = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == &*state.authorization);
    if !authorized {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(json!({"error": {"message": "the demo model needs its API key", "type": "invalid_request_error"}})),
        )
            .into_response();
    }
    let Ok(body) = serde_json::from_str::<Value>(&body) else {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": {"message": "the request body is not JSON", "type": "invalid_request_error"}})),
        )
            .into_response();
    };
    let prompt_tokens: i64 = body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| tokens(&content_text(m)) + 4)
        .sum();
    let turn = next_turn(&body);
    let (message, finish, output) = match &turn {
        Turn::Call { name, args } => {
            let call_id = format!("call_demo_{name}");
            (
                json!({"role": "assistant", "content": null, "tool_calls": [{
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args.to_string()}}]}),
                "tool_calls",
                args.to_string(),
            )
        }
        Turn::Say(text) => (
            json!({"role": "assistant", "content": text}),
            "stop",
            text.clone(),
        ),
    };
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tokens(&output),
        "total_tokens": prompt_tokens + tokens(&output),
    });
    let id = format!("chatcmpl-demo-{}", uuid::Uuid::new_v4().simple());
    if body["stream"] != true {
        return axum::Json(json!({
            "id": id, "object": "chat.completion", "model": DEMO_MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        }))
        .into_response();
    }
    // The same answer as server-sent events, in OpenAI's chunk shapes.
    let mut events = vec![];
    let chunk = |delta: Value, finish: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "model": DEMO_MODEL,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    events.push(chunk(json!({"role": "assistant"}), Value::Null));
    match &turn {
        Turn::Say(text) => {
            for piece in text.split_inclusive(' ').collect::<Vec<_>>().chunks(8) {
                events.push(chunk(json!({"content": piece.concat()}), Value::Null));
            }
        }
        Turn::Call { .. } => {
            events.push(chunk(
                json!({"tool_calls": [{"index": 0, "id": message["tool_calls"][0]["id"],
                    "type": "function", "function": {"name": message["tool_calls"][0]["function"]["name"], "arguments": ""}}]}),
                Value::Null,
            ));
            events.push(chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": output}}]}),
                Value::Null,
            ));
        }
    }
    events.push(chunk(json!({}), json!(finish)));
    if body["stream_options"]["include_usage"] == true {
        events.push(
            json!({"id": id, "object": "chat.completion.chunk", "model": DEMO_MODEL,
                           "choices": [], "usage": usage}),
        );
    }
    let mut text: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    text.push_str("data: [DONE]\n\n");
    ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response()
}

/// Serves the demo model on `listener` (base URL `http://<addr>/v1`) until
/// `shutdown`; requests must carry `Authorization: Bearer <key>`.
pub async fn serve_model(listener: TcpListener, key: String, shutdown: CancellationToken) {
    let state = ModelState {
        authorization: format!("Bearer {key}").into(),
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .route(
            "/v1/models",
            get(|| async {
                axum::Json(json!({"object": "list", "data": [
                    {"id": DEMO_MODEL, "object": "model", "owned_by": "automesh"}]}))
            }),
        )
        .with_state(state);
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await;
}

// ---- the demo Connect endpoint ----

#[derive(Clone, Default)]
struct DemoConnect;

fn schema(value: Value) -> Arc<JsonObject> {
    Arc::new(value.as_object().cloned().unwrap_or_default())
}

impl ServerHandler for DemoConnect {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_server_info(
            Implementation::new("automesh-demo-connect", env!("CARGO_PKG_VERSION")),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _cx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![
            Tool::new(
                "search_capabilities",
                "Search the (demo) catalogue of capabilities for ones matching a query",
                schema(json!({"type": "object", "required": ["query"],
                    "properties": {"query": {"type": "string", "description": "What you want to do"}}})),
            ),
            Tool::new(
                "execute_capability",
                "Run one (demo) capability by its id",
                schema(json!({"type": "object", "required": ["capability"],
                    "properties": {"capability": {"type": "string", "description": "A capability id from search_capabilities"},
                                   "input": {"type": "object", "description": "The capability's input"}}})),
            ),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _cx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.clone().unwrap_or_default();
        let text = |key: &str| args.get(key).and_then(Value::as_str).unwrap_or_default();
        let result = match request.name.as_ref() {
            "search_capabilities" => {
                let found: Vec<Value> = search(text("query"))
                    .into_iter()
                    .map(|c| json!({"id": c.id, "description": c.description}))
                    .collect();
                CallToolResult::success(vec![ContentBlock::text(
                    json!({"capabilities": found, "catalogue": "automesh demo catalogue"})
                        .to_string(),
                )])
            }
            "execute_capability" => match CATALOGUE.iter().find(|c| c.id == text("capability")) {
                Some(c) => CallToolResult::success(vec![ContentBlock::text(c.answer)]),
                None => CallToolResult::error(vec![ContentBlock::text(format!(
                    "unknown capability {:?}; search_capabilities lists the demo catalogue",
                    text("capability")
                ))]),
            },
            other => {
                return Err(ErrorData::invalid_params(
                    format!("no tool {other:?}"),
                    None,
                ));
            }
        };
        Ok(result.into())
    }
}

/// Serves the demo Connect endpoint at `http://<addr>/mcp` until `shutdown`;
/// every request must carry `Authorization: Bearer <token>`.
pub async fn serve_connect(listener: TcpListener, token: String, shutdown: CancellationToken) {
    let service: StreamableHttpService<DemoConnect, LocalSessionManager> =
        StreamableHttpService::new(
            || Ok(DemoConnect),
            Arc::new(LocalSessionManager::default()),
            StreamableHttpServerConfig::default()
                .with_sse_keep_alive(None)
                .with_cancellation_token(shutdown.child_token()),
        );
    let app = automesh_rpc::http::require_bearer(
        Router::new().nest_service("/mcp", service),
        &token,
        "the demo Connect endpoint needs its token",
    );
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool_message(text: &str) -> Value {
        json!({"role": "tool", "tool_call_id": "c", "content": text})
    }

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "search_capabilities"}},
               {"type": "function", "function": {"name": "execute_capability"}}])
    }

    #[test]
    fn the_demo_model_searches_then_executes_then_summarises() {
        let user = json!({"role": "user", "content": "summarise my unread inbox"});
        let mut body = json!({"messages": [user.clone()], "tools": tools()});
        let Turn::Call { name, args } = next_turn(&body) else {
            panic!("a tool call first")
        };
        assert_eq!(name, "search_capabilities");
        assert_eq!(args["query"], "summarise my unread inbox");

        let found = json!({"capabilities": search("summarise my unread inbox")
            .into_iter().map(|c| json!({"id": c.id})).collect::<Vec<_>>()});
        body["messages"] =
            json!([user.clone(), {"role": "assistant"}, tool_message(&found.to_string())]);
        let Turn::Call { name, args } = next_turn(&body) else {
            panic!("then the best match")
        };
        assert_eq!(name, "execute_capability");
        assert_eq!(args["capability"], "mail.unread");

        body["messages"] = json!([user, {"role": "assistant"}, tool_message("x"),
            {"role": "assistant"}, tool_message("3 unread messages (demo data)")]);
        let Turn::Say(text) = next_turn(&body) else {
            panic!("then a summary")
        };
        assert!(text.starts_with(MODEL_LABEL), "{text}");
        assert!(text.contains("3 unread messages (demo data)"), "{text}");
    }

    #[test]
    fn search_ranks_by_shared_words_and_never_comes_back_empty() {
        assert_eq!(
            search("what's the weather in Paris")[0].id,
            "weather.forecast"
        );
        assert_eq!(search("my meetings today")[0].id, "calendar.today");
        assert_eq!(search("zzz").len(), 3);
    }

    #[test]
    fn tokens_are_about_four_characters() {
        assert_eq!(tokens(""), 1);
        assert_eq!(tokens("abcd"), 1);
        assert_eq!(tokens("abcde"), 2);
    }
}
