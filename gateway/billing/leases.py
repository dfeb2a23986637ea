"""Budget leases: headroom held by this process, so most budgeted calls make no round trip.

Without leases every budgeted call reserves its worst case in the shared store before it
is sent: one round trip (0.6-1.4 ms with PostgreSQL) before the first byte of every call.
A *lease* is a reservation like a call's, held by this process against the same budgets
(its own row in ``budget_reservations``, or its own field in Redis), of a share of the
smallest of those budgets. Calls of those budgets are then admitted from the lease in
memory, in arrival order, while their worst case fits in what the lease has left:

    free = lease - worst cases of its calls still running - real costs of its calls ended

The shared store sees the lease's whole amount from the moment it is granted, so spend
plus every open reservation and lease never exceeds a budget, exactly as with one
reservation per call: leases change who waits for the store, never the arithmetic.

A lease admits calls for ``seconds`` (or until it cannot fit the next one), then retires;
in its last quarter (of time, or of headroom) the next one is asked for in the background,
so a steadily busy budget's calls never wait for the store. A lease whose time is over
with no successor (its budget's calls stopped, or come seldom) *stands by* instead, for
``standby_seconds`` (stood by by the sweep, every half lease, or by the first call that
finds it past its time, which then tells the store in the background): it is cut down
to what its calls still hold and have spent plus room for two calls as large as the
largest it admitted, and admits from that. A key that
calls now and then (less than once a ``seconds``) then finds a lease, and its call makes
no round trip; a call that leaves the standby less than one more call's room asks for a
full lease in the background, which replaces the standby when granted. A standby retires
``standby_seconds`` after it began, or when a call does not fit. A retired lease:
what it never used is given back by the next sweep (its amount shrinks to what its calls
still hold and have spent), or at once when the store refuses a call of its budgets
meanwhile (:meth:`BudgetLeases.give_back`; the call is then asked for again), and the
lease itself is released when its last call has ended and, in PostgreSQL, every call of it that cost anything has its ledger row (whose trigger added
the cost to ``budget_spend``; until then the lease keeps counting that cost itself, so
it is never counted nowhere). In Redis the lease is settled at the sum of its calls' real
costs, as one call's reservation is.

Leases are only taken where they cannot matter much: the lease is ``fraction`` of the
smallest budget it holds against and the call asking must fit in it at least
:data:`MIN_CALLS_PER_LEASE` times; a budget too small for that (10 calls' worth, say),
or a lease the store refuses (the budget is nearly spent), goes back to one reservation
per call, exact to the last call. The price: while a budget is nearly spent, another
replica's leases may hold what they never use, up to ``fraction`` of it per budget and
replica (twice that while a successor granted ahead waits) for about a lease's
``seconds``, and a standby two calls' worst case for up to ``standby_seconds``, so a call
that would fit in what is truly left can be refused meanwhile. Never the reverse:
nothing is admitted that the budget cannot cover.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.billing.reservations import Budget, Reservation

if TYPE_CHECKING:
    from gateway.billing.reservations import ReservationStore

__all__ = ["MIN_CALLS_PER_LEASE", "BudgetLeases", "Lease"]

log = logging.getLogger("gateway.billing")

#: A lease is taken only if the call asking for it fits in it at least this many times.
MIN_CALLS_PER_LEASE = 8
#: A call tries this many fresh leases (others' calls may take each one first) before it
#: reserves on its own.
_ATTEMPTS = 3


class Lease:
    """One lease: its reservation (id, amount, budgets) and what its calls use of it."""

    __slots__ = ("admits_until", "amount", "costly_calls", "expires_at", "free", "largest", "open", "release_after",
                 "renew_at", "renewing", "reservation", "resizing", "retired", "shrinking", "shrunk", "spent",
                 "standby")

    def __init__(
        self, reservation: Reservation, admits_until: float, expires_at: float, renew_at: float, largest: int = 0,
    ) -> None:
        self.reservation = reservation
        #: Micro-USD the store holds for it: the amount granted, until a standby cuts it down.
        self.amount = reservation.amount_micro_usd
        #: Micro-USD still free: the amount less the running calls' holds and the ended calls' costs.
        self.free = reservation.amount_micro_usd
        #: The largest hold of a call it (or the lease before it) admitted: a standby keeps two.
        self.largest = largest
        #: Past its time with no successor: cut down, admitting occasional calls.
        self.standby = False
        self.admits_until = admits_until
        #: From then (or from a quarter of its amount left) the next lease is asked for, once.
        self.renew_at = renew_at
        self.renewing = False
        #: When the store stops counting the lease by itself (its TTL).
        self.expires_at = expires_at
        self.open = 0
        #: Real cost of the calls that ended (micro-USD).
        self.spent = 0
        #: Calls that ended with a cost: PostgreSQL releases the lease once all are ledgered.
        self.costly_calls: list[uuid.UUID] = []
        #: Its calls all ended (or a release found one not ledgered yet) at this time: its
        #: release waits for a ship of the ledger's journal that began then or later
        #: (:meth:`BudgetLeases.shipped`). None: not yet known to have ended.
        self.release_after: float | None = None
        self.retired = False
        #: Retired: the store told to hold just what its calls hold and have spent (or telling it).
        self.shrinking: asyncio.Task[None] | None = None
        self.shrunk = False
        #: Stood by by a call (not the sweep): the store told the cut-down amount, in the background.
        self.resizing: asyncio.Task[None] | None = None


class BudgetLeases:
    """This process's leases, one admitting at a time per set of budgets."""

    def __init__(
        self,
        store: ReservationStore,
        *,
        ttl: float,
        fraction: float,
        seconds: float,
        standby_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._ttl = ttl
        self._fraction = fraction
        self._seconds = seconds
        #: 0: a lease past its time retires at once (every call of a seldom-called budget
        #: then waits for the store).
        self._standby_seconds = standby_seconds
        self._clock = clock
        self._active: dict[tuple[Budget, ...], Lease] = {}
        #: Leases granted ahead (a renewal), admitting once the active one is done.
        self._next: dict[tuple[Budget, ...], Lease] = {}
        self._opening: dict[tuple[Budget, ...], asyncio.Task[Lease | None]] = {}
        #: Budgets whose last lease was refused: one reservation per call until then.
        self._refused_until: dict[tuple[Budget, ...], float] = {}
        self._retired: list[Lease] = []
        self._sweeper: asyncio.Task[None] | None = None
        #: When the last ship of the ledger's journal that shipped everything began (the
        #: billing actor tells, :meth:`shipped`); None until one has. A store that settles
        #: through the ledger (PostgreSQL) releases a lease only once its costly calls are
        #: in it: each try sends every one of their ids to be looked up there (thousands
        #: for a busy key's lease), so a lease is tried once per ship that can have them,
        #: not at every sweep. Until a ship is told, at every sweep.
        self._shipped_from: float | None = None
        #: Leases granted, and calls admitted from one (for tests and the bench).
        self.granted = 0
        self.admitted = 0

    def size_for(self, budgets: tuple[Budget, ...], amount: int) -> int:
        """The lease a call of ``amount`` (micro-USD) may draw from; 0: reserve on its own."""
        if self._fraction <= 0:
            return 0
        smallest = budgets[0].limit_micro_usd
        for budget in budgets:  # one or two: a loop, not min() over a generator
            if budget.limit_micro_usd < smallest:
                smallest = budget.limit_micro_usd
        size = int(smallest * self._fraction)
        if size <= 0 or amount * MIN_CALLS_PER_LEASE > size:
            return 0
        # Looked up only when some budget was refused (the lookup hashes every budget).
        refused_until = self._refused_until.get(budgets) if self._refused_until else None
        if refused_until is not None:
            if self._clock() < refused_until:
                return 0
            del self._refused_until[budgets]
        return size

    def take(self, budgets: tuple[Budget, ...], amount: int, call_id: uuid.UUID) -> Reservation | None:
        """The call's hold from the admitting lease of its budgets, if it fits (no I/O)."""
        now = self._clock()
        while True:
            lease = self._active.get(budgets) or self._promote(budgets)
            if lease is None:
                return None
            if now >= lease.admits_until and self._may_stand_by(lease, budgets):
                # Past its time before the sweep (every half lease) stood it by: a budget
                # called about once a lease's time found it so on about every other call
                # and waited for a new lease. It stands by now, as the sweep would have.
                self._stand_by_soon(lease, now)
            if lease.free >= amount and now < lease.admits_until:
                break
            self._retire(lease)  # then its successor, if one was granted ahead
        lease.free = free = lease.free - amount
        lease.open += 1
        largest = lease.largest
        if amount > largest:  # max(), without the call
            lease.largest = largest = amount
        self.admitted += 1
        if not lease.renewing:
            # Low: a quarter of its headroom left (a standby: less than one more call as large).
            low = free < largest if lease.standby else free * 4 < lease.reservation.amount_micro_usd
            if now >= lease.renew_at or low:
                lease.renewing = True  # its successor, before any call has to wait for it
                self._start_opening(budgets, lease.reservation.amount_micro_usd, renewal=True, largest=largest)
        return Reservation(call_id, amount, budgets, lease)

    async def acquire(
        self, budgets: tuple[Budget, ...], amount: int, call_id: uuid.UUID, size: int
    ) -> Reservation | None:
        """:meth:`take`, from a new lease when needed (one round trip, shared by every call
        waiting for it); None when the store refuses the lease (reserve on your own).
        Raises what the store raises."""
        for _attempt in range(_ATTEMPTS):
            held = self.take(budgets, amount, call_id)
            if held is not None:
                return held
            opening = self._opening.get(budgets) or self._start_opening(budgets, size, renewal=False, largest=amount)
            if await asyncio.shield(opening) is None:
                return None
        return None

    def _start_opening(
        self, budgets: tuple[Budget, ...], size: int, *, renewal: bool, largest: int,
    ) -> asyncio.Task[Lease | None]:
        opening = self._opening.get(budgets)
        if opening is None:
            # Its own task and context: a caller that stops waiting does not cancel the
            # lease the calls behind it wait for (it is never lost: it admits them).
            opening = asyncio.get_running_loop().create_task(
                self._open(budgets, size, renewal, largest), name="billing:lease", context=contextvars.Context())
            opening.add_done_callback(_retrieve)
            self._opening[budgets] = opening
        return opening

    def finish(self, held: Reservation, cost_micro_usd: int) -> None:
        """A call admitted from a lease ended at its real cost (no I/O)."""
        lease = held.lease
        assert lease is not None
        lease.open -= 1
        lease.spent += cost_micro_usd
        if cost_micro_usd > 0:
            lease.costly_calls.append(held.reservation_id)
        if not lease.retired:
            lease.free += held.amount_micro_usd - cost_micro_usd
        elif lease.open == 0:
            lease.release_after = self._clock()  # its last call ended: a ship from now on has them all

    async def _open(self, budgets: tuple[Budget, ...], size: int, renewal: bool, largest: int) -> Lease | None:
        try:
            reservation = Reservation(uuid.uuid4(), size, budgets)
            refused = await self.store.reserve(reservation, self._ttl + self._seconds)
        finally:
            self._opening.pop(budgets, None)
        now = self._clock()
        if refused is not None:
            # A renewal refused: the current lease admits on until it is spent, and only a
            # call that then finds no lease steers the budget to one reservation per call.
            if not renewal:
                self._refused_until[budgets] = now + self._seconds
            return None
        lease = Lease(reservation, now + self._seconds, now + self._ttl + self._seconds,
                      renew_at=now + self._seconds * 0.75, largest=largest)
        active = self._active.get(budgets)
        if active is not None and active.standby:
            self._retire(active)  # a standby's successor admits at once; what it held goes back
        if budgets in self._active:
            # Granted ahead: it admits once the current lease is spent or past its time.
            if (waiting := self._next.get(budgets)) is not None:
                self._retire(waiting)
            self._next[budgets] = lease
        else:
            self._active[budgets] = lease
        self.granted += 1
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_forever(), name="billing:leases", context=contextvars.Context())
        return lease

    def _promote(self, budgets: tuple[Budget, ...]) -> Lease | None:
        """The lease granted ahead for ``budgets``, admitting from now on."""
        lease = self._next.pop(budgets, None)
        if lease is not None:
            self._active[budgets] = lease
        return lease

    def _retire(self, lease: Lease) -> None:
        """Stop admitting from ``lease``; the next sweep gives back what it never used."""
        if lease.retired:
            return
        lease.retired = True
        budgets = lease.reservation.budgets
        if self._active.get(budgets) is lease:
            del self._active[budgets]
        if self._next.get(budgets) is lease:
            del self._next[budgets]
        self._retired.append(lease)

    async def _sweep_forever(self) -> None:
        interval = max(0.05, self._seconds / 2)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
            except Exception as exc:  # noqa: BLE001 - retried next sweep; leases expire otherwise
                log.warning("billing: could not release budget leases (%s: %s); retried", type(exc).__name__, exc)

    def ship_began(self) -> float:
        """A ship of the ledger's journal begins: its time, for :meth:`shipped`."""
        return self._clock()

    def shipped(self, began: float) -> None:
        """The ship that began at ``began`` (:meth:`ship_began`) shipped every line: every call
        that ended before then is in the ledger."""
        if self._shipped_from is None or began > self._shipped_from:
            self._shipped_from = began

    async def sweep(self, *, final: bool = False) -> None:
        """Retire leases past their time; shrink retired ones to what their calls still hold
        and have spent; release those whose calls have all ended (and been ledgered: with a
        store that settles through the ledger, tried once a ship began after they ended;
        ``final``, at close after the last ship: tried whatever the ships)."""
        now = self._clock()
        for lease in [*self._active.values(), *self._next.values()]:
            if now < lease.admits_until:
                continue
            if self._may_stand_by(lease, lease.reservation.budgets):
                if (amount := self._stand_by(lease, now)) is not None:
                    await self.store.resize(lease.reservation, amount)
            else:
                self._retire(lease)
        # Each retired lease stays listed (and counted in ``held``) until the store has let
        # it go: taken off the list while its release was in flight, it was held by
        # nobody's count, and a caller reading ``held == 0`` could find its row still there.
        for lease in list(self._retired):
            if lease.resizing is not None:
                await asyncio.shield(lease.resizing)  # the store's updates of one lease land in order
            if now >= lease.expires_at:
                self._forget(lease)  # the store no longer counts it
            elif lease.open == 0:
                if not self._may_try_release(lease, now, final):
                    continue
                if await self.store.release_lease(lease.reservation, lease.spent, lease.costly_calls):
                    self._forget(lease)
                else:
                    lease.release_after = self._clock()  # the next ship that begins from now on has them
            elif not lease.shrunk:
                await asyncio.shield(self._shrink(lease))  # the sweeper stopped at close: close's sweep shares it

    def _may_try_release(self, lease: Lease, now: float, final: bool) -> bool:
        """Whether a retired lease whose calls have all ended may ask the store for its
        release now: always where the store does not wait for the ledger, at close, and
        before any ship was told; else once a ship that began after its calls ended has
        shipped everything. A lease whose last call's end was not timed (retired with none
        open) is taken to have ended now, the first time it is asked."""
        if final or self.store.settles_explicitly or self._shipped_from is None:
            return True
        if lease.release_after is None:
            # Retired with no call open (its last end was not timed): they ended by now.
            lease.release_after = now
        return self._shipped_from >= lease.release_after

    async def give_back(self, budgets: tuple[Budget, ...]) -> bool:
        """Shrink this process's retired leases on any of ``budgets`` now, not at the next
        sweep: a call the store refused may fit in what they never used (a lease retired
        on its time with room left, say, while the calls of a burst still arrive), and this
        process must not refuse a call for room it holds itself. True when any was (or was
        being) shrunk, so that asking the store once more may admit the call."""
        shrinks = [self._shrink(lease) for lease in self._retired
                   if not lease.shrunk and any(budget in budgets for budget in lease.reservation.budgets)]
        for shrink in shrinks:
            # Shielded: a call that stops waiting (its timeout) leaves the shrink to finish
            # for the sweep and the other calls sharing it.
            await asyncio.shield(shrink)
        return bool(shrinks)

    def _shrink(self, lease: Lease) -> asyncio.Task[None]:
        """The store told to hold for a retired ``lease`` just what its calls still hold and
        have spent: one round trip, shared by the sweep and every call waiting for it."""
        if lease.shrinking is None:
            lease.shrinking = asyncio.get_running_loop().create_task(
                self._resize_retired(lease), name="billing:lease-shrink", context=contextvars.Context())
            lease.shrinking.add_done_callback(_retrieve)
        return lease.shrinking

    async def _resize_retired(self, lease: Lease) -> None:
        if lease.resizing is not None:
            await asyncio.shield(lease.resizing)  # a standby's cut first: the store's updates land in order
        try:
            # A retired lease's ``free`` no longer moves (its calls' ends only add to
            # ``spent``), so what it holds is fixed from its retirement on.
            await self.store.resize(lease.reservation, max(lease.amount - lease.free, 0))
        finally:
            lease.shrinking = None  # a failed resize is tried again by the next sweep
        lease.shrunk = True

    def _may_stand_by(self, lease: Lease, budgets: tuple[Budget, ...]) -> bool:
        """Whether ``lease``, past its time, stands by rather than retiring: standbys are
        on, it is not one already, it admits for ``budgets``, and no successor is granted
        or being asked for."""
        return (self._standby_seconds > 0 and not lease.standby and self._active.get(budgets) is lease
                and budgets not in self._next and budgets not in self._opening)

    def _stand_by(self, lease: Lease, now: float) -> int | None:
        """A lease past its time, with no successor: cut down to what its calls hold and
        have spent plus two calls' room, it admits on for ``standby_seconds``; a call that
        leaves it less than one more call's room asks for a full successor. Returns what
        the store must now hold for it (None: what it holds already)."""
        lease.standby = True
        lease.admits_until = lease.renew_at = now + self._standby_seconds
        lease.renewing = False
        cut = lease.free - 2 * lease.largest
        if cut <= 0:
            return None
        # Taken from what calls may draw before the store is told, never after: the
        # store holds at least what the lease may still admit, whatever the round trip does.
        lease.free -= cut
        lease.amount -= cut
        return lease.amount

    def _stand_by_soon(self, lease: Lease, now: float) -> None:
        """:meth:`_stand_by` for a call, which does not wait for the store: until the
        update lands (or if it fails) the store holds more than the lease needs, never less."""
        amount = self._stand_by(lease, now)
        if amount is not None:
            lease.resizing = asyncio.get_running_loop().create_task(
                self._resize_standby(lease, amount), name="billing:lease-standby", context=contextvars.Context())
            lease.resizing.add_done_callback(_retrieve)

    async def _resize_standby(self, lease: Lease, amount: int) -> None:
        try:
            await self.store.resize(lease.reservation, amount)
        except Exception as exc:  # noqa: BLE001 - it holds the lease's whole amount until released
            log.warning("billing: could not cut a standing-by budget lease down (%s: %s); it holds its whole "
                        "amount until released", type(exc).__name__, exc)
        finally:
            lease.resizing = None

    def _forget(self, lease: Lease) -> None:
        """A retired lease the store holds no more (a sweep running beside another, as a
        test's or the shutdown's, may have let it go first)."""
        with contextlib.suppress(ValueError):
            self._retired.remove(lease)

    async def close(self) -> None:
        """Retire every lease and release those whose calls have ended (the rest expire)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for lease in [*self._active.values(), *self._next.values()]:
            self._retire(lease)
        try:
            await self.sweep(final=True)
        except Exception as exc:  # noqa: BLE001 - they expire by themselves
            log.warning("billing: could not release budget leases at shutdown (%s: %s); they expire in %.0f s",
                        type(exc).__name__, exc, self._ttl + self._seconds)

    @property
    def held(self) -> int:
        """Leases this process holds in the store (admitting or retired)."""
        return len(self._active) + len(self._next) + len(self._retired)


def _retrieve(task: asyncio.Task[Lease | None] | asyncio.Task[None]) -> None:
    """A lease's (or a shrink's) failure reaches its waiters; none may be left to read it."""
    if not task.cancelled():
        task.exception()
