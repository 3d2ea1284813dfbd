//! The native loop end to end against a fake OpenAI-compatible provider and
//! a fake Connect MCP server, both speaking their real protocols on loopback.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_engine::adapter::{Checkpoint, Ending, EngineEvent, Outcome};
use automesh_engine::connect::ConnectConfig;
use automesh_engine::native::{self, NativeRun};
use automesh_engine::provider::ProviderConfig;
use common::{FakeMcp, Reply, as_sse, mcp, provider, text_completion, tool_call_completion};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const KEY: &str = "sk-live-RECOGNISABLE-provider-key-4242";
const TOKEN: &str = "ctk-RECOGNISABLE-connect-token-9999";
const PAIR: [&str; 2] = ["search_capabilities", "execute_capability"];

/// The model's side of a happy run: search, then execute, then answer.
fn happy(stream: bool) -> impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync {
    move |_, body| {
        let tool_results = body["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
        let answer = match tool_results {
            0 => tool_call_completion("call_1", "search_capabilities", r#"{"query":"send mail"}"#),
            1 => tool_call_completion(
                "call_2",
                "execute_capability",
                r#"{"capability":"mail.send"}"#,
            ),
            _ => text_completion("Mail sent."),
        };
        if stream {
            Reply::Sse(as_sse(&answer))
        } else {
            Reply::Json(answer)
        }
    }
}

fn run_config(provider_url: &str, mcp_url: &str, stream: bool) -> NativeRun {
    NativeRun {
        model: "fake-model".into(),
        prompt: "Send the weekly report by mail.".into(),
        guidance: Some(
            "You run headlessly in the user's cloud worker with their Connect tools.".into(),
        ),
        provider: ProviderConfig {
            kind: "openai-compatible".into(),
            base_url: provider_url.into(),
            api_key: KEY.into(),
            request_timeout: Duration::from_secs(10),
            stream,
        },
        connect: ConnectConfig {
            url: mcp_url.into(),
            token: TOKEN.into(),
            call_timeout: Duration::from_secs(10),
        },
        connect_token_expires_at: None,
        model_authorized: true,
        max_steps: native::DEFAULT_MAX_STEPS,
        deadline: Instant::now() + Duration::from_secs(30),
        resume_from: None,
        budget: Default::default(),
        price: None,
    }
}

async fn go(run: NativeRun) -> (Outcome, Vec<EngineEvent>) {
    go_with(run, CancellationToken::new()).await
}

async fn go_with(run: NativeRun, cancel: CancellationToken) -> (Outcome, Vec<EngineEvent>) {
    let (tx, mut rx) = mpsc::channel(256);
    let collector = tokio::spawn(async move {
        let mut all = vec![];
        while let Some(e) = rx.recv().await {
            all.push(e);
        }
        all
    });
    let outcome = tokio::time::timeout(Duration::from_secs(60), native::run(run, tx, cancel))
        .await
        .expect("the engine always ends, bounded");
    (outcome, collector.await.expect("events"))
}

fn failed(o: &Outcome) -> ErrorCode {
    match &o.ending {
        Ending::Failed(e) => e.code,
        other => panic!("expected a failure, got {other:?}"),
    }
}

async fn happy_path(stream: bool) {
    let (purl, p) = provider(happy(stream)).await;
    let fake = FakeMcp::with_tools(&PAIR);
    let (murl, _stop) = mcp(fake.clone(), TOKEN).await;
    let (outcome, events) = go(run_config(&purl, &murl, stream)).await;
    assert_eq!(
        outcome.ending,
        Ending::Succeeded {
            answer: "Mail sent.".into()
        }
    );
    assert_eq!(outcome.steps, 3);
    assert_eq!(p.calls(), 3);
    // Usage: 2 tool-call steps (100 in / 20 out) and the answer (7 / 3).
    assert_eq!(
        (outcome.usage.input_tokens, outcome.usage.output_tokens),
        (207, 43)
    );
    // The engine counts tokens; the run-coordinator prices them.
    assert_eq!(outcome.usage.cost_micros, 0);
    let calls: Vec<String> = fake.calls.lock().iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(calls, PAIR);
    // A checkpoint stays local: it has no run event payload.
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e.payload().map_or("checkpoint", |p| p.kind()))
        .collect();
    let step = ["usage", "tool_call", "tool_result", "checkpoint"];
    assert_eq!(
        kinds,
        [&step[..], &step[..], &["usage", "assistant_text"]].concat()
    );
    // The provider saw the two reviewed tools, and the guidance.
    let first = &p.bodies.lock()[0];
    let offered: Vec<&str> = first["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(offered.len(), 2);
    assert!(offered.contains(&"search_capabilities") && offered.contains(&"execute_capability"));
    assert_eq!(first["messages"][0]["role"], "system");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn happy_path_without_streaming() {
    happy_path(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn happy_path_with_streaming() {
    happy_path(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_mcp_tool_fails_admission_and_the_provider_is_never_called() {
    let (purl, p) = provider(happy(false)).await;
    let (murl, _stop) = mcp(
        FakeMcp::with_tools(&["search_capabilities", "execute_capability", "run_shell"]),
        TOKEN,
    )
    .await;
    let (outcome, events) = go(run_config(&purl, &murl, false)).await;
    assert_eq!(failed(&outcome), ErrorCode::ToolInventoryMismatch);
    assert_eq!(p.calls(), 0);
    assert!(events.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_mcp_tool_fails_admission() {
    let (purl, p) = provider(happy(false)).await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&["search_capabilities"]), TOKEN).await;
    let (outcome, _) = go(run_config(&purl, &murl, false)).await;
    assert_eq!(failed(&outcome), ErrorCode::ToolInventoryMismatch);
    assert_eq!(p.calls(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_401_fails_before_the_provider() {
    let (purl, p) = provider(happy(false)).await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), "a-different-token").await;
    let (outcome, _) = go(run_config(&purl, &murl, false)).await;
    assert_eq!(failed(&outcome), ErrorCode::ConnectUnauthorized);
    assert_eq!(p.calls(), 0);
}

/// An unreachable Connect endpoint ends the run with a message for people:
/// no URL, no Rust type names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_connect_endpoint_is_named_in_words() {
    let (purl, p) = provider(happy(false)).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let murl = format!("http://{closed}/mcp?key=never-in-a-receipt");
    let (outcome, _) = go(run_config(&purl, &murl, false)).await;
    let Ending::Failed(e) = &outcome.ending else {
        panic!("expected a failure, got {outcome:?}");
    };
    assert_eq!(e.code, ErrorCode::ToolError);
    assert_eq!(e.message, "the Connect endpoint could not be reached");
    for never in ["http", "never-in-a-receipt", "::", "Transport", "rmcp"] {
        assert!(!e.message.contains(never), "{never:?} in {:?}", e.message);
    }
    assert_eq!(p.calls(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_expiring_mid_run_ends_the_run() {
    let (purl, _p) = provider(|_, _| {
        Reply::Delayed(
            Duration::from_millis(300),
            tool_call_completion("c", "search_capabilities", "{}"),
        )
    })
    .await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), TOKEN).await;
    let mut run = run_config(&purl, &murl, false);
    run.connect_token_expires_at = Some(chrono::Utc::now() + chrono::Duration::milliseconds(800));
    let (outcome, _) = go(run).await;
    assert_eq!(failed(&outcome), ErrorCode::ConnectTokenExpired);
    assert!(outcome.steps >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_or_an_unauthorised_model_never_starts() {
    let (purl, p) = provider(happy(false)).await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), TOKEN).await;
    let mut run = run_config(&purl, &murl, false);
    run.connect_token_expires_at = Some(chrono::Utc::now() - chrono::Duration::seconds(1));
    assert_eq!(failed(&go(run).await.0), ErrorCode::ConnectTokenExpired);
    let mut run = run_config(&purl, &murl, false);
    run.model_authorized = false;
    assert_eq!(failed(&go(run).await.0), ErrorCode::ModelNotAuthorized);
    assert_eq!(p.calls(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_limit_ends_the_loop() {
    let (purl, p) = provider(|n, _| {
        Reply::Json(tool_call_completion(
            &format!("c{n}"),
            "search_capabilities",
            "{}",
        ))
    })
    .await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), TOKEN).await;
    let mut run = run_config(&purl, &murl, false);
    run.max_steps = 3;
    let (outcome, _) = go(run).await;
    assert_eq!(failed(&outcome), ErrorCode::StepLimitExceeded);
    assert_eq!(p.calls(), 3);
}

/// A budget per run (issue 32): after every step the run's usage is
/// checked; the step that takes it over a cap is its last — the provider is
/// not called again and that step's tool calls are not made — and it ends
/// `budget_exceeded`, its outcome showing what was spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_its_budget_stops_at_that_step_boundary() {
    // Every step asks for a tool: 100 input and 20 output tokens each.
    let endless = |n: usize, _: &serde_json::Value| {
        Reply::Json(tool_call_completion(
            &format!("c{n}"),
            "search_capabilities",
            "{}",
        ))
    };
    // 1 micro-unit per input token, 2 per output token: 140 per step.
    let price = automesh_domain::Price {
        input_micros_per_million_tokens: 1_000_000,
        output_micros_per_million_tokens: 2_000_000,
    };
    for (budget, price, steps) in [
        // 140, 280 > 150: two steps.
        (
            automesh_domain::RunBudget {
                max_cost_micros: Some(150),
                max_tokens: None,
            },
            Some(price),
            2,
        ),
        // 120, 240, 360 > 250 tokens: three steps.
        (
            automesh_domain::RunBudget {
                max_cost_micros: None,
                max_tokens: Some(250),
            },
            None,
            3,
        ),
        // Unpriced: the cost cap cannot be reached; the token cap is.
        (
            automesh_domain::RunBudget {
                max_cost_micros: Some(1),
                max_tokens: Some(130),
            },
            None,
            2,
        ),
    ] {
        let (purl, p) = provider(endless).await;
        let fake = FakeMcp::with_tools(&PAIR);
        let (murl, _stop) = mcp(fake.clone(), TOKEN).await;
        let mut run = run_config(&purl, &murl, false);
        run.budget = budget;
        run.price = price;
        let (outcome, events) = go(run).await;
        assert_eq!(failed(&outcome), ErrorCode::BudgetExceeded, "{budget:?}");
        assert_eq!(
            p.calls(),
            steps,
            "{budget:?}: the provider was called again"
        );
        assert_eq!(outcome.steps, steps as u32);
        assert_eq!(
            outcome.usage.input_tokens,
            100 * steps as i64,
            "what was spent"
        );
        // The last step's tool call was not made.
        assert_eq!(fake.calls.lock().len(), steps - 1, "{budget:?}");
        let results = events
            .iter()
            .filter(|e| matches!(e, EngineEvent::ToolResult { .. }))
            .count();
        assert_eq!(results, steps - 1);
        if let Ending::Failed(e) = &outcome.ending {
            assert!(
                e.message.contains(&format!("after step {steps}")),
                "{}",
                e.message
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_to_an_unreviewed_tool_is_refused_and_reported() {
    let (purl, _p) = provider(|_, body| {
        let refused = body["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "tool"));
        Reply::Json(if refused {
            text_completion("ok")
        } else {
            tool_call_completion("c1", "run_shell", "{}")
        })
    })
    .await;
    let fake = FakeMcp::with_tools(&PAIR);
    let (murl, _stop) = mcp(fake.clone(), TOKEN).await;
    let (outcome, events) = go(run_config(&purl, &murl, false)).await;
    assert_eq!(
        outcome.ending,
        Ending::Succeeded {
            answer: "ok".into()
        }
    );
    assert!(
        fake.calls.lock().is_empty(),
        "nothing reached the MCP server"
    );
    assert!(events.iter().any(
        |e| matches!(e, EngineEvent::ToolResult { tool, is_error: true, .. } if tool == "run_shell")
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_during_a_provider_call() {
    let (purl, _p) = provider(|_, _| Reply::Slow(Duration::from_secs(30))).await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), TOKEN).await;
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.cancel();
    });
    let started = std::time::Instant::now();
    let (outcome, _) = go_with(run_config(&purl, &murl, false), cancel).await;
    assert_eq!(outcome.ending, Ending::Cancelled);
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_during_a_tool_call() {
    let (purl, _p) = provider(|_, _| {
        Reply::Json(tool_call_completion(
            "c1",
            "execute_capability",
            r#"{"slow":true}"#,
        ))
    })
    .await;
    let fake = FakeMcp::with_tools(&PAIR);
    let (murl, _stop) = mcp(fake.clone(), TOKEN).await;
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    let watcher = fake.clone();
    tokio::spawn(async move {
        // Cancel once the slow tool call is in flight.
        while watcher.calls.lock().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c.cancel();
    });
    let (outcome, _) = go_with(run_config(&purl, &murl, false), cancel).await;
    assert_eq!(outcome.ending, Ending::Cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_resumes_from_its_checkpoint() {
    let (purl, p) = provider(happy(false)).await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), TOKEN).await;
    let (first, events) = go(run_config(&purl, &murl, false)).await;
    assert!(matches!(first.ending, Ending::Succeeded { .. }));
    let checkpoint: Checkpoint = events
        .iter()
        .find_map(|e| match e {
            EngineEvent::Checkpoint(c) if c.step == 1 => Some(c.clone()),
            _ => None,
        })
        .expect("a checkpoint after step 1");
    let before = p.calls();
    let mut run = run_config(&purl, &murl, false);
    run.resume_from = Some(checkpoint.clone());
    let (resumed, _) = go(run).await;
    assert_eq!(
        resumed.ending,
        Ending::Succeeded {
            answer: "Mail sent.".into()
        }
    );
    assert_eq!(
        p.calls() - before,
        2,
        "resumed at step 2, not from the prompt"
    );
    assert_eq!(resumed.steps, 3);
    assert!(resumed.usage.input_tokens > checkpoint.usage.input_tokens);
}

/// A log writer that keeps everything written, for the secret scan.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_credential_reaches_events_checkpoints_errors_logs_or_spans() {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    // Logs through a writer we keep; spans through a real OpenTelemetry
    // pipeline into an in-memory exporter.
    let logs = Captured::default();
    let writer = logs.clone();
    let exporter = InMemorySpanExporter::default();
    let tracer_provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(tracer_provider.tracer("engine-test")))
        .with(tracing_subscriber::fmt::layer().with_writer(move || writer.clone()))
        .with(tracing_subscriber::EnvFilter::new("trace"));
    let _guard = tracing::subscriber::set_default(subscriber);

    let (purl, p) = provider(happy(true)).await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), TOKEN).await;
    let (outcome, events) = go(run_config(&purl, &murl, true)).await;
    assert!(matches!(outcome.ending, Ending::Succeeded { .. }));
    // And a failing run, whose error message must be clean too.
    let (unauth_url, _p2) = provider(|_, _| Reply::Status(401, None)).await;
    let (failed_run, _) = go(run_config(&unauth_url, &murl, false)).await;
    assert_eq!(failed(&failed_run), ErrorCode::ProviderUnavailable);

    let mut haystack = format!("{outcome:?}\n{failed_run:?}\n{events:?}\n");
    for e in &events {
        if let EngineEvent::Checkpoint(c) = e {
            haystack.push_str(&serde_json::to_string(c).expect("checkpoint json"));
        }
    }
    haystack.push_str(&String::from_utf8_lossy(&logs.0.lock().expect("lock")));
    assert!(
        haystack.contains("gen_ai.chat"),
        "spans were captured for the scan"
    );
    for secret in [KEY, TOKEN] {
        assert!(!haystack.contains(secret), "{secret} leaked");
    }
    // The key did travel, as an Authorization header only.
    assert!(p.auth.lock().iter().all(|a| a == &format!("Bearer {KEY}")));
    let bodies = serde_json::to_string(&*p.bodies.lock()).expect("json");
    assert!(
        !bodies.contains(KEY) && !bodies.contains(TOKEN),
        "no credential in a prompt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_engine_runs_behind_the_adapter_contract() {
    use automesh_engine::{EngineAdapter, EngineRequest, NativeEngine};
    let (purl, p) = provider(happy(false)).await;
    let (murl, _stop) = mcp(FakeMcp::with_tools(&PAIR), TOKEN).await;
    let engine: Box<dyn EngineAdapter> = Box::new(NativeEngine {
        template: run_config(&purl, &murl, false),
    });
    assert_eq!(engine.engine_id(), "native-v1");
    // The provider is asked for the catalogue's provider name; without one,
    // for the catalogue id after its provider prefix, never the id itself.
    for (model, provider_model, asked) in [
        ("fake/alias", "fake-model-2026", "fake-model-2026"),
        ("openai/gpt-4.1-mini", "", "gpt-4.1-mini"),
    ] {
        let before = p.calls();
        let (tx, mut rx) = mpsc::channel(64);
        let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let outcome = engine
            .run(
                EngineRequest {
                    prompt: "Send it.".into(),
                    model: model.into(),
                    provider_model: provider_model.into(),
                    automation_id: "aut-1".into(),
                    guidance: None,
                    deadline: Instant::now() + Duration::from_secs(30),
                    resume_from: None,
                    budget: Default::default(),
                    price: None,
                },
                tx,
                CancellationToken::new(),
            )
            .await;
        drain.await.expect("drain");
        assert_eq!(
            outcome.ending,
            Ending::Succeeded {
                answer: "Mail sent.".into()
            }
        );
        let bodies = p.bodies.lock();
        assert!(bodies.len() > before);
        for body in &bodies[before..] {
            assert_eq!(body["model"], asked, "{model}");
        }
    }
}

/// Model and tool calls are CLIENT spans under the OpenTelemetry GenAI
/// conventions, a failed one is ERROR with `error.type`, and the provider
/// and the Connect endpoint receive the run's `traceparent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn genai_spans_follow_the_conventions_and_calls_carry_the_trace() {
    use opentelemetry::trace::{SpanKind, Status, TraceContextExt, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let exporter = InMemorySpanExporter::default();
    let tracer_provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(tracer_provider.tracer("engine-test")))
        .with(tracing_subscriber::EnvFilter::new("info"));
    let _guard = tracing::subscriber::set_default(subscriber);

    let (purl, p) = provider(happy(false)).await;
    let fake = FakeMcp::with_tools(&PAIR);
    let (murl, _stop) = mcp(fake.clone(), TOKEN).await;
    let run_span = tracing::info_span!("automesh.runner.run");
    let trace_id = run_span
        .context()
        .span()
        .span_context()
        .trace_id()
        .to_string();
    let (outcome, _) = go(run_config(&purl, &murl, false))
        .instrument(run_span)
        .await;
    assert!(
        matches!(outcome.ending, Ending::Succeeded { .. }),
        "{outcome:?}"
    );
    let (unauth_url, _p2) = provider(|_, _| Reply::Status(401, None)).await;
    let (failed_run, _) = go(run_config(&unauth_url, &murl, false)).await;
    assert_eq!(failed(&failed_run), ErrorCode::ProviderUnavailable);

    let spans = exporter.get_finished_spans().expect("spans");
    let attr = |s: &opentelemetry_sdk::trace::SpanData, k: &str| {
        s.attributes
            .iter()
            .find(|kv| kv.key.as_str() == k)
            .map(|kv| kv.value.to_string())
    };
    let chats: Vec<_> = spans
        .iter()
        .filter(|s| s.name.starts_with("chat "))
        .collect();
    assert!(
        chats.len() >= 3,
        "two calls of the good run, one of the failed"
    );
    for s in &chats {
        assert_eq!(s.span_kind, SpanKind::Client, "{}", s.name);
        assert_eq!(attr(s, "gen_ai.operation.name").as_deref(), Some("chat"));
        assert_eq!(attr(s, "gen_ai.provider.name").as_deref(), Some("openai"));
        assert_eq!(
            attr(s, "gen_ai.request.model").as_deref(),
            Some("fake-model")
        );
        assert_eq!(attr(s, "server.address").as_deref(), Some("127.0.0.1"));
        assert!(attr(s, "server.port").is_some());
        assert!(
            attr(s, "gen_ai.system").is_none(),
            "the deprecated attribute is gone"
        );
    }
    let answered: Vec<_> = chats
        .iter()
        .filter(|s| s.status != Status::error(""))
        .filter(|s| attr(s, "error.type").is_none())
        .collect();
    assert!(answered.iter().all(|s| {
        attr(s, "gen_ai.response.model").as_deref() == Some("fake-model-2026")
            && attr(s, "gen_ai.response.id").is_some_and(|id| id.starts_with("chatcmpl-fake"))
            && attr(s, "gen_ai.usage.input_tokens").is_some()
    }));
    let refused: Vec<_> = chats
        .iter()
        .filter(|s| attr(s, "error.type").is_some())
        .collect();
    assert_eq!(refused.len(), 1, "the failed run's call");
    assert_eq!(
        attr(refused[0], "error.type").as_deref(),
        Some("provider_unavailable")
    );
    assert!(matches!(refused[0].status, Status::Error { .. }));
    let tools: Vec<_> = spans
        .iter()
        .filter(|s| s.name.starts_with("execute_tool "))
        .collect();
    assert!(!tools.is_empty());
    for s in &tools {
        assert_eq!(s.span_kind, SpanKind::Client);
        assert!(attr(s, "gen_ai.tool.name").is_some());
        assert_eq!(attr(s, "server.address").as_deref(), Some("127.0.0.1"));
    }
    // The good run's calls carried its trace to the provider and to Connect.
    let provider_traces = p.traceparents.lock().clone();
    assert!(
        !provider_traces.is_empty()
            && provider_traces
                .iter()
                .all(|t| t.starts_with(&format!("00-{trace_id}-"))),
        "{provider_traces:?} vs {trace_id}"
    );
    let connect_traces = fake.traceparents.lock().clone();
    assert!(
        connect_traces
            .iter()
            .any(|t| t.starts_with(&format!("00-{trace_id}-"))),
        "{connect_traces:?} vs {trace_id}"
    );
}
