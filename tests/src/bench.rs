//! Helpers the benchmark binaries share.

/// The value after `name` on the command line, or `default`.
pub fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
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

/// The yardstick L: a third of PostgreSQL's single-row commit rate
/// with 32 clients, measured now, on this machine.
pub async fn yardstick(url: &str, secs: f64) -> anyhow::Result<f64> {
    Ok(pg_commits_per_sec(url, 32, secs).await? / 3.0)
}

/// What the database has done so far: transactions committed (read-only
/// ones too) and transactions that wrote (each took a transaction id).
#[derive(Debug, Clone, Copy)]
pub struct DbCounters {
    pub commits: i64,
    pub writes: i64,
}

impl DbCounters {
    /// Now. The statistics of other sessions reach `pg_stat_database` when
    /// they go idle (at most a second later): read after the work settled.
    pub async fn read(url: &str) -> anyhow::Result<DbCounters> {
        use sqlx::Connection;
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
