"""The contract's error shapes, rendered in one place for both planes.

A :class:`~gateway.core.errors.GatewayError` raised anywhere below the edge becomes an
HTTP answer here: a JSON error before the first byte of an answer, or one SSE error
event once a stream has started (after it, a status can no longer change).
"""

from __future__ import annotations

import math

import orjson
from aiohttp import web

from gateway.core.errors import GatewayError

__all__ = ["error_body", "error_event", "error_response"]


def error_body(message: str, type_: str, code: str | None) -> bytes:
    """The contract's error JSON, encoded."""
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code}})


def error_response(error: GatewayError) -> web.Response:
    """``error`` as its contract answer; ``Retry-After`` is whole seconds and never 0."""
    headers = dict(error.headers)
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    return web.Response(
        status=error.status,
        body=error_body(error.message, error.type, error.error_code),
        content_type="application/json",
        headers=headers,
    )


def error_event(error: GatewayError) -> bytes:
    """``error`` as the one SSE error event sent after a stream has started."""
    return b"data: " + error_body(error.message, error.type, error.error_code) + b"\n\n"
