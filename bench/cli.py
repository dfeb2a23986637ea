"""``python -m bench``: start the stack, run the chosen scenarios, profile, write the report.

    python -m bench                          # every scenario, full sizes (~10 minutes)
    python -m bench --quick                  # every scenario, seconds each (a smoke run)
    python -m bench --scenarios S1,S2 --duration 5
    python -m bench --scenarios S5 --soak-seconds 600

Needs PostgreSQL on 127.0.0.1:5432 (``BENCH_PG_ADMIN_DSN`` to change; a database is
created for the run and dropped after). Exit status 1 if the stack could not start, or
with ``--check`` if a bar was missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import hops as hops_mod
from bench import profiling
from bench.driver import closed_loop
from bench.report import machine, write
from bench.scenarios import (
    PROFILES,
    SCENARIOS,
    TARGETS,
    RunContext,
    ScenarioReport,
    profiles_for,
    stream_body,
    whole_body,
)
from bench.stack import REPO, ProcWatch, Stack, StackOptions, gateway_env_assignment, raised_fd_limit

__all__ = ["main"]

DEFAULT_OUT = REPO / "bench" / "results"


def _scenarios(text: str) -> list[str]:
    if text.lower() == "all":
        return list(SCENARIOS)
    wanted = [s.strip().upper() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    return wanted


def _targets(text: str) -> tuple[str, ...]:
    wanted = tuple(t.strip() for t in text.split(",") if t.strip())
    if not wanted or any(t not in TARGETS for t in wanted):
        raise argparse.ArgumentTypeError(f"targets are a comma list of {', '.join(TARGETS)}")
    return wanted


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError("expected seconds in (0, 3600]")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS),
                        help="comma list of S1..S6, or all (default all)")
    parser.add_argument("--quick", action="store_true", help="seconds per scenario: a smoke run, not a measurement")
    parser.add_argument("--duration", type=_seconds, help="measured seconds per pass (overrides each scenario's)")
    parser.add_argument("--soak-seconds", type=_seconds, help="S5's length (default 180, quick 6)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of S1-S3 and S6, best kept (default 3, quick 1)")
    parser.add_argument("--targets", type=_targets, default=TARGETS, help="comma list of direct,bare,gateway")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs with taskset")
    parser.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                        help="run the gateway as `serve --workers N` (unpinned; its CPU figures then cover "
                             "the supervisor only: compare requests/s)")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    parser.add_argument("--profile-seconds", type=_seconds, help="length of the profile (default 10, quick 2)")
    parser.add_argument("--no-hops", action="store_true", help="skip the actor hop measurements")
    parser.add_argument("--redis", metavar="URL", help="give the gateway REDIS_URL (limits in Redis)")
    parser.add_argument("--no-budget", action="store_true",
                        help="create the bench key without its USD 1,000,000 budget (no reservations: what the budget costs)")
    parser.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE", type=gateway_env_assignment,
                        help="extra environment for the gateway, e.g. LOG_LEVEL=warning (repeatable; for A/B runs)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where reports go (default bench/results)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (printed path)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    return parser


async def _profile(ctx: RunContext, args: argparse.Namespace, out: Path, stamp: str) -> dict[str, Any]:
    """py-spy on the bare relay and on the gateway, each under S1's load in turn."""
    stack = ctx.stack
    seconds = args.profile_seconds or (2.0 if args.quick else 10.0)
    profile = profiles_for(args.quick)["fast"]
    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {}
    for target in ("bare", "gateway"):
        pid = ctx.pid(target, profile)
        if pid is None or target not in ctx.targets:
            continue
        call = ctx.call(target, profile, whole_body(profile))
        path = out / f"{stamp}-profile-{target}.txt"
        # Load first, then attach, so every sample is taken under load.
        load = asyncio.ensure_future(closed_loop(lambda _i, c=call: c, concurrency=32, duration=seconds + 1.5))  # type: ignore[misc]
        await asyncio.sleep(0.5)
        async with ProcWatch(pid).window() as window:
            error = await profiling.record(pid, seconds, path, cpu=stack.load_cpu if stack.pinned else None)
        result = await load
        if error is not None:
            return {"error": error}
        requests = result.ok * seconds / result.duration if result.duration else 0
        found[target] = {
            "file": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
            "summary": profiling.summarize(path),
            "cpu_us_per_request": round(1e6 * window.cpu / requests, 1) if requests else None,
            "cpu_pct": round(100 * window.cpu / window.wall, 1) if window.wall else None,
            "load": result.summary(),
        }
    return {"seconds": seconds, "targets": found}


async def _run(args: argparse.Namespace) -> int:
    names: list[str] = args.scenarios
    all_profiles = profiles_for(args.quick)
    needed = {"fast"} | {p for s in names for p in PROFILES[s]}
    profiles = [all_profiles[n] for n in all_profiles if n in needed]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    meta: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "scenarios_run": names,
        "targets": list(args.targets),
        "gateway_env": dict(args.gateway_env),
        "gateway_workers": args.gateway_workers,
    }
    options = StackOptions(profiles=profiles, pin=not args.no_pin, redis_url=args.redis,
                           bare="bare" in args.targets, keep_logs=args.keep_logs,
                           gateway_env=dict(args.gateway_env), gateway_workers=args.gateway_workers,
                           key_budget=not args.no_budget)
    reports: list[ScenarioReport] = []
    profile: dict[str, Any] | None = None
    hops: dict[str, Any] | None = None
    print(f"bench: starting fake providers ({', '.join(p.name for p in profiles)}), gateway and relays", flush=True)
    async with Stack(options) as stack:
        if args.keep_logs:
            print(f"bench: logs in {stack.workdir}", flush=True)
        meta["environment"] = stack.environment()
        rounds = max(1, args.rounds or (1 if args.quick else 3))
        ctx = RunContext(stack, args.quick, tuple(args.targets), duration=args.duration, rounds=rounds,
                         soak=args.soak_seconds)
        for name in names:
            t0 = time.monotonic()
            print(f"bench: {name} ...", end="", flush=True)
            report = await SCENARIOS[name](ctx)
            reports.append(report)
            print(f" {time.monotonic() - t0:.1f} s" + (f" (skipped: {report.skipped})" if report.skipped else ""),
                  flush=True)
            if name == "S1" and not args.no_profile and "gateway" in args.targets:
                print("bench: profiling the gateway under S1's load ...", flush=True)
                profile = await _profile(ctx, args, args.out, stamp)
        if not args.no_hops:
            print("bench: actor hops ...", flush=True)
            fast = all_profiles["fast"]
            hops = await hops_mod.measure_hops(
                stack.database_url, stack.workdir / "gateway.yaml", stack.api_key,
                whole_body(fast), stream_body(fast, 20), quick=args.quick,
            )
        if stack.gateway is not None and not stack.gateway.alive():
            raise RuntimeError(f"the gateway died during the run:\n{stack.gateway.log_tail()}")
    meta["load_after"] = [round(x, 2) for x in os.getloadavg()]
    md_path, json_path = write(args.out, stamp, meta, reports, profile, hops)
    print(md_path.read_text())
    print(f"bench: wrote {md_path} and {json_path}", flush=True)
    missed = [f"{r.scenario} {r.metric}" for rep in reports for r in rep.rows if r.passed is False]
    if missed:
        print(f"bench: bars missed: {', '.join(missed)}", flush=True)
    return 1 if (args.check and missed) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = None

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await _run(args)

    with raised_fd_limit(), asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            return runner.run(guarded())
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("bench: interrupted; processes stopped, database dropped", file=sys.stderr)
            return 130
        except RuntimeError as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 1
