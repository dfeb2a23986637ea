"""What the pipeline keeps of an opted-in call for its request log, while the call runs.

A call whose model group or key is listed under ``request_logs:`` gets a
:class:`BodyCapture`: the request as it went upstream (after the input policies, so a
redacted prompt is kept redacted, and a refused one is never kept), the whole answer as
the client got it (after the output policies), or, for a stream, its text assembled
from the events as they were relayed (after the stream's window: redacted text never
reaches it), per choice in index order. Nothing is encoded here: when the call ends the
references go to :mod:`actors.request_logs`, which encodes, cuts and writes them.

A stream's text is collected up to the size cap (``max_body_bytes`` characters, which is
at least that many bytes) and then only marked as cut, so a long stream costs bounded
memory. A stream replayed from the response cache keeps no answer text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.billing.request_log import CapturedCall
from gateway.core.request_log_config import RequestLogSettings
from gateway.core.usage import CallRecord
from gateway.protocols.sse import stream_texts

if TYPE_CHECKING:
    from gateway.http.state import GatewayState

__all__ = ["BodyCapture", "capture_for"]


class BodyCapture:
    """One opted-in call's bodies, gathered as it runs (see the module docstring)."""

    __slots__ = ("_chars", "_limit", "_settings", "_texts", "cut_short", "key_prefix", "model_group",
                 "request", "response")

    def __init__(self, settings: RequestLogSettings, model_group: str, key_prefix: str | None) -> None:
        self._settings = settings
        self._limit = settings.max_body_bytes
        self.model_group = model_group
        self.key_prefix = key_prefix
        #: The request as sent upstream (a JSON value); None until it is known to be sent.
        self.request: Any = None
        #: A whole answer's body as the client got it.
        self.response: bytes | None = None
        self._texts: dict[int, list[str]] | None = None
        self._chars = 0
        self.cut_short = False

    def answered(self, response: web.StreamResponse) -> None:
        """A whole answer, as it goes to the client."""
        if isinstance(response, web.Response) and isinstance(response.body, bytes | bytearray):
            self.response = bytes(response.body)

    def streamed(self, event: bytes, wire: str) -> None:
        """One stream event as relayed: its text joins the assembled answer."""
        if self._texts is None:
            self._texts = {}
        if self.cut_short:
            return
        for index, text in stream_texts(event, wire):
            room = self._limit - self._chars
            if len(text) > room:
                text, self.cut_short = text[:room], True
            self._texts.setdefault(index, []).append(text)
            self._chars += len(text)
            if self.cut_short:
                return

    def _stream_text(self) -> str | None:
        if self._texts is None:
            return None
        return "\n\n".join("".join(self._texts[i]) for i in sorted(self._texts))

    def finish(self, state: GatewayState, record: CallRecord) -> None:
        """The call ended: hand everything to the request-log actor (no encoding here)."""
        if state.request_logs is None:
            return
        text = self._stream_text()
        response: bytes | str | None = self.response if text is None else text
        state.request_logs.store(CapturedCall(
            record=record, model_group=self.model_group, key_prefix=self.key_prefix,
            request=self.request, response=response,
            response_kind=None if response is None else ("text" if text is not None else "body"),
            retention_days=self._settings.retention_days, max_body_bytes=self._limit,
            response_cut_short=self.cut_short,
        ))


def capture_for(state: GatewayState, model_group: str, key_prefix: str | None) -> BodyCapture | None:
    """A capture when the active config opts this call in, else None (one lookup)."""
    settings = state.config.request_logs
    if state.request_logs is None or not settings.enabled or not settings.applies(model_group, key_prefix):
        return None
    return BodyCapture(settings, model_group, key_prefix)
