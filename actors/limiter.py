"""LimiterActor: every rate limit and quota, and the handle the edge calls.

The edge asks twice per request: :meth:`LimiterHandle.check_ip` before authentication
(a flood guard per client address, which therefore also shields the database), and
:meth:`LimiterHandle.acquire` after it (the key's own limits). State it owns:

* the windows, through ``limits`` strategies over a storage (:mod:`gateway.limits.storage`):
  memory for one instance, Redis shared by every replica, or per-key request windows in
  PostgreSQL (the seed's table); per-IP and token windows never go to PostgreSQL;
* per key: requests per window (``rate_limit_requests`` per
  ``rate_limit_window_seconds``), tokens per minute (checked before the call against what
  is left, charged with the real usage when the call ends) and concurrent requests
  (a count in memory, or leases in Redis renewed while the request runs);
* the degraded state: when a remote storage fails, decisions move to this process's
  memory at once, a probe watches the storage, and it is used again when it answers;
* counts of rejections by scope (``ip``, ``requests``, ``tokens``, ``concurrency``).

A rejected request consumes nothing: hits the library counted anyway are refunded, a
concurrency slot taken alongside a rejected hit is given back.

Memory decisions are plain function calls with no I/O (microseconds), made in the
asking request's task (:meth:`LimiterActor.decide_now`; for the handle's per-IP check,
acquire and release without any message: ``check_ip_now``, ``acquire_now``, the
Permit) or the actor's loop. Remote
ones run as tasks; their storage commands of one event-loop turn share one Redis
pipeline, and each result comes back on the internal lane, where state changes.

Why one module of ~1300 lines: one actor per module; the limiter's windows, token quotas,
concurrency leases, storage outage fallback and the edge's handle share one state and one
set of messages. The storages themselves live in gateway/limits/storage.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import asyncpg
from limits import RateLimitItem, parse
from limits.util import WindowStats
from multidict import CIMultiDict, istr

from actors.runtime import Actor, ActorRef
from gateway.core.config import RateLimitSettings
from gateway.core.errors import RateLimited
from gateway.limits.storage import (
    STORAGE_ERRORS,
    KeyedItem,
    LocalStorage,
    MemoryCounter,
    PostgresWindowStorage,
    RedisWindowStorage,
    Windows,
)

if TYPE_CHECKING:
    from actors.auth import VerifiedKey
    from gateway.auth.keys import KeyPolicy
    from gateway.core.usage import CallRecord

__all__ = [
    "Acquire",
    "CheckIp",
    "Decision",
    "LimiterActor",
    "LimiterHandle",
    "Permit",
    "Release",
    "StorageDown",
    "describe_ip_guard",
    "reset_header",
]

log = logging.getLogger("gateway.limiter")

SCOPES = ("ip", "requests", "tokens", "concurrency")


#: The fraction of a second in ``x-ratelimit-reset-*``, by its milliseconds: ``.5``, ``.25``,
#: ``.125`` (trailing zeros dropped), nothing for none: built once, not per answer.
_MS_FRACTION = ("", *(f".{ms:03d}".rstrip("0") for ms in range(1, 1000)))


def reset_header(seconds: float) -> str:
    """A duration as OpenAI writes ``x-ratelimit-reset-*``: ``20ms``, ``1s``, ``6m0s``, ``1h2m3.5s``."""
    ms = math.ceil(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms" if ms > 0 else "0ms"
    if ms < 60_000:  # the common case (a minute's window): seconds with up to three decimals
        return f"{ms // 1000}{_MS_FRACTION[ms % 1000]}s"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    # Whole milliseconds: seconds with up to three decimals, trailing zeros dropped.
    whole, fraction = divmod(rest, 1000)
    if hours:
        return f"{hours}h{minutes}m{whole}{_MS_FRACTION[fraction]}s"
    return f"{minutes}m{whole}{_MS_FRACTION[fraction]}s"


class StorageDown(Exception):
    """A remote storage failed while deciding; the limiter falls back to memory."""

    def __init__(self, store: str, error: BaseException) -> None:
        super().__init__(f"{store} storage failed: {error!r}")
        self.store = store
        self.error = error


# -- messages ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CheckIp:
    """The per-address guard; replies with a Decision. ``kind`` says which question:

    * ``any``: may one more request from ``ip`` pass the generous cap on all requests
      (``per_ip_all``)? Counts it.
    * ``peek``: has ``ip`` spent its allowance of failed attempts (``per_ip``)? Counts
      nothing: asked before a request that would cost a key lookup.
    * ``failed``: count one unauthenticated or failed attempt of ``ip``; always allowed.
    """

    ip: str
    kind: str = "any"


@dataclass(frozen=True, slots=True)
class Acquire:
    """Admit one request of a key under its limits; replies with a Decision."""

    #: Unique across replicas: names the request's concurrency lease in Redis.
    permit_id: str
    api_key_id: str
    requests: int
    window_seconds: int
    tokens_per_minute: int | None
    max_concurrent: int | None


@dataclass(frozen=True, slots=True)
class Release:
    """The request ended (internal lane, never shed): free its slot, charge its tokens.

    ``abandoned``: the asker gave up before the answer; undo a grant if one comes.
    """

    permit_id: str
    api_key_id: str
    tokens_per_minute: int | None
    tokens: int
    abandoned: bool = False


# -- replies -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to a check: allowed or not, and what the client is told."""

    allowed: bool
    #: Which limit refused (one of SCOPES), None when allowed.
    scope: str | None = None
    retry_after: float = 0.0
    message: str = ""
    #: ``x-ratelimit-*`` headers of this answer (per-key checks only).
    headers: tuple[tuple[str, str], ...] = ()
    #: The request holds a concurrency slot until released.
    holds_slot: bool = False


_ALLOWED = Decision(allowed=True)


# -- internal results --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Outcome:
    decision: Decision
    redis_slot: bool


@dataclass(frozen=True, slots=True)
class _Decided:
    msg: CheckIp | Acquire
    reply: asyncio.Future[Decision]
    outcome: _Outcome | None
    error: BaseException | None
    local_slot: bool | None


@dataclass(frozen=True, slots=True)
class _Recovered:
    store: str


@dataclass(frozen=True, slots=True)
class _Renewed:
    """The outcome of one round of Redis concurrency-lease renewals."""

    #: Leases Redis no longer held (expired or removed): that slot may now be someone else's.
    lost: int
    #: Renewals that failed (Redis unreachable): retried next tick.
    failed: int


@dataclass(frozen=True, slots=True)
class _Charged:
    msg: Release
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class _Unreleased:
    slot: str
    member: str


@dataclass(frozen=True, slots=True)
class _Held:
    api_key_id: str
    where: str  # "local" | "redis"


class _Store:
    """A place windows live: its primary storage and, if remote, a memory fallback."""

    __slots__ = ("down", "fallback", "name", "primary")

    def __init__(self, primary: Windows, fallback: Windows | None) -> None:
        self.name = primary.name
        self.primary = primary
        self.fallback = fallback
        self.down = False

    def current(self) -> Windows:
        return self.fallback if self.down and self.fallback is not None else self.primary


#: Keys and addresses whose memory counters the limiter keeps (cleared when full).
_MAX_KEPT = 4096


class _KeyLimits:
    """What the memory path keeps of one key under one policy: its counters."""

    __slots__ = ("generation", "key_id", "policy", "requests", "tokens")

    def __init__(
        self, policy: KeyPolicy, key_id: str, generation: int, requests: MemoryCounter, tokens: MemoryCounter | None
    ) -> None:
        self.policy = policy
        self.key_id = key_id
        #: Of the windows the counters belong to (LimiterActor._generation when made).
        self.generation = generation
        self.requests = requests
        self.tokens = tokens


class LimiterActor(Actor[CheckIp | Acquire]):
    """Owns every window; see the module docstring."""

    name = "limiter"
    ask_timeout = 2.0

    def __init__(
        self,
        settings: RateLimitSettings,
        *,
        redis_url: str | None = None,
        pool: asyncpg.Pool | None = None,
        mailbox_size: int = 8192,
        lease_seconds: float = 30.0,
        probe_seconds: float = 0.5,
        storage_timeout: float = 1.0,
    ) -> None:
        self.mailbox_size = mailbox_size
        super().__init__()
        self._settings = settings
        self._redis_url = redis_url
        self._pool = pool
        self._lease_ms = int(lease_seconds * 1000)
        self._probe_seconds = probe_seconds
        self._storage_timeout = storage_timeout
        #: Failed attempts per address (``per_ip``) and all requests per address (``per_ip_all``).
        self._ip_items = _ip_items(settings.per_ip, settings.per_ip_burst)
        self._ip_all_items = _ip_items(settings.per_ip_all, None)
        self._items: dict[tuple[int, int], RateLimitItem] = {}
        self._own_pool: asyncpg.Pool | None = None
        self._redis: RedisWindowStorage | None = None
        self._shared: _Store | None = None
        self._requests: _Store | None = None
        self._inflight: dict[str, int] = {}
        self._held: dict[str, _Held] = {}
        self._abandoned: dict[str, float] = {}
        self._unreleased: list[tuple[str, str]] = []
        #: Redis concurrency leases found lost on renewal, and renewals that failed: a long
        #: stream whose lease is lost no longer counts toward its key's max_concurrent.
        self.leases_lost = 0
        self.lease_renew_failures = 0
        #: Whether the last renewal round failed or found a lease lost (``/readyz``).
        self.lease_trouble: str | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._last_prune = 0.0
        self._rejections: Counter[str] = Counter()
        self._degraded: dict[str, str] = {}
        #: Rejections so far by scope (read-only view for metrics).
        self.rejections: Mapping[str, int] = MappingProxyType(self._rejections)
        #: Storages currently replaced by memory, with why (read-only view for /readyz).
        self.degraded: Mapping[str, str] = MappingProxyType(self._degraded)
        #: Called with the scope of every rejection, in the actor's loop (metrics hook).
        self.rejection_listeners: list[Callable[[str], None]] = []
        #: Whether the per-IP flood guard is on (``per_ip: off`` turns it off).
        self.guards_ip = bool(self._ip_items or self._ip_all_items)
        self.description = ""
        # The memory path (decided in the asking request's task, see decide_now), kept
        # ready by _stores_changed whenever the windows in use change (start, outage,
        # recovery): the windows per-IP checks and key decisions use when they are this
        # process's memory (else None), and what each key and address needs of them.
        self._generation = 0
        self._ip_windows: Windows | None = None
        self._key_windows: tuple[Windows, Windows] | None = None
        self._keys: dict[uuid.UUID, _KeyLimits] = {}
        self._ip_counters: dict[str, tuple[MemoryCounter, ...]] = {}
        self._ip_counters_of: tuple[RateLimitItem, ...] = self._ip_all_items
        #: Every address whose failed attempts were counted, while all of them are counted
        #: in this process's memory (no Redis, whose counts other replicas add to): a peek
        #: at any other address reads untouched failure windows, which allow at least one
        #: (``per_ip`` >= 1), so it cannot refuse. None: not known (Redis; too many kept).
        self._failed_ips: set[str] | None = None

    # -- lifecycle ----------------------------------------------------------------------
    async def on_start(self) -> None:
        settings = self._settings
        storage = settings.storage
        strategy = settings.strategy
        redis_url = self._redis_url
        if storage is not None and storage.startswith(("redis", "rediss", "async+redis")):
            redis_url = storage
        elif storage is not None and storage.startswith("memory"):
            redis_url = None
        if redis_url:
            self._redis = RedisWindowStorage(redis_url, key_prefix=settings.key_prefix, timeout=self._storage_timeout)
            self._shared = _Store(Windows("redis", self._redis, strategy), Windows("memory", LocalStorage(), strategy))
        else:
            self._shared = _Store(Windows("memory", LocalStorage(), strategy), None)
        self._failed_ips = set() if self._redis is None and _allow_one(self._ip_items) else None
        if storage is not None and storage.startswith("postgres"):
            pool = self._pool
            if storage != "postgres":
                # min_size=0: a database that is down at start degrades; it does not stop start-up.
                pool = self._own_pool = await asyncpg.create_pool(storage, min_size=0, max_size=4)
            if pool is None:
                raise ValueError("rate_limits.storage: postgres needs the gateway's database pool")
            # PostgreSQL holds fixed windows only (the seed's table), whatever `strategy` says.
            self._requests = _Store(
                Windows("postgres", PostgresWindowStorage(pool, timeout=self._storage_timeout), "fixed-window"),
                Windows("memory", LocalStorage(), "fixed-window"),
            )
        else:
            self._requests = self._shared
        self._stores_changed()
        self.description = self._describe()
        if self._redis is not None:
            try:
                await self._redis.load_scripts()
            except Exception as exc:  # noqa: BLE001 - Redis down at start: serve from memory
                self._degrade(self._shared, exc)
        self._tick_task = asyncio.get_running_loop().create_task(self._tick_forever())
        log.info("rate limits: %s", self.description)

    async def on_stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self._redis is not None:
            await self._redis.close()
        if self._own_pool is not None:
            await self._own_pool.close()

    def _describe(self) -> str:
        assert self._shared is not None and self._requests is not None
        return (
            f"{describe_ip_guard(self._settings)}; the guard counts unauthenticated and failed attempts, "
            f"every request per address is capped at {self._settings.per_ip_all}; tokens in {self._shared.name}, per-key requests in {self._requests.name} "
            f"({self._requests.primary.strategy.__class__.__name__}), concurrency in "
            f"{'redis' if self._redis is not None else 'memory'}"
        )

    # -- messages -----------------------------------------------------------------------
    def decide_now(self, msg: CheckIp | Acquire) -> Decision | None:
        """Decide ``msg`` in the caller's task when every window it touches is in memory.

        Memory decisions do no I/O and are plain function calls (the ``*_now`` methods),
        and asyncio runs one callback at a time, so deciding here is as atomic as deciding
        in the actor's loop, which makes these same calls; it saves the two hops of an
        ask. Returns None when the decision needs a remote storage (or the actor is not
        running): the caller asks instead, and the actor keeps owning every remote decision.
        """
        shared, requests = self._shared, self._requests
        if shared is None or requests is None or not self.running:
            return None
        if isinstance(msg, CheckIp):
            windows = shared.current()
            if not windows.immediate:
                return None
            return self._settle_ip(self._decide_ip_now(windows, msg))
        requests_windows, shared_windows = requests.current(), shared.current()
        if not (requests_windows.immediate and shared_windows.immediate):
            return None
        local_slot = self._reserve_local_slot(msg)
        decision = self._decide_key_now(requests_windows, shared_windows, msg, local_slot)
        return self._settle_key(msg, decision, local_slot)

    def release_now(self, msg: Release) -> bool:
        """Apply a release in the caller's task when it touches memory only; False: post it.

        Done where the decisions are made so a release is seen by the very next
        decision, as it was when both went through the mailbox (releases first).
        """
        if msg.abandoned or not self.running or self._shared is None:
            return False
        held = self._held.get(msg.permit_id)
        if held is not None and held.where != "local":
            return False
        charge = msg.tokens > 0 and bool(msg.tokens_per_minute)
        if charge and not self._shared.current().immediate:
            return False
        self._free_slot(msg.permit_id)
        if charge:
            self._charge(msg)
        return True

    async def receive(self, msg: CheckIp | Acquire) -> Any:
        assert self._shared is not None and self._requests is not None
        if isinstance(msg, CheckIp):
            windows = self._shared.current()
            if windows.immediate:
                return self._settle_ip(self._decide_ip_now(windows, msg))
            return self._remote(self._decide_ip(windows, msg), msg, None)
        if isinstance(msg, Acquire):
            local_slot = self._reserve_local_slot(msg)
            requests, shared = self._requests.current(), self._shared.current()
            if requests.immediate and shared.immediate:
                return self._settle_key(msg, self._decide_key_now(requests, shared, msg, local_slot), local_slot)
            return self._remote(self._decide_key(requests, shared, msg, local_slot), msg, local_slot)
        raise TypeError(f"unexpected message {msg!r}")

    async def on_internal(self, msg: Any) -> None:
        if isinstance(msg, Release):
            await self._release(msg)
        elif isinstance(msg, _Decided):
            await self._finish_remote(msg)
        elif isinstance(msg, _Charged):
            if isinstance(msg.error, StorageDown):
                self._degrade_named(msg.error)
                self._charge(msg.msg)  # on memory now
        elif isinstance(msg, _Recovered):
            self._recover(msg.store)
        elif isinstance(msg, _Renewed):
            self._renewed(msg)
        elif isinstance(msg, _Unreleased):
            self._unreleased.append((msg.slot, msg.member))
        elif msg == "tick":
            self._tick()

    def _renewed(self, renewed: _Renewed) -> None:
        self.leases_lost += renewed.lost
        self.lease_renew_failures += renewed.failed
        if renewed.lost:
            log.warning("rate limits: %d concurrency lease(s) lost in Redis; those streams no longer count", renewed.lost)
        if renewed.failed:
            log.warning("rate limits: %d concurrency lease renewal(s) failed; retried next tick", renewed.failed)
        trouble = []
        if renewed.lost:
            trouble.append(f"{renewed.lost} lost")
        if renewed.failed:
            trouble.append(f"{renewed.failed} renewal(s) failed")
        self.lease_trouble = ", ".join(trouble) or None

    def _remote(
        self, decide: Coroutine[Any, Any, Any], msg: CheckIp | Acquire, local_slot: bool | None
    ) -> asyncio.Future[Decision]:
        reply: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()

        def done(result: Any, error: BaseException | None) -> _Decided:
            outcome = result if isinstance(result, _Outcome) else None
            if isinstance(result, Decision):
                outcome = _Outcome(result, redis_slot=False)
            return _Decided(msg, reply, outcome, error, local_slot)

        self.spawn(decide, done)
        return reply

    async def _finish_remote(self, done: _Decided) -> None:
        assert self._shared is not None and self._requests is not None
        if done.error is None and done.outcome is not None:
            if isinstance(done.msg, CheckIp):
                decision = self._settle_ip(done.outcome.decision)
            else:
                decision = self._settle_key(done.msg, done.outcome.decision, done.local_slot, done.outcome.redis_slot)
            if not done.reply.done():
                done.reply.set_result(decision)
            return
        if not isinstance(done.error, StorageDown):
            if isinstance(done.msg, Acquire) and done.local_slot:
                self._free_local(done.msg.api_key_id)
            if not done.reply.done():
                done.reply.set_exception(done.error or RuntimeError("no decision"))
            return
        # A remote storage failed: memory takes over at once, and this request is decided there.
        self._degrade_named(done.error)
        msg = done.msg
        if isinstance(msg, CheckIp):
            windows = self._shared.current()
            if windows.immediate:
                decision = self._settle_ip(self._decide_ip_now(windows, msg))
                if not done.reply.done():
                    done.reply.set_result(decision)
                return
            retry = self._remote(self._decide_ip(windows, msg), msg, None)
        else:
            # A slot reserved in memory stays reserved; one that was to be leased in Redis
            # is now taken in memory.
            local_slot = done.local_slot if done.local_slot is not None else self._reserve_local_slot(msg)
            requests, shared = self._requests.current(), self._shared.current()
            if requests.immediate and shared.immediate:
                decision = self._settle_key(msg, self._decide_key_now(requests, shared, msg, local_slot), local_slot)
                if not done.reply.done():
                    done.reply.set_result(decision)
                return
            retry = self._remote(self._decide_key(requests, shared, msg, local_slot), msg, local_slot)
        retry.add_done_callback(lambda f: _copy_outcome(f, done.reply))

    # -- per-IP ---------------------------------------------------------------------------
    # Two homes for the same operations: the coroutines for remote storages (their ops of
    # one request share a pipeline), and a synchronous twin for memory, which a request
    # decides in its own task: coroutines there cost more than the dict work they wrap.
    # Both hit, read and refund the same windows in the same order; what the answer says
    # is built by the same functions (_ip_refusal, _failures_spent).
    async def _decide_ip(self, windows: Windows, msg: CheckIp) -> Decision:
        if msg.kind == "failed":
            self._note_failure(msg.ip)
            failures = self._ip_items
            if failures:
                await _together(windows, *(windows.add(item, "ipfail", msg.ip, amount=1) for item in failures))
            return _ALLOWED
        if msg.kind == "peek":
            items = self._ip_items
            if not items:
                return _ALLOWED
            stats = await _together(windows, *(windows.stats(item, "ipfail", msg.ip) for item in items))
            return _failures_spent(stats, time.time())
        ids = ("ip", msg.ip)
        items = self._ip_all_items
        if not items:
            return _ALLOWED
        oks = await _together(windows, *(windows.hit(item, *ids) for item in items))
        if all(oks):
            return _ALLOWED
        rejected = [item for item, ok in zip(items, oks, strict=True) if not ok]
        refunds = [windows.add(item, *ids, amount=-1) for item, ok in zip(items, oks, strict=True) if ok]
        results = await _together(windows, *(windows.stats(item, *ids) for item in rejected), *refunds)
        return _ip_refusal(results[: len(rejected)], time.time())

    def _decide_ip_now(self, windows: Windows, msg: CheckIp) -> Decision:
        """:meth:`_decide_ip` on memory windows, at one reading of the clock."""
        now = time.time()
        ip = msg.ip
        if msg.kind == "failed":
            self._note_failure(ip)
            for item in self._ip_items:
                windows.add_now(item, "ipfail", ip, amount=1, now=now)
            return _ALLOWED
        if msg.kind == "peek":
            return _failures_spent([windows.stats_now(item, "ipfail", ip, now=now) for item in self._ip_items], now)
        return _ip_hits(self._ip_counters_in(windows, ip), now)

    def _note_failure(self, ip: str) -> None:
        """``ip``'s failed attempt is about to be counted: keep it in ``_failed_ips``."""
        failed = self._failed_ips
        if failed is not None and ip not in failed:
            if len(failed) >= _MAX_KEPT:
                self._failed_ips = None  # too many to keep: every address is peeked at from now on
            else:
                failed.add(ip)

    def _ip_counters_in(self, windows: Windows, ip: str) -> tuple[MemoryCounter, ...]:
        """The memory counters of ``ip``'s ``per_ip_all`` windows (kept for the windows in use)."""
        if windows is not self._ip_windows:
            return tuple(windows.counter(item, "ip", ip) for item in self._ip_all_items)
        cache = self._ip_counters
        if self._ip_counters_of is not self._ip_all_items:  # a reload changed the guard
            cache.clear()
            self._ip_counters_of = self._ip_all_items
        counters = cache.get(ip)
        if counters is None:
            if len(cache) >= _MAX_KEPT:
                cache.clear()  # it only saves work: the counts are in the windows
            counters = cache[ip] = tuple(windows.counter(item, "ip", ip) for item in self._ip_all_items)
        return counters

    def check_ip_now(self, ip: str) -> Decision | None:
        """``CheckIp(ip)`` (kind ``any``) decided at once when its windows are in memory
        (:meth:`decide_now` without the message); None: ask."""
        windows = self._ip_windows
        if windows is None or not self.running:
            return None
        # The kept counters looked up here, the rest in _ip_counters_in (a layer less on
        # every request).
        counters = self._ip_counters.get(ip)
        if counters is None or self._ip_counters_of is not self._ip_all_items:
            counters = self._ip_counters_in(windows, ip)
        return self._settle_ip(_ip_hits(counters, time.time()))

    def _settle_ip(self, decision: Decision) -> Decision:
        if not decision.allowed:
            self._count("ip")
        return decision

    # -- the memory path's state ---------------------------------------------------------
    def _stores_changed(self) -> None:
        """The windows in use changed (start, outage, recovery): what the memory path keeps
        of the previous ones is dropped (a permit granted on them sees the generation move)."""
        self._generation += 1
        self._keys.clear()
        self._ip_counters.clear()
        shared, requests = self._shared, self._requests
        if shared is None or requests is None:
            self._ip_windows = self._key_windows = None
            return
        shared_windows, requests_windows = shared.current(), requests.current()
        self._ip_windows = shared_windows if shared_windows.immediate else None
        both = shared_windows.immediate and requests_windows.immediate
        self._key_windows = (requests_windows, shared_windows) if both else None

    def _key_limits(self, key: VerifiedKey) -> _KeyLimits:
        """What a memory decision needs of ``key`` under its policy (kept per key id)."""
        assert self._key_windows is not None
        requests, shared = self._key_windows
        policy = key.policy
        key_id = str(key.api_key_id)
        item = self._item(policy.rate_limit_requests, policy.rate_limit_window_seconds)
        tpm = policy.tokens_per_minute
        limits = _KeyLimits(
            policy, key_id, self._generation, requests.counter(item, "req", key_id),
            shared.counter(self._item(tpm, 60), "tok", key_id) if tpm else None,
        )
        if len(self._keys) >= _MAX_KEPT:
            self._keys.clear()  # it only saves work: the counts are in the windows
        self._keys[key.api_key_id] = limits
        return limits

    def acquire_now(self, handle: LimiterHandle, key: VerifiedKey) -> Permit | None:
        """``key``'s Acquire decided at once when its windows are in memory: a Permit, or
        RateLimited raised. None: ask (:meth:`decide_now`, without the message).

        The same decision as ``decide_now(Acquire(...))`` (the same counters through
        :func:`_key_now`); an admitted request's slot is freed and its tokens charged by
        its Permit (:meth:`release_permit_now`), so it needs no permit id, no ``_held``
        entry, and its headers are written only if the answer is prepared.
        """
        if self._key_windows is None or not self.running:
            return None
        limits = self._keys.get(key.api_key_id)
        if limits is None or limits.policy is not key.policy:
            limits = self._key_limits(key)
        local_slot = None  # _reserve_local_slot: slots in memory, since the windows are
        max_concurrent = limits.policy.max_concurrent
        if max_concurrent is not None:
            count = self._inflight.get(limits.key_id, 0)
            if count >= max_concurrent:
                local_slot = False
            else:
                self._inflight[limits.key_id] = count + 1
                local_slot = True
        scope, reading = _key_now(limits.requests, limits.tokens, local_slot, time.time())
        if scope is None:
            return Permit(handle, None, local_slot is True, limits, reading)
        msg = handle._acquire_message(key)
        decision = self._settle_key(msg, _key_decision(msg, scope, reading, holds_slot=bool(local_slot)), local_slot)
        raise RateLimited(decision.message, retry_after=decision.retry_after, headers=dict(decision.headers))

    def release_permit_now(self, handle: LimiterHandle, limits: _KeyLimits, local_slot: bool, tokens: int) -> None:
        """The end of a request :meth:`acquire_now` admitted: free its slot, charge ``tokens``.

        As :meth:`release_now` does for a Release of it; where that would post the
        Release (the actor stopped, tokens to charge in a remote storage), this does too.
        """
        if limits.generation == self._generation and self.running:
            # The windows of the grant are still in use (this process's memory, so
            # ``_ip_windows`` too), and ``limits.tokens`` is there when the key has a tpm.
            if local_slot:
                self._free_local(limits.key_id)
            if tokens > 0 and limits.tokens is not None:
                limits.tokens.add(time.time(), tokens)
            return
        tpm = limits.policy.tokens_per_minute
        charge = tokens > 0 and bool(tpm)
        if not (local_slot or charge):
            return
        if self.running and (not charge or self._ip_windows is not None):
            if local_slot:
                self._free_local(limits.key_id)
            if charge:  # the windows changed since the grant: charge the ones in use now
                self._charge(Release("", limits.key_id, tpm, tokens))
            return
        msg = handle._release_message(limits.key_id, tpm, tokens if charge else 0)
        if local_slot:
            self._held[msg.permit_id] = _Held(limits.key_id, "local")  # for the actor to free
        handle._post(msg)

    # -- per key --------------------------------------------------------------------------
    def _item(self, amount: int, seconds: int) -> RateLimitItem:
        item = self._items.get((amount, seconds))
        if item is None:
            if len(self._items) > 10_000:
                self._items.clear()
            item = self._items[(amount, seconds)] = KeyedItem(amount, seconds)
        return item

    def _reserve_local_slot(self, msg: Acquire) -> bool | None:
        """Concurrency kept in memory: take a slot now (in the loop); None if not ours to keep."""
        if msg.max_concurrent is None or (self._redis is not None and self._redis_slots() is not None):
            return None
        count = self._inflight.get(msg.api_key_id, 0)
        if count >= msg.max_concurrent:
            return False
        self._inflight[msg.api_key_id] = count + 1
        return True

    def _redis_slots(self) -> RedisWindowStorage | None:
        assert self._shared is not None
        storage = self._shared.current().storage
        return storage if isinstance(storage, RedisWindowStorage) else None

    def _free_local(self, api_key_id: str) -> None:
        count = self._inflight.get(api_key_id, 0) - 1
        if count > 0:
            self._inflight[api_key_id] = count
        else:
            self._inflight.pop(api_key_id, None)

    # The same two homes as the per-IP guard's: _decide_key (remote storages, one batch)
    # and _decide_key_now (memory); _refused_scope and _key_decision say what either found.
    async def _decide_key(
        self, requests: Windows, shared: Windows, msg: Acquire, local_slot: bool | None
    ) -> _Outcome:
        """One request of a key: every read and hit in one batch where the storage batches.

        The window stats are read just before the hit (same pipeline), so remaining after
        an allowed hit is ``remaining - 1`` without a second round trip.
        """
        rpm = self._item(msg.requests, msg.window_seconds)
        rid = ("req", msg.api_key_id)
        tpm = self._item(msg.tokens_per_minute, 60) if msg.tokens_per_minute else None
        tid = ("tok", msg.api_key_id)
        full = local_slot is False  # concurrency already refused: hit nothing
        slots = shared.storage if msg.max_concurrent is not None and local_slot is None else None
        if not isinstance(slots, RedisWindowStorage):
            slots = None
        request_ops: list[Coroutine[Any, Any, Any]] = [requests.stats(rpm, *rid)]
        if not full:
            request_ops.append(requests.hit(rpm, *rid))
        shared_ops: list[Coroutine[Any, Any, Any]] = []
        if tpm is not None:
            shared_ops.append(shared.stats(tpm, *tid))
        if slots is not None and not full:
            shared_ops.append(slots.slot_acquire(f"conc/{msg.api_key_id}", msg.permit_id, msg.max_concurrent or 0, self._lease_ms))
        if requests is shared:
            results = await _together(requests, *request_ops, *shared_ops)
            request_results, shared_results = results[: len(request_ops)], results[len(request_ops):]
        else:
            request_results = await _together(requests, *request_ops)
            try:
                shared_results = await _together(shared, *shared_ops)
            except StorageDown:
                if len(request_results) > 1 and request_results[1]:
                    await _quietly(requests.add(rpm, *rid, amount=-1))
                raise
        rstats = request_results[0]
        hit_ok = bool(request_results[1]) if not full else False
        tstats = shared_results[0] if tpm is not None else None
        slot_ok = bool(shared_results[-1]) if slots is not None and not full else None

        now = time.time()
        scope = _refused_scope(full, hit_ok, slot_ok, tstats.remaining if tstats is not None else None)
        if scope is not None:
            # A rejected request consumes nothing: give back what was taken alongside.
            if hit_ok:
                await _quietly(requests.add(rpm, *rid, amount=-1))
            if slot_ok and slots is not None:
                await _quietly(slots.slot_release(f"conc/{msg.api_key_id}", msg.permit_id))
        reading = (
            now, rstats.reset_time, rstats.remaining,
            tstats.reset_time if tstats is not None else 0.0, tstats.remaining if tstats is not None else None,
        )
        decision = _key_decision(msg, scope, reading, holds_slot=bool(slot_ok or local_slot))
        return _Outcome(decision, redis_slot=bool(slot_ok) and scope is None)

    def _decide_key_now(self, requests: Windows, shared: Windows, msg: Acquire, local_slot: bool | None) -> Decision:
        """:meth:`_decide_key` on memory windows, at one reading of the clock.

        Concurrency is then the count in memory (``local_slot``), never a Redis lease.
        """
        key_id = msg.api_key_id
        counter = requests.counter(self._item(msg.requests, msg.window_seconds), "req", key_id)
        tokens = shared.counter(self._item(msg.tokens_per_minute, 60), "tok", key_id) if msg.tokens_per_minute else None
        scope, reading = _key_now(counter, tokens, local_slot, time.time())
        return _key_decision(msg, scope, reading, holds_slot=bool(local_slot))

    def _settle_key(
        self, msg: Acquire, decision: Decision, local_slot: bool | None, redis_slot: bool = False
    ) -> Decision:
        """Book a decision in the loop: hold its slot, or count its rejection."""
        pid = msg.permit_id
        if not decision.allowed:
            if local_slot:
                self._free_local(msg.api_key_id)
            self._count(decision.scope or "requests")
            self._abandoned.pop(pid, None)
            return decision
        if local_slot:
            self._held[pid] = _Held(msg.api_key_id, "local")
        elif redis_slot:
            self._held[pid] = _Held(msg.api_key_id, "redis")
        if self._abandoned.pop(pid, None) is not None:
            # The asker is gone (timeout, disconnect): nobody will release this grant.
            self._free_slot(pid)
        return decision

    # -- release and charge -----------------------------------------------------------
    async def _release(self, msg: Release) -> None:
        if msg.abandoned:
            if msg.permit_id in self._held:
                self._free_slot(msg.permit_id)
            else:
                self._abandoned[msg.permit_id] = time.monotonic()
            return
        self._free_slot(msg.permit_id)
        if msg.tokens > 0 and msg.tokens_per_minute:
            self._charge(msg)

    def _free_slot(self, permit_id: str) -> None:
        held = self._held.pop(permit_id, None)
        if held is None:
            return
        if held.where == "local":
            self._free_local(held.api_key_id)
            return
        assert self._redis is not None
        redis = self._redis
        name = f"conc/{held.api_key_id}"

        def done(_result: Any, error: BaseException | None) -> _Unreleased | None:
            # Redis away: the lease would free it in time; release it as soon as Redis is back.
            return _Unreleased(name, permit_id) if error is not None else None

        if self._shared is not None and self._shared.down:
            self._unreleased.append((name, permit_id))
            return
        self.spawn(redis.slot_release(name, permit_id), done)

    def _charge(self, msg: Release) -> None:
        """Add the call's real usage to the key's token window (it may go past the limit).

        Memory: at once. Remote: in a task, whose failure comes back as _Charged.
        """
        assert self._shared is not None and msg.tokens_per_minute
        windows = self._shared.current()
        item = self._item(msg.tokens_per_minute, 60)
        if windows.immediate:
            windows.add_now(item, "tok", msg.api_key_id, amount=msg.tokens, now=time.time())
            return
        op = windows.add(item, "tok", msg.api_key_id, amount=msg.tokens)
        self.spawn(_together(windows, op), lambda _r, error: _Charged(msg, error))

    # -- degraded state -----------------------------------------------------------------
    def _stores(self) -> list[_Store]:
        return [s for s in (self._shared, self._requests) if s is not None]

    def _degrade_named(self, down: StorageDown) -> None:
        for store in self._stores():
            if store.name == down.store:
                self._degrade(store, down.error)

    def _degrade(self, store: _Store | None, error: BaseException) -> None:
        if store is None or store.down or store.fallback is None:
            return
        store.down = True
        self._stores_changed()
        self._degraded[store.name] = (
            f"{store.name} unreachable ({type(error).__name__}); limits are enforced by each replica in its own memory"
        )
        log.warning("rate-limit storage %s failed (%r): using local memory until it answers", store.name, error)
        self.spawn(self._probe(store.primary), lambda _r, _e: _Recovered(store.name))

    async def _probe(self, windows: Windows) -> None:
        while True:
            await asyncio.sleep(self._probe_seconds)
            if not await windows.storage.check():
                continue
            if isinstance(windows.storage, RedisWindowStorage):
                try:
                    await windows.storage.load_scripts()
                except Exception:  # noqa: BLE001 - answered PING, not yet the scripts: try again
                    continue
            return

    def _recover(self, name: str) -> None:
        for store in self._stores():
            if store.name == name and store.down:
                store.down = False
                self._stores_changed()
                log.warning("rate-limit storage %s answers again: shared limits restored", name)
        self._degraded.pop(name, None)
        if name == "redis" and self._redis is not None and self._unreleased:
            pending, self._unreleased = self._unreleased, []
            for slot, member in pending:
                self.spawn(self._redis.slot_release(slot, member))

    def _count(self, scope: str) -> None:
        self._rejections[scope] += 1
        for listener in self.rejection_listeners:
            try:
                listener(scope)
            except Exception:  # a metrics hook must never break a decision
                log.exception("rejection listener failed")

    # -- housekeeping -------------------------------------------------------------------
    async def _tick_forever(self) -> None:
        # Lease renewal must run well within a lease: three chances before one expires.
        interval = max(0.05, self._lease_ms / 3000)
        while True:
            await asyncio.sleep(interval)
            self.post_internal("tick")

    def _tick(self) -> None:
        now = time.monotonic()
        for pid in [p for p, at in self._abandoned.items() if now - at > 60]:
            del self._abandoned[pid]
        redis = self._redis
        shared = self._shared
        if redis is not None and shared is not None and not shared.down:
            held = [(f"conc/{h.api_key_id}", pid) for pid, h in self._held.items() if h.where == "redis"]
            if held:
                self.spawn(_renew(redis, held, self._lease_ms), lambda counts, err: _Renewed(*(counts or (0, len(held)))))
        requests = self._requests
        if requests is not None and requests.name == "postgres" and now - self._last_prune > 300:
            self._last_prune = now
            storage = requests.primary.storage
            assert isinstance(storage, PostgresWindowStorage)
            self.spawn(storage.prune())

    # -- for tests and the benchmark ----------------------------------------------------
    @property
    def inflight(self) -> Mapping[str, int]:
        """Concurrency slots held in memory, by key id."""
        return MappingProxyType(self._inflight)

    @property
    def redis(self) -> RedisWindowStorage | None:
        return self._redis


async def _together(windows: Windows, *ops: Coroutine[Any, Any, Any]) -> list[Any]:
    """``windows.together``, with a storage failure tagged by the storage's name."""
    try:
        return await windows.together(*ops)
    except STORAGE_ERRORS as exc:
        if windows.immediate:
            raise
        raise StorageDown(windows.name, exc) from exc


async def _renew(redis: RedisWindowStorage, held: list[tuple[str, str]], lease_ms: int) -> tuple[int, int]:
    """Extend every lease this replica holds (one pipeline): ``(lost, failed)`` counts.

    A renewal that changed nothing found its lease gone (lost); one that raised failed and
    waits for the next tick. Both are reported, never swallowed.
    """
    results = await asyncio.gather(
        *(redis.slot_renew(name, pid, lease_ms) for name, pid in held), return_exceptions=True
    )
    failed = sum(1 for r in results if isinstance(r, BaseException))
    lost = sum(1 for r in results if not isinstance(r, BaseException) and not r)
    return lost, failed


async def _quietly(op: Coroutine[Any, Any, Any]) -> None:
    """A compensation (refund, release): its failure must not fail the answer."""
    try:
        await op
    except Exception as exc:  # noqa: BLE001 - the window or lease expires on its own
        log.debug("rate-limit compensation failed: %r", exc)


def _ip_refusal(rejected: list[WindowStats], now: float) -> Decision:
    """The per-IP cap refused: retry once the latest of the refusing windows resets."""
    return Decision(
        allowed=False, scope="ip", retry_after=max(stats.reset_time for stats in rejected) - now,
        message="too many requests from this address",
    )


def _ip_hits(counters: tuple[MemoryCounter, ...], now: float) -> Decision:
    """One request from an address on its memory windows (``per_ip_all``): hit each; when
    one refuses, the hits the others took are given back (a rejection consumes nothing)."""
    for at, counter in enumerate(counters):
        if not counter.hit(now):
            return _ip_hits_refused(counters, at, now)
    return _ALLOWED


def _ip_hits_refused(counters: tuple[MemoryCounter, ...], at: int, now: float) -> Decision:
    """:func:`_ip_hits` once the window at ``at`` refused: the windows after it are hit all
    the same (each window is asked, as the coroutines' path does), then the others' hits
    refunded."""
    oks = [True] * at + [False] + [counter.hit(now) for counter in counters[at + 1:]]
    rejected = [WindowStats(*counter.stats(now)) for counter, ok in zip(counters, oks, strict=True) if not ok]
    for counter, ok in zip(counters, oks, strict=True):
        if ok:
            counter.add(now, -1)
    return _ip_refusal(rejected, now)


def _key_now(
    requests: MemoryCounter, tokens: MemoryCounter | None, local_slot: bool | None, now: float
) -> tuple[str | None, _Reading]:
    """One request of a key on its memory windows (``requests``, and ``tokens`` if it has
    a token limit), its concurrency already settled (``local_slot``, see
    :meth:`LimiterActor._reserve_local_slot`): which limit refuses it (None: admitted) and
    what the windows said. The same operations in the same order as ``_decide_key``."""
    if local_slot is False:  # concurrency already refused: hit nothing
        requests_reset, requests_remaining = requests.stats(now)
        hit_ok = False
    else:
        requests_reset, requests_remaining, hit_ok = requests.stats_and_hit(now)
    if tokens is None:
        tokens_reset, tokens_remaining = 0.0, None
    else:
        tokens_reset, tokens_remaining, _ = tokens.stats_and_hit(now, None)  # its stats
    if hit_ok and (tokens_remaining is None or tokens_remaining >= 1):
        scope = None  # what _refused_scope says of a hit that went and tokens left
    else:
        scope = _refused_scope(local_slot is False, hit_ok, None, tokens_remaining)
    if scope is not None and hit_ok:
        requests.add(now, -1)  # a rejected request consumes nothing
    return scope, (now, requests_reset, requests_remaining, tokens_reset, tokens_remaining)


def _failures_spent(stats: list[WindowStats], now: float) -> Decision:
    """Refused while an address's allowance of failed attempts is spent (nothing counted)."""
    spent = [s for s in stats if s.remaining <= 0]
    if not spent:
        return _ALLOWED
    return Decision(
        allowed=False, scope="ip", retry_after=max(s.reset_time for s in spent) - now,
        message="too many failed or unauthenticated requests from this address",
    )


def _refused_scope(full: bool, hit_ok: bool, slot_ok: bool | None, tokens_remaining: int | None) -> str | None:
    """Which of a key's limits refuses its request (None: admitted).

    ``full``: no concurrency slot was free (nothing was hit); ``slot_ok``: the Redis
    lease, if one was asked for; ``tokens_remaining``: None when the key has no token limit.
    """
    if full or slot_ok is False:
        return "concurrency" if hit_ok or full else "requests"
    if not hit_ok:
        return "requests"
    if tokens_remaining is not None and tokens_remaining < 1:
        return "tokens"
    return None


#: What a key's windows said: (now, requests reset time, requests remaining, tokens reset
#: time, tokens remaining), the remaining counts read before this request's hit, and the
#: tokens None for a key without a token limit. Enough for the answer and its headers.
_Reading = tuple[float, float, int, float, "int | None"]


def _key_headers(
    requests: int, window_seconds: int, tokens_per_minute: int | None, allowed: bool, reading: _Reading
) -> dict[str, str]:
    """A key's ``x-ratelimit-*`` headers, from what its windows said (``reading``)."""
    now, requests_reset, requests_remaining, tokens_reset, tokens_remaining = reading
    reset_requests = requests_reset - now
    if allowed:
        requests_remaining -= 1
    # One dict display, not a dict grown key by key.
    if tokens_remaining is None:
        return {
            "x-ratelimit-limit-requests": str(requests),
            "x-ratelimit-remaining-requests": str(requests_remaining) if requests_remaining > 0 else "0",
            # An untouched window starts with this request and resets a whole window later.
            "x-ratelimit-reset-requests": reset_header(reset_requests if reset_requests > 0 else window_seconds),
        }
    return {
        "x-ratelimit-limit-requests": str(requests),
        "x-ratelimit-remaining-requests": str(requests_remaining) if requests_remaining > 0 else "0",
        "x-ratelimit-reset-requests": reset_header(reset_requests if reset_requests > 0 else window_seconds),
        "x-ratelimit-limit-tokens": str(tokens_per_minute),
        "x-ratelimit-remaining-tokens": str(tokens_remaining) if tokens_remaining > 0 else "0",
        "x-ratelimit-reset-tokens": reset_header(tokens_reset - now),
    }


#: The ``x-ratelimit-*`` names as multidict's case-insensitive keys, made once: a response's
#: headers take them without folding their case per answer.
_LIMIT_REQUESTS = istr("x-ratelimit-limit-requests")
_REMAINING_REQUESTS = istr("x-ratelimit-remaining-requests")
_RESET_REQUESTS = istr("x-ratelimit-reset-requests")
_LIMIT_TOKENS = istr("x-ratelimit-limit-tokens")
_REMAINING_TOKENS = istr("x-ratelimit-remaining-tokens")
_RESET_TOKENS = istr("x-ratelimit-reset-tokens")


def _key_decision(msg: Acquire, scope: str | None, reading: _Reading, *, holds_slot: bool) -> Decision:
    """A key's answer: its ``x-ratelimit-*`` headers and, when refused, why and when to retry."""
    headers = tuple(_key_headers(msg.requests, msg.window_seconds, msg.tokens_per_minute, scope is None, reading).items())
    now, requests_reset, _, tokens_reset, _ = reading
    if scope is None:
        return Decision(allowed=True, headers=headers, holds_slot=holds_slot)
    if scope == "requests":
        return Decision(
            False, scope, requests_reset - now,
            f"rate limit reached for requests: {msg.requests} per {msg.window_seconds}s", headers,
        )
    if scope == "tokens":
        return Decision(
            False, scope, tokens_reset - now,
            f"rate limit reached for tokens: {msg.tokens_per_minute} per minute", headers,
        )
    return Decision(
        False, scope, 1.0,
        f"too many concurrent requests: at most {msg.max_concurrent} at a time", headers,
    )


def _copy_outcome(source: asyncio.Future[Decision], target: asyncio.Future[Decision]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def describe_ip_guard(settings: RateLimitSettings) -> str:
    """The flood guard as configured (``rate_limits.per_ip`` as written, the spelling of
    README and the config file), then the windows :func:`_ip_items` derives from it."""
    if settings.per_ip == "off":
        return "per-IP off"
    rate = parse(settings.per_ip)
    burst = rate.amount if settings.per_ip_burst is None else settings.per_ip_burst
    if burst <= 0:
        return f"per-IP {settings.per_ip} (no burst)"
    period = rate.get_expiry()
    return (
        f"per-IP {settings.per_ip} with a burst of {burst} (at most {rate.amount + burst} in {period} s"
        f" and {rate.amount * 10} in {period * 10} s per address)"
    )


def _allow_one(items: tuple[RateLimitItem, ...]) -> bool:
    """Whether untouched windows of ``items`` allow a hit (config's ``per_ip`` >= 1 ensures it)."""
    return all(item.amount >= 1 for item in items)


def _ip_items(per_ip: str, per_ip_burst: int | None) -> tuple[RateLimitItem, ...]:
    """A per-address guard's windows: the rate, and a burst allowance above it.

    With a burst B over R per period P: at most R+B in any one period, and at most
    10*R per 10*P, so bursts are absorbed while the average stays at R.
    """
    if per_ip == "off":
        return ()
    rate = parse(per_ip)
    burst = rate.amount if per_ip_burst is None else per_ip_burst
    if burst <= 0:
        return (rate,)
    period = rate.get_expiry()
    return (
        KeyedItem(rate.amount + burst, period),
        KeyedItem(rate.amount * 10, period * 10),
    )


# -- handle ------------------------------------------------------------------------------
class Permit:
    """One admitted request's hold on its key's limits; :meth:`release` exactly once.

    Release frees the concurrency slot and charges the call's real token usage (from
    the tracked :class:`CallRecord`, read at release, so a stream's final usage counts).
    ``headers`` (``x-ratelimit-*``) are written when first read, from what the key's
    windows said at admission.
    """

    __slots__ = ("_handle", "_headers", "_limits", "_msg", "_reading", "_record", "_released", "_tokens", "holds_slot")

    def __init__(
        self, handle: LimiterHandle, msg: Acquire | None, holds_slot: bool,
        limits: _KeyLimits | None = None, reading: _Reading | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        """Granted through an Acquire (``msg``, with the answer's ``headers``), or at once on
        memory windows (:meth:`LimiterActor.acquire_now`: the key's ``limits`` and ``reading``)."""
        self._handle = handle
        self._msg = msg
        self._limits = limits
        self._reading = reading
        self._headers = headers
        self._record: CallRecord | None = None
        self._tokens = 0
        self._released = False
        self.holds_slot = holds_slot

    @property
    def headers(self) -> dict[str, str]:
        """The answer's ``x-ratelimit-*`` headers."""
        headers = self._headers
        if headers is None:
            limits, reading = self._limits, self._reading
            assert limits is not None and reading is not None
            policy = limits.policy
            headers = self._headers = _key_headers(
                policy.rate_limit_requests, policy.rate_limit_window_seconds, policy.tokens_per_minute, True, reading,
            )
        return headers

    def put_headers(self, out: CIMultiDict[str]) -> None:
        """Set :attr:`headers` on a response's headers (``out.update(self.headers)``).

        A permit of :meth:`LimiterActor.acquire_now` writes :func:`_key_headers`' values
        straight from its reading, in the same order, without the dict in between.
        """
        headers = self._headers
        if headers is not None:
            if headers:
                out.update(headers)
            return
        limits, reading = self._limits, self._reading
        assert limits is not None and reading is not None
        policy = limits.policy
        now, requests_reset, requests_remaining, tokens_reset, tokens_remaining = reading
        reset_requests = requests_reset - now
        requests_remaining -= 1
        out[_LIMIT_REQUESTS] = str(policy.rate_limit_requests)
        out[_REMAINING_REQUESTS] = str(requests_remaining) if requests_remaining > 0 else "0"
        out[_RESET_REQUESTS] = reset_header(
            reset_requests if reset_requests > 0 else policy.rate_limit_window_seconds
        )
        if tokens_remaining is not None:
            out[_LIMIT_TOKENS] = str(policy.tokens_per_minute)
            out[_REMAINING_TOKENS] = str(tokens_remaining) if tokens_remaining > 0 else "0"
            out[_RESET_TOKENS] = reset_header(tokens_reset - now)

    def track(self, record: CallRecord) -> None:
        """Charge ``record.usage`` at release (chat calls)."""
        self._record = record

    def charge(self, tokens: int) -> None:
        """Charge ``tokens`` at release (calls without a CallRecord, e.g. embeddings)."""
        self._tokens += max(0, tokens)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give back the slot and charge usage; later calls do nothing. Never waits."""
        if self._released:
            return
        self._released = True
        tokens = self._tokens + (self._record.usage.total_tokens if self._record is not None else 0)
        if self._limits is not None:
            self._handle._actor.release_permit_now(self._handle, self._limits, self.holds_slot, tokens)
            return
        msg = self._msg
        assert msg is not None
        charge = tokens > 0 and msg.tokens_per_minute is not None
        if self.holds_slot or charge:
            self._handle._post(Release(msg.permit_id, msg.api_key_id, msg.tokens_per_minute, tokens if charge else 0))


class LimiterHandle:
    """What the edge calls; raises :class:`RateLimited` (429) with ``Retry-After``."""

    __slots__ = ("_actor", "_ids", "_ref", "_replica")

    def __init__(self, actor: LimiterActor, ref: ActorRef[Any]) -> None:
        self._actor = actor
        self._ref = ref
        # Permit ids name Redis leases shared by every replica: unique per process.
        self._replica = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)

    def apply_ip_guard(self, settings: RateLimitSettings) -> None:
        """A config reload's per-address guards, effective for the next request.

        Immutable values replaced in one step on the event loop, read by the actor and by
        memory decisions alike; the windows already counted are kept.
        """
        self._actor._ip_items = _ip_items(settings.per_ip, settings.per_ip_burst)
        self._actor._ip_all_items = _ip_items(settings.per_ip_all, None)
        self._actor.guards_ip = bool(self._actor._ip_items or self._actor._ip_all_items)
        if not _allow_one(self._actor._ip_items):
            self._actor._failed_ips = None

    def failures_counted(self, ip: str) -> bool:
        """Whether ``ip``'s allowance of failed attempts could be spent (``check_ip(ip,
        "peek")`` could refuse): False when this process knows it is untouched (see
        ``LimiterActor._failed_ips``), and the guard need not ask whether the request
        would cost a key lookup."""
        failed = self._actor._failed_ips
        return failed is None or ip in failed

    def passed_ip_now(self, ip: str) -> bool:
        """``check_ip(ip)`` (kind ``any``) where it is answered at once (the guard off, or its
        windows in memory): True once passed, RateLimited when refused; False: await
        :meth:`check_ip`. The guard's every request, without a coroutine in between."""
        actor = self._actor
        if not actor.guards_ip:
            return True
        decision = actor.check_ip_now(ip)
        if decision is None:
            return False
        if not decision.allowed:
            raise RateLimited(decision.message, retry_after=decision.retry_after)
        return True

    async def check_ip(self, ip: str, kind: str = "any") -> None:
        """The per-address guard (see :class:`CheckIp` for ``kind``); RateLimited when refused."""
        actor = self._actor
        if not actor.guards_ip:
            return
        decision = actor.check_ip_now(ip) if kind == "any" else None
        if decision is None:
            msg = CheckIp(ip, kind)
            decision = actor.decide_now(msg)
            if decision is None:
                decision = await self._ref.ask(msg)
        if not decision.allowed:
            raise RateLimited(decision.message, retry_after=decision.retry_after)

    async def acquire(self, key: VerifiedKey) -> Permit:
        """Admit one request of ``key``; the Permit must be released when it ends."""
        permit = self._actor.acquire_now(self, key)  # memory windows: decided here, at once
        if permit is not None:
            return permit
        msg = self._acquire_message(key)
        now = self._actor.decide_now(msg)
        if now is not None:
            decision = now
        else:
            try:
                decision = await self._ref.ask(msg)
            except BaseException:
                # The ask gave up but the message may still be granted: have the grant undone.
                self._post(Release(msg.permit_id, msg.api_key_id, None, 0, abandoned=True))
                raise
        if not decision.allowed:
            raise RateLimited(decision.message, retry_after=decision.retry_after, headers=dict(decision.headers))
        return Permit(self, msg, decision.holds_slot, headers=dict(decision.headers))

    def _acquire_message(self, key: VerifiedKey) -> Acquire:
        policy = key.policy
        return Acquire(
            permit_id=self._permit_id(),
            api_key_id=str(key.api_key_id),
            requests=policy.rate_limit_requests,
            window_seconds=policy.rate_limit_window_seconds,
            tokens_per_minute=policy.tokens_per_minute,
            max_concurrent=policy.max_concurrent,
        )

    def _release_message(self, api_key_id: str, tokens_per_minute: int | None, tokens: int) -> Release:
        return Release(self._permit_id(), api_key_id, tokens_per_minute, tokens)

    def _permit_id(self) -> str:
        return f"{self._replica}:{next(self._ids)}"

    def _post(self, msg: Release) -> None:
        # Releases take the internal lane: unbounded and served first, because a shed
        # release would leak a concurrency slot for good. Memory-only ones apply at once.
        if not self._actor.release_now(msg):
            self._actor.post_internal(msg)

    @property
    def degraded(self) -> Mapping[str, str]:
        """Storages replaced by memory right now, with why; empty when all is well."""
        return self._actor.degraded

    @property
    def rejections(self) -> Mapping[str, int]:
        """Rejections so far by scope: ip, requests, tokens, concurrency."""
        return self._actor.rejections

    @property
    def lease_counts(self) -> tuple[int, int]:
        """(leases lost, renewals failed) so far (``gateway_background_failures_total``)."""
        return self._actor.leases_lost, self._actor.lease_renew_failures

    @property
    def lease_trouble(self) -> str | None:
        """What went wrong in the last lease renewal round, if anything (``/readyz``)."""
        return self._actor.lease_trouble

    @property
    def rejection_listeners(self) -> list[Callable[[str], None]]:
        """Add ``f(scope)`` to be called on every rejection (e.g. a Prometheus counter)."""
        return self._actor.rejection_listeners

    @property
    def description(self) -> str:
        return self._actor.description

    @property
    def ref(self) -> ActorRef[Any]:
        return self._ref
