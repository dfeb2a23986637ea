"""Rate limits as clients see them: 429 with Retry-After, x-ratelimit-* headers on every
authenticated answer, tokens charged with real usage, concurrency released on every path,
and the per-IP flood guard refusing before any database work.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.auth.keys import generate_key
from gateway.core.config import ConfigError, load_config, load_settings
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, sse_payloads, until

HOUR = 3600
#: OpenAI's duration format: 20ms, 1s, 1.5s, 6m0s, 1h2m3s.
DURATION = re.compile(r"\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s")
REQUEST_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


async def start(gateway_factory: Any, fake: FakeUpstream, env: dict[str, str] | None = None, **rate_limits: Any) -> Gateway:
    yaml = config_for(fake.url, rate_limits={"strategy": "fixed-window", **rate_limits})
    return await gateway_factory(env=env, config_yaml=yaml)  # type: ignore[no-any-return]


def remaining(resp: aiohttp.ClientResponse, kind: str = "requests") -> int:
    return int(resp.headers[f"x-ratelimit-remaining-{kind}"])


async def test_every_authenticated_answer_carries_the_headers(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any
) -> None:
    gw = await start(gateway_factory, fake)
    raw, _ = await key_factory(rate_limit_requests=10, rate_limit_window_seconds=HOUR, tokens_per_minute=10_000)
    answers = [
        await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw)),
        await gw.data.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth(raw)),
        await gw.data.post("/v1/chat/completions", data=b"{not json", headers=auth(raw)),
        await gw.data.get("/v1/models", headers=auth(raw)),
        await gw.data.post("/v1/embeddings", json={"model": "m", "input": "hello"}, headers=auth(raw)),
    ]
    assert [a.status for a in answers] == [200, 200, 400, 200, 200]
    assert answers[1].headers["Content-Type"].startswith("text/event-stream")
    for answer in answers:
        await answer.read()
        for name in REQUEST_HEADERS + TOKEN_HEADERS:
            assert name in answer.headers, (answer.url, name)
        assert answer.headers["x-ratelimit-limit-requests"] == "10"
        assert answer.headers["x-ratelimit-limit-tokens"] == "10000"
        assert DURATION.fullmatch(answer.headers["x-ratelimit-reset-requests"])
        assert DURATION.fullmatch(answer.headers["x-ratelimit-reset-tokens"])
    assert [remaining(a) for a in answers] == [9, 8, 7, 6, 5]
    # The first request of a window resets a whole window later.
    assert answers[0].headers["x-ratelimit-reset-requests"] == "1h0m0s"
    # No key, no key limits: a 401 carries none of them.
    unauthenticated = await gw.data.post("/v1/chat/completions", json=chat_body())
    assert unauthenticated.status == 401
    assert not any(name in unauthenticated.headers for name in REQUEST_HEADERS)
    # Without a token limit there is no -tokens trio.
    plain, _ = await key_factory(rate_limit_requests=10, rate_limit_window_seconds=HOUR)
    answer = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(plain))
    assert answer.status == 200 and remaining(answer) == 9
    assert not any(name in answer.headers for name in TOKEN_HEADERS)


@pytest.mark.parametrize("strategy", ["fixed-window", "sliding-window"])
async def test_the_request_over_the_limit_gets_429_with_retry_after(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any, strategy: str
) -> None:
    gw = await start(gateway_factory, fake, strategy=strategy)
    raw, _ = await key_factory(rate_limit_requests=2, rate_limit_window_seconds=60)
    statuses = []
    for _ in range(2):
        answer = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
        statuses.append(answer.status)
    assert statuses == [200, 200]
    for _ in range(3):
        answer = await gw.data.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth(raw))
        assert answer.status == 429
        assert await answer.json() == {
            "error": {"message": "rate limit reached for requests: 2 per 60s", "type": "rate_limit_error",
                      "code": "rate_limit_exceeded"}
        }
        retry_after = answer.headers["Retry-After"]
        assert retry_after.isdigit() and 1 <= int(retry_after) <= 60
        assert answer.headers["x-ratelimit-limit-requests"] == "2"
        assert answer.headers["x-ratelimit-remaining-requests"] == "0"
        assert DURATION.fullmatch(answer.headers["x-ratelimit-reset-requests"])
    stats = await fake.stats()
    assert stats["requests"] == 2  # the refused ones never reached the provider
    scrape = await (await gw.management.get("/metrics")).text()
    assert 'gateway_rate_limited_total{scope="requests"} 3.0' in scrape


async def test_tokens_are_charged_with_real_usage_stream_and_not(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any
) -> None:
    gw = await start(gateway_factory, fake)
    raw, _ = await key_factory(rate_limit_requests=100, rate_limit_window_seconds=HOUR, tokens_per_minute=10_000)
    first = await gw.data.post("/v1/chat/completions", json=chat_body("one two three"), headers=auth(raw))
    used = (await first.json())["usage"]["total_tokens"]
    assert remaining(first, "tokens") == 10_000  # checked before the call
    body = chat_body("four five six seven", stream=True, stream_options={"include_usage": True})
    second = await gw.data.post("/v1/chat/completions", json=body, headers=auth(raw))
    assert remaining(second, "tokens") == 10_000 - used
    usage_chunk = orjson.loads([p for p in sse_payloads(await second.read()) if p != b"[DONE]"][-1])
    used += usage_chunk["usage"]["total_tokens"]
    # A stream whose client did not ask for usage is charged all the same.
    hidden = chat_body("eight nine", stream=True)
    direct = await fake.session.post(
        f"{fake.url}/chat/completions", json={**hidden, "stream_options": {"include_usage": True}}
    )
    hidden_usage = orjson.loads([p for p in sse_payloads(await direct.read()) if p != b"[DONE]"][-1])["usage"]
    third = await gw.data.post("/v1/chat/completions", json=hidden, headers=auth(raw))
    assert remaining(third, "tokens") == 10_000 - used
    assert b"usage" not in await third.read()
    used += hidden_usage["total_tokens"]
    fourth = await gw.data.get("/v1/models", headers=auth(raw))
    assert remaining(fourth, "tokens") == 10_000 - used
    assert used > 0


async def test_a_spent_token_budget_refuses_until_the_window_frees(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any
) -> None:
    gw = await start(gateway_factory, fake)
    raw, _ = await key_factory(rate_limit_requests=100, rate_limit_window_seconds=HOUR, tokens_per_minute=5)
    first = await gw.data.post("/v1/chat/completions", json=chat_body("a b c d e f g"), headers=auth(raw))
    assert first.status == 200
    assert (await first.json())["usage"]["total_tokens"] > 5  # real usage overshoots what was left
    refused = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
    assert refused.status == 429
    assert (await refused.json())["error"]["message"] == "rate limit reached for tokens: 5 per minute"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert remaining(refused, "tokens") == 0
    # The refused request took no request from the window.
    assert remaining(refused) == 99
    models = await gw.data.get("/v1/models", headers=auth(raw))
    assert models.status == 429


async def test_concurrency_is_released_on_success_error_and_disconnect(
    gateway_factory: Any, fake: FakeUpstream, key_factory: Any
) -> None:
    gw = await start(gateway_factory, fake, env={"UPSTREAM_MAX_RETRIES": "0"})
    raw, record = await key_factory(rate_limit_requests=1000, rate_limit_window_seconds=HOUR, max_concurrent=1)
    key_id = str(record.api_key_id)
    inflight = gw.state.limiter._actor.inflight
    # Success and a provider error both give the slot back.
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))).status == 200
    await fake.script({"status": 500})
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))).status == 500
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))).status == 200
    # A slow stream holds the only slot ...
    await fake.script({"chunks": 200, "chunk_delay_ms": 50})
    session = aiohttp.ClientSession()
    try:
        streaming = await session.post(gw.url("/v1/chat/completions"), json=chat_body(stream=True), headers=auth(raw))
        assert streaming.status == 200
        await streaming.content.readline()
        assert inflight.get(key_id) == 1
        refused = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))
        assert refused.status == 429
        assert "concurrent" in (await refused.json())["error"]["message"]
        # ... until its client hangs up.
        streaming.close()
    finally:
        await session.close()
    await until(lambda: key_id not in inflight)
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))).status == 200
    # A client that gives up while the provider hangs frees it too.
    await fake.script({"hang": True})
    with pytest.raises(asyncio.TimeoutError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as impatient:
            await impatient.post(gw.url("/v1/chat/completions"), json=chat_body(), headers=auth(raw))
    await until(lambda: key_id not in inflight)
    await fake.session.delete(f"{fake.url[:-3]}/_fake/script")
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(raw))).status == 200
    assert key_id not in inflight


async def test_the_per_ip_guard_refuses_a_flood_before_any_database_work(
    gateway_factory: Any, fake: FakeUpstream
) -> None:
    gw = await start(gateway_factory, fake, per_ip="5/minute", per_ip_burst=0)
    # Every key lookup that finds nothing leaves an entry in auth's negative cache; it is
    # cleared once when key invalidation starts listening, so wait for that first.
    await until(lambda: gw.state.auth.listening)
    negative_cache = gw.state.auth._actor._negative
    statuses = []
    for _ in range(30):
        # Each key is new: every one that got past the guard would cost a database lookup.
        answer = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(generate_key()))
        statuses.append(answer.status)
        if answer.status == 429:
            assert answer.headers["Retry-After"].isdigit() and int(answer.headers["Retry-After"]) >= 1
            assert (await answer.json())["error"]["code"] == "rate_limit_exceeded"
            assert "x-ratelimit-limit-requests" not in answer.headers
    assert statuses == [401] * 5 + [429] * 25
    assert len(negative_cache) == 5  # five lookups, not thirty
    assert gw.state.limiter.rejections["ip"] == 25
    # The other authenticated routes are behind the same guard; health checks are not.
    assert (await gw.data.get("/v1/models", headers=auth(generate_key()))).status == 429
    assert (await gw.data.post("/v1/embeddings", json={}, headers=auth(generate_key()))).status == 429
    assert (await gw.data.get("/v1/nowhere")).status == 429
    assert (await gw.data.get("/healthz")).status == 200
    assert (await gw.data.get("/readyz")).status == 200
    assert len(negative_cache) == 5


def test_rate_limit_config_is_checked(tmp_path: Path, fake_url: str = "http://127.0.0.1:9/v1") -> None:
    cases = {
        "rate_limits.per_ip": {"per_ip": "lots"},
        "rate_limits.per_ip:": {"per_ip": "0/second"},
        "rate_limits.storage": {"storage": "mongodb://x"},
        "rate_limits.strategy": {"strategy": "moving-window"},
        "rate_limits.per_ip_burst": {"per_ip_burst": -1},
        "rate_limits.key_prefix": {"key_prefix": "has space"},
        "rate_limits.window": {"window": 3},
    }
    for path, section in cases.items():
        config = tmp_path / "gateway.yaml"
        config.write_text(config_for(fake_url, rate_limits=section))
        settings = load_settings({"GATEWAY_CONFIG": str(config)})
        with pytest.raises(ConfigError) as caught:
            load_config(settings, {})
        assert str(caught.value).startswith(path.rstrip(":")), caught.value
    config = tmp_path / "gateway.yaml"
    config.write_text(config_for(fake_url, rate_limits={"storage": "postgres", "per_ip": "off", "per_ip_burst": 5}))
    limits = load_config(load_settings({"GATEWAY_CONFIG": str(config)}), {}).rate_limits
    assert (limits.storage, limits.per_ip, limits.per_ip_burst, limits.strategy) == ("postgres", "off", 5, "sliding-window")


async def test_the_per_ip_guard_never_throttles_callers_with_valid_keys(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    """One backend (or everything behind one NAT) with valid keys is limited by its keys,
    not by its address; failed attempts from that address are still refused once spent."""
    gw = await start(gateway_factory, fake, per_ip="5/minute", per_ip_burst=0)
    statuses = [
        (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))).status
        for _ in range(40)
    ]
    assert statuses == [200] * 40
    bad = [
        (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(generate_key()))).status
        for _ in range(8)
    ]
    assert bad == [401] * 5 + [429] * 3
    missing = await gw.data.post("/v1/chat/completions", json=chat_body())
    assert missing.status == 429  # a missing key is a failed attempt too, refused before auth
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))).status == 200


async def test_the_generous_cap_still_bounds_everything_from_one_address(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw = await start(gateway_factory, fake, per_ip_all="10/minute", per_ip_burst=0)
    statuses = [(await gw.data.get("/v1/models", headers=auth(api_key))).status for _ in range(25)]
    assert statuses.count(200) == 20 and statuses[-1] == 429  # 10 per minute plus a burst of 10


async def test_forwarded_addresses_count_only_behind_a_trusted_proxy(
    gateway_factory: Any, fake: FakeUpstream
) -> None:
    async def failures_then(gw: Gateway, headers: dict[str, str]) -> list[int]:
        return [
            (await gw.data.get("/v1/models", headers={**auth(generate_key()), **headers})).status
            for _ in range(3)
        ]

    trusting = await start(gateway_factory, fake, per_ip="2/minute", per_ip_burst=0, trusted_proxies=["127.0.0.1/32"])
    assert await failures_then(trusting, {"X-Forwarded-For": "198.51.100.1, 203.0.113.5"}) == [401, 401, 429]
    # Another client behind the same proxy has its own allowance (Forwarded works too).
    assert await failures_then(trusting, {"Forwarded": 'for="203.0.113.6"'}) == [401, 401, 429]
    # IPv6 clients are counted by their /64: a neighbour address shares the window.
    assert await failures_then(trusting, {"X-Forwarded-For": "2001:db8:1:2::1"}) == [401, 401, 429]
    assert await failures_then(trusting, {"X-Forwarded-For": "2001:db8:1:2::ffff"}) == [429, 429, 429]
    # Without trusted proxies the header is the client's word and is ignored.
    plain = await start(gateway_factory, fake, per_ip="2/minute", per_ip_burst=0)
    assert await failures_then(plain, {"X-Forwarded-For": "203.0.113.7"}) == [401, 401, 429]
    assert await failures_then(plain, {"X-Forwarded-For": "203.0.113.8"}) == [429, 429, 429]


def test_trusted_proxies_must_be_cidrs(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    for bad in (["not-an-ip"], "10.0.0.0/8"):
        config.write_text(config_for("http://127.0.0.1:9/v1", rate_limits={"trusted_proxies": bad}))
        with pytest.raises(ConfigError) as caught:
            load_config(load_settings({"GATEWAY_CONFIG": str(config)}), {})
        assert str(caught.value).startswith("rate_limits.trusted_proxies"), caught.value


def test_client_ip_reads_the_chain_from_the_right_and_keys_ipv6_by_64() -> None:
    from aiohttp.test_utils import make_mocked_request

    from gateway.edge.ratelimit import client_ip

    def ip(remote: str, trusted: tuple[str, ...] = (), **headers: str) -> str:
        request = make_mocked_request("GET", "/v1/models", headers=headers).clone(remote=remote)
        return client_ip(request, trusted)

    proxies = ("10.0.0.0/8",)
    assert ip("192.0.2.1") == "192.0.2.1"
    assert ip("192.0.2.1", proxies, **{"X-Forwarded-For": "203.0.113.9"}) == "192.0.2.1"  # untrusted peer
    # A client-forged entry on the left does not win over what our proxies appended.
    assert ip("10.0.0.2", proxies, **{"X-Forwarded-For": "1.2.3.4, 203.0.113.9, 10.0.0.7"}) == "203.0.113.9"
    assert ip("10.0.0.2", proxies, Forwarded='for=198.51.100.4;proto=https, for="10.0.0.7:80"') == "198.51.100.4"
    assert ip("10.0.0.2", proxies, Forwarded='for="[2001:db8:a:b::5]:443"') == "2001:db8:a:b::/64"
    assert ip("10.0.0.2", proxies, **{"X-Forwarded-For": "unknown"}) == "10.0.0.2"
    assert ip("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert ip("::ffff:192.0.2.8") == "192.0.2.8"
