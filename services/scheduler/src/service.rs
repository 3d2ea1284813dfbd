//! The scheduler's operations on automations and manual runs, and the thin
//! gRPC handlers in front of them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use automesh_domain::automation::{Automation, NewAutomation, StateChange};
use automesh_domain::ids::{manual_run_id, new_automation_id};
use automesh_domain::run::NewRun;
use automesh_domain::{
    AutomationPatch, AutomationState, Placement, Principal, Run, RunState, RunTrigger,
};
use automesh_proto::scheduler::v1 as spb;
use automesh_proto::scheduler::v1::scheduler_service_server::SchedulerService;
use automesh_proto::v1 as pb;
use automesh_rpc::convert::{self, CreateInput};
use automesh_rpc::propagation;
use automesh_store::page::Cursor;
use automesh_store::{Store, StoreError};
use chrono::{DateTime, Utc};
use tonic::{Request, Response, Status};

use crate::error::Error;

/// How many times an unconditional update retries when it races another write.
const UPDATE_ATTEMPTS: usize = 5;

/// The scheduler's state: the store and its settings. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Scheduler {
    store: Store,
    run_deadline: Duration,
    /// Wakes the occurrence loop after an edit that may move the next due instant.
    wake: Arc<Notify>,
}

impl Scheduler {
    pub fn new(store: Store, run_deadline: Duration, wake: Arc<Notify>) -> Self {
        Self {
            store,
            run_deadline,
            wake,
        }
    }

    /// Stores a new, active automation with its first occurrence.
    pub async fn create(
        &self,
        owner: &Principal,
        input: CreateInput,
        now: DateTime<Utc>,
    ) -> Result<Automation, Error> {
        let next = input.schedule.next_after(now);
        let new = NewAutomation {
            id: new_automation_id(),
            org_id: owner.org_id.clone(),
            owner_id: owner.user_id.clone(),
            name: input.name,
            prompt: input.prompt,
            model: input.model,
            surface: input.surface,
            schedule: input.schedule,
        };
        let created = self.store.create_automation(&new, next, now).await?;
        self.wake.notify_waiters();
        Ok(created)
    }

    /// Applies an edit. A claimed placement must equal the stored one; a
    /// given etag must match; archived automations do not change.
    pub async fn update(
        &self,
        owner: &Principal,
        id: &str,
        patch: AutomationPatch,
        claimed_placement: Option<Placement>,
        now: DateTime<Utc>,
    ) -> Result<Automation, Error> {
        self.write(owner, id, patch.expected_version, now, |current| {
            if let Some(claimed) = claimed_placement
                && claimed != current.placement
            {
                let mut v = automesh_domain::Violations::default();
                v.field(
                    "automation.placement",
                    format!(
                        "placement is {} and cannot be changed: create a new automation from the other surface",
                        current.placement
                    ),
                );
                return Err(Error::Invalid(v));
            }
            if current.state == AutomationState::Archived {
                return Err(Error::Archived);
            }
            let mut next = current.clone();
            if let Some(name) = &patch.name {
                next.name = name.clone();
            }
            if let Some(prompt) = &patch.prompt {
                next.prompt = prompt.clone();
            }
            if let Some(model) = &patch.model {
                next.model = model.clone();
            }
            if let Some(schedule) = &patch.schedule {
                next.schedule = schedule.clone();
                next.next_run_at = next
                    .state
                    .is_scheduling()
                    .then(|| schedule.next_after(now))
                    .flatten();
            }
            Ok(next)
        })
        .await
    }

    /// Activates, deactivates or archives. Activation clears needs-attention
    /// and schedules the next occurrence from now.
    pub async fn set_state(
        &self,
        owner: &Principal,
        id: &str,
        change: StateChange,
        expected_version: Option<i64>,
        now: DateTime<Utc>,
    ) -> Result<Automation, Error> {
        self.write(owner, id, expected_version, now, |current| {
            let state = current.state.apply(change)?;
            let mut next = current.clone();
            next.state = state;
            if state == AutomationState::Active {
                next.attention_reason = None;
                next.attention_message = None;
                next.next_run_at = next.schedule.next_after(now);
            } else {
                next.next_run_at = None;
            }
            Ok(next)
        })
        .await
    }

    /// Read-modify-write under optimistic concurrency. With an expected
    /// version, a lost race is `Stale`; without one, the write is retried on
    /// the new state a bounded number of times.
    async fn write(
        &self,
        owner: &Principal,
        id: &str,
        expected_version: Option<i64>,
        now: DateTime<Utc>,
        change: impl Fn(&Automation) -> Result<Automation, Error>,
    ) -> Result<Automation, Error> {
        for _ in 0..UPDATE_ATTEMPTS {
            let current = self.store.get_automation(owner, id).await?;
            if expected_version.is_some_and(|v| v != current.version) {
                return Err(Error::Stale);
            }
            let next = change(&current)?;
            if next == current {
                return Ok(current);
            }
            match self
                .store
                .update_automation_if_version(&next, current.version, now)
                .await
            {
                Ok(stored) => {
                    self.wake.notify_waiters();
                    return Ok(stored);
                }
                Err(StoreError::VersionConflict { .. }) if expected_version.is_none() => continue,
                Err(StoreError::VersionConflict { .. }) => return Err(Error::Stale),
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::Contended)
    }

    /// Creates (or returns) the manual run of `automation_id` for `key`.
    pub async fn run_now(
        &self,
        owner: &Principal,
        automation_id: &str,
        key: &str,
        now: DateTime<Utc>,
    ) -> Result<Run, Error> {
        let automation = self.store.get_automation(owner, automation_id).await?;
        let id = manual_run_id(&automation.id, key);
        if let Ok(existing) = self.store.get_run(owner, &id).await {
            return Ok(existing);
        }
        if automation.state == AutomationState::Archived {
            return Err(Error::Archived);
        }
        let deadline = now + chrono::Duration::from_std(self.run_deadline).unwrap_or_default();
        let run = NewRun {
            id,
            automation_id: automation.id.clone(),
            org_id: automation.org_id.clone(),
            owner_id: automation.owner_id.clone(),
            placement: automation.placement,
            trigger: RunTrigger::Manual,
            scheduled_for: None,
            idempotency_key: Some(key.to_owned()),
            prompt: automation.prompt.clone(),
            model: automation.model.clone(),
            state: RunState::Pending,
            error_code: None,
            error_message: None,
            deadline_at: deadline,
            traceparent: propagation::current_traceparent(),
        };
        let (run, created) = self.store.create_run(&run, now).await?;
        if created {
            tracing::info!(run_id = %run.id, automation_id = %run.automation_id, "manual run created");
            crate::metrics::count(&[crate::metrics::Created {
                placement: run.placement,
                trigger: RunTrigger::Manual,
                state: run.state,
                code: None,
            }]);
        }
        Ok(run)
    }
}

fn state_change(change: i32) -> Result<StateChange, Error> {
    match spb::StateChange::try_from(change) {
        Ok(spb::StateChange::Activate) => Ok(StateChange::Activate),
        Ok(spb::StateChange::Deactivate) => Ok(StateChange::Deactivate),
        Ok(spb::StateChange::Archive) => Ok(StateChange::Archive),
        _ => {
            let mut v = automesh_domain::Violations::default();
            v.field("change", "required: ACTIVATE, DEACTIVATE or ARCHIVE");
            Err(Error::Invalid(v))
        }
    }
}

#[tonic::async_trait]
impl SchedulerService for Scheduler {
    async fn create_automation(
        &self,
        request: Request<spb::CreateAutomationRequest>,
    ) -> Result<Response<spb::CreateAutomationResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let now = Utc::now();
        let input = convert::parse_create(req.automation.as_ref(), req.surface, now)
            .map_err(Error::from)?;
        let automation = self.create(&owner, input, now).await?;
        tracing::info!(automation_id = %automation.id, placement = %automation.placement, "automation created");
        Ok(Response::new(spb::CreateAutomationResponse {
            automation: Some(convert::automation_to_pb(&automation)),
        }))
    }

    async fn get_automation(
        &self,
        request: Request<spb::GetAutomationRequest>,
    ) -> Result<Response<spb::GetAutomationResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        convert::require_id(&req.id, "id").map_err(Error::from)?;
        let automation = self
            .store
            .get_automation(&owner, &req.id)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(spb::GetAutomationResponse {
            automation: Some(convert::automation_to_pb(&automation)),
        }))
    }

    async fn list_automations(
        &self,
        request: Request<spb::ListAutomationsRequest>,
    ) -> Result<Response<spb::ListAutomationsResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let list = req.request.unwrap_or_default();
        let size = convert::page_size(list.page_size, 50, "page_size").map_err(Error::from)?;
        let cursor = Cursor::decode(&list.page_token).map_err(Error::from)?;
        let page = self
            .store
            .list_automations(&owner, &cursor, size, list.show_archived)
            .await
            .map_err(Error::from)?;
        let mut automations: Vec<pb::Automation> =
            page.items.iter().map(convert::automation_to_pb).collect();
        // Within the page byte budget: a cut page goes on after its last
        // automation.
        let kept = automesh_proto::bounds::fitting(&automations);
        automations.truncate(kept);
        Ok(Response::new(spb::ListAutomationsResponse {
            response: Some(pb::ListAutomationsResponse {
                automations,
                next_page_token: page.next_token(kept),
            }),
        }))
    }

    async fn update_automation(
        &self,
        request: Request<spb::UpdateAutomationRequest>,
    ) -> Result<Response<spb::UpdateAutomationResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let now = Utc::now();
        let update =
            convert::parse_update(&req.request.unwrap_or_default(), now).map_err(Error::from)?;
        let automation = self
            .update(
                &owner,
                &update.id,
                update.patch,
                update.claimed_placement,
                now,
            )
            .await?;
        Ok(Response::new(spb::UpdateAutomationResponse {
            automation: Some(convert::automation_to_pb(&automation)),
        }))
    }

    async fn set_automation_state(
        &self,
        request: Request<spb::SetAutomationStateRequest>,
    ) -> Result<Response<spb::SetAutomationStateResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        convert::require_id(&req.id, "id").map_err(Error::from)?;
        let expected = convert::parse_optional_etag(&req.etag, "etag").map_err(Error::from)?;
        let change = state_change(req.change)?;
        let automation = self
            .set_state(&owner, &req.id, change, expected, Utc::now())
            .await?;
        tracing::info!(automation_id = %automation.id, state = %automation.state, "automation state set");
        Ok(Response::new(spb::SetAutomationStateResponse {
            automation: Some(convert::automation_to_pb(&automation)),
        }))
    }

    async fn run_automation_now(
        &self,
        request: Request<spb::RunAutomationNowRequest>,
    ) -> Result<Response<spb::RunAutomationNowResponse>, Status> {
        let (owner, req) = convert::scoped(request)?;
        let run_now = req.request.unwrap_or_default();
        convert::parse_run_now(&run_now).map_err(Error::from)?;
        let run = self
            .run_now(&owner, &run_now.id, &run_now.idempotency_key, Utc::now())
            .await?;
        Ok(Response::new(spb::RunAutomationNowResponse {
            run: Some(convert::run_to_pb(&run, None)),
        }))
    }
}
