//! Throw-away databases for tests: a fresh SQLite file, or a fresh
//! PostgreSQL database created on the server named by
//! `AUTOMESH_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`).
//!
//! An unreachable PostgreSQL fails the test: the suite never skips silently.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::any::install_default_drivers;
use sqlx::{AnyConnection, Connection, Executor};

use crate::{Backend, Result, Store, StoreError, StoreOptions};

/// The admin URL of the PostgreSQL server tests create databases on.
pub fn postgres_admin_url() -> String {
    std::env::var("AUTOMESH_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn unique_suffix() -> String {
    format!(
        "{}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        uuid::Uuid::new_v4()
            .simple()
            .to_string()
            .get(..8)
            .unwrap_or("0")
    )
}

/// A migrated, empty database that is removed by [`TestDatabase::remove`].
#[derive(Debug)]
pub struct TestDatabase {
    pub store: Store,
    /// The URL services under test connect to.
    pub url: String,
    cleanup: Cleanup,
}

#[derive(Debug)]
enum Cleanup {
    File(PathBuf),
    Database { admin_url: String, name: String },
}

impl TestDatabase {
    /// A fresh database on `backend`.
    pub async fn new(backend: Backend) -> Result<TestDatabase> {
        match backend {
            Backend::Sqlite => Self::sqlite().await,
            Backend::Postgres => Self::postgres().await,
        }
    }

    /// A fresh SQLite file in the system temp directory.
    pub async fn sqlite() -> Result<TestDatabase> {
        let path = std::env::temp_dir().join(format!("automesh-test-{}.db", unique_suffix()));
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let store = Store::connect_and_migrate(&url, StoreOptions::default()).await?;
        Ok(TestDatabase {
            store,
            url,
            cleanup: Cleanup::File(path),
        })
    }

    /// A fresh database on the test PostgreSQL server.
    pub async fn postgres() -> Result<TestDatabase> {
        install_default_drivers();
        let admin_url = postgres_admin_url();
        let mut admin = AnyConnection::connect(&admin_url).await?;
        drop_orphans(&mut admin).await?;
        let name = format!("automesh_test_{}", unique_suffix());
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await?;
        admin.close().await?;
        let url = replace_database(&admin_url, &name)?;
        let options = StoreOptions {
            max_connections: 16,
            ..StoreOptions::default()
        };
        let store = Store::connect_and_migrate(&url, options).await?;
        Ok(TestDatabase {
            store,
            url,
            cleanup: Cleanup::Database { admin_url, name },
        })
    }

    /// The tables that hold `needle` anywhere in a row (PostgreSQL: each
    /// row as text; SQLite: the file and its write-ahead log, byte for
    /// byte, so nothing the database keeps escapes the scan).
    pub async fn tables_holding(&self, needle: &str) -> Result<Vec<String>> {
        match &self.cleanup {
            Cleanup::File(path) => {
                let mut found = vec![];
                for suffix in ["", "-wal"] {
                    let mut p = path.clone().into_os_string();
                    p.push(suffix);
                    let bytes = std::fs::read(&p).unwrap_or_default();
                    if bytes
                        .windows(needle.len().max(1))
                        .any(|w| w == needle.as_bytes())
                    {
                        found.push(format!("the SQLite file{suffix}"));
                    }
                }
                Ok(found)
            }
            Cleanup::Database { .. } => {
                let tables: Vec<String> = sqlx::query_scalar(
                    "SELECT CAST(table_name AS TEXT) FROM information_schema.tables \
                     WHERE table_schema = 'public' AND table_type = 'BASE TABLE'",
                )
                .fetch_all(self.store.db())
                .await?;
                let mut found = vec![];
                for table in tables {
                    let sql = format!(
                        "SELECT COUNT(*) FROM {table} x WHERE strpos(CAST(x AS TEXT), $1) > 0"
                    );
                    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                        .bind(needle)
                        .fetch_one(self.store.db())
                        .await?;
                    if n > 0 {
                        found.push(table);
                    }
                }
                Ok(found)
            }
        }
    }

    /// Runs `sql` as it is (a test moving rows back in time, say); how many
    /// rows it changed.
    pub async fn execute(&self, sql: &str) -> Result<u64> {
        let done = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(self.store.db())
            .await?;
        Ok(done.rows_affected())
    }

    /// Closes the pool and deletes the database.
    pub async fn remove(self) -> Result<()> {
        self.store.close().await;
        match self.cleanup {
            Cleanup::File(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut p = path.clone().into_os_string();
                    p.push(suffix);
                    let _ = std::fs::remove_file(p);
                }
            }
            Cleanup::Database { admin_url, name } => {
                let mut admin = AnyConnection::connect(&admin_url).await?;
                admin
                    .execute(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .await?;
                admin.close().await?;
            }
        }
        Ok(())
    }
}

/// Drops test databases left behind by test processes that no longer run
/// (a panicking test never reaches `remove`).
async fn drop_orphans(admin: &mut AnyConnection) -> Result<()> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT datname::TEXT FROM pg_database WHERE datname LIKE 'automesh_test_%'",
    )
    .fetch_all(&mut *admin)
    .await?;
    for name in names {
        let pid = name
            .strip_prefix("automesh_test_")
            .and_then(|rest| rest.split('_').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        let alive = pid.is_some_and(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists());
        if !alive {
            admin
                .execute(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
                .await?;
        }
    }
    Ok(())
}

fn replace_database(url: &str, name: &str) -> Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let slash = base
        .rfind('/')
        .filter(|i| *i > "postgres://".len())
        .ok_or(StoreError::UnsupportedUrl)?;
    let mut out = format!("{}/{name}", &base[..slash]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

/// The payload of this process's run notifications, which its own run
/// watchers take as no news (tests send it from another pool).
pub fn runs_notification_payload() -> &'static str {
    crate::signal::process_token()
}
