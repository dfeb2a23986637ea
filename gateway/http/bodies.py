"""Reading a request: the caller's key and its JSON body, bounded in size and time.

Shared by every route of both planes, so a key is found the same way everywhere and a
body over the limit, malformed or too slow gets the same contract error.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from gateway.core.errors import InvalidRequest, RequestTimeout, RequestTooLarge
from gateway.http.state import STATE

__all__ = ["bearer_token", "read_body", "read_json_body"]


def bearer_token(request: web.Request) -> str | None:
    """The key from ``Authorization: Bearer KEY`` or ``x-api-key: KEY``."""
    auth = request.headers.get("Authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return request.headers.get("x-api-key")


async def read_json_body(request: web.Request, limit: int) -> dict[str, Any]:
    """The request's JSON object; 413 over ``limit`` bytes, 400 if not a JSON object,
    408 if it does not arrive within ``CLIENT_IDLE_TIMEOUT_SECONDS`` (a slow-body client
    must not hold a request slot for ever)."""
    raw = await read_body(request, limit)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return body


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's raw body; 413 over ``limit`` bytes, 408 if it arrives too slowly."""
    declared = request.content_length  # a property that parses the header each time
    if declared is not None and declared > limit:
        raise RequestTooLarge(f"request body over {limit} bytes")
    # Whole body: content.read(n) returns what has arrived so far, not n bytes. aiohttp's
    # own cap (client_max_size, just above the limit) answers 413 for a chunked giant.
    content = request.content
    if content.is_eof():
        # Already all here (the usual small body, in the packet of its headers): reading it
        # cannot wait, so it needs no timer (arming and cancelling one per request), nor
        # request.read()'s loop of reads (about 100 instructions): it is taken as it is, as a
        # provider's whole answer is (read_whole). Over aiohttp's cap, request.read()'s own
        # refusal (the error layer answers its 413 as this, without a message).
        raw = content.read_nowait(-1)
        if len(raw) > request.client_max_size:
            raise RequestTooLarge()
    else:
        try:
            async with asyncio.timeout(request.app[STATE].settings.client_idle_timeout):
                raw = await request.read()
        except TimeoutError:
            raise RequestTimeout() from None
    if len(raw) > limit:
        raise RequestTooLarge(f"request body over {limit} bytes")
    return raw
