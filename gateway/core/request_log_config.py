"""``request_logs:`` in the config file: which calls keep their bodies, and for how long.

Declared here, in the core, because the config file is read here; storing the bodies is
:mod:`gateway.billing.request_log` and :mod:`actors.request_logs`::

    request_logs:
      models: [smart]            # model groups (as models[].name spells them)
      keys: [llmg_ab12cd34]      # key prefixes (as ``keys list`` shows them)
      retention_days: 30         # each row is deleted this long after its call
      max_body_bytes: 65536      # each body cut to this many bytes, marked truncated

Off by default: with neither ``models`` nor ``keys`` no body is ever stored.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictStr
from pydantic.dataclasses import dataclass

from gateway.core.schema import SHAPE, Number, Section

__all__ = ["MAX_BODY_BYTES_LIMIT", "RequestLogSettings"]

#: The largest ``max_body_bytes`` accepted (a row holds two bodies).
MAX_BODY_BYTES_LIMIT = 16 * 1024 * 1024


@dataclass(frozen=True, config=SHAPE)
class RequestLogSettings(Section):
    """``request_logs``: the model groups and keys whose calls keep their bodies."""

    #: Model group names whose every call is stored.
    models: tuple[StrictStr, ...] = ()
    #: Key prefixes (12 characters, as ``keys list`` shows) whose every call is stored.
    keys: tuple[StrictStr, ...] = ()
    #: Days a row is kept after its call (fractions allowed: 0.5 is twelve hours).
    retention_days: Annotated[Number, Field(gt=0, le=36500)] = 30.0
    #: Each body (request, response) is cut to this many bytes of UTF-8, and marked.
    max_body_bytes: Annotated[int, Field(ge=256, le=MAX_BODY_BYTES_LIMIT, strict=True)] = 64 * 1024

    @property
    def enabled(self) -> bool:
        return bool(self.models or self.keys)

    def applies(self, group: str, key_prefix: str | None) -> bool:
        """Whether a call on ``group`` with the key ``key_prefix`` keeps its bodies."""
        return group in self.models or (key_prefix is not None and key_prefix in self.keys)
