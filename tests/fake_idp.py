"""A small OpenID Connect identity provider for the console's sign-on tests.

Serves what a real one does over loopback HTTP: the discovery document, a JWKS with
one RSA key, an authorization endpoint that signs the configured person in at once
(no login form) and sends the browser back with a code, and a token endpoint that
checks the client, the redirect URI and the PKCE verifier (S256) and answers a signed
RS256 ID token carrying the login's nonce.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import jwt
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric import rsa
from yarl import URL

CLIENT_ID = "llm-gateway-console"
CLIENT_SECRET = "console-client-secret"


@dataclass
class FakeIdp:
    """The provider's state: who signs in next, and what it saw."""

    claims: dict[str, Any] = field(default_factory=lambda: {"email": "ada@example.com", "email_verified": True,
                                                            "roles": ["admin"]})
    server: TestServer | None = None
    codes: dict[str, dict[str, Any]] = field(default_factory=dict)
    token_requests: list[dict[str, str]] = field(default_factory=list)
    #: Sign ID tokens with another key than the JWKS's (a forged token).
    forge: bool = False
    #: Serve a JWKS with no key in it.
    empty_jwks: bool = False

    def __post_init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = secrets.token_hex(4)

    def rotate_keys(self) -> None:
        """A new signing key under a new kid, as providers do from time to time."""
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = secrets.token_hex(4)

    @property
    def issuer(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self.discovery)
        app.router.add_get("/jwks", self.jwks)
        app.router.add_get("/authorize", self.authorize)
        app.router.add_post("/token", self.token)
        return app

    async def discovery(self, request: web.Request) -> web.Response:
        return web.json_response({
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "jwks_uri": f"{self.issuer}/jwks",
            "response_types_supported": ["code"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "code_challenge_methods_supported": ["S256"],
        })

    async def jwks(self, request: web.Request) -> web.Response:
        if self.empty_jwks:
            return web.json_response({"keys": []})
        jwk = jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key(), as_dict=True)
        return web.json_response({"keys": [{**jwk, "kid": self.kid, "use": "sig", "alg": "RS256"}]})

    async def authorize(self, request: web.Request) -> web.Response:
        q = request.query
        if q.get("client_id") != CLIENT_ID or q.get("response_type") != "code":
            return web.json_response({"error": "invalid_request"}, status=400)
        if q.get("code_challenge_method") != "S256" or not q.get("code_challenge"):
            return web.json_response({"error": "invalid_request", "error_description": "PKCE required"}, status=400)
        code = secrets.token_urlsafe(16)
        self.codes[code] = {"challenge": q["code_challenge"], "redirect_uri": q["redirect_uri"], "nonce": q.get("nonce")}
        raise web.HTTPFound(str(URL(q["redirect_uri"]).update_query(code=code, state=q.get("state", ""))))

    async def token(self, request: web.Request) -> web.Response:
        form = dict(await request.post())
        self.token_requests.append({k: str(v) for k, v in form.items()})
        grant = self.codes.pop(str(form.get("code")), None)
        if grant is None or form.get("grant_type") != "authorization_code":
            return web.json_response({"error": "invalid_grant"}, status=400)
        if form.get("client_id") != CLIENT_ID or form.get("client_secret") != CLIENT_SECRET:
            return web.json_response({"error": "invalid_client"}, status=401)
        if form.get("redirect_uri") != grant["redirect_uri"]:
            return web.json_response({"error": "invalid_grant", "error_description": "redirect_uri"}, status=400)
        verifier = str(form.get("code_verifier", ""))
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        if challenge != grant["challenge"]:
            return web.json_response({"error": "invalid_grant", "error_description": "PKCE verifier"}, status=400)
        now = int(time.time())
        claims = {"iss": self.issuer, "aud": CLIENT_ID, "sub": "user-" + secrets.token_hex(4), "iat": now,
                  "exp": now + 300, "nonce": grant["nonce"], **self.claims}
        id_token = jwt.encode(claims, self.other_key if self.forge else self.key, algorithm="RS256",
                              headers={"kid": self.kid})
        return web.json_response({"access_token": "at-" + secrets.token_hex(8), "token_type": "Bearer",
                                  "expires_in": 300, "id_token": id_token})


async def start_idp() -> FakeIdp:
    idp = FakeIdp()
    idp.server = TestServer(idp.app(), host="127.0.0.1")
    await idp.server.start_server()
    return idp


def oidc_section(idp: FakeIdp, **extra: Any) -> dict[str, Any]:
    """The config file's ``admin:`` section, signing on through ``idp``."""
    return {"oidc": {"issuer": idp.issuer, "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, **extra}}
