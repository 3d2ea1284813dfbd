//! Desktop runs through the desktop-runner-gateway: the coordinator drives
//! them over the executor contract, the gateway hands them to a runner of
//! the owner over its `Connect` stream. The runner here is a test client
//! speaking the real protocol.

use std::time::Duration;

use automesh_domain::{ErrorCode, RunState};
use automesh_e2e_tests::RunsApi;
use automesh_e2e_tests::{Api, Mesh, MeshOptions};
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_client::DesktopRunnerServiceClient;
use automesh_proto::v1 as pb;
use automesh_store::Backend;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// What the test runner does with an assignment.
#[derive(Debug, Clone, Copy)]
enum Script {
    /// Accept, report two events, succeed.
    Complete,
    /// Accept and work until cancelled; then report idle and the end.
    UntilCancelled,
}

fn msg(m: rpb::connect_request::Message) -> rpb::ConnectRequest {
    rpb::ConnectRequest { message: Some(m) }
}

/// Connects a runner with `token` and plays `script` for every assignment.
/// Returns the ids of the runs it was assigned.
async fn runner(mesh: &Mesh, token: &str, script: Script) -> mpsc::UnboundedReceiver<String> {
    use rpb::connect_request::Message as Up;
    use rpb::connect_response::Message as Down;
    let mut client = DesktopRunnerServiceClient::new(
        automesh_rpc::client::channel(&mesh.runner_gateway).expect("channel"),
    );
    let (tx, rx) = mpsc::channel(64);
    tx.send(msg(Up::Hello(rpb::Hello {
        runner_version: "test-runner".into(),
        held_runs: vec![],
        ping_liveness: false,
    })))
    .await
    .expect("hello");
    let request = automesh_e2e_tests::with_bearer(token, ReceiverStream::new(rx));
    let mut down = client
        .connect(request)
        .await
        .expect("connected")
        .into_inner();
    let (assigned_tx, assigned_rx) = mpsc::unbounded_channel();
    let beat = tx.clone();
    tokio::spawn(async move {
        while beat
            .send(msg(Up::Heartbeat(rpb::Heartbeat { send_time: None })))
            .await
            .is_ok()
        {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    tokio::spawn(async move {
        while let Ok(Some(m)) = down.message().await {
            match m.message {
                Some(Down::Assignment(a)) => {
                    let _ = assigned_tx.send(a.run_id.clone());
                    let _ = tx
                        .send(msg(Up::AssignmentAccepted(rpb::AssignmentAccepted {
                            run_id: a.run_id.clone(),
                        })))
                        .await;
                    if let Script::Complete = script {
                        let events = (1..=2)
                            .map(|i| pb::RunEvent {
                                event_id: format!("runner:{}:{i}", a.run_id),
                                payload: Some(pb::run_event::Payload::AssistantText(
                                    pb::AssistantText {
                                        text: format!("part {i}"),
                                    },
                                )),
                                ..Default::default()
                            })
                            .collect();
                        // Sent twice: redelivery must add nothing.
                        for _ in 0..2 {
                            let _ = tx
                                .send(msg(Up::RunEvents(rpb::RunEvents {
                                    run_id: a.run_id.clone(),
                                    events: Vec::clone(&events),
                                })))
                                .await;
                        }
                        let _ = tx
                            .send(msg(Up::RunFinished(rpb::RunFinished {
                                run_id: a.run_id.clone(),
                                outcome: pb::RunState::Succeeded as i32,
                                engine: "test-runner".into(),
                                usage: Some(pb::Usage {
                                    input_tokens: 3,
                                    output_tokens: 4,
                                    cost_micros: 5,
                                }),
                                ..Default::default()
                            })))
                            .await;
                    }
                }
                Some(Down::CancelAssignment(c)) => {
                    let _ = tx
                        .send(msg(Up::IdleObserved(rpb::IdleObserved {
                            run_id: c.run_id.clone(),
                        })))
                        .await;
                    let _ = tx
                        .send(msg(Up::RunFinished(rpb::RunFinished {
                            run_id: c.run_id.clone(),
                            outcome: pb::RunState::Cancelled as i32,
                            engine: "test-runner".into(),
                            ..Default::default()
                        })))
                        .await;
                }
                _ => {}
            }
        }
    });
    assigned_rx
}

async fn mesh(run_deadline: Duration) -> Mesh {
    Mesh::start_with(
        Backend::Sqlite,
        MeshOptions {
            desktop_via_runner_gateway: true,
            run_deadline,
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh")
}

async fn runner_token(mesh: &Mesh, org: &str, user: &str) -> String {
    mesh.automations(Some(&mesh.token(org, user)))
        .create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: "laptop".into(),
        })
        .await
        .expect("mint")
        .into_inner()
        .token
}

async fn desktop_run(mesh: &Mesh, org: &str, user: &str) -> pb::Run {
    mesh.desktop_run_now(org, user).await
}

async fn terminal(mesh: &Mesh, run_id: &str) -> automesh_domain::Run {
    mesh.until_terminal(run_id, Duration::from_secs(30)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desktop_run_reaches_the_owners_runner_and_completes() {
    let mesh = mesh(Duration::from_secs(60)).await;
    let token = runner_token(&mesh, "acme", "alice").await;
    let mut assigned = runner(&mesh, &token, Script::Complete).await;
    let run = desktop_run(&mesh, "acme", "alice").await;
    let ended = terminal(&mesh, &run.id).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    assert_eq!(assigned.recv().await.as_deref(), Some(run.id.as_str()));
    let receipt = mesh.receipt(&run.id).await;
    assert_eq!(receipt.engine.as_deref(), Some("test-runner"));
    assert_eq!(
        (
            receipt.usage.input_tokens,
            receipt.usage.output_tokens,
            receipt.usage.cost_micros
        ),
        // Unpriced model: the runner's own cost figure is not charged.
        (3, 4, 0)
    );
    let events = mesh.events(&run.id).await;
    let texts = automesh_e2e_tests::assistant_texts(&events);
    assert_eq!(texts, 2, "redelivered runner events added nothing");
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owners_runner_gets_the_run_and_without_it_the_run_ends_runner_offline() {
    let mesh = mesh(Duration::from_secs(2)).await;
    // Bob's runner is connected; Alice's is not.
    let bob = runner_token(&mesh, "acme", "bob").await;
    let mut bobs = runner(&mesh, &bob, Script::Complete).await;
    let run = desktop_run(&mesh, "acme", "alice").await;
    let ended = terminal(&mesh, &run.id).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::TimedOut, Some(ErrorCode::RunnerOffline))
    );
    assert!(
        bobs.try_recv().is_err(),
        "another user's runner never sees the run"
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_the_runner_and_ends_once_it_is_idle() {
    let mesh = mesh(Duration::from_secs(60)).await;
    let token = runner_token(&mesh, "acme", "alice").await;
    let mut assigned = runner(&mesh, &token, Script::UntilCancelled).await;
    let run = desktop_run(&mesh, "acme", "alice").await;
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), assigned.recv())
            .await
            .expect("assigned in time")
            .as_deref(),
        Some(run.id.as_str())
    );
    let api_token = mesh.token("acme", "alice");
    let answered = mesh.runs(Some(&api_token)).cancel(&run.id).await;
    assert_eq!(
        answered.state,
        pb::RunState::Cancelled as i32,
        "{answered:?}"
    );
    assert!(answered.error_code.is_empty());
    mesh.stop().await.expect("stop");
}

/// Cancelling a run right after run-now, before any executor has it or
/// while StartRun is in flight, ends it cancelled at once: never
/// `cancel_unobserved` after waiting out the cancellation bound for an
/// executor that was given the run after its cancellation.
async fn cancel_right_after_run_now(backend: Backend) {
    let mesh = Mesh::start_with(
        backend,
        MeshOptions {
            desktop_via_runner_gateway: true,
            cancel_bound: Duration::from_secs(2),
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let mut runs = mesh.runs(Some(&token));
    let automation = api
        .create(automesh_e2e_tests::daily_automation(
            "cancel",
            "p",
            pb::Surface::Desktop,
        ))
        .await;
    let mut ids = vec![];
    for i in 0..40 {
        let run = api.run_now(&automation.id, &format!("k{i}")).await;
        // Spread the cancellation over the driver's first moments.
        if i % 4 != 0 {
            tokio::time::sleep(Duration::from_millis(i % 7 * 3)).await;
        }
        runs.cancel_run(pb::CancelRunRequest { id: run.id.clone() })
            .await
            .expect("cancel");
        ids.push(run.id);
    }
    for id in ids {
        let ended = mesh.until_terminal(&id, Duration::from_secs(120)).await;
        assert_eq!(
            (ended.state, ended.error_code),
            (RunState::Cancelled, None),
            "{ended:?}"
        );
    }
    mesh.stop().await.expect("stop");
}

automesh_e2e_tests::on_both_backends!(cancel_right_after_run_now);

/// A store failure is answered by its kind, the same in every service: a
/// corrupt row is INTERNAL (nothing a retry can fix), never UNAVAILABLE,
/// which clients retry forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_dispatch_row_is_internal_not_unavailable() {
    use automesh_proto::executor::v1 as epb;
    use automesh_proto::executor::v1::executor_service_client::ExecutorServiceClient;
    let mesh = mesh(Duration::from_secs(60)).await;
    sqlx::query(
        "INSERT INTO desktop_assignments (run_id, org_id, owner_id, spec, created_at, updated_at) \
         VALUES ('corrupt', 'acme', 'alice', 'not hex', 0, 0)",
    )
    .execute(mesh.store().pool())
    .await
    .expect("insert");
    let mut executor = ExecutorServiceClient::new(
        automesh_rpc::internal_channel(&mesh.runner_gateway_internal, &mesh.credential)
            .expect("channel"),
    );
    let refused = executor
        .get_run_status(epb::GetRunStatusRequest {
            run_id: "corrupt".into(),
        })
        .await
        .expect_err("corrupt");
    assert_eq!(refused.code(), tonic::Code::Internal, "{refused:?}");
    mesh.stop().await.expect("stop");
}
