//! Webhook delivery: a loop beside the occurrence loop that claims
//! endpoints with a message due (never one endpoint twice at once, across
//! every scheduler replica), posts each due message signed as the Standard
//! Webhooks specification says, and records what each attempt did.
//!
//! Isolation: each claimed endpoint is its own task, up to
//! [`IN_FLIGHT`] at once, and stops at its first failed attempt; a failing
//! endpoint is not claimed again before its retry is due. So a slow or dead
//! endpoint costs one task for one attempt's bound, and never delays
//! another owner's. Nothing here is on the run path: the outbox row is
//! written by the change that causes it, and only read here.
//!
//! At least once: an attempt is recorded after it is made, so a process
//! killed between the two leaves the message due; another process claims
//! the endpoint once the claim runs out and sends it again, with the same
//! `webhook-id`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use automesh_domain::WebhookEndpoint;
use automesh_store::notifications::{Attempt, WebhookMessage};
use automesh_store::{Store, Topic};
use chrono::{DateTime, Utc};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::webhooks::Webhooks;

/// Endpoints delivered to at once by one process.
pub const IN_FLIGHT: usize = 256;
/// Messages one claim of an endpoint sends at most.
const BATCH: u32 = 8;
/// How long the loop sleeps when nothing wakes it.
const POLL: Duration = Duration::from_secs(1);
/// How soon it looks again after a wake-up.
const RECHECK: Duration = Duration::from_millis(50);
/// The most of an answer's body that is read (then the connection is
/// dropped): a receiver cannot make delivery hold a large answer.
const BODY_LIMIT: usize = 64 * 1024;
/// The longest wait between two attempts of a message.
const RETRY_MAX: Duration = Duration::from_secs(3600);

fn deliveries() -> &'static Counter<u64> {
    static C: OnceLock<Counter<u64>> = OnceLock::new();
    C.get_or_init(|| {
        automesh_telemetry::metrics::counter(
            "automesh.webhook.attempts",
            "Webhook delivery attempts, by outcome (delivered, failed, given_up) and event type",
        )
    })
}

fn lag() -> &'static Histogram<f64> {
    static H: OnceLock<Histogram<f64>> = OnceLock::new();
    H.get_or_init(|| {
        automesh_telemetry::metrics::seconds(
            "automesh.webhook.delivery.lag",
            "From the change that caused a webhook message to its receiver's 2xx, by event type",
            &[
                0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 600.0, 3600.0, 86400.0,
            ],
        )
    })
}

impl Webhooks {
    /// When a message that failed its `attempts`-th attempt at `now` is
    /// tried again: `first_retry` doubled per attempt up to an hour, less
    /// up to a quarter at random; `None` past its retry window.
    pub fn retry_at(
        &self,
        attempts: i64,
        created_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let doubled = self
            .first_retry
            .saturating_mul(1u32 << attempts.clamp(1, 20).saturating_sub(1) as u32);
        let base = doubled.min(RETRY_MAX).max(Duration::from_millis(1));
        let spread = base.as_millis() as u64 / 4;
        let random = (uuid::Uuid::new_v4().as_u128() as u64) % spread.max(1);
        let wait = base - Duration::from_millis(random);
        let at = now + chrono::Duration::from_std(wait).ok()?;
        let end = created_at + chrono::Duration::from_std(self.retry_for).ok()?;
        (at <= end).then_some(at)
    }

    /// How long a claim of an endpoint lasts: two attempts at their bound
    /// and a margin. A batch makes an attempt only while one more fits in
    /// its claim, so a process killed mid-delivery holds the endpoint no
    /// longer than this, and its message goes out again from another.
    fn claim_for(&self) -> chrono::Duration {
        let bound = self.timeout * 2 + Duration::from_secs(2);
        chrono::Duration::from_std(bound).unwrap_or(chrono::Duration::seconds(60))
    }

    /// The client every attempt goes through: bounded, no redirects, and
    /// (unless the operator allows them) no private addresses, whatever a
    /// name resolves to.
    fn client(&self) -> reqwest::Result<reqwest::Client> {
        let mut builder = reqwest::Client::builder()
            .timeout(self.timeout)
            .connect_timeout(self.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("automesh-webhooks/", env!("CARGO_PKG_VERSION")))
            .pool_max_idle_per_host(2);
        if !self.allow_private {
            builder = builder.dns_resolver(Arc::new(PublicOnly));
        }
        builder.build()
    }
}

/// A resolver that answers only public addresses.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let public: Vec<_> = found
                .filter(|a| crate::webhooks::is_public(a.ip()))
                .collect();
            if public.is_empty() {
                let why = format!("{host} resolves to no public address");
                return Err(why.into());
            }
            let addrs: reqwest::dns::Addrs = Box::new(public.into_iter());
            Ok(addrs)
        })
    }
}

/// Delivers until `stop` is cancelled.
pub async fn run_loop(store: Store, webhooks: Arc<Webhooks>, stop: CancellationToken) {
    let client = match webhooks.client() {
        Ok(c) => c,
        Err(error) => {
            tracing::error!(%error, "cannot build the webhook client; no delivery");
            return;
        }
    };
    let mut watcher = store.watch(Topic::Notifications).await;
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut tasks = JoinSet::new();
    // A wake-up that found nothing is looked at again shortly: on SQLite
    // it comes just before the commit of what it announces.
    let mut again = false;
    while !stop.is_cancelled() {
        watcher.consume();
        let free = slots.available_permits().min(64) as u32;
        let mut full = false;
        if free > 0 {
            let now = Utc::now();
            let t0 = std::time::Instant::now();
            let until = now + webhooks.claim_for();
            match store
                .internal()
                .claim_webhook_endpoints(now, until, free)
                .await
            {
                Ok(claimed) => {
                    tracing::debug!(
                        claimed = claimed.len(),
                        free,
                        took_ms = t0.elapsed().as_millis() as u64,
                        "webhook endpoints claimed"
                    );
                    full = claimed.len() as u32 == free;
                    for endpoint in claimed {
                        let Ok(slot) = slots.clone().try_acquire_owned() else {
                            break;
                        };
                        let (store, webhooks) = (store.clone(), webhooks.clone());
                        let client = client.clone();
                        tasks.spawn(async move {
                            deliver(&store, &webhooks, &client, &endpoint, until).await;
                            drop(slot);
                        });
                    }
                }
                Err(error) => tracing::warn!(%error, "cannot claim webhook endpoints"),
            }
        }
        if full {
            continue;
        }
        let wait = if again { RECHECK } else { POLL };
        let waited = tokio::time::Instant::now();
        again = false;
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = watcher.wait(wait) => again = waited.elapsed() < wait,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    tasks.abort_all();
}

/// Sends the due messages of one endpoint claimed until `claimed_until`,
/// oldest first, until one fails or the claim has no room for another
/// attempt; records what each attempt did and releases the endpoint.
async fn deliver(
    store: &Store,
    webhooks: &Webhooks,
    client: &reqwest::Client,
    endpoint: &WebhookEndpoint,
    claimed_until: DateTime<Utc>,
) {
    let due = store
        .internal()
        .due_webhook_messages(&endpoint.id, Utc::now(), BATCH)
        .await;
    let due = match due {
        Ok(due) => due,
        Err(error) => {
            // The claim runs out and another pass tries again.
            tracing::warn!(%error, endpoint_id = %endpoint.id, "cannot read due webhook messages");
            return;
        }
    };
    tracing::debug!(endpoint_id = %endpoint.id, due = due.len(), "delivering");
    let secret = webhooks.secret(&endpoint.id);
    let signer = match standardwebhooks::Webhook::new(secret.expose()) {
        Ok(s) => s,
        Err(error) => {
            tracing::error!(%error, "a derived webhook secret does not decode");
            return;
        }
    };
    let (mut attempts, mut release, mut disable) = (vec![], Utc::now(), None);
    let bound = chrono::Duration::from_std(webhooks.timeout).unwrap_or_default();
    for m in due {
        // Only while one more attempt fits in the claim: past it, another
        // process may claim the endpoint.
        if Utc::now() + bound > claimed_until {
            break;
        }
        let outcome = attempt(client, &signer, endpoint, &m).await;
        let now = Utc::now();
        let kind = KeyValue::new("event_type", m.event_type.as_str());
        match outcome {
            Ok(()) => {
                deliveries().add(1, &[KeyValue::new("outcome", "delivered"), kind.clone()]);
                let since = (now - m.created_at).to_std().unwrap_or_default();
                lag().record(since.as_secs_f64(), &[kind]);
                attempts.push((m.message_id, Attempt::Delivered));
            }
            Err(error) => {
                let retry_at = webhooks.retry_at(m.attempts + 1, m.created_at, now);
                let outcome = if retry_at.is_some() {
                    "failed"
                } else {
                    "given_up"
                };
                deliveries().add(1, &[KeyValue::new("outcome", outcome), kind]);
                if retry_at.is_none() {
                    let reason = format!(
                        "message {} was not delivered within {}s of retries (last: {error}); \
                         create the endpoint again to receive messages",
                        m.message_id,
                        webhooks.retry_for.as_secs()
                    );
                    tracing::warn!(endpoint_id = %endpoint.id, %reason, "webhook endpoint disabled");
                    disable = Some(reason);
                }
                release = retry_at.unwrap_or(now);
                attempts.push((m.message_id, Attempt::Failed { error, retry_at }));
                break;
            }
        }
    }
    let recorded = store.internal().record_webhook_attempts(
        &endpoint.id,
        &attempts,
        release,
        disable.as_deref(),
        Utc::now(),
    );
    if let Err(error) = recorded.await {
        // Left due: sent again once the claim runs out (at least once).
        tracing::warn!(%error, endpoint_id = %endpoint.id, "cannot record webhook attempts");
    }
}

/// One attempt: the message posted, signed; `Err` says why it failed.
async fn attempt(
    client: &reqwest::Client,
    signer: &standardwebhooks::Webhook,
    endpoint: &WebhookEndpoint,
    m: &WebhookMessage,
) -> Result<(), String> {
    let span = tracing::info_span!(
        "webhook.deliver",
        otel.kind = "client",
        endpoint_id = %endpoint.id,
        message_id = %m.message_id,
        event_type = m.event_type.as_str(),
        attempt = m.attempts + 1,
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    let result = async {
        let timestamp = Utc::now().timestamp();
        let signature = signer
            .sign(&m.message_id, timestamp, m.payload.as_bytes())
            .map_err(|e| format!("cannot sign: {e}"))?;
        let response = client
            .post(&endpoint.url)
            .header("content-type", "application/json")
            .header(standardwebhooks::HEADER_WEBHOOK_ID, &m.message_id)
            .header(
                standardwebhooks::HEADER_WEBHOOK_TIMESTAMP,
                timestamp.to_string(),
            )
            .header(standardwebhooks::HEADER_WEBHOOK_SIGNATURE, signature)
            .body(m.payload.clone())
            .send()
            .await
            .map_err(describe)?;
        let status = response.status();
        tracing::Span::current().record("http.response.status_code", status.as_u16());
        drain(response).await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("answered HTTP {}", status.as_u16()))
        }
    }
    .instrument(span.clone())
    .await;
    if let Err(error) = &result {
        span.record("error.type", error.as_str());
    }
    result
}

/// Reads at most [`BODY_LIMIT`] of an answer (within the client's bound),
/// so a small answer leaves its connection reusable; the rest is dropped.
async fn drain(mut response: reqwest::Response) {
    let mut read = 0;
    while let Ok(Some(chunk)) = response.chunk().await {
        read += chunk.len();
        if read >= BODY_LIMIT {
            break;
        }
    }
}

/// Why a request failed, without its URL (which the endpoint list shows).
fn describe(e: reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        // The innermost cause: a refused connection, a name that resolves
        // to no public address.
        let mut cause: &dyn std::error::Error = &e;
        while let Some(next) = cause.source() {
            cause = next;
        }
        format!("could not connect ({cause})")
    } else if e.is_redirect() {
        "answered a redirect, which is not followed".into()
    } else {
        e.without_url().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::dns::Resolve;

    #[tokio::test]
    async fn names_that_resolve_to_private_addresses_are_not_reached() {
        let name = "localhost".parse().expect("a name");
        let refused = PublicOnly.resolve(name).await.err().expect("refused");
        assert!(
            refused.to_string().contains("no public address"),
            "{refused}"
        );
    }

    #[test]
    fn retries_double_with_jitter_until_the_window_ends() {
        let w = Webhooks {
            key: automesh_domain::Secret::from("operator key of tests"),
            allow_http: false,
            allow_private: false,
            timeout: Duration::from_secs(10),
            first_retry: Duration::from_secs(5),
            retry_for: Duration::from_secs(24 * 3600),
        };
        let t0 = Utc::now();
        let wait = |n: i64| (w.retry_at(n, t0, t0).expect("within") - t0).num_milliseconds();
        assert!((3750..=5000).contains(&wait(1)), "{}", wait(1));
        assert!((7500..=10_000).contains(&wait(2)), "{}", wait(2));
        assert!(
            (2_700_000..=3_600_000).contains(&wait(30)),
            "capped at an hour"
        );
        let late = t0 + chrono::Duration::hours(24);
        assert_eq!(w.retry_at(3, t0, late), None, "past the window");
    }
}
