-- Budget reservations: before a call is sent, its worst-case cost is reserved against
-- every budget that applies (docs/billing.md). With PostgreSQL as the shared store (no
-- REDIS_URL) they live here: one row per call and budget, admitted by
-- budget_reserve() in one round trip, released by the ledger's own trigger in the same
-- transaction that adds the call's real cost to budget_spend, so spend plus open
-- reservations never drops a call in between. A reservation whose process died (no
-- ledger row ever comes) stops counting at expires_at.
CREATE TABLE budget_reservations
  -- The call's call_id: the ledger row that settles it carries the same id.
  ( reservation_id uuid NOT NULL
  , scope text NOT NULL
  , id uuid NOT NULL
  , period text NOT NULL
  , period_start date NOT NULL
  , amount_micro_usd bigint NOT NULL
  , expires_at timestamptz NOT NULL
  , PRIMARY KEY (reservation_id, scope)
  , CONSTRAINT budget_reservations_amount_nonnegative CHECK (amount_micro_usd >= 0)
  , CONSTRAINT budget_reservations_scope_known CHECK (scope IN ('key', 'subject'))
  );

CREATE INDEX budget_reservations_budget ON budget_reservations (scope, id, period, period_start);

-- Admit a reservation of p_amount micro-USD against every budget given (parallel arrays,
-- limits in micro-USD), or none of them. Returns 0 when admitted, else the 1-based index
-- of the first budget it does not fit. Each budget is locked (a transaction-scoped
-- advisory lock, taken in the callers' sorted order, so no deadlock) while its spend and
-- its open reservations are read in one statement: one snapshot, so a ledger batch
-- committing meanwhile is seen either whole (cost in, reservation out) or not at all.
CREATE FUNCTION budget_reserve
  ( p_reservation uuid, p_scopes text[], p_ids uuid[], p_periods text[], p_starts date[]
  , p_limits bigint[], p_amount bigint, p_ttl_seconds double precision )
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  i integer;
  used numeric;
BEGIN
  FOR i IN 1 .. coalesce(array_length(p_scopes, 1), 0) LOOP
    PERFORM pg_advisory_xact_lock(
      hashtextextended(p_scopes[i] || ':' || p_ids[i] || ':' || p_periods[i] || ':' || p_starts[i], 24));
    DELETE FROM budget_reservations r
     WHERE r.scope = p_scopes[i] AND r.id = p_ids[i] AND r.period = p_periods[i]
       AND r.period_start = p_starts[i] AND r.expires_at <= now();
    SELECT coalesce((SELECT ceil(s.cost_usd * 1000000) FROM budget_spend s
                      WHERE s.scope = p_scopes[i] AND s.id = p_ids[i] AND s.period = p_periods[i]
                        AND s.period_start = CASE p_periods[i] WHEN 'total' THEN DATE '-infinity'
                                                              ELSE p_starts[i] END), 0)
         + coalesce((SELECT sum(r.amount_micro_usd) FROM budget_reservations r
                      WHERE r.scope = p_scopes[i] AND r.id = p_ids[i] AND r.period = p_periods[i]
                        AND r.period_start = p_starts[i] AND r.expires_at > now()), 0)
      INTO used;
    IF used + p_amount > p_limits[i] THEN
      RETURN i;
    END IF;
  END LOOP;
  INSERT INTO budget_reservations (reservation_id, scope, id, period, period_start, amount_micro_usd, expires_at)
  SELECT p_reservation, p_scopes[g.k], p_ids[g.k], p_periods[g.k], p_starts[g.k], p_amount,
         now() + make_interval(secs => p_ttl_seconds)
  FROM generate_subscripts(p_scopes, 1) AS g (k)
  ON CONFLICT (reservation_id, scope) DO NOTHING;
  RETURN 0;
END;
$$;

-- The ledger's trigger, as in 0004, plus: the rows just inserted settle their calls'
-- reservations (deleted in the same transaction that adds their cost to budget_spend).
CREATE OR REPLACE FUNCTION usage_ledger_rollup() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO usage_daily AS d
    (day, api_key_id, subject_id, model, provider, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT (n.created_at AT TIME ZONE 'UTC')::date, n.api_key_id, n.subject_id,
         n.requested_model, coalesce(n.provider, ''), count(*),
         count(*) FILTER (WHERE n.status >= 400), sum(n.prompt_tokens),
         sum(n.completion_tokens), sum(n.cost_usd), coalesce(sum(n.cost_diem), 0)
  FROM new_rows n
  GROUP BY 1, 2, 3, 4, 5
  ORDER BY 1, 2, 3, 4, 5
  ON CONFLICT (day, api_key_id, subject_id, model, provider) DO UPDATE SET
    requests = d.requests + EXCLUDED.requests,
    errors = d.errors + EXCLUDED.errors,
    prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
    cost_usd = d.cost_usd + EXCLUDED.cost_usd,
    cost_diem = d.cost_diem + EXCLUDED.cost_diem;

  INSERT INTO budget_spend AS b (scope, id, period, period_start, cost_usd)
  SELECT v.scope, v.id, v.period, v.period_start, sum(c.cost_usd)
  FROM (SELECT (n.created_at AT TIME ZONE 'UTC')::date AS day, n.api_key_id, n.subject_id, n.cost_usd
        FROM new_rows n WHERE n.cost_usd > 0) c
  CROSS JOIN LATERAL (VALUES
    ('key', c.api_key_id, 'day', c.day),
    ('key', c.api_key_id, 'month', date_trunc('month', c.day)::date),
    ('key', c.api_key_id, 'total', DATE '-infinity'),
    ('subject', c.subject_id, 'day', c.day),
    ('subject', c.subject_id, 'month', date_trunc('month', c.day)::date),
    ('subject', c.subject_id, 'total', DATE '-infinity')
  ) AS v (scope, id, period, period_start)
  GROUP BY 1, 2, 3, 4
  ORDER BY 1, 2, 3, 4
  ON CONFLICT (scope, id, period, period_start) DO UPDATE SET
    cost_usd = b.cost_usd + EXCLUDED.cost_usd;

  DELETE FROM budget_reservations r USING new_rows n WHERE r.reservation_id = n.call_id;
  RETURN NULL;
END;
$$;
