//! Building `tonic::Status` values the same way everywhere: field violations
//! as the standard `BadRequest` details, preconditions as
//! `PreconditionFailure`, internal errors logged once and answered with a
//! clean message that names the trace.

use automesh_domain::Violations;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use automesh_telemetry::propagation;

/// INVALID_ARGUMENT naming every offending field.
pub fn invalid_argument(violations: &Violations) -> Status {
    let mut details = ErrorDetails::new();
    for v in violations.iter() {
        details.add_bad_request_violation(v.field.clone(), v.description.clone());
    }
    Status::with_error_details(
        Code::InvalidArgument,
        format!("invalid request: {violations}"),
        details,
    )
}

/// INVALID_ARGUMENT for one field.
pub fn invalid_field(field: &str, description: &str) -> Status {
    let mut v = Violations::default();
    v.field(field, description);
    invalid_argument(&v)
}

/// NOT_FOUND; also the answer for another tenant's object.
pub fn not_found(what: &str) -> Status {
    Status::not_found(format!("{what} not found"))
}

/// FAILED_PRECONDITION with a `PreconditionFailure` detail.
pub fn failed_precondition(kind: &str, subject: &str, description: &str) -> Status {
    Status::with_error_details(
        Code::FailedPrecondition,
        description.to_owned(),
        ErrorDetails::with_precondition_failure_violation(kind, subject, description),
    )
}

/// ABORTED: a concurrent change won (stale etag).
pub fn aborted(message: &str) -> Status {
    Status::aborted(message.to_owned())
}

/// Logs an internal error once, with context, and answers INTERNAL with a
/// message that carries no detail but the trace id to look it up by.
pub fn internal(context: &str, error: &dyn std::fmt::Display) -> Status {
    tracing::error!(%error, context, "internal error");
    let trace = propagation::current_trace_id().unwrap_or_default();
    Status::internal(format!("internal error (trace {trace})"))
}

/// UNAVAILABLE: a dependency (database, another service) did not answer.
pub fn unavailable(context: &str, error: &dyn std::fmt::Display) -> Status {
    tracing::warn!(%error, context, "dependency unavailable");
    Status::unavailable(format!("{context}: temporarily unavailable"))
}

/// UNAVAILABLE because this server is shutting down: the caller retries
/// against another replica, as `what` says.
pub fn shutting_down(what: &str) -> Status {
    Status::unavailable(format!("shutting down; {what}"))
}

/// UNAVAILABLE because the peer's connection was lost (it stopped
/// answering or went away): `what` says whose. Nobody may be left to read
/// it; it names why a stream ended, in metrics and logs.
pub fn connection_lost(what: &str) -> Status {
    Status::unavailable(format!("{what}: the connection was lost"))
}

/// A request body that ended early, as tonic reads its own: a stream the
/// caller cancelled (or a lost connection) is a call the caller abandoned,
/// which ends a request stream; any other reset is INTERNAL.
pub fn stream_ended(abandoned: bool, why: &dyn std::fmt::Display) -> Status {
    if abandoned {
        Status::cancelled(why.to_string())
    } else {
        Status::internal(why.to_string())
    }
}

/// The one answer to a failure of kind `kind` while doing `context`
/// (`error` says what exactly; it is logged, and for bad input shown). A
/// missing thing is named by `context`.
pub fn failure(
    kind: automesh_domain::FailureKind,
    context: &str,
    error: &dyn std::fmt::Display,
) -> Status {
    use automesh_domain::FailureKind as K;
    match kind {
        K::InvalidArgument => Status::invalid_argument(error.to_string()),
        K::NotFound => not_found(context),
        K::Conflict => aborted(&format!("{context}: {error}; read it again")),
        K::FailedPrecondition => Status::failed_precondition(format!("{context}: {error}")),
        K::Unavailable => unavailable(context, error),
        K::Internal => internal(context, error),
    }
}

/// The one answer to `error` while doing `context`: a failure of one
/// request field names it; any other is answered by its kind ([`failure`]).
pub fn of(error: &dyn automesh_domain::Failure, context: &str) -> Status {
    match error.field() {
        Some(field) => invalid_field(field, &error.to_string()),
        None => failure(error.kind(), context, &error),
    }
}

/// Re-issues a status received from an internal service: code, message and
/// rich details pass through; transport metadata does not.
pub fn forward(status: Status) -> Status {
    Status::with_details(
        status.code(),
        status.message().to_owned(),
        status.details().to_vec().into(),
    )
}

/// The field violations carried by a status (for clients and tests).
pub fn field_violations(status: &Status) -> Vec<(String, String)> {
    status
        .get_details_bad_request()
        .map(|b| {
            b.field_violations
                .into_iter()
                .map(|v| (v.field, v.description))
                .collect()
        })
        .unwrap_or_default()
}
