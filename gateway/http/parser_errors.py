"""Requests aiohttp's HTTP parser refuses get the contract's JSON error, not plain text.

A request whose head cannot be parsed (a bad request line, a header over the size
limit, a bad chunked body) never reaches the app or its middlewares: aiohttp answers it
from its connection handler with a ``text/plain`` "400 Bad Request". The contract says
every gateway error is ``{"error": {...}}`` with an ``x-request-id``, so the runners of
both planes use :class:`ContractAppRunner`, whose connections render those answers here.

aiohttp offers no public hook for this; ``RequestHandler.handle_error`` is the method
its parser path calls, and ``AppRunner._make_server`` is where the runner builds the
server whose connections use it (both unchanged since aiohttp 3.0).
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.http.errors import error_body
from gateway.http.middleware import REQUEST_ID, new_request_id

__all__ = ["ContractAppRunner", "parser_error_response"]

#: status → (message, type, code) of what aiohttp's connection handler answers itself.
_PARSER_ERRORS: dict[int, tuple[str, str, str]] = {
    400: ("malformed HTTP request", "invalid_request_error", "invalid_http_request"),
    413: ("request too large", "invalid_request_error", "request_too_large"),
    431: ("request headers too large", "invalid_request_error", "request_too_large"),
    500: ("internal error", "server_error", "internal_error"),
    504: ("the gateway timed out handling the request", "timeout_error", "gateway_timeout"),
}


def parser_error_response(status: int) -> web.Response:
    """The contract answer for a request refused before it reached the app."""
    known = _PARSER_ERRORS.get(status)
    if known is None:
        phrase = HTTPStatus(status).phrase.lower() if status in set(HTTPStatus) else "error"
        known = (phrase, "invalid_request_error", "invalid_http_request") if status < 500 else (
            phrase, "server_error", "internal_error")
    message, type_, code = known
    response = web.Response(
        status=status,
        body=error_body(message, type_, code),
        content_type="application/json",
        headers={REQUEST_ID: new_request_id(), "X-Content-Type-Options": "nosniff"},
    )
    response.force_close()  # aiohttp's own answer closes too: the stream is out of sync
    return response


class _ContractRequestHandler(RequestHandler):
    """A connection whose own error answers (parser errors, timeouts) are contract JSON."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's version logs the error and refuses when bytes were already sent;
        # keep both, and replace only the body it would send.
        super().handle_error(request, status, exc, message)
        return parser_error_response(status)


class _ContractServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _ContractRequestHandler(self, loop=self._loop, **self._kwargs)


class ContractAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser-refused requests as the contract says."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The app builds a plain Server (Application is final, its factory private):
        # give that one object our connection factory; nothing else about it changes.
        server.__class__ = _ContractServer
        return server
