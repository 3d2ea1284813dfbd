//! Benchmark of the desktop path on PostgreSQL.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-desktop [-- --streams 10000 --more 19000 --latency-runs 100 --heartbeats --runner-http2 hyper]
//!   cargo run -p automesh-e2e-tests --bin bench-desktop -- --quick
//!
//! Prints, from one run on this machine:
//! - baselines: a bare gRPC round trip (health check) to the gateway
//!   process, and PostgreSQL's single-row transaction latency;
//! - `--streams` idle runner streams held by one desktop-runner-gateway
//!   *process* (a child of this one, on its own port; each stream on its
//!   own TCP connection, kept alive by HTTP/2 PING as the reference runner
//!   asks, or by heartbeats every 3 s with `--heartbeats`), whether all
//!   stayed alive past the dead-stream bound, the gateway's resident memory
//!   per stream, and its CPU while they idle (% of one core per 10,000
//!   streams);
//! - the latency from a desktop run's due instant to its runner receiving
//!   the assignment (p50, p99), through two replicas: the mesh's scheduler
//!   and coordinator call the in-process replica, the runners are on the
//!   child process holding all the idle streams, so every assignment
//!   crosses PostgreSQL (NOTIFY + claim);
//! - then with `--more` streams in all: memory per stream again, and the
//!   latency from a public-API RunAutomationNow call to the runner
//!   receiving the assignment (p50, p99); and that latency again while one
//!   more connection floods the runner listener with PINGs and SETTINGS,
//!   as a ratio to the latency without the flood.
//!
//! The machine is shared; read medians and ratios. `--quick` is the short
//! form CI runs once (500 and 950 streams; figures printed, not checked).
//! To profile the gateway process, name a wrapper in `BENCH_WRAP` (for
//! example `BENCH_WRAP=heaptrack`): the child is started under it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use automesh_domain::automation::NewAutomation;
use automesh_domain::{Principal, Schedule, Surface};
use automesh_e2e_tests::bench::{
    Assigned, Flag, QUICK, RUNNER_HTTP2, StubRunners, check_args, median, mint_runner, percentile,
    quick, sized,
};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_proto::v1 as pb;
use automesh_store::{Backend, Store, StoreOptions};
use chrono::Utc;
use tokio::io::AsyncBufReadExt;

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS for {pid}"))
}

/// CPU time (user + system) the process has used so far, in seconds.
fn cpu_secs(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    automesh_e2e_tests::bench::proc_cpu(&stat)
        .map(|(_, secs)| secs)
        .ok_or_else(|| anyhow::anyhow!("odd /proc/{pid}/stat"))
}

/// Child mode: one desktop-runner-gateway process on `url`, its runner
/// listener served by `http2` (`lean` or `hyper`).
async fn serve_gateway(url: &str, http2: &str) -> anyhow::Result<()> {
    // Its log on stdout, where the benchmark reads it (filtered by RUST_LOG).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stdout)
        .with_ansi(false)
        .try_init();
    let store = Store::connect_lazy(url, StoreOptions::default())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let internal = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening http://{}", listener.local_addr()?);
    let credential = automesh_rpc::InternalCredential::new("test-internal-credential-0123")?;
    let config =
        automesh_rpc::runtime::config_from_args(&["--database-url", url, "--runner-http2", http2])?;
    automesh_desktop_runner_gateway::Service::new(&config, store, credential)?
        .serve(
            automesh_desktop_runner_gateway::Listeners {
                runners: listener,
                internal,
            },
            tokio_util::sync::CancellationToken::new(),
        )
        .await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--serve-gateway") {
        let url = args.get(i + 1).cloned().unwrap_or_default();
        let http2 = args.get(i + 2).cloned().unwrap_or_else(|| "lean".into());
        return serve_gateway(&url, &http2).await;
    }
    check_args(
        "bench-desktop",
        "Benchmark of the desktop path on PostgreSQL (AUTOMESH_TEST_POSTGRES_URL): idle runner \
         streams on a gateway process (memory and CPU per stream), due → assignment latency, and \
         run-now → assignment with more streams.",
        &[
            Flag::count("--streams", "idle runner streams first (default 10000)"),
            Flag::count(
                "--more",
                "streams in all for the second part (default 19000)",
            ),
            Flag::count(
                "--latency-runs",
                "runs measured per latency case (default 100)",
            ),
            Flag::switch(
                "--heartbeats",
                "keep streams alive by heartbeats every 3 s, not HTTP/2 PING",
            ),
            RUNNER_HTTP2,
            QUICK,
        ],
    );
    let (_, http2) = automesh_e2e_tests::bench::runner_http2()?;
    let streams = sized("--streams", 10_000, 500);
    let more = sized("--more", 19_000, 950).max(streams);
    let latency_runs = sized("--latency-runs", 100, 20);
    let ping_liveness = !std::env::args().any(|a| a == "--heartbeats");
    let latency_users = 16;
    let mesh = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            desktop_via_runner_gateway: true,
            ..MeshOptions::benchmark()
        },
    )
    .await?;
    let store = mesh.store().clone();
    println!(
        "automesh desktop benchmark (PostgreSQL, {} cores{}; liveness by {}; runner listener on {http2} HTTP/2)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        if quick() { ", --quick" } else { "" },
        if ping_liveness {
            "HTTP/2 PING"
        } else {
            "heartbeats every 3 s"
        }
    );

    // The gateway process.
    let mut child = match std::env::var("BENCH_WRAP") {
        Ok(w) => {
            let mut c = tokio::process::Command::new(w);
            c.arg(std::env::current_exe()?);
            c
        }
        Err(_) => tokio::process::Command::new(std::env::current_exe()?),
    };
    let mut child = child
        .args(["--serve-gateway", &mesh.db.url, &http2])
        .stdout(std::process::Stdio::piped())
        // Errors, and why the gateway ended a connection with an error (a
        // keepalive PING unanswered, a broken pipe), counted below.
        .env("RUST_LOG", "error,automesh_rpc::server::connections=debug")
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().ok_or_else(|| anyhow::anyhow!("no child pid"))?;
    let mut lines = tokio::io::BufReader::new(
        child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("stdout"))?,
    )
    .lines();
    // Its address, on the first line it prints (a wrapper may print first).
    let listening = async {
        while let Some(line) = lines.next_line().await? {
            if let Some(addr) = line.strip_prefix("listening ") {
                return Ok(addr.to_owned());
            }
        }
        anyhow::bail!("the gateway process ended before it listened")
    };
    let addr = tokio::time::timeout(Duration::from_secs(30), listening)
        .await
        .map_err(|_| anyhow::anyhow!("the gateway process did not start within 30 s"))??;
    let closed_by_gateway =
        std::sync::Arc::new(parking_lot::Mutex::new(std::collections::BTreeMap::<
            String,
            usize,
        >::new()));
    let counting = closed_by_gateway.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(at) = line.find("connection ended") {
                let cause = line[at..].chars().take(120).collect::<String>();
                {
                    let mut c = counting.lock();
                    *c.entry(cause).or_default() += 1;
                }
            }
        }
    });
    automesh_e2e_tests::wait_for_health(&addr, Duration::from_secs(30), true).await?;

    // Baselines.
    let (rtt, _) = automesh_e2e_tests::bench::baseline_round_trips(&addr, &store).await?;
    // Occurrences are due 50 ms apart: the floor of a lone dispatch's hops.
    let (spaced, _) =
        automesh_e2e_tests::bench::spaced_round_trips(&addr, &store, Duration::from_millis(50))
            .await?;

    // Runners and their tokens.
    let t = Instant::now();
    let mut tokens = Vec::with_capacity(more);
    for i in 0..more {
        tokens.push(mint_runner(&store, &Principal::new("bench", format!("idle-{i}")), i).await?);
        if (i + 1) % 5000 == 0 {
            println!("setup     {} runner tokens minted…", i + 1);
        }
    }
    let mut latency_tokens = vec![];
    for u in 0..latency_users {
        latency_tokens
            .push(mint_runner(&store, &Principal::new("bench", format!("lat-{u}")), u).await?);
    }
    println!(
        "setup     {more} runner tokens minted in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // The gateway's own idle CPU, before any stream: what the streams add
    // is measured against it.
    let window = if quick() { 3.0 } else { 10.0 };
    let cpu0 = cpu_secs(pid)?;
    tokio::time::sleep(Duration::from_secs_f64(window)).await;
    let cpu_base = (cpu_secs(pid)? - cpu0) / window * 100.0;
    println!("baseline  the gateway process idles at {cpu_base:.2} % of a core without streams");
    let rss_before = rss_kib(pid)?;
    let (runners, mut assigned_rx) = StubRunners::new(ping_liveness);
    // One idle runner stream per token, counted as it is welcomed or ends.
    let connect = |token: String| tokio::spawn(runners.clone().hold(addr.clone(), token));
    // The latency runners first: they are streams like the others.
    for token in latency_tokens {
        connect(token);
    }
    let mut tokens = tokens.into_iter();

    // Idle streams, in two stages.
    let mut held = 0;
    for total in [streams, more] {
        let t = Instant::now();
        for token in tokens.by_ref().take(total - held) {
            connect(token);
            held += 1;
            if held % 100 == 0 {
                // Pace the connects (2,000 a second): a real fleet does not
                // arrive in one instant, and these stub runners, unlike
                // real ones, never reconnect.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let expected = latency_users + held;
        while runners.settled() < expected {
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(300),
                "streams did not connect within 300 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!(
            "streams   {} of {expected} welcomed ({:.1} s for this stage)",
            runners.welcomed.load(Ordering::SeqCst),
            t.elapsed().as_secs_f64()
        );
        // Past the 10 s dead-stream bound: every stream must still be alive.
        tokio::time::sleep(Duration::from_secs(12)).await;
        let alive = runners.alive();
        let rss = rss_kib(pid)?;
        let per_stream = rss.saturating_sub(rss_before) as f64 / alive.max(1) as f64;
        // The gateway's CPU while every stream idles, above its own.
        let cpu0 = cpu_secs(pid)?;
        tokio::time::sleep(Duration::from_secs_f64(window)).await;
        let cpu = (cpu_secs(pid)? - cpu0) / window * 100.0;
        let per_10k = (cpu - cpu_base).max(0.0) * 10_000.0 / alive.max(1) as f64;
        println!(
            "streams   {alive} idle streams alive after 12 s in one gateway process; RSS {:.1} MiB → {:.1} MiB = {per_stream:.1} KiB per stream (goal ≤ 16); idle CPU {cpu:.2} % of a core = {per_10k:.1} % per 10,000 streams above the baseline (goal ≤ 4)",
            rss_before as f64 / 1024.0,
            rss as f64 / 1024.0,
        );
        let causes = runners.ended_causes();
        if !causes.is_empty() {
            println!("streams   ended, by cause: {causes}");
        }
        let c = closed_by_gateway.lock().clone();
        if !c.is_empty() {
            println!("streams   connections the gateway ended with an error, by cause: {c:?}");
        }
        if total == streams {
            let (p50, p99, n) =
                due_latency(&store, latency_runs, latency_users, &mut assigned_rx).await?;
            println!(
                "latency   at {alive} streams: due instant → runner receives assignment   p50 {p50:>7.1} ms   p99 {p99:>7.1} ms   ({n} runs; {:.0} × / {:.0} × the gRPC round trip, {:.0} × / {:.0} × one 50 ms apart; goal p50 ≤ 5, p99 ≤ 25)",
                p50 / rtt,
                p99 / rtt,
                p50 / spaced,
                p99 / spaced
            );
        }
        if total == more {
            let (p50, p99, n) =
                run_now_latency(&mesh, latency_runs, latency_users, &mut assigned_rx).await?;
            println!(
                "latency   at {alive} streams: RunAutomationNow → runner receives assignment   p50 {p50:>7.1} ms   p99 {p99:>7.1} ms   ({n} runs; {:.0} × / {:.0} × the gRPC round trip, {:.0} × / {:.0} × one 50 ms apart; goal p99 ≤ 25)",
                p50 / rtt,
                p99 / rtt,
                p50 / spaced,
                p99 / spaced
            );
            // The same while one more connection floods the runner listener
            // with PINGs and SETTINGS (reading the answers as they come).
            let flood = automesh_e2e_tests::flood::Flood::start(&addr);
            tokio::time::sleep(Duration::from_secs(1)).await;
            let before = flood.counts.answered.load(Ordering::Relaxed);
            let t = Instant::now();
            let (f50, f99, flooded_runs) =
                run_now_latency(&mesh, latency_runs, latency_users, &mut assigned_rx).await?;
            let rate = (flood.counts.answered.load(Ordering::Relaxed) - before) as f64
                / t.elapsed().as_secs_f64();
            println!(
                "flood     at {alive} streams, one connection flooding PING and SETTINGS ({rate:.0} answered/s, {} times ended by the gateway): RunAutomationNow → assignment   p50 {f50:>7.1} ms   p99 {f99:>7.1} ms   ({flooded_runs} runs; {:.2} × / {:.2} × without the flood)",
                flood.counts.ended.load(Ordering::Relaxed),
                f50 / p50,
                f99 / p99
            );
            drop(flood);
        }
        if streams == more {
            break;
        }
    }
    let _ = child.kill().await;
    mesh.stop().await?;
    Ok(())
}

/// Desktop occurrences due one at a time, 50 ms apart, for the latency
/// runners on the gateway process, coordinated through the other replica:
/// (p50, p99, runs) of due instant → assignment received.
async fn due_latency(
    store: &Store,
    runs: usize,
    users: usize,
    assigned: &mut Assigned,
) -> anyhow::Result<(f64, f64, usize)> {
    let start = Utc::now() + chrono::Duration::seconds(3);
    let now = Utc::now();
    let mut due_of = std::collections::HashMap::new();
    for i in 0..runs {
        let owner = Principal::new("bench", format!("lat-{}", i % users));
        let at = start + chrono::Duration::milliseconds(50 * i as i64);
        let id = format!("dlat-{i:05}");
        store
            .create_automation(
                &NewAutomation {
                    pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
                    budget: Default::default(),
                    monthly_budget_micros: None,
                    id: id.clone(),
                    owner: owner.clone(),
                    name: format!("desk {i}"),
                    prompt: "p".into(),
                    model: "fake/echo".into(),
                    surface: Surface::Desktop,
                    schedule: Schedule::Once { at },
                },
                Some(at),
                now,
            )
            .await?;
        due_of.insert(automesh_domain::ids::scheduled_run_id(&id, at), at);
    }
    let dues = due_of.clone();
    let mut latencies = vec![];
    let give_up = Instant::now() + Duration::from_secs(120);
    while latencies.len() < runs && Instant::now() < give_up {
        let Ok(Some((run_id, at))) =
            tokio::time::timeout(Duration::from_secs(5), assigned.recv()).await
        else {
            continue;
        };
        if let Some(due) = due_of.remove(&run_id) {
            latencies.push((at - due).num_microseconds().unwrap_or(0) as f64 / 1000.0);
        }
    }
    anyhow::ensure!(!latencies.is_empty(), "no assignment arrived");
    latencies.sort_by(|a, b| a.total_cmp(b));
    let n = latencies.len();
    // Where the time goes, from the rows' own instants (microseconds).
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT r.id, r.created_at, d.created_at, d.claimed_at \
         FROM runs r JOIN desktop_assignments d ON d.run_id = r.id \
         WHERE r.automation_id LIKE 'dlat-%'",
    )
    .fetch_all(store.pool())
    .await?;
    let after_due = |pick: fn(&(String, i64, i64, i64)) -> i64| {
        let ms: Vec<f64> = rows
            .iter()
            .filter_map(|r| {
                dues.get(&r.0)
                    .map(|due| (pick(r) - due.timestamp_micros()) as f64 / 1000.0)
            })
            .collect();
        if ms.is_empty() { f64::NAN } else { median(ms) }
    };
    println!(
        "latency   where it goes (medians after the due instant): run created {:.1} ms (negative: ahead of it, then held by the coordinator until it), offered {:.1} ms, claimed for the runner {:.1} ms",
        after_due(|r| r.1),
        after_due(|r| r.2),
        after_due(|r| r.3),
    );
    Ok((percentile(&latencies, 0.5), percentile(&latencies, 0.99), n))
}

/// RunAutomationNow through the public API, one at a time, 50 ms apart, for
/// desktop automations of the latency runners' owners: (p50, p99, runs) of
/// call → assignment received.
async fn run_now_latency(
    mesh: &Mesh,
    runs: usize,
    users: usize,
    assigned: &mut Assigned,
) -> anyhow::Result<(f64, f64, usize)> {
    use automesh_e2e_tests::Api as _;
    // One client (one connection) per user, made and connected before
    // anything is measured, as a web backend keeps its channel: the
    // measured call is the call, not a connection's setup.
    let mut automations = vec![];
    for u in 0..users {
        let token = mesh.token("bench", &format!("lat-{u}"));
        let mut api = mesh.automations(Some(&token));
        let request =
            automesh_e2e_tests::daily_automation(&format!("now {u}"), "p", pb::Surface::Desktop);
        let id = api.create(request).await.id;
        automations.push((api, id));
    }
    let mut called_at = std::collections::HashMap::new();
    let mut received = std::collections::HashMap::new();
    for i in 0..runs {
        let (api, automation_id) = &mut automations[i % users];
        let t0 = Utc::now();
        let run = api.run_now(automation_id, &format!("bench-{i}")).await;
        called_at.insert(run.id, t0);
        while let Ok((run_id, at)) = assigned.try_recv() {
            received.insert(run_id, at);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let give_up = Instant::now() + Duration::from_secs(60);
    while called_at.keys().any(|r| !received.contains_key(r)) && Instant::now() < give_up {
        if let Ok(Some((run_id, at))) =
            tokio::time::timeout(Duration::from_secs(1), assigned.recv()).await
        {
            received.insert(run_id, at);
        }
    }
    let mut latencies: Vec<f64> = called_at
        .iter()
        .filter_map(|(run, t0)| received.get(run).map(|at| *at - *t0))
        .map(|d| d.num_microseconds().unwrap_or(0) as f64 / 1000.0)
        .collect();
    anyhow::ensure!(!latencies.is_empty(), "no run-now assignment arrived");
    latencies.sort_by(|a, b| a.total_cmp(b));
    let n = latencies.len();
    // Where the time goes, from the rows' own instants: p50 and p99 of each
    // step after the call, so that a tail shows the step it is in.
    let ids: Vec<String> = called_at.keys().cloned().collect();
    /// A run's id, created, offered and claimed-for-the-runner instants.
    type Steps = (String, i64, i64, Option<i64>);
    let rows: Vec<Steps> = sqlx::query_as(
        "SELECT r.id, r.created_at, d.created_at, d.claimed_at \
         FROM runs r JOIN desktop_assignments d ON d.run_id = r.id WHERE r.id = ANY(string_to_array($1, ','))",
    )
    .bind(ids.join(","))
    .fetch_all(mesh.store().pool())
    .await?;
    let step = |pick: fn(&Steps) -> Option<i64>| {
        let mut ms: Vec<f64> = rows
            .iter()
            .filter_map(|r| {
                let t0 = called_at.get(&r.0)?.timestamp_micros();
                pick(r).map(|at| (at - t0) as f64 / 1000.0)
            })
            .collect();
        ms.sort_by(|a, b| a.total_cmp(b));
        if ms.is_empty() {
            "–".to_owned()
        } else {
            format!("{:.1} / {:.1}", percentile(&ms, 0.5), percentile(&ms, 0.99))
        }
    };
    println!(
        "latency   where it goes (p50 / p99 ms after the call): run created {}, offered {}, claimed for the runner {}, received {:.1} / {:.1}",
        step(|r| Some(r.1)),
        step(|r| Some(r.2)),
        step(|r| r.3),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
    );
    Ok((percentile(&latencies, 0.5), percentile(&latencies, 0.99), n))
}
