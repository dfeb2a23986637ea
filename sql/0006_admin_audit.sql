-- Every change made through the admin API: who (the admin token's name or fingerprint,
-- never the token), what, when, which key, and the details (never a raw key or hash).
-- Rows are only ever inserted; there is no foreign key to api_keys so the trail of a
-- key outlives anything done to the key.
CREATE TABLE admin_audit
  ( audit_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY
  , at timestamptz NOT NULL DEFAULT now()
  , actor text NOT NULL
  , action text NOT NULL
  , api_key_id uuid
  , request_id text
  , remote text
  , detail jsonb NOT NULL DEFAULT '{}'
  , CONSTRAINT admin_audit_actor_nonempty CHECK (actor <> '')
  , CONSTRAINT admin_audit_action_nonempty CHECK (action <> '')
  );

-- GET /admin/audit pages newest first by audit_id, optionally for one key.
CREATE INDEX admin_audit_api_key_id ON admin_audit (api_key_id, audit_id DESC)
WHERE api_key_id IS NOT NULL;
