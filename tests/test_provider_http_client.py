"""The HTTP/1.1 client of providers' whole answers (gateway/providers/http_client.py),
against real servers on loopback: what it sends, every way an answer can end, its
bounds, its pool, TLS, and how a provider maps its failures."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import ssl
import subprocess
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yarl
from aiohttp import web

from gateway.core.config import load_config, load_settings
from gateway.providers.base import (
    UpstreamBodyTooLarge,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
)
from gateway.providers.http_client import AnswerBroken, AnswerTooLarge, ConnectFailed, ProviderHTTP
from gateway.providers.openai import OpenAIProvider

LIMIT = 1 << 20


class Echo:
    """An aiohttp server that answers each POST with what it received, and counts the
    connections its requests came on."""

    def __init__(self) -> None:
        self.peers: list[Any] = []
        self.app = web.Application()
        self.app.router.add_post("/{tail:.*}", self.echo)

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        body = await request.read()
        return web.json_response({
            "path": request.path_qs, "host": request.headers.get("Host"), "body": body.decode(),
            "headers": {k: v for k, v in request.headers.items()},
        }, headers={"X-Seen": "yes", "Set-Cookie": "a=1"})


@pytest.fixture
async def echo(aiohttp_server: Any) -> AsyncIterator[tuple[Echo, str]]:
    server = Echo()
    running = await aiohttp_server(server.app)
    yield server, f"http://127.0.0.1:{running.port}"


@pytest.fixture
async def client() -> AsyncIterator[ProviderHTTP]:
    http = ProviderHTTP()
    yield http
    await http.close()


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[RawHandler], Awaitable[str]]]:
    """A TCP server whose every connection ``handler`` serves byte by byte."""
    servers: list[asyncio.Server] = []

    async def start(handler: RawHandler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def _answering(*replies: bytes, then_close: bool = False) -> RawHandler:
    """A connection's handler: reads a request, writes the next reply, for each reply."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for reply in replies:
                await _read_request(reader)
                writer.write(reply)
                await writer.drain()
            if then_close:
                writer.close()
            else:
                await reader.read()  # hold the connection until the client closes it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
    return handle


async def test_the_request_goes_out_as_given_and_the_answer_comes_back_whole(
    echo: tuple[Echo, str], client: ProviderHTTP
) -> None:
    _, base = echo
    answer = await client.post(f"{base}/v1/chat/completions?api-version=1", b'{"a": "\xc3\xa9"}',
                               {"Authorization": "Bearer sk-test", "Content-Type": "application/json"},
                               total=5, connect=5, limit=LIMIT)
    assert answer.status == 200
    assert answer.headers["x-seen"] == "yes" and answer.headers.getall("Set-Cookie") == ["a=1"]
    seen = orjson.loads(answer.body)
    assert seen["path"] == "/v1/chat/completions?api-version=1"
    assert seen["host"] == base.removeprefix("http://")
    assert seen["body"] == '{"a": "é"}'
    assert seen["headers"]["Authorization"] == "Bearer sk-test"
    assert seen["headers"]["Content-Length"] == str(len('{"a": "é"}'.encode()))


async def test_a_kept_connection_carries_the_next_call(echo: tuple[Echo, str], client: ProviderHTTP) -> None:
    server, base = echo
    for _ in range(3):
        answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert answer.status == 200
    assert len(server.peers) == 3 and len(set(server.peers)) == 1
    assert client.open_connections == 1


async def test_calls_at_once_each_get_a_connection_and_all_are_kept(
    echo: tuple[Echo, str], client: ProviderHTTP
) -> None:
    server, base = echo
    answers = await asyncio.gather(*(client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
                                     for _ in range(5)))
    assert [a.status for a in answers] == [200] * 5
    assert client.open_connections == len(set(server.peers))
    await asyncio.gather(*(client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT) for _ in range(5)))
    assert len(set(server.peers)) <= 5  # the second round reused the first round's connections


async def test_a_yarl_url_made_encoded_is_sent_exactly(raw_server: Any, client: ProviderHTTP) -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    base = await raw_server(handle)
    answer = await client.post(yarl.URL(f"{base}/model/a%3Ab/converse", encoded=True), b"", {},
                               total=5, connect=5, limit=LIMIT)
    assert answer.status == 200 and answer.body == b""
    assert seen[0].startswith(b"POST /model/a%3Ab/converse HTTP/1.1\r\n")


@pytest.mark.parametrize("reply, body", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"hello world"),
    (b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", b"ok"),
    (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nRetry-After: 7\r\n\r\nbusy", b"busy"),
])
async def test_sized_and_chunked_answers_are_read_and_the_connection_kept(
    raw_server: Any, client: ProviderHTTP, reply: bytes, body: bytes
) -> None:
    base = await raw_server(_answering(reply, reply))
    for _ in range(2):
        answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert answer.body == body
    assert client.open_connections == 1


async def test_an_answer_that_ends_with_its_connection_is_read_to_the_end(
    raw_server: Any, client: ProviderHTTP
) -> None:
    base = await raw_server(_answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", then_close=True))
    answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    assert answer.status == 200 and answer.body == b"until the end"
    await asyncio.sleep(0.05)
    assert client.open_connections == 0


async def test_a_connection_close_answer_is_not_kept(raw_server: Any, client: ProviderHTTP) -> None:
    base = await raw_server(_answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"))
    answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    assert answer.body == b"ok"
    await asyncio.sleep(0.05)
    assert client.open_connections == 0


@pytest.mark.parametrize("encoding, packed", [
    ("gzip", gzip.compress(b'{"ok": true}')),
    ("deflate", zlib.compress(b'{"ok": true}')),
    ("deflate", zlib.compress(b'{"ok": true}')[2:-4]),  # raw deflate, as some servers send it
])
async def test_a_compressed_answer_is_decoded(raw_server: Any, client: ProviderHTTP, encoding: str,
                                              packed: bytes) -> None:
    head = f"HTTP/1.1 200 OK\r\nContent-Encoding: {encoding}\r\nContent-Length: {len(packed)}\r\n\r\n".encode()
    base = await raw_server(_answering(head + packed))
    answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    assert answer.body == b'{"ok": true}'


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000,  # declared over
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n" + b"x" * 2000 + b"\r\n0\r\n\r\n",  # read over
    b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n",  # decoded over (filled below)
])
async def test_an_answer_over_the_limit_fails_and_its_connection_is_closed(
    raw_server: Any, client: ProviderHTTP, reply: bytes
) -> None:
    if b"gzip" in reply:
        packed = gzip.compress(b"x" * 100_000)
        reply = reply % len(packed) + packed
    base = await raw_server(_answering(reply))
    with pytest.raises(AnswerTooLarge, match="1000-byte limit"):
        await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=1000)
    await asyncio.sleep(0.05)
    assert client.open_connections == 0


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly",  # then closed
    b"NOT HTTP AT ALL\r\n\r\n",
    b"",  # closed without a byte
    b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\nxx",  # not what was asked for
])
async def test_a_broken_answer_is_answer_broken(raw_server: Any, client: ProviderHTTP, reply: bytes) -> None:
    base = await raw_server(_answering(reply, then_close=True))
    with pytest.raises(AnswerBroken):
        await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    await asyncio.sleep(0.05)
    assert client.open_connections == 0


async def test_a_silent_provider_times_out_within_the_total_and_is_closed(
    raw_server: Any, client: ProviderHTTP
) -> None:
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # until the client gives up
        closed.set()

    base = await raw_server(silent)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.post(f"{base}/x", b"{}", {}, total=0.3, connect=5, limit=LIMIT)
    assert 0.25 < time.monotonic() - started < 2
    await asyncio.wait_for(closed.wait(), 2)
    assert client.open_connections == 0


async def test_a_refused_connection_is_connect_failed(client: ProviderHTTP) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectFailed):
        await client.post(f"http://127.0.0.1:{port}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)


async def test_a_cancelled_call_closes_its_connection_and_the_next_call_opens_another(
    raw_server: Any, client: ProviderHTTP
) -> None:
    requests = 0

    async def slow_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        requests += 1
        mine = requests
        try:
            await _read_request(reader)
            if mine == 1:
                await reader.read()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read()
        finally:
            writer.close()

    base = await raw_server(slow_first)
    call = asyncio.ensure_future(client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.sleep(0.05)
    assert client.open_connections == 0
    answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    assert answer.body == b"ok" and requests == 2


async def test_a_kept_connection_the_server_closed_is_not_used_again(raw_server: Any, client: ProviderHTTP) -> None:
    base = await raw_server(_answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", then_close=True))
    assert (await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)).body == b"ok"
    await asyncio.sleep(0.05)  # the server's close arrives while the connection is idle
    assert client.open_connections == 0
    assert (await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)).body == b"ok"


async def test_idle_connections_close_after_the_keepalive(echo: tuple[Echo, str]) -> None:
    _, base = echo
    http = ProviderHTTP(keepalive_timeout=0.1)
    try:
        await http.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert http.open_connections == 1
        await asyncio.sleep(0.4)
        assert http.open_connections == 0
    finally:
        await http.close()


@pytest.mark.parametrize("headers", [
    {"X-Evil": "a\r\nX-Injected: yes"},
    {"X-Evil\r\nX-Injected": "yes"},
    {"X-Evil": "a\nb"},
    {"Host": "elsewhere"},
    {"content-length": "1"},
    {"Transfer-Encoding": "chunked"},
])
async def test_headers_that_would_change_the_request_are_refused(
    echo: tuple[Echo, str], client: ProviderHTTP, headers: dict[str, str]
) -> None:
    server, base = echo
    with pytest.raises(ValueError):
        await client.post(f"{base}/x", b"{}", headers, total=5, connect=5, limit=LIMIT)
    assert server.peers == []


async def test_a_closed_client_closes_its_connections_and_refuses_calls(echo: tuple[Echo, str]) -> None:
    _, base = echo
    http = ProviderHTTP()
    await http.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    await http.close()
    assert http.closed and http.open_connections == 0
    with pytest.raises(RuntimeError, match="closed"):
        await http.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to serve TLS with")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def test_https_is_verified_against_the_trust_store(
    aiohttp_server: Any, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    echo = Echo()
    server = await aiohttp_server(echo.app, ssl=served)
    url = f"https://localhost:{server.port}/v1/x"

    trusting = ssl.create_default_context(cafile=str(cert))
    http = ProviderHTTP(ssl_context=trusting)
    untrusting = ProviderHTTP()  # the system's store, which does not hold this certificate
    try:
        answer = await http.post(url, b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert answer.status == 200 and len(echo.peers) == 1
        with pytest.raises(ConnectFailed):
            await untrusting.post(url, b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert len(echo.peers) == 1
    finally:
        await http.close()
        await untrusting.close()


# -- as a provider uses it ------------------------------------------------------------------

def _provider(base: str, tmp_path: Path, **extra: Any) -> OpenAIProvider:
    lines = [f"providers:\n  up:\n    type: openai\n    base_url: {base}\n    api_key: sk-up\n"]
    lines += [f"    {name}: {value}\n" for name, value in extra.items()]
    lines.append("models:\n  - name: '*'\n    deployments: [{provider: up, model: '*'}]\n")
    path = tmp_path / "gateway.yaml"
    path.write_text("".join(lines))
    env = {"GATEWAY_CONFIG": str(path)}
    return OpenAIProvider(load_config(load_settings(env), env).providers["up"], aiohttp.ClientSession(),
                          request_timeout=5)


async def _closed(provider: OpenAIProvider) -> None:
    await provider.close()
    await provider._session.close()


async def test_a_provider_answers_whole_calls_over_it_and_closes_it(raw_server: Any, tmp_path: Path) -> None:
    body = b'{"id": "c", "choices": [], "usage": {"prompt_tokens": 1}}'
    base = await raw_server(_answering(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)))
    provider = _provider(base, tmp_path)
    try:
        reply = await provider.chat({"model": "m", "messages": []}, stream=False, headers={})
        assert reply.status == 200 and reply.answer == {"id": "c", "choices": [], "usage": {"prompt_tokens": 1}}
        assert provider.http.open_connections == 1
    finally:
        await _closed(provider)
    assert provider.http.closed and provider.http.open_connections == 0


@pytest.mark.parametrize("reply, error", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n", UpstreamBodyTooLarge),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\ncut", UpstreamProtocolError),
    (None, UpstreamTimeoutError),
])
async def test_a_provider_maps_its_failures(raw_server: Any, tmp_path: Path, reply: bytes | None,
                                           error: type[Exception]) -> None:
    base = await raw_server(_answering(reply, then_close=True) if reply is not None else _answering())
    provider = _provider(base, tmp_path, timeout_seconds=0.3, max_response_bytes=1024)
    try:
        with pytest.raises(error) as raised:
            await provider.chat({"model": "m", "messages": []}, stream=False, headers={})
        assert type(raised.value) is error
        assert "127.0.0.1" not in str(raised.value)  # never the upstream's address to a client
    finally:
        await _closed(provider)


async def test_a_provider_that_cannot_connect_is_a_connect_error(tmp_path: Path) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    provider = _provider(f"http://127.0.0.1:{port}", tmp_path)
    try:
        with pytest.raises(UpstreamConnectError):
            await provider.chat({"model": "m", "messages": []}, stream=False, headers={})
    finally:
        await _closed(provider)


def test_it_runs_on_uvloop_as_the_gateway_does() -> None:
    """The gateway's loop is uvloop's, whose transports and ``create_connection`` differ
    from asyncio's (no ``happy_eyeballs_delay``, for one)."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        echo = Echo()
        runner = web.AppRunner(echo.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        http = ProviderHTTP()
        try:
            for _ in range(2):
                answer = await http.post(f"http://localhost:{port}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
                assert answer.status == 200
            assert len(set(echo.peers)) == 1 and http.open_connections == 1
        finally:
            await http.close()
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def test_an_interim_answer_is_passed_over_for_the_answer_after_it(raw_server: Any, client: ProviderHTTP) -> None:
    base = await raw_server(_answering(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal"))
    answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    assert (answer.status, answer.body) == (200, b"final")


async def test_a_timer_due_as_the_answer_ends_leaves_the_next_call_on_the_connection_alone(
    raw_server: Any, client: ProviderHTTP
) -> None:
    """A call's total bound is bound to that call: the connection it was on, given to the
    next call, is not closed under it when the first call's timer comes due."""
    base = await raw_server(_answering(*[b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"] * 2))
    first = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    # Fire the first call's timer by hand while the second call is on the same connection.
    (connection,) = client._idle[next(iter(client._idle))]
    stale = asyncio.get_running_loop().create_future()
    second = asyncio.ensure_future(client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT))
    await asyncio.sleep(0)
    connection.time_out(stale)
    assert (await second).body == first.body == b"ok"
    assert client.open_connections == 1


async def test_a_host_is_looked_up_once_per_ttl_and_again_after_a_failed_connect(
    echo: tuple[Echo, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, base = echo
    port = int(base.rsplit(":", 1)[1])
    loop = asyncio.get_running_loop()
    lookups: list[str] = []
    real = loop.getaddrinfo

    async def counted(host: str, *args: Any, **kwargs: Any) -> Any:
        lookups.append(host)
        await asyncio.sleep(0.01)  # long enough for a burst to find the lookup in flight
        return await real(host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", counted)
    http = ProviderHTTP(dns_ttl=0.3)
    try:
        url = f"http://localhost:{port}/x"
        answers = await asyncio.gather(*(http.post(url, b"{}", {}, total=5, connect=5, limit=LIMIT) for _ in range(4)))
        assert [a.status for a in answers] == [200] * 4 and http.open_connections == 4
        assert lookups == ["localhost"]  # four new connections, one lookup
        await http.post(url, b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert lookups == ["localhost"]
        await asyncio.sleep(0.35)  # past the TTL
        for connection in list(http._all):
            connection.abort()  # force a new connection
        await asyncio.sleep(0.01)
        await http.post(url, b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert lookups == ["localhost"] * 2

        # A connect that fails forgets the addresses: the next one looks the host up again.
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        for _ in range(2):
            with pytest.raises(ConnectFailed, match=f"localhost:{dead}"):
                await http.post(f"http://localhost:{dead}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
        assert lookups == ["localhost"] * 4
    finally:
        await http.close()


async def test_headers_without_end_are_cut_off(raw_server: Any, client: ProviderHTTP) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Long: ")
        try:
            for _ in range(40):  # 2.5 MiB of one header's value, never ended
                writer.write(b"x" * 65536)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    base = await raw_server(endless)
    with pytest.raises(AnswerBroken, match="headers are over"):
        await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)


async def test_a_large_answer_read_with_its_headers_is_not_mistaken_for_long_headers(
    raw_server: Any, client: ProviderHTTP
) -> None:
    body = b"y" * (3 * 1024 * 1024)
    base = await raw_server(_answering(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)))
    answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=4 * 1024 * 1024)
    assert answer.body == body


async def test_a_compressed_answer_declared_over_the_limit_fails_before_it_is_read(
    raw_server: Any, client: ProviderHTTP
) -> None:
    """The limit bounds the bytes on the wire too: a compressed body declared longer than
    it fails at its headers, not after it was held whole (or at the call's timeout)."""
    async def declared_then_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 10000000\r\n\r\n\x1f\x8b")
        await writer.drain()
        await reader.read()
        writer.close()

    base = await raw_server(declared_then_silent)
    started = time.monotonic()
    with pytest.raises(AnswerTooLarge, match="10000000 bytes"):
        await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=1000)
    assert time.monotonic() - started < 2


async def test_a_close_delimited_answer_that_does_not_decode_is_answer_broken(
    raw_server: Any, client: ProviderHTTP
) -> None:
    base = await raw_server(_answering(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Encoding: gzip\r\n\r\nnot gzip at all", then_close=True))
    started = time.monotonic()
    with pytest.raises(AnswerBroken, match="does not decode"):
        await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    assert time.monotonic() - started < 2  # failed when the connection closed, not at the timeout


async def test_a_second_answer_nobody_asked_for_closes_the_connection(raw_server: Any, client: ProviderHTTP) -> None:
    one = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none"
    two = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\ntwo"
    base = await raw_server(_answering(one + two))
    answer = await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)
    assert answer.body == b"one"
    await asyncio.sleep(0.05)
    assert client.open_connections == 0  # its state is unknown: not kept for the next call


async def test_bytes_on_an_idle_connection_close_it(raw_server: Any, client: ProviderHTTP) -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"unasked")  # while the connection waits in the pool
        await writer.drain()
        await reader.read()
        writer.close()

    base = await raw_server(chatty)
    assert (await client.post(f"{base}/x", b"{}", {}, total=5, connect=5, limit=LIMIT)).body == b"ok"
    assert client.open_connections == 1
    await asyncio.sleep(0.2)
    assert client.open_connections == 0
