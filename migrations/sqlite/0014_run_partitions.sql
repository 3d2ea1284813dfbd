-- Run ids start with the time they were made for (crates/domain/src/ids.rs);
-- PostgreSQL partitions runs by them (migrations/postgres/0014). Here only
-- the guard that keeps a manual run's idempotency key naming one run, its
-- id no longer being the key's hash.
CREATE TABLE run_keys (
    automation_id   TEXT   NOT NULL,
    idempotency_key TEXT   NOT NULL,
    run_id          TEXT   NOT NULL,
    created_at      BIGINT NOT NULL,
    PRIMARY KEY (automation_id, idempotency_key)
);
CREATE INDEX run_keys_by_run ON run_keys (run_id);
INSERT INTO run_keys (automation_id, idempotency_key, run_id, created_at)
    SELECT automation_id, idempotency_key, id, created_at FROM runs
    WHERE trigger = 'manual' AND idempotency_key IS NOT NULL
    ON CONFLICT DO NOTHING;
