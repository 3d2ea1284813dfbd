//! Group commit: the hot-path writes of many runs — state moves, events,
//! receipts, desktop reports — committed together, one transaction per
//! batch instead of one per write.
//!
//! Each process's store has a few writer tasks (one on SQLite). A write is
//! a [`Job`]: its own guarded statements, exactly as it would run alone. A
//! writer takes every job waiting when it is free (nothing waits on a
//! timer: under no load a job commits at once, under load jobs pile up
//! while the batches before commit, and the batches grow), runs them in one transaction in
//! the order of their keys (a run's id: transactions of different
//! processes lock rows in one order, so they cannot deadlock), and
//! answers each job only after the commit. A batch is exactly as safe as
//! its jobs one by one: each job's guards and fencing are its own
//! statements, and a job that fails (having written part of what it
//! writes, perhaps) poisons only its batch, which is then rolled back and
//! run again one job per transaction: a job commits all of its writes or
//! none, and one bad write never fails another.
//!
//! On PostgreSQL the batch's single moves forward of runs (to admitted, to
//! running, each with its status event) are one statement for all of them,
//! each row still guarded by its own run's state; a run another job of the
//! batch also writes moves in its own statement, in order. Its ends of runs
//! (terminal state, receipt and event) are one statement the same way, each
//! row guarded as alone and locked in key order; an end whose guard does not
//! hold is left to its job, which runs as alone and says why.
//!
//! The desktop notes a batch's jobs ask for are sent (NOTIFY) inside the
//! batch's transaction, so they are delivered at its commit, packed into as
//! few payloads as they fit.
//!
//! On PostgreSQL a batch of one job that can be one statement (a desktop
//! offer: its insert and its NOTIFY in one statement) runs as that
//! statement alone, its own transaction: one round trip instead of four
//! (BEGIN, the write, NOTIFY, COMMIT), where an idle mesh's latency goes.
//! It is as safe: one statement commits all of its writes or none, and its
//! note is delivered at its commit, as a batch's are.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::future::BoxFuture;
use sqlx::{Any as AnyDb, AnyConnection, AnyPool, Transaction};
use tokio::sync::{mpsc, oneshot};

use automesh_domain::AutomationState;

use crate::signal::{DesktopNote, Topic};
use crate::{Backend, Result, StoreError};

/// Jobs one transaction takes at most.
const MAX_BATCH: usize = 256;

/// Writer tasks of a PostgreSQL store, each committing its own batches on
/// its own connection (a batch's statements are round trips in a row: one
/// writer alone would be bound by their latency). SQLite has one writer
/// at a time anyway.
const PG_WRITERS: usize = 4;

/// Jobs that may wait for the writer before a new one waits to be queued.
const QUEUE: usize = 4096;

/// One write committed with others: its statements, run on the batch's
/// connection inside its transaction. It may run twice (once in a batch
/// that is rolled back, then alone), so it must not act outside the
/// database.
pub(crate) trait Job: Send + Sync + 'static {
    type Output: Send + 'static;

    /// What orders the batch's jobs (the row the job locks first).
    fn key(&self) -> &str;

    /// What to tell the runner-gateway replicas once the job's writes
    /// commit, given what it did (nothing, unless a job says so).
    fn signal(&self, _done: &Self::Output) -> Option<DesktopNote> {
        None
    }

    /// The job as one run's single move forward, which a batch on
    /// PostgreSQL makes together with its other such moves, in one
    /// statement (none, unless a job says so).
    fn as_move(&self) -> Option<crate::runs::Move> {
        None
    }

    /// Its answer when its move was made (`made`) or its guard held it off,
    /// in a batch's statement of moves.
    fn moved(&self, _made: bool) -> Option<Self::Output> {
        None
    }

    /// The job as one run's end (its terminal state, receipt and event),
    /// which a batch on PostgreSQL makes together with its other ends, in
    /// one statement (none, unless a job says so).
    fn as_end(&self) -> Option<crate::receipts::End> {
        None
    }

    /// Its answer when its end was made, its run's automation in
    /// `automation` state, in a batch's statement of ends.
    fn ended(&self, _automation: AutomationState) -> Option<Self::Output> {
        None
    }

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Result<Self::Output>>;

    /// On PostgreSQL, whether the job can run as one statement that
    /// commits by itself ([`Job::run_alone`]).
    fn runs_alone(&self) -> bool {
        false
    }

    /// The job as one statement outside any transaction (so it commits by
    /// itself), sending the note [`Job::signal`] would ask for itself:
    /// exactly what `run` writes, then a NOTIFY at its commit.
    fn run_alone<'c>(
        &'c self,
        _db: &'c mut AnyConnection,
    ) -> Option<BoxFuture<'c, Result<Self::Output>>> {
        None
    }
}

type Answer = Result<Box<dyn Any + Send>>;

/// A job's answer and the signal it asks for.
type Done = Result<(Box<dyn Any + Send>, Option<DesktopNote>)>;

/// A job with its type erased, and where its answer goes.
struct Pending {
    job: Arc<dyn Erased>,
    answer: oneshot::Sender<Answer>,
}

trait Erased: Send + Sync {
    fn key(&self) -> &str;
    fn as_move(&self) -> Option<crate::runs::Move>;
    fn moved(&self, made: bool) -> Option<Done>;
    fn as_end(&self) -> Option<crate::receipts::End>;
    fn ended(&self, automation: AutomationState) -> Option<Done>;
    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Done>;
    fn runs_alone(&self) -> bool;
    fn run_alone<'c>(
        &'c self,
        db: &'c mut AnyConnection,
    ) -> Option<BoxFuture<'c, Result<Box<dyn Any + Send>>>>;
}

impl<J: Job> Erased for J {
    fn runs_alone(&self) -> bool {
        Job::runs_alone(self)
    }

    fn run_alone<'c>(
        &'c self,
        db: &'c mut AnyConnection,
    ) -> Option<BoxFuture<'c, Result<Box<dyn Any + Send>>>> {
        let alone = Job::run_alone(self, db)?;
        Some(Box::pin(async move {
            alone.await.map(|out| Box::new(out) as Box<dyn Any + Send>)
        }))
    }

    fn key(&self) -> &str {
        Job::key(self)
    }

    fn as_move(&self) -> Option<crate::runs::Move> {
        Job::as_move(self)
    }

    fn moved(&self, made: bool) -> Option<Done> {
        let out = Job::moved(self, made)?;
        let signal = self.signal(&out);
        Some(Ok((Box::new(out) as Box<dyn Any + Send>, signal)))
    }

    fn as_end(&self) -> Option<crate::receipts::End> {
        Job::as_end(self)
    }

    fn ended(&self, automation: AutomationState) -> Option<Done> {
        let out = Job::ended(self, automation)?;
        let signal = self.signal(&out);
        Some(Ok((Box::new(out) as Box<dyn Any + Send>, signal)))
    }

    fn run<'c>(&'c self, db: &'c mut AnyConnection) -> BoxFuture<'c, Done> {
        Box::pin(async move {
            let out = Job::run(self, db).await?;
            let signal = self.signal(&out);
            Ok((Box::new(out) as Box<dyn Any + Send>, signal))
        })
    }
}

/// The queue of one store's writer task.
#[derive(Debug, Clone)]
pub(crate) struct Writer {
    queue: mpsc::Sender<Pending>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("key", &self.job.key())
            .finish()
    }
}

impl Writer {
    /// The writers over `pool`; their tasks end once every handle is
    /// dropped.
    pub(crate) fn start(pool: AnyPool, backend: Backend) -> Writer {
        let (queue, jobs) = mpsc::channel(QUEUE);
        let jobs = Arc::new(tokio::sync::Mutex::new(jobs));
        let writers = match backend {
            Backend::Postgres => PG_WRITERS,
            Backend::Sqlite => 1,
        };
        for _ in 0..writers {
            let db = Db {
                pool: pool.clone(),
                backend,
            };
            tokio::spawn(write_loop(db, jobs.clone()));
        }
        Writer { queue }
    }

    /// Commits `job` with whatever else is waiting, and answers what it
    /// returned once its transaction committed.
    pub(crate) async fn write<J: Job>(&self, job: J) -> Result<J::Output> {
        let (answer, answered) = oneshot::channel();
        let pending = Pending {
            job: Arc::new(job),
            answer,
        };
        self.queue.send(pending).await.map_err(|_| gone())?;
        let out = answered.await.map_err(|_| gone())??;
        out.downcast::<J::Output>()
            .map(|out| *out)
            .map_err(|_| StoreError::Corrupt("a write answered with the wrong type".into()))
    }
}

fn gone() -> StoreError {
    StoreError::Database(sqlx::Error::PoolClosed)
}

/// What the writer task holds of its store: the pool, never a `Store`
/// (whose handles keep the task's queue open).
struct Db {
    pool: AnyPool,
    backend: Backend,
}

impl Db {
    async fn begin(&self) -> Result<Transaction<'static, AnyDb>> {
        Ok(match self.backend {
            Backend::Postgres => self.pool.begin().await?,
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
        })
    }
}

/// How many batches the writers of this process committed, and how many
/// jobs they held: the batching an operator sees in the metrics.
pub fn written() -> (u64, u64) {
    (
        BATCHES.load(Ordering::Relaxed),
        JOBS.load(Ordering::Relaxed),
    )
}

/// How many jobs the writers of this process ran alone, each one
/// statement that committed by itself.
pub fn written_alone() -> u64 {
    ALONE.load(Ordering::Relaxed)
}

static ALONE: AtomicU64 = AtomicU64::new(0);

/// How many runs' moves forward the writers of this process made together
/// with others, in one statement per batch.
pub fn moved_at_once() -> u64 {
    MOVED_AT_ONCE.load(Ordering::Relaxed)
}

static MOVED_AT_ONCE: AtomicU64 = AtomicU64::new(0);

/// How many runs' ends the writers of this process made together with
/// others, in one statement per batch.
pub fn ended_at_once() -> u64 {
    ENDED_AT_ONCE.load(Ordering::Relaxed)
}

static ENDED_AT_ONCE: AtomicU64 = AtomicU64::new(0);
static BATCHES: AtomicU64 = AtomicU64::new(0);
static JOBS: AtomicU64 = AtomicU64::new(0);

async fn write_loop(store: Db, jobs: Arc<tokio::sync::Mutex<mpsc::Receiver<Pending>>>) {
    loop {
        // One writer takes what waits; the others wait their turn.
        let batch = {
            let mut jobs = jobs.lock().await;
            let Some(first) = jobs.recv().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match jobs.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            batch
        };
        let mut batch = batch;
        // One lock order for every transaction: no deadlocks between
        // batches of different processes.
        batch.sort_by(|a, b| a.job.key().cmp(b.job.key()));
        BATCHES.fetch_add(1, Ordering::Relaxed);
        JOBS.fetch_add(batch.len() as u64, Ordering::Relaxed);
        match commit(&store, &batch).await {
            Ok(answers) => {
                for (pending, answer) in batch.into_iter().zip(answers) {
                    let _ = pending.answer.send(answer);
                }
            }
            Err(Poisoned(_)) => {
                // One job failed: every job again, alone, so only that one
                // fails.
                for pending in batch {
                    let answer = match commit(&store, std::slice::from_ref(&pending)).await {
                        Ok(mut answers) => answers.pop().unwrap_or_else(|| Err(gone())),
                        Err(Poisoned(error)) => Err(error),
                    };
                    let _ = pending.answer.send(answer);
                }
            }
        }
    }
}

/// A batch one of whose jobs failed, with its error; nothing of the batch
/// was committed.
struct Poisoned(StoreError);

/// Runs `batch` in one transaction: each job's answer once it committed,
/// an error for every job when the transaction could not commit, or
/// `Poisoned` when a job's statement failed.
async fn commit(store: &Db, batch: &[Pending]) -> std::result::Result<Vec<Answer>, Poisoned> {
    let failed_all = |e: &StoreError| -> Vec<Answer> {
        batch
            .iter()
            .map(|_| Err(StoreError::Database(copy_error(e))))
            .collect()
    };
    if let [only] = batch
        && store.backend == Backend::Postgres
        && only.job.runs_alone()
    {
        let mut db = match store.pool.acquire().await {
            Ok(db) => db,
            Err(e) => return Ok(failed_all(&StoreError::Database(e))),
        };
        if let Some(alone) = only.job.run_alone(&mut db) {
            ALONE.fetch_add(1, Ordering::Relaxed);
            // One statement: it wrote everything or nothing.
            return Ok(vec![alone.await]);
        }
    }
    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return Ok(failed_all(&e)),
    };
    let mut answers: Vec<Option<Answer>> = batch.iter().map(|_| None).collect();
    let mut notes = vec![];
    if store.backend == Backend::Postgres {
        let mut at_once = moves_at_once(&mut tx, batch, &mut answers, &mut notes).await;
        if at_once.is_ok() {
            at_once = ends_at_once(&mut tx, batch, &mut answers, &mut notes).await;
        }
        if let Err(error) = at_once {
            let _ = tx.rollback().await;
            return Err(Poisoned(error));
        }
    }
    for (pending, answer) in batch.iter().zip(answers.iter_mut()) {
        if answer.is_some() {
            continue;
        }
        // A job that fails may have written part of what it writes: the
        // batch goes back, and every job runs alone.
        let (out, signal) = match pending.job.run(&mut tx).await {
            Ok(done) => done,
            Err(error) => {
                let _ = tx.rollback().await;
                return Err(Poisoned(error));
            }
        };
        notes.extend(signal);
        *answer = Some(Ok(out));
    }
    if store.backend == Backend::Postgres {
        for payload in DesktopNote::payloads(&notes) {
            let notified = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(Topic::Desktop.pg_channel())
                .bind(payload)
                .execute(&mut *tx)
                .await;
            if let Err(error) = notified {
                let _ = tx.rollback().await;
                return Err(Poisoned(error.into()));
            }
        }
    }
    if let Err(e) = tx.commit().await {
        return Ok(failed_all(&StoreError::Database(e)));
    }
    if store.backend == Backend::Sqlite && !notes.is_empty() {
        crate::signal::notes_local(&notes);
    }
    Ok(answers
        .into_iter()
        .map(|a| a.unwrap_or_else(|| Err(gone())))
        .collect())
}

/// Makes the batch's single moves forward in one statement, answering
/// their jobs: only moves of runs no other job of the batch writes (so a
/// run's writes keep their order), and only when there are several.
async fn moves_at_once(
    tx: &mut AnyConnection,
    batch: &[Pending],
    answers: &mut [Option<Answer>],
    notes: &mut Vec<DesktopNote>,
) -> Result<()> {
    let moves = joinable(batch, answers, |job| job.as_move());
    if moves.len() < 2 {
        return Ok(());
    }
    let rows: Vec<&crate::runs::Move> = moves.iter().map(|(_, m)| m).collect();
    let made = crate::runs::advance_many(tx, &rows).await?;
    MOVED_AT_ONCE.fetch_add(rows.len() as u64, Ordering::Relaxed);
    for (i, m) in &moves {
        if let Some(done) = batch[*i].job.moved(made.contains(&m.run_id)) {
            answer(done, &mut answers[*i], notes)?;
        }
    }
    Ok(())
}

/// Makes the batch's ends of runs in one statement, answering the jobs of
/// the runs that ended: only ends of runs no other job of the batch writes,
/// and only when there are several. A run whose guard did not hold is left
/// to its job, which runs as alone and says why.
async fn ends_at_once(
    tx: &mut AnyConnection,
    batch: &[Pending],
    answers: &mut [Option<Answer>],
    notes: &mut Vec<DesktopNote>,
) -> Result<()> {
    let ends = joinable(batch, answers, |job| job.as_end());
    if ends.len() < 2 {
        return Ok(());
    }
    let rows: Vec<&crate::receipts::End> = ends.iter().map(|(_, e)| e).collect();
    let ended = crate::receipts::end_many(tx, &rows).await?;
    ENDED_AT_ONCE.fetch_add(ended.len() as u64, Ordering::Relaxed);
    for (i, e) in &ends {
        if let Some(state) = ended.get(&e.run_id)
            && let Some(done) = batch[*i].job.ended(*state)
        {
            answer(done, &mut answers[*i], notes)?;
        }
    }
    Ok(())
}

/// The batch's unanswered jobs that can join one statement (`row` says
/// how), with their places: only jobs of runs no other job of the batch
/// writes, so a run's writes keep their order.
fn joinable<T>(
    batch: &[Pending],
    answers: &[Option<Answer>],
    row: impl Fn(&dyn Erased) -> Option<T>,
) -> Vec<(usize, T)> {
    let mut jobs_of = std::collections::HashMap::<&str, usize>::new();
    for pending in batch {
        *jobs_of.entry(pending.job.key()).or_default() += 1;
    }
    batch
        .iter()
        .enumerate()
        .filter(|(i, p)| answers[*i].is_none() && jobs_of.get(p.job.key()) == Some(&1))
        .filter_map(|(i, p)| row(p.job.as_ref()).map(|r| (i, r)))
        .collect()
}

/// Answers a job a joined statement made, keeping the note it asks for.
fn answer(done: Done, slot: &mut Option<Answer>, notes: &mut Vec<DesktopNote>) -> Result<()> {
    let (out, signal) = done?;
    notes.extend(signal);
    *slot = Some(Ok(out));
    Ok(())
}

/// A database error again, for every job of a batch that failed as one
/// (sqlx errors are not `Clone`).
fn copy_error(e: &StoreError) -> sqlx::Error {
    sqlx::Error::Protocol(format!("the batch's transaction failed: {e}"))
}
