"""Model names → the deployments that may serve them, in the order one call tries them.

A client-facing name matches a model group exactly, else the longest wildcard group
(``venice/*`` before ``*``); for a wildcard, the part after the prefix is the upstream
model name (``venice/llama`` → ``llama``) where the deployment's model is ``*``.
:meth:`Router.resolve` answers which deployments (and raises the contract's 403/404);
:meth:`Router.order` applies the group's strategy (:mod:`gateway.relay.strategies`) per call.
:meth:`Router.list_models` names what a key may send, including the upstream models
behind wildcard routes (asked of the providers, cached by :class:`ModelCatalog`, and
never waited on for more than a bound).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.config import Deployment, GatewayConfig, ModelGroup
from gateway.core.errors import ModelNotAllowed, ModelNotFound
from gateway.providers.base import Provider, ProviderError, Timeouts
from gateway.relay.strategies import order_targets

if TYPE_CHECKING:
    from actors.breaker import Health

__all__ = ["ModelCatalog", "Route", "Router", "Target", "timeouts_for"]

log = logging.getLogger("gateway.routing")


@dataclass(frozen=True, slots=True)
class Target:
    """One concrete place to send a call: a deployment and the upstream model name."""

    deployment: Deployment
    upstream_model: str
    #: The provider a call to it goes through (:meth:`Provider.for_deployment`) in the
    #: config generation whose router built it, and the call's timeouts there: resolved
    #: once per generation, not per call. None: built without providers (dispatch then
    #: looks them up in the gateway's state).
    client: Provider | None = field(default=None, compare=False, repr=False)
    timeouts: Timeouts | None = field(default=None, compare=False, repr=False)
    #: ``deployment.id`` and ``deployment.provider``, read on every attempt: kept here, not
    #: formatted per read (the id is a property: 13 instructions a read).
    deployment_id: str = field(init=False, compare=False, repr=False)
    provider: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deployment_id", self.deployment.id)
        object.__setattr__(self, "provider", self.deployment.provider)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a requested model may go: its group and targets (priority order)."""

    requested_model: str
    group: ModelGroup
    targets: tuple[Target, ...]
    #: The router (and so the config generation) that resolved it: a call keeps using
    #: its providers and fallbacks even if the config is reloaded meanwhile.
    router: Router | None = field(default=None, compare=False, repr=False)


class Router:
    """Resolves model names against the configured model groups and orders targets."""

    def __init__(
        self, config: GatewayConfig, *, rng: random.Random | None = None,
        providers: Mapping[str, Provider] | None = None,
    ) -> None:
        #: The providers of this config generation (empty when built without them).
        self.providers: Mapping[str, Provider] = providers or {}
        self._exact: dict[str, ModelGroup] = {m.name: m for m in config.models if not m.is_wildcard}
        # Longest prefix first, so "venice/*" wins over "*".
        self._wildcards: list[ModelGroup] = sorted(
            (m for m in config.models if m.is_wildcard), key=lambda m: len(m.name), reverse=True
        )
        self._groups: Mapping[str, ModelGroup] = {m.name: m for m in config.models}
        # Exact groups resolve to the same targets every call: build them once.
        self._exact_routes: dict[str, Route] = {
            name: Route(name, group, _targets(group, name, self.providers), self) for name, group in self._exact.items()
        }
        #: Draws the weighted strategy's order; seedable for tests.
        self.rng = rng or random.Random()
        self.catalog = ModelCatalog()

    def group(self, name: str) -> ModelGroup | None:
        return self._groups.get(name)

    def resolve(self, model: str, allowed: Sequence[str] | None = None) -> Route:
        """The route for ``model``; ModelNotAllowed / ModelNotFound otherwise.

        ``allowed`` is the key's allowlist (``fnmatch`` patterns); None allows all.
        """
        if allowed is not None and not _allows(allowed, model):
            raise ModelNotAllowed(f"model {model!r} is not allowed for this key")
        route = self._exact_routes.get(model)
        if route is not None:
            return route
        for candidate in self._wildcards:
            prefix = candidate.name[:-1]
            if model.startswith(prefix) and len(model) > len(prefix):
                return Route(model, candidate, _targets(candidate, model[len(prefix):], self.providers), self)
        raise ModelNotFound(f"model {model!r} not found")

    def order(
        self, route: Route, health: Mapping[str, Health], *, stream: bool,
        headroom: Mapping[str, float] | None = None,
    ) -> list[Target]:
        """The route's targets in the order its group's strategy tries them for one call."""
        return order_targets(
            route.group.strategy, route.targets, health, stream=stream, rng=self.rng, headroom=headroom
        )

    def listable(self, allowed: Sequence[str] | None = None) -> list[str]:
        """Names a client can send without asking providers: exact groups (and the
        allowlist's exact names that resolve), filtered by the key's allowlist."""
        return sorted(self._filter(set(self._exact), allowed))

    async def list_models(
        self, providers: Mapping[str, Provider], allowed: Sequence[str] | None = None
    ) -> list[str]:
        """Every name the key may send: exact groups, plus, for each wildcard group, the
        upstream models of its pass-through deployments (``venice/`` + each id Venice
        lists), filtered by the key's allowlist. A provider that cannot list, or has not
        answered within the catalog's bound, is skipped. Providers are asked together, so
        the bound holds for the whole list, not per provider."""
        wanted = [
            (group.name[:-1], provider)
            for group in self._wildcards
            for deployment in group.deployments
            if deployment.model == "*" and (provider := providers.get(deployment.provider)) is not None
        ]
        listed = await asyncio.gather(*(self.catalog.ids(provider) for _prefix, provider in wanted))
        names = set(self._exact)
        for (prefix, _provider), ids in zip(wanted, listed, strict=True):
            names.update(prefix + model_id for model_id in ids if model_id)
        return sorted(self._filter(names, allowed))

    def _filter(self, names: set[str], allowed: Sequence[str] | None) -> set[str]:
        if allowed is None:
            return names
        kept = {n for n in names if _allows(allowed, n)}
        for name in allowed:
            if "*" not in name and name not in kept and self._routable(name):
                kept.add(name)
        return kept

    def _routable(self, name: str) -> bool:
        try:
            self.resolve(name)
        except ModelNotFound:
            return False
        return True


def _allows(allowed: Sequence[str], model: str) -> bool:
    return any(fnmatch.fnmatchcase(model, pattern) for pattern in allowed)


def _targets(group: ModelGroup, rest: str, providers: Mapping[str, Provider]) -> tuple[Target, ...]:
    # Stable sort: equal priorities keep their config order (the deterministic tie-break).
    ordered = sorted(group.deployments, key=lambda d: d.priority)
    return tuple(_target(group, d, rest if d.model == "*" else d.model, providers) for d in ordered)


def _target(group: ModelGroup, deployment: Deployment, upstream_model: str, providers: Mapping[str, Provider]) -> Target:
    provider = providers.get(deployment.provider)
    if provider is None:
        return Target(deployment, upstream_model)
    provider = provider.for_deployment(deployment)
    return Target(deployment, upstream_model, provider, timeouts_for(group, provider))


def timeouts_for(group: ModelGroup, provider: Provider) -> Timeouts:
    """A call's timeouts: the group's where set, else the provider's (never one cap)."""
    if group.connect_timeout is None and group.timeout is None and group.idle_timeout is None:
        return provider.timeouts
    base = provider.timeouts
    return Timeouts(
        connect=group.connect_timeout or base.connect,
        total=group.timeout or base.total,
        idle=group.idle_timeout or base.idle,
    )


class ModelCatalog:
    """Upstream model ids per provider, cached, and never waited on for long.

    ``/v1/models`` must not cost a provider call each time, nor be slow because a
    provider is: a good list is kept ``ttl`` seconds; after that it is still answered
    at once while one refresh runs behind it (a failed refresh keeps the old list and
    is tried again after ``failure_ttl``). With nothing cached yet (the first ask, or
    a provider that has never answered) an ask waits at most ``answer_within`` seconds
    and then answers without that provider's models; the call goes on, and its list
    is there for the next ask. Concurrent askers share one call.
    """

    def __init__(self, *, ttl: float = 300.0, failure_ttl: float = 30.0, answer_within: float = 1.0) -> None:
        self._ttl = ttl
        self._failure_ttl = failure_ttl
        self._answer_within = answer_within
        #: provider name -> (fresh until, ids)
        self._cache: dict[str, tuple[float, tuple[str, ...]]] = {}
        self._inflight: dict[str, asyncio.Task[tuple[str, ...]]] = {}

    async def ids(self, provider: Provider) -> tuple[str, ...]:
        """The model ids ``provider`` lists (empty if it cannot say, or not yet)."""
        cached = self._cache.get(provider.name)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        task = self._inflight.get(provider.name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch(provider, cached))
            self._inflight[provider.name] = task
            task.add_done_callback(lambda _t: self._inflight.pop(provider.name, None))
        if cached is not None:
            return cached[1]  # stale, but answered now; the refresh replaces it
        try:
            # Shielded: neither the bound nor an asker going away may cancel the call,
            # whose list the next ask (or another asker) will use.
            async with asyncio.timeout(self._answer_within):
                return await asyncio.shield(task)
        except TimeoutError:
            return ()

    async def _fetch(self, provider: Provider, previous: tuple[float, tuple[str, ...]] | None) -> tuple[str, ...]:
        try:
            ids = tuple(await provider.list_models())
        except ProviderError as exc:
            log.info("provider %s did not list its models: %s", provider.name, exc)
            kept = previous[1] if previous is not None else ()
            self._cache[provider.name] = (time.monotonic() + self._failure_ttl, kept)
            return kept
        self._cache[provider.name] = (time.monotonic() + self._ttl, ids)
        return ids
