//! The mesh as separate processes: every service (any number of replicas
//! each) and every desktop runner is its own `automesh` child process on a
//! fixed loopback port, against one fresh PostgreSQL database, so a test can
//! kill one with SIGKILL (a lost process: its sockets, its children, its
//! in-flight transactions), stall it with SIGSTOP, and start it again on the
//! same port. In-process task aborts cannot lose a socket or a child; this
//! can.
//!
//! The binary is the caller's (`env!("CARGO_BIN_EXE_automesh")` in the cli
//! crate's tests). Each process's stderr goes to `<dir>/<name>.log`, kept
//! across restarts and removed with the cluster unless the test failed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use automesh_proto::v1 as pb;
use automesh_proto::v1::automations_client::AutomationsClient;
use automesh_proto::v1::runs_client::RunsClient;
use automesh_rpc::process::Signal;
use automesh_store::Backend;
use automesh_store::testing::TestDatabase;

use crate::{Bearer, JWT_SECRET};

/// A public-API channel to every gateway replica (failing over between
/// them), presenting a bearer token.
pub type ClusterChannel =
    tonic::service::interceptor::InterceptedService<automesh_rpc::client::Replicas, Bearer>;

/// A service of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Gateway,
    Scheduler,
    Coordinator,
    Lifecycle,
    RunnerGateway,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Scheduler,
        Kind::Coordinator,
        Kind::Lifecycle,
        Kind::RunnerGateway,
        Kind::Gateway,
    ];

    /// The `automesh` subcommand that runs it.
    pub fn command(self) -> &'static str {
        match self {
            Kind::Gateway => "gateway",
            Kind::Scheduler => "scheduler",
            Kind::Coordinator => "run-coordinator",
            Kind::Lifecycle => "cloud-worker-lifecycle",
            Kind::RunnerGateway => "desktop-runner-gateway",
        }
    }

    fn listen_var(self) -> &'static str {
        match self {
            Kind::Gateway => "AUTOMESH_GATEWAY_LISTEN",
            Kind::Scheduler => "AUTOMESH_SCHEDULER_LISTEN",
            Kind::Coordinator => "AUTOMESH_COORDINATOR_LISTEN",
            Kind::Lifecycle => "AUTOMESH_LIFECYCLE_LISTEN",
            Kind::RunnerGateway => "AUTOMESH_RUNNER_GATEWAY_LISTEN",
        }
    }
}

/// Runs automation `automation_id` now under `key` through `client`,
/// retried under the same key until a gateway answers (a replica may be
/// restarting, the database away): the run it names is created once
/// however often it is asked for. Panics after `within`.
pub async fn run_now_retrying(
    mut client: AutomationsClient<ClusterChannel>,
    automation_id: &str,
    key: &str,
    within: Duration,
) -> String {
    let started = std::time::Instant::now();
    loop {
        let asked = client
            .run_automation_now(pb::RunAutomationNowRequest {
                id: automation_id.to_owned(),
                idempotency_key: key.to_owned(),
            })
            .await;
        match asked {
            Ok(r) => return r.into_inner().run.expect("run").id,
            Err(status) => {
                assert!(
                    started.elapsed() < within,
                    "run-now failed for {within:?}: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The internal credential of every process cluster.
pub const INTERNAL_TOKEN: &str = "process-cluster-internal-token-0123";

/// How a cluster is put together. Durations are passed to the services as
/// their flags' text (`"3s"`, `"500ms"`).
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Replicas of each service.
    pub replicas: BTreeMap<Kind, usize>,
    /// Environment of every process of a kind (on top of the cluster's).
    pub env: BTreeMap<Kind, Vec<(String, String)>>,
    /// Environment of one replica (on top of its kind's).
    pub replica_env: BTreeMap<(Kind, usize), Vec<(String, String)>>,
    /// Environment of every process: services and runners.
    pub all_env: Vec<(String, String)>,
    /// The model provider cloud workers and runners use.
    pub provider_url: String,
    pub provider_key: String,
    /// The Connect endpoint of cloud workers and runners.
    pub connect_url: String,
    pub connect_token: String,
}

impl ClusterSpec {
    /// `replicas` of every service, against the given provider and Connect
    /// endpoint, with short leases and bounds so that faults show quickly.
    pub fn new(
        replicas: usize,
        provider_url: &str,
        connect_url: &str,
        connect_token: &str,
    ) -> Self {
        let short = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let mut env = BTreeMap::new();
        env.insert(
            Kind::Coordinator,
            short(&[
                ("AUTOMESH_RUN_LEASE", "3s"),
                ("AUTOMESH_CANCEL_BOUND", "5s"),
            ]),
        );
        env.insert(
            Kind::Lifecycle,
            short(&[
                ("AUTOMESH_CLOUD_LEASE", "3s"),
                ("AUTOMESH_AGENT_ORPHAN_AFTER", "8s"),
                // Agents outlive their replica, for the other to adopt
                // (what the crash tests exercise); a test that wants them
                // to die with it sets this.
                ("AUTOMESH_AGENT_DIES_WITH_LIFECYCLE", "false"),
                ("AUTOMESH_READINESS_CAP", "120s"),
                ("AUTOMESH_WORKER_IDLE_AFTER", "10m"),
                ("AUTOMESH_WORKER_IDLE_CHECK", "1s"),
            ]),
        );
        env.insert(
            Kind::RunnerGateway,
            short(&[
                ("AUTOMESH_RUNNER_HEARTBEAT", "1s"),
                ("AUTOMESH_RUNNER_DEAD_AFTER", "4s"),
            ]),
        );
        env.insert(Kind::Scheduler, short(&[("AUTOMESH_RUN_DEADLINE", "90s")]));
        Self {
            replicas: Kind::ALL.iter().map(|k| (*k, replicas)).collect(),
            env,
            replica_env: BTreeMap::new(),
            all_env: vec![],
            provider_url: provider_url.to_owned(),
            provider_key: "sk-cluster-provider-key-never-logged".into(),
            connect_url: connect_url.to_owned(),
            connect_token: connect_token.to_owned(),
        }
    }

    /// Sets (or replaces) one variable of every process, runners included.
    pub fn set_all(mut self, var: &str, value: &str) -> Self {
        self.all_env.retain(|(k, _)| k != var);
        self.all_env.push((var.to_owned(), value.to_owned()));
        self
    }

    /// Sets (or replaces) one variable of one replica of `kind`.
    pub fn set_replica(mut self, kind: Kind, replica: usize, var: &str, value: &str) -> Self {
        let vars = self.replica_env.entry((kind, replica)).or_default();
        vars.retain(|(k, _)| k != var);
        vars.push((var.to_owned(), value.to_owned()));
        self
    }

    /// Sets (or replaces) one variable of every process of `kind`.
    pub fn set(mut self, kind: Kind, var: &str, value: &str) -> Self {
        let vars = self.env.entry(kind).or_default();
        vars.retain(|(k, _)| k != var);
        vars.push((var.to_owned(), value.to_owned()));
        self
    }
}

/// One service process (or its slot while it is down).
struct Proc {
    port: u16,
    /// Its metrics listener's port.
    metrics: u16,
    /// Its internal listener's port (the desktop-runner-gateway's).
    internal: u16,
    child: Option<Child>,
}

/// A desktop runner process.
struct RunnerProc {
    token: String,
    state_dir: PathBuf,
    child: Option<Child>,
}

/// The mesh as separate processes; call [`Cluster::stop`] at the end.
pub struct Cluster {
    /// Taken by [`Cluster::stop`].
    db: Option<TestDatabase>,
    pub spec: ClusterSpec,
    bin: PathBuf,
    /// Logs, worker directories and runner state.
    pub dir: PathBuf,
    procs: BTreeMap<(Kind, usize), Proc>,
    runners: Vec<RunnerProc>,
}

/// A port nothing listens on now (bound, then released); services are
/// started on it and restarted on it.
fn free_port() -> anyhow::Result<u16> {
    crate::free_port()
}

fn log_file(path: &Path) -> anyhow::Result<Stdio> {
    Ok(std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("log file {}", path.display()))?
        .into())
}

impl Cluster {
    /// Starts every replica of every service on a fresh PostgreSQL database
    /// and waits (bounded) until each reports SERVING.
    pub async fn start(bin: &Path, spec: ClusterSpec) -> anyhow::Result<Cluster> {
        automesh_telemetry::init_for_tests();
        let db = TestDatabase::new(Backend::Postgres)
            .await
            .context("test database (is PostgreSQL running? see README)")?;
        let dir = std::env::temp_dir().join(format!(
            "automesh-cluster-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(dir.join("workers"))?;
        let mut procs = BTreeMap::new();
        for (kind, n) in &spec.replicas {
            for i in 0..(*n).max(1) {
                procs.insert(
                    (*kind, i),
                    Proc {
                        port: free_port()?,
                        metrics: free_port()?,
                        internal: free_port()?,
                        child: None,
                    },
                );
            }
        }
        let mut cluster = Cluster {
            db: Some(db),
            spec,
            bin: bin.to_owned(),
            dir,
            procs,
            runners: vec![],
        };
        // Upstreams first, the gateway last: it serves once they all do.
        for kind in Kind::ALL {
            let slots: Vec<usize> = cluster
                .procs
                .keys()
                .filter(|(k, _)| *k == kind)
                .map(|(_, i)| *i)
                .collect();
            for i in &slots {
                cluster.spawn(kind, *i)?;
            }
            for i in slots {
                cluster
                    .wait_serving(kind, i, Duration::from_secs(60))
                    .await?;
            }
        }
        Ok(cluster)
    }

    /// The cluster's database.
    pub fn store(&self) -> &automesh_store::Store {
        &self.database().store
    }

    fn database(&self) -> &TestDatabase {
        self.db.as_ref().expect("the cluster is running")
    }

    /// The address of one replica, `http://127.0.0.1:port`.
    pub fn addr(&self, kind: Kind, replica: usize) -> String {
        format!("http://127.0.0.1:{}", self.procs[&(kind, replica)].port)
    }

    /// One replica's metrics, as Prometheus text (`GET /metrics`).
    pub async fn scrape(&self, kind: Kind, replica: usize) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let port = self.procs[&(kind, replica)].metrics;
        let mut stream = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(("127.0.0.1", port)),
        )
        .await??;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        let mut response = String::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
            .await??;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .ok_or_else(|| anyhow::anyhow!("not an HTTP response: {response}"))?;
        anyhow::ensure!(
            head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
            "{head}"
        );
        Ok(body.to_owned())
    }

    /// Every replica of `kind`, comma separated (how services name their
    /// upstreams).
    pub fn addrs(&self, kind: Kind) -> String {
        self.procs
            .keys()
            .filter(|(k, _)| *k == kind)
            .map(|(k, i)| self.addr(*k, *i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every replica's internal listener (the desktop-runner-gateway's
    /// executor and token service), comma separated.
    pub fn internal_addrs(&self, kind: Kind) -> String {
        self.procs
            .iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|(_, p)| format!("http://127.0.0.1:{}", p.internal))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How many replicas of `kind` the cluster has.
    pub fn replicas(&self, kind: Kind) -> usize {
        self.procs.keys().filter(|(k, _)| *k == kind).count()
    }

    fn name(kind: Kind, replica: usize) -> String {
        format!("{}-{replica}", kind.command())
    }

    /// The log of one replica (every start of it).
    pub fn log(&self, kind: Kind, replica: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("{}.log", Self::name(kind, replica))))
            .unwrap_or_default()
    }

    /// Where the cloud workers' directories are (shared by every
    /// lifecycle replica, as on one host).
    pub fn workers_dir(&self) -> PathBuf {
        self.dir.join("workers")
    }

    fn base_env(&self, command: &mut Command) {
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", &self.dir)
            .env(
                "RUST_LOG",
                std::env::var("AUTOMESH_CLUSTER_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("AUTOMESH_DATABASE_URL", &self.database().url)
            .env("AUTOMESH_DATABASE_POOL", "4")
            .env("AUTOMESH_INTERNAL_TOKEN", INTERNAL_TOKEN)
            .envs(
                self.spec
                    .all_env
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            );
    }

    fn spawn(&mut self, kind: Kind, replica: usize) -> anyhow::Result<()> {
        let port = self.procs[&(kind, replica)].port;
        let metrics = self.procs[&(kind, replica)].metrics;
        let internal = self.procs[&(kind, replica)].internal;
        let mut command = Command::new(&self.bin);
        command.arg(kind.command());
        self.base_env(&mut command);
        command
            .env(kind.listen_var(), format!("127.0.0.1:{port}"))
            .env("AUTOMESH_METRICS_LISTEN", format!("127.0.0.1:{metrics}"));
        match kind {
            Kind::Gateway => {
                command
                    .env(
                        "AUTOMESH_JWT_SECRET",
                        String::from_utf8_lossy(JWT_SECRET).into_owned(),
                    )
                    .env("AUTOMESH_SCHEDULER_ADDR", self.addrs(Kind::Scheduler))
                    .env("AUTOMESH_COORDINATOR_ADDR", self.addrs(Kind::Coordinator))
                    .env("AUTOMESH_LIFECYCLE_ADDR", self.addrs(Kind::Lifecycle))
                    .env(
                        "AUTOMESH_RUNNER_GATEWAY_ADDR",
                        self.internal_addrs(Kind::RunnerGateway),
                    );
            }
            Kind::Coordinator => {
                command
                    .env(
                        "AUTOMESH_DESKTOP_EXECUTOR_ADDR",
                        self.internal_addrs(Kind::RunnerGateway),
                    )
                    .env("AUTOMESH_CLOUD_EXECUTOR_ADDR", self.addrs(Kind::Lifecycle));
            }
            Kind::Lifecycle => {
                command
                    .env(
                        "AUTOMESH_WORKER_AGENT_COMMAND",
                        format!("{} worker-agent", self.bin.display()),
                    )
                    .env("AUTOMESH_WORKERS_DIR", self.workers_dir())
                    .env("AUTOMESH_WORKER_PROVIDER_URL", &self.spec.provider_url)
                    .env("AUTOMESH_WORKER_PROVIDER_API_KEY", &self.spec.provider_key)
                    .env("AUTOMESH_CONNECT_URL", &self.spec.connect_url)
                    .env("AUTOMESH_CONNECT_TOKEN", &self.spec.connect_token)
                    .env("AUTOMESH_WORKER_LOG", "info");
            }
            Kind::RunnerGateway => {
                command.env(
                    "AUTOMESH_RUNNER_GATEWAY_INTERNAL_LISTEN",
                    format!("127.0.0.1:{internal}"),
                );
            }
            Kind::Scheduler => {}
        }
        for (k, v) in self.spec.env.get(&kind).into_iter().flatten() {
            command.env(k, v);
        }
        for (k, v) in self
            .spec
            .replica_env
            .get(&(kind, replica))
            .into_iter()
            .flatten()
        {
            command.env(k, v);
        }
        let log = self.dir.join(format!("{}.log", Self::name(kind, replica)));
        let child = command
            .stdin(Stdio::null())
            .stdout(log_file(&log)?)
            .stderr(log_file(&log)?)
            .spawn()
            .with_context(|| format!("start {}", Self::name(kind, replica)))?;
        if let Some(p) = self.procs.get_mut(&(kind, replica)) {
            p.child = Some(child);
        }
        Ok(())
    }

    /// Waits (bounded) until one replica reports SERVING.
    pub async fn wait_serving(
        &self,
        kind: Kind,
        replica: usize,
        within: Duration,
    ) -> anyhow::Result<()> {
        crate::wait_for_health(&self.addr(kind, replica), within, true)
            .await
            .with_context(|| {
                format!(
                    "{} did not serve; its log:\n{}",
                    Self::name(kind, replica),
                    tail(&self.log(kind, replica), 40)
                )
            })
    }

    /// The process id of a running replica.
    pub fn pid(&self, kind: Kind, replica: usize) -> Option<u32> {
        self.procs[&(kind, replica)].child.as_ref().map(Child::id)
    }

    /// Kills one replica with SIGKILL and reaps it: nothing of it runs on,
    /// nothing of it is cleaned up.
    pub fn kill(&mut self, kind: Kind, replica: usize) {
        if let Some(p) = self.procs.get_mut(&(kind, replica))
            && let Some(mut child) = p.child.take()
        {
            // SIGCONT first, so a stalled process dies as promptly.
            automesh_rpc::process::signal(child.id(), Signal::CONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Tells one replica to stop (SIGTERM), as a rolling restart does, and
    /// waits (bounded by `within`, then SIGKILL) for it to exit; true when
    /// it exited by itself, successfully.
    pub async fn terminate(&mut self, kind: Kind, replica: usize, within: Duration) -> bool {
        let Some(p) = self.procs.get_mut(&(kind, replica)) else {
            return false;
        };
        let Some(mut child) = p.child.take() else {
            return false;
        };
        automesh_rpc::process::signal(child.id(), Signal::TERM);
        let give_up = tokio::time::Instant::now() + within;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if tokio::time::Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return false;
                }
            }
        }
    }

    /// Starts a replica again on its port (after [`Cluster::kill`]) and
    /// waits until it serves.
    pub async fn restart(&mut self, kind: Kind, replica: usize) -> anyhow::Result<()> {
        self.respawn(kind, replica)?;
        self.wait_serving(kind, replica, Duration::from_secs(60))
            .await
    }

    /// Starts a replica again on its port without waiting for it (it may
    /// need upstreams that are down themselves).
    pub fn respawn(&mut self, kind: Kind, replica: usize) -> anyhow::Result<()> {
        self.kill(kind, replica);
        self.spawn(kind, replica)
    }

    /// Waits (bounded) until every replica of every service serves.
    pub async fn wait_all_serving(&self, within: Duration) -> anyhow::Result<()> {
        for (kind, replica) in self.procs.keys() {
            self.wait_serving(*kind, *replica, within).await?;
        }
        Ok(())
    }

    /// Stalls one replica (SIGSTOP): its sockets stay open, it answers
    /// nothing.
    pub fn pause(&self, kind: Kind, replica: usize) {
        if let Some(pid) = self.pid(kind, replica) {
            automesh_rpc::process::signal(pid, Signal::STOP);
        }
    }

    /// Lets a stalled replica go on (SIGCONT).
    pub fn resume(&self, kind: Kind, replica: usize) {
        if let Some(pid) = self.pid(kind, replica) {
            automesh_rpc::process::signal(pid, Signal::CONT);
        }
    }

    /// Cuts every database connection of the cluster's services (as a
    /// PostgreSQL restart or a network cut would); returns how many.
    pub async fn cut_database_connections(&self) -> anyhow::Result<i64> {
        let cut: i64 = sqlx::query_scalar(
            "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND backend_type = 'client backend'",
        )
        .fetch_one(self.store().pool())
        .await?;
        Ok(cut)
    }

    /// Cuts the cluster's LISTEN connections only (named
    /// [`automesh_store::LISTEN_APPLICATION_NAME`]), as a proxy or a
    /// PostgreSQL backend crash would; returns how many.
    pub async fn cut_listen_connections(&self) -> anyhow::Result<i64> {
        let cut: i64 = sqlx::query_scalar(
            "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = $1",
        )
        .bind(automesh_store::LISTEN_APPLICATION_NAME)
        .fetch_one(self.store().pool())
        .await?;
        Ok(cut)
    }

    /// A bearer token for `user` of `org`.
    pub fn token(&self, org: &str, user: &str) -> String {
        automesh_gateway::mint(JWT_SECRET, org, user, chrono::Duration::hours(2)).expect("mint")
    }

    /// A public-API channel to every gateway replica, presenting `token`.
    pub fn channel(&self, token: &str) -> ClusterChannel {
        tonic::service::interceptor::InterceptedService::new(
            automesh_rpc::client::replicas(&self.addrs(Kind::Gateway)).expect("gateway addresses"),
            Bearer::new(token),
        )
    }

    pub fn automations(&self, token: &str) -> AutomationsClient<ClusterChannel> {
        AutomationsClient::new(self.channel(token))
    }

    pub fn runs(&self, token: &str) -> RunsClient<ClusterChannel> {
        RunsClient::new(self.channel(token))
    }

    /// Mints a runner token for `user` of `org` through the public API and
    /// starts a desktop runner process with it (native engine, the
    /// cluster's provider and Connect endpoint, every runner-gateway
    /// replica); returns its index.
    pub async fn add_runner(&mut self, org: &str, user: &str) -> anyhow::Result<usize> {
        let minted = self
            .automations(&self.token(org, user))
            .create_runner_token(pb::CreateRunnerTokenRequest {
                runner_name: format!("runner-{}", self.runners.len()),
            })
            .await?
            .into_inner();
        let index = self.runners.len();
        self.runners.push(RunnerProc {
            token: minted.token,
            state_dir: self.dir.join(format!("runner-{index}")),
            child: None,
        });
        self.spawn_runner(index)?;
        Ok(index)
    }

    fn spawn_runner(&mut self, index: usize) -> anyhow::Result<()> {
        let log = self.dir.join(format!("runner-{index}.log"));
        let r = &self.runners[index];
        let mut command = Command::new(&self.bin);
        command.arg("runner");
        self.base_env(&mut command);
        let child = command
            .env("AUTOMESH_RUNNER_GATEWAY", self.addrs(Kind::RunnerGateway))
            .env("AUTOMESH_RUNNER_TOKEN", &r.token)
            .env("AUTOMESH_RUNNER_STATE_DIR", &r.state_dir)
            .env("AUTOMESH_PROVIDER_URL", &self.spec.provider_url)
            .env("AUTOMESH_PROVIDER_API_KEY", &self.spec.provider_key)
            .env("AUTOMESH_CONNECT_URL", &self.spec.connect_url)
            .env("AUTOMESH_CONNECT_TOKEN", &self.spec.connect_token)
            .args(["--dead-after", "4s", "--reconnect-max", "1s"])
            .stdin(Stdio::null())
            .stdout(log_file(&log)?)
            .stderr(log_file(&log)?)
            .spawn()
            .context("start a runner")?;
        self.runners[index].child = Some(child);
        Ok(())
    }

    /// How many runners the cluster has.
    pub fn runner_count(&self) -> usize {
        self.runners.len()
    }

    /// The process id of a running runner.
    pub fn runner_pid(&self, index: usize) -> Option<u32> {
        self.runners[index].child.as_ref().map(Child::id)
    }

    /// Kills a runner with SIGKILL.
    pub fn kill_runner(&mut self, index: usize) {
        if let Some(mut child) = self.runners[index].child.take() {
            automesh_rpc::process::signal(child.id(), Signal::CONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a runner again with its token and state (after a kill).
    pub fn restart_runner(&mut self, index: usize) -> anyhow::Result<()> {
        self.kill_runner(index);
        self.spawn_runner(index)
    }

    /// A runner's log.
    pub fn runner_log(&self, index: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("runner-{index}.log"))).unwrap_or_default()
    }

    /// The pid of each live worker agent, by worker id (from the pid file
    /// each agent keeps in its directory).
    pub fn live_agents(&self) -> BTreeMap<String, u32> {
        let mut live = BTreeMap::new();
        let Ok(entries) = std::fs::read_dir(self.workers_dir()) else {
            return live;
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            let pid = std::fs::read_to_string(dir.join(automesh_rpc::process::PID_FILE))
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok());
            if let Some(pid) = pid
                && automesh_rpc::process::alive(pid)
                && automesh_rpc::process::works_in(pid, &dir)
            {
                live.insert(entry.file_name().to_string_lossy().into_owned(), pid);
            }
        }
        live
    }

    /// The log of a worker's agent.
    pub fn agent_log(&self, worker_id: &str) -> String {
        std::fs::read_to_string(self.workers_dir().join(worker_id).join("agent.log"))
            .unwrap_or_default()
    }

    /// Every log the cluster wrote (services, runners, agents), for scans.
    pub fn all_logs(&self) -> String {
        let mut all = String::new();
        let mut read = |dir: &Path| {
            if let Ok(entries) = std::fs::read_dir(dir) {
                for e in entries.flatten() {
                    let p = e.path();
                    if p.extension().is_some_and(|x| x == "log") {
                        all.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
                    }
                }
            }
        };
        read(&self.dir);
        if let Ok(entries) = std::fs::read_dir(self.workers_dir()) {
            for e in entries.flatten() {
                read(&e.path());
            }
        }
        all
    }

    /// Stops every process (SIGTERM, then SIGKILL after a bound), every
    /// agent, and removes the database and — unless `keep_logs` — the
    /// cluster's directory.
    pub async fn stop(mut self, keep_logs: bool) -> anyhow::Result<()> {
        let mut pids = vec![];
        for r in &mut self.runners {
            if let Some(c) = r.child.take() {
                pids.push(c);
            }
        }
        for p in self.procs.values_mut() {
            if let Some(c) = p.child.take() {
                pids.push(c);
            }
        }
        for c in &pids {
            automesh_rpc::process::signal(c.id(), Signal::CONT);
            automesh_rpc::process::signal(c.id(), Signal::TERM);
        }
        let give_up = std::time::Instant::now() + Duration::from_secs(20);
        for mut c in pids {
            loop {
                if c.try_wait().ok().flatten().is_some() {
                    break;
                }
                if std::time::Instant::now() >= give_up {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        for pid in self.live_agents().values() {
            automesh_rpc::process::terminate(*pid, Duration::from_secs(2)).await;
        }
        if let Some(db) = self.db.take() {
            db.remove().await?;
        }
        if keep_logs || std::env::var_os("AUTOMESH_CLUSTER_KEEP_LOGS").is_some() {
            eprintln!("cluster logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        Ok(())
    }
}

impl Drop for Cluster {
    /// A cluster the test did not stop (it failed) leaves nothing running;
    /// its logs stay for reading.
    fn drop(&mut self) {
        let mut any = false;
        for child in self
            .procs
            .values_mut()
            .filter_map(|p| p.child.take())
            .chain(self.runners.iter_mut().filter_map(|r| r.child.take()))
        {
            any = true;
            let mut child = child;
            automesh_rpc::process::signal(child.id(), Signal::CONT);
            let _ = child.kill();
            let _ = child.wait();
        }
        for pid in self.live_agents().values() {
            automesh_rpc::process::signal(*pid, Signal::CONT);
            automesh_rpc::process::signal(*pid, Signal::KILL);
        }
        if any {
            eprintln!("cluster logs kept in {}", self.dir.display());
        }
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
