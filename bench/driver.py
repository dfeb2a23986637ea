"""The load driver: bounded closed and open loops over an aiohttp client.

* Closed loop: ``concurrency`` workers each send the next request when the last one
  answered, for a fixed time. It measures throughput.
* Open loop: requests are started at a fixed arrival rate whatever the answers do, and
  each latency is counted from the request's *scheduled* start, so a stalled server is
  not hidden by a driver that waits for it (no coordinated omission). The number in
  flight is bounded; a request that would exceed it is counted as ``shed``.

Both stop by themselves: a fixed duration, a fixed request count, a per-request timeout.
Streams are read line by line to time the first chunk and count every ``data:`` event.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

__all__ = [
    "Call",
    "Outcome",
    "Result",
    "closed_loop",
    "open_loop",
    "percentile",
    "session_for",
]

#: The driver never waits longer than this for one answer.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=10)


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    ok: bool
    error: str | None = None
    ttfc: float | None = None  # seconds to the first ``data:`` event (streams)
    events: int = 0  # ``data:`` events other than [DONE]
    done: bool = False  # saw ``data: [DONE]``
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Call:
    """How to send one request to one target."""

    url: str
    body: bytes
    headers: dict[str, str]
    stream: bool = False

    @classmethod
    def chat(cls, url: str, body: dict[str, Any], key: str | None = None) -> Call:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return cls(url, orjson.dumps(body), headers, stream=body.get("stream") is True)

    async def send(self, session: aiohttp.ClientSession) -> Outcome:
        started = time.perf_counter()
        try:
            async with session.post(self.url, data=self.body, headers=self.headers) as resp:
                if resp.status != 200:
                    await resp.read()
                    return Outcome(False, f"http {resp.status}", stream=self.stream)
                if not self.stream:
                    await resp.read()
                    return Outcome(True)
                return await _read_stream(resp, started)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            return Outcome(False, type(exc).__name__, stream=self.stream)


async def _read_stream(resp: aiohttp.ClientResponse, started: float) -> Outcome:
    """Count the events of a stream; the first chunk is timed from the request's start."""
    out = Outcome(True, stream=True)
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        if out.ttfc is None:
            out.ttfc = time.perf_counter() - started
        if line.startswith(b"data: [DONE]"):
            out.done = True
        elif line.startswith(b'data: {"error"'):
            out.ok, out.error = False, "error event"
        else:
            out.events += 1
    if not out.done and out.ok:
        out.ok, out.error = False, "no [DONE]"
    return out


@dataclass
class Result:
    """Everything one loop measured (latencies in seconds)."""

    latencies: list[float] = field(default_factory=list)
    #: Latencies of whole (non-streaming) calls only, for mixed loads.
    whole_latencies: list[float] = field(default_factory=list)
    ttfcs: list[float] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    duration: float = 0.0
    shed: int = 0  # open loop: not sent because max_in_flight was reached
    lateness: list[float] = field(default_factory=list)  # open loop: start delay vs schedule
    driver_cpu: float = 0.0  # CPU seconds the driver itself used

    @property
    def count(self) -> int:
        return len(self.latencies)

    @property
    def ok(self) -> int:
        return len(self.latencies) - sum(self.errors.values())

    @property
    def rps(self) -> float:
        return self.ok / self.duration if self.duration else 0.0

    def add(self, outcome: Outcome, latency: float) -> None:
        self.latencies.append(latency)
        if not outcome.stream:
            self.whole_latencies.append(latency)
        if not outcome.ok:
            self.errors[outcome.error or "error"] += 1
        if outcome.ttfc is not None:
            self.ttfcs.append(outcome.ttfc)
        if outcome.done or outcome.events:
            self.events.append(outcome.events)

    def summary(self) -> dict[str, Any]:
        """Counts and percentiles in milliseconds, for the JSON report."""
        out: dict[str, Any] = {
            "requests": self.count,
            "ok": self.ok,
            "errors": dict(self.errors),
            "duration_s": round(self.duration, 3),
            "rps": round(self.rps, 1),
            "driver_cpu_pct": round(100 * self.driver_cpu / self.duration, 1) if self.duration else None,
        }
        for name, values in (("latency", self.latencies), ("ttfc", self.ttfcs), ("lateness", self.lateness)):
            if values:
                ordered = sorted(values)
                out[name] = {
                    f"p{q}": round(1000 * percentile(ordered, q), 3) for q in (50, 90, 99)
                } | {"max": round(1000 * ordered[-1], 3), "mean": round(1000 * sum(ordered) / len(ordered), 3)}
        if self.shed:
            out["shed"] = self.shed
        if self.events:
            out["events_per_stream"] = {"min": min(self.events), "max": max(self.events), "total": sum(self.events)}
        return out


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 if empty)."""
    if not ordered:
        return 0.0
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def session_for(connections: int) -> aiohttp.ClientSession:
    """A client session keeping up to ``connections`` keep-alive connections (0: any)."""
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT, auto_decompress=False)


def _call_at_warmup_end(warmup: float, hook: Callable[[], None] | None) -> asyncio.Handle | None:
    """``hook`` called ``warmup`` seconds from now (at once without a warm-up)."""
    if hook is None:
        return None
    if warmup <= 0:
        hook()
        return None
    return asyncio.get_running_loop().call_later(warmup, hook)


async def closed_loop(
    calls: Callable[[int], Call], *, concurrency: int, duration: float, warmup: float = 0.0,
    max_requests: int | None = None, stagger: float = 0.0, on_measure: Callable[[], None] | None = None,
) -> Result:
    """``concurrency`` workers send back to back for ``warmup + duration`` seconds.

    Only requests started after the warm-up count. ``calls(i)`` gives the i-th request,
    so a mix (streams among whole answers) is possible. ``max_requests`` bounds the run.
    ``stagger`` spreads the workers' first requests over that many seconds, so long
    requests (streams) do not all start and end together in waves. ``on_measure`` is
    called when the warm-up ends: a server's CPU read from then on is the counted
    requests' (and the ones in flight at that moment, which the tail's make up for).
    """
    result = Result()
    sent = 0
    async with session_for(concurrency) as session:
        cpu0 = time.process_time()
        start = time.perf_counter()
        measure_from = start + warmup
        end = measure_from + duration
        measuring = _call_at_warmup_end(warmup, on_measure)

        async def worker(k: int) -> None:
            nonlocal sent
            if stagger:
                await asyncio.sleep(stagger * k / concurrency)
            while (t0 := time.perf_counter()) < end and (max_requests is None or sent < max_requests):
                call = calls(sent)
                sent += 1
                outcome = await call.send(session)
                if t0 >= measure_from:
                    result.add(outcome, time.perf_counter() - t0)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        if measuring is not None:
            measuring.cancel()  # a run bounded by max_requests may end before its warm-up did
        result.duration = min(time.perf_counter(), end) - measure_from
        result.driver_cpu = time.process_time() - cpu0
    return result


async def open_loop(
    calls: Callable[[int], Call], *, rate: float, duration: float, warmup: float = 0.0,
    max_in_flight: int = 2000, during: Callable[[], Awaitable[None]] | None = None,
    on_measure: Callable[[], None] | None = None,
) -> Result:
    """Start ``rate`` requests per second for ``warmup + duration`` seconds, then wait.

    Latency is measured from each request's scheduled start. ``during`` runs alongside
    (e.g. a scraper) and is cancelled when the last request is scheduled. ``on_measure``
    is called when the warm-up ends, as :func:`closed_loop` calls it.
    """
    result = Result()
    total = int(rate * (warmup + duration))
    warm = int(rate * warmup)
    in_flight = 0
    tasks: set[asyncio.Task[None]] = set()
    async with session_for(0) as session:

        async def one(call: Call, scheduled: float, measured: bool) -> None:
            nonlocal in_flight
            in_flight += 1
            try:
                if measured:
                    result.lateness.append(time.perf_counter() - scheduled)
                outcome = await call.send(session)
                if measured:
                    result.add(outcome, time.perf_counter() - scheduled)
            finally:
                in_flight -= 1

        side = asyncio.ensure_future(during()) if during is not None else None
        cpu0 = time.process_time()
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        measuring = _call_at_warmup_end(warm / rate, on_measure)
        try:
            for i in range(total):
                scheduled = start + i / rate
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if in_flight >= max_in_flight:
                    if i >= warm:
                        result.shed += 1
                    continue
                task = loop.create_task(one(calls(i), scheduled, i >= warm))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            if side is not None:
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)
        if tasks:
            await asyncio.wait(list(tasks))
        if measuring is not None:
            measuring.cancel()
        result.duration = duration
        result.driver_cpu = time.process_time() - cpu0
    return result
