"""HTML of the console: the page frame, tables, bar charts, and the static assets.

Pages are rendered on the server from the same functions the admin API answers with;
the little script there is (``static/console.js``) only sends changes to the admin API
and refreshes the providers table. Everything is escaped here (:func:`esc`); nothing
inline runs or styles, so the pages work under a CSP of ``'self'`` only (bar widths
are SVG attributes, not ``style``).
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from gateway.admin.session import Session

__all__ = [
    "CONSOLE_CSP",
    "STATIC",
    "bar_chart",
    "detail_json",
    "esc",
    "html_response",
    "money",
    "page",
    "static_handler",
    "table",
]

#: The console's CSP: scripts, styles, images and fetches from this origin only, no
#: frames, no plugins, forms post only here. The rest of the plane keeps
#: ``default-src 'none'`` (it serves JSON, never a page).
CONSOLE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)

#: Navigation: (path, label).
NAV = (
    ("/ui/", "Overview"),
    ("/ui/keys", "Keys"),
    ("/ui/subjects", "Subjects"),
    ("/ui/usage", "Usage"),
    ("/ui/providers", "Providers"),
    ("/ui/cache", "Cache"),
    ("/ui/audit", "Audit"),
    ("/ui/requests", "Requests"),
)

_TYPES = {".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}


def _load_static() -> dict[str, tuple[bytes, str, str]]:
    """name → (bytes, content type, short content hash), read once from the package."""
    found: dict[str, tuple[bytes, str, str]] = {}
    for entry in resources.files("gateway.admin.console").joinpath("static").iterdir():
        suffix = entry.name[entry.name.rfind("."):]
        if suffix in _TYPES:
            body = entry.read_bytes()
            found[entry.name] = (body, _TYPES[suffix], hashlib.sha256(body).hexdigest()[:12])
    return found


STATIC = _load_static()


def asset(name: str) -> str:
    """The URL of a static asset, its content hash in the query so it may be cached for good."""
    return f"/ui/static/{name}?v={STATIC[name][2]}"


async def static_handler(request: web.Request) -> web.Response:
    found = STATIC.get(request.match_info["name"])
    if found is None:
        raise web.HTTPNotFound()
    body, content_type, _ = found
    # The URL changes with the content (asset()), so a browser may keep it for a year.
    return web.Response(body=body, content_type=content_type, headers={
        "Cache-Control": "public, max-age=31536000, immutable",
    })


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def detail_json(detail: Any) -> str:
    """An audit row's detail as the API shows it (JSON, keys sorted)."""
    return orjson.dumps(detail, option=orjson.OPT_SORT_KEYS, default=str).decode()


def money(value: float) -> str:
    """USD as the pages show it: small amounts to the micro-dollar (the CSV's precision)."""
    if value < 1:
        return f"${value:,.6f}"
    return f"${value:,.4f}" if value < 100 else f"${value:,.2f}"


def html_response(body: str, *, status: int = 200) -> web.Response:
    return web.Response(
        text=body, status=status, content_type="text/html", charset="utf-8",
        headers={"Content-Security-Policy": CONSOLE_CSP},
    )


def page(title: str, body: str, session: Session | None, *, active: str = "") -> web.Response:
    """A whole page: head with the assets, navigation and who is signed in, then ``body``."""
    nav = ""
    meta = ""
    if session is not None:
        links = "".join(
            f'<a href="{path}"{" aria-current=page" if path == active else ""}>{label}</a>' for path, label in NAV
        )
        nav = (
            f'<header><nav aria-label="Console">{links}</nav>'
            f'<div class="who"><span data-role="{esc(session.role)}">{esc(session.principal)} · {esc(session.role)}</span>'
            f'<form method="post" action="/ui/logout"><input type="hidden" name="csrf_token" value="{esc(session.csrf_token)}">'
            f'<button type="submit">Sign out</button></form></div></header>'
        )
        meta = (
            f'<meta name="csrf-token" content="{esc(session.csrf_token)}">'
            f'<meta name="console-role" content="{esc(session.role)}">'
        )
    return html_response(
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{meta}<title>{esc(title)} · LLM gateway</title>"
        f'<link rel="stylesheet" href="{asset("console.css")}">'
        f'<script src="{asset("console.js")}" defer></script></head>'
        f'<body><a class="skip" href="#main">Skip to content</a>{nav}<main id="main" tabindex="-1"><h1>{esc(title)}</h1>{body}</main></body></html>'
    )


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, numeric_from: int = 1, id_: str = "",
          empty: str = "Nothing yet.") -> str:
    """A table; cells are HTML already escaped by the caller. Columns from ``numeric_from`` align right."""
    head = "".join(
        f'<th scope="col"{" class=num" if i >= numeric_from else ""}>{esc(h)}</th>' for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>" + "".join(f'<td{" class=num" if i >= numeric_from else ""}>{c}</td>' for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    if not body:
        body = f'<tr><td colspan="{len(headers)}" class="empty">{esc(empty)}</td></tr>'
    ident = f' id="{esc(id_)}"' if id_ else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def bar_chart(points: Sequence[tuple[str, float]], *, label: str, unit: str = "") -> str:
    """Horizontal bars as inline SVG (widths are attributes: no inline style under the CSP)."""
    if not points:
        return ""
    top = max(v for _, v in points) or 1.0
    row_h, label_w, bar_w = 22, 220, 360
    parts = []
    for i, (name, value) in enumerate(points):
        y = i * row_h
        width = max(1.0, bar_w * value / top) if value else 0.0
        parts.append(
            f'<text x="0" y="{y + 15}" class="chart-label">{esc(name[:32])}</text>'
            f'<rect x="{label_w}" y="{y + 3}" width="{width:.1f}" height="{row_h - 6}" class="bar"></rect>'
            f'<text x="{label_w + width + 6:.1f}" y="{y + 15}" class="chart-value">{esc(unit)}{value:,.4g}</text>'
        )
    height = row_h * len(points)
    return (
        f'<svg class="chart" role="img" aria-label="{esc(label)}" viewBox="0 0 {label_w + bar_w + 120} {height}" '
        f'width="{label_w + bar_w + 120}" height="{height}">{"".join(parts)}</svg>'
    )
