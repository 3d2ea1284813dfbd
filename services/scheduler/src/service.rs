//! The scheduler's operations on automations and manual runs, and the thin
//! gRPC handlers in front of them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use automesh_domain::automation::{Automation, NewAutomation, StateChange, month_of};
use automesh_domain::ids::{manual_run_id, new_automation_id};
use automesh_domain::run::NewRun;
use automesh_domain::{
    AutomationPatch, AutomationState, ErrorCode, Notice, Placement, Principal, Receipt, Run,
    RunState, RunTrigger,
};
use automesh_edge::convert::{self, CreateInput};
use automesh_proto::scheduler::v1 as spb;
use automesh_proto::scheduler::v1::scheduler_service_server::SchedulerService;
use automesh_proto::v1 as pb;
use automesh_store::page::Cursor;
use automesh_store::{Store, StoreError};
use automesh_telemetry::propagation;
use chrono::{DateTime, Utc};

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
    /// What the operator configured for webhooks (none: notifications off).
    webhooks: Option<Arc<crate::webhooks::Webhooks>>,
}

impl Scheduler {
    pub fn new(
        store: Store,
        run_deadline: Duration,
        wake: Arc<Notify>,
        webhooks: Option<Arc<crate::webhooks::Webhooks>>,
    ) -> Self {
        Self {
            store,
            run_deadline,
            wake,
            webhooks,
        }
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    pub(crate) fn webhook_settings(&self) -> Option<&crate::webhooks::Webhooks> {
        self.webhooks.as_deref()
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
            owner: owner.clone(),
            name: input.name,
            prompt: input.prompt,
            model: input.model,
            surface: input.surface,
            schedule: input.schedule,
            pause_after_failures: input.pause_after_failures,
            budget: input.budget,
            monthly_budget_micros: input.monthly_budget_micros,
        };
        let created = self.store.create_automation(&new, next, now).await?;
        self.wake.notify_waiters();
        Ok(created)
    }

    /// What the runs of `a` created in the calendar month of `at` (in its
    /// schedule's zone) cost so far, by their receipts.
    pub async fn month_spend(&self, a: &Automation, at: DateTime<Utc>) -> Result<i64, Error> {
        let (from, to) = month_of(at, a.schedule.zone());
        Ok(self.store.internal().month_spend(&a.id, from, to).await?)
    }

    /// Applies an edit. A claimed placement must equal the stored one; a
    /// given etag must match; archived automations do not change. A
    /// monthly budget raised above (or removed from) what the month spent
    /// resumes an automation paused for it.
    pub async fn update(
        &self,
        owner: &Principal,
        id: &str,
        patch: AutomationPatch,
        claimed_placement: Option<Placement>,
        now: DateTime<Utc>,
    ) -> Result<Automation, Error> {
        let spent = match patch.monthly_budget_micros {
            Some(_) => {
                let current = self.store.get_automation(owner, id).await?;
                Some(self.month_spend(&current, now).await?)
            }
            None => None,
        };
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
            if let Some(n) = patch.pause_after_failures {
                next.pause_after_failures = n;
            }
            if let Some(cap) = patch.max_cost_micros {
                next.budget.max_cost_micros = cap;
            }
            if let Some(cap) = patch.max_tokens {
                next.budget.max_tokens = cap;
            }
            if let Some(budget) = patch.monthly_budget_micros {
                next.monthly_budget_micros = budget;
                if spent.is_some_and(|spent| !next.month_spent(spent)) && next.resume_budget(now) {
                    tracing::info!(automation_id = %next.id, "monthly budget raised above this month's spend: active again");
                }
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
        reason: Option<&str>,
        expected_version: Option<i64>,
        now: DateTime<Utc>,
    ) -> Result<Automation, Error> {
        self.write(owner, id, expected_version, now, |current| {
            let state = current.state.apply(change)?;
            let mut next = current.clone();
            next.state = state;
            // A reason is kept while the automation stays paused; pausing
            // again without one keeps the one given before.
            next.pause_reason = match state {
                AutomationState::Inactive => reason
                    .map(str::to_owned)
                    .or_else(|| current.pause_reason.clone()),
                _ => None,
            };
            if state == AutomationState::Active {
                // Activation ends a failure streak: the owner has looked.
                next.failure_streak = Default::default();
                next.attention = None;
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
        // A run this key made already is returned as it is (the one made
        // before an archive too); a request racing this one with the same
        // key finds the key taken when it creates, and gets this run.
        let existing = self.store.run_for_key(owner, &automation.id, key).await?;
        match (existing, automation.state) {
            (Some(existing), _) => return Ok(existing),
            (None, AutomationState::Archived) => return Err(Error::Archived),
            (None, _) => {}
        }
        let id = manual_run_id(&automation.id, key, now);
        if automation.monthly_budget_micros.is_some() {
            let spent = self.month_spend(&automation, now).await?;
            if automation.month_spent(spent) {
                return self
                    .skip_for_budget(owner, &automation, id, key, spent, now)
                    .await;
            }
        }
        let deadline = now + chrono::Duration::from_std(self.run_deadline).unwrap_or_default();
        let run = NewRun {
            id,
            automation: &automation,
            trigger: RunTrigger::Manual,
            scheduled_for: None,
            idempotency_key: Some(key.to_owned()),
            state: RunState::Pending,
            error: None,
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
                fired: None,
            }]);
        }
        Ok(run)
    }
}

impl Scheduler {
    /// A run-now that finds the month's budget spent: recorded as a run
    /// skipped with `budget_exhausted` on its receipt (one transaction),
    /// and the automation, if active, needs attention for it.
    async fn skip_for_budget(
        &self,
        owner: &Principal,
        automation: &Automation,
        id: String,
        key: &str,
        spent: i64,
        now: DateTime<Utc>,
    ) -> Result<Run, Error> {
        let why = format!(
            "this month's runs cost {spent} micro-units, the monthly budget is {}",
            automation.monthly_budget_micros.unwrap_or_default()
        );
        let run = NewRun {
            id: id.clone(),
            automation,
            trigger: RunTrigger::Manual,
            scheduled_for: None,
            idempotency_key: Some(key.to_owned()),
            state: RunState::Skipped,
            error: Some((ErrorCode::BudgetExhausted, why.clone())),
            deadline_at: now,
            traceparent: propagation::current_traceparent(),
        };
        let mut tx = self.store.begin_scheduling().await?;
        if tx.create_run(&run, now).await? {
            tx.insert_receipt(&Receipt {
                error_code: Some(ErrorCode::BudgetExhausted),
                error_message: Some(why),
                ..Receipt::bare(&id, RunState::Skipped, automation.placement, now)
            })
            .await?;
            if automation.state == AutomationState::Active {
                let mut paused = automation.clone();
                paused.exhaust_budget(spent, now);
                tx.notify(&[Notice::budget_reached(&paused, &id, spent, now)])
                    .await?;
            }
            tx.commit().await?;
            tracing::warn!(run_id = %id, automation_id = %automation.id, spent, "run-now skipped: the monthly budget is spent");
            crate::metrics::count(&[crate::metrics::Created {
                placement: automation.placement,
                trigger: RunTrigger::Manual,
                state: RunState::Skipped,
                code: Some(ErrorCode::BudgetExhausted),
                fired: None,
            }]);
        } else {
            tx.commit().await?;
        }
        self.write(owner, &automation.id, None, now, |current| {
            let mut next = current.clone();
            next.exhaust_budget(spent, now);
            Ok(next)
        })
        .await?;
        // This request's run, or the one a request with the same key made.
        match self.store.run_for_key(owner, &automation.id, key).await? {
            Some(run) => Ok(run),
            None => Ok(self.store.get_run(owner, &id).await?),
        }
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
    automesh_edge::scoped_calls! {
        create_automation(spb::CreateAutomationRequest) -> spb::CreateAutomationResponse
            => serve_create as answer;
        get_automation(spb::GetAutomationRequest) -> spb::GetAutomationResponse
            => serve_get[id];
        list_automations(spb::ListAutomationsRequest) -> spb::ListAutomationsResponse
            => serve_list[request];
        update_automation(spb::UpdateAutomationRequest) -> spb::UpdateAutomationResponse
            => serve_update[request] as answer;
        set_automation_state(spb::SetAutomationStateRequest) -> spb::SetAutomationStateResponse
            => serve_set_state as answer;
        run_automation_now(spb::RunAutomationNowRequest) -> spb::RunAutomationNowResponse
            => serve_run_now[request];
        create_webhook_endpoint(spb::CreateWebhookEndpointRequest)
            -> spb::CreateWebhookEndpointResponse => serve_create_endpoint[request];
        list_webhook_endpoints(spb::ListWebhookEndpointsRequest)
            -> spb::ListWebhookEndpointsResponse => serve_list_endpoints[request];
        delete_webhook_endpoint(spb::DeleteWebhookEndpointRequest)
            -> spb::DeleteWebhookEndpointResponse => serve_delete_endpoint[request];
        test_webhook_endpoint(spb::TestWebhookEndpointRequest)
            -> spb::TestWebhookEndpointResponse => serve_test_endpoint[request];
        list_webhook_messages(spb::ListWebhookMessagesRequest)
            -> spb::ListWebhookMessagesResponse => serve_list_messages[request];
    }
}

/// What a call answers, or why not.
type Reply<T> = Result<T, Error>;

/// An answer that carries the automation as a call left it.
trait Carries {
    fn carrying(automation: Option<pb::Automation>) -> Self;
}

macro_rules! carries {
    ($($answer:ty),+ $(,)?) => {$(
        impl Carries for $answer {
            fn carrying(automation: Option<pb::Automation>) -> Self {
                Self { automation }
            }
        }
    )+};
}

carries!(
    spb::CreateAutomationResponse,
    spb::UpdateAutomationResponse,
    spb::SetAutomationStateResponse,
);

/// The answer carrying `automation`.
fn answer<T: Carries>(automation: Automation) -> T {
    T::carrying(Some(convert::automation_to_pb(&automation)))
}

/// What each call does for its caller.
impl Scheduler {
    async fn serve_list(
        &self,
        owner: Principal,
        list: pb::ListAutomationsRequest,
    ) -> Reply<spb::ListAutomationsResponse> {
        let size = convert::page_size(list.page_size, 50, "page_size")?;
        let cursor = Cursor::decode(&list.page_token)?;
        let archived = list.show_archived;
        let page = self.store.list_automations(&owner, &cursor, size, archived);
        let page = page.await?;
        let last = self
            .store
            .last_runs_of_page(&owner, &cursor, size, archived);
        let mut last: std::collections::HashMap<String, (Run, Option<Receipt>)> = last
            .await?
            .into_iter()
            .map(|(run, receipt)| (run.automation_id.clone(), (run, receipt)))
            .collect();
        let automations = page
            .items
            .iter()
            .map(|automation| {
                let mut shown = convert::automation_to_pb(automation);
                shown.last_run = last
                    .remove(&automation.id)
                    .map(|(run, receipt)| convert::run_to_pb(&run, receipt.as_ref()));
                shown
            })
            .collect();
        // Within the page byte budget: a cut page goes on after its last
        // automation.
        let (automations, next_page_token) = page.cut(automations, automesh_proto::bounds::fitting);
        let response = pb::ListAutomationsResponse {
            automations,
            next_page_token,
        };
        Ok(spb::ListAutomationsResponse {
            response: Some(response),
        })
    }

    async fn serve_run_now(
        &self,
        owner: Principal,
        run_now: pb::RunAutomationNowRequest,
    ) -> Reply<spb::RunAutomationNowResponse> {
        convert::parse_run_now(&run_now)?;
        let key = &run_now.idempotency_key;
        let run = self.run_now(&owner, &run_now.id, key, Utc::now()).await?;
        let run = Some(convert::run_to_pb(&run, None));
        Ok(spb::RunAutomationNowResponse { run })
    }

    async fn serve_get(&self, owner: Principal, id: String) -> Reply<spb::GetAutomationResponse> {
        let automation = self.store.get_automation(&owner, &id).await?;
        let mut shown = self.with_last_run(&owner, &automation).await?;
        if automation.monthly_budget_micros.is_some() {
            shown.month_spend_micros = Some(self.month_spend(&automation, Utc::now()).await?);
        }
        Ok(spb::GetAutomationResponse {
            automation: Some(shown),
        })
    }

    /// `automation` as the API shows it, with its newest run (and that
    /// run's receipt once it ended).
    async fn with_last_run(
        &self,
        owner: &Principal,
        automation: &Automation,
    ) -> Reply<pb::Automation> {
        let mut shown = convert::automation_to_pb(automation);
        if let Some(run) = self.store.last_run(owner, &automation.id).await? {
            let receipt = if run.state.is_terminal() {
                self.store.internal().receipt(&run.id).await?
            } else {
                None
            };
            shown.last_run = Some(convert::run_to_pb(&run, receipt.as_ref()));
        }
        Ok(shown)
    }

    async fn serve_create(
        &self,
        owner: Principal,
        req: spb::CreateAutomationRequest,
    ) -> Reply<Automation> {
        let now = Utc::now();
        let input = convert::parse_create(req.automation.as_ref(), req.surface, now)?;
        let automation = self.create(&owner, input, now).await?;
        tracing::info!(automation_id = %automation.id, placement = %automation.placement, "automation created");
        Ok(automation)
    }

    async fn serve_update(
        &self,
        owner: Principal,
        edit: pb::UpdateAutomationRequest,
    ) -> Reply<Automation> {
        let update = convert::parse_update(&edit, Utc::now())?;
        let (id, placement) = (&update.id, update.claimed_placement);
        self.update(&owner, id, update.patch, placement, Utc::now())
            .await
    }

    async fn serve_set_state(
        &self,
        owner: Principal,
        req: spb::SetAutomationStateRequest,
    ) -> Reply<Automation> {
        let change = state_change(req.change)?;
        convert::require_id(&req.id, "id")?;
        let expected = convert::parse_optional_etag(&req.etag, "etag")?;
        let reason = convert::parse_pause_reason(&req.reason, "reason")?;
        let automation = self
            .set_state(&owner, &req.id, change, reason, expected, Utc::now())
            .await?;
        tracing::info!(automation_id = %automation.id, state = %automation.state, "automation state set");
        Ok(automation)
    }
}
