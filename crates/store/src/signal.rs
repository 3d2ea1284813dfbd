//! Wake-ups for run-coordinators when runs are created: in-process (dev mode
//! and tests run several services in one process) and, on PostgreSQL, across
//! processes with LISTEN/NOTIFY on `automesh_runs`. A wake-up is only a
//! hint: coordinators also poll, so a lost one delays work by at most the
//! poll interval, and never loses it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::Notify;

use crate::{Backend, Store};

static GENERATION: AtomicU64 = AtomicU64::new(0);
static NOTIFY: Notify = Notify::const_new();

/// Tells in-process watchers that runs were created.
pub(crate) fn runs_created() {
    GENERATION.fetch_add(1, Ordering::SeqCst);
    NOTIFY.notify_waiters();
}

/// Waits for news of created runs.
pub struct RunWatcher {
    seen: u64,
    listener: Option<PgListener>,
}

impl std::fmt::Debug for RunWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunWatcher")
            .field("listening", &self.listener.is_some())
            .finish()
    }
}

impl Store {
    /// A watcher of run creation; on PostgreSQL it also listens for other
    /// processes (falling back to polling alone if it cannot).
    pub async fn watch_new_runs(&self) -> RunWatcher {
        let listener = match self.backend() {
            Backend::Postgres => match connect_listener(self.url()).await {
                Ok(l) => Some(l),
                Err(error) => {
                    tracing::warn!(%error, "cannot LISTEN for new runs; polling only");
                    None
                }
            },
            Backend::Sqlite => None,
        };
        RunWatcher {
            seen: GENERATION.load(Ordering::SeqCst),
            listener,
        }
    }
}

async fn connect_listener(url: &str) -> Result<PgListener, sqlx::Error> {
    let mut l = PgListener::connect(url).await?;
    l.listen("automesh_runs").await?;
    Ok(l)
}

impl RunWatcher {
    /// Returns when runs were created since the last call, or after `max`.
    pub async fn wait(&mut self, max: Duration) {
        let notified = NOTIFY.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = GENERATION.load(Ordering::SeqCst);
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
        self.seen = GENERATION.load(Ordering::SeqCst);
    }
}
