-- Cloud dispatch: one row per cloud run the lifecycle service admits. The
-- worker, workspace, thread and message identity is reserved here before
-- the prompt is submitted, so any replica (and any later coordinator)
-- observes or submits that exact message, never a second one.
-- `spec` and `outcome` are protobuf messages, hex-encoded.

CREATE TABLE cloud_dispatch (
    run_id           TEXT PRIMARY KEY,
    org_id           TEXT NOT NULL,
    owner_id         TEXT NOT NULL,
    worker_id        TEXT NOT NULL,
    workspace_id     TEXT NOT NULL,
    thread_id        TEXT NOT NULL,
    message_id       TEXT NOT NULL,
    spec             TEXT NOT NULL,
    phase            TEXT NOT NULL DEFAULT 'waking'
                     CHECK (phase IN ('waking', 'admitted', 'running', 'finished')),
    outcome          TEXT,
    cancel_requested BIGINT NOT NULL DEFAULT 0,
    wake_micros      BIGINT NOT NULL DEFAULT 0,
    admission_micros BIGINT NOT NULL DEFAULT 0,
    driver_owner     TEXT,
    driver_until     BIGINT NOT NULL DEFAULT 0,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL
);

-- Idle stop never selects a worker with a live run.
CREATE INDEX cloud_dispatch_live ON cloud_dispatch (worker_id) WHERE phase <> 'finished';
