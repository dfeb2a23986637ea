"""The admin API for keys: the token, every route, bad bodies, and effects on the data plane.

Each test talks to real gateways in-process (both planes over loopback HTTP) over the
run's PostgreSQL, and to the fake provider; changes reach the data plane through the
same NOTIFY path a second replica uses.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for

ADMIN_TOKEN = "admin-secret-for-tests-0123456789"
ADMIN = auth(ADMIN_TOKEN)
#: The contract's promise for key changes reaching every replica.
PROPAGATION_SECONDS = 1.0

#: (method, path) of every admin route; {id} is filled in by the tests.
ADMIN_ROUTES = [
    ("POST", "/admin/keys"),
    ("GET", "/admin/keys"),
    ("GET", "/admin/keys/{id}"),
    ("PATCH", "/admin/keys/{id}"),
    ("POST", "/admin/keys/{id}/revoke"),
    ("POST", "/admin/keys/{id}/rotate"),
    ("GET", "/admin/budgets"),
    ("GET", "/admin/budgets/{id}"),
    ("PUT", "/admin/budgets/{id}"),
    ("DELETE", "/admin/budgets/{id}"),
    ("GET", "/admin/audit"),
    ("GET", "/admin/usage"),
    ("GET", "/admin/providers"),
]


@pytest.fixture
async def admin_gateway(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> Gateway:
    # Priced, so keys created with a budget may call it (an unpriced model is refused 402).
    price = {"input_per_mtok": 0.15, "output_per_mtok": 0.6}
    yaml = config_for(fake.url, models=[{"name": "*", "deployments": [{"provider": "fake", "model": "*", "price": price}]}])
    return await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=yaml)  # type: ignore[no-any-return]


async def create_key(gw: Gateway, **body: Any) -> dict[str, Any]:
    resp = await gw.management.post("/admin/keys", json={"name": "test", **body}, headers=ADMIN)
    assert resp.status == 201, await resp.text()
    return dict(await resp.json())


async def eventually(check: Callable[[], Awaitable[bool]], within: float) -> bool:
    """True as soon as ``check`` is; False if it is still false after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        if await check():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)


async def chat_status(gw: Gateway, key: str, model: str = "test-model") -> int:
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(model=model), headers=auth(key))
    await resp.read()
    return resp.status


# -- the token ----------------------------------------------------------------------
async def test_every_admin_route_needs_the_token(admin_gateway: Gateway) -> None:
    key = await create_key(admin_gateway)
    for method, path in ADMIN_ROUTES:
        url = path.replace("{id}", key["api_key_id"])
        for headers in ({}, auth("wrong-token"), {"Authorization": f"Basic {ADMIN_TOKEN}"}, {"Authorization": "Bearer"}):
            resp = await admin_gateway.management.request(method, url, json={}, headers=headers)
            assert resp.status == 401, (method, url, headers)
            body = await resp.json()
            assert body == {"error": {"message": "invalid admin token", "type": "authentication_error", "code": "invalid_admin_token"}}
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    # The key was not touched by any of those calls.
    resp = await admin_gateway.management.get(f"/admin/keys/{key['api_key_id']}", headers=ADMIN)
    assert (await resp.json())["state"] == "active"


async def test_no_token_configured_disables_every_admin_route(gateway: Gateway) -> None:
    for method, path in ADMIN_ROUTES:
        url = path.replace("{id}", str(uuid.uuid4()))
        for headers in ({}, ADMIN):
            resp = await gateway.management.request(method, url, json={"name": "x"}, headers=headers)
            assert resp.status == 403, (method, url)
            assert await resp.json() == {
                "error": {"message": "admin API disabled", "type": "permission_error", "code": "admin_disabled"}
            }
    # Health and the document stay open.
    assert (await gateway.management.get("/healthz")).status == 200
    assert (await gateway.management.get("/openapi.json")).status == 200


async def test_admin_routes_do_not_exist_on_the_data_plane(admin_gateway: Gateway) -> None:
    for method, path in ADMIN_ROUTES:
        url = path.replace("{id}", str(uuid.uuid4()))
        resp = await admin_gateway.data.request(method, url, json={"name": "x"}, headers=ADMIN)
        assert resp.status == 404, (method, url)
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_unknown_admin_paths_are_404_only_with_the_token(admin_gateway: Gateway) -> None:
    # No route matched: the usual 404, with or without a token (nothing to protect).
    resp = await admin_gateway.management.get("/admin/nothing-here", headers=ADMIN)
    assert resp.status == 404
    resp = await admin_gateway.management.delete("/admin/keys", headers=ADMIN)
    assert resp.status == 405


# -- create, read, list -------------------------------------------------------------
async def test_created_key_is_shown_once_and_works_on_the_data_plane(admin_gateway: Gateway) -> None:
    subject = str(uuid.uuid4())
    resp = await admin_gateway.management.post(
        "/admin/keys",
        json={"name": "ci", "subject_id": subject, "rate_limit_requests": 5, "tokens_per_minute": 1000,
              "budget_usd": 12.5, "allowed_models": ["test-*"], "expires_in_days": 30},
        headers=ADMIN,
    )
    assert resp.status == 201
    created = await resp.json()
    raw = created["api_key"]
    assert raw.startswith("llmg_") and created["key_prefix"] == raw[:12]
    assert created["subject_id"] == subject and created["state"] == "active"
    assert created["rate_limit_requests"] == 5 and created["tokens_per_minute"] == 1000
    assert created["budget_usd"] == 12.5 and created["budget_period"] == "month"
    assert created["allowed_models"] == ["test-*"] and created["expires_at"] is not None
    assert resp.headers["Location"] == f"/admin/keys/{created['api_key_id']}"
    assert await chat_status(admin_gateway, raw) == 200
    # Never shown again: not by id, not by prefix, not in a listing.
    for ref in (created["api_key_id"], created["key_prefix"]):
        resp = await admin_gateway.management.get(f"/admin/keys/{ref}", headers=ADMIN)
        assert resp.status == 200
        text = await resp.text()
        assert raw not in text and "api_key\"" not in text and "hash" not in text
    listing = await (await admin_gateway.management.get("/admin/keys", headers=ADMIN)).text()
    assert raw not in listing


async def test_list_filters_by_subject_and_state_and_pages(admin_gateway: Gateway) -> None:
    subject = str(uuid.uuid4())
    made = [await create_key(admin_gateway, subject_id=subject, name=f"k{i}") for i in range(5)]
    other = await create_key(admin_gateway)
    await admin_gateway.management.post(f"/admin/keys/{made[0]['api_key_id']}/revoke", headers=ADMIN)

    async def page(**query: Any) -> dict[str, Any]:
        resp = await admin_gateway.management.get("/admin/keys", params=query, headers=ADMIN)
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())

    everything = await page(subject_id=subject, limit=500)
    assert [k["api_key_id"] for k in everything["data"]] == [k["api_key_id"] for k in reversed(made)]
    assert other["api_key_id"] not in {k["api_key_id"] for k in everything["data"]}
    assert not everything["has_more"]
    revoked = await page(subject_id=subject, state="revoked")
    assert [k["api_key_id"] for k in revoked["data"]] == [made[0]["api_key_id"]]
    active = await page(subject_id=subject, state="active")
    assert len(active["data"]) == 4 and all(k["state"] == "active" for k in active["data"])
    # Pages of two, following last_id, cover all five exactly once, newest first.
    seen: list[str] = []
    after = None
    for _ in range(5):
        query: dict[str, Any] = {"subject_id": subject, "limit": 2}
        if after:
            query["after"] = after
        p = await page(**query)
        seen += [k["api_key_id"] for k in p["data"]]
        if not p["has_more"]:
            break
        after = p["last_id"]
    assert seen == [k["api_key_id"] for k in reversed(made)]


async def test_bad_queries_are_400(admin_gateway: Gateway) -> None:
    for query in ({"state": "sleeping"}, {"subject_id": "nope"}, {"limit": "0"}, {"limit": "501"},
                  {"limit": "x"}, {"after": "nope"}, {"subjectid": str(uuid.uuid4())}):
        resp = await admin_gateway.management.get("/admin/keys", params=query, headers=ADMIN)
        assert resp.status == 400, query
        body = await resp.json()
        assert body["error"]["code"] == "invalid_query" and body["error"]["type"] == "invalid_request_error"


async def test_unknown_keys_are_404(admin_gateway: Gateway) -> None:
    for ref in (str(uuid.uuid4()), "llmg_nothere", "short", "x" * 80, "llmg_%00abcdef"):
        for method, suffix in (("GET", ""), ("PATCH", ""), ("POST", "/revoke"), ("POST", "/rotate")):
            body = {"name": "n"} if method == "PATCH" else None
            resp = await admin_gateway.management.request(method, f"/admin/keys/{ref}{suffix}", json=body, headers=ADMIN)
            assert resp.status == 404, (method, ref, suffix)
            assert (await resp.json())["error"]["code"] == "key_not_found"


# -- bad bodies ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[]", "invalid_json"),
        (b"{}", "missing_field"),
        (b'{"name": ""}', "invalid_field"),
        (b'{"name": "   "}', "invalid_field"),
        (b'{"name": 7}', "invalid_field"),
        (b'{"name": "a\\u0000b"}', "invalid_field"),
        (b'{"name": "x", "nme": 1}', "unknown_field"),
        (b'{"name": "x", "rate_limit_requests": 0}', "invalid_field"),
        (b'{"name": "x", "rate_limit_requests": true}', "invalid_field"),
        (b'{"name": "x", "rate_limit_requests": 1.5}', "invalid_field"),
        (b'{"name": "x", "rate_limit_requests": 2147483648}', "invalid_field"),
        (b'{"name": "x", "rate_limit_requests": null}', "invalid_field"),
        (b'{"name": "x", "tokens_per_minute": -1}', "invalid_field"),
        (b'{"name": "x", "budget_usd": -0.01}', "invalid_field"),
        (b'{"name": "x", "budget_usd": 1e12}', "invalid_field"),
        (b'{"name": "x", "budget_usd": "5"}', "invalid_field"),
        (b'{"name": "x", "budget_period": "week"}', "invalid_field"),
        (b'{"name": "x", "allowed_models": "gpt-4"}', "invalid_field"),
        (b'{"name": "x", "allowed_models": [""]}', "invalid_field"),
        (b'{"name": "x", "allowed_models": [1]}', "invalid_field"),
        (b'{"name": "x", "subject_id": "not-a-uuid"}', "invalid_field"),
        (b'{"name": "x", "expires_at": "tomorrow"}', "invalid_field"),
        (b'{"name": "x", "expires_at": "2030-01-01T00:00:00"}', "invalid_field"),
        (b'{"name": "x", "expires_at": "2001-01-01T00:00:00Z"}', "invalid_field"),
        (b'{"name": "x", "expires_in_days": 0}', "invalid_field"),
        (b'{"name": "x", "expires_in_days": 1, "expires_at": "2030-01-01T00:00:00Z"}', "invalid_field"),
    ],
)
async def test_bad_create_bodies_are_clear_400s(admin_gateway: Gateway, body: bytes, code: str) -> None:
    resp = await admin_gateway.management.post(
        "/admin/keys", data=body, headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert resp.status == 400, body
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    assert error["message"]


async def test_bad_patch_and_action_bodies_are_400(admin_gateway: Gateway) -> None:
    key = await create_key(admin_gateway)
    kid = key["api_key_id"]
    cases = [
        ("PATCH", "", b"{}", "missing_field"),
        ("PATCH", "", b'{"subject_id": "' + str(uuid.uuid4()).encode() + b'"}', "unknown_field"),
        ("PATCH", "", b'{"rate_limit_requests": null}', "invalid_field"),
        ("PATCH", "", b'{"max_concurrent": 0}', "invalid_field"),
        ("PATCH", "", b"nope", "invalid_json"),
        ("POST", "/rotate", b'{"grace_seconds": -1}', "invalid_field"),
        ("POST", "/rotate", b'{"grace_seconds": 99999999}', "invalid_field"),
        ("POST", "/rotate", b'{"grace": 5}', "unknown_field"),
        ("POST", "/revoke", b'{"reason": 5}', "invalid_field"),
        ("POST", "/revoke", b"[1]", "invalid_json"),
    ]
    for method, suffix, body, code in cases:
        resp = await admin_gateway.management.request(
            method, f"/admin/keys/{kid}{suffix}", data=body, headers={**ADMIN, "Content-Type": "application/json"}
        )
        assert resp.status == 400, (method, suffix, body)
        assert (await resp.json())["error"]["code"] == code, (method, suffix, body)
    # None of those changed the key.
    resp = await admin_gateway.management.get(f"/admin/keys/{kid}", headers=ADMIN)
    assert await resp.json() == {**{k: v for k, v in key.items() if k != "api_key"}, "last_used_at": None}


async def test_admin_body_over_the_limit_is_413(admin_gateway: Gateway) -> None:
    resp = await admin_gateway.management.post(
        "/admin/keys", json={"name": "x" * (70 * 1024)}, headers=ADMIN
    )
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"


# -- changes take effect ------------------------------------------------------------
async def test_patched_allowlist_and_limits_reach_every_replica(
    gateway_factory: Callable[..., Any], fake: FakeUpstream
) -> None:
    one = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake.url))
    other = await gateway_factory(config_yaml=config_for(fake.url))  # a second replica, same database
    key = await create_key(one, rate_limit_requests=100)
    raw = key["api_key"]
    # Both replicas have the key cached before the change.
    assert await chat_status(one, raw, "model-a") == 200
    assert await chat_status(other, raw, "model-a") == 200
    verified = await other.state.auth.authenticate(raw)
    assert verified.policy.rate_limit_requests == 100

    resp = await one.management.patch(
        f"/admin/keys/{key['api_key_id']}",
        json={"allowed_models": ["model-b"], "rate_limit_requests": 7, "tokens_per_minute": 500, "name": "renamed"},
        headers=ADMIN,
    )
    assert resp.status == 200
    patched = await resp.json()
    assert patched["allowed_models"] == ["model-b"] and patched["rate_limit_requests"] == 7
    assert patched["name"] == "renamed" and patched["budget_usd"] is None  # untouched fields stay

    async def allowlist_holds_on_other() -> bool:
        return await chat_status(other, raw, "model-a") == 403

    assert await eventually(allowlist_holds_on_other, within=PROPAGATION_SECONDS)
    assert await chat_status(other, raw, "model-b") == 200
    assert await chat_status(one, raw, "model-a") == 403
    # The limits the limiter reads come from the same (now refreshed) cached key.
    for replica in (one, other):
        policy = (await replica.state.auth.authenticate(raw)).policy
        assert policy.rate_limit_requests == 7 and policy.tokens_per_minute == 500
        assert policy.allowed_models == ("model-b",)
    models = await (await other.data.get("/v1/models", headers=auth(raw))).json()
    assert [m["id"] for m in models["data"]] == ["model-b"]

    # null lifts a limit; the allowlist back to "any model".
    resp = await one.management.patch(
        f"/admin/keys/{key['api_key_id']}", json={"allowed_models": None, "tokens_per_minute": None}, headers=ADMIN
    )
    assert resp.status == 200

    async def any_model_again() -> bool:
        return await chat_status(other, raw, "model-a") == 200

    assert await eventually(any_model_again, within=PROPAGATION_SECONDS)
    assert (await other.state.auth.authenticate(raw)).policy.tokens_per_minute is None


async def test_patched_expiry_in_the_past_disables_and_null_restores(admin_gateway: Gateway) -> None:
    key = await create_key(admin_gateway)
    raw, kid = key["api_key"], key["api_key_id"]
    assert await chat_status(admin_gateway, raw) == 200
    resp = await admin_gateway.management.patch(
        f"/admin/keys/{kid}", json={"expires_at": "2001-01-01T00:00:00+00:00"}, headers=ADMIN
    )
    assert resp.status == 200 and (await resp.json())["state"] == "expired"

    async def refused() -> bool:
        return await chat_status(admin_gateway, raw) == 401

    assert await eventually(refused, within=PROPAGATION_SECONDS)
    resp = await admin_gateway.management.patch(f"/admin/keys/{kid}", json={"expires_at": None}, headers=ADMIN)
    assert (await resp.json())["state"] == "active"

    async def accepted() -> bool:
        return await chat_status(admin_gateway, raw) == 200

    assert await eventually(accepted, within=PROPAGATION_SECONDS)


async def test_revoke_holds_within_a_second_and_is_idempotent(admin_gateway: Gateway) -> None:
    key = await create_key(admin_gateway)
    raw, kid = key["api_key"], key["api_key_id"]
    assert await chat_status(admin_gateway, raw) == 200
    resp = await admin_gateway.management.post(f"/admin/keys/{kid}/revoke", json={"reason": "leaked"}, headers=ADMIN)
    assert resp.status == 200
    revoked = await resp.json()
    assert revoked["state"] == "revoked" and revoked["revoked_at"]

    async def refused() -> bool:
        return await chat_status(admin_gateway, raw) == 401

    assert await eventually(refused, within=PROPAGATION_SECONDS)
    again = await admin_gateway.management.post(f"/admin/keys/{kid}/revoke", headers=ADMIN)  # no body at all
    assert again.status == 200 and (await again.json())["revoked_at"] == revoked["revoked_at"]
    # A revoked key cannot be rotated back to life.
    resp = await admin_gateway.management.post(f"/admin/keys/{kid}/rotate", headers=ADMIN)
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "key_state_conflict"


async def test_rotated_key_old_fails_new_works(admin_gateway: Gateway) -> None:
    subject = str(uuid.uuid4())
    key = await create_key(admin_gateway, subject_id=subject, rate_limit_requests=9, allowed_models=["m-*"])
    old_raw = key["api_key"]
    assert await chat_status(admin_gateway, old_raw, "m-1") == 200
    resp = await admin_gateway.management.post(f"/admin/keys/{key['key_prefix']}/rotate", headers=ADMIN)
    assert resp.status == 201
    rotated = await resp.json()
    new_raw = rotated["api_key"]
    assert new_raw != old_raw and rotated["api_key_id"] != key["api_key_id"]
    assert rotated["subject_id"] == subject and rotated["rate_limit_requests"] == 9
    assert rotated["allowed_models"] == ["m-*"] and rotated["name"] == key["name"]
    assert rotated["previous"]["api_key_id"] == key["api_key_id"] and rotated["previous"]["state"] == "revoked"

    async def old_refused() -> bool:
        return await chat_status(admin_gateway, old_raw, "m-1") == 401

    assert await eventually(old_refused, within=PROPAGATION_SECONDS)
    assert await chat_status(admin_gateway, new_raw, "m-1") == 200
    assert await chat_status(admin_gateway, new_raw, "other") == 403  # same allowlist


async def test_rotation_with_grace_keeps_both_until_it_ends(admin_gateway: Gateway, db_pool: Any) -> None:
    key = await create_key(admin_gateway)
    old_raw, kid = key["api_key"], key["api_key_id"]
    resp = await admin_gateway.management.post(
        f"/admin/keys/{kid}/rotate", json={"grace_seconds": 3600, "reason": "scheduled"}, headers=ADMIN
    )
    assert resp.status == 201
    rotated = await resp.json()
    previous = rotated["previous"]
    assert previous["state"] == "active" and previous["expires_at"] is not None
    assert await chat_status(admin_gateway, old_raw) == 200
    assert await chat_status(admin_gateway, rotated["api_key"]) == 200
    # The grace ends (moved to the past here rather than waiting an hour): the old key stops.
    await db_pool.execute("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE api_key_id = $1", uuid.UUID(kid))

    async def old_refused() -> bool:
        return await chat_status(admin_gateway, old_raw) == 401

    assert await eventually(old_refused, within=PROPAGATION_SECONDS)
    assert await chat_status(admin_gateway, rotated["api_key"]) == 200
    # An expired key cannot be rotated (its successor would inherit the past expiry).
    resp = await admin_gateway.management.post(f"/admin/keys/{kid}/rotate", headers=ADMIN)
    assert resp.status == 409


async def test_cli_and_api_share_one_store(admin_gateway: Gateway, key_factory: Any) -> None:
    _raw, record = await key_factory(name="from-cli-store")
    resp = await admin_gateway.management.get(f"/admin/keys/{record.api_key_id}", headers=ADMIN)
    assert (await resp.json())["name"] == "from-cli-store"


# -- audit --------------------------------------------------------------------------
async def test_every_change_is_audited_with_who_what_when_which(admin_gateway: Gateway) -> None:
    started = time.time()
    key = await create_key(admin_gateway, name="audited")
    kid = key["api_key_id"]
    await admin_gateway.management.patch(f"/admin/keys/{kid}", json={"rate_limit_requests": 3}, headers=ADMIN)
    rotated = await (await admin_gateway.management.post(
        f"/admin/keys/{kid}/rotate", json={"grace_seconds": 60}, headers={**ADMIN, "x-request-id": "rotate-42"}
    )).json()
    await admin_gateway.management.post(f"/admin/keys/{kid}/revoke", json={"reason": "done"}, headers=ADMIN)
    # Failed changes leave no row.
    await admin_gateway.management.patch(f"/admin/keys/{kid}", json={"rate_limit_requests": 0}, headers=ADMIN)

    resp = await admin_gateway.management.get("/admin/audit", params={"api_key_id": kid}, headers=ADMIN)
    assert resp.status == 200
    entries = (await resp.json())["data"]
    assert [e["action"] for e in entries] == ["key.revoke", "key.rotate", "key.update", "key.create"]
    fingerprint = "token:" + hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()[:12]
    for e in entries:
        assert e["actor"] == fingerprint and e["api_key_id"] == kid
        assert e["remote"] == "127.0.0.1"
        from datetime import datetime

        assert datetime.fromisoformat(e["at"]).timestamp() >= started - 1
    revoke, rotate, update, create = entries
    assert revoke["detail"] == {"already_revoked": False, "reason": "done"}
    assert rotate["request_id"] == "rotate-42"
    assert rotate["detail"]["new_api_key_id"] == rotated["api_key_id"] and rotate["detail"]["grace_seconds"] == 60
    assert update["detail"] == {"changes": {"rate_limit_requests": {"from": 60, "to": 3}}}
    assert create["detail"]["name"] == "audited" and create["detail"]["key_prefix"] == key["key_prefix"]
    # No secret ever reaches the trail.
    text = await resp.text()
    assert key["api_key"] not in text and rotated["api_key"] not in text and ADMIN_TOKEN not in text

    only_rotations = await (await admin_gateway.management.get(
        "/admin/audit", params={"action": "key.rotate", "api_key_id": kid}, headers=ADMIN
    )).json()
    assert [e["id"] for e in only_rotations["data"]] == [rotate["id"]]
    first_page = await (await admin_gateway.management.get(
        "/admin/audit", params={"api_key_id": kid, "limit": 3}, headers=ADMIN
    )).json()
    assert first_page["has_more"] and first_page["last_id"] == update["id"]
    rest = await (await admin_gateway.management.get(
        "/admin/audit", params={"api_key_id": kid, "after": first_page["last_id"]}, headers=ADMIN
    )).json()
    assert [e["id"] for e in rest["data"]] == [create["id"]] and not rest["has_more"]


async def test_audit_actor_is_the_configured_name(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> None:
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN, "ADMIN_TOKEN_NAME": "ops-team"}, config_yaml=config_for(fake.url)
    )
    key = await create_key(gw)
    entries = (await (await gw.management.get(
        "/admin/audit", params={"api_key_id": key["api_key_id"]}, headers=ADMIN
    )).json())["data"]
    assert [e["actor"] for e in entries] == ["ops-team"]
