"""Where rate-limit windows live: ``limits`` storages the LimiterActor drives.

The strategies stay the ``limits`` library's (sliding-window counter, fixed window);
this module gives them three storages and one small wrapper:

* :class:`LocalStorage`: the library's memory storage (one process, microseconds).
* :class:`RedisWindowStorage`: Redis shared by every replica. Every command issued in
  one event-loop turn, by any number of concurrent requests, goes out as ONE pipeline
  (one round trip) instead of the 2-6 round trips per request of the library's own
  Redis storage. It runs the library's own Lua scripts under the library's key layout,
  plus two small scripts of ours for concurrency leases (``limits`` has no such thing).
* :class:`PostgresWindowStorage`: per-key fixed windows in the seed's
  ``api_key_rate_limit_windows`` table, one guarded upsert per hit, so a rejected hit
  writes nothing.
* :class:`Windows`: a strategy over a storage, with the operations the limiter needs:
  ``hit`` (never consuming on rejection), ``stats``, and ``add`` (an unconditional
  charge or refund, for token usage known only after the call); on memory also as
  plain calls (``hit_now``, ``stats_now``, ``stats_and_hit_now``, ``add_now``), made on
  a :class:`MemoryCounter` (``Windows.counter``): one key's window with its keys built
  once, which the limiter's memory path keeps per API key and per address.

Library internals: :class:`LocalStorage` overrides two name-mangled private methods of
``limits``' ``MemoryStorage`` and :func:`_without_error_wrappers` unwraps its per-class
error wrappers. Neither is public API, so ``limits`` is pinned to the tested major
(``limits>=5.0,<6`` in setup.cfg), and ``tests/test_limiter.py`` fails when an upgrade
inside that range renames what these rely on (the override would then be silently dead:
a sweep per event-loop turn, under the key's lock).

Why one module of ~850 lines: the three storages (memory, Redis, PostgreSQL) implement one
interface and share the window arithmetic; side by side they are easy to keep in step.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import inspect
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import datetime, timezone
from typing import Any

import asyncpg
from limits import RateLimitItem, RateLimitItemPerSecond
from limits.aio.storage import MemoryStorage, SlidingWindowCounterSupport, Storage
from limits.aio.storage.redis.bridge import RedisBridge
from limits.aio.strategies import FixedWindowRateLimiter, RateLimiter, SlidingWindowCounterRateLimiter
from limits.util import WindowStats
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from gateway.core.redis import redis_client

__all__ = [
    "STORAGE_ERRORS",
    "KeyedItem",
    "LocalStorage",
    "PostgresWindowStorage",
    "RedisWindowStorage",
    "Windows",
]

#: A limit so large that a sliding-window "acquire" always succeeds: how ``add`` charges.
UNBOUNDED = 2**50

#: What a storage raises when it is unreachable (the limiter then falls back to memory).
STORAGE_ERRORS: tuple[type[BaseException], ...] = (
    RedisError, OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
)


class KeyedItem(RateLimitItemPerSecond):
    """A per-second limit that remembers the storage key of each identifier tuple.

    ``key_for`` is a pure function of the ids, but builds the key by escaping every
    part: on a memory decision, where a request uses five keys, that was ~15 % of the
    limiter's CPU. The memo is bounded (cleared when full: it only saves work).
    """

    __slots__ = ("_keys",)
    MAX_KEYS = 4096

    def __init__(self, amount: int, multiples: int | None = 1, namespace: str = "LIMITER") -> None:
        super().__init__(amount, multiples, namespace)
        self._keys: dict[tuple[Any, ...], str] = {}

    def key_for(self, *identifiers: bytes | str | int | float) -> str:
        key = self._keys.get(identifiers)
        if key is None:
            if len(self._keys) >= self.MAX_KEYS:
                self._keys.clear()
            key = self._keys[identifiers] = super().key_for(*identifiers)
        return key


#: Methods ``limits`` wraps (in ``__init_subclass__``) to translate storage errors.
_WRAPPED = (
    "incr", "get", "get_expiry", "check", "reset", "clear",
    "acquire_entry", "get_moving_window",
    "acquire_sliding_window_entry", "get_sliding_window", "clear_sliding_window",
)


def _without_error_wrappers(cls: type[Storage]) -> type[Storage]:
    """Undo ``limits``' per-class error wrappers on ``cls``.

    The library wraps these methods again for every subclass in a hierarchy (twice for
    the sliding-window ones), so a memory hit ran through ~10 wrapper frames, most of its
    cost. With ``wrap_exceptions`` off, as here, a wrapper only re-raises: removing it
    changes nothing but the cost.
    """
    for name in _WRAPPED:
        method = getattr(cls, name, None)
        if method is not None:
            setattr(cls, name, inspect.unwrap(method))
    return cls


@_without_error_wrappers
class LocalStorage(MemoryStorage):
    """The library's memory storage; windows of this process only.

    ``limits`` sweeps expired keys in a task it starts after any hit once the previous
    sweep ended, and each sweep walks every key: under load that is one full walk per
    event-loop turn. This subclass sweeps at most once per ``SWEEP_SECONDS``; reads
    already ignore expired entries, so only memory use depends on the sweep.

    The limiter decides memory windows with :class:`MemoryCounter` (below). The
    library's own coroutines (tests, ``clear``, ``reset``) never suspend mid-operation
    either, so no decision sees half of one: uncontended locks never wait, and
    this sweep holds no lock across an ``await``, unlike the library's, which bisects
    moving-window event lists in a thread while holding the key's lock.
    """

    SWEEP_SECONDS = 1.0

    def __init__(self) -> None:
        super().__init__("memory://")
        self._next_sweep = 0.0

    # The library calls its private ``__schedule_expiry`` (name-mangled to this) on hits.
    async def _MemoryStorage__schedule_expiry(self) -> None:
        self._sweep_soon()

    def _sweep_soon(self) -> None:
        """Start a sweep task unless one ran within ``SWEEP_SECONDS`` (or still runs)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.SWEEP_SECONDS
        if not self.timer or self.timer.done():
            self.timer = asyncio.create_task(self._MemoryStorage__expire_events())

    # The limiter's memory decisions do not go through the library's coroutines: see
    # :class:`MemoryCounter` below, which does the same arithmetic on these same dicts.

    # Replaces the library's sweep (same effect, no thread hop, no lock held while waiting).
    async def _MemoryStorage__expire_events(self) -> None:
        now = time.time()
        for key, events in list(self.events.items()):
            # Events are kept newest first; drop those whose expiry has passed.
            cutoff = bisect.bisect_left(events, -now, key=lambda event: -event.expiry)
            if events[:cutoff]:
                self.events[key] = events[:cutoff]
            else:
                self.events.pop(key, None)
                self.locks.pop(key, None)
        for key, expiry in list(self.expirations.items()):
            if expiry <= now:
                self.storage.pop(key, None)
                self.expirations.pop(key, None)
                self.locks.pop(key, None)


# --------------------------------------------------------------------------- memory counters
# The library's memory operations await four to six coroutines per hit (the strategy, the
# storage's acquire, its window read, two gets, incr, the sweep scheduling, the key's
# lock) to do a few dict operations: most of a memory decision's cost. A MemoryCounter
# does the same arithmetic on the same dicts and keys, so the library's own methods
# (tests, ``clear``, ``reset``) still see every count; it never suspends, so no lock is
# needed (asyncio runs one callback at a time). It is one window of one identifier tuple
# (one ``limits`` key), with what every operation on it needs worked out once: the key
# (and, for a sliding window, its two counters' keys, rebuilt when the window moves on),
# the limit and the period. ``tests/test_limiter.py`` checks every operation against the
# library's own strategy over its own MemoryStorage, at frozen times across window edges.
class MemoryCounter:
    """One window of one key in a :class:`LocalStorage` (the base of the two strategies).

    Every operation takes ``now`` (``time.time()``, read once per decision by the caller)
    and answers with plain numbers: ``stats`` → ``(reset_time, remaining)``,
    ``stats_and_hit`` → ``(reset_time, remaining, hit)`` (the stats as read just before
    the hit, reading the counters once; with ``cost`` None the stats alone, hit False),
    ``hit`` → whether ``cost`` was taken (a rejected hit consumes nothing), ``add`` an
    unconditional charge or refund.
    """

    __slots__ = ("amount", "expiry", "key", "local")

    def __init__(self, local: LocalStorage, key: str, amount: int, expiry: int) -> None:
        self.local = local
        self.key = key
        self.amount = amount
        self.expiry = expiry

    def stats(self, now: float) -> tuple[float, int]:
        reset, remaining, _ = self.stats_and_hit(now, None)
        return reset, remaining

    def stats_and_hit(self, now: float, cost: int | None = 1) -> tuple[float, int, bool]:
        raise NotImplementedError

    def hit(self, now: float, cost: int = 1) -> bool:
        raise NotImplementedError

    def add(self, now: float, amount: int) -> None:
        raise NotImplementedError

    def _get(self, key: str, now: float) -> int:
        """``MemoryStorage.get``: the counter, dropped once expired.

        A key never counted is in none of the storage's dicts: every writer (the
        library's ``incr``, these counters) sets a new counter's expiry with it, and every
        remover (``get``, ``clear``, ``reset``, the sweep) drops the three together. So
        when it has no expiry there is nothing to drop.
        """
        local = self.local
        expires = local.expirations.get(key)
        if expires is None:
            return 0
        if expires > now:
            return local.storage.get(key, 0)
        # Expired: forgotten, as the library's ``get`` does, which then reads 0.
        local.storage.pop(key, None)
        local.expirations.pop(key, None)
        local.locks.pop(key, None)
        return 0

    def _incr(self, key: str, expiry: float, amount: int, now: float, current: int) -> int:
        """``MemoryStorage.incr`` of a counter :meth:`_get` read as ``current`` at this ``now``:
        add ``amount``; a new counter expires ``expiry`` from now."""
        local = self.local
        count = current + amount
        if time.monotonic() >= local._next_sweep:
            local._sweep_soon()
        local.storage[key] = count
        if count == amount:
            local.expirations[key] = now + expiry
        return count


class FixedCounter(MemoryCounter):
    """``FixedWindowRateLimiter`` on memory: one counter that expires a period after it starts."""

    __slots__ = ()

    def stats_and_hit(self, now: float, cost: int | None = 1) -> tuple[float, int, bool]:
        key, amount = self.key, self.amount
        count = self._get(key, now)
        reset = self.local.expirations.get(key, now)  # before the hit sets a new window's expiry
        if cost is None:
            return reset, max(0, amount - count), False
        return reset, max(0, amount - count), self._hit(key, amount, cost, now, count)

    def hit(self, now: float, cost: int = 1) -> bool:
        return self._hit(self.key, self.amount, cost, now, self._get(self.key, now))

    def _hit(self, key: str, amount: int, cost: int, now: float, count: int) -> bool:
        if self._incr(key, self.expiry, cost, now, count) <= amount:
            return True
        # Counted on rejection, as the library does: give it back.
        self._incr(key, self.expiry, -cost, now, self._get(key, now))
        return False

    def add(self, now: float, amount: int) -> None:
        self._incr(self.key, self.expiry, amount, now, self._get(self.key, now))


class SlidingCounter(MemoryCounter):
    """``SlidingWindowCounterRateLimiter`` on memory: the current period's counter
    (``{key}/{now // period}``) plus the previous one's, weighted by how much of it
    still overlaps the sliding window; a counter lives two periods.

    One reading of the window (:meth:`_read`) serves both the stats-and-hit of a key's
    window and the per-IP hit, in the library's order; a take adds to the current counter
    (:meth:`_incr`), which, new, lives two periods (it is the next period's previous).

    Within the two periods its keys are of, a counter's reads need not check expiry:
    each counter lives two periods from a write made in its own period (the key says
    which), so neither can expire before the current period ends. ``_steady_from`` ..
    ``_steady_until`` is a span of times a reading found in these periods (checked
    with the library's divisions; both indexes only grow with time, so every time
    between two such times is in them too), ending a millisecond before the period does.

    A write schedules the storage's sweep (as the library's ``incr`` does) except in the
    steady span: there it adds to a counter of the span's periods, and the reading that
    began the span (:meth:`_read`, for a new counter or a new period: where keys of
    other periods start to expire) scheduled it. The sweep only frees memory (reads
    ignore expired counters), so no answer depends on it; the check was 8 of a write's
    instructions, four writes a request (bench.opcodes S1: 32 per request).
    """

    __slots__ = (
        "_current_key", "_previous", "_previous_key", "_steady_from", "_steady_until",
        "_weight", "_weight_at", "_weight_previous_count", "_window",
    )

    def __init__(self, local: LocalStorage, key: str, amount: int, expiry: int) -> None:
        super().__init__(local, key, amount, expiry)
        self._window = self._previous = -1
        self._current_key = self._previous_key = ""
        self._steady_from, self._steady_until = math.inf, -math.inf
        self._weight_at, self._weight, self._weight_previous_count = math.inf, 0.0, 0

    def _keys(self, window: int, previous: int) -> None:
        """The two counters' keys for these period indexes (``sliding_window_keys``)."""
        self._window, self._previous = window, previous
        self._current_key, self._previous_key = f"{self.key}/{window}", f"{self.key}/{previous}"
        # What was known of the periods before (their span, hit's reading) is not of these.
        self._steady_from, self._steady_until = math.inf, -math.inf
        self._weight_at = math.inf

    def _steady(self, now: float) -> None:
        """``now`` was read in the periods of the keys: widen the steady span to it."""
        window, expiry = self._window, self.expiry
        until = (window + 1) * expiry - 0.001  # the last millisecond is read whole
        if (
            self._previous == window - 1 and now <= until
            and int(until / expiry) == window and int((until - expiry) / expiry) == window - 1
        ):
            self._steady_from, self._steady_until = min(now, self._steady_from), until

    def stats_and_hit(self, now: float, cost: int | None = 1) -> tuple[float, int, bool]:
        """``get_window_stats``, then (unless ``cost`` is None) ``acquire_sliding_window_entry``,
        on one reading of the two counters.

        Each of the library's terms is worked out only where its value is used (a counter
        at 0 adds none), and a hit's write is :meth:`_incr` written out: a key's two
        windows are read on every request (bench.opcodes S1, with _incr, 226 -> 194).
        """
        expiry = self.expiry
        local = self.local
        if self._steady_from <= now <= self._steady_until:
            # _read's steady case, here.
            storage = local.storage
            previous_count, current_count = storage.get(self._previous_key, 0), storage.get(self._current_key, 0)
        else:
            _, _, previous_count, current_count = self._read(now)
        if previous_count:
            previous_ttl = (1 - (((now - expiry) / expiry) % 1)) * expiry
            used = math.floor(previous_count * previous_ttl / expiry + current_count)
            previous_reset_in = previous_ttl % (expiry / previous_count)
            if current_count:
                current_ttl = (1 - ((now / expiry) % 1)) * expiry + expiry
                reset = now + min(previous_reset_in, current_ttl % expiry)
            else:
                reset = now + previous_reset_in
        elif current_count:
            used = current_count
            reset = now + ((1 - ((now / expiry) % 1)) * expiry + expiry) % expiry
        else:
            used = 0
            reset = now
        amount = self.amount
        remaining = amount - used if used < amount else 0
        if cost is None or cost > amount or used + cost > amount:
            return reset, remaining, False
        # _incr, written out (the sweep is the reading's, see the class).
        key = self._current_key
        count = current_count + cost
        local.storage[key] = count
        if count == cost:
            local.expirations[key] = now + 2 * expiry
        return reset, remaining, True

    def hit(self, now: float, cost: int = 1) -> bool:
        """:meth:`stats_and_hit` without the stats (the per-IP windows' question).

        Mostly answered from the last reading's weight of the previous counter
        (``_weight*``), without the window's arithmetic. In the steady span, that weight
        (``previous_count * previous_ttl / expiry``: each step of the float arithmetic
        monotonic in ``now``, for a count >= 0) only shrinks as time passes, so while the
        previous counter still holds what the reading found, the count used now is at most
        ``floor(weight read + current count)``; when that plus ``cost`` fits, the whole
        reading would grant too: granted, with the same write. Otherwise (out of the
        span, a time before the reading's, another previous count, no room) the whole
        reading decides. The current counter is read each time, so every writer's hits,
        refunds and clears count. Measured (``bench.opcodes``, S1): the per-IP guard's
        two hits, 352 -> 158 instructions per request.
        """
        amount = self.amount
        if cost > amount:
            return False  # refused before the window is read, as the library does
        local = self.local
        storage = local.storage
        if (
            self._weight_at <= now <= self._steady_until
            and storage.get(self._previous_key, 0) == self._weight_previous_count
        ):
            key = self._current_key
            current_count = storage.get(key, 0)
            if self._weight + current_count < amount - cost + 1:
                # _incr, written out (of a live counter, no sweep: see the class): most
                # requests' path.
                count = current_count + cost
                storage[key] = count
                if count == cost:
                    local.expirations[key] = now + 2 * self.expiry
                return True
        expiry = self.expiry
        _, previous_position, previous_count, current_count = self._read(now)
        if previous_count:
            previous_ttl = (1 - (previous_position % 1)) * expiry
            weight = previous_count * previous_ttl / expiry
            used = math.floor(weight + current_count)
        else:
            weight = 0.0
            used = current_count
        # A negative count's weight would grow with time: never answered from.
        self._weight_at, self._weight = (now, weight) if previous_count >= 0 else (math.inf, 0.0)
        self._weight_previous_count = previous_count
        if used + cost > amount:
            return False
        self._incr(self._current_key, 2 * self.expiry, cost, now, current_count)
        return True

    def _read(self, now: float) -> tuple[float, float, int, int]:
        """The window's positions at ``now`` and its two counters (``get_sliding_window``)."""
        expiry = self.expiry
        position = now / expiry
        previous_position = (now - expiry) / expiry
        local = self.local
        if self._steady_from <= now <= self._steady_until:
            # Both counters live (see the class): their counts, or 0 for one never written.
            storage = local.storage
            return position, previous_position, storage.get(self._previous_key, 0), storage.get(self._current_key, 0)
        # Each index from its own division, as the library computes them.
        if int(position) != self._window or int(previous_position) != self._previous:
            self._keys(int(position), int(previous_position))
        local._sweep_soon()  # (see the class)
        # Both counters as _get reads them, inline: a live one from the storage, an
        # expired one forgotten, a missing one 0.
        expirations = local.expirations
        previous_key, current_key = self._previous_key, self._current_key
        expires = expirations.get(previous_key)
        if expires is None:
            previous_count = 0
        elif expires > now:
            previous_count = local.storage.get(previous_key, 0)
        else:
            previous_count = self._get(previous_key, now)
        expires = expirations.get(current_key)
        if expires is None:
            current_count = 0
        elif expires > now:
            current_count = local.storage.get(current_key, 0)
        else:
            current_count = self._get(current_key, now)
        self._steady(now)
        return position, previous_position, previous_count, current_count

    def add(self, now: float, amount: int) -> None:
        # An acquire with no bound always takes: it only adds to the current counter
        # (a new one lives two windows), which is all this does.
        # (a token charge, at the end of every request with a token limit: _incr written
        # out in the steady span, bench.opcodes S1 add + _incr 68 -> 51).
        expiry = self.expiry
        key = self._current_key
        local = self.local
        if self._steady_from <= now <= self._steady_until:
            storage = local.storage
            count = storage.get(key, 0) + amount  # live, no sweep (see the class)
            storage[key] = count
            if count == amount:
                local.expirations[key] = now + 2 * expiry
            return
        window = int(now / expiry)
        if window != self._window:
            self._keys(window, int((now - expiry) / expiry))
            key = self._current_key
        self._incr(key, 2 * expiry, amount, now, self._get(key, now))

# --------------------------------------------------------------------------- Redis
# Concurrency leases: one sorted set per key, member = permit id, score = lease end (ms,
# Redis clock, so replicas' clocks need not agree). A replica that dies mid-request
# leaks nothing for longer than one lease.
_SLOT_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""
_SLOT_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return changed
"""

def _script_bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


#: The library's own scripts (its key layout and arithmetic) plus our two lease scripts.
_SCRIPTS: dict[str, bytes] = {
    "incr": _script_bytes(RedisBridge.SCRIPT_INCR_EXPIRE),
    "sliding": _script_bytes(RedisBridge.SCRIPT_SLIDING_WINDOW),
    "acquire_sliding": _script_bytes(RedisBridge.SCRIPT_ACQUIRE_SLIDING_WINDOW),
    "slot_acquire": _script_bytes(_SLOT_ACQUIRE),
    "slot_renew": _script_bytes(_SLOT_RENEW),
}
_SHAS: dict[str, str] = {name: hashlib.sha1(text).hexdigest() for name, text in _SCRIPTS.items()}

_Queued = tuple[tuple[Any, ...], Callable[[Any], Any], "asyncio.Future[Any]"]


def _sliding_tuple(reply: Any) -> tuple[int, float, int, float]:
    # Same conversion as limits' redis-py bridge: counts, and TTLs from ms to seconds.
    if not reply:
        return 0, 0.0, 0, 0.0
    return (
        int(reply[0] or 0),
        max(0.0, float(reply[1] or 0)) / 1000,
        int(reply[2] or 0),
        max(0.0, float(reply[3] or 0)) / 1000,
    )


@_without_error_wrappers
class RedisWindowStorage(Storage, SlidingWindowCounterSupport):
    """Redis windows shared by every replica, one pipeline per event-loop turn.

    Each method queues its command and returns when the turn's pipeline has answered.
    Keys are ``{key_prefix}:{limits key}`` (sliding windows: ``{key}`` and ``{key}/-1``,
    as the library lays them out). Scripts are sent by hash; after a Redis restart
    (``NOSCRIPT``) they are loaded again and only the affected commands re-sent.
    The client never retries by itself: an unreachable Redis must fail fast so the
    limiter falls back to memory at once.
    """

    def __init__(self, url: str, *, key_prefix: str, timeout: float = 1.0) -> None:
        url = url.removeprefix("async+")
        super().__init__(url)
        self._client = redis_client(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
        self._timeout = timeout
        self._prefix = key_prefix
        self._queue: list[_Queued] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        #: Pipelines and commands sent so far (the benchmark and tests read them).
        self.pipelines = 0
        self.commands = 0

    @property
    def base_exceptions(self) -> tuple[type[Exception], ...]:
        return (RedisError, OSError)

    # -- the batching --------------------------------------------------------------
    def _send(self, convert: Callable[[Any], Any], *command: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.append((command, convert, fut))
        if not self._flush_scheduled:
            # Runs after every callback already due this turn: all of them queue first.
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _eval(self, convert: Callable[[Any], Any], script: str, keys: tuple[str, ...], *args: Any) -> asyncio.Future[Any]:
        return self._send(convert, "EVALSHA", _SHAS[script], len(keys), *keys, *args)

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        self._flush_scheduled = False
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[_Queued]) -> None:
        try:
            replies = await self._execute([command for command, _, _ in batch])
        except asyncio.CancelledError:
            for _, _, fut in batch:
                fut.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the failure
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, convert, fut), reply in zip(batch, replies, strict=True):
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
                continue
            try:
                fut.set_result(convert(reply))
            except Exception as exc:  # noqa: BLE001 - a reply of an unexpected shape fails its own caller only
                fut.set_exception(exc)

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        replies = await self._pipeline(commands)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            await self.load_scripts()
            again = await self._pipeline([commands[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        self.pipelines += 1
        self.commands += len(commands)
        return list(await pipe.execute(raise_on_error=False))

    async def load_scripts(self) -> None:
        """Load every script (at start and after Redis lost them)."""
        pipe = self._client.pipeline(transaction=False)
        for text in _SCRIPTS.values():
            pipe.script_load(text)
        await pipe.execute()

    def _key(self, key: str) -> str:
        return f"{self._prefix}:{key}"

    def _sliding_keys(self, key: str) -> tuple[str, str]:
        current = self._key(f"{{{key}}}")
        return f"{current}/-1", current

    # -- limits' Storage API -----------------------------------------------------------
    async def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        return int(await self._eval(int, "incr", (self._key(key),), int(expiry), amount))

    async def get(self, key: str) -> int:
        return int(await self._send(lambda v: int(v or 0), "GET", self._key(key)))

    async def get_expiry(self, key: str) -> float:
        return float(await self._send(lambda ttl: max(int(ttl), 0) + time.time(), "TTL", self._key(key)))

    async def acquire_sliding_window_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        return bool(await self._eval(bool, "acquire_sliding", self._sliding_keys(key), limit, int(expiry), amount))

    async def get_sliding_window(self, key: str, expiry: int) -> tuple[int, float, int, float]:
        result: tuple[int, float, int, float] = await self._eval(
            _sliding_tuple, "sliding", self._sliding_keys(key), int(expiry)
        )
        return result

    async def clear_sliding_window(self, key: str, expiry: int) -> None:
        await self._send(int, "DEL", *self._sliding_keys(key))

    async def clear(self, key: str) -> None:
        await self._send(int, "DEL", self._key(key))

    async def check(self) -> bool:
        """One PING on a fresh connection, not batched: True when Redis answers in time.

        Pooled connections are dropped first: after an outage they may be dead without
        knowing it, and the next pipeline must not be the one to find out.
        """
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.connection_pool.disconnect()
                return bool(await self._client.ping())
        except Exception:  # noqa: BLE001 - any failure means "not healthy"
            return False

    async def reset(self) -> int | None:
        """Delete every key under this storage's prefix (tests and the benchmark)."""
        count = 0
        async for key in self._client.scan_iter(match=f"{self._prefix}:*", count=1000):
            count += int(await self._client.delete(key))
        return count

    # -- concurrency leases (ours: limits has no concurrency limit) ---------------------
    async def slot_acquire(self, name: str, member: str, limit: int, lease_ms: int) -> bool:
        """Take one of ``limit`` slots of ``name`` for ``lease_ms``; False when all are taken."""
        return bool(await self._eval(bool, "slot_acquire", (self._key(name),), member, limit, lease_ms))

    async def slot_renew(self, name: str, member: str, lease_ms: int) -> bool:
        """Extend a held slot's lease (long streams outlive one lease)."""
        return bool(await self._eval(bool, "slot_renew", (self._key(name),), member, lease_ms))

    async def slot_release(self, name: str, member: str) -> None:
        await self._send(int, "ZREM", self._key(name), member)

    async def slots_held(self, name: str) -> int:
        """How many slots of ``name`` are held now (tests)."""
        return int(await self._send(int, "ZCARD", self._key(name)))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._client.aclose()


# --------------------------------------------------------------------------- PostgreSQL
_GRANULARITY_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}

_UPSERT = """
INSERT INTO api_key_rate_limit_windows AS w (api_key_id, window_start_at, window_seconds, request_count)
VALUES ($1, $2, $3, $4)
ON CONFLICT (api_key_id, window_start_at, window_seconds) DO UPDATE
SET request_count = w.request_count + EXCLUDED.request_count, updated_at = now()
WHERE w.request_count + EXCLUDED.request_count <= $5
RETURNING request_count
"""
_REFUND = """
UPDATE api_key_rate_limit_windows
SET request_count = GREATEST(request_count + $4, 0), updated_at = now()
WHERE api_key_id = $1 AND window_start_at = $2 AND window_seconds = $3
RETURNING request_count
"""
_READ = """
SELECT request_count FROM api_key_rate_limit_windows
WHERE api_key_id = $1 AND window_start_at = $2 AND window_seconds = $3
"""
_PRUNE = """
DELETE FROM api_key_rate_limit_windows
WHERE window_start_at + make_interval(secs => window_seconds) < now() - make_interval(secs => $1)
"""


class _KeyWindow:
    """A per-key limits key (``ns/req/<api_key_id>/<limit>/<multiples>/<granularity>``), parsed."""

    __slots__ = ("api_key_id", "limit", "seconds")

    def __init__(self, key: str) -> None:
        parts = key.split("/")
        try:
            self.api_key_id = uuid.UUID(parts[-4])
            self.limit = int(parts[-3])
            self.seconds = int(parts[-2]) * _GRANULARITY_SECONDS[parts[-1]]
        except (IndexError, ValueError, KeyError):
            raise ValueError(f"not a per-key window: {key!r}") from None

    def start(self, now: float) -> datetime:
        """Windows are aligned to the epoch, so every replica computes the same start."""
        return datetime.fromtimestamp(math.floor(now / self.seconds) * self.seconds, tz=timezone.utc)


@_without_error_wrappers
class PostgresWindowStorage(Storage):
    """Per-key fixed windows in ``api_key_rate_limit_windows`` (seed 000), for ``limits``.

    Only per-key request windows fit the seed's table (it references ``api_keys``), so
    the limiter keeps per-IP and token windows elsewhere. The limit travels in the key
    (``limits`` builds keys as ``.../<amount>/<multiples>/<granularity>``), which lets
    ``incr`` be the seed's one upsert guarded by ``request_count < limit``: a rejected
    hit writes nothing (the library's other storages count it, and are refunded).
    """

    #: The fixed-window strategy need not refund a rejected hit here.
    consumes_on_rejection = False

    def __init__(self, pool: asyncpg.Pool, *, timeout: float = 1.0) -> None:
        super().__init__(None)
        self._pool = pool
        self._timeout = timeout

    @property
    def base_exceptions(self) -> tuple[type[Exception], ...]:
        return (asyncpg.PostgresError, asyncpg.InterfaceError, OSError)

    async def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        window = _KeyWindow(key)
        start = window.start(time.time())
        args = (window.api_key_id, start, window.seconds, amount)
        if amount <= 0:
            value = await self._pool.fetchval(_REFUND, *args, timeout=self._timeout)
            return int(value or 0)
        if amount > window.limit:
            return window.limit + amount  # can never fit: refuse without writing
        try:
            value = await self._pool.fetchval(_UPSERT, *args, window.limit, timeout=self._timeout)
        except asyncpg.ForeignKeyViolationError:
            return window.limit + amount  # the key row is gone: refuse, this is no outage
        # No row back: the guard refused, nothing was written; report "over the limit".
        return window.limit + amount if value is None else int(value)

    async def get(self, key: str) -> int:
        window = _KeyWindow(key)
        value = await self._pool.fetchval(
            _READ, window.api_key_id, window.start(time.time()), window.seconds, timeout=self._timeout
        )
        return int(value or 0)

    async def get_expiry(self, key: str) -> float:
        window = _KeyWindow(key)
        return window.start(time.time()).timestamp() + window.seconds

    async def check(self) -> bool:
        try:
            return bool(await self._pool.fetchval("SELECT true", timeout=self._timeout))
        except Exception:  # noqa: BLE001 - any failure means "not healthy"
            return False

    async def reset(self) -> int | None:
        result = await self._pool.execute("DELETE FROM api_key_rate_limit_windows", timeout=self._timeout)
        return int(result.split()[-1])

    async def clear(self, key: str) -> None:
        window = _KeyWindow(key)
        await self._pool.execute(
            "DELETE FROM api_key_rate_limit_windows WHERE api_key_id = $1 AND window_seconds = $2",
            window.api_key_id, window.seconds, timeout=self._timeout,
        )

    async def prune(self, grace_seconds: float = 60.0) -> int:
        """Delete windows that ended more than ``grace_seconds`` ago; returns how many."""
        result = await self._pool.execute(_PRUNE, float(grace_seconds), timeout=10)
        return int(result.split()[-1])


# --------------------------------------------------------------------------- strategy
class Windows:
    """One ``limits`` strategy over one storage, as the limiter uses it.

    ``name`` says which storage ("memory", "redis", "postgres"). ``immediate``: this
    process's memory (:class:`LocalStorage`), which answers without I/O and also through
    the synchronous ``*_now`` twins of ``hit``, ``stats`` and ``add`` and the
    :class:`MemoryCounter` they use (same arithmetic, same keys; the caller reads the
    clock once per decision and passes it as ``now``).
    Operations of one request run together only on Redis, whose pipeline keeps them in
    order; elsewhere one after the other (memory: no task per operation; PostgreSQL: on
    separate connections a read could overtake the hit before it).
    """

    __slots__ = (
        "_batches", "_counters", "_fixed", "_local", "_refund_rejected", "immediate", "name", "storage", "strategy",
    )
    #: Counters kept (cleared when full: each only saves building its keys again).
    MAX_COUNTERS = 8192

    def __init__(self, name: str, storage: Storage, strategy: str) -> None:
        if strategy not in ("sliding-window", "fixed-window"):
            raise ValueError(f"unknown strategy {strategy!r}")
        self.name = name
        self.storage = storage
        self._fixed = strategy == "fixed-window"
        self.strategy: RateLimiter = (
            FixedWindowRateLimiter(storage) if self._fixed else SlidingWindowCounterRateLimiter(storage)
        )
        self._batches = isinstance(storage, RedisWindowStorage)
        self._refund_rejected = self._fixed and getattr(storage, "consumes_on_rejection", True)
        #: This process's memory: decided by :class:`MemoryCounter`, synchronous twins of
        #: the library's operations (same arithmetic, same keys), not through its coroutines.
        #: (The library's own MemoryStorage, a test's reference, goes through the strategy.)
        self._local = storage if isinstance(storage, LocalStorage) else None
        self.immediate = self._local is not None
        self._counters: dict[str, MemoryCounter] = {}

    async def hit(self, item: RateLimitItem, *ids: str, cost: int = 1) -> bool:
        """Consume ``cost`` if it fits; a rejected hit consumes nothing."""
        if self._local is not None:
            return self.hit_now(item, *ids, cost=cost, now=time.time())
        if await self.strategy.hit(item, *ids, cost=cost):
            return True
        if self._refund_rejected:
            # limits' fixed window counts a rejected hit (INCRBY, then compare): give it back.
            await self.add(item, *ids, amount=-cost)
        return False

    async def stats(self, item: RateLimitItem, *ids: str) -> WindowStats:
        """(reset time, remaining) of the window, as ``limits`` computes them."""
        if self._local is not None:
            return self.stats_now(item, *ids, now=time.time())
        return await self.strategy.get_window_stats(item, *ids)

    async def add(self, item: RateLimitItem, *ids: str, amount: int) -> None:
        """Add ``amount`` whatever is left (negative: a refund).

        Token usage is known only after the call and must always count, even past the
        limit; the library's ``hit`` refuses a cost over what is left, so this goes to
        the storage under the strategy's own key.
        """
        if self._local is not None:
            self.add_now(item, *ids, amount=amount, now=time.time())
            return
        key = item.key_for(*ids)
        if self._fixed:
            await self.storage.incr(key, item.get_expiry(), amount)
        else:
            storage: Any = self.storage
            await storage.acquire_sliding_window_entry(key, UNBOUNDED, item.get_expiry(), amount)

    async def together(self, *ops: Coroutine[Any, Any, Any]) -> list[Any]:
        """Run ``ops`` in order: concurrently into one pipeline on Redis, else one by one."""
        if not self._batches:
            return [await op for op in ops]
        return list(await asyncio.gather(*ops))

    # -- this process's memory, without coroutines (``immediate`` windows only) ----------
    # Called on other storages they fail at once; the limiter only calls them where
    # ``immediate`` holds.
    def counter(self, item: RateLimitItem, *ids: str) -> MemoryCounter:
        """The :class:`MemoryCounter` of ``item`` for ``ids`` (kept: its keys are built once)."""
        key = item.key_for(*ids)
        counter = self._counters.get(key)
        if counter is None:
            local = self._local
            assert local is not None, "memory windows only"
            if len(self._counters) >= self.MAX_COUNTERS:
                self._counters.clear()  # it only saves work: a counter holds no count
            kind = FixedCounter if self._fixed else SlidingCounter
            counter = self._counters[key] = kind(local, key, item.amount, item.get_expiry())
        return counter

    def hit_now(self, item: RateLimitItem, *ids: str, cost: int = 1, now: float) -> bool:
        """:meth:`hit`, at ``now`` (``time.time()``)."""
        return self.counter(item, *ids).hit(now, cost)

    def stats_now(self, item: RateLimitItem, *ids: str, now: float) -> WindowStats:
        """:meth:`stats`, at ``now``."""
        return WindowStats(*self.counter(item, *ids).stats(now))

    def stats_and_hit_now(
        self, item: RateLimitItem, *ids: str, cost: int = 1, now: float
    ) -> tuple[WindowStats, bool]:
        """:meth:`stats` then :meth:`hit`, at ``now``, reading the window's counters once.

        Nothing runs in between (no await), so the hit would read what the stats read.
        """
        reset, remaining, ok = self.counter(item, *ids).stats_and_hit(now, cost)
        return WindowStats(reset, remaining), ok

    def add_now(self, item: RateLimitItem, *ids: str, amount: int, now: float) -> None:
        """:meth:`add`, at ``now``."""
        self.counter(item, *ids).add(now, amount)
