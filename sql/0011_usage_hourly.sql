-- An hourly rollup beside the daily one: a report over a range whose edges are not
-- midnight reads whole days from usage_daily, the whole hours of its edge days from
-- here, and only the partial hours at its very ends from the ledger, so its cost no
-- longer grows with how many calls a day holds (docs/billing.md, "Reports"). Kept by the
-- same trigger, from the rows each shipped statement really inserted.
CREATE TABLE usage_hourly
  ( hour timestamptz NOT NULL
  , api_key_id uuid NOT NULL
  , subject_id uuid NOT NULL
  , model text NOT NULL
  , provider text NOT NULL
  , requests bigint NOT NULL
  , errors bigint NOT NULL
  , prompt_tokens bigint NOT NULL
  , completion_tokens bigint NOT NULL
  , cost_usd numeric(24, 10) NOT NULL
  , cost_diem numeric(24, 10) NOT NULL
  , PRIMARY KEY (hour, api_key_id, subject_id, model, provider)
  );

CREATE INDEX usage_hourly_key_hour ON usage_hourly (api_key_id, hour);
CREATE INDEX usage_hourly_subject_hour ON usage_hourly (subject_id, hour);

-- What the ledger already holds.
INSERT INTO usage_hourly
  (hour, api_key_id, subject_id, model, provider, requests, errors, prompt_tokens,
   completion_tokens, cost_usd, cost_diem)
SELECT date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', api_key_id, subject_id, requested_model,
       coalesce(provider, ''), count(*), count(*) FILTER (WHERE status >= 400),
       sum(prompt_tokens), sum(completion_tokens), sum(cost_usd), coalesce(sum(cost_diem), 0)
FROM usage_ledger
GROUP BY 1, 2, 3, 4, 5;

-- The ledger's trigger, as in 0008, plus the hourly rollup.
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

  INSERT INTO usage_hourly AS h
    (hour, api_key_id, subject_id, model, provider, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT (date_trunc('hour', n.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'), n.api_key_id, n.subject_id,
         n.requested_model, coalesce(n.provider, ''), count(*),
         count(*) FILTER (WHERE n.status >= 400), sum(n.prompt_tokens),
         sum(n.completion_tokens), sum(n.cost_usd), coalesce(sum(n.cost_diem), 0)
  FROM new_rows n
  GROUP BY 1, 2, 3, 4, 5
  ORDER BY 1, 2, 3, 4, 5
  ON CONFLICT (hour, api_key_id, subject_id, model, provider) DO UPDATE SET
    requests = h.requests + EXCLUDED.requests,
    errors = h.errors + EXCLUDED.errors,
    prompt_tokens = h.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = h.completion_tokens + EXCLUDED.completion_tokens,
    cost_usd = h.cost_usd + EXCLUDED.cost_usd,
    cost_diem = h.cost_diem + EXCLUDED.cost_diem;

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
