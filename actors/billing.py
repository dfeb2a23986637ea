"""BillingActor: every finished call lands in the ledger exactly once, and budgets hold.

State it owns:

* the local journal (:mod:`gateway.billing.journal`): events are written into it as the
  calls end, group-committed with one ``fsync`` at most every ``fsync_interval`` seconds, sealed
  and shipped in batches (one ``INSERT ... ON CONFLICT (call_id) DO NOTHING`` per batch),
  and deleted once the ledger has them. While PostgreSQL is away they wait on disk; a
  restart ships whatever a crash left.
* the budget gate (:mod:`gateway.billing.gate`): a call of a budgeted key or subject
  reserves its worst-case cost in the shared store (PostgreSQL, or Redis when
  ``REDIS_URL`` is set) from the caller's task, one round trip; :class:`Settle` (tell)
  releases it at the real cost when the call ends (Redis; with PostgreSQL the ledger row
  itself settles it). Subject budgets are refreshed about every second and published.
* running spend counters per key and per subject, in integer micro-USD: the ledger's
  spend in each budget's current period plus what this replica has not shipped yet,
  for :class:`Spend` reports.
* counters for metrics: recorded, shipped, duplicates, pending, unpriced models.

Handlers never wait for billing: :meth:`BillingHandle.record` (a call listener) appends
the call's event to the journal from the handler's own task, before the answer's last
bytes leave (the append is synchronous, one ``write`` into the page cache and no await,
so it is safe from any task on the loop). No mailbox stands between a finished call and
the disk: a process killed the moment after a client saw its answer (SIGKILL, the OOM
killer) has left that call's event in the journal, and the next start ships it. On stop
(SIGTERM) the actor drains: a last fsync, a last ship; what cannot be shipped stays on
disk for next start.

Why one module of ~600 lines: an actor's messages, handle, loop and start/stop read top to
bottom in one file (the house style for actors); the journal, the ledger's rows and budgets
already live in gateway/billing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import asyncpg

from actors.runtime import Actor, ActorRef, ActorStopped, MailboxFull
from gateway.billing.budgets import fetch_spend
from gateway.billing.gate import BudgetGate
from gateway.billing.journal import Journal
from gateway.billing.ledger import NIL_UUID, fetch_ledger_id, ledger_line, ledger_row, ship_lines
from gateway.billing.reservations import (
    PostgresReservations,
    Reservation,
    ReservationStore,
    exact_rates,
    micro_usd,
    output_cap,
    prompt_token_bound,
)
from gateway.billing.shipping import JournalShipper, fixed_batches
from gateway.core.config import Price
from gateway.core.usage import CallRecord
from gateway.observability.logs import current_request_id, hand_off_fields, log_fields

if TYPE_CHECKING:
    from actors.auth import VerifiedKey
    from gateway.relay.routing import Route, Router

__all__ = [
    "BillingActor",
    "BillingHandle",
    "BillingStats",
    "Flush",
    "Settle",
    "Spend",
    "SpendReport",
]

log = logging.getLogger("gateway.billing")

#: Longest wait between two attempts to reach an unreachable ledger.
MAX_SHIP_BACKOFF = 2.0
#: Unpriced model names remembered for metrics; a bound, since clients choose names.
MAX_UNPRICED_MODELS = 1000
#: Routes whose reachable prices a billing handle remembers; cleared when this many.
MAX_CACHED_ROUTES = 1024
#: A bad row (refused by the ledger) makes us ship its batch line by line, at most this big.


# -- messages ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Settle:
    """A call that held a reservation ended (tell): release it at the call's real cost."""

    reservation: Reservation
    cost_micro_usd: int


@dataclass(frozen=True, slots=True)
class Flush:
    """Ship everything recorded so far (ask): True once the ledger has it, False if the
    ledger could not be reached (the events stay on disk)."""


@dataclass(frozen=True, slots=True)
class Spend:
    """The running spend of a key and/or a subject in their budget periods (ask)."""

    api_key_id: uuid.UUID | None = None
    subject_id: uuid.UUID | None = None


# -- replies -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SpendReport:
    #: USD spent in the key's budget period (all recorded spend if it has no budget).
    key_spent_usd: float | None
    subject_spent_usd: float | None
    subject_budget_usd: float | None
    subject_budget_period: str | None


@dataclass(frozen=True, slots=True)
class BillingStats:
    """Counters for metrics and readiness (a snapshot)."""

    #: Events journaled since start.
    recorded: int
    #: Rows the ledger inserted from this replica's journal.
    shipped: int
    #: Lines shipped again after a crash or a lost reply, which the ledger already had.
    duplicates: int
    #: Events not yet in the ledger (``gateway_billing_pending_events``).
    pending: int
    #: Lines the ledger refused, set aside in ``rejected.jsonl``.
    rejected: int
    #: Ship attempts that failed because the ledger was unreachable.
    ship_failures: int
    ledger_reachable: bool
    #: Requested models with tokens and no price (``cost_source == "unpriced"``).
    unpriced_models: frozenset[str]
    journal_dir: str


#: Attempts to settle a reservation while the store is away (then it expires by itself).
_SETTLE_ATTEMPTS = 5
#: A call whose PostgreSQL reservation its own ledger row releases is shipped within this
#: long, whatever the ship interval: until its row is in, its worst case stays held
#: against its budgets (one timer for every such call of that time).
RESERVED_SHIP_SECONDS = 0.1


class BillingActor(Actor[Flush | Spend | Settle]):
    name = "billing"

    def __init__(
        self,
        pool: asyncpg.Pool,
        journal_root: Path,
        *,
        mailbox_size: int = 8192,
        fsync_interval: float = 0.02,
        ship_interval: float = 1.0,
        refresh_interval: float = 1.0,
        max_batch: int = 5000,
        ship_timeout: float = 3.0,
        drain_timeout: float = 5.0,
        reservations: ReservationStore | None = None,
        reservation_ttl: float = 600.0,
        lease_fraction: float = 0.0,
        lease_seconds: float = 1.0,
        lease_standby_seconds: float = 0.0,
    ) -> None:
        self.mailbox_size = mailbox_size
        super().__init__()
        self._pool = pool
        self._journal_root = journal_root
        self._ship_interval = ship_interval
        self._refresh_interval = refresh_interval
        self._max_batch = max_batch
        self._ship_timeout = ship_timeout
        self._drain_timeout = drain_timeout
        self._journal: Journal | None = None
        #: Micro-USD per key and subject in their budget periods (for Spend reports).
        self._key_spent: dict[uuid.UUID, int] = {}
        self._subject_spent: dict[uuid.UUID, int] = {}
        self._subject_budgets: dict[uuid.UUID, tuple[Decimal, str]] = {}
        #: Read-only view the budget gate reads (no hop, no database trip).
        self.subject_budgets: Mapping[uuid.UUID, tuple[Decimal, str]] = MappingProxyType(self._subject_budgets)
        self.gate = BudgetGate(
            reservations or PostgresReservations(pool), ttl=reservation_ttl, subject_budgets=self.subject_budgets,
            lease_fraction=lease_fraction, lease_seconds=lease_seconds, lease_standby_seconds=lease_standby_seconds,
        )
        self._settling: set[asyncio.Task[None]] = set()
        self._budgeted_keys = 0
        self._shipping = JournalShipper(
            pool, ship_lines, batches=fixed_batches(max_batch), ship_timeout=ship_timeout,
            fsync_interval=fsync_interval, log=log, name="billing", store="the ledger",
        )
        self._wake_shipper = asyncio.Event()
        #: The timer of :meth:`ship_soon`, while one is set.
        self._ship_soon_timer: asyncio.TimerHandle | None = None
        self._stopping = False
        self._committer: asyncio.Task[None] | None = None
        self._shipper: asyncio.Task[None] | None = None
        self._unpriced: set[str] = set()
        self.recorded = 0
        #: Spend refreshes from the ledger that failed, and since when they keep failing
        #: (monotonic; None while they succeed): budgets shared across replicas go stale.
        self.refresh_failures = 0
        self.refresh_failing_since: float | None = None
        self.refreshed_at: float | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._ship_timeout * 2):
            ledger_id = await fetch_ledger_id(self._pool)
        self._journal = await loop.run_in_executor(None, Journal.open, self._journal_root / str(ledger_id))
        self._shipping.journal = self._journal
        await self._refresh()  # budgets hold from the first request
        self._committer = loop.create_task(self._shipping.commit_forever(), name="billing:commit")
        self._shipper = loop.create_task(self._ship_forever(), name="billing:ship")

    async def on_stop(self) -> None:
        """Drain: last fsync, last ship; whatever the ledger cannot take stays on disk."""
        journal = self.journal
        self._stopping = self._shipping.stopping = True
        if self._ship_soon_timer is not None:
            self._ship_soon_timer.cancel()  # the drain below ships everything
            self._ship_soon_timer = None
        self._wake_shipper.set()
        journal.wake()
        # Asked to finish, never cancelled: a commit must not be cut while its thread writes.
        for task in (self._committer, self._shipper):
            if task is not None:
                with contextlib.suppress(Exception):
                    await task
        if self._settling:  # releases in flight: given a moment, else they expire
            await asyncio.wait(self._settling, timeout=self._drain_timeout)
        try:
            await journal.commit()
        except OSError as exc:
            log.error("billing journal: final commit failed: %s", exc)
        try:
            async with asyncio.timeout(self._drain_timeout):
                shipped = await self._ship_cycle()
        except TimeoutError:
            shipped = False
        if not shipped or journal.pending_events:
            log.warning(
                "billing: %d event(s) stay in %s; they are shipped at the next start",
                journal.pending_events, journal.directory,
            )
        journal.close()
        # After the last ship: a PostgreSQL lease is released once its calls are ledgered.
        await self.gate.leases.close()

    # -- messages -----------------------------------------------------------------------
    async def receive(self, msg: Flush | Spend | Settle) -> Any:
        if isinstance(msg, Settle):
            self.settle_later(msg.reservation, msg.cost_micro_usd)
            return None
        if isinstance(msg, Flush):
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._shipping.flush_waiters.append(fut)
            self._wake_shipper.set()
            return fut  # deferred: answered after the next ship
        if isinstance(msg, Spend):
            budget = self._subject_budgets.get(msg.subject_id) if msg.subject_id else None
            return SpendReport(
                key_spent_usd=self._key_spent.get(msg.api_key_id, 0) / 1e6 if msg.api_key_id else None,
                subject_spent_usd=self._subject_spent.get(msg.subject_id, 0) / 1e6 if msg.subject_id else None,
                subject_budget_usd=float(budget[0]) if budget else None,
                subject_budget_period=budget[1] if budget else None,
            )
        raise TypeError(f"unexpected message {msg!r}")

    def ingest(self, call: CallRecord) -> None:
        """Journal and count one finished call's ledger row, and hold it on the call for its
        billing line (:meth:`BillingHandle.log_line`). Synchronous (no await), so the handle
        calls it from the handler's task, and it works after the actor stopped too (the
        journal then writes and fsyncs a late row at once)."""
        journal = self._journal  # the journal property, inline
        if journal is None:
            raise RuntimeError("billing actor used before it started")
        row = ledger_row(call)
        # The spend counters are keyed by the ids as they are (the line may hold their text).
        api_key_id, subject_id = call.api_key_id or NIL_UUID, call.subject_id or NIL_UUID
        cost = micro_usd(call.cost_usd)
        active_lines = journal.append(ledger_line(row), api_key_id, subject_id, cost)
        self.recorded += 1
        if cost > 0:
            self._key_spent[api_key_id] = self._key_spent.get(api_key_id, 0) + cost
            self._subject_spent[subject_id] = self._subject_spent.get(subject_id, 0) + cost
        if call.cost_source == "unpriced" and len(self._unpriced) < MAX_UNPRICED_MODELS:
            self._unpriced.add(call.requested_model[:256])  # as its row has it
        if active_lines >= self._max_batch:
            self._wake_shipper.set()
        # Its billing line is logged after the answer is out (BillingHandle.log_line): the
        # only step between an answer and its client is the journal's.
        call.ledger_row = row

    @property
    def has_budgets(self) -> bool:
        """Does any key or subject have a budget (as of the last refresh)?"""
        return self._budgeted_keys > 0 or bool(self._subject_budgets)

    def settle_later(self, reservation: Reservation, cost_micro_usd: int) -> None:
        """Release a reservation in a task of its own (never inline: it is store I/O)."""
        task = asyncio.get_running_loop().create_task(self._settle(reservation, cost_micro_usd))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        for attempt in range(_SETTLE_ATTEMPTS):
            try:
                async with asyncio.timeout(self._ship_timeout):
                    await self.gate.settle(reservation, cost_micro_usd)
                return
            except Exception as exc:  # noqa: BLE001 - retried; the reservation expires otherwise
                if attempt == _SETTLE_ATTEMPTS - 1:
                    log.warning("billing: could not release reservation %s (%s); it expires in %.0f s",
                                reservation.reservation_id, exc, self.gate.ttl)
                    return
                await asyncio.sleep(0.2 * 2**attempt)

    # -- shipping -----------------------------------------------------------------------
    def ship_soon(self) -> None:
        """Ship within :data:`RESERVED_SHIP_SECONDS` rather than at the next interval (a
        call's reservation waits for its ledger row)."""
        if self._ship_soon_timer is None and self._ship_interval > RESERVED_SHIP_SECONDS:
            self._ship_soon_timer = asyncio.get_running_loop().call_later(RESERVED_SHIP_SECONDS, self._ship_now)

    def _ship_now(self) -> None:
        self._ship_soon_timer = None
        self._wake_shipper.set()

    async def _ship_cycle(self) -> bool:
        """Ship the journal; the budget leases are told when a ship had everything (a
        PostgreSQL lease is released once its calls are in the ledger)."""
        leases = self.gate.leases
        began = leases.ship_began()
        ok = await self._shipping.ship_cycle()
        if ok:
            leases.shipped(began)
        return ok

    async def _ship_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_ship = loop.time() + self._ship_interval
        next_refresh = loop.time() + self._refresh_interval
        backoff = self._ship_interval
        while not self._stopping:
            timeout = max(0.0, min(next_ship, next_refresh) - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_shipper.wait(), timeout)
            woken = self._wake_shipper.is_set()
            self._wake_shipper.clear()
            if self._stopping:
                return
            try:
                if woken or loop.time() >= next_ship:
                    ok = await self._ship_cycle()
                    backoff = self._ship_interval if ok else min(max(backoff * 2, 0.1), MAX_SHIP_BACKOFF)
                    next_ship = loop.time() + (self._ship_interval if ok else backoff)
                # Refresh only after a ship, never during one: the counters add the ledger's
                # figure to what is not shipped yet, so the two must not overlap.
                if loop.time() >= next_refresh and self._shipping.reachable:
                    await self._refresh()
                    next_refresh = loop.time() + self._refresh_interval
            except Exception:
                log.exception("billing: ship loop error")
                await asyncio.sleep(backoff)

    # -- spend counters -------------------------------------------------------------------
    async def _refresh(self) -> None:
        """Counters := the ledger's spend per budget period + what is not shipped yet."""
        try:
            async with asyncio.timeout(self._ship_timeout):
                snapshot = await fetch_spend(self._pool)
        except Exception as exc:  # noqa: BLE001 - keep the last counters; retried next time
            self.refresh_failures += 1
            if self.refresh_failing_since is None:
                self.refresh_failing_since = time.monotonic()
                # WARNING once per outage: shared budgets now use the last counters read.
                log.warning("billing: spend refresh failed, budgets may go stale: %s: %s", type(exc).__name__, exc)
            else:
                log.debug("billing: spend refresh failed again: %r", exc)
            return
        if self.refresh_failing_since is not None:
            log.warning("billing: spend refresh works again after %.0f s", time.monotonic() - self.refresh_failing_since)
            self.refresh_failing_since = None
        unshipped_keys, unshipped_subjects = self.journal.unshipped_spend()
        _replace(self._key_spent, snapshot.key_spend, unshipped_keys)
        self._budgeted_keys = len(snapshot.key_spend)
        _replace(self._subject_spent, snapshot.subject_spend, unshipped_subjects)
        self._subject_budgets.clear()
        self._subject_budgets.update(snapshot.subject_budgets)
        self.refreshed_at = time.monotonic()

    # -- views ----------------------------------------------------------------------------
    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise RuntimeError("billing actor used before it started")
        return self._journal

    def stats(self) -> BillingStats:
        journal = self._journal
        return BillingStats(
            recorded=self.recorded,
            shipped=self._shipping.shipped,
            duplicates=self._shipping.duplicates,
            pending=journal.pending_events if journal else 0,
            rejected=journal.rejected if journal else 0,
            ship_failures=self._shipping.ship_failures,
            ledger_reachable=self._shipping.reachable,
            unpriced_models=frozenset(self._unpriced),
            journal_dir=str(journal.directory) if journal else "",
        )


def _replace(target: dict[uuid.UUID, int], base: dict[uuid.UUID, int], extra: dict[uuid.UUID, int]) -> None:
    """Rebuild ``target`` in place as base + extra."""
    target.clear()
    target.update(base)
    for k, v in extra.items():
        target[k] = target.get(k, 0) + v


def _log_billing(row: Mapping[str, Any]) -> None:
    """The per-call billing line (seed 000) of a ledger row (:func:`ledger_row`): key id,
    request id, cost, as structured fields (one JSON object per line with
    ``LOG_FORMAT=json``, see gateway/observability/logs.py).

    When the line is made by the gateway's writer (:func:`hand_off_fields` takes it), its
    fields are one dict literal in the line's order with a request id bound (every
    request's line: that key first, where the line puts it), put in the unbound order
    otherwise; and the ids go as they are: orjson writes a UUID as ``str()`` does, without
    ``UUID.__str__``'s Python (0.55 µs an id). The same bytes; anything else sees the
    fields as they always were.
    """
    fields = {
        "request_id": row["request_id"], "api_key_id": row["api_key_id"], "subject_id": row["subject_id"],
        "response_id": row["response_id"], "model": row["requested_model"], "served_model": row["served_model"],
        "provider": row["provider"], "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"], "cost_usd": row["cost_usd"], "cost_diem": row["cost_diem"],
        "cost_source": row["cost_source"], "status": row["status"],
    }
    if current_request_id() is None:
        unbound = _BILLING_UNBOUND.copy()
        unbound.update(fields)
        fields = unbound
    if hand_off_fields(log, "billing", fields):
        return
    payload = {field: row[column] for field, column in _BILLING_FIELDS}
    payload["api_key_id"], payload["subject_id"] = str(row["api_key_id"]), str(row["subject_id"])
    log_fields(log, "billing", payload)


#: The billing line's fields in its order (:func:`_log_billing`), each with the ledger
#: column it shows. The fast path above writes them as a literal, on purpose: read through
#: this table (``dict(zip(names, itemgetter(*columns)(row)))``) the fields took 1.1-1.3 µs
#: a call against 0.6; the literal takes the time of storing them one by one into a copy
#: of a dict holding them (0.39 µs each) in 40 instructions fewer. The byte-for-byte test
#: in tests/test_logs.py holds the two to one line.
_BILLING_FIELDS: tuple[tuple[str, str], ...] = (
    ("api_key_id", "api_key_id"), ("subject_id", "subject_id"), ("request_id", "request_id"),
    ("response_id", "response_id"), ("model", "requested_model"), ("served_model", "served_model"),
    ("provider", "provider"), ("prompt_tokens", "prompt_tokens"), ("completion_tokens", "completion_tokens"),
    ("cost_usd", "cost_usd"), ("cost_diem", "cost_diem"), ("cost_source", "cost_source"), ("status", "status"),
)
#: Those fields with no request id bound (the line then has them in this order).
_BILLING_UNBOUND: dict[str, Any] = dict.fromkeys(field for field, _ in _BILLING_FIELDS)


class BillingHandle:
    """What the edge holds: the call listener, the budget check, flush and stats."""

    __slots__ = ("_actor", "_gate", "_prices", "_prices_router", "_ref", "_subject_budgets")

    def __init__(self, actor: BillingActor, ref: ActorRef[Any]) -> None:
        self._actor = actor
        self._ref = ref
        self._gate = actor.gate
        #: The subjects' budgets the gate reads (:meth:`BudgetGate.applies`, inline).
        self._subject_budgets = actor.subject_budgets
        #: :meth:`_prices_of` by route, for one router (config generation): ``id(route)``
        #: → (route, prices, their exact rates).
        self._prices: dict[int, _RoutePrices] = {}
        self._prices_router: Router | None = None

    def record(self, call: CallRecord) -> None:
        """One event per finished call, in the journal's file when this returns (so before
        the client has the answer's end). Never waits, never raises. Its billing line
        follows once the answer is out: :meth:`log_line`."""
        try:
            self._actor.ingest(call)
        except Exception:
            log.exception("billing: LOST the event of call %s (%s)", call.call_id, call.request_id)

    def log_line(self, call: CallRecord) -> None:
        """The billing line of the row :meth:`record` journaled for ``call``, once (nothing
        if none was). Called after the answer is sent: at a low rate, where a request's
        path runs with cold caches, the line cost ~9 µs of each answer's latency before.
        Never raises."""
        row = call.ledger_row
        if row is None:
            return
        call.ledger_row = None
        if log.isEnabledFor(logging.INFO):
            try:
                _log_billing(row)
            except Exception:  # a log line must never fail the request it describes
                log.exception("billing: could not log the billing line of call %s", call.call_id)

    async def reserve(
        self, key: VerifiedKey, record: CallRecord, route: Route, router: Router, body: dict[str, Any],
        *, embeddings: bool = False,
    ) -> Reservation | None:
        """Hold the call's worst-case cost against the key's and its subject's budgets.

        Raises BudgetExceeded (402) if it does not fit, ServiceUnavailable (503) if the
        store is away; None (and no I/O at all) for a key with no budget. The worst case is
        the prompt's token bound at the input price plus its output cap (none for
        embeddings) at the output price, on the dearest deployment the call may reach
        (fallbacks included).
        """
        # The gate's applies() and the key's budget as the gate takes it, inline, and the
        # gate's hold awaited from here: a helper coroutine and two calls less per call.
        policy = key.policy
        budget = policy.budget_usd
        if budget is None and key.subject_id not in self._subject_budgets:
            return None
        cap = 0 if embeddings else output_cap(body, route.group.max_output_tokens)
        bound = prompt_token_bound(body.get("input") if embeddings else body)
        _, prices, rates = self._prices_of(route, router)
        return await self._gate.hold(
            record.call_id, key.api_key_id, None if budget is None else (budget, policy.budget_period or "total"),
            key.subject_id, record.requested_model, prices, bound, cap, rates,
        )

    def _prices_of(self, route: Route, router: Router) -> _RoutePrices:
        """:func:`_reachable_prices` and their :func:`exact_rates`, remembered: the same for
        every call of a route on one router (an exact model's route is built once per
        router; a wildcard's per call). The route comes first (held, so its id is never
        another's meanwhile)."""
        if router is not self._prices_router:
            self._prices.clear()
            self._prices_router = router
        cached = self._prices.get(id(route))
        if cached is not None and cached[0] is route:
            return cached
        prices = tuple(_reachable_prices(route, router))
        if len(self._prices) >= MAX_CACHED_ROUTES:
            self._prices.clear()
        self._prices[id(route)] = cached = (route, prices, exact_rates(prices))
        return cached

    async def reserve_passthrough(
        self, key: VerifiedKey, record: CallRecord, body: Any, price: Price | None,
    ) -> Reservation | None:
        """:meth:`reserve` for a pass-through call: the provider's own API, no model group.

        The worst case is the raw body's size as the prompt bound plus the body's own
        ``max_tokens`` (or the default cap), at the price of the model the body names; a
        budgeted key calling an unpriced model is refused, as everywhere.
        """
        policy = key.policy
        budget = policy.budget_usd
        if budget is None and key.subject_id not in self._subject_budgets:
            return None
        cap = output_cap(body if isinstance(body, dict) else {}, None)
        return await self._gate.hold(
            record.call_id, key.api_key_id, None if budget is None else (budget, policy.budget_period or "total"),
            key.subject_id, record.requested_model, [price], prompt_token_bound(body), cap,
        )

    def settle(self, reservation: Reservation | None, call: CallRecord) -> None:
        """The call ended (its cost settled): release what it held. Never waits."""
        if reservation is None:
            return  # no budget
        if self._gate.settles_at_once(reservation, call.cost_micro_usd):
            if reservation.lease is None:
                self._actor.ship_soon()  # the ledger row settles it (PostgreSQL): not a whole interval later
            return  # or a lease's call
        try:
            self._ref.tell(Settle(reservation, call.cost_micro_usd))
        except (MailboxFull, ActorStopped):
            self._actor.settle_later(reservation, call.cost_micro_usd)

    async def flush(self, timeout: float = 10.0) -> bool:
        """Ship everything recorded so far; True once the ledger has it."""
        return bool(await self._ref.ask(Flush(), timeout=timeout))

    async def spend(self, api_key_id: uuid.UUID | None = None, subject_id: uuid.UUID | None = None) -> SpendReport:
        result: SpendReport = await self._ref.ask(Spend(api_key_id, subject_id))
        return result

    def stats(self) -> BillingStats:
        return self._actor.stats()

    @property
    def refresh_failures(self) -> int:
        """Failed spend refreshes so far (``gateway_background_failures_total``)."""
        return self._actor.refresh_failures

    @property
    def refresh_failing_for(self) -> float | None:
        """Seconds the spend refresh has kept failing; None while it works (``/readyz``)."""
        since = self._actor.refresh_failing_since
        return None if since is None else time.monotonic() - since

    @property
    def pending_events(self) -> int:
        """For ``gateway_billing_pending_events``."""
        journal = self._actor._journal
        return journal.pending_events if journal is not None else 0

    @property
    def ref(self) -> ActorRef[Any]:
        return self._ref


#: A route, the price of every deployment a call on it may reach, and their :func:`exact_rates`.
_RoutePrices = tuple["Route", tuple[Price | None, ...], tuple[tuple[int, int, int], ...] | None]


def _reachable_prices(route: Route, router: Router) -> list[Price | None]:
    """The price of every deployment a call on ``route`` may be served by (fallbacks too)."""
    prices = [t.deployment.price for t in route.targets]
    for name in route.group.fallbacks:
        try:
            prices += [t.deployment.price for t in router.resolve(name).targets]
        except Exception:  # noqa: BLE001 - an unresolvable fallback is never tried either
            continue
    return prices
