//! `automesh worker-agent` as a command: the agent's flags, its hold on its
//! state directory (one agent per worker), and the process around
//! [`serve`](crate::serve): the `listening on` line its driver reads,
//! shutdown on SIGTERM and SIGINT, telemetry flushed on the way out.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use automesh_domain::Secret;
use tokio::net::TcpListener;

use crate::{DualCredential, Settings, serve};

/// Holds the agent's state directory for this process: an exclusive lock on
/// `agent.lock` (released when the process ends, however it ends) and the
/// process id in `agent.pid`, so its lifecycle can stop it from any replica.
#[derive(Debug)]
pub struct StateDir {
    _lock: std::fs::File,
}

/// The lock file of an agent's state directory.
pub const LOCK_FILE: &str = "agent.lock";
/// The file an agent writes its process id to.
pub use automesh_rpc::process::PID_FILE;

impl StateDir {
    /// Takes the state directory, or fails naming it when another live
    /// agent holds it.
    pub fn take(dir: &std::path::Path) -> anyhow::Result<StateDir> {
        std::fs::create_dir_all(dir)?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(LOCK_FILE))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
                "another worker agent holds {}; one agent per worker",
                dir.display()
            ),
            Err(std::fs::TryLockError::Error(e)) => return Err(e.into()),
        }
        let pid = dir.join(PID_FILE);
        let tmp = dir.join(format!("{PID_FILE}.tmp"));
        std::fs::write(&tmp, format!("{}\n", std::process::id()))?;
        std::fs::rename(&tmp, &pid)?;
        Ok(StateDir { _lock: lock })
    }
}

/// `automesh worker-agent`: started inside a cloud worker by its driver.
/// Prints `listening on http://<addr>` once it serves.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[arg(long, env = "AUTOMESH_AGENT_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The collaborator token every call must present (Bearer).
    #[arg(long, env = "AUTOMESH_AGENT_COLLABORATOR_TOKEN", hide_env_values = true)]
    pub collaborator_token: Secret,
    /// The internal host credential every call must present.
    #[arg(long, env = "AUTOMESH_AGENT_HOST_CREDENTIAL", hide_env_values = true)]
    pub host_credential: Secret,
    #[command(flatten)]
    pub provider: automesh_engine::ProviderFlags,
    /// Where the agent keeps its MCP registrations.
    #[arg(long, env = "AUTOMESH_AGENT_STATE_DIR", default_value = ".")]
    pub state_dir: PathBuf,
    /// Exit after this long without a call from the lifecycle service.
    #[arg(
        long,
        env = "AUTOMESH_AGENT_ORPHAN_AFTER",
        default_value = "60s",
        value_parser = automesh_domain::parse_duration
    )]
    pub orphan_after: Duration,
    /// The process that started this agent (its local-process driver): the
    /// agent dies with it (Linux `PR_SET_PDEATHSIG`, SIGTERM), and exits at
    /// once if it is already gone.
    #[arg(long, env = "AUTOMESH_AGENT_PARENT_PID")]
    pub parent_pid: Option<u32>,
}

/// Asks the kernel to send this process SIGTERM when its parent dies; an
/// error when the parent is not `parent` any more (it died before the ask).
fn die_with(parent: u32) -> anyhow::Result<()> {
    use rustix::process::{Signal, getppid, set_parent_process_death_signal};
    set_parent_process_death_signal(Some(Signal::TERM))?;
    let now = getppid().map(|p| p.as_raw_nonzero().get() as u32);
    anyhow::ensure!(
        now == Some(parent),
        "the process that started this agent ({parent}) is gone; exiting"
    );
    Ok(())
}

impl Args {
    pub async fn execute(self) -> anyhow::Result<()> {
        let _telemetry = automesh_telemetry::init("automesh-worker-agent")?;
        if let Some(parent) = self.parent_pid {
            die_with(parent)?;
        }
        let _state = StateDir::take(&self.state_dir)?;
        let listener = TcpListener::bind(self.listen).await?;
        // The one line the driver reads; the agent writes nothing else to
        // stdout (its logs go to stderr), so a reader that is gone costs it
        // nothing.
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "listening on http://{}", listener.local_addr()?);
            let _ = out.flush();
        }
        let shutdown = automesh_rpc::runtime::shutdown_on_signal();
        serve(
            Settings {
                provider: self.provider,
                state_dir: self.state_dir,
                orphan_after: Some(self.orphan_after),
            },
            DualCredential::new(
                self.collaborator_token.expose(),
                self.host_credential.expose(),
            ),
            listener,
            shutdown,
        )
        .await
    }
}
