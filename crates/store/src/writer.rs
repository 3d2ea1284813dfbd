//! Group commit: the hot-path writes of many runs — state moves, events,
//! receipts, desktop reports — committed together, one transaction per
//! batch instead of one per write.
//!
//! Each process's store has a few writer tasks (one on SQLite). A write is
//! a [`Job`]: its own guarded statements, exactly as it would run alone. A
//! writer takes every job waiting when it is free (nothing waits on a
//! timer: under no load a job commits at once, under load jobs pile up
//! while the batches before commit, and the batches grow), runs them in one transaction in
//! the order of their keys (a run's id, so that transactions of different
//! writers lock rows in one order), and answers each job only after the
//! commit. A batch is exactly as safe as
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
//! hold is left to its job, which runs as alone and says why. Runners'
//! reports and desktop offers are joined the same way. A job joins through
//! its [`Job::joined_row`] (a [`Row`] of one [`Joint`]) and is answered
//! from what the statement did ([`Joined`]).
//!
//! A joined statement takes its rows' locks (in key order) before the
//! batch's other jobs take theirs, so a batch no longer locks strictly in
//! one key order: two batches that write crossing sets of the same runs
//! (say one with reports on r1 and r9 and a cancellation of r5, the other
//! with reports on r2 and r5 and a cancellation of r9) can deadlock.
//! PostgreSQL detects it after `deadlock_timeout`, the batch it picks fails
//! and is run again one job per transaction — correct, but that late; the
//! batches run again so are counted (`automesh.db.write.replayed`).
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

use crate::signal::{DesktopNote, Topic};
use crate::{Backend, Result, StoreError};

mod joined;

use joined::joined_at_once;
pub(crate) use joined::{Joined, Joint, Row};

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

    /// The job as one row of a statement a batch on PostgreSQL makes for
    /// many jobs at once (none, unless a job says so): a run's single move
    /// forward, a run's end, a runner's report, a desktop offer.
    fn joined_row(&self) -> Option<Row> {
        None
    }

    /// Its answer given what the joined statement did with its row; `None`
    /// leaves the job to run as alone.
    fn joined(&self, _done: Joined) -> Option<Self::Output> {
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
    fn joined_row(&self) -> Option<Row>;
    fn joined(&self, done: Joined) -> Option<Done>;
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

    fn joined_row(&self) -> Option<Row> {
        Job::joined_row(self)
    }

    fn joined(&self, done: Joined) -> Option<Done> {
        let out = Job::joined(self, done)?;
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

/// Reports the writers' batching on `meter`, read at each collection; once
/// per process, whatever its stores (the counts are the process's):
/// `automesh.db.write.batches` (transactions committed or tried),
/// `automesh.db.write.jobs` (writes they held), `automesh.db.write.replayed`
/// (batches run again one write per transaction), `automesh.db.write.alone`
/// (writes that were one statement by themselves), and
/// `automesh.db.write.joined` by `kind` (`move`, `end`, `report`,
/// `offer`): writes a batch made together with others in one statement
/// (counted when made, so a batch rolled back afterwards counts too).
pub(crate) fn observe(meter: &opentelemetry::metrics::Meter) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let count = |name: &'static str, description: &'static str, of: &'static AtomicU64| {
            let _counter = meter
                .u64_observable_counter(name)
                .with_description(description)
                .with_callback(move |o| o.observe(of.load(Ordering::Relaxed), &[]))
                .build();
        };
        count(
            "automesh.db.write.batches",
            "Transactions the store's writers committed (or tried), each holding many writes",
            &BATCHES,
        );
        count(
            "automesh.db.write.jobs",
            "Writes the store's writers took into batches (committed, or run again one by one)",
            &JOBS,
        );
        count(
            "automesh.db.write.replayed",
            "Batches rolled back because one write failed (a refused write, a deadlock) and run again one write per transaction",
            &REPLAYED,
        );
        count(
            "automesh.db.write.alone",
            "Writes that were one statement committing by itself (a lone desktop offer)",
            &ALONE,
        );
        let _joined = meter
            .u64_observable_counter("automesh.db.write.joined")
            .with_description("Writes a batch made together with others in one statement, by kind")
            .with_callback(|o| {
                for joint in Joint::ALL {
                    let kind = opentelemetry::KeyValue::new("kind", joint.name());
                    o.observe(joint.counter().load(Ordering::Relaxed), &[kind]);
                }
            })
            .build();
    });
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
    Joint::Move.counter().load(Ordering::Relaxed)
}

/// How many runs' ends the writers of this process made together with
/// others, in one statement per batch.
pub fn ended_at_once() -> u64 {
    Joint::End.counter().load(Ordering::Relaxed)
}

/// How many runners' reports the writers of this process recorded
/// together with others, in one statement per batch.
pub fn reported_at_once() -> u64 {
    Joint::Report.counter().load(Ordering::Relaxed)
}

/// How many desktop offers the writers of this process made together with
/// others, in one statement per batch.
pub fn offered_at_once() -> u64 {
    Joint::Offer.counter().load(Ordering::Relaxed)
}

/// How many batches the writers of this process rolled back because one
/// of their jobs failed (a refused write, a deadlock between batches) and
/// ran again one job per transaction.
pub fn replayed() -> u64 {
    REPLAYED.load(Ordering::Relaxed)
}

static BATCHES: AtomicU64 = AtomicU64::new(0);
/// Batches one of whose jobs failed (a refused write, a deadlock), rolled
/// back and run again one job per transaction.
static REPLAYED: AtomicU64 = AtomicU64::new(0);
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
                REPLAYED.fetch_add(1, Ordering::Relaxed);
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
    if store.backend == Backend::Postgres
        && let Err(error) = joined_at_once(&mut tx, batch, &mut answers, &mut notes).await
    {
        let _ = tx.rollback().await;
        return Err(Poisoned(error));
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
            let notified = crate::signal::notify(&mut *tx, Topic::Desktop, &payload).await;
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

/// A database error again, for every job of a batch that failed as one
/// (sqlx errors are not `Clone`).
fn copy_error(e: &StoreError) -> sqlx::Error {
    sqlx::Error::Protocol(format!("the batch's transaction failed: {e}"))
}
