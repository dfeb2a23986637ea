"""``serve --workers N``: N data-plane processes on one port, one management plane.

The parent process migrates once, then starts N workers (``serve --worker-socket``)
that each bind ``BIND_ADDR`` with ``SO_REUSEPORT``, so the kernel spreads connections
across them. The parent serves the management plane itself (admin API over its own
state), and its ``/metrics`` is the aggregation of every worker's registry: each
worker's own exposition, fetched over a private unix socket, with a ``worker`` label
added to every sample (``sum by`` in PromQL gives the totals). A worker that dies is
restarted with backoff and counted; SIGTERM is passed to every worker, which drain as
one process does, and the parent exits when they have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway import __version__
from gateway.core.config import GatewayConfig, Settings
from gateway.edge.app import build_management_app, gateway_state
from gateway.edge.server import SUPERVISOR_PID_ENV, seed_development_key
from gateway.http.parser_errors import ContractAppRunner
from gateway.observability.metrics import CONTENT_TYPE

__all__ = ["WorkerPool", "per_worker_limits_refusal", "supervise_workers"]

log = logging.getLogger("gateway.workers")

def per_worker_limits_refusal(settings: Settings, config: GatewayConfig, workers: int) -> str | None:
    """Why ``serve --workers N`` must not start as configured, or None.

    With rate limits in memory (no ``REDIS_URL``, or ``rate_limits.storage: memory://``)
    each worker keeps its own windows, so every limit becomes N times the configured one,
    and each worker sees only its own in-flight budget use. That is refused unless the
    operator opts in (``--per-worker-limits``); Redis or PostgreSQL storage is shared.
    """
    if workers <= 1:
        return None
    storage = config.rate_limits.storage
    if storage is None:
        storage = settings.redis_url or "memory://"
    if not storage.startswith("memory://"):
        return None
    return (
        f"serve --workers {workers}: rate limits are kept in memory (no REDIS_URL), so each of the "
        f"{workers} workers would allow the full limit ({workers}x in total) and see only its own "
        "in-flight budget use; set REDIS_URL (or rate_limits.storage: redis://... or postgres), "
        "or pass --per-worker-limits to accept that"
    )


#: How long a worker must live to count as started well (resets the restart backoff).
STABLE_SECONDS = 10.0
MAX_BACKOFF_SECONDS = 10.0


@dataclass
class Worker:
    index: int
    socket: Path
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    watcher: asyncio.Task[None] | None = None


@dataclass
class WorkerPool:
    """Starts, watches, restarts and stops the worker processes."""

    count: int
    env: dict[str, str]
    runtime_dir: Path
    workers: list[Worker] = field(default_factory=list)
    stopping: bool = False

    async def start(self) -> None:
        for i in range(self.count):
            worker = Worker(i, self.runtime_dir / f"worker-{i}.sock")
            self.workers.append(worker)
            await self._spawn(worker)
            worker.watcher = asyncio.get_running_loop().create_task(self._watch(worker))

    async def _spawn(self, worker: Worker) -> None:
        with contextlib.suppress(FileNotFoundError):
            worker.socket.unlink()
        worker.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--no-migrate",
            "--worker-socket", str(worker.socket),
            env={**self.env, "LLM_GATEWAY_WORKER": str(worker.index), SUPERVISOR_PID_ENV: str(os.getpid())},
        )
        log.info("worker %d started (pid %d)", worker.index, worker.proc.pid)

    async def _watch(self, worker: Worker) -> None:
        """Restart ``worker`` whenever it exits while the pool is not stopping."""
        loop = asyncio.get_running_loop()
        backoff = 0.1
        while True:
            assert worker.proc is not None
            started = loop.time()
            code = await worker.proc.wait()
            if self.stopping:
                return
            worker.restarts += 1
            if loop.time() - started > STABLE_SECONDS:
                backoff = 0.1
            log.error("worker %d exited with %s; restart %d in %.1fs", worker.index, code, worker.restarts, backoff)
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)
            if self.stopping:
                return
            await self._spawn(worker)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.proc.returncode is None]

    async def stop(self, grace: float) -> None:
        """SIGTERM every worker, wait for their drain, then SIGKILL what is left."""
        self.stopping = True
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                w.proc.send_signal(signal.SIGTERM)
        waits = [w.proc.wait() for w in self.workers if w.proc is not None]
        try:
            async with asyncio.timeout(grace + 10):
                await asyncio.gather(*waits)
        except TimeoutError:
            for w in self.workers:
                if w.proc is not None and w.proc.returncode is None:
                    w.proc.kill()
            await asyncio.gather(*(w.proc.wait() for w in self.workers if w.proc is not None))
        for w in self.workers:
            if w.watcher is not None:
                w.watcher.cancel()

    async def scrape(self) -> list[tuple[int, str]]:
        """Each live worker's ``/metrics`` text; a worker that does not answer is skipped."""

        async def one(worker: Worker) -> tuple[int, str] | None:
            if not worker.socket.exists():
                return None
            try:
                connector = aiohttp.UnixConnector(path=str(worker.socket))
                async with aiohttp.ClientSession(connector=connector) as session, session.get(
                    "http://worker/metrics", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    return worker.index, await resp.text()
            except (aiohttp.ClientError, TimeoutError, OSError):
                return None

        results = await asyncio.gather(*(one(w) for w in self.workers))
        return [r for r in results if r is not None]


class _Merged:
    """A collector over already-parsed families (what generate_latest renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(texts: list[tuple[int, str]]) -> bytes:
    """One exposition from several workers', each sample labelled with its ``worker``."""
    merged: dict[str, Metric] = {}
    for index, text in texts:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = target
            for s in family.samples:
                target.samples.append(
                    Sample(s.name, {"worker": str(index), **s.labels}, s.value, s.timestamp, s.exemplar)
                )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))  # type: ignore[arg-type]
    return generate_latest(registry)


def _aggregated_metrics(pool: WorkerPool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.Response:
        texts = await pool.scrape()
        body = await asyncio.get_running_loop().run_in_executor(None, merge_expositions, texts)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    return handler


async def supervise_workers(
    settings: Settings, config: GatewayConfig, dsn: str, *, embedded: bool, workers: int, migrate: bool
) -> None:
    """Run ``workers`` data-plane processes and this process's management plane."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runtime_dir = Path(tempfile.mkdtemp(prefix="llm-gateway-workers-"))
    env = {**os.environ, "DATABASE_URL": dsn}
    pool = WorkerPool(workers, env, runtime_dir)
    try:
        async with gateway_state(settings, config, dsn, run_migrations=migrate) as state:
            if embedded:
                await seed_development_key(state.pool)
            await pool.start()
            app = build_management_app(state, metrics_handler=_aggregated_metrics(pool))
            runner = ContractAppRunner(app, handle_signals=False, shutdown_timeout=5, access_log=None)
            await runner.setup()
            try:
                await web.TCPSite(runner, settings.management_host, settings.management_port).start()
                print(
                    f"llm-gateway {__version__} supervising {workers} workers on http://{settings.bind_host}:{settings.bind_port}"
                    f"; management plane on http://{settings.management_host}:{settings.management_port}",
                    flush=True,
                )
                await stop.wait()
                state.draining = True
                await pool.stop(settings.shutdown_grace)
            finally:
                await runner.cleanup()
    finally:
        if not pool.stopping:
            await pool.stop(settings.shutdown_grace)
        shutil.rmtree(runtime_dir, ignore_errors=True)
