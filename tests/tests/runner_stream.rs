//! The desktop runners' `Connect` stream: token authentication, Hello and
//! Welcome, heartbeats or PING liveness, and a stalled stream declared dead
//! within its bound even though its connection stays open (a runner process
//! stalled on PING liveness: `cli/tests/crash_recovery.rs`).

use std::sync::Arc;
use std::time::Duration;

use automesh_desktop_runner_gateway::stream::StreamSettings;
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_client::DesktopRunnerServiceClient;
use automesh_proto::v1 as pb;
use automesh_store::Backend;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

fn hello() -> rpb::ConnectRequest {
    hello_asking(false)
}

fn hello_asking(ping_liveness: bool) -> rpb::ConnectRequest {
    rpb::ConnectRequest {
        message: Some(rpb::connect_request::Message::Hello(rpb::Hello {
            runner_version: "test".into(),
            held_runs: vec![],
            ping_liveness,
        })),
    }
}

fn heartbeat() -> rpb::ConnectRequest {
    rpb::ConnectRequest {
        message: Some(rpb::connect_request::Message::Heartbeat(rpb::Heartbeat {
            send_time: None,
        })),
    }
}

async fn mesh() -> Mesh {
    Mesh::start_with(
        Backend::Sqlite,
        MeshOptions {
            runner_streams: StreamSettings {
                heartbeat_interval: Duration::from_millis(200),
                dead_after: Duration::from_secs(1),
                hello_timeout: Duration::from_secs(1),
                ..Default::default()
            },
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh")
}

async fn mint(mesh: &Mesh) -> pb::CreateRunnerTokenResponse {
    let token = mesh.token("acme", "alice");
    mesh.automations(Some(&token))
        .create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: "laptop".into(),
        })
        .await
        .expect("mint")
        .into_inner()
}

/// Opens a stream with `token`; returns the sender of runner messages and
/// the gateway's answer.
async fn open(
    mesh: &Mesh,
    token: &str,
) -> (
    mpsc::Sender<rpb::ConnectRequest>,
    Result<tonic::Streaming<rpb::ConnectResponse>, tonic::Status>,
) {
    open_with(mesh, token, hello()).await
}

/// Opens a stream with `token` that says `hello` first.
async fn open_with(
    mesh: &Mesh,
    token: &str,
    hello: rpb::ConnectRequest,
) -> (
    mpsc::Sender<rpb::ConnectRequest>,
    Result<tonic::Streaming<rpb::ConnectResponse>, tonic::Status>,
) {
    let mut client = DesktopRunnerServiceClient::new(
        automesh_rpc::client::channel(&mesh.runner_gateway).expect("channel"),
    );
    let (tx, rx) = mpsc::channel(16);
    let request = automesh_e2e_tests::with_bearer(token, ReceiverStream::new(rx));
    // The gateway answers once it has the Hello; send it before waiting.
    let sender = tx.clone();
    tokio::spawn(async move {
        let _ = sender.send(hello).await;
    });
    let answer = tokio::time::timeout(Duration::from_secs(10), client.connect(request))
        .await
        .expect("bounded")
        .map(|r| r.into_inner());
    (tx, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_with_its_token_is_welcomed_and_kept_alive_by_heartbeats() {
    let mesh = mesh().await;
    let minted = mint(&mesh).await;
    let (tx, answer) = open(&mesh, &minted.token).await;
    let mut stream = answer.expect("connected");
    let first = stream.message().await.expect("ok").expect("welcome");
    let Some(rpb::connect_response::Message::Welcome(welcome)) = first.message else {
        panic!("expected Welcome, got {first:?}");
    };
    assert_eq!(welcome.runner_id, minted.runner_id);
    assert!(welcome.heartbeat_interval.is_some());
    // Three dead periods' worth of heartbeats: the stream stays alive.
    for _ in 0..15 {
        tx.send(heartbeat()).await.expect("send");
        let ack = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("ack in time")
            .expect("ok")
            .expect("ack");
        assert!(matches!(
            ack.message,
            Some(rpb::connect_response::Message::HeartbeatAck(_))
        ));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(tx);
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_asks_for_ping_liveness_needs_no_heartbeats() {
    let mesh = mesh().await;
    let minted = mint(&mesh).await;
    let (tx, answer) = open_with(&mesh, &minted.token, hello_asking(true)).await;
    let mut stream = answer.expect("connected");
    let first = stream.message().await.expect("ok").expect("welcome");
    let Some(rpb::connect_response::Message::Welcome(welcome)) = first.message else {
        panic!("expected Welcome, got {first:?}");
    };
    assert!(welcome.ping_liveness, "granted: {welcome:?}");
    // Three dead periods without a message: the connection answers the
    // gateway's PINGs, so the stream lives.
    let quiet = tokio::time::timeout(Duration::from_secs(3), stream.message()).await;
    assert!(quiet.is_err(), "the stream ended or spoke: {quiet:?}");
    // A heartbeat sent anyway is still answered.
    tx.send(heartbeat()).await.expect("send");
    let ack = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("ack in time")
        .expect("ok")
        .expect("ack");
    assert!(matches!(
        ack.message,
        Some(rpb::connect_response::Message::HeartbeatAck(_))
    ));
    drop(tx);
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_is_declared_dead_although_its_connection_is_open() {
    let mesh = mesh().await;
    let minted = mint(&mesh).await;
    let (tx, answer) = open(&mesh, &minted.token).await;
    let mut stream = answer.expect("connected");
    stream.message().await.expect("ok").expect("welcome");
    // Keep the sender (and so the HTTP/2 stream) open, but send nothing.
    let ended = automesh_e2e_tests::end_of(
        &mut stream,
        Duration::from_secs(10),
        "the gateway ends a silent stream within its bound",
    )
    .await;
    let status = ended.expect("ended with a status");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("declared dead"));
    drop(tx);
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_revoked_tokens_are_refused() {
    let mesh = mesh().await;
    let (_tx, answer) = open(&mesh, "amr_not-a-real-token").await;
    assert_eq!(answer.expect_err("refused").code(), Code::Unauthenticated);

    let minted = mint(&mesh).await;
    mesh.store()
        .revoke_runner(
            &automesh_domain::Principal::new("acme", "alice"),
            &minted.runner_id,
            chrono::Utc::now(),
        )
        .await
        .expect("revoke");
    let (_tx, answer) = open(&mesh, &minted.token).await;
    assert_eq!(answer.expect_err("revoked").code(), Code::Unauthenticated);
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_message_must_be_hello() {
    let mesh = mesh().await;
    let minted = mint(&mesh).await;
    let mut client = DesktopRunnerServiceClient::new(
        automesh_rpc::client::channel(&mesh.runner_gateway).expect("channel"),
    );
    let (tx, rx) = mpsc::channel(4);
    tx.send(heartbeat()).await.expect("send");
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", minted.token).parse().expect("ascii"),
    );
    let status = tokio::time::timeout(Duration::from_secs(10), client.connect(request))
        .await
        .expect("bounded")
        .expect_err("refused");
    assert_eq!(status.code(), Code::FailedPrecondition);
    drop(tx);
    mesh.stop().await.expect("stop");
}

/// The port desktops reach serves the runner stream and health, and
/// nothing internal: reflection lists nothing else, and the desktop
/// executor and the token service are not there, with or without the
/// internal credential. They live on the internal listener, behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_port_serves_runners_only_and_the_internal_services_sit_behind_the_credential() {
    use automesh_proto::executor::v1 as epb;
    use automesh_proto::executor::v1::executor_service_client::ExecutorServiceClient;
    use automesh_proto::runner::v1::runner_token_service_client::RunnerTokenServiceClient;
    let mesh = mesh().await;
    assert_eq!(
        automesh_e2e_tests::reflected_services(&mesh.runner_gateway).await,
        [
            "automesh.runner.v1.DesktopRunnerService",
            "grpc.health.v1.Health"
        ]
    );
    assert_eq!(
        automesh_e2e_tests::reflected_services(&mesh.runner_gateway_internal).await,
        [
            "automesh.executor.v1.ExecutorService",
            "automesh.runner.v1.RunnerTokenService",
            "grpc.health.v1.Health"
        ]
    );
    let token_request = || rpb::CreateRunnerTokenRequest {
        caller: Some(automesh_edge::convert::caller(
            &automesh_domain::Principal::new("acme", "alice"),
        )),
        runner_name: "x".into(),
    };
    // On the runner port, even the right credential reaches nothing.
    let credentialed =
        automesh_rpc::internal_channel(&mesh.runner_gateway, &mesh.credential).expect("channel");
    let refused = ExecutorServiceClient::new(credentialed.clone())
        .get_run_status(epb::GetRunStatusRequest {
            run_id: "run-1".into(),
        })
        .await
        .expect_err("no executor on the runner port");
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    let refused = RunnerTokenServiceClient::new(credentialed)
        .create_runner_token(token_request())
        .await
        .expect_err("no token service on the runner port");
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    // On the internal listener: refused without the credential, served
    // with it.
    let refused = RunnerTokenServiceClient::new(
        automesh_rpc::client::channel(&mesh.runner_gateway_internal).expect("channel"),
    )
    .create_runner_token(token_request())
    .await
    .expect_err("internal only");
    assert_eq!(refused.code(), Code::Unauthenticated);
    let minted = RunnerTokenServiceClient::new(
        automesh_rpc::internal_channel(&mesh.runner_gateway_internal, &mesh.credential)
            .expect("channel"),
    )
    .create_runner_token(token_request())
    .await
    .expect("minted on the internal listener");
    assert!(minted.get_ref().token.starts_with("amr_"));
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnecting_runner_holding_unknown_runs_is_told_to_cancel_them_all() {
    let mesh = mesh().await;
    let minted = mint(&mesh).await;
    let mut client = DesktopRunnerServiceClient::new(
        automesh_rpc::client::channel(&mesh.runner_gateway).expect("channel"),
    );
    let (tx, rx) = mpsc::channel(16);
    // More held runs than the gateway buffers per stream.
    let held: Vec<rpb::HeldRun> = (0..50)
        .map(|i| rpb::HeldRun {
            run_id: format!("run-{i}"),
            finished: false,
        })
        .collect();
    tx.send(rpb::ConnectRequest {
        message: Some(rpb::connect_request::Message::Hello(rpb::Hello {
            runner_version: "test".into(),
            held_runs: held,
            ping_liveness: false,
        })),
    })
    .await
    .expect("hello");
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", minted.token).parse().expect("ascii"),
    );
    let mut stream = tokio::time::timeout(Duration::from_secs(10), client.connect(request))
        .await
        .expect("answered in time")
        .expect("connected")
        .into_inner();
    let mut cancels = 0;
    let mut welcomed = false;
    while cancels < 50 {
        tx.send(heartbeat()).await.expect("heartbeat");
        let m = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("bounded")
            .expect("ok")
            .expect("message");
        match m.message {
            Some(rpb::connect_response::Message::Welcome(_)) => welcomed = true,
            Some(rpb::connect_response::Message::CancelAssignment(_)) => cancels += 1,
            _ => {}
        }
    }
    assert!(welcomed);
    drop(tx);
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_runner_through_the_public_api_ends_its_live_stream() {
    let mesh = mesh().await;
    let minted = mint(&mesh).await;
    let (tx, answer) = open(&mesh, &minted.token).await;
    let mut stream = answer.expect("connected");
    let first = stream.message().await.expect("ok").expect("welcome");
    assert!(matches!(
        first.message,
        Some(rpb::connect_response::Message::Welcome(_))
    ));
    // A live, heartbeating runner.
    let beating = tokio::spawn(async move {
        while tx.send(heartbeat()).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    mesh.automations(Some(&mesh.token("acme", "alice")))
        .revoke_runner_token(pb::RevokeRunnerTokenRequest {
            runner_id: minted.runner_id.clone(),
        })
        .await
        .expect("revoke");
    let ended = automesh_e2e_tests::end_of(
        &mut stream,
        Duration::from_secs(30),
        "the stream ended after the revocation",
    )
    .await;
    assert_eq!(ended.map(|s| s.code()), Some(Code::Unauthenticated));
    // Another user cannot revoke alice's runner: NOT_FOUND.
    let err = mesh
        .automations(Some(&mesh.token("acme", "mallory")))
        .revoke_runner_token(pb::RevokeRunnerTokenRequest {
            runner_id: minted.runner_id,
        })
        .await
        .expect_err("not hers");
    assert_eq!(err.code(), Code::NotFound);
    beating.abort();
    mesh.stop().await.expect("stop");
}

/// A mesh whose desktop runs go through the real runner gateway.
async fn dispatching_mesh() -> Mesh {
    Mesh::start_with(
        Backend::Sqlite,
        MeshOptions {
            desktop_via_runner_gateway: true,
            runner_streams: StreamSettings {
                heartbeat_interval: Duration::from_millis(200),
                dead_after: Duration::from_secs(2),
                hello_timeout: Duration::from_secs(2),
                ..Default::default()
            },
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh")
}

/// Connects a runner of `token` that says it holds `held`; returns its
/// sender and the gateway's stream, the Welcome read.
async fn connect_holding(
    mesh: &Mesh,
    token: &str,
    held: &[&str],
) -> (
    mpsc::Sender<rpb::ConnectRequest>,
    tonic::Streaming<rpb::ConnectResponse>,
) {
    let mut client = DesktopRunnerServiceClient::new(
        automesh_rpc::client::channel(&mesh.runner_gateway).expect("channel"),
    );
    let (tx, rx) = mpsc::channel(64);
    tx.send(rpb::ConnectRequest {
        message: Some(rpb::connect_request::Message::Hello(rpb::Hello {
            runner_version: "third-party".into(),
            held_runs: held
                .iter()
                .map(|id| rpb::HeldRun {
                    run_id: (*id).into(),
                    finished: false,
                })
                .collect(),
            ping_liveness: false,
        })),
    })
    .await
    .expect("hello");
    let request = automesh_e2e_tests::with_bearer(token, ReceiverStream::new(rx));
    let mut stream = tokio::time::timeout(Duration::from_secs(10), client.connect(request))
        .await
        .expect("answered in time")
        .expect("connected")
        .into_inner();
    let welcome = next(&mut stream).await;
    assert!(
        matches!(welcome, rpb::connect_response::Message::Welcome(_)),
        "{welcome:?}"
    );
    (tx, stream)
}

/// The gateway's next message that is not a heartbeat ack, bounded.
async fn next(
    stream: &mut tonic::Streaming<rpb::ConnectResponse>,
) -> rpb::connect_response::Message {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("a message within 10 s")
            .expect("the stream is healthy")
            .expect("the stream is open");
        match m.message {
            Some(rpb::connect_response::Message::HeartbeatAck(_)) | None => {}
            Some(other) => return other,
        }
    }
}

fn up(message: rpb::connect_request::Message) -> rpb::ConnectRequest {
    rpb::ConnectRequest {
        message: Some(message),
    }
}

/// A RunFinished whose outcome is not terminal, and reports about runs the
/// runner does not hold, are refused with a named ProtocolError on the
/// stream; the stream stays open, the run is unaffected and still finishes
/// with a proper report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_violations_are_named_on_the_stream_and_leave_the_run_alone() {
    use rpb::connect_request::Message as Up;
    use rpb::connect_response::Message as Down;
    let mesh = dispatching_mesh().await;
    let minted = mint(&mesh).await;
    let (tx, mut stream) = connect_holding(&mesh, &minted.token, &[]).await;
    let run = mesh.desktop_run_now("acme", "alice").await;
    let Down::Assignment(a) = next(&mut stream).await else {
        panic!("an assignment")
    };
    assert_eq!(a.run_id, run.id);
    tx.send(up(Up::AssignmentAccepted(rpb::AssignmentAccepted {
        run_id: run.id.clone(),
    })))
    .await
    .expect("accept");
    // The acceptance is recorded and confirmed: the runner may start now.
    let Down::AssignmentConfirmed(c) = next(&mut stream).await else {
        panic!("the acceptance is confirmed")
    };
    assert_eq!(c.run_id, run.id);
    for outcome in [
        pb::RunState::Running,
        pb::RunState::Pending,
        pb::RunState::Unspecified,
    ] {
        tx.send(up(Up::RunFinished(rpb::RunFinished {
            run_id: run.id.clone(),
            outcome: outcome as i32,
            ..Default::default()
        })))
        .await
        .expect("send");
        let Down::ProtocolError(e) = next(&mut stream).await else {
            panic!("a protocol error for {outcome:?}")
        };
        assert_eq!(
            (e.run_id.as_str(), e.code.as_str()),
            (run.id.as_str(), "non_terminal_outcome")
        );
        assert!(e.message.contains(outcome.as_str_name()), "{e:?}");
    }
    // Reports about a run this runner was never assigned.
    for report in [
        Up::RunFinished(rpb::RunFinished {
            run_id: "run-never-assigned".into(),
            outcome: pb::RunState::Succeeded as i32,
            ..Default::default()
        }),
        Up::AssignmentAccepted(rpb::AssignmentAccepted {
            run_id: "run-never-assigned".into(),
        }),
        Up::IdleObserved(rpb::IdleObserved {
            run_id: "run-never-assigned".into(),
        }),
    ] {
        tx.send(up(report)).await.expect("send");
        let Down::ProtocolError(e) = next(&mut stream).await else {
            panic!("a protocol error")
        };
        assert_eq!(e.code, "not_assigned", "{e:?}");
    }
    // The run was not touched: still live, and a terminal report ends it.
    let live = mesh.store().internal().get_run(&run.id).await.expect("run");
    assert!(!live.state.is_terminal(), "{live:?}");
    tx.send(up(Up::RunFinished(rpb::RunFinished {
        run_id: run.id.clone(),
        outcome: pb::RunState::Succeeded as i32,
        engine: "third-party".into(),
        ..Default::default()
    })))
    .await
    .expect("finish");
    let ended = mesh.until_terminal(&run.id, Duration::from_secs(30)).await;
    assert_eq!(ended.state, automesh_domain::RunState::Succeeded);
    drop(tx);
    // The runner reconnects and sends its finished run's event and result
    // again, as a runner does from its journal after every reconnect: a
    // harmless redelivery, no ProtocolError; it is told the run is done.
    let (tx, mut stream) = connect_holding(&mesh, &minted.token, &[&run.id]).await;
    for report in [
        Up::RunEvents(rpb::RunEvents {
            run_id: run.id.clone(),
            events: vec![automesh_proto::v1::RunEvent {
                event_id: format!("{}:1", run.id),
                ..Default::default()
            }],
        }),
        Up::RunFinished(rpb::RunFinished {
            run_id: run.id.clone(),
            outcome: pb::RunState::Succeeded as i32,
            engine: "third-party".into(),
            ..Default::default()
        }),
    ] {
        tx.send(up(report)).await.expect("resend");
    }
    let Down::CancelAssignment(c) = next(&mut stream).await else {
        panic!("told the run is finished")
    };
    assert_eq!(
        (c.run_id.as_str(), c.reason.as_str()),
        (run.id.as_str(), "the run is finished")
    );
    // The runner ends its stream: every report it sent is answered before
    // the stream ends, and none of them with a ProtocolError.
    drop(tx);
    let mut answers = vec![];
    while let Ok(Ok(Some(m))) =
        tokio::time::timeout(Duration::from_secs(10), stream.message()).await
    {
        answers.extend(m.message);
    }
    assert!(
        !answers.iter().any(|m| matches!(m, Down::ProtocolError(_))),
        "{answers:?}"
    );
    mesh.stop().await.expect("stop");
}

/// A runner whose Hello names another organisation's run learns nothing
/// about it: the cancellation it gets says exactly what an unknown id gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_run_id_gets_the_answer_an_unknown_id_gets() {
    use rpb::connect_response::Message as Down;
    let mesh = dispatching_mesh().await;
    // bob's desktop run waits for bob's runner, which never comes.
    let bobs = mesh.desktop_run_now("globex", "bob").await;
    let minted = mint(&mesh).await;
    let (tx, mut stream) =
        connect_holding(&mesh, &minted.token, &[&bobs.id, "run-that-never-existed"]).await;
    let mut reasons = std::collections::BTreeMap::new();
    while reasons.len() < 2 {
        tx.send(heartbeat()).await.expect("heartbeat");
        if let Down::CancelAssignment(c) = next(&mut stream).await {
            reasons.insert(c.run_id, c.reason);
        }
    }
    assert_eq!(
        reasons[&bobs.id], reasons["run-that-never-existed"],
        "{reasons:?}"
    );
    drop(tx);
    mesh.stop().await.expect("stop");
}

/// Two runner-gateway replicas on PostgreSQL; desktop runs go through them.
async fn two_replicas(run_deadline: Duration) -> Mesh {
    Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            desktop_via_runner_gateway: true,
            runner_gateways: 2,
            run_deadline,
            runner_streams: StreamSettings {
                heartbeat_interval: Duration::from_millis(200),
                dead_after: Duration::from_secs(3),
                hello_timeout: Duration::from_secs(2),
                accept_within: Duration::from_secs(1),
                ..Default::default()
            },
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh")
}

/// Connects to replica `replica` of the runner gateway.
async fn connect_to(
    mesh: &Mesh,
    replica: usize,
    token: &str,
) -> (
    mpsc::Sender<rpb::ConnectRequest>,
    tonic::Streaming<rpb::ConnectResponse>,
) {
    let mut client = DesktopRunnerServiceClient::new(
        automesh_rpc::client::channel(&mesh.runner_gateways[replica]).expect("channel"),
    );
    let (tx, rx) = mpsc::channel(64);
    tx.send(hello()).await.expect("hello");
    let request = automesh_e2e_tests::with_bearer(token, ReceiverStream::new(rx));
    let mut stream = tokio::time::timeout(Duration::from_secs(10), client.connect(request))
        .await
        .expect("answered in time")
        .expect("connected")
        .into_inner();
    assert!(matches!(
        next(&mut stream).await,
        rpb::connect_response::Message::Welcome(_)
    ));
    // Heartbeats keep it alive; the runner itself may do nothing else.
    let beat = tx.clone();
    tokio::spawn(async move {
        while beat.send(heartbeat()).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    (tx, stream)
}

async fn mint_named(mesh: &Mesh, name: &str) -> String {
    mesh.automations(Some(&mesh.token("acme", "alice")))
        .create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: name.into(),
        })
        .await
        .expect("mint")
        .into_inner()
        .token
}

/// A runner that heartbeats but never accepts does not pin the run: past
/// the acceptance bound it is told to drop it, and the owner's other,
/// healthy runner (on the other replica) gets it and runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_runners_assignment_goes_to_the_owners_healthy_runner() {
    use rpb::connect_request::Message as Up;
    use rpb::connect_response::Message as Down;
    let mesh = two_replicas(Duration::from_secs(120)).await;
    let (wedged_token, healthy_token) = (
        mint_named(&mesh, "wedged").await,
        mint_named(&mesh, "healthy").await,
    );
    let (_wedged_tx, mut wedged) = connect_to(&mesh, 0, &wedged_token).await;
    let run = mesh.desktop_run_now("acme", "alice").await;
    let Down::Assignment(a) = next(&mut wedged).await else {
        panic!("the wedged runner is sent the run first")
    };
    assert_eq!(a.run_id, run.id);
    let (healthy_tx, mut healthy) = connect_to(&mesh, 1, &healthy_token).await;
    // The wedged runner never accepts: it is told to drop the run…
    let Down::CancelAssignment(c) = next(&mut wedged).await else {
        panic!("the wedged runner is told to drop it")
    };
    assert_eq!(c.run_id, run.id);
    assert!(c.reason.contains("not accepted"), "{c:?}");
    // …and the healthy runner gets it, runs it, and the run succeeds.
    let Down::Assignment(a) = next(&mut healthy).await else {
        panic!("the healthy runner gets the run")
    };
    assert_eq!(a.run_id, run.id);
    for m in [
        Up::AssignmentAccepted(rpb::AssignmentAccepted {
            run_id: run.id.clone(),
        }),
        Up::RunFinished(rpb::RunFinished {
            run_id: run.id.clone(),
            outcome: pb::RunState::Succeeded as i32,
            engine: "healthy".into(),
            ..Default::default()
        }),
    ] {
        healthy_tx.send(up(m)).await.expect("send");
    }
    let ended = mesh.until_terminal(&run.id, Duration::from_secs(30)).await;
    assert_eq!(
        ended.state,
        automesh_domain::RunState::Succeeded,
        "{ended:?}"
    );
    mesh.stop().await.expect("stop");
}

/// With only a wedged runner, the run ends at its deadline naming what
/// happened: `runner_unresponsive`, not `runner_offline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_only_a_wedged_runner_was_sent_ends_runner_unresponsive() {
    use rpb::connect_response::Message as Down;
    let mesh = two_replicas(Duration::from_secs(4)).await;
    let token = mint_named(&mesh, "wedged").await;
    let (_tx, mut wedged) = connect_to(&mesh, 0, &token).await;
    let run = mesh.desktop_run_now("acme", "alice").await;
    let Down::Assignment(_) = next(&mut wedged).await else {
        panic!("an assignment")
    };
    let ended = mesh.until_terminal(&run.id, Duration::from_secs(60)).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (
            automesh_domain::RunState::TimedOut,
            Some(automesh_domain::ErrorCode::RunnerUnresponsive)
        ),
        "{ended:?}"
    );
    mesh.stop().await.expect("stop");
}

/// One runner token, one stream on each of two replicas: the newest stream
/// wins across replicas. The older one is closed, and no run is delivered
/// to it, even in the moment before it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_on_two_replicas_gets_each_run_once_on_its_newest_stream() {
    use rpb::connect_request::Message as Up;
    use rpb::connect_response::Message as Down;
    let mesh = two_replicas(Duration::from_secs(120)).await;
    let token = mint_named(&mesh, "laptop").await;
    let (_old_tx, mut old) = connect_to(&mesh, 0, &token).await;
    let (new_tx, mut new) = connect_to(&mesh, 1, &token).await;
    let mut runs = vec![];
    for _ in 0..20 {
        runs.push(mesh.desktop_run_now("acme", "alice").await.id);
    }
    // The older stream ends (replaced), having been sent nothing.
    let old_end = tokio::spawn(async move {
        let mut assigned = vec![];
        loop {
            match tokio::time::timeout(Duration::from_secs(15), old.message()).await {
                Ok(Ok(Some(m))) => {
                    if let Some(Down::Assignment(a)) = m.message {
                        assigned.push(a.run_id);
                    }
                }
                Ok(Ok(None)) => return (assigned, None),
                Ok(Err(status)) => return (assigned, Some(status)),
                Err(_) => panic!("the older stream was not closed within 15 s"),
            }
        }
    });
    let mut delivered = std::collections::BTreeMap::<String, usize>::new();
    while delivered.len() < runs.len() {
        if let Down::Assignment(a) = next(&mut new).await {
            *delivered.entry(a.run_id.clone()).or_default() += 1;
            for m in [
                Up::AssignmentAccepted(rpb::AssignmentAccepted {
                    run_id: a.run_id.clone(),
                }),
                Up::RunFinished(rpb::RunFinished {
                    run_id: a.run_id.clone(),
                    outcome: pb::RunState::Succeeded as i32,
                    engine: "laptop".into(),
                    ..Default::default()
                }),
            ] {
                new_tx.send(up(m)).await.expect("send");
            }
        }
    }
    let (old_assigned, old_status) = old_end.await.expect("old stream");
    assert!(
        old_assigned.is_empty(),
        "sent to the older stream: {old_assigned:?}"
    );
    let status = old_status.expect("the older stream ends with a status");
    assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
    assert!(delivered.values().all(|n| *n == 1), "{delivered:?}");
    for id in &runs {
        let ended = mesh.until_terminal(id, Duration::from_secs(30)).await;
        assert_eq!(
            ended.state,
            automesh_domain::RunState::Succeeded,
            "{ended:?}"
        );
    }
    mesh.stop().await.expect("stop");
}

/// Events are bounded in bytes: a runner's 3 MiB tool output (sent in a
/// message under the runner limit) is kept as its first MiB with a note,
/// and a run's history pages within the byte budget a default client
/// accepts, however large its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_events_are_cut_and_their_history_still_pages() {
    use rpb::connect_request::Message as Up;
    use rpb::connect_response::Message as Down;
    let mesh = dispatching_mesh().await;
    let minted = mint(&mesh).await;
    let (tx, mut stream) = connect_holding(&mesh, &minted.token, &[]).await;
    let run = mesh.desktop_run_now("acme", "alice").await;
    let Down::Assignment(_) = next(&mut stream).await else {
        panic!("an assignment")
    };
    tx.send(up(Up::AssignmentAccepted(rpb::AssignmentAccepted {
        run_id: run.id.clone(),
    })))
    .await
    .expect("accept");
    for i in 0..4 {
        let output = format!("{i}").repeat(3 * 1024 * 1024);
        tx.send(up(Up::RunEvents(rpb::RunEvents {
            run_id: run.id.clone(),
            events: vec![pb::RunEvent {
                event_id: format!("big-{i}"),
                payload: Some(pb::run_event::Payload::ToolResult(pb::ToolResult {
                    call_id: format!("c{i}"),
                    tool: "execute_capability".into(),
                    output,
                    is_error: false,
                })),
                ..Default::default()
            }],
        })))
        .await
        .expect("events");
    }
    tx.send(up(Up::RunFinished(rpb::RunFinished {
        run_id: run.id.clone(),
        outcome: pb::RunState::Succeeded as i32,
        ..Default::default()
    })))
    .await
    .expect("finish");
    let ended = mesh.until_terminal(&run.id, Duration::from_secs(30)).await;
    assert_eq!(ended.state, automesh_domain::RunState::Succeeded);
    // Through the public API with a default client: every page decodes.
    let mut runs = mesh.runs(Some(&mesh.token("acme", "alice")));
    let (mut after, mut outputs, mut pages) = (0, vec![], 0);
    loop {
        let page = runs
            .list_run_events(pb::ListRunEventsRequest {
                run_id: run.id.clone(),
                after_sequence: after,
                page_size: 100,
            })
            .await
            .expect("a page within the default 4 MiB")
            .into_inner();
        if page.events.is_empty() {
            break;
        }
        pages += 1;
        for e in &page.events {
            if let Some(pb::run_event::Payload::ToolResult(r)) = &e.payload {
                outputs.push(r.output.clone());
            }
        }
        after = page.last_sequence;
    }
    assert_eq!(outputs.len(), 4);
    assert!(pages >= 2, "four 1 MiB events do not fit one 3 MiB page");
    for (i, output) in outputs.iter().enumerate() {
        assert!(output.len() <= automesh_proto::bounds::MAX_EVENT_TEXT_BYTES);
        assert!(output.starts_with(&format!("{i}{i}{i}")), "in order");
        assert!(output.contains("cut to"), "the cut is said");
    }
    drop(tx);
    mesh.stop().await.expect("stop");
}

/// Python with grpcio (grpc C-core): `AUTOMESH_GRPCIO_PYTHON`, else the
/// `.tools/venv` `scripts/test` installs it into. The test fails without it.
fn grpcio_python() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("AUTOMESH_GRPCIO_PYTHON") {
        return p.into();
    }
    let local = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/python3");
    assert!(
        local.exists(),
        "Python with grpcio missing at {} (scripts/test installs it)",
        local.display()
    );
    local
}

/// A runner on another gRPC stack entirely (C-core's HTTP/2, HPACK and
/// flow control, with its BDP PINGs) is served by the runner listener's
/// lean HTTP/2 like ours: health, a refused token with its status, then
/// Hello → Welcome and heartbeats → acks, and a clean end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_on_grpc_core_is_welcomed_and_kept_alive() {
    use prost::Message as _;
    let mesh = mesh().await;
    let minted = mint(&mesh).await;
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/grpcio_runner.py");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(grpcio_python())
            .arg(script)
            .arg(mesh.runner_gateway.trim_start_matches("http://"))
            .arg(&minted.token)
            .arg(hex::encode(hello().encode_to_vec()))
            .arg(hex::encode(heartbeat().encode_to_vec()))
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the grpcio runner ends in time")
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let said = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{said}");
    let lines: Vec<&str> = stdout.lines().collect();
    // SERVING is status 1 (field 1, varint).
    assert_eq!(lines.first(), Some(&"health 0801"), "{said}");
    assert_eq!(lines.get(1), Some(&"refused UNAUTHENTICATED"), "{said}");
    let got: Vec<rpb::ConnectResponse> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("got "))
        .map(|h| rpb::ConnectResponse::decode(&*hex::decode(h).expect("hex")).expect("a message"))
        .collect();
    let Some(rpb::connect_response::Message::Welcome(welcome)) =
        got.first().and_then(|m| m.message.clone())
    else {
        panic!("expected Welcome first: {said}");
    };
    assert_eq!(welcome.runner_id, minted.runner_id);
    let acks = got
        .iter()
        .filter(|m| {
            matches!(
                m.message,
                Some(rpb::connect_response::Message::HeartbeatAck(_))
            )
        })
        .count();
    assert_eq!(acks, 3, "{said}");
    assert_eq!(lines.last(), Some(&"ended OK"), "{said}");
    mesh.stop().await.expect("stop");
}

/// A heartbeating runner's liveness is judged by what it sends, not by how
/// fast the gateway stores it. A third-party runner on grpc C-core that
/// keeps the documented heartbeat liveness (no PINGs of its own) reports
/// 50,000 events — one message of 30,000 and 40 of 500, its heartbeats
/// queued behind them in its one stream — while the database is slowed (a
/// lock on the run's assignment, or SQLite's write lock, held for twice the
/// dead-after bound): its stream stays alive, every event is stored once and
/// in order, and the run ends with its result. Then the runner is stopped
/// with SIGSTOP, and the gateway declares its stream dead within the bound.
async fn a_heartbeating_runner_reporting_a_flood_to_a_slow_database_stays_alive(backend: Backend) {
    use prost::Message as _;
    use rpb::connect_request::Message as Up;
    let dead_after = Duration::from_secs(2);
    let mesh = Mesh::start_with(
        backend,
        MeshOptions {
            desktop_via_runner_gateway: true,
            runner_streams: StreamSettings {
                heartbeat_interval: Duration::from_millis(500),
                dead_after,
                hello_timeout: Duration::from_secs(2),
                ..Default::default()
            },
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh");
    let minted = mint(&mesh).await;
    // Offered while no runner is connected: it waits for this one.
    let run = mesh.desktop_run_now("acme", "alice").await;

    let events = |from: usize, n: usize| -> Up {
        Up::RunEvents(rpb::RunEvents {
            run_id: run.id.clone(),
            events: (from..from + n)
                .map(|i| pb::RunEvent {
                    event_id: format!("flood-{i:05}"),
                    payload: Some(pb::run_event::Payload::AssistantText(pb::AssistantText {
                        text: format!("event {i}"),
                    })),
                    ..Default::default()
                })
                .collect(),
        })
    };
    let mut reports = vec![events(0, 30_000)];
    reports.extend((0..40).map(|k| events(30_000 + k * 500, 500)));
    reports.push(Up::RunFinished(rpb::RunFinished {
        run_id: run.id.clone(),
        outcome: pb::RunState::Succeeded as i32,
        engine: "grpcio-flood".into(),
        ..Default::default()
    }));
    let mut lines = vec![
        hex::encode(hello().encode_to_vec()),
        hex::encode(heartbeat().encode_to_vec()),
        hex::encode(
            up(Up::AssignmentAccepted(rpb::AssignmentAccepted {
                run_id: run.id.clone(),
            }))
            .encode_to_vec(),
        ),
    ];
    lines.extend(
        reports
            .into_iter()
            .map(|r| hex::encode(up(r).encode_to_vec())),
    );
    let messages = std::env::temp_dir().join(format!("automesh-flood-{}.hex", run.id));
    std::fs::write(&messages, lines.join("\n")).expect("messages");

    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/grpcio_flood.py");
    let mut runner = tokio::process::Command::new(grpcio_python())
        .arg(script)
        .arg(mesh.runner_gateway.trim_start_matches("http://"))
        .arg(&minted.token)
        .arg(&messages)
        .arg("0.5")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python runs");
    let pid = runner.id().expect("pid");
    let mut stdin = runner.stdin.take().expect("stdin");
    let said = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let reader = {
        use tokio::io::AsyncBufReadExt;
        let said = said.clone();
        let mut out = tokio::io::BufReader::new(runner.stdout.take().expect("stdout")).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                said.lock().expect("lock").push(line);
            }
        })
    };
    let saw = |prefix: &str| said_line(&said, prefix);
    until_said(&said, "got 32", Duration::from_secs(30)).await;

    // The database is slowed: the run's assignment row (PostgreSQL) or the
    // whole database (SQLite's write lock) held for twice the bound.
    let mut held = mesh.store().pool().acquire().await.expect("a connection");
    match backend {
        Backend::Postgres => {
            sqlx::query("BEGIN")
                .execute(&mut *held)
                .await
                .expect("begin");
            sqlx::query("SELECT run_id FROM desktop_assignments WHERE run_id = $1 FOR UPDATE")
                .bind(run.id.clone())
                .fetch_all(&mut *held)
                .await
                .expect("lock the assignment");
        }
        Backend::Sqlite => {
            sqlx::query("BEGIN IMMEDIATE")
                .execute(&mut *held)
                .await
                .expect("take the write lock");
        }
    }
    let release = tokio::spawn(async move {
        tokio::time::sleep(dead_after * 2).await;
        sqlx::query("COMMIT")
            .execute(&mut *held)
            .await
            .expect("commit");
    });
    use tokio::io::AsyncWriteExt;
    stdin.write_all(b"go\n").await.expect("go");
    stdin.flush().await.expect("flush");
    until_said(&said, "sent 42", Duration::from_secs(120)).await;
    release.await.expect("released");
    let ended = mesh.until_terminal(&run.id, Duration::from_secs(120)).await;
    assert_eq!(
        ended.state,
        automesh_domain::RunState::Succeeded,
        "{ended:?}"
    );
    assert_eq!(
        saw("ended"),
        None,
        "the stream ended: {:?}",
        said.lock().expect("lock")
    );

    // Every event stored once, in the order sent.
    let mut stored = vec![];
    loop {
        let after = stored.len() as i64;
        let page = mesh
            .store()
            .internal()
            .events(&run.id, after, 1000)
            .await
            .expect("events");
        if page.is_empty() {
            break;
        }
        stored.extend(page);
    }
    let flood: Vec<&str> = stored
        .iter()
        .map(|e| e.event_id.as_str())
        .filter(|id| id.starts_with("flood-"))
        .collect();
    assert_eq!(flood.len(), 50_000);
    for (i, id) in flood.iter().enumerate() {
        assert_eq!(*id, format!("flood-{i:05}"), "in order");
    }

    // Stopped: the gateway declares it dead, well before the runner would
    // heartbeat again once continued.
    automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::STOP);
    tokio::time::sleep(dead_after * 3).await;
    automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::CONT);
    let end = until_said(&said, "ended", Duration::from_secs(30)).await;
    assert!(
        end.starts_with("ended DEADLINE_EXCEEDED") && end.contains("declared dead")
            || end.starts_with("ended UNAVAILABLE"),
        "{end}"
    );
    let _ = runner.kill().await;
    reader.abort();
    let _ = std::fs::remove_file(&messages);
    mesh.stop().await.expect("stop");
}

automesh_e2e_tests::on_both_backends!(
    a_heartbeating_runner_reporting_a_flood_to_a_slow_database_stays_alive
);

/// The first line a peer printed that starts with `prefix`.
fn said_line(said: &std::sync::Mutex<Vec<String>>, prefix: &str) -> Option<String> {
    said.lock()
        .expect("lock")
        .iter()
        .find(|l| l.starts_with(prefix))
        .cloned()
}

/// Waits (bounded by `within`) until a peer printed a line starting with
/// `prefix`; returns it.
async fn until_said(
    said: &std::sync::Mutex<Vec<String>>,
    prefix: &str,
    within: Duration,
) -> String {
    let give_up = tokio::time::Instant::now() + within;
    loop {
        if let Some(line) = said_line(said, prefix) {
            return line;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "the peer never said {prefix:?}: {:?}",
            said.lock().expect("lock")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One connection flooding the runner listener with PINGs and SETTINGS
/// (answered as fast as they come) does not stop another runner's
/// assignments: a run made while the flood goes on is delivered to its
/// runner, and the flood is answered all along. (How much the flood delays
/// an assignment is `bench-desktop`'s to report, as a ratio.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_and_settings_flood_on_one_connection_does_not_stop_another_runners_assignments() {
    use std::sync::atomic::Ordering;
    let mesh = dispatching_mesh().await;
    let minted = mint(&mesh).await;
    let flood = automesh_e2e_tests::flood::Flood::start(&mesh.runner_gateway);
    let (tx, mut stream) = connect_holding(&mesh, &minted.token, &[]).await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    while flood.counts.answered.load(Ordering::Relaxed) < 10_000 {
        assert!(
            tokio::time::Instant::now() < give_up,
            "the flood is answered: {:?}",
            flood.counts
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..3 {
        let run = mesh.desktop_run_now("acme", "alice").await;
        let rpb::connect_response::Message::Assignment(a) = next(&mut stream).await else {
            panic!("an assignment while the flood goes on")
        };
        assert_eq!(a.run_id, run.id);
        tx.send(up(rpb::connect_request::Message::RunFinished(
            rpb::RunFinished {
                run_id: run.id.clone(),
                outcome: pb::RunState::Succeeded as i32,
                ..Default::default()
            },
        )))
        .await
        .expect("finish");
    }
    let answered = flood.counts.answered.load(Ordering::Relaxed);
    assert!(answered >= 10_000, "{:?}", flood.counts);
    drop(flood);
    drop(tx);
    mesh.stop().await.expect("stop");
}
