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
* Shipping: every ``ship_interval`` (BILLING_SHIP_INTERVAL_SECONDS, as the ledger's) while
  anything waits to be shipped (an idle shipper sleeps until a line comes, a flush, the stop
  or the next purge: no wake-ups on a gateway where no route logs bodies), the
  active segment is sealed and every sealed one shipped in batches bounded by lines and
  bytes, ``ON CONFLICT (call_id) DO NOTHING``, and deleted once stored: a crash replays
  what it left on the next start, and a row shipped twice is stored once. A batch
  PostgreSQL refuses is shipped line by line; a line it refuses is set aside in
  ``rejected.jsonl``.
* Retention: every ``purge_interval`` rows past their ``expires_at`` are deleted (every
  replica does it; deleting twice is harmless); :class:`Purge` does it now.

The commit and the shipping are billing's too (:mod:`gateway.billing.shipping`); only the
schedule is this actor's: billing interleaves spend refreshes with its ships, this one
purges expired rows.
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
from gateway.billing.journal import Journal
from gateway.billing.ledger import NIL_UUID, fetch_ledger_id
from gateway.billing.request_log import CapturedCall, purge_expired, ship_lines, to_line
from gateway.billing.shipping import JournalShipper

__all__ = ["Flush", "Purge", "RequestLogActor", "RequestLogHandle", "Store"]

log = logging.getLogger("gateway.request_logs")

#: Bounds of one INSERT: lines and bytes (a line holds up to two bodies).
MAX_BATCH_LINES = 1000
MAX_BATCH_BYTES = 8 * 1024 * 1024


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
        self, pool: asyncpg.Pool, journal_root: Path, *, fsync_interval: float = 0.02,
        ship_interval: float = 1.0, purge_interval: float = 60.0, ship_timeout: float = 5.0,
        drain_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self._pool = pool
        self._journal_root = journal_root
        self._ship_interval = ship_interval
        self._purge_interval = purge_interval
        self._ship_timeout = ship_timeout
        self._drain_timeout = drain_timeout
        self._journal: Journal | None = None
        self._stopping = False
        self._wake_shipper = asyncio.Event()
        self._shipping = JournalShipper(
            pool, ship_lines, batches=batches, ship_timeout=ship_timeout, fsync_interval=fsync_interval,
            log=log, name="request logs", store="PostgreSQL",
        )
        self._tasks_running: list[asyncio.Task[None]] = []
        self.stored = 0
        self.overflowed = 0
        self.purged = 0

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
        self._shipping.journal = self._journal
        self._tasks_running = [
            loop.create_task(self._shipping.commit_forever(), name="request_logs:commit"),
            loop.create_task(self._ship_forever(), name="request_logs:ship"),
        ]

    async def on_stop(self) -> None:
        """Drain: last fsync, last ship; what PostgreSQL cannot take stays on disk."""
        journal = self.journal
        self._stopping = self._shipping.stopping = True
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
                await self._shipping.ship_cycle()
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
            self._shipping.flush_waiters.append(fut)
            self._wake_shipper.set()
            self.journal.wake()  # a shipper idle with nothing to ship waits on the journal
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
    async def _ship_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_purge = loop.time() + self._purge_interval
        journal = self.journal
        while not self._stopping:
            if not journal.unshipped and not self._wake_shipper.is_set():
                # Nothing to ship (no route logs bodies, or all is shipped): sleep until a
                # line is appended, a flush, the stop or the next purge, not every interval.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(journal.wait_for_lines(), max(0.0, next_purge - loop.time()))
                if self._stopping:
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_shipper.wait(), self._ship_interval)
            self._wake_shipper.clear()
            if self._stopping:
                return
            try:
                await self._shipping.ship_cycle()
                if loop.time() >= next_purge:
                    next_purge = loop.time() + self._purge_interval
                    await self._purge()
            except Exception:
                log.exception("request logs: ship loop error")
                await asyncio.sleep(self._ship_interval)

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
