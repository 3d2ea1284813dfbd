-- Delivery finds the due webhook messages by their next attempt, across
-- endpoints (the claim), through this index of the pending ones only.

CREATE INDEX webhook_messages_next ON webhook_messages (next_attempt_at)
    WHERE next_attempt_at IS NOT NULL;
