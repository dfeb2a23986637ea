"""The HTTP/1.1 client a provider's whole (non-streaming) answers travel over.

aiohttp's client is general: cookies, redirects, proxies, auth, multipart bodies, trace
signals, a stream reader per body. A provider's whole answer needs none of it: one POST
of bytes already encoded to a fixed origin, the status, the headers and the body back.
Under S1's load aiohttp's client ran about 3,300 Python instructions per call, more than
half of a bare aiohttp relay's whole budget, and about 45 µs of CPU (``python -m
bench.server_cpu``); this client does the same call in a fraction of that
(docs/benchmark.md, "The nineteenth pass"). Responses are parsed by ``httptools`` (the
llhttp parser uvicorn uses); TLS is the event loop's. Streams stay on aiohttp, whose
reader the stream relay is built around.

What it does:

- one connection per call, kept alive afterwards (``keepalive_timeout``) for the next
  call to the same origin (scheme, host, port), the most recently used first; a host's
  addresses looked up once per ``dns_ttl`` (one lookup shared by a burst of connects),
  and tried in turn 250 ms apart (RFC 8305);
- the request in one write: the request line, ``Host``, the caller's headers,
  ``Content-Length`` and the body;
- the answer whole: ``Content-Length``, chunked or (``Connection: close``) up to the
  end, at most ``limit`` bytes as sent and as decoded, decoded from gzip or deflate when
  the server compressed it (it is asked for identity, but a proxy may compress anyway);
- a ``total`` bound on the call and a ``connect`` bound on opening the connection;
- a connection whose answer did not complete (a timeout, a broken answer, a cancelled
  call) is closed, never reused.

Its failures are :class:`ConnectFailed` (no connection: refused, DNS, TLS), ``TimeoutError``
(a bound passed), :class:`AnswerBroken` (the connection closed, or the bytes were not
HTTP, before the answer ended) and :class:`AnswerTooLarge`; ``gateway.providers.base``
maps them to the providers' errors.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import zlib
from collections.abc import Mapping
from typing import Any

import aiohappyeyeballs
import httptools
import yarl
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["AnswerBroken", "AnswerTooLarge", "ConnectFailed", "ProviderHTTP", "WholeAnswer"]

#: Headers the client writes itself; a caller's own would contradict them.
_OWN_HEADERS = frozenset({"Host", "host", "HOST", "Content-Length", "content-length", "CONTENT-LENGTH",
                          "Transfer-Encoding", "transfer-encoding", "TRANSFER-ENCODING"})
#: Distinct URLs whose parsed form is kept (a provider calls a handful: one per model at most).
_MAX_TARGETS = 1024
#: The most an answer's status line and headers may take, counted by the bytes received
#: before they end (a read is at most 256 KiB, so the body read with them fits): a
#: provider sending headers without end is cut off, not buffered.
_MAX_HEAD_BYTES = 1024 * 1024
_HAPPY_EYEBALLS_DELAY = 0.25  # as aiohttp's connector: try the next address after 250 ms


class ConnectFailed(ConnectionError):
    """No connection to the provider: refused, unreachable, a name that does not resolve,
    a TLS handshake that failed."""


class AnswerBroken(ConnectionError):
    """The connection closed, or the bytes were not HTTP, before the answer ended."""


class AnswerTooLarge(Exception):
    """The answer is over the caller's ``limit`` (declared, as read, or decoded)."""


class WholeAnswer:
    """A provider's answer, read to its end."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: CIMultiDictProxy[str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def __repr__(self) -> str:
        return f"<WholeAnswer {self.status} {len(self.body)} bytes>"


class _Target:
    """A URL as the client sends to it: where to connect, and the request's first lines."""

    __slots__ = ("head", "host", "origin", "port", "tls")

    def __init__(self, url: yarl.URL) -> None:
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"not an http(s) URL: {url}")
        self.tls = url.scheme == "https"
        self.host = url.raw_host or url.host
        self.port = url.port or (443 if self.tls else 80)
        self.origin = (self.tls, self.host, self.port)
        host = url.host_port_subcomponent or self.host
        self.head = f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {host}\r\n"


class _Connection(asyncio.Protocol):
    """One connection: idle in its origin's pool, or reading one call's answer."""

    __slots__ = ("_body", "_chunked_or_sized", "_client", "_encoding", "_head_received", "_headers", "_limit",
                 "_parser", "_raw_headers", "_received", "_waiter", "idle_since", "origin", "transport")

    def __init__(self, client: ProviderHTTP, origin: tuple[bool, str, int]) -> None:
        self._client = client
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[WholeAnswer] | None = None
        self._raw_headers: list[tuple[str, str]] = []
        self._headers: CIMultiDictProxy[str] | None = None
        self._body: list[bytes] = []
        self._received = 0
        self._head_received = 0
        self._encoding = ""
        self._limit = 0
        self._chunked_or_sized = False
        self.idle_since = 0.0

    # -- one call ----------------------------------------------------------------
    def send(self, request: bytes, waiter: asyncio.Future[WholeAnswer], limit: int) -> None:
        self._waiter = waiter
        self._limit = limit
        assert self.transport is not None
        self.transport.write(request)

    def busy_with(self, waiter: asyncio.Future[WholeAnswer]) -> bool:
        return self._waiter is waiter

    def abort(self) -> None:
        """Close without reading on (the call failed or was given up): never reused."""
        self._waiter = None
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if self.transport is not None:
            self.transport.abort()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def time_out(self, waiter: asyncio.Future[WholeAnswer]) -> None:
        # Only the call the timer was set for: its answer may have ended just before the
        # timer fired, and the connection already carry the next call.
        if self._waiter is waiter:
            self._fail(TimeoutError("the provider did not answer in time"))

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes on an idle connection (or after an answer): nothing asked for them,
            # so the connection's state is unknown: close it.
            self.abort()
            return
        if self._headers is None:
            self._head_received += len(data)
            if self._head_received > _MAX_HEAD_BYTES:
                self._fail(AnswerBroken(f"the answer's headers are over {_MAX_HEAD_BYTES} bytes"))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # A callback's own error (the limit) comes wrapped, as the context.
            cause = exc.__context__
            self._fail(cause if isinstance(cause, AnswerTooLarge) else AnswerBroken(f"the answer is not HTTP/1.1: {exc}"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost says what it ended

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.forget(self)
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():
            return
        if self._headers is not None and not self._chunked_or_sized:
            # An answer without Content-Length or chunks ends where the connection does.
            try:
                waiter.set_result(self._answer())
            except (AnswerTooLarge, AnswerBroken) as failed:  # over the limit, or not decodable
                waiter.set_exception(failed)
            return
        waiter.set_exception(AnswerBroken("the provider closed the connection before the answer ended"))

    # -- httptools' callbacks --------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        headers = CIMultiDictProxy(CIMultiDict(self._raw_headers))
        self._raw_headers = []
        self._headers = headers
        self._encoding = headers.get("Content-Encoding", "").lower()
        declared = headers.get("Content-Length")
        self._chunked_or_sized = declared is not None or "chunked" in headers.get("Transfer-Encoding", "").lower()
        # The limit bounds the bytes on the wire too, compressed or not: a compressed body
        # longer than the limit does not decode to less (deflate never shrinks much data
        # that does not compress), and it must not be held whole before that is known.
        if declared is not None and declared.isdigit() and int(declared) > self._limit:
            raise AnswerTooLarge(f"upstream answer of {declared} bytes is over the {self._limit}-byte limit")

    def on_body(self, body: bytes) -> None:
        self._received += len(body)
        if self._received > self._limit:
            raise AnswerTooLarge(f"upstream answer is over the {self._limit}-byte limit")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._parser.get_status_code() < 200:
            # An interim answer (100 Continue, 103 Early Hints): the answer follows it.
            self._start_answer()
            return
        waiter = self._waiter
        if waiter is None:
            # A second answer in the bytes of the first: nothing asked for it.
            self.abort()
            return
        try:
            answer = self._answer()
        except (AnswerTooLarge, AnswerBroken) as exc:
            self._fail(exc)
            return
        self._waiter = None
        if self._parser.should_keep_alive():
            self._client.keep(self)
        elif self.transport is not None:
            self.transport.close()
        if not waiter.done():
            waiter.set_result(answer)

    def _answer(self) -> WholeAnswer:
        assert self._headers is not None
        body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        if self._encoding and self._encoding != "identity":
            body = _decoded(body, self._encoding, self._limit)
        answer = WholeAnswer(self._parser.get_status_code(), self._headers, body)
        self._start_answer()
        return answer

    def _start_answer(self) -> None:
        """Ready for the next answer's head (the connection is kept, or a 1xx came first)."""
        self._headers = None
        self._body = []
        self._received = 0
        self._head_received = 0
        self._encoding = ""


def _decoded(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("gzip", "x-gzip", "deflate"):
        # 47: a gzip or zlib header, told apart by the library; raw deflate (what some
        # servers send as "deflate") needs -15.
        wbits = 47 if encoding != "deflate" or body[:1] == b"\x78" else -zlib.MAX_WBITS
        decoder = zlib.decompressobj(wbits)
        try:
            out = decoder.decompress(body, limit + 1)
        except zlib.error as exc:
            raise AnswerBroken(f"the answer's {encoding} body does not decode: {exc}") from None
        if len(out) > limit or decoder.unconsumed_tail:
            raise AnswerTooLarge(f"upstream answer is over the {limit}-byte limit")
        return out
    raise AnswerBroken(f"the answer is encoded as {encoding!r}, which was not asked for")


class ProviderHTTP:
    """One provider's connections, and its whole calls over them.

    Made without I/O (a provider is built before the loop runs); :meth:`close` closes
    every connection it holds.
    """

    def __init__(self, *, keepalive_timeout: float = 30.0, ssl_context: ssl.SSLContext | None = None,
                 dns_ttl: float = 300.0) -> None:
        self._keepalive = keepalive_timeout
        self._ssl_context = ssl_context
        self._idle: dict[tuple[bool, str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._targets: dict[Any, _Target] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        #: (host, port) → (until when, addresses): a host's addresses are looked up once per
        #: ``dns_ttl`` (as the aiohttp connector's ``ttl_dns_cache`` did), and a burst of new
        #: connections shares one lookup in flight.
        self._dns_ttl = dns_ttl
        self._resolved: dict[tuple[str, int], tuple[float, list[Any]]] = {}
        self._resolving: dict[tuple[str, int], asyncio.Task[list[Any]]] = {}

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_connections(self) -> int:
        """Connections open now, idle or answering (for tests and diagnostics)."""
        return len(self._all)

    async def post(
        self, url: str | yarl.URL, body: bytes, headers: Mapping[str, str], *,
        total: float | None, connect: float | None, limit: int,
    ) -> WholeAnswer:
        """POST ``body`` to ``url`` with ``headers``; the answer, read whole.

        A ``str`` URL is encoded as yarl encodes it; a ``yarl.URL`` made with
        ``encoded=True`` is sent exactly as it is (a signed path).
        """
        if self._closed:
            raise RuntimeError("the provider's HTTP client is closed")
        target = self._targets.get(url)
        if target is None:
            target = self._target(url)
        if _OWN_HEADERS.isdisjoint(headers):
            lines = "\r\n".join(map(": ".join, headers.items()))
        else:
            raise ValueError("Host, Content-Length and Transfer-Encoding are the client's own headers")
        head = f"{target.head}{lines}\r\nContent-Length: {len(body)}\r\n\r\n" if lines else \
            f"{target.head}Content-Length: {len(body)}\r\n\r\n"
        if head.count("\n") != len(headers) + 4 or head.count("\r") != len(headers) + 4:
            # A header name or value holding a line break would start a header (or a
            # request) of its own: refused, as aiohttp refuses it.
            raise ValueError("a header holds a line break")
        request = head.encode("utf-8") + body
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total if total else None
        connection = self._take(target.origin, loop.time())
        if connection is None:
            bound = connect
            if deadline is not None:
                bound = min(bound, deadline - loop.time()) if bound else deadline - loop.time()
            connection = await self._connect(target, bound)
        waiter: asyncio.Future[WholeAnswer] = loop.create_future()
        connection.send(request, waiter, limit)
        timer = loop.call_at(deadline, connection.time_out, waiter) if deadline is not None else None
        try:
            return await waiter
        except BaseException:
            if connection.busy_with(waiter):  # cancelled mid-answer: the connection's state is unknown
                connection.abort()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def close(self) -> None:
        """Close every connection, idle or answering; later calls fail."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._all):
            connection.abort()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run

    # -- the pool ----------------------------------------------------------------------
    def _target(self, url: str | yarl.URL) -> _Target:
        target = _Target(url if isinstance(url, yarl.URL) else yarl.URL(url))
        if len(self._targets) >= _MAX_TARGETS:
            self._targets.clear()
        self._targets[url] = target
        return target

    def _take(self, origin: tuple[bool, str, int], now: float) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            transport = connection.transport
            if transport is not None and not transport.is_closing() and now - connection.idle_since < self._keepalive:
                return connection
            connection.abort()
        return None

    async def _connect(self, target: _Target, bound: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        context = self._ssl() if target.tls else None
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(bound):
                addresses = await self._addresses(target.host, target.port)
                # Every address in turn, the next one 250 ms after the last (RFC 8305), as
                # aiohttp's connector does: uvloop's create_connection cannot do it itself.
                sock = await aiohappyeyeballs.start_connection(
                    addresses, happy_eyeballs_delay=_HAPPY_EYEBALLS_DELAY, interleave=1)
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, target.origin), sock=sock, ssl=context,
                    server_hostname=target.host if context is not None else None,
                )
        except BaseException as exc:
            if sock is not None:
                sock.close()  # the TLS handshake failed or timed out: the socket is still ours
            # The address is for the log (the cause of the provider's error), never a client.
            where = f"{target.host}:{target.port}"
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"connecting to {where} timed out") from None
            if isinstance(exc, OSError):  # refused, unreachable, DNS (gaierror), TLS (SSLError)
                self._resolved.pop((target.host, target.port), None)  # the host may have moved: look again
                raise ConnectFailed(f"cannot connect to {where}: {type(exc).__name__}: {exc}") from exc
            raise
        if self._closed:
            connection.abort()
            raise RuntimeError("the provider's HTTP client is closed")
        self._all.add(connection)
        return connection

    async def _addresses(self, host: str, port: int) -> list[Any]:
        loop = asyncio.get_running_loop()
        key = (host, port)
        cached = self._resolved.get(key)
        if cached is not None and cached[0] > loop.time():
            return cached[1]
        lookup = self._resolving.get(key)
        if lookup is None:
            # A task of its own, shielded: one caller giving up does not fail the others'.
            lookup = loop.create_task(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            self._resolving[key] = lookup
            lookup.add_done_callback(lambda _: self._resolving.pop(key, None))
        addresses = await asyncio.shield(lookup)
        self._resolved[key] = (loop.time() + self._dns_ttl, addresses)
        return addresses

    def _ssl(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            # The system's trust store (SSL_CERT_FILE and SSL_CERT_DIR are honoured), made
            # on the first https connection: loading it takes milliseconds.
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    def keep(self, connection: _Connection) -> None:
        """An answer ended on a connection the server keeps open: idle until the next call."""
        if self._closed:
            connection.abort()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(connection.origin, []).append(connection)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._keepalive, self._close_expired)

    def forget(self, connection: _Connection) -> None:
        """``connection`` closed: out of the pool."""
        self._all.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    def _close_expired(self) -> None:
        self._sweep = None
        now = asyncio.get_running_loop().time()
        for idle in self._idle.values():
            for connection in [c for c in idle if now - c.idle_since >= self._keepalive]:
                idle.remove(connection)
                connection.abort()
        if any(self._idle.values()):
            self._sweep = asyncio.get_running_loop().call_later(self._keepalive, self._close_expired)
