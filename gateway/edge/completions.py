"""``POST /v1/completions``: OpenAI's legacy completions, as an adapter of the pipeline.

Every guarantee of chat completions holds (keys, limits, budgets, routing, breakers,
retries and failover, cancellation, the ledger with ``protocol`` = ``completions``,
metrics, spans, the contract's errors). The request is translated to chat
(:mod:`gateway.protocols.completions`) for every deployment, and the answer and stream
back, chunk by chunk. The response cache serves it under chat's rules: its entries are
chat answers, rendered as text completions on a hit (docs/cache.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson
from aiohttp import web

from gateway.core.errors import InvalidRequest, UpstreamUnavailable
from gateway.core.usage import StreamTap
from gateway.edge.pipeline import Inbound, Parsed, serve
from gateway.edge.relays import StreamRelay, TapRelay
from gateway.protocols.completions import (
    from_completions_request,
    to_text_completion,
    to_text_completion_chunk,
)
from gateway.providers.base import UpstreamReply

__all__ = ["COMPLETIONS", "LegacyCompletions", "completions"]

_JSON = {"Content-Type": "application/json"}


class _CompletionsRelay(TapRelay):
    """Chat chunks re-framed as text completion chunks; unasked-for usage hidden."""

    def chunk(self, event: bytes, data: bytes) -> bytes | None:
        return to_text_completion_chunk(data)


class LegacyCompletions(Inbound):
    name: ClassVar[str] = "completions"
    cacheable: ClassVar[bool] = True

    def parse(self, body: dict[str, Any], request: web.Request) -> Parsed:
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            raise InvalidRequest("'model' must be a non-empty string", code="invalid_model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a boolean", code="invalid_stream")
        options = body.get("stream_options")
        wants_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        return Parsed(model=model, stream=stream, body=from_completions_request(body), wants_usage=wants_usage)

    def answer(self, reply: UpstreamReply, answer: dict[str, Any] | None, parsed: Parsed) -> web.Response:
        if not reply.ok:  # the provider's own error: its status and body, as on chat
            return self.unstreamed(reply)
        if answer is None:
            raise UpstreamUnavailable("upstream answered something other than a chat completion")
        return web.Response(status=200, body=orjson.dumps(to_text_completion(answer)), headers=_JSON)

    def unstreamed(self, reply: UpstreamReply) -> web.Response:
        return web.Response(status=reply.status, body=reply.body,
                            headers={"Content-Type": reply.headers.get("Content-Type", "application/json")})

    def relay(self, reply: UpstreamReply, parsed: Parsed, keep_text: bool, prompt_estimate: int) -> StreamRelay:
        return _CompletionsRelay(StreamTap(client_wants_usage=parsed.wants_usage, keep_text=keep_text))


COMPLETIONS = LegacyCompletions()


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await serve(request, COMPLETIONS)
