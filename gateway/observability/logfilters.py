"""Log filters for expected trouble that libraries report as tracebacks.

Two sources, both outside our code, both able to fill a log with tracebacks for
conditions an operator expects and a client can cause at will:

* **aiohttp's HTTP parser** logs every malformed request ("Error handling request")
  with a traceback *and the offending bytes*, which may be an ``Authorization``
  header: a client can make the gateway write its own (or anyone's forwarded) key into
  the log, or flood the log with garbage. The filter keeps one line, the exception's
  type and status, never the bytes, at DEBUG. (The client still gets aiohttp's plain
  400 and the connection is closed.)
* **asyncpg's pool** logs every failed reconnect during a database outage with a full
  traceback, with backoff up to a minute: one line is enough.

Installed once by ``serve`` (:func:`install_log_filters`); idempotent.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["install_log_filters"]


class _MalformedRequests(logging.Filter):
    """aiohttp.server: a parser error becomes one DEBUG line without the request's bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        record.msg = f"malformed request: {type(exc).__name__} ({exc.code})"
        if record.args:
            # "from %s": the peer's address is the one argument worth keeping.
            record.msg += " from %s"
            record.args = record.args[:1] if isinstance(record.args, tuple) else record.args
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class _OneLineReconnects(logging.Filter):
    """asyncpg.pool: a failed reconnect becomes one line with the exception's type and text."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def install_log_filters() -> None:
    """Attach the filters to the libraries' loggers (once)."""
    for name, kind in (("aiohttp.server", _MalformedRequests), ("asyncpg.pool", _OneLineReconnects)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
