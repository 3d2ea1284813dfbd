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

const GET: &str = "SELECT run_id, outcome, error_code, error_message, placement, engine, queued_us, \
     wake_us, admission_us, execution_us, input_tokens, output_tokens, cost_micros, worker_id, \
     workspace_id, thread_id, message_id, created_at, model, provider_model, \
     price_input_micros_per_mtok, price_output_micros_per_mtok FROM receipts WHERE run_id = $1";

const CURRENT_STATE: &str = "SELECT state FROM runs WHERE id = $1";

const AUTOMATION_STATE: &str = "SELECT state FROM automations WHERE id = $1";

fn decode(row: &AnyRow) -> Result<Receipt> {
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
