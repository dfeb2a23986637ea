"""The contract's error shapes, rendered in one place for both planes.

A :class:`~gateway.core.errors.GatewayError` raised anywhere below the edge becomes an
HTTP answer here: a JSON error before the first byte of an answer, or one SSE error
event once a stream has started (after it, a status can no longer change).

Two shapes: the contract's (OpenAI's) ``{"error": {"message", "type", "code"}}`` and,
on the Anthropic Messages routes (:func:`error_shape_for`), Anthropic's ``{"type":
"error", "error": {"type", "message"}}``, whose type follows the status as Anthropic
documents it and whose 503 is Anthropic's 529 ``overloaded_error``, so Anthropic's SDKs
raise their own exception classes (and retry where they would).
"""

from __future__ import annotations

import math
from typing import Literal

import orjson
from aiohttp import web

from gateway.core.errors import GatewayError
from gateway.protocols.anthropic import anthropic_error_body, anthropic_error_type, anthropic_status

__all__ = [
    "ErrorShape",
    "anthropic_error_event",
    "anthropic_status",
    "error_body",
    "error_body_in",
    "error_event",
    "error_response",
    "error_shape_for",
]

ErrorShape = Literal["openai", "anthropic"]

#: The Anthropic Messages routes (and everything under them, e.g. ``count_tokens``).
_ANTHROPIC_PREFIX = "/v1/messages"


def error_shape_for(path: str) -> ErrorShape:
    """The error shape of the route at ``path``."""
    if path.startswith(_ANTHROPIC_PREFIX) and (len(path) == len(_ANTHROPIC_PREFIX) or path[12] == "/"):
        return "anthropic"
    return "openai"


def error_body(message: str, type_: str, code: str | None) -> bytes:
    """The contract's error JSON, encoded."""
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code}})


def error_body_in(shape: ErrorShape, status: int, message: str, type_: str, code: str | None) -> bytes:
    """An error JSON in ``shape`` (for answers that are not a GatewayError: 404, 405, 500)."""
    if shape == "anthropic":
        return anthropic_error_body(message, anthropic_error_type(anthropic_status(status)))
    return error_body(message, type_, code)


def error_response(error: GatewayError, shape: ErrorShape = "openai") -> web.Response:
    """``error`` as its answer in ``shape``; ``Retry-After`` is whole seconds and never 0."""
    headers = dict(error.headers)
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    status = anthropic_status(error.status) if shape == "anthropic" else error.status
    return web.Response(
        status=status,
        body=error_body_in(shape, error.status, error.message, error.type, error.error_code),
        content_type="application/json",
        headers=headers,
    )


def error_event(error: GatewayError) -> bytes:
    """``error`` as the one SSE error event sent after a stream has started."""
    return b"data: " + error_body(error.message, error.type, error.error_code) + b"\n\n"


def anthropic_error_event(error: GatewayError) -> bytes:
    """``error`` as a Messages stream's ``event: error``, after the stream has started."""
    body = anthropic_error_body(error.message, anthropic_error_type(anthropic_status(error.status)))
    return b"event: error\ndata: " + body + b"\n\n"
