//! Notifications end to end: webhook endpoints through the public API,
//! messages written by the changes that cause them, delivered to a real
//! HTTP receiver (failures, timeouts and 500s injected), signatures checked
//! by the PyPI `standardwebhooks` package; SQLite and PostgreSQL.

use std::time::Duration;

use automesh_e2e_tests::executor::{Behavior, TestExecutor};
use automesh_e2e_tests::webhooks::{Answer, Receiver, verify_with_python};
use automesh_e2e_tests::{
    Api, Mesh, MeshOptions, daily_automation, on_both_backends, until_ended, wait_for,
};
use automesh_proto::v1 as pb;
use automesh_store::Backend;

async fn mesh_with(
    backend: Backend,
    behavior: Behavior,
    options: MeshOptions,
) -> (Mesh, TestExecutor) {
    let (executor, addr) = TestExecutor::start(behavior).await.expect("executor");
    let options = MeshOptions {
        executor: Some(addr),
        ..options
    };
    let mesh = Mesh::start_with(backend, options).await.expect("mesh");
    (mesh, executor)
}

async fn endpoint(mesh: &Mesh, token: &str, url: &str) -> (pb::WebhookEndpoint, String) {
    let request = pb::CreateWebhookEndpointRequest {
        url: url.to_owned(),
        description: "ops".into(),
    };
    let created = mesh
        .notifications(Some(token))
        .create_webhook_endpoint(request)
        .await;
    let created = created.expect("create endpoint").into_inner();
    (created.endpoint.expect("endpoint"), created.secret)
}

async fn run_to_its_end(mesh: &Mesh, token: &str, automation_id: &str, key: &str) {
    let mut api = mesh.automations(Some(token));
    let run = api.run_now(automation_id, key).await;
    until_ended(&mesh.db.store, &run.id, Duration::from_secs(30)).await;
}

async fn failures_reach_the_owners_endpoint_signed_retried_and_once_per_streak(backend: Backend) {
    let behavior = Behavior::Fail("provider_error");
    let (mesh, _executor) = mesh_with(backend, behavior, MeshOptions::default()).await;
    let receiver = Receiver::start(Answer::Status(204))
        .await
        .expect("receiver");
    // The first message's first attempt is answered 500, its second
    // never (past the 2 s bound); the third is delivered.
    receiver.script(&[Answer::Status(500), Answer::Hang]);
    let token = mesh.token("acme", "alice");
    let (ep, secret) = endpoint(&mesh, &token, &receiver.url).await;
    assert!(ep.id.starts_with("ep_") && secret.starts_with("whsec_"));
    assert_eq!(
        (ep.url.as_str(), ep.disable_time),
        (receiver.url.as_str(), None)
    );

    let mut request = daily_automation("nightly report", "report", pb::Surface::Desktop);
    if let Some(a) = request.automation.as_mut() {
        a.pause_after_failures = Some(2);
    }
    let a = mesh.automations(Some(&token)).create(request).await;
    // Three failed runs: the first starts a streak (run.failed), the second
    // pauses the automation (automation.needs_attention), the third is
    // part of the same streak and tells nobody.
    for key in ["k1", "k2", "k3"] {
        run_to_its_end(&mesh, &token, &a.id, key).await;
    }
    let mut hooks = mesh.notifications(Some(&token));
    let list = pb::ListWebhookMessagesRequest {
        endpoint_id: ep.id.clone(),
        page_size: 0,
    };
    let messages = hooks
        .list_webhook_messages(list.clone())
        .await
        .expect("messages");
    let mut types: Vec<String> = messages
        .into_inner()
        .messages
        .iter()
        .map(|m| m.event_type.clone())
        .collect();
    types.sort();
    assert_eq!(
        types,
        ["automation.needs_attention", "run.failed"],
        "one per streak"
    );

    let delivered = wait_for(
        Duration::from_secs(60),
        "both messages delivered",
        || async {
            let d = receiver.delivered();
            (d.len() == 2).then_some(d)
        },
    )
    .await;
    let received = receiver.received();
    // Retried with the same webhook-id until answered 2xx: the 500 and the
    // attempt never answered (whichever message met them) were each
    // followed by another attempt of the same message.
    let answers: Vec<Answer> = received.iter().map(|d| d.answer).collect();
    assert_eq!(answers.len(), 4, "{answers:?}");
    let mut attempts = std::collections::BTreeMap::<String, Vec<Answer>>::new();
    for d in &received {
        attempts
            .entry(d.id().to_owned())
            .or_default()
            .push(d.answer);
    }
    for (id, tries) in &attempts {
        assert!(id.starts_with("msg_"), "{id}");
        assert_eq!(tries.last(), Some(&Answer::Status(204)), "{id}: {tries:?}");
        assert_eq!(
            tries.iter().filter(|a| **a == Answer::Status(204)).count(),
            1
        );
    }
    let (first, _) = attempts
        .iter()
        .find(|(_, tries)| tries.contains(&Answer::Status(500)))
        .expect("the message answered 500");
    let first = first.clone();
    let mut ids: Vec<&str> = delivered.iter().map(|d| d.id()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 2, "two messages, each delivered once");
    for d in &received {
        assert_eq!(d.header("content-type"), Some("application/json"));
        assert!(
            d.header("webhook-signature")
                .is_some_and(|s| s.starts_with("v1,"))
        );
    }
    // Every attempt verifies with the endpoint's secret under an
    // independent implementation, and with no other secret.
    verify_with_python(&secret, &received).expect("signatures");

    let attention = delivered
        .iter()
        .find(|d| d.event_type() == "automation.needs_attention")
        .expect("needs attention");
    let body: serde_json::Value = serde_json::from_str(&attention.body).expect("json");
    assert_eq!(body["data"]["reason"], "failing_repeatedly");
    assert_eq!(body["data"]["automation"]["id"], a.id.as_str());
    assert_eq!(body["data"]["failure_streak"], 2);
    let failed = delivered
        .iter()
        .find(|d| d.event_type() == "run.failed")
        .expect("run failed");
    let body: serde_json::Value = serde_json::from_str(&failed.body).expect("json");
    assert_eq!(body["data"]["error_code"], "provider_error");
    assert_eq!(body["data"]["state"], "failed");

    // What delivery did is visible to the owner.
    let messages = hooks.list_webhook_messages(list).await.expect("messages");
    let shown = messages.into_inner().messages;
    let retried = shown
        .iter()
        .find(|m| m.id == first)
        .expect("the retried one");
    assert_eq!(retried.attempts, attempts[&first].len() as i64);
    assert!(retried.attempts >= 2);
    let total: i64 = shown.iter().map(|m| m.attempts).sum();
    assert_eq!(total, 4);
    assert!(retried.deliver_time.is_some() && retried.next_attempt_time.is_none());

    // The secret is nowhere in the database.
    let key = secret.trim_start_matches("whsec_");
    let holding = mesh.db.tables_holding(key).await.expect("scan");
    assert!(holding.is_empty(), "the secret is stored in {holding:?}");
    mesh.stop().await.expect("stop");
}

async fn a_dead_endpoint_is_disabled_and_never_delays_another_owners(backend: Backend) {
    let options = MeshOptions {
        webhook_timeout: Duration::from_secs(1),
        webhook_first_retry: Duration::from_millis(100),
        webhook_retry_for: Duration::from_secs(3),
        ..MeshOptions::default()
    };
    let (mesh, _executor) = mesh_with(backend, Behavior::Forever, options).await;
    let dead = Receiver::start(Answer::Hang).await.expect("receiver");
    let live = Receiver::start(Answer::Status(200))
        .await
        .expect("receiver");
    let alice = mesh.token("acme", "alice");
    let bob = mesh.token("acme", "bob");
    let (dead_ep, _) = endpoint(&mesh, &alice, &dead.url).await;
    let (live_ep, _) = endpoint(&mesh, &bob, &live.url).await;
    let test = |token: &str, id: &str| {
        let mut hooks = mesh.notifications(Some(token));
        let request = pb::TestWebhookEndpointRequest { id: id.to_owned() };
        async move { hooks.test_webhook_endpoint(request).await }
    };
    let queued = test(&alice, &dead_ep.id).await.expect("test").into_inner();
    assert!(queued.message_id.starts_with("msg_"));
    wait_for(
        Duration::from_secs(30),
        "alice's endpoint to be tried",
        || async { (!dead.received().is_empty()).then_some(()) },
    )
    .await;
    // While alice's endpoint hangs, bob's message is delivered.
    let bobs = test(&bob, &live_ep.id).await.expect("test").into_inner();
    wait_for(Duration::from_secs(30), "bob's message", || async {
        live.delivered()
            .iter()
            .any(|d| d.id() == bobs.message_id)
            .then_some(())
    })
    .await;
    let first_try = dead.received()[0].at;
    let bobs_arrival = live.delivered()[0].at;
    assert!(
        dead.received().iter().all(|d| d.id() == queued.message_id),
        "only alice's message reaches her endpoint"
    );
    // Past its retry window alice's endpoint is disabled, saying why.
    let mut hooks = mesh.notifications(Some(&alice));
    let disabled = wait_for(Duration::from_secs(60), "alice's endpoint disabled", || {
        let mut hooks = hooks.clone();
        async move {
            let listed = hooks.list_webhook_endpoints(pb::ListWebhookEndpointsRequest {});
            let listed = listed.await.ok()?.into_inner().endpoints;
            listed.into_iter().find(|e| e.disable_time.is_some())
        }
    })
    .await;
    assert!(
        disabled.disabled_reason.contains(&queued.message_id)
            && disabled.disabled_reason.contains("timed out"),
        "{}",
        disabled.disabled_reason
    );
    assert!(dead.received().len() >= 2, "retried before giving up");
    assert!(bobs_arrival > first_try);
    let refused = test(&alice, &dead_ep.id).await.expect_err("disabled");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    // Bob's endpoint is untouched.
    let bobs_list = mesh.notifications(Some(&bob));
    let listed = bobs_list
        .clone()
        .list_webhook_endpoints(pb::ListWebhookEndpointsRequest {})
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.endpoints.len(), 1);
    assert_eq!(listed.endpoints[0].disable_time, None);
    // Deleting the endpoint is the owner's; another's is not found.
    let delete = |id: &str| pb::DeleteWebhookEndpointRequest { id: id.to_owned() };
    let theirs = bobs_list
        .clone()
        .delete_webhook_endpoint(delete(&dead_ep.id))
        .await
        .expect_err("not bob's");
    let unknown = bobs_list
        .clone()
        .delete_webhook_endpoint(delete("ep_0000"))
        .await
        .expect_err("unknown");
    assert_eq!(theirs.code(), tonic::Code::NotFound);
    assert_eq!(
        (theirs.code(), theirs.message()),
        (unknown.code(), unknown.message())
    );
    hooks
        .delete_webhook_endpoint(delete(&dead_ep.id))
        .await
        .expect("delete");
    mesh.stop().await.expect("stop");
}

on_both_backends!(
    failures_reach_the_owners_endpoint_signed_retried_and_once_per_streak,
    a_dead_endpoint_is_disabled_and_never_delays_another_owners,
);

/// Bad endpoints are refused by name, whatever the backend; with the
/// operator's defaults (https only, public addresses only) too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_endpoints_are_refused_by_name() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut hooks = mesh.notifications(Some(&token));
    for (url, why) in [
        ("", "required"),
        ("hooks.example.com/automesh", "absolute"),
        ("ftp://hooks.example.com/automesh", "https"),
        (
            "https://ops:hunter2@hooks.example.com/automesh",
            "credentials",
        ),
        ("https://hooks.example.com/automesh?token=abc", "secret"),
        ("https://hooks.example.com/automesh?Signature=abc", "secret"),
    ] {
        let request = pb::CreateWebhookEndpointRequest {
            url: url.to_owned(),
            description: String::new(),
        };
        let refused = hooks.create_webhook_endpoint(request).await.expect_err(url);
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{url}");
        assert!(
            refused.message().contains("url") && refused.message().contains(why),
            "{url}: {}",
            refused.message()
        );
    }
    let unauthenticated = mesh
        .notifications(None)
        .list_webhook_endpoints(pb::ListWebhookEndpointsRequest {})
        .await
        .expect_err("signed in only");
    assert_eq!(unauthenticated.code(), tonic::Code::Unauthenticated);
    mesh.stop().await.expect("stop");
}
