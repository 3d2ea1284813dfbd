-- Time partitions (docs/retention.md). Runs, their events and receipts are
-- range-partitioned by run id: a run id starts with `r` and twelve hex
-- digits of a time in milliseconds (crates/domain/src/ids.rs), so a week
-- is a range of ids, a lookup by id is pruned to one partition, and
-- retention drops a week whose every run is past its retention instead of
-- deleting its rows. The tables as they were become the `_legacy`
-- partition of the ids below 'r' (the UUIDs made before this format; no
-- row is copied) and retention deletes those in batches as before; the
-- `_default` partition holds what no week does (an occurrence recorded
-- after its week was dropped). Weeks are created ahead of need, by this
-- migration and by every retention pass.

-- A manual run's idempotency key names one run (its id is no longer the
-- key's hash, but starts with the time it was requested).
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

-- A partitioned table's unique keys must contain the partition key: the
-- run id is in each. Foreign keys into runs go (a week is dropped whole,
-- events and receipts with it; the store writes a run's children in the
-- run's own transactions).
ALTER TABLE run_events DROP CONSTRAINT run_events_run_id_fkey;
ALTER TABLE receipts DROP CONSTRAINT receipts_run_id_fkey;
DROP TRIGGER runs_terminal_is_final ON runs;

ALTER TABLE runs RENAME TO runs_legacy;
ALTER INDEX runs_pkey RENAME TO runs_legacy_pkey;
ALTER INDEX runs_by_owner RENAME TO runs_legacy_by_owner;
ALTER INDEX runs_by_automation RENAME TO runs_legacy_by_automation;
ALTER INDEX runs_live RENAME TO runs_legacy_live;
ALTER INDEX runs_claimable RENAME TO runs_legacy_claimable;
ALTER INDEX runs_live_by_automation RENAME TO runs_legacy_live_by_automation;
ALTER INDEX runs_expiry RENAME TO runs_legacy_expiry;
-- Proves the legacy rows' range without a second scan at ATTACH.
ALTER TABLE runs_legacy ADD CONSTRAINT runs_legacy_ids CHECK (id < 'r');

CREATE TABLE runs (LIKE runs_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (id);
ALTER TABLE runs DROP CONSTRAINT runs_legacy_ids;
ALTER TABLE runs ADD PRIMARY KEY (id);
ALTER TABLE runs ADD CONSTRAINT runs_automation_id_fkey
    FOREIGN KEY (automation_id) REFERENCES automations (id);
CREATE INDEX runs_by_owner ON runs (org_id, owner_id, created_at DESC, id DESC);
CREATE INDEX runs_by_automation ON runs (automation_id, created_at DESC, id DESC);
CREATE INDEX runs_live ON runs (deadline_at)
    WHERE state IN ('pending', 'waking', 'admitted', 'running');
CREATE INDEX runs_claimable ON runs (lease_expires_at)
    WHERE state IN ('pending', 'waking', 'admitted', 'running');
CREATE INDEX runs_live_by_automation ON runs (automation_id)
    WHERE state IN ('pending', 'waking', 'admitted', 'running');
CREATE INDEX runs_expiry ON runs (org_id, created_at, id)
    WHERE state IN ('succeeded', 'failed', 'timed_out', 'cancelled', 'skipped', 'missed');
CREATE TRIGGER runs_terminal_is_final
    BEFORE UPDATE OF state ON runs
    FOR EACH ROW EXECUTE FUNCTION automesh_terminal_run_is_final();
ALTER TABLE runs ATTACH PARTITION runs_legacy FOR VALUES FROM (MINVALUE) TO ('r');
CREATE TABLE runs_default PARTITION OF runs DEFAULT;

ALTER TABLE run_events RENAME TO run_events_legacy;
ALTER INDEX run_events_pkey RENAME TO run_events_legacy_pkey;
ALTER INDEX run_events_run_id_event_id_key RENAME TO run_events_legacy_run_id_event_id_key;
ALTER TABLE run_events_legacy ADD CONSTRAINT run_events_legacy_ids CHECK (run_id < 'r');
CREATE TABLE run_events (LIKE run_events_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (run_id);
ALTER TABLE run_events DROP CONSTRAINT run_events_legacy_ids;
ALTER TABLE run_events ADD PRIMARY KEY (run_id, seq);
ALTER TABLE run_events ADD CONSTRAINT run_events_run_id_event_id_key UNIQUE (run_id, event_id);
ALTER TABLE run_events ATTACH PARTITION run_events_legacy FOR VALUES FROM (MINVALUE) TO ('r');
CREATE TABLE run_events_default PARTITION OF run_events DEFAULT;

ALTER TABLE receipts RENAME TO receipts_legacy;
ALTER INDEX receipts_pkey RENAME TO receipts_legacy_pkey;
ALTER TABLE receipts_legacy ADD CONSTRAINT receipts_legacy_ids CHECK (run_id < 'r');
CREATE TABLE receipts (LIKE receipts_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (run_id);
ALTER TABLE receipts DROP CONSTRAINT receipts_legacy_ids;
ALTER TABLE receipts ADD PRIMARY KEY (run_id);
ALTER TABLE receipts ATTACH PARTITION receipts_legacy FOR VALUES FROM (MINVALUE) TO ('r');
CREATE TABLE receipts_default PARTITION OF receipts DEFAULT;

-- The lowest run id of the instant `at_us` (microseconds since the epoch):
-- crates/domain/src/ids.rs `run_id_bound`, which a test keeps equal.
CREATE FUNCTION automesh_run_id_bound(at_us BIGINT) RETURNS TEXT AS $$
    SELECT 'r' || lpad(to_hex(at_us / 1000), 12, '0')
$$ LANGUAGE sql IMMUTABLE STRICT;

-- Creates the week partitions (Monday 00:00 UTC) of runs, run_events and
-- receipts from the week of `now_us` to `weeks_ahead` weeks after it,
-- where missing. A week whose rows the default partition already holds
-- (no partition was there when they came) cannot be made: it is left to
-- the default partition and named in the answer, with its table.
CREATE FUNCTION automesh_ensure_run_partitions(now_us BIGINT, weeks_ahead INT)
RETURNS TABLE (partition TEXT, created BOOLEAN) AS $$
DECLARE
    week_start TIMESTAMP;
    lo TEXT;
    hi TEXT;
    parent TEXT;
    name TEXT;
BEGIN
    week_start := date_trunc('week', to_timestamp(now_us / 1000000.0) AT TIME ZONE 'UTC');
    FOR i IN 0..weeks_ahead LOOP
        lo := automesh_run_id_bound((extract(epoch FROM week_start) * 1000000)::BIGINT);
        hi := automesh_run_id_bound(
            (extract(epoch FROM week_start + INTERVAL '7 days') * 1000000)::BIGINT);
        FOREACH parent IN ARRAY ARRAY['runs', 'run_events', 'receipts'] LOOP
            name := parent || '_p' || to_char(week_start, 'YYYYMMDD');
            IF to_regclass(name) IS NULL THEN
                BEGIN
                    EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
                                   name, parent, lo, hi);
                    partition := name;
                    created := true;
                    RETURN NEXT;
                EXCEPTION WHEN check_violation THEN
                    partition := name;
                    created := false;
                    RETURN NEXT;
                END;
            END IF;
        END LOOP;
        week_start := week_start + INTERVAL '7 days';
    END LOOP;
END;
$$ LANGUAGE plpgsql;

SELECT count(*) FROM automesh_ensure_run_partitions(
    (extract(epoch FROM now()) * 1000000)::BIGINT, 2);

-- Why the week partition `week` (its `YYYYMMDD`) must stay, or NULL when
-- every run in it is finished and was created longer ago than its
-- organisation's retention (`default_days` unless org_retention names
-- one), and than `least_days` whatever it is. One probe of the partition's
-- `runs_live` index, and two of its `runs_expiry` index per organisation.
CREATE FUNCTION automesh_run_partition_kept(week TEXT, now_us BIGINT, default_days BIGINT,
                                            least_days BIGINT)
RETURNS TEXT AS $$
DECLARE
    part TEXT := 'runs_p' || week;
    org TEXT := '';
    newest BIGINT;
    days BIGINT;
    live BOOLEAN;
BEGIN
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE state IN '
                   '(''pending'', ''waking'', ''admitted'', ''running''))', part) INTO live;
    IF live THEN
        RETURN 'a run in it is still going';
    END IF;
    LOOP
        EXECUTE format('SELECT min(org_id) FROM %I WHERE org_id > $1 AND state IN '
                       '(''succeeded'', ''failed'', ''timed_out'', ''cancelled'', ''skipped'', ''missed'')',
                       part) INTO org USING org;
        EXIT WHEN org IS NULL;
        EXECUTE format('SELECT max(created_at) FROM %I WHERE org_id = $1 AND state IN '
                       '(''succeeded'', ''failed'', ''timed_out'', ''cancelled'', ''skipped'', ''missed'')',
                       part) INTO newest USING org;
        SELECT retention_days INTO days FROM org_retention WHERE org_id = org;
        days := greatest(coalesce(days, default_days), least_days);
        IF newest >= now_us - days * 86400000000 THEN
            RETURN format('organisation %s keeps runs in it', org);
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

-- The rows the week partition `week` holds, table by table (0 for a table
-- whose week could not be made: those rows are in its default partition).
CREATE FUNCTION automesh_run_partition_rows(week TEXT)
RETURNS TABLE (runs BIGINT, run_events BIGINT, receipts BIGINT) AS $$
BEGIN
    runs := 0;
    run_events := 0;
    receipts := 0;
    IF to_regclass('runs_p' || week) IS NOT NULL THEN
        EXECUTE format('SELECT count(*) FROM %I', 'runs_p' || week) INTO runs;
    END IF;
    IF to_regclass('run_events_p' || week) IS NOT NULL THEN
        EXECUTE format('SELECT count(*) FROM %I', 'run_events_p' || week) INTO run_events;
    END IF;
    IF to_regclass('receipts_p' || week) IS NOT NULL THEN
        EXECUTE format('SELECT count(*) FROM %I', 'receipts_p' || week) INTO receipts;
    END IF;
    RETURN NEXT;
END;
$$ LANGUAGE plpgsql;

-- Drops the week partition `week` of `parent` (runs, run_events or
-- receipts) when automesh_run_partition_kept says nothing keeps the week,
-- checked again under the lock the drop needs anyway: NULL when dropped (or
-- not there), or why the week stays. Only that parent is locked, before its
-- partitions as every statement locks them, so a drop never holds one lock
-- while it waits for another; a run written into the week while its
-- receipts or events partition is dropped has them routed to the default
-- partition, and keeps its week's runs. The caller bounds the wait
-- (lock_timeout), since writers queue behind it; held for a few index
-- probes and the drop.
CREATE FUNCTION automesh_drop_run_partition(parent TEXT, week TEXT, now_us BIGINT,
                                            default_days BIGINT, least_days BIGINT)
RETURNS TEXT AS $$
DECLARE
    kept TEXT;
BEGIN
    IF parent NOT IN ('runs', 'run_events', 'receipts') THEN
        RAISE EXCEPTION 'not a partitioned table of runs: %', parent;
    END IF;
    EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', parent);
    IF to_regclass('runs_p' || week) IS NULL THEN
        RETURN NULL;
    END IF;
    kept := automesh_run_partition_kept(week, now_us, default_days, least_days);
    IF kept IS NULL THEN
        EXECUTE format('DROP TABLE IF EXISTS %I', parent || '_p' || week);
    END IF;
    RETURN kept;
END;
$$ LANGUAGE plpgsql;
