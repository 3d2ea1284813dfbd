//! The coordinator's errors, and their one mapping into `Status`.

use automesh_domain::Violations;
use automesh_rpc::status;
use automesh_store::StoreError;
use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid request: {0}")]
    Invalid(#[from] Violations),
    #[error("run {0} is being executed; cancellation must go through its executor")]
    Executing(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        match e {
            Error::Invalid(v) => status::invalid_argument(&v),
            Error::Executing(id) => status::failed_precondition(
                "RUN_STATE",
                &format!("runs/{id}"),
                "the run has been handed to an executor; cancellation through executors is not available in this build",
            ),
            Error::Store(StoreError::NotFound) => status::not_found("run"),
            Error::Store(StoreError::InvalidPageToken) => {
                status::invalid_field("page_token", "not a page token issued by this service")
            }
            Error::Store(e @ StoreError::Database(_)) => status::unavailable("database", &e),
            Error::Store(e) => status::internal("coordinator store", &e),
        }
    }
}
