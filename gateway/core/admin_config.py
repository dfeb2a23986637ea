"""``admin:`` in the config file: the console's sessions and single sign-on (OIDC)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from gateway.core.extras import extra_installed
from gateway.core.schema import SHAPE, Number, Section, problem

__all__ = ["AdminSettings", "OidcSettings"]

NonEmpty = Annotated[StrictStr, Field(min_length=1)]


def _issuer(value: str) -> str:
    if not value.startswith(("https://", "http://")):
        raise problem("expected an http(s) URL")
    return value.rstrip("/")


def _lower(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(v.lower() for v in values)


@dataclass(frozen=True, config=SHAPE)
class OidcSettings(Section):
    """``admin.oidc``: single sign-on to the admin console (authorization code + PKCE)."""

    issuer: Annotated[NonEmpty, AfterValidator(_issuer)]
    client_id: NonEmpty
    client_secret: NonEmpty | None = None
    #: Where the identity provider sends the browser back; default: this plane's own
    #: ``/ui/oidc/callback`` as the browser reached it.
    redirect_url: NonEmpty | None = None
    scopes: tuple[NonEmpty, ...] = ("openid", "email", "profile")
    #: Who may sign in: an email domain listed here, and/or a group listed here (each
    #: list that is set must match).
    allowed_domains: Annotated[tuple[NonEmpty, ...], AfterValidator(_lower)] = ()
    allowed_groups: tuple[NonEmpty, ...] = ()
    groups_claim: NonEmpty = "groups"
    #: The claim whose values name the role: ``admin`` (may change) or ``viewer``.
    role_claim: NonEmpty = "roles"
    #: The role of an allowed person whose role claim names neither (``none``: refused).
    default_role: Literal["viewer", "admin", "none"] = "viewer"

    @model_validator(mode="after")
    def _usable(self) -> OidcSettings:
        if "openid" not in self.scopes:
            raise problem("must include 'openid'", at="scopes")
        return self


@dataclass(frozen=True, config=SHAPE)
class AdminSettings(Section):
    """``admin:``: the console's sessions and sign-on."""

    session_ttl: Annotated[Number, Field(ge=1)] = Field(default=8 * 3600.0, validation_alias="session_ttl_seconds")
    oidc: OidcSettings | None = None

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("oidc") is not None and not extra_installed("oidc"):
            raise problem("single sign-on needs pip install 'llm-gateway[oidc]'", at="oidc")
        return data
