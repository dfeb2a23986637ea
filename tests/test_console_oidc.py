"""Single sign-on to the admin console over HTTP: authorization code + PKCE against a
fake OpenID Connect provider (tests/fake_idp.py), who may sign in, roles, and refusals.

The browser does the same walk in tests/test_console_browser.py.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from yarl import URL

from gateway.admin.session import COOKIE
from tests.conftest import FakeUpstream, Gateway, config_for
from tests.fake_idp import FakeIdp, oidc_section, start_idp
from tests.test_console import ADMIN, with_session


@pytest.fixture
async def idp() -> AsyncIterator[FakeIdp]:
    provider = await start_idp()
    yield provider
    assert provider.server is not None
    await provider.server.close()


async def oidc_gateway(gateway_factory: Callable[..., Any], fake: FakeUpstream, idp: FakeIdp,
                       **extra: Any) -> Gateway:
    return await gateway_factory(  # type: ignore[no-any-return]
        config_yaml=config_for(fake.url, admin=oidc_section(idp, **extra)),
    )


async def sso(gw: Gateway) -> aiohttp.ClientResponse:
    """Walk the sign-on like a browser would (cookies by hand): returns the callback's answer."""
    start = await gw.management.get("/ui/oidc/start?next=/ui/keys", allow_redirects=False)
    assert start.status == 302, await start.text()
    login_cookie = start.headers["Set-Cookie"]
    assert "HttpOnly" in login_cookie and "SameSite=Lax" in login_cookie and "Path=/ui/oidc" in login_cookie
    async with aiohttp.ClientSession() as browser:
        at_idp = await browser.get(start.headers["Location"], allow_redirects=False)
        assert at_idp.status == 302, await at_idp.text()
        callback = URL(at_idp.headers["Location"])
    name, _, value = login_cookie.split(";")[0].partition("=")
    return await gw.management.get(callback.path_qs, headers={"Cookie": f"{name}={value}"}, allow_redirects=False)


async def test_sign_on_with_pkce_names_the_person(gateway_factory: Callable[..., Any], fake: FakeUpstream,
                                                  idp: FakeIdp) -> None:
    gw = await oidc_gateway(gateway_factory, fake, idp, allowed_domains=["example.com"])
    resp = await sso(gw)
    assert resp.status == 200, await resp.text()
    assert 'http-equiv="refresh" content="0;url=/ui/keys"' in await resp.text()
    assert "SameSite=Strict" in resp.headers.getall("Set-Cookie")[0]
    token = resp.cookies[COOKIE].value
    sent = idp.token_requests[-1]
    assert sent["code_verifier"] and sent["client_secret"]
    page = await (await gw.management.get("/ui/keys", headers=with_session(token))).text()
    assert "ada@example.com · admin" in page
    csrf = re.search(r'name="csrf-token" content="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    made = await gw.management.post("/admin/keys", json={"name": "sso"}, headers=with_session(token, csrf))
    assert made.status == 201
    actor = await gw.state.pool.fetchval("SELECT actor FROM admin_audit WHERE action = 'key.create' "
                                         "ORDER BY audit_id DESC LIMIT 1")
    assert actor == "ada@example.com"
    # No ADMIN_TOKEN here: a bearer token gets nothing, and is told where to sign in.
    gw.management.session.cookie_jar.clear()
    for headers in (ADMIN, {}):
        refused = await gw.management.get("/admin/keys", headers=headers)
        assert refused.status == 403
        assert "sign in at /ui/" in (await refused.json())["error"]["message"]


async def test_sign_on_role_viewer_is_read_only(gateway_factory: Callable[..., Any], fake: FakeUpstream,
                                                idp: FakeIdp) -> None:
    idp.claims = {"email": "vic@example.com", "email_verified": True,
                  "realm_access": {"roles": ["viewer", "offline_access"]}}
    gw = await oidc_gateway(gateway_factory, fake, idp, role_claim="realm_access.roles", default_role="none")
    resp = await sso(gw)
    token = resp.cookies[COOKIE].value
    page = await (await gw.management.get("/ui/keys", headers=with_session(token))).text()
    csrf = re.search(r'name="csrf-token" content="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    made = await gw.management.post("/admin/keys", json={"name": "v"}, headers=with_session(token, csrf))
    assert (await made.json())["error"]["code"] == "read_only"


@pytest.mark.parametrize("claims, extra, reason", [
    ({"email": "eve@evil.example", "email_verified": True}, {"allowed_domains": ["example.com"]}, "email domain"),
    ({"email": "eve@example.com", "email_verified": False}, {"allowed_domains": ["example.com"]}, "email domain"),
    ({"email": "bob@example.com", "groups": ["staff"]}, {"allowed_groups": ["llm-admins"]}, "none of the groups"),
    ({"email": "bob@example.com"}, {"default_role": "none"}, "no console role"),
])
async def test_sign_on_refuses_who_is_not_allowed(gateway_factory: Callable[..., Any], fake: FakeUpstream,
                                                  idp: FakeIdp, claims: dict[str, Any], extra: dict[str, Any],
                                                  reason: str) -> None:
    idp.claims = claims
    gw = await oidc_gateway(gateway_factory, fake, idp, **extra)
    resp = await sso(gw)
    assert resp.status == 403
    assert reason in await resp.text()
    assert COOKIE not in resp.cookies


async def test_sign_on_refuses_a_forged_token_and_a_foreign_state(gateway_factory: Callable[..., Any],
                                                                  fake: FakeUpstream, idp: FakeIdp) -> None:
    gw = await oidc_gateway(gateway_factory, fake, idp)
    idp.forge = True
    resp = await sso(gw)
    assert resp.status == 403 and "not valid" in await resp.text()
    idp.forge = False
    # A callback this browser did not start (no login cookie): refused before any code is redeemed.
    before = len(idp.token_requests)
    cold = await gw.management.get("/ui/oidc/callback?code=x&state=y", allow_redirects=False)
    assert cold.status == 400 and len(idp.token_requests) == before


async def test_sign_on_says_so_when_the_identity_provider_is_down(
    gateway_factory: Callable[..., Any], fake: FakeUpstream,
) -> None:
    from tests.conftest import free_port

    down = f"http://127.0.0.1:{free_port()}"
    gw = await gateway_factory(config_yaml=config_for(fake.url, admin={"oidc": {"issuer": down, "client_id": "c"}}))
    login = await (await gw.management.get("/ui/login")).text()
    assert 'id="sso"' in login and 'id="token"' not in login
    resp = await gw.management.get("/ui/oidc/start", allow_redirects=False)
    assert resp.status == 502
    assert "cannot be reached" in await resp.text()


async def test_sign_on_follows_a_key_rotation_and_refuses_an_empty_jwks(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, idp: FakeIdp,
) -> None:
    gw = await oidc_gateway(gateway_factory, fake, idp)
    assert (await sso(gw)).status == 200  # the JWKS is now cached
    idp.rotate_keys()  # an unknown kid: fetched again at once, not after the cache's hour
    assert (await sso(gw)).status == 200
    idp.empty_jwks = True
    idp.rotate_keys()
    resp = await sso(gw)
    assert resp.status == 403 and "JWKS is unusable" in await resp.text()
