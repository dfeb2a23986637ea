"""Structured logs: one JSON object per line, request ids on every line, no secrets.

``serve`` calls :func:`configure_logging` once. Records are handed to a queue on the
event loop and formatted and written by a worker thread (a slow stderr pipe must not
stall requests). Every line carries the request id of the request being handled when
it was logged (a context variable the edge middleware sets), so an error can be
matched to its access line.

Secrets never reach the output: every formatted line, traceback included, is passed
through :class:`Redactor`, which masks gateway keys (``llmg_...``), bearer tokens,
``sk-`` style provider keys and every secret value the configuration holds (admin
token, provider API keys). Lines are built from fields chosen in code; the access line
(logger ``gateway.access``) carries the key's id, never the key.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import logging
import logging.handlers
import operator
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

import orjson

__all__ = [
    "ACCESS_LOGGER",
    "JsonFormatter",
    "LogSetup",
    "Redactor",
    "TextFormatter",
    "bind_request_id",
    "configure_logging",
    "current_request_id",
    "hand_off_fields",
    "lines_made_here",
    "log_fields",
    "reset_request_id",
]

ACCESS_LOGGER = "gateway.access"
LOG_FORMATS = ("json", "text")

#: The request being handled by the current task. A context variable, not shared state:
#: each request's task sees its own value, and the worker thread gets it stamped on
#: each record before the handoff.
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("gateway_request_id", default=None)

#: Masked wherever they appear: gateway keys, bearer credentials, OpenAI/Anthropic-style keys.
_SECRET_PATTERNS = re.compile(
    r"llmg_[A-Za-z0-9_\-]{16,}"
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/\-]{6,}=*"
    r"|\bsk-[A-Za-z0-9_\-]{8,}"
)
#: Substrings without which no pattern can match: a line with none skips the regex
#: (a scan for them is ~50x cheaper, and almost every line has none). "bearer" is
#: matched in any case, so it is looked for in the lowered line (BeArEr counts too).
_MARKERS = ("llmg_", "sk-")
REDACTED = "[REDACTED]"
#: Records logged on the event loop reach the writer thread at most this late, in batches.
BATCH_SECONDS = 0.02
MAX_BATCH = 1000
#: The keys every line starts with, in order (then the request id, then the fields).
_HEAD_KEYS = frozenset({"ts", "level", "logger", "msg"})
#: Heads :meth:`JsonFormatter.fields_line` remembers (a logger and message each; code-chosen).
_MAX_HEADS = 64
#: Record attributes that are logging's own, not fields to emit.
_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "fields", "request_id"}


# The context variable's own methods, not functions around them: each request binds, reads
# and resets its id once (a Python frame around each was ~6 instructions of 7).
#: Make a request id the current request's for log lines (edge middleware); returns the
#: token :func:`reset_request_id` takes.
bind_request_id: Callable[[str], contextvars.Token[str | None]] = _REQUEST_ID.set
#: Undo a :func:`bind_request_id` by its token.
reset_request_id: Callable[[contextvars.Token[str | None]], None] = _REQUEST_ID.reset
#: The current request's id, or None.
current_request_id: Callable[[], str | None] = _REQUEST_ID.get


class Redactor:
    """Masks secret-looking text and known secret values in a string."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: tuple[str, ...] = ()
        #: The secrets in the same order, each with the markers it holds (see :meth:`json_line`).
        self._marked: tuple[tuple[str, bool, bool], ...] = ()
        #: The secrets holding no marker, in the same order (all a line without one can hold).
        self._unmarked: tuple[str, ...] = ()
        self.add(secrets)

    def add(self, secrets: Iterable[str | None]) -> None:
        """Also mask these exact values (too-short values would mask ordinary words).

        Each is also known in its JSON-escaped spelling, so it is found in an encoded line.
        """
        fresh = {s for s in secrets if s and len(s) >= 6}
        fresh |= {orjson.dumps(s).decode()[1:-1] for s in fresh}
        known = set(self._secrets) | fresh
        # Longest first, so a secret containing another is masked whole.
        self._secrets = tuple(sorted(known, key=len, reverse=True))
        self._marked = tuple((s, "llmg_" in s, "sk-" in s) for s in self._secrets)
        self._unmarked = tuple(s for s, llmg, sk in self._marked if not llmg and not sk)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        for marker in _MARKERS:
            if marker in text:
                return _SECRET_PATTERNS.sub(_mask, text)
        if "bearer" in text.lower():
            return _SECRET_PATTERNS.sub(_mask, text)
        return text

    def json_line(self, text: str) -> str:
        """:meth:`__call__` of a line orjson made (the same result), with fewer scans of it.

        * A secret holding a marker (``sk-``, ``llmg_``) is looked for only if the line
          holds that marker: without it the secret cannot be there, and no replacement can
          make it appear (``[REDACTED]`` holds no marker, nor ``[`` or ``]`` one would span).
          Most lines hold neither marker, and go through only the secrets without one
          (known apart: checking each secret's markers was half of an access line's
          redaction, ~30 instructions).
        * A bearer credential needs whitespace after the word, and orjson writes none but
          the space inside strings (control characters are escaped; any other whitespace
          is not ASCII): an ASCII line without a space needs no lowered copy.

        A line that may need masking goes the way :meth:`__call__` goes.
        """
        has_llmg = "llmg_" in text
        has_sk = "sk-" in text
        if not has_llmg and not has_sk:
            for secret in self._unmarked:
                if secret in text:
                    text = text.replace(secret, REDACTED)
            if text.isascii() and " " not in text:
                return text
            if "bearer" in text.lower():
                return _SECRET_PATTERNS.sub(_mask, text)
            return text
        replaced = False
        for secret, needs_llmg, needs_sk in self._marked:
            if (needs_llmg and not has_llmg) or (needs_sk and not has_sk):
                continue
            if secret in text:
                text = text.replace(secret, REDACTED)
                replaced = True
        if replaced:
            has_llmg, has_sk = "llmg_" in text, "sk-" in text
        if has_llmg or has_sk:
            return _SECRET_PATTERNS.sub(_mask, text)
        if text.isascii() and " " not in text:
            return text
        if "bearer" in text.lower():
            return _SECRET_PATTERNS.sub(_mask, text)
        return text

    def keeps_json_lines(self, text: str) -> bool:
        """Whether :meth:`json_line` would leave as it is every line orjson made that ``text``
        holds (a batch's lines joined): one scan of a batch for what almost no line holds,
        instead of a call and its scans per line (:func:`_write_batch`).

        Exact where it says yes: a marker, a secret or "bearer" (in the lowered text) found
        nowhere in the text is in none of its lines, and an ASCII text without a space has no
        line with one. A no (one of them is somewhere, maybe only across two lines) leaves
        each line to :meth:`json_line`.
        """
        if "llmg_" in text or "sk-" in text:
            return False
        for secret in self._unmarked:
            if secret in text:
                return False
        return (text.isascii() and " " not in text) or "bearer" not in text.lower()


def _mask(match: re.Match[str]) -> str:
    found = match.group(0)
    if found.startswith("llmg_"):
        return "llmg_" + REDACTED
    if found[:6].lower() == "bearer":
        return "Bearer " + REDACTED
    return "sk-" + REDACTED


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, request id, fields.

    Structured fields come from ``extra={"fields": {...}}`` (and any other ``extra``
    keys); the whole line is redacted after encoding, exception text included.
    """

    def __init__(self, redactor: Redactor | None = None) -> None:
        super().__init__()
        self.redactor = redactor or Redactor()
        #: Encoded heads of :meth:`fields_line`, by logger and message.
        self._heads: dict[tuple[str, str], str] = {}

    def fields_line(
        self, name: str, msg: str, fields: dict[str, Any], created: float, request_id: str | None
    ) -> str:
        """The line :meth:`format` makes of an INFO record with these and nothing else
        (no args, extras, traceback): what :func:`log_fields` hands the writer ready-made.

        The same text, made cheaper: the head (level, logger, message) is encoded once
        per logger and message, and the fields in one orjson call after it.
        """
        if not fields.keys().isdisjoint(_HEAD_KEYS):  # a field replaces part of the head
            out: dict[str, Any] = {"ts": _iso(created), "level": "info", "logger": name, "msg": msg}
            if request_id is not None:
                out["request_id"] = request_id
            out.update(fields)
            return self._encode(out)
        if request_id is not None and next(iter(fields), None) != "request_id":
            # The request id goes right after the head; a field of that name gives its value.
            fields = {"request_id": request_id, **fields}
        return self.ordered_line(name, msg, fields, created)

    def ordered_line(self, name: str, msg: str, fields: dict[str, Any], created: float) -> str:
        """:meth:`fields_line` of fields that are as the line has them already: none of the
        head's keys, and ``request_id`` first if a request id is bound. The same text,
        without looking (what the writer makes of :func:`hand_off_fields`' parts, in
        :func:`_write_batch`)."""
        return self.redactor.json_line(self.unredacted_line(name, msg, fields, created))

    def unredacted_line(self, name: str, msg: str, fields: dict[str, Any], created: float) -> str:
        """:meth:`ordered_line` before its redaction: what the writer makes of each line
        :func:`hand_off_fields` handed over, then redacts a batch at a time."""
        head = self._heads.get((name, msg))
        if head is None:
            head = self._head(name, msg)
        body = orjson.dumps(fields, default=str).decode()
        return f'{{"ts":"{_iso(created)}{head}}}' if body == "{}" else f'{{"ts":"{_iso(created)}{head},{body[1:]}'

    def _head(self, name: str, msg: str) -> str:
        """What follows the time in a line of ``name`` and ``msg`` (remembered for a few)."""
        head = '",' + orjson.dumps({"level": "info", "logger": name, "msg": msg}).decode()[1:-1]
        if len(self._heads) < _MAX_HEADS:
            self._heads[name, msg] = head
        return head

    def _encode(self, out: dict[str, Any]) -> str:
        # Redacted once encoded: message, fields and traceback alike (fields hold no
        # secret by design; this is the net under that). Known secrets are matched in
        # their JSON-escaped spelling too, and the patterns use no escaped characters.
        return self.redactor.json_line(orjson.dumps(out, default=str).decode())

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or _REQUEST_ID.get()
        if request_id is not None:
            out["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        for name in vars(record).keys() - _STANDARD_ATTRS:
            if not name.startswith("_"):
                out.setdefault(name, getattr(record, name))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return self._encode(out)


class TextFormatter(logging.Formatter):
    """The human format (``LOG_FORMAT=text``), redacted like the JSON one."""

    def __init__(self, redactor: Redactor | None = None) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.redactor = redactor or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None) or _REQUEST_ID.get()
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        elif request_id is not None:
            text += f" request_id={request_id}"
        return self.redactor(text)


_thread_id = threading.get_ident


def _never() -> bool:
    return False


class _HandOff(logging.handlers.QueueHandler):
    """Queues records for the writer thread, with what only the loop's task knows.

    The message is rendered and the traceback formatted here (their objects must not
    cross threads); the request id is read from this task's context. Records logged on
    an event loop are handed off in batches (:meth:`enqueue`).
    """

    def __init__(self, records: queue.SimpleQueue[Any]) -> None:
        super().__init__(records)
        #: Records, lines :func:`log_fields` made ready (str) and the parts of lines
        #: :func:`hand_off_fields` handed over (tuples), in the order logged.
        self._batch: list[logging.LogRecord | str | _LineParts] = []
        #: Whether the loop the batch was begun on runs (its ``is_running``), and that loop's
        #: thread (see :meth:`enqueue`).
        self._batch_loop_runs: Callable[[], bool] = _never
        self._batch_thread = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # No copy: this is the root's only handler, and the record is not used after.
        record.msg = record.getMessage()
        record.args = None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get()
        return record

    def enqueue(self, record: logging.LogRecord | str | _LineParts) -> None:
        """Batch records logged on an event loop; hand others off at once, in order.

        Every handoff wakes the writer thread, which then competes with the loop for the
        GIL and, on a pinned core, for the CPU: per record, that was the largest cost of
        an access line in the S1 profile. Batched, a busy loop wakes it 50 times a second.

        A record joining a batch on the thread whose loop began it, while that loop runs,
        is logged on that loop (whatever runs on the thread runs inside it): known without
        asking for the running loop (~0.15 µs under uvloop, twice a request).
        """
        batch = self._batch
        if batch and self._batch_thread == _thread_id() and self._batch_loop_runs():
            batch.append(record)
            if len(batch) >= MAX_BATCH:
                self.flush_batch()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # Off any loop. On the batch's own thread (its loop ended, or code around it),
            # the batch goes first, so the lines stay in order. Another thread (an
            # exporter's, a worker's) never touches the batch: swapping it out there could
            # land between the loop's read of the list and its append, and lose that line.
            if self._batch_thread == _thread_id():
                self.flush_batch()
            self.queue.put_nowait(record)
            return
        self._batch.append(record)
        if len(self._batch) == 1:
            self._batch_loop_runs, self._batch_thread = loop.is_running, _thread_id()
            loop.call_later(BATCH_SECONDS, self.flush_batch)
        elif len(self._batch) >= MAX_BATCH:
            self.flush_batch()

    def flush_batch(self) -> None:
        """Hand what is batched to the writer thread (also run by :meth:`LogSetup.stop`)."""
        with self.lock:  # type: ignore[union-attr]
            batch, self._batch = self._batch, []
        if batch:
            self.queue.put_nowait(batch)


#: The hand-off :func:`configure_logging` installed and the JSON formatter of its writer,
#: which :func:`log_fields` uses to make its lines on the loop (None: logging is someone
#: else's, or in the text format).
_installed: _HandOff | None = None
_installed_json: JsonFormatter | None = None
#: That hand-off when its writer is the JSON one (lines are made for it), else None.
_json_handoff: _HandOff | None = None


def log_fields(logger: logging.Logger, msg: str, fields: dict[str, Any]) -> None:
    """``logger.info(msg, extra={"fields": fields})``, cheap enough for lines logged per request.

    When the line could only ever reach the hand-off :func:`configure_logging` installed
    with the JSON format (the root's one handler; no handler, filter or disabling on the
    logger or its parents), it is made here by the writer's own formatter and handed over
    as text, in order with the records around it: the same line, without the standard
    library's walk per call (``makeRecord``, filters, the handler lock, ``prepare``) and
    without the writer formatting it again with the GIL held (4.1-4.9 µs a line before,
    loop and writer together; 2.1-3.0 µs now). Anything else (the text format, a test's
    ``caplog``, an operator's own handler) gets ``logger.info``, and sees every line.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    handoff, formatter = _installed, _installed_json
    if handoff is None or formatter is None or not _reaches_only(logger, handoff):
        logger.info(msg, extra={"fields": fields})
        return
    handoff.enqueue(formatter.fields_line(logger.name, msg, fields, time.time(), _REQUEST_ID.get()))


def lines_made_here(logger: logging.Logger) -> bool:
    """Whether :func:`log_fields` would make ``logger``'s INFO lines itself (its fast path,
    level aside): what :func:`hand_off_fields` asks first."""
    handoff = _json_handoff
    return handoff is not None and _reaches_only(logger, handoff)


def hand_off_fields(logger: logging.Logger, msg: str, fields: dict[str, Any]) -> bool:
    """:func:`log_fields`' fast path itself if :func:`lines_made_here` (level aside), for
    fields as the line has them (:meth:`JsonFormatter.ordered_line`: none of the head's
    keys, ``request_id`` first if a request id is bound): True once the line is handed
    over. False, nothing done: the caller logs its fields the standard way
    (:func:`log_fields`). A caller may build the fields the cheap way for this (values
    orjson writes as the standard path writes their ``str()``, e.g. a UUID; in the line's
    order). One call for both (the question was a call of its own, ~10 instructions).

    The line is made by the writer thread, from its parts handed over in the batch as they
    are: ``fields`` is the caller's no longer (built for this call, of immutable values).
    The writer makes a batch's lines (:meth:`JsonFormatter.unredacted_line`) and redacts
    them with one scan of the batch's text (:meth:`Redactor.keeps_json_lines`), not each
    line's own ``json_line``. Measured with valgrind (machine instructions a line, the
    access and billing lines, batches of 40; with the line's assembly then written out in
    the batch's loop, a call a line fewer): loop and writer together 33,000 -> 29,200; the
    loop's share 31,000 -> 9,500. Most of the loop's cut is moved, not removed.
    """
    handoff = _json_handoff
    if handoff is None or not _reaches_only(logger, handoff):
        return False
    parts = (logger.name, msg, fields, time.time())
    batch = handoff._batch
    if batch and handoff._batch_thread == _thread_id() and handoff._batch_loop_runs():
        # _HandOff.enqueue's first case inline (its call was ~8 instructions a line).
        batch.append(parts)
        if len(batch) >= MAX_BATCH:
            handoff.flush_batch()
    else:
        handoff.enqueue(parts)
    return True


def _reaches_only(logger: logging.Logger, handoff: _HandOff) -> bool:
    """Whether a record of ``logger`` would be handled by ``handoff`` alone, unfiltered.

    Asked twice a request (the access and billing lines): the walk of the logger tree
    (79 instructions a line) runs only when :data:`_reached` cannot vouch for the answer.
    """
    known = _reached.get(logger)
    if known is not None:
        made_for, read, tree, handoff_state = known
        try:
            if made_for is handoff and read(logger) == tree and _HANDOFF_STATE(handoff) == handoff_state:
                return True
        except AttributeError:  # the chain is shorter than it was: a parent was reassigned
            pass
    return _walk(logger, handoff)


def _walk(logger: logging.Logger, handoff: _HandOff) -> bool:
    """:func:`_reaches_only` found the long way; a yes is remembered in :data:`_reached`."""
    node: Any = logger
    names: list[str] = []
    state: list[Any] = []
    prefix = ""
    while node is not None:
        if node.disabled or node.filters:
            return False
        if node.parent is None:  # the root
            handlers = node.handlers
            if not (len(handlers) == 1 and handlers[0] is handoff and not handoff.filters
                    and handoff.level <= logging.INFO):
                return False
            names += (prefix + "disabled", prefix + "filters", prefix + "parent", prefix + "handlers")
            state += (node.disabled, node.filters, None, handlers)
            _remember(logger, names, state, handoff)
            return True
        if node.handlers or not node.propagate:
            return False
        names += (prefix + "disabled", prefix + "filters", prefix + "handlers", prefix + "propagate", prefix + "parent")
        state += (node.disabled, node.filters, node.handlers, node.propagate, node.parent)
        prefix += "parent."
        node = node.parent
    return False


def _remember(logger: logging.Logger, names: list[str], state: list[Any], handoff: _HandOff) -> None:
    """Note that ``logger`` reaches only ``handoff`` while the attributes ``names`` (dotted
    from ``logger``) read ``state`` again: every value the walk's yes rested on.

    The check compares values, so a change made in place is seen: the lists (handlers,
    filters) are kept as copies and compared by content (a handler or filter compares by
    identity: logging's own define no equality); flags and parents are immutable values
    or compare by identity. Anything of another kind is not remembered (walked each time).
    """
    if len(_reached) >= _MAX_REACHED and logger not in _reached:
        return
    kept: list[Any] = []
    for value in state:
        if type(value) is list:
            kept.append(list(value))
        elif value is None or type(value) is bool or type(value) is int or isinstance(value, logging.Logger):
            kept.append(value)
        else:
            return
    handoff_filters, level = handoff.filters, handoff.level
    if type(handoff_filters) is not list or type(level) is not int:
        return
    _reached[logger] = (handoff, operator.attrgetter(*names), tuple(kept), (list(handoff_filters), level))


#: Loggers :func:`_reaches_only` found reach only a hand-off: each with that hand-off (the
#: answer is about it alone), a reader of the logging state the answer rests on (one C
#: call for the whole chain: logger, parents, root) and that state, and the hand-off's own
#: (filters, level) then. (One reader of both through an object holding the logger and the
#: hand-off was 14 instructions a request fewer, but each attribute one more lookup: more
#: machine work.)
_reached: dict[logging.Logger, tuple[_HandOff, Callable[[Any], Any], tuple[Any, ...], tuple[list[Any], int]]] = {}
_MAX_REACHED = 64
_HANDOFF_STATE = operator.attrgetter("filters", "level")


#: What :func:`hand_off_fields` hands the writer for a line: logger name, message, fields, time.
_LineParts = tuple[str, str, dict[str, Any], float]


class _Writer(logging.handlers.QueueListener):
    """The writer thread: takes single records and batches of them (records, or lines
    :func:`log_fields` made ready or the parts :func:`hand_off_fields` handed over, when the
    writer is configure_logging's own JSON one)."""

    def handle(self, record: Any) -> None:
        if isinstance(record, (str, tuple)):
            record = [record]
        if not isinstance(record, list):
            super().handle(record)
            return
        for handler in self.handlers:
            if isinstance(handler, logging.StreamHandler) and not handler.filters:
                _write_batch(handler, record)
            else:
                for one in record:
                    handler.handle(one)


def _write_batch(handler: logging.StreamHandler[Any], records: list[logging.LogRecord | str | _LineParts]) -> None:
    """Format a whole batch, then write it at once.

    Line by line, each write released the GIL and handed the core back and forth with
    the event loop once per line; a batch does so once (and makes one system call).

    The lines :func:`hand_off_fields` handed over as parts are made here by the handler's
    formatter (configure_logging's JSON one: the formatter :func:`lines_made_here` vouched
    for), and redacted together: one scan of the batch's text, a line's own redaction only
    if that finds something to look at.
    """
    formatter = handler.formatter
    # One line per record, in order (None where one failed); the lines made from parts are
    # redacted below, the others were as they were made.
    lines: list[str | None] = []
    made = failed = False
    for record in records:
        if type(record) is tuple:
            name, msg, fields, created = record
            try:
                lines.append(formatter.unredacted_line(name, msg, fields, created))  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
                handler.handleError(logging.makeLogRecord({"name": name, "msg": msg}))
                lines.append(None)
                failed = True
                continue
            made = True
        elif isinstance(record, str):
            lines.append(record)
        else:
            try:
                lines.append(handler.format(record))  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
                handler.handleError(record)  # type: ignore[arg-type]
                lines.append(None)
                failed = True
    kept: list[str] = [line for line in lines if line is not None] if failed else lines  # type: ignore[assignment]
    if not kept:
        return
    terminator = handler.terminator
    text = terminator.join(kept) + terminator
    if made:
        redactor: Redactor = formatter.redactor  # type: ignore[union-attr]
        if not redactor.keeps_json_lines(text):
            kept = [redactor.json_line(line) if type(record) is tuple else line
                    for line, record in zip(lines, records, strict=True) if line is not None]
            text = terminator.join(kept) + terminator
    with handler.lock:  # type: ignore[union-attr]
        try:
            handler.stream.write(text)
            handler.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            last = records[-1]
            handler.handleError(last if isinstance(last, logging.LogRecord) else logging.makeLogRecord({"msg": last}))


class LogSetup:
    """What :func:`configure_logging` installed; :meth:`add_secrets` once config is read."""

    def __init__(
        self, redactor: Redactor, listener: logging.handlers.QueueListener, handoff: _HandOff | None = None
    ) -> None:
        self.redactor = redactor
        self._listener: logging.handlers.QueueListener | None = listener
        self._handoff = handoff

    def add_secrets(self, secrets: Iterable[str | None]) -> None:
        """Mask these values in every later line (admin token, provider keys...)."""
        self.redactor.add(secrets)

    def stop(self) -> None:
        """Write what is queued and stop the writer thread (also run at exit); idempotent."""
        listener, self._listener = self._listener, None
        if listener is not None:
            if self._handoff is not None:
                self._handoff.flush_batch()
            listener.stop()


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> LogSetup:
    """Route every log record through a redacting formatter on a writer thread.

    ``fmt`` is ``json`` (one object per line) or ``text``. Replaces the root logger's
    handlers, so calling it twice does not duplicate lines.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    redactor = Redactor()
    writer = logging.StreamHandler(stream or sys.stderr)
    writer.setFormatter(JsonFormatter(redactor) if fmt == "json" else TextFormatter(redactor))
    records: queue.SimpleQueue[Any] = queue.SimpleQueue()
    listener = _Writer(records, writer, respect_handler_level=False)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handoff = _HandOff(records)
    root.addHandler(handoff)
    global _installed, _installed_json, _json_handoff
    _installed = handoff
    _installed_json = writer.formatter if isinstance(writer.formatter, JsonFormatter) else None
    _json_handoff = handoff if _installed_json is not None else None
    root.setLevel(getattr(logging, level.upper()))
    # Neither format shows where a call was made from, nor thread or process names: skip
    # computing them for every record (the logging HOWTO's "Optimization" switches).
    # Finding the caller walks the stack: ~8 µs of the ~19 µs an access line costs the loop.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    listener.start()
    setup = LogSetup(redactor, listener, handoff)
    atexit.register(setup.stop)
    return setup


def _iso(created: float) -> str:
    """``created`` as ISO-8601 UTC to the millisecond: ``2026-12-02T01:37:32.123Z``."""
    whole = int(created)
    second = _last_second
    if second[0] != whole:
        second = _second(whole)
    return second[1] + _MILLIS[int((created - whole) * 1000)]


#: "000Z" .. "999Z": the end of every timestamp, made once.
_MILLIS = tuple(f"{ms:03d}Z" for ms in range(1000))
#: The last second formatted (lines of one second share it: formatting it is the slow
#: part); one tuple, swapped whole, since the writer thread formats records too.
_last_second: tuple[int, str] = (-1, "")


def _second(whole: int) -> tuple[int, str]:
    global _last_second
    _last_second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(whole)))
    return _last_second
