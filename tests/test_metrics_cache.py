"""The response cache in ``GET /metrics``: hits, misses and bypasses, sizes, semantic
similarity, and a hit never counted as an upstream call or as tokens used upstream."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.core.usage import CallRecord, Usage
from gateway.observability.metrics import GatewayMetrics
from gateway.testing import fake_llm
from tests.cache_helpers import ask, cached_config, settle
from tests.conftest import FakeUpstream, Gateway, chat_body
from tests.test_metrics import parse, scrape, total, value


async def test_hits_misses_and_bypasses_are_counted_and_a_hit_is_no_upstream_call(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw: Gateway = await gateway_factory(config_yaml=cached_config(fake.url))
    prompt = fake_llm.prompt_tokens(chat_body("what is a cache")["messages"])
    resp, _ = await ask(gw, api_key)  # miss: the provider answers, the answer is stored
    assert resp.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    resp, _ = await ask(gw, api_key)
    assert resp.headers["x-gateway-cache"] == "hit"
    resp, _ = await ask(gw, api_key, headers={"Cache-Control": "no-cache"})
    assert resp.headers["x-gateway-cache"] == "bypass"
    for _ in range(2):  # a stream: stored, then replayed
        resp, _ = await ask(gw, api_key, stream=True)
        assert resp.status == 200
        await settle(gw, 2)
    assert resp.headers["x-gateway-cache"] == "hit"

    _, samples = await scrape(gw)
    assert value(samples, "gateway_cache_requests_total", result="hit") == 2
    assert value(samples, "gateway_cache_requests_total", result="miss") == 2
    assert value(samples, "gateway_cache_requests_total", result="bypass") == 1
    # Three calls reached the provider (two misses and the bypass); the hits did not.
    assert total(samples, "gateway_upstream_requests_total") == 3
    assert total(samples, "gateway_upstream_requests_total", provider="none") == 0
    assert total(samples, "gateway_upstream_duration_seconds_count") == 3
    assert total(samples, "gateway_time_to_first_token_seconds_count") == 1  # the live stream only
    assert value(samples, "gateway_tokens_total", model="cached", type="input") == 3 * prompt
    assert value(samples, "gateway_cache_hit_tokens_total", type="input") == 2 * prompt
    assert value(samples, "gateway_cache_hit_tokens_total", type="output") > 0
    # Every call, hits included, is still an HTTP request of the route.
    assert value(samples, "gateway_requests_total", route="/v1/chat/completions", status="200") == 5
    assert value(samples, "gateway_cache_entries") == 2
    stats = gw.state.cache.stats()
    assert value(samples, "gateway_cache_bytes") == stats["bytes"] > 0
    assert value(samples, "gateway_cache_max_bytes") == stats["max_bytes"]
    assert value(samples, "gateway_cache_semantic_hits_total") == 0


async def test_semantic_searches_feed_the_similarity_histogram(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    pytest.importorskip("numpy", reason="vectors from a deployment are compared with numpy here")
    doc = yaml.safe_load(cached_config(
        fake.url, {"mode": "semantic", "threshold": 0.99}, semantic={"embedder": "embedder", "max_wait_ms": 5000},
    ))
    doc["models"].insert(0, {"name": "embedder", "deployments": [{"provider": "fake", "model": "mock-embedding"}]})
    gw: Gateway = await gateway_factory(config_yaml=yaml.safe_dump(doc))
    seen: list[tuple[float, bool]] = []
    gw.state.cache.similarity_listeners.append(lambda best, hit: seen.append((best, hit)))
    await ask(gw, api_key, "first question")
    await settle(gw, 1)
    resp, _ = await ask(gw, api_key, "an unrelated question")
    assert resp.headers["x-gateway-cache"] == "miss"
    [(best, hit)] = seen  # the fake's vectors of these two texts are not alike
    assert not hit and 0 < best < 0.99
    _, samples = await scrape(gw)
    assert value(samples, "gateway_cache_similarity_count", result="miss") == 1
    assert value(samples, "gateway_cache_similarity_sum", result="miss") == pytest.approx(best)
    assert value(samples, "gateway_cache_similarity_count", result="hit") == 0


def test_similarity_buckets_and_hit_records_without_a_gateway() -> None:
    metrics = GatewayMetrics(process_metrics=False)
    metrics.cache_similarity(0.97, True)
    metrics.cache_similarity(0.42, False)
    hit = CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model="m", cache="hit")
    hit.usage = Usage(10, 20, cost_usd=0.0)
    metrics.observe_call(hit)
    samples = parse(metrics.render_now().decode())
    assert value(samples, "gateway_cache_similarity_bucket", result="hit", le="0.96") == 0
    assert value(samples, "gateway_cache_similarity_bucket", result="hit", le="0.97") == 1
    assert value(samples, "gateway_cache_similarity_bucket", result="miss", le="0.5") == 1
    assert value(samples, "gateway_cache_hit_tokens_total", type="input") == 10
    assert value(samples, "gateway_cache_hit_tokens_total", type="output") == 20
    assert total(samples, "gateway_upstream_requests_total") == 0
    assert total(samples, "gateway_tokens_total") == 0
    assert total(samples, "gateway_token_usage_count") == 0
    # No cache watched (no gateway): no cache families at all, rather than zeros.
    assert not [name for name, _ in samples if name.startswith("gateway_cache_requests")]
