"""``/admin/requests`` on the management plane: the request logs (``request_logs:``).

* ``GET /admin/requests?key=&model=&since=&limit=&after=`` — stored calls, newest first,
  without their bodies (ids, key, model, status, outcome, guardrail decisions, body
  sizes and whether each was cut), paged with ``after`` (the previous page's
  ``last_id``, a call id).
* ``GET /admin/requests/{request_id}`` — one call with its bodies: by its request id
  (``x-request-id``; a client that reused one gets its newest call) or its call id.
  404 ``request_log_not_found`` when there is none, or it has outlived its retention.

Who may read: the list is what the usage report already shows, so any admin caller (a
``viewer`` session too) may read it. The bodies are the prompts and answers themselves,
so only the admin token or an ``admin`` session may read them: a viewer gets 403
``admin_role_required``. Both sit under ``/admin/``, behind
:func:`gateway.admin.routes.admin_guard`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

import orjson
from aiohttp import web
from pydantic import Field
from pydantic.dataclasses import dataclass as model_dataclass

from gateway.admin.input import parse_request_log_query
from gateway.admin.routes import ADMIN_ROLE, checked_query, list_page
from gateway.billing.request_log import RequestLogStore
from gateway.core.errors import GatewayError, NotFound
from gateway.http.state import STATE

__all__ = ["AdminRoleRequired", "RequestLogDetail", "RequestLogSummary", "add_routes"]

#: A request id longer than this was never stored (the ledger's bound too).
MAX_REQUEST_ID = 128


class AdminRoleRequired(GatewayError):
    """A viewer asked for what only an admin may read (a call's bodies)."""

    status = 403
    type = "permission_error"
    code = "admin_role_required"
    default_message = (
        "request and response bodies need the admin token or an admin session "
        "(a viewer may list calls, not read their bodies)"
    )


@model_dataclass(frozen=True, kw_only=True)
class RequestLogSummary:
    """One stored call as ``GET /admin/requests`` lists it (the OpenAPI document's shape)."""

    call_id: uuid.UUID = Field(description="the gateway's id of the call (the ledger's)")
    request_id: str = Field(description="x-request-id, as the client sent it or the gateway chose it")
    api_key_id: uuid.UUID | None
    key_prefix: str | None
    subject_id: uuid.UUID | None
    requested_model: str
    model_group: str | None
    served_model: str | None
    protocol: str = Field(description="chat | anthropic | completions | responses")
    streamed: bool
    status: int
    outcome: str
    guardrails: str | None = Field(description="policy:action of each guardrail that acted, comma-joined")
    request_bytes: int = Field(description="the request body's full size in bytes")
    request_truncated: bool = Field(description="the stored request body was cut to max_body_bytes")
    response_kind: Literal["body", "text"] | None = Field(
        description="body: the whole answer as the client got it; text: a stream's assembled text")
    response_bytes: int
    response_truncated: bool
    created_at: datetime
    expires_at: datetime = Field(description="when the retention ends and the row is deleted")


@model_dataclass(frozen=True, kw_only=True)
class RequestLogDetail(RequestLogSummary):
    """One stored call with its bodies (``GET /admin/requests/{request_id}``)."""

    request_body: str | None = Field(description="the request as sent upstream, after redaction (JSON text)")
    response_body: str | None = Field(description="the answer as the client got it, after redaction")


def _json(obj: object) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def list_requests(request: web.Request) -> web.Response:
    """``GET /admin/requests``: stored calls newest first, bodies left out."""
    q = parse_request_log_query(checked_query(request, "requests"))
    api_key_id: uuid.UUID | None = None
    key_prefix: str | None = None
    if q.key is not None:
        try:
            api_key_id = uuid.UUID(q.key)
        except ValueError:
            key_prefix = q.key
    rows = await RequestLogStore(request.app[STATE].pool).page(
        limit=q.limit + 1, api_key_id=api_key_id, key_prefix=key_prefix, model=q.model, since=q.since, after=q.after,
    )
    return _json(list_page(rows, q.limit, "call_id"))


async def get_request(request: web.Request) -> web.Response:
    """``GET /admin/requests/{request_id}``: one call with its bodies (admin role only)."""
    checked_query(request, "none")
    if request[ADMIN_ROLE] != "admin":
        raise AdminRoleRequired()
    ref = request.match_info["request_id"]
    row = None
    if len(ref) <= MAX_REQUEST_ID:
        row = await RequestLogStore(request.app[STATE].pool).get(ref)
    if row is None:
        raise NotFound(f"no stored call with request id {ref[:64]!r}", code="request_log_not_found")
    return _json(row)


def add_routes(app: web.Application) -> None:
    """Register ``/admin/requests`` on the management plane."""
    app.router.add_get("/admin/requests", list_requests)
    app.router.add_get("/admin/requests/{request_id}", get_request)
