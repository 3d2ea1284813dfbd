//! What notifications cost and how fast they arrive, on PostgreSQL.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-notifications [-- --endpoints 1000 --messages 10 --hang-percent 10 --singles 200 --runs 1000 --repeats 5]
//!
//! Prints, from one run on this machine:
//! - delivery: `--endpoints` endpoints of as many owners, `--hang-percent`
//!   of them on a receiver that never answers (each attempt waits out the
//!   production bound of 10 s), the rest on one that answers 204 at once;
//!   `--messages` messages per endpoint written to the outbox at once.
//!   Messages per second delivered to the answering endpoints, and the lag
//!   from the outbox commit to the receiver (p50, p99), next to a bare HTTP
//!   round trip to the same receiver (the baseline, measured now); then the
//!   lag of `--singles` messages written one at a time, 20 ms apart;
//! - the run path: `--runs` runs due at once, each failing (so each writes
//!   a `run.failed` message in the transaction that ends it), driven to
//!   receipts by a mesh with notifications on (every owner has an endpoint,
//!   delivery running) and by one with them off, alternately, `--repeats`
//!   rounds each; runs per second of each (medians) and their ratio.
//!
//! The machine is shared: read medians and ratios. `--quick` is the short
//! form CI runs once (figures printed, not checked).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use automesh_domain::{Notice, Principal, Surface, WebhookEndpoint};
use automesh_e2e_tests::bench::{
    Flag, QUICK, check_args, insert_due, median, percentile, settle_then, sized,
};
use automesh_e2e_tests::executor::{Behavior, TestExecutor};
use automesh_e2e_tests::webhooks::{Answer, Receiver};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_store::{Backend, Store};
use chrono::Utc;

fn owner(i: usize) -> Principal {
    Principal::new("bench", format!("owner-{i:05}"))
}

async fn endpoints(
    store: &Store,
    count: usize,
    url: impl Fn(usize) -> String,
) -> anyhow::Result<Vec<String>> {
    let mut ids = vec![];
    for i in 0..count {
        let o = owner(i);
        let e = WebhookEndpoint {
            id: format!("ep_bench{i:05}"),
            org_id: o.org_id,
            owner_id: o.user_id,
            url: url(i),
            description: String::new(),
            created_at: Utc::now(),
            disabled_at: None,
            disabled_reason: None,
        };
        ids.push(store.create_webhook_endpoint(&e).await?.id);
    }
    Ok(ids)
}

async fn count_ended(store: &Store, prefix: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM receipts WHERE run_id IN \
         (SELECT id FROM runs WHERE automation_id LIKE '{prefix}-%')"
    )))
    .fetch_one(store.pool())
    .await?)
}

/// Runs per second of a burst of `runs` failing runs due at once.
async fn burst(mesh: &Mesh, prefix: &str, runs: usize, owners: usize) -> anyhow::Result<f64> {
    let store = mesh.store();
    let dues = insert_due(
        store,
        prefix,
        runs,
        Surface::Web,
        |i| owner(i % owners),
        |_, base| base + settle_then(1500),
    )
    .await?;
    let due = dues[0];
    while Utc::now() < due {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t0 = Instant::now();
    while count_ended(store, prefix).await? < runs as i64 {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(300),
            "burst did not finish within 300 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = automesh_e2e_tests::bench::last_run(store, prefix, due).await?;
    Ok(last.rate(runs))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    check_args(
        "bench-notifications",
        "What notifications cost and how fast they arrive (PostgreSQL, AUTOMESH_TEST_POSTGRES_URL): \
         delivery throughput and lag with hanging endpoints beside a bare HTTP round trip, and the \
         run path's throughput with notifications on and off.",
        &[
            Flag::count("--endpoints", "endpoints, one per owner (default 1000)"),
            Flag::count(
                "--messages",
                "messages per endpoint written at once (default 10)",
            ),
            Flag::count(
                "--hang-percent",
                "endpoints whose receiver never answers, in percent (default 10)",
            ),
            Flag::count(
                "--singles",
                "messages written one at a time in the lag case (default 200)",
            ),
            Flag::count(
                "--runs",
                "failing runs due at once in the run-path case (default 1000)",
            ),
            Flag::count(
                "--repeats",
                "rounds of the run-path case per mesh; medians (default 5)",
            ),
            QUICK,
        ],
    );
    let count = sized("--endpoints", 1000, 50);
    let per_endpoint = sized("--messages", 10, 2);
    let hang_percent = sized("--hang-percent", 10, 10).min(100);
    let runs = sized("--runs", 1000, 50);
    let repeats = sized("--repeats", 5, 1).max(1);
    println!(
        "automesh notifications benchmark (PostgreSQL, {} cores)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );

    // Delivery.
    let (executor, addr) = TestExecutor::start(Behavior::Fail("provider_error")).await?;
    let options = || MeshOptions {
        executor: Some(addr.clone()),
        webhook_timeout: Duration::from_secs(10),
        webhook_first_retry: Duration::from_secs(5),
        ..MeshOptions::benchmark()
    };
    let on = Mesh::start_with(Backend::Postgres, options()).await?;
    let fast = Receiver::start(Answer::Status(204)).await?;
    let dead = Receiver::start(Answer::Hang).await?;
    // Every (100 / hang-percent)th endpoint, spread evenly.
    let hangs = |i: usize| (i * hang_percent) % 100 < hang_percent;
    let hanging = (0..count).filter(|i| hangs(*i)).count();
    let ids = endpoints(on.store(), count, |i| {
        if hangs(i) {
            dead.url.clone()
        } else {
            fast.url.clone()
        }
    })
    .await?;

    // The baseline: a bare POST to the answering receiver, back to back.
    let client = reqwest::Client::new();
    let mut bare = vec![];
    for _ in 0..200 {
        let t = Instant::now();
        client
            .post(&fast.url)
            .body("{}")
            .send()
            .await?
            .error_for_status()?;
        bare.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    bare.sort_by(f64::total_cmp);
    let before = fast.len();

    let mut committed: HashMap<String, Instant> = HashMap::new();
    let started = Instant::now();
    for _ in 0..per_endpoint {
        let now = Utc::now();
        let notices: Vec<Notice> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| Notice::test(&owner(i), id, now))
            .collect();
        for chunk in notices.chunks(500) {
            on.store().internal().enqueue_notices(chunk).await?;
            let at = Instant::now();
            for n in chunk {
                committed.insert(n.id.clone(), at);
            }
        }
    }
    let written = started.elapsed();
    let want = (count - hanging) * per_endpoint;
    let give_up = Instant::now() + Duration::from_secs(600);
    while fast.len() - before < want {
        let so_far = fast.len() - before;
        anyhow::ensure!(
            Instant::now() < give_up,
            "delivery did not finish within 600 s ({so_far} of {want})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = fast.received();
    let delivered = &got[before..];
    let last = delivered
        .iter()
        .map(|d| d.at)
        .max()
        .unwrap_or_else(tokio::time::Instant::now);
    let span = last.into_std().duration_since(started).as_secs_f64();
    let mut lags: Vec<f64> = delivered
        .iter()
        .filter_map(|d| {
            Some(
                d.at.into_std()
                    .duration_since(*committed.get(d.id())?)
                    .as_secs_f64()
                    * 1000.0,
            )
        })
        .collect();
    lags.sort_by(f64::total_cmp);
    let mut distinct: Vec<&str> = delivered.iter().map(|d| d.id()).collect();
    distinct.sort_unstable();
    distinct.dedup();
    println!(
        "delivery  {} messages to {} answering endpoints ({} more endpoints hang), written in {:.0} ms",
        want,
        count - hanging,
        hanging,
        written.as_secs_f64() * 1000.0
    );
    println!(
        "          throughput {:>8.0} messages/s   lag commit → receiver p50 {:>7.1} ms   p99 {:>7.1} ms",
        want as f64 / span.max(1e-3),
        percentile(&lags, 0.5),
        percentile(&lags, 0.99)
    );
    println!(
        "          baseline: a bare HTTP round trip p50 {:>6.2} ms; {} deliveries of {} distinct messages; {} attempts on the hanging endpoints",
        percentile(&bare, 0.5),
        delivered.len(),
        distinct.len(),
        dead.len()
    );

    // Lag at a low rate: one message at a time, 20 ms apart, each to the
    // next answering endpoint, while the hanging ones hang.
    let answering: Vec<usize> = (0..count).filter(|i| !hangs(*i)).collect();
    let singles = sized("--singles", 200, 20);
    let before = fast.len();
    let mut sent: HashMap<String, Instant> = HashMap::new();
    for k in 0..singles {
        let i = answering[k % answering.len()];
        let notice = Notice::test(&owner(i), &ids[i], Utc::now());
        on.store()
            .internal()
            .enqueue_notices(std::slice::from_ref(&notice))
            .await?;
        sent.insert(notice.id.clone(), Instant::now());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let give_up = Instant::now() + Duration::from_secs(120);
    while fast.len() - before < singles {
        anyhow::ensure!(
            Instant::now() < give_up,
            "single messages not delivered within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = fast.received();
    let mut single: Vec<f64> = got[before..]
        .iter()
        .filter_map(|d| {
            Some(
                d.at.into_std()
                    .duration_since(*sent.get(d.id())?)
                    .as_secs_f64()
                    * 1000.0,
            )
        })
        .collect();
    single.sort_by(f64::total_cmp);
    println!(
        "          one at a time ({singles}, 20 ms apart): lag commit → receiver p50 {:>7.1} ms   p99 {:>7.1} ms",
        percentile(&single, 0.5),
        percentile(&single, 0.99)
    );

    // The run path, with notifications on (this mesh: every owner of a run
    // has an endpoint) and off, alternately.
    let off = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            notifications: false,
            ..options()
        },
    )
    .await?;
    let owners = 16.min(count);
    let (mut with, mut without) = (vec![], vec![]);
    for r in 0..repeats {
        with.push(burst(&on, &format!("on{r}"), runs, owners).await?);
        without.push(burst(&off, &format!("off{r}"), runs, owners).await?);
    }
    let messages: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM webhook_messages WHERE event_type = 'run.failed'")
            .fetch_one(on.store().pool())
            .await?;
    let (with, without) = (median(with), median(without));
    println!(
        "run path  {runs} failing runs due at once: notifications on {with:>7.0} runs/s, off {without:>7.0} runs/s; off / on = {:.3} ({messages} run.failed messages written)",
        without / with.max(1e-9)
    );
    drop(executor);
    on.stop().await?;
    off.stop().await?;
    Ok(())
}
