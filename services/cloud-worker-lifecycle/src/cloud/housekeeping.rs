//! What every lifecycle replica does in the background: resume cloud runs
//! whose drive died (their lease lapsed), keep ready workers' agents alive
//! (an agent that hears from no lifecycle exits after its orphan bound), and
//! stop idle workers — any replica any worker, whoever started it.

use std::time::Duration;

use automesh_proto::agent::v1 as apb;
use automesh_store::cloud::WorkerMove;
use chrono::Utc;
use tokio_util::sync::CancellationToken;

use super::{Cloud, KEEPALIVE_TIMEOUT};

/// How often runs whose drive died are looked for.
const RESUME_EVERY: Duration = Duration::from_secs(1);
/// How many agents are kept alive at once.
const KEEPALIVE_PARALLEL: usize = 16;

impl Cloud {
    /// Resumes, keeps alive and stops idle workers until `shutdown`.
    pub async fn housekeeping(self, shutdown: CancellationToken) {
        let start = tokio::time::Instant::now();
        let mut idle_at = start + self.settings.idle_check;
        let mut keepalive_at = start;
        loop {
            tokio::select! {
                () = tokio::time::sleep(RESUME_EVERY.min(self.settings.idle_check)) => {}
                () = shutdown.cancelled() => return,
            }
            if let Err(error) = self.resume_pass().await {
                tracing::warn!(%error, "looking for cloud runs to resume failed");
            }
            if let Ok(states) = self.store.workers_by_state().await {
                crate::metrics::metrics().workers.set(
                    states
                        .into_iter()
                        .map(|(state, n)| {
                            (n as f64, vec![opentelemetry::KeyValue::new("state", state)])
                        })
                        .collect(),
                );
            }
            let now = tokio::time::Instant::now();
            if now >= keepalive_at {
                keepalive_at = now + self.settings.keepalive_every;
                self.keepalive_pass().await;
            }
            if now >= idle_at {
                idle_at = now + self.settings.idle_check;
                if let Err(error) = self.idle_pass().await {
                    tracing::warn!(%error, "idle stop pass failed");
                }
            }
        }
    }

    /// Hands back this replica's drives and worker starts (it is
    /// stopping), bounded: a database that does not answer leaves them to
    /// lapse with their leases instead.
    pub async fn hand_back(&self) {
        // This replica's drives end first, so that none renews what is
        // handed back.
        self.stopped.cancel();
        let ended = tokio::time::timeout(Duration::from_secs(2), async {
            while !self.driving.lock().is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        if ended.await.is_err() {
            tracing::warn!("stopping: some cloud drives did not end within 2 s");
        }
        let released = tokio::time::timeout(
            Duration::from_secs(5),
            self.store.release_cloud_claims(&self.replica),
        )
        .await;
        match released {
            Ok(Ok((drives, starts))) => {
                tracing::info!(
                    drives,
                    starts,
                    "stopping: cloud drives and worker starts handed back"
                )
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "stopping: cannot hand back cloud drives; they lapse with their leases")
            }
            Err(_) => tracing::warn!(
                "stopping: handing back cloud drives timed out; they lapse with their leases"
            ),
        }
    }

    /// Takes over unfinished cloud runs whose drive stopped renewing its
    /// lease.
    pub async fn resume_pass(&self) -> Result<usize, automesh_store::StoreError> {
        let runs = self.store.undriven_cloud_runs(Utc::now(), 100).await?;
        for run_id in &runs {
            let span = self.run_span("automesh.cloud.resume", run_id).await;
            span.in_scope(|| tracing::info!(run_id, "resuming a cloud run whose drive stopped"));
            self.drive(run_id);
        }
        Ok(runs.len())
    }

    /// Tells every ready worker's agent that its lifecycle lives.
    pub async fn keepalive_pass(&self) {
        let workers = match self.store.ready_workers(10_000).await {
            Ok(w) => w,
            Err(error) => {
                tracing::warn!(%error, "cannot list ready workers to keep alive");
                return;
            }
        };
        let mut calls = tokio::task::JoinSet::new();
        for w in workers {
            while calls.len() >= KEEPALIVE_PARALLEL {
                calls.join_next().await;
            }
            let Ok(mut agent) = self.agent(&w.endpoint, &w.id) else {
                continue;
            };
            calls.spawn(async move {
                let answer = tokio::time::timeout(
                    KEEPALIVE_TIMEOUT,
                    agent.keep_alive(apb::KeepAliveRequest {}),
                )
                .await;
                if !matches!(answer, Ok(Ok(_))) {
                    // The next wake of the worker finds out and starts a
                    // fresh agent; a keepalive alone never kills one.
                    tracing::debug!(worker_id = %w.id, "a ready worker's agent did not answer its keepalive");
                }
            });
        }
        while calls.join_next().await.is_some() {}
    }

    /// One idle-stop pass; returns the workers it stopped. A worker with a
    /// live run is never stopped (see `Store::begin_worker_stop`).
    pub async fn idle_pass(&self) -> Result<Vec<String>, automesh_store::StoreError> {
        let now = Utc::now();
        let cutoff = now - chrono::Duration::from_std(self.settings.idle_after).unwrap_or_default();
        let mut stopped = vec![];
        for worker_id in self.store.idle_worker_candidates(cutoff).await? {
            let ready = self.store.worker_endpoint(&worker_id).await?;
            if !self
                .store
                .move_worker(&worker_id, WorkerMove::BeginStop { cutoff }, Utc::now())
                .await?
            {
                continue;
            }
            tracing::info!(worker_id, "stopping an idle worker");
            // Asked first, so it exits cleanly; the drive then makes sure.
            if let Some(ready) = ready
                && let Ok(mut agent) = self.agent(&ready.endpoint, &worker_id)
            {
                let _ = tokio::time::timeout(
                    KEEPALIVE_TIMEOUT,
                    agent.shutdown(apb::ShutdownRequest {
                        reason: "idle".into(),
                    }),
                )
                .await;
            }
            if let Err(e) = self.driver.stop(&worker_id).await {
                tracing::warn!(worker_id, error = %e, "stopping the worker failed");
                let _ = self
                    .store
                    .move_worker(&worker_id, WorkerMove::Failed, Utc::now())
                    .await;
                continue;
            }
            self.store
                .move_worker(&worker_id, WorkerMove::Stopped, Utc::now())
                .await?;
            crate::metrics::metrics().idle_stopped();
            stopped.push(worker_id);
        }
        Ok(stopped)
    }
}
