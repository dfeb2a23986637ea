"""Gemini on Google Cloud Vertex AI: the Gemini wire at project / location URLs, with
OAuth2 access tokens from google-auth.

Needs the ``vertex`` extra (google-auth). Calls go to
``{base_url}/v1/projects/{project}/locations/{location}/publishers/google/models/{model}:generateContent``
(and ``:streamGenerateContent?alt=sse``); the translation both ways is the Gemini API's
(gateway/protocols/gemini.py), shared with gateway/providers/gemini.py. ``base_url``
defaults to ``https://{location}-aiplatform.googleapis.com`` (``https://aiplatform.googleapis.com``
for the ``global`` location).

Credentials: a service-account key file (``credentials_file``), else google-auth's
Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's user
credentials, the metadata server of GCE / GKE / Cloud Run), scope ``cloud-platform``.
The access token is fetched on the first call and again when google-auth no longer
considers it valid (it refreshes a few minutes before expiry), in a worker thread (the
refresh is blocking I/O), one refresh at a time. Tokens are never logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import aiohttp
import google.auth
import google.auth.exceptions
from google.auth.transport.requests import Request as GoogleAuthRequest
from google.oauth2 import service_account

from gateway.core.config import ProviderConfig
from gateway.providers.base import UpstreamProtocolError
from gateway.providers.gemini import GeminiProvider

__all__ = ["CLOUD_PLATFORM_SCOPE", "GoogleAccessToken", "VertexProvider"]

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


class GoogleAccessToken:
    """A google-auth credential's access token, refreshed (in a thread) when no longer valid."""

    def __init__(self, credentials_file: str | None) -> None:
        self._file = credentials_file
        self._credentials: Any = None
        self._lock = asyncio.Lock()

    def _load(self) -> Any:
        if self._file is not None:
            return service_account.Credentials.from_service_account_file(self._file, scopes=[CLOUD_PLATFORM_SCOPE])
        credentials, _project = google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
        return credentials

    def _refresh(self) -> None:
        if self._credentials is None:
            self._credentials = self._load()
        self._credentials.refresh(GoogleAuthRequest())

    async def current(self) -> str:
        """A valid access token; UpstreamProtocolError when none can be had."""
        credentials = self._credentials
        if credentials is not None and credentials.valid and credentials.token:
            return str(credentials.token)
        async with self._lock:
            credentials = self._credentials
            if credentials is None or not credentials.valid or not credentials.token:
                try:
                    await asyncio.to_thread(self._refresh)
                except (google.auth.exceptions.GoogleAuthError, OSError, ValueError) as exc:
                    # The message names the failure, never a token or a key.
                    raise UpstreamProtocolError(f"no Google access token: {type(exc).__name__}: {exc}") from None
        return str(self._credentials.token)


class VertexProvider(GeminiProvider):
    """Speaks the Gemini wire to Vertex AI for one project and location."""

    system = "gcp.vertex_ai"
    #: Vertex embeds through ``:predict`` with another shape; not mapped.
    serves_embeddings = False

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
        self._publisher_url = (
            f"{config.base_url}/v1/projects/{quote(self.project, safe='')}/locations/"
            f"{quote(self.location, safe='')}/publishers/google/models"
        )

    @property
    def passthrough_base(self) -> str:
        return self.config.base_url

    def url(self, model: str, method: str) -> str:
        return f"{self._publisher_url}/{quote(model.removeprefix('models/'), safe='')}:{method}"

    async def auth_headers(self) -> Mapping[str, str]:
        return {**self._headers, "Authorization": f"Bearer {await self._token.current()}"}

    async def credential_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {await self._token.current()}"}

