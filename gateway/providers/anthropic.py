"""The ``anthropic`` provider: Anthropic's Messages API, spoken two ways.

* :meth:`AnthropicProvider.chat` takes the internal (OpenAI chat) shape and translates
  both ways with :mod:`gateway.protocols.anthropic` (requests, answers, errors) and
  :mod:`gateway.protocols.anthropic_stream` (the stream, event by event). Anthropic's
  error bodies become the OpenAI shape with the provider's status kept; an ``error``
  event mid-stream ends the stream as a provider failure.
* :meth:`AnthropicProvider.messages` and :meth:`AnthropicProvider.count_tokens` send an
  Anthropic-shaped body as it came (``POST /v1/messages`` passthrough: only the model
  name and the credential change, so ``cache_control``, thinking blocks and betas
  survive) and answer Anthropic's own bytes: body, events or error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway.core.config import ProviderConfig
from gateway.protocols.anthropic import (
    ANTHROPIC_VERSION,
    DEFAULT_MAX_TOKENS,
    to_chat_completion,
    to_messages_request,
    to_openai_error,
)
from gateway.protocols.anthropic_stream import ChunksFromEvents, StreamBroken
from gateway.providers.base import (
    IDENTITY_ENCODING,
    EventStream,
    Provider,
    Timeouts,
    UpstreamProtocolError,
    UpstreamReply,
    fetch_model_ids,
    map_transport_errors,
    stream_timeout,
    whole_answer_of,
)

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "AnthropicProvider",
    "StreamTranslator",
    "to_chat_completion",
    "to_messages_request",
    "to_openai_error",
]

_JSON_HEADERS = {"Content-Type": "application/json"}
#: Headers of a passed-through answer a client of the Messages API may read.
_NATIVE_REPLY_HEADERS = ("retry-after", "request-id")


class StreamTranslator(ChunksFromEvents):
    """The shared outbound stream translator; a broken stream is a provider failure here."""

    __slots__ = ()

    def feed(self, event: bytes) -> list[bytes]:
        try:
            return super().feed(event)
        except StreamBroken as exc:
            raise UpstreamProtocolError(str(exc)) from None


class AnthropicProvider(Provider):
    """Speaks the Messages API to ``base_url`` (``/v1/messages``, ``/v1/models``)."""

    system = "anthropic"
    key_header = ("x-api-key", "{}")
    speaks_messages = True

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        super().__init__(config, request_timeout=request_timeout)
        self._session = session
        # Accept the documented base (https://api.anthropic.com) and one ending in /v1.
        root = config.base_url[:-3] if config.base_url.endswith("/v1") else config.base_url
        self._messages_url = f"{root}/v1/messages"
        self._count_url = f"{root}/v1/messages/count_tokens"
        self._models_url = f"{root}/v1/models?limit=1000"
        self._headers: dict[str, str] = {
            "Content-Type": "application/json",
            "anthropic-version": ANTHROPIC_VERSION,
            **IDENTITY_ENCODING,
            **dict(config.headers),
        }
        # x-api-key is added per call by keyed_headers(), so a rotated key file takes effect.
        self._address = urlsplit(config.base_url).hostname

    @property
    def address(self) -> str | None:
        return self._address

    async def list_models(self) -> list[str]:
        return await fetch_model_ids(self._session, self._models_url, self.keyed_headers(self._headers))

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        payload = orjson.dumps(to_messages_request(body, stream=stream))
        keyed = self.keyed_headers(self._headers)
        send_headers = {**keyed, **headers} if headers else keyed
        if stream:
            with map_transport_errors():
                resp = await self._session.post(
                    self._messages_url,
                    data=payload,
                    headers=send_headers,
                    timeout=stream_timeout(timeouts or self.timeouts),
                    auto_decompress=True,
                )
            if resp.status < 300 and resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                translator = StreamTranslator(model=str(body.get("model") or ""), include_usage=_wants_usage(body))
                return UpstreamReply(status=resp.status, headers=_JSON_HEADERS,
                                     events=_translated_events(resp, translator), _release=resp.release)
            whole = await whole_answer_of(resp, self.config.max_response_bytes)
        else:
            whole = await self.post_whole(self._messages_url, payload, send_headers, timeouts)
        raw = whole.body
        reply_headers = dict(_JSON_HEADERS)
        if "retry-after" in whole.headers:
            reply_headers["retry-after"] = whole.headers["retry-after"]
        if whole.status >= 300:
            return UpstreamReply(status=whole.status, headers=reply_headers, body=to_openai_error(whole.status, raw))
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamProtocolError("anthropic answered a body that is not JSON") from None
        if not isinstance(message, dict) or message.get("type") != "message":
            raise UpstreamProtocolError("anthropic answered something other than a message")
        answer = to_chat_completion(message)
        if stream:
            # Asked to stream but answered whole: replay it as a one-chunk stream.
            translator = StreamTranslator(model=str(body.get("model") or ""), include_usage=_wants_usage(body))
            return UpstreamReply(
                status=whole.status, headers=_JSON_HEADERS, events=_replay_whole(message, translator)
            )
        return UpstreamReply(status=whole.status, headers=reply_headers, body=orjson.dumps(answer), answer=answer)


    async def messages(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        """Send an Anthropic Messages body as it is; answer Anthropic's own body or events."""
        return await self._native(self._messages_url, body, stream=stream, headers=headers,
                                  timeouts=timeouts or self.timeouts)

    async def count_tokens(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        """``POST /v1/messages/count_tokens`` with the body as it is; Anthropic's answer."""
        return await self._native(self._count_url, body, stream=False, headers=headers,
                                  timeouts=timeouts or self.timeouts)

    async def _native(
        self, url: str, body: dict[str, Any], *, stream: bool, headers: Mapping[str, str], timeouts: Timeouts
    ) -> UpstreamReply:
        keyed = self.keyed_headers(self._headers)
        send_headers = {**keyed, **headers} if headers else keyed
        if stream:
            with map_transport_errors():
                resp = await self._session.post(
                    url, data=orjson.dumps(body), headers=send_headers, timeout=stream_timeout(timeouts)
                )
            content_type = resp.headers.get("Content-Type", "")
            if resp.status < 300 and content_type.startswith("text/event-stream"):
                return UpstreamReply(status=resp.status, headers={"Content-Type": content_type},
                                     events=_native_events(resp), _release=resp.release, wire="anthropic")
            whole = await whole_answer_of(resp, self.config.max_response_bytes)
        else:
            whole = await self.post_whole(url, orjson.dumps(body), send_headers, timeouts)
        reply_headers = {"Content-Type": whole.headers.get("Content-Type", "") or "application/json"}
        for name in _NATIVE_REPLY_HEADERS:
            if name in whole.headers:
                reply_headers[name] = whole.headers[name]
        return UpstreamReply(status=whole.status, headers=reply_headers, body=whole.body, wire="anthropic")


def _native_events(resp: aiohttp.ClientResponse) -> EventStream:
    """Anthropic's events as sent."""
    return EventStream(resp)


def _wants_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _translated_events(resp: aiohttp.ClientResponse, translator: StreamTranslator) -> EventStream:
    """Anthropic's events as OpenAI chunk events."""
    return EventStream(resp, translator.feed)


async def _replay_whole(message: dict[str, Any], translator: StreamTranslator) -> AsyncIterator[bytes]:
    for out in translator.whole(message):
        yield out


