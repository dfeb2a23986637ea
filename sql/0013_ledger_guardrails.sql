-- Which guardrail policies acted on each call, as "policy:action" comma-joined
-- (e.g. "mask-pii:redacted,topics:logged"); NULL when none did. Never the matched text.
ALTER TABLE usage_ledger ADD COLUMN guardrails text;
