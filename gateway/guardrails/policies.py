"""Guardrail policies: what each one checks, and what it does when it matches.

A policy has a ``type`` (what it looks for), a ``mode`` (``block``: refuse the call with
400 ``guardrail_blocked`` naming the policy; ``redact``: replace the matched text before it
goes upstream, or before it reaches the client; ``log``: only count and record) and the
direction it applies to (``direction``) (``input``, ``output`` or ``both``).

Types:

* ``pii`` — the built-in detectors of :mod:`gateway.guardrails.detectors` (e-mail, phone,
  card numbers with Luhn, IBAN with mod-97, IP addresses, API-key and private-key shapes,
  and the national id formats the policy names);
* ``terms`` — blocked words or phrases (case-insensitive, whole words) and regular
  expressions;
* ``max_input`` — a bound on the prompt's characters or estimated tokens (input only;
  its mode is always ``block``);
* ``webhook`` — POST the messages to a URL; its answer allows, blocks or rewrites them;
  fail-open or fail-closed when it is slow or down;
* ``moderation`` — a configured model group's ``/moderations`` endpoint; a flagged text
  is blocked (or logged);
* ``hook`` — a Python function named ``module:function`` (sync or async) for what none
  of the above covers;
* ``presidio`` — Microsoft Presidio's analyzer (the ``presidio`` extra,
  :mod:`gateway.guardrails.presidio`), a local policy like ``pii``.

``pii``, ``terms`` and ``presidio`` run in the caller's task (microseconds; about a
millisecond for Presidio) and follow a stream chunk by chunk
(:mod:`gateway.guardrails.streams`); ``max_input`` reads the prompt only; the other three
wait for I/O and run on the whole prompt and whole answers, and on a stream's text so
far at intervals, beside the stream (:mod:`gateway.guardrails.stream_checks`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.guardrail_config import GuardrailPolicy as Policy
from gateway.guardrails.detectors import DETECTORS, NATIONAL_ID_DETECTORS, Detector, Match, find_matches

__all__ = [
    "DEFAULT_PII",
    "LOCAL_TYPES",
    "Decision",
    "Policy",
    "TextRule",
    "compile_rule",
]

#: Policies decided on the text alone, without I/O (and so incrementally on streams).
LOCAL_TYPES = frozenset({"pii", "terms", "presidio"})

#: The detectors a ``pii`` policy uses when it names none: all but the national ids,
#: which only make sense for the countries a deployment serves.
DEFAULT_PII = tuple(name for name in DETECTORS if name not in NATIONAL_ID_DETECTORS)


@dataclass(frozen=True, slots=True)
class Decision:
    """What one policy did to one call: recorded in the ledger, metrics and the span.

    Never the matched text: only which policy, what it did, and which detectors (or
    categories) fired.
    """

    policy: str
    action: Literal["blocked", "redacted", "logged", "allowed", "failed_open"]
    direction: Literal["input", "output"]
    kinds: tuple[str, ...] = ()

    def label(self) -> str:
        """``policy:action`` as the ledger keeps it."""
        return f"{self.policy}:{self.action}"


@dataclass(frozen=True, slots=True)
class TextRule:
    """A local policy compiled: the detectors it runs over a text."""

    policy: Policy
    detectors: tuple[Detector, ...] = field(default_factory=tuple)
    #: A backend that is not a regular expression (Presidio): text in, matches out.
    analyzer: Callable[[str], list[Match]] | None = None

    def matches(self, text: str) -> list[Match]:
        if self.analyzer is not None:
            return self.analyzer(text)
        return find_matches(text, self.detectors)


def _terms_detector(policy: Policy) -> Detector | None:
    alternatives = [r"\b" + re.escape(term) + r"\b" for term in policy.terms]
    alternatives += [f"(?:{p})" for p in policy.patterns]
    if not alternatives:
        return None
    return Detector("term", re.compile("|".join(alternatives), re.IGNORECASE))


def compile_rule(policy: Policy) -> TextRule:
    """The detectors of a ``pii`` or ``terms`` policy; raises ValueError naming a bad one."""
    if policy.type == "pii":
        names = policy.detectors or DEFAULT_PII
        unknown = [n for n in names if n not in DETECTORS]
        if unknown:
            raise ValueError(f"unknown detector {unknown[0]!r} (known: {', '.join(DETECTORS)})")
        return TextRule(policy, tuple(DETECTORS[n] for n in names))
    if policy.type == "terms":
        for pattern in policy.patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
        detector = _terms_detector(policy)
        if detector is None:
            raise ValueError("a terms policy needs terms or patterns")
        return TextRule(policy, (detector,))
    if policy.type == "presidio":
        from gateway.guardrails.presidio import PresidioAnalyzer  # the extra: imported only when used

        analyzer = PresidioAnalyzer(
            policy.entities, language=policy.language, score_threshold=policy.score_threshold,
            spacy_model=policy.spacy_model,
        )
        return TextRule(policy, (), analyzer.matches)
    raise ValueError(f"{policy.type} is not a text policy")
