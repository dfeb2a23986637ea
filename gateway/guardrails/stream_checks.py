"""Output policies that wait for I/O (webhook, moderation, hook) on a relayed stream.

They cannot follow a stream chunk by chunk as the local policies do (a round trip per
chunk would stall it), and holding the answer back until they answer would buffer it
whole. So they check the text relayed so far, at intervals, beside the stream:

* each time ``stream_check_chars`` more characters have been relayed (the smallest of the
  stream's policies), one check starts in the background over every choice's text so
  far; at most one runs at a time, and the stream never waits for it;
* each event relayed first looks at a check that has finished: a ``block`` (or a
  fail-closed check that could not answer) raises
  :class:`~gateway.core.errors.GuardrailBlocked`, and the pipeline ends the stream with
  the protocol's one error event;
* before the stream's end reaches the client, the last check runs on the whole text and
  the end waits for it: a stream a policy blocks never ends as a success.

Limits (``docs/guardrails.md``): the client may already have read the text a check
refuses (up to one interval plus what arrives while the check runs); a rewrite cannot
apply to text already sent and is recorded as ``logged``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.core.errors import GuardrailBlocked
from gateway.guardrails.engine import GuardrailEngine
from gateway.guardrails.policies import Decision
from gateway.protocols.sse import stream_texts

__all__ = ["StreamChecks", "stream_checks"]

log = logging.getLogger("gateway.guardrails")

#: Which decision of one policy a stream records when it was checked several times.
_SEVERITY = {"blocked": 4, "failed_open": 3, "redacted": 2, "logged": 1, "allowed": 0}


class StreamChecks:
    """The I/O output policies of one stream: the text so far, checked at intervals."""

    def __init__(self, engine: GuardrailEngine, wire: str) -> None:
        self._engine = engine
        self._wire = wire
        self.interval = min(p.stream_check_chars for p in engine.stream_checks)
        self._texts: dict[int, list[str]] = {}
        self._chars = 0
        #: Characters the last check started (or ran) on.
        self._checked = -1
        self._task: asyncio.Task[list[Decision]] | None = None
        self._acted: dict[str, Decision] = {}
        #: Checks run, for tests and the record.
        self.checks = 0

    def observe(self, event: bytes) -> None:
        """One relayed event: its text joins the text so far. Raises GuardrailBlocked when
        a check that has finished refused the text."""
        for index, text in stream_texts(event, self._wire):
            self._texts.setdefault(index, []).append(text)
            self._chars += len(text)
        if self._task is not None and self._task.done():
            task, self._task = self._task, None
            self._settle(task)
        if self._task is None and self._chars - max(self._checked, 0) >= self.interval:
            self._checked = self._chars
            self._task = asyncio.get_running_loop().create_task(self._run(self._snapshot()))

    async def finish(self) -> None:
        """The stream is about to end: the check in flight, then one on the whole text (if
        any arrived since), answer first. Raises GuardrailBlocked."""
        if self._task is not None:
            task, self._task = self._task, None
            with contextlib.suppress(Exception):
                await asyncio.wait([task])
            self._settle(task)
        if self._chars > self._checked:
            self._checked = self._chars
            try:
                decisions = await self._run(self._snapshot())
            except GuardrailBlocked as exc:
                self._record([Decision(exc.policy, "blocked", "output")])
                raise
            self._record(decisions)

    def close(self) -> None:
        """The stream ended some other way: a check still running is dropped."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def decisions(self) -> list[Decision]:
        """What each policy did on this stream (its most severe outcome)."""
        return list(self._acted.values())

    def _snapshot(self) -> list[str]:
        return ["".join(self._texts[i]) for i in sorted(self._texts)]

    async def _run(self, texts: list[str]) -> list[Decision]:
        self.checks += 1
        return await self._engine.check_stream_texts(texts)

    def _settle(self, task: asyncio.Task[list[Decision]]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, GuardrailBlocked):
            self._record([Decision(exc.policy, "blocked", "output")])
            raise exc
        if exc is not None:
            # A hook that raised: it says nothing about the text; the stream goes on.
            log.error("guardrail stream check failed: %r", exc)
            return
        self._record(task.result())

    def _record(self, decisions: list[Decision]) -> None:
        for d in decisions:
            known = self._acted.get(d.policy)
            if known is None or _SEVERITY[d.action] > _SEVERITY[known.action]:
                self._acted[d.policy] = d


def stream_checks(engine: GuardrailEngine | None, wire: str) -> StreamChecks | None:
    """The checks of a stream in ``wire``, or None when no I/O output policy applies."""
    if engine is None or not engine.stream_checks:
        return None
    return StreamChecks(engine, wire)
