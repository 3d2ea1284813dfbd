//! The caller of an internal request and its principal.

use automesh_domain::Principal;
use automesh_proto::internal::v1 as ipb;
use tonic::Status;

#[allow(unused_imports)]
use super::*;

/// The caller of an internal request; a missing or empty one is refused.
pub fn principal(caller: Option<&ipb::Caller>) -> Result<Principal, Status> {
    match caller {
        Some(c) if !c.organization_id.is_empty() && !c.user_id.is_empty() => {
            Ok(Principal::new(&c.organization_id, &c.user_id))
        }
        _ => Err(Status::unauthenticated("internal request without a caller")),
    }
}

pub fn caller(p: &Principal) -> ipb::Caller {
    ipb::Caller {
        organization_id: p.org_id.clone(),
        user_id: p.user_id.clone(),
    }
}

/// An internal request that acts for a user: its caller says whom.
pub trait Scoped {
    fn caller(&self) -> Option<&ipb::Caller>;
}

macro_rules! scoped {
    ($($t:ty),* $(,)?) => {
        $(impl Scoped for $t {
            fn caller(&self) -> Option<&ipb::Caller> {
                self.caller.as_ref()
            }
        })*
    };
}

scoped!(
    automesh_proto::coordinator::v1::GetRunRequest,
    automesh_proto::coordinator::v1::ListRunsRequest,
    automesh_proto::coordinator::v1::CancelRunRequest,
    automesh_proto::coordinator::v1::ListRunEventsRequest,
    automesh_proto::coordinator::v1::WatchRunRequest,
    automesh_proto::runner::v1::CreateRunnerTokenRequest,
    automesh_proto::runner::v1::RevokeRunnerTokenRequest,
    automesh_proto::scheduler::v1::CreateAutomationRequest,
    automesh_proto::scheduler::v1::GetAutomationRequest,
    automesh_proto::scheduler::v1::ListAutomationsRequest,
    automesh_proto::scheduler::v1::UpdateAutomationRequest,
    automesh_proto::scheduler::v1::SetAutomationStateRequest,
    automesh_proto::scheduler::v1::RunAutomationNowRequest,
    automesh_proto::worker::v1::GetWorkerRequest,
    automesh_proto::worker::v1::RegisterWorkerRequest,
);

/// An internal request and the principal it acts for; one without a caller
/// is refused (UNAUTHENTICATED).
pub fn scoped<T: Scoped>(request: tonic::Request<T>) -> Result<(Principal, T), Status> {
    let req = request.into_inner();
    Ok((principal(req.caller())?, req))
}
