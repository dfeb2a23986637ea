"""One call to one deployment, with the contract's retry policy.

Retried: connection errors (never sent, always safe), timeouts (only where the
provider allows ``retry_on_timeout``: the call may have been billed), and the statuses
408/429/500/502/503/504. Backoff is exponential with full jitter, and a provider's
``Retry-After`` is honoured when it asks for longer (capped, so one answer cannot park
a request forever). A stream is retried only while nothing has reached the client,
which holds here: this module returns before the first event is read.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.providers.base import (
    Provider,
    ProviderError,
    UpstreamConnectError,
    UpstreamReply,
    UpstreamTimeoutError,
)

__all__ = ["RETRYABLE_STATUSES", "RetryPolicy", "call_with_retries"]

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int = 2
    base_delay: float = 0.1
    max_delay: float = 2.0
    #: Longest Retry-After honoured before giving up on this deployment.
    max_retry_after: float = 10.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        backoff = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
        if retry_after is not None:
            return max(backoff, retry_after)
        return backoff


async def call_with_retries(
    provider: Provider,
    body: dict[str, Any],
    *,
    stream: bool,
    headers: Mapping[str, str],
    policy: RetryPolicy,
    on_retry: Callable[[int, str], None] | None = None,
) -> UpstreamReply:
    """Call ``provider`` until an answer worth returning, or raise the last error.

    Returns the last reply even if its status is an error (the caller relays the
    provider's own status and body); raises ProviderError if no reply came.
    """
    attempt = 0
    while True:
        try:
            reply = await provider.chat(body, stream=stream, headers=headers)
        except ProviderError as exc:
            retryable = isinstance(exc, UpstreamConnectError) or (
                isinstance(exc, UpstreamTimeoutError) and provider.config.retry_on_timeout
            ) or not exc.maybe_delivered
            if not retryable or attempt >= policy.max_retries:
                raise
            reason = type(exc).__name__
            await asyncio.sleep(policy.delay(attempt, None))
        else:
            if reply.status not in RETRYABLE_STATUSES or attempt >= policy.max_retries:
                return reply
            retry_after = reply.retry_after
            if retry_after is not None and retry_after > policy.max_retry_after:
                return reply
            await reply.release()
            reason = str(reply.status)
            await asyncio.sleep(policy.delay(attempt, retry_after))
        attempt += 1
        if on_retry is not None:
            on_retry(attempt, reason)
