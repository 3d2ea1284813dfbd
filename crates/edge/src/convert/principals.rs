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
    automesh_proto::coordinator::v1::SummarizeUsageRequest,
    automesh_proto::runner::v1::ListRunnersRequest,
    automesh_proto::runner::v1::CreateRunnerTokenRequest,
    automesh_proto::runner::v1::RevokeRunnerTokenRequest,
    automesh_proto::scheduler::v1::CreateAutomationRequest,
    automesh_proto::scheduler::v1::GetAutomationRequest,
    automesh_proto::scheduler::v1::ListAutomationsRequest,
    automesh_proto::scheduler::v1::UpdateAutomationRequest,
    automesh_proto::scheduler::v1::SetAutomationStateRequest,
    automesh_proto::scheduler::v1::RunAutomationNowRequest,
    automesh_proto::scheduler::v1::CreateWebhookEndpointRequest,
    automesh_proto::scheduler::v1::ListWebhookEndpointsRequest,
    automesh_proto::scheduler::v1::DeleteWebhookEndpointRequest,
    automesh_proto::scheduler::v1::TestWebhookEndpointRequest,
    automesh_proto::scheduler::v1::ListWebhookMessagesRequest,
    automesh_proto::worker::v1::GetWorkerRequest,
    automesh_proto::worker::v1::RegisterWorkerRequest,
);

/// An internal request and the principal it acts for; one without a caller
/// is refused (UNAUTHENTICATED).
pub fn scoped<T: Scoped>(request: tonic::Request<T>) -> Result<(Principal, T), Status> {
    let req = request.into_inner();
    Ok((principal(req.caller())?, req))
}

/// Methods of an internal service's trait that act for the caller each
/// request names. Each row names the trait's method, its request and
/// answer, and the service's own method that serves it, which gets the
/// caller's principal (the call is UNAUTHENTICATED without one) and one of:
/// the request (`=> own`), the checked `id` it names (`=> own[id]`), or the
/// public request it wraps (`=> own[request]`); what it returns is the
/// answer, or becomes it through `as wrap`. The own method's error becomes
/// the call's status. The methods are written as
/// `#[tonic::async_trait]` writes its methods, so they stand beside the
/// service's own.
#[macro_export]
macro_rules! scoped_calls {
    ($($method:ident($req:ty) -> $reply:ty => $own:ident $([$part:ident])? $(as $wrap:path)?;)+) => {$(
        fn $method<'life0, 'async_trait>(
            &'life0 self,
            request: ::tonic::Request<$req>,
        ) -> ::std::pin::Pin<Box<
            dyn ::std::future::Future<
                    Output = ::std::result::Result<::tonic::Response<$reply>, ::tonic::Status>,
                > + Send
                + 'async_trait,
        >>
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(async move {
                let (owner, req) = $crate::convert::scoped(request)?;
                let part = $crate::scoped_calls!(@part req $($part)?);
                let reply = self.$own(owner, part).await.map_err(::tonic::Status::from)?;
                Ok(::tonic::Response::new($($wrap)?(reply)))
            })
        }
    )+};
    (@part $req:ident) => { $req };
    (@part $req:ident id) => {{
        $crate::convert::require_id(&$req.id, "id")
            .map_err(|v| $crate::status::invalid_argument(&v))?;
        $req.id
    }};
    (@part $req:ident request) => { $req.request.unwrap_or_default() };
}
