"""One round trip for many calls: what arrives while a round trip is in flight goes in the next.

Budget reservations of one process all go to the same shared store, and most of them to
the same few budgets (a busy key, its subject). Sent one by one, every call pays a round
trip, and the store serialises them per budget anyway (a lock in PostgreSQL, a script in
Redis), so a burst of one key's calls queues behind that budget's lock. A
:class:`Coalescer` keeps at most one round trip in flight per store: the first call is sent
at once, and every call arriving meanwhile waits for it to end and then goes in the next
one, up to ``max_batch``. The batch is sent as one statement or one script that answers
each call in the order they arrived, so the answers are exactly those of the calls sent
one after another; an idle store still costs a lone call one round trip.

Failure is shared: a round trip that fails (an error, ``timeout`` seconds without an
answer) fails every call it carried with that error, and the store's ``lost`` callback is
told every item whose answer was lost (failed, or whose caller stopped waiting), so a
reservation that may have been admitted for a call that will never be sent is released
at once instead of holding its budget until it expires.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Coalescer"]

log = logging.getLogger("gateway.billing")

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class Coalescer(Generic[Item, Answer]):
    """Gathers calls into round trips of ``send``, one in flight at a time.

    ``send`` gets the items of a batch in arrival order and returns one answer per item,
    in the same order. ``lost`` (optional, synchronous) gets the items whose answer no
    caller received, with the answer when there was one (None when the round trip failed).
    """

    def __init__(
        self,
        send: Callable[[list[Item]], Awaitable[Sequence[Answer]]],
        *,
        max_batch: int = 256,
        timeout: float = 2.0,
        lost: Callable[[list[tuple[Item, Answer | None]]], None] | None = None,
        name: str = "store",
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._send = send
        self._max_batch = max_batch
        self._timeout = timeout
        self._lost = lost
        self._name = name
        self._waiting: deque[tuple[Item, asyncio.Future[Answer]]] = deque()
        self._runner: asyncio.Task[None] | None = None
        #: Round trips sent and items they carried (for tests and the bench).
        self.round_trips = 0
        self.items = 0

    async def submit(self, item: Item) -> Answer:
        """Send ``item`` with whatever else is waiting; its own answer (or the batch's error)."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._runner is None:
            # A context of its own: the round trips serve every caller, not the first one
            # (whose request id its log lines would otherwise carry).
            self._runner = asyncio.get_running_loop().create_task(
                self._run(), name=f"coalesce:{self._name}", context=contextvars.Context())
        return await future

    async def close(self) -> None:
        """Let the round trip in flight finish (bounded by ``timeout``); fail what waits."""
        runner = self._runner
        if runner is not None:
            await asyncio.wait([runner], timeout=self._timeout + 1)
            if not runner.done():
                runner.cancel()
        while self._waiting:
            _item, future = self._waiting.popleft()
            if not future.done():
                future.set_exception(RuntimeError(f"the {self._name} is closed"))

    async def _run(self) -> None:
        try:
            while self._waiting:
                batch: list[tuple[Item, asyncio.Future[Answer]]] = []
                while self._waiting and len(batch) < self._max_batch:
                    item, future = self._waiting.popleft()
                    if not future.done():  # a caller that stopped waiting before it was sent
                        batch.append((item, future))
                if batch:
                    await self._round_trip(batch)
        finally:
            self._runner = None

    async def _round_trip(self, batch: list[tuple[Item, asyncio.Future[Answer]]]) -> None:
        self.round_trips += 1
        self.items += len(batch)
        try:
            async with asyncio.timeout(self._timeout):
                answers = await self._send([item for item, _ in batch])
            if len(answers) != len(batch):
                raise RuntimeError(f"the {self._name} answered {len(answers)} of {len(batch)} calls")
        except asyncio.CancelledError:
            self._fail(batch, RuntimeError(f"the {self._name}'s round trip was cancelled"))
            raise
        except TimeoutError:
            self._fail(batch, TimeoutError(f"no answer from the {self._name} within {self._timeout:g} s "
                                           f"({len(batch)} call(s) in the round trip)"))
            return
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets it
            self._fail(batch, exc)
            return
        lost: list[tuple[Item, Answer | None]] = []
        for (item, future), answer in zip(batch, answers, strict=True):
            if future.done():
                lost.append((item, answer))
            else:
                future.set_result(answer)
        if lost:
            self._tell_lost(lost)

    def _fail(self, batch: list[tuple[Item, asyncio.Future[Answer]]], exc: BaseException) -> None:
        for _item, future in batch:
            if not future.done():
                future.set_exception(exc)
        self._tell_lost([(item, None) for item, _ in batch])

    def _tell_lost(self, lost: list[tuple[Item, Answer | None]]) -> None:
        if self._lost is None:
            return
        try:
            self._lost(lost)
        except Exception:  # a release is best effort; the TTL is the backstop
            log.exception("billing: releasing %d lost %s answer(s) failed", len(lost), self._name)
