"""Rate limits at the edge: the per-IP guard, per-key admission, and the headers.

* :func:`guard_ip` (a step of the data plane's middleware, :mod:`gateway.edge.front`)
  guards each client address on ``/v1/``: every request counts against a generous cap
  (``per_ip_all``); unauthenticated and failed attempts (:func:`count_failure`) count
  against ``per_ip``, and once an address has spent that, its requests that would cost
  a key lookup are refused before authentication (a flood of bad or missing keys costs
  no database work), while callers with cached valid keys go on. After the handler
  ends, on every path (answer, error, cancellation, client gone), the middleware
  releases the request's :class:`Permit` exactly once (:func:`release_permit`).
* :func:`client_ip`: the TCP peer, or the client a trusted proxy names
  (``rate_limits.trusted_proxies``) in ``X-Forwarded-For`` / ``Forwarded``; IPv6
  clients are keyed by their /64 (one host usually holds a whole /64).
* :func:`admit` is what a handler calls right after authentication: the key's limits,
  a 429 when one is hit, and the ``x-ratelimit-*`` headers for whatever answer follows
  (an admitted request's are written from its Permit when the answer is prepared).
* :func:`put_ratelimit_headers` (``on_response_prepare``) puts those headers on every
  answer of an authenticated request: errors after auth and streams too, since a
  stream's headers are sent when it is prepared.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re
import time
from collections.abc import Mapping
from datetime import datetime, timezone

from aiohttp import web

from actors.auth import VerifiedKey
from actors.limiter import LimiterHandle, Permit
from gateway.core.errors import RateLimited
from gateway.http.bodies import bearer_token
from gateway.http.errors import error_shape_for
from gateway.http.state import GatewayState

__all__ = [
    "PERMIT", "admit", "client_ip", "count_failure", "guard_ip", "put_ratelimit_headers", "release_permit",
]

PERMIT = web.RequestKey("ratelimit_permit", Permit)
_HEADERS = web.RequestKey("ratelimit_headers", dict[str, str])

#: Routes the flood guard covers: the authenticated API (health checks stay free).
GUARDED_PREFIX = "/v1/"

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@functools.lru_cache(maxsize=8)
def _networks(cidrs: tuple[str, ...]) -> tuple[_Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def _parse(text: str) -> _Address | None:
    text = text.strip().strip('"')
    if text.startswith("["):  # Forwarded: for="[2001:db8::1]:4711"
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.partition(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _forwarded_chain(request: web.Request) -> list[str]:
    """Addresses the proxies appended, nearest last (``Forwarded`` wins over XFF)."""
    forwarded = request.headers.getall("Forwarded", [])
    if forwarded:
        chain = []
        for element in ",".join(forwarded).split(","):
            for pair in element.split(";"):
                name, _, value = pair.strip().partition("=")
                if name.lower() == "for":
                    chain.append(value)
        return chain
    return [part for value in request.headers.getall("X-Forwarded-For", []) for part in value.split(",")]


def _key_of(address: _Address) -> str:
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@functools.lru_cache(maxsize=4096)
def _peer_key(remote: str) -> str:
    """The key of a TCP peer that is no trusted proxy: a pure function of the address,
    so parsed once per address (``ipaddress`` parsing was most of the guard's own work
    on a request); bounded, an evicted address is parsed again."""
    peer = _parse(remote)
    return (remote or "unknown") if peer is None else _key_of(peer)


def client_ip(request: web.Request, trusted_proxies: tuple[str, ...] = ()) -> str:
    """The key the per-IP guard counts this request under (see docs/rate-limits.md).

    The TCP peer, unless it is a trusted proxy: then the forwarded chain is read from
    the right, skipping trusted proxies, and the first other address is the client (a
    client cannot forge its way past the proxy nearest to us). IPv6 is keyed by /64.
    """
    remote = request.remote or ""
    if not trusted_proxies:
        return _peer_key(remote)
    peer = _parse(remote)
    if peer is None:
        return remote or "unknown"
    networks = _networks(trusted_proxies)
    if any(peer in net for net in networks):
        for raw in reversed(_forwarded_chain(request)):
            hop = _parse(raw)
            if hop is None:
                break  # "unknown" or garbage: stop at the last proxy we trust
            if not any(hop in net for net in networks):
                return _key_of(hop)
            peer = hop
    return _key_of(peer)


async def admit(request: web.Request, key: VerifiedKey, limiter: LimiterHandle) -> Permit:
    """Check ``key``'s limits for this request; raises RateLimited (429) when one is hit.

    ``limiter`` is the caller's state's (every caller holds it: ``request.app[STATE]``
    again is ~25 instructions through aiohttp's ``request.app`` and ``current_app``)."""
    try:
        permit = await limiter.acquire(key)
    except RateLimited as exc:
        request[_HEADERS] = exc.headers
        raise
    request[PERMIT] = permit  # its headers are written when the answer is prepared
    return permit


async def guard_ip(request: web.Request, state: GatewayState) -> str | None:
    """The per-IP guard, before the handler: the address it counts, None off ``/v1/``.

    Raises RateLimited when the address is past its cap, or past its failures and the
    request would cost a key lookup.
    """
    if not request.path.startswith(GUARDED_PREFIX):
        return None
    limiter = state.limiter
    ip = client_ip(request, state.config.rate_limits.trusted_proxies)
    if not limiter.passed_ip_now(ip):  # the generous cap on every request
        await limiter.check_ip(ip)
    # Past its failures only if some were counted (most addresses have none, and then the
    # token's lookup in the auth cache is not needed: bench.opcodes S1, 99 -> 48 instructions).
    if limiter.failures_counted(ip) and not state.auth.answers_from_cache(bearer_token(request)):
        await limiter.check_ip(ip, "peek")  # would cost a lookup: not past its failures
    return ip


async def count_failure(state: GatewayState, ip: str) -> None:
    """The request guarded under ``ip`` was refused its key: one failed attempt."""
    await state.limiter.check_ip(ip, "failed")


def release_permit(request: web.Request) -> None:
    """After the handler, on every path: free what :func:`admit` took, if it did."""
    permit = request.get(PERMIT)
    if permit is not None:
        permit.release()


_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)s)?(?:(\d+)ms)?")


def duration_seconds(text: str) -> float:
    """``x-ratelimit-reset-*``'s duration (``20ms``, ``6m0s``, ``1h2m3.5s``) in seconds."""
    m = _DURATION.fullmatch(text)
    if m is None:
        return 0.0
    hours, minutes, secs, ms = m.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs or 0) + int(ms or 0) / 1000


def anthropic_ratelimit_headers(headers: Mapping[str, str], now: float) -> dict[str, str]:
    """The same limits under Anthropic's names (``anthropic-ratelimit-*``), which the
    Anthropic SDKs and Claude Code read; resets are RFC 3339 times, as Anthropic sends."""
    out: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        if f"x-ratelimit-limit-{kind}" not in headers:
            continue
        out[f"anthropic-ratelimit-{kind}-limit"] = headers[f"x-ratelimit-limit-{kind}"]
        out[f"anthropic-ratelimit-{kind}-remaining"] = headers.get(f"x-ratelimit-remaining-{kind}", "0")
        reset = now + duration_seconds(headers.get(f"x-ratelimit-reset-{kind}", "0s"))
        out[f"anthropic-ratelimit-{kind}-reset"] = (
            datetime.fromtimestamp(math.ceil(reset), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        )
    return out


def put_ratelimit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The ``x-ratelimit-*`` headers :func:`admit` computed, on whatever answer follows
    (and their ``anthropic-ratelimit-*`` spelling on the Messages routes)."""
    # The permit first: most answers have one, and a request key that is not there costs
    # a KeyError raised and caught (``Request.get``). :func:`admit` runs once per request,
    # so a request has a permit or a refusal's headers, never both.
    permit = request.get(PERMIT)
    if permit is not None and error_shape_for(request.path) != "anthropic":
        permit.put_headers(response.headers)  # the common answer: no dict in between
        return
    headers = permit.headers if permit is not None else request.get(_HEADERS)
    if headers:
        response.headers.update(headers)
        if error_shape_for(request.path) == "anthropic":
            response.headers.update(anthropic_ratelimit_headers(dict(headers), time.time()))
