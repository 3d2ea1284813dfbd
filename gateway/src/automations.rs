//! `automesh.v1.Automations`: validated here, stored by the scheduler.

use automesh_proto::runner::v1 as rpb;
use automesh_proto::scheduler::v1 as spb;
use automesh_proto::v1 as pb;
use automesh_proto::v1::automations_server::Automations;
use automesh_rpc::convert;
use automesh_rpc::status;
use chrono::Utc;
use tonic::{Request, Response, Status};

use crate::Gateway;

fn invalid(v: automesh_domain::Violations) -> Status {
    status::invalid_argument(&v)
}

impl Gateway {
    async fn set_state(
        &self,
        request: Request<(String, String)>,
        change: spb::StateChange,
    ) -> Result<pb::Automation, Status> {
        let owner = self.principal(&request)?;
        let (id, etag) = request.into_inner();
        convert::require_id(&id, "id").map_err(invalid)?;
        convert::parse_optional_etag(&etag, "etag").map_err(invalid)?;
        let mut scheduler = self.upstreams.scheduler.clone();
        let resp = scheduler
            .set_automation_state(spb::SetAutomationStateRequest {
                caller: Some(convert::caller(&owner)),
                id,
                etag,
                change: change as i32,
            })
            .await
            .map_err(status::forward)?;
        resp.into_inner()
            .automation
            .ok_or_else(|| status::internal("the scheduler's answer", &"no automation in it"))
    }
}

#[tonic::async_trait]
impl Automations for Gateway {
    async fn create_automation(
        &self,
        request: Request<pb::CreateAutomationRequest>,
    ) -> Result<Response<pb::CreateAutomationResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        let input = convert::parse_create(req.automation.as_ref(), req.surface, Utc::now())
            .map_err(invalid)?;
        self.check_model(&owner, &input.model, input.placement())?;
        if input.placement() == automesh_domain::Placement::Cloud {
            self.require_cloud_worker(&owner).await?;
        }
        let mut scheduler = self.upstreams.scheduler.clone();
        let resp = scheduler
            .create_automation(spb::CreateAutomationRequest {
                caller: Some(convert::caller(&owner)),
                automation: req.automation,
                surface: req.surface,
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(pb::CreateAutomationResponse {
            automation: resp.into_inner().automation,
        }))
    }

    async fn get_automation(
        &self,
        request: Request<pb::GetAutomationRequest>,
    ) -> Result<Response<pb::GetAutomationResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::require_id(&req.id, "id").map_err(invalid)?;
        let mut scheduler = self.upstreams.scheduler.clone();
        let resp = scheduler
            .get_automation(spb::GetAutomationRequest {
                caller: Some(convert::caller(&owner)),
                id: req.id,
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(pb::GetAutomationResponse {
            automation: resp.into_inner().automation,
        }))
    }

    async fn list_automations(
        &self,
        request: Request<pb::ListAutomationsRequest>,
    ) -> Result<Response<pb::ListAutomationsResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::page_size(req.page_size, 50, "page_size").map_err(invalid)?;
        convert::check_optional_text(&[("page_token", &req.page_token)]).map_err(invalid)?;
        let mut scheduler = self.upstreams.scheduler.clone();
        let resp = scheduler
            .list_automations(spb::ListAutomationsRequest {
                caller: Some(convert::caller(&owner)),
                request: Some(req),
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(
            resp.into_inner().response.unwrap_or_default(),
        ))
    }

    async fn update_automation(
        &self,
        request: Request<pb::UpdateAutomationRequest>,
    ) -> Result<Response<pb::UpdateAutomationResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        let update = convert::parse_update(&req, Utc::now()).map_err(invalid)?;
        let mut scheduler = self.upstreams.scheduler.clone();
        if let Some(model) = &update.patch.model {
            // The model rules depend on the stored placement.
            let current = scheduler
                .get_automation(spb::GetAutomationRequest {
                    caller: Some(convert::caller(&owner)),
                    id: update.id.clone(),
                })
                .await
                .map_err(status::forward)?
                .into_inner()
                .automation
                .unwrap_or_default();
            let placement = convert::placement_from_pb(current.placement)
                .ok_or_else(|| status::internal("the stored automation", &"no placement"))?;
            self.check_model(&owner, model, placement)?;
        }
        let resp = scheduler
            .update_automation(spb::UpdateAutomationRequest {
                caller: Some(convert::caller(&owner)),
                request: Some(req),
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(pb::UpdateAutomationResponse {
            automation: resp.into_inner().automation,
        }))
    }

    async fn activate_automation(
        &self,
        request: Request<pb::ActivateAutomationRequest>,
    ) -> Result<Response<pb::ActivateAutomationResponse>, Status> {
        let (md, ext, req) = request.into_parts();
        let automation = self
            .set_state(
                Request::from_parts(md, ext, (req.id, req.etag)),
                spb::StateChange::Activate,
            )
            .await?;
        Ok(Response::new(pb::ActivateAutomationResponse {
            automation: Some(automation),
        }))
    }

    async fn deactivate_automation(
        &self,
        request: Request<pb::DeactivateAutomationRequest>,
    ) -> Result<Response<pb::DeactivateAutomationResponse>, Status> {
        let (md, ext, req) = request.into_parts();
        let automation = self
            .set_state(
                Request::from_parts(md, ext, (req.id, req.etag)),
                spb::StateChange::Deactivate,
            )
            .await?;
        Ok(Response::new(pb::DeactivateAutomationResponse {
            automation: Some(automation),
        }))
    }

    async fn archive_automation(
        &self,
        request: Request<pb::ArchiveAutomationRequest>,
    ) -> Result<Response<pb::ArchiveAutomationResponse>, Status> {
        let (md, ext, req) = request.into_parts();
        let automation = self
            .set_state(
                Request::from_parts(md, ext, (req.id, req.etag)),
                spb::StateChange::Archive,
            )
            .await?;
        Ok(Response::new(pb::ArchiveAutomationResponse {
            automation: Some(automation),
        }))
    }

    async fn run_automation_now(
        &self,
        request: Request<pb::RunAutomationNowRequest>,
    ) -> Result<Response<pb::RunAutomationNowResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::parse_run_now(&req).map_err(invalid)?;
        let mut scheduler = self.upstreams.scheduler.clone();
        let resp = scheduler
            .run_automation_now(spb::RunAutomationNowRequest {
                caller: Some(convert::caller(&owner)),
                request: Some(req),
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(pb::RunAutomationNowResponse {
            run: resp.into_inner().run,
        }))
    }

    async fn create_runner_token(
        &self,
        request: Request<pb::CreateRunnerTokenRequest>,
    ) -> Result<Response<pb::CreateRunnerTokenResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        let mut tokens = self.upstreams.runner_tokens.clone();
        let resp = tokens
            .create_runner_token(rpb::CreateRunnerTokenRequest {
                caller: Some(convert::caller(&owner)),
                runner_name: req.runner_name,
            })
            .await
            .map_err(status::forward)?
            .into_inner();
        Ok(Response::new(pb::CreateRunnerTokenResponse {
            runner_id: resp.runner_id,
            token: resp.token,
            create_time: resp.create_time,
        }))
    }

    async fn revoke_runner_token(
        &self,
        request: Request<pb::RevokeRunnerTokenRequest>,
    ) -> Result<Response<pb::RevokeRunnerTokenResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        let mut tokens = self.upstreams.runner_tokens.clone();
        tokens
            .revoke_runner_token(rpb::RevokeRunnerTokenRequest {
                caller: Some(convert::caller(&owner)),
                runner_id: req.runner_id,
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(pb::RevokeRunnerTokenResponse {}))
    }
}
