//! The executor contract for cloud runs: `StartRun` reserves the run's
//! identity and starts its drive; `ObserveRun` reports the run's phase as
//! it changes — `running` before the events of the thread, as soon as the
//! agent has the message — and streams the thread's events from its worker;
//! `CancelRun` and `GetRunStatus` read and write the dispatch row, from any
//! replica.

use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_edge::status;
use automesh_executor::{self as executor, Executor};
use automesh_proto::agent::v1 as apb;
use automesh_proto::executor::v1 as epb;
use automesh_proto::v1 as pb;
use automesh_store::cloud::{CloudDispatch, CloudPhase, Reservation};
use chrono::Utc;
use prost::Message as _;
use tonic::Status;
use tracing::Instrument;

use super::{Cloud, WATCH, status_of};

/// How long a thread's event stream may stay silent before it is opened
/// again (a stalled agent never holds an observer).
const EVENT_SILENCE: Duration = Duration::from_secs(5);

/// A corrupt dispatch row is INTERNAL, not worth a retry; only a lost
/// database is UNAVAILABLE.
fn store_err(e: automesh_store::StoreError) -> Status {
    status::of(&e, "cloud dispatch")
}

impl Cloud {
    /// A cloud run's dispatch row, if it has one.
    async fn dispatch(&self, run_id: &str) -> Result<Option<CloudDispatch>, Status> {
        self.store.cloud_run(run_id).await.map_err(store_err)
    }

    /// Forwards the thread's events after `after` until its stream ends,
    /// falls silent, or the observer leaves (`false`).
    async fn pump_events(
        &self,
        d: &CloudDispatch,
        after: &mut i64,
        observer: &executor::Observer,
    ) -> bool {
        let Ok(Some(ready)) = self.store.worker_endpoint(&d.worker_id).await else {
            return true;
        };
        let Ok(mut agent) = self.agent(&ready.endpoint, &d.worker_id) else {
            return true;
        };
        let opened = tokio::time::timeout(
            EVENT_SILENCE,
            agent.observe_thread(apb::ObserveThreadRequest {
                thread_id: d.thread_id.clone(),
                after_sequence: *after,
            }),
        )
        .await;
        let Ok(Ok(stream)) = opened else {
            return true;
        };
        let mut stream = stream.into_inner();
        while let Ok(Ok(Some(m))) = tokio::time::timeout(EVENT_SILENCE, stream.message()).await {
            if let Some(apb::observe_thread_response::Update::Event(mut e)) = m.update {
                *after = (*after).max(e.sequence);
                e.run_id = d.run_id.clone();
                if !observer.event(e).await {
                    return false;
                }
            }
        }
        true
    }
}

#[tonic::async_trait]
impl Executor for Cloud {
    async fn start(&self, spec: epb::RunSpec) -> Result<(bool, epb::ExecutionStatus), Status> {
        if let Some(existing) = self.dispatch(&spec.run_id).await? {
            if existing.phase != CloudPhase::Finished {
                self.drive(&spec.run_id);
            }
            return Ok((false, status_of(Some(&existing))));
        }
        let owner =
            automesh_domain::Principal::new(spec.organization_id.clone(), spec.owner_id.clone());
        let Some(worker) = self.store.get_worker(&owner).await.map_err(store_err)? else {
            // A durable failure of the user's setup: needs attention.
            let outcome = epb::Outcome {
                state: pb::RunState::Failed as i32,
                error_code: ErrorCode::RuntimeMissing.as_str().into(),
                error_message: "the owner has no cloud worker".into(),
                ..Default::default()
            };
            return Ok((false, executor::finished(outcome)));
        };
        let thread_id = format!("thr-{}", spec.run_id);
        let workspace_id = format!("ws-{}", worker.id);
        let reservation = Reservation {
            run_id: &spec.run_id,
            org_id: &spec.organization_id,
            owner_id: &spec.owner_id,
            worker_id: &worker.id,
            workspace_id: &workspace_id,
            thread_id: &thread_id,
            message_id: &spec.message_id,
            spec: &spec.encode_to_vec(),
        };
        let reserved = self.store.reserve_cloud_run(&reservation, Utc::now());
        let reserved = reserved.await.map_err(store_err)?;
        if reserved {
            tracing::info!(run_id = %spec.run_id, worker_id = %worker.id, "cloud run reserved");
        }
        self.drive(&spec.run_id);
        let d = self.dispatch(&spec.run_id).await?;
        Ok((reserved, status_of(d.as_ref())))
    }

    async fn observe(&self, run_id: String, after: i64) -> Result<executor::ObserveStream, Status> {
        let Some(first) = self.dispatch(&run_id).await? else {
            return Err(Status::not_found("no cloud dispatch for this run"));
        };
        if first.phase != CloudPhase::Finished {
            // A coordinator that reattaches also revives a drive whose
            // replica died.
            self.drive(&run_id);
        }
        let cloud = self.clone();
        let (mut observer, stream) = executor::observe();
        // The observer's reads of the thread (`ObserveThread`) belong to the
        // run's trace, as the `ObserveRun` request that asked for them does.
        let span = tracing::info_span!("automesh.cloud.observe", run_id = %run_id, after);
        tokio::spawn(
            async move {
                let mut after = after;
                loop {
                    if cloud.stopped.is_cancelled() {
                        // The caller observes again, on another replica,
                        // from the last sequence it read.
                        let why =
                            status::shutting_down("observe the run again from the last sequence");
                        observer.fail(why).await;
                        return;
                    }
                    let Ok(Some(d)) = cloud.store.cloud_run(&run_id).await else {
                        return;
                    };
                    let finished = d.phase == CloudPhase::Finished;
                    if !finished {
                        // Revives a drive that stopped (a store error, a dead
                        // replica); a live one elsewhere keeps its lease.
                        cloud.drive(&run_id);
                        // A phase change goes out before the events after it:
                        // `running` precedes the thread's first event.
                        if !observer.status(status_of(Some(&d))).await {
                            return;
                        }
                    }
                    if matches!(d.phase, CloudPhase::Running | CloudPhase::Finished)
                        && !cloud.pump_events(&d, &mut after, &observer).await
                    {
                        return;
                    }
                    if finished {
                        // The end goes out after every event before it.
                        observer.status(status_of(Some(&d))).await;
                        return;
                    }
                    if !observer.wait(cloud.stopped.cancelled(), WATCH).await {
                        return;
                    }
                }
            }
            .instrument(span),
        );
        Ok(stream)
    }

    async fn cancel(&self, run_id: &str, _reason: &str) -> Result<epb::ExecutionStatus, Status> {
        let cancelled = self.store.cancel_cloud_run(run_id, Utc::now());
        cancelled.await.map_err(store_err)?;
        let d = self.dispatch(run_id).await?;
        if let Some(d) = &d
            && d.phase != CloudPhase::Finished
        {
            self.drive(run_id);
        }
        Ok(status_of(d.as_ref()))
    }

    async fn status(&self, run_id: &str) -> Result<epb::ExecutionStatus, Status> {
        Ok(status_of(self.dispatch(run_id).await?.as_ref()))
    }
}
