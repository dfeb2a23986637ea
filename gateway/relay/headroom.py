"""How much a deployment may still take before its provider answers 429.

Two sources, per deployment id (``provider/model``):

* **its configured quota**: ``rpm`` / ``tpm`` on the deployment, counted in sliding
  one-minute windows of the ``limits`` library over the gateway's own storages
  (:mod:`gateway.limits.storage`): Redis when ``REDIS_URL`` is set (every replica counts
  into the same window), memory otherwise. Each attempt takes one request before it is
  sent; tokens are charged when the call's usage is known, so ``tpm`` turns a
  deployment away once a minute's tokens are spent.
* **what the provider said**: ``x-ratelimit-remaining-requests`` / ``-tokens`` with their
  ``x-ratelimit-reset-*`` (OpenAI's ``6m0s`` / ``1.5s`` / ``20ms`` forms, or seconds),
  and ``x-ratelimit-limit-*`` for the fraction. Nothing remaining means no more calls
  until the reset. (A 429's ``Retry-After`` cools the deployment in the breaker.)

Dispatch asks :meth:`DeploymentLimits.take` before each attempt and skips a deployment
that has no room, so the next one in its group serves the call instead of the provider
answering 429. :meth:`headroom` (0..1, the tightest of the known fractions) is what
the ``least-busy`` strategy sorts by; it reads only what this process last saw, never
the store, so ordering costs no I/O.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from limits import RateLimitItem

from gateway.core.config import Deployment
from gateway.limits.storage import STORAGE_ERRORS, KeyedItem, LocalStorage, RedisWindowStorage, Windows

__all__ = ["DeploymentLimits", "ProviderReport", "parse_reset"]

_KINDS = ("requests", "tokens")
#: Each kind a provider reports, with its headers' names (per answer: no name formatted).
_REPORT_HEADERS = tuple(
    (kind, f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}", f"x-ratelimit-limit-{kind}")
    for kind in _KINDS
)

log = logging.getLogger("gateway.headroom")

#: The window of ``rpm`` and ``tpm``.
MINUTE = 60
#: Seconds between two warnings about an unreachable store.
WARN_EVERY = 10.0

#: The last letters of :data:`_DURATION`'s units.
_UNIT_ENDS = ("h", "m", "s")
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?")


def parse_reset(raw: str | None) -> float | None:
    """Seconds in ``x-ratelimit-reset-*``: ``1s``, ``6m0s``, ``1h2m3s``, ``20ms`` or ``0.5``."""
    if not raw:
        return None
    raw = raw.strip()
    # OpenAI's form ("1s", "6m0s", "20ms") ends with a unit, which no number float() takes
    # ends with (its letters end "inf", "infinity", "nan"): the ValueError (~1 µs) is spared.
    if not raw.endswith(_UNIT_ENDS):
        try:
            return max(0.0, float(raw))
        except ValueError:
            pass
    match = _DURATION.fullmatch(raw)
    if match is None:
        return None
    hours, minutes, seconds, millis = match.groups()
    if not (hours or minutes or seconds or millis):
        return None
    return ((float(hours) if hours else 0.0) * 3600 + (float(minutes) if minutes else 0.0) * 60
            + (float(seconds) if seconds else 0.0) + (float(millis) if millis else 0.0) / 1000)


def _int(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(float(raw))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ProviderReport:
    """What a provider's last answer said about one of its limits."""

    remaining: int
    limit: int | None
    #: Monotonic time the provider's window resets (remaining is void after it).
    resets_at: float

    def fraction(self, now: float) -> float | None:
        if now >= self.resets_at:
            return None
        if self.remaining <= 0:
            return 0.0
        if self.limit:
            return min(1.0, self.remaining / self.limit)
        return None


@dataclass(slots=True)
class _Seen:
    """The last counts this process saw for a deployment's own windows."""

    requests_left: int | None = None
    tokens_left: int | None = None
    at: float = 0.0


class DeploymentLimits:
    """Per-deployment quotas (config) and the providers' own reports (headers)."""

    def __init__(self, *, redis_url: str | None = None, key_prefix: str = "llmg", timeout: float = 1.0) -> None:
        self._redis = RedisWindowStorage(redis_url, key_prefix=key_prefix, timeout=timeout) if redis_url else None
        self._memory = Windows("memory", LocalStorage(), "sliding-window")
        self._shared = Windows("redis", self._redis, "sliding-window") if self._redis is not None else self._memory
        self._items: dict[int, RateLimitItem] = {}
        self._seen: dict[str, _Seen] = {}
        self._reports: dict[tuple[str, str], ProviderReport] = {}
        #: Deployment id → its ``tpm`` as last routed to (a reload may change it).
        self._tpm: dict[str, int] = {}
        self._quiet_until = 0.0
        #: Where windows are counted (``redis`` or ``memory``), for docs and /admin.
        self.store = "redis" if self._redis is not None else "memory"

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.close()

    def _item(self, amount: int) -> RateLimitItem:
        item = self._items.get(amount)
        if item is None:
            item = self._items[amount] = KeyedItem(amount, MINUTE, namespace="DEPLOYMENT")
        return item

    # -- before an attempt ---------------------------------------------------------------
    async def take(self, deployment: Deployment) -> float | None:
        """Take one request of ``deployment``'s room: None if it may be sent, else the
        seconds until it may (it is skipped meanwhile).

        A store that cannot answer (Redis down) does not stop the call: the provider's
        own 429 is the backstop then.
        """
        now = time.monotonic()
        wait = self._reported_wait(deployment.id, now)
        if wait is not None:
            return wait
        if deployment.rpm is None and deployment.tpm is None:
            return None
        if deployment.tpm is not None:
            self._tpm[deployment.id] = deployment.tpm
        else:
            self._tpm.pop(deployment.id, None)
        windows = self._shared
        seen = self._seen.setdefault(deployment.id, _Seen())
        try:
            if deployment.tpm is not None:
                tokens = await windows.stats(self._item(deployment.tpm), "tokens", deployment.id)
                seen.tokens_left = tokens.remaining
                if tokens.remaining <= 0:
                    return max(0.05, tokens.reset_time - time.time())
            if deployment.rpm is not None:
                item = self._item(deployment.rpm)
                # One pipeline on Redis (in order): the hit, then what it left.
                taken, stats = await windows.together(
                    windows.hit(item, "requests", deployment.id), windows.stats(item, "requests", deployment.id)
                )
                if not taken:
                    seen.requests_left, seen.at = 0, now
                    return max(0.05, stats.reset_time - time.time())
                seen.requests_left = stats.remaining
            seen.at = now
        except STORAGE_ERRORS as exc:
            self._warn(f"deployment limits of {deployment.id} not counted ({exc}): the provider's 429 decides")
        return None

    def _warn(self, message: str) -> None:
        """One warning per ``WARN_EVERY`` seconds: an outage must not flood the log."""
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + WARN_EVERY
            log.warning(message)

    def reported_wait(self, deployment_id: str) -> float | None:
        """What :meth:`take` answers for a deployment with neither ``rpm`` nor ``tpm``
        (nothing to count): the wait its provider's last answer asked for, else None.
        Synchronous, so such a call (most of them) awaits no coroutine for it."""
        if not self._reports:
            return None
        return self._reported_wait(deployment_id, time.monotonic())

    def _reported_wait(self, deployment_id: str, now: float) -> float | None:
        reports = self._reports
        wait: float | None = None
        for kind in _KINDS:
            report = reports.get((deployment_id, kind))
            if report is not None and report.remaining <= 0 and report.resets_at > now:
                left = report.resets_at - now
                if wait is None or left > wait:
                    wait = left
        return wait

    # -- after an attempt ----------------------------------------------------------------
    def observe(self, deployment_id: str, headers: Mapping[str, str]) -> None:
        """Fold a provider answer's ``x-ratelimit-*`` headers in (any status)."""
        now = time.monotonic()
        for kind, remaining_header, reset_header, limit_header in _REPORT_HEADERS:
            remaining = _int(headers.get(remaining_header))
            if remaining is None:
                continue
            reset = parse_reset(headers.get(reset_header))
            # No reset given: trust the number for one window at most.
            resets_at = now + (reset if reset is not None else MINUTE)
            limit = _int(headers.get(limit_header))
            self._reports[(deployment_id, kind)] = ProviderReport(remaining, limit, resets_at)

    def charges_tokens(self, deployment_id: str | None) -> bool:
        """Whether a call served by ``deployment_id`` has tokens to count (a ``tpm`` was seen)."""
        return deployment_id is not None and deployment_id in self._tpm

    async def charge_tokens(self, deployment_id: str, tokens: int) -> None:
        """Count a finished call's tokens toward its deployment's ``tpm``."""
        tpm = self._tpm.get(deployment_id)
        if tpm is None or tokens <= 0:
            return
        try:
            await self._shared.add(self._item(tpm), "tokens", deployment_id, amount=tokens)
        except STORAGE_ERRORS as exc:
            self._warn(f"tokens of {deployment_id} not counted ({exc})")
            return
        seen = self._seen.setdefault(deployment_id, _Seen())
        if seen.tokens_left is not None:
            seen.tokens_left -= tokens

    # -- for least-busy and /admin -------------------------------------------------------
    def headroom(self, deployment: Deployment, now: float | None = None) -> float:
        """0 (no room) .. 1 (untouched or unlimited): the tightest known fraction left."""
        now = time.monotonic() if now is None else now
        fractions: list[float] = []
        seen = self._seen.get(deployment.id)
        fresh = seen is not None and now - seen.at < MINUTE
        if fresh and seen is not None:
            if deployment.rpm and seen.requests_left is not None:
                fractions.append(max(0.0, seen.requests_left / deployment.rpm))
            if deployment.tpm and seen.tokens_left is not None:
                fractions.append(max(0.0, seen.tokens_left / deployment.tpm))
        for kind in ("requests", "tokens"):
            report = self._reports.get((deployment.id, kind))
            if report is not None and (fraction := report.fraction(now)) is not None:
                fractions.append(fraction)
        return min(fractions) if fractions else 1.0

    def snapshot(self, deployments: list[Deployment]) -> dict[str, float]:
        """``{deployment id: headroom}`` for a strategy to sort by."""
        now = time.monotonic()
        return {d.id: self.headroom(d, now) for d in deployments}
