"""A real OTLP/HTTP trace receiver on loopback, decoding with ``opentelemetry-proto``.

No collector ships on PyPI or Debian; this is the part of one the tests need: it
accepts ``POST /v1/traces`` (protobuf, optionally gzip) and keeps every span with its
resource, so a test can assert on what an exporter really sent over HTTP.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedSpan"]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int
    resource: dict[str, Any]


@dataclass
class OtlpReceiver:
    server: TestServer
    raw: list[bytes] = field(default_factory=list)
    spans: list[ReceivedSpan] = field(default_factory=list)

    @classmethod
    async def start(cls) -> OtlpReceiver:
        app = web.Application()
        receiver = cls(server=TestServer(app, host="127.0.0.1"))
        app.router.add_post("/v1/traces", receiver._export)
        await receiver.server.start_server()
        return receiver

    @property
    def endpoint(self) -> str:
        """The base URL, as OTEL_EXPORTER_OTLP_ENDPOINT takes it."""
        return f"http://127.0.0.1:{self.server.port}"

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.raw.append(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        for resource_spans in message.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(ReceivedSpan(
                        name=span.name,
                        kind=span.kind,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes={kv.key: _value(kv.value) for kv in span.attributes},
                        events=[(e.name, {kv.key: _value(kv.value) for kv in e.attributes}) for e in span.events],
                        status_code=span.status.code,
                        resource=resource,
                    ))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    async def close(self) -> None:
        await self.server.close()
