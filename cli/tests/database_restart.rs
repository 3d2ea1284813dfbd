//! PostgreSQL restarted under load (issue 33): the mesh as separate
//! processes, two replicas of every service, a desktop runner and cloud
//! workers, runs flowing; the real PostgreSQL server is stopped for 10 s
//! and started again. Then:
//!
//! - every run asked for ends succeeded, with one receipt, and the model
//!   was asked once per run: nothing lost, nothing doubled;
//! - every replica of every service serves again by itself, and the LISTEN
//!   connections were made again (counted);
//! - the next run is dispatched at signal speed: both safety polls are 60 s,
//!   so a run that ends within 30 s was woken by notifications.
//!
//! The server is this machine's (`pg_ctlcluster`, as `.ci/run` starts it),
//! or what `AUTOMESH_TEST_POSTGRES_CTL` names (a command taking `stop` or
//! `start`). It is started again however the test ends.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use automesh_domain::{Principal, RunState};
use automesh_e2e_tests::Api;
use automesh_e2e_tests::processes::{Cluster, ClusterSpec, Kind, run_now_retrying, tail};
use automesh_proto::v1 as pb;
use automesh_testkit::{Reply, provider, text_completion};
use chrono::Utc;
use tokio_util::sync::CancellationToken;

const MCP_TOKEN: &str = "restart-connect-token-never-logged";
const DOWN_FOR: Duration = Duration::from_secs(10);

/// The command that stops or starts the test PostgreSQL server.
fn pg_ctl(action: &str) {
    let (program, mut args) = match std::env::var("AUTOMESH_TEST_POSTGRES_CTL") {
        Ok(command) => {
            let mut words = command.split_whitespace().map(str::to_owned);
            let program = words.next().expect("AUTOMESH_TEST_POSTGRES_CTL is empty");
            (program, words.collect::<Vec<_>>())
        }
        Err(_) => {
            let version = std::fs::read_dir("/etc/postgresql")
                .expect("no /etc/postgresql: set AUTOMESH_TEST_POSTGRES_CTL")
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .max()
                .expect("no PostgreSQL cluster in /etc/postgresql");
            (
                "pg_ctlcluster".to_owned(),
                vec!["--skip-systemctl-redirect".into(), version, "main".into()],
            )
        }
    };
    args.push(action.to_owned());
    if action == "stop" {
        args.extend(["-m".to_owned(), "fast".to_owned()]);
    }
    let out = Command::new(&program)
        .args(&args)
        .output()
        .unwrap_or_else(|e| panic!("{program} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The server stopped; started again when dropped, whatever happened.
struct Stopped(bool);

impl Stopped {
    fn now() -> Stopped {
        pg_ctl("stop");
        Stopped(true)
    }

    fn start(mut self) {
        pg_ctl("start");
        self.0 = false;
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if self.0 {
            pg_ctl("start");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_under_load_loses_nothing_and_every_service_recovers() {
    let (provider_url, provider) =
        provider(|_, _| Reply::Delayed(Duration::from_millis(1500), text_completion("done"))).await;
    let (mcp_url, _mcp) = automesh_testkit::connect(MCP_TOKEN).await;
    let spec = ClusterSpec::new(2, &provider_url, &mcp_url, MCP_TOKEN)
        .set(Kind::Coordinator, "AUTOMESH_CLAIM_POLL", "60s")
        .set(Kind::RunnerGateway, "AUTOMESH_RUNNER_DISPATCH_POLL", "60s");
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_automesh"));
    let mut cluster = Cluster::start(bin, spec).await.expect("cluster");
    let desk = Principal::new("acme", "dana");
    let cloud = Principal::new("acme", "carol");
    cluster
        .store()
        .register_worker(&cloud, "local-process", Utc::now())
        .await
        .expect("worker");
    cluster
        .add_runner(&desk.org_id, &desk.user_id)
        .await
        .expect("runner");
    let mut desk_client = cluster.automations(&cluster.token("acme", "dana"));
    let mut cloud_client = cluster.automations(&cluster.token("acme", "carol"));
    let request = automesh_e2e_tests::daily_automation("desk", "tidy up", pb::Surface::Desktop);
    let desk_id = desk_client.create(request).await.id;
    let request = automesh_e2e_tests::daily_automation("inbox", "summarise", pb::Surface::Web);
    let cloud_id = cloud_client.create(request).await.id;
    // Both paths warm: a desktop and a cloud run end before the restart.
    for (client, id) in [(&desk_client, &desk_id), (&cloud_client, &cloud_id)] {
        let run = run_now_retrying(client.clone(), id, "warm", Duration::from_secs(120)).await;
        until_ended(&cluster, &run, RunState::Succeeded).await;
    }

    // Runs flow: one every 300 ms, alternating desktop and cloud.
    let created = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let flowing = CancellationToken::new();
    let workload = {
        let (created, flowing) = (created.clone(), flowing.clone());
        let (desk_client, cloud_client) = (desk_client.clone(), cloud_client.clone());
        let (desk_id, cloud_id) = (desk_id.clone(), cloud_id.clone());
        tokio::spawn(async move {
            let mut asked = tokio::task::JoinSet::new();
            let mut n = 0usize;
            while !flowing.is_cancelled() {
                let (client, id) = if n.is_multiple_of(2) {
                    (desk_client.clone(), desk_id.clone())
                } else {
                    (cloud_client.clone(), cloud_id.clone())
                };
                let (created, key) = (created.clone(), format!("flow-{n}"));
                asked.spawn(async move {
                    let run = run_now_retrying(client, &id, &key, Duration::from_secs(120)).await;
                    created.lock().expect("lock").push(run);
                });
                n += 1;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            while let Some(done) = asked.join_next().await {
                done.expect("run-now");
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reconnects = "automesh_db_listen_reconnects_total";
    let listens = async |c: &Cluster| {
        let mut sum = 0.0;
        for kind in [Kind::Coordinator, Kind::RunnerGateway] {
            for replica in 0..2 {
                let text = c.scrape(kind, replica).await.expect("scrape");
                sum += automesh_e2e_tests::metric(&text, reconnects, &[]);
            }
        }
        sum
    };
    let before = listens(&cluster).await;

    // PostgreSQL away for 10 s, with runs in flight.
    let stopped = Stopped::now();
    tokio::time::sleep(DOWN_FOR).await;
    stopped.start();
    let back = Instant::now();
    // Every service serves again by itself.
    cluster
        .wait_all_serving(Duration::from_secs(60))
        .await
        .expect("every replica serves again");
    println!(
        "PostgreSQL away {} s: every replica serving again {:.1} s after it was back",
        DOWN_FOR.as_secs(),
        back.elapsed().as_secs_f64()
    );
    // A few more runs after it is back, then the flow stops.
    tokio::time::sleep(Duration::from_secs(5)).await;
    flowing.cancel();
    workload.await.expect("workload");

    let give_up = Instant::now() + Duration::from_secs(60);
    while listens(&cluster).await <= before {
        assert!(Instant::now() < give_up, "no LISTEN reconnection counted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Every run ends succeeded with one receipt; one model call each.
    let created = created.lock().expect("lock").clone();
    assert!(created.len() >= 20, "runs flowed: {}", created.len());
    for id in &created {
        until_ended(&cluster, id, RunState::Succeeded).await;
        let receipts: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM receipts WHERE run_id = $1")
            .bind(id)
            .fetch_one(cluster.store().pool())
            .await
            .expect("receipts");
        assert_eq!(receipts, 1, "{id}");
    }
    assert_eq!(
        provider.calls(),
        created.len() + 2,
        "one model call per run (and the two warm ones)"
    );
    // The next run is dispatched at signal speed (both polls are 60 s).
    for (client, id) in [(&desk_client, &desk_id), (&cloud_client, &cloud_id)] {
        let started = Instant::now();
        let run = run_now_retrying(client.clone(), id, "after", Duration::from_secs(120)).await;
        let give_up = started + Duration::from_secs(30);
        loop {
            let got = cluster.store().internal().get_run(&run).await;
            if let Ok(r) = &got
                && r.state.is_terminal()
            {
                assert_eq!(r.state, RunState::Succeeded, "{r:?}");
                println!(
                    "a run asked for after the restart ended in {:.2} s (polls are 60 s)",
                    started.elapsed().as_secs_f64()
                );
                break;
            }
            assert!(
                Instant::now() < give_up,
                "dispatched at poll speed after the restart (polls are 60 s):\n{}",
                tail(&cluster.log(Kind::Coordinator, 0), 30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "{} runs across the restart, each succeeded once",
        created.len()
    );
    cluster.stop(false).await.expect("stop");
}

/// Waits (bounded) for run `id` to end, and checks how.
async fn until_ended(cluster: &Cluster, id: &str, want: RunState) {
    let give_up = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(run) = cluster.store().internal().get_run(id).await
            && run.state.is_terminal()
        {
            assert_eq!(run.state, want, "{run:?}");
            return;
        }
        assert!(
            Instant::now() < give_up,
            "run {id} did not end; coordinator logs:\n{}\n{}",
            tail(&cluster.log(Kind::Coordinator, 0), 30),
            tail(&cluster.log(Kind::Coordinator, 1), 30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
