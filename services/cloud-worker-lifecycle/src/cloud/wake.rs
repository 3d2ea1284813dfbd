//! Waking a worker: claim its start (a lease, renewed while the drive
//! starts it), start it and wait — under the readiness cap — until its
//! agent answers; or wait for whoever holds the start. A worker that reads
//! ready is trusted only once its agent answers a keepalive as the agent
//! the row names; one that does not is marked lost, stopped, and started
//! afresh.

use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_proto::agent::v1 as apb;
use automesh_store::cloud::{ReadyWorker, Wake, WorkerMove};
use chrono::{DateTime, Utc};
use tracing::Instrument;

use super::{AbortOnDrop, Cloud, KEEPALIVE_TIMEOUT};
use automesh_domain::CodedError;

impl Cloud {
    /// Wakes the worker (or waits for whoever is waking it), bounded by
    /// `give_up` (the readiness cap or the deadline, whichever is first).
    pub(super) async fn wake(
        &self,
        worker_id: &str,
        give_up: DateTime<Utc>,
    ) -> Result<ReadyWorker, CodedError> {
        let mut backoff = Duration::from_millis(50);
        loop {
            let now = Utc::now();
            let _ = self
                .store
                .move_worker(worker_id, WorkerMove::Touch, now)
                .await;
            let wake = self
                .store
                .wake_worker(worker_id, &self.replica, self.lease_until(), now)
                .await
                .map_err(|e| CodedError::new(ErrorCode::RuntimeFailed, e.to_string()))?;
            match wake {
                Wake::Ready { endpoint, agent_id } => {
                    let ready = ReadyWorker {
                        id: worker_id.to_owned(),
                        endpoint,
                        agent_id,
                    };
                    if self.alive(&ready).await {
                        crate::metrics::metrics().woke("ready");
                        return Ok(ready);
                    }
                    self.agent_lost(&ready, "it did not answer a keepalive")
                        .await;
                    // Claim the fresh start at once.
                    continue;
                }
                Wake::Start => match self.start(worker_id, give_up).await {
                    Ok(Some(ready)) => {
                        crate::metrics::metrics().woke("started");
                        return Ok(ready);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        crate::metrics::metrics().woke(e.code.as_str());
                        return Err(e);
                    }
                },
                Wake::Starting | Wake::Stopping => {}
            }
            if Utc::now() >= give_up {
                crate::metrics::metrics().woke(ErrorCode::ReadinessTimeout.as_str());
                return Err(CodedError::new(
                    ErrorCode::ReadinessTimeout,
                    format!(
                        "the worker was not ready within {:?}",
                        self.settings.readiness_cap
                    ),
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Starts the worker whose start this replica claimed, renewing the
    /// claim meanwhile. `None` when the claim was taken over (this replica
    /// was too slow): the caller waits for the new holder.
    async fn start(
        &self,
        worker_id: &str,
        give_up: DateTime<Utc>,
    ) -> Result<Option<ReadyWorker>, CodedError> {
        let renewal = {
            let cloud = self.clone();
            let worker = worker_id.to_owned();
            AbortOnDrop(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(cloud.settings.lease / 3).await;
                    let renew = WorkerMove::RenewStart {
                        starter: &cloud.replica,
                        until: cloud.lease_until(),
                    };
                    match cloud.store.move_worker(&worker, renew, Utc::now()).await {
                        Ok(true) => {}
                        Ok(false) => return,
                        Err(error) => {
                            tracing::warn!(worker_id = %worker, %error, "cannot renew the worker's start")
                        }
                    }
                }
            }))
        };
        tracing::info!(
            worker_id,
            driver = self.driver.name(),
            "starting the worker"
        );
        let began = std::time::Instant::now();
        let started = async {
            let within = (give_up - Utc::now()).to_std().unwrap_or_default();
            let endpoint = self
                .driver
                .start(&self.launch(worker_id), within)
                .instrument(tracing::info_span!(
                    "automesh.cloud.start",
                    driver = self.driver.name()
                ))
                .await?;
            let agent_id = self
                .await_agent(&endpoint, worker_id, give_up)
                .instrument(tracing::info_span!("automesh.cloud.readiness"))
                .await?;
            Ok::<_, CodedError>((endpoint, agent_id))
        }
        .await;
        drop(renewal);
        let (endpoint, agent_id) = match started {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(worker_id, code = %e.code, message = %e.message, "the worker did not start");
                let _ = self.driver.stop(worker_id).await;
                let _ = self
                    .store
                    .move_worker(
                        worker_id,
                        WorkerMove::StartFailed {
                            starter: &self.replica,
                        },
                        Utc::now(),
                    )
                    .await;
                return Err(e);
            }
        };
        let ready = self
            .store
            .move_worker(
                worker_id,
                WorkerMove::Ready {
                    starter: &self.replica,
                    endpoint: &endpoint,
                    agent_id: &agent_id,
                },
                Utc::now(),
            )
            .await
            .map_err(|e| CodedError::new(ErrorCode::RuntimeFailed, e.to_string()))?;
        if !ready {
            tracing::warn!(
                worker_id,
                "the worker's start was taken over; waiting for its new starter"
            );
            return Ok(None);
        }
        tracing::info!(worker_id, %agent_id, "worker ready");
        crate::metrics::metrics().ready_after(began.elapsed());
        Ok(Some(ReadyWorker {
            id: worker_id.to_owned(),
            endpoint,
            agent_id,
        }))
    }

    /// Waits until the agent at `endpoint` answers a keepalive, bounded by
    /// `give_up`; returns its agent id.
    async fn await_agent(
        &self,
        endpoint: &str,
        worker_id: &str,
        give_up: DateTime<Utc>,
    ) -> Result<String, CodedError> {
        let mut agent = self
            .agent(endpoint, worker_id)
            .map_err(|_| CodedError::new(ErrorCode::RuntimeFailed, "bad worker endpoint"))?;
        let mut backoff = Duration::from_millis(25);
        loop {
            let answer = tokio::time::timeout(
                KEEPALIVE_TIMEOUT,
                agent.keep_alive(apb::KeepAliveRequest {}),
            )
            .await;
            if let Ok(Ok(r)) = answer {
                return Ok(r.into_inner().agent_id);
            }
            if Utc::now() >= give_up {
                crate::metrics::metrics().woke(ErrorCode::ReadinessTimeout.as_str());
                return Err(CodedError::new(
                    ErrorCode::ReadinessTimeout,
                    "the worker agent did not answer before the readiness cap",
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Whether the agent the worker's row names answers at its endpoint.
    pub(super) async fn alive(&self, ready: &ReadyWorker) -> bool {
        let Ok(mut agent) = self.agent(&ready.endpoint, &ready.id) else {
            return false;
        };
        let answer = tokio::time::timeout(
            KEEPALIVE_TIMEOUT,
            agent.keep_alive(apb::KeepAliveRequest {}),
        )
        .await;
        matches!(answer, Ok(Ok(r)) if r.get_ref().agent_id == ready.agent_id)
    }

    /// The worker's agent stopped answering: mark that agent lost (once,
    /// whichever replica sees it first) and stop what is left of it, so the
    /// next wake starts a fresh one.
    pub(super) async fn agent_lost(&self, ready: &ReadyWorker, why: &str) {
        match self
            .store
            .move_worker(
                &ready.id,
                WorkerMove::Lost {
                    agent_id: &ready.agent_id,
                },
                Utc::now(),
            )
            .await
        {
            Ok(true) => {
                crate::metrics::metrics().agent_lost();
                tracing::warn!(
                    worker_id = %ready.id,
                    agent_id = %ready.agent_id,
                    why,
                    "the worker's agent is gone; the worker will be woken afresh"
                );
                if let Err(e) = self.driver.stop(&ready.id).await {
                    tracing::warn!(worker_id = %ready.id, error = %e, "stopping what is left of the agent failed");
                }
            }
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(worker_id = %ready.id, %error, "cannot mark the worker's agent lost")
            }
        }
    }
}
