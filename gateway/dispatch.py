"""Sending one chat call: choosing among a route's targets and failing over.

The relay (:mod:`gateway.chat`) asks for a reply; this module decides where it comes
from: the route's targets in order, each with the retry policy of
:mod:`gateway.upstream`, moving on when a target cannot answer. It returns before the
first byte of a stream is read, so a stream fails over only while nothing has reached
the client.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.providers.base import ProviderError, UpstreamReply, UpstreamTimeoutError
from gateway.routing import Route, Target
from gateway.state import GatewayState
from gateway.upstream import call_with_retries
from gateway.usage import CallRecord

__all__ = ["dispatch"]


async def dispatch(
    state: GatewayState, route: Route, body: dict[str, Any], record: CallRecord, *, stream: bool
) -> tuple[Target, UpstreamReply]:
    """Try the route's targets in order; the first reply that is not a failure wins."""
    last_error: ProviderError | None = None
    last_reply: UpstreamReply | None = None
    for index, target in enumerate(route.targets):
        provider = state.providers[target.provider]
        upstream_body = body if body.get("model") == target.upstream_model else {**body, "model": target.upstream_model}
        record.provider, record.deployment = target.provider, target.deployment.id
        record.failovers = index

        def count_retry(_attempt: int, _reason: str) -> None:
            record.retries += 1

        try:
            reply = await call_with_retries(
                provider, upstream_body, stream=stream, headers={},
                policy=state.retry_policy, on_retry=count_retry,
            )
        except ProviderError as exc:
            last_error, last_reply = exc, None
            continue
        if reply.status >= 500 and index + 1 < len(route.targets):
            await reply.release()
            last_reply = reply
            continue
        return target, reply
    if last_reply is not None:
        return route.targets[-1], last_reply
    if isinstance(last_error, UpstreamTimeoutError):
        raise UpstreamTimeout(f"upstream timed out after {record.retries} retries")
    raise UpstreamUnavailable(f"upstream unavailable: {last_error}")
