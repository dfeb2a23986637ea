"""Admission at the edge: a bound on requests in flight, and the drain at shutdown.

Why a bound: every request the data plane accepts runs at once on one event loop. Past
what the machine can serve, accepting more does not queue them fairly, it makes every
one of them slower (and holds two sockets and some memory each) until clients time out
and retry, which is worse. So the ``/v1/*`` routes admit at most ``MAX_IN_FLIGHT``
requests at a time (a stream counts until its last byte) and answer the rest at once
with 503 ``overloaded`` and ``Retry-After: 1``: a fast refusal a client or a load
balancer can act on. ``/healthz`` and ``/readyz`` are never refused: a busy gateway is
not a dead one.

The same gate drains at shutdown (:mod:`gateway.edge.server`): once draining, new ``/v1``
requests get 503 ``shutting_down``; :meth:`AdmissionGate.wait_idle` waits for those in
flight; when the grace period is over, :meth:`AdmissionGate.abort` cancels the rest
with :data:`SHUTDOWN`, so a stream can end with one error event instead of a dead
socket (see :func:`is_shutdown`) and a request not yet answered gets a 503.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.core.errors import Overloaded, ServiceUnavailable
from gateway.http.errors import ErrorShape, error_response, error_shape_for

__all__ = [
    "ADMISSION",
    "SHUTDOWN",
    "AdmissionGate",
    "ShuttingDown",
    "default_max_in_flight",
    "is_shutdown",
    "raise_open_file_limit",
    "shutdown_answer",
]

log = logging.getLogger("gateway.admission")

#: The message of the cancellation :meth:`AdmissionGate.abort` sends to each request.
SHUTDOWN = "gateway shutting down"
#: Only these routes are gated (health and readiness must answer under any load).
GATED_PREFIX = "/v1/"
#: One log line per this many seconds while shedding, not one per refused request.
_SHED_LOG_EVERY = 10.0
#: Sockets a request holds while in flight: the client's and the provider's.
_FDS_PER_REQUEST = 2
#: File descriptors kept aside for the database pool, Redis, logs, idle connections.
_FDS_RESERVED = 256
_DEFAULT_CAP = 4096
_DEFAULT_FLOOR = 64

class ShuttingDown(ServiceUnavailable):
    """The gateway is draining for a restart: retry, another replica will answer."""

    code = "shutting_down"
    default_message = "gateway shutting down; retry the request"


def is_shutdown(exc: BaseException) -> bool:
    """Is this cancellation the shutdown's (:meth:`AdmissionGate.abort`), not a client's?"""
    return isinstance(exc, asyncio.CancelledError) and bool(exc.args) and exc.args[0] == SHUTDOWN


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the new soft limit.

    Thousands of keep-alive clients plus an upstream socket per request outgrow the
    usual soft limit of 1024 long before the CPU is busy. Raising the soft limit up to
    the hard one needs no privilege.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %s to %s: %s", soft, hard, exc)
    return soft


def default_max_in_flight() -> int:
    """``MAX_IN_FLIGHT`` when unset: what the open-file limit allows, within [64, 4096].

    Each request in flight holds two sockets; a few hundred descriptors stay reserved.
    4096 caps it because one event loop serving more streams than that is past the
    point where admitting more helps anyone (raise it explicitly on a big machine).
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(_DEFAULT_FLOOR, min(_DEFAULT_CAP, (soft - _FDS_RESERVED) // _FDS_PER_REQUEST))


class AdmissionGate:
    """Counts the gated requests in flight, refuses past ``limit``, drains at shutdown.

    Owned by the data plane's app (``app[ADMISSION]``); every method runs on the event
    loop, so plain counters need no lock.
    """

    __slots__ = ("_idle", "_last_shed_log", "_tasks", "aborting", "draining", "limit", "shed", "shed_since_log")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the in-flight limit must be at least 1")
        self.limit = limit
        #: Requests refused because the gate was full, since start (for metrics).
        self.shed = 0
        self.shed_since_log = 0
        self.draining = False
        self.aborting = False
        self._tasks: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_shed_log = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def admit(self, shape: ErrorShape = "openai") -> web.Response | None:
        """None if this request may proceed (the caller must :meth:`enter`), else the
        refusal, in the error ``shape`` of the route asked for."""
        if self.draining:
            return error_response(ShuttingDown(retry_after=1), shape)
        if len(self._tasks) >= self.limit:
            self._note_shed()
            return error_response(
                Overloaded(f"gateway overloaded: {self.limit} requests in flight", retry_after=1), shape
            )
        return None

    def enter(self, task: asyncio.Task[object]) -> None:
        self._tasks.add(task)
        self._idle.clear()

    def leave(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight, at most ``timeout`` seconds; True if idle."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def abort(self) -> int:
        """Cancel every request still in flight with :data:`SHUTDOWN`; how many."""
        self.aborting = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel(SHUTDOWN)
        return len(tasks)

    def metric_families(self) -> Iterator[Metric]:
        """``gateway_admission_shed_total`` and ``gateway_admission_limit``, read at scrape
        time (a 503 in ``gateway_requests_total`` may also be an open circuit)."""
        shed = CounterMetricFamily(
            "gateway_admission_shed", "Requests refused with 503 overloaded at the in-flight bound."
        )
        shed.add_metric([], self.shed)
        yield shed
        yield GaugeMetricFamily("gateway_admission_limit", "MAX_IN_FLIGHT: requests admitted at once.", value=self.limit)

    def _note_shed(self) -> None:
        self.shed += 1
        self.shed_since_log += 1
        now = time.monotonic()
        if now - self._last_shed_log >= _SHED_LOG_EVERY:
            log.warning(
                "shedding load: %d request(s) refused with 503 overloaded (MAX_IN_FLIGHT=%d)",
                self.shed_since_log, self.limit,
            )
            self._last_shed_log = now
            self.shed_since_log = 0


ADMISSION = web.AppKey("admission", AdmissionGate)


def shutdown_answer(path: str) -> web.Response:
    """The 503 ``shutting_down`` answer, in the error shape of the route at ``path``."""
    return error_response(ShuttingDown(retry_after=1), error_shape_for(path))
