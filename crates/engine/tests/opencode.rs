//! The OpenCode adapter against the real `opencode serve` (npm package
//! `opencode-linux-x64@1.18.34`, installed by `scripts/test` into
//! `.tools/opencode`, or `AUTOMESH_OPENCODE_BIN`), running offline against
//! the fake OpenAI-compatible provider. Each test starts its own server in
//! an isolated HOME.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_engine::adapter::EngineRequest;
use automesh_engine::adapter::{Ending, EngineEvent, Outcome};
use automesh_engine::opencode::{
    self, OpenCodeConfig, OpenCodeServer, PermissionPolicy, PermissionRule, isolated_env,
};
use common::{FakeProvider, Reply, as_sse, provider, text_completion, tool_call_completion};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const PASSWORD: &str = "opencode-server-password-not-for-logs";

fn binary() -> PathBuf {
    if let Ok(p) = std::env::var("AUTOMESH_OPENCODE_BIN") {
        return PathBuf::from(p);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../.tools/opencode/node_modules/opencode-linux-x64/bin/opencode")
}

/// The fake model, deciding from the request's content as OpenCode's calls
/// differ: a tool result → the answer "4"; otherwise → one bash call.
fn model(command: &'static str) -> impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync {
    move |_, req| {
        let messages = req["messages"].as_array().cloned().unwrap_or_default();
        let last_is_tool = messages.last().is_some_and(|m| m["role"] == "tool");
        let answer = if req["tools"].is_null() {
            text_completion("Fake title")
        } else if last_is_tool {
            text_completion("4")
        } else {
            tool_call_completion(
                "call_1",
                "bash",
                &serde_json::json!({"command": command, "description": "Run it"}).to_string(),
            )
        };
        Reply::Sse(as_sse(&answer))
    }
}

struct Server {
    server: OpenCodeServer,
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn start(provider_url: &str) -> Server {
    let bin = binary();
    assert!(
        bin.exists(),
        "OpenCode is not installed at {} (scripts/test installs it; or set AUTOMESH_OPENCODE_BIN)",
        bin.display()
    );
    let dir = std::env::temp_dir().join(format!("automesh-opencode-{}", uuid_like()));
    let project = dir.join("project");
    std::fs::create_dir_all(&project).expect("project dir");
    let config = serde_json::json!({
        "$schema": "https://opencode.ai/config.json",
        "model": "fake/fake-model",
        "small_model": "fake/fake-model",
        "autoupdate": false,
        "share": "disabled",
        "provider": {"fake": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "Fake",
            "options": {"baseURL": provider_url, "apiKey": "sk-fake"},
            "models": {"fake-model": {"name": "Fake Model", "tool_call": true}}
        }},
        "permission": {"bash": "ask"}
    });
    let mut env = isolated_env(&dir, &config.to_string());
    env.push(("OPENCODE_SERVER_PASSWORD".into(), PASSWORD.into()));
    let server = OpenCodeServer::start(&bin, &project, &env, Duration::from_secs(60))
        .await
        .expect("opencode serve");
    Server { server, dir }
}

fn uuid_like() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    )
}

fn config(base_url: &str) -> OpenCodeConfig {
    let mut c = OpenCodeConfig::new(base_url);
    c.password = Some(PASSWORD.into());
    c.idle_timeout = Duration::from_secs(20);
    c.cancel_timeout = Duration::from_secs(10);
    c.max_model_retries = 2;
    c
}

fn allow_echo() -> PermissionPolicy {
    PermissionPolicy {
        allow: vec![PermissionRule {
            permission: "bash".into(),
            patterns: vec!["echo *".into()],
        }],
    }
}

fn request(deadline: Duration) -> EngineRequest {
    EngineRequest {
        prompt: "What is 2+2? Use bash.".into(),
        model: "fake/fake-model".into(),
        provider_model: String::new(),
        automation_id: "aut-1".into(),
        guidance: None,
        deadline: Instant::now() + deadline,
        resume_from: None,
        budget: Default::default(),
        price: None,
    }
}

/// Runs to the end with a bound the test itself enforces.
async fn run(
    cfg: &OpenCodeConfig,
    policy: &PermissionPolicy,
    cancel: CancellationToken,
) -> (Outcome, Vec<EngineEvent>) {
    run_request(cfg, policy, cancel, request(Duration::from_secs(80))).await
}

async fn run_request(
    cfg: &OpenCodeConfig,
    policy: &PermissionPolicy,
    cancel: CancellationToken,
    request: EngineRequest,
) -> (Outcome, Vec<EngineEvent>) {
    let (tx, mut rx) = mpsc::channel(64);
    let collect = tokio::spawn(async move {
        let mut all = vec![];
        while let Some(e) = rx.recv().await {
            all.push(e);
        }
        all
    });
    let outcome = tokio::time::timeout(
        Duration::from_secs(90),
        opencode::run(cfg, policy, request, tx, cancel),
    )
    .await
    .expect("the adapter never hangs");
    (outcome, collect.await.expect("events"))
}

fn failed_with(outcome: &Outcome) -> Option<(ErrorCode, String)> {
    match &outcome.ending {
        Ending::Failed(e) => Some((e.code, e.message.clone())),
        _ => None,
    }
}

fn permissions(events: &[EngineEvent]) -> Vec<(String, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Permission {
                permission, reply, ..
            } => Some((permission.clone(), reply.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permission_the_allow_list_covers_is_approved_once_and_the_run_succeeds() {
    let (url, fake) = provider(model("echo hi")).await;
    let s = start(&url).await;
    let (outcome, events) = run(
        &config(&s.server.base_url),
        &allow_echo(),
        CancellationToken::new(),
    )
    .await;
    assert_eq!(
        outcome.ending,
        Ending::Succeeded { answer: "4".into() },
        "{events:?}"
    );
    assert_eq!(
        permissions(&events),
        vec![
            ("bash".into(), String::new()),
            ("bash".into(), "once".into())
        ]
    );
    // The tool's input comes from its running state, never the empty pending one.
    let call = events.iter().find_map(|e| match e {
        EngineEvent::ToolCall {
            tool, input_json, ..
        } if tool == "bash" => Some(input_json.clone()),
        _ => None,
    });
    assert!(
        call.as_deref().is_some_and(|i| i.contains("echo hi")),
        "{call:?}"
    );
    assert!(events.iter().any(|e| matches!(
        e,
        EngineEvent::ToolResult { output, is_error: false, .. } if output.contains("hi")
    )));
    assert!(
        outcome.usage.input_tokens > 0,
        "usage is accounted: {:?}",
        outcome.usage
    );
    assert!(fake.calls() >= 2);
    // The server's password appears in no event.
    assert!(!format!("{events:?}").contains(PASSWORD));
}

/// A budget per run (issue 32) on the OpenCode adapter: the step whose
/// usage takes the run over its cap is its last. OpenCode reports a step's
/// tokens when the step ends, after it ran the step's tools; the session is
/// aborted there and the run ends `budget_exceeded` with what it spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_its_budget_is_aborted_at_that_step_boundary() {
    let (url, fake) = provider(model("echo hi")).await;
    let s = start(&url).await;
    let over = EngineRequest {
        // The first step alone is 100 input and 20 output tokens.
        budget: automesh_domain::RunBudget {
            max_cost_micros: None,
            max_tokens: Some(50),
        },
        ..request(Duration::from_secs(80))
    };
    let (outcome, events) = run_request(
        &config(&s.server.base_url),
        &allow_echo(),
        CancellationToken::new(),
        over,
    )
    .await;
    let (code, message) = failed_with(&outcome).unwrap_or_else(|| panic!("{outcome:?}"));
    assert_eq!(code, ErrorCode::BudgetExceeded, "{message}");
    assert!(message.contains("after step 1"), "{message}");
    assert!(
        outcome.usage.input_tokens > 0,
        "what was spent: {:?}",
        outcome.usage
    );
    // The agent's steps the provider saw (title requests carry no tools):
    // OpenCode starts its next step as soon as one ends, so the abort sent
    // at that boundary can meet a request already on its way — one, never
    // more (the native engine's check sits before its call, so there it is
    // none).
    let steps = fake
        .bodies
        .lock()
        .iter()
        .filter(|b| !b["tools"].is_null())
        .count();
    assert!(
        (1..=2).contains(&steps),
        "the provider was asked {steps} times: {events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permission_outside_the_allow_list_is_rejected_and_ends_the_run_naming_it() {
    let (url, fake) = provider(model("rm -rf precious")).await;
    let s = start(&url).await;
    let (outcome, events) = run(
        &config(&s.server.base_url),
        &allow_echo(),
        CancellationToken::new(),
    )
    .await;
    let (code, message) = failed_with(&outcome).expect("failed");
    assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
    assert!(
        message.contains("bash") && message.contains("rm -rf precious"),
        "{message}"
    );
    assert_eq!(
        permissions(&events),
        vec![
            ("bash".into(), String::new()),
            ("bash".into(), "reject".into())
        ]
    );
    // Rejected without feedback: the model is not asked to go on.
    let calls = fake.calls();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fake.calls(), calls);
}

/// The agent asks the absent user a question (the `question` tool). The
/// question is dismissed under the headless policy and the run ends
/// `question_unanswered`, naming it — long before the idle watchdog (20 s
/// here, 120 s by default) — with nothing left pending in OpenCode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_question_to_the_absent_user_is_dismissed_and_ends_the_run_naming_it() {
    let (url, fake) = provider(|_, req| {
        let messages = req["messages"].as_array().cloned().unwrap_or_default();
        let answer = if req["tools"].is_null() {
            text_completion("Fake title")
        } else if messages.last().is_some_and(|m| m["role"] == "tool") {
            text_completion("I will wait for an answer")
        } else {
            tool_call_completion(
                "call_q",
                "question",
                &serde_json::json!({"questions": [{
                    "question": "Which folder should I tidy?",
                    "header": "Folder",
                    "options": [
                        {"label": "Downloads", "description": "the downloads folder"},
                        {"label": "Desktop", "description": "the desktop"}
                    ]
                }]})
                .to_string(),
            )
        };
        Reply::Sse(as_sse(&answer))
    })
    .await;
    let s = start(&url).await;
    let cfg = config(&s.server.base_url);
    let (outcome, events) = run(&cfg, &allow_echo(), CancellationToken::new()).await;
    let (code, message) = failed_with(&outcome).expect("failed");
    assert_eq!(code, ErrorCode::QuestionUnanswered, "{message} {events:?}");
    assert!(
        message.contains("Which folder should I tidy?"),
        "the question is named: {message}"
    );
    assert_eq!(
        permissions(&events),
        vec![
            ("question".into(), String::new()),
            ("question".into(), "reject".into())
        ]
    );
    // Nothing is left pending on the server.
    let pending: serde_json::Value = reqwest::Client::new()
        .get(format!("{}/question", s.server.base_url))
        .basic_auth("opencode", Some(PASSWORD))
        .send()
        .await
        .expect("list questions")
        .json()
        .await
        .expect("json");
    assert_eq!(pending, serde_json::json!([]), "no question left pending");
    let calls = fake.calls();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fake.calls(), calls, "the model is not asked to go on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_failing_forever_ends_the_run_provider_unavailable() {
    let (url, _fake) = provider(|_, _| Reply::Status(500, None)).await;
    let s = start(&url).await;
    let started = Instant::now();
    let (outcome, _) = run(
        &config(&s.server.base_url),
        &allow_echo(),
        CancellationToken::new(),
    )
    .await;
    let (code, message) = failed_with(&outcome).expect("failed");
    assert_eq!(code, ErrorCode::ProviderUnavailable, "{message}");
    assert!(message.contains("retries"), "{message}");
    eprintln!("ended after {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_while_a_permission_is_pending_ends_cancelled_once_idle() {
    let (url, _fake) = provider(model("echo hi")).await;
    let s = start(&url).await;
    let cfg = config(&s.server.base_url);
    // A consumer that does not read: the adapter holds its answer until
    // the pending prompt is delivered, so the prompt stays pending.
    let (tx, mut rx) = mpsc::channel(1);
    let cancel = CancellationToken::new();
    let policy = allow_echo();
    let running = {
        let cfg = cfg.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            opencode::run(&cfg, &policy, request(Duration::from_secs(80)), tx, cancel).await
        })
    };
    // Wait until the real server lists the prompt as pending.
    let http = reqwest::Client::new();
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let pending: serde_json::Value = http
            .get(format!("{}/permission", cfg.base_url))
            .basic_auth("opencode", Some(PASSWORD))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("GET /permission")
            .json()
            .await
            .expect("json");
        if pending.as_array().is_some_and(|a| !a.is_empty()) {
            break;
        }
        assert!(Instant::now() < give_up, "no permission became pending");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    let drain = tokio::spawn(async move {
        let mut all = vec![];
        while let Some(e) = rx.recv().await {
            all.push(e);
        }
        all
    });
    let outcome = tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("bounded")
        .expect("joined");
    assert_eq!(
        outcome.ending,
        Ending::Cancelled,
        "idle was observed after the abort"
    );
    let events = drain.await.expect("events");
    assert!(
        permissions(&events)
            .iter()
            .all(|(_, reply)| reply != "once"),
        "nothing was approved after the cancellation: {events:?}"
    );
}

/// A TCP proxy in front of OpenCode that can cut every connection.
struct Proxy {
    url: String,
    cut: Arc<tokio::sync::Notify>,
    refusing: Arc<AtomicBool>,
}

async fn proxy(upstream: &str) -> Proxy {
    let upstream = upstream.trim_start_matches("http://").to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let cut = Arc::new(tokio::sync::Notify::new());
    let refusing = Arc::new(AtomicBool::new(false));
    let (c, r) = (cut.clone(), refusing.clone());
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            if r.load(Ordering::SeqCst) {
                let _ = inbound.shutdown().await;
                continue;
            }
            let upstream = upstream.clone();
            let c = c.clone();
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    () = c.notified() => {}
                }
            });
        }
    });
    Proxy { url, cut, refusing }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_event_stream_is_recovered_from_the_servers_state() {
    // The model's first real call cuts every connection to OpenCode for a
    // second: the prompt is asked while the adapter has no stream.
    let dropped = Arc::new(AtomicBool::new(false));
    let (url, fake) = provider(model("echo hi")).await;
    let s = start(&url).await;
    let p = proxy(&s.server.base_url).await;
    let cfg = config(&p.url);
    let watcher = {
        let fake: FakeProvider = fake.clone();
        let cut = p.cut.clone();
        let refusing = p.refusing.clone();
        let dropped = dropped.clone();
        tokio::spawn(async move {
            while fake.calls() == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            refusing.store(true, Ordering::SeqCst);
            cut.notify_waiters();
            dropped.store(true, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(1)).await;
            refusing.store(false, Ordering::SeqCst);
        })
    };
    let (outcome, events) = run(&cfg, &allow_echo(), CancellationToken::new()).await;
    watcher.await.expect("watcher");
    assert!(dropped.load(Ordering::SeqCst));
    assert_eq!(
        outcome.ending,
        Ending::Succeeded { answer: "4".into() },
        "{events:?}"
    );
    assert!(
        permissions(&events).contains(&("bash".into(), "once".into())),
        "the prompt asked during the gap was found and answered: {events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_becomes_ready_is_a_named_error_not_a_hang() {
    // Something listens but never answers HTTP.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = vec![];
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let mut cfg = config(&url);
    cfg.ready_timeout = Duration::from_secs(2);
    cfg.request_timeout = Duration::from_millis(500);
    let (outcome, _) = run(&cfg, &allow_echo(), CancellationToken::new()).await;
    let (code, message) = failed_with(&outcome).expect("failed");
    assert_eq!(code, ErrorCode::ReadinessTimeout, "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_a_named_error() {
    let (url, _fake) = provider(model("echo hi")).await;
    let s = start(&url).await;
    let mut cfg = config(&s.server.base_url);
    cfg.password = Some("wrong".into());
    cfg.ready_timeout = Duration::from_secs(2);
    let (outcome, _) = run(&cfg, &allow_echo(), CancellationToken::new()).await;
    let (code, message) = failed_with(&outcome).expect("failed");
    assert_eq!(code, ErrorCode::ReadinessTimeout, "{message}");
    assert!(message.contains("401"), "{message}");
    assert!(!message.contains("wrong"));
}
