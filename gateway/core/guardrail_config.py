"""``guardrails:`` in the config file: the policies, and which keys they apply to.

Declared here, in the core, because the config file is read here; the policies' behaviour
is :mod:`gateway.guardrails`, which reads these same classes (one declaration per shape)::

    guardrails:
      policies:
        no-secrets: {type: pii, mode: block, detectors: [api_key, private_key]}
        mask-pii:   {type: pii, mode: redact, direction: both}
        topics:     {type: terms, terms: ["project falcon"], patterns: ["\\\\bcve-\\\\d{4}-\\\\d+"]}
        size:       {type: max_input, max_tokens: 8000}
        review:     {type: webhook, url: "https://guard.internal/check", timeout_seconds: 0.5, fail_open: true}
        moderate:   {type: moderation, model: moderation}
        custom:     {type: hook, hook: "mycompany.guards:check"}
        people:     {type: presidio, mode: redact, entities: [PERSON], spacy_model: en_core_web_lg}
      keys:                         # by key prefix (as ``keys list`` shows it)
        llmg_ab12cd34: [no-secrets]
    models:
      - name: smart
        guardrails: [mask-pii, topics]   # run in this order, then the key's
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from gateway.core.schema import SHAPE, Number, Section, problem

__all__ = ["GuardrailPolicy", "GuardrailSettings"]

Mode = Literal["block", "redact", "log"]
Direction = Literal["input", "output", "both"]
PolicyType = Literal["pii", "terms", "max_input", "webhook", "moderation", "hook", "presidio"]

_NEEDS: dict[str, tuple[str, ...]] = {"webhook": ("url",), "moderation": ("model",), "hook": ("hook",)}


@dataclass(frozen=True, config=SHAPE)
class GuardrailPolicy(Section):
    """One policy: what it looks for (``type``), what it does (``mode``), and where (``direction``)."""

    #: Filled in from the key under ``guardrails.policies``.
    name: StrictStr = ""
    type: PolicyType = "pii"
    mode: Mode = "block"
    #: ``input``, ``output`` or ``both`` (not ``on:``, which YAML reads as ``true``).
    direction: Direction = "input"
    #: pii: detector names (default: all but the national ids, which are named to apply).
    detectors: tuple[StrictStr, ...] = ()
    #: terms: words or phrases (case-insensitive, whole words), and regular expressions.
    terms: tuple[StrictStr, ...] = ()
    patterns: tuple[StrictStr, ...] = ()
    #: max_input: bounds on the prompt (characters; tokens as the gateway estimates them).
    max_chars: Annotated[StrictInt, Field(ge=1)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    #: webhook: where to POST, how long to wait, and whether a failure lets the call through.
    url: StrictStr | None = None
    timeout_seconds: Annotated[Number, Field(gt=0)] = 1.0
    fail_open: StrictBool = False
    #: moderation: the model group whose deployment serves ``/moderations``.
    model: StrictStr | None = None
    #: hook: ``module:function``.
    hook: StrictStr | None = None
    #: presidio: entity names (default: every one it supports here), the language of its
    #: recognizers, the least score that counts, and a spaCy model installed as a package
    #: (none: spaCy's blank pipeline, pattern recognizers only).
    entities: tuple[StrictStr, ...] = ()
    language: StrictStr = "en"
    score_threshold: Annotated[Number, Field(ge=0, le=1)] = 0.5
    spacy_model: StrictStr | None = None
    #: webhook, moderation, hook on a stream's answer: the text so far is checked again
    #: each time this many more characters have been relayed, and once before it ends.
    stream_check_chars: Annotated[StrictInt, Field(ge=1)] = 1000

    @model_validator(mode="after")
    def _complete(self) -> GuardrailPolicy:
        for needed in _NEEDS.get(self.type, ()):
            if getattr(self, needed) is None:
                raise problem(f"a {self.type} policy needs {needed!r}", at=needed)
        if self.type == "max_input" and self.max_chars is None and self.max_tokens is None:
            raise problem("a max_input policy needs max_chars or max_tokens")
        if self.type == "terms" and not (self.terms or self.patterns):
            raise problem("a terms policy needs terms or patterns")
        return self

    def applies_to_input(self) -> bool:
        return self.direction in ("input", "both")

    def applies_to_output(self) -> bool:
        return self.direction in ("output", "both")


@dataclass(frozen=True, config=SHAPE)
class GuardrailSettings(Section):
    """``guardrails``: the named policies, and the policies of particular keys."""

    policies: Mapping[StrictStr, GuardrailPolicy] = Field(default_factory=dict)
    #: Key prefix (12 characters, as ``keys list`` shows) → policy names, run after the group's.
    keys: Mapping[StrictStr, tuple[StrictStr, ...]] = Field(default_factory=dict)

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Each policy learns its name from its key."""
        if isinstance(data.get("policies"), dict):
            data["policies"] = {
                name: {**raw, "name": name} if isinstance(raw, dict) else raw for name, raw in data["policies"].items()
            }
        return data

    @model_validator(mode="after")
    def _known(self) -> GuardrailSettings:
        for prefix, names in self.keys.items():
            for name in names:
                if name not in self.policies:
                    raise problem(f"unknown guardrail policy {name!r}", at=f"keys.{prefix}")
        return self
