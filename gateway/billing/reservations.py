"""Budget reservations: a call's worst-case cost is held against every budget that applies
before it is sent, and settled to its real cost when it ends (docs/billing.md).

Money here is integer micro-USD (``int``), never a binary float: a price of
``output_per_mtok`` USD per million tokens is exactly that many micro-USD per token, so a
cost is ``tokens * price`` rounded up to the micro-dollar.

Two shared stores, so every replica sees every reservation at once:

* :class:`PostgresReservations` (no ``REDIS_URL``): one call of ``budget_reserve()``
  (sql/0008) per call, and nothing at the end: the ledger's trigger deletes the
  reservation in the transaction that adds the call's real cost to ``budget_spend``.
* :class:`RedisReservations`: one atomic Lua script to reserve, one to settle. Spend of
  each budget period is kept in Redis; a budget Redis has never seen (or has lost) is
  seeded from ``budget_spend`` first.

Both expire a reservation whose process died after ``ttl`` seconds.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone
from decimal import ROUND_CEILING, Decimal
from typing import Any, Protocol

import asyncpg
import orjson

from gateway.core.config import Price

__all__ = [
    "DEFAULT_OUTPUT_CAP",
    "Budget",
    "PostgresReservations",
    "RedisReservations",
    "Reservation",
    "ReservationStore",
    "connect_reservation_pool",
    "keep_session",
    "micro_usd",
    "open_reservations",
    "period_start",
    "prompt_token_bound",
    "worst_case_micro_usd",
]

#: Output tokens reserved for a call that sends no ``max_tokens`` when its model group sets
#: no ``max_output_tokens``.
DEFAULT_OUTPUT_CAP = 4096
#: ``total`` budgets have no period start; this stands for it (PostgreSQL's -infinity).
TOTAL_START = date(1970, 1, 1)
_MICRO = Decimal(1_000_000)


def micro_usd(usd: Decimal | float | int | str) -> int:
    """USD as integer micro-USD, rounded up (a floating figure through its shortest text)."""
    amount = usd if isinstance(usd, Decimal) else Decimal(repr(usd) if isinstance(usd, float) else str(usd))
    if not amount.is_finite() or amount <= 0:
        return 0
    return int((amount * _MICRO).to_integral_value(rounding=ROUND_CEILING))


@functools.lru_cache(maxsize=1024)
def price_micro(per_mtok: float) -> Decimal:
    """Micro-USD per token of a price in USD per million tokens (exactly the same number).

    Remembered: a deployment's prices are few and fixed, and every budgeted call and every
    priced call's cost needs them (a Decimal from a float's text is ~1 µs)."""
    return Decimal(repr(float(per_mtok)))


def cost_micro_usd(prompt_tokens: int, completion_tokens: int, price: Price) -> int:
    """Exact cost of a call at a price table, rounded up to the micro-dollar."""
    cost = prompt_tokens * price_micro(price.input_per_mtok) + completion_tokens * price_micro(price.output_per_mtok)
    return int(cost.to_integral_value(rounding=ROUND_CEILING))


def prompt_token_bound(payload: Any) -> int:
    """An upper bound on the tokens of a prompt: the bytes of its JSON.

    Every token of a byte-level BPE tokenizer covers at least one byte of text, and the
    JSON adds quotes, keys and separators on top, so this never undercounts text. It is
    generous (about four times a real count for English), which is the point: a call is
    refused rather than risk overshooting. Images sent by URL are the known exception.
    """
    return len(orjson.dumps(payload))


def worst_case_micro_usd(prompt_bound: int, output_cap: int, prices: Iterable[Price]) -> int:
    """The most a call may cost on any of the deployments it may reach."""
    return max((cost_micro_usd(prompt_bound, output_cap, p) for p in prices), default=0)


def period_start(period: str, now: datetime | None = None) -> date:
    """The first UTC day of ``period`` containing ``now``."""
    today = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).date()
    if period == "day":
        return today
    if period == "month":
        return today.replace(day=1)
    return TOTAL_START


@dataclass(frozen=True, slots=True)
class Budget:
    """One budget a call is held against: whose, which period, how much (micro-USD)."""

    scope: str  # key | subject
    id: uuid.UUID
    period: str  # day | month | total
    start: date
    limit_micro_usd: int

    @property
    def redis_name(self) -> str:
        return f"{self.scope}:{self.id}:{self.period}:{self.start.isoformat()}"


@dataclass(frozen=True, slots=True)
class Reservation:
    """What was held for one call (its ``call_id``) and against which budgets."""

    reservation_id: uuid.UUID
    amount_micro_usd: int
    budgets: tuple[Budget, ...]


class ReservationStore(Protocol):
    #: Does settling need a call of :meth:`settle` (False: the ledger settles it)?
    settles_explicitly: bool

    async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
        """Hold the reservation against every budget, or none: None if admitted, else
        the index of the first budget it does not fit. Raises when the store is away."""

    async def settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        """Release the reservation and count the call's real cost."""

    async def close(self) -> None:
        """Let go of connections the store opened itself."""


def _sorted(budgets: Sequence[Budget]) -> list[tuple[int, Budget]]:
    """Budgets in one global order (locks are taken in it), with their original index."""
    return sorted(enumerate(budgets), key=lambda ib: (ib[1].scope, str(ib[1].id), ib[1].period))


async def keep_session(conn: asyncpg.Connection) -> None:
    """The pool reset of connections that only ever run one autocommit statement.

    asyncpg's default reset sends ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL`` on every release: a second database round trip per budgeted call (and
    PostgreSQL's CPU, on the gateway's host). A connection that only runs
    ``budget_reserve()`` never holds a session lock, a cursor, a LISTEN or a setting
    (its advisory locks are transaction-scoped), so there is nothing to reset; asyncpg
    still rolls back an open transaction client-side before calling this.
    """


async def connect_reservation_pool(dsn: str, *, max_size: int = 10) -> asyncpg.Pool:
    """The pool budget reservations use on the hot path (see :func:`keep_session`)."""
    # min_size 0: a gateway without budgets never opens one of these connections.
    pool = await asyncpg.create_pool(dsn, min_size=0, max_size=max_size, reset=keep_session, command_timeout=30)
    assert pool is not None
    return pool


class PostgresReservations:
    """Reservations in ``budget_reservations``; settled by the ledger's trigger.

    ``own_pool`` (closed with the store) serves the reservations themselves: a pool whose
    connections skip the reset query on release (:func:`keep_session`), so a budgeted call
    costs one round trip, not two. Without it the shared ``pool`` is used.
    """

    settles_explicitly = False

    def __init__(self, pool: asyncpg.Pool, *, own_pool: asyncpg.Pool | None = None) -> None:
        self._pool = pool
        self._own_pool = own_pool

    async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
        order = _sorted(reservation.budgets)
        refused = await (self._own_pool or self._pool).fetchval(
            "SELECT budget_reserve($1, $2, $3, $4, $5, $6, $7, $8)",
            reservation.reservation_id,
            [b.scope for _, b in order], [b.id for _, b in order], [b.period for _, b in order],
            [b.start for _, b in order], [b.limit_micro_usd for _, b in order],
            reservation.amount_micro_usd, ttl,
        )
        return None if not refused else order[int(refused) - 1][0]

    async def settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        """Nothing to do: the call's ledger row releases it (see sql/0008)."""

    async def close(self) -> None:
        """Close the store's own pool (the shared one is the gateway's)."""
        if self._own_pool is not None:
            own, self._own_pool = self._own_pool, None
            await own.close()


# KEYS: one hash per budget (field "spent", fields "r:<id>" = reserved micro-USD) and one
# sorted set of reservation expiries per budget, interleaved: h1, z1, h2, z2, ...
# ARGV: reservation id, amount, ttl ms, key ttl seconds (0: none) per budget..., limits...
# Returns {1} admitted, {0, i} budget i (1-based) full, {-1, i} budget i not seeded.
_RESERVE_LUA = """
local n = #KEYS / 2
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, amount, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, n do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  local spent = redis.call('HGET', h, 'spent')
  if not spent then return {-1, i} end
  local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  for _, r in ipairs(expired) do redis.call('HDEL', h, 'r:' .. r) end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', now) end
  local used = tonumber(spent)
  local all = redis.call('HGETALL', h)
  for j = 1, #all, 2 do
    if string.sub(all[j], 1, 2) == 'r:' then used = used + tonumber(all[j + 1]) end
  end
  if used + amount > tonumber(ARGV[3 + n + i]) then return {0, i} end
end
for i = 1, n do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  redis.call('HSET', h, 'r:' .. id, amount)
  redis.call('ZADD', z, now + ttl, id)
  local keep = tonumber(ARGV[3 + i])
  if keep > 0 then redis.call('EXPIRE', h, keep); redis.call('EXPIRE', z, keep) end
end
return {1}
"""

# KEYS as above; ARGV: reservation id, cost. The cost counts even if the reservation
# expired meanwhile (a call longer than the TTL still spent it); a budget Redis lost is
# seeded from the ledger later, which will hold this call by then.
_SETTLE_LUA = """
local n = #KEYS / 2
for i = 1, n do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  redis.call('ZREM', z, ARGV[1])
  redis.call('HDEL', h, 'r:' .. ARGV[1])
  if redis.call('HEXISTS', h, 'spent') == 1 then
    redis.call('HINCRBY', h, 'spent', ARGV[2])
  end
end
return 1
"""

#: How long Redis keeps a period's spend after the period began (then it is only history).
_KEEP_SECONDS = {"day": 2 * 86400, "month": 33 * 86400, "total": 0}


class RedisReservations:
    """Reservations and period spend in Redis, two atomic scripts per call."""

    settles_explicitly = True

    def __init__(self, redis: Any, pool: asyncpg.Pool, *, prefix: str = "llmg:budget") -> None:
        self._redis = redis
        self._pool = pool
        self._prefix = prefix
        self._reserve = redis.register_script(_RESERVE_LUA)
        self._settle = redis.register_script(_SETTLE_LUA)

    def _keys(self, budgets: Sequence[Budget]) -> list[str]:
        keys: list[str] = []
        for b in budgets:
            keys += [f"{self._prefix}:{b.redis_name}", f"{self._prefix}:{b.redis_name}:exp"]
        return keys

    async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
        budgets = reservation.budgets
        args = [
            str(reservation.reservation_id), reservation.amount_micro_usd, int(ttl * 1000),
            *(_KEEP_SECONDS[b.period] for b in budgets), *(b.limit_micro_usd for b in budgets),
        ]
        for _attempt in range(3):
            result = await self._reserve(keys=self._keys(budgets), args=args)
            status = int(result[0])
            if status == 1:
                return None
            index = int(result[1]) - 1
            if status == 0:
                return index
            await self._seed(budgets[index])
        raise RuntimeError("budget spend could not be seeded in Redis")

    async def _seed(self, budget: Budget) -> None:
        """A budget Redis has not seen: its spend so far, from the ledger's budget_spend."""
        spent = await self._pool.fetchval(
            """SELECT coalesce(ceil(cost_usd * 1000000), 0)::bigint FROM budget_spend
            WHERE scope = $1 AND id = $2 AND period = $3
              AND period_start = CASE $3 WHEN 'total' THEN DATE '-infinity' ELSE $4::date END""",
            budget.scope, budget.id, budget.period, budget.start,
        )
        await self._redis.hsetnx(f"{self._prefix}:{budget.redis_name}", "spent", int(spent or 0))

    async def settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        await self._settle(
            keys=self._keys(reservation.budgets), args=[str(reservation.reservation_id), cost_micro_usd]
        )

    async def close(self) -> None:
        await self._redis.aclose()


def open_reservations(
    redis_url: str | None, pool: asyncpg.Pool, *, key_prefix: str, reservation_pool: asyncpg.Pool | None = None
) -> ReservationStore:
    """Redis when ``REDIS_URL`` is set, else PostgreSQL (docs/billing.md); ``reservation_pool``
    (from :func:`connect_reservation_pool`) is the PostgreSQL store's own, closed with it."""
    if not redis_url:
        return PostgresReservations(pool, own_pool=reservation_pool)
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # Fail fast, never retry by itself: an unreachable Redis is answered 503 at once.
    client = aioredis.Redis.from_url(
        redis_url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
    )
    return RedisReservations(client, pool, prefix=f"{key_prefix}:budget")


def budgets_of(
    key_id: uuid.UUID,
    key_budget: tuple[Decimal, str] | None,
    subject_id: uuid.UUID,
    subject_budget: tuple[Decimal | float, str] | None,
    now: datetime | None = None,
) -> tuple[Budget, ...]:
    """Every budget a call of this key is held against (key's, then subject's)."""
    budgets: list[Budget] = []
    for scope, owner, budget in (("key", key_id, key_budget), ("subject", subject_id, subject_budget)):
        if budget is not None:
            amount, period = budget
            limit = micro_usd(amount) if not isinstance(amount, float) else micro_usd(Decimal(repr(amount)))
            budgets.append(Budget(scope, owner, period, period_start(period, now), limit))
    return tuple(budgets)


def output_cap(body: Mapping[str, Any], group_cap: int | None) -> int:
    """Output tokens the call may produce: what it asks for, else the group's cap."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return group_cap or DEFAULT_OUTPUT_CAP


def is_finite_price(price: Price | None) -> bool:
    return price is not None and math.isfinite(price.input_per_mtok) and math.isfinite(price.output_per_mtok)
