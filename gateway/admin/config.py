"""``/admin/config`` on the management plane: the active config, and reloading it.

* ``GET /admin/config`` — the active config's ``source`` (the file, or ``default``),
  ``hash`` (``sha256:`` of the file, as ``sha256sum`` prints it), ``loaded_at`` and
  ``generation``, the last reload's outcome, and the config itself with every secret
  masked (provider keys, header values, credentials in URLs).
* ``POST /admin/config/reload`` — re-read ``GATEWAY_CONFIG`` now (as SIGHUP does):
  200 with the outcome when applied; 422 ``invalid_config`` with the path-named error
  when the file was refused (nothing changed). Under ``serve --workers`` the answer
  carries each worker's outcome too: 422 if a worker refused the file, 503
  ``reload_incomplete`` if one did not answer (it reads the file when it restarts).

Both sit under ``/admin/``, behind :func:`gateway.admin.routes.admin_guard`.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic import TypeAdapter
from yarl import URL

from gateway.core.config import GatewayConfig
from gateway.core.errors import GatewayError, InvalidRequest
from gateway.http.state import STATE, GatewayState

__all__ = ["MASK", "add_routes", "masked_config"]

#: What a secret is shown as.
MASK = "***"

_DUMP = TypeAdapter(GatewayConfig)


class InvalidConfig(GatewayError):
    """The config file was refused by a reload; the active config did not change."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_config"
    default_message = "the config file is not valid"


class ReloadIncomplete(GatewayError):
    """``serve --workers``: the supervisor applied the file, a worker did not answer."""

    status = 503
    type = "service_unavailable"
    code = "reload_incomplete"
    default_message = "a worker did not confirm the reload"


class _ReloadUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "reload_unavailable"
    default_message = "this gateway cannot reload its config"


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _no_query(request: web.Request) -> None:
    if request.query:
        raise InvalidRequest(f"unknown query parameter '{next(iter(request.query))}'", code="invalid_query")


def _public_url(raw: str) -> str:
    if not raw:
        return raw
    url = URL(raw)
    return str(url.with_user(None).with_password(None)) if url.user or url.password else raw


def masked_config(config: GatewayConfig) -> dict[str, Any]:
    """The config as JSON with every secret replaced by :data:`MASK`."""
    data: dict[str, Any] = _DUMP.dump_python(config, mode="json")
    for provider in data.get("providers", {}).values():
        if provider.get("api_key"):
            provider["api_key"] = MASK
        # Header values often carry keys (api-key, x-goog-api-key): names only.
        provider["headers"] = {name: MASK for name, _value in provider.get("headers") or ()}
        provider["base_url"] = _public_url(provider.get("base_url") or "")
    return data


def _view(state: GatewayState) -> dict[str, Any]:
    source = state.config_source
    return {
        "active": source.to_dict() if source is not None else None,
        "last_reload": state.last_reload.to_dict() if state.last_reload is not None else None,
        "config": masked_config(state.config),
    }


async def show_config(request: web.Request) -> web.Response:
    """``GET /admin/config``: source, hash, load time, last reload, masked config."""
    _no_query(request)
    return _json(_view(request.app[STATE]))


async def reload_config(request: web.Request) -> web.Response:
    """``POST /admin/config/reload``: 200 applied, 422 refused (nothing changed)."""
    _no_query(request)
    state = request.app[STATE]
    if state.reload_config is None:
        raise _ReloadUnavailable()
    outcome = await state.reload_config("admin")
    body = outcome.to_dict()
    failed = [w for w in outcome.workers if not w.get("ok")]
    problem: GatewayError
    if not outcome.ok:
        problem = InvalidConfig(outcome.error)
    elif any(w.get("refused") for w in failed):
        problem = InvalidConfig(next(str(w.get("error")) for w in failed if w.get("refused")))
    elif failed:
        problem = ReloadIncomplete(f"worker {failed[0].get('worker')}: {failed[0].get('error')}")
    else:
        return _json(body)
    return _json({"error": {"message": problem.message, "type": problem.type, "code": problem.error_code},
                  "reload": body}, status=problem.status)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/config", show_config)
    app.router.add_post("/admin/config/reload", reload_config)
