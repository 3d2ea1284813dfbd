//! `automesh.v1.Runs`: served by the run-coordinator for the caller.

use std::pin::Pin;

use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::v1 as pb;
use automesh_proto::v1::runs_server::Runs;
use automesh_rpc::{convert, status};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::Gateway;

fn invalid(v: automesh_domain::Violations) -> Status {
    status::invalid_argument(&v)
}

#[tonic::async_trait]
impl Runs for Gateway {
    async fn get_run(
        &self,
        request: Request<pb::GetRunRequest>,
    ) -> Result<Response<pb::GetRunResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::require_id(&req.id, "id").map_err(invalid)?;
        let mut coordinator = self.upstreams.coordinator.clone();
        let resp = coordinator
            .get_run(cpb::GetRunRequest {
                caller: Some(convert::caller(&owner)),
                id: req.id,
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(pb::GetRunResponse {
            run: resp.into_inner().run,
        }))
    }

    async fn list_runs(
        &self,
        request: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::page_size(req.page_size, 50, "page_size").map_err(invalid)?;
        convert::check_optional_text(&[
            ("automation_id", &req.automation_id),
            ("page_token", &req.page_token),
        ])
        .map_err(invalid)?;
        let mut coordinator = self.upstreams.coordinator.clone();
        let resp = coordinator
            .list_runs(cpb::ListRunsRequest {
                caller: Some(convert::caller(&owner)),
                request: Some(req),
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(
            resp.into_inner().response.unwrap_or_default(),
        ))
    }

    async fn cancel_run(
        &self,
        request: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::CancelRunResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::require_id(&req.id, "id").map_err(invalid)?;
        let mut coordinator = self.upstreams.coordinator.clone();
        let resp = coordinator
            .cancel_run(cpb::CancelRunRequest {
                caller: Some(convert::caller(&owner)),
                id: req.id,
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(pb::CancelRunResponse {
            run: resp.into_inner().run,
        }))
    }

    async fn list_run_events(
        &self,
        request: Request<pb::ListRunEventsRequest>,
    ) -> Result<Response<pb::ListRunEventsResponse>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::require_id(&req.run_id, "run_id").map_err(invalid)?;
        let mut coordinator = self.upstreams.coordinator.clone();
        let resp = coordinator
            .list_run_events(cpb::ListRunEventsRequest {
                caller: Some(convert::caller(&owner)),
                request: Some(req),
            })
            .await
            .map_err(status::forward)?;
        Ok(Response::new(
            resp.into_inner().response.unwrap_or_default(),
        ))
    }

    type WatchRunStream = Pin<Box<dyn Stream<Item = Result<pb::WatchRunResponse, Status>> + Send>>;

    async fn watch_run(
        &self,
        request: Request<pb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let owner = self.principal(&request)?;
        let req = request.into_inner();
        convert::require_id(&req.run_id, "run_id").map_err(invalid)?;
        let mut coordinator = self.upstreams.coordinator.clone();
        let upstream = coordinator
            .watch_run(cpb::WatchRunRequest {
                caller: Some(convert::caller(&owner)),
                request: Some(req),
            })
            .await
            .map_err(status::forward)?
            .into_inner();
        let stream = upstream.map(|item| {
            item.map(|m| m.update.unwrap_or_default())
                .map_err(status::forward)
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
