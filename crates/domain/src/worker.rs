//! Per-user cloud workers and desktop runners, as the store records them.

use chrono::{DateTime, Utc};

use crate::string_enum;

string_enum! {
    /// The state of a per-user cloud worker; a user without one has none.
    WorkerState {
        Stopped => "stopped",
        Starting => "starting",
        Ready => "ready",
        Stopping => "stopping",
        Failed => "failed",
    }
}

/// A user's cloud worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudWorker {
    pub state: WorkerState,
    pub driver: String,
    pub endpoint: Option<String>,
    pub last_active_at: Option<DateTime<Utc>>,
    pub id: String,
    pub org_id: String,
    pub owner_id: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A desktop runner registered by a user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runner {
    pub id: String,
    pub org_id: String,
    pub owner_id: String,
    /// What its owner calls it.
    pub name: String,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}
