//! Queries of receipts, the durable terminal record of a run. A run becomes
//! terminal, gets its receipt and its terminal status event in one
//! transaction: a process that dies after the commit leaves nothing to
//! finish, and one that dies before it leaves the run live, to be taken over.

use automesh_domain::{ErrorCode, Price, Receipt, Run, RunState, Usage};
use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;

use crate::events::{append_in, status_event};
use crate::rows::{instant, int, micros, opt_int, opt_parsed, opt_text, parsed, text};
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
    Ok(Receipt {
        run_id: text(row, "run_id")?,
        outcome: parsed(row, "outcome")?,
        error_code: opt_parsed::<ErrorCode>(row, "error_code")?,
        error_message: opt_text(row, "error_message")?,
        placement: parsed(row, "placement")?,
        engine: opt_text(row, "engine")?,
        queued_micros: int(row, "queued_us")?,
        wake_micros: int(row, "wake_us")?,
        admission_micros: int(row, "admission_us")?,
        execution_micros: int(row, "execution_us")?,
        usage: Usage {
            input_tokens: int(row, "input_tokens")?,
            output_tokens: int(row, "output_tokens")?,
            cost_micros: int(row, "cost_micros")?,
        },
        worker_id: opt_text(row, "worker_id")?,
        workspace_id: opt_text(row, "workspace_id")?,
        thread_id: opt_text(row, "thread_id")?,
        message_id: opt_text(row, "message_id")?,
        created_at: instant(row, "created_at")?,
        model: opt_text(row, "model")?,
        provider_model: opt_text(row, "provider_model")?,
        price: match (
            opt_int(row, "price_input_micros_per_mtok")?,
            opt_int(row, "price_output_micros_per_mtok")?,
        ) {
            (Some(input), Some(output)) => Some(Price {
                input_micros_per_million_tokens: input,
                output_micros_per_million_tokens: output,
            }),
            _ => None,
        },
    })
}

impl Store {
    /// Moves a live run to the receipt's terminal outcome and stores the
    /// receipt, atomically. A run already terminal is left as it is
    /// (`IllegalTransition`), so a run has exactly one receipt.
    pub async fn finish_run(&self, receipt: &Receipt, now: DateTime<Utc>) -> Result<Run> {
        self.finish(receipt, None, now).await
    }

    /// `finish_run`, only while `lease_owner` holds the run's lease: a
    /// coordinator that lost its lease cannot end a run another one drives.
    pub async fn finish_run_as(
        &self,
        receipt: &Receipt,
        lease_owner: &str,
        now: DateTime<Utc>,
    ) -> Result<Run> {
        self.finish(receipt, Some(lease_owner), now).await
    }

    async fn finish(
        &self,
        receipt: &Receipt,
        lease_owner: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<Run> {
        if !receipt.outcome.is_terminal() {
            return Err(StoreError::IllegalTransition {
                from: "live".into(),
                to: receipt.outcome.to_string(),
            });
        }
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(crate::runs::END)
            .bind(&receipt.run_id)
            .bind(receipt.outcome.as_str())
            .bind(receipt.error_code.map(|c| c.as_str()))
            .bind(receipt.error_message.as_deref())
            .bind(micros(now))
            .bind(lease_owner.unwrap_or(""))
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() != 1 {
            let state: Option<String> = sqlx::query_scalar(CURRENT_STATE)
                .bind(&receipt.run_id)
                .fetch_optional(&mut *tx)
                .await?;
            tx.rollback().await?;
            return Err(match state {
                None => StoreError::NotFound,
                Some(from) => StoreError::IllegalTransition {
                    from,
                    to: receipt.outcome.to_string(),
                },
            });
        }
        insert(&mut tx, receipt).await?;
        tx.commit().await?;
        self.internal().get_run(&receipt.run_id).await
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

pub(crate) async fn insert(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    r: &Receipt,
) -> Result<()> {
    let terminal: RunState = r.outcome;
    let done = sqlx::query(INSERT)
        .bind(&r.run_id)
        .bind(terminal.as_str())
        .bind(r.error_code.map(|c| c.as_str()))
        .bind(r.error_message.as_deref())
        .bind(r.placement.as_str())
        .bind(r.engine.as_deref())
        .bind(r.queued_micros)
        .bind(r.wake_micros)
        .bind(r.admission_micros)
        .bind(r.execution_micros)
        .bind(r.usage.input_tokens)
        .bind(r.usage.output_tokens)
        .bind(r.usage.cost_micros)
        .bind(r.worker_id.as_deref())
        .bind(r.workspace_id.as_deref())
        .bind(r.thread_id.as_deref())
        .bind(r.message_id.as_deref())
        .bind(micros(r.created_at))
        .bind(r.model.as_deref())
        .bind(r.provider_model.as_deref())
        .bind(r.price.map(|p| p.input_micros_per_million_tokens))
        .bind(r.price.map(|p| p.output_micros_per_million_tokens))
        .execute(&mut **tx)
        .await?;
    if done.rows_affected() == 1 {
        // The run's end, in its event log, commits with its receipt.
        let event = status_event(terminal, r.error_code, r.error_message.as_deref());
        append_in(tx, &r.run_id, &[event], r.created_at).await?;
    }
    Ok(())
}

impl crate::Internal<'_> {
    /// The receipt of a run, once it has one.
    pub async fn receipt(self, run_id: &str) -> Result<Option<Receipt>> {
        crate::rows::maybe(self.db(), GET, run_id, decode).await
    }
}
