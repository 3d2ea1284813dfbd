-- A receipt keeps what its cost was computed from: the catalogue model the
-- run was priced by, the name the provider was asked for, and the price per
-- million tokens at the run's end (both NULL for an unpriced model). A later
-- price change never rewrites a receipt.

ALTER TABLE receipts ADD COLUMN model TEXT;
ALTER TABLE receipts ADD COLUMN provider_model TEXT;
ALTER TABLE receipts ADD COLUMN price_input_micros_per_mtok INTEGER;
ALTER TABLE receipts ADD COLUMN price_output_micros_per_mtok INTEGER;
