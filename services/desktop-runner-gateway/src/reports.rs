//! What a runner tells the gateway, and what it is answered: reconciling
//! what a (re)connecting runner holds, and recording its reports —
//! acceptances (confirmed once recorded), events, results and idle
//! acknowledgements — with a named [`Refusal`] for what the protocol does
//! not allow.

use automesh_proto::executor::v1 as epb;
use automesh_proto::runner::v1 as rpb;
use automesh_store::Store;
use automesh_store::desktop::RunnerReport;
use chrono::Utc;
use prost::Message as _;

use crate::dispatch::Dispatch;
use crate::outbound::{cancel_message, send};
use crate::stream::Session;

/// Reconciles what a (re)connecting runner holds with the shared dispatch
/// state: runs it should run and does not hold are offered again (it
/// deduplicates by run id); cancelled runs it holds are cancelled again;
/// cancelled runs it no longer holds are idle; runs it holds that are
/// unknown, finished or another runner's are cancelled. Each send is
/// bounded.
pub(crate) async fn reconcile(
    store: &Store,
    dispatch: &Dispatch,
    session: &Session,
    held: &[String],
) -> Result<(), automesh_store::StoreError> {
    let runner_id = session.runner_id.as_str();
    let mine = store
        .desktop_runs_for_runner(&session.org_id, &session.owner_id, runner_id, 1024)
        .await?;
    for a in &mine {
        let holds = held.contains(&a.run_id);
        if a.cancel_requested {
            if holds {
                let reason = a.cancel_reason.clone().unwrap_or_default();
                send(&session.tx, cancel_message(&a.run_id, &reason)).await;
            } else if a.runner_id.as_deref() == Some(runner_id) {
                let idle = RunnerReport::Idle;
                store
                    .desktop_report(idle, &a.run_id, runner_id, &session.stream_id, Utc::now())
                    .await?;
            }
        } else if !holds
            // Only what no runner has accepted is offered again: a run this
            // runner accepted and no longer holds may be executing on the
            // machine of an older stream of its token; it is never sent to a
            // second one.
            && a.phase == automesh_store::desktop::DesktopPhase::Admitted
            // A run no runner was sent before is a first delivery, not a
            // redelivery, however it reaches the runner.
            && !dispatch.offer(store, session, &a.run_id, a.runner_id.is_some()).await?
            && session.tx.is_closed()
        {
            // The stream is gone; what was not offered waits for the next.
            return Ok(());
        }
    }
    for run_id in held {
        if mine.iter().any(|a| &a.run_id == run_id) {
            continue;
        }
        // Another owner's run gets the very answer an unknown id gets: a
        // runner learns nothing about runs that are not its owner's.
        let reason = match store.desktop_run(run_id).await? {
            Some(a) if a.org_id == session.org_id && a.owner_id == session.owner_id => {
                if a.phase == automesh_store::desktop::DesktopPhase::Finished {
                    "the run is finished"
                } else {
                    "the run belongs to another runner of its owner"
                }
            }
            _ => UNKNOWN_RUN,
        };
        if !send(&session.tx, cancel_message(run_id, reason)).await {
            tracing::warn!(
                runner_id,
                "the runner is not reading; reconciliation stopped"
            );
            return Ok(());
        }
    }
    Ok(())
}

/// What a reconnecting runner is told about a run it holds that the
/// gateway does not know for its owner.
const UNKNOWN_RUN: &str = "the gateway does not know this run";

/// A report the gateway refused, and why (sent back as `ProtocolError`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub run_id: String,
    pub code: &'static str,
    pub message: String,
    /// The named run's trace, when the gateway knows the run: the refusal
    /// is logged in it.
    pub traceparent: Option<String>,
}

impl Refusal {
    pub(crate) fn message(&self) -> rpb::ConnectResponse {
        rpb::ConnectResponse {
            message: Some(rpb::connect_response::Message::ProtocolError(
                rpb::ProtocolError {
                    run_id: self.run_id.clone(),
                    code: self.code.to_owned(),
                    message: self.message.clone(),
                },
            )),
        }
    }
}

/// The run ids of a report.
fn report_run_id(message: &rpb::connect_request::Message) -> Option<&str> {
    use rpb::connect_request::Message;
    match message {
        Message::AssignmentAccepted(a) => Some(&a.run_id),
        Message::RunEvents(e) => Some(&e.run_id),
        Message::RunFinished(f) => Some(&f.run_id),
        Message::IdleObserved(i) => Some(&i.run_id),
        Message::Hello(_) | Message::Heartbeat(_) => None,
    }
}

/// Outcomes a runner may finish a run with.
fn terminal_outcome(state: i32) -> bool {
    use automesh_proto::v1::RunState;
    matches!(
        RunState::try_from(state),
        Ok(RunState::Succeeded | RunState::Failed | RunState::Cancelled | RunState::TimedOut)
    )
}

/// What the gateway answers a runner's report with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Recorded (or a harmless redelivery): nothing to say.
    Nothing,
    /// The acceptance is recorded on this stream: the runner may start.
    Confirmed(String),
    Refused(Refusal),
}

/// Records a runner's report about one of its runs. Only the runner a run is
/// claimed for can change it (the store's updates are guarded by runner and
/// stream). An acceptance is answered with a confirmation once it is
/// recorded — the runner starts the run only then. A report the protocol
/// does not allow changes nothing and comes back as a [`Refusal`]; one that
/// changed nothing because it was a redelivery (after a reconnect) is fine.
pub(crate) async fn record(
    store: &Store,
    session: &Session,
    message: rpb::connect_request::Message,
) -> Result<Answer, automesh_store::StoreError> {
    let (runner_id, stream_id) = (session.runner_id.as_str(), session.stream_id.as_str());
    use rpb::connect_request::Message;
    let now = Utc::now();
    let Some(run_id) = report_run_id(&message).map(str::to_owned) else {
        return Ok(Answer::Nothing);
    };
    let refuse = |code: &'static str, message: String, traceparent: Option<String>| {
        Ok(Answer::Refused(Refusal {
            run_id: run_id.clone(),
            code,
            message,
            traceparent,
        }))
    };
    let acceptance = matches!(message, Message::AssignmentAccepted(_));
    if run_id.is_empty() {
        return refuse("invalid_report", "a report must name its run".into(), None);
    }
    if let Message::RunFinished(f) = &message
        && !terminal_outcome(f.outcome)
    {
        let name = automesh_proto::v1::RunState::try_from(f.outcome)
            .map(|s| s.as_str_name().to_owned())
            .unwrap_or_else(|_| format!("{}", f.outcome));
        let known = store.desktop_run(&run_id).await?;
        return refuse(
            "non_terminal_outcome",
            format!(
                "RunFinished needs a terminal outcome (SUCCEEDED, FAILED, CANCELLED or \
                 TIMED_OUT), not {name}; the run is unchanged"
            ),
            known.as_ref().and_then(traceparent_of),
        );
    }
    let applied = match message {
        Message::AssignmentAccepted(a) => {
            store
                .desktop_report(RunnerReport::Accepted, &a.run_id, runner_id, stream_id, now)
                .await?
        }
        Message::RunEvents(batch) => {
            let events: Vec<(String, Vec<u8>)> = batch
                .events
                .iter()
                .filter(|e| !e.event_id.is_empty())
                // A third-party runner's events are bounded here too.
                .map(|e| (e.event_id.clone(), e.clone().bounded().encode_to_vec()))
                .collect();
            store
                .append_desktop_events(&batch.run_id, runner_id, stream_id, &events, now)
                .await?
                > 0
        }
        Message::RunFinished(f) => {
            let outcome = epb::Outcome {
                state: f.outcome,
                error_code: f.error_code.clone(),
                error_message: f.error_message.clone(),
                engine: f.engine.clone(),
                usage: f.usage,
                ..Default::default()
            };
            let outcome = outcome.encode_to_vec();
            let finished = RunnerReport::Finished(&outcome);
            store
                .desktop_report(finished, &f.run_id, runner_id, stream_id, now)
                .await?
        }
        Message::IdleObserved(i) => {
            store
                .desktop_report(RunnerReport::Idle, &i.run_id, runner_id, stream_id, now)
                .await?
        }
        Message::Hello(_) | Message::Heartbeat(_) => true,
    };
    if applied {
        return Ok(if acceptance {
            Answer::Confirmed(run_id)
        } else {
            Answer::Nothing
        });
    }
    // Nothing changed: a redelivery of a report already recorded, or a
    // report about a run this runner does not hold (unknown, or another
    // runner's: the same answer either way).
    let known = store.desktop_run(&run_id).await?;
    let traceparent = known.as_ref().and_then(traceparent_of);
    // A finished run's events and result sent again by the runner that ran
    // it, from a newer stream (it resends what its journal holds after
    // every reconnect): a harmless redelivery, nothing to refuse.
    if known.as_ref().is_some_and(|a| {
        a.runner_id.as_deref() == Some(runner_id)
            && a.phase == automesh_store::desktop::DesktopPhase::Finished
    }) && !acceptance
    {
        return Ok(Answer::Nothing);
    }
    let held = known.filter(|a| {
        a.runner_id.as_deref() == Some(runner_id) && a.stream_id.as_deref() == Some(stream_id)
    });
    if let Some(a) = held {
        // An acceptance sent again (its confirmation was lost) is confirmed
        // again while the run runs here; a cancelled one is not (the
        // cancellation tells the runner to drop it).
        let confirm = acceptance
            && a.phase == automesh_store::desktop::DesktopPhase::Running
            && !a.cancel_requested;
        Ok(if confirm {
            Answer::Confirmed(run_id)
        } else {
            Answer::Nothing
        })
    } else {
        refuse(
            "not_assigned",
            "this runner holds no run with that id; the report was ignored".into(),
            traceparent,
        )
    }
}

/// The trace of a run, from its assignment's spec.
fn traceparent_of(a: &automesh_store::desktop::DesktopAssignment) -> Option<String> {
    crate::outbound::spec_of(a).map(|spec| spec.traceparent)
}
