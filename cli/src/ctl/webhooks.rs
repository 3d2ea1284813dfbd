//! `ctl webhooks`: the caller's webhook endpoints (automesh.v1.Notifications).

use automesh_proto::v1 as pb;
use automesh_proto::v1::notifications_client::NotificationsClient;
use clap::Subcommand;

use super::{Authed, explain, ts};

#[derive(Debug, Subcommand)]
pub(super) enum WebhooksCommand {
    /// Register an endpoint; its signing secret is printed once.
    Create {
        /// Where messages are posted (https; http and private addresses
        /// only where the operator allows them, as `dev` does).
        #[arg(long)]
        url: String,
        #[arg(long, default_value = "")]
        description: String,
    },
    /// List your endpoints, with why one is disabled.
    List,
    /// Delete an endpoint and every message waiting for it.
    Delete { id: String },
    /// Queue a `webhook.test` message to an endpoint.
    Test { id: String },
    /// The newest messages of an endpoint and what their delivery did.
    Messages {
        id: String,
        #[arg(long, default_value_t = 20)]
        limit: i32,
    },
}

pub(super) async fn run(channel: Authed, command: WebhooksCommand) -> anyhow::Result<()> {
    let mut client = NotificationsClient::new(channel);
    match command {
        WebhooksCommand::Create { url, description } => {
            let request = pb::CreateWebhookEndpointRequest { url, description };
            let created = client.create_webhook_endpoint(request).await;
            let created = created.map_err(explain)?.into_inner();
            let endpoint = created.endpoint.unwrap_or_default();
            println!("endpoint: {}", endpoint.id);
            println!("url:      {}", endpoint.url);
            println!("secret (shown once): {}", created.secret);
        }
        WebhooksCommand::List => {
            let listed = client
                .list_webhook_endpoints(pb::ListWebhookEndpointsRequest {})
                .await;
            let listed = listed.map_err(explain)?.into_inner();
            println!("{:<35}  {:<8}  URL", "ENDPOINT", "STATUS");
            for e in listed.endpoints {
                let status = if e.disable_time.is_some() {
                    "disabled"
                } else {
                    "enabled"
                };
                println!("{:<35}  {status:<8}  {}", e.id, e.url);
                if !e.disabled_reason.is_empty() {
                    println!("  disabled {}: {}", ts(&e.disable_time), e.disabled_reason);
                }
            }
        }
        WebhooksCommand::Delete { id } => {
            let request = pb::DeleteWebhookEndpointRequest { id: id.clone() };
            client
                .delete_webhook_endpoint(request)
                .await
                .map_err(explain)?;
            println!("endpoint {id} deleted");
        }
        WebhooksCommand::Test { id } => {
            let request = pb::TestWebhookEndpointRequest { id };
            let queued = client.test_webhook_endpoint(request).await;
            let queued = queued.map_err(explain)?.into_inner();
            println!("test message {} queued", queued.message_id);
        }
        WebhooksCommand::Messages { id, limit } => {
            let request = pb::ListWebhookMessagesRequest {
                endpoint_id: id,
                page_size: limit,
            };
            let listed = client.list_webhook_messages(request).await;
            let listed = listed.map_err(explain)?.into_inner();
            println!(
                "{:<36}  {:<31}  {:<9}  {:>8}  LAST ERROR",
                "MESSAGE", "TYPE", "STATUS", "ATTEMPTS"
            );
            for m in listed.messages {
                let status = match (&m.deliver_time, &m.next_attempt_time) {
                    (Some(_), _) => "delivered",
                    (None, Some(_)) => "pending",
                    (None, None) => "given up",
                };
                println!(
                    "{:<36}  {:<31}  {status:<9}  {:>8}  {}",
                    m.id, m.event_type, m.attempts, m.last_error
                );
            }
        }
    }
    Ok(())
}
