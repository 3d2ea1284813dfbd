//! The end-to-end harness: the whole mesh started in-process on port 0 over
//! real gRPC on loopback, against a fresh SQLite or PostgreSQL database, with
//! clients that authenticate like the web backend does.

pub mod bench;
pub mod executor;
pub mod flood;
pub mod otlp;
pub mod processes;
pub mod relay;
pub mod webhooks;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use automesh_domain::ModelCatalog;
use automesh_proto::v1::automations_client::AutomationsClient;
use automesh_proto::v1::runs_client::RunsClient;
use automesh_rpc::InternalCredential;
use automesh_store::testing::TestDatabase;
use automesh_store::{Backend, Store};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// A port nothing listens on, for a child process to listen on later.
///
/// Taken below the kernel's ephemeral range (32768–60999 on these
/// machines), from a per-process sequence: a port picked by binding port 0
/// lies inside that range, where any outgoing connection of a concurrent
/// test may take it as its local port before the child binds it.
pub fn free_port() -> anyhow::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 12_000;
    const HIGH: u32 = 32_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(7919) % (HIGH - LOW);
    for _ in 0..(HIGH - LOW) {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (seed + n) % (HIGH - LOW)) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port between {LOW} and {HIGH}")
}

/// The internal credential of every test mesh.
pub const INTERNAL_SECRET: &str = "test-internal-credential-0123";

/// The JWT key of every test mesh.
pub const JWT_SECRET: &[u8] = b"test-only-jwt-secret-0123456789abcdef";

/// How a test mesh is put together.
#[derive(Debug, Clone)]
pub struct MeshOptions {
    /// The executor both placements use (a [`executor::TestExecutor`]).
    pub executor: Option<String>,
    pub lease: Duration,
    /// The coordinators' safety poll (tests use a short one).
    pub claim_poll: Duration,
    /// How many runs each coordinator drives at once.
    pub max_runs: usize,
    pub cancel_bound: Duration,
    pub run_deadline: Duration,
    pub catch_up_window: Duration,
    /// Replicas of the scheduler and of the coordinator.
    pub schedulers: usize,
    pub coordinators: usize,
    /// Bounds of the desktop runners' streams.
    pub runner_streams: automesh_desktop_runner_gateway::stream::StreamSettings,
    /// Desktop runs go to the desktop-runner-gateway (the real desktop
    /// executor) instead of `executor`.
    pub desktop_via_runner_gateway: bool,
    /// Replicas of the desktop-runner-gateway, each with its own connection
    /// pool. Coordinators call the last one; `runner_gateway` is the first.
    pub runner_gateways: usize,
    /// Cloud runs go to the cloud-worker-lifecycle service (the real cloud
    /// executor) with this driver and these settings, instead of `executor`.
    pub cloud: Option<CloudOptions>,
    /// The model catalogue of the gateway and the coordinators.
    pub models: ModelCatalog,
    /// What the public gateway's and the runner gateways' listeners let in
    /// (their flags' defaults unless set).
    pub connections: Option<automesh_rpc::runtime::ConnectionLimits>,
    /// The schedulers' webhook settings: notifications on (the key
    /// [`WEBHOOK_KEY`]), http and loopback endpoints allowed, and these
    /// bounds (short ones by default).
    pub webhook_timeout: Duration,
    pub webhook_first_retry: Duration,
    /// Off: the schedulers have no notification key (no endpoints, no
    /// delivery), as an operator who never set one.
    pub notifications: bool,
    pub webhook_retry_for: Duration,
}

/// The operator's notification key of every test mesh.
pub const WEBHOOK_KEY: &str = "test-mesh-notification-key";

/// The cloud path of a test mesh: the lifecycle's configuration, and the
/// worker driver it runs (a real local-process driver the test keeps a
/// handle on, or a fake container runtime).
#[derive(Debug, Clone)]
pub struct CloudOptions {
    pub driver: std::sync::Arc<dyn automesh_cloud_worker_lifecycle::driver::WorkerDriver>,
    pub config: automesh_cloud_worker_lifecycle::Config,
}

/// A configuration as its service's flags give it by default. Its database
/// URL is never read: a test mesh gives every service its own store.
pub fn service_config<C: clap::Args>() -> C {
    automesh_rpc::runtime::config_from_args(&["--database-url", "the-test-mesh's"])
        .expect("the flags' defaults parse")
}

/// The lifecycle's default configuration in a test mesh, its workers'
/// directories under the temporary directory.
pub fn lifecycle_config() -> automesh_cloud_worker_lifecycle::Config {
    automesh_cloud_worker_lifecycle::Config {
        workers_dir: std::env::temp_dir().join("automesh-workers"),
        ..service_config()
    }
}

impl MeshOptions {
    /// The options of a benchmark: the coordinator's production lease and
    /// safety poll, as its flags give them by default (tests use short ones).
    pub fn benchmark() -> Self {
        let production: automesh_run_coordinator::Config = service_config();
        Self {
            lease: production.lease,
            claim_poll: production.claim_poll,
            ..Self::default()
        }
    }
}

impl Default for MeshOptions {
    fn default() -> Self {
        Self {
            executor: None,
            lease: Duration::from_secs(2),
            claim_poll: Duration::from_millis(100),
            max_runs: service_config::<automesh_run_coordinator::Config>().max_runs,
            cancel_bound: Duration::from_secs(2),
            run_deadline: Duration::from_secs(1800),
            catch_up_window: Duration::from_secs(3600),
            schedulers: 1,
            coordinators: 1,
            runner_streams: Default::default(),
            desktop_via_runner_gateway: false,
            runner_gateways: 1,
            cloud: None,
            models: test_models(),
            connections: None,
            webhook_timeout: Duration::from_secs(2),
            webhook_first_retry: Duration::from_millis(200),
            webhook_retry_for: Duration::from_secs(600),
            notifications: true,
        }
    }
}

/// A running mesh; call [`Mesh::stop`] at the end of the test.
pub struct Mesh {
    pub db: TestDatabase,
    pub gateway: String,
    pub scheduler: String,
    pub coordinator: String,
    pub lifecycle: String,
    /// The first desktop-runner-gateway's runner listener (where runners
    /// connect) and its internal listener (desktop executor, runner tokens).
    pub runner_gateway: String,
    pub runner_gateway_internal: String,
    pub credential: InternalCredential,
    pub options: MeshOptions,
    /// One handle per coordinator replica; aborting one kills it without
    /// any cleanup, as a crash would.
    pub coordinators: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
    shutdown: CancellationToken,
    tasks: JoinSet<anyhow::Result<()>>,
    /// Every desktop-runner-gateway replica's runner listener, in order.
    pub runner_gateways: Vec<String>,
    /// Every replica's internal listener, in the same order.
    pub runner_gateway_internals: Vec<String>,
    /// Stops one replica (as its process being terminated would).
    pub runner_gateway_stops: Vec<CancellationToken>,
}

async fn listener() -> anyhow::Result<(TcpListener, String)> {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let addr = format!("http://{}", l.local_addr()?);
    Ok((l, addr))
}

/// The priced model of test meshes. Its provider name is `echo`, so
/// OpenCode's `fake` provider (`fake/echo`) serves it too.
pub const PRICED_MODEL: &str = "fake/priced-echo";

/// What [`PRICED_MODEL`] costs in [`test_models`].
pub const PRICE: automesh_domain::Price = automesh_domain::Price {
    input_micros_per_million_tokens: 1_250_000,
    output_micros_per_million_tokens: 5_000_000,
};

/// The catalogue test meshes use: the development one, a model only the
/// organisation `acme` may use, and [`PRICED_MODEL`] at [`PRICE`].
pub fn test_models() -> ModelCatalog {
    test_models_at(PRICE)
}

/// The same, with [`PRICED_MODEL`] at `price`.
pub fn test_models_at(price: automesh_domain::Price) -> ModelCatalog {
    let mut catalog = ModelCatalog::development();
    let mut restricted = automesh_domain::ModelSpec::new("restricted/acme-only");
    restricted.authorized_orgs = vec!["acme".into()];
    catalog.models.push(restricted);
    let mut priced = automesh_domain::ModelSpec::new(PRICED_MODEL);
    priced.provider_model = Some("echo".into());
    priced.price = Some(price);
    catalog.models.push(priced);
    catalog
}

/// What `tokens` cost at `price`, computed here rather than by the mesh:
/// micro-units per million tokens, rounded up to a whole micro-unit.
pub fn expected_cost(price: automesh_domain::Price, input: i64, output: i64) -> i64 {
    let raw = input * price.input_micros_per_million_tokens
        + output * price.output_micros_per_million_tokens;
    (raw + 999_999) / 1_000_000
}

/// Changes [`PRICED_MODEL`]'s price to `price` (restarting the
/// coordinators on the new catalogue) and checks that the receipt and the
/// usage events of the run already charged as `before` did not change.
pub async fn reprice_keeps_history(
    mesh: &mut Mesh,
    before: &automesh_domain::Receipt,
    price: automesh_domain::Price,
) {
    let events_before = mesh
        .store()
        .internal()
        .events(&before.run_id, 0, 1000)
        .await
        .expect("events");
    mesh.reprice(test_models_at(price)).await.expect("reprice");
    let after = mesh
        .store()
        .internal()
        .receipt(&before.run_id)
        .await
        .expect("get receipt")
        .expect("a receipt");
    assert_eq!(&after, before, "a price change rewrote a receipt");
    let events_after = mesh
        .store()
        .internal()
        .events(&before.run_id, 0, 1000)
        .await
        .expect("events");
    assert_eq!(events_after, events_before, "a price change rewrote events");
}

/// Checks that a finished run of [`PRICED_MODEL`] was charged its tokens at
/// `price`: the receipt (with the price and the model names stored on it)
/// and every usage event. Returns the receipt.
pub async fn assert_charged(
    store: &Store,
    run_id: &str,
    price: automesh_domain::Price,
) -> automesh_domain::Receipt {
    let receipt = store
        .internal()
        .receipt(run_id)
        .await
        .expect("get receipt")
        .expect("a receipt");
    let usage = receipt.usage;
    assert!(usage.input_tokens > 0, "{receipt:?}");
    assert!(usage.cost_micros > 0, "{receipt:?}");
    assert_eq!(
        usage.cost_micros,
        expected_cost(price, usage.input_tokens, usage.output_tokens),
        "{receipt:?}"
    );
    assert_eq!(receipt.price, Some(price));
    assert_eq!(receipt.model.as_deref(), Some(PRICED_MODEL));
    assert_eq!(receipt.provider_model.as_deref(), Some("echo"));
    let events = store
        .internal()
        .events(run_id, 0, 1000)
        .await
        .expect("events");
    let mut usage_events = 0;
    for e in &events {
        if let automesh_domain::RunEventPayload::Usage(u) = &e.payload {
            usage_events += 1;
            assert_eq!(
                u.cost_micros,
                expected_cost(price, u.input_tokens, u.output_tokens),
                "{u:?}"
            );
        }
    }
    assert!(usage_events > 0, "no usage event: {events:?}");
    receipt
}

impl Mesh {
    /// Starts every service on a fresh database of `backend` and waits until
    /// the gateway reports SERVING.
    pub async fn start(backend: Backend) -> anyhow::Result<Mesh> {
        Self::start_with(backend, MeshOptions::default()).await
    }

    /// Starts a mesh as `options` say.
    pub async fn start_with(backend: Backend, options: MeshOptions) -> anyhow::Result<Mesh> {
        automesh_telemetry::init_for_tests();
        let db = TestDatabase::new(backend)
            .await
            .context("test database (is PostgreSQL running? see README)")?;
        let credential = InternalCredential::new(INTERNAL_SECRET)?;
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let (gl, gateway) = listener().await?;
        let (sl, scheduler) = listener().await?;
        let (cl, coordinator) = listener().await?;
        let (ll, lifecycle) = listener().await?;
        let mut runner_listeners = vec![];
        let mut runner_gateways = vec![];
        let mut runner_gateway_internals = vec![];
        for _ in 0..options.runner_gateways.max(1) {
            let (l, addr) = listener().await?;
            let (internal, internal_addr) = listener().await?;
            runner_listeners.push(automesh_desktop_runner_gateway::Listeners {
                runners: l,
                internal,
            });
            runner_gateways.push(addr);
            runner_gateway_internals.push(internal_addr);
        }
        let runner_gateway = runner_gateways[0].clone();
        let runner_gateway_internal = runner_gateway_internals[0].clone();
        let coordinated_gateway =
            runner_gateway_internals[runner_gateway_internals.len() - 1].clone();
        let store = db.store.clone();
        // Every service is assembled as its binary assembles it, from its
        // configuration, over the mesh's store.
        let mut first = Some(sl);
        for _ in 0..options.schedulers.max(1) {
            let l = match first.take() {
                Some(l) => l,
                None => listener().await?.0,
            };
            let config = automesh_scheduler::Config {
                run_deadline: options.run_deadline,
                catch_up_window: options.catch_up_window,
                notification_key: options.notifications.then(|| WEBHOOK_KEY.into()),
                webhook_allow_http: true,
                webhook_allow_private: true,
                webhook_timeout: options.webhook_timeout,
                webhook_first_retry: options.webhook_first_retry,
                webhook_retry_for: options.webhook_retry_for,
                ..service_config()
            };
            let scheduler =
                automesh_scheduler::Service::new(&config, store.clone(), credential.clone())?;
            tasks.spawn(scheduler.serve(l, shutdown.clone()));
        }
        let mut coordinators = vec![];
        let mut first = Some(cl);
        for _ in 0..options.coordinators.max(1) {
            let l = match first.take() {
                Some(l) => l,
                None => listener().await?.0,
            };
            coordinators.push(spawn_coordinator(
                &store,
                &options,
                &credential,
                l,
                &shutdown,
                &coordinated_gateway,
                &lifecycle,
            )?);
        }
        // Without a cloud path, the lifecycle has no worker agent to run:
        // workers can be recorded and read, and a cloud run that reaches it
        // ends `runtime_missing`.
        let (cloud_config, cloud_driver) = match &options.cloud {
            Some(cloud) => (cloud.config.clone(), Some(cloud.driver.clone())),
            None => (
                automesh_cloud_worker_lifecycle::Config {
                    agent_command: vec!["automesh-worker-agent-not-installed".into()],
                    ..lifecycle_config()
                },
                None,
            ),
        };
        let mut cloud = automesh_cloud_worker_lifecycle::Service::new(
            &cloud_config,
            store.clone(),
            credential.clone(),
        )?;
        if let Some(driver) = cloud_driver {
            cloud = cloud.with_driver(driver);
        }
        tasks.spawn(cloud.serve(ll, shutdown.clone()));
        let mut runner_gateway_stops = vec![];
        let defaults: automesh_desktop_runner_gateway::Config = service_config();
        let config = automesh_desktop_runner_gateway::Config {
            streams: options.runner_streams.clone(),
            connections: options
                .connections
                .clone()
                .unwrap_or(defaults.connections.clone()),
            ..defaults
        };
        for (i, l) in runner_listeners.into_iter().enumerate() {
            // The first replica shares the mesh's pool; the others have
            // their own, as separate processes would.
            let replica_store = if i == 0 {
                store.clone()
            } else {
                Store::connect_lazy(&db.url, automesh_store::StoreOptions::default())?
            };
            let stop = shutdown.child_token();
            runner_gateway_stops.push(stop.clone());
            let replica = automesh_desktop_runner_gateway::Service::new(
                &config,
                replica_store,
                credential.clone(),
            )?;
            tasks.spawn(replica.serve(l, stop));
        }
        let mut config = automesh_gateway::Config {
            upstreams: automesh_gateway::UpstreamAddrs {
                scheduler_addr: scheduler.clone(),
                coordinator_addr: coordinator.clone(),
                lifecycle_addr: lifecycle.clone(),
                runner_gateway_addr: coordinated_gateway.clone(),
            },
            models: automesh_rpc::runtime::Models::of(options.models.clone()),
            ..automesh_rpc::runtime::config_from_args(&[
                "--jwt-secret",
                std::str::from_utf8(JWT_SECRET)?,
            ])?
        };
        if let Some(limits) = &options.connections {
            config.connections = limits.clone();
        }
        let gw = automesh_gateway::Service::new(&config, credential.clone())?;
        tasks.spawn(gw.serve(gl, shutdown.clone()));
        let mesh = Mesh {
            db,
            gateway,
            scheduler,
            coordinator,
            lifecycle,
            runner_gateway,
            runner_gateway_internal,
            runner_gateways,
            runner_gateway_internals,
            runner_gateway_stops,
            credential,
            options,
            coordinators,
            shutdown,
            tasks,
        };
        mesh.wait_serving(&mesh.gateway, Duration::from_secs(30))
            .await?;
        Ok(mesh)
    }

    pub fn store(&self) -> &Store {
        &self.db.store
    }

    /// A run's first thousand events, as stored.
    pub async fn events(&self, run_id: &str) -> Vec<automesh_domain::RunEvent> {
        self.store()
            .internal()
            .events(run_id, 0, 1000)
            .await
            .expect("events")
    }

    /// A run's receipt; panics when it has none.
    pub async fn receipt(&self, run_id: &str) -> automesh_domain::Receipt {
        self.store()
            .internal()
            .receipt(run_id)
            .await
            .expect("get receipt")
            .expect("a receipt")
    }

    /// Replaces every coordinator with one reading `models`, as an operator
    /// changing the catalogue and restarting the coordinators would.
    pub async fn reprice(&mut self, models: ModelCatalog) -> anyhow::Result<()> {
        for c in self.coordinators.drain(..) {
            c.abort();
            let _ = c.await;
        }
        self.options.models = models;
        self.add_coordinator().await
    }

    /// Starts one more coordinator replica on this mesh's database.
    pub async fn add_coordinator(&mut self) -> anyhow::Result<()> {
        let (l, _) = listener().await?;
        let handle = spawn_coordinator(
            &self.db.store,
            &self.options,
            &self.credential,
            l,
            &self.shutdown,
            &self.runner_gateway_internals[self.runner_gateway_internals.len() - 1],
            &self.lifecycle,
        )?;
        self.coordinators.push(handle);
        Ok(())
    }

    /// Waits (bounded) until `addr` reports SERVING.
    pub async fn wait_serving(&self, addr: &str, within: Duration) -> anyhow::Result<()> {
        wait_for_health(addr, within, true).await
    }

    /// A bearer token for `user` of `org`.
    pub fn token(&self, org: &str, user: &str) -> String {
        automesh_gateway::mint(JWT_SECRET, org, user, chrono::Duration::hours(1)).expect("mint")
    }

    /// A public-API channel that presents `token` (or nothing).
    pub fn channel(&self, token: Option<&str>) -> AuthedChannel {
        let channel = automesh_rpc::client::channel(&self.gateway).expect("channel");
        InterceptedService::new(channel, token.map_or_else(Bearer::none, Bearer::new))
    }

    pub fn automations(&self, token: Option<&str>) -> AutomationsClient<AuthedChannel> {
        AutomationsClient::new(self.channel(token))
    }

    pub fn runs(&self, token: Option<&str>) -> RunsClient<AuthedChannel> {
        RunsClient::new(self.channel(token))
    }

    pub fn notifications(
        &self,
        token: Option<&str>,
    ) -> automesh_proto::v1::notifications_client::NotificationsClient<AuthedChannel> {
        automesh_proto::v1::notifications_client::NotificationsClient::new(self.channel(token))
    }

    /// Creates a daily desktop automation of `user` through the public API
    /// and runs it now; returns the run.
    pub async fn desktop_run_now(&self, org: &str, user: &str) -> automesh_proto::v1::Run {
        self.desktop_run_now_of(org, user, "fake/echo").await
    }

    /// The same, for an automation of `model`.
    pub async fn desktop_run_now_of(
        &self,
        org: &str,
        user: &str,
        model: &str,
    ) -> automesh_proto::v1::Run {
        use automesh_proto::v1 as pb;
        let token = self.token(org, user);
        let mut api = self.automations(Some(&token));
        let mut request = daily_automation("desk", "tidy my downloads", pb::Surface::Desktop);
        if let Some(a) = request.automation.as_mut() {
            a.model = model.into();
        }
        let a = api.create(request).await;
        api.run_now(&a.id, "k").await
    }

    /// Waits (bounded by `within`) until the run is terminal.
    pub async fn until_terminal(&self, run_id: &str, within: Duration) -> automesh_domain::Run {
        let give_up = tokio::time::Instant::now() + within;
        loop {
            let run = self.store().internal().get_run(run_id).await.expect("run");
            if run.state.is_terminal() {
                return run;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "run did not end within {within:?}: {run:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops every service, waits for them to drain, and removes the database.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(done) = self.tasks.join_next().await {
                done??;
            }
            for c in self.coordinators.drain(..) {
                match c.await {
                    Ok(result) => result?,
                    // A coordinator the test killed.
                    Err(e) if e.is_cancelled() => {}
                    Err(e) => return Err(e.into()),
                }
            }
            anyhow::Ok(())
        })
        .await
        .context("services did not stop within 20 s")??;
        self.db.remove().await?;
        Ok(())
    }
}

fn spawn_coordinator(
    store: &Store,
    options: &MeshOptions,
    credential: &InternalCredential,
    listener: TcpListener,
    shutdown: &CancellationToken,
    runner_gateway: &str,
    lifecycle: &str,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    // Each placement goes to its real executor where the options say so,
    // else to the test executor; without either, the coordinators execute
    // no runs of that placement (its runs stay pending).
    let desktop = if options.desktop_via_runner_gateway {
        Some(runner_gateway.to_owned())
    } else {
        options.executor.clone()
    };
    let cloud = if options.cloud.is_some() {
        Some(lifecycle.to_owned())
    } else {
        options.executor.clone()
    };
    let placements = [
        (automesh_domain::Placement::Desktop, &desktop),
        (automesh_domain::Placement::Cloud, &cloud),
    ]
    .into_iter()
    .filter_map(|(p, executor)| executor.as_ref().map(|_| p))
    .collect();
    let config = automesh_run_coordinator::Config {
        desktop_executor_addr: desktop,
        cloud_executor_addr: cloud,
        placements,
        lease: options.lease,
        cancel_bound: options.cancel_bound,
        claim_poll: options.claim_poll,
        max_runs: options.max_runs,
        models: automesh_rpc::runtime::Models::of(options.models.clone()),
        ..service_config()
    };
    let coordinator =
        automesh_run_coordinator::Service::new(&config, store.clone(), credential.clone())?;
    Ok(tokio::spawn(coordinator.serve(listener, shutdown.clone())))
}

/// Sends `body` (already protobuf-encoded, possibly invalid) as one unary
/// call to `path` on `addr`, as a client that writes its own bytes would;
/// returns the raw answer.
pub async fn raw_unary(
    addr: &str,
    path: &'static str,
    body: Vec<u8>,
    token: Option<&str>,
) -> Result<Vec<u8>, tonic::Status> {
    #[derive(Debug, Clone, Default)]
    struct Raw;
    #[derive(Debug, Clone, Default)]
    struct RawEncoder;
    #[derive(Debug, Clone, Default)]
    struct RawDecoder;
    impl tonic::codec::Encoder for RawEncoder {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn encode(
            &mut self,
            item: Vec<u8>,
            buf: &mut tonic::codec::EncodeBuf<'_>,
        ) -> Result<(), tonic::Status> {
            use bytes_put::Put;
            buf.put(item.as_slice());
            Ok(())
        }
    }
    impl tonic::codec::Decoder for RawDecoder {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn decode(
            &mut self,
            buf: &mut tonic::codec::DecodeBuf<'_>,
        ) -> Result<Option<Vec<u8>>, tonic::Status> {
            use bytes_put::Take;
            Ok(Some(buf.take_all()))
        }
    }
    impl tonic::codec::Codec for Raw {
        type Encode = Vec<u8>;
        type Decode = Vec<u8>;
        type Encoder = RawEncoder;
        type Decoder = RawDecoder;
        fn encoder(&mut self) -> RawEncoder {
            RawEncoder
        }
        fn decoder(&mut self) -> RawDecoder {
            RawDecoder
        }
    }
    let channel = automesh_rpc::client::channel(addr).expect("channel");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut request = tonic::Request::new(body);
    if let Some(t) = token {
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {t}").parse().expect("ascii"),
        );
    }
    grpc.unary(request, http::uri::PathAndQuery::from_static(path), Raw)
        .await
        .map(tonic::Response::into_inner)
}

/// The few `bytes::Buf`/`BufMut` calls `raw_unary` needs, through tonic's
/// own re-exports.
mod bytes_put {
    pub trait Put {
        fn put(&mut self, bytes: &[u8]);
    }
    impl Put for tonic::codec::EncodeBuf<'_> {
        fn put(&mut self, bytes: &[u8]) {
            use prost::bytes::BufMut;
            self.put_slice(bytes);
        }
    }
    pub trait Take {
        fn take_all(&mut self) -> Vec<u8>;
    }
    impl Take for tonic::codec::DecodeBuf<'_> {
        fn take_all(&mut self) -> Vec<u8> {
            use prost::bytes::Buf;
            let mut out = vec![0; self.remaining()];
            self.copy_to_slice(&mut out);
            out
        }
    }
}

/// The services `addr` lists through server reflection (v1), sorted.
pub async fn reflected_services(addr: &str) -> Vec<String> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut client =
        ServerReflectionClient::new(automesh_rpc::client::channel(addr).expect("channel"));
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection")
        .into_inner();
    let response = stream.message().await.expect("answer").expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer {response:?}");
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    names
}

/// A request creating a daily automation (09:00 UTC) of `name` with
/// `prompt`, from `surface`.
pub fn daily_automation(
    name: &str,
    prompt: &str,
    surface: automesh_proto::v1::Surface,
) -> automesh_proto::v1::CreateAutomationRequest {
    use automesh_proto::v1 as pb;
    pb::CreateAutomationRequest {
        automation: Some(pb::Automation {
            name: name.into(),
            prompt: prompt.into(),
            model: "fake/echo".into(),
            schedule: Some(pb::Schedule {
                kind: Some(pb::schedule::Kind::Daily(pb::DailySchedule {
                    time_of_day: Some(pb::TimeOfDay {
                        hours: 9,
                        minutes: 0,
                    }),
                    time_zone: "UTC".into(),
                })),
            }),
            ..Default::default()
        }),
        surface: surface as i32,
    }
}

/// How many of `events` are assistant text.
pub fn assistant_texts(events: &[automesh_domain::RunEvent]) -> usize {
    events
        .iter()
        .filter(|e| {
            matches!(
                e.payload,
                automesh_domain::RunEventPayload::AssistantText { .. }
            )
        })
        .count()
}

/// Reads `stream` to its end, within `within`: the status it ended with, or
/// `None` when it ended cleanly; panics naming `what` when it did not end.
pub async fn end_of<T>(
    stream: &mut tonic::Streaming<T>,
    within: Duration,
    what: &str,
) -> Option<tonic::Status> {
    tokio::time::timeout(within, async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(status) => return Some(status),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within {within:?}"))
}

/// `message` as a request carrying `Authorization: Bearer <token>`.
pub fn with_bearer<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("ascii"),
    );
    request
}

/// The two public calls nearly every test makes, on any client of
/// `automesh.v1.Automations` (an in-process mesh's or a process cluster's):
/// each panics naming what failed.
#[allow(async_fn_in_trait)]
pub trait Api {
    /// Creates an automation; returns it as stored.
    async fn create(
        &mut self,
        request: automesh_proto::v1::CreateAutomationRequest,
    ) -> automesh_proto::v1::Automation;

    /// Runs automation `id` now under idempotency key `key`; returns the run.
    async fn run_now(&mut self, id: &str, key: &str) -> automesh_proto::v1::Run;
}

impl<T> Api for AutomationsClient<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    async fn create(
        &mut self,
        request: automesh_proto::v1::CreateAutomationRequest,
    ) -> automesh_proto::v1::Automation {
        self.create_automation(request)
            .await
            .expect("create")
            .into_inner()
            .automation
            .expect("automation")
    }

    async fn run_now(&mut self, id: &str, key: &str) -> automesh_proto::v1::Run {
        self.run_automation_now(automesh_proto::v1::RunAutomationNowRequest {
            id: id.into(),
            idempotency_key: key.into(),
        })
        .await
        .expect("run now")
        .into_inner()
        .run
        .expect("run")
    }
}

/// The run calls tests make on any client of `automesh.v1.Runs`.
#[allow(async_fn_in_trait)]
pub trait RunsApi {
    /// Asks for run `id` to be cancelled; returns the run as it now is.
    async fn cancel(&mut self, id: &str) -> automesh_proto::v1::Run;
}

impl<T> RunsApi for RunsClient<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    async fn cancel(&mut self, id: &str) -> automesh_proto::v1::Run {
        self.cancel_run(automesh_proto::v1::CancelRunRequest { id: id.into() })
            .await
            .expect("cancel")
            .into_inner()
            .run
            .expect("run")
    }
}

/// Polls `check` every 50 ms until it yields a value; fails the test,
/// naming `what`, after `within`.
pub async fn wait_for<T, F, Fut>(within: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let give_up = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded by `within`) until the run exists and is terminal (a
/// scheduled run exists only once its occurrence fell due).
pub async fn until_ended(store: &Store, run_id: &str, within: Duration) -> automesh_domain::Run {
    let give_up = tokio::time::Instant::now() + within;
    loop {
        let run = store.internal().get_run(run_id).await.ok();
        if let Some(run) = &run
            && run.state.is_terminal()
        {
            return run.clone();
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "run {run_id} did not end within {within:?}: {run:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub use automesh_rpc::client::{Bearer, wait_for_health};

pub type AuthedChannel = InterceptedService<Channel, Bearer>;

/// Instantiates an async test once per backend, as `<name>::sqlite` and
/// `<name>::postgres`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$name(automesh_store::Backend::Sqlite).await;
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name(automesh_store::Backend::Postgres).await;
                }
            }
        )*
    };
}

/// The sum of the samples of `name` in Prometheus text `text` whose labels
/// include `labels`.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name
                && labels
                    .iter()
                    .all(|(k, want)| rest.contains(&format!("{k}=\"{want}\""))))
            .then(|| v.parse::<f64>().ok())
            .flatten()
        })
        .sum()
}
