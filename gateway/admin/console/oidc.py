"""OpenID Connect sign-in for the console: authorization code flow with PKCE (S256).

The identity provider is found through its discovery document
(``{issuer}/.well-known/openid-configuration``); the ID token's signature is checked
against its JWKS with PyJWT (the ``oidc`` extra), with the issuer, the audience (our
client id), the expiry and the nonce of this very login. Only asymmetric algorithms are
accepted (never ``none`` or an HMAC keyed with a public value).

Who may sign in (``admin.oidc``): when ``allowed_domains`` is set, a verified email in
one of them; when ``allowed_groups`` is set, membership of one of them (the
``groups_claim``); each list that is set must match. The role comes from
``role_claim`` (a dotted path, e.g. Keycloak's ``realm_access.roles``): ``admin`` or
``viewer`` among its values, else ``default_role``.

What a login in progress needs to remember (state, nonce, PKCE verifier) rides in a
short-lived HttpOnly cookie scoped to ``/ui/oidc``, so any replica can finish it.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from gateway.core.config import OidcSettings

__all__ = ["LOGIN_COOKIE", "LOGIN_TTL", "OidcClient", "OidcRefused", "PendingLogin", "Person"]

LOGIN_COOKIE = "llmg_oidc_login"
#: How long a login may take at the identity provider.
LOGIN_TTL = 600
#: How long the discovery document and the JWKS are trusted before being fetched again
#: (an unknown ``kid`` fetches the JWKS at once: the provider rotated its keys).
METADATA_TTL = 3600.0
_ASYMMETRIC = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")


class OidcRefused(Exception):
    """The sign-in did not succeed; the message is safe to show the person."""


@dataclass(frozen=True, slots=True)
class Person:
    name: str
    role: str
    subject: str


@dataclass(frozen=True, slots=True)
class PendingLogin:
    state: str
    nonce: str
    verifier: str
    next_path: str = "/ui/"

    def cookie_value(self) -> str:
        return ".".join((self.state, self.nonce, self.verifier, base64.urlsafe_b64encode(self.next_path.encode()).decode()))

    @classmethod
    def from_cookie(cls, value: str | None) -> PendingLogin | None:
        parts = (value or "").split(".")
        if len(parts) != 4:
            return None
        try:
            next_path = base64.urlsafe_b64decode(parts[3].encode()).decode()
        except (ValueError, UnicodeDecodeError):
            return None
        return cls(parts[0], parts[1], parts[2], next_path)


def _challenge(verifier: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()


def _claim(claims: dict[str, Any], path: str) -> list[str]:
    """The values of a (dotted) claim as a list of strings: absent → []."""
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, dict):
            return []
        value = value.get(part)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


class OidcClient:
    """One configured identity provider: its metadata, and the two halves of a login."""

    def __init__(self, settings: OidcSettings, session: aiohttp.ClientSession) -> None:
        self.settings = settings
        self._session = session
        self._metadata: tuple[float, dict[str, Any]] | None = None
        self._jwks: tuple[float, dict[str, Any]] | None = None

    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status != 200:
                    raise OidcRefused(f"the identity provider answered {resp.status} for {URL(url).path}")
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise OidcRefused(f"the identity provider cannot be reached ({type(exc).__name__})") from None
        if not isinstance(body, dict):
            raise OidcRefused("the identity provider sent something other than a JSON object")
        return body

    async def metadata(self) -> dict[str, Any]:
        if self._metadata is not None and time.monotonic() - self._metadata[0] < METADATA_TTL:
            return self._metadata[1]
        doc = await self._get_json(f"{self.settings.issuer}/.well-known/openid-configuration")
        if str(doc.get("issuer", "")).rstrip("/") != self.settings.issuer:
            raise OidcRefused("the discovery document names another issuer than admin.oidc.issuer")
        for field in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            if not isinstance(doc.get(field), str):
                raise OidcRefused(f"the discovery document has no {field}")
        self._metadata = (time.monotonic(), doc)
        return doc

    async def _keys(self, *, fresh: bool = False) -> dict[str, Any]:
        if not fresh and self._jwks is not None and time.monotonic() - self._jwks[0] < METADATA_TTL:
            return self._jwks[1]
        jwks = await self._get_json((await self.metadata())["jwks_uri"])
        self._jwks = (time.monotonic(), jwks)
        return jwks

    async def start(self, redirect_uri: str, next_path: str) -> tuple[str, PendingLogin]:
        """The identity provider's URL to send the browser to, and what to remember meanwhile."""
        doc = await self.metadata()
        pending = PendingLogin(
            state=secrets.token_urlsafe(24), nonce=secrets.token_urlsafe(24),
            verifier=secrets.token_urlsafe(48), next_path=next_path,
        )
        url = URL(doc["authorization_endpoint"]).update_query({
            "response_type": "code",
            "client_id": self.settings.client_id,
            "redirect_uri": redirect_uri,
            "scope": " ".join(self.settings.scopes),
            "state": pending.state,
            "nonce": pending.nonce,
            "code_challenge": _challenge(pending.verifier),
            "code_challenge_method": "S256",
        })
        return str(url), pending

    async def finish(self, code: str, pending: PendingLogin, redirect_uri: str) -> Person:
        """Redeem the code (with the PKCE verifier), check the ID token, decide who and which role."""
        doc = await self.metadata()
        form = {
            "grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
            "client_id": self.settings.client_id, "code_verifier": pending.verifier,
        }
        if self.settings.client_secret:
            form["client_secret"] = self.settings.client_secret
        try:
            async with self._session.post(
                doc["token_endpoint"], data=form, headers={"Accept": "application/json"},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp:
                body = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise OidcRefused(f"the identity provider's token endpoint failed ({type(exc).__name__})") from None
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("id_token"), str):
            error = body.get("error") if isinstance(body, dict) else None
            raise OidcRefused(f"the identity provider refused the code ({error or status})")
        claims = await self._verify(body["id_token"], pending.nonce)
        return self._person(claims)

    async def _verify(self, id_token: str, nonce: str) -> dict[str, Any]:
        import jwt  # the oidc extra; checked at start by the config (gateway.core.extras)

        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.InvalidTokenError:
            raise OidcRefused("the ID token is malformed") from None
        alg = header.get("alg")
        if alg not in _ASYMMETRIC:
            raise OidcRefused(f"the ID token is signed with {alg!r}, which is not accepted")
        key = None
        for fresh in (False, True):
            try:
                keys = jwt.PyJWKSet.from_dict(await self._keys(fresh=fresh)).keys
            except jwt.PyJWKSetError as exc:
                raise OidcRefused(f"the identity provider's JWKS is unusable: {exc}") from None
            key = next((k for k in keys if header.get("kid") in (None, k.key_id)), None)
            if key is not None:
                break
        if key is None:
            raise OidcRefused("no key of the identity provider's JWKS matches the ID token")
        try:
            claims: dict[str, Any] = jwt.decode(
                id_token, key.key, algorithms=[alg], audience=self.settings.client_id,
                issuer=self.settings.issuer, leeway=60,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
            )
        except jwt.InvalidTokenError as exc:
            raise OidcRefused(f"the ID token is not valid: {exc}") from None
        if not secrets.compare_digest(str(claims.get("nonce", "")), nonce):
            raise OidcRefused("the ID token belongs to another login (nonce)")
        return claims

    def _person(self, claims: dict[str, Any]) -> Person:
        s = self.settings
        email = claims.get("email") if isinstance(claims.get("email"), str) else None
        if email is not None and claims.get("email_verified") is False:
            email = None  # an unverified address proves nothing about its domain
        if s.allowed_domains:
            domain = email.rpartition("@")[2].lower() if email else ""
            if domain not in s.allowed_domains:
                raise OidcRefused("your account's email domain may not use this console")
        if s.allowed_groups and not set(_claim(claims, s.groups_claim)) & set(s.allowed_groups):
            raise OidcRefused("your account is in none of the groups that may use this console")
        roles = _claim(claims, s.role_claim)
        role = "admin" if "admin" in roles else "viewer" if "viewer" in roles else s.default_role
        if role == "none":
            raise OidcRefused("your account has no console role (admin or viewer)")
        name = email or claims.get("preferred_username") or claims["sub"]
        return Person(name=str(name), role=role, subject=str(claims["sub"]))
