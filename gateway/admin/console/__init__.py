"""The admin console: server-rendered pages at ``/ui/`` on the management plane.

Server-rendered pages with a small script were chosen over a single-page app: nothing
to build (no Node toolchain at install or start), every asset ships in this package
(``static/``, listed in ``package_data``), each page is a plain URL that works with
the keyboard and the back button, and the figures are computed by the same Python
functions the admin API answers with. The script only sends changes to the admin API
(with the session's CSRF token) and keeps the providers table live.

* :mod:`.auth` — sign-in with the admin token or OIDC (:mod:`.oidc`), sign-out.
* :mod:`.dashboards` — Overview, Usage (+ CSV), Providers, Cache, Audit.
* :mod:`.keys` — Keys (search, create, edit, revoke, rotate) and Subjects/budgets.
* :mod:`.requests` — Requests: the request logs, bodies for an admin only.
* :mod:`.layout` — the HTML frame, tables, charts; the static assets and the CSP.
"""

from __future__ import annotations

from aiohttp import web

from gateway.admin.console.auth import CONSOLE, Console, sign_in_routes
from gateway.admin.console.dashboards import dashboard_routes
from gateway.admin.console.keys import key_routes
from gateway.admin.console.layout import static_handler
from gateway.admin.console.oidc import OidcClient
from gateway.admin.console.requests import request_routes
from gateway.admin.routes import AdminAuth
from gateway.http.state import STATE

__all__ = ["add_console"]


async def _to_console(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/ui/")


def add_console(app: web.Application, auth: AdminAuth) -> None:
    """Serve the console on this (management) app; ``app[STATE]`` must be set."""
    state = app[STATE]
    settings = state.config.admin
    oidc = OidcClient(settings.oidc, state.session) if settings.oidc is not None else None
    app[CONSOLE] = Console(auth=auth, settings=settings, oidc=oidc)
    app.router.add_get("/ui", _to_console)
    app.router.add_get("/ui/static/{name}", static_handler)
    sign_in_routes(app.router)
    dashboard_routes(app.router)
    key_routes(app.router)
    request_routes(app.router)
