-- automesh schema, SQLite flavour. The PostgreSQL flavour beside it has the
-- same tables, columns and meaning. Instants are INTEGER microseconds since the
-- Unix epoch in both, so one set of queries serves both backends.

CREATE TABLE automations (
    id                TEXT PRIMARY KEY,
    org_id            TEXT   NOT NULL,
    owner_id          TEXT   NOT NULL,
    name              TEXT   NOT NULL,
    prompt            TEXT   NOT NULL,
    model             TEXT   NOT NULL,
    placement         TEXT   NOT NULL CHECK (placement IN ('desktop', 'cloud')),
    surface           TEXT   NOT NULL CHECK (surface IN ('desktop', 'web', 'cloud_chat')),
    schedule          TEXT   NOT NULL,
    state             TEXT   NOT NULL CHECK (state IN ('active', 'inactive', 'needs_attention', 'archived')),
    attention_reason  TEXT,
    attention_message TEXT,
    version           INTEGER NOT NULL,
    next_run_at       INTEGER,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL
);

CREATE INDEX automations_by_owner ON automations (org_id, owner_id, created_at DESC, id DESC);
-- The scheduler reads only due, active rows: its cost does not grow with
-- inactive or far-future automations.
CREATE INDEX automations_due ON automations (next_run_at)
    WHERE state = 'active' AND next_run_at IS NOT NULL;

-- Placement is fixed at creation (SPEC §1): the store refuses to change it.
CREATE TRIGGER automations_placement_is_immutable
    BEFORE UPDATE OF placement ON automations
    FOR EACH ROW WHEN NEW.placement <> OLD.placement
BEGIN
    SELECT RAISE(ABORT, 'placement is immutable');
END;

CREATE TABLE runs (
    id               TEXT PRIMARY KEY,
    automation_id    TEXT   NOT NULL REFERENCES automations (id),
    org_id           TEXT   NOT NULL,
    owner_id         TEXT   NOT NULL,
    placement        TEXT   NOT NULL CHECK (placement IN ('desktop', 'cloud')),
    trigger          TEXT   NOT NULL CHECK (trigger IN ('schedule', 'manual')),
    scheduled_for    INTEGER,
    idempotency_key  TEXT,
    prompt           TEXT   NOT NULL,
    model            TEXT   NOT NULL,
    state            TEXT   NOT NULL CHECK (state IN ('pending', 'waking', 'admitted', 'running',
                                  'succeeded', 'failed', 'timed_out', 'cancelled', 'skipped', 'missed')),
    error_code       TEXT,
    error_message    TEXT,
    deadline_at      INTEGER NOT NULL,
    traceparent      TEXT,
    last_event_seq   INTEGER NOT NULL DEFAULT 0,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL
);

CREATE INDEX runs_by_owner ON runs (org_id, owner_id, created_at DESC, id DESC);
CREATE INDEX runs_by_automation ON runs (automation_id, created_at DESC, id DESC);
CREATE INDEX runs_live ON runs (deadline_at)
    WHERE state IN ('pending', 'waking', 'admitted', 'running');

-- A terminal run never changes state again (SPEC §4).
CREATE TRIGGER runs_terminal_is_final
    BEFORE UPDATE OF state ON runs
    FOR EACH ROW WHEN OLD.state IN ('succeeded', 'failed', 'timed_out', 'cancelled', 'skipped', 'missed')
                  AND NEW.state <> OLD.state
BEGIN
    SELECT RAISE(ABORT, 'run is terminal');
END;

CREATE TABLE run_events (
    run_id     TEXT   NOT NULL REFERENCES runs (id),
    seq        INTEGER NOT NULL,
    event_id   TEXT   NOT NULL,
    kind       TEXT   NOT NULL,
    payload    TEXT   NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (run_id, seq),
    UNIQUE (run_id, event_id)
);

CREATE TABLE receipts (
    run_id        TEXT PRIMARY KEY REFERENCES runs (id),
    outcome       TEXT   NOT NULL,
    error_code    TEXT,
    error_message TEXT,
    placement     TEXT   NOT NULL,
    engine        TEXT,
    queued_us     INTEGER NOT NULL DEFAULT 0,
    wake_us       INTEGER NOT NULL DEFAULT 0,
    admission_us  INTEGER NOT NULL DEFAULT 0,
    execution_us  INTEGER NOT NULL DEFAULT 0,
    input_tokens  INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cost_micros   INTEGER NOT NULL DEFAULT 0,
    worker_id     TEXT,
    workspace_id  TEXT,
    thread_id     TEXT,
    message_id    TEXT,
    created_at    INTEGER NOT NULL
);

CREATE TABLE cloud_workers (
    id             TEXT PRIMARY KEY,
    org_id         TEXT   NOT NULL,
    owner_id       TEXT   NOT NULL,
    state          TEXT   NOT NULL CHECK (state IN ('stopped', 'starting', 'ready', 'stopping', 'failed')),
    driver         TEXT   NOT NULL,
    endpoint       TEXT,
    last_active_at INTEGER,
    created_at     INTEGER NOT NULL,
    updated_at     INTEGER NOT NULL,
    UNIQUE (org_id, owner_id)
);

CREATE TABLE runners (
    id           TEXT PRIMARY KEY,
    org_id       TEXT   NOT NULL,
    owner_id     TEXT   NOT NULL,
    name         TEXT   NOT NULL,
    created_at   INTEGER NOT NULL,
    revoked_at   INTEGER,
    last_seen_at INTEGER
);

CREATE INDEX runners_by_owner ON runners (org_id, owner_id);

-- Only a SHA-256 of each runner token is stored.
CREATE TABLE runner_tokens (
    token_hash TEXT PRIMARY KEY,
    runner_id  TEXT   NOT NULL REFERENCES runners (id),
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);
