"""A journal's group commit and its shipping into PostgreSQL.

What the billing actor (usage events into the ledger) and the request-log actor (bodies
into ``request_logs``) share: the mechanics that must be right once. Each actor keeps its
own schedule (billing interleaves spend refreshes with its ships) and calls these:

* :meth:`JournalShipper.commit_forever`: one ``fsync`` for whatever was written, at most
  every ``fsync_interval``; a disk error is logged and retried, never the end of the loop.
* :meth:`JournalShipper.ship_cycle`: seal the active segment, ship every sealed one in
  batches (``ship`` inserts idempotently: a batch shipped twice is stored once), delete a
  segment only once all of it is stored, then answer the flushes waiting. A batch
  PostgreSQL refuses as data is shipped line by line; a line it refuses is set aside in the
  journal's ``rejected.jsonl``. Any other failure leaves the segment on disk for the next
  cycle, and one log line says the store is away (another when it is back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import asyncpg

from gateway.billing.journal import Journal, Segment

__all__ = ["JournalShipper", "fixed_batches"]

#: What PostgreSQL answers for rows it will never take (a retry cannot help).
DATA_ERRORS = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError)

ShipLines = Callable[[Any, list[bytes]], Awaitable[int]]


def fixed_batches(size: int) -> Callable[[list[bytes]], Iterable[list[bytes]]]:
    """Batches of at most ``size`` lines, in order."""
    return lambda lines: (lines[start : start + size] for start in range(0, len(lines), size))


class JournalShipper:
    """Commits and ships one journal; counts what it shipped."""

    def __init__(
        self, pool: asyncpg.Pool, ship: ShipLines, *, batches: Callable[[list[bytes]], Iterable[list[bytes]]],
        ship_timeout: float, fsync_interval: float, log: logging.Logger, name: str, store: str,
    ) -> None:
        self._pool = pool
        self._ship = ship
        self._batches = batches
        self._ship_timeout = ship_timeout
        self._fsync_interval = fsync_interval
        self._log = log
        #: In log lines: who ships ("billing") and where to ("the ledger").
        self._name = name
        self._store = store
        self._journal: Journal | None = None
        #: Set to end :meth:`commit_forever` after its current round (never cancelled:
        #: a commit must not be cut while its thread writes).
        self.stopping = False
        self.flush_waiters: list[asyncio.Future[bool]] = []
        self.shipped = 0
        self.duplicates = 0
        self.ship_failures = 0
        self.reachable = True

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise RuntimeError(f"{self._name}: journal used before it was opened")
        return self._journal

    @journal.setter
    def journal(self, journal: Journal) -> None:
        self._journal = journal

    # -- group commit -------------------------------------------------------------------
    async def commit_forever(self) -> None:
        journal = self.journal
        while True:
            await journal.wait_for_data()
            try:
                await journal.commit()
            except OSError as exc:
                self._log.error("%s journal: commit failed (%s); %d line(s) wait to be fsync'd",
                                self._name, exc, journal.buffered)
                await asyncio.sleep(0.5)
            except Exception:  # noqa: BLE001 - a bug must not stop durability: the next round retries
                self._log.exception("%s journal: commit error", self._name)
                await asyncio.sleep(0.5)
            if self.stopping:
                return
            # Group commit: whatever arrives meanwhile goes out with the next fsync.
            await asyncio.sleep(self._fsync_interval)

    # -- shipping -----------------------------------------------------------------------
    async def ship_cycle(self) -> bool:
        """Seal the active segment and ship every sealed one; answer the flushes waiting."""
        waiters, self.flush_waiters = self.flush_waiters, []
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
        sealed = True
        try:
            await journal.seal()
        except OSError as exc:
            self._log.error("%s journal: cannot seal the active segment: %s", self._name, exc)
            sealed = False
        for segment in journal.sealed():
            if not await self._ship_segment(segment):
                return False
        return sealed

    async def _ship_segment(self, segment: Segment) -> bool:
        journal = self.journal
        try:
            lines = await journal.lines_of(segment)
        except FileNotFoundError:
            journal.discard(segment)
            return True
        for batch in self._batches(lines):
            try:
                async with asyncio.timeout(self._ship_timeout):
                    inserted = await self._ship(self._pool, batch)
            except DATA_ERRORS as exc:
                self._log.error("%s: %s refused a batch (%s); shipping it line by line", self._name, self._store, exc)
                try:
                    inserted = await self._ship_one_by_one(batch)
                except Exception as exc2:  # noqa: BLE001 - any failure: the batch waits on disk
                    self._unreachable(exc2)
                    return False
            except Exception as exc:  # noqa: BLE001 - any failure: the batch waits on disk
                self._unreachable(exc)
                return False
            self.shipped += inserted
            self.duplicates += len(batch) - inserted
        await journal.discard_soon(segment)
        if not self.reachable:
            self.reachable = True
            self._log.info("%s: %s reachable again; shipping the journal", self._name, self._store)
        return True

    async def _ship_one_by_one(self, batch: list[bytes]) -> int:
        inserted = 0
        refused: list[bytes] = []
        for line in batch:
            try:
                async with asyncio.timeout(self._ship_timeout):
                    inserted += await self._ship(self._pool, [line])
            except DATA_ERRORS as exc:
                self._log.error("%s: %s refused a line (%s); kept in rejected.jsonl", self._name, self._store, exc)
                refused.append(line)
        if refused:
            self.journal.reject(refused)
        return inserted

    def _unreachable(self, exc: BaseException) -> None:
        self.ship_failures += 1
        if self.reachable:
            self.reachable = False
            self._log.warning(
                "%s: %s unreachable (%s: %s); %d line(s) wait in %s", self._name, self._store,
                type(exc).__name__, exc, self.journal.pending_events, self.journal.directory,
            )
