//! Benchmark of scheduling and the run lifecycle on PostgreSQL.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-lifecycle [-- --runs 1000 --latency-runs 200 --repeats 3 --idle 1000000]
//!   cargo run -p automesh-e2e-tests --bin bench-lifecycle -- --quick
//!
//! Prints, from one run on this machine:
//! - the yardstick L: a third of PostgreSQL's own single-row commit rate
//!   with 32 clients, measured through the same driver;
//! - the floors of one dispatch: a bare gRPC round trip and a single-row
//!   commit (p50 of 500 each, back to back; and p50 of 100 each, 25 ms
//!   apart as the latency runs are due: on a virtual machine a hop to an
//!   idle process costs several times one made back to back);
//! - the latency from an occurrence's due instant to the executor receiving
//!   its StartRun (p50, p99), with occurrences due one at a time, in
//!   `--repeats` rounds;
//! - sustained runs per second through scheduler and coordinator (a burst
//!   all due at once, driven to receipts), as a ratio to L, and the
//!   database's commits and writing transactions per run;
//! - the scheduler's cost per wake-up before and after adding `--idle`
//!   inactive and far-future automations.
//!
//! Medians over `--repeats`; the machine is shared, so read ratios.
//! `--quick` is the short form CI runs once (figures printed, not checked).

use std::time::{Duration, Instant};

use automesh_domain::{Principal, Surface};
use automesh_e2e_tests::bench::{
    CpuTimes, DbCounters, Flag, LastRun, QUICK, baseline_yardstick, check_args, insert_due,
    last_run, median, medians, percentile, quick, settle_then, sized,
};
use automesh_e2e_tests::executor::{Behavior, TestExecutor};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_store::{Backend, Store};
use chrono::Utc;

/// How many of the runs of `prefix` are in each state (`--progress`).
async fn states(store: &Store, prefix: &str) -> anyhow::Result<String> {
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT state, COUNT(*) FROM runs WHERE automation_id LIKE '{prefix}-%' GROUP BY state ORDER BY state"
    )))
    .fetch_all(store.pool())
    .await?;
    Ok(rows
        .iter()
        .map(|(s, n)| format!("{s}={n}"))
        .collect::<Vec<_>>()
        .join(" "))
}

async fn count_terminal(store: &Store, prefix: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM runs WHERE automation_id LIKE '{prefix}-%' \
         AND state IN ('succeeded','failed','timed_out','cancelled','skipped','missed')"
    )))
    .fetch_one(store.pool())
    .await?)
}

/// The owner of the `i`th automation: sixteen users.
fn owner(i: usize) -> Principal {
    Principal::new("bench", format!("user-{}", i % 16))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    check_args(
        "bench-lifecycle",
        "Benchmark of scheduling and the run lifecycle on PostgreSQL (AUTOMESH_TEST_POSTGRES_URL): \
         the yardstick L, dispatch latency due → StartRun, runs/s through scheduler and \
         coordinator, commits per run, and the scheduler's wake-up cost with many idle automations.",
        &[
            Flag::count(
                "--runs",
                "runs due at once in the throughput case (default 1000)",
            ),
            Flag::count(
                "--latency-runs",
                "occurrences due one at a time per round (default 200)",
            ),
            Flag::count(
                "--repeats",
                "rounds of each case; medians are printed (default 3)",
            ),
            Flag::count(
                "--idle",
                "inactive and far-future automations in the wake-up case (default 1000000)",
            ),
            Flag::switch(
                "--progress",
                "print the throughput case's run states as it goes",
            ),
            QUICK,
        ],
    );
    let runs = sized("--runs", 1000, 50);
    let latency_runs = sized("--latency-runs", 200, 10);
    let repeats = sized("--repeats", 3, 1).max(1);
    let idle = sized("--idle", 1_000_000, 1000);
    let (executor, addr) = TestExecutor::start(Behavior::Complete {
        after: Duration::ZERO,
        events: 0,
    })
    .await?;
    let mesh = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            executor: Some(addr),
            ..MeshOptions::benchmark()
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

    // The yardstick, measured now.
    let url = mesh.db.url.clone();
    let l = baseline_yardstick(&url, repeats).await?;

    // The floors of one dispatch, measured now: a due run is created (one
    // statement, committed asynchronously), claimed (one, durably) and
    // started (one call).
    let (rtt, tx) =
        automesh_e2e_tests::bench::baseline_round_trips(&mesh.coordinator, &store).await?;
    // The same, as far apart as the occurrences below are due: what each
    // hop of a lone dispatch costs on this machine.
    let (spaced_rtt, spaced_tx) = automesh_e2e_tests::bench::spaced_round_trips(
        &mesh.coordinator,
        &store,
        Duration::from_millis(25),
    )
    .await?;

    // Latency: occurrences due one at a time, 25 ms apart, in `repeats`
    // rounds; each percentile is the median of the rounds'.
    let ms = |d: chrono::Duration| d.num_microseconds().unwrap_or(0) as f64 / 1000.0;
    let mut rounds: Vec<[f64; 6]> = vec![];
    let mut measured = 0;
    let mut created_ahead = 0;
    for r in 0..repeats {
        let prefix = format!("lat{r}");
        let dues = insert_due(
            &store,
            &prefix,
            latency_runs,
            Surface::Web,
            owner,
            |i, base| base + chrono::Duration::milliseconds(25 * i as i64),
        )
        .await?;
        let t0 = Instant::now();
        while count_terminal(&store, &prefix).await? < latency_runs as i64 {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(120),
                "latency runs did not finish within 120 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let starts = executor.first_starts();
        let (mut latencies, mut created, mut claimed) = (vec![], vec![], vec![]);
        let mut ahead = 0;
        for (i, due) in dues.into_iter().enumerate() {
            let id = format!("{prefix}-{i:05}");
            let run_id = automesh_domain::ids::scheduled_run_id(&id, due);
            if let Some(at) = starts.get(&run_id) {
                latencies.push(ms(*at - due));
                // Where the time goes: the run's creation, then its dispatch.
                let run = store.internal().get_run(&run_id).await?;
                created.push(ms(run.created_at - due));
                ahead += usize::from(run.created_at < due);
                claimed.push(ms(*at - run.created_at));
            }
        }
        for v in [&mut latencies, &mut created, &mut claimed] {
            v.sort_by(|a, b| a.total_cmp(b));
        }
        measured += latencies.len();
        created_ahead += ahead;
        rounds.push([
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
            percentile(&created, 0.5),
            percentile(&created, 0.99),
            percentile(&claimed, 0.5),
            percentile(&claimed, 0.99),
        ]);
    }
    let of = |k: usize| median(rounds.iter().map(|r| r[k]).collect());
    let (p50, p99) = (of(0), of(1));
    let p50s: Vec<String> = rounds.iter().map(|r| format!("{:.1}", r[0])).collect();
    let p99s: Vec<String> = rounds.iter().map(|r| format!("{:.1}", r[1])).collect();
    println!(
        "latency   due instant → executor StartRun     p50: {p50:>7.1} ms   p99: {p99:>7.1} ms   ({measured} runs in {} rounds: p50 {}, p99 {}; p50 = {:.1} × one commit and one round trip, {:.1} × those made 25 ms apart)",
        rounds.len(),
        p50s.join(" / "),
        p99s.join(" / "),
        p50 / (tx + rtt),
        p50 / (spaced_tx + spaced_rtt)
    );
    println!(
        "          of which due → run created         p50: {:>7.1} ms   p99: {:>7.1} ms; created → StartRun p50: {:>5.1} ms   p99: {:>5.1} ms ({created_ahead} of {measured} created ahead of their instant, and held by the coordinator until it)",
        of(2),
        of(3),
        of(4),
        of(5),
    );

    // Throughput: a burst all due at once, driven to receipts.
    let mut rates = vec![];
    let mut per_run = vec![];
    let mut lasts = vec![];
    let mut cpus = vec![];
    for r in 0..repeats {
        let prefix = format!("burst{r}");
        let dues = insert_due(&store, &prefix, runs, Surface::Web, owner, |_, base| {
            base + settle_then(1500)
        })
        .await?;
        let due = dues[0];
        let before = DbCounters::settled(&url).await?;
        let cpu_before = CpuTimes::now();
        while Utc::now() < due {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let t0 = Instant::now();
        let progress = std::env::args().any(|a| a == "--progress");
        let mut shown = Instant::now();
        while count_terminal(&store, &prefix).await? < runs as i64 {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(300),
                "burst did not finish within 300 s"
            );
            if progress && shown.elapsed() >= Duration::from_millis(500) {
                shown = Instant::now();
                let at = t0.elapsed().as_secs_f64();
                println!("  {at:>5.1}s  {}", states(&store, &prefix).await?);
            }
            // Each look is a query of its own: not so often that it weighs.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Timed from the due instant to the last run's end as the runs
        // record it, not to the look (every 50 ms) that saw it.
        cpus.push(CpuTimes::now().per_run(cpu_before, runs));
        let last = last_run(&store, &prefix, due).await?;
        rates.push(last.rate(runs));
        lasts.push(last);
        per_run.push(DbCounters::settled(&url).await?.per_run(before, runs));
    }
    let rate = median(rates);
    let (commits, writes) = medians(&per_run);
    println!(
        "throughput runs/s (due → receipt, {runs} at once)   {rate:>9.0}   = {:.3} × L",
        rate / l
    );
    let last = |of: fn(&LastRun) -> f64| median(lasts.iter().map(of).collect());
    println!(
        "          the last run created {:.0} ms after the due instant, started {:.0} ms, ended {:.0} ms",
        last(|l| l.created),
        last(|l| l.started),
        last(|l| l.ended)
    );
    let cpu = medians(&cpus);
    println!(
        "cpu       per run: PostgreSQL {:.2} ms (all its processes), scheduler + coordinator + test executor {:.2} ms",
        cpu.0, cpu.1
    );
    println!(
        "database  per run: {commits:>5.2} commits (read-only included), {writes:>5.2} writing transactions"
    );

    // Scheduler cost per wake-up with nothing due: two fresh databases,
    // one without automations and one with `--idle` inactive and far-future
    // ones (vacuumed and analysed, as a steady state is), measured in
    // alternating rounds so that the machine's drift falls on both alike.
    // An index probe, not a scan: the ratio stays near 1.
    let settings = automesh_scheduler::occurrences::Settings::new(
        Duration::from_secs(60),
        Duration::from_secs(3600),
    );
    let wake_cost = |store: Store, samples: usize| {
        let settings = settings.clone();
        async move {
            let mut taken = vec![];
            for _ in 0..samples {
                let t = Instant::now();
                store.next_due_at().await?;
                automesh_scheduler::occurrences::pass(&store, &settings).await?;
                taken.push(t.elapsed().as_secs_f64() * 1e6);
            }
            anyhow::Ok(taken)
        }
    };
    let none = automesh_store::testing::TestDatabase::new(Backend::Postgres).await?;
    let crowded = automesh_store::testing::TestDatabase::new(Backend::Postgres).await?;
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
    .execute(crowded.store.pool())
    .await?;
    for db in [&none, &crowded] {
        sqlx::query("VACUUM ANALYZE automations")
            .execute(db.store.pool())
            .await?;
    }
    let (mut before, mut after) = (vec![], vec![]);
    let rounds = if quick() { 2 } else { 10 };
    for _ in 0..rounds {
        before.extend(wake_cost(none.store.clone(), 50).await?);
        after.extend(wake_cost(crowded.store.clone(), 50).await?);
    }
    let (before, after) = (median(before), median(after));
    println!(
        "scheduler one wake-up with nothing due          {before:>7.0} µs   with {idle} inactive/far-future: {after:>7.0} µs   ({:.2} ×; goal ≤ 1.1)",
        after / before
    );
    none.remove().await?;
    crowded.remove().await?;
    mesh.stop().await?;
    Ok(())
}
