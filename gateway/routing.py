"""Model names → the deployments that may serve them.

A client-facing name matches a model group exactly, else the longest wildcard group
(``venice/*`` before ``*``); for a wildcard, the part after the prefix is the upstream
model name (``venice/llama`` → ``llama``) where the deployment's model is ``*``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.config import Deployment, GatewayConfig, ModelGroup
from gateway.errors import ModelNotAllowed, ModelNotFound

__all__ = ["Route", "Router", "Target"]


@dataclass(frozen=True, slots=True)
class Target:
    """One concrete place to send a call: a deployment and the upstream model name."""

    deployment: Deployment
    upstream_model: str

    @property
    def provider(self) -> str:
        return self.deployment.provider


@dataclass(frozen=True, slots=True)
class Route:
    """Where a requested model may go, in the order to try."""

    requested_model: str
    group: ModelGroup
    targets: tuple[Target, ...]


class Router:
    """Resolves model names against the configured model groups."""

    def __init__(self, config: GatewayConfig) -> None:
        self._exact: dict[str, ModelGroup] = {m.name: m for m in config.models if not m.is_wildcard}
        # Longest prefix first, so "venice/*" wins over "*".
        self._wildcards: list[ModelGroup] = sorted(
            (m for m in config.models if m.is_wildcard), key=lambda m: len(m.name), reverse=True
        )
        self._groups: Mapping[str, ModelGroup] = {m.name: m for m in config.models}

    def group(self, name: str) -> ModelGroup | None:
        return self._groups.get(name)

    def resolve(self, model: str, allowed: Sequence[str] | None = None) -> Route:
        """The route for ``model``; ModelNotAllowed / ModelNotFound otherwise."""
        if allowed is not None and not any(fnmatch.fnmatchcase(model, a) for a in allowed):
            raise ModelNotAllowed(f"model {model!r} is not allowed for this key")
        group = self._exact.get(model)
        rest = model
        if group is None:
            for candidate in self._wildcards:
                prefix = candidate.name[:-1]
                if model.startswith(prefix) and len(model) > len(prefix):
                    group, rest = candidate, model[len(prefix):]
                    break
        if group is None:
            raise ModelNotFound(f"model {model!r} not found")
        ordered = sorted(group.deployments, key=lambda d: d.priority)
        targets = tuple(Target(d, rest if d.model == "*" else d.model) for d in ordered)
        return Route(model, group, targets)

    def listable(self, allowed: Sequence[str] | None = None) -> list[str]:
        """Names a client can send: exact groups, filtered by the key's allowlist."""
        names = sorted(self._exact)
        if allowed is None:
            return names
        names = [n for n in names if any(fnmatch.fnmatchcase(n, a) for a in allowed)]
        names += [a for a in allowed if "*" not in a and a not in names]
        return sorted(names)
