//! The Docker driver: each worker is a container of a configured image,
//! driven through the Docker Engine API over its unix socket
//! (`/var/run/docker.sock`): create (once; the container and its files —
//! such as the agent's MCP registrations — persist across stops), start,
//! inspect until running with its agent port published on loopback, stop.
//!
//! Every request is bounded. No socket → `runtime_missing`; no image →
//! `runtime_missing`; a container that exits → `runtime_failed`.

use std::path::PathBuf;
use std::time::Duration;

use automesh_domain::ErrorCode;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};

use crate::driver::{WorkerDriver, WorkerLaunch};
use automesh_domain::CodedError;

/// Bound on one Engine API request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The port the agent listens on inside the container.
pub const AGENT_PORT: u16 = 50070;

/// Runs workers as Docker containers.
#[derive(Debug, Clone)]
pub struct DockerDriver {
    pub socket: PathBuf,
    pub image: String,
    pub provider_url: String,
    /// Redacted in `Debug`.
    pub provider_key: automesh_domain::Secret,
    pub engine: crate::driver::EngineSettings,
}

fn container_name(worker_id: &str) -> String {
    format!("automesh-worker-{worker_id}")
}

impl DockerDriver {
    /// One Engine API call: (status, JSON body or Null).
    /// A POST without a body.
    async fn post(&self, path: &str) -> Result<(u16, Value), CodedError> {
        self.call(http::Method::POST, path, None).await
    }

    async fn call(
        &self,
        method: http::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), CodedError> {
        let exchange = async {
            let stream = tokio::net::UnixStream::connect(&self.socket)
                .await
                .map_err(|e| {
                    CodedError::new(
                        ErrorCode::RuntimeMissing,
                        format!("no container runtime at {}: {e}", self.socket.display()),
                    )
                })?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(|e| {
                        CodedError::new(ErrorCode::RuntimeFailed, format!("Engine API: {e}"))
                    })?;
            tokio::spawn(connection);
            let bytes = body.map(|b| b.to_string()).unwrap_or_default();
            let request = http::Request::builder()
                .method(method)
                .uri(format!("http://docker/v1.43{path}"))
                .header("host", "docker")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(bytes)))
                .map_err(|e| CodedError::new(ErrorCode::RuntimeFailed, e.to_string()))?;
            let response = sender.send_request(request).await.map_err(|e| {
                CodedError::new(ErrorCode::RuntimeFailed, format!("Engine API: {e}"))
            })?;
            let status = response.status().as_u16();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| {
                    CodedError::new(ErrorCode::RuntimeFailed, format!("Engine API body: {e}"))
                })?
                .to_bytes();
            let value = if body.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&body).unwrap_or(Value::Null)
            };
            Ok((status, value))
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| {
                CodedError::new(
                    ErrorCode::RuntimeFailed,
                    format!("Engine API {path} timed out"),
                )
            })?
    }

    fn create_body(&self, launch: &WorkerLaunch) -> Value {
        let port = format!("{AGENT_PORT}/tcp");
        let mut env = vec![
            format!(
                "AUTOMESH_AGENT_COLLABORATOR_TOKEN={}",
                launch.collaborator_token
            ),
            format!("AUTOMESH_AGENT_HOST_CREDENTIAL={}", launch.host_credential),
            format!("AUTOMESH_PROVIDER_URL={}", self.provider_url),
            format!("AUTOMESH_PROVIDER_API_KEY={}", self.provider_key.expose()),
        ];
        env.extend(
            self.engine
                .env()
                .into_iter()
                .chain(crate::driver::telemetry_env(&launch.worker_id))
                .map(|(k, v)| format!("{k}={v}")),
        );
        json!({
            "Image": self.image,
            "Cmd": ["worker-agent", "--listen", format!("0.0.0.0:{AGENT_PORT}"), "--state-dir", "/var/lib/automesh"],
            "Env": env,
            "Labels": {"automesh.worker": launch.worker_id},
            "ExposedPorts": {port.clone(): {}},
            "HostConfig": {
                "PortBindings": {port: [{"HostIp": "127.0.0.1", "HostPort": ""}]},
                "RestartPolicy": {"Name": "no"}
            }
        })
    }
}

#[tonic::async_trait]
impl WorkerDriver for DockerDriver {
    fn name(&self) -> &'static str {
        "docker"
    }

    async fn start(&self, launch: &WorkerLaunch, within: Duration) -> Result<String, CodedError> {
        let give_up = tokio::time::Instant::now() + within;
        let name = container_name(&launch.worker_id);
        let (status, body) = self
            .call(
                http::Method::POST,
                &format!("/containers/create?name={name}"),
                Some(self.create_body(launch)),
            )
            .await?;
        match status {
            201 => {}
            // It exists from an earlier start: start it again.
            409 => {}
            404 => {
                return Err(CodedError::new(
                    ErrorCode::RuntimeMissing,
                    format!("the worker image {} is not available", self.image),
                ));
            }
            s => {
                return Err(CodedError::new(
                    ErrorCode::RuntimeFailed,
                    format!(
                        "creating the worker container failed ({s}): {}",
                        body["message"]
                    ),
                ));
            }
        }
        let (status, body) = self.post(&format!("/containers/{name}/start")).await?;
        if !matches!(status, 204 | 304) {
            return Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                format!(
                    "starting the worker container failed ({status}): {}",
                    body["message"]
                ),
            ));
        }
        let mut backoff = Duration::from_millis(50);
        loop {
            let (status, c) = self
                .call(http::Method::GET, &format!("/containers/{name}/json"), None)
                .await?;
            if status == 200 {
                let state = &c["State"];
                if state["Status"] == "exited" || state["Status"] == "dead" {
                    return Err(CodedError::new(
                        ErrorCode::RuntimeFailed,
                        format!("the worker container exited (code {})", state["ExitCode"]),
                    ));
                }
                let port = &c["NetworkSettings"]["Ports"][format!("{AGENT_PORT}/tcp")][0];
                if state["Running"] == true
                    && let Some(host_port) = port["HostPort"].as_str().filter(|p| !p.is_empty())
                {
                    let host = port["HostIp"]
                        .as_str()
                        .filter(|h| !h.is_empty() && *h != "0.0.0.0")
                        .unwrap_or("127.0.0.1");
                    return Ok(format!("http://{host}:{host_port}"));
                }
            }
            if tokio::time::Instant::now() + backoff >= give_up {
                return Err(CodedError::new(
                    ErrorCode::ReadinessTimeout,
                    format!("the worker container was not running within {within:?}"),
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    async fn stop(&self, worker_id: &str) -> Result<(), CodedError> {
        let name = container_name(worker_id);
        let (status, body) = self.post(&format!("/containers/{name}/stop?t=10")).await?;
        match status {
            204 | 304 | 404 => Ok(()),
            s => Err(CodedError::new(
                ErrorCode::RuntimeFailed,
                format!(
                    "stopping the worker container failed ({s}): {}",
                    body["message"]
                ),
            )),
        }
    }
}
