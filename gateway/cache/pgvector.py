"""The semantic cache's vector index in PostgreSQL with pgvector, shared by every replica.

Used when the gateway's database can load the ``vector`` extension (the embedded server
ships it; ``cache.semantic.index: auto``). One table, ``semantic_vectors``, holds per
stored answer its hard partition (:func:`gateway.cache.semantic.partition_of`), its final
message's embedding and :class:`gateway.cache.semantic.Guard`, who may be served it (group,
scope, subject), the encoded answer itself and its expiry. Since the answer is in the
row, a replica finds another replica's answer by meaning without Redis.

Search is exact within one partition (``WHERE partition = $1 ORDER BY embedding <=> $2``
over a btree on the partition): a partition is one conversation prefix and parameter set,
kept small by :data:`MAX_PER_PARTITION`, so no approximate index (and no fixed
dimension) is needed, and a deployment embedder of any dimension works. Similarity is
``1 - cosine distance``, the same number the in-process index computes.

The table and extension are created here at start, not by a migration: a migration runs
once, and cannot assume the extension exists. Everything that touches the database is a
coroutine: the cache actor runs writes and sweeps as spawned tasks, the request path
awaits :meth:`PgVectorIndex.search` under its own deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson

from gateway.cache.semantic import TOP_CANDIDATES, Guard, Match

__all__ = ["MAX_PER_PARTITION", "PgVectorIndex", "PgVectorRow", "open_pgvector_index", "vector_literal"]

log = logging.getLogger("gateway.cache")

#: Rows one partition keeps at most (newest kept): bounds the exact scan of one search.
MAX_PER_PARTITION = 1000
#: Serialises the CREATE EXTENSION / CREATE TABLE of replicas starting together.
_SETUP_LOCK = 0x6C6C_6D67_7665_6300  # "llmgvec\0"

_SETUP = """
CREATE EXTENSION IF NOT EXISTS vector;
CREATE TABLE IF NOT EXISTS semantic_vectors (
    partition   text        NOT NULL,
    key         text        NOT NULL,
    model_group text        NOT NULL,
    scope       text        NOT NULL,
    subject     text        NOT NULL,
    guard       jsonb       NOT NULL,
    embedding   vector      NOT NULL,
    entry       bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (partition, key)
);
CREATE INDEX IF NOT EXISTS semantic_vectors_key ON semantic_vectors (key);
CREATE INDEX IF NOT EXISTS semantic_vectors_expires ON semantic_vectors (expires_at);
CREATE INDEX IF NOT EXISTS semantic_vectors_created ON semantic_vectors (created_at);
CREATE INDEX IF NOT EXISTS semantic_vectors_subject ON semantic_vectors (subject);
CREATE INDEX IF NOT EXISTS semantic_vectors_group ON semantic_vectors (model_group);
"""

_INSERT = """
INSERT INTO semantic_vectors
    (partition, key, model_group, scope, subject, guard, embedding, entry, expires_at)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7::text::vector, $8, to_timestamp($9))
ON CONFLICT (partition, key) DO UPDATE SET
    guard = EXCLUDED.guard, embedding = EXCLUDED.embedding, entry = EXCLUDED.entry,
    created_at = now(), expires_at = EXCLUDED.expires_at
"""

_TRIM_PARTITION = """
DELETE FROM semantic_vectors WHERE partition = $1 AND key IN (
    SELECT key FROM semantic_vectors WHERE partition = $1 ORDER BY created_at DESC OFFSET $2)
"""

# The query vector is parsed once (in the CTE): a cast of a parameter in the select list
# is evaluated per row under a generic plan, which made a 1000-row search ~50 ms.
_SEARCH = f"""
WITH q AS MATERIALIZED (SELECT $2::text::vector AS v)
SELECT key, guard::text AS guard, 1 - (embedding <=> q.v) AS similarity
FROM semantic_vectors, q
WHERE partition = $1 AND expires_at > now()
ORDER BY embedding <=> q.v
LIMIT {TOP_CANDIDATES}
"""


def vector_literal(vector: Any) -> str:
    """pgvector's text form of a vector: ``[0.1,0.2,...]`` (no codec to register)."""
    return "[" + ",".join(format(float(v), ".8g") for v in vector) + "]"


@dataclass(frozen=True, slots=True)
class PgVectorRow:
    """One answer's vector, as the cache actor hands it to :meth:`PgVectorIndex.insert`."""

    partition: str
    key: str
    group: str
    scope: str
    subject: str
    guard: Guard
    vector: Any
    entry: bytes
    expires_at: float  # unix seconds


class PgVectorIndex:
    """Search, store, expire and purge vectors in ``semantic_vectors``.

    Holds only the pool; the cache actor decides when each call runs.
    """

    kind = "pgvector"

    def __init__(self, pool: asyncpg.Pool, max_vectors: int) -> None:
        self._pool = pool
        self.max_vectors = max_vectors

    async def search(
        self, partition: str, vector: Any, guard: Guard, threshold: float, *, timeout: float | None = None
    ) -> tuple[Match | None, float]:
        """The best stored prompt of ``partition`` passing threshold and guards, and the best score seen."""
        rows = await self._pool.fetch(_SEARCH, partition, vector_literal(vector), timeout=timeout)
        if not rows:
            return None, 0.0
        best_seen = float(rows[0]["similarity"])
        for row in rows:
            score = float(row["similarity"])
            if score < threshold:
                break
            if guard.agrees(Guard.from_json(orjson.loads(row["guard"]))):
                return Match(row["key"], min(score, 1.0)), best_seen
        return None, best_seen

    async def entry(self, partition: str, key: str, *, timeout: float | None = None) -> bytes | None:
        """The encoded answer stored with a vector (for a replica that never saw it)."""
        raw = await self._pool.fetchval(
            "SELECT entry FROM semantic_vectors WHERE partition = $1 AND key = $2 AND expires_at > now()",
            partition, key, timeout=timeout,
        )
        return bytes(raw) if raw is not None else None

    async def insert(self, rows: Sequence[PgVectorRow]) -> None:
        """Store ``rows`` in one transaction, then trim their partitions to the per-partition cap."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.executemany(_INSERT, [
                (r.partition, r.key, r.group, r.scope, r.subject, orjson.dumps(r.guard.to_json()).decode(),
                 vector_literal(r.vector), r.entry, r.expires_at)
                for r in rows
            ])
            for partition in {r.partition for r in rows}:
                await conn.execute(_TRIM_PARTITION, partition, MAX_PER_PARTITION)

    async def sweep(self) -> int:
        """Delete expired rows and the oldest past ``max_vectors``; return the rows left."""
        async with self._pool.acquire() as conn:
            await conn.execute("DELETE FROM semantic_vectors WHERE expires_at <= now()")
            count = int(await conn.fetchval("SELECT count(*) FROM semantic_vectors"))
            if count > self.max_vectors:
                status = await conn.execute(
                    "DELETE FROM semantic_vectors WHERE ctid IN"
                    " (SELECT ctid FROM semantic_vectors ORDER BY created_at DESC OFFSET $1)",
                    self.max_vectors,
                )
                count -= int(status.split()[-1])
            return count

    async def purge(
        self, *, keys: Sequence[str] = (), subject: str | None = None, group: str | None = None,
        everything: bool = False,
    ) -> int:
        """Forget vectors by key, by subject and/or group, or all; returns rows deleted."""
        if everything:
            status = await self._pool.execute("DELETE FROM semantic_vectors")
        elif keys:
            status = await self._pool.execute("DELETE FROM semantic_vectors WHERE key = ANY($1::text[])", list(keys))
        elif subject is not None or group is not None:
            status = await self._pool.execute(
                "DELETE FROM semantic_vectors WHERE ($1::text IS NULL OR subject = $1)"
                " AND ($2::text IS NULL OR model_group = $2)",
                subject, group,
            )
        else:
            return 0
        return int(status.split()[-1])


async def open_pgvector_index(pool: asyncpg.Pool, max_vectors: int) -> tuple[PgVectorIndex | None, str]:
    """The pgvector index when the database can have it, else None; and why, for the operator.

    Creates the extension and the table when missing (idempotent; an advisory lock keeps
    replicas starting together from racing). A database without the extension, or a role
    that may not create it, is not an error: the cache falls back to the in-process index.
    """
    try:
        async with pool.acquire() as conn:
            available = await conn.fetchval("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")
            if not available:
                return None, "the database has no pgvector extension"
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _SETUP_LOCK)
                await conn.execute(_SETUP)
    except (asyncpg.PostgresError, OSError) as exc:
        log.warning("cache: pgvector is available but could not be set up (%s); using the in-process index", exc)
        return None, f"pgvector set-up failed: {exc}"
    return PgVectorIndex(pool, max_vectors), "the database has the pgvector extension"
