//! `automesh runner`: the reference desktop runner as a command.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use automesh_domain::Secret;
use automesh_domain::parse_duration;
use automesh_engine::adapter::{EngineAdapter, NativeEngine};
use automesh_engine::opencode::{OpenCodeConfig, OpenCodeEngine, OpenCodeServer, PolicyBook};

use crate::{Runner, Settings};

/// Which engine runs the assignments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    /// The native engine: an OpenAI-compatible provider plus the two Connect
    /// MCP tools.
    Native,
    /// A local OpenCode server (`opencode serve`), attached to with
    /// --opencode-url or started with --opencode-bin, under the headless
    /// permission policy of --permission-policy.
    Opencode,
}

/// Connects to the desktop-runner-gateway with a runner token and runs the
/// owner's desktop runs on this machine.
///
/// Mint a token with `automesh ctl runner-token --name <name>`. Runs the runner
/// accepted are recorded in --state-dir before they start, so a restart
/// never runs one twice.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The desktop-runner-gateway to connect to; several (comma-separated)
    /// are tried in turn on each reconnection.
    #[arg(
        long,
        env = "AUTOMESH_RUNNER_GATEWAY",
        default_value = "http://127.0.0.1:50052",
        value_delimiter = ','
    )]
    pub gateway: Vec<String>,
    /// The runner token (`amr_…`); prefer the environment variable.
    #[arg(long, env = "AUTOMESH_RUNNER_TOKEN", hide_env_values = true)]
    pub token: Secret,
    /// Where the record of accepted runs is kept.
    #[arg(long, env = "AUTOMESH_RUNNER_STATE_DIR", default_value = ".automesh/runner")]
    pub state_dir: PathBuf,
    /// The engine that executes runs.
    #[arg(long, value_enum, default_value = "native")]
    pub engine: EngineKind,
    /// Silence from the gateway after which the stream is declared dead.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub dead_after: Duration,
    /// The largest pause between reconnection attempts.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub reconnect_max: Duration,
    #[command(flatten)]
    pub provider: automesh_engine::ProviderFlags,
    /// Native engine: the Connect (MCP) endpoint serving the owner's tools.
    #[arg(long, env = "AUTOMESH_CONNECT_URL", default_value = "")]
    pub connect_url: String,
    /// Native engine: the Connect bearer token.
    #[arg(long, env = "AUTOMESH_CONNECT_TOKEN", hide_env_values = true, default_value = "")]
    pub connect_token: Secret,
    /// OpenCode: attach to this running server (such as http://127.0.0.1:4096).
    #[arg(long, env = "AUTOMESH_OPENCODE_URL", conflicts_with = "opencode_bin")]
    pub opencode_url: Option<String>,
    /// OpenCode: start this `opencode` binary (`opencode serve`) as a child.
    #[arg(long, env = "AUTOMESH_OPENCODE_BIN")]
    pub opencode_bin: Option<PathBuf>,
    /// OpenCode: the project directory the agent works in.
    #[arg(long, env = "AUTOMESH_OPENCODE_DIR", default_value = ".")]
    pub opencode_dir: PathBuf,
    /// OpenCode: the server's password (HTTP Basic, user `opencode`); a
    /// started server gets a random one when unset.
    #[arg(long, env = "AUTOMESH_OPENCODE_PASSWORD", hide_env_values = true)]
    pub opencode_password: Option<Secret>,
    /// OpenCode: the headless permission policy (JSON; see
    /// docs/permission-policy.md). Without it every prompt is rejected.
    #[arg(long, env = "AUTOMESH_PERMISSION_POLICY")]
    pub permission_policy: Option<PathBuf>,
    /// OpenCode: time without progress of a session before it is ended.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
}

/// Reads a permission policy document.
pub fn read_policy(path: &std::path::Path) -> anyhow::Result<PolicyBook> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!("cannot read the permission policy {}: {e}", path.display())
    })?;
    serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("the permission policy {} is not valid: {e}", path.display()))
}

/// The native engine as the flags configure it.
pub fn native_engine(args: &Args) -> NativeEngine {
    NativeEngine::from_flags(
        &args.provider,
        &args.connect_url,
        args.connect_token.expose(),
    )
}

impl Args {
    pub async fn execute(self) -> anyhow::Result<()> {
        let _telemetry = automesh_telemetry::init("automesh-runner")?;
        let mut _server = None;
        let engine: Arc<dyn EngineAdapter> = match self.engine {
            EngineKind::Native => Arc::new(native_engine(&self)),
            EngineKind::Opencode => {
                let policies = match &self.permission_policy {
                    Some(p) => read_policy(p)?,
                    None => PolicyBook::default(),
                };
                let password = self
                    .opencode_password
                    .as_ref()
                    .map(|p| p.expose().to_owned());
                let (url, password) = match (&self.opencode_url, &self.opencode_bin) {
                    (Some(url), _) => (url.clone(), password),
                    (None, Some(bin)) => {
                        let password =
                            password.unwrap_or_else(|| automesh_rpc::runtime::random_secret("oc_"));
                        let env = vec![("OPENCODE_SERVER_PASSWORD".to_owned(), password.clone())];
                        eprintln!("automesh runner: starting {} serve", bin.display());
                        let server = OpenCodeServer::start(
                            bin,
                            &self.opencode_dir,
                            &env,
                            Duration::from_secs(60),
                        )
                        .await
                        .map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
                        let url = server.base_url.clone();
                        _server = Some(server);
                        (url, Some(password))
                    }
                    (None, None) => anyhow::bail!(
                        "--engine opencode needs --opencode-url (attach) or --opencode-bin (start)"
                    ),
                };
                let mut config = OpenCodeConfig::new(url);
                config.password = password.map(Secret::from);
                config.idle_timeout = self.idle_timeout;
                Arc::new(OpenCodeEngine { config, policies })
            }
        };
        let mut settings = Settings::new(
            self.gateway.clone(),
            self.token.clone(),
            self.state_dir.clone(),
        );
        settings.dead_after = self.dead_after;
        settings.reconnect_max = self.reconnect_max;
        let runner = Runner::new(settings, engine)?;
        eprintln!(
            "automesh runner: connecting to {} (engine {}, record in {})",
            self.gateway.join(", "),
            runner.engine.engine_id(),
            self.state_dir.display()
        );
        // SIGTERM as well as SIGINT: the runner stops its engines, and its
        // spans are flushed when `_telemetry` drops on the way out.
        let shutdown = automesh_rpc::runtime::shutdown_on_signal();
        runner.run(shutdown).await;
        Ok(())
    }
}
