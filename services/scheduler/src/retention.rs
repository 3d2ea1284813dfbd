//! Retention (docs/retention.md): a loop beside the occurrence loop that,
//! when a pass is due, claims it (one scheduler replica at a time) and
//! deletes finished runs, their events, receipts and dispatch rows, and
//! webhook messages done with, once older than their organisation's
//! retention — the store's `purge_expired`, in bounded batches.
//!
//! SRE: a `retention.pass` span per pass, `automesh_retention_deleted_total`
//! by table, `automesh_retention_partitions_total` by what befell them
//! (`dropped`, `created`: PostgreSQL's week partitions of runs),
//! `automesh_retention_oldest_kept_age_seconds` (the oldest
//! finished run kept, as the replica that ran the last pass saw it) and
//! `automesh_retention_pass_duration_seconds`, and one log line per pass.

use std::sync::OnceLock;
use std::time::Duration;

use automesh_store::Store;
use automesh_store::retention::{Pass, Policy};
use chrono::Utc;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How often a replica looks whether a pass is due.
const LOOK_EVERY: Duration = Duration::from_secs(60);

/// How a scheduler keeps history.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The pass's policy (default days, batch, time bound).
    pub policy: Policy,
    /// From one complete pass to the next.
    pub every: Duration,
}

fn deleted() -> &'static Counter<u64> {
    static C: OnceLock<Counter<u64>> = OnceLock::new();
    C.get_or_init(|| {
        automesh_telemetry::metrics::counter(
            "automesh.retention.deleted",
            "Rows deleted by retention, by table (runs, run_events, receipts, dispatch, \
             webhook_messages)",
        )
    })
}

fn partitions() -> &'static Counter<u64> {
    static C: OnceLock<Counter<u64>> = OnceLock::new();
    C.get_or_init(|| {
        automesh_telemetry::metrics::counter(
            "automesh.retention.partitions",
            "Week partitions of runs, their events and receipts (PostgreSQL) that retention \
             dropped or made ahead of need, by action (dropped, created)",
        )
    })
}

fn duration() -> &'static Histogram<f64> {
    static H: OnceLock<Histogram<f64>> = OnceLock::new();
    H.get_or_init(|| {
        automesh_telemetry::metrics::seconds(
            "automesh.retention.pass.duration",
            "How long a retention pass took, by whether it finished (complete) or stopped at its \
             time bound with work left (partial)",
            &[0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0],
        )
    })
}

fn oldest_kept() -> &'static automesh_telemetry::metrics::Sampled {
    static G: OnceLock<automesh_telemetry::metrics::Sampled> = OnceLock::new();
    G.get_or_init(|| {
        automesh_telemetry::metrics::Sampled::gauge(
            "automesh.retention.oldest_kept.age",
            "s",
            "Age of the oldest finished run kept, as the last retention pass of this replica saw it",
        )
    })
}

/// Looks every minute (and at once) whether a pass is due, runs it when
/// this replica claims it, until `shutdown`.
pub async fn run_loop(store: Store, settings: Settings, shutdown: CancellationToken) {
    // Registered up front, so that a scrape shows them before the first pass.
    let _ = (deleted(), partitions(), duration(), oldest_kept());
    loop {
        match pass_if_due(&store, settings).await {
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "retention pass failed; tried again later"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(LOOK_EVERY) => {}
        }
    }
}

/// With retention off (everything kept), still makes PostgreSQL's week
/// partitions of runs ahead of need, hourly (and at once), until `shutdown`:
/// so that runs do not pile up in the default partition, and turning
/// retention on later finds its weeks.
pub async fn weeks_loop(store: Store, shutdown: CancellationToken) {
    let _ = partitions();
    loop {
        match store.internal().make_run_weeks(Utc::now()).await {
            Ok(0) => {}
            Ok(n) => partitions().add(n, &[KeyValue::new("action", "created")]),
            Err(error) => {
                tracing::warn!(%error, "making week partitions failed; tried again later")
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(3600)) => {}
        }
    }
}

/// Runs one pass when one is due and this replica claims it: what it did,
/// or `None` when none was due (or another replica has it).
pub async fn pass_if_due(
    store: &Store,
    settings: Settings,
) -> automesh_store::Result<Option<Pass>> {
    let now = Utc::now();
    // The claim outlasts the pass's time bound and its last batch.
    let claim = settings.policy.time_bound + Duration::from_secs(120);
    let until = now + chrono::Duration::from_std(claim).unwrap_or(chrono::Duration::hours(1));
    if !store.internal().claim_retention_pass(now, until).await? {
        return Ok(None);
    }
    let span = tracing::info_span!(
        "retention.pass",
        default_days = settings.policy.default_days,
        runs_deleted = tracing::field::Empty,
        run_events_deleted = tracing::field::Empty,
        webhook_messages_deleted = tracing::field::Empty,
        orgs = tracing::field::Empty,
        weeks_dropped = tracing::field::Empty,
        complete = tracing::field::Empty,
    );
    let started = std::time::Instant::now();
    let pass = store
        .internal()
        .purge_expired(settings.policy, now)
        .instrument(span.clone())
        .await;
    let pass = match pass {
        Ok(pass) => pass,
        Err(error) => {
            // Due again at once: the claim is handed back.
            store
                .internal()
                .finish_retention_pass(now, Some(now))
                .await
                .ok();
            return Err(error);
        }
    };
    let done = Utc::now();
    // A pass stopped at its bound goes on at the next look.
    let next = if pass.complete {
        done + chrono::Duration::from_std(settings.every).unwrap_or(chrono::Duration::hours(1))
    } else {
        done
    };
    store
        .internal()
        .finish_retention_pass(done, Some(next))
        .await?;
    let took = started.elapsed().as_secs_f64();
    let outcome = if pass.complete { "complete" } else { "partial" };
    duration().record(took, &[KeyValue::new("outcome", outcome)]);
    for (table, n) in pass.purged.by_table() {
        if n > 0 {
            deleted().add(n, &[KeyValue::new("table", table)]);
        }
    }
    let dropped = pass.weeks_dropped.len() as u64;
    for (action, n) in [("dropped", dropped), ("created", pass.weeks_created)] {
        if n > 0 {
            partitions().add(n, &[KeyValue::new("action", action)]);
        }
    }
    let age = pass
        .oldest_kept
        .map(|t| (done - t).num_milliseconds() as f64 / 1000.0);
    oldest_kept().set(age.map(|a| (a, vec![])).into_iter().collect());
    span.record("runs_deleted", pass.purged.runs);
    span.record("run_events_deleted", pass.purged.run_events);
    span.record("webhook_messages_deleted", pass.purged.webhook_messages);
    span.record("orgs", pass.orgs);
    span.record("weeks_dropped", dropped);
    span.record("complete", pass.complete);
    tracing::info!(
        runs = pass.purged.runs,
        run_events = pass.purged.run_events,
        receipts = pass.purged.receipts,
        dispatch = pass.purged.dispatch,
        webhook_messages = pass.purged.webhook_messages,
        orgs = pass.orgs,
        weeks_dropped = dropped,
        complete = pass.complete,
        seconds = took,
        "retention pass"
    );
    Ok(Some(pass))
}
