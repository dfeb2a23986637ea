"""What writing one stream event to a client costs: aiohttp's ``StreamResponse.write``
against the relays' :class:`~gateway.http.chunked.ChunkedBody`.

    python -m bench.body_write [--streams N] [--events K] [--rounds R]

A loopback aiohttp server answers each request with ``K`` events of S3's size (236 bytes),
written one by one either way, with a client reading every answer; the handler times its
write loop alone (the writes never wait: ``K`` events fit the socket's buffer, so the loop
is the call's own CPU and the kernel's send, the same for both ways). Prints microseconds
per event for each way, the minimum over ``R`` alternated rounds of ``N`` streams, and the
difference: what the direct writer saves per event of every relayed stream.
"""

from __future__ import annotations

import argparse
import time

import aiohttp
import uvloop
from aiohttp import web

from gateway.http.chunked import Body, ChunkedBody, body_of

__all__ = ["main", "measure"]

EVENT = b"data: " + b"x" * 228 + b"\n\n"  # 236 bytes, one S3 content chunk's size


async def _rounds(streams: int, events: int, rounds: int) -> dict[str, float]:
    spent: dict[str, list[float]] = {"aiohttp": [], "direct": []}

    async def handler(request: web.Request) -> web.StreamResponse:
        way = request.match_info["way"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        writer = await response.prepare(request)
        if way == "direct":
            body = body_of(response, writer)
            assert isinstance(body, ChunkedBody)
        else:
            body = Body(response)
        started = time.perf_counter()
        for _ in range(events):
            if (waiting := body.put(EVENT)) is not None:
                await waiting
        spent[way].append(time.perf_counter() - started)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/{way}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    best: dict[str, float] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(rounds):
                for way in spent:
                    spent[way].clear()
                    for _ in range(streams):
                        async with session.get(f"http://127.0.0.1:{port}/{way}") as resp:
                            assert len(await resp.read()) == events * len(EVENT)
                    per_event = 1e6 * sum(spent[way]) / (streams * events)
                    best[way] = min(best.get(way, per_event), per_event)
    finally:
        await runner.cleanup()
    return best


def measure(streams: int = 400, events: int = 50, rounds: int = 5) -> dict[str, float]:
    """Microseconds per event written, each way (the best round)."""
    return uvloop.run(_rounds(streams, events, rounds))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.body_write", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=400, help="streams per round and way (default 400)")
    parser.add_argument("--events", type=int, default=50, help="events per stream (default 50, at most 200)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    args = parser.parse_args(argv)
    if not 1 <= args.streams <= 100_000 or not 1 <= args.events <= 200 or not 1 <= args.rounds <= 100:
        parser.error("--streams 1..100000, --events 1..200, --rounds 1..100")
    figures = measure(args.streams, args.events, args.rounds)
    for way, value in figures.items():
        print(f"{way}: {value:.2f} µs per event")
    print(f"saved per event: {figures['aiohttp'] - figures['direct']:.2f} µs")


if __name__ == "__main__":
    main()
