//! Chaos: the mesh as separate processes (two replicas of every service,
//! desktop runners, local-process worker agents) on PostgreSQL, driven by a
//! steady stream of desktop and cloud runs while seeded random faults hit
//! it: SIGKILL of every service kind, of runners and of agents (each
//! restarted after a pause), SIGSTOP stalls, and cut database connections.
//! Then every fault is healed and the test checks what the mesh promises:
//!
//! - every run has one terminal state, one receipt and one terminal event;
//! - no prompt was submitted to the model twice;
//! - no run was live past its deadline plus grace;
//! - new runs succeed after the faults;
//! - no worker agent is left running after idle stop.
//!
//! `scripts/test` runs the short form. The long form is a command:
//!
//! ```sh
//! AUTOMESH_CHAOS_RUNS=400 AUTOMESH_CHAOS_SEED=7 \
//!   cargo test -p automesh --test chaos -- --nocapture
//! ```
//!
//! `AUTOMESH_CHAOS_SEED` picks the workload and the faults (the same seed,
//! the same sequence of faults at the same pace; the workload and the
//! faults run side by side, so a fault may take every replica of a service
//! down for a moment); the seed is printed, so a failing run can be
//! replayed.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use automesh_domain::{Principal, RunEventPayload, RunState};
use automesh_e2e_tests::processes::{Cluster, ClusterChannel, ClusterSpec, Kind};
use automesh_proto::v1 as pb;
use automesh_proto::v1::automations_client::AutomationsClient;
use automesh_testkit::{Reply, provider, text_completion};
use chrono::Utc;
use tokio_util::sync::CancellationToken;

const MCP_TOKEN: &str = "chaos-connect-token-never-logged";
/// Each run's deadline.
const DEADLINE_SECS: i64 = 45;
/// How long past its deadline a run may stay live before the check fails:
/// the cancellation bound, two leases and a takeover, with room to spare.
const GRACE_SECS: i64 = 30;

/// A small seeded generator (xorshift64*): the same seed, the same faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from))
    }
}

fn env_or(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A fault and when it heals.
#[derive(Debug)]
enum Fault {
    Killed(Kind, usize),
    Paused(Kind, usize),
    RunnerKilled(usize),
    RunnerPaused(usize),
}

/// The owners: two with desktop runners, two with cloud workers.
fn desktop_owners() -> [Principal; 2] {
    [
        Principal::new("acme", "dana"),
        Principal::new("beta", "erin"),
    ]
}

fn cloud_owners() -> [Principal; 2] {
    [
        Principal::new("acme", "carol"),
        Principal::new("beta", "frank"),
    ]
}

/// Retries a public-API call through faults (every gateway replica may be
/// down for a moment); bounded.
async fn through_faults<T, F, Fut>(what: &str, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match tokio::time::timeout(Duration::from_secs(10), call()).await {
            Ok(Ok(v)) => return v,
            Ok(Err(s)) => {
                assert!(
                    matches!(
                        s.code(),
                        tonic::Code::Unavailable
                            | tonic::Code::DeadlineExceeded
                            | tonic::Code::Unknown
                            | tonic::Code::Cancelled
                            | tonic::Code::Internal
                            | tonic::Code::Aborted
                    ),
                    "{what}: {s:?}"
                );
            }
            Err(_) => {}
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "{what} never went through"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Creates an automation of `owner` on `surface` and runs it now; returns
/// the run id. Each automation has its own prompt, so each run's prompt is
/// unique and a second submission of it shows at the model.
async fn start_run(
    client: AutomationsClient<ClusterChannel>,
    surface: pb::Surface,
    n: usize,
) -> String {
    let prompt = format!("chaos run {n}: summarise what changed");
    // One client for every retry: it moves past a gateway replica that
    // failed and stays on the one that answers.
    let automation = through_faults("create", || {
        let mut api = client.clone();
        let prompt = prompt.clone();
        async move {
            let name = format!("chaos {n}");
            let request = automesh_e2e_tests::daily_automation(&name, &prompt, surface);
            api.create_automation(request).await
        }
    })
    .await
    .into_inner()
    .automation
    .expect("automation");
    through_faults("run now", || {
        let mut api = client.clone();
        let id = automation.id.clone();
        async move {
            api.run_automation_now(pb::RunAutomationNowRequest {
                id,
                idempotency_key: "chaos".into(),
            })
            .await
        }
    })
    .await
    .into_inner()
    .run
    .expect("run")
    .id
}

/// Reads through cut connections: the test's own pool is cut too.
async fn read<T, F, Fut>(mut query: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, automesh_store::StoreError>>,
{
    for _ in 0..50 {
        if let Ok(v) = query().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the database did not answer");
}

/// A public-API client of `owner`'s.
async fn client_of(
    cluster: &tokio::sync::Mutex<Cluster>,
    owner: &Principal,
) -> AutomationsClient<ClusterChannel> {
    let c = cluster.lock().await;
    c.automations(&c.token(&owner.org_id, &owner.user_id))
}

fn heal(cluster: &mut Cluster, fault: Fault) {
    match fault {
        Fault::Killed(kind, i) => cluster.respawn(kind, i).expect("restart"),
        Fault::Paused(kind, i) => cluster.resume(kind, i),
        Fault::RunnerKilled(i) => cluster.restart_runner(i).expect("restart runner"),
        Fault::RunnerPaused(i) => {
            if let Some(pid) = cluster.runner_pid(i) {
                automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::CONT);
            }
        }
    }
}

/// Lands a fault every second or two and heals each after a pause, until
/// `stop`; then heals what is left and returns what it did.
async fn inject(
    cluster: Arc<tokio::sync::Mutex<Cluster>>,
    mut rng: Rng,
    stop: CancellationToken,
) -> BTreeMap<String, usize> {
    let mut healing: Vec<(tokio::time::Instant, Fault)> = vec![];
    let mut next_fault = tokio::time::Instant::now() + Duration::from_secs(2);
    let mut faults: BTreeMap<String, usize> = BTreeMap::new();
    while !stop.is_cancelled() {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
            () = stop.cancelled() => break,
        }
        let mut cluster = cluster.lock().await;
        let now = tokio::time::Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = healing.drain(..).partition(|(at, _)| *at <= now);
        healing = later;
        for (_, fault) in due {
            heal(&mut cluster, fault);
        }
        if now < next_fault {
            continue;
        }
        next_fault = now + rng.millis(800, 2200);
        let pause = rng.millis(500, 5000);
        let faulted = |k: Kind, i: usize, h: &[(tokio::time::Instant, Fault)]| {
            h.iter().any(|(_, f)| {
                matches!(f, Fault::Killed(a, b) | Fault::Paused(a, b) if *a == k && *b == i)
            })
        };
        let kinds = Kind::ALL;
        let kind = kinds[rng.below(kinds.len() as u64) as usize];
        let replica = rng.below(cluster.replicas(kind) as u64) as usize;
        let runner = rng.below(cluster.runner_count() as u64) as usize;
        let runner_faulted = healing.iter().any(
            |(_, f)| matches!(f, Fault::RunnerKilled(r) | Fault::RunnerPaused(r) if *r == runner),
        );
        let what = match rng.below(10) {
            0..=3 if !faulted(kind, replica, &healing) => {
                cluster.kill(kind, replica);
                healing.push((now + pause, Fault::Killed(kind, replica)));
                format!("kill {kind:?}")
            }
            4..=5 if !faulted(kind, replica, &healing) => {
                cluster.pause(kind, replica);
                healing.push((now + pause, Fault::Paused(kind, replica)));
                format!("stall {kind:?}")
            }
            6 if !runner_faulted => {
                cluster.kill_runner(runner);
                healing.push((now + pause, Fault::RunnerKilled(runner)));
                "kill runner".into()
            }
            7 if !runner_faulted => {
                if let Some(pid) = cluster.runner_pid(runner) {
                    automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::STOP);
                }
                healing.push((now + pause, Fault::RunnerPaused(runner)));
                "stall runner".into()
            }
            8 => match cluster.live_agents().values().next() {
                Some(pid) => {
                    automesh_rpc::process::signal(*pid, automesh_rpc::process::Signal::KILL);
                    "kill agent".into()
                }
                None => "no agent to kill".into(),
            },
            _ => match cluster.cut_database_connections().await {
                Ok(cut) => {
                    *faults.entry("database connections cut".into()).or_default() +=
                        usize::try_from(cut).unwrap_or_default();
                    "cut database connections".into()
                }
                Err(error) => format!("cutting database connections failed: {error}"),
            },
        };
        *faults.entry(what).or_default() += 1;
    }
    let mut cluster = cluster.lock().await;
    for (_, fault) in healing.drain(..) {
        heal(&mut cluster, fault);
    }
    faults
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_keeps_its_promises_under_seeded_faults() {
    let seed = env_or("AUTOMESH_CHAOS_SEED", 20261201);
    let runs = env_or("AUTOMESH_CHAOS_RUNS", 70) as usize;
    eprintln!("chaos: seed {seed}, {runs} runs (AUTOMESH_CHAOS_SEED / AUTOMESH_CHAOS_RUNS)");
    let mut rng = Rng(seed | 1);

    // The model answers each run once, after a pause that keeps runs in
    // flight while faults land.
    let (provider_url, model) = provider(|n, _| {
        Reply::Delayed(
            Duration::from_millis(200 + (n as u64 * 7919) % 1800),
            text_completion("all summarised"),
        )
    })
    .await;
    let (mcp_url, _mcp) = automesh_testkit::connect(MCP_TOKEN).await;
    let spec = ClusterSpec::new(2, &provider_url, &mcp_url, MCP_TOKEN)
        .set(
            Kind::Scheduler,
            "AUTOMESH_RUN_DEADLINE",
            &format!("{DEADLINE_SECS}s"),
        )
        .set(Kind::Lifecycle, "AUTOMESH_WORKER_IDLE_AFTER", "5s");
    let mut cluster = Cluster::start(std::path::Path::new(env!("CARGO_BIN_EXE_automesh")), spec)
        .await
        .expect("cluster");
    for o in cloud_owners() {
        cluster
            .store()
            .register_worker(&o, "local-process", Utc::now())
            .await
            .expect("worker");
    }
    // Two runners for dana, one for erin.
    for o in [
        &desktop_owners()[0],
        &desktop_owners()[0],
        &desktop_owners()[1],
    ] {
        cluster
            .add_runner(&o.org_id, &o.user_id)
            .await
            .expect("runner");
    }

    // The workload, while the injector lands a fault every second or two.
    let cluster = Arc::new(tokio::sync::Mutex::new(cluster));
    let stop = CancellationToken::new();
    let injector = tokio::spawn(inject(cluster.clone(), Rng(rng.next() | 1), stop.clone()));
    let mut run_ids = vec![];
    for n in 0..runs {
        let desktop = rng.below(2) == 0;
        let owner = if desktop {
            desktop_owners()[rng.below(2) as usize].clone()
        } else {
            cloud_owners()[rng.below(2) as usize].clone()
        };
        let surface = if desktop {
            pb::Surface::Desktop
        } else {
            pb::Surface::Web
        };
        let client = client_of(&cluster, &owner).await;
        run_ids.push(start_run(client, surface, n).await);
        tokio::time::sleep(rng.millis(150, 450)).await;
    }
    stop.cancel();
    let faults = injector.await.expect("injector");
    let cluster = Arc::into_inner(cluster)
        .expect("the injector is done")
        .into_inner();
    cluster
        .wait_all_serving(Duration::from_secs(60))
        .await
        .expect("every replica serves again");
    eprintln!("chaos: faults {faults:?}");

    // Every run ends, bounded by its deadline plus grace.
    let give_up =
        tokio::time::Instant::now() + Duration::from_secs((DEADLINE_SECS + GRACE_SECS + 30) as u64);
    let store = cluster.store().clone();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for id in &run_ids {
        let run = loop {
            let run = read(|| store.internal().get_run(id)).await;
            if run.state.is_terminal() {
                break run;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "run {id} is still live well past its deadline: {run:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let label = format!(
            "{}{}",
            run.state,
            run.error_code.map(|c| format!(" {c}")).unwrap_or_default()
        );
        *outcomes.entry(label).or_default() += 1;
        // One receipt, agreeing with the run, written in time.
        let receipt = read(|| store.internal().receipt(id))
            .await
            .unwrap_or_else(|| panic!("run {id} has no receipt: {run:?}"));
        assert_eq!(receipt.outcome, run.state, "{run:?} {receipt:?}");
        assert!(
            receipt.created_at <= run.deadline_at + chrono::Duration::seconds(GRACE_SECS),
            "run {id} was live past its deadline plus grace: {run:?} {receipt:?}"
        );
        // One terminal event, the last one, naming the terminal state.
        let events = read(|| store.internal().events(id, 0, 10_000)).await;
        let ends: Vec<_> = events
            .iter()
            .filter(|e| {
                matches!(&e.payload, RunEventPayload::StatusChange { state, .. }
                    if state.parse::<RunState>().is_ok_and(|s| s.is_terminal()))
            })
            .collect();
        assert_eq!(ends.len(), 1, "run {id}: terminal events {ends:?}");
        assert!(
            matches!(&ends[0].payload, RunEventPayload::StatusChange { state, .. } if state == run.state.as_str()),
            "run {id}: {ends:?} vs {run:?}"
        );
    }
    eprintln!("chaos: outcomes {outcomes:?}");

    // No prompt reached the model twice.
    let mut submitted: HashMap<String, usize> = HashMap::new();
    for body in model.bodies.lock().iter() {
        let prompt = body["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["role"] == "user")
            .filter_map(|m| m["content"].as_str())
            .find(|c| c.contains("chaos run"))
            .unwrap_or_default()
            .to_owned();
        *submitted.entry(prompt).or_default() += 1;
    }
    let mut twice = vec![];
    for (prompt, n) in submitted.iter().filter(|(_, n)| **n > 1) {
        // Which run, where it ran and how it ended: what a replay needs.
        let run = prompt
            .strip_prefix("chaos run ")
            .and_then(|rest| rest.split(':').next())
            .and_then(|i| i.parse::<usize>().ok())
            .and_then(|i| run_ids.get(i));
        let detail = match run {
            Some(id) => {
                let r = read(|| store.internal().get_run(id)).await;
                format!("{id} {:?} {} {:?}", r.placement, r.state, r.error_code)
            }
            None => "no run".into(),
        };
        twice.push(format!("{prompt:?} ×{n} ({detail})"));
    }
    assert!(twice.is_empty(), "prompts submitted twice: {twice:#?}");

    // After the faults, new runs succeed on both placements.
    for (i, (owner, surface)) in [
        (desktop_owners()[0].clone(), pb::Surface::Desktop),
        (desktop_owners()[1].clone(), pb::Surface::Desktop),
        (cloud_owners()[0].clone(), pb::Surface::Web),
        (cloud_owners()[1].clone(), pb::Surface::Web),
    ]
    .into_iter()
    .enumerate()
    {
        let client = cluster.automations(&cluster.token(&owner.org_id, &owner.user_id));
        let id = start_run(client, surface, runs + i).await;
        let give_up = tokio::time::Instant::now() + Duration::from_secs(90);
        let run = loop {
            let run = read(|| store.internal().get_run(&id)).await;
            if run.state.is_terminal() {
                break run;
            }
            assert!(tokio::time::Instant::now() < give_up, "{run:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            (run.state, run.error_code),
            (RunState::Succeeded, None),
            "a run after the faults: {run:?}"
        );
    }

    // Idle stop leaves no agent running.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let live = cluster.live_agents();
        let states: Vec<String> = read(|| async {
            sqlx::query_scalar("SELECT state FROM cloud_workers")
                .fetch_all(store.pool())
                .await
                .map_err(automesh_store::StoreError::from)
        })
        .await;
        if live.is_empty() && states.iter().all(|s| s == "stopped" || s == "failed") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "after idle stop: agents {live:?}, workers {states:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    cluster.stop(false).await.expect("stop");
}
