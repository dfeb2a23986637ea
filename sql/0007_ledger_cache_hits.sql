-- A call answered from the response cache is recorded with cost_source 'cache' and a
-- cost of 0: the provider was not called, so nothing was spent.
ALTER TABLE usage_ledger DROP CONSTRAINT usage_ledger_cost_source_known;
ALTER TABLE usage_ledger ADD CONSTRAINT usage_ledger_cost_source_known
  CHECK (cost_source IN ('provider', 'price', 'unpriced', 'none', 'cache'));
