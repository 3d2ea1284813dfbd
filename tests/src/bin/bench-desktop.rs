//! Benchmark of the desktop path on PostgreSQL.
//!
//!   cargo run --release -p automesh-e2e-tests --bin bench-desktop [-- --streams 10000 --latency-runs 100]
//!
//! Prints, from one run on this machine:
//! - baselines: a bare gRPC round trip (health check) to the gateway
//!   process, and PostgreSQL's single-row transaction latency;
//! - idle runner streams held by one desktop-runner-gateway *process* (a
//!   child of this one, on its own port; each stream on its own TCP
//!   connection, heartbeating every 3 s as real runners do), whether all
//!   stayed alive past the dead-stream bound, and the gateway's resident
//!   memory per stream;
//! - the latency from a desktop run's due instant to its runner receiving
//!   the assignment (p50, p99), through two replicas: the mesh's scheduler
//!   and coordinator call the in-process replica, the runners are on the
//!   child process holding all the idle streams, so every assignment
//!   crosses PostgreSQL (NOTIFY + claim).
//!
//! The machine is shared; read medians and ratios.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use automesh_domain::automation::NewAutomation;
use automesh_domain::{Principal, Schedule, Surface};
use automesh_e2e_tests::bench::{arg, median, percentile};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_proto::runner::v1 as rpb;
use automesh_proto::runner::v1::desktop_runner_service_client::DesktopRunnerServiceClient;
use automesh_proto::v1 as pb;
use automesh_store::{Backend, Store, StoreOptions};
use chrono::Utc;
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS for {pid}"))
}

/// Child mode: one desktop-runner-gateway process on `url`.
async fn serve_gateway(url: &str) -> anyhow::Result<()> {
    let store = Store::connect_lazy(url, StoreOptions::default())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let internal = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening http://{}", listener.local_addr()?);
    let credential = automesh_rpc::InternalCredential::new("test-internal-credential-0123")?;
    let config = automesh_rpc::runtime::config_from_args(&["--database-url", url])?;
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

async fn mint(store: &Store, owner: &Principal, i: usize) -> anyhow::Result<String> {
    let token = format!("amr_bench_{}_{i}", uuid::Uuid::new_v4().simple());
    store
        .create_runner(
            owner,
            &automesh_domain::ids::new_runner_id(),
            &format!("bench {i}"),
            &automesh_desktop_runner_gateway::hash_token(&token),
            Utc::now(),
        )
        .await?;
    Ok(token)
}

/// One runner stream: Hello, then heartbeats at the interval the gateway
/// asks for; assignments are accepted and finished at once and their
/// arrival time reported.
async fn hold(
    addr: String,
    token: String,
    welcomed: Arc<AtomicUsize>,
    ended: Arc<AtomicUsize>,
    assignments: mpsc::UnboundedSender<(String, chrono::DateTime<Utc>)>,
) {
    let Ok(endpoint) = tonic::transport::Endpoint::from_shared(addr) else {
        return;
    };
    let Ok(channel) = endpoint.connect().await else {
        ended.fetch_add(1, Ordering::SeqCst);
        return;
    };
    let (tx, rx) = mpsc::channel(8);
    let _ = tx
        .send(rpb::ConnectRequest {
            message: Some(rpb::connect_request::Message::Hello(rpb::Hello {
                runner_version: "bench".into(),
                held_runs: vec![],
            })),
        })
        .await;
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    if let Ok(v) = format!("Bearer {token}").parse() {
        request.metadata_mut().insert("authorization", v);
    }
    let Ok(response) = DesktopRunnerServiceClient::new(channel)
        .connect(request)
        .await
    else {
        ended.fetch_add(1, Ordering::SeqCst);
        return;
    };
    let mut inbound = response.into_inner();
    let mut interval = Duration::from_secs(3);
    let mut tick = tokio::time::interval(interval);
    loop {
        tokio::select! {
            m = inbound.message() => match m {
                Ok(Some(m)) => match m.message {
                    Some(rpb::connect_response::Message::Welcome(w)) => {
                        welcomed.fetch_add(1, Ordering::SeqCst);
                        if let Some(d) = w.heartbeat_interval.and_then(|d| Duration::try_from(d).ok()) {
                            interval = d;
                            tick = tokio::time::interval(interval);
                        }
                    }
                    Some(rpb::connect_response::Message::Assignment(a)) => {
                        let _ = assignments.send((a.run_id.clone(), Utc::now()));
                        let _ = tx.send(rpb::ConnectRequest { message: Some(rpb::connect_request::Message::AssignmentAccepted(rpb::AssignmentAccepted { run_id: a.run_id.clone() })) }).await;
                        let _ = tx.send(rpb::ConnectRequest { message: Some(rpb::connect_request::Message::RunFinished(rpb::RunFinished {
                            run_id: a.run_id, outcome: pb::RunState::Succeeded as i32, engine: "bench".into(), ..Default::default()
                        })) }).await;
                    }
                    _ => {}
                },
                _ => {
                    ended.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            },
            _ = tick.tick() => {
                let hb = rpb::ConnectRequest { message: Some(rpb::connect_request::Message::Heartbeat(rpb::Heartbeat { send_time: None })) };
                if tx.send(hb).await.is_err() {
                    ended.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--serve-gateway") {
        let url = args.get(i + 1).cloned().unwrap_or_default();
        return serve_gateway(&url).await;
    }
    let streams = arg("--streams", 10_000);
    let latency_runs = arg("--latency-runs", 100);
    let latency_users = 16;
    let mesh = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            desktop_via_runner_gateway: true,
            ..MeshOptions::default()
        },
    )
    .await?;
    let store = mesh.store().clone();
    println!(
        "automesh desktop benchmark (PostgreSQL, {} cores)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );

    // The gateway process.
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["--serve-gateway", &mesh.db.url])
        .stdout(std::process::Stdio::piped())
        .env("RUST_LOG", "error")
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
    let addr = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await??
        .and_then(|l| l.strip_prefix("listening ").map(str::to_owned))
        .ok_or_else(|| anyhow::anyhow!("the gateway process did not start"))?;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    automesh_e2e_tests::wait_for_health(&addr, Duration::from_secs(30), true).await?;

    // Baselines.
    let mut health =
        tonic_health::pb::health_client::HealthClient::new(automesh_rpc::client::channel(&addr)?);
    let mut rtt = vec![];
    for _ in 0..500 {
        let t = Instant::now();
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await?;
        rtt.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let rtt = median(rtt);
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_counter (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    sqlx::query("INSERT INTO bench_counter (id, n) VALUES (0, 0) ON CONFLICT (id) DO NOTHING")
        .execute(store.pool())
        .await?;
    let mut tx_ms = vec![];
    for _ in 0..500 {
        let t = Instant::now();
        sqlx::query("UPDATE bench_counter SET n = n + 1 WHERE id = 0")
            .execute(store.pool())
            .await?;
        tx_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let tx_ms = median(tx_ms);
    println!(
        "baseline  bare gRPC round trip (health) p50 {rtt:>7.3} ms   PostgreSQL single-row tx p50 {tx_ms:>7.3} ms"
    );

    // Runners and their tokens.
    let t = Instant::now();
    let mut tokens = Vec::with_capacity(streams);
    for i in 0..streams {
        tokens.push(mint(&store, &Principal::new("bench", format!("idle-{i}")), i).await?);
    }
    let mut latency_tokens = vec![];
    for u in 0..latency_users {
        latency_tokens.push(mint(&store, &Principal::new("bench", format!("lat-{u}")), u).await?);
    }
    println!(
        "setup     {streams} runner tokens minted in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // Idle streams.
    let rss_before = rss_kib(pid)?;
    let welcomed = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicUsize::new(0));
    let (assigned_tx, mut assigned_rx) = mpsc::unbounded_channel();
    let t = Instant::now();
    // One idle runner stream per token, counted as it is welcomed or ends.
    let connect = |token: String| {
        tokio::spawn(hold(
            addr.clone(),
            token,
            welcomed.clone(),
            ended.clone(),
            assigned_tx.clone(),
        ))
    };
    for (i, token) in tokens.into_iter().enumerate() {
        connect(token);
        if i % 200 == 199 {
            // Pace the connects a little: a real fleet does not arrive in one instant.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    while welcomed.load(Ordering::SeqCst) + ended.load(Ordering::SeqCst) < streams {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(300),
            "streams did not connect within 300 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "streams   {} of {streams} welcomed in {:.1} s",
        welcomed.load(Ordering::SeqCst),
        t.elapsed().as_secs_f64()
    );
    // Past the 10 s dead-stream bound: every stream must still be alive.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let rss_after = rss_kib(pid)?;
    let alive = welcomed.load(Ordering::SeqCst)
        - ended
            .load(Ordering::SeqCst)
            .min(welcomed.load(Ordering::SeqCst));
    println!(
        "streams   {alive} idle streams alive after 12 s in one gateway process (target 10,000+); RSS {:.1} MiB → {:.1} MiB = {:.1} KiB per stream",
        rss_before as f64 / 1024.0,
        rss_after as f64 / 1024.0,
        (rss_after.saturating_sub(rss_before)) as f64 / alive.max(1) as f64
    );

    // Latency: desktop occurrences due one at a time, 50 ms apart, for
    // runners on the gateway process, coordinated through the other replica.
    for token in latency_tokens {
        connect(token);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Utc::now() + chrono::Duration::seconds(3);
    let now = Utc::now();
    let mut due_of = std::collections::HashMap::new();
    for i in 0..latency_runs {
        let owner = Principal::new("bench", format!("lat-{}", i % latency_users));
        let at = start + chrono::Duration::milliseconds(50 * i as i64);
        let id = format!("dlat-{i:05}");
        store
            .create_automation(
                &NewAutomation {
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
    let mut latencies = vec![];
    let give_up = Instant::now() + Duration::from_secs(120);
    while latencies.len() < latency_runs && Instant::now() < give_up {
        let Ok(Some((run_id, at))) =
            tokio::time::timeout(Duration::from_secs(5), assigned_rx.recv()).await
        else {
            continue;
        };
        if let Some(due) = due_of.remove(&run_id) {
            latencies.push((at - due).num_microseconds().unwrap_or(0) as f64 / 1000.0);
        }
    }
    anyhow::ensure!(!latencies.is_empty(), "no assignment arrived");
    latencies.sort_by(|a, b| a.total_cmp(b));
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    println!(
        "latency   due instant → runner receives assignment   p50 {p50:>7.1} ms   p99 {p99:>7.1} ms   ({} runs, {:.0} × / {:.0} × the gRPC round trip)",
        latencies.len(),
        p50 / rtt,
        p99 / rtt
    );
    let _ = child.kill().await;
    mesh.stop().await?;
    Ok(())
}
