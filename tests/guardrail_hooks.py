"""Guardrail hooks for the tests, referenced as ``tests.guardrail_hooks:<function>``."""

from __future__ import annotations

import asyncio

from gateway.guardrails.engine import Verdict


def refuse_pineapple(direction: str, texts: list[str]) -> Verdict | None:
    """Blocks any text that mentions pineapple pizza."""
    return Verdict("block", kinds=("pineapple",)) if any("pineapple" in t.lower() for t in texts) else None


async def shout(direction: str, texts: list[str]) -> Verdict:
    """Rewrites every text in capitals (an async hook)."""
    await asyncio.sleep(0)
    return Verdict("rewrite", texts=tuple(t.upper() for t in texts), kinds=("shouted",))
