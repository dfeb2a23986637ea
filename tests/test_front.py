"""The front of the data plane (gateway/edge/front.py): its steps, as one middleware,
keep the order they had as six: a preflight is answered before admission, a refusal is
observed and readable by a page, a shutdown's abort is answered in the route's shape,
the generation pin holds until the handler returns, and the access line keeps every
field in its order."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from typing import Any

import orjson
import pytest

from gateway.http.admission import ADMISSION, AdmissionGate
from gateway.http.middleware import new_request_id
from gateway.observability.logs import ACCESS_LOGGER, JsonFormatter
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, until

ORIGIN = {"Origin": "https://app.example"}
#: The access line of a whole chat call, key by key, in order (README "Logs").
CHAT_ACCESS_LINE = [
    "ts", "level", "logger", "msg", "request_id", "method", "route", "path", "status", "latency_ms", "client_ip",
    "key_id", "model", "served_model", "provider", "stream", "outcome", "input_tokens", "output_tokens",
    "tokens_estimated", "cost_usd", "ttft_ms", "retries", "failovers", "error",
]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    formatter = JsonFormatter()
    return [orjson.loads(formatter.format(r)) for r in caplog.records if r.name == ACCESS_LOGGER]


async def test_a_preflight_is_answered_before_admission_and_a_refusal_is_observed_and_readable(
    gateway_factory: Any, fake: FakeUpstream, api_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await gateway_factory(config_yaml=config_for(fake.url))
    gate: AdmissionGate = gw.data.app[ADMISSION]
    caplog.set_level(logging.INFO)
    gate.draining = True
    try:
        preflight = await gw.data.options("/v1/chat/completions", headers={
            **ORIGIN, "Access-Control-Request-Method": "POST", "x-request-id": "pre-1",
        })
        assert preflight.status == 204 and preflight.headers["Access-Control-Allow-Origin"] == "*"
        assert preflight.headers["x-request-id"] == "pre-1"
        refused = await gw.data.post("/v1/chat/completions", json=chat_body(),
                                     headers={**auth(api_key), **ORIGIN, "x-request-id": "drain-1"})
        assert refused.status == 503 and (await refused.json())["error"]["code"] == "shutting_down"
        assert refused.headers["Access-Control-Allow-Origin"] == "*" and refused.headers["Retry-After"] == "1"
        assert refused.headers["x-request-id"] == "drain-1"
        assert refused.headers["X-Content-Type-Options"] == "nosniff"
        assert "x-ratelimit-limit-requests" not in refused.headers  # refused before the key was checked
    finally:
        gate.draining = False
    lines = {line["request_id"]: line for line in access_lines(caplog)}
    assert lines["pre-1"]["status"] == 204 and lines["drain-1"]["status"] == 503
    exposition = await (await gw.management.get("/metrics")).text()
    assert 'gateway_requests_total{route="/v1/chat/completions",status="503"} 1.0' in exposition


async def test_the_abort_answers_a_whole_request_in_its_routes_shape(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory(latency_ms=2000)
    gw = await gateway_factory(config_yaml=config_for(fake.url))
    gate: AdmissionGate = gw.data.app[ADMISSION]
    chat = asyncio.ensure_future(gw.data.post(
        "/v1/chat/completions", json=chat_body(), headers={**auth(api_key), "x-request-id": "abort-chat"}))
    messages = asyncio.ensure_future(gw.data.post(
        "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": api_key, "x-request-id": "abort-messages"}))
    await until(lambda: gate.in_flight == 2)
    gate.draining = True
    assert gate.abort() == 2
    chat_answer, messages_answer = await asyncio.gather(chat, messages)
    assert chat_answer.status == 503 and chat_answer.headers["Retry-After"] == "1"
    assert (await chat_answer.json())["error"] == {
        "message": "gateway shutting down; retry the request", "type": "service_unavailable", "code": "shutting_down",
    }
    assert chat_answer.headers["x-request-id"] == "abort-chat"
    assert messages_answer.status == 529 and messages_answer.headers["x-request-id"] == "abort-messages"
    assert (await messages_answer.json()) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "gateway shutting down; retry the request"},
    }
    assert await gate.wait_idle(2)


async def test_a_request_holds_its_config_generation_until_its_handler_returns(
    gateway_factory: Any, fake_factory: Any, api_key: str
) -> None:
    fake: FakeUpstream = await fake_factory(latency_ms=300)
    gw = await gateway_factory(config_yaml=config_for(fake.url))
    pools = gw.state.provider_pools
    generation = pools.generation
    call = asyncio.ensure_future(gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key)))
    await until(lambda: pools.in_flight(generation) == 1)
    assert (await call).status == 200
    assert pools.in_flight(generation) == 0


async def test_the_access_line_of_a_chat_call_has_every_field_in_order(
    gateway: Gateway, api_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(),
                                   headers={**auth(api_key), "x-request-id": "order-1"})
    assert resp.status == 200 and resp.headers["x-request-id"] == "order-1"
    [line] = [line for line in access_lines(caplog) if line["request_id"] == "order-1"]
    assert list(line) == CHAT_ACCESS_LINE


def test_a_new_request_id_is_32_hex_digits_of_fresh_random_bits() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    state = random.getstate()
    try:
        made = new_request_id()
        random.setstate(state)
        assert made == f"{random.getrandbits(128):032x}"  # the same text as uuid4().hex's shape, leading zeros kept
    finally:
        random.setstate(state)


def test_the_first_request_id_is_request_id_of() -> None:
    # The front's first step skips the lookup that would miss on a request with nothing
    # stored; the id is the one request_id_of gives, and kept for it.
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from gateway.http.middleware import first_request_id, request_id_of

    for sent in (None, "client.id:1-2_3", "has space", "x" * 129):
        headers = {} if sent is None else {"x-request-id": sent}
        fresh, reference = make_mocked_request("GET", "/", headers=headers), make_mocked_request("GET", "/", headers=headers)
        state = random.getstate()
        rid = first_request_id(fresh)
        random.setstate(state)
        assert rid == request_id_of(reference) and request_id_of(fresh) == rid
    stored = make_mocked_request("GET", "/")
    stored[web.RequestKey("other", int)] = 1
    assert first_request_id(stored) == request_id_of(stored)  # something stored: looked up
    known = request_id_of(stored)
    assert first_request_id(stored) == known


async def test_the_request_id_is_echoed_when_plain_and_replaced_when_not(gateway: Gateway) -> None:
    plain = await gateway.data.get("/healthz", headers={"x-request-id": "client.id:1-2_3"})
    assert plain.headers["x-request-id"] == "client.id:1-2_3"
    for refused in ("has space", "x" * 129, "semi;colon"):
        answer = await gateway.data.get("/healthz", headers={"x-request-id": refused})
        assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"]), refused
    assert re.fullmatch(r"[0-9a-f]{32}", (await gateway.data.get("/healthz")).headers["x-request-id"])
