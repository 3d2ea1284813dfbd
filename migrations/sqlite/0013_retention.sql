-- Retention (docs/retention.md): finished runs, with their events,
-- receipts and dispatch rows, are deleted once older than their
-- organisation's retention period (the operator's default unless
-- org_retention names one), and delivered or given-up webhook messages
-- likewise, in bounded batches, by one scheduler at a time.

CREATE TABLE org_retention (
    org_id         TEXT PRIMARY KEY,
    retention_days BIGINT NOT NULL CHECK (retention_days >= 1 AND retention_days <= 36500),
    updated_at     BIGINT NOT NULL
);

-- Which scheduler runs the next pass, and when: claimed_until is both the
-- claim of a pass under way and, once it is done, when the next is due.
CREATE TABLE retention_passes (
    name          TEXT PRIMARY KEY,
    claimed_until BIGINT NOT NULL DEFAULT 0,
    last_done_at  BIGINT
);
INSERT INTO retention_passes (name) VALUES ('runs');

-- A pass walks the organisations with finished runs (one probe each) and
-- each one's oldest finished runs first.
CREATE INDEX runs_expiry ON runs (org_id, created_at, id)
    WHERE state IN ('succeeded', 'failed', 'timed_out', 'cancelled', 'skipped', 'missed');

-- An endpoint's messages that are done with (delivered or given up), oldest
-- first.
CREATE INDEX webhook_messages_done ON webhook_messages (endpoint_id, created_at)
    WHERE next_attempt_at IS NULL;
