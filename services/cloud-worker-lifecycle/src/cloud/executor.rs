//! The executor contract for cloud runs: `StartRun` reserves the run's
//! identity and starts its drive; `ObserveRun` reports the run's phase as
//! it changes — `running` before the events of the thread, as soon as the
//! agent has the message — and streams the thread's events from its worker;
//! `CancelRun` and `GetRunStatus` read and write the dispatch row, from any
//! replica.

use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_proto::agent::v1 as apb;
use automesh_proto::executor::v1 as epb;
use automesh_proto::executor::v1::executor_service_server::ExecutorService;
use automesh_proto::v1 as pb;
use automesh_rpc::{executor, status};
use automesh_store::cloud::{CloudPhase, Reservation};
use chrono::Utc;
use prost::Message as _;
use tonic::{Request, Response, Status};

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
    /// Forwards the thread's events after `after` until its stream ends,
    /// falls silent, or the observer leaves (`false`).
    async fn pump_events(
        &self,
        run_id: &str,
        worker_id: &str,
        thread_id: &str,
        after: &mut i64,
        observer: &executor::Observer,
    ) -> bool {
        let Ok(Some(ready)) = self.store.worker_endpoint(worker_id).await else {
            return true;
        };
        let Ok(mut agent) = self.agent(&ready.endpoint, worker_id) else {
            return true;
        };
        let opened = tokio::time::timeout(
            EVENT_SILENCE,
            agent.observe_thread(apb::ObserveThreadRequest {
                thread_id: thread_id.to_owned(),
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
                e.run_id = run_id.to_owned();
                if !observer.event(e).await {
                    return false;
                }
            }
        }
        true
    }
}

#[tonic::async_trait]
impl ExecutorService for Cloud {
    async fn start_run(
        &self,
        request: Request<epb::StartRunRequest>,
    ) -> Result<Response<epb::StartRunResponse>, Status> {
        let spec = executor::run_spec(request.into_inner())?;
        if let Some(existing) = self
            .store
            .cloud_run(&spec.run_id)
            .await
            .map_err(store_err)?
        {
            if existing.phase != CloudPhase::Finished {
                self.drive(&spec.run_id);
            }
            return Ok(Response::new(epb::StartRunResponse {
                submitted: false,
                status: Some(status_of(Some(&existing))),
            }));
        }
        let owner =
            automesh_domain::Principal::new(spec.organization_id.clone(), spec.owner_id.clone());
        let Some(worker) = self.store.get_worker(&owner).await.map_err(store_err)? else {
            // A durable failure of the user's setup: needs attention.
            return Ok(Response::new(epb::StartRunResponse {
                submitted: false,
                status: Some(epb::ExecutionStatus {
                    phase: epb::ExecutionPhase::Finished as i32,
                    idle: true,
                    outcome: Some(epb::Outcome {
                        state: pb::RunState::Failed as i32,
                        error_code: ErrorCode::RuntimeMissing.as_str().into(),
                        error_message: "the owner has no cloud worker".into(),
                        ..Default::default()
                    }),
                    unaccepted: false,
                }),
            }));
        };
        let thread_id = format!("thr-{}", spec.run_id);
        let workspace_id = format!("ws-{}", worker.id);
        let reserved = self
            .store
            .reserve_cloud_run(
                &Reservation {
                    run_id: &spec.run_id,
                    org_id: &spec.organization_id,
                    owner_id: &spec.owner_id,
                    worker_id: &worker.id,
                    workspace_id: &workspace_id,
                    thread_id: &thread_id,
                    message_id: &spec.message_id,
                    spec: &spec.encode_to_vec(),
                },
                Utc::now(),
            )
            .await
            .map_err(store_err)?;
        if reserved {
            tracing::info!(run_id = %spec.run_id, worker_id = %worker.id, "cloud run reserved");
        }
        self.drive(&spec.run_id);
        let d = self
            .store
            .cloud_run(&spec.run_id)
            .await
            .map_err(store_err)?;
        Ok(Response::new(epb::StartRunResponse {
            submitted: reserved,
            status: Some(status_of(d.as_ref())),
        }))
    }

    type ObserveRunStream = executor::ObserveStream;

    async fn observe_run(
        &self,
        request: Request<epb::ObserveRunRequest>,
    ) -> Result<Response<Self::ObserveRunStream>, Status> {
        let req = request.into_inner();
        let Some(first) = self.store.cloud_run(&req.run_id).await.map_err(store_err)? else {
            return Err(Status::not_found("no cloud dispatch for this run"));
        };
        if first.phase != CloudPhase::Finished {
            // A coordinator that reattaches also revives a drive whose
            // replica died.
            self.drive(&req.run_id);
        }
        let cloud = self.clone();
        let (mut observer, stream) = executor::observe();
        tokio::spawn(async move {
            let mut after = req.after_sequence;
            loop {
                let Ok(Some(d)) = cloud.store.cloud_run(&req.run_id).await else {
                    return;
                };
                let finished = d.phase == CloudPhase::Finished;
                if !finished {
                    // Revives a drive that stopped (a store error, a dead
                    // replica); a live one elsewhere keeps its lease.
                    cloud.drive(&req.run_id);
                    // A phase change goes out before the events after it:
                    // `running` precedes the thread's first event.
                    if !observer.status(status_of(Some(&d))).await {
                        return;
                    }
                }
                if matches!(d.phase, CloudPhase::Running | CloudPhase::Finished)
                    && !cloud
                        .pump_events(
                            &req.run_id,
                            &d.worker_id,
                            &d.thread_id,
                            &mut after,
                            &observer,
                        )
                        .await
                {
                    return;
                }
                if finished {
                    // The end goes out after every event before it.
                    observer.status(status_of(Some(&d))).await;
                    return;
                }
                if !observer.wait(std::future::pending(), WATCH).await {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn cancel_run(
        &self,
        request: Request<epb::CancelRunRequest>,
    ) -> Result<Response<epb::CancelRunResponse>, Status> {
        let req = request.into_inner();
        self.store
            .cancel_cloud_run(&req.run_id, Utc::now())
            .await
            .map_err(store_err)?;
        let d = self.store.cloud_run(&req.run_id).await.map_err(store_err)?;
        if let Some(d) = &d
            && d.phase != CloudPhase::Finished
        {
            self.drive(&req.run_id);
        }
        Ok(Response::new(epb::CancelRunResponse {
            status: Some(status_of(d.as_ref())),
        }))
    }

    async fn get_run_status(
        &self,
        request: Request<epb::GetRunStatusRequest>,
    ) -> Result<Response<epb::GetRunStatusResponse>, Status> {
        let d = self
            .store
            .cloud_run(&request.into_inner().run_id)
            .await
            .map_err(store_err)?;
        Ok(Response::new(epb::GetRunStatusResponse {
            status: Some(status_of(d.as_ref())),
        }))
    }
}
