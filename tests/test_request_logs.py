"""Request logs through a running gateway: bodies kept for the calls opted in and no
others, after redaction, cut at the size cap, gone after their retention, read through
``/admin/requests`` with its filters, paging, 404 and roles; and the journal replays
what a SIGKILL left, once."""

from __future__ import annotations

import asyncio
import signal
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest

from actors.request_logs import batches
from gateway.admin.session import SessionStore
from gateway.billing.request_log import cut_body, ship_lines
from tests.conftest import FakeUpstream, Gateway, auth, chat_body, config_for, sse_payloads

ADMIN_TOKEN = "request-logs-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
POLICIES = {
    "mask-email": {"type": "pii", "mode": "redact", "detectors": ["email"]},
    "mask-out": {"type": "pii", "mode": "redact", "direction": "output", "detectors": ["card_number"]},
    "no-secrets": {"type": "pii", "mode": "block", "detectors": ["api_key"]},
}
CARD = "4111 1111 1111 1111"


def _config(fake: FakeUpstream, *, keys: list[str] = (), **request_logs: Any) -> str:  # type: ignore[assignment]
    deployment = [{"provider": "fake", "model": "m"}]
    return config_for(
        fake.url,
        guardrails={"policies": POLICIES},
        models=[
            {"name": "logged", "deployments": deployment, "guardrails": ["no-secrets", "mask-email", "mask-out"]},
            {"name": "plain", "deployments": deployment},
        ],
        request_logs={"models": ["logged"], "keys": list(keys), **request_logs},
    )


async def _start(gateway_factory: Any, fake: FakeUpstream, **kwargs: Any) -> Gateway:
    gateway: Gateway = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=_config(fake, **kwargs))
    return gateway


async def _call(gw: Gateway, key: str, content: str, *, model: str, stream: bool = False, **extra: Any) -> tuple[str, bytes]:
    request_id = f"rl-{uuid.uuid4().hex[:12]}"
    resp = await gw.data.post("/v1/chat/completions", json=chat_body(content, model=model, stream=stream, **extra),
                              headers={**auth(key), "x-request-id": request_id})
    body = await resp.read()
    return request_id, body


async def _stored(gw: Gateway, request_id: str) -> dict[str, Any]:
    assert await gw.state.request_logs.flush()
    resp = await gw.management.get(f"/admin/requests/{request_id}", headers=ADMIN)
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


@pytest.fixture
async def fake12(fake_factory: Any) -> FakeUpstream:
    return await fake_factory(chunks=12)  # type: ignore[no-any-return]


async def test_bodies_are_kept_for_an_opted_in_group_or_key_and_for_no_other_call(
    gateway_factory: Any, fake12: FakeUpstream, key_factory: Any, db_pool: asyncpg.Pool
) -> None:
    logged_key, logged_record = await key_factory()
    other_key, _ = await key_factory()
    gw = await _start(gateway_factory, fake12, keys=[logged_record.key_prefix])
    by_group, answer = await _call(gw, other_key, "hello group", model="logged")
    by_key, _ = await _call(gw, logged_key, "hello key", model="plain")
    not_logged, _ = await _call(gw, other_key, "hello nobody", model="plain")
    assert await gw.state.request_logs.flush()
    stored = {r["request_id"] for r in await db_pool.fetch(
        "SELECT request_id FROM request_logs WHERE request_id = ANY($1)", [by_group, by_key, not_logged])}
    assert stored == {by_group, by_key}

    row = await _stored(gw, by_group)
    assert orjson.loads(row["request_body"])["messages"] == [{"role": "user", "content": "hello group"}]
    assert row["response_kind"] == "body" and row["response_body"] == answer.decode()  # as the client got it
    assert row["model_group"] == "logged" and row["requested_model"] == "logged" and row["status"] == 200
    assert not row["request_truncated"] and not row["response_truncated"]
    assert row["response_bytes"] == len(answer)
    # The row is the ledger's call: the same call id.
    assert await gw.state.billing.flush()
    ledger_call = await db_pool.fetchval("SELECT call_id FROM usage_ledger WHERE request_id = $1", by_group)
    assert row["call_id"] == str(ledger_call)
    assert (await _stored(gw, row["call_id"]))["request_id"] == by_group  # by call id too
    row = await _stored(gw, by_key)
    assert row["key_prefix"] == logged_record.key_prefix and row["api_key_id"] == str(logged_record.api_key_id)


async def test_what_is_kept_is_what_went_upstream_and_what_the_client_saw_after_redaction(
    gateway_factory: Any, fake12: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    gw = await _start(gateway_factory, fake12)
    prompt = f"card {CARD} mail jane@example.com now"
    whole_id, whole = await _call(gw, api_key, prompt, model="logged")
    stream_id, raw = await _call(gw, api_key, prompt, model="logged", stream=True)
    streamed = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in (orjson.loads(p) for p in sse_payloads(raw) if p != b"[DONE]") if c.get("choices")
    )
    assert "[REDACTED:card_number]" in streamed

    for request_id in (whole_id, stream_id):
        row = await _stored(gw, request_id)
        assert "jane@example.com" not in row["request_body"] and "[REDACTED:email]" in row["request_body"]
        assert "4111" not in row["response_body"] and "[REDACTED:card_number]" in row["response_body"]
        assert row["guardrails"] and "mask-email:redacted" in row["guardrails"]
    assert (await _stored(gw, whole_id))["response_body"] == whole.decode()
    row = await _stored(gw, stream_id)
    assert row["streamed"] and row["response_kind"] == "text" and row["response_body"] == streamed
    # No stored byte anywhere holds the redacted texts.
    leaked = await db_pool.fetchval(
        "SELECT count(*) FROM request_logs WHERE request_id = ANY($1)"
        " AND (request_body LIKE '%jane@example.com%' OR response_body LIKE '%4111 1111%')",
        [whole_id, stream_id],
    )
    assert leaked == 0

    # A prompt an input policy refused was never sent: nothing of it is kept.
    refused_id, _ = await _call(gw, api_key, "key sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", model="logged")
    assert await gw.state.request_logs.flush()
    assert await db_pool.fetchval("SELECT count(*) FROM request_logs WHERE request_id = $1", refused_id) == 0


async def test_each_body_is_cut_at_the_cap_and_marked(gateway_factory: Any, fake12: FakeUpstream, api_key: str) -> None:
    gw = await _start(gateway_factory, fake12, max_body_bytes=256)
    long_prompt = " ".join(f"wörd{i}" for i in range(200))  # non-ASCII: never cut mid-character
    whole_id, whole = await _call(gw, api_key, long_prompt, model="logged")
    stream_id, _ = await _call(gw, api_key, "go", model="logged", stream=True, mock_completion_words=300)
    row = await _stored(gw, whole_id)
    assert row["request_truncated"] and row["request_bytes"] > 256
    assert len(row["request_body"].encode()) <= 256 and row["request_body"].startswith('{"model":"logged"')
    assert row["response_truncated"] and row["response_bytes"] == len(whole)
    assert len(row["response_body"].encode()) <= 256
    row = await _stored(gw, stream_id)
    assert row["response_truncated"] and 0 < len(row["response_body"].encode()) <= 256


async def test_rows_expire_after_their_retention(gateway_factory: Any, fake12: FakeUpstream, key_factory: Any,
                                                 db_pool: asyncpg.Pool) -> None:
    api_key, record = await key_factory()
    gw = await _start(gateway_factory, fake12, retention_days=2)
    old_id, _ = await _call(gw, api_key, "old call", model="logged")
    new_id, _ = await _call(gw, api_key, "new call", model="logged")
    row = await _stored(gw, old_id)
    created, expires = datetime.fromisoformat(row["created_at"]), datetime.fromisoformat(row["expires_at"])
    assert abs((expires - created) - timedelta(days=2)) < timedelta(seconds=1)
    # Two days pass for the first call.
    await db_pool.execute("UPDATE request_logs SET expires_at = now() - interval '1 second' WHERE request_id = $1", old_id)
    # Never shown once expired, purged yet or not.
    assert (await gw.management.get(f"/admin/requests/{old_id}", headers=ADMIN)).status == 404
    listed = await (await gw.management.get(f"/admin/requests?key={record.key_prefix}", headers=ADMIN)).json()
    assert old_id not in {r["request_id"] for r in listed["data"]} and new_id in {r["request_id"] for r in listed["data"]}
    assert await gw.state.request_logs.purge() >= 1
    metrics = await (await gw.management.get("/metrics")).text()
    assert "gateway_request_logs_stored_total 2.0" in metrics and "gateway_request_logs_pending_rows 0.0" in metrics
    assert "gateway_request_logs_purged_total" in metrics and "gateway_request_logs_purged_total 0.0" not in metrics
    remaining = {r["request_id"] for r in await db_pool.fetch(
        "SELECT request_id FROM request_logs WHERE request_id = ANY($1)", [old_id, new_id])}
    assert remaining == {new_id}


async def test_the_list_filters_pages_newest_first_and_refuses_bad_queries(
    gateway_factory: Any, fake12: FakeUpstream, key_factory: Any
) -> None:
    key_a, record_a = await key_factory()
    key_b, record_b = await key_factory()
    gw = await _start(gateway_factory, fake12, keys=[record_a.key_prefix])
    ids_a = []
    for i in range(3):
        ids_a.append((await _call(gw, key_a, f"a{i}", model="plain"))[0])
        await asyncio.sleep(0.01)  # distinct start times
    id_b, _ = await _call(gw, key_b, "b", model="logged")
    assert await gw.state.request_logs.flush()

    async def page(query: str) -> dict[str, Any]:
        resp = await gw.management.get(f"/admin/requests?{query}", headers=ADMIN)
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())

    by_prefix = await page(f"key={record_a.key_prefix}")
    assert [r["request_id"] for r in by_prefix["data"]] == ids_a[::-1]  # newest first
    assert "request_body" not in by_prefix["data"][0] and "response_body" not in by_prefix["data"][0]
    assert [r["request_id"] for r in (await page(f"key={record_a.api_key_id}"))["data"]] == ids_a[::-1]
    # Other tests share the table: every filter below is narrowed to this test's keys.
    b = f"key={record_b.key_prefix}"
    assert [r["request_id"] for r in (await page(f"model=logged&{b}"))["data"]] == [id_b]
    assert (await page(f"model=plain&{b}"))["data"] == []
    assert [r["request_id"] for r in (await page(f"model=plain&key={record_a.key_prefix}"))["data"]] == ids_a[::-1]
    first = await page(f"key={record_a.key_prefix}&limit=2")
    assert first["has_more"] and [r["request_id"] for r in first["data"]] == ids_a[:0:-1]
    rest = await page(f"key={record_a.key_prefix}&limit=2&after={first['last_id']}")
    assert not rest["has_more"] and [r["request_id"] for r in rest["data"]] == [ids_a[0]]
    future = (datetime.now().astimezone() + timedelta(hours=1)).isoformat()
    assert (await page(f"{b}&since=" + future.replace("+", "%2B")))["data"] == []
    assert len((await page(f"since=2000-01-01&model=logged&{b}"))["data"]) == 1

    for query, name in (("key=nope", "key"), ("since=yesterday", "since"), ("limit=0", "limit"),
                        ("after=1", "after"), ("colour=red", "colour")):
        resp = await gw.management.get(f"/admin/requests?{query}", headers=ADMIN)
        assert resp.status == 400, query
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_query" and name in error["message"]
    missing = await gw.management.get("/admin/requests/no-such-request", headers=ADMIN)
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "request_log_not_found"
    assert (await gw.management.get("/admin/requests/" + "x" * 300, headers=ADMIN)).status == 404


async def test_bodies_need_the_admin_role_and_the_list_any_admin_caller(
    gateway_factory: Any, fake12: FakeUpstream, api_key: str
) -> None:
    gw = await _start(gateway_factory, fake12)
    request_id, _ = await _call(gw, api_key, "private words", model="logged")
    assert await gw.state.request_logs.flush()
    assert (await gw.management.get("/admin/requests")).status == 401
    assert (await gw.management.get(f"/admin/requests/{request_id}", headers={"Authorization": "Bearer wrong"})).status == 401
    assert (await gw.data.get(f"/admin/requests/{request_id}", headers=ADMIN)).status == 404  # not on the data plane
    store = SessionStore(gw.state.pool)
    viewer, _ = await store.create("vera@example.com", "viewer", "oidc", 60)
    admin, _ = await store.create("ada@example.com", "admin", "oidc", 60)
    cookie = {"Cookie": f"llmg_console={viewer}"}
    assert (await gw.management.get("/admin/requests", headers=cookie)).status == 200
    refused = await gw.management.get(f"/admin/requests/{request_id}", headers=cookie)
    assert refused.status == 403 and (await refused.json())["error"]["code"] == "admin_role_required"
    assert "private words" not in await refused.text()
    allowed = await gw.management.get(f"/admin/requests/{request_id}", headers={"Cookie": f"llmg_console={admin}"})
    assert allowed.status == 200 and "private words" in (await allowed.json())["request_body"]


def test_bodies_are_cut_on_a_character_boundary_and_nul_is_replaced() -> None:
    assert cut_body("abc", 10) == ("abc", 3, False)
    text, size, cut = cut_body("é" * 10, 5)  # 2 bytes each
    assert (text, size, cut) == ("éé", 20, True)
    assert cut_body("a\x00b", 10)[0] == "a\ufffdb"
    lines = [b"x" * 10] * 5
    assert [len(b) for b in batches(lines, max_lines=2)] == [2, 2, 1]
    assert [len(b) for b in batches(lines, max_bytes=25)] == [2, 2, 1]
    assert [len(b) for b in batches([b"x" * 100, b"y"], max_bytes=10)] == [1, 1]


async def test_a_batch_shipped_twice_is_stored_once(db_pool: asyncpg.Pool) -> None:
    call_id = str(uuid.uuid4())
    line = orjson.dumps({
        "call_id": call_id, "request_id": "twice", "requested_model": "m", "protocol": "chat", "streamed": False,
        "status": 200, "outcome": "ok", "request_body": "{}", "request_bytes": 2, "request_truncated": False,
        "response_bytes": 0, "response_truncated": False, "created_at": "2026-01-01T00:00:00Z",
        "expires_at": "2999-01-01T00:00:00Z",
    }) + b"\n"
    assert await ship_lines(db_pool, [line]) == 1
    assert await ship_lines(db_pool, [line]) == 0
    assert await db_pool.fetchval("SELECT count(*) FROM request_logs WHERE call_id = $1", uuid.UUID(call_id)) == 1


async def test_sigkill_then_restart_stores_what_the_journal_kept_exactly_once(
    process_factory: Any, fake: FakeUpstream, api_key: str, db_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    config = config_for(fake.url, request_logs={"models": ["*"]})
    # Nothing ships for an hour: every row is still in the journal when the process dies.
    gw = await process_factory(env={"BILLING_JOURNAL_DIR": str(journal), "BILLING_SHIP_INTERVAL_SECONDS": "3600"},
                               config_yaml=config)
    ids = []
    async with aiohttp.ClientSession() as session:
        for i in range(6):
            request_id = f"rl-kill-{uuid.uuid4().hex[:10]}"
            async with session.post(f"{gw.url}/v1/chat/completions", json=chat_body(f"kept {i}", stream=i % 2 == 0),
                                    headers={**auth(api_key), "x-request-id": request_id}) as resp:
                assert resp.status == 200
                await resp.read()
            ids.append(request_id)
    await asyncio.sleep(0.5)  # past the group commit: on disk now
    gw.signal(signal.SIGKILL)
    gw.wait(10)
    assert await db_pool.fetchval("SELECT count(*) FROM request_logs WHERE request_id = ANY($1)", ids) == 0
    assert list((journal / "request-logs").glob("*/slot-*/segment-*.jsonl"))
    await process_factory(env={"BILLING_JOURNAL_DIR": str(journal)}, config_yaml=config)
    counts: dict[str, int] = {}
    for _ in range(100):
        rows = await db_pool.fetch(
            "SELECT request_id, count(*) AS n FROM request_logs WHERE request_id = ANY($1) GROUP BY 1", ids)
        counts = {r["request_id"]: r["n"] for r in rows}
        if len(counts) == len(ids):
            break
        await asyncio.sleep(0.1)
    assert counts == {rid: 1 for rid in ids}
    texts = await db_pool.fetch("SELECT request_body FROM request_logs WHERE request_id = ANY($1)", ids)
    assert {orjson.loads(r["request_body"])["messages"][0]["content"] for r in texts} == {f"kept {i}" for i in range(6)}


def test_request_logs_config_is_checked(tmp_path: Path) -> None:
    from gateway.core.config import ConfigError, load_config
    from gateway.core.settings import load_settings

    def load(extra: str) -> Any:
        path = tmp_path / "c.yaml"
        path.write_text(config_for("http://127.0.0.1:1/v1") + extra)
        env = {"GATEWAY_CONFIG": str(path), "DATABASE_URL": "postgresql://x@127.0.0.1/x"}
        return load_config(load_settings(env), env)

    assert not load("").request_logs.enabled
    assert load("request_logs: {models: ['*'], retention_days: 0.5}\n").request_logs.retention_days == 0.5
    for extra, message in (
        ("request_logs: {models: [nope]}\n", "request_logs.models[0]: unknown model group 'nope'"),
        ("request_logs: {retention_days: 0}\n", "request_logs.retention_days"),
        ("request_logs: {max_body_bytes: 10}\n", "request_logs.max_body_bytes"),
        ("request_logs: {on: true}\n", "request_logs"),
    ):
        with pytest.raises(ConfigError) as exc:
            load(extra)
        assert message in str(exc.value), (extra, str(exc.value))


async def test_a_refused_answer_keeps_no_body_and_a_cut_stream_only_what_the_client_got(
    gateway_factory: Any, fake12: FakeUpstream, api_key: str
) -> None:
    deployment = [{"provider": "fake", "model": "m"}]
    config = config_for(
        fake12.url,
        guardrails={"policies": {"stop-cards": {"type": "pii", "direction": "output", "detectors": ["card_number"]}}},
        models=[{"name": "strict", "deployments": deployment, "guardrails": ["stop-cards"]}],
        request_logs={"models": ["strict"]},
    )
    gw: Gateway = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config)
    prompt = f"card {CARD} ok"
    whole_id, _ = await _call(gw, api_key, prompt, model="strict")
    stream_id, raw = await _call(gw, api_key, prompt, model="strict", stream=True)
    row = await _stored(gw, whole_id)
    assert row["status"] == 400 and row["outcome"] == "blocked" and row["response_body"] is None
    assert row["guardrails"] == "stop-cards:blocked"
    row = await _stored(gw, stream_id)
    received = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        for c in (orjson.loads(p) for p in sse_payloads(raw)) if c.get("choices")
    )
    assert row["outcome"] == "blocked" and row["response_kind"] == "text"
    assert row["response_body"] == received and "4111" not in row["response_body"]


async def test_anthropic_messages_streams_are_kept_as_their_text(
    gateway_factory: Any, fake12: FakeUpstream, api_key: str
) -> None:
    gw = await _start(gateway_factory, fake12)
    request_id = f"rl-{uuid.uuid4().hex[:12]}"
    resp = await gw.data.post("/v1/messages", headers={"x-api-key": api_key, "x-request-id": request_id}, json={
        "model": "logged", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "tell jane@example.com hi"}],
    })
    assert resp.status == 200
    raw = await resp.read()
    sent = "".join(
        e["delta"]["text"] for e in (orjson.loads(p) for p in sse_payloads(raw))
        if e.get("type") == "content_block_delta" and e["delta"].get("type") == "text_delta"
    )
    row = await _stored(gw, request_id)
    assert row["protocol"] == "anthropic" and row["streamed"] and row["response_body"] == sent
    assert "jane@example.com" not in row["request_body"] and "[REDACTED:email]" in row["request_body"]


async def test_a_config_reload_opts_calls_in_and_out(gateway_factory: Any, fake12: FakeUpstream, api_key: str,
                                                     db_pool: asyncpg.Pool) -> None:
    gw: Gateway = await gateway_factory(env={"ADMIN_TOKEN": ADMIN_TOKEN}, config_yaml=config_for(fake12.url))
    before, _ = await _call(gw, api_key, "before", model="any")
    gw.state.settings.config_path.write_text(config_for(fake12.url, request_logs={"models": ["*"]}))
    assert (await gw.management.post("/admin/config/reload", headers=ADMIN)).status == 200
    after, _ = await _call(gw, api_key, "after", model="any")
    assert await gw.state.request_logs.flush()
    stored = {r["request_id"] for r in await db_pool.fetch(
        "SELECT request_id FROM request_logs WHERE request_id = ANY($1)", [before, after])}
    assert stored == {after}


def test_stream_texts_reads_every_wire() -> None:
    from gateway.protocols.sse import stream_texts

    def event(obj: Any, name: str | None = None) -> bytes:
        return (f"event: {name}\n".encode() if name else b"") + b"data: " + orjson.dumps(obj) + b"\n\n"

    assert stream_texts(event({"choices": [{"index": 1, "delta": {"content": "hi"}}]}), "chat") == [(1, "hi")]
    assert stream_texts(b"data: [DONE]\n\n", "chat") == []
    assert stream_texts(event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "yo"}},
                              "content_block_delta"), "anthropic") == [(0, "yo")]
    assert stream_texts(event({"type": "response.output_text.delta", "output_index": 0, "delta": "ok"}),
                        "responses") == [(0, "ok")]
    assert stream_texts(b"data: {not json\n\n", "chat") == []


async def test_the_console_lists_stored_calls_and_shows_bodies_to_an_admin_only(
    gateway_factory: Any, fake12: FakeUpstream, key_factory: Any
) -> None:
    key, record = await key_factory()
    gw = await _start(gateway_factory, fake12, keys=[record.key_prefix])
    request_id, _ = await _call(gw, key, "console <b>words</b>", model="plain")
    assert await gw.state.request_logs.flush()
    assert (await gw.management.get("/ui/requests", allow_redirects=False)).status == 303  # a session first
    store = SessionStore(gw.state.pool)
    admin, _ = await store.create("ada@example.com", "admin", "oidc", 60)
    viewer, _ = await store.create("vera@example.com", "viewer", "oidc", 60)
    as_admin, as_viewer = {"Cookie": f"llmg_console={admin}"}, {"Cookie": f"llmg_console={viewer}"}

    listing = await (await gw.management.get("/ui/requests", params={"key": record.key_prefix}, headers=as_admin)).text()
    assert f"/ui/requests/{request_id}" in listing and 'aria-current=page>Requests' in listing
    assert "Nothing" not in listing and "No stored calls" not in listing
    bad = await (await gw.management.get("/ui/requests", params={"key": "nope"}, headers=as_admin)).text()
    assert "key must be a key id" in bad

    detail = await gw.management.get(f"/ui/requests/{request_id}", headers=as_admin)
    text = await detail.text()
    assert detail.status == 200 and "Request (as sent upstream)" in text
    assert "console &lt;b&gt;words&lt;/b&gt;" in text and "<b>words</b>" not in text  # escaped
    hidden = await (await gw.management.get(f"/ui/requests/{request_id}", headers=as_viewer)).text()
    assert 'id="bodies-hidden"' in hidden and "words" not in hidden
    assert (await gw.management.get("/ui/requests/nope", headers=as_admin)).status == 404


async def test_an_idle_shipper_sleeps_until_a_body_is_stored_then_ships_it_unasked(
    gateway_factory: Any, fake12: FakeUpstream, api_key: str, db_pool: asyncpg.Pool
) -> None:
    """With nothing to ship the request-log shipper does not wake every ship interval (a
    gateway where no call is logged makes no ship cycle); a stored body wakes it, and it
    ships without a flush."""
    gw = await _start(gateway_factory, fake12)
    shipping = gw.state.request_logs._actor._shipping
    cycles = 0
    ship_cycle = shipping.ship_cycle

    async def counted() -> bool:
        nonlocal cycles
        cycles += 1
        return await ship_cycle()

    shipping.ship_cycle = counted  # type: ignore[method-assign]
    await asyncio.sleep(0.6)  # several ship intervals
    assert cycles == 0
    request_id, _ = await _call(gw, api_key, "wake the shipper", model="logged")
    for _ in range(100):
        if await db_pool.fetchval("SELECT count(*) FROM request_logs WHERE request_id = $1", request_id):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the stored body was not shipped without a flush")
    assert cycles >= 1
    await asyncio.sleep(0.3)
    shipped_by_then = cycles
    await asyncio.sleep(0.6)
    assert cycles == shipped_by_then  # asleep again once everything is shipped
    assert await gw.state.request_logs.flush()  # a flush still answers (it wakes the idle shipper)
    assert cycles == shipped_by_then + 1
