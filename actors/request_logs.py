"""RequestLogActor: the bodies of opted-in calls land in PostgreSQL once, off the hot path.

State it owns: a journal of its own (:mod:`gateway.billing.journal`, the billing
journal's class under ``<BILLING_JOURNAL_DIR>/request-logs/<ledger id>``, so request
logs never slow or share a segment with the ledger's rows) and the loops that commit it,
ship it and purge expired rows.

* :meth:`RequestLogHandle.store` (from the edge, when a call ends) tells the actor a
  :class:`~gateway.billing.request_log.CapturedCall`: references only, no encoding on
  the request's path. The actor encodes it (:func:`~gateway.billing.request_log.to_line`)
  and appends it; a full mailbox appends directly (synchronous, never dropped).
* Group commit: one ``fsync`` for whatever was appended, at most every ``fsync_interval``.
* Shipping: every ``ship_interval`` (BILLING_SHIP_INTERVAL_SECONDS, as the ledger's) the
  active segment is sealed and every sealed one shipped in batches bounded by lines and
  bytes, ``ON CONFLICT (call_id) DO NOTHING``, and deleted once stored: a crash replays
  what it left on the next start, and a row shipped twice is stored once. A batch
  PostgreSQL refuses is shipped line by line; a line it refuses is set aside in
  ``rejected.jsonl``.
* Retention: every ``purge_interval`` rows past their ``expires_at`` are deleted (every
  replica does it; deleting twice is harmless); :class:`Purge` does it now.

Why the commit and ship loops are not shared with :mod:`actors.billing`: billing's
interleave budget counters and spend refreshes with every ship; these are the plain
loops, and the journal itself (the part that must be right) is the same class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from actors.runtime import Actor, ActorRef, ActorStopped, MailboxFull
from gateway.billing.journal import Journal, Segment
from gateway.billing.ledger import NIL_UUID, fetch_ledger_id
from gateway.billing.request_log import CapturedCall, purge_expired, ship_lines, to_line

__all__ = ["Flush", "Purge", "RequestLogActor", "RequestLogHandle", "Store"]

log = logging.getLogger("gateway.request_logs")

#: Bounds of one INSERT: lines and bytes (a line holds up to two bodies).
MAX_BATCH_LINES = 1000
MAX_BATCH_BYTES = 8 * 1024 * 1024
_DATA_ERRORS = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError)


@dataclass(frozen=True, slots=True)
class Store:
    """One finished call's bodies (tell)."""

    call: CapturedCall


@dataclass(frozen=True, slots=True)
class Flush:
    """Ship everything stored so far (ask): True once PostgreSQL has it."""


@dataclass(frozen=True, slots=True)
class Purge:
    """Delete the expired rows now (ask): how many were deleted."""


def batches(lines: list[bytes], max_lines: int = MAX_BATCH_LINES, max_bytes: int = MAX_BATCH_BYTES) -> list[list[bytes]]:
    """``lines`` in order, cut into batches of at most ``max_lines`` lines and about
    ``max_bytes`` bytes (a single larger line goes alone)."""
    out: list[list[bytes]] = []
    current: list[bytes] = []
    size = 0
    for line in lines:
        if current and (len(current) >= max_lines or size + len(line) > max_bytes):
            out.append(current)
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        out.append(current)
    return out


class RequestLogActor(Actor[Store | Flush | Purge]):
    name = "request_logs"
    mailbox_size = 4096

    def __init__(
        self, pool: asyncpg.Pool, journal_root: Path, *, fsync_interval: float = 0.005,
        ship_interval: float = 0.1, purge_interval: float = 60.0, ship_timeout: float = 5.0,
        drain_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self._pool = pool
        self._journal_root = journal_root
        self._fsync_interval = fsync_interval
        self._ship_interval = ship_interval
        self._purge_interval = purge_interval
        self._ship_timeout = ship_timeout
        self._drain_timeout = drain_timeout
        self._journal: Journal | None = None
        self._stopping = False
        self._wake_shipper = asyncio.Event()
        self._flush_waiters: list[asyncio.Future[bool]] = []
        self._tasks_running: list[asyncio.Task[None]] = []
        self.stored = 0
        self.shipped = 0
        self.duplicates = 0
        self.overflowed = 0
        self.purged = 0
        self.reachable = True

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise RuntimeError("request-log actor used before it started")
        return self._journal

    # -- lifecycle ------------------------------------------------------------------------
    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._ship_timeout * 2):
            ledger_id = await fetch_ledger_id(self._pool)
        self._journal = await loop.run_in_executor(None, Journal.open, self._journal_root / str(ledger_id))
        self._tasks_running = [
            loop.create_task(self._commit_forever(), name="request_logs:commit"),
            loop.create_task(self._ship_forever(), name="request_logs:ship"),
        ]

    async def on_stop(self) -> None:
        """Drain: last fsync, last ship; what PostgreSQL cannot take stays on disk."""
        journal = self.journal
        self._stopping = True
        self._wake_shipper.set()
        journal.wake()
        for task in self._tasks_running:  # asked to finish, never cancelled mid-write
            with contextlib.suppress(Exception):
                await task
        try:
            await journal.commit()
        except OSError as exc:
            log.error("request-log journal: final commit failed: %s", exc)
        try:
            async with asyncio.timeout(self._drain_timeout):
                await self._ship_cycle()
        except TimeoutError:
            pass
        if journal.pending_events:
            log.warning("request logs: %d row(s) stay in %s; they are shipped at the next start",
                        journal.pending_events, journal.directory)
        journal.close()

    # -- messages -------------------------------------------------------------------------
    async def receive(self, msg: Store | Flush | Purge) -> Any:
        if isinstance(msg, Store):
            self.ingest(msg.call)
            return None
        if isinstance(msg, Flush):
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._flush_waiters.append(fut)
            self._wake_shipper.set()
            return fut
        if isinstance(msg, Purge):
            return await self._purge()
        raise TypeError(f"unexpected message {msg!r}")

    def ingest(self, call: CapturedCall) -> None:
        """Encode and journal one call. Synchronous, so the handle may call it directly."""
        record = call.record
        self.journal.append(to_line(call), record.api_key_id or NIL_UUID, record.subject_id or NIL_UUID, 0)
        self.stored += 1

    # -- loops ----------------------------------------------------------------------------
    async def _commit_forever(self) -> None:
        journal = self.journal
        while True:
            await journal.wait_for_data()
            try:
                await journal.commit()
            except Exception as exc:  # noqa: BLE001 - the lines stay buffered; retried
                log.error("request-log journal: commit failed (%s); %d row(s) wait in memory", exc, journal.buffered)
                await asyncio.sleep(0.5)
            if self._stopping:
                return
            await asyncio.sleep(self._fsync_interval)

    async def _ship_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_purge = loop.time() + self._purge_interval
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_shipper.wait(), self._ship_interval)
            self._wake_shipper.clear()
            if self._stopping:
                return
            try:
                await self._ship_cycle()
                if loop.time() >= next_purge:
                    next_purge = loop.time() + self._purge_interval
                    await self._purge()
            except Exception:
                log.exception("request logs: ship loop error")
                await asyncio.sleep(self._ship_interval)

    async def _ship_cycle(self) -> bool:
        waiters, self._flush_waiters = self._flush_waiters, []
        ok = False
        try:
            ok = await self._ship_all()
        finally:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(ok)
        return ok

    async def _ship_all(self) -> bool:
        journal = self.journal
        try:
            await journal.seal()
        except OSError as exc:
            log.error("request-log journal: cannot seal the active segment: %s", exc)
            return False
        for segment in journal.sealed():
            if not await self._ship_segment(segment):
                return False
        return True

    async def _ship_segment(self, segment: Segment) -> bool:
        journal = self.journal
        try:
            lines = await asyncio.get_running_loop().run_in_executor(None, Journal.read, segment)
        except FileNotFoundError:
            journal.discard(segment)
            return True
        for batch in batches(lines):
            try:
                async with asyncio.timeout(self._ship_timeout):
                    inserted = await ship_lines(self._pool, batch)
            except _DATA_ERRORS as exc:
                log.error("request logs: PostgreSQL refused a batch (%s); shipping it line by line", exc)
                try:
                    inserted = await self._ship_one_by_one(batch)
                except Exception as exc2:  # noqa: BLE001 - the batch waits on disk
                    self._unreachable(exc2)
                    return False
            except Exception as exc:  # noqa: BLE001 - the batch waits on disk
                self._unreachable(exc)
                return False
            self.shipped += inserted
            self.duplicates += len(batch) - inserted
        journal.discard(segment)
        if not self.reachable:
            self.reachable = True
            log.info("request logs: PostgreSQL reachable again; shipping the journal")
        return True

    async def _ship_one_by_one(self, batch: list[bytes]) -> int:
        inserted = 0
        refused: list[bytes] = []
        for line in batch:
            try:
                async with asyncio.timeout(self._ship_timeout):
                    inserted += await ship_lines(self._pool, [line])
            except _DATA_ERRORS as exc:
                log.error("request logs: a row was refused (%s); kept in rejected.jsonl", exc)
                refused.append(line)
        if refused:
            self.journal.reject(refused)
        return inserted

    def _unreachable(self, exc: BaseException) -> None:
        if self.reachable:
            self.reachable = False
            log.warning("request logs: PostgreSQL unreachable (%s: %s); %d row(s) wait in %s",
                        type(exc).__name__, exc, self.journal.pending_events, self.journal.directory)

    async def _purge(self) -> int:
        try:
            async with asyncio.timeout(self._ship_timeout * 4):
                deleted = await purge_expired(self._pool)
        except Exception as exc:  # noqa: BLE001 - retried at the next interval
            log.warning("request logs: purge of expired rows failed: %s: %s", type(exc).__name__, exc)
            return 0
        self.purged += deleted
        if deleted:
            log.info("request logs: %d expired row(s) deleted", deleted)
        return deleted


class RequestLogHandle:
    """What the edge holds: store a call's bodies, flush, purge."""

    __slots__ = ("_actor", "_ref")

    def __init__(self, actor: RequestLogActor, ref: ActorRef[Any]) -> None:
        self._actor = actor
        self._ref = ref

    def store(self, call: CapturedCall) -> None:
        """One call's bodies. Never waits, never raises."""
        try:
            self._ref.tell(Store(call))
        except (MailboxFull, ActorStopped):
            self._actor.overflowed += 1
            try:
                self._actor.ingest(call)
            except Exception:
                log.exception("request logs: LOST the bodies of call %s (%s)", call.record.call_id,
                              call.record.request_id)

    async def flush(self, timeout: float = 10.0) -> bool:
        """Ship everything stored so far; True once PostgreSQL has it."""
        return bool(await self._ref.ask(Flush(), timeout=timeout))

    async def purge(self, timeout: float = 30.0) -> int:
        """Delete the expired rows now; how many were deleted."""
        return int(await self._ref.ask(Purge(), timeout=timeout))

    @property
    def pending(self) -> int:
        journal = self._actor._journal
        return journal.pending_events if journal is not None else 0

    def metric_families(self) -> Iterable[Metric]:
        """For ``/metrics`` (read on the loop at each scrape)."""
        actor = self._actor
        yield GaugeMetricFamily("gateway_request_logs_pending_rows",
                                "Request-log rows journaled but not yet in PostgreSQL.", value=self.pending)
        yield CounterMetricFamily("gateway_request_logs_stored_total",
                                  "Request-log rows journaled (calls whose bodies are kept).", value=actor.stored)
        yield CounterMetricFamily("gateway_request_logs_purged_total",
                                  "Request-log rows deleted after their retention.", value=actor.purged)
