//! What telemetry costs: runs per second and CPU per run through the whole
//! mesh as separate processes, with telemetry off and on.
//!
//!   cargo build --release -p automesh
//!   cargo run --release -p automesh-e2e-tests --bin bench-telemetry [-- --runs 200 --repeats 3]
//!
//! One replica of every service and one desktop runner (`automesh runner`,
//! the native engine against a fake provider that answers at once), on
//! PostgreSQL. Each repeat drives `--runs` desktop runs (run-now through the
//! gateway) to their end, in each of two modes:
//! - **off**: no OTLP export, text logs (`RUST_LOG=info`);
//! - **on**: traces, metrics and logs exported over OTLP to a collector in
//!   this process, JSON logs.
//!
//! It prints runs/s (first request to last end) and the CPU seconds every
//! process of the mesh used per run (user + system, from /proc), medians over
//! `--repeats`, and the on/off ratios. The binary is `target/release/automesh`
//! unless `AUTOMESH_BIN` names another. The machine is shared: read ratios.
//! `--quick` is the short form CI runs once (10 runs, one repeat, the debug
//! binary `target/debug/automesh`; figures printed, not checked).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use automesh_domain::RunState;
use automesh_e2e_tests::bench::{Flag, QUICK, check_args, median, quick, sized};
use automesh_e2e_tests::otlp::Receiver;
use automesh_e2e_tests::processes::{Cluster, ClusterSpec, Kind};
use automesh_proto::v1 as pb;
use automesh_testkit::{Reply, provider, text_completion};

/// CPU seconds (user + system) `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    // Fields after the command: state is 3rd overall; utime 14th, stime 15th.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Linux reports clock ticks of 1/100 s (USER_HZ).
    (ticks(11) + ticks(12)) / 100.0
}

fn mesh_cpu(cluster: &Cluster) -> f64 {
    let mut total = 0.0;
    for kind in Kind::ALL {
        for i in 0..cluster.replicas(kind) {
            if let Some(pid) = cluster.pid(kind, i) {
                total += cpu_seconds(pid);
            }
        }
    }
    for i in 0..cluster.runner_count() {
        if let Some(pid) = cluster.runner_pid(i) {
            total += cpu_seconds(pid);
        }
    }
    total
}

/// One measurement: (runs per second, CPU seconds per run).
async fn measure(bin: &Path, runs: usize, on: bool) -> anyhow::Result<(f64, f64)> {
    let receiver = Receiver::start().await?;
    let (provider_url, _p) = provider(|_, _| Reply::Json(text_completion("done"))).await;
    let (mcp_url, _mcp) = automesh_testkit::connect("bench-token").await;
    let mut spec = ClusterSpec::new(1, &provider_url, &mcp_url, "bench-token");
    if on {
        spec = spec
            .set_all("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint)
            .set_all("AUTOMESH_LOG_FORMAT", "json");
    }
    let mut cluster = Cluster::start(bin, spec).await?;
    cluster.add_runner("acme", "dana").await?;
    let token = cluster.token("acme", "dana");
    let api = cluster.automations(&token);
    let mut ids = vec![];
    for n in 0..runs {
        let mut api = api.clone();
        let a = api
            .create_automation(automesh_e2e_tests::daily_automation(
                &format!("bench {n}"),
                "summarise",
                pb::Surface::Desktop,
            ))
            .await?
            .into_inner()
            .automation
            .ok_or_else(|| anyhow::anyhow!("no automation"))?;
        ids.push(a.id);
    }
    // Warm: the runner is connected once a first run succeeds.
    let cpu_before = mesh_cpu(&cluster);
    let started = Instant::now();
    let mut run_ids = vec![];
    for id in &ids {
        let mut api = api.clone();
        run_ids.push(
            api.run_automation_now(pb::RunAutomationNowRequest {
                id: id.clone(),
                idempotency_key: "bench".into(),
            })
            .await?
            .into_inner()
            .run
            .ok_or_else(|| anyhow::anyhow!("no run"))?
            .id,
        );
    }
    let give_up = Instant::now() + Duration::from_secs(600);
    for run_id in &run_ids {
        loop {
            let run = cluster.store().internal().get_run(run_id).await?;
            if run.state.is_terminal() {
                anyhow::ensure!(run.state == RunState::Succeeded, "{run:?}");
                break;
            }
            anyhow::ensure!(Instant::now() < give_up, "runs did not end");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let took = started.elapsed().as_secs_f64();
    let cpu = mesh_cpu(&cluster) - cpu_before;
    cluster.stop(false).await?;
    Ok((runs as f64 / took, cpu / runs as f64))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    check_args(
        "bench-telemetry",
        "What telemetry costs: runs/s and CPU per run through the whole mesh as separate processes \
         (target/release/automesh, or AUTOMESH_BIN), with OTLP export off and on.",
        &[
            Flag::count("--runs", "desktop runs per mode and repeat (default 200)"),
            Flag::count("--repeats", "repeats; medians are printed (default 3)"),
            QUICK,
        ],
    );
    let runs = sized("--runs", 200, 10);
    let repeats = sized("--repeats", 3, 1).max(1);
    // The short form runs the debug build the tests built.
    let profile = if quick() { "debug" } else { "release" };
    let bin = std::env::var("AUTOMESH_BIN").map_or_else(
        |_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../target/{profile}/automesh")),
        PathBuf::from,
    );
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: build it first (cargo build --release -p automesh) or set AUTOMESH_BIN",
        bin.display()
    );
    println!(
        "bench-telemetry: {runs} desktop runs per measurement, {repeats} repeats, {}",
        bin.display()
    );
    let mut off = (vec![], vec![]);
    let mut on = (vec![], vec![]);
    for r in 0..repeats {
        for (mode, acc) in [(false, &mut off), (true, &mut on)] {
            let (rate, cpu) = measure(&bin, runs, mode).await?;
            println!(
                "  repeat {r} telemetry {:<3}  {rate:>7.1} runs/s  {:>7.2} ms CPU per run",
                if mode { "on" } else { "off" },
                cpu * 1000.0
            );
            acc.0.push(rate);
            acc.1.push(cpu);
        }
    }
    let (rate_off, cpu_off) = (median(off.0), median(off.1));
    let (rate_on, cpu_on) = (median(on.0), median(on.1));
    println!(
        "median   telemetry off  {rate_off:>7.1} runs/s  {:>7.2} ms CPU per run",
        cpu_off * 1000.0
    );
    println!(
        "median   telemetry on   {rate_on:>7.1} runs/s  {:>7.2} ms CPU per run",
        cpu_on * 1000.0
    );
    println!(
        "ratio    on / off       {:>7.2} × runs/s  {:>7.2} × CPU per run",
        rate_on / rate_off,
        cpu_on / cpu_off
    );
    Ok(())
}
