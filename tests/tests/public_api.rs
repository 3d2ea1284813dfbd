//! The public API end to end: the whole mesh over real gRPC on loopback, on
//! SQLite and on PostgreSQL.

use std::time::Duration;

use automesh_domain::Principal;
use automesh_e2e_tests::RunsApi;
use automesh_e2e_tests::{Api, Mesh, on_both_backends, wait_for_health};
use automesh_edge::status::field_violations;
use automesh_proto::v1 as pb;
use automesh_store::Backend;
use chrono::Utc;
use tonic::Code;

fn daily(hours: i32, minutes: i32, zone: &str) -> pb::Schedule {
    pb::Schedule {
        kind: Some(pb::schedule::Kind::Daily(pb::DailySchedule {
            time_of_day: Some(pb::TimeOfDay { hours, minutes }),
            time_zone: zone.into(),
        })),
    }
}

fn automation(name: &str, model: &str, schedule: pb::Schedule) -> pb::Automation {
    pb::Automation {
        name: name.into(),
        prompt: "summarise my inbox".into(),
        model: model.into(),
        schedule: Some(schedule),
        ..Default::default()
    }
}

fn create_req(a: pb::Automation, surface: pb::Surface) -> pb::CreateAutomationRequest {
    pb::CreateAutomationRequest {
        automation: Some(a),
        surface: surface as i32,
    }
}

/// Everything the bad-input table must leave untouched.
async fn snapshot(mesh: &Mesh) -> Vec<String> {
    use sqlx::Row;
    let mut rows = vec![];
    for sql in [
        "SELECT id || '|' || version || '|' || name || '|' || prompt || '|' || model || '|' || placement || '|' || state || '|' || schedule AS r FROM automations ORDER BY id",
        "SELECT id || '|' || state AS r FROM runs ORDER BY id",
        "SELECT id AS r FROM runners ORDER BY id",
    ] {
        for row in sqlx::query(sql)
            .fetch_all(mesh.store().pool())
            .await
            .expect("snapshot")
        {
            rows.push(row.try_get::<String, _>("r").expect("text"));
        }
    }
    rows
}

#[track_caller]
fn expect_field(result: Result<impl std::fmt::Debug, tonic::Status>, code: Code, field: &str) {
    let status = result.expect_err("the request must fail");
    assert_eq!(status.code(), code, "{status:?}");
    if !field.is_empty() {
        let fields: Vec<String> = field_violations(&status)
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert!(
            fields.iter().any(|f| f == field),
            "expected a violation of {field}, got {fields:?} ({})",
            status.message()
        );
    }
}

/// A table of bad-input cases, each named by its number and the answer it
/// expects (code and field); every case runs before the test fails.
#[derive(Default)]
struct Cases {
    ran: usize,
    failed: Vec<String>,
}

impl Cases {
    /// Case `self.ran + 1`: `result` must fail with `code`, naming `field`
    /// (unless empty) among its violations.
    fn check(
        &mut self,
        result: Result<impl std::fmt::Debug, tonic::Status>,
        code: Code,
        field: &str,
    ) {
        self.ran += 1;
        let name = format!("case {} ({code:?} {field})", self.ran);
        let status = match result {
            Ok(ok) => {
                self.failed.push(format!("{name}: succeeded: {ok:?}"));
                return;
            }
            Err(status) => status,
        };
        if status.code() != code {
            self.failed.push(format!("{name}: answered {status:?}"));
            return;
        }
        if !field.is_empty() {
            let fields: Vec<String> = field_violations(&status)
                .into_iter()
                .map(|(f, _)| f)
                .collect();
            if !fields.iter().any(|f| f == field) {
                self.failed.push(format!(
                    "{name}: violations {fields:?} ({})",
                    status.message()
                ));
            }
        }
    }

    fn all_answered(&self) {
        assert!(
            self.failed.is_empty(),
            "{} of {} bad-input cases got the wrong answer:\n{}",
            self.failed.len(),
            self.ran,
            self.failed.join("\n")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_sees_the_public_api() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let names = automesh_e2e_tests::reflected_services(&mesh.gateway).await;
    assert_eq!(
        names,
        [
            "automesh.v1.Automations",
            "automesh.v1.Notifications",
            "automesh.v1.Runs",
            "grpc.health.v1.Health"
        ]
    );
    mesh.stop().await.expect("stop");
}

async fn automation_lifecycle(backend: Backend) {
    let mesh = Mesh::start(backend).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));

    let mut ids = vec![];
    for i in 0..3 {
        let a = api
            .create(create_req(
                automation(&format!("a{i}"), "fake/echo", daily(9, 30, "Europe/Paris")),
                pb::Surface::Desktop,
            ))
            .await;
        assert_eq!(a.placement, pb::Placement::Desktop as i32);
        assert_eq!(a.state, pb::AutomationState::Active as i32);
        assert_eq!(a.organization_id, "acme");
        assert_eq!(a.owner_id, "alice");
        assert!(a.next_run_time.is_some());
        ids.push(a.id);
    }

    // Paging: one at a time, newest first, no gaps or repeats.
    let mut seen = vec![];
    let mut page_token = String::new();
    loop {
        let page = api
            .list_automations(pb::ListAutomationsRequest {
                page_size: 1,
                page_token,
                show_archived: false,
            })
            .await
            .expect("list")
            .into_inner();
        seen.extend(page.automations.into_iter().map(|a| a.id));
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    assert_eq!(seen, ids.iter().rev().cloned().collect::<Vec<_>>());

    // Update with the current etag; the etag moves on.
    let current = api
        .get_automation(pb::GetAutomationRequest { id: ids[0].clone() })
        .await
        .expect("get")
        .into_inner()
        .automation
        .expect("automation");
    let updated = api
        .update_automation(pb::UpdateAutomationRequest {
            automation: Some(pb::Automation {
                id: ids[0].clone(),
                name: "renamed".into(),
                etag: current.etag.clone(),
                schedule: Some(daily(6, 0, "America/New_York")),
                ..Default::default()
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["name".into(), "schedule".into()],
            }),
        })
        .await
        .expect("update")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(updated.name, "renamed");
    assert_eq!(
        updated.prompt, current.prompt,
        "fields outside the mask stay"
    );
    assert_ne!(updated.etag, current.etag);
    assert_ne!(updated.next_run_time, current.next_run_time);
    assert_eq!(updated.placement, current.placement);

    // Deactivate clears the next occurrence; activate brings it back.
    let off = api
        .deactivate_automation(pb::DeactivateAutomationRequest {
            id: ids[0].clone(),
            etag: updated.etag.clone(),
            reason: String::new(),
        })
        .await
        .expect("deactivate")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(off.state, pb::AutomationState::Inactive as i32);
    assert!(off.next_run_time.is_none());
    let on = api
        .activate_automation(pb::ActivateAutomationRequest {
            id: ids[0].clone(),
            etag: String::new(),
        })
        .await
        .expect("activate")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(on.state, pb::AutomationState::Active as i32);
    assert!(on.next_run_time.is_some());

    // A run-now made before the archive stays its key's answer after it.
    let made = api.run_now(&ids[1], "before").await;

    // Archive: kept, hidden by default, and frozen.
    let archived = api
        .archive_automation(pb::ArchiveAutomationRequest {
            id: ids[1].clone(),
            etag: String::new(),
        })
        .await
        .expect("archive")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(archived.state, pb::AutomationState::Archived as i32);
    let visible = api
        .list_automations(pb::ListAutomationsRequest {
            page_size: 10,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(visible.automations.len(), 2);
    let all = api
        .list_automations(pb::ListAutomationsRequest {
            page_size: 10,
            show_archived: true,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(all.automations.len(), 3);
    expect_field(
        api.activate_automation(pb::ActivateAutomationRequest {
            id: ids[1].clone(),
            etag: String::new(),
        })
        .await,
        Code::FailedPrecondition,
        "",
    );
    expect_field(
        api.run_automation_now(pb::RunAutomationNowRequest {
            id: ids[1].clone(),
            idempotency_key: "k".into(),
        })
        .await,
        Code::FailedPrecondition,
        "",
    );
    let again = api.run_now(&ids[1], "before").await;
    assert_eq!(again.id, made.id, "the same run, not a second");
    mesh.stop().await.expect("stop");
}

async fn bad_input_changes_nothing(backend: Backend) {
    let mesh = Mesh::start(backend).await.expect("mesh");
    // Every case runs; the test fails at the end naming each case that
    // did not get its answer, so one failure does not hide the rest.
    let mut cases = Cases::default();
    let alice_token = mesh.token("acme", "alice");
    let mut alice = mesh.automations(Some(&alice_token));
    mesh.store()
        .register_worker(
            &Principal::new("acme", "alice"),
            "local-process",
            Utc::now(),
        )
        .await
        .expect("worker");
    mesh.store()
        .register_worker(
            &Principal::new("other", "carol"),
            "local-process",
            Utc::now(),
        )
        .await
        .expect("worker");

    // Data the table must not touch: a desktop and a cloud automation, at v2.
    let desktop = alice
        .create_automation(create_req(
            automation("desk", "fake/echo", daily(8, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await
        .expect("create desktop")
        .into_inner()
        .automation
        .expect("automation");
    let cloud = alice
        .create_automation(create_req(
            automation("cloud", "restricted/acme-only", daily(8, 0, "UTC")),
            pb::Surface::Web,
        ))
        .await
        .expect("create cloud (alice has a worker, acme may use the model)")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(cloud.placement, pb::Placement::Cloud as i32);
    let v2 = alice
        .update_automation(pb::UpdateAutomationRequest {
            automation: Some(pb::Automation {
                id: desktop.id.clone(),
                prompt: "new prompt".into(),
                ..Default::default()
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["prompt".into()],
            }),
        })
        .await
        .expect("update")
        .into_inner()
        .automation
        .expect("automation");
    let run = alice.run_now(&desktop.id, "setup").await;

    let before = snapshot(&mesh).await;
    let past = prost_types::Timestamp {
        seconds: Utc::now().timestamp() - 60,
        nanos: 0,
    };
    let weekly_no_days = pb::Schedule {
        kind: Some(pb::schedule::Kind::Weekly(pb::WeeklySchedule {
            days: vec![],
            time_of_day: Some(pb::TimeOfDay {
                hours: 9,
                minutes: 0,
            }),
            time_zone: "Europe/London".into(),
        })),
    };
    let once_past = pb::Schedule {
        kind: Some(pb::schedule::Kind::Once(pb::OnceSchedule {
            at: Some(past),
        })),
    };
    let create = |a: pb::Automation, s: pb::Surface| create_req(a, s);

    // Schedules.
    cases.check(
        alice
            .create_automation(create(
                automation("x", "fake/echo", daily(9, 0, "Mars/Olympus_Mons")),
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.schedule.daily.time_zone",
    );
    cases.check(
        alice
            .create_automation(create(
                automation("x", "fake/echo", daily(24, 0, "UTC")),
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.schedule.daily.time_of_day",
    );
    cases.check(
        alice
            .create_automation(create(
                automation("x", "fake/echo", weekly_no_days),
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.schedule.weekly.days",
    );
    cases.check(
        alice
            .create_automation(create(
                automation("x", "fake/echo", once_past),
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.schedule.once.at",
    );
    cases.check(
        alice
            .create_automation(create(
                pb::Automation {
                    schedule: None,
                    ..automation("x", "fake/echo", daily(9, 0, "UTC"))
                },
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.schedule",
    );
    // Text fields and the model.
    cases.check(
        alice
            .create_automation(create(
                pb::Automation {
                    prompt: "  ".into(),
                    ..automation("x", "fake/echo", daily(9, 0, "UTC"))
                },
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.prompt",
    );
    cases.check(
        alice
            .create_automation(create(
                pb::Automation {
                    prompt: "p".repeat(40 * 1024),
                    ..automation("x", "fake/echo", daily(9, 0, "UTC"))
                },
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.prompt",
    );
    cases.check(
        alice
            .create_automation(create(
                automation("", "fake/echo", daily(9, 0, "UTC")),
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.name",
    );
    cases.check(
        alice
            .create_automation(create(
                automation("x", "nobody/knows", daily(9, 0, "UTC")),
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.model",
    );
    // Placement belongs to the surface, and never changes.
    cases.check(
        alice
            .create_automation(create_req(
                automation("x", "fake/echo", daily(9, 0, "UTC")),
                pb::Surface::Unspecified,
            ))
            .await,
        Code::InvalidArgument,
        "surface",
    );
    cases.check(
        alice
            .create_automation(create(
                pb::Automation {
                    placement: pb::Placement::Cloud as i32,
                    ..automation("x", "fake/echo", daily(9, 0, "UTC"))
                },
                pb::Surface::Desktop,
            ))
            .await,
        Code::InvalidArgument,
        "automation.placement",
    );
    cases.check(
        alice
            .update_automation(pb::UpdateAutomationRequest {
                automation: Some(pb::Automation {
                    id: desktop.id.clone(),
                    placement: pb::Placement::Cloud as i32,
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["placement".into()],
                }),
            })
            .await,
        Code::InvalidArgument,
        "update_mask",
    );
    cases.check(
        alice
            .update_automation(pb::UpdateAutomationRequest {
                automation: Some(pb::Automation {
                    id: desktop.id.clone(),
                    name: "moved".into(),
                    placement: pb::Placement::Cloud as i32,
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["name".into()],
                }),
            })
            .await,
        Code::InvalidArgument,
        "automation.placement",
    );
    // Concurrency.
    cases.check(
        alice
            .update_automation(pb::UpdateAutomationRequest {
                automation: Some(pb::Automation {
                    id: desktop.id.clone(),
                    name: "stale".into(),
                    etag: desktop.etag.clone(),
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["name".into()],
                }),
            })
            .await,
        Code::Aborted,
        "",
    );
    cases.check(
        alice
            .deactivate_automation(pb::DeactivateAutomationRequest {
                id: desktop.id.clone(),
                etag: desktop.etag.clone(),
                reason: String::new(),
            })
            .await,
        Code::Aborted,
        "",
    );
    cases.check(
        alice
            .update_automation(pb::UpdateAutomationRequest {
                automation: Some(pb::Automation {
                    id: desktop.id.clone(),
                    name: "x".into(),
                    etag: "garbage".into(),
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["name".into()],
                }),
            })
            .await,
        Code::InvalidArgument,
        "automation.etag",
    );
    // Creation rules for cloud automations.
    let bob_token = mesh.token("acme", "bob");
    cases.check(
        mesh.automations(Some(&bob_token))
            .create_automation(create(
                automation("x", "fake/echo", daily(9, 0, "UTC")),
                pb::Surface::Web,
            ))
            .await,
        Code::FailedPrecondition,
        "",
    );
    let carol_token = mesh.token("other", "carol");
    cases.check(
        mesh.automations(Some(&carol_token))
            .create_automation(create(
                automation("x", "restricted/acme-only", daily(9, 0, "UTC")),
                pb::Surface::CloudChat,
            ))
            .await,
        Code::FailedPrecondition,
        "",
    );
    // Paging and run-now input.
    cases.check(
        alice
            .list_automations(pb::ListAutomationsRequest {
                page_size: -1,
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "page_size",
    );
    cases.check(
        alice
            .list_automations(pb::ListAutomationsRequest {
                page_token: "forged".into(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "page_token",
    );
    cases.check(
        alice
            .run_automation_now(pb::RunAutomationNowRequest {
                id: desktop.id.clone(),
                idempotency_key: String::new(),
            })
            .await,
        Code::InvalidArgument,
        "idempotency_key",
    );
    // Authentication.
    cases.check(
        mesh.automations(None)
            .list_automations(pb::ListAutomationsRequest::default())
            .await,
        Code::Unauthenticated,
        "",
    );
    let forged = automesh_gateway::mint(
        b"another-key-that-is-long-enough-!!",
        "acme",
        "alice",
        chrono::Duration::hours(1),
    )
    .expect("mint");
    cases.check(
        mesh.automations(Some(&forged))
            .create_automation(create(
                automation("x", "fake/echo", daily(9, 0, "UTC")),
                pb::Surface::Desktop,
            ))
            .await,
        Code::Unauthenticated,
        "",
    );
    cases.check(
        mesh.automations(Some("not-a-jwt"))
            .get_automation(pb::GetAutomationRequest {
                id: desktop.id.clone(),
            })
            .await,
        Code::Unauthenticated,
        "",
    );
    // Another tenant's objects are not found, whatever the call.
    for token in [
        mesh.token("evil", "mallory"),
        mesh.token("other", "alice"),
        mesh.token("acme", "bob"),
    ] {
        let mut api = mesh.automations(Some(&token));
        cases.check(
            api.get_automation(pb::GetAutomationRequest {
                id: desktop.id.clone(),
            })
            .await,
            Code::NotFound,
            "",
        );
        cases.check(
            api.update_automation(pb::UpdateAutomationRequest {
                automation: Some(pb::Automation {
                    id: desktop.id.clone(),
                    name: "stolen".into(),
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["name".into()],
                }),
            })
            .await,
            Code::NotFound,
            "",
        );
        cases.check(
            api.archive_automation(pb::ArchiveAutomationRequest {
                id: cloud.id.clone(),
                etag: String::new(),
            })
            .await,
            Code::NotFound,
            "",
        );
        cases.check(
            api.deactivate_automation(pb::DeactivateAutomationRequest {
                id: cloud.id.clone(),
                etag: String::new(),
                reason: String::new(),
            })
            .await,
            Code::NotFound,
            "",
        );
        cases.check(
            api.run_automation_now(pb::RunAutomationNowRequest {
                id: desktop.id.clone(),
                idempotency_key: "steal".into(),
            })
            .await,
            Code::NotFound,
            "",
        );
        let mut runs = mesh.runs(Some(&token));
        cases.check(
            runs.get_run(pb::GetRunRequest { id: run.id.clone() }).await,
            Code::NotFound,
            "",
        );
        cases.check(
            runs.cancel_run(pb::CancelRunRequest { id: run.id.clone() })
                .await,
            Code::NotFound,
            "",
        );
        cases.check(
            runs.list_run_events(pb::ListRunEventsRequest {
                run_id: run.id.clone(),
                ..Default::default()
            })
            .await,
            Code::NotFound,
            "",
        );
        let listed = api
            .list_automations(pb::ListAutomationsRequest::default())
            .await
            .expect("list")
            .into_inner();
        assert!(listed.automations.is_empty());
    }

    cases.all_answered();
    assert_eq!(
        snapshot(&mesh).await,
        before,
        "bad input changed stored data"
    );
    // And the data is still what alice last wrote.
    let still = alice
        .get_automation(pb::GetAutomationRequest {
            id: desktop.id.clone(),
        })
        .await
        .expect("get")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(still.etag, v2.etag);
    assert_eq!(still.placement, pb::Placement::Desktop as i32);
    mesh.stop().await.expect("stop");
}

async fn run_now_is_idempotent_and_cancellable(backend: Backend) {
    let mesh = Mesh::start(backend).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let mut runs = mesh.runs(Some(&token));
    let a = api
        .create(create_req(
            automation("a", "fake/echo", daily(9, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;
    let run_now = |key: &str| pb::RunAutomationNowRequest {
        id: a.id.clone(),
        idempotency_key: key.into(),
    };
    let first = api
        .run_automation_now(run_now("k1"))
        .await
        .expect("run")
        .into_inner()
        .run
        .expect("run");
    let again = api
        .run_automation_now(run_now("k1"))
        .await
        .expect("run")
        .into_inner()
        .run
        .expect("run");
    let other = api
        .run_automation_now(run_now("k2"))
        .await
        .expect("run")
        .into_inner()
        .run
        .expect("run");
    assert_eq!(first.id, again.id);
    assert_ne!(first.id, other.id);
    assert_eq!(first.state, pb::RunState::Pending as i32);
    assert_eq!(first.trigger, pb::RunTrigger::Manual as i32);
    assert_eq!(first.placement, pb::Placement::Desktop as i32);
    assert!(first.deadline_time.is_some());
    let listed = runs
        .list_runs(pb::ListRunsRequest {
            automation_id: a.id.clone(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.runs.len(), 2);

    let cancelled = runs.cancel(&first.id).await;
    assert_eq!(cancelled.state, pb::RunState::Cancelled as i32);
    let receipt = cancelled.receipt.expect("a terminal run has a receipt");
    assert_eq!(receipt.outcome, pb::RunState::Cancelled as i32);
    assert_eq!(receipt.placement, pb::Placement::Desktop as i32);
    // Cancelling again changes nothing; run-now with the same key returns the cancelled run.
    let twice = runs.cancel(&first.id).await;
    assert_eq!(twice.update_time, cancelled.update_time);
    let same = api
        .run_automation_now(run_now("k1"))
        .await
        .expect("run")
        .into_inner()
        .run
        .expect("run");
    assert_eq!(same.state, pb::RunState::Cancelled as i32);
    mesh.stop().await.expect("stop");
}

async fn watch_run_resumes_without_gaps_or_repeats(backend: Backend) {
    use automesh_domain::{Receipt, RunEventPayload, RunState};
    use automesh_store::events::NewEvent;
    use tokio_stream::StreamExt;

    let mesh = Mesh::start(backend).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let a = api
        .create(create_req(
            automation("a", "fake/echo", daily(9, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;
    let run = api
        .run_automation_now(pb::RunAutomationNowRequest {
            id: a.id.clone(),
            idempotency_key: "w".into(),
        })
        .await
        .expect("run")
        .into_inner()
        .run
        .expect("run");
    let event = |id: &str| NewEvent {
        event_id: id.into(),
        payload: RunEventPayload::AssistantText {
            text: format!("text {id}"),
        },
    };
    let store = mesh.store();
    store
        .append_events(
            &run.id,
            &[
                event("e1"),
                event("e2"),
                event("e3"),
                event("e4"),
                event("e5"),
            ],
            Utc::now(),
        )
        .await
        .expect("append");

    let mut stream = mesh
        .runs(Some(&token))
        .watch_run(pb::WatchRunRequest {
            run_id: run.id.clone(),
            after_sequence: 2,
        })
        .await
        .expect("watch")
        .into_inner();
    let mut sequences = vec![];
    let mut states = vec![];
    // Read what is there, then produce more while watching.
    while sequences.len() < 3 {
        match tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("bounded")
            .expect("open")
            .expect("ok")
            .update
        {
            Some(pb::watch_run_response::Update::Event(e)) => sequences.push(e.sequence),
            Some(pb::watch_run_response::Update::Run(r)) => states.push(r.state),
            None => {}
        }
    }
    // A redelivered event adds nothing; a new one arrives once.
    store
        .append_events(&run.id, &[event("e3"), event("e6")], Utc::now())
        .await
        .expect("append");
    let receipt = Receipt {
        engine: Some("test".into()),
        ..Receipt::bare(
            &run.id,
            RunState::Succeeded,
            automesh_domain::Placement::Desktop,
            Utc::now(),
        )
    };
    store
        .finish_run(&receipt, Utc::now())
        .await
        .expect("finish");
    while let Some(item) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("the stream ends after the terminal state")
    {
        match item.expect("ok").update {
            Some(pb::watch_run_response::Update::Event(e)) => sequences.push(e.sequence),
            Some(pb::watch_run_response::Update::Run(r)) => states.push(r.state),
            None => {}
        }
    }
    // 7 is the run's end, written with its receipt.
    assert_eq!(sequences, [3, 4, 5, 6, 7]);
    assert_eq!(states.first(), Some(&(pb::RunState::Pending as i32)));
    assert_eq!(states.last(), Some(&(pb::RunState::Succeeded as i32)));

    let all = mesh
        .runs(Some(&token))
        .list_run_events(pb::ListRunEventsRequest {
            run_id: run.id.clone(),
            after_sequence: 0,
            page_size: 0,
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(
        all.events.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6, 7]
    );
    assert_eq!(all.last_sequence, 7);
    mesh.stop().await.expect("stop");
}

/// Input the database cannot store, or a client cannot read back, gets the
/// same answer on both backends: INVALID_ARGUMENT naming the field, never a
/// retryable code. Limits count what the contract documents (characters).
async fn nul_and_out_of_range_input_is_invalid_on_both_backends(backend: Backend) {
    let mesh = Mesh::start(backend).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let mut runs = mesh.runs(Some(&token));
    let with = |f: &dyn Fn(&mut pb::Automation)| {
        let mut a = automation("a", "fake/echo", daily(9, 0, "UTC"));
        f(&mut a);
        create_req(a, pb::Surface::Desktop)
    };
    let once = |seconds: i64, nanos: i32| pb::Schedule {
        kind: Some(pb::schedule::Kind::Once(pb::OnceSchedule {
            at: Some(prost_types::Timestamp { seconds, nanos }),
        })),
    };
    expect_field(
        api.create_automation(with(&|a| a.name = "in\0box".into()))
            .await,
        Code::InvalidArgument,
        "automation.name",
    );
    expect_field(
        api.create_automation(with(&|a| a.prompt = "sum\0marise".into()))
            .await,
        Code::InvalidArgument,
        "automation.prompt",
    );
    // After 9999-12-31T23:59:59Z, and with nanos out of range.
    expect_field(
        api.create_automation(with(&|a| a.schedule = Some(once(253_402_300_800, 0))))
            .await,
        Code::InvalidArgument,
        "automation.schedule.once.at",
    );
    expect_field(
        api.create_automation(with(&|a| {
            a.schedule = Some(once(Utc::now().timestamp() + 3600, -1))
        }))
        .await,
        Code::InvalidArgument,
        "automation.schedule.once.at",
    );
    // Budgets per run: 0..=10^12, each named when out of range.
    for (field, bad) in [
        ("automation.max_cost_micros", -1),
        ("automation.max_tokens", 1_000_000_000_001),
    ] {
        expect_field(
            api.create_automation(with(&|a| {
                if field.ends_with("max_cost_micros") {
                    a.max_cost_micros = Some(bad);
                } else {
                    a.max_tokens = Some(bad);
                }
            }))
            .await,
            Code::InvalidArgument,
            field,
        );
    }
    let capped = api
        .create_automation(with(&|a| a.max_cost_micros = Some(2_000)))
        .await
        .expect("a budget")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(
        (capped.max_cost_micros, capped.max_tokens),
        (Some(2_000), None)
    );
    // An update naming a cap with no value removes it; unnamed, it stays.
    let update = |paths: &[&str], a: pb::Automation| pb::UpdateAutomationRequest {
        automation: Some(a),
        update_mask: Some(prost_types::FieldMask {
            paths: paths.iter().map(|p| (*p).to_owned()).collect(),
        }),
    };
    let kept = api
        .update_automation(update(
            &["max_tokens"],
            pb::Automation {
                id: capped.id.clone(),
                max_tokens: Some(10),
                ..Default::default()
            },
        ))
        .await
        .expect("set the token cap")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(
        (kept.max_cost_micros, kept.max_tokens),
        (Some(2_000), Some(10))
    );
    let cleared = api
        .update_automation(update(
            &["max_cost_micros"],
            pb::Automation {
                id: capped.id.clone(),
                ..Default::default()
            },
        ))
        .await
        .expect("remove the cost cap")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(
        (cleared.max_cost_micros, cleared.max_tokens),
        (None, Some(10))
    );
    expect_field(
        api.update_automation(update(
            &["max_tokens"],
            pb::Automation {
                id: capped.id.clone(),
                max_tokens: Some(-5),
                ..Default::default()
            },
        ))
        .await,
        Code::InvalidArgument,
        "automation.max_tokens",
    );
    // 200 Greek characters (400 bytes) are a valid name; 201 are not.
    let greek = api
        .create_automation(with(&|a| a.name = "λ".repeat(200)))
        .await
        .expect("a 200-character name")
        .into_inner()
        .automation
        .expect("automation");
    expect_field(
        api.create_automation(with(&|a| a.name = "λ".repeat(201)))
            .await,
        Code::InvalidArgument,
        "automation.name",
    );
    expect_field(
        api.run_automation_now(pb::RunAutomationNowRequest {
            id: greek.id.clone(),
            idempotency_key: "k\0".into(),
        })
        .await,
        Code::InvalidArgument,
        "idempotency_key",
    );
    api.run_automation_now(pb::RunAutomationNowRequest {
        id: greek.id.clone(),
        idempotency_key: "鍵".repeat(200),
    })
    .await
    .expect("a 200-character idempotency key");
    expect_field(
        api.get_automation(pb::GetAutomationRequest { id: "x\0".into() })
            .await,
        Code::InvalidArgument,
        "id",
    );
    expect_field(
        api.list_automations(pb::ListAutomationsRequest {
            page_token: "\0".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "page_token",
    );
    expect_field(
        api.create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: "lap\0top".into(),
        })
        .await,
        Code::InvalidArgument,
        "runner_name",
    );
    api.create_runner_token(pb::CreateRunnerTokenRequest {
        runner_name: "ノートパソコン".repeat(28),
    })
    .await
    .expect("a 196-character runner name");
    expect_field(
        runs.get_run(pb::GetRunRequest { id: "r\0".into() }).await,
        Code::InvalidArgument,
        "id",
    );
    expect_field(
        runs.list_runs(pb::ListRunsRequest {
            automation_id: "a\0".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "automation_id",
    );
    expect_field(
        runs.list_runs(pb::ListRunsRequest {
            page_token: "\0".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "page_token",
    );
    // A token whose `sub` holds U+0000 is not a token.
    let nul_sub = mesh.token("acme", "ali\0ce");
    let refused = mesh
        .automations(Some(&nul_sub))
        .list_automations(pb::ListAutomationsRequest::default())
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    // Every listing still decodes: nothing out of range was stored (the
    // Greek-named one and the capped one).
    let listed = api
        .list_automations(pb::ListAutomationsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.automations.len(), 2);
    mesh.stop().await.expect("stop");
}

/// Listings are bounded in bytes: 130 automations of 32 KiB prompts list
/// at page size 128 in pages a default client accepts, each with a token to
/// go on, and together they hold every automation once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_stay_within_a_default_clients_message_limit() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    for i in 0..130 {
        api.create_automation(create_req(
            pb::Automation {
                prompt: format!("{i:03}").repeat(32 * 1024 / 3),
                ..automation(&format!("big {i}"), "fake/echo", daily(9, 0, "UTC"))
            },
            pb::Surface::Desktop,
        ))
        .await
        .expect("create");
    }
    let mut seen = std::collections::BTreeSet::new();
    let (mut token_at, mut pages) = (String::new(), 0);
    loop {
        let page = api
            .list_automations(pb::ListAutomationsRequest {
                page_size: 128,
                page_token: token_at.clone(),
                ..Default::default()
            })
            .await
            .expect("a page within the default 4 MiB")
            .into_inner();
        pages += 1;
        assert!(page.automations.len() <= 128);
        for a in &page.automations {
            assert!(seen.insert(a.id.clone()), "listed twice: {}", a.id);
        }
        if page.next_page_token.is_empty() {
            break;
        }
        token_at = page.next_page_token;
    }
    assert_eq!(seen.len(), 130);
    assert!(pages >= 2, "130 × 32 KiB does not fit one page");
    mesh.stop().await.expect("stop");
}

/// A request that does not decode (a string that is not UTF-8) is the
/// caller's error, INVALID_ARGUMENT; one over the size limit is
/// RESOURCE_EXHAUSTED, as gRPC's status table says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_and_oversized_requests_get_the_codes_grpc_prescribes() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    // CreateAutomationRequest { automation: { name: b"\xff\xfe" } }
    let invalid_utf8 = vec![0x0a, 0x04, 0x22, 0x02, 0xff, 0xfe];
    let refused = automesh_e2e_tests::raw_unary(
        &mesh.gateway,
        "/automesh.v1.Automations/CreateAutomation",
        invalid_utf8.clone(),
        Some(&token),
    )
    .await
    .expect_err("not UTF-8");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().contains("CreateAutomationRequest"),
        "{refused:?}"
    );
    // The same on an internal service, past its credential check:
    // CreateRunnerTokenRequest { runner_name: b"\xff\xfe" }.
    let internal = automesh_e2e_tests::raw_unary(
        &mesh.runner_gateway_internal,
        "/automesh.runner.v1.RunnerTokenService/CreateRunnerToken",
        vec![0x12, 0x02, 0xff, 0xfe],
        Some(automesh_e2e_tests::INTERNAL_SECRET),
    )
    .await
    .expect_err("not UTF-8");
    assert_eq!(internal.code(), Code::InvalidArgument, "{internal:?}");
    let mut api = mesh.automations(Some(&token));
    let huge = api
        .create_automation(create_req(
            pb::Automation {
                prompt: "x".repeat(5 * 1024 * 1024),
                ..automation("big", "fake/echo", daily(9, 0, "UTC"))
            },
            pb::Surface::Desktop,
        ))
        .await
        .expect_err("over the size limit");
    assert_eq!(huge.code(), Code::ResourceExhausted, "{huge:?}");
    mesh.stop().await.expect("stop");
}

/// Activation is refused (FAILED_PRECONDITION, naming the model) while the
/// catalogue does not admit the automation's model where it runs — a cloud
/// model not authorised for the organisation, a model gone from the
/// catalogue — and allowed where it does (on the desktop a model need only
/// exist). Such automations exist when the catalogue changed after they were
/// created; they are made here in the store, as the catalogue of the time
/// admitted them.
async fn activation_needs_a_model_the_catalogue_admits(backend: Backend) {
    use automesh_domain::automation::NewAutomation;
    let mesh = Mesh::start(backend).await.expect("mesh");
    let owner = Principal::new("globex", "gina");
    let token = mesh.token(&owner.org_id, &owner.user_id);
    let mut api = mesh.automations(Some(&token));
    let cases = [
        (
            "cloud-acme-only",
            "restricted/acme-only",
            automesh_domain::Surface::Web,
            false,
        ),
        (
            "cloud-gone",
            "gone/model",
            automesh_domain::Surface::Web,
            false,
        ),
        (
            "desktop-gone",
            "gone/model",
            automesh_domain::Surface::Desktop,
            false,
        ),
        (
            "desktop-acme-only",
            "restricted/acme-only",
            automesh_domain::Surface::Desktop,
            true,
        ),
    ];
    for (id, model, surface, admitted) in cases {
        let new = NewAutomation {
            pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
            budget: Default::default(),
            monthly_budget_micros: None,
            id: id.into(),
            owner: owner.clone(),
            name: id.into(),
            prompt: "p".into(),
            model: model.into(),
            surface,
            schedule: automesh_domain::Schedule::Daily {
                time: automesh_domain::TimeOfDay::new(9, 0).expect("time"),
                zone: chrono_tz::UTC,
            },
        };
        mesh.store()
            .create_automation(&new, None, Utc::now())
            .await
            .expect("create");
        api.deactivate_automation(pb::DeactivateAutomationRequest {
            id: id.into(),
            etag: String::new(),
            reason: String::new(),
        })
        .await
        .expect("deactivate");
        let activated = api
            .activate_automation(pb::ActivateAutomationRequest {
                id: id.into(),
                etag: String::new(),
            })
            .await;
        if admitted {
            let a = activated
                .expect(id)
                .into_inner()
                .automation
                .expect("automation");
            assert_eq!(a.state, pb::AutomationState::Active as i32, "{id}");
        } else {
            let refused = activated.expect_err(id);
            assert_eq!(
                refused.code(),
                Code::FailedPrecondition,
                "{id}: {refused:?}"
            );
            assert!(refused.message().contains(model), "{id}: {refused:?}");
            let stored = mesh.store().get_automation(&owner, id).await.expect("read");
            assert_eq!(
                stored.state,
                automesh_domain::AutomationState::Inactive,
                "{id}"
            );
        }
    }
    mesh.stop().await.expect("stop");
}

async fn get_automation(
    api: &mut automesh_proto::v1::automations_client::AutomationsClient<
        automesh_e2e_tests::AuthedChannel,
    >,
    id: &str,
) -> pb::Automation {
    api.get_automation(pb::GetAutomationRequest { id: id.into() })
        .await
        .expect("get")
        .into_inner()
        .automation
        .expect("automation")
}

/// What a console page reads beyond the basics: the reason given when
/// pausing (kept while paused, cleared by activation, bounded), batch
/// pause and resume with one answer per id (another user's is NOT_FOUND),
/// each automation's last run, and usage per calendar day of a zone
/// across a DST change.
async fn pause_reasons_batches_last_runs_and_usage_per_day(backend: Backend) {
    use automesh_domain::{NewRun, Placement, Receipt, RunState, RunTrigger, Usage};
    let mesh = Mesh::start(backend).await.expect("mesh");
    let owner = Principal::new("acme", "alice");
    let token = mesh.token(&owner.org_id, &owner.user_id);
    let mut api = mesh.automations(Some(&token));
    let a = api
        .create(create_req(
            automation("paused with a reason", "fake/echo", daily(9, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;
    let b = api
        .create(create_req(
            automation("second", "fake/echo", daily(10, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;
    let eves = mesh
        .automations(Some(&mesh.token("acme", "eve")))
        .create(create_req(
            automation("eve's", "fake/echo", daily(9, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;

    // A reason is kept while paused and cleared by activation.
    let paused = api
        .deactivate_automation(pb::DeactivateAutomationRequest {
            id: a.id.clone(),
            etag: String::new(),
            reason: "on holiday until Monday".into(),
        })
        .await
        .expect("deactivate")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(paused.pause_reason, "on holiday until Monday");
    let got = get_automation(&mut api, &a.id).await;
    assert_eq!(got.pause_reason, "on holiday until Monday");
    let too_long = api
        .deactivate_automation(pb::DeactivateAutomationRequest {
            id: a.id.clone(),
            etag: String::new(),
            reason: "x".repeat(501),
        })
        .await;
    expect_field(too_long, Code::InvalidArgument, "reason");

    // Batches: one answer per id, in order; another user's id is NOT_FOUND
    // and changes nothing of theirs.
    let resumed = api
        .batch_activate_automations(pb::BatchActivateAutomationsRequest {
            ids: vec![a.id.clone(), eves.id.clone(), b.id.clone()],
        })
        .await
        .expect("batch")
        .into_inner()
        .results;
    let codes: Vec<(String, i32)> = resumed.iter().map(|r| (r.id.clone(), r.code)).collect();
    assert_eq!(
        codes,
        [
            (a.id.clone(), 0),
            (eves.id.clone(), Code::NotFound as i32),
            (b.id.clone(), 0)
        ]
    );
    let first = resumed[0].automation.as_ref().expect("automation");
    assert_eq!(first.state, pb::AutomationState::Active as i32);
    assert!(
        first.pause_reason.is_empty(),
        "activation clears the reason"
    );
    let batch_paused = api
        .batch_deactivate_automations(pb::BatchDeactivateAutomationsRequest {
            ids: vec![a.id.clone(), b.id.clone(), "no-such-automation".into()],
            reason: "cost review".into(),
        })
        .await
        .expect("batch")
        .into_inner()
        .results;
    assert_eq!(batch_paused.len(), 3);
    for r in &batch_paused[..2] {
        let paused = r.automation.as_ref().expect("changed");
        assert_eq!(paused.state, pb::AutomationState::Inactive as i32);
        assert_eq!(paused.pause_reason, "cost review");
    }
    assert_eq!(batch_paused[2].code, Code::NotFound as i32);
    let eves_now = mesh
        .store()
        .get_automation(&Principal::new("acme", "eve"), &eves.id)
        .await
        .expect("eve's");
    assert_eq!(eves_now.state, automesh_domain::AutomationState::Active);
    for (ids, field) in [
        (vec![], "ids"),
        ((0..101).map(|i| format!("id-{i}")).collect(), "ids"),
        (vec![a.id.clone(), a.id.clone()], "ids[1]"),
    ] {
        let refused = api
            .batch_activate_automations(pb::BatchActivateAutomationsRequest { ids })
            .await;
        expect_field(refused, Code::InvalidArgument, field);
    }

    // Usage: three runs around New York's spring-forward (2026-03-08 07:00 UTC).
    let stored = mesh
        .store()
        .get_automation(&owner, &a.id)
        .await
        .expect("automation");
    let at = |s: &str| s.parse::<chrono::DateTime<Utc>>().expect("instant");
    for (id, created, cost) in [
        ("usage-1", "2026-03-08T06:30:00Z", 100), // 01:30 EST on the 8th
        ("usage-2", "2026-03-08T04:30:00Z", 20),  // 23:30 EST on the 7th
        ("usage-3", "2026-03-09T03:30:00Z", 3),   // 23:30 EDT on the 8th
    ] {
        let run = NewRun {
            id: id.into(),
            automation: &stored,
            trigger: RunTrigger::Schedule,
            scheduled_for: Some(at(created)),
            idempotency_key: None,
            state: RunState::Skipped,
            error: None,
            deadline_at: at(created) + chrono::Duration::hours(1),
            traceparent: None,
        };
        mesh.store()
            .create_run(&run, at(created))
            .await
            .expect("run");
        let mut receipt = Receipt::bare(id, RunState::Skipped, Placement::Desktop, at(created));
        receipt.usage = Usage {
            input_tokens: cost * 10,
            output_tokens: cost,
            cost_micros: cost,
        };
        mesh.store()
            .insert_receipt(&receipt)
            .await
            .expect("receipt");
    }
    let mut runs = mesh.runs(Some(&token));
    let summary = |zone: &str| pb::SummarizeUsageRequest {
        automation_id: a.id.clone(),
        start_time: Some(automesh_edge::convert::timestamp(at(
            "2026-03-07T05:00:00Z",
        ))),
        end_time: Some(automesh_edge::convert::timestamp(at(
            "2026-03-10T04:00:00Z",
        ))),
        time_zone: zone.into(),
    };
    let days = |r: &pb::SummarizeUsageResponse| -> Vec<(String, i64, i64)> {
        r.days
            .iter()
            .map(|d| {
                (
                    d.date.clone(),
                    d.runs,
                    d.usage.unwrap_or_default().cost_micros,
                )
            })
            .collect()
    };
    let new_york = runs
        .summarize_usage(summary("America/New_York"))
        .await
        .expect("summary")
        .into_inner();
    assert_eq!(
        days(&new_york),
        [
            ("2026-03-07".to_owned(), 1, 20),
            ("2026-03-08".to_owned(), 2, 103),
            ("2026-03-09".to_owned(), 0, 0),
        ]
    );
    let total = new_york.total.expect("total");
    assert_eq!(
        (new_york.runs, total.cost_micros, total.input_tokens),
        (3, 123, 1230)
    );
    let utc = runs
        .summarize_usage(summary(""))
        .await
        .expect("summary")
        .into_inner();
    assert_eq!(utc.time_zone, "UTC");
    assert_eq!(
        days(&utc),
        [
            ("2026-03-07".to_owned(), 0, 0),
            ("2026-03-08".to_owned(), 2, 120),
            ("2026-03-09".to_owned(), 1, 3),
            ("2026-03-10".to_owned(), 0, 0),
        ]
    );
    let mut theirs = summary("UTC");
    theirs.automation_id = eves.id.clone();
    let refused = runs.summarize_usage(theirs).await.expect_err("not found");
    assert_eq!(refused.code(), Code::NotFound);
    for (request, field) in [
        (
            pb::SummarizeUsageRequest {
                start_time: None,
                ..summary("UTC")
            },
            "start_time",
        ),
        (
            pb::SummarizeUsageRequest {
                end_time: Some(automesh_edge::convert::timestamp(at(
                    "2027-06-01T00:00:00Z",
                ))),
                ..summary("UTC")
            },
            "end_time",
        ),
        (summary("Mars/Olympus"), "time_zone"),
    ] {
        expect_field(
            runs.summarize_usage(request).await,
            Code::InvalidArgument,
            field,
        );
    }

    // The last run: the newest, with its receipt, on Get and List.
    let got = get_automation(&mut api, &a.id).await;
    let last = got.last_run.expect("last run");
    assert_eq!(last.id, "usage-3");
    assert_eq!(
        last.receipt.and_then(|r| r.usage).map(|u| u.cost_micros),
        Some(3)
    );
    let listed = api
        .list_automations(pb::ListAutomationsRequest::default())
        .await
        .expect("list")
        .into_inner()
        .automations;
    let by_id = |id: &str| listed.iter().find(|x| x.id == id).expect("listed").clone();
    assert_eq!(
        by_id(&a.id).last_run.map(|r| r.id).as_deref(),
        Some("usage-3")
    );
    assert!(by_id(&b.id).last_run.is_none());
    mesh.stop().await.expect("stop");
}

/// Many watchers of one run, each from its own sequence, while events arrive
/// in batches larger than one read: every watcher gets every event after its
/// own sequence once, in order, and its stream ends after the run's end
/// (however many watch, one poller per coordinator reads the run).
async fn many_watchers_of_one_run_each_see_every_event_once(backend: Backend) {
    use automesh_domain::{Receipt, RunEventPayload, RunState};
    use automesh_store::events::NewEvent;
    use tokio_stream::StreamExt;

    let mesh = Mesh::start(backend).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let a = api
        .create(create_req(
            automation("watched", "fake/echo", daily(9, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;
    let run = api.run_now(&a.id, "many").await;
    let store = mesh.store();
    let burst = |from: usize| -> Vec<NewEvent> {
        (from..from + 150)
            .map(|i| NewEvent {
                event_id: format!("e{i}"),
                payload: RunEventPayload::AssistantText {
                    text: format!("text {i}"),
                },
            })
            .collect()
    };
    store
        .append_events(&run.id, &burst(0), Utc::now())
        .await
        .expect("append");
    let mut watchers = Vec::new();
    for w in 0..24i64 {
        let mut runs = mesh.runs(Some(&token));
        let run_id = run.id.clone();
        let after = (w % 6) * 40;
        watchers.push(tokio::spawn(async move {
            let mut stream = runs
                .watch_run(pb::WatchRunRequest {
                    run_id,
                    after_sequence: after,
                })
                .await
                .expect("watch")
                .into_inner();
            let mut sequences = vec![];
            let mut last_state = 0;
            while let Some(item) = tokio::time::timeout(Duration::from_secs(30), stream.next())
                .await
                .expect("bounded")
            {
                match item.expect("ok").update {
                    Some(pb::watch_run_response::Update::Event(e)) => sequences.push(e.sequence),
                    Some(pb::watch_run_response::Update::Run(r)) => last_state = r.state,
                    None => {}
                }
            }
            (after, sequences, last_state)
        }));
    }
    // More than one read's batch while they watch, then the end.
    for from in [150, 300] {
        tokio::time::sleep(Duration::from_millis(100)).await;
        store
            .append_events(&run.id, &burst(from), Utc::now())
            .await
            .expect("append");
    }
    let receipt = Receipt {
        engine: Some("test".into()),
        ..Receipt::bare(
            &run.id,
            RunState::Succeeded,
            automesh_domain::Placement::Desktop,
            Utc::now(),
        )
    };
    store
        .finish_run(&receipt, Utc::now())
        .await
        .expect("finish");
    let mut results = Vec::new();
    for watcher in watchers {
        results.push(watcher.await.expect("watcher"));
    }
    // The log as stored: the 450 events, the run's end and any status the
    // coordinator recorded meanwhile.
    let log: Vec<i64> = store
        .internal()
        .events(&run.id, 0, 10_000)
        .await
        .expect("events")
        .iter()
        .map(|e| e.sequence)
        .collect();
    assert!(log.len() > 450, "{}", log.len());
    for (after, sequences, state) in results {
        let want: Vec<i64> = log.iter().copied().filter(|s| *s > after).collect();
        let missing: Vec<_> = want.iter().filter(|s| !sequences.contains(s)).collect();
        let extra: Vec<_> = sequences.iter().filter(|s| !want.contains(s)).collect();
        assert_eq!(
            sequences, want,
            "the watcher from {after}: missing {missing:?}, extra {extra:?}"
        );
        assert_eq!(state, pb::RunState::Succeeded as i32);
    }
    mesh.stop().await.expect("stop");
}

on_both_backends!(
    many_watchers_of_one_run_each_see_every_event_once,
    pause_reasons_batches_last_runs_and_usage_per_day,
    run_history_filters_by_state_and_creation_time,
    activation_needs_a_model_the_catalogue_admits,
    nul_and_out_of_range_input_is_invalid_on_both_backends,
    automation_lifecycle,
    bad_input_changes_nothing,
    run_now_is_idempotent_and_cancellable,
    watch_run_resumes_without_gaps_or_repeats,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_follows_run_now_into_the_run() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let a = api
        .create(create_req(
            automation("a", "fake/echo", daily(9, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut request = tonic::Request::new(pb::RunAutomationNowRequest {
        id: a.id.clone(),
        idempotency_key: "traced".into(),
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01")
            .parse()
            .expect("ascii"),
    );
    let run = api
        .run_automation_now(request)
        .await
        .expect("run")
        .into_inner()
        .run
        .expect("run");
    // The client's trace crossed the gateway and the scheduler into the stored run.
    assert_eq!(run.trace_id, trace_id);
    let stored = mesh.store().internal().get_run(&run.id).await.expect("run");
    let tp = stored.traceparent.expect("stored traceparent");
    assert!(tp.starts_with(&format!("00-{trace_id}-")), "{tp}");
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_services_require_the_internal_credential() {
    use automesh_proto::scheduler::v1 as spb;
    use automesh_proto::scheduler::v1::scheduler_service_client::SchedulerServiceClient;
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let request = || spb::ListAutomationsRequest {
        caller: Some(automesh_edge::convert::caller(&Principal::new(
            "acme", "alice",
        ))),
        request: None,
    };
    let mut anonymous = SchedulerServiceClient::new(
        automesh_rpc::client::channel(&mesh.scheduler).expect("channel"),
    );
    assert_eq!(
        anonymous
            .list_automations(request())
            .await
            .expect_err("refused")
            .code(),
        Code::Unauthenticated
    );
    let wrong =
        automesh_rpc::InternalCredential::new("a-wrong-credential-of-some-length").expect("cred");
    let mut wrong = SchedulerServiceClient::new(
        automesh_rpc::internal_channel(&mesh.scheduler, &wrong).expect("channel"),
    );
    assert_eq!(
        wrong
            .list_automations(request())
            .await
            .expect_err("refused")
            .code(),
        Code::Unauthenticated
    );
    let mut right = SchedulerServiceClient::new(
        automesh_rpc::internal_channel(&mesh.scheduler, &mesh.credential).expect("channel"),
    );
    right.list_automations(request()).await.expect("accepted");
    // Even with the credential, a call must name its caller.
    let no_caller = spb::ListAutomationsRequest {
        caller: None,
        request: None,
    };
    assert_eq!(
        right
            .list_automations(no_caller)
            .await
            .expect_err("refused")
            .code(),
        Code::Unauthenticated
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_not_serving_while_the_database_is_unreachable() {
    automesh_telemetry::init_for_tests();
    // Nothing listens on port 9 (discard) on loopback here.
    let store = automesh_store::Store::connect_lazy(
        "postgres://postgres@127.0.0.1:9/nowhere",
        automesh_store::StoreOptions {
            acquire_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .expect("lazy pool");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = format!("http://{}", listener.local_addr().expect("addr"));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let credential =
        automesh_rpc::InternalCredential::new("test-internal-credential-0123").expect("cred");
    let config = automesh_scheduler::Config {
        run_deadline: Duration::from_secs(60),
        catch_up_window: Duration::from_secs(60),
        ..automesh_e2e_tests::service_config()
    };
    let scheduler = automesh_scheduler::Service::new(&config, store, credential).expect("config");
    let server = tokio::spawn(scheduler.serve(listener, shutdown.clone()));
    wait_for_health(&addr, Duration::from_secs(10), false)
        .await
        .expect("NOT_SERVING");
    // It stays so: the probe keeps failing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    wait_for_health(&addr, Duration::from_secs(1), false)
        .await
        .expect("still NOT_SERVING");
    shutdown.cancel();
    server.await.expect("join").expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_tokens_are_returned_once_and_stored_hashed() {
    use sqlx::Row;
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let minted = mesh
        .automations(Some(&token))
        .create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: "laptop".into(),
        })
        .await
        .expect("mint")
        .into_inner();
    assert!(minted.token.starts_with("amr_"));
    let hash = automesh_desktop_runner_gateway::hash_token(&minted.token);
    let runner = mesh
        .store()
        .find_runner_by_token_hash(&hash)
        .await
        .expect("find")
        .expect("runner");
    assert_eq!(runner.id, minted.runner_id);
    assert_eq!(
        (runner.org_id.as_str(), runner.owner_id.as_str()),
        ("acme", "alice")
    );
    // No column of any row holds the token itself.
    for table in ["runners", "runner_tokens"] {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT * FROM {table}")))
            .fetch_all(mesh.store().pool())
            .await
            .expect("scan");
        for row in rows {
            for i in 0..row.len() {
                if let Ok(Some(v)) = row.try_get::<Option<String>, _>(i) {
                    assert!(!v.contains(&minted.token[4..]), "{table} stores the token");
                }
            }
        }
    }
    expect_field(
        mesh.automations(Some(&token))
            .create_runner_token(pb::CreateRunnerTokenRequest {
                runner_name: " ".into(),
            })
            .await,
        Code::InvalidArgument,
        "runner_name",
    );
    mesh.stop().await.expect("stop");
}

/// `ListRuns` narrowed by state (the skipped and missed occurrences among
/// them, with their reason), by reason and by creation time; bad filters
/// are named.
async fn run_history_filters_by_state_and_creation_time(backend: Backend) {
    use automesh_domain::{ErrorCode, NewRun, RunState, RunTrigger};
    let mesh = Mesh::start(backend).await.expect("mesh");
    let owner = Principal::new("acme", "alice");
    let token = mesh.token(&owner.org_id, &owner.user_id);
    let a = mesh
        .automations(Some(&token))
        .create(create_req(
            automation("filtered", "fake/echo", daily(9, 0, "UTC")),
            pb::Surface::Desktop,
        ))
        .await;
    let manual = mesh.automations(Some(&token)).run_now(&a.id, "k").await;
    let stored = mesh
        .store()
        .get_automation(&owner, &a.id)
        .await
        .expect("automation");
    let now = Utc::now();
    for (id, state, code) in [
        ("skipped-1", RunState::Skipped, ErrorCode::PreviousRunLive),
        (
            "missed-1",
            RunState::Missed,
            ErrorCode::MissedDuringDowntime,
        ),
    ] {
        let run = NewRun {
            id: id.into(),
            automation: &stored,
            trigger: RunTrigger::Schedule,
            scheduled_for: Some(now),
            idempotency_key: None,
            state,
            error: Some((code, "not run".to_owned())),
            deadline_at: now + chrono::Duration::hours(1),
            traceparent: None,
        };
        mesh.store().create_run(&run, now).await.expect("create");
    }
    let runs = mesh.runs(Some(&token));
    let list = |req: pb::ListRunsRequest| {
        let mut runs = runs.clone();
        async move { runs.list_runs(req).await.map(|r| r.into_inner().runs) }
    };
    let not_run = list(pb::ListRunsRequest {
        automation_id: a.id.clone(),
        states: vec![pb::RunState::Skipped as i32, pb::RunState::Missed as i32],
        ..Default::default()
    })
    .await
    .expect("list");
    let mut reasons: Vec<(String, String)> = not_run
        .iter()
        .map(|r| (r.id.clone(), r.error_code.clone()))
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            ("missed-1".to_owned(), "missed_during_downtime".to_owned()),
            ("skipped-1".to_owned(), "previous_run_live".to_owned()),
        ]
    );
    let pending = list(pb::ListRunsRequest {
        states: vec![pb::RunState::Pending as i32],
        ..Default::default()
    })
    .await
    .expect("list");
    assert_eq!(
        pending.iter().map(|r| &r.id).collect::<Vec<_>>(),
        [&manual.id]
    );
    let future = list(pb::ListRunsRequest {
        created_after: Some(automesh_edge::convert::timestamp(
            now + chrono::Duration::hours(1),
        )),
        ..Default::default()
    })
    .await
    .expect("list");
    assert!(future.is_empty());
    let all = list(pb::ListRunsRequest {
        created_before: Some(automesh_edge::convert::timestamp(
            now + chrono::Duration::hours(1),
        )),
        ..Default::default()
    })
    .await
    .expect("list");
    assert_eq!(all.len(), 3);
    // By reason alone: the missed occurrence, whatever its state filter.
    let missed = list(pb::ListRunsRequest {
        error_codes: vec!["missed_during_downtime".into()],
        ..Default::default()
    })
    .await
    .expect("list");
    assert_eq!(
        missed.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["missed-1"]
    );
    for (request, field) in [
        (
            pb::ListRunsRequest {
                states: vec![99],
                ..Default::default()
            },
            "states[0]",
        ),
        (
            pb::ListRunsRequest {
                error_codes: vec!["previous_run_live".into(), "no_such_code".into()],
                ..Default::default()
            },
            "error_codes[1]",
        ),
        (
            pb::ListRunsRequest {
                created_after: Some(automesh_edge::convert::timestamp(now)),
                created_before: Some(automesh_edge::convert::timestamp(now)),
                ..Default::default()
            },
            "created_before",
        ),
    ] {
        let refused = list(request).await.expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(
            field_violations(&refused).iter().any(|(f, _)| f == field),
            "{field}: {refused:?}"
        );
    }
    mesh.stop().await.expect("stop");
}

/// `PreviewSchedule`: the next occurrences in the zone and in UTC, and the
/// first one across the zone's next offset change; bad input is named and
/// a caller without a token is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_previews_cross_the_next_dst_change() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let weekly = pb::Schedule {
        kind: Some(pb::schedule::Kind::Weekly(pb::WeeklySchedule {
            days: vec![pb::DayOfWeek::Monday as i32],
            time_of_day: Some(pb::TimeOfDay {
                hours: 9,
                minutes: 30,
            }),
            time_zone: "America/New_York".into(),
        })),
    };
    let after = chrono::DateTime::parse_from_rfc3339("2027-02-01T00:00:00Z")
        .expect("t")
        .with_timezone(&Utc);
    let preview = api
        .preview_schedule(pb::PreviewScheduleRequest {
            schedule: Some(weekly.clone()),
            count: 0,
            after_time: Some(automesh_edge::convert::timestamp(after)),
        })
        .await
        .expect("preview")
        .into_inner();
    assert_eq!(preview.time_zone, "America/New_York");
    let local: Vec<&str> = preview
        .occurrences
        .iter()
        .map(|o| o.local_time.as_str())
        .collect();
    assert_eq!(
        local,
        [
            "2027-02-01T09:30:00-05:00",
            "2027-02-08T09:30:00-05:00",
            "2027-02-15T09:30:00-05:00",
            "2027-02-22T09:30:00-05:00",
            "2027-03-01T09:30:00-05:00",
        ]
    );
    assert_eq!(preview.occurrences[0].zone_abbreviation, "EST");
    assert_eq!(preview.occurrences[0].utc_offset_seconds, -5 * 3600);
    // New York springs forward on 2027-03-14 at 07:00 UTC; the next Monday
    // 09:30 is then 13:30 UTC, not 14:30.
    let change = preview.next_offset_change_time.expect("a change");
    assert_eq!(
        automesh_edge::convert::from_timestamp(&change).map(|t| t.to_rfc3339()),
        Some("2027-03-14T07:00:00+00:00".to_owned())
    );
    let across = preview.first_after_offset_change.expect("across");
    assert_eq!(across.local_time, "2027-03-15T09:30:00-04:00");
    assert_eq!(across.zone_abbreviation, "EDT");

    let past_once = pb::Schedule {
        kind: Some(pb::schedule::Kind::Once(pb::OnceSchedule {
            at: Some(automesh_edge::convert::timestamp(
                Utc::now() - chrono::Duration::hours(1),
            )),
        })),
    };
    for (request, field) in [
        (
            pb::PreviewScheduleRequest {
                schedule: Some(weekly.clone()),
                count: 51,
                after_time: None,
            },
            "count",
        ),
        (
            pb::PreviewScheduleRequest {
                schedule: Some(past_once),
                count: 1,
                after_time: None,
            },
            "schedule.once.at",
        ),
        (
            pb::PreviewScheduleRequest {
                schedule: None,
                count: 1,
                after_time: None,
            },
            "schedule",
        ),
    ] {
        let refused = api.preview_schedule(request).await.expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(
            field_violations(&refused).iter().any(|(f, _)| f == field),
            "{field}: {refused:?}"
        );
    }
    let anonymous = mesh
        .automations(None)
        .preview_schedule(pb::PreviewScheduleRequest {
            schedule: Some(weekly),
            count: 1,
            after_time: None,
        })
        .await
        .expect_err("refused");
    assert_eq!(anonymous.code(), Code::Unauthenticated);
    mesh.stop().await.expect("stop");
}
