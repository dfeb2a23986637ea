"""Where metrics, traces and logs meet the request path: the edge middleware, the
``/metrics`` route, the chat-call hooks, and the wiring done at start-up.

* :func:`arrived` / :func:`answered` (the first step of both planes' middleware,
  :mod:`gateway.edge.front`) time every request, count it by route template and
  status, bind its request id for log lines and write the one JSON access line per
  request (logger ``gateway.access``).
* :func:`begin_call` / :func:`end_call` bracket a chat call in :mod:`gateway.edge.chat`:
  the span, the trace headers for the provider, the record the access line reads.
* :func:`key_known` is called by every key-authenticated handler once the key is
  verified, so the access line names the key's id on every route, refusals included.
* :func:`retried` / :func:`failed_over` are called by :mod:`gateway.edge.dispatch`.
* :func:`install` subscribes the metrics to finished calls and points the scrape at
  the actors' state; :func:`metrics_endpoint` serves ``GET /metrics``.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from gateway.core.errors import MetricsUnauthorized
from gateway.core.usage import CallRecord
from gateway.http.middleware import first_request_id
from gateway.http.state import STATE, GatewayState
from gateway.observability import logs
from gateway.observability.metrics import CONTENT_TYPE, GatewayMetrics, InFlight, cost_of
from gateway.observability.tracing import ChatSpan, note_failover, note_retry, note_upstream_error

__all__ = [
    "CALL_RECORD",
    "Arrival",
    "answered",
    "arrived",
    "begin_call",
    "end_call",
    "failed_over",
    "install",
    "key_known",
    "metrics_endpoint",
    "metrics_guard",
    "retried",
    "route_label",
    "upstream_auth_failed",
    "upstream_failed",
]

access_log = logging.getLogger(logs.ACCESS_LOGGER)

#: The chat call's record, for the access line of its request.
CALL_RECORD = web.RequestKey("call_record", CallRecord)
#: The verified key's id (never the key), for the access line of every authenticated route.
KEY_ID = web.RequestKey("key_id", uuid.UUID)
#: Monotonic arrival time of the request, for the overhead metric.
RECEIVED_AT = web.RequestKey("received_at", float)
#: Route label of requests that matched no route (404/405): one series, whatever the path.
UNMATCHED = "unmatched"
#: Status recorded for a request whose client went away before the answer (nginx's 499).
CLIENT_CLOSED = 499

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def route_label(request: web.Request) -> str:
    """The route template that matched (``/admin/keys/{id}``), never the raw path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


#: What :func:`arrived` noted of a request: its arrival time, route label, request id and
#: the token binding it for log lines, its route's in-flight gauge, the metrics it counts in.
Arrival = tuple[float, str, str, contextvars.Token[str | None], InFlight, GatewayMetrics]


def arrived(request: web.Request, metrics: GatewayMetrics) -> Arrival:
    """A request arrived (the front's first step): timed, counted in flight in ``metrics``
    (its plane's state's: the front holds it, where ``request.app[STATE]`` costs ~25
    instructions), its request id bound for log lines. :func:`answered` must follow, on
    every path."""
    received = time.monotonic()
    request_id = first_request_id(request)  # before anything is stored in it
    token = logs.bind_request_id(request_id)
    request[RECEIVED_AT] = received
    route = route_label(request)
    in_flight = metrics.in_flight(route)
    in_flight.value += 1
    return received, route, request_id, token, in_flight, metrics


def answered(request: web.Request, arrival: Arrival, status: int) -> None:
    """The request of ``arrival`` ended with ``status`` (its answer's, or
    :data:`CLIENT_CLOSED`): counted by route and status, and its access line written."""
    received, route, request_id, token, in_flight, metrics = arrival
    elapsed = time.monotonic() - received
    in_flight.value -= 1
    metrics.request_done(route, status, elapsed)
    if access_log.isEnabledFor(logging.INFO):
        _access_line(request, request_id, route, status, elapsed)
    logs.reset_request_id(token)


def _access_line(request: web.Request, request_id: str, route: str, status: int, elapsed: float) -> None:
    # ``request_id`` is the request's (:func:`request_id_of`), as :func:`arrived` found it:
    # not looked up again in the request's storage (20 instructions).
    # Ids go as UUIDs: orjson writes them as str() would, without str()'s Python-level
    # formatting. Items are set one by one (update() of a second dict costs more).
    fields: dict[str, Any] = {
        "request_id": request_id,
        "method": request.method,
        "route": route,
        "path": request.path,
        "status": status,
        "latency_ms": round(elapsed * 1000, 3),
        "client_ip": request.remote,
    }
    record = request.get(CALL_RECORD)
    if record is None:
        key_id = request.get(KEY_ID)
        if key_id is not None:
            fields["key_id"] = key_id
    else:
        usage = record.usage
        ttft = record.ttft
        fields["key_id"] = record.api_key_id or None
        fields["model"] = record.requested_model
        fields["served_model"] = record.served_model
        fields["provider"] = record.provider
        fields["stream"] = record.stream
        fields["outcome"] = record.outcome
        fields["input_tokens"] = usage.prompt_tokens
        fields["output_tokens"] = usage.completion_tokens
        fields["tokens_estimated"] = usage.estimated
        fields["cost_usd"] = cost_of(record)
        fields["ttft_ms"] = round(ttft * 1000, 3) if ttft is not None else None
        fields["retries"] = record.retries
        fields["failovers"] = record.failovers
        fields["error"] = record.error_type
    # As the line has them (request_id first, none of the head's keys): handed over as they
    # are where the line is made by the gateway's writer, else logged the standard way.
    if not logs.hand_off_fields(access_log, "access", fields):
        logs.log_fields(access_log, "access", fields)


def key_known(request: web.Request, api_key_id: uuid.UUID) -> None:
    """The request's key is verified: its id goes on the access line whatever follows."""
    request[KEY_ID] = api_key_id


# -- the chat call --------------------------------------------------------------------------
def begin_call(
    request: web.Request, state: GatewayState, record: CallRecord, body: Mapping[str, Any]
) -> ChatSpan | None:
    """Start observing a chat call: its span (if tracing), trace headers, access record."""
    request[CALL_RECORD] = record
    record.received_at = request.get(RECEIVED_AT)
    return state.tracing.start_chat(record, body, request.headers)


def end_call(state: GatewayState, scope: ChatSpan | None, record: CallRecord) -> None:
    """End the call's span; run after the call listeners (billing may set the cost)."""
    if scope is not None:
        state.tracing.end_chat(scope, record, cost_of(record))


def retried(state: GatewayState, provider: str, attempt: int, reason: str) -> None:
    """An upstream attempt is about to be repeated (``reason``: status or error name)."""
    state.metrics.retried(provider, reason)
    note_retry(provider, attempt, reason)


def upstream_failed(deployment: str, error: str, detail: str) -> None:
    """An attempt failed in transport; ``detail`` (hosts, addresses) is for the span only."""
    note_upstream_error(deployment, error, detail)


def upstream_auth_failed(state: GatewayState, provider: str, deployment: str, status: int) -> None:
    """A provider refused the gateway's credential (401/403): counted and on the span."""
    state.metrics.upstream_auth_failed(provider)
    note_upstream_error(deployment, "UpstreamCredentialRejected", f"provider answered {status}")


def failed_over(state: GatewayState, deployment: str, reason: str) -> None:
    """A call leaves ``deployment`` for the next target (counted from the record at the end)."""
    note_failover(deployment, reason)


# -- start-up and the scrape ----------------------------------------------------------------
def install(state: GatewayState) -> None:
    """Subscribe metrics to finished calls and point the scrape at live state.

    Components that may or may not exist yet (billing, limiter) are found by attribute,
    so this works before and after they land; they may also register themselves with
    ``state.metrics.watch_*``.
    """
    metrics = state.metrics
    metrics.watch_actors(state.supervisor.refs)
    metrics.watch_key_invalidation(lambda: state.auth.listening)
    breaker = getattr(state, "breaker", None)
    if breaker is not None and hasattr(breaker, "statuses"):
        # The observer's view: an open circuit whose reset time has passed reads half-open.
        metrics.watch_circuits(lambda: {s.deployment: int(s.state) for s in breaker.statuses(state.config)})
    pending = _reader(state, "billing", "pending_events")
    if pending is not None:
        metrics.watch_billing(pending)
    degraded = _reader(state, "limiter", "degraded")
    if degraded is not None:
        metrics.watch_limiter(lambda: bool(degraded()))
    metrics.watch_background_failures(lambda: _background_failures(state))
    cache = getattr(state, "cache", None)
    if cache is not None:
        metrics.watch_cache(cache.stats)
        cache.similarity_listeners.append(metrics.cache_similarity)
    rejection_listeners = getattr(getattr(state, "limiter", None), "rejection_listeners", None)
    if rejection_listeners is not None:
        rejection_listeners.append(metrics.rate_limited)
    state.tracing.providers = state.providers
    state.call_listeners.append(metrics.observe_call)


def _background_failures(state: GatewayState) -> dict[str, int]:
    """Failure counts of the actors' background work, for the metric."""
    counts = {"key_listen": int(getattr(state.auth, "listen_failures", 0))}
    billing = getattr(state, "billing", None)
    if billing is not None:
        counts["spend_refresh"] = int(getattr(billing, "refresh_failures", 0))
    limiter = getattr(state, "limiter", None)
    if limiter is not None and hasattr(limiter, "lease_counts"):
        lost, failed = limiter.lease_counts
        counts["lease_lost"], counts["lease_renew"] = lost, failed
    return counts


def _reader(state: GatewayState, component: str, attribute: str) -> Callable[[], Any] | None:
    """A function reading ``state.<component>.<attribute>`` (called if callable), or None."""
    owner = getattr(state, component, None)
    if owner is None or not hasattr(owner, attribute):
        return None

    def read() -> Any:
        value = getattr(owner, attribute)
        return value() if callable(value) else value

    return read


def metrics_guard(token: str | None, handler: Handler) -> Handler:
    """``handler`` behind ``Authorization: Bearer <METRICS_TOKEN>`` when a token is set.

    The comparison is constant-time over the token's digest, like the admin token's.
    """
    if not token:
        return handler
    expected = hashlib.sha256(f"Bearer {token}".encode()).digest()

    async def guarded(request: web.Request) -> web.StreamResponse:
        sent = hashlib.sha256(request.headers.get("Authorization", "").encode()).digest()
        if not hmac.compare_digest(sent, expected):
            raise MetricsUnauthorized()
        return await handler(request)

    return guarded


async def metrics_endpoint(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text, rendered off the event loop."""
    body = await request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
