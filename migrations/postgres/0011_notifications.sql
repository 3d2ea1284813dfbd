-- Notifications (owners in control): webhook endpoints an owner
-- registers, and an outbox of messages to them. A message is written in
-- the transaction of the change that causes it, one row per endpoint of
-- the owner, under a message id derived from the cause (so writing it
-- again is a no-op and every retry carries the same `webhook-id`).
--
-- No secret is stored: an endpoint's signing secret is derived from the
-- operator's notification key and the endpoint's id.
--
-- claimed_until fences delivery per endpoint: a delivery process claims
-- an endpoint (never more than one at a time per endpoint), and a failing
-- endpoint is not claimed again before its next retry. disabled_at and
-- disabled_reason say why an endpoint no longer receives anything.

CREATE TABLE webhook_endpoints (
    id              TEXT PRIMARY KEY,
    org_id          TEXT NOT NULL,
    owner_id        TEXT NOT NULL,
    url             TEXT NOT NULL,
    description     TEXT NOT NULL DEFAULT '',
    created_at      BIGINT NOT NULL,
    disabled_at     BIGINT,
    disabled_reason TEXT,
    claimed_until   BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX webhook_endpoints_by_owner ON webhook_endpoints (org_id, owner_id, created_at);

-- next_attempt_at is NULL once the message is delivered (delivered_at) or
-- given up (last_error says why).
CREATE TABLE webhook_messages (
    endpoint_id     TEXT NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    message_id      TEXT NOT NULL,
    event_type      TEXT NOT NULL,
    payload         TEXT NOT NULL,
    created_at      BIGINT NOT NULL,
    next_attempt_at BIGINT,
    attempts        INTEGER NOT NULL DEFAULT 0,
    delivered_at    BIGINT,
    last_error      TEXT,
    PRIMARY KEY (endpoint_id, message_id)
);
CREATE INDEX webhook_messages_due ON webhook_messages (endpoint_id, next_attempt_at)
    WHERE next_attempt_at IS NOT NULL;
