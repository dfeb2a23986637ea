-- Budget reservations in batches: a gateway process sends the reservations that arrive
-- while its previous round trip is in flight as one call of budget_reserve_batch()
-- (docs/billing.md). It admits them in the order given, each exactly as budget_reserve()
-- (0010) would one after another: against every budget it names or none, only if spend
-- plus open reservations plus its amount stays within each limit. Each distinct budget
-- is locked once (the same transaction-scoped advisory lock as budget_reserve(), so
-- replicas running either function exclude each other), in the order given (the caller
-- sorts them, so no deadlock); its spend and open reservations are read once, in one
-- snapshot, and the batch's admissions are counted on top as they are decided. The locks
-- last one statement (this function, in autocommit), never a longer transaction, and no
-- row lock is waited for.
--
-- Parameters: per call (in arrival order) its reservation id, amount (micro-USD) and TTL
-- (seconds); the distinct budgets (parallel arrays, in lock order); per (call, budget)
-- pair, grouped by call in call order: the 1-based call index, the 1-based budget index
-- and the limit (micro-USD) the call holds that budget to.
-- Returns per call 0 when admitted, else the 1-based position among that call's pairs of
-- the first budget it does not fit.
CREATE FUNCTION budget_reserve_batch
  ( p_reservations uuid[], p_amounts bigint[], p_ttl_seconds double precision[]
  , p_scopes text[], p_ids uuid[], p_periods text[], p_starts date[]
  , p_calls integer[], p_budgets integer[], p_limits bigint[] )
RETURNS integer[]
LANGUAGE plpgsql AS $$
DECLARE
  n_calls integer := coalesce(array_length(p_reservations, 1), 0);
  n_pairs integer := coalesce(array_length(p_calls, 1), 0);
  used numeric[] := '{}';
  answers integer[] := array_fill(0, ARRAY[n_calls]);
  i integer;
  c integer;
  j integer := 1;
  first integer;
  refused integer;
  total numeric;
BEGIN
  FOR i IN 1 .. coalesce(array_length(p_scopes, 1), 0) LOOP
    PERFORM pg_advisory_xact_lock(
      hashtextextended(p_scopes[i] || ':' || p_ids[i] || ':' || p_periods[i] || ':' || p_starts[i], 24));
    -- Housekeeping only (expired rows are not counted below either), so it never waits
    -- on a row another transaction holds (a ledger batch deleting it as it ships).
    DELETE FROM budget_reservations r
     WHERE r.ctid = ANY (ARRAY(
       SELECT x.ctid FROM budget_reservations x
        WHERE x.scope = p_scopes[i] AND x.id = p_ids[i] AND x.period = p_periods[i]
          AND x.period_start = p_starts[i] AND x.expires_at <= now()
        FOR UPDATE SKIP LOCKED));
    SELECT coalesce((SELECT ceil(s.cost_usd * 1000000) FROM budget_spend s
                      WHERE s.scope = p_scopes[i] AND s.id = p_ids[i] AND s.period = p_periods[i]
                        AND s.period_start = CASE p_periods[i] WHEN 'total' THEN DATE '-infinity'
                                                              ELSE p_starts[i] END), 0)
         + coalesce((SELECT sum(r.amount_micro_usd) FROM budget_reservations r
                      WHERE r.scope = p_scopes[i] AND r.id = p_ids[i] AND r.period = p_periods[i]
                        AND r.period_start = p_starts[i] AND r.expires_at > now()), 0)
      INTO total;
    used[i] := total;
  END LOOP;
  FOR c IN 1 .. n_calls LOOP
    first := j;
    refused := 0;
    WHILE j <= n_pairs AND p_calls[j] = c LOOP
      IF refused = 0 AND used[p_budgets[j]] + p_amounts[c] > p_limits[j] THEN
        refused := j - first + 1;
      END IF;
      j := j + 1;
    END LOOP;
    IF refused = 0 THEN
      FOR i IN first .. j - 1 LOOP
        used[p_budgets[i]] := used[p_budgets[i]] + p_amounts[c];
      END LOOP;
    END IF;
    answers[c] := refused;
  END LOOP;
  INSERT INTO budget_reservations (reservation_id, scope, id, period, period_start, amount_micro_usd, expires_at)
  SELECT p_reservations[p_calls[g.k]], p_scopes[p_budgets[g.k]], p_ids[p_budgets[g.k]],
         p_periods[p_budgets[g.k]], p_starts[p_budgets[g.k]], p_amounts[p_calls[g.k]],
         now() + make_interval(secs => p_ttl_seconds[p_calls[g.k]])
  FROM generate_subscripts(p_calls, 1) AS g (k)
  WHERE answers[p_calls[g.k]] = 0
  ON CONFLICT (reservation_id, scope) DO NOTHING;
  RETURN answers;
END;
$$;
