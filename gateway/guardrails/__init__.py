"""Guardrails: policies on what goes in and comes out (PII and secrets, terms, sizes,
external checks, hooks), on the internal message shape, for every protocol."""
