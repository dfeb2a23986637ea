"""The admin console over HTTP (no browser): sessions, CSRF, roles, headers, figures.

Black-box against in-process gateways (both planes over loopback). Single sign-on is in
tests/test_console_oidc.py, the browser-driven flows in tests/test_console_browser.py.
"""

from __future__ import annotations

import asyncio
import csv
import html
import io
import re
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from yarl import URL

from gateway.admin.console.figures import row_label
from gateway.admin.console.layout import CONSOLE_CSP
from gateway.admin.session import COOKIE, SessionStore
from gateway.billing.reports import UsageQuery, format_table, usage_report
from gateway.core.config import ConfigError, load_config, load_settings
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for

ADMIN_TOKEN = "console-admin-token-0123456789abcdef"
ADMIN = auth(ADMIN_TOKEN)
PRICED = [{"name": "*", "deployments": [
    {"provider": "fake", "model": "*", "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}},
]}]


@pytest.fixture
async def console(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> Gateway:
    return await gateway_factory(  # type: ignore[no-any-return]
        env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake.url, models=PRICED),
    )


def origin(gw: Gateway) -> str:
    return str(gw.management.make_url("")).rstrip("/")


async def sign_in(gw: Gateway, token: str = ADMIN_TOKEN) -> tuple[str, str]:
    """Sign in with the form; returns (session cookie, CSRF token)."""
    resp = await gw.management.post("/ui/login", data={"token": token}, allow_redirects=False,
                                    headers={"Origin": origin(gw)})
    assert resp.status == 303, await resp.text()
    cookie = resp.cookies[COOKIE].value
    page = await gw.management.get("/ui/keys", headers={"Cookie": f"{COOKIE}={cookie}"}, allow_redirects=False)
    assert page.status == 200
    match = re.search(r'name="csrf-token" content="([^"]+)"', await page.text())
    assert match
    return cookie, match.group(1)


def with_session(cookie: str, csrf: str | None = None) -> dict[str, str]:
    headers = {"Cookie": f"{COOKIE}={cookie}"}
    if csrf is not None:
        headers["X-CSRF-Token"] = csrf
    return headers


# -- sign-in and the cookie -------------------------------------------------------------
async def test_sign_in_sets_a_strict_http_only_session_cookie(console: Gateway) -> None:
    resp = await console.management.post("/ui/login?next=/ui/usage", data={"token": ADMIN_TOKEN},
                                         allow_redirects=False, headers={"Origin": origin(console)})
    assert resp.status == 303
    assert resp.headers["Location"] == "/ui/usage"
    set_cookie = resp.headers["Set-Cookie"]
    assert f"{COOKIE}=" in set_cookie
    assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and "Path=/" in set_cookie
    assert "Max-Age=28800" in set_cookie
    assert "Secure" not in set_cookie  # plain HTTP on loopback; Secure over TLS
    # Only the hash of the cookie's token is stored.
    token = resp.cookies[COOKIE].value
    rows = await console.state.pool.fetch("SELECT token_sha256 FROM console_sessions")
    assert rows and all(token.encode() not in bytes(r["token_sha256"]) for r in rows)


async def test_wrong_token_is_refused_with_the_form_again(console: Gateway) -> None:
    resp = await console.management.post("/ui/login", data={"token": "nope"}, allow_redirects=False,
                                         headers={"Origin": origin(console)})
    assert resp.status == 401
    assert COOKIE not in resp.cookies
    assert "not the admin token" in await resp.text()


@pytest.mark.parametrize("headers", [
    {"Origin": "https://evil.example"},
    {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
])
async def test_sign_in_from_another_site_is_refused(console: Gateway, headers: dict[str, str]) -> None:
    resp = await console.management.post("/ui/login", data={"token": ADMIN_TOKEN}, allow_redirects=False,
                                         headers=headers)
    assert resp.status == 403
    assert COOKIE not in resp.cookies


async def test_next_never_leaves_the_console(console: Gateway) -> None:
    for target in ("//evil.example/x", "https://evil.example", "/admin/keys", "/ui\\..\\x"):
        resp = await console.management.post(
            "/ui/login", params={"next": target}, data={"token": ADMIN_TOKEN}, allow_redirects=False,
            headers={"Origin": origin(console)},
        )
        assert resp.headers["Location"] == "/ui/", target


async def test_every_page_needs_a_session(console: Gateway) -> None:
    for path in ("/ui/", "/ui/keys", "/ui/subjects", "/ui/usage", "/ui/usage.csv", "/ui/providers",
                 "/ui/cache", "/ui/audit", "/ui/keys/00000000-0000-0000-0000-000000000000"):
        resp = await console.management.get(path, allow_redirects=False)
        assert resp.status == 303, path
        assert URL(resp.headers["Location"]).path == "/ui/login", path
        bogus = await console.management.get(path, allow_redirects=False, headers={"Cookie": f"{COOKIE}=forged"})
        assert bogus.status == 303, path


async def test_pages_render_for_a_session(console: Gateway) -> None:
    cookie, _ = await sign_in(console)
    for path in ("/ui/", "/ui/keys", "/ui/subjects", "/ui/usage", "/ui/providers", "/ui/cache", "/ui/audit"):
        resp = await console.management.get(path, headers=with_session(cookie), allow_redirects=False)
        assert resp.status == 200, (path, await resp.text())
        assert resp.headers["Content-Security-Policy"] == CONSOLE_CSP
        assert resp.headers["Cache-Control"] == "no-store"
        html = await resp.text()
        assert "<script src=\"/ui/static/console.js?v=" in html
        assert "<script>" not in html and " style=" not in html and "onclick" not in html


async def test_static_assets_are_cacheable_and_the_api_keeps_its_strict_csp(console: Gateway) -> None:
    page = await console.management.get("/ui/login")
    assets = re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', await page.text())
    assert len(assets) == 2
    for path in assets:
        resp = await console.management.get(path)
        assert resp.status == 200
        assert resp.headers["Cache-Control"] == "public, max-age=31536000, immutable"
        assert resp.content_type in ("text/css", "text/javascript")
    assert (await console.management.get("/ui/static/nope.js")).status == 404
    api = await console.management.get("/admin/keys", headers=ADMIN)
    assert api.headers["Content-Security-Policy"] == "default-src 'none'; frame-ancestors 'none'"


# -- the admin API with a session ---------------------------------------------------------
async def test_admin_api_accepts_the_session_and_needs_csrf_for_changes(console: Gateway) -> None:
    cookie, csrf = await sign_in(console)
    listed = await console.management.get("/admin/keys", headers=with_session(cookie))
    assert listed.status == 200
    refused = await console.management.post("/admin/keys", json={"name": "x"}, headers=with_session(cookie))
    assert refused.status == 403
    assert (await refused.json())["error"]["code"] == "csrf_failed"
    wrong = await console.management.post("/admin/keys", json={"name": "x"}, headers=with_session(cookie, "wrong"))
    assert (await wrong.json())["error"]["code"] == "csrf_failed"
    made = await console.management.post("/admin/keys", json={"name": "x"}, headers=with_session(cookie, csrf))
    assert made.status == 201
    assert await console.state.pool.fetchval("SELECT count(*) FROM api_keys WHERE name = 'x'") == 1
    trail = await (await console.management.get("/admin/audit?action=key.create", headers=ADMIN)).json()
    assert trail["data"][0]["actor"].startswith("token:")


async def test_a_viewer_may_read_but_not_change(console: Gateway) -> None:
    token, session = await SessionStore(console.state.pool).create("vera@example.com", "viewer", "oidc", 60)
    headers = with_session(token, session.csrf_token)
    assert (await console.management.get("/admin/keys", headers=headers)).status == 200
    assert (await console.management.get("/ui/keys", headers=headers)).status == 200
    for method, path in (("POST", "/admin/keys"), ("PUT", "/admin/budgets/00000000-0000-0000-0000-000000000001"),
                         ("DELETE", "/admin/cache?all=true")):
        resp = await console.management.request(method, path, json={"name": "v"}, headers=headers)
        assert resp.status == 403, (method, path)
        assert (await resp.json())["error"]["code"] == "read_only"
    page = await (await console.management.get("/ui/keys", headers=headers)).text()
    assert 'id="create-key"' not in page


async def test_sign_out_ends_the_session_everywhere(console: Gateway) -> None:
    cookie, csrf = await sign_in(console)
    refused = await console.management.post("/ui/logout", data={"csrf_token": "wrong"},
                                            headers=with_session(cookie), allow_redirects=False)
    assert refused.status == 403
    assert (await console.management.get("/admin/keys", headers=with_session(cookie))).status == 200
    out = await console.management.post("/ui/logout", data={"csrf_token": csrf}, headers=with_session(cookie),
                                        allow_redirects=False)
    assert out.status == 303 and out.headers["Location"] == "/ui/login"
    after = await console.management.get("/admin/keys", headers=with_session(cookie))
    assert after.status == 401
    assert (await console.management.get("/ui/", headers=with_session(cookie), allow_redirects=False)).status == 303
    actions = [e["action"] for e in (await (await console.management.get("/admin/audit", headers=ADMIN)).json())["data"]]
    assert actions[:2] == ["session.sign_out", "session.sign_in"]


async def test_a_session_expires(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> None:
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN},
                               config_yaml=config_for(fake.url, admin={"session_ttl_seconds": 1}))
    cookie, _ = await sign_in(gw)
    await asyncio.sleep(1.3)
    assert (await gw.management.get("/admin/keys", headers=with_session(cookie))).status == 401
    assert (await gw.management.get("/ui/keys", headers=with_session(cookie), allow_redirects=False)).status == 303


async def test_without_token_or_sign_on_the_console_and_api_stay_closed(gateway: Gateway) -> None:
    page = await gateway.management.get("/ui/login")
    assert "console is disabled" in await page.text()
    resp = await gateway.management.get("/admin/keys")
    assert (await resp.json())["error"]["code"] == "admin_disabled"


# -- figures --------------------------------------------------------------------------
async def test_usage_page_and_csv_match_the_admin_api_and_the_cli(console: Gateway) -> None:
    made = await (await console.management.post("/admin/keys", json={"name": "fig"}, headers=ADMIN)).json()
    for _ in range(3):
        resp = await console.data.post("/v1/chat/completions", json=chat_body(), headers=auth(made["api_key"]))
        assert resp.status == 200
    assert await console.state.billing.flush()
    cookie, _ = await sign_in(console)
    since = (datetime.now(timezone.utc) - timedelta(hours=1)).replace(microsecond=0).isoformat()
    # The run's database is shared by every test: look at this key's calls only.
    for group_by in ("key", "model", "day"):
        params = {"since": since, "group_by": group_by, "api_key_id": made["api_key_id"]}
        api = await (await console.management.get("/admin/usage", params=params, headers=ADMIN)).json()
        page = await (await console.management.get("/ui/usage", params=params, headers=with_session(cookie))).text()
        total = re.search(r'data-total-cost="([0-9.]+)"', page)
        assert total and float(total.group(1)) == pytest.approx(api["totals"]["cost_usd"], abs=1e-6)
        assert api["totals"]["cost_usd"] > 0 and api["totals"]["requests"] == 3
        assert f">{api['totals']['requests']:,}<" in page
        exported = await console.management.get("/ui/usage.csv", params=params, headers=with_session(cookie))
        assert exported.content_type == "text/csv"
        rows = list(csv.DictReader(io.StringIO(await exported.text())))
        assert rows[-1]["group"] == "total" and int(rows[-1]["requests"]) == 3
        # The CLI's table prints the same numbers from the same report.
        report = await usage_report(console.state.pool, UsageQuery(
            group_by=group_by, since=datetime.fromisoformat(since), api_key_id=uuid.UUID(made["api_key_id"])))
        cli = format_table(report).splitlines()[-1].split()
        assert cli[0] == "TOTAL" and rows[-1]["cost_usd"] == cli[-1] and rows[-1]["requests"] == cli[1]


async def test_overview_figures_match_the_admin_api(console: Gateway) -> None:
    made = await (await console.management.post("/admin/keys", json={"name": "ov"}, headers=ADMIN)).json()
    for _ in range(2):
        await console.data.post("/v1/chat/completions", json=chat_body(), headers=auth(made["api_key"]))
    assert await console.state.billing.flush()
    cookie, _ = await sign_in(console)
    page = await (await console.management.get("/ui/", headers=with_session(cookie))).text()
    today = datetime.now(timezone.utc).date()
    for period, since in (("today", today), ("week", today - timedelta(days=6))):
        api = await (await console.management.get(
            "/admin/usage", params={"since": since.isoformat(), "group_by": "day"}, headers=ADMIN)).json()
        section = page.split(f'data-period="{period}"')[1].split("</section>")[0]
        shown = re.search(r'data-figure="cost_usd" data-value="([0-9.]+)"', section)
        assert shown and float(shown.group(1)) == pytest.approx(api["totals"]["cost_usd"], abs=1e-6)
        assert f'data-figure="requests">{api["totals"]["requests"]:,}<' in section
        assert "ms /" in section  # p50 / p99 of the calls just made
    top_keys = await usage_report(console.state.pool, UsageQuery(
        group_by="key", since=datetime.combine(today - timedelta(days=6), datetime.min.time(), tzinfo=timezone.utc)))
    shown_top = page.split('id="top-key"')[1].split("</table>")[0]
    rows = top_keys.rows
    assert rows
    # The page's top five by spend are the report's (keys tied at the fifth place may be
    # either; on the run's shared ledger ties are common).
    fifth = rows[min(5, len(rows)) - 1].cost_usd
    # Named as the CLI names them: a key by prefix and name, a key no longer known by its id.
    def named(r: Any) -> bool:
        return html.escape(row_label(r)) in shown_top

    assert all(named(r) for r in rows if r.cost_usd > fifth)
    shown = sum(1 for r in rows if r.cost_usd >= fifth and named(r))
    assert shown == min(5, len(rows))
    assert shown_top.count("<tr>") == 1 + min(5, len(rows))


async def test_subjects_page_shows_spend_against_budget(console: Gateway) -> None:
    subject = "6b1d2a9e-0000-4000-8000-000000000001"
    await console.management.put(f"/admin/budgets/{subject}", json={"budget_usd": 5, "budget_period": "day"},
                                 headers=ADMIN)
    cookie, _ = await sign_in(console)
    page = await (await console.management.get("/ui/subjects", headers=with_session(cookie))).text()
    row = page.split(f"<code>{subject}</code>")[1].split("</tr>")[0]
    assert "day" in row and "$5.0000" in row and "$0.000000" in row


# -- config -----------------------------------------------------------------------------
def test_admin_oidc_config_is_checked(tmp_path: Any) -> None:
    def load(section: Any) -> Any:
        path = tmp_path / "g.yaml"
        path.write_text(config_for("http://127.0.0.1:1", admin=section))
        env = {"GATEWAY_CONFIG": str(path)}
        return load_config(load_settings(env), env)

    assert load({}).admin.oidc is None
    ok = load({"oidc": {"issuer": "https://id.example/", "client_id": "c", "allowed_domains": ["Example.com"]}})
    assert ok.admin.oidc.issuer == "https://id.example" and ok.admin.oidc.allowed_domains == ("example.com",)
    for section, message in (
        ({"oidc": {"client_id": "c"}}, "admin.oidc.issuer: required"),
        ({"oidc": {"issuer": "id.example", "client_id": "c"}}, "admin.oidc.issuer: expected an http(s) URL"),
        ({"oidc": {"issuer": "https://id.example", "client_id": "c", "tenant": 1}}, "admin.oidc.tenant: unknown key"),
        ({"oidc": {"issuer": "https://i", "client_id": "c", "default_role": "root"}}, "admin.oidc.default_role"),
        ({"oidc": {"issuer": "https://i", "client_id": "c", "scopes": ["email"]}}, "admin.oidc.scopes"),
        ({"session_ttl_seconds": 0}, "admin.session_ttl_seconds"),
        ({"sessions": 1}, "admin.sessions: unknown key"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(section)


# -- replicas and the admin token -------------------------------------------------------
async def test_a_session_works_on_every_replica_until_the_admin_token_changes(
    gateway_factory: Callable[..., Any], fake: FakeUpstream,
) -> None:
    first = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake.url))
    replica = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake.url))
    rotated = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN + "-new"}, config_yaml=config_for(fake.url))
    cookie, csrf = await sign_in(first)
    made = await replica.management.post("/admin/keys", json={"name": "r"}, headers=with_session(cookie, csrf))
    assert made.status == 201
    assert (await replica.management.get("/ui/keys", headers=with_session(cookie), allow_redirects=False)).status == 200
    # The token it was signed in with is no longer the admin token there: the session is over.
    assert (await rotated.management.get("/admin/keys", headers=with_session(cookie))).status == 401
    assert (await rotated.management.get("/ui/keys", headers=with_session(cookie), allow_redirects=False)).status == 303


def test_the_session_cookie_is_secure_over_tls() -> None:
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from gateway.admin.session import session_cookie

    for scheme, secure in (("https", True), ("http", False)):
        request = make_mocked_request("POST", "/ui/login").clone(scheme=scheme)
        response = web.Response()
        session_cookie(response, request, "t0ken", 60)
        header = response.cookies[COOKIE].output()
        assert ("Secure" in header) is secure, scheme
        assert "HttpOnly" in header and "SameSite=Strict" in header and "Max-Age=60" in header


# -- pages: filters and errors -------------------------------------------------------------
async def test_keys_page_searches_and_filters(console: Gateway) -> None:
    alpha = await (await console.management.post("/admin/keys", json={"name": "alpha-team"}, headers=ADMIN)).json()
    beta = await (await console.management.post("/admin/keys", json={"name": "beta-team"}, headers=ADMIN)).json()
    await console.management.post(f"/admin/keys/{beta['api_key_id']}/revoke", headers=ADMIN)
    cookie, _ = await sign_in(console)

    async def listed(**params: str) -> str:
        resp = await console.management.get("/ui/keys", params=params, headers=with_session(cookie))
        assert resp.status == 200
        return (await resp.text()).split('id="keys"')[1]

    assert "alpha-team" in await listed(q="ALPHA") and "beta-team" not in await listed(q="alpha")
    assert "alpha-team" in await listed(q=alpha["key_prefix"])
    revoked = await listed(state="revoked")
    assert "beta-team" in revoked and "alpha-team" not in revoked
    by_subject = await listed(subject_id=alpha["subject_id"])
    assert "alpha-team" in by_subject and "beta-team" not in by_subject
    bad = await (await console.management.get("/ui/keys", params={"subject_id": "x", "state": "gone"},
                                              headers=with_session(cookie))).text()
    assert "subject must be a UUID" in bad
    missing = await console.management.get("/ui/keys/7d0a5ad1-0000-4000-8000-000000000000", headers=with_session(cookie))
    assert "Key not found" in await missing.text()
    detail = await (await console.management.get(f"/ui/keys/{alpha['api_key_id']}", headers=with_session(cookie))).text()
    assert alpha["key_prefix"] in detail and "key.create" in detail and 'id="revoke-key"' in detail


async def test_audit_page_filters_by_action_and_key(console: Gateway) -> None:
    one = await (await console.management.post("/admin/keys", json={"name": "one"}, headers=ADMIN)).json()
    await console.management.post(f"/admin/keys/{one['api_key_id']}/revoke", headers=ADMIN)
    await console.management.post("/admin/keys", json={"name": "two"}, headers=ADMIN)
    cookie, _ = await sign_in(console)

    async def rows(**params: str) -> list[str]:
        page = await (await console.management.get("/ui/audit", params=params, headers=with_session(cookie))).text()
        return re.findall(r"<tr><td[^>]*>[^<]+</td><td[^>]*>[^<]+</td><td[^>]*>([a-z._]+)</td>", page)

    assert set(await rows(action="key.revoke")) == {"key.revoke"}
    assert sorted(await rows(api_key_id=one["api_key_id"])) == ["key.create", "key.revoke"]
    assert "session.sign_in" in await rows()
    page = await (await console.management.get("/ui/audit", params={"api_key_id": one["api_key_id"]},
                                                headers=with_session(cookie))).text()
    assert "{&quot;already_revoked&quot;:false}" in page  # the detail as the API's JSON


async def test_usage_page_groups_by_each_dimension_and_explains_a_bad_range(console: Gateway, api_key: str) -> None:
    assert (await console.data.post("/v1/chat/completions", json=chat_body(), headers=auth(api_key))).status == 200
    assert await console.state.billing.flush()
    cookie, _ = await sign_in(console)
    for group_by in ("day", "model", "key", "subject", "provider"):
        page = await (await console.management.get("/ui/usage", params={"group_by": group_by},
                                                    headers=with_session(cookie))).text()
        report = await usage_report(console.state.pool, UsageQuery(
            group_by=group_by, since=datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
            - timedelta(days=6)))
        total = re.search(r'data-total-cost="([0-9.]+)"', page)
        assert total and float(total.group(1)) == pytest.approx(float(report.total.cost_usd), abs=1e-6), group_by
        assert len(re.findall(r"data-cost=", page)) == len(report.rows), group_by
    bad = {"since": "2026-02-01", "until": "2026-01-01"}
    page = await (await console.management.get("/ui/usage", params=bad, headers=with_session(cookie))).text()
    assert "since: must be before until" in page
    exported = await console.management.get("/ui/usage.csv", params=bad, headers=with_session(cookie))
    assert exported.status == 400 and "since: must be before until" in await exported.text()


async def test_an_admin_session_purges_the_cache(console: Gateway) -> None:
    cookie, csrf = await sign_in(console)
    resp = await console.management.delete("/admin/cache?all=true", headers=with_session(cookie, csrf))
    assert resp.status == 200 and "purged" in await resp.json()
    page = await (await console.management.get("/ui/cache", headers=with_session(cookie))).text()
    assert 'id="purge-cache"' in page and 'id="hit-rate"' in page


def test_every_console_asset_is_packaged() -> None:
    """setup.cfg's package_data must carry every file the console serves (no CDN, no build)."""
    import configparser
    import fnmatch

    from tests.conftest import REPO

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    globs = [g.strip() for g in cfg["options.package_data"]["gateway"].splitlines() if g.strip()]
    static = REPO / "gateway" / "admin" / "console" / "static"
    files = [p.relative_to(REPO / "gateway").as_posix() for p in static.iterdir()]
    assert files
    for name in files:
        assert any(fnmatch.fnmatch(name, g) for g in globs), f"{name} is not in package_data"


async def test_pages_and_sessions_answer_503_while_the_database_is_away(
    database_url: str, pg_proxy: Any, fake: FakeUpstream, tmp_path: Any,
) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.edge.app import build_management_app, gateway_state
    from tests.conftest import via_proxy

    path = tmp_path / "gateway.yaml"
    path.write_text(config_for(fake.url))
    environ = {"ADMIN_TOKEN": ADMIN_TOKEN, "GATEWAY_CONFIG": str(path)}
    settings = load_settings(environ)
    async with gateway_state(settings, load_config(settings, environ), via_proxy(database_url, pg_proxy.port)) as state:
        client = TestClient(TestServer(build_management_app(state), host="127.0.0.1"))
        await client.start_server()
        try:
            gw = Gateway(data=client, management=client, state=state)
            cookie, csrf = await sign_in(gw)
            await pg_proxy.cut()
            page = await client.get("/ui/keys", headers=with_session(cookie), allow_redirects=False)
            assert page.status == 503 and page.headers["Retry-After"] == "1"
            assert "Database unavailable" in await page.text()
            for method in ("GET", "POST"):
                api = await client.request(method, "/admin/keys", json={"name": "during"},
                                           headers=with_session(cookie, csrf))
                assert api.status == 503 and (await api.json())["error"]["code"] == "database_unavailable"
        finally:
            await pg_proxy.restore()
            await client.close()


async def test_usage_page_offers_range_presets(console: Gateway) -> None:
    cookie, _ = await sign_in(console)
    page = await (await console.management.get("/ui/usage", params={"group_by": "model"},
                                                headers=with_session(cookie))).text()
    month = (datetime.now(timezone.utc).date() - timedelta(days=29)).isoformat()
    assert f'href="/ui/usage?since={month}&amp;group_by=model"' in page
