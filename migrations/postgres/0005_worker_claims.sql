-- A worker's start is a lease held by the replica starting it (`starter`,
-- renewed until `start_until`): a start whose holder died is taken over
-- as soon as its lease lapses, not after the readiness cap. A ready worker
-- records which agent process answers at its endpoint (`agent_id`), so a
-- replica that finds the agent gone marks exactly that agent lost, never
-- one started since.

ALTER TABLE cloud_workers ADD COLUMN starter TEXT;
ALTER TABLE cloud_workers ADD COLUMN start_until BIGINT NOT NULL DEFAULT 0;
ALTER TABLE cloud_workers ADD COLUMN agent_id TEXT;

-- Replicas resume cloud runs whose driver stopped renewing its lease.
CREATE INDEX cloud_dispatch_unfinished ON cloud_dispatch (driver_until) WHERE phase <> 'finished';
