//! `automesh.v1.Runs`: served by the run-coordinator for the caller.

use std::pin::Pin;

use automesh_proto::coordinator::v1 as cpb;
use automesh_proto::v1 as pb;
use automesh_proto::v1::runs_server::Runs;
use automesh_rpc::{convert, status};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::{Gateway, forwarded};

// Each call: accepted (authenticated, checked), scoped to its caller,
// forwarded to the coordinator, its answer passed on.
#[tonic::async_trait]
impl Runs for Gateway {
    async fn get_run(
        &self,
        request: Request<pb::GetRunRequest>,
    ) -> Result<Response<pb::GetRunResponse>, Status> {
        let call = self.accept(request, |r| convert::require_id(&r.id, "id"))?;
        let upstream = cpb::GetRunRequest {
            caller: call.caller(),
            id: call.req.id,
        };
        let answer = self.upstreams.coordinator().get_run(upstream).await;
        let run = forwarded(answer)?.run;
        Ok(Response::new(pb::GetRunResponse { run }))
    }

    async fn list_runs(
        &self,
        request: Request<pb::ListRunsRequest>,
    ) -> Result<Response<pb::ListRunsResponse>, Status> {
        let call = self.accept(request, |r| {
            convert::page_size(r.page_size, 50, "page_size")?;
            convert::check_optional_text(&[
                ("automation_id", &r.automation_id),
                ("page_token", &r.page_token),
            ])
        })?;
        let upstream = cpb::ListRunsRequest {
            caller: call.caller(),
            request: Some(call.req),
        };
        let answer = self.upstreams.coordinator().list_runs(upstream).await;
        Ok(Response::new(
            forwarded(answer)?.response.unwrap_or_default(),
        ))
    }

    async fn cancel_run(
        &self,
        request: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::CancelRunResponse>, Status> {
        let call = self.accept(request, |r| convert::require_id(&r.id, "id"))?;
        let upstream = cpb::CancelRunRequest {
            caller: call.caller(),
            id: call.req.id,
        };
        let answer = self.upstreams.coordinator().cancel_run(upstream).await;
        let run = forwarded(answer)?.run;
        Ok(Response::new(pb::CancelRunResponse { run }))
    }

    async fn list_run_events(
        &self,
        request: Request<pb::ListRunEventsRequest>,
    ) -> Result<Response<pb::ListRunEventsResponse>, Status> {
        let call = self.accept(request, |r| convert::require_id(&r.run_id, "run_id"))?;
        let upstream = cpb::ListRunEventsRequest {
            caller: call.caller(),
            request: Some(call.req),
        };
        let answer = self.upstreams.coordinator().list_run_events(upstream).await;
        Ok(Response::new(
            forwarded(answer)?.response.unwrap_or_default(),
        ))
    }

    type WatchRunStream = Pin<Box<dyn Stream<Item = Result<pb::WatchRunResponse, Status>> + Send>>;

    async fn watch_run(
        &self,
        request: Request<pb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let call = self.accept(request, |r| convert::require_id(&r.run_id, "run_id"))?;
        let upstream = cpb::WatchRunRequest {
            caller: call.caller(),
            request: Some(call.req),
        };
        let answer = self.upstreams.coordinator().watch_run(upstream).await;
        // Each update passes through; an upstream error ends the stream as
        // it came.
        let stream = forwarded(answer)?.map(|item| {
            item.map(|m| m.update.unwrap_or_default())
                .map_err(status::forward)
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
