"""What each thread of a server does per request: its CPU, its wait for the CPU, and how
often it was preempted, the bare relay's against the gateway's.

    python -m bench.threads [--profile fast|slow] [--concurrency N] [--seconds S] [--rounds N] \\
        [--no-budget] [--gateway-env NAME=VALUE ...]

A request's latency is not only its own CPU: on the gateway's core the event loop shares
the CPU with the process's helper threads (the journals' fsyncs, the log writer), and a
helper thread that wakes can preempt the loop in the middle of a request. This drives
whole calls at a fixed concurrency (``--profile slow`` and ``--concurrency 10`` is S2's
rate, about 200 a second) and reads each thread's ``/proc/<pid>/task/<tid>/schedstat``
(time on the CPU, time runnable but waiting for it, time slices) and ``status``
(voluntary and involuntary context switches) before and after, per request. The
gateway is pinned to one CPU and the driver and fake provider to the other, as in
``python -m bench``. The first row of each server is its main thread, the event loop.

Examples::

    python -m bench.threads --profile slow --concurrency 10
    python -m bench.threads --profile fast --concurrency 1 --gateway-env BILLING_FSYNC_INTERVAL_SECONDS=0.005

PostgreSQL as for ``python -m bench`` (``BENCH_PG_ADMIN_DSN``). Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass

from bench.driver import closed_loop
from bench.scenarios import RunContext, profiles_for, whole_body
from bench.stack import Stack, StackOptions, add_gateway_arguments

__all__ = ["ThreadFigures", "main"]


@dataclass(frozen=True)
class ThreadFigures:
    """One thread's counters over a window, per request."""

    tid: int
    name: str
    run_us: float
    wait_us: float
    slices: float
    voluntary: float
    preempted: float


def _counters(pid: int) -> dict[int, tuple[str, int, int, int, int, int]]:
    """tid → (name, ns on CPU, ns waiting, slices, voluntary, involuntary switches)."""
    out: dict[int, tuple[str, int, int, int, int, int]] = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{entry}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/schedstat") as f:
                run, wait, slices = (int(v) for v in f.read().split()[:3])
            with open(f"{base}/status") as f:
                status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        out[int(entry)] = (name, run, wait, slices, int(status["voluntary_ctxt_switches"]),
                           int(status["nonvoluntary_ctxt_switches"]))
    return out


def _per_request(pid: int, before: dict[int, tuple[str, int, int, int, int, int]],
                 after: dict[int, tuple[str, int, int, int, int, int]], requests: int) -> list[ThreadFigures]:
    rows = []
    for tid, (name, run, wait, slices, vol, invol) in after.items():
        if tid not in before or slices == before[tid][3]:
            continue  # new, or idle all along
        _, run0, wait0, slices0, vol0, invol0 = before[tid]
        rows.append(ThreadFigures(tid, "main (event loop)" if tid == pid else name, (run - run0) / requests / 1000,
                                  (wait - wait0) / requests / 1000, (slices - slices0) / requests,
                                  (vol - vol0) / requests, (invol - invol0) / requests))
    rows.sort(key=lambda r: (r.tid != pid, -r.run_us))
    return rows



async def main(argv: list[str] | None = None) -> dict[str, list[list[ThreadFigures]]]:
    """Run; returns each server's rows per round ("bare", "gateway")."""
    parser = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=("fast", "slow"), default="slow",
                        help="the upstream: fast, or slow (50 ms, S2's; default)")
    parser.add_argument("--concurrency", type=int, default=10, help="concurrent calls (default 10)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per server and round (default 8)")
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds (default 1, at most 10)")
    add_gateway_arguments(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.concurrency <= 256 or not 1 <= args.rounds <= 10 or args.seconds <= 0:
        parser.error("--concurrency 1..256, --rounds 1..10, --seconds > 0")
    if not os.path.exists("/proc/self/schedstat"):
        parser.error("needs Linux's /proc/<pid>/task/<tid>/schedstat")
    profile = profiles_for(False)[args.profile]
    options = StackOptions(profiles=(profile,), bare=True, key_budget=not args.no_budget,
                           gateway_env=dict(args.gateway_env))
    results: dict[str, list[list[ThreadFigures]]] = {"bare": [], "gateway": []}
    async with Stack(options) as stack:
        ctx = RunContext(stack, False)
        for round_no in range(args.rounds):
            for target in results:
                pid = stack.bare_procs[profile.name].pid if target == "bare" else stack.gateway.pid
                call = ctx.call(target, profile, whole_body(profile))
                await closed_loop(lambda _i, call=call: call, concurrency=args.concurrency, duration=1.0, warmup=0.5)
                before = _counters(pid)
                result = await closed_loop(lambda _i, call=call: call, concurrency=args.concurrency,
                                           duration=args.seconds, warmup=0)
                after = _counters(pid)
                requests = max(1, len(result.latencies))
                rows = _per_request(pid, before, after, requests)
                results[target].append(rows)
                print(f"\nround {round_no + 1}, {target}: {requests} calls, "
                      f"{requests / args.seconds:,.0f} a second", flush=True)
                print("| thread | CPU µs | waiting for the CPU µs | time slices | voluntary switches | preempted |")
                print("| --- | ---: | ---: | ---: | ---: | ---: |")
                for r in rows:
                    print(f"| {r.name} | {r.run_us:.1f} | {r.wait_us:.1f} | {r.slices:.2f} | {r.voluntary:.2f} "
                          f"| {r.preempted:.2f} |")
    return results


if __name__ == "__main__":
    asyncio.run(main())
