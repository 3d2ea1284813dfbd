//! `docker-compose.yml` is wired right, proven without a Docker engine (none
//! runs on these machines): the test reads the file, starts each automesh
//! service's exact command and environment as a local process — the
//! services' hostnames mapped to loopback ports, PostgreSQL to the test
//! database, the collector to an OTLP receiver in this test, volumes to a
//! temporary directory — and drives a desktop and a cloud run to success
//! through them. A broken copy (a missing executor address, a misspelt
//! host) must fail it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use automesh_domain::{Principal, RunState};
use automesh_proto::v1 as pb;
use automesh_store::testing::TestDatabase;
use automesh_testkit::{Reply, provider, text_completion};
use chrono::Utc;

const COMPOSE: &str = include_str!("../../docker-compose.yml");
const MCP_TOKEN: &str = "compose-connect-token";

/// One automesh service of the compose file.
#[derive(Debug, Clone)]
struct Service {
    name: String,
    command: Vec<String>,
    env: BTreeMap<String, String>,
}

fn text(v: &serde_yaml::Value) -> String {
    match v {
        serde_yaml::Value::String(s) => s.clone(),
        serde_yaml::Value::Number(n) => n.to_string(),
        serde_yaml::Value::Bool(b) => b.to_string(),
        _ => String::new(),
    }
}

/// The services built from this repository (the `automesh` image), with
/// merge keys applied.
fn services(yaml: &str) -> anyhow::Result<Vec<Service>> {
    let mut doc: serde_yaml::Value = serde_yaml::from_str(yaml)?;
    doc.apply_merge()?;
    let mut out = vec![];
    let all = doc["services"]
        .as_mapping()
        .ok_or_else(|| anyhow::anyhow!("no services"))?;
    for (name, svc) in all {
        if svc.get("build").is_none() {
            continue;
        }
        let command = svc["command"]
            .as_sequence()
            .ok_or_else(|| anyhow::anyhow!("{name:?} has no command"))?
            .iter()
            .map(text)
            .collect();
        let env = svc["environment"]
            .as_mapping()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (text(k), text(v)))
                    .collect::<BTreeMap<_, _>>()
            })
            .unwrap_or_default();
        out.push(Service {
            name: text(name),
            command,
            env,
        });
    }
    Ok(out)
}

/// Compose's `${NAME:-default}` and `${NAME}`, from `given`.
fn interpolate(value: &str, given: &BTreeMap<&str, String>) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let Some(end) = rest[start..].find('}') else {
            break;
        };
        let inner = &rest[start + 2..start + end];
        let (name, default) = inner.split_once(":-").unwrap_or((inner, ""));
        out.push_str(given.get(name).map_or(default, String::as_str));
        rest = &rest[start + end + 1..];
    }
    out.push_str(rest);
    out
}

/// Where each `host:port` of the compose network is on this machine.
struct Network {
    ports: BTreeMap<(String, u16), u16>,
    /// Hosts that are not automesh services, and what stands for them.
    others: BTreeMap<String, String>,
}

fn free_port() -> u16 {
    automesh_e2e_tests::free_port().expect("a free port")
}

impl Network {
    /// Every port a service listens on (`--listen`, `--metrics-listen`).
    fn of(services: &[Service]) -> Network {
        let mut ports = BTreeMap::new();
        for s in services {
            for pair in s.command.windows(2) {
                if pair[0].ends_with("listen")
                    && let Some((_, port)) = pair[1].rsplit_once(':')
                    && let Ok(port) = port.parse::<u16>()
                {
                    ports.insert((s.name.clone(), port), free_port());
                }
            }
        }
        Network {
            ports,
            others: BTreeMap::new(),
        }
    }

    /// `value` with every `http://host:port` of the compose network
    /// rewritten to where it is here; a host that is neither a service nor
    /// a known outside one is an error (compose would fail to resolve it).
    fn rewrite(&self, value: &str) -> anyhow::Result<String> {
        let Some(rest) = value.strip_prefix("http://") else {
            return Ok(value.to_owned());
        };
        let (host_port, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = host_port
            .rsplit_once(':')
            .ok_or_else(|| anyhow::anyhow!("no port in {value}"))?;
        let port: u16 = port.parse()?;
        if let Some(local) = self.ports.get(&(host.to_owned(), port)) {
            return Ok(format!("http://127.0.0.1:{local}{}", slash(path)));
        }
        if let Some(other) = self.others.get(host) {
            return Ok(other.clone());
        }
        anyhow::bail!(
            "{value} names host {host:?} port {port}, which no service of the compose file serves"
        )
    }

    fn listen(&self, service: &str, arg: &str) -> anyhow::Result<String> {
        let (_, port) = arg
            .rsplit_once(':')
            .ok_or_else(|| anyhow::anyhow!("listen address {arg}"))?;
        let local = self
            .ports
            .get(&(service.to_owned(), port.parse()?))
            .ok_or_else(|| anyhow::anyhow!("{service} port {port}"))?;
        Ok(format!("127.0.0.1:{local}"))
    }
}

fn slash(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("/{path}")
    }
}

/// The compose services as local processes; killed when dropped.
struct Stack {
    children: Vec<(String, Child)>,
    dir: PathBuf,
    network: Network,
    jwt_secret: String,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in automesh_rpc::process::working_in(&self.dir.join("var/workers")) {
            automesh_rpc::process::signal(pid, automesh_rpc::process::Signal::KILL);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Stack {
    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    fn addr(&self, service: &str, port: u16) -> String {
        format!(
            "http://127.0.0.1:{}",
            self.network.ports[&(service.to_owned(), port)]
        )
    }

    /// Starts every service of `yaml` and waits (bounded) until each
    /// serves; an error names the service and what its log says.
    async fn start(
        yaml: &str,
        db: &TestDatabase,
        given: &BTreeMap<&str, String>,
        otlp: &str,
    ) -> anyhow::Result<Stack> {
        let services = services(yaml)?;
        let mut network = Network::of(&services);
        network
            .others
            .insert("otel-collector".into(), otlp.to_owned());
        let dir = std::env::temp_dir().join(format!(
            "automesh-compose-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(dir.join("var"))?;
        let mut stack = Stack {
            children: vec![],
            dir,
            network,
            jwt_secret: String::new(),
        };
        // One-shot services (the migration) run to their end first, as
        // the others' `service_completed_successfully` asks.
        let (once, services): (Vec<Service>, Vec<Service>) = services
            .into_iter()
            .partition(|s| s.command.first().is_some_and(|c| c == "migrate"));
        anyhow::ensure!(
            !once.is_empty(),
            "no migrate service: nothing applies the schema"
        );
        for s in once.iter().chain(&services) {
            let mut args = vec![];
            let mut listen_next = false;
            for a in &s.command {
                if listen_next {
                    args.push(stack.network.listen(&s.name, a)?);
                } else {
                    args.push(a.clone());
                }
                listen_next = a.ends_with("listen");
            }
            let mut command = Command::new(env!("CARGO_BIN_EXE_automesh"));
            command
                .args(&args)
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .env("HOME", &stack.dir);
            for (k, raw) in &s.env {
                let v = interpolate(raw, given);
                let v = match k.as_str() {
                    // The operator's own settings (`${…}`): outside the
                    // compose network, taken as given.
                    _ if raw.contains("${") => v,
                    // The compose database is the test's.
                    "AUTOMESH_DATABASE_URL" => {
                        anyhow::ensure!(
                            v.contains("@postgres:5432/"),
                            "{}: AUTOMESH_DATABASE_URL {v} is not the compose PostgreSQL",
                            s.name
                        );
                        db.url.clone()
                    }
                    _ => stack
                        .network
                        .rewrite(&v)
                        .map_err(|e| anyhow::anyhow!("{}: {k}: {e}", s.name))?,
                };
                // Volumes under /var/lib/automesh live in the test's directory.
                let v = v.replace(
                    "/var/lib/automesh",
                    &stack.dir.join("var").display().to_string(),
                );
                if k == "AUTOMESH_JWT_SECRET" {
                    stack.jwt_secret = v.clone();
                }
                command.env(k, v);
            }
            let log = stack.dir.join(format!("{}.log", s.name));
            let out = std::fs::File::create(&log)?;
            command
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out);
            let mut child = command.spawn()?;
            if once.iter().any(|o| o.name == s.name) {
                let give_up = tokio::time::Instant::now() + Duration::from_secs(120);
                let status = loop {
                    if let Some(status) = child.try_wait()? {
                        break status;
                    }
                    anyhow::ensure!(
                        tokio::time::Instant::now() < give_up,
                        "{} did not finish:\n{}",
                        s.name,
                        stack.log(&s.name)
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                anyhow::ensure!(
                    status.success(),
                    "{} failed ({status}):\n{}",
                    s.name,
                    stack.log(&s.name)
                );
                continue;
            }
            stack.children.push((s.name.clone(), child));
        }
        // Each serves, or the stack names the one that did not.
        for s in &services {
            let Some(grpc) = s
                .command
                .windows(2)
                .find(|p| p[0] == "--listen")
                .and_then(|p| p[1].rsplit_once(':'))
                .and_then(|(_, port)| port.parse::<u16>().ok())
            else {
                anyhow::bail!("{} has no --listen", s.name);
            };
            let addr = stack.addr(&s.name, grpc);
            let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
            loop {
                if automesh_e2e_tests::wait_for_health(&addr, Duration::from_millis(500), true)
                    .await
                    .is_ok()
                {
                    break;
                }
                let exited = stack
                    .children
                    .iter_mut()
                    .find(|(n, _)| n == &s.name)
                    .and_then(|(_, c)| c.try_wait().ok().flatten());
                if let Some(status) = exited {
                    anyhow::bail!(
                        "{} exited ({status}) before serving:\n{}",
                        s.name,
                        stack.log(&s.name)
                    );
                }
                anyhow::ensure!(
                    tokio::time::Instant::now() < give_up,
                    "{} did not serve:\n{}",
                    s.name,
                    stack.log(&s.name)
                );
            }
        }
        Ok(stack)
    }
}

/// The outside world a compose operator configures: a model provider and a
/// Connect endpoint (fakes speaking the real protocols).
async fn outside() -> (
    BTreeMap<&'static str, String>,
    tokio_util::sync::CancellationToken,
) {
    let (provider_url, _fake) = provider(|_, _| Reply::Json(text_completion("done"))).await;
    let (mcp_url, stop) = automesh_testkit::connect(MCP_TOKEN).await;
    let given = BTreeMap::from([
        ("AUTOMESH_WORKER_PROVIDER_URL", provider_url),
        ("AUTOMESH_WORKER_PROVIDER_API_KEY", "sk-compose".to_owned()),
        ("AUTOMESH_CONNECT_URL", mcp_url),
        ("AUTOMESH_CONNECT_TOKEN", MCP_TOKEN.to_owned()),
    ]);
    (given, stop)
}

type Api = pb::automations_client::AutomationsClient<
    tonic::service::interceptor::InterceptedService<
        tonic::transport::Channel,
        automesh_e2e_tests::Bearer,
    >,
>;

/// The public API of the stack's gateway, as `owner`.
fn api(stack: &Stack, owner: &Principal) -> anyhow::Result<Api> {
    let token = automesh_gateway::mint(
        stack.jwt_secret.as_bytes(),
        &owner.org_id,
        &owner.user_id,
        chrono::Duration::hours(1),
    )?;
    let channel = automesh_rpc::client::channel(&stack.addr("gateway", 50051))?;
    Ok(pb::automations_client::AutomationsClient::with_interceptor(
        channel,
        automesh_e2e_tests::Bearer::new(&token),
    ))
}

async fn run_now(stack: &Stack, owner: &Principal, surface: pb::Surface) -> anyhow::Result<String> {
    let mut api = api(stack, owner)?;
    let a = api
        .create_automation(automesh_e2e_tests::daily_automation(
            "composed",
            "summarise my inbox",
            surface,
        ))
        .await?
        .into_inner()
        .automation
        .ok_or_else(|| anyhow::anyhow!("no automation"))?;
    Ok(api
        .run_automation_now(pb::RunAutomationNowRequest {
            id: a.id,
            idempotency_key: "compose".into(),
        })
        .await?
        .into_inner()
        .run
        .ok_or_else(|| anyhow::anyhow!("no run"))?
        .id)
}

async fn until_terminal(db: &TestDatabase, run_id: &str) -> automesh_domain::Run {
    automesh_e2e_tests::until_ended(&db.store, run_id, Duration::from_secs(60)).await
}

fn runner(stack: &Stack, token: &str, state: &Path, given: &BTreeMap<&str, String>) -> Child {
    Command::new(env!("CARGO_BIN_EXE_automesh"))
        .arg("runner")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(
            "AUTOMESH_RUNNER_GATEWAY",
            stack.addr("desktop-runner-gateway", 50052),
        )
        .env("AUTOMESH_RUNNER_TOKEN", token)
        .env("AUTOMESH_RUNNER_STATE_DIR", state)
        .env(
            "AUTOMESH_PROVIDER_URL",
            &given["AUTOMESH_WORKER_PROVIDER_URL"],
        )
        .env("AUTOMESH_CONNECT_URL", &given["AUTOMESH_CONNECT_URL"])
        .env("AUTOMESH_CONNECT_TOKEN", MCP_TOKEN)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("runner")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_stack_runs_a_desktop_and_a_cloud_run() {
    automesh_telemetry::init_for_tests();
    let receiver = automesh_e2e_tests::otlp::Receiver::start()
        .await
        .expect("collector");
    let db = TestDatabase::new(automesh_store::Backend::Postgres)
        .await
        .expect("database");
    let (given, _mcp) = outside().await;
    let stack = Stack::start(COMPOSE, &db, &given, &receiver.endpoint)
        .await
        .expect("the compose stack starts");

    // Cloud: the owner's worker, woken for the run.
    let carol = Principal::new("acme", "carol");
    db.store
        .register_worker(&carol, "local-process", Utc::now())
        .await
        .expect("worker");
    let cloud = run_now(&stack, &carol, pb::Surface::Web)
        .await
        .expect("run");
    let run = until_terminal(&db, &cloud).await;
    assert_eq!(
        (run.state, run.error_code),
        (RunState::Succeeded, None),
        "{run:?}\n{}",
        stack.log("cloud-worker-lifecycle")
    );

    // Desktop: a runner of the owner's, on the compose runner gateway.
    let dana = Principal::new("acme", "dana");
    let minted = api(&stack, &dana)
        .expect("api")
        .create_runner_token(pb::CreateRunnerTokenRequest {
            runner_name: "laptop".into(),
        })
        .await
        .expect("runner token")
        .into_inner();
    let state = stack.dir.join("runner");
    let mut r = runner(&stack, &minted.token, &state, &given);
    let desktop = run_now(&stack, &dana, pb::Surface::Desktop)
        .await
        .expect("run");
    let run = until_terminal(&db, &desktop).await;
    let _ = r.kill();
    let _ = r.wait();
    assert_eq!(
        (run.state, run.error_code),
        (RunState::Succeeded, None),
        "{run:?}"
    );

    // The services export their spans to the stack's collector (in
    // batches, every few seconds).
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    while !receiver
        .spans()
        .iter()
        .any(|s| s.service == "automesh-run-coordinator")
    {
        assert!(
            tokio::time::Instant::now() < give_up,
            "traces reach the collector"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(stack);
    db.remove().await.expect("remove");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_compose_file_fails_naming_what_is_wrong() {
    automesh_telemetry::init_for_tests();
    let db = TestDatabase::new(automesh_store::Backend::Postgres)
        .await
        .expect("database");
    let (given, _mcp) = outside().await;
    // A coordinator without its cloud executor refuses to start.
    let no_executor: String = COMPOSE
        .lines()
        .filter(|l| !l.contains("AUTOMESH_CLOUD_EXECUTOR_ADDR"))
        .collect::<Vec<_>>()
        .join("\n");
    let err = Stack::start(&no_executor, &db, &given, "http://127.0.0.1:9")
        .await
        .err()
        .expect("a coordinator without an executor must not start");
    let err = format!("{err:#}");
    assert!(
        err.contains("run-coordinator") && err.contains("AUTOMESH_CLOUD_EXECUTOR_ADDR"),
        "{err}"
    );
    // A misspelt upstream host does not resolve.
    let misspelt = COMPOSE.replace("http://scheduler:50053", "http://schedular:50053");
    let err = Stack::start(&misspelt, &db, &given, "http://127.0.0.1:9")
        .await
        .err()
        .expect("a misspelt host must not wire");
    assert!(format!("{err:#}").contains("schedular"), "{err:#}");
    db.remove().await.expect("remove");
}
