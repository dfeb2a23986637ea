"""Output policies on a stream, chunk by chunk, without buffering the whole answer.

Each choice's text goes through a sliding window: what arrives is appended to a pending
tail, the tail is scanned, and only the part that no later text can still turn into a
match is released, redacted where it matched. The last :data:`HOLD_CHARS` characters are
held back (longer than any built-in match, bar private keys), so a card number split over
two chunks is seen whole before any of it reaches the client. A private key's
``-----BEGIN`` line holds everything after it until its ``-----END`` line (or
:data:`MAX_HELD_CHARS`, when it is redacted anyway). At the end of the stream the tail
is released.

Cost: the client sees text up to ``HOLD_CHARS`` characters later than it was generated
(the first chunk's role and any tool calls are not held); each chunk costs one regex
scan of the tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.core.errors import GuardrailBlocked
from gateway.guardrails.detectors import MAX_MATCH_CHARS, Match, redact
from gateway.guardrails.policies import Decision, TextRule

__all__ = ["HOLD_CHARS", "MAX_HELD_CHARS", "StreamScreen", "TextWindow"]

#: Characters held back at the end of each choice's text.
HOLD_CHARS = MAX_MATCH_CHARS
#: A private key never ends: past this much held text it is redacted as it stands.
MAX_HELD_CHARS = 16 * 1024
_KEY_BEGIN = "-----BEGIN"


@dataclass(slots=True)
class TextWindow:
    """One choice's sliding window over its streamed text."""

    rules: Sequence[TextRule]
    pending: str = ""
    #: (policy, detector) pairs that acted, for the call's decisions.
    acted: dict[str, set[str]] = field(default_factory=dict)

    def feed(self, text: str) -> str:
        """Take ``text``; return what may be sent now (redacted). Raises GuardrailBlocked."""
        self.pending += text
        return self._release(final=False)

    def finish(self) -> str:
        """The stream ended: everything still held, redacted."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        text = self.pending
        cut = len(text) if final else max(0, len(text) - HOLD_CHARS)
        if not final:
            begin = text.find(_KEY_BEGIN)
            if begin != -1 and len(text) - begin < MAX_HELD_CHARS:
                cut = min(cut, begin)
        found_by_rule = [(rule, rule.matches(text)) for rule in self.rules]
        # A match running across the cut is held whole until it is complete (moving the
        # cut back may put it inside another match: repeat until it falls between them).
        moved = True
        while moved:
            moved = False
            for _, found in found_by_rule:
                for m in found:
                    if m.start < cut < m.end:
                        cut, moved = m.start, True
        matches: list[Match] = []
        for rule, found in found_by_rule:
            if found:
                self._act(rule, found, cut)
            if rule.policy.mode == "redact":
                matches += [m for m in found if m.end <= cut]
        released = redact(text[:cut], _without_overlaps(matches))
        self.pending = text[cut:]
        return released

    def _act(self, rule: TextRule, found: list[Match], cut: int) -> None:
        complete = [m for m in found if m.end <= cut]
        if not complete:
            return
        if rule.policy.mode == "block":
            self.acted.setdefault(rule.policy.name, set()).update(m.detector for m in complete)
            raise GuardrailBlocked(rule.policy.name, "output")
        self.acted.setdefault(rule.policy.name, set()).update(m.detector for m in complete)


def _without_overlaps(matches: list[Match]) -> list[Match]:
    matches.sort(key=lambda m: (m.start, -(m.end - m.start)))
    kept: list[Match] = []
    for m in matches:
        if kept and m.start < kept[-1].end:
            continue
        kept.append(m)
    return kept


@dataclass(slots=True)
class StreamScreen:
    """The output policies of one streamed call: a window per choice index."""

    rules: Sequence[TextRule]
    windows: dict[int, TextWindow] = field(default_factory=dict)

    def feed(self, index: int, text: str) -> str:
        window = self.windows.get(index)
        if window is None:
            window = self.windows[index] = TextWindow(self.rules)
        return window.feed(text)

    def finish(self, index: int) -> str:
        window = self.windows.get(index)
        return "" if window is None else window.finish()

    def decisions(self) -> list[Decision]:
        acted: dict[str, set[str]] = {}
        for window in self.windows.values():
            for policy, kinds in window.acted.items():
                acted.setdefault(policy, set()).update(kinds)
        modes = {rule.policy.name: rule.policy.mode for rule in self.rules}
        out = []
        for policy, kinds in acted.items():
            action = {"block": "blocked", "redact": "redacted"}.get(modes[policy], "logged")
            out.append(Decision(policy, action, "output", tuple(sorted(kinds))))  # type: ignore[arg-type]
        return out
