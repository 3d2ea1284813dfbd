//! Watching a submitted thread until it is idle: its worker kept out of
//! idle stop, a cancellation forwarded, and the outcome recorded. A thread
//! whose agent is gone hands the run back to admission (a fresh agent, whose
//! journal says what became of the message).

use automesh_domain::ErrorCode;
use automesh_proto::agent::v1 as apb;
use automesh_proto::v1 as pb;
use automesh_store::StoreError;
use automesh_store::cloud::{CloudPhase, ReadyWorker, WorkerMove};
use chrono::Utc;

use super::admission::Step;
use super::{Cloud, WATCH};

impl Cloud {
    pub(super) async fn watch(
        &self,
        run_id: &str,
        ready: &ReadyWorker,
    ) -> Result<Step, StoreError> {
        let Ok(mut agent) = self.agent(&ready.endpoint, &ready.id) else {
            return Ok(Step::Lost("bad worker endpoint".into()));
        };
        let mut cancel_sent = false;
        let mut touched: Option<tokio::time::Instant> = None;
        loop {
            let Some(d) = self.store.cloud_run(run_id).await? else {
                return Ok(Step::Done);
            };
            if d.phase == CloudPhase::Finished {
                return Ok(Step::Done);
            }
            if touched.is_none_or(|at| at.elapsed() >= self.settings.lease / 3) {
                let _ = self
                    .store
                    .move_worker(&d.worker_id, WorkerMove::Touch, Utc::now())
                    .await;
                touched = Some(tokio::time::Instant::now());
            }
            if d.cancel_requested && !cancel_sent {
                cancel_sent = agent
                    .cancel_thread(apb::CancelThreadRequest {
                        thread_id: d.thread_id.clone(),
                    })
                    .await
                    .is_ok();
            }
            let thread = agent
                .get_thread(apb::GetThreadRequest {
                    thread_id: d.thread_id.clone(),
                })
                .await;
            match thread.map(|r| r.into_inner().thread.unwrap_or_default()) {
                Ok(t) if t.status == apb::ThreadStatus::Idle as i32 => {
                    let state = pb::RunState::try_from(t.outcome).unwrap_or(pb::RunState::Failed);
                    let code = t.error_code.parse::<ErrorCode>().ok();
                    self.finish(&d, state, code, t.error_message.clone(), t.usage)
                        .await?;
                    let _ = self
                        .store
                        .move_worker(&d.worker_id, WorkerMove::Touch, Utc::now())
                        .await;
                    tracing::info!(run_id, outcome = ?state, "cloud run finished on its worker");
                    return Ok(Step::Done);
                }
                Ok(t) if t.status == apb::ThreadStatus::Unknown as i32 => {
                    // The agent answering does not know the thread: its
                    // journal is gone with the agent that had it.
                    self.fail(
                        &d,
                        ErrorCode::RuntimeInterrupted,
                        "the worker no longer knows the run's thread; it is not run again".into(),
                    )
                    .await?;
                    return Ok(Step::Done);
                }
                Ok(_) => {}
                Err(_) if !self.alive(ready).await => {
                    self.agent_lost(ready, "it stopped answering for a running thread")
                        .await;
                    return Ok(Step::Lost(
                        "the agent stopped answering for the running thread".into(),
                    ));
                }
                Err(s) => {
                    tracing::warn!(run_id, code = ?s.code(), "the worker did not answer for the thread; it is alive, watching on");
                }
            }
            tokio::time::sleep(WATCH).await;
        }
    }
}
