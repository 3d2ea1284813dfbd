//! Wake-ups between services: in-process (dev mode and tests run several
//! services in one process) and, on PostgreSQL, across processes with
//! LISTEN/NOTIFY. Two topics: runs were created (`automesh_runs`, for
//! run-coordinators) and desktop dispatch changed (`automesh_desktop`, for
//! runner-gateway replicas). A wake-up is only a hint: every watcher also
//! polls, so a lost one delays work by at most the poll interval, and never
//! loses it.
//!
//! Desktop changes are [`DesktopNote`]s that say what changed, so a replica
//! acts on exactly that — claims an offered run for the owner's runner it
//! holds, wakes the one observer of a run — instead of looking at
//! everything. On PostgreSQL they travel only by NOTIFY (a process hears
//! its own), newline-separated in the payload; on SQLite, in-process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::{Notify, broadcast};

use crate::{Backend, Result, Store};

/// What a watcher waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Topic {
    /// Runs were created.
    Runs,
    /// A desktop assignment was offered, claimed, reported on or cancelled.
    Desktop,
}

struct Channel {
    generation: AtomicU64,
    notify: Notify,
}

static RUNS: Channel = Channel {
    generation: AtomicU64::new(0),
    notify: Notify::const_new(),
};
static DESKTOP: Channel = Channel {
    generation: AtomicU64::new(0),
    notify: Notify::const_new(),
};

impl Topic {
    fn channel(self) -> &'static Channel {
        match self {
            Topic::Runs => &RUNS,
            Topic::Desktop => &DESKTOP,
        }
    }

    /// The PostgreSQL channel name.
    pub(crate) fn pg_channel(self) -> &'static str {
        match self {
            Topic::Runs => "automesh_runs",
            Topic::Desktop => "automesh_desktop",
        }
    }

    /// Wakes this process's watchers of the topic.
    pub(crate) fn signal_local(self) {
        let c = self.channel();
        c.generation.fetch_add(1, Ordering::SeqCst);
        c.notify.notify_waiters();
    }
}

/// What changed in desktop dispatch, as the replicas are told.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
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
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct AssignmentState {
    /// `admitted`, `running` or `finished`, as stored.
    pub phase: String,
    pub idle: bool,
    /// Events the runner reported so far (they are numbered 1, 2, …).
    pub event_count: i64,
    /// Whether a runner sat on it without accepting it.
    pub passed_over: bool,
    /// The encoded outcome (hex, as stored), once finished.
    pub outcome_hex: Option<String>,
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

    /// One line of a payload: a JSON array, so any id survives it.
    fn encode(&self) -> String {
        let flag = |b: bool| if b { "1" } else { "0" };
        let fields: Vec<&str> = match self {
            DesktopNote::Offered {
                run_id,
                org_id,
                owner_id,
            } => vec!["offered", run_id, org_id, owner_id],
            DesktopNote::Changed { run_id, now: None } => vec!["changed", run_id],
            DesktopNote::Changed {
                run_id,
                now: Some(now),
            } => {
                let count = now.event_count.to_string();
                let fields = [
                    "changed",
                    run_id,
                    &now.phase,
                    flag(now.idle),
                    &count,
                    flag(now.passed_over),
                    now.outcome_hex.as_deref().unwrap_or(""),
                ];
                return serde_json::to_string(&fields).unwrap_or_default();
            }
            DesktopNote::GivenBack { run_id } => vec!["given_back", run_id],
            DesktopNote::Cancelled { run_id } => vec!["cancelled", run_id],
            DesktopNote::Released => vec!["released"],
        };
        serde_json::to_string(&fields).unwrap_or_default()
    }

    fn decode(line: &str) -> Option<DesktopNote> {
        let fields: Vec<String> = serde_json::from_str(line).ok()?;
        let mut f = fields.into_iter();
        let kind = f.next()?;
        let mut next = || f.next();
        Some(match kind.as_str() {
            "offered" => DesktopNote::Offered {
                run_id: next()?,
                org_id: next()?,
                owner_id: next()?,
            },
            "changed" => {
                let run_id = next()?;
                let now = match next() {
                    None => None,
                    Some(phase) => Some(AssignmentState {
                        phase,
                        idle: next()? == "1",
                        event_count: next()?.parse().ok()?,
                        passed_over: next()? == "1",
                        outcome_hex: next().filter(|o| !o.is_empty()),
                    }),
                };
                DesktopNote::Changed { run_id, now }
            }
            "given_back" => DesktopNote::GivenBack { run_id: next()? },
            "cancelled" => DesktopNote::Cancelled { run_id: next()? },
            "released" => DesktopNote::Released,
            _ => return None,
        })
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

/// Hears desktop notes: from NOTIFY on PostgreSQL, in-process on SQLite.
pub struct DesktopListener {
    local: broadcast::Receiver<DesktopNote>,
    listener: Option<PgListener>,
    backend: Backend,
}

impl std::fmt::Debug for DesktopListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DesktopListener")
            .field("listening", &self.listener.is_some())
            .finish()
    }
}

impl DesktopListener {
    /// The next notes, or `Nothing` after `max`.
    pub async fn next(&mut self, max: Duration) -> Heard {
        if self.backend == Backend::Sqlite {
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
        }
        let Some(listener) = self.listener.as_mut() else {
            tokio::time::sleep(max).await;
            return Heard::Nothing;
        };
        match tokio::time::timeout(max, listener.recv()).await {
            Err(_) => Heard::Nothing,
            Ok(Ok(n)) => DesktopNote::parse(n.payload()).map_or(Heard::Missed, Heard::Notes),
            Ok(Err(error)) => {
                // sqlx connects again on the next receive; what was sent
                // meanwhile is lost.
                tracing::warn!(%error, "LISTEN connection lost; reconnecting");
                tokio::time::sleep(max.min(Duration::from_millis(200))).await;
                Heard::Missed
            }
        }
    }
}

/// Tells in-process watchers that runs were created.
pub(crate) fn runs_created() {
    Topic::Runs.signal_local();
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
    listener: Option<PgListener>,
}

/// The watcher coordinators use for new runs.
pub type RunWatcher = Watcher;

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("topic", &self.topic)
            .field("listening", &self.listener.is_some())
            .finish()
    }
}

impl Store {
    /// A watcher of run creation; on PostgreSQL it also listens for other
    /// processes (falling back to polling alone if it cannot).
    pub async fn watch_new_runs(&self) -> RunWatcher {
        self.watch(Topic::Runs).await
    }

    /// A watcher of `topic`; on PostgreSQL it also listens for other
    /// processes (falling back to polling alone if it cannot).
    pub async fn watch(&self, topic: Topic) -> Watcher {
        let listener = match self.backend() {
            Backend::Postgres => match connect_listener(self.url(), topic).await {
                Ok(l) => Some(l),
                Err(error) => {
                    tracing::warn!(%error, ?topic, "cannot LISTEN; polling only");
                    None
                }
            },
            Backend::Sqlite => None,
        };
        Watcher {
            topic,
            seen: topic.channel().generation.load(Ordering::SeqCst),
            listener,
        }
    }

    /// A listener of desktop notes; on PostgreSQL a LISTEN connection of its
    /// own (polling alone, hearing nothing, if it cannot connect).
    pub async fn listen_desktop(&self) -> DesktopListener {
        let listener = match self.backend() {
            Backend::Postgres => match connect_listener(self.url(), Topic::Desktop).await {
                Ok(l) => Some(l),
                Err(error) => {
                    tracing::warn!(%error, "cannot LISTEN for desktop notes; polling only");
                    None
                }
            },
            Backend::Sqlite => None,
        };
        DesktopListener {
            local: local_notes().subscribe(),
            listener,
            backend: self.backend(),
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
            let sent = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(Topic::Desktop.pg_channel())
                .bind(payload)
                .execute(self.db())
                .await;
            if let Err(error) = sent {
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
                Topic::Desktop => "",
            };
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(topic.pg_channel())
                .bind(payload)
                .execute(self.db())
                .await?;
        }
        Ok(())
    }
}

async fn connect_listener(url: &str, topic: Topic) -> std::result::Result<PgListener, sqlx::Error> {
    let mut l = PgListener::connect(url).await?;
    l.listen(topic.pg_channel()).await?;
    Ok(l)
}

impl Watcher {
    /// Takes every signal so far as seen: called just before reading what
    /// the signals announce (a signal is sent after its commit, so the read
    /// that follows sees it), so that the next [`Watcher::wait`] returns
    /// only for news after the read.
    pub fn consume(&mut self) {
        self.seen = self.topic.channel().generation.load(Ordering::SeqCst);
        if let Some(l) = self.listener.as_mut() {
            while l.next_buffered().is_some() {}
        }
    }

    /// Returns when the topic was signalled since the last call (or
    /// [`Watcher::consume`]), or after `max`. A notification this process
    /// sent is not news: its in-process signal came first.
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
            match self.listener.as_mut() {
                Some(l) => {
                    let lost = loop {
                        match l.recv().await {
                            Ok(n) if n.payload() == process_token() => {}
                            Ok(_) => break None,
                            Err(error) => break Some(error),
                        }
                    };
                    if let Some(error) = lost {
                        tracing::warn!(%error, "LISTEN connection lost; polling only");
                        self.listener = None;
                        std::future::pending::<()>().await;
                    }
                }
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
