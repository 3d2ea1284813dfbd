//! The `runner_streams` table: each runner's newest stream, on whichever
//! replica holds it. Opening a stream takes over the runner's live claims,
//! so an older stream (here or on another replica) can no longer claim or
//! report.

use chrono::{DateTime, Utc};

use crate::rows::{self, col, micros};
use crate::{Result, Store};

const OPEN_STREAM: &str = "INSERT INTO runner_streams (runner_id, stream_id, opened_at, holder) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (runner_id) \
     DO UPDATE SET stream_id = excluded.stream_id, opened_at = excluded.opened_at, \
     holder = excluded.holder, closed_at = NULL";

/// A runner-gateway replica is alive at `$2`: every stream it holds is seen.
const REPLICA_SEEN: &str = "INSERT INTO runner_gateway_replicas (id, seen_at) VALUES ($1, $2) \
     ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at";

/// Replicas gone for long: their streams then read as last seen when opened.
const FORGET_REPLICAS: &str = "DELETE FROM runner_gateway_replicas WHERE seen_at < $1";

/// The stream ended, unless a newer one of the runner replaced it.
const CLOSE_STREAM: &str =
    "UPDATE runner_streams SET closed_at = $3 WHERE runner_id = $1 AND stream_id = $2";

/// The newest stream takes over everything of its runner's that is live,
/// and the runner gets a fresh chance at what it sat on.
const TAKE_OVER_CLAIMS: &str = "UPDATE desktop_assignments SET stream_id = $2, updated_at = $3 \
     WHERE runner_id = $1 AND phase <> 'finished'";
const FORGIVE: &str = "UPDATE desktop_assignments SET passed_over = NULL \
     WHERE passed_over = $1 AND phase = 'admitted'";

const STREAMS_OPENED_SINCE: &str =
    "SELECT runner_id, stream_id FROM runner_streams WHERE opened_at >= $1";

impl Store {
    /// Records `stream_id`, held by the runner-gateway replica `holder`, as
    /// the newest stream of `runner_id`: it takes over the runner's live
    /// claims, older streams can no longer claim or report, and what the
    /// runner sat on may be offered to it again. The holder is seen now.
    pub async fn open_runner_stream(
        &self,
        runner_id: &str,
        stream_id: &str,
        holder: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let stream = (runner_id, stream_id, micros(now));
        let mut tx = self.begin_write().await?;
        let opened = (runner_id, stream_id, micros(now), holder);
        rows::execute(&mut *tx, OPEN_STREAM, opened).await?;
        rows::execute(&mut *tx, REPLICA_SEEN, (holder, micros(now))).await?;
        rows::execute(&mut *tx, TAKE_OVER_CLAIMS, stream).await?;
        rows::execute(&mut *tx, FORGIVE, (runner_id,)).await?;
        // Nothing to tell: the replica holding the stream reconciles what
        // the runner should run, and the others notice the newer stream
        // within their poll.
        tx.commit().await?;
        Ok(())
    }

    /// The runner-gateway replica `replica` is alive at `now`: one write
    /// marks every stream it holds as seen. A replica that stops beating
    /// (it died) has its streams read as offline once the beat is older than
    /// the listing's bound; replicas not seen for `forget_after` are
    /// forgotten.
    pub async fn runner_gateway_seen(
        &self,
        replica: &str,
        now: DateTime<Utc>,
        forget_after: chrono::Duration,
    ) -> Result<()> {
        let mut tx = self.begin_write().await?;
        rows::execute(&mut *tx, REPLICA_SEEN, (replica, micros(now))).await?;
        rows::execute(&mut *tx, FORGET_REPLICAS, (micros(now - forget_after),)).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records that the stream `stream_id` of `runner_id` ended at `now`
    /// (nothing when a newer stream of the runner replaced it).
    pub async fn close_runner_stream(
        &self,
        runner_id: &str,
        stream_id: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        rows::execute(self.db(), CLOSE_STREAM, (runner_id, stream_id, micros(now))).await?;
        Ok(())
    }

    /// Runner streams opened at or after `since`: (runner id, stream id).
    pub async fn runner_streams_opened_since(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<(String, String)>> {
        rows::all(self.db(), STREAMS_OPENED_SINCE, (micros(since),), |row| {
            Ok((col(row, "runner_id")?, col(row, "stream_id")?))
        })
        .await
    }
}
