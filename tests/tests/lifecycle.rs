//! Scheduling and the durable run lifecycle, end to end: the scheduler and
//! the coordinator over real gRPC, a test executor speaking the executor
//! contract, SQLite and PostgreSQL.

use std::time::Duration;

use automesh_domain::{AutomationState, ErrorCode, Principal, Run, RunState};
use automesh_e2e_tests::RunsApi;
use automesh_e2e_tests::executor::{Behavior, TestExecutor};
use automesh_e2e_tests::{Api, Mesh, MeshOptions, daily_automation, on_both_backends, wait_for};
use automesh_proto::v1 as pb;
use automesh_store::page::Cursor;
use automesh_store::{Backend, Store};
use chrono::{Timelike, Utc};

async fn terminal(store: &Store, run_id: &str, within: Duration) -> Run {
    wait_for(within, "the run to end", || async {
        store
            .internal()
            .get_run(run_id)
            .await
            .ok()
            .filter(|r| r.state.is_terminal())
    })
    .await
}

async fn all_runs(store: &Store, owner: &Principal) -> Vec<Run> {
    store
        .list_runs(owner, &Default::default(), &Cursor::start(), 1000)
        .await
        .expect("list runs")
        .items
}

fn daily(hours: i32, minutes: i32) -> pb::Schedule {
    pb::Schedule {
        kind: Some(pb::schedule::Kind::Daily(pb::DailySchedule {
            time_of_day: Some(pb::TimeOfDay { hours, minutes }),
            time_zone: "UTC".into(),
        })),
    }
}

fn once_in(d: Duration) -> pb::Schedule {
    let at = Utc::now() + chrono::Duration::from_std(d).expect("duration");
    pb::Schedule {
        kind: Some(pb::schedule::Kind::Once(pb::OnceSchedule {
            at: Some(automesh_edge::convert::timestamp(at)),
        })),
    }
}

async fn create(mesh: &Mesh, token: &str, schedule: pb::Schedule) -> pb::Automation {
    let mut request = daily_automation("lifecycle", "do the thing", pb::Surface::Desktop);
    if let Some(a) = request.automation.as_mut() {
        a.schedule = Some(schedule);
    }
    mesh.automations(Some(token)).create(request).await
}

async fn run_now(mesh: &Mesh, token: &str, automation_id: &str, key: &str) -> pb::Run {
    mesh.automations(Some(token))
        .run_now(automation_id, key)
        .await
}

async fn mesh_with(
    backend: Backend,
    behavior: Behavior,
    options: MeshOptions,
) -> (Mesh, TestExecutor) {
    let (executor, addr) = TestExecutor::start(behavior).await.expect("executor");
    let mesh = Mesh::start_with(
        backend,
        MeshOptions {
            executor: Some(addr),
            ..options
        },
    )
    .await
    .expect("mesh");
    (mesh, executor)
}

async fn a_due_occurrence_runs_to_a_receipt(backend: Backend) {
    let (mesh, executor) = mesh_with(
        backend,
        Behavior::Complete {
            after: Duration::from_millis(300),
            events: 3,
        },
        MeshOptions::default(),
    )
    .await;
    let token = mesh.token("acme", "alice");
    let owner = Principal::new("acme", "alice");
    let a = create(&mesh, &token, once_in(Duration::from_millis(1500))).await;
    let run = wait_for(Duration::from_secs(20), "the occurrence's run", || async {
        all_runs(mesh.store(), &owner).await.into_iter().next()
    })
    .await;
    let run = terminal(mesh.store(), &run.id, Duration::from_secs(20)).await;
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");
    assert_eq!(run.automation_id, a.id);
    assert_eq!(run.trigger, automesh_domain::RunTrigger::Schedule);
    let scheduled = a
        .next_run_time
        .as_ref()
        .and_then(automesh_edge::convert::from_timestamp);
    assert_eq!(run.scheduled_for, scheduled);
    assert_eq!(
        run.id,
        automesh_domain::ids::scheduled_run_id(&a.id, scheduled.expect("instant"))
    );
    assert!(run.trace_id().is_some(), "a scheduled run carries a trace");
    let message_id = run.message_id.clone().expect("message identity persisted");
    assert_eq!(executor.submissions(&message_id), 1);
    assert_eq!(
        executor.spec_of(&run.id).expect("spec").traceparent,
        run.traceparent.clone().unwrap_or_default()
    );

    let receipt = mesh.receipt(&run.id).await;
    assert_eq!(receipt.outcome, RunState::Succeeded);
    assert_eq!(receipt.engine.as_deref(), Some("test-executor"));
    assert_eq!(
        (
            receipt.usage.input_tokens,
            receipt.usage.output_tokens,
            receipt.usage.cost_micros
        ),
        // `fake/echo` has no price: the executor's own figure (42) is not
        // what the mesh charges.
        (10, 5, 0)
    );
    assert_eq!(receipt.price, None);
    assert_eq!(receipt.model.as_deref(), Some("fake/echo"));
    assert!(receipt.execution_micros > 0);
    assert_eq!(receipt.message_id.as_deref(), Some(message_id.as_str()));

    let events = mesh.events(&run.id).await;
    let texts = automesh_e2e_tests::assistant_texts(&events);
    assert_eq!(texts, 3);
    assert!(
        events
            .windows(2)
            .all(|w| w[0].sequence + 1 == w[1].sequence)
    );
    // A once schedule has nothing left to run.
    let after = mesh
        .store()
        .get_automation(&owner, &a.id)
        .await
        .expect("automation");
    assert_eq!(after.next_run_at, None);
    mesh.stop().await.expect("stop");
}

async fn a_killed_coordinator_is_taken_over_without_a_second_submission(backend: Backend) {
    let options = MeshOptions {
        lease: Duration::from_secs(1),
        ..MeshOptions::default()
    };
    let (mut mesh, executor) = mesh_with(
        backend,
        Behavior::Complete {
            after: Duration::from_secs(4),
            events: 4,
        },
        options,
    )
    .await;
    let token = mesh.token("acme", "alice");
    let a = create(&mesh, &token, daily(3, 0)).await;
    let run = run_now(&mesh, &token, &a.id, "takeover").await;
    wait_for(Duration::from_secs(10), "the run to be running", || async {
        mesh.store()
            .internal()
            .get_run(&run.id)
            .await
            .ok()
            .filter(|r| r.state == RunState::Running)
    })
    .await;
    // Kill the coordinator without any cleanup: its lease just stops being renewed.
    mesh.coordinators[0].abort();
    mesh.add_coordinator().await.expect("second coordinator");
    let ended = terminal(mesh.store(), &run.id, Duration::from_secs(30)).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    let message_id = ended.message_id.clone().expect("message id");
    assert_eq!(
        executor.submissions(&message_id),
        1,
        "the prompt was submitted exactly once"
    );
    assert!(
        executor.start_calls(&run.id) >= 2,
        "the second coordinator reattached through StartRun"
    );
    let events = mesh.events(&run.id).await;
    let texts = automesh_e2e_tests::assistant_texts(&events);
    assert_eq!(texts, 4, "redelivered executor events were deduplicated");
    mesh.stop().await.expect("stop");
}

async fn three_days_of_downtime_catch_up_once(backend: Backend) {
    let (mesh, _executor) = mesh_with(
        backend,
        Behavior::Complete {
            after: Duration::from_millis(100),
            events: 0,
        },
        MeshOptions::default(),
    )
    .await;
    let token = mesh.token("acme", "alice");
    let owner = Principal::new("acme", "alice");
    let slot = Utc::now() - chrono::Duration::minutes(30);
    let a = create(
        &mesh,
        &token,
        daily(slot.hour() as i32, slot.minute() as i32),
    )
    .await;
    // The scheduler was down for three days: the stored next occurrence is
    // the one three days ago.
    let today = slot
        .with_second(0)
        .and_then(|t| t.with_nanosecond(0))
        .expect("slot");
    let three_days_ago = today - chrono::Duration::days(3);
    endpoint(&mesh, &owner).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE automations SET next_run_at = {} WHERE id = '{}'",
        three_days_ago.timestamp_micros(),
        a.id
    )))
    .execute(mesh.store().pool())
    .await
    .expect("simulate downtime");
    let runs = wait_for(Duration::from_secs(20), "four runs, all ended", || async {
        let runs = all_runs(mesh.store(), &owner).await;
        (runs.len() >= 4 && runs.iter().all(|r| r.state.is_terminal())).then_some(runs)
    })
    .await;
    assert_eq!(runs.len(), 4, "{runs:#?}");
    let missed: Vec<&Run> = runs
        .iter()
        .filter(|r| r.state == RunState::Missed)
        .collect();
    let ran: Vec<&Run> = runs
        .iter()
        .filter(|r| r.state == RunState::Succeeded)
        .collect();
    assert_eq!(missed.len(), 3);
    assert_eq!(ran.len(), 1, "exactly one catch-up run");
    assert_eq!(
        ran[0].scheduled_for,
        Some(today),
        "the catch-up is the latest missed occurrence"
    );
    for m in &missed {
        assert_eq!(m.error_code, Some(ErrorCode::MissedDuringDowntime));
        let receipt = mesh.receipt(&m.id).await;
        assert_eq!(receipt.outcome, RunState::Missed);
    }
    let after = mesh
        .store()
        .get_automation(&owner, &a.id)
        .await
        .expect("automation");
    assert_eq!(after.next_run_at, Some(today + chrono::Duration::days(1)));
    // The owner is told once of the three missed occurrences.
    let told = told(&mesh, &owner, "automation.occurrences_missed").await;
    assert_eq!(told.len(), 1, "{told:?}");
    let body: serde_json::Value = serde_json::from_str(&told[0]).expect("json");
    assert_eq!(body["data"]["missed"], 3);
    assert_eq!(body["data"]["automation"]["id"], a.id.as_str());
    mesh.stop().await.expect("stop");
}

async fn an_occurrence_while_the_previous_run_is_live_is_skipped(backend: Backend) {
    let (mesh, _executor) = mesh_with(backend, Behavior::Forever, MeshOptions::default()).await;
    let token = mesh.token("acme", "alice");
    let owner = Principal::new("acme", "alice");
    let a = create(&mesh, &token, daily(4, 0)).await;
    let live = run_now(&mesh, &token, &a.id, "long").await;
    wait_for(
        Duration::from_secs(10),
        "the manual run to be running",
        || async {
            mesh.store()
                .internal()
                .get_run(&live.id)
                .await
                .ok()
                .filter(|r| r.state == RunState::Running)
        },
    )
    .await;
    let due = Utc::now();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE automations SET next_run_at = {} WHERE id = '{}'",
        due.timestamp_micros(),
        a.id
    )))
    .execute(mesh.store().pool())
    .await
    .expect("make an occurrence due");
    let skipped = wait_for(
        Duration::from_secs(20),
        "the skipped occurrence",
        || async {
            all_runs(mesh.store(), &owner)
                .await
                .into_iter()
                .find(|r| r.state == RunState::Skipped)
        },
    )
    .await;
    assert_eq!(skipped.error_code, Some(ErrorCode::PreviousRunLive));
    let receipt = mesh.receipt(&skipped.id).await;
    assert_eq!(receipt.outcome, RunState::Skipped);
    assert_eq!(
        all_runs(mesh.store(), &owner).await.len(),
        2,
        "nothing was queued"
    );
    let cancelled = mesh.runs(Some(&token)).cancel(&live.id).await;
    assert_eq!(cancelled.state, pb::RunState::Cancelled as i32);
    mesh.stop().await.expect("stop");
}

async fn durable_failures_need_attention_until_a_run_succeeds(backend: Backend) {
    let (mesh, executor) = mesh_with(
        backend,
        Behavior::Fail("runtime_missing"),
        MeshOptions::default(),
    )
    .await;
    let token = mesh.token("acme", "alice");
    let owner = Principal::new("acme", "alice");
    let a = create(&mesh, &token, daily(5, 0)).await;
    let first = run_now(&mesh, &token, &a.id, "first").await;
    let failed = terminal(mesh.store(), &first.id, Duration::from_secs(20)).await;
    assert_eq!(
        (failed.state, failed.error_code),
        (RunState::Failed, Some(ErrorCode::RuntimeMissing))
    );
    let paused = wait_for(Duration::from_secs(10), "needs attention", || async {
        mesh.store()
            .get_automation(&owner, &a.id)
            .await
            .ok()
            .filter(|a| a.state == AutomationState::NeedsAttention)
    })
    .await;
    assert_eq!(
        paused.attention.map(|x| x.reason),
        Some(ErrorCode::RuntimeMissing)
    );
    assert_eq!(paused.next_run_at, None, "the schedule is paused");
    // Run now still works, and success clears the attention.
    executor.set_behavior(Behavior::Complete {
        after: Duration::from_millis(100),
        events: 1,
    });
    let second = run_now(&mesh, &token, &a.id, "second").await;
    assert_eq!(
        terminal(mesh.store(), &second.id, Duration::from_secs(20))
            .await
            .state,
        RunState::Succeeded
    );
    let cleared = wait_for(Duration::from_secs(10), "attention cleared", || async {
        mesh.store()
            .get_automation(&owner, &a.id)
            .await
            .ok()
            .filter(|a| a.state == AutomationState::Active)
    })
    .await;
    assert_eq!(cleared.attention, None);
    assert!(cleared.next_run_at.is_some());
    mesh.stop().await.expect("stop");
}

on_both_backends!(
    a_due_occurrence_runs_to_a_receipt,
    a_killed_coordinator_is_taken_over_without_a_second_submission,
    three_days_of_downtime_catch_up_once,
    an_occurrence_while_the_previous_run_is_live_is_skipped,
    durable_failures_need_attention_until_a_run_succeeds,
    a_failure_streak_pauses_its_automation_until_activated,
    a_spent_monthly_budget_skips_runs_until_the_month_ends_or_it_is_raised,
    an_executor_that_ignores_the_budget_is_stopped_by_the_coordinator,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_executor_never_answers_times_out_at_its_deadline() {
    // Nothing listens on port 9: every StartRun fails to connect.
    let mesh = Mesh::start_with(
        Backend::Sqlite,
        MeshOptions {
            executor: Some("http://127.0.0.1:9".into()),
            run_deadline: Duration::from_secs(2),
            cancel_bound: Duration::from_secs(1),
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh");
    let token = mesh.token("acme", "alice");
    let a = create(&mesh, &token, daily(6, 0)).await;
    let run = run_now(&mesh, &token, &a.id, "silent").await;
    let ended = terminal(mesh.store(), &run.id, Duration::from_secs(20)).await;
    assert_eq!(
        (ended.state, ended.error_code),
        // A desktop run that no executor ever took: no runner took it (SPEC §6).
        (RunState::TimedOut, Some(ErrorCode::RunnerOffline))
    );
    assert!(
        ended.updated_at >= ended.deadline_at,
        "ended at, not before, its deadline"
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_never_finishes_is_cancelled_on_its_executor_at_the_deadline() {
    let (mesh, executor) = mesh_with(
        Backend::Sqlite,
        Behavior::Forever,
        MeshOptions {
            run_deadline: Duration::from_secs(2),
            ..MeshOptions::default()
        },
    )
    .await;
    let token = mesh.token("acme", "alice");
    let a = create(&mesh, &token, daily(6, 0)).await;
    let run = run_now(&mesh, &token, &a.id, "forever").await;
    let ended = terminal(mesh.store(), &run.id, Duration::from_secs(20)).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::TimedOut, Some(ErrorCode::DeadlineExceeded))
    );
    assert!(
        executor.was_cancelled(&run.id),
        "the deadline cancelled the run on its executor"
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_cancelled_once_the_executor_is_idle() {
    let (mesh, executor) =
        mesh_with(Backend::Sqlite, Behavior::Forever, MeshOptions::default()).await;
    let token = mesh.token("acme", "alice");
    let a = create(&mesh, &token, daily(7, 0)).await;
    let run = run_now(&mesh, &token, &a.id, "c").await;
    wait_for(Duration::from_secs(10), "running", || async {
        mesh.store()
            .internal()
            .get_run(&run.id)
            .await
            .ok()
            .filter(|r| r.state == RunState::Running)
    })
    .await;
    let answered = mesh.runs(Some(&token)).cancel(&run.id).await;
    assert_eq!(answered.state, pb::RunState::Cancelled as i32);
    assert!(answered.error_code.is_empty());
    assert!(executor.was_cancelled(&run.id));
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_recorded_by_another_replica_reaches_its_drive() {
    let (mesh, executor) =
        mesh_with(Backend::Postgres, Behavior::Forever, MeshOptions::default()).await;
    let token = mesh.token("acme", "alice");
    let a = create(&mesh, &token, daily(7, 30)).await;
    let run = run_now(&mesh, &token, &a.id, "remote").await;
    wait_for(Duration::from_secs(10), "running", || async {
        mesh.store()
            .internal()
            .get_run(&run.id)
            .await
            .ok()
            .filter(|r| r.state == RunState::Running)
    })
    .await;
    // What another replica's CancelRun does: record the request, with no
    // in-process signal to this driver. The heartbeat must bring it.
    assert!(
        mesh.store()
            .internal()
            .request_cancel(&run.id, Utc::now())
            .await
            .expect("request")
    );
    let ended = terminal(mesh.store(), &run.id, Duration::from_secs(20)).await;
    assert_eq!((ended.state, ended.error_code), (RunState::Cancelled, None));
    assert!(executor.was_cancelled(&run.id));
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_an_executor_that_never_goes_idle_ends_cancel_unobserved() {
    let (mesh, _executor) = mesh_with(
        Backend::Sqlite,
        Behavior::IgnoreCancel,
        MeshOptions {
            cancel_bound: Duration::from_secs(1),
            ..MeshOptions::default()
        },
    )
    .await;
    let token = mesh.token("acme", "alice");
    let a = create(&mesh, &token, daily(8, 0)).await;
    let run = run_now(&mesh, &token, &a.id, "stuck").await;
    wait_for(Duration::from_secs(10), "running", || async {
        mesh.store()
            .internal()
            .get_run(&run.id)
            .await
            .ok()
            .filter(|r| r.state == RunState::Running)
    })
    .await;
    mesh.runs(Some(&token))
        .cancel_run(pb::CancelRunRequest { id: run.id.clone() })
        .await
        .expect("cancel");
    let ended = terminal(mesh.store(), &run.id, Duration::from_secs(20)).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Cancelled, Some(ErrorCode::CancelUnobserved))
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_due_at_once_on_two_schedulers_and_two_coordinators() {
    use automesh_domain::automation::NewAutomation;
    let (mesh, executor) = mesh_with(
        Backend::Postgres,
        Behavior::Complete {
            after: Duration::from_millis(50),
            events: 1,
        },
        MeshOptions {
            schedulers: 2,
            coordinators: 2,
            ..MeshOptions::default()
        },
    )
    .await;
    let due = Utc::now() + chrono::Duration::seconds(3);
    let now = Utc::now();
    for i in 0..500 {
        let owner = Principal::new("acme", format!("user-{}", i % 7));
        let new = NewAutomation {
            pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
            budget: Default::default(),
            monthly_budget_micros: None,
            id: format!("bulk-{i:03}"),
            owner: owner.clone(),
            name: format!("bulk {i}"),
            prompt: "p".into(),
            model: "fake/echo".into(),
            surface: automesh_domain::Surface::Web,
            schedule: automesh_domain::Schedule::Once { at: due },
        };
        mesh.store()
            .create_automation(&new, Some(due), now)
            .await
            .expect("create");
    }
    let store = mesh.store().clone();
    let count = |sql: &'static str| {
        let store = store.clone();
        async move {
            let n: i64 = sqlx::query_scalar(sql)
                .fetch_one(store.pool())
                .await
                .expect("count");
            n
        }
    };
    wait_for(Duration::from_secs(120), "500 terminal runs", || async {
        (count("SELECT COUNT(*) FROM runs WHERE state = 'succeeded'").await == 500).then_some(())
    })
    .await;
    assert_eq!(
        count("SELECT COUNT(*) FROM runs").await,
        500,
        "exactly one run per occurrence"
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM receipts").await,
        500,
        "exactly one receipt per run"
    );
    assert_eq!(
        count("SELECT COUNT(DISTINCT automation_id) FROM runs").await,
        500
    );
    let submissions = executor.all_submissions();
    assert_eq!(submissions.len(), 500);
    assert!(
        submissions.values().all(|n| *n == 1),
        "every prompt submitted exactly once"
    );
    mesh.stop().await.expect("stop");
}

/// A scheduled run created just ahead of its instant, as the scheduler
/// creates an on-time occurrence's, is claimed and held by the coordinator:
/// its executor has it at its instant, never before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_created_ahead_of_its_instant_starts_at_it_never_before() {
    use automesh_domain::automation::NewAutomation;
    use automesh_domain::run::NewRun;
    let (mesh, executor) = mesh_with(
        Backend::Postgres,
        Behavior::Complete {
            after: Duration::from_millis(20),
            events: 0,
        },
        MeshOptions::default(),
    )
    .await;
    let owner = Principal::new("acme", "alice");
    let new = NewAutomation {
        pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
        budget: Default::default(),
        monthly_budget_micros: None,
        id: "ahead".into(),
        owner: owner.clone(),
        name: "ahead".into(),
        prompt: "p".into(),
        model: "fake/echo".into(),
        surface: automesh_domain::Surface::Web,
        schedule: automesh_domain::Schedule::Once { at: Utc::now() },
    };
    let a = mesh
        .store()
        .create_automation(&new, None, Utc::now())
        .await
        .expect("create");
    let lead = chrono::Duration::from_std(automesh_store::leases::CLAIM_AHEAD / 2).expect("lead");
    let mut runs = vec![];
    for _ in 0..5 {
        let now = Utc::now();
        let at = now + lead;
        let run = NewRun {
            id: automesh_domain::ids::scheduled_run_id(&a.id, at),
            automation: &a,
            trigger: automesh_domain::RunTrigger::Schedule,
            scheduled_for: Some(at),
            idempotency_key: None,
            state: RunState::Pending,
            error: None,
            deadline_at: now + chrono::Duration::seconds(60),
            traceparent: None,
        };
        let (run, created) = mesh.store().create_run(&run, now).await.expect("run");
        assert!(created);
        let run = terminal(mesh.store(), &run.id, Duration::from_secs(30)).await;
        assert_eq!(run.state, RunState::Succeeded, "{run:?}");
        runs.push(run);
    }
    let starts = executor.first_starts();
    for run in &runs {
        let at = run.scheduled_for.expect("instant");
        assert!(run.created_at < at, "created ahead: {run:?}");
        assert!(
            starts[&run.id] >= at,
            "started {} before its instant {at}",
            starts[&run.id]
        );
    }
    mesh.stop().await.expect("stop");
}

/// A coordinator driving as many runs as it may claims the next the moment
/// one of its runs ends, not at its next safety poll (an hour here): three
/// runs through a coordinator that drives one at a time, each started only
/// after the one before it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_coordinator_claims_the_next_run_as_one_ends() {
    let (mesh, executor) = mesh_with(
        Backend::Postgres,
        Behavior::Complete {
            after: Duration::from_millis(200),
            events: 0,
        },
        MeshOptions {
            max_runs: 1,
            claim_poll: Duration::from_secs(3600),
            ..MeshOptions::default()
        },
    )
    .await;
    let token = mesh.token("acme", "alice");
    let mut runs = vec![];
    for i in 0..3 {
        let a = create(&mesh, &token, daily(6, 0)).await;
        runs.push(run_now(&mesh, &token, &a.id, &format!("one-at-a-time-{i}")).await);
    }
    let mut ended = vec![];
    for run in &runs {
        ended.push(terminal(mesh.store(), &run.id, Duration::from_secs(30)).await);
    }
    assert!(
        ended.iter().all(|r| r.state == RunState::Succeeded),
        "every run succeeded: {ended:?}"
    );
    let starts = executor.first_starts();
    let mut spans: Vec<_> = ended
        .iter()
        .map(|r| (starts[&r.id], r.updated_at))
        .collect();
    spans.sort();
    for pair in spans.windows(2) {
        assert!(
            pair[1].0 >= pair[0].1,
            "a run started before the one before it ended: {spans:?}"
        );
    }
    mesh.stop().await.expect("stop");
}

/// Failure streaks through the public API (issue 32): `pause_after_failures`
/// is set on create and changed by an update that names it; after that many
/// runs in a row end failed, whatever their codes, the automation needs
/// attention (`failing_repeatedly`), its schedule paused, its streak and its
/// runs' codes shown; activating it ends the streak. Bad values are named
/// INVALID_ARGUMENTs.
async fn a_failure_streak_pauses_its_automation_until_activated(backend: Backend) {
    let (mesh, executor) = mesh_with(
        backend,
        Behavior::Fail("provider_error"),
        MeshOptions::default(),
    )
    .await;
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let invalid = |value: i32| {
        let mut request = daily_automation("streak", "do the thing", pb::Surface::Desktop);
        if let Some(a) = request.automation.as_mut() {
            a.pause_after_failures = Some(value);
        }
        request
    };
    for bad in [-1, 1001] {
        let status = api
            .create_automation(invalid(bad))
            .await
            .expect_err("a bad pause_after_failures is refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad}");
        assert!(
            status.message().contains("automation.pause_after_failures"),
            "{bad}: {}",
            status.message()
        );
    }
    // Unset means 3.
    let defaulted = create(&mesh, &token, daily(5, 0)).await;
    assert_eq!(defaulted.pause_after_failures, Some(3));
    let a = api
        .create_automation(invalid(2))
        .await
        .expect("create")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!((a.pause_after_failures, a.failure_streak), (Some(2), 0));
    let get = |id: String| {
        let mut api = api.clone();
        async move {
            api.get_automation(pb::GetAutomationRequest { id })
                .await
                .expect("get")
                .into_inner()
                .automation
                .expect("automation")
        }
    };
    let first = run_now(&mesh, &token, &a.id, "first").await;
    terminal(mesh.store(), &first.id, Duration::from_secs(20)).await;
    let one = get(a.id.clone()).await;
    assert_eq!(one.state, pb::AutomationState::Active as i32);
    assert_eq!(one.failure_streak, 1);
    let second = run_now(&mesh, &token, &a.id, "second").await;
    let failed = terminal(mesh.store(), &second.id, Duration::from_secs(20)).await;
    assert_eq!(failed.error_code, Some(ErrorCode::ProviderError));
    // Moved with the run's end, in its transaction: no wait.
    let paused = get(a.id.clone()).await;
    assert_eq!(paused.state, pb::AutomationState::NeedsAttention as i32);
    assert_eq!(paused.attention_reason, "failing_repeatedly");
    assert!(
        paused.attention_message.contains("2 runs in a row"),
        "{paused:?}"
    );
    assert_eq!(paused.failure_streak, 2);
    assert_eq!(
        paused.failure_streak_codes,
        ["provider_error", "provider_error"]
    );
    assert_eq!(paused.next_run_time, None, "its schedule is paused");
    // Activation ends the streak and resumes the schedule.
    executor.set_behavior(Behavior::Complete {
        after: Duration::from_millis(50),
        events: 1,
    });
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
    assert_eq!(active.attention_reason, "");
    assert_eq!(active.failure_streak, 0);
    assert!(active.failure_streak_codes.is_empty());
    assert!(active.next_run_time.is_some());
    // An update changes it only when its mask names it.
    let update = |value: Option<i32>, paths: &[&str]| pb::UpdateAutomationRequest {
        automation: Some(pb::Automation {
            id: a.id.clone(),
            name: "renamed".into(),
            pause_after_failures: value,
            etag: String::new(),
            ..active.clone()
        }),
        update_mask: Some(prost_types::FieldMask {
            paths: paths.iter().map(|p| (*p).to_owned()).collect(),
        }),
    };
    let renamed = api
        .update_automation(update(Some(9), &["name"]))
        .await
        .expect("rename")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(renamed.pause_after_failures, Some(2), "not in the mask");
    let off = api
        .update_automation(update(Some(0), &["pause_after_failures"]))
        .await
        .expect("turn off")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(off.pause_after_failures, Some(0));
    for (value, why) in [
        (Some(-3), "between 0"),
        (None, "required when update_mask names it"),
    ] {
        let status = api
            .update_automation(update(value, &["pause_after_failures"]))
            .await
            .expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains(why), "{}", status.message());
    }
    mesh.stop().await.expect("stop");
}

/// Monthly budgets (issue 32): once the runs created this month (in the
/// schedule's zone) cost the budget, a run-now and a due occurrence do not
/// start — each is recorded as a run skipped with `budget_exhausted` on its
/// receipt, listed by that reason — and the automation needs attention,
/// its schedule paused, until the month ends (the scheduler's month sweep)
/// or its owner raises the budget.
async fn a_spent_monthly_budget_skips_runs_until_the_month_ends_or_it_is_raised(backend: Backend) {
    let (mesh, _executor) = mesh_with(
        backend,
        Behavior::Complete {
            after: Duration::from_millis(50),
            events: 1,
        },
        MeshOptions::default(),
    )
    .await;
    let token = mesh.token("acme", "alice");
    let owner = Principal::new("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    endpoint(&mesh, &owner).await;
    let with_budget = |schedule: pb::Schedule, budget: i64| {
        let mut request = daily_automation("budgeted", "do the thing", pb::Surface::Desktop);
        if let Some(a) = request.automation.as_mut() {
            a.schedule = Some(schedule);
            a.monthly_budget_micros = Some(budget);
        }
        request
    };
    let a = api
        .create_automation(with_budget(daily(5, 0), 50))
        .await
        .expect("create")
        .into_inner()
        .automation
        .expect("automation");
    // A run of this month, and another that cost 60 micro-units, recorded
    // as a coordinator would.
    let first = run_now(&mesh, &token, &a.id, "spend").await;
    let ended = terminal(mesh.store(), &first.id, Duration::from_secs(20)).await;
    assert_eq!(ended.state, RunState::Succeeded);
    let stored = mesh.store().get_automation(&owner, &a.id).await.expect("a");
    let extra = automesh_domain::run::NewRun {
        id: "spent-elsewhere".into(),
        automation: &stored,
        trigger: automesh_domain::RunTrigger::Manual,
        scheduled_for: None,
        idempotency_key: Some("spent-elsewhere".into()),
        state: RunState::Pending,
        error: None,
        deadline_at: Utc::now() + chrono::Duration::hours(1),
        traceparent: None,
    };
    mesh.store()
        .create_run(&extra, Utc::now())
        .await
        .expect("create");
    let mut receipt = automesh_domain::Receipt::bare(
        "spent-elsewhere",
        RunState::Succeeded,
        automesh_domain::Placement::Desktop,
        Utc::now(),
    );
    receipt.usage.cost_micros = 60;
    mesh.store()
        .finish_run(&receipt, Utc::now())
        .await
        .expect("finish");

    // A run-now does not start: skipped, with the reason on its receipt.
    let skipped = run_now(&mesh, &token, &a.id, "over").await;
    let over_id = skipped.id.clone();
    assert_eq!(skipped.state, pb::RunState::Skipped as i32);
    assert_eq!(skipped.error_code, "budget_exhausted");
    let receipt = mesh.receipt(&skipped.id).await;
    assert_eq!(receipt.error_code, Some(ErrorCode::BudgetExhausted));
    // The same key answers the same run.
    assert_eq!(run_now(&mesh, &token, &a.id, "over").await.id, skipped.id);
    let reader = api.clone();
    let get = |id: String| {
        let mut api = reader.clone();
        async move {
            api.get_automation(pb::GetAutomationRequest { id })
                .await
                .expect("get")
                .into_inner()
                .automation
                .expect("automation")
        }
    };
    let paused = get(a.id.clone()).await;
    assert_eq!(paused.state, pb::AutomationState::NeedsAttention as i32);
    assert_eq!(paused.attention_reason, "budget_exhausted");
    assert_eq!(paused.next_run_time, None, "its schedule is paused");
    assert!(
        paused.month_spend_micros.is_some_and(|s| s >= 60),
        "{paused:?}"
    );
    let listed = mesh
        .runs(Some(&token))
        .list_runs(pb::ListRunsRequest {
            error_codes: vec!["budget_exhausted".into()],
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .runs;
    assert_eq!(
        listed.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        [skipped.id.as_str()]
    );

    // The month ends: the sweep makes it active from the new month's first
    // occurrence (nothing is spent in that month yet).
    let (_, next_month) = automesh_domain::automation::month_of(Utc::now(), stored.schedule.zone());
    let resumed = automesh_scheduler::budget::resume_spent_months(
        mesh.store(),
        next_month + chrono::Duration::minutes(1),
    )
    .await
    .expect("sweep");
    assert_eq!(resumed, 1);
    let active = get(a.id.clone()).await;
    assert_eq!(active.state, pb::AutomationState::Active as i32);
    let next = active
        .next_run_time
        .as_ref()
        .and_then(automesh_edge::convert::from_timestamp);
    assert!(
        next.is_some_and(|t| t >= next_month),
        "{next:?} before {next_month}"
    );

    // Spent again this month; raising the budget above the spend resumes it.
    run_now(&mesh, &token, &a.id, "again").await;
    assert_eq!(
        get(a.id.clone()).await.state,
        pb::AutomationState::NeedsAttention as i32
    );
    let raised = api
        .update_automation(pb::UpdateAutomationRequest {
            automation: Some(pb::Automation {
                id: a.id.clone(),
                monthly_budget_micros: Some(10_000),
                ..Default::default()
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["monthly_budget_micros".into()],
            }),
        })
        .await
        .expect("raise")
        .into_inner()
        .automation
        .expect("automation");
    assert_eq!(raised.state, pb::AutomationState::Active as i32);
    assert_eq!(raised.attention_reason, "");
    assert!(raised.next_run_time.is_some());
    let runs = run_now(&mesh, &token, &a.id, "within").await;
    assert_eq!(runs.state, pb::RunState::Pending as i32);

    // A due occurrence finds the budget spent (0 is spent at once).
    let soon = Utc::now() + chrono::Duration::seconds(2);
    let once = pb::Schedule {
        kind: Some(pb::schedule::Kind::Once(pb::OnceSchedule {
            at: Some(automesh_edge::convert::timestamp(soon)),
        })),
    };
    let b = api
        .create_automation(with_budget(once, 0))
        .await
        .expect("create")
        .into_inner()
        .automation
        .expect("automation");
    let skipped = wait_for(
        Duration::from_secs(20),
        "the occurrence to be skipped",
        || async {
            all_runs(mesh.store(), &owner)
                .await
                .into_iter()
                .find(|r| r.automation_id == b.id)
        },
    )
    .await;
    assert_eq!(
        (skipped.state, skipped.error_code),
        (RunState::Skipped, Some(ErrorCode::BudgetExhausted))
    );
    let b = get(b.id.clone()).await;
    assert_eq!(b.state, pb::AutomationState::NeedsAttention as i32);
    assert_eq!(b.attention_reason, "budget_exhausted");
    // The owner is told each time a spent budget pauses an automation
    // (the run-now's and the occurrence's), by a message written with the
    // skipped run.
    let told = told(&mesh, &owner, "automation.budget_reached").await;
    for (automation, run) in [(&a.id, &over_id), (&b.id, &skipped.id)] {
        assert!(
            told.iter()
                .any(|m| m.contains(automation.as_str()) && m.contains(run.as_str())),
            "{automation}/{run} not told: {told:?}"
        );
    }
    mesh.stop().await.expect("stop");
}

/// An endpoint of `owner`'s that no delivery reaches (its messages stay in
/// the outbox, where a test reads them).
async fn endpoint(mesh: &Mesh, owner: &Principal) {
    let endpoint = automesh_domain::WebhookEndpoint {
        id: "ep_lifecycle".into(),
        org_id: owner.org_id.clone(),
        owner_id: owner.user_id.clone(),
        url: "http://127.0.0.1:9/unused".into(),
        description: String::new(),
        created_at: Utc::now(),
        disabled_at: None,
        disabled_reason: None,
    };
    let made = mesh.store().create_webhook_endpoint(&endpoint).await;
    made.expect("endpoint");
}

/// The payloads of the messages of type `kind` written for `owner`.
async fn told(mesh: &Mesh, owner: &Principal, kind: &str) -> Vec<String> {
    let messages = mesh.store().webhook_messages(owner, "ep_lifecycle", 500);
    let messages = messages.await.expect("messages");
    messages
        .into_iter()
        .filter(|m| m.event_type.as_str() == kind)
        .map(|m| m.payload)
        .collect()
}

/// The budget per run is the coordinator's to enforce as well (issue 32):
/// an executor whose engine ignores it (a third-party runner, say) keeps
/// reporting usage; once the reported tokens go over `max_tokens`, the
/// coordinator cancels the run on its executor and the run ends failed,
/// `budget_exceeded`.
async fn an_executor_that_ignores_the_budget_is_stopped_by_the_coordinator(backend: Backend) {
    let (mesh, executor) = mesh_with(
        backend,
        Behavior::Spend {
            input: 100,
            output: 20,
            every: Duration::from_millis(100),
        },
        MeshOptions::default(),
    )
    .await;
    let token = mesh.token("acme", "alice");
    let mut request = daily_automation("capped", "do the thing", pb::Surface::Desktop);
    if let Some(a) = request.automation.as_mut() {
        // Over it at the third step (360 tokens).
        a.max_tokens = Some(300);
    }
    let a = mesh.automations(Some(&token)).create(request).await;
    let run = run_now(&mesh, &token, &a.id, "capped").await;
    let ended = terminal(mesh.store(), &run.id, Duration::from_secs(20)).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Failed, Some(ErrorCode::BudgetExceeded)),
        "{ended:?}"
    );
    assert!(
        executor.was_cancelled(&run.id),
        "the executor was not told to stop"
    );
    // Stopped within a batch or two of going over, not at its deadline.
    let steps = executor.events(&run.id);
    assert!((3..=6).contains(&steps), "{steps} steps reported");
    let receipt = mesh.receipt(&run.id).await;
    assert_eq!(receipt.budget.max_tokens, Some(300));
    // What it spent, as its events reported it (its cancelled outcome
    // reported none).
    assert!(receipt.usage.input_tokens >= 300, "{:?}", receipt.usage);
    mesh.stop().await.expect("stop");
}
