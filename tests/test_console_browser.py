"""The admin console in a real browser: Playwright driving Debian's Chromium.

Sign in, create a key (raw key shown once, copied), use it on the data plane, see the
call in usage (figures checked against ``GET /admin/usage``), rotate it with grace,
revoke it and see the data plane refuse it, CSRF refused, sign-out ends the session;
a viewer is refused a change; single sign-on through the fake identity provider; the
providers table refreshing by itself.

The browser is found by path (``CHROMIUM`` or ``chromium`` on PATH; ``.ci/run``
installs Debian's package); ``playwright install`` is never needed. Without Playwright
or a browser that starts, these tests skip and say why. With ``CONSOLE_SCREENSHOTS=1``
they also write the README's screenshots to ``docs/console/``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from gateway.admin.session import COOKIE, SessionStore
from tests.conftest import REPO, FakeUpstream, Gateway, auth, chat_body, config_for
from tests.fake_idp import FakeIdp, oidc_section, start_idp
from tests.test_console import ADMIN, ADMIN_TOKEN, PRICED

playwright_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed (dev extra)")

SCREENSHOTS = REPO / "docs" / "console" if os.environ.get("CONSOLE_SCREENSHOTS") == "1" else None
#: The contract's promise for a key change reaching the data plane.
PROPAGATION_SECONDS = 1.0


def chromium_path() -> str | None:
    found = os.environ.get("CHROMIUM")
    if found and Path(found).exists():
        return found
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium here (apt-get install chromium, or set CHROMIUM=/path/to/chrome)")
    async with playwright_api.async_playwright() as p:
        try:
            launched = await p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        except Exception as exc:  # a browser that cannot start here (no display libraries, ...)
            pytest.skip(f"Chromium at {path} does not start: {str(exc).splitlines()[0]}")
        yield launched
        await launched.close()


@pytest.fixture
async def console(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> Gateway:
    return await gateway_factory(  # type: ignore[no-any-return]
        env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake.url, models=PRICED),
    )


def base(gw: Gateway) -> str:
    return str(gw.management.make_url("")).rstrip("/")


async def shot(page: Any, name: str) -> None:
    if SCREENSHOTS is not None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


async def new_page(browser: Any) -> tuple[Any, Any]:
    context = await browser.new_context(viewport={"width": 1280, "height": 800},
                                        permissions=["clipboard-read", "clipboard-write"])
    context.set_default_timeout(8000)
    page = await context.new_page()
    page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    return context, page


async def sign_in(page: Any, gw: Gateway) -> None:
    await page.goto(base(gw) + "/ui/keys")
    assert "/ui/login" in page.url
    await page.fill("#token", ADMIN_TOKEN)
    await page.click("button[type=submit]")
    await page.wait_for_url(re.compile(r"/ui/keys$"))


async def chat_status(gw: Gateway, key: str) -> int:
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(), headers=auth(key))
    return resp.status


async def until_status(gw: Gateway, key: str, status: int) -> bool:
    deadline = time.monotonic() + PROPAGATION_SECONDS
    while time.monotonic() < deadline:
        if await chat_status(gw, key) == status:
            return True
        await asyncio.sleep(0.05)
    return await chat_status(gw, key) == status


async def fetch_in_page(page: Any, method: str, path: str, *, csrf: bool) -> dict[str, Any]:
    """A fetch made by the page itself (its cookie rides along), with or without the CSRF token."""
    result: dict[str, Any] = await page.evaluate(
        """async ([method, path, csrf]) => {
            const headers = {"Content-Type": "application/json"};
            if (csrf) headers["X-CSRF-Token"] = document.querySelector('meta[name="csrf-token"]').content;
            const resp = await fetch(path, {method, headers, body: method === "GET" ? undefined : JSON.stringify({name: "x"})});
            return {status: resp.status, body: await resp.json()};
        }""",
        [method, path, csrf],
    )
    return result


async def test_key_lifecycle_in_the_browser(browser: Any, console: Gateway) -> None:
    context, page = await new_page(browser)
    await sign_in(page, console)

    # Create a key: the raw key is shown once, and the copy button puts it on the clipboard.
    await page.click("summary:has-text('Create a key')")
    await page.fill("#create-key [name=name]", "browser key")
    await page.fill("#create-key [name=budget_usd]", "25")
    await page.select_option("#create-key [name=budget_period]", "month")
    await page.fill("#create-key [name=allowed_models]", "test-model, other-model")
    await page.click("#create-key button[type=submit]")
    await page.wait_for_selector("#raw-key:not([hidden])")
    raw = (await page.inner_text("#raw-key-value")).strip()
    assert raw.startswith("llmg_")
    await page.click("#copy-key")
    # (wait_for_function would evaluate a string, which the console's CSP rightly forbids)
    await page.wait_for_selector("#copy-state:has-text('Copied')")
    assert await page.evaluate("navigator.clipboard.readText()") == raw
    await shot(page, "keys-created")
    stored = (await (await console.management.get("/admin/keys", headers=ADMIN)).json())["data"][0]
    assert stored["name"] == "browser key" and stored["budget_usd"] == 25.0
    assert stored["allowed_models"] == ["test-model", "other-model"]

    # Use it on the data plane, then see the call in usage, with the API's figures.
    assert await chat_status(console, raw) == 200
    assert await console.state.billing.flush()
    since = (datetime.now(timezone.utc) - timedelta(hours=1)).replace(microsecond=0).isoformat()
    await page.goto(f"{base(console)}/ui/usage?group_by=key&since={quote(since)}")
    row = page.locator("#usage tbody tr", has_text=stored["key_prefix"])
    assert await row.count() == 1
    api = await (await console.management.get(
        "/admin/usage", params={"group_by": "key", "since": since}, headers=ADMIN)).json()
    mine = next(r for r in api["data"] if r["group"] == stored["api_key_id"])
    cells = await row.locator("td").all_inner_texts()
    assert int(cells[1].replace(",", "")) == mine["requests"] == 1
    assert float(await row.locator("[data-cost]").get_attribute("data-cost")) == pytest.approx(mine["cost_usd"], abs=1e-6)
    assert mine["cost_usd"] > 0
    await shot(page, "usage")

    # Edit it on its page: the change is made through the admin API and audited.
    await page.goto(f"{base(console)}/ui/keys/{stored['api_key_id']}")
    await page.click("summary:has-text('Edit')")
    await page.fill("#edit-key [name=rate_limit_requests]", "42")
    await page.fill("#edit-key [name=allowed_models]", "")
    await page.click("#edit-key button[type=submit]")
    await page.wait_for_selector("dd:has-text('42/')")
    edited = await (await console.management.get(f"/admin/keys/{stored['api_key_id']}", headers=ADMIN)).json()
    assert edited["rate_limit_requests"] == 42 and edited["allowed_models"] is None
    await shot(page, "key")

    # Rotate with a grace period: a new key, shown once; the old one keeps working meanwhile.
    await page.click("summary:has-text('Rotate')")
    await page.fill("#rotate-key [name=grace_seconds]", "3600")
    await page.click("#rotate-key button[type=submit]")
    await page.wait_for_selector("#raw-key:not([hidden])")
    rotated = (await page.inner_text("#raw-key-value")).strip()
    assert rotated.startswith("llmg_") and rotated != raw
    assert await chat_status(console, rotated) == 200
    assert await chat_status(console, raw) == 200

    # Revoke the new key: the data plane refuses it within a second.
    await page.click("#raw-key-link")
    await page.wait_for_selector("#revoke-key")
    await page.click("#revoke-key button[type=submit]")
    await page.wait_for_selector(".state-revoked")
    assert await until_status(console, rotated, 401)
    trail = [e["action"] for e in (await (await console.management.get("/admin/audit", headers=ADMIN)).json())["data"]]
    assert trail[:4] == ["key.revoke", "key.rotate", "key.update", "key.create"]

    # A change without the CSRF token is refused, even from the console's own page.
    refused = await fetch_in_page(page, "POST", "/admin/keys", csrf=False)
    assert refused["status"] == 403 and refused["body"]["error"]["code"] == "csrf_failed"
    allowed = await fetch_in_page(page, "POST", "/admin/keys", csrf=True)
    assert allowed["status"] == 201

    # Screenshots of the other pages, while signed in.
    for path, name in (("/ui/", "overview"), ("/ui/providers", "providers"), ("/ui/audit", "audit"),
                       ("/ui/subjects", "subjects"), ("/ui/keys", "keys")):
        await page.goto(base(console) + path)
        await shot(page, name)

    # Sign out: the session is over for the page and for the API.
    await page.click("header button:has-text('Sign out')")
    await page.wait_for_url(re.compile(r"/ui/login$"))
    gone = await page.evaluate("fetch('/admin/keys').then(r => r.status)")
    assert gone == 401
    await page.goto(base(console) + "/ui/keys")
    assert "/ui/login" in page.url
    await shot(page, "sign-in")
    await context.close()


async def test_a_viewer_is_refused_a_change_in_the_browser(browser: Any, console: Gateway) -> None:
    token, _ = await SessionStore(console.state.pool).create("vera@example.com", "viewer", "oidc", 600)
    context, page = await new_page(browser)
    await context.add_cookies([{"name": COOKIE, "value": token, "url": base(console)}])
    await page.goto(base(console) + "/ui/keys")
    assert await page.inner_text("header .who span") == "vera@example.com · viewer"
    assert await page.locator("#create-key").count() == 0
    refused = await fetch_in_page(page, "POST", "/admin/keys", csrf=True)
    assert refused["status"] == 403 and refused["body"]["error"]["code"] == "read_only"
    assert (await fetch_in_page(page, "GET", "/admin/keys", csrf=False))["status"] == 200
    # The page's CSP holds: an inline script injected into it does not run.
    ran = await page.evaluate("""() => {
        const s = document.createElement("script");
        s.textContent = "window.injectedRan = true";
        document.body.append(s);
        return window.injectedRan === true;
    }""")
    assert ran is False
    await context.close()


async def test_single_sign_on_in_the_browser(browser: Any, gateway_factory: Callable[..., Any],
                                             fake: FakeUpstream) -> None:
    idp: FakeIdp = await start_idp()
    try:
        gw = await gateway_factory(config_yaml=config_for(fake.url, admin=oidc_section(idp)))
        context, page = await new_page(browser)
        await page.goto(base(gw) + "/ui/usage")
        assert "/ui/login" in page.url
        assert await page.locator("#token").count() == 0  # no ADMIN_TOKEN: sign-on only
        await page.click("#sso")
        # The SameSite=Strict cookie set after the provider's redirect is sent on the way on.
        await page.wait_for_url(re.compile(r"/ui/usage$"))
        assert await page.inner_text("header .who span") == "ada@example.com · admin"
        made = await fetch_in_page(page, "POST", "/admin/keys", csrf=True)
        assert made["status"] == 201
        trail = await gw.state.pool.fetch("SELECT actor, action FROM admin_audit ORDER BY audit_id")
        assert [(r["actor"], r["action"]) for r in trail][-2:] == [
            ("ada@example.com", "session.sign_in"), ("ada@example.com", "key.create"),
        ]
        await context.close()
    finally:
        assert idp.server is not None
        await idp.server.close()


async def test_providers_table_refreshes_by_itself(browser: Any, console: Gateway, api_key: str) -> None:
    context, page = await new_page(browser)
    await sign_in(page, console)
    await page.goto(base(console) + "/ui/providers")
    calls = page.locator("#providers tbody tr td").nth(5)
    before = await calls.inner_text()
    for _ in range(2):
        assert await chat_status(console, api_key) == 200
    await page.wait_for_selector("#refreshed:has-text('Updated')", timeout=8000)
    # The script replaces the rows on its next refresh: wait for the cell's new text
    # (by selector: the console's CSP forbids the string evaluation of wait_for_function).
    await page.locator("#providers tbody tr td").nth(5).filter(has_not_text=before).wait_for(timeout=8000)
    assert await calls.inner_text() != before
    await context.close()


async def test_cache_purge_from_the_page(browser: Any, console: Gateway) -> None:
    context, page = await new_page(browser)
    await sign_in(page, console)
    await page.goto(base(console) + "/ui/cache")
    await page.check("#f-all")
    await page.click("#purge-cache button[type=submit]")
    await page.wait_for_selector("#form-status:has-text('Purged')")
    await shot(page, "cache")
    await context.close()
