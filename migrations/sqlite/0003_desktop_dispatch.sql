-- Desktop dispatch, shared by every desktop-runner-gateway replica: an
-- assignment is offered here by whichever replica the coordinator called,
-- claimed for a runner by the replica holding that runner's stream, and
-- what the runner reports (acceptance, events, result, idle) is written
-- back here, where any replica serves it to the coordinator.
-- Bodies are protobuf messages, hex-encoded.

CREATE TABLE desktop_assignments (
    run_id           TEXT PRIMARY KEY,
    org_id           TEXT NOT NULL,
    owner_id         TEXT NOT NULL,
    spec             TEXT NOT NULL,
    runner_id        TEXT,
    phase            TEXT NOT NULL DEFAULT 'admitted'
                     CHECK (phase IN ('admitted', 'running', 'finished')),
    idle             INTEGER NOT NULL DEFAULT 0,
    outcome          TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    cancel_reason    TEXT,
    event_count      INTEGER NOT NULL DEFAULT 0,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL
);

-- What a replica's delivery pass looks for: runs no runner holds, and
-- cancellations not yet seen idle.
CREATE INDEX desktop_unclaimed ON desktop_assignments (created_at)
    WHERE phase = 'admitted' AND runner_id IS NULL;
CREATE INDEX desktop_cancelling ON desktop_assignments (runner_id)
    WHERE cancel_requested = 1 AND idle = 0;
CREATE INDEX desktop_by_owner ON desktop_assignments (org_id, owner_id)
    WHERE phase <> 'finished';

CREATE TABLE desktop_events (
    run_id    TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    event_id  TEXT NOT NULL,
    body      TEXT NOT NULL,
    PRIMARY KEY (run_id, seq),
    UNIQUE (run_id, event_id)
);
