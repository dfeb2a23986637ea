-- Per-key policies beyond the seed: expiry, token and concurrency limits, budgets and a
-- model allowlist. NULL means "not set" for every one of them.
ALTER TABLE api_keys
  ADD COLUMN expires_at timestamptz,
  ADD COLUMN tokens_per_minute integer,
  ADD COLUMN max_concurrent integer,
  ADD COLUMN budget_usd numeric(14, 6),
  ADD COLUMN budget_period text,
  ADD COLUMN allowed_models text[],
  ADD CONSTRAINT api_keys_tokens_per_minute_positive CHECK (tokens_per_minute > 0),
  ADD CONSTRAINT api_keys_max_concurrent_positive CHECK (max_concurrent > 0),
  ADD CONSTRAINT api_keys_budget_nonnegative CHECK (budget_usd >= 0),
  ADD CONSTRAINT api_keys_budget_period_known
    CHECK (budget_period IS NULL OR budget_period IN ('day', 'month', 'total')),
  ADD CONSTRAINT api_keys_budget_has_period
    CHECK (budget_usd IS NULL OR budget_period IS NOT NULL);

CREATE INDEX api_keys_subject_id ON api_keys (subject_id);

-- Every replica's AuthActor LISTENs here: any change to a key (revoke, rotate, PATCH,
-- delete, create) evicts that prefix from every cache within milliseconds.
CREATE FUNCTION api_keys_notify_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' THEN
    PERFORM pg_notify('api_keys_changed', OLD.key_prefix);
    RETURN OLD;
  END IF;
  PERFORM pg_notify('api_keys_changed', NEW.key_prefix);
  IF TG_OP = 'UPDATE' AND OLD.key_prefix <> NEW.key_prefix THEN
    PERFORM pg_notify('api_keys_changed', OLD.key_prefix);
  END IF;
  RETURN NEW;
END;
$$;

-- last_used_at is written in batches and is no policy change: it must not evict caches.
CREATE TRIGGER api_keys_changed
AFTER INSERT OR DELETE OR UPDATE OF subject_id, name, key_prefix, key_hash,
  rate_limit_requests, rate_limit_window_seconds, is_active, revoked_at, expires_at,
  tokens_per_minute, max_concurrent, budget_usd, budget_period, allowed_models
ON api_keys
FOR EACH ROW EXECUTE FUNCTION api_keys_notify_change();
