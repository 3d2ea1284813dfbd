//! `automesh.v1.Notifications`: webhook endpoints, kept and delivered by
//! the scheduler (which holds the operator's notification key and knows
//! which URLs the operator allows). Every call is passed on whole.

use automesh_proto::v1::notifications_server::Notifications;

use crate::Gateway;

#[tonic::async_trait]
impl Notifications for Gateway {
    crate::pass::passed! {
        create_webhook_endpoint(CreateWebhookEndpointRequest) -> CreateWebhookEndpointResponse;
        list_webhook_endpoints(ListWebhookEndpointsRequest) -> ListWebhookEndpointsResponse;
        delete_webhook_endpoint(DeleteWebhookEndpointRequest) -> DeleteWebhookEndpointResponse;
        test_webhook_endpoint(TestWebhookEndpointRequest) -> TestWebhookEndpointResponse;
        list_webhook_messages(ListWebhookMessagesRequest) -> ListWebhookMessagesResponse;
    }
}
