"""The response cache's domain: keys, stored entries, the semantic index, pgvector, embedders."""
