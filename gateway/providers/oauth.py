"""OAuth2 access tokens a provider fetches for itself (Microsoft Entra client credentials).

A token is fetched on the first call, kept in memory, and fetched again once less than
:data:`REFRESH_MARGIN_SECONDS` of its lifetime is left, so no call goes out with a token
about to expire. Concurrent callers that find it stale share one fetch (one lock), so a
burst after expiry costs the token endpoint one request. A token is never logged: errors
name the endpoint's status and its ``error`` code only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import orjson

from gateway.providers.base import UpstreamProtocolError, map_transport_errors

__all__ = ["ENTRA_SCOPE", "REFRESH_MARGIN_SECONDS", "ClientCredentialsToken", "entra_token_url"]

#: The scope Azure OpenAI (Cognitive Services) accepts tokens for.
ENTRA_SCOPE = "https://cognitiveservices.azure.com/.default"
#: Fetch a new token when the current one has less than this left.
REFRESH_MARGIN_SECONDS = 300.0
_TOKEN_TIMEOUT = aiohttp.ClientTimeout(total=15.0)


def entra_token_url(tenant_id: str) -> str:
    """Microsoft Entra's v2.0 token endpoint for ``tenant_id``."""
    return f"https://login.microsoftonline.com/{tenant_id}/oauth2/v2.0/token"


class ClientCredentialsToken:
    """A bearer token from an OAuth2 client-credentials grant, refreshed before expiry."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        token_url: str,
        client_id: str,
        client_secret: str,
        scope: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._url = token_url
        self._form = {
            "grant_type": "client_credentials",
            "client_id": client_id,
            "client_secret": client_secret,
            "scope": scope,
        }
        self._clock = clock
        self._token: str | None = None
        self._refresh_at = 0.0
        self._lock = asyncio.Lock()

    async def current(self) -> str:
        """A token valid for at least the refresh margin; fetched when needed.

        Raises UpstreamProtocolError (or another ProviderError) when the endpoint refuses.
        """
        if self._token is not None and self._clock() < self._refresh_at:
            return self._token
        async with self._lock:
            if self._token is None or self._clock() >= self._refresh_at:
                await self._fetch()
        assert self._token is not None
        return self._token

    async def _fetch(self) -> None:
        with map_transport_errors():
            async with self._session.post(self._url, data=self._form, timeout=_TOKEN_TIMEOUT) as resp:
                raw = await resp.read()
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise UpstreamProtocolError(f"token endpoint answered HTTP {resp.status} without JSON")
        if resp.status != 200 or not isinstance(answer.get("access_token"), str):
            raise UpstreamProtocolError(
                f"token endpoint refused the client credentials: HTTP {resp.status} {answer.get('error', '')}".rstrip()
            )
        try:  # Entra sends a number; some endpoints send it as a string
            lifetime = max(1.0, float(answer.get("expires_in", 3600)))
        except (TypeError, ValueError):
            lifetime = 3600.0
        self._token = answer["access_token"]
        # A token shorter-lived than twice the margin is refreshed at half its life.
        self._refresh_at = self._clock() + max(lifetime - REFRESH_MARGIN_SECONDS, lifetime / 2)
