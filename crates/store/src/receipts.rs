//! Queries of receipts, the durable terminal record of a run. A run becomes
//! terminal, gets its receipt and its terminal status event in one
//! transaction: a process that dies after the commit leaves nothing to
//! finish, and one that dies before it leaves the run live, to be taken over.

use automesh_domain::{Price, Receipt, RunState, Usage};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::events::{append_in, status_event};
use futures_util::future::BoxFuture;
use sqlx::AnyConnection;

use crate::rows::{self, col, micros};
use crate::{Result, Store, StoreError};

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
    /// receipt, atomically. A run already terminal is left as it is
    /// (`IllegalTransition`), so a run has exactly one receipt.
    pub async fn finish_run(&self, receipt: &Receipt, now: DateTime<Utc>) -> Result<()> {
        self.finish(receipt, None, now).await
    }

    /// `finish_run`, only while `lease_owner` holds the run's lease: a
    /// coordinator that lost its lease cannot end a run another one drives.
    pub async fn finish_run_as(
        &self,
        receipt: &Receipt,
        lease_owner: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        self.finish(receipt, Some(lease_owner), now).await
    }

    async fn finish(
        &self,
        receipt: &Receipt,
        lease_owner: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        if !receipt.outcome.is_terminal() {
            return Err(StoreError::IllegalTransition {
                from: "live".into(),
                to: receipt.outcome.to_string(),
            });
        }
        let lease_owner = lease_owner.unwrap_or("").to_owned();
        let receipt = receipt.clone();
        self.writer().write(Finish { receipt, lease_owner, now }).await
    }

    /// Stores the receipt of a run that was created terminal (skipped or
    /// missed occurrences).
    pub async fn insert_receipt(&self, receipt: &Receipt) -> Result<()> {
        let mut tx = self.begin_write().await?;
        insert(&mut tx, receipt).await?;
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
    type Output = ();

    fn key(&self) -> &str {
        &self.receipt.run_id
    }

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            let r = &self.receipt;
            let end = (
                &r.run_id,
                r.outcome.as_str(),
                r.error_code.map(|c| c.as_str()),
                r.error_message.as_deref(),
                micros(self.now),
                self.lease_owner.as_str(),
            );
            if !rows::changed_one(&mut *db, crate::runs::END, end).await? {
                let state = rows::optional(&mut *db, CURRENT_STATE, (&r.run_id,), |row| {
                    col::<String>(row, "state")
                });
                return Err(match state.await? {
                    None => StoreError::NotFound,
                    Some(from) => StoreError::IllegalTransition {
                        from,
                        to: r.outcome.to_string(),
                    },
                });
            }
            insert(db, r).await
        })
    }
}

pub(crate) async fn insert(tx: &mut AnyConnection, r: &Receipt) -> Result<()> {
    let terminal: RunState = r.outcome;
    let params = (
        &r.run_id,
        terminal.as_str(),
        r.error_code.map(|c| c.as_str()),
        r.error_message.as_deref(),
        r.placement.as_str(),
        r.engine.as_deref(),
        r.queued_micros,
        r.wake_micros,
        r.admission_micros,
        r.execution_micros,
        r.usage.input_tokens,
        r.usage.output_tokens,
        r.usage.cost_micros,
        r.worker_id.as_deref(),
        r.workspace_id.as_deref(),
        r.thread_id.as_deref(),
        r.message_id.as_deref(),
        micros(r.created_at),
        r.model.as_deref(),
        r.provider_model.as_deref(),
        r.price.map(|p| p.input_micros_per_million_tokens),
        r.price.map(|p| p.output_micros_per_million_tokens),
    );
    if rows::changed_one(&mut *tx, INSERT, params).await? {
        // The run's end, in its event log, commits with its receipt.
        let event = status_event(terminal, r.error_code, r.error_message.as_deref());
        append_in(tx, &r.run_id, &[event], r.created_at).await?;
    }
    Ok(())
}

impl crate::Internal<'_> {
    /// The receipt of a run, once it has one.
    pub async fn receipt(self, run_id: &str) -> Result<Option<Receipt>> {
        crate::rows::optional(self.db(), GET, (run_id,), decode).await
    }
}
