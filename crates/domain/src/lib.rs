//! The automesh domain: automations, schedules and their DST rules, runs and
//! their states, the closed set of error codes, the model catalogue, and the
//! validation rules every surface shares.
//!
//! Nothing here knows about protobuf or SQL: the services convert at their
//! edges, and the store persists these types.

mod flags;
mod secret;
pub use flags::parse_duration;
pub use secret::Secret;
pub mod automation;
pub mod budget;
pub mod error_code;
pub mod failure;
pub mod ids;
pub mod models;
pub mod notification;
pub mod principal;
pub mod run;
pub mod schedule;
pub mod validation;
pub mod worker;

pub use automation::{
    Attention, Automation, AutomationPatch, AutomationState, FailureStreak, NewAutomation,
    Placement, StateChange, Surface,
};
pub use error_code::{CodedError, ErrorCode};
pub use failure::{Failure, FailureKind};
pub use models::{ModelCatalog, ModelRefusal, ModelSpec, Price};
pub use notification::{EventType, Notice, WebhookEndpoint};
pub use principal::Principal;
pub use run::{
    NewRun, QuarterUsage, Receipt, Run, RunBudget, RunEvent, RunEventPayload, RunState, RunTrigger,
    Usage,
};
pub use schedule::{Schedule, TimeOfDay, WeekdaySet};
pub use validation::{FieldViolation, Violations};
pub use worker::{CloudWorker, Runner, WorkerState};
