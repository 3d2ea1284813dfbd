//! The claim loop: leases claimable runs (woken by signals, polled as a
//! safety net), bounded by `max_concurrent`, one drive task per run.

use std::sync::Arc;
use std::time::Duration;

use automesh_store::Store;
use chrono::Utc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Context;
use super::lease::{AbortOnDrop, drive};

/// Registers a drive's cancellation signal for as long as it lives.
pub(super) struct Registration<'a> {
    pub(super) ctx: &'a Context,
    pub(super) run_id: String,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.ctx.active.lock().remove(&self.run_id);
    }
}

/// Claims and drives runs until `shutdown`; then stops its drives and gives
/// their leases up, so another coordinator takes the runs over at once.
pub async fn run_loop(ctx: Arc<Context>, shutdown: CancellationToken) {
    let mut drives = JoinSet::new();
    let _queue = AbortOnDrop(tokio::spawn(sample_queue(ctx.store.clone())));
    let mut watcher = ctx.store.watch_new_runs().await;
    tracing::info!(owner = %ctx.owner, "coordinator claiming runs");
    loop {
        while drives.try_join_next().is_some() {}
        let capacity = ctx.settings.max_concurrent.saturating_sub(drives.len());
        // A full batch may leave more behind: claim again at once. A short
        // one took everything claimable; what is created after it signals.
        let mut full = false;
        if capacity > 0 {
            let now = Utc::now();
            let until = now + chrono::Duration::from_std(ctx.settings.lease).unwrap_or_default();
            let placements = ctx.executors.placements();
            let limit = capacity.min(64);
            // Signals so far announce runs this claim sees.
            watcher.consume();
            match ctx
                .store
                .claim_runs(
                    &ctx.owner,
                    &placements,
                    until,
                    now,
                    now - chrono::Duration::from_std(ctx.settings.orphan_grace).unwrap_or_default(),
                    limit as u32,
                )
                .await
            {
                Ok(claimed) => {
                    full = claimed.len() == limit;
                    for run in claimed {
                        drives.spawn(drive(ctx.clone(), run));
                    }
                }
                Err(error) => tracing::warn!(%error, "cannot claim runs"),
            }
        }
        let at_capacity = drives.len() >= ctx.settings.max_concurrent;
        if full && !at_capacity {
            continue;
        }
        tokio::select! {
            () = watcher.wait(ctx.settings.poll) => {}
            // At capacity, a drive that ends makes room for what waits.
            Some(_) = drives.join_next(), if at_capacity => {}
            () = shutdown.cancelled() => break,
        }
    }
    drives.shutdown().await;
    match ctx.store.release_all_leases(&ctx.owner).await {
        Ok(n) => tracing::info!(released = n, "coordinator stopped; leases released"),
        Err(error) => tracing::warn!(%error, "coordinator stopped; leases will expire"),
    }
}

/// Samples the queue of unclaimed runs for its gauges, every few seconds.
async fn sample_queue(store: Store) {
    loop {
        if let Ok(q) = store.run_queue().await {
            let m = crate::metrics::metrics();
            m.pending.set(vec![(q.pending as f64, vec![])]);
            let lag = q.oldest.map_or(0.0, |t| {
                (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
            });
            m.lag.set(vec![(lag, vec![])]);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}
