"""The console's Requests pages: the request logs (``request_logs:``), read as the admin
API reads them (:class:`gateway.billing.request_log.RequestLogStore`).

* ``GET /ui/requests?key=&model=&after=`` — stored calls newest first, 50 a page.
* ``GET /ui/requests/{request_id}`` — one call; its bodies for an ``admin`` session only
  (a ``viewer`` sees the call, not what was said: the rule of ``GET /admin/requests/{id}``).
"""

from __future__ import annotations

import re
import uuid
from typing import Any
from urllib.parse import quote, urlencode

import orjson
from aiohttp import web

from gateway.admin.console.auth import console_page
from gateway.admin.console.layout import esc, page, table
from gateway.admin.session import Session
from gateway.billing.request_log import RequestLogStore
from gateway.http.state import STATE

__all__ = ["request_routes"]

_PREFIX = re.compile(r"[A-Za-z0-9_-]{12}")
_PAGE = 50


def _pretty(body: str | None, truncated: bool) -> str:
    """A stored body for reading: JSON indented when it parses (a cut one does not)."""
    if body is None:
        return "<p>None stored.</p>"
    text = body
    try:
        text = orjson.dumps(orjson.loads(body), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        pass
    note = '<p class="hint">Cut at the size cap (request_logs.max_body_bytes).</p>' if truncated else ""
    return f"{note}<pre><code>{esc(text)}</code></pre>"


@console_page
async def requests_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/requests?key=&model=&after=``: stored calls, newest first."""
    query = request.query
    key, model = query.get("key", "").strip(), query.get("model", "").strip()[:256]
    message = ""
    api_key_id: uuid.UUID | None = None
    key_prefix: str | None = None
    after: uuid.UUID | None = None
    try:
        if key:
            try:
                api_key_id = uuid.UUID(key)
            except ValueError:
                if not _PREFIX.fullmatch(key):
                    raise
                key_prefix = key
        after = uuid.UUID(query["after"]) if query.get("after") else None
    except ValueError:
        message, api_key_id, key_prefix, after = "key must be a key id or 12-character prefix", None, None, None
    rows: list[dict[str, Any]] = await RequestLogStore(request.app[STATE].pool).page(
        limit=_PAGE + 1, api_key_id=api_key_id, key_prefix=key_prefix, model=model or None, after=after,
    )
    shown = rows[:_PAGE]
    form = (
        '<form method="get" action="/ui/requests" class="filters">'
        f'<label for="key">Key</label><input id="key" name="key" value="{esc(key)}" placeholder="id or prefix">'
        f'<label for="model">Model</label><input id="model" name="model" value="{esc(model)}">'
        '<button type="submit">Filter</button></form>'
    )
    cells = [
        (esc(r["created_at"][:19].replace("T", " ")),
         f'<a href="/ui/requests/{esc(quote(r["request_id"], safe=""))}"><code>{esc(r["request_id"])}</code></a>',
         f'<code>{esc(r["key_prefix"] or "—")}</code>', esc(r["requested_model"]), esc(r["status"]),
         esc(r["outcome"]), esc(r["guardrails"] or "—"),
         f'{r["request_bytes"]:,}{" (cut)" if r["request_truncated"] else ""}',
         f'{r["response_bytes"]:,}{" (cut)" if r["response_truncated"] else ""}')
        for r in shown
    ]
    more = ""
    if len(rows) > _PAGE:
        params = {"after": shown[-1]["call_id"], **{k: v for k, v in (("key", key), ("model", model)) if v}}
        more = f'<p><a href="/ui/requests?{esc(urlencode(params))}">Older calls</a></p>'
    intro = ('<p class="hint">Calls stored by request_logs: (off unless groups or keys are named), '
             "after every guardrail redaction, kept for their retention.</p>")
    body = (intro + (f'<p class="error" role="alert">{esc(message)}</p>' if message else "") + form
            + table(("When (UTC)", "Request id", "Key", "Model", "Status", "Outcome", "Guardrails",
                     "Request bytes", "Response bytes"), cells, numeric_from=7, id_="requests",
                    empty="No stored calls.") + more)
    return page("Requests", body, session, active="/ui/requests")


@console_page
async def request_page(request: web.Request, session: Session) -> web.StreamResponse:
    """``GET /ui/requests/{request_id}``: one stored call; its bodies for an admin only."""
    ref = request.match_info["request_id"]
    row = await RequestLogStore(request.app[STATE].pool).get(ref) if len(ref) <= 128 else None
    if row is None:
        resp = page("Request not found", "<p>No stored call with that id (or its retention has passed).</p>", session,
                    active="/ui/requests")
        resp.set_status(404)
        return resp
    facts = "".join(
        f"<dt>{esc(label)}</dt><dd>{esc(row[name] if row[name] is not None else '—')}</dd>"
        for name, label in (
            ("request_id", "Request id"), ("call_id", "Call id"), ("created_at", "When"), ("key_prefix", "Key"),
            ("requested_model", "Model asked"), ("model_group", "Model group"), ("served_model", "Served by"),
            ("protocol", "Protocol"), ("streamed", "Streamed"), ("status", "Status"), ("outcome", "Outcome"),
            ("guardrails", "Guardrails"), ("expires_at", "Deleted after"),
        )
    )
    body = f'<section class="card"><dl>{facts}</dl></section>'
    if session.role == "admin":
        kind = "the stream's text" if row["response_kind"] == "text" else "the answer as the client got it"
        body += (f'<section class="card"><h2>Request (as sent upstream)</h2>'
                 f'{_pretty(row["request_body"], row["request_truncated"])}</section>'
                 f'<section class="card"><h2>Response ({kind})</h2>'
                 f'{_pretty(row["response_body"], row["response_truncated"])}</section>')
    else:
        body += '<p class="hint" id="bodies-hidden">The request and response bodies need an admin session.</p>'
    return page(f"Request {ref[:64]}", body, session, active="/ui/requests")


def request_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/ui/requests", requests_page)
    router.add_get("/ui/requests/{request_id}", request_page)
