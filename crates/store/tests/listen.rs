//! On PostgreSQL, a watcher is woken by a NOTIFY from another process (here:
//! another pool that signals nothing in this process) — the path by which an
//! assignment offered on one gateway replica reaches the replica holding the
//! runner's stream. Alone in its binary, so no in-process signal interferes.

use std::time::Duration;

use automesh_store::testing::TestDatabase;
use automesh_store::{Backend, Store, StoreOptions, Topic};

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
    let notified = tokio::time::timeout(Duration::from_secs(30), async {
        while !woken.is_finished() {
            sqlx::query("SELECT pg_notify('automesh_desktop', '')")
                .execute(other.pool())
                .await
                .expect("notify");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(notified.is_ok(), "the watcher never heard the NOTIFY");
    db.remove().await.expect("remove");
}
