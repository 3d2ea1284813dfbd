//! Queries of desktop runners and their tokens. Only a SHA-256 of a token is
//! stored; the token itself is shown once, to the user who minted it.

use automesh_domain::{Principal, Runner};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::rows::{self, col, micros};
use crate::{Result, Store};

const INSERT_RUNNER: &str = "INSERT INTO runners (id, org_id, owner_id, name, created_at) \
     VALUES ($1, $2, $3, $4, $5)";

const INSERT_TOKEN: &str =
    "INSERT INTO runner_tokens (token_hash, runner_id, created_at) VALUES ($1, $2, $3)";

const FIND_BY_TOKEN: &str = "SELECT r.id, r.org_id, r.owner_id, r.name, r.created_at, r.revoked_at \
     FROM runner_tokens t JOIN runners r ON r.id = t.runner_id \
     WHERE t.token_hash = $1 AND t.revoked_at IS NULL AND r.revoked_at IS NULL";

const REVOKE_RUNNER: &str = "UPDATE runners SET revoked_at = $4 \
     WHERE id = $1 AND org_id = $2 AND owner_id = $3 AND revoked_at IS NULL";

const REVOKE_TOKENS: &str =
    "UPDATE runner_tokens SET revoked_at = $2 WHERE runner_id = $1 AND revoked_at IS NULL";

const REVOKED_SINCE: &str =
    "SELECT id FROM runners WHERE revoked_at IS NOT NULL AND revoked_at >= $1";

const GET: &str = "SELECT id, org_id, owner_id, name, created_at, revoked_at FROM runners \
     WHERE id = $1 AND org_id = $2 AND owner_id = $3";

/// An owner's live runners with their newest stream, newest runner first.
const LIST: &str = "SELECT r.id, r.name, r.created_at, s.opened_at, s.closed_at, \
     g.seen_at AS holder_seen_at \
     FROM runners r LEFT JOIN runner_streams s ON s.runner_id = r.id \
     LEFT JOIN runner_gateway_replicas g ON g.id = s.holder \
     WHERE r.org_id = $1 AND r.owner_id = $2 AND r.revoked_at IS NULL \
     ORDER BY r.created_at DESC, r.id DESC LIMIT 1000";

/// One of an owner's runners as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerPresence {
    pub id: String,
    pub name: String,
    pub created_at: DateTime<Utc>,
    /// A stream of it is held now: open, and its holding replica beating
    /// within the listing's bound.
    pub connected: bool,
    /// When it was last known to be connected.
    pub last_seen_at: Option<DateTime<Utc>>,
}

fn decode(row: &AnyRow) -> Result<Runner> {
    rows::columns! { row => Runner { id, org_id, owner_id, name, created_at, revoked_at } }
}

impl Store {
    /// Registers a runner of `owner` with the hash of its first token.
    pub async fn create_runner(
        &self,
        owner: &Principal,
        runner_id: &str,
        name: &str,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> Result<Runner> {
        crate::error::storable(&[("runner name", name)])?;
        let (org, user, at) = (&owner.org_id, &owner.user_id, micros(now));
        let mut tx = self.begin_write().await?;
        rows::execute(&mut *tx, INSERT_RUNNER, (runner_id, org, user, name, at)).await?;
        rows::execute(&mut *tx, INSERT_TOKEN, (token_hash, runner_id, at)).await?;
        tx.commit().await?;
        self.get_runner(owner, runner_id).await
    }

    /// Runners revoked at or after `since` (any owner): replicas end the
    /// streams they hold of these.
    pub async fn runners_revoked_since(&self, since: DateTime<Utc>) -> Result<Vec<String>> {
        rows::all(self.db(), REVOKED_SINCE, (micros(since),), |r| col(r, "id")).await
    }

    /// One runner of `owner`.
    pub async fn get_runner(&self, owner: &Principal, runner_id: &str) -> Result<Runner> {
        rows::owned(self.db(), GET, owner, runner_id, decode).await
    }

    /// The live runner whose token hashes to `token_hash`.
    pub async fn find_runner_by_token_hash(&self, token_hash: &str) -> Result<Option<Runner>> {
        rows::optional(self.db(), FIND_BY_TOKEN, (token_hash,), decode).await
    }

    /// `owner`'s runners that are not revoked (at most 1,000, newest first):
    /// connected when its newest stream is open and the replica holding it
    /// beat after `now - stale_after`.
    pub async fn list_runners(
        &self,
        owner: &Principal,
        now: DateTime<Utc>,
        stale_after: chrono::Duration,
    ) -> Result<Vec<RunnerPresence>> {
        let fresh = micros(now - stale_after);
        rows::all(self.db(), LIST, (&owner.org_id, &owner.user_id), |row| {
            let opened: Option<i64> = col(row, "opened_at")?;
            let closed: Option<i64> = col(row, "closed_at")?;
            let holder_seen: Option<i64> = col(row, "holder_seen_at")?;
            // An open stream is seen while its holder beats; a closed one
            // was last seen when it closed.
            let seen = match (opened, closed) {
                (None, _) => None,
                (Some(_), Some(closed)) => Some(closed),
                (Some(opened), None) => Some(holder_seen.unwrap_or(opened).max(opened)),
            };
            Ok(RunnerPresence {
                id: col(row, "id")?,
                name: col(row, "name")?,
                created_at: col(row, "created_at")?,
                connected: opened.is_some()
                    && closed.is_none()
                    && holder_seen.is_some_and(|at| at >= fresh),
                last_seen_at: seen.and_then(DateTime::from_timestamp_micros),
            })
        })
        .await
    }

    /// Revokes a runner of `owner` and every token it has.
    pub async fn revoke_runner(
        &self,
        owner: &Principal,
        runner_id: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let (org, user, at) = (&owner.org_id, &owner.user_id, micros(now));
        let mut tx = self.begin_write().await?;
        if rows::execute(&mut *tx, REVOKE_RUNNER, (runner_id, org, user, at)).await? == 0 {
            tx.rollback().await?;
            // Already revoked is fine; someone else's runner is not found.
            return self.get_runner(owner, runner_id).await.map(|_| ());
        }
        rows::execute(&mut *tx, REVOKE_TOKENS, (runner_id, at)).await?;
        tx.commit().await?;
        Ok(())
    }
}
