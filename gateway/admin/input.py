"""What the admin API accepts: JSON bodies and query strings, declared once as typed models.

Each body (:class:`KeyCreateBody`, :class:`KeyPatchBody`, :class:`RotateBody`,
:class:`RevokeBody`, :class:`BudgetSetBody`) and each query string (:class:`KeyListQuery`,
...) is a pydantic class; :mod:`gateway.edge.openapi` publishes their JSON Schema, so the
document and the checks are the same declaration. The ``parse_*`` functions validate
with them and turn the result into the values the routes use.

Every refusal is a 400 in the contract's shape whose message names the field and what
it takes (``invalid_json``, ``unknown_field``, ``missing_field``, ``invalid_field``,
``invalid_query``), so an operator can fix the call from the answer alone; what a field
takes is the :class:`Must` beside its type. The bounds are the database columns' own (see
:class:`gateway.auth.keys.KeyPolicy`), checked here so that no input can reach PostgreSQL
and come back as a 500.

A little over 500 lines because each of the ten shapes is declared here whole, with its
bounds and its words; splitting bodies from query strings would part declarations that
share their field types.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Annotated, Any, TypeVar, get_args

from aiohttp import web
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
)
from pydantic.dataclasses import dataclass as model_dataclass

from gateway.admin.audit import ACTIONS
from gateway.auth.keys import (
    BUDGET_PERIODS,
    KEY_STATES,
    MAX_BUDGET_USD,
    MAX_INT,
    MAX_NAME_LEN,
    UNCHANGED,
    Unchanged,
)
from gateway.core.errors import InvalidRequest
from gateway.core.schema import SHAPE, Number, OneOf
from gateway.http.bodies import read_json_body

__all__ = [
    "ADMIN_BODY_LIMIT",
    "BODIES",
    "QUERIES",
    "AuditQuery",
    "BudgetListQuery",
    "BudgetSet",
    "BudgetSetBody",
    "KeyCreate",
    "KeyCreateBody",
    "KeyListQuery",
    "KeyPatch",
    "KeyPatchBody",
    "Must",
    "RevokeBody",
    "RotateBody",
    "Rotation",
    "RequestLogQuery",
    "UsageQuery",
    "parse_audit_query",
    "parse_budget_list_query",
    "parse_budget_set",
    "parse_key_create",
    "parse_key_list_query",
    "parse_key_patch",
    "parse_revoke",
    "parse_rotation",
    "parse_request_log_query",
    "parse_usage_query",
    "read_admin_body",
]

#: Admin bodies are a few hundred bytes; anything near this is a mistake or an attack.
#: The effective limit is the smaller of this and REQUEST_BODY_LIMIT_BYTES.
ADMIN_BODY_LIMIT = 64 * 1024
DEFAULT_PAGE = 100
MAX_PAGE = 500
MAX_MODELS = 1000
MAX_MODEL_NAME_LEN = 256
MAX_REASON_LEN = 500
#: A rotation's grace period: long enough to roll out a new key, short enough to matter.
MAX_GRACE = timedelta(days=30)
MAX_EXPIRES_IN_DAYS = 36_500
GROUP_BYS = ("key", "model", "day")
#: A subject budget's period when none is sent (as ``llm-gateway budgets set``).
DEFAULT_BUDGET_PERIOD = "month"


class Must:
    """Annotation: what a field takes, as its refusal says (``'limit' must be {what}``)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what


# -- field types --------------------------------------------------------------------
def _integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer, and so do we."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("NUL")  # PostgreSQL text cannot hold it
    return value


def _aware_datetime(value: Any) -> Any:
    """An ISO 8601 string with a zone; numbers (epoch seconds) are refused, unlike pydantic's default."""
    if isinstance(value, str) and "\x00" not in value:
        parsed = datetime.fromisoformat(value)
        if parsed.tzinfo is not None:
            return parsed
    raise ValueError("not an aware ISO 8601 date-time")


MAX_GRACE_SECONDS = int(MAX_GRACE.total_seconds())
# Before-validators go last: placed first they would hide the bounds from the JSON Schema.
PolicyInt = Annotated[int, Strict(), Field(ge=1, le=MAX_INT), BeforeValidator(_integral)]
DaysInt = Annotated[int, Strict(), Field(ge=1, le=MAX_EXPIRES_IN_DAYS), BeforeValidator(_integral)]
GraceInt = Annotated[int, Strict(), Field(ge=0, le=MAX_GRACE_SECONDS), BeforeValidator(_integral)]
Money = Annotated[Number, Field(ge=0, le=float(MAX_BUDGET_USD))]
# Non-blank: at least one character that is not white space.
Text = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=MAX_NAME_LEN, pattern=r"\S"),
                 AfterValidator(_no_nul)]
Reason = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=MAX_REASON_LEN, pattern=r"\S"),
                   AfterValidator(_no_nul)]
ModelName = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=MAX_MODEL_NAME_LEN, pattern=r"\S"),
                      AfterValidator(_no_nul)]
AwareDateTime = Annotated[datetime, BeforeValidator(_aware_datetime)]
BudgetPeriod = Annotated[str, OneOf(BUDGET_PERIODS)]

#: The default of a field that may be left out but never sent as null (its type refuses
#: null); ``model_fields_set`` tells whether it was sent.
ABSENT: Any = None

_INT_TEXT = f"a whole number from 1 to {MAX_INT}"
_BODY = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# -- bodies -------------------------------------------------------------------------
class _PolicyBody(BaseModel):
    """The limit, budget and expiry fields keys are created and changed with."""

    model_config = _BODY

    rate_limit_requests: Annotated[PolicyInt, Must(_INT_TEXT)] = Field(default=ABSENT, description="requests per window")
    rate_limit_window_seconds: Annotated[PolicyInt, Must(_INT_TEXT)] = Field(
        default=ABSENT, description="length of the request window"
    )
    tokens_per_minute: Annotated[PolicyInt | None, Must(f"{_INT_TEXT} or null")] = None
    max_concurrent: Annotated[PolicyInt | None, Must(f"{_INT_TEXT} or null")] = None
    budget_usd: Annotated[Money | None, Must(f"a number from 0 to {MAX_BUDGET_USD} or null")] = None
    budget_period: Annotated[BudgetPeriod | None, Must(f"one of {', '.join(BUDGET_PERIODS)} or null")] = None
    allowed_models: Annotated[
        Annotated[list[ModelName], Field(max_length=MAX_MODELS)] | None,
        Must(f"a list of at most {MAX_MODELS} model names (wildcards ok) or null"),
    ] = Field(default=None, description="model names this key may use; '*' wildcards allowed; null: any")
    expires_at: Annotated[
        AwareDateTime | None, Must("an ISO 8601 date-time with a time zone (e.g. 2030-01-31T00:00:00Z)")
    ] = Field(default=None, description="with a time zone")
    expires_in_days: Annotated[
        DaysInt | None, Must(f"a whole number from 1 to {MAX_EXPIRES_IN_DAYS} or null")
    ] = None


_NAME_TEXT = f"a non-blank string of at most {MAX_NAME_LEN} characters"


class KeyCreateBody(_PolicyBody):
    """``POST /admin/keys``."""

    name: Annotated[Text, Must(_NAME_TEXT)]
    subject_id: Annotated[uuid.UUID | None, Must("a UUID")] = None


class KeyPatchBody(_PolicyBody):
    """``PATCH /admin/keys/{id}``: only the fields sent change."""

    model_config = ConfigDict(**_BODY, json_schema_extra={"minProperties": 1})

    name: Annotated[Text, Must(_NAME_TEXT)] = Field(default=ABSENT)


class RotateBody(BaseModel):
    """``POST /admin/keys/{id}/rotate`` (the body is optional)."""

    model_config = _BODY

    grace_seconds: Annotated[
        GraceInt | None, Must(f"a whole number from 0 to {MAX_GRACE_SECONDS}"),
    ] = Field(default=None, description="the old key keeps working this long; 0 or absent: revoked at once")
    reason: Annotated[Reason | None, Must(f"a non-blank string of at most {MAX_REASON_LEN} characters")] = None


class RevokeBody(BaseModel):
    """``POST /admin/keys/{id}/revoke`` (the body is optional)."""

    model_config = _BODY

    reason: Annotated[Reason | None, Must(f"a non-blank string of at most {MAX_REASON_LEN} characters")] = None


class BudgetSetBody(BaseModel):
    """``PUT /admin/budgets/{subject_id}``: the whole budget (clearing is ``DELETE``)."""

    model_config = _BODY

    budget_usd: Annotated[Money, Must(f"a number from 0 to {MAX_BUDGET_USD}")] = Field(
        description="USD per period for all the subject's keys together; 0 refuses every call"
    )
    budget_period: Annotated[BudgetPeriod, Must(f"one of {', '.join(BUDGET_PERIODS)}")] = Field(
        default=DEFAULT_BUDGET_PERIOD, description="day and month are UTC calendar periods; total is all time"
    )


#: Every admin body by its OpenAPI component name.
BODIES: dict[str, type[BaseModel]] = {
    "KeyCreate": KeyCreateBody, "KeyPatch": KeyPatchBody, "Rotate": RotateBody, "Revoke": RevokeBody,
    "BudgetSet": BudgetSetBody,
}


def _must(model: Any, name: str) -> str:
    """The :class:`Must` of a field, on the field itself or inside its ``X | None``."""
    info = model.__pydantic_fields__.get(name)
    if info is None:
        return "valid"
    pending: list[Any] = [*info.metadata, info.annotation]
    while pending:
        item = pending.pop(0)
        if isinstance(item, Must):
            return item.what
        pending.extend(getattr(item, "__metadata__", ()))
        pending.extend(get_args(item))
    return "valid"


_Body = TypeVar("_Body", bound=BaseModel)


def _validate_body(model: type[_Body], body: Mapping[str, Any]) -> _Body:
    """``body`` as ``model``, or the 400 naming the first field to fix."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        allowed = ", ".join(model.model_fields)
        raise InvalidRequest(f"unknown field '{unknown[0]}' (allowed: {allowed})", code="unknown_field") from None
    missing = [e for e in errors if e["type"] == "missing"]
    if missing:
        raise InvalidRequest(f"'{missing[0]['loc'][0]}' is required", code="missing_field") from None
    name = str(errors[0]["loc"][0])
    raise _field_error(name, _must(model, name)) from None


def _field_error(name: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{name}' must be {what}", code="invalid_field")


async def read_admin_body(request: web.Request, limit: int, *, optional: bool = False) -> dict[str, Any]:
    """The JSON object sent (400/413 otherwise); with ``optional``, no body means ``{}``.

    Optional bodies are those of actions (revoke, rotate) whose every field has a default.
    """
    if optional and not request.body_exists:
        return {}
    return await read_json_body(request, limit)


_POLICY_FIELDS = (
    "rate_limit_requests", "rate_limit_window_seconds", "tokens_per_minute", "max_concurrent",
    "budget_usd", "budget_period", "allowed_models",
)


def _policy(body: _PolicyBody) -> dict[str, Any]:
    """The policy fields sent, as the key store takes them; absent fields are not in the result."""
    out: dict[str, Any] = {}
    for name in _POLICY_FIELDS:
        if name not in body.model_fields_set:
            continue
        value = getattr(body, name)
        if name == "budget_usd" and value is not None:
            value = Decimal(str(value))
        elif name == "allowed_models" and value is not None:
            value = tuple(value)
        out[name] = value
    return out


def _expiry(body: _PolicyBody, *, now: datetime) -> datetime | Unchanged | None:
    """``expires_at`` or ``expires_in_days`` (not both); UNCHANGED when neither is sent."""
    sent = body.model_fields_set
    if "expires_at" in sent and "expires_in_days" in sent:
        raise InvalidRequest("send 'expires_at' or 'expires_in_days', not both", code="invalid_field")
    if "expires_in_days" in sent:
        return None if body.expires_in_days is None else now + timedelta(days=body.expires_in_days)
    if "expires_at" in sent:
        return body.expires_at
    return UNCHANGED


@dataclass(frozen=True, slots=True)
class KeyCreate:
    """A checked ``POST /admin/keys`` body."""

    name: str
    subject_id: uuid.UUID | None
    policy: dict[str, Any]
    expires_at: datetime | None


def parse_key_create(body: Mapping[str, Any]) -> KeyCreate:
    checked = _validate_body(KeyCreateBody, body)
    now = datetime.now(timezone.utc)
    expires_at = _expiry(checked, now=now)
    if isinstance(expires_at, datetime) and expires_at <= now:
        raise _field_error("expires_at", "in the future")
    policy = _policy(checked)
    if policy.get("budget_usd") is not None and policy.get("budget_period") is None:
        policy["budget_period"] = "month"  # as the CLI does
    return KeyCreate(
        name=checked.name,
        subject_id=checked.subject_id,
        policy=policy,
        expires_at=expires_at if isinstance(expires_at, datetime) else None,
    )


@dataclass(frozen=True, slots=True)
class KeyPatch:
    """A checked ``PATCH /admin/keys/{id}`` body: only the fields sent."""

    name: str | None
    policy: dict[str, Any]
    #: UNCHANGED: leave alone; None: never expires; a datetime (a past one disables the key).
    expires_at: datetime | Unchanged | None

    @property
    def empty(self) -> bool:
        return self.name is None and not self.policy and isinstance(self.expires_at, Unchanged)


def parse_key_patch(body: Mapping[str, Any]) -> KeyPatch:
    checked = _validate_body(KeyPatchBody, body)
    patch = KeyPatch(
        name=checked.name if "name" in checked.model_fields_set else None,
        policy=_policy(checked),
        expires_at=_expiry(checked, now=datetime.now(timezone.utc)),
    )
    if patch.empty:
        fields = ", ".join(KeyPatchBody.model_fields)
        raise InvalidRequest(f"nothing to change: send at least one of {fields}", code="missing_field")
    return patch


@dataclass(frozen=True, slots=True)
class Rotation:
    """A checked ``POST /admin/keys/{id}/rotate`` body."""

    grace: timedelta | None = None
    reason: str | None = None


def parse_rotation(body: Mapping[str, Any]) -> Rotation:
    checked = _validate_body(RotateBody, body)
    seconds = checked.grace_seconds
    # 0 or absent: the old key is revoked at once.
    return Rotation(grace=timedelta(seconds=seconds) if seconds else None, reason=checked.reason)


def parse_revoke(body: Mapping[str, Any]) -> str | None:
    """The optional ``reason`` of a revocation."""
    return _validate_body(RevokeBody, body).reason


@dataclass(frozen=True, slots=True)
class BudgetSet:
    """A checked ``PUT /admin/budgets/{subject_id}`` body: the whole budget."""

    budget_usd: Decimal
    budget_period: str


def parse_budget_set(body: Mapping[str, Any]) -> BudgetSet:
    """``budget_usd`` (required, 0 blocks every call) and ``budget_period`` (default month).

    A PUT replaces the budget, so neither may be null: clearing is ``DELETE``.
    """
    checked = _validate_body(BudgetSetBody, body)
    return BudgetSet(budget_usd=Decimal(str(checked.budget_usd)), budget_period=checked.budget_period)


# -- query strings ------------------------------------------------------------------
def _digits(value: Any) -> Any:
    """A query string's whole number: ASCII digits only (no sign, space or exponent)."""
    if isinstance(value, str):
        if not value.isascii() or not value.isdigit():
            raise ValueError("not digits")
        return int(value)
    return value


def _query_time(value: Any) -> Any:
    """A bare date or a date-time; without a zone it is taken as UTC."""
    if isinstance(value, str):
        parsed = datetime.fromisoformat(value)
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)
    return value


PageSize = Annotated[
    int, Field(ge=1, le=MAX_PAGE), BeforeValidator(_digits), Must(f"a whole number from 1 to {MAX_PAGE}"),
    Field(description=f"page size (default {DEFAULT_PAGE})"),
]
AuditId = Annotated[int, Field(ge=1, le=2**63 - 1), BeforeValidator(_digits), Must(f"a whole number from 1 to {2**63 - 1}")]
QueryUUID = Annotated[uuid.UUID, Must("a UUID")]
QueryTime = Annotated[
    datetime, BeforeValidator(_query_time), Must("an ISO 8601 date or date-time"),
    # A date is accepted too, so the document says "string", not "date-time".
    WithJsonSchema({"type": "string"}),
]
_AFTER = "last_id of the previous page"


KeyState = Annotated[str, OneOf(KEY_STATES), Must(f"one of {', '.join(KEY_STATES)}")]
Action = Annotated[str, OneOf(ACTIONS), Must(f"one of {', '.join(ACTIONS)}")]
GroupBy = Annotated[str, OneOf(GROUP_BYS), Must(f"one of {', '.join(GROUP_BYS)}")]


@model_dataclass(frozen=True, config=SHAPE)
class KeyListQuery:
    """``GET /admin/keys``."""

    subject_id: QueryUUID | None = Field(default=None, description="only this subject's keys")
    state: KeyState | None = Field(default=None, description="only keys in this state")
    limit: PageSize = DEFAULT_PAGE
    after: QueryUUID | None = Field(default=None, description=_AFTER)


@model_dataclass(frozen=True, config=SHAPE)
class BudgetListQuery:
    """``GET /admin/budgets``."""

    limit: PageSize = DEFAULT_PAGE
    after: QueryUUID | None = Field(default=None, description=_AFTER)


@model_dataclass(frozen=True, config=SHAPE)
class AuditQuery:
    """``GET /admin/audit``."""

    limit: PageSize = DEFAULT_PAGE
    after: AuditId | None = Field(default=None, description=_AFTER)
    api_key_id: QueryUUID | None = Field(default=None, description="only changes to this key")
    action: Action | None = Field(default=None, description="only this action")


@model_dataclass(frozen=True, config=SHAPE)
class UsageQuery:
    """``GET /admin/usage``: grouping, a half-open time range [since, until), one key."""

    group_by: GroupBy = Field(default="key", description="default key")
    since: QueryTime | None = Field(default=None, description="ISO 8601 date or date-time (UTC if no zone), inclusive")
    until: QueryTime | None = Field(default=None, description="ISO 8601 date or date-time (UTC if no zone), exclusive")
    api_key_id: QueryUUID | None = Field(default=None, description="only this key")


KeyRef = Annotated[
    str, StringConstraints(pattern=r"^(?:[0-9a-fA-F]{8}-?(?:[0-9a-fA-F]{4}-?){3}[0-9a-fA-F]{12}|[A-Za-z0-9_-]{12})$"),
    Must("a key's id (UUID) or its 12-character prefix"),
]
QueryModel = Annotated[str, StringConstraints(min_length=1, max_length=256), Must("a model name of 1 to 256 characters")]


@model_dataclass(frozen=True, config=SHAPE)
class RequestLogQuery:
    """``GET /admin/requests``: stored calls newest first, by key, model and start time."""

    key: KeyRef | None = Field(default=None, description="only this key's calls: its id or 12-character prefix")
    model: QueryModel | None = Field(default=None, description="only calls asking for this model, or served by this model group")
    since: QueryTime | None = Field(default=None, description="ISO 8601 date or date-time (UTC if no zone), inclusive")
    limit: PageSize = DEFAULT_PAGE
    after: QueryUUID | None = Field(default=None, description=_AFTER + " (a call_id)")


#: Every admin query string by the route kind ``gateway.admin.routes`` names it with.
QUERIES: dict[str, Any] = {
    "keys": KeyListQuery, "budgets": BudgetListQuery, "audit": AuditQuery, "usage": UsageQuery,
    "requests": RequestLogQuery,
}

_Query = TypeVar("_Query")


def _validate_query(model: type[_Query], query: Mapping[str, str]) -> _Query:
    """The query string as ``model``, or the 400 naming the parameter to fix.

    Unknown parameters were refused by the route already (``gateway.admin.routes``).
    """
    try:
        return TypeAdapter(model).validate_python(dict(query))
    except ValidationError as exc:
        name = str(exc.errors(include_url=False)[0]["loc"][0])
    raise InvalidRequest(f"query parameter '{name}' must be {_must(model, name)}", code="invalid_query") from None


def parse_key_list_query(query: Mapping[str, str]) -> KeyListQuery:
    return _validate_query(KeyListQuery, query)


def parse_budget_list_query(query: Mapping[str, str]) -> BudgetListQuery:
    return _validate_query(BudgetListQuery, query)


def parse_audit_query(query: Mapping[str, str]) -> AuditQuery:
    return _validate_query(AuditQuery, query)


def parse_request_log_query(query: Mapping[str, str]) -> RequestLogQuery:
    return _validate_query(RequestLogQuery, query)


def parse_usage_query(query: Mapping[str, str]) -> UsageQuery:
    q = _validate_query(UsageQuery, query)
    if q.since is not None and q.until is not None and q.until <= q.since:
        raise InvalidRequest("query parameter 'until' must be later than 'since'", code="invalid_query")
    return q
