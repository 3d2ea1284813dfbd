//! Retention end to end, on SQLite and PostgreSQL: runs that ended longer
//! ago than the retention period are gone from the public API (and their
//! events and receipts with them), runs inside it are untouched, and a run
//! still going is never touched however old; one scheduler pass at a time.

use std::time::Duration;

use automesh_e2e_tests::executor::{Behavior, TestExecutor};
use automesh_e2e_tests::{
    Api, Mesh, MeshOptions, RunsApi, daily_automation, on_both_backends, wait_for,
};
use automesh_proto::v1 as pb;
use automesh_store::Backend;
use automesh_store::retention::Policy;

const DAY_MICROS: i64 = 86_400_000_000;

async fn old_finished_runs_go_and_everything_else_stays(backend: Backend) {
    let (_executor, addr) = TestExecutor::start(Behavior::Forever)
        .await
        .expect("executor");
    let options = MeshOptions {
        executor: Some(addr),
        ..MeshOptions::default()
    };
    let mesh = Mesh::start_with(backend, options).await.expect("mesh");
    let token = mesh.token("acme", "alice");
    let request = daily_automation("nightly report", "report", pb::Surface::Desktop);
    let a = mesh.automations(Some(&token)).create(request).await;
    let mut runs = mesh.runs(Some(&token));
    // Four runs working; three of them cancelled (ended), one left going.
    let mut ids = vec![];
    for key in ["old-1", "old-2", "old-live", "recent"] {
        let run = mesh.automations(Some(&token)).run_now(&a.id, key).await;
        let store = mesh.store().clone();
        let id = run.id.clone();
        wait_for(Duration::from_secs(30), "the run working", || {
            let (store, id) = (store.clone(), id.clone());
            async move {
                let run = store.internal().get_run(&id).await.ok()?;
                (run.state == automesh_domain::RunState::Running).then_some(())
            }
        })
        .await;
        ids.push(run.id);
    }
    let [old_1, old_2, old_live, recent] = [&ids[0], &ids[1], &ids[2], &ids[3]];
    for id in [old_1, old_2, recent] {
        runs.cancel(id).await;
        mesh.until_terminal(id, Duration::from_secs(30)).await;
    }
    assert!(!mesh.events(old_1).await.is_empty(), "events to delete");
    // Three of them were created 40 days ago. A run id starts with its
    // time, and PostgreSQL partitions runs by it, so there the two ended
    // ones also take the ids they would have had then (moving to the
    // partition of that time), everywhere their id is; the live one keeps
    // its id (the mesh is driving it).
    let moved = mesh
        .db
        .execute(&format!(
            "UPDATE runs SET created_at = created_at - {} WHERE id IN ('{old_1}', '{old_2}', '{old_live}')",
            40 * DAY_MICROS
        ))
        .await
        .expect("backdate");
    assert_eq!(moved, 3);
    let mut old = vec![];
    for id in [old_1, old_2] {
        if backend == Backend::Sqlite {
            old.push(id.clone());
            continue;
        }
        let made = automesh_domain::ids::run_id_time(id).expect("a time-ordered id");
        let then = automesh_domain::ids::run_id_bound(made - chrono::Duration::days(40));
        let new_id = format!("{then}{}", &id[then.len()..]);
        let tables = [
            ("runs", "id"),
            ("run_events", "run_id"),
            ("receipts", "run_id"),
            ("run_keys", "run_id"),
            ("desktop_assignments", "run_id"),
            ("desktop_events", "run_id"),
            ("cloud_dispatch", "run_id"),
        ];
        for (table, column) in tables {
            let sql = format!("UPDATE {table} SET {column} = '{new_id}' WHERE {column} = '{id}'");
            mesh.db.execute(&sql).await.expect("backdate the id");
        }
        let got = runs.get_run(pb::GetRunRequest { id: new_id.clone() }).await;
        assert!(got.is_ok(), "{new_id} is there before the pass: {got:?}");
        assert!(!mesh.events(&new_id).await.is_empty(), "events to delete");
        old.push(new_id);
    }
    // The mesh's scheduler ran a pass at its start; the next is due now.
    mesh.db
        .execute("UPDATE retention_passes SET claimed_until = 0")
        .await
        .expect("due");
    let settings = automesh_scheduler::retention::Settings {
        policy: Policy {
            default_days: 30,
            batch: 1,
            ..Policy::default()
        },
        every: Duration::from_secs(3600),
    };
    let store = mesh.store();
    let (x, y) = tokio::join!(
        automesh_scheduler::retention::pass_if_due(store, settings),
        automesh_scheduler::retention::pass_if_due(store, settings),
    );
    let (x, y) = (x.expect("pass"), y.expect("pass"));
    assert!(
        x.is_some() != y.is_some(),
        "one pass at a time: {x:?} {y:?}"
    );
    let pass = x.or(y).expect("a pass");
    assert_eq!(pass.purged.runs, 2, "{pass:?}");
    assert_eq!(pass.purged.receipts, 2, "{pass:?}");
    assert!(pass.purged.run_events >= 2, "{pass:?}");
    assert!(pass.complete);
    let again = automesh_scheduler::retention::pass_if_due(store, settings).await;
    assert!(
        again.expect("pass").is_none(),
        "the next pass is an hour away"
    );

    // Through the public API: the two old ended runs are unknown, the old
    // run still going and the recent one are as they were.
    for id in &old {
        let got = runs.get_run(pb::GetRunRequest { id: id.clone() }).await;
        assert_eq!(
            got.expect_err("deleted").code(),
            tonic::Code::NotFound,
            "{id}"
        );
        assert!(mesh.events(id).await.is_empty(), "{id}'s events are gone");
    }
    let live = runs
        .get_run(pb::GetRunRequest {
            id: old_live.clone(),
        })
        .await
        .expect("kept")
        .into_inner()
        .run
        .expect("run");
    assert_eq!(live.state(), pb::RunState::Running);
    let kept = mesh.receipt(recent).await;
    assert_eq!(kept.outcome, automesh_domain::RunState::Cancelled);
    let listed = runs
        .list_runs(pb::ListRunsRequest {
            automation_id: a.id.clone(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    let mut listed: Vec<String> = listed.runs.into_iter().map(|r| r.id).collect();
    listed.sort();
    let mut expected = vec![old_live.clone(), recent.clone()];
    expected.sort();
    assert_eq!(listed, expected);
    runs.cancel(old_live).await;
    mesh.until_terminal(old_live, Duration::from_secs(30)).await;
    mesh.stop().await.expect("stop");
}

on_both_backends!(old_finished_runs_go_and_everything_else_stays);
