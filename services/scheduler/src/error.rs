//! The scheduler's errors, and their one mapping into `Status`.

use automesh_domain::Violations;
use automesh_domain::automation::IllegalStateChange;
use automesh_edge::status;
use automesh_store::StoreError;
use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid request: {0}")]
    Invalid(#[from] Violations),
    #[error("{0}")]
    IllegalStateChange(#[from] IllegalStateChange),
    #[error("the automation is archived")]
    Archived,
    #[error("the etag is stale")]
    Stale,
    #[error("the automation kept changing while being updated")]
    Contended,
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The operator set no notification key.
    #[error("notifications are not configured")]
    NotificationsOff,
    /// A store error about a webhook endpoint.
    #[error("{0}")]
    Endpoint(StoreError),
    #[error("the webhook endpoint is disabled: {0}")]
    EndpointDisabled(String),
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        match e {
            Error::Invalid(v) => status::invalid_argument(&v),
            Error::IllegalStateChange(e) => {
                status::failed_precondition("AUTOMATION_STATE", "automation", &e.to_string())
            }
            Error::Archived => status::failed_precondition(
                "AUTOMATION_STATE",
                "automation",
                "the automation is archived: its history is kept but it cannot change or run",
            ),
            Error::Stale | Error::Store(StoreError::VersionConflict { .. }) => status::aborted(
                "the etag is stale: the automation changed since it was read; read it again",
            ),
            Error::Contended => Status::aborted("the automation kept changing; retry"),
            Error::Store(StoreError::Invariant(msg)) => {
                status::failed_precondition("INVARIANT", "automation", &msg)
            }
            Error::Store(e) => status::of(&e, "automation"),
            Error::NotificationsOff => status::failed_precondition(
                "NOTIFICATIONS_OFF",
                "webhook endpoint",
                "notifications are not configured on this mesh: its operator sets \
                 AUTOMESH_NOTIFICATION_KEY on the scheduler",
            ),
            Error::Endpoint(StoreError::Invariant(msg)) => {
                status::failed_precondition("WEBHOOK_ENDPOINT_LIMIT", "webhook endpoint", &msg)
            }
            Error::Endpoint(e) => status::of(&e, "webhook endpoint"),
            Error::EndpointDisabled(why) => status::failed_precondition(
                "WEBHOOK_ENDPOINT_DISABLED",
                "webhook endpoint",
                &format!("the endpoint is disabled ({why})"),
            ),
        }
    }
}
