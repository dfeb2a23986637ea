"""A whole answer's usage: made with its counts at once where the answer has ``usage`` and
no ``cost`` (``usage_from_answer``'s short way), it is what an empty Usage that absorbed the
answer is, for answers of every shape."""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from gateway.core.usage import Usage, usage_from_answer


class Mapping(dict):  # type: ignore[type-arg]
    """A dict subclass (an answer a provider library built): not the short way's, same usage."""


_COUNTS: list[Any] = [0, 7, 2**40, -3, 2.5, -1.0, True, False, None, "9", [1]]
_MISSING = object()


def _usage_objects() -> list[Any]:
    made: list[Any] = [None, [], "usage", 3]
    for prompt, completion in itertools.product([*_COUNTS, _MISSING], repeat=2):
        for prompt_key, completion_key in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
            usage: dict[str, Any] = {}
            if prompt is not _MISSING:
                usage[prompt_key] = prompt
            if completion is not _MISSING:
                usage[completion_key] = completion
            made.append(usage)
    made.append({"prompt_tokens": None, "input_tokens": 5, "completion_tokens": 3, "output_tokens": 4})
    made.append({"input_tokens": 5, "output_tokens": 4, "prompt_tokens": 2})
    made.append(Mapping(prompt_tokens=3, completion_tokens=4))
    return made


def _answers() -> list[dict[str, Any]]:
    costs: list[Any] = [_MISSING, None, {"usd": 0.25}, {"usd": 1, "diem": 2.0}, {"usd": "x"}, 3.0, []]
    answers: list[dict[str, Any]] = []
    for usage, cost in itertools.product(_usage_objects(), costs):
        answer: dict[str, Any] = {"id": "chatcmpl-1", "choices": []}
        if usage is not _MISSING:
            answer["usage"] = usage
        if cost is not _MISSING:
            answer["cost"] = cost
        answers.append(answer)
    answers.append({"choices": []})
    return answers


def _absorbed(answer: dict[str, Any]) -> Usage:
    usage = Usage()
    usage.absorb(answer)
    return usage


def _fields(usage: Usage) -> tuple[Any, ...]:
    values = (usage.prompt_tokens, usage.completion_tokens, usage.cost_usd, usage.cost_diem, usage.estimated)
    return values + tuple(type(v) for v in values)


def test_an_answers_usage_is_what_absorbing_it_gives() -> None:
    for answer in _answers():
        usage, parsed = usage_from_answer(b"unused", answer)
        assert parsed is answer
        assert _fields(usage) == _fields(_absorbed(answer)), answer


def test_an_answer_from_its_body_is_parsed_once_and_the_same() -> None:
    for answer in _answers():
        body = orjson.dumps(answer)
        usage, parsed = usage_from_answer(body)
        assert parsed == answer
        assert _fields(usage) == _fields(_absorbed(answer)), answer
    for body in (b"not json", b"[1, 2]", b'"text"', b""):
        usage, parsed = usage_from_answer(body)
        assert parsed is None and _fields(usage) == _fields(Usage())
