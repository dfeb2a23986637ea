"""What billing costs one finished call, step by step: the record side and the reserve side.

    python -m bench.record_cost [--calls N] [--repeats R] [--json]
    (or, from the repository root: PYTHONPATH=. python bench/record_cost.py)

One call like S1's (a budgeted key, one OpenAI-compatible deployment priced at 1 and 2 USD
per million tokens, a short non-streaming answer with usage) goes through what the
gateway does for it, each step timed on its own, ``N`` times in a row, the fastest of
``R`` repeats kept (the steady state on a quiet core; a neighbour's load only adds):

* the reserve side: ``new_call_id`` (every CallRecord's default), ``CallRecord(...)``
  as the pipeline builds it, ``worst_case_micro_usd`` on the call's prices, and
  ``BillingHandle.reserve`` then ``settle`` drawing from a lease (what a busy key's
  call does: no I/O; the store is a stand-in that admits every lease);
* the record side (the pipeline's ``_finish``): ``settle_cost``, ``ledger_row``,
  ``ledger_line``, ``micro_usd`` of the call's cost, and ``BillingHandle.record`` whole
  (the row built and journaled: one
  ``write`` into a journal under a temporary directory; the billing log line is off, as
  it is below INFO).

Prints microseconds per call for each step, and the sums of the two paths (the steps
inside ``record`` and ``reserve`` are not added twice). A run takes a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from asyncpg.pgproto.pgproto import UUID as PgUUID

from actors.auth import VerifiedKey
from actors.billing import BillingActor, BillingHandle
from gateway.auth.keys import KeyPolicy
from gateway.billing.journal import Journal
from gateway.billing.ledger import ledger_line, ledger_row
from gateway.billing.pricing import settle_cost
from gateway.billing.reservations import Reservation, micro_usd, worst_case_micro_usd
from gateway.core.config import parse_config
from gateway.core.usage import CallRecord, Usage, new_call_id
from gateway.relay.routing import Router

__all__ = ["main", "measure"]

#: The bench stack's config (bench/stack.py ``gateway_config``) for its "fast" profile.
CONFIG = {
    "providers": {"fast": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-bench-upstream"}},
    "models": [{"name": "fast-model", "deployments": [
        {"provider": "fast", "model": "fast-model", "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
    ]}],
}
#: The chat body S1 sends (a short prompt, no max_tokens: the default output cap).
BODY = {"model": "fast-model", "messages": [{"role": "user", "content": "Say hello in one short sentence."}]}


class AdmitAll:
    """A reservation store that admits everything at once (leases included)."""

    settles_explicitly = False

    async def reserve(self, reservation: Reservation, ttl: float) -> int | None:
        return None

    async def settle(self, reservation: Reservation, cost_micro_usd: int) -> None:
        return None

    async def resize(self, lease: Reservation, amount_micro_usd: int) -> None:
        return None

    async def release_lease(self, lease: Reservation, spent_micro_usd: int, costly_calls: Any) -> bool:
        return True

    async def close(self) -> None:
        return None


def _key() -> VerifiedKey:
    """The bench key as the key cache holds it: its ids are asyncpg's UUIDs, its budget a Decimal."""
    policy = KeyPolicy(budget_usd=Decimal(1_000_000), budget_period="total")
    return VerifiedKey(api_key_id=PgUUID(str(uuid.uuid4())), subject_id=PgUUID(str(uuid.uuid4())), name="bench",
                       key_prefix="llmg_bench00",
                       key_hash=b"\0" * 32, policy=policy, expires_at=None)


def _record(key: VerifiedKey, router: Router) -> CallRecord:
    """A finished S1 call: what the pipeline's record holds when ``_finish`` runs."""
    record = CallRecord(request_id=uuid.uuid4().hex, api_key_id=key.api_key_id, subject_id=key.subject_id,
                        requested_model="fast-model", stream=False, protocol="chat")
    record.served_model, record.provider, record.deployment = "fast-model", "fast", "fast/fast-model"
    record.price = router.resolve("fast-model").targets[0].deployment.price
    record.status, record.response_id, record.finish_reasons = 200, "chatcmpl-bench0123456789", ("stop",)
    record.usage = Usage(prompt_tokens=14, completion_tokens=9)
    record.latency, record.upstream_time = 0.00131, 0.00042
    return record


def _per_call_us(step: Callable[[], object], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, time.perf_counter() - started)
    return best / calls * 1e6


async def _per_call_us_async(step: Callable[[], Any], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            await step()
        best = min(best, time.perf_counter() - started)
    return best / calls * 1e6


async def measure(calls: int = 2_000, repeats: int = 25) -> dict[str, float]:
    """Microseconds per call of each step, and of both paths."""
    router = Router(parse_config(yaml.safe_dump(CONFIG), Path("bench.yaml")))
    route = router.resolve("fast-model")
    key = _key()
    with tempfile.TemporaryDirectory(prefix="bench-record-") as tmp:
        actor = BillingActor(None, Path(tmp), reservations=AdmitAll(),  # type: ignore[arg-type]
                             lease_fraction=0.02, lease_seconds=3600.0)
        actor._journal = journal = Journal.open(Path(tmp) / "ledger")
        handle = BillingHandle(actor, None)  # type: ignore[arg-type]
        try:
            record = _record(key, router)
            settle_cost(record)
            row = ledger_row(record)
            prices = [t.deployment.price for t in route.targets]

            async def reserve_and_settle() -> None:
                held = await handle.reserve(key, record, route, router, BODY)
                handle.settle(held, record)

            await reserve_and_settle()  # the lease is granted here; every later call draws from it
            results = {
                "new_call_id": _per_call_us(new_call_id, calls, repeats),
                "CallRecord()": _per_call_us(
                    lambda: CallRecord(request_id="r", api_key_id=key.api_key_id, subject_id=key.subject_id,
                                       requested_model="fast-model", stream=False, protocol="chat"),
                    calls, repeats),
                "worst_case_micro_usd": _per_call_us(lambda: worst_case_micro_usd(90, 4096, prices), calls, repeats),
                "reserve+settle (lease)": await _per_call_us_async(reserve_and_settle, calls, repeats),
                "settle_cost": _per_call_us(lambda: settle_cost(record), calls, repeats),
                "ledger_row": _per_call_us(lambda: ledger_row(record), calls, repeats),
                "ledger_line": _per_call_us(lambda: ledger_line(row), calls, repeats),
                "micro_usd(cost_usd)": _per_call_us(lambda: micro_usd(record.cost_usd), calls, repeats),
                "BillingHandle.record": _per_call_us(lambda: handle.record(record), calls, repeats),
            }
        finally:
            journal.close()
    results["reserve path (CallRecord + reserve+settle)"] = results["CallRecord()"] + results["reserve+settle (lease)"]
    results["record path (settle_cost + record)"] = results["settle_cost"] + results["BillingHandle.record"]
    results["total"] = (results["reserve path (CallRecord + reserve+settle)"]
                        + results["record path (settle_cost + record)"])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.record_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.calls, args.repeats))
    if args.json:
        print(json.dumps({name: round(us, 3) for name, us in results.items()}))
        return 0
    print(f"calls={args.calls} repeats={args.repeats} (fastest repeat, us per call)")
    for name, us in results.items():
        print(f"{name:>44}: {us:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
