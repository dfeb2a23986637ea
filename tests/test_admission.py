"""The admission gate (gateway/http/admission.py) on an in-process gateway: the in-flight
bound answers 503 ``overloaded`` at once, health routes are never gated, the drain
refuses new work, and the abort ends what is left in the contract's shape."""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import pytest

from gateway.core.config import ConfigError, load_settings
from gateway.http.admission import ADMISSION, SHUTDOWN, AdmissionGate, default_max_in_flight, is_shutdown
from tests.conftest import FakeUpstream, auth, chat_body, config_for, sse_payloads


async def test_requests_past_the_bound_get_a_fast_503_and_health_still_answers(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory(latency_ms=800)
    gw = await gateway_factory(env={"MAX_IN_FLIGHT": "2"}, config_yaml=config_for(fake.url))
    slow = [asyncio.ensure_future(gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key)))
            for _ in range(2)]
    for _ in range(100):
        if gw.data.app[ADMISSION].in_flight == 2:
            break
        await asyncio.sleep(0.01)
    shed = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert shed.status == 503 and shed.headers["Retry-After"] == "1"
    assert (await shed.json())["error"] == {
        "message": "gateway overloaded: 2 requests in flight", "type": "service_unavailable", "code": "overloaded",
    }
    assert "x-request-id" in shed.headers
    assert (await gw.data.get("/healthz")).status == 200
    assert [r.status for r in await asyncio.gather(*slow)] == [200, 200]
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))).status == 200
    assert gw.data.app[ADMISSION].shed == 1 and gw.data.app[ADMISSION].in_flight == 0
    exposition = await (await gw.management.get("/metrics")).text()
    assert "gateway_admission_shed_total 1.0" in exposition
    assert "gateway_admission_limit 2.0" in exposition


async def test_draining_refuses_new_work_and_the_abort_ends_streams_with_one_error_event(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory(chunk_delay_ms=200)
    gw = await gateway_factory(config_yaml=config_for(fake.url))
    gate: AdmissionGate = gw.data.app[ADMISSION]
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("w " * 30, stream=True), headers=auth(api_key))
    await resp.content.readuntil(b"\n\n")
    gate.draining = True
    refused = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))
    assert refused.status == 503 and (await refused.json())["error"]["code"] == "shutting_down"
    assert gate.abort() == 1
    payloads = sse_payloads(await resp.read())
    assert b"[DONE]" not in payloads and b'"code":"shutting_down"' in payloads[-1]
    assert await gate.wait_idle(2)


def test_is_shutdown_tells_the_abort_from_a_client_gone() -> None:
    assert is_shutdown(asyncio.CancelledError(SHUTDOWN))
    assert not is_shutdown(asyncio.CancelledError())
    assert not is_shutdown(ValueError(SHUTDOWN))


def test_the_default_bound_follows_the_open_file_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = max(64, min(4096, (soft - 256) // 2)) if soft != resource.RLIM_INFINITY else 4096
    assert default_max_in_flight() == expected


def test_settings_of_the_edge() -> None:
    settings = load_settings({"MAX_IN_FLIGHT": "12", "CLIENT_IDLE_TIMEOUT_SECONDS": "2.5"})
    assert (settings.max_in_flight, settings.client_idle_timeout) == (12, 2.5)
    assert load_settings({}).max_in_flight is None
    with pytest.raises(ConfigError, match="MAX_IN_FLIGHT"):
        load_settings({"MAX_IN_FLIGHT": "0"})
    with pytest.raises(ConfigError, match="CLIENT_IDLE_TIMEOUT_SECONDS"):
        load_settings({"CLIENT_IDLE_TIMEOUT_SECONDS": "soon"})


async def test_the_messages_route_is_shed_in_anthropics_shape(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory(latency_ms=800)
    gw = await gateway_factory(env={"MAX_IN_FLIGHT": "1"}, config_yaml=config_for(fake.url))
    slow = asyncio.ensure_future(gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key)))
    for _ in range(100):
        if gw.data.app[ADMISSION].in_flight == 1:
            break
        await asyncio.sleep(0.01)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    shed = await gw.data.post("/v1/messages", json=body, headers={"x-api-key": api_key})
    # Anthropic's own overload answer, so the anthropic SDK raises OverloadedError and retries.
    assert shed.status == 529 and shed.headers["Retry-After"] == "1"
    assert (await shed.json()) == {"type": "error", "error": {"type": "overloaded_error",
                                                              "message": "gateway overloaded: 1 requests in flight"}}
    assert (await slow).status == 200
