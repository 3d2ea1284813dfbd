//! A webhook receiver: what lies outside the project (an owner's endpoint),
//! speaking HTTP/1.1 on loopback. It records every request and answers as
//! its script says (a status, a hang, a dropped connection), then as its
//! default. Signatures are checked by an independent implementation of
//! Standard Webhooks: the `standardwebhooks` package from PyPI
//! ([`verify_with_python`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// How the receiver answers one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// This status, an empty body.
    Status(u16),
    /// Nothing, ever (the connection stays open).
    Hang,
    /// The connection closed without an answer.
    Close,
}

/// One request as received.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// How it was answered.
    pub answer: Answer,
    pub at: tokio::time::Instant,
}

impl Delivery {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `webhook-id`.
    pub fn id(&self) -> &str {
        self.header("webhook-id").unwrap_or_default()
    }

    /// The payload's `type`.
    pub fn event_type(&self) -> String {
        let body: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        body["type"].as_str().unwrap_or_default().to_owned()
    }
}

#[derive(Debug, Default)]
struct State {
    script: VecDeque<Answer>,
    received: Vec<Delivery>,
}

/// A running receiver; it stops when dropped.
#[derive(Debug)]
pub struct Receiver {
    /// `http://127.0.0.1:<port>/hook`.
    pub url: String,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    /// Starts a receiver that answers `default` once its script is done.
    pub async fn start(default: Answer) -> std::io::Result<Receiver> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/hook", listener.local_addr()?);
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, shared.clone(), default));
            }
        });
        Ok(Receiver { url, state, task })
    }

    /// The next requests are answered so, in order.
    pub fn script(&self, answers: &[Answer]) {
        self.state.lock().script.extend(answers.iter().copied());
    }

    /// Every request so far, in order of arrival.
    pub fn received(&self) -> Vec<Delivery> {
        self.state.lock().received.clone()
    }

    /// How many requests so far.
    pub fn len(&self) -> usize {
        self.state.lock().received.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The requests answered 2xx.
    pub fn delivered(&self) -> Vec<Delivery> {
        let received = self.received();
        received
            .into_iter()
            .filter(|d| matches!(d.answer, Answer::Status(s) if (200..300).contains(&s)))
            .collect()
    }
}

async fn serve(stream: TcpStream, state: Arc<Mutex<State>>, default: Answer) {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    loop {
        let mut headers = vec![];
        let mut line = String::new();
        // The request line, then headers to the blank line.
        match read.read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        loop {
            line.clear();
            match read.read_line(&mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            if let Some((name, value)) = trimmed.split_once(':') {
                headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
            }
        }
        let length: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; length];
        if read.read_exact(&mut body).await.is_err() {
            return;
        }
        let answer = {
            let mut s = state.lock();
            let answer = s.script.pop_front().unwrap_or(default);
            s.received.push(Delivery {
                headers,
                body: String::from_utf8_lossy(&body).into_owned(),
                answer,
                at: tokio::time::Instant::now(),
            });
            answer
        };
        match answer {
            Answer::Status(status) => {
                let reply = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n");
                if write.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
            }
            Answer::Hang => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                return;
            }
            Answer::Close => return,
        }
    }
}

/// The Python that checks signatures: the `standardwebhooks` package.
const VERIFY: &str = r#"
import json, sys
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
d = json.load(sys.stdin)
hook = Webhook(d["secret"])
for x in d["deliveries"]:
    hook.verify(x["body"].encode(), x["headers"])
wrong = Webhook(d["wrong_secret"])
for x in d["deliveries"]:
    try:
        wrong.verify(x["body"].encode(), x["headers"])
        sys.exit("a delivery verified with the wrong secret")
    except WebhookVerificationError:
        pass
print(len(d["deliveries"]))
"#;

/// The Python interpreter that has `standardwebhooks` (`AUTOMESH_PYTHON`,
/// as `scripts/test` sets it, or `python3`).
pub fn python() -> String {
    std::env::var("AUTOMESH_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Checks every delivery's signature with `secret` using the PyPI
/// `standardwebhooks` package, and that none verifies with another secret;
/// `Err` says what failed.
pub fn verify_with_python(secret: &str, deliveries: &[Delivery]) -> Result<(), String> {
    use std::io::Write;
    let input = serde_json::json!({
        "secret": secret,
        "wrong_secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "deliveries": deliveries.iter().map(|d| serde_json::json!({
            "headers": d.headers.iter().cloned().collect::<std::collections::HashMap<_, _>>(),
            "body": d.body,
        })).collect::<Vec<_>>(),
    });
    let mut child = std::process::Command::new(python())
        .args(["-c", VERIFY])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", python()))?;
    child
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(input.to_string().as_bytes())
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || said != deliveries.len().to_string() {
        return Err(format!(
            "standardwebhooks (Python) refused: {said} {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}
