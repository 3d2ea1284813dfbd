//! Worker drivers: how a per-user cloud worker is started and stopped.
//!
//! `LocalProcessDriver` (the default; `dev` mode and the tests) runs the
//! worker agent as a child process with a scrubbed environment — nothing of
//! the service's own environment leaks in, only what the agent needs — in
//! its own 0700 working directory, on its own loopback port.
//!
//! Any replica on the host can stop any worker's agent, not only the one
//! that started it: the agent writes its pid into its directory
//! (`agent.pid`), and a pid is trusted only while that process works in
//! that directory. Stopping is SIGTERM, then SIGKILL after a grace period.
//! Starting first stops a previous agent of the worker, so a worker never
//! has two. An agent dies with the replica that started it (Linux
//! `PR_SET_PDEATHSIG`; `AUTOMESH_AGENT_DIES_WITH_LIFECYCLE`), or, when that
//! is off, another replica adopts it and it exits by itself after its
//! orphan bound (no call from any lifecycle for that long).

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use automesh_domain::{CodedError, ErrorCode};
use tokio::io::AsyncBufReadExt;

/// What a started worker needs to know.
#[derive(Clone)]
pub struct WorkerLaunch {
    pub worker_id: String,
    /// The collaborator token and host credential it must require.
    pub collaborator_token: String,
    pub host_credential: String,
}

impl std::fmt::Debug for WorkerLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerLaunch")
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

/// Starts and stops workers.
#[tonic::async_trait]
pub trait WorkerDriver: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    /// Starts the worker; returns its agent endpoint (`http://…`) once it
    /// listens, within `within`.
    async fn start(&self, launch: &WorkerLaunch, within: Duration) -> Result<String, CodedError>;
    /// Stops the worker (idempotent).
    async fn stop(&self, worker_id: &str) -> Result<(), CodedError>;
}

/// What an agent needs of this service's telemetry configuration, so its
/// spans join the runs' traces and its logs take the same form: every
/// standard `OTEL_*` variable and `AUTOMESH_LOG_FORMAT` — except this
/// service's own identity (the agent names itself `automesh-worker-agent`,
/// with its own instance id, and carries its worker's id).
pub fn telemetry_env(worker_id: &str) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            (k.starts_with("OTEL_") && k != "OTEL_SERVICE_NAME" && k != "OTEL_RESOURCE_ATTRIBUTES")
                || k == "AUTOMESH_LOG_FORMAT"
        })
        .collect();
    let mut attributes: Vec<String> = std::env::var("OTEL_RESOURCE_ATTRIBUTES")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|kv| {
            !kv.is_empty()
                && !kv.starts_with("service.name=")
                && !kv.starts_with("service.instance.id=")
        })
        .map(str::to_owned)
        .collect();
    attributes.push(format!("automesh.worker.id={worker_id}"));
    env.push(("OTEL_RESOURCE_ATTRIBUTES".into(), attributes.join(",")));
    env
}

/// The file in a worker's directory its agent's output goes to.
pub const AGENT_LOG: &str = "agent.log";

fn log_file(dir: &std::path::Path) -> Stdio {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(AGENT_LOG))
        .map_or_else(|_| Stdio::null(), Stdio::from)
}

/// How long a stopped agent gets to exit on SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The native engine's settings every worker agent is started with, the
/// same knobs a desktop runner has (`automesh runner --request-timeout
/// --stream --max-steps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSettings {
    /// Bound on one provider request.
    pub request_timeout: Duration,
    /// Streaming completions.
    pub stream: bool,
    /// The agent loop's step limit.
    pub max_steps: u32,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(120),
            stream: false,
            max_steps: 32,
        }
    }
}

impl EngineSettings {
    /// The agent's environment variables carrying these settings.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (
                "AUTOMESH_PROVIDER_REQUEST_TIMEOUT".into(),
                format!("{}ms", self.request_timeout.as_millis()),
            ),
            ("AUTOMESH_PROVIDER_STREAM".into(), self.stream.to_string()),
            ("AUTOMESH_MAX_STEPS".into(), self.max_steps.to_string()),
        ]
    }
}

/// Runs worker agents as child processes of this service.
#[derive(Debug)]
pub struct LocalProcessDriver {
    /// The program and leading arguments that run the agent, such as
    /// `["/usr/bin/automesh", "worker-agent"]`.
    pub command: Vec<String>,
    /// Where each worker's working directory is created.
    pub root: PathBuf,
    /// The model provider the agents use.
    pub provider_url: String,
    /// Redacted in `Debug`.
    pub provider_key: automesh_domain::Secret,
    /// An agent that hears from no lifecycle for this long exits.
    pub orphan_after: Duration,
    /// Each agent dies with the process that started it (Linux
    /// `PR_SET_PDEATHSIG`): a stopped or killed lifecycle (a developer's
    /// Ctrl-C of `dev`) leaves no agent behind. Off, an agent outlives its
    /// starter and another replica on the host adopts it (until the orphan
    /// bound ends it).
    pub die_with_parent: bool,
    pub engine: EngineSettings,
    /// The pid of each worker's agent this process started.
    children: Mutex<HashMap<String, u32>>,
    starts: std::sync::atomic::AtomicUsize,
}

impl LocalProcessDriver {
    pub fn new(
        command: Vec<String>,
        root: PathBuf,
        provider_url: String,
        provider_key: automesh_domain::Secret,
    ) -> Self {
        Self {
            command,
            root,
            provider_url,
            provider_key,
            orphan_after: Duration::from_secs(60),
            die_with_parent: true,
            engine: EngineSettings::default(),
            children: Mutex::default(),
            starts: Default::default(),
        }
    }

    /// The same, with agents that exit after `bound` without a call.
    pub fn with_orphan_after(mut self, bound: Duration) -> Self {
        self.orphan_after = bound;
        self
    }

    /// The same, with agents that die with this process (or not).
    pub fn with_die_with_parent(mut self, on: bool) -> Self {
        self.die_with_parent = on;
        self
    }

    /// The same, with agents whose engine runs with `engine`.
    pub fn with_engine(mut self, engine: EngineSettings) -> Self {
        self.engine = engine;
        self
    }

    /// How many worker processes this driver has started.
    pub fn starts(&self) -> usize {
        self.starts.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn workdir(&self, worker_id: &str) -> Result<PathBuf, CodedError> {
        let safe = !worker_id.is_empty()
            && worker_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !safe {
            return Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "unsafe worker id",
            ));
        }
        let dir = self.root.join(worker_id);
        let failed = |e: std::io::Error| {
            CodedError::new(ErrorCode::RuntimeFailed, format!("worker directory: {e}"))
        };
        std::fs::create_dir_all(&dir).map_err(failed)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(failed)?;
        }
        std::fs::canonicalize(&dir).map_err(failed)
    }

    /// Stops the worker's agent, whoever started it — the one this process
    /// started, the one whose pid file the directory holds (another
    /// replica's, or one a dead process left), and anything else working in
    /// the worker's directory (a wrapper about to exec an agent) — trusting
    /// a pid only while that process works in the directory. True once none
    /// lives.
    async fn stop_agent(&self, worker_id: &str, dir: &std::path::Path) -> bool {
        let own = self.children.lock().get(worker_id).copied();
        let recorded = std::fs::read_to_string(dir.join(automesh_rpc::process::PID_FILE))
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok());
        let mut pids: Vec<u32> = [own, recorded]
            .into_iter()
            .flatten()
            .filter(|pid| {
                automesh_rpc::process::alive(*pid) && automesh_rpc::process::works_in(*pid, dir)
            })
            .collect();
        pids.extend(automesh_rpc::process::working_in(dir));
        pids.sort_unstable();
        pids.dedup();
        let mut stopped = true;
        for pid in pids {
            tracing::info!(worker_id, pid, "stopping the worker agent");
            stopped &= automesh_rpc::process::terminate(pid, STOP_GRACE).await;
        }
        let mut c = self.children.lock();
        if own.is_some() && c.get(worker_id) == own.as_ref() {
            c.remove(worker_id);
        }
        stopped
    }
}

#[tonic::async_trait]
impl WorkerDriver for LocalProcessDriver {
    fn name(&self) -> &'static str {
        "local-process"
    }

    async fn start(&self, launch: &WorkerLaunch, within: Duration) -> Result<String, CodedError> {
        let Some((program, args)) = self.command.split_first() else {
            return Err(CodedError::new(
                ErrorCode::RuntimeMissing,
                "no worker agent command configured",
            ));
        };
        let dir = self.workdir(&launch.worker_id)?;
        // One agent per worker: a previous one (hung, or left behind by a
        // replica that died) goes first.
        if !self.stop_agent(&launch.worker_id, &dir).await {
            return Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "a previous agent of the worker could not be stopped",
            ));
        }
        self.starts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut command = tokio::process::Command::new(program);
        command
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .current_dir(&dir)
            // Scrubbed: only what the agent needs.
            .env_clear()
            .env("HOME", &dir)
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env(
                "RUST_LOG",
                std::env::var("AUTOMESH_WORKER_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("AUTOMESH_AGENT_STATE_DIR", &dir)
            .env(
                "AUTOMESH_AGENT_ORPHAN_AFTER",
                format!("{}ms", self.orphan_after.as_millis()),
            )
            .env(
                "AUTOMESH_AGENT_COLLABORATOR_TOKEN",
                &launch.collaborator_token,
            )
            .env("AUTOMESH_AGENT_HOST_CREDENTIAL", &launch.host_credential)
            .env("AUTOMESH_PROVIDER_URL", &self.provider_url)
            .env("AUTOMESH_PROVIDER_API_KEY", self.provider_key.expose())
            .envs(self.engine.env())
            .envs(telemetry_env(&launch.worker_id))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file(&dir));
        if self.die_with_parent {
            // The agent asks the kernel for SIGTERM when this process dies
            // (and exits at once if it already has). Linux ties that signal
            // to the thread that spawned the child: this runs on a runtime
            // worker thread, which lives as long as the runtime (nothing
            // here moves work onto blocking threads that expire).
            command.env("AUTOMESH_AGENT_PARENT_PID", std::process::id().to_string());
        }
        let mut child = command.spawn().map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                ErrorCode::RuntimeMissing
            } else {
                ErrorCode::RuntimeFailed
            };
            CodedError::new(code, format!("cannot start the worker agent: {e}"))
        })?;
        let pid = child.id().unwrap_or_default();
        let stdout = child.stdout.take();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(1);
        if let Some(stdout) = stdout {
            tokio::spawn(async move {
                // Only the first line matters; the agent writes nothing else.
                let mut lines = tokio::io::BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Some(url) = line.strip_prefix("listening on ") {
                        let _ = tx.send(url.trim().to_owned()).await;
                        break;
                    }
                }
            });
        }
        // Reaped as soon as it exits, however it is stopped. When this
        // process ends, the agent ends with it (`die_with_parent`), or other
        // replicas adopt it and its orphan bound ends it otherwise.
        let (exited_tx, exited) = tokio::sync::oneshot::channel();
        let worker_id = launch.worker_id.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            tracing::info!(worker_id, pid, status = ?status.ok(), "worker agent exited");
            let _ = exited_tx.send(());
        });
        let endpoint = tokio::select! {
            url = rx.recv() => url,
            _ = exited => None,
            () = tokio::time::sleep(within) => {
                automesh_rpc::process::terminate(pid, STOP_GRACE).await;
                return Err(CodedError::new(
                    ErrorCode::ReadinessTimeout,
                    format!("the worker did not become ready within {within:?}"),
                ));
            }
        };
        match endpoint {
            Some(url) => {
                self.children.lock().insert(launch.worker_id.clone(), pid);
                Ok(url)
            }
            None => Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "the worker agent exited before it listened (see its agent.log)",
            )),
        }
    }

    async fn stop(&self, worker_id: &str) -> Result<(), CodedError> {
        let dir = self.workdir(worker_id)?;
        if self.stop_agent(worker_id, &dir).await {
            Ok(())
        } else {
            Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "the worker agent did not stop",
            ))
        }
    }
}
