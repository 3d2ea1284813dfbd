//! History at scale (issue 33): what reading and writing cost once the
//! database holds millions of finished runs, next to the same figures at
//! 10,000 runs measured in the same run, and what retention costs.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-history [-- --runs 10000000 --owners 1000 --events 2 --samples 200]
//!
//! On PostgreSQL (the test server), for 10,000 runs and then `--runs`: a
//! mesh is started, its database filled with finished runs spread evenly
//! over the last 31 days across `--owners` owners (one automation each,
//! ten organisations), each with `--events` events and a receipt, written
//! with `generate_series` (not through the API), then vacuumed and
//! analysed. Through the public API: `ListRuns` first page and page 100
//! (keyset paging), `GetRun`, `RunAutomationNow`; and the scheduler's pass
//! firing 100 due automations, called directly. Each p50/p99 is printed
//! with its ratio to the 10k figure. Then the storage per run (runs, events
//! and receipts with their indexes), and retention both ways, each with
//! its time, the WAL it wrote and the blocks it touched: a pass with the
//! default 30 days on the day the oldest week falls due, which drops that
//! week's partitions, and then a pass that deletes one organisation's
//! oldest three days in batches (its retention set shorter than the
//! default, so its runs go row by row). The runs have time-ordered ids, so
//! they sit in week partitions, made for the 31 days first, as a mesh
//! running that long would have made them. `--quick` is the short form CI
//! runs once (20,000 runs, 100 owners; figures printed, not checked).

use std::time::{Duration, Instant};

use automesh_domain::automation::NewAutomation;
use automesh_domain::{Principal, RunEventPayload, Schedule, Surface, TimeOfDay};
use automesh_e2e_tests::bench::{Flag, QUICK, check_args, percentile, sized};
use automesh_e2e_tests::executor::{Behavior, TestExecutor};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_proto::v1 as pb;
use automesh_store::Backend;
use automesh_store::retention::Policy;
use chrono::Utc;

const FLAGS: &[Flag] = &[
    Flag::count(
        "--runs",
        "finished runs of the big history (default 10000000)",
    ),
    Flag::count("--owners", "owners, one automation each (default 1000)"),
    Flag::count("--events", "events per run (default 2)"),
    Flag::count("--samples", "timed calls of each figure (default 200)"),
    QUICK,
];

const BASELINE_RUNS: usize = 10_000;
const DAYS: i64 = 31;
const PAGE: i32 = 50;
const DEEP: usize = 100;

/// p50 and p99 in milliseconds.
type Figure = (f64, f64);

async fn timed<F, Fut>(samples: usize, mut f: F) -> anyhow::Result<Figure>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    f(usize::MAX).await?;
    let mut ms = Vec::with_capacity(samples);
    for i in 0..samples {
        let t = Instant::now();
        f(i).await?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok((percentile(&ms, 0.5), percentile(&ms, 0.99)))
}

fn org_of(owner: usize) -> String {
    format!("org-{}", owner % 10)
}

/// Writes `runs` finished runs over the last [`DAYS`] days, round-robin
/// over `owners` automations, each with `events` events and a receipt.
async fn fill(mesh: &Mesh, runs: usize, owners: usize, events: usize) -> anyhow::Result<i64> {
    let now = Utc::now();
    let zone = chrono_tz::Europe::Paris;
    for o in 0..owners {
        let new = NewAutomation {
            id: format!("bench-a-{o}"),
            owner: Principal::new(org_of(o), format!("owner-{o}")),
            name: format!("report {o}"),
            prompt: "p".into(),
            model: automesh_e2e_tests::PRICED_MODEL.into(),
            surface: Surface::Web,
            schedule: Schedule::Daily {
                time: TimeOfDay::new(9, 0).ok_or_else(|| anyhow::anyhow!("time"))?,
                zone,
            },
            pause_after_failures: 0,
            budget: Default::default(),
            monthly_budget_micros: None,
        };
        mesh.store().create_automation(&new, None, now).await?;
    }
    let from = (now - chrono::Duration::days(DAYS)).timestamp_micros();
    let span = chrono::Duration::days(DAYS).num_microseconds().unwrap_or(1);
    let payload = serde_json::to_string(&RunEventPayload::AssistantText {
        text: "Summary: three new messages, one needs an answer today.".into(),
    })?;
    let pool = sqlx::PgPool::connect(&mesh.db.url).await?;
    // The weeks of the last 31 days, as a mesh running that long made them.
    sqlx::query("SELECT count(*) FROM automesh_ensure_run_partitions($1, 6)")
        .bind(from)
        .execute(&pool)
        .await?;
    let t = Instant::now();
    // In slices, so that progress shows and no statement runs for long.
    let slice = 500_000usize;
    let mut done = 0;
    while done < runs {
        let end = (done + slice).min(runs);
        sqlx::query(
            "INSERT INTO runs (id, automation_id, org_id, owner_id, placement, trigger, \
             scheduled_for, prompt, model, state, deadline_at, created_at, updated_at) \
             SELECT automesh_run_id_bound($1 + (g * ($2 / $4))) || lpad(to_hex(g), 20, '0'), \
             'bench-a-' || (g % $3), 'org-' || ((g % $3) % 10), \
             'owner-' || (g % $3), 'cloud', 'schedule', $1 + (g * ($2 / $4)), 'p', 'm', 'succeeded', \
             $1 + (g * ($2 / $4)) + 1800000000, $1 + (g * ($2 / $4)), $1 + (g * ($2 / $4)) + 60000000 \
             FROM generate_series($5::bigint, $6::bigint - 1) AS g",
        )
        .bind(from)
        .bind(span)
        .bind(owners as i64)
        .bind(runs as i64)
        .bind(done as i64)
        .bind(end as i64)
        .execute(&pool)
        .await?;
        sqlx::query(
            "INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
             SELECT automesh_run_id_bound($1 + (g * ($2 / $4))) || lpad(to_hex(g), 20, '0'), \
             s, 'e-' || s, 'assistant_text', $3, $1 + (g * ($2 / $4)) \
             FROM generate_series($5::bigint, $6::bigint - 1) AS g, generate_series(1, $7) AS s",
        )
        .bind(from)
        .bind(span)
        .bind(&payload)
        .bind(runs as i64)
        .bind(done as i64)
        .bind(end as i64)
        .bind(events as i32)
        .execute(&pool)
        .await?;
        sqlx::query(
            "INSERT INTO receipts (run_id, outcome, placement, engine, execution_us, \
             input_tokens, output_tokens, cost_micros, created_at) \
             SELECT automesh_run_id_bound($1 + (g * ($2 / $3))) || lpad(to_hex(g), 20, '0'), \
             'succeeded', 'cloud', 'native', 900000, 1200, 300, 2700, \
             $1 + (g * ($2 / $3)) + 60000000 FROM generate_series($4::bigint, $5::bigint - 1) AS g",
        )
        .bind(from)
        .bind(span)
        .bind(runs as i64)
        .bind(done as i64)
        .bind(end as i64)
        .execute(&pool)
        .await?;
        done = end;
        eprintln!(
            "  {done}/{runs} runs written ({:.0} s)",
            t.elapsed().as_secs_f64()
        );
    }
    for table in ["runs", "run_events", "receipts", "automations"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
            .execute(&pool)
            .await?;
    }
    pool.close().await;
    Ok(from)
}

/// The id [`fill`] gave run `g` of `runs` written from `from` (µs).
fn run_id(from: i64, runs: usize, g: usize) -> String {
    let span = chrono::Duration::days(DAYS).num_microseconds().unwrap_or(1);
    let at = from + g as i64 * (span / runs as i64);
    let at = chrono::DateTime::from_timestamp_micros(at).unwrap_or_default();
    format!("{}{g:020x}", automesh_domain::ids::run_id_bound(at))
}

struct Figures {
    first_page: Figure,
    /// The page read, and its figure.
    deep_page: (usize, Figure),
    get_run: Figure,
    run_now: Figure,
    pass: Figure,
}

async fn measure(
    mesh: &Mesh,
    from: i64,
    runs: usize,
    owners: usize,
    samples: usize,
) -> anyhow::Result<Figures> {
    let owner = |i: usize| (i.wrapping_mul(7919)) % owners;
    let token = |o: usize| mesh.token(&org_of(o), &format!("owner-{o}"));
    let tokens: Vec<String> = (0..owners).map(token).collect();
    let list = |o: usize, page_token: String| {
        let mut client = mesh.runs(Some(&tokens[o]));
        async move {
            let page = client
                .list_runs(pb::ListRunsRequest {
                    page_size: PAGE,
                    page_token,
                    ..Default::default()
                })
                .await?
                .into_inner();
            anyhow::Ok(page)
        }
    };
    let first_page = timed(samples, |i| {
        let page = list(owner(i), String::new());
        async move {
            anyhow::ensure!(!page.await?.runs.is_empty(), "an empty first page");
            Ok(())
        }
    })
    .await?;
    // The token of page DEEP of one owner, walked to once.
    let deep_owner = owner(1);
    let mut page_token = String::new();
    let depth = DEEP.min(runs / owners / PAGE as usize).max(1);
    for _ in 1..depth {
        page_token = list(deep_owner, page_token).await?.next_page_token;
    }
    let deep_page = timed(samples, |_| {
        let page = list(deep_owner, page_token.clone());
        async move {
            page.await?;
            Ok(())
        }
    })
    .await?;
    let get_run = timed(samples, |i| {
        // Run g belongs to owner g % owners.
        let g = (i.wrapping_mul(104_729)) % runs;
        let o = g % owners;
        let mut client = mesh.runs(Some(&tokens[o]));
        async move {
            client
                .get_run(pb::GetRunRequest {
                    id: run_id(from, runs, g),
                })
                .await?;
            Ok(())
        }
    })
    .await?;
    let run_now = timed(samples, |i| {
        let o = owner(i);
        let mut client = mesh.automations(Some(&tokens[o]));
        async move {
            client
                .run_automation_now(pb::RunAutomationNowRequest {
                    id: format!("bench-a-{o}"),
                    idempotency_key: format!("bench-{i}"),
                })
                .await?;
            Ok(())
        }
    })
    .await?;
    // The scheduler's pass firing 100 due automations.
    let settings = automesh_scheduler::occurrences::Settings::new(
        Duration::from_secs(1800),
        Duration::from_secs(3600),
    );
    let pool = sqlx::PgPool::connect(&mesh.db.url).await?;
    let mut fired = 0;
    let mut taken = vec![];
    for round in 0..samples.clamp(5, 30) {
        let at = Utc::now().timestamp_micros();
        let first = (round * 100) % owners.max(100);
        sqlx::query(
            "UPDATE automations SET next_run_at = $1 WHERE id IN \
             (SELECT 'bench-a-' || g FROM generate_series($2::bigint, $3::bigint) g)",
        )
        .bind(at)
        .bind(first as i64)
        .bind((first + 99) as i64)
        .execute(&pool)
        .await?;
        let t = Instant::now();
        fired += automesh_scheduler::occurrences::pass(mesh.store(), &settings).await?;
        taken.push(t.elapsed().as_secs_f64() * 1e3);
    }
    pool.close().await;
    taken.sort_by(|a, b| a.total_cmp(b));
    eprintln!(
        "  scheduler passes fired {fired} automations in {} passes",
        taken.len()
    );
    let pass = (percentile(&taken, 0.5), percentile(&taken, 0.99));
    Ok(Figures {
        first_page,
        deep_page: (depth, deep_page),
        get_run,
        run_now,
        pass,
    })
}

/// Bytes the runs, their events and receipts take (tables, indexes, TOAST),
/// over every partition.
async fn storage(url: &str) -> anyhow::Result<i64> {
    let pool = sqlx::PgPool::connect(url).await?;
    let bytes: i64 = sqlx::query_scalar(
        "SELECT CAST(sum(pg_total_relation_size(t.relid)) AS BIGINT) FROM \
         (SELECT relid FROM pg_partition_tree('runs') UNION ALL \
          SELECT relid FROM pg_partition_tree('run_events') UNION ALL \
          SELECT relid FROM pg_partition_tree('receipts')) t",
    )
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    Ok(bytes)
}

/// What one retention pass cost: its time, WAL bytes and blocks touched
/// (read + hit), printed with what it deleted.
async fn costed(
    mesh: &Mesh,
    what: &str,
    policy: Policy,
    now: chrono::DateTime<Utc>,
) -> anyhow::Result<()> {
    let pool = sqlx::PgPool::connect(&mesh.db.url).await?;
    let counters = "SELECT CAST(blks_read + blks_hit AS BIGINT) FROM pg_stat_database \
                    WHERE datname = current_database()";
    tokio::time::sleep(automesh_e2e_tests::bench::stats_settle()).await;
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&pool)
        .await?;
    let lsn: String = sqlx::query_scalar("SELECT CAST(pg_current_wal_lsn() AS TEXT)")
        .fetch_one(&pool)
        .await?;
    let blocks: i64 = sqlx::query_scalar(counters).fetch_one(&pool).await?;
    let t = Instant::now();
    let pass = mesh.store().internal().purge_expired(policy, now).await?;
    let took = t.elapsed().as_secs_f64();
    let wal: i64 = sqlx::query_scalar(
        "SELECT CAST(pg_wal_lsn_diff(pg_current_wal_lsn(), CAST($1 AS pg_lsn)) AS BIGINT)",
    )
    .bind(&lsn)
    .fetch_one(&pool)
    .await?;
    tokio::time::sleep(automesh_e2e_tests::bench::stats_settle()).await;
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&pool)
        .await?;
    let after: i64 = sqlx::query_scalar(counters).fetch_one(&pool).await?;
    let touched = after - blocks;
    pool.close().await;
    let runs = pass.purged.runs.max(1) as f64;
    println!(
        "  retention, {what}: {} runs ({} events, {} receipts) deleted in {took:.2} s \
         ({:.0} runs/s; weeks dropped: {}); WAL {:.1} MiB ({:.0} B/run); {touched} blocks touched \
         ({:.2}/run)",
        pass.purged.runs,
        pass.purged.run_events,
        pass.purged.receipts,
        runs / took,
        if pass.weeks_dropped.is_empty() {
            "none".to_owned()
        } else {
            pass.weeks_dropped.join(" ")
        },
        wal as f64 / 1048576.0,
        wal as f64 / runs,
        touched as f64 / runs,
    );
    Ok(())
}

/// Retention both ways on the runs [`fill`] wrote from `from` (µs): the
/// default 30 days on the day the oldest week falls due (a drop), then one
/// organisation's oldest three days in batches.
async fn retention(mesh: &Mesh, from: i64) -> anyhow::Result<()> {
    use chrono::Datelike;
    let first = chrono::DateTime::from_timestamp_micros(from).unwrap_or_default();
    let monday = first.date_naive()
        - chrono::Duration::days(i64::from(first.weekday().num_days_from_monday()));
    let week_end = monday.and_time(chrono::NaiveTime::MIN).and_utc() + chrono::Duration::days(7);
    // A week is due once its end is 32 days behind (the budget rule's floor).
    let due = week_end + chrono::Duration::days(32) + chrono::Duration::minutes(1);
    let policy = Policy {
        time_bound: Duration::from_secs(24 * 3600),
        ..Policy::default()
    };
    costed(mesh, "a week dropped", policy, due).await?;
    // org-0 keeps only until three days after the dropped week's end.
    let short = (due - week_end).num_days() - 3;
    let internal = mesh.store().internal();
    internal
        .set_org_retention("org-0", short as u32, due)
        .await?;
    costed(
        mesh,
        "org-0's next three days in batches of 500",
        policy,
        due,
    )
    .await?;
    internal.clear_org_retention("org-0").await?;
    Ok(())
}

async fn mesh() -> anyhow::Result<(Mesh, TestExecutor)> {
    let behavior = Behavior::Complete {
        after: Duration::ZERO,
        events: 1,
    };
    let (executor, addr) = TestExecutor::start(behavior).await?;
    let options = MeshOptions {
        executor: Some(addr),
        ..MeshOptions::benchmark()
    };
    Ok((
        Mesh::start_with(Backend::Postgres, options).await?,
        executor,
    ))
}

fn show(name: &str, big: Figure, small: Figure) {
    println!(
        "  {name:<22} p50 {:>7.2} ms  p99 {:>7.2} ms   at 10k: p50 {:>7.2} ms  p99 {:>7.2} ms   ratio p50 {:.2}×  p99 {:.2}×",
        big.0,
        big.1,
        small.0,
        small.1,
        big.0 / small.0,
        big.1 / small.1
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    check_args(
        "bench-history",
        "Reads, run-now and the scheduler's pass at millions of finished runs, and retention",
        FLAGS,
    );
    let runs = sized("--runs", 10_000_000, 20_000);
    let owners = sized("--owners", 1_000, 100).max(10);
    let events = sized("--events", 2, 2);
    let samples = sized("--samples", 200, 20);
    let mut figures = vec![];
    for size in [BASELINE_RUNS, runs] {
        eprintln!("{size} finished runs across {owners} owners, {events} events each:");
        let (mesh, _executor) = mesh().await?;
        let t = Instant::now();
        let from = fill(&mesh, size, owners, events).await?;
        eprintln!(
            "  written and analysed in {:.0} s",
            t.elapsed().as_secs_f64()
        );
        figures.push(measure(&mesh, from, size, owners, samples).await?);
        if size == runs {
            let bytes = storage(&mesh.db.url).await?;
            println!(
                "{runs} runs, {events} events each, across {owners} owners (PostgreSQL):\n  \
                 storage: {:.0} MiB, {:.0} bytes per run with its events and receipt (indexes included)",
                bytes as f64 / 1048576.0,
                bytes as f64 / runs as f64
            );
            retention(&mesh, from).await?;
        }
        mesh.stop().await?;
    }
    let (small, big) = (&figures[0], &figures[1]);
    println!("through the public API (p50/p99), {runs} runs next to {BASELINE_RUNS}:");
    show("ListRuns first page", big.first_page, small.first_page);
    show(
        &format!("ListRuns page {}", big.deep_page.0),
        big.deep_page.1,
        small.first_page,
    );
    println!(
        "    (next to the first page at 10k: an owner has {} runs there)",
        BASELINE_RUNS / owners
    );
    show("GetRun", big.get_run, small.get_run);
    show("RunAutomationNow", big.run_now, small.run_now);
    show("scheduler pass (100)", big.pass, small.pass);
    Ok(())
}
