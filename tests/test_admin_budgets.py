"""Subject budgets over the admin API: set, read, page, clear, audit, refusals, and the
402 they cause on the data plane of a gateway that prices its calls."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from gateway.billing.budgets import SubjectBudgetStore
from gateway.billing.reservations import prompt_token_bound
from gateway.testing import fake_llm
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for
from tests.test_admin_keys import eventually

ADMIN_TOKEN = "budget-admin-token-0123456789abcdef"
ADMIN = auth(ADMIN_TOKEN)
PRICE = {"input_per_mtok": 1000.0, "output_per_mtok": 3000.0}
#: Asks for at most the fake's answer length, so the call's worst case is known.
BODY = chat_body("hello there", max_tokens=fake_llm.completion_tokens(chat_body("hello there")))
#: What BODY costs at PRICE (the fake's token counts are deterministic).
COST = (fake_llm.prompt_tokens(BODY["messages"]) * 1000 + fake_llm.completion_tokens(BODY) * 3000) / 1e6
#: What BODY reserves before it is sent (docs/billing.md: the worst-case estimate).
RESERVE = (prompt_token_bound(BODY) * 1000 + BODY["max_tokens"] * 3000) / 1e6
#: Budgets reach the check with billing's next spend refresh (about a second); bounded wait.
REFRESH_WITHIN = 10.0


@pytest.fixture
async def priced_gateway(gateway_factory: Callable[..., Any], fake: FakeUpstream) -> Gateway:
    yaml = config_for(fake.url, models=[{"name": "*", "deployments": [{"provider": "fake", "model": "*", "price": PRICE}]}])
    return await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=yaml)  # type: ignore[no-any-return]


async def chat(gw: Gateway, key: str) -> tuple[int, dict[str, Any]]:
    resp = await gw.data.post("/v1/chat/completions", json=BODY, headers=auth(key))
    answer = await resp.json()
    assert await gw.state.billing.flush()  # its ledger row settles its reservation
    return resp.status, answer


async def put_budget(gw: Gateway, subject: uuid.UUID | str, body: Any) -> Any:
    return await gw.management.put(f"/admin/budgets/{subject}", json=body, headers=ADMIN)


async def test_a_budget_set_over_the_api_answers_402_once_spent_and_clearing_it_lifts_it(
    priced_gateway: Gateway, key_factory: Any, fake: FakeUpstream
) -> None:
    gw = priced_gateway
    subject = uuid.uuid4()
    first, _ = await key_factory(subject_id=subject, rate_limit_requests=100_000)
    second, _ = await key_factory(subject_id=subject, rate_limit_requests=100_000)
    other, _ = await key_factory(rate_limit_requests=100_000)

    budget = round(RESERVE + COST * 1.5, 6)
    resp = await put_budget(gw, subject, {"budget_usd": budget, "budget_period": "day"})
    assert resp.status == 201, await resp.text()
    assert resp.headers["Location"] == f"/admin/budgets/{subject}"
    created = await resp.json()
    assert created["subject_id"] == str(subject) and created["budget_period"] == "day"
    assert created["budget_usd"] == pytest.approx(budget, abs=1e-6)

    async def budget_known() -> bool:
        return (await gw.state.billing.spend(subject_id=subject)).subject_budget_period == "day"

    assert await eventually(budget_known, REFRESH_WITHIN)
    assert (await chat(gw, first))[0] == 200
    assert (await chat(gw, second))[0] == 200  # one call spent: another reservation fits
    calls = (await fake.stats())["requests"]
    for key in (first, second):  # the whole subject is refused, whichever key asks
        status, body = await chat(gw, key)
        assert status == 402, body
        assert body["error"]["code"] == "budget_exceeded" and "subject" in body["error"]["message"]
    assert (await fake.stats())["requests"] == calls  # refused before any provider call
    assert (await chat(gw, other))[0] == 200  # another subject is not affected

    # Raising it (a replace: 200, not 201) lets the subject through again.
    resp = await put_budget(gw, subject, {"budget_usd": COST * 10, "budget_period": "day"})
    assert resp.status == 200 and "Location" not in resp.headers
    assert (await resp.json())["created_at"] == created["created_at"]

    async def first_served() -> bool:
        return (await chat(gw, first))[0] == 200

    assert await eventually(first_served, REFRESH_WITHIN)

    # Lowered to zero, then cleared: refused, then free again.
    assert (await put_budget(gw, subject, {"budget_usd": 0})).status == 200

    async def first_refused() -> bool:
        return (await chat(gw, first))[0] == 402

    assert await eventually(first_refused, REFRESH_WITHIN)
    resp = await gw.management.delete(f"/admin/budgets/{subject}", headers=ADMIN)
    assert resp.status == 200
    assert (await resp.json())["budget_period"] == "month"  # PUT's default period
    assert await eventually(first_served, REFRESH_WITHIN)
    resp = await gw.management.get(f"/admin/budgets/{subject}", headers=ADMIN)
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "budget_not_found"


async def test_every_budget_change_is_audited_with_the_subject(priced_gateway: Gateway) -> None:
    gw = priced_gateway
    subject = uuid.uuid4()
    assert (await put_budget(gw, subject, {"budget_usd": 5})).status == 201
    assert (await put_budget(gw, subject, {"budget_usd": 7.5, "budget_period": "total"})).status == 200
    assert (await gw.management.delete(f"/admin/budgets/{subject}", headers=ADMIN)).status == 200

    resp = await gw.management.get("/admin/audit?action=budget.set&limit=500", headers=ADMIN)
    sets = [e for e in (await resp.json())["data"] if e["detail"]["subject_id"] == str(subject)]
    assert [e["detail"]["changes"] for e in sets] == [  # newest first
        {"budget_usd": {"from": 5.0, "to": 7.5}, "budget_period": {"from": "month", "to": "total"}},
        {"budget_usd": {"from": None, "to": 5.0}, "budget_period": {"from": None, "to": "month"}},
    ]
    assert all(e["api_key_id"] is None and e["actor"].startswith("token:") and e["request_id"] for e in sets)
    resp = await gw.management.get("/admin/audit?action=budget.clear&limit=500", headers=ADMIN)
    clears = [e for e in (await resp.json())["data"] if e["detail"]["subject_id"] == str(subject)]
    assert [e["detail"] for e in clears] == [
        {"subject_id": str(subject), "budget_usd": 7.5, "budget_period": "total"}
    ]


async def test_a_refused_change_changes_nothing_and_leaves_no_audit_row(priced_gateway: Gateway) -> None:
    gw = priced_gateway
    subject = uuid.uuid4()
    resp = await gw.management.delete(f"/admin/budgets/{subject}", headers=ADMIN)
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "budget_not_found"
    resp = await gw.management.get("/admin/audit?action=budget.clear&limit=500", headers=ADMIN)
    assert not [e for e in (await resp.json())["data"] if e["detail"]["subject_id"] == str(subject)]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({}, "missing_field"),
        ({"budget_period": "day"}, "missing_field"),
        ({"budget_usd": -1}, "invalid_field"),
        ({"budget_usd": "10"}, "invalid_field"),
        ({"budget_usd": True}, "invalid_field"),
        ({"budget_usd": None}, "invalid_field"),
        ({"budget_usd": 1e9}, "invalid_field"),
        ({"budget_usd": 1, "budget_period": "week"}, "invalid_field"),
        ({"budget_usd": 1, "budget_period": None}, "invalid_field"),
        ({"budget_usd": 1, "subject_id": str(uuid.uuid4())}, "unknown_field"),
        ([1], "invalid_json"),
    ],
)
async def test_bad_budget_bodies_are_400_naming_the_field(priced_gateway: Gateway, body: Any, code: str) -> None:
    subject = uuid.uuid4()
    resp = await put_budget(priced_gateway, subject, body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    resp = await priced_gateway.management.get(f"/admin/budgets/{subject}", headers=ADMIN)
    assert resp.status == 404  # nothing was set


async def test_bad_paths_and_queries_are_400(priced_gateway: Gateway) -> None:
    gw = priced_gateway
    for method in ("GET", "PUT", "DELETE"):
        resp = await gw.management.request(method, "/admin/budgets/not-a-uuid", json={"budget_usd": 1}, headers=ADMIN)
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_field", method
    for query in ("limit=0", "limit=501", "after=nope", "subject=x"):
        resp = await gw.management.get(f"/admin/budgets?{query}", headers=ADMIN)
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_query", query
    resp = await gw.management.get(f"/admin/budgets/{uuid.uuid4()}?x=1", headers=ADMIN)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_query"
    resp = await gw.management.request("PUT", f"/admin/budgets/{uuid.uuid4()}", data=b"nope", headers=ADMIN)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"


async def test_listing_pages_in_subject_order_and_shows_the_clis_budgets(
    priced_gateway: Gateway, db_pool: asyncpg.Pool
) -> None:
    gw = priced_gateway
    ours = sorted(uuid.uuid4() for _ in range(3))
    await SubjectBudgetStore(db_pool).set(ours[0], Decimal("1.25"), "day")  # as `budgets set` does
    for subject in ours[1:]:
        assert (await put_budget(gw, subject, {"budget_usd": 2})).status == 201
    seen: list[dict[str, Any]] = []
    after: str | None = None
    for _ in range(1000):  # bounded: the run's database holds other tests' budgets too
        resp = await gw.management.get("/admin/budgets?limit=2" + (f"&after={after}" if after else ""), headers=ADMIN)
        assert resp.status == 200
        page = await resp.json()
        assert page["object"] == "list" and len(page["data"]) <= 2
        seen += page["data"]
        if not page["has_more"]:
            break
        after = page["last_id"]
        assert after == page["data"][-1]["subject_id"]
    ids = [b["subject_id"] for b in seen]
    assert ids == sorted(ids, key=uuid.UUID) and len(set(ids)) == len(ids)
    mine = {b["subject_id"]: b for b in seen if uuid.UUID(b["subject_id"]) in ours}
    assert list(mine) == [str(s) for s in ours]
    assert mine[str(ours[0])]["budget_usd"] == 1.25 and mine[str(ours[0])]["budget_period"] == "day"
    resp = await gw.management.get(f"/admin/budgets/{ours[1]}", headers=ADMIN)
    assert (await resp.json())["budget_usd"] == 2.0 and (await resp.json())["budget_period"] == "month"


async def test_management_cors_allows_put_for_a_listed_origin(
    gateway_factory: Callable[..., Any], fake: FakeUpstream
) -> None:
    origin = "https://ops.example.com"
    gw = await gateway_factory(
        env={"ADMIN_TOKEN": ADMIN_TOKEN, "MANAGEMENT_CORS_ORIGINS": origin}, config_yaml=config_for(fake.url)
    )
    resp = await gw.management.options(f"/admin/budgets/{uuid.uuid4()}", headers={
        "Origin": origin, "Access-Control-Request-Method": "PUT",
        "Access-Control-Request-Headers": "authorization, content-type",
    })
    assert resp.status == 204 and "PUT" in resp.headers["Access-Control-Allow-Methods"]
