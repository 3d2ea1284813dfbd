//! The OpenCode adapter against an *older* OpenCode server, which announces
//! prompts with `permission.updated` (kind in `type`, a single `pattern`)
//! and answers only at `POST /session/{id}/permissions/{id}`. The real 1.18
//! server no longer speaks this, so a fake of that release stands in for it,
//! speaking its wire shapes over HTTP + SSE. The prompt comes from a child
//! session (a sub-agent), which belongs to the run too.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_engine::adapter::EngineRequest;
use automesh_engine::adapter::{Ending, EngineEvent};
use automesh_engine::opencode::{self, OpenCodeConfig, PermissionPolicy, PermissionRule};
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Response, StatusCode};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
struct Old {
    events: broadcast::Sender<Value>,
    replies: Arc<Mutex<Vec<(String, String, String)>>>,
    aborts: Arc<Mutex<Vec<String>>>,
    answered: Arc<Mutex<bool>>,
}

impl Old {
    fn send(&self, v: Value) {
        let _ = self.events.send(v);
    }

    fn finish(&self, text: &str) {
        self.send(
            json!({"type": "message.part.updated", "properties": {"part": {
            "id": "prt_t", "sessionID": "ses_root", "messageID": "msg_a", "type": "text",
            "text": text, "time": {"start": 1, "end": 2}}}}),
        );
        self.send(json!({"type": "message.updated", "properties": {"info": {
            "id": "msg_a", "sessionID": "ses_root", "role": "assistant", "cost": 0.002,
            "tokens": {"input": 11, "output": 5}, "time": {"created": 1, "completed": 2}}}}));
        self.send(json!({"type": "session.status", "properties": {"sessionID": "ses_root", "status": {"type": "idle"}}}));
        self.send(json!({"type": "session.idle", "properties": {"sessionID": "ses_root"}}));
    }
}

async fn events(State(old): State<Old>) -> Response<Body> {
    let mut rx = old.events.subscribe();
    let stream = async_stream(
        move |tx: mpsc::Sender<Result<Vec<u8>, std::io::Error>>| async move {
            let hello = json!({"type": "server.connected", "properties": {}});
            let _ = tx.send(Ok(format!("data: {hello}\n\n").into_bytes())).await;
            while let Ok(v) = rx.recv().await {
                if tx
                    .send(Ok(format!("data: {v}\n\n").into_bytes()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        },
    );
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .expect("response")
}

fn async_stream<F, Fut>(
    f: F,
) -> tokio_stream::wrappers::ReceiverStream<Result<Vec<u8>, std::io::Error>>
where
    F: FnOnce(mpsc::Sender<Result<Vec<u8>, std::io::Error>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

async fn prompt(State(old): State<Old>, Path(_id): Path<String>) -> StatusCode {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        old.send(json!({"type": "session.status", "properties": {"sessionID": "ses_root", "status": {"type": "busy"}}}));
        // A sub-agent starts and asks, the old way.
        old.send(json!({"type": "session.created", "properties": {"info": {"id": "ses_child", "parentID": "ses_root"}}}));
        old.send(json!({"type": "permission.updated", "properties": {
            "id": "per_1", "sessionID": "ses_child", "type": "bash", "pattern": "echo hi",
            "title": "echo hi", "metadata": {}, "time": {"created": 1}}}));
    });
    StatusCode::NO_CONTENT
}

async fn legacy_reply(
    State(old): State<Old>,
    Path((sid, pid)): Path<(String, String)>,
    axum::Json(body): axum::Json<Value>,
) -> axum::Json<Value> {
    let reply = body["response"].as_str().unwrap_or("").to_owned();
    old.replies
        .lock()
        .expect("lock")
        .push((sid, pid, reply.clone()));
    *old.answered.lock().expect("lock") = true;
    if reply == "once" {
        old.send(json!({"type": "message.part.updated", "properties": {"part": {
            "id": "prt_c", "sessionID": "ses_child", "messageID": "msg_c", "type": "tool", "tool": "bash",
            "callID": "call_1", "state": {"status": "completed", "input": {"command": "echo hi"}, "output": "hi\n"}}}}));
        old.finish("done");
    }
    axum::Json(json!(true))
}

async fn abort(State(old): State<Old>, Path(id): Path<String>) -> axum::Json<Value> {
    old.aborts.lock().expect("lock").push(id.clone());
    if id == "ses_root" {
        old.send(json!({"type": "session.status", "properties": {"sessionID": "ses_root", "status": {"type": "idle"}}}));
    }
    axum::Json(json!(true))
}

async fn messages(State(old): State<Old>) -> axum::Json<Value> {
    if *old.answered.lock().expect("lock") {
        axum::Json(
            json!([{"info": {"id": "msg_a", "sessionID": "ses_root", "role": "assistant",
            "tokens": {"input": 11, "output": 5}, "cost": 0.002, "time": {"created": 1, "completed": 2}},
            "parts": [{"id": "prt_t", "type": "text", "text": "done", "time": {"start": 1, "end": 2}}]}]),
        )
    } else {
        axum::Json(json!([]))
    }
}

async fn serve() -> (String, Old) {
    let (events_tx, _) = broadcast::channel(64);
    let old = Old {
        events: events_tx,
        replies: Arc::default(),
        aborts: Arc::default(),
        answered: Arc::default(),
    };
    let app = Router::new()
        .route(
            "/global/health",
            get(|| async { axum::Json(json!({"healthy": true, "version": "0.15.0"})) }),
        )
        .route("/event", get(events))
        .route(
            "/session",
            post(|| async { axum::Json(json!({"id": "ses_root"})) }),
        )
        .route("/session/status", get(|| async { axum::Json(json!({})) }))
        .route("/session/{id}/prompt_async", post(prompt))
        .route("/session/{id}/message", get(messages))
        .route("/session/{id}/abort", post(abort))
        .route("/session/{sid}/permissions/{pid}", post(legacy_reply))
        // The old server has no /permission routes: 404 for both.
        .with_state(old.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, old)
}

async fn run(
    url: &str,
    policy: PermissionPolicy,
) -> (automesh_engine::adapter::Outcome, Vec<EngineEvent>) {
    let mut cfg = OpenCodeConfig::new(url);
    cfg.idle_timeout = Duration::from_secs(10);
    let (tx, mut rx) = mpsc::channel(64);
    let collect = tokio::spawn(async move {
        let mut all = vec![];
        while let Some(e) = rx.recv().await {
            all.push(e);
        }
        all
    });
    let request = EngineRequest {
        prompt: "say hi".into(),
        model: "old/model".into(),
        provider_model: String::new(),
        automation_id: "aut-1".into(),
        guidance: None,
        deadline: Instant::now() + Duration::from_secs(30),
        resume_from: None,
        budget: Default::default(),
        price: None,
    };
    let outcome = tokio::time::timeout(
        Duration::from_secs(40),
        opencode::run(&cfg, &policy, request, tx, CancellationToken::new()),
    )
    .await
    .expect("never hangs");
    (outcome, collect.await.expect("events"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_sessions_permission_updated_is_answered_on_the_legacy_route() {
    let (url, old) = serve().await;
    let policy = PermissionPolicy {
        allow: vec![PermissionRule {
            permission: "bash".into(),
            patterns: vec!["echo *".into()],
        }],
    };
    let (outcome, events) = run(&url, policy).await;
    assert_eq!(
        outcome.ending,
        Ending::Succeeded {
            answer: "done".into()
        },
        "{events:?}"
    );
    assert_eq!(
        *old.replies.lock().expect("lock"),
        vec![(
            "ses_child".to_owned(),
            "per_1".to_owned(),
            "once".to_owned()
        )]
    );
    assert!(events.iter().any(|e| matches!(
        e,
        EngineEvent::Permission { permission, patterns, reply, .. }
            if permission == "bash" && patterns == &vec!["echo hi".to_owned()] && reply == "once"
    )));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, EngineEvent::ToolResult { output, .. } if output == "hi\n"))
    );
    assert_eq!(
        (outcome.usage.input_tokens, outcome.usage.cost_micros),
        (11, 2000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_legacy_prompt_outside_the_policy_is_rejected_and_named() {
    let (url, old) = serve().await;
    let (outcome, _) = run(&url, PermissionPolicy::default()).await;
    let Ending::Failed(e) = &outcome.ending else {
        panic!("expected a failure, got {:?}", outcome.ending);
    };
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{}", e.message);
    assert!(
        e.message.contains("bash") && e.message.contains("echo hi"),
        "{}",
        e.message
    );
    assert_eq!(old.replies.lock().expect("lock")[0].2, "reject");
    assert!(
        old.aborts
            .lock()
            .expect("lock")
            .contains(&"ses_root".to_owned())
    );
}
