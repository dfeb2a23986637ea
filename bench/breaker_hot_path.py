"""What the circuit breaker costs a call: the published snapshot versus an actor hop.

    python -m bench.breaker_hot_path [--calls N] [--concurrency C]

Each simulated call does what dispatch does around one upstream attempt: decide whether
the deployment may be called, then report the outcome (a tell). "snapshot" decides by
reading the breaker's published table (what the gateway does for a closed circuit);
"ask" decides by asking the actor (what a design without the snapshot would do). The
report is a tell in both. Prints microseconds per call; a short run (a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from actors.breaker import Admission, BreakerActor, BreakerHandle, Outcome, Permit
from actors.runtime import Supervisor
from gateway.core.config import BreakerSettings

__all__ = ["main"]

DEPLOYMENTS = ("venice/llama", "anthropic/claude", "local/mock")


async def _run(calls: int, concurrency: int) -> dict[str, float]:
    supervisor = Supervisor()
    actor = BreakerActor(BreakerSettings(), mailbox_size=max(8192, concurrency * 4))
    ref = await supervisor.start(actor)
    handle = BreakerHandle(actor, ref)
    per_task = calls // concurrency

    async def snapshot_calls(i: int) -> None:
        dep = DEPLOYMENTS[i % len(DEPLOYMENTS)]
        for _ in range(per_task):
            admission, _ = handle.admission(dep)
            assert admission is Admission.PASS
            handle.report(dep, Outcome.SUCCESS, latency=0.01)
            await asyncio.sleep(0)  # the upstream call would yield here

    async def ask_calls(i: int) -> None:
        dep = DEPLOYMENTS[i % len(DEPLOYMENTS)]
        for token in range(per_task):
            permission = await ref.ask(Permit(dep, 10.0, token + 1))
            assert permission.granted
            handle.report(dep, Outcome.SUCCESS, latency=0.01)
            await asyncio.sleep(0)

    async def baseline(i: int) -> None:
        for _ in range(per_task):
            await asyncio.sleep(0)

    results: dict[str, float] = {}
    try:
        for name, body in (("baseline", baseline), ("snapshot", snapshot_calls), ("ask", ask_calls)):
            started = time.perf_counter()
            await asyncio.gather(*(body(i) for i in range(concurrency)))
            await handle.permit("drain/none", 10.0)  # wait until every report is folded in
            results[name] = (time.perf_counter() - started) / (per_task * concurrency) * 1e6
    finally:
        await supervisor.stop()
    results["dropped_reports"] = handle.dropped_reports
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.breaker_hot_path", description=__doc__)
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--concurrency", type=int, default=50)
    args = parser.parse_args(argv)
    results = asyncio.run(_run(args.calls, args.concurrency))
    base = results["baseline"]
    print(f"calls={args.calls} concurrency={args.concurrency}")
    for name in ("baseline", "snapshot", "ask"):
        extra = "" if name == "baseline" else f"  (+{results[name] - base:.2f} us over baseline)"
        print(f"{name:>9}: {results[name]:7.2f} us/call{extra}")
    print(f"dropped reports: {int(results['dropped_reports'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
