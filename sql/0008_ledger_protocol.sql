-- Which protocol the client spoke for each call: 'chat' (/v1/chat/completions) or
-- 'anthropic' (/v1/messages). Rows from before this column, and journal lines written
-- by an older gateway, carry NULL; the default fills existing rows with 'chat', which
-- is all an older gateway served.
ALTER TABLE usage_ledger ADD COLUMN protocol text DEFAULT 'chat';
ALTER TABLE usage_ledger ADD CONSTRAINT usage_ledger_protocol_known
  CHECK (protocol IS NULL OR protocol IN ('chat', 'anthropic', 'responses', 'completions'));
