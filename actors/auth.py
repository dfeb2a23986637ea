"""AuthActor: turns a bearer token into a verified key, without a database trip when cached.

State it owns:

* the verified-key cache (prefix → :class:`VerifiedKey`), published to handlers as a
  read-only view so a cached key costs no mailbox hop;
* a negative cache of unknown prefixes, for ``NEGATIVE_TTL`` seconds;
* in-flight lookups, so concurrent misses on one prefix make one query;
* the set of keys used since the last ``last_used_at`` flush;
* a LISTEN connection on ``api_keys_changed``: a change to a key on any replica evicts
  its prefix here within milliseconds. When that connection is lost the cache is kept
  (cached keys keep working through a database outage, unknown keys fail closed), and
  on reconnect every cached key is re-read in one query, since notifications sent while
  disconnected are gone.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any

import asyncpg

from actors.runtime import Actor, ActorRef
from gateway.auth.keys import KEY_COLUMNS, KEY_PREFIX_LEN, KeyPolicy, KeyRecord, hash_key
from gateway.auth.negative import NegativeCache

__all__ = [
    "AuthActor",
    "AuthHandle",
    "Authenticate",
    "REASONS",
    "VerifiedKey",
    "Unauthenticated",
]

log = logging.getLogger("gateway.auth")

NOTIFY_CHANNEL = "api_keys_changed"
NEGATIVE_TTL = 5.0
#: Most unknown prefixes remembered at once: a flood of made-up keys costs bounded memory.
NEGATIVE_MAX_ENTRIES = 100_000
TOUCH_FLUSH_SECONDS = 1.0
RECONNECT_SECONDS = 0.5
#: Re-read every cached key this often even without notifications, as a safety net.
REVALIDATE_SECONDS = 60.0
MAX_TOKEN_LEN = 256


class Unauthenticated(Exception):
    """The token is missing, malformed, unknown, revoked or expired (one answer for all).

    ``reason`` says which, for metrics and logs only: the client always gets the same
    401, so a caller cannot tell a revoked key from one that never existed.
    """

    #: Why the key was refused: one of ``REASONS``.
    reason: str

    def __init__(self, reason: str = "unknown") -> None:
        super().__init__(reason)
        self.reason = reason


#: Every ``Unauthenticated.reason``: no token; not shaped like a key; no such key (or the
#: secret does not match its prefix); revoked or deactivated; past ``expires_at``; the
#: database could not be asked (an unknown key fails closed).
REASONS = ("missing", "malformed", "unknown", "revoked", "expired", "unavailable")


@dataclass(frozen=True, slots=True)
class VerifiedKey:
    """What the rest of the request needs to know about its key."""

    api_key_id: uuid.UUID
    subject_id: uuid.UUID
    name: str
    key_prefix: str
    key_hash: bytes
    policy: KeyPolicy
    expires_at: float | None  # unix seconds

    def usable(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


# -- messages ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Authenticate:
    """Verify ``token``; replies with a VerifiedKey or raises Unauthenticated."""

    token: str


@dataclass(frozen=True, slots=True)
class Touch:
    """The key was used now: its ``last_used_at`` is written with the next batch."""

    api_key_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Evict:
    """Forget this prefix (a change was notified)."""

    prefix: str


# -- internal results --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Looked:
    prefix: str
    #: The usable key, or why there is none (``unknown``/``revoked``); None on error.
    found: VerifiedKey | str | None
    error: BaseException | None
    #: Evictions counted when the query was sent (a later one makes ``found`` stale).
    since: int


@dataclass(frozen=True, slots=True)
class _Revalidated:
    rows: dict[str, VerifiedKey] | None
    asked: frozenset[str]
    since: int


def _verified(row: asyncpg.Record, hash_: bytes) -> VerifiedKey | None:
    """A usable VerifiedKey from a row, or None if the row is revoked/inactive."""
    if not row["is_active"] or row["revoked_at"] is not None:
        return None
    record = KeyRecord.from_row(row)
    expires: datetime | None = record.expires_at
    return VerifiedKey(
        api_key_id=record.api_key_id,
        subject_id=record.subject_id,
        name=record.name,
        key_prefix=record.key_prefix,
        key_hash=hash_,
        policy=record.policy,
        expires_at=expires.timestamp() if expires else None,
    )


class AuthActor(Actor[Authenticate | Touch | Evict]):
    name = "auth"

    def __init__(self, pool: asyncpg.Pool, dsn: str, *, mailbox_size: int = 4096) -> None:
        self.mailbox_size = mailbox_size
        super().__init__()
        self._pool = pool
        self._dsn = dsn
        self._cache: dict[str, VerifiedKey] = {}
        self.view: Mapping[str, VerifiedKey] = MappingProxyType(self._cache)
        #: prefixes known not to work, with why; bounded in time and size.
        self._negative = NegativeCache(NEGATIVE_MAX_ENTRIES)
        self._pending: dict[str, list[tuple[str, asyncio.Future[VerifiedKey]]]] = {}
        self._touched: set[uuid.UUID] = set()
        # A query may read a key just before it changes and answer after the change was
        # notified; caching that answer would undo the eviction. So evictions are counted,
        # and while queries are in flight each evicted prefix remembers its count.
        self._evictions = 0
        self._evicted: dict[str, int] = {}
        self._queries_in_flight = 0
        self._listener: asyncpg.Connection | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self.listening = False
        #: LISTEN connections that could not be opened (``gateway_background_failures_total``).
        self.listen_failures = 0

    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        self._listen_task = loop.create_task(self._keep_listening())
        self._flush_task = loop.create_task(self._flush_touched_forever())

    async def on_stop(self) -> None:
        for t in (self._listen_task, self._flush_task):
            if t is not None:
                t.cancel()
        await self._flush_touched()
        if self._listener is not None:
            await self._listener.close(timeout=1)

    async def receive(self, msg: Authenticate | Touch | Evict) -> Any:
        if isinstance(msg, Authenticate):
            return self._authenticate(msg.token)  # deferred: the loop goes on
        if isinstance(msg, Touch):
            self._touched.add(msg.api_key_id)
            return None
        if isinstance(msg, Evict):
            self._evict(msg.prefix)
            return None
        raise TypeError(f"unexpected message {msg!r}")

    async def on_internal(self, msg: Any) -> None:
        if isinstance(msg, _Looked):
            self._finish_lookup(msg)
        elif isinstance(msg, _Revalidated):
            self._finish_revalidation(msg)
        elif isinstance(msg, Evict):
            self._evict(msg.prefix)
        elif msg == "listening":
            self.listening = True
            self._revalidate()
        elif msg == "not-listening":
            self.listening = False

    def touched_since_flush(self, api_key_id: uuid.UUID) -> bool:
        """Is this key's ``last_used_at`` already due in the next flush? (read-only peek)"""
        return api_key_id in self._touched

    # -- lookups ----------------------------------------------------------------------
    def _authenticate(self, token: str) -> asyncio.Future[VerifiedKey]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[VerifiedKey] = loop.create_future()
        prefix = token[:KEY_PREFIX_LEN]
        cached = self._cache.get(prefix)
        now = time.time()
        if cached is not None:
            refused = _refusal(cached, token, now)
            if refused is None:
                fut.set_result(cached)
            else:
                fut.set_exception(Unauthenticated(refused))
            return fut
        negative = self._negative.get(prefix)
        if negative is not None:
            fut.set_exception(Unauthenticated(negative))
            return fut
        waiters = self._pending.get(prefix)
        if waiters is not None:
            waiters.append((token, fut))
            return fut
        self._pending[prefix] = [(token, fut)]
        since = self._query_started()
        self.spawn(self._fetch(prefix), lambda found, err: _Looked(prefix, found, err, since))
        return fut

    async def _fetch(self, prefix: str) -> VerifiedKey | str:
        """The usable key of ``prefix``, or why there is none (``unknown``/``revoked``)."""
        row = await self._pool.fetchrow(
            f"SELECT {KEY_COLUMNS}, key_hash FROM api_keys WHERE key_prefix = $1", prefix
        )
        if row is None:
            return "unknown"
        return _verified(row, bytes(row["key_hash"])) or "revoked"

    def _finish_lookup(self, looked: _Looked) -> None:
        waiters = self._pending.pop(looked.prefix, [])
        now = time.time()
        stale = self._stale(looked.prefix, looked.since)
        self._query_finished()
        if looked.error is not None or looked.found is None:
            # Database unreachable: an unknown key fails closed, and is not cached.
            log.warning("key lookup failed: %r", looked.error)
            for _, fut in waiters:
                if not fut.done():
                    fut.set_exception(Unauthenticated("unavailable"))
            return
        row = looked.found if isinstance(looked.found, VerifiedKey) else None
        if stale:
            pass  # the key changed while we asked: answer these waiters, remember nothing
        elif row is None:
            self._negative.add(looked.prefix, str(looked.found), NEGATIVE_TTL)
        else:
            self._cache[looked.prefix] = row
        for token, fut in waiters:
            if fut.done():
                continue
            refused = str(looked.found) if row is None else _refusal(row, token, now)
            if row is not None and refused is None:
                fut.set_result(row)
            else:
                fut.set_exception(Unauthenticated(refused or "unknown"))

    def _evict(self, prefix: str) -> None:
        self._cache.pop(prefix, None)
        self._negative.discard(prefix)
        self._evictions += 1
        if self._queries_in_flight:
            self._evicted[prefix] = self._evictions

    def _query_started(self) -> int:
        self._queries_in_flight += 1
        return self._evictions

    def _stale(self, prefix: str, since: int) -> bool:
        """Was ``prefix`` evicted after a query sent at eviction count ``since``?"""
        return self._evicted.get(prefix, 0) > since

    def _query_finished(self) -> None:
        self._queries_in_flight -= 1
        if not self._queries_in_flight:
            self._evicted.clear()

    # -- revalidation after a lost LISTEN connection ---------------------------------
    def _revalidate(self) -> None:
        prefixes = frozenset(self._cache)
        self._negative.clear()
        if not prefixes:
            return
        since = self._query_started()
        self.spawn(self._fetch_many(prefixes), lambda rows, err: _Revalidated(rows, prefixes, since))

    async def _fetch_many(self, prefixes: frozenset[str]) -> dict[str, VerifiedKey]:
        rows = await self._pool.fetch(
            f"SELECT {KEY_COLUMNS}, key_hash FROM api_keys WHERE key_prefix = ANY($1)", list(prefixes)
        )
        found: dict[str, VerifiedKey] = {}
        for row in rows:
            verified = _verified(row, bytes(row["key_hash"]))
            if verified is not None:
                found[row["key_prefix"]] = verified
        return found

    def _finish_revalidation(self, result: _Revalidated) -> None:
        stale = {p for p in result.asked if self._stale(p, result.since)}
        self._query_finished()
        if result.rows is None:
            return  # database still away: keep serving what we know
        for prefix in result.asked:
            fresh = result.rows.get(prefix)
            if prefix in stale:
                continue  # evicted after the query was sent; the next use looks it up afresh
            if fresh is None:
                self._cache.pop(prefix, None)
            else:
                self._cache[prefix] = fresh

    # -- background loops (run as plain tasks; talk to the loop via internal messages) --
    async def _keep_listening(self) -> None:
        last_full_check = time.monotonic()
        failing = False
        while True:
            try:
                conn = await asyncpg.connect(self._dsn, timeout=5)
            except Exception as exc:  # noqa: BLE001 - any failure means "retry later"
                self.listen_failures += 1
                # WARNING once per outage (then DEBUG every retry): revocations from other
                # replicas are not heard meanwhile (also /readyz and a metric).
                if failing:
                    log.debug("LISTEN connect failed again: %r", exc)
                else:
                    log.warning("key invalidation: LISTEN connect failed, retrying: %s: %s", type(exc).__name__, exc)
                failing = True
                await asyncio.sleep(RECONNECT_SECONDS)
                continue
            if failing:
                log.warning("key invalidation: LISTEN connected again")
            failing = False
            lost = asyncio.Event()
            self._listener = conn
            try:
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await conn.add_listener(
                    NOTIFY_CHANNEL, lambda _c, _pid, _ch, payload: self.post_internal(Evict(payload))
                )
                self.post_internal("listening")
                while not lost.is_set():
                    try:
                        await asyncio.wait_for(lost.wait(), timeout=RECONNECT_SECONDS * 4)
                    except TimeoutError:
                        # A dead TCP peer may never fire the termination listener: probe.
                        try:
                            await conn.fetchval("SELECT 1", timeout=2)
                        except Exception:  # noqa: BLE001
                            break
                        if time.monotonic() - last_full_check > REVALIDATE_SECONDS:
                            last_full_check = time.monotonic()
                            self.post_internal("listening")
            finally:
                self.post_internal("not-listening")
                self._listener = None
                conn.terminate()
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _flush_touched_forever(self) -> None:
        while True:
            await asyncio.sleep(TOUCH_FLUSH_SECONDS)
            await self._flush_touched()

    async def _flush_touched(self) -> None:
        if not self._touched:
            return
        ids, self._touched = list(self._touched), set()
        try:
            await self._pool.execute(
                "UPDATE api_keys SET last_used_at = now() WHERE api_key_id = ANY($1::uuid[])", ids
            )
        except Exception as exc:  # noqa: BLE001 - bookkeeping only; retried next flush
            log.debug("last_used_at flush failed: %r", exc)
            self._touched.update(ids)


def _refusal(key: VerifiedKey, token: str, now: float) -> str | None:
    """Why ``token`` may not use ``key`` (``unknown``, ``expired``), or None if it may."""
    if not hmac.compare_digest(key.key_hash, hash_key(token)):
        return "unknown"  # right prefix, wrong secret: no such key, as far as the caller knows
    if not key.usable(now):
        return "expired"
    return None


class AuthHandle:
    """What handlers call: cached keys are checked right here, misses ask the actor."""

    __slots__ = ("_actor", "_ref", "_view")

    def __init__(self, actor: AuthActor, ref: ActorRef[Any]) -> None:
        self._actor = actor
        self._ref = ref
        self._view = actor.view

    def answers_from_cache(self, token: str | None) -> bool:
        """Would :meth:`authenticate` decide ``token`` without a database lookup?

        True for a token whose key is cached (valid or not for this secret): the per-IP
        guard spends its budget of failed attempts only on requests that may cost one.
        """
        return (
            token is not None and KEY_PREFIX_LEN + 4 <= len(token) <= MAX_TOKEN_LEN
            and token[:KEY_PREFIX_LEN] in self._view
        )

    async def authenticate(self, token: str | None) -> VerifiedKey:
        """The key for ``token``, or Unauthenticated. Never touches the database if cached."""
        if not token:
            raise Unauthenticated("missing")
        if len(token) > MAX_TOKEN_LEN or len(token) < KEY_PREFIX_LEN + 4 or not token.isascii():
            raise Unauthenticated("malformed")
        key = self._view.get(token[:KEY_PREFIX_LEN])
        if key is None:
            key = await self._ref.ask(Authenticate(token))
        elif (refused := _refusal(key, token, time.time())) is not None:
            raise Unauthenticated(refused)
        # One Touch per key per flush, not per request: a tell wakes the actor's task.
        if not self._actor.touched_since_flush(key.api_key_id):
            try:
                self._ref.tell(Touch(key.api_key_id))
            except Exception:  # noqa: BLE001 - a full mailbox must not fail a good key
                pass
        return key

    @property
    def listening(self) -> bool:
        return self._actor.listening

    @property
    def listen_failures(self) -> int:
        return self._actor.listen_failures

    @property
    def ref(self) -> ActorRef[Any]:
        return self._ref
