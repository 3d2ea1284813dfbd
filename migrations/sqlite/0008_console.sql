-- What the console shows: the reason an owner gave when pausing an
-- automation, and when each runner's newest stream was last known to be
-- held (refreshed by the replica holding it) and when it closed.

ALTER TABLE automations ADD COLUMN pause_reason TEXT;

ALTER TABLE runner_streams ADD COLUMN seen_at INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runner_streams ADD COLUMN closed_at INTEGER;
