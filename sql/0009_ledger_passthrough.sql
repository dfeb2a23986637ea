-- A pass-through call (/passthrough/{provider}/...) whose answer carried no usage object
-- the gateway recognises is recorded with zero tokens and cost_source 'passthrough'.
ALTER TABLE usage_ledger DROP CONSTRAINT usage_ledger_cost_source_known;
ALTER TABLE usage_ledger ADD CONSTRAINT usage_ledger_cost_source_known
  CHECK (cost_source IN ('provider', 'price', 'unpriced', 'none', 'cache', 'passthrough'));
