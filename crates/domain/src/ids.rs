//! Identifiers. Automations get random ids; run ids are derived, so that two
//! schedulers racing on one occurrence, or a client retrying run-now with the
//! same key, name the same run.

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The namespace of derived run ids (a fixed random UUID).
const RUN_NAMESPACE: Uuid = Uuid::from_u128(0x6d1f_0c2b_9a7e_4e3f_8b52_1c4d_7e9a_03f1);

pub fn new_automation_id() -> String {
    Uuid::new_v4().to_string()
}

pub fn new_runner_id() -> String {
    Uuid::new_v4().to_string()
}

pub fn new_worker_id() -> String {
    Uuid::new_v4().to_string()
}

/// The id of the scheduled run of `automation_id` due at `scheduled_for`.
pub fn scheduled_run_id(automation_id: &str, scheduled_for: DateTime<Utc>) -> String {
    let name = format!(
        "scheduled/{automation_id}/{}",
        scheduled_for.timestamp_micros()
    );
    Uuid::new_v5(&RUN_NAMESPACE, name.as_bytes()).to_string()
}

/// The id of the manual run of `automation_id` requested with `key`.
pub fn manual_run_id(automation_id: &str, key: &str) -> String {
    let name = format!("manual/{automation_id}/{key}");
    Uuid::new_v5(&RUN_NAMESPACE, name.as_bytes()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_deterministic_and_distinct() {
        let t = DateTime::from_timestamp(1_800_000_000, 0).expect("instant");
        assert_eq!(scheduled_run_id("a", t), scheduled_run_id("a", t));
        assert_ne!(scheduled_run_id("a", t), scheduled_run_id("b", t));
        assert_eq!(manual_run_id("a", "k"), manual_run_id("a", "k"));
        assert_ne!(manual_run_id("a", "k"), manual_run_id("a", "k2"));
    }
}
