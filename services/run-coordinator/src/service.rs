//! The coordinator's operations on runs, and the thin gRPC handlers in front
//! of them.

use automesh_domain::{Principal, Receipt, Run, RunState};
use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::coordinator::v1::run_coordinator_service_server::RunCoordinatorService;
use automesh_proto::v1 as pb;
use automesh_rpc::convert;
use automesh_store::page::Cursor;
use automesh_store::{Store, StoreError};
use chrono::{DateTime, Utc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::watch;

/// The coordinator's state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Coordinator {
    store: Store,
    shutdown: CancellationToken,
}

impl Coordinator {
    pub fn new(store: Store, shutdown: CancellationToken) -> Self {
        Self { store, shutdown }
    }

    /// A run of `owner` in its protobuf form, with its receipt once terminal.
    pub async fn run_pb(&self, owner: &Principal, id: &str) -> Result<pb::Run, Error> {
        let run = self.store.get_run(owner, id).await?;
        self.to_pb(&run).await
    }

    async fn to_pb(&self, run: &Run) -> Result<pb::Run, Error> {
        let receipt = if run.state.is_terminal() {
            self.store.get_receipt(&run.id).await?
        } else {
            None
        };
        Ok(convert::run_to_pb(run, receipt.as_ref()))
    }

    /// Cancels a run. A run no executor holds yet ends `cancelled` at once; a
    /// terminal run is returned unchanged.
    pub async fn cancel(
        &self,
        owner: &Principal,
        id: &str,
        now: DateTime<Utc>,
    ) -> Result<Run, Error> {
        let run = self.store.get_run(owner, id).await?;
        if run.state.is_terminal() {
            return Ok(run);
        }
        if run.state != RunState::Pending {
            return Err(Error::Executing(run.id));
        }
        let receipt = Receipt {
            run_id: run.id.clone(),
            outcome: RunState::Cancelled,
            error_code: None,
            error_message: Some("cancelled before it was dispatched".into()),
            placement: run.placement,
            engine: None,
            queued_micros: (now - run.created_at)
                .num_microseconds()
                .unwrap_or(0)
                .max(0),
            wake_micros: 0,
            admission_micros: 0,
            execution_micros: 0,
            usage: Default::default(),
            worker_id: None,
            workspace_id: None,
            thread_id: None,
            message_id: None,
            created_at: now,
        };
        match self.store.finish_run(&receipt, now).await {
            Ok(run) => {
                tracing::info!(run_id = %run.id, "run cancelled before dispatch");
                Ok(run)
            }
            // Someone moved it first: report what it is now.
            Err(StoreError::IllegalTransition { .. }) => {
                let run = self.store.get_run(owner, id).await?;
                if run.state.is_terminal() {
                    Ok(run)
                } else {
                    Err(Error::Executing(run.id))
                }
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[tonic::async_trait]
impl RunCoordinatorService for Coordinator {
    async fn get_run(
        &self,
        request: Request<cpb::GetRunRequest>,
    ) -> Result<Response<cpb::GetRunResponse>, Status> {
        let req = request.into_inner();
        let owner = convert::principal(req.caller.as_ref())?;
        convert::require_id(&req.id, "id").map_err(Error::from)?;
        Ok(Response::new(cpb::GetRunResponse {
            run: Some(self.run_pb(&owner, &req.id).await?),
        }))
    }

    async fn list_runs(
        &self,
        request: Request<cpb::ListRunsRequest>,
    ) -> Result<Response<cpb::ListRunsResponse>, Status> {
        let req = request.into_inner();
        let owner = convert::principal(req.caller.as_ref())?;
        let list = req.request.unwrap_or_default();
        let size = convert::page_size(list.page_size, 50, "page_size").map_err(Error::from)?;
        let cursor = Cursor::decode(&list.page_token).map_err(Error::from)?;
        let filter = (!list.automation_id.is_empty()).then_some(list.automation_id.as_str());
        let page = self
            .store
            .list_runs(&owner, filter, &cursor, size)
            .await
            .map_err(Error::from)?;
        let mut runs = Vec::with_capacity(page.items.len());
        for run in &page.items {
            runs.push(self.to_pb(run).await?);
        }
        Ok(Response::new(cpb::ListRunsResponse {
            response: Some(pb::ListRunsResponse {
                runs,
                next_page_token: page.next.map(|c| c.encode()).unwrap_or_default(),
            }),
        }))
    }

    async fn cancel_run(
        &self,
        request: Request<cpb::CancelRunRequest>,
    ) -> Result<Response<cpb::CancelRunResponse>, Status> {
        let req = request.into_inner();
        let owner = convert::principal(req.caller.as_ref())?;
        convert::require_id(&req.id, "id").map_err(Error::from)?;
        let run = self.cancel(&owner, &req.id, Utc::now()).await?;
        Ok(Response::new(cpb::CancelRunResponse {
            run: Some(self.to_pb(&run).await?),
        }))
    }

    async fn list_run_events(
        &self,
        request: Request<cpb::ListRunEventsRequest>,
    ) -> Result<Response<cpb::ListRunEventsResponse>, Status> {
        let req = request.into_inner();
        let owner = convert::principal(req.caller.as_ref())?;
        let list = req.request.unwrap_or_default();
        convert::require_id(&list.run_id, "run_id").map_err(Error::from)?;
        let size = convert::page_size(list.page_size, 100, "page_size").map_err(Error::from)?;
        if list.after_sequence < 0 {
            return Err(automesh_rpc::status::invalid_field(
                "after_sequence",
                "must not be negative",
            ));
        }
        // Scope first: another tenant's run is not found.
        self.store
            .get_run(&owner, &list.run_id)
            .await
            .map_err(Error::from)?;
        let events = self
            .store
            .list_events(&list.run_id, list.after_sequence, size)
            .await
            .map_err(Error::from)?;
        let last_sequence = events.last().map_or(list.after_sequence, |e| e.sequence);
        Ok(Response::new(cpb::ListRunEventsResponse {
            response: Some(pb::ListRunEventsResponse {
                events: events.iter().map(convert::event_to_pb).collect(),
                last_sequence,
            }),
        }))
    }

    type WatchRunStream = ReceiverStream<Result<cpb::WatchRunResponse, Status>>;

    async fn watch_run(
        &self,
        request: Request<cpb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let req = request.into_inner();
        let owner = convert::principal(req.caller.as_ref())?;
        let watch_req = req.request.unwrap_or_default();
        convert::require_id(&watch_req.run_id, "run_id").map_err(Error::from)?;
        if watch_req.after_sequence < 0 {
            return Err(automesh_rpc::status::invalid_field(
                "after_sequence",
                "must not be negative",
            ));
        }
        let run = self
            .store
            .get_run(&owner, &watch_req.run_id)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(watch::spawn(
            self.clone(),
            run,
            watch_req.after_sequence,
            self.shutdown.clone(),
        )))
    }
}

impl Coordinator {
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    pub(crate) async fn pb_of(&self, run: &Run) -> Result<pb::Run, Error> {
        self.to_pb(run).await
    }
}
