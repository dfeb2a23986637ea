"""Which policies apply to a call: its model group's, then its key's, compiled once.

Built at start-up from ``guardrails:`` and ``models[].guardrails``; an engine is made once
per (group, key prefix) pair that has any policy and reused, so a call with no policy
costs one dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.core.config import ConfigError, ModelGroup
from gateway.core.guardrail_config import GuardrailSettings
from gateway.guardrails.engine import ExternalChecks, GuardrailEngine

__all__ = ["Guardrails"]


class Guardrails:
    """The compiled policies of every model group and key."""

    def __init__(self, settings: GuardrailSettings, groups: Iterable[ModelGroup], external: ExternalChecks | None) -> None:
        self._settings = settings
        self._external = external
        self._by_group = {g.name: g.guardrails for g in groups if g.guardrails}
        self._engines: dict[tuple[str, ...], GuardrailEngine | None] = {}
        # Compile every policy now: a bad pattern, detector or hook fails the start, by path.
        for name, policy in settings.policies.items():
            try:
                GuardrailEngine([policy], external)
            except ValueError as exc:
                raise ConfigError(f"guardrails.policies.{name}: {exc}") from None

    @property
    def any(self) -> bool:
        """Whether any group or key has a policy at all."""
        return bool(self._by_group or self._settings.keys)

    def engine_for(self, group: str, key_prefix: str | None) -> GuardrailEngine | None:
        """The engine of a call on ``group`` with the key ``key_prefix``; None: no policy."""
        names = self._by_group.get(group, ())
        if key_prefix is not None and key_prefix in self._settings.keys:
            names = names + tuple(n for n in self._settings.keys[key_prefix] if n not in names)
        if not names:
            return None
        engine = self._engines.get(names)
        if engine is None and names not in self._engines:
            engine = GuardrailEngine([self._settings.policies[n] for n in names], self._external)
            self._engines[names] = engine
        return engine
