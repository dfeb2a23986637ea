"""CacheActor: owns the stored answers, their bounds, the semantic index and the Redis tier.

State it owns:

* the in-memory LRU of entries, bounded by bytes (:class:`gateway.cache.store.ByteLRU`),
  published to handlers as a read-only view: a hit in memory costs no mailbox hop;
* the semantic index: in PostgreSQL with pgvector when the database has the extension
  (:class:`gateway.cache.pgvector.PgVectorIndex`; shared by every replica, answers stored
  with their vectors; writes, sweeps and purges run as spawned tasks), otherwise the
  in-process :class:`gateway.cache.semantic.SemanticIndex`, published per partition as
  immutable snapshots, bounded in vectors;
* with ``REDIS_URL``: the shared tier. Entries live under ``{prefix}:e:{key}`` with the
  group's TTL, so every replica serves every replica's answers; sets per subject and
  per group serve purges. Each store and purge is announced on ``{prefix}:events``;
  every replica subscribes and keeps the set of keys that exist in Redis (seeded by a
  SCAN when it subscribes). A miss is then decided by one dict lookup, with no Redis
  trip; only a key known to exist costs a GET. While not subscribed (start-up, lost
  connection) every lookup asks Redis, so a hit is never missed for long. With the
  in-process index, semantic vectors travel in the same announcements, so replicas
  share semantic hits too (with pgvector the database already shares them).

Handlers hold a :class:`CacheHandle`: ``ticket`` decides what a request may do (one dict
lookup when its group has no cache), ``lookup`` finds a hit, ``store`` tells the actor.

Why one module of ~860 lines: one actor per module (messages, handle, loop, start), and the
cache actor owns three tiers (in-process LRU, semantic index, Redis announcements) whose
bookkeeping must stay consistent; the pure parts (keys, entries, indexes, embedders) live
in gateway/cache.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import asyncpg
import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from actors.runtime import Actor, ActorError, ActorRef, Supervisor
from gateway.cache.embedder import DeploymentEmbedder, Embedder, EmbedderBusy, LocalEmbedder
from gateway.cache.keys import (
    CACHE_HEADER,
    CacheTicket,
    client_directives,
    exact_key,
    is_deterministic,
    request_material,
)
from gateway.cache.pgvector import PgVectorIndex, PgVectorRow, open_pgvector_index
from gateway.cache.semantic import (
    Guard,
    Match,
    SemanticIndex,
    final_user_text,
    guard_of,
    partition_of,
    vector_from_bytes,
    vector_to_bytes,
)
from gateway.cache.store import ByteLRU, CacheEntry, decode_entry, encode_entry
from gateway.core.config import CachePolicy, CacheSettings, ConfigError, GatewayConfig
from gateway.core.redis import connection_pool

__all__ = ["CacheActor", "CacheCounters", "CacheHandle", "Purge", "start_cache"]

log = logging.getLogger("gateway.cache")

SWEEP_SECONDS = 5.0
RECONNECT_SECONDS = 0.5
#: A Redis call on the request path gives up after this long (then: a miss).
REDIS_TIMEOUT = 0.25
#: After a Redis error, requests skip Redis this long instead of each waiting for it.
REDIS_BACKOFF = 1.0
#: Keys known to exist in Redis at most; past it every lookup asks Redis instead.
MAX_REMOTE_KEYS = 1_000_000
#: Stores waiting to be shared at most; past it the oldest are kept in memory only.
MAX_OUTBOX = 10_000
#: Connections to Redis at most; a request waits for one up to REDIS_TIMEOUT.
MAX_REDIS_CONNECTIONS = 64
#: Fetching a matched answer's body from PostgreSQL (a hit, not a miss) gives up after this long.
PG_ENTRY_TIMEOUT = 1.0
#: A pgvector search left running past a miss's budget is bounded by this (asyncpg timeout).
PG_SEARCH_TIMEOUT = 2.0


# -- messages ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Store:
    """Keep ``entry`` (and its vector, for semantic groups); share it through Redis."""

    entry: CacheEntry
    partition: str | None = None
    vector: Any = None
    guard: Guard | None = None


@dataclass(frozen=True, slots=True)
class Adopt:
    """An entry read from Redis: keep it in memory so the next hit costs no trip."""

    entry: CacheEntry


@dataclass(frozen=True, slots=True)
class Touch:
    """The entry was served: it becomes the most recently used."""

    key: str


@dataclass(frozen=True, slots=True)
class Purge:
    """Forget entries: by exact key, by the subject that stored them, by group, or all.

    Replies ``{"memory": n, "shared": m}`` (entries removed here, and from Redis).
    """

    key: str | None = None
    subject: str | None = None
    group: str | None = None
    everything: bool = False


# -- internal results --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Announced:
    data: bytes


@dataclass(frozen=True, slots=True)
class _Synced:
    keys: dict[str, float] | None  # None: not subscribed (any more)


@dataclass(frozen=True, slots=True)
class _RemotePurged:
    reply: asyncio.Future[dict[str, int]]
    memory: int
    shared: int | None


@dataclass(frozen=True, slots=True)
class _RemoteStored:
    error: BaseException | None
    count: int


@dataclass(frozen=True, slots=True)
class _VectorsStored:
    error: BaseException | None
    count: int


@dataclass(frozen=True, slots=True)
class _VectorsSwept:
    error: BaseException | None
    rows: int | None


@dataclass(slots=True)
class CacheCounters:
    """Running totals for metrics (observability reads them; nothing resets them)."""

    hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    bypasses: int = 0
    stores: int = 0
    stores_dropped: int = 0
    evictions: int = 0
    expirations: int = 0
    semantic_lookups: int = 0
    semantic_timeouts: int = 0
    semantic_skipped: int = 0
    semantic_errors: int = 0
    remote_gets: int = 0
    remote_errors: int = 0
    similarity_sum: float = 0.0
    #: Vectors written to the semantic index (in-process, or committed to pgvector).
    vectors_stored: int = 0
    #: pgvector writes, sweeps or purges that failed (the answers stay in the exact cache).
    vector_errors: int = 0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


CacheMessage = Store | Adopt | Touch | Purge


class CacheActor(Actor[CacheMessage]):
    name = "cache"

    def __init__(
        self, settings: CacheSettings, redis_url: str | None, *, mailbox_size: int = 8192,
        pg_index: PgVectorIndex | None = None, index_reason: str = "",
    ) -> None:
        self.mailbox_size = mailbox_size
        super().__init__()
        self.settings = settings
        self.counters = CacheCounters()
        self._lru = ByteLRU(settings.max_bytes)
        self.view: Mapping[str, CacheEntry] = self._lru.view
        self._index = SemanticIndex(settings.semantic.max_vectors)
        self._redis_url = redis_url
        self.redis: aioredis.Redis | None = None
        self._prefix = settings.redis_prefix
        self._channel = f"{settings.redis_prefix}:events"
        self._instance = uuid.uuid4().hex
        #: Keys that exist in Redis, with their expiry (unix seconds); see the module doc.
        self._remote: dict[str, float] = {}
        self.remote_view: Mapping[str, float] = MappingProxyType(self._remote)
        self.remote_synced = False
        self._tasks_started: list[asyncio.Task[None]] = []
        #: Stores not yet shared: one writer sends them all in one pipeline (see _flush).
        self._outbox: list[Store] = []
        self._flushing = False
        #: The shared vector index, when the database has pgvector (else None: in-process).
        self.pg_index = pg_index
        self._index_reason = index_reason
        self._pg_outbox: list[PgVectorRow] = []
        self._pg_flushing = False
        self._pg_sweeping = False
        self._pg_rows = 0  # as of the last sweep, plus what was stored since

    # -- published read-only state -------------------------------------------------------
    def semantic_snapshot(self, partition: str) -> Any:
        return self._index.snapshot(partition)

    def entry_key(self, key: str) -> str:
        return f"{self._prefix}:e:{key}"

    def sizes(self) -> dict[str, Any]:
        return {
            "entries": len(self._lru), "bytes": self._lru.bytes, "max_bytes": self._lru.max_bytes,
            "vectors": self._pg_rows if self.pg_index is not None else len(self._index),
            "semantic_index": "pgvector" if self.pg_index is not None else "memory",
            "semantic_index_reason": self._index_reason,
            "shared": self.redis is not None,
            "shared_keys_known": len(self._remote), "shared_index_live": self.remote_synced,
        }

    # -- lifecycle -----------------------------------------------------------------------
    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._redis_url:
            pool = connection_pool(
                self._redis_url, blocking=True, max_connections=MAX_REDIS_CONNECTIONS, timeout=REDIS_TIMEOUT,
                socket_timeout=2.0, socket_connect_timeout=1.0, health_check_interval=15,
            )
            self.redis = aioredis.Redis(connection_pool=pool)
            self._tasks_started.append(loop.create_task(self._subscribe_forever()))
        self._tasks_started.append(loop.create_task(self._sweep_forever()))
        if self.pg_index is not None:
            self.post_internal("sweep")  # learn the shared table's size (and expire) right away

    async def on_stop(self) -> None:
        for task in self._tasks_started:
            task.cancel()
        for task in self._tasks_started:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.redis is not None:
            await self.redis.aclose()

    async def receive(self, msg: CacheMessage) -> Any:
        if isinstance(msg, Touch):
            self._lru.touch(msg.key)
        elif isinstance(msg, Store):
            self._store(msg)
        elif isinstance(msg, Adopt):
            if msg.entry.fresh(time.time()):
                self._evicted(self._lru.put(msg.entry))
        elif isinstance(msg, Purge):
            return self._purge(msg)
        else:
            raise TypeError(f"unexpected message {msg!r}")
        return None

    async def on_internal(self, msg: Any) -> None:
        if isinstance(msg, _Announced):
            self._announced(msg.data)
        elif isinstance(msg, _Synced):
            if msg.keys is None:
                self.remote_synced = False
            elif len(self._remote) + len(msg.keys) <= MAX_REMOTE_KEYS:
                self._remote.update(msg.keys)
                self.remote_synced = True
        elif isinstance(msg, _RemotePurged):
            if not msg.reply.done():
                msg.reply.set_result({"memory": msg.memory, "shared": msg.shared if msg.shared is not None else -1})
        elif msg == "sweep":
            self._sweep()
        elif isinstance(msg, _RemoteStored):
            self._flushing = False
            if msg.error is not None:
                self.counters.remote_errors += 1
                log.warning("cache: could not share %d entries through Redis: %r", msg.count, msg.error)
            self._flush()
        elif isinstance(msg, _VectorsStored):
            self._pg_flushing = False
            if msg.error is not None:
                self.counters.vector_errors += 1
                log.warning("cache: could not store %d vectors in PostgreSQL: %r", msg.count, msg.error)
            else:
                self.counters.vectors_stored += msg.count
                self._pg_rows += msg.count
            self._pg_flush()
        elif isinstance(msg, _VectorsSwept):
            self._pg_sweeping = False
            if msg.error is not None:
                self.counters.vector_errors += 1
                log.warning("cache: could not sweep the pgvector index: %r", msg.error)
            elif msg.rows is not None:
                self._pg_rows = msg.rows

    # -- stores, evictions, purges ---------------------------------------------------------
    def _store(self, msg: Store) -> None:
        entry = msg.entry
        self.counters.stores += 1
        self._evicted(self._lru.put(entry))
        if msg.partition is not None and msg.vector is not None and msg.guard is not None:
            if self.pg_index is not None:
                self._pg_outbox.append(PgVectorRow(
                    msg.partition, entry.key, entry.group, entry.scope, entry.subject, msg.guard, msg.vector,
                    encode_entry(entry), entry.expires_at,
                ))
                if len(self._pg_outbox) > MAX_OUTBOX:
                    del self._pg_outbox[0]
                    self.counters.stores_dropped += 1
                self._pg_flush()
            else:
                self._index.add(entry.key, msg.partition, msg.vector, msg.guard, entry.expires_at)
                self.counters.vectors_stored += 1
        if self.redis is not None:
            self._remote[entry.key] = entry.expires_at
            self._outbox.append(msg)
            if len(self._outbox) > MAX_OUTBOX:
                del self._outbox[0]
                self.counters.stores_dropped += 1
            self._flush()

    def _flush(self) -> None:
        """Share what waits in one pipeline; stores arriving meanwhile wait for the next."""
        if self._flushing or not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        self._flushing = True
        self.spawn(self._remote_store(batch), lambda _r, err: _RemoteStored(err, len(batch)))

    def _pg_flush(self) -> None:
        """Write waiting vectors in one transaction; ones arriving meanwhile wait for the next."""
        if self._pg_flushing or not self._pg_outbox or self.pg_index is None:
            return
        batch, self._pg_outbox = self._pg_outbox, []
        self._pg_flushing = True
        self.spawn(self.pg_index.insert(batch), lambda _r, err: _VectorsStored(err, len(batch)))

    def _evicted(self, keys: list[str]) -> None:
        self.counters.evictions += len(keys)
        if self.redis is None and self.pg_index is None:
            # Without a shared tier an evicted answer is gone, and so is its vector.
            self._index.discard(keys)

    def _forget(self, keys: list[str]) -> int:
        removed = sum(1 for k in keys if self._lru.pop(k) is not None)
        self._index.discard(keys)
        for key in keys:
            self._remote.pop(key, None)
        return removed

    def _purge(self, msg: Purge) -> Any:
        if msg.everything:
            keys = self._lru.clear()
            self._index.clear()
            self._remote.clear()
            memory = len(keys)
        elif msg.key is not None:
            memory = self._forget([msg.key])
        else:
            memory = self._forget(self._lru.select(subject=msg.subject, group=msg.group))
        if self.redis is None and self.pg_index is None:
            return {"memory": memory, "shared": 0}
        reply: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
        self.spawn(
            self._shared_purge(msg),
            lambda n, err: _RemotePurged(reply, memory, None if err is not None else n),
        )
        return reply  # deferred: answered once Redis has been purged too

    def _sweep(self) -> None:
        now = time.time()
        gone = self._lru.expire(now)
        self.counters.expirations += len(gone)
        self._index.expire(now)
        for key in [k for k, exp in self._remote.items() if exp <= now]:
            del self._remote[key]
        if self.pg_index is not None and not self._pg_sweeping:
            self._pg_sweeping = True
            self.spawn(self.pg_index.sweep(), lambda rows, err: _VectorsSwept(err, rows))

    def _announced(self, data: bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict) or event.get("src") == self._instance:
            return  # our own announcement: already applied
        op = event.get("op")
        if op == "stored":
            key, expires = str(event["key"]), float(event["exp"])
            if len(self._remote) < MAX_REMOTE_KEYS:
                self._remote[key] = expires
            if event.get("p") and event.get("vec") and event.get("g") and self.pg_index is None:
                vector = vector_from_bytes(base64.b64decode(event["vec"]))
                self._index.add(key, event["p"], vector, Guard.from_json(event["g"]), expires)
        elif op == "purged":
            self._forget([str(k) for k in event.get("keys") or ()])
        elif op == "cleared":
            self._lru.clear()
            self._index.clear()
            self._remote.clear()

    # -- Redis (run as tasks; results come back as internal messages) ----------------------
    async def _remote_store(self, batch: list[Store]) -> None:
        assert self.redis is not None
        pipe = self.redis.pipeline(transaction=False)
        now = time.time()
        for msg in batch:
            entry = msg.entry
            ttl_ms = int((entry.expires_at - now) * 1000)
            if ttl_ms <= 0:
                continue
            announce: dict[str, Any] = {
                "op": "stored", "src": self._instance, "key": entry.key, "exp": entry.expires_at,
            }
            if msg.partition is not None and msg.vector is not None and msg.guard is not None and self.pg_index is None:
                announce.update(p=msg.partition, g=msg.guard.to_json(),
                                vec=base64.b64encode(vector_to_bytes(msg.vector)).decode())
            pipe.set(self.entry_key(entry.key), encode_entry(entry), px=ttl_ms)
            for tag in (f"{self._prefix}:subject:{entry.subject}", f"{self._prefix}:group:{entry.group}"):
                pipe.sadd(tag, entry.key)
                # A tag set lives as long as its longest-lived entry (NX for a new set, GT after).
                pipe.pexpire(tag, ttl_ms, nx=True)
                pipe.pexpire(tag, ttl_ms, gt=True)
            pipe.publish(self._channel, orjson.dumps(announce))
        await pipe.execute()

    async def _shared_purge(self, msg: Purge) -> int:
        """Purge the pgvector rows (shared by every replica), then Redis; returns Redis' count."""
        if self.pg_index is not None:
            try:
                await self.pg_index.purge(
                    keys=[msg.key] if msg.key is not None else (), subject=msg.subject, group=msg.group,
                    everything=msg.everything,
                )
            except (asyncpg.PostgresError, OSError) as exc:
                self.counters.vector_errors += 1
                log.warning("cache: could not purge the pgvector index: %r", exc)
        return await self._remote_purge(msg) if self.redis is not None else 0

    async def _remote_purge(self, msg: Purge) -> int:
        assert self.redis is not None
        redis = self.redis
        if msg.everything:
            deleted = 0
            async for name in redis.scan_iter(match=f"{self._prefix}:*", count=1000):
                deleted += int(name.startswith(f"{self._prefix}:e:".encode()))
                await redis.unlink(name)
            await redis.publish(self._channel, orjson.dumps({"op": "cleared", "src": self._instance}))
            return deleted
        tags: list[str] = []
        if msg.subject is not None:
            tags.append(f"{self._prefix}:subject:{msg.subject}")
        if msg.group is not None:
            tags.append(f"{self._prefix}:group:{msg.group}")
        if msg.key is not None:
            keys = [msg.key]
        elif len(tags) == 1:
            keys = [_text(k) for k in await redis.smembers(tags[0])]
        else:
            keys = [_text(k) for k in await redis.sinter(tags)]
        if not keys:
            return 0
        deleted = int(await redis.unlink(*[self.entry_key(k) for k in keys]))
        if tags:
            pipe = redis.pipeline(transaction=False)
            for tag in tags:
                pipe.srem(tag, *keys)
            await pipe.execute()
        await redis.publish(self._channel, orjson.dumps({"op": "purged", "src": self._instance, "keys": keys}))
        return deleted

    async def _scan_remote(self) -> dict[str, float] | None:
        assert self.redis is not None
        prefix = f"{self._prefix}:e:"
        names: list[bytes] = []
        async for name in self.redis.scan_iter(match=f"{prefix}*", count=1000):
            names.append(name)
            if len(names) > MAX_REMOTE_KEYS:
                return None
        found: dict[str, float] = {}
        now = time.time()
        for start in range(0, len(names), 500):
            batch = names[start:start + 500]
            pipe = self.redis.pipeline(transaction=False)
            for name in batch:
                pipe.pttl(name)
            for name, ttl in zip(batch, await pipe.execute(), strict=True):
                if isinstance(ttl, int) and ttl > 0:
                    found[name.decode()[len(prefix):]] = now + ttl / 1000
        return found

    async def _subscribe_forever(self) -> None:
        assert self.redis is not None
        warned = False
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                keys = await self._scan_remote()
                if keys is not None:
                    self.post_internal(_Synced(keys))
                if warned:
                    log.info("cache: Redis subscription is back")
                    warned = False
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self.post_internal(_Announced(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: resubscribe, ask Redis meanwhile
                if not warned:  # once per outage, not once per retry
                    log.warning("cache: Redis subscription lost (%r); lookups ask Redis until it is back", exc)
                    warned = True
                self.post_internal(_Synced(None))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            self.post_internal("sweep")


def _scope_of(scope: str, api_key_id: uuid.UUID, subject_id: uuid.UUID) -> str:
    if scope == "key":
        return f"key:{api_key_id}"
    if scope == "subject":
        return f"subject:{subject_id}"
    return "global"


class CacheHandle:
    """What the chat handler calls. Reads published state directly; writes are tells."""

    __slots__ = (
        "_actor", "_default_policy", "_embedder", "_opt_in", "_policies", "_redis_down_until",
        "_ref", "_wait", "counters", "max_entry_bytes", "similarity_listeners",
    )

    def __init__(
        self, actor: CacheActor, ref: ActorRef[Any], config: GatewayConfig, embedder: Embedder | None
    ) -> None:
        self._actor = actor
        self._ref = ref
        self._policies: dict[str, CachePolicy] = {m.name: m.cache for m in config.models if m.cache is not None}
        self._opt_in = config.cache.client_opt_in
        self._default_policy = CachePolicy()
        self._embedder = embedder
        self._wait = config.cache.semantic.max_wait_ms / 1000
        self._redis_down_until = 0.0
        self.counters = actor.counters
        self.max_entry_bytes = config.cache.max_entry_bytes
        #: Called with (best similarity, hit) after each semantic search that found a candidate.
        self.similarity_listeners: list[Callable[[float, bool], None]] = []

    def apply_config(self, config: GatewayConfig) -> None:
        """A config reload's per-group policies and request-path bounds (effective at once).

        The store's own bounds (``max_bytes``), the Redis prefix, the index and the
        embedder are built at start-up and change only with a restart.
        """
        self._policies = {m.name: m.cache for m in config.models if m.cache is not None}
        self._opt_in = config.cache.client_opt_in
        self._wait = config.cache.semantic.max_wait_ms / 1000
        self.max_entry_bytes = config.cache.max_entry_bytes

    # -- the request path ------------------------------------------------------------------
    def ticket(
        self, group: str, requested_model: str, body: Mapping[str, Any],
        api_key_id: uuid.UUID, subject_id: uuid.UUID, headers: Mapping[str, str],
    ) -> CacheTicket | None:
        """This request's cache decision; None when caching does not apply to it at all."""
        policy = self._policies.get(group)
        if policy is None and (not self._opt_in or CACHE_HEADER not in headers):
            return None  # the common case when caching is off: one dict lookup
        opted_in, read, write = client_directives(headers)
        if policy is None:
            if not opted_in:
                return None
            policy = self._default_policy
        if policy.deterministic_only and not is_deterministic(body):
            read = write = False
        stream = body.get("stream") is True
        scope = _scope_of(policy.scope, api_key_id, subject_id)
        material = request_material(group, requested_model, scope, stream, body)
        ticket = CacheTicket(
            handle=self, key=exact_key(material), scope=scope, subject=str(subject_id), group=group,
            policy=policy, stream=stream, read=read, write=write, material=material,
            status="miss" if read else "bypass",
        )
        if not read:
            self.counters.bypasses += 1
        if policy.mode == "semantic" and self._embedder is not None and (read or write):
            text = final_user_text(body.get("messages") or ())
            if text is not None:
                ticket.semantic_text = text
                ticket.partition = partition_of(material, self._embedder.name)
                ticket.guard = guard_of(text)
        return ticket

    async def lookup(self, ticket: CacheTicket) -> CacheEntry | None:
        """A stored answer for ``ticket``: memory, then Redis, then by meaning; else None."""
        if not ticket.read:
            return None
        now = time.time()
        entry = self._usable(self._actor.view.get(ticket.key), ticket, now)
        if entry is None and self._actor.redis is not None and (
            not self._actor.remote_synced or ticket.key in self._actor.remote_view
        ):
            entry = self._usable(await self._fetch(ticket.key), ticket, now)
        if entry is None and ticket.semantic_text is not None:
            entry = await self._semantic(ticket, now)
        if entry is None:
            self.counters.misses += 1
            return None
        ticket.status = "hit"
        ticket.write = False
        self.counters.hits += 1
        with contextlib.suppress(ActorError):
            self._ref.tell(Touch(entry.key))
        return entry

    def store(self, ticket: CacheTicket, entry: CacheEntry) -> None:
        """Hand a fresh answer to the actor (after its vector, for semantic groups)."""
        ticket.write = False
        if ticket.partition is None or self._embedder is None:
            self._tell(Store(entry))
            return
        if ticket.vector is None:
            ticket.vector = self._start_embedding(ticket.semantic_text or "")
        partition, guard = ticket.partition, ticket.guard

        def with_vector(done: asyncio.Future[Any]) -> None:
            vector = None if done.cancelled() or done.exception() is not None else done.result()
            self._tell(Store(entry, partition, vector, guard) if vector is not None else Store(entry))

        if ticket.vector.done():
            with_vector(ticket.vector)
        else:
            ticket.vector.add_done_callback(with_vector)

    # -- operator calls --------------------------------------------------------------------
    async def purge(
        self, *, key: str | None = None, subject: str | None = None, group: str | None = None,
        everything: bool = False,
    ) -> dict[str, int]:
        reply: dict[str, int] = await self._ref.ask(Purge(key, subject, group, everything), timeout=10.0)
        return reply

    def stats(self) -> dict[str, Any]:
        """Sizes, counters and per-group policies, for /admin/cache and metrics."""
        return {
            **self._actor.sizes(),
            "counters": self.counters.as_dict(),
            "embedder": None if self._embedder is None else self._embedder.name,
            "policies": {
                name: {"mode": p.mode, "ttl_seconds": p.ttl, "scope": p.scope, "threshold": p.threshold,
                       "deterministic_only": p.deterministic_only}
                for name, p in self._policies.items()
            },
            "client_opt_in": self._opt_in,
        }

    @property
    def ref(self) -> ActorRef[Any]:
        return self._ref

    # -- internals -------------------------------------------------------------------------
    def _tell(self, msg: Store) -> None:
        try:
            self._ref.tell(msg)
        except ActorError:  # full or stopping: this answer is simply not cached
            self.counters.stores_dropped += 1

    @staticmethod
    def _usable(entry: CacheEntry | None, ticket: CacheTicket, now: float) -> CacheEntry | None:
        # The key already encodes scope, group and stream; checking them again means no
        # hash collision or stray write can ever serve an answer across tenants.
        if (
            entry is None or not entry.fresh(now) or entry.scope != ticket.scope
            or entry.group != ticket.group or entry.stream != ticket.stream
        ):
            return None
        return entry

    async def _fetch(self, key: str) -> CacheEntry | None:
        redis = self._actor.redis
        if redis is None or time.monotonic() < self._redis_down_until:
            return None
        self.counters.remote_gets += 1
        try:
            async with asyncio.timeout(REDIS_TIMEOUT):
                raw = await redis.get(self._actor.entry_key(key))
        except (RedisError, OSError, TimeoutError) as exc:
            self.counters.remote_errors += 1
            self._redis_down_until = time.monotonic() + REDIS_BACKOFF
            log.debug("cache: Redis GET failed: %r", exc)
            return None
        if raw is None:
            return None
        entry = decode_entry(raw if isinstance(raw, bytes) else raw.encode())
        if entry is not None:
            with contextlib.suppress(ActorError):
                self._ref.tell(Adopt(entry))
        return entry

    def _start_embedding(self, text: str) -> asyncio.Future[Any]:
        assert self._embedder is not None
        future = asyncio.ensure_future(self._embedder.embed(text))
        future.add_done_callback(_retrieve)
        return future

    async def _semantic(self, ticket: CacheTicket, now: float) -> CacheEntry | None:
        assert ticket.partition is not None and ticket.guard is not None
        pg = self._actor.pg_index
        if pg is None and not self._actor.semantic_snapshot(ticket.partition).keys:
            # Nothing to compare with (replicas' vectors arrive here too): embed only to store.
            return None
        self.counters.semantic_lookups += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait  # embedding and search together: what a miss may wait
        ticket.vector = self._start_embedding(ticket.semantic_text or "")
        done, _ = await asyncio.wait({ticket.vector}, timeout=self._wait)
        if not done:
            self.counters.semantic_timeouts += 1  # the miss goes on; the vector still serves the store
            return None
        error = ticket.vector.exception()
        if error is not None:
            if isinstance(error, EmbedderBusy):
                self.counters.semantic_skipped += 1
            else:
                self.counters.semantic_errors += 1
                log.warning("cache: embedding failed: %s", error)
            return None
        if pg is not None:
            found = await self._search_pg(pg, ticket, deadline - loop.time())
            if found is None:
                return None
            match, best = found
        else:
            snapshot = self._actor.semantic_snapshot(ticket.partition)
            match, best = snapshot.search(ticket.vector.result(), ticket.guard, ticket.policy.threshold, now)
        if best > 0.0:
            for listener in self.similarity_listeners:
                listener(best, match is not None)
        if match is None:
            return None
        entry = self._usable(self._actor.view.get(match.key), ticket, now)
        if entry is None and self._actor.redis is not None:
            entry = self._usable(await self._fetch(match.key), ticket, now)
        if entry is None and pg is not None:
            entry = self._usable(await self._fetch_pg(pg, ticket.partition, match.key), ticket, now)
        if entry is not None:
            ticket.similarity = match.similarity
            self.counters.semantic_hits += 1
            self.counters.similarity_sum += match.similarity
        return entry


    async def _search_pg(
        self, pg: PgVectorIndex, ticket: CacheTicket, budget: float
    ) -> tuple[Match | None, float] | None:
        """Search pgvector within what is left of the miss's budget; None: no answer in time."""
        assert ticket.partition is not None and ticket.guard is not None and ticket.vector is not None
        search = asyncio.ensure_future(
            pg.search(ticket.partition, ticket.vector.result(), ticket.guard, ticket.policy.threshold,
                      timeout=PG_SEARCH_TIMEOUT)
        )
        search.add_done_callback(_retrieve)
        # Not cancelled on time-out: cancelling an asyncpg query resets its connection; the
        # search ends on its own (bounded by PG_SEARCH_TIMEOUT) and the miss goes on now.
        done, _ = await asyncio.wait({search}, timeout=max(budget, 0.0))
        if not done:
            self.counters.semantic_timeouts += 1
            return None
        error = search.exception()
        if error is not None:
            self.counters.semantic_errors += 1
            log.warning("cache: pgvector search failed: %r", error)
            return None
        return search.result()

    async def _fetch_pg(self, pg: PgVectorIndex, partition: str, key: str) -> CacheEntry | None:
        """A matched answer another replica stored: its body is in the vector's row."""
        try:
            raw = await pg.entry(partition, key, timeout=PG_ENTRY_TIMEOUT)
        except (asyncpg.PostgresError, OSError, TimeoutError) as exc:
            self.counters.semantic_errors += 1
            log.debug("cache: reading a matched answer from PostgreSQL failed: %r", exc)
            return None
        entry = decode_entry(raw) if raw is not None else None
        if entry is not None:
            with contextlib.suppress(ActorError):
                self._ref.tell(Adopt(entry))
        return entry


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark an embedding's error as seen (it is counted where it matters)."""
    if not future.cancelled():
        future.exception()


async def start_cache(
    supervisor: Supervisor, config: GatewayConfig, redis_url: str | None, providers: Mapping[str, Any],
    router: Any, *, pool: asyncpg.Pool | None = None,
) -> tuple[CacheHandle, Embedder | None]:
    """Build the embedder a semantic group needs (warm), pick the vector index, start the actor.

    The index is pgvector in ``pool``'s database when it has the extension (and
    ``cache.semantic.index`` is not ``memory``), else in-process; ``index: pgvector``
    without the extension stops start-up.
    """
    embedder: Embedder | None = None
    pg_index: PgVectorIndex | None = None
    reason = "no semantic group"
    semantic = config.cache.semantic
    if any(m.cache is not None and m.cache.mode == "semantic" for m in config.models):
        if semantic.index == "memory":
            reason = "cache.semantic.index is memory"
        elif pool is None:
            reason = "no database pool"
        else:
            pg_index, reason = await open_pgvector_index(pool, semantic.max_vectors)
        if pg_index is None and semantic.index == "pgvector":
            raise ConfigError(f"cache.semantic.index: pgvector is not usable: {reason}")
        log.info("cache: semantic index %s (%s)", "pgvector" if pg_index is not None else "in-process", reason)
        name = config.cache.semantic.embedder
        if name == "local":
            local = LocalEmbedder()
            await local.warm_up()
            embedder = local
        else:
            target = router.resolve(name).targets[0]
            embedder = DeploymentEmbedder(providers[target.provider], target.upstream_model)
    actor = CacheActor(config.cache, redis_url, pg_index=pg_index, index_reason=reason)
    ref = await supervisor.start(actor)
    return CacheHandle(actor, ref, config, embedder), embedder
