//! The HTTP side of a run on OpenCode: URLs (with `?directory=`), bounded
//! requests with Basic credentials, readiness, and opening the event stream.

use std::time::Duration;

use automesh_domain::ErrorCode;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::time::Instant;

use automesh_domain::CodedError;

use super::session::Drive;
use super::sse::{EventStream, SseLines};

impl Drive<'_> {
    pub(super) fn url(&self, path: &str) -> String {
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

    pub(super) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self
            .http
            .request(method, self.url(path))
            .timeout(self.cfg.request_timeout);
        match &self.cfg.password {
            Some(pw) => r.basic_auth(&self.cfg.username, Some(pw.expose())),
            None => r,
        }
    }

    /// One bounded request; the JSON answer (Null for an empty body).
    pub(super) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), CodedError> {
        let mut r = self.request(method, path);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.map_err(|e| {
            CodedError::new(
                ErrorCode::RuntimeFailed,
                format!("OpenCode request {path} failed: {}", without_url(&e)),
            )
        })?;
        let status = resp.status().as_u16();
        if status == 401 {
            return Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode refused the credentials (401)",
            ));
        }
        let text = tokio::time::timeout(self.cfg.request_timeout, resp.text())
            .await
            .map_err(|_| {
                CodedError::new(
                    ErrorCode::RuntimeFailed,
                    format!("OpenCode {path}: body timed out"),
                )
            })?
            .map_err(|e| {
                CodedError::new(
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

    pub(super) async fn wait_ready(&self, deadline: Instant) -> Result<(), CodedError> {
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
                return Err(CodedError::new(
                    ErrorCode::ReadinessTimeout,
                    format!("the OpenCode server was not ready in time ({last})"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub(super) async fn open_events(&self) -> Result<EventStream, CodedError> {
        // The stream itself is unbounded in time; only its opening is bounded
        // here (the run's watchdogs bound the reading).
        let mut r = self.http.get(self.url("/event"));
        if let Some(pw) = &self.cfg.password {
            r = r.basic_auth(&self.cfg.username, Some(pw.expose()));
        }
        let resp = tokio::time::timeout(self.cfg.request_timeout, r.send())
            .await
            .map_err(|_| {
                CodedError::new(
                    ErrorCode::RuntimeFailed,
                    "opening OpenCode's event stream timed out",
                )
            })?
            .map_err(|e| {
                CodedError::new(
                    ErrorCode::RuntimeFailed,
                    format!("OpenCode event stream: {}", without_url(&e)),
                )
            })?;
        if !resp.status().is_success() {
            return Err(CodedError::new(
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
            _ => Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode's event stream did not start",
            )),
        }
    }
}

pub(super) fn without_url(e: &reqwest::Error) -> String {
    // reqwest errors carry the URL; the message is enough (and a URL may
    // one day carry credentials).
    let mut s = e.to_string();
    if let Some(url) = e.url() {
        s = s.replace(url.as_str(), "<opencode>");
    }
    s
}
