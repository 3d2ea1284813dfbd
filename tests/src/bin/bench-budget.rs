//! What checking an automation's monthly budget costs: its month's spend,
//! summed from the receipts of its runs created this month, against a bare
//! `SELECT 1` round trip through the same pool (the baseline), in one run.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-budget [-- --runs 100000 --months 4 --samples 300]
//!
//! On PostgreSQL (the test server), one automation gets `--runs` finished
//! runs with receipts spread evenly over the last `--months` months (written
//! with `generate_series`, not through the API); a second one gets 1,000.
//! It prints the median and 99th percentile of `month_spend` for the current
//! month of each (with how many of its runs fall in this month: the query
//! reads only those, through `runs_by_automation`), next to the baseline,
//! with their ratios: what the scheduler and run-now pay per check of a
//! budgeted automation. `--quick` is the short form CI runs once
//! (2,000 runs, 30 samples; figures printed, not checked).

use std::time::Instant;

use automesh_domain::automation::{NewAutomation, month_of};
use automesh_domain::{Principal, Schedule, Surface, TimeOfDay};
use automesh_e2e_tests::bench::{Flag, QUICK, check_args, percentile, sized};
use automesh_store::Backend;
use automesh_store::testing::TestDatabase;
use chrono::{Duration, Utc};
use sqlx::Connection;

const FLAGS: &[Flag] = &[
    Flag::count(
        "--runs",
        "finished runs of the big automation (default 100000)",
    ),
    Flag::count(
        "--months",
        "months they are spread over, this one last (default 4)",
    ),
    Flag::count("--samples", "timed reads of each figure (default 300)"),
    QUICK,
];

/// Writes `runs` finished runs of `automation` with receipts of 3
/// micro-units each, created evenly over `[from, to)`.
async fn fill(
    url: &str,
    automation: &str,
    runs: usize,
    from: chrono::DateTime<Utc>,
    to: chrono::DateTime<Utc>,
) -> anyhow::Result<()> {
    let mut db = sqlx::PgConnection::connect(url).await?;
    let (from, span) = (
        from.timestamp_micros(),
        (to - from).num_microseconds().unwrap_or(1),
    );
    sqlx::query(
        "INSERT INTO runs (id, automation_id, org_id, owner_id, placement, trigger, prompt, model, \
         state, deadline_at, created_at, updated_at) \
         SELECT $1 || '-' || g, $1, 'bench', 'owner', 'cloud', 'schedule', 'p', 'm', 'succeeded', \
         $2 + (g * $3 / $4), $2 + (g * $3 / $4), $2 + (g * $3 / $4) \
         FROM generate_series(0, $4 - 1) AS g",
    )
    .bind(automation)
    .bind(from)
    .bind(span)
    .bind(runs as i64)
    .execute(&mut db)
    .await?;
    sqlx::query(
        "INSERT INTO receipts (run_id, outcome, placement, cost_micros, created_at) \
         SELECT id, 'succeeded', 'cloud', 3, created_at FROM runs WHERE automation_id = $1",
    )
    .bind(automation)
    .execute(&mut db)
    .await?;
    sqlx::query("ANALYZE runs").execute(&mut db).await?;
    sqlx::query("ANALYZE receipts").execute(&mut db).await?;
    Ok(())
}

/// Median and 99th percentile, in milliseconds, of `samples` calls of `f`.
async fn timed<F, Fut>(samples: usize, mut f: F) -> anyhow::Result<(f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    // One untimed call first: the pool's connection is opened by it.
    f().await?;
    let mut ms = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        f().await?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok((percentile(&ms, 0.5), percentile(&ms, 0.99)))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    check_args(
        "bench-budget",
        "What checking an automation's monthly budget costs, at scale",
        FLAGS,
    );
    let runs = sized("--runs", 100_000, 2_000);
    let months = sized("--months", 4, 2).max(1);
    let samples = sized("--samples", 300, 30);
    let db = TestDatabase::new(Backend::Postgres).await?;
    let store = db.store.clone();
    let owner = Principal::new("bench", "owner");
    let zone = chrono_tz::Europe::Paris;
    let now = Utc::now();
    let (this_month, next_month) = month_of(now, zone);
    let mut start = this_month;
    for _ in 1..months {
        start = month_of(start - Duration::days(1), zone).0;
    }
    let mut ids = vec![];
    for (name, count) in [("big", runs), ("small", 1_000)] {
        let new = NewAutomation {
            id: format!("bench-{name}"),
            owner: owner.clone(),
            name: name.into(),
            prompt: "p".into(),
            model: "m".into(),
            surface: Surface::Web,
            schedule: Schedule::Daily {
                time: TimeOfDay::new(9, 0).ok_or_else(|| anyhow::anyhow!("time"))?,
                zone,
            },
            pause_after_failures: 3,
            budget: Default::default(),
            monthly_budget_micros: Some(1_000_000),
        };
        store.create_automation(&new, None, now).await?;
        let t = Instant::now();
        fill(&db.url, &new.id, count, start, now).await?;
        eprintln!(
            "{count} runs of {} over {months} months written in {:.1} s",
            new.id,
            t.elapsed().as_secs_f64()
        );
        ids.push((new.id, count));
    }
    let pool = sqlx::PgPool::connect(&db.url).await?;
    let baseline = timed(samples, || async {
        sqlx::query("SELECT 1").execute(&pool).await?;
        Ok(())
    })
    .await?;
    println!("runs per automation over {months} months; month_spend of the current month:");
    println!(
        "  baseline SELECT 1            p50 {:.3} ms  p99 {:.3} ms",
        baseline.0, baseline.1
    );
    let mut figures = vec![];
    for (id, count) in &ids {
        let spent = store
            .internal()
            .month_spend(id, this_month, next_month)
            .await?;
        let (p50, p99) = timed(samples, || async {
            store
                .internal()
                .month_spend(id, this_month, next_month)
                .await?;
            Ok(())
        })
        .await?;
        println!(
            "  {count:>7} runs ({:>6} this month)  p50 {p50:.3} ms  p99 {p99:.3} ms  ({:.1}× baseline p50)",
            spent / 3,
            p50 / baseline.0
        );
        figures.push(p50);
    }
    if let [big, small] = figures[..] {
        println!("  {runs} runs vs 1000 runs: {:.1}× p50", big / small);
    }
    pool.close().await;
    db.remove().await?;
    Ok(())
}
