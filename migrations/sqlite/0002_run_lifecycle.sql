-- The run lifecycle: the message identity persisted before submission,
-- cancellation requests, phase timings, and claim bookkeeping.

ALTER TABLE runs ADD COLUMN message_id TEXT;
ALTER TABLE runs ADD COLUMN cancel_requested_at INTEGER;
ALTER TABLE runs ADD COLUMN admitted_at INTEGER;
ALTER TABLE runs ADD COLUMN started_at INTEGER;
ALTER TABLE runs ADD COLUMN claims INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN executor_seq INTEGER NOT NULL DEFAULT 0;

-- Coordinators claim live runs whose lease is free or expired.
CREATE INDEX runs_claimable ON runs (lease_expires_at)
    WHERE state IN ('pending', 'waking', 'admitted', 'running');

-- The scheduler's overlap check: is a run of this automation still live?
CREATE INDEX runs_live_by_automation ON runs (automation_id)
    WHERE state IN ('pending', 'waking', 'admitted', 'running');
