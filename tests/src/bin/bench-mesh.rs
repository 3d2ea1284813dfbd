//! Benchmark of the whole mesh on PostgreSQL: due occurrences → scheduler →
//! coordinator → desktop-runner-gateway → real runner streams → receipts.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-mesh [-- --runs 1000 --runners 64 --repeats 3 --runner-http2 hyper]
//!   cargo run -p automesh-e2e-tests --bin bench-mesh -- --quick
//!
//! Every service of the mesh over real gRPC on loopback (one replica each),
//! and `--runners` desktop runners, each on its own stream and connection,
//! written against the runner proto with a stub engine that answers at once
//! (an assignment is accepted, and once confirmed finished as succeeded).
//! Each repeat makes `--runs` desktop occurrences of the runners' owners due
//! at one instant and waits until every run has its receipt.
//!
//! Prints, from one run on this machine:
//! - the yardstick L: a third of PostgreSQL's own single-row commit rate
//!   with 32 clients, measured now through the same driver;
//! - runs per second, due instant → last receipt, and its ratio to L
//!   (goal ≥ 0.12 L);
//! - the database's commits per run (read-only included) and writing
//!   transactions per run, from `pg_stat_database` and the transaction id
//!   counter (goal ≤ 3 commits);
//! - how many runs did not end with exactly one receipt matching their
//!   terminal state (it must be 0; the benchmark fails otherwise).
//!
//! Medians over `--repeats`; the machine is shared, so read ratios.
//! `--quick` is the short form CI runs once (figures printed, not checked
//! — except that every run ends with exactly one receipt).

use std::time::{Duration, Instant};

use automesh_domain::{Principal, Surface};
use automesh_e2e_tests::bench::{
    CpuTimes, DbCounters, Flag, QUICK, RUNNER_HTTP2, StubRunners, baseline_yardstick, check_args,
    insert_due, last_run, median, medians, mint_runner, quick, settle_then, sized,
};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_store::{Backend, Store};

/// The owner of the `i`th automation (and of the `i`th runner).
fn owner(i: usize, runners: usize) -> Principal {
    Principal::new("bench", format!("mesh-{}", i % runners))
}

/// Receipts of the runs of `prefix`'s automations.
async fn receipts(store: &Store, prefix: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COUNT(*) FROM receipts c JOIN runs r ON r.id = c.run_id \
         WHERE r.automation_id LIKE $1",
    )
    .bind(format!("{prefix}-%"))
    .fetch_one(store.pool())
    .await?)
}

/// The automations of `prefix` whose runs did not end with exactly one
/// run, in a terminal state, with exactly one receipt of that outcome.
async fn without_one_receipt(store: &Store, prefix: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COUNT(*) FROM automations a WHERE a.id LIKE $1 AND 1 <> ( \
           SELECT COUNT(*) FROM runs r JOIN receipts c ON c.run_id = r.id \
           WHERE r.automation_id = a.id AND c.outcome = r.state \
             AND r.state IN ('succeeded','failed','timed_out','cancelled','skipped','missed')) \
         OR 1 <> (SELECT COUNT(*) FROM runs r WHERE r.automation_id = a.id)",
    )
    .bind(format!("{prefix}-%"))
    .fetch_one(store.pool())
    .await?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    check_args(
        "bench-mesh",
        "Benchmark of the whole mesh on PostgreSQL (AUTOMESH_TEST_POSTGRES_URL): due occurrences → \
         scheduler → coordinator → desktop-runner-gateway → real runner streams → receipts; runs/s \
         against L, commits per run, and every run checked for exactly one receipt.",
        &[
            Flag::count(
                "--runs",
                "desktop occurrences due at once per repeat (default 1000)",
            ),
            Flag::count("--runners", "runner streams, one owner each (default 64)"),
            Flag::count("--repeats", "repeats; medians are printed (default 3)"),
            RUNNER_HTTP2,
            QUICK,
        ],
    );
    let runs = sized("--runs", 1000, 100);
    let runners = sized("--runners", 64, 16).max(1);
    let repeats = sized("--repeats", 3, 1).max(1);
    let (http2, http2_name) = automesh_e2e_tests::bench::runner_http2()?;
    let mesh = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            desktop_via_runner_gateway: true,
            runner_streams: automesh_desktop_runner_gateway::stream::StreamSettings {
                http2,
                ..Default::default()
            },
            ..MeshOptions::benchmark()
        },
    )
    .await?;
    let store = mesh.store().clone();
    let url = mesh.db.url.clone();
    println!(
        "automesh whole-mesh benchmark (PostgreSQL, {} cores{}; {runs} runs at once on {runners} runner streams; runner listener on {http2_name} HTTP/2)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        if quick() { ", --quick" } else { "" },
    );

    // The yardstick, measured now.
    let l = baseline_yardstick(&url, repeats).await?;

    // The runners: one stream each, on the gateway replica runners dial.
    let (stubs, assigned) = StubRunners::new(true);
    drop(assigned);
    for i in 0..runners {
        let token = mint_runner(&store, &owner(i, runners), i).await?;
        tokio::spawn(stubs.clone().hold(mesh.runner_gateway.clone(), token));
    }
    let t = Instant::now();
    while stubs.settled() < runners {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(60),
            "runner streams did not connect within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::ensure!(
        stubs.alive() == runners,
        "{} of {runners} runner streams were refused",
        runners - stubs.alive()
    );
    println!("setup     {runners} runner streams connected");

    let mut rates = vec![];
    let mut per_run = vec![];
    let mut cpus = vec![];
    let mut wrong = 0;
    for r in 0..repeats {
        let prefix = format!("mesh{r}");
        let dues = insert_due(
            &store,
            &prefix,
            runs,
            Surface::Desktop,
            |i| owner(i, runners),
            |_, base| base + settle_then(1500),
        )
        .await?;
        let before = DbCounters::settled(&url).await?;
        let cpu_before = CpuTimes::now();
        let replayed_before = automesh_store::replayed();
        while chrono::Utc::now() < dues[0] {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let t0 = Instant::now();
        let mut shown = Instant::now();
        loop {
            let done = receipts(&store, &prefix).await?;
            if done >= runs as i64 {
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(300),
                "{done} of {runs} runs had receipts after 300 s"
            );
            if shown.elapsed() >= Duration::from_secs(5) {
                shown = Instant::now();
                println!("progress  {done} of {runs} receipts");
            }
            // Each look is a query of its own: not so often that it weighs.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Timed from the due instant to the last run's end as the runs
        // record it, not to the look (every 50 ms) that saw it.
        let last = last_run(&store, &prefix, dues[0]).await?;
        let rate = last.rate(runs);
        cpus.push(CpuTimes::now().per_run(cpu_before, runs));
        let (commits, writes) = DbCounters::settled(&url).await?.per_run(before, runs);
        let bad = without_one_receipt(&store, &prefix).await?;
        let replayed = automesh_store::replayed() - replayed_before;
        println!(
            "repeat {r}  {rate:>7.0} runs/s = {:.3} × L (the last run created {:.0} ms after the due instant, started {:.0} ms, ended {:.0} ms); {commits:.2} commits, {writes:.2} writing transactions per run; {replayed} write batches replayed job by job (a failed write or a deadlock); {bad} runs without exactly one receipt",
            rate / l,
            last.created,
            last.started,
            last.ended
        );
        rates.push(rate);
        per_run.push((commits, writes));
        wrong += bad;
    }
    let rate = median(rates);
    let (commits, writes) = medians(&per_run);
    println!(
        "throughput runs/s (due → receipt, {runs} at once, {runners} runners)   {rate:>7.0}   = {:.3} × L (goal ≥ 0.12)",
        rate / l
    );
    println!(
        "database  per run: {commits:>5.2} commits (read-only included; goal ≤ 3), {writes:>5.2} writing transactions"
    );
    let cpu = medians(&cpus);
    println!(
        "cpu       per run: PostgreSQL {:.2} ms (all its processes), the mesh and its runners {:.2} ms (this process)",
        cpu.0, cpu.1
    );
    println!(
        "receipts  {wrong} of {} runs without exactly one receipt matching their end",
        runs * repeats
    );
    mesh.stop().await?;
    anyhow::ensure!(
        wrong == 0,
        "{wrong} runs did not end with exactly one receipt"
    );
    Ok(())
}
