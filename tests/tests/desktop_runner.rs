//! The desktop path end to end with the reference runner (`automesh-runner`)
//! running the native engine against a fake OpenAI-compatible provider and a
//! fake Connect MCP server (both speak the real protocols on loopback), on
//! PostgreSQL, with two desktop-runner-gateway replicas: coordinators call
//! replica B, the runner starts on replica A.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use automesh_desktop_runner_gateway::stream::StreamSettings;
use automesh_domain::{ErrorCode, RunState};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_engine::adapter::NativeEngine;
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_client::DesktopRunnerServiceClient;
use automesh_proto::v1 as pb;
use automesh_runner::{Runner, Settings, Stats};
use automesh_store::Backend;
use automesh_testkit::{FakeProvider, Reply, provider, text_completion};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

const MCP_TOKEN: &str = "connect-secret-token-for-the-run";
const PROVIDER_KEY: &str = "sk-provider-secret-key";

struct Desk {
    mesh: Mesh,
    runner_token: String,
    provider: FakeProvider,
    engine: NativeEngine,
    state_dir: PathBuf,
    _mcp: CancellationToken,
}

/// A mesh on PostgreSQL with two runner-gateway replicas, a runner token for
/// alice, and a native engine whose provider answers as `script` says.
async fn desk(
    run_deadline: Duration,
    streams: StreamSettings,
    script: impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync + 'static,
) -> Desk {
    desk_on(Backend::Postgres, run_deadline, streams, script).await
}

/// [`desk`] on `backend`.
async fn desk_on(
    backend: Backend,
    run_deadline: Duration,
    streams: StreamSettings,
    script: impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync + 'static,
) -> Desk {
    let mesh = Mesh::start_with(
        backend,
        MeshOptions {
            desktop_via_runner_gateway: true,
            runner_gateways: 2,
            run_deadline,
            runner_streams: streams,
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh");
    let runner_token = mesh
        .automations(Some(&mesh.token("acme", "alice")))
        .create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: "laptop".into(),
        })
        .await
        .expect("mint")
        .into_inner()
        .token;
    let (provider_url, provider) = provider(script).await;
    let (mcp_url, mcp_stop) = automesh_testkit::connect(MCP_TOKEN).await;
    let engine = NativeEngine::openai_compatible(
        &provider_url,
        PROVIDER_KEY,
        &mcp_url,
        MCP_TOKEN,
        automesh_engine::adapter::NativeSettings {
            request_timeout: Duration::from_secs(60),
            stream: false,
            max_steps: 8,
            connect_call_timeout: Duration::from_secs(10),
        },
    );
    let state_dir = std::env::temp_dir().join(format!(
        "automesh-runner-test-{}",
        uuid::Uuid::new_v4().simple()
    ));
    Desk {
        mesh,
        runner_token,
        provider,
        engine,
        state_dir,
        _mcp: mcp_stop,
    }
}

/// A runner process, in-process: aborting `task` kills it (its engines
/// with it), as SIGKILL would; its record stays on disk.
struct RunnerProc {
    task: tokio::task::JoinHandle<()>,
    stats: Arc<Stats>,
}

impl Desk {
    fn start_runner(&self, gateways: &[&str]) -> RunnerProc {
        self.start_runner_as(gateways, &self.runner_token, &self.state_dir)
    }

    /// A runner with its own token and record.
    fn start_runner_as(&self, gateways: &[&str], token: &str, state_dir: &Path) -> RunnerProc {
        let mut settings = Settings::new(
            gateways.iter().map(|g| (*g).to_owned()).collect(),
            token.to_owned().into(),
            state_dir.to_owned(),
        );
        settings.reconnect_min = Duration::from_millis(50);
        settings.reconnect_max = Duration::from_millis(500);
        settings.dead_after = Duration::from_secs(3);
        let runner = Runner::new(settings, Arc::new(self.engine.clone())).expect("runner");
        let stats = runner.stats.clone();
        let task = tokio::spawn(async move { runner.run(CancellationToken::new()).await });
        RunnerProc { task, stats }
    }

    async fn run_now(&self) -> pb::Run {
        self.mesh.desktop_run_now("acme", "alice").await
    }

    async fn terminal(&self, run_id: &str) -> automesh_domain::Run {
        self.mesh
            .until_terminal(run_id, Duration::from_secs(60))
            .await
    }

    async fn stop(self) {
        let _ = std::fs::remove_dir_all(&self.state_dir);
        self.mesh.stop().await.expect("stop");
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(tokio::time::Instant::now() < give_up, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn streams() -> StreamSettings {
    StreamSettings {
        heartbeat_interval: Duration::from_millis(300),
        dead_after: Duration::from_secs(2),
        hello_timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assignment_made_through_replica_b_reaches_the_runner_on_a_and_survives_losing_a() {
    // The model takes a while: replica A goes away mid-run.
    let desk = desk(Duration::from_secs(60), streams(), |n, _| match n {
        0 => Reply::Delayed(Duration::from_secs(2), text_completion("tidied")),
        _ => Reply::Json(text_completion("a second submission must never happen")),
    })
    .await;
    let a = desk.mesh.runner_gateways[0].clone();
    let b = desk.mesh.runner_gateways[1].clone();
    let runner = desk.start_runner(&[&a, &b]);
    until("runner connected to A", || {
        runner.stats.connections.load(Ordering::SeqCst) == 1
    })
    .await;
    let run = desk.run_now().await;
    let provider = desk.provider.clone();
    until("the model is asked", || provider.calls() == 1).await;
    let held = desk
        .mesh
        .store()
        .desktop_run(&run.id)
        .await
        .expect("read")
        .expect("offered");
    assert!(held.runner_id.is_some(), "claimed for the runner on A");

    // Replica A stops; the runner reconnects to B and reports there.
    desk.mesh.runner_gateway_stops[0].cancel();
    let ended = desk.terminal(&run.id).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    assert!(runner.stats.connections.load(Ordering::SeqCst) >= 2);
    assert_eq!(desk.provider.calls(), 1, "the prompt was submitted once");
    assert_eq!(runner.stats.executions.load(Ordering::SeqCst), 1);
    let events = desk.mesh.events(&run.id).await;
    assert!(
        events.iter().any(|e| matches!(
            &e.payload,
            automesh_domain::RunEventPayload::AssistantText { text } if text == "tidied"
        )),
        "the runner's events reached the run through B: {events:?}"
    );
    // No secret of the runner's engine reached the run's record.
    let dump = format!("{events:?}{ended:?}");
    assert!(!dump.contains(PROVIDER_KEY) && !dump.contains(MCP_TOKEN));
    runner.task.abort();
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_mid_run_and_restarted_against_b_never_runs_it_again() {
    let desk = desk(Duration::from_secs(60), streams(), |_, _| {
        Reply::Delayed(Duration::from_secs(20), text_completion("too late"))
    })
    .await;
    let a = desk.mesh.runner_gateways[0].clone();
    let b = desk.mesh.runner_gateways[1].clone();
    let first = desk.start_runner(&[&a]);
    until("runner connected to A", || {
        first.stats.connections.load(Ordering::SeqCst) == 1
    })
    .await;
    let run = desk.run_now().await;
    let provider = desk.provider.clone();
    until("the model is asked", || provider.calls() == 1).await;

    // SIGKILL, in effect: the engine and the stream die with the runner.
    first.task.abort();
    let _ = first.task.await;

    let second = desk.start_runner(&[&b]);
    let ended = desk.terminal(&run.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Failed, Some(ErrorCode::RunnerInterrupted)),
        "{ended:?}"
    );
    assert_eq!(second.stats.executions.load(Ordering::SeqCst), 0);
    assert_eq!(desk.provider.calls(), 1, "the prompt was submitted once");
    second.task.abort();
    desk.stop().await;
}

/// Alice's runner connected to replica A through a relay that, from the
/// moment a run is made, loses everything the runner sends; returns once the
/// runner holds that run (its journal has it), with the journal's path.
struct HeldBehindALossyLink {
    relay: automesh_e2e_tests::relay::Relay,
    runner: RunnerProc,
    run: pb::Run,
    journal: PathBuf,
}

async fn a_run_held_behind_a_lossy_link(desk: &Desk) -> HeldBehindALossyLink {
    let a = desk.mesh.runner_gateways[0].clone();
    let relay = automesh_e2e_tests::relay::Relay::start(
        a.trim_start_matches("http://").parse().expect("address"),
    )
    .await
    .expect("relay");
    let runner = desk.start_runner(&[&relay.url]);
    until("the runner connected", || {
        runner.stats.connections.load(Ordering::SeqCst) == 1
    })
    .await;
    relay.lose_upstream(true);
    let run = desk.run_now().await;
    let journal = desk.state_dir.join(format!("{}.jsonl", run.id));
    until("the runner holds the assignment", || journal.exists()).await;
    HeldBehindALossyLink {
        relay,
        runner,
        run,
        journal,
    }
}

/// A runner's acceptance can be lost on the way (a link that carries only
/// the gateway's side): the gateway then declares the stream dead and gives
/// the run to the owner's other runner. The first runner must not have run
/// it: a runner starts a run only once the gateway confirmed it recorded the
/// acceptance. When the first runner returns, it is told the run is
/// another's, and drops it without ever running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_whose_acceptance_is_lost_never_runs_what_the_gateway_gives_another_runner() {
    let desk = desk(Duration::from_secs(60), streams(), |_, _| {
        Reply::Json(text_completion("done once"))
    })
    .await;
    let a = desk.mesh.runner_gateways[0].clone();
    // From the run on, nothing the first runner sends reaches the gateway.
    let HeldBehindALossyLink {
        relay,
        runner: first,
        run,
        journal,
    } = a_run_held_behind_a_lossy_link(&desk).await;

    let second_token = desk
        .mesh
        .automations(Some(&desk.mesh.token("acme", "alice")))
        .create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: "desktop".into(),
        })
        .await
        .expect("mint")
        .into_inner()
        .token;
    let second_dir = desk.state_dir.with_extension("second");
    let second = desk.start_runner_as(&[&a], &second_token, &second_dir);
    let ended = desk.terminal(&run.id).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    assert_eq!(second.stats.executions.load(Ordering::SeqCst), 1);

    // The link heals; the first runner returns and lets the run go.
    relay.lose_upstream(false);
    until("the first runner let the run go", || !journal.exists()).await;
    assert_eq!(first.stats.executions.load(Ordering::SeqCst), 0);
    assert_eq!(desk.provider.calls(), 1, "the prompt was submitted once");
    first.task.abort();
    second.task.abort();
    let _ = std::fs::remove_dir_all(&second_dir);
    desk.stop().await;
}

/// A runner that dies holding an assignment whose acceptance was never
/// confirmed had not started it: after a restart it is not
/// `runner_interrupted`, and the run runs once, there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_restarted_before_its_acceptance_was_confirmed_runs_the_run_once() {
    let desk = desk(Duration::from_secs(60), streams(), |_, _| {
        Reply::Json(text_completion("done once"))
    })
    .await;
    let a = desk.mesh.runner_gateways[0].clone();
    let HeldBehindALossyLink {
        relay: _link,
        runner: first,
        run,
        ..
    } = a_run_held_behind_a_lossy_link(&desk).await;
    assert_eq!(first.stats.executions.load(Ordering::SeqCst), 0);
    // Killed, in effect, and started again with its record.
    first.task.abort();
    let _ = first.task.await;
    let again = desk.start_runner(&[&a]);
    let ended = desk.terminal(&run.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Succeeded, None),
        "{ended:?}"
    );
    assert_eq!(again.stats.executions.load(Ordering::SeqCst), 1);
    assert_eq!(desk.provider.calls(), 1, "the prompt was submitted once");
    again.task.abort();
    desk.stop().await;
}

/// A test runner speaking the protocol by hand, to stall on purpose.
async fn stalled_runner(
    addr: &str,
    token: &str,
) -> (
    mpsc::Sender<rpb::ConnectRequest>,
    tonic::Streaming<rpb::ConnectResponse>,
) {
    let mut client =
        DesktopRunnerServiceClient::new(automesh_rpc::client::channel(addr).expect("channel"));
    let (tx, rx) = mpsc::channel(16);
    tx.send(rpb::ConnectRequest {
        message: Some(rpb::connect_request::Message::Hello(rpb::Hello {
            runner_version: "stall".into(),
            held_runs: vec![],
            ping_liveness: false,
        })),
    })
    .await
    .expect("hello");
    let request = automesh_e2e_tests::with_bearer(token, ReceiverStream::new(rx));
    let stream = tokio::time::timeout(Duration::from_secs(10), client.connect(request))
        .await
        .expect("bounded")
        .expect("connected")
        .into_inner();
    (tx, stream)
}

async fn next_assignment(stream: &mut tonic::Streaming<rpb::ConnectResponse>) -> rpb::Assignment {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("bounded")
            .expect("ok")
            .expect("open");
        if let Some(rpb::connect_response::Message::Assignment(a)) = m.message {
            return a;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_is_declared_dead_and_its_run_is_offered_again_when_the_runner_returns() {
    let desk = desk(Duration::from_secs(60), streams(), |_, _| {
        Reply::Json(text_completion("done"))
    })
    .await;
    let a = desk.mesh.runner_gateways[0].clone();
    let b = desk.mesh.runner_gateways[1].clone();
    // The runner gets the assignment, then stalls: TCP open, nothing sent.
    let (_keep_open, mut stream) = stalled_runner(&a, &desk.runner_token).await;
    let run = desk.run_now().await;
    let offered = next_assignment(&mut stream).await;
    assert_eq!(offered.run_id, run.id);
    let declared = automesh_e2e_tests::end_of(
        &mut stream,
        Duration::from_secs(10),
        "declared dead within 10 s",
    )
    .await;
    let status = declared.expect("ended with a status");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    // The unaccepted assignment is given back as the stream is dropped.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    while desk
        .mesh
        .store()
        .desktop_run(&run.id)
        .await
        .expect("read")
        .expect("offered")
        .runner_id
        .is_some()
    {
        assert!(tokio::time::Instant::now() < give_up, "never given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The runner comes back (through the other replica): offered again, run once.
    let back = desk.start_runner(&[&b]);
    let ended = desk.terminal(&run.id).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    assert_eq!(back.stats.executions.load(Ordering::SeqCst), 1);
    assert_eq!(desk.provider.calls(), 1);
    back.task.abort();
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_runner_that_never_returns_leaves_its_run_runner_offline_at_the_deadline() {
    let desk = desk(Duration::from_secs(5), streams(), |_, _| {
        Reply::Json(text_completion("done"))
    })
    .await;
    let a = desk.mesh.runner_gateways[0].clone();
    let (_keep_open, mut stream) = stalled_runner(&a, &desk.runner_token).await;
    let run = desk.run_now().await;
    assert_eq!(next_assignment(&mut stream).await.run_id, run.id);
    let ended = desk.terminal(&run.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::TimedOut, Some(ErrorCode::RunnerOffline)),
        "{ended:?}"
    );
    assert_eq!(desk.provider.calls(), 0);
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_run_stops_the_runners_engine_and_ends_once_idle_is_observed() {
    let desk = desk(Duration::from_secs(60), streams(), |_, _| {
        Reply::Delayed(Duration::from_secs(30), text_completion("too late"))
    })
    .await;
    let a = desk.mesh.runner_gateways[0].clone();
    let runner = desk.start_runner(&[&a]);
    until("runner connected", || {
        runner.stats.connections.load(Ordering::SeqCst) == 1
    })
    .await;
    let run = desk.run_now().await;
    let provider = desk.provider.clone();
    until("the model is asked", || provider.calls() == 1).await;
    desk.mesh
        .runs(Some(&desk.mesh.token("acme", "alice")))
        .cancel_run(pb::CancelRunRequest { id: run.id.clone() })
        .await
        .expect("cancel");
    let ended = desk.terminal(&run.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Cancelled, None),
        "{ended:?}"
    );
    let held = desk
        .mesh
        .store()
        .desktop_run(&run.id)
        .await
        .expect("read")
        .expect("offered");
    assert!(held.idle, "idle was observed on the runner");
    runner.task.abort();
    desk.stop().await;
}

/// The mesh charges a desktop run's tokens at the catalogue price of its
/// model, whatever the runner reported as cost; the provider is asked for
/// the catalogue's provider name; a later price change charges later runs
/// and leaves earlier receipts alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn desktop_runs_are_charged_at_the_catalogue_price_and_keep_it() {
    use automesh_e2e_tests::{PRICE, PRICED_MODEL, assert_charged, reprice_keeps_history};
    let mut desk = desk(Duration::from_secs(60), streams(), |_, body| {
        let tools = body["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
        Reply::Json(match tools {
            0 => automesh_testkit::tool_call_completion(
                "call_1",
                "search_capabilities",
                r#"{"query":"downloads"}"#,
            ),
            _ => text_completion("tidied"),
        })
    })
    .await;
    let runner = desk.start_runner(&[&desk.mesh.runner_gateways[0]]);
    let run = desk
        .mesh
        .desktop_run_now_of("acme", "alice", PRICED_MODEL)
        .await;
    let ended = desk.terminal(&run.id).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    let first = assert_charged(desk.mesh.store(), &run.id, PRICE).await;
    // Two model calls: 100/20 and 7/3 tokens (the fake's figures).
    assert_eq!(
        (first.usage.input_tokens, first.usage.output_tokens),
        (107, 23)
    );
    for body in desk.provider.bodies.lock().iter() {
        assert_eq!(body["model"], "echo", "the catalogue's provider name");
    }
    // The run reads `running` before its engine's first event.
    let events = desk.mesh.events(&run.id).await;
    let position = |want: &dyn Fn(&automesh_domain::RunEventPayload) -> bool| {
        events
            .iter()
            .position(|e| want(&e.payload))
            .unwrap_or_else(|| panic!("missing event in {events:?}"))
    };
    let running = position(
        &|p| matches!(p, automesh_domain::RunEventPayload::StatusChange { state, .. } if state == "running"),
    );
    let first_engine_event = position(&|p| {
        matches!(
            p,
            automesh_domain::RunEventPayload::Usage(_)
                | automesh_domain::RunEventPayload::ToolCall { .. }
        )
    });
    assert!(running < first_engine_event, "{events:?}");

    let doubled = automesh_domain::Price {
        input_micros_per_million_tokens: 2 * PRICE.input_micros_per_million_tokens,
        output_micros_per_million_tokens: 2 * PRICE.output_micros_per_million_tokens,
    };
    reprice_keeps_history(&mut desk.mesh, &first, doubled).await;
    let second = desk
        .mesh
        .desktop_run_now_of("acme", "alice", PRICED_MODEL)
        .await;
    let ended = desk.terminal(&second.id).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    let second = assert_charged(desk.mesh.store(), &second.id, doubled).await;
    assert!(second.usage.cost_micros > first.usage.cost_micros);
    runner.task.abort();
    desk.stop().await;
}

fn opencode_binary() -> PathBuf {
    std::env::var("AUTOMESH_OPENCODE_BIN").map_or_else(
        |_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../.tools/opencode/node_modules/opencode-linux-x64/bin/opencode")
        },
        PathBuf::from,
    )
}

/// The fake model as OpenCode calls it: a tool result → "4"; otherwise one
/// bash call.
fn opencode_model(n: usize, req: &serde_json::Value) -> Reply {
    let _ = n;
    let last_is_tool = req["messages"]
        .as_array()
        .and_then(|m| m.last())
        .is_some_and(|m| m["role"] == "tool");
    let answer = if req["tools"].is_null() {
        text_completion("Fake title")
    } else if last_is_tool {
        text_completion("4")
    } else {
        automesh_testkit::tool_call_completion(
            "call_1",
            "bash",
            &serde_json::json!({"command": "echo hi", "description": "Print hi"}).to_string(),
        )
    };
    Reply::Sse(automesh_testkit::as_sse(&answer))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desktop_run_executes_through_the_opencode_adapter_under_the_runners_policy() {
    use automesh_engine::opencode::{
        OpenCodeConfig, OpenCodeEngine, OpenCodeServer, PermissionPolicy, PermissionRule,
        PolicyBook, isolated_env,
    };
    let mut desk = desk(Duration::from_secs(120), streams(), opencode_model).await;
    let bin = opencode_binary();
    assert!(
        bin.exists(),
        "OpenCode missing at {} (scripts/test installs it)",
        bin.display()
    );
    let root = desk.state_dir.with_extension("opencode");
    let project = root.join("project");
    std::fs::create_dir_all(&project).expect("project");
    let provider_url = desk.engine.template.provider.base_url.clone();
    let config = serde_json::json!({
        "model": "fake/echo", "small_model": "fake/echo", "autoupdate": false, "share": "disabled",
        "provider": {"fake": {"npm": "@ai-sdk/openai-compatible", "name": "Fake",
            "options": {"baseURL": provider_url, "apiKey": "sk-fake"},
            "models": {"echo": {"name": "Echo", "tool_call": true}}}},
        "permission": {"bash": "ask"}
    });
    let server = OpenCodeServer::start(
        &bin,
        &project,
        &isolated_env(&root, &config.to_string()),
        Duration::from_secs(60),
    )
    .await
    .expect("opencode serve");
    let engine = OpenCodeEngine {
        config: OpenCodeConfig::new(server.base_url.clone()),
        policies: PolicyBook {
            default: PermissionPolicy {
                allow: vec![PermissionRule {
                    permission: "bash".into(),
                    patterns: vec!["echo *".into()],
                }],
            },
            automations: Default::default(),
        },
    };
    let mut settings = Settings::new(
        vec![desk.mesh.runner_gateways[0].clone()],
        desk.runner_token.clone().into(),
        desk.state_dir.clone(),
    );
    settings.reconnect_min = Duration::from_millis(50);
    let runner = Runner::new(settings, Arc::new(engine)).expect("runner");
    let task = tokio::spawn(async move { runner.run(CancellationToken::new()).await });
    // The priced model: OpenCode is asked for `fake/echo` (the catalogue's
    // provider prefix and provider name), the mesh charges its tokens.
    let run = desk
        .mesh
        .desktop_run_now_of("acme", "alice", automesh_e2e_tests::PRICED_MODEL)
        .await;
    let ended = desk.terminal(&run.id).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    let receipt =
        automesh_e2e_tests::assert_charged(desk.mesh.store(), &run.id, automesh_e2e_tests::PRICE)
            .await;
    assert_eq!(receipt.engine.as_deref(), Some("opencode-1.18"));
    automesh_e2e_tests::reprice_keeps_history(
        &mut desk.mesh,
        &receipt,
        automesh_domain::Price {
            input_micros_per_million_tokens: 1,
            output_micros_per_million_tokens: 1,
        },
    )
    .await;
    let events = desk
        .mesh
        .store()
        .internal()
        .events(&run.id, 0, 200)
        .await
        .expect("events");
    let replies: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.payload {
            automesh_domain::RunEventPayload::PermissionPrompt { reply, .. } => {
                Some(reply.clone().unwrap_or_default())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        replies,
        vec![String::new(), "once".to_owned()],
        "{events:?}"
    );
    assert!(events.iter().any(|e| matches!(
        &e.payload,
        automesh_domain::RunEventPayload::AssistantText { text } if text == "4"
    )));
    task.abort();
    drop(server);
    let _ = std::fs::remove_dir_all(&root);
    desk.stop().await;
}

/// A budget per run (issue 32) set through the public API reaches the
/// runner's engine: the run stops at the step boundary where its cost went
/// over `max_cost_micros` (the provider's call count proves the next call
/// was never made) and ends `budget_exceeded`, its receipt showing what it
/// spent and the cap it ran under.
async fn a_desktop_run_over_its_budget_stops_at_that_step(backend: Backend) {
    use automesh_e2e_tests::Api;
    // Every step asks for a tool: 100 input and 20 output tokens.
    let desk = desk_on(backend, Duration::from_secs(60), streams(), |n, _| {
        Reply::Json(automesh_testkit::tool_call_completion(
            &format!("c{n}"),
            "search_capabilities",
            "{}",
        ))
    })
    .await;
    let runner = desk.start_runner(&[&desk.mesh.runner_gateways[0]]);
    let token = desk.mesh.token("acme", "alice");
    let mut api = desk.mesh.automations(Some(&token));
    let step = automesh_e2e_tests::expected_cost(automesh_e2e_tests::PRICE, 100, 20);
    let mut request =
        automesh_e2e_tests::daily_automation("capped", "tidy my downloads", pb::Surface::Desktop);
    if let Some(a) = request.automation.as_mut() {
        a.model = automesh_e2e_tests::PRICED_MODEL.into();
        // Over it in the second step.
        a.max_cost_micros = Some(step + step / 2);
    }
    let a = api.create(request).await;
    assert_eq!(a.max_cost_micros, Some(step + step / 2));
    assert_eq!(a.max_tokens, None);
    let run = api.run_now(&a.id, "capped").await;
    let ended = desk.terminal(&run.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Failed, Some(ErrorCode::BudgetExceeded)),
        "{ended:?}"
    );
    assert_eq!(desk.provider.calls(), 2, "the provider was called again");
    let receipt = desk.mesh.receipt(&run.id).await;
    assert_eq!(receipt.budget.max_cost_micros, Some(step + step / 2));
    assert_eq!(receipt.usage.input_tokens, 200);
    assert_eq!(
        receipt.usage.cost_micros,
        automesh_e2e_tests::expected_cost(automesh_e2e_tests::PRICE, 200, 40)
    );
    // And through the public API.
    let got = desk
        .mesh
        .runs(Some(&token))
        .get_run(pb::GetRunRequest { id: run.id.clone() })
        .await
        .expect("get run")
        .into_inner()
        .run
        .and_then(|r| r.receipt)
        .expect("receipt");
    assert_eq!(got.error_code, "budget_exceeded");
    assert_eq!(got.max_cost_micros, Some(step + step / 2));
    runner.task.abort();
    desk.stop().await;
}

automesh_e2e_tests::on_both_backends!(a_desktop_run_over_its_budget_stops_at_that_step);

/// On the desktop a run's model need only be in the catalogue the
/// coordinator holds: a desktop automation whose model was removed from it
/// ends its next run `model_not_authorized` before anything is offered to a
/// runner (the provider is never called), needs attention and is paused.
async fn a_desktop_run_of_a_model_gone_from_the_catalogue_is_not_dispatched(backend: Backend) {
    use automesh_e2e_tests::Api;
    let mut desk = desk_on(backend, Duration::from_secs(60), streams(), |_, _| {
        Reply::Json(text_completion("tidied"))
    })
    .await;
    let runner = desk.start_runner(&[&desk.mesh.runner_gateways[0]]);
    let token = desk.mesh.token("acme", "alice");
    let mut api = desk.mesh.automations(Some(&token));
    let mut request =
        automesh_e2e_tests::daily_automation("desk", "tidy my downloads", pb::Surface::Desktop);
    if let Some(a) = request.automation.as_mut() {
        a.model = "openai/gpt-4.1".into();
    }
    let a = api.create(request).await;
    let first = api.run_now(&a.id, "first").await;
    assert_eq!(desk.terminal(&first.id).await.state, RunState::Succeeded);
    let calls = desk.provider.calls();
    let mut without = automesh_e2e_tests::test_models();
    without.models.retain(|m| m.id != "openai/gpt-4.1");
    desk.mesh
        .reprice(without)
        .await
        .expect("restart the coordinators");
    let refused = api.run_now(&a.id, "second").await;
    let refused = desk.terminal(&refused.id).await;
    assert_eq!(
        (refused.state, refused.error_code),
        (RunState::Failed, Some(ErrorCode::ModelNotAuthorized)),
        "{refused:?}"
    );
    assert_eq!(desk.provider.calls(), calls, "the provider was called");
    assert_eq!(runner.stats.executions.load(Ordering::SeqCst), 1);
    assert!(
        desk.mesh
            .store()
            .desktop_run(&refused.id)
            .await
            .expect("read")
            .is_none(),
        "the refused run was offered to the runners"
    );
    // The automation moves after its run ended: waited for, bounded.
    let alice = automesh_domain::Principal::new("acme", "alice");
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    let paused = loop {
        let a = desk
            .mesh
            .store()
            .get_automation(&alice, &a.id)
            .await
            .expect("automation");
        if a.state != automesh_domain::AutomationState::Active
            || tokio::time::Instant::now() >= give_up
        {
            break a;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (
            paused.state,
            paused.attention.map(|x| x.reason),
            paused.next_run_at
        ),
        (
            automesh_domain::AutomationState::NeedsAttention,
            Some(ErrorCode::ModelNotAuthorized),
            None
        )
    );
    runner.task.abort();
    desk.stop().await;
}

automesh_e2e_tests::on_both_backends!(
    a_desktop_run_of_a_model_gone_from_the_catalogue_is_not_dispatched
);

/// `ListRunners`: a runner reads online while its stream is held and
/// offline (with when it was last seen) once the stream ends; another
/// user's runners are not listed, and a revoked runner is not listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runners_are_listed_online_while_connected_and_offline_after() {
    let desk = desk_on(
        Backend::Sqlite,
        Duration::from_secs(60),
        streams(),
        |_, _| Reply::Json(text_completion("done")),
    )
    .await;
    let token = desk.mesh.token("acme", "alice");
    let automations = desk.mesh.automations(Some(&token));
    let list = || {
        let mut automations = automations.clone();
        async move {
            automations
                .list_runners(pb::ListRunnersRequest {})
                .await
                .expect("list")
                .into_inner()
                .runners
        }
    };
    let before = list().await;
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(before[0].name, "laptop");
    assert!(!before[0].connected && before[0].last_seen_time.is_none());
    let runner_id = before[0].runner_id.clone();

    let a = desk.mesh.runner_gateways[0].clone();
    let (hold, stream) = stalled_runner(&a, &desk.runner_token).await;
    let online = list().await;
    assert!(online[0].connected, "{online:?}");
    let seen = online[0].last_seen_time.expect("seen");

    // Another user sees none of alice's runners.
    let eve = desk.mesh.token("acme", "eve");
    let eves = desk
        .mesh
        .automations(Some(&eve))
        .list_runners(pb::ListRunnersRequest {})
        .await
        .expect("list")
        .into_inner()
        .runners;
    assert!(eves.is_empty(), "{eves:?}");

    // The runner goes away: offline, last seen no earlier than before.
    drop(hold);
    drop(stream);
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    let offline = loop {
        let now = list().await;
        if !now[0].connected {
            break now;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "still online: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let last = offline[0].last_seen_time.expect("last seen");
    assert!(
        (last.seconds, last.nanos) >= (seen.seconds, seen.nanos),
        "{last:?} < {seen:?}"
    );

    automations
        .clone()
        .revoke_runner_token(pb::RevokeRunnerTokenRequest { runner_id })
        .await
        .expect("revoke");
    assert!(list().await.is_empty());
    desk.stop().await;
}
