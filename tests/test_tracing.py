"""Traces: GenAI spans exported over real OTLP/HTTP, W3C context in and out, content capture."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from actors.runtime import Actor, Supervisor
from gateway.core.config import load_settings
from gateway.observability.tracing import Tracing
from tests.conftest import FakeUpstream, auth, chat_body, config_for, pair_config, sse_payloads
from tests.otlp import OtlpReceiver, ReceivedSpan

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
PROMPT = "a very secret prompt about zebras"


@pytest.fixture
async def otlp() -> AsyncIterator[OtlpReceiver]:
    receiver = await OtlpReceiver.start()
    yield receiver
    await receiver.close()


async def traced_gateway(gateway_factory: Any, fake: FakeUpstream, otlp: OtlpReceiver, **env: str) -> Any:
    return await gateway_factory(
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_SERVICE_NAME": "gw-under-test", **env},
        config_yaml=config_for(fake.url),
    )


async def exported(gw: Any, otlp: OtlpReceiver, count: int) -> list[ReceivedSpan]:
    assert await gw.state.tracing.flush()
    for _ in range(50):
        if len(otlp.spans) >= count:
            break
        await asyncio.sleep(0.02)
    return otlp.spans


async def test_chat_span_has_genai_attributes_and_joins_the_client_trace(
    gateway_factory: Any, fake: FakeUpstream, otlp: OtlpReceiver, api_key: str
) -> None:
    gw = await traced_gateway(gateway_factory, fake, otlp)
    assert gw.state.tracing.enabled
    headers = {**auth(api_key), "traceparent": CLIENT_TRACEPARENT, "x-request-id": "traced-1"}
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(PROMPT, temperature=0.5), headers=headers)
    answer = await resp.json()
    upstream_traceparent = (await fake.stats())["last_request"]["headers"]["traceparent"]

    [span] = await exported(gw, otlp, 1)
    assert span.name == "chat test-model"
    assert span.kind == ProtoSpan.SpanKind.SPAN_KIND_CLIENT
    assert span.resource["service.name"] == "gw-under-test"
    # The client's trace continues through the gateway's span into the provider request.
    assert span.trace_id == CLIENT_TRACE_ID and span.parent_span_id == CLIENT_SPAN_ID
    assert upstream_traceparent == f"00-{CLIENT_TRACE_ID}-{span.span_id}-01"
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.model"] == "test-model"
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.response.model"] == answer["model"]
    assert a["gen_ai.response.id"] == answer["id"]
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
    assert a["server.address"] == "127.0.0.1"
    assert a["llm_gateway.request_id"] == "traced-1"
    assert "error.type" not in a and span.status_code != ProtoStatus.StatusCode.STATUS_CODE_ERROR
    # Content capture is off: no prompt or completion text anywhere in what was exported.
    assert span.events == []
    everything = b"".join(otlp.raw)
    assert b"zebras" not in everything and answer["choices"][0]["message"]["content"].encode() not in everything
    assert api_key.encode() not in everything


async def test_stream_span_has_time_to_first_chunk(
    gateway_factory: Any, fake: FakeUpstream, otlp: OtlpReceiver, api_key: str
) -> None:
    gw = await traced_gateway(gateway_factory, fake, otlp)
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("one two three four five", stream=True), headers=auth(api_key))
    chunks = [orjson.loads(p) for p in sse_payloads(await resp.read()) if p != b"[DONE]"]
    [span] = await exported(gw, otlp, 1)
    a = span.attributes
    assert a["llm_gateway.stream"] is True
    assert 0 < a["gen_ai.response.time_to_first_chunk"] < 10
    assert a["llm_gateway.stream.mean_time_between_chunks"] >= 0
    assert a["gen_ai.response.id"] == chunks[0]["id"]
    assert a["gen_ai.usage.output_tokens"] > 0
    # Without a client traceparent the span starts a trace and the provider still gets one.
    assert span.parent_span_id == ""
    upstream = (await fake.stats())["last_request"]["headers"]["traceparent"]
    assert upstream.startswith(f"00-{span.trace_id}-{span.span_id}-")


async def test_content_is_captured_only_when_enabled(
    gateway_factory: Any, fake: FakeUpstream, otlp: OtlpReceiver, api_key: str
) -> None:
    gw = await traced_gateway(gateway_factory, fake, otlp, CAPTURE_GENAI_CONTENT="true")
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(PROMPT), headers=auth(api_key))
    completion = (await resp.json())["choices"][0]["message"]["content"]
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(PROMPT, stream=True), headers=auth(api_key))
    await resp.read()
    spans = await exported(gw, otlp, 2)
    for span in spans:
        [(name, content)] = span.events
        assert name == "gen_ai.client.inference.operation.details"
        assert orjson.loads(content["gen_ai.input.messages"]) == [{"role": "user", "content": PROMPT}]
        [output] = orjson.loads(content["gen_ai.output.messages"])
        assert output["role"] == "assistant" and output["parts"][0]["content"] == completion
        assert output["finish_reason"] == "stop"


async def test_retries_failovers_and_errors_on_the_span(
    gateway_factory: Any, fake_factory: Any, otlp: OtlpReceiver, api_key: str
) -> None:
    first, second = await fake_factory(), await fake_factory()
    config = pair_config(first.url, second.url)
    gw = await gateway_factory(env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "UPSTREAM_MAX_RETRIES": "1"}, config_yaml=config)
    await first.script({"status": 503}, {"status": 503})
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="pair"), headers=auth(api_key))).status == 200
    await first.script({"status": 400}, {"status": 400})  # not retried, not failed over: relayed
    assert (await gw.data.post("/v1/chat/completions", json=chat_body(model="pair"), headers=auth(api_key))).status == 400
    ok, failed = await exported(gw, otlp, 2)
    names = [name for name, _ in ok.events]
    assert names == ["llm_gateway.retry", "llm_gateway.failover"]
    assert dict(ok.events)["llm_gateway.retry"]["reason"] == "503"
    assert dict(ok.events)["llm_gateway.failover"]["llm_gateway.deployment"] == "first/m1"
    assert ok.attributes["gen_ai.response.model"] == "m2" and ok.attributes["llm_gateway.failovers"] == 1
    assert failed.attributes["error.type"] == "400"
    assert failed.status_code == ProtoStatus.StatusCode.STATUS_CODE_ERROR


async def test_no_endpoint_means_no_spans_but_the_client_trace_is_passed_on(
    gateway_factory: Any, fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=config_for(fake.url))
    assert not gw.state.tracing.enabled
    headers = {**auth(api_key), "traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=abc"}
    await gw.data.post("/v1/chat/completions", json=chat_body(), headers=headers)
    upstream = (await fake.stats())["last_request"]["headers"]
    assert upstream["traceparent"] == CLIENT_TRACEPARENT and upstream["tracestate"] == "vendor=abc"
    # A malformed one is not passed on.
    await gw.data.post("/v1/chat/completions", json=chat_body(), headers={**auth(api_key), "traceparent": "00-nothex-00f067aa0ba902b7-01"})
    assert "traceparent" not in (await fake.stats())["last_request"]["headers"]


def test_endpoint_variables() -> None:
    assert load_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}).otel_endpoint == "http://c:4318/v1/traces"
    both = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}
    assert load_settings(both).otel_endpoint == "http://t:1/x"
    assert load_settings({**both, "OTEL_SDK_DISABLED": "true"}).otel_endpoint is None
    assert load_settings({**both, "OTEL_TRACES_EXPORTER": "none"}).otel_endpoint is None
    assert load_settings({}).otel_endpoint is None
    assert not Tracing.from_settings(load_settings({})).enabled
    from gateway.core.config import ConfigError

    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        load_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"})


class _Recorder(Actor[str]):
    """Remembers the trace context each message was handled in."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, SpanContext]] = []

    async def receive(self, msg: str) -> Any:
        self.seen.append((msg, trace.get_current_span().get_span_context()))
        return msg


async def test_trace_context_travels_through_actor_messages() -> None:
    supervisor = Supervisor()
    actor = _Recorder()
    ref = await supervisor.start(actor)
    try:
        sender = SpanContext(trace_id=int(CLIENT_TRACE_ID, 16), span_id=int(CLIENT_SPAN_ID, 16),
                             is_remote=False, trace_flags=TraceFlags(1))
        with trace.use_span(NonRecordingSpan(sender)):
            ref.tell("told")
            assert await ref.ask("asked") == "asked"
        await ref.ask("outside")  # sent with no span current
    finally:
        await supervisor.stop()
    seen = dict(actor.seen)
    assert seen["told"] == sender and seen["asked"] == sender
    assert not seen["outside"].is_valid
