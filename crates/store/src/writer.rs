//! Group commit: the hot-path writes of many runs — state moves, events,
//! receipts, leases, desktop offers and reports — committed together, one
//! transaction per batch instead of one per write.
//!
//! Each process's store has a few writer tasks in two lanes, the runs' and
//! desktop dispatch's (one task each on SQLite, whose one write lock they
//! share). A write is a [`Job`]. A writer takes every job waiting when it is free (nothing
//! waits on a timer: under no load a job commits at once, under load jobs
//! pile up while the batches before commit, and the batches grow) and
//! commits them in one transaction, answering each job only after the
//! commit.
//!
//! Every kind of job is written in bulk: [`Job::write_all`] makes the
//! writes of many jobs of its kind with one statement per step (a bulk
//! statement, `sql.rs`), each row guarded as if it were alone; a lone write
//! is a batch of one. A batch is sorted by run id and cut into rounds (a
//! run's first job in the first, its second in the second, …), so that two
//! jobs of one run keep their order; each round writes each kind once.
//!
//! On PostgreSQL a batch first locks the rows of every run it writes, in
//! one statement per table and in one order (`ORDER BY id … FOR UPDATE`;
//! a kind names its table's statement, [`Job::LOCK_PG`]: the runs, or a
//! desktop kind's assignments, so that the runner gateway's writes never
//! hold a run's row): batches of different writers and processes queue on
//! their first common run instead of deadlocking over crossing sets. A job whose guard refuses it (a run
//! already ended, a report from a stream that no longer holds the run) is
//! answered so and writes nothing; it does not fail the batch.
//!
//! What is left of the replay path: a statement that fails outright (the
//! database refused a row, or a deadlock with a statement outside the
//! writers, such as a sweep that updates many rows) rolls the batch back,
//! and every job is run again in a transaction of its own, so that one bad
//! write never fails another (`automesh.db.write.replayed` counts them; a
//! steady rate means something to look at).
//!
//! The desktop notes a batch's jobs ask for are sent (NOTIFY) inside the
//! batch's transaction, so they are delivered at its commit, packed into as
//! few payloads as they fit.

use std::any::{Any, TypeId};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::future::BoxFuture;
use sqlx::{Any as AnyDb, AnyConnection, AnyPool, Transaction};
use tokio::sync::{mpsc, oneshot};

use crate::signal::{DesktopNote, Topic};
use crate::{Backend, Result, StoreError};

/// Jobs one transaction takes at most.
const MAX_BATCH: usize = 256;

/// Writer tasks of a PostgreSQL store, each committing its own batches on
/// its own connection (a batch's statements are round trips in a row: one
/// writer alone would be bound by their latency). SQLite has one writer
/// at a time anyway.
const PG_WRITERS: usize = 4;

/// Writer tasks of a PostgreSQL store's desktop lane (offers, reports,
/// cancellations and runners' events).
const PG_DESKTOP_WRITERS: usize = 2;

/// Jobs that may wait for the writer before a new one waits to be queued.
const QUEUE: usize = 4096;

/// PostgreSQL: the runs a batch's jobs write locked in one order, before
/// anything else it writes (`$1` a JSON array of run ids).
pub(crate) const LOCK_RUNS_PG: &str = "SELECT id FROM runs \
     WHERE id IN (SELECT value FROM json_array_elements_text($1::json)) \
     ORDER BY id COLLATE \"C\" FOR UPDATE";

/// One kind of write committed with others. Its jobs may run twice (once
/// in a batch that is rolled back, then alone), so a job must not act
/// outside the database.
pub(crate) trait Job: Send + Sync + Sized + 'static {
    type Output: Send + 'static;

    /// The run the job writes (what orders and locks the batch).
    fn key(&self) -> &str;

    /// PostgreSQL: the statement that locks, in one order, the rows of the
    /// runs (`$1`, a JSON array of keys) that jobs of this kind write
    /// (`LOCK_RUNS_PG`, unless a kind writes another table's rows only).
    const LOCK_PG: &'static str = LOCK_RUNS_PG;

    /// What to tell the runner-gateway replicas once the job's writes
    /// commit, given what it did (nothing, unless a job says so).
    fn signal(&self, _done: &Self::Output) -> Option<DesktopNote> {
        None
    }

    /// Makes the writes of `jobs` (of distinct runs, in the order of their
    /// ids) in the batch's transaction, with one bulk statement per step:
    /// each job's answer, in order. A job its guard refuses is answered
    /// with why, having written nothing; an error fails the batch.
    fn write_all<'a>(
        jobs: &'a [&'a Self],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Result<Self::Output>>>>;
}

type Answer = Result<Box<dyn Any + Send>>;

/// A job's answer and the signal it asks for, or why it was refused.
type Done = Result<(Box<dyn Any + Send>, Option<DesktopNote>)>;

/// A job with its type erased, and where its answer goes.
struct Pending {
    job: Arc<dyn Erased>,
    answer: oneshot::Sender<Answer>,
}

trait Erased: Send + Sync {
    fn key(&self) -> &str;
    fn lock(&self) -> &'static str;
    fn kind(&self) -> TypeId;
    fn as_any(&self) -> &dyn Any;
    /// Writes `group`, jobs of this one's kind.
    fn write_group<'a>(
        &'a self,
        group: &'a [&'a Pending],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Done>>>;
}

impl<J: Job> Erased for J {
    fn key(&self) -> &str {
        Job::key(self)
    }

    fn lock(&self) -> &'static str {
        J::LOCK_PG
    }

    fn kind(&self) -> TypeId {
        TypeId::of::<J>()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn write_group<'a>(
        &'a self,
        group: &'a [&'a Pending],
        db: &'a mut AnyConnection,
    ) -> BoxFuture<'a, Result<Vec<Done>>> {
        Box::pin(async move {
            let jobs: Vec<&J> = group
                .iter()
                .filter_map(|p| p.job.as_any().downcast_ref::<J>())
                .collect();
            let answers = J::write_all(&jobs, db).await?;
            if jobs.len() != group.len() || answers.len() != jobs.len() {
                return Err(StoreError::Corrupt("a bulk write lost a job".into()));
            }
            Ok(jobs
                .iter()
                .zip(answers)
                .map(|(job, out)| {
                    let out = out?;
                    let signal = job.signal(&out);
                    Ok((Box::new(out) as Box<dyn Any + Send>, signal))
                })
                .collect())
        })
    }
}

/// The queues of one store's writer tasks: one lane for the writes of
/// runs, one for desktop dispatch's (see [`Job::LOCK_PG`]), so that a
/// write waiting on a desktop assignment another transaction holds never
/// holds up a run's (when one process runs both services, as in dev mode).
#[derive(Debug, Clone)]
pub(crate) struct Writer {
    runs: mpsc::Sender<Pending>,
    desktop: mpsc::Sender<Pending>,
    /// Batches this store's writers replayed (see [`replayed`]).
    replayed: Arc<AtomicU64>,
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
        let replayed = Arc::new(AtomicU64::new(0));
        let lane = |writers: usize| {
            let (queue, jobs) = mpsc::channel(QUEUE);
            let jobs = Arc::new(tokio::sync::Mutex::new(jobs));
            for _ in 0..writers {
                let db = Db {
                    pool: pool.clone(),
                    backend,
                    replayed: replayed.clone(),
                };
                tokio::spawn(write_loop(db, jobs.clone()));
            }
            queue
        };
        let (runs, desktop) = match backend {
            Backend::Postgres => (lane(PG_WRITERS), lane(PG_DESKTOP_WRITERS)),
            Backend::Sqlite => (lane(1), lane(1)),
        };
        Writer {
            runs,
            desktop,
            replayed,
        }
    }

    /// Commits `job` with whatever else is waiting, and answers what it
    /// returned once its transaction committed.
    pub(crate) async fn write<J: Job>(&self, job: J) -> Result<J::Output> {
        let (answer, answered) = oneshot::channel();
        let pending = Pending {
            job: Arc::new(job),
            answer,
        };
        let lane = if J::LOCK_PG == LOCK_RUNS_PG {
            &self.runs
        } else {
            &self.desktop
        };
        lane.send(pending).await.map_err(|_| gone())?;
        let out = answered.await.map_err(|_| gone())??;
        out.downcast::<J::Output>()
            .map(|out| *out)
            .map_err(|_| StoreError::Corrupt("a write answered with the wrong type".into()))
    }
}

impl Writer {
    /// Batches this store's writers rolled back and ran again one job per
    /// transaction ([`replayed`] counts the whole process's).
    pub(crate) fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
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
    replayed: Arc<AtomicU64>,
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
/// (batches run again one write per transaction) and
/// `automesh.db.write.statements` (bulk statements they ran).
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
            "Batches rolled back because a statement failed and run again one write per transaction",
            &REPLAYED,
        );
        count(
            "automesh.db.write.statements",
            "Bulk statements the store ran (its writers' batches, the scheduler's fires), each one step of many writes of one kind",
            &STATEMENTS,
        );
    });
}

/// How many bulk statements this process's stores ran (each one step of
/// many writes of one kind: the writers' batches, the scheduler's fires).
pub fn statements() -> u64 {
    STATEMENTS.load(Ordering::Relaxed)
}

static STATEMENTS: AtomicU64 = AtomicU64::new(0);

/// Counts a bulk statement run.
pub(crate) fn counted() {
    STATEMENTS.fetch_add(1, Ordering::Relaxed);
}

/// How many batches the writers of this process rolled back because one
/// of their statements failed (see the module's docs) and ran again one
/// job per transaction.
pub fn replayed() -> u64 {
    REPLAYED.load(Ordering::Relaxed)
}

static BATCHES: AtomicU64 = AtomicU64::new(0);
/// Batches one of whose statements failed, rolled back and run again one
/// job per transaction.
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
                store.replayed.fetch_add(1, Ordering::Relaxed);
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

/// A batch one of whose statements failed, with its error; nothing of the
/// batch was committed.
struct Poisoned(StoreError);

/// Runs `batch` (sorted by key) in one transaction: each job's answer once
/// it committed, an error for every job when the transaction could not
/// commit, or `Poisoned` when a statement failed.
async fn commit(store: &Db, batch: &[Pending]) -> std::result::Result<Vec<Answer>, Poisoned> {
    let failed_all = |e: &StoreError| -> Vec<Answer> {
        batch
            .iter()
            .map(|_| Err(StoreError::Database(copy_error(e))))
            .collect()
    };
    let mut tx = match store.begin().await {
        Ok(tx) => tx,
        Err(e) => return Ok(failed_all(&e)),
    };
    match write_batch(&mut tx, store.backend, batch).await {
        Ok((answers, notes)) => {
            if let Err(e) = tx.commit().await {
                return Ok(failed_all(&StoreError::Database(e)));
            }
            if store.backend == Backend::Sqlite && !notes.is_empty() {
                crate::signal::notes_local(&notes);
            }
            Ok(answers)
        }
        Err(error) => {
            let _ = tx.rollback().await;
            Err(Poisoned(error))
        }
    }
}

/// The batch's writes inside its transaction: its runs locked (PostgreSQL),
/// then round by round each kind's jobs in bulk, then its notes sent.
async fn write_batch(
    tx: &mut AnyConnection,
    backend: Backend,
    batch: &[Pending],
) -> Result<(Vec<Answer>, Vec<DesktopNote>)> {
    if backend == Backend::Postgres {
        // Each table's rows in one order, the tables in one order too: the
        // runs last, so that a batch waiting on another table's row (a
        // desktop assignment held elsewhere) holds no run meanwhile.
        let mut locks: std::collections::BTreeMap<(bool, &str), Vec<&str>> = Default::default();
        for p in batch {
            let lock = p.job.lock();
            let keys = locks.entry((lock == LOCK_RUNS_PG, lock)).or_default();
            if keys.last() != Some(&p.job.key()) {
                keys.push(p.job.key());
            }
        }
        for ((_, lock), keys) in locks {
            let keys = serde_json::to_string(&keys)
                .map_err(|e| StoreError::Corrupt(format!("a batch's keys: {e}")))?;
            crate::rows::execute(&mut *tx, lock, (keys,)).await?;
        }
    }
    let mut answers: Vec<Option<Answer>> = batch.iter().map(|_| None).collect();
    let mut notes = vec![];
    for group in groups(batch) {
        let pending: Vec<&Pending> = group.iter().map(|i| &batch[*i]).collect();
        let done = pending[0].job.write_group(&pending, &mut *tx).await?;
        for (i, done) in group.into_iter().zip(done) {
            answers[i] = Some(done.map(|(out, signal)| {
                notes.extend(signal);
                out
            }));
        }
    }
    if backend == Backend::Postgres {
        for payload in DesktopNote::payloads(&notes) {
            crate::signal::notify(&mut *tx, Topic::Desktop, &payload).await?;
        }
    }
    let answers = answers
        .into_iter()
        .map(|a| a.unwrap_or_else(|| Err(gone())))
        .collect();
    Ok((answers, notes))
}

/// The batch (sorted by key) as groups of jobs, each of one kind and of
/// distinct runs, in the order they are written: round by round (a run's
/// first job in the first round, its second in the second, …), and within
/// a round one group per kind.
fn groups(batch: &[Pending]) -> Vec<Vec<usize>> {
    let mut rounds: Vec<Vec<usize>> = vec![];
    let mut run = 0;
    for (i, pending) in batch.iter().enumerate() {
        let same = i > 0 && batch[i - 1].job.key() == pending.job.key();
        run = if same { run + 1 } else { 0 };
        if rounds.len() <= run {
            rounds.push(vec![]);
        }
        rounds[run].push(i);
    }
    let mut groups = vec![];
    for round in rounds {
        let mut kinds: Vec<(TypeId, Vec<usize>)> = vec![];
        for i in round {
            let kind = batch[i].job.kind();
            match kinds.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, group)) => group.push(i),
                None => kinds.push((kind, vec![i])),
            }
        }
        groups.extend(kinds.into_iter().map(|(_, group)| group));
    }
    groups
}

/// A database error again, for every job of a batch that failed as one
/// (sqlx errors are not `Clone`).
fn copy_error(e: &StoreError) -> sqlx::Error {
    sqlx::Error::Protocol(format!("the batch's transaction failed: {e}"))
}
