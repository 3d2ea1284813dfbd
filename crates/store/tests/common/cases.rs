//! The conformance cases. Each takes a migrated, empty store.

use automesh_domain::automation::{Automation, NewAutomation};
use automesh_domain::run::NewRun;
use automesh_domain::{
    ErrorCode, Placement, Principal, Receipt, RunEventPayload, RunState, RunTrigger, Schedule,
    Surface, TimeOfDay, Usage,
};
use automesh_store::Store;
use automesh_store::StoreError;
use automesh_store::cloud::WorkerMove;
use automesh_store::desktop::{Claim, RunnerReport};
use automesh_store::events::NewEvent;
use automesh_store::page::Cursor;
use automesh_store::runs::RunFilter;
use chrono::{DateTime, Duration, Utc};

fn t(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + secs, 0).expect("instant")
}

fn alice() -> Principal {
    Principal::new("org-a", "alice")
}

fn mallory() -> Principal {
    Principal::new("org-b", "mallory")
}

fn new_automation(owner: &Principal, id: &str, surface: Surface) -> NewAutomation {
    NewAutomation {
        pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
        budget: Default::default(),
        monthly_budget_micros: None,
        id: id.to_owned(),
        owner: owner.clone(),
        name: format!("automation {id}"),
        prompt: "summarise my inbox".to_owned(),
        model: "openai/gpt-4.1-mini".to_owned(),
        surface,
        schedule: Schedule::Daily {
            time: TimeOfDay::new(9, 30).expect("time"),
            zone: chrono_tz::Europe::Paris,
        },
    }
}

async fn create(store: &Store, owner: &Principal, id: &str, at: DateTime<Utc>) -> Automation {
    store
        .create_automation(
            &new_automation(owner, id, Surface::Web),
            Some(at + Duration::hours(1)),
            at,
        )
        .await
        .expect("create automation")
}

fn new_run<'a>(a: &'a Automation, id: &str) -> NewRun<'a> {
    NewRun {
        id: id.to_owned(),
        automation: a,
        trigger: RunTrigger::Manual,
        scheduled_for: None,
        idempotency_key: Some(format!("key-{id}")),
        state: RunState::Pending,
        error: None,
        deadline_at: t(3600),
        traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
    }
}

fn receipt(run_id: &str, outcome: RunState) -> Receipt {
    Receipt {
        run_id: run_id.to_owned(),
        outcome,
        error_code: None,
        error_message: None,
        placement: Placement::Cloud,
        engine: Some("test".into()),
        queued_micros: 1,
        wake_micros: 2,
        admission_micros: 3,
        execution_micros: 4,
        usage: Usage {
            input_tokens: 10,
            output_tokens: 20,
            cost_micros: 30,
        },
        worker_id: None,
        workspace_id: None,
        thread_id: None,
        message_id: None,
        created_at: t(100),
        model: Some("openai/gpt-4.1-mini".into()),
        provider_model: Some("gpt-4.1-mini".into()),
        price: Some(automesh_domain::Price {
            input_micros_per_million_tokens: 400_000,
            output_micros_per_million_tokens: 1_600_000,
        }),
        budget: automesh_domain::RunBudget {
            max_cost_micros: Some(5_000),
            max_tokens: None,
        },
    }
}

fn text_event(id: &str, text: &str) -> NewEvent {
    NewEvent {
        event_id: id.to_owned(),
        payload: RunEventPayload::AssistantText {
            text: text.to_owned(),
        },
    }
}

pub async fn migrations_are_idempotent(store: &Store) {
    assert!(store.is_migrated().await.expect("is_migrated"));
    store.migrate().await.expect("second migrate");
    store.ping().await.expect("ping");
}

pub async fn a_schema_newer_than_the_binary_is_refused_by_name(store: &Store) {
    let known = store.known_schema_version();
    assert_eq!(store.schema_version().await.expect("version"), Some(known));
    store
        .refuse_newer_schema()
        .await
        .expect("the schema it knows");
    store.check_schema().await.expect("the schema it knows");
    // An older schema (its newest migration not applied): refused by name,
    // for the migration job to run first.
    let newest = |success: bool| {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE _sqlx_migrations SET success = {success} WHERE version = {known}"
        )))
        .execute(store.pool())
    };
    newest(false).await.expect("an older schema");
    let behind = store.check_schema().await;
    assert!(
        matches!(behind, Err(StoreError::SchemaBehind { database, binary }) if database == Some(known - 1) && binary == known),
        "{behind:?}"
    );
    let message = behind.expect_err("refused").to_string();
    assert!(
        message.contains(&format!(
            "version {}, older than this binary knows ({known})",
            known - 1
        )) && message.contains("automesh migrate"),
        "{message}"
    );
    store.refuse_newer_schema().await.expect("not newer");
    newest(true).await.expect("the schema again");
    store.check_schema().await.expect("the schema it knows");
    let ahead = known + 1;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO _sqlx_migrations (version, description, installed_on, success, checksum, \
         execution_time) VALUES ({ahead}, 'from the future', CURRENT_TIMESTAMP, TRUE, \
         '\\x00', 0)"
    )))
    .execute(store.pool())
    .await
    .ok();
    // The checksum literal differs per backend: write it the other way if
    // the first did not take.
    if store.schema_version().await.expect("version") != Some(ahead) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO _sqlx_migrations (version, description, installed_on, success, \
             checksum, execution_time) VALUES ({ahead}, 'from the future', CURRENT_TIMESTAMP, \
             TRUE, x'00', 0)"
        )))
        .execute(store.pool())
        .await
        .expect("a newer migration");
    }
    assert!(!store.is_migrated().await.expect("is_migrated"));
    let refused = store.refuse_newer_schema().await;
    assert!(
        matches!(refused, Err(StoreError::SchemaAhead { database, binary }) if database == ahead && binary == known),
        "{refused:?}"
    );
    let checked = store.check_schema().await;
    assert!(
        matches!(checked, Err(StoreError::SchemaAhead { .. })),
        "{checked:?}"
    );
    let message = store
        .refuse_newer_schema()
        .await
        .expect_err("refused")
        .to_string();
    assert!(
        message.contains(&format!(
            "version {ahead}, newer than this binary knows ({known})"
        )),
        "{message}"
    );
}

pub async fn automation_round_trips(store: &Store) {
    let new = NewAutomation {
        pause_after_failures: 7,
        budget: automesh_domain::RunBudget {
            max_cost_micros: Some(1_234),
            max_tokens: None,
        },
        schedule: Schedule::Weekly {
            days: automesh_domain::WeekdaySet::new([chrono::Weekday::Tue, chrono::Weekday::Sat])
                .expect("days"),
            time: TimeOfDay::new(2, 30).expect("time"),
            zone: chrono_tz::America::New_York,
        },
        ..new_automation(&alice(), "a1", Surface::Desktop)
    };
    let created = store
        .create_automation(&new, Some(t(60)), t(0))
        .await
        .expect("create");
    assert_eq!(created.placement, Placement::Desktop);
    assert_eq!(created.surface, Surface::Desktop);
    assert_eq!(created.state, automesh_domain::AutomationState::Active);
    assert_eq!(created.version, 1);
    assert_eq!(created.schedule, new.schedule);
    assert_eq!(created.next_run_at, Some(t(60)));
    assert_eq!(created.created_at, t(0));
    assert_eq!(created.pause_after_failures, 7);
    assert_eq!(created.budget, new.budget);
    assert_eq!(created.failure_streak, Default::default());
    let got = store.get_automation(&alice(), "a1").await.expect("get");
    assert_eq!(got, created);
    // The owner's setting and a streak are written as they are given.
    let edited = Automation {
        pause_after_failures: 0,
        budget: automesh_domain::RunBudget {
            max_cost_micros: None,
            max_tokens: Some(50_000),
        },
        failure_streak: automesh_domain::FailureStreak {
            runs: 2,
            codes: vec!["provider_error".into(), "timed_out".into()],
        },
        ..created
    };
    let stored = store
        .update_automation_if_version(&edited, 1, t(1))
        .await
        .expect("update");
    assert_eq!(stored.pause_after_failures, 0);
    assert_eq!(stored.failure_streak, edited.failure_streak);
    assert_eq!(stored.budget, edited.budget);
}

pub async fn automations_are_scoped_to_their_owner(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    assert!(matches!(
        store.get_automation(&mallory(), "a1").await,
        Err(StoreError::NotFound)
    ));
    // Same user name in another organisation is another tenant.
    let other_org = Principal::new("org-b", "alice");
    assert!(matches!(
        store.get_automation(&other_org, "a1").await,
        Err(StoreError::NotFound)
    ));
    let mut hijack = a.clone();
    hijack.org_id = mallory().org_id;
    hijack.owner_id = mallory().user_id;
    hijack.name = "stolen".into();
    assert!(matches!(
        store.update_automation_if_version(&hijack, 1, t(1)).await,
        Err(StoreError::NotFound)
    ));
    let page = store
        .list_automations(&mallory(), &Cursor::start(), 10, true)
        .await
        .expect("list");
    assert!(page.items.is_empty());
    assert_eq!(store.get_automation(&alice(), "a1").await.expect("get"), a);
}

pub async fn automation_listing_pages_without_gaps(store: &Store) {
    for i in 0..5 {
        create(store, &alice(), &format!("a{i}"), t(i)).await;
    }
    // Two automations with the same creation instant still page apart.
    create(store, &alice(), "b-same", t(2)).await;
    let mut seen = vec![];
    let mut cursor = Cursor::start();
    let mut pages = 0;
    loop {
        let page = store
            .list_automations(&alice(), &cursor, 2, false)
            .await
            .expect("list");
        pages += 1;
        assert!(page.items.len() <= 2);
        seen.extend(page.items.iter().map(|a| a.id.clone()));
        match page.next {
            Some(next) => cursor = Cursor::decode(&next.encode()).expect("token"),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, ["a4", "a3", "b-same", "a2", "a1", "a0"]);

    // Archived automations are listed only on request.
    let a0 = store.get_automation(&alice(), "a0").await.expect("get");
    let archived = Automation {
        state: automesh_domain::AutomationState::Archived,
        next_run_at: None,
        ..a0
    };
    store
        .update_automation_if_version(&archived, 1, t(10))
        .await
        .expect("archive");
    let visible = store
        .list_automations(&alice(), &Cursor::start(), 100, false)
        .await
        .expect("list");
    assert_eq!(visible.items.len(), 5);
    let all = store
        .list_automations(&alice(), &Cursor::start(), 100, true)
        .await
        .expect("list");
    assert_eq!(all.items.len(), 6);
}

pub async fn stale_version_is_rejected_and_changes_nothing(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    let renamed = Automation {
        name: "renamed".into(),
        ..a.clone()
    };
    let v2 = store
        .update_automation_if_version(&renamed, 1, t(5))
        .await
        .expect("update");
    assert_eq!(v2.version, 2);
    assert_eq!(v2.name, "renamed");
    assert_eq!(v2.updated_at, t(5));
    assert_eq!(v2.created_at, t(0));

    let stale = Automation {
        name: "stale write".into(),
        ..a
    };
    match store.update_automation_if_version(&stale, 1, t(6)).await {
        Err(StoreError::VersionConflict { current }) => assert_eq!(current, 2),
        other => panic!("expected a version conflict, got {other:?}"),
    }
    assert_eq!(store.get_automation(&alice(), "a1").await.expect("get"), v2);
}

pub async fn placement_is_immutable_in_the_schema(store: &Store) {
    create(store, &alice(), "a1", t(0)).await;
    let err = sqlx::query("UPDATE automations SET placement = 'desktop' WHERE id = 'a1'")
        .execute(store.pool())
        .await
        .expect_err("the schema must refuse a placement change");
    assert!(err.to_string().contains("placement is immutable"), "{err}");
    let err = StoreError::from(err);
    assert!(matches!(err, StoreError::Invariant(_)), "{err:?}");
    assert_eq!(err.kind(), automesh_domain::FailureKind::FailedPrecondition);
    let a = store.get_automation(&alice(), "a1").await.expect("get");
    assert_eq!(a.placement, Placement::Cloud);
}

pub async fn run_creation_is_idempotent_by_id(store: &Store) {
    let mut a = create(store, &alice(), "a1", t(0)).await;
    // A run keeps the budget its automation had when it was created.
    a.budget = automesh_domain::RunBudget {
        max_cost_micros: Some(77),
        max_tokens: Some(88),
    };
    let (first, created) = store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    assert!(created);
    assert_eq!(first.budget, a.budget);
    let edited = Automation {
        prompt: "a different prompt must not overwrite".into(),
        ..a.clone()
    };
    let again = new_run(&edited, "r1");
    let (second, created) = store.create_run(&again, t(2)).await.expect("create again");
    assert!(!created);
    assert_eq!(first, second);
    assert_eq!(second.prompt, a.prompt);
    let page = store
        .list_runs(&alice(), &RunFilter::automation("a1"), &Cursor::start(), 10)
        .await
        .expect("list");
    assert_eq!(page.items.len(), 1);
}

pub async fn run_transitions_are_guarded(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    let r = store
        .transition_run("r1", RunState::Admitted, None, t(2))
        .await
        .expect("pending -> admitted");
    assert_eq!(r.state, RunState::Admitted);
    assert!(matches!(
        store
            .transition_run("r1", RunState::Waking, None, t(3))
            .await,
        Err(StoreError::IllegalTransition { .. })
    ));
    store
        .transition_run("r1", RunState::Running, None, t(3))
        .await
        .expect("admitted -> running");
    let done = store
        .transition_run(
            "r1",
            RunState::Failed,
            Some((ErrorCode::ProviderUnavailable, "provider said 401")),
            t(4),
        )
        .await
        .expect("running -> failed");
    assert_eq!(done.error_code, Some(ErrorCode::ProviderUnavailable));
    for next in [RunState::Running, RunState::Succeeded, RunState::Cancelled] {
        assert!(matches!(
            store.transition_run("r1", next, None, t(5)).await,
            Err(StoreError::IllegalTransition { .. })
        ));
    }
    assert!(matches!(
        store
            .transition_run("nope", RunState::Running, None, t(5))
            .await,
        Err(StoreError::NotFound)
    ));
    assert_eq!(
        store.internal().get_run("r1").await.expect("get").state,
        RunState::Failed
    );
}

pub async fn terminal_runs_are_final_in_the_schema(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    store
        .finish_run(&receipt("r1", RunState::Succeeded), t(2))
        .await
        .expect("finish");
    let err = sqlx::query("UPDATE runs SET state = 'running' WHERE id = 'r1'")
        .execute(store.pool())
        .await
        .expect_err("the schema must refuse to reopen a terminal run");
    assert!(err.to_string().contains("terminal"), "{err}");
    let err = StoreError::from(err);
    assert!(matches!(err, StoreError::Invariant(_)), "{err:?}");
    assert_eq!(
        store.internal().get_run("r1").await.expect("get").state,
        RunState::Succeeded
    );
}

pub async fn finish_run_writes_exactly_one_receipt(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    let mut failed = receipt("r1", RunState::TimedOut);
    failed.error_code = Some(ErrorCode::DeadlineExceeded);
    failed.error_message = Some("deadline reached".into());
    store.finish_run(&failed, t(2)).await.expect("finish");
    let run = store.internal().get_run("r1").await.expect("run");
    assert_eq!(run.state, RunState::TimedOut);
    assert_eq!(run.error_code, Some(ErrorCode::DeadlineExceeded));
    assert!(matches!(
        store
            .finish_run(&receipt("r1", RunState::Succeeded), t(3))
            .await,
        Err(StoreError::IllegalTransition { .. })
    ));
    let stored = store
        .internal()
        .receipt("r1")
        .await
        .expect("get")
        .expect("receipt");
    assert_eq!(stored, failed);
    assert!(
        store
            .internal()
            .receipt("nope")
            .await
            .expect("get")
            .is_none()
    );
}

/// The terminal state, the receipt and the terminal status event commit
/// together: a process killed right after the commit leaves a run whose log
/// shows its end, and one whose event write fails leaves the run live.
pub async fn a_run_ends_with_its_receipt_and_status_event_or_not_at_all(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    for id in ["r1", "r2"] {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
    }
    store
        .append_events("r1", &[text_event("e1", "working")], t(2))
        .await
        .expect("append");
    let mut failed = receipt("r1", RunState::Failed);
    failed.error_code = Some(ErrorCode::ProviderUnavailable);
    failed.error_message = Some("the provider kept failing".into());
    store.finish_run(&failed, t(3)).await.expect("finish");
    let events = store.internal().events("r1", 0, 100).await.expect("events");
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(
        events[1].payload,
        RunEventPayload::StatusChange {
            state: "failed".into(),
            error_code: Some("provider_unavailable".into()),
            message: Some("the provider kept failing".into()),
        }
    );
    // Recording the same end again adds nothing.
    store
        .append_events(
            "r1",
            &[automesh_store::events::status_event(
                RunState::Failed,
                Some(ErrorCode::ProviderUnavailable),
                None,
            )],
            t(4),
        )
        .await
        .expect("append");
    assert_eq!(
        store
            .internal()
            .events("r1", 0, 100)
            .await
            .expect("events")
            .len(),
        2
    );

    // A status event that cannot be written takes the whole end with it.
    let refuse = match store.backend() {
        automesh_store::Backend::Postgres => vec![
            "CREATE FUNCTION refuse_r2() RETURNS trigger AS $$ BEGIN \
             IF NEW.run_id = 'r2' THEN RAISE EXCEPTION 'refused by the test'; END IF; \
             RETURN NEW; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER refuse_r2 BEFORE INSERT ON run_events \
             FOR EACH ROW EXECUTE FUNCTION refuse_r2()",
        ],
        automesh_store::Backend::Sqlite => vec![
            "CREATE TRIGGER refuse_r2 BEFORE INSERT ON run_events WHEN NEW.run_id = 'r2' \
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        ],
    };
    for sql in refuse {
        sqlx::query(sql)
            .execute(store.pool())
            .await
            .expect("trigger");
    }
    assert!(
        store
            .finish_run(&receipt("r2", RunState::Succeeded), t(5))
            .await
            .is_err()
    );
    let r2 = store.internal().get_run("r2").await.expect("get");
    assert!(!r2.state.is_terminal(), "{r2:?}");
    assert!(store.internal().receipt("r2").await.expect("get").is_none());
}

pub async fn events_are_ordered_and_deduplicated(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    let batch = [
        text_event("e1", "one"),
        text_event("e2", "two"),
        text_event("e1", "one again, same id"),
    ];
    let appended = store
        .append_events("r1", &batch, t(2))
        .await
        .expect("append");
    assert_eq!(
        appended.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        [1, 2]
    );
    // Redelivery adds nothing.
    let again = store
        .append_events("r1", &batch, t(3))
        .await
        .expect("redeliver");
    assert!(again.is_empty());
    let more = store
        .append_events(
            "r1",
            &[text_event("e2", "dup"), text_event("e3", "three")],
            t(4),
        )
        .await
        .expect("append");
    assert_eq!(more.len(), 1);
    assert_eq!(more[0].sequence, 3);
    let all = store.internal().events("r1", 0, 100).await.expect("list");
    assert_eq!(
        all.iter()
            .map(|e| (e.sequence, e.event_id.as_str()))
            .collect::<Vec<_>>(),
        [(1, "e1"), (2, "e2"), (3, "e3")]
    );
    assert_eq!(
        all[0].payload,
        RunEventPayload::AssistantText { text: "one".into() }
    );
    let tail = store.internal().events("r1", 2, 100).await.expect("list");
    assert_eq!(tail.len(), 1);
    assert_eq!(tail[0].event_id, "e3");
    assert!(matches!(
        store.append_events("nope", &batch, t(5)).await,
        Err(StoreError::NotFound)
    ));
}

pub async fn concurrent_event_appenders_get_contiguous_sequences(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    let mut tasks = vec![];
    for producer in 0..6 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..10 {
                // Every producer also redelivers a shared id.
                let events = [
                    text_event(&format!("p{producer}-{i}"), "x"),
                    text_event(&format!("shared-{i}"), "y"),
                ];
                store
                    .append_events("r1", &events, t(2))
                    .await
                    .expect("append");
            }
        }));
    }
    for task in tasks {
        task.await.expect("producer");
    }
    let all = store.internal().events("r1", 0, 1000).await.expect("list");
    assert_eq!(all.len(), 6 * 10 + 10);
    let seqs: Vec<i64> = all.iter().map(|e| e.sequence).collect();
    assert_eq!(seqs, (1..=70).collect::<Vec<_>>());
}

/// The states of a run's status events, its log numbered 1, 2, … without
/// a gap.
async fn statuses_in_order(store: &Store, id: &str) -> Vec<String> {
    let events = store.internal().events(id, 0, 100).await.expect("events");
    let seqs: Vec<i64> = events.iter().map(|e| e.sequence).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>(), "{id}");
    events
        .iter()
        .filter_map(|e| match &e.payload {
            RunEventPayload::StatusChange { state, .. } => Some(state.clone()),
            _ => None,
        })
        .collect()
}

/// Jobs the writers of this process took beyond one per batch: grows when
/// a batch holds more than one write.
fn batched() -> u64 {
    let (batches, jobs) = automesh_store::written();
    jobs - batches
}

/// Many runs moved forward at once (one bulk statement per step of a
/// batch): each run by its own guard, with its own status event next in
/// its log, whatever the other runs of the batch do.
pub async fn many_runs_moved_at_once_each_by_its_own_guard(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    let ids: Vec<String> = (0..60).map(|i| format!("r{i:02}")).collect();
    for (i, id) in ids.iter().enumerate() {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
        match i % 3 {
            // There already: its move to admitted is skipped.
            0 => {
                store
                    .transition_run(id, RunState::Admitted, None, t(2))
                    .await
                    .expect("admit");
            }
            // Ended: it never moves again.
            1 => {
                store
                    .finish_run(&receipt(id, RunState::Succeeded), t(2))
                    .await
                    .expect("finish");
            }
            _ => {}
        }
    }
    let before = batched();
    let moves = |to: RunState, at: DateTime<Utc>| {
        let tasks: Vec<_> = ids
            .iter()
            .map(|id| {
                let (store, id) = (store.clone(), id.clone());
                tokio::spawn(async move { store.advance_run(&id, &[to], at).await })
            })
            .collect();
        async move {
            let mut moved = vec![];
            for task in tasks {
                moved.push(task.await.expect("mover").expect("advance"));
            }
            moved
        }
    };
    let admitted = moves(RunState::Admitted, t(5)).await;
    let running = moves(RunState::Running, t(6)).await;
    for (i, id) in ids.iter().enumerate() {
        let run = store.internal().get_run(id).await.expect("get");
        let statuses = statuses_in_order(store, id).await;
        match i % 3 {
            0 => {
                assert_eq!(admitted[i], Vec::<RunState>::new(), "{id}");
                assert_eq!(running[i], vec![RunState::Running], "{id}");
                assert_eq!(run.state, RunState::Running);
                assert_eq!(statuses, ["running"], "{id}");
            }
            1 => {
                assert_eq!(admitted[i], Vec::<RunState>::new(), "{id}");
                assert_eq!(running[i], Vec::<RunState>::new(), "{id}");
                assert_eq!(run.state, RunState::Succeeded);
                assert!(!statuses.contains(&"running".to_owned()), "{id}");
            }
            _ => {
                assert_eq!(admitted[i], vec![RunState::Admitted], "{id}");
                assert_eq!(running[i], vec![RunState::Running], "{id}");
                assert_eq!(run.state, RunState::Running);
                assert_eq!(run.admitted_at, Some(t(5)), "{id}");
                assert_eq!(run.started_at, Some(t(6)), "{id}");
                assert_eq!(statuses, ["admitted", "running"], "{id}");
            }
        }
    }
    // Some of them shared a batch (one bulk statement per step).
    assert!(batched() > before);

    // A report of "running" asks for admitted then running in one job:
    // step by step, each run by its own guard; a run past the first move
    // takes only the second, an ended one neither.
    let ids: Vec<String> = (0..48).map(|i| format!("s{i:02}")).collect();
    for (i, id) in ids.iter().enumerate() {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
        let before = match i % 4 {
            0 => Some(RunState::Admitted),
            1 => Some(RunState::Waking),
            2 => Some(RunState::Cancelled),
            _ => None,
        };
        if let Some(state) = before {
            store
                .transition_run(id, state, None, t(2))
                .await
                .expect("move before");
        }
    }
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| {
            let (store, id) = (store.clone(), id.clone());
            let both = [RunState::Admitted, RunState::Running];
            tokio::spawn(async move { store.advance_run(&id, &both, t(7)).await })
        })
        .collect();
    for (i, (id, task)) in ids.iter().zip(tasks).enumerate() {
        let moved = task.await.expect("mover").expect("advance");
        let run = store.internal().get_run(id).await.expect("get");
        let statuses = statuses_in_order(store, id).await;
        match i % 4 {
            0 => {
                assert_eq!(moved, [RunState::Running], "{id}");
                assert_eq!(run.admitted_at, Some(t(2)), "{id}");
                // (`transition_run` records no status event.)
                assert_eq!(statuses, ["running"], "{id}");
            }
            1 => {
                assert_eq!(moved, [RunState::Admitted, RunState::Running], "{id}");
                assert_eq!(run.admitted_at, Some(t(7)), "{id}");
                assert_eq!(statuses, ["admitted", "running"], "{id}");
            }
            2 => {
                assert_eq!(moved, Vec::<RunState>::new(), "{id}");
                assert_eq!(run.state, RunState::Cancelled, "{id}");
                continue;
            }
            _ => {
                assert_eq!(moved, [RunState::Admitted, RunState::Running], "{id}");
                assert_eq!(run.admitted_at, Some(t(7)), "{id}");
                assert_eq!(statuses, ["admitted", "running"], "{id}");
            }
        }
        assert_eq!(run.state, RunState::Running, "{id}");
        assert_eq!(run.started_at, Some(t(7)), "{id}");
    }
}

pub async fn runs_are_scoped_and_listed(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    let b = create(store, &alice(), "a2", t(0)).await;
    store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    store
        .create_run(&new_run(&b, "r2"), t(2))
        .await
        .expect("create");
    assert!(matches!(
        store.get_run(&mallory(), "r1").await,
        Err(StoreError::NotFound)
    ));
    assert_eq!(store.get_run(&alice(), "r1").await.expect("get").id, "r1");
    let all = store
        .list_runs(&alice(), &RunFilter::default(), &Cursor::start(), 10)
        .await
        .expect("list");
    assert_eq!(
        all.items.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["r2", "r1"]
    );
    let only_a = store
        .list_runs(&alice(), &RunFilter::automation("a1"), &Cursor::start(), 10)
        .await
        .expect("list");
    assert_eq!(only_a.items.len(), 1);
    let none = store
        .list_runs(&mallory(), &RunFilter::default(), &Cursor::start(), 10)
        .await
        .expect("list");
    assert!(none.items.is_empty());
}

pub async fn runs_are_filtered_by_state_and_creation_time(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    // r1 pending at t(1); r2 missed at t(2); r3 skipped at t(3); r4 timed
    // out (its state name holds an underscore, a LIKE wildcard) at t(4).
    store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    for (id, at, state, code) in [
        ("r2", 2, RunState::Missed, ErrorCode::MissedDuringDowntime),
        ("r3", 3, RunState::Skipped, ErrorCode::PreviousRunLive),
        ("r4", 4, RunState::TimedOut, ErrorCode::DeadlineExceeded),
    ] {
        let mut run = new_run(&a, id);
        run.state = state;
        run.error = Some((code, "why".into()));
        store.create_run(&run, t(at)).await.expect("create");
    }
    let ids = |filter: RunFilter<'static>| async move {
        let page = store
            .list_runs(&alice(), &filter, &Cursor::start(), 10)
            .await
            .expect("list");
        page.items.into_iter().map(|r| r.id).collect::<Vec<_>>()
    };
    let not_run = RunFilter {
        states: vec![RunState::Skipped, RunState::Missed],
        ..RunFilter::automation("a1")
    };
    assert_eq!(ids(not_run).await, ["r3", "r2"]);
    let timed_out = RunFilter {
        states: vec![RunState::TimedOut],
        ..RunFilter::default()
    };
    assert_eq!(ids(timed_out).await, ["r4"]);
    let window = RunFilter {
        created_after: Some(t(2)),
        created_before: Some(t(4)),
        ..RunFilter::default()
    };
    assert_eq!(ids(window).await, ["r3", "r2"]);
    let nothing = RunFilter {
        states: vec![RunState::Succeeded],
        ..RunFilter::default()
    };
    assert!(ids(nothing).await.is_empty());
    // By the reason a run carries: skipped and missed occurrences are
    // listed with it, never silence.
    let by_reason = RunFilter {
        error_codes: vec![ErrorCode::PreviousRunLive, ErrorCode::DeadlineExceeded],
        ..RunFilter::default()
    };
    assert_eq!(ids(by_reason).await, ["r4", "r3"]);
    let reason_and_state = RunFilter {
        states: vec![RunState::Missed],
        error_codes: vec![ErrorCode::MissedDuringDowntime],
        ..RunFilter::automation("a1")
    };
    assert_eq!(ids(reason_and_state).await, ["r2"]);
    let no_code = RunFilter {
        error_codes: vec![ErrorCode::Internal],
        ..RunFilter::default()
    };
    assert!(
        ids(no_code).await.is_empty(),
        "a run without a code matches none"
    );
}

pub async fn workers_register_once_per_owner(store: &Store) {
    assert!(store.get_worker(&alice()).await.expect("get").is_none());
    let w = store
        .register_worker(&alice(), "local-process", t(0))
        .await
        .expect("register");
    assert_eq!(w.state, automesh_domain::WorkerState::Stopped);
    let again = store
        .register_worker(&alice(), "docker", t(1))
        .await
        .expect("register again");
    assert_eq!(again, w);
    assert!(store.get_worker(&mallory()).await.expect("get").is_none());
}

pub async fn runner_tokens_resolve_until_revoked(store: &Store) {
    let r = store
        .create_runner(&alice(), "runner-1", "laptop", "hash-1", t(0))
        .await
        .expect("create");
    assert_eq!(r.name, "laptop");
    let found = store
        .find_runner_by_token_hash("hash-1")
        .await
        .expect("find")
        .expect("runner");
    assert_eq!(found.id, "runner-1");
    assert!(
        store
            .find_runner_by_token_hash("hash-2")
            .await
            .expect("find")
            .is_none()
    );
    assert!(matches!(
        store.revoke_runner(&mallory(), "runner-1", t(1)).await,
        Err(StoreError::NotFound)
    ));
    assert!(
        store
            .find_runner_by_token_hash("hash-1")
            .await
            .expect("find")
            .is_some()
    );
    store
        .revoke_runner(&alice(), "runner-1", t(2))
        .await
        .expect("revoke");
    assert!(
        store
            .find_runner_by_token_hash("hash-1")
            .await
            .expect("find")
            .is_none()
    );
    store
        .revoke_runner(&alice(), "runner-1", t(3))
        .await
        .expect("revoke twice");
}

pub async fn invalid_page_token_is_rejected(store: &Store) {
    assert!(matches!(
        Cursor::decode("not a token"),
        Err(StoreError::InvalidPageToken)
    ));
    let page = store
        .list_automations(&alice(), &Cursor::start(), 10, false)
        .await
        .expect("empty list");
    assert!(page.items.is_empty());
    assert!(page.next.is_none());
}

pub async fn desktop_assignments_are_claimed_by_one_runner_and_reported_only_by_it(store: &Store) {
    use automesh_store::desktop::DesktopPhase;
    let now = t(0);
    // Each runner has one stream; a claim names it.
    for (runner, stream) in [("runner-a", "sa"), ("runner-b", "sb")] {
        store
            .open_runner_stream(runner, stream, "g1", now)
            .await
            .expect("stream");
    }
    let stream_of = |runner: &str| if runner == "runner-a" { "sa" } else { "sb" };
    assert!(
        store
            .offer_desktop_run("run-d1", "org-a", "alice", b"\x00spec\xff", now)
            .await
            .expect("offer")
    );
    assert!(
        !store
            .offer_desktop_run("run-d1", "org-a", "alice", b"other", now)
            .await
            .expect("again"),
        "offered once"
    );
    assert_eq!(
        store
            .unclaimed_desktop_runs(10)
            .await
            .expect("unclaimed")
            .len(),
        1
    );
    // Two replicas race to claim for two runners: one wins.
    let (a, b) = tokio::join!(
        store.desktop_claim(Claim::Take, "run-d1", "runner-a", "sa", now),
        store.desktop_claim(Claim::Take, "run-d1", "runner-b", "sb", now)
    );
    let (a, b) = (a.expect("a"), b.expect("b"));
    assert!(a.is_some() ^ b.is_some(), "exactly one claim wins");
    // The winner has the assignment as claimed: its spec, its runner.
    let won = a.or(b).expect("one won");
    assert_eq!(won.run_id, "run-d1");
    assert_eq!(won.spec, b"\x00spec\xff");
    assert!(won.runner_id.is_some());
    let held = store
        .desktop_run("run-d1")
        .await
        .expect("read")
        .expect("offered");
    let winner = held.runner_id.clone().expect("claimed");
    let loser = if winner == "runner-a" {
        "runner-b"
    } else {
        "runner-a"
    };
    assert_eq!(
        held.spec, b"\x00spec\xff",
        "the spec round-trips byte for byte"
    );
    assert!(
        store
            .unclaimed_desktop_runs(10)
            .await
            .expect("unclaimed")
            .is_empty()
    );
    // Only the claiming runner's reports count.
    assert!(
        !store
            .desktop_report(
                RunnerReport::Accepted,
                "run-d1",
                loser,
                stream_of(loser),
                now
            )
            .await
            .expect("loser")
    );
    assert!(
        store
            .desktop_report(
                RunnerReport::Accepted,
                "run-d1",
                &winner,
                stream_of(&winner),
                now
            )
            .await
            .expect("winner")
    );
    let events = vec![
        ("e1".to_owned(), b"one".to_vec()),
        ("e2".to_owned(), b"two".to_vec()),
    ];
    assert_eq!(
        store
            .append_desktop_events("run-d1", loser, stream_of(loser), &events, now)
            .await
            .expect("loser"),
        0
    );
    assert_eq!(
        store
            .append_desktop_events("run-d1", &winner, stream_of(&winner), &events, now)
            .await
            .expect("w"),
        2
    );
    assert_eq!(
        store
            .append_desktop_events("run-d1", &winner, stream_of(&winner), &events, now)
            .await
            .expect("again"),
        0,
        "redelivery adds nothing"
    );
    let read = store
        .desktop_events_after("run-d1", 0, 10)
        .await
        .expect("events");
    assert_eq!(
        read.iter().map(|e| e.sequence).collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(
        store
            .desktop_events_after("run-d1", 1, 10)
            .await
            .expect("after")
            .len(),
        1
    );
    // Accepted runs are not given back when the stream ends.
    assert_eq!(
        store
            .release_unaccepted_desktop_runs(&winner, stream_of(&winner), now)
            .await
            .expect("release"),
        0
    );
    assert!(
        store
            .desktop_report(
                RunnerReport::Finished(b"outcome"),
                "run-d1",
                &winner,
                stream_of(&winner),
                now
            )
            .await
            .expect("finish")
    );
    assert!(
        !store
            .desktop_report(
                RunnerReport::Finished(b"twice"),
                "run-d1",
                &winner,
                stream_of(&winner),
                now
            )
            .await
            .expect("twice")
    );
    let done = store
        .desktop_run("run-d1")
        .await
        .expect("read")
        .expect("offered");
    assert_eq!(
        (done.phase, done.idle, done.outcome.as_deref()),
        (DesktopPhase::Finished, true, Some(&b"outcome"[..]))
    );

    // A run no runner holds is idle as soon as it is cancelled, and can no
    // longer be claimed.
    assert!(
        store
            .offer_desktop_run("run-d2", "org-a", "alice", b"s", now)
            .await
            .expect("offer")
    );
    let cancelled = store
        .cancel_desktop_run("run-d2", "user", now)
        .await
        .expect("cancel")
        .expect("known");
    assert!(cancelled.cancel_requested && cancelled.idle);
    assert!(
        store
            .desktop_claim(Claim::Take, "run-d2", "runner-a", "sa", now)
            .await
            .expect("claim")
            .is_none()
    );
    // A claimed, unaccepted run is given back.
    assert!(
        store
            .offer_desktop_run("run-d3", "org-a", "alice", b"s", now)
            .await
            .expect("offer")
    );
    assert!(
        store
            .desktop_claim(Claim::Take, "run-d3", "runner-a", "sa", now)
            .await
            .expect("claim")
            .is_some()
    );
    assert_eq!(
        store
            .release_unaccepted_desktop_runs("runner-a", "sa", now)
            .await
            .expect("release"),
        1
    );
    assert!(
        store
            .desktop_run("run-d3")
            .await
            .expect("read")
            .expect("offered")
            .runner_id
            .is_none()
    );
    assert_eq!(
        store
            .purge_finished_desktop_runs(t(1))
            .await
            .expect("purge"),
        1
    );
    assert!(store.desktop_run("run-d1").await.expect("read").is_none());
    assert!(
        store
            .desktop_events_after("run-d1", 0, 10)
            .await
            .expect("events")
            .is_empty()
    );
}

/// U+0000 cannot be stored in PostgreSQL text, so no backend stores it: both
/// refuse it the same way, as `Refused` (never `Database`, which services
/// answer UNAVAILABLE and clients retry), and nothing is written. A lookup
/// by such an id is never a database failure either.
pub async fn text_no_backend_can_store_is_refused_alike_and_never_as_retryable(store: &Store) {
    let now = t(0);
    for (field, mutate) in [
        (
            "name",
            (|a: &mut NewAutomation| a.name = "in\0box".into()) as fn(&mut NewAutomation),
        ),
        ("prompt", |a| a.prompt = "sum\0marise".into()),
        ("model", |a| a.model = "openai/\0".into()),
        ("id", |a| a.id = "a\0".into()),
    ] {
        let mut new = new_automation(&alice(), "nul", Surface::Web);
        mutate(&mut new);
        match store.create_automation(&new, None, now).await {
            Err(StoreError::Refused(why)) => assert!(why.contains(field), "{field}: {why}"),
            other => panic!("{field}: expected Refused, got {other:?}"),
        }
    }
    assert!(
        store
            .list_automations(&alice(), &Cursor::start(), 100, true)
            .await
            .expect("list")
            .items
            .is_empty(),
        "nothing was written"
    );
    let a = create(store, &alice(), "a1", now).await;
    let mut renamed = a.clone();
    renamed.name = "re\0named".into();
    assert!(matches!(
        store
            .update_automation_if_version(&renamed, a.version, now)
            .await,
        Err(StoreError::Refused(_))
    ));
    assert!(matches!(
        store
            .create_runner(&alice(), "runner-1", "lap\0top", "hash", now)
            .await,
        Err(StoreError::Refused(_))
    ));
    // Reading by an id no row can have is "not found" or a refusal, on
    // either backend: never a database failure.
    match store.get_automation(&alice(), "a\0").await {
        Err(StoreError::NotFound | StoreError::Refused(_)) => {}
        other => panic!("expected NotFound or Refused, got {other:?}"),
    }
}

/// A runner's newest stream holds its claims, whichever replica opened it:
/// an older stream can neither claim nor report; a claim not accepted in
/// time goes back, and the runner that sat on it is passed over until it
/// opens a new stream; claims of a lost replica are given back after the
/// orphan bound.
pub async fn a_runners_newest_stream_holds_its_claims(store: &Store) {
    let now = t(0);
    store
        .open_runner_stream("rx", "s1", "g1", now)
        .await
        .expect("s1");
    store
        .open_runner_stream("ry", "y1", "g1", now)
        .await
        .expect("y1");
    for run in ["r1", "r2", "r3", "r4"] {
        store
            .offer_desktop_run(run, "org-a", "alice", b"s", now)
            .await
            .expect("offer");
    }
    assert!(
        store
            .desktop_claim(Claim::Take, "r1", "rx", "s1", now)
            .await
            .expect("claim")
            .is_some()
    );
    // A newer stream of the runner (on any replica) takes its claims over.
    store
        .open_runner_stream("rx", "s2", "g1", now)
        .await
        .expect("s2");
    let r1 = store.desktop_run("r1").await.expect("read").expect("r1");
    assert_eq!(r1.stream_id.as_deref(), Some("s2"));
    assert!(
        !store
            .desktop_report(RunnerReport::Accepted, "r1", "rx", "s1", now)
            .await
            .expect("old")
    );
    assert!(
        store
            .desktop_report(RunnerReport::Accepted, "r1", "rx", "s2", now)
            .await
            .expect("new")
    );
    // The older stream cannot claim; the newest can.
    assert!(
        store
            .desktop_claim(Claim::Take, "r2", "rx", "s1", now)
            .await
            .expect("old")
            .is_none()
    );
    assert!(
        store
            .desktop_claim(Claim::Take, "r2", "rx", "s2", now)
            .await
            .expect("new")
            .is_some()
    );
    // Accepted runs are never claimed again, not even by their runner.
    assert!(
        store
            .desktop_claim(Claim::Take, "r1", "rx", "s2", now)
            .await
            .expect("accepted")
            .is_none()
    );
    // Not accepted in time: given back, and rx is passed over for it.
    assert!(
        store
            .desktop_claim(Claim::Take, "r3", "rx", "s2", now)
            .await
            .expect("claim")
            .is_some()
    );
    assert!(
        store
            .desktop_claim(Claim::Expire, "r3", "rx", "s2", now)
            .await
            .expect("expire")
            .is_some()
    );
    assert!(
        store
            .desktop_claim(Claim::Expire, "r3", "rx", "s2", now)
            .await
            .expect("once")
            .is_none()
    );
    let r3 = store.desktop_run("r3").await.expect("read").expect("r3");
    assert_eq!(
        (r3.runner_id, r3.passed_over.as_deref()),
        (None, Some("rx"))
    );
    assert!(
        store
            .desktop_claim(Claim::Take, "r3", "rx", "s2", now)
            .await
            .expect("passed over")
            .is_none()
    );
    assert!(
        store
            .desktop_claim(Claim::Take, "r3", "ry", "y1", now)
            .await
            .expect("another runner")
            .is_some()
    );
    // An expired claim that was accepted meanwhile stays.
    assert!(
        store
            .desktop_claim(Claim::Expire, "r1", "rx", "s2", now)
            .await
            .expect("accepted")
            .is_none()
    );
    // A new stream gives the runner a fresh chance at what it sat on.
    store
        .offer_desktop_run("r5", "org-a", "alice", b"s", now)
        .await
        .expect("offer");
    assert!(
        store
            .desktop_claim(Claim::Take, "r5", "rx", "s2", now)
            .await
            .expect("claim")
            .is_some()
    );
    assert!(
        store
            .desktop_claim(Claim::Expire, "r5", "rx", "s2", now)
            .await
            .expect("expire")
            .is_some()
    );
    store
        .open_runner_stream("rx", "s3", "g1", t(5))
        .await
        .expect("s3");
    assert!(
        store
            .desktop_claim(Claim::Take, "r5", "rx", "s3", t(5))
            .await
            .expect("forgiven")
            .is_some()
    );
    let opened = store
        .runner_streams_opened_since(t(5))
        .await
        .expect("opened");
    assert_eq!(opened, vec![("rx".to_owned(), "s3".to_owned())]);
    // Claims older than the orphan bound are given back, newer ones stay.
    assert!(
        store
            .desktop_claim(Claim::Take, "r4", "ry", "y1", t(1))
            .await
            .expect("claim")
            .is_some()
    );
    let swept = store
        .expire_orphaned_desktop_claims(t(3), t(10))
        .await
        .expect("sweep");
    // r2, r3 (claimed at 0 s) and r4 (1 s); r5 (5 s) stays, r1 is accepted.
    assert_eq!(swept, 3);
    let r5 = store.desktop_run("r5").await.expect("read").expect("r5");
    assert_eq!(r5.runner_id.as_deref(), Some("rx"));
    let r1 = store.desktop_run("r1").await.expect("read").expect("r1");
    assert_eq!(r1.runner_id.as_deref(), Some("rx"));
}

/// A live run is leased to one coordinator at a time; its lease is renewed
/// only by its holder (fencing: once another coordinator took an expired
/// lease, the old holder's renewals fail); a run is claimed only by a
/// coordinator of its placement until it is orphaned; and a run gets one
/// message identity, with the first claim of a coordinator of its
/// placement, which every later claim keeps and reports as possibly
/// submitted.
pub async fn runs_are_leased_to_one_coordinator_and_fenced(store: &Store) {
    use automesh_store::leases::Renewal;
    let a = create(store, &alice(), "a1", t(0)).await;
    let (run, _) = store
        .create_run(&new_run(&a, "r1"), t(1))
        .await
        .expect("create");
    assert_eq!(run.placement, Placement::Cloud);
    let long_ago = t(-100_000);
    // A coordinator without the run's placement does not take it.
    let none = store
        .claim_runs("desk", &[Placement::Desktop], t(30), t(2), long_ago, 10)
        .await
        .expect("claim");
    assert!(none.is_empty(), "{none:?}");
    let first = store
        .claim_runs("c1", &[Placement::Cloud], t(30), t(2), long_ago, 10)
        .await
        .expect("claim");
    assert_eq!(first.len(), 1);
    assert_eq!((first[0].run.id.as_str(), first[0].claims), ("r1", 1));
    assert_eq!(first[0].run.message_id.as_deref(), Some("msg_r1"));
    assert!(!first[0].maybe_submitted, "nobody had it before");
    // Held: nobody else claims it, and only its holder renews it.
    let second = store
        .claim_runs("c2", &[Placement::Cloud], t(40), t(10), long_ago, 10)
        .await
        .expect("claim");
    assert!(second.is_empty());
    assert_eq!(
        store.renew_lease("r1", "c2", t(40)).await.expect("renew"),
        Renewal::Lost
    );
    assert_eq!(
        store.renew_lease("r1", "c1", t(60)).await.expect("renew"),
        Renewal::Held {
            cancel_requested: false
        }
    );
    // Expired: another coordinator takes it, and the old holder is fenced.
    let taken = store
        .claim_runs("c2", &[Placement::Cloud], t(120), t(61), long_ago, 10)
        .await
        .expect("claim");
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].claims, 2, "a takeover counts as a second claim");
    assert_eq!(taken[0].run.message_id.as_deref(), Some("msg_r1"));
    assert!(
        taken[0].maybe_submitted,
        "the first holder may have submitted it"
    );
    assert_eq!(
        store.renew_lease("r1", "c1", t(120)).await.expect("renew"),
        Renewal::Lost
    );
    // A cancellation request reaches the holder with its next renewal.
    assert!(
        store
            .internal()
            .request_cancel("r1", t(62))
            .await
            .expect("cancel")
    );
    assert_eq!(
        store.renew_lease("r1", "c2", t(130)).await.expect("renew"),
        Renewal::Held {
            cancel_requested: true
        }
    );
}

/// A scheduled run is claimed only from `CLAIM_AHEAD` before its instant
/// (the scheduler creates an on-time occurrence's run just ahead of it, and
/// the claiming coordinator holds it until the instant); a manual run at
/// once, and a scheduled run whose instant passed however late.
pub async fn a_scheduled_run_is_claimed_only_shortly_before_its_instant(store: &Store) {
    use automesh_store::leases::CLAIM_AHEAD;
    let a = create(store, &alice(), "a1", t(0)).await;
    let scheduled = |id: &str, at: DateTime<Utc>| NewRun {
        trigger: RunTrigger::Schedule,
        scheduled_for: Some(at),
        idempotency_key: None,
        ..new_run(&a, id)
    };
    let (soon, later) = (t(100), t(200));
    for run in [
        scheduled("soon", soon),
        scheduled("later", later),
        new_run(&a, "manual"),
    ] {
        store.create_run(&run, t(1)).await.expect("create");
    }
    let ahead = Duration::from_std(CLAIM_AHEAD).expect("ahead");
    let claim = |now: DateTime<Utc>| {
        let store = store.clone();
        async move {
            let claimed = store
                .claim_runs("c1", &[Placement::Cloud], t(100_000), now, t(-100_000), 10)
                .await
                .expect("claim");
            let mut ids: Vec<String> = claimed.into_iter().map(|c| c.run.id).collect();
            ids.sort();
            ids
        }
    };
    let just_too_early = soon - ahead - Duration::microseconds(1);
    assert_eq!(claim(just_too_early).await, ["manual"]);
    assert_eq!(
        claim(soon - ahead).await,
        ["soon"],
        "claimable from CLAIM_AHEAD before its instant"
    );
    assert!(claim(soon).await.is_empty(), "nothing else is due yet");
    assert_eq!(
        claim(later + Duration::hours(5)).await,
        ["later"],
        "an instant long passed is due"
    );
}

/// Concurrent wakes of a stopped worker start it once; a start whose holder
/// stopped renewing it is taken over after its lease, and the old holder
/// can neither renew it nor declare the worker ready.
pub async fn concurrent_wakes_start_a_worker_once(store: &Store) {
    use automesh_store::cloud::Wake;
    let worker = store
        .register_worker(&alice(), "local-process", t(0))
        .await
        .expect("worker");
    let mut wakes = tokio::task::JoinSet::new();
    for i in 0..6 {
        let (store, id) = (store.clone(), worker.id.clone());
        wakes.spawn(async move {
            let woke = store
                .wake_worker(&id, &format!("starter-{i}"), t(30), t(1))
                .await
                .expect("wake");
            (i, woke)
        });
    }
    let mut woke = wakes.join_all().await;
    woke.sort_by_key(|(i, _)| *i);
    let woke: Vec<Wake> = woke.into_iter().map(|(_, w)| w).collect();
    let starts = woke.iter().filter(|w| matches!(w, Wake::Start)).count();
    assert_eq!(starts, 1, "{woke:?}");
    assert!(
        woke.iter()
            .all(|w| matches!(w, Wake::Start | Wake::Starting)),
        "{woke:?}"
    );
    let holder = woke
        .iter()
        .position(|w| matches!(w, Wake::Start))
        .map(|i| format!("starter-{i}"))
        .expect("one start");
    assert!(
        store
            .move_worker(
                &worker.id,
                WorkerMove::RenewStart {
                    starter: &holder,
                    until: t(60)
                },
                t(0)
            )
            .await
            .expect("renew")
    );
    // The holder goes quiet; after its lease another starter takes over.
    assert!(matches!(
        store
            .wake_worker(&worker.id, "late", t(120), t(61))
            .await
            .expect("wake"),
        Wake::Start
    ));
    assert!(
        !store
            .move_worker(
                &worker.id,
                WorkerMove::RenewStart {
                    starter: &holder,
                    until: t(200)
                },
                t(0)
            )
            .await
            .expect("renew")
    );
    assert!(
        !store
            .move_worker(
                &worker.id,
                WorkerMove::Ready {
                    starter: &holder,
                    endpoint: "http://old",
                    agent_id: "agent-old"
                },
                t(62)
            )
            .await
            .expect("ready")
    );
    assert!(
        store
            .move_worker(
                &worker.id,
                WorkerMove::Ready {
                    starter: "late",
                    endpoint: "http://new",
                    agent_id: "agent-new"
                },
                t(63)
            )
            .await
            .expect("ready")
    );
    match store
        .wake_worker(&worker.id, "anyone", t(200), t(64))
        .await
        .expect("wake")
    {
        Wake::Ready { endpoint, agent_id } => {
            assert_eq!(
                (endpoint.as_str(), agent_id.as_str()),
                ("http://new", "agent-new")
            );
        }
        other => panic!("a ready worker is not started again: {other:?}"),
    }
    // A starter that stops hands its start back: another starts the worker
    // at once, not when the start's lease lapses.
    let other = store
        .register_worker(&mallory(), "local-process", t(0))
        .await
        .expect("worker");
    let first = store.wake_worker(&other.id, "s-a", t(100), t(1)).await;
    assert!(matches!(first.expect("wake"), Wake::Start));
    let second = store.wake_worker(&other.id, "s-b", t(100), t(2)).await;
    assert!(matches!(second.expect("wake"), Wake::Starting));
    let released = store.release_cloud_claims("s-a").await.expect("release");
    assert_eq!(released, (0, 1));
    let third = store.wake_worker(&other.id, "s-b", t(100), t(3)).await;
    assert!(matches!(third.expect("wake"), Wake::Start), "handed back");
}

/// Idle stop never stops a worker with a live run: the admission's dispatch
/// row holds it, whatever the worker's last use; once the run finished it
/// may stop, a wake meanwhile waits for it, and a stopped worker starts
/// afresh.
pub async fn a_worker_with_a_live_run_is_never_stopped(store: &Store) {
    use automesh_store::cloud::{Reservation, Wake};
    let worker = store
        .register_worker(&alice(), "local-process", t(0))
        .await
        .expect("worker");
    assert!(matches!(
        store
            .wake_worker(&worker.id, "s", t(30), t(1))
            .await
            .expect("wake"),
        Wake::Start
    ));
    assert!(
        store
            .move_worker(
                &worker.id,
                WorkerMove::Ready {
                    starter: "s",
                    endpoint: "http://w",
                    agent_id: "agent-1"
                },
                t(2)
            )
            .await
            .expect("ready")
    );
    let reservation = Reservation {
        run_id: "r1",
        org_id: "org-a",
        owner_id: "alice",
        worker_id: &worker.id,
        workspace_id: "ws-1",
        thread_id: "th-1",
        message_id: "msg_r1",
        spec: b"spec",
    };
    assert!(
        store
            .reserve_cloud_run(&reservation, t(3))
            .await
            .expect("reserve")
    );
    assert!(
        !store
            .reserve_cloud_run(&reservation, t(4))
            .await
            .expect("again"),
        "one reservation per run"
    );
    // Unused for a long time, but a run is live on it: not stopped.
    let later = t(10_000);
    assert_eq!(
        store
            .idle_worker_candidates(later)
            .await
            .expect("candidates"),
        vec![worker.id.clone()]
    );
    assert!(
        !store
            .move_worker(&worker.id, WorkerMove::BeginStop { cutoff: later }, later)
            .await
            .expect("stop")
    );
    assert!(
        store
            .finish_cloud_run("r1", b"done", t(5))
            .await
            .expect("finish")
    );
    assert!(
        !store
            .finish_cloud_run("r1", b"again", t(6))
            .await
            .expect("finish"),
        "an outcome is recorded once"
    );
    assert!(
        store
            .move_worker(&worker.id, WorkerMove::BeginStop { cutoff: later }, later)
            .await
            .expect("stop")
    );
    assert!(matches!(
        store
            .wake_worker(&worker.id, "w", t(20_000), later)
            .await
            .expect("wake"),
        Wake::Stopping
    ));
    assert!(
        store
            .move_worker(&worker.id, WorkerMove::Stopped, later)
            .await
            .expect("stopped")
    );
    assert!(matches!(
        store
            .wake_worker(&worker.id, "w", t(20_000), later)
            .await
            .expect("wake"),
        Wake::Start
    ));
}

/// The scheduler's firing at the due instant (read ahead without a lock,
/// one guarded bulk statement): it creates the run and advances the
/// automation only while the automation is active, unchanged since the
/// read, due at that instant and without a live run — never twice.
pub async fn an_occurrence_fires_unlocked_only_while_its_guards_hold(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    let due_at = a.next_run_at.expect("due");
    let due = store.due_by(due_at, 10).await.expect("due by");
    assert_eq!(due.len(), 1);
    assert!(!due[0].live_run);
    let read = due[0].automation.clone();
    fn scheduled<'a>(a: &'a Automation, id: &str, at: DateTime<Utc>) -> NewRun<'a> {
        NewRun {
            trigger: RunTrigger::Schedule,
            scheduled_for: Some(at),
            idempotency_key: None,
            ..new_run(a, id)
        }
    }
    // A read kept for the test's length (each fire borrows its own).
    fn leak(a: Automation) -> &'static Automation {
        Box::leak(Box::new(a))
    }
    let tomorrow = due_at + Duration::days(1);
    let next = Some(tomorrow);
    let runs = |store: &Store| {
        let store = store.clone();
        async move {
            store
                .list_runs(&alice(), &RunFilter::automation("a1"), &Cursor::start(), 10)
                .await
                .expect("list")
                .items
                .len()
        }
    };
    let fire = |run: NewRun<'static>, next: Option<DateTime<Utc>>, at: DateTime<Utc>| {
        let store = store.clone();
        async move {
            let fired = store.fire_unlocked(&[(&run, next)], at).await;
            fired.expect("fire") == [true]
        }
    };
    // Changed since the read, or due at another instant: nothing.
    let stale = Automation {
        version: read.version + 1,
        ..read.clone()
    };
    assert!(!fire(scheduled(leak(stale), "r1", due_at), next, t(2)).await);
    let elsewhen = Automation {
        next_run_at: Some(due_at - Duration::seconds(1)),
        ..read.clone()
    };
    assert!(!fire(scheduled(leak(elsewhen), "r1", due_at), next, t(2)).await);
    assert_eq!(runs(store).await, 0);
    // As read: the run, and the automation advanced (a new version).
    assert!(fire(scheduled(leak(read.clone()), "r1", due_at), next, t(2)).await);
    let advanced = store.get_automation(&alice(), "a1").await.expect("read");
    assert_eq!(advanced.next_run_at, next);
    assert_eq!(advanced.version, read.version + 1);
    assert_eq!(runs(store).await, 1);
    // The same read again: no second run.
    assert!(!fire(scheduled(leak(read.clone()), "r2", due_at), next, t(3)).await);
    assert_eq!(runs(store).await, 1);
    // A run of it is live: nothing, even with a fresh read.
    let again = store.get_automation(&alice(), "a1").await.expect("read");
    assert!(!fire(scheduled(leak(again), "r3", due_at), None, t(4)).await);
    assert_eq!(runs(store).await, 1);
}

/// A scheduling pass fires its batch's ordinary occurrences together (one
/// bulk statement per step), each exactly as alone: its run created with
/// every column, only while its automation is as read, and its automation
/// advanced to its next occurrence (or to none), a new version.
pub async fn occurrences_fired_together_each_fire_as_alone(store: &Store) {
    let a1 = create(store, &alice(), "a1", t(0)).await;
    let a2 = create(store, &alice(), "a2", t(0)).await;
    let a3 = create(store, &alice(), "a3", t(0)).await;
    let due_at = a1.next_run_at.expect("due");
    let mut tx = store.begin_scheduling().await.expect("begin");
    let due = tx.claim_due(due_at, 10).await.expect("claim");
    assert_eq!(due.len(), 3);
    fn scheduled<'a>(a: &'a Automation, id: &str, at: DateTime<Utc>) -> NewRun<'a> {
        NewRun {
            trigger: RunTrigger::Schedule,
            scheduled_for: Some(at),
            idempotency_key: None,
            ..new_run(a, id)
        }
    }
    let r1 = scheduled(&a1, "r1", due_at);
    let r2 = scheduled(&a2, "r2", due_at);
    let r3 = scheduled(&a3, "r3", due_at);
    let tomorrow = due_at + Duration::days(1);
    let fires = [(&r1, Some(tomorrow)), (&r2, None), (&r3, Some(tomorrow))];
    let made = tx.fire_many(&fires, t(5)).await.expect("fire");
    assert_eq!(made, vec![true, true, true]);
    assert!(tx.commit().await.expect("commit"), "live runs were created");
    for (run, a) in [(&r1, &a1), (&r2, &a2), (&r3, &a3)] {
        let stored = store.get_run(&alice(), &run.id).await.expect("run");
        assert_eq!(stored.automation_id, a.id);
        assert_eq!(stored.state, RunState::Pending);
        assert_eq!(stored.trigger, RunTrigger::Schedule);
        assert_eq!(stored.scheduled_for, Some(due_at));
        assert_eq!(stored.prompt, a.prompt);
        assert_eq!(stored.model, a.model);
        assert_eq!(stored.placement, a.placement);
        assert_eq!(stored.deadline_at, run.deadline_at);
        assert_eq!(stored.traceparent, run.traceparent);
        assert_eq!(stored.created_at, t(5));
        assert_eq!(stored.idempotency_key, None);
        let advanced = store.get_automation(&alice(), &a.id).await.expect("read");
        assert_eq!(advanced.version, a.version + 1);
    }
    let next_of = |id: &'static str| {
        let store = store.clone();
        async move {
            store
                .get_automation(&alice(), id)
                .await
                .expect("read")
                .next_run_at
        }
    };
    assert_eq!(next_of("a1").await, Some(tomorrow));
    assert_eq!(next_of("a2").await, None);
    assert_eq!(next_of("a3").await, Some(tomorrow));
    // The same occurrences again (their ids exist): no second run of any.
    let mut tx = store.begin_scheduling().await.expect("begin");
    let again = tx.fire_many(&fires, t(6)).await.expect("again");
    assert_eq!(again, vec![false, false, false]);
    assert!(!tx.commit().await.expect("commit"), "nothing was created");
    let listed = store
        .list_runs(&alice(), &RunFilter::default(), &Cursor::start(), 10)
        .await
        .expect("list");
    assert_eq!(listed.items.len(), 3);
}

/// Many runs ended at once (one bulk statement per step of a batch): each
/// run by its own guard (live, and held by the coordinator ending it when
/// one does), with exactly one receipt as its job wrote it and its terminal
/// event next in its log, whatever the other runs of the batch do; a run
/// whose guard does not hold is refused and left as it was.
pub async fn many_runs_ended_at_once_each_by_its_own_guard(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    let ids: Vec<String> = (0..60).map(|i| format!("r{i:02}")).collect();
    for id in &ids {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
    }
    // Every run leased to c1; every fourth ended already (a second end
    // is refused). Below, another coordinator ends every fourth but one
    // (refused, left live), c1 the next, and no lease the rest.
    let claimed = store
        .claim_runs("c1", &[Placement::Cloud], t(9_000), t(2), t(-100_000), 100)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), ids.len());
    for id in ids.iter().step_by(4) {
        store
            .finish_run(&receipt(id, RunState::Failed), t(3))
            .await
            .expect("first end");
    }
    // Each kind of end on its own, all of its runs at once: a refused end
    // sends its batch back to run one job at a time, and the guard of the
    // batch's statement would not be what decides.
    let end_all = |kind: usize| {
        let tasks: Vec<_> = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 4 == kind || (kind == 2 && i % 4 == 3))
            .map(|(i, id)| {
                let (store, id) = (store.clone(), id.clone());
                tokio::spawn(async move {
                    let mut r = receipt(&id, RunState::Succeeded);
                    r.usage.input_tokens = i as i64;
                    r.error_message = (i % 2 == 0).then(|| format!("note {i}"));
                    let ended = match i % 4 {
                        1 => store.finish_run_as(&r, "c2", t(5)).await,
                        2 => store.finish_run_as(&r, "c1", t(5)).await,
                        _ => store.finish_run(&r, t(5)).await,
                    };
                    (i, ended)
                })
            })
            .collect();
        async move {
            let mut answers = vec![];
            for task in tasks {
                answers.push(task.await.expect("ender"));
            }
            answers
        }
    };
    let mut answers: Vec<Option<Result<_, StoreError>>> = ids.iter().map(|_| None).collect();
    let mut at_once = vec![];
    for kind in [1, 0, 2] {
        let before = batched();
        for (i, ended) in end_all(kind).await {
            answers[i] = Some(ended);
        }
        at_once.push(batched() - before);
    }
    let answers: Vec<_> = answers.into_iter().map(|a| a.expect("answered")).collect();
    for (i, id) in ids.iter().enumerate() {
        let run = store.internal().get_run(id).await.expect("get");
        let kept = store.internal().receipt(id).await.expect("receipt");
        let statuses = statuses_in_order(store, id).await;
        match i % 4 {
            0 => {
                assert!(
                    matches!(answers[i], Err(StoreError::IllegalTransition { .. })),
                    "{id}: {:?}",
                    answers[i]
                );
                assert_eq!(run.state, RunState::Failed, "{id}");
                assert_eq!(kept.expect("receipt").outcome, RunState::Failed, "{id}");
                assert_eq!(statuses, ["failed"], "{id}");
            }
            1 => {
                assert!(
                    matches!(answers[i], Err(StoreError::IllegalTransition { .. })),
                    "{id}: {:?}",
                    answers[i]
                );
                assert_eq!(run.state, RunState::Pending, "{id}");
                assert!(kept.is_none(), "{id}");
                assert!(statuses.is_empty(), "{id}: {statuses:?}");
            }
            _ => {
                assert_eq!(
                    answers[i].as_ref().ok().map(|after| after.state),
                    Some(automesh_domain::AutomationState::Active),
                    "{id}"
                );
                assert_eq!(run.state, RunState::Succeeded, "{id}");
                let mut expected = receipt(id, RunState::Succeeded);
                expected.usage.input_tokens = i as i64;
                expected.error_message = (i % 2 == 0).then(|| format!("note {i}"));
                assert_eq!(kept, Some(expected.clone()), "{id}");
                assert_eq!(run.error_message, expected.error_message, "{id}");
                assert_eq!(statuses, ["succeeded"], "{id}");
            }
        }
    }
    // Some of the ends that hold shared a batch.
    assert!(at_once[2] > 0, "{at_once:?}");
}

/// A batch's offers and runners' reports are one bulk statement each;
/// each applies exactly as it would
/// alone: an offer made twice keeps the first, an acceptance needs the
/// claiming stream, an unfinished phase and no cancellation, a finish
/// happens once, and the note each sends tells what the assignment now is.
pub async fn many_reports_and_offers_joined_each_as_alone(store: &Store) {
    use automesh_store::desktop::DesktopPhase;
    use automesh_store::{DesktopNote, Heard};
    let now = t(0);
    // runner-j's newest stream is sj (sj-old was its first); runner-k is
    // another runner of the owner.
    for (runner, stream, at) in [("runner-j", "sj-old", 0), ("runner-j", "sj", 1)] {
        let opened = store.open_runner_stream(runner, stream, "g1", t(at));
        opened.await.expect("stream");
    }
    let opened = store.open_runner_stream("runner-k", "sk", "g1", now);
    opened.await.expect("stream");
    let ids: Vec<String> = (0..48).map(|i| format!("jd-{i:02}")).collect();
    // Runs at once, each its own task: the writer batches what waits.
    async fn all<T: Send + 'static>(
        tasks: Vec<tokio::task::JoinHandle<(usize, T)>>,
    ) -> Vec<(usize, T)> {
        let mut out = vec![];
        for task in tasks {
            out.push(task.await.expect("task"));
        }
        out
    }
    let offers = |spec: &'static [u8], every: usize| {
        let tasks = ids.iter().enumerate().filter(|(i, _)| i % every == 0);
        let tasks = tasks.map(|(i, id)| {
            let (store, id) = (store.clone(), id.clone());
            tokio::spawn(async move {
                let made = store.offer_desktop_run(&id, "org-a", "alice", spec, t(i as i64));
                (i, made.await.expect("offer"))
            })
        });
        all(tasks.collect())
    };
    let offered_before = batched();
    assert!(
        offers(b"spec\x00one", 1)
            .await
            .iter()
            .all(|(_, made)| *made)
    );
    let again = offers(b"other", 4).await;
    assert!(again.iter().all(|(_, made)| !made), "offered once");
    let offered = batched() - offered_before;
    // Claimed by the runner's stream: every run but every fourth; every
    // fourth but two cancelled before it is accepted.
    for (i, id) in ids.iter().enumerate() {
        let held = store.desktop_run(id).await.expect("read").expect("offered");
        assert_eq!(held.spec, b"spec\x00one", "{id}");
        assert!(held.runner_id.is_none(), "{id}: unclaimed");
        if i % 4 != 3 {
            let claim = store.desktop_claim(Claim::Take, id, "runner-j", "sj", t(1));
            assert!(claim.await.expect("claim").is_some(), "{id}");
        }
        if i % 4 == 2 {
            let cancel = store.cancel_desktop_run(id, "stop", t(2));
            assert!(
                cancel
                    .await
                    .expect("cancel")
                    .expect("offered")
                    .cancel_requested
            );
        }
    }
    let mut listener = store.listen_desktop().await;
    type By = (&'static str, &'static str);
    let reports = |kind: fn(usize) -> Option<(RunnerReport<'static>, By)>| {
        let tasks = ids.iter().enumerate().filter_map(|(i, id)| {
            let (report, (runner, stream)) = kind(i)?;
            let (store, id) = (store.clone(), id.clone());
            Some(tokio::spawn(async move {
                let made = store.desktop_report(report, &id, runner, stream, t(10 + i as i64));
                (i, made.await.expect("report"))
            }))
        });
        all(tasks.collect())
    };
    const J: By = ("runner-j", "sj");
    let reported_before = batched();
    // Reports by anyone but the claiming stream are refused: another
    // runner (on its own stream, or naming the claiming stream's id), the
    // runner's older stream.
    let strangers = reports(|i| {
        Some(match i % 4 {
            0 => (RunnerReport::Accepted, ("runner-k", "sk")),
            1 => (RunnerReport::Accepted, ("runner-j", "sj-old")),
            2 => (RunnerReport::Finished(b"x"), ("runner-k", "sj")),
            _ => (RunnerReport::Idle, ("runner-j", "sj-old")),
        })
    });
    assert!(strangers.await.iter().all(|(_, applied)| !applied));
    // Every run accepted: only the claimed, uncancelled ones take it.
    let accepted = reports(|_| Some((RunnerReport::Accepted, J))).await;
    for (i, applied) in &accepted {
        assert_eq!(*applied, i % 4 < 2, "accept {i}");
    }
    // Then every first finished, every second idle, every third idle
    // (cancelled), every fourth finished (never claimed: refused).
    let ends = |i: usize| {
        Some(match i % 4 {
            0 | 3 => (RunnerReport::Finished(b"out\x00\xff"), J),
            _ => (RunnerReport::Idle, J),
        })
    };
    for (i, applied) in reports(ends).await {
        assert_eq!(applied, i % 4 != 3, "end {i}");
    }
    // Again: a second finish and a second acceptance change nothing.
    let twice = reports(|i| match i % 4 {
        0 => Some((RunnerReport::Finished(b"later"), J)),
        1 => Some((RunnerReport::Accepted, J)),
        _ => None,
    });
    assert!(twice.await.iter().all(|(_, applied)| !applied));
    let reported = batched() - reported_before;
    for (i, id) in ids.iter().enumerate() {
        let held = store.desktop_run(id).await.expect("read").expect("offered");
        let (phase, idle, outcome): (_, _, Option<&[u8]>) = match i % 4 {
            0 => (DesktopPhase::Finished, true, Some(b"out\x00\xff")),
            1 => (DesktopPhase::Running, true, None),
            2 => (DesktopPhase::Admitted, true, None),
            _ => (DesktopPhase::Admitted, false, None),
        };
        assert_eq!(held.phase, phase, "{id}");
        assert_eq!(held.idle, idle, "{id}");
        assert_eq!(held.outcome.as_deref(), outcome, "{id}");
        assert_eq!(held.runner_id.is_some(), i % 4 != 3, "{id}");
        assert_eq!(held.cancel_requested, i % 4 == 2, "{id}");
    }
    // Each applied report told what it left (24 acceptances, 36 ends; a
    // refused report tells nothing): the last note of each run is its
    // assignment as it now is.
    let (mut last, mut heard) = (std::collections::BTreeMap::new(), 0);
    let give_up = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while heard < 60 && tokio::time::Instant::now() < give_up {
        if let Heard::Notes(notes) = listener.next(std::time::Duration::from_secs(1)).await {
            for note in notes {
                if let DesktopNote::Changed { run_id, now } = note
                    && run_id.starts_with("jd-")
                {
                    heard += 1;
                    last.insert(run_id, now);
                }
            }
        }
    }
    // Nothing more: no refused report sent a note.
    let quiet = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    while tokio::time::Instant::now() < quiet {
        let Heard::Notes(notes) = listener.next(std::time::Duration::from_millis(300)).await else {
            break;
        };
        let ours = |n: &&DesktopNote| matches!(n, DesktopNote::Changed { run_id, .. } if run_id.starts_with("jd-"));
        heard += notes.iter().filter(ours).count();
    }
    assert_eq!(heard, 60, "one note per applied report");
    assert_eq!(last.len(), 36, "a note for every run reported on");
    for (run_id, now) in last {
        let i: usize = run_id[3..].parse().expect("index");
        let now = now.expect("the note says what the assignment is");
        let held = store
            .desktop_run(&run_id)
            .await
            .expect("read")
            .expect("offered");
        assert_eq!(now.phase, held.phase, "{run_id}");
        assert_eq!(now.idle, held.idle, "{run_id}");
        assert_eq!(now.outcome(), held.outcome, "{run_id}");
        assert_eq!(now.event_count, 0, "{run_id}");
        assert!(!now.passed_over, "{run_id}");
        assert_ne!(i % 4, 3, "{run_id}: a refused report sends no note");
    }
    assert!(offered > 0, "some offers shared a batch");
    assert!(reported > 0, "some reports shared a batch");
}

/// A runner reads connected while its newest stream is open and the
/// replica holding it beats within the bound, offline once the stream
/// closed or the beat went stale (the replica died), with when it was last
/// seen; revoked runners and other
/// owners' are not listed.
pub async fn a_runner_is_connected_while_its_stream_is_held_and_refreshed(store: &Store) {
    let stale = Duration::seconds(35);
    store
        .create_runner(&alice(), "ra", "laptop", "hash-a", t(0))
        .await
        .expect("runner");
    store
        .create_runner(&alice(), "rb", "desktop", "hash-b", t(1))
        .await
        .expect("runner");
    let listed = store
        .list_runners(&alice(), t(2), stale)
        .await
        .expect("list");
    let names: Vec<(&str, bool, bool)> = listed
        .iter()
        .map(|r| (r.name.as_str(), r.connected, r.last_seen_at.is_some()))
        .collect();
    assert_eq!(names, [("desktop", false, false), ("laptop", false, false)]);

    store
        .open_runner_stream("ra", "s1", "g1", t(10))
        .await
        .expect("open");
    let laptop = |listed: Vec<automesh_store::runners::RunnerPresence>| {
        listed.into_iter().find(|r| r.id == "ra").expect("listed")
    };
    let now = laptop(
        store
            .list_runners(&alice(), t(20), stale)
            .await
            .expect("list"),
    );
    assert!(now.connected);
    assert_eq!(now.last_seen_at, Some(t(10)));
    // Its replica stopped refreshing it: offline once stale.
    let later = laptop(
        store
            .list_runners(&alice(), t(50), stale)
            .await
            .expect("list"),
    );
    assert!(!later.connected);
    store
        .runner_gateway_seen("g1", t(40), Duration::days(7))
        .await
        .expect("seen");
    let refreshed = laptop(
        store
            .list_runners(&alice(), t(50), stale)
            .await
            .expect("list"),
    );
    assert!(refreshed.connected);
    assert_eq!(refreshed.last_seen_at, Some(t(40)));
    // An older stream ending does not close the newer one.
    store
        .open_runner_stream("ra", "s2", "g1", t(45))
        .await
        .expect("open");
    store
        .close_runner_stream("ra", "s1", t(46))
        .await
        .expect("close");
    assert!(
        laptop(
            store
                .list_runners(&alice(), t(47), stale)
                .await
                .expect("list")
        )
        .connected
    );
    store
        .close_runner_stream("ra", "s2", t(48))
        .await
        .expect("close");
    let closed = laptop(
        store
            .list_runners(&alice(), t(49), stale)
            .await
            .expect("list"),
    );
    assert!(!closed.connected);
    assert_eq!(closed.last_seen_at, Some(t(48)));
    // A closed stream is not marked seen again.
    store
        .runner_gateway_seen("g1", t(60), Duration::days(7))
        .await
        .expect("seen");
    assert!(
        !laptop(
            store
                .list_runners(&alice(), t(61), stale)
                .await
                .expect("list")
        )
        .connected
    );

    let bob = Principal::new("acme", "bob");
    assert!(
        store
            .list_runners(&bob, t(61), stale)
            .await
            .expect("list")
            .is_empty()
    );
    store
        .revoke_runner(&alice(), "rb", t(62))
        .await
        .expect("revoke");
    let left = store
        .list_runners(&alice(), t(63), stale)
        .await
        .expect("list");
    assert_eq!(
        left.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["ra"]
    );
}

/// Batches whose run sets cross commit without a deadlock and without a
/// replay: each locks its runs in one order before writing (PostgreSQL;
/// SQLite has one writer). Eight writers each append to every run, end
/// half of them and renew nothing else, in different orders at once, so
/// the store's writers hold batches of crossing runs; every write lands
/// exactly once, in order, and no batch is rolled back.
pub async fn crossing_batches_commit_without_deadlock_or_replay(store: &Store) {
    let a = create(store, &alice(), "a1", t(0)).await;
    let ids: Vec<String> = (0..24).map(|i| format!("x{i:02}")).collect();
    for id in &ids {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
    }
    let replayed = store.writes_replayed();
    let before = batched();
    // Each writer's order: rotated, every other one reversed.
    let order = |w: usize| {
        let mut order = ids.clone();
        order.rotate_left(w * 3);
        if w % 2 == 1 {
            order.reverse();
        }
        order
    };
    let appends = (0..8).map(|w| {
        let (store, order) = (store.clone(), order(w));
        tokio::spawn(async move {
            let writes = order.iter().map(|id| {
                let store = store.clone();
                let event = text_event(&format!("w{w}"), "x");
                async move { store.append_events(id, &[event], t(2)).await }
            });
            futures_util::future::join_all(writes).await
        })
    });
    for appended in futures_util::future::join_all(appends).await {
        for events in appended.expect("writer") {
            assert_eq!(events.expect("append").len(), 1);
        }
    }
    // Moves and ends of crossing sets, with appends to the same runs.
    let mixed = (0..8).map(|w| {
        let (store, order) = (store.clone(), order(w));
        tokio::spawn(async move {
            let writes = order.iter().enumerate().map(|(i, id)| {
                let store = store.clone();
                let id = id.clone();
                async move {
                    match (w + i) % 3 {
                        0 => store
                            .advance_run(&id, &[RunState::Admitted], t(3))
                            .await
                            .map(|_| ()),
                        1 => store
                            .append_events(&id, &[text_event(&format!("m{w}"), "y")], t(3))
                            .await
                            .map(|_| ()),
                        _ if id.ends_with(['0', '2', '4', '6', '8']) => {
                            match store
                                .finish_run(&receipt(&id, RunState::Succeeded), t(4))
                                .await
                            {
                                // Another writer ended it first.
                                Err(StoreError::IllegalTransition { .. }) => Ok(()),
                                other => other.map(|_| ()),
                            }
                        }
                        _ => Ok(()),
                    }
                }
            });
            futures_util::future::join_all(writes).await
        })
    });
    for written in futures_util::future::join_all(mixed).await {
        for w in written.expect("writer") {
            w.expect("write");
        }
    }
    for (n, id) in ids.iter().enumerate() {
        let log = store.internal().events(id, 0, 1000).await.expect("events");
        let seqs: Vec<i64> = log.iter().map(|e| e.sequence).collect();
        assert_eq!(seqs, (1..=log.len() as i64).collect::<Vec<_>>(), "{id}");
        let texts = log.iter().filter(|e| e.event_id.starts_with('w')).count();
        assert_eq!(texts, 8, "{id}: every writer's append, once");
        let run = store.internal().get_run(id).await.expect("run");
        let ends_once = statuses_in_order(store, id)
            .await
            .iter()
            .filter(|s| *s == "succeeded")
            .count();
        let even = n % 2 == 0;
        assert_eq!(ends_once, usize::from(even), "{id}");
        assert_eq!(run.state == RunState::Succeeded, even, "{id}");
    }
    assert!(batched() > before, "some writes shared a batch");
    assert_eq!(
        store.writes_replayed(),
        replayed,
        "no batch was rolled back and replayed"
    );
}

/// Cloud dispatch (every write of it): a reservation is made once and
/// stands; one replica drives a run at a time, its drive renewable by it
/// and taken over by another only once it lapses (then the run reads as
/// undriven); progress and a cancellation are recorded until the run
/// finishes, its outcome once; a finished run is neither driven nor
/// undriven.
pub async fn cloud_dispatch_is_driven_by_one_replica_and_finished_once(store: &Store) {
    use automesh_store::cloud::{CloudPhase, Reservation};
    let reservation = |message_id: &'static str, spec: &'static [u8]| Reservation {
        run_id: "c1",
        org_id: "org-a",
        owner_id: "alice",
        worker_id: "w1",
        workspace_id: "ws1",
        thread_id: "th1",
        message_id,
        spec,
    };
    assert!(
        store
            .reserve_cloud_run(&reservation("m1", b"spec\x00"), t(1))
            .await
            .expect("reserve")
    );
    assert!(
        !store
            .reserve_cloud_run(&reservation("m2", b"other"), t(2))
            .await
            .expect("again"),
        "reserved once"
    );
    let read = || async { store.cloud_run("c1").await.expect("read").expect("held") };
    let held = read().await;
    assert_eq!(
        (held.message_id.as_str(), &held.spec[..]),
        ("m1", &b"spec\x00"[..])
    );
    assert_eq!(held.phase, CloudPhase::Waking);
    assert!(!held.cancel_requested);
    // Never driven: undriven.
    let undriven = |at: i64| async move {
        store
            .undriven_cloud_runs(t(at), 10)
            .await
            .expect("undriven")
    };
    assert_eq!(undriven(10).await, ["c1"]);
    let take = |owner: &'static str, until: i64, now: i64| async move {
        store
            .take_cloud_drive("c1", owner, t(until), t(now))
            .await
            .expect("take")
    };
    assert!(take("d1", 20, 10).await);
    assert!(!take("d2", 40, 15).await, "d1's drive is live");
    assert!(take("d1", 30, 15).await, "its driver renews it");
    assert!(undriven(25).await.is_empty());
    assert_eq!(undriven(31).await, ["c1"], "the drive lapsed");
    assert!(take("d2", 50, 31).await, "taken over once lapsed");
    assert!(!take("d1", 60, 32).await, "and no longer d1's");
    // d2 stops and hands its drive back: undriven at once, long before
    // its lease would lapse; d1's release touches nothing of d2's.
    let released = store.release_cloud_claims("d1").await.expect("release");
    assert_eq!(released, (0, 0));
    assert!(undriven(32).await.is_empty());
    let released = store.release_cloud_claims("d2").await.expect("release");
    assert_eq!(released, (1, 0));
    assert_eq!(undriven(32).await, ["c1"], "handed back at once");
    assert!(take("d1", 50, 32).await, "and taken by another");
    // Progress, and a cancellation.
    let phase = |p: CloudPhase, wake: i64, admission: i64, at: i64| async move {
        store
            .set_cloud_phase("c1", p, wake, admission, t(at))
            .await
            .expect("phase")
    };
    assert!(phase(CloudPhase::Admitted, 5, 7, 33).await);
    let held = read().await;
    assert_eq!(
        (held.phase, held.wake_micros, held.admission_micros),
        (CloudPhase::Admitted, 5, 7)
    );
    assert!(store.cancel_cloud_run("c1", t(34)).await.expect("cancel"));
    assert!(read().await.cancel_requested);
    assert!(
        !store.cancel_cloud_run("c9", t(34)).await.expect("cancel"),
        "no such run"
    );
    // Finished once: then nothing moves it.
    let finish = |out: &'static [u8]| async move {
        store
            .finish_cloud_run("c1", out, t(35))
            .await
            .expect("finish")
    };
    assert!(finish(b"out\x00\xff").await);
    assert!(!finish(b"later").await, "finished once");
    assert!(!phase(CloudPhase::Running, 9, 9, 36).await);
    assert!(!take("d2", 90, 36).await, "a finished run is not driven");
    assert!(undriven(1000).await.is_empty());
    let held = read().await;
    assert_eq!(held.phase, CloudPhase::Finished);
    assert_eq!(held.outcome.as_deref(), Some(&b"out\x00\xff"[..]));
    assert_eq!((held.wake_micros, held.admission_micros), (5, 7));
}

/// The writes the other cases do not reach: how far a run's executor
/// stream was consumed (`set_executor_seq`: only forward, kept across a
/// takeover), a coordinator giving back every lease it holds at shutdown
/// (`release_all_leases`: its runs claimable at once by another, its old
/// renewals refused, another holder's runs untouched), and the receipt of a
/// run created terminal (`insert_receipt`, from the store and from a
/// scheduling transaction: one receipt and one terminal event, written
/// again changes nothing); and a scheduling transaction's `advance` of an
/// automation (its next occurrence and its version).
pub async fn executor_seqs_lease_releases_and_terminal_receipts_are_written_once(store: &Store) {
    use automesh_store::leases::Renewal;
    let a = create(store, &alice(), "a1", t(0)).await;
    for id in ["r1", "r2", "r3"] {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
    }
    let long_ago = t(-100_000);
    let claim = |owner: &'static str, until: i64, now: i64, limit: u32| {
        let store = store.clone();
        async move {
            let mut ids: Vec<(String, i64)> = store
                .claim_runs(
                    owner,
                    &[Placement::Cloud],
                    t(until),
                    t(now),
                    long_ago,
                    limit,
                )
                .await
                .expect("claim")
                .into_iter()
                .map(|c| (c.run.id, c.executor_seq))
                .collect();
            ids.sort();
            ids
        }
    };
    // c1 takes r1 and r2, c2 takes r3.
    let c1 = claim("c1", 100, 2, 2).await;
    assert_eq!(c1, [("r1".into(), 0), ("r2".into(), 0)]);
    assert_eq!(claim("c2", 100, 2, 10).await, [("r3".into(), 0)]);
    // The executor seq only moves forward.
    store.set_executor_seq("r1", 5).await.expect("seq");
    store.set_executor_seq("r1", 3).await.expect("an older seq");
    // c1 gives back its leases: 2 runs, claimable at once by c3 (long
    // before they would expire), r1 with its seq; c2's run stays c2's.
    assert_eq!(store.release_all_leases("c1").await.expect("release"), 2);
    assert_eq!(store.release_all_leases("c1").await.expect("again"), 0);
    assert_eq!(
        claim("c3", 200, 3, 10).await,
        [("r1".into(), 5), ("r2".into(), 0)]
    );
    assert_eq!(
        store.renew_lease("r1", "c1", t(4)).await.expect("renew"),
        Renewal::Lost
    );
    assert_eq!(
        store.renew_lease("r3", "c2", t(4)).await.expect("renew"),
        Renewal::Held {
            cancel_requested: false
        }
    );
    // Runs created terminal get their receipt and terminal event once,
    // whichever way it is written.
    let mut skipped = new_run(&a, "s1");
    skipped.state = RunState::Skipped;
    store.create_run(&skipped, t(5)).await.expect("create");
    let mut missed = new_run(&a, "m1");
    missed.state = RunState::Missed;
    store.create_run(&missed, t(5)).await.expect("create");
    // A scheduling transaction moves an automation's next occurrence, and
    // its version with it.
    let mut tx = store.begin_scheduling().await.expect("begin");
    tx.advance("a1", Some(t(7200)), t(5))
        .await
        .expect("advance");
    tx.commit().await.expect("commit");
    let advanced = store.get_automation(&alice(), "a1").await.expect("read");
    assert_eq!(
        (advanced.next_run_at, advanced.version),
        (Some(t(7200)), a.version + 1)
    );
    let mut tx = store.begin_scheduling().await.expect("begin");
    tx.advance("a1", None, t(6)).await.expect("advance");
    tx.commit().await.expect("commit");
    let advanced = store.get_automation(&alice(), "a1").await.expect("read");
    assert_eq!(
        (advanced.next_run_at, advanced.version),
        (None, a.version + 2)
    );
    for _ in 0..2 {
        store
            .insert_receipt(&receipt("s1", RunState::Skipped))
            .await
            .expect("receipt");
        let mut tx = store.begin_scheduling().await.expect("begin");
        tx.insert_receipt(&receipt("m1", RunState::Missed))
            .await
            .expect("receipt");
        tx.commit().await.expect("commit");
    }
    for (id, state) in [("s1", RunState::Skipped), ("m1", RunState::Missed)] {
        let stored = store.internal().receipt(id).await.expect("read");
        assert_eq!(
            stored,
            Some(receipt(id, state)),
            "{id}'s receipt as written"
        );
        assert_eq!(
            statuses_in_order(store, id).await,
            [state.as_str()],
            "{id}: one terminal event"
        );
    }
}

/// Failure streaks (issue 32): each failed or timed-out run's end extends
/// its automation's streak in the transaction that ends the run; at
/// `pause_after_failures` the automation needs attention
/// (`failing_repeatedly`) and its schedule pauses; a success ends the
/// streak and makes it active again; 0 never pauses; and runs of one
/// automation ended at once, in one batch or in crossing ones, each count.
pub async fn failure_streaks_pause_an_automation_and_a_success_ends_them(store: &Store) {
    use automesh_domain::AutomationState::{Active, NeedsAttention};
    let a = create(store, &alice(), "a1", t(0)).await;
    for id in ["f1", "f2", "f3", "c1", "s1"] {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
    }
    let failed = |id: &str, outcome: RunState, code: Option<ErrorCode>| {
        let mut r = receipt(id, outcome);
        r.error_code = code;
        r
    };
    let after = store
        .finish_run(
            &failed("f1", RunState::Failed, Some(ErrorCode::ProviderError)),
            t(2),
        )
        .await
        .expect("finish f1");
    assert_eq!(
        (after.state, after.paused, after.failure_streak),
        (Active, None, 1)
    );
    // A cancelled run neither extends nor ends it.
    store
        .finish_run(&failed("c1", RunState::Cancelled, None), t(3))
        .await
        .expect("finish c1");
    store
        .finish_run(
            &failed("f2", RunState::TimedOut, Some(ErrorCode::DeadlineExceeded)),
            t(4),
        )
        .await
        .expect("finish f2");
    let got = store.get_automation(&alice(), "a1").await.expect("get");
    assert_eq!(got.state, Active);
    assert_eq!(got.failure_streak.runs, 2);
    assert_eq!(
        got.failure_streak.codes,
        ["provider_error", "deadline_exceeded"]
    );
    assert!(got.next_run_at.is_some());
    let after = store
        .finish_run(&failed("f3", RunState::Failed, None), t(5))
        .await
        .expect("finish f3");
    assert_eq!(after.state, NeedsAttention);
    assert_eq!(after.paused, Some(ErrorCode::FailingRepeatedly));
    let paused = store.get_automation(&alice(), "a1").await.expect("get");
    assert_eq!(paused.state, NeedsAttention);
    assert_eq!(paused.next_run_at, None, "its schedule pauses");
    let attention = paused.attention.clone().expect("attention");
    assert_eq!(attention.reason, ErrorCode::FailingRepeatedly);
    assert!(
        attention
            .message
            .contains("provider_error, deadline_exceeded, failed"),
        "{attention:?}"
    );
    assert_eq!(paused.failure_streak.runs, 3);
    assert!(paused.version > got.version, "a move is a new version");
    // A success (a Run now) ends the streak and resumes the schedule.
    let after = store
        .finish_run(&receipt("s1", RunState::Succeeded), t(6))
        .await
        .expect("finish s1");
    assert_eq!(
        (after.state, after.resumed, after.failure_streak),
        (Active, true, 0)
    );
    let resumed = store.get_automation(&alice(), "a1").await.expect("get");
    assert_eq!(resumed.state, Active);
    assert_eq!(resumed.attention, None);
    assert_eq!(resumed.failure_streak, Default::default());
    assert!(resumed.next_run_at.is_some_and(|at| at > t(6)));

    // 0 never pauses; many runs of one automation ended at once each count
    // (the automation's row is locked, read and written once per batch).
    let never = NewAutomation {
        pause_after_failures: 0,
        ..new_automation(&alice(), "a2", Surface::Web)
    };
    let never = store
        .create_automation(&never, Some(t(3600)), t(0))
        .await
        .expect("create a2");
    let ids: Vec<String> = (0..12).map(|i| format!("n{i:02}")).collect();
    for id in &ids {
        store
            .create_run(&new_run(&never, id), t(1))
            .await
            .expect("create");
    }
    let ends = ids.iter().map(|id| {
        let (store, r) = (
            store.clone(),
            failed(id, RunState::Failed, Some(ErrorCode::ToolError)),
        );
        tokio::spawn(async move { store.finish_run(&r, t(2)).await })
    });
    for ended in futures_util::future::join_all(ends).await {
        ended.expect("task").expect("finish");
    }
    let got = store.get_automation(&alice(), "a2").await.expect("get a2");
    assert_eq!(got.state, Active, "0 never pauses");
    assert_eq!(got.failure_streak.runs, 12, "no end is lost to another");
    assert_eq!(got.failure_streak.codes, vec!["tool_error"; 12]);

    // Crossing batches ending runs of two automations each in opposite
    // orders queue on their first common row instead of deadlocking.
    let b = create(store, &alice(), "a3", t(0)).await;
    let c = create(store, &alice(), "a4", t(0)).await;
    let mut runs = vec![];
    for (i, a) in [&b, &c].iter().enumerate() {
        for j in 0..8 {
            let id = format!("x{i}{j}");
            store
                .create_run(&new_run(a, &id), t(1))
                .await
                .expect("create");
            runs.push(id);
        }
    }
    let replayed = store.writes_replayed();
    let ends = runs.iter().enumerate().map(|(k, id)| {
        let store = store.clone();
        let r = failed(id, RunState::TimedOut, None);
        tokio::spawn(async move {
            if k % 2 == 1 {
                tokio::task::yield_now().await;
            }
            store.finish_run(&r, t(2)).await
        })
    });
    for ended in futures_util::future::join_all(ends).await {
        ended.expect("task").expect("finish");
    }
    for id in ["a3", "a4"] {
        let got = store.get_automation(&alice(), id).await.expect("get");
        assert_eq!(got.failure_streak.runs, 8, "{id}");
        assert_eq!(got.state, NeedsAttention, "{id}");
        let reason = got.attention.map(|x| x.reason);
        assert_eq!(reason, Some(ErrorCode::FailingRepeatedly), "{id}");
    }
    assert_eq!(store.writes_replayed(), replayed, "no batch was replayed");
}

/// Monthly budgets (issue 32): a month's spend is the sum of the receipts of
/// the automation's runs created in it (read alike through the store and in
/// a scheduling transaction); an automation paused for a spent budget is
/// written by the scheduling transaction and listed for the month sweep.
pub async fn monthly_budgets_are_read_from_receipts_and_spent_months_listed(store: &Store) {
    use automesh_domain::AutomationState::NeedsAttention;
    let new = NewAutomation {
        monthly_budget_micros: Some(100),
        ..new_automation(&alice(), "a1", Surface::Web)
    };
    let a = store
        .create_automation(&new, Some(t(3600)), t(0))
        .await
        .expect("create");
    assert_eq!(a.monthly_budget_micros, Some(100));
    let other = create(store, &alice(), "a2", t(0)).await;
    // Runs created at t(10), t(20) (in the window) and t(100) (outside);
    // one in the window has no receipt yet; another automation's run.
    for (run, at, cost) in [
        ("r1", 10, Some(30)),
        ("r2", 20, Some(45)),
        ("r3", 25, None),
        ("r4", 100, Some(1_000)),
    ] {
        store
            .create_run(&new_run(&a, run), t(at))
            .await
            .expect("create run");
        if let Some(cost) = cost {
            let mut r = receipt(run, RunState::Succeeded);
            r.usage.cost_micros = cost;
            store.finish_run(&r, t(at + 1)).await.expect("finish");
        }
    }
    store
        .create_run(&new_run(&other, "o1"), t(10))
        .await
        .expect("create");
    let mut r = receipt("o1", RunState::Succeeded);
    r.usage.cost_micros = 7_000;
    store.finish_run(&r, t(11)).await.expect("finish");
    let spent = store
        .internal()
        .month_spend("a1", t(0), t(50))
        .await
        .expect("spend");
    assert_eq!(spent, 75);
    let mut tx = store.begin_scheduling().await.expect("begin");
    assert_eq!(tx.month_spend("a1", t(0), t(50)).await.expect("spend"), 75);
    assert_eq!(
        tx.month_spend("a1", t(50), t(200)).await.expect("spend"),
        1_000
    );
    assert_eq!(
        tx.month_spend("nope", t(0), t(200)).await.expect("spend"),
        0
    );
    // Paused in the transaction: written as a new version, and listed.
    let mut paused = store.get_automation(&alice(), "a1").await.expect("get");
    assert!(paused.exhaust_budget(spent, t(60)));
    tx.stand(&[&paused], t(60)).await.expect("stand");
    tx.commit().await.expect("commit");
    let stored = store.get_automation(&alice(), "a1").await.expect("get");
    assert_eq!(stored.state, NeedsAttention);
    assert_eq!(stored.next_run_at, None);
    assert_eq!(
        stored.attention.as_ref().map(|x| x.reason),
        Some(ErrorCode::BudgetExhausted)
    );
    assert!(stored.version > a.version);
    let listed = store.internal().budget_spent(10).await.expect("list");
    assert_eq!(
        listed.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
        ["a1"]
    );
    // Raised (an update), it is no longer listed once resumed.
    let mut raised = stored.clone();
    raised.monthly_budget_micros = Some(1_000_000);
    assert!(raised.resume_budget(t(70)));
    store
        .update_automation_if_version(&raised, stored.version, t(70))
        .await
        .expect("update");
    assert!(
        store
            .internal()
            .budget_spent(10)
            .await
            .expect("list")
            .is_empty()
    );
    let got = store.get_automation(&alice(), "a1").await.expect("get");
    assert_eq!(got.monthly_budget_micros, Some(1_000_000));
}

fn endpoint(owner: &Principal, id: &str, at: DateTime<Utc>) -> automesh_domain::WebhookEndpoint {
    automesh_domain::WebhookEndpoint {
        id: id.to_owned(),
        org_id: owner.org_id.clone(),
        owner_id: owner.user_id.clone(),
        url: format!("https://hooks.example.com/{id}"),
        description: String::new(),
        created_at: at,
        disabled_at: None,
        disabled_reason: None,
    }
}

async fn message_types(store: &Store, owner: &Principal, endpoint: &str) -> Vec<String> {
    let mut types: Vec<String> = store
        .webhook_messages(owner, endpoint, 100)
        .await
        .expect("messages")
        .iter()
        .map(|m| m.event_type.as_str().to_owned())
        .collect();
    types.sort();
    types
}

pub async fn webhook_endpoints_are_scoped_and_notices_fan_out_once_per_cause(store: &Store) {
    use automesh_domain::Notice;
    for (owner, id) in [(alice(), "e1"), (alice(), "e2"), (mallory(), "e3")] {
        let e = endpoint(&owner, id, t(0));
        assert_eq!(
            store.create_webhook_endpoint(&e).await.expect("create").id,
            id
        );
    }
    let listed = store.list_webhook_endpoints(&alice()).await.expect("list");
    let ids: Vec<&str> = listed.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["e1", "e2"]);
    // Another owner's endpoint is the unknown id's NotFound.
    let theirs = store.get_webhook_endpoint(&alice(), "e3").await;
    assert!(matches!(theirs, Err(StoreError::NotFound)), "{theirs:?}");
    let theirs = store.delete_webhook_endpoint(&alice(), "e3").await;
    assert!(matches!(theirs, Err(StoreError::NotFound)), "{theirs:?}");
    let theirs = store.webhook_messages(&alice(), "e3", 10).await;
    assert!(matches!(theirs, Err(StoreError::NotFound)), "{theirs:?}");
    // An owner has at most ENDPOINT_LIMIT.
    let bob = Principal::new("org-a", "bob");
    for n in 0..automesh_store::notifications::ENDPOINT_LIMIT {
        let e = endpoint(&bob, &format!("b{n}"), t(0));
        store
            .create_webhook_endpoint(&e)
            .await
            .expect("within the limit");
    }
    let over = store
        .create_webhook_endpoint(&endpoint(&bob, "b-over", t(0)))
        .await;
    assert!(matches!(over, Err(StoreError::Invariant(_))), "{over:?}");

    // Three failed runs: the streak's first failure and the move to
    // needs-attention, to each of alice's endpoints, in the transactions
    // that end the runs; nothing to mallory's.
    let a = create(store, &alice(), "a1", t(0)).await;
    for id in ["f1", "f2", "f3"] {
        store
            .create_run(&new_run(&a, id), t(1))
            .await
            .expect("create");
        let mut r = receipt(id, RunState::Failed);
        r.error_code = Some(ErrorCode::ProviderError);
        store.finish_run(&r, t(2)).await.expect("finish");
    }
    let told = ["automation.needs_attention", "run.failed"];
    assert_eq!(message_types(store, &alice(), "e1").await, told);
    assert_eq!(message_types(store, &alice(), "e2").await, told);
    assert!(message_types(store, &mallory(), "e3").await.is_empty());
    let msgs = store
        .webhook_messages(&alice(), "e1", 10)
        .await
        .expect("messages");
    let failed = msgs
        .iter()
        .find(|m| m.event_type.as_str() == "run.failed")
        .expect("one");
    let payload: serde_json::Value = serde_json::from_str(&failed.payload).expect("json");
    assert_eq!(payload["data"]["run_id"], "f1");
    assert_eq!(payload["data"]["error_code"], "provider_error");
    assert_eq!(failed.next_attempt_at, Some(t(2)), "due at once");

    // A cause written again is the same message.
    let again = Notice::run_failed(&a, "f1", RunState::Failed, None, None, t(9));
    let written = store
        .internal()
        .enqueue_notices(&[again])
        .await
        .expect("enqueue");
    assert_eq!(written, 0);
    // A test message goes to the one endpoint; not to another owner's.
    let test = Notice::test(&alice(), "e1", t(3));
    store.enqueue_for_endpoint(&test, "e1").await.expect("test");
    assert_eq!(message_types(store, &alice(), "e1").await.len(), 3);
    assert_eq!(message_types(store, &alice(), "e2").await.len(), 2);
    let theirs = store
        .enqueue_for_endpoint(&Notice::test(&alice(), "e3", t(3)), "e3")
        .await;
    assert!(matches!(theirs, Err(StoreError::NotFound)), "{theirs:?}");
    // A scheduling pass's notice commits with it.
    let mut tx = store.begin_scheduling().await.expect("begin");
    tx.notify(&[Notice::occurrences_missed(&a, &[t(0), t(60)], t(4))])
        .await
        .expect("notify");
    tx.commit().await.expect("commit");
    assert!(
        message_types(store, &alice(), "e2")
            .await
            .contains(&"automation.occurrences_missed".to_owned())
    );
    // Deleting an endpoint deletes its messages.
    store
        .delete_webhook_endpoint(&alice(), "e2")
        .await
        .expect("delete");
    let gone = store.webhook_messages(&alice(), "e2", 10).await;
    assert!(matches!(gone, Err(StoreError::NotFound)), "{gone:?}");
}

pub async fn webhook_endpoints_are_claimed_once_and_attempts_recorded(store: &Store) {
    use automesh_domain::Notice;
    use automesh_store::notifications::Attempt;
    store
        .create_webhook_endpoint(&endpoint(&alice(), "e1", t(0)))
        .await
        .expect("create");
    let a = create(store, &alice(), "a1", t(0)).await;
    let notices = [
        Notice::run_failed(&a, "r1", RunState::Failed, None, None, t(10)),
        Notice::run_failed(&a, "r2", RunState::TimedOut, None, None, t(11)),
    ];
    store
        .internal()
        .enqueue_notices(&notices)
        .await
        .expect("enqueue");
    let nothing_due = store
        .internal()
        .claim_webhook_endpoints(t(5), t(60), 10)
        .await;
    assert!(nothing_due.expect("claim").is_empty(), "nothing due yet");
    // Two claims at once: one takes the endpoint.
    let (x, y) = tokio::join!(
        store.internal().claim_webhook_endpoints(t(20), t(80), 10),
        store.internal().claim_webhook_endpoints(t(20), t(80), 10),
    );
    let (x, y) = (x.expect("claim"), y.expect("claim"));
    assert_eq!(x.len() + y.len(), 1, "{x:?} {y:?}");
    let later = store
        .internal()
        .claim_webhook_endpoints(t(21), t(80), 10)
        .await;
    assert!(later.expect("claim").is_empty(), "claimed until t(80)");
    let due = store
        .internal()
        .due_webhook_messages("e1", t(21), 8)
        .await
        .expect("due");
    let ids: Vec<String> = due.iter().map(|m| m.message_id.clone()).collect();
    assert_eq!(
        ids,
        [notices[0].id.clone(), notices[1].id.clone()],
        "oldest first"
    );
    // The first delivered, the second failed: released until its retry.
    let attempts = [
        (ids[0].clone(), Attempt::Delivered),
        (
            ids[1].clone(),
            Attempt::Failed {
                error: "answered HTTP 500".into(),
                retry_at: Some(t(50)),
            },
        ),
    ];
    store
        .internal()
        .record_webhook_attempts("e1", &attempts, t(50), None, t(22))
        .await
        .expect("record");
    let early = store
        .internal()
        .claim_webhook_endpoints(t(30), t(90), 10)
        .await;
    assert!(early.expect("claim").is_empty(), "not before its retry");
    let retried = store
        .internal()
        .claim_webhook_endpoints(t(51), t(90), 10)
        .await;
    assert_eq!(retried.expect("claim").len(), 1);
    let due = store
        .internal()
        .due_webhook_messages("e1", t(51), 8)
        .await
        .expect("due");
    assert_eq!(due.len(), 1);
    assert_eq!(
        (due[0].message_id.as_str(), due[0].attempts),
        (ids[1].as_str(), 1)
    );
    // Given up: the endpoint is disabled, with why, and takes no more.
    let gave_up = [(
        ids[1].clone(),
        Attempt::Failed {
            error: "timed out".into(),
            retry_at: None,
        },
    )];
    store
        .internal()
        .record_webhook_attempts(
            "e1",
            &gave_up,
            t(52),
            Some("not delivered for a day"),
            t(52),
        )
        .await
        .expect("record");
    let e = store
        .get_webhook_endpoint(&alice(), "e1")
        .await
        .expect("get");
    assert_eq!(e.disabled_at, Some(t(52)));
    assert_eq!(
        e.disabled_reason.as_deref(),
        Some("not delivered for a day")
    );
    let more = Notice::run_failed(&a, "r3", RunState::Failed, None, None, t(60));
    let written = store
        .internal()
        .enqueue_notices(&[more])
        .await
        .expect("enqueue");
    assert_eq!(written, 0, "a disabled endpoint gets nothing new");
    let claim = store
        .internal()
        .claim_webhook_endpoints(t(100), t(200), 10)
        .await;
    assert!(claim.expect("claim").is_empty());
    let msgs = store
        .webhook_messages(&alice(), "e1", 10)
        .await
        .expect("messages");
    let delivered = msgs.iter().find(|m| m.message_id == ids[0]).expect("first");
    assert_eq!(
        (delivered.delivered_at, delivered.next_attempt_at),
        (Some(t(22)), None)
    );
    let failed = msgs
        .iter()
        .find(|m| m.message_id == ids[1])
        .expect("second");
    assert_eq!(failed.attempts, 2);
    assert_eq!(failed.next_attempt_at, None);
    assert_eq!(failed.last_error.as_deref(), Some("timed out"));
}

pub async fn retention_deletes_finished_runs_past_their_organisations_period(store: &Store) {
    use automesh_domain::Notice;
    use automesh_store::notifications::Attempt;
    use automesh_store::retention::Policy;
    const DAY: i64 = 86_400;
    let now = t(100 * DAY);
    let ago = |days: i64| now - Duration::days(days);
    let internal = store.internal();
    // Bad overrides are refused by name; mallory's organisation keeps 60 days.
    for bad in [0, automesh_store::retention::MAX_RETENTION_DAYS + 1] {
        let refused = internal.set_org_retention("org-b", bad, now).await;
        assert!(
            matches!(refused, Err(StoreError::Invariant(ref m)) if m.contains("retention")),
            "{bad} days: {refused:?}"
        );
    }
    internal
        .set_org_retention("org-x", 7, now)
        .await
        .expect("set");
    assert!(internal.clear_org_retention("org-x").await.expect("clear"));
    assert!(!internal.clear_org_retention("org-x").await.expect("clear"));
    internal
        .set_org_retention("org-b", 90, now)
        .await
        .expect("set");
    internal
        .set_org_retention("org-b", 60, now)
        .await
        .expect("set again");
    assert_eq!(
        internal.org_retentions().await.expect("list"),
        [("org-b".to_owned(), 60)]
    );
    let a = create(store, &alice(), "a1", ago(50)).await;
    let budgeted = NewAutomation {
        monthly_budget_micros: Some(1_000_000),
        ..new_automation(&alice(), "a2", Surface::Web)
    };
    let b = store
        .create_automation(&budgeted, Some(now), ago(50))
        .await
        .expect("create");
    let m = create(store, &mallory(), "m1", ago(80)).await;
    // (run, automation, created days ago, finished)
    let runs = [
        ("old", &a, 40, true),
        ("recent", &a, 10, true),
        ("live", &a, 40, false),
        ("budget-31", &b, 31, true),
        ("budget-33", &b, 33, true),
        ("m-40", &m, 40, true),
        ("m-70", &m, 70, true),
    ];
    for (id, automation, days, finished) in runs {
        let at = ago(days);
        store
            .create_run(&new_run(automation, id), at)
            .await
            .expect("create run");
        store
            .append_events(id, &[text_event("e1", "working")], at)
            .await
            .expect("append");
        if finished {
            store
                .finish_run(&receipt(id, RunState::Succeeded), at + Duration::seconds(1))
                .await
                .expect("finish");
        }
    }
    // Alice's endpoint: an old message delivered, an old one still pending,
    // a recent one delivered.
    store
        .create_webhook_endpoint(&endpoint(&alice(), "e1", ago(50)))
        .await
        .expect("endpoint");
    let notices = [
        Notice::run_failed(&a, "old", RunState::Failed, None, None, ago(40)),
        Notice::run_failed(&a, "pending", RunState::Failed, None, None, ago(40)),
        Notice::run_failed(&a, "recent", RunState::Failed, None, None, ago(2)),
    ];
    internal.enqueue_notices(&notices).await.expect("enqueue");
    let delivered = [
        (notices[0].id.clone(), Attempt::Delivered),
        (notices[2].id.clone(), Attempt::Delivered),
    ];
    internal
        .record_webhook_attempts("e1", &delivered, ago(1), None, ago(1))
        .await
        .expect("record");

    // One pass at a time: claimed, then due again only when the last one
    // said so.
    let soon = now + Duration::minutes(5);
    assert!(
        internal
            .claim_retention_pass(now, soon)
            .await
            .expect("claim")
    );
    assert!(
        !internal
            .claim_retention_pass(now, soon)
            .await
            .expect("claim")
    );
    let policy = Policy {
        default_days: 30,
        batch: 1,
        ..Policy::default()
    };
    let pass = internal.purge_expired(policy, now).await.expect("pass");
    let next = now + Duration::hours(1);
    internal
        .finish_retention_pass(now, Some(next))
        .await
        .expect("finish");
    assert!(
        !internal
            .claim_retention_pass(soon, next)
            .await
            .expect("claim")
    );
    assert!(
        internal
            .claim_retention_pass(next, next)
            .await
            .expect("claim")
    );
    assert_eq!(
        internal.last_retention_pass().await.expect("last"),
        Some(now)
    );
    // An operator's pass is recorded and leaves the timetable alone.
    let far = next + Duration::hours(1);
    internal
        .finish_retention_pass(next, Some(far))
        .await
        .expect("finish");
    let later = next + Duration::minutes(1);
    internal
        .finish_retention_pass(later, None)
        .await
        .expect("finish");
    let last = internal.last_retention_pass().await.expect("last");
    assert_eq!(last, Some(later));
    let early = internal.claim_retention_pass(later, far).await;
    assert!(!early.expect("claim"), "the next pass is due at `far`");
    let due = internal.claim_retention_pass(far, far).await;
    assert!(due.expect("claim"));

    assert!(pass.complete);
    assert_eq!(pass.orgs, 2, "{pass:?}");
    assert_eq!(pass.purged.runs, 3, "{pass:?}");
    assert_eq!(pass.purged.receipts, 3, "{pass:?}");
    assert_eq!(pass.purged.by_table()[0], ("runs", 3), "metrics' names");
    // Each run's event and the status events its end wrote.
    assert!(pass.purged.run_events >= 3, "{pass:?}");
    assert_eq!(pass.purged.webhook_messages, 1, "{pass:?}");
    assert_eq!(pass.oldest_kept, Some(ago(40)), "mallory's run of 40 days");
    for (id, gone) in [
        ("old", true),
        ("budget-33", true),
        ("m-70", true),
        ("recent", false),
        ("live", false),
        ("budget-31", false),
        ("m-40", false),
    ] {
        let run = internal.get_run(id).await;
        let events = internal.events(id, 0, 100).await.expect("events");
        let receipt = internal.receipt(id).await.expect("receipt");
        if gone {
            assert!(matches!(run, Err(StoreError::NotFound)), "{id}: {run:?}");
            assert!(events.is_empty() && receipt.is_none(), "{id}");
        } else {
            assert!(run.is_ok(), "{id} is kept");
            assert!(!events.is_empty(), "{id}'s events are kept");
        }
    }
    let kept: Vec<String> = store
        .webhook_messages(&alice(), "e1", 10)
        .await
        .expect("messages")
        .into_iter()
        .map(|m| m.message_id)
        .collect();
    assert!(!kept.contains(&notices[0].id), "the old delivered one goes");
    assert!(kept.contains(&notices[1].id) && kept.contains(&notices[2].id));
    // Nothing more to do: a second pass deletes nothing.
    let again = internal.purge_expired(policy, now).await.expect("pass");
    assert_eq!(again.purged, Default::default());
}

/// Retention by week (PostgreSQL drops week partitions; SQLite deletes the
/// same runs in batches): a week whose every run is finished and past its
/// organisation's retention goes whole, with its events, receipts and
/// idempotency keys; a week with a run still going, or one an organisation
/// with a longer retention keeps, stays (its due runs deleted in batches);
/// and the runs of a week still to be dropped are left to the drop.
pub async fn retention_drops_a_week_whose_every_run_is_due(store: &Store) {
    use automesh_domain::ids::{manual_run_id, scheduled_run_id};
    use automesh_store::Backend;
    use automesh_store::retention::Policy;
    let postgres = store.backend() == Backend::Postgres;
    let internal = store.internal();
    // Mondays, 00:00 UTC, years after the weeks the migration made.
    let monday = DateTime::parse_from_rfc3339("2031-01-20T00:00:00Z")
        .expect("instant")
        .with_timezone(&Utc);
    let week = move |n: i64| monday + Duration::days(7 * n);
    let policy = Policy {
        default_days: 30,
        batch: 2,
        ..Policy::default()
    };
    // A pass makes the weeks ahead of need: weeks 0..=2, then 2..=4.
    let first = internal.purge_expired(policy, week(0)).await.expect("pass");
    let second = internal.purge_expired(policy, week(2)).await.expect("pass");
    let name = |n: i64| week(n).format("%Y%m%d").to_string();
    let weeks = internal.run_weeks().await.expect("weeks");
    if postgres {
        assert_eq!((first.weeks_created, second.weeks_created), (9, 6));
        let ours: Vec<&String> = weeks.iter().filter(|w| w.starts_with("2031")).collect();
        assert_eq!(
            ours,
            (0..5)
                .map(name)
                .collect::<Vec<_>>()
                .iter()
                .collect::<Vec<_>>()
        );
    } else {
        assert!(weeks.is_empty() && first.weeks_created == 0);
    }
    // Making the weeks again makes none: each is there once.
    let again = internal.make_run_weeks(week(2)).await.expect("weeks");
    assert_eq!(again, 0);
    assert_eq!(internal.run_weeks().await.expect("weeks"), weeks);
    internal
        .set_org_retention("org-b", 60, week(0))
        .await
        .expect("set");
    let a = create(store, &alice(), "a1", week(-1)).await;
    let m = create(store, &mallory(), "m1", week(-1)).await;
    // (automation, created at, finished, manual key)
    let at = |w: i64, hours: i64| week(w) + Duration::hours(hours);
    let plan = [
        (&a, at(0, 1), true, None),
        (&a, at(0, 2), true, Some("k1")),
        (&a, at(1, 1), true, None),
        (&a, at(1, 2), false, None),
        (&m, at(2, 1), true, None),
        (&a, at(3, 1), true, None),
    ];
    let mut ids = Vec::new();
    for (automation, at, finished, key) in plan {
        let new = NewRun {
            trigger: if key.is_some() {
                RunTrigger::Manual
            } else {
                RunTrigger::Schedule
            },
            scheduled_for: key.is_none().then_some(at),
            idempotency_key: key.map(str::to_owned),
            ..new_run(automation, "")
        };
        let id = match key {
            Some(key) => manual_run_id(&automation.id, key, at),
            None => scheduled_run_id(&automation.id, at),
        };
        let new = NewRun {
            id: id.clone(),
            ..new
        };
        assert!(store.create_run(&new, at).await.expect("create").1);
        store
            .append_events(&id, &[text_event("e1", "working")], at)
            .await
            .expect("append");
        if finished {
            let end = at + Duration::seconds(1);
            store
                .finish_run(&receipt(&id, RunState::Succeeded), end)
                .await
                .expect("finish");
        }
        ids.push(id);
    }
    assert!(
        store
            .run_for_key(&alice(), "a1", "k1")
            .await
            .expect("key")
            .is_some()
    );
    // Each run is in its week (the ids' bounds and the partitions' agree);
    // an id of the old format in the legacy partition, one of a week that
    // has none in the default partition.
    let legacy = NewRun {
        id: "6d1f0c2b-9a7e-4e3f-8b52-1c4d7e9a03f1".into(),
        ..new_run(&a, "")
    };
    let unmade = NewRun {
        id: scheduled_run_id(&a.id, week(30)),
        trigger: RunTrigger::Schedule,
        idempotency_key: None,
        ..new_run(&a, "")
    };
    for new in [&legacy, &unmade] {
        assert!(store.create_run(new, at(3, 5)).await.expect("create").1);
    }
    if postgres {
        let mut parts = Vec::new();
        for id in ids.iter().chain([&legacy.id, &unmade.id]) {
            parts.push(internal.partition_of_run(id).await.expect("partition"));
        }
        let week_of = |n: i64| Some(format!("runs_p{}", name(n)));
        let expected = [
            week_of(0),
            week_of(0),
            week_of(1),
            week_of(1),
            week_of(2),
            week_of(3),
            Some("runs_legacy".into()),
            Some("runs_default".into()),
        ];
        assert_eq!(parts, expected);
    }

    // Weeks 0 to 2 ended more than the default retention (and the budget's
    // 32 days, the least a week is kept) ago; week 3 did not.
    let now = week(4) + Duration::days(26);
    // Writers go on meanwhile, creating, filling and ending runs of week 4
    // (whose partition the drop locks too, parent first): none waits on the
    // drop in a cycle, none fails, none is lost.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (store, stop, a) = (store.clone(), stop.clone(), a.clone());
        tokio::spawn(async move {
            let mut made = vec![];
            let mut n = 0i64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) || made.len() < 5 {
                let at = week(4) + Duration::seconds(n);
                let new = NewRun {
                    id: scheduled_run_id(&a.id, at),
                    trigger: RunTrigger::Schedule,
                    scheduled_for: Some(at),
                    idempotency_key: None,
                    ..new_run(&a, "")
                };
                store.create_run(&new, at).await?;
                store
                    .append_events(&new.id, &[text_event("e1", "working")], at)
                    .await?;
                store
                    .finish_run(&receipt(&new.id, RunState::Succeeded), at)
                    .await?;
                made.push(new.id);
                n += 1;
            }
            Ok::<_, StoreError>(made)
        })
    };
    let pass = internal.purge_expired(policy, now).await.expect("pass");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let made = writer
        .await
        .expect("writer")
        .expect("every write while the drop ran");
    for id in &made {
        assert!(
            internal.get_run(id).await.is_ok(),
            "{id} written meanwhile is there"
        );
        assert!(internal.receipt(id).await.expect("receipt").is_some());
    }
    assert!(pass.complete, "{pass:?}");
    let ours: Vec<&String> = pass
        .weeks_dropped
        .iter()
        .filter(|w| w.starts_with("2031"))
        .collect();
    match postgres {
        true => assert_eq!(ours, [&name(0)], "{pass:?}"),
        false => assert!(pass.weeks_dropped.is_empty(), "{pass:?}"),
    }
    // Week 0 gone whole; week 1's finished run gone in a batch, its live run
    // kept (the week with it); week 2 kept by mallory's 60 days; week 3's
    // run, 33 days old, is deleted by a batch on SQLite and left to its
    // week's drop on PostgreSQL (due once the week is 32 days behind).
    let kept = [false, false, false, true, true, postgres];
    for (id, kept) in ids.iter().zip(kept) {
        let run = internal.get_run(id).await;
        let events = internal.events(id, 0, 100).await.expect("events");
        let receipt = internal.receipt(id).await.expect("receipt");
        if kept {
            assert!(run.is_ok(), "{id} is kept: {run:?}");
            assert!(!events.is_empty(), "{id}'s events are kept");
        } else {
            assert!(matches!(run, Err(StoreError::NotFound)), "{id}: {run:?}");
            assert!(events.is_empty() && receipt.is_none(), "{id}");
        }
    }
    assert_eq!(pass.purged.runs, 4 - u64::from(postgres), "{pass:?}");
    assert_eq!(pass.purged.receipts, pass.purged.runs, "{pass:?}");
    // The key went with its run: it may name a new one.
    assert!(
        store
            .run_for_key(&alice(), "a1", "k1")
            .await
            .expect("key")
            .is_none()
    );
    if postgres {
        let weeks = internal.run_weeks().await.expect("weeks");
        assert!(!weeks.contains(&name(0)), "{weeks:?}");
        assert!(weeks.contains(&name(1)) && weeks.contains(&name(2)) && weeks.contains(&name(3)));
    }
    // Once week 3 is due, it goes too (a drop on PostgreSQL).
    let later = week(4) + Duration::days(40);
    let pass = internal.purge_expired(policy, later).await.expect("pass");
    assert!(matches!(
        internal.get_run(&ids[5]).await,
        Err(StoreError::NotFound)
    ));
    if postgres {
        assert!(pass.weeks_dropped.contains(&name(3)), "{pass:?}");
        assert!(
            !pass.weeks_dropped.contains(&name(1)),
            "a run in it is live"
        );
    }
    // The live run and mallory's are still there.
    assert!(internal.get_run(&ids[3]).await.is_ok());
    assert!(internal.get_run(&ids[4]).await.is_ok());
}

/// A manual run's idempotency key names one run, though a retry made at
/// another instant derives another id (the id starts with its time).
pub async fn a_manual_runs_key_names_one_run_whatever_its_id(store: &Store) {
    use automesh_domain::ids::manual_run_id;
    let a = create(store, &alice(), "a1", t(0)).await;
    let first = NewRun {
        id: manual_run_id(&a.id, "k", t(10)),
        idempotency_key: Some("k".into()),
        ..new_run(&a, "")
    };
    let (run, created) = store.create_run(&first, t(10)).await.expect("create");
    assert!(created);
    let retry = NewRun {
        id: manual_run_id(&a.id, "k", t(20)),
        ..first.clone()
    };
    assert_ne!(retry.id, first.id);
    let (again, created) = store.create_run(&retry, t(20)).await.expect("create");
    assert!(!created, "the key names a run already");
    assert_eq!(again.id, run.id);
    assert!(matches!(
        store.internal().get_run(&retry.id).await,
        Err(StoreError::NotFound)
    ));
    let found = store.run_for_key(&alice(), &a.id, "k").await.expect("key");
    assert_eq!(found.map(|r| r.id), Some(run.id.clone()));
    // Another owner never reaches it; another key makes another run.
    let other = store
        .run_for_key(&mallory(), &a.id, "k")
        .await
        .expect("key");
    assert!(other.is_none());
    let k2 = NewRun {
        id: manual_run_id(&a.id, "k2", t(20)),
        idempotency_key: Some("k2".into()),
        ..first.clone()
    };
    assert!(store.create_run(&k2, t(20)).await.expect("create").1);
}
