"""The gateway's own benchmark: a fake provider, the gateway and a bare relay as real
processes on loopback, a bounded load driver, and a Markdown + JSON report.

Run ``python -m bench --help``; docs/benchmark.md says what each scenario means.
"""

__all__: list[str] = []
