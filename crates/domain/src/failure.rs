//! The closed set of ways a request can fail, whatever failed underneath:
//! every service answers a failure of any of its parts (the store, an
//! executor, a driver) by its kind, in one mapping
//! (`automesh_edge::status::failure`), so a corrupt row is INTERNAL and a
//! lost database UNAVAILABLE everywhere, and only UNAVAILABLE invites a
//! retry.

/// What kind of failure a request met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The request carries something no backend accepts: never retry.
    InvalidArgument,
    /// No such thing within the caller's scope.
    NotFound,
    /// A concurrent change won (a stale version): read again, then retry.
    Conflict,
    /// The state of things does not allow it (an illegal transition, an
    /// invariant of the schema).
    FailedPrecondition,
    /// A dependency did not answer: the one kind worth retrying as is.
    Unavailable,
    /// A fault of the mesh (a corrupt row, a failed migration): never retry.
    Internal,
}

impl FailureKind {
    /// Whether retrying the same request may succeed.
    pub fn retryable(self) -> bool {
        matches!(self, FailureKind::Unavailable)
    }
}

/// A failure that knows its kind: a store error, an executor's or an
/// engine's coded error. `automesh_edge::status::of` answers every one.
pub trait Failure: std::fmt::Display {
    fn kind(&self) -> FailureKind;
    /// The request field at fault, when the failure is one field's (a page
    /// token the store did not issue).
    fn field(&self) -> Option<&'static str> {
        None
    }
}
