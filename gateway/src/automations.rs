//! `automesh.v1.Automations`: validated here, stored by the scheduler; runner
//! tokens are minted by the runner gateway. Every call is passed on (see
//! `pass.rs`); what is particular to a call is its `Pass`.

use automesh_domain::{Placement, Principal, Violations};
use automesh_edge::convert;
use automesh_edge::status;
use automesh_proto::internal::v1::Caller;
use automesh_proto::scheduler::v1 as spb;
use automesh_proto::v1 as pb;
use automesh_proto::v1::automations_server::Automations;
use chrono::Utc;
use tonic::Status;

use crate::pass::{Answer, Pass};
use crate::{Gateway, Upstreams, forwarded};

#[tonic::async_trait]
impl Automations for Gateway {
    crate::pass::passed! {
        create_automation(CreateAutomationRequest) -> CreateAutomationResponse;
        get_automation(GetAutomationRequest) -> GetAutomationResponse;
        list_automations(ListAutomationsRequest) -> ListAutomationsResponse;
        update_automation(UpdateAutomationRequest) -> UpdateAutomationResponse;
        activate_automation(ActivateAutomationRequest) -> ActivateAutomationResponse;
        deactivate_automation(DeactivateAutomationRequest) -> DeactivateAutomationResponse;
        archive_automation(ArchiveAutomationRequest) -> ArchiveAutomationResponse;
        run_automation_now(RunAutomationNowRequest) -> RunAutomationNowResponse;
        create_runner_token(CreateRunnerTokenRequest) -> CreateRunnerTokenResponse;
        revoke_runner_token(RevokeRunnerTokenRequest) -> RevokeRunnerTokenResponse;
        list_runners(ListRunnersRequest) -> ListRunnersResponse;
    }

    async fn batch_activate_automations(
        &self,
        request: tonic::Request<pb::BatchActivateAutomationsRequest>,
    ) -> Result<tonic::Response<pb::BatchActivateAutomationsResponse>, Status> {
        // A caller that is not signed in is refused once, not per id.
        self.principal(&request)?;
        let (metadata, _, batch) = request.into_parts();
        convert::require_ids(&batch.ids, "ids", BATCH_LIMIT)
            .map_err(|v| status::invalid_argument(&v))?;
        let results = self
            .batch(&metadata, batch.ids, |id| pb::ActivateAutomationRequest {
                id,
                etag: String::new(),
            })
            .await;
        Ok(tonic::Response::new(pb::BatchActivateAutomationsResponse {
            results,
        }))
    }

    async fn batch_deactivate_automations(
        &self,
        request: tonic::Request<pb::BatchDeactivateAutomationsRequest>,
    ) -> Result<tonic::Response<pb::BatchDeactivateAutomationsResponse>, Status> {
        // A caller that is not signed in is refused once, not per id.
        self.principal(&request)?;
        let (metadata, _, batch) = request.into_parts();
        let mut checked = convert::require_ids(&batch.ids, "ids", BATCH_LIMIT);
        if let Err(v) = convert::parse_pause_reason(&batch.reason, "reason") {
            let mut all = checked.err().unwrap_or_default();
            v.iter().cloned().for_each(|x| all.push(x));
            checked = Err(all);
        }
        checked.map_err(|v| status::invalid_argument(&v))?;
        let reason = batch.reason;
        let results = self
            .batch(&metadata, batch.ids, |id| pb::DeactivateAutomationRequest {
                id,
                etag: String::new(),
                reason: reason.clone(),
            })
            .await;
        Ok(tonic::Response::new(
            pb::BatchDeactivateAutomationsResponse { results },
        ))
    }

    async fn preview_schedule(
        &self,
        request: tonic::Request<pb::PreviewScheduleRequest>,
    ) -> Result<tonic::Response<pb::PreviewScheduleResponse>, Status> {
        self.preview(request).map(tonic::Response::new)
    }
}

/// The most automations one batch call changes.
const BATCH_LIMIT: usize = 100;

/// A batch's state changes: each passed on as the single call would be
/// (its checks, its admission, its own answer), a few at a time.
trait Answers: Pass {
    fn automation(reply: Self::Reply) -> Option<pb::Automation>;
}

impl Answers for pb::ActivateAutomationRequest {
    fn automation(reply: pb::ActivateAutomationResponse) -> Option<pb::Automation> {
        reply.automation
    }
}

impl Answers for pb::DeactivateAutomationRequest {
    fn automation(reply: pb::DeactivateAutomationResponse) -> Option<pb::Automation> {
        reply.automation
    }
}

impl Gateway {
    async fn batch<R: Answers>(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        ids: Vec<String>,
        single: impl Fn(String) -> R,
    ) -> Vec<pb::AutomationResult> {
        use futures_util::stream::{self, StreamExt};
        let calls = ids.into_iter().map(|id| {
            let mut request = tonic::Request::new(single(id.clone()));
            *request.metadata_mut() = metadata.clone();
            async move {
                match self.pass(request).await {
                    Ok(reply) => pb::AutomationResult {
                        id,
                        automation: R::automation(reply.into_inner()),
                        code: 0,
                        message: String::new(),
                    },
                    Err(status) => pb::AutomationResult {
                        id,
                        automation: None,
                        code: status.code() as i32,
                        message: status.message().to_owned(),
                    },
                }
            }
        });
        // In the request's order; a few at a time, so one batch cannot take
        // every upstream connection.
        stream::iter(calls).buffered(8).collect().await
    }
}

/// A new automation's model must be one the caller may use where it runs,
/// and a cloud automation needs the owner's cloud worker.
#[tonic::async_trait]
impl Pass for pb::CreateAutomationRequest {
    type Up = spb::CreateAutomationRequest;
    type Down = spb::CreateAutomationResponse;
    type Reply = pb::CreateAutomationResponse;

    fn check(&self) -> Result<(), Violations> {
        convert::parse_create(self.automation.as_ref(), self.surface, Utc::now()).map(drop)
    }

    async fn admit(&self, gateway: &Gateway, owner: &Principal) -> Result<(), Status> {
        let input = convert::parse_create(self.automation.as_ref(), self.surface, Utc::now())
            .map_err(|v| status::invalid_argument(&v))?;
        let placement = input.placement();
        gateway.check_model(owner, &input.model, placement)?;
        if placement == Placement::Cloud {
            gateway.require_cloud_worker(owner).await?;
        }
        Ok(())
    }

    fn up(self, caller: Option<Caller>) -> Self::Up {
        let (automation, surface) = (self.automation, self.surface);
        spb::CreateAutomationRequest {
            caller,
            automation,
            surface,
        }
    }

    async fn call(upstreams: &Upstreams, up: Self::Up) -> Answer<Self::Down> {
        upstreams.scheduler().create_automation(up).await
    }

    fn reply(created: Self::Down) -> Result<Self::Reply, Status> {
        let automation = created.automation;
        Ok(pb::CreateAutomationResponse { automation })
    }
}

/// A new model must be one the caller may use where the stored automation
/// runs.
pub(crate) async fn admit_update(
    update: &pb::UpdateAutomationRequest,
    gateway: &Gateway,
    owner: &Principal,
) -> Result<(), Status> {
    let update = convert::parse_update(update, Utc::now());
    let update = update.map_err(|v| status::invalid_argument(&v))?;
    let Some(model) = update.patch.model else {
        return Ok(());
    };
    // The model rules depend on the stored placement.
    let (_, placement) = stored(gateway, owner, update.id).await?;
    gateway.check_model(owner, &model, placement)
}

/// The caller's stored automation `id` and its placement.
async fn stored(
    gateway: &Gateway,
    owner: &Principal,
    id: String,
) -> Result<(pb::Automation, Placement), Status> {
    let caller = Some(convert::caller(owner));
    let stored = spb::GetAutomationRequest { caller, id };
    let stored = gateway.upstreams.scheduler().get_automation(stored).await;
    let stored = forwarded(stored)?.automation.unwrap_or_default();
    let placement = convert::placement_from_pb(stored.placement)
        .ok_or_else(|| status::internal("the stored automation", &"no placement"))?;
    Ok((stored, placement))
}

/// An automation is activated only while the catalogue admits its model
/// where it runs: activating one that needs attention because its model was
/// de-authorised would only fail its next run again.
async fn admit_activation(
    activate: &pb::ActivateAutomationRequest,
    gateway: &Gateway,
    owner: &Principal,
) -> Result<(), Status> {
    let (stored, placement) = stored(gateway, owner, activate.id.clone()).await?;
    match gateway
        .models
        .admits(&stored.model, &owner.org_id, placement)
    {
        Ok(_) => Ok(()),
        Err(refusal) => Err(status::failed_precondition(
            "MODEL_AUTHORIZATION",
            &format!("models/{}", stored.model),
            &format!(
                "{}; change the automation's model, or have the model authorised, before \
                 activating it",
                refusal.explain(&stored.model, &owner.org_id)
            ),
        )),
    }
}

/// Activation, deactivation and archival: one internal call, the change
/// named. Each row is the public request, the change (and what must hold
/// before it goes on, if anything) and the public answer.
macro_rules! state_changes {
    ($($req:ident => $change:ident $(, admit $admit:path)? $(, with $reason:ident)? => $reply:ident;)+) => {$(
        #[tonic::async_trait]
        impl Pass for pb::$req {
            type Up = spb::SetAutomationStateRequest;
            type Down = spb::SetAutomationStateResponse;
            type Reply = pb::$reply;
            fn check(&self) -> Result<(), Violations> {
                convert::require_id(&self.id, "id")?;
                $(convert::parse_pause_reason(&self.$reason, "reason")?;)?
                convert::parse_optional_etag(&self.etag, "etag").map(drop)
            }
            $(
                async fn admit(&self, gateway: &Gateway, owner: &Principal) -> Result<(), Status> {
                    $admit(self, gateway, owner).await
                }
            )?
            fn up(self, caller: Option<Caller>) -> Self::Up {
                let change = spb::StateChange::$change as i32;
                let reason: String = None$(.or(Some(self.$reason)))?.unwrap_or_default();
                spb::SetAutomationStateRequest { caller, id: self.id, etag: self.etag, change, reason }
            }
            async fn call(upstreams: &Upstreams, up: Self::Up) -> Answer<Self::Down> {
                upstreams.scheduler().set_automation_state(up).await
            }
            fn reply(set: Self::Down) -> Result<Self::Reply, Status> {
                let automation = set.automation.ok_or_else(|| {
                    status::internal("the scheduler's answer", &"no automation in it")
                })?;
                Ok(pb::$reply { automation: Some(automation) })
            }
        }
    )+};
}

state_changes! {
    ActivateAutomationRequest => Activate, admit admit_activation => ActivateAutomationResponse;
    DeactivateAutomationRequest => Deactivate, with reason => DeactivateAutomationResponse;
    ArchiveAutomationRequest => Archive => ArchiveAutomationResponse;
}
