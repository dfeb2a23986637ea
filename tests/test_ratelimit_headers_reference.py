"""The ``x-ratelimit-*`` headers, written the fast way, are byte for byte what the plain
way wrote: the reference implementations below are the code they replaced, compared over
many random limiter states (and responses already carrying some of those headers)."""

from __future__ import annotations

import math
import random
import time
from types import SimpleNamespace
from typing import Any

from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from actors.limiter import Permit, _key_headers, reset_header
from gateway.edge import ratelimit
from gateway.edge.ratelimit import PERMIT, anthropic_ratelimit_headers, put_ratelimit_headers
from gateway.http.errors import error_shape_for


def reference_reset_header(seconds: float) -> str:
    ms = math.ceil(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms" if ms > 0 else "0ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    secs = f"{whole}.{fraction:03d}".rstrip("0") if fraction else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def reference_key_headers(
    requests: int, window_seconds: int, tokens_per_minute: int | None, allowed: bool, reading: Any
) -> dict[str, str]:
    now, requests_reset, requests_remaining, tokens_reset, tokens_remaining = reading
    reset_requests = requests_reset - now
    if allowed:
        requests_remaining -= 1
    headers = {
        "x-ratelimit-limit-requests": str(requests),
        "x-ratelimit-remaining-requests": str(requests_remaining) if requests_remaining > 0 else "0",
        "x-ratelimit-reset-requests": reference_reset_header(reset_requests if reset_requests > 0 else window_seconds),
    }
    if tokens_remaining is not None:
        headers["x-ratelimit-limit-tokens"] = str(tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(tokens_remaining) if tokens_remaining > 0 else "0"
        headers["x-ratelimit-reset-tokens"] = reference_reset_header(tokens_reset - now)
    return headers


def reference_put(request: web.Request, response: web.StreamResponse, headers: dict[str, str] | None) -> None:
    """The old ``put_ratelimit_headers``, given what ``request`` held."""
    if headers:
        response.headers.update(headers)
        if error_shape_for(request.path) == "anthropic":
            response.headers.update(anthropic_ratelimit_headers(dict(headers), time.time()))


def random_seconds(rng: random.Random) -> float:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice([0, -0.0, 0.001, 0.0009999, 0.999, 0.9991, 1, 59.999, 59.9991, 60, 3600, 3599.9995, -1.5])
    if kind == 1:
        return rng.uniform(-2, 1)
    if kind == 2:
        return rng.uniform(0, 60)
    if kind == 3:
        return rng.uniform(59, 3700)
    if kind == 4:
        return rng.uniform(0, 200_000)
    return rng.randrange(0, 100_000) / 1000  # whole milliseconds, floats near them


def random_state(rng: random.Random) -> tuple[int, int, int | None, Any]:
    requests = rng.choice([1, 2, 10, 60, 600, 10_000, rng.randrange(1, 10**7)])
    window = rng.choice([1, 60, 3600, rng.randrange(1, 86_400)])
    tokens = rng.choice([None, 1000, 100_000, rng.randrange(1, 10**9)])
    now = rng.uniform(0, 2e9)
    reading = (
        now,
        now + rng.choice([0.0, -1.0, random_seconds(rng)]),
        rng.randrange(-3, requests + 2),
        now + random_seconds(rng),
        None if tokens is None else rng.randrange(-5, tokens + 2),
    )
    return requests, window, tokens, reading


def random_response(rng: random.Random) -> web.Response:
    response = web.Response()
    for _ in range(rng.randrange(4)):
        name = rng.choice([
            "Content-Type", "X-RateLimit-Limit-Requests", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests",
            "x-request-id", "X-Ratelimit-Reset-Tokens",
        ])
        response.headers.add(name, str(rng.randrange(1000)))
    return response


def test_reset_header_matches_the_reference() -> None:
    rng = random.Random(7)
    for _ in range(100_000):
        seconds = random_seconds(rng)
        assert reset_header(seconds) == reference_reset_header(seconds), seconds
    for ms in range(0, 4_000_000, 7):
        assert reset_header(ms / 1000) == reference_reset_header(ms / 1000), ms


def test_key_headers_match_the_reference() -> None:
    rng = random.Random(11)
    for _ in range(50_000):
        requests, window, tokens, reading = random_state(rng)
        allowed = rng.random() < 0.8
        new = _key_headers(requests, window, tokens, allowed, reading)
        old = reference_key_headers(requests, window, tokens, allowed, reading)
        assert list(new.items()) == list(old.items())
        assert all(type(name) is str and type(value) is str for name, value in new.items())


def test_a_permits_headers_on_a_response_match_the_reference() -> None:
    rng = random.Random(13)
    for _ in range(20_000):
        requests, window, tokens, reading = random_state(rng)
        policy = SimpleNamespace(rate_limit_requests=requests, rate_limit_window_seconds=window, tokens_per_minute=tokens)
        permit = Permit(None, None, True, SimpleNamespace(policy=policy), reading)  # type: ignore[arg-type]
        seed = rng.random()
        new, old = random_response(random.Random(seed)), random_response(random.Random(seed))
        permit.put_headers(new.headers)
        old.headers.update(reference_key_headers(requests, window, tokens, True, reading))
        assert list(new.headers.items()) == list(old.headers.items())
        assert permit.headers == reference_key_headers(requests, window, tokens, True, reading)
        # A permit granted with its headers (an Acquire's answer) writes exactly those.
        given = Permit(None, None, True, headers=dict(permit.headers))  # type: ignore[arg-type]
        out: CIMultiDict[str] = CIMultiDict(old.headers)
        given.put_headers(out)
        assert list(out.items()) == list(old.headers.items())


def test_the_prepare_hooks_rate_limit_headers_match_the_reference(monkeypatch: Any) -> None:
    monkeypatch.setattr(ratelimit.time, "time", lambda: 1_700_000_000.25)
    rng = random.Random(17)
    for _ in range(5_000):
        requests, window, tokens, reading = random_state(rng)
        policy = SimpleNamespace(rate_limit_requests=requests, rate_limit_window_seconds=window, tokens_per_minute=tokens)
        path = rng.choice(["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/healthz"])
        request = make_mocked_request("POST", path, app=web.Application())
        held: dict[str, str] | None = None
        case = rng.randrange(3)
        if case == 0:
            permit = Permit(None, None, True, SimpleNamespace(policy=policy), reading)  # type: ignore[arg-type]
            request[PERMIT] = permit
            held = reference_key_headers(requests, window, tokens, True, reading)
        elif case == 1:
            held = reference_key_headers(requests, window, tokens, False, reading)
            request[ratelimit._HEADERS] = held
        seed = rng.random()
        new, old = random_response(random.Random(seed)), random_response(random.Random(seed))
        put_ratelimit_headers(request, new)
        reference_put(request, old, held)
        assert list(new.headers.items()) == list(old.headers.items()), path
