"""Actor hops: what one costs, and how many a request makes.

Two in-process measurements, run in the driver's process on the run's database:

* the price of one hop: an ``ask`` round trip and a ``tell`` to a trivial actor on the
  runtime, against a plain ``await`` of a coroutine, and the cached-key check of
  :class:`actors.auth.AuthHandle` (which must cost no hop and no database trip);
* the hops of one request: every ``ActorRef.ask``/``tell`` is counted by actor while an
  in-process gateway serves a few whole and streamed calls, so the count follows the
  code as limiter, breaker and billing actors join the path.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from actors.runtime import Actor, ActorRef, Supervisor
from bench.driver import Call

__all__ = ["measure_hops"]


class _Echo(Actor[int]):
    name = "echo"
    mailbox_size = 100_000

    async def receive(self, msg: int) -> int:
        return msg


async def _noop(x: int) -> int:
    return x


async def hop_costs(n: int) -> dict[str, float]:
    """Microseconds per plain await, per ask round trip and per tell (handled)."""
    supervisor = Supervisor()
    ref = await supervisor.start(_Echo())
    try:
        t0 = time.perf_counter()
        for i in range(n):
            await _noop(i)
        plain = time.perf_counter() - t0
        for i in range(200):
            await ref.ask(i)
        t0 = time.perf_counter()
        for i in range(n):
            await ref.ask(i)
        ask = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            ref.tell(i)
        await ref.ask(-1)  # the mailbox is FIFO: every tell before it has been handled
        tell = time.perf_counter() - t0
    finally:
        await supervisor.stop()
    return {
        "await_us": round(1e6 * plain / n, 2),
        "ask_us": round(1e6 * ask / n, 2),
        "tell_us": round(1e6 * tell / n, 2),
    }


@contextmanager
def _counting_hops(counts: Counter[str]) -> Iterator[None]:
    """Count every ask and tell by ``actor:kind`` while the block runs (bench process only)."""
    real_ask, real_tell = ActorRef.ask, ActorRef.tell

    async def ask(self: ActorRef[Any], msg: Any, timeout: float | None = None) -> Any:
        counts[f"{self.name} ask {type(msg).__name__}"] += 1
        return await real_ask(self, msg, timeout)

    def tell(self: ActorRef[Any], msg: Any) -> None:
        counts[f"{self.name} tell {type(msg).__name__}"] += 1
        real_tell(self, msg)

    ActorRef.ask, ActorRef.tell = ask, tell  # type: ignore[method-assign]
    try:
        yield
    finally:
        ActorRef.ask, ActorRef.tell = real_ask, real_tell  # type: ignore[method-assign]


async def measure_hops(
    database_url: str, config_path: Path, api_key: str, whole_body: dict[str, Any],
    stream_body: dict[str, Any], *, quick: bool,
) -> dict[str, Any]:
    """Hop prices, the cached-key check's price, and hops per request by actor."""
    from gateway.core.config import load_config, load_settings
    from gateway.edge.app import DATA_SERVER_OPTIONS, build_data_app, gateway_state

    n = 5_000 if quick else 50_000
    out: dict[str, Any] = {"costs": await hop_costs(n)}
    env = {"DATABASE_URL": database_url, "GATEWAY_CONFIG": str(config_path), "BIND_ADDR": "127.0.0.1:0"}
    settings = load_settings(env)
    config = load_config(settings, env)
    requests = 20 if quick else 100
    async with gateway_state(settings, config, database_url, run_migrations=False) as state:
        await state.auth.authenticate(api_key)  # a miss: fills the cache
        t0 = time.perf_counter()
        for _ in range(n):
            await state.auth.authenticate(api_key)
        out["costs"]["cached_key_check_us"] = round(1e6 * (time.perf_counter() - t0) / n, 2)
        server = TestServer(build_data_app(state), host="127.0.0.1")
        await server.start_server(
            **{k: v for k, v in DATA_SERVER_OPTIONS.items() if k != "handler_cancellation"}  # type: ignore[arg-type]
        )
        try:
            url = str(server.make_url("/v1/chat/completions"))
            async with aiohttp.ClientSession() as session:
                for kind, body in (("whole", whole_body), ("stream", stream_body)):
                    call = Call.chat(url, body, api_key)
                    await call.send(session)  # warm: connections, caches
                    counts: Counter[str] = Counter()
                    failures = 0
                    with _counting_hops(counts):
                        for _ in range(requests):
                            failures += not (await call.send(session)).ok
                        await asyncio.sleep(0.05)  # the handler's last tells may follow its last byte
                    out[kind] = {
                        "requests": requests,
                        "failures": failures,
                        "per_request": {k: round(v / requests, 2) for k, v in sorted(counts.items())},
                        "asks": round(sum(v for k, v in counts.items() if " ask " in k) / requests, 2),
                        "tells": round(sum(v for k, v in counts.items() if " tell " in k) / requests, 2),
                    }
        finally:
            await server.close()
    return out
