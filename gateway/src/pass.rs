//! How the gateway passes a public call on. Each public request says what
//! it checks, what must hold before it goes on (`admit`), the internal
//! request it becomes for its caller, the internal call that serves it and
//! the public answer it gets; [`Gateway::pass`] does the rest alike for
//! every call: authenticate, check (INVALID_ARGUMENT naming each bad
//! field), scope to the caller, forward, and pass the upstream's status on
//! unchanged.

use automesh_domain::{Principal, Violations};
use automesh_edge::convert;
use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::internal::v1::Caller;
use automesh_proto::runner::v1 as rpb;
use automesh_proto::scheduler::v1 as spb;
use automesh_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::{Gateway, Upstreams, forwarded};

/// The upstream's answer to one internal call.
pub(crate) type Answer<T> = Result<Response<T>, Status>;

/// A public request the gateway passes on to one internal call.
#[tonic::async_trait]
pub(crate) trait Pass: Send + Sync + Sized + 'static {
    /// The internal call's request and answer, and the public answer.
    type Up: Send;
    type Down: Send;
    type Reply;

    /// Its fields, checked (none, unless a request says so).
    fn check(&self) -> Result<(), Violations> {
        Ok(())
    }

    /// What must hold for the caller before it goes on (nothing, unless a
    /// request says so).
    async fn admit(&self, _gateway: &Gateway, _owner: &Principal) -> Result<(), Status> {
        Ok(())
    }

    /// The internal request, scoped to `caller`.
    fn up(self, caller: Option<Caller>) -> Self::Up;

    /// The internal call.
    async fn call(upstreams: &Upstreams, up: Self::Up) -> Answer<Self::Down>;

    /// The public answer to the internal one.
    fn reply(down: Self::Down) -> Result<Self::Reply, Status>;
}

/// The methods of a public service trait that pass their call on
/// ([`Gateway::pass`]), written as `#[tonic::async_trait]` writes its
/// methods, so they stand beside the service's own.
macro_rules! passed {
    ($($method:ident($req:ident) -> $reply:ident;)+) => {$(
        fn $method<'life0, 'async_trait>(
            &'life0 self,
            request: tonic::Request<automesh_proto::v1::$req>,
        ) -> std::pin::Pin<Box<
            dyn std::future::Future<Output = $crate::pass::Answer<automesh_proto::v1::$reply>>
                + Send
                + 'async_trait,
        >>
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(self.pass(request))
        }
    )+};
}
pub(crate) use passed;

impl Gateway {
    /// Passes a public call on: see [`Pass`].
    pub(crate) async fn pass<R: Pass>(&self, request: Request<R>) -> Answer<R::Reply> {
        let call = self.accept(request, R::check)?;
        call.req.admit(self, &call.owner).await?;
        let up = call.req.up(Some(convert::caller(&call.owner)));
        let down = forwarded(R::call(&self.upstreams, up).await)?;
        Ok(Response::new(R::reply(down)?))
    }
}

/// Requests that name one object by `id` and are answered with it: each
/// row is the public request, the internal call (its client, method and
/// request) and the public answer with the field that carries the object.
macro_rules! by_id {
    ($($req:ty => $client:ident.$method:ident($($up:ident)::+) => $reply:ident.$field:ident;)+) => {$(
        #[tonic::async_trait]
        impl Pass for $req {
            type Up = $($up)::+;
            type Down = <$($up)::+ as Upstream>::Down;
            type Reply = pb::$reply;
            fn check(&self) -> Result<(), Violations> {
                convert::require_id(&self.id, "id")
            }
            fn up(self, caller: Option<Caller>) -> Self::Up {
                $($up)::+ { caller, id: self.id }
            }
            async fn call(upstreams: &Upstreams, up: Self::Up) -> Answer<Self::Down> {
                upstreams.$client().$method(up).await
            }
            fn reply(down: Self::Down) -> Result<pb::$reply, Status> {
                Ok(pb::$reply { $field: down.$field })
            }
        }
    )+};
}

/// Requests passed on whole, answered with the internal answer's public
/// part: each row is the public request, its check (and what must hold
/// before it goes on, if anything), and the internal call (its client,
/// method and request).
macro_rules! whole {
    ($($req:ty, $check:expr $(, admit $admit:path)? => $client:ident.$method:ident($up:ident);)+) => {$(
        #[tonic::async_trait]
        impl Pass for $req {
            type Up = $up;
            type Down = <$up as Upstream>::Down;
            type Reply = <Self::Down as Wraps>::Public;
            fn check(&self) -> Result<(), Violations> {
                $check(self)
            }
            $(
                async fn admit(&self, gateway: &Gateway, owner: &Principal) -> Result<(), Status> {
                    $admit(self, gateway, owner).await
                }
            )?
            fn up(self, caller: Option<Caller>) -> $up {
                $up { caller, request: Some(self) }
            }
            async fn call(upstreams: &Upstreams, up: $up) -> Answer<Self::Down> {
                upstreams.$client().$method(up).await
            }
            fn reply(down: Self::Down) -> Result<Self::Reply, Status> {
                Ok(down.public())
            }
        }
    )+};
}

/// An internal request and the answer it gets.
pub(crate) trait Upstream {
    type Down;
}

/// An internal answer that carries a public one.
pub(crate) trait Wraps {
    type Public;
    fn public(self) -> Self::Public;
}

macro_rules! upstream {
    ($($up:ty => $down:ty),+ $(,)?) => {$(
        impl Upstream for $up {
            type Down = $down;
        }
    )+};
}

impl Wraps for spb::RunAutomationNowResponse {
    type Public = pb::RunAutomationNowResponse;
    fn public(self) -> pb::RunAutomationNowResponse {
        pb::RunAutomationNowResponse { run: self.run }
    }
}

impl Wraps for spb::UpdateAutomationResponse {
    type Public = pb::UpdateAutomationResponse;
    fn public(self) -> pb::UpdateAutomationResponse {
        let automation = self.automation;
        pb::UpdateAutomationResponse { automation }
    }
}

macro_rules! wraps {
    ($($down:ty => $public:ty),+ $(,)?) => {$(
        impl Wraps for $down {
            type Public = $public;
            fn public(self) -> $public {
                self.response.unwrap_or_default()
            }
        }
    )+};
}

upstream!(
    cpb::GetRunRequest => cpb::GetRunResponse,
    cpb::CancelRunRequest => cpb::CancelRunResponse,
    spb::GetAutomationRequest => spb::GetAutomationResponse,
    spb::RunAutomationNowRequest => spb::RunAutomationNowResponse,
    spb::UpdateAutomationRequest => spb::UpdateAutomationResponse,
    cpb::ListRunsRequest => cpb::ListRunsResponse,
    cpb::ListRunEventsRequest => cpb::ListRunEventsResponse,
    cpb::SummarizeUsageRequest => cpb::SummarizeUsageResponse,
    spb::ListAutomationsRequest => spb::ListAutomationsResponse,
    spb::CreateWebhookEndpointRequest => spb::CreateWebhookEndpointResponse,
    spb::ListWebhookEndpointsRequest => spb::ListWebhookEndpointsResponse,
    spb::DeleteWebhookEndpointRequest => spb::DeleteWebhookEndpointResponse,
    spb::TestWebhookEndpointRequest => spb::TestWebhookEndpointResponse,
    spb::ListWebhookMessagesRequest => spb::ListWebhookMessagesResponse,
);

wraps!(
    cpb::ListRunsResponse => pb::ListRunsResponse,
    cpb::ListRunEventsResponse => pb::ListRunEventsResponse,
    cpb::SummarizeUsageResponse => pb::SummarizeUsageResponse,
    spb::ListAutomationsResponse => pb::ListAutomationsResponse,
    spb::CreateWebhookEndpointResponse => pb::CreateWebhookEndpointResponse,
    spb::ListWebhookEndpointsResponse => pb::ListWebhookEndpointsResponse,
    spb::DeleteWebhookEndpointResponse => pb::DeleteWebhookEndpointResponse,
    spb::TestWebhookEndpointResponse => pb::TestWebhookEndpointResponse,
    spb::ListWebhookMessagesResponse => pb::ListWebhookMessagesResponse,
);

by_id! {
    pb::GetRunRequest => coordinator.get_run(cpb::GetRunRequest) => GetRunResponse.run;
    pb::CancelRunRequest => coordinator.cancel_run(cpb::CancelRunRequest) => CancelRunResponse.run;
    pb::GetAutomationRequest => scheduler.get_automation(spb::GetAutomationRequest)
        => GetAutomationResponse.automation;
}

use cpb::{ListRunEventsRequest, ListRunsRequest, SummarizeUsageRequest};
use spb::{
    CreateWebhookEndpointRequest, DeleteWebhookEndpointRequest, ListWebhookEndpointsRequest,
    ListWebhookMessagesRequest, TestWebhookEndpointRequest,
};
use spb::{ListAutomationsRequest, RunAutomationNowRequest, UpdateAutomationRequest};

whole! {
    pb::ListRunsRequest, checks::list_runs => coordinator.list_runs(ListRunsRequest);
    pb::ListRunEventsRequest, checks::list_run_events
        => coordinator.list_run_events(ListRunEventsRequest);
    pb::SummarizeUsageRequest, checks::summarize_usage
        => coordinator.summarize_usage(SummarizeUsageRequest);
    pb::ListAutomationsRequest, checks::list_automations
        => scheduler.list_automations(ListAutomationsRequest);
    pb::RunAutomationNowRequest, convert::parse_run_now
        => scheduler.run_automation_now(RunAutomationNowRequest);
    pb::UpdateAutomationRequest, checks::update, admit crate::automations::admit_update
        => scheduler.update_automation(UpdateAutomationRequest);
    pb::CreateWebhookEndpointRequest, checks::create_endpoint
        => scheduler.create_webhook_endpoint(CreateWebhookEndpointRequest);
    pb::ListWebhookEndpointsRequest, checks::none
        => scheduler.list_webhook_endpoints(ListWebhookEndpointsRequest);
    pb::DeleteWebhookEndpointRequest, checks::delete_endpoint
        => scheduler.delete_webhook_endpoint(DeleteWebhookEndpointRequest);
    pb::TestWebhookEndpointRequest, checks::test_endpoint
        => scheduler.test_webhook_endpoint(TestWebhookEndpointRequest);
    pb::ListWebhookMessagesRequest, checks::messages
        => scheduler.list_webhook_messages(ListWebhookMessagesRequest);
}

/// What the listings check before they go on.
mod checks {
    use super::*;

    pub(super) fn list_runs(r: &pb::ListRunsRequest) -> Result<(), Violations> {
        convert::page_size(r.page_size, 50, "page_size")?;
        convert::run_list_filter(r)?;
        convert::check_optional_text(&[
            ("automation_id", &r.automation_id),
            ("page_token", &r.page_token),
        ])
    }

    pub(super) fn summarize_usage(r: &pb::SummarizeUsageRequest) -> Result<(), Violations> {
        convert::parse_usage_query(r).map(drop)
    }

    pub(super) fn list_run_events(r: &pb::ListRunEventsRequest) -> Result<(), Violations> {
        convert::require_id(&r.run_id, "run_id")
    }

    pub(super) fn update(r: &pb::UpdateAutomationRequest) -> Result<(), Violations> {
        convert::parse_update(r, chrono::Utc::now()).map(drop)
    }

    pub(super) fn none<T>(_: &T) -> Result<(), Violations> {
        Ok(())
    }

    pub(super) fn delete_endpoint(r: &pb::DeleteWebhookEndpointRequest) -> Result<(), Violations> {
        convert::require_id(&r.id, "id")
    }

    pub(super) fn test_endpoint(r: &pb::TestWebhookEndpointRequest) -> Result<(), Violations> {
        convert::require_id(&r.id, "id")
    }

    pub(super) fn messages(r: &pb::ListWebhookMessagesRequest) -> Result<(), Violations> {
        convert::require_id(&r.endpoint_id, "endpoint_id")
    }

    /// The URL is checked by the scheduler, which knows what its operator
    /// allows; here only what no operator allows.
    pub(super) fn create_endpoint(r: &pb::CreateWebhookEndpointRequest) -> Result<(), Violations> {
        convert::check_optional_text(&[("url", &r.url), ("description", &r.description)])?;
        if r.url.trim().is_empty() {
            let mut v = Violations::default();
            v.field("url", "required: the https URL messages are posted to");
            return Err(v);
        }
        Ok(())
    }

    pub(super) fn list_automations(r: &pb::ListAutomationsRequest) -> Result<(), Violations> {
        convert::page_size(r.page_size, 50, "page_size")?;
        convert::check_optional_text(&[("page_token", &r.page_token)])
    }
}

#[tonic::async_trait]
impl Pass for pb::CreateRunnerTokenRequest {
    type Up = rpb::CreateRunnerTokenRequest;
    type Down = rpb::CreateRunnerTokenResponse;
    type Reply = pb::CreateRunnerTokenResponse;
    fn up(self, caller: Option<Caller>) -> Self::Up {
        let runner_name = self.runner_name;
        rpb::CreateRunnerTokenRequest {
            caller,
            runner_name,
        }
    }
    async fn call(upstreams: &Upstreams, up: Self::Up) -> Answer<Self::Down> {
        upstreams.runner_tokens().create_runner_token(up).await
    }
    fn reply(created: Self::Down) -> Result<Self::Reply, Status> {
        Ok(pb::CreateRunnerTokenResponse {
            runner_id: created.runner_id,
            token: created.token,
            create_time: created.create_time,
        })
    }
}

#[tonic::async_trait]
impl Pass for pb::RevokeRunnerTokenRequest {
    type Up = rpb::RevokeRunnerTokenRequest;
    type Down = rpb::RevokeRunnerTokenResponse;
    type Reply = pb::RevokeRunnerTokenResponse;
    async fn call(upstreams: &Upstreams, up: Self::Up) -> Answer<Self::Down> {
        upstreams.runner_tokens().revoke_runner_token(up).await
    }
    fn up(self, caller: Option<Caller>) -> Self::Up {
        let runner_id = self.runner_id;
        rpb::RevokeRunnerTokenRequest { caller, runner_id }
    }
    fn reply(_revoked: Self::Down) -> Result<Self::Reply, Status> {
        Ok(pb::RevokeRunnerTokenResponse {})
    }
}

#[tonic::async_trait]
impl Pass for pb::ListRunnersRequest {
    type Up = rpb::ListRunnersRequest;
    type Down = rpb::ListRunnersResponse;
    type Reply = pb::ListRunnersResponse;
    async fn call(upstreams: &Upstreams, up: Self::Up) -> Answer<Self::Down> {
        upstreams.runner_tokens().list_runners(up).await
    }
    fn up(self, caller: Option<Caller>) -> Self::Up {
        rpb::ListRunnersRequest { caller }
    }
    fn reply(listed: Self::Down) -> Result<Self::Reply, Status> {
        Ok(listed.response.unwrap_or_default())
    }
}
