//! The Docker driver against a fake Docker Engine that speaks the Engine API
//! over a real unix socket (this machine has no Docker engine). The fake
//! "runs" a container by starting the real worker agent binary with the
//! container's command and environment, and publishes its port on loopback.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automesh_cloud_worker_lifecycle::docker::{AGENT_PORT, DockerDriver};
use automesh_cloud_worker_lifecycle::driver::{WorkerDriver, WorkerLaunch};
use automesh_domain::automation::NewAutomation;
use automesh_domain::{ErrorCode, Principal, RunState, Schedule, Surface, WorkerState};
use automesh_e2e_tests::{CloudOptions, Mesh, MeshOptions, lifecycle_config};
use automesh_store::Backend;
use automesh_testkit::{Reply, provider, text_completion};
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use chrono::Utc;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

const IMAGE: &str = "automesh/worker:test";

#[derive(Default)]
struct Container {
    env: Vec<String>,
    cmd: Vec<String>,
    process: Option<tokio::process::Child>,
    port: Option<String>,
    dir: PathBuf,
}

#[derive(Clone, Default)]
struct Engine {
    containers: Arc<Mutex<HashMap<String, Container>>>,
    calls: Arc<Mutex<Vec<String>>>,
    root: PathBuf,
}

impl Engine {
    fn log(&self, call: String) {
        self.calls.lock().expect("lock").push(call);
    }
}

async fn create(
    State(e): State<Engine>,
    Query(q): Query<HashMap<String, String>>,
    axum::Json(body): axum::Json<Value>,
) -> (StatusCode, axum::Json<Value>) {
    let name = q.get("name").cloned().unwrap_or_default();
    e.log(format!("create {name}"));
    if body["Image"] != IMAGE {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"message": format!("No such image: {}", body["Image"])})),
        );
    }
    let mut containers = e.containers.lock().expect("lock");
    if containers.contains_key(&name) {
        return (
            StatusCode::CONFLICT,
            axum::Json(json!({"message": "Conflict. The container name is already in use"})),
        );
    }
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let dir = e.root.join(&name);
    std::fs::create_dir_all(&dir).expect("container fs");
    containers.insert(
        name.clone(),
        Container {
            env: strings(&body["Env"]),
            cmd: strings(&body["Cmd"]),
            dir,
            ..Default::default()
        },
    );
    (StatusCode::CREATED, axum::Json(json!({"Id": name})))
}

async fn start(State(e): State<Engine>, Path(name): Path<String>) -> StatusCode {
    e.log(format!("start {name}"));
    let (env, cmd, dir) = {
        let containers = e.containers.lock().expect("lock");
        let Some(c) = containers.get(&name) else {
            return StatusCode::NOT_FOUND;
        };
        if c.process.is_some() {
            return StatusCode::NOT_MODIFIED;
        }
        (c.env.clone(), c.cmd.clone(), c.dir.clone())
    };
    // The image's entrypoint is `automesh`: run the agent with the
    // container's arguments, its port published on an ephemeral host port,
    // its state directory inside the container's filesystem.
    assert_eq!(cmd.first().map(String::as_str), Some("worker-agent"));
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_automesh-worker-agent"))
        .args(["--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&dir)
        .env_clear()
        .envs(env.iter().filter_map(|kv| kv.split_once('=')))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("run the container's process");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let port = loop {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("the agent listens")
            .expect("read")
            .expect("line");
        if let Some(url) = line.strip_prefix("listening on http://") {
            break url.rsplit(':').next().unwrap_or_default().to_owned();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let mut containers = e.containers.lock().expect("lock");
    if let Some(c) = containers.get_mut(&name) {
        c.process = Some(child);
        c.port = Some(port);
    }
    StatusCode::NO_CONTENT
}

async fn inspect(
    State(e): State<Engine>,
    Path(name): Path<String>,
) -> (StatusCode, axum::Json<Value>) {
    let containers = e.containers.lock().expect("lock");
    let Some(c) = containers.get(&name) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"message": "No such container"})),
        );
    };
    let running = c.process.is_some();
    let ports = match &c.port {
        Some(p) => json!({format!("{AGENT_PORT}/tcp"): [{"HostIp": "127.0.0.1", "HostPort": p}]}),
        None => json!({}),
    };
    (
        StatusCode::OK,
        axum::Json(json!({
            "Id": name,
            "State": {"Running": running, "Status": if running { "running" } else { "created" }},
            "NetworkSettings": {"Ports": ports}
        })),
    )
}

async fn stop(State(e): State<Engine>, Path(name): Path<String>) -> StatusCode {
    e.log(format!("stop {name}"));
    let child = {
        let mut containers = e.containers.lock().expect("lock");
        let Some(c) = containers.get_mut(&name) else {
            return StatusCode::NOT_FOUND;
        };
        c.port = None;
        c.process.take()
    };
    match child {
        Some(mut child) => {
            let _ = child.kill().await;
            StatusCode::NO_CONTENT
        }
        None => StatusCode::NOT_MODIFIED,
    }
}

async fn fake_engine() -> (PathBuf, Engine) {
    let root = std::env::temp_dir().join(format!(
        "automesh-fake-docker-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&root).expect("root");
    let socket = root.join("docker.sock");
    let engine = Engine {
        root: root.clone(),
        ..Engine::default()
    };
    let app = Router::new()
        .route("/v1.43/containers/create", post(create))
        .route("/v1.43/containers/{name}/start", post(start))
        .route("/v1.43/containers/{name}/json", get(inspect))
        .route("/v1.43/containers/{name}/stop", post(stop))
        .with_state(engine.clone());
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind the socket");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (socket, engine)
}

fn driver(socket: PathBuf, image: &str, provider_url: &str) -> DockerDriver {
    DockerDriver {
        socket,
        image: image.into(),
        provider_url: provider_url.into(),
        provider_key: "sk-docker-provider-key".into(),
        engine: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloud_run_wakes_a_container_worker_and_idle_stop_stops_it() {
    let (provider_url, fake) =
        provider(|_, _| Reply::Json(text_completion("from the container"))).await;
    let (mcp_url, _mcp) = automesh_testkit::connect("docker-connect-token").await;
    let (socket, engine) = fake_engine().await;
    let mesh = Mesh::start_with(
        Backend::Postgres,
        MeshOptions {
            cloud: Some(CloudOptions {
                driver: Arc::new(driver(socket, IMAGE, &provider_url)),
                config: {
                    let mut c = lifecycle_config();
                    c.readiness_cap = Duration::from_secs(30);
                    c.idle_after = Duration::from_secs(2);
                    c.idle_check = Duration::from_millis(300);
                    c.worker.connect_url = Some(mcp_url);
                    c.worker.connect_token = "docker-connect-token".to_owned().into();
                    c
                },
            }),
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh");
    let owner = Principal::new("acme", "dora");
    let worker = mesh
        .store()
        .register_worker(&owner, "docker", Utc::now())
        .await
        .expect("worker");
    let at = Utc::now() + chrono::Duration::seconds(1);
    mesh.store()
        .create_automation(
            &NewAutomation {
                pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
                budget: Default::default(),
                monthly_budget_micros: None,
                id: "in-docker".into(),
                owner: owner.clone(),
                name: "docker".into(),
                prompt: "p".into(),
                model: "fake/echo".into(),
                surface: Surface::Web,
                schedule: Schedule::Once { at },
            },
            Some(at),
            Utc::now(),
        )
        .await
        .expect("automation");
    let run_id = automesh_domain::ids::scheduled_run_id("in-docker", at);
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    let run = loop {
        if let Ok(run) = mesh.store().internal().get_run(&run_id).await
            && run.state.is_terminal()
        {
            break run;
        }
        assert!(tokio::time::Instant::now() < give_up, "the run did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(run.state, RunState::Succeeded, "{run:?}");
    assert_eq!(fake.calls(), 1);
    // Idle stop stops the container.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while mesh
        .store()
        .get_worker(&owner)
        .await
        .expect("read")
        .expect("worker")
        .state
        != WorkerState::Stopped
    {
        assert!(
            tokio::time::Instant::now() < give_up,
            "the worker was never stopped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let name = format!("automesh-worker-{}", worker.id);
    assert_eq!(
        *engine.calls.lock().expect("lock"),
        vec![
            format!("create {name}"),
            format!("start {name}"),
            format!("stop {name}")
        ]
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_or_runtime_is_runtime_missing_and_a_restart_reuses_the_container() {
    let (socket, engine) = fake_engine().await;
    let launch = WorkerLaunch {
        worker_id: "w-1".into(),
        collaborator_token: "collab".into(),
        host_credential: "host".into(),
    };
    let missing_image = driver(socket.clone(), "no/such:image", "http://127.0.0.1:9/v1");
    let err = missing_image
        .start(&launch, Duration::from_secs(5))
        .await
        .expect_err("no image");
    assert_eq!(err.code, ErrorCode::RuntimeMissing, "{err}");
    let no_runtime = driver(
        socket.with_file_name("absent.sock"),
        IMAGE,
        "http://127.0.0.1:9/v1",
    );
    let err = no_runtime
        .start(&launch, Duration::from_secs(5))
        .await
        .expect_err("no runtime");
    assert_eq!(err.code, ErrorCode::RuntimeMissing, "{err}");

    let d = driver(socket, IMAGE, "http://127.0.0.1:9/v1");
    let first = d
        .start(&launch, Duration::from_secs(20))
        .await
        .expect("start");
    assert!(first.starts_with("http://127.0.0.1:"), "{first}");
    d.stop("w-1").await.expect("stop");
    d.stop("w-1").await.expect("stopping twice is fine");
    let again = d
        .start(&launch, Duration::from_secs(20))
        .await
        .expect("start again");
    assert!(again.starts_with("http://127.0.0.1:"));
    let calls = engine.calls.lock().expect("lock").clone();
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.starts_with("create automesh-worker-w-1"))
            .count(),
        3,
        "the missing-image attempt, the first start, and the restart's 409: {calls:?}"
    );
    d.stop("w-1").await.expect("stop");
}
