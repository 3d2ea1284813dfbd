//! The OpenCode adapter (SPEC §8): drives a local `opencode serve` (1.18;
//! older releases' permission events too) over HTTP + SSE, headless.
//!
//! - **Never a hang.** Every HTTP request has a bound; the server's
//!   readiness is awaited (bounded) before anything else; an idle watchdog
//!   ends a session without progress; the run deadline bounds everything.
//!   The watchdog is reset by any event *about the run's sessions* — status
//!   changes, message and part updates (tool state changes included),
//!   permission events — and never by the server's own heartbeats, so a
//!   session that stays busy, waits on a prompt or keeps retrying after its
//!   last real event is ended with a named error.
//! - **Permissions under an explicit policy** ([`PermissionPolicy`]): a
//!   prompt whose kind and patterns the allow-list covers is answered
//!   `once`; any other is answered `reject`, the session is aborted and the
//!   run ends `permission_denied` naming the permission. Both
//!   `permission.asked` (1.18, `POST /permission/{id}/reply`) and the older
//!   `permission.updated` (`POST /session/{id}/permissions/{id}`) are
//!   handled. Prompts raised by child sessions (sub-agents, linked by
//!   `parentID`) are answered like the parent's.
//! - **A model failing forever** (OpenCode retries 5xx with backoff and no
//!   error event) ends `provider_unavailable` after `max_model_retries`.
//! - **A dropped event stream** (it has no replay) is reopened and the state
//!   recovered from `GET /permission`, `GET /session/status` and the
//!   session's messages; events are deduplicated by part and call id.
//! - Tool inputs are read from the `running`/`completed` states, never from
//!   `pending` (which carries an empty input).
//! - Cancellation aborts the session and waits, bounded, for it to be idle.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use automesh_domain::{ErrorCode, Usage};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::adapter::EngineRequest;
use crate::error::EngineError;
use crate::native::{Ending, EngineEvent, Outcome};

/// The longest SSE line accepted.
const MAX_LINE: usize = 8 * 1024 * 1024;

/// One allow-list entry: a permission kind (`bash`, `edit`, `read`, …, or
/// `*`) and the patterns it covers (`*` wildcards; empty = any pattern).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionRule {
    pub permission: String,
    #[serde(default)]
    pub patterns: Vec<String>,
}

/// The headless permission policy of a run: what is not allowed is
/// rejected and ends the run `permission_denied`. The default allows
/// nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionPolicy {
    #[serde(default)]
    pub allow: Vec<PermissionRule>,
}

/// Policies per automation, with a default; read from a JSON document:
/// `{"default": {"allow": [...]}, "automations": {"<id>": {"allow": [...]}}}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyBook {
    #[serde(default)]
    pub default: PermissionPolicy,
    #[serde(default)]
    pub automations: HashMap<String, PermissionPolicy>,
}

impl PolicyBook {
    pub fn for_automation(&self, automation_id: &str) -> &PermissionPolicy {
        self.automations.get(automation_id).unwrap_or(&self.default)
    }
}

/// `*` matches any run of characters; everything else literally.
pub fn glob(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let mut rest = text;
    for (i, part) in parts.iter().enumerate() {
        if i == 0 {
            let Some(r) = rest.strip_prefix(part) else {
                return false;
            };
            rest = r;
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            match rest.find(part) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
    }
    true
}

impl PermissionPolicy {
    /// Whether a prompt for `permission` over `patterns` is allowed: one
    /// rule of that kind must cover every pattern.
    pub fn allows(&self, permission: &str, patterns: &[String]) -> bool {
        self.allow.iter().any(|rule| {
            (rule.permission == "*" || rule.permission == permission)
                && (rule.patterns.is_empty()
                    || patterns
                        .iter()
                        .all(|p| rule.patterns.iter().any(|r| glob(r, p))))
        })
    }
}

/// How to reach and bound an OpenCode server.
#[derive(Clone)]
pub struct OpenCodeConfig {
    /// Such as `http://127.0.0.1:4096`.
    pub base_url: String,
    /// HTTP Basic credentials, when the server has a password.
    pub username: String,
    pub password: Option<String>,
    /// The project directory (`?directory=`), or the server's own.
    pub directory: Option<String>,
    /// Time without progress of the session after which it is ended.
    pub idle_timeout: Duration,
    /// Bound on each HTTP request.
    pub request_timeout: Duration,
    /// Bound on waiting for the server to answer its health check.
    pub ready_timeout: Duration,
    /// Bound on waiting for idle after an abort.
    pub cancel_timeout: Duration,
    /// Retries of a failing model after which the run ends.
    pub max_model_retries: u64,
}

impl std::fmt::Debug for OpenCodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenCodeConfig")
            .field("base_url", &self.base_url)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("directory", &self.directory)
            .field("idle_timeout", &self.idle_timeout)
            .finish_non_exhaustive()
    }
}

impl OpenCodeConfig {
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            username: "opencode".into(),
            password: None,
            directory: None,
            idle_timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(10),
            ready_timeout: Duration::from_secs(30),
            cancel_timeout: Duration::from_secs(10),
            max_model_retries: 3,
        }
    }
}

/// A `opencode serve` child process, killed when dropped.
#[derive(Debug)]
pub struct OpenCodeServer {
    pub base_url: String,
    child: tokio::process::Child,
}

impl OpenCodeServer {
    /// Starts `binary serve` in `directory` on a free loopback port with
    /// `env` added, and waits (bounded by `ready_timeout`) until it says
    /// where it listens.
    pub async fn start(
        binary: &Path,
        directory: &Path,
        env: &[(String, String)],
        ready_timeout: Duration,
    ) -> Result<OpenCodeServer, EngineError> {
        let missing = |e: std::io::Error| {
            EngineError::new(
                ErrorCode::RuntimeMissing,
                format!("cannot start OpenCode ({}): {e}", binary.display()),
            )
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(missing)?
            .port();
        let mut child = tokio::process::Command::new(binary)
            .args([
                "serve",
                "--hostname",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .current_dir(directory)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(missing)?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        if let Some(stderr) = stderr {
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::debug!(target: "opencode", "{line}");
                }
            });
        }
        let Some(stdout) = stdout else {
            return Err(EngineError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode has no stdout",
            ));
        };
        let (tx, mut rx) = mpsc::channel::<String>(1);
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            let mut tx = Some(tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(at) = line.find("listening on ")
                    && let Some(t) = tx.take()
                {
                    let _ = t
                        .send(line[at + "listening on ".len()..].trim().to_owned())
                        .await;
                }
                tracing::debug!(target: "opencode", "{line}");
            }
        });
        match tokio::time::timeout(ready_timeout, rx.recv()).await {
            Ok(Some(url)) => Ok(OpenCodeServer {
                base_url: url,
                child,
            }),
            Ok(None) => Err(EngineError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode exited before it listened",
            )),
            Err(_) => {
                let _ = child.start_kill();
                Err(EngineError::new(
                    ErrorCode::ReadinessTimeout,
                    format!("OpenCode did not listen within {ready_timeout:?}"),
                ))
            }
        }
    }

    /// Kills the server at once.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// The isolated environment a headless OpenCode is started with: its own
/// HOME and XDG directories under `root`, updates, sharing and downloads off,
/// and the config (JSON) inline.
pub fn isolated_env(root: &Path, config_json: &str) -> Vec<(String, String)> {
    let home: PathBuf = root.join("home");
    let p = |sub: &str| home.join(sub).to_string_lossy().into_owned();
    vec![
        ("HOME".into(), home.to_string_lossy().into_owned()),
        ("XDG_CONFIG_HOME".into(), p(".config")),
        ("XDG_DATA_HOME".into(), p(".local/share")),
        ("XDG_CACHE_HOME".into(), p(".cache")),
        ("XDG_STATE_HOME".into(), p(".local/state")),
        ("OPENCODE_DISABLE_AUTOUPDATE".into(), "1".into()),
        ("OPENCODE_DISABLE_MODELS_FETCH".into(), "1".into()),
        ("OPENCODE_DISABLE_SHARE".into(), "1".into()),
        ("OPENCODE_DISABLE_LSP_DOWNLOAD".into(), "1".into()),
        ("OPENCODE_DISABLE_CLAUDE_CODE".into(), "1".into()),
        ("OPENCODE_CONFIG_CONTENT".into(), config_json.into()),
    ]
}

/// Event types that carry nothing for a run: ignored on purpose.
pub const IGNORED_EVENTS: &[&str] = &[
    "server.connected",
    "server.heartbeat",
    "server.instance.disposed",
    "global.disposed",
    "plugin.added",
    "catalog.updated",
    "reference.updated",
    "integration.updated",
    "installation.updated",
    "installation.update-available",
    "project.updated",
    "vcs.branch.updated",
    "file.edited",
    "file.watcher.updated",
    "lsp.updated",
    "lsp.client.diagnostics",
    "mcp.tools.changed",
    "command.executed",
    "tui.prompt.append",
    "tui.command.execute",
    "tui.toast.show",
    "ide.installed",
    "pty.created",
    "pty.updated",
    "pty.exited",
    "pty.deleted",
    "sync",
    "session.diff",
    "session.compacted",
    "session.deleted",
    "todo.updated",
    "message.part.delta",
    "message.part.removed",
    "message.removed",
    "permission.replied",
    "question.replied",
    "question.rejected",
];

/// Incremental SSE decoding: whole lines only, `data:` payloads out.
#[derive(Default)]
struct SseLines {
    buf: Vec<u8>,
    data: String,
}

impl SseLines {
    fn push(&mut self, chunk: &[u8], out: &mut Vec<String>) -> Result<(), EngineError> {
        self.buf.extend_from_slice(chunk);
        while let Some(nl) = self.buf.iter().position(|b| *b == b'\n') {
            let raw: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&raw);
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if !self.data.is_empty() {
                    out.push(std::mem::take(&mut self.data));
                }
            } else if let Some(d) = line.strip_prefix("data:") {
                if !self.data.is_empty() {
                    self.data.push('\n');
                }
                self.data.push_str(d.trim_start());
            }
        }
        if self.buf.len() > MAX_LINE || self.data.len() > MAX_LINE {
            return Err(EngineError::new(
                ErrorCode::RuntimeFailed,
                "an OpenCode event exceeds the size bound",
            ));
        }
        Ok(())
    }
}

struct EventStream {
    body:
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Vec<u8>, reqwest::Error>> + Send>>,
    lines: SseLines,
    ready: std::collections::VecDeque<String>,
}

impl EventStream {
    /// The next event, `None` when the stream ended or broke.
    async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(d) = self.ready.pop_front() {
                match serde_json::from_str(&d) {
                    Ok(v) => return Some(v),
                    Err(_) => continue,
                }
            }
            let chunk = self.body.next().await?;
            let chunk = chunk.ok()?;
            let mut out = vec![];
            if self.lines.push(&chunk, &mut out).is_err() {
                return None;
            }
            self.ready.extend(out);
        }
    }
}

/// What one run tracks.
struct Drive<'a> {
    cfg: &'a OpenCodeConfig,
    http: reqwest::Client,
    events: &'a mpsc::Sender<EngineEvent>,
    policy: &'a PermissionPolicy,
    cancel: CancellationToken,
    root: String,
    sessions: HashSet<String>,
    texts: HashSet<String>,
    calls: HashSet<String>,
    results: HashSet<String>,
    permissions: HashSet<String>,
    usage: HashMap<String, Usage>,
    usage_sent: HashSet<String>,
    /// A prompt asked and not yet answered (for `permission_pending`).
    pending: Option<String>,
    /// How the run ends, once decided (then only idle is awaited).
    ending: Option<Ending>,
    /// The model's own error, reported by `session.error`.
    model_error: Option<EngineError>,
    aborted: Option<Instant>,
    root_idle: bool,
    busy_seen: bool,
    last_answer: String,
}

fn session_of(v: &Value) -> Option<&str> {
    let p = &v["properties"];
    p["sessionID"]
        .as_str()
        .or_else(|| p["info"]["sessionID"].as_str())
        .or_else(|| p["part"]["sessionID"].as_str())
}

fn strs(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect(),
        _ => vec![],
    }
}

fn model_error(e: &Value) -> EngineError {
    let name = e["name"].as_str().unwrap_or("UnknownError");
    let message = e["data"]["message"].as_str().unwrap_or("").to_owned();
    let status = e["data"]["statusCode"].as_u64();
    let code = match (name, status) {
        ("ProviderAuthError", _) => ErrorCode::ProviderUnavailable,
        ("APIError", Some(s)) if s == 429 || s >= 500 => ErrorCode::ProviderUnavailable,
        ("APIError", Some(401 | 403)) => ErrorCode::ProviderUnavailable,
        _ => ErrorCode::ProviderError,
    };
    EngineError::new(code, format!("OpenCode reported {name}: {message}"))
}

impl<'a> Drive<'a> {
    fn url(&self, path: &str) -> String {
        let base = self.cfg.base_url.trim_end_matches('/');
        match &self.cfg.directory {
            Some(d) => {
                let sep = if path.contains('?') { '&' } else { '?' };
                let enc: String = d
                    .bytes()
                    .map(|b| match b {
                        b'A'..=b'Z'
                        | b'a'..=b'z'
                        | b'0'..=b'9'
                        | b'-'
                        | b'_'
                        | b'.'
                        | b'~'
                        | b'/' => (b as char).to_string(),
                        _ => format!("%{b:02X}"),
                    })
                    .collect();
                format!("{base}{path}{sep}directory={enc}")
            }
            None => format!("{base}{path}"),
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self
            .http
            .request(method, self.url(path))
            .timeout(self.cfg.request_timeout);
        match &self.cfg.password {
            Some(pw) => r.basic_auth(&self.cfg.username, Some(pw)),
            None => r,
        }
    }

    /// One bounded request; the JSON answer (Null for an empty body).
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), EngineError> {
        let mut r = self.request(method, path);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.map_err(|e| {
            EngineError::new(
                ErrorCode::RuntimeFailed,
                format!("OpenCode request {path} failed: {}", without_url(&e)),
            )
        })?;
        let status = resp.status().as_u16();
        if status == 401 {
            return Err(EngineError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode refused the credentials (401)",
            ));
        }
        let text = tokio::time::timeout(self.cfg.request_timeout, resp.text())
            .await
            .map_err(|_| {
                EngineError::new(
                    ErrorCode::RuntimeFailed,
                    format!("OpenCode {path}: body timed out"),
                )
            })?
            .map_err(|e| {
                EngineError::new(
                    ErrorCode::RuntimeFailed,
                    format!("OpenCode {path}: {}", without_url(&e)),
                )
            })?;
        let v = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        Ok((status, v))
    }

    async fn wait_ready(&self, deadline: Instant) -> Result<(), EngineError> {
        let give_up = deadline.min(Instant::now() + self.cfg.ready_timeout);
        let mut last;
        loop {
            match self
                .call(reqwest::Method::GET, "/global/health", None)
                .await
            {
                Ok((200, v)) if v["healthy"].as_bool() == Some(true) => return Ok(()),
                Ok((s, _)) => last = format!("status {s}"),
                Err(e) => last = e.message,
            }
            if Instant::now() + Duration::from_millis(200) >= give_up {
                return Err(EngineError::new(
                    ErrorCode::ReadinessTimeout,
                    format!("the OpenCode server was not ready in time ({last})"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn open_events(&self) -> Result<EventStream, EngineError> {
        // The stream itself is unbounded in time; only its opening is bounded
        // here (the run's watchdogs bound the reading).
        let mut r = self.http.get(self.url("/event"));
        if let Some(pw) = &self.cfg.password {
            r = r.basic_auth(&self.cfg.username, Some(pw));
        }
        let resp = tokio::time::timeout(self.cfg.request_timeout, r.send())
            .await
            .map_err(|_| {
                EngineError::new(
                    ErrorCode::RuntimeFailed,
                    "opening OpenCode's event stream timed out",
                )
            })?
            .map_err(|e| {
                EngineError::new(
                    ErrorCode::RuntimeFailed,
                    format!("OpenCode event stream: {}", without_url(&e)),
                )
            })?;
        if !resp.status().is_success() {
            return Err(EngineError::new(
                ErrorCode::RuntimeFailed,
                format!("OpenCode event stream answered {}", resp.status()),
            ));
        }
        let body = resp.bytes_stream().map(|c| c.map(|b| b.to_vec()));
        let mut s = EventStream {
            body: Box::pin(body),
            lines: SseLines::default(),
            ready: Default::default(),
        };
        // `server.connected` comes first: after it, nothing is missed.
        match tokio::time::timeout(self.cfg.request_timeout, s.next()).await {
            Ok(Some(v)) if v["type"] == "server.connected" => Ok(s),
            Ok(Some(v)) => {
                s.ready.push_front(v.to_string());
                Ok(s)
            }
            _ => Err(EngineError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode's event stream did not start",
            )),
        }
    }

    /// Emits unless the run is cancelled first; false when cancelled.
    async fn emit_unless_cancelled(&self, e: EngineEvent) -> bool {
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => false,
            _ = tokio::time::timeout(self.cfg.request_timeout, self.events.send(e)) => true,
        }
    }

    async fn emit(&self, e: EngineEvent) {
        // Bounded: a stalled consumer must not stall the run forever.
        let _ = tokio::time::timeout(self.cfg.request_timeout, self.events.send(e)).await;
    }

    /// Handles one event; returns whether it was progress of the run.
    async fn handle(&mut self, v: &Value) -> bool {
        let ty = v["type"].as_str().unwrap_or("");
        let p = &v["properties"];
        if ty == "session.created" || ty == "session.updated" {
            let info = &p["info"];
            if let (Some(id), Some(parent)) = (info["id"].as_str(), info["parentID"].as_str())
                && self.sessions.contains(parent)
            {
                self.sessions.insert(id.to_owned());
            }
        }
        let Some(sid) = session_of(v).map(str::to_owned) else {
            if !IGNORED_EVENTS.contains(&ty) {
                tracing::debug!(
                    event = ty,
                    "unknown OpenCode event without a session; ignored"
                );
            }
            return false;
        };
        if !self.sessions.contains(&sid) {
            return false;
        }
        match ty {
            "session.status" => match p["status"]["type"].as_str() {
                Some("idle") if sid == self.root => self.root_idle = true,
                Some("busy") => self.busy_seen = true,
                Some("retry") => {
                    self.busy_seen = true;
                    let attempt = p["status"]["attempt"].as_u64().unwrap_or(0);
                    if attempt >= self.cfg.max_model_retries && self.ending.is_none() {
                        let msg = p["status"]["message"].as_str().unwrap_or("").to_owned();
                        self.decide(Ending::Failed(EngineError::new(
                            ErrorCode::ProviderUnavailable,
                            format!("the model kept failing ({attempt} retries): {msg}"),
                        )))
                        .await;
                    }
                }
                _ => {}
            },
            "session.idle" => {
                if sid == self.root {
                    self.root_idle = true;
                }
            }
            "session.error" => {
                let e = model_error(&p["error"]);
                if p["error"]["name"] != "MessageAbortedError" && self.model_error.is_none() {
                    self.model_error = Some(e);
                }
            }
            "message.updated" => self.on_message(&p["info"]).await,
            "message.part.updated" => self.on_part(&p["part"]).await,
            "permission.asked" | "permission.updated" => self.on_permission(p, ty).await,
            "question.asked" => self.on_question(p).await,
            "session.created" | "session.updated" => {}
            t if IGNORED_EVENTS.contains(&t) => {}
            t => tracing::debug!(event = t, "unknown OpenCode session event; ignored"),
        }
        true
    }

    async fn on_message(&mut self, info: &Value) {
        if info["role"] != "assistant" {
            return;
        }
        let Some(id) = info["id"].as_str() else {
            return;
        };
        let t = &info["tokens"];
        let usage = Usage {
            input_tokens: t["input"].as_i64().unwrap_or(0),
            output_tokens: t["output"].as_i64().unwrap_or(0),
            cost_micros: (info["cost"].as_f64().unwrap_or(0.0) * 1_000_000.0).round() as i64,
        };
        self.usage.insert(id.to_owned(), usage);
        let completed = info["time"]["completed"].is_number() || info["error"].is_object();
        if completed && self.usage_sent.insert(id.to_owned()) {
            self.emit(EngineEvent::Usage {
                step: self.usage_sent.len() as u32,
                usage,
            })
            .await;
        }
    }

    async fn on_part(&mut self, part: &Value) {
        let step = self.usage_sent.len() as u32 + 1;
        match part["type"].as_str() {
            Some("text") => {
                let Some(id) = part["id"].as_str() else {
                    return;
                };
                if part["time"]["end"].is_number() && !part["synthetic"].as_bool().unwrap_or(false)
                {
                    let text = part["text"].as_str().unwrap_or("").to_owned();
                    self.last_answer = text.clone();
                    if self.texts.insert(id.to_owned()) {
                        self.emit(EngineEvent::AssistantText { step, text }).await;
                    }
                }
            }
            Some("tool") => {
                let call_id = part["callID"].as_str().unwrap_or("").to_owned();
                let tool = part["tool"].as_str().unwrap_or("").to_owned();
                let state = &part["state"];
                let status = state["status"].as_str().unwrap_or("");
                // `pending` carries an empty input: wait for `running`.
                if matches!(status, "running" | "completed" | "error")
                    && self.calls.insert(call_id.clone())
                {
                    self.emit(EngineEvent::ToolCall {
                        step,
                        call_id: call_id.clone(),
                        tool: tool.clone(),
                        input_json: state["input"].to_string(),
                    })
                    .await;
                }
                if matches!(status, "completed" | "error") && self.results.insert(call_id.clone()) {
                    let (output, is_error) = if status == "completed" {
                        (state["output"].as_str().unwrap_or("").to_owned(), false)
                    } else {
                        (state["error"].as_str().unwrap_or("").to_owned(), true)
                    };
                    self.emit(EngineEvent::ToolResult {
                        step,
                        call_id,
                        tool,
                        output,
                        is_error,
                    })
                    .await;
                }
            }
            _ => {}
        }
    }

    async fn on_permission(&mut self, p: &Value, ty: &str) {
        let Some(id) = p["id"].as_str().map(str::to_owned) else {
            return;
        };
        let sid = p["sessionID"].as_str().unwrap_or(&self.root).to_owned();
        if !self.permissions.insert(id.clone()) {
            return;
        }
        let kind = p["permission"]
            .as_str()
            .or_else(|| p["type"].as_str())
            .unwrap_or("unknown")
            .to_owned();
        let mut patterns = strs(&p["patterns"]);
        if patterns.is_empty() {
            patterns = strs(&p["pattern"]);
        }
        let described = format!("`{kind}` for {patterns:?}");
        self.pending = Some(described.clone());
        // Reported as pending first; answered only once that is delivered —
        // and not at all if the run is cancelled meanwhile.
        let prompt = |reply: &str| EngineEvent::Permission {
            permission_id: id.clone(),
            permission: kind.clone(),
            patterns: patterns.clone(),
            reply: reply.into(),
        };
        if !self.emit_unless_cancelled(prompt("")).await || self.cancel.is_cancelled() {
            self.decide(Ending::Cancelled).await;
            return;
        }
        let allowed = self.ending.is_none() && self.policy.allows(&kind, &patterns);
        let reply = if allowed { "once" } else { "reject" };
        if !self.emit_unless_cancelled(prompt(reply)).await || self.cancel.is_cancelled() {
            self.decide(Ending::Cancelled).await;
            return;
        }
        // 1.18 answers at /permission/{id}/reply; older servers (which send
        // `permission.updated`) at the session's route. Try the event's own
        // first, the other on 404.
        let modern = (format!("/permission/{id}/reply"), json!({ "reply": reply }));
        let legacy = (
            format!("/session/{sid}/permissions/{id}"),
            json!({ "response": reply }),
        );
        let order = if ty == "permission.asked" {
            [modern, legacy]
        } else {
            [legacy, modern]
        };
        let mut answered = false;
        for (path, body) in order {
            match self.call(reqwest::Method::POST, &path, Some(body)).await {
                Ok((200..=299, _)) => {
                    answered = true;
                    break;
                }
                Ok((404, _)) => continue,
                Ok((s, v)) => {
                    tracing::warn!(status = s, answer = %v, "OpenCode refused the permission reply");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e.message, "permission reply failed");
                    break;
                }
            }
        }
        if answered {
            self.pending = None;
        }
        if !allowed && self.ending.is_none() {
            self.decide(Ending::Failed(EngineError::new(
                ErrorCode::PermissionDenied,
                format!("the headless policy does not allow permission {described}"),
            )))
            .await;
        } else if !answered && self.ending.is_none() {
            self.decide(Ending::Failed(EngineError::new(
                ErrorCode::PermissionPending,
                format!("permission {described} could not be answered"),
            )))
            .await;
        }
    }

    /// The agent asked the absent user a question (OpenCode's `question`
    /// tool). Nobody can answer a headless run, so under the headless policy
    /// it is dismissed at once — reported first, like a permission prompt —
    /// and the run ends `question_unanswered`, naming the question, instead
    /// of waiting for the idle watchdog with the question left pending.
    async fn on_question(&mut self, p: &Value) {
        let Some(id) = p["id"].as_str().map(str::to_owned) else {
            return;
        };
        if !self.permissions.insert(id.clone()) {
            return;
        }
        let asked: Vec<String> = p["questions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|q| {
                let text = q["question"].as_str().unwrap_or("");
                match q["header"].as_str().filter(|h| !h.is_empty()) {
                    Some(h) => format!("{h}: {text}"),
                    None => text.to_owned(),
                }
            })
            .collect();
        let described = format!("{asked:?}");
        self.pending = Some(format!("question {described}"));
        let prompt = |reply: &str| EngineEvent::Permission {
            permission_id: id.clone(),
            permission: "question".into(),
            patterns: asked.clone(),
            reply: reply.into(),
        };
        if !self.emit_unless_cancelled(prompt("")).await || self.cancel.is_cancelled() {
            self.decide(Ending::Cancelled).await;
            return;
        }
        let _ = self.emit_unless_cancelled(prompt("reject")).await;
        match self
            .call(
                reqwest::Method::POST,
                &format!("/question/{id}/reject"),
                None,
            )
            .await
        {
            Ok((200..=299, _)) => self.pending = None,
            Ok((s, v)) => {
                tracing::warn!(status = s, answer = %v, "OpenCode refused dismissing the question")
            }
            Err(e) => tracing::warn!(error = %e.message, "dismissing the question failed"),
        }
        if self.ending.is_none() {
            self.decide(Ending::Failed(EngineError::new(
                ErrorCode::QuestionUnanswered,
                format!(
                    "the agent asked {described}, which nobody can answer in a headless run; \
                     the question was dismissed"
                ),
            )))
            .await;
        }
    }

    /// Decides how the run ends and aborts the session; the loop then waits
    /// (bounded) for it to be idle.
    async fn decide(&mut self, ending: Ending) {
        if self.ending.is_none() {
            self.ending = Some(ending);
        }
        self.abort().await;
    }

    async fn abort(&mut self) {
        if self.aborted.is_some() {
            return;
        }
        self.aborted = Some(Instant::now());
        let sessions: Vec<String> = self.sessions.iter().cloned().collect();
        for s in sessions {
            if let Err(e) = self
                .call(reqwest::Method::POST, &format!("/session/{s}/abort"), None)
                .await
            {
                tracing::warn!(error = %e.message, "aborting an OpenCode session failed");
            }
        }
    }

    /// After a dropped event stream, or to confirm an end: pending
    /// permissions, the root's status, and the messages (events missed are
    /// emitted from them).
    async fn recover(&mut self) {
        if let Ok((200, Value::Array(pending))) =
            self.call(reqwest::Method::GET, "/permission", None).await
        {
            for p in pending {
                if p["sessionID"]
                    .as_str()
                    .is_some_and(|s| self.sessions.contains(s))
                {
                    self.on_permission(&p, "permission.asked").await;
                }
            }
        }
        if let Ok((200, Value::Array(pending))) =
            self.call(reqwest::Method::GET, "/question", None).await
        {
            for q in pending {
                if q["sessionID"]
                    .as_str()
                    .is_some_and(|s| self.sessions.contains(s))
                {
                    self.on_question(&q).await;
                }
            }
        }
        self.read_messages().await;
        if let Ok((200, status)) = self
            .call(reqwest::Method::GET, "/session/status", None)
            .await
            && status.get(&self.root).is_none()
            && self.busy_seen
        {
            self.root_idle = true;
        }
    }

    async fn read_messages(&mut self) {
        let path = format!("/session/{}/message", self.root);
        if let Ok((200, Value::Array(messages))) =
            self.call(reqwest::Method::GET, &path, None).await
        {
            for m in &messages {
                if m["info"]["role"] == "assistant" {
                    self.busy_seen = true;
                }
                for part in m["parts"].as_array().into_iter().flatten() {
                    self.on_part(part).await;
                }
                self.on_message(&m["info"]).await;
                if m["info"]["error"].is_object()
                    && m["info"]["error"]["name"] != "MessageAbortedError"
                    && self.model_error.is_none()
                {
                    self.model_error = Some(model_error(&m["info"]["error"]));
                }
            }
        }
    }

    fn usage_total(&self) -> Usage {
        self.usage.values().fold(Usage::default(), |a, u| Usage {
            input_tokens: a.input_tokens + u.input_tokens,
            output_tokens: a.output_tokens + u.output_tokens,
            cost_micros: a.cost_micros + u.cost_micros,
        })
    }
}

fn without_url(e: &reqwest::Error) -> String {
    // reqwest errors carry the URL; the message is enough (and a URL may
    // one day carry credentials).
    let mut s = e.to_string();
    if let Some(url) = e.url() {
        s = s.replace(url.as_str(), "<opencode>");
    }
    s
}

/// OpenCode's model: the provider is the catalogue id's prefix, the model
/// the catalogue's provider name (or the id's rest).
fn split_model(model: &str, provider_model: &str) -> Option<Value> {
    let (provider, rest) = model.split_once('/')?;
    let model = if provider_model.is_empty() {
        rest
    } else {
        provider_model
    };
    (!provider.is_empty() && !model.is_empty())
        .then(|| json!({ "providerID": provider, "modelID": model }))
}

/// Runs one request on the OpenCode server to its end.
pub async fn run(
    cfg: &OpenCodeConfig,
    policy: &PermissionPolicy,
    request: EngineRequest,
    events: mpsc::Sender<EngineEvent>,
    cancel: CancellationToken,
) -> Outcome {
    let mut d = Drive {
        cfg,
        http: reqwest::Client::new(),
        events: &events,
        policy,
        cancel: cancel.clone(),
        root: String::new(),
        sessions: HashSet::new(),
        texts: HashSet::new(),
        calls: HashSet::new(),
        results: HashSet::new(),
        permissions: HashSet::new(),
        usage: HashMap::new(),
        usage_sent: HashSet::new(),
        pending: None,
        ending: None,
        model_error: None,
        aborted: None,
        root_idle: false,
        busy_seen: false,
        last_answer: String::new(),
    };
    let ending = drive(&mut d, &request, &cancel).await;
    Outcome {
        ending,
        usage: d.usage_total(),
        steps: d.usage_sent.len() as u32,
    }
}

fn failed(code: ErrorCode, message: impl Into<String>) -> Ending {
    Ending::Failed(EngineError::new(code, message))
}

async fn drive(d: &mut Drive<'_>, request: &EngineRequest, cancel: &CancellationToken) -> Ending {
    let deadline = request.deadline;
    let before = async {
        d.wait_ready(deadline).await?;
        let stream = d.open_events().await?;
        let (status, session) = d
            .call(
                reqwest::Method::POST,
                "/session",
                Some(json!({ "title": "automesh run" })),
            )
            .await?;
        let Some(id) = session["id"].as_str().filter(|_| status == 200) else {
            return Err(EngineError::new(
                ErrorCode::RuntimeFailed,
                format!("OpenCode did not create a session (status {status})"),
            ));
        };
        Ok::<_, EngineError>((stream, id.to_owned()))
    };
    let (mut stream, root) = tokio::select! {
        r = before => match r {
            Ok(r) => r,
            Err(e) => return Ending::Failed(e),
        },
        () = cancel.cancelled() => return Ending::Cancelled,
        () = tokio::time::sleep_until(deadline) => return failed(ErrorCode::DeadlineExceeded, "the run reached its deadline before OpenCode was ready"),
    };
    d.root = root.clone();
    d.sessions.insert(root.clone());
    let mut body = json!({ "parts": [{ "type": "text", "text": request.prompt }] });
    if let Some(m) = split_model(&request.model, &request.provider_model) {
        body["model"] = m;
    }
    if let Some(g) = &request.guidance {
        body["system"] = json!(g);
    }
    match d
        .call(
            reqwest::Method::POST,
            &format!("/session/{root}/prompt_async"),
            Some(body),
        )
        .await
    {
        Ok((200..=299, _)) => {}
        Ok((s, v)) => {
            return failed(
                ErrorCode::RuntimeFailed,
                format!("OpenCode refused the prompt ({s}): {v}"),
            );
        }
        Err(e) => return Ending::Failed(e),
    }

    let mut last_progress = Instant::now();
    let mut reconnect_backoff = Duration::from_millis(100);
    let mut stream_ok = true;
    loop {
        if d.root_idle {
            break;
        }
        // After an abort, idle is awaited for `cancel_timeout`, no longer.
        if let Some(at) = d.aborted
            && Instant::now() >= at + d.cfg.cancel_timeout
        {
            tracing::warn!("OpenCode was not observed idle after the abort");
            break;
        }
        let idle_at = last_progress + d.cfg.idle_timeout;
        let poll_at = Instant::now() + Duration::from_millis(500);
        tokio::select! {
            biased;
            () = cancel.cancelled(), if d.ending.is_none() => {
                d.decide(Ending::Cancelled).await;
            }
            () = tokio::time::sleep_until(deadline), if d.ending.is_none() => {
                d.decide(failed(ErrorCode::DeadlineExceeded, "the run reached its deadline")).await;
            }
            () = tokio::time::sleep_until(idle_at), if d.ending.is_none() => {
                let e = match &d.pending {
                    Some(p) => failed(ErrorCode::PermissionPending, format!("permission {p} was still unanswered after {:?} without progress", d.cfg.idle_timeout)),
                    None => failed(ErrorCode::IdleTimeout, format!("the OpenCode session made no progress for {:?}", d.cfg.idle_timeout)),
                };
                d.decide(e).await;
            }
            // While aborting, or with the stream down: look, don't wait.
            () = tokio::time::sleep_until(poll_at), if d.aborted.is_some() || !stream_ok => {
                if !stream_ok {
                    match d.open_events().await {
                        Ok(s) => {
                            tracing::info!("OpenCode event stream reopened; recovering state");
                            stream = s;
                            stream_ok = true;
                            reconnect_backoff = Duration::from_millis(100);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e.message, "reopening OpenCode's event stream failed");
                            tokio::time::sleep(reconnect_backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
                            reconnect_backoff = (reconnect_backoff * 2).min(Duration::from_secs(2));
                        }
                    }
                }
                d.recover().await;
            }
            next = stream.next(), if stream_ok => match next {
                Some(v) => {
                    if d.handle(&v).await {
                        last_progress = Instant::now();
                    }
                }
                None => {
                    tracing::warn!("OpenCode's event stream dropped; reopening and recovering");
                    stream_ok = false;
                }
            },
        }
    }
    if !d.root_idle && d.aborted.is_none() {
        // Not reachable without an abort, kept for safety.
        d.abort().await;
    }
    // Confirm the end from the messages (and emit anything missed).
    d.read_messages().await;
    let idle = d.root_idle;
    match d.ending.take() {
        Some(Ending::Cancelled) if !idle => failed(
            ErrorCode::CancelUnobserved,
            "OpenCode was not observed idle after the abort",
        ),
        Some(e) => e,
        None => match d.model_error.take() {
            Some(e) => Ending::Failed(e),
            None => Ending::Succeeded {
                answer: d.last_answer.clone(),
            },
        },
    }
}

/// The OpenCode engine for the adapter contract.
#[derive(Debug, Clone)]
pub struct OpenCodeEngine {
    pub config: OpenCodeConfig,
    pub policies: PolicyBook,
}

impl crate::adapter::EngineAdapter for OpenCodeEngine {
    fn engine_id(&self) -> &'static str {
        "opencode-1.18"
    }

    fn run<'a>(
        &'a self,
        request: EngineRequest,
        events: mpsc::Sender<EngineEvent>,
        cancel: CancellationToken,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send + 'a>> {
        let policy = self.policies.for_automation(&request.automation_id);
        Box::pin(run(&self.config, policy, request, events, cancel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_shell_patterns() {
        assert!(glob("echo *", "echo hi"));
        assert!(glob("*", "anything at all"));
        assert!(glob("git * --dry-run", "git push origin --dry-run"));
        assert!(!glob("echo *", "rm -rf /"));
        assert!(glob("exact", "exact"));
        assert!(!glob("exact", "exactly"));
    }

    #[test]
    fn the_policy_needs_one_rule_covering_every_pattern() {
        let p = PermissionPolicy {
            allow: vec![
                PermissionRule {
                    permission: "bash".into(),
                    patterns: vec!["echo *".into()],
                },
                PermissionRule {
                    permission: "read".into(),
                    patterns: vec![],
                },
            ],
        };
        assert!(p.allows("bash", &["echo hi".into()]));
        assert!(!p.allows("bash", &["echo hi".into(), "rm x".into()]));
        assert!(p.allows("read", &["/etc/hosts".into()]));
        assert!(!p.allows("edit", &["a.txt".into()]));
        assert!(!PermissionPolicy::default().allows("bash", &["echo hi".into()]));
    }

    #[test]
    fn sse_lines_survive_any_split() {
        let text = "data: {\"type\":\"a\"}\n\n: comment\ndata: {\"type\":\"b\"}\r\n\r\n";
        for cut in 0..text.len() {
            let mut s = SseLines::default();
            let mut out = vec![];
            s.push(&text.as_bytes()[..cut], &mut out).expect("push");
            s.push(&text.as_bytes()[cut..], &mut out).expect("push");
            assert_eq!(
                out,
                vec!["{\"type\":\"a\"}", "{\"type\":\"b\"}"],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn models_split_into_provider_and_model() {
        assert_eq!(
            split_model("fake/fake-model", ""),
            Some(json!({"providerID": "fake", "modelID": "fake-model"}))
        );
        assert_eq!(
            split_model("fake/alias", "fake-model-2026"),
            Some(json!({"providerID": "fake", "modelID": "fake-model-2026"}))
        );
        assert_eq!(split_model("bare", ""), None);
    }
}
