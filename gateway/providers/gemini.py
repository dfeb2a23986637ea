"""The Gemini API (``generativelanguage.googleapis.com``) behind the OpenAI chat shape.

Calls go to ``{base_url}/v1beta/models/{model}:generateContent`` and, streamed,
``:streamGenerateContent?alt=sse``; embeddings to ``:embedContent`` (one input) or
``:batchEmbedContents`` (a list). The key
travels in the ``x-goog-api-key`` header. The translation both ways is
gateway/protocols/gemini.py. A prompt blocked by Gemini's safety filters is answered
400 ``content_filter`` before any byte is relayed (the first streamed event is read
first for that reason); a ``google.rpc.RetryInfo`` delay on a 429 becomes the reply's
``retry-after``, so the deployment cools as long as Google asks.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import orjson

from gateway.core.config import ProviderConfig
from gateway.core.tokens import count_tokens
from gateway.protocols import gemini as wire
from gateway.protocols.chat import UpstreamAnswerError, wants_usage
from gateway.protocols.sse import iter_events
from gateway.providers.base import (
    Provider,
    Timeouts,
    UpstreamProtocolError,
    UpstreamReply,
    WholeAnswer,
    json_object,
    map_transport_errors,
    stream_chunks,
    stream_timeout,
    whole_answer_of,
)

__all__ = ["GeminiProvider", "google_error_reply", "translated"]

_JSON_HEADERS = {"Content-Type": "application/json"}


class GeminiProvider(Provider):
    """Speaks the Gemini API's own protocol to ``base_url``."""

    system = "gcp.gemini"
    serves_embeddings = True
    key_header = ("x-goog-api-key", "{}")

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        super().__init__(config, request_timeout=request_timeout)
        self._session = session
        root = config.base_url
        self._models_url = root if root.endswith(("/v1beta", "/v1")) else f"{root}/v1beta"
        self._headers: dict[str, str] = {"Content-Type": "application/json", **dict(config.headers)}
        self._address = urlsplit(config.base_url).hostname

    @property
    def address(self) -> str | None:
        return self._address

    def url(self, model: str, method: str) -> str:
        """``.../models/{model}:{method}`` (a ``models/`` prefix on the name is accepted)."""
        name = model.removeprefix("models/")
        return f"{self._models_url}/models/{quote(name, safe='')}:{method}"

    def passthrough_model(self, path: str) -> str | None:
        _, found, rest = path.rpartition("models/")
        model = rest.partition(":")[0]
        return model if found and model and "/" not in model else None

    async def auth_headers(self) -> Mapping[str, str]:
        """The headers every call sends, credential included (the API key here)."""
        return self.keyed_headers(self._headers)

    async def _post_stream(
        self, url: str, payload: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None,
    ) -> aiohttp.ClientResponse:
        keyed = await self.auth_headers()
        with map_transport_errors():
            return await self._session.post(
                url, data=orjson.dumps(payload), headers={**keyed, **headers} if headers else keyed,
                timeout=stream_timeout(timeouts or self.timeouts),
            )

    async def _post_whole(
        self, url: str, payload: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None,
    ) -> WholeAnswer:
        keyed = await self.auth_headers()
        return await self.post_whole(url, orjson.dumps(payload), {**keyed, **headers} if headers else keyed, timeouts)

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        model = str(body.get("model") or "")
        payload = wire.to_generate_content(body)
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        if stream:
            resp = await self._post_stream(self.url(model, method), payload, headers=headers, timeouts=timeouts)
            if resp.status < 300:
                try:
                    return await self._stream_reply(resp, model, wants_usage(body))
                except BaseException:
                    resp.close()
                    raise
            whole = await whole_answer_of(resp, self.config.max_response_bytes)
        else:
            whole = await self._post_whole(self.url(model, method), payload, headers=headers, timeouts=timeouts)
        if whole.status >= 300:
            return google_error_reply(whole.status, whole.body)
        answer = json_object(whole.body, "gemini")
        block = wire.safety_block(answer)
        if block is not None:
            return UpstreamReply(status=400, headers=_JSON_HEADERS, body=block.openai_error())
        return UpstreamReply(status=200, headers=_JSON_HEADERS,
                             body=orjson.dumps(wire.to_chat_completion(answer, model=model)))

    async def _stream_reply(self, resp: aiohttp.ClientResponse, model: str, include_usage: bool) -> UpstreamReply:
        """Read the first event (a safety block is a 400, not a broken stream), then relay."""
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            raise UpstreamProtocolError("gemini answered a stream request without an event stream")
        translator = wire.StreamTranslator(model=model, include_usage=include_usage)
        events = iter_events(stream_chunks(resp))
        first: dict[str, Any] | None = None
        with map_transport_errors():
            async for event in events:
                first = translated(translator.parse, event)
                if first is not None:
                    break
        if first is None:
            raise UpstreamProtocolError("gemini stream ended before any answer")
        block = wire.safety_block(first)
        if block is not None:
            resp.release()
            return UpstreamReply(status=400, headers=_JSON_HEADERS, body=block.openai_error())
        return UpstreamReply(status=200, headers=_JSON_HEADERS,
                             events=_relay(first, events, translator), _release=resp.release)

    async def embeddings(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        model = str(body.get("model") or "").removeprefix("models/")
        requests = wire.embedding_requests(body, model)
        # One string: embedContent; a list: batchEmbedContents, one request per input.
        single = isinstance(body.get("input"), str)
        method, payload = ("embedContent", requests[0]) if single else ("batchEmbedContents", {"requests": requests})
        whole = await self._post_whole(self.url(model, method), payload, headers=headers, timeouts=timeouts)
        if whole.status >= 300:
            return google_error_reply(whole.status, whole.body)
        estimate = sum(count_tokens(r["content"]["parts"][0]["text"]) for r in requests)
        answer = translated(lambda a: wire.to_embeddings_answer(a, body=body, model=model, prompt_tokens=estimate),
                            json_object(whole.body, "gemini"))
        return UpstreamReply(status=200, headers=_JSON_HEADERS, body=orjson.dumps(answer))


def translated(translate: Callable[[Any], Any], value: Any) -> Any:
    """``translate(value)``, a broken answer being the provider's failure (502 after retries)."""
    try:
        return translate(value)
    except UpstreamAnswerError as exc:
        raise UpstreamProtocolError(str(exc)) from None


def google_error_reply(status: int, raw: bytes, error_body: Callable[[int, bytes], bytes] = wire.to_openai_error
                       ) -> UpstreamReply:
    """A Google API error answer (Gemini's, Vertex's) in the OpenAI shape via ``error_body``,
    the delay of a ``google.rpc.RetryInfo`` detail as ``retry-after``."""
    headers = dict(_JSON_HEADERS)
    delay = wire.retry_delay(raw)
    if delay is not None:
        headers["retry-after"] = str(math.ceil(delay))
    return UpstreamReply(status=status, headers=headers, body=error_body(status, raw))


async def _relay(
    first: dict[str, Any], events: AsyncIterator[bytes], translator: wire.StreamTranslator
) -> AsyncIterator[bytes]:
    for out in translated(translator.feed, first):
        yield out
    with map_transport_errors():
        async for event in events:
            answer = translated(translator.parse, event)
            if answer is not None:
                for out in translated(translator.feed, answer):
                    yield out
    for out in translated(lambda _: translator.close(), None):
        yield out
