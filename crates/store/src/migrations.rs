//! The schema, embedded per backend from `migrations/<backend>/`.

use std::borrow::Cow;

use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};

use crate::Backend;

/// (version, description, PostgreSQL SQL, SQLite SQL), in order.
const MIGRATIONS: &[(i64, &str, &str, &str)] = &[
    (
        1,
        "initial",
        include_str!("../../../migrations/postgres/0001_initial.sql"),
        include_str!("../../../migrations/sqlite/0001_initial.sql"),
    ),
    (
        2,
        "run lifecycle",
        include_str!("../../../migrations/postgres/0002_run_lifecycle.sql"),
        include_str!("../../../migrations/sqlite/0002_run_lifecycle.sql"),
    ),
    (
        3,
        "desktop dispatch",
        include_str!("../../../migrations/postgres/0003_desktop_dispatch.sql"),
        include_str!("../../../migrations/sqlite/0003_desktop_dispatch.sql"),
    ),
    (
        4,
        "cloud dispatch",
        include_str!("../../../migrations/postgres/0004_cloud_dispatch.sql"),
        include_str!("../../../migrations/sqlite/0004_cloud_dispatch.sql"),
    ),
    (
        5,
        "worker claims",
        include_str!("../../../migrations/postgres/0005_worker_claims.sql"),
        include_str!("../../../migrations/sqlite/0005_worker_claims.sql"),
    ),
    (
        6,
        "receipt prices",
        include_str!("../../../migrations/postgres/0006_receipt_prices.sql"),
        include_str!("../../../migrations/sqlite/0006_receipt_prices.sql"),
    ),
    (
        7,
        "runner streams",
        include_str!("../../../migrations/postgres/0007_runner_streams.sql"),
        include_str!("../../../migrations/sqlite/0007_runner_streams.sql"),
    ),
    (
        8,
        "console",
        include_str!("../../../migrations/postgres/0008_console.sql"),
        include_str!("../../../migrations/sqlite/0008_console.sql"),
    ),
    (
        9,
        "failure streaks",
        include_str!("../../../migrations/postgres/0009_failure_streaks.sql"),
        include_str!("../../../migrations/sqlite/0009_failure_streaks.sql"),
    ),
    (
        10,
        "budgets",
        include_str!("../../../migrations/postgres/0010_budgets.sql"),
        include_str!("../../../migrations/sqlite/0010_budgets.sql"),
    ),
    (
        11,
        "notifications",
        include_str!("../../../migrations/postgres/0011_notifications.sql"),
        include_str!("../../../migrations/sqlite/0011_notifications.sql"),
    ),
    (
        12,
        "webhook due index",
        include_str!("../../../migrations/postgres/0012_webhook_due.sql"),
        include_str!("../../../migrations/sqlite/0012_webhook_due.sql"),
    ),
    (
        13,
        "retention",
        include_str!("../../../migrations/postgres/0013_retention.sql"),
        include_str!("../../../migrations/sqlite/0013_retention.sql"),
    ),
    (
        14,
        "run partitions",
        include_str!("../../../migrations/postgres/0014_run_partitions.sql"),
        include_str!("../../../migrations/sqlite/0014_run_partitions.sql"),
    ),
];

pub(crate) fn migrator(backend: Backend) -> Migrator {
    Migrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, description, pg, sqlite)| {
                let sql = match backend {
                    Backend::Postgres => pg,
                    Backend::Sqlite => sqlite,
                };
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    sql.into_sql_str(),
                    false,
                )
            })
            .collect(),
    )
}

pub(crate) fn latest_version(_backend: Backend) -> i64 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}
