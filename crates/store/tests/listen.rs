//! On PostgreSQL, a watcher is woken by a NOTIFY from another process (here:
//! another pool that signals nothing in this process) — the path by which an
//! assignment offered on one gateway replica reaches the replica holding the
//! runner's stream. Alone in its binary, so no in-process signal interferes.

use std::time::Duration;

use automesh_store::testing::TestDatabase;
use automesh_store::{Backend, Store, StoreOptions, Topic};

/// One NOTIFY on `channel` through `other`, then a tenth of a second.
async fn notify(other: &Store, channel: &str, payload: &str) {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(channel)
        .bind(payload)
        .execute(other.pool())
        .await
        .expect("notify");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Notifies until `woken` has finished, for at most 30 s; whether it did.
async fn notify_until_woken(
    other: &Store,
    channel: &str,
    payload: &str,
    woken: &tokio::task::JoinHandle<()>,
) -> bool {
    let notifying = async {
        while !woken.is_finished() {
            notify(other, channel, payload).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), notifying)
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notify_from_another_connection_wakes_a_desktop_watcher() {
    let db = TestDatabase::new(Backend::Postgres)
        .await
        .expect("test database (is PostgreSQL running? see README)");
    let mut watcher = db.store.watch(Topic::Desktop).await;
    let other = Store::connect_lazy(&db.url, StoreOptions::default()).expect("pool");
    let woken = tokio::spawn(async move {
        // Far longer than the test's own bound: only the NOTIFY can end it.
        watcher.wait(Duration::from_secs(3600)).await;
    });
    // Keep notifying until woken (the LISTEN may register a moment later).
    assert!(
        notify_until_woken(&other, "automesh_desktop", "", &woken).await,
        "the watcher never heard the NOTIFY"
    );
    db.remove().await.expect("remove");
}

/// An offer made through another pool (another process, as far as the
/// database can tell) reaches a desktop listener as a note naming the run
/// and its owner — what lets the replica holding the owner's runner claim
/// it in one hop. Two offers committed together arrive as notes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_elsewhere_is_heard_as_a_note_naming_its_owner() {
    use automesh_store::{DesktopNote, Heard};
    let db = TestDatabase::new(Backend::Postgres)
        .await
        .expect("test database (is PostgreSQL running? see README)");
    let mut listener = db.store.listen_desktop().await;
    let other = Store::connect_lazy(&db.url, StoreOptions::default()).expect("pool");
    // Owner ids with characters a naive payload format would break on.
    let owner = "carol \"c\"\n\tx";
    let now = chrono::Utc::now();
    let (a, b) = tokio::join!(
        other.offer_desktop_run("run-n1", "org-n", owner, b"spec", now),
        other.offer_desktop_run("run-n2", "org-n", owner, b"spec", now),
    );
    assert!(a.expect("offer") && b.expect("offer"));
    let mut heard = vec![];
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while heard.len() < 2 && tokio::time::Instant::now() < give_up {
        match listener.next(Duration::from_secs(1)).await {
            Heard::Notes(notes) => heard.extend(notes),
            Heard::Missed => panic!("a note was not understood"),
            Heard::Nothing => {}
        }
    }
    heard.sort_by_key(|n| format!("{n:?}"));
    let offered = |run: &str| DesktopNote::Offered {
        run_id: run.into(),
        org_id: "org-n".into(),
        owner_id: owner.into(),
    };
    assert_eq!(heard, vec![offered("run-n1"), offered("run-n2")]);
    // One offer alone in its batch is heard alike, and offered again it
    // changes nothing and says nothing.
    let offer = other.offer_desktop_run("run-n3", "org-n", owner, b"spec", now);
    assert!(offer.await.expect("offer"));
    let again = other.offer_desktop_run("run-n3", "org-n", owner, b"other", now);
    assert!(!again.await.expect("offer again"));
    let mut heard = vec![];
    let give_up = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < give_up {
        if let Heard::Notes(notes) = listener.next(Duration::from_millis(500)).await {
            heard.extend(notes);
        }
    }
    assert_eq!(
        heard,
        vec![offered("run-n3")],
        "one note, for the offer made"
    );
    let spec = db
        .store
        .desktop_run("run-n3")
        .await
        .expect("read")
        .expect("offered");
    assert_eq!(spec.spec, b"spec", "the first offer stands");
    db.remove().await.expect("remove");
}

/// A runner's report made through another pool reaches a desktop listener
/// as a note that says what the assignment now is — what lets the run's
/// observers answer without reading the row: running once accepted, then
/// finished and idle with its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_elsewhere_is_heard_with_what_the_assignment_now_is() {
    use automesh_store::desktop::DesktopPhase;
    use automesh_store::desktop::{Claim, RunnerReport};
    use automesh_store::{AssignmentState, DesktopNote, Heard};
    let db = TestDatabase::new(Backend::Postgres)
        .await
        .expect("test database (is PostgreSQL running? see README)");
    let mut listener = db.store.listen_desktop().await;
    let other = Store::connect_lazy(&db.url, StoreOptions::default()).expect("pool");
    let owner = automesh_domain::Principal::new("org-r", "dana");
    let now = chrono::Utc::now();
    other
        .create_runner(&owner, "runner-r", "desk", "hash-r", now)
        .await
        .expect("runner");
    other
        .open_runner_stream("runner-r", "stream-r", "g1", now)
        .await
        .expect("stream");
    assert!(
        other
            .offer_desktop_run("run-r", "org-r", "dana", b"spec", now)
            .await
            .expect("offer")
    );
    let claimed = other.desktop_claim(Claim::Take, "run-r", "runner-r", "stream-r", now);
    assert!(claimed.await.expect("claim").is_some());
    let report = |r| other.desktop_report(r, "run-r", "runner-r", "stream-r", now);
    assert!(report(RunnerReport::Accepted).await.expect("accepted"));
    assert!(
        report(RunnerReport::Finished(&[1, 2, 0xab]))
            .await
            .expect("finished")
    );
    let mut changed = vec![];
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while changed.len() < 2 && tokio::time::Instant::now() < give_up {
        match listener.next(Duration::from_secs(1)).await {
            Heard::Notes(notes) => changed.extend(
                notes
                    .into_iter()
                    .filter(|n| matches!(n, DesktopNote::Changed { .. })),
            ),
            Heard::Missed => panic!("a note was not understood"),
            Heard::Nothing => {}
        }
    }
    let state = |phase: DesktopPhase, idle, outcome: Option<&str>| DesktopNote::Changed {
        run_id: "run-r".into(),
        now: Some(AssignmentState {
            phase,
            idle,
            event_count: 0,
            passed_over: false,
            outcome_hex: outcome.map(str::to_owned),
        }),
    };
    assert_eq!(
        changed,
        vec![
            state(DesktopPhase::Running, false, None),
            state(DesktopPhase::Finished, true, Some("0102ab"))
        ]
    );
    if let DesktopNote::Changed { now: Some(s), .. } = &changed[1] {
        assert_eq!(s.outcome(), Some(vec![1, 2, 0xab]));
    }
    db.remove().await.expect("remove");
}

/// A run watcher takes its own process's notification as no news (the
/// in-process signal that goes with it woke it already), a notification
/// from another process as news; and once it has consumed the signals so
/// far (just before a claim reads what they announce), it waits for the
/// next one instead of waking at once for the same runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_watcher_hears_other_processes_and_not_its_own_echo() {
    let db = TestDatabase::new(Backend::Postgres)
        .await
        .expect("test database (is PostgreSQL running? see README)");
    let mut watcher = db.store.watch_new_runs().await;
    let other = Store::connect_lazy(&db.url, StoreOptions::default()).expect("pool");
    // The signal in this process wakes it at once, however long it waits.
    db.store.signal(Topic::Runs).await.expect("signal");
    tokio::time::timeout(
        Duration::from_secs(30),
        watcher.wait(Duration::from_secs(3600)),
    )
    .await
    .expect("the in-process signal woke the watcher");
    // Signalled again, then consumed: the next wait hears neither that
    // signal nor the echo of its NOTIFY, nor more of this process's own.
    db.store.signal(Topic::Runs).await.expect("signal");
    watcher.consume();
    let woken = tokio::spawn(async move {
        watcher.wait(Duration::from_secs(3600)).await;
    });
    let own = automesh_store::testing::runs_notification_payload();
    for _ in 0..5 {
        notify(&other, "automesh_runs", own).await;
    }
    assert!(
        !woken.is_finished(),
        "the watcher woke for its own process's notifications"
    );
    // Another process's notification is news.
    assert!(
        notify_until_woken(&other, "automesh_runs", "elsewhere", &woken).await,
        "the watcher never heard another process"
    );
    db.remove().await.expect("remove");
}

/// Item 2 of issue 31: a LISTEN connection terminated by the server comes
/// back. The desktop listener hears `Missed` (look at everything once), a
/// watcher wakes (its caller's read is the catch-up), and a NOTIFY sent
/// after the reconnection is heard again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_listen_connection_reconnects_and_catches_up() {
    use automesh_store::{Heard, LISTEN_APPLICATION_NAME};
    let db = TestDatabase::new(Backend::Postgres)
        .await
        .expect("test database (is PostgreSQL running? see README)");
    let mut listener = db.store.listen_desktop().await;
    let mut watcher = db.store.watch(Topic::Runs).await;
    let other = Store::connect_lazy(&db.url, StoreOptions::default()).expect("pool");
    let cut: i64 = sqlx::query_scalar(
        "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(LISTEN_APPLICATION_NAME)
    .fetch_one(other.pool())
    .await
    .expect("terminate");
    assert_eq!(cut, 2, "one LISTEN connection per listener");
    let mut heard = Heard::Nothing;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while heard == Heard::Nothing && tokio::time::Instant::now() < give_up {
        heard = listener.next(Duration::from_secs(1)).await;
    }
    assert_eq!(heard, Heard::Missed, "a reconnection is a catch-up");
    tokio::time::timeout(
        Duration::from_secs(30),
        watcher.wait(Duration::from_secs(3600)),
    )
    .await
    .expect("the watcher wakes for its catch-up after the reconnection");
    // Listening again: a notification from elsewhere wakes it.
    let woken = tokio::spawn(async move {
        watcher.wait(Duration::from_secs(3600)).await;
    });
    assert!(
        notify_until_woken(&other, "automesh_runs", "elsewhere", &woken).await,
        "the watcher did not listen again after the reconnection"
    );
    db.remove().await.expect("remove");
}
