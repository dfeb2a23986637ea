-- Time-block rollups for reports at scale (docs/billing.md, "Reports"). A report over
-- a range reads whole aligned time blocks instead of every day and hour in it: blocks
-- of 1, 2, 4 and 8 hours (aligned within the UTC day) and of 1, 2, 4, ... 64 UTC days
-- (aligned on the days since 1970-01-01), so any range is a few dozen blocks at most
-- (at most two of each span per edge, plus the biggest span repeated), whatever its
-- length and the ledger's size. Two narrow tables, so a report reads no more rows than
-- its grouping needs: per key (and its subject), and per requested model and provider.
-- Reports grouped by model, provider or day for one key or subject still read
-- usage_daily and usage_hourly, through their key and subject indexes.
--
-- Kept like the other rollups: by a statement trigger on the ledger, from the rows each
-- INSERT or COPY really inserted, groups upserted in key order (no deadlock between two
-- replicas shipping at once). Its own trigger, so the rollup function of the earlier
-- migrations can change without touching it. Money is numeric: sums are exact.

-- The spans, in hours; each divides the next, so a range splits into aligned blocks
-- greedily. gateway/billing/reports.py holds the same list (a test compares them).
CREATE FUNCTION usage_block_spans() RETURNS integer[]
LANGUAGE sql IMMUTABLE AS $$ SELECT ARRAY[1, 2, 4, 8, 24, 48, 96, 192, 384, 768, 1536] $$;

CREATE TABLE usage_key_blocks
  ( span_hours integer NOT NULL
  -- date_bin(span, t, 1970-01-01 UTC): the block's start.
  , block_start timestamptz NOT NULL
  , api_key_id uuid NOT NULL
  , subject_id uuid NOT NULL
  , requests bigint NOT NULL
  , errors bigint NOT NULL
  , prompt_tokens bigint NOT NULL
  , completion_tokens bigint NOT NULL
  , cost_usd numeric(24, 10) NOT NULL
  , cost_diem numeric(24, 10) NOT NULL
  , PRIMARY KEY (span_hours, block_start, api_key_id, subject_id)
  ) PARTITION BY LIST (span_hours);

CREATE TABLE usage_model_blocks
  ( span_hours integer NOT NULL
  , block_start timestamptz NOT NULL
  , model text NOT NULL
  , provider text NOT NULL
  , requests bigint NOT NULL
  , errors bigint NOT NULL
  , prompt_tokens bigint NOT NULL
  , completion_tokens bigint NOT NULL
  , cost_usd numeric(24, 10) NOT NULL
  , cost_diem numeric(24, 10) NOT NULL
  , PRIMARY KEY (span_hours, block_start, model, provider)
  ) PARTITION BY LIST (span_hours);

-- One partition per span: rows land in a span's partition in the order their blocks
-- begin (the trigger adds to the current blocks), so one block's rows sit on few pages
-- and a report reads few pages per block. Room left on each page keeps the updates that
-- add a batch to a row on its page (HOT), where it was.
DO $$
DECLARE
  span integer;
BEGIN
  FOREACH span IN ARRAY usage_block_spans() LOOP
    EXECUTE format('CREATE TABLE usage_key_blocks_%s PARTITION OF usage_key_blocks FOR VALUES IN (%s)'
                   ' WITH (fillfactor = 70)', span, span);
    EXECUTE format('CREATE TABLE usage_model_blocks_%s PARTITION OF usage_model_blocks FOR VALUES IN (%s)'
                   ' WITH (fillfactor = 70)', span, span);
  END LOOP;
END;
$$;

CREATE FUNCTION usage_ledger_blocks() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO usage_key_blocks AS b
    (span_hours, block_start, api_key_id, subject_id, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT s.span, date_bin(make_interval(hours => s.span), n.created_at, TIMESTAMPTZ '1970-01-01 00:00:00+00'),
         n.api_key_id, n.subject_id, count(*), count(*) FILTER (WHERE n.status >= 400),
         sum(n.prompt_tokens), sum(n.completion_tokens), sum(n.cost_usd), coalesce(sum(n.cost_diem), 0)
  FROM new_rows n CROSS JOIN unnest(usage_block_spans()) AS s (span)
  GROUP BY 1, 2, 3, 4
  ORDER BY 1, 2, 3, 4
  ON CONFLICT (span_hours, block_start, api_key_id, subject_id) DO UPDATE SET
    requests = b.requests + EXCLUDED.requests,
    errors = b.errors + EXCLUDED.errors,
    prompt_tokens = b.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = b.completion_tokens + EXCLUDED.completion_tokens,
    cost_usd = b.cost_usd + EXCLUDED.cost_usd,
    cost_diem = b.cost_diem + EXCLUDED.cost_diem;

  INSERT INTO usage_model_blocks AS b
    (span_hours, block_start, model, provider, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT s.span, date_bin(make_interval(hours => s.span), n.created_at, TIMESTAMPTZ '1970-01-01 00:00:00+00'),
         n.requested_model, coalesce(n.provider, ''), count(*), count(*) FILTER (WHERE n.status >= 400),
         sum(n.prompt_tokens), sum(n.completion_tokens), sum(n.cost_usd), coalesce(sum(n.cost_diem), 0)
  FROM new_rows n CROSS JOIN unnest(usage_block_spans()) AS s (span)
  GROUP BY 1, 2, 3, 4
  ORDER BY 1, 2, 3, 4
  ON CONFLICT (span_hours, block_start, model, provider) DO UPDATE SET
    requests = b.requests + EXCLUDED.requests,
    errors = b.errors + EXCLUDED.errors,
    prompt_tokens = b.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = b.completion_tokens + EXCLUDED.completion_tokens,
    cost_usd = b.cost_usd + EXCLUDED.cost_usd,
    cost_diem = b.cost_diem + EXCLUDED.cost_diem;
  RETURN NULL;
END;
$$;

-- The block rollups rebuilt from usage_hourly (every block is whole hours), each span
-- from the one below it, in block order (as the trigger lays them down). Callers hold
-- the ledger still (the migration below by creating
-- its trigger, usage_rollups_rebuild by a lock).
CREATE FUNCTION usage_blocks_rebuild() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  spans integer[] := usage_block_spans();
  i integer;
BEGIN
  TRUNCATE usage_key_blocks, usage_model_blocks;
  INSERT INTO usage_key_blocks
    (span_hours, block_start, api_key_id, subject_id, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT 1, hour, api_key_id, subject_id, sum(requests), sum(errors), sum(prompt_tokens),
         sum(completion_tokens), sum(cost_usd), sum(cost_diem)
  FROM usage_hourly GROUP BY 2, 3, 4 ORDER BY 2, 3, 4;
  INSERT INTO usage_model_blocks
    (span_hours, block_start, model, provider, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT 1, hour, model, provider, sum(requests), sum(errors), sum(prompt_tokens),
         sum(completion_tokens), sum(cost_usd), sum(cost_diem)
  FROM usage_hourly GROUP BY 2, 3, 4 ORDER BY 2, 3, 4;
  FOR i IN 2 .. array_length(spans, 1) LOOP
    INSERT INTO usage_key_blocks
      (span_hours, block_start, api_key_id, subject_id, requests, errors, prompt_tokens,
       completion_tokens, cost_usd, cost_diem)
    SELECT spans[i], date_bin(make_interval(hours => spans[i]), block_start, TIMESTAMPTZ '1970-01-01 00:00:00+00'),
           api_key_id, subject_id, sum(requests), sum(errors), sum(prompt_tokens),
           sum(completion_tokens), sum(cost_usd), sum(cost_diem)
    FROM usage_key_blocks WHERE span_hours = spans[i - 1] GROUP BY 2, 3, 4 ORDER BY 2, 3, 4;
    INSERT INTO usage_model_blocks
      (span_hours, block_start, model, provider, requests, errors, prompt_tokens,
       completion_tokens, cost_usd, cost_diem)
    SELECT spans[i], date_bin(make_interval(hours => spans[i]), block_start, TIMESTAMPTZ '1970-01-01 00:00:00+00'),
           model, provider, sum(requests), sum(errors), sum(prompt_tokens),
           sum(completion_tokens), sum(cost_usd), sum(cost_diem)
    FROM usage_model_blocks WHERE span_hours = spans[i - 1] GROUP BY 2, 3, 4 ORDER BY 2, 3, 4;
  END LOOP;
END;
$$;

-- Every rollup the ledger's triggers keep (usage_daily, usage_hourly, budget_spend and
-- the blocks), rebuilt from the ledger in one GROUP BY each, with shipping held off by a
-- lock meanwhile. For loading a ledger with the triggers disabled (bench/ledger_report.py)
-- or repairing rollups; budget reservations are not touched.
CREATE FUNCTION usage_rollups_rebuild() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  LOCK TABLE usage_ledger IN SHARE MODE;
  TRUNCATE usage_daily, usage_hourly, budget_spend;
  INSERT INTO usage_daily
    (day, api_key_id, subject_id, model, provider, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT (created_at AT TIME ZONE 'UTC')::date, api_key_id, subject_id, requested_model,
         coalesce(provider, ''), count(*), count(*) FILTER (WHERE status >= 400),
         sum(prompt_tokens), sum(completion_tokens), sum(cost_usd), coalesce(sum(cost_diem), 0)
  FROM usage_ledger GROUP BY 1, 2, 3, 4, 5;
  INSERT INTO usage_hourly
    (hour, api_key_id, subject_id, model, provider, requests, errors, prompt_tokens,
     completion_tokens, cost_usd, cost_diem)
  SELECT date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', api_key_id, subject_id,
         requested_model, coalesce(provider, ''), count(*), count(*) FILTER (WHERE status >= 400),
         sum(prompt_tokens), sum(completion_tokens), sum(cost_usd), coalesce(sum(cost_diem), 0)
  FROM usage_ledger GROUP BY 1, 2, 3, 4, 5;
  INSERT INTO budget_spend (scope, id, period, period_start, cost_usd)
  SELECT v.scope, v.id, v.period, v.period_start, sum(d.cost_usd)
  FROM usage_daily d
  CROSS JOIN LATERAL (VALUES
    ('key', d.api_key_id, 'day', d.day),
    ('key', d.api_key_id, 'month', date_trunc('month', d.day)::date),
    ('key', d.api_key_id, 'total', DATE '-infinity'),
    ('subject', d.subject_id, 'day', d.day),
    ('subject', d.subject_id, 'month', date_trunc('month', d.day)::date),
    ('subject', d.subject_id, 'total', DATE '-infinity')
  ) AS v (scope, id, period, period_start)
  WHERE d.cost_usd > 0
  GROUP BY 1, 2, 3, 4;
  PERFORM usage_blocks_rebuild();
END;
$$;

-- Creating the trigger waits for shipping batches in flight and holds new ones until
-- this migration commits, so the backfill below sees every row the trigger will not.
CREATE TRIGGER usage_ledger_blocks
AFTER INSERT ON usage_ledger
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION usage_ledger_blocks();

SELECT usage_blocks_rebuild();
