"""What one whole provider call costs its caller's CPU: aiohttp's ``ClientSession``
against the providers' own :class:`~gateway.providers.http_client.ProviderHTTP`.

    python -m bench.provider_client [--calls N] [--concurrency C] [--rounds R]

A loopback aiohttp server in a process of its own answers every POST with a chat
completion of S1's size; this process, on another CPU where there are two, sends ``N``
calls ``C`` at a time each way, as a provider sends them (the key and JSON headers, the
body as bytes, the answer read whole and its connection kept), and reads its own CPU
time (``time.process_time``) around them. Prints microseconds of CPU per call each way,
the minimum over ``R`` alternated rounds, and the difference: what a whole call saves
in the gateway (the nineteenth pass in docs/benchmark.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import uvloop

from gateway.providers.http_client import ProviderHTTP

__all__ = ["main", "measure"]

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]})
ANSWER = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello " * 20}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
})
HEADERS = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json", "Accept-Encoding": "identity"}
LIMIT = 64 * 1024 * 1024
_REPO = str(Path(__file__).resolve().parent.parent)


async def _serve(port: int) -> None:
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _rounds(url: str, calls: int, concurrency: int, rounds: int) -> dict[str, float]:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                    auto_decompress=False)
    http = ProviderHTTP()
    timeout = aiohttp.ClientTimeout(total=30, sock_connect=10)

    async def by_aiohttp() -> None:
        resp = await session.post(url, data=BODY, headers=HEADERS, timeout=timeout, auto_decompress=True)
        body = await resp.read()
        resp.release()
        assert resp.status == 200 and len(body) == len(ANSWER)

    async def by_provider_http() -> None:
        answer = await http.post(url, BODY, HEADERS, total=30, connect=10, limit=LIMIT)
        assert answer.status == 200 and len(answer.body) == len(ANSWER)

    ways = {"aiohttp": by_aiohttp, "ProviderHTTP": by_provider_http}

    async def run(call: object, n: int) -> None:
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await call()  # type: ignore[operator]

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    best: dict[str, float] = {}
    try:
        for call in ways.values():  # warm: connections open, code paths hot
            await run(call, min(calls, 200))
        for _ in range(rounds):
            for name, call in ways.items():
                started = time.process_time()
                await run(call, calls)
                per_call = 1e6 * (time.process_time() - started) / calls
                best[name] = min(best.get(name, per_call), per_call)
    finally:
        await session.close()
        await http.close()
    return best


def measure(calls: int = 20_000, concurrency: int = 32, rounds: int = 3) -> dict[str, float]:
    """Microseconds of this process's CPU per whole call, each way (the best round)."""
    port = _free_port()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])
    server = subprocess.Popen(
        ["taskset", "-c", str(server_cpu), sys.executable, "-m", "bench.provider_client", "--serve", str(port)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))},
    )
    own = os.sched_getaffinity(0)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the loopback server did not start") from None
                time.sleep(0.05)
        os.sched_setaffinity(0, {client_cpu})
        return uvloop.run(_rounds(f"http://127.0.0.1:{port}/v1/chat/completions", calls, concurrency, rounds))
    finally:
        os.sched_setaffinity(0, own)
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.provider_client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000, help="calls per round and way (default 20000)")
    parser.add_argument("--concurrency", type=int, default=32, help="calls at once (default 32, as S1)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        uvloop.run(_serve(args.serve))
        return
    if not 1 <= args.calls <= 1_000_000 or not 1 <= args.concurrency <= 1000 or not 1 <= args.rounds <= 100:
        parser.error("--calls 1..1000000, --concurrency 1..1000, --rounds 1..100")
    figures = measure(args.calls, args.concurrency, args.rounds)
    for way, value in figures.items():
        print(f"{way}: {value:.1f} µs of CPU per call")
    print(f"saved per call: {figures['aiohttp'] - figures['ProviderHTTP']:.1f} µs")


if __name__ == "__main__":
    main()
