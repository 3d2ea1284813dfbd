//! Wake-ups between services: in-process (dev mode and tests run several
//! services in one process) and, on PostgreSQL, across processes with
//! LISTEN/NOTIFY. Two topics: runs were created (`automesh_runs`, for
//! run-coordinators) and desktop dispatch changed (`automesh_desktop`, for
//! runner-gateway replicas). A wake-up is only a hint: every watcher also
//! polls, so a lost one delays work by at most the poll interval, and never
//! loses it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::Notify;

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

/// Tells in-process watchers that runs were created.
pub(crate) fn runs_created() {
    Topic::Runs.signal_local();
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

    /// Wakes the watchers of `topic`, in this process and (on PostgreSQL)
    /// in every other.
    pub async fn signal(&self, topic: Topic) -> Result<()> {
        topic.signal_local();
        if self.backend() == Backend::Postgres {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(topic.pg_channel())
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
    /// Returns when the topic was signalled since the last call, or after
    /// `max`.
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
                    if let Err(error) = l.recv().await {
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
