"""Azure OpenAI: the OpenAI wire at Azure's URLs, with Azure's keys and Azure's errors.

URLs: with a dated ``api_version`` (e.g. ``2024-10-21``) every call goes to
``{base_url}/openai/deployments/{deployment}/chat/completions?api-version=...`` (and
``/embeddings``), the routed model being the deployment name. With ``api_version: v1``
(the default) calls go to ``{base_url}/openai/v1/chat/completions`` with the deployment
name as the body's ``model``, as Azure's v1 API wants.

Credentials: ``api_key`` is sent in Azure's ``api-key`` header; with ``tenant_id``,
``client_id`` and ``client_secret`` instead, a Microsoft Entra token is fetched by the
client-credentials grant (``token_url`` overrides Entra's endpoint) and sent as a bearer
token, refreshed before it expires (gateway/providers/oauth.py).

Errors: a prompt blocked by Azure's content filter (400, ``code: content_filter``)
becomes a 400 ``invalid_request_error`` / ``content_filter`` naming the filtered
categories. Throttling: Azure's ``retry-after-ms`` (more precise than ``retry-after``),
else ``retry-after``, else ``x-ratelimit-reset-requests`` / ``-tokens`` becomes the
reply's ``retry-after``, so a 429 cools the deployment exactly as long as Azure asks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from gateway.core.config import ProviderConfig
from gateway.providers.base import Timeouts, UpstreamReply
from gateway.providers.oauth import ENTRA_SCOPE, ClientCredentialsToken, entra_token_url
from gateway.providers.openai import OpenAIProvider

__all__ = ["DEFAULT_API_VERSION", "AzureProvider", "azure_retry_after", "to_openai_error"]

#: Azure's versionless (v1) API, the default when the config names no dated version.
DEFAULT_API_VERSION = "v1"


class AzureProvider(OpenAIProvider):
    """Speaks the OpenAI wire to one Azure OpenAI (or Foundry) resource."""

    system = "azure.ai.openai"
    key_header = ("api-key", "{}")

    def __init__(
        self, config: ProviderConfig, session: aiohttp.ClientSession, *, request_timeout: float
    ) -> None:
        super().__init__(config, session, request_timeout=request_timeout)
        root = config.base_url
        for suffix in ("/openai/v1", "/openai"):  # accept the resource URL with either path
            if root.endswith(suffix):
                root = root[: -len(suffix)]
        self._root = root
        self.api_version = config.option("api_version", DEFAULT_API_VERSION) or DEFAULT_API_VERSION
        self._token: ClientCredentialsToken | None = None
        tenant = config.option("tenant_id")
        if tenant is not None:
            self._token = ClientCredentialsToken(
                session,
                token_url=config.option("token_url") or entra_token_url(tenant),
                client_id=config.option("client_id") or "",
                client_secret=config.option("client_secret") or "",
                scope=ENTRA_SCOPE,
            )

    def url(self, operation: str, deployment: str) -> str:
        """Where ``operation`` (``chat/completions`` | ``embeddings``) of ``deployment`` goes."""
        if self.api_version == "v1":
            return f"{self._root}/openai/v1/{operation}"
        return (
            f"{self._root}/openai/deployments/{quote(deployment, safe='')}/{operation}"
            f"?api-version={quote(self.api_version, safe='')}"
        )

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        url = self.url("chat/completions", str(body.get("model") or ""))
        reply = await self._post(url, orjson.dumps(body), stream=stream, headers=await self._auth(headers),
                                 timeouts=timeouts)
        return _azure_reply(reply)

    async def embeddings(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        url = self.url("embeddings", str(body.get("model") or ""))
        reply = await self._post(url, orjson.dumps(body), stream=False, headers=await self._auth(headers),
                                 timeouts=timeouts)
        return _azure_reply(reply)

    async def list_models(self) -> list[str]:
        return []  # Azure lists deployments on its management plane only

    @property
    def passthrough_base(self) -> str:
        return self._root  # the resource: clients send /openai/... paths as Azure documents them

    async def credential_headers(self) -> dict[str, str]:
        if self._token is None:
            return await super().credential_headers()
        return {"Authorization": f"Bearer {await self._token.current()}"}

    async def _auth(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """``headers`` plus the Entra bearer token, when this resource uses Entra."""
        if self._token is None:
            return headers  # the api-key header is added by keyed_headers()
        return {**headers, "Authorization": f"Bearer {await self._token.current()}"}


def _azure_reply(reply: UpstreamReply) -> UpstreamReply:
    """Azure's error bodies and throttling headers in the gateway's terms; 2xx unchanged."""
    if reply.ok:
        return reply
    headers = {"Content-Type": "application/json"}
    wait = azure_retry_after(reply.headers)
    if wait is not None:
        headers["retry-after"] = str(wait)
    return UpstreamReply(status=reply.status, headers=headers, body=to_openai_error(reply.status, reply.body))


def azure_retry_after(headers: Mapping[str, str]) -> int | None:
    """Whole seconds Azure asks to wait, from its most precise header present; else None."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0),
                        ("x-ratelimit-reset-requests", 1.0), ("x-ratelimit-reset-tokens", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            seconds = float(raw.rstrip("s")) / scale
        except ValueError:
            continue
        if math.isfinite(seconds) and seconds >= 0:
            return math.ceil(seconds)
    return None


def _filtered_categories(error: Mapping[str, Any]) -> list[str]:
    inner = error.get("innererror")
    results = inner.get("content_filter_result") if isinstance(inner, dict) else None
    if not isinstance(results, dict):
        return []
    return sorted(name for name, verdict in results.items() if isinstance(verdict, dict) and verdict.get("filtered"))


def to_openai_error(status: int, raw: bytes) -> bytes:
    """An Azure error body in the OpenAI shape; a content-filter block says what tripped it."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        return orjson.dumps({"error": {"message": f"azure answered HTTP {status}", "type": "upstream_error",
                                       "code": None}})
    message = str(error.get("message") or f"azure answered HTTP {status}")
    code = error.get("code")
    if code == "content_filter":
        categories = _filtered_categories(error)
        what = f" ({', '.join(categories)})" if categories else ""
        return orjson.dumps({"error": {
            "message": f"Azure OpenAI's content filter blocked the {error.get('param') or 'prompt'}{what}: {message}",
            "type": "invalid_request_error",
            "param": error.get("param"),
            "code": "content_filter",
        }})
    if status == 401:
        return orjson.dumps({"error": {"message": message, "type": "authentication_error", "code": "invalid_api_key"}})
    if status == 429:
        return orjson.dumps({"error": {"message": message, "type": "rate_limit_error", "code": "rate_limit_exceeded"}})
    error_type = error.get("type") if isinstance(error.get("type"), str) else "upstream_error"
    return orjson.dumps({"error": {"message": message, "type": error_type,
                                   "code": code if isinstance(code, str) else None}})
