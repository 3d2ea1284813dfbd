//! Queries of webhook endpoints and their outbox (see
//! `migrations/*/0011_notifications.sql`). A notice is written, one
//! message per endpoint of its owner, in the transaction of the change
//! that causes it ([`enqueue`]); delivery processes claim endpoints, never
//! more than one claim per endpoint, read their due messages and record
//! what each attempt did.

use automesh_domain::{EventType, Notice, Principal, WebhookEndpoint};
use chrono::{DateTime, Utc};
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use crate::rows::{self, col, micros};
use crate::sql::{Bulk, bulk};
use crate::{Result, Store, StoreError};

/// The most endpoints one owner may have.
pub const ENDPOINT_LIMIT: i64 = 20;

const ENDPOINT_COLUMNS: &str =
    "id, org_id, owner_id, url, description, created_at, disabled_at, disabled_reason";

/// An endpoint, unless its owner has [`ENDPOINT_LIMIT`] already.
const INSERT_ENDPOINT: &str = "INSERT INTO webhook_endpoints \
     (id, org_id, owner_id, url, description, created_at) \
     SELECT $1, $2, $3, $4, $5, $6 WHERE (SELECT COUNT(*) FROM webhook_endpoints \
     WHERE org_id = $2 AND owner_id = $3) < $7";

const LIST_ENDPOINTS: &str = const_format::concatcp!(
    "SELECT ",
    ENDPOINT_COLUMNS,
    " FROM webhook_endpoints WHERE org_id = $1 AND owner_id = $2 ORDER BY created_at, id"
);

const GET_ENDPOINT: &str = const_format::concatcp!(
    "SELECT ",
    ENDPOINT_COLUMNS,
    " FROM webhook_endpoints WHERE id = $1 AND org_id = $2 AND owner_id = $3"
);

const DELETE_ENDPOINT: &str =
    "DELETE FROM webhook_endpoints WHERE id = $1 AND org_id = $2 AND owner_id = $3";

bulk! {
    /// A notice to write to the outbox, for every endpoint of its owner
    /// (or only `endpoint_id`, when given) that is not disabled.
    struct NoticeRow {
        message_id: String => TEXT,
        org_id: String => TEXT,
        owner_id: String => TEXT,
        endpoint_id: Option<String> => TEXT,
        event_type: &'static str => TEXT,
        payload: String => TEXT,
        at: i64 => BIGINT,
    }
}

/// Notices fanned out to their owners' endpoints; a message already
/// written (the same cause) is left as it is.
const ENQUEUE: Bulk<NoticeRow> = bulk!(NoticeRow => [
    "INSERT INTO webhook_messages (endpoint_id, message_id, event_type, payload, created_at, \
     next_attempt_at) SELECT e.id, i.message_id, i.event_type, i.payload, i.at, i.at FROM "
] [
    " JOIN webhook_endpoints e ON e.org_id = i.org_id AND e.owner_id = i.owner_id \
     AND (i.endpoint_id IS NULL OR e.id = i.endpoint_id) AND e.disabled_at IS NULL \
     WHERE true ON CONFLICT (endpoint_id, message_id) DO NOTHING"
]);

/// Claims endpoints with a message due: each not claimed (or its claim
/// over) and not disabled, taken until `$2`, at most `$3`, the longest
/// unclaimed first. Each step is computed once, driven from the due
/// messages (`webhook_messages_next`), so that no plan (a prepared
/// statement's generic plan, made while the tables were empty, say) reads
/// the messages once per endpoint; the update's guard holds the claim
/// against a concurrent one (which re-reads the row once the first commits
/// and finds it claimed).
const CLAIM: &str = "WITH due AS MATERIALIZED (SELECT DISTINCT m.endpoint_id FROM webhook_messages m \
     WHERE m.next_attempt_at IS NOT NULL AND m.next_attempt_at <= $1), \
     picked AS MATERIALIZED (SELECT e.id FROM due JOIN webhook_endpoints e ON e.id = due.endpoint_id \
     WHERE e.claimed_until <= $1 AND e.disabled_at IS NULL \
     ORDER BY e.claimed_until, e.id LIMIT $3) \
     UPDATE webhook_endpoints SET claimed_until = $2 FROM picked \
     WHERE webhook_endpoints.id = picked.id AND webhook_endpoints.claimed_until <= $1 \
     AND webhook_endpoints.disabled_at IS NULL \
     RETURNING webhook_endpoints.id, webhook_endpoints.org_id, webhook_endpoints.owner_id, \
     webhook_endpoints.url, webhook_endpoints.description, webhook_endpoints.created_at, \
     webhook_endpoints.disabled_at, webhook_endpoints.disabled_reason";

/// The columns every message query reads, in `decode_message`'s terms.
const MESSAGE_COLUMNS: &str = "message_id, event_type, payload, created_at, attempts, \
     next_attempt_at, delivered_at, last_error";

const DUE_MESSAGES: &str = const_format::concatcp!(
    "SELECT ",
    MESSAGE_COLUMNS,
    " FROM webhook_messages WHERE endpoint_id = $1 AND next_attempt_at IS NOT NULL \
     AND next_attempt_at <= $2 ORDER BY next_attempt_at, created_at, message_id LIMIT $3"
);

const MESSAGES: &str = const_format::concatcp!(
    "SELECT ",
    MESSAGE_COLUMNS,
    " FROM webhook_messages WHERE endpoint_id = $1 \
     ORDER BY created_at DESC, message_id DESC LIMIT $2"
);

bulk! {
    /// One attempt's outcome: when the message is tried next (none once
    /// delivered or given up), when it was delivered, why it failed.
    struct AttemptRow {
        endpoint_id: String => TEXT,
        message_id: String => TEXT,
        next_attempt_at: Option<i64> => BIGINT,
        delivered_at: Option<i64> => BIGINT,
        last_error: Option<String> => TEXT,
    }
}

/// The attempts of one claim, each counted and recorded.
const ATTEMPTED: Bulk<AttemptRow> = bulk!(AttemptRow => [
    "UPDATE webhook_messages SET attempts = webhook_messages.attempts + 1, \
     next_attempt_at = i.next_attempt_at, delivered_at = i.delivered_at, \
     last_error = i.last_error FROM "
] [
    " WHERE webhook_messages.endpoint_id = i.endpoint_id \
     AND webhook_messages.message_id = i.message_id"
]);

const RELEASE: &str = "UPDATE webhook_endpoints SET claimed_until = $2 WHERE id = $1";

const DISABLE: &str = "UPDATE webhook_endpoints SET disabled_at = $2, disabled_reason = $3 \
     WHERE id = $1 AND disabled_at IS NULL";

fn decode_endpoint(row: &AnyRow) -> Result<WebhookEndpoint> {
    rows::columns! { row => WebhookEndpoint {
        id, org_id, owner_id, url, description, created_at, disabled_at, disabled_reason
    } }
}

fn event_type(name: &str) -> Result<EventType> {
    EventType::ALL
        .into_iter()
        .find(|t| t.as_str() == name)
        .ok_or_else(|| StoreError::Corrupt(format!("webhook event type {name:?}")))
}

/// A message of an endpoint, as delivery and its owner see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookMessage {
    pub message_id: String,
    pub event_type: EventType,
    pub payload: String,
    pub created_at: DateTime<Utc>,
    /// Attempts made so far.
    pub attempts: i64,
    /// When it is tried next; `None` once delivered or given up.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    /// Why its last attempt failed.
    pub last_error: Option<String>,
}

fn decode_message(row: &AnyRow) -> Result<WebhookMessage> {
    let kind: String = col(row, "event_type")?;
    Ok(WebhookMessage {
        message_id: col(row, "message_id")?,
        event_type: event_type(&kind)?,
        payload: col(row, "payload")?,
        created_at: col(row, "created_at")?,
        attempts: col(row, "attempts")?,
        next_attempt_at: col(row, "next_attempt_at")?,
        delivered_at: col(row, "delivered_at")?,
        last_error: col(row, "last_error")?,
    })
}

/// What one delivery attempt did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// The endpoint answered 2xx.
    Delivered,
    /// It did not; tried again at `retry_at`, or never (`None`: the retry
    /// window is over).
    Failed {
        error: String,
        retry_at: Option<DateTime<Utc>>,
    },
}

impl NoticeRow {
    fn of(n: &Notice, endpoint_id: Option<&str>) -> NoticeRow {
        NoticeRow {
            message_id: n.id.clone(),
            org_id: n.org_id.clone(),
            owner_id: n.owner_id.clone(),
            endpoint_id: endpoint_id.map(str::to_owned),
            event_type: n.event_type.as_str(),
            payload: n.payload.clone(),
            at: micros(n.at),
        }
    }
}

/// Writes `notices` to the outbox in `db`'s transaction, one message per
/// endpoint of each owner, and wakes the delivery processes when any was
/// written (on PostgreSQL at commit). How many messages.
pub(crate) async fn enqueue(db: &mut AnyConnection, notices: &[Notice]) -> Result<u64> {
    let rows: Vec<NoticeRow> = notices.iter().map(|n| NoticeRow::of(n, None)).collect();
    let written = ENQUEUE.execute(&mut *db, &rows).await?;
    woken(db, written).await?;
    Ok(written)
}

/// Wakes delivery: on PostgreSQL by a NOTIFY that every process hears at
/// commit (this one too: an empty payload is nobody's own); on SQLite in
/// this process at once, before the commit, so delivery looks again
/// shortly after a wake-up that found nothing.
async fn woken(db: &mut AnyConnection, written: u64) -> Result<()> {
    if written > 0 {
        if rows::is_postgres(db) {
            crate::signal::notify(&mut *db, crate::Topic::Notifications, "").await?;
        } else {
            crate::Topic::Notifications.signal_local();
        }
    }
    Ok(())
}

impl Store {
    /// Registers an endpoint; `Invariant` when its owner has
    /// [`ENDPOINT_LIMIT`] already.
    pub async fn create_webhook_endpoint(&self, e: &WebhookEndpoint) -> Result<WebhookEndpoint> {
        crate::error::storable(&[("url", &e.url), ("description", &e.description)])?;
        let params = (
            e.id.as_str(),
            e.org_id.as_str(),
            e.owner_id.as_str(),
            e.url.as_str(),
            e.description.as_str(),
            micros(e.created_at),
            ENDPOINT_LIMIT,
        );
        if rows::execute(self.db(), INSERT_ENDPOINT, params).await? == 0 {
            return Err(StoreError::Invariant(format!(
                "an owner may have at most {ENDPOINT_LIMIT} webhook endpoints: delete one first"
            )));
        }
        let owner = Principal::new(&e.org_id, &e.owner_id);
        self.get_webhook_endpoint(&owner, &e.id).await
    }

    /// One endpoint of `owner` (another owner's is `NotFound`).
    pub async fn get_webhook_endpoint(
        &self,
        owner: &Principal,
        id: &str,
    ) -> Result<WebhookEndpoint> {
        rows::owned(self.db(), GET_ENDPOINT, owner, id, decode_endpoint).await
    }

    /// `owner`'s endpoints, oldest first.
    pub async fn list_webhook_endpoints(&self, owner: &Principal) -> Result<Vec<WebhookEndpoint>> {
        let params = (&owner.org_id, &owner.user_id);
        rows::all(self.db(), LIST_ENDPOINTS, params, decode_endpoint).await
    }

    /// Deletes an endpoint of `owner` and its messages.
    pub async fn delete_webhook_endpoint(&self, owner: &Principal, id: &str) -> Result<()> {
        let params = (id, &owner.org_id, &owner.user_id);
        match rows::execute(self.db(), DELETE_ENDPOINT, params).await? {
            0 => Err(StoreError::NotFound),
            _ => Ok(()),
        }
    }

    /// Writes `notice` for the one endpoint `endpoint_id` of its owner (a
    /// test message); `NotFound` when the owner has no such endpoint
    /// enabled.
    pub async fn enqueue_for_endpoint(&self, notice: &Notice, endpoint_id: &str) -> Result<()> {
        let mut tx = self.begin_write().await?;
        let rows = [NoticeRow::of(notice, Some(endpoint_id))];
        let written = ENQUEUE.execute(&mut tx, &rows).await?;
        if written == 0 {
            return Err(StoreError::NotFound);
        }
        woken(&mut tx, written).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The newest `limit` messages of an endpoint of `owner`.
    pub async fn webhook_messages(
        &self,
        owner: &Principal,
        endpoint_id: &str,
        limit: u32,
    ) -> Result<Vec<WebhookMessage>> {
        self.get_webhook_endpoint(owner, endpoint_id).await?;
        let params = (endpoint_id, i64::from(limit));
        rows::all(self.db(), MESSAGES, params, decode_message).await
    }
}

impl crate::Internal<'_> {
    /// Writes notices that no other change causes (the scheduler's, outside
    /// a pass): see [`enqueue`]. How many messages.
    pub async fn enqueue_notices(self, notices: &[Notice]) -> Result<u64> {
        let mut tx = self.0.begin_write().await?;
        let written = enqueue(&mut tx, notices).await?;
        tx.commit().await?;
        Ok(written)
    }

    /// Up to `limit` endpoints with a message due at `now`, each claimed
    /// until `until` (no other claim takes it meanwhile).
    pub async fn claim_webhook_endpoints(
        self,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<WebhookEndpoint>> {
        let mut tx = self.0.begin_write().await?;
        let params = (micros(now), micros(until), i64::from(limit));
        let claimed = rows::all(&mut *tx, CLAIM, params, decode_endpoint).await?;
        tx.commit().await?;
        Ok(claimed)
    }

    /// Up to `limit` messages of `endpoint_id` due at `now`, oldest first.
    pub async fn due_webhook_messages(
        self,
        endpoint_id: &str,
        now: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<WebhookMessage>> {
        let params = (endpoint_id, micros(now), i64::from(limit));
        rows::all(self.db(), DUE_MESSAGES, params, decode_message).await
    }

    /// What a claim of `endpoint_id` did, in one transaction: its
    /// messages' attempts (one statement), the endpoint released (claimable again from
    /// `release_at`), and disabled with `disable` as its reason if given.
    pub async fn record_webhook_attempts(
        self,
        endpoint_id: &str,
        attempts: &[(String, Attempt)],
        release_at: DateTime<Utc>,
        disable: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let recorded: Vec<AttemptRow> = attempts
            .iter()
            .map(|(message_id, attempt)| {
                let (next_attempt_at, delivered_at, last_error) = match attempt {
                    Attempt::Delivered => (None, Some(micros(now)), None),
                    Attempt::Failed { error, retry_at } => {
                        (retry_at.map(micros), None, Some(error.clone()))
                    }
                };
                AttemptRow {
                    endpoint_id: endpoint_id.to_owned(),
                    message_id: message_id.clone(),
                    next_attempt_at,
                    delivered_at,
                    last_error,
                }
            })
            .collect();
        let mut tx = self.0.begin_write().await?;
        ATTEMPTED.execute(&mut tx, &recorded).await?;
        rows::execute(&mut *tx, RELEASE, (endpoint_id, micros(release_at))).await?;
        if let Some(reason) = disable {
            rows::execute(&mut *tx, DISABLE, (endpoint_id, micros(now), reason)).await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
