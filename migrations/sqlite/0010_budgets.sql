-- Budgets (owners in control): the most one run of an automation
-- may spend, in micro-units of the catalogue's currency and in tokens
-- (input and output together); NULL is no cap. A run keeps the caps its
-- automation had when it was created, and its receipt the caps it ran
-- under.

ALTER TABLE automations ADD COLUMN max_cost_micros INTEGER CHECK (max_cost_micros >= 0);
ALTER TABLE automations ADD COLUMN max_tokens INTEGER CHECK (max_tokens >= 0);
ALTER TABLE runs ADD COLUMN max_cost_micros INTEGER;
ALTER TABLE runs ADD COLUMN max_tokens INTEGER;
ALTER TABLE receipts ADD COLUMN max_cost_micros INTEGER;
ALTER TABLE receipts ADD COLUMN max_tokens INTEGER;

-- A monthly budget per automation: the most its runs created in a calendar
-- month of its schedule's zone may cost together (the sum of their
-- receipts); NULL is none. Automations paused for a spent budget are found
-- by the scheduler's month sweep through their own index.
ALTER TABLE automations ADD COLUMN monthly_budget_micros INTEGER CHECK (monthly_budget_micros >= 0);
CREATE INDEX automations_budget_spent ON automations (id) WHERE attention_reason = 'budget_exhausted';
