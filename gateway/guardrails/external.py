"""The guardrails that wait for I/O: a webhook, and a provider's moderation endpoint.

Webhook protocol (what the configured URL receives and answers)::

    POST <url>   {"policy": "name", "direction": "input" | "output", "texts": ["...", ...]}
    200          {"action": "allow"}
               | {"action": "block", "reasons": ["..."]}
               | {"action": "rewrite", "texts": ["...", ...], "reasons": ["..."]}

``texts`` are the prompt's (or the answer's) texts in order; a rewrite answers one text
for each. A check that does not answer within ``timeout_seconds``, answers a status other
than 200, or answers something else counts as unavailable: the call goes on when the
policy fails open (``fail_open: true``, recorded as ``failed_open``), and is blocked when
it fails closed (the default).

Moderation: OpenAI's ``POST /moderations`` shape (``{"model", "input": [...]}`` →
``{"results": [{"flagged", "categories": {...}}]}``), sent to the deployment of the
policy's model group by the edge; any flagged result blocks (or is logged), with the
flagged category names recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from gateway.guardrails.engine import UNAVAILABLE, Direction, Verdict
from gateway.guardrails.policies import Policy

__all__ = ["HttpChecks", "ModerationCall", "moderation_verdict", "webhook_verdict"]

#: Sends a moderation request for a policy: (policy, body) → the provider's JSON answer.
ModerationCall = Callable[[Policy, Mapping[str, Any]], Awaitable[Any]]


def _unavailable(policy: Policy) -> Verdict:
    return Verdict("allow" if policy.fail_open else "block", kinds=(UNAVAILABLE,))


def webhook_verdict(answer: Any, n_texts: int) -> Verdict | None:
    """A webhook's JSON answer as a verdict; None when it does not follow the protocol."""
    if not isinstance(answer, dict):
        return None
    action = answer.get("action")
    reasons = answer.get("reasons")
    kinds = tuple(str(r) for r in reasons) if isinstance(reasons, list) else ()
    if action == "allow":
        return Verdict("allow")
    if action == "block":
        return Verdict("block", kinds=kinds)
    if action == "rewrite":
        texts = answer.get("texts")
        if isinstance(texts, list) and len(texts) == n_texts and all(isinstance(t, str) for t in texts):
            return Verdict("rewrite", texts=tuple(texts), kinds=kinds)
    return None


def moderation_verdict(answer: Any) -> Verdict | None:
    """An OpenAI-shaped moderation answer as a verdict; None when it is not one."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        return None
    flagged: set[str] = set()
    any_flagged = False
    for result in results:
        if not isinstance(result, dict):
            return None
        if result.get("flagged") is True:
            any_flagged = True
            categories = result.get("categories")
            if isinstance(categories, dict):
                flagged.update(name for name, hit in categories.items() if hit is True)
    return Verdict("block", kinds=tuple(sorted(flagged))) if any_flagged else Verdict("allow")


class HttpChecks:
    """:class:`~gateway.guardrails.engine.ExternalChecks` over the gateway's client session."""

    def __init__(self, session: aiohttp.ClientSession, moderation: ModerationCall | None = None) -> None:
        self._session = session
        self._moderation = moderation

    async def webhook(self, policy: Policy, direction: Direction, texts: Sequence[str]) -> Verdict:
        assert policy.url is not None
        payload = orjson.dumps({"policy": policy.name, "direction": direction, "texts": list(texts)})
        try:
            async with asyncio.timeout(policy.timeout_seconds), self._session.post(
                policy.url, data=payload, headers={"Content-Type": "application/json"}
            ) as resp:
                if resp.status != 200:
                    return _unavailable(policy)
                answer = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, OSError):
            return _unavailable(policy)
        verdict = webhook_verdict(answer, len(texts))
        return verdict if verdict is not None else _unavailable(policy)

    async def moderate(self, policy: Policy, texts: Sequence[str]) -> Verdict:
        if self._moderation is None:
            return _unavailable(policy)
        try:
            async with asyncio.timeout(policy.timeout_seconds):
                answer = await self._moderation(policy, {"input": list(texts)})
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return _unavailable(policy)
        verdict = moderation_verdict(answer)
        return verdict if verdict is not None else _unavailable(policy)
