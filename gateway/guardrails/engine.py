"""The policy engine: one call's prompt and answer screened by its ordered policies.

The engine works on the internal message shape (OpenAI chat completions: ``messages``
with string or text-part content; answers' ``choices[].message.content``), so every
inbound protocol, translated to that shape, gets the same decisions. Policies run in
the order they are listed; a ``block`` stops the call at once, a ``redact`` hands the
redacted text to the next policy, a ``log`` only records.

What a policy reads: the text of every message (string content and text parts) for
input; each choice's message text for output. Tool-call arguments, images and audio are
not read (``docs/guardrails.md``).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gateway.core.errors import GuardrailBlocked
from gateway.core.tokens import prompt_tokens
from gateway.guardrails.detectors import redact
from gateway.guardrails.policies import LOCAL_TYPES, Decision, Policy, TextRule, compile_rule

__all__ = [
    "ExternalChecks",
    "GuardrailEngine",
    "HookFunction",
    "UNAVAILABLE",
    "Verdict",
    "load_hook",
]

Direction = Literal["input", "output"]

#: The kind an external check reports when it could not answer (timeout, error, bad reply).
UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What an external check (webhook, moderation, hook) answered."""

    action: Literal["allow", "block", "rewrite"]
    #: ``rewrite``: the new texts, one per text given, in order.
    texts: tuple[str, ...] = ()
    #: Categories or reasons, for the record (never the text).
    kinds: tuple[str, ...] = ()


class ExternalChecks(Protocol):
    """The I/O the webhook and moderation policies need (see :mod:`gateway.guardrails.external`)."""

    async def webhook(self, policy: Policy, direction: Direction, texts: Sequence[str]) -> Verdict: ...

    async def moderate(self, policy: Policy, texts: Sequence[str]) -> Verdict: ...


#: A hook gets the direction and the texts; it returns None (allow), a Verdict, or awaits one.
HookFunction = Callable[[str, list[str]], "Verdict | Awaitable[Verdict | None] | None"]


def load_hook(reference: str) -> HookFunction:
    """``module:function`` imported; raises ValueError with a line naming what is wrong."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected 'module:function', got {reference!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{reference!r} is not a function")
    return function  # type: ignore[no-any-return]


def _text_slots(body: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Each (container, key) of ``body``'s prompt that holds text, in order: a chat body's
    messages, or an Anthropic Messages body's ``system`` and messages as sent."""
    system = body.get("system")
    if isinstance(system, str):
        yield body, "system"
    elif isinstance(system, list):
        for block in system:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                yield block, "text"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            yield message, "content"
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part, "text"


def _answer_slots(answer: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Each text of a whole answer: chat's choices, or an Anthropic message's text blocks."""
    content = answer.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                yield block, "text"
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            yield message, "content"


class GuardrailEngine:
    """The ordered policies of one model group or key, compiled once."""

    def __init__(
        self, policies: Sequence[Policy], external: ExternalChecks | None = None,
        hooks: dict[str, HookFunction] | None = None,
    ) -> None:
        self.policies = tuple(policies)
        self._rules = {p.name: compile_rule(p) for p in self.policies if p.type in LOCAL_TYPES}
        self._external = external
        self._hooks = dict(hooks or {})
        for p in self.policies:
            if p.type == "hook" and p.name not in self._hooks:
                assert p.hook is not None
                self._hooks[p.name] = load_hook(p.hook)
        self.input_policies = tuple(p for p in self.policies if p.applies_to_input())
        self.output_policies = tuple(p for p in self.policies if p.applies_to_output())
        #: Output policies that can follow a stream chunk by chunk.
        self.stream_rules: tuple[TextRule, ...] = tuple(
            self._rules[p.name] for p in self.output_policies if p.name in self._rules
        )
        #: Output policies that wait for I/O (webhook, moderation, hook): on a stream they
        #: check the text so far at intervals (:mod:`gateway.guardrails.stream_checks`).
        self.stream_checks: tuple[Policy, ...] = tuple(
            p for p in self.output_policies if p.type not in LOCAL_TYPES and p.type != "max_input"
        )

    async def screen_input(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[Decision]]:
        """The body to send upstream (a redacted copy if any policy redacted) and the
        decisions; raises :class:`GuardrailBlocked` naming the first policy that blocks."""
        if not self.input_policies:
            return body, []
        work = copy.deepcopy(body)
        decisions: list[Decision] = []
        changed = False
        for policy in self.input_policies:
            slots = list(_text_slots(work))
            if policy.type == "max_input":
                decisions += self._size(policy, work, slots)
                continue
            changed |= await self._apply(policy, "input", slots, decisions)
        return (work if changed else body), decisions

    async def screen_answer(self, answer: dict[str, Any]) -> tuple[dict[str, Any], list[Decision]]:
        """A whole answer after the output policies (a redacted copy if any redacted)."""
        if not self.output_policies:
            return answer, []
        work = copy.deepcopy(answer)
        decisions: list[Decision] = []
        changed = False
        for policy in self.output_policies:
            if policy.type == "max_input":
                continue
            changed |= await self._apply(policy, "output", list(_answer_slots(work)), decisions)
        return (work if changed else answer), decisions

    async def check_stream_texts(self, texts: Sequence[str]) -> list[Decision]:
        """The stream checks (:attr:`stream_checks`) on a stream's text so far, one text
        per choice; raises :class:`GuardrailBlocked` naming the first that blocks.

        What was checked has been sent already, so a rewrite cannot apply: it is recorded
        as ``logged``.
        """
        decisions: list[Decision] = []
        for policy in self.stream_checks:
            await self._apply(policy, "output", [({"text": t}, "text") for t in texts], decisions)
        return [Decision(d.policy, "logged", d.direction, d.kinds) if d.action == "redacted" else d for d in decisions]

    def _size(self, policy: Policy, body: dict[str, Any], slots: list[tuple[dict[str, Any], str]]) -> list[Decision]:
        chars = sum(len(c[k]) for c, k in slots)
        over = policy.max_chars is not None and chars > policy.max_chars
        if policy.max_tokens is not None and not over:
            messages = body.get("messages")
            over = prompt_tokens(messages if isinstance(messages, list) else []) > policy.max_tokens
        if not over:
            return []
        if policy.mode == "log":
            return [Decision(policy.name, "logged", "input", ("max_input",))]
        raise GuardrailBlocked(policy.name, "input")

    async def _apply(
        self, policy: Policy, direction: Direction, slots: list[tuple[dict[str, Any], str]],
        decisions: list[Decision],
    ) -> bool:
        """Run one policy over ``slots``; True when it rewrote any of them."""
        if not slots:
            return False
        rule = self._rules.get(policy.name)
        if rule is not None:
            return self._apply_rule(rule, direction, slots, decisions)
        verdict = await self._ask(policy, direction, [c[k] for c, k in slots])
        if verdict is None:
            return False
        if verdict.action == "allow":
            if UNAVAILABLE in verdict.kinds:  # the check is down and the policy fails open
                decisions.append(Decision(policy.name, "failed_open", direction, verdict.kinds))
            return False
        # Fail-closed is a refusal whatever the policy does with a verdict (bar log mode).
        refuses = policy.mode == "block" or (UNAVAILABLE in verdict.kinds and policy.mode != "log")
        if verdict.action == "block" and refuses:
            decisions.append(Decision(policy.name, "blocked", direction, verdict.kinds))
            raise GuardrailBlocked(policy.name, direction)
        if verdict.action == "rewrite" and policy.mode != "log" and len(verdict.texts) == len(slots):
            for (container, key), text in zip(slots, verdict.texts, strict=True):
                container[key] = text
            decisions.append(Decision(policy.name, "redacted", direction, verdict.kinds))
            return True
        decisions.append(Decision(policy.name, "logged", direction, verdict.kinds))
        return False

    def _apply_rule(
        self, rule: TextRule, direction: Direction, slots: list[tuple[dict[str, Any], str]],
        decisions: list[Decision],
    ) -> bool:
        policy = rule.policy
        kinds: set[str] = set()
        changed = False
        for container, key in slots:
            matches = rule.matches(container[key])
            if not matches:
                continue
            kinds.update(m.detector for m in matches)
            if policy.mode == "block":
                decisions.append(Decision(policy.name, "blocked", direction, tuple(sorted(kinds))))
                raise GuardrailBlocked(policy.name, direction)
            if policy.mode == "redact":
                container[key] = redact(container[key], matches)
                changed = True
        if kinds:
            action: Literal["redacted", "logged"] = "redacted" if policy.mode == "redact" else "logged"
            decisions.append(Decision(policy.name, action, direction, tuple(sorted(kinds))))
        return changed

    async def _ask(self, policy: Policy, direction: Direction, texts: list[str]) -> Verdict | None:
        if policy.type == "hook":
            result = self._hooks[policy.name](direction, list(texts))
            if inspect.isawaitable(result):
                result = await result
            return result
        if self._external is None:
            raise RuntimeError(f"guardrail {policy.name!r} needs external checks, and none are configured")
        if policy.type == "webhook":
            return await self._external.webhook(policy, direction, texts)
        if policy.type == "moderation":
            return await self._external.moderate(policy, texts)
        raise ValueError(f"unknown policy type {policy.type!r}")
