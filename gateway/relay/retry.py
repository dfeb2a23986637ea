"""The retry policy of one deployment, and how an attempt's ending is classified.

Retried on the same deployment (then the next one, see :mod:`gateway.edge.dispatch`):
connection errors (the request never left, so sending it again is always safe),
timeouts and connections dropped after sending (only where the provider's
``retry_on_timeout`` allows: the call may have run and been billed), and the statuses
408/429/500/502/503/504 (and Anthropic's 529). Backoff is exponential with full jitter;
a provider's ``Retry-After`` is honoured when it asks for longer, capped, so one answer
cannot park a request forever.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gateway.core.config import ProviderConfig
from gateway.providers.base import ProviderError

__all__ = ["RETRYABLE_STATUSES", "RetryPolicy", "is_failure_status", "may_resend"]

#: Statuses worth sending again (429 after its Retry-After; 529 is Anthropic's "overloaded").
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 529})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently one deployment is retried within one call."""

    max_retries: int = 2
    base_delay: float = 0.1
    max_delay: float = 2.0
    #: Longest Retry-After honoured before giving up on this deployment.
    max_retry_after: float = 10.0

    def retries_for(self, provider: ProviderConfig) -> int:
        """The provider's own ``max_retries`` if set, else the gateway's."""
        return self.max_retries if provider.max_retries is None else provider.max_retries

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        backoff = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
        if retry_after is not None:
            return max(backoff, retry_after)
        return backoff


def is_failure_status(status: int) -> bool:
    """Does this answer say the deployment is failing (408 or 5xx)? A 429 does not."""
    return status == 408 or status >= 500


def may_resend(exc: ProviderError, provider: ProviderConfig) -> bool:
    """May a call that failed with ``exc`` be sent again, here or elsewhere?

    Always when it provably never left (no connection); otherwise (a timeout, a
    connection dropped after sending) only where the provider's ``retry_on_timeout``
    allows, since the provider may have run and billed it.
    """
    return not exc.maybe_delivered or provider.retry_on_timeout
