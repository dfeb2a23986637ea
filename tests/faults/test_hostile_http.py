"""Hostile input against a real gateway process: generated bodies (hypothesis), key-
shaped garbage, and header injection through ``x-request-id`` and model names, sent
byte for byte over raw sockets where an HTTP client would refuse to send it.

The parsers alone are property-tested in tests/test_hostile_parsers.py; here the whole
edge answers, and what is checked is what a client gets: never a 500, never a
traceback, errors in the contract's shape, and no header a client can inject.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
from typing import Any

import asyncpg
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import FakeUpstream, chat_body
from tests.faults.support import _LEAKS, assert_error_shape, stream_end

#: What the gateway keeps of a client's x-request-id (gateway/http/middleware.py).
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# ----------------------------------------------------------------------------- bodies
_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=30)
_json = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=15,
)
_roles = st.sampled_from(["user", "system", "assistant", "tool", "", "\r\n", "ユーザー"]) | st.text(max_size=8)
_contents = st.text(max_size=60) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"])}, optional={"text": _json}),
    max_size=3,
) | _json
_messages = st.lists(
    st.fixed_dictionaries({"role": _roles | _json}, optional={"content": _contents, "name": _json}),
    max_size=4,
) | _json
_models = st.sampled_from(["test-model", "m\r\nX-Injected: 1", "", " ", "*", "a/" * 50]) | st.text(max_size=40) | _json
_chat_like = st.fixed_dictionaries(
    {"model": _models, "messages": _messages},
    optional={
        "stream": st.booleans() | _json,
        "stream_options": _json | st.fixed_dictionaries({"include_usage": _json}),
        "max_tokens": _json,
        "temperature": _json,
        "tools": _json,
        "n": _json,
    },
)

#: Bodies the gateway must accept: the three fields it checks are right, everything
#: else (content, extra fields, their types) is arbitrary and goes through to the provider.
_valid_chat = st.fixed_dictionaries(
    {
        "model": st.text(min_size=1, max_size=40).filter(lambda m: bool(m.strip())),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": _roles}, optional={"content": _contents, "name": _json, "tool_calls": _json}
            ),
            min_size=1, max_size=4,
        ),
    },
    optional={
        "stream": st.booleans(),
        "stream_options": _json,
        "max_tokens": _json,
        "temperature": _json,
        "tools": _json,
        "response_format": _json,
        "user": _json,
    },
)


def _encode(value: Any) -> bytes:
    # The standard library's encoder: it writes what orjson refuses (integers past 64
    # bits, NaN, Infinity), which the gateway must refuse politely in its turn.
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


_bodies = st.one_of(
    _valid_chat.map(_encode),
    _valid_chat.map(_encode),
    st.binary(max_size=300),
    _json.map(_encode),
    _chat_like.map(_encode),
    # Near-valid JSON text: cut short, or with bytes sprinkled in.
    st.tuples(_chat_like.map(_encode), st.integers(0, 400)).map(lambda t: t[0][: t[1]]),
    st.tuples(_chat_like.map(_encode), st.binary(min_size=1, max_size=4), st.integers(0, 400)).map(
        lambda t: t[0][: t[2]] + t[1] + t[0][t[2]:]
    ),
)
_content_types = st.sampled_from(
    ["application/json", "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1", None]
)


def _post(port: int, key: str, body: bytes, content_type: str | None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Authorization": f"Bearer {key}"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _check_answer(status: int, headers: dict[str, str], raw: bytes) -> None:
    assert status != 500, raw[:300]
    assert not any(leak in raw for leak in _LEAKS), raw[:500]
    assert "x-injected" not in headers
    if status >= 400:
        error = assert_error_shape(status, raw)
        assert error["code"] != "internal_error", error
        return
    assert status == 200, (status, raw[:300])
    if headers.get("content-type", "").startswith("text/event-stream"):
        assert stream_end(raw) == "done", raw[-300:]
    else:
        assert isinstance(orjson.loads(raw), dict)


def _fuzz(port: int, key: str) -> dict[int, int]:
    """Run the generated posts; how many answers of each status."""
    statuses: dict[int, int] = {}

    @settings(
        max_examples=200, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(body=_bodies, content_type=_content_types)
    def post_anything(body: bytes, content_type: str | None) -> None:
        status, headers, raw = _post(port, key, body, content_type)
        statuses[status] = statuses.get(status, 0) + 1
        _check_answer(status, headers, raw)

    post_anything()
    return statuses


async def test_generated_bodies_never_get_a_500_and_errors_keep_the_shape(
    start_gateway: Any, fake: FakeUpstream, api_key: str
) -> None:
    """Fault: a client posts generated bodies to /v1/chat/completions: random bytes,
    random JSON, chat-shaped objects with wrong types in every field, cut-short or
    corrupted JSON, with assorted content types.

    Visible: each gets a 200 (a valid body: relayed from the provider, a stream ending
    ``[DONE]``) or an error in the contract's shape (400 ``invalid_*`` mostly); never a
    500, never a traceback, never an injected header. No ledger check: rejected bodies
    leave no row and the valid ones are like any other call.
    """
    gw = await start_gateway(fake)
    statuses = await asyncio.to_thread(_fuzz, gw.port, api_key)
    print(f"generated bodies: answers by status {dict(sorted(statuses.items()))}")
    assert statuses.get(200) and statuses.get(400), statuses  # both paths were exercised
    assert "Traceback" not in gw.log(), gw.log()[-3000:]


# ----------------------------------------------------------------------------- raw HTTP
async def _raw_exchange(port: int, request: bytes, *, timeout: float = 10) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send bytes exactly as given; the status, header list and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=timeout)
    finally:
        writer.transport.abort()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(name.strip().lower(), value.strip()) for name, _, value in (line.partition(":") for line in lines[1:])]
    return status, headers, body


def _request(key: str, *, extra_headers: bytes = b"", body: bytes = b"", path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nContent-Type: application/json\r\n".encode()
        + (f"Authorization: Bearer {key}\r\n".encode() if key else b"")
        + extra_headers
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


KEY_GARBAGE: list[bytes] = [
    b"",
    b"x",
    b"llmg_",
    b"llmg_short",
    b"llmg_" + b"A" * 10 * 1024,
    "llmg_ключ_0123456789abcdefghij".encode(),
    b"llmg_\xff\xfe\xfd_0123456789abcdefghij",
    b"llmg_' OR '1'='1' --0123456789abcdef",
    b"llmg_x'); DROP TABLE api_keys; --012345",
    b"llmg_\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00",
    b"%00%0d%0allmg_0123456789abcdefghijklmn",
    b"llmg_" + b"%" * 60,
]


async def test_key_shaped_garbage_is_a_401_and_never_a_database_error(
    start_gateway: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """Fault: tokens too short, non-ASCII, 10 kB long, not UTF-8, SQL in the token, in
    ``Authorization: Bearer`` and in ``x-api-key``.

    Visible: each is a 401 ``invalid_api_key`` in the contract's shape (one message for
    all); the gateway logs no database error; the keys table is intact and a real key
    still works. No ledger row (refused before any work).
    """
    gw = await start_gateway(fake)
    body = orjson.dumps(chat_body())
    for token in KEY_GARBAGE:
        for header in (b"Authorization: Bearer ", b"x-api-key: "):
            status, _, raw = await _raw_exchange(gw.port, _request("", extra_headers=header + token + b"\r\n", body=body))
            assert status == 401, (token[:40], status, raw[:200])
            error = assert_error_shape(status, raw)
            assert (error["type"], error["code"], error["message"]) == (
                "authentication_error", "invalid_api_key", "invalid API key"
            )
    status, _, raw = await _raw_exchange(gw.port, _request(api_key, body=body))
    assert status == 200, raw[:300]
    assert await db_pool.fetchval("SELECT count(*) FROM api_keys") >= 1
    log = gw.log()
    for sign in ("Traceback", "asyncpg", "key lookup failed", "syntax error", "ERROR"):
        assert sign not in log, log[-2000:]


INJECTED_IDS: list[bytes] = [
    b"abc\r\nX-Injected: yes",  # on the wire: a second header line, from the client itself
    b"abc\rX-Injected: yes",
    b"abc\nX-Injected: yes",
    b"abc\r\n X-Injected: yes",  # obsolete line folding
    b"abc%0d%0aX-Injected:%20yes",
    "abc\u2028X-Injected: yes".encode(),
    "abc\u0085X-Injected: yes".encode(),
    b"abc\x00X-Injected: yes",
    b"a" * 200,
    b"ok-id\r\nx-request-id: second",
]


async def test_header_injection_through_request_ids_and_model_names_is_impossible(
    start_gateway: Any, fake: FakeUpstream, api_key: str
) -> None:
    """Fault: CR/LF (bare, paired, folded, percent-encoded, Unicode line separators, NUL)
    in ``x-request-id``, and in model names inside the JSON body (routed upstream, and
    not routed at all).

    Visible: no answer ever carries a header the client smuggled in; the answer's
    ``x-request-id`` is exactly one, and the client's own only when it is plain
    (``[A-Za-z0-9._:-]{1,128}``), else a fresh one; malformed header lines are a 400
    from the HTTP parser. The provider never receives a smuggled header either. No
    ledger check (nothing here is about billing).
    """
    gw = await start_gateway(
        fake, models=[
            {"name": "known", "deployments": [{"provider": "fake", "model": "m"}]},
            {"name": "wild/*", "deployments": [{"provider": "fake", "model": "*"}]},
        ],
    )
    body = orjson.dumps(chat_body(model="known"))
    for rid in INJECTED_IDS:
        status, headers, raw = await _raw_exchange(gw.port, _request(api_key, extra_headers=b"x-request-id: " + rid + b"\r\n", body=body))
        names = [name for name, _ in headers]
        assert "x-injected" not in names, (rid, headers)
        assert status in (200, 400), (rid, status, raw[:200])
        if status == 200:
            ids = [value for name, value in headers if name == "x-request-id"]
            assert len(ids) == 1 and SAFE_REQUEST_ID.fullmatch(ids[0]), (rid, ids)
            assert rid.startswith(ids[0].encode()) or len(ids[0]) == 32, (rid, ids)
    for model, expected in (("wild/m\r\nX-Injected: yes", 200), ("nope\r\nX-Injected: yes\r\n\r\n", 404)):
        status, headers, raw = await _raw_exchange(gw.port, _request(api_key, body=orjson.dumps(chat_body(model=model))))
        assert status == expected, raw[:300]
        assert "x-injected" not in [name for name, _ in headers]
        if status == 404:
            assert assert_error_shape(status, raw)["code"] == "model_not_found"
    seen = (await fake.stats())["last_request"]["headers"]
    assert "x-injected" not in seen and "x-request-id" not in seen


async def test_malformed_http_is_refused_without_logging_its_bytes(
    start_gateway: Any, fake: FakeUpstream, api_key: str
) -> None:
    """Fault: requests the HTTP parser refuses (a 40 kB header line, a NUL in a header,
    not HTTP at all), one of them carrying a real key.

    Visible: a 400 and a closed connection; the gateway's log has no traceback and never
    the bytes sent (here: the key), whatever the log level. No ledger row.
    """
    gw = await start_gateway(fake)
    for raw_request in (
        _request(api_key, extra_headers=b"X-Big: " + b"a" * 40_000 + b"\r\n"),
        _request("", extra_headers=f"Authorization: Bearer {api_key}\x00\r\n".encode()),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello on a plain port
        b"GET / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    ):
        try:
            status, _, _ = await _raw_exchange(gw.port, raw_request)
        except (ConnectionError, IndexError, ValueError):
            continue  # closed without a status line: also a refusal
        assert status == 400
    await asyncio.sleep(0.2)
    log = gw.log()
    assert "Traceback" not in log and api_key not in log, log[-2000:]
    with socket.create_connection(("127.0.0.1", gw.port)) as s:  # still serving
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")


async def test_requests_the_parser_refuses_get_the_contract_json_error(
    start_gateway: Any, fake: FakeUpstream, api_key: str
) -> None:
    """Fault: requests aiohttp's HTTP parser refuses before the app sees them, on both planes.

    Visible: a 400 with the contract's JSON error body and an ``x-request-id``, not
    aiohttp's ``text/plain`` "400 Bad Request"; the connection is closed.
    """
    gw = await start_gateway(fake)
    for port in (gw.port, gw.management_port):
        for raw_request in (
            _request(api_key, extra_headers=b"X-Big: " + b"a" * 40_000 + b"\r\n"),
            b"GET / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: gw\r\nBad Header\r\n\r\n",
        ):
            status, headers, body = await _raw_exchange(port, raw_request)
            assert status == 400, body[:200]
            names = dict(headers)
            assert names.get("content-type", "").startswith("application/json"), headers
            assert re.fullmatch(r"[0-9a-f]{32}", names.get("x-request-id", "")), headers
            error = assert_error_shape(status, body)
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_http_request")
