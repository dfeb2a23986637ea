"""AWS Bedrock's Converse and ConverseStream APIs behind the OpenAI chat shape; embeddings
through InvokeModel; pass-through calls re-signed.

Needs the ``bedrock`` extra (botocore): requests are signed with botocore's SigV4 signer
(service ``bedrock``, the deployment's region) and ConverseStream's
``application/vnd.amazon.eventstream`` frames are read with botocore's event-stream
parser, which checks each frame's prelude and message CRCs. Credentials come from
botocore's standard chain, resolved on the first call (in a thread: the chain may read
files or ask the instance metadata service): environment variables, the shared
credentials and config files (``profile``), web identity, container and instance roles.
Refreshable credentials are refreshed (in a thread) when botocore says they are due.

Regions: the provider's ``region`` is the default; a deployment naming its own
(``models[].deployments[].region``) is served by a view of the provider in that region
(:meth:`BedrockProvider.for_deployment`): same credentials, its own endpoint host
(``bedrock-runtime.{region}.amazonaws.com``, or ``base_url`` with ``{region}`` filled in)
and SigV4 scope.

Calls: ``POST {base_url}/model/{modelId}/converse`` and ``/converse-stream``; embeddings
``/model/{modelId}/invoke`` with the model's own body (Amazon Titan Text Embeddings, one
call per input; Cohere Embed, one call for all); the translation both ways is
gateway/protocols/bedrock.py. A 429 (``ThrottlingException``) keeps its status, so it
cools the deployment like any 429. Pass-through calls (``/passthrough/{name}/...``) are
signed here over their own method, path, query and body.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import aiohttp
import orjson
import yarl
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.eventstream import EventStreamBuffer, ParserError
from botocore.exceptions import BotoCoreError, ClientError
from botocore.session import Session as BotocoreSession

from gateway.core.config import Deployment, ProviderConfig
from gateway.core.tokens import count_tokens
from gateway.protocols import bedrock as wire
from gateway.protocols.chat import UpstreamAnswerError, wants_usage
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
from gateway.providers.credentials import RefreshedInThread

__all__ = ["SIGNING_SERVICE", "BedrockProvider"]

#: The SigV4 service name of bedrock-runtime.
SIGNING_SERVICE = "bedrock"
_JSON_HEADERS = {"Content-Type": "application/json"}
_EVENT_STREAM = "application/vnd.amazon.eventstream"
#: The headers of a pass-through call that are signed (with host and the x-amz-* ones).
_SIGNED_PASSTHROUGH_HEADERS = ("Content-Type", "Accept")
#: InvokeModel reports the tokens of a call in these headers.
_INPUT_TOKENS_HEADER = "X-Amzn-Bedrock-Input-Token-Count"


class BedrockProvider(Provider):
    """Speaks Converse (and InvokeModel for embeddings) to one region's ``bedrock-runtime``."""

    system = "aws.bedrock"
    serves_embeddings = True

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        super().__init__(config, request_timeout=request_timeout)
        self._session = session
        self._botocore = BotocoreSession(profile=config.option("profile"))
        self._source: Any = None
        self._credentials: RefreshedInThread[Any] = RefreshedInThread(self._frozen, self._refresh_due)
        #: Region → the view serving it; shared by every view, so each region has one.
        self._regions: dict[str, BedrockProvider] = {}
        region = config.option("region") or os.environ.get("AWS_REGION") or os.environ.get(
            "AWS_DEFAULT_REGION") or "us-east-1"
        self._in_region(region)

    def _in_region(self, region: str) -> None:
        self.region = region
        template = self.config.base_url or "https://bedrock-runtime.{region}.amazonaws.com"
        self._base = template.replace("{region}", region)
        self._address = urlsplit(self._base).hostname
        self._regions[region] = self

    def for_deployment(self, deployment: Deployment) -> Provider:
        region = deployment.region
        if region is None or region == self.region:
            return self
        view = self._regions.get(region)
        if view is None:
            view = copy.copy(self)  # shares the session, the whole answers' client, the credentials and the views
            view._in_region(region)
        return view

    @property
    def address(self) -> str | None:
        return self._address

    @property
    def passthrough_base(self) -> str:
        return self._base

    def url(self, model: str, operation: str) -> str:
        return f"{self._base}/model/{quote(model, safe='')}/{operation}"

    # ----------------------------------------------------------------------- credentials
    def _frozen(self, _previous: Any) -> Any:
        """Run in a thread: resolve the chain once, then freeze (refreshing when due)."""
        if self._source is None:
            self._source = self._botocore.get_credentials()
        if self._source is None:
            raise LookupError("no AWS credentials found (environment, profile files, web identity or instance role)")
        return self._source.get_frozen_credentials()

    def _refresh_due(self, _frozen: Any) -> bool:
        refresh_needed = getattr(self._source, "refresh_needed", None)
        return refresh_needed is not None and bool(refresh_needed())

    async def _signed_headers(self, method: str, url: str, body: bytes, headers: Mapping[str, str]) -> dict[str, str]:
        """``headers`` plus SigV4's (``X-Amz-Date``, ``Authorization``, the session token)."""
        try:
            credentials = await self._credentials.current()
        except LookupError as exc:
            raise UpstreamProtocolError(str(exc)) from None
        except (BotoCoreError, ClientError, OSError) as exc:
            # STS, the container endpoint or IMDS refused or failed: named, never a secret.
            raise UpstreamProtocolError(f"no AWS credentials: {type(exc).__name__}: {exc}") from None
        request = AWSRequest(method=method, url=url, data=body, headers=dict(headers))
        SigV4Auth(credentials, SIGNING_SERVICE, self.region).add_auth(request)
        return dict(request.headers.items())

    # ----------------------------------------------------------------------- calls
    async def _post_stream(self, url: str, payload: bytes, *, headers: Mapping[str, str],
                           timeouts: Timeouts | None) -> aiohttp.ClientResponse:
        signed = await self._signed_headers("POST", url, payload, {
            "Content-Type": "application/json", "Accept": _EVENT_STREAM})
        with map_transport_errors():
            return await self._session.post(
                # encoded=True: send the path exactly as signed (yarl would decode %3A to ':').
                yarl.URL(url, encoded=True), data=payload, headers={**headers, **signed},
                timeout=stream_timeout(timeouts or self.timeouts),
            )

    async def _post_whole(self, url: str, payload: bytes, *, headers: Mapping[str, str],
                          timeouts: Timeouts | None) -> WholeAnswer:
        signed = await self._signed_headers("POST", url, payload, {
            "Content-Type": "application/json", "Accept": "application/json"})
        # encoded=True: the path goes out exactly as signed (yarl would decode %3A to ':').
        return await self.post_whole(yarl.URL(url, encoded=True), payload, {**headers, **signed}, timeouts)

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
        if stream:
            resp = await self._post_stream(url, payload, headers=headers, timeouts=timeouts)
            response_id = f"bedrock-{resp.headers.get('x-amzn-RequestId', '')}"
            if resp.status < 300:
                if not resp.headers.get("Content-Type", "").startswith(_EVENT_STREAM):
                    resp.close()
                    raise UpstreamProtocolError("bedrock answered a stream request without an event stream")
                translator = wire.StreamTranslator(model=model, include_usage=wants_usage(body),
                                                   response_id=response_id)
                return UpstreamReply(status=resp.status, headers=_JSON_HEADERS,
                                     events=_translated_events(resp, translator), _release=resp.release)
            whole = await whole_answer_of(resp, self.config.max_response_bytes)
        else:
            whole = await self._post_whole(url, payload, headers=headers, timeouts=timeouts)
            response_id = f"bedrock-{whole.headers.get('x-amzn-RequestId', '')}"
        if whole.status >= 300:
            return _error_reply(whole)
        completion = _translated(lambda a: wire.to_chat_completion(a, model=model, response_id=response_id),
                                 json_object(whole.body, "bedrock"))
        return UpstreamReply(status=200, headers=_JSON_HEADERS, body=orjson.dumps(completion))

    async def embeddings(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        model = str(body.get("model") or "")
        family = wire.embedding_family(model)
        url = self.url(model, "invoke")
        if family == "titan":
            # Titan embeds one text a call: the inputs go out together, answered in order.
            calls = [self._invoke(url, request, headers, timeouts) for request in wire.titan_embedding_requests(body)]
            replies = []
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
                replies.append(result)
            for reply in replies:
                if reply.status >= 300:
                    return _error_reply(reply)
            answers = [json_object(reply.body, "bedrock") for reply in replies]
            answer = _translated(lambda a: wire.from_titan_embeddings(a, body=body, model=model), answers)
        elif family == "cohere":
            request = wire.cohere_embedding_request(body)
            whole = await self._invoke(url, request, headers, timeouts)
            if whole.status >= 300:
                return _error_reply(whole)
            reported = whole.headers.get(_INPUT_TOKENS_HEADER, "")
            tokens = int(reported) if reported.isdigit() else sum(count_tokens(t) for t in request["texts"])
            answer = _translated(lambda a: wire.from_cohere_embeddings(a, body=body, model=model, prompt_tokens=tokens),
                                 json_object(whole.body, "bedrock"))
        else:
            raise wire.not_an_embedding_model(model)
        return UpstreamReply(status=200, headers=_JSON_HEADERS, body=orjson.dumps(answer))

    async def _invoke(self, url: str, request: dict[str, Any], headers: Mapping[str, str],
                      timeouts: Timeouts | None) -> WholeAnswer:
        return await self._post_whole(url, orjson.dumps(request), headers=headers, timeouts=timeouts)

    # ----------------------------------------------------------------------- pass-through
    async def passthrough_request(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[str | yarl.URL, dict[str, str]]:
        # Encoded as botocore encodes a model id in a path (':' too), then signed as sent.
        url = f"{self._base}/{quote(path, safe='/')}"
        if query:
            url = f"{url}?{urlencode(parse_qsl(query, keep_blank_values=True), quote_via=quote)}"
        signed = {name: headers[name] for name in _SIGNED_PASSTHROUGH_HEADERS if name in headers}
        return yarl.URL(url, encoded=True), await self._signed_headers(method, url, body, signed)

    def passthrough_model(self, path: str) -> str | None:
        kind, _, rest = path.partition("/")
        model = rest.partition("/")[0]
        return model if kind == "model" and model else None

    def passthrough_payloads(self, content_type: str) -> Callable[[bytes], list[bytes]] | None:
        if not content_type.startswith(_EVENT_STREAM):
            return None
        return _EventStreamPayloads()


class _EventStreamPayloads:
    """The JSON payloads of an event stream relayed by pass-through (for its usage): a
    ConverseStream event as it is, an InvokeModelWithResponseStream ``chunk`` decoded
    from its base64 ``bytes``. A broken frame ends the reading (the client sees it as is)."""

    __slots__ = ("_broken", "_frames")

    def __init__(self) -> None:
        self._frames = EventStreamBuffer()
        self._broken = False

    def __call__(self, chunk: bytes) -> list[bytes]:
        if self._broken:
            return []
        self._frames.add_data(chunk)
        payloads = []
        try:
            for message in self._frames:
                payload = message.payload
                if payload.startswith(b'{"bytes"'):
                    try:
                        payload = base64.b64decode(orjson.loads(payload)["bytes"])
                    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                        continue
                payloads.append(payload)
        except ParserError:
            self._broken = True
        return payloads


def _translated(translate: Callable[[Any], Any], answer: Any) -> Any:
    """``translate(answer)``, a broken answer being the provider's failure (502 after retries)."""
    try:
        return translate(answer)
    except UpstreamAnswerError as exc:
        raise UpstreamProtocolError(f"bedrock answered a broken body: {exc}") from None


def _error_reply(answer: WholeAnswer) -> UpstreamReply:
    """Bedrock's error answer in the OpenAI shape, its status and ``retry-after`` kept."""
    headers = dict(_JSON_HEADERS)
    if "retry-after" in answer.headers:
        headers["retry-after"] = answer.headers["retry-after"]
    return UpstreamReply(status=answer.status, headers=headers,
                         body=wire.to_openai_error(answer.status, answer.body, answer.headers.get("x-amzn-ErrorType")))


async def _translated_events(resp: aiohttp.ClientResponse, translator: wire.StreamTranslator) -> AsyncIterator[bytes]:
    """ConverseStream's binary frames, CRC-checked by botocore, as OpenAI chunk events."""
    frames = EventStreamBuffer()
    with map_transport_errors():
        async for chunk in stream_chunks(resp):
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
