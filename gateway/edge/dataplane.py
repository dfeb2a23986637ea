"""The data plane's routes other than chat: health, readiness, models, embeddings."""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from gateway.core.errors import GatewayError, InvalidRequest
from gateway.core.usage import CallRecord, usage_from_answer
from gateway.edge import telemetry
from gateway.edge.dispatch import embed
from gateway.edge.pipeline import finish_record
from gateway.edge.ratelimit import admit
from gateway.http.bodies import bearer_token, read_json_body
from gateway.http.middleware import request_id_of
from gateway.http.state import STATE

__all__ = ["embeddings", "healthz", "list_models", "readyz"]

_OK = orjson.dumps({"status": "ok"})
#: The state of a ``/readyz`` check that passed; any other value says what is wrong.
_CHECK_OK = "ok"


async def healthz(request: web.Request) -> web.Response:
    """Alive while the process runs; never touches a dependency."""
    return web.Response(body=_OK, content_type="application/json")


async def readyz(request: web.Request) -> web.Response:
    """Ready when the database answers, every actor runs and key changes are heard;
    else 503. ``checks`` names every check with its state, ``ok`` or what is wrong, so
    a healthy answer shows what was checked, not an empty object."""
    state = request.app[STATE]
    checks: dict[str, str] = {"server": "shutting down" if state.draining else _CHECK_OK}
    try:
        async with asyncio.timeout(1.0):
            await state.pool.fetchval("SELECT 1")
        checks["database"] = _CHECK_OK
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
        checks["database"] = f"unreachable: {type(exc).__name__}"
    stopped = set(state.supervisor.not_running())
    for name in sorted(ref.name for ref in state.supervisor.refs()):
        checks[f"actor:{name}"] = "not running" if name in stopped else _CHECK_OK
    checks["key_invalidation"] = _CHECK_OK if state.auth.listening else "not listening for key changes"
    ready = all(value == _CHECK_OK for value in checks.values())
    # Degraded is still ready: limits keep working from memory (docs/rate-limits.md).
    degraded = {f"rate_limits:{name}": why for name, why in state.limiter.degraded.items()}
    # Still ready, but shared state may be stale: say so (each also logs a WARNING and
    # counts in gateway_background_failures_total).
    stale_for = state.billing.refresh_failing_for
    if stale_for is not None:
        degraded["budgets"] = f"spend refresh failing for {stale_for:.0f} s: shared budgets may be stale"
    if state.limiter.lease_trouble is not None:
        degraded["concurrency_leases"] = f"last renewal: {state.limiter.lease_trouble}"
    checks["rate_limits"] = (
        "degraded: " + "; ".join(f"{name}: {why}" for name, why in state.limiter.degraded.items())
        if degraded else _CHECK_OK
    )
    body: dict[str, object] = {"status": "ok" if ready else "unavailable", "checks": checks}
    if degraded:
        body["degraded"] = degraded
        if ready:
            body["status"] = "degraded"
    return web.Response(status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json")


async def list_models(request: web.Request) -> web.Response:
    """The model names this key may use, in OpenAI's list shape."""
    state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    await admit(request, key, state.limiter)
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "llm-gateway"}
        for name in await state.router.list_models(state.providers, key.policy.allowed_models)
    ]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def embeddings(request: web.Request) -> web.Response:
    """Proxied to the model's deployments that serve embeddings, as chat calls are: under
    their circuit breakers, with retries, failover and the group's fallbacks
    (:func:`gateway.edge.dispatch.embed`). A provider's own error answer keeps its status."""
    state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    permit = await admit(request, key, state.limiter)
    body = await read_json_body(request, state.settings.body_limit)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", code="invalid_model")
    if "input" not in body:
        raise InvalidRequest("'input' is required", code="invalid_input")
    route = state.router.resolve(model, key.policy.allowed_models)
    record = CallRecord(
        request_id=request_id_of(request), api_key_id=key.api_key_id, subject_id=key.subject_id,
        requested_model=model,
    )
    # Budgets hold here too: the input's worst case is reserved before it is sent.
    reservation = await state.billing.reserve(key, record, route, state.router, body, embeddings=True)
    started = time.monotonic()
    try:
        target, reply = await embed(state, route, body, record)
        record.status = reply.status
        record.served_model = target.upstream_model
        usage, answer = usage_from_answer(reply.body, reply.answer)
        if answer is not None and isinstance(answer.get("model"), str):
            record.served_model = answer["model"]
        record.usage = usage
        if not reply.ok:
            record.outcome = "provider_error"
        permit.charge(usage.total_tokens)
        return web.Response(
            status=reply.status,
            body=reply.body,
            headers={"Content-Type": reply.headers.get("Content-Type", "application/json")},
        )
    except asyncio.CancelledError:
        record.outcome, record.status = "cancelled", record.status or 499
        raise
    except GatewayError as exc:
        record.status, record.outcome, record.error_type = exc.status, "upstream_error", exc.error_code
        raise
    finally:
        # One ledger row per embeddings call, with its tokens and cost, as for chat.
        record.latency = time.monotonic() - started
        finish_record(state, record)
        state.billing.settle(reservation, record)
        # This route tells no call listeners (tell_listeners), so its billing line is logged here.
        state.billing.log_line(record)
