//! One trace per run, across separate processes: the mesh runs as its own
//! processes on PostgreSQL (a real `automesh runner`, local-process worker
//! agents) exporting over OTLP to a collector in this test, and each run's
//! trace is read back whole.

use std::collections::BTreeSet;
use std::time::Duration;

use automesh_domain::{Principal, RunState};
use automesh_e2e_tests::otlp::{Receiver, Span};
use automesh_e2e_tests::processes::{Cluster, ClusterSpec};
use automesh_proto::v1 as pb;
use automesh_testkit::{FakeMcp, Reply, mcp, provider, text_completion, tool_call_completion};
use chrono::Utc;

const MCP_TOKEN: &str = "traces-connect-token";

/// The model: one tool call, then an answer (so a run has model and tool
/// spans).
fn model(_: usize, req: &serde_json::Value) -> Reply {
    let last_is_tool = req["messages"]
        .as_array()
        .and_then(|m| m.last())
        .is_some_and(|m| m["role"] == "tool");
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

async fn run_now(cluster: &Cluster, owner: &Principal, surface: pb::Surface) -> pb::Run {
    let token = cluster.token(&owner.org_id, &owner.user_id);
    let mut api = cluster.automations(&token);
    let a = api
        .create_automation(pb::CreateAutomationRequest {
            automation: Some(pb::Automation {
                name: "traced".into(),
                prompt: "summarise my inbox".into(),
                model: "fake/echo".into(),
                schedule: Some(pb::Schedule {
                    kind: Some(pb::schedule::Kind::Daily(pb::DailySchedule {
                        time_of_day: Some(pb::TimeOfDay {
                            hours: 5,
                            minutes: 0,
                        }),
                        time_zone: "UTC".into(),
                    })),
                }),
                ..Default::default()
            }),
            surface: surface as i32,
        })
        .await
        .expect("create")
        .into_inner()
        .automation
        .expect("automation");
    api.run_automation_now(pb::RunAutomationNowRequest {
        id: a.id,
        idempotency_key: "traced".into(),
    })
    .await
    .expect("run now")
    .into_inner()
    .run
    .expect("run")
}

async fn until_terminal(cluster: &Cluster, run_id: &str) -> automesh_domain::Run {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let run = cluster.store().get_run_unscoped(run_id).await.expect("run");
        if run.state.is_terminal() {
            return run;
        }
        assert!(tokio::time::Instant::now() < give_up, "{run:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desktop_and_a_cloud_run_each_give_one_trace_across_every_process() {
    let receiver = Receiver::start().await.expect("collector");
    let (provider_url, _model) = provider(model).await;
    let (mcp_url, _mcp) = mcp(
        FakeMcp::with_tools(&["search_capabilities", "execute_capability"]),
        MCP_TOKEN,
    )
    .await;
    let spec = ClusterSpec::new(1, &provider_url, &mcp_url, MCP_TOKEN)
        .set_all("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint)
        .set_all("OTEL_BSP_SCHEDULE_DELAY", "100")
        .set_all("AUTOMESH_LOG_FORMAT", "json");
    let mut cluster = Cluster::start(std::path::Path::new(env!("CARGO_BIN_EXE_automesh")), spec)
        .await
        .expect("cluster");
    let carol = Principal::new("acme", "carol");
    let dana = Principal::new("acme", "dana");
    cluster
        .store()
        .register_worker(&carol, "local-process", Utc::now())
        .await
        .expect("worker");
    cluster
        .add_runner(&dana.org_id, &dana.user_id)
        .await
        .expect("runner");

    let desktop = run_now(&cluster, &dana, pb::Surface::Desktop).await;
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

    let cloud = run_now(&cluster, &carol, pb::Surface::Web).await;
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

    // Every JSON log line about those runs, in every process, names the
    // run's trace.
    let logs = cluster.all_logs();
    for run in [&desktop, &cloud] {
        let about: Vec<serde_json::Value> = logs
            .lines()
            .filter(|l| l.contains(&run.id))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        assert!(about.len() >= 3, "lines about {}: {about:?}", run.id);
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
    cluster.stop(false).await.expect("stop");
}
