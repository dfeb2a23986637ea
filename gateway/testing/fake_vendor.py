"""What the vendor fakes (Azure, Gemini) share: a script of failures and a request log.

Each vendor fake (``fake_azure``, ``fake_gemini``) is an aiohttp app speaking that
vendor's documented wire; tests run it in process on 127.0.0.1 and hold its
:class:`VendorState` directly: ``state.script.append({...})`` queues what the next call
answers, ``state.calls`` lists what each call carried.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web

__all__ = ["STATE_KEY", "Call", "VendorState", "json_response", "unit_vector"]


@dataclass(frozen=True, slots=True)
class Call:
    """One request a fake received (token requests included)."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass(slots=True)
class VendorState:
    """The fake's script (popped one step per model call) and what it received."""

    #: Steps: ``{"status": 429, "headers": {...}, "body": {...}}`` answers that error;
    #: vendor fakes document their own extra step keys.
    script: deque[dict[str, Any]] = field(default_factory=deque)
    calls: list[Call] = field(default_factory=list)
    #: Access tokens the fake's token endpoint has issued (and so accepts).
    issued_tokens: list[str] = field(default_factory=list)

    async def record(self, request: web.Request) -> Any:
        """Log ``request`` and return its body (JSON or form decoded, else bytes)."""
        raw = await request.read()
        body: Any = raw
        if request.content_type == "application/x-www-form-urlencoded":
            body = dict(await request.post())
        elif raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = raw
        self.calls.append(Call(request.method, request.path, dict(request.query),
                               {k.lower(): v for k, v in request.headers.items()}, body))
        return body

    def next_step(self) -> dict[str, Any]:
        return self.script.popleft() if self.script else {}

    def model_calls(self) -> list[Call]:
        """The calls other than credential requests (token endpoints, metadata servers)."""
        return [c for c in self.calls if "/oauth2/" not in c.path and not c.path.endswith(("/token", "-credentials", "/sts"))
                and not c.path.startswith(("/computeMetadata/", "/latest/")) and c.path != "/"]


STATE_KEY: Final = web.AppKey("vendor_fake_state", VendorState)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json", headers=headers)


def unit_vector(text: str, dimensions: int) -> list[float]:
    """A deterministic unit-length embedding of ``text`` (what an embedding fake answers)."""
    digest = hashlib.shake_256(text.encode()).digest(dimensions)
    values = [b / 127.5 - 1.0 for b in digest]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]
