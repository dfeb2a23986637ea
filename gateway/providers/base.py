"""What every provider offers the relay, and the errors it may raise.

A provider takes an OpenAI-shaped chat body and answers either a whole body
(:class:`UpstreamReply` with ``body``) or a stream of OpenAI SSE events (``events``).
Providers speaking another wire (Anthropic) translate both ways, so everything above
this module sees one shape. Foreign exceptions (aiohttp, asyncio) are translated here,
at the boundary, into :class:`ProviderError` subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.config import ProviderConfig

__all__ = [
    "Provider",
    "ProviderError",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamReply",
    "UpstreamTimeoutError",
    "map_transport_errors",
]


class ProviderError(Exception):
    """The call to the provider failed before it gave an HTTP answer."""

    #: Could the request have reached the provider (and been billed there)?
    maybe_delivered: bool = True


class UpstreamConnectError(ProviderError):
    """No connection could be made: the request never left, so a retry is always safe."""

    maybe_delivered = False


class UpstreamTimeoutError(ProviderError):
    """The provider did not answer (or went silent) within its timeout."""


class UpstreamProtocolError(ProviderError):
    """The provider answered something that is not HTTP/JSON/SSE as promised."""


@contextlib.contextmanager
def map_transport_errors() -> Iterator[None]:
    """Translate aiohttp/asyncio failures into ProviderError, most specific first."""
    try:
        yield
    except (aiohttp.ClientConnectorError, aiohttp.ClientConnectorDNSError) as exc:
        raise UpstreamConnectError(str(exc) or type(exc).__name__) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeoutError("upstream timed out") from exc
    except aiohttp.ClientPayloadError as exc:
        raise UpstreamProtocolError(f"upstream body broken: {exc}") from exc
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise UpstreamProtocolError(f"upstream connection failed: {type(exc).__name__}: {exc}") from exc


@dataclass(slots=True)
class UpstreamReply:
    """A provider's HTTP answer: whole (``body``) or streaming (``events``)."""

    status: int
    headers: Mapping[str, str]
    body: bytes = b""
    events: AsyncIterator[bytes] | None = None
    #: The upstream response id and model, when known before the body is read.
    extra: dict[str, Any] = field(default_factory=dict)
    _release: Callable[[], Awaitable[None] | None] | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def retry_after(self) -> float | None:
        raw = self.headers.get("retry-after") or self.headers.get("Retry-After")
        if raw is None:
            return None
        try:
            return max(0.0, float(raw))
        except ValueError:
            return None

    async def release(self) -> None:
        """Give the connection back (or close it); safe to call twice."""
        release, self._release = self._release, None
        if release is not None:
            result = release()
            if asyncio.iscoroutine(result):
                await result


class Provider:
    """Base of every provider: one upstream account reached over a shared session."""

    #: Value of ``gen_ai.provider.name`` for spans.
    system: str = "openai"

    def __init__(self, config: ProviderConfig, *, request_timeout: float) -> None:
        self.config = config
        self.name = config.name
        self.request_timeout = config.timeout or request_timeout
        self.idle_timeout = config.idle_timeout or request_timeout

    async def chat(
        self, body: dict[str, Any], *, stream: bool, headers: Mapping[str, str]
    ) -> UpstreamReply:
        """Send one chat call; for a 2xx stream, ``events`` yields OpenAI SSE events."""
        raise NotImplementedError

    async def embeddings(self, body: dict[str, Any], *, headers: Mapping[str, str]) -> UpstreamReply:
        """Send one embeddings call (OpenAI shape)."""
        raise UpstreamProtocolError(f"provider {self.name} does not serve embeddings")

    @property
    def address(self) -> str | None:
        """Host of the provider, for ``server.address``."""
        return None

    async def close(self) -> None:
        """Release what the provider holds beyond the shared session."""
