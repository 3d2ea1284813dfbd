//! The store's error type.

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No such row within the caller's scope.
    #[error("not found")]
    NotFound,
    /// A guarded write lost: the stored version is not the expected one.
    #[error("version conflict: stored version is {current}")]
    VersionConflict { current: i64 },
    /// A run transition that its current state does not allow.
    #[error("illegal run transition from {from} to {to}")]
    IllegalTransition { from: String, to: String },
    /// A write the schema's invariants refuse (placement change, terminal run).
    #[error("invariant violated: {0}")]
    Invariant(String),
    /// A page token that this store did not issue.
    #[error("invalid page token")]
    InvalidPageToken,
    /// A stored value that does not decode into its domain type.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// A database URL that names neither PostgreSQL nor SQLite.
    #[error("unsupported database url: expected postgres:// or sqlite:")]
    UnsupportedUrl,
    #[error("migration failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            let msg = db.message();
            if msg.contains("placement is immutable") || msg.contains("is terminal") {
                return StoreError::Invariant(msg.to_owned());
            }
        }
        StoreError::Database(e)
    }
}

/// The store's result type.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
