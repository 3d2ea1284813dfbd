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
