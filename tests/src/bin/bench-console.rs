//! What the web console costs: page server time against a bare gRPC round
//! trip, and live run pages (server-sent events) held at once.
//!
//!   cargo build --release -p automesh
//!   cargo run --release -p automesh-e2e-tests --bin bench-console [-- --automations 1000 --runs 10000 --watchers 1000]
//!
//! The mesh runs in this process on PostgreSQL; the console is its own
//! process (`automesh console`, the binary `target/release/automesh` unless
//! `AUTOMESH_BIN` names another), a client of the mesh's gateway as it is in
//! production. One user owns `--automations` automations; one of them has
//! `--runs` finished runs with receipts (written through the store, not the
//! API). It prints, as medians and 99th percentiles over `--samples`
//! requests each:
//! - a bare `GetAutomation` round trip through the gateway (the baseline);
//! - the automations page (`GET /`: every automation read, 50 rows rendered
//!   with their last run);
//! - the automation page of the one with `--runs` runs (its facts, 50 rows of
//!   history, its spend summed by the API);
//!
//! each with its ratio to the baseline; then `--watchers` run pages' live
//! streams (`GET /runs/{id}/events`) held at once on the one console: the
//! console process's resident memory per watcher (RSS after they connected
//! minus before, over their number), and the latency from an event's append
//! to the run's log to its arrival at every watcher (p50/p99 over 5 events).
//! `--quick` is the short form CI runs once (the debug binary, 50
//! automations, 200 runs, 20 watchers; figures printed, not checked).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use automesh_domain::{NewRun, Placement, Receipt, RunEventPayload, RunState, RunTrigger, Usage};
use automesh_e2e_tests::bench::{Flag, QUICK, check_args, quick, sized};
use automesh_e2e_tests::{Api, Mesh, MeshOptions};
use automesh_proto::v1 as pb;
use automesh_store::Backend;
use automesh_store::events::NewEvent;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

fn percentile(samples: &mut [f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i.min(samples.len() - 1)]
}

/// Resident memory of `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// One GET over HTTP/1.1 (`Connection: close`): the status and the whole
/// response, bounded by 30 s.
async fn get(addr: &str, path: &str, cookie: &str) -> anyhow::Result<(u16, String)> {
    let fetch = async {
        let mut s = TcpStream::connect(addr).await?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(request.as_bytes()).await?;
        let mut body = Vec::new();
        s.read_to_end(&mut body).await?;
        let text = String::from_utf8_lossy(&body).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        anyhow::Ok((status, text))
    };
    tokio::time::timeout(Duration::from_secs(30), fetch)
        .await
        .map_err(|_| anyhow::anyhow!("GET {path}: no answer within 30 s"))?
}

/// Server time of `samples` sequential GETs of `path` (ms), each checked
/// to answer 200 with `marker` in it.
async fn page_times(
    addr: &str,
    path: &str,
    cookie: &str,
    marker: &str,
    samples: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let started = Instant::now();
        let (status, body) = get(addr, path, cookie).await?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(status == 200, "GET {path} answered {status}");
        anyhow::ensure!(body.contains(marker), "GET {path} lacks {marker:?}");
    }
    Ok(times)
}

/// Opens a run page's live stream; the arrival instant of each marker
/// `bench-<k>` is recorded in `arrivals[k]`.
async fn watch(
    addr: String,
    run_id: String,
    cookie: String,
    events: usize,
    arrivals: Arc<Mutex<Vec<Vec<Instant>>>>,
) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(&addr).await?;
    let request = format!(
        "GET /runs/{run_id}/events HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nAccept: text/event-stream\r\n\r\n"
    );
    s.write_all(request.as_bytes()).await?;
    let mut seen = vec![false; events];
    let mut buffer = String::new();
    let mut chunk = vec![0u8; 16 * 1024];
    while seen.iter().any(|s| !s) {
        let n = s.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "the live stream ended early");
        let at = Instant::now();
        buffer.push_str(&String::from_utf8_lossy(&chunk[..n]));
        for (k, seen) in seen.iter_mut().enumerate() {
            if !*seen && buffer.contains(&format!("bench-{k}-end")) {
                *seen = true;
                arrivals.lock().await[k].push(at);
            }
        }
        // Keep only a tail long enough to hold a split marker.
        if buffer.len() > 64 * 1024 {
            buffer = buffer[buffer.len() - 256..].to_owned();
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    check_args(
        "bench-console",
        "The web console: page server time next to a bare GetAutomation, and live run pages held at once.",
        &[
            Flag::count(
                "--automations",
                "automations of the one user (default 1000)",
            ),
            Flag::count("--runs", "finished runs of one automation (default 10000)"),
            Flag::count("--watchers", "live run pages held at once (default 1000)"),
            Flag::count("--samples", "requests per page measured (default 100)"),
            QUICK,
        ],
    );
    let automations = sized("--automations", 1000, 50);
    let run_count = sized("--runs", 10_000, 200);
    let watchers = sized("--watchers", 1000, 20);
    let samples = sized("--samples", 100, 10);
    let events = 5;
    let profile = if quick() { "debug" } else { "release" };
    let bin = std::env::var_os("AUTOMESH_BIN").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target")
                .join(profile)
                .join("automesh")
        },
        PathBuf::from,
    );
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: cargo build {}-p automesh",
        bin.display(),
        if quick() { "" } else { "--release " }
    );

    // Desktop runs go to the runner gateway, where no runner connects: the
    // live run stays live (admitted) for the whole measurement.
    let mesh = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            desktop_via_runner_gateway: true,
            run_deadline: Duration::from_secs(900),
            ..MeshOptions::benchmark()
        },
    )
    .await?;
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    println!("bench-console: {automations} automations, {run_count} runs, {watchers} watchers");
    let started = Instant::now();
    let mut ids = Vec::with_capacity(automations);
    for i in 0..automations {
        let created = api
            .create(pb::CreateAutomationRequest {
                automation: Some(pb::Automation {
                    name: format!("automation {i:04}"),
                    prompt: "summarise the day".into(),
                    model: "fake/echo".into(),
                    schedule: Some(pb::Schedule {
                        kind: Some(pb::schedule::Kind::Daily(pb::DailySchedule {
                            time_of_day: Some(pb::TimeOfDay {
                                hours: 9,
                                minutes: 0,
                            }),
                            time_zone: "Europe/Paris".into(),
                        })),
                    }),
                    ..Default::default()
                }),
                surface: pb::Surface::Desktop as i32,
            })
            .await;
        ids.push(created.id);
    }
    let busy = ids.last().cloned().unwrap_or_default();
    let owner = automesh_domain::Principal::new("acme", "alice");
    let stored = mesh.store().get_automation(&owner, &busy).await?;
    let now = chrono::Utc::now();
    for i in 0..run_count {
        let at = now - chrono::Duration::minutes(i as i64 * 4);
        let id = format!("bench-run-{i:06}");
        let run = NewRun {
            id: id.clone(),
            automation: &stored,
            trigger: RunTrigger::Schedule,
            scheduled_for: Some(at),
            idempotency_key: None,
            state: RunState::Skipped,
            error: None,
            deadline_at: at + chrono::Duration::hours(1),
            traceparent: None,
        };
        mesh.store().create_run(&run, at).await?;
        let mut receipt = Receipt::bare(&id, RunState::Skipped, Placement::Desktop, at);
        receipt.usage = Usage {
            input_tokens: 1000,
            output_tokens: 200,
            cost_micros: 720,
        };
        mesh.store().insert_receipt(&receipt).await?;
    }
    println!("  data written in {:.1} s", started.elapsed().as_secs_f64());

    // The console as its own process.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut console = tokio::process::Command::new(&bin)
        .arg("console")
        .env("AUTOMESH_CONSOLE_LISTEN", &addr)
        .env("AUTOMESH_CONSOLE_GATEWAY", &mesh.gateway)
        .env("AUTOMESH_METRICS_LISTEN", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()?;
    let pid = console.id().unwrap_or_default();
    let give_up = Instant::now() + Duration::from_secs(30);
    while get(&addr, "/healthz", "").await.map(|r| r.0).unwrap_or(0) != 200 {
        anyhow::ensure!(
            Instant::now() < give_up,
            "the console did not answer /healthz within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cookie = format!("automesh_session={token}");

    // Warm both paths, then measure.
    page_times(&addr, "/", &cookie, "automation 0", 3).await?;
    let mut bare = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        api.get_automation(pb::GetAutomationRequest { id: busy.clone() })
            .await?;
        bare.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut list = page_times(&addr, "/", &cookie, "automation", samples).await?;
    let history = format!("/automations/{busy}");
    let mut runs_page = page_times(&addr, &history, &cookie, "bench-run-", samples).await?;
    let (b50, b99) = (percentile(&mut bare, 0.5), percentile(&mut bare, 0.99));
    println!("  bare GetAutomation           p50 {b50:8.2} ms  p99 {b99:8.2} ms");
    for (name, times) in [
        ("automations page (GET /)", &mut list),
        ("automation + history page", &mut runs_page),
    ] {
        let (p50, p99) = (percentile(times, 0.5), percentile(times, 0.99));
        println!(
            "  {name:<28} p50 {p50:8.2} ms  p99 {p99:8.2} ms  ({:.1}× / {:.1}× the bare call)",
            p50 / b50,
            p99 / b99
        );
    }

    // Live run pages: one live run, `watchers` streams of it.
    let live = api.run_now(&busy, "bench-live").await;
    let before = rss_kib(pid);
    let arrivals = Arc::new(Mutex::new(vec![Vec::new(); events]));
    let mut tasks = Vec::with_capacity(watchers);
    for _ in 0..watchers {
        tasks.push(tokio::spawn(watch(
            addr.clone(),
            live.id.clone(),
            cookie.clone(),
            events,
            arrivals.clone(),
        )));
    }
    // Every watcher is connected once the console holds as many watches.
    let metrics_ready = Instant::now() + Duration::from_secs(120);
    tokio::time::sleep(Duration::from_secs(3)).await;
    loop {
        let held = tasks.iter().filter(|t| !t.is_finished()).count();
        if held == watchers || Instant::now() > metrics_ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(pid);
    let mut appended = Vec::with_capacity(events);
    for k in 0..events {
        let at = Instant::now();
        mesh.store()
            .append_events(
                &live.id,
                &[NewEvent {
                    event_id: format!("bench-{k}"),
                    payload: RunEventPayload::AssistantText {
                        text: format!("bench-{k}-end"),
                    },
                }],
                chrono::Utc::now(),
            )
            .await?;
        appended.push(at);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let finished = tokio::time::timeout(Duration::from_secs(60), async {
        let mut failed = 0;
        for t in tasks {
            if !matches!(t.await, Ok(Ok(()))) {
                failed += 1;
            }
        }
        failed
    })
    .await
    .map_err(|_| anyhow::anyhow!("watchers did not all see every event within 60 s"))?;
    let mut latencies: Vec<f64> = Vec::new();
    for (k, seen) in arrivals.lock().await.iter().enumerate() {
        latencies.extend(
            seen.iter()
                .map(|at| at.duration_since(appended[k]).as_secs_f64() * 1e3),
        );
    }
    let per_watcher = after.saturating_sub(before) as f64 / watchers as f64;
    println!(
        "  {watchers} live run pages on one console: RSS {:.1} → {:.1} MiB, {per_watcher:.1} KiB per watcher",
        before as f64 / 1024.0,
        after as f64 / 1024.0
    );
    println!(
        "  event append → every watcher: p50 {:.1} ms  p99 {:.1} ms over {} arrivals ({finished} watchers failed)",
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
        latencies.len()
    );
    anyhow::ensure!(finished == 0, "{finished} watchers failed");
    let _ = console.start_kill();
    let _ = console.wait().await;
    mesh.stop().await?;
    Ok(())
}
