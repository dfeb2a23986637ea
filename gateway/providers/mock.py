"""The built-in ``mock`` provider: deterministic answers offline, with usage.

It makes the quick start work with no network and no provider account. Answers come
from :mod:`gateway.providers.mock_text`, the same generator the standalone fake provider serves
over HTTP, so the mock and the fake agree byte for byte on content and usage.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from gateway.providers import mock_text
from gateway.providers.base import Provider, Timeouts, UpstreamReply

__all__ = ["MockProvider"]

_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "text/event-stream"}


class MockProvider(Provider):
    """Answers every model in-process, stream and non-stream."""

    system = "mock"
    serves_embeddings = True

    def __init__(self, config: Any, *, request_timeout: float) -> None:
        super().__init__(config, request_timeout=request_timeout)
        self._ids = itertools.count(1)

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        response_id = f"chatcmpl-mock-{next(self._ids)}"
        created = int(time.time())
        if not stream:
            answer = mock_text.completion(body, response_id=response_id, created=created)
            return UpstreamReply(status=200, headers=_JSON, body=orjson.dumps(answer))
        chunks = mock_text.stream_chunks(body, response_id=response_id, created=created)
        return UpstreamReply(status=200, headers=_SSE, events=_replay(chunks))

    async def embeddings(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        return UpstreamReply(status=200, headers=_JSON, body=orjson.dumps(mock_text.embeddings(body)))

    async def list_models(self) -> list[str]:
        return list(mock_text.MODEL_IDS)


async def _replay(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield mock_text.encode_event(chunk)
    yield mock_text.DONE_EVENT
