//! What one run on OpenCode tracks — its sessions (children by
//! `parentID`), texts, tool calls and results, permissions and usage — and
//! how each event changes it: permission prompts answered under the policy,
//! tool inputs read only from `running`/`completed`, recovery after the
//! event stream dropped.

use std::collections::{HashMap, HashSet};

use automesh_domain::{ErrorCode, Usage};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::adapter::{Ending, EngineEvent};
use automesh_domain::CodedError;

use super::OpenCodeConfig;
use super::policy::PermissionPolicy;
use super::sse::IGNORED_EVENTS;

/// What one run tracks.
pub(super) struct Drive<'a> {
    pub(super) cfg: &'a OpenCodeConfig,
    pub(super) http: reqwest::Client,
    pub(super) events: &'a mpsc::Sender<EngineEvent>,
    pub(super) policy: &'a PermissionPolicy,
    pub(super) cancel: CancellationToken,
    pub(super) root: String,
    pub(super) root_idle: bool,
    pub(super) busy_seen: bool,
    pub(super) sessions: HashSet<String>,
    pub(super) texts: HashSet<String>,
    pub(super) calls: HashSet<String>,
    pub(super) results: HashSet<String>,
    pub(super) permissions: HashSet<String>,
    pub(super) usage: HashMap<String, Usage>,
    pub(super) usage_sent: HashSet<String>,
    /// A prompt asked and not yet answered (for `permission_pending`).
    pub(super) pending: Option<String>,
    /// How the run ends, once decided (then only idle is awaited).
    pub(super) ending: Option<Ending>,
    /// The model's own error, reported by `session.error`.
    pub(super) model_error: Option<CodedError>,
    pub(super) aborted: Option<Instant>,
    pub(super) last_answer: String,
    /// What the run may spend, checked as each step (assistant message)
    /// completes, and the price its cost is counted at.
    pub(super) budget: automesh_domain::RunBudget,
    pub(super) price: Option<automesh_domain::Price>,
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

fn model_error(e: &Value) -> CodedError {
    let name = e["name"].as_str().unwrap_or("UnknownError");
    let message = e["data"]["message"].as_str().unwrap_or("").to_owned();
    let status = e["data"]["statusCode"].as_u64();
    let code = match (name, status) {
        ("ProviderAuthError", _) => ErrorCode::ProviderUnavailable,
        ("APIError", Some(s)) if s == 429 || s >= 500 => ErrorCode::ProviderUnavailable,
        ("APIError", Some(401 | 403)) => ErrorCode::ProviderUnavailable,
        _ => ErrorCode::ProviderError,
    };
    CodedError::new(code, format!("OpenCode reported {name}: {message}"))
}

impl Drive<'_> {
    /// Emits unless the run is cancelled first; false when cancelled.
    pub(super) async fn emit_unless_cancelled(&self, e: EngineEvent) -> bool {
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => false,
            _ = tokio::time::timeout(self.cfg.request_timeout, self.events.send(e)) => true,
        }
    }

    pub(super) async fn emit(&self, e: EngineEvent) {
        // Bounded: a stalled consumer must not stall the run forever.
        let _ = tokio::time::timeout(self.cfg.request_timeout, self.events.send(e)).await;
    }

    /// Handles one event; returns whether it was progress of the run.
    pub(super) async fn handle(&mut self, v: &Value) -> bool {
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
                        self.decide(Ending::Failed(CodedError::new(
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

    pub(super) async fn on_message(&mut self, info: &Value) {
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
            let step = self.usage_sent.len() as u32;
            self.emit(EngineEvent::Usage { step, usage }).await;
            // The step boundary: a run over its budget is aborted here,
            // before it asks the provider again (a tool this step asked
            // for is stopped by the abort, and its permission never
            // granted).
            if let Some(over) = self.budget.exceeded(&self.usage_total(), self.price) {
                tracing::warn!(step, error_code = over.code.as_str(), "{}", over.message);
                let message = format!("{} after step {step}", over.message);
                self.decide(Ending::Failed(CodedError::new(over.code, message)))
                    .await;
            }
        }
    }

    pub(super) async fn on_part(&mut self, part: &Value) {
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

    pub(super) async fn on_permission(&mut self, p: &Value, ty: &str) {
        let Some(id) = p["id"].as_str().map(str::to_owned) else {
            return;
        };
        let sid = p["sessionID"].as_str().unwrap_or(&self.root).to_owned();
        if !self.permissions.insert(id.clone()) {
            return;
        }
        if self.ending.is_some() {
            // The run's end is decided (its budget, say) and the session
            // aborted: nothing more is granted.
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
            self.decide(Ending::Failed(CodedError::new(
                ErrorCode::PermissionDenied,
                format!("the headless policy does not allow permission {described}"),
            )))
            .await;
        } else if !answered && self.ending.is_none() {
            self.decide(Ending::Failed(CodedError::new(
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
    pub(super) async fn on_question(&mut self, p: &Value) {
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
            self.decide(Ending::Failed(CodedError::new(
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
    pub(super) async fn decide(&mut self, ending: Ending) {
        if self.ending.is_none() {
            self.ending = Some(ending);
        }
        self.abort().await;
    }

    pub(super) async fn abort(&mut self) {
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

    /// What the server lists at `path` (pending permissions, questions)
    /// for the run's sessions; nothing when it cannot say.
    async fn pending(&self, path: &str) -> Vec<Value> {
        let Ok((200, Value::Array(all))) = self.call(reqwest::Method::GET, path, None).await else {
            return vec![];
        };
        all.into_iter()
            .filter(|p| {
                p["sessionID"]
                    .as_str()
                    .is_some_and(|s| self.sessions.contains(s))
            })
            .collect()
    }

    /// After a dropped event stream, or to confirm an end: pending
    /// permissions, the root's status, and the messages (events missed are
    /// emitted from them).
    pub(super) async fn recover(&mut self) {
        for p in self.pending("/permission").await {
            self.on_permission(&p, "permission.asked").await;
        }
        for q in self.pending("/question").await {
            self.on_question(&q).await;
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

    pub(super) async fn read_messages(&mut self) {
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

    pub(super) fn usage_total(&self) -> Usage {
        self.usage.values().fold(Usage::default(), |a, u| Usage {
            input_tokens: a.input_tokens + u.input_tokens,
            output_tokens: a.output_tokens + u.output_tokens,
            cost_micros: a.cost_micros + u.cost_micros,
        })
    }
}
