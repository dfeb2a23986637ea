"""Gemini (and Claude) on Google Cloud Vertex AI: project / location URLs, OAuth2 access
tokens from google-auth.

Needs the ``vertex`` extra (google-auth). Calls go to
``{base_url}/v1/projects/{project}/locations/{location}/publishers/google/models/{model}:generateContent``
(and ``:streamGenerateContent?alt=sse``); the translation both ways is the Gemini API's
(gateway/protocols/gemini.py), shared with gateway/providers/gemini.py. ``base_url``
defaults to ``https://{location}-aiplatform.googleapis.com`` (``https://aiplatform.googleapis.com``
for the ``global`` location). Claude models (``claude-*``) go to the ``anthropic``
publisher's ``:rawPredict`` / ``:streamRawPredict`` with the Messages API mapping of
gateway/providers/anthropic.py, ``anthropic_version`` set as Vertex wants. Embeddings go
to the text embedding model's ``:predict`` (``instances[].content`` →
``predictions[].embeddings.values``, tokens from ``statistics.token_count``).

Credentials: a service-account key file (``credentials_file``), else google-auth's
Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's user
credentials, the metadata server of GCE / GKE / Cloud Run), scope ``cloud-platform``.
The access token is fetched on the first call and again when google-auth no longer
considers it valid (it refreshes a few minutes before expiry), in a worker thread (the
refresh is blocking I/O), one refresh at a time. Tokens are never logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import aiohttp
import google.auth
import google.auth.exceptions
import orjson
from google.auth.transport.requests import Request as GoogleAuthRequest
from google.oauth2 import service_account

from gateway.core.config import ProviderConfig
from gateway.protocols import gemini as gemini_wire
from gateway.protocols.chat import wants_usage
from gateway.providers import anthropic
from gateway.providers.base import (
    EventStream,
    Timeouts,
    UpstreamProtocolError,
    UpstreamReply,
    json_object,
    whole_answer_of,
)
from gateway.providers.credentials import RefreshedInThread
from gateway.providers.gemini import GeminiProvider, google_error_reply, translated

__all__ = ["CLOUD_PLATFORM_SCOPE", "VERTEX_ANTHROPIC_VERSION", "GoogleAccessToken", "VertexProvider",
           "is_anthropic_model"]

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
#: The ``anthropic_version`` Vertex AI wants in a Claude request body.
VERTEX_ANTHROPIC_VERSION = "vertex-2023-10-16"
_JSON_HEADERS = {"Content-Type": "application/json"}


def is_anthropic_model(model: str) -> bool:
    """Claude models are served by Vertex's ``anthropic`` publisher, the rest by ``google``."""
    return model.startswith("claude")


class GoogleAccessToken:
    """A google-auth credential's access token, refreshed (in a thread) when no longer valid."""

    def __init__(self, credentials_file: str | None) -> None:
        self._file = credentials_file
        self._credentials: RefreshedInThread[Any] = RefreshedInThread(self._refreshed, _expired)

    def _load(self) -> Any:
        if self._file is not None:
            return service_account.Credentials.from_service_account_file(self._file, scopes=[CLOUD_PLATFORM_SCOPE])
        credentials, _project = google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
        return credentials

    def _refreshed(self, credentials: Any) -> Any:
        credentials = credentials if credentials is not None else self._load()
        credentials.refresh(GoogleAuthRequest())
        return credentials

    async def current(self) -> str:
        """A valid access token; UpstreamProtocolError when none can be had."""
        try:
            credentials = await self._credentials.current()
        except (google.auth.exceptions.GoogleAuthError, OSError, ValueError) as exc:
            # The message names the failure, never a token or a key.
            raise UpstreamProtocolError(f"no Google access token: {type(exc).__name__}: {exc}") from None
        return str(credentials.token)


def _expired(credentials: Any) -> bool:
    return credentials is None or not credentials.valid or not credentials.token


class VertexProvider(GeminiProvider):
    """Speaks the Gemini wire to Vertex AI for one project and location."""

    system = "gcp.vertex_ai"

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        self.location = config.option("location", "us-central1") or "us-central1"
        self.project = config.option("project") or ""
        if not config.base_url:
            host = "aiplatform.googleapis.com" if self.location == "global" else \
                f"{self.location}-aiplatform.googleapis.com"
            config = replace(config, base_url=f"https://{host}")
        super().__init__(config, session, request_timeout=request_timeout)
        self._token = GoogleAccessToken(config.option("credentials_file"))
        self._location_url = (
            f"{config.base_url}/v1/projects/{quote(self.project, safe='')}/locations/{quote(self.location, safe='')}"
        )

    @property
    def passthrough_base(self) -> str:
        return self.config.base_url

    def url(self, model: str, method: str) -> str:
        name = model.removeprefix("models/")
        publisher = "anthropic" if is_anthropic_model(name) else "google"
        return f"{self._location_url}/publishers/{publisher}/models/{quote(name, safe='')}:{method}"

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        model = str(body.get("model") or "")
        if not is_anthropic_model(model):
            return await super().chat(body, stream=stream, headers=headers, timeouts=timeouts)
        # Claude on Vertex: the Messages API body (no model: it is in the URL) with
        # Vertex's anthropic_version, at :rawPredict / :streamRawPredict.
        payload = anthropic.to_messages_request(body, stream=stream)
        payload.pop("model", None)
        payload["anthropic_version"] = VERTEX_ANTHROPIC_VERSION
        url = self.url(model, "streamRawPredict" if stream else "rawPredict")
        if stream:
            resp = await self._post_stream(url, payload, headers=headers, timeouts=timeouts)
            if resp.status < 300 and resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                translator = anthropic.StreamTranslator(model=model, include_usage=wants_usage(body))
                return UpstreamReply(status=resp.status, headers=_JSON_HEADERS,
                                     events=_anthropic_events(resp, translator), _release=resp.release)
            whole = await whole_answer_of(resp, self.config.max_response_bytes)
        else:
            whole = await self._post_whole(url, payload, headers=headers, timeouts=timeouts)
        if whole.status >= 300:
            return google_error_reply(whole.status, whole.body, _error_body)
        message = json_object(whole.body, "vertex")
        if message.get("type") != "message":
            raise UpstreamProtocolError("vertex answered something other than an Anthropic message")
        if stream:
            raise UpstreamProtocolError("vertex answered a stream request without an event stream")
        return UpstreamReply(status=200, headers=_JSON_HEADERS, body=orjson.dumps(anthropic.to_chat_completion(message)))

    async def embeddings(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        """Text embedding models (``text-embedding-005``, ``gemini-embedding-001``, ...) at ``:predict``."""
        model = str(body.get("model") or "").removeprefix("models/")
        payload = gemini_wire.predict_embeddings_request(body)
        whole = await self._post_whole(self.url(model, "predict"), payload, headers=headers, timeouts=timeouts)
        if whole.status >= 300:
            return google_error_reply(whole.status, whole.body)
        answer = translated(lambda a: gemini_wire.from_predict_embeddings(a, body=body, model=model),
                            json_object(whole.body, "vertex"))
        return UpstreamReply(status=200, headers=_JSON_HEADERS, body=orjson.dumps(answer))

    async def auth_headers(self) -> Mapping[str, str]:
        return {**self._headers, "Authorization": f"Bearer {await self._token.current()}"}

    async def credential_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {await self._token.current()}"}


def _anthropic_events(resp: aiohttp.ClientResponse, translator: anthropic.StreamTranslator) -> EventStream:
    """Claude's events on Vertex (Anthropic's wire) as OpenAI chunk events."""
    return EventStream(resp, translator.feed)


def _error_body(status: int, raw: bytes) -> bytes:
    """Google's error shape (auth, quota) or Anthropic's (the model's own), as OpenAI's."""
    try:
        error = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict) and "status" in error:
        return gemini_wire.to_openai_error(status, raw)
    return anthropic.to_openai_error(status, raw)
