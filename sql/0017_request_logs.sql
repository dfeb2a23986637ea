-- Request logs (opt-in, request_logs: in the config): the bodies of a call, as they were
-- sent upstream and answered to the client, after every guardrail redaction; never the
-- raw text a policy redacted or refused. One row per call (call_id, as the ledger's),
-- shipped from the local journal like the ledger's rows (a batch shipped twice inserts
-- nothing the second time), deleted once expires_at has passed.
CREATE TABLE request_logs
  ( call_id uuid PRIMARY KEY
  , request_id text NOT NULL
  , api_key_id uuid
  , key_prefix text
  , subject_id uuid
  , requested_model text NOT NULL
  , model_group text
  , served_model text
  , protocol text NOT NULL
  , streamed boolean NOT NULL
  , status smallint NOT NULL
  , outcome text NOT NULL
  , guardrails text
  -- The request as sent upstream (JSON text), cut to request_logs.max_body_bytes.
  , request_body text
  , request_bytes integer NOT NULL DEFAULT 0
  , request_truncated boolean NOT NULL DEFAULT false
  -- The answer as the client got it: the whole body ('body'), or a stream's text ('text').
  , response_body text
  , response_kind text
  , response_bytes integer NOT NULL DEFAULT 0
  , response_truncated boolean NOT NULL DEFAULT false
  , created_at timestamptz NOT NULL
  , expires_at timestamptz NOT NULL
  , recorded_at timestamptz NOT NULL DEFAULT now()
  , CONSTRAINT request_logs_response_kind CHECK (response_kind IN ('body', 'text'))
  );

-- GET /admin/requests pages newest first, for everyone or one key; the purge finds the
-- expired rows by expires_at.
CREATE INDEX request_logs_newest ON request_logs (created_at DESC, call_id DESC);
CREATE INDEX request_logs_key ON request_logs (api_key_id, created_at DESC, call_id DESC);
CREATE INDEX request_logs_key_prefix ON request_logs (key_prefix, created_at DESC, call_id DESC);
CREATE INDEX request_logs_request_id ON request_logs (request_id);
CREATE INDEX request_logs_expires ON request_logs (expires_at);
