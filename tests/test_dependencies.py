"""Every runtime dependency in setup.cfg is used by the product (gateway/, actors/).

A dependency declared but imported nowhere installs, pins and audits code for nothing
(pybreaker was such a one until the breaker actor was built on it). A new entry in
``install_requires`` must be added to ``IMPORTED_AS`` below, and the product must import it.
"""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Distribution name (as in setup.cfg) -> the module the product imports from it.
IMPORTED_AS = {
    "aiohttp": "aiohttp",
    "asyncpg": "asyncpg",
    "limits": "limits",
    "redis": "redis",
    "pybreaker": "pybreaker",
    "prometheus-client": "prometheus_client",
    "opentelemetry-sdk": "opentelemetry.sdk",
    "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http",
    "orjson": "orjson",
    "httptools": "httptools",
    "aiohappyeyeballs": "aiohappyeyeballs",
    "PyYAML": "yaml",
    "uvloop": "uvloop",
    "pgserver": "pgserver",
    "pydantic": "pydantic",
}
#: Used without an import of ours: redis-py parses replies with hiredis when installed.
ACCELERATORS = {"hiredis"}


def _install_requires() -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    return [re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0] for line in lines if line.strip()]


def _imported_modules() -> set[str]:
    """Every module imported anywhere in the product, lazy imports inside functions too."""
    seen: set[str] = set()
    for package in ("gateway", "actors"):
        for path in (ROOT / package).rglob("*.py"):
            if "testing" in path.relative_to(ROOT).parts:
                continue  # the fakes serve tests and bench only
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    seen.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    seen.add(node.module)
    return seen


def test_every_declared_dependency_is_imported_by_the_product() -> None:
    declared = _install_requires()
    assert declared
    unknown = [d for d in declared if d not in IMPORTED_AS and d not in ACCELERATORS]
    assert not unknown, f"add {unknown} to IMPORTED_AS (and use them) or drop them from setup.cfg"
    imported = _imported_modules()
    unused = [
        dist for dist in declared if dist in IMPORTED_AS
        and not any(m == IMPORTED_AS[dist] or m.startswith(IMPORTED_AS[dist] + ".") for m in imported)
    ]
    assert not unused, f"declared in setup.cfg but imported nowhere in gateway/ or actors/: {unused}"


def test_hiredis_is_the_parser_redis_uses() -> None:
    from redis.asyncio.connection import DefaultParser

    assert DefaultParser.__name__ == "_AsyncHiredisParser"
