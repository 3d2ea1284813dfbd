//! A headless `opencode serve` started as a child process in an isolated
//! HOME, killed when dropped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use automesh_domain::ErrorCode;
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;

use automesh_domain::CodedError;

/// A `opencode serve` child process, killed when dropped.
#[derive(Debug)]
pub struct OpenCodeServer {
    pub base_url: String,
    child: tokio::process::Child,
}

impl OpenCodeServer {
    /// Starts `binary serve` in `directory` on a free loopback port with
    /// `env` added, and waits (bounded by `ready_timeout`) until it says
    /// where it listens.
    pub async fn start(
        binary: &Path,
        directory: &Path,
        env: &[(String, String)],
        ready_timeout: Duration,
    ) -> Result<OpenCodeServer, CodedError> {
        let missing = |e: std::io::Error| {
            CodedError::new(
                ErrorCode::RuntimeMissing,
                format!("cannot start OpenCode ({}): {e}", binary.display()),
            )
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(missing)?
            .port();
        let mut child = tokio::process::Command::new(binary)
            .args([
                "serve",
                "--hostname",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .current_dir(directory)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(missing)?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        if let Some(stderr) = stderr {
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::debug!(target: "opencode", "{line}");
                }
            });
        }
        let Some(stdout) = stdout else {
            return Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode has no stdout",
            ));
        };
        let (tx, mut rx) = mpsc::channel::<String>(1);
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            let mut tx = Some(tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(at) = line.find("listening on ")
                    && let Some(t) = tx.take()
                {
                    let _ = t
                        .send(line[at + "listening on ".len()..].trim().to_owned())
                        .await;
                }
                tracing::debug!(target: "opencode", "{line}");
            }
        });
        match tokio::time::timeout(ready_timeout, rx.recv()).await {
            Ok(Some(url)) => Ok(OpenCodeServer {
                base_url: url,
                child,
            }),
            Ok(None) => Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                "OpenCode exited before it listened",
            )),
            Err(_) => {
                let _ = child.start_kill();
                Err(CodedError::new(
                    ErrorCode::ReadinessTimeout,
                    format!("OpenCode did not listen within {ready_timeout:?}"),
                ))
            }
        }
    }

    /// Kills the server at once.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// The isolated environment a headless OpenCode is started with: its own
/// HOME and XDG directories under `root`, updates, sharing and downloads off,
/// and the config (JSON) inline.
pub fn isolated_env(root: &Path, config_json: &str) -> Vec<(String, String)> {
    let home: PathBuf = root.join("home");
    let p = |sub: &str| home.join(sub).to_string_lossy().into_owned();
    vec![
        ("HOME".into(), home.to_string_lossy().into_owned()),
        ("XDG_CONFIG_HOME".into(), p(".config")),
        ("XDG_DATA_HOME".into(), p(".local/share")),
        ("XDG_CACHE_HOME".into(), p(".cache")),
        ("XDG_STATE_HOME".into(), p(".local/state")),
        ("OPENCODE_DISABLE_AUTOUPDATE".into(), "1".into()),
        ("OPENCODE_DISABLE_MODELS_FETCH".into(), "1".into()),
        ("OPENCODE_DISABLE_SHARE".into(), "1".into()),
        ("OPENCODE_DISABLE_LSP_DOWNLOAD".into(), "1".into()),
        ("OPENCODE_DISABLE_CLAUDE_CODE".into(), "1".into()),
        ("OPENCODE_CONFIG_CONTENT".into(), config_json.into()),
    ]
}
