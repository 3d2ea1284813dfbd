//! Queries of per-user cloud workers.

use automesh_domain::ids::new_worker_id;
use automesh_domain::{CloudWorker, Principal};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::rows::{self, micros};
use crate::{Result, Store, StoreError};

const INSERT: &str = "INSERT INTO cloud_workers (id, org_id, owner_id, state, driver, endpoint, \
     last_active_at, created_at, updated_at) VALUES ($1, $2, $3, 'stopped', $4, NULL, NULL, $5, $5) \
     ON CONFLICT (org_id, owner_id) DO NOTHING";

const GET_BY_OWNER: &str = "SELECT id, org_id, owner_id, state, driver, endpoint, last_active_at, \
     created_at, updated_at FROM cloud_workers WHERE org_id = $1 AND owner_id = $2";

fn decode(row: &AnyRow) -> Result<CloudWorker> {
    rows::columns! { row => CloudWorker {
        id, org_id, owner_id, state, driver, endpoint, last_active_at, created_at, updated_at,
    } }
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
        let params = (
            new_worker_id(),
            &owner.org_id,
            &owner.user_id,
            driver,
            micros(now),
        );
        rows::execute(self.db(), INSERT, params).await?;
        self.get_worker(owner).await?.ok_or(StoreError::NotFound)
    }

    /// `owner`'s cloud worker, if they have one.
    pub async fn get_worker(&self, owner: &Principal) -> Result<Option<CloudWorker>> {
        let params = (&owner.org_id, &owner.user_id);
        rows::optional(self.db(), GET_BY_OWNER, params, decode).await
    }
}
