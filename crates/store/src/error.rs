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
    #[error("not a page token issued by this service")]
    InvalidPageToken,
    /// A stored value that does not decode into its domain type.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// A database URL that names neither PostgreSQL nor SQLite.
    #[error("unsupported database url: expected postgres:// or sqlite:")]
    UnsupportedUrl,
    #[error("migration failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// A value the database refuses to store, or that no backend accepts
    /// (U+0000 in text, a value out of range). Never worth retrying.
    #[error("value refused: {0}")]
    Refused(String),
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
    /// The database was migrated by a newer binary than this one.
    #[error(
        "the database schema is at version {database}, newer than this binary knows ({binary}): \
         run a binary at least as new as the one that migrated it"
    )]
    SchemaAhead { database: i64, binary: i64 },
    /// The database's schema is older than this binary's (or absent):
    /// `automesh migrate` (the deployment's migration job) has not run.
    #[error(
        "the database schema is at version {}, older than this binary knows ({binary}): \
         run `automesh migrate` (the deployment's migration job) first",
        database.map_or_else(|| "none (empty)".to_owned(), |v| v.to_string())
    )]
    SchemaBehind { database: Option<i64>, binary: i64 },
}

impl StoreError {
    /// What kind of failure this is for the caller.
    pub fn kind(&self) -> automesh_domain::FailureKind {
        automesh_domain::Failure::kind(self)
    }
}

impl automesh_domain::Failure for StoreError {
    fn field(&self) -> Option<&'static str> {
        matches!(self, StoreError::InvalidPageToken).then_some("page_token")
    }

    fn kind(&self) -> automesh_domain::FailureKind {
        use automesh_domain::FailureKind as K;
        match self {
            StoreError::NotFound => K::NotFound,
            StoreError::VersionConflict { .. } => K::Conflict,
            StoreError::IllegalTransition { .. } | StoreError::Invariant(_) => {
                K::FailedPrecondition
            }
            StoreError::InvalidPageToken | StoreError::Refused(_) => K::InvalidArgument,
            StoreError::Database(_) => K::Unavailable,
            StoreError::Corrupt(_)
            | StoreError::UnsupportedUrl
            | StoreError::Migrate(_)
            | StoreError::SchemaAhead { .. }
            | StoreError::SchemaBehind { .. } => K::Internal,
        }
    }
}

/// Refuses text no backend may store: PostgreSQL cannot hold U+0000 in
/// text, so SQLite is not allowed to either, and both give one answer.
pub(crate) fn storable(texts: &[(&str, &str)]) -> Result<()> {
    match texts.iter().find(|(_, value)| value.contains('\0')) {
        Some((field, _)) => Err(StoreError::Refused(format!(
            "{field} contains the NUL character (U+0000)"
        ))),
        None => Ok(()),
    }
}

/// PostgreSQL's SQLSTATE for a refused CHECK (and the schema's triggers).
const PG_CHECK_VIOLATION: &str = "23514";
/// SQLite's extended result codes for `RAISE(ABORT, …)` in a trigger and a
/// refused CHECK constraint.
const SQLITE_CONSTRAINT_TRIGGER: &str = "1811";
const SQLITE_CONSTRAINT_CHECK: &str = "275";

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            let msg = db.message();
            let code = db.code();
            let code = code.as_deref().unwrap_or_default();
            // The schema's invariants (placement is immutable, a terminal
            // run is final) are triggers: PostgreSQL raises them as
            // check_violation, SQLite as a trigger constraint. A CHECK
            // constraint refusing a value is the same kind of refusal.
            if matches!(
                code,
                PG_CHECK_VIOLATION | SQLITE_CONSTRAINT_TRIGGER | SQLITE_CONSTRAINT_CHECK
            ) {
                return StoreError::Invariant(msg.to_owned());
            }
            // SQLSTATE class 22 (data exception: a character not in the
            // encoding, a value out of range): the data is at fault, not the
            // database; retrying can never succeed.
            if code.starts_with("22") && code.len() == 5 {
                return StoreError::Refused(msg.to_owned());
            }
        }
        StoreError::Database(e)
    }
}

/// The store's result type.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
