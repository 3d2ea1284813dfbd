-- The newest stream of each runner, whichever replica holds it: a replica
-- holding an older stream of the runner closes it, and only the newest may
-- claim an assignment. A claim names the stream that holds it (stream_id),
-- so only that stream's reports count. A claim not accepted within the
-- bound is given back, and the runner that sat on it (passed_over) is not
-- offered it again until it opens a new stream.

CREATE TABLE runner_streams (
    runner_id  TEXT PRIMARY KEY,
    stream_id  TEXT NOT NULL,
    opened_at  BIGINT NOT NULL
);
CREATE INDEX runner_streams_opened ON runner_streams (opened_at);

ALTER TABLE desktop_assignments ADD COLUMN stream_id TEXT;
ALTER TABLE desktop_assignments ADD COLUMN claimed_at BIGINT NOT NULL DEFAULT 0;
ALTER TABLE desktop_assignments ADD COLUMN passed_over TEXT;
CREATE INDEX desktop_unaccepted ON desktop_assignments (claimed_at)
    WHERE phase = 'admitted' AND runner_id IS NOT NULL;
