//! Helpers the benchmark binaries share.

use automesh_desktop_runner_gateway::stream::Http2;

/// One flag a benchmark takes: its name, what its value is (`None` for a
/// switch; otherwise a positive whole number unless `choices` names the
/// values it takes) and what it does.
pub struct Flag {
    pub name: &'static str,
    pub value: Option<&'static str>,
    pub choices: &'static [&'static str],
    pub help: &'static str,
}

impl Flag {
    /// A flag taking a positive whole number.
    pub const fn count(name: &'static str, help: &'static str) -> Flag {
        Flag {
            name,
            value: Some("N"),
            choices: &[],
            help,
        }
    }

    /// A flag taking no value.
    pub const fn switch(name: &'static str, help: &'static str) -> Flag {
        Flag {
            name,
            value: None,
            choices: &[],
            help,
        }
    }
}

/// `--quick`, which every benchmark takes.
pub const QUICK: Flag = Flag::switch(
    "--quick",
    "the short form CI runs once (figures printed, not checked)",
);

/// `--runner-http2`, for the benchmarks that hold runner streams.
pub const RUNNER_HTTP2: Flag = Flag {
    name: "--runner-http2",
    value: Some("lean|hyper"),
    choices: &["lean", "hyper"],
    help: "what serves the runner listener (default lean)",
};

/// Checks the command line against `flags` before anything starts:
/// `--help` (or `-h`) prints `about` and the flags and exits; an unknown
/// flag, a missing value or one that is not what the flag takes is refused
/// naming it, with exit status 2. The values are then read by [`sized`] and
/// the others.
pub fn check_args(bin: &str, about: &str, flags: &[Flag]) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        let mut u = format!("{about}\n\nUsage: {bin} [FLAGS]\n\nFlags:\n");
        for f in flags {
            let name = match f.value {
                Some(v) => format!("{} {v}", f.name),
                None => f.name.to_owned(),
            };
            u.push_str(&format!("  {name:<26} {}\n", f.help));
        }
        u.push_str(&format!(
            "  {:<26} {}\n",
            "-h, --help", "print this and exit"
        ));
        u
    };
    let refuse = |why: String| -> ! {
        eprintln!("error: {why}\n\n{}", usage());
        std::process::exit(2)
    };
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--help" || a == "-h" {
            print!("{}", usage());
            std::process::exit(0)
        }
        let Some(flag) = flags.iter().find(|f| f.name == a) else {
            refuse(format!("{bin} takes no {a:?}"))
        };
        if let Some(kind) = flag.value {
            let Some(v) = args.get(i + 1) else {
                refuse(format!("{a} needs a value ({kind})"))
            };
            let (ok, takes) = if flag.choices.is_empty() {
                let n = v.parse::<usize>();
                (n.is_ok_and(|n| n > 0), "a positive whole number".to_owned())
            } else {
                let choices = flag.choices.join(", ");
                (
                    flag.choices.contains(&v.as_str()),
                    format!("one of {choices}"),
                )
            };
            if !ok {
                refuse(format!("{a} takes {takes}, not {v:?}"))
            }
            i += 1;
        }
        i += 1;
    }
}

/// The value after `name` on the command line, or `default`.
pub fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `--runner-http2 lean|hyper` (lean unless given): what serves the runner
/// listener, so that the two can be measured in one sitting; with its name
/// as the flag spells it. Any other value is refused, naming the two.
pub fn runner_http2() -> anyhow::Result<(Http2, String)> {
    use clap::ValueEnum as _;
    let args: Vec<String> = std::env::args().collect();
    let http2 = match args.iter().position(|a| a == "--runner-http2") {
        None => Http2::Lean,
        Some(i) => {
            let value = args.get(i + 1).map(String::as_str).unwrap_or_default();
            Http2::from_str(value, false)
                .map_err(|_| anyhow::anyhow!("--runner-http2 takes lean or hyper, not {value:?}"))?
        }
    };
    let name = http2
        .to_possible_value()
        .map(|v| v.get_name().to_owned())
        .unwrap_or_default();
    Ok((http2, name))
}

/// The medians of each half of `pairs`.
pub fn medians(pairs: &[(f64, f64)]) -> (f64, f64) {
    (
        median(pairs.iter().map(|p| p.0).collect()),
        median(pairs.iter().map(|p| p.1).collect()),
    )
}

/// The median (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The `p` quantile (0..=1) of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Whether `--quick` was given: every benchmark's short form, which CI runs
/// once so that none of them rots (its figures are printed, never
/// asserted).
pub fn quick() -> bool {
    std::env::args().any(|a| a == "--quick")
}

/// `full`, or `short` under `--quick`, unless `name` gives a value.
pub fn sized(name: &str, full: usize, short: usize) -> usize {
    arg(name, if quick() { short } else { full })
}

/// PostgreSQL's own single-row commit rate with `clients` connections,
/// each updating its own row for `secs` (what `pgbench` measures with a
/// single-row script), through the same driver as the mesh.
pub async fn pg_commits_per_sec(url: &str, clients: usize, secs: f64) -> anyhow::Result<f64> {
    use sqlx::Connection;
    let mut setup = sqlx::PgConnection::connect(url).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_counter (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)",
    )
    .execute(&mut setup)
    .await?;
    sqlx::query("INSERT INTO bench_counter (id, n) SELECT g, 0 FROM generate_series(0, $1) g ON CONFLICT (id) DO NOTHING")
        .bind(clients as i64)
        .execute(&mut setup)
        .await?;
    let mut conns = vec![];
    for _ in 0..clients {
        conns.push(sqlx::PgConnection::connect(url).await?);
    }
    let stop = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
    let mut tasks = vec![];
    for (id, mut conn) in conns.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while std::time::Instant::now() < stop {
                sqlx::query("UPDATE bench_counter SET n = n + 1 WHERE id = $1")
                    .bind(id as i64)
                    .execute(&mut conn)
                    .await?;
                n += 1;
            }
            anyhow::Ok(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / secs)
}

/// The floors of a dispatch, each the median of 500 in ms: a bare gRPC
/// round trip (a health check) to `addr`, and a single-row commit through
/// `store`'s pool, committed durably; printed as a baseline line.
pub async fn baseline_round_trips(
    addr: &str,
    store: &automesh_store::Store,
) -> anyhow::Result<(f64, f64)> {
    let (rtt, tx) = round_trips(addr, store, 500, std::time::Duration::ZERO).await?;
    println!(
        "baseline  bare gRPC round trip (health) p50 {rtt:>7.3} ms   PostgreSQL single-row tx p50 {tx:>7.3} ms"
    );
    Ok((rtt, tx))
}

/// The same floors measured `gap` apart, as occurrences due one at a time
/// are (medians of `samples` each): on a virtual machine a round trip to a
/// process that sat idle costs several times one made back to back, and a
/// dispatch of a lone occurrence pays it at every hop. Printed as a
/// baseline line.
pub async fn spaced_round_trips(
    addr: &str,
    store: &automesh_store::Store,
    gap: std::time::Duration,
) -> anyhow::Result<(f64, f64)> {
    let samples = if quick() { 10 } else { 100 };
    let (rtt, tx) = round_trips(addr, store, samples, gap).await?;
    println!(
        "baseline  the same, {} ms apart:   gRPC p50 {rtt:>7.3} ms   PostgreSQL single-row tx p50 {tx:>7.3} ms",
        gap.as_millis()
    );
    Ok((rtt, tx))
}

/// Medians (ms) of `samples` health checks to `addr` and of as many durable
/// single-row commits through `store`'s pool, each `gap` after the last.
async fn round_trips(
    addr: &str,
    store: &automesh_store::Store,
    samples: usize,
    gap: std::time::Duration,
) -> anyhow::Result<(f64, f64)> {
    let mut health =
        tonic_health::pb::health_client::HealthClient::new(automesh_rpc::client::channel(addr)?);
    let mut rtt = vec![];
    for _ in 0..samples {
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        let t = std::time::Instant::now();
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await?;
        rtt.push(t.elapsed().as_secs_f64() * 1e3);
    }
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_counter (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    sqlx::query("INSERT INTO bench_counter (id, n) VALUES (0, 0) ON CONFLICT (id) DO NOTHING")
        .execute(store.pool())
        .await?;
    let mut tx = vec![];
    for _ in 0..samples {
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        let t = std::time::Instant::now();
        sqlx::query("UPDATE bench_counter SET n = n + 1 WHERE id = 0")
            .execute(store.pool())
            .await?;
        tx.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((median(rtt), median(tx)))
}

/// The yardstick L: a third of PostgreSQL's single-row commit rate
/// with 32 clients, measured now, on this machine.
pub async fn yardstick(url: &str, secs: f64) -> anyhow::Result<f64> {
    Ok(pg_commits_per_sec(url, 32, secs).await? / 3.0)
}

/// L measured now, the median of `repeats` (short under `--quick`), and
/// printed as the benchmark's baseline line.
pub async fn baseline_yardstick(url: &str, repeats: usize) -> anyhow::Result<f64> {
    let secs = if quick() { 0.5 } else { 3.0 };
    let mut ls = vec![];
    for _ in 0..repeats.max(1) {
        ls.push(yardstick(url, secs).await?);
    }
    let l = median(ls);
    println!(
        "baseline  L = PostgreSQL single-row commits/s with 32 clients ÷ 3: {l:>9.0}   ({:.0} commits/s)",
        3.0 * l
    );
    Ok(l)
}

/// What the database has done so far: transactions committed (read-only
/// ones too) and transactions that wrote (each took a transaction id).
#[derive(Debug, Clone, Copy)]
pub struct DbCounters {
    pub commits: i64,
    pub writes: i64,
}

/// How long the statistics of other sessions take, at most, to reach
/// `pg_stat_database`: a session going idle flushes them unless it did less
/// than a second ago, and then ten seconds later (PostgreSQL 15's
/// `PGSTAT_IDLE_INTERVAL`). Read before and after the work, that long after
/// everything else went quiet, the counters miss none of its commits.
/// Under `--quick` a second, to keep CI short: its counts may then miss
/// some (its figures are not read).
pub fn stats_settle() -> std::time::Duration {
    if quick() {
        std::time::Duration::from_millis(1100)
    } else {
        std::time::Duration::from_millis(10_500)
    }
}

/// A due instant `ms` after [`stats_settle`]: the counters are read
/// settled before the burst falls due.
pub fn settle_then(ms: i64) -> chrono::Duration {
    chrono::Duration::from_std(stats_settle()).unwrap_or_default()
        + chrono::Duration::milliseconds(ms)
}

impl DbCounters {
    /// [`stats_settle`] from now, called once the work (or what came before
    /// it) went quiet.
    pub async fn settled(url: &str) -> anyhow::Result<DbCounters> {
        use sqlx::Connection;
        tokio::time::sleep(stats_settle()).await;
        let mut c = sqlx::PgConnection::connect(url).await?;
        let (commits, writes): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()), \
             pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
        )
        .fetch_one(&mut c)
        .await?;
        Ok(DbCounters { commits, writes })
    }

    /// What happened since `before`, per `runs`: (commits, writes).
    pub fn per_run(&self, before: DbCounters, runs: usize) -> (f64, f64) {
        let n = runs.max(1) as f64;
        (
            (self.commits - before.commits) as f64 / n,
            (self.writes - before.writes) as f64 / n,
        )
    }
}

/// Mints a runner token for `owner` (the `i`th of a benchmark).
pub async fn mint_runner(
    store: &automesh_store::Store,
    owner: &automesh_domain::Principal,
    i: usize,
) -> anyhow::Result<String> {
    let token = format!("amr_bench_{}_{i}", uuid::Uuid::new_v4().simple());
    store
        .create_runner(
            owner,
            &automesh_domain::ids::new_runner_id(),
            &format!("bench {i}"),
            &automesh_desktop_runner_gateway::hash_token(&token),
            chrono::Utc::now(),
        )
        .await?;
    Ok(token)
}

/// What a benchmark's stub runners report: streams welcomed and ended, and
/// each assignment as it arrives (run id, instant).
#[derive(Clone)]
pub struct StubRunners {
    pub welcomed: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub ended: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub assignments: tokio::sync::mpsc::UnboundedSender<(String, chrono::DateTime<chrono::Utc>)>,
    /// HTTP/2 PING liveness (as the reference runner asks), or heartbeats.
    pub ping_liveness: bool,
    /// Why streams ended: the cause's first words, and how many.
    causes: std::sync::Arc<parking_lot::Mutex<std::collections::BTreeMap<String, usize>>>,
}

/// Received assignments, as [`StubRunners`] reports them.
pub type Assigned = tokio::sync::mpsc::UnboundedReceiver<(String, chrono::DateTime<chrono::Utc>)>;

impl StubRunners {
    pub fn new(ping_liveness: bool) -> (StubRunners, Assigned) {
        let (assignments, assigned) = tokio::sync::mpsc::unbounded_channel();
        (
            StubRunners {
                welcomed: Default::default(),
                ended: Default::default(),
                assignments,
                ping_liveness,
                causes: Default::default(),
            },
            assigned,
        )
    }

    /// Streams alive now.
    pub fn alive(&self) -> usize {
        use std::sync::atomic::Ordering;
        let welcomed = self.welcomed.load(Ordering::SeqCst);
        welcomed - self.ended.load(Ordering::SeqCst).min(welcomed)
    }

    /// Why streams ended so far, e.g. `connect: … (12)`; empty if none did.
    pub fn ended_causes(&self) -> String {
        self.causes
            .lock()
            .iter()
            .map(|(k, n)| format!("{k}… ({n})"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Streams welcomed or ended so far.
    pub fn settled(&self) -> usize {
        use std::sync::atomic::Ordering;
        self.welcomed.load(Ordering::SeqCst) + self.ended.load(Ordering::SeqCst)
    }

    /// One runner stream at `addr` with `token`, written against the proto:
    /// Hello, heartbeats at the interval the gateway asks for unless it
    /// granted PING liveness, and a stub engine that answers at once: an
    /// assignment is accepted, and once confirmed finished as succeeded.
    /// Returns when the stream ends.
    pub async fn hold(self, addr: String, token: String) {
        use automesh_proto::runner::v1 as rpb;
        use automesh_proto::runner::v1::connect_request::Message as Up;
        use automesh_proto::runner::v1::connect_response::Message as Down;
        use std::sync::atomic::Ordering;
        // Every end is counted by its cause (the first of each kind is
        // printed whole): a benchmark that loses streams shows why.
        let ended = |why: &dyn std::fmt::Display| {
            self.ended.fetch_add(1, Ordering::SeqCst);
            let why = why.to_string();
            let kind: String = why.chars().take(60).collect();
            {
                let mut causes = self.causes.lock();
                let n = causes.entry(kind).or_default();
                if *n == 0 {
                    eprintln!("bench: a runner stream ended: {why}");
                }
                *n += 1;
            }
        };
        let endpoint = match tonic::transport::Endpoint::from_shared(addr) {
            Ok(e) => e,
            Err(e) => return ended(&e),
        };
        let channel = match endpoint.connect().await {
            Ok(c) => c,
            Err(e) => return ended(&format!("connect: {e:?}")),
        };
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let up = |m: Up| rpb::ConnectRequest { message: Some(m) };
        let _ = tx
            .send(up(Up::Hello(rpb::Hello {
                runner_version: "bench".into(),
                held_runs: vec![],
                ping_liveness: self.ping_liveness,
            })))
            .await;
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        if let Ok(v) = format!("Bearer {token}").parse() {
            request.metadata_mut().insert("authorization", v);
        }
        let response =
            match rpb::desktop_runner_service_client::DesktopRunnerServiceClient::new(channel)
                .connect(request)
                .await
            {
                Ok(r) => r,
                Err(e) => return ended(&format!("Connect: {e}")),
            };
        let mut inbound = response.into_inner();
        let mut heartbeats = true;
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(3));
        loop {
            let sent = tokio::select! {
                m = inbound.message() => match m {
                    Ok(Some(rpb::ConnectResponse { message: Some(m) })) => match m {
                        Down::Welcome(w) => {
                            self.welcomed.fetch_add(1, Ordering::SeqCst);
                            heartbeats = !w.ping_liveness;
                            if let Some(d) = w.heartbeat_interval.and_then(|d| std::time::Duration::try_from(d).ok()) {
                                tick = tokio::time::interval(d);
                            }
                            Ok(())
                        }
                        Down::Assignment(a) => {
                            let _ = self.assignments.send((a.run_id.clone(), chrono::Utc::now()));
                            tx.send(up(Up::AssignmentAccepted(rpb::AssignmentAccepted { run_id: a.run_id }))).await
                        }
                        Down::AssignmentConfirmed(c) => {
                            tx.send(up(Up::RunFinished(rpb::RunFinished {
                                run_id: c.run_id,
                                outcome: automesh_proto::v1::RunState::Succeeded as i32,
                                engine: "bench".into(),
                                ..Default::default()
                            }))).await
                        }
                        _ => Ok(()),
                    },
                    Ok(Some(_)) => Ok(()),
                    Ok(None) => return ended(&"closed by the gateway"),
                    Err(e) => return ended(&format!("stream: {e}")),
                },
                _ = tick.tick(), if heartbeats => {
                    tx.send(up(Up::Heartbeat(rpb::Heartbeat { send_time: None }))).await
                }
            };
            if sent.is_err() {
                return ended(&"the outbound queue closed");
            }
        }
    }
}

/// Creates `count` once-automations of `prefix` on `surface`, owned by
/// `owner(i)`, far in the future, then
/// makes them due at `due(i)` — instants it asks for only once they all
/// exist, so that creating them never eats into the measured time.
pub async fn insert_due(
    store: &automesh_store::Store,
    prefix: &str,
    count: usize,
    surface: automesh_domain::Surface,
    owner: impl Fn(usize) -> automesh_domain::Principal,
    due: impl Fn(usize, chrono::DateTime<chrono::Utc>) -> chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<Vec<chrono::DateTime<chrono::Utc>>> {
    let now = chrono::Utc::now();
    let far = now + chrono::Duration::days(3650);
    for i in 0..count {
        let at = far;
        let new = automesh_domain::automation::NewAutomation {
            pause_after_failures: automesh_domain::automation::DEFAULT_PAUSE_AFTER_FAILURES,
            budget: Default::default(),
            monthly_budget_micros: None,
            id: format!("{prefix}-{i:05}"),
            owner: owner(i),
            name: format!("bench {i}"),
            prompt: "p".into(),
            model: "fake/echo".into(),
            surface,
            schedule: automesh_domain::Schedule::Once { at },
        };
        store.create_automation(&new, Some(at), now).await?;
    }
    // Due from a second after the last one is due-dated.
    let base = chrono::Utc::now() + chrono::Duration::milliseconds(1000 + 2 * count as i64);
    let mut dues = vec![];
    for i in 0..count {
        let at = due(i, base);
        let record =
            automesh_domain::schedule::ScheduleRecord::from(&automesh_domain::Schedule::Once {
                at,
            });
        sqlx::query("UPDATE automations SET next_run_at = $1, schedule = $2 WHERE id = $3")
            .bind(at.timestamp_micros())
            .bind(serde_json::to_string(&record)?)
            .bind(format!("{prefix}-{i:05}"))
            .execute(store.pool())
            .await?;
        dues.push(at);
    }
    Ok(dues)
}

/// When the last run of a burst was created, started and ended (its last
/// transition), in milliseconds after the burst's due instant.
#[derive(Debug, Clone, Copy)]
pub struct LastRun {
    pub created: f64,
    pub started: f64,
    pub ended: f64,
}

/// [`LastRun`] of the runs of `prefix`, due at `due`.
pub async fn last_run(
    store: &automesh_store::Store,
    prefix: &str,
    due: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<LastRun> {
    let (created, started, ended): (i64, Option<i64>, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT MAX(created_at), MAX(started_at), MAX(updated_at) FROM runs WHERE automation_id LIKE '{prefix}-%'"
    )))
    .fetch_one(store.pool())
    .await?;
    let after = |micros: i64| (micros - due.timestamp_micros()) as f64 / 1000.0;
    Ok(LastRun {
        created: after(created),
        started: after(started.unwrap_or(created)),
        ended: after(ended),
    })
}

impl LastRun {
    /// Runs per second of a burst of `runs` that ended with this run.
    pub fn rate(&self, runs: usize) -> f64 {
        runs as f64 / (self.ended / 1000.0).max(1e-3)
    }
}

/// A process's command name and CPU time (user + system, in seconds) so
/// far, from its `/proc/<pid>/stat` text.
pub fn proc_cpu(stat: &str) -> Option<(&str, f64)> {
    // The command name is in parentheses and may hold spaces.
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of the whole line, in the kernel's
    // clock ticks (1/100 s on Linux).
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some((comm, ticks as f64 / 100.0))
}

/// CPU time used so far (user and system, in seconds) by every PostgreSQL
/// process on this machine and by this process: where a run's cost goes,
/// less sensitive to a shared machine's load than a rate.
#[derive(Debug, Clone, Copy)]
pub struct CpuTimes {
    pub postgres: f64,
    pub this: f64,
}

impl CpuTimes {
    pub fn now() -> CpuTimes {
        let this = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| proc_cpu(&s).map(|(_, secs)| secs))
            .unwrap_or(0.0);
        let mut postgres = 0.0;
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
                if let Some(("postgres", secs)) = proc_cpu(&stat) {
                    postgres += secs;
                }
            }
        }
        CpuTimes { postgres, this }
    }

    /// Milliseconds of CPU per run since `before`: (PostgreSQL, this process).
    pub fn per_run(&self, before: CpuTimes, runs: usize) -> (f64, f64) {
        let n = runs.max(1) as f64;
        (
            (self.postgres - before.postgres) * 1000.0 / n,
            (self.this - before.this) * 1000.0 / n,
        )
    }
}
