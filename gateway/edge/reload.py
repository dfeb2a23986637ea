"""Config reload without a restart: SIGHUP and ``POST /admin/config/reload``.

A reload re-reads ``GATEWAY_CONFIG`` (and every ``*_FILE`` secret it names), validates
the whole file and builds the providers a changed file needs *before* anything changes:
a bad file changes nothing and is answered (and logged) with its path-named error, and
``gateway_config_last_reload_success`` drops to 0. A good file is swapped in in one step
on the event loop (no await between the assignments), so every request sees either the
old config or the new one, never a mix:

* routes, prices (on the deployments), fallbacks and strategies: a new
  :class:`~gateway.relay.routing.Router`; a call already routed keeps its router, and
  with it its providers and fallbacks (``Route.router``), so requests and streams in
  flight finish on the config they started with;
* providers: an unchanged entry keeps its object (connection pool, rotated key); a new or
  changed one is built afresh; a replaced or removed one has its connection pool closed
  once the last request that started before the swap has ended (:class:`ProviderPools`);
* the breaker: new settings apply; deployments whose provider changed (or that went
  away) are forgotten, the rest keep their circuit state and latency history;
* the per-IP guard's rates and the cache's per-group policies apply at once; settings
  that shape a store built at start-up (limiter storage, cache size, embedder) are
  listed in the answer's ``needs_restart``.

Each provider has its own ``aiohttp`` session here (rather than one shared pool), so a
removed provider's connections can be closed without touching the others'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Iterable, Mapping

import aiohttp

from gateway.core.config import ConfigError, GatewayConfig, ProviderConfig, Settings, parse_config
from gateway.core.config_source import ConfigSource, ReloadOutcome, config_hash
from gateway.edge.guardrails import build_guardrails
from gateway.http.state import GatewayState
from gateway.providers import Provider, build_provider
from gateway.relay.routing import Router

__all__ = ["ConfigReloader", "ProviderPools", "default_source", "install_sighup"]

log = logging.getLogger("gateway.reload")


def default_source(settings: Settings) -> ConfigSource:
    """The source of the config loaded at start-up (the file is read again to hash it)."""
    path = settings.config_path
    if path is None:
        return ConfigSource("default", config_hash(""), time.time())
    try:
        text = path.read_text()
    except OSError:
        text = ""
    return ConfigSource(str(path), config_hash(text), time.time())


class ProviderPools:
    """The providers of every live config generation, each on its own connection pool.

    A request pins the generation active when it arrived (:meth:`enter`, and
    :meth:`leave` once its handler returns, a stream's after its last byte: the data
    plane's middleware, :mod:`gateway.edge.front`); the providers a reload replaced are
    closed once no request pinned to a generation before that reload is left.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        #: The providers built here and their sessions, by the provider's id: closing one
        #: closes both (a provider's whole answers have connections of their own).
        self._owned: dict[int, tuple[Provider, aiohttp.ClientSession]] = {}
        #: Requests in flight per generation (only generations with some, plus the current).
        self._in_flight: dict[int, int] = {}
        self.generation = 1
        #: (generation that retired them, providers): closed when older ones have drained.
        self._retired: list[tuple[int, list[Provider]]] = []
        #: Providers that must outlive reloads (the cache's embedder holds one).
        self.pinned: set[int] = set()
        self._closing: set[asyncio.Task[None]] = set()

    def build(self, config: GatewayConfig, keep: Mapping[str, Provider] | None = None) -> dict[str, Provider]:
        """Providers for ``config``: ``keep``'s object where its entry is unchanged.

        Raises ConfigError (and closes what it built) if a provider cannot be built.
        """
        keep = keep or {}
        built: dict[str, Provider] = {}
        fresh: list[Provider] = []
        try:
            for name, provider_config in config.providers.items():
                old = keep.get(name)
                if old is not None and old.config == provider_config:
                    built[name] = old
                    continue
                provider = self._open(provider_config)
                fresh.append(provider)
                built[name] = provider
        except ConfigError:
            for provider in fresh:
                self._schedule_close([provider])
            raise
        return built

    def _open(self, provider_config: ProviderConfig) -> Provider:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=30)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        name = provider_config.name
        try:
            provider = build_provider(provider_config, session, request_timeout=self._settings.request_timeout)
        except ValueError as exc:
            asyncio.get_running_loop().create_task(session.close())
            raise ConfigError(f"providers.{name}.type: {exc}") from None
        self._owned[id(provider)] = (provider, session)
        return provider

    def retire(self, old: Mapping[str, Provider], new: Mapping[str, Provider]) -> None:
        """A reload swapped ``old`` for ``new``: start the next generation; close what
        ``new`` does not keep once every earlier request has finished."""
        kept = {id(p) for p in new.values()}
        gone = [p for p in old.values() if id(p) not in kept and id(p) not in self.pinned]
        retiring_generation = self.generation
        self.generation += 1
        if gone:
            self._retired.append((retiring_generation, gone))
        self._close_drained()

    def enter(self) -> int:
        generation = self.generation
        self._in_flight[generation] = self._in_flight.get(generation, 0) + 1
        return generation

    def leave(self, generation: int) -> None:
        left = self._in_flight.get(generation, 1) - 1
        if left > 0:
            self._in_flight[generation] = left
            return
        self._in_flight.pop(generation, None)
        if self._retired:
            self._close_drained()

    def in_flight(self, generation: int) -> int:
        return self._in_flight.get(generation, 0)

    def _close_drained(self) -> None:
        busy = [g for g, n in self._in_flight.items() if n > 0]
        oldest_busy = min(busy) if busy else None
        still: list[tuple[int, list[Provider]]] = []
        for generation, providers in self._retired:
            if oldest_busy is not None and oldest_busy <= generation:
                still.append((generation, providers))
            else:
                self._schedule_close(providers)
        self._retired = still

    def _schedule_close(self, providers: Iterable[Provider]) -> None:
        for provider in providers:
            task = asyncio.get_running_loop().create_task(self._close(provider))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, provider: Provider) -> None:
        owned = self._owned.pop(id(provider), None)
        try:
            await provider.close()
        finally:
            if owned is not None:
                await owned[1].close()
        log.info("provider %s: connection pool closed (no call of it left)", provider.name)

    def closed(self, provider: Provider) -> bool:
        """Whether ``provider``'s pool is closed (or was never ours)."""
        owned = self._owned.get(id(provider))
        return owned is None or owned[1].closed

    async def close_all(self) -> None:
        """At shutdown: every pool, retired or not."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        owned, self._owned = list(self._owned.values()), {}
        for provider, session in owned:
            try:
                await provider.close()
            finally:
                await session.close()


class ConfigReloader:
    """Re-reads, validates and swaps in the config of one gateway's state."""

    def __init__(self, state: GatewayState, pools: ProviderPools) -> None:
        self._state = state
        self._pools = pools
        self._lock = asyncio.Lock()

    async def __call__(self, trigger: str) -> ReloadOutcome:
        """Reload now; returns the outcome (also kept as ``state.last_reload``)."""
        async with self._lock:  # one reload at a time: each validates against the last
            outcome = self._reload(trigger)
        state = self._state
        state.last_reload = outcome
        active = state.config_source
        state.metrics.config_reloaded(outcome.ok, active.loaded_at if active is not None else time.time())
        if outcome.ok:
            log.info(
                "config reloaded (%s) from %s: %s, generation %d%s", trigger, outcome.active.source,
                outcome.active.hash[:19], outcome.active.generation,
                f"; needs a restart: {', '.join(outcome.needs_restart)}" if outcome.needs_restart else "",
            )
        else:
            log.error("config reload (%s) refused, nothing changed: %s", trigger, outcome.error)
        return outcome

    def _reload(self, trigger: str) -> ReloadOutcome:
        state = self._state
        now = time.time()
        active = state.config_source or default_source(state.settings)
        path = state.settings.config_path
        if path is None:
            return ReloadOutcome(False, trigger, now, active, error="no config file to reload (GATEWAY_CONFIG is unset)")
        try:
            text = path.read_text()
            config = parse_config(text, path)
            providers = self._pools.build(config, keep=state.providers)
        except OSError as exc:
            return ReloadOutcome(False, trigger, now, active, error=f"{path}: {str(exc).splitlines()[0]}")
        except ConfigError as exc:
            return ReloadOutcome(False, trigger, now, active, error=str(exc))
        digest = config_hash(text)
        router = Router(config, providers=providers)
        try:
            # Compiled before the swap: a bad pattern or hook refuses the whole reload.
            guardrails = build_guardrails(config, state.session, router, providers)
        except ConfigError as exc:
            return ReloadOutcome(False, trigger, now, active, error=str(exc))
        old_config, old_providers = state.config, state.providers
        source = ConfigSource(str(path), digest, now, active.generation + 1)
        # The swap: plain assignments, no await in between, so no request sees a mix.
        state.config, state.router, state.providers = config, router, providers
        state.guardrails = guardrails if guardrails.any else None
        state.tracing.providers = providers
        state.config_source = source
        state.breaker.reconfigure(config.circuit_breaker, forget=_void_deployments(old_config, config))
        state.limiter.apply_ip_guard(config.rate_limits)
        if state.cache is not None:
            state.cache.apply_config(config)
        if state.probes is not None:
            state.probes.watch(providers)
        self._pools.retire(old_providers, providers)
        return ReloadOutcome(
            True, trigger, now, source, changed=digest != active.hash,
            needs_restart=_needs_restart(old_config, config),
        )


def _void_deployments(old: GatewayConfig, new: GatewayConfig) -> tuple[str, ...]:
    """Deployment ids whose history no longer describes them: their provider changed
    or is gone, or no group routes to them any more."""
    used = {d.id for m in new.models for d in m.deployments}
    void = {
        d.id for m in old.models for d in m.deployments
        if d.id not in used or old.providers.get(d.provider) != new.providers.get(d.provider)
    }
    return tuple(sorted(void))


def _needs_restart(old: GatewayConfig, new: GatewayConfig) -> tuple[str, ...]:
    """Changed settings that shape stores built once at start-up."""
    changed = []
    for field in ("storage", "strategy", "key_prefix"):
        if getattr(old.rate_limits, field) != getattr(new.rate_limits, field):
            changed.append(f"rate_limits.{field}")
    for field in ("max_bytes", "redis_prefix"):
        if getattr(old.cache, field) != getattr(new.cache, field):
            changed.append(f"cache.{field}")
    old_semantic = dataclasses.replace(old.cache.semantic, max_wait_ms=0.0)
    if old_semantic != dataclasses.replace(new.cache.semantic, max_wait_ms=0.0):
        changed.append("cache.semantic")
    return tuple(changed)


def install_sighup(loop: asyncio.AbstractEventLoop, state: GatewayState) -> None:
    """Reload on SIGHUP (logged; a refused file changes nothing)."""
    if state.reload_config is None:
        return
    tasks: set[asyncio.Task[ReloadOutcome]] = set()

    async def reload() -> ReloadOutcome:
        assert state.reload_config is not None
        return await state.reload_config("sighup")  # read at signal time: workers.py wraps it

    def on_sighup() -> None:
        log.info("received SIGHUP: reloading %s", state.settings.config_path or "(no config file)")
        task: asyncio.Task[ReloadOutcome] = loop.create_task(reload())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
