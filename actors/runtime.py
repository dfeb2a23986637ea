"""The actor runtime: bounded mailboxes, ``tell``/``ask`` handles, supervision.

An actor is one asyncio task that owns its state and reads a bounded mailbox. Callers
hold an :class:`ActorRef`, never the actor:

* ``tell(msg)`` never waits; a full mailbox raises :class:`MailboxFull` at once, which the
  edge answers as 503 ``overloaded`` (a full mailbox is an answer, not a wait).
* ``ask(msg)`` awaits a reply under a deadline; an error raised while handling it is
  raised to the asker, and a dead or stopping actor fails the ask instead of hanging.
* Slow I/O runs as a task (:meth:`Actor.spawn`) whose outcome comes back on an internal,
  unbounded lane that is served before the mailbox, so results never compete with callers
  for mailbox space.
* A loop that crashes (an error outside a single message's handling) is restarted by the
  supervisor, with backoff, and counted; a failed tell is logged and the loop goes on.
* Stopping drains what is queued, then runs :meth:`Actor.on_stop`, all within a bound;
  what is still queued after the bound is answered with :class:`ActorStopped`.

The OpenTelemetry context of the sender travels inside each envelope: context variables
do not cross a queue into another task by themselves.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from opentelemetry import context as otel_context

__all__ = [
    "Actor",
    "ActorError",
    "ActorRef",
    "ActorStopped",
    "AskTimeout",
    "MailboxFull",
    "Supervisor",
]

log = logging.getLogger("gateway.actors")

M = TypeVar("M")
R = TypeVar("R")


class ActorError(Exception):
    """Root of the runtime's own errors."""


class MailboxFull(ActorError):
    """The actor's mailbox is at its bound: shed this request."""

    def __init__(self, actor: str) -> None:
        super().__init__(f"mailbox of {actor} is full")
        self.actor = actor


class ActorStopped(ActorError):
    """The actor is stopping or stopped and takes no more messages."""

    def __init__(self, actor: str) -> None:
        super().__init__(f"actor {actor} is stopped")
        self.actor = actor


class AskTimeout(ActorError, TimeoutError):
    """The actor did not answer an ask before its deadline."""

    def __init__(self, actor: str, deadline: float) -> None:
        super().__init__(f"actor {actor} did not answer within {deadline:.3f}s")
        self.actor = actor


class _State(enum.Enum):
    NEW = "new"  # constructed, not started
    RUNNING = "running"  # loop serving the mailbox
    STOPPING = "stopping"  # intake closed, draining what is queued
    STOPPED = "stopped"  # loop ended; every ask fails with ActorStopped


@dataclass(slots=True)
class _Envelope:
    msg: Any
    reply: asyncio.Future[Any] | None
    trace: otel_context.Context = field(default_factory=otel_context.get_current)


def _chain(reply: asyncio.Future[Any], actor: str, source: asyncio.Future[Any]) -> None:
    if reply.done():
        return
    if source.cancelled():
        # The actor dropped the work; cancelling the asker's future instead would look,
        # to the asker, as if its own task had been cancelled.
        reply.set_exception(ActorStopped(actor))
    elif (exc := source.exception()) is not None:
        reply.set_exception(exc)
    else:
        reply.set_result(source.result())


@dataclass(frozen=True, slots=True)
class _Internal:
    payload: Any


class _Mailbox:
    """A bounded lane for callers plus an unbounded internal lane served first."""

    __slots__ = ("_external", "_internal", "_maxsize", "_waiter")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("mailbox size must be at least 1")
        self._maxsize = maxsize
        self._external: deque[_Envelope] = deque()
        self._internal: deque[_Envelope] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._external)

    def put(self, env: _Envelope) -> bool:
        if len(self._external) >= self._maxsize:
            return False
        self._external.append(env)
        self._wake()
        return True

    def put_internal(self, env: _Envelope) -> None:
        self._internal.append(env)
        self._wake()

    def pop(self) -> _Envelope | None:
        if self._internal:
            return self._internal.popleft()
        if self._external:
            return self._external.popleft()
        return None

    def drain_external(self) -> list[_Envelope]:
        items = list(self._external)
        self._external.clear()
        return items

    async def wait(self) -> None:
        if self._internal or self._external:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Actor(Generic[M]):
    """Base class: subclass and implement :meth:`receive`.

    Hooks run inside the actor's task, one at a time, never concurrently with each other:
    ``on_start`` once before the first message, ``receive`` per message, ``on_internal``
    per result posted by :meth:`spawn` or :meth:`post_internal`, ``on_restart`` after a
    crash, ``on_stop`` once after the mailbox is drained.
    """

    #: Name used in logs, metrics and errors.
    name: str = "actor"
    #: Bound of the callers' mailbox; a full one answers MailboxFull.
    mailbox_size: int = 1024
    #: Default deadline of ``ask``.
    ask_timeout: float = 5.0

    def __init__(self) -> None:
        self._mailbox = _Mailbox(self.mailbox_size)
        self._state = _State.NEW
        self._tasks: set[asyncio.Task[Any]] = set()
        self.restarts = 0

    # -- hooks -------------------------------------------------------------------------
    async def on_start(self) -> None:
        """Acquire resources; runs before the first message. Raising aborts start."""

    async def receive(self, msg: M) -> Any:
        """Handle one message; the return value answers an ask.

        Returning an ``asyncio.Future`` defers the answer: the asker gets its outcome
        when it resolves, while the loop goes on to the next message.
        """
        raise NotImplementedError

    async def on_internal(self, msg: Any) -> None:
        """Fold back a result posted by a task; an error here crashes the loop."""

    async def on_restart(self, exc: BaseException) -> None:
        """Repair state after the loop crashed with ``exc``; the mailbox is kept."""

    async def on_stop(self) -> None:
        """Flush and release resources; runs after the mailbox is drained."""

    # -- helpers for subclasses -------------------------------------------------------
    def post_internal(self, msg: Any) -> None:
        """Queue ``msg`` for :meth:`on_internal` on the unbounded internal lane."""
        self._mailbox.put_internal(_Envelope(_Internal(msg), None))

    def spawn(
        self,
        coro: Coroutine[Any, Any, R],
        on_done: Callable[[R | None, BaseException | None], Any] | None = None,
    ) -> asyncio.Task[R]:
        """Run slow I/O as a task; ``on_done(result, error)`` becomes an internal message."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def _done(t: asyncio.Task[R]) -> None:
            self._tasks.discard(t)
            if on_done is None or t.cancelled():
                if not t.cancelled() and t.exception() is not None:
                    log.warning("%s: background task failed: %r", self.name, t.exception())
                return
            exc = t.exception()
            self.post_internal(on_done(None if exc else t.result(), exc))

        task.add_done_callback(_done)
        return task

    @property
    def mailbox_depth(self) -> int:
        """How many callers' messages wait right now."""
        return self._mailbox.qsize()

    @property
    def running(self) -> bool:
        return self._state is _State.RUNNING


class ActorRef(Generic[M]):
    """The handle callers hold: ``tell``, ``ask``; never the actor's state."""

    __slots__ = ("_actor", "_mailbox", "name")

    def __init__(self, actor: Actor[M]) -> None:
        self._actor = actor
        self._mailbox = actor._mailbox
        self.name = actor.name

    def tell(self, msg: M) -> None:
        """Queue ``msg`` without waiting; raises MailboxFull or ActorStopped."""
        if self._actor._state is not _State.RUNNING:
            raise ActorStopped(self.name)
        if not self._mailbox.put(_Envelope(msg, None)):
            raise MailboxFull(self.name)

    async def ask(self, msg: M, timeout: float | None = None) -> Any:
        """Send ``msg`` and await the reply, at most ``timeout`` seconds."""
        if self._actor._state is not _State.RUNNING:
            raise ActorStopped(self.name)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self._mailbox.put(_Envelope(msg, fut)):
            raise MailboxFull(self.name)
        deadline = self._actor.ask_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return fut.result()
            raise AskTimeout(self.name, deadline) from None

    @property
    def alive(self) -> bool:
        return self._actor._state is _State.RUNNING

    @property
    def mailbox_depth(self) -> int:
        return self._mailbox.qsize()

    @property
    def restarts(self) -> int:
        return self._actor.restarts

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r}, state={self._actor._state.value})"


class _Cell:
    """One supervised actor: its loop task and its restart policy."""

    def __init__(self, actor: Actor[Any], max_backoff: float) -> None:
        self.actor = actor
        self.ref: ActorRef[Any] = ActorRef(actor)
        self.task: asyncio.Task[None] | None = None
        self._max_backoff = max_backoff
        self._restart_handle: asyncio.TimerHandle | None = None
        #: Held so the event loop (which keeps only weak references to tasks) cannot drop it.
        self._restart_task: asyncio.Task[None] | None = None
        #: Replies deferred by ``receive`` and not yet resolved; failed at stop, never left hanging.
        self._deferred: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        actor = self.actor
        if actor._state is not _State.NEW:
            raise RuntimeError(f"actor {actor.name} was already started ({actor._state.value})")
        await actor.on_start()
        actor._state = _State.RUNNING
        self._run_loop()

    def _run_loop(self) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self._loop(), name=f"actor:{self.actor.name}"
        )
        self.task.add_done_callback(self._on_loop_done)

    async def _loop(self) -> None:
        actor = self.actor
        mailbox = actor._mailbox
        while True:
            env = mailbox.pop()
            if env is None:
                if actor._state is not _State.RUNNING:
                    return
                await mailbox.wait()
                continue
            await self._handle(env)

    async def _handle(self, env: _Envelope) -> None:
        actor = self.actor
        token = otel_context.attach(env.trace)
        try:
            if env.msg.__class__ is _Internal:
                await actor.on_internal(env.msg.payload)
                return
            try:
                result = await actor.receive(env.msg)
            except asyncio.CancelledError:
                # Aborted by a stop past its bound: the asker learns now, not at its deadline.
                if env.reply is not None and not env.reply.done():
                    env.reply.set_exception(ActorStopped(actor.name))
                raise
            except Exception as exc:
                if env.reply is None:
                    log.exception("%s: tell %s failed", actor.name, type(env.msg).__name__)
                elif not env.reply.done():
                    env.reply.set_exception(exc)
                return
            if env.reply is None or env.reply.done():
                return
            if isinstance(result, asyncio.Future):
                # A deferred reply: the actor answers later without blocking its loop.
                self._deferred.add(env.reply)
                env.reply.add_done_callback(self._deferred.discard)
                result.add_done_callback(partial(_chain, env.reply, actor.name))
            else:
                env.reply.set_result(result)
        finally:
            otel_context.detach(token)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        actor = self.actor
        if task.cancelled() or actor._state is not _State.RUNNING:
            return
        exc = task.exception()
        if exc is None:
            return
        actor.restarts += 1
        delay = min(self._max_backoff, 0.01 * 2 ** min(actor.restarts, 10))
        log.error("actor %s crashed (%r); restart %d in %.2fs", actor.name, exc, actor.restarts, delay)
        loop = asyncio.get_running_loop()
        self._restart_handle = loop.call_later(delay, self._begin_restart, exc)

    def _begin_restart(self, exc: BaseException) -> None:
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(exc))

    async def _restart(self, exc: BaseException) -> None:
        actor = self.actor
        if actor._state is not _State.RUNNING:
            return
        try:
            await actor.on_restart(exc)
        except Exception:
            log.exception("actor %s: on_restart failed", actor.name)
        if actor._state is not _State.STOPPED:
            self._run_loop()  # if a stop began meanwhile, this loop drains and ends

    async def stop(self, timeout: float) -> None:
        actor = self.actor
        if actor._state in (_State.NEW, _State.STOPPED):
            actor._state = _State.STOPPED
            return
        actor._state = _State.STOPPING
        if self._restart_handle is not None:
            self._restart_handle.cancel()
        actor._mailbox._wake()
        try:
            async with asyncio.timeout(timeout):
                await self._drain()
                await actor.on_stop()
        except TimeoutError:
            log.error("actor %s did not stop within %.1fs; aborting", actor.name, timeout)
        except Exception:
            log.exception("actor %s failed while stopping", actor.name)
        finally:
            actor._state = _State.STOPPED
            if self.task is not None and not self.task.done():
                self.task.cancel()
            for env in actor._mailbox.drain_external():
                if env.reply is not None and not env.reply.done():
                    env.reply.set_exception(ActorStopped(actor.name))
            for reply in list(self._deferred):
                if not reply.done():
                    reply.set_exception(ActorStopped(actor.name))
            for t in list(actor._tasks):
                t.cancel()


    async def _drain(self) -> None:
        """Let the loop serve what is queued; if it crashed (before or during the stop),
        serve the rest here, so queued work is not lost and ``on_stop`` still runs."""
        actor = self.actor
        if self._restart_task is not None and not self._restart_task.done():
            # A restart under way (in on_restart) finishes first; its fresh loop then drains.
            await asyncio.shield(self._restart_task)
        task = self.task
        if task is None:
            return
        if not task.done():
            try:
                await asyncio.shield(task)
            except Exception:  # noqa: BLE001 - examined just below
                pass
        if task.cancelled() or task.exception() is None:
            return
        log.error("actor %s: loop crashed while stopping (%r); draining by hand", actor.name, task.exception())
        while (env := actor._mailbox.pop()) is not None:
            try:
                await self._handle(env)
            except Exception:
                log.exception("actor %s: message failed while stopping", actor.name)


class Supervisor:
    """Starts actors in order, restarts crashed loops, stops them in reverse order.

    Start order is dependency order (billing first, so it stops last and drains after
    everything that tells it has stopped).
    """

    def __init__(self, *, max_backoff: float = 5.0, stop_timeout: float = 10.0) -> None:
        self._cells: list[_Cell] = []
        self._max_backoff = max_backoff
        self._stop_timeout = stop_timeout

    async def start(self, actor: Actor[M]) -> ActorRef[M]:
        """Start ``actor`` (runs ``on_start``) and return its handle."""
        cell = _Cell(actor, self._max_backoff)
        await cell.start()
        self._cells.append(cell)
        return cell.ref

    def restarts(self) -> dict[str, int]:
        """Restarts per actor name, for metrics and /readyz."""
        return {c.actor.name: c.actor.restarts for c in self._cells}

    def refs(self) -> list[ActorRef[Any]]:
        return [c.ref for c in self._cells]

    def not_running(self) -> list[str]:
        """Names of actors whose loop is not serving right now."""
        return [
            c.actor.name
            for c in self._cells
            if not c.actor.running or c.task is None or c.task.done()
        ]

    async def stop(self, timeout: float | None = None) -> None:
        """Stop every actor, last started first, each within ``timeout``."""
        bound = self._stop_timeout if timeout is None else timeout
        # One by one, not gather: an actor stopping later may still tell one stopped after.
        while self._cells:
            cell = self._cells.pop()
            await cell.stop(bound)

