//! `automesh.v1.Automations`: validated here, stored by the scheduler.

use automesh_proto::runner::v1 as rpb;
use automesh_proto::scheduler::v1 as spb;
use automesh_proto::v1 as pb;
use automesh_proto::v1::automations_server::Automations;
use automesh_rpc::convert;
use automesh_rpc::status;
use chrono::Utc;
use tonic::{Request, Response, Status};

use crate::{Gateway, forwarded};

impl Gateway {
    /// Activates, deactivates or archives the automation `id` of the caller.
    async fn set_state<T>(
        &self,
        request: Request<T>,
        id_and_etag: impl FnOnce(T) -> (String, String),
        change: spb::StateChange,
    ) -> Result<Option<pb::Automation>, Status> {
        let call = self.accept(request, |_| Ok(()))?;
        let caller = call.caller();
        let (id, etag) = id_and_etag(call.req);
        convert::require_id(&id, "id").map_err(|v| status::invalid_argument(&v))?;
        convert::parse_optional_etag(&etag, "etag").map_err(|v| status::invalid_argument(&v))?;
        let upstream = spb::SetAutomationStateRequest {
            caller,
            id,
            etag,
            change: change as i32,
        };
        let answer = self
            .upstreams
            .scheduler()
            .set_automation_state(upstream)
            .await;
        let automation = forwarded(answer)?.automation;
        automation
            .ok_or_else(|| status::internal("the scheduler's answer", &"no automation in it"))
            .map(Some)
    }
}

// Each call: accepted (authenticated, checked), scoped to its caller,
// forwarded to the scheduler (runner tokens: to the runner gateway), its
// answer passed on.
#[tonic::async_trait]
impl Automations for Gateway {
    async fn create_automation(
        &self,
        request: Request<pb::CreateAutomationRequest>,
    ) -> Result<Response<pb::CreateAutomationResponse>, Status> {
        let mut placement = None;
        let call = self.accept(request, |r| {
            let input = convert::parse_create(r.automation.as_ref(), r.surface, Utc::now())?;
            placement = Some((input.placement(), input.model));
            Ok(())
        })?;
        if let Some((placement, model)) = placement {
            self.check_model(&call.owner, &model, placement)?;
            if placement == automesh_domain::Placement::Cloud {
                self.require_cloud_worker(&call.owner).await?;
            }
        }
        let upstream = spb::CreateAutomationRequest {
            caller: call.caller(),
            automation: call.req.automation,
            surface: call.req.surface,
        };
        let answer = self.upstreams.scheduler().create_automation(upstream).await;
        let automation = forwarded(answer)?.automation;
        Ok(Response::new(pb::CreateAutomationResponse { automation }))
    }

    async fn get_automation(
        &self,
        request: Request<pb::GetAutomationRequest>,
    ) -> Result<Response<pb::GetAutomationResponse>, Status> {
        let call = self.accept(request, |r| convert::require_id(&r.id, "id"))?;
        let upstream = spb::GetAutomationRequest {
            caller: call.caller(),
            id: call.req.id,
        };
        let answer = self.upstreams.scheduler().get_automation(upstream).await;
        let automation = forwarded(answer)?.automation;
        Ok(Response::new(pb::GetAutomationResponse { automation }))
    }

    async fn list_automations(
        &self,
        request: Request<pb::ListAutomationsRequest>,
    ) -> Result<Response<pb::ListAutomationsResponse>, Status> {
        let call = self.accept(request, |r| {
            convert::page_size(r.page_size, 50, "page_size")?;
            convert::check_optional_text(&[("page_token", &r.page_token)])
        })?;
        let upstream = spb::ListAutomationsRequest {
            caller: call.caller(),
            request: Some(call.req),
        };
        let answer = self.upstreams.scheduler().list_automations(upstream).await;
        Ok(Response::new(
            forwarded(answer)?.response.unwrap_or_default(),
        ))
    }

    async fn update_automation(
        &self,
        request: Request<pb::UpdateAutomationRequest>,
    ) -> Result<Response<pb::UpdateAutomationResponse>, Status> {
        let mut changed = None;
        let call = self.accept(request, |r| {
            let update = convert::parse_update(r, Utc::now())?;
            changed = update.patch.model.map(|model| (update.id, model));
            Ok(())
        })?;
        let mut scheduler = self.upstreams.scheduler.clone();
        if let Some((id, model)) = changed {
            // The model rules depend on the stored placement.
            let upstream = spb::GetAutomationRequest {
                caller: call.caller(),
                id,
            };
            let current = forwarded(scheduler.get_automation(upstream).await)?.automation;
            let placement = convert::placement_from_pb(current.unwrap_or_default().placement)
                .ok_or_else(|| status::internal("the stored automation", &"no placement"))?;
            self.check_model(&call.owner, &model, placement)?;
        }
        let upstream = spb::UpdateAutomationRequest {
            caller: call.caller(),
            request: Some(call.req),
        };
        let automation = forwarded(scheduler.update_automation(upstream).await)?.automation;
        Ok(Response::new(pb::UpdateAutomationResponse { automation }))
    }

    async fn activate_automation(
        &self,
        request: Request<pb::ActivateAutomationRequest>,
    ) -> Result<Response<pb::ActivateAutomationResponse>, Status> {
        let automation = self
            .set_state(request, |r| (r.id, r.etag), spb::StateChange::Activate)
            .await?;
        Ok(Response::new(pb::ActivateAutomationResponse { automation }))
    }

    async fn deactivate_automation(
        &self,
        request: Request<pb::DeactivateAutomationRequest>,
    ) -> Result<Response<pb::DeactivateAutomationResponse>, Status> {
        let change = spb::StateChange::Deactivate;
        let automation = self.set_state(request, |r| (r.id, r.etag), change).await?;
        Ok(Response::new(pb::DeactivateAutomationResponse {
            automation,
        }))
    }

    async fn archive_automation(
        &self,
        request: Request<pb::ArchiveAutomationRequest>,
    ) -> Result<Response<pb::ArchiveAutomationResponse>, Status> {
        let change = spb::StateChange::Archive;
        let automation = self.set_state(request, |r| (r.id, r.etag), change).await?;
        Ok(Response::new(pb::ArchiveAutomationResponse { automation }))
    }

    async fn run_automation_now(
        &self,
        request: Request<pb::RunAutomationNowRequest>,
    ) -> Result<Response<pb::RunAutomationNowResponse>, Status> {
        let call = self.accept(request, convert::parse_run_now)?;
        let upstream = spb::RunAutomationNowRequest {
            caller: call.caller(),
            request: Some(call.req),
        };
        let answer = self
            .upstreams
            .scheduler()
            .run_automation_now(upstream)
            .await;
        let run = forwarded(answer)?.run;
        Ok(Response::new(pb::RunAutomationNowResponse { run }))
    }

    async fn create_runner_token(
        &self,
        request: Request<pb::CreateRunnerTokenRequest>,
    ) -> Result<Response<pb::CreateRunnerTokenResponse>, Status> {
        let call = self.accept(request, |_| Ok(()))?;
        let upstream = rpb::CreateRunnerTokenRequest {
            caller: call.caller(),
            runner_name: call.req.runner_name,
        };
        let answer = self
            .upstreams
            .runner_tokens()
            .create_runner_token(upstream)
            .await;
        let created = forwarded(answer)?;
        Ok(Response::new(pb::CreateRunnerTokenResponse {
            runner_id: created.runner_id,
            token: created.token,
            create_time: created.create_time,
        }))
    }

    async fn revoke_runner_token(
        &self,
        request: Request<pb::RevokeRunnerTokenRequest>,
    ) -> Result<Response<pb::RevokeRunnerTokenResponse>, Status> {
        let call = self.accept(request, |_| Ok(()))?;
        let upstream = rpb::RevokeRunnerTokenRequest {
            caller: call.caller(),
            runner_id: call.req.runner_id,
        };
        let answer = self
            .upstreams
            .runner_tokens()
            .revoke_runner_token(upstream)
            .await;
        forwarded(answer)?;
        Ok(Response::new(pb::RevokeRunnerTokenResponse {}))
    }
}
