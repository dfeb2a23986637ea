-- Stored Responses API answers (POST /v1/responses with store true, the default): what
-- GET /v1/responses/{id}, its input_items and a later call's previous_response_id read.
-- Per subject: another subject's id is not found. input_items holds the whole input the
-- response answered (earlier turns first), so a follow-up rebuilds its conversation
-- from one row. Rows past expires_at (RESPONSES_RETENTION_DAYS) are never read and are
-- purged as new ones are stored.
CREATE TABLE stored_responses
  ( id text PRIMARY KEY
  , subject_id uuid NOT NULL
  , api_key_id uuid NOT NULL
  , response jsonb NOT NULL
  , input_items jsonb NOT NULL
  , created_at timestamptz NOT NULL DEFAULT now()
  , expires_at timestamptz NOT NULL
  );

CREATE INDEX stored_responses_expires_at ON stored_responses (expires_at);
