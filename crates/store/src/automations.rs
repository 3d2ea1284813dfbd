//! Queries of the `automations` aggregate.

use automesh_domain::automation::{Automation, NewAutomation};
use automesh_domain::schedule::{Schedule, ScheduleRecord};
use automesh_domain::{ErrorCode, Principal};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::page::{Cursor, Page};
use crate::rows::{
    instant, int, micros, opt_instant, opt_micros, opt_parsed, opt_text, parsed, text,
};
use crate::{Result, Store, StoreError};

/// The columns every automation query reads, in `decode`'s terms.
macro_rules! automation_columns {
    () => {
        "id, org_id, owner_id, name, prompt, model, placement, surface, schedule, state, \
         attention_reason, attention_message, version, next_run_at, created_at, updated_at"
    };
}
pub(crate) use automation_columns;

const INSERT: &str = "INSERT INTO automations (id, org_id, owner_id, name, prompt, model, placement, \
     surface, schedule, state, attention_reason, attention_message, version, next_run_at, \
     created_at, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'active', NULL, NULL, 1, $10, $11, $11)";

const GET: &str = concat!(
    "SELECT ",
    automation_columns!(),
    " FROM automations WHERE id = $1 AND org_id = $2 AND owner_id = $3"
);

const GET_UNSCOPED: &str = concat!(
    "SELECT ",
    automation_columns!(),
    " FROM automations WHERE id = $1"
);

const LIST: &str = concat!(
    "SELECT ",
    automation_columns!(),
    " FROM automations \
     WHERE org_id = $1 AND owner_id = $2 \
       AND (created_at < $3 OR (created_at = $3 AND id < $4)) \
       AND ($5 = 1 OR state <> 'archived') \
     ORDER BY created_at DESC, id DESC LIMIT $6"
);

/// Placement, surface, owner and creation time are absent: they never change.
const UPDATE_IF_VERSION: &str = "UPDATE automations SET name = $4, prompt = $5, model = $6, \
     schedule = $7, state = $8, attention_reason = $9, attention_message = $10, \
     next_run_at = $11, updated_at = $12, version = version + 1 \
     WHERE id = $1 AND org_id = $2 AND owner_id = $3 AND version = $13";

pub(crate) fn decode(row: &AnyRow) -> Result<Automation> {
    let schedule_json = text(row, "schedule")?;
    let record: ScheduleRecord = serde_json::from_str(&schedule_json)
        .map_err(|e| StoreError::Corrupt(format!("schedule: {e}")))?;
    let schedule = Schedule::try_from(record).map_err(StoreError::Corrupt)?;
    Ok(Automation {
        id: text(row, "id")?,
        org_id: text(row, "org_id")?,
        owner_id: text(row, "owner_id")?,
        name: text(row, "name")?,
        prompt: text(row, "prompt")?,
        model: text(row, "model")?,
        placement: parsed(row, "placement")?,
        surface: parsed(row, "surface")?,
        schedule,
        state: parsed(row, "state")?,
        attention_reason: opt_parsed::<ErrorCode>(row, "attention_reason")?,
        attention_message: opt_text(row, "attention_message")?,
        version: int(row, "version")?,
        next_run_at: opt_instant(row, "next_run_at")?,
        created_at: instant(row, "created_at")?,
        updated_at: instant(row, "updated_at")?,
    })
}

fn schedule_json(s: &Schedule) -> String {
    // Serialising a plain enum of strings and integers cannot fail.
    serde_json::to_string(&ScheduleRecord::from(s)).unwrap_or_default()
}

impl Store {
    /// Inserts a new automation, active, at version 1.
    pub async fn create_automation(
        &self,
        new: &NewAutomation,
        next_run_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<Automation> {
        for (field, value) in [
            ("id", &new.id),
            ("name", &new.name),
            ("prompt", &new.prompt),
            ("model", &new.model),
        ] {
            crate::error::storable(field, value)?;
        }
        sqlx::query(INSERT)
            .bind(&new.id)
            .bind(&new.org_id)
            .bind(&new.owner_id)
            .bind(&new.name)
            .bind(&new.prompt)
            .bind(&new.model)
            .bind(new.placement().as_str())
            .bind(new.surface.as_str())
            .bind(schedule_json(&new.schedule))
            .bind(opt_micros(next_run_at))
            .bind(micros(now))
            .execute(self.db())
            .await?;
        self.internal().get_automation(&new.id).await
    }

    /// One automation of `owner`; another tenant's answers `NotFound`.
    pub async fn get_automation(&self, owner: &Principal, id: &str) -> Result<Automation> {
        crate::rows::owned(self.db(), GET, owner, id, decode).await
    }

    /// A page of `owner`'s automations, newest first.
    pub async fn list_automations(
        &self,
        owner: &Principal,
        after: &Cursor,
        limit: u32,
        show_archived: bool,
    ) -> Result<Page<Automation>> {
        let rows = sqlx::query(LIST)
            .bind(&owner.org_id)
            .bind(&owner.user_id)
            .bind(after.created_micros)
            .bind(&after.id)
            .bind(i64::from(show_archived))
            .bind(i64::from(limit) + 1)
            .fetch_all(self.db())
            .await?;
        let items = rows.iter().map(decode).collect::<Result<Vec<_>>>()?;
        Ok(Page::from_rows(items, limit))
    }

    /// Writes the mutable fields of `updated` if the stored version is still
    /// `expected_version`, and returns the stored result. Placement, surface,
    /// owner and creation time are never written.
    pub async fn update_automation_if_version(
        &self,
        updated: &Automation,
        expected_version: i64,
        now: DateTime<Utc>,
    ) -> Result<Automation> {
        for (field, value) in [
            ("name", &updated.name),
            ("prompt", &updated.prompt),
            ("model", &updated.model),
        ] {
            crate::error::storable(field, value)?;
        }
        let done = sqlx::query(UPDATE_IF_VERSION)
            .bind(&updated.id)
            .bind(&updated.org_id)
            .bind(&updated.owner_id)
            .bind(&updated.name)
            .bind(&updated.prompt)
            .bind(&updated.model)
            .bind(schedule_json(&updated.schedule))
            .bind(updated.state.as_str())
            .bind(updated.attention_reason.map(|c| c.as_str()))
            .bind(updated.attention_message.as_deref())
            .bind(opt_micros(updated.next_run_at))
            .bind(micros(now))
            .bind(expected_version)
            .execute(self.db())
            .await?;
        let owner = Principal::new(&updated.org_id, &updated.owner_id);
        let stored = self.get_automation(&owner, &updated.id).await?;
        if done.rows_affected() == 1 {
            Ok(stored)
        } else {
            Err(StoreError::VersionConflict {
                current: stored.version,
            })
        }
    }
}

impl crate::Internal<'_> {
    /// One automation by id, for internal callers that act for no user.
    pub async fn get_automation(self, id: &str) -> Result<Automation> {
        crate::rows::by_id(self.db(), GET_UNSCOPED, id, decode).await
    }
}
