"""Time to first chunk at a few concurrencies, the gateway's against the bare relay's and
a direct call's, in alternated rounds.

    python -m bench.first_chunk [--concurrency 1,8,64] [--seconds S] [--rounds N] [--chunks N] \\
        [--no-budget] [--gateway-env NAME=VALUE ...]

S3 measures the first chunk under 64 concurrent streams, where it is mostly the time a
stream waits behind the others' chunks. This measures it also where nothing else runs:
one client sending S3's streams back to back is about one call a second per key, the
cadence at which a budgeted key's lease is past its time at every call (issue 23's tenth
pass found a store round trip on about every other call there, +2.4 ms). Each round
drives every target in turn (direct, bare relay, gateway) at each concurrency for ``S``
seconds after a warm-up; the report gives each target's p50 and p90 over all its rounds
and the gateway's p50 over the bare relay's. The gateway is pinned to one CPU and the
driver and fake provider to the other, as in ``python -m bench``.

Examples::

    python -m bench.first_chunk --concurrency 1 --seconds 25
    python -m bench.first_chunk --concurrency 1 --no-budget
    python -m bench.first_chunk --concurrency 1 --gateway-env BUDGET_LEASE_STANDBY_SECONDS=0

PostgreSQL as for ``python -m bench`` (``BENCH_PG_ADMIN_DSN``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from bench.driver import closed_loop
from bench.scenarios import RunContext, profiles_for, stream_body
from bench.stack import Stack, StackOptions, add_gateway_arguments

__all__ = ["main"]

TARGETS = ("direct", "bare", "gateway")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: expected N[,M...]") from None
    if not levels or any(n < 1 or n > 256 for n in levels):
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: each between 1 and 256")
    return levels



def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


async def main(argv: list[str] | None = None) -> dict[tuple[int, str], list[float]]:
    """Run; returns every first-chunk time (seconds) by (concurrency, target)."""
    parser = argparse.ArgumentParser(prog="python -m bench.first_chunk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=_levels, default=(1, 8, 64),
                        help="comma list of concurrent clients (default 1,8,64)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per target and level (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2, at most 20)")
    parser.add_argument("--chunks", type=int, default=50, help="chunks per stream, 20 ms apart (default 50)")
    add_gateway_arguments(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 20 or not 1 <= args.chunks <= 1000 or args.seconds <= 0:
        parser.error("--rounds 1..20, --chunks 1..1000, --seconds > 0")
    profile = dataclasses.replace(profiles_for(False)["stream"], chunks=args.chunks)
    stream_seconds = profile.stream_seconds
    firsts: dict[tuple[int, str], list[float]] = {(n, t): [] for n in args.concurrency for t in TARGETS}
    options = StackOptions(profiles=(profile,), bare=True, key_budget=not args.no_budget,
                           gateway_env=dict(args.gateway_env))
    async with Stack(options) as stack:
        ctx = RunContext(stack, False)
        for round_no in range(args.rounds):
            for level in args.concurrency:
                for target in TARGETS:
                    call = ctx.call(target, profile, stream_body(profile, args.chunks))
                    result = await closed_loop(lambda _i, call=call: call, concurrency=level, duration=args.seconds,
                                               warmup=min(1.5, stream_seconds + 0.5), stagger=stream_seconds)
                    if not result.ttfcs:
                        raise RuntimeError(f"{target} at {level}: no stream completed ({dict(result.errors)})")
                    firsts[level, target].extend(result.ttfcs)
                    print(f"round {round_no + 1}, {level} concurrent, {target}: {len(result.ttfcs)} streams, "
                          f"p50 {1000 * _quantile(result.ttfcs, 0.5):.2f} ms", flush=True)
    print()
    print("| concurrent | target | streams | first chunk p50 | p90 | p50 over the bare relay's |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for level in args.concurrency:
        bare_p50 = _quantile(firsts[level, "bare"], 0.5)
        for target in TARGETS:
            values = firsts[level, target]
            p50 = _quantile(values, 0.5)
            over = "" if target == "bare" else f"{1000 * (p50 - bare_p50):+.2f} ms"
            print(f"| {level} | {target} | {len(values)} | {1000 * p50:.2f} ms | {1000 * _quantile(values, 0.9):.2f} ms "
                  f"| {over} |")
    return firsts


if __name__ == "__main__":
    asyncio.run(main())
