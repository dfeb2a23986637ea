"""CORS for one plane: preflights answered, allowed origins told, never credentials.

Each plane gets its own :class:`CorsPolicy` (``CORS_ALLOWED_ORIGINS`` for the data
plane, default ``*``; ``MANAGEMENT_CORS_ORIGINS`` for the management plane, default
none, and ``*`` refused at start by :mod:`gateway.core.config`). Shaped after starlette's
``middleware/cors.py``: every header that does not depend on the request is built once
in ``__init__``; the per-request paths are guard clauses.

Two hooks, because answers are prepared in two places:

* :meth:`CorsPolicy.preflight_of` (a step of each plane's middleware,
  :mod:`gateway.edge.front`) answers preflights (``OPTIONS`` with ``Origin`` and
  ``Access-Control-Request-Method``) before routing reaches a handler, so no route
  needs an ``OPTIONS`` twin;
* :meth:`CorsPolicy.put_headers` (from each plane's ``on_response_prepare`` hook) adds
  ``Access-Control-Allow-Origin`` to every other answer to an allowed origin,
  including streams prepared inside handlers and errors rendered by middleware.

Credentials are never allowed (no ``Access-Control-Allow-Credentials``): keys and the
admin token travel in ``Authorization``, which a page must set explicitly, so a
browser never sends them on its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import hdrs, web

from gateway.http.errors import error_body

__all__ = ["CorsPolicy", "DATA_PLANE_EXPOSED", "MANAGEMENT_REQUEST_HEADERS"]

#: Response headers a browser page on the data plane may read (request id, limits).
DATA_PLANE_EXPOSED = (
    "x-request-id",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    "retry-after",
    "x-gateway-cache", "x-gateway-cache-key", "x-gateway-cache-similarity",
)
#: Request headers a management page may send: nothing beyond what the API reads.
MANAGEMENT_REQUEST_HEADERS = ("authorization", "content-type", "x-request-id")

#: How long a browser may cache a preflight answer, in seconds.
PREFLIGHT_MAX_AGE = 600


class CorsPolicy:
    """The CORS rules of one plane.

    ``allow_headers=None`` accepts whatever request headers a preflight asks for (the
    data plane: OpenAI SDKs send ``x-stainless-*`` and friends, and no credential rides
    on CORS); a tuple accepts only those (case-insensitive).
    """

    def __init__(
        self,
        allow_origins: Iterable[str],
        *,
        allow_methods: Iterable[str],
        allow_headers: Iterable[str] | None,
        expose_headers: Iterable[str] = (),
        max_age: int = PREFLIGHT_MAX_AGE,
    ) -> None:
        origins = tuple(allow_origins)
        self.allow_any_origin = "*" in origins
        self.allow_origins = frozenset(o for o in origins if o != "*")
        self.allow_methods = tuple(m.upper() for m in allow_methods)
        self.allow_headers = None if allow_headers is None else frozenset(h.lower() for h in allow_headers)
        self._method_set = frozenset(self.allow_methods)
        simple: dict[str, str] = {}
        if expose_headers:
            simple["Access-Control-Expose-Headers"] = ", ".join(expose_headers)
        preflight = {
            "Access-Control-Allow-Methods": ", ".join(self.allow_methods),
            "Access-Control-Max-Age": str(max_age),
        }
        if self.allow_headers is not None:
            preflight["Access-Control-Allow-Headers"] = ", ".join(sorted(self.allow_headers))
        if not self.allow_any_origin:
            # The answer depends on the Origin: shared caches must keep one per origin.
            preflight["Vary"] = "Origin"
        self._simple_headers = simple
        self._preflight_headers = preflight

    @property
    def enabled(self) -> bool:
        """False when no origin is allowed: every cross-origin call is refused."""
        return self.allow_any_origin or bool(self.allow_origins)

    def origin_allowed(self, origin: str) -> bool:
        return self.allow_any_origin or origin in self.allow_origins

    def _allow_origin_value(self, origin: str) -> str:
        # "*" only when any origin may call; otherwise echo the one origin (with Vary).
        return "*" if self.allow_any_origin else origin

    # -- preflight --------------------------------------------------------------------
    def preflight_of(self, request: web.Request) -> web.Response | None:
        """The answer to ``request`` if it is a preflight, else None (routed as usual)."""
        if request.method != "OPTIONS":
            return None
        headers = request.headers
        origin = headers.get("Origin")
        requested_method = headers.get("Access-Control-Request-Method")
        if origin is None or requested_method is None:
            return None  # a plain OPTIONS: not CORS, routed as usual
        return self.preflight(origin, requested_method, headers.get("Access-Control-Request-Headers"))

    def preflight(self, origin: str, method: str, requested_headers: str | None) -> web.Response:
        """The answer to one preflight: 204 with the rules, or 400 saying what is refused.

        A browser only needs the missing ``Access-Control-Allow-Origin`` to refuse; the
        400 and its message are for the person reading the network tab.
        """
        problems = []
        if not self.origin_allowed(origin):
            problems.append(f"origin {origin!r} is not allowed")
        if method.upper() not in self._method_set:
            problems.append(f"method {method!r} is not allowed")
        headers = dict(self._preflight_headers)
        if requested_headers:
            asked = [h.strip().lower() for h in requested_headers.split(",") if h.strip()]
            if self.allow_headers is None:
                headers["Access-Control-Allow-Headers"] = ", ".join(asked)
            else:
                refused = [h for h in asked if h not in self.allow_headers]
                if refused:
                    problems.append(f"headers {', '.join(refused)} are not allowed")
        if problems:
            return web.Response(
                status=400,
                body=error_body("CORS preflight refused: " + "; ".join(problems), "invalid_request_error", "cors_refused"),
                content_type="application/json",
                headers={"Vary": "Origin"} if not self.allow_any_origin else None,
            )
        headers["Access-Control-Allow-Origin"] = self._allow_origin_value(origin)
        return web.Response(status=204, headers=headers)

    # -- every other answer -----------------------------------------------------------
    def put_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Tell an allowed origin it may read this answer (no preflight's: it is complete)."""
        origin = request.headers.get(hdrs.ORIGIN)  # multidict's key, made once: no case folding
        if origin is None:
            return
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return  # a preflight: its answer is complete (and a refusal must stay bare)
        if not self.allow_any_origin:
            _vary_on_origin(response)
        if not self.origin_allowed(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = self._allow_origin_value(origin)
        for name, value in self._simple_headers.items():
            response.headers.setdefault(name, value)


def _vary_on_origin(response: web.StreamResponse) -> None:
    vary = response.headers.get("Vary")
    if vary is None:
        response.headers["Vary"] = "Origin"
    elif "origin" not in {v.strip().lower() for v in vary.split(",")}:
        response.headers["Vary"] = f"{vary}, Origin"
