"""OpenAI-compatible providers (OpenAI, Venice, vLLM, ...): the body goes through as is.

The provider's credential is added here, server-side; nothing the client sent in its
headers is forwarded except the trace context the relay passes in ``headers``.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway.core.config import ProviderConfig
from gateway.providers.base import (
    IDENTITY_ENCODING,
    TRANSPORT_FAILURES,
    EventStream,
    Provider,
    Timeouts,
    UpstreamProtocolError,
    UpstreamReply,
    fetch_model_ids,
    read_reply,
    stream_timeout,
    transport_error,
)

__all__ = ["OpenAIProvider"]


class OpenAIProvider(Provider):
    """Speaks the OpenAI wire to ``base_url`` (``/chat/completions``, ``/embeddings``, and
    ``/responses`` where ``responses_api`` says the deployment serves it)."""

    system = "openai"
    serves_embeddings = True

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        super().__init__(config, request_timeout=request_timeout)
        self._session = session
        self._chat_url = f"{config.base_url}/chat/completions"
        self._embeddings_url = f"{config.base_url}/embeddings"
        self._responses_url = f"{config.base_url}/responses"
        # The key is added per call by keyed_headers(), so a rotated key file takes effect.
        self._headers: dict[str, str] = {
            "Content-Type": "application/json", **IDENTITY_ENCODING, **dict(config.headers)
        }
        self._stream_timeout = stream_timeout(self.timeouts)
        self._address = urlsplit(config.base_url).hostname

    @property
    def address(self) -> str | None:
        return self._address

    def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> Coroutine[Any, Any, UpstreamReply]:
        # Not a coroutine of its own around _post's: one coroutine less per call.
        return self._post(self._chat_url, orjson.dumps(body), stream=stream, headers=headers, timeouts=timeouts)

    async def responses(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        reply = await self._post(
            self._responses_url, orjson.dumps(body), stream=stream, headers=headers, timeouts=timeouts
        )
        reply.wire = "responses"
        return reply

    async def embeddings(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        return await self._post(
            self._embeddings_url, orjson.dumps(body), stream=False, headers=headers, timeouts=timeouts
        )

    async def list_models(self) -> list[str]:
        return await fetch_model_ids(self._session, f"{self.config.base_url}/models", self.keyed_headers(self._headers))

    async def _post(
        self, url: str, data: bytes, *, stream: bool, headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        keyed = self.keyed_headers(self._headers)
        send_headers = {**keyed, **headers} if headers else keyed
        if not stream:
            whole = await self.post_whole(url, data, send_headers, timeouts)
            answer = (_checked_whole_answer(whole.body, whole.headers.get("Content-Type", ""), stream=False)
                      if whole.status < 300 else None)
            return UpstreamReply(status=whole.status, headers=whole.headers, body=whole.body, answer=answer)
        if timeouts is None or timeouts is self.timeouts:
            # Dispatch passes the provider's own timeouts unless the route group sets its
            # own: aiohttp's timeout for them is built once, not per call (0.7 µs).
            timeout = self._stream_timeout
        else:
            timeout = stream_timeout(timeouts)
        try:
            resp = await self._session.post(
                url, data=data, headers=send_headers, timeout=timeout, auto_decompress=True
            )
        except TRANSPORT_FAILURES as exc:  # map_transport_errors(), without its two calls
            raise transport_error(exc) from exc
        content_type = resp.headers.get("Content-Type", "")
        if resp.status < 300 and content_type.startswith("text/event-stream"):
            return UpstreamReply(status=resp.status, headers=resp.headers, events=_events(resp), _release=resp.release)
        payload = await read_reply(resp, self.config.max_response_bytes)
        answer = _checked_whole_answer(payload, content_type, stream=True) if resp.status < 300 else None
        return UpstreamReply(status=resp.status, headers=resp.headers, body=payload, answer=answer)


def _checked_whole_answer(payload: bytes, content_type: str, *, stream: bool) -> dict[str, Any]:
    """A 2xx answer must be what was asked for; anything else is the provider's failure.

    Relaying an HTML page or half a JSON document with our 200 would hand the client a
    broken answer it cannot tell from a good one: fail it (502 after retries) instead.
    """
    if stream:
        raise UpstreamProtocolError(
            f"upstream answered {content_type.split(';')[0] or 'no content type'} instead of an event stream"
        )
    try:
        answer = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise UpstreamProtocolError("upstream answered a body that is not JSON") from None
    if not isinstance(answer, dict):
        raise UpstreamProtocolError("upstream answered JSON that is not an object")
    return answer  # parsed once: handed on in the reply, never parsed again


def _events(resp: aiohttp.ClientResponse) -> EventStream:
    """The stream's events as the provider sent them."""
    return EventStream(resp)
