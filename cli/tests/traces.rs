//! One trace per run, across separate processes: the mesh runs as its own
//! processes on PostgreSQL (a real `automesh runner`, local-process worker
//! agents) exporting over OTLP to a collector in this test, and each run's
//! trace is read back whole.

use std::collections::BTreeSet;
use std::time::Duration;

use automesh_domain::{Principal, RunState};
use automesh_e2e_tests::otlp::{Receiver, Span};
use automesh_e2e_tests::processes::{Cluster, ClusterSpec, Kind};
use automesh_e2e_tests::{Api, metric};
use automesh_proto::v1 as pb;
use automesh_testkit::{Reply, provider, text_completion, tool_call_completion};
use chrono::Utc;

const MCP_TOKEN: &str = "traces-connect-token";

/// The model: one tool call, then an answer (so a run has model and tool
/// spans); a prompt that says FAIL is refused (401), one that says SLOW is
/// answered after a pause.
fn model(_: usize, req: &serde_json::Value) -> Reply {
    let messages = req["messages"].as_array().cloned().unwrap_or_default();
    let said = |word: &str| {
        messages
            .iter()
            .any(|m| m["role"] == "user" && m["content"].as_str().is_some_and(|c| c.contains(word)))
    };
    if said("FAIL") {
        return Reply::Status(401, None);
    }
    if said("SLOW") {
        return Reply::Delayed(Duration::from_secs(8), text_completion("done slowly"));
    }
    let last_is_tool = messages.last().is_some_and(|m| m["role"] == "tool");
    if last_is_tool {
        Reply::Json(text_completion("done"))
    } else {
        Reply::Json(tool_call_completion(
            "call_1",
            "search_capabilities",
            r#"{"query":"mail"}"#,
        ))
    }
}

/// One trace: exactly one root, and every other span's parent in it.
fn assert_one_whole_trace(spans: &[Span]) {
    let roots: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .collect();
    assert_eq!(roots.len(), 1, "one root:\n{}", summary(spans));
    let ids: BTreeSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let orphans: Vec<&Span> = spans
        .iter()
        .filter(|s| !s.parent_span_id.is_empty() && !ids.contains(s.parent_span_id.as_str()))
        .collect();
    assert!(
        orphans.is_empty(),
        "orphan spans {orphans:?} in:\n{}",
        summary(spans)
    );
}

/// Whether `service` sent a span named `prefix…`.
fn has(spans: &[Span], service: &str, prefix: &str) -> bool {
    spans
        .iter()
        .any(|s| s.service == service && s.name.starts_with(prefix))
}

async fn run_now(
    cluster: &Cluster,
    owner: &Principal,
    surface: pb::Surface,
    prompt: &str,
) -> pb::Run {
    let token = cluster.token(&owner.org_id, &owner.user_id);
    let mut api = cluster.automations(&token);
    let request = automesh_e2e_tests::daily_automation("traced", prompt, surface);
    let a = api.create(request).await;
    api.run_now(&a.id, "traced").await
}

async fn until_terminal(cluster: &Cluster, run_id: &str) -> automesh_domain::Run {
    automesh_e2e_tests::until_ended(cluster.store(), run_id, Duration::from_secs(90)).await
}

fn summary(spans: &[Span]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "{:<32} {:<44} kind={} status={} parent={} id={}",
                s.service, s.name, s.kind, s.status, s.parent_span_id, s.span_id
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits (bounded) until the trace holds spans of every wanted service.
async fn trace_with(receiver: &Receiver, trace_id: &str, services: &[&str]) -> Vec<Span> {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let spans = receiver.trace(trace_id);
        let seen: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
        if services.iter().all(|s| seen.contains(s)) {
            // Give the last batches a moment.
            tokio::time::sleep(Duration::from_secs(1)).await;
            return receiver.trace(trace_id);
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "trace {trace_id} lacks some of {services:?}:\n{}",
            summary(&spans)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn carol() -> Principal {
    Principal::new("acme", "carol")
}

fn dana() -> Principal {
    Principal::new("acme", "dana")
}

/// The mesh as processes exporting to a collector in this test, the model
/// and Connect fakes, a cloud worker for carol and a runner for dana.
async fn world(
    tune: impl FnOnce(ClusterSpec) -> ClusterSpec,
) -> (Receiver, Cluster, tokio_util::sync::CancellationToken) {
    let receiver = Receiver::start().await.expect("collector");
    let (provider_url, _model) = provider(model).await;
    let (mcp_url, mcp_stop) = automesh_testkit::connect(MCP_TOKEN).await;
    let spec = tune(
        ClusterSpec::new(1, &provider_url, &mcp_url, MCP_TOKEN)
            .set_all("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint),
    );
    let mut cluster = Cluster::start(std::path::Path::new(env!("CARGO_BIN_EXE_automesh")), spec)
        .await
        .expect("cluster");
    cluster
        .store()
        .register_worker(&carol(), "local-process", Utc::now())
        .await
        .expect("worker");
    let d = dana();
    cluster
        .add_runner(&d.org_id, &d.user_id)
        .await
        .expect("runner");
    (receiver, cluster, mcp_stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desktop_and_a_cloud_run_each_give_one_trace_across_every_process() {
    let (receiver, mut cluster, _mcp) = world(|spec| {
        let mut spec = spec
            .set_all("OTEL_BSP_SCHEDULE_DELAY", "100")
            .set_all("AUTOMESH_LOG_FORMAT", "json");
        // Two coordinators: one is killed under a run, the other takes it over.
        spec.replicas.insert(Kind::Coordinator, 2);
        spec
    })
    .await;
    let (carol, dana) = (carol(), dana());

    let desktop = run_now(&cluster, &dana, pb::Surface::Desktop, "summarise my inbox").await;
    assert_eq!(
        until_terminal(&cluster, &desktop.id).await.state,
        RunState::Succeeded
    );
    let spans = trace_with(
        &receiver,
        &desktop.trace_id,
        &[
            "automesh-gateway",
            "automesh-scheduler",
            "automesh-run-coordinator",
            "automesh-desktop-runner-gateway",
            "automesh-runner",
        ],
    )
    .await;
    eprintln!("desktop trace:\n{}", summary(&spans));
    assert_one_whole_trace(&spans);
    assert!(has(&spans, "automesh-runner", "chat "), "model spans");
    assert!(
        has(&spans, "automesh-runner", "execute_tool "),
        "tool spans"
    );
    assert!(has(
        &spans,
        "automesh-desktop-runner-gateway",
        "automesh.desktop.deliver"
    ));

    let cloud = run_now(&cluster, &carol, pb::Surface::Web, "summarise my inbox").await;
    assert_eq!(
        until_terminal(&cluster, &cloud.id).await.state,
        RunState::Succeeded
    );
    let spans = trace_with(
        &receiver,
        &cloud.trace_id,
        &[
            "automesh-gateway",
            "automesh-scheduler",
            "automesh-run-coordinator",
            "automesh-cloud-worker-lifecycle",
            "automesh-worker-agent",
        ],
    )
    .await;
    eprintln!("cloud trace:\n{}", summary(&spans));
    assert_one_whole_trace(&spans);
    for step in [
        "automesh.cloud.drive",
        "automesh.cloud.wake",
        "automesh.cloud.mcp_registration",
        "automesh.cloud.submit",
        "automesh.cloud.watch",
    ] {
        assert!(
            has(&spans, "automesh-cloud-worker-lifecycle", step),
            "{step}"
        );
    }
    assert!(has(&spans, "automesh-worker-agent", "chat "), "model spans");
    assert!(
        has(&spans, "automesh-worker-agent", "execute_tool "),
        "tool spans"
    );
    assert!(
        spans
            .iter()
            .filter(|s| s.name.starts_with("chat ") || s.name.starts_with("execute_tool "))
            .all(|s| s.kind == 3),
        "model and tool calls are CLIENT spans"
    );

    // A scheduled run: its trace starts at the scheduler's occurrence.
    let at = Utc::now() + chrono::Duration::seconds(2);
    let scheduled = {
        let token = cluster.token(&dana.org_id, &dana.user_id);
        let mut api = cluster.automations(&token);
        let a = api
            .create_automation(pb::CreateAutomationRequest {
                automation: Some(pb::Automation {
                    name: "scheduled".into(),
                    prompt: "tidy my downloads".into(),
                    model: "fake/echo".into(),
                    schedule: Some(pb::Schedule {
                        kind: Some(pb::schedule::Kind::Once(pb::OnceSchedule {
                            at: Some(prost_types::Timestamp {
                                seconds: at.timestamp(),
                                nanos: 0,
                            }),
                        })),
                    }),
                    ..Default::default()
                }),
                surface: pb::Surface::Desktop as i32,
            })
            .await
            .expect("create")
            .into_inner()
            .automation
            .expect("automation");
        let run_id = automesh_domain::ids::scheduled_run_id(
            &a.id,
            chrono::DateTime::from_timestamp(at.timestamp(), 0).expect("instant"),
        );
        assert_eq!(
            until_terminal(&cluster, &run_id).await.state,
            RunState::Succeeded
        );
        cluster
            .runs(&token)
            .get_run(pb::GetRunRequest { id: run_id })
            .await
            .expect("get run")
            .into_inner()
            .run
            .expect("run")
    };
    let spans = trace_with(
        &receiver,
        &scheduled.trace_id,
        &[
            "automesh-scheduler",
            "automesh-run-coordinator",
            "automesh-desktop-runner-gateway",
            "automesh-runner",
        ],
    )
    .await;
    assert_one_whole_trace(&spans);
    assert!(has(&spans, "automesh-runner", "chat "), "model spans");
    assert!(
        spans
            .iter()
            .any(|s| s.parent_span_id.is_empty() && s.service == "automesh-scheduler"),
        "the scheduler's occurrence is the root:\n{}",
        summary(&spans)
    );

    // A failed run marks its spans ERROR with error.type = its code.
    let failed = run_now(&cluster, &carol, pb::Surface::Web, "FAIL please").await;
    let ended = until_terminal(&cluster, &failed.id).await;
    assert_eq!(ended.state, RunState::Failed, "{ended:?}");
    let spans = trace_with(
        &receiver,
        &failed.trace_id,
        &["automesh-run-coordinator", "automesh-worker-agent"],
    )
    .await;
    let run_span = spans
        .iter()
        .find(|s| s.name == "automesh.run")
        .expect("the run's span");
    assert_eq!(run_span.status, 2, "ERROR: {run_span:?}");
    assert_eq!(
        run_span.attributes.get("error.type").map(String::as_str),
        Some("provider_unavailable")
    );
    // What the end did to its automation, on the run's span: its first
    // failure in a row.
    assert_eq!(
        run_span
            .attributes
            .get("automation.failure_streak")
            .map(String::as_str),
        Some("1"),
        "{run_span:?}"
    );
    let chat = spans
        .iter()
        .find(|s| s.name.starts_with("chat "))
        .expect("the refused model call");
    assert_eq!(chat.status, 2, "{chat:?}");
    assert_eq!(
        chat.attributes.get("error.type").map(String::as_str),
        Some("provider_unavailable")
    );

    // Every service's Prometheus endpoint, and what this test moved.
    let mut scraped = std::collections::BTreeMap::new();
    for kind in Kind::ALL {
        for i in 0..cluster.replicas(kind) {
            let text = cluster.scrape(kind, i).await.expect("scrape");
            if kind != Kind::Gateway {
                assert!(
                    text.contains("automesh_db_pool_connections{"),
                    "{kind:?} reports its pool:\n{text}"
                );
            }
            scraped
                .entry(kind)
                .or_insert_with(String::new)
                .push_str(&text);
        }
    }
    let coordinators = &scraped[&Kind::Coordinator];
    // The coordinator's moves and ends went through its store's writers.
    assert!(
        metric(coordinators, "automesh_db_write_jobs_total", &[]) >= 2.0,
        "{coordinators}"
    );
    assert!(
        metric(coordinators, "automesh_db_write_batches_total", &[]) >= 1.0,
        "{coordinators}"
    );
    // Each of them one or more bulk statements.
    assert!(
        metric(coordinators, "automesh_db_write_statements_total", &[]) >= 2.0,
        "{coordinators}"
    );
    assert!(
        metric(
            coordinators,
            "automesh_runs_ended_total",
            &[("placement", "desktop"), ("outcome", "succeeded")]
        ) >= 2.0,
        "{coordinators}"
    );
    assert!(
        metric(
            coordinators,
            "automesh_runs_ended_total",
            &[("placement", "cloud"), ("outcome", "succeeded")]
        ) >= 1.0,
        "{coordinators}"
    );
    assert!(
        metric(
            coordinators,
            "automesh_runs_ended_total",
            &[
                ("outcome", "failed"),
                ("error_code", "provider_unavailable")
            ]
        ) >= 1.0,
        "{coordinators}"
    );
    for histogram in [
        "automesh_run_dispatch_duration_seconds_count",
        "automesh_run_first_event_duration_seconds_count",
        "automesh_executor_call_duration_seconds_count",
    ] {
        assert!(
            metric(coordinators, histogram, &[]) >= 3.0,
            "{histogram}:\n{coordinators}"
        );
    }
    assert!(
        metric(
            coordinators,
            "automesh_run_tokens_total",
            &[("type", "input")]
        ) > 0.0
    );
    assert!(
        coordinators.contains("automesh_runs_pending "),
        "{coordinators}"
    );
    assert!(
        coordinators.contains("automesh_runs_queue_lag_seconds "),
        "{coordinators}"
    );
    let scheduler = &scraped[&Kind::Scheduler];
    assert!(
        metric(
            scheduler,
            "automesh_runs_created_total",
            &[("trigger", "manual")]
        ) >= 3.0,
        "{scheduler}"
    );
    assert!(
        metric(
            scheduler,
            "automesh_runs_created_total",
            &[("trigger", "schedule")]
        ) >= 1.0,
        "{scheduler}"
    );
    // The scheduled run's occurrence: how late after its due instant the
    // run was committed.
    assert!(
        metric(
            scheduler,
            "automesh_occurrence_fire_duration_seconds_count",
            &[]
        ) >= 1.0,
        "{scheduler}"
    );
    let runners = &scraped[&Kind::RunnerGateway];
    assert_eq!(
        metric(runners, "automesh_runner_streams", &[]),
        1.0,
        "{runners}"
    );
    assert!(
        metric(runners, "automesh_desktop_deliveries_total", &[]) >= 2.0,
        "{runners}"
    );
    let lifecycle = &scraped[&Kind::Lifecycle];
    assert_eq!(
        metric(lifecycle, "automesh_cloud_workers", &[("state", "ready")]),
        1.0,
        "{lifecycle}"
    );
    assert!(
        metric(
            lifecycle,
            "automesh_cloud_wakes_total",
            &[("result", "started")]
        ) >= 1.0,
        "{lifecycle}"
    );
    assert!(
        metric(
            lifecycle,
            "automesh_cloud_readiness_duration_seconds_count",
            &[]
        ) >= 1.0,
        "{lifecycle}"
    );

    // A coordinator killed under a run: its successor's span of the run is
    // in the same trace.
    let slow = run_now(&cluster, &carol, pb::Surface::Web, "SLOW please").await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    let holder = loop {
        if let Some(i) = (0..2).find(|i| {
            cluster
                .log(Kind::Coordinator, *i)
                .lines()
                .any(|l| l.contains(&slow.id) && l.contains("run started on its executor"))
        }) {
            break i;
        }
        assert!(tokio::time::Instant::now() < give_up, "never started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    cluster.kill(Kind::Coordinator, holder);
    assert_eq!(
        until_terminal(&cluster, &slow.id).await.state,
        RunState::Succeeded
    );
    let spans = trace_with(&receiver, &slow.trace_id, &["automesh-run-coordinator"]).await;
    let takeover = spans
        .iter()
        .find(|s| s.name == "automesh.run")
        .expect("the successor's span of the run");
    assert_eq!(
        takeover.attributes.get("claim").map(String::as_str),
        Some("2"),
        "taken over: {takeover:?}"
    );
    let survivor = cluster
        .scrape(Kind::Coordinator, 1 - holder)
        .await
        .expect("scrape");
    assert_eq!(
        metric(&survivor, "automesh_run_lease_takeovers_total", &[]),
        1.0,
        "{survivor}"
    );

    // A desktop run running when its runner gets SIGTERM: the runner
    // restarted on its journal ends it runner_interrupted (never runs it
    // again), and its lines about it are in the run's trace too.
    let interrupted = run_now(&cluster, &dana, pb::Surface::Desktop, "SLOW please").await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cluster
        .runner_log(0)
        .lines()
        .any(|l| l.contains(&interrupted.id) && l.contains("the run starts"))
    {
        assert!(tokio::time::Instant::now() < give_up, "never started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let runner = cluster.runner_pid(0).expect("runner");
    automesh_rpc::process::signal(runner, automesh_rpc::process::Signal::TERM);
    assert!(
        automesh_rpc::process::gone_within(runner, Duration::from_secs(20)).await,
        "the runner stops on SIGTERM"
    );
    cluster.restart_runner(0).expect("restart the runner");
    let ended = until_terminal(&cluster, &interrupted.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (
            RunState::Failed,
            Some(automesh_domain::ErrorCode::RunnerInterrupted)
        ),
        "{ended:?}"
    );

    // A cloud run whose agent is killed (SIGKILL) while it runs: a fresh
    // agent's journal replay says what became of it (runtime_interrupted),
    // in the run's trace.
    let lost = run_now(&cluster, &carol, pb::Surface::Web, "SLOW please").await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cluster
        .log(Kind::Lifecycle, 0)
        .lines()
        .any(|l| l.contains(&lost.id) && l.contains("message submitted to the worker"))
    {
        assert!(tokio::time::Instant::now() < give_up, "never submitted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let agent = *cluster.live_agents().values().next().expect("an agent");
    automesh_rpc::process::signal(agent, automesh_rpc::process::Signal::KILL);
    let ended = until_terminal(&cluster, &lost.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (
            RunState::Failed,
            Some(automesh_domain::ErrorCode::RuntimeInterrupted)
        ),
        "{ended:?}"
    );

    // Every agent call made for a run is in the run's trace: the cloud
    // run's trace holds each kind of call the lifecycle makes for it, and
    // no agent call is a trace of its own (calls for no run are untraced).
    let cloud_spans = receiver.trace(&cloud.trace_id);
    for call in [
        "GetMcpRegistration",
        "SubmitMessage",
        "GetThread",
        "ObserveThread",
    ] {
        let path = format!("/automesh.agent.v1.WorkerAgentService/{call}");
        assert!(
            has(&cloud_spans, "automesh-worker-agent", &path),
            "{call} in the cloud run's trace:\n{}",
            summary(&cloud_spans)
        );
    }
    // Every trace starts where work starts: a public API call, a
    // scheduled occurrence, or a retention pass (maintenance a scheduler
    // starts by itself, once per pass). No internal call (an agent's, an
    // executor's, a runner stream's) and no other loop is a trace of its
    // own.
    let strays: Vec<Span> = receiver
        .spans()
        .into_iter()
        .filter(|s| s.parent_span_id.is_empty())
        .filter(|s| {
            !(s.service == "automesh-gateway" && s.name.starts_with("/automesh.v1.")
                || s.service == "automesh-scheduler"
                    && (s.name == "automesh.occurrence" || s.name == "retention.pass"))
        })
        .collect();
    assert!(
        strays.is_empty(),
        "traces that are not a request's or an occurrence's:\n{}",
        summary(&strays)
    );

    // Every JSON log line about those runs, in every process, names the
    // run's trace: the runs' own lines, a coordinator's takeover, the
    // runner's journal replay after its restart.
    let logs = cluster.all_logs();
    for run in [
        &desktop,
        &cloud,
        &scheduled,
        &failed,
        &slow,
        &interrupted,
        &lost,
    ] {
        let about: Vec<serde_json::Value> = logs
            .lines()
            .filter(|l| l.contains(&run.id))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        assert!(about.len() >= 3, "lines about {}: {about:?}", run.id);
        // The recoveries' own lines are among them.
        let recovery = if run.id == interrupted.id {
            Some("ends runner_interrupted")
        } else if run.id == lost.id {
            Some("it is reported interrupted")
        } else {
            None
        };
        if let Some(said) = recovery {
            assert!(
                about.iter().any(|l| l["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(said))),
                "{said:?} among the lines about {}: {about:?}",
                run.id
            );
        }
        let untraced: Vec<&serde_json::Value> = about
            .iter()
            .filter(|l| l["trace_id"] != run.trace_id.as_str() || !l["span_id"].is_string())
            .collect();
        assert!(
            untraced.is_empty(),
            "lines about run {} without its trace id {}:\n{}",
            run.id,
            run.trace_id,
            untraced
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    // The log lines went out over OTLP too, linked to the runs' traces.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let logs = receiver.logs();
        let linked: BTreeSet<&str> = logs
            .iter()
            .filter(|l| l.trace_id == desktop.trace_id || l.trace_id == cloud.trace_id)
            .map(|l| l.service.as_str())
            .collect();
        if [
            "automesh-run-coordinator",
            "automesh-runner",
            "automesh-worker-agent",
        ]
        .iter()
        .all(|s| linked.contains(s))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "OTLP log records linked to the runs' traces come from {linked:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.stop(false).await.expect("stop");
}

/// The runner and the worker agent flush their spans when they stop on
/// SIGTERM: with export batched once a minute, nothing of theirs reaches
/// the collector before the signal, and everything after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_and_the_agent_flush_their_spans_on_sigterm() {
    let (receiver, cluster, _mcp) =
        world(|spec| spec.set_all("OTEL_BSP_SCHEDULE_DELAY", "60000")).await;
    let (carol, dana) = (carol(), dana());
    let desktop = run_now(&cluster, &dana, pb::Surface::Desktop, "summarise my inbox").await;
    let cloud = run_now(&cluster, &carol, pb::Surface::Web, "summarise my inbox").await;
    for run in [&desktop, &cloud] {
        assert_eq!(
            until_terminal(&cluster, &run.id).await.state,
            RunState::Succeeded
        );
    }
    let sent = |service: &str| receiver.spans().iter().any(|s| s.service == service);
    assert!(!sent("automesh-runner") && !sent("automesh-worker-agent"));
    let term = automesh_rpc::process::Signal::TERM;
    let runner = cluster.runner_pid(0).expect("runner");
    let agent = *cluster.live_agents().values().next().expect("agent");
    for pid in [runner, agent] {
        automesh_rpc::process::signal(pid, term);
        assert!(
            automesh_rpc::process::gone_within(pid, Duration::from_secs(20)).await,
            "{pid} stops on SIGTERM"
        );
    }
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    while !(sent("automesh-runner") && sent("automesh-worker-agent")) {
        assert!(
            tokio::time::Instant::now() < give_up,
            "spans flushed on SIGTERM: runner {}, agent {}",
            sent("automesh-runner"),
            sent("automesh-worker-agent")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for run in [&desktop, &cloud] {
        assert!(
            !receiver.trace(&run.trace_id).is_empty(),
            "the flushed spans belong to the runs' traces"
        );
    }
    cluster.stop(false).await.expect("stop");
}
