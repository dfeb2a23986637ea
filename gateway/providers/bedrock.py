"""AWS Bedrock's Converse and ConverseStream APIs behind the OpenAI chat shape.

Needs the ``bedrock`` extra (botocore): requests are signed with botocore's SigV4 signer
(service ``bedrock``, the deployment's region) and ConverseStream's
``application/vnd.amazon.eventstream`` frames are read with botocore's event-stream
parser, which checks each frame's prelude and message CRCs. Credentials come from
botocore's standard chain, resolved on the first call (in a thread: the chain may read
files or ask the instance metadata service): environment variables, the shared
credentials and config files (``profile``), web identity, container and instance roles.
Refreshable credentials are refreshed (in a thread) when botocore says they are due.

Calls: ``POST {base_url}/model/{modelId}/converse`` and ``/converse-stream``; the
translation both ways is gateway/protocols/bedrock.py. A 429 (``ThrottlingException``)
keeps its status, so it cools the deployment like any 429.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import orjson
import yarl
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.eventstream import EventStreamBuffer, ParserError
from botocore.session import Session as BotocoreSession

from gateway.core.config import ProviderConfig
from gateway.protocols import bedrock as wire
from gateway.protocols.chat import UpstreamAnswerError, wants_usage
from gateway.providers.base import (
    Provider,
    Timeouts,
    UpstreamProtocolError,
    UpstreamReply,
    client_timeout,
    map_transport_errors,
)

__all__ = ["SIGNING_SERVICE", "BedrockProvider"]

#: The SigV4 service name of bedrock-runtime.
SIGNING_SERVICE = "bedrock"
_JSON_HEADERS = {"Content-Type": "application/json"}
_EVENT_STREAM = "application/vnd.amazon.eventstream"


class BedrockProvider(Provider):
    """Speaks Converse to one region's ``bedrock-runtime`` endpoint."""

    system = "aws.bedrock"

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        super().__init__(config, request_timeout=request_timeout)
        self._session = session
        self.region = config.option("region") or os.environ.get("AWS_REGION") or os.environ.get(
            "AWS_DEFAULT_REGION") or "us-east-1"
        self._base = config.base_url or f"https://bedrock-runtime.{self.region}.amazonaws.com"
        self._botocore = BotocoreSession(profile=config.option("profile"))
        self._credentials: Any = None
        self._resolving = asyncio.Lock()
        self._address = urlsplit(self._base).hostname

    @property
    def address(self) -> str | None:
        return self._address

    @property
    def passthrough_base(self) -> str:
        return ""  # a pass-through call would need SigV4 over the client's request: not offered

    def url(self, model: str, operation: str) -> str:
        return f"{self._base}/model/{quote(model, safe='')}/{operation}"

    async def _frozen_credentials(self) -> Any:
        """Current credentials from the standard chain; UpstreamProtocolError if none."""
        if self._credentials is None:
            async with self._resolving:
                if self._credentials is None:
                    self._credentials = await asyncio.to_thread(self._botocore.get_credentials)
        if self._credentials is None:
            raise UpstreamProtocolError(
                "no AWS credentials found (environment, profile files, web identity or instance role)")
        refresh_needed = getattr(self._credentials, "refresh_needed", None)
        if refresh_needed is not None and refresh_needed():
            return await asyncio.to_thread(self._credentials.get_frozen_credentials)
        return self._credentials.get_frozen_credentials()

    async def _post(self, url: str, payload: bytes, *, stream: bool, headers: Mapping[str, str],
                    timeouts: Timeouts | None) -> aiohttp.ClientResponse:
        request = AWSRequest(method="POST", url=url, data=payload, headers={
            "Content-Type": "application/json", "Accept": _EVENT_STREAM if stream else "application/json"})
        SigV4Auth(await self._frozen_credentials(), SIGNING_SERVICE, self.region).add_auth(request)
        signed = dict(request.headers.items())
        with map_transport_errors():
            return await self._session.post(
                # encoded=True: send the path exactly as signed (yarl would decode %3A to ':').
                yarl.URL(url, encoded=True), data=payload, headers={**headers, **signed},
                timeout=client_timeout(timeouts or self.timeouts, stream=stream),
            )

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        model = str(body.get("model") or "")
        payload = orjson.dumps(wire.to_converse(body))
        url = self.url(model, "converse-stream" if stream else "converse")
        resp = await self._post(url, payload, stream=stream, headers=headers, timeouts=timeouts)
        response_id = f"bedrock-{resp.headers.get('x-amzn-RequestId', '')}"
        try:
            if stream and resp.status < 300:
                if not resp.headers.get("Content-Type", "").startswith(_EVENT_STREAM):
                    raise UpstreamProtocolError("bedrock answered a stream request without an event stream")
                translator = wire.StreamTranslator(model=model, include_usage=wants_usage(body),
                                                   response_id=response_id)
                return UpstreamReply(status=resp.status, headers=_JSON_HEADERS,
                                     events=_translated_events(resp, translator), _release=resp.release)
            with map_transport_errors():
                raw = await resp.read()
        except BaseException:
            resp.close()
            raise
        resp.release()
        if resp.status >= 300:
            reply_headers = dict(_JSON_HEADERS)
            if "retry-after" in resp.headers:
                reply_headers["retry-after"] = resp.headers["retry-after"]
            return UpstreamReply(status=resp.status, headers=reply_headers,
                                 body=wire.to_openai_error(resp.status, raw, resp.headers.get("x-amzn-ErrorType")))
        try:
            answer = orjson.loads(raw)
            if not isinstance(answer, dict):
                raise UpstreamAnswerError("bedrock answered JSON that is not an object")
            completion = wire.to_chat_completion(answer, model=model, response_id=response_id)
        except (orjson.JSONDecodeError, UpstreamAnswerError) as exc:
            raise UpstreamProtocolError(f"bedrock answered a broken body: {exc}") from None
        return UpstreamReply(status=200, headers=_JSON_HEADERS, body=orjson.dumps(completion))


async def _translated_events(resp: aiohttp.ClientResponse, translator: wire.StreamTranslator) -> AsyncIterator[bytes]:
    """ConverseStream's binary frames, CRC-checked by botocore, as OpenAI chunk events."""
    frames = EventStreamBuffer()
    with map_transport_errors():
        async for chunk in resp.content.iter_any():
            frames.add_data(chunk)
            try:
                # One frame at a time: those before a broken one are still relayed.
                for message in frames:
                    for out in _translated_message(message, translator):
                        yield out
            except ParserError as exc:
                raise UpstreamProtocolError(f"bedrock event stream broken: {type(exc).__name__}: {exc}") from None
    if not translator.finished:
        raise UpstreamProtocolError("bedrock event stream ended before its metadata event")


def _translated_message(message: Any, translator: wire.StreamTranslator) -> list[bytes]:
    headers = message.headers
    kind = headers.get(":message-type")
    try:
        payload = orjson.loads(message.payload) if message.payload else {}
    except orjson.JSONDecodeError:
        raise UpstreamProtocolError("bedrock stream sent an event that is not JSON") from None
    if kind == "exception" or kind == "error":
        name = headers.get(":exception-type") or headers.get(":error-code") or "error"
        detail = payload.get("message", "") if isinstance(payload, dict) else ""
        raise UpstreamProtocolError(f"bedrock stream error: {name}: {detail}")
    if kind != "event" or not isinstance(payload, dict):
        return []
    return translator.feed(str(headers.get(":event-type")), payload)
