"""``GET /metrics``: values after known traffic, bounded labels, one registry per gateway."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.usage import CallRecord, Usage
from gateway.observability.metrics import (
    MAX_MODEL_LABELS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    BoundedLabel,
    GatewayMetrics,
)
from gateway.testing import fake_llm
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, pair_config, sse_payloads

#: Contract §9: the names every gateway exposes.
CONTRACT_NAMES = (
    "gateway_requests_total", "gateway_request_duration_seconds", "gateway_upstream_requests_total",
    "gateway_upstream_duration_seconds", "gateway_time_to_first_token_seconds", "gateway_tokens_total",
    "gateway_cost_usd_total", "gateway_rate_limited_total", "gateway_circuit_state",
    "gateway_actor_mailbox_size", "gateway_billing_pending_events", "gateway_auth_failures_total",
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 when absent (a counter never incremented)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def scrape(gw: Gateway) -> tuple[str, Samples]:
    resp = await gw.management.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    return text, parse(text)


async def test_metrics_after_known_traffic(gateway: Gateway, fake: FakeUpstream, api_key: str) -> None:
    expected_in = expected_out = 0
    for i in range(3):
        resp = await gateway.data.post("/v1/chat/completions", json=chat_body(f"count me {i}"), headers=auth(api_key))
        usage = (await resp.json())["usage"]
        expected_in += usage["prompt_tokens"]
        expected_out += usage["completion_tokens"]
    for i in range(2):
        body = chat_body(f"stream me please {i}", stream=True, stream_options={"include_usage": True})
        resp = await gateway.data.post("/v1/chat/completions", json=body, headers=auth(api_key))
        chunks = [orjson.loads(p) for p in sse_payloads(await resp.read()) if p != b"[DONE]"]
        usage = next(c["usage"] for c in chunks if c.get("usage"))
        expected_in += usage["prompt_tokens"]
        expected_out += usage["completion_tokens"]

    assert await gateway.state.billing.flush()  # so the billing backlog reads 0 below
    text, samples = await scrape(gateway)
    for name in CONTRACT_NAMES:
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    chat = "/v1/chat/completions"
    assert value(samples, "gateway_requests_total", route=chat, status="200") == 5
    assert value(samples, "gateway_request_duration_seconds_count", route=chat) == 5
    assert value(samples, "gateway_tokens_total", model="test-model", type="input") == expected_in
    assert value(samples, "gateway_tokens_total", model="test-model", type="output") == expected_out
    assert value(samples, "gateway_token_usage_count", type="output") == 5
    assert value(samples, "gateway_token_usage_sum", type="output") == expected_out
    assert value(samples, "gateway_upstream_requests_total", provider="fake", model="test-model", outcome="ok") == 5
    assert value(samples, "gateway_upstream_duration_seconds_count", provider="fake", model="test-model") == 5
    # Time to first token is observed for the streams only.
    assert value(samples, "gateway_time_to_first_token_seconds_count", provider="fake", model="test-model") == 2
    assert value(samples, "gateway_time_to_first_token_seconds_sum", provider="fake", model="test-model") > 0
    assert value(samples, "gateway_overhead_seconds_count", stream="false") == 3
    assert value(samples, "gateway_overhead_seconds_count", stream="true") == 2
    assert value(samples, "gateway_requests_in_flight", route=chat) == 0
    # Live actor state is read at scrape time.
    assert value(samples, "gateway_actor_mailbox_size", actor="auth") == 0
    assert value(samples, "gateway_actor_restarts_total", actor="auth") == 0
    assert value(samples, "gateway_actor_up", actor="auth") == 1
    assert value(samples, "gateway_billing_pending_events") == 0
    # The buckets advised for LLM workloads.
    ttft_bounds = {float(dict(ls)["le"]) for (n, ls), _ in samples.items() if n == "gateway_time_to_first_token_seconds_bucket"}
    assert ttft_bounds == {*TTFT_BUCKETS, float("inf")}
    assert min(ttft_bounds) == 0.001 and max(ttft_bounds - {float("inf")}) == 10.0
    token_bounds = {float(dict(ls)["le"]) for (n, ls), _ in samples.items() if n == "gateway_token_usage_bucket"}
    assert token_bounds == {*TOKEN_BUCKETS, float("inf")} and 4.0**5 in token_bounds
    # No key or key id ever becomes a label.
    assert api_key not in text and api_key[:12] not in text
    # The scrape itself is counted on the management plane.
    _, again = await scrape(gateway)
    assert value(again, "gateway_requests_total", route="/metrics", status="200") >= 1


async def test_cost_reported_by_the_provider_is_counted(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    fake = await fake_factory(cost=True)
    gw = await gateway_factory(config_yaml=config_for(fake.url))
    spent = 0.0
    for _ in range(2):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body("what does it cost"), headers=auth(api_key))
        spent += (await resp.json())["cost"]["usd"]
    _, samples = await scrape(gw)
    assert spent > 0
    assert value(samples, "gateway_cost_usd_total", model="test-model") == pytest.approx(spent)


async def test_auth_failures_are_counted_by_reason(gateway: Gateway, key_factory: Any, db_pool: Any) -> None:
    unknown = "llmg_" + "q" * 43
    revoked_raw, revoked = await key_factory(name="revoked")
    await db_pool.execute("UPDATE api_keys SET revoked_at = now(), is_active = false WHERE api_key_id = $1", revoked.api_key_id)
    expired_raw, expired = await key_factory(name="expired")
    assert (await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=auth(expired_raw))).status == 200
    await db_pool.execute("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE api_key_id = $1", expired.api_key_id)
    await asyncio.sleep(0.3)  # the NOTIFY evicts the cached key

    cases = [({}, "missing"), (auth("short"), "malformed"), (auth(unknown), "unknown"),
             (auth(unknown), "unknown"), (auth(revoked_raw), "revoked"), (auth(expired_raw), "expired")]
    bodies = set()
    for headers, _ in cases:
        resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert resp.status == 401
        bodies.add(await resp.read())
    assert len(bodies) == 1  # one answer for every reason
    _, samples = await scrape(gateway)
    assert value(samples, "gateway_auth_failures_total", reason="missing") == 1
    assert value(samples, "gateway_auth_failures_total", reason="malformed") == 1
    assert value(samples, "gateway_auth_failures_total", reason="revoked") == 1
    assert value(samples, "gateway_auth_failures_total", reason="unknown") == 2
    assert value(samples, "gateway_auth_failures_total", reason="expired") == 1
    assert value(samples, "gateway_requests_total", route="/v1/chat/completions", status="401") == len(cases)


async def test_retries_and_failovers_are_counted(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    first, second = await fake_factory(), await fake_factory()
    config = pair_config(first.url, second.url)
    gw = await gateway_factory(env={"UPSTREAM_MAX_RETRIES": "1"}, config_yaml=config)
    # first: 503 then 503 again (retries exhausted, 5xx) → fail over to second.
    await first.script({"status": 503}, {"status": 503})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="pair"), headers=auth(api_key))
    assert resp.status == 200
    _, samples = await scrape(gw)
    assert value(samples, "gateway_upstream_retries_total", provider="first", reason="503") == 1
    assert value(samples, "gateway_upstream_failovers_total", model="pair") == 1
    assert value(samples, "gateway_upstream_requests_total", provider="second", model="m2", outcome="ok") == 1


async def test_cancelled_stream_is_counted_once(gateway_factory: Any, fake_factory: Any, api_key: str) -> None:
    fake = await fake_factory(chunk_delay_ms=200, chunks=20)
    gw = await gateway_factory(config_yaml=config_for(fake.url))
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth(api_key))
    await resp.content.readline()
    resp.close()  # hang up mid-stream
    for _ in range(100):
        _, samples = await scrape(gw)
        if total(samples, "gateway_upstream_requests_total", outcome="cancelled") == 1:
            break
        await asyncio.sleep(0.05)
    assert total(samples, "gateway_upstream_requests_total", outcome="cancelled") == 1
    assert value(samples, "gateway_requests_total", route="/v1/chat/completions", status="499") == 1
    assert value(samples, "gateway_requests_in_flight", route="/v1/chat/completions") == 0


async def test_each_gateway_has_its_own_registry(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    busy = await gateway_factory(config_yaml=config_for(fake.url))
    idle = await gateway_factory(config_yaml=config_for(fake.url))
    assert busy.state.metrics.registry is not idle.state.metrics.registry
    await busy.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    _, busy_samples = await scrape(busy)
    _, idle_samples = await scrape(idle)
    assert total(busy_samples, "gateway_tokens_total") > 0
    assert total(idle_samples, "gateway_tokens_total") == 0
    assert value(idle_samples, "gateway_requests_total", route="/v1/chat/completions", status="200") == 0


async def test_unmatched_paths_share_one_route_label(gateway: Gateway) -> None:
    for i in range(5):
        assert (await gateway.data.get(f"/no/such/path/{i}")).status == 404
    _, samples = await scrape(gateway)
    assert value(samples, "gateway_requests_total", route="unmatched", status="404") == 5
    assert not any("/no/such" in dict(ls).get("route", "") for (_, ls) in samples)


def _record(model: str, **extra: Any) -> CallRecord:
    return CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model=model,
                      served_model=model, provider="p", usage=Usage(1, 1), **extra)


def test_durations_on_bucket_bounds_and_odd_values_land_as_the_library_puts_them() -> None:
    """The per-request series hold loop-owned values: their buckets and sums must be the
    library's own (a value on a bound is in that bucket; NaN goes into the sum and no bucket,
    so not into the count either)."""
    metrics = GatewayMetrics(process_metrics=False)
    for seconds in (0.001, 0.0025, 0.0025, 1e9, float("nan")):
        metrics.request_done("/v1/chat/completions", 200, seconds)
    metrics.request_done("/v1/chat/completions", 429, 0.004)
    samples = parse(metrics.render_now().decode())
    bucket = "gateway_request_duration_seconds_bucket"
    route = "/v1/chat/completions"
    assert value(samples, bucket, route=route, le="0.001") == 1
    assert value(samples, bucket, route=route, le="0.0025") == 3
    assert value(samples, bucket, route=route, le="0.005") == 4
    assert value(samples, bucket, route=route, le="327.68") == 4
    assert value(samples, bucket, route=route, le="+Inf") == 5
    assert value(samples, "gateway_request_duration_seconds_count", route=route) == 5
    assert str(value(samples, "gateway_request_duration_seconds_sum", route=route)) == "nan"
    assert value(samples, "gateway_requests_total", route=route, status="200") == 5
    assert value(samples, "gateway_requests_total", route=route, status="429") == 1


def test_model_labels_are_bounded() -> None:
    metrics = GatewayMetrics(process_metrics=False)
    for i in range(MAX_MODEL_LABELS + 50):
        metrics.observe_call(_record(f"client-chosen-{i}"))
    samples = parse(metrics.render_now().decode())
    models = {dict(ls)["model"] for (n, ls) in samples if n == "gateway_tokens_total"}
    assert len(models) == MAX_MODEL_LABELS + 1 and "other" in models
    assert value(samples, "gateway_tokens_total", model="other", type="input") == 50
    label = BoundedLabel(2)
    assert [label(v) for v in ("a", "b", "c", "a", None)] == ["a", "b", "other", "a", "none"]


def test_hooks_for_breakers_billing_and_limiter() -> None:
    metrics = GatewayMetrics(process_metrics=False)
    circuits: dict[str, Any] = {"fake/a": "closed", "fake/b": "open"}
    pending = [7]
    metrics.watch_circuits(lambda: circuits)
    metrics.watch_billing(lambda: pending[0])
    metrics.watch_limiter(lambda: True)
    metrics.rate_limited("key")
    metrics.rate_limited("key")
    metrics.rate_limited("ip")
    metrics.unpriced("mystery")
    samples = parse(metrics.render_now().decode())
    assert value(samples, "gateway_circuit_state", deployment="fake/a") == 0
    assert value(samples, "gateway_circuit_state", deployment="fake/b") == 2
    assert value(samples, "gateway_billing_pending_events") == 7
    assert value(samples, "gateway_limiter_degraded") == 1
    assert value(samples, "gateway_rate_limited_total", scope="key") == 2
    assert value(samples, "gateway_rate_limited_total", scope="ip") == 1
    assert value(samples, "gateway_unpriced_calls_total", model="mystery") == 1
    # A breaker changing state shows at the next scrape; a purged one disappears.
    circuits["fake/a"] = "half-open"
    circuits["fake/b"] = 0
    pending[0] = 0
    samples = parse(metrics.render_now().decode())
    assert value(samples, "gateway_circuit_state", deployment="fake/a") == 1
    assert value(samples, "gateway_circuit_state", deployment="fake/b") == 0
    assert value(samples, "gateway_billing_pending_events") == 0
    del circuits["fake/a"]
    samples = parse(metrics.render_now().decode())
    assert ("gateway_circuit_state", frozenset({("deployment", "fake/a")})) not in samples


async def test_prompt_token_estimate_matches_fake(gateway: Gateway, api_key: str) -> None:
    """A stream the client did not ask usage for is still counted, from the hidden usage chunk."""
    body = chat_body("tokens without asking", stream=True)
    resp = await gateway.data.post("/v1/chat/completions", json=body, headers=auth(api_key))
    await resp.read()
    _, samples = await scrape(gateway)
    assert value(samples, "gateway_tokens_total", model="test-model", type="input") == fake_llm.prompt_tokens(body["messages"])


async def test_concurrent_scrapes_share_one_rendering() -> None:
    metrics = GatewayMetrics(process_metrics=False)
    metrics.observe_call(_record("m"))
    first, second = await asyncio.gather(metrics.render(), metrics.render())
    assert first is second  # one rendering in the worker thread, two answers
    third = await metrics.render()
    assert third is not first and third == first


async def test_circuit_state_follows_the_breaker(gateway_factory: Any, fake: FakeUpstream, api_key: str) -> None:
    config = config_for(fake.url, circuit_breaker={"fail_max": 2, "reset_timeout_seconds": 60})
    gw = await gateway_factory(env={"UPSTREAM_MAX_RETRIES": "0"}, config_yaml=config)
    _, samples = await scrape(gw)
    assert value(samples, "gateway_circuit_state", deployment="fake/*") == 0
    await fake.script({"status": 500}, {"status": 500})
    for _ in range(2):
        resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
        assert resp.status == 500
    for _ in range(100):  # the breaker actor folds reports in asynchronously
        _, samples = await scrape(gw)
        if value(samples, "gateway_circuit_state", deployment="fake/*") == 2:
            break
        await asyncio.sleep(0.02)
    assert value(samples, "gateway_circuit_state", deployment="fake/*") == 2
    assert value(samples, "gateway_actor_up", actor="breaker") == 1
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert resp.status == 503  # circuit_open
    _, samples = await scrape(gw)
    assert value(samples, "gateway_requests_total", route="/v1/chat/completions", status="503") == 1


async def test_metrics_token_guards_the_scrape(gateway_factory: Any, fake: FakeUpstream) -> None:
    gw = await gateway_factory(env={"METRICS_TOKEN": "scrape-secret"}, config_yaml=config_for(fake.url))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "scrape-secret"}):
        resp = await gw.management.get("/metrics", headers=headers)
        assert resp.status == 401, headers
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        error = (await resp.json())["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_metrics_token")
    resp = await gw.management.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})
    assert resp.status == 200 and "gateway_requests_total" in await resp.text()
    assert (await gw.management.get("/healthz")).status == 200  # health stays open


async def test_metrics_need_no_token_when_none_is_set(gateway: Gateway) -> None:
    assert (await gateway.management.get("/metrics")).status == 200


def _observe_call_reference(metrics: GatewayMetrics, record: CallRecord, now: float) -> None:
    """GatewayMetrics.observe_call as it was before its series were remembered per call kind."""
    from gateway.observability.metrics import CALL_OUTCOMES, OVERFLOW_LABEL, cost_of

    m: Any = metrics
    for policy, action, direction in record.guardrails:
        m.guardrail_decisions.labels(policy, action, direction).inc()
    if record.cache == "hit":
        m._observe_hit(record)
        return
    requested = m.model_label(record.requested_model)
    provider = record.provider or "none"
    served = m.model_label(record.served_model or record.requested_model)
    outcome = record.outcome if record.outcome in CALL_OUTCOMES else OVERFLOW_LABEL
    m._upstream[provider, served, outcome].inc()
    if record.upstream_started_at is not None:
        waited = now - record.upstream_started_at if record.stream else record.upstream_time
        m._upstream_duration[provider, served].observe(waited)
        if record.received_at is not None:
            if record.stream:
                overhead = record.upstream_started_at - record.received_at
            else:
                overhead = (now - record.received_at) - record.upstream_time
            m._overhead[record.stream].observe(max(0.0, overhead))
    if record.ttft is not None:
        m._ttft[provider, served].observe(record.ttft)
        output = record.usage.completion_tokens
        if output > 1 and record.latency > record.ttft:
            m._tpot[provider, served].observe((record.latency - record.ttft) / (output - 1))
    usage = record.usage
    if usage.prompt_tokens or usage.completion_tokens:
        m._tokens[requested, "input"].inc(usage.prompt_tokens)
        m._tokens[requested, "output"].inc(usage.completion_tokens)
        m._token_usage["input"].observe(usage.prompt_tokens)
        m._token_usage["output"].observe(usage.completion_tokens)
    cost = cost_of(record)
    if cost:
        m._cost[requested].inc(cost)
    elif record.cost_source == "unpriced":
        m.unpriced(record.requested_model)
    if record.failovers:
        m._failovers[requested].inc(record.failovers)


@pytest.mark.parametrize("remembered", [4096, 3])
def test_observe_call_exposes_what_it_exposed_before_byte_for_byte(monkeypatch: pytest.MonkeyPatch, remembered: int) -> None:
    # Series remembered per kind of call (and, past the bound, worked out per call): the
    # exposition, series order included, is the one the old listener's gave.
    import random
    from types import SimpleNamespace

    from gateway.observability import metrics as metrics_module

    now = 1000.0
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(monotonic=lambda: now))
    monkeypatch.setattr(metrics_module, "MAX_CALL_SERIES", remembered)
    monkeypatch.setattr(metrics_module, "MAX_MODEL_LABELS", 6)
    rng = random.Random(9)
    new, old = GatewayMetrics(process_metrics=False), GatewayMetrics(process_metrics=False)
    new.model_label = BoundedLabel(6)
    old.model_label = BoundedLabel(6)
    models = [f"model-{i}" for i in range(9)]
    for _ in range(3000):
        usage = Usage(prompt_tokens=rng.choice([0, 0, 3, 14, 5000]), completion_tokens=rng.choice([0, 1, 9, 700]))
        record = CallRecord(
            request_id="r", api_key_id=None, subject_id=None, requested_model=rng.choice(models),
            served_model=rng.choice([None, *models[:4]]), provider=rng.choice([None, "", "a", "b"]),
            outcome=rng.choice(["ok", "ok", "provider_error", "cut", "weird"]), stream=rng.random() < 0.5,
            usage=usage, ttft=rng.choice([None, 0.02, 0.3]), latency=rng.choice([0.001, 0.5, 2.0]),
            failovers=rng.choice([0, 0, 1]), received_at=rng.choice([None, now - 0.01]),
            upstream_started_at=rng.choice([None, now - 0.005]), upstream_time=rng.choice([0.0, 0.004]),
            cost_usd=rng.choice([0.0, 1e-05, 0.25]), cost_source=rng.choice(["price", "unpriced", "none"]),
            cache=rng.choice([None, None, None, "miss", "hit"]),
            guardrails=rng.choice([(), (("pii", "redacted", "input"),)]),
        )
        new.observe_call(record)
        _observe_call_reference(old, record, now)
    assert new.render_now() == old.render_now()
