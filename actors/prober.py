"""ProberActor: active health checks of the providers that opt in (``health_check:``).

State it owns, per watched provider: consecutive good and failed probes, whether the
provider is healthy, when it was last probed, how long the probe took and why the last
one failed. A probe is the provider's model list (``GET {base_url}/models`` on the
OpenAI and Anthropic wires): cheap, never billed, never a call record.

Each watched provider has one probing task (the first probe at once, then every
``interval``, each bounded by ``timeout``); its results come back on the internal lane,
so the table is written only by the actor. ``unhealthy_after`` failures in a row mark a
provider unhealthy, ``healthy_after`` successes in a row heal it. The table is
published as a read-only mapping of frozen :class:`ProbeStatus`, which dispatch reads
without a hop: an unhealthy provider's deployments are passed over before a user's
call goes to them.

A config reload sends :class:`Watch` with the new providers: unchanged entries (same
provider object, same settings) keep their history and task; others start afresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from actors.runtime import Actor, ActorError, ActorRef
from gateway.core.config import HealthCheck
from gateway.providers.base import ProviderError

if TYPE_CHECKING:
    from gateway.providers.base import Provider

__all__ = ["ProbeStatus", "ProberActor", "ProberHandle", "Watch"]

log = logging.getLogger("gateway.health")


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    """One watched provider's published entry; replaced whole after every probe."""

    provider: str
    settings: HealthCheck
    #: Until the first probe decides, a provider counts as healthy (as it did before).
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    probes: int = 0
    #: Unix time of the last probe's end (None: not probed yet).
    last_checked: float | None = None
    last_latency: float | None = None
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "consecutive_failures": self.consecutive_failures,
            "consecutive_successes": self.consecutive_successes,
            "probes": self.probes,
            "last_checked": self.last_checked,
            "last_latency_seconds": self.last_latency,
            "last_error": self.last_error,
            "interval_seconds": self.settings.interval,
            "timeout_seconds": self.settings.timeout,
        }


@dataclass(frozen=True, slots=True)
class Watch:
    """Probe exactly these providers from now on (tell): ``(name, settings, provider)``."""

    providers: tuple[tuple[str, HealthCheck, Provider], ...]


@dataclass(frozen=True, slots=True)
class _Probed:
    """Internal: one probe's result for the watch entry ``epoch``."""

    provider: str
    epoch: int
    ok: bool
    latency: float
    error: str | None


class ProberActor(Actor[Watch]):
    """Owns the watched providers' probe history; publishes it as ``view``."""

    name = "prober"
    mailbox_size = 64

    def __init__(self) -> None:
        super().__init__()
        self._table: dict[str, ProbeStatus] = {}
        self.view: Mapping[str, ProbeStatus] = MappingProxyType(self._table)
        #: name → (epoch, provider object, probing task): a result of an older epoch is stale.
        self._watching: dict[str, tuple[int, Provider, asyncio.Task[None]]] = {}
        self._epochs = 0

    async def receive(self, msg: Watch) -> Any:
        if isinstance(msg, Watch):
            self._watch(msg)
            return None
        raise TypeError(f"unexpected message {msg!r}")

    async def on_internal(self, msg: Any) -> None:
        if isinstance(msg, _Probed):
            self._fold(msg)

    async def on_stop(self) -> None:
        for _epoch, _provider, task in self._watching.values():
            task.cancel()
        self._watching.clear()

    def _watch(self, msg: Watch) -> None:
        wanted = {name: (settings, provider) for name, settings, provider in msg.providers}
        for name in list(self._watching):
            epoch, provider, task = self._watching[name]
            entry = wanted.get(name)
            old = self._table.get(name)
            if entry is not None and entry[1] is provider and old is not None and old.settings == entry[0]:
                continue  # unchanged: keep its history and its task
            task.cancel()
            del self._watching[name]
            self._table.pop(name, None)
        for name, (settings, provider) in wanted.items():
            if name in self._watching:
                continue
            self._epochs += 1
            epoch = self._epochs
            self._table[name] = ProbeStatus(name, settings)
            task = asyncio.get_running_loop().create_task(self._probe_forever(name, epoch, settings, provider))
            self._watching[name] = (epoch, provider, task)

    async def _probe_forever(self, name: str, epoch: int, settings: HealthCheck, provider: Provider) -> None:
        while True:
            started = time.monotonic()
            error: str | None = None
            try:
                async with asyncio.timeout(settings.timeout):
                    await provider.list_models()
            except TimeoutError:
                error = f"no answer within {settings.timeout:g}s"
            except ProviderError as exc:
                error = str(exc) or type(exc).__name__
            self.post_internal(_Probed(name, epoch, error is None, time.monotonic() - started, error))
            await asyncio.sleep(settings.interval)

    def _fold(self, msg: _Probed) -> None:
        watched = self._watching.get(msg.provider)
        old = self._table.get(msg.provider)
        if watched is None or watched[0] != msg.epoch or old is None:
            return  # a result from before a reload changed the entry
        settings = old.settings
        if msg.ok:
            successes, failures = old.consecutive_successes + 1, 0
            healthy = old.healthy or successes >= settings.healthy_after
        else:
            successes, failures = 0, old.consecutive_failures + 1
            healthy = old.healthy and failures < settings.unhealthy_after
        if healthy != old.healthy:
            if healthy:
                log.info("provider %s is healthy again (%d good probes)", msg.provider, successes)
            else:
                log.warning("provider %s is unhealthy after %d failed probes: %s", msg.provider, failures, msg.error)
        self._table[msg.provider] = replace(
            old, healthy=healthy, consecutive_failures=failures, consecutive_successes=successes,
            probes=old.probes + 1, last_checked=time.time(), last_latency=msg.latency,
            last_error=msg.error,
        )


class ProberHandle:
    """What dispatch and the admin API read (no hop), and how a reload re-aims it."""

    __slots__ = ("_ref", "_view")

    def __init__(self, actor: ProberActor, ref: ActorRef[Any]) -> None:
        self._ref = ref
        self._view = actor.view

    def healthy(self, provider: str) -> bool:
        """False only for a watched provider whose probes failed; unwatched: True."""
        status = self._view.get(provider)
        return status is None or status.healthy

    def retry_after(self, provider: str) -> float:
        """How long until the next probe may heal ``provider`` (its interval)."""
        status = self._view.get(provider)
        return status.settings.interval if status is not None else 1.0

    def status(self, provider: str) -> ProbeStatus | None:
        return self._view.get(provider)

    @property
    def view(self) -> Mapping[str, ProbeStatus]:
        return self._view

    def watch(self, providers: Mapping[str, Provider]) -> None:
        """Probe the providers whose config opts in (start-up and every reload)."""
        watched = tuple(
            (name, p.config.health_check, p) for name, p in providers.items() if p.config.health_check is not None
        )
        try:
            self._ref.tell(Watch(watched))
        except ActorError:
            log.error("health checks not updated: the prober's mailbox is full")
