"""The exact response cache end to end: hits, misses, scopes, keys, bounds, replay, admin."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gateway.cache.keys import (
    client_directives,
    exact_key,
    is_deterministic,
    normalised_body,
    request_material,
)
from gateway.cache.store import ByteLRU, CacheEntry, decode_entry, encode_entry
from gateway.core.config import ConfigError, load_config, load_settings
from gateway.core.usage import CallRecord
from tests.cache_helpers import ask, cached_config, settle, upstream_calls, with_models
from tests.conftest import FakeUpstream, Gateway, sse_payloads


def _records(gateway: Gateway) -> list[CallRecord]:
    records: list[CallRecord] = []
    gateway.state.call_listeners.append(records.append)
    return records


# ----------------------------------------------------------------------------- hits and misses
async def test_whole_answer_is_stored_then_served_without_calling_the_provider(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    records = _records(gw)
    first, body1 = await ask(gw, api_key)
    assert first.status == 200 and first.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    second, body2 = await ask(gw, api_key)
    assert second.status == 200 and second.headers["x-gateway-cache"] == "hit"
    assert second.headers["x-gateway-cache-key"] == first.headers["x-gateway-cache-key"]
    assert body2 == body1  # the stored answer, byte for byte (same id: it is the same answer)
    assert await upstream_calls(fake) == 1
    miss, hit = records
    assert (miss.cache, hit.cache) == ("miss", "hit")
    assert hit.provider is None and hit.status == 200 and hit.outcome == "ok"
    assert hit.usage.cost_usd == 0.0  # billing: nothing was spent on a provider
    assert hit.usage.prompt_tokens == miss.usage.prompt_tokens > 0
    assert hit.response_id == miss.response_id and hit.served_model == miss.served_model


async def test_stream_is_stored_once_complete_and_replayed_identically(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    options = {"stream": True, "stream_options": {"include_usage": True}}
    first, raw1 = await ask(gw, api_key, "tell me a long story please", **options)
    assert first.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    second, raw2 = await ask(gw, api_key, "tell me a long story please", **options)
    assert second.headers["x-gateway-cache"] == "hit"
    assert second.headers["Content-Type"].startswith("text/event-stream")
    assert raw2 == raw1  # chunks, usage chunk and [DONE], exactly as first relayed
    assert raw2.endswith(b"data: [DONE]\n\n")
    assert len(sse_payloads(raw2)) > 3
    assert await upstream_calls(fake) == 1


async def test_replay_shows_usage_only_to_a_client_that_asked(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    await ask(gw, api_key, "count to five", stream=True, stream_options={"include_usage": True})
    await settle(gw, 1)
    # Same answer, asked without usage: a hit shaped like the live relay would be.
    hit, replayed = await ask(gw, api_key, "count to five", stream=True)
    assert hit.headers["x-gateway-cache"] == "hit"
    live, relayed = await ask(gw, api_key, "count to five", stream=True, headers={"Cache-Control": "no-store"})
    assert live.headers["x-gateway-cache"] == "bypass"

    def shape(raw: bytes) -> list[Any]:
        out: list[Any] = []
        for payload in sse_payloads(raw):
            if payload == b"[DONE]":
                out.append("[DONE]")
                continue
            obj = orjson.loads(payload)
            obj.pop("id"), obj.pop("created")
            out.append(obj)
        return out

    assert shape(replayed) == shape(relayed)
    assert all("usage" not in p for p in shape(replayed) if isinstance(p, dict))


async def test_stream_and_whole_answers_are_separate_entries(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    await ask(gw, api_key, "same words")
    await settle(gw, 1)
    resp, raw = await ask(gw, api_key, "same words", stream=True)
    assert resp.headers["x-gateway-cache"] == "miss"
    assert raw.endswith(b"data: [DONE]\n\n")
    await settle(gw, 2)
    resp, raw = await ask(gw, api_key, "same words", stream=True)
    assert resp.headers["x-gateway-cache"] == "hit" and raw.endswith(b"data: [DONE]\n\n")


async def test_failed_or_cut_answers_are_not_stored(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    await fake.script({"status": 400})
    resp, _ = await ask(gw, api_key, "first")
    assert resp.status == 400
    resp, _ = await ask(gw, api_key, "first")
    assert resp.status == 200 and resp.headers["x-gateway-cache"] == "miss"
    await fake.script({"cut_after_chunks": 2})
    resp, raw = await ask(gw, api_key, "second", stream=True)
    assert b"[DONE]" not in raw
    resp, raw = await ask(gw, api_key, "second", stream=True)
    assert resp.headers["x-gateway-cache"] == "miss" and raw.endswith(b"data: [DONE]\n\n")
    assert gw.state.cache.counters.stores == 2


# ----------------------------------------------------------------------------- tenants
async def test_no_answer_crosses_subjects(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, key_factory: Callable[..., Any]
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    tenant_a, tenant_b = uuid.uuid4(), uuid.uuid4()
    a1, _ = await key_factory("a1", subject_id=tenant_a)
    a2, _ = await key_factory("a2", subject_id=tenant_a)
    b1, _ = await key_factory("b1", subject_id=tenant_b)
    await ask(gw, a1, "secret plans")
    await settle(gw, 1)
    other, _ = await ask(gw, b1, "secret plans")
    assert other.headers["x-gateway-cache"] == "miss"
    same_tenant, _ = await ask(gw, a2, "secret plans")  # scope subject: another key of the tenant
    assert same_tenant.headers["x-gateway-cache"] == "hit"
    assert await upstream_calls(fake) == 2


@pytest.mark.parametrize(("scope", "sibling_hits", "stranger_hits"), [
    ("key", False, False), ("subject", True, False), ("global", True, True),
])
async def test_scope_decides_who_is_served(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, key_factory: Callable[..., Any],
    scope: str, sibling_hits: bool, stranger_hits: bool,
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url, {"mode": "exact", "scope": scope}))
    tenant = uuid.uuid4()
    owner, _ = await key_factory("owner", subject_id=tenant)
    sibling, _ = await key_factory("sibling", subject_id=tenant)
    stranger, _ = await key_factory("stranger", subject_id=uuid.uuid4())
    await ask(gw, owner, "scoped question")
    await settle(gw, 1)
    again, _ = await ask(gw, owner, "scoped question")
    assert again.headers["x-gateway-cache"] == "hit"
    resp, _ = await ask(gw, sibling, "scoped question")
    assert (resp.headers["x-gateway-cache"] == "hit") is sibling_hits
    resp, _ = await ask(gw, stranger, "scoped question")
    assert (resp.headers["x-gateway-cache"] == "hit") is stranger_hits


# ----------------------------------------------------------------------------- the key
_BASE: dict[str, Any] = {"max_tokens": 50, "messages": [
    {"role": "system", "content": "You are terse."}, {"role": "user", "content": "name a colour"},
]}
_CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("max_tokens", {"max_tokens": 51}),
    ("top_p", {"top_p": 0.5}),
    ("stop", {"stop": ["\n"]}),
    ("seed", {"seed": 7}),
    ("presence_penalty", {"presence_penalty": 0.1}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("n", {"n": 2}),
    ("system prompt", {"messages": [
        {"role": "system", "content": "You are verbose."}, {"role": "user", "content": "name a colour"}]}),
    ("earlier turn", {"messages": [
        {"role": "system", "content": "You are terse."}, {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "name a colour"}]}),
    ("user message", {"messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "name a color"}]}),
]


@pytest.mark.parametrize(("what", "change"), _CHANGES, ids=[c[0] for c in _CHANGES])
def test_a_change_to_any_parameter_or_the_prompt_changes_the_key(what: str, change: dict[str, Any]) -> None:
    def key(body: dict[str, Any]) -> str:
        return exact_key(request_material("g", "g", "subject:x", False, {"temperature": 0, **body}))

    assert key({**_BASE, **change}) != key(_BASE), what


def test_equivalent_requests_share_a_key() -> None:
    def key(body: dict[str, Any], model: str = "g") -> str:
        return exact_key(request_material("g", model, "subject:x", False, body))

    base = key({"temperature": 0, **_BASE})
    same = [
        {**_BASE, "temperature": 0.0},  # 0.0 is 0
        {"messages": _BASE["messages"], "temperature": 0, "max_tokens": 50},  # key order
        {**_BASE, "temperature": 0, "n": 1, "top_p": 1, "frequency_penalty": 0, "stop": None},  # defaults, nulls
        {**_BASE, "temperature": 0, "user": "someone", "stream_options": {"include_usage": True}},  # not shaping
        {**_BASE, "temperature": 0, "messages": [  # one text part is the plain string
            {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
            {"role": "user", "content": "name a colour", "name": None}]},
    ]
    for body in same:
        assert key(body) == base, body
    assert key({"temperature": 0, **_BASE}, model="other") != base  # a wildcard group's upstream model
    assert exact_key(request_material("g", "g", "subject:y", False, {"temperature": 0, **_BASE})) != base
    assert exact_key(request_material("g", "g", "subject:x", True, {"temperature": 0, **_BASE})) != base


async def test_a_changed_parameter_misses_end_to_end(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    await ask(gw, api_key, "the question", max_tokens=20)
    await settle(gw, 1)
    for change in ({"max_tokens": 21}, {"seed": 1}, {"top_p": 0.9}):
        resp, _ = await ask(gw, api_key, "the question", **{"max_tokens": 20, **change})
        assert resp.headers["x-gateway-cache"] == "miss", change
    system = {"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "the question"}]}
    resp, _ = await ask(gw, api_key, "ignored", max_tokens=20, **system)
    assert resp.headers["x-gateway-cache"] == "miss"
    resp, _ = await ask(gw, api_key, "the question", max_tokens=20)
    assert resp.headers["x-gateway-cache"] == "hit"


# ----------------------------------------------------------------------------- eligibility
def test_only_explicit_greedy_decoding_is_deterministic() -> None:
    assert is_deterministic({"temperature": 0}) and is_deterministic({"temperature": 0.0})
    assert is_deterministic({"temperature": 0.7, "top_p": 0})
    assert not is_deterministic({}) and not is_deterministic({"temperature": 0.2})
    assert not is_deterministic({"temperature": False})


def test_cache_control_and_opt_in_headers() -> None:
    assert client_directives({}) == (False, True, True)
    assert client_directives({"Cache-Control": "no-store"}) == (False, False, False)
    assert client_directives({"Cache-Control": "max-age=0, no-cache"}) == (False, False, True)
    assert client_directives({"x-gateway-cache": "use"}) == (True, True, True)


async def test_sampled_requests_bypass_unless_the_group_allows_them(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    config = with_models(
        cached_config(fake.url),
        {"name": "loose", "deployments": [{"provider": "fake", "model": "mock-small"}],
         "cache": {"deterministic_only": False}},
    )
    gw = await gateway_factory(config_yaml=config)
    for _ in range(2):
        resp, _ = await ask(gw, api_key, "sampled", temperature=0.8)
        assert resp.headers["x-gateway-cache"] == "bypass"
        assert "x-gateway-cache-key" not in resp.headers
    resp, _ = await ask(gw, api_key, "no temperature", temperature=None)
    assert resp.headers["x-gateway-cache"] == "bypass"
    await ask(gw, api_key, "sampled", model="loose", temperature=0.8)
    await settle(gw, 1)
    resp, _ = await ask(gw, api_key, "sampled", model="loose", temperature=0.8)
    assert resp.headers["x-gateway-cache"] == "hit"
    assert gw.state.cache.counters.bypasses == 3


async def test_no_store_and_no_cache_are_honoured(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    resp, _ = await ask(gw, api_key, "q", headers={"Cache-Control": "no-store"})
    assert resp.headers["x-gateway-cache"] == "bypass"
    resp, first = await ask(gw, api_key, "q")
    assert resp.headers["x-gateway-cache"] == "miss"  # no-store kept nothing
    await settle(gw, 1)
    resp, fresh = await ask(gw, api_key, "q", headers={"Cache-Control": "no-cache"})
    assert resp.headers["x-gateway-cache"] == "bypass" and fresh != first  # a fresh answer ...
    await settle(gw, 2)
    resp, served = await ask(gw, api_key, "q")
    assert resp.headers["x-gateway-cache"] == "hit" and served == fresh  # ... that replaced the old one
    assert await upstream_calls(fake) == 3


async def test_a_client_may_opt_in_where_the_group_has_no_policy(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    resp, _ = await ask(gw, api_key, "plain", model="other-model")
    assert "x-gateway-cache" not in resp.headers  # caching off: not even looked at
    opt_in = {"x-gateway-cache": "use"}
    resp, _ = await ask(gw, api_key, "plain", model="other-model", headers=opt_in)
    assert resp.headers["x-gateway-cache"] == "miss"
    await settle(gw, 1)
    resp, _ = await ask(gw, api_key, "plain", model="other-model", headers=opt_in)
    assert resp.headers["x-gateway-cache"] == "hit"
    resp, _ = await ask(gw, api_key, "plain", model="other-model")
    assert "x-gateway-cache" not in resp.headers


async def test_operators_can_forbid_client_opt_in(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url, client_opt_in=False))
    resp, _ = await ask(gw, api_key, "plain", model="other-model", headers={"x-gateway-cache": "use"})
    assert "x-gateway-cache" not in resp.headers


# ----------------------------------------------------------------------------- bounds
async def test_entries_expire_after_their_ttl(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url, {"ttl_seconds": 1}))
    await ask(gw, api_key, "short lived")
    await settle(gw, 1)
    resp, _ = await ask(gw, api_key, "short lived")
    assert resp.headers["x-gateway-cache"] == "hit"
    await asyncio.sleep(1.05)
    resp, _ = await ask(gw, api_key, "short lived")
    assert resp.headers["x-gateway-cache"] == "miss"


async def test_the_byte_bound_evicts_the_least_recently_used(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url, max_bytes=2000))
    for n, word in enumerate(("alpha", "bravo"), start=1):
        await ask(gw, api_key, word)
        await settle(gw, n)
    resp, _ = await ask(gw, api_key, "alpha")  # alpha is now the most recently used
    assert resp.headers["x-gateway-cache"] == "hit"
    await asyncio.sleep(0.01)  # the Touch is a tell
    await ask(gw, api_key, "charlie")
    await settle(gw, 3)
    stats = gw.state.cache.stats()
    assert stats["bytes"] <= 2000 and stats["entries"] == 2 and stats["counters"]["evictions"] == 1
    resp, _ = await ask(gw, api_key, "alpha")
    assert resp.headers["x-gateway-cache"] == "hit"
    resp, _ = await ask(gw, api_key, "bravo")  # the least recently used went
    assert resp.headers["x-gateway-cache"] == "miss"


def _entry(key: str, size: int, expires_at: float = 2e9, subject: str = "s", group: str = "g") -> CacheEntry:
    return CacheEntry(key=key, scope="global", subject=subject, group=group, stream=False, body=b"x" * size,
                      content_type="application/json", created_at=0.0, expires_at=expires_at)


def test_byte_lru_bounds_expiry_and_selection() -> None:
    lru = ByteLRU(max_bytes=3 * (100 + 512))
    for key in "abc":
        assert lru.put(_entry(key, 100)) == []
    lru.touch("a")
    assert lru.put(_entry("d", 100)) == ["b"]
    assert list(lru.view) == ["c", "a", "d"] and lru.bytes == 3 * 612
    assert lru.put(_entry("huge", 10_000)) == []  # larger than the whole bound: not kept
    lru.put(_entry("old", 1, expires_at=1.0, subject="t", group="h"))
    assert lru.expire(now=2.0) == ["old"] and "old" not in lru.view
    assert sorted(lru.select(subject="s")) == ["a", "d"] and lru.select(group="h") == []


def test_entries_survive_their_wire_form() -> None:
    entry = CacheEntry(key="k", scope="subject:1", subject="1", group="g", stream=True,
                       body=b"data: {}\n\ndata: [DONE]\n\n", content_type="text/event-stream",
                       created_at=1.0, expires_at=2.0, response_id="r", model="m", finish_reasons=("stop",),
                       prompt_tokens=3, completion_tokens=4)
    assert decode_entry(encode_entry(entry)) == entry
    assert entry.events() == [b"data: {}\n\n", b"data: [DONE]\n\n"]
    assert decode_entry(b"garbage") is None and decode_entry(b'{"v": 99}\nbody') is None


def test_normalised_body_drops_what_does_not_shape_the_answer() -> None:
    assert normalised_body({"model": "m", "stream": True, "user": "u", "temperature": 1.0,
                            "messages": [{"role": "user", "content": "hi"}]}) == {
        "messages": [{"role": "user", "content": "hi"}]}


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(("cache", "message"), [
    ({"mode": "fuzzy"}, "models[0].cache.mode: expected one of exact, semantic"),
    ({"scope": "world"}, "models[0].cache.scope: expected one of key, subject, global"),
    ({"threshold": 1.5}, "models[0].cache.threshold: expected a value <= 1"),
    ({"threshold": 0.1}, "models[0].cache.threshold: expected a value >= 0.5"),
    ({"ttl_seconds": 0}, "models[0].cache.ttl_seconds: expected a value >= 1"),
    ({"tll_seconds": 5}, "models[0].cache.tll_seconds: unknown key"),
])
def test_bad_cache_policies_are_refused_with_their_path(tmp_path: Any, cache: Any, message: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(cached_config("http://127.0.0.1:1/v1", cache))
    settings = load_settings({"GATEWAY_CONFIG": str(path)})
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(settings, {})


def test_bad_cache_settings_are_refused_with_their_path(tmp_path: Any) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(cached_config("http://127.0.0.1:1/v1", semantic={"embedder": "nowhere"}))
    with pytest.raises(ConfigError, match=r"^cache\.semantic\.embedder: expected 'local' or a model name"):
        load_config(load_settings({"GATEWAY_CONFIG": str(path)}), {})
    path.write_text(cached_config("http://127.0.0.1:1/v1", max_bytes=-1))
    with pytest.raises(ConfigError, match=r"^cache\.max_bytes: expected a value >= 0"):
        load_config(load_settings({"GATEWAY_CONFIG": str(path)}), {})


# ----------------------------------------------------------------------------- /admin/cache
async def test_admin_cache_needs_the_admin_token(
    gateway_factory: Callable[..., Any], fake: FakeUpstream
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    resp = await gw.management.get("/admin/cache")
    assert resp.status == 403 and (await resp.json())["error"]["message"] == "admin API disabled"
    gw = await gateway_factory(config_yaml=cached_config(fake.url), env={"ADMIN_TOKEN": "s3cret-admin"})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-admin"}):
        resp = await gw.management.get("/admin/cache", headers=headers)
        assert resp.status == 401
    resp = await gw.management.delete("/admin/cache?all=true", headers={"Authorization": "Bearer nope"})
    assert resp.status == 401


async def test_admin_cache_shows_size_and_purges_by_key_subject_and_group(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, key_factory: Callable[..., Any]
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url), env={"ADMIN_TOKEN": "s3cret-admin"})
    admin = {"Authorization": "Bearer s3cret-admin"}
    tenant_a, tenant_b = uuid.uuid4(), uuid.uuid4()
    key_a, _ = await key_factory("a", subject_id=tenant_a)
    key_b, _ = await key_factory("b", subject_id=tenant_b)
    first, _ = await ask(gw, key_a, "one")
    await ask(gw, key_a, "two")
    await ask(gw, key_b, "three")
    await ask(gw, key_b, "four", model="other-model", headers={"x-gateway-cache": "use"})
    await settle(gw, 4)
    stats = await (await gw.management.get("/admin/cache", headers=admin)).json()
    assert stats["entries"] == 4 and stats["bytes"] > 0 and stats["counters"]["stores"] == 4
    assert stats["policies"]["cached"]["scope"] == "subject"

    resp = await gw.management.delete(f"/admin/cache?key={first.headers['x-gateway-cache-key']}", headers=admin)
    assert (await resp.json())["purged"] == {"memory": 1, "shared": 0}
    resp, _ = await ask(gw, key_a, "one")
    assert resp.headers["x-gateway-cache"] == "miss"
    await settle(gw, 5)

    resp = await gw.management.delete("/admin/cache?group=%2A", headers=admin)
    assert (await resp.json())["purged"]["memory"] == 1
    resp = await gw.management.delete(f"/admin/cache?subject={tenant_a}", headers=admin)
    assert (await resp.json())["purged"]["memory"] == 2
    resp, _ = await ask(gw, key_b, "three")
    assert resp.headers["x-gateway-cache"] == "hit"  # the other tenant's answers stay
    resp = await gw.management.delete("/admin/cache?all=true", headers=admin)
    assert (await resp.json())["purged"]["memory"] == 1
    assert (await (await gw.management.get("/admin/cache", headers=admin)).json())["entries"] == 0

    for bad in ("", "?subject=not-a-uuid", "?all=true&group=x", "?colour=red", "?key=k", "?all=false",
                "?group=", f"?key={first.headers['x-gateway-cache-key']}&group=g", "?group=a&group=b"):
        resp = await gw.management.delete(f"/admin/cache{bad}", headers=admin)
        assert resp.status == 400, bad


async def test_a_hit_is_a_ledger_row_marked_cache_with_zero_cost(
    gateway_factory: Callable[..., Any], fake: FakeUpstream, api_key: str, db_pool: Any
) -> None:
    gw = await gateway_factory(config_yaml=cached_config(fake.url))
    ids = [f"cache-ledger-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    first, _ = await ask(gw, api_key, headers={"x-request-id": ids[0]})
    await settle(gw, 1)
    second, _ = await ask(gw, api_key, headers={"x-request-id": ids[1]})
    assert (first.headers["x-gateway-cache"], second.headers["x-gateway-cache"]) == ("miss", "hit")
    assert await gw.state.billing.flush()
    rows = {r["request_id"]: r for r in await db_pool.fetch(
        "SELECT request_id, cost_source, cost_usd, prompt_tokens FROM usage_ledger WHERE request_id = ANY($1)", ids
    )}
    assert rows[ids[0]]["cost_source"] != "cache"
    assert rows[ids[1]]["cost_source"] == "cache" and rows[ids[1]]["cost_usd"] == 0
    assert rows[ids[1]]["prompt_tokens"] == rows[ids[0]]["prompt_tokens"] > 0
