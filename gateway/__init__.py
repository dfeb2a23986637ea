"""LLM gateway package."""
