//! The coordinator's errors, and their one mapping into `Status`.

use automesh_domain::Violations;
use automesh_edge::status;
use automesh_store::StoreError;
use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid request: {0}")]
    Invalid(#[from] Violations),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        match e {
            Error::Store(e) => status::of(&e, "run"),
            Error::Invalid(v) => status::invalid_argument(&v),
        }
    }
}
