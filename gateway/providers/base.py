"""What every provider offers the relay, and the errors it may raise.

A provider takes an OpenAI-shaped chat body and answers either a whole body
(:class:`UpstreamReply` with ``body``) or a stream of OpenAI SSE events (``events``).
Providers speaking another wire (Anthropic) translate both ways, so everything above
this module sees one shape. Foreign exceptions (aiohttp, asyncio) are translated here,
at the boundary, into :class:`ProviderError` subclasses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import aiohttp
import orjson
import yarl

from gateway.core.config import Deployment, ProviderConfig
from gateway.protocols.sse import EventSplitter, EventTooLarge
from gateway.providers.credentials import Credential
from gateway.providers.http_client import (
    AnswerBroken,
    AnswerTooLarge,
    ConnectFailed,
    ProviderHTTP,
    WholeAnswer,
)

__all__ = [
    "EventStream",
    "Provider",
    "ProviderError",
    "ReplyEvents",
    "Timeouts",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamReply",
    "UpstreamTimeoutError",
    "WholeAnswer",
    "IDENTITY_ENCODING",
    "TRANSPORT_FAILURES",
    "UpstreamBodyTooLarge",
    "UpstreamCredentialRejected",
    "error_detail",
    "fetch_model_ids",
    "json_object",
    "map_transport_errors",
    "read_reply",
    "read_whole",
    "stream_chunks",
    "stream_timeout",
    "transport_error",
    "watched",
    "whole_answer_of",
]

#: Sent with every provider request. aiohttp offers ``gzip, deflate`` by default, and the
#: session does not decompress by itself; asking for identity spares the CPU, and each
#: call still passes ``auto_decompress=True`` so an upstream (or a proxy in front of
#: it) that compresses anyway is decoded, whole answers and streams alike.
IDENTITY_ENCODING = {"Accept-Encoding": "identity"}

#: How long a provider's idle connection is kept for the next call (as the aiohttp
#: session's connector keeps its own).
_KEEPALIVE_SECONDS = 30.0


class ProviderError(Exception):
    """The call to the provider failed before it gave an HTTP answer."""

    #: Could the request have reached the provider (and been billed there)?
    maybe_delivered: bool = True


class UpstreamConnectError(ProviderError):
    """No connection could be made: the request never left, so a retry is always safe."""

    maybe_delivered = False


class UpstreamTimeoutError(ProviderError):
    """The provider did not answer (or went silent) within its timeout."""


class UpstreamProtocolError(ProviderError):
    """The provider answered something that is not HTTP/JSON/SSE as promised."""


class UpstreamCredentialRejected(ProviderError):
    """The provider answered 401/403: it refused the gateway's credential for it.

    Such a call was refused, not run, so moving on to another deployment is safe.
    """

    maybe_delivered = False


class UpstreamBodyTooLarge(UpstreamProtocolError):
    """A whole answer grew past the provider's ``max_response_bytes``."""


#: The transport failures a provider call can meet: :func:`_translated` has a ProviderError
#: for each of them, and for nothing else.
TRANSPORT_FAILURES = (aiohttp.ClientError, ConnectionError, TimeoutError, EventTooLarge, AnswerTooLarge)


def _translated(exc: BaseException) -> ProviderError | None:
    """The ProviderError for one of :data:`TRANSPORT_FAILURES`, most specific first; else None.

    Messages are fixed phrases: aiohttp's own text names hosts, addresses and URLs of
    the upstream, which must not reach a client. The original stays the ``__cause__``,
    for the log line and the span.
    """
    if not isinstance(exc, TRANSPORT_FAILURES):
        return None
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ClientConnectorDNSError | ConnectFailed):
        return UpstreamConnectError("could not connect to the provider")
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeoutError("upstream timed out")
    if isinstance(exc, EventTooLarge):
        return UpstreamProtocolError(f"upstream stream broken: {exc}")
    if isinstance(exc, aiohttp.ClientPayloadError | AnswerBroken):
        return UpstreamProtocolError("upstream body broken")
    if isinstance(exc, AnswerTooLarge):
        return UpstreamBodyTooLarge(str(exc))
    return UpstreamProtocolError("upstream connection failed")  # any other ClientError or ConnectionError


def transport_error(exc: BaseException) -> ProviderError:
    """The ProviderError for one of :data:`TRANSPORT_FAILURES`, to raise ``from exc``.

    ``try: ... except TRANSPORT_FAILURES as exc: raise transport_error(exc) from exc`` is
    :func:`map_transport_errors` without a context manager: where a call's every answer
    passes (a whole answer's request and its body), the ``with`` cost 20 instructions a
    use (its ``__enter__`` and ``__exit__`` calls); an unraised ``try`` costs none.
    """
    error = _translated(exc)
    assert error is not None, f"not a transport failure: {exc!r}"
    return error


def error_detail(exc: ProviderError) -> str:
    """``exc`` with its foreign cause, for the log and the span only (never a client)."""
    cause = exc.__cause__
    return f"{exc}: {type(cause).__name__}: {cause}" if cause is not None else str(exc)


class _TransportErrorMap:
    """``with map_transport_errors():`` — a plain class, not ``@contextmanager``.

    It wraps every provider call (twice per whole answer): a generator-based context
    manager cost ~1.2 µs a use in the S1 profile, this one ~0.1 µs.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if exc is None:
            return False
        error = _translated(exc)
        if error is None:
            return False
        raise error from exc


_TRANSPORT_ERROR_MAP = _TransportErrorMap()


def map_transport_errors() -> _TransportErrorMap:
    """Translate aiohttp/asyncio failures into ProviderError, most specific first."""
    return _TRANSPORT_ERROR_MAP


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How patient one call is, resolved per route group (group → provider → global).

    A whole answer must arrive within ``total``; a stream has no total (it may last long)
    but may not stay silent longer than ``idle``, before its first chunk or between two.
    """

    #: Opening the TCP (and TLS) connection.
    connect: float
    #: A whole (non-streaming) call, from sending to the last byte.
    total: float
    #: The longest silence of a stream, first chunk included.
    idle: float


@dataclass(slots=True)
class UpstreamReply:
    """A provider's HTTP answer: whole (``body``) or streaming (``events``)."""

    status: int
    headers: Mapping[str, str]
    body: bytes = b""
    #: ``body`` parsed, when the provider already parsed it (a 2xx whole answer is
    #: checked to be a JSON object): usage and the cache read this instead of parsing again.
    answer: dict[str, Any] | None = None
    events: AsyncIterator[bytes] | None = None
    #: The protocol of ``body`` / ``events``: "chat" (the internal shape, what
    #: :meth:`Provider.chat` answers), "anthropic" (:meth:`Provider.messages`, as sent)
    #: or "responses" (:meth:`Provider.responses`, as sent).
    wire: str = "chat"
    _release: Callable[[], Awaitable[None] | None] | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def retry_after(self) -> float | None:
        raw = self.headers.get("retry-after") or self.headers.get("Retry-After")
        if raw is None:
            return None
        try:
            return max(0.0, float(raw))
        except ValueError:
            return None

    async def release(self) -> None:
        """Give the connection back (or close it); safe to call twice."""
        release, self._release = self._release, None
        if release is not None:
            result = release()
            if asyncio.iscoroutine(result):
                await result


class Provider:
    """Base of every provider: one upstream account reached over a shared session."""

    #: Value of ``gen_ai.provider.name`` for spans.
    system: str = "openai"
    #: The region this provider (or this view of it, :meth:`for_deployment`) sends to, for
    #: a type whose deployments may name their own (Bedrock); None: a type without regions.
    region: str | None = None
    #: Whether :meth:`embeddings` is served; dispatch passes over deployments that are not.
    serves_embeddings: bool = False
    #: The header this wire sends the key in, and how the value is written.
    key_header: tuple[str, str] = ("Authorization", "Bearer {}")
    #: Whether :meth:`messages` and :meth:`count_tokens` speak Anthropic's Messages API
    #: natively (a ``/v1/messages`` call then passes through instead of being translated).
    speaks_messages: bool = False
    #: Whether :meth:`responses` speaks OpenAI's Responses API natively (set per provider
    #: by ``responses_api: true``; a ``/v1/responses`` call then passes through).
    speaks_responses: bool = False

    def __init__(self, config: ProviderConfig, *, request_timeout: float) -> None:
        self.config = config
        self.speaks_responses = config.responses_api
        self.name = config.name
        #: The provider key; re-read from its file when rotated (see credentials.py).
        self.credential = Credential(config.api_key, config.api_key_file, provider=config.name)
        self._keyed_for: str | None = None
        self._keyed: dict[str, str] = {}
        self.request_timeout = config.timeout or request_timeout
        self.idle_timeout = config.idle_timeout or request_timeout
        #: What a call gets when its route group sets no timeouts of its own.
        self.timeouts = Timeouts(config.connect_timeout, self.request_timeout, self.idle_timeout)
        #: The connections whole answers travel over (streams go over the shared aiohttp
        #: session, whose reader the stream relay is built around).
        self.http = ProviderHTTP(keepalive_timeout=_KEEPALIVE_SECONDS)

    def for_deployment(self, deployment: Deployment) -> Provider:
        """The provider a call to ``deployment`` goes through: this one, or, for a type whose
        deployments may name their own region (Bedrock), a view of it in that region."""
        return self

    async def chat(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        """Send one chat call; for a 2xx stream, ``events`` yields OpenAI SSE events.

        ``timeouts`` are the route group's (default: the provider's own).
        """
        raise NotImplementedError

    async def messages(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        """Send an Anthropic Messages body unchanged (only where :attr:`speaks_messages`)."""
        raise UpstreamProtocolError(f"provider {self.name} does not speak the Messages API")

    async def responses(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        headers: Mapping[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamReply:
        """Send a Responses API body unchanged (only where :attr:`speaks_responses`)."""
        raise UpstreamProtocolError(f"provider {self.name} does not speak the Responses API")

    async def count_tokens(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        """Anthropic's own token count of a Messages body (only where :attr:`speaks_messages`)."""
        raise UpstreamProtocolError(f"provider {self.name} does not count tokens")

    async def list_models(self) -> list[str]:
        """Upstream model ids, for ``/v1/models`` under wildcard routes; [] if unknown."""
        return []

    async def embeddings(
        self, body: dict[str, Any], *, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> UpstreamReply:
        """Send one embeddings call (OpenAI shape); ``timeouts`` as for :meth:`chat`."""
        raise UpstreamProtocolError(f"provider {self.name} does not serve embeddings")

    @property
    def address(self) -> str | None:
        """Host of the provider, for ``server.address``."""
        return None

    @property
    def passthrough_base(self) -> str:
        """Where ``/passthrough/{provider}/{path}`` sends ``path`` ("" if nowhere)."""
        return self.config.base_url

    async def passthrough_request(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[str | yarl.URL, dict[str, str]]:
        """Where a pass-through call of ``path`` (decoded, under :attr:`passthrough_base`)
        and ``query`` (as the client wrote it) goes, and the headers carrying the
        provider's credential for it (they replace the forwarded ``headers`` of the same name).
        A provider whose signature covers the request (Bedrock's SigV4) signs it here."""
        url = f"{self.passthrough_base}/{path}"
        return (f"{url}?{query}" if query else url), await self.credential_headers()

    def passthrough_model(self, path: str) -> str | None:
        """The model a pass-through ``path`` names, for a wire with the model in its URL
        (Gemini's ``.../models/{model}:method``, Bedrock's ``model/{modelId}/...``); else None."""
        return None

    def passthrough_payloads(self, content_type: str) -> Callable[[bytes], list[bytes]] | None:
        """For an answer streamed in frames of the vendor's own (neither JSON nor SSE):
        a reader turning the body's chunks into the JSON payloads they carry, so their
        usage can be read on the side; None for every other answer."""
        return None

    async def credential_headers(self) -> dict[str, str]:
        """The headers carrying this provider's credential (for pass-through calls)."""
        key = self.credential.current()
        if not key:
            return {}
        name, form = self.key_header
        return {name: form.format(key)}

    def keyed_headers(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` plus the current key; rebuilt only when the key changed (rotation).

        ``base`` must be the same mapping on every call of one provider.
        """
        key = self.credential.current()
        if key is not self._keyed_for or not self._keyed:
            self._keyed_for = key
            self._keyed = dict(base)
            if key:
                name, form = self.key_header
                self._keyed[name] = form.format(key)
        return self._keyed

    async def post_whole(
        self, url: str | yarl.URL, data: bytes, headers: Mapping[str, str], timeouts: Timeouts | None = None
    ) -> WholeAnswer:
        """POST ``data`` and read the whole answer (at most ``max_response_bytes``), with
        the call's ``total`` and ``connect`` bounds; transport failures as ProviderErrors."""
        bounds = timeouts or self.timeouts
        try:
            return await self.http.post(url, data, headers, total=bounds.total, connect=bounds.connect,
                                        limit=self.config.max_response_bytes)
        except TRANSPORT_FAILURES as exc:
            raise transport_error(exc) from exc

    async def close(self) -> None:
        """Release what the provider holds beyond the shared session: its whole answers'
        connections (subclasses holding more close that too, then call this)."""
        await self.http.close()


def _taken_bound(resp: aiohttp.ClientResponse) -> float | None:
    """The request's ``sock_read`` bound, taken over from aiohttp (None: no bound to keep,
    the whole body is read already or none was asked for)."""
    connection = resp.connection
    protocol = connection.protocol if connection is not None else None
    idle = protocol.read_timeout if protocol is not None else None
    if protocol is None or not idle:
        return None
    protocol.read_timeout = None  # aiohttp's timer is disarmed at the next read; ours bounds from here
    return idle


def stream_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """A streamed body's chunks as they arrive (``resp.content.iter_any()``), the silence
    between two bounded by the request's ``sock_read`` (its :class:`Timeouts` ``idle``)
    with one timer per bound rather than one per chunk.

    aiohttp enforces ``sock_read`` by cancelling and re-arming a timer on every read: on a
    relayed stream that was 6 % of the gateway's CPU under S3's load. Here aiohttp keeps the
    bound up to the headers (and the bytes read with them); from there each chunk only
    notes the time, and the one timer, when it fires, either waits on until the last read's
    bound or fails the read as aiohttp would (``SocketTimeoutError``, the connection closed).
    Bytes that came and wait unread (the relay's client is slow to take them) are not a
    silence of the upstream: the bound waits on, as aiohttp's does while bytes arrive.
    An SSE answer is read by :class:`EventStream`, with the same bound.
    """
    idle = _taken_bound(resp)
    if idle is None:
        return resp.content.iter_any()
    return _SilenceBound(resp, idle)


class _SilenceBound:
    """:func:`stream_chunks`' iterator: ``readany`` until the end, behind a lazy idle timer."""

    __slots__ = ("_content", "_idle", "_last_read", "_loop", "_received_at_read", "_resp", "_timer")

    def __init__(self, resp: aiohttp.ClientResponse, idle: float | None) -> None:
        self._resp = resp
        self._content: Any = resp.content
        self._idle = idle or 0.0
        self._loop = asyncio.get_running_loop()
        self._last_read = self._loop.time()
        #: The body's bytes received as of the last read (``readany`` takes all there are).
        self._received_at_read = self._content.total_bytes
        #: None: no bound (the whole body is read already, or none was asked for).
        self._timer: asyncio.TimerHandle | None = (
            self._loop.call_at(self._last_read + idle, self._check) if idle else None
        )

    def __aiter__(self) -> _SilenceBound:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except BaseException:
            self._disarm()
            raise
        if chunk:
            self._last_read = self._loop.time()
            self._received_at_read = self._content.total_bytes
            return chunk
        self._disarm()
        raise StopAsyncIteration

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._resp.closed:
            return  # released by a relay that stopped reading (its client left): nothing to bound
        now = self._loop.time()
        if self._content.total_bytes != self._received_at_read:
            # Bytes came since the last read and wait for the relay (its client is slow):
            # the upstream is not silent, and must not be blamed for a timeout.
            self._timer = self._loop.call_at(now + self._idle, self._check)
            return
        due = self._last_read + self._idle
        if now < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        # What aiohttp's own sock_read timer does: the waiting read raises, and the
        # connection is closed (a half-read body is never reused). Set before close(),
        # which would otherwise fail the read as a mere closed connection.
        self._content.set_exception(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))
        self._resp.close()


class ReplyEvents:
    """What a stream reply's ``events`` are once dispatch has them: an async iterator of
    events that can take back the first one (read ahead by dispatch) and tell whoever
    watches it how the stream ended, without a wrapping generator per stream.

    :meth:`watch` puts ``first`` back in front and names the end: the events holding
    ``marker`` that ``ends`` says are the wire's end. ``failed`` is called once if the
    stream breaks (a :class:`ProviderError`) or ends without its end event; never when
    the reader stops reading (its client left) or another error ends it.

    The attributes below are each subclass's slots (none here: a reader may also be a
    :class:`_SilenceBound`, whose slots come first).
    """

    _queued: list[Any]
    _marker: bytes | None
    _ends: Callable[[bytes], bool]
    _failed: Callable[[], object] | None

    def __aiter__(self) -> ReplyEvents:
        return self

    async def __anext__(self) -> bytes:
        raise NotImplementedError

    async def relay(self, deliver: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Give each event to ``deliver`` in turn, to the stream's end, awaiting what it
        returns (a write's drain) before the next; raises what iterating would raise, and
        what ``deliver`` raises. This one iterates; :class:`EventStream` pushes."""
        async for event in self:
            waiting = deliver(event)
            if waiting is not None:
                await waiting

    def watch(self, first: bytes, ends: Callable[[bytes], bool], marker: bytes, failed: Callable[[], object]) -> None:
        self._queued.append(first)  # given again before anything queued after it
        self._ends = ends
        # None once the end came (or nobody asks): no event is looked at for it any more.
        self._marker = None if ends(first) else marker
        self._failed = failed

    def _broken(self, exc: BaseException) -> None:
        """The stream ends with ``exc``: a ProviderError is the watcher's failure."""
        failed, self._failed = self._failed, None
        if failed is not None and isinstance(exc, ProviderError):
            failed()

    def _over(self) -> None:
        """The stream ended: without its end event, the watcher's failure."""
        failed, self._failed = self._failed, None
        if failed is not None and self._marker is not None:
            failed()


def _never_ends(event: bytes) -> bool:
    return False


class _Watched(ReplyEvents):
    """Any other reply's events (a translated or replayed stream) made a :class:`ReplyEvents`."""

    __slots__ = ("_ends", "_failed", "_inner", "_marker", "_over_already", "_queued")

    def __init__(self, inner: AsyncIterator[bytes]) -> None:
        self._inner = inner
        self._queued = []
        self._marker = None
        self._ends = _never_ends
        self._failed = None
        self._over_already = False

    async def __anext__(self) -> bytes:
        queued = self._queued
        if queued:
            event: bytes = queued.pop()
        elif self._over_already:
            raise StopAsyncIteration
        else:
            try:
                event = await self._inner.__anext__()
            except StopAsyncIteration:
                self._over_already = True
                self._over()
                raise
            except BaseException as exc:
                self._over_already = True
                self._broken(exc)
                raise
        marker = self._marker
        if marker is not None and event.rfind(marker) >= 0 and self._ends(event):
            self._marker = None
        return event


def watched(events: AsyncIterator[bytes]) -> ReplyEvents:
    """``events`` as a :class:`ReplyEvents` (itself, when it is one already)."""
    return events if isinstance(events, ReplyEvents) else _Watched(events)


class _Exhausted:
    """The body of a stream that is over: every read is its end."""

    __slots__ = ()

    total_bytes = 0

    async def readany(self) -> bytes:
        return b""


_EXHAUSTED = _Exhausted()


class _PushedBody(aiohttp.StreamReader):
    """aiohttp's reader of a streamed body while :meth:`EventStream.relay` takes its bytes
    as aiohttp's parser hands them over (the class of the reader, switched for that time):
    each chunk goes to the stream, which splits it and gives its events on at once, rather
    than into the reader's buffer for a read coroutine to be woken for. The end, a failure
    or a stall switches the class back first, so that they and everything after are the
    reader's own (read as :meth:`EventStream.__anext__` reads).

    No slot of its own (a class switch needs the same layout): the stream it feeds is kept
    in the reader's ``_timer``, which only its read methods use, and which the stream puts
    back when it switches the class back. ``_cursor`` moves with ``total_bytes`` as a read
    would move it, so the reader's bookkeeping of HTTP chunk ends is right once it reads
    again.
    """

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        if data:
            self.total_bytes += len(data)
            self._cursor += len(data)
            self._timer._pushed(self, data)  # type: ignore[attr-defined]
        return False

    def end_http_chunk_receiving(self) -> None:
        pass  # a chunk's end matters to the reader's reads only: nothing was buffered

    def feed_eof(self) -> None:
        self._timer._stall(self, None)  # type: ignore[attr-defined]
        aiohttp.StreamReader.feed_eof(self)

    def set_exception(self, *args: Any, **kwargs: Any) -> None:
        self._timer._stall(self, None)  # type: ignore[attr-defined]
        aiohttp.StreamReader.set_exception(self, *args, **kwargs)


class EventStream(_SilenceBound, ReplyEvents):
    """An SSE answer as its events, one class-based iterator per stream: each ``__anext__``
    reads a chunk behind :func:`stream_chunks`' silence bound, splits it into events
    (:class:`~gateway.protocols.sse.EventSplitter`: a chunk that is one event is that event,
    the others of a chunk wait in a queue), and translates a transport failure into a
    :class:`ProviderError` as :func:`map_transport_errors` does. ``translate``, if given,
    turns each event into the events relayed (a provider speaking another wire).

    It replaces four layers of async generators (the bound, the split, the error mapping
    and dispatch's watch): a chunk is one coroutine over aiohttp's read, not five.

    :meth:`relay` pushes instead: while nothing waits to be read, each chunk is split and
    its events given on from aiohttp's ``data_received`` (:class:`_PushedBody`), and the
    relaying coroutine is woken only when a write must wait for its drain, a chunk fails
    or the body ends. A relayed event then costs no future, no task step and no coroutine
    resumed through the handler's frames: about a third of the CPU a relay spends per
    event, reading one event per read as streams arrive (docs/benchmark.md, "The sixteenth
    pass").
    """

    __slots__ = ("_aiohttp_timer", "_deliver", "_ends", "_failed", "_marker", "_over_already", "_queued",
                 "_splitter", "_translate", "_wake")

    def __init__(self, resp: aiohttp.ClientResponse,
                 translate: Callable[[bytes], list[bytes]] | None = None) -> None:
        _SilenceBound.__init__(self, resp, _taken_bound(resp))
        self._splitter = EventSplitter()
        self._translate = translate
        #: Events (and at most one error, last) still to give, the next one last.
        self._queued = []
        self._marker = None
        self._ends = _never_ends
        self._failed = None
        self._over_already = False
        #: While :meth:`relay` pushes: who takes the events, the relaying coroutine's
        #: wake-up, and the reader's own ``_timer`` (its slot holds this stream meanwhile).
        self._deliver: Callable[[bytes], Awaitable[None] | None] | None = None
        self._wake: asyncio.Future[Awaitable[None] | None] | None = None
        self._aiohttp_timer: Any = None

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        queued = self._queued
        if queued:
            event = queued.pop()
            if event.__class__ is not bytes:
                raise event  # the overflow of a chunk whose complete events came first
        else:
            content = self._content
            while True:
                try:
                    chunk = await content.readany()
                    if chunk:
                        self._last_read = self._loop.time()
                        self._received_at_read = content.total_bytes
                        events = self._chunk_events(chunk)
                        if isinstance(events, bytes):
                            event = events
                            break
                    else:
                        events = self._end()
                        if self._translate is not None:
                            events = [out for event in events for out in self._translate(event)]
                except StopAsyncIteration:
                    raise
                except BaseException as exc:
                    failure = self._failed_chunk(exc)
                    if failure is exc:
                        raise
                    if failure is None:
                        return await self.__anext__()
                    raise failure from exc
                if events:
                    event = events[0]
                    if len(events) > 1:
                        events.reverse()
                        events.pop()
                        queued += events
                    break
        marker = self._marker
        if marker is not None and event.rfind(marker) >= 0 and self._ends(event):
            self._marker = None
        return event

    def _chunk_events(self, chunk: bytes) -> bytes | list[bytes]:
        """The complete events ``chunk`` brings (translated, if the stream translates), or
        the chunk itself when it is one whole event."""
        # Most chunks of a stream: one whole event on one line, nothing held before it. It
        # is the event as it came (EventSplitter.feed's first case, the same test inline: a
        # call and a list fewer per event). CR is looked for as an int: memchr, a fifth of
        # `b"\r" in` and of find's cost on an S3 chunk.
        if (self._translate is None and self._splitter.between_events
                and chunk.find(b"\n") == len(chunk) - 2 and chunk[-1] == 0x0A
                and chunk[0] > 0x20 and 0x0D not in chunk):
            return chunk
        events = self._splitter.feed(chunk)
        if self._translate is not None:
            events = [out for event in events for out in self._translate(event)]
        return events

    def _failed_chunk(self, exc: BaseException) -> BaseException | None:
        """What a failed read or split raises: ``exc`` itself (no transport failure), the
        :class:`ProviderError` it is, or None when the events a chunk completed before
        its overflow come first (queued, the error after them)."""
        error = self._failing(exc)
        if error is None:
            return exc
        if isinstance(exc, EventTooLarge) and exc.events:
            self._pending(exc.events, error, exc)
            return None
        error.__cause__ = exc
        return error

    async def relay(self, deliver: Callable[[bytes], Awaitable[None] | None]) -> None:
        content = self._content
        if content.__class__ is not aiohttp.StreamReader:
            await ReplyEvents.relay(self, deliver)  # a reader of another kind: iterated
            return
        while True:
            # What is here already (the event dispatch read ahead, the rest of a chunk
            # whose write had to wait, bytes that came meanwhile, the end or a failure)
            # is read as iterating reads it; then the events are pushed until one of
            # those is here again.
            while (self._queued or self._over_already or content._buffer or content._eof
                   or content._exception is not None):
                try:
                    event = await self.__anext__()
                except StopAsyncIteration:
                    return
                waiting = deliver(event)
                if waiting is not None:
                    await waiting
            wake = self._wake = self._loop.create_future()
            self._deliver = deliver
            self._aiohttp_timer = content._timer
            content._timer = self  # type: ignore[assignment]
            content.__class__ = _PushedBody
            try:
                waiting = await wake
            finally:
                if content.__class__ is _PushedBody:  # cancelled (the client left) while pushing
                    self._unpush(content)
            if waiting is not None:
                await waiting

    def _unpush(self, content: aiohttp.StreamReader) -> None:
        """The reader is its own again (its class and its ``_timer``)."""
        content.__class__ = aiohttp.StreamReader
        content._timer = self._aiohttp_timer
        self._deliver = None

    def _stall(self, content: aiohttp.StreamReader, waiting: Awaitable[None] | None,
               failure: BaseException | None = None) -> None:
        """Stop pushing; the relaying coroutine wakes to await ``waiting``, to raise
        ``failure``, or to read what is there (the end, or what came meanwhile)."""
        self._unpush(content)
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            if failure is not None:
                wake.set_exception(failure)
            else:
                wake.set_result(waiting)

    def _pushed(self, content: aiohttp.StreamReader, chunk: bytes) -> None:
        """One chunk from aiohttp's parser while pushing: its events given on; never raises
        (it runs inside aiohttp's ``data_received``)."""
        self._last_read = self._loop.time()
        self._received_at_read = content.total_bytes
        try:
            events = self._chunk_events(chunk)
        except BaseException as exc:  # noqa: BLE001 - raised by the relaying coroutine, not here
            failure = self._failed_chunk(exc)
            self._stall(content, None, failure)
            return
        if isinstance(events, bytes):
            self._give(content, events)
            return
        for i, event in enumerate(events):
            if not self._give(content, event):
                rest = events[i + 1:]
                rest.reverse()
                self._queued += rest
                return

    def _give(self, content: aiohttp.StreamReader, event: bytes) -> bool:
        """One event to the relay while pushing; False if pushing stopped (its write must
        wait for a drain, or the relay raised)."""
        marker = self._marker
        if marker is not None and event.rfind(marker) >= 0 and self._ends(event):
            self._marker = None
        try:
            waiting = self._deliver(event)  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - the relay refused the stream, or its client left: raised by the relaying coroutine
            self._stall(content, None, exc)
            return False
        if waiting is not None:
            self._stall(content, waiting)
            return False
        return True

    def _end(self) -> list[bytes]:
        """The body is over: its unterminated tail as an event (once), else the end."""
        self._disarm()
        if not self._over_already:
            self._over_already = True
            self._content = _EXHAUSTED
            tail = self._splitter.end()
            if tail is not None:
                return [tail]
        self._over()
        raise StopAsyncIteration

    def _failing(self, exc: BaseException) -> ProviderError | None:
        """The stream fails with ``exc``: nothing more is read; the ProviderError it is
        (None: ``exc`` is one already, or no transport failure), the watcher told."""
        self._disarm()
        self._over_already = True
        self._content = _EXHAUSTED
        error = _translated(exc)
        self._broken(error if error is not None else exc)
        return error

    def _pending(self, events: list[bytes], error: ProviderError, cause: BaseException) -> None:
        """A chunk completed ``events`` then overflowed: they are given, then ``error``."""
        if self._translate is not None:
            events = [out for event in events for out in self._translate(event)]
        error.__cause__ = cause
        queued: list[Any] = [error, *reversed(events)]
        self._queued = queued


async def read_whole(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The (decoded) body of ``resp``, refusing past ``limit`` bytes.

    Raises :class:`UpstreamBodyTooLarge` as soon as the declared length or the bytes
    read so far pass the bound, like the SSE reader's bound on one event, so a provider
    answering without end costs at most ``limit`` bytes of memory.
    """
    declared = resp.content_length
    if declared is not None and declared > limit and not resp.headers.get("Content-Encoding"):
        raise UpstreamBodyTooLarge(f"upstream answer of {declared} bytes is over the {limit}-byte limit")
    content = resp.content
    if content.is_eof():
        # The whole body came with the headers (most whole answers): take it as it is,
        # without an iterator and a read coroutine per chunk.
        try:
            whole = content.read_nowait(-1)
        except TRANSPORT_FAILURES as exc:
            raise transport_error(exc) from exc
        if len(whole) > limit:
            raise UpstreamBodyTooLarge(f"upstream answer is over the {limit}-byte limit")
        return whole
    body = bytearray()
    with map_transport_errors():
        async for chunk in content.iter_chunked(256 * 1024):
            body += chunk
            if len(body) > limit:
                raise UpstreamBodyTooLarge(f"upstream answer is over the {limit}-byte limit")
    return bytes(body)


async def read_reply(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of a provider's answer (bounded as :func:`read_whole`); the connection
    is given back after it, or closed when reading failed (a half-read body must not be reused)."""
    try:
        raw = await read_whole(resp, limit)
    except BaseException:
        resp.close()
        raise
    resp.release()
    return raw


async def whole_answer_of(resp: aiohttp.ClientResponse, limit: int) -> WholeAnswer:
    """A streaming request's answer that is not a stream (an error, or a provider that
    answered whole), read as :meth:`Provider.post_whole` reads one."""
    raw = await read_reply(resp, limit)
    return WholeAnswer(resp.status, resp.headers, raw)


def json_object(raw: bytes, vendor: str) -> dict[str, Any]:
    """``raw`` parsed as the JSON object a vendor's answer must be; else the provider failed."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamProtocolError(f"{vendor} answered a body that is not JSON") from None
    if not isinstance(answer, dict):
        raise UpstreamProtocolError(f"{vendor} answered JSON that is not an object")
    return answer


def stream_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """aiohttp's timeout for a stream (whole answers go over :class:`ProviderHTTP`, with
    ``total``): a stream may last long; what must stay short is the silence between chunks."""
    return aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect, sock_read=timeouts.idle)


#: A model list is a convenience: never wait long for it.
_LIST_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_LIST_MAX_BYTES = 8 * 1024 * 1024


async def fetch_model_ids(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]
) -> list[str]:
    """The ``id`` of each entry of an OpenAI/Anthropic-shaped model list at ``url``.

    Raises ProviderError when the provider cannot be reached or answers no such list.
    """
    with map_transport_errors():
        async with session.get(
            url, headers={**headers, **IDENTITY_ENCODING}, timeout=_LIST_TIMEOUT, auto_decompress=True
        ) as resp:
            payload = await read_whole(resp, _LIST_MAX_BYTES)
    if resp.status != 200:
        raise UpstreamProtocolError(f"model list answered {resp.status}")
    try:
        data = orjson.loads(payload).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        raise UpstreamProtocolError("model list is not JSON") from None
    if not isinstance(data, list):
        raise UpstreamProtocolError("model list has no data")
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
