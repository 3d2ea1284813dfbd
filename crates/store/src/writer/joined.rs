//! The statements a batch on PostgreSQL makes for many of its jobs at
//! once: each kind of joinable write (a run's move forward, a run's end, a
//! runner's report, a desktop offer) is a [`Row`] of one [`Joint`], and
//! the batch's rows of a kind are one statement, each row guarded as its
//! job's own statement guards it.

use std::sync::atomic::{AtomicU64, Ordering};

use automesh_domain::AutomationState;
use sqlx::AnyConnection;

use super::{Answer, Done, Pending};
use crate::Result;
use crate::signal::DesktopNote;

/// Which of the statements a batch makes for many jobs at once a row
/// joins. They run in this order, each over rows of distinct runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Joint {
    /// Runs' single moves forward, each with its status event
    /// ([`crate::runs::advance_many`]).
    Move,
    /// Runs' ends: terminal state, receipt and event
    /// ([`crate::receipts::end_many`]).
    End,
    /// Runners' reports on their assignments
    /// ([`crate::desktop::report_many`]).
    Report,
    /// Desktop offers ([`crate::desktop::offer_many`]).
    Offer,
}

impl Joint {
    pub(super) const ALL: [Joint; 4] = [Joint::Move, Joint::End, Joint::Report, Joint::Offer];

    /// Its `kind` label.
    pub(super) fn name(self) -> &'static str {
        match self {
            Joint::Move => "move",
            Joint::End => "end",
            Joint::Report => "report",
            Joint::Offer => "offer",
        }
    }

    /// How many writes of this kind this process's batches made together.
    pub(super) fn counter(self) -> &'static AtomicU64 {
        static COUNTERS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
        &COUNTERS[self as usize]
    }
}

/// One job's row of a joined statement: its run and its values (a JSON
/// object the statement reads with `json_to_recordset`).
#[derive(Debug)]
pub(crate) struct Row {
    pub(crate) joint: Joint,
    pub(crate) run_id: String,
    pub(crate) value: serde_json::Value,
}

/// What a joined statement did with a job's row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Joined {
    /// The run moved (`true`), or its guard held it off.
    Moved(bool),
    /// The run ended; its automation is in this state.
    Ended(AutomationState),
    /// The report applied and left the assignment so; `None` when its
    /// guard did not hold.
    Reported(Option<crate::signal::AssignmentState>),
    /// The offer was made (`true`), or the run was offered already.
    Offered(bool),
}

/// Makes the batch's joinable rows, each kind in one statement, and
/// answers their jobs: only rows of runs no other job of the batch writes
/// (so a run's writes keep their order), and only kinds with several
/// rows. A job the statement gives no answer (an end whose guard did not
/// hold) is left to run as alone, and says why.
pub(super) async fn joined_at_once(
    tx: &mut AnyConnection,
    batch: &[Pending],
    answers: &mut [Option<Answer>],
    notes: &mut Vec<DesktopNote>,
) -> Result<()> {
    let rows = joinable(batch, answers);
    for joint in Joint::ALL {
        let of_kind: Vec<&(usize, Row)> = rows.iter().filter(|(_, r)| r.joint == joint).collect();
        if of_kind.len() < 2 {
            continue;
        }
        let made: Vec<&Row> = of_kind.iter().map(|(_, r)| r).collect();
        let mut done = make(tx, joint, &made).await?;
        for (i, row) in of_kind {
            if let Some(d) = done.remove(&row.run_id)
                && let Some(d) = batch[*i].job.joined(d)
            {
                answer(d, &mut answers[*i], notes)?;
                joint.counter().fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(())
}

/// Runs the joined statement of `joint` over `rows`: what it did with each
/// run's row (an end whose guard did not hold has none).
async fn make(
    tx: &mut AnyConnection,
    joint: Joint,
    rows: &[&Row],
) -> Result<std::collections::HashMap<String, Joined>> {
    let input = serde_json::Value::Array(rows.iter().map(|r| r.value.clone()).collect());
    let input = input.to_string();
    Ok(match joint {
        Joint::Move => {
            let made = crate::runs::advance_many(tx, input).await?;
            each(rows, |id| Joined::Moved(made.contains(id)))
        }
        Joint::End => crate::receipts::end_many(tx, input)
            .await?
            .into_iter()
            .map(|(id, state)| (id, Joined::Ended(state)))
            .collect(),
        Joint::Report => {
            let mut now = crate::desktop::report_many(tx, input).await?;
            each(rows, |id| Joined::Reported(now.remove(id)))
        }
        Joint::Offer => {
            let made = crate::desktop::offer_many(tx, input).await?;
            each(rows, |id| Joined::Offered(made.contains(id)))
        }
    })
}

/// Every row's answer, as `of` reads it from what the statement did.
fn each(
    rows: &[&Row],
    mut of: impl FnMut(&str) -> Joined,
) -> std::collections::HashMap<String, Joined> {
    rows.iter()
        .map(|r| (r.run_id.clone(), of(&r.run_id)))
        .collect()
}

/// The batch's unanswered jobs that can join a statement, with their
/// places: only jobs of runs no other job of the batch writes, so a run's
/// writes keep their order.
fn joinable(batch: &[Pending], answers: &[Option<Answer>]) -> Vec<(usize, Row)> {
    let mut jobs_of = std::collections::HashMap::<&str, usize>::new();
    for pending in batch {
        *jobs_of.entry(pending.job.key()).or_default() += 1;
    }
    batch
        .iter()
        .enumerate()
        .filter(|(i, p)| answers[*i].is_none() && jobs_of.get(p.job.key()) == Some(&1))
        .filter_map(|(i, p)| p.job.joined_row().map(|r| (i, r)))
        .collect()
}

/// Answers a job a joined statement made, keeping the note it asks for.
fn answer(done: Done, slot: &mut Option<Answer>, notes: &mut Vec<DesktopNote>) -> Result<()> {
    let (out, signal) = done?;
    notes.extend(signal);
    *slot = Some(Ok(out));
    Ok(())
}
