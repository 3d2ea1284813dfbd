//! Rolling restarts (issue 33): the mesh as separate processes, two
//! replicas of every service on PostgreSQL, 1,000 desktop runners connected
//! (the reference runner's library, in this process, each with its own
//! token, record and connection) and runs flowing, desktop and cloud. Every
//! replica of every service is told to stop (SIGTERM), exits by itself and
//! is started again, one by one, as a rolling deployment does. Then:
//!
//! - every run created ends succeeded, with one receipt: nothing lost;
//! - the model was called once per run: no prompt submitted twice;
//! - every runner is connected again;
//!
//! and the time the fleet spent reconnecting after each runner-gateway
//! replica stopped is printed. `AUTOMESH_ROLLING_RUNNERS` sets the fleet's
//! size (1,000 by default).

use std::sync::Arc;
use std::time::{Duration, Instant};

use automesh_domain::{Principal, RunState};
use automesh_e2e_tests::processes::{Cluster, ClusterSpec, Kind, run_now_retrying, tail};
use automesh_proto::v1 as pb;
use automesh_testkit::{Reply, provider, text_completion};
use chrono::Utc;
use tokio_util::sync::CancellationToken;

const MCP_TOKEN: &str = "rolling-connect-token-never-logged";
/// Owners whose desktop automations run during the restarts (each of them
/// has one of the runners); the others' runners are connected and idle.
const BUSY_OWNERS: usize = 50;
/// How long the model takes to answer: runs are in flight across restarts.
const MODEL_TAKES: Duration = Duration::from_millis(1500);

fn fleet_size() -> usize {
    std::env::var("AUTOMESH_ROLLING_RUNNERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000)
}

/// Runner streams the runner-gateway `replica` holds now.
async fn streams(cluster: &Cluster, replica: usize) -> usize {
    match cluster.scrape(Kind::RunnerGateway, replica).await {
        Ok(text) => automesh_e2e_tests::metric(&text, "automesh_runner_streams", &[]) as usize,
        Err(_) => 0,
    }
}

/// Waits (bounded) until runner-gateway `replica` holds `want` streams;
/// how long that took.
async fn until_streams(cluster: &Cluster, replica: usize, want: usize) -> Duration {
    let started = Instant::now();
    loop {
        if streams(cluster, replica).await >= want {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "runner-gateway {replica} holds {} of {want} streams after 2 min:\n{}",
            streams(cluster, replica).await,
            tail(&cluster.log(Kind::RunnerGateway, replica), 30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_replica_restarted_one_by_one_loses_no_run_and_runners_reconnect() {
    let runners = fleet_size().max(BUSY_OWNERS);
    let (provider_url, provider) =
        provider(|_, _| Reply::Delayed(MODEL_TAKES, text_completion("done"))).await;
    let (mcp_url, _mcp) = automesh_testkit::connect(MCP_TOKEN).await;
    let spec = ClusterSpec::new(2, &provider_url, &mcp_url, MCP_TOKEN)
        // Leases as long as production's: a handover that waited for one
        // to lapse would show in the runs' times, not in their outcomes.
        .set(Kind::Coordinator, "AUTOMESH_RUN_LEASE", "15s")
        .set(Kind::Lifecycle, "AUTOMESH_CLOUD_LEASE", "15s")
        .set(Kind::RunnerGateway, "AUTOMESH_MAX_CONNECTIONS", "5000");
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_automesh"));
    let mut cluster = Cluster::start(bin, spec).await.expect("cluster");
    let store = cluster.store().clone();

    // The fleet: one runner per owner, all in this process.
    let scratch = std::env::temp_dir().join(format!(
        "automesh-rolling-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let flags = automesh_engine::ProviderFlags {
        provider_url: provider_url.clone(),
        provider_key: "sk-rolling-provider-key".into(),
        stream: false,
        request_timeout: Duration::from_secs(30),
        max_steps: 4,
    };
    let engine: Arc<dyn automesh_engine::adapter::EngineAdapter> = Arc::new(
        automesh_engine::adapter::NativeEngine::from_flags(&flags, &mcp_url, MCP_TOKEN),
    );
    let gateways: Vec<String> = cluster
        .addrs(Kind::RunnerGateway)
        .split(',')
        .map(str::to_owned)
        .collect();
    let fleet_stop = CancellationToken::new();
    let mut fleet = tokio::task::JoinSet::new();
    let owner = |i: usize| Principal::new("acme", format!("user-{i}"));
    for i in 0..runners {
        let token = automesh_e2e_tests::bench::mint_runner(&store, &owner(i), i)
            .await
            .expect("runner token");
        let mut settings = automesh_runner::Settings::new(
            gateways.clone(),
            token.into(),
            scratch.join(format!("runner-{i}")),
        );
        settings.dead_after = Duration::from_secs(8);
        settings.reconnect_max = Duration::from_secs(2);
        let runner = automesh_runner::Runner::new(settings, engine.clone()).expect("runner");
        let stop = fleet_stop.clone();
        fleet.spawn(async move { runner.run(stop).await });
    }
    let give_up = Instant::now() + Duration::from_secs(120);
    while streams(&cluster, 0).await + streams(&cluster, 1).await < runners {
        assert!(Instant::now() < give_up, "the fleet did not connect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Desktop automations of the busy owners, and a cloud one.
    let mut automations = vec![];
    for i in 0..BUSY_OWNERS {
        let token = cluster.token("acme", &format!("user-{i}"));
        let request = automesh_e2e_tests::daily_automation(
            &format!("report {i}"),
            &format!("report {i}: summarise my inbox"),
            pb::Surface::Desktop,
        );
        let mut client = cluster.automations(&token);
        let a = automesh_e2e_tests::Api::create(&mut client, request).await;
        automations.push((client, a.id));
    }
    let cloud_owner = Principal::new("acme", "cloud-user");
    store
        .register_worker(&cloud_owner, "local-process", Utc::now())
        .await
        .expect("worker");
    let cloud_token = cluster.token("acme", "cloud-user");
    let request = automesh_e2e_tests::daily_automation(
        "cloud report",
        "summarise my inbox",
        pb::Surface::Web,
    );
    let mut cloud_client = cluster.automations(&cloud_token);
    let cloud = automesh_e2e_tests::Api::create(&mut cloud_client, request).await;

    // Runs flow for the whole restart sequence: a desktop run every 100 ms
    // round-robin over the busy owners, a cloud run every second.
    let created = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let flowing = CancellationToken::new();
    let workload = {
        let (created, flowing) = (created.clone(), flowing.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let mut asked = tokio::task::JoinSet::new();
            let mut n = 0usize;
            while !flowing.is_cancelled() {
                tick.tick().await;
                let (client, id, key) = if n % 10 == 9 {
                    (cloud_client.clone(), cloud.id.clone(), format!("cloud-{n}"))
                } else {
                    let (client, id) = &automations[n % automations.len()];
                    (client.clone(), id.clone(), format!("desktop-{n}"))
                };
                n += 1;
                let created = created.clone();
                asked.spawn(async move {
                    let run = run_now_retrying(client, &id, &key, Duration::from_secs(60)).await;
                    created.lock().expect("lock").push(run);
                });
            }
            while let Some(done) = asked.join_next().await {
                done.expect("run-now");
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;

    // Every replica of every service, one by one.
    let mut reconnects = vec![];
    for kind in Kind::ALL {
        for replica in 0..2 {
            let c = &mut cluster;
            if kind == Kind::RunnerGateway {
                // Told to stop, it sends its runners away (GOAWAY, their
                // streams ended UNAVAILABLE) and they reconnect to the
                // other replica: from the signal until the other holds
                // the whole fleet.
                let pid = c.pid(kind, replica).expect("running");
                let told = Instant::now();
                automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::TERM);
                until_streams(c, 1 - replica, runners).await;
                let took = told.elapsed();
                reconnects.push(took);
                println!(
                    "runner-gateway {replica} told to stop: all {runners} runners on the other replica {:.2} s later",
                    took.as_secs_f64()
                );
            }
            let clean = c.terminate(kind, replica, Duration::from_secs(60)).await;
            assert!(
                clean,
                "{kind:?} {replica} did not exit by itself within 60 s:\n{}",
                tail(&c.log(kind, replica), 30)
            );
            c.restart(kind, replica).await.expect("restart");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    flowing.cancel();
    workload.await.expect("workload");

    // Every run ends succeeded, with one receipt; the model was asked once
    // per run.
    let created = created.lock().expect("lock").clone();
    assert!(created.len() > 100, "runs flowed: {}", created.len());
    let give_up = Instant::now() + Duration::from_secs(180);
    let mut failed = vec![];
    for id in &created {
        let run = loop {
            let run = store.internal().get_run(id).await.expect("run");
            if run.state.is_terminal() {
                break run;
            }
            assert!(Instant::now() < give_up, "run {id} did not end: {run:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        if run.state != RunState::Succeeded {
            failed.push(format!("{id}: {:?} {:?}", run.state, run.error_code));
        }
        let receipts: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM receipts WHERE run_id = $1")
            .bind(id)
            .fetch_one(store.pool())
            .await
            .expect("receipts");
        assert_eq!(receipts, 1, "{id}");
    }
    assert!(
        failed.is_empty(),
        "{} of {} runs did not succeed:\n{}",
        failed.len(),
        created.len(),
        failed.join("\n")
    );
    assert_eq!(
        provider.calls(),
        created.len(),
        "one model call per run: no prompt submitted twice, none lost"
    );
    let held = streams(&cluster, 0).await + streams(&cluster, 1).await;
    assert_eq!(held, runners, "every runner connected again");
    println!(
        "{} runs across the rolling restart of {} replicas, all succeeded once; \
         the fleet on the other replica after a runner-gateway was told to stop: {}",
        created.len(),
        Kind::ALL.len() * 2,
        reconnects
            .iter()
            .map(|d| format!("{:.2} s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    fleet_stop.cancel();
    while fleet.join_next().await.is_some() {}
    cluster.stop(false).await.expect("stop");
    let _ = std::fs::remove_dir_all(&scratch);
}
