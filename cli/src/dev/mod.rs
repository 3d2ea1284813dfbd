//! `automesh dev`: the whole mesh in one process, on SQLite under a data
//! directory, each service on its own loopback port, with a desktop runner
//! for the `dev` user. Without a configured model provider or Connect
//! endpoint it serves the built-in demo ones ([`demo`]), so a first run
//! succeeds on a fresh machine.

mod demo;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use automesh_domain::Principal;
use automesh_rpc::InternalCredential;
use automesh_rpc::runtime::{bind, config_from_args, random_secret, shutdown_on_signal};
use automesh_store::{Store, StoreOptions};
use tokio::task::JoinSet;

/// The user and organisation of the printed development token.
pub const DEV_USER: &str = "dev";
pub const DEV_ORG: &str = "dev";

/// The dev mesh's data directory, where `ctl` and `admin` find its tokens
/// and signing key.
#[derive(Debug, Clone, clap::Args)]
pub struct DataDir {
    /// The dev mesh's data directory (its tokens and signing key).
    #[arg(
        long = "data-dir",
        env = "AUTOMESH_DATA_DIR",
        default_value = ".automesh",
        global = true
    )]
    pub path: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// Where the SQLite database and the development secrets live.
    #[arg(long, env = "AUTOMESH_DATA_DIR", default_value = ".automesh")]
    pub data_dir: PathBuf,
    /// Use this database instead of SQLite under the data directory.
    #[arg(long, env = "AUTOMESH_DATABASE_URL")]
    pub database_url: Option<String>,
    /// The public API (web backend, `automesh ctl`).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub gateway_listen: SocketAddr,
    /// The web console (open it in a browser; one click signs the dev user
    /// in).
    #[arg(long, env = "AUTOMESH_CONSOLE_LISTEN", default_value = "127.0.0.1:8080")]
    pub console_listen: SocketAddr,
    /// Where desktop runners connect.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub runner_gateway_listen: SocketAddr,
    /// What serves the runner listener's HTTP/2: `lean` (automesh-http2,
    /// which keeps no buffers on an idle connection) or `hyper` (hyper's, as
    /// every other listener).
    #[arg(long, env = "AUTOMESH_RUNNER_HTTP2", default_value = "lean")]
    pub runner_http2: automesh_desktop_runner_gateway::settings::Http2,
    /// The desktop-runner-gateway's internal listener (the desktop executor
    /// and the runner token service; the mesh only).
    #[arg(long, default_value = "127.0.0.1:50056")]
    pub runner_gateway_internal_listen: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:50053")]
    pub scheduler_listen: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:50054")]
    pub coordinator_listen: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:50055")]
    pub lifecycle_listen: SocketAddr,
    /// Where the whole mesh's metrics are served as Prometheus text
    /// (`GET /metrics`).
    #[arg(long, env = "AUTOMESH_METRICS_LISTEN", default_value = "127.0.0.1:9450")]
    pub metrics_listen: SocketAddr,
    /// How long a run may take from creation to its end.
    #[arg(long, env = "AUTOMESH_DEV_RUN_DEADLINE", default_value = "30m", value_parser = automesh_scheduler::parse_duration)]
    pub run_deadline: Duration,
    /// How late a missed occurrence may be and still run once after downtime.
    #[arg(long, default_value = "1h", value_parser = automesh_scheduler::parse_duration)]
    pub catch_up_window: Duration,
    /// Do not record a (stopped) cloud worker for the `dev` user. Without
    /// one, creating a cloud automation fails its precondition, as it would
    /// for a user who has no cloud worker.
    #[arg(long)]
    pub no_dev_worker: bool,
    /// Do not start the desktop runner of the `dev` user (desktop runs then
    /// wait for a runner you start, and end `runner_offline` at their
    /// deadline without one).
    #[arg(long)]
    pub no_runner: bool,
    #[command(flatten)]
    pub models: automesh_rpc::runtime::Models,
    /// The model provider, the Connect endpoint and the engine settings of
    /// cloud workers and of the dev runner. Without a provider URL, the
    /// built-in demo model serves; without a Connect URL, the demo Connect
    /// endpoint.
    #[command(flatten)]
    pub worker: automesh_cloud_worker_lifecycle::WorkerEnv,
}

/// The model provider and Connect endpoint the dev mesh's engines use, and
/// whether each is the built-in demo.
struct Outside {
    worker: automesh_cloud_worker_lifecycle::WorkerEnv,
    demo_model: bool,
    demo_connect: bool,
}

/// Serves a demo endpoint on a loopback port of its own when `url` names
/// none: `serve` gets its listener and the fresh secret (`prefix…`) it will
/// require, and `url` becomes its address with `path`. True when it did.
async fn demo<F: std::future::Future<Output = ()> + Send + 'static>(
    url: &mut Option<String>,
    path: &str,
    prefix: &str,
    serve: impl FnOnce(tokio::net::TcpListener, String) -> F,
) -> anyhow::Result<bool> {
    if url.as_deref().is_some_and(|u| !u.trim().is_empty()) {
        return Ok(false);
    }
    let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    *url = Some(format!("http://{}{path}", listener.local_addr()?));
    tokio::spawn(serve(listener, random_secret(prefix)));
    Ok(true)
}

impl Outside {
    /// Starts the demo model and the demo Connect endpoint where nothing is
    /// configured, on loopback ports of their own.
    async fn resolve(
        configured: &automesh_cloud_worker_lifecycle::WorkerEnv,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<Outside> {
        let mut worker = configured.clone();
        let w = &mut worker;
        let stop = || shutdown.clone();
        let demo_model = demo(&mut w.provider_url, "/v1", "demo_key_", |listener, key| {
            w.provider_key = key.clone().into();
            demo::serve_model(listener, key, stop())
        });
        let demo_model = demo_model.await?;
        let demo_connect = demo(
            &mut w.connect_url,
            "/mcp",
            "demo_connect_",
            |listener, token| {
                w.connect_token = token.clone().into();
                demo::serve_connect(listener, token, stop())
            },
        );
        let demo_connect = demo_connect.await?;
        Ok(Outside {
            worker,
            demo_model,
            demo_connect,
        })
    }

    fn provider_url(&self) -> String {
        self.worker.provider_url()
    }

    fn connect_url(&self) -> String {
        self.worker.connect_url.clone().unwrap_or_default()
    }
}

/// The dev user's runner token: the one kept in `<data-dir>/runner-token`
/// while the database still knows it, otherwise a new one, recorded there.
async fn dev_runner_token(store: &Store, data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join("runner-token");
    if let Ok(token) = std::fs::read_to_string(&path) {
        let token = token.trim().to_owned();
        let known = store
            .find_runner_by_token_hash(&automesh_desktop_runner_gateway::hash_token(&token))
            .await?;
        if known.is_some_and(|r| r.revoked_at.is_none()) {
            return Ok(token);
        }
    }
    let token = random_secret(automesh_desktop_runner_gateway::TOKEN_PREFIX);
    store
        .create_runner(
            &Principal::new(DEV_ORG, DEV_USER),
            &automesh_domain::ids::new_runner_id(),
            "dev runner",
            &automesh_desktop_runner_gateway::hash_token(&token),
            chrono::Utc::now(),
        )
        .await?;
    write_private(&path, &token)?;
    Ok(token)
}

/// The dev user's desktop runner, in this process: the native engine
/// against `outside`'s provider and Connect endpoint.
fn dev_runner(
    outside: &Outside,
    token: String,
    gateway: String,
    state_dir: PathBuf,
) -> anyhow::Result<automesh_runner::Runner> {
    let engine = outside.worker.engine();
    let native = automesh_engine::adapter::NativeEngine::openai_compatible(
        &outside.provider_url(),
        outside.worker.provider_key.expose(),
        &outside.connect_url(),
        outside.worker.connect_token.expose(),
        automesh_engine::adapter::NativeSettings {
            request_timeout: engine.request_timeout,
            stream: engine.stream,
            max_steps: engine.max_steps,
            ..Default::default()
        },
    );
    let settings = automesh_runner::Settings::new(vec![gateway], token.into(), state_dir);
    automesh_runner::Runner::new(settings, std::sync::Arc::new(native))
}

/// Reads a secret from `path`, creating it (mode 0600) on first use.
pub fn secret_file(path: &Path, prefix: &str) -> anyhow::Result<String> {
    if let Ok(existing) = std::fs::read_to_string(path) {
        let existing = existing.trim().to_owned();
        if !existing.is_empty() {
            return Ok(existing);
        }
    }
    let secret = random_secret(prefix);
    write_private(path, &secret)?;
    Ok(secret)
}

/// Writes a file only its owner can read.
pub fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    options.mode(0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(contents.as_bytes())?;
    Ok(())
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create data directory {}", args.data_dir.display()))?;
    let telemetry = automesh_telemetry::init("automesh-dev")?;
    let metrics_listener = bind(args.metrics_listen).await?;
    let metrics_addr = metrics_listener.local_addr()?;
    let jwt_secret = secret_file(&args.data_dir.join("jwt-secret"), "jwt_")?;
    let internal = secret_file(&args.data_dir.join("internal-token"), "ait_")?;
    let notification_key = secret_file(&args.data_dir.join("notification-key"), "ank_")?;
    let credential = InternalCredential::new(internal)?;

    let database_url = args.database_url.clone().unwrap_or_else(|| {
        format!(
            "sqlite://{}?mode=rwc",
            args.data_dir.join("automesh.db").display()
        )
    });
    let store = Store::connect_lazy(&database_url, StoreOptions::from_env())
        .with_context(|| format!("cannot open the database at {database_url}"))?;
    // A data directory a newer automesh migrated is refused by name.
    store.refuse_newer_schema().await?;
    store
        .migrate()
        .await
        .with_context(|| format!("cannot migrate the database at {database_url}"))?;
    let shutdown = shutdown_on_signal();
    let outside = Outside::resolve(&args.worker, &shutdown).await?;
    let mut models = args.models.catalog();
    if outside.demo_model {
        // Whatever model a run names, the demo model answers it, and its
        // receipt says so.
        for m in &mut models.models {
            m.provider_model = Some(demo::DEMO_MODEL.to_owned());
        }
    }
    let gateway_models = models.clone();

    // Bind every port before serving anything, so a taken port fails fast.
    let gateway_l = bind(args.gateway_listen).await?;
    let runner_l = bind(args.runner_gateway_listen).await?;
    let runner_internal_l = bind(args.runner_gateway_internal_listen).await?;
    let scheduler_l = bind(args.scheduler_listen).await?;
    let coordinator_l = bind(args.coordinator_listen).await?;
    let lifecycle_l = bind(args.lifecycle_listen).await?;
    let console_l = bind(args.console_listen).await?;
    let addr = |l: &tokio::net::TcpListener| -> anyhow::Result<String> {
        Ok(format!("http://{}", l.local_addr()?))
    };
    let upstreams = automesh_gateway::UpstreamAddrs {
        scheduler_addr: addr(&scheduler_l)?,
        coordinator_addr: addr(&coordinator_l)?,
        lifecycle_addr: addr(&lifecycle_l)?,
        runner_gateway_addr: addr(&runner_internal_l)?,
    };
    let public = addr(&gateway_l)?;
    let runners = addr(&runner_l)?;
    let console_url = addr(&console_l)?;

    if !args.no_dev_worker {
        store
            .register_worker(
                &Principal::new(DEV_ORG, DEV_USER),
                "local-process",
                chrono::Utc::now(),
            )
            .await?;
    }

    tokio::spawn(automesh_telemetry::metrics::serve(
        telemetry.scrape(),
        metrics_listener,
        shutdown.clone(),
    ));
    // Each service is assembled from its configuration exactly as its own
    // binary would be (every default is its flag's), over the one store:
    // a bad setting stops dev before anything serves.
    let url = ["--database-url", database_url.as_str()];
    let scheduler = automesh_scheduler::Config {
        run_deadline: args.run_deadline,
        catch_up_window: args.catch_up_window,
        // Webhooks to a receiver on this machine, over http, are what a
        // developer tries first.
        notification_key: Some(notification_key.as_str().into()),
        webhook_allow_http: true,
        webhook_allow_private: true,
        ..config_from_args(&url)?
    };
    // Desktop runs go to the runner gateway (the desktop executor), cloud
    // runs to the lifecycle service.
    let coordinator = automesh_run_coordinator::Config {
        desktop_executor_addr: Some(upstreams.runner_gateway_addr.clone()),
        cloud_executor_addr: Some(upstreams.lifecycle_addr.clone()),
        models: automesh_rpc::runtime::Models::of(models),
        ..config_from_args(&url)?
    };
    // The local-process driver runs this binary's `worker-agent`.
    let lifecycle = automesh_cloud_worker_lifecycle::Config {
        workers_dir: args.data_dir.join("workers"),
        worker: outside.worker.clone(),
        ..config_from_args(&url)?
    };
    let mut runner_gateway: automesh_desktop_runner_gateway::Config = config_from_args(&url)?;
    runner_gateway.streams.http2 = args.runner_http2;
    let gateway = automesh_gateway::Config {
        upstreams: upstreams.clone(),
        models: automesh_rpc::runtime::Models::of(gateway_models),
        ..config_from_args(&["--jwt-secret", jwt_secret.as_str()])?
    };
    let (st, cred) = (|| store.clone(), || credential.clone());
    let scheduler = automesh_scheduler::Service::new(&scheduler, st(), cred())?;
    let coordinator = automesh_run_coordinator::Service::new(&coordinator, st(), cred())?;
    let lifecycle = automesh_cloud_worker_lifecycle::Service::new(&lifecycle, st(), cred())?;
    let runner_gateway =
        automesh_desktop_runner_gateway::Service::new(&runner_gateway, st(), cred())?;
    let gateway = automesh_gateway::Service::new(&gateway, cred())?;
    let token = automesh_gateway::mint(
        jwt_secret.as_bytes(),
        DEV_ORG,
        DEV_USER,
        chrono::Duration::days(30),
    )?;
    let console: automesh_console::Config = config_from_args(&["--gateway", public.as_str()])?;
    let console = automesh_console::Service::new(&console)?.with_dev_sign_in(token.clone());
    let mut tasks: JoinSet<(&'static str, anyhow::Result<()>)> = JoinSet::new();
    let sd = || shutdown.clone();
    spawn(&mut tasks, "scheduler", scheduler.serve(scheduler_l, sd()));
    spawn(
        &mut tasks,
        "run-coordinator",
        coordinator.serve(coordinator_l, sd()),
    );
    spawn(
        &mut tasks,
        "cloud-worker-lifecycle",
        lifecycle.serve(lifecycle_l, sd()),
    );
    spawn(
        &mut tasks,
        "desktop-runner-gateway",
        runner_gateway.serve(
            automesh_desktop_runner_gateway::Listeners {
                runners: runner_l,
                internal: runner_internal_l,
            },
            sd(),
        ),
    );
    spawn(&mut tasks, "gateway", gateway.serve(gateway_l, sd()));
    spawn(&mut tasks, "console", console.serve(console_l, sd()));

    let runner_line = if args.no_runner {
        "none (--no-runner): start one with `automesh runner`".to_owned()
    } else {
        let token = dev_runner_token(&store, &args.data_dir).await?;
        let runner = dev_runner(
            &outside,
            token,
            runners.clone(),
            args.data_dir.join("runner"),
        )?;
        let sd = shutdown.clone();
        tasks.spawn(async move {
            runner.run(sd).await;
            ("desktop runner", Ok(()))
        });
        format!("for user {DEV_USER:?}, in this process (native engine; --no-runner turns it off)")
    };

    let token_path = args.data_dir.join("dev-token");
    write_private(&token_path, &token)?;

    let line = |label: &str, value: &str| println!("  {label:<24}{value}");
    let demo = |is_demo: bool, what: &str| {
        if is_demo {
            format!("   DEMO: {what}")
        } else {
            String::new()
        }
    };
    println!("automesh dev mesh");
    line("database", &redact_url(&database_url));
    line(
        "console",
        &format!("{console_url}   (open it in a browser: one click signs in the dev user)"),
    );
    line(
        "public gateway",
        &format!("{public}   (automesh.v1.Automations, automesh.v1.Runs)"),
    );
    line(
        "desktop runners",
        &format!(
            "{runners}   (HTTP/2: {})",
            match args.runner_http2 {
                automesh_desktop_runner_gateway::settings::Http2::Lean => "lean, automesh-http2",
                automesh_desktop_runner_gateway::settings::Http2::Hyper => "hyper",
            }
        ),
    );
    line("scheduler", &upstreams.scheduler_addr);
    line("run-coordinator", &upstreams.coordinator_addr);
    line("cloud-worker-lifecycle", &upstreams.lifecycle_addr);
    line("metrics", &format!("http://{metrics_addr}/metrics"));
    line(
        "model provider",
        &format!(
            "{}{}",
            outside.provider_url(),
            demo(
                outside.demo_model,
                "the built-in deterministic demo model (set AUTOMESH_WORKER_PROVIDER_URL for a real one)"
            )
        ),
    );
    line(
        "connect (MCP)",
        &format!(
            "{}{}",
            outside.connect_url(),
            demo(
                outside.demo_connect,
                "two tools over a demo catalogue (set AUTOMESH_CONNECT_URL for real tools)"
            )
        ),
    );
    line("desktop runner", &runner_line);
    println!();
    println!(
        "development token for user {DEV_USER:?} of org {DEV_ORG:?} (30 days; also in {}):",
        token_path.display()
    );
    println!("{token}");
    println!();
    println!(
        "try:  automesh ctl create --name inbox --prompt \"summarise my unread inbox\" --surface desktop --daily 09:30 --tz Europe/Paris"
    );
    println!("      automesh ctl run-now <automation id>");
    println!("      automesh ctl watch <run id>");
    println!(
        "      grpcurl -plaintext -H \"authorization: Bearer $(cat {})\" {} list",
        token_path.display(),
        args.gateway_listen
    );

    match automesh_rpc::client::wait_serving(&public, Duration::from_secs(30)).await {
        Ok(()) => println!("ready"),
        Err(e) => tracing::warn!(error = %e, "the mesh is not serving yet"),
    }

    // Run until a signal, or until any service stops on its own.
    let first = tokio::select! {
        () = shutdown.cancelled() => None,
        done = tasks.join_next() => done,
    };
    if let Some(done) = first.filter(|_| !shutdown.is_cancelled()) {
        shutdown.cancel();
        match done {
            Ok((name, Ok(()))) => {
                tracing::warn!(service = name, "service stopped; stopping the mesh")
            }
            Ok((name, Err(e))) => {
                tracing::error!(service = name, error = %e, "service failed; stopping the mesh")
            }
            Err(e) => tracing::error!(error = %e, "service panicked; stopping the mesh"),
        }
    }
    let drained = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(done) = tasks.join_next().await {
            if let Ok((name, Err(e))) = done {
                tracing::error!(service = name, error = %e, "service failed while stopping");
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!("services did not drain within 15 s; exiting");
    }
    store.close().await;
    Ok(())
}

/// Runs one service of the mesh, named for the log line if it stops.
fn spawn(
    tasks: &mut JoinSet<(&'static str, anyhow::Result<()>)>,
    name: &'static str,
    serving: impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
) {
    tasks.spawn(async move { (name, serving.await) });
}

/// A database URL without its password, for printing.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
