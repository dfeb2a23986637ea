"""OpenTelemetry spans for chat calls, with the GenAI attribute names defined once.

One CLIENT span per chat call, named ``chat {model}`` (contract §10), parented to the
client's W3C ``traceparent`` when it sent one; its context is current while the call
runs, so actor messages carry it (actors/runtime.py puts the sender's context in each
envelope) and the provider gets it as ``traceparent``. Retries and failovers are span
events. Prompts and completions appear only as a span event, and only when
``CAPTURE_GENAI_CONTENT=true``.

With no OTLP endpoint configured, no tracer exists and no span is made: a call costs
two header lookups (a client's ``traceparent`` is still passed on to the provider, so
a trace that does not include the gateway still joins up). With an endpoint, spans
are batched and exported over OTLP/HTTP by the SDK's worker thread; each gateway has
its own :class:`TracerProvider` (none is installed globally), so in-process gateways
in one test run stay apart.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.core.config import Settings
from gateway.core.usage import CallRecord

__all__ = [
    "GEN_AI_INPUT_MESSAGES",
    "GEN_AI_OPERATION_NAME",
    "GEN_AI_OUTPUT_MESSAGES",
    "GEN_AI_PROVIDER_NAME",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_ID",
    "GEN_AI_RESPONSE_MODEL",
    "GEN_AI_USAGE_INPUT_TOKENS",
    "GEN_AI_USAGE_OUTPUT_TOKENS",
    "ChatSpan",
    "Tracing",
    "note_failover",
    "note_retry",
    "note_upstream_error",
]

log = logging.getLogger("gateway.tracing")

# -- attribute names (OpenTelemetry GenAI conventions; the Python package's constants
#    for most of these are deprecated, so they are spelled out here, once) -------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
#: The span event that carries content when capture is on.
GEN_AI_CONTENT_EVENT = "gen_ai.client.inference.operation.details"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
# The gateway's own (no convention exists for these).
GATEWAY_PROVIDER = "llm_gateway.provider"
GATEWAY_DEPLOYMENT = "llm_gateway.deployment"
GATEWAY_REQUEST_ID = "llm_gateway.request_id"
GATEWAY_STREAM = "llm_gateway.stream"
GATEWAY_COST_USD = "llm_gateway.cost.usd"
GATEWAY_COST_DIEM = "llm_gateway.cost.diem"
GATEWAY_USAGE_ESTIMATED = "llm_gateway.usage.estimated"
GATEWAY_TIME_BETWEEN_CHUNKS = "llm_gateway.stream.mean_time_between_chunks"
GATEWAY_OUTCOME = "llm_gateway.outcome"
GATEWAY_RETRIES = "llm_gateway.retries"
GATEWAY_FAILOVERS = "llm_gateway.failovers"
#: Span event names.
EVENT_RETRY = "llm_gateway.retry"
EVENT_UPSTREAM_ERROR = "llm_gateway.upstream_error"
EVENT_FAILOVER = "llm_gateway.failover"

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: A well-formed W3C traceparent (version 00 layout); anything else is not passed on.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_MAX_TRACESTATE = 512
_NUMERIC_REQUEST_PARAMS = (
    ("temperature", GEN_AI_REQUEST_TEMPERATURE),
    ("top_p", GEN_AI_REQUEST_TOP_P),
    ("max_tokens", GEN_AI_REQUEST_MAX_TOKENS),
)


@dataclass(slots=True)
class ChatSpan:
    """A started chat span and the context token to detach when it ends."""

    span: trace.Span
    token: object
    #: The request's messages as JSON, kept only when content capture is on.
    input_messages: str | None = None


class Tracing:
    """Spans for chat calls; with no tracer every method is a near-free no-op."""

    def __init__(
        self,
        provider: TracerProvider | None = None,
        *,
        capture_content: bool = False,
        providers: Mapping[str, Any] | None = None,
    ) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("llm-gateway") if provider is not None else None
        self._propagator = TraceContextTextMapPropagator()
        self.capture_content = capture_content
        #: The gateway's providers by name: ``system`` and ``address`` feed the span.
        self.providers: Mapping[str, Any] = providers or {}

    @classmethod
    def from_settings(cls, settings: Settings, exporter: SpanExporter | None = None) -> Tracing:
        """A Tracing exporting to ``settings.otel_endpoint``, or a disabled one if unset.

        ``exporter`` replaces the OTLP exporter (tests, tools). The SDK reads the other
        standard variables itself (``OTEL_TRACES_SAMPLER``, ``OTEL_EXPORTER_OTLP_HEADERS``,
        ``OTEL_BSP_*``, ``OTEL_RESOURCE_ATTRIBUTES``...).
        """
        if exporter is None and settings.otel_endpoint is None:
            return cls(capture_content=settings.capture_genai_content)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.otel_endpoint)
        provider = TracerProvider(resource=Resource.create({"service.name": settings.otel_service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, capture_content=settings.capture_genai_content)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    # -- a chat call -------------------------------------------------------------------
    def start_chat(self, record: CallRecord, body: Mapping[str, Any], headers: Mapping[str, str]) -> ChatSpan | None:
        """Start the call's span (current until :meth:`end_chat`) and set its trace headers.

        ``headers`` are the client's request headers. Returns None when tracing is off;
        then only the client's own trace context, if well-formed, is passed upstream.
        """
        if self._tracer is None:
            traceparent = headers.get(TRACEPARENT)
            if traceparent is not None and _TRACEPARENT.fullmatch(traceparent):
                carried = {TRACEPARENT: traceparent}
                tracestate = headers.get(TRACESTATE)
                if tracestate and len(tracestate) <= _MAX_TRACESTATE:
                    carried[TRACESTATE] = tracestate
                record.trace_headers = carried
            return None
        parent = self._propagator.extract(headers) if TRACEPARENT in headers else None
        attributes: dict[str, Any] = {
            GEN_AI_OPERATION_NAME: "chat",
            GEN_AI_REQUEST_MODEL: record.requested_model,
            GATEWAY_REQUEST_ID: record.request_id,
            GATEWAY_STREAM: record.stream,
        }
        for field_name, attribute in _NUMERIC_REQUEST_PARAMS:
            value = body.get(field_name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[attribute] = value
        span = self._tracer.start_span(
            f"chat {record.requested_model}", context=parent, kind=SpanKind.CLIENT, attributes=attributes
        )
        ctx = trace.set_span_in_context(span, parent)
        token = otel_context.attach(ctx)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=ctx)
        record.trace_headers = carrier
        scope = ChatSpan(span, token)
        if self.capture_content and span.is_recording():
            scope.input_messages = _json(body.get("messages"))
        return scope

    def end_chat(self, scope: ChatSpan | None, record: CallRecord, cost_usd: float | None = None) -> None:
        """Describe the finished call on its span, end it and restore the context."""
        if scope is None:
            return
        span = scope.span
        try:
            if span.is_recording():
                self._describe(span, record, cost_usd)
                if scope.input_messages is not None:
                    self._add_content(span, scope.input_messages, record)
            span.end()
        finally:
            try:
                otel_context.detach(scope.token)  # type: ignore[arg-type]
            except ValueError:
                pass  # ended from another context (a cancelled task's cleanup): nothing to restore

    def _describe(self, span: trace.Span, record: CallRecord, cost_usd: float | None) -> None:
        attrs: dict[str, Any] = {
            GATEWAY_OUTCOME: record.outcome,
            GEN_AI_USAGE_INPUT_TOKENS: record.usage.prompt_tokens,
            GEN_AI_USAGE_OUTPUT_TOKENS: record.usage.completion_tokens,
        }
        if record.provider is not None:
            attrs[GATEWAY_PROVIDER] = record.provider
            provider = self.providers.get(record.provider)
            attrs[GEN_AI_PROVIDER_NAME] = getattr(provider, "system", None) or record.provider
            address = getattr(provider, "address", None)
            if address:
                attrs[SERVER_ADDRESS] = address
        if record.deployment is not None:
            attrs[GATEWAY_DEPLOYMENT] = record.deployment
        if record.served_model:
            attrs[GEN_AI_RESPONSE_MODEL] = record.served_model
        if record.response_id:
            attrs[GEN_AI_RESPONSE_ID] = record.response_id
        if record.finish_reasons:
            attrs[GEN_AI_RESPONSE_FINISH_REASONS] = list(record.finish_reasons)
        if record.status:
            attrs[HTTP_RESPONSE_STATUS_CODE] = record.status
        if record.usage.estimated:
            attrs[GATEWAY_USAGE_ESTIMATED] = True
        if cost_usd is not None:
            attrs[GATEWAY_COST_USD] = cost_usd
        if record.usage.cost_diem is not None:
            attrs[GATEWAY_COST_DIEM] = record.usage.cost_diem
        if record.retries:
            attrs[GATEWAY_RETRIES] = record.retries
        if record.failovers:
            attrs[GATEWAY_FAILOVERS] = record.failovers
        if record.ttft is not None:
            attrs[GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = record.ttft
            if record.chunks > 1:
                attrs[GATEWAY_TIME_BETWEEN_CHUNKS] = max(0.0, record.latency - record.ttft) / (record.chunks - 1)
        error = error_type_of(record)
        if error is not None:
            attrs[ERROR_TYPE] = error
            span.set_status(Status(StatusCode.ERROR))
        span.set_attributes(attrs)
        for policy, action, direction in record.guardrails:
            span.add_event("gateway.guardrail", {"policy": policy, "action": action, "direction": direction})

    @staticmethod
    def _add_content(span: trace.Span, input_messages: str, record: CallRecord) -> None:
        """One event with the prompt and the completion (only with CAPTURE_GENAI_CONTENT)."""
        content = {GEN_AI_INPUT_MESSAGES: input_messages}
        if record.completion is not None:
            content[GEN_AI_OUTPUT_MESSAGES] = _json([{
                "role": "assistant",
                "parts": [{"type": "text", "content": record.completion}],
                "finish_reason": record.finish_reasons[0] if record.finish_reasons else None,
            }])
        span.add_event(GEN_AI_CONTENT_EVENT, content)

    # -- lifecycle -----------------------------------------------------------------------
    async def flush(self, within: float = 5.0) -> bool:
        """Export every ended span now (off the loop); True if all went out ``within`` s."""
        if self._provider is None:
            return True
        provider = self._provider
        return await asyncio.to_thread(provider.force_flush, int(within * 1000))

    async def shutdown(self) -> None:
        """Flush and stop the export thread (off the loop: the last export may take a while)."""
        if self._provider is not None:
            provider, self._provider, self._tracer = self._provider, None, None
            await asyncio.to_thread(provider.shutdown)


def error_type_of(record: CallRecord) -> str | None:
    """``error.type`` of a finished call: the gateway's code, the HTTP status, or None."""
    if record.error_type:
        return record.error_type
    if record.outcome == "cancelled":
        return "cancelled"
    if record.status >= 400:
        return str(record.status)
    if record.outcome != "ok":
        return record.outcome
    return None


def note_retry(provider: str, attempt: int, reason: str) -> None:
    """Add a retry event to the current chat span (no-op when there is none)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(EVENT_RETRY, {GATEWAY_PROVIDER: provider, "attempt": attempt, "reason": reason})


def note_upstream_error(deployment: str, error: str, detail: str) -> None:
    """Add an upstream-error event (the full detail the client never sees) to the chat span."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(EVENT_UPSTREAM_ERROR, {GATEWAY_DEPLOYMENT: deployment, ERROR_TYPE: error, "detail": detail})


def note_failover(from_deployment: str, reason: str) -> None:
    """Add a failover event: the call leaves ``from_deployment`` for the next target."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(EVENT_FAILOVER, {GATEWAY_DEPLOYMENT: from_deployment, "reason": reason})


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return "null"
