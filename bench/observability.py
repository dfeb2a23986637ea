"""What observability costs a request, and whether a scrape stalls requests.

    PYTHONPATH=. python bench/observability.py                  # in-process parts only
    PYTHONPATH=. DATABASE_URL=postgresql://... python bench/observability.py --e2e

Part 1 (no services needed): per-call cost of the metrics listener, the request
counter, an access line, and a chat span with tracing off, on with a sampled span and
on but unsampled; then the exposition size and how long a scrape blocks the event
loop when rendered inline versus in the worker thread (a 1 ms ticker measures the
loop's worst lag while the scrape runs).

Part 2 (``--e2e``): a real ``llm-gateway serve`` in front of the fake provider,
``--requests`` chat calls at ``--concurrency``, once without and once with a scraper
hitting ``/metrics`` every ``--scrape-every`` seconds (default 1: fifteen times
Prometheus' default rate), after
``--models`` distinct model names have filled the label space. Reports client-side
p50/p99 for both runs. Results vary with the load on the machine: compare the two
runs of one invocation, not runs across invocations.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gateway.core.config import Settings
from gateway.core.usage import CallRecord, Usage
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import Tracing

REPO = Path(__file__).resolve().parent.parent


class _Discard(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _per_call(label: str, fn: Callable[[int], None], n: int = 20_000) -> None:
    for i in range(min(n, 2000)):  # warm caches and label children
        fn(i)
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    micros = (time.perf_counter() - start) / n * 1e6
    print(f"  {label:<58} {micros:8.2f} µs")


def _record(i: int, models: int = 1) -> CallRecord:
    now = time.monotonic()
    return CallRecord(
        request_id=f"r{i}", api_key_id=uuid.uuid4(), subject_id=None, requested_model=f"model-{i % models}",
        served_model=f"model-{i % models}", provider="fake", deployment="fake/*", status=200, stream=i % 2 == 0,
        usage=Usage(120, 340, cost_usd=0.0004), latency=0.5, ttft=0.05 if i % 2 == 0 else None,
        received_at=now - 0.5, upstream_started_at=now - 0.49, upstream_time=0.48, chunks=40,
    )


def part_costs() -> None:
    print("per-call costs (this process, one thread):")
    metrics = GatewayMetrics()
    records = [_record(i) for i in range(64)]
    _per_call("metrics listener (observe_call)", lambda i: metrics.observe_call(records[i % 64]))
    _per_call("request counter + duration (request_done)", lambda i: metrics.request_done("/v1/chat/completions", 200, 0.01))

    access = logging.getLogger("bench.access")
    access.propagate = False
    from gateway.observability.logs import configure_logging

    root = logging.getLogger()
    saved = list(root.handlers)
    setup = configure_logging("info", "json", stream=io.StringIO())
    fields = {"request_id": "r", "route": "/v1/chat/completions", "status": 200, "latency_ms": 1.2, "key_id": "k",
              "model": "m", "input_tokens": 1, "output_tokens": 2, "cost_usd": 0.0}
    logger = logging.getLogger("gateway.access")
    _per_call("access line handed to the writer thread", lambda i: logger.info("access", extra={"fields": fields}), n=5000)
    setup.stop()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved:
        root.addHandler(h)

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2}
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}

    def span_cycle(tracing: Tracing) -> Callable[[int], None]:
        def run(i: int) -> None:
            record = records[i % 64]
            scope = tracing.start_chat(record, body, headers)
            tracing.end_chat(scope, record, 0.0004)
        return run

    _per_call("chat span, tracing off (traceparent passed on)", span_cycle(Tracing()))
    on = Tracing.from_settings(Settings(), exporter=_Discard())
    _per_call("chat span, tracing on, sampled, batch export", span_cycle(on), n=5000)
    unsampled = {"traceparent": headers["traceparent"][:-2] + "00"}

    def unsampled_cycle(i: int) -> None:
        record = records[i % 64]
        on.end_chat(on.start_chat(record, body, unsampled), record, 0.0004)

    _per_call("chat span, tracing on, parent not sampled", unsampled_cycle, n=5000)
    asyncio.run(on.shutdown())


async def _lag_during(coro_factory: Callable[[], Any]) -> tuple[float, float]:
    """(seconds the coroutine took, worst event-loop lag seen meanwhile)."""
    worst = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal worst
        while not stop:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - before - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await coro_factory()
    took = time.perf_counter() - start
    stop = True
    await tick
    return took, worst


def part_scrape(models: int) -> None:
    metrics = GatewayMetrics()
    for i in range(models * 4):
        metrics.observe_call(_record(i, models))
    for route in ("/v1/chat/completions", "/v1/models", "/healthz", "/readyz", "/metrics"):
        for status in (200, 401, 429, 502):
            metrics.request_done(route, status, 0.01)
    text = metrics.render_now()
    lines = text.count(b"\n")
    print(f"scrape with {models} model names seen: {lines} lines, {len(text) / 1024:.0f} KiB")

    async def inline() -> None:
        metrics.render_now()

    async def threaded() -> None:
        await metrics.render()

    async def measure() -> None:
        for name, factory in (("inline on the loop", inline), ("worker thread (what /metrics does)", threaded)):
            runs = [await _lag_during(factory) for _ in range(5)]
            took = statistics.median(r[0] for r in runs) * 1000
            lag = max(r[1] for r in runs) * 1000
            print(f"  {name:<36} render {took:6.1f} ms   worst loop lag {lag:6.1f} ms")

    asyncio.run(measure())


# -- part 2: a served gateway ------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(400):
            if proc.poll() is not None:
                raise RuntimeError("process exited")
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(url)


def _spawn(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def part_e2e(args: argparse.Namespace) -> None:
    import aiohttp
    import asyncpg

    from gateway.auth.keys import KeyPolicy, KeyStore
    from gateway.core.db import migrate

    dsn = os.environ["DATABASE_URL"]
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    assert pool is not None
    raw, _ = await KeyStore(pool).create(f"bench-{uuid.uuid4().hex[:6]}", policy=KeyPolicy(rate_limit_requests=10**9))
    await pool.close()

    tmp = Path(tempfile.mkdtemp(prefix="obs-bench-"))
    fake_port, port, mport = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOG_LEVEL": "warning"}
    config = tmp / "gateway.yaml"
    config.write_text(
        f"providers:\n  fake: {{type: openai, base_url: 'http://127.0.0.1:{fake_port}/v1', api_key: sk-bench-secret}}\n"
        "models:\n  - {name: '*', deployments: [{provider: fake, model: '*'}]}\n"
    )
    procs = [
        _spawn(["-m", "gateway.testing.fake_provider", "--host", "127.0.0.1", "--port", str(fake_port)], env, tmp),
        _spawn(["-m", "gateway", "serve"], {**env, "GATEWAY_CONFIG": str(config), "BIND_ADDR": f"127.0.0.1:{port}",
                                            "MANAGEMENT_BIND_ADDR": f"127.0.0.1:{mport}"}, tmp),
    ]
    try:
        await _wait_ready(f"http://127.0.0.1:{port}/readyz", procs[1])
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {raw}"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for i in range(args.models):  # fill the label space as a busy wildcard route would
                async with session.post(url, json={"model": f"warm-{i}", "messages": [{"role": "user", "content": "x"}]},
                                        headers=headers) as r:
                    await r.read()
            async with session.get(f"http://127.0.0.1:{mport}/metrics") as r:
                size = len(await r.read())
            print(f"served gateway: /metrics is {size / 1024:.0f} KiB after {args.models} model names")
            for scraping in (False, True):
                latencies, scrapes = await _load(session, url, headers, f"http://127.0.0.1:{mport}/metrics", args, scraping)
                extra = f"   {len(scrapes)} scrapes, median {statistics.median(scrapes) * 1000:.1f} ms" if scrapes else ""
                print(f"  {'with' if scraping else 'without':<7} scraping: p50 {_pct(latencies, 0.5) * 1000:6.2f} ms"
                      f"   p99 {_pct(latencies, 0.99) * 1000:6.2f} ms   max {max(latencies) * 1000:6.1f} ms{extra}")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _load(session: Any, url: str, headers: dict[str, str], metrics_url: str, args: argparse.Namespace,
                scraping: bool) -> tuple[list[float], list[float]]:
    latencies: list[float] = []
    scrapes: list[float] = []
    remaining = args.requests
    done = asyncio.Event()
    body = {"model": "bench-model", "messages": [{"role": "user", "content": "measure me please"}]}

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
            latencies.append(time.perf_counter() - start)

    async def scraper() -> None:
        while not done.is_set():
            start = time.perf_counter()
            async with session.get(metrics_url) as r:
                await r.read()
            scrapes.append(time.perf_counter() - start)
            await asyncio.sleep(args.scrape_every)

    scrape_task = asyncio.create_task(scraper()) if scraping else None
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    done.set()
    if scrape_task is not None:
        await scrape_task
    return latencies, scrapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--e2e", action="store_true", help="also run against a served gateway (needs DATABASE_URL)")
    parser.add_argument("--models", type=int, default=100, help="distinct model names before measuring")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--scrape-every", type=float, default=1.0,
                        help="seconds between scrapes in the scraping run (Prometheus' default is 15)")
    args = parser.parse_args()
    part_costs()
    part_scrape(args.models)
    if args.e2e:
        asyncio.run(part_e2e(args))


if __name__ == "__main__":
    main()
