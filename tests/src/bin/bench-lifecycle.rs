//! Benchmark of scheduling and the run lifecycle on PostgreSQL.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-lifecycle [-- --runs 1000 --latency-runs 200 --repeats 3]
//!
//! Prints, from one run on this machine:
//! - PostgreSQL's own single-row UPDATE transaction rate (1 and 8 clients),
//!   measured through the same driver, as the baseline;
//! - the latency from an occurrence's due instant to the executor receiving
//!   its StartRun (p50, p99), with occurrences due one at a time;
//! - sustained runs per second through scheduler and coordinator (a burst
//!   all due at once, driven to receipts), and its ratio to the baseline.
//!
//! Medians over `--repeats`; the machine is shared, so read ratios.

use std::time::{Duration, Instant};

use automesh_domain::automation::NewAutomation;
use automesh_domain::{Principal, Schedule, Surface};
use automesh_e2e_tests::bench::{arg, median, percentile};
use automesh_e2e_tests::executor::{Behavior, TestExecutor};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_store::{Backend, Store};
use chrono::Utc;

/// Single-row UPDATE transactions per second with `clients` connections,
/// each on its own row, for `secs`.
async fn pg_tps(store: &Store, clients: usize, secs: u64) -> anyhow::Result<f64> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_counter (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    for id in 0..clients as i64 {
        sqlx::query("INSERT INTO bench_counter (id, n) VALUES ($1, 0) ON CONFLICT (id) DO NOTHING")
            .bind(id)
            .execute(store.pool())
            .await?;
    }
    let stop = Instant::now() + Duration::from_secs(secs);
    let mut tasks = vec![];
    for id in 0..clients as i64 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < stop {
                sqlx::query("UPDATE bench_counter SET n = n + 1 WHERE id = $1")
                    .bind(id)
                    .execute(store.pool())
                    .await?;
                n += 1;
            }
            anyhow::Ok(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / secs as f64)
}

async fn insert_due(
    store: &Store,
    prefix: &str,
    count: usize,
    due: impl Fn(usize) -> chrono::DateTime<Utc>,
) -> anyhow::Result<()> {
    let now = Utc::now();
    for i in 0..count {
        let owner = Principal::new("bench", format!("user-{}", i % 16));
        let at = due(i);
        let new = NewAutomation {
            id: format!("{prefix}-{i:05}"),
            owner: owner.clone(),
            name: format!("bench {i}"),
            prompt: "p".into(),
            model: "fake/echo".into(),
            surface: Surface::Web,
            schedule: Schedule::Once { at },
        };
        store.create_automation(&new, Some(at), now).await?;
    }
    Ok(())
}

async fn count_terminal(store: &Store, prefix: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM runs WHERE automation_id LIKE '{prefix}-%' \
         AND state IN ('succeeded','failed','timed_out','cancelled','skipped','missed')"
    )))
    .fetch_one(store.pool())
    .await?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let runs = arg("--runs", 1000);
    let latency_runs = arg("--latency-runs", 200);
    let repeats = arg("--repeats", 3).max(1);
    let (executor, addr) = TestExecutor::start(Behavior::Complete {
        after: Duration::ZERO,
        events: 0,
    })
    .await?;
    let mesh = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            executor: Some(addr),
            ..MeshOptions::default()
        },
    )
    .await?;
    let store = mesh.store().clone();
    println!(
        "automesh lifecycle benchmark (PostgreSQL, {} cores)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );

    // Baseline.
    let mut tps1 = vec![];
    let mut tps8 = vec![];
    for _ in 0..repeats {
        tps1.push(pg_tps(&store, 1, 2).await?);
        tps8.push(pg_tps(&store, 8, 2).await?);
    }
    let (tps1, tps8) = (median(tps1), median(tps8));
    println!(
        "baseline  PostgreSQL single-row UPDATE tx/s   1 client: {tps1:>9.0}   8 clients: {tps8:>9.0}"
    );

    // Latency: occurrences due one at a time, 25 ms apart.
    let start = Utc::now() + chrono::Duration::seconds(2);
    insert_due(&store, "lat", latency_runs, |i| {
        start + chrono::Duration::milliseconds(25 * i as i64)
    })
    .await?;
    let t0 = Instant::now();
    while count_terminal(&store, "lat").await? < latency_runs as i64 {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "latency runs did not finish within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let starts = executor.first_starts();
    let mut latencies: Vec<f64> = vec![];
    for i in 0..latency_runs {
        let id = format!("lat-{i:05}");
        let due = start + chrono::Duration::milliseconds(25 * i as i64);
        let run_id = automesh_domain::ids::scheduled_run_id(&id, due);
        if let Some(at) = starts.get(&run_id) {
            latencies.push((*at - due).num_microseconds().unwrap_or(0) as f64 / 1000.0);
        }
    }
    latencies.sort_by(|a, b| a.total_cmp(b));
    println!(
        "latency   due instant → executor StartRun     p50: {:>7.1} ms   p99: {:>7.1} ms   ({} runs)",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.len()
    );

    // Throughput: a burst all due at once, driven to receipts.
    let mut rates = vec![];
    for r in 0..repeats {
        let prefix = format!("burst{r}");
        let due = Utc::now() + chrono::Duration::seconds(1);
        insert_due(&store, &prefix, runs, |_| due).await?;
        while Utc::now() < due {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let t0 = Instant::now();
        while count_terminal(&store, &prefix).await? < runs as i64 {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(300),
                "burst did not finish within 300 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        rates.push(runs as f64 / t0.elapsed().as_secs_f64());
    }
    let rate = median(rates);
    println!(
        "throughput runs/s (due → receipt, {runs} at once)   {rate:>9.0}   = {:.3} × the 1-client tx/s, {:.3} × the 8-client tx/s",
        rate / tps1,
        rate / tps8
    );

    // Scheduler cost per wake-up with nothing due, before and after adding
    // `--idle` inactive and far-future automations: an index probe, not a scan.
    let idle = arg("--idle", 100_000);
    let settings = automesh_scheduler::occurrences::Settings::new(
        Duration::from_secs(60),
        Duration::from_secs(3600),
    );
    let wake_cost = |store: Store| {
        let settings = settings.clone();
        async move {
            let mut samples = vec![];
            for _ in 0..200 {
                let t = Instant::now();
                store.next_due_at().await?;
                automesh_scheduler::occurrences::pass(&store, &settings).await?;
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
            anyhow::Ok(median(samples))
        }
    };
    let before = wake_cost(store.clone()).await?;
    let far_future = (Utc::now() + chrono::Duration::days(3650)).timestamp_micros();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO automations (id, org_id, owner_id, name, prompt, model, placement, surface, \
           schedule, state, version, next_run_at, created_at, updated_at) \
         SELECT 'idle-' || g, 'bench', 'idle', 'idle', 'p', 'fake/echo', 'cloud', 'web', \
           '{{\"kind\":\"once\",\"at_micros\":{far_future}}}', \
           CASE WHEN g % 2 = 0 THEN 'inactive' ELSE 'active' END, 1, \
           CASE WHEN g % 2 = 0 THEN NULL ELSE {far_future} END, 0, 0 \
         FROM generate_series(1, {idle}) g"
    )))
    .execute(store.pool())
    .await?;
    sqlx::query("ANALYZE automations")
        .execute(store.pool())
        .await?;
    let after = wake_cost(store.clone()).await?;
    println!(
        "scheduler one wake-up with nothing due          {before:>7.0} µs   with {idle} inactive/far-future: {after:>7.0} µs   ({:.2} ×)",
        after / before
    );
    mesh.stop().await?;
    Ok(())
}
