//! Queries of receipts, the durable terminal record of a run. A run becomes
//! terminal, gets its receipt and its terminal status event in one
//! transaction: a process that dies after the commit leaves nothing to
//! finish, and one that dies before it leaves the run live, to be taken over.

use std::collections::{HashMap, HashSet};

use automesh_domain::{AutomationState, ErrorCode, Price, Receipt, RunState, Usage};
use chrono::{DateTime, Utc};
use const_format::concatcp;
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use crate::automations::RunEnd;
use crate::events::status_event;
use crate::rows::{self, col, micros};
use crate::runs::IdRow;
use crate::sql::{Bulk, Input, bulk};
use crate::{Result, Store, StoreError};

bulk! {
    /// A receipt as stored: its fields are its columns.
    struct ReceiptRow {
        run_id: String => TEXT,
        outcome: &'static str => TEXT,
        error_code: Option<&'static str> => TEXT,
        error_message: Option<String> => TEXT,
        placement: &'static str => TEXT,
        engine: Option<String> => TEXT,
        queued_us: i64 => BIGINT,
        wake_us: i64 => BIGINT,
        admission_us: i64 => BIGINT,
        execution_us: i64 => BIGINT,
        input_tokens: i64 => BIGINT,
        output_tokens: i64 => BIGINT,
        cost_micros: i64 => BIGINT,
        worker_id: Option<String> => TEXT,
        workspace_id: Option<String> => TEXT,
        thread_id: Option<String> => TEXT,
        message_id: Option<String> => TEXT,
        created_at: i64 => BIGINT,
        model: Option<String> => TEXT,
        provider_model: Option<String> => TEXT,
        price_input_micros_per_mtok: Option<i64> => BIGINT,
        price_output_micros_per_mtok: Option<i64> => BIGINT,
        max_cost_micros: Option<i64> => BIGINT,
        max_tokens: Option<i64> => BIGINT,
    }
}

impl ReceiptRow {
    fn of(r: &Receipt) -> ReceiptRow {
        ReceiptRow {
            run_id: r.run_id.clone(),
            outcome: r.outcome.as_str(),
            error_code: r.error_code.map(|c| c.as_str()),
            error_message: r.error_message.clone(),
            placement: r.placement.as_str(),
            engine: r.engine.clone(),
            queued_us: r.queued_micros,
            wake_us: r.wake_micros,
            admission_us: r.admission_micros,
            execution_us: r.execution_micros,
            input_tokens: r.usage.input_tokens,
            output_tokens: r.usage.output_tokens,
            cost_micros: r.usage.cost_micros,
            worker_id: r.worker_id.clone(),
            workspace_id: r.workspace_id.clone(),
            thread_id: r.thread_id.clone(),
            message_id: r.message_id.clone(),
            created_at: micros(r.created_at),
            model: r.model.clone(),
            provider_model: r.provider_model.clone(),
            price_input_micros_per_mtok: r.price.map(|p| p.input_micros_per_million_tokens),
            price_output_micros_per_mtok: r.price.map(|p| p.output_micros_per_million_tokens),
            max_cost_micros: r.budget.max_cost_micros,
            max_tokens: r.budget.max_tokens,
        }
    }
}

/// The columns every receipt query reads, in `decode`'s terms.
pub(crate) const RECEIPT_COLUMNS: &str = <ReceiptRow as Input>::COLUMNS;

/// Receipts, each unless its run has one: the runs given one.
const INSERT: Bulk<ReceiptRow> = bulk!(ReceiptRow => [
    "INSERT INTO receipts (", RECEIPT_COLUMNS, ") SELECT i.* FROM "
] [
    " WHERE true ON CONFLICT (run_id) DO NOTHING RETURNING run_id"
]);

const GET: &str = concatcp!(
    "SELECT ",
    RECEIPT_COLUMNS,
    " FROM receipts WHERE run_id = $1"
);

bulk! {
    /// A live run's end: its terminal state, fenced by its lease owner
    /// (none when empty).
    struct EndRow {
        id: String => TEXT,
        state: &'static str => TEXT,
        error_code: Option<&'static str> => TEXT,
        error_message: Option<String> => TEXT,
        at: i64 => BIGINT,
        lease_owner: String => TEXT,
    }
}

/// Live runs' ends, each taking the number of its terminal event: the runs
/// that ended, each with that number and its automation's state.
const END: Bulk<EndRow> = bulk!(EndRow => [
    "UPDATE runs SET state = i.state, error_code = i.error_code, \
     error_message = i.error_message, updated_at = i.at, \
     last_event_seq = runs.last_event_seq + 1 FROM "
] [
    " WHERE runs.id = i.id AND runs.state IN ", crate::runs::LIVE_STATES,
    " AND (i.lease_owner = '' OR runs.lease_owner = i.lease_owner) \
     RETURNING runs.id, runs.last_event_seq, runs.automation_id, \
     (SELECT a.state FROM automations a WHERE a.id = runs.automation_id) AS automation_state, \
     (SELECT a.failure_streak FROM automations a WHERE a.id = runs.automation_id) AS failure_streak"
]);

/// What a run's end did to its automation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AfterRun {
    /// Its state once the run ended.
    pub state: AutomationState,
    /// Why it needs attention, when this run's end moved it there.
    pub paused: Option<ErrorCode>,
    /// Whether this run's end made it active again.
    pub resumed: bool,
    /// Its consecutive failed or timed-out runs once the run ended.
    pub failure_streak: i64,
}

pub(crate) fn decode(row: &AnyRow) -> Result<Receipt> {
    let usage: Result<Usage> = rows::columns! { row => Usage {
        input_tokens, output_tokens, cost_micros,
    } };
    let usage = usage?;
    let input: Option<i64> = col(row, "price_input_micros_per_mtok")?;
    let output: Option<i64> = col(row, "price_output_micros_per_mtok")?;
    let price = input.zip(output).map(|(input, output)| Price {
        input_micros_per_million_tokens: input,
        output_micros_per_million_tokens: output,
    });
    let budget = rows::budget(row)?;
    rows::columns! { row => Receipt {
        run_id, outcome, error_code, error_message, placement, engine,
        queued_micros = "queued_us", wake_micros = "wake_us", admission_micros = "admission_us",
        execution_micros = "execution_us", worker_id, workspace_id, thread_id, message_id,
        created_at, model, provider_model;
        usage, price, budget,
    } }
}

impl Store {
    /// Moves a live run to the receipt's terminal outcome and stores the
    /// receipt, atomically, with what the outcome means for the run's
    /// automation (its failure streak, needs-attention or active again:
    /// [`Automation::after_run`](automesh_domain::Automation::after_run)),
    /// which it answers. A run already terminal is left as it is
    /// (`IllegalTransition`), so a run has exactly one receipt.
    pub async fn finish_run(&self, receipt: &Receipt, now: DateTime<Utc>) -> Result<AfterRun> {
        self.finish(receipt, None, now).await
    }

    /// `finish_run`, only while `lease_owner` holds the run's lease: a
    /// coordinator that lost its lease cannot end a run another one drives.
    pub async fn finish_run_as(
        &self,
        receipt: &Receipt,
        lease_owner: &str,
        now: DateTime<Utc>,
    ) -> Result<AfterRun> {
        self.finish(receipt, Some(lease_owner), now).await
    }

    async fn finish(
        &self,
        receipt: &Receipt,
        lease_owner: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<AfterRun> {
        if !receipt.outcome.is_terminal() {
            return Err(StoreError::IllegalTransition {
                from: "live".into(),
                to: receipt.outcome.to_string(),
            });
        }
        let lease_owner = lease_owner.unwrap_or("").to_owned();
        let receipt = receipt.clone();
        self.writer()
            .write(Finish {
                receipt,
                lease_owner,
                now,
            })
            .await
    }

    /// Stores the receipt of a run that was created terminal (skipped or
    /// missed occurrences).
    pub async fn insert_receipt(&self, receipt: &Receipt) -> Result<()> {
        let mut tx = self.begin_write().await?;
        created_terminal(&mut tx, std::slice::from_ref(receipt)).await?;
        tx.commit().await?;
        Ok(())
    }
}

/// A run's end: its terminal state, its receipt, its terminal event and
/// what it does to its automation, in one transaction, fenced by the lease
/// owner (none when empty).
struct Finish {
    receipt: Receipt,
    lease_owner: String,
    now: DateTime<Utc>,
}

/// Whether a run's end (`outcome`) may move its automation, whose `state`
/// and failure `streak` END read: a failure always counts; a success only
/// ends a streak or a needs-attention; nothing else moves it.
fn may_move(outcome: RunState, state: AutomationState, streak: i64) -> bool {
    match outcome {
        RunState::Failed | RunState::TimedOut => true,
        RunState::Succeeded => streak > 0 || state == AutomationState::NeedsAttention,
        _ => false,
    }
}

/// A run ended by END: its terminal event's number, its automation, and
/// that automation's state and failure streak as END read them.
struct Ended {
    seq: i64,
    automation_id: String,
    state: AutomationState,
    streak: i64,
}

impl crate::writer::Job for Finish {
    type Output = AfterRun;

    fn key(&self) -> &str {
        &self.receipt.run_id
    }

    /// Three statements for every job: the runs ended (each by its own
    /// guard), their receipts, their terminal events; and, when a run's end
    /// moves its automation (a failure, or a success that ends a streak or
    /// a needs-attention), the automations locked, read and written. A run
    /// its guard refused is answered with why.
    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<AfterRun>>>> {
        Box::pin(async move {
            let ends: Vec<EndRow> = jobs
                .iter()
                .map(|j| {
                    let r = &j.receipt;
                    EndRow {
                        id: r.run_id.clone(),
                        state: r.outcome.as_str(),
                        error_code: r.error_code.map(|c| c.as_str()),
                        error_message: r.error_message.clone(),
                        at: micros(j.now),
                        lease_owner: j.lease_owner.clone(),
                    }
                })
                .collect();
            let ended = END.all(&mut *db, &ends, |r| {
                let ended = Ended {
                    seq: col(r, "last_event_seq")?,
                    automation_id: col(r, "automation_id")?,
                    state: col(r, "automation_state")?,
                    streak: col(r, "failure_streak")?,
                };
                Ok((col::<String>(r, "id")?, ended))
            });
            let ended: HashMap<String, Ended> = ended.await?.into_iter().collect();
            let (mut receipts, mut events, mut refused) = (vec![], vec![], vec![]);
            for job in jobs {
                let r = &job.receipt;
                match ended.get(&r.run_id).map(|e| e.seq) {
                    Some(seq) => {
                        receipts.push(ReceiptRow::of(r));
                        // The run's end, in its event log, commits with its
                        // receipt.
                        let event =
                            status_event(r.outcome, r.error_code, r.error_message.as_deref());
                        events.push(crate::events::row(&r.run_id, seq, &event, r.created_at)?);
                    }
                    None => refused.push(r.run_id.as_str()),
                }
            }
            INSERT.execute(&mut *db, &receipts).await?;
            crate::events::INSERT.execute(&mut *db, &events).await?;
            // The ends that move their automations, in the order the runs
            // ended.
            let mut moving: Vec<(&Receipt, &Ended)> = jobs
                .iter()
                .filter_map(|j| Some((&j.receipt, ended.get(&j.receipt.run_id)?)))
                .filter(|(r, e)| may_move(r.outcome, e.state, e.streak))
                .collect();
            moving.sort_by_key(|(r, _)| r.created_at);
            let moves: Vec<RunEnd<'_>> = moving
                .iter()
                .map(|(r, e)| RunEnd {
                    run_id: &r.run_id,
                    automation_id: &e.automation_id,
                    outcome: r.outcome,
                    code: r.error_code,
                    message: r.error_message.as_deref(),
                })
                .collect();
            let now = jobs.iter().map(|j| j.now).max().unwrap_or_else(Utc::now);
            let standing = crate::automations::after_runs(&mut *db, &moves, now).await?;
            let outcome = |id: &str| {
                let job = jobs.iter().find(|j| j.receipt.run_id == id);
                job.map(|j| j.receipt.outcome.to_string())
                    .unwrap_or_default()
            };
            let mut refusals = crate::runs::refusals(&mut *db, &refused, outcome).await?;
            Ok(jobs
                .iter()
                .map(|job| match ended.get(&job.receipt.run_id) {
                    Some(e) => Ok(match standing.get(&e.automation_id) {
                        Some((a, changed)) => AfterRun {
                            state: a.state,
                            paused: (*changed && a.state != e.state)
                                .then(|| a.attention.as_ref().map(|x| x.reason))
                                .flatten(),
                            resumed: *changed
                                && a.state == AutomationState::Active
                                && e.state == AutomationState::NeedsAttention,
                            failure_streak: a.failure_streak.runs,
                        },
                        None => AfterRun {
                            state: e.state,
                            paused: None,
                            resumed: false,
                            failure_streak: e.streak,
                        },
                    }),
                    None => Err(refusals
                        .remove(&job.receipt.run_id)
                        .unwrap_or(StoreError::NotFound)),
                })
                .collect())
        })
    }
}

/// The receipts of runs created terminal, and their terminal events
/// (nothing for a run that has a receipt already).
pub(crate) async fn created_terminal(tx: &mut AnyConnection, receipts: &[Receipt]) -> Result<()> {
    let rows: Vec<ReceiptRow> = receipts.iter().map(ReceiptRow::of).collect();
    let given = INSERT.all(&mut *tx, &rows, |r| col::<String>(r, "run_id"));
    let given: HashSet<String> = given.await?.into_iter().collect();
    let ids: Vec<IdRow> = given.iter().map(|id| IdRow::of(id)).collect();
    let last = crate::runs::LAST_EVENT_SEQ.all(&mut *tx, &ids, |r| {
        Ok((col::<String>(r, "id")?, col::<i64>(r, "last_event_seq")?))
    });
    let last: HashMap<String, i64> = last.await?.into_iter().collect();
    let mut events = vec![];
    for r in receipts.iter().filter(|r| given.contains(&r.run_id)) {
        let seq = last.get(&r.run_id).copied().unwrap_or_default() + 1;
        let event = status_event(r.outcome, r.error_code, r.error_message.as_deref());
        events.push(crate::events::row(&r.run_id, seq, &event, r.created_at)?);
    }
    crate::events::INSERT.execute(&mut *tx, &events).await?;
    crate::events::SET_LAST_SEQ
        .execute(&mut *tx, &events)
        .await?;
    Ok(())
}

impl crate::Internal<'_> {
    /// The receipt of a run, once it has one.
    pub async fn receipt(self, run_id: &str) -> Result<Option<Receipt>> {
        crate::rows::optional(self.db(), GET, (run_id,), decode).await
    }
}
