//! OpenCode's event stream: incremental SSE decoding (whole lines, bounded
//! size) and the event types that carry nothing for a run.

use automesh_domain::ErrorCode;
use futures_util::StreamExt;
use serde_json::Value;

use automesh_domain::CodedError;

/// The longest SSE line accepted.
const MAX_LINE: usize = 8 * 1024 * 1024;

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
pub(super) struct SseLines {
    buf: Vec<u8>,
    data: String,
}

impl SseLines {
    pub(super) fn push(&mut self, chunk: &[u8], out: &mut Vec<String>) -> Result<(), CodedError> {
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
            return Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "an OpenCode event exceeds the size bound",
            ));
        }
        Ok(())
    }
}

pub(super) struct EventStream {
    pub(super) body:
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Vec<u8>, reqwest::Error>> + Send>>,
    pub(super) lines: SseLines,
    pub(super) ready: std::collections::VecDeque<String>,
}

impl EventStream {
    /// The next event, `None` when the stream ended or broke.
    pub(super) async fn next(&mut self) -> Option<Value> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
