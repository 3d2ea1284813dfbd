//! Queries of per-user cloud workers.

use automesh_domain::ids::new_worker_id;
use automesh_domain::{CloudWorker, Principal};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::rows::{instant, micros, opt_instant, opt_text, parsed, text};
use crate::{Result, Store, StoreError};

const INSERT: &str = "INSERT INTO cloud_workers (id, org_id, owner_id, state, driver, endpoint, \
     last_active_at, created_at, updated_at) VALUES ($1, $2, $3, 'stopped', $4, NULL, NULL, $5, $5) \
     ON CONFLICT (org_id, owner_id) DO NOTHING";

const GET_BY_OWNER: &str = "SELECT id, org_id, owner_id, state, driver, endpoint, last_active_at, \
     created_at, updated_at FROM cloud_workers WHERE org_id = $1 AND owner_id = $2";

fn decode(row: &AnyRow) -> Result<CloudWorker> {
    Ok(CloudWorker {
        id: text(row, "id")?,
        org_id: text(row, "org_id")?,
        owner_id: text(row, "owner_id")?,
        state: parsed(row, "state")?,
        driver: text(row, "driver")?,
        endpoint: opt_text(row, "endpoint")?,
        last_active_at: opt_instant(row, "last_active_at")?,
        created_at: instant(row, "created_at")?,
        updated_at: instant(row, "updated_at")?,
    })
}

impl Store {
    /// Records that `owner` has a cloud worker (stopped), unless they already
    /// have one; returns the stored worker either way.
    pub async fn register_worker(
        &self,
        owner: &Principal,
        driver: &str,
        now: DateTime<Utc>,
    ) -> Result<CloudWorker> {
        sqlx::query(INSERT)
            .bind(new_worker_id())
            .bind(&owner.org_id)
            .bind(&owner.user_id)
            .bind(driver)
            .bind(micros(now))
            .execute(self.db())
            .await?;
        self.get_worker(owner).await?.ok_or(StoreError::NotFound)
    }

    /// `owner`'s cloud worker, if they have one.
    pub async fn get_worker(&self, owner: &Principal) -> Result<Option<CloudWorker>> {
        sqlx::query(GET_BY_OWNER)
            .bind(&owner.org_id)
            .bind(&owner.user_id)
            .fetch_optional(self.db())
            .await?
            .as_ref()
            .map(decode)
            .transpose()
    }
}
