"""Sending calls upstream: routing, strategies, the retry policy and the SSE reader."""
