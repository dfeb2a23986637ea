"""What the hot path's chat-body check costs, and what the same check through pydantic would.

    python -m bench.chat_body [--calls N]

``gateway.edge.chat.parse_chat_body`` checks only ``model``, ``messages`` (each with a
string ``role``) and ``stream``, by hand, on the dict orjson already decoded; every other
field passes through untouched. The config file and the admin API are validated by typed
models (:mod:`gateway.core.schema`); the chat body deliberately is not, and this script
keeps the reason on record: it times both on a one-message body and a 40-message one and
prints microseconds per call (median of five rounds). A run takes a second or two.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from gateway.edge.chat import parse_chat_body

__all__ = ["main", "measure"]

ROUNDS = 5


class _Message(BaseModel):
    """The same rule as parse_chat_body's: an object with a string role, anything else kept."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr


class _ChatBody(BaseModel):
    """The three checked fields as a pydantic model (extra fields allowed, as they pass through)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr = Field(min_length=1, pattern=r"\S")
    messages: list[_Message] = Field(min_length=1)
    stream: StrictBool = False


def _pydantic_check(body: dict[str, Any]) -> tuple[str, bool]:
    checked = _ChatBody.model_validate(body)
    return checked.model, checked.stream


def _body(messages: int) -> dict[str, Any]:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 30}
             for i in range(messages)]
    return {"model": "smart", "messages": turns, "stream": True, "temperature": 0.2, "max_tokens": 256}


def _per_call_us(check: Callable[[dict[str, Any]], tuple[str, bool]], body: dict[str, Any], calls: int) -> float:
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            check(body)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def measure(calls: int) -> dict[str, float]:
    """µs per call of each check on each body, keyed ``"<check> <n> message(s)"``."""
    out = {}
    for n in (1, 40):
        body = _body(n)
        assert parse_chat_body(body) == _pydantic_check(body) == ("smart", True)
        out[f"parse_chat_body {n} message(s)"] = _per_call_us(parse_chat_body, body, calls)
        out[f"pydantic model  {n} message(s)"] = _per_call_us(_pydantic_check, body, calls)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.chat_body", description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000, help="calls per round (default 20000)")
    args = parser.parse_args(argv)
    for label, us in measure(args.calls).items():
        print(f"{label:32s} {us:8.2f} µs/call")


if __name__ == "__main__":
    main()
