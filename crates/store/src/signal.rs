//! Wake-ups between services: in-process (dev mode and tests run several
//! services in one process) and, on PostgreSQL, across processes with
//! LISTEN/NOTIFY, one channel per [`Topic`] (for run-coordinators,
//! runner-gateway replicas and webhook delivery). A wake-up is only a hint:
//! every watcher also polls, so a lost one delays work by at most the poll
//! interval.
//!
//! Desktop changes are [`DesktopNote`]s that say what changed, so a replica
//! acts on exactly that — claims an offered run for the owner's runner it
//! holds, wakes the one observer of a run — instead of looking at
//! everything. On PostgreSQL they travel only by NOTIFY (a process hears
//! its own), newline-separated in the payload; on SQLite, in-process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::{Notify, broadcast, mpsc};

use crate::desktop::DesktopPhase;
use crate::{Backend, Result, Store};

/// What a watcher waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Topic {
    /// Runs were created.
    Runs,
    /// A desktop assignment was offered, claimed, reported on or cancelled.
    Desktop,
    /// Webhook messages were written to the outbox.
    Notifications,
}

struct Channel {
    generation: AtomicU64,
    notify: Notify,
}

/// One channel per topic, in the order of [`Topic`].
static CHANNELS: [Channel; 3] = [const {
    Channel {
        generation: AtomicU64::new(0),
        notify: Notify::const_new(),
    }
}; 3];

impl Topic {
    fn channel(self) -> &'static Channel {
        &CHANNELS[self as usize]
    }

    /// The PostgreSQL channel name.
    pub(crate) fn pg_channel(self) -> &'static str {
        match self {
            Topic::Runs => "automesh_runs",
            Topic::Desktop => "automesh_desktop",
            Topic::Notifications => "automesh_notifications",
        }
    }

    /// Wakes this process's watchers of the topic.
    pub(crate) fn signal_local(self) {
        let c = self.channel();
        c.generation.fetch_add(1, Ordering::SeqCst);
        c.notify.notify_waiters();
    }
}

/// What changed in desktop dispatch, as the replicas are told: one JSON
/// object per note (`{"note":"offered","run_id":…}`), so any id survives
/// the payload and a note a replica does not know is a note it missed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "note", rename_all = "snake_case", deny_unknown_fields)]
pub enum DesktopNote {
    /// A run was offered to its owner's runners.
    Offered {
        run_id: String,
        org_id: String,
        owner_id: String,
    },
    /// A run's assignment changed: accepted, reported on, finished, idle;
    /// with what it now is when the change knows it (a runner's report),
    /// so that the run's observers need not read it.
    Changed {
        run_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        now: Option<AssignmentState>,
    },
    /// A claim on a run was given back (not accepted in time, or its
    /// replica was lost): another runner of the owner may take it.
    GivenBack { run_id: String },
    /// A run's cancellation was asked for: its runner is to be told.
    Cancelled { run_id: String },
    /// Claims of an ended stream were given back.
    Released,
}

/// What a run's assignment is, as of the commit a note was sent in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignmentState {
    #[serde(with = "phase_name")]
    pub phase: DesktopPhase,
    pub idle: bool,
    /// Events the runner reported so far (they are numbered 1, 2, …).
    pub event_count: i64,
    /// Whether a runner sat on it without accepting it.
    pub passed_over: bool,
    /// The encoded outcome (hex, as stored), once finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_hex: Option<String>,
}

/// A phase in a note by its stored name.
mod phase_name {
    use super::DesktopPhase;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(phase: &DesktopPhase, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(phase.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DesktopPhase, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl AssignmentState {
    /// The encoded outcome, once finished (`None` too if it is not hex).
    pub fn outcome(&self) -> Option<Vec<u8>> {
        self.outcome_hex
            .as_deref()
            .and_then(|h| crate::rows::from_hex(h).ok())
    }
}

/// Bound on one NOTIFY payload (PostgreSQL's is 8000 bytes).
const PAYLOAD_LIMIT: usize = 7900;

impl DesktopNote {
    /// The run it is about, if one.
    pub fn run_id(&self) -> Option<&str> {
        match self {
            DesktopNote::Offered { run_id, .. }
            | DesktopNote::Changed { run_id, .. }
            | DesktopNote::GivenBack { run_id }
            | DesktopNote::Cancelled { run_id } => Some(run_id),
            DesktopNote::Released => None,
        }
    }

    /// One line of a payload (JSON has no raw newline).
    fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    fn decode(line: &str) -> Option<DesktopNote> {
        serde_json::from_str(line).ok()
    }

    /// `notes` as NOTIFY payloads: lines, each payload under the bound (a
    /// note too long for one is dropped: the poll finds what it told).
    pub(crate) fn payloads(notes: &[DesktopNote]) -> Vec<String> {
        let mut payloads = vec![];
        let mut current = String::new();
        for note in notes {
            let mut line = note.encode();
            // Too long with its state (a long outcome): without it, and the
            // observers read the row.
            if line.len() > PAYLOAD_LIMIT
                && let DesktopNote::Changed {
                    run_id,
                    now: Some(_),
                } = note
            {
                let run_id = run_id.clone();
                line = DesktopNote::Changed { run_id, now: None }.encode();
            }
            if line.len() > PAYLOAD_LIMIT {
                tracing::warn!(bytes = line.len(), "a desktop note too long to send");
                continue;
            }
            if !current.is_empty() && current.len() + 1 + line.len() > PAYLOAD_LIMIT {
                payloads.push(std::mem::take(&mut current));
            }
            if !current.is_empty() {
                current.push('\n');
            }
            current.push_str(&line);
        }
        if !current.is_empty() {
            payloads.push(current);
        }
        payloads
    }

    /// The notes of one payload; `None` when it is empty (a bare wake-up)
    /// or any line is not a note.
    fn parse(payload: &str) -> Option<Vec<DesktopNote>> {
        if payload.is_empty() {
            return None;
        }
        payload.lines().map(DesktopNote::decode).collect()
    }
}

/// Desktop notes within this process (SQLite, and PostgreSQL stores whose
/// replicas cannot LISTEN do not need it: they poll).
fn local_notes() -> &'static broadcast::Sender<DesktopNote> {
    static NOTES: std::sync::OnceLock<broadcast::Sender<DesktopNote>> = std::sync::OnceLock::new();
    NOTES.get_or_init(|| broadcast::channel(4096).0)
}

/// Tells this process's desktop listeners `notes`.
pub(crate) fn notes_local(notes: &[DesktopNote]) {
    for note in notes {
        // No receiver is no listener: nothing to tell.
        let _ = local_notes().send(note.clone());
    }
    Topic::Desktop.signal_local();
}

/// What a replica heard of desktop dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    /// These notes.
    Notes(Vec<DesktopNote>),
    /// Notes may have been lost (a lagging listener, a lost connection, a
    /// payload that is not notes): look at everything.
    Missed,
    /// Nothing within the wait.
    Nothing,
}

/// The `application_name` of every LISTEN connection, so an operator (and
/// a test) can tell them from the pool's connections in
/// `pg_stat_activity`.
pub const LISTEN_APPLICATION_NAME: &str = "automesh-listen";

/// The first reconnection after a lost LISTEN connection is immediate; the
/// ones after a failed attempt wait this, doubling up to [`RETRY_MAX`],
/// with jitter so that replicas do not come back in step.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Bound on one connection attempt.
const CONNECT_BOUND: Duration = Duration::from_secs(10);

/// What a LISTEN connection hands its listener.
#[derive(Debug)]
enum Received {
    /// A notification's payload.
    Payload(String),
    /// The connection was lost (or could not be made) and is back: what
    /// was sent meanwhile is gone, so the listener catches up once.
    Reconnected,
}

/// One LISTEN connection of one topic, the single listener under every
/// watcher: a task of its own that holds sqlx's [`PgListener`], and when
/// the connection is lost logs it, reconnects with backoff, counts the
/// reconnection (`automesh.db.listen.reconnects`, Prometheus
/// `automesh_db_listen_reconnects_total`) and tells its listener to catch
/// up. The task ends with the listener.
struct Listen {
    received: mpsc::Receiver<Received>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Listen {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Listen {
    /// Listens on `topic`; returns once the first attempt to connect has
    /// succeeded (so nothing sent after it is missed) or failed (then it
    /// keeps trying in the background, and says so when it is back).
    async fn start(url: &str, topic: Topic) -> Listen {
        let first = connect_listener(url, topic).await;
        if let Err(error) = &first {
            tracing::warn!(%error, ?topic, "cannot LISTEN yet; retrying, polling meanwhile");
        }
        let (sender, received) = mpsc::channel(1024);
        let task = tokio::spawn(listening(url.to_owned(), topic, first.ok(), sender));
        Listen { received, task }
    }

    /// The next thing received; `None` never comes while the task runs.
    async fn recv(&mut self) -> Option<Received> {
        self.received.recv().await
    }

    /// Everything received so far, dropped.
    fn drain(&mut self) {
        while self.received.try_recv().is_ok() {}
    }
}

/// Reconnections of LISTEN connections after a loss.
fn reconnects() -> &'static opentelemetry::metrics::Counter<u64> {
    static COUNTER: std::sync::OnceLock<opentelemetry::metrics::Counter<u64>> =
        std::sync::OnceLock::new();
    COUNTER.get_or_init(|| {
        opentelemetry::global::meter("automesh")
            .u64_counter("automesh.db.listen.reconnects")
            .with_description(
                "LISTEN connections made again after one was lost; each is followed by one catch-up pass",
            )
            .build()
    })
}

/// `base` less up to a half, at random.
fn jittered(base: Duration) -> Duration {
    let spread = base.as_millis() as u64 / 2;
    let random = (uuid::Uuid::new_v4().as_u128() as u64) % spread.max(1);
    base - Duration::from_millis(random)
}

/// The task of one [`Listen`].
async fn listening(
    url: String,
    topic: Topic,
    mut connection: Option<PgListener>,
    sender: mpsc::Sender<Received>,
) {
    let mut retry = RETRY_FIRST;
    loop {
        let mut listener = match connection.take() {
            Some(l) => l,
            None => match connect_listener(&url, topic).await {
                Ok(l) => {
                    retry = RETRY_FIRST;
                    reconnects().add(
                        1,
                        &[opentelemetry::KeyValue::new("topic", topic.pg_channel())],
                    );
                    tracing::info!(?topic, "LISTEN connection back; catching up");
                    if sender.send(Received::Reconnected).await.is_err() {
                        return;
                    }
                    l
                }
                Err(error) => {
                    let wait = jittered(retry);
                    tracing::warn!(%error, ?topic, retry_in_ms = wait.as_millis() as u64, "cannot LISTEN; retrying, polling meanwhile");
                    tokio::time::sleep(wait).await;
                    retry = (retry * 2).min(RETRY_MAX);
                    continue;
                }
            },
        };
        let error = loop {
            match listener.try_recv().await {
                Ok(Some(n)) => {
                    let payload = Received::Payload(n.payload().to_owned());
                    if sender.send(payload).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break "connection closed".to_owned(),
                Err(error) => break error.to_string(),
            }
        };
        tracing::warn!(%error, ?topic, "LISTEN connection lost; reconnecting");
    }
}

/// A LISTEN connection of its own (a pool of one that never expires it),
/// named [`LISTEN_APPLICATION_NAME`], listening on `topic`. Lost, it is
/// dropped and made again: reconnection is [`listening`]'s, not sqlx's.
async fn connect_listener(url: &str, topic: Topic) -> std::result::Result<PgListener, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .acquire_timeout(CONNECT_BOUND)
        .connect_with(options.application_name(LISTEN_APPLICATION_NAME))
        .await?;
    let mut l = PgListener::connect_with(&pool).await?;
    l.eager_reconnect(false);
    l.ignore_pool_close_event(true);
    l.listen(topic.pg_channel()).await?;
    Ok(l)
}

/// Sends `payload` on `topic`'s channel through `db` (in a transaction, it
/// is delivered at commit). Every notification is sent through here.
pub(crate) async fn notify<'e, E>(db: E, topic: Topic, payload: &str) -> sqlx::Result<()>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(topic.pg_channel())
        .bind(payload)
        .execute(db)
        .await
        .map(|_| ())
}

/// Hears desktop notes: from NOTIFY on PostgreSQL, in-process on SQLite.
pub struct DesktopListener {
    local: broadcast::Receiver<DesktopNote>,
    listen: Option<Listen>,
}

impl std::fmt::Debug for DesktopListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DesktopListener")
            .field("listening", &self.listen.is_some())
            .finish()
    }
}

impl DesktopListener {
    /// The next notes, or `Nothing` after `max`; `Missed` after a lost
    /// LISTEN connection came back (look at everything once).
    pub async fn next(&mut self, max: Duration) -> Heard {
        let Some(listen) = self.listen.as_mut() else {
            let first = match tokio::time::timeout(max, self.local.recv()).await {
                Err(_) => return Heard::Nothing,
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => return Heard::Missed,
                Ok(Err(broadcast::error::RecvError::Closed)) => return Heard::Nothing,
                Ok(Ok(note)) => note,
            };
            let mut notes = vec![first];
            loop {
                match self.local.try_recv() {
                    Ok(note) => notes.push(note),
                    Err(broadcast::error::TryRecvError::Lagged(_)) => return Heard::Missed,
                    Err(_) => return Heard::Notes(notes),
                }
            }
        };
        match tokio::time::timeout(max, listen.recv()).await {
            Err(_) | Ok(None) => Heard::Nothing,
            Ok(Some(Received::Payload(p))) => {
                DesktopNote::parse(&p).map_or(Heard::Missed, Heard::Notes)
            }
            Ok(Some(Received::Reconnected)) => Heard::Missed,
        }
    }
}

/// Tells the coordinators that runs were created (through `db`, outside a
/// transaction): by NOTIFY on PostgreSQL, and this process's at once.
pub(crate) async fn runs_created_on(db: &mut sqlx::AnyConnection) -> Result<()> {
    if crate::rows::is_postgres(db) {
        notify(&mut *db, Topic::Runs, process_token()).await?;
    }
    Topic::Runs.signal_local();
    Ok(())
}

/// The payload of this process's `automesh_runs` notifications: a token
/// of its own, so that its watchers skip what they hear of their own
/// process (every such notification goes with an in-process signal, which
/// woke them already) instead of claiming a second time.
pub(crate) fn process_token() -> &'static str {
    static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TOKEN.get_or_init(|| uuid::Uuid::new_v4().simple().to_string())
}

/// Waits for news on one topic.
pub struct Watcher {
    topic: Topic,
    seen: u64,
    listen: Option<Listen>,
}

/// The watcher coordinators use for new runs.
pub type RunWatcher = Watcher;

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("topic", &self.topic)
            .field("listening", &self.listen.is_some())
            .finish()
    }
}

impl Store {
    /// A watcher of run creation; on PostgreSQL it also listens for other
    /// processes.
    pub async fn watch_new_runs(&self) -> RunWatcher {
        self.watch(Topic::Runs).await
    }

    /// A watcher of `topic`; on PostgreSQL it also listens for other
    /// processes, on a LISTEN connection that reconnects when lost.
    pub async fn watch(&self, topic: Topic) -> Watcher {
        let listen = match self.backend() {
            Backend::Postgres => Some(Listen::start(self.url(), topic).await),
            Backend::Sqlite => None,
        };
        Watcher {
            topic,
            seen: topic.channel().generation.load(Ordering::SeqCst),
            listen,
        }
    }

    /// A listener of desktop notes; on PostgreSQL a LISTEN connection of its
    /// own that reconnects when lost.
    pub async fn listen_desktop(&self) -> DesktopListener {
        let listen = match self.backend() {
            Backend::Postgres => Some(Listen::start(self.url(), Topic::Desktop).await),
            Backend::Sqlite => None,
        };
        DesktopListener {
            local: local_notes().subscribe(),
            listen,
        }
    }

    /// Tells every replica `notes` (outside a batch's transaction).
    pub(crate) async fn tell(&self, notes: &[DesktopNote]) {
        if notes.is_empty() {
            return;
        }
        if self.backend() == Backend::Sqlite {
            notes_local(notes);
            return;
        }
        for payload in DesktopNote::payloads(notes) {
            if let Err(error) = notify(self.db(), Topic::Desktop, &payload).await {
                // Only a hint: replicas poll as well.
                tracing::warn!(%error, "cannot send desktop notes");
            }
        }
    }

    /// Wakes the watchers of `topic`, in this process and (on PostgreSQL)
    /// in every other.
    pub async fn signal(&self, topic: Topic) -> Result<()> {
        topic.signal_local();
        if self.backend() == Backend::Postgres {
            let payload = match topic {
                Topic::Runs => process_token(),
                Topic::Desktop | Topic::Notifications => "",
            };
            notify(self.db(), topic, payload).await?;
        }
        Ok(())
    }
}

impl Watcher {
    /// Takes every signal so far as seen: called just before reading what
    /// the signals announce (a signal is sent after its commit, so the read
    /// that follows sees it), so that the next [`Watcher::wait`] returns
    /// only for news after the read.
    pub fn consume(&mut self) {
        self.seen = self.topic.channel().generation.load(Ordering::SeqCst);
        if let Some(l) = self.listen.as_mut() {
            l.drain();
        }
    }

    /// Returns when the topic was signalled since the last call (or
    /// [`Watcher::consume`]), when a lost LISTEN connection came back (the
    /// caller's read is the catch-up), or after `max`. A notification this
    /// process sent is not news: its in-process signal came first.
    pub async fn wait(&mut self, max: Duration) {
        let channel = self.topic.channel();
        let notified = channel.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = channel.generation.load(Ordering::SeqCst);
        if now != self.seen {
            self.seen = now;
            return;
        }
        let remote = async {
            match self.listen.as_mut() {
                Some(l) => loop {
                    match l.recv().await {
                        Some(Received::Payload(p)) if p == process_token() => {}
                        Some(_) => break,
                        None => std::future::pending::<()>().await,
                    }
                },
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = notified => {}
            () = remote => {}
            () = tokio::time::sleep(max) => {}
        }
        self.seen = channel.generation.load(Ordering::SeqCst);
    }
}
