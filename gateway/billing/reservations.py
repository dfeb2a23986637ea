"""Budget reservations: a call's worst-case cost is held against every budget that applies
before it is sent, and settled to its real cost when it ends (docs/billing.md).

Money here is integer micro-USD (``int``), never a binary float: a price of
``output_per_mtok`` USD per million tokens is exactly that many micro-USD per token, so a
cost is ``tokens * price`` rounded up to the micro-dollar.

Two shared stores, so every replica sees every reservation at once:

* :class:`PostgresReservations` (no ``REDIS_URL``): one call of ``budget_reserve_batch()``
  (sql/0016) per round trip, and nothing at the end: the ledger's trigger deletes the
  reservation in the transaction that adds the call's real cost to ``budget_spend``.
* :class:`RedisReservations`: one atomic Lua script per round trip to reserve, one to
  settle. Spend of each budget period is kept in Redis; a budget Redis has never seen
  (or has lost) is seeded from ``budget_spend`` first.

In both, the reservations (and Redis settlements) a process makes while its previous
round trip is in flight go together in the next one (:mod:`gateway.billing.coalesce`),
admitted in arrival order exactly as one by one: a burst of one key's calls costs a few
round trips, not one each queued behind the budget's lock.

Both expire a reservation whose process died after ``ttl`` seconds.

(Just over 500 lines: the arithmetic, both stores and the Redis scripts stay together so
that the one admission rule reads in one place; the generic batching is its own module.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import uuid
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from decimal import ROUND_CEILING, Decimal
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg
import orjson

from gateway.billing.coalesce import Coalescer
from gateway.core.config import Price

if TYPE_CHECKING:
    from gateway.billing.leases import Lease

__all__ = [
    "DEFAULT_OUTPUT_CAP",
    "Budget",
    "PostgresReservations",
    "RedisReservations",
    "Reservation",
    "ReservationStore",
    "connect_reservation_pool",
    "exact_micro_cost",
    "exact_micro_numerator",
    "exact_rates",
    "keep_session",
    "micro_usd",
    "open_reservations",
    "period_start",
    "prompt_token_bound",
    "worst_case_micro_usd",
]

log = logging.getLogger("gateway.billing")

#: Reservations (or settlements) sent in one round trip at most; more wait for the next.
MAX_BATCH = 256
#: Longest one round trip to the store may take before every call it carries is failed
#: (and answered 503 by the gate: fail closed).
ROUND_TRIP_TIMEOUT = 2.0
#: Output tokens reserved for a call that sends no ``max_tokens`` when its model group sets
#: no ``max_output_tokens``.
DEFAULT_OUTPUT_CAP = 4096
#: ``total`` budgets have no period start; this stands for it (PostgreSQL's -infinity).
TOTAL_START = date(1970, 1, 1)
_MICRO = Decimal(1_000_000)


#: Floats below this many USD take :func:`_float_micro_usd`'s route (their micro-USD stay
#: well below 10**15, where its argument holds); others take the Decimal's.
_FLOAT_ROUTE_BELOW = 1e8
#: Decimal's default precision, 28 digits (nothing in the gateway changes the context):
#: a sum whose integer coefficient is below this the Decimal arithmetic gets exactly, so
#: integer arithmetic on the same coefficients gives the same figure.
_DECIMAL_EXACT_BELOW = 10**28


def micro_usd(usd: Decimal | float | int | str) -> int:
    """USD as integer micro-USD, rounded up (a floating figure through its shortest text)."""
    if type(usd) is float and 0.0 < usd < _FLOAT_ROUTE_BELOW:
        return _float_micro_usd(usd)
    amount = usd if isinstance(usd, Decimal) else Decimal(repr(usd) if isinstance(usd, float) else str(usd))
    if not amount.is_finite() or amount <= 0:
        return 0
    return int((amount * _MICRO).to_integral_value(rounding=ROUND_CEILING))


def _float_micro_usd(usd: float) -> int:
    """:func:`micro_usd` of a float in (0, 1e8) without Decimal: the same integer, ~5x cheaper.

    The answer is the least integer ``m`` with ``m / 10**6 >= t``, ``t`` the float's shortest
    text. For ``m`` below 10**15 that decimal has at most 15 significant digits, and two such
    decimals never round to the same float (``DBL_DIG``), so ``m / 10**6 >= t`` exactly when
    the float nearest ``m / 10**6`` is ``>= usd`` (rounding is monotonic, and a tie means
    ``t`` is that decimal). That float is ``m / 1e6`` (``m`` and 1e6 exact, the division
    correctly rounded). ``ceil(usd * 1e6)`` is within one of the answer; the loops settle it.
    """
    micro = math.ceil(usd * 1e6)
    while (micro - 1) / 1e6 >= usd:
        micro -= 1
    while micro / 1e6 < usd:
        micro += 1
    return micro


@functools.lru_cache(maxsize=1024)
def price_micro(per_mtok: float) -> Decimal:
    """Micro-USD per token of a price in USD per million tokens (exactly the same number).

    Remembered: a deployment's prices are few and fixed, and every budgeted call and every
    priced call's cost needs them (a Decimal from a float's text is ~1 µs)."""
    return Decimal(repr(float(per_mtok)))


@functools.lru_cache(maxsize=1024)
def _per_token_micro(input_per_mtok: float, output_per_mtok: float) -> tuple[int, int, int] | None:
    """A price table's micro-USD per input and per output token as integers over one divisor,
    ``(input, output, divisor)``: a call's cost is then exactly
    ``(prompt_tokens * input + completion_tokens * output) / divisor`` micro-USD, the figure
    the Decimal arithmetic of :func:`price_micro` gets while it is exact. None for a price
    that is not a finite, unsigned number, or is 1e16 USD or more (its text has no decimal
    point): the Decimal arithmetic alone decides those.

    Remembered, like :func:`price_micro`: a few Decimal operations once per price, not per call.
    """
    prices = (price_micro(input_per_mtok), price_micro(output_per_mtok))
    if not all(p.is_finite() and not p.is_signed() for p in prices):
        return None
    # The Decimal sum's coefficient sits at the smaller of the two exponents.
    exponent = min(int(p.as_tuple().exponent) for p in prices)
    if exponent >= 0:
        return None
    per_input, per_output = (int(p.scaleb(-exponent)) for p in prices)
    return per_input, per_output, 10**-exponent


def exact_micro_cost(prompt_tokens: int, completion_tokens: int, price: Price) -> tuple[int, int] | None:
    """A call's cost at a price table as an exact fraction of micro-USD, ``(numerator,
    divisor)``, in integers: what the Decimal arithmetic (:func:`price_micro`) gives, where
    it is exact. None where it might round (28 digits and beyond: token counts no call
    reaches), or for a count or price that is not a plain non-negative number: the caller
    then takes the Decimal route, so the figure is the same either way."""
    rate = _per_token_micro(price.input_per_mtok, price.output_per_mtok)
    if rate is None:
        return None
    numerator = exact_micro_numerator(prompt_tokens, completion_tokens, rate)
    return None if numerator is None else (numerator, rate[2])


def exact_micro_numerator(prompt_tokens: int, completion_tokens: int, rate: tuple[int, int, int]) -> int | None:
    """:func:`exact_micro_cost`'s numerator at a price's integer ``rate`` (its
    :func:`exact_rates` entry: per input token, per output token, divisor); None where the
    Decimal arithmetic might round, or for a count that is not a plain non-negative number.
    The one home of that rule, for callers that keep a price's rate."""
    per_input, per_output, _ = rate
    numerator = prompt_tokens * per_input + completion_tokens * per_output
    # Each product and their sum is a Decimal operation rounded to 28 digits; with both counts
    # >= 0 neither product's coefficient exceeds the sum's, so a sum below 10**28 is all exact.
    if type(numerator) is not int or numerator >= _DECIMAL_EXACT_BELOW or prompt_tokens < 0 or completion_tokens < 0:
        return None
    return numerator


def cost_micro_usd(prompt_tokens: int, completion_tokens: int, price: Price) -> int:
    """Exact cost of a call at a price table, rounded up to the micro-dollar."""
    exact = exact_micro_cost(prompt_tokens, completion_tokens, price)
    if exact is not None:
        numerator, divisor = exact
        return -(-numerator // divisor)
    cost = prompt_tokens * price_micro(price.input_per_mtok) + completion_tokens * price_micro(price.output_per_mtok)
    return int(cost.to_integral_value(rounding=ROUND_CEILING))


def exact_rates(prices: Sequence[Price | None]) -> tuple[tuple[int, int, int], ...] | None:
    """Every price's micro-USD per input and per output token as integers over one divisor
    (:func:`_per_token_micro`), for a caller that prices many calls at the same prices (a
    route's): None unless there is a price and every one is a finite, unsigned number
    of fewer than 16 digits before its point, so that :meth:`BudgetGate.hold
    <gateway.billing.gate.BudgetGate.hold>` may take the rates for the prices' own check
    and :func:`worst_case_micro_usd`."""
    rates = []
    for price in prices:
        if price is None or not is_finite_price(price):
            return None
        per_token = _per_token_micro(price.input_per_mtok, price.output_per_mtok)
        if per_token is None:
            return None
        rates.append(per_token)
    return tuple(rates) if rates else None


def prompt_token_bound(payload: Any) -> int:
    """An upper bound on the tokens of a prompt: the bytes of its JSON.

    Every token of a byte-level BPE tokenizer covers at least one byte of text, and the
    JSON adds quotes, keys and separators on top, so this never undercounts text. It is
    generous (about four times a real count for English), which is the point: a call is
    refused rather than risk overshooting. Images sent by URL are the known exception.
    """
    return len(orjson.dumps(payload))


def worst_case_micro_usd(prompt_bound: int, output_cap: int, prices: Iterable[Price]) -> int:
    """The most a call may cost on any of the deployments it may reach (0: none)."""
    worst: int | None = None
    for price in prices:  # a loop, not max() over a generator: most calls have one price
        cost = cost_micro_usd(prompt_bound, output_cap, price)
        if worst is None or cost > worst:
            worst = cost
    return 0 if worst is None else worst


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
    #: The hash of the fields, once: a call's budgets key this process's leases, and the
    #: generated ``__hash__`` (a tuple of five, the UUID's own ``__hash__`` in Python) was
    #: most of each lookup. Same value as the generated one; not compared, not shown.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.scope, self.id, self.period, self.start, self.limit_micro_usd)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Budget], tuple[str, uuid.UUID, str, date, int]]:
        # Rebuilt (and so hashed again) when unpickled or copied: a str's hash is per process.
        return Budget, (self.scope, self.id, self.period, self.start, self.limit_micro_usd)

    @property
    def redis_name(self) -> str:
        return f"{self.scope}:{self.id}:{self.period}:{self.start.isoformat()}"


@dataclass(frozen=True, slots=True, init=False)
class Reservation:
    """What was held for one call (its ``call_id``) and against which budgets; or a
    lease's own reservation (gateway/billing/leases.py)."""

    reservation_id: uuid.UUID
    amount_micro_usd: int
    budgets: tuple[Budget, ...]
    #: The lease this call's hold was drawn from (no reservation of its own in the store).
    lease: Lease | None = None

    def __init__(
        self, reservation_id: uuid.UUID, amount_micro_usd: int, budgets: tuple[Budget, ...], lease: Lease | None = None,
    ) -> None:
        # The generated frozen __init__, by the slots' own setters (one made per call
        # admitted from a lease: ~0.2 us less than object.__setattr__ looked up per field).
        set_id, set_amount, set_budgets, set_lease = _RESERVATION_SETTERS
        set_id(self, reservation_id)
        set_amount(self, amount_micro_usd)
        set_budgets(self, budgets)
        set_lease(self, lease)


_RESERVATION_SETTERS: tuple[Any, ...] = tuple(
    getattr(Reservation, name).__set__ for name in ("reservation_id", "amount_micro_usd", "budgets", "lease")
)


class ReservationStore(Protocol):
    #: Does settling need a call of :meth:`settle` (False: the ledger settles it)?
    settles_explicitly: bool

    async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
        """Hold the reservation against every budget, or none: None if admitted, else
        the index of the first budget it does not fit. Raises when the store is away."""

    async def settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        """Release the reservation and count the call's real cost."""

    async def resize(self, lease: Reservation, amount_micro_usd: int) -> None:
        """Hold ``amount_micro_usd`` for a lease from now on (what its calls still need)."""

    async def release_lease(self, lease: Reservation, spent_micro_usd: int, costly_calls: Sequence[uuid.UUID]) -> bool:
        """A lease whose calls have all ended, at ``spent_micro_usd`` in all: release it.
        False when it must wait (PostgreSQL: a call in ``costly_calls`` is not in the
        ledger yet, so the lease keeps holding what they spent; asked again later)."""

    async def close(self) -> None:
        """Let go of connections the store opened itself."""


class _Plan:
    """A batch of reservations laid out for one round trip: the distinct budgets it touches,
    in the one global order locks are taken in (so replicas never deadlock), and for each
    call the index of each of its budgets (in the call's own order) among them."""

    __slots__ = ("budgets", "pair_budgets", "pair_calls", "pair_limits", "slots")

    def __init__(self, reservations: Sequence[Reservation]) -> None:
        # A budget is who, which period and since when; never its limit: a limit changed
        # between two calls of one batch is still the one budget, counted once.
        distinct: dict[tuple[str, uuid.UUID, str, date], Budget] = {}
        for reservation in reservations:
            for b in reservation.budgets:
                distinct.setdefault((b.scope, b.id, b.period, b.start), b)
        self.budgets = sorted(distinct.values(), key=lambda b: (b.scope, str(b.id), b.period, b.start))
        index = {(b.scope, b.id, b.period, b.start): i for i, b in enumerate(self.budgets)}
        self.slots = [[index[(b.scope, b.id, b.period, b.start)] for b in r.budgets] for r in reservations]
        #: Per (call, budget) pair, grouped by call: 1-based call and budget, and the limit.
        self.pair_calls = [call + 1 for call, slots in enumerate(self.slots) for _ in slots]
        self.pair_budgets = [slot + 1 for slots in self.slots for slot in slots]
        self.pair_limits = [b.limit_micro_usd for r in reservations for b in r.budgets]


class _Releases:
    """Best-effort releases running in the background (the TTL is their backstop)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, release: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(self._quietly(release))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _quietly(release: Coroutine[Any, Any, None]) -> None:
        try:
            await release
        except Exception as exc:  # noqa: BLE001 - the reservation expires by itself
            log.warning("billing: could not release a reservation of a call that was not sent (%s: %s); "
                        "it expires by itself", type(exc).__name__, exc)

    async def wait(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=ROUND_TRIP_TIMEOUT + 1)


async def keep_session(conn: asyncpg.Connection) -> None:
    """The pool reset of connections that only ever run one autocommit statement.

    asyncpg's default reset sends ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL`` on every release: a second database round trip per budgeted call (and
    PostgreSQL's CPU, on the gateway's host). A connection that only runs
    ``budget_reserve_batch()`` and the release of reservations never holds a session lock,
    a cursor, a LISTEN or a setting (its advisory locks are transaction-scoped), so there
    is nothing to reset; asyncpg still rolls back an open transaction client-side before
    calling this.
    """


async def connect_reservation_pool(dsn: str, *, max_size: int = 10) -> asyncpg.Pool:
    """The pool budget reservations use on the hot path (see :func:`keep_session`)."""
    # min_size 0: a gateway without budgets never opens one of these connections.
    pool = await asyncpg.create_pool(dsn, min_size=0, max_size=max_size, reset=keep_session, command_timeout=30)
    assert pool is not None
    return pool


class PostgresReservations:
    """Reservations in ``budget_reservations``; settled by the ledger's trigger.

    Reservations arriving while one round trip is in flight go together in the next, as
    one call of ``budget_reserve_batch()`` (sql/0016, see :mod:`gateway.billing.coalesce`).

    ``own_pool`` (closed with the store) serves the reservations themselves: a pool whose
    connections skip the reset query on release (:func:`keep_session`), so a round trip
    is one round trip, not two. Without it the shared ``pool`` is used.
    """

    settles_explicitly = False

    def __init__(self, pool: asyncpg.Pool, *, own_pool: asyncpg.Pool | None = None, max_batch: int = MAX_BATCH) -> None:
        self._pool = pool
        self._own_pool = own_pool
        self.batcher: Coalescer[tuple[Reservation, float], int] = Coalescer(
            self._round_trip, max_batch=max_batch, timeout=ROUND_TRIP_TIMEOUT, lost=self._release_lost,
            name="PostgreSQL budget store",
        )
        self._releases = _Releases()

    async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
        refused = await self.batcher.submit((reservation, ttl))
        return None if refused == 0 else refused - 1

    async def _round_trip(self, items: list[tuple[Reservation, float]]) -> list[int]:
        plan = _Plan([r for r, _ in items])
        answers = await (self._own_pool or self._pool).fetchval(
            "SELECT budget_reserve_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            [r.reservation_id for r, _ in items], [r.amount_micro_usd for r, _ in items], [ttl for _, ttl in items],
            [b.scope for b in plan.budgets], [b.id for b in plan.budgets], [b.period for b in plan.budgets],
            [b.start for b in plan.budgets], plan.pair_calls, plan.pair_budgets, plan.pair_limits,
        )
        return [int(a) for a in answers]

    def _release_lost(self, lost: list[tuple[tuple[Reservation, float], int | None]]) -> None:
        """Reservations admitted (or perhaps admitted) for calls that will not be sent."""
        ids = [item[0].reservation_id for item, answer in lost if answer is None or answer == 0]
        if ids:
            self._releases.start(self._release(ids))

    async def _release(self, ids: list[uuid.UUID]) -> None:
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT):
            await (self._own_pool or self._pool).execute(
                "DELETE FROM budget_reservations WHERE reservation_id = ANY($1::uuid[])", ids)

    async def settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        """Nothing to do: the call's ledger row releases it (see sql/0010)."""

    async def resize(self, lease: Reservation, amount_micro_usd: int) -> None:
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT):
            await (self._own_pool or self._pool).execute(
                "UPDATE budget_reservations SET amount_micro_usd = $2 WHERE reservation_id = $1",
                lease.reservation_id, amount_micro_usd)

    async def release_lease(self, lease: Reservation, spent_micro_usd: int, costly_calls: Sequence[uuid.UUID]) -> bool:
        """Delete the lease once every call of it that cost something is in the ledger (its
        trigger has added the cost to budget_spend); until then hold just what they spent.
        One statement: the check and the delete see one snapshot."""
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT):
            missing = await (self._own_pool or self._pool).fetchval(_RELEASE_LEASE_SQL, lease.reservation_id,
                                                                    list(costly_calls), spent_micro_usd)
        return int(missing) == 0

    async def close(self) -> None:
        """Close the store's own pool (the shared one is the gateway's)."""
        await self.batcher.close()
        await self._releases.wait()
        if self._own_pool is not None:
            own, self._own_pool = self._own_pool, None
            await own.close()


# $1 the lease, $2 the calls of it that cost something, $3 what they spent (micro-USD).
_RELEASE_LEASE_SQL = """
WITH missing AS (
  SELECT count(*) AS calls FROM unnest($2::uuid[]) AS c(call_id)
  WHERE NOT EXISTS (SELECT 1 FROM usage_ledger l WHERE l.call_id = c.call_id)
), released AS (
  DELETE FROM budget_reservations WHERE reservation_id = $1 AND (SELECT calls FROM missing) = 0
), kept AS (
  UPDATE budget_reservations SET amount_micro_usd = $3 WHERE reservation_id = $1 AND (SELECT calls FROM missing) > 0
)
SELECT calls FROM missing
"""

# KEYS: one hash per budget (field "spent", fields "r:<id>" = reserved micro-USD) and one
# sorted set of reservation expiries per budget, interleaved: h1, z1, h2, z2, ...
# ARGV: the number of calls, then per budget its key TTL in seconds (0: none), then per
# call (in arrival order): id, amount, TTL ms, its budget count k, then k pairs of
# (budget index, limit). Every budget's open reservations are summed once; the calls are
# then admitted in order, each against all its budgets or none, exactly as one script per
# call would. Returns {1, answer per call} (0 admitted, else the 1-based position of the
# first of its budgets that is full), or {-1, budget index...} when budgets are not seeded
# (nothing admitted then).
_RESERVE_LUA = """
local n = #KEYS / 2
local unseeded = {-1}
for i = 1, n do
  if redis.call('HEXISTS', KEYS[2 * i - 1], 'spent') == 0 then unseeded[#unseeded + 1] = i end
end
if #unseeded > 1 then return unseeded end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local used, touched = {}, {}
for i = 1, n do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  for _, r in ipairs(expired) do redis.call('HDEL', h, 'r:' .. r) end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', now) end
  local all = redis.call('HGETALL', h)
  local sum = 0
  for j = 1, #all, 2 do
    if all[j] == 'spent' or string.sub(all[j], 1, 2) == 'r:' then sum = sum + tonumber(all[j + 1]) end
  end
  used[i] = sum
end
local calls = tonumber(ARGV[1])
local answers = {1}
local p = n + 2
for c = 1, calls do
  local id, amount, ttl, k = ARGV[p], tonumber(ARGV[p + 1]), tonumber(ARGV[p + 2]), tonumber(ARGV[p + 3])
  local refused = 0
  for j = 1, k do
    local b = tonumber(ARGV[p + 2 + 2 * j])
    if refused == 0 and used[b] + amount > tonumber(ARGV[p + 3 + 2 * j]) then refused = j end
  end
  if refused == 0 then
    for j = 1, k do
      local b = tonumber(ARGV[p + 2 + 2 * j])
      used[b] = used[b] + amount
      touched[b] = true
      redis.call('HSET', KEYS[2 * b - 1], 'r:' .. id, amount)
      redis.call('ZADD', KEYS[2 * b], now + ttl, id)
    end
  end
  answers[#answers + 1] = refused
  p = p + 4 + 2 * k
end
for i = 1, n do
  local keep = tonumber(ARGV[1 + i])
  if touched[i] and keep > 0 then redis.call('EXPIRE', KEYS[2 * i - 1], keep); redis.call('EXPIRE', KEYS[2 * i], keep) end
end
return answers
"""

# KEYS as above; ARGV: the number of settlements, then per settlement: reservation id,
# cost, its budget count k, then k budget indices. The cost counts even if the
# reservation expired meanwhile (a call longer than the TTL still spent it); a budget
# Redis lost is seeded from the ledger later, which will hold this call by then.
_SETTLE_LUA = """
local calls = tonumber(ARGV[1])
local p = 2
for c = 1, calls do
  local id, cost, k = ARGV[p], ARGV[p + 1], tonumber(ARGV[p + 2])
  for j = 1, k do
    local b = tonumber(ARGV[p + 2 + j])
    local h, z = KEYS[2 * b - 1], KEYS[2 * b]
    redis.call('ZREM', z, id)
    redis.call('HDEL', h, 'r:' .. id)
    if redis.call('HEXISTS', h, 'spent') == 1 then redis.call('HINCRBY', h, 'spent', cost) end
  end
  p = p + 3 + k
end
return calls
"""

# KEYS: the lease's budget hashes; ARGV: its id, the amount it holds from now on (kept
# only where the lease is still held: never revived once expired or settled).
_RESIZE_LUA = """
for i = 1, #KEYS do
  if redis.call('HEXISTS', KEYS[i], 'r:' .. ARGV[1]) == 1 then redis.call('HSET', KEYS[i], 'r:' .. ARGV[1], ARGV[2]) end
end
return #KEYS
"""

#: How long Redis keeps a period's spend after the period began (then it is only history).
_KEEP_SECONDS = {"day": 2 * 86400, "month": 33 * 86400, "total": 0}


class RedisReservations:
    """Reservations and period spend in Redis: one atomic script per batch of reservations
    (calls that arrive while one is in flight, see :mod:`gateway.billing.coalesce`) and one
    per batch of settlements."""

    settles_explicitly = True

    def __init__(self, redis: Any, pool: asyncpg.Pool, *, prefix: str = "llmg:budget", max_batch: int = MAX_BATCH) -> None:
        self._redis = redis
        self._pool = pool
        self._prefix = prefix
        self._reserve_script = redis.register_script(_RESERVE_LUA)
        self._settle_script = redis.register_script(_SETTLE_LUA)
        self._resize_script = redis.register_script(_RESIZE_LUA)
        self.batcher: Coalescer[tuple[Reservation, float], int] = Coalescer(
            self._reserve_round_trip, max_batch=max_batch, timeout=ROUND_TRIP_TIMEOUT, lost=self._release_lost,
            name="Redis budget store",
        )
        self.settle_batcher: Coalescer[tuple[Reservation, int], None] = Coalescer(
            self._settle_round_trip, max_batch=max_batch, timeout=ROUND_TRIP_TIMEOUT, name="Redis budget store",
        )
        self._releases = _Releases()

    def _keys(self, budgets: Sequence[Budget]) -> list[str]:
        keys: list[str] = []
        for b in budgets:
            keys += [f"{self._prefix}:{b.redis_name}", f"{self._prefix}:{b.redis_name}:exp"]
        return keys

    async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
        refused = await self.batcher.submit((reservation, ttl))
        return None if refused == 0 else refused - 1

    async def _reserve_round_trip(self, items: list[tuple[Reservation, float]]) -> list[int]:
        plan = _Plan([r for r, _ in items])
        args: list[Any] = [len(items), *(_KEEP_SECONDS[b.period] for b in plan.budgets)]
        for call, (reservation, ttl) in enumerate(items):
            slots = plan.slots[call]
            args += [str(reservation.reservation_id), reservation.amount_micro_usd, int(ttl * 1000), len(slots)]
            for slot, budget in zip(slots, reservation.budgets, strict=True):
                args += [slot + 1, budget.limit_micro_usd]
        keys = self._keys(plan.budgets)
        for _attempt in range(3):
            result = await self._reserve_script(keys=keys, args=args)
            if int(result[0]) == 1:
                return [int(a) for a in result[1:]]
            for index in result[1:]:
                await self._seed(plan.budgets[int(index) - 1])
        raise RuntimeError("budget spend could not be seeded in Redis")

    def _release_lost(self, lost: list[tuple[tuple[Reservation, float], int | None]]) -> None:
        """Reservations admitted (or perhaps admitted) for calls that will not be sent."""
        for (reservation, _ttl), answer in lost:
            if answer is None or answer == 0:
                self._releases.start(self.settle(reservation, 0))

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
        await self.settle_batcher.submit((reservation, cost_micro_usd))

    async def resize(self, lease: Reservation, amount_micro_usd: int) -> None:
        keys = [f"{self._prefix}:{b.redis_name}" for b in lease.budgets]
        await self._resize_script(keys=keys, args=[str(lease.reservation_id), amount_micro_usd])

    async def release_lease(self, lease: Reservation, spent_micro_usd: int, costly_calls: Sequence[uuid.UUID]) -> bool:
        """Settled like one call's reservation, at the sum of its calls' real costs."""
        await self.settle(lease, spent_micro_usd)
        return True

    async def _settle_round_trip(self, items: list[tuple[Reservation, int]]) -> list[None]:
        plan = _Plan([r for r, _ in items])
        args: list[Any] = [len(items)]
        for call, (reservation, cost) in enumerate(items):
            slots = plan.slots[call]
            args += [str(reservation.reservation_id), cost, len(slots), *(slot + 1 for slot in slots)]
        await self._settle_script(keys=self._keys(plan.budgets), args=args)
        return [None] * len(items)

    async def close(self) -> None:
        await self.batcher.close()
        await self._releases.wait()
        await self.settle_batcher.close()
        await self._redis.aclose()


def open_reservations(
    redis_url: str | None, pool: asyncpg.Pool, *, key_prefix: str, reservation_pool: asyncpg.Pool | None = None
) -> ReservationStore:
    """Redis when ``REDIS_URL`` is set, else PostgreSQL (docs/billing.md); ``reservation_pool``
    (from :func:`connect_reservation_pool`) is the PostgreSQL store's own, closed with it."""
    if not redis_url:
        return PostgresReservations(pool, own_pool=reservation_pool)
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from gateway.core.redis import redis_client

    # Fail fast, never retry by itself: an unreachable Redis is answered 503 at once.
    client = redis_client(
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
