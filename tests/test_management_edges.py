"""The edges of both planes: CORS per plane, security headers, body limits, and the
usage and providers views of the management plane."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import yaml

from gateway.auth.keys import KeyStore
from gateway.core.config import ConfigError, load_settings
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for

ADMIN_TOKEN = "edge-admin-token-abcdef0123456789"
ADMIN = auth(ADMIN_TOKEN)
APP = "https://app.example.com"
OPS = "https://ops.example.com"


def preflight(origin: str, method: str, headers: str | None = None) -> dict[str, str]:
    out = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        out["Access-Control-Request-Headers"] = headers
    return out


# -- CORS: data plane ---------------------------------------------------------------
async def test_data_plane_allows_any_origin_by_default_without_credentials(
    gateway: Gateway, api_key: str
) -> None:
    resp = await gateway.data.options(
        "/v1/chat/completions",
        headers=preflight(APP, "POST", "Authorization, Content-Type, X-Stainless-OS, x-api-key"),
    )
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    allowed = {h.strip() for h in resp.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os", "x-api-key"} <= allowed
    assert int(resp.headers["Access-Control-Max-Age"]) > 0
    assert "Access-Control-Allow-Credentials" not in resp.headers
    assert resp.headers["X-Content-Type-Options"] == "nosniff" and resp.headers["x-request-id"]

    # The actual call, whole and streamed: the page may read the answer and its headers.
    for stream in (False, True):
        resp = await gateway.data.post(
            "/v1/chat/completions", json=chat_body(stream=stream), headers={**auth(api_key), "Origin": APP}
        )
        await resp.read()
        assert resp.status == 200
        assert resp.headers["Access-Control-Allow-Origin"] == "*"
        assert "x-request-id" in resp.headers["Access-Control-Expose-Headers"]
        assert "Access-Control-Allow-Credentials" not in resp.headers
    # Errors too, so the page can show them.
    resp = await gateway.data.post("/v1/chat/completions", json=chat_body(), headers={"Origin": APP})
    assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == "*"
    # No Origin: no CORS headers at all.
    resp = await gateway.data.get("/healthz")
    assert "Access-Control-Allow-Origin" not in resp.headers


async def test_data_plane_preflight_refuses_methods_it_does_not_serve(gateway: Gateway) -> None:
    resp = await gateway.data.options("/v1/chat/completions", headers=preflight(APP, "DELETE"))
    assert resp.status == 400
    body = await resp.json()
    assert body["error"]["code"] == "cors_refused" and "DELETE" in body["error"]["message"]
    assert "Access-Control-Allow-Origin" not in resp.headers
    # A plain OPTIONS (not a preflight) is routed as usual.
    resp = await gateway.data.options("/v1/chat/completions")
    assert resp.status == 405


async def test_data_plane_with_listed_origins(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> None:
    gw = await gateway_factory(env={"CORS_ALLOWED_ORIGINS": f"{APP}, https://other.example"},
                               config_yaml=config_for(fake.url))
    resp = await gw.data.options("/v1/models", headers=preflight(APP, "GET", "authorization"))
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == APP and resp.headers["Vary"] == "Origin"
    resp = await gw.data.options("/v1/models", headers=preflight("https://evil.example", "GET"))
    assert resp.status == 400 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await gw.data.get("/healthz", headers={"Origin": "https://evil.example"})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    assert resp.headers["Vary"] == "Origin"
    resp = await gw.data.get("/healthz", headers={"Origin": APP})
    assert resp.headers["Access-Control-Allow-Origin"] == APP


# -- CORS: management plane ---------------------------------------------------------
async def test_management_plane_allows_no_origin_by_default(gateway: Gateway) -> None:
    resp = await gateway.management.options("/admin/keys", headers=preflight(APP, "GET", "authorization"))
    assert resp.status == 400
    assert "Access-Control-Allow-Origin" not in resp.headers
    assert resp.headers["Cache-Control"] == "no-store"
    resp = await gateway.management.get("/healthz", headers={"Origin": APP})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_management_plane_with_listed_origin(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> None:
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN, "MANAGEMENT_CORS_ORIGINS": OPS}, config_yaml=config_for(fake.url)
    )
    resp = await gw.management.options(
        f"/admin/keys/{uuid.uuid4()}", headers=preflight(OPS, "PATCH", "authorization, content-type")
    )
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == OPS and resp.headers["Vary"] == "Origin"
    assert "PATCH" in resp.headers["Access-Control-Allow-Methods"]
    assert "Access-Control-Allow-Credentials" not in resp.headers
    assert resp.headers["Content-Security-Policy"].startswith("default-src 'none'")
    # Only the headers the API reads may be sent.
    resp = await gw.management.options("/admin/keys", headers=preflight(OPS, "POST", "authorization, x-custom"))
    assert resp.status == 400 and "x-custom" in (await resp.json())["error"]["message"]
    # Another origin gets nothing.
    resp = await gw.management.options("/admin/keys", headers=preflight(APP, "GET"))
    assert resp.status == 400 and "Access-Control-Allow-Origin" not in resp.headers
    # Real calls from the allowed origin can be read, refusals included.
    resp = await gw.management.get("/admin/keys", headers={**ADMIN, "Origin": OPS})
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == OPS
    resp = await gw.management.get("/admin/keys", headers={"Origin": OPS})
    assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == OPS


def test_wildcard_management_origin_is_refused_by_settings() -> None:
    with pytest.raises(ConfigError, match="MANAGEMENT_CORS_ORIGINS"):
        load_settings({"MANAGEMENT_CORS_ORIGINS": "https://ok.example,*"})
    with pytest.raises(ConfigError, match="CORS_ALLOWED_ORIGINS"):
        load_settings({"CORS_ALLOWED_ORIGINS": "https://app.example.com/"})  # a path never matches an Origin
    with pytest.raises(ConfigError, match="MANAGEMENT_CORS_ORIGINS"):
        load_settings({"MANAGEMENT_CORS_ORIGINS": "ops.example.com"})
    settings = load_settings({"CORS_ALLOWED_ORIGINS": "*", "MANAGEMENT_CORS_ORIGINS": f"{OPS},http://127.0.0.1:8080"})
    assert settings.cors_origins == ("*",)
    assert settings.management_cors_origins == (OPS, "http://127.0.0.1:8080")
    assert load_settings({}).management_cors_origins == ()


async def test_serve_refuses_a_wildcard_management_origin_with_one_clear_line(
    process_factory: Callable[..., Any]
) -> None:
    gp = await process_factory(env={"MANAGEMENT_CORS_ORIGINS": "*"}, ready=False)
    code = await asyncio.to_thread(gp.wait, 30)
    assert code == 2
    lines = [line for line in gp.log().splitlines() if line.strip()]
    assert lines == [
        "llm-gateway: configuration error: MANAGEMENT_CORS_ORIGINS: '*' is refused on the management plane; list origins"
    ]


# -- security headers ---------------------------------------------------------------
async def test_security_headers_on_every_management_answer(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> None:
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake.url))
    calls = [
        ("GET", "/healthz", {}), ("GET", "/openapi.json", {}), ("GET", "/admin/keys", ADMIN),
        ("GET", "/admin/keys", {}), ("GET", "/nowhere", {}), ("POST", "/admin/keys", ADMIN),
    ]
    for method, path, headers in calls:
        resp = await gw.management.request(method, path, headers=headers)
        assert resp.headers["X-Content-Type-Options"] == "nosniff", path
        assert resp.headers["Content-Security-Policy"] == "default-src 'none'; frame-ancestors 'none'", path
        assert resp.headers["Cache-Control"] == "no-store", path
        assert resp.headers["X-Frame-Options"] == "DENY" and resp.headers["Referrer-Policy"] == "no-referrer"
        assert resp.headers["x-request-id"]


async def test_security_headers_on_data_plane_answers(gateway: Gateway, api_key: str) -> None:
    for method, path, headers in [("GET", "/healthz", {}), ("GET", "/nowhere", {}),
                                  ("GET", "/v1/models", {}), ("GET", "/v1/models", auth(api_key))]:
        resp = await gateway.data.request(method, path, headers=headers)
        assert resp.headers["X-Content-Type-Options"] == "nosniff", path
        assert resp.headers["x-request-id"]


# -- body limits --------------------------------------------------------------------
async def test_management_body_limit_follows_the_smaller_limit(
    gateway_factory: Callable[..., Any], fake: FakeUpstream
) -> None:
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN, "REQUEST_BODY_LIMIT_BYTES": "300"}, config_yaml=config_for(fake.url)
    )
    resp = await gw.management.post("/admin/keys", json={"name": "n" * 400}, headers=ADMIN)
    assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the reader still stops at the limit
        yield b'{"name": "'
        for _ in range(10):
            yield b"x" * 100
        yield b'"}'

    resp = await gw.management.post(
        "/admin/keys", data=chunks(), headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert resp.status == 413
    resp = await gw.management.post("/admin/keys", json={"name": "fits"}, headers=ADMIN)
    assert resp.status == 201
    resp = await gw.data.post("/v1/chat/completions", json=chat_body("y" * 400), headers=auth("llmg_whatever_key"))
    assert resp.status in (401, 413)  # auth is checked first on the data plane; the limit holds either way


# -- usage and providers ------------------------------------------------------------
async def test_usage_report_shape_and_query_checks(
    gateway_factory: Callable[..., Any], fake: FakeUpstream
) -> None:
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake.url))
    kid = str(uuid.uuid4())  # a key with no calls: the report is empty (the ledger is shared by the run)
    resp = await gw.management.get("/admin/usage", params={"api_key_id": kid}, headers=ADMIN)
    assert resp.status == 200
    assert await resp.json() == {
        "object": "usage_report", "group_by": "key", "since": None, "until": None, "api_key_id": kid,
        "data": [], "totals": {"requests": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0},
    }
    resp = await gw.management.get(
        "/admin/usage", params={"group_by": "day", "since": "2026-01-01", "until": "2026-02-01T00:00:00+01:00",
                                "api_key_id": kid},
        headers=ADMIN,
    )
    body = await resp.json()
    assert body["group_by"] == "day" and body["api_key_id"] == kid
    assert body["since"] == "2026-01-01T00:00:00+00:00" and body["until"] == "2026-02-01T00:00:00+01:00"
    for query in ({"group_by": "week"}, {"since": "yesterday"}, {"since": "2026-02-01", "until": "2026-01-01"},
                  {"api_key_id": "x"}, {"group": "key"}):
        resp = await gw.management.get("/admin/usage", params=query, headers=ADMIN)
        assert resp.status == 400, query
        assert (await resp.json())["error"]["code"] == "invalid_query"


async def test_providers_lists_deployments_without_secrets(
    gateway_factory: Callable[..., Any], fake: FakeUpstream
) -> None:
    doc = yaml.safe_load(config_for(fake.url))
    doc["providers"]["backup"] = {"type": "openai", "base_url": "http://user:hunter2@127.0.0.1:9/v1",
                                  "api_key": "sk-backup-secret"}
    doc["models"] = [
        {"name": "smart", "deployments": [
            {"provider": "fake", "model": "big", "priority": 0, "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}},
            {"provider": "backup", "model": "big", "priority": 1},
        ]},
        {"name": "*", "deployments": [{"provider": "fake", "model": "*"}]},
        {"name": "also-big", "deployments": [{"provider": "fake", "model": "big", "priority": 5, "weight": 2}]},
    ]
    doc["circuit_breaker"] = {"fail_max": 1}  # one failed call (its retries count once) opens a circuit
    gw = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=yaml.safe_dump(doc))
    resp = await gw.management.get("/admin/providers", headers=ADMIN)
    assert resp.status == 200
    text = await resp.text()
    assert "hunter2" not in text and "sk-backup-secret" not in text and "sk-fake-provider-secret" not in text
    body = await resp.json()
    assert {p["name"]: p["base_url"] for p in body["providers"]} == {
        "fake": fake.url, "backup": "http://127.0.0.1:9/v1",
    }
    by_id = {d["id"]: d for d in body["deployments"]}
    assert set(by_id) == {"fake/big", "backup/big", "fake/*"}
    big = by_id["fake/big"]
    assert big["model_groups"] == [
        {"name": "smart", "priority": 0, "weight": 1.0}, {"name": "also-big", "priority": 5, "weight": 2.0},
    ]
    assert big["price"] == {"input_per_mtok": 3.0, "output_per_mtok": 15.0}
    assert by_id["backup/big"]["price"] is None
    for d in body["deployments"]:
        # No traffic yet: every breaker is closed, with nothing measured.
        assert d["circuit_state"] == "closed"
        assert d["latency_ms"] is None and d["recent_requests"] == 0

    # One failed call opens fake/big's breaker; its three attempts (two retries) are all measured.
    raw, _ = await KeyStore(gw.state.pool).create("providers-view")
    await fake.script({"status": 500}, {"status": 500}, {"status": 500})
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model="also-big"), headers=auth(raw))
    assert resp.status == 500
    body = await (await gw.management.get("/admin/providers", headers=ADMIN)).json()
    big = {d["id"]: d for d in body["deployments"]}["fake/big"]
    assert big["circuit_state"] == "open"
    assert big["recent_requests"] == 3 and big["error_rate"] > 0


# -- database outage ----------------------------------------------------------------
async def test_admin_api_answers_503_while_the_database_is_away(
    database_url: str, pg_proxy: Any, fake: FakeUpstream, tmp_path: Any
) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.core.config import load_config
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
            subject = str(uuid.uuid4())
            resp = await client.post("/admin/keys", json={"name": "before", "subject_id": subject}, headers=ADMIN)
            assert resp.status == 201
            await pg_proxy.cut()
            for method, path_, body in [("GET", "/admin/keys", None), ("POST", "/admin/keys", {"name": "during", "subject_id": subject}),
                                        ("GET", "/admin/audit", None)]:
                resp = await client.request(method, path_, json=body, headers=ADMIN)
                assert resp.status == 503, (method, path_, await resp.text())
                assert (await resp.json())["error"]["code"] == "database_unavailable"
                assert resp.headers["Retry-After"] == "1"
            # Health and the provider listing need no database.
            assert (await client.get("/healthz")).status == 200
            assert (await client.get("/admin/providers", headers=ADMIN)).status == 200
            await pg_proxy.restore()

            async def back() -> bool:
                r = await client.get("/admin/keys", params={"subject_id": subject}, headers=ADMIN)
                return r.status == 200

            for _ in range(100):
                if await back():
                    break
                await asyncio.sleep(0.1)
            names = [k["name"] for k in (await (await client.get(
                "/admin/keys", params={"subject_id": subject}, headers=ADMIN)).json())["data"]]
            assert names == ["before"]
        finally:
            await client.close()
