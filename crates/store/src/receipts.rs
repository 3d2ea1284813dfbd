//! Queries of receipts, the durable terminal record of a run. A run becomes
//! terminal, gets its receipt and its terminal status event in one
//! transaction: a process that dies after the commit leaves nothing to
//! finish, and one that dies before it leaves the run live, to be taken over.

use automesh_domain::{AutomationState, Price, Receipt, RunState, Usage};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::events::{append_in, status_event};
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use crate::rows::{self, col, micros};
use crate::writer::{Joined, Joint, Row};
use crate::{Result, Store, StoreError};

/// A receipt's columns from `placement` to its price, as query parameters
/// between `before` and `after`: the one list both ways of writing a
/// receipt bind.
macro_rules! receipt_params {
    ($r:expr; $($before:expr),* ; $($after:expr),*) => {
        (
            $($before,)*
            $r.placement.as_str(),
            $r.engine.as_deref(),
            $r.queued_micros,
            $r.wake_micros,
            $r.admission_micros,
            $r.execution_micros,
            $r.usage.input_tokens,
            $r.usage.output_tokens,
            $r.usage.cost_micros,
            $r.worker_id.as_deref(),
            $r.workspace_id.as_deref(),
            $r.thread_id.as_deref(),
            $r.message_id.as_deref(),
            micros($r.created_at),
            $r.model.as_deref(),
            $r.provider_model.as_deref(),
            $r.price.map(|p| p.input_micros_per_million_tokens),
            $r.price.map(|p| p.output_micros_per_million_tokens),
            $($after,)*
        )
    };
}

const INSERT: &str = "INSERT INTO receipts (run_id, outcome, error_code, error_message, placement, \
     engine, queued_us, wake_us, admission_us, execution_us, input_tokens, output_tokens, \
     cost_micros, worker_id, workspace_id, thread_id, message_id, created_at, model, \
     provider_model, price_input_micros_per_mtok, price_output_micros_per_mtok) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, \
     $19, $20, $21, $22) \
     ON CONFLICT (run_id) DO NOTHING";

/// The columns every receipt query reads, in `decode`'s terms.
macro_rules! receipt_columns {
    () => {
        "run_id, outcome, error_code, error_message, placement, engine, queued_us, \
         wake_us, admission_us, execution_us, input_tokens, output_tokens, cost_micros, worker_id, \
         workspace_id, thread_id, message_id, created_at, model, provider_model, \
         price_input_micros_per_mtok, price_output_micros_per_mtok"
    };
}
pub(crate) use receipt_columns;

const GET: &str = rows::select!(receipt_columns, "FROM receipts WHERE run_id = $1");

const CURRENT_STATE: &str = "SELECT state FROM runs WHERE id = $1";

const AUTOMATION_STATE: &str = "SELECT state FROM automations WHERE id = $1";

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
    rows::columns! { row => Receipt {
        run_id, outcome, error_code, error_message, placement, engine,
        queued_micros = "queued_us", wake_micros = "wake_us", admission_micros = "admission_us",
        execution_micros = "execution_us", worker_id, workspace_id, thread_id, message_id,
        created_at, model, provider_model;
        usage, price,
    } }
}

impl Store {
    /// Moves a live run to the receipt's terminal outcome and stores the
    /// receipt, atomically; answers with the state of the run's automation
    /// (what the outcome means for it is the caller's). A run already
    /// terminal is left as it is (`IllegalTransition`), so a run has
    /// exactly one receipt.
    pub async fn finish_run(
        &self,
        receipt: &Receipt,
        now: DateTime<Utc>,
    ) -> Result<AutomationState> {
        self.finish(receipt, None, now).await
    }

    /// `finish_run`, only while `lease_owner` holds the run's lease: a
    /// coordinator that lost its lease cannot end a run another one drives.
    pub async fn finish_run_as(
        &self,
        receipt: &Receipt,
        lease_owner: &str,
        now: DateTime<Utc>,
    ) -> Result<AutomationState> {
        self.finish(receipt, Some(lease_owner), now).await
    }

    async fn finish(
        &self,
        receipt: &Receipt,
        lease_owner: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<AutomationState> {
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
        created_terminal(&mut tx, receipt).await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Many runs' ends in one statement (PostgreSQL), each as
/// [`crate::runs::END_PG`] ends one: `$1` a JSON array of the ends, one per
/// run. Each run's guard is its own (live, and held by its lease owner
/// unless that is empty); its rows are locked in the order of their ids,
/// as the writer orders a batch. Answers, for each run that ended, its id
/// and its automation's state; a run whose guard did not hold is left as
/// it is (its job then runs alone, and says why).
const END_MANY_PG: &str = concat!(
    "WITH input AS (SELECT * FROM json_to_recordset($1::json) AS i(id TEXT, state TEXT, \
       error_code TEXT, error_message TEXT, at BIGINT, lease_owner TEXT, placement TEXT, \
       engine TEXT, queued_us BIGINT, wake_us BIGINT, admission_us BIGINT, execution_us BIGINT, \
       input_tokens BIGINT, output_tokens BIGINT, cost_micros BIGINT, worker_id TEXT, \
       workspace_id TEXT, thread_id TEXT, message_id TEXT, created_at BIGINT, model TEXT, \
       provider_model TEXT, price_in BIGINT, price_out BIGINT, event_id TEXT, kind TEXT, \
       payload TEXT)), \
     locked AS MATERIALIZED (SELECT id FROM runs WHERE id IN (SELECT id FROM input) \
       ORDER BY id COLLATE \"C\" FOR UPDATE), \
     ended AS (UPDATE runs r SET state = i.state, error_code = i.error_code, \
       error_message = i.error_message, updated_at = i.at, \
       last_event_seq = r.last_event_seq + 1 \
       FROM input i WHERE r.id = i.id AND r.id IN (SELECT id FROM locked) AND r.state IN ",
    crate::runs::live_states!(),
    " AND (i.lease_owner = '' OR r.lease_owner = i.lease_owner) \
       RETURNING r.id, r.last_event_seq, r.automation_id), \
     receipt AS (INSERT INTO receipts (run_id, outcome, error_code, error_message, placement, \
       engine, queued_us, wake_us, admission_us, execution_us, input_tokens, output_tokens, \
       cost_micros, worker_id, workspace_id, thread_id, message_id, created_at, model, \
       provider_model, price_input_micros_per_mtok, price_output_micros_per_mtok) \
       SELECT i.id, i.state, i.error_code, i.error_message, i.placement, i.engine, i.queued_us, \
       i.wake_us, i.admission_us, i.execution_us, i.input_tokens, i.output_tokens, \
       i.cost_micros, i.worker_id, i.workspace_id, i.thread_id, i.message_id, i.created_at, \
       i.model, i.provider_model, i.price_in, i.price_out \
       FROM ended e JOIN input i ON i.id = e.id ON CONFLICT (run_id) DO NOTHING), \
     events AS (INSERT INTO run_events (run_id, seq, event_id, kind, payload, created_at) \
       SELECT e.id, e.last_event_seq, i.event_id, i.kind, i.payload, i.created_at \
       FROM ended e JOIN input i ON i.id = e.id) \
     SELECT e.id, a.state AS automation_state FROM ended e JOIN automations a \
       ON a.id = e.automation_id"
);

/// Makes the ends of `input` (a JSON array of [`Finish`]'s joined rows, of
/// distinct runs) in one statement (PostgreSQL): the runs that ended, each
/// with its automation's state.
pub(crate) async fn end_many(
    db: &mut AnyConnection,
    input: String,
) -> Result<std::collections::HashMap<String, AutomationState>> {
    let ended = rows::all(db, END_MANY_PG, (input,), |r| {
        Ok((
            col::<String>(r, "id")?,
            col::<AutomationState>(r, "automation_state")?,
        ))
    });
    Ok(ended.await?.into_iter().collect())
}

/// A run's end: its terminal state, its receipt and its terminal event, in
/// one transaction, fenced by the lease owner (none when empty).
struct Finish {
    receipt: Receipt,
    lease_owner: String,
    now: DateTime<Utc>,
}

impl crate::writer::Job for Finish {
    type Output = AutomationState;

    fn key(&self) -> &str {
        &self.receipt.run_id
    }

    /// The end as one row of [`END_MANY_PG`], with the same values
    /// [`crate::runs::END_PG`] binds.
    fn joined_row(&self) -> Option<Row> {
        let r = &self.receipt;
        let event = status_event(r.outcome, r.error_code, r.error_message.as_deref());
        let (event_id, kind, payload) = crate::events::columns(&event).ok()?;
        Some(Row {
            joint: Joint::End,
            run_id: r.run_id.clone(),
            value: serde_json::json!({
                "id": r.run_id,
                "state": r.outcome.as_str(),
                "error_code": r.error_code.map(|c| c.as_str()),
                "error_message": r.error_message,
                "at": micros(self.now),
                "lease_owner": self.lease_owner,
                "placement": r.placement.as_str(),
                "engine": r.engine,
                "queued_us": r.queued_micros,
                "wake_us": r.wake_micros,
                "admission_us": r.admission_micros,
                "execution_us": r.execution_micros,
                "input_tokens": r.usage.input_tokens,
                "output_tokens": r.usage.output_tokens,
                "cost_micros": r.usage.cost_micros,
                "worker_id": r.worker_id,
                "workspace_id": r.workspace_id,
                "thread_id": r.thread_id,
                "message_id": r.message_id,
                "created_at": micros(r.created_at),
                "model": r.model,
                "provider_model": r.provider_model,
                "price_in": r.price.map(|p| p.input_micros_per_million_tokens),
                "price_out": r.price.map(|p| p.output_micros_per_million_tokens),
                "event_id": event_id,
                "kind": kind,
                "payload": payload,
            }),
        })
    }

    fn joined(&self, done: Joined) -> Option<AutomationState> {
        let Joined::Ended(automation) = done else {
            return None;
        };
        Some(automation)
    }

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Result<AutomationState>> {
        Box::pin(async move {
            let r = &self.receipt;
            let event = status_event(r.outcome, r.error_code, r.error_message.as_deref());
            let automation = if rows::is_postgres(db) {
                let (id, kind, payload) = crate::events::columns(&event)?;
                let params = self.end_params();
                let params = receipt_params!(
                    r;
                    params.0, params.1, params.2, params.3, params.4, params.5;
                    id, kind, payload
                );
                let ended = rows::optional(&mut *db, crate::runs::END_PG, params, |row| {
                    col::<AutomationState>(row, "automation_state")
                });
                ended.await?
            } else {
                let ended = rows::optional(&mut *db, crate::runs::END, self.end_params(), |row| {
                    Ok((
                        col::<i64>(row, "last_event_seq")?,
                        col::<String>(row, "automation_id")?,
                    ))
                });
                match ended.await? {
                    Some((seq, automation_id)) => {
                        // The run's end, in its event log, commits with its
                        // receipt.
                        insert(&mut *db, r).await?;
                        crate::events::insert(&mut *db, &r.run_id, seq, &event, r.created_at)
                            .await?;
                        let state =
                            rows::optional(&mut *db, AUTOMATION_STATE, (automation_id,), |row| {
                                col::<AutomationState>(row, "state")
                            });
                        state.await?
                    }
                    None => None,
                }
            };
            match automation {
                Some(state) => Ok(state),
                None => Err(self.refusal(db).await),
            }
        })
    }
}

impl Finish {
    /// The parameters of [`crate::runs::END`].
    fn end_params(
        &self,
    ) -> (
        &str,
        &'static str,
        Option<&'static str>,
        Option<&str>,
        i64,
        &str,
    ) {
        let r = &self.receipt;
        (
            &r.run_id,
            r.outcome.as_str(),
            r.error_code.map(|c| c.as_str()),
            r.error_message.as_deref(),
            micros(self.now),
            self.lease_owner.as_str(),
        )
    }

    /// Why the run did not end: it is missing, or no longer live (or no
    /// longer this lease's).
    async fn refusal(&self, db: &mut AnyConnection) -> StoreError {
        let run_id = &self.receipt.run_id;
        let state = rows::optional(db, CURRENT_STATE, (run_id,), |row| {
            col::<String>(row, "state")
        });
        match state.await {
            Ok(None) => StoreError::NotFound,
            Ok(Some(from)) => StoreError::IllegalTransition {
                from,
                to: self.receipt.outcome.to_string(),
            },
            Err(e) => e,
        }
    }
}

/// The receipt of a run created terminal, and its terminal event.
pub(crate) async fn created_terminal(tx: &mut AnyConnection, r: &Receipt) -> Result<()> {
    if insert(&mut *tx, r).await? {
        let event = status_event(r.outcome, r.error_code, r.error_message.as_deref());
        append_in(tx, &r.run_id, &[event], r.created_at).await?;
    }
    Ok(())
}

/// Inserts the receipt unless the run has one; true when it did.
async fn insert(tx: &mut AnyConnection, r: &Receipt) -> Result<bool> {
    let terminal: RunState = r.outcome;
    let params = receipt_params!(
        r;
        &r.run_id, terminal.as_str(), r.error_code.map(|c| c.as_str()), r.error_message.as_deref();
    );
    rows::changed_one(&mut *tx, INSERT, params).await
}

impl crate::Internal<'_> {
    /// The receipt of a run, once it has one.
    pub async fn receipt(self, run_id: &str) -> Result<Option<Receipt>> {
        crate::rows::optional(self.db(), GET, (run_id,), decode).await
    }
}
