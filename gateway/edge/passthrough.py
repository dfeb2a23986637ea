"""``/passthrough/{provider}/{path}``: a provider's own API, relayed unchanged.

For what the gateway does not translate (batch APIs, files, a vendor's newest route),
a client calls ``/passthrough/{provider}/{path}`` with its gateway key; the gateway
checks the key, its allowlist, its limits and its budget as for a chat call, then sends
the method, ``path``, query and body to the provider's base URL with the provider's
credential attached server-side (the client's own credential headers are never
forwarded), and relays the status, headers and body back as they arrive, streams
included, byte for byte.

Access: a key with a model allowlist may use a provider here only when the allowlist
holds ``passthrough/{provider}`` (or a pattern matching it, e.g. ``passthrough/*``); a
key without an allowlist may use every provider.

Regions: ``/passthrough/{provider}@{region}/{path}`` sends the call to the provider's
endpoint in ``region`` (its host and, for Bedrock, its SigV4 scope), one of the regions
the operator configured for that provider: its own, or one a deployment of it names. A
region not configured is refused, so a client cannot send data where the operator did
not mean it to go. Without ``@region`` the call goes to the provider's own region.

A provider whose signature covers the request itself (Bedrock's SigV4: method, path,
query and body) signs the forwarded request with the gateway's credentials
(:meth:`Provider.passthrough_request`); its binary event streams are relayed as they come
and read on the side for usage through the provider's frame reader
(:meth:`Provider.passthrough_payloads`).

Billing: the answer is read on the side (gateway/protocols/usage_shapes.py). When it
carries a usage object of a known wire, the call is recorded with those tokens (priced
from a configured deployment of that provider and the body's ``model`` when there is
one); otherwise it is recorded with zero tokens and ``cost_source = passthrough``.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from gateway.core.config import Price
from gateway.core.errors import InvalidRequest, ModelNotAllowed, ModelNotFound, UpstreamUnavailable
from gateway.core.usage import CallRecord, Usage
from gateway.edge import telemetry
from gateway.edge.pipeline import finish_record, tell_listeners
from gateway.edge.ratelimit import admit
from gateway.http.bodies import bearer_token, read_body
from gateway.http.chunked import Body, body_of
from gateway.http.middleware import request_id_of
from gateway.http.state import STATE, GatewayState
from gateway.protocols.sse import event_data, iter_events
from gateway.protocols.usage_shapes import UsageSniffer
from gateway.providers.base import (
    Provider,
    ProviderError,
    map_transport_errors,
    stream_chunks,
    stream_timeout,
)

__all__ = ["PASSTHROUGH_ROUTE", "passthrough"]

log = logging.getLogger("gateway.passthrough")

PASSTHROUGH_ROUTE = "/passthrough/{provider}/{path:.*}"

#: Never forwarded upstream: hop-by-hop headers, the client's credentials (the
#: provider's are added server-side), and what aiohttp sets itself.
_REQUEST_DROP = frozenset({
    "host", "connection", "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "authorization", "x-api-key", "api-key",
    "x-goog-api-key", "cookie", "accept-encoding", "x-request-id",
})
#: Never relayed back: hop-by-hop headers and those aiohttp writes for the relay itself.
_RESPONSE_DROP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "set-cookie", "upgrade",
    "proxy-authenticate", "trailer", "date", "server",
})
#: A whole answer larger than this is relayed but not searched for usage.
_SNIFF_LIMIT_BYTES = 8 * 1024 * 1024


async def passthrough(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    permit = await admit(request, key, state.limiter)
    name, _, region = request.match_info["provider"].partition("@")
    allowed = key.policy.allowed_models
    if allowed is not None and not any(fnmatch.fnmatchcase(f"passthrough/{name}", p) for p in allowed):
        raise ModelNotAllowed(f"pass-through to provider {name!r} is not allowed for this key",
                              code="provider_not_allowed")
    provider = state.providers.get(name)
    if provider is None or not provider.passthrough_base:
        raise ModelNotFound(f"no provider {name!r} to pass through to", code="provider_not_found")
    if region == provider.region:
        region = ""  # the provider's own, named: the same call as without it
    elif region:
        provider = _in_region(state, provider, name, region)
    raw = await read_body(request, state.settings.body_limit)
    model = _model_of(raw) or provider.passthrough_model(request.match_info["path"])
    record = CallRecord(
        request_id=request_id_of(request), api_key_id=key.api_key_id, subject_id=key.subject_id,
        requested_model=model or f"passthrough/{name}", served_model=model, provider=name,
        # As a deployment's id names its region (provider/model@region) when not the provider's.
        deployment=f"{name}/passthrough@{region}" if region else f"{name}/passthrough", passthrough=True,
    )
    record.price = _price_of(state, name, model)
    # Budgets hold here too: the body's worst case at its model's price, held before sending.
    reservation = await state.billing.reserve_passthrough(key, record, _json_of(raw), record.price)
    permit.track(record)
    started = time.monotonic()
    try:
        return await _relay(request, state, provider, raw, record, started)
    except asyncio.CancelledError:
        record.outcome, record.status = "cancelled", record.status or 499
        raise
    finally:
        record.latency = time.monotonic() - started
        finish_record(state, record)  # journaled once the answer is through: its usage is in it
        tell_listeners(state, record)
        state.billing.settle(reservation, record)


async def _relay(
    request: web.Request, state: GatewayState, provider: Provider, raw: bytes, record: CallRecord, started: float,
) -> web.StreamResponse:
    headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP)
    try:
        # The credential goes in last: a provider signing the request (Bedrock) signs what is sent.
        url, credential = await provider.passthrough_request(
            request.method, request.match_info["path"], request.query_string, headers, raw)
        headers.update(credential)
        headers["Accept-Encoding"] = "identity"  # so the answer can be read for usage as it passes
        with map_transport_errors():
            upstream = await state.session.request(
                request.method, url, data=raw or None, headers=headers,
                timeout=stream_timeout(provider.timeouts),  # a stream or not: bound the silence
            )
    except ProviderError as exc:
        record.outcome, record.status = "upstream_error", 502
        raise UpstreamUnavailable(f"provider {provider.name} unreachable: {exc}") from None
    sniffer = UsageSniffer()
    response = web.StreamResponse(status=upstream.status, headers={
        k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP})
    record.status = upstream.status
    content_type = upstream.headers.get("Content-Type", "")
    framed = provider.passthrough_payloads(content_type)  # a vendor's binary stream (Bedrock's)
    record.stream = content_type.startswith("text/event-stream") or framed is not None
    try:
        out = body_of(response, await response.prepare(request))
        if framed is not None:
            async for chunk in _chunks(upstream, out, record, started):
                for payload in framed(chunk):
                    sniffer.feed_json(payload)
        elif record.stream:
            async for event in iter_events(_chunks(upstream, out, record, started)):
                if (data := event_data(event)) is not None:
                    sniffer.feed_json(data)
        else:
            body = bytearray()
            async for chunk in _chunks(upstream, out, record, started):
                if len(body) <= _SNIFF_LIMIT_BYTES:
                    body += chunk
            if len(body) <= _SNIFF_LIMIT_BYTES:
                sniffer.feed_json(bytes(body))
        await response.write_eof()
    except ProviderError as exc:
        record.outcome, record.error_type = "cut", type(exc).__name__
        response.force_close()  # the status is sent: ending the connection tells the client
    except ConnectionError:
        record.outcome = "cancelled"
    finally:
        upstream.release()
        if upstream.status >= 400 and record.outcome == "ok":
            record.outcome = "provider_error"
        sniffer.feed_headers(upstream.headers)
        if sniffer.recognised:
            record.usage = Usage(prompt_tokens=sniffer.prompt_tokens, completion_tokens=sniffer.completion_tokens)
    return response


async def _chunks(
    upstream: aiohttp.ClientResponse, out: Body, record: CallRecord, started: float
) -> AsyncIterator[bytes]:
    """The upstream body chunk by chunk, each written to the client before it is yielded."""
    with map_transport_errors():
        async for chunk in stream_chunks(upstream):
            if record.ttft is None and record.stream:
                record.ttft = time.monotonic() - started
            if (waiting := out.put(chunk)) is not None:
                await waiting
            yield chunk


def _json_of(raw: bytes) -> Any:
    """The body as JSON where it is JSON (a worst case reads its ``max_tokens``), else its text."""
    try:
        return orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


def _model_of(raw: bytes) -> str | None:
    """The body's ``model``, when it is a JSON object naming one (for the ledger and price)."""
    if not raw.startswith(b"{") or b'"model"' not in raw:
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model[:256] if isinstance(model, str) and model else None


def _in_region(state: GatewayState, provider: Provider, name: str, region: str) -> Provider:
    """``provider`` in ``region`` (not its own), when the operator configured that region for
    it (one of its deployments'); otherwise the client's 400, naming the regions it may use."""
    own = provider.region
    regions = {own} if own is not None else set()
    for group in state.config.models:
        for deployment in group.deployments:
            if deployment.provider == name and deployment.region is not None:
                regions.add(deployment.region)
                if deployment.region == region:
                    return provider.for_deployment(deployment)
    known = ", ".join(sorted(regions)) if regions else "none: it has no regions"
    raise InvalidRequest(f"provider {name!r} is not configured for region {region!r} (configured: {known})",
                         code="region_not_configured")


def _price_of(state: GatewayState, provider: str, model: str | None) -> Price | None:
    """The price of a configured deployment of ``provider`` serving ``model``, if any."""
    if model is None:
        return None
    for group in state.config.models:
        for deployment in group.deployments:
            if deployment.provider == provider and deployment.model in (model, "*") and deployment.price:
                return deployment.price
    return None

