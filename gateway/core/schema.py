"""The typed-model toolkit: how every declared shape is configured and how its errors read.

The gateway declares each shape it accepts once, as a pydantic class: the config file's
sections (:mod:`gateway.core.config`) and the admin API's bodies and query strings
(:mod:`gateway.admin.input`). The same classes validate input and give the JSON Schema
that the OpenAPI documents (:mod:`gateway.edge.openapi`) publish, so the three cannot drift.

pydantic reports an error as a location tuple and an error type; :func:`first_problem`
turns the first one into the gateway's one-line form, ``models[0].deployments[1].provider:
unknown provider 'x'``. Messages are ours, chosen per error type, so an operator reads the
same words whether a value was refused by a constraint, a type or a validator.

The hot path's chat-body check (:func:`gateway.edge.chat.parse_chat_body`) deliberately
does not use these models: it checks three fields by hand in about a microsecond.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar

from pydantic import ConfigDict, GetCoreSchemaHandler, Strict, ValidationError, WrapValidator, model_validator
from pydantic_core import ArgsKwargs, ErrorDetails, PydanticCustomError, core_schema

__all__ = [
    "SHAPE",
    "Section",
    "Number",
    "OneOf",
    "error_path",
    "first_problem",
    "problem",
    "says",
]

#: Every declared shape: unknown keys refused, NaN and infinities refused (YAML reads
#: ``.nan`` and ``.inf`` as floats), Python code may use attribute names where the
#: file uses longer keys (``reset_timeout`` for ``reset_timeout_seconds``).
SHAPE = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True, allow_inf_nan=False)

#: A number as YAML or JSON writes it: an int or a float, never a bool or a string.
Number = Annotated[float, Strict()]

class OneOf:
    """Annotation: the value is one of ``values`` (an ``enum`` in the JSON Schema).

    ``Literal[...]`` says the same where the values are spelled in the annotation; this
    takes them from a constant defined elsewhere (``Annotated[str, OneOf(KEY_STATES)]``).
    """

    __slots__ = ("values",)

    def __init__(self, values: Sequence[str]) -> None:
        self.values = tuple(values)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.literal_schema(list(self.values))


#: The error type of messages the gateway wrote itself; ``ctx["at"]`` extends the path.
PROBLEM = "gateway"


def problem(message: str, at: str | None = None) -> PydanticCustomError:
    """A refusal worded by us, raised inside a validator; ``at`` names a key below it."""
    return PydanticCustomError(PROBLEM, message, {"at": at} if at else None)


def says(message: str) -> WrapValidator:
    """Annotation: any refusal of the value itself (not of an item inside it) reads ``message``.

    Put it last in ``Annotated[...]`` so it also covers the constraints before it.
    """

    def wrap(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            # Items that failed count as missing, so "too short" rides along with their own
            # errors: those are the ones to report.
            if all(not error["loc"] for error in exc.errors()):
                raise problem(message) from None
            raise

    return WrapValidator(wrap)


def error_path(loc: Sequence[int | str], root: str = "config") -> str:
    """``("models", 0, "deployments", 1, "provider")`` → ``models[0].deployments[1].provider``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]":  # a mapping key of the wrong type
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or root


def _quoted(expected: str) -> str:
    """pydantic's ``"'a', 'b' or 'c'"`` as ``a, b, c``."""
    return ", ".join(re.findall(r"'([^']*)'", expected)) or expected


def describe(error: ErrorDetails) -> str:
    """What was expected, in the gateway's words, for one pydantic error."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == PROBLEM:
        return error["msg"]
    if kind == "missing":
        return "required"
    if kind in ("string_type", "string_too_short"):
        return "expected a non-empty string"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return "expected a whole number"
    if kind in ("float_type", "float_parsing"):
        return "expected a number"
    if kind == "finite_number":
        return "expected a finite number"
    if kind in ("bool_type", "bool_parsing"):
        return "expected true or false"
    if kind == "greater_than_equal":
        return f"expected a value >= {ctx['ge']:g}"
    if kind == "less_than_equal":
        return f"expected a value <= {ctx['le']:g}"
    if kind == "literal_error":
        return f"expected one of {_quoted(str(ctx['expected']))}"
    if kind in ("dataclass_type", "dict_type", "model_type", "mapping_type", "model_attributes_type"):
        return "expected a mapping"
    if kind in ("list_type", "tuple_type", "iterable_type"):
        return "expected a list"
    if kind == "too_short":
        return f"expected at least {ctx['min_length']} item(s)"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    msg = error["msg"]
    return msg[:1].lower() + msg[1:]


def first_problem(exc: ValidationError, root: str = "config") -> tuple[str, str]:
    """(path, message) of the first error: the one a reader fixes first."""
    error = exc.errors(include_url=False)[0]
    loc = list(error["loc"])
    at = (error.get("ctx") or {}).get("at")
    if error["type"] == PROBLEM and at:
        loc.append(at)
    return error_path(loc, root), describe(error)


class Section:
    """What every section of the file shares: unknown keys refused, naming the allowed ones.

    The check (and :meth:`_prepare`) applies to mappings read from the file only; Python
    code building a section with attribute names goes straight to the field checks.
    """

    #: Fields the gateway fills in itself (never written in the file).
    _not_in_file: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _from_file(cls, data: Any) -> Any:
        if isinstance(data, ArgsKwargs) or not isinstance(data, dict):
            return data
        fields = getattr(cls, "__pydantic_fields__", {})
        allowed = [f.validation_alias or name for name, f in fields.items() if name not in cls._not_in_file]
        allowed += cls._more_keys(data)
        for key in data:
            if key not in allowed:
                raise problem(f"unknown key (allowed: {', '.join(map(str, allowed))})", at=str(key))
        return cls._prepare(dict(data))

    @classmethod
    def _more_keys(cls, data: dict[str, Any]) -> tuple[str, ...]:
        """Keys this mapping may hold beyond the fields (those that depend on another key)."""
        return ()

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Defaults that depend on other keys; a null section means its defaults."""
        return data
