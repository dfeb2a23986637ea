"""Metrics, traces and logs, each defined once."""
