-- Failure streaks (owners in control): after pause_after_failures
-- consecutive runs of an automation end failed or timed out, it needs
-- attention (failing_repeatedly) and its schedule pauses; 0 never pauses.
-- failure_streak counts the streak, streak_codes keeps the error codes of
-- its newest runs as a JSON array of strings, oldest first. A run's end
-- writes both in the transaction that ends it.

ALTER TABLE automations ADD COLUMN pause_after_failures INTEGER NOT NULL DEFAULT 3
    CHECK (pause_after_failures >= 0);
ALTER TABLE automations ADD COLUMN failure_streak INTEGER NOT NULL DEFAULT 0;
ALTER TABLE automations ADD COLUMN streak_codes TEXT NOT NULL DEFAULT '[]';
