"""What the gateway knows about the config it runs on, and how its last reload went.

Pure values: :mod:`gateway.edge.reload` fills them in, ``GET /admin/config`` and
``POST /admin/config/reload`` (:mod:`gateway.admin.config`) show them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigSource", "ReloadOutcome", "config_hash"]


def config_hash(text: str) -> str:
    """``sha256:<hex>`` of the file's text: what ``sha256sum`` of the file prints."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """The active config: where it came from, its hash, when it was loaded."""

    #: The file (``GATEWAY_CONFIG``), or ``default`` when no file is configured.
    source: str
    hash: str
    #: Unix time the config became active.
    loaded_at: float
    #: 1 at start-up, +1 per successful reload.
    generation: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "hash": self.hash, "loaded_at": self.loaded_at, "generation": self.generation}


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """One reload attempt: applied, or refused with the path-named error."""

    ok: bool
    #: ``admin`` (the API), ``sighup``, or ``supervisor`` (a worker told by ``--workers``).
    trigger: str
    #: Unix time of the attempt.
    at: float
    #: The config active after the attempt (the old one when refused).
    active: ConfigSource
    #: The one-line error (``models[0].deployments[0].provider: unknown provider 'x'``).
    error: str | None = None
    #: False when the file's hash did not change (a reload still re-reads *_FILE secrets).
    changed: bool = False
    #: Settings that changed in the file but only take effect on a restart.
    needs_restart: tuple[str, ...] = ()
    #: Per worker (``serve --workers``): each worker's own outcome.
    workers: tuple[dict[str, Any], ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "ok": self.ok,
            "trigger": self.trigger,
            "at": self.at,
            "error": self.error,
            "changed": self.changed,
            "needs_restart": list(self.needs_restart),
            "active": self.active.to_dict(),
        }
        if self.workers:
            body["workers"] = list(self.workers)
        return body
