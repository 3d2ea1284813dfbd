//! The worker agent over real gRPC: both credentials on every call,
//! observe-or-submit by message id, cancellation to idle, and the MCP
//! registration the lifecycle service probes and repairs.

use std::time::Duration;

use automesh_proto::agent::v1 as apb;
use automesh_proto::agent::v1::worker_agent_service_client::WorkerAgentServiceClient;
use automesh_proto::v1 as pb;
use automesh_testkit::{FakeProvider, Reply, provider, text_completion};
use automesh_worker_agent::{DualCredential, HOST_HEADER, Settings, serve};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

const COLLABORATOR: &str = "collaborator-token-of-this-worker";
const HOST: &str = "internal-host-credential-of-the-mesh";
const MCP_TOKEN: &str = "run-scoped-connect-token";

struct Agent {
    addr: String,
    mcp_url: String,
    provider: FakeProvider,
    stop: CancellationToken,
    _mcp: CancellationToken,
    dir: std::path::PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.cancel();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn agent(
    script: impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync + 'static,
) -> Agent {
    let (provider_url, fake) = provider(script).await;
    let (mcp_url, mcp_stop) = automesh_testkit::connect(MCP_TOKEN).await;
    let dir =
        std::env::temp_dir().join(format!("automesh-agent-{}", uuid::Uuid::new_v4().simple()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = format!("http://{}", listener.local_addr().expect("addr"));
    let stop = CancellationToken::new();
    tokio::spawn(serve(
        Settings {
            provider: automesh_engine::ProviderFlags {
                provider_url,
                provider_key: "sk-agent".to_owned().into(),
                max_steps: 8,
                request_timeout: Duration::from_secs(60),
                stream: false,
            },
            state_dir: dir.clone(),
            orphan_after: None,
        },
        DualCredential::new(COLLABORATOR, HOST),
        listener,
        stop.clone(),
    ));
    Agent {
        addr,
        mcp_url,
        provider: fake,
        stop,
        _mcp: mcp_stop,
        dir,
    }
}

fn request<T>(message: T, collaborator: Option<&str>, host: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    if let Some(c) = collaborator {
        r.metadata_mut().insert(
            "authorization",
            format!("Bearer {c}").parse().expect("ascii"),
        );
    }
    if let Some(h) = host {
        r.metadata_mut()
            .insert(HOST_HEADER, h.parse().expect("ascii"));
    }
    r
}

fn both<T>(message: T) -> tonic::Request<T> {
    request(message, Some(COLLABORATOR), Some(HOST))
}

async fn client(a: &Agent) -> WorkerAgentServiceClient<Channel> {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let endpoint = tonic::transport::Endpoint::from_shared(a.addr.clone()).expect("endpoint");
        if let Ok(channel) = endpoint.connect().await {
            return WorkerAgentServiceClient::new(channel);
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "agent never listened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn register(c: &mut WorkerAgentServiceClient<Channel>, url: &str) {
    c.put_mcp_registration(both(apb::PutMcpRegistrationRequest {
        registration: Some(apb::McpRegistration {
            name: "openwork-cloud".into(),
            url: url.into(),
            model: "fake/echo".into(),
        }),
    }))
    .await
    .expect("register");
}

fn submit(message_id: &str) -> apb::SubmitMessageRequest {
    apb::SubmitMessageRequest {
        workspace_id: "ws-1".into(),
        thread_id: "thr-1".into(),
        message_id: message_id.into(),
        prompt: "say hello".into(),
        model: "fake/echo".into(),
        deadline_time: None,
        traceparent: String::new(),
        connect_token: MCP_TOKEN.into(),
        guidance: String::new(),
        provider_model: String::new(),
        budget: None,
    }
}

async fn until_idle(c: &mut WorkerAgentServiceClient<Channel>, thread_id: &str) -> apb::Thread {
    let mut stream = c
        .observe_thread(both(apb::ObserveThreadRequest {
            thread_id: thread_id.into(),
            after_sequence: 0,
        }))
        .await
        .expect("observe")
        .into_inner();
    let mut last = None;
    while let Some(m) = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("bounded")
        .expect("ok")
    {
        if let Some(apb::observe_thread_response::Update::Thread(t)) = m.update {
            last = Some(t);
        }
    }
    last.expect("a final thread state")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_needs_both_credentials() {
    let a = agent(|_, _| Reply::Json(text_completion("hi"))).await;
    let mut c = client(&a).await;
    let get = || apb::GetThreadRequest {
        thread_id: "t".into(),
    };
    for (collaborator, host) in [
        (None, None),
        (Some(COLLABORATOR), None),
        (None, Some(HOST)),
        (Some("wrong"), Some(HOST)),
        (Some(COLLABORATOR), Some("wrong")),
    ] {
        let err = c
            .get_thread(request(get(), collaborator, host))
            .await
            .expect_err("refused");
        assert_eq!(
            err.code(),
            Code::Unauthenticated,
            "{collaborator:?} {host:?}"
        );
    }
    c.get_thread(both(get()))
        .await
        .expect("both credentials admit the call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_message_id_observes_the_existing_message_and_never_runs_it_twice() {
    let a =
        agent(|_, _| Reply::Delayed(Duration::from_millis(500), text_completion("hello"))).await;
    let mut c = client(&a).await;
    register(&mut c, &a.mcp_url).await;
    let first = c
        .submit_message(both(submit("msg-1")))
        .await
        .expect("submit")
        .into_inner();
    assert!(first.submitted);
    let again = c
        .submit_message(both(submit("msg-1")))
        .await
        .expect("again")
        .into_inner();
    assert!(!again.submitted, "a repeated id is observed, not submitted");
    let done = until_idle(&mut c, "thr-1").await;
    assert_eq!(done.outcome, pb::RunState::Succeeded as i32, "{done:?}");
    let after = c
        .submit_message(both(submit("msg-1")))
        .await
        .expect("after")
        .into_inner();
    assert!(!after.submitted);
    assert_eq!(a.provider.calls(), 1, "the prompt reached the model once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_thread_stops_its_engine_and_reports_idle() {
    let a = agent(|_, _| Reply::Delayed(Duration::from_secs(30), text_completion("late"))).await;
    let mut c = client(&a).await;
    register(&mut c, &a.mcp_url).await;
    c.submit_message(both(submit("msg-2")))
        .await
        .expect("submit");
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    while a.provider.calls() == 0 {
        assert!(
            tokio::time::Instant::now() < give_up,
            "never called the model"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.cancel_thread(both(apb::CancelThreadRequest {
        thread_id: "thr-1".into(),
    }))
    .await
    .expect("cancel");
    let done = until_idle(&mut c, "thr-1").await;
    assert_eq!(done.status, apb::ThreadStatus::Idle as i32);
    assert_eq!(done.outcome, pb::RunState::Cancelled as i32, "{done:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_registration_for_the_model_nothing_is_submitted() {
    let a = agent(|_, _| Reply::Json(text_completion("hi"))).await;
    let mut c = client(&a).await;
    let err = c
        .get_mcp_registration(both(apb::GetMcpRegistrationRequest {
            model: "fake/echo".into(),
        }))
        .await
        .expect_err("none yet");
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .submit_message(both(submit("msg-3")))
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("mcp_config_missing"),
        "{}",
        err.message()
    );
    assert_eq!(a.provider.calls(), 0);
    // A registration must carry the managed name.
    let err = c
        .put_mcp_registration(both(apb::PutMcpRegistrationRequest {
            registration: Some(apb::McpRegistration {
                name: "other".into(),
                url: a.mcp_url.clone(),
                model: "fake/echo".into(),
            }),
        }))
        .await
        .expect_err("bad name");
    assert_eq!(err.code(), Code::InvalidArgument);
}
