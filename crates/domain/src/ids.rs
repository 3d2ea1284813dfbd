//! Identifiers. Automations get random ids; run ids are derived, so that two
//! schedulers racing on one occurrence name the same run.
//!
//! A run id is `r`, twelve hex digits of a time in milliseconds since the
//! epoch, and twenty hex digits of a name-based hash: `r0193a1b2c3d4…`. The
//! time prefix orders ids by time, so PostgreSQL partitions runs, their
//! events and receipts by ranges of ids, one week each (docs/retention.md),
//! and a lookup by id touches one partition. A scheduled run's time is its
//! occurrence (deterministic: the same occurrence, the same id); a manual
//! run's is the instant it was requested, its idempotency key being kept
//! unique by the `run_keys` table instead. Ids made before this format
//! (plain UUIDs, all below `r`) stay valid.

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The namespace of derived run ids (a fixed random UUID).
const RUN_NAMESPACE: Uuid = Uuid::from_u128(0x6d1f_0c2b_9a7e_4e3f_8b52_1c4d_7e9a_03f1);

/// Every time-ordered run id starts with this; ids below it predate the
/// format.
pub const RUN_ID_PREFIX: char = 'r';

pub fn new_automation_id() -> String {
    Uuid::new_v4().to_string()
}

pub fn new_runner_id() -> String {
    Uuid::new_v4().to_string()
}

pub fn new_worker_id() -> String {
    Uuid::new_v4().to_string()
}

/// The lowest run id of the instant `at` (and the bound a partition of
/// runs starting at `at` has): `r` and twelve hex digits of milliseconds.
pub fn run_id_bound(at: DateTime<Utc>) -> String {
    let ms = u64::try_from(at.timestamp_millis()).unwrap_or(0);
    format!("{RUN_ID_PREFIX}{ms:012x}")
}

fn run_id(at: DateTime<Utc>, name: &str) -> String {
    let hash = Uuid::new_v5(&RUN_NAMESPACE, name.as_bytes())
        .simple()
        .to_string();
    format!("{}{}", run_id_bound(at), &hash[..20])
}

/// The instant a time-ordered run id was made for, to the millisecond;
/// `None` for an id that predates the format.
pub fn run_id_time(id: &str) -> Option<DateTime<Utc>> {
    let hex = id.strip_prefix(RUN_ID_PREFIX)?.get(..12)?;
    DateTime::from_timestamp_millis(i64::from_str_radix(hex, 16).ok()?)
}

/// The id of the scheduled run of `automation_id` due at `scheduled_for`.
pub fn scheduled_run_id(automation_id: &str, scheduled_for: DateTime<Utc>) -> String {
    let name = format!(
        "scheduled/{automation_id}/{}",
        scheduled_for.timestamp_micros()
    );
    run_id(scheduled_for, &name)
}

/// The id of a manual run of `automation_id` requested with `key` at `now`
/// (that the key names one run is the `run_keys` table's guarantee).
pub fn manual_run_id(automation_id: &str, key: &str, now: DateTime<Utc>) -> String {
    run_id(now, &format!("manual/{automation_id}/{key}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_deterministic_and_distinct() {
        let t = DateTime::from_timestamp(1_800_000_000, 0).expect("instant");
        assert_eq!(scheduled_run_id("a", t), scheduled_run_id("a", t));
        assert_ne!(scheduled_run_id("a", t), scheduled_run_id("b", t));
        let later = t + chrono::Duration::microseconds(1);
        assert_ne!(scheduled_run_id("a", t), scheduled_run_id("a", later));
        assert_eq!(manual_run_id("a", "k", t), manual_run_id("a", "k", t));
        assert_ne!(manual_run_id("a", "k", t), manual_run_id("a", "k2", t));
    }

    #[test]
    fn run_ids_order_by_their_time_and_sit_above_the_old_uuids() {
        let t = DateTime::from_timestamp(1_800_000_000, 0).expect("instant");
        let id = scheduled_run_id("a", t);
        assert_eq!(id.len(), 33);
        assert_eq!(run_id_time(&id), Some(t));
        assert!(id.starts_with(&run_id_bound(t)));
        // Within [bound(t), bound(t + 1 ms)): what a partition's range is.
        let next = run_id_bound(t + chrono::Duration::milliseconds(1));
        assert!(run_id_bound(t) <= id && id < next);
        let earlier = scheduled_run_id("zzz", t - chrono::Duration::days(7));
        assert!(earlier < id);
        // Every UUID (hex and dashes) sorts below every time-ordered id.
        assert!(
            "ffffffff-ffff-ffff-ffff-ffffffffffff" < run_id_bound(DateTime::UNIX_EPOCH).as_str()
        );
        assert_eq!(run_id_time("6d1f0c2b-9a7e-4e3f-8b52-1c4d7e9a03f1"), None);
    }
}
