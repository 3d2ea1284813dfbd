//! Crash recovery with real processes: the mesh runs as separate `automesh`
//! processes, two replicas of each service, on PostgreSQL, and the tests
//! kill them (and the worker agents they start) with SIGKILL at the points
//! the outside testing found: a worker agent that crashed, idle stop from
//! the replica that did not start the worker, a lifecycle replica lost
//! mid-wake or with every replica gone, and a coordinator lost right after
//! it committed a run's end.
//!
//! The model provider and the Connect endpoint are fakes speaking the real
//! protocols (the outside world); everything of automesh is real.

use std::time::Duration;

use automesh_domain::{AutomationState, ErrorCode, Principal, RunEventPayload, RunState};
use automesh_e2e_tests::Api;
use automesh_e2e_tests::processes::{Cluster, ClusterSpec, Kind, tail};
use automesh_proto::v1 as pb;
use automesh_testkit::{FakeProvider, Reply, provider, text_completion};
use chrono::Utc;
use tokio_util::sync::CancellationToken;

const MCP_TOKEN: &str = "crash-connect-token-never-logged";

/// One cluster at a time: each is ten processes with their own pools.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct World {
    cluster: Cluster,
    provider: FakeProvider,
    token: String,
    _mcp: CancellationToken,
}

fn owner() -> Principal {
    Principal::new("acme", "carol")
}

async fn world(
    script: impl Fn(usize, &serde_json::Value) -> Reply + Send + Sync + 'static,
    tune: impl FnOnce(ClusterSpec, &std::path::Path) -> ClusterSpec,
) -> World {
    let (provider_url, provider) = provider(script).await;
    let (mcp_url, mcp_stop) = automesh_testkit::connect(MCP_TOKEN).await;
    let scratch =
        std::env::temp_dir().join(format!("automesh-crash-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&scratch).expect("scratch");
    let spec = tune(
        ClusterSpec::new(2, &provider_url, &mcp_url, MCP_TOKEN),
        &scratch,
    );
    let cluster = Cluster::start(std::path::Path::new(env!("CARGO_BIN_EXE_automesh")), spec)
        .await
        .expect("cluster");
    cluster
        .store()
        .register_worker(&owner(), "local-process", Utc::now())
        .await
        .expect("worker");
    let token = cluster.token("acme", "carol");
    World {
        cluster,
        provider,
        token,
        _mcp: mcp_stop,
    }
}

impl World {
    /// A daily cloud automation of carol's, created through the gateway.
    async fn cloud_automation(&self, name: &str) -> String {
        let prompt = format!("{name}: summarise my inbox");
        let request = automesh_e2e_tests::daily_automation(name, &prompt, pb::Surface::Web);
        self.cluster
            .automations(&self.token)
            .create(request)
            .await
            .id
    }

    async fn run_now(&self, automation_id: &str, key: &str) -> String {
        let mut api = self.cluster.automations(&self.token);
        api.run_now(automation_id, key).await.id
    }

    async fn until_terminal(&self, run_id: &str) -> automesh_domain::Run {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(run) = self.cluster.store().internal().get_run(run_id).await
                && run.state.is_terminal()
            {
                return run;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "run {run_id} did not end; coordinator logs:\n{}\n{}\nlifecycle logs:\n{}\n{}",
                tail(&self.cluster.log(Kind::Coordinator, 0), 30),
                tail(&self.cluster.log(Kind::Coordinator, 1), 30),
                tail(&self.cluster.log(Kind::Lifecycle, 0), 30),
                tail(&self.cluster.log(Kind::Lifecycle, 1), 30),
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn automation_state(&self, id: &str) -> AutomationState {
        self.cluster
            .store()
            .get_automation(&owner(), id)
            .await
            .expect("automation")
            .state
    }

    async fn worker_id(&self) -> String {
        self.cluster
            .store()
            .get_worker(&owner())
            .await
            .expect("read")
            .expect("worker")
            .id
    }

    /// The pid of carol's worker's live agent, waiting (bounded) for one.
    async fn agent_pid(&self) -> u32 {
        let worker = self.worker_id().await;
        let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(pid) = self.cluster.live_agents().get(&worker) {
                return *pid;
            }
            assert!(tokio::time::Instant::now() < give_up, "no live agent");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn worker_state(&self) -> String {
        sqlx::query_scalar("SELECT state FROM cloud_workers")
            .fetch_one(self.cluster.store().pool())
            .await
            .expect("state")
    }

    async fn until_worker(&self, want: &str) {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
        while self.worker_state().await != want {
            assert!(
                tokio::time::Instant::now() < give_up,
                "the worker never became {want}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) {
        self.cluster.stop(false).await.expect("stop");
    }
}

fn kill(pid: u32) {
    automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::KILL);
}

/// Item 2: the agent of a ready worker dies; the owner's next runs find a
/// fresh agent instead of failing `runtime_failed`, and nothing moves to
/// needs-attention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_agent_of_a_ready_worker_is_replaced_not_blamed_on_the_user() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world(|_, _| Reply::Json(text_completion("done")), |s, _| s).await;
    let a = w.cloud_automation("inbox").await;
    let first = w.run_now(&a, "first").await;
    assert_eq!(w.until_terminal(&first).await.state, RunState::Succeeded);
    let dead = w.agent_pid().await;
    kill(dead);
    assert!(automesh_rpc::process::gone_within(dead, Duration::from_secs(5)).await);
    for i in 0..3 {
        let run = w.run_now(&a, &format!("after-{i}")).await;
        let run = w.until_terminal(&run).await;
        assert_eq!(
            (run.state, run.error_code),
            (RunState::Succeeded, None),
            "{run:?}"
        );
    }
    assert_ne!(w.agent_pid().await, dead, "a fresh agent serves the worker");
    assert_eq!(w.automation_state(&a).await, AutomationState::Active);
    assert_eq!(w.provider.calls(), 4, "one provider call per run");
    w.stop().await;
}

/// Item 2: the agent dies under a running run. That run ends
/// `runtime_interrupted` (its prompt is never sent again) without
/// needs-attention, and the owner's next run succeeds on a fresh agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_under_a_running_run_interrupts_only_that_run() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world(
        |n, _| {
            if n == 0 {
                Reply::Delayed(Duration::from_secs(20), text_completion("too late"))
            } else {
                Reply::Json(text_completion("done"))
            }
        },
        |s, _| s,
    )
    .await;
    let a = w.cloud_automation("inbox").await;
    let run = w.run_now(&a, "first").await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    while w.provider.calls() == 0 {
        assert!(tokio::time::Instant::now() < give_up, "never submitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    kill(w.agent_pid().await);
    let ended = w.until_terminal(&run).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Failed, Some(ErrorCode::RuntimeInterrupted)),
        "{ended:?}"
    );
    assert_eq!(w.automation_state(&a).await, AutomationState::Active);
    let next = w.run_now(&a, "next").await;
    assert_eq!(w.until_terminal(&next).await.state, RunState::Succeeded);
    assert_eq!(
        w.provider.calls(),
        2,
        "the interrupted prompt was sent once, never again"
    );
    w.stop().await;
}

/// Item 3: with two lifecycle replicas, the one that did not start a worker
/// stops it when idle — and the agent process is gone; waking it again
/// starts exactly one agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_lifecycle_replica_stops_any_worker_and_no_agent_is_left() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world(
        |_, _| Reply::Json(text_completion("done")),
        |s, _| {
            s.set(Kind::Lifecycle, "AUTOMESH_WORKER_IDLE_AFTER", "3s")
                // Replica 0 (which coordinators call first) never stops
                // workers; replica 1 does.
                .set_replica(Kind::Lifecycle, 0, "AUTOMESH_WORKER_IDLE_CHECK", "1h")
        },
    )
    .await;
    let a = w.cloud_automation("inbox").await;
    let run = w.run_now(&a, "first").await;
    assert_eq!(w.until_terminal(&run).await.state, RunState::Succeeded);
    let agent = w.agent_pid().await;
    w.until_worker("stopped").await;
    assert!(
        automesh_rpc::process::gone_within(agent, Duration::from_secs(10)).await,
        "the idle worker's agent still runs"
    );
    assert!(w.cluster.live_agents().is_empty());
    assert!(
        w.cluster
            .log(Kind::Lifecycle, 1)
            .contains("stopping an idle worker"),
        "replica 1 stopped it"
    );
    assert!(
        w.cluster
            .log(Kind::Lifecycle, 0)
            .contains("starting the worker"),
        "replica 0 started it"
    );
    // Woken again: one agent, not two.
    let again = w.run_now(&a, "again").await;
    assert_eq!(w.until_terminal(&again).await.state, RunState::Succeeded);
    assert_eq!(w.cluster.live_agents().len(), 1);
    w.stop().await;
}

/// Item 3: when every lifecycle replica is lost, the agents they started
/// exit by themselves within their orphan bound — cleanly, without a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_exit_cleanly_when_every_lifecycle_replica_is_gone() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut w = world(|_, _| Reply::Json(text_completion("done")), |s, _| s).await;
    let a = w.cloud_automation("inbox").await;
    let run = w.run_now(&a, "first").await;
    assert_eq!(w.until_terminal(&run).await.state, RunState::Succeeded);
    let agent = w.agent_pid().await;
    w.cluster.kill(Kind::Lifecycle, 0);
    w.cluster.kill(Kind::Lifecycle, 1);
    // The orphan bound is 8 s; the wait is bounded well past it.
    assert!(
        automesh_rpc::process::gone_within(agent, Duration::from_secs(40)).await,
        "an orphaned agent outlived its lifecycle"
    );
    let log = w.cluster.agent_log(&w.worker_id().await);
    assert!(log.contains("orphan bound"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    w.stop().await;
}

/// Item 4: the lifecycle replica waking a worker dies mid-wake. The other
/// replica takes the start over once its lease lapses — not after the
/// readiness cap (120 s, longer than the run's 90 s deadline) — and the run
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifecycle_lost_during_a_wake_hands_the_start_over_at_lease_speed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let bin = env!("CARGO_BIN_EXE_automesh");
    let mut w = world(
        |_, _| Reply::Json(text_completion("done")),
        |s, scratch| {
            // An agent that takes a while to start, so the wake is long.
            let slow = scratch.join("slow-agent.sh");
            std::fs::write(
                &slow,
                format!("#!/bin/sh\nsleep 4\nexec {bin} worker-agent \"$@\"\n"),
            )
            .expect("script");
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755))
                    .expect("chmod");
            }
            s.set(
                Kind::Lifecycle,
                "AUTOMESH_WORKER_AGENT_COMMAND",
                &slow.display().to_string(),
            )
        },
    )
    .await;
    let a = w.cloud_automation("inbox").await;
    let run = w.run_now(&a, "first").await;
    w.until_worker("starting").await;
    // Whichever replica holds the start dies.
    let starter = if w
        .cluster
        .log(Kind::Lifecycle, 0)
        .contains("starting the worker")
    {
        0
    } else {
        1
    };
    w.cluster.kill(Kind::Lifecycle, starter);
    let ended = w.until_terminal(&run).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Succeeded, None),
        "{ended:?}"
    );
    assert!(
        w.cluster
            .log(Kind::Lifecycle, 1 - starter)
            .contains("starting the worker"),
        "the other replica took the start over"
    );
    assert_eq!(w.cluster.live_agents().len(), 1, "one agent for the worker");
    w.stop().await;
}

/// Issue 33, rolling restarts: a lifecycle replica told to stop (SIGTERM)
/// while it drives a cloud run hands the drive back as it exits, and the
/// other replica resumes it at once — not when the 120 s lease would lapse,
/// which is past the run's 60 s deadline. The run succeeds and the prompt
/// reached the model once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifecycle_told_to_stop_hands_its_cloud_run_over_at_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut w = world(
        |_, _| Reply::Delayed(Duration::from_secs(6), text_completion("done")),
        |s, _| {
            s.set(Kind::Lifecycle, "AUTOMESH_CLOUD_LEASE", "120s").set(
                Kind::Scheduler,
                "AUTOMESH_RUN_DEADLINE",
                "60s",
            )
        },
    )
    .await;
    let a = w.cloud_automation("inbox").await;
    let run = w.run_now(&a, "first").await;
    // The prompt is with the model: the run is running, driven by one
    // replica, whose name its dispatch row carries.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    while w.provider.calls() == 0 {
        assert!(
            tokio::time::Instant::now() < give_up,
            "the model was never called"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Which lifecycle replica drives the run: its dispatch row names it.
    let store = w.cluster.store().clone();
    let driver_of = || async {
        let driver: String =
            sqlx::query_scalar("SELECT driver_owner FROM cloud_dispatch WHERE run_id = $1")
                .bind(&run)
                .fetch_one(store.pool())
                .await
                .expect("driver");
        driver
    };
    let driver = driver_of().await;
    let holder = usize::from(!w.cluster.log(Kind::Lifecycle, 0).contains(&driver));
    assert!(w.cluster.log(Kind::Lifecycle, holder).contains(&driver));
    let clean = w
        .cluster
        .terminate(Kind::Lifecycle, holder, Duration::from_secs(30))
        .await;
    assert!(clean, "the replica exited by itself, successfully");
    assert!(
        w.cluster
            .log(Kind::Lifecycle, holder)
            .contains("cloud drives and worker starts handed back"),
        "{}",
        tail(&w.cluster.log(Kind::Lifecycle, holder), 20)
    );
    let ended = w.until_terminal(&run).await;
    assert_eq!(
        (ended.state, ended.error_code),
        (RunState::Succeeded, None),
        "{ended:?}"
    );
    // The other replica drove it to its end (its resume pass or the
    // coordinator observing again revived the drive, whichever came first).
    let last = driver_of().await;
    assert_ne!(last, driver, "the stopped replica no longer drives it");
    assert!(
        w.cluster.log(Kind::Lifecycle, 1 - holder).contains(&last),
        "the other replica drove it to its end"
    );
    assert_eq!(w.provider.calls(), 1, "the prompt reached the model once");
    w.stop().await;
}

/// Item 5: a coordinator dies (SIGKILL) right after it committed a run's
/// end. The run's log still holds its terminal status event, because the
/// end, the receipt and the event commit together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_right_after_a_run_ends_leaves_its_terminal_event() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut w = world(
        |_, _| Reply::Json(text_completion("done")),
        |s, _| {
            s.set(
                Kind::Coordinator,
                "AUTOMESH_FAILPOINTS",
                "coordinator.after_finish",
            )
        },
    )
    .await;
    let a = w.cloud_automation("inbox").await;
    let run = w.run_now(&a, "first").await;
    let ended = w.until_terminal(&run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{ended:?}");
    // The coordinator that ended it is dead.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    while !(0..2).any(|i| {
        w.cluster
            .log(Kind::Coordinator, i)
            .contains("failpoint coordinator.after_finish")
    }) {
        assert!(tokio::time::Instant::now() < give_up, "no coordinator died");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let events = w
        .cluster
        .store()
        .internal()
        .events(&run, 0, 1000)
        .await
        .expect("events");
    let ends: Vec<_> = events
        .iter()
        .filter(|e| {
            matches!(&e.payload, RunEventPayload::StatusChange { state, .. } if state == "succeeded")
        })
        .collect();
    assert_eq!(ends.len(), 1, "{events:?}");
    assert_eq!(
        events.last().map(|e| e.sequence),
        ends.first().map(|e| e.sequence),
        "the end is the last event"
    );
    assert!(
        w.cluster
            .store()
            .internal()
            .receipt(&run)
            .await
            .expect("receipt")
            .is_some()
    );
    for i in 0..2 {
        w.cluster.kill(Kind::Coordinator, i);
    }
    w.stop().await;
}

/// The runner streams of every runner-gateway replica kept alive by
/// `liveness` (`ping` or `heartbeat`), and how many ended `lost`.
async fn runner_streams(cluster: &Cluster, liveness: &str) -> (f64, f64) {
    let (mut streams, mut broken) = (0.0, 0.0);
    for replica in 0..cluster.replicas(Kind::RunnerGateway) {
        let text = cluster
            .scrape(Kind::RunnerGateway, replica)
            .await
            .expect("scrape");
        let held = [("liveness", liveness)];
        streams += automesh_e2e_tests::metric(&text, "automesh_runner_streams", &held);
        let ended = [("reason", "lost")];
        broken += automesh_e2e_tests::metric(&text, "automesh_runner_streams_ended_total", &ended);
    }
    (streams, broken)
}

/// Waits (bounded by `within`) until `liveness` streams number `want`.
async fn until_runner_streams(cluster: &Cluster, liveness: &str, want: f64, within: Duration) {
    let give_up = tokio::time::Instant::now() + within;
    loop {
        let (streams, _) = runner_streams(cluster, liveness).await;
        if streams == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "{streams} {liveness} streams, not {want}, after {within:?}; runner gateway logs:\n{}\n{}",
            tail(&cluster.log(Kind::RunnerGateway, 0), 20),
            tail(&cluster.log(Kind::RunnerGateway, 1), 20),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A desktop runner whose gateway stalls (SIGSTOP: the connection stays
/// open, nothing comes back) leaves it within its dead-after bound — it
/// sends no PINGs of its own; it hears neither the gateway's PINGs nor an
/// answer to the heartbeat it asks with — and reconnects to the other
/// replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_leaves_a_stalled_gateway_and_reconnects_to_another_replica() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut w = world(|_, _| Reply::Json(text_completion("done")), |s, _| s).await;
    let o = owner();
    let runner = w
        .cluster
        .add_runner(&o.org_id, &o.user_id)
        .await
        .expect("runner");
    until_runner_streams(&w.cluster, "ping", 1.0, Duration::from_secs(30)).await;
    let held_by = |text: &str| {
        automesh_e2e_tests::metric(text, "automesh_runner_streams", &[("liveness", "ping")])
    };
    let mut holder = None;
    for replica in 0..2 {
        let text = w.cluster.scrape(Kind::RunnerGateway, replica).await;
        if held_by(&text.expect("scrape")) == 1.0 {
            holder = Some(replica);
        }
    }
    let holder = holder.expect("a replica holds the runner's stream");
    let other = 1 - holder;
    // The holder PINGs the idle stream and counts how long its answer took.
    let answers = "automesh_http2_ping_answer_duration_seconds_count";
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = w.cluster.scrape(Kind::RunnerGateway, holder).await;
        if automesh_e2e_tests::metric(&text.expect("scrape"), answers, &[]) >= 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "no PING answer counted by the stream's gateway within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    w.cluster.pause(Kind::RunnerGateway, holder);
    // Dead-after is 4 s in the cluster; bounded generously for a loaded
    // machine (the runner also backs off between attempts).
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = w.cluster.scrape(Kind::RunnerGateway, other).await;
        if held_by(&text.expect("scrape")) == 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "the runner did not move to the other replica; its log:\n{}",
            tail(&w.cluster.runner_log(runner), 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = w.cluster.runner_log(runner);
    assert!(
        log.contains("the gateway sent nothing for"),
        "the runner says why it left: {}",
        tail(&log, 20)
    );
    w.cluster.resume(Kind::RunnerGateway, holder);
    w.stop().await;
}

/// A desktop runner that stalls (SIGSTOP) on a stream kept alive by HTTP/2
/// PING — it sends no heartbeats, so no silence gives it away — is declared
/// dead by the runner gateway within the dead-after bound: its connection
/// stops answering PINGs. The owner's runs go to the owner's other runner
/// meanwhile, and the stalled one reconnects once it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_runner_kept_alive_by_ping_is_declared_dead_and_its_owner_served_by_another() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut w = world(|_, _| Reply::Json(text_completion("done")), |s, _| s).await;
    let o = owner();
    let stalled = w
        .cluster
        .add_runner(&o.org_id, &o.user_id)
        .await
        .expect("runner");
    w.cluster
        .add_runner(&o.org_id, &o.user_id)
        .await
        .expect("runner");
    // The reference runner asks for PING liveness, and it is granted.
    until_runner_streams(&w.cluster, "ping", 2.0, Duration::from_secs(30)).await;
    assert_eq!(runner_streams(&w.cluster, "heartbeat").await.0, 0.0);
    let (_, broken_before) = runner_streams(&w.cluster, "ping").await;

    let pid = w.cluster.runner_pid(stalled).expect("runner pid");
    automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::STOP);
    // Dead-after is 4 s in the cluster: PINGs after 2 s of quiet, answered
    // within 1.6 s. Bounded generously for a loaded machine.
    until_runner_streams(&w.cluster, "ping", 1.0, Duration::from_secs(20)).await;
    let (_, broken) = runner_streams(&w.cluster, "ping").await;
    let mut ended = String::new();
    for replica in 0..2 {
        let text = w
            .cluster
            .scrape(Kind::RunnerGateway, replica)
            .await
            .expect("scrape");
        ended.extend(
            text.lines()
                .filter(|l| l.starts_with("automesh_runner_streams_ended"))
                .map(|l| format!("{l}\n")),
        );
    }
    assert!(
        broken > broken_before,
        "the stalled stream ended as a lost connection: {ended}"
    );

    // The owner is served by the runner that is still there.
    let request = automesh_e2e_tests::daily_automation("desk", "tidy up", pb::Surface::Desktop);
    let id = w.cluster.automations(&w.token).create(request).await.id;
    let run_id = w.run_now(&id, "after-stall").await;
    let run = w.until_terminal(&run_id).await;
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");

    // Going on, the stalled runner finds its connection closed and
    // reconnects.
    automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::CONT);
    until_runner_streams(&w.cluster, "ping", 2.0, Duration::from_secs(30)).await;
    w.stop().await;
}

/// Issue 31, item 2: the LISTEN connections of a coordinator and a runner
/// gateway are terminated (`pg_terminate_backend`); each logs it, counts
/// the reconnection and catches up, and the next run-now is dispatched at
/// signal speed. Both polls are 60 s here, so a run that ends within 30 s
/// was woken by notifications, not found by a poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_listen_connection_is_reconnected_and_the_next_run_is_dispatched_at_signal_speed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut w = world(
        |_, _| Reply::Json(text_completion("done")),
        |mut s, _| {
            s.replicas.insert(Kind::Coordinator, 1);
            s.replicas.insert(Kind::RunnerGateway, 1);
            s.set(Kind::Coordinator, "AUTOMESH_CLAIM_POLL", "60s").set(
                Kind::RunnerGateway,
                "AUTOMESH_RUNNER_DISPATCH_POLL",
                "60s",
            )
        },
    )
    .await;
    let o = owner();
    w.cluster
        .add_runner(&o.org_id, &o.user_id)
        .await
        .expect("runner");
    until_runner_streams(&w.cluster, "ping", 1.0, Duration::from_secs(30)).await;
    let request = automesh_e2e_tests::daily_automation("desk", "tidy up", pb::Surface::Desktop);
    let id = w.cluster.automations(&w.token).create(request).await.id;
    let warm = w.run_now(&id, "before-cut").await;
    assert_eq!(w.until_terminal(&warm).await.state, RunState::Succeeded);

    let reconnects = "automesh_db_listen_reconnects_total";
    let count = async |kind| {
        let text = w.cluster.scrape(kind, 0).await.expect("scrape");
        automesh_e2e_tests::metric(&text, reconnects, &[])
    };
    let before = (
        count(Kind::Coordinator).await,
        count(Kind::RunnerGateway).await,
    );
    let cut = w.cluster.cut_listen_connections().await.expect("cut");
    assert!(
        cut >= 2,
        "a coordinator and a runner gateway listen: {cut} cut"
    );
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = (
            count(Kind::Coordinator).await,
            count(Kind::RunnerGateway).await,
        );
        if now.0 > before.0 && now.1 > before.1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "LISTEN reconnections not counted within 30 s ({before:?} → {now:?}); logs:\n{}\n{}",
            tail(&w.cluster.log(Kind::Coordinator, 0), 20),
            tail(&w.cluster.log(Kind::RunnerGateway, 0), 20),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for kind in [Kind::Coordinator, Kind::RunnerGateway] {
        let log = w.cluster.log(kind, 0);
        assert!(
            log.contains("LISTEN connection lost; reconnecting"),
            "{kind:?} logs the loss: {}",
            tail(&log, 20)
        );
    }

    let started = tokio::time::Instant::now();
    let run_id = w.run_now(&id, "after-cut").await;
    let give_up = started + Duration::from_secs(30);
    loop {
        let run = w.cluster.store().internal().get_run(&run_id).await;
        if let Ok(run) = &run
            && run.state.is_terminal()
        {
            assert_eq!(run.state, RunState::Succeeded, "{run:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "dispatched at poll speed: the run after the LISTEN cut did not end within 30 s \
             (polls are 60 s); coordinator log:\n{}\nrunner gateway log:\n{}",
            tail(&w.cluster.log(Kind::Coordinator, 0), 30),
            tail(&w.cluster.log(Kind::RunnerGateway, 0), 30),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.stop().await;
}

/// Issue 32: a delivery process killed (SIGKILL) in the middle of a
/// delivery loses no notification: once its claim on the endpoint runs out
/// another scheduler process sends the message again, with the same
/// `webhook-id`, signed as before; no secret reaches any process's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_killed_mid_request_is_redelivered_with_the_same_webhook_id() {
    use automesh_e2e_tests::webhooks::{Answer, Receiver, verify_with_python};
    use automesh_proto::v1::notifications_client::NotificationsClient;
    let _one = ONE_AT_A_TIME.lock().await;
    let mut w = world(
        |_, _| Reply::Json(text_completion("done")),
        |s, _| {
            s.set(
                Kind::Scheduler,
                "AUTOMESH_NOTIFICATION_KEY",
                "crash-test-notification-key",
            )
            .set(Kind::Scheduler, "AUTOMESH_WEBHOOK_ALLOW_HTTP", "true")
            .set(Kind::Scheduler, "AUTOMESH_WEBHOOK_ALLOW_PRIVATE", "true")
            .set(Kind::Scheduler, "AUTOMESH_WEBHOOK_TIMEOUT", "3s")
        },
    )
    .await;
    let receiver = Receiver::start(Answer::Status(204))
        .await
        .expect("receiver");
    // The first request is never answered: the process sending it is
    // killed while it waits.
    receiver.script(&[Answer::Hang]);
    let mut hooks = NotificationsClient::new(w.cluster.channel(&w.token));
    let request = pb::CreateWebhookEndpointRequest {
        url: receiver.url.clone(),
        description: String::new(),
    };
    let created = hooks.create_webhook_endpoint(request).await;
    let created = created.expect("create").into_inner();
    let endpoint = created.endpoint.expect("endpoint");
    let test = pb::TestWebhookEndpointRequest {
        id: endpoint.id.clone(),
    };
    let queued = hooks.test_webhook_endpoint(test).await.expect("test");
    let message_id = queued.into_inner().message_id;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while receiver.received().is_empty() {
        assert!(tokio::time::Instant::now() < give_up, "never sent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Mid-request: every scheduler process is killed, then one comes back.
    w.cluster.kill(Kind::Scheduler, 0);
    w.cluster.kill(Kind::Scheduler, 1);
    w.cluster
        .restart(Kind::Scheduler, 0)
        .await
        .expect("restart");
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    while receiver.delivered().is_empty() {
        assert!(
            tokio::time::Instant::now() < give_up,
            "not redelivered within 60 s; scheduler log:\n{}",
            tail(&w.cluster.log(Kind::Scheduler, 0), 30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let received = receiver.received();
    assert_eq!(received.len(), 2, "sent, killed, sent again");
    assert!(received.iter().all(|d| d.id() == message_id));
    assert_eq!(received[0].body, received[1].body);
    verify_with_python(&created.secret, &received).expect("signatures");
    let shown = hooks
        .list_webhook_messages(pb::ListWebhookMessagesRequest {
            endpoint_id: endpoint.id.clone(),
            page_size: 0,
        })
        .await
        .expect("messages")
        .into_inner()
        .messages;
    assert_eq!(shown.len(), 1);
    assert!(shown[0].deliver_time.is_some(), "{shown:?}");
    let key = created.secret.trim_start_matches("whsec_");
    assert!(
        !w.cluster.all_logs().contains(key),
        "a webhook secret in a log"
    );
    w.stop().await;
}

/// Issue 33: with `AUTOMESH_AGENT_DIES_WITH_LIFECYCLE` (the default), the
/// agent a lifecycle replica started dies with it (SIGKILL of the replica),
/// not after its orphan bound (here ten minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_dies_with_the_lifecycle_that_started_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let w = world(
        |_, _| Reply::Json(text_completion("done")),
        |s, _| {
            let mut s = s
                .set(
                    Kind::Lifecycle,
                    "AUTOMESH_AGENT_DIES_WITH_LIFECYCLE",
                    "true",
                )
                .set(Kind::Lifecycle, "AUTOMESH_AGENT_ORPHAN_AFTER", "600s");
            s.replicas.insert(Kind::Lifecycle, 1);
            s
        },
    )
    .await;
    let mut w = w;
    let a = w.cloud_automation("inbox").await;
    let run = w.run_now(&a, "first").await;
    assert_eq!(w.until_terminal(&run).await.state, RunState::Succeeded);
    let agent = w.agent_pid().await;
    w.cluster.kill(Kind::Lifecycle, 0);
    assert!(
        automesh_rpc::process::gone_within(agent, Duration::from_secs(60)).await,
        "the agent outlived the lifecycle that started it"
    );
    let log = w.cluster.agent_log(&w.worker_id().await);
    assert!(!log.contains("orphan bound"), "{log}");
    w.stop().await;
}
