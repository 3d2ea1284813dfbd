-- What the console shows: the reason an owner gave when pausing an
-- automation, and whether each runner is connected and when it was last
-- seen. A runner's newest stream names the runner-gateway replica holding
-- it (holder) and when it closed; each replica beats in
-- runner_gateway_replicas while it runs, so a stream of a replica that died
-- reads as offline once its beat is stale: one write per replica, however
-- many streams it holds.

ALTER TABLE automations ADD COLUMN pause_reason TEXT;

ALTER TABLE runner_streams ADD COLUMN holder TEXT NOT NULL DEFAULT '';
ALTER TABLE runner_streams ADD COLUMN closed_at BIGINT;

CREATE TABLE runner_gateway_replicas (
    id       TEXT PRIMARY KEY,
    seen_at  BIGINT NOT NULL
);
