"""The stream tap's accounting: a content chunk read from its template (not parsed) counts
exactly what a parse of every payload counts, malformed payloads included.

Each payload reaches the tap as the relay hands it over: its event (one ``data:`` line)
to the template's look (``inspect_event``), and, if that did not account for it, the
payload itself to the parse (``inspect``)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.core.usage import CallRecord, StreamTap
from gateway.edge.relays import TapRelay


class _ParsingTap(StreamTap):
    """The tap without templates: every payload parsed (the reference)."""

    def _learn_template(self, data: bytes, choice: Any) -> None:
        return None


def _chunk(content: str | None, *, finish: str | None = None, role: bool = False, rid: str = "chatcmpl-1",
           pad: str | None = None, index: int = 0) -> bytes:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    if role:
        delta = {"role": "assistant", **delta}
    obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": "m",
                           "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
                           "usage": None}
    if pad is not None:
        obj["obfuscation"] = pad  # OpenAI's: random characters, a random length
    return orjson.dumps(obj)


def _padded(content: str, pad: str) -> bytes:
    return _chunk(content, pad=pad)


def _inspect(tap: StreamTap, payload: bytes) -> bool:
    """What the relay does with the event of ``payload``; True: forwarded."""
    return tap.inspect_event(b"data: " + payload + b"\n\n") or tap.inspect(payload)


def _feed(tap: StreamTap, payloads: list[bytes]) -> tuple[Any, ...]:
    said = [_inspect(tap, p) for p in payloads]
    usage = tap.final_usage(7)
    return (said, tap.malformed, tap.response_id, tap.response_model, tap.finish_reasons, tap.text_chars,
            tap.chunks, tap.kept_text(), usage.prompt_tokens, usage.completion_tokens, usage.estimated)


USAGE = b'{"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}'
PLAIN = [_chunk("", role=True), _chunk("Hello"), _chunk(" world"), _chunk(" again")]

STREAMS = {
    "plain": [*PLAIN, _chunk(None, finish="stop"), USAGE, b"[DONE]"],
    "escapes and non-ASCII": [*PLAIN, _chunk('say "hi"\n'), _chunk(" caf\u00e9 \u2603"),
                              _chunk(" \U0001f600"), _chunk(" tail")],
    "ascii-escaped non-ASCII": [*PLAIN, _chunk(" cafX").replace(b"X", b"\\u00e9"), _chunk(" tail")],
    "raw control character": [*PLAIN, _chunk(" a").replace(b" a", b" \n a")],
    "raw quote": [*PLAIN, _chunk(" ab").replace(b" ab", b' "b')],
    "invalid UTF-8": [*PLAIN, _chunk(" ab").replace(b"ab", b"\xff\xfe")],
    "truncated": [*PLAIN, _chunk(" cut")[:-12]],
    # The template's two parts overlapping by the text's closing quote: no text, not JSON.
    "shorter than the template": [*PLAIN, _chunk("").replace(b'"content":""', b'"content":"')],
    "another id": [*PLAIN, _chunk(" other", rid="chatcmpl-2"), _chunk(" more")],
    "two choices": [*PLAIN, b'{"id":"chatcmpl-1","choices":[{"delta":{"content":"a"}},'
                            b'{"delta":{"content":"bc"},"finish_reason":"stop"}]}', _chunk(" x")],
    "finish in a text chunk": [*PLAIN, _chunk(" end", finish="length")],
    "usage on a text chunk": [*PLAIN, _chunk(" u").replace(b'"usage":null', b'"usage":{"prompt_tokens":1}')],
    "content key in the text": [_chunk("x", role=True), _chunk('"content":"'), _chunk("content"), _chunk(" y")],
    "not an object": [*PLAIN, b"[1,2]", b'"text"', _chunk(" z")],
    "padded": [_chunk("", role=True, pad="AAatV4uAp"), _padded("Once", "RmYFV8ad65HP9F"), _padded(" upon", ""),
               _padded(" a", "x1"), _padded(" time", "Qz"), _chunk(None, finish="stop", pad="IPio8"), USAGE],
    "padding not plain": [_padded("a", "x"), _padded("b", "yy"), _padded("c", 'q"q'), _padded("d", "p\\q"),
                          _padded("e", "caf\u00e9"), _padded("f", "z").replace(b'"z"', b'"\xff"'),
                          _padded("g", "z").replace(b'"z"', b'"\x01"'), _padded("h", "z")[:-2]],
    "padding twice": [_padded("a", "x"), _padded("b", "y").replace(b"}", b',"obfuscation":"w"}', 1),
                      _padded("c", "z")],
    "padding before the text": [b'{"id":"c","obfuscation":"p","choices":[{"delta":{"content":"a"}}]}',
                                b'{"id":"c","obfuscation":"q","choices":[{"delta":{"content":"bb"}}]}'],
    "two choices taking turns": [_chunk(str(i), index=i % 2) for i in range(12)],
}


@pytest.mark.parametrize("keep_text", [False, True])
@pytest.mark.parametrize("wants_usage", [False, True])
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_the_template_counts_what_a_parse_of_every_chunk_counts(name: str, wants_usage: bool, keep_text: bool) -> None:
    payloads = STREAMS[name]
    fast = StreamTap(client_wants_usage=wants_usage, keep_text=keep_text)
    assert _feed(fast, payloads) == _feed(_ParsingTap(client_wants_usage=wants_usage, keep_text=keep_text), payloads)


def test_plain_text_chunks_are_read_from_the_template() -> None:
    tap = StreamTap(client_wants_usage=False, keep_text=True)
    for payload in PLAIN[:2]:
        _inspect(tap, payload)
    assert tap._text_prefix is not None and tap._text_prefix.startswith(b'data: {"id":"chatcmpl-1"')
    assert tap._text_prefix.endswith(b'"content":"')
    assert tap._text_rest.startswith(b'"},"logprobs":null,"finish_reason":null}') and tap._pad_tail is None
    assert tap._text_rest.endswith(b'"usage":null}\n\n')
    assert tap.inspect_event(b"data: " + _chunk(" caf\u00e9") + b"\n\n")  # read from the template
    assert tap.text_chars == len("Hello caf\u00e9") and tap.kept_text() == "Hello caf\u00e9" and tap.chunks == 3


def test_openai_padding_is_left_free_by_the_template() -> None:
    tap = StreamTap(client_wants_usage=False, keep_text=True)
    _inspect(tap, _padded("Once", "RmYFV8ad65HP9F"))
    assert tap._text_rest.endswith(b'"obfuscation":"') and tap._pad_tail == b'"}\n\n'
    prefix = tap._text_prefix
    assert tap.inspect_event(b"data: " + _padded(" upon a", "x") + b"\n\n")
    assert tap._text_prefix is prefix and tap.kept_text() == "Once upon a"


def test_a_stream_whose_chunks_never_fit_a_template_stops_taking_them() -> None:
    tap = StreamTap(client_wants_usage=False)
    for i in range(12):
        _inspect(tap, _chunk(str(i), index=i % 2))
    assert tap._template_misses == 4 and tap.text_chars == 14


def _relayed(tap: StreamTap, events: list[bytes]) -> tuple[Any, ...]:
    relay = TapRelay(tap)
    out = [relay.feed(event) for event in events]
    record = CallRecord(request_id="r", api_key_id=None, subject_id=None, requested_model="m")
    relay.settle(record, 0.0, 7)
    return out, relay.done, record.response_id, record.finish_reasons, record.usage, record.chunks, record.completion


def test_the_relay_reads_events_from_the_template_as_a_parse_of_their_payloads() -> None:
    """Only a one-line event is read from the template: an event of several lines, a payload
    with newlines (never a template), ``data:`` without its space, a comment, all as parsed."""
    one_line = [b"data: " + p + b"\n\n" for p in PLAIN]
    pretty = _chunk(" pretty").replace(b'"choices":', b'\n"choices":')
    events = [
        *one_line,
        b"data: " + pretty.replace(b"\n", b"\ndata: ") + b"\n\n",  # its payload has a newline
        b"data: " + _chunk(" two").replace(b'"choices":', b'\ndata: "choices":') + b"\n\n",
        b"data:" + _chunk(" nospace") + b"\n\n",
        b": keep-alive\n\n",
        b"data: " + _chunk(" trailing") + b"\n: a comment\n\n",
        b"data: " + _chunk(" last") + b"\n\n",
        b"data: " + _chunk(None, finish="stop") + b"\n\n",
        b"data: " + USAGE + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    for keep_text in (False, True):
        fast = StreamTap(client_wants_usage=False, keep_text=keep_text)
        assert _relayed(fast, events) == _relayed(_ParsingTap(client_wants_usage=False, keep_text=keep_text), events)
        assert fast._text_prefix is not None and b"\n" not in fast._text_prefix
    tap = StreamTap(client_wants_usage=False)
    for payload in (pretty, pretty):  # a payload with a newline: never the template
        tap.inspect(payload)
    assert tap._text_prefix is None
