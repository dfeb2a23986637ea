-- The usage ledger: one row per chat call, written in batches by every replica's
-- BillingActor from its local journal. Append-only: rows are never updated or deleted
-- by the gateway (the daily rollup below relies on it).

-- Which database this is. A replica's journal on local disk is filed under this id, so
-- events recorded for one database are never shipped into another one.
CREATE TABLE ledger_identity
  ( singleton boolean PRIMARY KEY DEFAULT true
  , ledger_id uuid NOT NULL DEFAULT gen_random_uuid()
  , created_at timestamptz NOT NULL DEFAULT now()
  , CONSTRAINT ledger_identity_one_row CHECK (singleton)
  );

INSERT INTO ledger_identity DEFAULT VALUES;

CREATE TABLE usage_ledger
  -- The gateway's own id for the call, made once when the call ends: the idempotency
  -- key of shipping (a batch shipped twice after a crash inserts nothing the second
  -- time). Not the x-request-id, which a client may choose and reuse.
  ( call_id uuid PRIMARY KEY
  -- The x-request-id the client saw (its own, or one the gateway made).
  , request_id text NOT NULL
  -- The provider's response id (``chatcmpl-...``), when it answered one.
  , response_id text
  , api_key_id uuid NOT NULL
  , subject_id uuid NOT NULL
  , requested_model text NOT NULL
  , served_model text
  , provider text
  , deployment text
  , prompt_tokens integer NOT NULL
  , completion_tokens integer NOT NULL
  -- True when the tokens were counted from the delivered chunks (a stream cut short or
  -- cancelled before the provider's usage chunk).
  , usage_estimated boolean NOT NULL DEFAULT false
  , cost_usd numeric(20, 10) NOT NULL
  -- Venice's own ``cost.diem``, when the provider reports it.
  , cost_diem numeric(20, 10)
  -- provider: the provider's ``cost``; price: the deployment's price table;
  -- unpriced: tokens but no way to price them (cost 0); none: no tokens.
  , cost_source text NOT NULL
  , latency_seconds double precision NOT NULL
  , ttft_seconds double precision
  , status smallint NOT NULL
  -- ok | provider_error | upstream_error | cancelled | cut
  , outcome text NOT NULL
  , streamed boolean NOT NULL
  , cancelled boolean GENERATED ALWAYS AS (outcome = 'cancelled') STORED
  , retries smallint NOT NULL DEFAULT 0
  , failovers smallint NOT NULL DEFAULT 0
  , failed_over boolean GENERATED ALWAYS AS (failovers > 0) STORED
  , error_type text
  , finish_reason text
  -- When the call started (reports and budgets count it on this day, UTC).
  , created_at timestamptz NOT NULL
  -- When its batch reached the ledger.
  , recorded_at timestamptz NOT NULL DEFAULT now()
  , CONSTRAINT usage_ledger_tokens_nonnegative CHECK (prompt_tokens >= 0 AND completion_tokens >= 0)
  , CONSTRAINT usage_ledger_cost_nonnegative CHECK (cost_usd >= 0)
  , CONSTRAINT usage_ledger_cost_source_known
      CHECK (cost_source IN ('provider', 'price', 'unpriced', 'none'))
  );

-- Reports cut time ranges (the partial days at the edges come from here), filter by key
-- or subject, and an operator looks a call up by the x-request-id a client quotes.
CREATE INDEX usage_ledger_created_at ON usage_ledger (created_at);
CREATE INDEX usage_ledger_key_created_at ON usage_ledger (api_key_id, created_at);
CREATE INDEX usage_ledger_subject_created_at ON usage_ledger (subject_id, created_at);
CREATE INDEX usage_ledger_request_id ON usage_ledger (request_id);

-- One row per UTC day, key, subject, requested model and provider: what reports over
-- whole days read, so they do not scan the ledger.
CREATE TABLE usage_daily
  ( day date NOT NULL
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
  , PRIMARY KEY (day, api_key_id, subject_id, model, provider)
  );

CREATE INDEX usage_daily_key_day ON usage_daily (api_key_id, day);
CREATE INDEX usage_daily_subject_day ON usage_daily (subject_id, day);

-- Spend per key and per subject for each budget period that has begun (a UTC day, a
-- UTC month, all time): the budget refresh every replica runs about once a second reads
-- one row per budget here instead of summing the rollup.
CREATE TABLE budget_spend
  ( scope text NOT NULL
  , id uuid NOT NULL
  , period text NOT NULL
  -- The period's first day; -infinity for 'total'.
  , period_start date NOT NULL
  , cost_usd numeric(24, 10) NOT NULL
  , PRIMARY KEY (scope, id, period, period_start)
  , CONSTRAINT budget_spend_scope_known CHECK (scope IN ('key', 'subject'))
  , CONSTRAINT budget_spend_period_known CHECK (period IN ('day', 'month', 'total'))
  );

-- Both tables are kept by the database itself, once per INSERT or COPY statement, from the rows that
-- statement really inserted (a re-shipped batch conflicts and adds nothing), so the
-- rollup is exact whoever writes the ledger. Groups are upserted in key order so two
-- replicas shipping at once lock rollup rows in the same order (no deadlock).
CREATE FUNCTION usage_ledger_rollup() RETURNS trigger
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
  RETURN NULL;
END;
$$;

CREATE TRIGGER usage_ledger_rollup
AFTER INSERT ON usage_ledger
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION usage_ledger_rollup();

-- Budgets of a subject (tenant), across all its keys. A key's own budget lives on
-- api_keys (budget_usd, budget_period); both are checked before every call.
CREATE TABLE subject_budgets
  ( subject_id uuid PRIMARY KEY
  , budget_usd numeric(14, 6) NOT NULL
  , budget_period text NOT NULL
  , created_at timestamptz NOT NULL DEFAULT now()
  , updated_at timestamptz NOT NULL DEFAULT now()
  , CONSTRAINT subject_budgets_budget_nonnegative CHECK (budget_usd >= 0)
  , CONSTRAINT subject_budgets_period_known CHECK (budget_period IN ('day', 'month', 'total'))
  );
