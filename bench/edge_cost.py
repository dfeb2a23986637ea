"""What the edge costs a non-streaming request, piece by piece and in all.

    python -m bench.edge_cost [--repeats R] [--json]
    (or, to measure another tree's code: PYTHONPATH=/that/tree python bench/edge_cost.py)

The edge is what every data-plane request pays outside routing, dispatch and billing:
the middlewares of :func:`gateway.edge.app.build_data_app`, the response-prepare hooks
(request id, security, CORS, rate-limit headers), the request id, reading the JSON
body, the cached-key check, the access line and the billing line. No services needed:
the limiter is a stub answering at once (its own cost is bench/limiter_cost.py's), the
key is in the auth actor's cache, and logging is configured as ``serve`` does (JSON,
writer thread) onto ``/dev/null``.

Reported per call, in microseconds, the minimum over ``R`` repeats (the least
disturbed run on a shared machine):

* ``request_id``: :func:`gateway.http.middleware.request_id_of` on a request without
  one (an id is made) and again (memoised);
* ``authenticate``: :meth:`actors.auth.AuthHandle.authenticate` of a cached valid key;
* ``access_line`` / ``billing_line``: one JSON line each, handed to the writer;
* ``ratelimit_headers``: :func:`gateway.edge.ratelimit.put_ratelimit_headers`;
* ``edge_request``: one keep-alive request served whole by aiohttp's server (parse,
  middlewares, a handler doing the edge's steps of a chat call, prepare hooks, the
  answer written to a fake transport), and ``bare_request``, the same request served
  by an aiohttp app with no middleware and a handler that reads the body and answers
  the same bytes (the bare relay's edge). Their difference is the edge's overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from actors.auth import AuthActor, AuthHandle, VerifiedKey
from gateway.auth.keys import KEY_PREFIX_LEN, KeyPolicy, hash_key
from gateway.core.config import load_config
from gateway.core.settings import load_settings
from gateway.core.usage import CallRecord, Usage
from gateway.edge import ratelimit, telemetry
from gateway.edge.app import DATA_SERVER_OPTIONS, build_data_app
from gateway.edge.reload import ProviderPools
from gateway.http.bodies import bearer_token, read_json_body
from gateway.http.middleware import request_id_of
from gateway.http.parser_errors import ContractAppRunner
from gateway.http.state import STATE, GatewayState
from gateway.observability.logs import configure_logging, log_fields

__all__ = ["main"]

#: A data-plane route of the bench's own (under ``/v1/``, so gated and guarded like chat).
BENCH_ROUTE = "/v1/bench/chat"
KEY = "llmg_benchKEY0" + "x" * 39
BODY = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hi in five words."}]})
ANSWER = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there, how are you?"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
})
#: What an OpenAI SDK-like client sends (the S1 driver's aiohttp client sends these).
REQUEST = (
    b"POST " + BENCH_ROUTE.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1:3000\r\n"
    b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
    b"Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nUser-Agent: Python/3.11 aiohttp/3.14\r\n"
    b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)
RATE_HEADERS = {
    "x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "599",
    "x-ratelimit-reset-requests": "100ms", "x-ratelimit-limit-tokens": "100000",
    "x-ratelimit-remaining-tokens": "99981", "x-ratelimit-reset-tokens": "11ms",
}


class _Permit:
    """What the edge reads of a limiter permit."""

    def __init__(self) -> None:
        self.headers = dict(RATE_HEADERS)

    def put_headers(self, out: Any) -> None:
        out.update(self.headers)

    def track(self, record: CallRecord) -> None:
        pass

    def release(self) -> None:
        pass


class _Limiter:
    """A limiter that admits everything at once (the real one is measured elsewhere)."""

    def __init__(self) -> None:
        self.rejection_listeners: list[Callable[..., None]] = []

    def passed_ip_now(self, ip: str) -> bool:
        return True

    async def check_ip(self, ip: str, kind: str = "all") -> None:
        return None

    def failures_counted(self, ip: str) -> bool:
        return False  # as the real one says of an address with no failed attempts

    async def acquire(self, key: VerifiedKey) -> _Permit:
        return _Permit()

    def apply_ip_guard(self, settings: Any) -> None:
        pass


def _auth() -> tuple[AuthHandle, VerifiedKey]:
    actor = AuthActor(None, "")  # type: ignore[arg-type]  # no database: the key is cached
    key = VerifiedKey(
        api_key_id=uuid.uuid4(), subject_id=uuid.uuid4(), name="bench", key_prefix=KEY[:KEY_PREFIX_LEN],
        key_hash=hash_key(KEY), policy=KeyPolicy(), expires_at=None,
    )
    actor._cache[key.key_prefix] = key
    actor._touched.add(key.api_key_id)  # already due in the next flush: no tell per request
    return AuthHandle(actor, SimpleNamespace()), key  # type: ignore[arg-type]


def _state() -> GatewayState:
    settings = load_settings({"DATABASE_URL": "postgresql://bench@127.0.0.1/bench", "LLM_GATEWAY_HOME": "/tmp"})
    auth, _ = _auth()
    state = GatewayState(
        settings=settings, config=load_config(settings, {}), pool=None, dsn="", supervisor=None,  # type: ignore[arg-type]
        auth=auth, billing=None, keys=None, router=None, providers={}, session=None,  # type: ignore[arg-type]
        retry_policy=None, breaker=None, limiter=_Limiter(),  # type: ignore[arg-type]
        provider_pools=ProviderPools(settings),
    )
    state.call_listeners.append(state.metrics.observe_call)
    return state


def _record(request_id: str, key: VerifiedKey) -> CallRecord:
    return CallRecord(
        request_id=request_id, api_key_id=key.api_key_id, subject_id=key.subject_id,
        requested_model="gpt-4o-mini", served_model="gpt-4o-mini-2024-07-18", provider="fake",
        deployment="fake/gpt-4o-mini", status=200, usage=Usage(prompt_tokens=12, completion_tokens=7),
    )


async def _edge_handler(request: web.Request) -> web.StreamResponse:
    """The edge's steps of a whole chat call (gateway/edge/pipeline.py), without a provider."""
    state = request.app[STATE]
    key = await state.auth.authenticate(bearer_token(request))
    telemetry.key_known(request, key.api_key_id)
    permit = await ratelimit.admit(request, key, state.limiter)
    await read_json_body(request, state.settings.body_limit)
    record = _record(request_id_of(request), key)
    permit.track(record)
    observed = telemetry.begin_call(request, state, record, {})
    record.latency = 0.001
    for listener in state.call_listeners:
        listener(record)
    telemetry.end_call(state, observed, record)
    return web.Response(status=200, body=ANSWER, headers={"Content-Type": "application/json"})


async def _bare_handler(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.Response(status=200, body=ANSWER, headers={"Content-Type": "application/json"})


class _Transport(asyncio.Transport):
    """A connection's socket: keeps what is written, says when an answer has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.done: asyncio.Future[bytes] | None = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: Any) -> None:
        self.written += data
        if self.written.endswith(ANSWER) and self.done is not None and not self.done.done():
            self.done.set_result(bytes(self.written))
            self.written.clear()

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Connection:
    """One keep-alive connection to an app's server, driven in-process."""

    def __init__(self, runner: web.AppRunner) -> None:
        assert runner.server is not None
        self.protocol = runner.server()
        self.transport = _Transport()
        self.protocol.connection_made(self.transport)

    async def request(self) -> bytes:
        loop = asyncio.get_running_loop()
        self.transport.done = loop.create_future()
        self.protocol.data_received(REQUEST)
        return await self.transport.done


async def _runner(app: web.Application) -> web.AppRunner:
    runner = ContractAppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=60,
                               **DATA_SERVER_OPTIONS)  # type: ignore[arg-type]
    await runner.setup()
    return runner


def _timed(fn: Callable[[], None], n: int, repeats: int) -> float:
    for _ in range(min(n, 1000)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


async def _timed_async(fn: Callable[[], Any], n: int, repeats: int) -> float:
    for _ in range(min(n, 200)):
        await fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(n):
            await fn()
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


async def run(repeats: int) -> dict[str, float]:
    results: dict[str, float] = {}
    auth, key = _auth()
    request = make_mocked_request("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    state_of_request = request._state  # the request's own mapping: emptied to make it new again

    def fresh_id() -> None:
        state_of_request.clear()
        request_id_of(request)

    def no_op() -> None:
        state_of_request.clear()

    results["request_id (new)"] = _timed(fresh_id, 50_000, repeats) - _timed(no_op, 50_000, repeats)
    results["request_id (memoised)"] = _timed(lambda: request_id_of(request), 50_000, repeats)
    results["authenticate"] = await _timed_async(lambda: auth.authenticate(KEY), 50_000, repeats)

    response = web.Response()
    request[ratelimit.PERMIT] = _Permit()  # type: ignore[assignment]  # what an admitted request holds

    # The function the prepare hook calls (before it, the hook itself: a coroutine).
    put_headers = getattr(ratelimit, "put_ratelimit_headers", None)
    if put_headers is not None:
        def rate_headers() -> None:
            response.headers.clear()
            put_headers(request, response)

        results["ratelimit_headers"] = _timed(rate_headers, 50_000, repeats)
    else:
        async def rate_headers_hook() -> None:
            response.headers.clear()
            await ratelimit.add_ratelimit_headers(request, response)  # type: ignore[attr-defined]

        results["ratelimit_headers"] = await _timed_async(rate_headers_hook, 50_000, repeats)

    record = _record(request_id_of(request), key)
    request[telemetry.CALL_RECORD] = record
    access = telemetry._access_line
    access_log = logging.getLogger("gateway.access")
    access_log.setLevel(logging.INFO)  # the pieces whatever --log-level says
    billing_log = logging.getLogger("gateway.billing")
    billing_log.setLevel(logging.INFO)
    results["access_line"] = _timed(
        lambda: access(request, record.request_id, "/v1/chat/completions", 200, 0.0123), 20_000, repeats)
    payload = {
        "api_key_id": str(key.api_key_id), "subject_id": str(key.subject_id), "request_id": record.request_id,
        "response_id": "chatcmpl-bench", "model": "gpt-4o-mini", "served_model": "gpt-4o-mini-2024-07-18",
        "provider": "fake", "prompt_tokens": 12, "completion_tokens": 7, "cost_usd": "0.0000063",
        "cost_diem": None, "cost_source": "price", "status": 200,
    }
    results["billing_line"] = _timed(lambda: log_fields(billing_log, "billing", dict(payload)), 20_000, repeats)
    access_log.setLevel(logging.NOTSET)
    billing_log.setLevel(logging.NOTSET)

    app = build_data_app(_state())
    app.router.add_post(BENCH_ROUTE, _edge_handler)
    bare = web.Application()
    bare.router.add_post(BENCH_ROUTE, _bare_handler)
    edge_runner, bare_runner = await _runner(app), await _runner(bare)
    try:
        edge, plain = _Connection(edge_runner), _Connection(bare_runner)
        answer = await edge.request()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        edge_best, bare_best = float("inf"), float("inf")
        # Short batches, interleaved, so both see the same machine and the least disturbed
        # batch of a busy one.
        for _ in range(repeats * 6):
            edge_best = min(edge_best, await _timed_async(edge.request, 1_000, 1))
            bare_best = min(bare_best, await _timed_async(plain.request, 1_000, 1))
        results["edge_request"] = edge_best
        results["bare_request"] = bare_best
        results["edge_overhead"] = edge_best - bare_best
        results["answer_header_bytes"] = float(answer.index(b"\r\n\r\n") + 4)
    finally:
        await edge_runner.cleanup()
        await bare_runner.cleanup()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="repeats per piece; the minimum is reported")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--log-level", default="info",
                        help="warning: the requests without their access line (the line's pieces are timed anyway)")
    args = parser.parse_args(argv)
    setup = configure_logging(args.log_level, "json", open(os.devnull, "w"))  # noqa: SIM115 - closed at exit
    try:
        import uvloop

        results = uvloop.run(run(max(1, args.repeats)))
    finally:
        setup.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for name, value in results.items():
        print(f"{name:24} {value:9.2f}" + ("" if name == "answer_header_bytes" else " µs"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
