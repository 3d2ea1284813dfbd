//! The automesh store: one set of SQL queries over PostgreSQL (production)
//! and SQLite (the embedded default for `dev` mode), through sqlx's `Any`
//! driver, with the schema in `migrations/<backend>/`.
//!
//! The queries keep to the dialect both backends share: `$n` parameters,
//! `ON CONFLICT`, `RETURNING`, `UPDATE … FROM`, instants as BIGINT
//! microseconds and ids as text. Every write the writer commits is one
//! bulk statement per step, whose input relation `bulk!` spells per
//! backend (`sql.rs`). What else differs (row locks, asynchronous commit)
//! is a short list of backend-specific statements a tidy test names.
//! Queries are grouped per aggregate, one module each.
//!
//! Correctness across service replicas comes from here — unique keys,
//! guarded updates, row locks — never from in-memory state.

pub mod automations;
pub mod cloud;
pub mod desktop;
mod error;
pub mod events;
mod keys;
pub mod leases;
mod migrations;
pub mod notifications;
pub mod page;
pub mod receipts;
pub mod retention;
mod rows;
pub mod runners;
pub mod runs;
pub mod scheduling;
mod signal;
mod sql;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod workers;
mod writer;

use std::time::Duration;

use sqlx::any::{AnyPoolOptions, install_default_drivers};
use sqlx::{Any, AnyPool, Executor, Transaction};

pub use error::{Result, StoreError};
pub use signal::{
    AssignmentState, DesktopListener, DesktopNote, Heard, LISTEN_APPLICATION_NAME, RunWatcher,
    Topic, Watcher,
};
pub use writer::{replayed, statements, written};

/// Which database a store talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

impl Backend {
    /// The backend a connection URL names.
    pub fn from_url(url: &str) -> Result<Backend> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else if url.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else {
            Err(StoreError::UnsupportedUrl)
        }
    }
}

/// Pool settings.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub max_connections: u32,
    /// Bound on waiting for a pooled connection.
    pub acquire_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
        }
    }
}

impl StoreOptions {
    /// The defaults, with the pool size from `AUTOMESH_DATABASE_POOL` when
    /// it is set: how an operator fits every replica's pool inside the
    /// server's connection limit.
    pub fn from_env() -> Self {
        let mut options = Self::default();
        if let Some(n) = std::env::var("AUTOMESH_DATABASE_POOL")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|n| *n > 0)
        {
            options.max_connections = n;
        }
        options
    }
}

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    url: std::sync::Arc<str>,
    /// The group-commit writer of this store's hot-path writes, started on
    /// first use (`writer.rs`).
    writer: std::sync::Arc<std::sync::OnceLock<writer::Writer>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.backend)
            .finish()
    }
}

/// How long a pooled connection may idle and still be handed out
/// untested.
const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

impl Store {
    /// Opens a pool without connecting yet: a service can start, report
    /// NOT_SERVING, and become ready once the database answers.
    pub fn connect_lazy(url: &str, options: StoreOptions) -> Result<Store> {
        install_default_drivers();
        let backend = Backend::from_url(url)?;
        let mut pool = AnyPoolOptions::new()
            .max_connections(match backend {
                Backend::Postgres => options.max_connections,
                // One writer at a time anyway; a few readers under WAL.
                Backend::Sqlite => options.max_connections.min(8),
            })
            .acquire_timeout(options.acquire_timeout)
            // A connection used within the last second is handed out as
            // it is; one idle longer is pinged first (one that fails is
            // replaced). Pinging every one would add a round trip to every
            // query on the hot path.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > PING_IDLE_AFTER {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            });
        if backend == Backend::Postgres {
            // No statement or lock wait may hang a service: both are
            // bounded. Each statement is prepared once per connection
            // (sqlx caches it) and planned once with it: a custom plan per
            // execution, which PostgreSQL may keep choosing, costs more than
            // most of these statements take to run.
            pool = pool.after_connect(|conn, _meta| {
                Box::pin(async move {
                    conn.execute(
                        "SET statement_timeout = '30s'; SET lock_timeout = '10s'; \
                         SET plan_cache_mode = force_generic_plan;",
                    )
                    .await?;
                    Ok(())
                })
            });
        }
        if backend == Backend::Sqlite {
            pool = pool.after_connect(|conn, _meta| {
                Box::pin(async move {
                    conn.execute(
                        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
                         PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = ON;",
                    )
                    .await?;
                    Ok(())
                })
            });
        }
        let pool = pool.connect_lazy(url)?;
        Ok(Store {
            pool,
            backend,
            url: url.into(),
            writer: Default::default(),
        })
    }

    /// Opens a pool, connects, and applies every migration.
    pub async fn connect_and_migrate(url: &str, options: StoreOptions) -> Result<Store> {
        let store = Store::connect_lazy(url, options)?;
        store.migrate().await?;
        Ok(store)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The connection URL (it may hold a password: never log it).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Applies the migrations of this backend; safe to run concurrently from
    /// several replicas (PostgreSQL takes an advisory lock).
    pub async fn migrate(&self) -> Result<()> {
        migrations::migrator(self.backend)
            .run(&self.pool)
            .await
            .map_err(StoreError::Migrate)
    }

    /// Whether the database answers a trivial query.
    pub async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Whether every migration of this binary has been applied.
    pub async fn is_migrated(&self) -> Result<bool> {
        Ok(self.schema_version().await? == Some(self.known_schema_version()))
    }

    /// The newest migration applied to the database (`None` before any).
    pub async fn schema_version(&self) -> Result<Option<i64>> {
        let applied =
            sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations WHERE success = TRUE")
                .fetch_one(&self.pool)
                .await
                .or_else(|e| match e {
                    // No migrations table yet.
                    sqlx::Error::Database(_) => Ok(None),
                    e => Err(e),
                })?;
        Ok(applied)
    }

    /// The newest migration this binary knows.
    pub fn known_schema_version(&self) -> i64 {
        migrations::latest_version(self.backend)
    }

    /// `SchemaAhead` when the database was migrated by a newer binary than
    /// this one: a service refuses to serve a schema it does not know. An
    /// unreachable database is not refused here (readiness waits for it).
    pub async fn refuse_newer_schema(&self) -> Result<()> {
        let known = self.known_schema_version();
        match self.schema_version().await {
            Ok(Some(database)) if database > known => Err(StoreError::SchemaAhead {
                database,
                binary: known,
            }),
            _ => Ok(()),
        }
    }

    /// The schema this binary knows, or why not: `SchemaAhead` (a newer
    /// binary migrated the database) or `SchemaBehind` (the migration job
    /// has not run yet). A service serves only the schema it knows; it
    /// never migrates it itself.
    pub async fn check_schema(&self) -> Result<()> {
        let known = self.known_schema_version();
        match self.schema_version().await? {
            Some(database) if database > known => Err(StoreError::SchemaAhead {
                database,
                binary: known,
            }),
            Some(database) if database == known => Ok(()),
            database => Err(StoreError::SchemaBehind {
                database,
                binary: known,
            }),
        }
    }

    /// Closes the pool, waiting for connections to be returned.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// The pool itself: an escape hatch for tests and benchmarks that must
    /// check what the schema enforces on its own (feature `testing`).
    #[cfg(any(test, feature = "testing"))]
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// The pool, for this crate's queries.
    pub(crate) fn db(&self) -> &AnyPool {
        &self.pool
    }

    /// The writer that commits hot-path writes in batches.
    pub(crate) fn writer(&self) -> &writer::Writer {
        self.writer
            .get_or_init(|| writer::Writer::start(self.pool.clone(), self.backend))
    }

    /// Batches of this store's writes rolled back because a statement
    /// failed and run again one write per transaction (the process-wide
    /// figure is [`replayed`]); a write its guard refuses is not one.
    pub fn writes_replayed(&self) -> u64 {
        self.writer.get().map_or(0, writer::Writer::replayed)
    }

    /// The id-only reads and writes, for internal callers that act for no
    /// user: see [`Internal`].
    pub fn internal(&self) -> Internal<'_> {
        Internal(self)
    }

    /// Starts a transaction that will write. On SQLite it takes the write
    /// lock up front (`BEGIN IMMEDIATE`), so two writers queue on the busy
    /// timeout instead of failing when a read lock is upgraded.
    /// Reports the pool on `meter`, read at each collection:
    /// `automesh.db.pool.connections` by state (`in_use`, `idle`) and
    /// `automesh.db.pool.max`; and the writers' batching (see
    /// `writer::observe`).
    pub fn observe_pool(&self, meter: &opentelemetry::metrics::Meter) {
        use opentelemetry::KeyValue;
        writer::observe(meter);
        let pool = self.pool.clone();
        let _connections = meter
            .u64_observable_gauge("automesh.db.pool.connections")
            .with_description("Database connections of this process's pool, by state")
            .with_callback(move |o| {
                let open = u64::from(pool.size());
                let idle = u64::try_from(pool.num_idle()).unwrap_or(0).min(open);
                o.observe(open - idle, &[KeyValue::new("state", "in_use")]);
                o.observe(idle, &[KeyValue::new("state", "idle")]);
            })
            .build();
        let pool = self.pool.clone();
        let _max = meter
            .u64_observable_gauge("automesh.db.pool.max")
            .with_description("The most database connections this process's pool opens")
            .with_callback(move |o| o.observe(u64::from(pool.options().get_max_connections()), &[]))
            .build();
    }

    pub(crate) async fn begin_write(&self) -> Result<Transaction<'static, Any>> {
        Ok(match self.backend {
            Backend::Postgres => self.pool.begin().await?,
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
        })
    }
}

/// A readiness probe in the shape `automesh_rpc::server::Probe` expects.
pub type ReadinessProbe = Box<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> + Send + Sync,
>;

impl Store {
    /// Ready means reachable and at the schema this binary knows. A service
    /// never migrates: against an older schema (or none) it is not ready
    /// until the migration job (`automesh migrate`) has run, and says so
    /// by name once; against a newer one it is not ready either (its start
    /// refused it already). Each change of why is logged once.
    pub fn readiness_probe(&self) -> ReadinessProbe {
        let store = self.clone();
        let said = std::sync::Arc::new(parking_lot::Mutex::new(String::new()));
        Box::new(move || {
            let (store, said) = (store.clone(), said.clone());
            Box::pin(async move {
                let why = match store.check_schema().await {
                    Ok(()) => match store.ping().await {
                        Ok(()) => String::new(),
                        Err(error) => format!("database not ready: {error}"),
                    },
                    Err(error) => format!("not serving: {error}"),
                };
                let mut last = said.lock();
                if *last != why {
                    if why.is_empty() {
                        tracing::info!("database reachable at the schema this binary knows");
                    } else {
                        tracing::warn!("{why}");
                    }
                    *last = why.clone();
                }
                why.is_empty()
            })
        })
    }
}

/// The store's id-only reads and writes, for internal callers that act for
/// no user — the coordinator driving a run, the executors, the harnesses.
/// Everything a user's request reaches takes a [`Principal`] on [`Store`]
/// itself (another tenant's object is indistinguishable from a missing
/// one); what is here never checks an owner, so it is reached only through
/// [`Store::internal`], where a reader sees it.
///
/// [`Principal`]: automesh_domain::Principal
#[derive(Debug, Clone, Copy)]
pub struct Internal<'a>(&'a Store);

impl Internal<'_> {
    pub(crate) fn db(&self) -> &AnyPool {
        self.0.db()
    }
}
