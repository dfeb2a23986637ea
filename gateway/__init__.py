"""LLM gateway package."""

#: The one place the version is written: setup.cfg reads it (``attr:``), and
#: ``llm-gateway --version``, the start-up line and ``gateway_build_info`` show it.
__version__ = "0.1.0"
