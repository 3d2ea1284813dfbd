//! `automesh dev` as a real child process, driven by a client that knows
//! nothing but server reflection: grpcurl.
//!
//! grpcurl is found through `AUTOMESH_GRPCURL`, then `.tools/venv/bin/grpcurl`
//! (installed by `scripts/test`), then `PATH`. Without it the test fails: it
//! never skips.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn grpcurl() -> PathBuf {
    if let Ok(p) = std::env::var("AUTOMESH_GRPCURL") {
        return PathBuf::from(p);
    }
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/grpcurl");
    if local.exists() {
        return local;
    }
    let found = Command::new("sh")
        .args(["-c", "command -v grpcurl"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim().to_owned()));
    found.expect("grpcurl not found: run scripts/test once (it installs it into .tools/), or set AUTOMESH_GRPCURL")
}

struct Dev {
    child: Child,
    data_dir: PathBuf,
    /// The desktop runners' gateway, `http://…`.
    runners: String,
    /// Everything it printed up to `ready`.
    banner: Vec<String>,
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

fn grpc(tool: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(tool)
        .args(["-max-time", "20"])
        .args(args)
        .output()
        .expect("run grpcurl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn json_field(json: &str, key: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("not JSON ({e}): {json}"));
    v.pointer(key)
        .and_then(|x| x.as_str())
        .unwrap_or_else(|| panic!("no {key} in {json}"))
        .to_owned()
}

/// Starts `automesh dev` on ephemeral ports with `env`, waits (bounded) for
/// `ready`, and returns it with the gateway address and the printed token.
fn start_dev(name: &str, env: &[(&str, String)]) -> (Dev, String, String) {
    start_dev_with(name, env, &[], false)
}

/// The same, with more arguments, and (`clean`) with nothing of this
/// process's environment: exactly what a fresh shell would give it.
fn start_dev_with(
    name: &str,
    env: &[(&str, String)],
    extra: &[&str],
    clean: bool,
) -> (Dev, String, String) {
    let data_dir =
        std::env::temp_dir().join(format!("automesh-dev-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data_dir);
    let mut command = Command::new(env!("CARGO_BIN_EXE_automesh"));
    if clean {
        command.env_clear();
    }
    let mut child = command
        .arg("dev")
        .arg("--data-dir")
        .arg(&data_dir)
        .args([
            "--gateway-listen",
            "127.0.0.1:0",
            "--runner-gateway-listen",
            "127.0.0.1:0",
            "--runner-gateway-internal-listen",
            "127.0.0.1:0",
            "--scheduler-listen",
            "127.0.0.1:0",
            "--coordinator-listen",
            "127.0.0.1:0",
            "--lifecycle-listen",
            "127.0.0.1:0",
            "--console-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start automesh dev");
    let stdout = child.stdout.take().expect("stdout");
    let mut dev = Dev {
        child,
        data_dir,
        runners: String::new(),
        banner: vec![],
    };

    // Read the banner on a thread, so the wait for it is bounded.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut gateway = None;
    let mut token = None;
    let mut expect_token = false;
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("automesh dev printed `ready` within 60 s");
        dev.banner.push(line.clone());
        if expect_token {
            token = Some(line.trim().to_owned());
            expect_token = false;
        } else if line.trim_start().starts_with("public gateway") {
            gateway = line
                .split_whitespace()
                .find(|w| w.starts_with("http://"))
                .map(|w| w.trim_start_matches("http://").to_owned());
        } else if line.trim_start().starts_with("desktop runners") {
            dev.runners = line
                .split_whitespace()
                .find(|w| w.starts_with("http://"))
                .unwrap_or_default()
                .to_owned();
        } else if line.starts_with("development token") {
            expect_token = true;
        } else if line.trim() == "ready" {
            break;
        }
    }
    let gateway = gateway.expect("gateway address printed");
    let token = token.expect("token printed");
    let on_disk = std::fs::read_to_string(dev.data_dir.join("dev-token")).expect("dev-token file");
    assert_eq!(on_disk.trim(), token);
    (dev, gateway, token)
}

#[test]
fn grpcurl_with_reflection_drives_the_dev_mesh() {
    let tool = grpcurl();
    let (dev, gateway, token) = start_dev("grpcurl", &[]);
    let auth = format!("authorization: Bearer {token}");

    let (ok, listing) = grpc(&tool, &["-plaintext", &gateway, "list"]);
    assert!(ok, "{listing}");
    for service in [
        "automesh.v1.Automations",
        "automesh.v1.Notifications",
        "automesh.v1.Runs",
        "grpc.health.v1.Health",
    ] {
        assert!(
            listing.lines().any(|l| l.trim() == service),
            "{service} missing from:\n{listing}"
        );
    }

    let create = r#"{"automation":{"name":"from grpcurl","prompt":"say hello","model":"fake/echo",
        "schedule":{"daily":{"timeOfDay":{"hours":9,"minutes":15},"timeZone":"Europe/Paris"}}},
        "surface":"SURFACE_DESKTOP"}"#;
    let (ok, created) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            create,
            &gateway,
            "automesh.v1.Automations/CreateAutomation",
        ],
    );
    assert!(ok, "{created}");
    let id = json_field(&created, "/automation/id");
    let etag = json_field(&created, "/automation/etag");

    let (ok, listed) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            "{}",
            &gateway,
            "automesh.v1.Automations/ListAutomations",
        ],
    );
    assert!(ok, "{listed}");
    assert!(listed.contains(&id), "{listed}");

    let update = format!(
        r#"{{"automation":{{"id":"{id}","name":"renamed by grpcurl","etag":"{etag}"}},"updateMask":{{"paths":["name"]}}}}"#
    );
    let (ok, updated) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            &update,
            &gateway,
            "automesh.v1.Automations/UpdateAutomation",
        ],
    );
    assert!(ok, "{updated}");
    assert_eq!(
        json_field(&updated, "/automation/name"),
        "renamed by grpcurl"
    );

    // The same stale etag again: ABORTED, and grpcurl can read the status.
    let (ok, stale) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            &auth,
            "-d",
            &update,
            &gateway,
            "automesh.v1.Automations/UpdateAutomation",
        ],
    );
    assert!(!ok && stale.contains("Aborted"), "{stale}");
    // No token: UNAUTHENTICATED.
    let (ok, anonymous) = grpc(
        &tool,
        &[
            "-plaintext",
            "-d",
            "{}",
            &gateway,
            "automesh.v1.Automations/ListAutomations",
        ],
    );
    assert!(!ok && anonymous.contains("Unauthenticated"), "{anonymous}");

    // The runner listener (served by the lean HTTP/2 connection, not
    // hyper's) to grpc-go's client: reflection, health, and a Connect
    // stream whose token is refused with a status grpcurl can read.
    let runners = dev.runners.trim_start_matches("http://").to_owned();
    let (ok, listing) = grpc(&tool, &["-plaintext", &runners, "list"]);
    assert!(ok, "{listing}");
    for service in [
        "automesh.runner.v1.DesktopRunnerService",
        "grpc.health.v1.Health",
    ] {
        assert!(
            listing.lines().any(|l| l.trim() == service),
            "{service} missing from:\n{listing}"
        );
    }
    let (ok, described) = grpc(
        &tool,
        &[
            "-plaintext",
            &runners,
            "describe",
            "automesh.runner.v1.ConnectRequest",
        ],
    );
    assert!(ok && described.contains("hello"), "{described}");
    let (ok, health) = grpc(
        &tool,
        &[
            "-plaintext",
            "-d",
            "{}",
            &runners,
            "grpc.health.v1.Health/Check",
        ],
    );
    assert!(ok && health.contains("SERVING"), "{health}");
    let (ok, refused) = grpc(
        &tool,
        &[
            "-plaintext",
            "-H",
            "authorization: Bearer not-a-runner-token",
            "-d",
            r#"{"hello":{"runnerVersion":"grpcurl"}}"#,
            &runners,
            "automesh.runner.v1.DesktopRunnerService/Connect",
        ],
    );
    assert!(
        !ok && refused.contains("Unauthenticated")
            && refused.contains("unknown or revoked runner token"),
        "{refused}"
    );

    // SIGTERM drains and exits on its own, bounded.
    let pid = dev.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success()
    );
    let mut dev = dev;
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = dev.child.try_wait().expect("wait") {
            assert!(status.success(), "automesh dev exited with {status}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "automesh dev did not stop within 30 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_are_exported_over_otlp_and_one_trace_crosses_the_services() {
    use automesh_proto::v1 as pb;
    use automesh_proto::v1::automations_client::AutomationsClient;

    // The harness's fake collector: the real OTLP/gRPC services on loopback.
    let collector = automesh_e2e_tests::otlp::Receiver::start()
        .await
        .expect("collector");
    let endpoint = collector.endpoint.clone();
    let (dev, gateway, token) = tokio::task::spawn_blocking(move || {
        start_dev(
            "otlp",
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
                ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
                // Bounded either way: the dev runner runs it against the
                // demo model, or its deadline ends it.
                ("AUTOMESH_DEV_RUN_DEADLINE", "2s".to_owned()),
            ],
        )
    })
    .await
    .expect("start");

    let channel = automesh_rpc::client::channel(&format!("http://{gateway}")).expect("channel");
    let mut api = AutomationsClient::new(channel);
    let created = api
        .create_automation(automesh_e2e_tests::with_bearer(
            &token,
            daily_automation(
                "traced",
                "p",
                "fake/echo",
                pb::Surface::Desktop,
                (7, 0, "UTC"),
            ),
        ))
        .await
        .expect("create")
        .into_inner()
        .automation
        .expect("automation");

    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let mut request = automesh_e2e_tests::with_bearer(
        &token,
        pb::RunAutomationNowRequest {
            id: created.id,
            idempotency_key: "otlp".into(),
        },
    );
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-b7ad6b7169203331-01")
            .parse()
            .expect("ascii"),
    );
    let run = api
        .run_automation_now(request)
        .await
        .expect("run now")
        .into_inner()
        .run
        .expect("run");
    assert_eq!(run.trace_id, trace_id);

    // Both hops of the call, and the coordinator's span of the run, arrive
    // at the collector in the caller's trace.
    let wanted = [
        "/automesh.v1.Automations/RunAutomationNow",
        "/automesh.scheduler.v1.SchedulerService/RunAutomationNow",
        "automesh.run",
    ];
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let seen = collector.spans();
        let in_trace: Vec<&str> = seen
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .map(|s| s.name.as_str())
            .collect();
        if wanted.iter().all(|w| in_trace.contains(w)) {
            break;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "spans of trace {trace_id} not all exported within 30 s; saw {in_trace:?} (all: {} spans)",
            seen.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(dev);
}

/// The reference runner as a real process: killed with SIGKILL while its
/// engine waits on the model, then started again on the same record. The
/// run it had accepted ends `runner_interrupted`; the prompt reached the
/// model once; nothing secret reached its logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_process_killed_mid_run_never_runs_it_again_after_a_restart() {
    use automesh_proto::v1 as pb;
    use automesh_testkit::{Reply, provider, text_completion};

    const PROVIDER_KEY: &str = "sk-provider-key-never-logged";
    const MCP_TOKEN: &str = "connect-token-never-logged";
    let (provider_url, fake) =
        provider(|_, _| Reply::Delayed(Duration::from_secs(30), text_completion("too late"))).await;
    let (mcp_url, _mcp) = automesh_testkit::connect(MCP_TOKEN).await;
    // This test's runner is the dev user's only one.
    let (dev, gateway, token) = start_dev_with("runner-kill", &[], &["--no-runner"], false);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{gateway}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut automations = pb::automations_client::AutomationsClient::new(channel.clone());
    let mut runs = pb::runs_client::RunsClient::new(channel);
    let runner_token = automations
        .create_runner_token(automesh_e2e_tests::with_bearer(
            &token,
            pb::CreateRunnerTokenRequest {
                runner_name: "laptop".into(),
            },
        ))
        .await
        .expect("runner token")
        .into_inner()
        .token;
    let state_dir = dev.data_dir.join("runner-state");
    let logs = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let start_runner = || {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_automesh"))
            .args(["runner", "--engine", "native", "--gateway", &dev.runners])
            .arg("--state-dir")
            .arg(&state_dir)
            .args(["--provider-url", &provider_url, "--connect-url", &mcp_url])
            .env("AUTOMESH_RUNNER_TOKEN", &runner_token)
            .env("AUTOMESH_PROVIDER_API_KEY", PROVIDER_KEY)
            .env("AUTOMESH_CONNECT_TOKEN", MCP_TOKEN)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start automesh runner");
        // Read both outputs as they come, so a chatty runner never blocks.
        for out in [
            child
                .stdout
                .take()
                .map(|o| Box::new(o) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|e| Box::new(e) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let logs = logs.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let mut l = logs.lock().expect("lock");
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        child
    };
    let mut first = start_runner();

    let automation = automations
        .create_automation(automesh_e2e_tests::with_bearer(
            &token,
            daily_automation(
                "desk",
                "tidy my downloads",
                "fake/echo",
                pb::Surface::Desktop,
                (9, 0, "UTC"),
            ),
        ))
        .await
        .expect("create")
        .into_inner()
        .automation
        .expect("automation");
    let run = runs_now(
        &mut automations,
        automesh_e2e_tests::with_bearer(
            &token,
            pb::RunAutomationNowRequest {
                id: automation.id,
                idempotency_key: "once".into(),
            },
        ),
    )
    .await;

    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    while fake.calls() == 0 {
        assert!(
            std::time::Instant::now() < give_up,
            "the runner never called the model"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill().expect("SIGKILL");
    let _ = first.wait();

    let mut second = start_runner();
    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    let ended = loop {
        let got = runs
            .get_run(automesh_e2e_tests::with_bearer(
                &token,
                pb::GetRunRequest { id: run.id.clone() },
            ))
            .await
            .expect("get run")
            .into_inner()
            .run
            .expect("run");
        if got.receipt.is_some() {
            break got;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "the run did not end: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let receipt = ended.receipt.expect("receipt");
    assert_eq!(receipt.outcome, pb::RunState::Failed as i32, "{receipt:?}");
    assert_eq!(receipt.error_code, "runner_interrupted", "{receipt:?}");
    assert_eq!(fake.calls(), 1, "the prompt reached the model once");
    second.kill().expect("kill");
    let _ = second.wait();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let logs = logs.lock().expect("lock").clone();
    assert!(
        logs.contains("runner connected"),
        "the runner logged: {logs}"
    );
    for secret in [PROVIDER_KEY, MCP_TOKEN, runner_token.as_str()] {
        assert!(!logs.contains(secret), "a secret reached the runner's logs");
    }
}

async fn runs_now(
    client: &mut automesh_proto::v1::automations_client::AutomationsClient<
        tonic::transport::Channel,
    >,
    request: tonic::Request<automesh_proto::v1::RunAutomationNowRequest>,
) -> automesh_proto::v1::Run {
    client
        .run_automation_now(request)
        .await
        .expect("run now")
        .into_inner()
        .run
        .expect("run")
}

/// A create request for a daily automation at (hours, minutes, time zone).
fn daily_automation(
    name: &str,
    prompt: &str,
    model: &str,
    surface: automesh_proto::v1::Surface,
    (hours, minutes, time_zone): (i32, i32, &str),
) -> automesh_proto::v1::CreateAutomationRequest {
    use automesh_proto::v1 as pb;
    pb::CreateAutomationRequest {
        automation: Some(pb::Automation {
            name: name.into(),
            prompt: prompt.into(),
            model: model.into(),
            schedule: Some(pb::Schedule {
                kind: Some(pb::schedule::Kind::Daily(pb::DailySchedule {
                    time_of_day: Some(pb::TimeOfDay { hours, minutes }),
                    time_zone: time_zone.into(),
                })),
            }),
            ..Default::default()
        }),
        surface: surface as i32,
    }
}

/// Every service checks its configuration before it serves: a bad setting
/// stops the real binary, naming the setting to fix (and not the good ones).
/// A coordinator with no executor, for one, would let every run time out at
/// its deadline.
#[test]
fn every_service_refuses_a_bad_configuration_before_it_serves() {
    let bad_models = std::env::temp_dir().join(format!("models-{}.json", std::process::id()));
    std::fs::write(&bad_models, r#"{"models": [{"id": "x", "colour": "red"}]}"#).expect("write");
    let bad_models = bad_models.to_string_lossy().into_owned();
    // (service, its environment, what the error names, what it must not)
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: &[Case] = &[
        (
            "run-coordinator",
            &[("AUTOMESH_DESKTOP_EXECUTOR_ADDR", "http://127.0.0.1:9")],
            "AUTOMESH_CLOUD_EXECUTOR_ADDR",
            "AUTOMESH_DESKTOP_EXECUTOR_ADDR",
        ),
        (
            "run-coordinator",
            &[
                ("AUTOMESH_DESKTOP_EXECUTOR_ADDR", "http://127.0.0.1:9"),
                ("AUTOMESH_CLOUD_EXECUTOR_ADDR", "http://127.0.0.1:9"),
                ("AUTOMESH_CLAIM_POLL", "0s"),
            ],
            "AUTOMESH_CLAIM_POLL",
            "AUTOMESH_RUN_LEASE",
        ),
        (
            "run-coordinator",
            &[("AUTOMESH_MODELS_FILE", &bad_models)],
            "invalid model catalogue",
            "EXECUTOR_ADDR",
        ),
        (
            "desktop-runner-gateway",
            &[("AUTOMESH_RUNNER_HEARTBEAT", "20s")],
            "AUTOMESH_RUNNER_HEARTBEAT",
            "AUTOMESH_RUNNER_ACCEPT_WITHIN",
        ),
        (
            "cloud-worker-lifecycle",
            &[("AUTOMESH_CLOUD_LEASE", "0s")],
            "AUTOMESH_CLOUD_LEASE",
            "AUTOMESH_READINESS_CAP",
        ),
        (
            "scheduler",
            &[("AUTOMESH_RUN_DEADLINE", "0s")],
            "AUTOMESH_RUN_DEADLINE",
            "AUTOMESH_CATCH_UP_WINDOW",
        ),
    ];
    let mut wrong = vec![];
    for (service, env, named, not_named) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_automesh"))
            .args([
                service,
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            .env_clear()
            .env("AUTOMESH_DATABASE_URL", "sqlite::memory:")
            .env("AUTOMESH_INTERNAL_TOKEN", "internal-token-of-this-test")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("run the service");
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !stderr.contains(named) || stderr.contains(not_named) {
            wrong.push(format!("{service} {env:?}: {:?}, {stderr}", out.status));
        }
    }
    let _ = std::fs::remove_file(&bad_models);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Issue 33: `automesh migrate` applies the schema once and says what it
/// did; a service started against a schema newer than it knows refuses to
/// start, naming both versions, and so does `migrate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_applies_once_and_a_newer_schema_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("automesh-migrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("m.db").display());
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_automesh"))
            .args(args)
            .env_clear()
            .env("AUTOMESH_DATABASE_URL", &url)
            .env("AUTOMESH_INTERNAL_TOKEN", "internal-token-of-this-test")
            .stdin(Stdio::null())
            .output()
            .expect("run automesh");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), said)
    };
    let (ok, said) = run(&["migrate"]);
    assert!(ok && said.contains("schema created at version"), "{said}");
    let store = automesh_store::Store::connect_lazy(&url, Default::default()).expect("store");
    let known = store.known_schema_version();
    assert_eq!(store.schema_version().await.expect("version"), Some(known));
    let (ok, said) = run(&["migrate"]);
    assert!(ok && said.contains("nothing to apply"), "{said}");

    // A newer binary migrated the database since.
    let ahead = known + 1;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO _sqlx_migrations (version, description, installed_on, success, checksum, \
         execution_time) VALUES ({ahead}, 'from the future', CURRENT_TIMESTAMP, TRUE, x'00', 0)"
    )))
    .execute(store.pool())
    .await
    .expect("a newer migration");
    store.close().await;
    let named = format!("schema is at version {ahead}, newer than this binary knows ({known})");
    let (ok, said) = run(&["migrate"]);
    assert!(!ok && said.contains(&named), "{said}");
    let service = [
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let (ok, said) = run(&service);
    assert!(!ok && said.contains(&named), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 33: a service never migrates. Started against an empty database
/// it does not serve (health NOT_SERVING) and says why by name, once; the
/// migration job (`automesh migrate`) runs; then it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_serves_only_once_the_migration_job_has_run() {
    let dir = std::env::temp_dir().join(format!("automesh-schema-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("s.db").display());
    let port = automesh_e2e_tests::free_port().expect("port");
    let log = dir.join("scheduler.log");
    let out = std::fs::File::create(&log).expect("log");
    let mut service = Command::new(env!("CARGO_BIN_EXE_automesh"))
        .args(["scheduler", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env_clear()
        .env("AUTOMESH_DATABASE_URL", &url)
        .env("AUTOMESH_INTERNAL_TOKEN", "internal-token-of-this-test")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .expect("start the scheduler");
    let addr = format!("http://127.0.0.1:{port}");
    automesh_e2e_tests::wait_for_health(&addr, Duration::from_secs(30), false)
        .await
        .expect("answering, NOT_SERVING");
    let named = "older than this binary knows";
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains(named)
    {
        assert!(
            std::time::Instant::now() < give_up,
            "no named refusal: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(said.contains("run `automesh migrate`"), "{said}");
    // Still not serving a while later, and said once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    automesh_e2e_tests::wait_for_health(&addr, Duration::from_secs(1), false)
        .await
        .expect("still NOT_SERVING");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(said.matches(named).count(), 1, "{said}");
    // Its loops wait for the schema it knows instead of failing each second.
    assert!(!said.contains("pass failed"), "{said}");
    let migrated = Command::new(env!("CARGO_BIN_EXE_automesh"))
        .arg("migrate")
        .env_clear()
        .env("AUTOMESH_DATABASE_URL", &url)
        .stdin(Stdio::null())
        .output()
        .expect("migrate");
    assert!(migrated.status.success(), "{migrated:?}");
    automesh_e2e_tests::wait_for_health(&addr, Duration::from_secs(30), true)
        .await
        .expect("SERVING once migrated");
    let _ = service.kill();
    let _ = service.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `automesh retention`, the operator's command: an organisation's own
/// retention set, listed, refused out of range and unset; a pass run now
/// says what it deleted; a database not migrated is named.
#[tokio::test]
async fn retention_is_set_per_organisation_and_a_pass_reports_what_it_deleted() {
    let dir = std::env::temp_dir().join(format!("automesh-retention-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("r.db").display());
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_automesh"))
            .arg("retention")
            .args(args)
            .env_clear()
            .env("AUTOMESH_DATABASE_URL", &url)
            .stdin(Stdio::null())
            .output()
            .expect("run automesh");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), said)
    };
    let (ok, said) = run(&["list"]);
    assert!(
        !ok && said.contains("version none (empty), older than this binary knows")
            && said.contains("run `automesh migrate`"),
        "{said}"
    );
    let store = automesh_store::Store::connect_and_migrate(&url, Default::default())
        .await
        .expect("migrate");
    let (ok, said) = run(&["set", "--org", "acme", "--days", "0"]);
    assert!(!ok && said.contains("--days"), "{said}");
    let (ok, said) = run(&["set", "--org", "acme", "--days", "365"]);
    assert!(
        ok && said.contains("acme keeps finished runs 365 days"),
        "{said}"
    );
    let (ok, said) = run(&["list"]);
    assert!(
        ok && said.contains("acme\t365 days") && said.contains("no pass has run yet"),
        "{said}"
    );
    let (ok, said) = run(&["run", "--days", "7"]);
    assert!(ok && said.contains("runs\t0 deleted"), "{said}");
    let (ok, said) = run(&["list"]);
    assert!(ok && said.contains("last pass finished"), "{said}");
    assert_eq!(
        store.internal().org_retentions().await.expect("read"),
        [("acme".to_owned(), 365)]
    );
    let (ok, said) = run(&["unset", "--org", "acme"]);
    assert!(
        ok && said.contains("follows the default retention again"),
        "{said}"
    );
    let (ok, said) = run(&["unset", "--org", "acme"]);
    assert!(ok && said.contains("nothing changed"), "{said}");
    store.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A newcomer's first run: the real `automesh dev` binary with an empty
/// environment — no provider, no Connect endpoint, no runner set up — and,
/// through the public API only, a web and a desktop automation run now. Both
/// succeed against the built-in demo model and demo Connect endpoint (the
/// web one in a cloud worker, the desktop one on dev's own runner), with
/// assistant text, two tool calls and their results, usage, and a receipt
/// that costs something and says the demo model served it. `automesh ctl
/// watch` shows one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_run_succeeds_out_of_the_box_on_both_placements() {
    use automesh_proto::v1 as pb;
    let (dev, gateway, token) =
        tokio::task::spawn_blocking(|| start_dev_with("first-run", &[], &[], true))
            .await
            .expect("start");
    let banner = dev.banner.join("\n");
    for label in ["model provider", "connect (MCP)", "desktop runner"] {
        assert!(banner.contains(label), "{label} in:\n{banner}");
    }
    assert_eq!(
        banner.matches("DEMO").count(),
        2,
        "both demos labelled:\n{banner}"
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{gateway}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut automations = pb::automations_client::AutomationsClient::new(channel.clone());
    let mut runs = pb::runs_client::RunsClient::new(channel);
    let mut started = vec![];
    for (name, surface, prompt) in [
        ("inbox", pb::Surface::Web, "summarise my unread inbox"),
        (
            "forecast",
            pb::Surface::Desktop,
            "what is the weather in Paris",
        ),
    ] {
        let automation = automations
            .create_automation(automesh_e2e_tests::with_bearer(
                &token,
                daily_automation(
                    name,
                    prompt,
                    "openai/gpt-4.1-mini",
                    surface,
                    (9, 30, "Europe/Paris"),
                ),
            ))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e:?}"))
            .into_inner()
            .automation
            .expect("automation");
        let run = automations
            .run_automation_now(automesh_e2e_tests::with_bearer(
                &token,
                pb::RunAutomationNowRequest {
                    id: automation.id.clone(),
                    idempotency_key: format!("first-{name}"),
                },
            ))
            .await
            .expect("run now")
            .into_inner()
            .run
            .expect("run");
        started.push((name, automation.placement, run.id));
    }
    assert_eq!(started[0].1, pb::Placement::Cloud as i32);
    assert_eq!(started[1].1, pb::Placement::Desktop as i32);

    for (name, _, run_id) in &started {
        let run = until_receipt(&mut runs, &token, run_id, Duration::from_secs(90)).await;
        assert_eq!(run.state, pb::RunState::Succeeded as i32, "{name}: {run:?}");
        let events = runs
            .list_run_events(automesh_e2e_tests::with_bearer(
                &token,
                pb::ListRunEventsRequest {
                    run_id: run_id.clone(),
                    after_sequence: 0,
                    page_size: 500,
                },
            ))
            .await
            .expect("events")
            .into_inner()
            .events;
        use pb::run_event::Payload;
        let calls: Vec<&pb::ToolCall> = events
            .iter()
            .filter_map(|e| match &e.payload {
                Some(Payload::ToolCall(c)) => Some(c),
                _ => None,
            })
            .collect();
        let results: Vec<&pb::ToolResult> = events
            .iter()
            .filter_map(|e| match &e.payload {
                Some(Payload::ToolResult(r)) => Some(r),
                _ => None,
            })
            .collect();
        let texts: Vec<&str> = events
            .iter()
            .filter_map(|e| match &e.payload {
                Some(Payload::AssistantText(t)) => Some(t.text.as_str()),
                _ => None,
            })
            .collect();
        let usage: Vec<&pb::Usage> = events
            .iter()
            .filter_map(|e| match &e.payload {
                Some(Payload::Usage(u)) => Some(u),
                _ => None,
            })
            .collect();
        assert_eq!(
            calls.iter().map(|c| c.tool.as_str()).collect::<Vec<_>>(),
            ["search_capabilities", "execute_capability"],
            "{name}: {events:?}"
        );
        assert_eq!(results.len(), 2, "{name}: {events:?}");
        assert!(results.iter().all(|r| !r.is_error && !r.output.is_empty()));
        assert!(
            results[1].output.contains("(demo data)"),
            "{name}: {results:?}"
        );
        assert!(
            texts.iter().any(|t| t.starts_with("[automesh demo model]")),
            "{name}: {texts:?}"
        );
        assert!(!usage.is_empty() && usage.iter().all(|u| u.cost_micros > 0));
        let receipt = run.receipt.expect("receipt");
        let total = receipt.usage.expect("usage");
        assert!(
            total.input_tokens > 0 && total.output_tokens > 0,
            "{receipt:?}"
        );
        assert!(total.cost_micros > 0, "{name}: {receipt:?}");
        assert_eq!(receipt.model, "openai/gpt-4.1-mini");
        assert_eq!(receipt.provider_model, "automesh-demo", "labelled as demo");
        assert!(receipt.price.is_some());
    }

    // `automesh ctl watch` replays the desktop run and prints its receipt.
    let watched = Command::new(env!("CARGO_BIN_EXE_automesh"))
        .args(["ctl", "watch", &started[1].2])
        .env("AUTOMESH_ADDR", format!("http://{gateway}"))
        .env("AUTOMESH_TOKEN", &token)
        .output()
        .expect("ctl watch");
    let out = String::from_utf8_lossy(&watched.stdout);
    assert!(watched.status.success(), "{out}");
    for want in [
        "tool call search_capabilities",
        "tool result execute_capability",
        "assistant: [automesh demo model]",
        "is succeeded",
        "receipt:",
        "asked of the provider as automesh-demo",
    ] {
        assert!(out.contains(want), "{want:?} in:\n{out}");
    }

    // Issue 33: a developer's Ctrl-C (SIGTERM) of dev after a cloud run
    // leaves no worker agent behind: it dies with dev, long before its
    // 60 s orphan bound.
    let agents: Vec<u32> = std::fs::read_dir(dev.data_dir.join("workers"))
        .expect("the workers' directories")
        .flatten()
        .filter_map(|e| {
            std::fs::read_to_string(e.path().join(automesh_rpc::process::PID_FILE)).ok()
        })
        .filter_map(|t| t.trim().parse().ok())
        .filter(|pid| automesh_rpc::process::alive(*pid))
        .collect();
    assert!(!agents.is_empty(), "the cloud run's agent is running");
    let mut dev = dev;
    let pid = dev.child.id().to_string();
    let term = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(term.success());
    let exited = tokio::task::spawn_blocking(move || {
        let status = dev.child.wait().expect("wait");
        (dev, status)
    });
    let (dev, status) = exited.await.expect("dev exits");
    assert!(status.success(), "automesh dev exited with {status}");
    for agent in agents {
        assert!(
            automesh_rpc::process::gone_within(agent, Duration::from_secs(20)).await,
            "worker agent {agent} outlived automesh dev"
        );
    }
    drop(dev);
}

/// `AUTOMESH_RUNNER_HTTP2=hyper` (or `--runner-http2 hyper`) serves the dev
/// mesh's runner listener with hyper's HTTP/2 instead of the lean one: the
/// banner says which, and the dev runner, connected through it, runs a
/// desktop run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dev_runner_listener_can_be_served_by_hyper() {
    use automesh_proto::v1 as pb;
    let (dev, gateway, token) = tokio::task::spawn_blocking(|| {
        start_dev(
            "hyper-runners",
            &[("AUTOMESH_RUNNER_HTTP2", "hyper".into())],
        )
    })
    .await
    .expect("start");
    let banner = dev.banner.join("\n");
    assert!(
        banner
            .lines()
            .any(|l| l.contains("desktop runners") && l.contains("(HTTP/2: hyper)")),
        "{banner}"
    );
    let run = desktop_run_to_its_end(&gateway, &token, "over-hyper", Duration::from_secs(90)).await;
    assert_eq!(run.state, pb::RunState::Succeeded as i32, "{run:?}");
    drop(dev);
}

/// The README's quick start is what the binary does: its commands exist and
/// take the flags it shows (they are run, in order, against a real `automesh
/// dev` with an empty environment), and where the README shows output, the
/// binary prints exactly that, up to ids, times, ports, tokens and the data
/// directory (and the live state lines of `ctl watch`, which depend on when
/// it attaches; its last one is kept).
#[test]
fn the_readme_quick_start_is_what_the_binary_prints() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md");
    let start = readme.find("## Quick start").expect("a quick start");
    let end = readme[start..]
        .find("\n## ")
        .map_or(readme.len(), |i| start + i);
    let blocks = code_blocks(&readme[start..end]);
    assert!(blocks.len() >= 4, "{blocks:?}");
    assert!(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../scripts/test")
            .exists(),
        "the quick start's test command exists"
    );

    let (dev, gateway, _token) = start_dev_with("readme", &[], &[], true);
    let data_dir = dev.data_dir.display().to_string();
    let ctl = |args: &[String]| {
        let out = Command::new(env!("CARGO_BIN_EXE_automesh"))
            .env_clear()
            .args(args)
            .env("AUTOMESH_ADDR", format!("http://{gateway}"))
            .env("AUTOMESH_DATA_DIR", &dev.data_dir)
            .output()
            .expect("run the README's command");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "`automesh {}` failed: {}{}",
            args.join(" "),
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    // `ctl watch` as the README shows it, run again once the run has ended:
    // a watch attached after the end prints the same, the end last.
    let mut watch_again = None;
    let mut ids: std::collections::BTreeMap<String, String> = Default::default();
    let mut compared = 0;
    let mut ran = 0;
    let mut i = 0;
    while i < blocks.len() {
        let (lang, body) = &blocks[i];
        let expected = blocks
            .get(i + 1)
            .filter(|(l, _)| l == "text")
            .map(|(_, b)| b.clone());
        i += if expected.is_some() { 2 } else { 1 };
        if lang != "sh" {
            continue;
        }
        let commands: Vec<Vec<String>> = body
            .lines()
            .map(|l| l.split(" #").next().unwrap_or_default().trim())
            .filter_map(|l| {
                l.strip_prefix("cargo run -p automesh -- ")
                    .or_else(|| l.strip_prefix("automesh "))
            })
            .map(shell_words)
            .collect();
        if expected.is_some() {
            assert_eq!(commands.len(), 1, "one command before shown output: {body}");
        }
        for args in commands {
            let output = if args[0] == "dev" {
                dev.banner.join("\n")
            } else {
                let args: Vec<String> = args
                    .iter()
                    .map(
                        |a| match a.strip_prefix('<').and_then(|a| a.strip_suffix(" id>")) {
                            Some(name) => ids
                                .get(name)
                                .unwrap_or_else(|| panic!("no {name} id yet for {a}"))
                                .clone(),
                            None => a.clone(),
                        },
                    )
                    .collect();
                let text = ctl(&args);
                if args.get(1).map(String::as_str) == Some("watch") {
                    watch_again = Some((args.clone(), expected.clone().unwrap_or_default()));
                }
                let field = |name: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(name))
                        .map(|v| v.trim().to_owned())
                };
                if args.get(1).map(String::as_str) == Some("create") {
                    let name = args
                        .iter()
                        .position(|a| a == "--name")
                        .map(|p| args[p + 1].clone())
                        .expect("--name");
                    ids.insert(name, field("id:").expect("an id"));
                }
                if args.get(1).map(String::as_str) == Some("run-now") {
                    ids.insert("run".into(), field("run:").expect("a run id"));
                }
                ran += 1;
                text
            };
            if let Some(expected) = &expected {
                assert_eq!(
                    normalize(&output, &data_dir),
                    normalize(expected, &data_dir),
                    "`automesh {}` printed something else than the README shows",
                    args.join(" ")
                );
                compared += 1;
            }
        }
    }
    assert!(ran >= 5, "ran {ran} commands");
    assert!(compared >= 4, "compared {compared} outputs");
    let (args, expected) = watch_again.expect("the README watches its run");
    assert_eq!(
        normalize(&ctl(&args), &data_dir),
        normalize(&expected, &data_dir),
        "`automesh {}` on the ended run printed something else than the README shows",
        args.join(" ")
    );
    drop(dev);
}

/// The fenced code blocks of a Markdown text: (language, body).
fn code_blocks(markdown: &str) -> Vec<(String, String)> {
    let mut blocks = vec![];
    // (language, the fence's indentation, lines)
    let mut open: Option<(String, String, Vec<&str>)> = None;
    for line in markdown.lines() {
        let fence = line.trim_start();
        let indent = &line[..line.len() - fence.len()];
        match (&mut open, fence.strip_prefix("```")) {
            (None, Some(lang)) => open = Some((lang.trim().to_owned(), indent.to_owned(), vec![])),
            (Some(_), Some(_)) => {
                let (lang, _, body) = open.take().expect("open");
                blocks.push((lang, body.join("\n")));
            }
            (Some((_, indent, body)), None) => {
                body.push(line.strip_prefix(indent.as_str()).unwrap_or(line))
            }
            (None, None) => {}
        }
    }
    blocks
}

/// Words as a POSIX shell splits them, with double and single quotes; a
/// `<placeholder with spaces>` is one word.
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quote, mut any) = (vec![], String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (None, '<') if !any => {
                quote = Some('>');
                word.push(c);
                any = true;
            }
            (Some('>'), '>') => {
                word.push(c);
                quote = None;
            }
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            (_, c) => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(word);
    }
    words
}

/// Output with what varies from run to run replaced.
fn normalize(text: &str, data_dir: &str) -> String {
    let text = text.replace(data_dir, ".automesh");
    let rules = [
        (
            r"eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+",
            "<token>",
        ),
        (
            r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            "<id>",
        ),
        // A run id: `r`, its time and a hash (crates/domain/src/ids.rs).
        (r"\br[0-9a-f]{32}\b", "<id>"),
        (r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", "<time>"),
        (r"127\.0\.0\.1:\d+", "127.0.0.1:<port>"),
        (r"\b[0-9a-f]{32}\b", "<trace>"),
    ];
    let mut text = text;
    for (pattern, with) in rules {
        text = regex::Regex::new(pattern)
            .expect("pattern")
            .replace_all(&text, with)
            .into_owned();
    }
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    let last_state = lines.iter().rposition(|l| l.starts_with("-- run "));
    lines
        .iter()
        .enumerate()
        .filter(|(i, l)| !l.starts_with("-- run ") || Some(*i) == last_state)
        .map(|(_, l)| *l)
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_owned()
}

/// With a provider URL and a Connect URL configured, dev uses those, not
/// its demo ones: the banner says nothing of a demo, and a desktop run on
/// dev's own runner goes to the configured provider and Connect endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_provider_and_connect_endpoint_replace_the_demo_ones() {
    use automesh_proto::v1 as pb;
    use automesh_testkit::{FakeMcp, Reply, mcp, provider, text_completion};
    let (provider_url, fake) =
        provider(|_, _| Reply::Json(text_completion("answered by the configured provider"))).await;
    let tools = FakeMcp::with_tools(&["search_capabilities", "execute_capability"]);
    let (mcp_url, _mcp) = mcp(tools, "configured-connect-token").await;
    let env = vec![
        ("AUTOMESH_WORKER_PROVIDER_URL", provider_url.clone()),
        (
            "AUTOMESH_WORKER_PROVIDER_API_KEY",
            "sk-configured".to_owned(),
        ),
        ("AUTOMESH_CONNECT_URL", mcp_url.clone()),
        (
            "AUTOMESH_CONNECT_TOKEN",
            "configured-connect-token".to_owned(),
        ),
    ];
    let (dev, gateway, token) =
        tokio::task::spawn_blocking(move || start_dev_with("configured", &env, &[], true))
            .await
            .expect("start");
    let banner = dev.banner.join("\n");
    assert!(!banner.contains("DEMO"), "{banner}");
    assert!(banner.contains(&provider_url), "{banner}");
    let ended =
        desktop_run_to_its_end(&gateway, &token, "configured", Duration::from_secs(60)).await;
    assert_eq!(ended.state, pb::RunState::Succeeded as i32, "{ended:?}");
    assert_eq!(fake.calls(), 1, "the configured provider answered");
    let receipt = ended.receipt.expect("receipt");
    assert_eq!(
        receipt.provider_model, "gpt-4.1-mini",
        "the catalogue's name, no demo"
    );
    assert!(fake.auth.lock().iter().all(|a| a == "Bearer sk-configured"));
    drop(dev);
}

/// A daily desktop automation made through `gateway`'s public API and run
/// now once; the run, once it has its receipt (bounded by `within`).
async fn desktop_run_to_its_end(
    gateway: &str,
    token: &str,
    name: &str,
    within: Duration,
) -> automesh_proto::v1::Run {
    use automesh_proto::v1 as pb;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{gateway}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut automations = pb::automations_client::AutomationsClient::new(channel.clone());
    let mut runs = pb::runs_client::RunsClient::new(channel);
    let automation = automations
        .create_automation(automesh_e2e_tests::with_bearer(
            token,
            daily_automation(
                name,
                "say hello",
                "openai/gpt-4.1-mini",
                pb::Surface::Desktop,
                (9, 0, "UTC"),
            ),
        ))
        .await
        .expect("create")
        .into_inner()
        .automation
        .expect("automation");
    let run = automations
        .run_automation_now(automesh_e2e_tests::with_bearer(
            token,
            pb::RunAutomationNowRequest {
                id: automation.id,
                idempotency_key: name.into(),
            },
        ))
        .await
        .expect("run now")
        .into_inner()
        .run
        .expect("run");
    until_receipt(&mut runs, token, &run.id, within).await
}

/// The run, once it has its receipt, read through the public API; fails
/// the test after `within`.
async fn until_receipt(
    runs: &mut automesh_proto::v1::runs_client::RunsClient<tonic::transport::Channel>,
    token: &str,
    run_id: &str,
    within: Duration,
) -> automesh_proto::v1::Run {
    use automesh_proto::v1 as pb;
    let give_up = std::time::Instant::now() + within;
    loop {
        let run = runs
            .get_run(automesh_e2e_tests::with_bearer(
                token,
                pb::GetRunRequest { id: run_id.into() },
            ))
            .await
            .expect("get run")
            .into_inner()
            .run
            .expect("run");
        if run.receipt.is_some() {
            return run;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "no end within {within:?}: {run:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
