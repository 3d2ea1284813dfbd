//! Worker drivers: how a per-user cloud worker is started and stopped.
//!
//! `LocalProcessDriver` (the default; `dev` mode and the tests) runs the
//! worker agent as a child process with a scrubbed environment — nothing of
//! the service's own environment leaks in, only what the agent needs — in
//! its own 0700 working directory, on its own loopback port. Stopping kills
//! it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use automesh_domain::ErrorCode;
use tokio::io::AsyncBufReadExt;

/// Why a worker could not be started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct DriverError {
    pub code: ErrorCode,
    pub message: String,
}

impl DriverError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

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
    async fn start(&self, launch: &WorkerLaunch, within: Duration) -> Result<String, DriverError>;
    /// Stops the worker (idempotent).
    async fn stop(&self, worker_id: &str) -> Result<(), DriverError>;
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
    pub provider_key: automesh_rpc::auth::Secret,
    children: Mutex<HashMap<String, tokio::process::Child>>,
    starts: std::sync::atomic::AtomicUsize,
}

impl LocalProcessDriver {
    pub fn new(
        command: Vec<String>,
        root: PathBuf,
        provider_url: String,
        provider_key: automesh_rpc::auth::Secret,
    ) -> Self {
        Self {
            command,
            root,
            provider_url,
            provider_key,
            children: Mutex::default(),
            starts: Default::default(),
        }
    }

    /// How many worker processes this driver has started.
    pub fn starts(&self) -> usize {
        self.starts.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn workdir(&self, worker_id: &str) -> Result<PathBuf, DriverError> {
        let safe = !worker_id.is_empty()
            && worker_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !safe {
            return Err(DriverError::new(
                ErrorCode::RuntimeFailed,
                "unsafe worker id",
            ));
        }
        let dir = self.root.join(worker_id);
        let failed = |e: std::io::Error| {
            DriverError::new(ErrorCode::RuntimeFailed, format!("worker directory: {e}"))
        };
        std::fs::create_dir_all(&dir).map_err(failed)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(failed)?;
        }
        Ok(dir)
    }
}

#[tonic::async_trait]
impl WorkerDriver for LocalProcessDriver {
    fn name(&self) -> &'static str {
        "local-process"
    }

    async fn start(&self, launch: &WorkerLaunch, within: Duration) -> Result<String, DriverError> {
        let Some((program, args)) = self.command.split_first() else {
            return Err(DriverError::new(
                ErrorCode::RuntimeMissing,
                "no worker agent command configured",
            ));
        };
        let dir = self.workdir(&launch.worker_id)?;
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
                "AUTOMESH_AGENT_COLLABORATOR_TOKEN",
                &launch.collaborator_token,
            )
            .env("AUTOMESH_AGENT_HOST_CREDENTIAL", &launch.host_credential)
            .env("AUTOMESH_PROVIDER_URL", &self.provider_url)
            .env("AUTOMESH_PROVIDER_API_KEY", self.provider_key.expose())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file(&dir))
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                ErrorCode::RuntimeMissing
            } else {
                ErrorCode::RuntimeFailed
            };
            DriverError::new(code, format!("cannot start the worker agent: {e}"))
        })?;
        let stdout = child.stdout.take();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(1);
        if let Some(stdout) = stdout {
            let log = dir.join(AGENT_LOG);
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut lines = tokio::io::BufReader::new(stdout).lines();
                let mut tx = Some(tx);
                let mut file = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .await
                    .ok();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Some(url) = line.strip_prefix("listening on ")
                        && let Some(t) = tx.take()
                    {
                        let _ = t.send(url.trim().to_owned()).await;
                    }
                    if let Some(f) = file.as_mut() {
                        let _ = f.write_all(format!("{line}\n").as_bytes()).await;
                    }
                }
            });
        }
        let endpoint = tokio::time::timeout(within, rx.recv()).await;
        match endpoint {
            Ok(Some(url)) => {
                if let Ok(mut children) = self.children.lock()
                    && let Some(mut old) = children.insert(launch.worker_id.clone(), child)
                {
                    let _ = old.start_kill();
                }
                Ok(url)
            }
            Ok(None) => {
                let status = child.wait().await.ok();
                Err(DriverError::new(
                    ErrorCode::RuntimeFailed,
                    format!("the worker agent exited before it listened ({status:?})"),
                ))
            }
            Err(_) => {
                let _ = child.start_kill();
                Err(DriverError::new(
                    ErrorCode::ReadinessTimeout,
                    format!("the worker did not become ready within {within:?}"),
                ))
            }
        }
    }

    async fn stop(&self, worker_id: &str) -> Result<(), DriverError> {
        let child = self
            .children
            .lock()
            .ok()
            .and_then(|mut c| c.remove(worker_id));
        if let Some(mut child) = child {
            let _ = child.kill().await;
        }
        Ok(())
    }
}
