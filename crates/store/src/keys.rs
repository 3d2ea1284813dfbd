//! Idempotency keys (`run_keys`): a manual run's key names one run. Its id
//! starts with the instant it was requested (crates/domain/src/ids.rs), so
//! a retry derives another id; the key, claimed in the run's transaction,
//! is what makes the retry find the first run.

use automesh_domain::{Principal, Run, RunTrigger};
use sqlx::AnyConnection;

use crate::rows::{self, col};
use crate::runs::RunRow;
use crate::sql::{Bulk, Input, bulk};
use crate::{Result, Store, StoreError};

bulk! {
    /// A manual run's idempotency key, claimed for the run it names.
    struct KeyRow {
        automation_id: String => TEXT,
        idempotency_key: String => TEXT,
        run_id: String => TEXT,
        created_at: i64 => BIGINT,
    }
}

/// Keys claimed, each unless it names a run already: the runs they name.
const CLAIM: Bulk<KeyRow> = bulk!(KeyRow => [
    "INSERT INTO run_keys (", <KeyRow as Input>::COLUMNS, ") SELECT i.* FROM "
] [
    " WHERE true ON CONFLICT (automation_id, idempotency_key) DO NOTHING RETURNING run_id"
]);

/// The run an automation's idempotency key names.
const KEY_RUN: &str =
    "SELECT run_id FROM run_keys WHERE automation_id = $1 AND idempotency_key = $2";

/// The run `automation_id`'s idempotency key `key` names, if any.
pub(crate) async fn key_run(
    db: &mut AnyConnection,
    automation_id: &str,
    key: &str,
) -> Result<Option<String>> {
    rows::optional(db, KEY_RUN, (automation_id, key), |r| col(r, "run_id")).await
}

/// The key a row claims: a manual run's idempotency key.
pub(crate) fn key_of(row: &RunRow) -> Option<KeyRow> {
    let key = row.idempotency_key.as_ref()?;
    (row.trigger == RunTrigger::Manual.as_str()).then(|| KeyRow {
        automation_id: row.automation_id.clone(),
        idempotency_key: key.clone(),
        run_id: row.id.clone(),
        created_at: row.created_at,
    })
}

/// Claims `keys`, each unless it names a run already: the runs of those
/// claimed.
pub(crate) async fn claim(
    db: &mut AnyConnection,
    keys: &[KeyRow],
) -> Result<std::collections::HashSet<String>> {
    let claimed = CLAIM.all(db, keys, |r| col::<String>(r, "run_id")).await?;
    Ok(claimed.into_iter().collect())
}

impl Store {
    /// The run of `owner`'s automation `automation_id` that idempotency key
    /// `key` named, if a run-now made one.
    pub async fn run_for_key(
        &self,
        owner: &Principal,
        automation_id: &str,
        key: &str,
    ) -> Result<Option<Run>> {
        let mut db = self.db().acquire().await?;
        let Some(id) = key_run(&mut db, automation_id, key).await? else {
            return Ok(None);
        };
        drop(db);
        match self.get_run(owner, &id).await {
            Ok(run) => Ok(Some(run)),
            Err(StoreError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
