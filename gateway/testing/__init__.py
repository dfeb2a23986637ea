"""Fakes for tests and bench/ only: the scriptable fake upstream and its answers. Never imported by product code."""
