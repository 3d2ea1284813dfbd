//! The cloud path end to end (on PostgreSQL, and on both backends where it
//! says so): scheduler → coordinator →
//! cloud-worker-lifecycle (the cloud executor, local-process driver) → the
//! real worker agent binary as a child process → the native engine against
//! a fake OpenAI-compatible provider and a fake Connect MCP server (both
//! speak the real protocols on loopback).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use automesh_cloud_worker_lifecycle::cloud::{Cloud, CloudSettings};
use automesh_cloud_worker_lifecycle::driver::LocalProcessDriver;
use automesh_cloud_worker_lifecycle::{Config, WorkerEnv};
use automesh_domain::automation::NewAutomation;
use automesh_domain::{
    AutomationState, ErrorCode, Principal, RunState, Schedule, Surface, WorkerState,
};
use automesh_e2e_tests::{CloudOptions, Mesh, MeshOptions, lifecycle_config};
use automesh_store::Backend;
use automesh_store::cloud::WorkerMove;
use automesh_testkit::{FakeProvider, Reply, provider, text_completion};
use chrono::Utc;
use tokio_util::sync::CancellationToken;

const PROVIDER_KEY: &str = "sk-cloud-provider-key-never-stored";
const MCP_TOKEN: &str = "cloud-connect-token-never-stored";

struct Env {
    mesh: Mesh,
    driver: Arc<LocalProcessDriver>,
    provider: FakeProvider,
    mcp_url: String,
    workers: PathBuf,
    _mcp: CancellationToken,
}

fn owner() -> Principal {
    Principal::new("acme", "carol")
}

async fn env(
    script: impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync + 'static,
    tune: impl FnOnce(&mut Config),
) -> Env {
    env_on(Backend::Postgres, script, tune).await
}

/// [`env`] on `backend`.
async fn env_on(
    backend: Backend,
    script: impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync + 'static,
    tune: impl FnOnce(&mut Config),
) -> Env {
    let (provider_url, fake) = provider(script).await;
    let (mcp_url, mcp_stop) = automesh_testkit::connect(MCP_TOKEN).await;
    let workers = std::env::temp_dir().join(format!(
        "automesh-workers-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let defaults = lifecycle_config();
    let mut config = Config {
        readiness_cap: Duration::from_secs(30),
        idle_after: Duration::from_secs(3),
        idle_check: Duration::from_millis(300),
        lease: Duration::from_secs(3),
        agent_orphan_after: Duration::from_secs(10),
        agent_command: vec![env!("CARGO_BIN_EXE_automesh-worker-agent").to_owned()],
        workers_dir: workers.clone(),
        worker: WorkerEnv {
            provider_url: Some(provider_url),
            provider_key: PROVIDER_KEY.into(),
            connect_url: Some(mcp_url.clone()),
            connect_token: MCP_TOKEN.into(),
            ..defaults.worker.clone()
        },
        ..defaults
    };
    tune(&mut config);
    // The lifecycle's own driver for this configuration, kept to count its
    // starts.
    let driver = Arc::new(
        config
            .worker
            .local_driver(config.agent_command.clone(), config.workers_dir.clone())
            .with_orphan_after(config.agent_orphan_after),
    );
    let mesh = Mesh::start_with(
        backend,
        MeshOptions {
            cloud: Some(CloudOptions {
                driver: driver.clone(),
                config,
            }),
            run_deadline: Duration::from_secs(60),
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh");
    mesh.store()
        .register_worker(&owner(), "local-process", Utc::now())
        .await
        .expect("worker");
    Env {
        mesh,
        driver,
        provider: fake,
        mcp_url,
        workers,
        _mcp: mcp_stop,
    }
}

impl Env {
    /// A cloud automation of carol's, due once at `at`.
    async fn automation(&self, id: &str, at: chrono::DateTime<Utc>) {
        self.automation_of(id, at, "fake/echo").await
    }

    /// The same, of `model`.
    async fn automation_of(&self, id: &str, at: chrono::DateTime<Utc>, model: &str) {
        let o = owner();
        self.mesh
            .store()
            .create_automation(
                &NewAutomation {
                    pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
                    budget: Default::default(),
                    monthly_budget_micros: None,
                    id: id.into(),
                    owner: o.clone(),
                    name: "cloud".into(),
                    prompt: "summarise my inbox".into(),
                    model: model.into(),
                    surface: Surface::Web,
                    schedule: Schedule::Once { at },
                },
                Some(at),
                Utc::now(),
            )
            .await
            .expect("automation");
    }

    async fn run_of(&self, automation_id: &str, at: chrono::DateTime<Utc>) -> automesh_domain::Run {
        let run_id = automesh_domain::ids::scheduled_run_id(automation_id, at);
        let give_up = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            if let Ok(run) = self.mesh.store().internal().get_run(&run_id).await
                && run.state.is_terminal()
            {
                return run;
            }
            assert!(tokio::time::Instant::now() < give_up, "the run did not end");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn worker_state(&self) -> WorkerState {
        self.mesh
            .store()
            .get_worker(&owner())
            .await
            .expect("read")
            .expect("worker")
            .state
    }

    async fn until_worker(&self, want: WorkerState) {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
        while self.worker_state().await != want {
            assert!(
                tokio::time::Instant::now() < give_up,
                "worker never became {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every text column of the tables a run touches, as one string.
    async fn dump(&self) -> String {
        let mut all = String::new();
        for table in [
            "automations",
            "runs",
            "run_events",
            "receipts",
            "cloud_workers",
            "cloud_dispatch",
        ] {
            let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT CAST(t AS TEXT) FROM {table} t"
            )))
            .fetch_all(self.mesh.store().pool())
            .await
            .expect("dump");
            all.push_str(&rows.join("\n"));
        }
        all
    }

    fn secrets(&self) -> Vec<String> {
        let c = &self.mesh.credential;
        let worker = |w: &str| c.derive(&format!("collaborator:{w}"));
        vec![
            PROVIDER_KEY.to_owned(),
            MCP_TOKEN.to_owned(),
            c.derive("worker-host"),
            worker("any"),
        ]
    }

    /// Waits (bounded) until the automation needs attention for `code`.
    async fn needs_attention(&self, automation_id: &str, code: ErrorCode) {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let a = self
                .mesh
                .store()
                .get_automation(&owner(), automation_id)
                .await
                .expect("automation");
            if a.state == AutomationState::NeedsAttention {
                assert_eq!(a.attention.map(|x| x.reason), Some(code));
                return;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "never needed attention: {a:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(self) {
        let _ = std::fs::remove_dir_all(&self.workers);
        self.mesh.stop().await.expect("stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_is_woken_for_a_due_run_and_stopped_again_when_idle() {
    let env = env(
        |_, _| Reply::Json(text_completion("inbox summarised")),
        |_| {},
    )
    .await;
    assert_eq!(env.worker_state().await, WorkerState::Stopped);
    let at = Utc::now() + chrono::Duration::seconds(2);
    env.automation("journey", at).await;
    let run = env.run_of("journey", at).await;
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");
    let receipt = env.mesh.receipt(&run.id).await;
    assert!(receipt.wake_micros > 0, "wake timing recorded: {receipt:?}");
    assert!(
        receipt.admission_micros > 0,
        "admission timing recorded: {receipt:?}"
    );
    assert_eq!(receipt.engine.as_deref(), Some("native-v1"));
    assert_eq!(env.provider.calls(), 1);
    let events = env.mesh.events(&run.id).await;
    assert!(
        events.iter().any(|e| matches!(
            &e.payload,
            automesh_domain::RunEventPayload::AssistantText { text } if text == "inbox summarised"
        )),
        "{events:?}"
    );
    // The worker was woken, and after the idle period it is stopped again.
    env.until_worker(WorkerState::Stopped).await;
    // No credential reached the database, the services' logs (captured in
    // this process) or the worker agent's log.
    let dump = env.dump().await;
    let logs = automesh_telemetry::captured_logs();
    let worker = env
        .mesh
        .store()
        .get_worker(&owner())
        .await
        .expect("read")
        .expect("worker");
    let agent_log = std::fs::read_to_string(
        env.workers
            .join(&worker.id)
            .join(automesh_cloud_worker_lifecycle::driver::AGENT_LOG),
    )
    .expect("agent log");
    assert!(
        agent_log.contains("thread idle"),
        "the agent logged: {agent_log}"
    );
    assert!(
        logs.contains("cloud run reserved"),
        "the services' logs were captured"
    );
    let collaborator = env
        .mesh
        .credential
        .derive(&format!("collaborator:{}", worker.id));
    for secret in env.secrets().into_iter().chain([collaborator]) {
        assert!(!dump.contains(&secret), "a credential reached the database");
        assert!(
            !logs.contains(&secret),
            "a credential reached the services' logs"
        );
        assert!(
            !agent_log.contains(&secret),
            "a credential reached the agent's log"
        );
    }
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_becomes_ready_ends_readiness_timeout_and_needs_attention() {
    let env = env(
        |_, _| Reply::Json(text_completion("never")),
        |c| {
            c.readiness_cap = Duration::from_secs(2);
            // A real process that never listens.
            c.agent_command = vec!["/bin/sh".into(), "-c".into(), "sleep 600".into()];
        },
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("never-ready", at).await;
    let run = env.run_of("never-ready", at).await;
    assert_eq!(
        (run.state, run.error_code),
        (RunState::Failed, Some(ErrorCode::ReadinessTimeout)),
        "{run:?}"
    );
    env.needs_attention("never-ready", run.error_code.expect("code"))
        .await;
    assert_eq!(env.provider.calls(), 0);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_owner_has_no_worker_ends_runtime_missing() {
    let env = env(|_, _| Reply::Json(text_completion("never")), |_| {}).await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("no-worker", at).await;
    sqlx::query("DELETE FROM cloud_workers")
        .execute(env.mesh.store().pool())
        .await
        .expect("delete");
    let run = env.run_of("no-worker", at).await;
    assert_eq!(
        (run.state, run.error_code),
        (RunState::Failed, Some(ErrorCode::RuntimeMissing)),
        "{run:?}"
    );
    env.needs_attention("no-worker", run.error_code.expect("code"))
        .await;
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_after_submission_is_replaced_and_the_prompt_is_sent_once() {
    let mut env = env(
        |_, _| Reply::Delayed(Duration::from_secs(3), text_completion("done once")),
        |_| {},
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("reattach", at).await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    while env.provider.calls() == 0 {
        assert!(tokio::time::Instant::now() < give_up, "never submitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Kill the coordinator mid-run; another one takes the run over.
    env.mesh.coordinators[0].abort();
    env.mesh.add_coordinator().await.expect("coordinator");
    let run = env.run_of("reattach", at).await;
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");
    assert_eq!(
        env.provider.calls(),
        1,
        "the provider saw the prompt exactly once"
    );
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drifted_mcp_registration_is_repaired_before_admission() {
    let env = env(
        |_, _| Reply::Json(text_completion("ok")),
        |c| {
            c.idle_after = Duration::from_secs(600);
        },
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("first", at).await;
    assert_eq!(env.run_of("first", at).await.state, RunState::Succeeded);
    let worker = env
        .mesh
        .store()
        .get_worker(&owner())
        .await
        .expect("read")
        .expect("worker");
    let file = env.workers.join(&worker.id).join("mcp-registrations.json");
    let written = std::fs::read_to_string(&file).expect("registration persisted");
    assert!(written.contains(&env.mcp_url), "{written}");
    // Someone alters it on the worker.
    std::fs::write(
        &file,
        r#"{"fake/echo": ["openwork-cloud", "http://127.0.0.1:9/elsewhere"]}"#,
    )
    .expect("alter");
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("second", at).await;
    assert_eq!(env.run_of("second", at).await.state, RunState::Succeeded);
    let repaired = std::fs::read_to_string(&file).expect("registration");
    assert!(
        repaired.contains(&env.mcp_url) && !repaired.contains("elsewhere"),
        "{repaired}"
    );
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_connect_configuration_a_run_ends_mcp_config_missing_and_never_calls_the_model() {
    let env = env(
        |_, _| Reply::Json(text_completion("never")),
        |c| c.worker.connect_url = None,
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("no-connect", at).await;
    let run = env.run_of("no-connect", at).await;
    assert_eq!(
        (run.state, run.error_code),
        (RunState::Failed, Some(ErrorCode::McpConfigMissing)),
        "{run:?}"
    );
    assert_eq!(env.provider.calls(), 0);
    env.needs_attention("no-connect", run.error_code.expect("code"))
        .await;
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_stop_racing_an_admission_never_stops_a_worker_the_admission_holds() {
    let env = env(|_, _| Reply::Json(text_completion("ok")), |_| {}).await;
    let store = env.mesh.store().clone();
    let worker = store
        .get_worker(&owner())
        .await
        .expect("read")
        .expect("worker");
    let cloud = Cloud::new(
        store.clone(),
        Arc::new(LocalProcessDriver::new(
            vec![],
            env.workers.clone(),
            String::new(),
            "".into(),
        )),
        CloudSettings {
            // Far shorter than the time since the worker was last used (0),
            // far longer than the race itself.
            idle_after: Duration::from_secs(1),
            ..CloudSettings::default()
        },
        env.mesh.credential.clone(),
    );
    let mut held = 0;
    let mut stopped = 0;
    for i in 0..60 {
        // A ready worker, unused for a while.
        sqlx::query(
            "UPDATE cloud_workers SET state = 'ready', endpoint = 'http://127.0.0.1:9', last_active_at = 0",
        )
        .execute(store.pool())
        .await
        .expect("ready");
        let run_id = format!("race-{i}");
        let admission = {
            let store = store.clone();
            let worker_id = worker.id.clone();
            async move {
                store
                    .reserve_cloud_run(
                        &automesh_store::cloud::Reservation {
                            run_id: &run_id,
                            org_id: "acme",
                            owner_id: "carol",
                            worker_id: &worker_id,
                            workspace_id: "ws",
                            thread_id: "thr",
                            message_id: "msg",
                            spec: b"",
                        },
                        Utc::now(),
                    )
                    .await
                    .expect("reserve");
                store
                    .move_worker(&worker_id, WorkerMove::Touch, Utc::now())
                    .await
                    .expect("touch")
            }
        };
        let (touched, pass) = tokio::join!(admission, cloud.idle_pass());
        pass.expect("idle pass");
        let state = env.worker_state().await;
        if touched {
            held += 1;
            assert_eq!(
                state,
                WorkerState::Ready,
                "iteration {i}: a worker an admission holds was stopped"
            );
        } else {
            stopped += 1;
            // The admission saw it stopping and will wake it again.
            assert_ne!(state, WorkerState::Ready, "iteration {i}");
        }
        sqlx::query("UPDATE cloud_dispatch SET phase = 'finished'")
            .execute(store.pool())
            .await
            .expect("finish");
    }
    eprintln!("race outcomes: admission held the worker {held}×, idle stop won {stopped}×");
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_runs_waking_one_worker_start_it_once() {
    let env = env(
        |_, _| Reply::Json(text_completion("ok")),
        |c| {
            c.idle_after = Duration::from_secs(600);
        },
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(2);
    for id in ["wake-a", "wake-b", "wake-c"] {
        env.automation(id, at).await;
    }
    for id in ["wake-a", "wake-b", "wake-c"] {
        assert_eq!(env.run_of(id, at).await.state, RunState::Succeeded);
    }
    assert_eq!(
        env.driver.starts(),
        1,
        "three wakes coalesced into one start"
    );
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_run_ends_runtime_failed_and_needs_attention() {
    let env = env(
        |_, _| Reply::Json(text_completion("never")),
        |c| c.agent_command = vec!["/bin/false".into()],
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("crashes", at).await;
    let run = env.run_of("crashes", at).await;
    assert_eq!(
        (run.state, run.error_code),
        (RunState::Failed, Some(ErrorCode::RuntimeFailed)),
        "{run:?}"
    );
    env.needs_attention("crashes", ErrorCode::RuntimeFailed)
        .await;
    assert_eq!(env.worker_state().await, WorkerState::Failed);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_cloud_run_stops_the_thread_and_ends_once_it_is_idle() {
    let env = env(
        |_, _| Reply::Delayed(Duration::from_secs(30), text_completion("too late")),
        |_| {},
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("cancel-me", at).await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    while env.provider.calls() == 0 {
        assert!(tokio::time::Instant::now() < give_up, "never submitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run_id = automesh_domain::ids::scheduled_run_id("cancel-me", at);
    env.mesh
        .store()
        .internal()
        .request_cancel(&run_id, Utc::now())
        .await
        .expect("cancel");
    let run = env.run_of("cancel-me", at).await;
    assert_eq!(
        (run.state, run.error_code),
        (RunState::Cancelled, None),
        "{run:?}"
    );
    let d = env
        .mesh
        .store()
        .cloud_run(&run_id)
        .await
        .expect("read")
        .expect("dispatch");
    assert_eq!(
        d.phase,
        automesh_store::cloud::CloudPhase::Finished,
        "the thread was observed idle"
    );
    env.stop().await;
}

/// A cloud run reads `running` while its agent executes it: from the
/// moment the agent has the message, before the engine's events, and its
/// receipt's execution time covers the execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloud_run_is_running_while_its_agent_executes_it() {
    let env = env(
        |_, _| Reply::Delayed(Duration::from_secs(3), text_completion("slow answer")),
        |_| {},
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation("slow", at).await;
    let run_id = automesh_domain::ids::scheduled_run_id("slow", at);
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    // The engine spends 3 s in its provider call; within them the run must
    // read `running` (today's bug: `admitted` until the end).
    loop {
        let now = env.mesh.store().internal().get_run(&run_id).await.ok();
        match now.as_ref().map(|r| r.state) {
            Some(RunState::Running) => break,
            Some(s) if s.is_terminal() => panic!("the run ended without reading running: {now:?}"),
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "never running: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run = env.run_of("slow", at).await;
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");
    let events = env.mesh.events(&run.id).await;
    let seq = |want: &dyn Fn(&automesh_domain::RunEventPayload) -> bool| {
        events
            .iter()
            .find(|e| want(&e.payload))
            .map(|e| e.sequence)
            .unwrap_or_else(|| panic!("missing event in {events:?}"))
    };
    let running = seq(
        &|p| matches!(p, automesh_domain::RunEventPayload::StatusChange { state, .. } if state == "running"),
    );
    let text = seq(&|p| matches!(p, automesh_domain::RunEventPayload::AssistantText { .. }));
    assert!(
        running < text,
        "running before the engine's events: {events:?}"
    );
    let receipt = env.mesh.receipt(&run.id).await;
    assert!(
        receipt.execution_micros >= 2_500_000,
        "the execution time covers the 3 s the engine spent: {receipt:?}"
    );
    env.stop().await;
}

/// A cloud run is charged its tokens at the catalogue price of its model,
/// the agent asks the provider for the catalogue's provider name, and the
/// agent runs with the lifecycle's engine settings (streaming, step limit,
/// request timeout), as a desktop runner does with its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_runs_are_charged_at_the_catalogue_price_and_run_with_the_lifecycles_engine_settings()
{
    use automesh_e2e_tests::{PRICE, PRICED_MODEL, assert_charged, reprice_keeps_history};
    let mut env = env(
        |_, body| {
            let tools = body["messages"]
                .as_array()
                .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
            let answer = match tools {
                0 => automesh_testkit::tool_call_completion(
                    "call_1",
                    "search_capabilities",
                    r#"{"query":"inbox"}"#,
                ),
                _ => text_completion("inbox summarised"),
            };
            // Streaming is what the lifecycle configured: answer in kind.
            if body["stream"] == true {
                Reply::Sse(automesh_testkit::as_sse(&answer))
            } else {
                Reply::Json(answer)
            }
        },
        |c| {
            // Kept alive past the run, so its process can be looked at.
            c.idle_after = Duration::from_secs(120);
            c.worker.request_timeout = Duration::from_secs(7);
            c.worker.stream = true;
            c.worker.max_steps = 5;
        },
    )
    .await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation_of("priced", at, PRICED_MODEL).await;
    let run = env.run_of("priced", at).await;
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");
    let first = assert_charged(env.mesh.store(), &run.id, PRICE).await;
    assert_eq!(
        (first.usage.input_tokens, first.usage.output_tokens),
        (107, 23)
    );
    let bodies = env.provider.bodies.lock().clone();
    assert_eq!(bodies.len(), 2);
    for body in &bodies {
        assert_eq!(body["model"], "echo", "the catalogue's provider name");
        assert_eq!(body["stream"], true, "the lifecycle's streaming setting");
    }
    // The agent process was started with the lifecycle's engine settings.
    let worker = env
        .mesh
        .store()
        .get_worker(&owner())
        .await
        .expect("read")
        .expect("worker");
    let pid = std::fs::read_to_string(
        env.workers
            .join(&worker.id)
            .join(automesh_worker_agent::PID_FILE),
    )
    .expect("agent.pid");
    let environ = std::fs::read(format!("/proc/{}/environ", pid.trim())).expect("environ");
    let environ: Vec<String> = environ
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    for want in [
        "AUTOMESH_MAX_STEPS=5",
        "AUTOMESH_PROVIDER_STREAM=true",
        "AUTOMESH_PROVIDER_REQUEST_TIMEOUT=7000ms",
    ] {
        assert!(environ.iter().any(|v| v == want), "{want} in {environ:?}");
    }

    let doubled = automesh_domain::Price {
        input_micros_per_million_tokens: 2 * PRICE.input_micros_per_million_tokens,
        output_micros_per_million_tokens: 2 * PRICE.output_micros_per_million_tokens,
    };
    reprice_keeps_history(&mut env.mesh, &first, doubled).await;
    let at = Utc::now() + chrono::Duration::seconds(1);
    env.automation_of("priced-again", at, PRICED_MODEL).await;
    let run = env.run_of("priced-again", at).await;
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");
    assert_charged(env.mesh.store(), &run.id, doubled).await;
    env.stop().await;
}

/// The catalogue a coordinator holds decides, at run time, whether a run's
/// model may still run: a model de-authorised for the owner's organisation
/// after the automation was created ends the next run `model_not_authorized`
/// before anything is dispatched (the provider is never called), moves the
/// automation to needs-attention and pauses its schedule; activation is
/// refused while the model stays de-authorised, and re-authorising and
/// activating clears it.
async fn a_de_authorised_model_never_runs_and_needs_attention(backend: Backend) {
    use automesh_e2e_tests::{Api, test_models};
    use automesh_proto::v1 as pb;
    let mut env = env_on(backend, |_, _| Reply::Json(text_completion("done")), |_| {}).await;
    let o = owner();
    let token = env.mesh.token(&o.org_id, &o.user_id);
    let mut api = env.mesh.automations(Some(&token));
    let mut request =
        automesh_e2e_tests::daily_automation("acme only", "summarise", pb::Surface::Web);
    if let Some(a) = request.automation.as_mut() {
        a.model = "restricted/acme-only".into();
    }
    let a = api.create(request).await;
    assert_eq!(a.placement, pb::Placement::Cloud as i32);
    let first = api.run_now(&a.id, "first").await;
    let first = env
        .mesh
        .until_terminal(&first.id, Duration::from_secs(60))
        .await;
    assert_eq!(first.state, RunState::Succeeded, "{first:?}");
    let calls = env.provider.calls();
    assert!(calls > 0);

    // The coordinators restart on a catalogue that authorises the model
    // for another organisation only.
    let mut elsewhere = test_models();
    for m in &mut elsewhere.models {
        if m.id == "restricted/acme-only" {
            m.authorized_orgs = vec!["globex".into()];
        }
    }
    env.mesh
        .reprice(elsewhere)
        .await
        .expect("restart the coordinators");
    let refused = api.run_now(&a.id, "second").await;
    let refused = env
        .mesh
        .until_terminal(&refused.id, Duration::from_secs(60))
        .await;
    assert_eq!(
        (refused.state, refused.error_code),
        (RunState::Failed, Some(ErrorCode::ModelNotAuthorized)),
        "{refused:?}"
    );
    assert_eq!(env.provider.calls(), calls, "the provider was called");
    let receipt = env.mesh.receipt(&refused.id).await;
    assert!(
        receipt
            .error_message
            .as_deref()
            .is_some_and(|m| m.contains("not authorised for organisation acme")),
        "{receipt:?}"
    );
    assert_eq!(receipt.usage.cost_micros, 0);
    // Nothing reached the worker: the run was never dispatched.
    assert!(
        env.mesh
            .store()
            .cloud_run(&refused.id)
            .await
            .expect("read")
            .is_none(),
        "a cloud dispatch row for a refused run"
    );
    env.needs_attention(&a.id, ErrorCode::ModelNotAuthorized)
        .await;
    let paused = env
        .mesh
        .store()
        .get_automation(&o, &a.id)
        .await
        .expect("automation");
    assert_eq!(paused.next_run_at, None, "its schedule is paused");

    // Re-authorised (the gateway's catalogue authorises acme) and activated:
    // active again, and the next run runs.
    env.mesh
        .reprice(test_models())
        .await
        .expect("restart the coordinators");
    let active = api
        .activate_automation(pb::ActivateAutomationRequest {
            id: a.id.clone(),
            etag: String::new(),
        })
        .await
        .expect("activate")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(active.state, pb::AutomationState::Active as i32);
    assert!(active.next_run_time.is_some(), "{active:?}");
    let third = api.run_now(&a.id, "third").await;
    let third = env
        .mesh
        .until_terminal(&third.id, Duration::from_secs(60))
        .await;
    assert_eq!(third.state, RunState::Succeeded, "{third:?}");
    assert!(env.provider.calls() > calls);
    env.stop().await;
}

automesh_e2e_tests::on_both_backends!(a_de_authorised_model_never_runs_and_needs_attention);
