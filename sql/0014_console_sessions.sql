-- Sessions of the admin console (gateway/admin/session.py): one row per signed-in
-- browser. The cookie holds a random token; only its SHA-256 is stored here, so a copy
-- of this table signs no one in. Every replica reads the same rows: a session works
-- on any replica and signing out ends it everywhere.
CREATE TABLE console_sessions
  ( token_sha256 bytea PRIMARY KEY
  -- Sent back in X-CSRF-Token (or a form's csrf_token) with every change.
  , csrf_token text NOT NULL
  -- Who signed in: the admin token's actor name, or the OIDC person's email or subject.
  , principal text NOT NULL
  , role text NOT NULL CHECK (role IN ('admin', 'viewer'))
  -- token | oidc
  , method text NOT NULL
  -- For a token sign-in: a fingerprint of the ADMIN_TOKEN it was made with. When the
  -- token is changed, the sessions made with the old one answer nothing more.
  , token_fingerprint text
  , created_at timestamptz NOT NULL DEFAULT now()
  , expires_at timestamptz NOT NULL
  );

CREATE INDEX console_sessions_expires_at ON console_sessions (expires_at);
