//! Turning due occurrences into runs, exactly once, on any number of
//! scheduler replicas.
//!
//! Each pass claims the active automations whose next occurrence is due
//! (locked rows other replicas skip), and in one transaction per batch
//! creates their runs — with ids derived from (automation, instant), so even
//! a race without locks could not create two — and advances their next
//! occurrence. Between passes the loop sleeps until the earliest next
//! occurrence (one index probe), or until an edit wakes it; a few ordinary
//! occurrences are fired just ahead of their instant, for the coordinator
//! to claim and hold until it (see `AHEAD`).
//!
//! After downtime, only the latest missed occurrence may still run, and only
//! inside the catch-up window; every other one gets a `missed` receipt.
//! Never a burst. An occurrence whose previous run is still live is recorded
//! `skipped`, never queued.

use std::sync::Arc;
use std::time::Duration;

use automesh_domain::ids::scheduled_run_id;
use automesh_domain::run::NewRun;
use automesh_domain::{Automation, ErrorCode, Notice, Receipt, RunState, RunTrigger, Schedule};
use automesh_store::leases::CLAIM_AHEAD;
use automesh_store::scheduling::{Due, SchedulingTx};
use automesh_store::{Store, StoreError};
use automesh_telemetry::propagation;
use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Created, Path};
use automesh_rpc::precise::sleep_precisely;

/// Automations claimed per transaction.
const BATCH: u32 = 200;

/// Batches one pass claims and commits at once (PostgreSQL).
const PASS_WORKERS: usize = 4;
/// Occurrences considered per automation per pass (a longer backlog is
/// worked through over several passes, all recorded missed).
const OCCURRENCE_LIMIT: usize = 1000;
/// The shortest sleep when something due is held by another replica.
const MIN_SLEEP: Duration = Duration::from_millis(20);
/// An occurrence this late is still on time, whatever the catch-up window.
const ON_TIME: Duration = Duration::from_secs(60);

/// How the loop behaves.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How late the latest missed occurrence may be and still run.
    pub catch_up_window: Duration,
    /// Each run's deadline, from its creation.
    pub run_deadline: Duration,
    /// The longest sleep between passes (edits made elsewhere are seen
    /// within it; edits made through this replica wake it at once).
    pub max_sleep: Duration,
}

impl Settings {
    /// The longest sleep between passes, unless a caller needs another.
    pub const MAX_SLEEP: Duration = Duration::from_secs(1);

    /// Settings with runs of `run_deadline` and a catch-up window of
    /// `catch_up_window`, sleeping at most [`Settings::MAX_SLEEP`].
    pub fn new(run_deadline: Duration, catch_up_window: Duration) -> Self {
        Self {
            catch_up_window,
            run_deadline,
            max_sleep: Self::MAX_SLEEP,
        }
    }
}

/// What to do with an automation's due occurrences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Occurrences recorded `missed`.
    pub missed: Vec<DateTime<Utc>>,
    /// The occurrence to run (subject to the overlap check).
    pub fire: Option<DateTime<Utc>>,
    /// The next occurrence still to come.
    pub next: Option<DateTime<Utc>>,
}

/// Plans the occurrences from `first_due` (the stored next occurrence) up to
/// `now`.
pub fn plan(
    schedule: &Schedule,
    first_due: DateTime<Utc>,
    now: DateTime<Utc>,
    catch_up: Duration,
) -> Plan {
    let mut due = Vec::new();
    let mut t = Some(first_due);
    while let Some(at) = t {
        if at > now || due.len() == OCCURRENCE_LIMIT {
            break;
        }
        due.push(at);
        t = schedule.next_after(at);
    }
    let backlog_continues = t.is_some_and(|at| at <= now);
    let window = chrono::Duration::from_std(catch_up.max(ON_TIME)).unwrap_or_default();
    let fire = match due.last() {
        Some(latest) if !backlog_continues && now - *latest <= window => due.pop(),
        _ => None,
    };
    Plan {
        missed: due,
        fire,
        next: t,
    }
}

/// Runs passes until `shutdown`.
pub async fn run_loop(
    store: Store,
    settings: Settings,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    // The due instant the loop woke (a little) ahead of, if it did.
    let mut ahead_of = None;
    let mut swept: Option<std::time::Instant> = None;
    loop {
        if swept.is_none_or(|at| at.elapsed() >= crate::budget::MONTH_SWEEP) {
            swept = Some(std::time::Instant::now());
            // What it resumes is due now or later: the pass below sees it.
            if let Err(error) = crate::budget::resume_spent_months(&store, Utc::now()).await {
                tracing::warn!(%error, "the month sweep failed; the next one retries");
            }
        }
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Everything due by the instant fired ahead of it: no locked pass
        // now (it would only compete with the coordinators claiming those
        // runs); anything due since is seen by the look below.
        let fired = match ahead_of.take() {
            Some(at) => match fire_ahead(&store, &settings, at).await {
                Ok(fired) => fired,
                Err(error) => {
                    tracing::warn!(%error, "firing at the due instant failed; the pass fires it");
                    None
                }
            },
            None => None,
        };
        let claimed = match fired {
            Some(n) => Ok(n),
            None => pass(&store, &settings).await,
        };
        if let Err(error) = claimed {
            tracing::warn!(%error, "scheduling pass failed; retrying");
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                () = shutdown.cancelled() => return,
            }
        }
        let (sleep, next) = match store.next_due_at().await {
            // Due now but not claimed: another replica holds it. Do not spin.
            Ok(Some(at)) if at <= Utc::now() && matches!(claimed, Ok(0)) => (MIN_SLEEP, None),
            Ok(Some(at)) => {
                let until = (at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
                if until > settings.max_sleep {
                    (settings.max_sleep, None)
                } else if until > AHEAD {
                    // Wake ahead to have the due runs created and claimed
                    // by the instant.
                    (until - AHEAD, Some(at))
                } else {
                    (until, None)
                }
            }
            Ok(None) => (settings.max_sleep, None),
            Err(error) => {
                tracing::warn!(%error, "cannot read the next due instant");
                (settings.max_sleep, None)
            }
        };
        tokio::select! {
            () = sleep_precisely(sleep) => ahead_of = next,
            () = notified => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// How far ahead of a due instant the loop wakes to read what falls due,
/// plan it and fire it, in one transaction: its runs are then
/// committed, and claimed by a coordinator that holds it until the instant,
/// before the instant comes ([`CLAIM_AHEAD`]: a run is claimable twice as
/// long before its instant). An occurrence fired so is decided this much
/// before its instant: an edit, a deactivation or a run-now committed in
/// these last milliseconds applies from the next occurrence, as it would
/// had it arrived a little later.
const AHEAD: Duration = Duration::from_millis(10);

const _: () = assert!(AHEAD.as_micros() * 2 <= CLAIM_AHEAD.as_micros());

/// The most occurrences due at one instant fired that way; a burst goes
/// through the pass's batches.
const AHEAD_LIMIT: usize = 8;

/// Fires what falls due at `at` ahead of it, when that is a few ordinary
/// occurrences (nothing missed, no previous run live): read and planned
/// without locks, and fired together in one transaction whose one bulk
/// statement guards each (the automation still active, unchanged and due
/// at the same instant, and no run of it live). A guard that does not hold fires nothing:
/// the pass at the instant claims what is still due, with locks, and
/// decides again. PostgreSQL only. How many fired when every occurrence
/// due by `at` did (no pass is needed then), else `None`.
async fn fire_ahead(
    store: &Store,
    settings: &Settings,
    at: DateTime<Utc>,
) -> Result<Option<usize>, StoreError> {
    if store.backend() != automesh_store::Backend::Postgres {
        return Ok(None);
    }
    let due = store.due_by(at, AHEAD_LIMIT as u32 + 1).await?;
    // A monthly budget is checked by the pass, in its transaction.
    let budgeted = due
        .iter()
        .any(|d| d.automation.monthly_budget_micros.is_some());
    if due.is_empty() || due.len() > AHEAD_LIMIT || due.iter().any(|d| d.live_run) || budgeted {
        return Ok(None);
    }
    let mut fires = vec![];
    for d in &due {
        let a = &d.automation;
        let Some(first_due) = a.next_run_at else {
            return Ok(None);
        };
        let plan = plan(&a.schedule, first_due, at, settings.catch_up_window);
        let (Some(fire), true) = (plan.fire, plan.missed.is_empty()) else {
            return Ok(None);
        };
        fires.push((a, fire, plan.next));
    }
    let now = Utc::now();
    let planned: Vec<_> = fires
        .iter()
        .map(|(a, fire, next)| {
            let span = occurrence_span(a, *fire);
            let traceparent = span.in_scope(propagation::current_traceparent);
            let run = new_run(
                a,
                *fire,
                now,
                settings,
                RunState::Pending,
                None,
                traceparent,
            );
            (span, run, *fire, *next)
        })
        .collect();
    let runs: Vec<_> = planned
        .iter()
        .map(|(_, run, _, next)| (run, *next))
        .collect();
    let made = store.fire_unlocked(&runs, now).await?;
    let mut created = vec![];
    for ((span, run, fire, _), made) in planned.iter().zip(made) {
        if made {
            span.in_scope(|| tracing::info!(run_id = %run.id, "occurrence due: run created"));
            created.push(Created {
                placement: run.automation.placement,
                trigger: RunTrigger::Schedule,
                state: RunState::Pending,
                code: None,
                fired: Some((*fire, Path::Ahead)),
            });
        }
    }
    crate::metrics::count(&created);
    Ok((created.len() == fires.len()).then_some(created.len()))
}

/// The span an occurrence's run starts its trace with.
fn occurrence_span(a: &Automation, at: DateTime<Utc>) -> tracing::Span {
    tracing::info_span!(
        parent: None,
        "automesh.occurrence",
        automation_id = %a.id,
        scheduled_for = %at,
        placement = %a.placement,
    )
}

/// One pass over everything due now; returns how many automations fired.
/// On PostgreSQL several batches are claimed and committed at once (the
/// claims skip each other's rows); SQLite has one writer.
pub async fn pass(store: &Store, settings: &Settings) -> Result<usize, StoreError> {
    // One batch first: most passes find a few automations due, and one
    // transaction is all they need.
    let first = batch(store, settings).await?;
    if first < BATCH as usize {
        return Ok(first);
    }
    let workers = match store.backend() {
        automesh_store::Backend::Postgres => PASS_WORKERS,
        automesh_store::Backend::Sqlite => 1,
    };
    let batches = (0..workers).map(|_| batches(store, settings));
    let mut total = first;
    for fired in futures_util::future::join_all(batches).await {
        total += fired?;
    }
    Ok(total)
}

/// Claims and materializes batches of due automations until a batch comes
/// back short; how many fired.
async fn batches(store: &Store, settings: &Settings) -> Result<usize, StoreError> {
    let mut total = 0;
    loop {
        let fired = batch(store, settings).await?;
        total += fired;
        if fired < BATCH as usize {
            return Ok(total);
        }
    }
}

/// Claims and materializes one batch of due automations, in one
/// transaction; how many fired.
async fn batch(store: &Store, settings: &Settings) -> Result<usize, StoreError> {
    let now = Utc::now();
    let mut tx = store.begin_scheduling().await?;
    let due = tx.claim_due(now, BATCH).await?;
    let mut created = vec![];
    let mut fires = vec![];
    for d in &due {
        fires.extend(materialize(&mut tx, d, now, settings, &mut created).await?);
    }
    // The ordinary occurrences, nothing missed and nothing live: their
    // runs created and their automations advanced together.
    let runs: Vec<_> = fires.iter().map(|f| (&f.run, f.next)).collect();
    let made = tx.fire_many(&runs, now).await?;
    for (fire, made) in fires.iter().zip(made) {
        if made {
            let run_id = &fire.run.id;
            fire.span
                .in_scope(|| tracing::info!(run_id = %run_id, "occurrence due: run created"));
            created.push(Created {
                placement: fire.run.automation.placement,
                trigger: RunTrigger::Schedule,
                state: RunState::Pending,
                code: None,
                fired: Some((fire.at, Path::Pass)),
            });
        }
    }
    tx.commit().await?;
    crate::metrics::count(&created);
    Ok(due.len())
}

/// An ordinary occurrence a pass fires: its run, the automation's next
/// occurrence, and the span its trace starts with.
struct Fire<'a> {
    run: NewRun<'a>,
    next: Option<DateTime<Utc>>,
    at: DateTime<Utc>,
    span: tracing::Span,
}

/// Records what fell due of one automation in the pass's transaction:
/// missed and skipped occurrences at once; an ordinary one (nothing
/// missed, no run live) is returned, for the batch to fire with the rest.
async fn materialize<'a>(
    tx: &mut SchedulingTx,
    due: &'a Due,
    now: DateTime<Utc>,
    settings: &Settings,
    created: &mut Vec<Created>,
) -> Result<Option<Fire<'a>>, StoreError> {
    let a = &due.automation;
    let Some(first_due) = a.next_run_at else {
        return Ok(None);
    };
    let plan = plan(&a.schedule, first_due, now, settings.catch_up_window);
    for at in &plan.missed {
        record_terminal(
            tx,
            a,
            *at,
            now,
            (
                RunState::Missed,
                ErrorCode::MissedDuringDowntime,
                "the occurrence fell due while the scheduler was down, outside the catch-up window",
            ),
            created,
        )
        .await?;
    }
    if !plan.missed.is_empty() {
        tx.notify(&[Notice::occurrences_missed(a, &plan.missed, now)])
            .await?;
        tracing::warn!(automation_id = %a.id, missed = plan.missed.len(), "occurrences missed");
    }
    if let Some(at) = plan.fire
        && !due.live_run
        && crate::budget::skipped_for_budget(tx, a, at, now, created).await?
    {
        return Ok(None);
    }
    if let Some(at) = plan.fire {
        if due.live_run {
            record_terminal(
                tx,
                a,
                at,
                now,
                (
                    RunState::Skipped,
                    ErrorCode::PreviousRunLive,
                    "the previous run of this automation was still live at the due instant",
                ),
                created,
            )
            .await?;
            tracing::info!(automation_id = %a.id, scheduled_for = %at, "occurrence skipped: previous run live");
        } else {
            // Each occurrence starts its own trace; the run carries it on.
            let span = occurrence_span(a, at);
            let traceparent = span.in_scope(propagation::current_traceparent);
            let run = new_run(a, at, now, settings, RunState::Pending, None, traceparent);
            // The common case, nothing missed: the run and the automation's
            // advance in one statement, with the batch's others.
            if plan.missed.is_empty() {
                return Ok(Some(Fire {
                    run,
                    next: plan.next,
                    at,
                    span,
                }));
            }
            if tx.create_run(&run, now).await? {
                span.in_scope(|| tracing::info!(run_id = %run.id, "occurrence due: run created"));
                created.push(Created {
                    placement: a.placement,
                    trigger: RunTrigger::Schedule,
                    state: RunState::Pending,
                    code: None,
                    fired: Some((at, Path::Pass)),
                });
            }
        }
    }
    tx.advance(&a.id, plan.next, now).await?;
    Ok(None)
}

fn new_run<'a>(
    a: &'a Automation,
    at: DateTime<Utc>,
    now: DateTime<Utc>,
    settings: &Settings,
    state: RunState,
    error: Option<(ErrorCode, &str)>,
    traceparent: Option<String>,
) -> NewRun<'a> {
    NewRun {
        id: scheduled_run_id(&a.id, at),
        automation: a,
        trigger: RunTrigger::Schedule,
        scheduled_for: Some(at),
        idempotency_key: None,
        state,
        error: error.map(|(c, m)| (c, m.to_owned())),
        deadline_at: now + chrono::Duration::from_std(settings.run_deadline).unwrap_or_default(),
        traceparent,
    }
}

pub(crate) async fn record_terminal(
    tx: &mut SchedulingTx,
    a: &Automation,
    at: DateTime<Utc>,
    now: DateTime<Utc>,
    (state, code, message): (RunState, ErrorCode, &str),
    created: &mut Vec<Created>,
) -> Result<(), StoreError> {
    let settings = Settings {
        catch_up_window: Duration::ZERO,
        run_deadline: Duration::ZERO,
        max_sleep: Duration::ZERO,
    };
    let run = new_run(a, at, now, &settings, state, Some((code, message)), None);
    if tx.create_run(&run, now).await? {
        tx.insert_receipt(&Receipt {
            error_code: Some(code),
            error_message: Some(message.to_owned()),
            ..Receipt::bare(&run.id, state, a.placement, now)
        })
        .await?;
        created.push(Created {
            placement: a.placement,
            trigger: RunTrigger::Schedule,
            state,
            code: Some(code),
            fired: None,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use automesh_domain::TimeOfDay;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .expect("instant")
            .with_timezone(&Utc)
    }

    fn daily_utc(h: u32) -> Schedule {
        Schedule::Daily {
            time: TimeOfDay::new(h, 0).expect("time"),
            zone: chrono_tz::UTC,
        }
    }

    /// The plan of a daily 09:00 UTC schedule first due at `first`, at
    /// `now`, catching up within `window`.
    fn daily_plan(first: &str, now: &str, window: Duration) -> Plan {
        plan(&daily_utc(9), utc(first), utc(now), window)
    }

    #[test]
    fn on_time_fires() {
        let p = daily_plan(
            "2026-12-01T09:00:00Z",
            "2026-12-01T09:00:00.010Z",
            Duration::ZERO,
        );
        assert_eq!(p.fire, Some(utc("2026-12-01T09:00:00Z")));
        assert!(p.missed.is_empty());
        assert_eq!(p.next, Some(utc("2026-12-02T09:00:00Z")));
    }

    #[test]
    fn three_days_down_catches_up_once_inside_the_window() {
        let hour = Duration::from_secs(3600);
        let p = daily_plan("2026-12-01T09:00:00Z", "2026-12-04T09:30:00Z", hour);
        assert_eq!(p.fire, Some(utc("2026-12-04T09:00:00Z")));
        assert_eq!(
            p.missed,
            [
                utc("2026-12-01T09:00:00Z"),
                utc("2026-12-02T09:00:00Z"),
                utc("2026-12-03T09:00:00Z")
            ]
        );
        assert_eq!(p.next, Some(utc("2026-12-05T09:00:00Z")));
    }

    #[test]
    fn outside_the_window_everything_is_missed() {
        let hour = Duration::from_secs(3600);
        let p = daily_plan("2026-12-02T09:00:00Z", "2026-12-04T12:00:00Z", hour);
        assert_eq!(p.fire, None);
        assert_eq!(p.missed.len(), 3);
    }

    #[test]
    fn once_fires_then_has_no_next() {
        let at = utc("2026-12-01T09:00:00Z");
        let p = plan(
            &Schedule::Once { at },
            at,
            utc("2026-12-01T09:00:01Z"),
            Duration::ZERO,
        );
        assert_eq!(p.fire, Some(at));
        assert_eq!(p.next, None);
    }

    #[test]
    fn a_huge_backlog_is_worked_through_in_bounded_passes() {
        let s = daily_utc(0);
        let first = utc("2020-01-01T00:00:00Z");
        let now = utc("2026-12-01T00:30:00Z");
        let p = plan(&s, first, now, Duration::from_secs(3600));
        assert_eq!(p.missed.len(), OCCURRENCE_LIMIT);
        assert_eq!(p.fire, None, "nothing fires until the backlog is through");
        assert!(p.next.is_some_and(|n| n <= now));
    }
}
