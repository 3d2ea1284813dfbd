//! Driving one cloud run: wake its worker, probe and repair the MCP
//! registration, submit the message, watch it — and, when the worker's agent
//! is lost on the way, do it again on a fresh agent (bounded). Submission is
//! observe-or-submit by message id against the agent's journal, so doing it
//! again never runs a message twice: a message the lost agent had accepted
//! is reported by the fresh one as finished or `runtime_interrupted`.

use automesh_domain::ErrorCode;
use automesh_proto::agent::v1 as apb;
use automesh_proto::executor::v1 as epb;
use automesh_proto::v1 as pb;
use automesh_store::StoreError;
use automesh_store::cloud::{CloudDispatch, CloudPhase, ReadyWorker};
use chrono::Utc;
use prost::Message as _;
use tracing::Instrument;

use super::Cloud;

/// How many agents a run may lose before its worker counts as failing.
const AGENT_LOSSES: usize = 3;

/// How one admission attempt ended.
pub(super) enum Step {
    /// The run's outcome is recorded.
    Done,
    /// The worker's agent was lost; the run goes on with a fresh one.
    Lost(String),
}

fn guidance() -> String {
    "You run headless in the user's cloud worker, started by a schedule: nobody is watching and \
     nobody can answer questions. The user's connected services are available through the \
     openwork-cloud tools (search_capabilities, execute_capability)."
        .into()
}

/// Whether an error from the agent may mean the agent itself is gone
/// (rather than an answer of the agent's).
fn maybe_gone(s: &tonic::Status) -> bool {
    use tonic::Code;
    const GONE: [Code; 5] = [
        Code::Unavailable,
        Code::DeadlineExceeded,
        Code::Cancelled,
        Code::Unknown,
        Code::Unauthenticated,
    ];
    GONE.contains(&s.code())
}

impl Cloud {
    /// Drives the run while this replica holds its drive.
    pub(super) async fn drive_run(&self, run_id: &str) -> Result<(), StoreError> {
        let Some(held) = self.hold(run_id).await? else {
            return Ok(());
        };
        tokio::select! {
            r = self.admit(run_id) => r,
            () = held.lost.cancelled() => {
                tracing::warn!(run_id, "lost the cloud run's drive; another replica has it");
                Ok(())
            }
        }
    }

    async fn admit(&self, run_id: &str) -> Result<(), StoreError> {
        let Some(d) = self.store.cloud_run(run_id).await? else {
            return Ok(());
        };
        let Ok(spec) = epb::RunSpec::decode(d.spec.as_slice()) else {
            return self
                .fail(&d, ErrorCode::Internal, "undecodable run spec".into())
                .await;
        };
        // The drive belongs to the run's trace, whichever replica drives it.
        let span = tracing::info_span!(
            parent: None,
            "automesh.cloud.drive",
            run_id,
            worker_id = %d.worker_id,
            replica = %self.replica,
        );
        automesh_telemetry::propagation::continue_trace(&span, Some(spec.traceparent.as_str()));
        self.admit_attempts(run_id, &spec).instrument(span).await
    }

    async fn admit_attempts(&self, run_id: &str, spec: &epb::RunSpec) -> Result<(), StoreError> {
        let mut losses = 0;
        loop {
            let Some(d) = self.store.cloud_run(run_id).await? else {
                return Ok(());
            };
            if d.phase == CloudPhase::Finished {
                return Ok(());
            }
            match self.attempt(&d, spec, losses).await? {
                Step::Done => return Ok(()),
                Step::Lost(why) => {
                    losses += 1;
                    tracing::warn!(run_id, losses, %why, "the worker's agent was lost under the run");
                    if losses >= AGENT_LOSSES {
                        let d = self.store.cloud_run(run_id).await?.unwrap_or(d);
                        return self
                            .fail(
                                &d,
                                ErrorCode::RuntimeFailed,
                                format!("the worker's agent was lost {losses} times: {why}"),
                            )
                            .await;
                    }
                }
            }
        }
    }

    /// One attempt: wake, admit, submit, watch.
    async fn attempt(
        &self,
        d: &CloudDispatch,
        spec: &epb::RunSpec,
        losses: usize,
    ) -> Result<Step, StoreError> {
        let submitted = d.phase == CloudPhase::Running;
        if d.cancel_requested && (!submitted || losses > 0) {
            // Nothing runs: never submitted, or its agent is gone.
            let why = if submitted {
                "cancelled; the worker's agent had stopped"
            } else {
                "cancelled before submission"
            };
            self.finish(d, pb::RunState::Cancelled, None, why.into(), None)
                .await?;
            return Ok(Step::Done);
        }
        let deadline = spec
            .deadline_time
            .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32))
            .unwrap_or_else(|| Utc::now() + chrono::Duration::minutes(30));
        let cap = Utc::now()
            + chrono::Duration::from_std(self.settings.readiness_cap).unwrap_or_default();
        let woke = Utc::now();
        let ready = match self
            .wake(&d.worker_id, cap.min(deadline))
            .instrument(tracing::info_span!("automesh.cloud.wake", worker_id = %d.worker_id))
            .await
        {
            Ok(r) => r,
            Err(e) if submitted => {
                // The agent that had the message is gone and no fresh one
                // can say what became of it.
                self.fail(
                    d,
                    ErrorCode::RuntimeInterrupted,
                    format!(
                        "the worker's agent stopped while the run executed, and no fresh agent \
                         answered: {}",
                        e.message
                    ),
                )
                .await?;
                return Ok(Step::Done);
            }
            Err(e) => {
                self.fail(d, e.code, e.message).await?;
                return Ok(Step::Done);
            }
        };
        let wake_micros = d.wake_micros + (Utc::now() - woke).num_microseconds().unwrap_or(0);
        if submitted {
            // Submitted to an agent before: the one answering now (by its
            // journal) says what became of it.
            return self
                .watch(&d.run_id, &ready)
                .instrument(tracing::info_span!("automesh.cloud.watch", thread_id = %d.thread_id))
                .await;
        }
        self.store
            .set_cloud_phase(&d.run_id, CloudPhase::Admitted, wake_micros, 0, Utc::now())
            .await?;
        let admitted = Utc::now();
        let Some(connect) = self.settings.connect.clone() else {
            let d = self
                .store
                .cloud_run(&d.run_id)
                .await?
                .unwrap_or_else(|| d.clone());
            self.fail(
                &d,
                ErrorCode::McpConfigMissing,
                format!(
                    "no Connect configuration for model {}: the run would lack the user's tools",
                    spec.model
                ),
            )
            .await?;
            return Ok(Step::Done);
        };
        let Ok(mut agent) = self.agent(&ready.endpoint, &d.worker_id) else {
            self.fail(d, ErrorCode::RuntimeFailed, "bad worker endpoint".into())
                .await?;
            return Ok(Step::Done);
        };
        // Probe the persisted registration; repair it when it drifted.
        let mcp_span = tracing::info_span!(
            "automesh.cloud.mcp_registration",
            model = %spec.model,
            repaired = tracing::field::Empty,
        );
        let current = agent
            .get_mcp_registration(apb::GetMcpRegistrationRequest {
                model: spec.model.clone(),
            })
            .instrument(mcp_span.clone())
            .await;
        let drifted = match &current {
            Ok(r) => r
                .get_ref()
                .registration
                .as_ref()
                .is_none_or(|r| r.url != connect.url || r.name != "openwork-cloud"),
            Err(s) if s.code() == tonic::Code::NotFound => true,
            Err(s) => {
                return self
                    .refused(d, &ready, s, "the worker did not answer")
                    .await;
            }
        };
        mcp_span.record("repaired", drifted);
        if drifted {
            tracing::warn!(parent: &mcp_span, run_id = %d.run_id, worker_id = %d.worker_id, model = %spec.model, "MCP registration missing or drifted; repairing");
            let repaired = agent
                .put_mcp_registration(apb::PutMcpRegistrationRequest {
                    registration: Some(apb::McpRegistration {
                        name: "openwork-cloud".into(),
                        url: connect.url.clone(),
                        model: spec.model.clone(),
                    }),
                })
                .instrument(mcp_span.clone())
                .await;
            if let Err(s) = repaired {
                if maybe_gone(&s) && !self.alive(&ready).await {
                    self.agent_lost(&ready, "it did not answer the registration repair")
                        .await;
                    return Ok(Step::Lost("the registration repair went unanswered".into()));
                }
                self.fail(
                    d,
                    ErrorCode::McpConfigMissing,
                    format!(
                        "the MCP registration could not be repaired: {}",
                        s.message()
                    ),
                )
                .await?;
                return Ok(Step::Done);
            }
        }
        if self
            .store
            .cloud_run(&d.run_id)
            .await?
            .is_some_and(|d| d.cancel_requested)
        {
            self.finish(
                d,
                pb::RunState::Cancelled,
                None,
                "cancelled before submission".into(),
                None,
            )
            .await?;
            return Ok(Step::Done);
        }
        let submitted = agent
            .submit_message(apb::SubmitMessageRequest {
                workspace_id: d.workspace_id.clone(),
                thread_id: d.thread_id.clone(),
                message_id: d.message_id.clone(),
                prompt: spec.prompt.clone(),
                model: spec.model.clone(),
                deadline_time: spec.deadline_time,
                traceparent: spec.traceparent.clone(),
                connect_token: connect.token.expose().to_owned(),
                guidance: guidance(),
                provider_model: spec.provider_model.clone(),
                budget: spec.budget,
            })
            .instrument(tracing::info_span!("automesh.cloud.submit", message_id = %d.message_id))
            .await;
        if let Err(s) = submitted {
            // Whether it reached the agent or not, the next attempt's
            // observe-or-submit finds out from the agent's journal.
            return self
                .refused(d, &ready, &s, "the worker refused the message")
                .await;
        }
        let admission_micros = (Utc::now() - admitted).num_microseconds().unwrap_or(0);
        // Running from the moment the agent has the message.
        self.store
            .set_cloud_phase(
                &d.run_id,
                CloudPhase::Running,
                wake_micros,
                admission_micros,
                Utc::now(),
            )
            .await?;
        tracing::info!(run_id = %d.run_id, worker_id = %d.worker_id, "message submitted to the worker");
        self.watch(&d.run_id, &ready)
            .instrument(tracing::info_span!("automesh.cloud.watch", thread_id = %d.thread_id))
            .await
    }

    /// The agent answered a call with an error: a lost agent is woken
    /// afresh, an answer of the agent's fails the run.
    async fn refused(
        &self,
        d: &CloudDispatch,
        ready: &ReadyWorker,
        s: &tonic::Status,
        what: &str,
    ) -> Result<Step, StoreError> {
        if maybe_gone(s) && !self.alive(ready).await {
            self.agent_lost(ready, what).await;
            return Ok(Step::Lost(format!("{what} (it is gone)")));
        }
        self.fail(
            d,
            ErrorCode::RuntimeFailed,
            format!("{what}: {}", s.message()),
        )
        .await?;
        Ok(Step::Done)
    }
}
