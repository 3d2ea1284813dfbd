//! Webhook endpoints (`automesh.v1.Notifications`, passed on by the
//! gateway): what an owner registers, checked here because only the
//! scheduler knows what its operator allows; and the signing secret of
//! each, derived from the operator's notification key and the endpoint's
//! id, so the database holds no secret at all.

use std::net::IpAddr;
use std::time::Duration;

use automesh_domain::notification::new_endpoint_id;
use automesh_domain::{Notice, Principal, Secret, Violations, WebhookEndpoint};
use automesh_edge::convert;
use automesh_proto::scheduler::v1 as spb;
use automesh_proto::v1 as pb;
use automesh_store::notifications::WebhookMessage;
use base64::Engine;
use chrono::Utc;
use reqwest::Url;

use crate::error::Error;
use crate::service::Scheduler;

/// What the operator configured for webhooks.
#[derive(Debug, Clone)]
pub struct Webhooks {
    /// Each endpoint's signing secret is derived from it.
    pub key: Secret,
    /// `http://` endpoints are allowed (dev, tests).
    pub allow_http: bool,
    /// Loopback, private, link-local and other non-public addresses are
    /// allowed (dev, tests).
    pub allow_private: bool,
    /// Bound on one delivery attempt (connect, send, answer).
    pub timeout: Duration,
    /// The wait before the first retry; each next one doubles it, up to an
    /// hour, with jitter.
    pub first_retry: Duration,
    /// How long a message is retried before its endpoint is disabled.
    pub retry_for: Duration,
}

/// The longest URL an endpoint may have.
const URL_LIMIT: usize = 2048;
/// The longest description.
const DESCRIPTION_LIMIT: usize = 500;

/// Query parameter names that say a secret rides in the URL.
const SECRET_WORDS: [&str; 8] = [
    "secret",
    "token",
    "key",
    "password",
    "passwd",
    "signature",
    "auth",
    "credential",
];

impl Webhooks {
    /// The signing secret of `endpoint_id`: `whsec_` and the base64 of
    /// HMAC-SHA256(key, "automesh webhook endpoint " + id).
    pub fn secret(&self, endpoint_id: &str) -> Secret {
        let name = format!("automesh webhook endpoint {endpoint_id}");
        let key = hmac_sha256::HMAC::mac(name.as_bytes(), self.key.expose().as_bytes());
        let encoded = base64::engine::general_purpose::STANDARD.encode(key);
        Secret::from(format!("whsec_{encoded}"))
    }

    /// `url` as an endpoint may have it, or why not.
    pub fn check_url(&self, url: &str) -> Result<Url, String> {
        if url.trim().is_empty() {
            return Err("required: the https URL messages are posted to".into());
        }
        if url.len() > URL_LIMIT {
            return Err(format!("at most {URL_LIMIT} bytes"));
        }
        let parsed = Url::parse(url).map_err(|e| format!("not an absolute URL ({e})"))?;
        match parsed.scheme() {
            "https" => {}
            "http" if self.allow_http => {}
            "http" => {
                return Err(
                    "must be https (http is allowed only where the operator allows it)".into(),
                );
            }
            other => return Err(format!("scheme {other:?}: must be https")),
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err("must not carry credentials (user:password@): receivers check the signature instead".into());
        }
        for (name, _) in parsed.query_pairs() {
            let lower = name.to_ascii_lowercase();
            if SECRET_WORDS.iter().any(|w| lower.contains(w)) {
                return Err(format!(
                    "must not carry a secret (query parameter {name:?}): receivers check the signature instead"
                ));
            }
        }
        let private = match parsed.host() {
            None => return Err("must name a host".into()),
            Some(url::Host::Domain(d)) => {
                let d = d.trim_end_matches('.').to_ascii_lowercase();
                d == "localhost" || d.ends_with(".localhost")
            }
            Some(url::Host::Ipv4(ip)) => !is_public(IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => !is_public(IpAddr::V6(ip)),
        };
        if private && !self.allow_private {
            return Err(
                "names a loopback or private address, which the operator does not allow".into(),
            );
        }
        Ok(parsed)
    }
}

/// Whether `ip` is a public unicast address (what a delivery may reach
/// unless the operator allows private ones).
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_private()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (b == 18 || b == 19))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || first == 0x2001 && v6.segments()[1] == 0xdb8)
        }
    }
}

fn endpoint_to_pb(e: &WebhookEndpoint) -> pb::WebhookEndpoint {
    pb::WebhookEndpoint {
        id: e.id.clone(),
        url: e.url.clone(),
        description: e.description.clone(),
        create_time: Some(convert::timestamp(e.created_at)),
        disable_time: e.disabled_at.map(convert::timestamp),
        disabled_reason: e.disabled_reason.clone().unwrap_or_default(),
    }
}

fn message_to_pb(m: &WebhookMessage) -> pb::WebhookMessage {
    pb::WebhookMessage {
        id: m.message_id.clone(),
        event_type: m.event_type.as_str().to_owned(),
        payload: m.payload.clone(),
        create_time: Some(convert::timestamp(m.created_at)),
        attempts: m.attempts,
        next_attempt_time: m.next_attempt_at.map(convert::timestamp),
        deliver_time: m.delivered_at.map(convert::timestamp),
        last_error: m.last_error.clone().unwrap_or_default(),
    }
}

/// The calls of `automesh.v1.Notifications`, for their caller.
impl Scheduler {
    fn webhooks(&self) -> Result<&Webhooks, Error> {
        self.webhook_settings().ok_or(Error::NotificationsOff)
    }

    pub(crate) async fn serve_create_endpoint(
        &self,
        owner: Principal,
        create: pb::CreateWebhookEndpointRequest,
    ) -> Result<spb::CreateWebhookEndpointResponse, Error> {
        let webhooks = self.webhooks()?;
        let mut v = Violations::default();
        let url = webhooks.check_url(&create.url);
        if let Err(why) = &url {
            v.field("url", why.clone());
        }
        if create.description.chars().count() > DESCRIPTION_LIMIT {
            v.field(
                "description",
                format!("at most {DESCRIPTION_LIMIT} characters"),
            );
        }
        let url = match url {
            Ok(url) if v.is_empty() => url,
            _ => return Err(Error::Invalid(v)),
        };
        let endpoint = WebhookEndpoint {
            id: new_endpoint_id(),
            org_id: owner.org_id.clone(),
            owner_id: owner.user_id.clone(),
            url: url.to_string(),
            description: create.description,
            created_at: Utc::now(),
            disabled_at: None,
            disabled_reason: None,
        };
        let created = self.store().create_webhook_endpoint(&endpoint).await;
        let created = created.map_err(Error::Endpoint)?;
        tracing::info!(endpoint_id = %created.id, "webhook endpoint created");
        let response = pb::CreateWebhookEndpointResponse {
            secret: webhooks.secret(&created.id).expose().to_owned(),
            endpoint: Some(endpoint_to_pb(&created)),
        };
        Ok(spb::CreateWebhookEndpointResponse {
            response: Some(response),
        })
    }

    pub(crate) async fn serve_list_endpoints(
        &self,
        owner: Principal,
        _list: pb::ListWebhookEndpointsRequest,
    ) -> Result<spb::ListWebhookEndpointsResponse, Error> {
        let listed = self.store().list_webhook_endpoints(&owner).await;
        let endpoints = listed.map_err(Error::Endpoint)?;
        let endpoints = endpoints.iter().map(endpoint_to_pb).collect();
        let response = pb::ListWebhookEndpointsResponse { endpoints };
        Ok(spb::ListWebhookEndpointsResponse {
            response: Some(response),
        })
    }

    pub(crate) async fn serve_delete_endpoint(
        &self,
        owner: Principal,
        delete: pb::DeleteWebhookEndpointRequest,
    ) -> Result<spb::DeleteWebhookEndpointResponse, Error> {
        convert::require_id(&delete.id, "id")?;
        let deleted = self.store().delete_webhook_endpoint(&owner, &delete.id);
        deleted.await.map_err(Error::Endpoint)?;
        tracing::info!(endpoint_id = %delete.id, "webhook endpoint deleted");
        Ok(spb::DeleteWebhookEndpointResponse {
            response: Some(pb::DeleteWebhookEndpointResponse {}),
        })
    }

    pub(crate) async fn serve_test_endpoint(
        &self,
        owner: Principal,
        test: pb::TestWebhookEndpointRequest,
    ) -> Result<spb::TestWebhookEndpointResponse, Error> {
        self.webhooks()?;
        convert::require_id(&test.id, "id")?;
        let endpoint = self.store().get_webhook_endpoint(&owner, &test.id).await;
        let endpoint = endpoint.map_err(Error::Endpoint)?;
        if let Some(why) = &endpoint.disabled_reason {
            return Err(Error::EndpointDisabled(why.clone()));
        }
        let notice = Notice::test(&owner, &endpoint.id, Utc::now());
        let queued = self.store().enqueue_for_endpoint(&notice, &endpoint.id);
        queued.await.map_err(Error::Endpoint)?;
        let response = pb::TestWebhookEndpointResponse {
            message_id: notice.id,
        };
        Ok(spb::TestWebhookEndpointResponse {
            response: Some(response),
        })
    }

    pub(crate) async fn serve_list_messages(
        &self,
        owner: Principal,
        list: pb::ListWebhookMessagesRequest,
    ) -> Result<spb::ListWebhookMessagesResponse, Error> {
        convert::require_id(&list.endpoint_id, "endpoint_id")?;
        let size = match list.page_size {
            0 => 50,
            n @ 1..=500 => n as u32,
            _ => {
                let mut v = Violations::default();
                v.field("page_size", "between 1 and 500 (0 is 50)");
                return Err(Error::Invalid(v));
            }
        };
        let listed = self
            .store()
            .webhook_messages(&owner, &list.endpoint_id, size);
        let messages = listed.await.map_err(Error::Endpoint)?;
        let messages = messages.iter().map(message_to_pb).collect();
        let response = pb::ListWebhookMessagesResponse { messages };
        Ok(spb::ListWebhookMessagesResponse {
            response: Some(response),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strict() -> Webhooks {
        Webhooks {
            key: Secret::from("operator key"),
            allow_http: false,
            allow_private: false,
            timeout: Duration::from_secs(1),
            first_retry: Duration::from_secs(1),
            retry_for: Duration::from_secs(60),
        }
    }

    #[test]
    fn urls_are_https_public_and_carry_no_secret() {
        let w = strict();
        assert!(w.check_url("https://hooks.example.com/automesh").is_ok());
        for (bad, why) in [
            ("hooks.example.com/x", "absolute"),
            ("http://hooks.example.com/x", "https"),
            ("ftp://hooks.example.com/x", "https"),
            ("https://user:pw@hooks.example.com/x", "credentials"),
            ("https://hooks.example.com/x?token=abc", "secret"),
            ("https://hooks.example.com/x?api_key=abc", "secret"),
            ("https://127.0.0.1/x", "private"),
            ("https://10.1.2.3/x", "private"),
            ("https://[::1]/x", "private"),
            ("https://[::ffff:192.168.1.1]/x", "private"),
            ("https://169.254.169.254/latest/meta-data", "private"),
            ("https://localhost:8443/x", "private"),
            ("", "required"),
        ] {
            let refused = w.check_url(bad).expect_err(bad);
            assert!(refused.contains(why), "{bad}: {refused}");
        }
        let dev = Webhooks {
            allow_http: true,
            allow_private: true,
            ..strict()
        };
        assert!(dev.check_url("http://127.0.0.1:9000/hook").is_ok());
    }

    #[test]
    fn each_endpoint_has_its_own_secret_from_the_key() {
        let w = strict();
        let a = w.secret("ep_a");
        assert_eq!(a, w.secret("ep_a"));
        assert_ne!(a, w.secret("ep_b"));
        assert!(a.expose().starts_with("whsec_"));
        // A secret the Standard Webhooks library takes.
        assert!(standardwebhooks::Webhook::new(a.expose()).is_ok());
        let other = Webhooks {
            key: Secret::from("another key"),
            ..strict()
        };
        assert_ne!(a, other.secret("ep_a"));
    }
}
